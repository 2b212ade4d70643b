"""Custom ops of Kiln (`torch.ops.kiln.*`).

Each op has a plain-torch reference (CPU, and the ground truth in tests), a fake (meta)
implementation for tracing, and, for fused ops on CUDA, a Triton implementation.
Importing this package registers every op.
"""

from kiln.kernels import attention as attention  # noqa: F401  (registers kiln::attention)
from kiln.kernels import paged_attention as paged_attention  # noqa: F401

__all__ = ["attention", "paged_attention"]
