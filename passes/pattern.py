"""Pattern-and-replacement passes: write two plain torch functions, get a graph rewrite.

    import torch
    from kiln.passes.pattern import Pattern, PatternPass

    def gelu_and_mul(gate, up):                       # what the captured graph computes
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    def fused(gate, up):                              # what it should compute instead
        return torch.ops.my_ops.gelu_tanh_and_mul(gate, up)

    GELU_AND_MUL = Pattern(
        "gelu_tanh_and_mul", pattern=gelu_and_mul, replacement=fused,
        example_inputs=(torch.randn(8, 32), torch.randn(8, 32)),
    )

    class FuseGeluAndMul(PatternPass):
        name = "fuse_gelu_and_mul"
        phase = "fusion"
        patterns = (GELU_AND_MUL,)

`PatternPass.__call__` rewrites every non-overlapping match of each pattern and returns
`{pattern name: matches rewritten}` as its stats (what `kiln passes show` prints). Its
`uuid()` hashes the pass's module, each pattern's two functions and example-input
signatures, and this module, so editing any of them changes every cache key. Patterns that
depend on the model (traced for its head_dim, say) come from overriding
`patterns_for(ctx)`; then the pass's uuid must cover what they depend on (its module
source does, when they are built there).

How the two functions become graphs
-----------------------------------
Both are traced with `torch.export` (non-strict, training IR, not decomposed): the same
tracer capture uses, so the pattern shows the same ATen ops the model graph has
(`aten.linear.default`, `aten.mean.dim`, `aten.pow.Tensor_Scalar`, `aten.rsqrt.default`,
...). The pattern graph then goes through the `normalize` pass, as the model graph did, so
`_assert_tensor_metadata` checks and casts to the dtype a tensor already has disappear from
both.

- **dtype.** Floating-point example tensors are cast to the graph's dtype before tracing
  (`ctx.dtype` in a pass; `dtype=` in `apply`/`find`/`explain`), and each dtype is traced
  once. A pattern written with `x.to(torch.float32) ... .to(x.dtype)` (HF's RMSNorm) thus
  matches both float32 graphs (casts gone) and bfloat16 graphs (casts kept). Pass
  `cast_inputs=False` to trace the example inputs exactly as given.
- **Scalars are wildcards.** An `int` or `float` example input (an epsilon, a scale) matches
  any literal at the places the function uses it, and the replacement receives the matched
  value. (It is found by tracing twice with different values; a scalar used in arithmetic
  before reaching an op, or one that changes the graph's structure, is refused with an
  error: write such a value into the function as a constant.)
- **Shapes.** The pattern is traced with the example shapes, so a size baked into an op
  (`view(x, [2, 8, 64])`) only matches that size: start or end a pattern around such ops. The
  replacement is traced with every dimension dynamic (except those of size 1 in the
  example), so `x.shape[0]` in a replacement reads the matched tensor's size at run time.
- **Argument order matters.** `w * x` and `x * w` are different graphs. When a pattern does
  not match, `Pattern.explain(gm)` (or `kiln passes show MODEL --explain PASS`) prints the
  closest candidate and the first node and argument that differed
  (`kiln.passes.match_report`).

Rewriting
---------
Matching uses `torch.fx.passes.utils.matcher_utils.SubgraphMatcher`: placeholders are
wildcards, a match's inner nodes may not be used outside the match (only the pattern's
outputs may), overlapping matches keep the first. Each match's replacement nodes are
inserted before the match's last node; the pattern's outputs are rerouted to the
replacement's outputs; the matched nodes are erased. Every new node gets `meta["val"]`
(a fake tensor) propagated from its inputs, so later passes can read shapes and dtypes.
An optional `where(match) -> bool` filter on the `Pattern` can refuse a structural match
(e.g. only when the last dimension is a multiple of 16).

Checks
------
A replacement must compute what it replaces: each replacement output's `meta["val"]` is
compared with the matched output's (shape, symbolically, and dtype) and a mismatch raises a
`PatternError` naming both, before the graph is changed at that match. The replacement is
traced at the rank of the example inputs, so indexing written relative to that rank
(`x[..., :n]` traced at 2-D is a slice of dimension 1) means something else on tensors of
another rank: when the matched tensors have another rank than the example inputs, a
warning says so (once per pattern, input and rank).
"""

from __future__ import annotations

import hashlib
import heapq
import inspect
import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch.fx.passes.utils.matcher_utils import InternalMatch, SubgraphMatcher
from torch.utils._pytree import tree_flatten, tree_map

from kiln.passes.base import KilnPass, PassContext, PassStats

Scalar = int | float

logger = logging.getLogger("kiln.passes.pattern")

# Ops a dynamic-shape trace adds to state its assumptions; a replacement does not need them.
_SHAPE_ASSERTIONS = {
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
}


class PatternError(ValueError):
    """A pattern or replacement that cannot be traced or used; the message says what to change."""


@dataclass
class TracedPattern:
    """The two graphs of a `Pattern` for one dtype."""

    name: str
    pattern: torch.fx.GraphModule
    replacement: torch.fx.GraphModule
    dtype: torch.dtype | None
    input_names: list[str]

    @property
    def pattern_outputs(self) -> list[Any]:
        return _output_values(self.pattern.graph)


@dataclass
class PatternMatch:
    """One place in a graph where a pattern matched."""

    pattern_name: str
    # Pattern input name -> the graph value bound to it (an fx.Node, or a literal for scalars).
    inputs: dict[str, Any]
    # Pattern node name -> the graph node it matched (inputs excluded).
    nodes: dict[str, torch.fx.Node]
    outputs: list[torch.fx.Node]

    def input_val(self, name: str) -> Any:
        """The matched input's example value: `meta["val"]` (a fake tensor) or the literal."""
        value = self.inputs[name]
        if isinstance(value, torch.fx.Node):
            return value.meta.get("val")
        return value


def _output_values(graph: torch.fx.Graph) -> list[Any]:
    out = next(iter(graph.find_nodes(op="output")))
    value = out.args[0]
    return list(value) if isinstance(value, (tuple, list)) else [value]


def _perturbed(value: Scalar) -> Scalar:
    if isinstance(value, int):
        return value + 1
    return value * 1.37 + 0.61 if value != 0 else 0.61


def _signature_of(example_inputs: Sequence[Any]) -> str:
    parts = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            parts.append(f"tensor({tuple(x.shape)},{x.dtype})")
        else:
            parts.append(type(x).__name__)
    return ",".join(parts)


class Pattern:
    """A subgraph to find (`pattern`) and what to put in its place (`replacement`).

    Both are plain functions of the same inputs, in the same order, returning the same
    number of tensors. `example_inputs` are tensors (shapes the pattern is traced with) and
    int/float scalars (wildcards). `where(match)` may veto a structural match.
    """

    def __init__(
        self,
        name: str,
        pattern: Callable[..., Any],
        replacement: Callable[..., Any],
        example_inputs: Sequence[torch.Tensor | Scalar],
        where: Callable[[PatternMatch], bool] | None = None,
        cast_inputs: bool = True,
    ):
        if not name or not isinstance(name, str):
            raise PatternError("Pattern needs a name (a non-empty string): it labels the pass's stats")
        for label, fn in (("pattern", pattern), ("replacement", replacement)):
            if not callable(fn):
                raise PatternError(f"Pattern {name!r}: {label} must be a function, got {type(fn).__name__}")
        self.name = name
        self.pattern_fn = pattern
        self.replacement_fn = replacement
        self.example_inputs = tuple(example_inputs)
        self.where = where
        self.cast_inputs = cast_inputs
        self.input_names = self._input_names()
        for i, x in enumerate(self.example_inputs):
            if isinstance(x, bool) or not isinstance(x, (torch.Tensor, int, float)):
                raise PatternError(
                    f"Pattern {name!r}: example input {self.input_names[i]!r} is a {type(x).__name__}; "
                    "example inputs must be tensors or int/float scalars (write other values into the function)"
                )
        # Traced graphs per dtype; tracing is deterministic, the lock only avoids doing it twice.
        self._traced: dict[torch.dtype | None, TracedPattern] = {}
        self._lock = threading.Lock()
        self._rank_warned: set[tuple[str, int, int]] = set()

    def __repr__(self) -> str:
        return f"Pattern({self.name!r})"

    def _input_names(self) -> list[str]:
        params = list(inspect.signature(self.pattern_fn).parameters.values())
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
            raise PatternError(f"Pattern {self.name!r}: the pattern function must take named positional inputs, not *args/**kwargs")
        if len(positional) != len(self.example_inputs):
            raise PatternError(
                f"Pattern {self.name!r}: the pattern function takes {len(positional)} inputs "
                f"({', '.join(p.name for p in positional)}) but {len(self.example_inputs)} example inputs were given"
            )
        n_rep = len([p for p in inspect.signature(self.replacement_fn).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
        if n_rep != len(positional):
            raise PatternError(
                f"Pattern {self.name!r}: the replacement takes {n_rep} inputs but the pattern takes {len(positional)}; "
                "both receive the same inputs in the same order"
            )
        return [p.name for p in positional]

    # ---- identity -----------------------------------------------------------------------
    def fingerprint(self) -> str:
        """Hash of both functions' source, the example-input signature and the options."""
        h = hashlib.sha256()
        for fn in (self.pattern_fn, self.replacement_fn, self.where):
            if fn is None:
                continue
            try:
                h.update(inspect.getsource(fn).encode())
            except (OSError, TypeError):
                h.update(repr(fn).encode())  # built-ins and lambdas made at run time
        h.update(self.name.encode())
        h.update(_signature_of(self.example_inputs).encode())
        h.update(repr(self.cast_inputs).encode())
        return h.hexdigest()[:16]

    # ---- tracing ------------------------------------------------------------------------
    def traced(self, dtype: torch.dtype | None = None) -> TracedPattern:
        key = dtype if self.cast_inputs else None
        with self._lock:
            if key not in self._traced:
                self._traced[key] = self._trace(key)
            return self._traced[key]

    def _examples(self, dtype: torch.dtype | None) -> list[Any]:
        out = []
        for x in self.example_inputs:
            if isinstance(x, torch.Tensor):
                x = x.detach()
                if dtype is not None and x.is_floating_point():
                    x = x.to(dtype)
            out.append(x)
        return out

    def _trace(self, dtype: torch.dtype | None) -> TracedPattern:
        examples = self._examples(dtype)
        pattern = trace_function(self.pattern_fn, examples, self.input_names, dynamic=False,
                                 what=f"pattern {self.name!r}")
        replacement = trace_function(self.replacement_fn, examples, self.input_names, dynamic=True,
                                     what=f"replacement of {self.name!r}")
        _check_pattern_graph(pattern, self.name, self.input_names)
        n_pat, n_rep = len(_output_values(pattern.graph)), len(_output_values(replacement.graph))
        if n_pat != n_rep:
            raise PatternError(f"Pattern {self.name!r}: the pattern returns {n_pat} values but the replacement returns {n_rep}")
        return TracedPattern(name=self.name, pattern=pattern, replacement=replacement, dtype=dtype, input_names=list(self.input_names))

    # ---- matching and rewriting -------------------------------------------------------
    def find(self, gm: torch.fx.GraphModule, dtype: torch.dtype | None = None) -> list[PatternMatch]:
        """Every non-overlapping match in `gm` (after the `where` filter); `gm` is not changed."""
        traced = self.traced(dtype)
        return [self._to_match(traced, m) for m in self._internal_matches(traced, gm)]

    def _internal_matches(self, traced: TracedPattern, gm: torch.fx.GraphModule) -> list[InternalMatch]:
        matcher = SubgraphMatcher(traced.pattern.graph, match_output=False, match_placeholder=False,
                                  remove_overlapping_matches=True, ignore_literals=False)
        found = matcher.match(gm.graph)
        if self.where is None:
            return found
        return [m for m in found if self.where(self._to_match(traced, m))]

    def _to_match(self, traced: TracedPattern, m: InternalMatch) -> PatternMatch:
        inputs = dict(zip(traced.input_names, m.placeholder_nodes))
        nodes = {pn.name: gn for pn, gn in m.nodes_map.items() if pn.op == "call_function"}
        return PatternMatch(pattern_name=self.name, inputs=inputs, nodes=nodes, outputs=list(m.returning_nodes))

    def apply(self, gm: torch.fx.GraphModule, dtype: torch.dtype | None = None) -> int:
        """Rewrite every match in place; returns how many were rewritten."""
        traced = self.traced(dtype)
        matches = self._internal_matches(traced, gm)
        if not matches:
            return 0
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        # An input of a later match may be an output an earlier match replaced.
        replaced: dict[torch.fx.Node, torch.fx.Node] = {}
        positional = _takes_positions(traced.replacement.graph)
        for m in matches:
            if positional:
                self._warn_on_rank(m)
            _rewrite_one(graph, traced, m, order, replaced, self._example_ranks())
        if not _is_topological(graph):
            _stable_topological_sort(graph)
        graph.lint()
        gm.recompile()
        return len(matches)

    def _example_ranks(self) -> dict[str, int]:
        return {n: x.dim() for n, x in zip(self.input_names, self.example_inputs) if isinstance(x, torch.Tensor)}

    def _warn_on_rank(self, m: InternalMatch) -> None:
        """Warn (once per input and rank) when a matched tensor's rank differs from its example's."""
        for name, value in zip(self.input_names, m.placeholder_nodes):
            rank = self._example_ranks().get(name)
            val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
            if rank is None or not isinstance(val, torch.Tensor) or val.dim() == rank:
                continue
            key = (name, rank, val.dim())
            if key in self._rank_warned:
                continue
            self._rank_warned.add(key)
            logger.warning(
                "pattern %r: example input %r is %d-D but matched %s, which is %d-D (%s); the replacement was "
                "traced at the example's rank, so indexing relative to the rank ([..., :n], dim=1) may land on "
                "another dimension: give example inputs of the graph's rank",
                self.name, name, rank, value.name, val.dim(), _format_shape(val.shape))

    def explain(self, gm: torch.fx.GraphModule, dtype: torch.dtype | None = None) -> "Any":
        """A `MatchReport`: the matches, or the closest candidate and where it diverged."""
        from kiln.passes.match_report import explain_pattern

        return explain_pattern(self, gm, dtype=dtype)


# ---- tracing helpers ---------------------------------------------------------------------
class _FunctionModule(torch.nn.Module):
    """Lets `torch.export` trace a plain function; placeholders take the function's names."""

    def __init__(self, fn: Callable[..., Any], names: list[str]):
        super().__init__()
        self.fn = fn

        def forward(*args: Any) -> Any:
            return fn(*args)

        forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
        )
        self.forward = forward  # type: ignore[method-assign]


def _export(fn: Callable[..., Any], args: list[Any], names: list[str], dynamic: bool, what: str) -> torch.fx.GraphModule:
    from torch.export import Dim

    dynamic_shapes = None
    if dynamic:
        # Size-0/1 dimensions would be specialized (with a warning) anyway: leave them static.
        dynamic_shapes = tuple(
            {i: Dim.AUTO for i in range(a.dim()) if a.shape[i] > 1} if isinstance(a, torch.Tensor) else None
            for a in args
        )
    try:
        with torch.no_grad():
            program = torch.export.export(_FunctionModule(fn, names), tuple(args), dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as e:
        raise PatternError(f"{what}: torch.export could not trace it on the example inputs: {type(e).__name__}: {e}") from e
    gm = program.graph_module
    # Drop export's pytree calling convention: plain positional inputs, plain outputs.
    gm.graph._codegen = torch.fx.graph.CodeGen()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _SHAPE_ASSERTIONS:
            gm.graph.erase_node(node)
    from kiln.passes.normalize import NormalizePass

    NormalizePass()(gm, PassContext(config=None))
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


def trace_function(fn: Callable[..., Any], example_inputs: Sequence[Any], input_names: Sequence[str] | None = None,
                   dynamic: bool = False, what: str = "function") -> torch.fx.GraphModule:
    """Trace `fn` to the normalized ATen graph capture produces; int/float inputs become placeholders.

    With `dynamic=True` every tensor dimension is symbolic (size reads become `sym_size`
    nodes instead of constants).
    """
    args = list(example_inputs)
    names = list(input_names) if input_names is not None else list(inspect.signature(fn).parameters)[: len(args)]
    gm = _export(fn, args, names, dynamic, what)
    scalar_positions = [i for i, a in enumerate(args) if isinstance(a, (int, float)) and not isinstance(a, bool)]
    if not scalar_positions:
        return gm
    other = list(args)
    for i in scalar_positions:
        other[i] = _perturbed(args[i])
    gm_other = _export(fn, other, names, dynamic, what)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    _bind_scalar_inputs(gm, gm_other, {i: (args[i], other[i], placeholders[i]) for i in scalar_positions}, names, what)
    gm.recompile()
    return gm


def _bind_scalar_inputs(gm: torch.fx.GraphModule, gm_other: torch.fx.GraphModule,
                        scalars: dict[int, tuple[Scalar, Scalar, torch.fx.Node]], names: list[str], what: str) -> None:
    """Replace the literals that changed between the two traces with the scalar's placeholder."""
    nodes, nodes_other = list(gm.graph.nodes), list(gm_other.graph.nodes)
    if len(nodes) != len(nodes_other) or any(
        a.op != b.op or a.target != b.target for a, b in zip(nodes, nodes_other)
    ):
        raise PatternError(
            f"{what}: the graph's structure depends on the scalar inputs "
            f"({', '.join(names[i] for i in scalars)}); write such a value into the function as a constant"
        )

    def same(x: Any, y: Any) -> bool:
        if isinstance(x, float) and isinstance(y, float):
            return x == y or (math.isnan(x) and math.isnan(y))
        return type(x) is type(y) and x == y

    def substitute(x: Any, y: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            return x
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)) and len(x) == len(y):
            return type(x)(substitute(a, b) for a, b in zip(x, y))
        if same(x, y):
            return x
        for i, (value, value_other, placeholder) in scalars.items():
            if same(x, value) and same(y, value_other):
                return placeholder
        raise PatternError(
            f"{what}: an op argument derived from a scalar input ({x!r}, or {y!r} when traced with other values) "
            "is not the input itself; the scalar inputs must reach ops unchanged (move the arithmetic into the "
            "replacement, or write the value into the function as a constant)"
        )

    for node, node_other in zip(nodes, nodes_other):
        if node.op != "call_function":
            continue
        node.args = substitute(node.args, node_other.args)
        node.kwargs = dict(zip(node.kwargs, substitute(tuple(node.kwargs.values()), tuple(node_other.kwargs.values()))))


def _check_pattern_graph(gm: torch.fx.GraphModule, name: str, input_names: list[str]) -> None:
    for node, input_name in zip(gm.graph.find_nodes(op="placeholder"), input_names):
        if not node.users:
            raise PatternError(
                f"Pattern {name!r}: input {input_name!r} is not used by the traced pattern "
                "(a pattern can only bind inputs its ops read)"
            )
    if not any(n.op == "call_function" for n in gm.graph.nodes):
        raise PatternError(f"Pattern {name!r}: the pattern has no ops to match")
    for value in _output_values(gm.graph):
        if not isinstance(value, torch.fx.Node) or value.op != "call_function":
            raise PatternError(f"Pattern {name!r}: every pattern output must be computed by an op (not an input or constant)")


# ---- rewriting helpers -------------------------------------------------------------------
def _resolve(value: Any, replaced: dict[torch.fx.Node, torch.fx.Node]) -> Any:
    while isinstance(value, torch.fx.Node) and value in replaced:
        value = replaced[value]
    return value


def _format_shape(shape: Sequence[Any]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _same_size(a: Any, b: Any) -> bool:
    """Whether two (possibly symbolic) sizes are known equal, without adding shape guards."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except Exception:  # sizes from two unrelated shape environments: compare as written
        return str(a) == str(b)


def _output_mismatch(old: torch.fx.Node, new: Any) -> str | None:
    """What differs between a matched output's value and its replacement's, or None."""
    want = old.meta.get("val")
    got = new.meta.get("val") if isinstance(new, torch.fx.Node) else None
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return None  # nothing known to compare
    if want.dtype != got.dtype or want.dim() != got.dim() or not all(
            _same_size(a, b) for a, b in zip(want.shape, got.shape)):
        return (f"has shape {_format_shape(got.shape)} and dtype {str(got.dtype).replace('torch.', '')} where the "
                f"matched node {old.name!r} ({old.target}) has shape {_format_shape(want.shape)} and dtype "
                f"{str(want.dtype).replace('torch.', '')}")
    return None


def _takes_positions(graph: torch.fx.Graph) -> bool:
    """Whether an op of a replacement takes an int or a slice (a dim, an index, a size): what a
    matched tensor of another rank than the example's would move. An elementwise replacement
    (kiln::silu_and_mul(gate, up)) takes none, and fits a match of any rank."""
    for node in graph.nodes:
        if node.op == "call_function":
            args, _ = tree_flatten((node.args, node.kwargs))
            if any(isinstance(a, slice) or (isinstance(a, int) and not isinstance(a, bool)) for a in args):
                return True
    return False


def _rewrite_one(graph: torch.fx.Graph, traced: TracedPattern, m: InternalMatch,
                 order: dict[torch.fx.Node, int], replaced: dict[torch.fx.Node, torch.fx.Node],
                 example_ranks: dict[str, int] | None = None) -> None:
    matched = [gn for pn, gn in m.nodes_map.items() if pn.op == "call_function"]
    last = max(matched, key=lambda n: order[n])
    env: dict[torch.fx.Node, Any] = {}
    rep_graph = traced.replacement.graph
    for placeholder, value in zip(rep_graph.find_nodes(op="placeholder"), m.placeholder_nodes):
        env[placeholder] = _resolve(value, replaced)
    new_nodes = []
    with graph.inserting_before(last):
        for node in rep_graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op != "call_function":
                raise PatternError(f"replacement of {traced.name!r}: only op calls are supported, found {node.op} {node.name}")
            new = graph.call_function(node.target, tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, node.args),
                                      tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a, node.kwargs))
            env[node] = new
            new_nodes.append(new)
    for node in new_nodes:
        propagate_val(node)
    new_outputs = [env[v] if isinstance(v, torch.fx.Node) else v for v in _output_values(rep_graph)]
    for i, (old, new) in enumerate(zip(m.returning_nodes, new_outputs)):
        problem = _output_mismatch(old, new)
        if problem is None:
            continue
        for node in reversed(new_nodes):  # leave this match's place as it was
            graph.erase_node(node)
        ranks = {name: (example_ranks or {}).get(name) for name in traced.input_names}
        matched = {name: v.meta["val"].dim() for name, v in zip(traced.input_names, m.placeholder_nodes)
                   if isinstance(v, torch.fx.Node) and isinstance(v.meta.get("val"), torch.Tensor)}
        hint = ""
        if any(ranks.get(n) is not None and ranks[n] != r for n, r in matched.items()):
            hint = (f" The example inputs have ranks {ranks}, the matched tensors {matched}: the replacement was "
                    "traced at the example ranks, so indexing relative to the rank lands elsewhere; give example "
                    "inputs of the graph's rank.")
        raise PatternError(f"Pattern {traced.name!r}: replacement output {i} {problem}; a replacement must compute "
                           f"the same shape and dtype as the nodes it replaces.{hint}")
    for old, new in zip(m.returning_nodes, new_outputs):
        if isinstance(new, torch.fx.Node) and "val" in old.meta and "val" not in new.meta:
            new.meta["val"] = old.meta["val"]
        old.replace_all_uses_with(new)
        if isinstance(new, torch.fx.Node):
            replaced[old] = new
    for node in sorted(matched, key=lambda n: order[n], reverse=True):
        if not node.users:
            graph.erase_node(node)


def propagate_val(node: torch.fx.Node) -> None:
    """Give a new node a fake `meta["val"]` computed from its inputs' fake values."""
    from torch._guards import detect_fake_mode

    inputs, _ = tree_flatten((node.args, node.kwargs))
    if any(isinstance(a, torch.fx.Node) and "val" not in a.meta for a in inputs):
        return  # an input without a value: leave this node without one too
    args, kwargs = tree_map(lambda a: a.meta["val"] if isinstance(a, torch.fx.Node) else a, (node.args, node.kwargs))
    flat, _ = tree_flatten((args, kwargs))
    mode = detect_fake_mode([a for a in flat if isinstance(a, torch.Tensor)])
    if mode is None:
        return
    try:
        with mode:
            node.meta["val"] = node.target(*args, **kwargs)
    except Exception:  # a value we cannot compute is absent, never wrong
        node.meta.pop("val", None)


def _is_topological(graph: torch.fx.Graph) -> bool:
    seen: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if any(a not in seen for a in node.all_input_nodes):
            return False
        seen.add(node)
    return True


def _stable_topological_sort(graph: torch.fx.Graph) -> None:
    """Reorder nodes so every node follows its inputs, keeping the current order otherwise."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [index[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    ordered: list[torch.fx.Node] = []
    while ready:
        node = nodes[heapq.heappop(ready)]
        ordered.append(node)
        for user in node.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, index[user])
    if len(ordered) != len(nodes):
        raise RuntimeError("graph has a cycle after a pattern rewrite")
    for prev, node in zip(ordered, ordered[1:]):
        prev.append(node)


# ---- the pass ------------------------------------------------------------------------------
class PatternPass(KilnPass):
    """A pass made of patterns, applied in order; stats = matches rewritten per pattern."""

    patterns: Sequence[Pattern] = ()

    def patterns_for(self, ctx: PassContext) -> Sequence[Pattern]:
        """The patterns to apply for this model; override when they depend on the config
        (e.g. traced per head_dim). `__call__` and `explain` both go through here."""
        return self.patterns

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        return {p.name: p.apply(gm, dtype=ctx.dtype) for p in self.patterns_for(ctx)}

    def uuid(self) -> str:
        h = hashlib.sha256(super().uuid().encode())
        for p in self.patterns:
            h.update(p.fingerprint().encode())
        h.update(inspect.getsource(inspect.getmodule(Pattern)).encode())
        return h.hexdigest()[:16]

    def explain(self, gm: torch.fx.GraphModule, ctx: PassContext) -> list[Any]:
        """A `MatchReport` per pattern, on the graph this pass would see."""
        return [p.explain(gm, dtype=ctx.dtype) for p in self.patterns_for(ctx)]


def replace_pattern(gm: torch.fx.GraphModule, pattern: Callable[..., Any], replacement: Callable[..., Any],
                    example_inputs: Sequence[Any], dtype: torch.dtype | None = None) -> int:
    """One-off rewrite without declaring a `Pattern`; returns matches rewritten."""
    name = getattr(pattern, "__name__", "pattern")
    return Pattern(name, pattern, replacement, example_inputs).apply(gm, dtype=dtype)


__all__ = ["Pattern", "PatternError", "PatternMatch", "PatternPass", "TracedPattern", "replace_pattern", "trace_function"]
