"""`normalize`: strip what export leaves behind that no pattern should have to match around.

- `aten._assert_tensor_metadata` checks (export's record of the dtypes it traced with);
- casts and moves to the dtype/device the tensor already has (`aten.to`, `aten._to_copy`);
- full slices (`x[:, 0:]`) and `aten.alias`, which return their input unchanged.
"""

from __future__ import annotations

import torch

from kiln.passes.base import KilnPass, PassContext, PassStats

aten = torch.ops.aten
INT64_MAX = 2**63 - 1


def _val(node: object) -> torch.Tensor | None:
    val = getattr(node, "meta", {}).get("val")
    return val if isinstance(val, torch.Tensor) else None


def _is_noop_cast(node: torch.fx.Node) -> bool:
    if node.target not in (aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten._to_copy.default):
        return False
    src, out = _val(node.args[0]), _val(node)
    if src is None or out is None:
        return False
    if node.kwargs.get("memory_format") not in (None, torch.preserve_format):
        return False
    return src.dtype == out.dtype and src.device == out.device and src.layout == out.layout


def _is_noop_slice(node: torch.fx.Node) -> bool:
    if node.target != aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2], args[3], args[4]
    return start in (None, 0) and end in (None, INT64_MAX) and step in (None, 1)


class NormalizePass(KilnPass):
    name = "normalize"
    phase = "normalize"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        stats = {"asserts_removed": 0, "noop_casts_removed": 0, "noop_views_removed": 0}
        for node in list(gm.graph.nodes):
            if node.op != "call_function":
                continue
            if node.target == aten._assert_tensor_metadata.default:
                gm.graph.erase_node(node)
                stats["asserts_removed"] += 1
            elif _is_noop_cast(node):
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                stats["noop_casts_removed"] += 1
            elif _is_noop_slice(node) or node.target == aten.alias.default:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                stats["noop_views_removed"] += 1
        return stats
