"""`fuse_rope`: each layer's rotary embedding of q and k as one `kiln::rope` op.

Before (Hugging Face's apply_rotary_pos_emb, q [1, Hq, T, D], k [1, Hkv, T, D], cos/sin [1, T, D]):
    c = unsqueeze(cos, 1); s = unsqueeze(sin, 1)
    q' = add(mul(q, c), mul(cat([neg(slice(q, 3, D/2, end)), slice(q, 3, 0, D/2)]), s))   (same for k)
After:
    q', k' = kiln::rope(q[0].T, k[0].T, cos[0], sin[0], None, None, 0.0)   (transposed back as views)

GPT-OSS rotates by halves (`chunk`, cos/sin of D/2, `cat`): the same rotation, which
becomes `kiln::rope` with cos/sin repeated over both halves (`rope_halves`). Gemma 4 rotates q
and k one at a time while they are still token-major ([1, T, H, D], `unsqueeze(cos, 2)`), each
after its own norm: the same op on the two (`rope_token_major`). Its global layers have a head
size of their own, so the patterns are traced for every head size the model's layers have.

Partial rotary (Qwen3-Next, Qwen3.5, GLM-4.5, GPT-NeoX: cos/sin of R < D, `q[..., :R]` rotated
and concatenated with `q[..., R:]`) becomes `kiln::rope` with the narrow cos/sin (`rope_partial`),
which rotates the first R dims in the kernel and passes the rest. R is read from the graph
(the width of its `cos`), so no config field is needed. Those ropes stay apart from the
attention (no `kv_write_fused`: the decode kernels' own RoPE rotates whole heads).

Qwen3 normalises each head right before RoPE; that form (RMSNorm of the [1, T, H, D] head
view, transpose, rotate) becomes one `kiln::rope` with the two norm weights, so the q/k
norm costs no launch of its own. It is matched first. This pass must run before
`fuse_rmsnorm`, which would otherwise take the q/k norms (the registry orders them).

Then, where a layer's rotated q and k only feed its `kiln::paged_attention` (through
views), the two ops become one `kiln::rope_paged_attention`: its RoPE kernel writes the
rotated keys and the values straight into the KV cache, so the separate cache write and
the rotated-k tensor disappear (stats: kv_write_fused). The OLMo family (OLMo, OLMo 2/3,
FlexOlmo) keeps cos/sin in float32, so a bfloat16 graph rotates in float32 and casts q and k
back before the attention: such a rope folds through those casts, and on CUDA its kernel
computes in float32 and rounds once, as that graph does (`F32_TABLES`; before, the kernel
refused the mixed dtypes and ~14 torch ops a layer rotated, unfolded).

cos/sin stay the graph's own computation (once per step, shared by every layer), so
every RoPE variant transformers implements through inv_freq and the attention factor
(Llama 3.1's "llama3" scaling, linear, dynamic NTK, YaRN) is covered without the kernel
knowing about it. The rotation's slices bake in D/2, so patterns are traced for the
model's head_dim. Runs on CUDA graphs by default; see `kiln.passes.fuse_common`.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from kiln.kernels.paged_attention import kv_heads_and_head_dim
from kiln.passes.base import PassContext, PassStats
from kiln.passes.fuse_common import CustomOpFusionPass, hf_rms_norm, node_dtype
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
    # flatten(0, 1) rather than [0]: indexing would specialise the size-1 batch dimension.
    q_out, k_out = torch.ops.kiln.rope(q.flatten(0, 1).transpose(0, 1), k.flatten(0, 1).transpose(0, 1),
                                       cos.flatten(0, 1), sin.flatten(0, 1), None, None, 0.0)
    return _to_head_major(q_out), _to_head_major(k_out)


def _token_major_rope(x, cos, sin):
    return x * cos.unsqueeze(2) + _rotate_half(x) * sin.unsqueeze(2)


def token_major_rope_pattern(q, k, cos, sin):
    # Gemma 4's: q and k rotated one call at a time (each unsqueezing cos/sin itself) while
    # still [1, T, H, D] (`unsqueeze_dim=2`), after their norms, before the transposes.
    return _token_major_rope(q, cos, sin), _token_major_rope(k, cos, sin)


def token_major_rope_replacement(q, k, cos, sin):
    q_out, k_out = torch.ops.kiln.rope(q.flatten(0, 1), k.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1),
                                       None, None, 0.0)
    return q_out.unsqueeze(0), k_out.unsqueeze(0)


def qk_norm_rope_pattern(q, k, q_weight, k_weight, cos, sin, eps):
    q = hf_rms_norm(q, q_weight, eps).transpose(1, 2)
    k = hf_rms_norm(k, k_weight, eps).transpose(1, 2)
    return _hf_rope(q, k, cos, sin)


def qk_norm_rope_replacement(q, k, q_weight, k_weight, cos, sin, eps):
    q_out, k_out = torch.ops.kiln.rope(q.flatten(0, 1), k.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1),
                                       q_weight, k_weight, eps)
    return _to_head_major(q_out), _to_head_major(k_out)


def _halves_rope(x, cos, sin):
    # GPT-OSS's _apply_rotary_emb: cos/sin of D/2, the two halves rotated and concatenated.
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def halves_rope_pattern(q, k, cos, sin):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return _halves_rope(q, c, s), _halves_rope(k, c, s)


def halves_rope_replacement(q, k, cos, sin):
    # The same rotation with cos/sin repeated over both halves, as kiln::rope (HF's form) takes them.
    return rope_replacement(q, k, torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))


def partial_rope_pattern(q, k, cos, sin):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    rotary_dim = c.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * c) + (_rotate_half(q_rot) * s)
    k_embed = (k_rot * c) + (_rotate_half(k_rot) * s)
    return torch.cat([q_embed, q_pass], dim=-1), torch.cat([k_embed, k_pass], dim=-1)


def partial_rope_patterns(head_dim: int, rotary_dim: int) -> tuple[Pattern, ...]:
    """Partial rotary over the first `rotary_dim` of `head_dim` (as transformers' models with a
    `partial_rotary_factor` write it)."""
    t, hq, hkv = 4, 4, 2
    return (Pattern("rope_partial", partial_rope_pattern, rope_replacement,
                    (torch.randn(1, hq, t, head_dim), torch.randn(1, hkv, t, head_dim),
                     torch.randn(1, t, rotary_dim), torch.randn(1, t, rotary_dim))),)


def rotary_widths(gm: torch.fx.GraphModule) -> set[int]:
    """The last-dim sizes of the graph's `cos` tensors (each RoPE's rotated width)."""
    widths = set()
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.cos.default):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() >= 1 and isinstance(val.shape[-1], int):
            widths.add(val.shape[-1])
    return widths


def rope_patterns(head_dim: int) -> tuple[Pattern, ...]:
    """The patterns for one head_dim: Qwen3's q/k norm + RoPE, plain RoPE, GPT-OSS's RoPE by
    halves (cos/sin of D/2), and Gemma 4's token-major one."""
    t, hq, hkv, d = 4, 4, 2, head_dim
    cos, sin = torch.randn(1, t, d), torch.randn(1, t, d)
    qk_norm = Pattern(
        "qk_norm_rope", qk_norm_rope_pattern, qk_norm_rope_replacement,
        (torch.randn(1, t, hq, d), torch.randn(1, t, hkv, d), torch.randn(d), torch.randn(d), cos, sin, 1e-6),
    )
    plain = Pattern("rope", rope_pattern, rope_replacement,
                    (torch.randn(1, hq, t, d), torch.randn(1, hkv, t, d), cos, sin))
    halves = Pattern("rope_halves", halves_rope_pattern, halves_rope_replacement,
                     (torch.randn(1, hq, t, d), torch.randn(1, hkv, t, d), torch.randn(1, t, d // 2),
                      torch.randn(1, t, d // 2)))
    token_major = Pattern("rope_token_major", token_major_rope_pattern, token_major_rope_replacement,
                          (torch.randn(1, t, hq, d), torch.randn(1, t, hkv, d), cos, sin))
    return qk_norm, plain, halves, token_major


aten = torch.ops.aten
# Ops between a rotated k and the attention that only re-view it ([T,H,D] <-> [1,H,T,D]).
_VIEW_OPS = {aten.transpose.int, aten.unsqueeze.default, aten.select.int, aten.flatten.using_ints,
             aten.view.default, aten.squeeze.dim}


def _is_cast_to(node: torch.fx.Node, dtype: torch.dtype | None) -> bool:
    """`node` is `x.to(dtype)` and nothing else (no copy or memory-format arguments)."""
    return (dtype is not None and node.target == aten.to.dtype and tuple(node.args[1:]) == (dtype,)
            and not node.kwargs)


def _follow_views(node: torch.fx.Node, cast_to: torch.dtype | None = None
                  ) -> tuple[torch.fx.Node, torch.fx.Node, int] | None:
    """(consumer, value, casts): walk the single-user chain of view ops from `node`, and of
    casts to `cast_to` (counted) where that is given."""
    value, casts = node, 0
    while len(value.users) == 1:
        user = next(iter(value.users))
        if user.op == "call_function" and user.args[0] is value and (user.target in _VIEW_OPS
                                                                     or _is_cast_to(user, cast_to)):
            casts += user.target == aten.to.dtype
            value = user
            continue
        return user, value, casts
    return None



def _same_layout(end: torch.fx.Node, start: torch.fx.Node) -> bool:
    """Whether the views from `start` (a rope output) to `end` give back start's own layout.

    The views are replayed on start's example value rather than read from their own: a
    pattern's replacement gives its outputs fresh values, but the views after it keep those
    of the rotation they replaced, whose layout may differ (GPT-OSS's `cat` made q contiguous
    head-major, the rope op writes it token-major)."""
    va = start.meta.get("val")
    if not isinstance(va, torch.Tensor):
        return False
    replayed, node = va, start
    try:
        while node is not end:
            node = next(iter(node.users))
            replayed = node.target(replayed, *node.args[1:], **node.kwargs)
    except Exception:  # a view the example value does not support: no fold
        return False
    return replayed.shape == va.shape and replayed.stride() == va.stride()


def fold_rope_into_attention(gm: torch.fx.GraphModule) -> int:
    """Replace rope -> (views) -> paged_attention by one `kiln::rope_paged_attention`.

    Only where the rotated q and k reach the attention through views that give back the
    very layout rope produced, and are used nowhere else: then the rotated k need not
    exist as a tensor, since the RoPE kernel can write it into the cache. The OLMo family's
    float32 cos/sin rotate 16-bit heads in float32: such a rope folds only where each output
    is cast back to its head's dtype on the way, as the fused op returns it
    (`kiln.kernels.rope.rotated_for_attention`).
    """
    graph = gm.graph
    folded = 0
    for rope in list(graph.find_nodes(op="call_function", target=torch.ops.kiln.rope.default)):
        outs = {u.args[1]: u for u in rope.users if u.op == "call_function" and u.target is operator.getitem}
        if len(rope.users) != 2 or set(outs) != {0, 1}:
            continue
        q_dtype, k_dtype, cos_dtype = node_dtype(rope.args[0]), node_dtype(rope.args[1]), node_dtype(rope.args[2])
        widened = q_dtype is not None and cos_dtype is not None and cos_dtype != q_dtype and rope.args[4] is None
        q_end = _follow_views(outs[0], q_dtype if widened else None)
        k_end = _follow_views(outs[1], k_dtype if widened else None)
        if q_end is None or k_end is None or q_end[0] is not k_end[0]:
            continue
        if (q_end[2], k_end[2]) != ((1, 1) if widened else (0, 0)):
            continue  # float32 tables: each rotated head cast back once, or no fold
        attn = q_end[0]
        if attn.target != torch.ops.kiln.paged_attention.default or attn.args[0] is not q_end[1] \
                or attn.args[1] is not k_end[1]:
            continue
        if not (_same_layout(q_end[1], outs[0]) and _same_layout(k_end[1], outs[1])):
            continue
        q, k, cos, sin, q_weight, k_weight, eps = rope.args
        cos_val, q_val = cos.meta.get("val"), q.meta.get("val")
        if (isinstance(cos_val, torch.Tensor) and isinstance(q_val, torch.Tensor)
                and cos_val.shape[-1] != q_val.shape[-1]):
            continue  # partial rotary: the decode kernels' own RoPE rotates whole heads
        _, _, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, window, *rest = attn.args
        softcap = rest[0] if rest else 0.0
        if len(rest) > 1 and rest[1] is not None:
            continue  # ALiBi slopes: the fused op does not carry them (no model has both RoPE and ALiBi)
        sinks = attn.kwargs.get("sinks")  # GPT-OSS: carried over by name
        with graph.inserting_before(attn):
            fused = graph.call_function(torch.ops.kiln.rope_paged_attention.default, (
                q, k, v, cos, sin, q_weight, k_weight, eps, kv_cache, slot_mapping, block_tables, seq_lens,
                query_start_loc, scale, window, softcap), {"sinks": sinks} if sinks is not None else {})
        fused.meta.update({key: val for key, val in attn.meta.items() if key in ("val", "stack_trace", "nn_module_stack")})
        attn.replace_all_uses_with(fused)
        graph.erase_node(attn)  # the rope node and the views die with it (dead-code elimination)
        folded += 1
    return folded


def model_head_dims(config: Any) -> list[int]:
    """The head sizes of the model's attention layers (Gemma 4's global layers have their own)."""
    layers = range(config.num_hidden_layers) if getattr(config, "is_heterogeneous", False) else [None]
    return sorted({kv_heads_and_head_dim(config, 1, layer)[1] for layer in layers})


class FuseRoPEPass(CustomOpFusionPass):
    name = "fuse_rope"

    def __init__(self, on_cpu: bool | None = None):
        super().__init__(on_cpu)
        self._patterns_by_head_dim: dict[int, tuple[Pattern, ...]] = {}
        self._partial_patterns: dict[tuple[int, int], tuple[Pattern, ...]] = {}

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        if not self.applies_to(gm):
            return {"skipped_on_cpu": 1}
        stats: PassStats = {}
        partial = 0
        for head_dim in model_head_dims(ctx.config):
            if head_dim not in self._patterns_by_head_dim:
                self._patterns_by_head_dim[head_dim] = rope_patterns(head_dim)
            for p in self._patterns_by_head_dim[head_dim]:
                stats[p.name] = stats.get(p.name, 0) + p.apply(gm, dtype=ctx.dtype)
            for width in sorted(w for w in rotary_widths(gm) if w < head_dim and w % 2 == 0):
                key = (head_dim, width)
                if key not in self._partial_patterns:
                    self._partial_patterns[key] = partial_rope_patterns(head_dim, width)
                partial += sum(p.apply(gm, dtype=ctx.dtype) for p in self._partial_patterns[key])
        stats["rope_partial"] = partial
        stats["kv_write_fused"] = fold_rope_into_attention(gm)
        return stats
