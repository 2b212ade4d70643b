"""The model runner: turns a scheduled step into graph inputs, runs the graph, returns logits.

The graph's inputs are fed by role (see `kiln.compiler.capture`): weights by parameter name,
config-derived constants, one KV cache per layer, and the step's batch tensors. With
compiled artifacts, each step is padded to its bucket (kiln.compiler.buckets): decode
steps to the next decode bucket, other steps to the next token bucket.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from kiln.compiler.buckets import Bucket, BucketPlan, decode_bucket
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.scheduler import SchedulerOutput

logger = logging.getLogger("kiln.runtime")


@dataclass
class StepInputs:
    """The batch tensors of one step (token-major, packed)."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    logits_indices: torch.Tensor  # [S] int64: the rows to sample

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.__dict__)


def prepare_step_inputs(step: SchedulerOutput, block_manager: BlockManager, device: torch.device | str) -> StepInputs:
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    sample_rows: list[int] = []
    tables = []
    for item in step.scheduled:
        seq, n = item.seq, item.num_new_tokens
        begin = seq.num_computed_tokens
        ids = seq.all_token_ids[begin:begin + n]
        # A continuation step (async scheduling) computes a token still on the device: its
        # id is a placeholder here, and the runner takes the real one from the device.
        tokens.extend(ids if len(ids) == n else ids + [0] * (n - len(ids)))
        positions.extend(range(begin, begin + n))
        slots.extend(block_manager.slot(seq, p) for p in range(begin, begin + n))
        seq_lens.append(begin + n)
        starts.append(starts[-1] + n)
        if item.samples:
            sample_rows.append(starts[-1] - 1)
        tables.append(seq.block_table)
    width = max(1, max(len(t) for t in tables))
    # One tensor from padded rows (0 is the null block): one call instead of one per row.
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)

    def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype)

    inputs = StepInputs(
        input_ids=t(tokens, torch.long).unsqueeze(0),
        position_ids=t(positions, torch.long).unsqueeze(0),
        slot_mapping=t(slots, torch.long),
        block_tables=block_tables,
        seq_lens=t(seq_lens, torch.int32),
        query_start_loc=t(starts, torch.int32),
        logits_indices=t(sample_rows, torch.long),
    )
    return StepInputs(**{k: v.to(device, non_blocking=True) for k, v in inputs.as_dict().items()})


def pad_step_inputs(inputs: StepInputs, bucket: Bucket) -> StepInputs:
    """`inputs` padded to `bucket`'s static shapes, so that its artifact can run them.

    Padded tokens are token 0 at position 0 and write their K/V to slot 0, in the null block
    no sequence owns. Padded sequence rows have length 0 and no new tokens (query_start_loc
    repeats its last offset), so attention skips them; padded logits rows point at row 0
    and are cut off by the runner, so nothing padded is ever sampled. Block tables keep
    their width: it is a dynamic dimension of every artifact.
    """
    pad_t = bucket.num_tokens - inputs.input_ids.shape[1]
    pad_b = bucket.num_seqs - inputs.seq_lens.shape[0]
    pad_s = bucket.num_samples - inputs.logits_indices.shape[0]
    if pad_t < 0 or pad_b < 0 or pad_s < 0:
        raise ValueError(
            f"a step of {inputs.input_ids.shape[1]} tokens, {inputs.seq_lens.shape[0]} sequences and "
            f"{inputs.logits_indices.shape[0]} sampled rows does not fit bucket {bucket.name}"
        )
    if pad_t == pad_b == pad_s == 0:
        return inputs
    qsl = inputs.query_start_loc
    return StepInputs(
        input_ids=F.pad(inputs.input_ids, (0, pad_t)),
        position_ids=F.pad(inputs.position_ids, (0, pad_t)),
        slot_mapping=F.pad(inputs.slot_mapping, (0, pad_t)),  # slot 0: the null block
        block_tables=F.pad(inputs.block_tables, (0, 0, 0, pad_b)),
        seq_lens=F.pad(inputs.seq_lens, (0, pad_b)),
        query_start_loc=torch.cat([qsl, qsl[-1:].expand(pad_b)]),
        logits_indices=F.pad(inputs.logits_indices, (0, pad_s)),
    )


@dataclass
class DecodeStaging:
    """The batch inputs of one captured decode graph: device views the graph reads, packed
    by dtype into two flat buffers, and pinned host mirrors of them.

    A step writes its (CPU) inputs into the host views and issues one asynchronous copy per
    dtype, instead of one synchronous copy per tensor from pageable memory. The pinned
    buffers are reused every step, so `upload` first waits for the previous upload's copies
    (long done in practice: they ran ahead of the step before, which has been read back).
    """

    device: dict[str, torch.Tensor]
    host: dict[str, torch.Tensor]
    device_flat: list[torch.Tensor]
    host_flat: list[torch.Tensor]
    copied: Any  # torch.cuda.Event recorded after the last upload's copies

    @staticmethod
    def allocate(batch: int, max_blocks_per_seq: int, device: torch.device) -> "DecodeStaging":
        layout = {  # name -> (dtype, shape, initial value)
            "input_ids": (torch.long, (1, batch), 0),
            "position_ids": (torch.long, (1, batch), 0),
            "slot_mapping": (torch.long, (batch,), 0),  # slot 0: the null block
            "logits_indices": (torch.long, (batch,), None),  # arange
            "block_tables": (torch.int32, (batch, max_blocks_per_seq), 0),
            "seq_lens": (torch.int32, (batch,), 1),
            "query_start_loc": (torch.int32, (batch + 1,), None),  # arange
        }
        dev_views: dict[str, torch.Tensor] = {}
        host_views: dict[str, torch.Tensor] = {}
        dev_flat, host_flat = [], []
        for dtype in (torch.long, torch.int32):
            names = [n for n, (dt, _, _) in layout.items() if dt == dtype]
            total = sum(math.prod(layout[n][1]) for n in names)
            d = torch.zeros(total, dtype=dtype, device=device)
            h = torch.zeros(total, dtype=dtype).pin_memory()
            offset = 0
            for n in names:
                _, shape, init = layout[n]
                size = math.prod(shape)
                dv = d[offset:offset + size].view(shape)
                hv = h[offset:offset + size].view(shape)
                if init is None:
                    hv.copy_(torch.arange(size, dtype=dtype).view(shape))
                else:
                    hv.fill_(init)
                dev_views[n], host_views[n] = dv, hv
                offset += size
            d.copy_(h)
            dev_flat.append(d)
            host_flat.append(h)
        event = torch.cuda.Event()
        event.record()
        return DecodeStaging(dev_views, host_views, dev_flat, host_flat, event)

    def upload(self, inputs: StepInputs) -> None:
        """Copy a step's CPU inputs (padded to this batch) into the graph's device buffers."""
        self.copied.synchronize()
        for name, value in inputs.as_dict().items():
            view = self.host[name]
            if value.shape == view.shape:
                view.copy_(value)
            else:  # block tables narrower than max_model_len's: pad with the null block
                view.zero_()
                view[tuple(slice(0, n) for n in value.shape)].copy_(value)
        for d, h in zip(self.device_flat, self.host_flat):
            d.copy_(h, non_blocking=True)
        self.copied.record()


class ModelRunner:
    """Holds the runnable graph, weights, constants and KV caches; runs one step.

    Two ways to run: `graph_fn`, the post-pass FX graph called as is at the step's exact
    shapes (eager mode), or `bucket_fns`, one compiled artifact per bucket of `plan`, for
    which each step is padded to its bucket (`pad_step_inputs`).
    """

    def __init__(
        self,
        graph_fn: Callable[..., Any] | None,
        input_roles: list[str],
        weights: dict[str, torch.Tensor],
        constants: dict[str, torch.Tensor],
        kv_caches: list[torch.Tensor],
        device: torch.device,
        *,
        bucket_fns: dict[Bucket, Callable[[list[torch.Tensor]], torch.Tensor]] | None = None,
        plan: BucketPlan | None = None,
    ):
        if (graph_fn is None) == (bucket_fns is None):
            raise ValueError("ModelRunner takes either graph_fn (eager) or bucket_fns with a plan (compiled)")
        if bucket_fns is not None:
            if plan is None:
                raise ValueError("ModelRunner: bucket_fns need the bucket plan they were compiled for")
            absent = [b.name for b in plan.buckets() if b not in bucket_fns]
            if absent:
                raise ValueError(f"ModelRunner: no artifact for bucket(s) {', '.join(absent)}")
        self.graph_fn = graph_fn
        self.bucket_fns = bucket_fns
        self.plan = plan
        self.input_roles = input_roles
        self.kv_caches = kv_caches
        self.device = device
        self.bucket_counts: dict[str, int] = {}  # steps run per bucket (for stats and tests)
        # Fixed inputs resolved once; batch inputs are filled per step.
        self._fixed: list[torch.Tensor | None] = []
        self._batch_slots: list[tuple[int, str]] = []
        for i, role in enumerate(input_roles):
            kind, _, name = role.partition(":")
            if kind == "param":
                if name not in weights:
                    raise ValueError(f"graph input {role!r} has no loaded weight named {name!r}")
                w = weights[name]
                # Compiled artifacts assume the dense strides they were traced with.
                self._fixed.append(w.contiguous() if bucket_fns is not None else w)
            elif kind == "constant":
                self._fixed.append(constants[name].to(device))
            elif kind == "kv_cache":
                self._fixed.append(kv_caches[int(name)])
            elif kind == "batch":
                self._fixed.append(None)
                self._batch_slots.append((i, name))
            else:
                raise ValueError(f"graph input role {role!r} is unknown to the runner")

    def twin(
        self,
        graph_fn: Callable[..., Any] | None = None,
        input_roles: list[str] | None = None,
        *,
        bucket_fns: dict[Bucket, Callable[[list[torch.Tensor]], torch.Tensor]] | None = None,
        plan: BucketPlan | None = None,
    ) -> "ModelRunner":
        """Another way of running the same model over this runner's weights and KV caches:
        e.g. the post-pass FX graph eagerly, to check compiled artifacts against it."""
        roles = self.input_roles if input_roles is None else input_roles
        if roles != self.input_roles:
            raise ValueError("ModelRunner.twin: the graph's inputs differ from this runner's")
        named = {role.partition(":")[2]: t for role, t in zip(self.input_roles, self._fixed) if t is not None}
        return ModelRunner(graph_fn, roles, named, named, self.kv_caches, self.device, bucket_fns=bucket_fns, plan=plan)

    # ---- CUDA graphs for decode steps ------------------------------------------------------
    def _step_fn(self, bucket: Bucket) -> Callable[..., Any]:
        """The callable that runs a step of `bucket`'s shape, taking the batch tensors by name."""
        if self.bucket_fns is not None:
            compiled = self.bucket_fns.get(bucket)
            if compiled is None:
                raise ValueError(f"no compiled artifact for bucket {bucket.name} to capture")
            run: Callable[..., Any] = lambda *args: compiled(list(args))  # noqa: E731
        else:
            assert self.graph_fn is not None
            run = self.graph_fn

        def step(**batch: torch.Tensor) -> torch.Tensor:
            args = list(self._fixed)
            for i, name in self._batch_slots:
                args[i] = batch[name]
            out = run(*args)
            return out[0] if isinstance(out, (tuple, list)) else out

        return step

    @torch.inference_mode()
    def capture_decode_graphs(self, sizes: list[int], max_blocks_per_seq: int) -> dict[str, float]:
        """Capture one CUDA graph per decode bucket (largest first, one memory pool).

        A decode step then costs one graph replay: the whole model, attention included,
        without a Python op dispatch per layer. Block tables are captured at their full
        width (max_model_len / block_size) so that one graph serves every context length.
        Each graph's batch inputs live in two flat device buffers (int64 and int32) mirrored
        by pinned host buffers, so a step's inputs reach the GPU in two asynchronous copies
        (`DecodeStaging`). Returns the seconds each capture took, by bucket name.
        """
        from kiln.runtime.cuda_graphs import BucketGraphs

        graphs = BucketGraphs(self.device)
        self._decode_staging = {b: DecodeStaging.allocate(b, max_blocks_per_seq, self.device) for b in sizes}
        static = {b: self._decode_staging[b].device for b in sizes}
        graphs.capture_all({b: self._step_fn(decode_bucket(b)) for b in sizes}, static)
        self._decode_graphs = graphs
        self._decode_graph_sizes = sorted(sizes)
        return {decode_bucket(b).name: s for b, s in graphs.capture_seconds.items()}

    def _replay_decode(self, inputs: StepInputs, input_ids: torch.Tensor | None) -> torch.Tensor | None:
        graphs = getattr(self, "_decode_graphs", None)
        if graphs is None:
            return None
        t, b, s = inputs.input_ids.shape[1], inputs.seq_lens.shape[0], inputs.logits_indices.shape[0]
        if not (t == b == s):
            return None  # prefill or mixed step: run the bucket's artifact (or the FX graph) directly
        size = next((n for n in self._decode_graph_sizes if n >= b), None)
        if size is None:
            return None
        padded = pad_step_inputs(inputs, decode_bucket(size))
        self.bucket_counts[f"cudagraph-decode-{size}"] = self.bucket_counts.get(f"cudagraph-decode-{size}", 0) + 1
        staging = self._decode_staging[size]
        if padded.input_ids.device.type == "cpu":
            staging.upload(padded)  # two async copies through pinned memory
            if input_ids is not None:  # after the upload on the stream: it overwrites the placeholders
                staging.device["input_ids"][0, : input_ids.shape[0]].copy_(input_ids)
            logits = graphs.replay(size, {})
        else:  # already on the device (callers that built device inputs): copy buffer by buffer
            if input_ids is not None:
                padded.input_ids[0, : input_ids.shape[0]].copy_(input_ids)
            logits = graphs.replay(size, padded.as_dict())
        return logits[0, :s].float()  # a copy: the static output is overwritten by the next replay

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns logits [S, V] (float32) for the rows in `logits_indices`.

        `input_ids` ([T] int64, on the device) replaces `inputs.input_ids`: a continuation
        step's tokens are the previous step's samples, which never visit the host first.
        """
        if input_ids is not None and input_ids.shape[0] != inputs.input_ids.shape[1]:
            raise ValueError(f"{input_ids.shape[0]} device input ids for a step of {inputs.input_ids.shape[1]} tokens")
        replayed = self._replay_decode(inputs, input_ids)
        if replayed is not None:
            return replayed
        if inputs.input_ids.device.type != self.device.type:
            inputs = StepInputs(**{k: v.to(self.device, non_blocking=True) for k, v in inputs.as_dict().items()})
        if input_ids is not None:
            inputs = dataclasses.replace(inputs, input_ids=input_ids.view(1, -1).to(inputs.input_ids.dtype))
        num_samples = inputs.logits_indices.shape[0]
        fn: Callable[..., Any]
        if self.bucket_fns is not None:
            assert self.plan is not None  # checked in __init__
            bucket = self.plan.bucket_for(inputs.input_ids.shape[1], inputs.seq_lens.shape[0])
            inputs = pad_step_inputs(inputs, bucket)
            self.bucket_counts[bucket.name] = self.bucket_counts.get(bucket.name, 0) + 1
            compiled = self.bucket_fns[bucket]
            fn = lambda *args: compiled(list(args))  # noqa: E731
        else:
            assert self.graph_fn is not None
            fn = self.graph_fn
        args = list(self._fixed)
        batch = inputs.as_dict()
        for i, name in self._batch_slots:
            args[i] = batch[name]
        logits = fn(*args)
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        return logits[0, :num_samples].float()


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> list[torch.Tensor]:
    caches = []
    for _ in range(num_layers):
        # Uninitialised: attention only reads slots a sequence has written. The null block
        # (padding's target) is zeroed so padded rows never see NaN garbage.
        cache = torch.empty((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        cache[:, 0].zero_()
        caches.append(cache)
    return caches


@torch.inference_mode()
def profile_step_memory(runner: ModelRunner, num_tokens: int, block_size: int) -> int:
    """Peak bytes a step of `num_tokens` tokens (one prefill) allocates beyond what is held.

    Every token writes to the null slot and attends over the null block, so the profile
    needs no real KV cache beyond block 0; the activations are those of a real step.
    """
    dev = runner.device
    blocks = -(-num_tokens // block_size)
    inputs = StepInputs(
        input_ids=torch.zeros((1, num_tokens), dtype=torch.long, device=dev),
        position_ids=torch.arange(num_tokens, device=dev).unsqueeze(0),
        slot_mapping=torch.zeros((num_tokens,), dtype=torch.long, device=dev),
        block_tables=torch.zeros((1, blocks), dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
        logits_indices=torch.tensor([num_tokens - 1], device=dev),
    )
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    runner.execute(inputs)
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - before
