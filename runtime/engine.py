"""The engine: owns the model runner, scheduler and sampler; `step()` is the per-step loop.

    step() = schedule -> prepare inputs -> run the graph -> sample -> update sequences

Start-up (`LLMEngine.__init__`) resolves the model, builds the graph (capture + passes),
loads weights, sizes and allocates the KV cache, and logs how long each phase took.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compiler.model_source import ModelSource, resolve_model
from kiln.compiler.pipeline import ModelGraph, build_model_graph
from kiln.passes.manager import PassManager
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.model_runner import ModelRunner, allocate_kv_caches, prepare_step_inputs
from kiln.runtime.outputs import CompletionOutput, RequestOutput, RequestMetrics
from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.scheduler import Scheduler
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

        with self._phase("capture and passes"):
            pm = PassManager.default(enable=config.enable_passes, disable=config.disable_passes)
            self.graph: ModelGraph = build_model_graph(
                self.model_config, self.dtype, self.device, block_size=config.block_size, pass_manager=pm,
                max_num_tokens=max(config.max_num_batched_tokens, 2),
            )
        with self._phase("load weights"):
            weights = self.source.load_weights(self.graph.captured.param_aliases, self.dtype, self.device,
                                               progress=config.progress)
        with self._phase("allocate KV cache"):
            self.num_kv_blocks = self._num_kv_blocks()
            kv_caches = allocate_kv_caches(
                self.model_config.num_hidden_layers, self.num_kv_blocks, config.block_size,
                self._num_kv_heads(), self._head_dim(), self.dtype, self.device,
            )
        self.runner = ModelRunner(
            self.graph.graph_module, self.graph.input_roles(), weights, self.graph.captured.constants,
            kv_caches, self.device,
        )
        self.block_manager = BlockManager(self.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}
        self._seq_ids = itertools.count()
        self.eos_token_ids = self._eos_token_ids()
        self.timings["total"] = time.perf_counter() - t0
        logger.info(
            "engine ready in %.2fs (%s) | %d KV blocks x %d tokens",
            self.timings["total"],
            ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items() if k != "total"),
            self.num_kv_blocks, config.block_size,
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
        c = self.model_config
        return int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)

    def _head_dim(self) -> int:
        c = self.model_config
        return int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)

    def kv_bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.model_config.num_hidden_layers * self._num_kv_heads() * self._head_dim() * elem

    def _num_kv_blocks(self) -> int:
        bs = self.config.block_size
        if self.config.num_kv_blocks is not None:
            return int(self.config.num_kv_blocks)
        wanted = -(-self.config.max_num_seqs * self.max_model_len // bs) + 1
        if self.device.type == "cpu":
            ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            fit = int(ram * CPU_KV_MEMORY_FRACTION) // (self.kv_bytes_per_token() * bs)
        else:
            free, _ = torch.cuda.mem_get_info(self.device)
            fit = int(free * 0.9) // (self.kv_bytes_per_token() * bs)
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
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) for t in prompt):
            raise ValueError("prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Validate and queue a request; raises ValueError naming the bad field, queueing nothing."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len ({self.max_model_len})"
            )
        capacity = (self.num_kv_blocks - 1) * self.config.block_size
        if total > capacity:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens can never fit the KV cache ({capacity} tokens); "
                "lower max_tokens or raise num_kv_blocks"
            )
        seqs = [
            Sequence(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=list(token_ids),
                     params=params, index=i)
            for i in range(params.n)
        ]
        self.requests[request_id] = _Request(
            request_id, prompt if isinstance(prompt, str) else None, token_ids, params, seqs,
        )
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of requests that produced tokens or ended."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        inputs = prepare_step_inputs(sched, self.block_manager, self.device)
        logits = self.runner.execute(inputs)
        sampling = [s for s in sched.scheduled if s.samples]
        for item in sched.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
        tokens = self.sampler.sample(logits, [s.seq for s in sampling]) if sampling else []
        touched: dict[str, _Request] = {}
        now = time.monotonic()
        for item, token in zip(sampling, tokens):
            seq = item.seq
            seq.output_token_ids.append(int(token))
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._finish_reason(seq)
            if reason is not None:
                seq.finish_time = now
                self.scheduler.finish(seq, reason)
            req = self.requests.get(seq.request_id)
            if req is not None:
                touched[req.request_id] = req
        outputs = [self._request_output(req) for req in touched.values()]
        for out in outputs:
            if out.finished:
                self.requests.pop(out.request_id, None)
        return outputs

    def _finish_reason(self, seq: Sequence) -> str | None:
        p = seq.params
        token = seq.output_token_ids[-1]
        n_out = len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token in self.eos_token_ids:
                seq.stop_reason = token
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if p.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
                for s in p.stop:
                    if s in text:
                        seq.stop_reason = s
                        return "stop"
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _text(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and isinstance(seq.stop_reason, int) and ids and ids[-1] == seq.stop_reason:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        if isinstance(seq.stop_reason, str):
            text = text[: text.find(seq.stop_reason)]
        return text

    def _request_output(self, req: _Request) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            completions.append(CompletionOutput(
                index=seq.index, text=self._text(seq), token_ids=list(seq.output_token_ids),
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            ))
        first = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        arrival = min(s.arrival_time for s in req.seqs)
        finish = [s.finish_time for s in req.seqs if s.finish_time is not None]
        n_out = max(len(s.output_token_ids) for s in req.seqs)
        metrics = RequestMetrics(
            arrival_time=arrival,
            time_to_first_token=(min(first) - arrival) if first else None,
            time_per_output_token=((max(finish) - min(first)) / (n_out - 1))
            if first and finish and n_out > 1 else None,
        )
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=completions, finished=all(s.is_finished for s in req.seqs), metrics=metrics,
        )
