"""What the fusion passes share: the on-which-device policy and the HF arithmetic they match.

Default policy: the custom-op fusions (`fuse_rmsnorm`, `fuse_rope`, `fuse_silu_mul`) rewrite
graphs that run on CUDA and leave CPU graphs alone. On CUDA each fused op is one Triton
kernel where the unfused graph needs several launches or an Inductor-generated kernel
that cannot reach across the attention op. On CPU the fused ops run their plain-torch
references, which are opaque to Inductor: the C++ backend would otherwise fuse the same
elementwise chains itself, so the custom ops only add calls and temporaries. Set
`KILN_CPU_FUSIONS=1` (or construct the pass with `on_cpu=True`) to rewrite CPU graphs too,
as the tests do. The projection merges (`merge_qkv`, `merge_gate_up`) change layout only and
run on every device: one larger GEMM beats two or three smaller ones everywhere.

The device is read from the graph itself (the fake values capture left on its inputs), so
the decision needs nothing beyond the graph, and the option enters the pass's uuid.
"""

from __future__ import annotations

import hashlib
import inspect
import operator
import os
import sys
from typing import Any

import torch

from kiln.passes.base import PassContext, PassStats
from kiln.passes.pattern import PatternPass

CPU_FUSIONS_ENV = "KILN_CPU_FUSIONS"


def graph_device_type(gm: torch.fx.GraphModule) -> str:
    """'cuda', 'cpu', ...: the device of the graph's tensor inputs (capture's fake values)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type
    return "cpu"


def cpu_fusions_requested() -> bool:
    return os.environ.get(CPU_FUSIONS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


class CudaByDefault:
    """Mixin for passes that rewrite into Kiln custom ops: on CUDA always, on CPU on request
    (the policy above). Put it before the pass's base class; `applies_to` tells `__call__`."""

    def __init__(self, on_cpu: bool | None = None):
        self.on_cpu = cpu_fusions_requested() if on_cpu is None else bool(on_cpu)

    def options(self) -> dict[str, Any]:
        return {"on_cpu": self.on_cpu}

    def uuid(self) -> str:
        # The policy, and helpers the patterns call (hf_rms_norm), live here: this module's
        # source is part of the identity.
        h = hashlib.sha256(super().uuid().encode())  # type: ignore[misc]
        h.update(inspect.getsource(sys.modules[__name__]).encode())
        return h.hexdigest()[:16]

    def applies_to(self, gm: torch.fx.GraphModule) -> bool:
        return self.on_cpu or graph_device_type(gm) != "cpu"


class CustomOpFusionPass(CudaByDefault, PatternPass):
    """A pattern pass whose replacements are Kiln custom ops: on CUDA always, on CPU on request."""

    phase = "fusion"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        if not self.applies_to(gm):
            return {"skipped_on_cpu": 1}
        return super().__call__(gm, ctx)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama/Qwen RMSNorm as the captured graph computes it (the pattern)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def hf_offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's, Qwen3-Next's and Qwen3.5's RMSNorm (weights stored as offsets from 1, the
    product rounded once), as their modeling code writes it (the pattern)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def hf_rms_norm_fp32_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GPT-OSS's, OLMo 2/3's, Helium's, FlexOlmo's, AFMoE's and Nemotron-H's RMSNorm: the weight
    joins the float32 norm and the product is rounded once (the pattern; Nemotron-H's explicit
    cast of the weight traces the same)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def node_dtype(node: object) -> torch.dtype | None:
    """The dtype of a graph node's example value (None for a non-node or a non-tensor value)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def move_output(graph: torch.fx.Graph, old: torch.fx.Node, source: torch.fx.Node, index: int,
                after: torch.fx.Node) -> torch.fx.Node:
    """Replace `old`, a getitem of an op being fused away, with getitem(source, index) placed
    after `after` (the fused op's output the rest of the graph reads, e.g. a residual sum)."""
    with graph.inserting_after(after):
        new = graph.call_function(operator.getitem, (source, index))
    new.meta.update(old.meta)
    old.replace_all_uses_with(new)
    graph.erase_node(old)
    return new
