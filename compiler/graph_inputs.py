"""The graph's calling convention: what each input of a Kiln graph is, and how to feed it.

Every placeholder of a captured (and rewritten) graph carries a role tag in
`node.meta[INPUT_META_KEY]`:

    param:<hf name>      a checkpoint weight (or one a layout pass builds from several)
    constant:<name>      a config-derived buffer kept with the graph (RoPE's inv_freq)
    kv_cache:<layer>     one layer's paged KV cache
    state:<layer>.<part> one recurrent layer's per-sequence state cache (`conv`, `recurrent`)
    batch:<name>         a per-step tensor from `BATCH_INPUTS`

`BATCH_INPUTS` is the one table of batch inputs: name, dtype, shape in bucket dimensions,
the value padded rows get, and the value of a valid empty step. The runner, the bucket
compiler, memory profiling, CUDA-graph staging and the pass-test helpers all read it, and
`bind` is the one function that turns roles plus sources into a graph's argument list.
Adding a batch input is one entry here plus the pass that adds it to the graph.

A leaf: it depends on torch alone, so passes and the runtime can import it cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Mapping, Sequence

import torch

INPUT_META_KEY = "kiln_input"


class RoleKind(str, Enum):
    PARAM = "param"
    CONSTANT = "constant"
    KV_CACHE = "kv_cache"
    STATE = "state"
    BATCH = "batch"


@dataclass(frozen=True)
class InputRole:
    """A parsed role tag: `InputRole.parse("kv_cache:3") == InputRole(RoleKind.KV_CACHE, "3")`."""

    kind: RoleKind
    name: str

    @staticmethod
    def parse(tag: str) -> "InputRole":
        kind, sep, name = tag.partition(":")
        try:
            role_kind = RoleKind(kind)
        except ValueError:
            role_kind = None
        if not sep or not name or role_kind is None:
            kinds = ", ".join(f"{k.value}:<name>" for k in RoleKind)
            raise ValueError(f"graph input role {tag!r} is not one of {kinds}")
        return InputRole(role_kind, name)

    @property
    def tag(self) -> str:
        return f"{self.kind.value}:{self.name}"


def param_role(name: str) -> str:
    return InputRole(RoleKind.PARAM, name).tag


def constant_role(name: str) -> str:
    return InputRole(RoleKind.CONSTANT, name).tag


def kv_cache_role(layer: int) -> str:
    return InputRole(RoleKind.KV_CACHE, str(layer)).tag


def state_role(layer: int, part: str) -> str:
    return InputRole(RoleKind.STATE, f"{layer}.{part}").tag


def batch_role(name: str) -> str:
    if name not in BATCH_INPUTS:
        raise ValueError(f"batch input {name!r} is not declared in kiln.compiler.graph_inputs.BATCH_INPUTS")
    return InputRole(RoleKind.BATCH, name).tag


def role_of(node: torch.fx.Node) -> InputRole | None:
    """The parsed role of a placeholder, or None when it has none."""
    tag = node.meta.get(INPUT_META_KEY)
    return InputRole.parse(tag) if tag is not None else None


def param_name(node: object) -> str | None:
    """The parameter name of a `param:` placeholder (what passes key weight transforms by),
    or None for any other node."""
    if isinstance(node, torch.fx.Node) and node.op == "placeholder":
        role = role_of(node)
        if role is not None and role.kind is RoleKind.PARAM:
            return role.name
    return None


def graph_input_roles(gm: torch.fx.GraphModule) -> list[str]:
    """The role tag of each placeholder, in call order."""
    roles = []
    for node in gm.graph.find_nodes(op="placeholder"):
        role = node.meta.get(INPUT_META_KEY)
        if role is None:
            raise ValueError(f"graph input {node.name!r} has no {INPUT_META_KEY!r} role; a pass added it untagged")
        roles.append(role)
    return roles


def add_graph_input(gm: torch.fx.GraphModule, name: str, role: str, example: torch.Tensor | None = None) -> torch.fx.Node:
    """Append a placeholder (after the existing ones) tagged with its role; an input of the
    same role already there is returned instead, so passes can ask for inputs freely."""
    InputRole.parse(role)
    graph = gm.graph
    existing = {n.meta.get(INPUT_META_KEY): n for n in graph.find_nodes(op="placeholder")}
    if role in existing:
        return existing[role]
    last = list(graph.find_nodes(op="placeholder"))[-1]
    with graph.inserting_after(last):
        node = graph.placeholder(name)
    node.meta[INPUT_META_KEY] = role
    if example is not None:
        node.meta["val"] = example
    return node


# ---- batch inputs ------------------------------------------------------------------------

# Bucket dimensions a batch input's shape is written in.
BUCKET_DIMS = ("1", "T", "B", "B+1", "S", "W")
DIM_DOC = {"1": "one", "T": "tokens of the step", "B": "sequences of the step", "B+1": "sequences + 1",
           "S": "rows sampled", "W": "block-table width (dynamic in every artifact)"}
REPEAT_LAST = "repeat-last"


@dataclass(frozen=True)
class BatchInput:
    """One per-step input of the graph.

    `pad`: the value of the entries a step padded to its bucket gets (token 0 at position 0,
    slot 0 and block 0 are the null block no sequence owns), or REPEAT_LAST for offsets that
    padded rows must leave unchanged (empty rows). `fill`: the value of a valid empty step
    ("zeros", "ones" or "arange"), used for example inputs (compile, capture) and for the
    buffers of captured CUDA graphs before their first step.
    """

    name: str
    dtype: torch.dtype
    dims: tuple[str, ...]
    pad: int | str = 0
    fill: str = "zeros"
    doc: str = ""

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(int(sizes[d]) for d in self.dims)

    def empty_step_value(self, sizes: Mapping[str, int], device: torch.device | str = "cpu") -> torch.Tensor:
        shape = self.shape(sizes)
        if self.fill == "arange":
            numel = 1
            for n in shape:
                numel *= n
            return torch.arange(numel, dtype=self.dtype, device=device).view(shape)
        value = {"zeros": 0, "ones": 1}[self.fill]
        return torch.full(shape, value, dtype=self.dtype, device=device)

    def pad_to(self, value: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """`value` grown to `shape` (each dimension at least as large) with this input's pad."""
        if tuple(value.shape) == tuple(shape):
            return value
        if value.dim() != len(shape) or any(v > s for v, s in zip(value.shape, shape)):
            raise ValueError(f"batch input {self.name!r} of shape {tuple(value.shape)} does not fit {tuple(shape)}")
        if self.pad == REPEAT_LAST:
            extra = shape[0] - value.shape[0]
            return torch.cat([value, value[-1:].expand(extra, *value.shape[1:])])
        out = torch.full(tuple(shape), int(self.pad), dtype=value.dtype, device=value.device)
        out[tuple(slice(0, n) for n in value.shape)] = value
        return out


BATCH_INPUTS: dict[str, BatchInput] = {b.name: b for b in (
    BatchInput("input_ids", torch.long, ("1", "T"), doc="token ids, packed token-major"),
    BatchInput("position_ids", torch.long, ("1", "T"), doc="each token's position in its sequence"),
    BatchInput("slot_mapping", torch.long, ("T",), doc="the KV-cache slot each token writes (0: the null slot)"),
    BatchInput("block_tables", torch.int32, ("B", "W"), doc="each sequence's KV blocks (0: the null block)"),
    BatchInput("seq_lens", torch.int32, ("B",), fill="ones", doc="tokens in the KV cache per sequence, this step's included"),
    BatchInput("query_start_loc", torch.int32, ("B+1",), pad=REPEAT_LAST, fill="arange",
               doc="offset of each sequence's first token in the step"),
    BatchInput("logits_indices", torch.long, ("S",), fill="arange", doc="the rows whose logits are sampled"),
    BatchInput("state_slots", torch.int32, ("B",),
               doc="each sequence's row in the recurrent layers' state caches (0: the null slot)"),
)}


def bucket_sizes(num_tokens: int, num_seqs: int, num_samples: int, block_table_width: int) -> dict[str, int]:
    """The value of every bucket dimension for a step or bucket of these sizes."""
    return {"1": 1, "T": num_tokens, "B": num_seqs, "B+1": num_seqs + 1, "S": num_samples, "W": block_table_width}


def upload(t: torch.Tensor, device: torch.device | str, non_blocking: bool = True) -> torch.Tensor:
    """`t` on `device`. A host tensor bound for a GPU goes through pinned memory, so that the
    copy is queued behind the step in flight instead of waiting for it (async scheduling
    launches the next step while the device still runs this one)."""
    if non_blocking and t.device.type == "cpu" and torch.device(device).type == "cuda" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=non_blocking)


class StepInputs(dict):
    """The batch tensors of one step by `BATCH_INPUTS` name (a dict; `inputs.seq_lens` reads too)."""

    def __getattr__(self, name: str) -> torch.Tensor:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"step has no batch input {name!r}") from None

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(self)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "StepInputs":
        return StepInputs({k: upload(v, device, non_blocking) for k, v in self.items()})

    @property
    def num_tokens(self) -> int:
        return int(self["input_ids"].shape[1])

    @property
    def num_seqs(self) -> int:
        return int(self["seq_lens"].shape[0])

    @property
    def num_samples(self) -> int:
        return int(self["logits_indices"].shape[0])

    def padded(self, num_tokens: int, num_seqs: int, num_samples: int) -> "StepInputs":
        """These inputs grown to a bucket's static sizes with each input's pad (the block
        tables keep their width: it is dynamic in every artifact)."""
        sizes = bucket_sizes(num_tokens, num_seqs, num_samples, int(self["block_tables"].shape[1]))
        return StepInputs({name: BATCH_INPUTS[name].pad_to(value, BATCH_INPUTS[name].shape(sizes))
                           for name, value in self.items()})


def empty_step(sizes: Mapping[str, int], device: torch.device | str = "cpu") -> StepInputs:
    """Every batch input at `sizes` holding a valid empty step (example inputs, buffers)."""
    return StepInputs({name: spec.empty_step_value(sizes, device) for name, spec in BATCH_INPUTS.items()})


def single_prefill_step(num_tokens: int, block_size: int, *, input_ids: torch.Tensor | None = None,
                        null_blocks: bool = False, device: torch.device | str = "cpu") -> StepInputs:
    """One sequence prefilling `num_tokens` tokens and sampling the last.

    Its K/V go to blocks 1.. (block 0 is the null block), or all to the null block with
    `null_blocks` (memory profiling, which has a one-block cache). Inputs of the table this
    function does not know hold their empty-step value.
    """
    n_blocks = -(-num_tokens // block_size)
    step = empty_step(bucket_sizes(num_tokens, 1, 1, n_blocks), device)
    if input_ids is not None:
        step["input_ids"] = input_ids.to(device).view(1, num_tokens)
    step["position_ids"] = torch.arange(num_tokens, device=device).unsqueeze(0)
    if not null_blocks:
        step["slot_mapping"] = torch.arange(block_size, block_size + num_tokens, device=device)
        step["block_tables"] = torch.arange(1, n_blocks + 1, dtype=torch.int32, device=device).unsqueeze(0)
    step["seq_lens"] = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    step["query_start_loc"] = torch.tensor([0, num_tokens], dtype=torch.int32, device=device)
    step["logits_indices"] = torch.tensor([num_tokens - 1], device=device)
    return step


# ---- binding sources to roles -------------------------------------------------------------

Source = Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor]


def _look_up(source: Source | None, name: str, role: str) -> torch.Tensor:
    if source is None:
        raise ValueError(f"graph input {role!r}: no source for {role.partition(':')[0]} inputs was given")
    if callable(source) and not isinstance(source, Mapping):
        return source(name)
    if name not in source:
        raise ValueError(f"graph input {role!r} has no tensor named {name!r} among the {len(source)} given")
    return source[name]


def bind(roles: Sequence[str], *, params: Source | None = None, constants: Source | None = None,
         kv_caches: Source | Sequence[torch.Tensor] | None = None,
         batch: Source | None = None, states: Source | None = None) -> list[torch.Tensor | None]:
    """The graph's argument list: each role's tensor from its source.

    A source is a mapping by name (a kv_cache's name is its layer index; a list of per-layer
    caches works too; a state's name is "<layer>.<part>") or a function of the name. `batch=None` leaves the batch inputs as None
    slots for a caller that fills them per step (`batch_slots`).
    """
    if isinstance(kv_caches, (list, tuple)):
        caches = kv_caches
        kv_caches = lambda layer: caches[int(layer)]  # noqa: E731
    args: list[torch.Tensor | None] = []
    for tag in roles:
        role = InputRole.parse(tag)
        if role.kind is RoleKind.BATCH:
            if role.name not in BATCH_INPUTS:
                raise ValueError(f"graph input {tag!r} is not declared in BATCH_INPUTS")
            args.append(None if batch is None else _look_up(batch, role.name, tag))
            continue
        source = {RoleKind.PARAM: params, RoleKind.CONSTANT: constants, RoleKind.KV_CACHE: kv_caches,
                  RoleKind.STATE: states}[role.kind]
        args.append(_look_up(source, role.name, tag))  # type: ignore[arg-type]
    return args


def batch_slots(roles: Sequence[str]) -> list[tuple[int, str]]:
    """(argument index, batch input name) of every batch input among `roles`."""
    slots = []
    for i, tag in enumerate(roles):
        role = InputRole.parse(tag)
        if role.kind is RoleKind.BATCH:
            slots.append((i, role.name))
    return slots


def copy_into(buffer: torch.Tensor, value: torch.Tensor, pad: int = 0) -> None:
    """Copy `value` into the leading corner of a static `buffer`, `pad` elsewhere (a CUDA
    graph's input buffers are fixed; a step's block tables may be narrower)."""
    if value.shape == buffer.shape:
        buffer.copy_(value, non_blocking=True)
        return
    if value.dim() != buffer.dim() or any(v > b for v, b in zip(value.shape, buffer.shape)):
        raise ValueError(f"a tensor of shape {tuple(value.shape)} does not fit the buffer {tuple(buffer.shape)}")
    buffer.fill_(pad)
    buffer[tuple(slice(0, n) for n in value.shape)].copy_(value, non_blocking=True)
