"""Merging sibling projections: the graph rewrite and weight transform behind `merge_qkv`
and `merge_gate_up`.

Projections that read the same input (q/k/v of one attention, gate/up of one MLP) become
one `aten.linear` over the concatenated weight, followed by one slice of its last dimension
per original projection (views: nothing is copied). The merged weight (and bias, when the
projections have biases, as Qwen2's q/k/v do) is a new graph input with role
`param:<prefix><merged>.weight`; the originals' inputs are removed, and a `ConcatWeights`
per merged tensor goes into `ctx.weight_transforms` for the loader
(`kiln.passes.weight_transforms`). A group is merged only when every member is present
with its own parameter that nothing else reads, so a partial or shared layout is left as
it was.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from kiln.compiler.graph_inputs import add_graph_input, param_name, param_role
from kiln.passes.base import PassContext, PassStats
from kiln.passes.weight_transforms import ConcatWeights

aten = torch.ops.aten



def _fake_val(target: object, *args: object) -> torch.Tensor | None:
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in args]
    if any(v is None for v in vals):
        return None
    try:
        return target(*vals)
    except Exception:  # a value we cannot compute is left absent, never wrong
        return None


def _split_name(name: str, members: tuple[str, ...], leaf: str) -> tuple[str, str] | None:
    """'model.layers.0.self_attn.q_proj.weight' -> ('model.layers.0.self_attn.', 'q_proj')."""
    for member in members:
        tail = f"{member}.{leaf}"
        if name.endswith(tail) and (len(name) == len(tail) or name[-len(tail) - 1] == "."):
            return name[: -len(tail)], member
    return None


def merge_sibling_linears(gm: torch.fx.GraphModule, ctx: PassContext, members: tuple[str, ...], merged: str
                          ) -> PassStats:
    """Merge each group of linears named `<prefix><member>` (all of `members`) reading one input."""
    graph = gm.graph
    groups: dict[tuple[torch.fx.Node, str], dict[str, torch.fx.Node]] = defaultdict(dict)
    for node in graph.find_nodes(op="call_function", target=aten.linear.default):
        weight_name = param_name(node.args[1])
        split = _split_name(weight_name, members, "weight") if weight_name else None
        if split is None:
            continue
        prefix, member = split
        groups[(node.args[0], prefix)].setdefault(member, node)
    merged_groups = inputs_added = 0
    for (x, prefix), linears in groups.items():
        if set(linears) != set(members) or not _mergeable([linears[m] for m in members]):
            continue
        inputs_added += _merge_group(gm, ctx, x, prefix, [linears[m] for m in members], merged)
        merged_groups += 1
    return {f"{merged}_merged": merged_groups, "inputs_added": inputs_added}


def _mergeable(linears: list[torch.fx.Node]) -> bool:
    has_bias = {len(n.args) > 2 and n.args[2] is not None for n in linears}
    if len(has_bias) != 1:
        return False
    for n in linears:
        params = [n.args[1]] + ([n.args[2]] if len(n.args) > 2 and n.args[2] is not None else [])
        if any(param_name(p) is None or len(p.users) != 1 for p in params):
            return False  # a weight someone else reads (tied, shared) keeps its own input
        if n.kwargs:
            return False
    return True


def _merge_group(gm: torch.fx.GraphModule, ctx: PassContext, x: torch.fx.Node, prefix: str,
                 linears: list[torch.fx.Node], merged: str) -> int:
    graph = gm.graph
    weights = [n.args[1] for n in linears]
    biases = [n.args[2] for n in linears] if len(linears[0].args) > 2 and linears[0].args[2] is not None else []
    new_inputs = []
    for leaf, params in (("weight", weights), ("bias", biases)):
        if not params:
            continue
        name = f"{prefix}{merged}.{leaf}"
        placeholder = add_graph_input(gm, name.replace(".", "_"), param_role(name),
                                      _fake_val(lambda *ts: torch.cat(ts, 0), *params))
        ctx.weight_transforms.append(ConcatWeights(output=name, inputs=tuple(param_name(p) for p in params), dim=0))
        new_inputs.append(placeholder)
    first = min(linears, key=lambda n: list(graph.nodes).index(n))
    with graph.inserting_before(first):
        fused = graph.call_function(aten.linear.default, (x, *new_inputs))
        fused.meta["val"] = _fake_val(aten.linear.default, x, *new_inputs)
    start = 0
    for node in linears:
        width = node.args[1].meta["val"].shape[0] if "val" in node.args[1].meta else None
        if width is None:
            raise ValueError(f"merge {merged}: weight input {node.args[1].name} has no shape to slice by")
        with graph.inserting_before(node):
            part = graph.call_function(aten.slice.Tensor, (fused, -1, start, start + width))
            part.meta["val"] = _fake_val(aten.slice.Tensor, fused, -1, start, start + width)
        node.replace_all_uses_with(part)
        graph.erase_node(node)
        start += width
    for param in weights + biases:
        graph.erase_node(param)
    return len(new_inputs)


def merge_pass_uuid(pass_uuid: str) -> str:
    """A merge pass's uuid must also change when the shared mechanics here change."""
    import hashlib
    import inspect
    import sys

    from kiln.passes import weight_transforms

    h = hashlib.sha256(pass_uuid.encode())
    for module in (sys.modules[__name__], weight_transforms):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()[:16]
