"""Paged attention over a latent cache (multi-head latent attention, `caches_latent`), in Triton.

DeepSeek-V2/V3's, Kimi K2's and GLM-4.7-Flash's attention is cached as its latent: one KV head
of kv_lora_rank + qk_rope_head_dim values a token (512 + 64 = 576), one cache plane that is
both K and V (`kiln.compiler.capture._latent_attention` absorbs kv_b_proj into the queries and
the output). The general kernel (`_paged_attention_kernel` at `LATENT_TILING`) runs it with the
head dim padded to a power of two, 1,024 for 576: 44% of its q.k products and half of its
p.V products and accumulator are padding. This kernel splits the head dim into its two
power-of-two parts (`latent_dims`: 512 + 64) instead, as FlashMLA splits the latent from the
RoPE key, and reads each key tile once for both dots (the values are the keys).

One program per (query tile, block of HEADS query heads of one KV head, KV split): a tile is
BLOCK_T tokens of one sequence times HEADS heads (the general kernel's tile numbering,
`locate_query_tile`); a KV head's GROUP query heads (16 for DeepSeek-V2-Lite, 128 for V3 on
one GPU) take GROUP / HEADS programs, so a tile's accumulator stays within registers
(BLOCK_M x 512 float32) at every group size. Causal masking only: the architectures that cache
a latent have no sliding window, soft-cap, ALiBi or sinks (`latent_kernel_applies`; others run
the general kernel). Splits over the KV length are merged by the general kernel's
`_combine_splits_kernel`. An FP8 cache is read with its k_scale for both K and V (a one-plane
cache stores the keys only), its dots in f16 as in the general kernel.

Compiled for sm_90 (tests/test_kernels_sm90_compile.py); not yet run on a GPU nor tuned: the
launch shapes below are first guesses (`KILN_LATENT_KERNEL=0` runs the general kernel for
A/B runs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.triton_common import (kv_split_range, locate_query_tile, online_softmax_start, pdl_launch_args,
                                        pow2_at_least, wait_for_previous_kernel)

LATENT_KERNEL = os.environ.get("KILN_LATENT_KERNEL", "1") != "0"
SEQ_CHUNK = 64


@dataclass(frozen=True)
class LatentTiling:
    """Launch shape of `_paged_latent_attention_kernel`: query heads per program (a power of
    two, at most the group's), rows (tokens x heads) per tile, keys per iteration, warps, stages."""

    heads: int
    tile_rows: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def tokens(self) -> int:
        """Tokens a tile (BLOCK_T)."""
        return self.tile_rows // self.heads

    def head_blocks(self, group: int) -> int:
        """Programs that share a KV head's `group` query heads."""
        return triton.cdiv(group, self.heads)


# From `bench/tune_latent_attention.py` on an H100 (AN3, DeepSeek-V2-Lite's 16 heads over one
# 576-wide latent): decode, one token's 16 heads a tile on 4 warps, two stages (0.051 against
# 0.080 ms at 64 sequences, 0.133 against 0.275 at 256 for the first guess's 8 warps, one
# stage); prefill and mixed steps, four tokens' 64 rows against 64 keys a step (0.67 against
# 1.61 ms for an 8,000-token prefill; the float32 accumulator over 512 columns is 128
# registers a thread at 8 warps; it spills 64 bytes under the GPU image's Triton 3.6, ~500
# under 3.9, and is still 18% faster than the fastest tiling without spills, 32 keys a step).
# An FP8 cache's decode (AN6, its own sweep): 64 keys a step on 8 warps, 0.053 / 0.160 ms at
# 64 / 256 sequences against 0.062 / 0.189 for the bf16 cache's tiling (which spills 108-160
# bytes there, the e4m3 widening's registers); it spills 4 bytes under Triton 3.6, 68 under 3.9.
# An FP8 cache's prefill (AO2, an H100, 8,000 tokens): the bf16 prefill's tiles in one stage,
# 0.899 against 0.995 ms in two (three 1.016; the general kernel 4.67).
LATENT_DECODE = LatentTiling(heads=16, tile_rows=16, block_n=32, num_warps=4, num_stages=2)
LATENT_DECODE_FP8 = LatentTiling(heads=16, tile_rows=16, block_n=64, num_warps=8, num_stages=2)
LATENT_PREFILL = LatentTiling(heads=16, tile_rows=64, block_n=64, num_warps=8, num_stages=2)
LATENT_PREFILL_FP8 = LatentTiling(heads=16, tile_rows=64, block_n=64, num_warps=8, num_stages=1)


def latent_dims(head_dim: int) -> tuple[int, int] | None:
    """`head_dim` as a power of two and a smaller one of at least 16 (576 = 512 + 64, the
    latent and the RoPE key), or None."""
    main = 1 << (head_dim.bit_length() - 1)
    tail = head_dim - main
    if tail < 16 or tail & (tail - 1):
        return None
    return main, tail


def latent_kernel_applies(kv_cache: torch.Tensor, head_dim: int, sliding_window: int, softcap: float,
                          alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None) -> bool:
    """Whether a call runs this kernel: a one-plane cache of a head dim over 256 that splits
    (`latent_dims`), causal attention without window, soft-cap, ALiBi or sinks."""
    return (LATENT_KERNEL and kv_cache.shape[0] == 1 and head_dim > 256 and latent_dims(head_dim) is not None
            and sliding_window == 0 and softcap == 0.0 and alibi_slopes is None and sinks is None)


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "num_tokens"])
def _paged_latent_attention_kernel(
    q_ptr, cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, kv_scale_ptr,
    scale, num_seqs, num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_bt, stride_c_blk, stride_c_off, stride_c_h,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
    KV_SCALE: tl.constexpr, FP8_CACHE: tl.constexpr, GROUP: tl.constexpr, HEADS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D_MAIN: tl.constexpr, D_TAIL: tl.constexpr, SEQ_CHUNK: tl.constexpr, CACHE_BLOCK: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_previous_kernel(PDL)
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    split = tl.program_id(2)
    first_head = (tl.program_id(1) % HEAD_BLOCKS) * HEADS  # this program's first head within the group
    offs_m = tl.arange(0, BLOCK_M)
    in_group = first_head + offs_m % HEADS  # each row's head within the group
    head = kv_head * GROUP + in_group
    offs_a = tl.arange(0, D_MAIN)
    offs_b = D_MAIN + tl.arange(0, D_TAIL)
    if NUM_SPLITS == 1:
        # The padded tokens' rows, spread over the tiles (with splits the combine zeroes them).
        rows = tl.arange(0, HEADS)
        pad_heads = kv_head * GROUP + first_head + rows
        pad_ok = (first_head + rows < GROUP)[:, None]
        for row in range(tl.load(query_start_loc_ptr + num_seqs) + tile_id, num_tokens, tl.num_programs(0)):
            base = out_ptr + tl.cast(row, tl.int64) * stride_ot + pad_heads[:, None] * stride_oh
            tl.store(base + offs_a[None, :], tl.zeros([HEADS, D_MAIN], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=pad_ok)
            tl.store(base + offs_b[None, :], tl.zeros([HEADS, D_TAIL], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=pad_ok)

    seq, q_start, n_new, tok0 = locate_query_tile(query_start_loc_ptr, num_seqs, tile_id, BLOCK_T, SEQ_CHUNK)
    if tok0 >= n_new:
        return
    first_pos = tl.load(seq_lens_ptr + seq) - n_new  # position of the sequence's first new token
    tok = tok0 + offs_m // HEADS
    row_ok = (tok < n_new) & (in_group < GROUP)
    pos = first_pos + tok
    q_rows = (q_start + tok).to(tl.int64)
    q_base = q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh
    q_a = tl.load(q_base + offs_a[None, :], mask=row_ok[:, None], other=0.0)
    q_b = tl.load(q_base + offs_b[None, :], mask=row_ok[:, None], other=0.0)
    # An FP8 cache: k_scale folds into the softmax scale and, the values being the keys, into
    # the output; the dots run in f16 with the query first brought into f16's range by the
    # power of two below the softmax scale (exact), as in `_paged_attention_kernel`.
    qk_scale = scale * tl.load(kv_scale_ptr) if KV_SCALE else scale
    if FP8_CACHE:
        shift = tl.exp2(tl.floor(tl.log2(scale)))
        q_a = (q_a.to(tl.float32) * shift).to(tl.float16)
        q_b = (q_b.to(tl.float32) * shift).to(tl.float16)
        qk_scale = qk_scale / shift

    kv_lo, kv_hi = kv_split_range(0, first_pos + tl.minimum(tok0 + BLOCK_T, n_new), split, NUM_SPLITS, BLOCK_N)
    m_i, l_i = online_softmax_start(q_ptr, head, row_ok, split, BLOCK_M, False)  # (no sinks)
    acc_a = tl.zeros([BLOCK_M, D_MAIN], tl.float32)
    acc_b = tl.zeros([BLOCK_M, D_TAIL], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < kv_hi
        block = tl.load(table + offs_n // CACHE_BLOCK, mask=n_ok, other=0).to(tl.int64)
        kv_base = cache_ptr + (block * stride_c_blk + (offs_n % CACHE_BLOCK) * stride_c_off + kv_head * stride_c_h)
        # Masked loads (other=0) keep never-written cache slots, which may hold NaN, out.
        k_a = tl.load(kv_base[:, None] + offs_a[None, :], mask=n_ok[:, None], other=0.0).to(q_a.dtype)
        k_b = tl.load(kv_base[:, None] + offs_b[None, :], mask=n_ok[:, None], other=0.0).to(q_a.dtype)
        qk = tl.dot(q_a, tl.trans(k_a), input_precision="ieee")
        qk = tl.dot(q_b, tl.trans(k_b), qk, input_precision="ieee") * qk_scale
        qk = tl.where(n_ok[None, :] & (offs_n[None, :] <= pos[:, None]), qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(k_a.dtype)
        acc_a = tl.dot(p, k_a, acc_a * alpha[:, None], input_precision="ieee")
        acc_b = tl.dot(p, k_b, acc_b * alpha[:, None], input_precision="ieee")
        m_i = m_new

    has_keys = l_i > 0.0
    norm = 1.0 / tl.where(has_keys, l_i, 1.0)
    if KV_SCALE:
        norm = norm * tl.load(kv_scale_ptr)  # the values are the keys: k_scale
    out_a = acc_a * norm[:, None]
    out_b = acc_b * norm[:, None]
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + split * stride_ls + q_rows * stride_lt + head, lse, mask=row_ok)
        part = part_out_ptr + split * stride_ps + q_rows[:, None] * stride_pt + head[:, None] * stride_ph
        tl.store(part + offs_a[None, :], out_a, mask=row_ok[:, None])
        tl.store(part + offs_b[None, :], out_b, mask=row_ok[:, None])
    else:
        dest = out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(dest + offs_a[None, :], out_a.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        tl.store(dest + offs_b[None, :], out_b.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def latent_tiling(num_tokens: int, num_seqs: int, group: int, fp8_cache: bool = False) -> LatentTiling:
    """Decode-shaped steps (one token a sequence) take one token a tile, others four; the heads
    a program takes are capped by the group's."""
    if num_tokens > num_seqs:
        tiling = LATENT_PREFILL_FP8 if fp8_cache else LATENT_PREFILL
    else:
        tiling = LATENT_DECODE_FP8 if fp8_cache else LATENT_DECODE
    heads = min(tiling.heads, pow2_at_least(group))
    return LatentTiling(heads, max(tiling.tile_rows, heads), tiling.block_n, tiling.num_warps, tiling.num_stages)


def launch_paged_latent_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, part_out: torch.Tensor,
                                  part_lse: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                                  query_start_loc: torch.Tensor, kv_scale: torch.Tensor | None, scale: float,
                                  num_splits: int, tiling: LatentTiling) -> None:
    """Launch the kernel over `q` [T, Hq, D] and the one-plane cache `kv_cache` [1, blocks,
    block size, Hkv, D] (D splitting by `latent_dims`), writing `out` (one split) or the
    splits' `part_out` / `part_lse`, which the caller then combines."""
    t, hq, d = q.shape
    hkv = kv_cache.shape[3]
    num_seqs = block_tables.shape[0]
    d_main, d_tail = latent_dims(d)
    group = hq // hkv
    block_t, head_blocks = tiling.tokens, tiling.head_blocks(group)
    cache = kv_cache[0]
    _paged_latent_attention_kernel[(t // block_t + num_seqs, hkv * head_blocks, num_splits)](
        q, cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
        kv_scale if kv_scale is not None else q,
        float(scale), num_seqs, t,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), cache.stride(0), cache.stride(1), cache.stride(2),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        KV_SCALE=kv_scale is not None, FP8_CACHE=kv_cache.element_size() == 1, GROUP=group, HEADS=tiling.heads,
        HEAD_BLOCKS=head_blocks, BLOCK_T=block_t, BLOCK_M=block_t * tiling.heads, BLOCK_N=tiling.block_n,
        D_MAIN=d_main, D_TAIL=d_tail,
        SEQ_CHUNK=SEQ_CHUNK, CACHE_BLOCK=kv_cache.shape[2], NUM_SPLITS=num_splits,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages, **pdl_launch_args(q.device, "attention"),
    )

