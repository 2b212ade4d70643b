"""kiln.passes.pattern: two plain functions -> the captured graph's IR -> a rewrite."""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny_models import COMMON, tiny_config

from kiln.passes import PassContext, op_counts
from kiln.passes.pattern import Pattern, PatternError, PatternPass, trace_function
from kiln.compiler.pass_testing import capture_through, run_graph

EXAMPLE = (torch.randn(2, 8, 64), torch.randn(64), 1e-6)


def rms_norm(x, w, eps):  # as transformers' LlamaRMSNorm computes it
    v = x.to(torch.float32)
    v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    return w * v.to(x.dtype)


def rms_norm_by_division(x, w, eps):  # same value, different ops: shows the rewrite happened
    v = x.to(torch.float32)
    return w * (v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def call_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.fixture(scope="module")
def llama_fusion_input():
    """The tiny Llama's graph as a fusion pass receives it (after normalize and paged_kv)."""
    return capture_through(tiny_config("llama"), "fusion")


def test_pattern_traces_to_the_captured_ir() -> None:
    p = Pattern("rms_norm", rms_norm, rms_norm_by_division, EXAMPLE)
    fp32 = p.traced(torch.float32).pattern
    assert call_ops(fp32) == ["aten.pow.Tensor_Scalar", "aten.mean.dim", "aten.add.Tensor", "aten.rsqrt.default",
                              "aten.mul.Tensor", "aten.mul.Tensor"]  # no-op casts stripped, like normalize does
    bf16 = p.traced(torch.bfloat16).pattern
    assert call_ops(bf16).count("aten.to.dtype") == 2  # real casts kept
    assert "aten._assert_tensor_metadata.default" not in call_ops(bf16)
    placeholders = list(fp32.graph.find_nodes(op="placeholder"))
    assert [n.name for n in placeholders] == ["x", "w", "eps"]
    add = next(n for n in fp32.graph.nodes if n.target == torch.ops.aten.add.Tensor)
    assert add.args[1] is placeholders[2]  # the scalar is a wildcard, not the literal 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewrites_every_norm_and_keeps_the_numbers(dtype: torch.dtype) -> None:
    before = capture_through(tiny_config("llama"), "fusion", dtype=dtype)
    after = before.copy()
    p = Pattern("rms_norm", rms_norm, rms_norm_by_division, EXAMPLE)
    n = p.apply(after.graph_module, dtype=dtype)
    layers = before.captured.config.num_hidden_layers
    assert n == 2 * layers + 1  # two norms per layer and the final one
    counts = op_counts(after.graph_module)
    assert counts["aten.rsqrt.default"] == 0 and counts["aten.sqrt.default"] == n
    new = [x for x in after.graph_module.graph.nodes if x.target == torch.ops.aten.sqrt.default]
    assert all(x.meta["val"].dtype == torch.float32 for x in new)  # fake values propagated
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(run_graph(after).float(), run_graph(before).float(), atol=tol, rtol=tol)


def test_scalar_input_binds_the_matched_value() -> None:
    config = transformers.LlamaConfig(**COMMON, rms_norm_eps=3e-5)
    graph = capture_through(config, "fusion")
    p = Pattern("rms_norm", rms_norm, rms_norm_by_division, EXAMPLE)  # traced with eps=1e-6
    assert p.apply(graph.graph_module, dtype=torch.float32) == 5
    adds = [n for n in graph.graph_module.graph.nodes
            if n.target == torch.ops.aten.add.Tensor and n.users and next(iter(n.users)).target == torch.ops.aten.sqrt.default]
    assert len(adds) == 5 and all(a.args[1] == 3e-5 for a in adds)


def test_multi_output_pattern(llama_fusion_input) -> None:
    """Residual add + norm: both the sum (the next residual) and the norm are outputs."""
    def add_rms_norm(x, residual, w, eps):
        h = residual + x
        return rms_norm(h, w, eps), h

    def add_rms_norm_replacement(x, residual, w, eps):
        h = torch.add(residual, x)
        return rms_norm_by_division(h, w, eps), h

    graph = llama_fusion_input.copy()
    p = Pattern("add_rms_norm", add_rms_norm, add_rms_norm_replacement,
                (torch.randn(2, 8, 64), torch.randn(2, 8, 64), torch.randn(64), 1e-6))
    # layer 0's input norm has no residual add before it; every other norm does
    assert p.apply(graph.graph_module, dtype=torch.float32) == 2 * graph.captured.config.num_hidden_layers
    torch.testing.assert_close(run_graph(graph), run_graph(llama_fusion_input), atol=1e-5, rtol=1e-5)


def test_replacement_reads_sizes_at_run_time(llama_fusion_input) -> None:
    """The replacement is traced with dynamic shapes: x.shape becomes sym_size, not 8."""
    def flat_norm(x, w, eps):
        rows = x.reshape(-1, x.shape[-1])
        return rms_norm(rows, w, eps).reshape(x.shape)

    graph = llama_fusion_input.copy()
    p = Pattern("rms_norm", rms_norm, flat_norm, EXAMPLE)
    assert p.apply(graph.graph_module, dtype=torch.float32) == 5
    assert op_counts(graph.graph_module)["aten.sym_size.int"] > 1
    for tokens in (3, 11):  # neither is the example's 8
        torch.testing.assert_close(run_graph(graph, num_tokens=tokens),
                                   run_graph(llama_fusion_input, num_tokens=tokens), atol=1e-5, rtol=1e-5)


def test_where_filter_can_refuse(llama_fusion_input) -> None:
    graph = llama_fusion_input.copy()
    only_final = Pattern("rms_norm", rms_norm, rms_norm_by_division, EXAMPLE,
                         where=lambda m: m.inputs["w"].meta["kiln_input"] == "param:model.norm.weight")
    assert len(only_final.find(graph.graph_module, dtype=torch.float32)) == 1
    assert only_final.apply(graph.graph_module, dtype=torch.float32) == 1
    assert op_counts(graph.graph_module)["aten.rsqrt.default"] == 4


def test_pattern_pass_stats_and_uuid(llama_fusion_input) -> None:
    class SqrtNorm(PatternPass):
        name = "sqrt_norm"
        phase = "fusion"
        patterns = (Pattern("rms_norm", rms_norm, rms_norm_by_division, EXAMPLE),)

    class SqrtNormWider(SqrtNorm):
        patterns = (Pattern("rms_norm", rms_norm, rms_norm_by_division, (torch.randn(2, 8, 32), torch.randn(32), 1e-6)),)

    def other_replacement(x, w, eps):
        return rms_norm(x, w, eps) * 1.0

    class OtherReplacement(SqrtNorm):
        patterns = (Pattern("rms_norm", rms_norm, other_replacement, EXAMPLE),)

    graph = llama_fusion_input.copy()
    assert SqrtNorm()(graph.graph_module, PassContext(config=graph.captured.config)) == {"rms_norm": 5}
    uuids = {SqrtNorm().uuid(), SqrtNormWider().uuid(), OtherReplacement().uuid()}
    assert len(uuids) == 3 and SqrtNorm().uuid() == SqrtNorm().uuid()


def test_bad_patterns_fail_with_a_clear_error() -> None:
    with pytest.raises(PatternError, match="takes 3 inputs .* but 2 example inputs"):
        Pattern("p", rms_norm, rms_norm, EXAMPLE[:2])
    with pytest.raises(PatternError, match="'flag' is a bool"):
        Pattern("p", lambda x, flag: x, lambda x, flag: x, (torch.randn(2), True))
    with pytest.raises(PatternError, match="input 'unused' is not used"):
        Pattern("p", lambda x, unused: x.relu(), lambda x, unused: x.relu(), (torch.randn(2), torch.randn(2))).traced()
    with pytest.raises(PatternError, match="scalar inputs must reach ops unchanged"):
        Pattern("p", lambda x, eps: x + eps * 2, lambda x, eps: x + eps * 2, (torch.randn(2), 1e-6)).traced()
    with pytest.raises(PatternError, match="returns 1 values but the replacement returns 2"):
        Pattern("p", lambda x: x.relu(), lambda x: (x.relu(), x.sin()), (torch.randn(2),)).traced()
    with pytest.raises(PatternError, match="replacement takes 1 inputs but the pattern takes 2"):
        Pattern("p", lambda x, y: x * y, lambda x: x, (torch.randn(2), torch.randn(2)))


def test_trace_function_matches_a_hand_traced_graph() -> None:
    gm = trace_function(lambda gate, up: torch.nn.functional.silu(gate) * up, [torch.randn(4, 8), torch.randn(4, 8)])
    assert call_ops(gm) == ["aten.silu.default", "aten.mul.Tensor"]


def silu_mul(gate, up):
    return torch.nn.functional.silu(gate) * up


def test_replacement_of_another_shape_is_refused(llama_fusion_input, caplog) -> None:
    """Issue 21: a replacement traced at 2-D that slices the last dimension slices the token
    dimension of the 3-D graph; the shape check refuses it and the rank warning says why."""
    def sliced(gate, up):
        return (torch.nn.functional.silu(gate) * up)[..., :1]

    gm = llama_fusion_input.copy().graph_module
    graph_before = str(gm.graph)
    p = Pattern("silu_mul_sliced", silu_mul, sliced, (torch.randn(4, 32), torch.randn(4, 32)))
    with caplog.at_level("WARNING", logger="kiln.passes.pattern"), pytest.raises(PatternError) as e:
        p.apply(gm)
    msg = str(e.value)
    assert "replacement output 0 has shape (1, 1, 128)" in msg and "(1, s" in msg and "mul" in msg
    assert "ranks {'gate': 2, 'up': 2}" in msg and "{'gate': 3, 'up': 3}" in msg
    assert any("example input 'gate' is 2-D" in r.getMessage() and "3-D" in r.getMessage() for r in caplog.records)
    assert str(gm.graph) == graph_before  # the first match is where it stopped: nothing was rewritten


def test_replacement_of_another_dtype_is_refused(llama_fusion_input) -> None:
    def to_half(gate, up):
        return (torch.nn.functional.silu(gate) * up).to(torch.float16)

    gm = llama_fusion_input.copy().graph_module
    p = Pattern("silu_mul_half", silu_mul, to_half, (torch.randn(1, 4, 32), torch.randn(1, 4, 32)))
    with pytest.raises(PatternError, match=r"dtype float16 where the matched node .* dtype float32"):
        p.apply(gm)


def test_an_elementwise_replacement_fits_any_rank_without_a_warning(llama_fusion_input, caplog) -> None:
    """kiln::silu_and_mul indexes nothing by position: 2-D examples matching the 3-D graph (and
    Mixtral's 2-D expert rows matching fuse_silu_mul's 3-D examples) rewrite correctly, silently."""
    gm = llama_fusion_input.copy().graph_module
    p = Pattern("silu_mul_2d", silu_mul, lambda gate, up: torch.ops.kiln.silu_and_mul(gate, up),
                (torch.randn(4, 32), torch.randn(4, 32)))
    with caplog.at_level("WARNING", logger="kiln.passes.pattern"):
        assert p.apply(gm) == COMMON["num_hidden_layers"]
    assert not [r for r in caplog.records if r.name == "kiln.passes.pattern"]


def test_same_rank_examples_do_not_warn(llama_fusion_input, caplog) -> None:
    gm = llama_fusion_input.copy().graph_module
    p = Pattern("silu_mul_3d", silu_mul, lambda gate, up: torch.nn.functional.silu(gate) * up,
                (torch.randn(1, 4, 32), torch.randn(1, 4, 32)))
    with caplog.at_level("WARNING", logger="kiln.passes.pattern"):
        assert p.apply(gm) == COMMON["num_hidden_layers"]
    assert not [r for r in caplog.records if r.name == "kiln.passes.pattern"]
