"""`kv_cache_scales`: per-layer scales for an FP8 (e4m3) KV cache (`kv_cache_dtype="fp8"`).

Before: paged_attention(q, k, v, kv_cache_<layer>, ...)           (or rope_paged_attention)
After:  paged_attention(q, k, v, kv_cache_<layer>, ..., kv_scale=S)
        S a new input `param:<attention module>.kv_cache_scales`, float32 [2] = (k_scale,
        v_scale): the cache stores k / k_scale and v / v_scale, the read multiplies back
        (kiln.kernels.paged_attention).

The scales are graph inputs, not constants, so one artifact serves every checkpoint. The
loader builds each from the checkpoint (`KVCacheScales`: vLLM / llm-compressor `k_scale`,
`v_scale`, the older `kv_scale`, AutoFP8's `k_proj.output_scale`), else 1.0, vLLM's default:
a scale that is safe for any model (K/V up to 448 are kept) but not the best for all: a
layer whose values are small loses many below e4m3's normal range (2^-6; on SmolLM2 43% of
layer 0's V). Calibrated scales (amax / 448 from a calibration set, as llm-compressor
writes them) come with the checkpoint.

Layers that attend over one cache (`kv_sharing`: Gemma 4's last layers read earlier layers')
take the scales of the first of them, the layer that owns the cache.

Phase `logits`: after the attention fusions (fuse_rope has formed rope_paged_attention).
Off unless the KV cache is FP8 (kiln.compiler.startup enables it).
"""

from __future__ import annotations

import torch

from kiln.compiler.graph_inputs import RoleKind, add_graph_input, param_role, role_of
from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.weight_transforms import KVCacheScales

# Where each op takes its layer's cache.
_CACHE_ARG = {"paged_attention": 3, "rope_paged_attention": 8}
SCALES_SUFFIX = "kv_cache_scales"


def attention_module(node: torch.fx.Node, layer: str) -> str:
    """The Hugging Face name of the attention module an attention op came from (its traced
    module stack; capture wraps the model as `hf`), or the Llama-style name of `layer`."""
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path = list(stack.values())[-1][0]
        return path[len("hf."):] if path.startswith("hf.") else path
    return f"model.layers.{layer}.self_attn"


class KVCacheScalesPass(KilnPass):
    name = "kv_cache_scales"
    phase = "logits"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        added = 0
        cache_arg_of = {getattr(torch.ops.kiln, op_name).default: arg for op_name, arg in _CACHE_ARG.items()}
        scale_of: dict[str, torch.fx.Node] = {}  # by cache: layers that share one cache share its scales
        # In graph order, so that of the layers sharing a cache the one that owns it (the first) names the scales.
        for node in list(gm.graph.nodes):
            cache_arg = cache_arg_of.get(node.target) if node.op == "call_function" else None
            if cache_arg is None or "kv_scale" in node.kwargs:
                continue
            role = role_of(node.args[cache_arg])
            if role is None or role.kind is not RoleKind.KV_CACHE:
                raise ValueError(f"kv_cache_scales: {node.name}'s cache argument is not a kv_cache: input")
            if role.name in scale_of:
                node.kwargs = {**node.kwargs, "kv_scale": scale_of[role.name]}
                continue
            module = attention_module(node, role.name)
            output = f"{module}.{SCALES_SUFFIX}"
            q_val = node.args[0].meta.get("val")
            example = q_val.new_empty((2,), dtype=torch.float32) if isinstance(q_val, torch.Tensor) else None
            scale = scale_of[role.name] = add_graph_input(gm, f"kv_cache_scales_{role.name}", param_role(output),
                                                          example)
            node.kwargs = {**node.kwargs, "kv_scale": scale}
            ctx.weight_transforms.append(KVCacheScales(output, module))
            added += 1
        return {"kv_scales_added": added}
