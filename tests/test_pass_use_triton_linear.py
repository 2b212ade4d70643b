"""The `use_triton_linear` pass: before/after graphs of tiny models, device policy, registration.

"Before" is the base pipeline (normalize, paged_kv, prune_logits) plus the QKV / gate-up
merges; "after" adds the pass. On CPU `kiln::linear` runs F.linear, so the rewritten graph
must compute bit-identical logits. A graph captured on the meta device stands in for a
CUDA graph (the pass only asks whether the graph is on the CPU).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kiln.compiler.capture import INPUT_META_KEY
from kiln.compiler.pipeline import ModelGraph, build_model_graph
from kiln.passes import PassManager, op_counts
from kiln.passes import use_triton_linear as module
from kiln.passes.base import PassContext
from kiln.passes.fuse_common import CPU_FUSIONS_ENV
from kiln.passes.registry import create_pass
from kiln.compiler.pass_testing import random_weights, run_captured
from kiln.passes.use_triton_linear import UseTritonLinearPass
from kiln.passes.weight_transforms import apply_weight_transforms

BASE = ("normalize", "paged_kv", "merge_qkv", "merge_gate_up", "prune_logits")
LAYERS = 2  # tiny_models.COMMON
BLOCK_SIZE = 16
KILN_LINEAR = "kiln.linear.default"


def build(arch: str, dtype: torch.dtype = torch.float32, *extra, device: str = "cpu", base=BASE) -> ModelGraph:
    from tiny_models import tiny_config

    passes = [create_pass(n) for n in base] + list(extra)
    return build_model_graph(tiny_config(arch), dtype, device, block_size=BLOCK_SIZE, pass_manager=PassManager(passes))


def stats_of(graph: ModelGraph, name: str) -> dict[str, int]:
    return next(r.stats for r in graph.report.records if r.name == name)


def run(graph: ModelGraph, num_tokens: int = 8) -> torch.Tensor:
    """Logits of one prefill on seeded random weights (merged as the loader merges them),
    every row sampled so the LM head sees several rows."""
    weights = apply_weight_transforms(random_weights(graph.captured), graph.weight_transforms)
    return run_captured(graph.captured, BLOCK_SIZE, num_tokens, weights=weights, sample_all_rows=True)


# Per layer: llama qkv, o, gate_up, down (7 unmerged); mixtral qkv, o and the router (its
# experts are bmm over gathered weights, not parameter linears); plus the LM head.
@pytest.mark.parametrize("arch, base, expected", [
    ("llama", BASE, 4 * LAYERS + 1),
    ("llama", ("normalize", "paged_kv", "prune_logits"), 7 * LAYERS + 1),
    ("mixtral", BASE, 3 * LAYERS + 1),
    ("qwen2", BASE, 4 * LAYERS + 1),  # tied embeddings: the LM head reads embed_tokens
])
def test_replaces_every_parameter_projection(arch, base, expected):
    before = build(arch, base=base)
    after = build(arch, torch.float32, UseTritonLinearPass(on_cpu=True), base=base)
    assert stats_of(after, "use_triton_linear") == {"linear_replaced": expected}
    assert op_counts(before.graph_module)["aten.linear.default"] == expected
    counts = op_counts(after.graph_module)
    assert counts[KILN_LINEAR] == expected and counts["aten.linear.default"] == 0
    assert counts["aten.bmm.default"] == op_counts(before.graph_module)["aten.bmm.default"]
    for node in after.graph_module.graph.find_nodes(op="call_function", target=torch.ops.kiln.linear.default):
        assert node.args[1].meta[INPUT_META_KEY].startswith("param:") and "val" in node.meta


def test_keeps_the_merged_qkv_bias():
    after = build("qwen2", torch.float32, UseTritonLinearPass(on_cpu=True))
    biased = [n for n in after.graph_module.graph.find_nodes(op="call_function", target=torch.ops.kiln.linear.default)
              if n.args[2] is not None]
    assert len(biased) == LAYERS
    assert all(n.args[2].meta[INPUT_META_KEY].endswith("qkv_proj.bias") for n in biased)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rewritten_graph_computes_the_same_logits(arch, dtype):
    before, after = build(arch, dtype), build(arch, dtype, UseTritonLinearPass(on_cpu=True))
    ref, out = run(before), run(after)
    assert out.shape == ref.shape == (1, 8, 128)
    assert torch.equal(out, ref)


def test_leaves_activation_linears_alone():
    def f(x, w):
        return torch.ops.aten.linear.default(torch.ops.aten.linear.default(x, w), x[:, :4])

    gm = torch.fx.symbolic_trace(f)
    roles = {"x": "batch:input", "w": "param:w"}
    for node in gm.graph.find_nodes(op="placeholder"):
        node.meta[INPUT_META_KEY] = roles[node.name]
        node.meta["val"] = torch.empty(4, 4)
    assert UseTritonLinearPass(on_cpu=True)(gm, PassContext(config=None)) == {"linear_replaced": 1}
    gm.recompile()
    assert op_counts(gm)["aten.linear.default"] == 1 and op_counts(gm)[KILN_LINEAR] == 1


def test_cpu_graphs_are_left_alone_by_default_and_cuda_graphs_rewritten(monkeypatch):
    monkeypatch.delenv(CPU_FUSIONS_ENV, raising=False)
    cpu = build("llama", torch.bfloat16, UseTritonLinearPass())
    assert stats_of(cpu, "use_triton_linear") == {"skipped_on_cpu": 1}
    assert KILN_LINEAR not in op_counts(cpu.graph_module)
    # The default pipeline, on a non-CPU graph: every pass in its place, prune_logits first.
    device = build("llama", torch.bfloat16, device="meta", base=tuple(p.name for p in PassManager.default().passes))
    assert stats_of(device, "prune_logits") == {"lm_head_pruned": 1}
    assert stats_of(device, "use_triton_linear") == {"linear_replaced": 4 * LAYERS + 1}
    monkeypatch.setenv(CPU_FUSIONS_ENV, "1")
    assert UseTritonLinearPass().on_cpu


def test_registered_last_and_uuid_covers_options_and_source(monkeypatch):
    p = create_pass("use_triton_linear")
    assert isinstance(p, UseTritonLinearPass) and p.phase == "logits"
    names = [q.name for q in PassManager.default().passes]
    assert names.index("use_triton_linear") > names.index("prune_logits")
    assert UseTritonLinearPass(on_cpu=True).uuid() != UseTritonLinearPass(on_cpu=False).uuid()
    before = UseTritonLinearPass(on_cpu=False).uuid()
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: real(obj) + ("\n# edited" if obj is module else ""))
    assert UseTritonLinearPass(on_cpu=False).uuid() != before
