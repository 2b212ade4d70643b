"""`kiln::fused_moe`'s Triton kernels against the CPU reference.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported, as in test_kernels_triton.py) on small shapes; float32 and float16
(the interpreter's bfloat16 dot is unusable, see test_kernels_triton.py). The `gpu` tests run
the compiled kernels at Mixtral-8x7B and Qwen3-MoE-30B-A3B layer shapes in bfloat16, and
inside a CUDA graph.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kiln.kernels.moe import fused_moe_reference  # noqa: E402
from kiln.kernels.triton_moe import (MoETiling, choose_tiling, fused_moe_triton, group_pairs,  # noqa: E402
                                    group_pairs_for_step, group_pairs_in_one_kernel, pair_per_block)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.triton_kernels  # on a GPU, part of `pytest -m gpu` (tests/conftest.py)


def moe_inputs(t: int, h: int, i: int, e: int, dtype: torch.dtype, seed: int = 0, device: str = DEVICE,
               skew: bool = True) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g) * 2
    if skew and e > 2:
        logits[:, e - 1] -= 20.0  # an expert no token picks: its blocks must not exist
    w_gate_up = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w_down = torch.randn(e, h, i, generator=g) / i**0.5
    return tuple(x.to(device=device, dtype=dtype) for x in (hidden, logits, w_gate_up, w_down))


def fp8_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """e4m3 experts as the loader makes them: (gate/up, its [E, 2I] scales, down, its [E, H] scales)."""
    from kiln.kernels.fp8 import quantize_fp8_rows

    (gq, gs), (dq, ds) = quantize_fp8_rows(w_gate_up), quantize_fp8_rows(w_down)
    return gq, gs.squeeze(-1), dq, ds.squeeze(-1)


def mixtral_fp8_case(tokens: int) -> tuple[Any, ...]:
    """Mixtral-shape bfloat16 inputs on CUDA over e4m3 experts: (hidden, logits, the experts as
    `fp8_experts` gives them, top_k, renormalize, the float32 reference over them dequantized)."""
    from kiln.kernels.moe import dequantize_experts

    h, i, e, k, renorm = REAL_SHAPES["mixtral-8x7b"]
    hidden, logits, w_gate_up, w_down = moe_inputs(tokens, h, i, e, torch.bfloat16, seed=tokens, device="cuda",
                                                   skew=False)
    gq, gs, dq, ds = fp8_experts(w_gate_up, w_down)
    ref = fused_moe_reference(hidden.float(), logits.float(), dequantize_experts(gq, gs, torch.float32),
                              dequantize_experts(dq, ds, torch.float32), k, renorm, True)
    return hidden, logits, (gq, gs, dq, ds), k, renorm, ref


def test_kernels_run_where_this_machine_can() -> None:
    from triton.runtime.interpreter import InterpretedFunction

    from kiln.kernels import triton_moe

    interpreted = DEVICE == "cpu"
    assert isinstance(triton_moe._moe_gate_up_kernel, InterpretedFunction) == interpreted
    assert isinstance(triton_moe._moe_down_kernel, InterpretedFunction) == interpreted


def check_blocks(experts: torch.Tensor, num_experts: int, block_m: int) -> list[int]:
    """group_pairs' invariants; returns the block experts in order."""
    blocks = group_pairs(experts, num_experts=num_experts, block_m=block_m)
    flat = experts.reshape(-1)
    pairs = blocks.sorted_pairs.view(blocks.num_blocks, block_m)
    valid = pairs < flat.numel()
    assert sorted(pairs[valid].tolist()) == list(range(flat.numel()))
    for b in range(blocks.num_blocks):
        in_block = pairs[b][valid[b]]
        e = int(blocks.block_expert[b])
        if e < 0:
            assert in_block.numel() == 0
        else:
            assert in_block.numel() > 0 and (flat[in_block.long()] == e).all()
    used = [e for e in blocks.block_expert.tolist() if e >= 0]
    assert used == sorted(used) and blocks.block_expert.tolist()[len(used):] == [-1] * (blocks.num_blocks - len(used))
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    assert [used.count(e) for e in range(num_experts)] == [-(-c // block_m) for c in counts]
    return used


def test_group_pairs_puts_each_pair_once_in_a_block_of_its_expert() -> None:
    experts = torch.tensor([[0, 2], [2, 1], [0, 2], [2, 0], [1, 2]])
    # Expert 2 has 5 pairs -> 3 blocks of 2; experts 0 (3 pairs) 2 blocks, 1 (2 pairs) 1 block; 3 none.
    assert check_blocks(experts, 4, 2) == [0, 0, 1, 2, 2, 2]
    g = torch.Generator().manual_seed(0)
    for t, e, k, bm in [(100, 16, 4, 8), (7, 64, 8, 16), (333, 5, 2, 32)]:
        experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        check_blocks(experts, e, bm)


@pytest.mark.parametrize("tokens,top_k,num_experts,block_m", [
    (1, 2, 8, 16), (5, 2, 8, 16), (40, 2, 4, 32), (17, 1, 8, 16), (330, 2, 8, 128), (1000, 2, 8, 128),
    (64, 8, 128, 16), (300, 8, 128, 64), (7, 3, 6, 16), (33, 4, 5, 64)])
def test_grouping_in_one_kernel_gives_group_pairs_blocks(tokens, top_k, num_experts, block_m) -> None:
    """The one-program grouping equals the torch ops' bit for bit: the same padded layout, each
    expert's pairs in token order, padding marked, unused blocks -1 (an expert no token picks,
    expert counts that are not powers of two, more pairs than a pass's chunk)."""
    g = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, num_experts - 1] -= 50.0
    experts = torch.topk(logits, top_k, dim=-1).indices.to(DEVICE)
    ref = group_pairs(experts, num_experts, block_m)
    blocks = group_pairs_in_one_kernel(experts, num_experts, block_m)
    assert blocks.num_blocks == ref.num_blocks
    assert torch.equal(blocks.sorted_pairs, ref.sorted_pairs.to(torch.int32))
    assert torch.equal(blocks.block_expert, ref.block_expert)


def test_steps_group_in_one_kernel_up_to_a_limit(monkeypatch) -> None:
    """Off by default (KILN_MOE_GROUPING_KERNEL_MAX_PAIRS), and never over many experts."""
    from kiln.kernels import triton_moe

    assert triton_moe.GROUPING_KERNEL_MAX_PAIRS == int(os.environ.get("KILN_MOE_GROUPING_KERNEL_MAX_PAIRS", "0"))

    experts = torch.randint(0, 8, (40, 2), device=DEVICE)
    calls: list[str] = []
    monkeypatch.setattr(triton_moe, "group_pairs", lambda *a: calls.append("torch ops") or group_pairs(*a))
    monkeypatch.setattr(triton_moe, "group_pairs_in_one_kernel",
                        lambda *a: calls.append("one kernel") or group_pairs_in_one_kernel(*a))
    monkeypatch.setattr(triton_moe, "GROUPING_KERNEL_MAX_PAIRS", 80)
    group_pairs_for_step(experts, 8, 16)
    monkeypatch.setattr(triton_moe, "GROUPING_KERNEL_MAX_PAIRS", 79)
    group_pairs_for_step(experts, 8, 16)
    many_experts = torch.randint(0, 32, (40, 2), device=DEVICE)
    group_pairs_for_step(many_experts, 32, 16)  # over GROUPING_KERNEL_MAX_EXPERTS
    monkeypatch.setattr(triton_moe, "GROUPING_KERNEL_MAX_PAIRS", 0)  # KILN_MOE_GROUPING_KERNEL_MAX_PAIRS=0: never
    group_pairs_for_step(experts, 8, 16)
    assert calls == ["one kernel", "torch ops", "torch ops", "torch ops"]
    assert triton_moe.GROUPING_KERNEL_MAX_EXPERTS == 16


def deepseek_routing(logits: torch.Tensor, top_k: int, scale: float = 2.5) -> tuple[torch.Tensor, torch.Tensor]:
    """A router fused_moe does not compute (DeepSeek-V3's, without groups): sigmoid scores, the
    top-k picked with a selection bias, their unbiased scores renormalised and scaled; float32
    weights and int32 ids, as `kiln::moe_experts` may get them."""
    scores = torch.sigmoid(logits.float())
    bias = torch.linspace(-0.5, 0.5, logits.shape[1], device=logits.device)
    ids = torch.topk(scores + bias, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True) * scale, ids.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,e,top_k,per_pair,tma", [(3, 8, 2, True, False), (17, 6, 3, False, False),
                                                    (40, 4, 2, False, True)])
def test_moe_experts_kernels_match_reference(t, e, top_k, per_pair, tma, dtype) -> None:
    """`kiln::moe_experts` (the routing given) on the pointer kernels, per pair and grouped, and
    the sorted-rows kernels: the reference's result for a router of another kind."""
    from kiln.kernels.moe import moe_experts_reference
    from kiln.kernels.triton_moe import moe_experts_triton

    if tma and DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    hidden, logits, w_gate_up, w_down = moe_inputs(t, 32, 24, e, dtype, seed=t)
    weights, ids = deepseek_routing(logits, top_k)
    ids = ids.t().contiguous().t()  # a column-major view: the kernels must not read its storage as [T, k]
    out = moe_experts_triton(hidden, weights, ids, w_gate_up, w_down, per_pair=per_pair, tma=tma)
    ref = moe_experts_reference(hidden, weights, ids, w_gate_up, w_down)
    assert out.dtype == ref.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if DEVICE == "cuda":  # the op's CUDA registration is this function
        torch.testing.assert_close(torch.ops.kiln.moe_experts(hidden, weights, ids, w_gate_up, w_down), out)


def oai_extras(e: int, h: int, i: int, dtype: torch.dtype, seed: int = 0):
    """GPT-OSS-style experts' extras: biases of both GEMMs and the clamped SwiGLU, with a limit
    the products reach (so a kernel that skipped the clamp differs)."""
    from kiln.kernels.moe import ExpertExtras

    g = torch.Generator().manual_seed(seed)
    return ExpertExtras(b_gate_up=(torch.randn(e, 2 * i, generator=g) * 0.5).to(DEVICE, dtype),
                        b_down=(torch.randn(e, h, generator=g) * 0.5).to(DEVICE, dtype),
                        activation="swiglu_oai", alpha=1.702, limit=0.6)


def experts_on_path(path: str, hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    w_gate_up: torch.Tensor, w_down: torch.Tensor, extras: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, ref): `kiln::moe_experts` with `extras` on one kernel path ("per_pair", "row",
    "grouped", "tma", "fp8": e4m3 experts on the pointer kernels, "grouped_mm"), and
    the reference it must equal (the FP8 reference for "fp8")."""
    from kiln.kernels.moe import moe_experts_fp8_reference, moe_experts_grouped_mm, moe_experts_reference
    from kiln.kernels.triton_moe import moe_experts_triton

    ref = moe_experts_reference(hidden, weights, ids, w_gate_up, w_down, **extras.kwargs())
    if path == "fp8":
        gq, gs, dq, ds = fp8_experts(w_gate_up, w_down)
        out = moe_experts_triton(hidden, weights, ids, gq, dq, w_gate_up_scale=gs, w_down_scale=ds, tiling=None,
                                 per_pair=False, tma=False, extras=extras)
        return out, moe_experts_fp8_reference(hidden, weights, ids, gq, gs, dq, ds, **extras.kwargs())
    if path == "grouped_mm":
        return moe_experts_grouped_mm(hidden, weights, ids, w_gate_up, w_down, **extras.kwargs()), ref
    out = moe_experts_triton(hidden, weights, ids, w_gate_up, w_down,
                             per_pair=path in ("per_pair", "row"), tma=path == "tma",
                             row_kernels=(path == "row") if path in ("per_pair", "row") else None, extras=extras)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,e,top_k,path", [(3, 8, 2, "per_pair"), (17, 6, 3, "grouped"), (40, 4, 2, "tma"),
                                            (12, 4, 2, "fp8"), (30, 4, 2, "grouped_mm")])
def test_biased_experts_with_clamped_swiglu_match_reference(t, e, top_k, path, dtype) -> None:
    """GPT-OSS's experts (biases after both GEMMs, the clamped SwiGLU) in every kernel's
    epilogue: the reference's result, which differs from the bias-free SiLU one."""
    from kiln.kernels.moe import moe_experts_reference

    if path == "tma" and DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    if path == "grouped_mm" and dtype != torch.float32 and DEVICE == "cpu":
        pytest.skip("torch's CPU grouped GEMM takes float32 and bfloat16")
    h, i = 32, 24
    hidden, logits, w_gate_up, w_down = moe_inputs(t, h, i, e, dtype, seed=t)
    weights, ids = deepseek_routing(logits, top_k)
    extras = oai_extras(e, h, i, dtype, seed=t)
    ref = moe_experts_reference(hidden, weights, ids, w_gate_up, w_down, **extras.kwargs())
    plain = moe_experts_reference(hidden, weights, ids, w_gate_up, w_down)
    assert (ref - plain).abs().max() > 0.1
    out, ref = experts_on_path(path, hidden, weights, ids, w_gate_up, w_down, extras)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    if DEVICE == "cuda" and path != "fp8":
        torch.testing.assert_close(torch.ops.kiln.moe_experts(hidden, weights, ids, w_gate_up, w_down,
                                                              **extras.kwargs()), ref, rtol=tol, atol=tol)



@pytest.mark.parametrize("t,e,top_k,path", [(3, 8, 2, "per_pair"), (2, 8, 2, "row"), (17, 6, 3, "grouped"),
                                            (40, 4, 2, "tma"), (12, 4, 2, "fp8"), (30, 4, 2, "grouped_mm")])
def test_gelu_tanh_experts_match_reference(t, e, top_k, path) -> None:
    """Gemma 4's experts (GELU-tanh and mul) in every kernel's epilogue: the reference's result,
    which differs from the SiLU one."""
    from kiln.kernels.moe import ExpertExtras, moe_experts_reference

    if path == "tma" and DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    dtype = torch.float32 if path == "grouped_mm" and DEVICE == "cpu" else torch.float16
    h, i = 32, 24
    hidden, logits, w_gate_up, w_down = moe_inputs(t, h, i, e, dtype, seed=t)
    weights, ids = deepseek_routing(logits, top_k)
    extras = ExpertExtras(activation="gelu_tanh")
    ref = moe_experts_reference(hidden, weights, ids, w_gate_up, w_down, **extras.kwargs())
    silu = moe_experts_reference(hidden, weights, ids, w_gate_up, w_down)
    assert (ref.float() - silu.float()).abs().max() > 0.05
    out, ref = experts_on_path(path, hidden, weights, ids, w_gate_up, w_down, extras)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h,i,experts", [(32, 24, "plain"), (40, 36, "fp8"), (48, 20, "oai")])
def test_per_pair_row_kernels_match_the_dot_kernels_and_reference(h, i, experts, dtype) -> None:
    """The per-pair GEMV kernels (`ROW_KERNELS`, the per-pair default) give the reference's
    result and the 16-row dot kernels' for plain, e4m3 (channel scales) and biased clamped-SwiGLU
    experts, with K (h, i) not a multiple of their K step (the masked loads)."""
    from kiln.kernels.moe import moe_experts_fp8_reference, moe_experts_reference
    from kiln.kernels.triton_moe import moe_experts_triton

    t, e, top_k = 2, 8, 2  # 4 pairs of 8 experts: a per-pair step
    hidden, logits, w_gate_up, w_down = moe_inputs(t, h, i, e, dtype, seed=h)
    weights, ids = deepseek_routing(logits, top_k)
    kwargs = oai_extras(e, h, i, dtype, seed=h).kwargs() if experts == "oai" else {}
    extras = {"extras": oai_extras(e, h, i, dtype, seed=h)} if experts == "oai" else {}
    if experts == "fp8":
        gq, gs, dq, ds = fp8_experts(w_gate_up, w_down)
        scales = {"w_gate_up_scale": gs, "w_down_scale": ds}
        ref = moe_experts_fp8_reference(hidden, weights, ids, gq, gs, dq, ds)
        w_gate_up, w_down = gq, dq
    else:
        scales = {}
        ref = moe_experts_reference(hidden, weights, ids, w_gate_up, w_down, **kwargs)
    row = moe_experts_triton(hidden, weights, ids, w_gate_up, w_down, per_pair=True, row_kernels=True, **scales,
                             **extras)
    dot = moe_experts_triton(hidden, weights, ids, w_gate_up, w_down, per_pair=True, row_kernels=False, **scales,
                             **extras)
    default = moe_experts_triton(hidden, weights, ids, w_gate_up, w_down, **scales, **extras)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(row, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(row, dot, rtol=tol, atol=tol)
    torch.testing.assert_close(default, row, rtol=0, atol=0)  # the default: the row kernels
    with pytest.raises(ValueError, match="per-pair steps only"):
        moe_experts_triton(hidden, weights, ids, w_gate_up, w_down, per_pair=False, row_kernels=True, **scales,
                           **extras)


def test_row_tiling_fills_the_gpu_with_column_slices() -> None:
    """Qwen3-Next-80B's batch-1 decode (10 pairs, e4m3): gate/up's [2 x 512, 2048] experts in
    8-column slices (640 programs), down's [2048, 512] in 16 (1,280), 256 of K a loop step on 4
    warps; 16 columns where the pairs fill the GPU already, narrowed so that gate/up's two
    accumulators stay 8,192 values; tiny shapes: 4 columns, K rounded up."""
    from kiln.kernels.triton_moe import ROW_TARGET_PROGRAMS, RowTiling, row_tiling

    assert row_tiling(10, 512, 2048, element_size=1, halves=2) == RowTiling(8, 256, 4, 3)
    assert row_tiling(10, 2048, 512, element_size=1) == RowTiling(16, 256, 4, 3)
    assert row_tiling(64, 768, 2048, element_size=2, halves=2) == RowTiling(16, 256, 4, 3)
    assert 64 * triton_cdiv(768, 16) >= ROW_TARGET_PROGRAMS
    assert row_tiling(1, 24, 40, element_size=4) == RowTiling(4, 64, 4, 3)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

def test_tiling_follows_rows_per_expert() -> None:
    decode = choose_tiling(num_pairs=2, num_experts=8, n=14336, k=4096)
    prefill = choose_tiling(num_pairs=8192 * 2, num_experts=8, n=14336, k=4096)
    assert decode.block_m == 16 and prefill.block_m == 128
    # Decode narrows the column tiles until the blocks in use fill the GPU: Mixtral's down
    # projection (4096 columns, 2 experts) needs 32-wide tiles for 256 programs.
    assert choose_tiling(2, 8, 4096, 14336).block_n == 32
    assert decode.block_n == 64
    assert choose_tiling(64 * 8, 128, 768, 2048).block_m == 16  # Qwen3-30B batch 64: 4 rows per expert
    assert choose_tiling(64 * 2, 8, 14336, 4096).block_m == 32  # Mixtral batch 64: 16 rows per expert
    assert choose_tiling(4096, 4, 24, 40).block_n == 32  # never wider than the (rounded) shape
    assert pair_per_block(2, 8) and pair_per_block(8, 128) and not pair_per_block(128, 8)
    # Prefill with several row blocks per expert: 128 x 128 tiles on 3 stages, 16 row blocks
    # across every column tile at a time. One block per expert (Mixtral's 320-token decode):
    # 4 stages where shared memory holds them (the H200's 227 KB), else 128 x 64 on 3.
    h200_smem, a100_smem, l4_smem = 232448, 166912, 101376
    assert choose_tiling(8192 * 2, 8, 14336, 4096, 2, h200_smem) == MoETiling(128, 128, 64, 8, 3, group_m=16)
    assert choose_tiling(8192 * 2, 8, 14336, 4096, 2, a100_smem) == MoETiling(128, 128, 64, 8, 3, group_m=16)
    assert choose_tiling(8192 * 2, 8, 14336, 4096, 2, l4_smem) == MoETiling(128, 64, 64, 8, 3, group_m=16)
    assert choose_tiling(320 * 2, 8, 14336, 4096, 2, h200_smem) == MoETiling(128, 128, 64, 8, 4)
    assert choose_tiling(320 * 2, 8, 14336, 4096, 2, a100_smem) == MoETiling(128, 64, 64, 8, 3)
    assert choose_tiling(320 * 2, 8, 14336, 4096, 4, a100_smem) == MoETiling(128, 64, 32, 8, 3)


CASES = [  # t, h, i, e, top_k, renormalize, fp32_weights, tiling, per_pair
    (5, 48, 24, 4, 2, True, True, None, False),                       # K and N not tile multiples
    (3, 32, 32, 6, 3, False, False, None, False),
    (40, 32, 48, 4, 2, False, True, MoETiling(32, 32, 16, 4, 2), False),   # many rows per expert, K loop
    (17, 64, 16, 8, 1, True, False, MoETiling(16, 16, 32, 4, 2), False),
    (40, 32, 48, 4, 2, False, True, MoETiling(16, 16, 16, 4, 2, group_m=4), False),  # grouped order: 9 blocks, groups 4, 4, 1
    (30, 48, 40, 3, 2, True, True, MoETiling(16, 32, 16, 4, 2, group_m=2), False),  # 7 blocks
    (1, 48, 40, 8, 2, True, True, None, None),                        # batch-1 decode: a block per pair
    (2, 32, 24, 16, 4, True, False, None, None),
    (6, 32, 24, 4, 2, False, True, None, True),                       # per pair with shared experts
    (40, 32, 24, 2, 1, True, True, None, None),                       # chosen tiling: 32-row blocks
    (48, 32, 24, 3, 2, False, False, None, None),                     # chosen tiling: 64-row blocks
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,h,i,e,top_k,renormalize,fp32_weights,tiling,per_pair", CASES)
def test_fused_moe_triton_matches_reference(t, h, i, e, top_k, renormalize, fp32_weights, tiling, per_pair,
                                            dtype) -> None:
    hidden, logits, w_gate_up, w_down = moe_inputs(t, h, i, e, dtype, seed=t)
    out = fused_moe_triton(hidden, logits, w_gate_up, w_down, top_k, renormalize, fp32_weights, tiling=tiling,
                           per_pair=per_pair)
    ref = fused_moe_reference(hidden, logits, w_gate_up, w_down, top_k, renormalize, fp32_weights)
    assert out.shape == ref.shape and out.dtype == ref.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,h,i,e,top_k,renormalize,fp32_weights,tiling,per_pair",
                         [case for case in CASES if case[-1] is not True])
def test_sorted_rows_kernels_match_reference(t, h, i, e, top_k, renormalize, fp32_weights, tiling, per_pair,
                                             dtype) -> None:
    """The tensor-descriptor kernels (rows gathered into expert order first) give the pointer
    kernels' result: every grouped case above, padding rows and tiles past N and K included."""
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    hidden, logits, w_gate_up, w_down = moe_inputs(t, h, i, e, dtype, seed=t)
    out = fused_moe_triton(hidden, logits, w_gate_up, w_down, top_k, renormalize, fp32_weights, tiling=tiling,
                           per_pair=False, tma=True)
    ref = fused_moe_reference(hidden, logits, w_gate_up, w_down, top_k, renormalize, fp32_weights)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,h,i,e,top_k,renormalize,fp32_weights,tiling,per_pair", CASES)
def test_fp8_experts_match_their_reference(t, h, i, e, top_k, renormalize, fp32_weights, tiling, per_pair,
                                           dtype) -> None:
    """e4m3 experts (kiln::fused_moe_fp8): the kernels widen each weight tile to the
    activations' dtype and scale each output channel after the K loop; the reference runs
    fused_moe over the dequantized experts. Every case above, per-pair blocks included."""
    from kiln.kernels.moe import fused_moe_fp8_reference

    hidden, logits, w_gate_up, w_down = moe_inputs(t, h, i, e, dtype, seed=t)
    gq, gs, dq, ds = fp8_experts(w_gate_up, w_down)
    out = fused_moe_triton(hidden, logits, gq, dq, top_k, renormalize, fp32_weights, tiling=tiling, per_pair=per_pair,
                           w_gate_up_scale=gs, w_down_scale=ds, fp8_activations=False)  # (W8A8: below)
    ref = fused_moe_fp8_reference(hidden, logits, gq, gs, dq, ds, top_k, renormalize, fp32_weights)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


def test_dequantize_experts_kernel_rounds_as_the_reference() -> None:
    from kiln.kernels.fp8 import quantize_fp8_rows
    from kiln.kernels.moe import dequantize_experts
    from kiln.kernels.triton_moe import dequantize_experts_triton

    w = torch.randn(3, 40, 72, device=DEVICE) * 0.05
    q, scale = quantize_fp8_rows(w)
    scale = scale.squeeze(-1)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        out, ref = dequantize_experts_triton(q, scale, dtype), dequantize_experts(q, scale, dtype)
        if dtype == torch.bfloat16 and DEVICE == "cpu":  # the interpreter's bfloat16 cast truncates
            torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)
        else:
            assert torch.equal(out, ref), dtype
    with pytest.raises(ValueError, match="need \\[E, N\\] scales"):
        dequantize_experts_triton(q, scale[:, :8], torch.float16)


@pytest.mark.parametrize("tokens,widened", [(48, True), (20, False)])
def test_fp8_experts_in_prefill_sized_steps_run_widened_by_the_16_bit_kernels(monkeypatch, tokens, widened) -> None:
    """From FP8_DEQUANT_MIN_ROWS rows an expert (here 8: 48 tokens x top-2 over 8 experts = 12),
    the layer's e4m3 experts are widened once and the 16-bit kernels run; below it the pointer
    kernels widen tile by tile. Both equal the reference over the dequantized experts."""
    from kiln.kernels import triton_moe
    from kiln.kernels.moe import fused_moe_fp8_reference

    assert triton_moe.FP8_DEQUANT_MIN_ROWS == int(os.environ.get("KILN_MOE_FP8_DEQUANT_MIN_ROWS", "1024"))
    monkeypatch.setattr(triton_moe, "FP8_DEQUANT_MIN_ROWS", 8)
    monkeypatch.setattr(triton_moe, "FP8_ACTIVATIONS_MIN_ROWS", 0)  # weight-only (W8A8 widens nothing)
    calls = []
    widen = triton_moe.dequantize_experts_triton
    monkeypatch.setattr(triton_moe, "dequantize_experts_triton", lambda *a: calls.append(a[0].shape) or widen(*a))
    hidden, logits, w_gate_up, w_down = moe_inputs(tokens, 32, 48, 8, torch.float16, seed=tokens)
    gq, gs, dq, ds = fp8_experts(w_gate_up, w_down)
    out = torch.ops.kiln.fused_moe_fp8(hidden, logits, gq, gs, dq, ds, 2, True, True) if DEVICE == "cuda" else \
        fused_moe_triton(hidden, logits, gq, dq, 2, True, True, w_gate_up_scale=gs, w_down_scale=ds)
    assert calls == ([gq.shape, dq.shape] if widened else [])
    ref = fused_moe_fp8_reference(hidden, logits, gq, gs, dq, ds, 2, True, True)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


def w8a8_moe_reference(hidden: torch.Tensor, logits: torch.Tensor, gq: torch.Tensor, gs: torch.Tensor,
                       dq: torch.Tensor, ds: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """fused_moe over e4m3 experts with e4m3 activations (`w8a8_experts_reference` after the router)."""
    from kiln.kernels.moe import route

    routing = route(logits, top_k, renormalize, True, hidden.dtype)
    return w8a8_experts_reference(hidden, routing.weights, routing.experts, gq, gs, dq, ds)


def w8a8_experts_reference(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, gq: torch.Tensor,
                           gs: torch.Tensor, dq: torch.Tensor, ds: torch.Tensor, extras: Any = None) -> torch.Tensor:
    """moe_experts over e4m3 experts with e4m3 activations, pair by pair, rounding where the
    kernels round: each token's hidden state quantized per row, gate and up to the model dtype
    (and their biases' sums, with `extras`), the activation (SiLU-and-mul with SiLU rounded,
    or GPT-OSS's clamped SwiGLU in float32) to the model dtype, that row quantized, the down
    product (and its bias's sum) to the model dtype, weighted in float32."""
    from kiln.kernels.fp8 import quantize_fp8_rows

    dt, inter = hidden.dtype, gq.shape[1] // 2
    xq, xs = quantize_fp8_rows(hidden)
    x = xq.float() * xs
    w_gate_up, w_down = gq.float() * gs[..., None], dq.float() * ds[..., None]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = (x[t] @ w_gate_up[e].T).to(dt).float()
            if extras is not None and extras.b_gate_up is not None:
                gate_up = (gate_up + extras.b_gate_up[e].float()).to(dt).float()
            gate, up = gate_up[:inter], gate_up[inter:]
            if extras is not None and extras.activation == "swiglu_oai":
                gate, up = gate.clamp(max=extras.limit), up.clamp(-extras.limit, extras.limit)
                act = ((up + 1) * (gate * torch.sigmoid(gate * extras.alpha))).to(dt)
            else:
                act = ((gate * torch.sigmoid(gate)).to(dt).float() * up).to(dt)
            aq, a_scale = quantize_fp8_rows(act[None])
            y = ((aq.float() * a_scale)[0] @ w_down[e].T).to(dt).float()
            if extras is not None and extras.b_down is not None:
                y = (y + extras.b_down[e].float()).to(dt).float()
            out[t] += y * weights[t, j].float()
    return out.to(dt)


def test_w8a8_experts_take_gpt_oss_biases_and_activation() -> None:
    """W8A8 (the sorted-rows kernels over e4m3 rows and experts) with GPT-OSS's biases and
    clamped SwiGLU in their epilogues: the rounding reference's result, not the bias-free one."""
    from kiln.kernels.triton_moe import moe_experts_triton

    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    hidden, logits, w_gate_up, w_down = moe_inputs(24, 32, 48, 4, torch.float16, seed=5)
    weights, ids = deepseek_routing(logits, 2)
    gq, gs, dq, ds = fp8_experts(w_gate_up, w_down)
    extras = oai_extras(4, 32, 48, torch.float16, seed=6)
    out = moe_experts_triton(hidden, weights, ids, gq, dq, w_gate_up_scale=gs, w_down_scale=ds,
                             fp8_activations=True, extras=extras)
    ref = w8a8_experts_reference(hidden, weights, ids, gq, gs, dq, ds, extras)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)
    plain = w8a8_experts_reference(hidden, weights, ids, gq, gs, dq, ds)
    assert (ref.float() - plain.float()).abs().max() > 0.1


@pytest.mark.parametrize("t,e,top_k", [(40, 4, 2), (7, 8, 2), (64, 16, 4)])
def test_fp8_experts_with_fp8_activations_match_their_rounding(t, e, top_k) -> None:
    """W8A8 (fp8_activations): e4m3 rows and experts on the sorted-rows kernels' e4m3 dots, each
    product scaled by its row's and its channel's scales after the K loop."""
    from kiln.kernels.moe import fused_moe_fp8_reference

    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    hidden, logits, w_gate_up, w_down = moe_inputs(t, 32, 48, e, torch.float16, seed=t)
    gq, gs, dq, ds = fp8_experts(w_gate_up, w_down)
    out = fused_moe_triton(hidden, logits, gq, dq, top_k, True, True, w_gate_up_scale=gs, w_down_scale=ds,
                           fp8_activations=True)
    ref = w8a8_moe_reference(hidden, logits, gq, gs, dq, ds, top_k, True)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-3, atol=2e-3)  # (weight-only: ~0.1 off)
    weight_only = fused_moe_fp8_reference(hidden, logits, gq, gs, dq, ds, top_k, True, True).float()
    assert (out.float() - weight_only).norm() / weight_only.norm() < 0.1  # e4m3 activations: a few % off
    with pytest.raises(ValueError, match="W8A8"):
        fused_moe_triton(hidden, logits, gq, dq, top_k, True, True, w_gate_up_scale=gs, w_down_scale=ds,
                         fp8_activations=True, per_pair=True)


def test_sorted_rows_kernels_take_large_steps_on_sm90_only_and_refuse_what_they_cannot_take(monkeypatch) -> None:
    from kiln.kernels import triton_moe

    hidden, logits, w_gate_up, w_down = moe_inputs(40, 32, 24, 4, torch.float16)
    hopper = DEVICE == "cuda" and torch.cuda.get_device_capability() >= (9, 0)
    assert triton_moe.TMA_MIN_ROWS == int(os.environ.get("KILN_MOE_TMA_MIN_ROWS", "1024"))
    monkeypatch.setattr(triton_moe, "TMA_MIN_ROWS", 8)
    assert triton_moe.uses_tma(32, 4, hidden, w_gate_up, w_down) == hopper  # 8 rows an expert
    assert not triton_moe.uses_tma(31, 4, hidden, w_gate_up, w_down)
    assert not triton_moe.uses_tma(32, 4, hidden.float(), w_gate_up.float(), w_down.float())  # 16-bit only
    monkeypatch.setattr(triton_moe, "TMA_MIN_ROWS", 0)  # KILN_MOE_TMA_MIN_ROWS=0: never
    assert not triton_moe.uses_tma(10**6, 4, hidden, w_gate_up, w_down)
    with pytest.raises(ValueError, match="16-byte-aligned"):
        odd = moe_inputs(8, 30, 24, 4, torch.float16)  # 60-byte rows
        fused_moe_triton(*odd, 2, True, True, per_pair=False, tma=True)
    h, l, w_gate_up, w_down = moe_inputs(8, 32, 24, 4, torch.float16)
    shifted = torch.empty(w_gate_up.numel() + 1, dtype=w_gate_up.dtype, device=DEVICE)[1:].view(w_gate_up.shape)
    shifted.copy_(w_gate_up)  # contiguous, but its storage starts 2 bytes off
    assert not triton_moe._descriptor_ok(shifted, w_down) and triton_moe._descriptor_ok(w_gate_up, w_down)
    with pytest.raises(ValueError, match="16-byte-aligned"):
        fused_moe_triton(h, l, shifted, w_down, 2, True, True, per_pair=False, tma=True)


# ---- GPU: real shapes -------------------------------------------------------------------------

REAL_SHAPES = {  # name: hidden, moe intermediate, experts, top_k, renormalize
    "mixtral-8x7b": (4096, 14336, 8, 2, True),
    "qwen3-moe-30b-a3b": (2048, 768, 128, 8, True),
    "glm-4.5-air": (4096, 1408, 128, 8, True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1000])
@pytest.mark.parametrize("shape", list(REAL_SHAPES))
def test_fused_moe_triton_matches_reference_at_real_shapes(shape: str, tokens: int) -> None:
    import kiln.kernels

    assert kiln.kernels.triton_kernels_available()
    h, i, e, k, renorm = REAL_SHAPES[shape]
    hidden, logits, w_gate_up, w_down = moe_inputs(tokens, h, i, e, torch.bfloat16, seed=tokens, device="cuda",
                                                   skew=False)
    out = torch.ops.kiln.fused_moe(hidden, logits, w_gate_up, w_down, k, renorm, True)  # dispatches to Triton
    ref = fused_moe_reference(hidden.float(), logits.float(), w_gate_up.float(), w_down.float(), k, renorm, True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 1e-2, f"{shape}, {tokens} tokens: relative error {rel:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1000])
def test_moe_experts_at_glm45_air_shape(tokens: int) -> None:
    """`kiln::moe_experts` on CUDA at GLM-4.5-Air's expert shape (128 experts, top-8) behind a
    DeepSeek-style router (float32 weights scaled by 2.5, int32 ids)."""
    from kiln.kernels.moe import moe_experts_reference

    h, i, e, k, _ = REAL_SHAPES["glm-4.5-air"]
    hidden, logits, w_gate_up, w_down = moe_inputs(tokens, h, i, e, torch.bfloat16, seed=tokens, device="cuda",
                                                   skew=False)
    weights, ids = deepseek_routing(logits, k)
    out = torch.ops.kiln.moe_experts(hidden, weights, ids, w_gate_up, w_down)
    ref = moe_experts_reference(hidden.float(), weights, ids, w_gate_up.float(), w_down.float())
    rel = (out.float() - ref).norm() / ref.norm()
    assert out.dtype == torch.bfloat16 and rel < 1e-2, f"{tokens} tokens: relative error {rel:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [64, 1000])
@pytest.mark.parametrize("shape", list(REAL_SHAPES))
def test_sorted_rows_kernels_at_real_shapes(shape: str, tokens: int) -> None:
    """The tensor-descriptor (TMA) kernels compiled for the GPU, bfloat16, against the float32 reference."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    h, i, e, k, renorm = REAL_SHAPES[shape]
    hidden, logits, w_gate_up, w_down = moe_inputs(tokens, h, i, e, torch.bfloat16, seed=tokens, device="cuda",
                                                   skew=False)
    out = fused_moe_triton(hidden, logits, w_gate_up, w_down, k, renorm, True, per_pair=False, tma=True)
    ref = fused_moe_reference(hidden.float(), logits.float(), w_gate_up.float(), w_down.float(), k, renorm, True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 1e-2, f"{shape}, {tokens} tokens: relative error {rel:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1000, 4096])
def test_fp8_experts_at_mixtral_shape(monkeypatch, tokens: int) -> None:
    """kiln::fused_moe_fp8 weight-only (KILN_MOE_FP8_ACTIVATIONS_MIN_ROWS=0) dispatched to the
    kernels on the GPU, bfloat16 activations over e4m3 Mixtral experts, against the float32
    reference over the same dequantized experts (4,096 tokens: 1,024 rows an expert, the experts
    widened for the 16-bit sorted-rows kernels)."""
    from kiln.kernels import triton_moe

    monkeypatch.setattr(triton_moe, "FP8_ACTIVATIONS_MIN_ROWS", 0)
    hidden, logits, (gq, gs, dq, ds), k, renorm, ref = mixtral_fp8_case(tokens)
    out = torch.ops.kiln.fused_moe_fp8(hidden, logits, gq, gs, dq, ds, k, renorm, True)
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 1e-2, f"{tokens} tokens: relative error {rel:.2e}"


@pytest.mark.gpu
def test_quantizing_stacked_experts_leaves_no_reserved_memory_behind() -> None:
    """Quantizing one layer's 16-bit experts after another (the loader's FP8-experts transforms)
    must not carve each e4m3 result out of the layer before's freed experts: the rest of such a
    block stays reserved and unusable for the KV cache (the Mixtral engine ran out of memory
    with 26 GiB so reserved)."""
    from kiln.passes.weight_transforms import QuantizeFP8Weight

    torch.cuda.empty_cache()  # what earlier tests left reserved (a CUDA graph's pool) is not ours
    base_allocated = torch.cuda.memory_allocated()
    base_stranded = torch.cuda.memory_reserved() - base_allocated
    weights = {f"layers.{i}.experts": torch.randn(8, 4096, 4096, device="cuda", dtype=torch.bfloat16)
               for i in range(4)}  # 256 MiB each: FRAGMENTING_BYTES
    for i in range(4):
        QuantizeFP8Weight(f"layers.{i}.experts").apply(weights)
    torch.cuda.empty_cache()
    stranded = torch.cuda.memory_reserved() - torch.cuda.memory_allocated() - base_stranded
    assert torch.cuda.memory_allocated() - base_allocated >= 4 * 8 * 4096 * 4096  # the e4m3 experts
    assert stranded < 8 * 2**20, f"{stranded / 2**20:.0f} MiB reserved but unallocated after quantizing"


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [128, 4096])
def test_fp8_activations_at_mixtral_shape(tokens: int) -> None:
    """W8A8 MoE (e4m3 rows and experts on e4m3 MMAs) compiled for the GPU at the Mixtral shape:
    within a few % of the weight-only result (the activations' e4m3 rounding, averaged over K)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    hidden, logits, (gq, gs, dq, ds), k, renorm, ref = mixtral_fp8_case(tokens)
    out = fused_moe_triton(hidden, logits, gq, dq, k, renorm, True, w_gate_up_scale=gs, w_down_scale=ds,
                           fp8_activations=True)
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 5e-2, f"{tokens} tokens: relative error {rel:.2e}"
    # The op's default on sm_90 (from KILN_MOE_FP8_ACTIVATIONS_MIN_ROWS=24 rows an expert; 128 tokens
    # are 32): the same launch, W8A8_BLOCK_K's K tiles included.
    assert torch.equal(torch.ops.kiln.fused_moe_fp8(hidden, logits, gq, gs, dq, ds, k, renorm, True), out)


@pytest.mark.gpu
def test_sorted_rows_kernels_replay_in_a_cuda_graph() -> None:
    """Their descriptors are built at launch: captured once, replayed with other tokens and routing."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    check_graph_replay(256, lambda h, l, gu, d, k: fused_moe_triton(h, l, gu, d, k, True, True, per_pair=False,
                                                                    tma=True))


@pytest.mark.gpu
def test_fused_moe_triton_replays_in_a_cuda_graph() -> None:
    """No host read in the launch path: captured once, replayed with other tokens and routing."""
    check_graph_replay(64, lambda h, l, gu, d, k: torch.ops.kiln.fused_moe(h, l, gu, d, k, True, True))


def assert_replay_is_eager(moe: Any, hidden: torch.Tensor) -> None:
    """`moe(x)` (run eagerly once already, so compiled) captured in a CUDA graph over a copy of
    `hidden` and replayed over `hidden * 0.5`: bit for bit what an eager call gives for it."""
    static_h = hidden.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(static_h)
    static_h.copy_(hidden * 0.5)
    graph.replay()
    torch.testing.assert_close(out, moe(hidden * 0.5), rtol=0, atol=0)


def check_graph_replay(tokens: int, moe: Any) -> None:
    """`moe(hidden, logits, w_gate_up, w_down, top_k)` (renormalized, float32 routing weights) is
    compiled outside a CUDA graph, captured, and replayed over new tokens and routing: the
    replay's output is the float32 reference's for the new inputs."""
    h, i, e, k = 1024, 512, 16, 4
    hidden, logits, w_gate_up, w_down = moe_inputs(tokens, h, i, e, torch.bfloat16, device="cuda", skew=False)
    static_h, static_l = hidden.clone(), logits.clone()
    moe(static_h, static_l, w_gate_up, w_down, k)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(static_h, static_l, w_gate_up, w_down, k)
    new_h, new_l, _, _ = moe_inputs(tokens, h, i, e, torch.bfloat16, seed=7, device="cuda", skew=False)
    static_h.copy_(new_h)
    static_l.copy_(new_l)
    graph.replay()
    ref = fused_moe_reference(new_h.float(), new_l.float(), w_gate_up.float(), w_down.float(), k, True, True)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_fp8_activations_replay_in_a_cuda_graph() -> None:
    """W8A8 MoE (the activations' per-row quantization, the descriptors built at launch) captured
    once and replayed over other tokens and routing: what an eager call gives for them."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the sorted-rows kernels' descriptors are for sm_90 and newer")
    h, i, e, k = 1024, 512, 16, 4
    hidden, logits, w_gate_up, w_down = moe_inputs(256, h, i, e, torch.bfloat16, device="cuda", skew=False)
    gq, gs, dq, ds = fp8_experts(w_gate_up, w_down)

    def moe(x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return fused_moe_triton(x, router_logits, gq, dq, k, True, True, w_gate_up_scale=gs, w_down_scale=ds,
                                fp8_activations=True)

    static_h, static_l = hidden.clone(), logits.clone()
    moe(static_h, static_l)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(static_h, static_l)
    new_h, new_l, _, _ = moe_inputs(256, h, i, e, torch.bfloat16, seed=7, device="cuda", skew=False)
    static_h.copy_(new_h)
    static_l.copy_(new_l)
    graph.replay()
    torch.testing.assert_close(out, moe(new_h, new_l), rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_prefill_steps_can_take_the_grouped_gemm(monkeypatch) -> None:
    """KILN_MOE_GROUPED_MM_MIN_ROWS: steps with that many rows per expert go to torch's grouped
    GEMM, which must agree with the Triton kernels and replay in a CUDA graph."""
    from kiln.kernels import triton_moe

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the grouped GEMM path is for sm_90 and newer")
    h, i, e, k, renorm = 1024, 512, 8, 2, True
    hidden, logits, w_gate_up, w_down = moe_inputs(512, h, i, e, torch.bfloat16, device="cuda", skew=False)
    kernels = fused_moe_triton(hidden, logits, w_gate_up, w_down, k, renorm, True)
    assert not triton_moe.uses_grouped_mm(512 * k, e, hidden)  # off by default
    monkeypatch.setattr(triton_moe, "GROUPED_MM_MIN_ROWS", 64)
    assert triton_moe.uses_grouped_mm(512 * k, e, hidden) and not triton_moe.uses_grouped_mm(8 * k, e, hidden)
    grouped = fused_moe_triton(hidden, logits, w_gate_up, w_down, k, renorm, True)
    torch.testing.assert_close(grouped, kernels, rtol=2e-2, atol=2e-2)
    assert_replay_is_eager(lambda x: fused_moe_triton(x, logits, w_gate_up, w_down, k, renorm, True), hidden)


def test_tune_moe_fp8_and_dense_paths_compute_fused_moe(monkeypatch) -> None:
    """bench/tune_moe.py's `--sweeps fp8` paths (weight-only, widened once, W8A8) and `--sweeps
    dense` (per-expert GEMMs) compute fused_moe: timed here by a stand-in clock, each path's
    difference from the 16-bit kernels within e4m3's (W8A8's within two roundings')."""
    from bench_scripts import load_bench_script

    tune = load_bench_script(monkeypatch, "tune_moe")
    monkeypatch.setattr(tune.bc, "call_ms", lambda fn, repeats, timing: (fn(), 1.0)[1])
    if DEVICE == "cuda" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("W8A8 runs the sorted-rows kernels: sm_90 and newer")
    t, h, i, e, top_k = 48, 32, 48, 4, 2
    hidden, logits, w_gate_up, w_down = moe_inputs(t, h, i, e, torch.float16, seed=5)
    reference = fused_moe_triton(hidden, logits, w_gate_up, w_down, top_k, True, True)
    dense = tune.per_expert_dense(hidden, logits, w_gate_up, w_down, top_k, True)
    torch.testing.assert_close(dense.float(), reference.float(), rtol=1e-2, atol=1e-2)
    experts = tune.quantized_experts(w_gate_up, w_down)
    default = choose_tiling(t * top_k, e, i, h)
    args = type("Args", (), {"repeats": 1, "timing": "events"})()
    row = tune.time_fp8_experts(hidden, logits, experts, top_k, True, reference, default, args, "tiny", t, 1.0)
    assert set(row) == {"weight_only", "widened_once", "w8a8", "w8a8_16bit_tiling"}
    for label, figures in row.items():
        limit = 0.1 if label.startswith("w8a8") else 0.05
        assert figures["ms"] == 1.0 and figures["relative_difference_vs_16_bit"] < limit, (label, figures)


@pytest.mark.parametrize("tokens,experts,top_k,renormalize,fp32_weights", [
    (5, 8, 2, True, True), (3, 128, 8, True, False), (4, 512, 10, True, False), (2, 60, 4, False, True)])
def test_router_kernel_matches_route(tokens, experts, top_k, renormalize, fp32_weights) -> None:
    """The softmax top-k router in one kernel (Mixtral's, Qwen3-MoE's and Qwen3-Next's expert
    counts, one that is no power of two; float16 logits): torch's `route` experts and weights
    (compared by expert: among equal probabilities the kernel lists the lower expert first,
    torch's top-k in no set order)."""
    from kiln.kernels.moe import route
    from kiln.kernels.triton_moe_router import route_triton

    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(experts)).to(DEVICE, torch.float16)
    got = route_triton(logits, top_k, renormalize, fp32_weights, torch.float16)
    want = route(logits, top_k, renormalize, fp32_weights, torch.float16)
    assert got.experts.dtype == torch.int64 and got.weights.dtype == want.weights.dtype
    got_ids, got_order = got.experts.sort(dim=-1)
    want_ids, want_order = want.experts.sort(dim=-1)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got.weights.gather(1, got_order), want.weights.gather(1, want_order),
                               rtol=1e-5 if fp32_weights else 1e-3, atol=1e-6)
    assert (got.weights[:, :-1] >= got.weights[:, 1:]).all()  # largest first, as torch's top-k
    if renormalize:
        torch.testing.assert_close(got.weights.float().sum(-1), torch.ones(tokens, device=DEVICE), rtol=1e-3,
                                   atol=1e-3)
