"""The match report: for a pattern that does not match, the closest candidate and where it diverged."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import tiny_config

from kiln.passes.match_report import explain_pattern
from kiln.passes.pattern import Pattern
from kiln.compiler.pass_testing import capture_through

X, W, EPS = torch.randn(2, 8, 64), torch.randn(64), 1e-6


@pytest.fixture(scope="module")
def graph():
    return capture_through(tiny_config("llama"), "fusion").graph_module


def node_where(gm: torch.fx.GraphModule, target, first_arg_role: str) -> torch.fx.Node:
    """The graph node calling `target` whose first argument is the input with that role."""
    for n in gm.graph.nodes:
        if n.target == target and isinstance(n.args[0], torch.fx.Node) and n.args[0].meta.get("kiln_input") == first_arg_role:
            return n
    raise LookupError(first_arg_role)


def test_correct_pattern_reports_its_matches(graph) -> None:
    def rms_norm(x, w, eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    report = Pattern("rms_norm", rms_norm, rms_norm, (X, W, EPS)).explain(graph, dtype=torch.float32)
    assert report.matched and report.num_matches == 5 and report.divergence is None
    assert len(report.matches) == 5 and all(len(m) == 6 for m in report.matches)


def test_swapped_operands_name_the_diverging_node(graph) -> None:
    """Deliberately mis-written: `normed * w`, while transformers computes `w * normed`."""
    def rms_norm_swapped(x, w, eps):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * w

    report = explain_pattern(Pattern("rms_norm", rms_norm_swapped, rms_norm_swapped, (X, W, EPS)), graph, torch.float32)
    assert not report.matched
    weight_mul = node_where(graph, torch.ops.aten.mul.Tensor, "param:model.layers.0.input_layernorm.weight")
    d = report.divergence
    assert d.kind == "user" and d.pattern_node == "mul_1" and d.graph_node == weight_mul.name
    assert "argument 0" in d.detail and "operand order" in d.detail
    assert report.closest.size == 5  # pow, mean, add, rsqrt and the first mul line up
    text = str(report)
    assert f"vs graph node '{weight_mul.name}'" in text and f"> {weight_mul.name} = aten.mul.Tensor(" in text


def test_wrong_literal_names_the_argument(graph) -> None:
    def rms_norm_fixed_eps(x, w):  # eps written in, and wrong for this model (1e-6)
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))

    report = Pattern("rms_norm", rms_norm_fixed_eps, rms_norm_fixed_eps, (X, W)).explain(graph, dtype=torch.float32)
    d = report.divergence
    assert d.kind == "arg" and d.pattern_op == "aten.add.Tensor"
    graph_add = next(n for n in graph.graph.nodes if n.name == d.graph_node)
    assert graph_add.target == torch.ops.aten.add.Tensor and graph_add.args[1] == 1e-6
    assert "argument 1 (other)" in d.detail and "1e-05" in d.detail and "1e-06" in d.detail


def test_wrong_op_is_named_with_both_ops(graph) -> None:
    def rms_norm_sqrt(x, w, eps):
        return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    report = Pattern("rms_norm", rms_norm_sqrt, rms_norm_sqrt, (X, W, EPS)).explain(graph, dtype=torch.float32)
    assert set(report.missing_ops) == {"aten.div.Tensor", "aten.sqrt.default"}
    d = report.divergence
    assert d.kind == "user" and d.pattern_op == "aten.sqrt.default"
    assert "rsqrt" in d.detail  # the op the graph has instead


def test_missing_cast_in_bfloat16(graph) -> None:
    """Written without the float32 upcast: in a bfloat16 graph the casts are real ops."""
    def rms_norm_no_cast(x, w, eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    bf16 = capture_through(tiny_config("llama"), "fusion", dtype=torch.bfloat16).graph_module
    report = Pattern("rms_norm", rms_norm_no_cast, rms_norm_no_cast, (X, W, EPS)).explain(bf16, dtype=torch.bfloat16)
    assert not report.matched
    assert "aten.to.dtype" in report.divergence.detail


def test_inner_value_used_outside(graph) -> None:
    """A pattern whose inner node has a user outside the match cannot be replaced."""
    def residual_mean_square(x, residual):
        h = residual + x
        return h.pow(2).mean(-1, keepdim=True)

    report = Pattern("rms", residual_mean_square, residual_mean_square, (X, X)).explain(graph, dtype=torch.float32)
    d = report.divergence
    assert not report.matched and d.kind == "escapes" and d.pattern_node == "add"
    assert "Return this value from the pattern" in d.detail


def test_report_is_plain_data(graph) -> None:
    def relu_mul(x, y):
        return torch.relu(x) * y

    report = Pattern("relu_mul", relu_mul, relu_mul, (X, X)).explain(graph, dtype=torch.float32)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["matched"] is False and data["missing_ops"] == ["aten.relu.default"]
    assert "aten.relu.default" in str(report)


def test_swapped_commutative_operands_rank_by_the_rarest_op() -> None:
    """Issue 21: `up * silu(gate)` against the model's `silu(gate) * up`: the closest candidate
    is at the MLP's silu (the pattern's rarest op), not at some other multiply (RoPE's, the
    norms'), it says the operand order differs, and the next candidates are listed."""
    from kiln.compiler.pass_testing import graph_for_pass

    def up_times_silu(gate, up):
        return up * torch.nn.functional.silu(gate)

    graph = graph_for_pass(tiny_config("llama"), "fuse_silu_mul").graph_module
    report = explain_pattern(Pattern("silu_mul", up_times_silu, up_times_silu,
                                     (torch.randn(1, 4, 32), torch.randn(1, 4, 32))), graph, torch.float32)
    assert not report.matched
    silu = {n.name for n in graph.graph.find_nodes(op="call_function", target=torch.ops.aten.silu.default)}
    assert report.closest.pairs[0][1] in silu
    d = report.divergence
    assert d.kind in ("user", "order") and "operand order differs" in d.detail
    assert len(report.others) == 3 and all(c.size <= report.closest.size for c in report.others)
    text = str(report)
    assert "next candidates:" in text and text.count(" ops from graph node ") == 3
    assert len(json.loads(json.dumps(report.to_dict()))["others"]) == 3


def test_order_divergence_at_the_commutative_op() -> None:
    """Anchored at the multiply itself, the walk says which operands are swapped."""
    from kiln.passes.match_report import _Walk
    from kiln.passes.pattern import trace_function

    def model(gate, up):
        return torch.nn.functional.silu(gate) * up

    gm = trace_function(model, [torch.randn(1, 4, 8), torch.randn(1, 4, 8)])
    p = Pattern("swapped", lambda gate, up: up * torch.nn.functional.silu(gate), model,
                (torch.randn(1, 4, 8), torch.randn(1, 4, 8)))
    traced = p.traced(torch.float32)
    pmul = next(iter(traced.pattern.graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)))
    gmul = next(iter(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.mul.Tensor)))
    returning = set(next(iter(traced.pattern.graph.find_nodes(op="output"))).all_input_nodes)
    cand = _Walk(traced.pattern.graph, returning).run(pmul, gmul)
    assert cand.divergence.kind == "order" and "the other way round" in cand.divergence.detail
    assert "swap them in the pattern" in cand.divergence.detail
