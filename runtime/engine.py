"""The engine: owns the model runner, scheduler and sampler; `step()` is the per-step loop.

    step() = schedule -> prepare inputs -> run the graph -> sample -> update sequences

Start-up (`LLMEngine.__init__`) resolves the model, gets the graph (kiln.compiler.startup:
cache, capture, compile), loads weights, builds the KV cache (kiln.runtime.kv_cache),
captures CUDA graphs, and logs how long each phase took.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from kiln.compiler.graph_inputs import StepInputs, upload
from kiln.compiler.model_source import ModelSource, resolve_model, resolve_tokenizer
from kiln.compiler.pipeline import ModelGraph
from kiln.compiler.startup import PreparedModel, config_lookup, timed, triton_kernels_at_startup
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.config import EngineConfig
from kiln.runtime.kv_cache import (build_kv_cache, cuda_graph_sizes, kv_bytes_per_token, mixed_graph_token_sizes,
                                   run_token_buckets)
from kiln.runtime.kv_scale_calibration import kv_scales_at_startup
from kiln.runtime.model_loading import LoadedModel, load_model
from kiln.runtime.model_runner import ModelRunner, prepare_step_inputs, prompt_logprob_positions
from kiln.runtime.tp_executor import PendingLogits, TensorParallelExecutor, start_executor
from kiln.runtime.detokenizer import IncrementalDetokenizer, OutputText
from kiln.runtime.guided_decoding import GrammarCompiler, GrammarMasker
from kiln.runtime.hardware_defaults import FALLBACK_CONTEXT, choose_max_model_len, model_context_length
from kiln.runtime.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, TokenLogprobs, TopLogprob
from kiln.runtime.sampler import PendingSample, Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import ScheduledSequence, Scheduler, SchedulerOutput
from kiln.runtime.sequence import Sequence

logger = logging.getLogger("kiln.runtime")


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
    # The step's logits until its draw is queued (`LLMEngine._start_draw`): a tensor, or a
    # tensor-parallel step's PendingLogits (read from rank 0 when called); None afterwards.
    logits: torch.Tensor | PendingLogits | None
    prompt_rows: list[tuple[Sequence, int]]  # rows after the sampled ones: prompt logprobs
    pending: PendingSample | None = None  # None: not drawn yet, or no sequence samples (prefill chunks only)

    @property
    def ended(self) -> bool:
        """Every sequence it samples for has ended meanwhile (aborted, stopped)."""
        return all(seq.is_finished for seq in self.sampling)


def continuation_input_ids(inputs: StepInputs, scheduled: list[ScheduledSequence], prev: _LaunchedStep
                           ) -> torch.Tensor | None:
    """A continuation's input ids on the device: the host's (`inputs.input_ids`, with a 0
    placeholder where a token is in flight), each sequence `prev` samples for taking its new
    token from `prev`'s draw. None when `prev` samples nothing (the host's ids are complete)."""
    if prev.pending is None:
        return None
    drawn = prev.pending.tokens
    if len(scheduled) == len(prev.sampling) and all(
            item.seq is seq and item.num_new_tokens == 1 for item, seq in zip(scheduled, prev.sampling)):
        return drawn  # a decode step of the same sequences: the draw as it is
    row_of = {id(seq): row for row, seq in enumerate(prev.sampling)}
    targets, rows = [], []
    offset = 0
    for item in scheduled:
        row = row_of.get(id(item.seq))
        if row is not None:  # its first new token is the one `prev` is sampling
            targets.append(offset)
            rows.append(row)
        offset += item.num_new_tokens
    # Every copy is queued (`upload`): a blocking one would wait for `prev` to finish, which is
    # what a continuation is launched early to avoid.
    ids = upload(inputs.input_ids[0], drawn.device)
    if targets:
        taken = drawn[upload(torch.tensor(rows), drawn.device)]
        ids[upload(torch.tensor(targets), drawn.device)] = taken.to(ids.dtype)
    return ids


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
        self.timings: dict[str, float] = {}
        # Seconds each CUDA graph's capture took, by bucket name (the runner logs them by kind).
        self.graph_capture_seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        # Unset batch limits become the device's (kiln.runtime.hardware_defaults); from here on
        # the engine's config holds concrete values.
        config, limits = config.with_batch_limits(self.device)
        self.config = config
        logger.info("engine limits: max_num_seqs=%d, max_num_batched_tokens=%d (%s)",
                    limits.max_num_seqs, limits.max_num_batched_tokens, limits.reason)

        with timed(self.timings, "resolve model"):
            # A config.json the cache has seen comes back as its snapshot: no transformers import.
            self.source: ModelSource = resolve_model(config.model, config.load_format, revision=config.revision,
                                                     download_dir=config.download_dir,
                                                     config_from_cache=config_lookup(config.compile_options()))
            self.model_config = self.source.config
        with timed(self.timings, "load tokenizer"):
            if config.tokenizer is not None:
                self.tokenizer = resolve_tokenizer(config.tokenizer, config.tokenizer_revision, config.download_dir)
            else:
                self.tokenizer = self.source.tokenizer()
        # Provisional until the KV cache is sized: the user's value or the model's context.
        model_context = model_context_length(self.model_config)
        self.max_model_len = int(config.max_model_len or model_context or FALLBACK_CONTEXT)
        # FP8 (kiln.passes.quantize_fp8): asked for, or implied by a pre-quantized checkpoint.
        self.quantization = config.resolved_quantization(self.model_config)
        if self.quantization != config.quantization:
            logger.info("checkpoint %s is quantized: running with quantization=%r", self.source.name,
                        self.quantization)
        self.kv_cache_dtype = config.resolved_kv_cache_dtype(self.dtype)

        self.executor: TensorParallelExecutor | None = None
        # FP8 KV-cache scales calibrated at start-up, by parameter name (_calibrate_kv_scales).
        self.kv_scales: dict[str, torch.Tensor] = {}
        self.num_state_slots = 0  # rows of the recurrent layers' state caches (0: none)
        if config.tensor_parallel_size > 1:
            self._start_workers(config)
            self._choose_max_model_len(config, model_context)
        else:
            self._load_model(config, model_context)
        # Recurrent layers' states are per sequence, not per block: no prefix caching there.
        prefix_caching = config.enable_prefix_caching and not self.num_state_slots
        if config.enable_prefix_caching and not prefix_caching:
            logger.info("prefix caching off: %s has recurrent layers, whose states no block holds",
                        self.source.name)
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size, enable_prefix_caching=prefix_caching,
                                          num_state_slots=self.num_state_slots)
        # A recurrent model runs at most as many sequences as it has state slots (kv_cache.allocate_states).
        max_num_seqs = min(config.max_num_seqs, self.num_state_slots - 1) if self.num_state_slots else config.max_num_seqs
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, config.max_num_batched_tokens,
                                   reserve_ratio=config.kv_reserve_ratio)
        self.eos_token_ids = self._eos_token_ids()
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed)
        # Guided decoding: grammars compiled against the tokenizer (lazily), and the logits
        # processor that masks guided rows before every draw.
        vocab, stops = int(self.model_config.vocab_size), sorted(self.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, vocab, stops)
        self.grammar_masker = GrammarMasker(vocab, stops)
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

    def _load_model(self, config: EngineConfig, model_context: int | None) -> None:
        # The graph (kiln.compiler.startup): eager capture, or cache lookups -> capture and
        # compile only what is missing -> load artifacts. Warm starts capture nothing: the
        # runtime reads what it needs (input roles, weight names, constants) from the cached spec.
        model = load_model(config, self.source, self.dtype, self.device, self.timings)
        self.prepared: PreparedModel | None = model.prepared
        self.startup_report = model.prepared.report
        self.graph_spec = model.prepared.spec
        self.graph: ModelGraph | None = model.prepared.graph  # None when nothing was captured
        # The first kernel runs: on CUDA with a cache, Triton's kernels come from it (or are
        # taken into it, every bucket run once) - kiln.compiler.triton_kernels.
        with triton_kernels_at_startup(model.prepared.triton_kernels, self.startup_report) as run_every_bucket:
            with timed(self.timings, "allocate KV cache"):
                kv = build_kv_cache(config, self.model_config, self.kv_cache_dtype, self.device, self.max_model_len,
                                    model.make_runner, state_dtype=self.dtype)
            self.num_kv_blocks, self.activation_peak_bytes = kv.num_blocks, kv.activation_peak_bytes
            self._choose_max_model_len(config, model_context)
            self.num_state_slots = kv.num_state_slots
            self.runner: ModelRunner | TensorParallelExecutor = model.make_runner(kv.layers, kv.states)
            self.kv_scales = self._calibrate_kv_scales(config, model)
            if run_every_bucket:
                with timed(self.timings, "run every token bucket"):
                    run_token_buckets(self.runner, model.prepared.plan, config.block_size, self.max_model_len)
            if self.device.type == "cuda" and not config.enforce_eager:
                with timed(self.timings, "capture CUDA graphs"):
                    plan = model.prepared.plan
                    self.graph_capture_seconds = self.runner.capture_cuda_graphs(
                        cuda_graph_sizes(plan), -(-self.max_model_len // config.block_size),
                        mixed_graph_token_sizes(config, plan, bool(kv.states)), plan.max_num_seqs)
        self.timings.update({k: v for k, v in self.startup_report.timings.items() if k not in self.timings})

    def _calibrate_kv_scales(self, config: EngineConfig, model: LoadedModel) -> dict[str, torch.Tensor]:
        """An FP8 KV cache's scales (kiln.runtime.kv_scale_calibration.kv_scales_at_startup):
        the checkpoint's, 1.0, or calibrated by one prefill, set in place in the graph's scales
        inputs before any request (and before CUDA graphs are captured). Returns the calibrated
        ones by parameter name ({} when none were)."""
        scales, line = kv_scales_at_startup(self.runner, self.graph_spec.input_roles, model.checkpoint_kv_scales,
                                            config, int(self.model_config.vocab_size), self.max_model_len,
                                            self.num_kv_blocks, self.timings)
        if line:
            logger.info("%s", line)
        return scales

    def _choose_max_model_len(self, config: EngineConfig, model_context: int | None) -> None:
        # Block 0 is the null block: one sequence can use the others.
        self.max_model_len, why = choose_max_model_len(config.max_model_len, model_context,
                                                       (self.num_kv_blocks - 1) * config.block_size,
                                                       config.block_size)
        logger.info("engine limits: max_model_len=%d (%s)", self.max_model_len, why)

    def _start_workers(self, config: EngineConfig) -> None:
        """Tensor parallelism: one worker per rank holds the model (kiln.runtime.tp_executor);
        this process schedules and samples from rank 0's gathered logits (on rank 0's GPU
        when there is one, else on the host)."""
        self.worker_device = self.device
        self.device = torch.device("cpu")
        with timed(self.timings, "start workers"):
            self.executor = start_executor(config, self.max_model_len, int(self.model_config.vocab_size))
        self.runner = self.executor
        self.prepared, self.graph_spec, self.graph = None, None, None
        self.startup_report = self.executor.startup_report
        self.num_kv_blocks = self.executor.num_kv_blocks
        self.activation_peak_bytes = max(r["activation_peak_bytes"] for r in self.executor.reports)
        # Every rank holds states for its heads; the engine runs as many sequences as all of them hold.
        self.num_state_slots = min(r["num_state_slots"] for r in self.executor.reports)
        for r in self.executor.reports:  # an FP8 KV cache: each rank's scales (RankWorker.allocate_kv_cache)
            if r.get("kv_scales"):
                logger.info("tensor-parallel rank %d: %s", r["rank"], r["kv_scales"])
        # No worker outlives the engine, however the engine is dropped.
        self._finalizer = weakref.finalize(self, self.executor.shutdown)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do for a single-device engine)."""
        if self.executor is not None:
            self._in_flight = None  # may hold a view of rank 0's logits buffer (CUDA IPC)
            self.executor.shutdown()

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.model_config, self.kv_cache_dtype, self.config.tensor_parallel_size)

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
        token_ids = params.truncated_prompt(self.tokenize(prompt), self.max_model_len)
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
        for name, ids in (("logit_bias", list(params.logit_bias or ())), ("allowed_token_ids",
                                                                         params.allowed_token_ids or [])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if params.prompt_logprobs is not None and self.runner.bucket_fns is not None:
            raise ValueError("prompt_logprobs: not available while the engine runs compiled buckets (each has a "
                             "fixed number of logits rows); start it with compile='eager' (--compile eager)")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words: words need a tokenizer, and this model has none")
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | dict[str, Any] | None = None,
        arrival_time: float | None = None,
        *,
        every_step: bool = True,
        grammar: Any = None,
    ) -> None:
        """Validate and queue a request; raises ValueError naming the bad field, queueing nothing.

        `params` may be a dict (see `SamplingParams.from_dict`). `arrival_time` (monotonic
        clock) lets a server count queueing before the engine saw the request.
        `every_step=False` makes `step()` return this request's output only once it has
        finished (what `LLM.generate` wants), instead of after every step that changed it.
        `grammar` (compiled by `self.grammars`) constrains the output; without one, the
        params' `structured_outputs` is compiled here (a bad one is a ValueError).
        """
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        token_ids = self.validate_request(prompt, params)
        if grammar is None and params.structured_outputs is not None:
            grammar = self.grammars.structured(params.structured_outputs)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        seqs = [
            Sequence(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=token_ids,
                     params=params, index=i, arrival_time=arrival)
            for i in range(params.n)
        ]
        for seq in seqs[1:]:
            seq.fork_parent = seqs[0]  # the others share the first one's prompt blocks
        if self.tokenizer is not None and params.detokenize:
            for seq in seqs:
                detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
                seq.text = OutputText(detok, params.stop, include_stop=params.include_stop_str_in_output)
        if params.bad_words:
            banned = self._bad_words_token_ids(params.bad_words)
            for seq in seqs:
                seq.bad_words_token_ids = banned
        self.requests[request_id] = _Request(
            request_id, prompt if isinstance(prompt, str) else None, token_ids, params, seqs, every_step,
        )
        for seq in seqs:
            self.scheduler.add(seq)
        if grammar is not None:
            self.grammar_masker.register(request_id, grammar)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word as token ids, alone and after a space (how it appears mid-text), as vLLM does."""
        out: list[list[int]] = []
        vocab = self.model_config.vocab_size
        for word in words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = list(self.tokenizer(variant, add_special_tokens=False)["input_ids"])
                if ids and all(t < vocab for t in ids) and ids not in out:
                    out.append(ids)
        return out

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish reason
        "abort"), or None if the request is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        self.grammar_masker.release(request_id)
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
        uploaded, graph replayed, draw queued on the device), then the next step is scheduled
        as a continuation of it (`Scheduler.schedule_continuation`: decodes and prefill
        chunks alike, unless it would preempt) and launched too, the ids of the tokens the
        first one is sampling taken from its draw on the device, and only then are the first
        one's tokens read back and processed while the device computes. A sequence that
        turns out to end with the token read back (EOS, a stop string, an abort) is dropped
        when the next step is read back: its extra token is discarded.

        With tensor parallelism the continuation is only sent to the ranks; its logits are
        read, and its draw queued, at the start of the next call, so that the ranks run it
        while this call processes the tokens before it.
        """
        launched, self._in_flight = self._in_flight, None
        if launched is not None:
            self._start_draw(launched)  # drawn in any case: the unseeded generator advances as at TP=1
            if launched.ended:
                launched = None  # nothing to read back
        if launched is None:
            sched = self.scheduler.schedule()
            if sched.is_empty:
                return []
            launched = self._launch(sched.scheduled)
            self._start_draw(launched)
        if self.config.async_scheduling:
            self._in_flight = self._launch_continuation(launched)
        return self._collect(launched)

    def _launch(self, scheduled: list[ScheduledSequence], prev: _LaunchedStep | None = None) -> _LaunchedStep:
        """Run `scheduled` on the device (tensor parallelism: send it to the ranks); nothing
        is read back, and its draw is queued by `_start_draw`. A continuation of `prev` takes
        the tokens `prev` is sampling from its draw."""
        now = time.monotonic()
        for item in scheduled:
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        # Built on the host; the runner uploads them (pinned, two copies for a decode graph).
        inputs = prepare_step_inputs(SchedulerOutput(scheduled=scheduled), self.block_manager, "cpu")
        input_ids = None if prev is None else continuation_input_ids(inputs, scheduled, prev)
        # Requests asking for prompt logprobs had rows of their prompt chunk added after the
        # sampled rows (prepare_step_inputs): which, in the same order.
        prompt_rows = [(item.seq, p) for item in scheduled
                       for p in prompt_logprob_positions(item.seq, item.seq.num_computed_tokens, item.num_new_tokens)]
        if self.executor is not None:
            logits: torch.Tensor | PendingLogits = self.executor.submit(inputs, input_ids)
        else:
            logits = self.runner.execute(inputs, input_ids)
        sampling: list[Sequence] = []
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.samples:
                sampling.append(item.seq)
        return _LaunchedStep(scheduled, sampling, logits, prompt_rows)

    def _start_draw(self, step: _LaunchedStep) -> None:
        """Queue `step`'s draw on its logits (a tensor-parallel step's are read from rank 0
        here); nothing is read back. Once per step: later calls do nothing."""
        if step.logits is None:
            return
        logits = step.logits() if isinstance(step.logits, PendingLogits) else step.logits
        step.logits = None
        if step.prompt_rows:
            num_sampled = logits.shape[0] - len(step.prompt_rows)
            self._record_prompt_logprobs(logits[num_sampled:], step.prompt_rows)
            logits = logits[:num_sampled]
        if step.sampling:
            self.grammar_masker.apply(logits, step.sampling)  # the logits processor: guided rows only
            step.pending = self.sampler.launch(logits, step.sampling)
        for seq in step.sampling:
            seq.num_inflight_tokens += 1

    def _launch_continuation(self, prev: _LaunchedStep) -> _LaunchedStep | None:
        """Launch the step after `prev` before `prev`'s tokens are read, where it can be
        scheduled without them (its draw queued too, except with tensor parallelism: see
        `step`)."""
        if prev.sampling and (not self.sampler.can_defer(prev.sampling)
                              or self.grammar_masker.guides(prev.sampling)):
            return None
        # A sequence whose in-flight token reaches its length limit ends when it is read back,
        # whatever the token: the continuation leaves it out instead of waiting for the read-back
        # (in an offline run every sequence ends so, and each such step left the device idle
        # while the host read it back, scheduled and prepared the next).
        ending = {seq for seq in prev.sampling
                  if seq.num_sampled_tokens >= seq.params.max_tokens
                  or seq.num_tokens + seq.num_inflight_tokens >= self.max_model_len}
        # `prev`'s prefill chunks enter the prefix cache now, not when it is read back, so that
        # a prompt admitted next finds their blocks as it would after the read-back (`prev`
        # writes them on this stream before any later step reads them).
        self._commit_prefill_chunks(prev)
        items = self.scheduler.schedule_continuation(ending)
        if items is None:
            return None
        step = self._launch(items, prev)
        if self.executor is None:
            self._start_draw(step)
        return step

    def _commit_prefill_chunks(self, step: _LaunchedStep) -> None:
        """Enter the full blocks of `step`'s prefill chunks (sequences it does not sample for,
        whose token ids are all known) in the prefix cache."""
        for item in step.scheduled:
            if not item.samples and not item.seq.is_finished:
                self.block_manager.commit(item.seq)

    def _collect(self, step: _LaunchedStep) -> list[RequestOutput]:
        """Read `step`'s tokens back (waits for the device) and process them."""
        self._commit_prefill_chunks(step)  # done already if a continuation followed it: a no-op then
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
                self.grammar_masker.release(req.request_id)
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, now: float) -> None:
        seq.append_token(token)
        if logprobs is not None:
            seq.logprobs.append(self._logprob_entry(logprobs, seq.params.detokenize))
            seq.cumulative_logprob += logprobs.logprob
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

    def _record_prompt_logprobs(self, logits: torch.Tensor, rows: list[tuple[Sequence, int]]) -> None:
        """Row i of `logits` is position p of its sequence: the distribution of prompt token p + 1."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor([seq.prompt_token_ids[p + 1] for seq, p in rows], device=logprobs.device)
        chosen = logprobs.gather(1, targets[:, None])
        ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
        top_n = max(seq.params.prompt_logprobs or 0 for seq, _ in rows)
        top_values, top_ids = (logprobs.topk(top_n, dim=-1) if top_n else (None, None))
        top_values = top_values.tolist() if top_values is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        chosen_list, target_list = chosen[:, 0].tolist(), targets.tolist()
        for i, (seq, p) in enumerate(rows):
            n = seq.params.prompt_logprobs or 0
            top = [TopLogprob(top_ids[i][j], top_values[i][j]) for j in range(n)] if n else []
            seq.prompt_logprobs[p + 1] = self._logprob_entry(
                TokenLogprobs(token_id=target_list[i], logprob=chosen_list[i], rank=ranks[i], top=top),
                seq.params.detokenize)

    def _logprob_entry(self, lp: TokenLogprobs, decode: bool = True) -> dict[int, Logprob]:
        """vLLM's per-position shape: token id -> Logprob(logprob, rank, decoded_token), the
        sampled token and the top N (inserted most likely first); decoded_token None without
        `decode` (SamplingParams.detokenize False) or a tokenizer."""
        def text(token_id: int) -> str | None:
            return self.tokenizer.decode([token_id]) if self.tokenizer is not None and decode else None

        entry = {t.token_id: Logprob(t.logprob, rank, text(t.token_id)) for rank, t in enumerate(lp.top, start=1)}
        if lp.token_id not in entry:
            entry[lp.token_id] = Logprob(lp.logprob, lp.rank, text(lp.token_id))
        return entry

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
            cumulative_logprob=seq.cumulative_logprob if wants_logprobs else None,
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
            prompt_logprobs=([None] + [seqs[0].prompt_logprobs.get(p) for p in range(1, len(req.prompt_token_ids))]
                             if req.params.prompt_logprobs is not None else None),
        )
