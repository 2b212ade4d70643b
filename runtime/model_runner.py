"""The model runner: turns a scheduled step into graph inputs, runs the graph, returns logits.

The graph's inputs are fed by role (see `kiln.compiler.capture`): weights by parameter name,
config-derived constants, one KV cache per layer, and the step's batch tensors. With
compiled artifacts, each step is padded to its bucket (kiln.compiler.buckets): decode
steps to the next decode bucket, other steps to the next token bucket.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from kiln.compiler.buckets import Bucket, BucketPlan, decode_bucket, mixed_bucket
from kiln.compiler.graph_inputs import (
    BATCH_INPUTS, StepInputs, batch_slots, bind, bucket_sizes, copy_into, empty_step, single_prefill_step,
)
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.scheduler import SchedulerOutput

logger = logging.getLogger("kiln.runtime")


def prompt_logprob_positions(seq: Any, begin: int, num_new_tokens: int) -> range:
    """Positions p of this chunk whose logits give the logprob of prompt token p + 1
    (requests with `prompt_logprobs` only; the last prompt position is the sampled row)."""
    if seq.params.prompt_logprobs is None:
        return range(0)
    return range(begin, min(begin + num_new_tokens, seq.num_prompt_tokens - 1))


def prepare_step_inputs(step: SchedulerOutput, block_manager: BlockManager, device: torch.device | str) -> StepInputs:
    # One pass over the scheduled sequences collects per-sequence numbers and the token ids;
    # per-token arrays (positions, slots, logits rows) are then computed with numpy and shared
    # with torch, not built as Python lists (torch.tensor over 16k-element lists was most of
    # the time): 13.7 -> 4.0 ms for a 16k-token mixed step of 900 decodes and 30 prompts on
    # CI's CPU. A mixed step's inputs are host time the GPU waits through (K1: 12.0 ms a step).
    num_seqs = len(step.scheduled)
    tokens: list[int] = []
    begins = np.empty(num_seqs, dtype=np.int64)
    counts = np.empty(num_seqs, dtype=np.int64)
    samples = np.zeros(num_seqs, dtype=bool)
    prompt_chunks: list[tuple[int, range]] = []  # SamplingParams.prompt_logprobs: see `prompt_logprob_rows`
    tables = []
    for i, item in enumerate(step.scheduled):
        seq, n = item.seq, item.num_new_tokens
        begin = seq.num_computed_tokens
        ids = seq.all_token_ids[begin:begin + n]
        # A continuation step (async scheduling) computes a token still on the device: its
        # id is a placeholder here, and the runner takes the real one from the device.
        tokens.extend(ids if len(ids) == n else ids + [0] * (n - len(ids)))
        begins[i], counts[i], samples[i] = begin, n, item.samples
        chunk = prompt_logprob_positions(seq, begin, n)
        if chunk:
            prompt_chunks.append((i, chunk))
        tables.append(seq.block_table)
    starts = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    num_tokens = int(starts[-1])
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(starts[:-1] - begins, counts)
    prompt_rows = [int(starts[i]) + (p - int(begins[i])) for i, chunk in prompt_chunks for p in chunk]
    logits_indices = np.concatenate([starts[1:][samples] - 1, np.asarray(prompt_rows, dtype=np.int64)])
    # Block tables: one flat array scattered into the padded rows (0 is the null block), and
    # the slots gathered from them in one indexing op.
    lengths = np.fromiter((len(t) for t in tables), dtype=np.int64, count=num_seqs)
    width = max(1, int(lengths.max(initial=0)))
    block_tables = np.zeros((num_seqs, width), dtype=np.int32)
    block_tables[np.arange(width) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=np.int32, count=int(lengths.sum()))
    bs = block_manager.block_size
    rows = np.repeat(np.arange(num_seqs), counts)
    slot_mapping = block_tables[rows, positions // bs].astype(np.int64) * bs + positions % bs

    inputs = StepInputs(
        input_ids=torch.from_numpy(np.fromiter(tokens, dtype=np.int64, count=num_tokens)).unsqueeze(0),
        position_ids=torch.from_numpy(positions).unsqueeze(0),
        slot_mapping=torch.from_numpy(slot_mapping),
        block_tables=torch.from_numpy(block_tables),
        seq_lens=torch.from_numpy((begins + counts).astype(np.int32)),
        query_start_loc=torch.from_numpy(starts.astype(np.int32)),
        # Sampled rows first (the sampler takes one per sampling sequence), then prompt rows.
        logits_indices=torch.from_numpy(logits_indices),
        # Rows of the recurrent layers' state caches (all the null slot 0 for other models).
        state_slots=torch.from_numpy(
            np.fromiter((item.seq.state_slot for item in step.scheduled), dtype=np.int32, count=num_seqs)
            if block_manager.num_state_slots else np.zeros(num_seqs, dtype=np.int32)),
    )
    # Inputs a pass added that the scheduler knows nothing of hold their empty-step value.
    sizes = bucket_sizes(num_tokens, num_seqs, len(logits_indices), width)
    for name, spec in BATCH_INPUTS.items():
        if name not in inputs:
            inputs[name] = spec.empty_step_value(sizes)
    return inputs.to(device)


def pad_step_inputs(inputs: StepInputs, bucket: Bucket) -> StepInputs:
    """`inputs` padded to `bucket`'s static shapes, so that its artifact can run them.

    Padded tokens are token 0 at position 0 and write their K/V to slot 0, in the null block
    no sequence owns. Padded sequence rows have length 0 and no new tokens (query_start_loc
    repeats its last offset), so attention skips them; padded logits rows point at row 0
    and are cut off by the runner, so nothing padded is ever sampled. Block tables keep
    their width: it is a dynamic dimension of every artifact.
    """
    if (inputs.num_tokens > bucket.num_tokens or inputs.num_seqs > bucket.num_seqs
            or inputs.num_samples > bucket.num_samples):
        raise ValueError(
            f"a step of {inputs.num_tokens} tokens, {inputs.num_seqs} sequences and "
            f"{inputs.num_samples} sampled rows does not fit bucket {bucket.name}"
        )
    return inputs.padded(bucket.num_tokens, bucket.num_seqs, bucket.num_samples)


@dataclass
class StepStaging:
    """The batch inputs of one captured graph (a decode or mixed bucket): device views the
    graph reads, packed by dtype into two flat buffers, and pinned host mirrors of them.

    A step writes its (CPU) inputs into the host views and issues one asynchronous copy per
    dtype, instead of one synchronous copy per tensor from pageable memory. The pinned
    buffers are reused every step, so `upload` first waits for the previous upload's copies
    (long done in practice: they ran ahead of the step before, which has been read back).
    """

    device: dict[str, torch.Tensor]
    host: dict[str, torch.Tensor]
    device_flat: list[torch.Tensor]
    host_flat: list[torch.Tensor]
    copied: Any  # torch.cuda.Event recorded after the last upload's copies (None on CPU)

    @staticmethod
    def allocate(bucket: Bucket, max_blocks_per_seq: int, device: torch.device) -> "StepStaging":
        # One flat buffer per dtype: a step's inputs reach the device in one copy per dtype.
        initial = empty_step(bucket_sizes(bucket.num_tokens, bucket.num_seqs, bucket.num_samples, max_blocks_per_seq))
        dev_views: dict[str, torch.Tensor] = {}
        host_views: dict[str, torch.Tensor] = {}
        dev_flat, host_flat = [], []
        for dtype in dict.fromkeys(spec.dtype for spec in BATCH_INPUTS.values()):
            names = [n for n, spec in BATCH_INPUTS.items() if spec.dtype == dtype]
            total = sum(initial[n].numel() for n in names)
            d = torch.zeros(total, dtype=dtype, device=device)
            h = torch.zeros(total, dtype=dtype)
            h = h.pin_memory() if device.type == "cuda" else h
            offset = 0
            for n in names:
                size = initial[n].numel()
                dev_views[n] = d[offset:offset + size].view(initial[n].shape)
                host_views[n] = h[offset:offset + size].view(initial[n].shape)
                host_views[n].copy_(initial[n])
                offset += size
            d.copy_(h)
            dev_flat.append(d)
            host_flat.append(h)
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return StepStaging(dev_views, host_views, dev_flat, host_flat, event)

    def upload(self, inputs: StepInputs) -> None:
        """Copy a step's CPU inputs (padded to this bucket) into the graph's device buffers."""
        if self.copied is not None:
            self.copied.synchronize()
        for name, value in inputs.items():
            # Block tables narrower than max_model_len's are padded with the null block.
            copy_into(self.host[name], value, pad=0)
        for d, h in zip(self.device_flat, self.host_flat):
            d.copy_(h, non_blocking=True)
        if self.copied is not None:
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
        states: dict[str, torch.Tensor] | None = None,
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
        self.states = states or {}  # recurrent layers' state caches by name (kiln.kernels.gated_delta_net)
        self.device = device
        self.bucket_counts: dict[str, int] = {}  # steps run per bucket (for stats and tests)
        # Fixed inputs resolved once; batch inputs are filled per step. Compiled artifacts
        # assume the dense strides they were traced with.
        params = {n: (w.contiguous() if bucket_fns is not None else w) for n, w in weights.items()}
        self._fixed: list[torch.Tensor | None] = bind(
            input_roles, params=params, constants=lambda name: constants[name].to(device), kv_caches=kv_caches,
            states=self.states)
        self._batch_slots = batch_slots(input_roles)

    def param_input(self, name: str) -> torch.Tensor:
        """The tensor bound to the graph input `param:<name>`, as every step reads it (e.g. a
        layer's FP8 KV-cache scales, which start-up calibration sets in place)."""
        role = f"param:{name}"
        if role not in self.input_roles:
            raise KeyError(f"the graph has no input {role!r}")
        tensor = self._fixed[self.input_roles.index(role)]
        assert tensor is not None  # bind() fills every param: input
        return tensor

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
        return ModelRunner(graph_fn, roles, named, named, self.kv_caches, self.device, bucket_fns=bucket_fns, plan=plan,
                           states=self.states)

    # ---- CUDA graphs: decode steps, and mixed steps up to a token count -------------------
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
    def capture_cuda_graphs(self, decode_sizes: Sequence[int], max_blocks_per_seq: int,
                            mixed_sizes: Sequence[int] = (), max_num_seqs: int = 1) -> dict[str, float]:
        """Capture one CUDA graph per decode bucket, then one per mixed bucket (each kind
        largest first, all in one memory pool; kiln.compiler.buckets).

        A decode step then costs one graph replay: the whole model, attention included,
        without a Python op dispatch per layer; so does a mixed step (prefill chunks beside
        decodes) of at most max(mixed_sizes) tokens, padded to its mixed bucket (N tokens,
        min(N - 1, max_num_seqs) sequences and sampled rows). Mixed graphs need the post-pass
        graph itself (graph mode): compiled artifacts exist for the plan's buckets only, so
        with them `mixed_sizes` is ignored. Block tables are captured at their full width
        (max_model_len / block_size) so that one graph serves every context length. Each
        graph's batch inputs live in two flat device buffers (int64 and int32) mirrored by
        pinned host buffers, so a step's inputs reach the GPU in two asynchronous copies
        (`StepStaging`). Returns the seconds each capture took, by bucket name.
        """
        from kiln.runtime.cuda_graphs import BucketGraphs, capture_seconds_by_kind

        if self.bucket_fns is not None and mixed_sizes:
            logger.info("no CUDA graphs for mixed steps: they need the post-pass graph, and this engine runs "
                        "compiled artifacts")
            mixed_sizes = []
        decode = [decode_bucket(b) for b in decode_sizes]
        mixed = sorted((mixed_bucket(t, max_num_seqs) for t in mixed_sizes), key=lambda b: -b.num_tokens)
        graphs = BucketGraphs(self.device)
        self._graph_staging = {b: StepStaging.allocate(b, max_blocks_per_seq, self.device) for b in decode + mixed}
        graphs.capture_all({b: self._step_fn(b) for b in decode}, {b: self._graph_staging[b].device for b in decode},
                           size=lambda b: b.num_seqs)
        captured_mixed: list[Bucket] = []
        for bucket in mixed:  # after the decode graphs: a failure here leaves those as they are
            try:
                graphs.capture(bucket, self._step_fn(bucket), self._graph_staging[bucket].device)
            except Exception as e:  # an op of this model's mixed steps that a graph cannot hold
                torch.cuda.synchronize(self.device)  # (raises if the failure left the device unusable)
                logger.warning("mixed steps run without CUDA graphs: capturing bucket %s failed (%s: %s)",
                               bucket.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
                captured_mixed = []
                break
            captured_mixed.append(bucket)
        for bucket in mixed:
            if bucket not in captured_mixed:
                graphs.buckets.pop(bucket, None)
                graphs.capture_phases.pop(bucket, None)
                self._graph_staging.pop(bucket, None)
        self._graphs = graphs
        self._decode_graph_sizes = sorted(decode_sizes)
        self._mixed_graph_buckets = sorted(captured_mixed, key=lambda b: b.num_tokens)
        seconds = {b.name: s for b, s in graphs.capture_seconds.items()}
        logger.info("captured CUDA graphs: %s", capture_seconds_by_kind(seconds))
        return seconds

    def _graph_bucket(self, num_tokens: int, num_seqs: int, num_samples: int) -> Bucket | None:
        """The captured bucket a step of these sizes replays in, or None (run it without a graph)."""
        if num_tokens == num_seqs == num_samples:
            size = next((n for n in self._decode_graph_sizes if n >= num_seqs), None)
            return None if size is None else decode_bucket(size)
        if num_tokens == num_seqs:
            return None  # decode-shaped but sampling other rows (prompt logprobs): no graph has them
        return next((b for b in self._mixed_graph_buckets
                     if b.fits(num_tokens, num_seqs) and num_samples <= b.num_samples), None)

    def _replay_graph(self, inputs: StepInputs, input_ids: torch.Tensor | None) -> torch.Tensor | None:
        graphs = getattr(self, "_graphs", None)
        if graphs is None:
            return None
        s = inputs.logits_indices.shape[0]
        bucket = self._graph_bucket(inputs.input_ids.shape[1], inputs.seq_lens.shape[0], s)
        if bucket is None:
            return None  # run the bucket's artifact (or the FX graph) directly
        padded = pad_step_inputs(inputs, bucket)
        counter = f"cudagraph-{bucket.name}"
        self.bucket_counts[counter] = self.bucket_counts.get(counter, 0) + 1
        staging = self._graph_staging[bucket]
        if padded.input_ids.device.type == "cpu":
            staging.upload(padded)  # two async copies through pinned memory
            if input_ids is not None:  # after the upload on the stream: it overwrites the placeholders
                staging.device["input_ids"][0, : input_ids.shape[0]].copy_(input_ids)
            logits = graphs.replay(bucket, {})
        else:  # already on the device (callers that built device inputs): copy buffer by buffer
            if input_ids is not None:
                padded.input_ids[0, : input_ids.shape[0]].copy_(input_ids)
            logits = graphs.replay(bucket, padded.as_dict())
        return logits[0, :s].float()  # a copy: the static output is overwritten by the next replay

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns logits [S, V] (float32) for the rows in `logits_indices`.

        `input_ids` ([T] int64, on the device) replaces `inputs.input_ids`: a continuation
        step's tokens are the previous step's samples, which never visit the host first.
        """
        if input_ids is not None and input_ids.shape[0] != inputs.input_ids.shape[1]:
            raise ValueError(f"{input_ids.shape[0]} device input ids for a step of {inputs.input_ids.shape[1]} tokens")
        replayed = self._replay_graph(inputs, input_ids)
        if replayed is not None:
            return replayed
        if inputs.input_ids.device.type != self.device.type:
            inputs = inputs.to(self.device)
        if input_ids is not None:
            inputs = StepInputs(inputs, input_ids=input_ids.view(1, -1).to(inputs.input_ids.dtype))
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
