"""Decode attention over an FP8 (e4m3) paged KV cache on e4m3 tensor cores.

`kiln.kernels.triton_paged_attention` runs any step over any cache: its query tiles are
(tokens x grouped heads) rows, so at decode a tile has one token's GROUP heads (4 of
Llama-3's 16 rows) and the e4m3 keys and values must be widened to f16 and moved through
shared memory in their new layout before its f16 MMAs. That widening and moving, not the
HBM read, bounds it: at 1,024 sequences it reads the cache at ~1.8 TB/s, slower than the
bf16 kernel reads twice the bytes (bench/RESULTS.md, J3).

This kernel turns the decode product around: s^T = K q^T, keys as the MMA's rows (its 64-row
side, which a decode's 4-8 heads could never fill) and the heads as its 8-16 columns. The
keys are then the A operand exactly as the cache holds them (head_dim contiguous,
"K-major"), which e4m3 tensor cores (wgmma on sm_90, mma.sync on sm_89) read with no
widening and no layout change. The query is the e4m3 side too, split in two terms, q * mul =
hi + lo / 16 (mul scales each head's largest |q| to 448, e4m3's largest value): hi holds the
4 leading significant bits of each element and lo most of the next 4. Its error is at most
~2^-8 of an element; on Gaussian heads of 128 the logits of a bf16 query move about a third
as much as rounding an f32 query to bf16 moves them, far less than the e4m3 cache's own 2^-4
error. (A power-of-two mul would keep a bf16 query exactly; not yet tried on a GPU.) hi and
lo are the MMA's two column halves: one pass over the keys. The values take the f16 path:
widened by `e4m3_to_f16` on the GPU, then out^T += V^T p. (On e4m3 tensor cores V^T would be
an A operand that is not K-major; on the H200 with Triton 3.6 that variant, p split like q,
hit an illegal address, and reading V as if the cache stored it transposed ran 3.5x slower:
bench/RESULTS.md, L2 and L3.)

The same turn runs over a 16-bit (bf16/f16) cache with the cache dtype's MMAs (`E4M3`
False): s^T = K q^T with the query as it is (no split), out^T += V^T p. The launcher gives
it the small-batch decodes over such a cache (bench/RESULTS.md X6: +1.3% / +1.4% bf16 decode
at batch 1 / 8); a GPU-filling decode keeps the general kernel's one-token tiles, faster
there (Q3, `bench/tune_attention.py --decode-sweep rows`).

With NEW_KV (`NewTokensKV`, `KILN_ATTENTION_FUSED_ROPE`) the kernel also does the step's
cache write, and with ROPE the rotation of its query and keys, after Qwen3's per-head norms
with HAS_NORM (`kiln::rope_paged_attention` in one launch): every program writes its sequence's new keys and values
of its KV head before a CTA barrier, then reads the cache as always.

One program per (sequence, KV head, split); a sequence bringing more than one token (never
at a decode, but the launch decision only sees shapes) runs them one after the other,
each with its own causal limit. With splits and arrival counters, the last split of each
(token, KV head) to finish merges the partials (`_combine_if_last`). In a mixed step
(`SINGLE_TOKENS_ONLY`) the kernel takes only the one-token sequences and the general kernel
the rest. Splits, sliding windows and the
FP8 scales as in the general kernel; soft-capping and ALiBi are not here (the launcher keeps
those models on the general kernel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.triton_common import (arrived_last, e4m3_to_f16, kv_split_range, online_softmax_start,
                                        pdl_launch_args, pow2_at_least, wait_for_previous_kernel, zero_padded_rows)
from kiln.kernels.triton_rope import inv_rms_rounded, rms_normed_rounded, rotate_rounded

# With NEW_KV and splits: only the split programs that read one of the step's new keys (at a
# decode, the last split of each sequence and KV head) write the new keys and values, and
# only they wait at the CTA barrier; the others go straight to their cache reads. Off: on one
# H200 (bench/RESULTS.md Z1, alternating runs) FP8 + FP8 KV decode -0.2% at batch 1 and 8, bf16
# +0.05% / +0.3%; `KILN_ATTENTION_NEW_KV_ONE_WRITER=1` turns it on.
NEW_KV_ONE_WRITER = os.environ.get("KILN_ATTENTION_NEW_KV_ONE_WRITER", "0") != "0"


@triton.jit
def _rotation(cos_ptr, sin_ptr, row, stride_cos, stride_sin, HEAD_DIM: tl.constexpr):
    """Token `row`'s RoPE factors over the head dimension: each element's rotation partner
    ((d + D/2) mod D), cos, and sin negated for d < D/2 (float32; `rotate_rounded`'s)."""
    offs_d = tl.arange(0, HEAD_DIM)
    half = HEAD_DIM // 2
    partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
    cos = tl.load(cos_ptr + row * stride_cos + offs_d).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_sin + offs_d).to(tl.float32)
    return partner, cos, tl.where(offs_d < half, -sin, sin)


@triton.jit
def _query_tile(q_ptr, cos_ptr, sin_ptr, qw_ptr, eps, q_row, heads, head_ok, stride_qt, stride_qh, stride_cos,
                stride_sin, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
                NO_CONTRACT: tl.constexpr):
    """Token q_row's query heads `heads` as a [D, len(heads)] tile in the model dtype; with
    ROPE rotated here (after the per-head norm with HAS_NORM), rounded as `kiln::rope` rounds
    (`rotate_rounded`, `rms_normed_rounded`)."""
    offs_d = tl.arange(0, HEAD_DIM)
    base = q_ptr + q_row * stride_qt + heads[None, :] * stride_qh
    q_t = tl.load(base + offs_d[:, None], mask=head_ok[None, :], other=0.0)
    if ROPE:
        partner, cos, signed_sin = _rotation(cos_ptr, sin_ptr, q_row, stride_cos, stride_sin, HEAD_DIM)
        q_partner = tl.load(base + partner[:, None], mask=head_ok[None, :], other=0.0)
        if HAS_NORM:
            inv_rms = inv_rms_rounded(q_t, eps, 0, HEAD_DIM, NO_CONTRACT)[None, :]
            q_t = rms_normed_rounded(q_t, inv_rms, tl.load(qw_ptr + offs_d).to(tl.float32)[:, None], NO_CONTRACT)
            q_partner = rms_normed_rounded(q_partner, inv_rms, tl.load(qw_ptr + partner).to(tl.float32)[:, None],
                                           NO_CONTRACT)
        q_t = rotate_rounded(q_t, q_partner, cos[:, None], signed_sin[:, None], NO_CONTRACT)
    return q_t


@triton.jit
def _write_new_kv(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, cos_ptr, sin_ptr, kw_ptr, eps,
                  kv_scale_ptr, row, kv_head, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
                  stride_c_blk, stride_c_off, stride_c_h,
                  HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, KV_SCALE: tl.constexpr, ROPE: tl.constexpr,
                  HAS_NORM: tl.constexpr, NO_CONTRACT: tl.constexpr):
    """Token `row`'s key (with ROPE rotated) and value of KV head `kv_head` into its cache
    slot, as `kiln::rope`'s fused write (or `_write_kv_kernel`) would write them: an FP8
    cache holds them divided by the layer's scales in float32, cast with saturation."""
    offs_d = tl.arange(0, HEAD_DIM)
    k_base = k_new_ptr + row * stride_kt + kv_head * stride_kh
    k = tl.load(k_base + offs_d)
    if ROPE:
        partner, cos, signed_sin = _rotation(cos_ptr, sin_ptr, row, stride_cos, stride_sin, HEAD_DIM)
        k_partner = tl.load(k_base + partner)
        if HAS_NORM:
            inv_rms = inv_rms_rounded(k, eps, 0, HEAD_DIM, NO_CONTRACT)
            k = rms_normed_rounded(k, inv_rms, tl.load(kw_ptr + offs_d).to(tl.float32), NO_CONTRACT)
            k_partner = rms_normed_rounded(k_partner, inv_rms, tl.load(kw_ptr + partner).to(tl.float32), NO_CONTRACT)
        k = rotate_rounded(k, k_partner, cos, signed_sin, NO_CONTRACT)
    v = tl.load(v_new_ptr + row * stride_vt + kv_head * stride_vh + offs_d)
    if KV_SCALE:
        k = k.to(tl.float32) / tl.load(kv_scale_ptr)
        v = v.to(tl.float32) / tl.load(kv_scale_ptr + 1)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    dest = (slot // CACHE_BLOCK) * stride_c_blk + (slot % CACHE_BLOCK) * stride_c_off + kv_head * stride_c_h
    tl.store(k_cache_ptr + dest + offs_d, k.to(k_cache_ptr.dtype.element_ty))
    tl.store(v_cache_ptr + dest + offs_d, v.to(v_cache_ptr.dtype.element_ty))


@triton.jit
def _key_range(ctx_len, sliding_window, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) that split `split` reads for the token at position ctx_len - 1."""
    # (chunked, sliding_window < 0: from the start of the query's chunk; the query is key ctx_len - 1)
    chunk = tl.maximum(-sliding_window, 1)
    kv_lo = tl.where(sliding_window > 0, tl.maximum(ctx_len - sliding_window, 0),
                     tl.where(sliding_window < 0, (ctx_len - 1) - (ctx_len - 1) % chunk, 0))
    return kv_split_range(kv_lo, ctx_len, split, NUM_SPLITS, BLOCK_N)


@triton.jit
def _reads_a_new_key(seq_len, n_new, sliding_window, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Whether split `split` reads any of the keys at the sequence's n_new new positions
    [seq_len - n_new, seq_len), for any of its new tokens."""
    first_new = seq_len - n_new
    reads = n_new < 0  # False
    for tok in range(n_new):
        lo, hi = _key_range(first_new + tok + 1, sliding_window, split, NUM_SPLITS, BLOCK_N)
        reads = reads | ((lo < hi) & (hi > first_new))
    return reads


@triton.jit
def _e4m3_query(q_ptr, cos_ptr, sin_ptr, qw_ptr, eps, kv_scale_ptr, scale, q_row, kv_head, stride_qt, stride_qh,
                stride_cos, stride_sin, KV_SCALE: tl.constexpr, GROUP: tl.constexpr, COLS: tl.constexpr,
                HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr, NO_CONTRACT: tl.constexpr):
    """The query as the e4m3 MMA's [D, 2 COLS] operand (hi and lo terms), the weights of its
    two halves and each head's logit scale (module docstring)."""
    cols = tl.arange(0, COLS)
    heads = kv_head * GROUP + cols
    # Columns [0, COLS) of the query operand are the hi terms of the heads, [COLS, 2 COLS)
    # their lo terms (both halves load the same heads); lo carries hi's rounding error (at
    # most 1/16 of hi's magnitude) times 16, and the logits take it back with weight 1/16.
    cols2 = tl.arange(0, 2 * COLS)
    heads2 = kv_head * GROUP + cols2 % COLS
    q_t = _query_tile(q_ptr, cos_ptr, sin_ptr, qw_ptr, eps, q_row, heads2, cols2 % COLS < GROUP, stride_qt,
                      stride_qh, stride_cos, stride_sin, HEAD_DIM, ROPE, HAS_NORM,
                      NO_CONTRACT).to(tl.float32)  # [D, 2 COLS]
    amax2 = tl.max(tl.abs(q_t), axis=0)
    mul2 = tl.where(amax2 > 0.0, 448.0 / amax2, 1.0)
    q_scaled = q_t * mul2[None, :]
    q_hi = q_scaled.to(tl.float8e4nv).to(tl.float32)
    q_split = tl.where((cols2 >= COLS)[None, :], (q_scaled - q_hi) * 16.0, q_scaled).to(tl.float8e4nv)
    half_weight = tl.where(cols2 >= COLS, 0.0625, 1.0)
    # The same per-head multiplier again, in the [COLS] layout of the softmax's statistics.
    amax = tl.max(tl.abs(_query_tile(q_ptr, cos_ptr, sin_ptr, qw_ptr, eps, q_row, heads, cols < GROUP, stride_qt,
                                     stride_qh, stride_cos, stride_sin, HEAD_DIM, ROPE, HAS_NORM,
                                     NO_CONTRACT).to(tl.float32)), axis=0)
    mul = tl.where(amax > 0.0, 448.0 / amax, 1.0)
    # k_scale folds into the logits' scale, v_scale into the output, as in the general kernel.
    col_scale = (scale * tl.load(kv_scale_ptr) if KV_SCALE else scale) / mul
    return q_split, half_weight, col_scale


@triton.jit
def _combine_if_last(out_ptr, part_out_ptr, part_lse_ptr, count_ptr, q_row, kv_head, num_kv_heads, heads, col_ok,
                     stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                     NUM_SPLITS: tl.constexpr, COLS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """After this program's partials are stored: count its arrival at (token, KV head); the
    last split to arrive merges every split's partials into `out` (as `_combine_splits_kernel`
    does, in split order) and resets the counter for the next launch."""
    tile = q_row * num_kv_heads + kv_head
    if arrived_last(count_ptr, tile, NUM_SPLITS):
        offs_d = tl.arange(0, HEAD_DIM)
        m = tl.full([COLS], float("-inf"), tl.float32)
        for split in tl.static_range(NUM_SPLITS):
            m = tl.maximum(m, tl.load(part_lse_ptr + split * stride_ls + q_row * stride_lt + heads, mask=col_ok,
                                      other=float("-inf"), cache_modifier=".cg"))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([COLS], tl.float32)
        acc_t = tl.zeros([HEAD_DIM, COLS], tl.float32)
        for split in tl.static_range(NUM_SPLITS):
            lse = tl.load(part_lse_ptr + split * stride_ls + q_row * stride_lt + heads, mask=col_ok,
                          other=float("-inf"), cache_modifier=".cg")
            w = tl.exp(lse - m_safe)  # 0 for a split that saw no key
            part_t = tl.load(part_out_ptr + split * stride_ps + q_row * stride_pt + heads[None, :] * stride_ph
                             + offs_d[:, None], mask=(col_ok & (lse > float("-inf")))[None, :], other=0.0,
                             cache_modifier=".cg")
            acc_t += part_t * w[None, :]
            total += w
        out_t = acc_t / tl.where(total > 0.0, total, 1.0)[None, :]
        tl.store(out_ptr + q_row * stride_ot + heads[None, :] * stride_oh + offs_d[:, None],
                 out_t.to(out_ptr.dtype.element_ty), mask=col_ok[None, :])
        tl.store(count_ptr + tile, 0)


@triton.jit
def _attend_one_token(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, count_ptr, table, kv_scale_ptr,
    cos_ptr, sin_ptr, qw_ptr, eps, scale, sliding_window, q_row, ctx_len, kv_head, num_kv_heads, split,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_c_blk, stride_c_off, stride_c_h,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_cos, stride_sin,
    KV_SCALE: tl.constexpr, GROUP: tl.constexpr, COLS: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, WIDEN_ASM: tl.constexpr,
    E4M3: tl.constexpr, COMBINE: tl.constexpr, ROPE: tl.constexpr, HAS_NORM: tl.constexpr,
    NO_CONTRACT: tl.constexpr, sinks_ptr, SINKS: tl.constexpr,
):
    """The GROUP heads of token `q_row` (at position ctx_len - 1) over keys [0, ctx_len).
    SINKS: each head's softmax starts at its attention sink (max = sink, sum = 1), in the
    first KV split only, as in the general kernel."""
    offs_d = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, COLS)
    col_ok = cols < GROUP
    heads = kv_head * GROUP + cols
    if E4M3:
        q_op, half_weight, col_scale = _e4m3_query(q_ptr, cos_ptr, sin_ptr, qw_ptr, eps, kv_scale_ptr, scale, q_row,
                                                   kv_head, stride_qt, stride_qh, stride_cos, stride_sin, KV_SCALE,
                                                   GROUP, COLS, HEAD_DIM, ROPE, HAS_NORM, NO_CONTRACT)
    else:
        # A 16-bit cache: the query as it is, in the cache's dtype (a bf16 model's own).
        q_op = _query_tile(q_ptr, cos_ptr, sin_ptr, qw_ptr, eps, q_row, heads, col_ok, stride_qt, stride_qh,
                           stride_cos, stride_sin, HEAD_DIM, ROPE, HAS_NORM,
                           NO_CONTRACT).to(k_cache_ptr.dtype.element_ty)  # [D, COLS]
        col_scale = tl.zeros([COLS], tl.float32) + scale

    kv_lo, kv_hi = _key_range(ctx_len, sliding_window, split, NUM_SPLITS, BLOCK_N)

    m_i, l_i = online_softmax_start(sinks_ptr, heads, col_ok, split, COLS, SINKS)
    acc_t = tl.zeros([HEAD_DIM, COLS], tl.float32)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_hi
        block = tl.load(table + offs_n // CACHE_BLOCK, mask=n_ok, other=0).to(tl.int64)
        kv_offs = block * stride_c_blk + (offs_n % CACHE_BLOCK) * stride_c_off + kv_head * stride_c_h
        # Masked loads (other=0) keep never-written cache slots, which may hold NaN, out.
        k = tl.load(k_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        # V is loaded here with K, not after the softmax that first needs it: both tiles' reads
        # are then in flight together (0.414 against 0.467 ms at 1,024 sequences on the H200,
        # bench/RESULTS.md, M3).
        v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if E4M3:
            s_t = tl.dot(k, q_op)  # [BLOCK_N, 2 COLS], e4m3 x e4m3 -> f32
            s = tl.sum(tl.reshape(s_t * half_weight[None, :], [BLOCK_N, 2, COLS]), axis=1) * col_scale[None, :]
        else:
            s = tl.dot(k, q_op) * col_scale[None, :]  # [BLOCK_N, COLS]
        s = tl.where(n_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a head with no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, axis=0)
        if E4M3:
            v_t = tl.trans(e4m3_to_f16(v) if WIDEN_ASM else v.to(tl.float16))
        else:
            v_t = tl.trans(v)
        acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p.to(v_t.dtype))
        m_i = m_new

    has_keys = l_i > 0.0
    out_t = acc_t / tl.where(has_keys, l_i, 1.0)[None, :]
    if KV_SCALE:
        out_t = out_t * tl.load(kv_scale_ptr + 1)
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_row * stride_lt + heads, lse, mask=col_ok)
        tl.store(part_out_ptr + split * stride_ps + q_row * stride_pt + heads[None, :] * stride_ph
                 + offs_d[:, None], out_t, mask=col_ok[None, :])
        if COMBINE:
            _combine_if_last(out_ptr, part_out_ptr, part_lse_ptr, count_ptr, q_row, kv_head, num_kv_heads, heads,
                             col_ok, stride_ot, stride_oh, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                             NUM_SPLITS, COLS, HEAD_DIM)
    else:
        tl.store(out_ptr + q_row * stride_ot + heads[None, :] * stride_oh + offs_d[:, None],
                 out_t.to(out_ptr.dtype.element_ty), mask=col_ok[None, :])


# As the general kernel: values that change from step to step are not specialised on.
@triton.jit(do_not_specialize=["stride_bt", "num_tokens"])
def _paged_decode_fp8_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, count_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, kv_scale_ptr,
    k_new_ptr, v_new_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    scale, sliding_window, num_tokens, eps,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_bt, stride_c_blk, stride_c_off, stride_c_h,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_sin,
    KV_SCALE: tl.constexpr, GROUP: tl.constexpr, COLS: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr, WIDEN_ASM: tl.constexpr,
    SINGLE_TOKENS_ONLY: tl.constexpr, HEADS_FASTEST: tl.constexpr = False, E4M3: tl.constexpr = True,
    COMBINE: tl.constexpr = False, NEW_KV: tl.constexpr = False, ROPE: tl.constexpr = False,
    HAS_NORM: tl.constexpr = False, NO_CONTRACT: tl.constexpr = False, ONE_WRITER: tl.constexpr = False,
    PDL: tl.constexpr = False, sinks_ptr=None, SINKS: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    if HEADS_FASTEST:  # the grid is (KV heads, sequences, splits): see launch_paged_decode_fp8
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    split = tl.program_id(2)
    if NUM_SPLITS == 1 or COMBINE:
        if split == 0:
            # The padded tokens' rows, spread over the sequence slots (with splits combined by
            # `_combine_splits_kernel`, that kernel zeroes them).
            num_seq_slots = tl.num_programs(1) if HEADS_FASTEST else tl.num_programs(0)
            zero_padded_rows(out_ptr, query_start_loc_ptr, num_seq_slots, num_tokens, seq, num_seq_slots, kv_head,
                             stride_ot, stride_oh, GROUP, COLS, HEAD_DIM, HEAD_DIM)
    q_start = tl.load(query_start_loc_ptr + seq)
    n_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if SINGLE_TOKENS_ONLY and n_new != 1:
        return  # a mixed step's prefill: the general kernel's (see attend_paged_triton)
    if NEW_KV:
        # The step's keys (rotated with ROPE) and values of this KV head, into the cache before
        # they are read. Every split program of the sequence that reads one of them (with
        # ONE_WRITER; else every one) writes them all (the same bytes), so each reads only
        # its own writes: the CTA barrier orders them before its loads, and no program waits
        # on another.
        if ONE_WRITER and NUM_SPLITS > 1:
            writes = _reads_a_new_key(seq_len, n_new, sliding_window, split, NUM_SPLITS, BLOCK_N)
        else:
            writes = n_new > 0
        if writes:
            for tok in range(n_new):
                _write_new_kv(k_new_ptr, v_new_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, cos_ptr, sin_ptr, kw_ptr, eps,
                              kv_scale_ptr, (q_start + tok).to(tl.int64), kv_head, stride_kt, stride_kh, stride_vt,
                              stride_vh, stride_cos, stride_sin, stride_c_blk, stride_c_off, stride_c_h,
                              HEAD_DIM, CACHE_BLOCK, KV_SCALE, ROPE, HAS_NORM, NO_CONTRACT)
            tl.debug_barrier()
    for tok in range(n_new):  # one token at a decode; none for a padded sequence
        _attend_one_token(
            q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr, count_ptr, table, kv_scale_ptr,
            cos_ptr, sin_ptr, qw_ptr, eps, scale, sliding_window, (q_start + tok).to(tl.int64),
            seq_len - n_new + tok + 1, kv_head, num_kv_heads, split,
            stride_qt, stride_qh, stride_ot, stride_oh, stride_c_blk, stride_c_off, stride_c_h,
            stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_cos, stride_sin,
            KV_SCALE, GROUP, COLS, BLOCK_N, HEAD_DIM, CACHE_BLOCK, NUM_SPLITS, WIDEN_ASM, E4M3, COMBINE, ROPE,
            HAS_NORM, NO_CONTRACT, sinks_ptr, SINKS)


@dataclass(frozen=True)
class NewTokensKV:
    """The step's keys and values ([T, Hkv, D]) and their cache slots, for the decode kernel to
    write into the cache itself before reading it (one launch fewer a layer than a write
    kernel first); with `cos` and `sin` ([T, D]) it rotates the keys, and the query, first
    (after Qwen3's per-head norms, given their weights): `kiln::rope_paged_attention` in one
    launch."""

    k: torch.Tensor
    v: torch.Tensor
    slot_mapping: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    # Qwen3's per-head q/k norms ([D] each), applied before the rotation (only with cos/sin).
    q_norm_weight: torch.Tensor | None = None
    k_norm_weight: torch.Tensor | None = None
    eps: float = 0.0


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def decode_fp8_supported(kv_cache: torch.Tensor, head_dim: int, softcap: float, has_alibi: bool) -> bool:
    """Whether this kernel can run the call: an e4m3 cache, a power-of-two head size of at
    least 32 (one e4m3 MMA step), no soft-cap, no ALiBi (attention sinks it takes)."""
    return (kv_cache.dtype == torch.float8_e4m3fn and head_dim >= 32 and head_dim == pow2_at_least(head_dim)
            and softcap <= 0.0 and not has_alibi)


def decode_rows_supported(kv_cache: torch.Tensor, head_dim: int, softcap: float, has_alibi: bool) -> bool:
    """Whether the kernel can run the call over this cache at all: an e4m3 cache as in
    `decode_fp8_supported`, or a bf16/f16 one with a power-of-two head size of at least 16."""
    if kv_cache.dtype in (torch.bfloat16, torch.float16):
        return head_dim >= 16 and head_dim == pow2_at_least(head_dim) and softcap <= 0.0 and not has_alibi
    return decode_fp8_supported(kv_cache, head_dim, softcap, has_alibi)


def launch_paged_decode_fp8(
    q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, kv_scale: torch.Tensor | None,
    scale: float, sliding_window: int, num_splits: int, block_n: int, num_warps: int, num_stages: int,
    widen_asm: bool, single_tokens_only: bool = False, heads_fastest: bool = False,
    combine_counters: torch.Tensor | None = None, new_kv: NewTokensKV | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Fill `out` (num_splits == 1) or the split partials (the general launcher combines them).
    With `single_tokens_only`, only the rows of sequences that bring one token this step. With
    num_splits == 1 the rows of padded tokens (after the last sequence's) are zeroed too.
    With `combine_counters` (zero int32 arrival counters, one per token and KV head: see
    `split_k_counters`) and splits, the last split of each (token, KV head) to finish merges
    the partials into `out` itself, and the padded tokens' rows are zeroed: one launch fewer.

    The grid's first axis is launched first: by default the sequences, so the programs running
    at once read one KV head of many sequences, 128 bytes of each token's 1 KB row of K (Llama-3's
    8 heads x 128, e4m3). `heads_fastest` puts the KV heads first, so the programs of one
    sequence's heads run side by side and read whole rows between them.

    With `new_kv` every program first writes its sequence's new keys (rotated, with cos/sin:
    then `q` is the unrotated query) and values of its KV head into the cache: no token may be
    another kernel's (`single_tokens_only` False). `sinks` ([Hq]): attention sinks (GPT-OSS)."""
    t, hq, d = q.shape
    hkv = kv_cache.shape[3]
    group = hq // hkv
    k_cache, v_cache = kv_cache[0], kv_cache[-1]  # (a one-plane cache: V is K)
    num_seqs = block_tables.shape[0]
    # A grid's second axis holds at most 65,535 programs: more sequences than that stay first.
    heads_fastest = heads_fastest and num_seqs <= 65535
    grid = (hkv, num_seqs, num_splits) if heads_fastest else (num_seqs, hkv, num_splits)
    combine = combine_counters is not None and num_splits > 1 and not single_tokens_only
    if combine and combine_counters.numel() < t * hkv:
        raise ValueError(f"launch_paged_decode_fp8: {combine_counters.numel()} combine counters for {t} tokens x "
                         f"{hkv} KV heads")
    if new_kv is not None:
        if single_tokens_only:
            raise ValueError("launch_paged_decode_fp8: new_kv needs every token's sequence (single_tokens_only off)")
        if new_kv.k.shape != (t, hkv, d) or new_kv.v.shape != (t, hkv, d) or new_kv.slot_mapping.shape != (t,):
            raise ValueError(f"launch_paged_decode_fp8: new_kv's k/v must be [{t}, {hkv}, {d}] with {t} slots; got "
                             f"{tuple(new_kv.k.shape)}, {tuple(new_kv.v.shape)}, {tuple(new_kv.slot_mapping.shape)}")
        k_new, v_new = _last_dim_contiguous(new_kv.k), _last_dim_contiguous(new_kv.v)
        slots = new_kv.slot_mapping
        rope = new_kv.cos is not None
        if rope and (new_kv.sin is None or new_kv.cos.shape != (t, d) or new_kv.sin.shape != (t, d)):
            raise ValueError(f"launch_paged_decode_fp8: new_kv's cos and sin must both be [{t}, {d}]")
        cos, sin = (_last_dim_contiguous(new_kv.cos), _last_dim_contiguous(new_kv.sin)) if rope else (q, q)
        has_norm = rope and new_kv.q_norm_weight is not None
        if has_norm and (new_kv.k_norm_weight is None or new_kv.q_norm_weight.shape != (d,)
                         or new_kv.k_norm_weight.shape != (d,)):
            raise ValueError(f"launch_paged_decode_fp8: new_kv's q and k norm weights must both be [{d}]")
        qw, kw = (new_kv.q_norm_weight.contiguous(), new_kv.k_norm_weight.contiguous()) if has_norm else (q, q)
    else:
        k_new = v_new = slots = cos = sin = qw = kw = q  # unused by the kernel
        rope = has_norm = False
    _paged_decode_fp8_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse, combine_counters if combine else part_lse,
        block_tables, seq_lens, query_start_loc, kv_scale if kv_scale is not None else q,
        k_new, v_new, slots, cos, sin, qw, kw,
        float(scale), int(sliding_window), t, float(new_kv.eps if has_norm else 0.0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos.stride(0), sin.stride(0),
        KV_SCALE=kv_scale is not None, GROUP=group, COLS=pow2_at_least(group, 8), BLOCK_N=block_n,
        HEAD_DIM=d, CACHE_BLOCK=kv_cache.shape[2], NUM_SPLITS=num_splits, WIDEN_ASM=widen_asm,
        SINGLE_TOKENS_ONLY=single_tokens_only, HEADS_FASTEST=heads_fastest,
        E4M3=kv_cache.dtype == torch.float8_e4m3fn, COMBINE=combine,
        NEW_KV=new_kv is not None, ROPE=rope, HAS_NORM=has_norm, ONE_WRITER=NEW_KV_ONE_WRITER and new_kv is not None,
        # RoPE's products rounded on their own as `kiln::rope` rounds them (its kernel compiles
        # with contraction off); here only they are, by inline assembly (CUDA), so the rest of
        # the kernel keeps its FMAs.
        NO_CONTRACT=rope and q.is_cuda, sinks_ptr=sinks if sinks is not None else q, SINKS=sinks is not None,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch_args(q.device, "attention"),
    )
