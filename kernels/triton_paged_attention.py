"""Triton implementation of `kiln::paged_attention` (registered for CUDA).

Layout and meaning of the arguments are documented in `kiln.kernels.paged_attention`.
One call is up to three launches (for `kiln::rope_paged_attention` the first is the RoPE
kernel of `kiln.kernels.triton_rope`, which writes the rotated keys and the values itself;
with FUSED_ROPE a decode on the keys-as-rows kernel does both in that kernel, one launch):

1. `_write_kv_kernel`: scatter the step's K/V rows into their cache slots.
2. `_paged_attention_kernel`: one program per (query tile, KV head, KV split). A query
   tile is BLOCK_T consecutive new tokens of one sequence times the GROUP query heads that
   share the KV head, so each K/V block is loaded once for the whole group (GQA) and the
   tile is tall enough for tensor cores even when a sequence brings one token (decode).
   Tiles are numbered without a host-side pass: sequence b owns tile ids starting at
   `query_start_loc[b] // BLOCK_T + b`, which is increasing in b and leaves each sequence at
   least the tiles it needs, so a program finds its sequence by counting starts <= its id.
   The kernel walks the sequence's blocks through the block table with an online softmax
   (float32), masking causally by position (and by the sliding window). With a soft-cap
   (Gemma 2) the scaled logits pass through softcap * tanh(x / softcap) first; SOFTCAP is a
   compile-time flag, so models without it run the kernel they ran before. ALiBi (Bloom,
   MPT) adds slope[head] * (k_pos - q_pos) after that, behind the ALIBI flag likewise.
   Attention sinks (GPT-OSS, the SINKS flag) start a row's online softmax at the sink: its
   running max at sink[head] and its sum at one (exp(sink - max)), with nothing added to the
   output; only the first KV split does, so the combine counts the sink once (the keys-as-rows
   decode kernel likewise; it takes no ALiBi, so such decodes run this kernel).
3. When the grid would leave most SMs idle (few sequences: small-batch decode), the KV
   length is split NUM_SPLITS ways (flash-decoding): each split writes its partial output
   and log-sum-exp, and `_combine_splits_kernel` merges them (or, with FUSED_COMBINE, the
   e4m3-MMA decode kernel's last split of each token and KV head does).

A one-plane latent cache (multi-head latent attention, head dim 576) runs
`kiln.kernels.triton_paged_latent`'s kernel instead of 2. and 3.'s first launch: its head dim
split as 512 + 64 rather than padded to 1,024 (`LATENT_TILING` here keeps the general kernel's
path for what that kernel does not take).

Every launch decision is taken from tensor shapes, never from tensor values, so the op
runs inside a captured CUDA graph (shapes are static per bucket) and never synchronises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kiln.kernels.paged_attention import paged_attention as paged_attention_op
from kiln.kernels.paged_attention import check_kv_scale, paged_attention_reference, record_kv_amax
from kiln.kernels.rope_paged_attention import rope_paged_attention as rope_paged_attention_op
from kiln.kernels.triton_common import (SPLIT_K_COUNTERS, converts_e4m3_in_hardware, e4m3_to_f16, kv_split_range,
                                        locate_query_tile, max_shared_memory, multiprocessor_count, num_warps_for,
                                        online_softmax_start, pdl_launch_args, pow2_at_least, split_k_counters,
                                        wait_for_previous_kernel, zero_padded_rows)
from kiln.kernels.triton_paged_latent import (LatentTiling, latent_kernel_applies, latent_tiling,
                                              launch_paged_latent_attention)
from kiln.kernels.triton_paged_decode_fp8 import (NewTokensKV, decode_fp8_supported, decode_rows_supported,
                                                  launch_paged_decode_fp8)
from kiln.kernels.rope import check_rope_args
from kiln.kernels.triton_rope import rope_kernel_applies, rope_triton

MAX_SPLITS = 16
# A split's shortest share of the KV capacity, in KV tiles (choose_num_splits). Each tile a
# program walks is a dependent load chain (block table, K, V), which is what a small-batch
# decode's attention waits on; `KILN_ATTENTION_MIN_SPLIT_TILES` sets it for A/B runs (one
# tile: FP8 decode +0.9% at batch 1, -0.7% at 8 on the H200, bench/RESULTS.md W1).
MIN_SPLIT_TILES = int(os.environ.get("KILN_ATTENTION_MIN_SPLIT_TILES", "2"))
# Keys per iteration of the e4m3-MMA decode kernel for a small-batch decode over an FP8
# cache, whose grid does not fill the GPU and is split over the KV length (0: the general
# kernel's 64-key tiles instead, as until 2026-12-03). That kernel finds its sequence from its
# program id and loads K and V together, a shorter chain of dependent loads than the general
# kernel's tile search: FP8 + FP8 KV decode 367.7 -> 375.4 tokens/s at batch 1 and 2,459.8 ->
# 2,536.0 at batch 8 on one H200 (bench/RESULTS.md, W1; 64 keys: 373.6 / 2,549.7).
# `KILN_ATTENTION_SMALL_DECODE_ROWS` sets it for A/B runs.
SMALL_DECODE_ROWS_BLOCK_N = int(os.environ.get("KILN_ATTENTION_SMALL_DECODE_ROWS", "128"))
# The same for a small-batch decode over a 16-bit (bf16/f16) cache, on the keys-as-rows
# kernel with the cache dtype's MMAs (0: the general kernel's 64-key tiles, as until
# 2026-12-04). The same shorter chain of dependent loads as above: bf16 decode 247.2 -> 250.4
# tokens/s at batch 1 and 1,746 -> 1,772 at batch 8 on one H200 (bench/RESULTS.md X6, two
# alternating runs each). `KILN_ATTENTION_SMALL_DECODE_ROWS_16BIT` sets it for A/B runs.
SMALL_DECODE_ROWS_16BIT_BLOCK_N = int(os.environ.get("KILN_ATTENTION_SMALL_DECODE_ROWS_16BIT", "128"))
# Whether a decode on the e4m3-MMA decode kernel, split over the KV length, merges its splits
# in that kernel (the last split of each token and KV head to finish, counted on the split-K
# arrival counters) instead of in `_combine_splits_kernel`: one launch fewer per layer (32 a
# decode step at Llama-3-8B's shape). Off until measured on a GPU;
# `KILN_ATTENTION_FUSED_COMBINE=1` turns it on for A/B runs.
FUSED_COMBINE = os.environ.get("KILN_ATTENTION_FUSED_COMBINE", "0") != "0"
# Whether `kiln::rope_paged_attention` (without q/k norms) runs a decode that the keys-as-rows
# kernel takes in that one launch: each program rotates its query heads and writes the step's
# rotated keys and values of its KV head into the cache before reading it, instead of the RoPE
# kernel's launch first (32 launches fewer a decode step at Llama-3-8B's shape). On one H200
# (bench/RESULTS.md Y2, two alternating runs each): FP8 + FP8 KV decode +0.5% at batch 1,
# +1.3% at 8; bf16 -0.2% / +1.4%. `KILN_ATTENTION_FUSED_ROPE=0` launches the RoPE kernel first.
FUSED_ROPE = os.environ.get("KILN_ATTENTION_FUSED_ROPE", "1") != "0"
# The same with Qwen3's per-head q/k norms, applied in that kernel before the rotation, for a
# decode of at least this many tokens (0: never). On one H200 at Qwen3-8B's shape (bench/RESULTS.md
# Z2, two alternating runs each) fusing every decode gained at batch 8 (bf16 +1.6%, FP8 + FP8 KV
# +0.4%) and lost at batch 1 (-0.4%, both): a one-token decode has the most split programs, each
# normalizing and rotating the new key before its first cache read, while the RoPE kernel's
# launch it saves is short under PDL. `KILN_ATTENTION_FUSED_ROPE_NORMS=N` sets the threshold.
FUSED_ROPE_NORMS_MIN_TOKENS = int(os.environ.get("KILN_ATTENTION_FUSED_ROPE_NORMS", "2"))
# Rows (tokens x grouped heads) per query tile: decode-shaped steps use short tiles (one
# token per sequence), prefills tall ones.
DECODE_TILE_ROWS = 16
PREFILL_TILE_ROWS = 64
# Sequences' tile starts scanned per vector load when a program looks for its sequence.
SEQ_CHUNK = 64


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr,
    n_kv_heads, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_blk, stride_c_off, stride_c_h,
    CACHE_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, H_PAD: tl.constexpr,
    KV_SCALE: tl.constexpr,
    PDL: tl.constexpr = False, V_IS_K: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h < n_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    dest = (slot // CACHE_BLOCK) * stride_c_blk + (slot % CACHE_BLOCK) * stride_c_off
    dest_offs = dest + h[:, None] * stride_c_h + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    if KV_SCALE:
        # An FP8 cache holds k / k_scale and v / v_scale (the scales are loaded, not passed
        # as floats, so a captured graph serves any checkpoint's scales). The division is in
        # float32, as the reference's; the cast to e4m3 saturates.
        k = k.to(tl.float32) / tl.load(kv_scale_ptr)
    tl.store(k_cache_ptr + dest_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    if not V_IS_K:  # (a one-plane cache holds the keys only, with k_scale)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
        if KV_SCALE:
            v = v.to(tl.float32) / tl.load(kv_scale_ptr + 1)
        tl.store(v_cache_ptr + dest_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# Values that change from step to step are not specialised on (Triton compiles a variant per
# "divisible by 16" / "equals 1" pattern of its int arguments): a continuous-batching run
# would otherwise meet new variants mid-run and stall on their compilation.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_tokens"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, alibi_slopes_ptr, kv_scale_ptr, sinks_ptr,
    scale, num_seqs, sliding_window, softcap, num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_bt, stride_c_blk, stride_c_off, stride_c_h,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, KV_SCALE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SEQ_CHUNK: tl.constexpr,
    CACHE_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, FP8_CACHE: tl.constexpr, WIDEN_ASM: tl.constexpr, V_TRANS: tl.constexpr,
    SKIP_SINGLE_TOKENS: tl.constexpr = False, MASK_ALL_BLOCKS: tl.constexpr = False, SINKS: tl.constexpr = False,
    PDL: tl.constexpr = False, V_IS_K: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if NUM_SPLITS == 1 and not SKIP_SINGLE_TOKENS:
        # The padded tokens' rows, spread over the tiles (with splits the combine zeroes them;
        # with SKIP_SINGLE_TOKENS the e4m3-MMA decode kernel does).
        zero_padded_rows(out_ptr, query_start_loc_ptr, num_seqs, num_tokens, tile_id, tl.num_programs(0), kv_head,
                         stride_ot, stride_oh, GROUP, GROUP_PAD, HEAD_DIM, D_PAD)

    # Which sequence owns this tile (see the module docstring for the numbering).
    seq, q_start, n_new, tok0 = locate_query_tile(query_start_loc_ptr, num_seqs, tile_id, BLOCK_T, SEQ_CHUNK)
    if tok0 >= n_new:
        return
    if SKIP_SINGLE_TOKENS:
        if n_new == 1:
            return  # a one-token sequence of a mixed step: the e4m3-MMA decode kernel's
    ctx_len = tl.load(seq_lens_ptr + seq)
    first_pos = ctx_len - n_new  # position of the sequence's first new token

    offs_m = tl.arange(0, BLOCK_M)
    tok = tok0 + offs_m // GROUP_PAD
    head = kv_head * GROUP + offs_m % GROUP_PAD
    row_ok = (tok < n_new) & (offs_m % GROUP_PAD < GROUP)
    pos = first_pos + tok
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if ALIBI:
        slope = tl.load(alibi_slopes_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
    # An FP8 cache's scales: k_scale folds into the softmax scale (q . (k_scale * k) =
    # k_scale * (q . k)), v_scale into the output (a weighted mean of v_scale * v), so the
    # inner loop reads e4m3 tiles as they are.
    qk_scale = scale * tl.load(kv_scale_ptr) if KV_SCALE else scale
    if FP8_CACHE:
        # The dots run in f16, not the query's bf16: an e4m3 pair widens to f16 in one
        # instruction (cvt.rn.f16x2.e4m3x2), to bf16 only by way of f16 (256 more conversions
        # per thread and tile at the decode tiling, for sm_90). e4m3 keys and values, and
        # the probabilities, are exact or finer in f16; so is a bf16 query once it is inside
        # f16's range (65,504): it is first multiplied by the power of two nearest below the
        # softmax scale (exact), which qk_scale gives back (exact too), so the logits are
        # those of the bf16 dots.
        shift = tl.exp2(tl.floor(tl.log2(scale)))
        q_dot = (q.to(tl.float32) * shift).to(tl.float16)
        qk_scale = qk_scale / shift
    else:
        q_dot = q

    # Keys this tile can see: up to its last token, from its first token's window start.
    kv_hi = first_pos + tl.minimum(tok0 + BLOCK_T, n_new)
    # Windowed: the tile's first row sees back sliding_window - 1 keys; chunked (< 0): back to
    # the start of its chunk of -sliding_window positions (later rows start no earlier).
    chunk = tl.maximum(-sliding_window, 1)
    kv_lo = tl.where(sliding_window > 0, tl.maximum(first_pos + tok0 - sliding_window + 1, 0),
                     tl.where(sliding_window < 0, first_pos + tok0 - (first_pos + tok0) % chunk, 0))
    kv_lo, kv_hi = kv_split_range(kv_lo, kv_hi, split, NUM_SPLITS, BLOCK_N)
    # Keys below kv_full are visible to every row of the tile (the tile's first token sees up
    # to its own position): a block wholly below it needs no mask, which spares the mask's
    # integer work on each of its BLOCK_M x BLOCK_N logits. Only the last block or two of a
    # tile (the causal diagonal, the cache's end) are masked. A sliding window bounds rows
    # from below as well: every block is masked then.
    kv_full = tl.where(sliding_window != 0, kv_lo, tl.minimum(first_pos + tok0 + 1, kv_hi))

    m_i, l_i = online_softmax_start(sinks_ptr, head, row_ok, split, BLOCK_M, SINKS)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_hi
        block = tl.load(table + offs_n // CACHE_BLOCK, mask=n_ok, other=0).to(tl.int64)
        kv_offs = block * stride_c_blk + (offs_n % CACHE_BLOCK) * stride_c_off + kv_head * stride_c_h
        # Masked loads (other=0) keep never-written cache slots, which may hold NaN, out.
        # .to: an FP8 cache is read back in the dots' dtype, f16 (a no-op for a bf16/fp16 cache).
        k = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        k = e4m3_to_f16(k) if WIDEN_ASM else k.to(q_dot.dtype)
        qk = tl.dot(q_dot, k, input_precision="ieee") * qk_scale
        if SOFTCAP:
            # softcap * tanh(qk / softcap), with tanh(x) = 1 - 2 / (exp(2x) + 1): exp
            # overflowing to inf gives 1 and underflowing to 0 gives -1, so no NaN.
            qk = softcap * (1.0 - 2.0 / (tl.exp(2.0 * qk / softcap) + 1.0))
        if ALIBI:
            qk += slope[:, None] * (offs_n[None, :] - pos[:, None]).to(tl.float32)
        if MASK_ALL_BLOCKS or start + BLOCK_N > kv_full:
            allowed = n_ok[None, :] & (offs_n[None, :] <= pos[:, None])
            allowed = allowed & ((sliding_window <= 0) | (offs_n[None, :] > pos[:, None] - sliding_window))
            allowed = allowed & ((sliding_window >= 0) | (offs_n[None, :] >= pos[:, None] - pos[:, None] % chunk))
            qk = tl.where(allowed, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_IS_K:
            # A one-plane (latent) cache: the values are the keys just loaded, not read again.
            v = tl.trans(k)
        elif V_TRANS:
            v = tl.load(v_cache_ptr + kv_offs[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
            v = tl.trans(e4m3_to_f16(v) if WIDEN_ASM else v.to(q_dot.dtype))
        else:
            v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = e4m3_to_f16(v) if WIDEN_ASM else v.to(q_dot.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if KV_SCALE:
        out = out * tl.load(kv_scale_ptr + (0 if V_IS_K else 1))  # a one-plane cache's values: k_scale
    store_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_ok)
        tl.store(part_out_ptr + split * stride_ps + q_rows[:, None] * stride_pt + head[:, None] * stride_ph
                 + offs_d[None, :], out, mask=store_mask)
    else:
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_seqs"])
def _combine_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, query_start_loc_ptr, num_seqs,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    if t >= tl.load(query_start_loc_ptr + num_seqs):
        # A padded token: no split wrote its partials (the buffers are uninitialised). Zero.
        tl.store(out_ptr + t * stride_ot + h * stride_oh + d, tl.zeros([D_PAD], tl.float32).to(out_ptr.dtype.element_ty),
                 mask=d_ok)
        return
    lse = tl.load(part_lse_ptr + s * stride_ls + t * stride_lt + h, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # 0 for splits that saw no key
    total = tl.sum(w, axis=0)
    parts = tl.load(part_out_ptr + s[:, None] * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
                    mask=(lse > float("-inf"))[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def fp8_cache_scale(kv_cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor | None:
    """The scales the kernels apply: only an FP8 cache is scaled, as in the reference."""
    return kv_scale if kv_cache.element_size() == 1 else None


def write_kv_cache_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          kv_scale: torch.Tensor | None = None) -> None:
    t, hkv, d = k.shape
    if t == 0:
        return
    kv_scale = fp8_cache_scale(kv_cache, kv_scale)
    record_kv_amax(k, v, kv_scale, slot_mapping, kv_cache.shape[2])  # start-up KV-scale calibration only (else a no-op)
    k_cache, v_cache = kv_cache[0], kv_cache[-1]  # (a one-plane cache: V is K)
    d_pad = pow2_at_least(d)
    h_pad = pow2_at_least(hkv)
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, kv_scale if kv_scale is not None else slot_mapping,
        hkv, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        CACHE_BLOCK=kv_cache.shape[2], HEAD_DIM=d, D_PAD=d_pad, H_PAD=h_pad, KV_SCALE=kv_scale is not None,
        V_IS_K=kv_cache.shape[0] == 1, num_warps=num_warps_for(h_pad * d_pad), **pdl_launch_args(k.device, "attention"),
    )


@dataclass(frozen=True)
class AttentionTiling:
    """Launch shape of `_paged_attention_kernel`: rows (tokens x grouped heads) per query
    tile, keys per inner iteration, warps (0: from the tile size) and pipeline stages."""

    tile_rows: int
    block_n: int
    num_warps: int = 0
    num_stages: int = 2
    widen_asm: bool = False  # an FP8 cache only: widen e4m3 by inline assembly (`e4m3_to_f16`; not interpreted)
    v_trans: bool = False  # load V tiles as [D, N], as K, and transpose them for the dot
    # Decode with keys as the MMA's rows (`kiln.kernels.triton_paged_decode_fp8`: e4m3 MMAs
    # over an FP8 cache, the cache dtype's over a 16-bit one; block_n, num_warps, num_stages
    # and widen_asm apply).
    keys_as_rows: bool = False
    # A step with more tokens than sequences (mixed): its one-token sequences go to that
    # kernel (at KEYS_AS_ROWS_DECODE's launch shape) and the general kernel skips them.
    singles_as_rows: bool = False
    # That kernel's grid with the KV heads as its first axis (launch_paged_decode_fp8), so a
    # sequence's heads run side by side: 0.430 against 0.440 ms at 1,024 sequences on the
    # H200, and faster at every launch shape of the sweep (bench/RESULTS.md, N4).
    heads_fastest: bool = False
    # Mask every key block instead of only those a tile's rows see in part. On the H200
    # (bench/RESULTS.md, P4) masking only those is 7-9% faster for prefill and mixed tiles,
    # but 4% slower for the one-token decode tile (0.203 against 0.194 ms at 256 sequences):
    # there only the last block needs the mask, and the branch costs more than it saves.
    mask_all_blocks: bool = False


# The e4m3-MMA decode kernel's launch shape (bench/RESULTS.md, L1): 128 keys per iteration,
# 4 warps, one stage, V widened by inline assembly; KV heads first in the grid (N4).
KEYS_AS_ROWS_DECODE = AttentionTiling(DECODE_TILE_ROWS, block_n=128, num_warps=4, num_stages=1, widen_asm=True,
                                      keys_as_rows=True, heads_fastest=True)


# Multi-head latent attention cached as its latent (kv_lora_rank + rope = 576 values, padded to
# 1,024; kiln.kernels.paged_attention.caches_latent): 16 keys and 16 query rows (one token's
# 16 heads of a GQA group) a step, one stage, 8 warps, for every step shape: ~96 KB of shared
# memory for the Q, K and V tiles and the fp32 accumulator at 64 registers a thread; the one-plane
# cache's K tile serves as V (`V_IS_K`), so each key is read once. Compiled for sm_90
# (tests/test_kernels_sm90_compile.py), not yet run on a GPU nor tuned.
LATENT_TILING = AttentionTiling(DECODE_TILE_ROWS, block_n=16, num_warps=8, num_stages=1, mask_all_blocks=True)


def choose_tiling(num_tokens: int, num_seqs: int, d_pad: int, shared_memory: int, fills_gpu: bool,
                  fp8_cache: bool = False, widen_asm: bool = False, e4m3_mma: bool = False,
                  rows_16bit: bool = False) -> AttentionTiling:
    """Decode-shaped steps (one token per sequence) get short tiles, prefills tall ones.

    Measured on an H200 (bench/tune_attention.py, Llama-3-8B heads, the throughput
    workload's contexts): decode reads the KV cache fastest with 128 keys per iteration
    and 3 stages (2.9 TB/s against 2.6 for 64 keys, 2 stages), which needs ~200 KB of shared
    memory for K and V tiles at head dim 128, so smaller GPUs keep 64 keys; prefill and
    mixed steps run best with 64-row tiles on 4 warps (0.73 ms against 1.21 with 8 warps
    on a mixed step of 256 decodes and 8,000 prompt tokens). Small-batch decode, whose grid
    does not fill the GPU (`fills_gpu` False) and is split over the KV length instead,
    keeps the 64-key tiles its split sizes were tuned with.

    Over an FP8 cache (`fp8_cache`) a GPU-filling decode loads 128 keys per iteration straight
    into registers (one stage), V as [D, N] like K, and widens e4m3 by inline assembly
    (`widen_asm`, CUDA only) before the tiles change layout: 0.819 ms against 0.973 for the
    bf16 tiling at 1,024 sequences (bench/RESULTS.md, J4; same output bit for bit). The
    e4m3 tiles then take no byte-wide shared-memory traffic.

    Where the e4m3-MMA decode kernel can run (`e4m3_mma`: an FP8 cache on a GPU with e4m3
    tensor cores, and a call it supports, see `decode_fp8_supported`), a GPU-filling decode
    takes it instead, 128 keys per iteration on 4 warps, one stage: 0.561 ms against J4's
    0.814 at 1,024 sequences, 0.114 against 0.139 at 64 (bench/RESULTS.md, L1); so does a
    small-batch decode, split over the KV length (`SMALL_DECODE_ROWS_BLOCK_N` keys per
    iteration; W1); and in a mixed step it takes the one-token sequences (`singles_as_rows`),
    which the general kernel's 64-row prefill tiles would run with 4 of 64 rows filled.
    Over a 16-bit cache the keys-as-rows kernel (`rows_16bit`: a call it supports) takes a
    small-batch decode too (`SMALL_DECODE_ROWS_16BIT_BLOCK_N` keys per iteration; X6).

    Prefill tiles mask only the key blocks their rows see in part; decode tiles mask every
    block (`AttentionTiling.mask_all_blocks`).
    """
    if d_pad > 256:
        return LATENT_TILING
    if num_tokens <= num_seqs and e4m3_mma and fills_gpu and d_pad <= 128:
        return KEYS_AS_ROWS_DECODE
    if num_tokens <= num_seqs and e4m3_mma and SMALL_DECODE_ROWS_BLOCK_N and d_pad <= 128:
        return replace(KEYS_AS_ROWS_DECODE, block_n=SMALL_DECODE_ROWS_BLOCK_N)
    if num_tokens <= num_seqs and rows_16bit and SMALL_DECODE_ROWS_16BIT_BLOCK_N and not fills_gpu and d_pad <= 128:
        return replace(KEYS_AS_ROWS_DECODE, block_n=SMALL_DECODE_ROWS_16BIT_BLOCK_N, widen_asm=False)
    if num_tokens <= num_seqs and fp8_cache and fills_gpu and d_pad <= 128:
        return AttentionTiling(DECODE_TILE_ROWS, block_n=128, num_warps=4, num_stages=1, widen_asm=widen_asm,
                               v_trans=True, mask_all_blocks=True)
    if num_tokens <= num_seqs:
        kv_tile_bytes = 2 * 128 * d_pad * 2  # K and V, 128 keys, 16-bit
        if fills_gpu and d_pad <= 128 and shared_memory >= 3 * kv_tile_bytes:
            return AttentionTiling(DECODE_TILE_ROWS, block_n=128, num_warps=4, num_stages=3, mask_all_blocks=True)
        return AttentionTiling(DECODE_TILE_ROWS, block_n=64 if d_pad <= 128 else 32, mask_all_blocks=True)
    return AttentionTiling(PREFILL_TILE_ROWS, block_n=64 if d_pad <= 128 else 32,
                           num_warps=4 if d_pad <= 128 else 0, singles_as_rows=e4m3_mma and d_pad <= 128)


def default_tiling(q: torch.Tensor, kv_cache: torch.Tensor, num_seqs: int, softcap: float = 0.0,
                   alibi: bool = False) -> AttentionTiling:
    """The tiling `attend_paged_triton` takes for this call when none is given (choose_tiling
    with the device's facts)."""
    t, _, d = q.shape
    e4m3_hardware = converts_e4m3_in_hardware(q.device)
    return choose_tiling(t, num_seqs, pow2_at_least(d, 16), max_shared_memory(q.device),
                         num_seqs * kv_cache.shape[3] >= multiprocessor_count(q.device),
                         fp8_cache=kv_cache.element_size() == 1, widen_asm=e4m3_hardware,
                         e4m3_mma=e4m3_hardware and decode_fp8_supported(kv_cache, d, softcap, alibi),
                         rows_16bit=kv_cache.element_size() == 2 and decode_rows_supported(kv_cache, d, softcap, alibi))


def choose_num_splits(num_tokens: int, num_seqs: int, num_kv_heads: int, block_t: int, block_n: int,
                      kv_capacity: int, num_sms: int) -> int:
    """How many ways to split the KV length so that the grid fills the GPU (shapes only)."""
    if num_tokens > max(2 * num_seqs, 32):
        return 1  # prefill-shaped: enough query tiles, and split partials would be large
    useful_tiles = max(triton.cdiv(num_tokens, block_t), min(num_seqs, num_tokens))
    programs = useful_tiles * num_kv_heads
    if programs >= num_sms:
        return 1
    splits = min(MAX_SPLITS, triton.cdiv(2 * num_sms, programs))
    # No split shorter than MIN_SPLIT_TILES KV tiles at full capacity: tiny contexts gain nothing.
    return max(1, min(splits, triton.cdiv(kv_capacity, MIN_SPLIT_TILES * block_n)))


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    num_splits: int | None = None,
    tiling: AttentionTiling | LatentTiling | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write K/V into the cache and attend; `num_splits` and `tiling` override the heuristics (tests)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"paged_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
    if kv_cache.stride(-1) != 1 or q.stride(-1) != 1:
        return paged_attention_reference(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens,
                                         query_start_loc, scale, sliding_window, softcap, alibi_slopes, kv_scale,
                                         sinks)
    check_kv_scale(kv_scale, kv_cache)
    kv_scale = fp8_cache_scale(kv_cache, kv_scale)
    write_kv_cache_triton(k, v, kv_cache, slot_mapping, kv_scale)
    return attend_paged_triton(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                               num_splits, tiling, softcap, alibi_slopes, kv_scale, sinks=sinks)


def attend_paged_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    num_splits: int | None = None,
    tiling: AttentionTiling | LatentTiling | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    fuse_combine: bool | None = None,
    new_kv: NewTokensKV | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q over the cache, whose slots for this step's tokens are already written
    (an FP8 cache's values times `kv_scale`, [2] float32 k_scale, v_scale; None: 1). With
    `new_kv` they are not yet, and with its cos/sin q is not yet rotated: the keys-as-rows
    decode kernel does both itself; any other launch gets them done first.

    `num_splits`, `tiling` and `fuse_combine` (None: FUSED_COMBINE) override the shape-based
    and default choices (tests, bench/tune_attention.py)."""
    fuse_combine = FUSED_COMBINE if fuse_combine is None else fuse_combine
    t, hq, d = q.shape
    hkv = kv_cache.shape[3]
    if hq % hkv:
        raise ValueError(f"paged_attention: {hq} query heads are not a multiple of {hkv} KV heads")
    for name, per_head in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if per_head is not None and (per_head.shape != (hq,) or per_head.device != q.device):
            raise ValueError(f"paged_attention: {name} must be [{hq}] on {q.device}, "
                             f"got {tuple(per_head.shape)} on {per_head.device}")
    check_kv_scale(kv_scale, kv_cache)
    kv_scale = fp8_cache_scale(kv_cache, kv_scale)
    num_seqs = block_tables.shape[0]
    if not isinstance(tiling, AttentionTiling) and latent_kernel_applies(kv_cache, d, sliding_window, softcap,
                                                                          alibi_slopes, sinks):
        if new_kv is not None:
            q = _write_new_kv_first(q, new_kv, kv_cache, kv_scale)
        return _attend_latent(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, kv_scale, num_splits,
                              tiling)
    # ALiBi, which the keys-as-rows kernels do not compute, keeps to the general kernel.
    rows_kernel_fits = decode_rows_supported(kv_cache, d, softcap, alibi_slopes is not None)
    tiling = tiling or default_tiling(q, kv_cache, num_seqs, softcap, alibi_slopes is not None)
    keys_as_rows = tiling.keys_as_rows and t <= num_seqs and rows_kernel_fits
    if new_kv is not None and not (keys_as_rows and t > 0):
        q = _write_new_kv_first(q, new_kv, kv_cache, kv_scale)
        new_kv = None
    if t == 0 or num_seqs == 0:
        return torch.zeros_like(q)
    cache_block = kv_cache.shape[2]
    group = hq // hkv
    group_pad = pow2_at_least(group, 1)  # MHA keeps 1: the block shape is BLOCK_M = block_t * group_pad
    d_pad = pow2_at_least(d, 16)
    num_sms = multiprocessor_count(q.device)
    e4m3_hardware = converts_e4m3_in_hardware(q.device)  # sm_89 and newer: e4m3 widening and MMAs
    block_t = max(1, tiling.tile_rows // group_pad)
    block_m = block_t * group_pad
    block_n = tiling.block_n
    if num_splits is None:
        num_splits = choose_num_splits(t, num_seqs, hkv, block_t, block_n, block_tables.shape[1] * cache_block,
                                       num_sms)
    num_tiles = t // block_t + num_seqs
    k_cache, v_cache = kv_cache[0], kv_cache[-1]  # (a one-plane cache: V is K)
    singles_as_rows = not keys_as_rows and tiling.singles_as_rows and rows_kernel_fits
    # Nothing is pre-filled. With splits, the combine writes every row of `out` (padded tokens
    # as zeros) and each split every partial a real token needs: at small-batch decode, two
    # fewer launches per layer. Without, the kernels zero the padded tokens' rows themselves:
    # no fill of the whole output first (3.5 us a layer at 1,024 decodes, ~40 us at 16k tokens).
    out, part_out, part_lse = _output_buffers(q, num_splits)
    num_warps = tiling.num_warps or (4 if block_m * d_pad <= 64 * 64 else 8)
    # None: `_combine_splits_kernel` merges the splits (and zeroes the padded tokens' rows).
    combine_counters = None
    if keys_as_rows:
        if fuse_combine and num_splits > 1 and t * hkv <= SPLIT_K_COUNTERS:
            combine_counters = split_k_counters(q.device)  # None while capturing, before it exists
        launch_paged_decode_fp8(q, kv_cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
                                kv_scale, scale, sliding_window, num_splits, block_n, num_warps, tiling.num_stages,
                                tiling.widen_asm, heads_fastest=tiling.heads_fastest,
                                combine_counters=combine_counters, new_kv=new_kv, sinks=sinks)
    else:
        if singles_as_rows:
            rows = KEYS_AS_ROWS_DECODE  # the decode's measured launch shape (L1)
            launch_paged_decode_fp8(q, kv_cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
                                    kv_scale, scale, sliding_window, num_splits, rows.block_n, rows.num_warps,
                                    rows.num_stages, e4m3_hardware, single_tokens_only=True,
                                    heads_fastest=rows.heads_fastest, sinks=sinks)
        _paged_attention_kernel[(num_tiles, hkv, num_splits)](
            q, k_cache, v_cache, out, part_out, part_lse,
            block_tables, seq_lens, query_start_loc, alibi_slopes if alibi_slopes is not None else q,
            kv_scale if kv_scale is not None else q, sinks if sinks is not None else q,
            float(scale), num_seqs, int(sliding_window), float(softcap), t,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
            SOFTCAP=softcap > 0, ALIBI=alibi_slopes is not None, KV_SCALE=kv_scale is not None, GROUP=group, GROUP_PAD=group_pad, BLOCK_T=block_t, BLOCK_M=block_m, BLOCK_N=block_n,
            HEAD_DIM=d, D_PAD=d_pad, SEQ_CHUNK=SEQ_CHUNK, CACHE_BLOCK=cache_block,
            NUM_SPLITS=num_splits, FP8_CACHE=kv_cache.element_size() == 1,
            WIDEN_ASM=tiling.widen_asm and kv_cache.element_size() == 1, V_TRANS=tiling.v_trans,
            SKIP_SINGLE_TOKENS=singles_as_rows, MASK_ALL_BLOCKS=tiling.mask_all_blocks, SINKS=sinks is not None,
            V_IS_K=kv_cache.shape[0] == 1, num_warps=num_warps,
            num_stages=tiling.num_stages, **pdl_launch_args(q.device, "attention"),
        )
    if num_splits > 1 and combine_counters is None:
        _combine_splits(part_out, part_lse, out, query_start_loc, num_seqs)
    return out


def _output_buffers(q: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention launch's output (like `q`, unfilled) and its splits' float32 partial outputs
    and log-sum-exps ([splits, T, Hq, D], [splits, T, Hq]); without splits the partials are
    `out` itself, which the kernels then do not touch as partials."""
    out = torch.empty_like(q)
    if num_splits == 1:
        return out, out, out
    t, hq, d = q.shape
    return (out, torch.empty((num_splits, t, hq, d), dtype=torch.float32, device=q.device),
            torch.empty((num_splits, t, hq), dtype=torch.float32, device=q.device))


def _combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, query_start_loc: torch.Tensor,
                    num_seqs: int) -> None:
    """Merge a split launch's partial outputs and log-sum-exps into `out` [T, Hq, D] (padded
    tokens' rows zeroed)."""
    num_splits, t, hq, d = part_out.shape
    _combine_splits_kernel[(t, hq)](
        part_out, part_lse, out, query_start_loc, num_seqs,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, SPLITS_PAD=pow2_at_least(num_splits), HEAD_DIM=d, D_PAD=pow2_at_least(d),
        num_warps=4, **pdl_launch_args(out.device, "attention"),
    )


def _attend_latent(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, scale: float, kv_scale: torch.Tensor | None,
                   num_splits: int | None, tiling: LatentTiling | None) -> torch.Tensor:
    """`attend_paged_triton` over a latent cache, on `kiln.kernels.triton_paged_latent`'s kernel."""
    t, hq, _ = q.shape
    num_seqs, hkv = block_tables.shape[0], kv_cache.shape[3]
    if t == 0 or num_seqs == 0:
        return torch.zeros_like(q)
    tiling = tiling or latent_tiling(t, num_seqs, hq // hkv, fp8_cache=kv_cache.element_size() == 1)
    if num_splits is None:
        num_splits = choose_num_splits(t, num_seqs, hkv * tiling.head_blocks(hq // hkv), tiling.tokens,
                                       tiling.block_n, block_tables.shape[1] * kv_cache.shape[2],
                                       multiprocessor_count(q.device))
    out, part_out, part_lse = _output_buffers(q, num_splits)
    launch_paged_latent_attention(q, kv_cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
                                  kv_scale, scale, num_splits, tiling)
    if num_splits > 1:
        _combine_splits(part_out, part_lse, out, query_start_loc, num_seqs)
    return out


def _write_new_kv_first(q: torch.Tensor, new_kv: NewTokensKV, kv_cache: torch.Tensor,
                        kv_scale: torch.Tensor | None) -> torch.Tensor:
    """What the keys-as-rows kernel does with `new_kv`, done by the RoPE or the write kernel
    before another attention launch: returns the query to attend with (rotated, with cos/sin)."""
    if new_kv.cos is None:
        write_kv_cache_triton(new_kv.k, new_kv.v, kv_cache, new_kv.slot_mapping, kv_scale)
        return q
    q_rot, _ = rope_triton(q, new_kv.k, new_kv.cos, new_kv.sin, new_kv.q_norm_weight, new_kv.k_norm_weight,
                           new_kv.eps, write_kv=(new_kv.v, kv_cache, new_kv.slot_mapping, kv_scale))
    return q_rot


def rope_paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    num_splits: int | None = None,
    softcap: float = 0.0,
    kv_scale: torch.Tensor | None = None,
    tiling: AttentionTiling | LatentTiling | None = None,
    fuse_rope: bool | None = None,
    fuse_norms: bool | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE whose kernel writes the rotated k and v into the cache, then attention; with
    `fuse_rope` (None: FUSED_ROPE) and a decode on the keys-as-rows kernel, that kernel alone
    (with q/k norms only with `fuse_norms`, None: at FUSED_ROPE_NORMS_MIN_TOKENS tokens or more).
    `num_splits` and `tiling` override the default choices (tests)."""
    check_kv_scale(kv_scale, kv_cache)
    fuse_rope = FUSED_ROPE if fuse_rope is None else fuse_rope
    if fuse_norms is None:
        fuse_norms = 0 < FUSED_ROPE_NORMS_MIN_TOKENS <= q.shape[0]
    check_rope_args(q, k, cos, sin)
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope: give both q_norm_weight and k_norm_weight, or neither")
    new_kv = NewTokensKV(k, v, slot_mapping, cos, sin, q_norm_weight, k_norm_weight, float(eps))
    # (The decode kernel's own RoPE rounds as a 16-bit graph does: float32 tables, the OLMo
    # family's, take the RoPE kernel's launch first.)
    if not (fuse_rope and (q_norm_weight is None or fuse_norms) and q.stride(-1) == 1 and cos.dtype == q.dtype
            and rope_kernel_applies(q, k, cos, sin, q_norm_weight, k_norm_weight, (v, kv_cache, slot_mapping))):
        q = _write_new_kv_first(q, new_kv, kv_cache, kv_scale)  # the RoPE kernel's launch (or torch's)
        new_kv = None
        if kv_cache.stride(-1) != 1:
            raise ValueError("rope_paged_attention: the KV cache's last dimension must be contiguous")
    # (With new_kv, attend_paged_triton still runs the RoPE kernel first when the call is not
    # a decode on the keys-as-rows kernel.)
    return attend_paged_triton(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                               num_splits, tiling, softcap=softcap, kv_scale=kv_scale, new_kv=new_kv, sinks=sinks)


@paged_attention_op.register_kernel("cuda")
def _paged_attention_cuda(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                          sliding_window, softcap=0.0, alibi_slopes=None, kv_scale=None, *, sinks=None):
    return paged_attention_triton(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                                  scale, sliding_window, softcap=softcap, alibi_slopes=alibi_slopes, kv_scale=kv_scale,
                                  sinks=sinks)


@rope_paged_attention_op.register_kernel("cuda")
def _rope_paged_attention_cuda(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, kv_cache, slot_mapping,
                               block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap=0.0,
                               kv_scale=None, *, sinks=None):
    return rope_paged_attention_triton(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, kv_cache, slot_mapping,
                                       block_tables, seq_lens, query_start_loc, scale, sliding_window,
                                       softcap=softcap, kv_scale=kv_scale, sinks=sinks)
