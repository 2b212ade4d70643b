"""An example out-of-tree Kiln pass: fuse `gelu(gate, approximate="tanh") * up`.

Registered through the `kiln.passes` entry point (see pyproject.toml); off until enabled
with `--enable-pass fuse_gelu_tanh_and_mul` (Kiln's plugin passes are opt-in).
"""

from kiln_example_pass.fuse import GELU_TANH_AND_MUL, FuseGeluTanhAndMul
from kiln_example_pass.ops import gelu_tanh_and_mul, gelu_tanh_and_mul_reference

__all__ = ["FuseGeluTanhAndMul", "GELU_TANH_AND_MUL", "gelu_tanh_and_mul", "gelu_tanh_and_mul_reference"]
