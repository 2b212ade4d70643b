"""`kiln::add_layer_norm`: the residual add and the LayerNorm after it, as one op.

    s   = x + residual                       (rounded to the dtype, as the eager add is)
    out = layer_norm(s, weight, bias, eps)   over the last dimension; weight and bias are
                                             optional (OLMo's LayerNorm has neither)

Returns `(out, s)`: `s` is the residual stream the next layer adds to. This is what GPT-2,
GPT-NeoX, Phi, StarCoder 2, StableLM, OPT, OLMo and the other LayerNorm models compute
between a layer's output and the next norm; the `fuse_layernorm` pass forms it. Outputs are
contiguous. The CPU implementation is the plain-torch reference below; the Triton one is in
`kiln.kernels.triton_norm` (CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.library import kiln_op


def add_layer_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = (x + residual).contiguous()
    return F.layer_norm(summed, (summed.shape[-1],), weight, bias, eps).contiguous(), summed


def check_layer_norm_args(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                          bias: torch.Tensor | None) -> None:
    if residual.shape != x.shape:
        raise ValueError(f"add_layer_norm: residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape")
    for label, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dim() != 1 or t.shape[0] != x.shape[-1]):
            raise ValueError(f"add_layer_norm: {label} of shape {tuple(t.shape)} does not match the last "
                             f"dimension of x {tuple(x.shape)}")


@kiln_op("kiln::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    check_layer_norm_args(x, residual, weight, bias)
    return add_layer_norm_reference(x, residual, weight, bias, eps)


@add_layer_norm.register_fake
def _add_layer_norm_fake(x, residual, weight, bias, eps):
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    return (torch.empty(x.shape, dtype=summed_dtype, device=x.device),
            torch.empty(x.shape, dtype=summed_dtype, device=x.device))
