"""CUDA graphs per bucket: capture once at start-up, then each step copies and replays.

    graphs = BucketGraphs(device)
    graphs.capture_all(step_fns, {bucket: static_inputs, ...}, size=lambda b: b.num_tokens)
    out = graphs.replay(bucket, {"input_ids": ids, ...})          # copy into buffers, replay

`step_fns[bucket](**static_inputs)` is the whole step of that bucket (its compiled
artifact with the weights, KV caches and constants bound; one callable may serve every
bucket), and `static_inputs[bucket]` holds the bucket's batch buffers, allocated at its
shapes (block tables at their full width, max_model_len / block_size). Every graph is
captured into one memory pool, largest bucket first, so the smaller graphs' temporaries
reuse the largest one's memory: the pool costs what the largest bucket needs, not the sum.

Inputs given to `replay` should already be padded to the bucket (the runner's
`pad_step_inputs`: query_start_loc repeats its last offset for padded rows, which no fill
value could express). What replay still pads is a tensor smaller than its buffer in some
dimension, in practice the block table's width: it is copied into the buffer's leading
corner and the rest filled with that buffer's pad value (0 unless given at capture: block
0 is the null block). The returned output is the graph's static output tensor: the next
replay of the same bucket overwrites it, so read (or copy) it before then.

Warm-up runs happen on a side stream before each capture: they compile Triton kernels and
initialise cuBLAS workspaces, which must not happen during capture. One run does all of
that (a second cost ~40 ms per bucket of start-up and changed nothing on the H200).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Mapping

import torch

from kiln.compiler.graph_inputs import copy_into

logger = logging.getLogger("kiln.runtime")


class CudaGraphError(RuntimeError):
    """A bucket or input the captured graphs cannot serve; the message says which."""


@dataclass
class CapturedBucket:
    """One bucket's graph, the buffers it reads, and the output it writes."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    output: Any
    pad_values: dict[str, int] = field(default_factory=dict)


class BucketGraphs:
    """One CUDA graph per bucket, sharing one memory pool."""

    def __init__(self, device: torch.device | str, warmup_runs: int = 1):
        device = torch.device(device)
        if device.type != "cuda":
            raise CudaGraphError(f"CUDA graphs need a CUDA device, not {device}")
        # "cuda" means the current device; tensors always name their index ("cuda:0"), so
        # pin it here or every device comparison below would fail.
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.warmup_runs = warmup_runs
        self.pool = torch.cuda.graph_pool_handle()
        self.buckets: dict[Hashable, CapturedBucket] = {}
        # Each capture's seconds by phase: the warm-up run (the device's time included), the
        # capture itself (host), the synchronize after it (bench/profile_capture.py reads them).
        self.capture_phases: dict[Hashable, dict[str, float]] = {}

    def __contains__(self, bucket: Hashable) -> bool:
        return bucket in self.buckets

    @property
    def capture_seconds(self) -> dict[Hashable, float]:
        """Each captured bucket's capture seconds, its phases summed."""
        return {bucket: sum(phases.values()) for bucket, phases in self.capture_phases.items()}

    def capture_all(
        self,
        step_fns: Callable[..., Any] | Mapping[Hashable, Callable[..., Any]],
        static_inputs: Mapping[Hashable, dict[str, torch.Tensor]],
        pad_values: Mapping[str, int] | None = None,
        size: Callable[[Hashable], Any] | None = None,
    ) -> None:
        """Capture every bucket, largest first (by `size(bucket)`, default the bucket itself)."""
        order = sorted(static_inputs, key=size or (lambda b: b), reverse=True)
        for bucket in order:
            fn = step_fns[bucket] if isinstance(step_fns, Mapping) else step_fns
            self.capture(bucket, fn, static_inputs[bucket], pad_values)
        seconds = self.capture_seconds
        logger.info("captured %d CUDA graphs in %.2fs (%s)", len(order), sum(seconds[b] for b in order),
                    ", ".join(f"{b}: {seconds[b]:.2f}s" for b in order))

    @torch.inference_mode()
    def capture(self, bucket: Hashable, step_fn: Callable[..., Any], inputs: dict[str, torch.Tensor],
                pad_values: Mapping[str, int] | None = None) -> None:
        for name, buf in inputs.items():
            if buf.device != self.device:
                raise CudaGraphError(f"bucket {bucket}: static input {name!r} is on {buf.device}, not {self.device}")
        start = time.perf_counter()
        with torch.cuda.device(self.device):  # capture on our device even if another is current
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup_runs):
                    step_fn(**inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            # (The warm-up's device time ends here, so that the phases below are the host's.)
            torch.cuda.synchronize(self.device)
            warmed = time.perf_counter()
            graph = torch.cuda.CUDAGraph()
            # Entering also synchronizes, collects garbage and empties the allocator's cache;
            # leaving ends the capture and instantiates the graph.
            with torch.cuda.graph(graph, pool=self.pool):
                output = step_fn(**inputs)
            captured = time.perf_counter()
            torch.cuda.synchronize(self.device)
        self.buckets[bucket] = CapturedBucket(graph, dict(inputs), output, dict(pad_values or {}))
        end = time.perf_counter()
        self.capture_phases[bucket] = {"warmup": warmed - start, "capture": captured - warmed, "sync": end - captured}

    def replay(self, bucket: Hashable, inputs: Mapping[str, torch.Tensor]) -> Any:
        """Copy `inputs` into the bucket's buffers (padding what they leave) and replay."""
        captured = self.buckets.get(bucket)
        if captured is None:
            raise CudaGraphError(f"no CUDA graph for bucket {bucket!r}; captured: {sorted(self.buckets, key=str)}")
        for name, value in inputs.items():
            buf = captured.inputs.get(name)
            if buf is None:
                raise CudaGraphError(f"bucket {bucket!r} has no static input {name!r}")
            try:
                copy_into(buf, value, captured.pad_values.get(name, 0))
            except ValueError as e:
                raise CudaGraphError(f"bucket {bucket!r}: input {name!r}: {e}") from None
        captured.graph.replay()
        return captured.output


def capture_seconds_by_kind(seconds: Mapping[str, float]) -> str:
    """A start-up log's summary of per-graph capture seconds (by bucket name, `kind-size`):
    per kind the count, the total and the slowest graph, e.g. "decode 28 graphs 2.05s
    (slowest decode-1024 0.21s)". The kinds are told apart so that a start-up that grew
    says which kind grew (bench/RESULTS.md, AQ3 and AR1-AR2)."""
    by_kind: dict[str, dict[str, float]] = {}
    for name, s in seconds.items():
        by_kind.setdefault(name.rsplit("-", 1)[0], {})[name] = s
    parts = []
    for kind, graphs in by_kind.items():
        slowest = max(graphs, key=lambda n: graphs[n])
        parts.append(f"{kind} {len(graphs)} graph{'s' if len(graphs) != 1 else ''} {sum(graphs.values()):.2f}s "
                     f"(slowest {slowest} {graphs[slowest]:.2f}s)")
    return ", ".join(parts) or "none"
