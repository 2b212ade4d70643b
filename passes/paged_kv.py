"""`paged_kv`: replace each `kiln::attention` marker with `kiln::paged_attention`.

Before: attention(q, k, v, layer_idx, scale, window, softcap[, alibi_slopes][, sinks=s]) over the
        T tokens of one sequence.
After:  paged_attention(q, k, v, kv_cache_<layer>, slot_mapping, block_tables, seq_lens,
        query_start_loc, scale, window, softcap[, alibi_slopes][, sinks=s]), which writes K/V into the
        layer's paged cache and attends over each sequence's cached blocks, for any mix of
        prefills and decodes.

Graph inputs added (roles in brackets): one KV cache per layer [kv_cache:<layer>], and the
batch metadata shared by all layers [batch:slot_mapping], [batch:block_tables],
[batch:seq_lens], [batch:query_start_loc]. Layout is documented in
`kiln.kernels.paged_attention`. The per-layer semantics (scale, window, soft-cap, ALiBi slopes) are
copied from the marker as they are (attention sinks too), so layers of one model may differ (Gemma 2's
alternating windowed and global layers).

The cache's shape comes from the config (`kv_heads_and_head_dim`, per layer: Gemma 4's global
layers have their own); each marker's k is checked against it here, so a config whose KV
heads are named unusually (multi-query flags) fails at compile time with the layer named, not
with a wrong cache at run time.

A layer that attends over another layer's K and V (`kv_sharing`: Gemma 4's last layers) is
given that layer's cache: its marker's k and v are the other layer's (capture traces them
through the model's shared-KV dictionary), so it writes the same rows to the same slots, and
attends over them with its own queries.
"""

from __future__ import annotations

import torch

from kiln.compiler.graph_inputs import add_graph_input, batch_role, kv_cache_role
from kiln.kernels.paged_attention import kv_heads_and_head_dim, kv_sharing
from kiln.passes.base import KilnPass, PassContext, PassStats

METADATA_INPUTS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
# Ops that only view their first argument: capture turns each attention call's [1, H, T, D]
# keys into the marker's [T, H, D] with them, so two layers' markers over one K differ by these.
_VIEW_OPS = frozenset({torch.ops.aten.select.int, torch.ops.aten.transpose.int, torch.ops.aten.view.default,
                       torch.ops.aten.reshape.default, torch.ops.aten.unsqueeze.default,
                       torch.ops.aten.squeeze.dim, torch.ops.aten.permute.default})


def _through_views(node: object) -> object:
    """The tensor `node` views (itself when it is not a view)."""
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _VIEW_OPS:
        node = node.args[0]
    return node


class PagedKVPass(KilnPass):
    name = "paged_kv"
    phase = "attention"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        graph = gm.graph
        markers = list(graph.find_nodes(op="call_function", target=torch.ops.kiln.attention.default))
        if not markers:
            return {"attention_replaced": 0}
        metadata = {name: add_graph_input(gm, name, batch_role(name)) for name in METADATA_INPUTS}
        shared = kv_sharing(ctx.config) if ctx.config is not None else {}
        kv_of: dict[int, tuple[object, object]] = {}  # each layer's (k, v) nodes
        for node in markers:
            q, k, v, layer_idx, scale, window, *rest = node.args
            softcap = rest[0] if rest else 0.0
            # ALiBi slopes only where the marker has them, so other graphs keep their form.
            alibi = tuple(rest[1:2]) if len(rest) > 1 and rest[1] is not None else ()
            k_val = k.meta.get("val") if isinstance(k, torch.fx.Node) else None
            expected = kv_heads_and_head_dim(ctx.config, ctx.tp_size, layer_idx) if ctx.config is not None else None
            if expected is not None and isinstance(k_val, torch.Tensor) and tuple(k_val.shape[1:]) != expected:
                raise ValueError(f"paged_kv: layer {layer_idx} has {tuple(k_val.shape[1:])} KV heads x head_dim, "
                                 f"but the KV cache is sized from the config as {expected}")
            cache_layer = shared.get(layer_idx, layer_idx)
            if cache_layer != layer_idx and kv_of.get(cache_layer) != (_through_views(k), _through_views(v)):
                raise ValueError(f"paged_kv: layer {layer_idx} shares layer {cache_layer}'s K/V cache by its config "
                                 "(num_kv_shared_layers), but its attention's keys and values are not that layer's")
            kv_of[layer_idx] = (_through_views(k), _through_views(v))
            kv_cache = add_graph_input(gm, f"kv_cache_{cache_layer}", kv_cache_role(cache_layer))
            with graph.inserting_before(node):
                paged = graph.call_function(
                    torch.ops.kiln.paged_attention.default,
                    (q, k, v, kv_cache, *metadata.values(), scale, window, softcap, *alibi),
                    {"sinks": node.kwargs["sinks"]} if node.kwargs.get("sinks") is not None else {},
                )
            paged.meta.update({k_: v_ for k_, v_ in node.meta.items() if k_ in ("val", "stack_trace", "nn_module_stack")})
            node.replace_all_uses_with(paged)
            graph.erase_node(node)
        return {"attention_replaced": len(markers), "inputs_added": len(markers) + len(METADATA_INPUTS)}
