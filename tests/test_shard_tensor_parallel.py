"""The tensor-parallel sharding pass, before -> after: the graph one rank runs (shards,
collectives, shapes), and numerically: two ranks over gloo, each running its own graph on
its slices of the same weights, give the logits of the unsharded graph."""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.compiler.pass_testing import capture_through, graph_for_pass, run_graph
from kiln.passes.manager import op_counts
from kiln.passes.shard_tensor_parallel import TP_ARCHITECTURES, ShardTensorParallelPass, check_tp_size
from kiln.passes.weight_transforms import ShardWeight, transforms_from_json, transforms_to_json

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import SUPPORTED, tiny_config  # noqa: E402

# Every tiny model of an architecture the pass shards (variants such as llama3.1 included);
# "llama-kv1" has one KV head, fewer than the two ranks (replicated).
TP_TEST_ARCHS = [a for a in SUPPORTED if tiny_config(a).model_type in TP_ARCHITECTURES] + ["llama-kv1"]


def config_for(arch: str):
    if arch == "llama-kv1":
        config = tiny_config("llama")
        config.num_key_value_heads = 1
        return config
    return tiny_config(arch)


def test_tp1_changes_nothing() -> None:
    before = graph_for_pass(tiny_config("llama"), "shard_tensor_parallel")
    after = before.copy()
    assert after.run_pass(ShardTensorParallelPass()) == {"tp_size": 1}
    assert after.graph_module.code == before.graph_module.code
    assert after.context.weight_transforms == []


def test_rank_graph_is_sharded() -> None:
    config = tiny_config("llama")  # 4 heads, 2 KV heads of 16, intermediate 128, vocab 128
    before = graph_for_pass(config, "shard_tensor_parallel")
    after = before.copy()
    after.context.tp_size, after.context.tp_rank = 2, 1
    stats = after.run_pass(ShardTensorParallelPass())
    layers = config.num_hidden_layers
    # q, k, v, gate, up per layer; o and down per layer; embedding and LM head.
    assert stats["column_parallel"] == 5 * layers and stats["row_parallel"] == 2 * layers
    assert stats["vocab_parallel"] == 2
    counts = op_counts(after.graph_module)
    assert counts["kiln.all_reduce.default"] == 2 * layers + 1  # o, down, embedding
    assert counts["kiln.all_gather.default"] == 1  # LM head
    shards = {t.name: t for t in after.context.weight_transforms}
    assert shards["model.layers.0.self_attn.q_proj.weight"] == ShardWeight(
        "model.layers.0.self_attn.q_proj.weight", 0, ((32, 64),), 32)  # heads 2, 3 of 4
    assert shards["model.layers.0.self_attn.k_proj.weight"].ranges == ((16, 32),)  # KV head 1 of 2
    assert shards["model.layers.0.self_attn.o_proj.weight"].dim == 1
    assert shards["model.layers.0.mlp.down_proj.weight"].ranges == ((64, 128),)
    assert shards["model.embed_tokens.weight"].ranges == ((64, 128),)
    # Later passes see the rank's shapes: the KV cache holds one head of 16.
    k = next(iter(after.graph_module.graph.find_nodes(op="call_function",
                                                        target=torch.ops.kiln.attention.default))).args[1]
    assert tuple(k.meta["val"].shape[1:]) == (1, 16)
    assert transforms_from_json(transforms_to_json(after.context.weight_transforms)) == after.context.weight_transforms


def test_refusals_are_clear() -> None:
    with pytest.raises(ValueError, match="does not shard 'gpt2'"):
        check_tp_size(tiny_config("gpt2"), 2)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        check_tp_size(tiny_config("llama"), 3)


def test_a_norm_over_all_heads_is_refused_not_miscomputed() -> None:
    """OLMo2 normalises q over all heads at once: a rank cannot compute that alone, and the
    shape propagation says so (the pass names the node) rather than producing wrong logits."""
    before = graph_for_pass(tiny_config("olmo2"), "shard_tensor_parallel")
    after = before.copy()
    after.context.tp_size = 2
    import kiln.passes.shard_tensor_parallel as stp

    stp.TP_ARCHITECTURES["olmo2"] = "probe: not supported"
    try:
        with pytest.raises(ValueError, match="cannot take the sharded shapes"):
            after.run_pass(ShardTensorParallelPass())
    finally:
        del stp.TP_ARCHITECTURES["olmo2"]


def _rank_logits(rank: int, world: int, init_file: str, archs: list[str], out_dir: str) -> None:
    """One rank: each architecture's graph of this rank, run on its slices of the seeded
    weights; logits (or the error) saved per architecture."""
    import traceback

    # A timeout: a failure on one rank alone must not leave the other waiting for 30 minutes.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        for arch in archs:
            try:
                graph = capture_through(config_for(arch), "logits", inclusive=True, tp_size=world, tp_rank=rank)
                result: object = run_graph(graph, num_tokens=11, sample_all_rows=True)
            except Exception:
                result = traceback.format_exc()  # the same on both ranks: no collective is left waiting
            torch.save(result, os.path.join(out_dir, f"{arch}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_logits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both ranks' logits for every architecture, from one pair of processes (starting a
    pair per architecture cost more than the runs)."""
    out = tmp_path_factory.mktemp("tp2")
    mp.start_processes(_rank_logits, args=(2, str(out / "init"), TP_TEST_ARCHS, str(out)), nprocs=2,
                       start_method="spawn")
    return out


@pytest.mark.parametrize("arch", TP_TEST_ARCHS)
def test_two_ranks_match_the_unsharded_graph(arch: str, two_rank_logits: Path) -> None:
    expected = run_graph(capture_through(config_for(arch), "logits", inclusive=True), num_tokens=11,
                         sample_all_rows=True)
    for rank in range(2):
        got = torch.load(two_rank_logits / f"{arch}-rank{rank}.pt", weights_only=False)
        assert isinstance(got, torch.Tensor), f"rank {rank} failed:\n{got}"
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
