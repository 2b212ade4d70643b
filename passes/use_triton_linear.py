"""`use_triton_linear`: the model's projections as `kiln::linear`, whose CUDA kernel is a GEMV.

Before: y = aten.linear(x, W[, b])   W a graph input of role `param:` (a checkpoint weight,
                                     the merged QKV / gate-up weights, the LM head)
After:  y = kiln.linear(x, W[, b])

At decode the projections are bound by reading their weights, and `kiln::linear`'s Triton
GEMV reads them faster than cuBLAS at 1-16 rows; at other shapes the op calls cuBLAS
itself, so the one graph serves every bucket (kiln.kernels.triton_linear decides per call,
from shapes). Linears over activations (no parameter weight) are left alone.

Phase `logits`, after `prune_logits`: that pass finds the LM head as an `aten.linear`, and
the projections have their final form only after the fusion phase's merges (and any plugin
fusion that matches `aten.linear`). Device policy as for the custom-op fusions
(kiln.passes.fuse_common): CUDA graphs by default; on CPU only with `on_cpu=True` or
`KILN_CPU_FUSIONS=1` (the CPU implementation is F.linear itself, so nothing changes there
but an opaque call Inductor cannot see through).
"""

from __future__ import annotations

import torch

from kiln.compiler.graph_inputs import RoleKind, role_of
from kiln.kernels.linear import linear as linear_op
from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.fuse_common import CudaByDefault

aten = torch.ops.aten


def _is_param(node: object) -> bool:
    return (isinstance(node, torch.fx.Node) and node.op == "placeholder"
            and (role := role_of(node)) is not None and role.kind is RoleKind.PARAM)


def parameter_linears(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The `aten.linear` nodes whose weight is a model parameter (graph input `param:...`)."""
    return [n for n in gm.graph.find_nodes(op="call_function", target=aten.linear.default)
            if len(n.args) >= 2 and _is_param(n.args[1])]


class UseTritonLinearPass(CudaByDefault, KilnPass):
    name = "use_triton_linear"
    phase = "logits"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        if not self.applies_to(gm):
            return {"skipped_on_cpu": 1}
        graph = gm.graph
        replaced = 0
        for node in parameter_linears(gm):
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            with graph.inserting_before(node):
                new = graph.call_function(linear_op.default, (node.args[0], node.args[1], bias))
            new.meta.update(node.meta)  # same value (meta["val"]), same source location
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            replaced += 1
        return {"linear_replaced": replaced}
