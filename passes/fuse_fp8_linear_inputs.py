"""`fuse_fp8_linear_inputs`: each FP8 projection and the op that makes its input, as one op.

Before: xq, xs[, summed] = kiln.add_rms_norm_quant_fp8(x, residual, norm_w, eps)
        y = kiln.fp8_linear(xq, xs, W, W_scale, b, out_dtype)
After:  y, summed = kiln.add_rms_norm_fp8_linear(x, residual, norm_w, eps, W, W_scale, b, out_dtype)

and likewise `rms_norm_quant_fp8` -> `kiln::rms_norm_fp8_linear`, the offset norm forms
(`offset_rms_norm_quant_fp8`, `add_offset_rms_norm_quant_fp8`: Gemma's, Qwen3-Next's) ->
`kiln::offset_rms_norm_fp8_linear` / `kiln::add_offset_rms_norm_fp8_linear`, `silu_and_mul_quant_fp8` ->
`kiln::silu_and_mul_fp8_linear` (Gemma's `gelu_tanh_and_mul_quant_fp8` ->
`kiln::gelu_tanh_and_mul_fp8_linear`), `quantize_fp8_per_token` (the attention output before
o_proj) -> `kiln::quantize_fp8_linear` (kiln.kernels.fp8_fused_linear). Each fused op is its
chain except at decode sizes on CUDA, where one GEMV computes the projection's input itself
and multiplies it unquantized with the e4m3 weight: one launch instead of two, ~0.3 ms of a
2.9 ms Llama-3-8B FP8 step at batch 1 in kernels of a few microseconds each (the module doc
of kiln.kernels.fp8_fused_linear; bench/fp8_fused_gemv.py times the pair against the chain).

Only where the quantized input feeds that one projection: an input several projections
share (a QKV or gate/up the merges left unmerged) keeps its quantizing op, which then runs
once for all of them instead of once in each GEMV.

Phase `logits`, after `quantize_fp8` (which makes the pairs; without it there are none and
this pass changes nothing). Device policy as for the fusions (kiln.passes.fuse_common): on
CPU the fused op would only run its chain.
"""

from __future__ import annotations

import operator

import torch

from kiln.kernels import fp8 as fp8_ops
from kiln.kernels import fp8_fused_linear as fused_ops
from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.fuse_common import CudaByDefault, move_output

# The op making a projection's quantized input -> the fused op taking that op's arguments
# followed by fp8_linear's weight, weight scale, bias and output dtype.
FUSED_OP = {
    fp8_ops.rms_norm_quant_fp8.default: fused_ops.rms_norm_fp8_linear,
    fp8_ops.add_rms_norm_quant_fp8.default: fused_ops.add_rms_norm_fp8_linear,
    fp8_ops.offset_rms_norm_quant_fp8.default: fused_ops.offset_rms_norm_fp8_linear,
    fp8_ops.add_offset_rms_norm_quant_fp8.default: fused_ops.add_offset_rms_norm_fp8_linear,
    fp8_ops.silu_and_mul_quant_fp8.default: fused_ops.silu_and_mul_fp8_linear,
    fp8_ops.gelu_tanh_and_mul_quant_fp8.default: fused_ops.gelu_tanh_and_mul_fp8_linear,
    fp8_ops.quantize_fp8_per_token.default: fused_ops.quantize_fp8_linear,
}
# The fused ops that also return the residual sum.
SUMMING = (fused_ops.add_rms_norm_fp8_linear, fused_ops.add_offset_rms_norm_fp8_linear)


def _output(node: object, index: int) -> torch.fx.Node | None:
    """The quantizing op whose output `index` node is (getitem(producer, index)), or None."""
    if (isinstance(node, torch.fx.Node) and node.target is operator.getitem and node.args[1] == index
            and isinstance(node.args[0], torch.fx.Node) and node.args[0].target in FUSED_OP):
        return node.args[0]
    return None


def _is_graph_input_or_none(arg: object) -> bool:
    return arg is None or (isinstance(arg, torch.fx.Node) and arg.op == "placeholder")


class FuseFP8LinearInputsPass(CudaByDefault, KilnPass):
    name = "fuse_fp8_linear_inputs"
    phase = "logits"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        if not self.applies_to(gm):
            return {"skipped_on_cpu": 1}
        graph = gm.graph
        stats = {op.name: 0 for op in FUSED_OP.values()}
        for linear in graph.find_nodes(op="call_function", target=fp8_ops.fp8_linear.default):
            xq, xs, weight, weight_scale, bias, out_dtype = linear.args
            producer = _output(xq, 0)
            if producer is None or _output(xs, 1) is not producer or producer.kwargs:
                continue
            if set(xq.users) != {linear} or set(xs.users) != {linear}:
                continue  # the quantized input serves other projections too
            if not all(_is_graph_input_or_none(a) for a in (weight, weight_scale, bias)):
                continue
            summed_out = [u for u in producer.users if u not in (xq, xs)]  # add_rms_norm's residual sum
            fused = FUSED_OP[producer.target]
            pair = fused in SUMMING  # (y, summed)
            # At the producer's place: its inputs come before it, the weights are graph inputs,
            # and every user of its residual sum comes after it.
            with graph.inserting_before(producer):
                new = graph.call_function(fused.default, (*producer.args, weight, weight_scale, bias, out_dtype))
                y = graph.call_function(operator.getitem, (new, 0)) if pair else new
            new.meta.update({k: v for k, v in linear.meta.items() if k != "val"})
            if "val" in linear.meta:
                new.meta["val"] = ((linear.meta["val"], producer.meta["val"][2]) if pair and "val" in producer.meta
                                   else linear.meta["val"])
            if y is not new:
                y.meta.update(linear.meta)
            linear.replace_all_uses_with(y)
            graph.erase_node(linear)
            graph.erase_node(xq)
            graph.erase_node(xs)
            for getitem in summed_out:  # getitem(producer, 2) -> getitem(new, 1)
                move_output(graph, getitem, new, 1, after=y)
            graph.erase_node(producer)
            stats[fused.name] += 1
        return stats
