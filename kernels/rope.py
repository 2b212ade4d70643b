"""`kiln::rope`: rotary position embedding of q and k in one op, optionally after q/k RMSNorm.

    q [T, Hq, D], k [T, Hkv, D]   the step's queries and keys (token-major, any strides)
    cos, sin [T, R]               the rotation of each token, as the graph computed it: R = D,
                                  or R < D (partial rotary: Qwen3-Next, Qwen3.5, GLM-4.5,
                                  GPT-NeoX rotate the first R dims, the rest pass unchanged)
    q_norm_weight, k_norm_weight  [D] or None: Qwen3 normalises each head of q and k
                                  (RMSNorm over D) right before RoPE; passing the weights
                                  fuses that norm into the same kernel
    eps                           the norm's epsilon (unused without norm weights)
Returns (q_out, k_out), contiguous, shapes of q and k.

The op takes cos/sin rather than positions: the graph already computes them once per step
from position_ids and the model's inv_freq buffer, and that buffer carries every scaling
rule transformers implements (Llama 3.1's "llama3" frequency scaling, linear, dynamic,
YaRN's attention factor folded into cos/sin), so the kernel needs no knowledge of any of
them. Rotation is the "rotate half" convention of Llama/Qwen/Mistral:

    out = x * cos + cat(-x[..., D/2:], x[..., :D/2]) * sin

with each product rounded to the model dtype as the eager graph does (cos/sin in float32
beside 16-bit q/k, the OLMo family's tables: in float32, returned in float32, as its graph
computes before casting back). The CPU implementation is the reference below;
`kiln.kernels.triton_rope` registers the CUDA one.
"""

from __future__ import annotations

import torch

from kiln.kernels.library import kiln_op
from kiln.kernels.rms_norm import rms_norm_reference


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    c, s = cos[:, None, :], sin[:, None, :]
    r = cos.shape[-1]

    def rotate(x: torch.Tensor, norm_weight: torch.Tensor | None) -> torch.Tensor:
        if norm_weight is not None:
            x = rms_norm_reference(x, norm_weight, eps)
        if r == x.shape[-1]:
            return (x * c + rotate_half(x) * s).contiguous()
        rot = x[..., :r]
        return torch.cat([rot * c + rotate_half(rot) * s, x[..., r:]], dim=-1).contiguous()

    return rotate(q, q_norm_weight), rotate(k, k_norm_weight)


def rotated_for_attention(q_rot: torch.Tensor, k_rot: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          q_norm_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated q and k as `kiln::rope_paged_attention` attends with them: in the heads' own
    dtype (promoted with the norm weights'), not cos/sin's. Only float32 tables beside 16-bit
    heads make a difference: the OLMo family's graph computes its RoPE in float32 and casts it
    back before the attention, and `fuse_rope` folds such a rope only through those casts."""
    def dtype(x: torch.Tensor) -> torch.dtype:
        return x.dtype if q_norm_weight is None else torch.promote_types(x.dtype, q_norm_weight.dtype)

    return q_rot.to(dtype(q)), k_rot.to(dtype(k))


def check_rope_args(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    partial: bool = False) -> None:
    """Shapes as `kiln::rope` takes them; cos/sin narrower than D (an even R) only with `partial`."""
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"rope: q and k must be [T, H, D]; got {tuple(q.shape)} and {tuple(k.shape)}")
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or d % 2:
        raise ValueError(f"rope: q {tuple(q.shape)} and k {tuple(k.shape)} must share T and an even D")
    r = cos.shape[-1] if cos.dim() == 2 else -1
    if not (r == d or (partial and 0 < r < d and r % 2 == 0)) or cos.shape != (t, r) or sin.shape != (t, r):
        want = f"[T, R] with an even R <= D = {d}" if partial else f"[T, D] = [{t}, {d}]"
        raise ValueError(f"rope: cos/sin must be {want}; got {tuple(cos.shape)}, {tuple(sin.shape)}")


@kiln_op("kiln::rope", mutates_args=())
def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_rope_args(q, k, cos, sin, partial=True)
    return rope_reference(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)


@rope.register_fake
def _rope_fake(q, k, cos, sin, q_norm_weight, k_norm_weight, eps):
    def out(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        dtype = x.dtype if w is None else torch.promote_types(x.dtype, w.dtype)
        return torch.empty(x.shape, dtype=torch.promote_types(dtype, cos.dtype), device=x.device)

    return out(q, q_norm_weight), out(k, k_norm_weight)
