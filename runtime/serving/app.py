"""`kiln serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

    GET  /v1/models              the served model
    POST /v1/completions         prompt(s) -> text (stream with SSE)
    POST /v1/chat/completions    messages (+ tools) -> reply or tool calls (stream with SSE)
    POST /tokenize               prompt or messages -> token ids (vLLM's)
    POST /detokenize             token ids -> text (vLLM's)
    GET  /version                {"version": Kiln's version}
    GET  /health                 200 while the engine runs, 503 otherwise
    GET  /metrics                Prometheus text format (vLLM's metric names, `kiln:` prefix)

Errors use OpenAI's format, {"error": {"message", "type", "param", "code"}}, with the HTTP
status saying whose fault it was: 400 bad input (the message names the field), 401 a
missing or wrong API key (when the server has one), 404 an unknown model or path, 413 a
body over `max_request_bytes`, 503 with Retry-After when the waiting queue is full, 500
when the engine failed on the request.

The event loop only moves bytes: parsing the body (after a check of its JSON nesting
depth and its text), tokenizing and rendering templates run in a small thread pool, so
`/health` and every other request are answered while a large request is prepared.

The app is built by `build_app(engine, ServerConfig)`, so tests and embedders can serve an
engine they built themselves; `kiln serve` builds the engine from the command line, binds
to loopback unless told otherwise, and shuts down cleanly on SIGINT/SIGTERM: uvicorn stops
accepting, in-flight requests get `--shutdown-timeout` seconds to finish, then whatever is
left is aborted and the engine thread stopped.
"""


import asyncio
import hmac
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

logger = logging.getLogger("kiln.runtime.serving.app")

DEFAULT_MAX_WAITING_REQUESTS = 512
# A request body bigger than this is refused (413) before it is parsed. Parsing JSON holds
# the GIL throughout, in proportion to the body's size, which stalls the event loop too, so
# this bound is what keeps /health prompt (runtime/README.md: request limits); 4 MiB still holds a
# dozen prompts at the default character limit.
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
# Threads that parse bodies, tokenize and render templates (two: enough to keep the loop
# free, few enough that heavy requests queue rather than starve the engine thread).
DEFAULT_PREPARE_THREADS = 2
# Default prompt-size limit, in characters per token of max_model_len: a token is a few
# characters long, so a prompt over this cannot fit the context anyway.
PROMPT_CHARS_PER_TOKEN = 32
DEFAULT_CHAT_TEMPLATE_TIMEOUT_S = 2.0
# vLLM's period for its throughput / KV-usage log line while serving.
DEFAULT_STATS_INTERVAL_S = 10.0


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    shutdown_timeout: float = 30.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN x max_model_len
    allow_client_chat_template: bool = False
    chat_template_timeout: float = DEFAULT_CHAT_TEMPLATE_TIMEOUT_S
    prepare_threads: int = DEFAULT_PREPARE_THREADS
    # vLLM's options (kiln.runtime.serving.vllm_compat.ServingOptions).
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    chat_template: str | None = None  # the server's template, used instead of the tokenizer's
    disable_log_requests: bool = False
    stats_interval: float = DEFAULT_STATS_INTERVAL_S  # the throughput / KV line; 0: off


def build_app(engine: Any, config: ServerConfig) -> Any:
    """The FastAPI app serving `engine` (an LLMEngine). Its engine thread starts with the
    app's lifespan and stops at its shutdown."""
    # Imported here, not at the top: the `kiln` CLI imports this module for `add_subcommands`,
    # and the other sub-commands should not pay for (or need) the server's dependencies.
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from pydantic import BaseModel
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from kiln.runtime.serving.async_engine import AsyncLLMEngine
    from kiln.runtime.serving.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, bad_request,
                                              server_error)
    from kiln.runtime.serving.openai_serving import ClientDisconnected, OpenAIServing, RequestLimits
    from kiln.runtime.serving.metrics import CONTENT_TYPE, ServerMetrics, StatsLogger
    from kiln.runtime.serving.parsers import get_reasoning_parser, get_tool_parser
    from kiln.runtime.serving.vllm_compat import (DetokenizeRequest, ServingOptions, TokenizeRequest, detokenize,
                                                  tokenize)
    from kiln.runtime.version import __version__

    for name in ("max_request_bytes", "prepare_threads"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")
    if config.max_prompt_chars is not None and config.max_prompt_chars < 1:
        raise ValueError(f"max_prompt_chars must be >= 1, got {config.max_prompt_chars}")
    if not config.chat_template_timeout > 0:
        raise ValueError(f"chat_template_timeout must be > 0 seconds, got {config.chat_template_timeout}")
    get_tool_parser(config.tool_call_parser)  # an unknown name fails here, naming the choices
    if config.reasoning_parser is not None:
        get_reasoning_parser(config.reasoning_parser)
    if config.stats_interval < 0:
        raise ValueError(f"stats_interval must be >= 0 seconds (0: off), got {config.stats_interval}")
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=config.max_waiting_requests)
    metrics = ServerMetrics(async_engine, cache_info=lambda: _cache_info(engine),
                            model_name=config.served_model_names[0] if config.served_model_names else "kiln")
    # Owned by this app (two apps in one process do not share it); shut down with it.
    prepare_pool = ThreadPoolExecutor(max_workers=config.prepare_threads, thread_name_prefix="kiln-prepare")
    start_pool_threads(prepare_pool, config.prepare_threads)
    limits = RequestLimits(max_prompt_chars=config.max_prompt_chars,
                           allow_client_chat_template=config.allow_client_chat_template,
                           chat_template_timeout=config.chat_template_timeout)
    options = ServingOptions(tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser,
                             enable_auto_tool_choice=config.enable_auto_tool_choice,
                             chat_template=config.chat_template, log_requests=not config.disable_log_requests)
    serving = OpenAIServing(async_engine, config.served_model_names, metrics, limits, prepare_pool, options)
    api_key = config.api_key.encode() if config.api_key else None
    max_bytes = config.max_request_bytes

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await async_engine.start()
        stats = (asyncio.get_running_loop().create_task(StatsLogger(metrics, async_engine, config.stats_interval).run())
                 if config.stats_interval > 0 else None)
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
            await async_engine.shutdown(timeout=config.shutdown_timeout)
            prepare_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="Kiln", summary="OpenAI-compatible server for the Kiln engine", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    def error_response(e: OpenAIError, endpoint: str) -> JSONResponse:
        metrics.record_request(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise OpenAIError("missing API key: send it as 'Authorization: Bearer <key>'", 401,
                              "invalid_request_error", None, "invalid_api_key")
        if not hmac.compare_digest(token.strip().encode(), api_key):
            raise OpenAIError("incorrect API key provided", 401, "invalid_request_error", None, "invalid_api_key")

    async def parse_body(request: Request, model: type[BaseModel]) -> Any:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise OpenAIError(f"the request body is {int(declared)} bytes; the limit is {max_bytes} "
                              "(--max-request-bytes)", 413, "invalid_request_error", None, "request_too_large")
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > max_bytes:
                raise OpenAIError(f"the request body is over the limit of {max_bytes} bytes (--max-request-bytes)",
                                  413, "invalid_request_error", None, "request_too_large")
        return await asyncio.get_running_loop().run_in_executor(prepare_pool, parse_request_body, bytes(raw), model)

    def disconnect_waiter(request: Request) -> Callable[[], Awaitable[None]]:
        async def wait() -> None:
            # After the body is read, the next ASGI message is the disconnect.
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    return
        return wait

    async def generate(request: Request, endpoint: str, model: type[BaseModel],
                       handler: Callable[..., Awaitable[Any]]) -> Any:
        try:
            check_api_key(request)
            body = await parse_body(request, model)
            result = await handler(body, disconnect_waiter(request))
        except OpenAIError as e:
            return error_response(e, endpoint)
        except ClientDisconnected:
            metrics.record_request(endpoint, 499)  # nginx's "client closed request"
            return Response(status_code=499)
        except Exception as e:  # a bug: answer 500 in OpenAI's format, keep serving
            logger.exception("%s failed", endpoint)
            return error_response(server_error(f"internal error: {type(e).__name__}: {e}"), endpoint)
        metrics.record_request(endpoint, 200)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await generate(request, "/v1/completions", CompletionRequest, serving.create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await generate(request, "/v1/chat/completions", ChatCompletionRequest, serving.create_chat_completion)

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        try:
            check_api_key(request)
        except OpenAIError as e:
            return error_response(e, "/v1/models")
        metrics.record_request("/v1/models", 200)
        return {"object": "list", "data": serving.model_cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Any:
        try:
            check_api_key(request)
            serving.check_model(model_id)
        except OpenAIError as e:
            return error_response(e, "/v1/models/{model}")
        metrics.record_request("/v1/models/{model}", 200)
        return next(card for card in serving.model_cards() if card["id"] == model_id)

    async def simple(request: Request, endpoint: str, model: type[BaseModel], fn: Callable[[Any], Any]) -> Any:
        """A small endpoint: key check, body parsing, `fn(body)` in a worker thread; a
        ValueError from it is a 400 naming the field its message starts with."""
        try:
            check_api_key(request)
            body = await parse_body(request, model)
            serving.check_model(getattr(body, "model", None))
            try:
                result = await asyncio.get_running_loop().run_in_executor(prepare_pool, fn, body)
            except ValueError as e:
                raise bad_request(str(e), str(e).split(":", 1)[0]) from None
        except OpenAIError as e:
            return error_response(e, endpoint)
        metrics.record_request(endpoint, 200)
        return result

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request) -> Any:
        return await simple(request, "/tokenize", TokenizeRequest, lambda body: tokenize(
            engine.tokenizer, body, config.chat_template, int(engine.max_model_len)))

    @app.post("/detokenize")
    async def detokenize_endpoint(request: Request) -> Any:
        return await simple(request, "/detokenize", DetokenizeRequest, lambda body: detokenize(
            engine.tokenizer, body, int(engine.model_config.vocab_size)))

    @app.get("/version")
    async def version() -> Any:
        return {"version": __version__}

    @app.get("/health")
    async def health() -> Any:
        if async_engine.is_healthy:
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Any:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = (f"no such endpoint: {request.method} {request.url.path}" if exc.status_code == 404
                   else str(exc.detail))
        return JSONResponse(OpenAIError(message, exc.status_code, "invalid_request_error", None, code).body(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path"))
        e = bad_request(f"{loc}: {err.get('msg', 'invalid value')}" if loc else str(exc), loc or None)
        return JSONResponse(e.body(), status_code=400)

    return app


def start_pool_threads(pool: ThreadPoolExecutor, n: int) -> None:
    """Start all `n` threads of `pool` now. The pool starts a thread lazily, inside `submit`
    on the event loop, and `Thread.start` returns only once the loop's thread gets the GIL
    back from the new thread, which runs the submitted work first: C calls that hold the GIL
    throughout (decoding and parsing a 4 MB body) kept the loop, and /health, waiting for
    them (105 ms and 331 ms in `Thread.start`, under a profiler, on a loaded 2-core machine)."""
    barrier = threading.Barrier(n)  # each task waits for the others: n tasks, n threads
    for future in [pool.submit(barrier.wait) for _ in range(n)]:
        future.result()


def parse_request_body(raw: bytes, model: Any) -> Any:
    """A request body -> `model` (a pydantic model), or OpenAIError 400 naming what is wrong.
    Blocking (the server runs it in its worker threads). In order: the nesting depth (before
    any parser recurses), JSON, the text of every field (lone surrogates, bytes that are
    not UTF-8), then the model's fields."""
    from pydantic import ValidationError

    from kiln.runtime.serving.protocol import (bad_request, check_json_depth, decode_body, find_bad_text,
                                              may_hold_bad_text, validation_error)

    if not raw.strip():
        raise bad_request("the request body is empty: send a JSON object")
    check_json_depth(raw)
    text = decode_body(raw)
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the request body must be a JSON object, not {type(data).__name__}")
    if may_hold_bad_text(raw, text):
        found = find_bad_text(data)
        if found is not None:
            raise bad_request(f"{found[0]}: {found[1]}", found[0] if found[0] != "(body)" else None, "invalid_text")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a valid JSON number")


def _cache_info(engine: Any) -> dict[str, int]:
    """Graph buckets by where start-up got them: {"cache": hits, "compiled": compiled here}.
    Empty in eager mode (nothing is compiled)."""
    report = getattr(engine, "startup_report", None)
    buckets = getattr(report, "buckets", None) or []
    counts: dict[str, int] = {}
    for b in buckets:
        source = {"hit": "cache"}.get(str(b.status), str(b.status))
        counts[source] = counts.get(source, 0) + 1
    return counts


__all__ = ["ServerConfig", "build_app", "parse_request_body", "DEFAULT_MAX_WAITING_REQUESTS",
           "DEFAULT_MAX_REQUEST_BYTES"]
