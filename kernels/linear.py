"""`kiln::linear`: y = x @ weight.T (+ bias), the model's projections as one Kiln op.

    x       [..., K]   any leading dimensions
    weight  [N, K]
    bias    [N] or None
Returns [..., N] in x's dtype, exactly what `torch.nn.functional.linear` returns (the
reference below *is* F.linear, so CPU graphs compute the same numbers with or without the
`use_triton_linear` pass). The op exists for its CUDA kernel: at decode (a few rows) the
projection is bound by reading the weight, and `kiln.kernels.triton_linear` reads it
faster than cuBLAS does at those shapes, falling back to cuBLAS everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.kernels.library import kiln_op


def check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError naming the bad argument; the rules are F.linear's (weight restricted to 2-D)."""
    if x.dim() < 1:
        raise ValueError("linear: x must have at least one dimension (its last is the input features)")
    if weight.dim() != 2:
        raise ValueError(f"linear: weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(f"linear: weight of shape {tuple(weight.shape)} does not match the last "
                         f"dimension of x {tuple(x.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"linear: bias of shape {tuple(bias.shape)} does not match weight {tuple(weight.shape)}")
    dtypes = {x.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) != 1:
        # F.linear refuses mixed dtypes too (with a RuntimeError from the matmul).
        raise ValueError(f"linear: x, weight and bias must share a dtype, got {sorted(map(str, dtypes))}")


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


@kiln_op("kiln::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    check_linear_args(x, weight, bias)
    return linear_reference(x, weight, bias)


@linear.register_fake
def _linear_fake(x, weight, bias=None):
    check_linear_args(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
