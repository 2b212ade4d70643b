"""How Kiln's ops are defined: `kiln_op`, a lighter `torch.library.custom_op`.

`torch.library.custom_op` wraps every implementation in `torch._disable_dynamo`, whose
first call imports `torch._dynamo` (and sympy with it) so that `torch.compile` never traces
into the kernel. Kiln never runs its ops under Dynamo: graphs are captured with
`torch.export` (which sees only the fake implementation) and compiled by Inductor, which
calls the op as an opaque kernel. On the H200 machine that import took 5.9 s, paid at the
first step of any process that had not imported it already. So the ops are declared with
the plain dispatcher API: the same schema (inferred from the reference's type hints, as
`custom_op` does), the reference registered for every device, a fake implementation for
tracing, and device kernels (Triton on CUDA) registered over the reference.

The returned `KilnOp` offers the part of `CustomOpDef`'s interface Kiln uses: call it,
`.register_fake(fn)`, `.register_kernel("cuda")(fn)`, and `.default` (the OpOverload).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

# Registrations live as long as this library object does: one for the whole `kiln`
# namespace, kept for the process (it is registration state, not per-request state).
_LIBRARY = torch.library.Library("kiln", "FRAGMENT")

_DEVICE_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


class KilnOp:
    """One `kiln::<name>` operator: callable, with kernels registrable per device."""

    def __init__(self, name: str):
        self.name = name
        self.qualname = f"kiln::{name}"

    @property
    def default(self) -> torch._ops.OpOverload:
        return getattr(torch.ops.kiln, self.name).default

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """The shape-and-dtype implementation used while tracing (fake tensors)."""
        torch.library.register_fake(self.qualname, fn, lib=_LIBRARY)
        return fn

    def register_kernel(self, device_type: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: `fn` serves this device instead of the reference."""
        if device_type not in _DEVICE_DISPATCH_KEYS:
            raise ValueError(f"{self.qualname}: no dispatch key known for device type {device_type!r}")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            _LIBRARY.impl(self.name, fn, _DEVICE_DISPATCH_KEYS[device_type])
            return fn

        return register


def kiln_op(qualname: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable[..., Any]], KilnOp]:
    """Decorator: define `qualname` ("kiln::name") with the decorated function as its
    implementation on every device (the reference), its schema inferred from the
    function's type hints; `mutates_args` names the tensor arguments it writes to."""
    namespace, _, name = qualname.partition("::")
    if namespace != "kiln" or not name:
        raise ValueError(f"kiln_op defines ops in the kiln namespace ('kiln::name'), not {qualname!r}")

    def define(fn: Callable[..., Any]) -> KilnOp:
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        _LIBRARY.define(name + schema)
        # CompositeExplicitAutograd: the kernel for every backend without its own, and no
        # decomposition while tracing (the fake implementation stands for it there).
        _LIBRARY.impl(name, fn, "CompositeExplicitAutograd")
        return KilnOp(name)

    return define
