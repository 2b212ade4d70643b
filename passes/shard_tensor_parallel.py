"""`shard_tensor_parallel`: turn the captured graph into one rank's graph of a
tensor-parallel group (Megatron-style), and tell the loader which slice of each weight that
rank reads.

At `tp_size` 1 (the default) the pass changes nothing. Otherwise, on rank r of tp:

- column-parallel projections (q, k, v, gate, up): the rank keeps its rows of the weight
  (and bias): its attention heads, its part of the MLP's intermediate dimension. Query heads
  split evenly; KV heads split too when there are at least as many as ranks, and otherwise
  each rank keeps the one KV head its query heads read (replicated over tp / kv_heads ranks);
- row-parallel projections (o, down): the rank keeps the matching columns, and the partial
  products are summed over ranks by `kiln::all_reduce` (the bias, if any, added once after it);
- the embedding is vocab-parallel: the rank holds ceil(V / tp) rows, looks up the tokens it
  owns, zeroes the others, and `kiln::all_reduce` sums;
- the LM head is vocab-parallel too: each rank projects onto its rows of the vocabulary and
  `kiln::all_gather` joins them. prune_logits (later) selects the sampled rows before the
  head, so only those rows are projected and gathered;
- MoE experts (transformers' stacked `experts.gate_up_proj` [E, 2I, H] and
  `experts.down_proj` [E, H, I]): each expert's intermediate dimension is split like a
  dense MLP's, the router stays whole, and the experts' sum is all-reduced.

Shapes in the graph's views use -1 for the head count (`[1, T, -1, head_dim]`), so after the
weights shrink, fake-tensor propagation gives every node its rank's shape, and the KV cache
(`kv_heads_and_head_dim(config, tp_size)`) holds the rank's KV heads. Each sliced weight gets a `ShardWeight`
transform; the merge passes that run later concatenate the already-sliced q/k/v and gate/up.
The graph depends on the rank (the vocabulary offset of its embedding), so the rank and tp
size are cache-key factors. Architectures are taken one by one once their tensor names and
per-head constructs are known to shard this way (`TP_ARCHITECTURES`, each tested at two
ranks against the unsharded graph); others are refused with a message at tp > 1.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kiln.compiler.graph_inputs import param_name
from kiln.kernels.paged_attention import kv_heads_and_head_dim
from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.prune_logits import find_lm_head
from kiln.passes.weight_transforms import ShardWeight

aten = torch.ops.aten

# model_type -> why it shards with the rules above (names q/k/v/o_proj, gate/up/down_proj,
# per-head or per-element norms only). Others are refused at tp > 1.
TP_ARCHITECTURES = {
    "llama": "q/k/v/o, gate/up/down",
    "mistral": "as llama; sliding window is per head",
    "qwen2": "as llama, with q/k/v biases",
    "qwen3": "as llama; q/k RMSNorm over head_dim (per head)",
    "granite": "as llama, with scalar multipliers",
    "helium": "as llama",
    "smollm3": "as llama",
    "mixtral": "as llama; experts split along their intermediate dimension",
    "gemma": "as llama; embedding scaled after the all-reduce",
    "gemma2": "as llama; soft-capping per head and on the gathered logits",
    "gemma3_text": "as llama; q/k norm per head",
    "olmo": "as llama; LayerNorm without weights",
    "cohere": "parallel attention/MLP block: both partial sums all-reduced",
    "cohere2": "as cohere",
    "exaone4": "as llama; q/k norm per head",
    "starcoder2": "q/k/v/o with biases, c_fc/c_proj",
    "phi": "q/k/v, dense, fc1/fc2, parallel block, biases",
    "gptj": "q/k/v, out_proj, fc_in/fc_out, parallel block",
    "stablelm": "as llama; its views spell out the head count (rewritten per rank)",
}
# Projection module names -> which split: "q" (query heads), "kv" (KV heads), "mlp" (the
# intermediate dimension, evenly). Names of the architectures in TP_ARCHITECTURES: Llama's
# q/k/v/o_proj and gate/up/down_proj, Phi's dense and fc1/fc2, StarCoder2's c_fc/c_proj,
# GPT-J's out_proj and fc_in/fc_out.
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp",
           "fc1": "mlp", "c_fc": "mlp", "fc_in": "mlp"}
_ROW = {"o_proj": "q", "dense": "q", "out_proj": "q", "down_proj": "mlp", "fc2": "mlp", "c_proj": "mlp",
        "fc_out": "mlp"}
# Replicated: every rank computes the whole projection (MoE routers: small, and every rank
# needs all experts' scores).
_REPLICATED = {"gate"}
# Where an MoE block's output ends: the residual add (or the graph output).
_BLOCK_END = {aten.add.Tensor, "output"}
_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def check_tp_size(config: Any, tp_size: int) -> None:
    """ValueError naming what does not divide, for a config that cannot be split tp_size ways."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
    if tp_size == 1:
        return
    model_type = str(getattr(config, "model_type", "?"))
    if model_type not in TP_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size={tp_size}: Kiln does not shard {model_type!r} models yet (it shards "
                         f"{', '.join(sorted(TP_ARCHITECTURES))}); run it with tensor_parallel_size=1")
    heads = int(config.num_attention_heads)
    kv_heads, _ = kv_heads_and_head_dim(config)
    if heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the {heads} attention heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size}: the {kv_heads} KV heads can be neither split over nor "
                         f"replicated across {tp_size} ranks (one must divide the other)")
    intermediate = getattr(config, "intermediate_size", None)
    if isinstance(intermediate, int) and intermediate % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide intermediate_size={intermediate}")



class _Plan:
    """The row ranges of rank r for each kind of projection output."""

    def __init__(self, config: Any, tp: int, rank: int):
        self.tp, self.rank = tp, rank
        heads = int(config.num_attention_heads)
        kv_heads, self.head_dim = kv_heads_and_head_dim(config)
        per = heads // tp
        self.q = (rank * per * self.head_dim, (rank + 1) * per * self.head_dim)
        if kv_heads >= tp:
            kv_per = kv_heads // tp
            self.kv = (rank * kv_per * self.head_dim, (rank + 1) * kv_per * self.head_dim)
        else:  # replicated: the KV head of this rank's query heads
            kv_index = rank * kv_heads // tp
            self.kv = (kv_index * self.head_dim, (kv_index + 1) * self.head_dim)

    def size_map(self, config: Any) -> dict[int, int]:
        """Full-model sizes a view may spell out (head counts, their widths) -> this rank's."""
        heads = int(config.num_attention_heads)
        kv_heads, _ = kv_heads_and_head_dim(config)
        kv_rank = (self.kv[1] - self.kv[0]) // self.head_dim
        return {heads: heads // self.tp, heads * self.head_dim: heads * self.head_dim // self.tp,
                kv_heads: kv_rank, kv_heads * self.head_dim: kv_rank * self.head_dim}

    def even(self, size: int, what: str) -> tuple[int, int]:
        if size % self.tp:
            raise ValueError(f"shard_tensor_parallel: {what} of size {size} does not divide by tp={self.tp}")
        per = size // self.tp
        return (self.rank * per, (self.rank + 1) * per)

    def vocab(self, size: int) -> tuple[tuple[int, int], int]:
        per = -(-size // self.tp)
        start = min(size, self.rank * per)
        return (start, min(size, start + per)), per


class ShardTensorParallelPass(KilnPass):
    name = "shard_tensor_parallel"
    # Last of the normalize phase: every later pass (paged_kv's KV-cache shape, the merges'
    # widths, the fusions) sees this rank's graph, as if the model were this small.
    phase = "normalize"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        tp, rank = int(ctx.tp_size), int(ctx.tp_rank)
        if tp == 1:
            return {"tp_size": 1}
        if not 0 <= rank < tp:
            raise ValueError(f"shard_tensor_parallel: rank {rank} is outside [0, {tp})")
        check_tp_size(ctx.config, tp)
        plan = _Plan(ctx.config, tp, rank)
        graph = gm.graph
        shards: dict[str, ShardWeight] = {}
        new_shapes: dict[torch.fx.Node, list[int]] = {}

        def shard(param: torch.fx.Node, dim: int, ranges: list[tuple[int, int]], size: int) -> None:
            name = param_name(param)
            assert name is not None  # callers pass parameter placeholders only
            transform = ShardWeight(name=name, dim=dim, ranges=tuple(ranges), size=size)
            if shards.setdefault(name, transform) != transform:
                raise ValueError(f"shard_tensor_parallel: {name!r} is read by two ops that shard it differently")
            shape = list(param.meta["val"].shape)
            shape[dim] = size
            new_shapes[param] = shape

        def all_reduce_after(node: torch.fx.Node, bias: Any = None) -> None:
            with graph.inserting_after(node):
                reduced = graph.call_function(torch.ops.kiln.all_reduce.default, (node,))
            node.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
            if bias is not None:
                with graph.inserting_after(reduced):
                    biased = graph.call_function(aten.add.Tensor, (reduced, bias))
                reduced.replace_all_uses_with(biased, delete_user_cb=lambda user: user is not biased)

        stats = {"column_parallel": 0, "row_parallel": 0, "vocab_parallel": 0, "experts_sharded": 0,
                 "all_reduce": 0, "all_gather": 0}
        lm_head = find_lm_head(gm)
        unknown: list[str] = []
        for node in list(graph.find_nodes(op="call_function", target=aten.linear.default)):
            weight = node.args[1]
            name = param_name(weight)
            bias = node.args[2] if len(node.args) > 2 else None
            if name is None:
                continue
            if node is lm_head:
                ranges, size = plan.vocab(weight.meta["val"].shape[0])
                shard(weight, 0, [ranges], size)
                if bias is not None:
                    shard(bias, 0, [ranges], size)
                vocab = weight.meta["val"].shape[0]
                with graph.inserting_after(node):
                    gathered = graph.call_function(torch.ops.kiln.all_gather.default, (node, -1, tp))
                with graph.inserting_after(gathered):
                    out = (graph.call_function(aten.slice.Tensor, (gathered, -1, 0, vocab))
                           if size * tp != vocab else gathered)
                node.replace_all_uses_with(out, delete_user_cb=lambda user: user not in (gathered, out))
                stats["vocab_parallel"] += 1
                stats["all_gather"] += 1
                continue
            module = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
            if module in _COLUMN:
                kind = _COLUMN[module]
                rows = (plan.q if kind == "q" else plan.kv if kind == "kv"
                        else plan.even(weight.meta["val"].shape[0], name))
                shard(weight, 0, [rows], rows[1] - rows[0])
                if bias is not None:
                    shard(bias, 0, [rows], rows[1] - rows[0])
                stats["column_parallel"] += 1
            elif module in _ROW:
                cols = plan.q if _ROW[module] == "q" else plan.even(weight.meta["val"].shape[1], name)
                shard(weight, 1, [cols], cols[1] - cols[0])
                if bias is not None:
                    node.args = node.args[:2]
                all_reduce_after(node, bias)
                stats["row_parallel"] += 1
                stats["all_reduce"] += 1
            elif module not in _REPLICATED:
                unknown.append(name)
        if unknown:
            raise ValueError(f"shard_tensor_parallel: no sharding rule for the projection(s) {', '.join(unknown[:4])}"
                             f"{' ...' if len(unknown) > 4 else ''}")
        for node in list(graph.find_nodes(op="call_function", target=aten.embedding.default)):
            weight = node.args[0]
            if param_name(weight) is None:
                continue
            (start, stop), size = plan.vocab(weight.meta["val"].shape[0])
            shard(weight, 0, [(start, stop)], size)
            all_reduce_after(self._mask_embedding(graph, node, start, stop))
            stats["vocab_parallel"] += 1
            stats["all_reduce"] += 1
        stats["experts_sharded"] = self._shard_experts(gm, plan, shard, all_reduce_after)
        stats["all_reduce"] += stats["experts_sharded"]
        _reshape_params(gm, new_shapes, plan.size_map(ctx.config))
        ctx.weight_transforms.extend(shards.values())
        stats["weights_sharded"] = len(shards)
        return stats

    @staticmethod
    def _mask_embedding(graph: torch.fx.Graph, node: torch.fx.Node, start: int, stop: int) -> torch.fx.Node:
        """embedding(w, ids) -> embedding(w_shard, owned ? ids - start : 0) * owned."""
        ids = node.args[1]
        with graph.inserting_before(node):
            ge = graph.call_function(aten.ge.Scalar, (ids, start))
            lt = graph.call_function(aten.lt.Scalar, (ids, stop))
            owned = graph.call_function(aten.logical_and.default, (ge, lt))
            shifted = graph.call_function(aten.sub.Tensor, (ids, start))
            local = graph.call_function(aten.mul.Tensor, (shifted, owned))
        node.args = (node.args[0], local)
        with graph.inserting_after(node):
            mask = graph.call_function(aten.unsqueeze.default, (owned, -1))
        with graph.inserting_after(mask):
            masked = graph.call_function(aten.mul.Tensor, (node, mask))
        node.replace_all_uses_with(masked, delete_user_cb=lambda user: user is not masked)
        return masked

    @staticmethod
    def _shard_experts(gm: torch.fx.GraphModule, plan: _Plan, shard: Any, all_reduce_after: Any) -> int:
        """Stacked experts: gate_up_proj [E, 2I, H] keeps each half's rows of this rank,
        down_proj [E, H, I] its columns. What follows the down projection (routing weights,
        the sum over each token's experts, reshapes) is linear in it, so the all-reduce goes
        at the end of that chain, where the block's output meets the residual add: one
        [T, H] message per layer rather than one per routed token."""
        count = 0
        for node in gm.graph.find_nodes(op="placeholder"):
            name = param_name(node)
            match = _EXPERTS.search(name or "")
            if match is None:
                continue
            shape = node.meta["val"].shape
            if match.group(1) == "gate_up_proj":
                inter = shape[1] // 2
                a, b = plan.even(inter, name)
                shard(node, 1, [(a, b), (inter + a, inter + b)], 2 * (b - a))
            else:
                a, b = plan.even(shape[2], name)
                shard(node, 2, [(a, b)], b - a)
                readers = [u for u in node.users if u.op == "call_function"]
                for user in readers:
                    target = user
                    while len(target.users) == 1 and next(iter(target.users)).target not in _BLOCK_END:
                        target = next(iter(target.users))
                    all_reduce_after(target)
                    count += 1
        return count


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def _reshape_params(gm: torch.fx.GraphModule, new_shapes: dict[torch.fx.Node, list[int]],
                    size_map: dict[int, int]) -> None:
    """Give the sharded inputs their new fake values and recompute every node's (so that
    later passes see the rank's shapes). A view that spells out a full-model size (StableLM's
    `view(1, T, num_heads, head_dim)`) gets the rank's, one dimension tried at a time; any
    other node whose shape arithmetic cannot follow is an error naming it."""
    from torch._guards import detect_fake_mode

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    mode = detect_fake_mode([n.meta.get("val") for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)])
    if mode is None:
        raise ValueError("shard_tensor_parallel: the graph's inputs carry no fake values to propagate shapes with")
    with mode:
        for node, shape in new_shapes.items():
            old = node.meta["val"]
            node.meta["val"] = torch.empty(shape, dtype=old.dtype, device=old.device)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            try:
                node.meta["val"] = node.target(*args, **kwargs)
            except Exception as e:
                if not (node.target in _VIEWS and _fix_view(node, args, size_map)):
                    raise ValueError(f"shard_tensor_parallel: node {node.name} ({node.target}) cannot take the "
                                     f"sharded shapes: {e}") from e
    gm.recompile()


def _fix_view(node: torch.fx.Node, args: tuple[Any, ...], size_map: dict[int, int]) -> bool:
    """Rewrite one literal dimension of a failing view to the rank's size, if one works."""
    shape = list(node.args[1])
    for i, dim in enumerate(shape):
        if isinstance(dim, int) and dim in size_map:
            trial = shape[:i] + [size_map[dim]] + shape[i + 1:]
            fake_trial = list(args[1])
            fake_trial[i] = size_map[dim]
            try:
                val = node.target(args[0], fake_trial)
            except Exception:
                continue
            node.args = (node.args[0], trial, *node.args[2:])
            node.meta["val"] = val
            return True
    return False

