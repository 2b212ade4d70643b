"""The pass protocol and the context every pass sees.

A pass is a callable object with a `name`, a `phase`, a `uuid()` that changes whenever its
source or options change (it is part of every cache key, so an edited pass never reuses an
artifact compiled by the old one), and `__call__(graph_module, ctx) -> stats`.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from kiln.compiler.graph_inputs import add_graph_input  # noqa: F401  (part of the pass API)

PassStats = dict[str, int]


@dataclass
class PassContext:
    """What passes may read about the model and the runtime layout they rewrite for."""

    config: Any
    dtype: torch.dtype = torch.float32
    # Tensor parallelism (kiln.passes.shard_tensor_parallel): the graph is this rank's of
    # tp_size. Both are cache-key factors (kiln.cache.keys.model_factors).
    tp_size: int = 1
    tp_rank: int = 0
    # Filled by passes for later stages (e.g. weight transforms the loader applies).
    weight_transforms: list[Any] = field(default_factory=list)


@runtime_checkable
class GraphPass(Protocol):
    name: str
    phase: str

    def uuid(self) -> str: ...

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats: ...


class KilnPass:
    """Convenience base: uuid from the class's source (and its module's) plus `options()`."""

    name: str = ""
    phase: str = ""

    def options(self) -> dict[str, Any]:
        return {}

    def uuid(self) -> str:
        h = hashlib.sha256()
        h.update(inspect.getsource(inspect.getmodule(type(self))).encode())
        h.update(repr(sorted(self.options().items())).encode())
        return h.hexdigest()[:16]

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        raise NotImplementedError
