"""The `prefetch_weights` pass: before/after graphs of tiny models, device policy, registration.

"Before" is the default pipeline without the pass; "after" adds it. A graph captured on the
meta device stands in for a CUDA graph (the pass only asks whether the graph is on the CPU).
On CPU the prefetch hint changes nothing, so a rewritten CPU graph computes the same logits.
"""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.capture import INPUT_META_KEY
from kiln.compiler.pass_testing import random_weights, run_captured
from kiln.compiler.pipeline import ModelGraph, build_model_graph
from kiln.passes import PassManager
from kiln.passes.fuse_common import CPU_FUSIONS_ENV
from kiln.passes.prefetch_weights import PrefetchWeightsPass
from kiln.passes.registry import create_pass
from kiln.passes.weight_transforms import apply_weight_transforms

LAYERS = 2  # tiny_models.COMMON
BLOCK_SIZE = 16
PROJECTIONS = (torch.ops.kiln.linear.default, torch.ops.kiln.fp8_linear.default)


def build(arch: str, *, device: str = "meta", with_pass: bool = True, fp8: bool = False,
          dtype: torch.dtype = torch.bfloat16) -> ModelGraph:
    from tiny_models import tiny_config

    names = [p.name for p in PassManager.default(enable=["quantize_fp8"] if fp8 else None).passes]
    passes = [create_pass(n) for n in names if n != "prefetch_weights"]
    if with_pass:
        passes.append(PrefetchWeightsPass(on_cpu=True))
    return build_model_graph(tiny_config(arch), dtype, device, block_size=BLOCK_SIZE, pass_manager=PassManager(passes))


def stats_of(graph: ModelGraph, name: str) -> dict[str, int]:
    return next(r.stats for r in graph.report.records if r.name == name)


def projections(graph: ModelGraph) -> list[torch.fx.Node]:
    return [n for n in graph.graph_module.graph.nodes if n.op == "call_function" and n.target in PROJECTIONS]


def weight_of(node: torch.fx.Node) -> torch.fx.Node:
    return node.args[1] if node.target is torch.ops.kiln.linear.default else node.args[2]


@pytest.mark.parametrize("fp8", [False, True])
def test_each_projection_prefetches_the_next_ones_weight(fp8):
    graph = build("llama", fp8=fp8)
    nodes = projections(graph)
    # qkv, o, gate/up, down a layer, then the LM head: one chain, the LM head at its end.
    assert len(nodes) == 4 * LAYERS + 1
    assert stats_of(graph, "prefetch_weights") == {"prefetch_linked": 4 * LAYERS, "prefetch_blocked": 0}
    for node, following in zip(nodes, nodes[1:]):
        assert node.kwargs["prefetch"] is weight_of(following)
    assert "prefetch" not in nodes[-1].kwargs
    assert weight_of(nodes[-1]).meta[INPUT_META_KEY] == "param:lm_head.weight"
    if fp8:  # the decoder layers' projections are FP8 GEMMs, the LM head is not
        assert [n.target for n in nodes].count(torch.ops.kiln.fp8_linear.default) == 4 * LAYERS


def test_an_moe_block_between_two_projections_blocks_the_link():
    graph = build("mixtral")
    nodes = projections(graph)
    # qkv, o and the router a layer, then the LM head; each layer's experts (fused_moe reads
    # them) sit between its router and the next layer's qkv.
    assert len(nodes) == 3 * LAYERS + 1
    assert stats_of(graph, "prefetch_weights") == {"prefetch_linked": 2 * LAYERS, "prefetch_blocked": LAYERS}
    routers = [n for n in nodes if weight_of(n).meta[INPUT_META_KEY].endswith("mlp.gate.weight")]
    assert len(routers) == LAYERS and all("prefetch" not in n.kwargs for n in routers)


def test_cpu_graphs_are_left_alone_by_default(monkeypatch):
    monkeypatch.delenv(CPU_FUSIONS_ENV, raising=False)
    graph = build("llama", device="cpu", with_pass=False)
    p = PrefetchWeightsPass()
    assert p(graph.graph_module, None) == {"skipped_on_cpu": 1}
    assert not any("prefetch" in n.kwargs for n in projections(graph))


def test_the_hint_changes_no_logit(monkeypatch):
    monkeypatch.setenv(CPU_FUSIONS_ENV, "1")  # the projections as kiln ops on CPU too

    def logits(graph: ModelGraph) -> torch.Tensor:
        weights = apply_weight_transforms(random_weights(graph.captured), graph.weight_transforms)
        return run_captured(graph.captured, BLOCK_SIZE, 8, weights=weights, sample_all_rows=True)

    before = build("llama", device="cpu", with_pass=False, dtype=torch.float32)
    after = build("llama", device="cpu", dtype=torch.float32)
    assert stats_of(after, "prefetch_weights")["prefetch_linked"] > 0
    assert torch.equal(logits(after), logits(before))


def test_registered_last_in_the_default_pipeline():
    p = create_pass("prefetch_weights")
    assert isinstance(p, PrefetchWeightsPass) and p.phase == "logits"
    for enable in (None, ["quantize_fp8"]):
        names = [q.name for q in PassManager.default(enable=enable).passes]
        assert names[-1] == "prefetch_weights"
    assert PrefetchWeightsPass(on_cpu=True).uuid() != PrefetchWeightsPass(on_cpu=False).uuid()
