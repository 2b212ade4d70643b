"""`kiln::rope_paged_attention`: RoPE (optionally after Qwen3's q/k norm), the KV-cache write
and paged attention as one op, so the rotated keys go straight into the cache.

Arguments are those of `kiln::rope` (q and k before rotation, cos/sin, the optional norm
weights and eps) followed by those of `kiln::paged_attention` after q/k/v (the cache, the
batch metadata, scale, sliding window, soft-cap, the FP8 cache's kv_scale; keyword-only, the attention sinks); layouts are documented in `kiln.kernels.rope` and
`kiln.kernels.paged_attention`. It computes exactly

    q', k' = rope(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)   (in q's and k's dtype:
             `rotated_for_attention`, for the OLMo family's float32 cos/sin)
    out    = paged_attention(q', k', v, kv_cache, ...)

On CUDA (`kiln.kernels.triton_paged_attention`) the rotation kernel writes k' and v into
their cache slots itself, so neither a rotated-k tensor nor a separate cache-write launch
exists. The `fuse_rope` pass forms this op where a layer's rotated k feeds only its
attention. The CPU implementation is the composition of the two references.
"""

from __future__ import annotations

import torch

from kiln.kernels.library import kiln_op
from kiln.kernels.paged_attention import paged_attention_reference
from kiln.kernels.rope import check_rope_args, rope_reference, rotated_for_attention


@kiln_op("kiln::rope_paged_attention", mutates_args=("kv_cache",))
def rope_paged_attention(
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
    softcap: float = 0.0,
    kv_scale: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    check_rope_args(q, k, cos, sin)
    q_rot, k_rot = rotated_for_attention(*rope_reference(q, k, cos, sin, q_norm_weight, k_norm_weight, eps), q, k,
                                         q_norm_weight)
    return paged_attention_reference(q_rot, k_rot, v, kv_cache, slot_mapping, block_tables, seq_lens,
                                     query_start_loc, scale, sliding_window, softcap, kv_scale=kv_scale, sinks=sinks)


@rope_paged_attention.register_fake
def _rope_paged_attention_fake(q, k, v, cos, sin, q_norm_weight, k_norm_weight, eps, kv_cache, slot_mapping,
                               block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap=0.0,
                               kv_scale=None, *, sinks=None):
    dtype = q.dtype if q_norm_weight is None else torch.promote_types(q.dtype, q_norm_weight.dtype)
    return torch.empty(q.shape, dtype=dtype, device=q.device)
