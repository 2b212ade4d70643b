"""The engine: owns the model runner, scheduler and sampler; `step()` is the per-step loop.

    step() = schedule -> prepare inputs -> run the graph -> sample -> update sequences

Start-up (`LLMEngine.__init__`) resolves the model, builds the graph (capture + passes),
loads weights, sizes and allocates the KV cache, and logs how long each phase took.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compiler.model_source import ModelSource, resolve_model
from kiln.compiler.aot import PreparedModel, prepare_for_engine
from kiln.compiler.pipeline import ModelGraph
from kiln.kernels.paged_attention import kv_heads_and_head_dim
from kiln.passes.weight_transforms import apply_weight_transforms
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.model_runner import ModelRunner, allocate_kv_caches, prepare_step_inputs, profile_step_memory
from kiln.runtime.detokenizer import IncrementalDetokenizer, OutputText
from kiln.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from kiln.runtime.sampler import PendingSample, Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from kiln.runtime.sequence import Sequence

logger = logging.getLogger("kiln.runtime")

# KV-cache budget on CPU when the caller gives no num_kv_blocks: a fraction of RAM.
CPU_KV_MEMORY_FRACTION = 0.2


@dataclass
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    enable_passes: list[str] = field(default_factory=list)
    disable_passes: list[str] = field(default_factory=list)
    progress: bool = True
    # Compile and cache (kiln.compiler.aot). compile: "auto" (the device's cached artifact
    # when the cache holds it all, filling misses only if cache_dir or require_cache is
    # given; else eager), "eager", "inductor" (an AOTInductor package per bucket; the CPU
    # artifact) or "graph" (the post-pass FX graph cached as code; the CUDA artifact; see
    # resolve_compile_mode). cache_dir: None for $KILN_CACHE_DIR or the user's cache
    # directory. require_cache: fail at start-up, naming the missing entries, instead of
    # capturing or compiling. *_buckets: None for the default plan.
    compile: str = "auto"
    cache_dir: str | None = None
    require_cache: bool = False
    decode_buckets: list[int] | None = None
    token_buckets: list[int] | None = None
    # CUDA only: fraction of the GPU's memory Kiln may use (weights + activations + KV
    # cache), and whether decode steps replay captured CUDA graphs (False = always eager).
    gpu_memory_utilization: float = 0.9
    cuda_graphs: bool = True
    # Launch the next decode step before reading this one's tokens, so the host's per-step
    # work (reading tokens, stop checks, outputs, scheduling) overlaps the device's
    # (see step()). False: every step is read back before the next is scheduled.
    async_scheduling: bool = True

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} asked for, but CUDA is not available on this machine")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        dtypes = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                  "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if self.dtype not in dtypes:
            raise ValueError(f"dtype must be one of auto, {', '.join(dtypes)}; got {self.dtype!r}")
        return dtypes[self.dtype]


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    # False: step() reports this request only when it finishes (offline generate); building
    # an output copies every completion's tokens, per step, per request: at batch 256 that
    # was most of a decode step's host time.
    every_step: bool = True


@dataclass
class _LaunchedStep:
    """A step running on the device whose sampled tokens have not been read back yet."""

    scheduled: list[ScheduledSequence]
    sampling: list[Sequence]  # the rows of `pending`, in order
    pending: PendingSample | None  # None: no sequence samples (prefill chunks only)

    @property
    def ended(self) -> bool:
        """Every sequence it samples for has ended meanwhile (aborted, stopped)."""
        return all(seq.is_finished for seq in self.sampling)


@dataclass
class EngineStats:
    """A snapshot of the engine's load, for metrics (the server exports these)."""

    num_running: int
    num_waiting: int
    num_kv_blocks: int  # usable blocks (the null block excluded)
    num_used_blocks: int  # owned by live sequences ("KV blocks in use")
    num_cached_blocks: int  # unowned, kept for prefix reuse
    num_free_blocks: int
    kv_usage: float  # num_used_blocks / num_kv_blocks
    prefix_cache_queries: int  # prompt tokens looked up at admission
    prefix_cache_hits: int  # of which were found cached
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_steps: int


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.timings: dict[str, float] = {}
        t0 = time.perf_counter()
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)

        with self._phase("resolve model"):
            self.source: ModelSource = resolve_model(config.model, config.load_format)
            self.model_config = self.source.config
        with self._phase("load tokenizer"):
            self.tokenizer = self.source.tokenizer()
        self.max_model_len = int(config.max_model_len or min(getattr(self.model_config, "max_position_embeddings", 4096), 8192))
        if config.max_num_batched_tokens < 1 or config.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if not 0 < config.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")

        # The graph (kiln.compiler.aot): eager capture, or cache lookups -> capture and compile
        # only what is missing -> load artifacts. Warm starts capture nothing: the runtime
        # reads what it needs (input roles, weight names, constants) from the cached spec.
        self.prepared: PreparedModel = prepare_for_engine(config, self.model_config, self.dtype, self.device)
        self.timings.update(self.prepared.report.timings)
        self.startup_report = self.prepared.report
        self.graph_spec = self.prepared.spec
        self.graph: ModelGraph | None = self.prepared.graph  # None when nothing was captured
        with self._phase("load weights"):
            weights = self.source.load_weights(self.graph_spec.param_aliases, self.dtype, self.device,
                                               progress=config.progress)
            # Layout passes (merged QKV / gate-up) declared how to build the tensors they take.
            weights = apply_weight_transforms(weights, self.graph_spec.weight_transforms)

        def make_runner(kv_caches: list[torch.Tensor]) -> ModelRunner:
            return ModelRunner(
                self.prepared.graph_fn, self.graph_spec.input_roles, weights, self.graph_spec.constants,
                kv_caches, self.device, bucket_fns=self.prepared.bucket_fns, plan=self.prepared.plan,
            )

        with self._phase("allocate KV cache"):
            self.activation_peak_bytes = 0
            if self.device.type == "cuda" and config.num_kv_blocks is None:
                # Profile the largest step with a one-block cache, then give the KV cache
                # what is left of gpu_memory_utilization.
                probe = make_runner(self._allocate_kv(1))
                self.activation_peak_bytes = profile_step_memory(probe, config.max_num_batched_tokens,
                                                                 config.block_size)
                del probe
                torch.cuda.empty_cache()
            self.num_kv_blocks = self._num_kv_blocks()
            kv_caches = self._allocate_kv(self.num_kv_blocks)
        self.runner = make_runner(kv_caches)
        if self.device.type == "cuda" and config.cuda_graphs:
            with self._phase("capture CUDA graphs"):
                sizes = self._cuda_graph_sizes()
                self.runner.capture_decode_graphs(sizes, -(-self.max_model_len // config.block_size))
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(self.eos_token_ids)
        self.requests: dict[str, _Request] = {}
        self._in_flight: _LaunchedStep | None = None  # async scheduling: launched, not read back
        self.num_discarded_tokens = 0  # computed for a sequence that had ended meanwhile
        self._seq_ids = itertools.count()
        # Everything start-up left on the heap (torch, transformers, the graph, the weights'
        # Python objects) goes to the collector's permanent generation: otherwise every
        # collection the per-step outputs trigger walks it again. At batch 128 that was 60%
        # of a decode step's host time (CPU, tiny model: 3.4 ms -> 1.4 ms per step).
        gc.collect()
        gc.freeze()
        # ... and back before the interpreter's final collection, so that extension objects
        # (Triton's nanobind types) are finalized instead of reported as leaked at exit.
        atexit.unregister(gc.unfreeze)  # one registration however many engines a process makes
        atexit.register(gc.unfreeze)
        self.timings["total"] = time.perf_counter() - t0
        logger.info(
            "engine ready in %.2fs (%s) | %s | %d KV blocks x %d tokens",
            self.timings["total"],
            ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items() if k != "total"),
            self.startup_report.summary(), self.num_kv_blocks, config.block_size,
        )

    # ---- start-up helpers -------------------------------------------------------------
    class _PhaseTimer:
        def __init__(self, engine: "LLMEngine", name: str):
            self.engine, self.name = engine, name

        def __enter__(self) -> None:
            self.t = time.perf_counter()

        def __exit__(self, *exc: Any) -> None:
            self.engine.timings[self.name] = time.perf_counter() - self.t

    def _phase(self, name: str) -> "_PhaseTimer":
        return LLMEngine._PhaseTimer(self, name)

    def _num_kv_heads(self) -> int:
        return kv_heads_and_head_dim(self.model_config)[0]

    def _head_dim(self) -> int:
        return kv_heads_and_head_dim(self.model_config)[1]

    def kv_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.model_config.num_hidden_layers * self._num_kv_heads() * self._head_dim() * elem

    def _allocate_kv(self, num_blocks: int) -> list[torch.Tensor]:
        return allocate_kv_caches(
            self.model_config.num_hidden_layers, num_blocks, self.config.block_size,
            self._num_kv_heads(), self._head_dim(), self.dtype, self.device,
        )

    def _cuda_graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture: the plan's decode buckets, or 1, 2, 4, 8, 16, 32, ..."""
        plan = self.prepared.plan
        if plan is not None:
            return sorted({b.num_seqs for b in plan.buckets() if b.kind == "decode"})
        sizes, n = [], 1
        while n < self.config.max_num_seqs:
            sizes.append(n)
            n *= 2
        return sizes + [self.config.max_num_seqs]

    def _num_kv_blocks(self) -> int:
        bs = self.config.block_size
        if self.config.num_kv_blocks is not None:
            return int(self.config.num_kv_blocks)
        wanted = -(-self.config.max_num_seqs * self.max_model_len // bs) + 1
        if self.device.type == "cpu":
            ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            fit = int(ram * CPU_KV_MEMORY_FRACTION) // (self.kv_bytes_per_token() * bs)
        else:
            _, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * self.config.gpu_memory_utilization)
            # Held now (weights, constants) + the largest step's activations + a reserve for
            # the CUDA graphs' pool and allocator fragmentation.
            reserve = 512 * 2**20
            free_for_kv = budget - torch.cuda.memory_allocated(self.device) - self.activation_peak_bytes - reserve
            fit = free_for_kv // (self.kv_bytes_per_token() * bs)
            if fit < 2:
                raise ValueError(
                    f"no GPU memory left for the KV cache at gpu_memory_utilization="
                    f"{self.config.gpu_memory_utilization}: weights and a {self.config.max_num_batched_tokens}-token "
                    "step already take it; lower max_num_batched_tokens or raise gpu_memory_utilization"
                )
            logger.info("KV cache: %d blocks (%d tokens) fit in %.1f GiB (activation peak %.2f GiB)",
                        min(wanted, fit), min(wanted, fit) * bs, free_for_kv / 2**30,
                        self.activation_peak_bytes / 2**30)
        blocks = max(2, min(wanted, fit))
        return blocks

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = getattr(self.model_config, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ---- requests -----------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompts as lists of token ids")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise ValueError("prompt must be a string or a list of token ids (integers)")
        return list(prompt)

    def validate_request(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, once the request is known to be runnable.

        Raises ValueError naming the field at fault; nothing is queued or changed.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams or a dict, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len}); shorten the prompt or lower max_tokens"
            )
        capacity = (self.num_kv_blocks - 1) * self.config.block_size
        if total > capacity:
            raise ValueError(
                f"max_tokens: prompt + max_tokens = {total} tokens can never fit the KV cache "
                f"({capacity} tokens); lower max_tokens or raise num_kv_blocks"
            )
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids: {bad} are outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs: {params.logprobs} exceeds the vocabulary size {vocab}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none; use stop_token_ids")
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | dict[str, Any] | None = None,
        arrival_time: float | None = None,
        *,
        every_step: bool = True,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field, queueing nothing.

        `params` may be a dict (see `SamplingParams.from_dict`). `arrival_time` (monotonic
        clock) lets a server count queueing before the engine saw the request.
        `every_step=False` makes `step()` return this request's output only once it has
        finished (what `LLM.generate` wants), instead of after every step that changed it.
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        token_ids = self.validate_request(prompt, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [
            Sequence(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=token_ids,
                     params=params, index=i, arrival_time=arrival)
            for i in range(params.n)
        ]
        for seq in seqs[1:]:
            seq.fork_parent = seqs[0]  # the others share the first one's prompt blocks
        if self.tokenizer is not None:
            for seq in seqs:
                detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                seq.text = OutputText(detok, params.stop)
        self.requests[request_id] = _Request(
            request_id, prompt if isinstance(prompt, str) else None, token_ids, params, seqs, every_step,
        )
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish reason
        "abort"), or None if the request is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        now = time.monotonic()
        for seq in req.seqs:
            if not seq.is_finished:
                seq.finish_time = now
                if seq.text is not None:
                    seq.text.finish(check_stop=False)
                self.scheduler.finish(seq, "abort")
        return self._request_output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self._in_flight is not None and not self._in_flight.ended)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def check_invariants(self) -> None:
        """Raise if the KV-block bookkeeping is inconsistent (tests call it after every step)."""
        self.block_manager.check_invariants(self.scheduler.live_sequences())

    def stats(self) -> EngineStats:
        bm, sched = self.block_manager, self.scheduler
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            num_kv_blocks=bm.num_usable_blocks, num_used_blocks=bm.num_used_blocks,
            num_cached_blocks=bm.num_cached_blocks, num_free_blocks=bm.num_free_blocks,
            kv_usage=bm.usage, prefix_cache_queries=bm.prefix_stats.queries,
            prefix_cache_hits=bm.prefix_stats.hits, prefix_cache_hit_rate=bm.prefix_stats.hit_rate,
            num_preemptions=sched.stats.num_preemptions, num_steps=sched.stats.num_steps,
        )

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that produced tokens or ended.

        Async scheduling keeps at most one step in flight: a step is launched (inputs
        uploaded, graph replayed, draw queued on the device), then, when the next step is a
        plain decode continuation of it (`Scheduler.schedule_continuation`), that one is
        launched too, its input ids taken on the device from the first one's draw, and only
        then are the first one's tokens read back and processed while the device computes.
        A sequence that turns out to end with the token read back (EOS, a stop string, an
        abort) is dropped when the next step is read back: its extra token is discarded.
        """
        launched, self._in_flight = self._in_flight, None
        if launched is not None and launched.ended:
            launched = None  # nothing to read back
        if launched is None:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return []
            launched = self._launch(sched.scheduled)
        if self.config.async_scheduling:
            self._in_flight = self._launch_continuation(launched)
        return self._collect(launched)

    def _launch(self, scheduled: list[ScheduledSequence], input_ids: torch.Tensor | None = None) -> _LaunchedStep:
        """Run `scheduled` on the device and queue its draw; nothing is read back."""
        now = time.monotonic()
        for item in scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        # Built on the host; the runner uploads them (pinned, two copies for a decode graph).
        inputs = prepare_step_inputs(SchedulerOutput(scheduled=scheduled), self.block_manager, "cpu")
        logits = self.runner.execute(inputs, input_ids)
        sampling: list[Sequence] = []
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.samples:
                sampling.append(item.seq)
        pending = self.sampler.launch(logits, sampling) if sampling else None
        for seq in sampling:
            seq.num_inflight_tokens += 1
        return _LaunchedStep(scheduled, sampling, pending)

    def _launch_continuation(self, prev: _LaunchedStep) -> _LaunchedStep | None:
        """Launch the decode step after `prev` before `prev`'s tokens are read, if it is one."""
        if prev.pending is None:
            return None
        for seq in prev.sampling:
            # Ending by length with the token in flight changes the batch: read it first.
            if (seq.num_sampled_tokens >= seq.params.max_tokens
                    or seq.num_tokens + seq.num_inflight_tokens >= self.max_model_len):
                return None
        if not self.sampler.can_defer(prev.sampling):
            return None
        items = self.scheduler.schedule_continuation(prev.scheduled)
        if items is None:
            return None
        return self._launch(items, input_ids=prev.pending.tokens)

    def _collect(self, step: _LaunchedStep) -> list[RequestOutput]:
        """Read `step`'s tokens back (waits for the device) and process them."""
        for item in step.scheduled:
            if not item.samples and not item.seq.is_finished:
                self.block_manager.commit(item.seq)  # a prefill chunk's full blocks
        if step.pending is None:
            return []
        sampled = self.sampler.collect(step.pending)
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for seq, token, logprobs in zip(step.sampling, sampled.token_ids, sampled.logprobs):
            seq.num_inflight_tokens -= 1
            if seq.is_finished:
                self.num_discarded_tokens += 1
                continue  # ended (stop, abort) while this step was in flight: the token is dropped
            self._append_token(seq, int(token), logprobs, now)
            req = self.requests[seq.request_id]
            if req.every_step or seq.is_finished:
                touched[seq.request_id] = req
        outputs = []
        for req in touched.values():
            finished = all(s.is_finished for s in req.seqs)
            if req.every_step or finished:
                outputs.append(self._request_output(req))
            if finished:
                del self.requests[req.request_id]
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, now: float) -> None:
        seq.append_token(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        # Every token id of its computed blocks is known now (with async scheduling the last
        # one may be this token): full blocks enter the prefix cache before a finish frees them.
        self.block_manager.commit(seq)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            seq.finish_time = now
            self.scheduler.finish(seq, reason)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Update `seq`'s text with `token`; say why it ends here, if it does."""
        p = seq.params
        n_out = seq.num_output_tokens
        # The sampler masks stop tokens while n_out <= min_tokens; stop strings count from
        # min_tokens on.
        check_strings = n_out >= p.min_tokens
        if n_out > p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            # The stop token itself is not part of the text.
            seq.stop_reason = token if token in p.stop_token_ids else None
            if seq.text is not None:
                seq.text.finish(check_strings)
            return "stop"
        if seq.text is not None:
            hit = seq.text.push(token, check_strings)
            if hit is not None:
                seq.stop_reason = hit
                return "stop"
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            if seq.text is not None:
                hit = seq.text.finish(check_strings)
                if hit is not None:
                    seq.stop_reason = hit
                    return "stop"
            return "length"
        return None

    def _completion_output(self, seq: Sequence) -> CompletionOutput:
        """The completion's state, with deltas since the last output of its request."""
        text = delta = ""
        if seq.text is not None:
            delta = seq.text.take_delta(final=seq.is_finished)
            text = seq.text.emitted_text
        wants_logprobs = seq.params.logprobs is not None
        start = seq.num_emitted_tokens
        seq.num_emitted_tokens = seq.num_output_tokens
        return CompletionOutput(
            index=seq.index, text=text, token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            logprobs=list(seq.logprobs) if wants_logprobs else None,
            text_delta=delta, token_ids_delta=seq.output_token_ids[start:],
            logprobs_delta=seq.logprobs[start:] if wants_logprobs else None,
        )

    def _request_output(self, req: _Request) -> RequestOutput:
        seqs = req.seqs
        arrival = min(s.arrival_time for s in seqs)
        scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
        first = [s.first_token_time for s in seqs if s.first_token_time is not None]
        finish = [s.finish_time for s in seqs if s.finish_time is not None]
        longest = max(seqs, key=lambda s: s.num_output_tokens)
        tpot = None
        first_t, last_t = longest.first_token_time, longest.last_token_time
        if longest.num_output_tokens > 1 and first_t is not None and last_t is not None:
            tpot = (last_t - first_t) / (longest.num_output_tokens - 1)
        metrics = RequestMetrics(
            arrival_time=arrival,
            first_scheduled_time=min(scheduled) if scheduled else None,
            first_token_time=min(first) if first else None,
            finish_time=max(finish) if len(finish) == len(seqs) else None,
            time_in_queue=(min(scheduled) - arrival) if scheduled else None,
            time_to_first_token=(min(first) - arrival) if first else None,
            time_per_output_token=tpot,
            num_preemptions=sum(s.num_preemptions for s in seqs),
        )
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[self._completion_output(s) for s in seqs],
            finished=all(s.is_finished for s in seqs), metrics=metrics,
            num_cached_tokens=seqs[0].num_cached_tokens,
        )
