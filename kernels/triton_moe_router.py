"""The softmax top-k router of `kiln::fused_moe` as one Triton kernel (CUDA).

transformers' router (`kiln.kernels.moe.route`): softmax over the E router logits in float32,
the top k probabilities and their experts, optionally renormalised to sum to 1. In torch that
is a cast, a softmax, a top-k (two kernels past a few dozen experts: a radix select and a
sort), a sum and a division: ~6 launches of a few microseconds each in every MoE layer, ~15 us
a layer at Qwen3-Next-80B's 512 experts on an H200 (bench/RESULTS.md AH2), which a batch-1
decode pays 48 times a step. Here one program takes one token's logits: the softmax in
registers, then k rounds of (largest probability, its lowest expert index, masked out), the
renormalisation, one store of the k weights and ids. Same arithmetic as torch's softmax
(exp(x - max) / sum); ties go to the lower expert index.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.kernels.moe import Routing, route
from kiln.kernels.triton_common import pdl_launch_args, wait_for_previous_kernel

# Routers of up to this many experts run the kernel (one token's logits in one program's
# registers); KILN_MOE_ROUTER_KERNEL=0 keeps torch's ops (`route`).
ROUTER_KERNEL = os.environ.get("KILN_MOE_ROUTER_KERNEL", "1") != "0"
ROUTER_KERNEL_MAX_EXPERTS = 1024


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                         TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
                         PDL: tl.constexpr = False):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_PAD)
    x = tl.load(logits_ptr + t * stride_t + e, mask=e < num_experts, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    p = tl.where(e < num_experts, p, -1.0)  # padding lanes never win
    ks = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int64)
    total = 0.0
    for i in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, E_PAD), axis=0)
        weights = tl.where(ks == i, best, weights)
        ids = tl.where(ks == i, idx.to(tl.int64), ids)
        total += best
        p = tl.where(e == idx, -2.0, p)
    if RENORMALIZE:
        weights = weights / total
    tl.store(weights_ptr + t * TOP_K + ks, weights.to(weights_ptr.dtype.element_ty), mask=ks < TOP_K)
    tl.store(ids_ptr + t * TOP_K + ks, ids, mask=ks < TOP_K)


def router_kernel_applies(router_logits: torch.Tensor, top_k: int) -> bool:
    return (ROUTER_KERNEL and router_logits.dim() == 2 and router_logits.shape[1] <= ROUTER_KERNEL_MAX_EXPERTS
            and 1 <= top_k <= router_logits.shape[1] and router_logits.stride(-1) == 1)


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool, fp32_weights: bool,
                 dtype: torch.dtype) -> Routing:
    """`kiln.kernels.moe.route` in one kernel where `router_kernel_applies`, else `route`."""
    if not router_kernel_applies(router_logits, top_k):
        return route(router_logits, top_k, renormalize, fp32_weights, dtype)
    tokens, experts = router_logits.shape
    weights = torch.empty((tokens, top_k), dtype=torch.float32 if fp32_weights else dtype,
                          device=router_logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if tokens:
        _softmax_topk_kernel[(tokens,)](
            router_logits, weights, ids, experts, router_logits.stride(0), TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(experts), RENORMALIZE=renormalize,
            num_warps=4 if experts <= 256 else 8, **pdl_launch_args(router_logits.device, "moe"),
        )
    return Routing(weights=weights, experts=ids)
