"""`kiln::fused_moe`: a mixture-of-experts block's routed experts in one op.

    hidden         [T, H]        the tokens (after the block's norm)
    router_logits  [T, E]        the router's projection of `hidden` (the one GEMM left outside)
    w_gate_up      [E, 2I, H]    per expert: gate rows then up rows (transformers 5's layout)
    w_down         [E, H, I]
    top_k          int           experts per token
    renormalize    bool          top-k weights divided by their sum (Mixtral; `norm_topk_prob`)
    fp32_weights   bool          routing weights stay float32 when they scale the expert outputs
                                 (Mixtral); otherwise they are rounded to the model dtype first
                                 (Qwen2/3-MoE, OLMoE). Only differs from False below float32.
Returns [T, H] in hidden's dtype:

    sum over the token's top-k experts e of  weight_e * down_e(silu(gate_e(x)) * up_e(x))

with the router computed as transformers does it: softmax in float32, top-k, optional
renormalisation. A shared expert (Qwen2-MoE) is not part of the op: it is a dense MLP over
every token, which the dense passes and kernels already serve. Its sigmoid gate and the sum
with this op's output are `kiln::add_gated_shared_expert` (below; the
`fuse_shared_expert_gate` pass).

The CPU implementation is the reference below: tokens are grouped by expert (one stable sort
of the T*top_k (token, expert) pairs), each expert's rows go through its gate/up GEMM, SiLU
and multiply, and its down GEMM, are scaled by their routing weights and scattered back to
their (token, slot) place; the slots are summed per token. It rounds where the batched_mm
graph transformers exports rounds, so on CPU the fused graph equals the unfused one.
`kiln.kernels.triton_moe` registers the CUDA implementation (a grouped GEMM).

`kiln::moe_experts` is the same op with the routing given instead of computed:

    moe_experts(hidden [T, H], topk_weights [T, k], topk_ids [T, k], w_gate_up, w_down) -> [T, H]

for the routers that are not a softmax and a top-k (DeepSeek-V3's sigmoid scores with a
selection bias and expert groups, GLM-4.5's, Ernie 4.5's, ...): `fuse_moe` leaves such a
router in the graph, as the model computes it, and fuses the experts after it. The weights'
dtype decides the rounding of the weighted sum as `fp32_weights` does in `fused_moe`, which is
`route` followed by this op.

Keyword-only, for experts that are not a bias-free SiLU-and-mul (GPT-OSS, Gemma 4):

    b_gate_up  [E, 2I] or None   added to the gate/up GEMM's output (gate half, then up half)
    b_down     [E, H] or None    added to the down GEMM's output, before the routing weight
    activation "silu"            silu(gate) * up
               "gelu_tanh"       gelu(gate, approximate="tanh") * up (Gemma 4's experts)
               "swiglu_oai"      GPT-OSS's clamped SwiGLU: gate = min(gate, limit),
                                 up = clamp(up, -limit, limit),
                                 (up + 1) * gate * sigmoid(alpha * gate)
    alpha, limit                 that activation's constants (GPT-OSS: 1.702 and 7.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kiln.kernels.library import kiln_op


@dataclass(frozen=True)
class Routing:
    """Each token's experts and their weights, as the router computes them."""

    weights: torch.Tensor  # [T, top_k] float32, or the model dtype (see `fp32_weights`)
    experts: torch.Tensor  # [T, top_k] int64


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool,
          dtype: torch.dtype) -> Routing:
    """transformers' top-k router: softmax in float32, top-k, optional renormalisation."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not fp32_weights:
        weights = weights.to(dtype)
    return Routing(weights=weights, experts=experts)


def check_fused_moe_args(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                         w_down: torch.Tensor, top_k: int) -> None:
    if hidden.dim() != 2 or router_logits.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(
            f"fused_moe: expected hidden [T, H], router_logits [T, E], w_gate_up [E, 2I, H], w_down [E, H, I]; got "
            f"{tuple(hidden.shape)}, {tuple(router_logits.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    t, h = hidden.shape
    e, two_i, h2 = w_gate_up.shape
    if router_logits.shape[0] != t or router_logits.shape[1] != e or h2 != h or two_i % 2:
        raise ValueError(f"fused_moe: shapes disagree: hidden {tuple(hidden.shape)}, router_logits "
                         f"{tuple(router_logits.shape)}, w_gate_up {tuple(w_gate_up.shape)}")
    if tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(f"fused_moe: w_down {tuple(w_down.shape)} should be {(e, h, two_i // 2)}")
    if not 1 <= top_k <= e:
        raise ValueError(f"fused_moe: top_k={top_k} must be in 1..{e} (the number of experts)")


EXPERT_ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")


def expert_activation(gate_up: torch.Tensor, activation: str = "silu", alpha: float = 1.702,
                      limit: float = 7.0) -> torch.Tensor:
    """[rows, 2I] gate/up products (gate half first) -> [rows, I], as the model's graph
    computes it (module doc), each op rounding in gate_up's dtype."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


@dataclass(frozen=True)
class ExpertExtras:
    """`kiln::moe_experts`' keyword-only arguments (module doc), as one value the kernels' launchers pass on."""

    b_gate_up: torch.Tensor | None = None
    b_down: torch.Tensor | None = None
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0

    def kwargs(self) -> dict[str, Any]:
        return {"b_gate_up": self.b_gate_up, "b_down": self.b_down, "activation": self.activation,
                "alpha": self.alpha, "limit": self.limit}


def check_expert_extras(w_gate_up: torch.Tensor, w_down: torch.Tensor, b_gate_up: torch.Tensor | None,
                        b_down: torch.Tensor | None, activation: str) -> None:
    """ValueError unless the biases and activation are those of the module doc."""
    if activation not in EXPERT_ACTIVATIONS:
        raise ValueError(f"moe_experts: activation {activation!r} is not one of {', '.join(EXPERT_ACTIVATIONS)}")
    for bias, weight, name in ((b_gate_up, w_gate_up, "b_gate_up"), (b_down, w_down, "b_down")):
        if bias is not None and tuple(bias.shape) != tuple(weight.shape[:2]):
            raise ValueError(f"moe_experts: {name} must be {tuple(weight.shape[:2])} (one per expert and output "
                             f"channel), got {tuple(bias.shape)}")


def check_moe_experts_args(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           w_gate_up: torch.Tensor, w_down: torch.Tensor) -> None:
    """ValueError unless the shapes and dtypes are those of `kiln::moe_experts` (module doc)."""
    if hidden.dim() != 2 or w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"moe_experts: expected hidden [T, H], w_gate_up [E, 2I, H], w_down [E, H, I]; got "
                         f"{tuple(hidden.shape)}, {tuple(w_gate_up.shape)}, {tuple(w_down.shape)}")
    t, h = hidden.shape
    e, two_i, h2 = w_gate_up.shape
    if topk_weights.dim() != 2 or tuple(topk_ids.shape) != tuple(topk_weights.shape) or topk_weights.shape[0] != t:
        raise ValueError(f"moe_experts: topk_weights and topk_ids must both be [T, k] with T = {t} tokens; got "
                         f"{tuple(topk_weights.shape)} and {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int64, torch.int32) or not topk_weights.is_floating_point():
        raise ValueError(f"moe_experts: topk_ids must be int64 or int32 and topk_weights floating point; got "
                         f"{topk_ids.dtype} and {topk_weights.dtype}")
    if h2 != h or two_i % 2 or tuple(w_down.shape) != (e, h, two_i // 2):
        raise ValueError(f"moe_experts: shapes disagree: hidden {tuple(hidden.shape)}, w_gate_up "
                         f"{tuple(w_gate_up.shape)}, w_down {tuple(w_down.shape)} (should be {(e, h, two_i // 2)})")
    if not 1 <= topk_weights.shape[1] <= e:
        raise ValueError(f"moe_experts: {topk_weights.shape[1]} experts a token must be in 1..{e} (the number of experts)")


def moe_experts_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                          w_gate_up: torch.Tensor, w_down: torch.Tensor, *, b_gate_up: torch.Tensor | None = None,
                          b_down: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                          limit: float = 7.0) -> torch.Tensor:
    """The routed experts of `kiln::moe_experts` (module doc), grouped by expert."""
    check_moe_experts_args(hidden, topk_weights, topk_ids, w_gate_up, w_down)
    check_expert_extras(w_gate_up, w_down, b_gate_up, b_down, activation)
    t, h = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts = w_gate_up.shape[0]
    # The graph multiplies bf16 expert outputs by float32 weights (Mixtral) in float32.
    out_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    pairs = topk_ids.reshape(-1).long()                     # pair p = token p // top_k, slot p % top_k
    order = torch.argsort(pairs, stable=True)               # pairs grouped by expert
    counts = torch.bincount(pairs, minlength=num_experts).tolist()
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order]
    out = torch.zeros(t * top_k, h, dtype=out_dtype, device=hidden.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        x = hidden[tokens[rows]]
        gate_up = F.linear(x, w_gate_up[e])
        if b_gate_up is not None:
            gate_up = gate_up + b_gate_up[e]
        act = expert_activation(gate_up, activation, alpha, limit)
        y = F.linear(act, w_down[e])
        if b_down is not None:
            y = y + b_down[e]
        out[order[rows]] = y * weights[rows, None]
        start += n
    return out.view(t, top_k, h).sum(dim=1).to(hidden.dtype)


def fused_moe_reference(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                        w_down: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool) -> torch.Tensor:
    check_fused_moe_args(hidden, router_logits, w_gate_up, w_down, top_k)
    routing = route(router_logits, top_k, renormalize, fp32_weights, hidden.dtype)
    return moe_experts_reference(hidden, routing.weights, routing.experts, w_gate_up, w_down)


def fused_moe_grouped_mm(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                         w_down: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool) -> torch.Tensor:
    """`fused_moe` by `moe_experts_grouped_mm`."""
    check_fused_moe_args(hidden, router_logits, w_gate_up, w_down, top_k)
    routing = route(router_logits, top_k, renormalize, fp32_weights, hidden.dtype)
    return moe_experts_grouped_mm(hidden, routing.weights, routing.experts, w_gate_up, w_down)


def moe_experts_grouped_mm(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           w_gate_up: torch.Tensor, w_down: torch.Tensor, *, b_gate_up: torch.Tensor | None = None,
                           b_down: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                           limit: float = 7.0) -> torch.Tensor:
    """The reference's computation with each GEMM one `torch._grouped_mm` over every expert
    (on CUDA, CUTLASS's grouped GEMM; torch also runs it on CPU) instead of a loop: the pairs
    sorted by expert, the per-expert row counts' prefix sums as the groups' ends. Device ops
    only, no host read, so a step can be captured in a CUDA graph. Unlike the Triton kernels
    it writes the [pairs, 2I] gate/up output (at 16k tokens of Mixtral, 1.9 GB): an
    alternative for prefill-sized steps, timed against them by bench/tune_moe.py."""
    check_moe_experts_args(hidden, topk_weights, topk_ids, w_gate_up, w_down)
    check_expert_extras(w_gate_up, w_down, b_gate_up, b_down, activation)
    t, h = hidden.shape
    top_k = topk_ids.shape[1]
    num_experts = w_gate_up.shape[0]
    out_dtype = torch.promote_types(hidden.dtype, topk_weights.dtype)
    pairs = topk_ids.reshape(-1).long()
    order = torch.argsort(pairs, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=hidden.device)
    counts.index_add_(0, pairs, torch.ones_like(pairs, dtype=torch.int32))  # no bincount: it reads max() back
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    x = hidden[order // top_k]
    # [E, H, 2I] and [E, I, H] views: column-major per expert, as the grouped GEMM takes them.
    gate_up = torch._grouped_mm(x, w_gate_up.transpose(1, 2), offs=ends)
    sorted_experts = pairs[order] if b_gate_up is not None or b_down is not None else None
    if b_gate_up is not None:
        gate_up = gate_up + b_gate_up[sorted_experts]
    act = expert_activation(gate_up, activation, alpha, limit)
    y = torch._grouped_mm(act, w_down.transpose(1, 2), offs=ends)
    if b_down is not None:
        y = y + b_down[sorted_experts]
    out = torch.empty(t * top_k, h, dtype=out_dtype, device=hidden.device)
    out[order] = y * topk_weights.reshape(-1)[order, None]
    return out.view(t, top_k, h).sum(dim=1).to(hidden.dtype)


@kiln_op("kiln::fused_moe", mutates_args=())
def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool, fp32_weights: bool) -> torch.Tensor:
    return fused_moe_reference(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, fp32_weights)


@fused_moe.register_fake
def _fused_moe_fake(hidden, router_logits, w_gate_up, w_down, top_k, renormalize, fp32_weights):
    return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)


@kiln_op("kiln::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, *, b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    return moe_experts_reference(hidden, topk_weights, topk_ids, w_gate_up, w_down, b_gate_up=b_gate_up,
                                 b_down=b_down, activation=activation, alpha=alpha, limit=limit)


@moe_experts.register_fake
def _moe_experts_fake(hidden, topk_weights, topk_ids, w_gate_up, w_down, *, b_gate_up=None, b_down=None,
                      activation="silu", alpha=1.702, limit=7.0):
    return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)


# ---- FP8 experts (weight-only) ------------------------------------------------------------------
#
# `kiln::fused_moe_fp8` (and `kiln::moe_experts_fp8`): the same ops over e4m3 expert weights with one float32 scale per expert
# and output channel (`w_gate_up_scale` [E, 2I], `w_down_scale` [E, H]), as `quantize_fp8`
# leaves them with `experts=True` (passes/quantize_fp8.py). The activations stay in the model
# dtype (weight-only: each product is sum_k x[k] * w_q[k] in float32, times the channel's
# scale), so the routing, the rounding points and the result's dtype are fused_moe's.


def check_fused_moe_fp8_args(w_gate_up: torch.Tensor, w_gate_up_scale: torch.Tensor, w_down: torch.Tensor,
                             w_down_scale: torch.Tensor) -> None:
    from kiln.kernels.fp8 import FP8_DTYPE

    if w_gate_up.dtype != FP8_DTYPE or w_down.dtype != FP8_DTYPE:
        raise ValueError(f"fused_moe_fp8: expert weights must be {FP8_DTYPE}, got {w_gate_up.dtype} and {w_down.dtype}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"fused_moe_fp8: expected w_gate_up [E, 2I, H] and w_down [E, H, I], got "
                         f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    for w, scale, name in ((w_gate_up, w_gate_up_scale, "w_gate_up_scale"), (w_down, w_down_scale, "w_down_scale")):
        if tuple(scale.shape) != tuple(w.shape[:2]) or scale.dtype != torch.float32:
            raise ValueError(f"fused_moe_fp8: {name} must be float32 {tuple(w.shape[:2])} (one scale per expert and "
                             f"output channel), got {scale.dtype} {tuple(scale.shape)}")


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, K] e4m3 expert weights times their [E, N] channel scales, in `dtype`."""
    return (w.float() * scale[..., None]).to(dtype)


def fused_moe_fp8_reference(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                            w_gate_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor,
                            top_k: int, renormalize: bool, fp32_weights: bool) -> torch.Tensor:
    """fused_moe over the dequantized experts."""
    check_fused_moe_fp8_args(w_gate_up, w_gate_up_scale, w_down, w_down_scale)
    return fused_moe_reference(hidden, router_logits, dequantize_experts(w_gate_up, w_gate_up_scale, hidden.dtype),
                               dequantize_experts(w_down, w_down_scale, hidden.dtype), top_k, renormalize,
                               fp32_weights)


@kiln_op("kiln::fused_moe_fp8", mutates_args=())
def fused_moe_fp8(hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                  w_gate_up_scale: torch.Tensor, w_down: torch.Tensor, w_down_scale: torch.Tensor, top_k: int,
                  renormalize: bool, fp32_weights: bool) -> torch.Tensor:
    return fused_moe_fp8_reference(hidden, router_logits, w_gate_up, w_gate_up_scale, w_down, w_down_scale, top_k,
                                   renormalize, fp32_weights)


@fused_moe_fp8.register_fake
def _fused_moe_fp8_fake(hidden, router_logits, w_gate_up, w_gate_up_scale, w_down, w_down_scale, top_k, renormalize,
                        fp32_weights):
    return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)


def moe_experts_fp8_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                              w_gate_up: torch.Tensor, w_gate_up_scale: torch.Tensor, w_down: torch.Tensor,
                              w_down_scale: torch.Tensor, **extras: Any) -> torch.Tensor:
    """moe_experts over the dequantized experts (`extras`: moe_experts' keyword-only arguments)."""
    check_fused_moe_fp8_args(w_gate_up, w_gate_up_scale, w_down, w_down_scale)
    return moe_experts_reference(hidden, topk_weights, topk_ids,
                                 dequantize_experts(w_gate_up, w_gate_up_scale, hidden.dtype),
                                 dequantize_experts(w_down, w_down_scale, hidden.dtype), **extras)


@kiln_op("kiln::moe_experts_fp8", mutates_args=())
def moe_experts_fp8(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    w_gate_up: torch.Tensor, w_gate_up_scale: torch.Tensor, w_down: torch.Tensor,
                    w_down_scale: torch.Tensor, *, b_gate_up: torch.Tensor | None = None,
                    b_down: torch.Tensor | None = None, activation: str = "silu", alpha: float = 1.702,
                    limit: float = 7.0) -> torch.Tensor:
    return moe_experts_fp8_reference(hidden, topk_weights, topk_ids, w_gate_up, w_gate_up_scale, w_down, w_down_scale,
                                     b_gate_up=b_gate_up, b_down=b_down, activation=activation, alpha=alpha,
                                     limit=limit)


@moe_experts_fp8.register_fake
def _moe_experts_fp8_fake(hidden, topk_weights, topk_ids, w_gate_up, w_gate_up_scale, w_down, w_down_scale, *,
                          b_gate_up=None, b_down=None, activation="silu", alpha=1.702, limit=7.0):
    return torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)


# ---- a shared expert's sigmoid gate -----------------------------------------------------------

def check_gated_shared_expert_args(out: torch.Tensor, shared: torch.Tensor, hidden: torch.Tensor,
                                   gate_weight: torch.Tensor) -> None:
    if out.shape != shared.shape:
        raise ValueError(f"add_gated_shared_expert: out {tuple(out.shape)} and shared {tuple(shared.shape)} "
                         "differ in shape")
    if gate_weight.dim() != 2 or gate_weight.shape[0] != 1 or gate_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"add_gated_shared_expert: gate_weight must be [1, {hidden.shape[-1]}] (hidden's width), "
                         f"got {tuple(gate_weight.shape)}")
    if hidden.shape[:-1] != out.shape[:-1]:
        raise ValueError(f"add_gated_shared_expert: hidden {tuple(hidden.shape)} and out {tuple(out.shape)} differ "
                         "in their tokens")


def add_gated_shared_expert_reference(out: torch.Tensor, shared: torch.Tensor, hidden: torch.Tensor,
                                      gate_weight: torch.Tensor) -> torch.Tensor:
    return out + torch.sigmoid(F.linear(hidden, gate_weight)) * shared


@kiln_op("kiln::add_gated_shared_expert", mutates_args=())
def add_gated_shared_expert(out: torch.Tensor, shared: torch.Tensor, hidden: torch.Tensor,
                            gate_weight: torch.Tensor) -> torch.Tensor:
    """out + sigmoid(hidden @ gate_weight.T) * shared: Qwen2-MoE's, Qwen3-Next's and Qwen3.5's
    shared expert added to the routed experts' output `out`, scaled by its one-column gate.
    The reference is that chain of torch ops (each rounding to the activation dtype)."""
    check_gated_shared_expert_args(out, shared, hidden, gate_weight)
    return add_gated_shared_expert_reference(out, shared, hidden, gate_weight)


@add_gated_shared_expert.register_fake
def _add_gated_shared_expert_fake(out, shared, hidden, gate_weight):
    return torch.empty(out.shape, dtype=torch.promote_types(out.dtype, shared.dtype), device=out.device)
