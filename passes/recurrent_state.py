"""`recurrent_state`: replace each `kiln::gated_delta_net` marker with `kiln::paged_gated_delta_net`
(and each `kiln::mamba2_scan` with `kiln::paged_mamba2_scan`, each `kiln::short_conv` with
`kiln::paged_short_conv`, each `kiln::selective_scan` with `kiln::paged_selective_scan`, alike:
their states in the slots; a short conv (LFM2's, or a Mamba mixer's convolution) has a conv
state only, a Mamba mixer's selective scan the recurrent state only).

Before: gated_delta_net(mixed_qkv, a, b, conv_weight, A_log, dt_bias, layer_idx, num_k_heads,
        head_k_dim, head_v_dim) over the T tokens of one sequence from zero states.
After:  paged_gated_delta_net(mixed_qkv, a, b, conv_weight, A_log, dt_bias, state_<layer>_conv,
        state_<layer>_recurrent, state_slots, seq_lens, query_start_loc, num_k_heads, head_k_dim,
        head_v_dim), which continues each sequence from the states in its slot and writes them
        back, for any mix of prefills, chunks and decodes.

Graph inputs added (roles in brackets): two state caches per gated DeltaNet layer
[state:<layer>.conv], [state:<layer>.recurrent], and the batch inputs [batch:state_slots],
[batch:seq_lens], [batch:query_start_loc]. Shapes: `kiln.runtime.recurrent_state`. The marker
comes from capture (kiln.compiler.recurrent_layers); a model without one is left as it is.
"""

from __future__ import annotations

import torch

from kiln.compiler.graph_inputs import add_graph_input, batch_role, state_role
from kiln.passes.base import KilnPass, PassContext, PassStats

METADATA_INPUTS = ("state_slots", "seq_lens", "query_start_loc")
# Each marker -> its paged op and the states it keeps. A marker's arguments are the paged op's,
# with `layer_idx` in the place where the paged op takes the layer's state caches and then the
# step's METADATA_INPUTS.
PAGED_OPS = {
    torch.ops.kiln.gated_delta_net.default: (torch.ops.kiln.paged_gated_delta_net.default, ("conv", "recurrent")),
    torch.ops.kiln.mamba2_scan.default: (torch.ops.kiln.paged_mamba2_scan.default, ("conv", "recurrent")),
    torch.ops.kiln.short_conv.default: (torch.ops.kiln.paged_short_conv.default, ("conv",)),  # LFM2, Mamba
    torch.ops.kiln.selective_scan.default: (torch.ops.kiln.paged_selective_scan.default, ("recurrent",)),  # Mamba
}
LAYER_ARG = {torch.ops.kiln.gated_delta_net.default: 6, torch.ops.kiln.mamba2_scan.default: 7,
             torch.ops.kiln.short_conv.default: 3, torch.ops.kiln.selective_scan.default: 8}


class RecurrentStatePass(KilnPass):
    name = "recurrent_state"
    phase = "attention"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        graph = gm.graph
        markers = [node for target in PAGED_OPS for node in graph.find_nodes(op="call_function", target=target)]
        if not markers:
            return {"recurrent_replaced": 0}
        metadata = [add_graph_input(gm, name, batch_role(name)) for name in METADATA_INPUTS]
        added = len(METADATA_INPUTS)
        for node in markers:
            paged_op, parts = PAGED_OPS[node.target]
            at = LAYER_ARG[node.target]
            layer_idx = node.args[at]
            states = [add_graph_input(gm, f"state_{layer_idx}_{part}", state_role(layer_idx, part)) for part in parts]
            added += len(parts)
            with graph.inserting_before(node):
                paged = graph.call_function(paged_op, (*node.args[:at], *states, *metadata, *node.args[at + 1:]))
            paged.meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
            node.replace_all_uses_with(paged)
            graph.erase_node(node)
        return {"recurrent_replaced": len(markers), "inputs_added": added}
