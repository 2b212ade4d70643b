"""`fuse_layernorm`: the residual add and the LayerNorm after it as one `kiln::add_layer_norm`.

Before (GPT-2, GPT-NeoX, Phi, StarCoder 2, StableLM, OPT, OLMo, ...; the casts vanish in
float32 graphs):
    s = add(x, residual); out = layer_norm(s, [D], weight, bias, eps)   # s feeds the next add
After:
    out, s = kiln::add_layer_norm(x, residual, weight, bias, eps)

Two forms: with weight and bias (nn.LayerNorm), and with neither (OLMo's non-parametric
LayerNorm). A LayerNorm without an add in front (the first layer's) stays `aten.layer_norm`,
already one kernel. `layer_norm` bakes the normalised shape into the op, so the patterns are
traced for the model's hidden size. Models whose norm is written out by hand (Cohere's
LayerNorm, Gemma's (1+w) RMSNorm) do not match, and keep their unfused graph. Runs on CUDA
graphs by default; see `kiln.passes.fuse_common`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from kiln.passes.base import PassContext
from kiln.passes.fuse_common import CustomOpFusionPass
from kiln.passes.pattern import Pattern


def _affine_pair(hidden: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def add_layer_norm_pattern(x, residual, weight, bias, eps):
        summed = x + residual
        return F.layer_norm(summed, (hidden,), weight, bias, eps), summed

    def add_layer_norm_replacement(x, residual, weight, bias, eps):
        out, summed = torch.ops.kiln.add_layer_norm(x, residual, weight, bias, eps)
        return out, summed

    return add_layer_norm_pattern, add_layer_norm_replacement


def _plain_pair(hidden: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def add_plain_layer_norm_pattern(x, residual, eps):
        summed = x + residual
        return F.layer_norm(summed, (hidden,), None, None, eps), summed

    def add_plain_layer_norm_replacement(x, residual, eps):
        out, summed = torch.ops.kiln.add_layer_norm(x, residual, None, None, eps)
        return out, summed

    return add_plain_layer_norm_pattern, add_plain_layer_norm_replacement


def layer_norm_patterns(hidden: int) -> tuple[Pattern, Pattern]:
    x = torch.randn(4, hidden)
    w = torch.randn(hidden)
    return (Pattern("add_layer_norm", *_affine_pair(hidden), (x, x, w, w, 1e-5)),
            Pattern("add_plain_layer_norm", *_plain_pair(hidden), (x, x, 1e-5)))


class FuseLayerNormPass(CustomOpFusionPass):
    name = "fuse_layernorm"

    def __init__(self, on_cpu: bool | None = None):
        super().__init__(on_cpu)
        self._patterns_by_hidden: dict[int, tuple[Pattern, Pattern]] = {}

    def patterns_for(self, ctx: PassContext) -> Sequence[Pattern]:
        hidden = int(ctx.config.hidden_size)
        if hidden not in self._patterns_by_hidden:
            self._patterns_by_hidden[hidden] = layer_norm_patterns(hidden)
        return self._patterns_by_hidden[hidden]
