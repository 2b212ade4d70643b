"""`fuse_rope`: each layer's rotary embedding of q and k as one `kiln::rope` op.

Before (Hugging Face's apply_rotary_pos_emb, q [1, Hq, T, D], k [1, Hkv, T, D], cos/sin [1, T, D]):
    c = unsqueeze(cos, 1); s = unsqueeze(sin, 1)
    q' = add(mul(q, c), mul(cat([neg(slice(q, 3, D/2, end)), slice(q, 3, 0, D/2)]), s))   (same for k)
After:
    q', k' = kiln::rope(q[0].T, k[0].T, cos[0], sin[0], None, None, eps)   (transposed back as views)

Qwen3 normalises each head right before RoPE; that form (RMSNorm of the [1, T, H, D] head
view, transpose, rotate) becomes one `kiln::rope` with the two norm weights, so the q/k
norm costs no launch of its own. It is matched first. This pass must run before
`fuse_rmsnorm`, which would otherwise take the q/k norms (the registry orders them).

cos/sin stay the graph's own computation (once per step, shared by every layer), so
every RoPE variant transformers implements through inv_freq and the attention factor
(Llama 3.1's "llama3" scaling, linear, dynamic NTK, YaRN) is covered without the kernel
knowing about it. The rotation's slices bake in D/2, so patterns are traced for the
model's head_dim. Runs on CUDA graphs by default; see `kiln.passes.fuse_common`.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.passes.base import PassContext, PassStats
from kiln.passes.fuse_common import CustomOpFusionPass, hf_rms_norm
from kiln.passes.pattern import Pattern


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _hf_rope(q, k, cos, sin):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _to_head_major(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)  # [T, H, D] -> [1, H, T, D], a view


def rope_pattern(q, k, cos, sin):
    return _hf_rope(q, k, cos, sin)


def rope_replacement(q, k, cos, sin):
    q_out, k_out = torch.ops.kiln.rope(q.flatten(0, 1).transpose(0, 1), k.flatten(0, 1).transpose(0, 1), cos.flatten(0, 1), sin.flatten(0, 1), None, None, 0.0)
    return _to_head_major(q_out), _to_head_major(k_out)


def qk_norm_rope_pattern(q, k, q_weight, k_weight, cos, sin, eps):
    q = hf_rms_norm(q, q_weight, eps).transpose(1, 2)
    k = hf_rms_norm(k, k_weight, eps).transpose(1, 2)
    return _hf_rope(q, k, cos, sin)


def qk_norm_rope_replacement(q, k, q_weight, k_weight, cos, sin, eps):
    q_out, k_out = torch.ops.kiln.rope(q.flatten(0, 1), k.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1), q_weight, k_weight, eps)
    return _to_head_major(q_out), _to_head_major(k_out)


def rope_patterns(head_dim: int) -> tuple[Pattern, Pattern]:
    """The two patterns for one head_dim: Qwen3's q/k norm + RoPE, and plain RoPE."""
    t, hq, hkv, d = 4, 4, 2, head_dim
    cos, sin = torch.randn(1, t, d), torch.randn(1, t, d)
    qk_norm = Pattern(
        "qk_norm_rope", qk_norm_rope_pattern, qk_norm_rope_replacement,
        (torch.randn(1, t, hq, d), torch.randn(1, t, hkv, d), torch.randn(d), torch.randn(d), cos, sin, 1e-6),
    )
    plain = Pattern("rope", rope_pattern, rope_replacement,
                    (torch.randn(1, hq, t, d), torch.randn(1, hkv, t, d), cos, sin))
    return qk_norm, plain


def model_head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim or config.hidden_size // config.num_attention_heads)


class FuseRoPEPass(CustomOpFusionPass):
    name = "fuse_rope"

    def __init__(self, on_cpu: bool | None = None):
        super().__init__(on_cpu)
        self._patterns_by_head_dim: dict[int, tuple[Pattern, Pattern]] = {}

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        if not self.applies_to(gm):
            return {"skipped_on_cpu": 1}
        head_dim = model_head_dim(ctx.config)
        if head_dim not in self._patterns_by_head_dim:
            self._patterns_by_head_dim[head_dim] = rope_patterns(head_dim)
        return {p.name: p.apply(gm, dtype=ctx.dtype) for p in self._patterns_by_head_dim[head_dim]}
