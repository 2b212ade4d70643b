"""`kiln::attention`: the marker op that capture puts where each layer attends.

The Hugging Face model is traced with an attention function that calls this op once per
layer, so the captured graph holds one opaque node per attention that passes can find and
replace (the paged-KV pass swaps it for `kiln::paged_attention`). Its eager implementation
is plain causal attention over the T tokens of one sequence, so an unrewritten graph still
runs and can be checked against Hugging Face.

Layout is token-major: q [T, Hq, D], k and v [T, Hkv, D], output [T, Hq, D].

Per-layer attention semantics travel as the op's scalar arguments, so the paged-KV pass
and the kernels need no knowledge of the architecture:
  scale           multiplies q.k (transformers' `scaling`: head_dim ** -0.5, Gemma's
                  query_pre_attn_scalar ** -0.5, Granite's attention_multiplier, ...)
  sliding_window  > 0: each query sees its last `sliding_window` keys (itself included);
                  0 on global layers, so windowed and global layers mix freely (Gemma 2/3);
                  < 0: chunked attention (Llama 4's `attention_chunk_size`, C = -sliding_window):
                  each query sees the keys of its own chunk of C positions (p // C the same)
                  up to itself, as Hugging Face's chunked causal mask does
  softcap         > 0: logits become softcap * tanh(logits / softcap) before the mask and
                  softmax (Gemma 2's attn_logit_softcapping); 0 = off
  alibi_slopes    [Hq] float32 or None: ALiBi (Bloom, MPT, Falcon-RW) adds
                  slope[h] * (k_pos - q_pos) to head h's logits after the soft-cap and
                  before the mask. Bloom and MPT write the bias as slope[h] * k_pos (plus
                  a per-model offset); per query row that differs by a constant, which
                  softmax drops. A tensor, not a scalar: it is a graph input (role
                  `constant:alibi_slopes`), so a captured CUDA graph reads it in place.
  sinks           [Hq] or None, keyword-only: attention sinks (GPT-OSS), a learned logit per
                  head that joins every query's softmax as one more key with no value: it
                  adds exp(sink[h]) to the denominator and nothing to the output. A model
                  parameter (read from the checkpoint). Keyword-only in this op and in the
                  paged ops, so passes find it by name whatever the positional arguments.
"""

from __future__ import annotations

import torch

from kiln.kernels.library import kiln_op


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int,
    q_positions: torch.Tensor | None = None,
    k_positions: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q over k/v, causal by position, GQA by head grouping; float32 softmax.

    q [Tq, Hq, D], k/v [Tk, Hkv, D]. Positions default to 0..T-1 for both (a whole prefill).
    sliding_window > 0 limits each query to the last `sliding_window` keys (itself included),
    as Hugging Face's sliding-window mask does; < 0 to its own chunk of -sliding_window
    positions (chunked attention). softcap > 0 caps the scaled logits with
    softcap * tanh(logits / softcap), as Hugging Face's eager Gemma 2 attention does.
    alibi_slopes [Hq] adds slope[h] * (k_pos - q_pos) to the logits (ALiBi). sinks [Hq]
    joins each head's softmax as one more logit whose probability is dropped (GPT-OSS).
    """
    tq, hq, _ = q.shape
    tk, hkv, _ = k.shape
    if q_positions is None:
        q_positions = torch.arange(tk - tq, tk, device=q.device)
    if k_positions is None:
        k_positions = torch.arange(tk, device=q.device)
    group = hq // hkv
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    if alibi_slopes is not None:
        distance = (k_positions[None, :] - q_positions[:, None]).float()
        scores = scores + alibi_slopes.float()[:, None, None] * distance[None]
    allowed = k_positions[None, :] <= q_positions[:, None]
    if sliding_window > 0:
        allowed = allowed & (k_positions[None, :] > q_positions[:, None] - sliding_window)
    elif sliding_window < 0:  # chunked: the query's own chunk of -sliding_window positions
        allowed = allowed & (k_positions[None, :] // -sliding_window == q_positions[:, None] // -sliding_window)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    if sinks is not None:
        sink_column = sinks.float()[:, None, None].expand(hq, tq, 1)
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.float())
    return out.to(q.dtype)


@kiln_op("kiln::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return causal_attention(q, k, v, scale, sliding_window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)


@attention.register_fake
def _attention_fake(q, k, v, layer_idx, scale, sliding_window, softcap=0.0, alibi_slopes=None, *, sinks=None):
    return torch.empty_like(q)
