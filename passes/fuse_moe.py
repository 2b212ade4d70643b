"""`fuse_moe`: a mixture-of-experts block's router -> top-k -> experts -> weighted sum as one
`kiln::fused_moe` op.

Capture builds every model with transformers' pluggable experts (`@use_experts_implementation`:
Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, ...) set to `batched_mm`, the form export can trace.
After `normalize` one block reads (float32 drops the two optional casts):

    logits = linear(x, router_w)
    probs  = softmax(to(logits, f32), -1)  |  softmax(logits, -1, f32)
    vals, idx = topk(probs, k)
    vals   = div_(vals, sum(vals, [-1], True))           # renormalised top-k only
    vals   = to(vals, dtype)                             # Qwen2/3-MoE, OLMoE below float32
    ids    = reshape(idx, [-1])                          # then clamp(ids, 0, E - 1) up to transformers 5.17
    h      = squeeze(bmm(index(w_gate_up, [ids]), unsqueeze(repeat_interleave(x, k, 0), -1)), -1)
    g, u   = chunk(h, 2, -1)
    y      = squeeze(bmm(index(w_down, [ids]), unsqueeze(silu(g) * u, -1)), -1)
    y      = sum(view(y * unsqueeze(reshape(vals, [-1]), -1), [T, k, H]), [1])
    y      = to(y, dtype)                                # Mixtral below float32

(`silu(g) * u` is `kiln::silu_and_mul(g, u)` when `fuse_silu_mul` ran first, as it does in the
registry's order) and becomes `y = kiln::fused_moe(x, logits, w_gate_up, w_down, k, renormalize, fp32_weights)`.
The router GEMM (`logits`) stays in the graph: it is one small projection. Qwen2-MoE's shared
expert and its sigmoid gate are a dense MLP beside this subgraph, untouched here (the dense
passes merge and fuse it like any MLP).

The match is written by hand, walking back from each `topk` rather than with
`kiln.passes.pattern`: the block's `view(..., [T, k, H])` carries the symbolic token count,
which a pattern traced at fixed example shapes cannot match.

The `batched_mm` graph gathers every pair's expert matrices (tokens x top-k x 3 matrices);
the fused op reads each expert's weights once per step. So unlike the elementwise fusions it
pays on CPU too (compiler/README.md, Mixture of experts: 13-50x at 1-64 tokens); still it follows the
custom-op policy (`kiln.passes.fuse_common`) for now: CUDA by default, CPU with
`KILN_CPU_FUSIONS=1` or `FuseMoEPass(on_cpu=True)`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.fuse_common import CudaByDefault

aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default)
_SOFTMAX = (aten.softmax.int, aten._softmax.default)


@dataclass
class MoEMatch:
    """One matched block: the op's operands and the nodes it replaces."""

    hidden: torch.fx.Node
    router_logits: torch.fx.Node
    w_gate_up: torch.fx.Node
    w_down: torch.fx.Node
    top_k: int
    renormalize: bool
    fp32_weights: bool
    output: torch.fx.Node  # the node whose uses the op's result takes over
    nodes: list[torch.fx.Node]  # every node of the subgraph (erased once unused)


def _is(node: object, *targets: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _dtype(node: torch.fx.Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_float32_cast(node: object) -> bool:
    return _is(node, *_CASTS) and _dtype(node) == torch.float32  # type: ignore[arg-type]


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _is_last_dim(node: torch.fx.Node, dim: object) -> bool:
    shape = _shape(node)
    return dim == -1 or (shape is not None and isinstance(dim, int) and dim == len(shape) - 1)


def _shapes_agree(hidden: object, logits: object, w_gate_up: object, w_down: object) -> bool:
    """hidden [T, H], logits [T, E], w_gate_up [E, 2I, H], w_down [E, H, I] (sizes that are
    symbolic, like T, are not compared)."""
    h, lg, gu, dn = _shape(hidden), _shape(logits), _shape(w_gate_up), _shape(w_down)
    if h is None or lg is None or gu is None or dn is None or len(h) != 2 or len(lg) != 2 \
            or len(gu) != 3 or len(dn) != 3:
        return False
    return gu[0] == dn[0] == lg[1] and gu[2] == dn[1] == h[1] and gu[1] == 2 * dn[2]


def _getitems(node: torch.fx.Node) -> dict[int, torch.fx.Node]:
    return {u.args[1]: u for u in node.users if _is(u, operator.getitem)}


def _squeezed_bmm(node: object) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node] | None:
    """squeeze(bmm(index(W, [ids]), unsqueeze(x, -1)), -1) -> (W, ids, x)."""
    if not (_is(node, aten.squeeze.dim) and node.args[1] == -1):  # type: ignore[union-attr]
        return None
    bmm = node.args[0]  # type: ignore[union-attr]
    if not _is(bmm, aten.bmm.default):
        return None
    gathered, col = bmm.args
    if not (_is(gathered, aten.index.Tensor) and _is(col, aten.unsqueeze.default) and col.args[1] == -1):
        return None
    indices = gathered.args[1]
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1):
        return None
    weight = gathered.args[0]
    if not (isinstance(weight, torch.fx.Node) and weight.op == "placeholder"):
        return None
    return weight, indices[0], col.args[0]


def _unclamped_ids(ids: torch.fx.Node, w_down: torch.fx.Node) -> torch.fx.Node | None:
    """The flat expert ids under an optional `clamp(ids, 0, E - 1)`, or None for any other clamp.

    transformers up to 5.17 clamps the ids before the gathers (for expert-parallel sentinels,
    ids >= E); later versions clamp only under expert parallelism, which capture does not use.
    Top-k indices over E experts already lie in [0, E - 1], so exactly that clamp is a no-op
    and the fused op may drop it; a clamp to any other range changes the routing and is not
    this block."""
    if not _is(ids, aten.clamp.default):
        return ids
    shape = _shape(w_down)
    bounds = list(ids.args[1:3]) + [None] * (3 - len(ids.args))
    low = ids.kwargs.get("min", bounds[0])
    high = ids.kwargs.get("max", bounds[1])
    if shape is None or low != 0 or high != shape[0] - 1 or not isinstance(ids.args[0], torch.fx.Node):
        return None
    return ids.args[0]


def match_moe_block(topk: torch.fx.Node) -> MoEMatch | None:
    """The MoE block around this `topk` node, or None when it is not one (see the module doc)."""
    if len(topk.args) != 2 or topk.kwargs:  # only topk(x, k): last dim, largest, sorted
        return None
    softmax, top_k = topk.args
    if not (_is(softmax, *_SOFTMAX) and _is_last_dim(softmax, softmax.args[1]) and _only_user(softmax) is topk):
        return None
    nodes = [softmax, topk]
    router_logits = softmax.args[0]
    if _is_float32_cast(router_logits) and _only_user(router_logits) is softmax:
        nodes.append(router_logits)
        router_logits = router_logits.args[0]
    if _dtype(softmax) != torch.float32:
        return None
    items = _getitems(topk)
    if set(items) != {0, 1} or len(topk.users) != 2:
        return None
    vals, idx = items[0], items[1]
    nodes += [vals, idx]

    # Routing weights: [div_(vals, sum(vals))] [to(dtype)] reshape(-1) unsqueeze(-1).
    weights, renormalize = vals, False
    users = list(vals.users)
    if len(users) == 2:
        total = next((u for u in users if _is(u, aten.sum.dim_IntList)), None)
        div = next((u for u in users if _is(u, aten.div_.Tensor, aten.div.Tensor)), None)
        if total is None or div is None or div.args != (vals, total) or list(total.args[1]) != [-1] \
                or not (len(total.args) > 2 and total.args[2]) or _only_user(total) is not div:
            return None
        nodes += [total, div]
        weights, renormalize = div, True
    cast = _only_user(weights)
    if _is(cast, *_CASTS):
        nodes.append(cast)
        weights = cast
    flat_weights = _only_user(weights)
    if not (_is(flat_weights, aten.reshape.default, aten.view.default) and list(flat_weights.args[1]) == [-1]):
        return None
    col_weights = _only_user(flat_weights)
    if not (_is(col_weights, aten.unsqueeze.default) and col_weights.args[1] == -1):
        return None
    weighted = _only_user(col_weights)
    if not (_is(weighted, aten.mul.Tensor) and weighted.args[1] is col_weights):
        return None
    nodes += [flat_weights, col_weights, weighted]
    fp32_weights = _dtype(weights) == torch.float32

    # The experts: the down projection of silu(gate) * up of the gate/up projection.
    down = _squeezed_bmm(weighted.args[0])
    if down is None:
        return None
    w_down, ids, act = down
    flat_ids = _unclamped_ids(ids, w_down)
    if flat_ids is None:
        return None
    if not (_is(flat_ids, aten.reshape.default, aten.view.default) and flat_ids.args[0] is idx
            and list(flat_ids.args[1]) == [-1]):
        return None
    if _is(act, aten.mul.Tensor) and _is(act.args[0], aten.silu.default):
        act_nodes = [act.args[0], act]
        gate, up = act.args[0].args[0], act.args[1]
    elif _is(act, torch.ops.kiln.silu_and_mul.default):  # fuse_silu_mul ran first
        act_nodes = [act]
        gate, up = act.args
    else:
        return None
    if not (_is(gate, operator.getitem) and _is(up, operator.getitem)):
        return None
    chunk = gate.args[0]
    if not (_is(chunk, aten.chunk.default) and tuple(chunk.args[1:]) == (2, -1) and gate.args[1] == 0
            and up.args == (chunk, 1)):
        return None
    gate_up = _squeezed_bmm(chunk.args[0])
    if gate_up is None:
        return None
    w_gate_up, ids_gu, repeated = gate_up
    if ids_gu is not ids or not _is(repeated, aten.repeat_interleave.self_int):
        return None
    hidden = repeated.args[0]
    if tuple(repeated.args[1:3]) != (top_k, 0):
        return None
    squeeze_down, bmm_down = weighted.args[0], weighted.args[0].args[0]
    index_down, col_down = bmm_down.args
    squeeze_gu = chunk.args[0]
    bmm_gu = squeeze_gu.args[0]
    index_gu, col_gu = bmm_gu.args
    nodes += [*dict.fromkeys([flat_ids, ids]), repeated, index_gu, col_gu, bmm_gu, squeeze_gu, chunk, gate, up, *act_nodes,
              index_down, col_down, bmm_down, squeeze_down]

    # The weighted sum over each token's k slots: sum(view(y, [T, k, H]), [1]) [to(dtype)].
    slots = _only_user(weighted)
    if not (_is(slots, aten.view.default, aten.reshape.default) and len(slots.args[1]) == 3
            and slots.args[1][1] == top_k):
        return None
    summed = _only_user(slots)
    if not (_is(summed, aten.sum.dim_IntList) and list(summed.args[1]) == [1] and len(summed.args) == 2):
        return None
    nodes += [slots, summed]
    output = summed
    hidden_dtype = _dtype(hidden)
    after = _only_user(summed)
    if _is(after, *_CASTS) and _dtype(after) == hidden_dtype:
        nodes.append(after)
        output = after
    if _dtype(output) != hidden_dtype or not _shapes_agree(hidden, router_logits, w_gate_up, w_down):
        return None
    # Everything but the output must be private to the block (ids feed both gathers).
    inside = set(nodes)
    for node in nodes:
        if node is not output and any(u not in inside for u in node.users):
            return None
    return MoEMatch(hidden=hidden, router_logits=router_logits, w_gate_up=w_gate_up, w_down=w_down,
                    top_k=int(top_k), renormalize=renormalize, fp32_weights=fp32_weights, output=output,
                    nodes=nodes)


def find_moe_blocks(gm: torch.fx.GraphModule) -> list[MoEMatch]:
    return [m for node in gm.graph.find_nodes(op="call_function", target=aten.topk.default)
            if (m := match_moe_block(node)) is not None]


class FuseMoEPass(CudaByDefault, KilnPass):
    name = "fuse_moe"
    phase = "fusion"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        if not self.applies_to(gm):
            return {"skipped_on_cpu": 1}
        matches = find_moe_blocks(gm)
        graph = gm.graph
        for m in matches:
            with graph.inserting_before(m.output):
                fused = graph.call_function(torch.ops.kiln.fused_moe.default, (
                    m.hidden, m.router_logits, m.w_gate_up, m.w_down, m.top_k, m.renormalize, m.fp32_weights))
            if "val" in m.output.meta:
                fused.meta["val"] = m.output.meta["val"]
            m.output.replace_all_uses_with(fused)
            for node in reversed(_topological(graph, m.nodes)):
                if not node.users:
                    graph.erase_node(node)
        if matches:
            graph.lint()
            gm.recompile()
        return {"fused_moe": len(matches)}


def _topological(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    wanted = set(nodes)
    return [n for n in graph.nodes if n in wanted]
