"""The post-pass FX graph as cacheable Python source, and back to a callable without tracing.

This is the compile cache's artifact for compile mode "graph" (kiln.compiler.startup), the
CUDA default: there the measured fast path is the post-pass graph run directly (its fused
ops are Kiln's Triton kernels) with decode steps replayed from CUDA graphs, and some torch
builds cannot load AOTInductor CUDA packages (compiler/README.md). What a warm start
then saves is the capture itself (`torch.export` + passes, ~8.5 s for Llama-3-8B).

Why source and not a pickle: `pickle.dumps(gm)` works, but `pickle.loads` re-traces the
module with a tracer that needs a `scope_root` our graphs do not have. FX's own code
generation (`graph.python_code`) gives the exact `forward` the GraphModule runs, plus the
globals it refers to; for Kiln's graphs those are only standard names (torch, device, inf,
nan, NoneType, pytree helpers). So an entry stores that source, the names of its globals,
the input roles it was captured with and the capture device, as JSON. Loading rebuilds the
globals from a fixed table (an unknown name is an error: the entry is treated as corrupt),
`exec`s the source and returns a callable taking the GraphModule's positional arguments.

Graphs that reach into their module (`get_attr` nodes, submodules, `self.` in the source)
are refused at serialization: nothing but the source is stored, so there is no `self`.

Loading executes code read from the cache directory, which is trusted exactly as much as
the shared libraries an AOTInductor package `dlopen`s from the same place.
"""

from __future__ import annotations

import ast
import builtins
import itertools
import json
import linecache
import math
import operator
import re
from typing import Any, Callable

import torch
import torch.fx

GRAPH_CODE_FORMAT = "fx-python/1"  # also the cache key's `format` factor for graph-code entries

# Every global the generated source may use, by the name FX gives it. Serialization checks
# that each of the graph's globals is one of these *same objects*, so whatever is stored
# can be rebuilt at load time from names alone.
_KNOWN_GLOBALS: dict[str, Any] = {
    "torch": torch,
    "device": torch.device,
    "inf": math.inf,
    "nan": math.nan,
    "NoneType": type(None),
    "fx_pytree": torch.fx._pytree,
    "pytree": torch.utils._pytree,
    "math": math,
    "operator": operator,
    "_operator": operator,
    "builtins": builtins,
}
_OP_RE = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)(?:\.(\w+))?")
_SELF_RE = re.compile(r"\bself\s*\.")
_load_ids = itertools.count()


class GraphCodeError(ValueError):
    """A graph that cannot be stored as source, or a stored entry that cannot be loaded."""


class GraphCode:
    """The loaded `forward` of a post-pass graph: call it with the GraphModule's positional args."""

    __slots__ = ("_fn", "source", "filename", "num_inputs")

    def __init__(self, fn: Callable[..., Any], source: str, filename: str, num_inputs: int):
        self._fn = fn
        self.source = source
        self.filename = filename
        self.num_inputs = num_inputs

    def __call__(self, *args: Any) -> Any:
        # `self` of the generated forward: None, since the graph reads nothing from a module.
        return self._fn(None, *args)

    def __repr__(self) -> str:
        return f"GraphCode({self.filename}, {self.num_inputs} inputs)"


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return False


def serialize_graph_code(gm: torch.fx.GraphModule, input_roles: list[str], device: torch.device) -> bytes:
    """`gm`'s generated source plus what loading needs, as bytes for a cache entry.

    Raises GraphCodeError for a graph whose source alone cannot reproduce it: module
    attributes or submodules, or a global outside the known table.
    """
    reaching = sorted({f"{n.op} {n.target}" for n in gm.graph.nodes if n.op in ("get_attr", "call_module")})
    if reaching:
        raise GraphCodeError(f"the graph reads {len(reaching)} module attribute(s)/submodule(s) "
                             f"({', '.join(reaching[:4])}), which its source alone cannot carry")
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(input_roles):
        raise GraphCodeError(f"the graph has {len(placeholders)} inputs but {len(input_roles)} input roles were given")
    code = gm.graph.python_code(root_module="self")
    if _SELF_RE.search(code.src):  # the def line has `self,` but never `self.`
        raise GraphCodeError("the graph's source refers to `self.` (module state), which is not stored")
    unknown = sorted(name for name, value in code.globals.items()
                     if name not in _KNOWN_GLOBALS or not _same(value, _KNOWN_GLOBALS[name]))
    if unknown:
        raise GraphCodeError(f"the graph's source uses global(s) Kiln cannot rebuild at load: {', '.join(unknown)}")
    payload = {
        "format": GRAPH_CODE_FORMAT,
        "torch": torch.__version__,
        "device": str(device),
        "globals": sorted(code.globals),
        "input_roles": list(input_roles),
        "src": code.src,
    }
    return json.dumps(payload, sort_keys=True).encode()


def load_graph_code(data: bytes, input_roles: list[str], device: torch.device, name: str = "graph") -> GraphCode:
    """The callable stored in `data` (from serialize_graph_code), for a graph spec with `input_roles`.

    Raises GraphCodeError when the entry is damaged, of another format, was stored for other
    input roles, names an unknown global, or calls an op that is not registered; the caller
    drops such an entry and captures again.
    """
    import kiln.kernels  # noqa: F401  (registers torch.ops.kiln.*, with the Triton kernels on CUDA)

    try:
        payload = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GraphCodeError(f"graph code is not readable JSON ({e})") from e
    if not isinstance(payload, dict) or payload.get("format") != GRAPH_CODE_FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise GraphCodeError(f"graph code has format {got!r}, expected {GRAPH_CODE_FORMAT!r}")
    src, names, roles = payload.get("src"), payload.get("globals"), payload.get("input_roles")
    if not isinstance(src, str) or not isinstance(names, list) or not isinstance(roles, list):
        raise GraphCodeError("graph code entry lacks its source, globals or input roles")
    if roles != list(input_roles):
        # The spec and the code are separate entries; both must come from one capture.
        raise GraphCodeError(f"graph code was stored for {len(roles)} inputs that differ from the graph spec's "
                             f"{len(input_roles)}")
    unknown = sorted(str(n) for n in names if n not in _KNOWN_GLOBALS)
    if unknown:
        raise GraphCodeError(f"graph code uses unknown global(s) {', '.join(unknown)}")
    glb: dict[str, Any] = {n: _KNOWN_GLOBALS[n] for n in names}
    stored_device = torch.device(str(payload.get("device", device)))
    if "device" in glb and stored_device != device and stored_device.type == device.type:
        # Captured on another index of the same device kind (cuda:0 vs cuda:1; the key holds
        # only the kind): device literals in the source mean "the engine's device".
        glb["device"] = lambda type=None, index=None: device if type == device.type else torch.device(type, index)
    _check_ops(src)
    filename = f"<kiln graph code {name} #{next(_load_ids)}>"
    try:
        tree = ast.parse(src, filename)
    except (SyntaxError, ValueError) as e:
        raise GraphCodeError(f"graph code does not parse ({type(e).__name__}: {e})") from e
    # A source cut short at a line boundary still parses; FX's forward always ends in `return`.
    defs = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    if [d.name for d in defs] != ["forward"] or not isinstance(defs[0].body[-1], ast.Return):
        raise GraphCodeError("graph code is not one complete `forward` function (truncated?)")
    try:
        exec(compile(tree, filename, "exec"), glb)  # noqa: S102  (our own generated source; see the module doc)
    except Exception as e:  # a damaged source raises NameError, ...
        raise GraphCodeError(f"graph code does not execute ({type(e).__name__}: {e})") from e
    fn = glb.get("forward")
    if not callable(fn) or getattr(fn, "__code__", None) is None:
        raise GraphCodeError("graph code defines no forward function")
    if fn.__code__.co_argcount != len(input_roles) + 1:
        raise GraphCodeError(f"graph code's forward takes {fn.__code__.co_argcount - 1} inputs, the spec has "
                             f"{len(input_roles)}")
    # Tracebacks through the graph then show its lines, as a GraphModule's do.
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    return GraphCode(fn, src, filename, len(input_roles))


def _check_ops(src: str) -> None:
    """Every `torch.ops.<ns>.<op>[.<overload>]` the source calls resolves now, rather than mid-step."""
    for ns, op, overload in sorted(set(_OP_RE.findall(src))):
        try:
            packet = getattr(getattr(torch.ops, ns), op)
            if overload:
                getattr(packet, overload)
        except (AttributeError, RuntimeError) as e:
            qual = f"torch.ops.{ns}.{op}" + (f".{overload}" if overload else "")
            raise GraphCodeError(f"graph code calls {qual}, which is not registered in this process ({e})") from e
