"""`fuse_moe`: a mixture-of-experts block's experts (and, where it is a softmax top-k, its
router) as one op: `kiln::fused_moe`, or `kiln::moe_experts` after any other router.

Capture builds every model with transformers' pluggable experts (`@use_experts_implementation`:
Mixtral, Qwen2/3-MoE, OLMoE, GLM-4.5, DeepSeek-V3, ...) set to `batched_mm`, the form export
can trace. After `normalize` one block reads (float32 drops the optional casts):

    logits = linear(x, router_w)                         # the router: here softmax -> top-k
    probs  = softmax(to(logits, f32), -1)  |  softmax(logits, -1, f32)
    vals, idx = topk(probs, k)
    vals   = div_(vals, sum(vals, [-1], True))           # renormalised top-k only
    vals   = to(vals, dtype)                             # Qwen2/3-MoE, OLMoE below float32
    ids    = reshape(idx, [-1])                          # the experts, from here on
                                                         # (then clamp(ids, 0, E - 1) up to transformers 5.17)
    h      = squeeze(bmm(index(w_gate_up, [ids]), unsqueeze(repeat_interleave(x, k, 0), -1)), -1)
    g, u   = chunk(h, 2, -1)
    y      = squeeze(bmm(index(w_down, [ids]), unsqueeze(silu(g) * u, -1)), -1)
    y      = sum(view(y * unsqueeze(reshape(vals, [-1]), -1), [T, k, H]), [1])
    y      = to(y, dtype)                                # Mixtral below float32

(`silu(g) * u` is `kiln::silu_and_mul(g, u)` when `fuse_silu_mul` ran first, as it does in the
registry's order). `match_experts` finds the experts from each `repeat_interleave`, with the
two [T, k] tensors the pairs' weights and ids are flattened from. Where those come from the
softmax router above (`match_softmax_router`) the block becomes
`y = kiln::fused_moe(x, logits, w_gate_up, w_down, k, renormalize, fp32_weights)`; any other
router (DeepSeek-V3's sigmoid scores with a selection bias and expert groups, PhiMoE's two
maxima, ...) stays in the graph as the model computes it and the experts become
`y = kiln::moe_experts(x, weights, ids, w_gate_up, w_down)`, provided the ids are indices of a
`topk` or `max` over the experts' scores (`_expert_indices`: the kernels index the weights by
them unchecked). The router GEMM stays in the graph: it is one small projection, which
`router_projections` finds by structure for the passes that must leave routers alone.
Shared experts (Qwen2-MoE, GLM-4.5) are a dense MLP beside this subgraph, untouched here (the
dense passes merge and fuse it like any MLP).

Llama 4's experts are not transformers' pluggable kind: every expert runs on every token, its
input scaled by the token's sigmoid score (0 off the top k). `match_llama4_experts` finds them
from their `repeat(x, [E, 1])`; they become `kiln::moe_experts` over the top-k pairs, each
pair's input x times its score (weights 1), the [E, in, out] weights transposed at load.

The match is written by hand rather than with `kiln.passes.pattern`: the block's
`view(..., [T, k, H])` carries the symbolic token count, which a pattern traced at fixed
example shapes cannot match.

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

from kiln.compiler.graph_inputs import add_graph_input, param_name, param_role
from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.fuse_common import CudaByDefault, node_dtype
from kiln.passes.pattern import propagate_val
from kiln.passes.weight_transforms import RearrangeExperts

aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default)
_SOFTMAX = (aten.softmax.int, aten._softmax.default)


@dataclass
class ExpertsMatch:
    """The experts of one block, from the repeated tokens to the weighted sum over their slots."""

    hidden: torch.fx.Node
    topk_weights: torch.fx.Node  # [T, k]: what the block flattens into each pair's weight
    topk_ids: torch.fx.Node      # [T, k]: what it flattens into each pair's expert
    w_gate_up: torch.fx.Node
    w_down: torch.fx.Node
    top_k: int
    output: torch.fx.Node  # the node whose uses the op's result takes over
    nodes: list[torch.fx.Node]  # every node of the experts' subgraph (erased once unused)
    # GPT-OSS's experts (`match_oai_experts`): [E, in, out] weights with gate and up channels
    # interleaved, biases, the clamped SwiGLU; the pass rearranges them (`RearrangeExperts`).
    b_gate_up: torch.fx.Node | None = None
    b_down: torch.fx.Node | None = None
    oai: tuple[float, float] | None = None  # (alpha, limit)
    # Llama 4's experts (`match_llama4_experts`): [E, in, out] weights, every expert's input
    # scaled by the token's score for it; `topk_weights` is then the [T, E] scores (0 off the
    # top k), which the pass gathers per pair.
    input_scaled: bool = False
    # The gated activation (`kiln::moe_experts`' `activation`): "silu", or Gemma 4's "gelu_tanh".
    activation: str = "silu"


@dataclass
class SoftmaxRouter:
    """A softmax -> top-k [-> renormalisation] router feeding an `ExpertsMatch`."""

    router_logits: torch.fx.Node
    renormalize: bool
    fp32_weights: bool
    nodes: list[torch.fx.Node]


def _is(node: object, *targets: object) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in targets


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _is_float32_cast(node: object) -> bool:
    return _is(node, *_CASTS) and node_dtype(node) == torch.float32  # type: ignore[arg-type]


def _shape(node: object) -> tuple[int, ...] | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _is_last_dim(node: torch.fx.Node, dim: object) -> bool:
    shape = _shape(node)
    return dim == -1 or (shape is not None and isinstance(dim, int) and dim == len(shape) - 1)


def _shapes_agree(hidden: object, logits: object, w_gate_up: object, w_down: object) -> bool:
    """hidden [T, H], logits [T, E] (None: not checked), w_gate_up [E, 2I, H], w_down [E, H, I]
    (sizes that are symbolic, like T, are not compared)."""
    h, gu, dn = _shape(hidden), _shape(w_gate_up), _shape(w_down)
    if h is None or gu is None or dn is None or len(h) != 2 or len(gu) != 3 or len(dn) != 3:
        return False
    if logits is not None:
        lg = _shape(logits)
        if lg is None or len(lg) != 2 or lg[1] != gu[0]:
            return False
    return gu[0] == dn[0] and gu[2] == dn[1] == h[1] and gu[1] == 2 * dn[2]


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


def _flattened(node: object) -> torch.fx.Node | None:
    """x for reshape(x, [-1]) / view(x, [-1])."""
    if _is(node, aten.reshape.default, aten.view.default) and list(node.args[1]) == [-1]:  # type: ignore[union-attr]
        return node.args[0]  # type: ignore[union-attr]
    return None


@dataclass
class _WeightedSum:
    """The block's tail: y * unsqueeze(flat_weights, -1) -> sum(view(., [T, k, H]), [1]) [-> cast]."""

    flat_weights: torch.fx.Node
    output: torch.fx.Node
    nodes: list[torch.fx.Node]


def _weighted_sum(expert_out: torch.fx.Node, hidden: torch.fx.Node, top_k: int) -> _WeightedSum | None:
    """The weighted sum over each token's k slots after the experts' output `expert_out`
    (the cast back to hidden's dtype included when there is one), or None."""
    weighted = _only_user(expert_out)
    if not (_is(weighted, aten.mul.Tensor) and weighted.args[0] is expert_out):
        return None
    col_weights = weighted.args[1]
    if not (_is(col_weights, aten.unsqueeze.default) and col_weights.args[1] == -1):
        return None
    slots = _only_user(weighted)
    if not (_is(slots, aten.view.default, aten.reshape.default) and len(slots.args[1]) == 3
            and slots.args[1][1] == top_k):
        return None
    summed = _only_user(slots)
    if not (_is(summed, aten.sum.dim_IntList) and list(summed.args[1]) == [1] and len(summed.args) == 2):
        return None
    output, after = summed, _only_user(summed)
    if _is(after, *_CASTS) and node_dtype(after) == node_dtype(hidden):
        output = after
    if node_dtype(output) != node_dtype(hidden):
        return None
    return _WeightedSum(flat_weights=col_weights.args[0], output=output,
                        nodes=[col_weights, weighted, slots, summed, *([output] if output is not summed else [])])


# The fused gated activations fuse_silu_mul forms, by `kiln::moe_experts` activation.
_GATED_OPS = {torch.ops.kiln.silu_and_mul.default: "silu", torch.ops.kiln.gelu_tanh_and_mul.default: "gelu_tanh"}


def _activation_name(node: object) -> str | None:
    """"silu" for silu(g), "gelu_tanh" for gelu(g, approximate="tanh") (Gemma 4's experts)."""
    if _is(node, aten.silu.default):
        return "silu"
    if _is(node, aten.gelu.default):
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")  # type: ignore[union-attr]
        return "gelu_tanh" if approximate == "tanh" else None
    return None


def _gated_activation_of(gate_up: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node], str] | None:
    """(act, nodes, activation) when `gate_up`'s only use is chunk(., 2, -1) into g, u and act =
    silu(g) * u or gelu_tanh(g) * u (or `kiln::silu_and_mul(g, u)` / `kiln::gelu_tanh_and_mul`,
    when fuse_silu_mul ran first); nodes: the chunk to act."""
    chunk = _only_user(gate_up)
    if not (_is(chunk, aten.chunk.default) and tuple(chunk.args[1:]) == (2, -1)):
        return None
    items = _getitems(chunk)
    if set(items) != {0, 1} or len(chunk.users) != 2:
        return None
    gate, up = items[0], items[1]
    fn = _only_user(gate)
    activation = _activation_name(fn)
    if activation is not None:
        act = _only_user(fn)  # type: ignore[arg-type]
        if not (_is(act, aten.mul.Tensor) and set(act.args) == {fn, up} and len(act.args) == 2):
            return None
        return act, [chunk, gate, up, fn, act], activation  # type: ignore[list-item]
    if _is(fn, *_GATED_OPS) and fn.args == (gate, up):  # type: ignore[union-attr]
        return fn, [chunk, gate, up, fn], _GATED_OPS[fn.target]  # type: ignore[union-attr,index,list-item]
    return None


def match_experts(repeated: torch.fx.Node) -> ExpertsMatch | None:
    """The experts around this `repeat_interleave(x, k, 0)` (the module doc's lines from `ids`
    on), or None when it is not a block of transformers' batched_mm experts."""
    if not (_is(repeated, aten.repeat_interleave.self_int) and len(repeated.args) >= 3 and repeated.args[2] == 0
            and not repeated.kwargs and isinstance(repeated.args[1], int)):
        return None
    hidden, top_k = repeated.args[0], repeated.args[1]
    col_gu = _only_user(repeated)
    bmm_gu = _only_user(col_gu) if col_gu is not None else None
    squeeze_gu = _only_user(bmm_gu) if bmm_gu is not None else None
    gate_up = _squeezed_bmm(squeeze_gu)
    if gate_up is None or gate_up[2] is not repeated:
        return None
    w_gate_up, ids, _ = gate_up
    gated = _gated_activation_of(squeeze_gu)
    if gated is None:
        return None
    act, act_nodes, activation = gated
    col_act = _only_user(act)
    bmm_down = _only_user(col_act) if col_act is not None else None
    squeeze_down = _only_user(bmm_down) if bmm_down is not None else None
    down = _squeezed_bmm(squeeze_down)
    if down is None or down[1] is not ids or down[2] is not act:
        return None
    w_down = down[0]
    tail = _weighted_sum(squeeze_down, hidden, top_k)
    if tail is None:
        return None
    topk_weights = _flattened(tail.flat_weights)
    flat_ids = _unclamped_ids(ids, w_down)
    topk_ids = _flattened(flat_ids) if flat_ids is not None else None
    if not isinstance(topk_weights, torch.fx.Node) or not isinstance(topk_ids, torch.fx.Node):
        return None
    if not _shapes_agree(hidden, None, w_gate_up, w_down):
        return None
    nodes = [repeated, col_gu, _gather_of(bmm_gu), bmm_gu, squeeze_gu, *act_nodes, col_act,
             _gather_of(bmm_down), bmm_down, squeeze_down, tail.flat_weights, *dict.fromkeys([flat_ids, ids]),
             *tail.nodes]
    return ExpertsMatch(hidden=hidden, topk_weights=topk_weights, topk_ids=topk_ids, w_gate_up=w_gate_up,
                        w_down=w_down, top_k=top_k, output=tail.output, nodes=nodes, activation=activation)


def _sigmoid_of_top_k(scores: object) -> tuple[torch.fx.Node, int] | None:
    """(ids, k) when `scores` is Llama 4's router output: sigmoid of the logits' top k scattered
    over -inf (so exactly 0 off the top k), casts around the sigmoid allowed."""
    node = scores
    while _is(node, *_CASTS):
        node = node.args[0]  # type: ignore[union-attr]
    if not _is(node, aten.sigmoid.default):
        return None
    node = node.args[0]  # type: ignore[union-attr]
    while _is(node, *_CASTS):
        node = node.args[0]  # type: ignore[union-attr]
    if not (_is(node, aten.scatter_.src, aten.scatter.src) and node.args[1] == 1):  # type: ignore[union-attr]
        return None
    base, ids, vals = node.args[0], node.args[2], node.args[3]  # type: ignore[union-attr]
    if not (_is(base, aten.full_like.default) and base.args[1] == float("-inf")):
        return None
    if not (_is(ids, operator.getitem) and ids.args[1] == 1 and _is(vals, operator.getitem) and vals.args[1] == 0
            and ids.args[0] is vals.args[0] and _is(ids.args[0], aten.topk.default)):
        return None
    topk = ids.args[0]
    if topk.args[0] is not base.args[0] or not isinstance(topk.args[1], int):
        return None
    return ids, topk.args[1]


def match_llama4_experts(repeated: torch.fx.Node) -> ExpertsMatch | None:
    """Llama 4's experts (`Llama4TextMoe`) around this `repeat(x, [E, 1])`: every expert runs
    on every token, its input scaled by the token's score for it:

        scores = to(sigmoid(to(scatter_(full_like(logits, -inf), 1, idx, vals), f32)), dtype)  # [T, E]
        x_e    = repeat(x, [E, 1]) * reshape(transpose(scores, 0, 1), [-1, 1])                 # [E*T, H]
        h      = bmm(view(x_e, [E, -1, H]), gate_up_proj)                                     # [E, H, 2I]
        g, u   = chunk(h, 2, -1)
        y      = view(bmm(u * silu(g), down_proj), [-1, H])                                   # [E, I, H]
        y      = sum(reshape(y, [E, -1, H]), [0])

    The experts have no biases, so an expert given 0 gives 0: only a token's top k add
    anything, and the op computes just those pairs, on x times the pair's score."""
    if not (_is(repeated, aten.repeat.default) and len(repeated.args) == 2 and len(repeated.args[1]) == 2
            and repeated.args[1][1] == 1 and isinstance(repeated.args[1][0], int)):
        return None
    hidden, num_experts = repeated.args[0], repeated.args[1][0]
    scaled = _only_user(repeated)
    if not _is(scaled, aten.mul.Tensor) or repeated not in scaled.args:
        return None
    col = _other(scaled, repeated)
    if not (_is(col, aten.reshape.default, aten.view.default) and list(col.args[1]) == [-1, 1]):
        return None
    transposed = col.args[0]
    if not (_is(transposed, aten.transpose.int) and tuple(transposed.args[1:]) in ((0, 1), (1, 0))):
        return None
    scores = transposed.args[0]
    routing = _sigmoid_of_top_k(scores)
    if routing is None:
        return None
    topk_ids, top_k = routing
    view_in = _only_user(scaled)
    bmm_gu = _only_user(view_in) if _is(view_in, aten.view.default, aten.reshape.default) else None
    if not (_is(bmm_gu, aten.bmm.default) and bmm_gu.args[0] is view_in and param_name(bmm_gu.args[1])):
        return None
    gated = _gated_activation_of(bmm_gu)
    if gated is None or gated[2] != "silu":  # (Llama 4's experts are SiLU's)
        return None
    act, act_nodes, _ = gated
    bmm_down = _only_user(act)
    if not (_is(bmm_down, aten.bmm.default) and bmm_down.args[0] is act and param_name(bmm_down.args[1])):
        return None
    flat = _only_user(bmm_down)
    per_expert = _only_user(flat) if _is(flat, aten.view.default, aten.reshape.default) else None
    summed = _only_user(per_expert) if _is(per_expert, aten.view.default, aten.reshape.default) else None
    if not (_is(summed, aten.sum.dim_IntList) and list(summed.args[1]) == [0] and len(summed.args) == 2):
        return None
    w_gate_up, w_down = bmm_gu.args[1], bmm_down.args[1]
    shapes = _shape(hidden), _shape(w_gate_up), _shape(w_down)
    if None in shapes or len(shapes[1]) != 3 or len(shapes[2]) != 3:
        return None
    (_, h), (e, h_in, two_i), (e2, i, h_out) = shapes  # type: ignore[misc]
    if not (e == e2 == num_experts and h == h_in == h_out and two_i == 2 * i):
        return None
    nodes = [repeated, transposed, col, scaled, view_in, bmm_gu, *act_nodes, bmm_down, flat, per_expert, summed]
    return ExpertsMatch(hidden=hidden, topk_weights=scores, topk_ids=topk_ids, w_gate_up=w_gate_up, w_down=w_down,
                        top_k=top_k, output=summed, nodes=nodes, input_scaled=True)


def _gathered_param(node: object, ids: torch.fx.Node) -> torch.fx.Node | None:
    """P for index(P, [ids]) with P a graph input."""
    if not (_is(node, aten.index.Tensor) and list(node.args[1]) == [ids]):  # type: ignore[union-attr]
        return None
    param = node.args[0]  # type: ignore[union-attr]
    return param if isinstance(param, torch.fx.Node) and param.op == "placeholder" else None


def _biased_transposed_bmm(squeeze: object) -> tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node,
                                                     torch.fx.Node, list[torch.fx.Node]] | None:
    """add(squeeze(bmm(unsqueeze(x, 1), index(W, [ids])), 1), index(b, [ids])) from its squeeze
    -> (W, b, ids, x, [its nodes]); transformers' batched_mm over [E, in, out] experts with biases."""
    if not (_is(squeeze, aten.squeeze.dim) and squeeze.args[1] == 1):  # type: ignore[union-attr]
        return None
    bmm = squeeze.args[0]  # type: ignore[union-attr]
    if not _is(bmm, aten.bmm.default):
        return None
    col, gathered = bmm.args
    if not (_is(col, aten.unsqueeze.default) and col.args[1] == 1 and _is(gathered, aten.index.Tensor)
            and len(gathered.args[1]) == 1):
        return None
    ids = gathered.args[1][0]
    weight = _gathered_param(gathered, ids)
    biased = _only_user(squeeze)
    if weight is None or not (_is(biased, aten.add.Tensor, aten.add_.Tensor) and biased.args[0] is squeeze):
        return None
    bias = _gathered_param(biased.args[1], ids)
    if bias is None:
        return None
    return weight, bias, ids, col.args[0], [col, gathered, bmm, squeeze, biased.args[1], biased]


def _clamp_bounds(node: object) -> tuple[object, object] | None:
    if not _is(node, aten.clamp.default):
        return None
    args = list(node.args[1:3]) + [None] * (3 - len(node.args))  # type: ignore[union-attr]
    return node.kwargs.get("min", args[0]), node.kwargs.get("max", args[1])  # type: ignore[union-attr]


def _other(node: torch.fx.Node, known: object) -> object:
    """The other argument of a two-argument op one of whose arguments is `known`."""
    a, b = node.args[:2]
    return b if a is known else a if b is known else None


def _oai_activation(gate_up: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node], float, float] | None:
    """GPT-OSS's clamped SwiGLU over interleaved gate/up channels, from its input:
        g = clamp(gate_up[:, 0::2], max=limit); u = clamp(gate_up[:, 1::2], -limit, limit)
        act = (u + 1) * (g * sigmoid(g * alpha))
    -> (act, [its nodes], alpha, limit)."""
    slices = {n.args[2]: n for n in gate_up.users if _is(n, aten.slice.Tensor)}
    if len(gate_up.users) != 2 or set(slices) != {0, 1}:
        return None
    for n in slices.values():
        if not (n.args[1] in (1, -1) and len(n.args) == 5 and n.args[4] == 2 and n.args[3] >= 2**62):
            return None
    gate_c, up_c = _only_user(slices[0]), _only_user(slices[1])
    gate_b, up_b = _clamp_bounds(gate_c), _clamp_bounds(up_c)
    if gate_b is None or up_b is None or gate_b[0] is not None or not isinstance(gate_b[1], float):
        return None
    limit = gate_b[1]
    if up_b != (-limit, limit) or len(gate_c.users) != 2:
        return None
    scaled = next((u for u in gate_c.users if _is(u, aten.mul.Tensor) and isinstance(_other(u, gate_c), float)), None)
    glu = next((u for u in gate_c.users if u is not scaled and _is(u, aten.mul.Tensor)), None)
    sig = _only_user(scaled) if scaled is not None else None
    if glu is None or not _is(sig, aten.sigmoid.default) or _other(glu, gate_c) is not sig:
        return None
    alpha = _other(scaled, gate_c)
    plus_one, act = _only_user(up_c), _only_user(glu)
    if not (_is(plus_one, aten.add.Tensor) and plus_one.args == (up_c, 1) and _is(act, aten.mul.Tensor)
            and _other(act, plus_one) is glu and _only_user(plus_one) is act):
        return None
    return act, [slices[0], slices[1], gate_c, up_c, scaled, sig, glu, plus_one, act], float(alpha), float(limit)


def match_oai_experts(repeated: torch.fx.Node) -> ExpertsMatch | None:
    """GPT-OSS's experts around this `repeat_interleave(x, k, 0)`: transformers' batched_mm over
    [E, in, out] weights with biases (`is_transposed`, `has_bias`) and its clamped SwiGLU over
    interleaved gate/up channels, then the usual weighted sum; or None."""
    if not (_is(repeated, aten.repeat_interleave.self_int) and len(repeated.args) >= 3 and repeated.args[2] == 0
            and not repeated.kwargs and isinstance(repeated.args[1], int)):
        return None
    hidden, top_k = repeated.args[0], repeated.args[1]
    col = _only_user(repeated)
    bmm = _only_user(col) if col is not None else None
    gate_up = _biased_transposed_bmm(_only_user(bmm) if bmm is not None else None)
    if gate_up is None or gate_up[3] is not repeated:
        return None
    w_gate_up, b_gate_up, ids, _, gu_nodes = gate_up
    activation = _oai_activation(gu_nodes[-1])
    if activation is None:
        return None
    act, act_nodes, alpha, limit = activation
    col_down = _only_user(act)
    bmm_down = _only_user(col_down) if col_down is not None else None
    down = _biased_transposed_bmm(_only_user(bmm_down) if bmm_down is not None else None)
    if down is None or down[2] is not ids or down[3] is not act:
        return None
    w_down, b_down, _, _, down_nodes = down
    tail = _weighted_sum(down_nodes[-1], hidden, top_k)
    if tail is None:
        return None
    flat_ids = _unclamped_ids(ids, w_down)  # (transformers 5.17 clamps them too)
    topk_weights = _flattened(tail.flat_weights)
    topk_ids = _flattened(flat_ids) if flat_ids is not None else None
    if not isinstance(topk_weights, torch.fx.Node) or not isinstance(topk_ids, torch.fx.Node):
        return None
    gu, dn, hs = _shape(w_gate_up), _shape(w_down), _shape(hidden)  # [E, H, 2I], [E, I, H], [T, H]
    if (gu is None or dn is None or hs is None or len(gu) != 3 or len(dn) != 3
            or not (gu[0] == dn[0] and gu[1] == dn[2] == hs[-1] and gu[2] == 2 * dn[1])):
        return None
    nodes = [repeated, *gu_nodes, *act_nodes, *down_nodes, tail.flat_weights, *dict.fromkeys([flat_ids, ids]),
             *tail.nodes]
    return ExpertsMatch(hidden=hidden, topk_weights=topk_weights, topk_ids=topk_ids, w_gate_up=w_gate_up,
                        w_down=w_down, top_k=top_k, output=tail.output, nodes=nodes, b_gate_up=b_gate_up,
                        b_down=b_down, oai=(alpha, limit))


def _gather_of(bmm: torch.fx.Node) -> torch.fx.Node:
    """The `index(W, [ids])` gather a matched bmm multiplies by."""
    return bmm.args[0]  # type: ignore[return-value]


def match_softmax_router(experts: ExpertsMatch) -> SoftmaxRouter | None:
    """The softmax -> top-k [-> div by the sum] [-> cast] router of the module doc behind these
    experts' weights and ids, or None for any other router."""
    idx = experts.topk_ids
    if not (_is(idx, operator.getitem) and idx.args[1] == 1):
        return None
    topk = idx.args[0]
    if not (_is(topk, aten.topk.default) and len(topk.args) == 2 and not topk.kwargs
            and topk.args[1] == experts.top_k):  # only topk(x, k): last dim, largest, sorted
        return None
    softmax = topk.args[0]
    if not (_is(softmax, *_SOFTMAX) and _is_last_dim(softmax, softmax.args[1]) and _only_user(softmax) is topk):
        return None
    nodes = [softmax, topk]
    router_logits = softmax.args[0]
    if _is_float32_cast(router_logits) and _only_user(router_logits) is softmax:
        nodes.append(router_logits)
        router_logits = router_logits.args[0]
    if node_dtype(softmax) != torch.float32:
        return None
    items = _getitems(topk)
    if set(items) != {0, 1} or len(topk.users) != 2:
        return None
    vals = items[0]
    nodes += [vals, idx]
    # Routing weights: vals [div_(vals, sum(vals, [-1], True))] [to(dtype)].
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
    if _is(cast, *_CASTS) and cast is experts.topk_weights:
        nodes.append(cast)
        weights = cast
    if weights is not experts.topk_weights or not _shapes_agree(experts.hidden, router_logits, experts.w_gate_up,
                                                                 experts.w_down):
        return None
    return SoftmaxRouter(router_logits=router_logits, renormalize=renormalize,
                         fp32_weights=node_dtype(weights) == torch.float32, nodes=nodes)


def _private(nodes: list[torch.fx.Node], output: torch.fx.Node) -> bool:
    """Every node but the output is used only inside `nodes`."""
    inside = set(nodes)
    return all(node is output or all(u in inside for u in node.users) for node in nodes)


def _expert_indices(ids: object, num_experts: int) -> bool:
    """ids hold valid experts by construction (the kernels index the weights by them unchecked):
    the indices of a `topk` or a `max` over a last dimension of `num_experts` scores, or such
    indices concatenated along the last dimension (PhiMoE's two `max`es)."""
    if _is(ids, aten.cat.default, aten.concat.default):
        parts, dim = ids.args[0], ids.args[1] if len(ids.args) > 1 else ids.kwargs.get("dim", 0)  # type: ignore[union-attr]
        return _is_last_dim(ids, dim) and all(_expert_indices(p, num_experts) for p in parts)  # type: ignore[arg-type]
    if not (_is(ids, operator.getitem) and ids.args[1] == 1):  # type: ignore[union-attr]
        return False
    select = ids.args[0]  # type: ignore[union-attr]
    if _is(select, aten.topk.default):
        args = list(select.args) + [None] * (3 - len(select.args))
        dim = select.kwargs.get("dim", args[2] if args[2] is not None else -1)
    elif _is(select, aten.max.dim):
        dim = select.args[1]
    else:
        return False
    scores = select.args[0]
    shape = _shape(scores)
    return shape is not None and len(shape) == 2 and shape[-1] == num_experts and _is_last_dim(scores, dim)


def _routes_each_token(experts: ExpertsMatch) -> bool:
    """The ids and weights are [T, top_k] and the ids are valid experts (`_expert_indices`)."""
    num_experts = _shape(experts.w_gate_up)[0]  # type: ignore[index]  (either layout: E first)
    ids, weights = _shape(experts.topk_ids), _shape(experts.topk_weights)
    return (ids is not None and weights is not None and len(ids) == len(weights) == 2
            and ids[1] == weights[1] == experts.top_k and _expert_indices(experts.topk_ids, num_experts))


@dataclass
class MoEBlock:
    """A block to rewrite: its experts, and the softmax router when the op takes that in too."""

    experts: ExpertsMatch
    router: SoftmaxRouter | None

    @property
    def nodes(self) -> list[torch.fx.Node]:
        return self.experts.nodes + (self.router.nodes if self.router else [])


def find_moe_blocks(gm: torch.fx.GraphModule) -> list[MoEBlock]:
    """Every MoE block of the graph: a softmax router with its experts (-> `kiln::fused_moe`),
    or experts after any other router whose ids are valid experts (-> `kiln::moe_experts`)."""
    blocks = []
    for node in gm.graph.find_nodes(op="call_function", target=aten.repeat.default):
        experts = match_llama4_experts(node)
        if experts is not None and _private(experts.nodes, experts.output):
            blocks.append(MoEBlock(experts, None))
    for node in gm.graph.find_nodes(op="call_function", target=aten.repeat_interleave.self_int):
        experts = match_experts(node) or match_oai_experts(node)
        if experts is None:
            continue
        # kiln::fused_moe computes SiLU experts only; others keep their router in the graph.
        router = match_softmax_router(experts) if experts.oai is None and experts.activation == "silu" else None
        if router is not None and _private(experts.nodes + router.nodes, experts.output):
            blocks.append(MoEBlock(experts, router))
        elif _private(experts.nodes, experts.output) and _routes_each_token(experts):
            blocks.append(MoEBlock(experts, None))
    return blocks


def router_projections(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The `aten.linear` nodes that compute MoE routers' scores: the first projections met
    walking back from what decides the routing (a fused op's router logits, `kiln::moe_experts`'
    weights and ids, or an unfused block's) without passing the block's input hidden states.
    Other passes leave them in the model dtype (quantize_fp8: a few columns whose ranking picks
    the experts), whatever the router's name."""
    starts: list[object] = []
    blocked: set[torch.fx.Node] = set()  # the blocks' inputs: the router reads them, so does all else
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.fused_moe.default):
        starts.append(node.args[1])
        blocked.add(node.args[0])
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.moe_experts.default):
        starts += [node.args[1], node.args[2]]
        blocked.add(node.args[0])
    for node in gm.graph.find_nodes(op="call_function", target=aten.repeat_interleave.self_int):
        experts = match_experts(node) or match_oai_experts(node)
        if experts is not None:
            starts += [experts.topk_weights, experts.topk_ids]
            blocked.add(experts.hidden)
    routers: set[torch.fx.Node] = set()
    seen = set(blocked)
    while starts:
        node = starts.pop()
        if not isinstance(node, torch.fx.Node) or node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if node.target is aten.linear.default:
            routers.add(node)
            continue  # the router's input is the block's hidden state: not routing any more
        # Only through the data: type_as(x, other) takes other's dtype alone, and a shape
        # (sym_size of the residual stream, in a view's sizes) is no routing input.
        inputs = [node.args[0]] if node.target is aten.type_as.default else node.all_input_nodes
        starts += [a for a in inputs if isinstance(a, torch.fx.Node)
                   and not isinstance(a.meta.get("val"), (int, torch.SymInt))]
    return routers


class FuseMoEPass(CudaByDefault, KilnPass):
    name = "fuse_moe"
    phase = "fusion"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        if not self.applies_to(gm):
            return {"skipped_on_cpu": 1}
        blocks = find_moe_blocks(gm)
        graph = gm.graph
        for block in blocks:
            m = block.experts
            fused = _fused_op(gm, ctx, block)
            if "val" in m.output.meta:
                fused.meta["val"] = m.output.meta["val"]
            m.output.replace_all_uses_with(fused)
            for node in reversed(_topological(graph, block.nodes)):
                if not node.users:
                    graph.erase_node(node)
            for param in (m.w_gate_up, m.b_gate_up, m.w_down) if m.oai is not None or m.input_scaled else ():
                if param is not None and not param.users:  # rearranged into new inputs: the loader must not bind it
                    graph.erase_node(param)
        if blocks:
            graph.lint()
            gm.recompile()
        return {"fused_moe": sum(b.router is not None for b in blocks),
                "moe_experts": sum(b.router is None for b in blocks)}


def _fused_op(gm: torch.fx.GraphModule, ctx: PassContext, block: MoEBlock) -> torch.fx.Node:
    """The op that computes `block` (inserted before its output)."""
    m, router = block.experts, block.router
    if m.input_scaled:
        return _input_scaled_experts(gm, ctx, m)
    graph = gm.graph
    if m.oai is not None:
        weights, kwargs = _rearranged_oai_experts(gm, ctx, m)
        with graph.inserting_before(m.output):
            return graph.call_function(torch.ops.kiln.moe_experts.default,
                                       (m.hidden, m.topk_weights, m.topk_ids, *weights), kwargs)
    with graph.inserting_before(m.output):
        if router is not None:
            return graph.call_function(torch.ops.kiln.fused_moe.default, (
                m.hidden, router.router_logits, m.w_gate_up, m.w_down, m.top_k, router.renormalize,
                router.fp32_weights))
        return graph.call_function(torch.ops.kiln.moe_experts.default,
                                   (m.hidden, m.topk_weights, m.topk_ids, m.w_gate_up, m.w_down),
                                   {"activation": m.activation} if m.activation != "silu" else {})


def _rearranged_oai_experts(gm: torch.fx.GraphModule, ctx: PassContext,
                            m: ExpertsMatch) -> tuple[tuple[torch.fx.Node, torch.fx.Node], dict[str, object]]:
    """GPT-OSS's expert tensors as `kiln::moe_experts` takes them: new inputs (w_gate_up
    [E, 2I, H] gate rows then up rows, its bias likewise, w_down [E, H, I]) built at load by
    `RearrangeExperts`; -> (w_gate_up, w_down) and the op's keyword arguments."""
    made = {key: _rearranged_input(gm, ctx, param, key, transpose, deinterleave)
            for key, param, transpose, deinterleave in (("w_gate_up", m.w_gate_up, True, True),
                                                        ("b_gate_up", m.b_gate_up, False, True),
                                                        ("w_down", m.w_down, True, False))}
    alpha, limit = m.oai  # type: ignore[misc]
    kwargs = {"b_gate_up": made["b_gate_up"], "b_down": m.b_down, "activation": "swiglu_oai",
              "alpha": alpha, "limit": limit}
    return (made["w_gate_up"], made["w_down"]), kwargs


def _rearranged_input(gm: torch.fx.GraphModule, ctx: PassContext, param: torch.fx.Node, key: str,
                      transpose: bool, deinterleave: bool = False) -> torch.fx.Node:
    """Expert tensor `param` as `kiln::moe_experts` takes it: a new input `<experts>.<key>`
    that the loader builds (`RearrangeExperts`: [E, in, out] transposed, interleaved gate/up
    channels reordered)."""
    source = param_name(param)
    if source is None:
        raise ValueError(f"fuse_moe: expert input {param.name} is not a parameter")
    name = f"{source.rsplit('.', 1)[0]}.{key}"  # model.layers.N.mlp.experts.w_gate_up, ...
    val = param.meta.get("val")
    example = None
    if isinstance(val, torch.Tensor):
        example = val.transpose(1, 2).contiguous() if transpose else val.clone()
    ctx.weight_transforms.append(RearrangeExperts(output=name, input=source, transpose=transpose,
                                                  deinterleave=deinterleave))
    return add_graph_input(gm, name.replace(".", "_"), param_role(name), example)


def _input_scaled_experts(gm: torch.fx.GraphModule, ctx: PassContext, m: ExpertsMatch) -> torch.fx.Node:
    """Llama 4's block as `kiln::moe_experts` over its (token, expert) pairs (`match_llama4_experts`):
    each pair's input is the token's hidden state times the pair's score, rounded as the model
    rounds it, one pair a row (weight 1), then each token's k rows summed."""
    graph = gm.graph
    hidden_size = _shape(m.hidden)[-1]  # type: ignore[index]
    w_gate_up = _rearranged_input(gm, ctx, m.w_gate_up, "w_gate_up", transpose=True)
    w_down = _rearranged_input(gm, ctx, m.w_down, "w_down", transpose=True)

    def call(target: object, *args: object, **kwargs: object) -> torch.fx.Node:
        node = graph.call_function(target, args, kwargs)
        propagate_val(node)
        return node

    with graph.inserting_before(m.output):
        pair_scores = call(aten.gather.default, m.topk_weights, 1, m.topk_ids)  # [T, k]
        scaled = call(aten.mul.Tensor, call(aten.unsqueeze.default, m.hidden, 1),
                      call(aten.unsqueeze.default, pair_scores, -1))  # [T, k, H]
        rows = call(aten.reshape.default, scaled, [-1, hidden_size])
        ids = call(aten.reshape.default, m.topk_ids, [-1, 1])
        ones = call(aten.ones_like.default, ids, dtype=torch.float32)
        out = call(torch.ops.kiln.moe_experts.default, rows, ones, ids, w_gate_up, w_down)
        return call(aten.sum.dim_IntList, call(aten.reshape.default, out, [-1, m.top_k, hidden_size]), [1])


def _topological(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> list[torch.fx.Node]:
    wanted = set(nodes)
    return [n for n in graph.nodes if n in wanted]
