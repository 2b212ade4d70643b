"""`quantize_fp8`: every projection over a model weight as an FP8 GEMM (`quantization="fp8"`).

Before: y = aten.linear(x, W[, b])          W a graph input `param:NAME`, [N, K] in the compute dtype
After:  xq, x_scale = kiln.quantize_fp8_per_token(x)          (once per x)
        y = kiln.fp8_linear(xq, x_scale, W, W_scale, b, out_dtype)
        W is now float8_e4m3fn [N, K]; W_scale a new input `param:NAME_scale`, float32 [N]

The loader gets a `QuantizeFP8Weight` transform per weight (kiln.passes.weight_transforms):
bf16/fp16/fp32 checkpoints are quantized per output channel at load; FP8 checkpoints keep
their values and scales. Left in the compute dtype, as vLLM leaves them: the LM head (the
logits decide every token; prune_logits already cut it to the sampled rows) and a weight tied
to the embedding, and MoE routers (`...gate.weight`, a few columns whose ranking picks the
experts). Expert weights inside `kiln::fused_moe` are not projections of this form and stay
as they are.

Phase `logits`, after `prune_logits` (which finds the LM head as an `aten.linear`) and before
`use_triton_linear` (which would otherwise take the projections into `kiln::linear`). Off
unless asked for: `quantization="fp8"` enables it (and a pre-quantized checkpoint implies it).
"""

from __future__ import annotations

import operator

import torch

from kiln.compiler.graph_inputs import RoleKind, add_graph_input, param_role, role_of
from kiln.kernels.fp8 import FP8_DTYPE
from kiln.kernels.fp8 import fp8_linear as fp8_linear_op
from kiln.kernels.fp8 import quantize_fp8_per_token as quantize_op
from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.prune_logits import find_lm_head
from kiln.passes.weight_transforms import QuantizeFP8Weight, fp8_scale_name

aten = torch.ops.aten


def _param_name(node: object) -> str | None:
    if isinstance(node, torch.fx.Node) and node.op == "placeholder":
        role = role_of(node)
        if role is not None and role.kind is RoleKind.PARAM:
            return role.name
    return None


def _is_router(name: str) -> bool:
    return name.endswith(".gate.weight")


class QuantizeFP8Pass(KilnPass):
    name = "quantize_fp8"
    phase = "logits"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        graph = gm.graph
        try:
            head = find_lm_head(gm)
        except ValueError:
            head = None
        embedded = {n.args[0] for n in graph.find_nodes(op="call_function", target=aten.embedding.default)}
        quantized_inputs: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]] = {}
        scales: dict[torch.fx.Node, torch.fx.Node] = {}
        replaced = kept = 0
        for node in list(graph.find_nodes(op="call_function", target=aten.linear.default)):
            weight = node.args[1] if len(node.args) > 1 else None
            name = _param_name(weight)
            if name is None:
                continue  # a product of activations, not a projection of a weight
            if node is head or weight in embedded or _is_router(name):
                kept += 1
                continue
            x = node.args[0]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            out_dtype = node.meta["val"].dtype if "val" in node.meta else ctx.dtype
            if weight not in scales:
                val = weight.meta.get("val")
                scale_example = None
                if isinstance(val, torch.Tensor):
                    weight.meta["val"] = val.to(FP8_DTYPE)
                    scale_example = val.new_empty((val.shape[0],), dtype=torch.float32)
                scales[weight] = add_graph_input(gm, f"{weight.name}_scale", param_role(fp8_scale_name(name)),
                                                 scale_example)
                ctx.weight_transforms.append(QuantizeFP8Weight(name))
            if x not in quantized_inputs:
                # Before the first projection of x (in graph order): one quantization serves all.
                with graph.inserting_before(node):
                    q = graph.call_function(quantize_op.default, (x,))
                    xq = graph.call_function(operator.getitem, (q, 0))
                    xs = graph.call_function(operator.getitem, (q, 1))
                if isinstance(x.meta.get("val"), torch.Tensor):
                    xv = x.meta["val"]
                    q.meta["val"] = (xv.to(FP8_DTYPE), xv.new_empty((*xv.shape[:-1], 1), dtype=torch.float32))
                    xq.meta["val"], xs.meta["val"] = q.meta["val"]
                quantized_inputs[x] = (xq, xs)
            xq, xs = quantized_inputs[x]
            with graph.inserting_before(node):
                new = graph.call_function(fp8_linear_op.default, (xq, xs, weight, scales[weight], bias, out_dtype))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            replaced += 1
        return {"fp8_linear": replaced, "kept_high_precision": kept}
