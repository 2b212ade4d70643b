"""The tensor-parallel sharding pass, before -> after: the graph one rank runs (shards,
collectives, shapes), and numerically: two ranks over gloo, each running its own graph on
its slices of the same weights, give the logits of the unsharded graph."""

from __future__ import annotations

import copy
import datetime
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.compiler.pass_testing import PhaseCapture, graph_for_pass, run_graph
from kiln.passes.base import PassContext
from kiln.passes.manager import PassManager, op_counts
from kiln.passes.registry import PHASES
from kiln.passes import shard_tensor_parallel as shard_tp
from kiln.passes.shard_tensor_parallel import TP_ARCHITECTURES, ShardTensorParallelPass, check_tp_size
from kiln.passes.weight_transforms import ShardWeight, transforms_from_json, transforms_to_json
from kiln.runtime.hardware_defaults import CPU_LIMITS

sys.path.insert(0, str(Path(__file__).parent))
from shared_capture import shared_capture  # noqa: E402
from tiny_models import SUPPORTED, tiny_config  # noqa: E402

def _shards_two_ways(arch: str) -> bool:
    """The architecture is one the pass shards, and its tiny config is not one `check_tp_size`
    refuses (Falcon-H1's with its grouped gated norm)."""
    config = tiny_config(arch)
    if config.model_type not in TP_ARCHITECTURES:
        return False
    try:
        check_tp_size(config, 2)
    except ValueError:
        return False
    return True


# Every tiny model of an architecture the pass shards (variants such as llama3.1 included);
# "llama-kv1" has one KV head, fewer than the two ranks (replicated).
TP_TEST_ARCHS = [a for a in SUPPORTED if _shards_two_ways(a)] + ["llama-kv1", "granite-g1"]


def config_for(arch: str):
    if arch == "llama-kv1":
        config = tiny_config("llama")
        config.num_key_value_heads = 1
        return config
    if arch == "granite-g1":  # one group of B and C (Granite 4.0-H's): replicated, its norm over every head
        config = tiny_config("granitemoehybrid")
        config.mamba_n_groups = 1
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
    unsupported = tiny_config("llama")
    unsupported.model_type = "made_up"
    with pytest.raises(ValueError, match="does not shard 'made_up'"):
        check_tp_size(unsupported, 2)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads"):
        check_tp_size(tiny_config("llama"), 3)
    # Laguna's query heads per layer ([4, 8, 4] in its tiny model): each layer's must split.
    laguna = tiny_config("laguna")
    check_tp_size(laguna, 4)
    laguna.num_attention_heads_per_layer = [4, 6, 4]
    with pytest.raises(ValueError, match="does not divide the 6 attention heads of layer 1"):
        check_tp_size(laguna, 4)


def test_modules_named_by_their_parent_take_their_roles() -> None:
    """CTRL's Sequential ffn (`ffn.0`, `ffn.2`) and ModernBERT's two `Wo` (attention's and the
    MLP's) shard as the projections they are; ModernBERT's prediction head before the LM head
    stays whole on every rank (the two-rank parity below checks the numbers)."""
    for arch, column, row, whole in (
            ("ctrl", "transformer.h.0.ffn.0.weight", "transformer.h.0.ffn.2.weight", None),
            ("modernbert-decoder", "model.layers.0.mlp.Wi.weight", "model.layers.0.attn.Wo.weight",
             "lm_head.dense.weight")):
        after = graph_for_pass(tiny_config(arch), "shard_tensor_parallel").copy()
        after.context.tp_size, after.context.tp_rank = 2, 1
        after.run_pass(ShardTensorParallelPass())
        shards = {t.name: t for t in after.context.weight_transforms}
        assert shards[column].dim == 0 and shards[row].dim == 1, (arch, shards[column], shards[row])
        assert whole is None or whole not in shards, arch


def test_a_view_may_cut_rows_of_a_width_the_rank_holds_whole() -> None:
    """OLMo Hybrid's gated norm views its gate [.., heads * head_dim] as rows of head_dim: on a
    rank's half the -1 halves with the heads, each row still one head's. A full-model row
    spelled over the rank's half (64 over 32) would silently halve the tokens: refused."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    per_head = graph.call_function(torch.ops.aten.view.default, (x, [-1, 8]))
    full_row = graph.call_function(torch.ops.aten.view.default, (x, [-1, 64]))
    rank_gate = torch.empty(5, 32)  # 4 of the full model's 8 heads of 8
    assert shard_tp._merges_leading_dims(per_head, (rank_gate,))
    assert not shard_tp._merges_leading_dims(full_row, (rank_gate,))


def test_a_vector_per_head_takes_the_ranks_heads() -> None:
    """Beam's attention-gate bias (one value per query head, added to the gate's logits by
    heads) is cut like the heads: rank 1 of 2 reads heads 2-3 of 4."""
    after = graph_for_pass(tiny_config("beam"), "shard_tensor_parallel").copy()
    after.context.tp_size, after.context.tp_rank = 2, 1
    stats = after.run_pass(ShardTensorParallelPass())
    shards = {t.name: t for t in after.context.weight_transforms}
    assert stats["per_head_vectors_sharded"] == tiny_config("beam").num_hidden_layers
    assert shards["model.layers.0.self_attn.gate_bias"].ranges == ((2, 4),)


def test_layers_with_their_own_heads_are_planned_per_layer() -> None:
    """Gemma 4's full-attention layers have a head_dim (32) and KV heads (1, K read as V) of
    their own, beside the windowed layers' (16, 2): each projection's rows are its layer's
    (`_LayerPlans`), the one global KV head is every rank's, and check_tp_size names the layer
    whose counts do not divide (the two-rank parity below checks the numbers)."""
    config = tiny_config("gemma4_text")
    shards, _ = _rank1("gemma4_text")
    kinds = config.layer_types
    window, full = kinds.index("sliding_attention"), kinds.index("full_attention")
    attn = "model.layers.{}.self_attn.{}.weight"
    assert shards[attn.format(window, "q_proj")].ranges == ((32, 64),)  # heads 2-3 of 4, 16 wide
    assert shards[attn.format(window, "k_proj")].ranges == ((16, 32),)  # KV head 1 of 2
    assert shards[attn.format(full, "q_proj")].ranges == ((64, 128),)  # heads 2-3 of 4, 32 wide
    assert shards[attn.format(full, "k_proj")].ranges == ((0, 32),)  # the one KV head, replicated
    check_tp_size(config, 4)
    with pytest.raises(ValueError, match="does not divide the 4 attention heads of layer 0"):
        check_tp_size(config, 3)


def test_values_narrower_than_keys_and_doubled_windowed_kv_heads() -> None:
    """MiMo-V2-Flash: keys of 24 and values of 16 a head, and windowed layers with twice the
    config's KV heads (2 in its full-attention layer 0, 4 in the windowed layers 1-2): v_proj
    keeps the rank's KV heads at the values' width, and each layer's K/V rows are its own
    heads' (the two-rank parity below checks the numbers)."""
    shards, _ = _rank1("mimo_v2_flash")
    attn = "model.layers.{}.self_attn.{}.weight"
    assert shards[attn.format(0, "q_proj")].ranges == ((48, 96),)  # heads 2-3 of 4, 24 wide
    assert shards[attn.format(0, "k_proj")].ranges == ((24, 48),)  # KV head 1 of 2
    assert shards[attn.format(0, "v_proj")].ranges == ((16, 32),)  # the same head, 16 wide
    assert shards[attn.format(1, "k_proj")].ranges == ((48, 96),)  # KV heads 2-3 of 4
    assert shards[attn.format(1, "v_proj")].ranges == ((32, 64),)
    config = tiny_config("mimo_v2_flash")
    config.num_attention_heads = 12  # (so that 6 ranks split the query heads)
    with pytest.raises(ValueError, match="the 4 KV heads of layer 1 can be neither"):
        check_tp_size(config, 6)  # layer 0's 2 KV heads replicate over 6 ranks, layer 1's 4 cannot


def test_a_std_over_the_ranks_channels_is_made_global() -> None:
    """Gemma 3n's activation sparsity cuts each MLP activation at mean + k std over the
    intermediate channels, which a rank holds half of: the std becomes sqrt of the all-reduced
    sums of x and x * x (in float32) over the full count, the mean an all-reduced sum, so
    every rank cuts where the whole model does (the two-rank parity below checks the numbers).
    Its AltUp and LAuReL projections, listed modules (`altup_projections.0`), stay whole."""
    config = tiny_config("gemma3n_text")
    before = graph_for_pass(config, "shard_tensor_parallel")
    after = before.copy()
    after.context.tp_size, after.context.tp_rank = 2, 1
    after.run_pass(ShardTensorParallelPass())
    sparse = sum(1 for p in config.activation_sparsity_pattern if p > 0)
    assert op_counts(before.graph_module)["aten.std.dim"] == sparse
    counts = op_counts(after.graph_module)
    assert counts["aten.std.dim"] == 0 and counts["aten.sqrt.default"] >= sparse
    shards = {t.name for t in after.context.weight_transforms}
    assert "model.layers.0.mlp.gate_proj.weight" in shards
    assert not any("altup" in n or "laurel" in n for n in shards)
    assert shard_tp._module_role("model.altup_projections.0.weight", "gemma3n_text") == "altup_projections"
    config.intermediate_size = [128, 90, 128, 128]
    with pytest.raises(ValueError, match="intermediate_size=90 of layer 1"):
        check_tp_size(config, 4)


def test_a_norm_over_all_heads_gets_a_global_mean_of_squares() -> None:
    """OLMo2 normalizes q over all heads at once: each rank keeps its slice of the norm
    weight and all-reduces its partial sum of squares (the two-rank parity below checks the
    numbers); with KV heads replicated over ranks that sum would count a head twice, so the
    pass refuses rather than producing wrong logits. One KV head is the exception: every rank
    holds it whole, so its norm is per head (Gemma 4's full-attention layers' k_norm)."""
    config = tiny_config("olmo2")  # 4 heads, 2 KV heads of 16
    before = graph_for_pass(config, "shard_tensor_parallel")
    after = before.copy()
    after.context.tp_size, after.context.tp_rank = 2, 1
    stats = after.run_pass(ShardTensorParallelPass())
    layers = config.num_hidden_layers
    assert stats["wide_norms_sharded"] == 2 * layers
    shards = {t.name: t for t in after.context.weight_transforms}
    assert shards["model.layers.0.self_attn.q_norm.weight"].ranges == ((32, 64),)
    assert shards["model.layers.0.self_attn.k_norm.weight"].ranges == ((16, 32),)
    counts = op_counts(after.graph_module)
    # o, down and the embedding as for Llama, plus the q and k sums of squares.
    assert counts["kiln.all_reduce.default"] == 4 * layers + 1
    # The q and k means became sums; the norms over the (whole) hidden state kept theirs.
    assert counts["aten.sum.dim_IntList"] == 2 * layers
    assert counts["aten.mean.dim"] == op_counts(before.graph_module)["aten.mean.dim"] - 2 * layers

    replicated = graph_for_pass(config, "shard_tensor_parallel")
    replicated.context.tp_size = 4  # a KV head of 2 a rank, each on two ranks
    with pytest.raises(ValueError, match="k_norm.weight' normalizes over all 2 KV heads"):
        replicated.run_pass(ShardTensorParallelPass())
    config.num_key_value_heads = 1
    one_kv_head = graph_for_pass(config, "shard_tensor_parallel")
    one_kv_head.context.tp_size = 2
    one_kv_head.run_pass(ShardTensorParallelPass())
    shards = {t.name for t in one_kv_head.context.weight_transforms}
    assert "model.layers.0.self_attn.q_norm.weight" in shards
    assert "model.layers.0.self_attn.k_norm.weight" not in shards  # whole: the one K head on every rank


def _rank1(arch: str) -> tuple[dict[str, ShardWeight], torch.fx.GraphModule]:
    after = graph_for_pass(tiny_config(arch), "shard_tensor_parallel")
    after.context.tp_size, after.context.tp_rank = 2, 1
    after.run_pass(ShardTensorParallelPass())
    return {t.name: t for t in after.context.weight_transforms}, after.graph_module


def test_fused_projections_read_the_ranks_part_of_each() -> None:
    """Phi-3's [q; k; v] and [gate; up] tensors: rank 1 reads its rows of each part, and the
    slices that split the product move to the rank's offsets; Bloom's per-head [q_h; k_h; v_h]
    layout: the rank's heads are one run of rows, and its ALiBi slopes are its heads'."""
    shards, gm = _rank1("phi3")  # 4 heads, 2 KV heads of 16, intermediate 128
    assert shards["model.layers.0.self_attn.qkv_proj.weight"].ranges == ((32, 64), (80, 96), (112, 128))
    assert shards["model.layers.0.mlp.gate_up_proj.weight"].ranges == ((64, 128), (192, 256))
    qkv = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.linear.default)
    cuts = sorted(tuple(u.args[2:4]) for u in qkv.users if u.target == torch.ops.aten.slice.Tensor)
    assert cuts == [(0, 32), (32, 48), (48, sys.maxsize)]
    shards, gm = _rank1("bloom")  # 6 heads of 16, no KV grouping
    assert shards["transformer.h.0.self_attention.query_key_value.weight"].ranges == ((144, 288),)
    slopes = [n for n in gm.graph.nodes if n.target == torch.ops.aten.slice.Tensor
              and n.args[0].op == "placeholder"]
    assert [n.args[1:] for n in slopes] == [(0, 3, 6)]


def test_gpt2_conv1d_shards_columns_and_rows() -> None:
    """GPT-2's Conv1D weights are [in, out], read by addmm: column-parallel c_attn (fused
    [q; k; v]) and c_fc keep the rank's columns, and the views and the split of their output
    take the rank's width; row-parallel c_proj keeps the rank's rows and becomes mm, with its
    bias added once after the all-reduce."""
    config = tiny_config("gpt2")  # 4 heads of 16, MLP width 256
    shards, gm = _rank1("gpt2")
    attn = "transformer.h.0.attn."
    assert shards[attn + "c_attn.weight"] == ShardWeight(attn + "c_attn.weight", 1, ((32, 64), (96, 128), (160, 192)), 96)
    assert shards[attn + "c_attn.bias"].ranges == ((32, 64), (96, 128), (160, 192))
    assert (shards[attn + "c_proj.weight"].dim, shards[attn + "c_proj.weight"].ranges) == (0, ((32, 64),))
    assert attn + "c_proj.bias" not in shards  # whole, added after the all-reduce
    mlp = "transformer.h.0.mlp."
    assert (shards[mlp + "c_fc.weight"].dim, shards[mlp + "c_fc.weight"].ranges) == (1, ((128, 256),))
    assert (shards[mlp + "c_proj.weight"].dim, shards[mlp + "c_proj.weight"].ranges) == (0, ((128, 256),))
    counts = op_counts(gm)
    layers = config.num_hidden_layers
    assert counts["aten.addmm.default"] == 2 * layers and counts["aten.mm.default"] == 2 * layers
    # Two row-parallel projections per layer, and the token and position embeddings.
    assert counts["kiln.all_reduce.default"] == 2 * layers + 2
    splits = [n for n in gm.graph.nodes if n.target == torch.ops.aten.split.Tensor]
    assert [n.args[1] for n in splits] == [32] * layers  # q, k, v of the rank: 32 wide each


def test_codegen_reads_whole_mp_blocks() -> None:
    """CodeGen's qkv_proj is 4 blocks of [q; v; k], a quarter of the heads each: at tp=2 a
    rank reads two whole blocks (one run of rows); a tp that does not divide 4 would split a
    block, and is refused."""
    shards, _ = _rank1("codegen")  # 4 heads of 16: one head per block
    assert shards["transformer.h.0.attn.qkv_proj.weight"].ranges == ((96, 192),)
    config = tiny_config("codegen")
    config.n_head = config.num_attention_heads = 8
    with pytest.raises(ValueError, match="tensor_parallel_size=8: CodeGen's qkv_proj .* divides 4"):
        check_tp_size(config, 8)
    with pytest.raises(ValueError, match="tensor_parallel_size that divides 4"):
        shard_tp._Plan(config, 8, 0).fused("mp4", 192, "qkv_proj.weight")


def test_falcon_transposed_matmul_by_layout() -> None:
    """Falcon's projections are matmul(x, W.T) with the bias added after: multi-query
    query_key_value is [q; k; v] with one K/V head (every rank reads it) and a view that
    counts heads + 2 gets the rank's count; Falcon-RW's is per head [q_h; k_h; v_h], its
    bias sliced alike, its row-parallel bias added after the all-reduce. The grouped layout
    (new_decoder_architecture) is refused."""
    config = tiny_config("falcon")  # 4 heads of 16, multi-query, parallel block
    shards, gm = _rank1("falcon")
    attn = "transformer.h.0.self_attention."
    assert shards[attn + "query_key_value.weight"].ranges == ((32, 64), (64, 80), (80, 96))
    assert (shards[attn + "dense.weight"].dim, shards[attn + "dense.weight"].ranges) == (1, ((32, 64),))
    assert shards["transformer.h.0.mlp.dense_4h_to_h.weight"].dim == 1
    views = [n for n in gm.graph.nodes if n.target == torch.ops.aten.view.default
             and n.args[0].target == torch.ops.aten.matmul.default]
    # 2 query heads + k + v: transformers 5.24 spells the count out (the pass rewrites it), 5.25
    # leaves it to -1 (it follows the rank's input); the view's value has it either way.
    assert [tuple(n.meta["val"].shape[2:]) for n in views] == [(4, 16)] * config.num_hidden_layers
    # Attention and MLP of each layer, and the embedding.
    assert op_counts(gm)["kiln.all_reduce.default"] == 2 * config.num_hidden_layers + 1

    shards, gm = _rank1("falcon_rw")  # per head, biases, ALiBi
    assert shards[attn + "query_key_value.weight"].ranges == ((96, 192),)
    assert shards[attn + "query_key_value.bias"].ranges == ((96, 192),)
    assert attn + "dense.bias" not in shards
    dense = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.matmul.default
                 and "dense_weight" in n.args[1].args[0].name)
    (reduced,) = dense.users
    assert reduced.target == torch.ops.kiln.all_reduce.default
    assert next(iter(reduced.users)).target == torch.ops.aten.add.Tensor  # the bias, once

    grouped = tiny_config("falcon")
    grouped.new_decoder_architecture, grouped.num_kv_heads = True, 2
    with pytest.raises(ValueError, match="new_decoder_architecture"):
        check_tp_size(grouped, 2)


def _rank_view(shape: list[int], full_input: tuple[int, ...],
               rank_input: tuple[int, ...]) -> tuple[torch.fx.Node, torch.Tensor]:
    """A `view(x, shape)` node whose value was computed on the rank's input (as the pass
    recomputes it), and the full model's value of it."""
    graph = torch.fx.Graph()
    node = graph.call_function(torch.ops.aten.view.default, (graph.placeholder("x"), shape))
    node.meta["val"] = torch.empty(rank_input).view(shape)
    return node, torch.empty(full_input).view(shape)


def test_a_view_gets_the_ranks_head_count_before_a_minus_one_may_follow() -> None:
    """With the token count static (a bucket exported at its own shape), OPT's
    `view(1, -1, heads, head_dim)` on the rank's half-width input would silently halve the
    tokens: its spelled-out head count becomes the rank's. Falcon's `view(1, T, -1, head_dim)`
    (transformers 5.25), with no count to give the rank's, leaves the heads to the -1."""
    size_map = {4: 2, 64: 32}  # 4 heads of 16 on two ranks
    node, full = _rank_view([1, -1, 4, 16], (1, 8, 64), (1, 8, 32))
    assert tuple(node.meta["val"].shape) == (1, 4, 4, 16)  # tokens halved: wrong
    assert shard_tp._view_takes_rank_shapes(node, (torch.empty(1, 8, 32), [1, -1, 4, 16]), full, size_map)
    assert list(node.args[1]) == [1, -1, 2, 16] and tuple(node.meta["val"].shape) == (1, 8, 2, 16)

    node, full = _rank_view([1, 8, -1, 16], (1, 8, 96), (1, 8, 64))  # 4 query heads + k + v -> 2 + k + v
    assert shard_tp._view_takes_rank_shapes(node, (torch.empty(1, 8, 64), [1, 8, -1, 16]), full, size_map)
    assert list(node.args[1]) == [1, 8, -1, 16] and tuple(node.meta["val"].shape) == (1, 8, 4, 16)


def _through_logits(captured, config, tp_size: int = 1, tp_rank: int = 0) -> PhaseCapture:
    """`capture_through(config, "logits", inclusive=True)` of an already captured model (a
    copy of it): the graph of one rank, or the unsharded one, from one capture."""
    pm = PassManager.default()
    limit = PHASES.index("logits") + 1
    passes = [p for p in pm.passes if PHASES.index(p.phase) < limit]
    captured = copy.deepcopy(captured)
    ctx = PassContext(config=config, dtype=torch.float32, tp_size=tp_size, tp_rank=tp_rank)
    report = PassManager(passes).run(captured.graph_module, ctx)
    return PhaseCapture(captured=captured, report=report, block_size=16, context=ctx)


def _capture_or_error(arch: str):
    import traceback

    try:
        # At the CPU engine's token budget: the capture test_parity.py's and
        # test_fusions_per_arch.py's engines made of the same tiny model on this worker
        # (tests/conftest.py runs the three files together), one memo entry for all three.
        return shared_capture(config_for(arch), dtype=torch.float32, device="cpu",
                              max_num_tokens=CPU_LIMITS[1])
    except Exception:
        return traceback.format_exc()  # reported by the test of that architecture


def _rank_logits(rank: int, world: int, init_file: str, archs: list[str], out_dir: str,
                 captures: dict | None = None) -> None:
    """One rank: each architecture's graph of this rank, run on its slices of the seeded
    weights; logits (or the error) saved per architecture. `captures`: each architecture's
    captured model, taken once by the parent before it forked the ranks (None: each rank
    captures it itself). The rank whose turn it is also runs the unsharded graph (the
    expected logits), so the two ranks share that work."""
    import traceback

    # Two ranks on two cores: one thread each (OpenMP threads of both spinning on the same
    # cores made every op slower).
    torch.set_num_threads(1)
    # A timeout: a failure on one rank alone must not leave the other waiting for 30 minutes.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        for i, arch in enumerate(archs):
            config = config_for(arch)
            captured = captures[arch] if captures is not None else _capture_or_error(arch)
            try:
                if isinstance(captured, str):
                    raise RuntimeError(f"capture failed:\n{captured}")
                graph = _through_logits(captured, config, tp_size=world, tp_rank=rank)
                result: object = run_graph(graph, num_tokens=11, sample_all_rows=True)
            except Exception:
                result = traceback.format_exc()  # the same on both ranks: no collective is left waiting
            torch.save(result, os.path.join(out_dir, f"{arch}-rank{rank}.pt"))
            if i % world == rank:
                try:
                    if isinstance(captured, str):
                        raise RuntimeError(f"capture failed:\n{captured}")
                    expected: object = run_graph(_through_logits(captured, config), num_tokens=11,
                                                 sample_all_rows=True)
                except Exception:
                    expected = traceback.format_exc()
                torch.save(expected, os.path.join(out_dir, f"{arch}-expected.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_logits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both ranks' logits and the unsharded graph's for every architecture, from one pair of
    processes (starting a pair per architecture cost more than the runs). The models are
    captured once, here, and the ranks forked with them (capture is most of the work: each
    rank capturing every model took 159 s on two cores, against ~100 s on one this way); a
    process that has initialised CUDA cannot fork, so there the ranks are spawned and capture
    for themselves."""
    out = tmp_path_factory.mktemp("tp2")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        captures, method = None, "spawn"
    else:
        captures, method = {arch: _capture_or_error(arch) for arch in TP_TEST_ARCHS}, "fork"
    mp.start_processes(_rank_logits, args=(2, str(out / "init"), TP_TEST_ARCHS, str(out), captures), nprocs=2,
                       start_method=method)
    return out


@pytest.mark.parametrize("arch", TP_TEST_ARCHS)
def test_two_ranks_match_the_unsharded_graph(arch: str, two_rank_logits: Path) -> None:
    expected = torch.load(two_rank_logits / f"{arch}-expected.pt", weights_only=False)
    assert isinstance(expected, torch.Tensor), f"the unsharded graph failed:\n{expected}"
    for rank in range(2):
        got = torch.load(two_rank_logits / f"{arch}-rank{rank}.pt", weights_only=False)
        assert isinstance(got, torch.Tensor), f"rank {rank} failed:\n{got}"
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
