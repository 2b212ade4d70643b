"""The OpenAI API on top of the async engine: validated requests in, response bodies and
stream chunks out. No HTTP here (that is `kiln.runtime.serving.app`).

Every check that can fail for a request runs before anything is queued: the body's types
(pydantic), sampling values (`SamplingParams`), the prompt against the context and the
vocabulary (`LLMEngine.validate_request`), tool schemas (the grammar compiler) and the
waiting-queue bound. So a bad request costs the engine nothing and never touches another.

Per-request CPU work (tokenizing, rendering the chat template, scanning token ids) runs
in the server's worker threads, never on the event loop, and is bounded before it starts:
a prompt over `RequestLimits.max_prompt_chars` characters is refused unread, and a
client's own chat template (only with `allow_client_chat_template`) renders in a
sandboxed, time-limited child process (kiln.runtime.serving.template_sandbox).

Streams are built from the outputs' cumulative state (text, token ids, logprobs): each
chunk carries what is new since the last chunk of that choice, so the concatenated deltas
are exactly the non-streamed text.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import time
import uuid
import weakref
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, TypeVar

from kiln.runtime.serving.app import DEFAULT_CHAT_TEMPLATE_TIMEOUT_S, PROMPT_CHARS_PER_TOKEN
from kiln.runtime.serving.async_engine import (AsyncLLMEngine, EngineStepError, EngineStoppedError, QueueFullError,
                                       RequestStream)
from kiln.runtime.serving.chat_prompt import (client_chat_template, continue_final, conversation_chars,
                                             render_chat_prompt, template_inputs)
from kiln.runtime.serving.template_sandbox import HOST_BUSY_TIMEOUT_S, render_in_sandbox
from kiln.runtime.guided_decoding import AfterMarker, GrammarError, ToolSchema
from kiln.runtime.serving.protocol import (ChatCompletionRequest, CompletionRequest, NamedToolChoice, OpenAIError,
                                          bad_request, server_error)
from kiln.runtime.outputs import CompletionOutput, Logprob, RequestOutput, top_entries
from kiln.runtime.sampling_params import SamplingParams, truncate_prompt
from kiln.runtime.serving.metrics import ServerMetrics
from kiln.runtime.serving.parsers import get_reasoning_parser, get_tool_parser
from kiln.runtime.serving.reasoning_parser import ReasoningDelta, ReasoningParser
from kiln.runtime.serving.tool_parser import ToolParser
from kiln.runtime.serving.vllm_compat import (ServingOptions, UnknownFieldLog, prompt_logprobs_json,
                                              request_log_line, system_fingerprint)

logger = logging.getLogger("kiln.runtime.serving.app")
# Request lines (one per request unless --disable-log-requests), as vLLM logs them.
request_logger = logging.getLogger("kiln.serving")

# What JSON cannot hold (-inf logprobs of masked tokens) is sent as this, like OpenAI does.
MIN_LOGPROB = -9999.0
RETRY_AFTER_S = 1
# Tokens at the prompt's end a reasoning parser reads (its generation prompt, e.g. `<think>\n`).
PROMPT_TAIL_TOKENS = 8


WaitDisconnect = Callable[[], Awaitable[None]]
T = TypeVar("T")


@dataclass
class RequestLimits:
    """Bounds on one request's preparation (see the module doc)."""

    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN x max_model_len
    allow_client_chat_template: bool = False
    chat_template_timeout: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S


class ClientDisconnected(Exception):
    """The client went away before its (non-streamed) response was ready."""


def _engine_error(e: BaseException) -> OpenAIError:
    if isinstance(e, QueueFullError):
        return OpenAIError(str(e), 503, "server_busy", None, "queue_full", {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineStoppedError):
        return OpenAIError(str(e), 503, "service_unavailable", None, "engine_stopped",
                           {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(e, EngineStepError):
        return server_error(str(e))
    return server_error(f"internal error: {type(e).__name__}: {e}")


def _param_from_message(message: str, known: set[str], rename: dict[str, str]) -> str | None:
    """Field-first error messages ("temperature must be ...") -> the request parameter."""
    head = message.split(":", 1)[0].split(" ", 1)[0]
    if head in rename:
        return rename[head]
    return head if head in known else None


def _consume_exception(f: asyncio.Future) -> None:
    """Mark a cancelled gather's outcome as seen, so asyncio does not log it."""
    if not f.cancelled():
        f.exception()


def _finite(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def _without_drawn_token(c: CompletionOutput) -> CompletionOutput:
    """`c` as an echo with max_tokens 0 answers it: the prompt alone (the token the engine had
    to draw is not part of the answer), finished by length, as vLLM does."""
    return replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                   finish_reason="length", stop_reason=None)


@dataclass
class _ChoiceProgress:
    """What one choice has sent so far in a stream."""

    num_chars: int = 0
    num_tokens: int = 0
    started: bool = False
    finished: bool = False
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None

    def advance(self, c: CompletionOutput) -> tuple[str, list[int], list[dict[int, Logprob]]]:
        """(new text, new token ids, new logprobs) of `c` since the last call."""
        text = c.text[self.num_chars:]
        self.num_chars = max(self.num_chars, len(c.text))
        tokens = c.token_ids[self.num_tokens:]
        lps = (c.logprobs or [])[self.num_tokens:] if c.logprobs is not None else []
        self.num_tokens = max(self.num_tokens, len(c.token_ids))
        return text, tokens, lps


@dataclass
class _ReplyParsers:
    """How one chat request's replies are read: reasoning split off first (the reasoning
    parser), then tool calls out of the rest (the tool parser), unless the reasoning parser
    reads those itself (harmony)."""

    tool_parser_cls: type[ToolParser]
    reasoning_parser_cls: type[ReasoningParser] | None
    tool_specs: dict[str, Any] | None  # None: the request has no tools (no calls are parsed)
    prompt_tail: str
    include_reasoning: bool

    def _reasoning(self) -> ReasoningParser | None:
        cls = self.reasoning_parser_cls
        return cls(self.prompt_tail, self.tool_specs) if cls is not None else None

    def _tools(self) -> ToolParser | None:
        reads_calls = self.reasoning_parser_cls is not None and self.reasoning_parser_cls.parses_tool_calls
        return self.tool_parser_cls(self.tool_specs) if self.tool_specs is not None and not reads_calls else None

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """A whole reply as the response's message, and whether it holds tool calls."""
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        calls = []
        reasoning = self._reasoning()
        if reasoning is not None:
            split = reasoning.parse(text)
            message["content"], calls = split.content, split.tool_calls
            message["reasoning_content"] = message["reasoning"] = split.reasoning if self.include_reasoning else None
        tools = self._tools()
        if tools is not None:
            parsed = tools.parse(message["content"] or "")
            if parsed.tool_calls or tools.keeps_special_tokens:  # (harmony's content is its final channel)
                message["content"], calls = parsed.content, parsed.tool_calls
        if calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, bool(calls)

    def for_stream(self) -> tuple[ToolParser | None, ReasoningParser | None]:
        """The parsers of one streamed choice."""
        return self._tools(), self._reasoning()

    def delta(self, tools: ToolParser | None, reasoning: ReasoningParser | None, text: str, last: bool
              ) -> dict[str, Any]:
        """A stream chunk's delta for `text`, the choice's new text (`last`: its final piece)."""
        delta: dict[str, Any] = {}
        part = ReasoningDelta(content=text)
        if reasoning is not None:
            part = reasoning.feed(text)
            if last:
                part.add(reasoning.finish())
            if part.reasoning and self.include_reasoning:
                delta["reasoning_content"] = delta["reasoning"] = part.reasoning
        calls = part.tool_calls
        content = part.content
        if tools is not None:
            parsed = tools.feed(content)
            if last:
                rest = tools.finish()
                parsed.content += rest.content
                parsed.tool_calls += rest.tool_calls
            content, calls = parsed.content, calls + parsed.tool_calls
        if content:
            delta["content"] = content
        if calls:  # per call: id and name first, then argument fragments
            delta["tool_calls"] = [d.to_openai() for d in calls]
        return delta


@dataclass
class _Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add_prompt(self, out: RequestOutput) -> None:
        self.prompt_tokens += len(out.prompt_token_ids)
        self.cached_tokens += out.num_cached_tokens

    def body(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class _Submitted:
    """One API request's engine requests (one per prompt)."""

    streams: list[RequestStream]
    request_ids: list[str]
    finished: set[str] = field(default_factory=set)


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, model_names: list[str], metrics: ServerMetrics,
                 limits: RequestLimits | None = None, executor: Executor | None = None,
                 options: ServingOptions | None = None):
        """`executor` runs the per-request CPU work (None: asyncio's default thread pool);
        `options` are the vLLM-named server options (tool-call parser, chat template, ...)."""
        if not model_names:
            raise ValueError("at least one served model name is needed")
        self.engine = engine
        self.llm = engine.engine
        self.tokenizer = self.llm.tokenizer
        self.max_model_len = int(self.llm.max_model_len)
        self.vocab_size = int(self.llm.model_config.vocab_size)
        self.model_names = list(model_names)
        self.metrics = metrics
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self._sampling_fields = set(SamplingParams.field_names()) | {"prompt"}
        self.limits = limits or RequestLimits()
        self.max_prompt_chars = int(self.limits.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * self.max_model_len)
        self._executor = executor
        # The Rust tokenizer's batch encoder without offsets: it releases the GIL while it
        # encodes and skips the offsets and BatchEncoding the transformers wrapper builds
        # while holding it, time the event loop could not run (runtime/README.md: request limits).
        # Same ids (tests/test_server_hardening.py); other tokenizers use the wrapper.
        backend = getattr(self.tokenizer, "_tokenizer", None)
        self._encode_fast = getattr(backend, "encode_batch_fast", None)
        self.options = options or ServingOptions()
        self.tool_parser_cls = get_tool_parser(self.options.tool_call_parser)
        self.reasoning_parser_cls = (get_reasoning_parser(self.options.reasoning_parser)
                                     if self.options.reasoning_parser else None)
        self._reasoning_end_ids: tuple[int, ...] | None = None
        if self.reasoning_parser_cls is not None and self.reasoning_parser_cls.parses_tool_calls:
            # Harmony's calls are harmony's, whatever --tool-call-parser says (its grammar too).
            self.tool_parser_cls = get_tool_parser("openai")
        self.unknown_fields = UnknownFieldLog()
        self.fingerprint = system_fingerprint(self.llm)

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` in a worker thread: the event loop keeps serving meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    # ---- models --------------------------------------------------------------------------
    def model_cards(self) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": self.created, "owned_by": "kiln",
                 "root": name, "parent": None, "max_model_len": self.max_model_len}
                for name in self.model_names]

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise OpenAIError(f"The model `{model}` does not exist; this server serves: "
                              f"{', '.join(self.model_names)}", 404, "invalid_request_error", "model",
                              "model_not_found")
        return model

    # ---- shared ----------------------------------------------------------------------------
    def _sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                         logprobs: int | None, rename: dict[str, str]) -> SamplingParams:
        values: dict[str, Any] = {"max_tokens": max_tokens, "n": req.n, "stop": req.stop,
                                  "stop_token_ids": list(req.stop_token_ids or []), "ignore_eos": req.ignore_eos,
                                  "min_tokens": req.min_tokens, "logprobs": logprobs,
                                  "skip_special_tokens": req.skip_special_tokens, "seed": req.seed}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(req, name)
            if value is not None:
                values[name] = value
        if values.get("top_k", -1) > self.vocab_size:
            values["top_k"] = -1  # larger than the vocabulary is the same as no top-k
        values.update(req.sampling_values())  # vLLM's extra fields (vllm_compat.VLLMSamplingFields)
        if req.logit_bias:
            values["logit_bias"] = dict(req.logit_bias)
        try:
            return SamplingParams(**values)
        except ValueError as e:
            param = _param_from_message(str(e), self._sampling_fields, rename)
            raise bad_request(str(e), param) from None

    def _validate(self, token_ids: list[int], params: SamplingParams, rename: dict[str, str],
                  prompt_param: str = "prompt") -> None:
        """The engine's checks on a prompt (a scan of every token id: call it off the loop)."""
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:  # the prompt's fault as much as max_tokens': name the prompt
            raise bad_request(f"{prompt_param}: the prompt is {len(token_ids)} tokens, and with max_tokens "
                              f"{params.max_tokens} that is {total}, over max_model_len ({self.max_model_len}); "
                              "shorten the prompt or lower max_tokens", rename.get("prompt", "prompt"))
        try:
            self.llm.validate_request(token_ids, params)
        except ValueError as e:
            raise bad_request(str(e), _param_from_message(str(e), self._sampling_fields, rename)) from None

    def _check_chars(self, n: int, param: str, what: str) -> None:
        if n > self.max_prompt_chars:
            raise OpenAIError(f"{param}: {what} is {n} characters; the limit is {self.max_prompt_chars} "
                              "(--max-prompt-chars)", 400, "invalid_request_error", param.split("[")[0],
                              "prompt_too_large")

    def _tokenize(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, after the size limit (blocking: call it off the loop)."""
        if self.tokenizer is None:
            raise bad_request(f"{param}: this model has no tokenizer; send token ids", param.split("[")[0])
        self._check_chars(len(text), param, "the prompt")
        try:
            if self._encode_fast is not None:
                return list(self._encode_fast([text], add_special_tokens=add_special_tokens)[0].ids)
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        except (TypeError, ValueError) as e:  # text the tokenizer cannot take (the body checks should catch it)
            raise bad_request(f"{param}: cannot be tokenized ({type(e).__name__}: {e})", param.split("[")[0]) from None

    def _check_prompt_count(self, n: int, param: str) -> None:
        """A request with more prompts than the waiting queue can ever hold is refused (400, not
        a 503 that clients would retry forever)."""
        limit = self.engine.max_waiting_requests
        if n > limit:
            raise bad_request(f"{param}: {n} prompts in one request can never be queued: the server holds at "
                              f"most {limit} waiting requests (--max-waiting-requests); send at most {limit}",
                              param, "too_many_prompts")

    async def _submit(self, base_id: str, prompts: list[list[int]], params: SamplingParams, grammar: Any,
                      arrival: float) -> _Submitted:
        try:
            self.engine.check_capacity(len(prompts))
        except QueueFullError:
            busy = OpenAIError(f"the server is busy: its queue of waiting requests is full (limit "
                               f"{self.engine.max_waiting_requests}) and this request needs {len(prompts)} "
                               "place(s); retry later", 503, "server_busy", None, "queue_full",
                               {"Retry-After": str(RETRY_AFTER_S)})
            raise busy from None
        ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        streams: list[RequestStream] = []
        try:
            for rid, token_ids in zip(ids, prompts):
                streams.append(await self.engine.add_request(rid, token_ids, params, grammar, arrival))
        except BaseException as e:
            for rid in ids:
                self.engine.abort(rid)
            if isinstance(e, ValueError):  # the engine's own validation (should have passed already)
                raise bad_request(str(e), _param_from_message(str(e), self._sampling_fields, {})) from None
            if isinstance(e, (QueueFullError, EngineStoppedError)):
                raise _engine_error(e) from None
            raise
        return _Submitted(streams, ids)

    async def _collect(self, sub: _Submitted, wait_disconnect: WaitDisconnect) -> list[RequestOutput]:
        """Wait for every prompt to finish; abort them all if the client goes away first."""
        gather = asyncio.ensure_future(asyncio.gather(*(s.result() for s in sub.streams)))
        gone = asyncio.ensure_future(wait_disconnect())
        try:
            await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            gather.cancel()
            gather.add_done_callback(_consume_exception)
            gone.cancel()
            self._abort(sub)
            raise
        if not gather.done():
            gather.cancel()
            gather.add_done_callback(_consume_exception)
            self._abort(sub)
            raise ClientDisconnected()
        gone.cancel()
        try:
            outputs = gather.result()
        except (EngineStepError, EngineStoppedError) as e:
            self._abort(sub, client_gone=False)
            raise _engine_error(e) from None
        for out in outputs:
            self._record(out)
        return outputs

    def _abort_when_dropped(self, stream: AsyncIterator[str], sub: _Submitted) -> AsyncIterator[str]:
        """A stream whose client left before its first chunk may be dropped without ever
        running (so without its `finally`): abort its requests when it is collected."""
        loop = asyncio.get_running_loop()

        def on_collect() -> None:
            try:
                loop.call_soon_threadsafe(self._abort, sub)  # engine bookkeeping lives on the loop
            except RuntimeError:
                pass  # the loop is closed: the server is gone anyway

        weakref.finalize(stream, on_collect)
        return stream

    async def _guard_stream(self, sub: _Submitted, response_id: str, events: AsyncGenerator[str, None]
                            ) -> AsyncIterator[str]:
        """Every SSE stream's frame: an engine failure or a bug ends the stream with an error
        event (the server keeps serving), requests a departed client left are aborted, and
        the stream closes with [DONE]."""
        ended = False
        try:
            async for event in events:
                yield event
            ended = True
        except (EngineStepError, EngineStoppedError) as e:
            ended = True
            yield self._sse(_engine_error(e).body())
        except Exception as e:  # a bug: end this stream with an error event, keep serving
            ended = True
            logger.exception("stream %s failed", response_id)
            yield self._sse(_engine_error(e).body())
        finally:
            await events.aclose()  # stop the event source's own merge of engine outputs now
            # Anything unfinished here was left by a client that went away (or by an error).
            self._abort(sub, client_gone=not ended)
        yield "data: [DONE]\n\n"

    def _abort(self, sub: _Submitted, client_gone: bool = True) -> None:
        """Abort the request's unfinished prompts (counted as aborted when the client left)."""
        for rid in sub.request_ids:
            if rid not in sub.finished:
                self.engine.abort(rid)
                if client_gone:
                    self.metrics.aborted.inc()
                sub.finished.add(rid)

    def _record(self, out: RequestOutput) -> None:
        m = out.metrics
        e2e = (time.monotonic() - m.arrival_time) if m is not None else None
        self.metrics.record_finished(
            m.time_to_first_token if m else None, m.time_per_output_token if m else None, e2e,
            len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
            queue_time=m.time_in_queue if m else None, finish_reasons=[c.finish_reason for c in out.outputs])

    async def _structured_grammar(self, req: CompletionRequest | ChatCompletionRequest) -> Any:
        """The grammar of `structured_outputs` / `guided_*`, compiled off the loop (None without one)."""
        try:
            spec = req.structured()
        except ValueError as e:
            raise bad_request(str(e), str(e).split(":", 1)[0].split(" ", 1)[0]) from None
        if spec is None:
            return None
        try:
            return await asyncio.to_thread(self.engine.grammars.structured, spec, "structured_outputs")
        except GrammarError as e:
            raise bad_request(str(e), e.param) from None

    def _log_request(self, response_id: str, endpoint: str, prompts: list[list[int]], params: SamplingParams,
                     guided: bool) -> None:
        if self.options.log_requests:
            request_logger.info("%s", request_log_line(response_id, endpoint, [len(p) for p in prompts], params,
                                                       guided))

    def _token_str(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"<{token_id}>"
            self._token_text[token_id] = text
        return text

    async def _merge(self, sub: _Submitted) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all of a request's streams, as they come."""
        if len(sub.streams) == 1:
            async for out in sub.streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out, None))
            except Exception as e:
                queue.put_nowait((i, None, e))
                return
            queue.put_nowait((i, None, None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(sub.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, out, error = await queue.get()
                if error is not None:
                    raise error
                if out is None:
                    remaining -= 1
                    continue
                yield i, out
        finally:
            for t in tasks:
                t.cancel()

    @staticmethod
    def _sse(obj: dict[str, Any]) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"

    # ---- /v1/completions ---------------------------------------------------------------------
    async def create_completion(self, req: CompletionRequest, wait_disconnect: WaitDisconnect
                                ) -> dict[str, Any] | AsyncIterator[str]:
        arrival = time.monotonic()
        model = self.check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of other than n is not supported", "best_of")
        if req.suffix:
            raise bad_request("suffix (insertion) is not supported by this server", "suffix")
        self.unknown_fields.note(req, "/v1/completions")
        # echo with logprobs, as vLLM answers it: the prompt's tokens get logprobs too (its
        # prompt logprobs; none for the first token) ahead of the completion's. It is how
        # lm-evaluation-harness scores a continuation (echo, logprobs, max_tokens 1); with
        # max_tokens 0 the prompt alone is echoed and scored (one token is drawn and dropped).
        echo_logprobs = req.echo and req.logprobs is not None
        prompt_only = req.echo and req.max_tokens == 0
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")

        raw = req.prompt
        texts: list[str | None]
        if isinstance(raw, list) and not isinstance(raw[0], int):
            self._check_prompt_count(len(raw), "prompt")
        rename: dict[str, str] = {}
        max_tokens = 1 if prompt_only else req.max_tokens if req.max_tokens is not None else 16
        params = self._sampling_params(req, max_tokens, req.logprobs, rename)
        if echo_logprobs:
            params = replace(params, prompt_logprobs=max(req.logprobs, params.prompt_logprobs or 0))
        if isinstance(raw, str):
            texts = [raw]
            self._check_chars(len(raw), "prompt", "the prompt")
        elif isinstance(raw[0], str):
            texts = list(raw)  # type: ignore[arg-type]
            for i, t in enumerate(texts):
                self._check_chars(len(t), f"prompt[{i}]", "the prompt")  # type: ignore[arg-type]
        else:
            texts = [None] if isinstance(raw[0], int) else [None] * len(raw)
        prompts = await self._off_loop(self._completion_prompts, raw, params, rename)
        grammar = await self._structured_grammar(req)
        sub = await self._submit(f"cmpl-{uuid.uuid4().hex}", prompts, params, grammar, arrival)
        if params.truncate_prompt_tokens is not None:
            texts = [None] * len(prompts)  # echo what runs: the kept tokens, decoded
        echo_texts = [self._echo_text(t, ids) if req.echo else "" for t, ids in zip(texts, prompts)]
        response_id = sub.request_ids[0].rsplit("-", 1)[0]
        self._log_request(response_id, "/v1/completions", prompts, params, grammar is not None)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._abort_when_dropped(self._guard_stream(sub, response_id, self._stream_completion(
                sub, response_id, model, req.n, echo_texts, req.logprobs, include_usage, echo_logprobs,
                prompt_only)), sub)
        outputs = await self._collect(sub, wait_disconnect)
        choices = []
        usage = _Usage()
        for i, out in enumerate(outputs):
            usage.add_prompt(out)
            for c in out.outputs:
                if prompt_only:
                    c = _without_drawn_token(c)
                usage.completion_tokens += len(c.token_ids)
                logprobs = None
                if echo_logprobs:
                    logprobs = self._echo_logprobs(out, c, req.logprobs)
                elif req.logprobs is not None:
                    logprobs = self._completion_logprobs(c.token_ids, c.logprobs or [], len(echo_texts[i]),
                                                         req.logprobs)
                choice = {"index": i * req.n + c.index, "text": echo_texts[i] + c.text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        return {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.body(), "system_fingerprint": self.fingerprint}

    def _completion_prompts(self, raw: Any, params: SamplingParams, rename: dict[str, str]) -> list[list[int]]:
        """The prompt(s) of a completion request as checked token ids (blocking: runs off the loop)."""
        if isinstance(raw, str):
            prompts = [self._tokenize(raw, "prompt")]
        elif isinstance(raw[0], str):
            prompts = [self._tokenize(t, f"prompt[{i}]") for i, t in enumerate(raw)]
        elif isinstance(raw[0], int):
            prompts = [list(raw)]
        else:
            prompts = [list(p) for p in raw]
        prompts = [params.truncated_prompt(ids, self.max_model_len) for ids in prompts]
        for i, ids in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not ids:
                raise bad_request(f"{where} is empty", "prompt")
            self._validate(ids, params, rename, where)
        return prompts

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        if text is not None:
            return text
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _echo_logprobs(self, out: RequestOutput, c: CompletionOutput, n: int) -> dict[str, Any]:
        """OpenAI's completion logprobs over the echoed prompt and then `c`'s tokens, as vLLM
        gives them: the prompt's first token has no logprob (None, and no top entries); the
        text offsets run over the tokens' own strings from 0."""
        prompt, lps = out.prompt_token_ids, out.prompt_logprobs or []
        head = self._token_str(prompt[0])
        rest = self._completion_logprobs(prompt[1:] + c.token_ids, list(lps[1:]) + list(c.logprobs or []),
                                         len(head), n)
        return {"tokens": [head] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}

    def _completion_logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]], offset: int, n: int
                             ) -> dict[str, Any]:
        tokens, token_logprobs, top, offsets = [], [], [], []
        pos = offset
        for token_id, entry in zip(token_ids, lps):
            chosen, best = top_entries(token_id, entry, n)
            s = self._token_str(token_id)
            tokens.append(s)
            token_logprobs.append(_finite(chosen.logprob))
            top.append({self._token_str(t): _finite(lp.logprob) for t, lp in best} or None)
            offsets.append(pos)
            pos += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    async def _stream_completion(self, sub: _Submitted, response_id: str, model: str, n: int,
                                 echo_texts: list[str], num_logprobs: int | None, include_usage: bool,
                                 echo_logprobs: bool = False, prompt_only: bool = False) -> AsyncIterator[str]:
        created = int(time.time())
        progress: dict[int, _ChoiceProgress] = {}
        offsets: dict[int, int] = {}
        usage = _Usage()

        def chunk(index: int, text: str, logprobs: Any, finish: str | None, stop_reason: Any = None) -> str:
            body: dict[str, Any] = {"id": response_id, "object": "text_completion", "created": created,
                                    "model": model, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                                                 "finish_reason": finish,
                                                                 "stop_reason": stop_reason}]}
            if include_usage:
                body["usage"] = None
            return self._sse(body)

        async for i, out in self._merge(sub):
            for c in out.outputs:
                index = i * n + c.index
                p = progress.setdefault(index, _ChoiceProgress())
                if p.finished:
                    continue
                if prompt_only:
                    c = _without_drawn_token(c)
                text, new_tokens, lps = p.advance(c)
                logprobs = None
                if not p.started:
                    p.started = True
                    text = echo_texts[i] + text
                    offsets[index] = len(echo_texts[i])
                    if echo_logprobs:  # the prompt's logprobs (and the first tokens') in the first chunk
                        logprobs = self._echo_logprobs(out, replace(c, token_ids=new_tokens, logprobs=lps),
                                                       num_logprobs or 0)
                        offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                if logprobs is None and num_logprobs is not None and lps:
                    logprobs = self._completion_logprobs(new_tokens, lps, offsets[index], num_logprobs)
                    offsets[index] += sum(len(t) for t in logprobs["tokens"])
                if c.finish_reason is not None:
                    p.finished = True
                    usage.completion_tokens += len(c.token_ids)
                    yield chunk(index, text, logprobs, c.finish_reason, c.stop_reason)
                elif text or logprobs:
                    yield chunk(index, text, logprobs, None)
            if out.finished:
                sub.finished.add(out.request_id)
                usage.add_prompt(out)
                self._record(out)
        if include_usage:
            yield self._sse({"id": response_id, "object": "text_completion", "created": created, "model": model,
                             "choices": [], "usage": usage.body()})

    # ---- /v1/chat/completions ------------------------------------------------------------------
    async def create_chat_completion(self, req: ChatCompletionRequest, wait_disconnect: WaitDisconnect
                                     ) -> dict[str, Any] | AsyncIterator[str]:
        arrival = time.monotonic()
        model = self.check_model(req.model)
        self.unknown_fields.note(req, "/v1/chat/completions")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise bad_request("give max_completion_tokens or max_tokens, not both", "max_tokens")

        tools, mode, tool_names = self._tool_mode(req)
        tool_dicts = [t.model_dump(exclude_none=True) for t in req.tools] if tools else None
        self._check_chars(conversation_chars(req), "messages", "the conversation's text")
        client_template = client_chat_template(req)
        if client_template is None:
            prompt_ids = await self._off_loop(self._chat_prompt_ids, req, tool_dicts)
        else:
            prompt_ids = await self._client_template_prompt_ids(req, tool_dicts, *client_template)
        if not prompt_ids:
            raise bad_request("messages: the conversation renders to an empty prompt", "messages")
        prompt_ids = truncate_prompt(prompt_ids, req.truncate_prompt_tokens, self.max_model_len)

        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        rename = {"max_tokens": max_param, "logprobs": "top_logprobs", "prompt": "messages"}
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - len(prompt_ids)
            if max_tokens < 1:
                raise bad_request(f"messages: the prompt is {len(prompt_ids)} tokens, which leaves no room to "
                                  f"generate within max_model_len ({self.max_model_len})", "messages")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = self._sampling_params(req, max_tokens, logprobs, rename)
        reasoning = self.reasoning_parser_cls
        if ((reasoning is not None and reasoning.keeps_special_tokens)
                or (tools and self.tool_parser_cls.keeps_special_tokens)):
            params = replace(params, skip_special_tokens=False)  # the parser reads the model's special markers
        await self._off_loop(self._validate, prompt_ids, params, rename, "messages")
        grammar = await self._chat_grammar(req, tools, mode)
        prompt_tail = self._prompt_tail(prompt_ids) if reasoning is not None else ""
        # The model reasons freely first; harmony's tool grammar spells its reasoning out itself.
        if (grammar is not None and reasoning is not None and reasoning.answer_waits_for_marker(prompt_tail)
                and not (tools and reasoning.parses_tool_calls)):
            grammar = AfterMarker(grammar, self._reasoning_end_tokens())
        sub = await self._submit(f"chatcmpl-{uuid.uuid4().hex}", [prompt_ids], params, grammar, arrival)
        response_id = sub.request_ids[0].rsplit("-", 1)[0]
        self._log_request(response_id, "/v1/chat/completions", [prompt_ids], params, grammar is not None)
        # The family's parser (--tool-call-parser) reads calls back, with each tool's schema;
        # the reasoning parser (--reasoning-parser) splits the reasoning off first.
        tool_specs = {t.name: t.parameters for t in tools} if tools else None
        replies = _ReplyParsers(self.tool_parser_cls, reasoning, tool_specs, prompt_tail, req.include_reasoning)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self._abort_when_dropped(self._guard_stream(sub, response_id, self._stream_chat(
                sub, response_id, model, logprobs, include_usage, replies)), sub)
        (out,) = await self._collect(sub, wait_disconnect)
        usage = _Usage()
        usage.add_prompt(out)
        choices = []
        for c in out.outputs:
            usage.completion_tokens += len(c.token_ids)
            message, has_calls = replies.message(c.text)
            finish = "tool_calls" if has_calls else c.finish_reason
            choices.append({"index": c.index, "message": message,
                            "logprobs": (self._chat_logprobs(c.token_ids, c.logprobs or [], logprobs)
                                         if logprobs is not None else None),
                            "finish_reason": finish, "stop_reason": c.stop_reason})
        body = {"id": response_id, "object": "chat.completion", "created": int(time.time()), "model": model,
                "choices": choices, "usage": usage.body(), "system_fingerprint": self.fingerprint}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return body

    def _chat_prompt_ids(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> list[int]:
        """The model's template rendered and tokenized (blocking: runs off the loop)."""
        if self.tokenizer is None:
            raise bad_request("this model has no chat template; use /v1/completions with a plain prompt", "messages")
        text = render_chat_prompt(self.tokenizer, req, tools, self.options.chat_template,
                                  self.tool_parser_cls.name)
        # The template's own special tokens are in the text already.
        return self._tokenize(text, "messages", add_special_tokens=False)

    async def _client_template_prompt_ids(self, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                                          template: str, param: str) -> list[int]:
        """A client's template, rendered in the sandbox (kiln.runtime.serving.template_sandbox)."""
        if not self.limits.allow_client_chat_template:
            raise bad_request(f"{param}: this server does not accept chat templates from clients (the model's own "
                              "template is used; the server's operator can allow them with "
                              "--allow-client-chat-template)", param, "chat_template_not_allowed")
        if self.tokenizer is None:
            raise bad_request(f"{param}: this model has no tokenizer; use /v1/completions with token ids", param)
        inputs = template_inputs(template, req, tools, self.tool_parser_cls.name)
        special = {k: v for k, v in (getattr(self.tokenizer, "special_tokens_map", None) or {}).items()
                   if isinstance(v, str)}
        timeout = self.limits.chat_template_timeout
        result = await render_in_sandbox(template, inputs.messages, inputs.tools, inputs.add_generation_prompt,
                                         {**special, **inputs.variables}, timeout, self.max_prompt_chars)
        if result.host_busy:
            raise OpenAIError(f"{param}: the template renderer got too little CPU in {HOST_BUSY_TIMEOUT_S:g} s (the "
                              "server is overloaded); retry later", 503, "server_busy", param, "renderer_busy",
                              {"Retry-After": str(RETRY_AFTER_S)})
        if result.timed_out:
            raise bad_request(f"{param}: rendering the template took longer than {timeout:g} s of CPU "
                              "time, the limit (--chat-template-timeout); simplify it", param, "chat_template_timeout")
        if result.error is not None or result.text is None:
            raise bad_request(f"{param}: the template failed: {result.error}", param)
        text = continue_final(result.text, inputs, "continue_final_message")
        return await self._off_loop(self._tokenize, text, "messages", False)

    def _tool_mode(self, req: ChatCompletionRequest) -> tuple[list[ToolSchema], str, set[str]]:
        """(tools the model may call, 'none' | 'auto' | 'required' | 'named', their names)."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise bad_request("tool_choice needs tools: give the functions the model may call", "tool_choice")
            return [], "none", set()
        if choice is None:
            choice = "auto"
        if choice == "none":
            return [], "none", set()
        schemas = [ToolSchema(t.function.name, t.function.parameters or {"type": "object", "properties": {}},
                              f"tools[{i}].function.parameters") for i, t in enumerate(req.tools)]
        if choice == "auto" and not self.options.enable_auto_tool_choice:
            # vLLM's rule (and message): free-form tool calls are parsed only when asked for.
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              'set (tool_choice defaults to "auto" when tools are given; name a function or '
                              'use "required" or "none")', "tool_choice")
        if isinstance(choice, NamedToolChoice):
            chosen = [s for s in schemas if s.name == choice.function.name]
            if not chosen:
                raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools "
                                  f"({', '.join(s.name for s in schemas)})", "tool_choice.function.name")
            return chosen, "named", {chosen[0].name}
        return schemas, choice, {s.name for s in schemas}

    async def _chat_grammar(self, req: ChatCompletionRequest, tools: list[ToolSchema], mode: str) -> Any:
        fmt = req.response_format
        wants_json = fmt is not None and fmt.type != "text"
        if wants_json and tools:
            raise bad_request("response_format json_object/json_schema cannot be combined with tools "
                              "(unless tool_choice is 'none')", "response_format")
        structured = await self._structured_grammar(req)
        if structured is not None:
            if tools or wants_json:
                raise bad_request("structured_outputs / guided_* cannot be combined with tools or response_format",
                                  "structured_outputs")
            return structured
        try:
            if tools:
                return await asyncio.to_thread(self.engine.grammars.tool_calls, tools, mode,
                                               req.parallel_tool_calls is not False, self.tool_parser_cls.name)
            if wants_json:
                if fmt.type == "json_object":
                    return await asyncio.to_thread(self.engine.grammars.json, None, "response_format")
                if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    raise bad_request("response_format json_schema needs json_schema.schema",
                                      "response_format.json_schema")
                return await asyncio.to_thread(self.engine.grammars.json, fmt.json_schema.schema_,
                                               "response_format.json_schema.schema")
        except GrammarError as e:
            raise bad_request(str(e), e.param) from None
        return None

    def _chat_logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]], n: int) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            s = self._token_str(token_id)
            return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode("utf-8"))}

        content = []
        for token_id, position in zip(token_ids, lps):
            chosen, best = top_entries(token_id, position, n)
            content.append({**entry(token_id, chosen.logprob),
                            "top_logprobs": [entry(t, lp.logprob) for t, lp in best]})
        return {"content": content}

    def _prompt_tail(self, prompt_ids: list[int]) -> str:
        """The rendered prompt's last tokens as text, special tokens included (where a reasoning
        parser reads whether the reply starts inside the reasoning)."""
        return self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)

    def _reasoning_end_tokens(self) -> tuple[int, ...]:
        if self._reasoning_end_ids is None:
            marker = self.reasoning_parser_cls.reasoning_end
            self._reasoning_end_ids = tuple(self.tokenizer.encode(marker, add_special_tokens=False))
        return self._reasoning_end_ids

    async def _stream_chat(self, sub: _Submitted, response_id: str, model: str, num_logprobs: int | None,
                           include_usage: bool, replies: _ReplyParsers) -> AsyncIterator[str]:
        created = int(time.time())
        progress: dict[int, _ChoiceProgress] = {}
        usage = _Usage()

        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None,
                  stop_reason: Any = None) -> str:
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            body: dict[str, Any] = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return self._sse(body)

        async for _, out in self._merge(sub):
            for c in out.outputs:
                p = progress.setdefault(c.index, _ChoiceProgress())
                if p.finished:
                    continue
                if not p.started:
                    p.started = True
                    p.tool_parser, p.reasoning_parser = replies.for_stream()
                    yield chunk(c.index, {"role": "assistant", "content": ""})
                text, new_tokens, lps = p.advance(c)
                logprobs = (self._chat_logprobs(new_tokens, lps, num_logprobs)
                            if num_logprobs is not None and lps else None)
                delta = replies.delta(p.tool_parser, p.reasoning_parser, text, c.finish_reason is not None)
                if c.finish_reason is not None:
                    p.finished = True
                    usage.completion_tokens += len(c.token_ids)
                    calls = sum(x.num_calls for x in (p.tool_parser, p.reasoning_parser) if x is not None)
                    finish = "tool_calls" if calls else c.finish_reason
                    if delta or logprobs:
                        yield chunk(c.index, delta, logprobs)
                    yield chunk(c.index, {}, None, finish, c.stop_reason)
                elif delta or logprobs:
                    yield chunk(c.index, delta, logprobs)
            if out.finished:
                sub.finished.add(out.request_id)
                usage.add_prompt(out)
                self._record(out)
        if include_usage:
            yield self._sse({"id": response_id, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": [], "usage": usage.body()})
