"""Why a pattern did not match: the closest candidate subgraph and where it diverged.

`explain_pattern(pattern, gm)` (also `Pattern.explain(gm)` and
`kiln passes show MODEL --explain PASS`) returns a `MatchReport`. When the pattern matched,
it lists the matches. When it did not, it walks the pattern against the graph from every
pair (pattern op, graph node with the same op), the way a matcher would: backwards through
each node's arguments, then forwards to the users of matched nodes (so a candidate is found
even when the pattern's last op is the wrong one). Each walk stops at the first
difference; the walk that matched the most pattern nodes is the closest candidate, and its
stopping point is the divergence: the pattern node, the graph node, and what differed:

- `op`: a different op at that place (`aten.mean.dim` expected, `aten.sum.dim_IntList` found);
- `arg`: an argument differs (a literal such as `keepdim` or `eps`, or a node where a literal
  was expected), named by position and schema name;
- `input`: a pattern input is used in two places that the graph feeds from two different
  nodes (a cast the pattern lacks, usually);
- `user`: the graph has no consumer of a matched node that looks like the next pattern op
  (operand order, most often: `w * x` against `x * w`);
- `order`: a commutative op (`mul`, `add`) whose operands line up only in the other order:
  the matcher compares operands in order, so write the pattern as the model computes it;
- `escapes`: the whole pattern matched, but an inner node is also used outside it, so it
  cannot be replaced (return that value from the pattern too);
- `where`: the structure matched but the pattern's `where` filter refused it.

Candidates are ranked by how many pattern ops line up, then by the rarest op they cover
(an op the graph has 30 of, such as `silu`, says more about where the pattern belongs than
one it has 300 of, such as `mul`); the report shows the closest and the next few.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import torch
import torch.fx

if TYPE_CHECKING:
    from kiln.passes.pattern import Pattern, TracedPattern

Node = torch.fx.Node


class _Diverged(Exception):
    def __init__(self, divergence: "Divergence"):
        super().__init__(divergence.detail)
        self.divergence = divergence


@dataclass
class Divergence:
    """The first place where the closest candidate differs from the pattern."""

    kind: str  # op | arg | input | user | escapes | where
    pattern_node: str  # name in the pattern graph (see the report's pattern code)
    pattern_op: str
    graph_node: str | None  # name in the model graph (as in KILN_DUMP_GRAPHS / `kiln passes show`)
    graph_op: str | None
    detail: str


@dataclass
class Candidate:
    """A partial match: pattern node name -> graph node name, in the order the walk reached them.

    A pair means the same op sits at the same place; the divergence may still be in that
    node's arguments.
    """

    pairs: list[tuple[str, str]]
    bound_inputs: dict[str, str]
    divergence: Divergence | None
    graph_nodes: list[Node] = field(default_factory=list, repr=False)

    @property
    def size(self) -> int:
        return len(self.pairs)


@dataclass
class MatchReport:
    pattern_name: str
    dtype: torch.dtype | None
    num_matches: int
    pattern_size: int  # ops in the pattern
    pattern_code: str
    closest: Candidate | None  # None when the pattern matched, or no op of it occurs in the graph
    graph_excerpt: list[str]
    missing_ops: list[str] = field(default_factory=list)  # pattern ops absent from the graph
    matches: list[dict[str, str]] = field(default_factory=list)  # per match: pattern node -> graph node
    others: list[Candidate] = field(default_factory=list)  # the next-closest candidates, best first

    @property
    def matched(self) -> bool:
        return self.num_matches > 0

    @property
    def divergence(self) -> Divergence | None:
        return self.closest.divergence if self.closest else None

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (`kiln passes show --json --explain PASS`)."""
        closest = None
        if self.closest is not None:
            d = self.closest.divergence
            closest = _candidate_dict(self.closest)
        return {"pattern": self.pattern_name, "dtype": str(self.dtype).replace("torch.", "") if self.dtype else None,
                "matched": self.matched, "num_matches": self.num_matches, "pattern_size": self.pattern_size,
                "missing_ops": self.missing_ops, "closest": closest, "graph_excerpt": self.graph_excerpt,
                "others": [_candidate_dict(c) for c in self.others],
                "matches": self.matches, "pattern_code": self.pattern_code}

    def __str__(self) -> str:
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "as given"
        head = f"pattern {self.pattern_name!r} (traced for {dtype}): "
        if self.matched:
            lines = [head + f"{self.num_matches} match(es)"]
            for i, m in enumerate(self.matches[:5]):
                lines.append(f"  match {i}: " + ", ".join(f"{p}->{g}" for p, g in m.items()))
            if self.num_matches > 5:
                lines.append(f"  ... {self.num_matches - 5} more")
            return "\n".join(lines)
        lines = [head + "no match"]
        if self.missing_ops:
            lines.append("  pattern ops absent from the graph: " + ", ".join(self.missing_ops))
        if self.closest is not None:
            c = self.closest
            lines.append(f"  closest candidate: {c.size} of {self.pattern_size} pattern ops line up (same op, same place)")
            if c.bound_inputs:
                lines.append("  inputs bound: " + ", ".join(f"{k}={v}" for k, v in c.bound_inputs.items()))
            d = c.divergence
            if d is not None:
                where = f"graph node {d.graph_node!r} ({d.graph_op})" if d.graph_node else "the graph"
                lines.append(f"  diverged at pattern node {d.pattern_node!r} ({d.pattern_op}) vs {where} [{d.kind}]:")
                lines.append(f"    {d.detail}")
            if self.graph_excerpt:
                lines.append("  candidate in the graph (* = matched, > = where it diverged):")
                lines += [f"    {line}" for line in self.graph_excerpt]
        if self.others:
            lines.append("  next candidates:")
            for c in self.others:
                d = c.divergence
                at = f"diverged at graph node {d.graph_node!r} [{d.kind}]" if d is not None and d.graph_node else "diverged"
                lines.append(f"    {c.size} of {self.pattern_size} ops from graph node {c.pairs[0][1]!r}, {at}")
        lines.append("  pattern:")
        lines += [f"    {line}" for line in self.pattern_code.strip().splitlines()]
        return "\n".join(lines)


def _candidate_dict(c: Candidate) -> dict[str, Any]:
    d = c.divergence
    return {"pairs": [list(p) for p in c.pairs], "bound_inputs": c.bound_inputs,
            "divergence": dict(d.__dict__) if d is not None else None}


# Ops whose two tensor operands may be swapped without changing the value: a pattern written
# with them in the other order than the model's does not match, and the report says so.
COMMUTATIVE = {torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor}


def _fits(p: Any, g: Any) -> bool:
    """Whether graph argument `g` could stand where the pattern has `p` (one level deep)."""
    if isinstance(p, Node):
        if p.op == "placeholder":
            return True
        return isinstance(g, Node) and g.op == "call_function" and g.target == p.target
    return not isinstance(g, Node) and type(p) is type(g) and p == g


def op_name(target: Any) -> str:
    """`aten.mul.Tensor` for `torch.ops.aten.mul.Tensor`; the node op for non-calls."""
    return str(target)


def describe(value: Any) -> str:
    if isinstance(value, Node):
        if value.op == "placeholder":
            return f"{value.name} (graph input)"
        if value.op == "call_function":
            return f"{value.name} (= {op_name(value.target)})"
        return f"{value.name} ({value.op})"
    return repr(value)


def format_node(node: Node) -> str:
    """`mul_4 = aten.mul.Tensor(p_weight, mul_3)`: one line, names as in the dumped code."""
    def fmt(a: Any) -> str:
        if isinstance(a, Node):
            return a.name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(fmt(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        return repr(a)

    if node.op == "placeholder":
        return f"{node.name} = <input>"
    args = [fmt(a) for a in node.args] + [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
    return f"{node.name} = {op_name(node.target)}({', '.join(args)})"


def _arg_names(node: Node) -> list[str]:
    schema = getattr(node.target, "_schema", None)
    return [a.name for a in schema.arguments] if schema is not None else []


def _all_args(node: Node, other: Node) -> tuple[list[Any], list[Any], list[str]]:
    """Both nodes' arguments as parallel lists (by schema, so defaults and kwargs line up)."""
    names = _arg_names(node)
    same_shape = len(node.args) == len(other.args) and list(node.kwargs) == list(other.kwargs)
    if same_shape or not names:
        labels = [names[i] if i < len(names) else str(i) for i in range(len(node.args))] + list(node.kwargs)
        return (list(node.args) + list(node.kwargs.values()), list(other.args) + list(other.kwargs.values()), labels)
    schema_args = node.target._schema.arguments

    def full(n: Node) -> list[Any]:
        out = []
        for i, a in enumerate(schema_args):
            if a.name in n.kwargs:
                out.append(n.kwargs[a.name])
            elif not a.kwarg_only and i < len(n.args):
                out.append(n.args[i])
            else:
                out.append(a.default_value)
        return out

    return full(node), full(other), names


def _short(value: Any) -> str:
    if isinstance(value, Node):
        return f"{value.name!r}" + (f" ({op_name(value.target)})" if value.op == "call_function" else " (input)")
    return repr(value)


class _Walk:
    """One attempt to match the pattern from a (pattern node, graph node) pair."""

    def __init__(self, pattern_graph: torch.fx.Graph, returning: set[Node]):
        self.pattern_graph = pattern_graph
        self.returning = returning
        self.pmap: dict[Node, Node] = {}  # pattern call node -> graph node
        self.gmapped: dict[Node, Node] = {}  # graph node -> pattern call node
        self.bound: dict[Node, Any] = {}  # pattern placeholder -> graph value
        self.order: list[Node] = []

    def run(self, pn: Node, gn: Node) -> Candidate:
        divergence = None
        try:
            self._match(pn, gn)
            self._extend_forward()
            self._check_contained()
        except _Diverged as d:
            divergence = d.divergence
        pairs = [(p.name, self.pmap[p].name) for p in self.order]
        bound = {p.name: (v.name if isinstance(v, Node) else repr(v)) for p, v in self.bound.items()}
        return Candidate(pairs=pairs, bound_inputs=bound, divergence=divergence,
                         graph_nodes=[self.pmap[p] for p in self.order])

    def _fail(self, kind: str, pn: Node, gn: Node | None, detail: str) -> None:
        raise _Diverged(Divergence(
            kind=kind, pattern_node=pn.name, pattern_op=op_name(pn.target),
            graph_node=gn.name if gn is not None else None,
            graph_op=(op_name(gn.target) if gn.op == "call_function" else gn.op) if gn is not None else None,
            detail=detail,
        ))

    def _match(self, pn: Node, gn: Node) -> None:
        if pn in self.pmap:
            if self.pmap[pn] is not gn:
                self._fail("input", pn, gn, f"pattern node {pn.name!r} is used twice; the graph uses "
                                            f"{self.pmap[pn].name!r} in one place and {gn.name!r} in the other")
            return
        if gn in self.gmapped:
            self._fail("op", pn, gn, f"graph node {gn.name!r} is already matched to pattern node {self.gmapped[gn].name!r}")
        if gn.op != "call_function" or gn.target != pn.target:
            found = op_name(gn.target) if gn.op == "call_function" else f"a {gn.op} ({gn.name})"
            self._fail("op", pn, gn, f"the pattern has {op_name(pn.target)} here, the graph has {found}: "
                                     f"{format_node(gn)}")
        self.pmap[pn] = gn
        self.gmapped[gn] = pn
        self.order.append(pn)
        if pn.target in COMMUTATIVE and len(pn.args) >= 2 and len(gn.args) >= 2:
            (p0, p1), (g0, g1) = pn.args[:2], gn.args[:2]
            if not (_fits(p0, g0) and _fits(p1, g1)) and _fits(p0, g1) and _fits(p1, g0):
                self._fail("order", pn, gn, (
                    f"operand order differs: the graph computes {format_node(gn)}, the pattern has "
                    f"{_short(p0)} and {_short(p1)} the other way round. {op_name(pn.target)} is commutative, "
                    f"but matching compares operands in order: swap them in the pattern, as the model writes it"))
        p_args, g_args, labels = _all_args(pn, gn)
        if len(p_args) != len(g_args):
            self._fail("arg", pn, gn, f"the pattern passes {len(p_args)} arguments, the graph {len(g_args)}: {format_node(gn)}")
        for i, (pa, ga) in enumerate(zip(p_args, g_args)):
            self._match_arg(pn, gn, f"argument {i} ({labels[i] if i < len(labels) else i})", pa, ga)

    def _match_arg(self, pn: Node, gn: Node, where: str, pa: Any, ga: Any) -> None:
        if isinstance(pa, Node) and pa.op == "placeholder":
            if pa in self.bound:
                prev = self.bound[pa]
                if not (prev is ga or (not isinstance(prev, Node) and not isinstance(ga, Node) and type(prev) is type(ga) and prev == ga)):
                    self._fail("input", pn, gn, f"{where}: pattern input {pa.name!r} was bound to {describe(prev)}, "
                                                f"but here the graph has {describe(ga)}")
                return
            if isinstance(ga, Node) and ga in self.gmapped:
                self._fail("input", pn, gn, f"{where}: pattern input {pa.name!r} would bind {ga.name!r}, which is "
                                            f"already matched to pattern node {self.gmapped[ga].name!r}")
            self.bound[pa] = ga
            return
        if isinstance(pa, Node):
            if not isinstance(ga, Node):
                self._fail("arg", pn, gn, f"{where}: the pattern has the result of {pa.name!r} ({op_name(pa.target)}), "
                                          f"the graph has the constant {ga!r}")
            self._match(pa, ga)
            return
        if isinstance(pa, (list, tuple)) and isinstance(ga, (list, tuple)):
            if len(pa) != len(ga):
                self._fail("arg", pn, gn, f"{where}: the pattern has a list of {len(pa)}, the graph {len(ga)}: {ga!r}")
            for j, (a, b) in enumerate(zip(pa, ga)):
                self._match_arg(pn, gn, f"{where}[{j}]", a, b)
            return
        if isinstance(ga, Node):
            self._fail("arg", pn, gn, f"{where}: the pattern has the constant {pa!r}, the graph has {describe(ga)}")
        if type(pa) is not type(ga) or pa != ga:
            self._fail("arg", pn, gn, f"{where}: the pattern has {pa!r}, the graph has {ga!r} "
                                      "(pass it as a scalar example input to match any value)")

    def _extend_forward(self) -> None:
        """Match pattern nodes not reached backwards, through users of matched nodes."""
        pattern_calls = [n for n in self.pattern_graph.nodes if n.op == "call_function"]
        while True:
            pending = [n for n in pattern_calls if n not in self.pmap]
            if not pending:
                return
            progress = False
            for pu in pending:
                anchor = next(((a, i) for i, a in enumerate(pu.args) if isinstance(a, Node) and a in self.pmap), None)
                if anchor is None:
                    continue
                pa, pos = anchor
                gsrc = self.pmap[pa]
                same_op = [u for u in gsrc.users if u.op == "call_function" and u.target == pu.target and u not in self.gmapped]
                exact = [u for u in same_op if len(u.args) > pos and u.args[pos] is gsrc]
                if exact:
                    self._match(pu, exact[0])
                    progress = True
                    break
                if same_op:
                    u = same_op[0]
                    at = [i for i, a in enumerate(u.args) if a is gsrc]
                    label = _arg_names(pu)[pos] if pos < len(_arg_names(pu)) else pos
                    self._fail("user", pu, u, (
                        f"argument {pos} ({label}): the pattern has {pa.name!r} there, the graph's {u.name!r} has "
                        f"{describe(u.args[pos]) if pos < len(u.args) else 'nothing'}; {gsrc.name!r} is its argument "
                        f"{', '.join(map(str, at)) or '?'} instead (operand order differs?): {format_node(u)}"))
                users = ", ".join(format_node(u) for u in gsrc.users) or "none"
                self._fail("user", pu, gsrc, (
                    f"the pattern feeds {pa.name!r} into {op_name(pu.target)} (as argument {pos}); in the graph, "
                    f"{gsrc.name!r} (matched to {pa.name!r}) has no such user. Its users: {users}"))
            if not progress:
                return  # the rest of the pattern is not connected to what matched

    def _check_contained(self) -> None:
        for pn, gn in self.pmap.items():
            if pn in self.returning:
                continue
            outside = [u for u in gn.users if u not in self.gmapped]
            if outside:
                self._fail("escapes", pn, gn, (
                    f"the whole pattern matched, but {gn.name!r} (pattern node {pn.name!r}, an inner value) is also "
                    f"used outside the match by {', '.join(u.name for u in outside)}; replacing the match would "
                    "remove it. Return this value from the pattern (and the replacement) as well."))


def _excerpt(gm: torch.fx.GraphModule, candidate: Candidate, context: int = 1) -> list[str]:
    marked = {n for n in candidate.graph_nodes}
    diverged = candidate.divergence.graph_node if candidate.divergence else None
    nodes = list(gm.graph.nodes)
    keep: set[int] = set()
    for i, n in enumerate(nodes):
        if n in marked or n.name == diverged:
            keep.update(range(max(0, i - context), min(len(nodes), i + context + 1)))
    lines, prev = [], None
    for i in sorted(keep):
        n = nodes[i]
        if n.op in ("output",):
            continue
        if prev is not None and i != prev + 1:
            lines.append("  ...")
        mark = ">" if n.name == diverged else ("*" if n in marked else " ")
        lines.append(f"{mark} {format_node(n)}")
        prev = i
    return lines


def ranked_candidates(traced: "TracedPattern", gm: torch.fx.GraphModule, limit: int = 4) -> list[Candidate]:
    """The partial matches that cover the most pattern ops, best first, at most `limit`.

    Walks start from every graph node that has one of the pattern's ops, the pattern's
    rarest op (in this graph) first. Equal sizes rank by the rarest op a candidate covers,
    then by the walk order (rarest anchor, the pattern's outputs first); candidates over
    the same graph nodes count once.
    """
    pattern_graph = traced.pattern.graph
    out = next(iter(pattern_graph.find_nodes(op="output")))
    returning = set(out.all_input_nodes)
    pattern_calls = [n for n in pattern_graph.nodes if n.op == "call_function"]
    by_target: dict[Any, list[Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            by_target.setdefault(n.target, []).append(n)
    count = {t: len(v) for t, v in by_target.items()}
    # Rarest op first; outputs before inner nodes; then from last to first (walks read best so).
    position = {n: i for i, n in enumerate(reversed(pattern_calls))}
    anchors = sorted((n for n in pattern_calls if n.target in count),
                     key=lambda n: (count[n.target], n not in returning, position[n]))
    found: list[tuple[tuple[int, int, int], Candidate]] = []
    seen: set[frozenset[Node]] = set()
    walk = 0
    for pn in anchors:
        for gn in by_target[pn.target]:
            cand = _Walk(pattern_graph, returning).run(pn, gn)
            nodes = frozenset(cand.graph_nodes)
            if nodes in seen:
                continue
            seen.add(nodes)
            rarest = min((count[n.target] for n in cand.graph_nodes), default=len(gm.graph.nodes))
            found.append(((-cand.size, rarest, walk), cand))
            walk += 1
            if cand.size == len(pattern_calls) and cand.divergence is None:
                break  # whole and self-contained: nothing can be closer
    found.sort(key=lambda item: item[0])
    return [c for _, c in found[:limit]]


def closest_candidate(traced: "TracedPattern", gm: torch.fx.GraphModule) -> Candidate | None:
    """The best of `ranked_candidates`, or None when no op of the pattern occurs in the graph."""
    ranked = ranked_candidates(traced, gm, limit=1)
    return ranked[0] if ranked else None


def explain_pattern(pattern: "Pattern", gm: torch.fx.GraphModule, dtype: torch.dtype | None = None) -> MatchReport:
    traced = pattern.traced(dtype)
    pattern_calls = [n for n in traced.pattern.graph.nodes if n.op == "call_function"]
    present = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    missing = sorted({op_name(n.target) for n in pattern_calls if n.target not in present})
    common = dict(pattern_name=pattern.name, dtype=traced.dtype, pattern_size=len(pattern_calls),
                  pattern_code=traced.pattern.code, missing_ops=missing)
    matches = pattern.find(gm, dtype=dtype)
    if matches:
        return MatchReport(num_matches=len(matches), closest=None, graph_excerpt=[],
                           matches=[{k: v.name for k, v in m.nodes.items()} for m in matches], **common)
    ranked = ranked_candidates(traced, gm)
    if not ranked:
        return MatchReport(num_matches=0, closest=None, graph_excerpt=[], **common)
    cand, others = ranked[0], ranked[1:]
    if cand.divergence is None:
        # Structurally whole and self-contained, yet not found: the `where` filter refused it,
        # or it overlaps another match.
        last = cand.graph_nodes[-1] if cand.graph_nodes else None
        out_pn = pattern_calls[-1]
        detail = ("the structure matches here, but the pattern's where() filter refused it"
                  if pattern.where is not None else
                  "the structure matches here but the matcher rejected it (it overlaps another match?)")
        cand.divergence = Divergence(kind="where" if pattern.where is not None else "overlap",
                                     pattern_node=out_pn.name, pattern_op=op_name(out_pn.target),
                                     graph_node=last.name if last is not None else None,
                                     graph_op=op_name(last.target) if last is not None else None, detail=detail)
    return MatchReport(num_matches=0, closest=cand, graph_excerpt=_excerpt(gm, cand), others=others, **common)


def explain_all(patterns: Iterable["Pattern"], gm: torch.fx.GraphModule, dtype: torch.dtype | None = None) -> list[MatchReport]:
    return [explain_pattern(p, gm, dtype=dtype) for p in patterns]


__all__ = ["Candidate", "Divergence", "MatchReport", "closest_candidate", "ranked_candidates", "explain_pattern", "explain_all", "format_node"]
