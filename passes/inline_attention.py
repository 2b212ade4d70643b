"""`mark_inline_attention`: attention a model writes inline becomes the `kiln::attention` marker.

Most transformers models call the attention interface, where capture's "kiln" function puts
the marker. Bloom, MPT and Falcon compute attention in their own code instead: Bloom as
`baddbmm(alibi, q, k^T) + mask -> softmax -> bmm(., v)`, MPT as `q @ k^T * scale + bias ->
masked_fill -> softmax -> @ v`, Falcon through its own `scaled_dot_product_attention` call
with a mask it builds (with the ALiBi bias folded in when `alibi=True`). This capture-time
pass finds each such site in the exported graph and replaces it with the marker, so
everything after capture (paged KV, kernels, fusions) sees the same graph as for any model.

A site is an `aten.scaled_dot_product_attention` call, or a softmax whose logits come from one
`q @ k^T` product (bmm/matmul/baddbmm) and whose probabilities (through casts, dropout and
views) multiply v. What the model adds to the logits is read off numerically rather than
pattern-matched, so it does not matter how a model spells it: the logits are evaluated as a
function of the q.k product on a concrete length (the bias subgraph depends only on token
positions and constants, never on weights), with the product set to 0, 1 and 3. That must
give `logits = scale * qk + bias` with one scalar scale, a bias of -inf (or the dtype's
minimum) exactly where a causal (optionally sliding-window) mask hides keys, and elsewhere
`slope[h] * (k_pos - q_pos)` plus a per-row constant (which softmax drops): ALiBi, with
the slopes read from the bias. Anything else (a learned bias, a non-causal mask, a
non-linear function of the logits) is refused with the construct and the module named.

The slopes become one graph input per distinct set, role `constant:alibi_slopes[_<n>]`,
whose values go into the capture's constants. Layer indices are the sites' order in the
graph, which is the order of the layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from kiln.compiler.graph_inputs import INPUT_META_KEY, InputRole, RoleKind, add_graph_input, constant_role

aten = torch.ops.aten

# The length the logits are evaluated at: long enough that a sliding window a model builds
# into its mask shows (the config's own window is checked against what was found).
PROBE_TOKENS = 64
_SOFTMAX = (aten.softmax.int, aten._softmax.default, aten._safe_softmax.default)
_PRODUCTS = (aten.matmul.default, aten.bmm.default)
# Between the probabilities and their product with v: casts, dropout (eval) and views.
_PASS_THROUGH = (aten.to.dtype, aten._to_copy.default, aten.dropout.default, aten.view.default,
                 aten.reshape.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
                 aten.type_as.default)
_ASSERT_METADATA = aten._assert_tensor_metadata.default
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# q.k values the logits are evaluated at: 0 gives the bias, the large one the scale
# (precisely, next to a bias of hundreds), 1 checks the two combine linearly.
_PROBE_PRODUCTS = (0.0, 1.0, 1024.0)


class InlineAttentionError(ValueError):
    """An inline attention this pass cannot express as the marker; the message names the
    construct and the module."""


@dataclass
class AttentionSite:
    """One inline attention, in the graph's own layouts: q, k and v are [..., T, D] (k may be
    given transposed, [..., D, T]); `output` is the [..., T, D] node the marker replaces."""

    q: torch.fx.Node
    k: torch.fx.Node
    k_transposed: bool
    v: torch.fx.Node
    output: torch.fx.Node
    logits: Callable[[torch.Tensor], torch.Tensor]  # qk product (concrete) -> logits
    qk_shape: tuple[int, ...]
    where: str


@dataclass
class InlineAttentionReport:
    sites: int
    alibi_layers: int
    sliding_window_layers: int


def mark_inline_attention(gm: torch.fx.GraphModule, constants: dict[str, torch.Tensor],
                          config_sliding_window: int | None = None) -> InlineAttentionReport:
    """Replace every inline attention of `gm` with `kiln::attention`; `constants` (the
    capture's config-derived tensors, by name) feeds the bias evaluation and receives the
    ALiBi slopes. Raises InlineAttentionError naming what it cannot express."""
    graph = gm.graph
    _split_baddbmm(graph)
    weighted = _depends_on_weights(graph)
    probe = _Probe(graph, constants, weighted)
    sites = [_site(node, weighted, probe) for node in list(graph.nodes)
             if node.op == "call_function" and (node.target in _SOFTMAX or
                                                node.target == aten.scaled_dot_product_attention.default)]
    if not sites:
        raise InlineAttentionError("no attention found in the traced graph (neither the attention interface "
                                   "nor softmax(q @ k^T) @ v)")
    slope_inputs: dict[tuple[float, ...], torch.fx.Node] = {}
    alibi_layers = window_layers = 0
    for layer_idx, site in enumerate(sites):
        scale, window, slopes = _read_logits(site)
        if window == 0 and config_sliding_window:
            raise InlineAttentionError(
                f"the config's sliding window ({config_sliding_window}) is not in the attention mask the model "
                f"builds at {site.where} (checked at {PROBE_TOKENS} tokens)")
        slopes_node = None
        if slopes is not None:
            key = tuple(slopes.tolist())
            if key not in slope_inputs:
                name = "alibi_slopes" if not slope_inputs else f"alibi_slopes_{len(slope_inputs)}"
                constants[name] = slopes.to(site.q.meta["val"].device)
                slope_inputs[key] = add_graph_input(gm, name, constant_role(name),
                                                    _fake_like(site.q, constants[name]))
            slopes_node = slope_inputs[key]
            alibi_layers += 1
        window_layers += window > 0
        _replace(graph, site, layer_idx, scale, window, slopes_node)
    _drop_dead(graph)
    graph.lint()
    gm.recompile()
    return InlineAttentionReport(sites=len(sites), alibi_layers=alibi_layers, sliding_window_layers=window_layers)


def _where(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if stack:
        path, cls = list(stack.values())[-1]
        path = path[len("hf."):] if path.startswith("hf.") else path
        cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
        return f"{path} ({cls_name.rsplit('.', 1)[-1]})"
    return node.name


def _split_baddbmm(graph: torch.fx.Graph) -> None:
    """baddbmm(bias, a, b, beta, alpha) -> beta * bias + alpha * bmm(a, b): the q.k product
    becomes a node of its own (Bloom folds its ALiBi bias into this call)."""
    for node in list(graph.find_nodes(op="call_function", target=aten.baddbmm.default)):
        bias, a, b = node.args[:3]
        beta = node.kwargs.get("beta", node.args[3] if len(node.args) > 3 else 1)
        alpha = node.kwargs.get("alpha", node.args[4] if len(node.args) > 4 else 1)
        with graph.inserting_before(node):
            product = graph.call_function(aten.bmm.default, (a, b))
            scaled = graph.call_function(aten.mul.Tensor, (product, alpha))
            biased = graph.call_function(aten.mul.Tensor, (bias, beta))
            total = graph.call_function(aten.add.Tensor, (scaled, biased))
        for new in (product, scaled, biased, total):
            new.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
            new.meta["val"] = _fake_call(new)
        node.replace_all_uses_with(total)
        graph.erase_node(node)


def _depends_on_weights(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes computed from a parameter (hidden states and everything after them)."""
    weighted: set[torch.fx.Node] = set()
    for node in graph.nodes:
        role = node.meta.get(INPUT_META_KEY)
        if node.op == "placeholder":
            if role is not None and InputRole.parse(role).kind == RoleKind.PARAM:
                weighted.add(node)
        elif any(a in weighted for a in node.all_input_nodes):
            weighted.add(node)
    return weighted


def _site(node: torch.fx.Node, weighted: set[torch.fx.Node], probe: "_Probe") -> AttentionSite:
    where = _where(node)
    if node.target == aten.scaled_dot_product_attention.default:
        return _sdpa_site(node, probe, where)
    # Forward: the probabilities reach `probs @ v` through casts, dropout and views.
    probs = node

    def users(n: torch.fx.Node) -> list[torch.fx.Node]:
        return [u for u in n.users if u.target is not _ASSERT_METADATA]

    while len(users(probs)) == 1:
        user = users(probs)[0]
        if user.op == "call_function" and user.target in _PASS_THROUGH:
            probs = user
            continue
        if user.op == "call_function" and user.target in _PRODUCTS and user.args[0] is probs:
            output, v = user, user.args[1]
            break
        raise InlineAttentionError(f"a softmax whose result is not multiplied by the values ({where}: "
                                   f"used by {user.target})")
    else:
        raise InlineAttentionError(f"a softmax whose result is used more than once or not at all ({where})")
    # Backward: the one q @ k^T product among the weight-dependent inputs of the logits.
    logits = node.args[0]
    products, seen, stack = [], set(), [logits]
    while stack:
        current = stack.pop()
        if current in seen or current not in weighted:
            continue
        seen.add(current)
        if current.op == "call_function" and current.target in _PRODUCTS:
            products.append(current)
            continue
        stack.extend(current.all_input_nodes)
    if len(products) != 1:
        raise InlineAttentionError(f"attention logits built from {len(products)} products of weight-dependent "
                                   f"tensors, not one q @ k^T ({where})")
    qk = products[0]
    evaluate = probe.function(logits, qk, where)
    return AttentionSite(q=qk.args[0], k=qk.args[1], k_transposed=True, v=v, output=output, logits=evaluate,
                         qk_shape=probe.concrete_shape(qk), where=where)


def _sdpa_site(node: torch.fx.Node, probe: "_Probe", where: str) -> AttentionSite:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    q, k, v = bound["query"], bound["key"], bound["value"]
    mask, is_causal = bound.get("attn_mask"), bool(bound.get("is_causal", False))
    scale = bound.get("scale")
    if scale is None:
        scale = probe.concrete_shape(q)[-1] ** -0.5
    mask_of = probe.function(mask, None, where) if mask is not None else None

    def evaluate(qk: torch.Tensor) -> torch.Tensor:
        out = qk * scale
        if mask_of is not None:
            m = mask_of(qk)
            out = out + (torch.where(m, 0.0, float("-inf")) if m.dtype == torch.bool else m)
        if is_causal:
            t = out.shape[-1]
            out = out.masked_fill(torch.ones(t, t, dtype=torch.bool, device=out.device).triu(1), float("-inf"))
        return out

    t = probe.tokens
    q_shape = probe.concrete_shape(q)
    return AttentionSite(q=q, k=k, k_transposed=False, v=v, output=node, logits=evaluate,
                         qk_shape=(*q_shape[:-1], t), where=where)


class _Probe:
    """Evaluates a node of the graph on a concrete length, from positions and constants only."""

    def __init__(self, graph: torch.fx.Graph, constants: dict[str, torch.Tensor], weighted: set[torch.fx.Node]):
        self.graph, self.constants, self.weighted = graph, constants, weighted
        self.tokens = PROBE_TOKENS
        ids = next((n for n in graph.find_nodes(op="placeholder")
                    if n.meta.get(INPUT_META_KEY) == "batch:input_ids"), None)
        if ids is None or "val" not in ids.meta:
            raise InlineAttentionError("the traced graph has no input_ids input to size the probe by")
        self.device = ids.meta["val"].device
        length = ids.meta["val"].shape[1]
        self.symbol = length.node.expr if isinstance(length, torch.SymInt) else None

    def concrete_shape(self, node: torch.fx.Node) -> tuple[int, ...]:
        dims = []
        for size in node.meta["val"].shape:
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if self.symbol is not None and hasattr(expr, "xreplace"):
                    expr = expr.xreplace({self.symbol: self.tokens})
                if not getattr(expr, "is_number", True):
                    raise InlineAttentionError(f"a size of {node.name} that is not a function of the token count")
                size = int(expr)
            dims.append(int(size))
        return tuple(dims)

    def function(self, target: torch.fx.Node, cut: torch.fx.Node | None,
                 where: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """`target` as a function of the value at `cut` (a concrete tensor), every other input
        fed from positions and constants; a weight reached elsewhere is a learned bias."""
        sub = torch.fx.Graph()
        cut_input = sub.placeholder("cut") if cut is not None else None
        copied: dict[torch.fx.Node, torch.fx.Node] = {}
        feeds: dict[str, torch.Tensor] = {}

        def copy(node: torch.fx.Node) -> torch.fx.Node:
            if node is cut:
                return cut_input
            if node in copied:
                return copied[node]
            for parent in node.all_input_nodes:
                copy(parent)
            if node.op == "placeholder":
                feeds[node.name] = self._feed(node, where)
                copied[node] = sub.placeholder(node.name)
            elif node.op == "get_attr":
                raise InlineAttentionError(f"attention bias from a module attribute ({where})")
            else:
                new = sub.node_copy(node, lambda n: copied[n] if n is not cut else cut_input)
                # The bias is read at float32 whatever the capture dtype: rounded to bfloat16,
                # MPT's bias (offset by its context length) would hide its slopes.
                new.args, new.kwargs = torch.fx.node.map_aggregate(
                    (new.args, new.kwargs), lambda a: torch.float32 if a in _LOW_PRECISION else a)
                copied[node] = new
            return copied[node]

        sub.output(copy(target))
        module = torch.fx.GraphModule(torch.nn.Module(), sub)
        order = [n.name for n in sub.find_nodes(op="placeholder") if n is not cut_input]

        def evaluate(value: torch.Tensor) -> torch.Tensor:
            args = ([value] if cut_input is not None else []) + [feeds[name] for name in order]
            with torch.no_grad():
                return module(*args)

        return evaluate

    def _feed(self, node: torch.fx.Node, where: str) -> torch.Tensor:
        role = node.meta.get(INPUT_META_KEY)
        parsed = InputRole.parse(role) if role else None
        if parsed is not None and parsed.kind == RoleKind.CONSTANT and parsed.name in self.constants:
            value = self.constants[parsed.name]
            return value.float() if value.dtype in _LOW_PRECISION else value
        if role == "batch:input_ids":
            return torch.zeros((1, self.tokens), dtype=torch.long, device=self.device)
        if role == "batch:position_ids":
            return torch.arange(self.tokens, device=self.device)[None]
        raise InlineAttentionError(f"attention bias computed from {role or node.name} (a learned attention bias "
                                   f"is not supported; {where})")


def _read_logits(site: AttentionSite) -> tuple[float, int, torch.Tensor | None]:
    """(scale, sliding window, ALiBi slopes or None) of the site; InlineAttentionError if its
    logits are not scale * q.k + a causal mask (+ ALiBi)."""
    t = PROBE_TOKENS
    device = site.q.meta["val"].device
    runs = [site.logits(torch.full(site.qk_shape, x, device=device)).float() for x in _PROBE_PRODUCTS]
    heads = math.prod(runs[0].shape[:-2])
    if runs[0].shape[-2:] != (t, t):
        raise InlineAttentionError(f"attention logits of shape {tuple(runs[0].shape)} at {t} tokens ({site.where})")
    bias, at_one, at_large = (r.reshape(heads, t, t) for r in runs)
    # The model's own masking value (its dtype's minimum, or -inf) is far below any real logit,
    # also where the mask is added before the scaling (CodeGen in transformers 5.17:
    # `(q.k + mask) / sqrt(head_dim)`), which divides it by up to the head size.
    floor = torch.finfo(site.q.meta["val"].dtype).min / (2 * site.q.meta["val"].shape[-1])
    allowed = bias > floor
    rows = torch.arange(t, device=bias.device)
    causal = rows[None, :] <= rows[:, None]
    if (allowed & ~causal).any():
        raise InlineAttentionError(f"an attention mask that lets a token see later tokens (bidirectional "
                                   f"attention is not supported; {site.where})")
    window = int(allowed[:, -1].sum(-1).max())
    window = 0 if window == t else window
    expected = causal if window == 0 else causal & (rows[None, :] > rows[:, None] - window)
    if not torch.equal(allowed, expected[None].expand_as(allowed)):
        raise InlineAttentionError(f"an attention mask that is neither causal nor a causal sliding window "
                                   f"({site.where})")
    finite = bias[allowed]
    tolerance = 1e-6 + 64 * torch.finfo(torch.float32).eps * (1.0 + float(finite.abs().max()))
    large = _PROBE_PRODUCTS[2]
    steps = (at_large - bias)[allowed] / large
    scale = float(steps.mean())
    if float((steps - scale).abs().max()) > 4 * tolerance / large \
            or float(((at_one - bias)[allowed] - scale).abs().max()) > 4 * tolerance:
        raise InlineAttentionError(f"attention logits that are not a scaled q.k product plus a bias (soft-capping "
                                   f"or another non-linear transform written inline; {site.where})")
    distance = (rows[None, :] - rows[:, None]).float()  # k_pos - q_pos
    last = allowed[0, -1]
    d_last = distance[-1][last]
    b_last = bias[:, -1][:, last]
    centered = d_last - d_last.mean()
    slopes = ((b_last - b_last.mean(-1, keepdim=True)) * centered).sum(-1) / centered.square().sum().clamp_min(1e-12)
    residual = torch.where(allowed, bias - slopes[:, None, None] * distance, 0.0)
    diagonal = residual.diagonal(dim1=1, dim2=2)[:, :, None]
    if ((residual - diagonal).abs() * allowed).max() > tolerance:
        raise InlineAttentionError(f"an attention bias that is neither a causal mask nor ALiBi "
                                   f"(slope * (k_pos - q_pos)) ({site.where})")
    if float(slopes.abs().max()) <= tolerance / t:
        return scale, window, None
    return scale, window, slopes.float().cpu()


def _fake_like(like: torch.fx.Node, value: torch.Tensor) -> torch.Tensor | None:
    mode = torch._guards.detect_fake_mode([like.meta.get("val")])
    return mode.from_tensor(value) if mode is not None else None


def _fake_call(node: torch.fx.Node) -> torch.Tensor | None:
    """The node's output as a fake tensor, from its inputs' (so later passes see shapes)."""
    vals = [n.meta.get("val") for n in node.all_input_nodes]
    mode = torch._guards.detect_fake_mode(vals)
    if mode is None:
        return None
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    with mode:
        return node.target(*args, **kwargs)


def _replace(graph: torch.fx.Graph, site: AttentionSite, layer_idx: int, scale: float, window: int,
             slopes: torch.fx.Node | None) -> None:
    """Token-major q/k/v into the marker, its [T, H, D] output back into the site's layout."""
    q_val, k_val, out_val = site.q.meta["val"], site.k.meta["val"], site.output.meta["val"]
    head_dim = int(q_val.shape[-1])
    heads = math.prod(int(s) for s in q_val.shape[:-2])
    kv_heads = math.prod(int(s) for s in (k_val.shape[:-2]))
    if heads % kv_heads:
        raise InlineAttentionError(f"{heads} query heads over {kv_heads} key heads ({site.where})")
    new: list[torch.fx.Node] = []

    def call(target, *args) -> torch.fx.Node:
        node = graph.call_function(target, args)
        node.meta.update({k: v for k, v in site.output.meta.items() if k in ("nn_module_stack", "stack_trace")})
        node.meta["val"] = _fake_call(node)
        new.append(node)
        return node

    with graph.inserting_before(site.output):
        q = call(aten.transpose.int, call(aten.reshape.default, site.q, [heads, -1, head_dim]), 0, 1)
        k = site.k
        if site.k_transposed:
            k = call(aten.transpose.int, k, -1, -2)
        k = call(aten.transpose.int, call(aten.reshape.default, k, [kv_heads, -1, head_dim]), 0, 1)
        v = call(aten.transpose.int, call(aten.reshape.default, site.v, [kv_heads, -1, head_dim]), 0, 1)
        args = (q, k, v, layer_idx, scale, window, 0.0) + ((slopes,) if slopes is not None else ())
        out = call(torch.ops.kiln.attention.default, *args)
        lead = [int(s) for s in out_val.shape[:-2]]
        back = call(aten.reshape.default, call(aten.transpose.int, out, 0, 1), [*lead, -1, head_dim])
        if out_val.dtype != q_val.dtype:
            back = call(aten.to.dtype, back, out_val.dtype)
    site.output.replace_all_uses_with(back)


def _drop_dead(graph: torch.fx.Graph) -> None:
    """Remove what only the replaced attention used (its softmax, bias and mask subgraphs).

    Not `eliminate_dead_code`: FX counts dropout (random) and export's metadata asserts as
    impure, which would keep every dead softmax alive. Live here: what the output or an
    in-place op needs; other side-effecting nodes (asserts) stay where all they check is live."""
    def mutates(n: torch.fx.Node) -> bool:
        return isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable

    live: set[torch.fx.Node] = set()
    stack = [n for n in graph.nodes if n.op in ("output", "placeholder") or (n.op == "call_function" and mutates(n))]
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
    for node in graph.nodes:
        if node not in live and node.op == "call_function" and node.is_impure() \
                and node.all_input_nodes and all(a in live for a in node.all_input_nodes):
            live.add(node)
    for node in reversed(list(graph.nodes)):
        if node not in live:
            graph.erase_node(node)

