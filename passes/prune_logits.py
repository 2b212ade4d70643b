"""`prune_logits`: compute the LM head only for the rows that are sampled.

A prefill of T tokens samples one token (its last), so projecting all T hidden states onto
a vocabulary of 50-150k is wasted work. This pass finds the final projection (the last
linear feeding the graph output) and selects the rows named by a new graph input
[batch:logits_indices] (int64 [S]) before it: logits become [1, S, V].
"""

from __future__ import annotations

import torch

import kiln.kernels.collectives  # noqa: F401  (kiln::all_gather, which the LM head may feed)
from kiln.compiler.graph_inputs import add_graph_input, batch_role
from kiln.passes.base import KilnPass, PassContext, PassStats

aten = torch.ops.aten
# Ops between the LM head and the output that keep rows aligned (HF's logits_to_keep slice).
# kiln::all_gather joins vocabulary shards along the last dimension (tensor parallelism).
_ROW_PRESERVING = {torch.ops.kiln.all_gather.default, aten.slice.Tensor, aten.view.default, aten.reshape.default, aten.alias.default,
                   aten.to.dtype, aten._to_copy.default, aten.clone.default}
# Elementwise ops on the logits with scalar operands (Gemma 2's final soft-cap, Cohere's
# logit_scale, Granite's logits_scaling): they act on each row alone, so rows can be selected
# before them as well.
_ELEMENTWISE = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.tanh.default,
                aten.add.Tensor, aten.sub.Tensor}
_PROJECTIONS = {aten.linear.default, aten.mm.default, aten.matmul.default}


def _row_wise(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _ROW_PRESERVING:
        return True
    return node.target in _ELEMENTWISE and not any(isinstance(a, torch.fx.Node) for a in node.args[1:])


def find_lm_head(gm: torch.fx.GraphModule) -> torch.fx.Node:
    out = next(iter(gm.graph.find_nodes(op="output")))
    node = out.args[0]
    while isinstance(node, torch.fx.Node) and _row_wise(node):
        node = node.args[0]
    if not (isinstance(node, torch.fx.Node) and node.target in _PROJECTIONS):
        raise ValueError(f"prune_logits: the graph output is not produced by a projection (found {node})")
    return node


class PruneLogitsPass(KilnPass):
    name = "prune_logits"
    phase = "logits"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        head = find_lm_head(gm)
        hidden = head.args[0]
        if isinstance(hidden, torch.fx.Node) and hidden.target == aten.index_select.default:
            return {"lm_head_pruned": 0}  # already pruned
        indices = add_graph_input(gm, "logits_indices", batch_role("logits_indices"))
        with gm.graph.inserting_before(head):
            selected = gm.graph.call_function(aten.index_select.default, (hidden, 1, indices))
        head.replace_input_with(hidden, selected)
        return {"lm_head_pruned": 1}
