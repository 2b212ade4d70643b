"""`quantize_fp8`: every projection over a model weight as an FP8 GEMM (`quantization="fp8"`).

Before: y = aten.linear(x, W[, b])          W a graph input `param:NAME`, [N, K] in the compute dtype
After:  xq, x_scale = kiln.quantize_fp8_per_token(x)          (once per x)
        y = kiln.fp8_linear(xq, x_scale, W, W_scale, b, out_dtype)
        W is now float8_e4m3fn [N, K]; W_scale a new input `param:NAME_scale`, float32 [N]

The loader gets a `QuantizeFP8Weight` transform per weight (kiln.passes.weight_transforms):
bf16/fp16/fp32 checkpoints are quantized per output channel at load; FP8 checkpoints keep
their values and scales. Left in the compute dtype, as vLLM leaves them: the LM head (the
logits decide every token; prune_logits already cut it to the sampled rows) and a weight tied
to the embedding, and MoE routers (`...gate.weight`, and every projection that
`kiln.passes.fuse_moe.router_projections` finds deciding a block's routing: a few columns
whose ranking picks the experts). MoE experts (inside `kiln::fused_moe` / `kiln::moe_experts`, not
projections of this form) are quantized too, as vLLM's `quantization="fp8"` quantizes them: each
such op becomes its `_fp8` op over e4m3 experts with one scale per expert and output channel
(kernels/moe.py; on sm_90 the grouped steps run W8A8, the rows quantized in the kernels, and
per-pair decode steps weight-only). Not where `experts=False` (`KILN_FP8_EXPERTS=0`) says so, or
where a pre-quantized checkpoint left its experts unquantized (`fp8_experts_by_default`). A
pre-quantized checkpoint's FP8 experts are dequantized as the loader stacks them, then quantized
again per channel.

The first and last decoder layers: in a small model (fewer than `EDGE_LAYERS_MAX_PARAMS`
parameters, counted over the graph's parameter inputs) their projections stay in the compute dtype too, as
in Meta's FP8 recipe for Llama 3.1 405B (first and last layers in bf16): they are the most
sensitive, and a small model feels it (SmolLM2-135M: every layer in FP8 costs +3.9% perplexity,
FP8 in layer 0 alone as much as in ten middle layers; with the edge layers kept, +1.5%; README
"FP8"). A larger model quantizes every decoder layer, as vLLM's `quantization="fp8"` and
llm-compressor's FP8_DYNAMIC recipe for Llama-3-8B do: there the kept layers cost 5-9% of an
FP8 step (their bf16 GEMMs, bench/RESULTS.md N3, P3) for a loss those recipes find negligible.
`keep_edge_layers=True / False` decides it for every model. Models of fewer than
`EDGE_LAYERS_MIN_LAYERS` layers (test models) quantize every layer, or little would be left.
A pre-quantized checkpoint's FP8 tensors in kept layers are dequantized at load.

A pre-quantized checkpoint's own list of modules it left unquantized is honoured, as vLLM
honours it: compressed-tensors' `ignore` (module names, or `re:` regexes) and transformers'
FP8 `modules_to_not_convert` (names matched as substrings, as transformers matches them).
Those projections stay in the compute dtype whatever the size rule says; a merged projection
(QKV, gate/up) stays if any of its parts is listed.

Phase `logits`, after `prune_logits` (which finds the LM head as an `aten.linear`) and before
`use_triton_linear` (which would otherwise take the projections into `kiln::linear`). Off
unless asked for: `quantization="fp8"` enables it (and a pre-quantized checkpoint implies it).
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any, Callable

import torch

from kiln.compiler.graph_inputs import add_graph_input, param_name, param_role
from kiln.kernels import rms_norm as norm_ops
from kiln.kernels.activation import gelu_tanh_and_mul as gelu_tanh_and_mul_op
from kiln.kernels.activation import silu_and_mul as silu_and_mul_op
from kiln.kernels.fp8 import (FP8_DTYPE, add_offset_rms_norm_quant_fp8, add_rms_norm_quant_fp8,
                              gelu_tanh_and_mul_quant_fp8, offset_rms_norm_quant_fp8, rms_norm_quant_fp8,
                              silu_and_mul_quant_fp8)
from kiln.kernels.fp8 import fp8_linear as fp8_linear_op
from kiln.kernels.fp8 import quantize_fp8_per_token as quantize_op
from kiln.kernels.moe import fused_moe as fused_moe_op
from kiln.kernels.moe import fused_moe_fp8 as fused_moe_fp8_op
from kiln.kernels.moe import moe_experts as moe_experts_op
from kiln.kernels.moe import moe_experts_fp8 as moe_experts_fp8_op
from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.fuse_common import move_output
from kiln.passes.fuse_moe import router_projections
from kiln.passes.prune_logits import find_lm_head
from kiln.passes.weight_transforms import ConcatWeights, QuantizeFP8Weight, fp8_scale_name

aten = torch.ops.aten



EDGE_LAYERS_MIN_LAYERS = 4
# keep_edge_layers=None (the default) keeps them in models of fewer parameters than this.
EDGE_LAYERS_MAX_PARAMS = 1_000_000_000
# The decoder layer a parameter belongs to, by its Hugging Face name (model.layers.N.…,
# transformer.h.N.…, …).
_LAYER_INDEX = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")


def _is_router(name: str) -> bool:
    return name.endswith(".gate.weight")


def in_edge_layer(name: str, num_layers: int | None) -> bool:
    """Whether parameter `name` belongs to the first or last of `num_layers` decoder layers
    (False for models of fewer than EDGE_LAYERS_MIN_LAYERS layers, or an unknown count)."""
    if num_layers is None or num_layers < EDGE_LAYERS_MIN_LAYERS:
        return False
    match = _LAYER_INDEX.search(name)
    return match is not None and int(match.group(1)) in (0, num_layers - 1)


def quantization_config(config: Any) -> dict[str, Any] | None:
    """The config's `quantization_config` as a dict (transformers keeps a dict or a config
    object), None without one."""
    qc = getattr(config, "quantization_config", None)
    if qc is None or isinstance(qc, dict):
        return qc
    return qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))


def checkpoint_unquantized(config: Any) -> Callable[[str], bool]:
    """Whether a module (its name, e.g. `model.layers.0.mlp.down_proj`) is one the config's
    pre-quantized checkpoint left unquantized (module doc); always False without such a list."""
    qc = quantization_config(config)
    if qc is None:
        return lambda module: False
    if qc.get("quant_method") == "compressed-tensors":
        entries = list(qc.get("ignore") or [])
        names = {e for e in entries if not e.startswith("re:")}
        patterns = [re.compile(e[3:]) for e in entries if e.startswith("re:")]
        return lambda module: module in names or any(p.match(module) for p in patterns)
    listed = list(qc.get("modules_to_not_convert") or [])
    return lambda module: any(entry in module for entry in listed)


def _checkpoint_parts(name: str, transforms: list[Any]) -> list[str]:
    """The checkpoint tensors a graph parameter is made of (a merged QKV or gate/up: its parts)."""
    for transform in transforms:
        if isinstance(transform, ConcatWeights) and transform.output == name:
            return [part for inp in transform.inputs for part in _checkpoint_parts(inp, transforms)]
    return [name]


def model_parameters(gm: torch.fx.GraphModule) -> int:
    """The parameters the graph takes as inputs (their example values' sizes; 0 where absent)."""
    return sum(node.meta["val"].numel() for node in gm.graph.find_nodes(op="placeholder")
               if param_name(node) is not None and isinstance(node.meta.get("val"), torch.Tensor))


class QuantizeFP8Pass(KilnPass):
    name = "quantize_fp8"
    phase = "logits"

    def __init__(self, keep_edge_layers: bool | None = None, experts: bool | None = None):
        """`keep_edge_layers`: None keeps the first and last layers in the compute dtype in
        models of fewer than EDGE_LAYERS_MAX_PARAMS parameters (module doc). `experts`: MoE
        experts in FP8 too; None: KILN_FP8_EXPERTS (1 on, 0 off), and unset, on unless a
        pre-quantized checkpoint left its experts unquantized (`fp8_experts_by_default`)."""
        self.keep_edge_layers = keep_edge_layers
        env = os.environ.get("KILN_FP8_EXPERTS")
        self.experts = bool(experts) if experts is not None else (None if env is None else env == "1")

    def options(self) -> dict[str, Any]:
        return {"keep_edge_layers": self.keep_edge_layers, "edge_layers_max_params": EDGE_LAYERS_MAX_PARAMS,
                "experts": self.experts}

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        graph = gm.graph
        try:
            head = find_lm_head(gm)
        except ValueError:
            head = None
        embedded = {n.args[0] for n in graph.find_nodes(op="call_function", target=aten.embedding.default)}
        routers = router_projections(gm)
        unquantized_in_checkpoint = checkpoint_unquantized(ctx.config)
        projections = []  # (node, weight, checkpoint name) of each projection to quantize
        kept = 0
        for node in graph.find_nodes(op="call_function", target=aten.linear.default):
            weight = node.args[1] if len(node.args) > 1 else None
            name = param_name(weight)
            if name is None:
                continue  # a product of activations, not a projection of a weight
            if (node is head or weight in embedded or node in routers or _is_router(name)
                    or any(unquantized_in_checkpoint(part.removesuffix(".weight"))
                           for part in _checkpoint_parts(name, ctx.weight_transforms))):
                kept += 1
                continue
            projections.append((node, weight, name))
        keep_edges = self.keep_edge_layers
        if keep_edges is None:
            # A tensor-parallel rank's graph holds its 1/tp_size of the sharded parameters.
            keep_edges = model_parameters(gm) * ctx.tp_size < EDGE_LAYERS_MAX_PARAMS
        num_layers = getattr(ctx.config, "num_hidden_layers", None) if keep_edges else None
        quantized_inputs: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]] = {}
        scales: dict[torch.fx.Node, torch.fx.Node] = {}
        replaced = 0
        for node, weight, name in projections:
            if in_edge_layer(name, num_layers):
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
        fused = fuse_quantization_into_producers(graph, [xq.args[0] for xq, _ in quantized_inputs.values()])
        stats = {"fp8_linear": replaced, "kept_high_precision": kept, **fused}
        experts = self.experts if self.experts is not None else fp8_experts_by_default(gm, ctx.config)
        if experts:
            stats.update(quantize_experts(gm, ctx, scales, num_layers))
        return stats


def fp8_experts_by_default(gm: torch.fx.GraphModule, config: Any) -> bool:
    """Whether experts run in FP8 without KILN_FP8_EXPERTS: yes, as vLLM's FP8 runs them (half
    the bytes a decode step streams; on sm_90 the grouped steps' e4m3 MMAs at twice bf16's rate:
    the Mixtral-8x7B shape's offline run 5,769 output tokens/s against 4,448 with 16-bit experts,
    bench/RESULTS.md AF4-AF6), unless a pre-quantized FP8 checkpoint left its experts unquantized
    (its `ignore` / `modules_to_not_convert`): then they stay as the checkpoint has them."""
    qc = quantization_config(config)
    # (The engine has refused any other quantization by now: compiler/fp8_checkpoint.py.)
    if qc is None or qc.get("quant_method") not in ("fp8", "compressed-tensors"):
        return True  # a 16-bit checkpoint quantized at load
    unquantized = checkpoint_unquantized(config)
    for node in gm.graph.find_nodes(op="placeholder"):
        name = param_name(node)
        if name is None or not name.endswith(".experts.gate_up_proj"):
            continue
        # The first expert's Hub names (Qwen/DeepSeek's gate_proj, Mixtral's w1) or the stacked one.
        prefix = name.removesuffix(".experts.gate_up_proj")
        hub = prefix.replace(".mlp", ".block_sparse_moe")
        names = [f"{prefix}.experts.0.gate_proj", f"{hub}.experts.0.w1", f"{prefix}.experts.gate_up_proj"]
        return not any(unquantized(n) for n in names)
    return True


def quantize_experts(gm: torch.fx.GraphModule, ctx: PassContext, scales: dict[torch.fx.Node, torch.fx.Node],
                     num_layers: int | None) -> PassStats:
    """Each `kiln::fused_moe` (`kiln::moe_experts`) over parameter experts (outside kept edge
    layers) as `kiln::fused_moe_fp8` (`kiln::moe_experts_fp8`): e4m3 experts, one float32 scale
    per expert and output channel."""
    graph = gm.graph
    replaced = kept = 0
    nodes = [*graph.find_nodes(op="call_function", target=fused_moe_op.default),
             *graph.find_nodes(op="call_function", target=moe_experts_op.default)]
    if not nodes:
        return {}  # no MoE block (or its experts unfused: batched matmuls on CPU)
    for node in nodes:
        fused = node.target is fused_moe_op.default
        # fused_moe(x, logits, w_gate_up, w_down, ...); moe_experts(x, weights, ids, w_gate_up, w_down)
        w_gate_up, w_down = node.args[2:4] if fused else node.args[3:5]
        names = [param_name(w_gate_up), param_name(w_down)]
        if None in names or any(in_edge_layer(name, num_layers) for name in names):
            kept += 1
            continue
        for weight, name in zip((w_gate_up, w_down), names):
            if weight in scales:
                continue
            val = weight.meta.get("val")
            scale_example = None
            if isinstance(val, torch.Tensor):
                weight.meta["val"] = val.to(FP8_DTYPE)
                scale_example = val.new_empty(tuple(val.shape[:2]), dtype=torch.float32)
            scales[weight] = add_graph_input(gm, f"{weight.name}_scale", param_role(fp8_scale_name(name)),
                                             scale_example)
            ctx.weight_transforms.append(QuantizeFP8Weight(name))
        with graph.inserting_before(node):
            if fused:
                x, logits, _, _, *rest = node.args
                new = graph.call_function(fused_moe_fp8_op.default,
                                          (x, logits, w_gate_up, scales[w_gate_up], w_down, scales[w_down], *rest))
            else:
                x, weights, ids = node.args[:3]
                new = graph.call_function(moe_experts_fp8_op.default,
                                          (x, weights, ids, w_gate_up, scales[w_gate_up], w_down, scales[w_down]),
                                          dict(node.kwargs))  # GPT-OSS's biases and activation
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        replaced += 1
    return {"fp8_experts": replaced, "kept_high_precision_experts": kept}


# The op producing a projection's input -> its form with the quantization fused in (same
# arguments; the summing norms' residual sum becomes the fused op's third output).
QUANTIZING_FORM = {
    norm_ops.rms_norm.default: rms_norm_quant_fp8,
    norm_ops.offset_rms_norm.default: offset_rms_norm_quant_fp8,
    silu_and_mul_op.default: silu_and_mul_quant_fp8,
    gelu_tanh_and_mul_op.default: gelu_tanh_and_mul_quant_fp8,
}
SUMMING_QUANTIZING_FORM = {
    norm_ops.add_rms_norm.default: add_rms_norm_quant_fp8,
    norm_ops.add_offset_rms_norm.default: add_offset_rms_norm_quant_fp8,
}


def fuse_quantization_into_producers(graph: torch.fx.Graph, quantizations: list[torch.fx.Node]) -> dict[str, int]:
    """Each `quantize_fp8_per_token(x)` whose x comes from an RMSNorm (`kiln::rms_norm`,
    `kiln::offset_rms_norm`, or the normed output of `kiln::add_rms_norm` /
    `kiln::add_offset_rms_norm`) or `kiln::silu_and_mul` / `kiln::gelu_tanh_and_mul` and is used
    by nothing else becomes
    the fused op (`kiln::*_quant_fp8`), which returns the same (xq, scale) first: the normed or
    activated tensor is never written out in full precision. The fused op takes the producer's
    place in the graph (the residual sum of the summing norms is used later, by the next layer).
    `rms_norm_quant_fused` counts both norm forms, `silu_and_mul_quant_fused` both activations. (Qwen3-Next's gated norm normalises each
    head, its out_proj's input quantizes whole tokens: not fused.)"""
    stats = {"rms_norm_quant_fused": 0, "silu_and_mul_quant_fused": 0}
    for q in quantizations:
        x = q.args[0]
        if not isinstance(x, torch.fx.Node) or len(x.users) != 1:
            continue
        if x.target in QUANTIZING_FORM:
            producer, fused_op = x, QUANTIZING_FORM[x.target]
            residual_out = None
        elif (x.target is operator.getitem and x.args[1] == 0 and isinstance(x.args[0], torch.fx.Node)
              and x.args[0].target in SUMMING_QUANTIZING_FORM):
            producer, fused_op = x.args[0], SUMMING_QUANTIZING_FORM[x.args[0].target]
            residual_out = next((u for u in producer.users if u.target is operator.getitem and u.args[1] == 1), None)
        else:
            continue
        with graph.inserting_before(producer):
            fused = graph.call_function(fused_op.default, tuple(producer.args), dict(producer.kwargs))
        fused.meta.update({k: v for k, v in producer.meta.items() if k != "val"})
        if "val" in q.meta:
            fused.meta["val"] = tuple(q.meta["val"]) + ((producer.meta["val"][1],) if residual_out is not None
                                                         and "val" in producer.meta else ())
        q.replace_all_uses_with(fused)  # getitem(q, 0 / 1) -> getitem(fused, 0 / 1)
        graph.erase_node(q)
        if residual_out is not None:
            move_output(graph, residual_out, fused, 2, after=fused)
        graph.erase_node(x)
        if producer is not x:
            graph.erase_node(producer)
        activation = fused_op in (silu_and_mul_quant_fp8, gelu_tanh_and_mul_quant_fp8)
        stats["silu_and_mul_quant_fused" if activation else "rms_norm_quant_fused"] += 1
    return stats
