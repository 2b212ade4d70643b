"""`recurrent_state`: replace each `kiln::gated_delta_net` marker with `kiln::paged_gated_delta_net`
(and each `kiln::mamba2_scan` with `kiln::paged_mamba2_scan`, each `kiln::short_conv` with
`kiln::paged_short_conv`, alike: their states in the slots; LFM2's short conv has a conv state only).

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


class RecurrentStatePass(KilnPass):
    name = "recurrent_state"
    phase = "attention"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        graph = gm.graph
        markers = list(graph.find_nodes(op="call_function", target=torch.ops.kiln.gated_delta_net.default))
        mamba = list(graph.find_nodes(op="call_function", target=torch.ops.kiln.mamba2_scan.default))
        convs = list(graph.find_nodes(op="call_function", target=torch.ops.kiln.short_conv.default))
        if not markers and not mamba and not convs:
            return {"recurrent_replaced": 0}
        metadata = [add_graph_input(gm, name, batch_role(name)) for name in METADATA_INPUTS]
        for node in convs:  # LFM2: a conv state alone
            bx, weight, bias, layer_idx = node.args
            state = add_graph_input(gm, f"state_{layer_idx}_conv", state_role(layer_idx, "conv"))
            with graph.inserting_before(node):
                paged = graph.call_function(torch.ops.kiln.paged_short_conv.default, (bx, weight, bias, state, *metadata))
            paged.meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
            node.replace_all_uses_with(paged)
            graph.erase_node(node)
        for node in mamba:
            x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, layer_idx, *sizes = node.args
            states = [add_graph_input(gm, f"state_{layer_idx}_{part}", state_role(layer_idx, part))
                      for part in ("conv", "recurrent")]
            with graph.inserting_before(node):
                paged = graph.call_function(
                    torch.ops.kiln.paged_mamba2_scan.default,
                    (x_bc, dt, conv_weight, conv_bias, A_log, D, dt_bias, *states, *metadata, *sizes),
                )
            paged.meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
            node.replace_all_uses_with(paged)
            graph.erase_node(node)
        for node in markers:
            mixed, a, b, conv_weight, A_log, dt_bias, layer_idx, num_k_heads, head_k_dim, head_v_dim = node.args
            states = [add_graph_input(gm, f"state_{layer_idx}_{part}", state_role(layer_idx, part))
                      for part in ("conv", "recurrent")]
            with graph.inserting_before(node):
                paged = graph.call_function(
                    torch.ops.kiln.paged_gated_delta_net.default,
                    (mixed, a, b, conv_weight, A_log, dt_bias, *states, *metadata, num_k_heads, head_k_dim, head_v_dim),
                )
            paged.meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
            node.replace_all_uses_with(paged)
            graph.erase_node(node)
        replaced = len(markers) + len(mamba) + len(convs)
        return {"recurrent_replaced": replaced,
                "inputs_added": 2 * (len(markers) + len(mamba)) + len(convs) + len(METADATA_INPUTS)}
