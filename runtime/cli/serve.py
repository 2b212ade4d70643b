"""`kiln serve`: build an engine from the command line and serve it over HTTP (kiln.runtime.serving)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from typing import Any

from kiln.runtime.serving.app import (DEFAULT_CHAT_TEMPLATE_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES,
                                      DEFAULT_MAX_WAITING_REQUESTS, DEFAULT_STATS_INTERVAL_S, PROMPT_CHARS_PER_TOKEN,
                                      ServerConfig, build_app)
from kiln.runtime.serving.parsers import REASONING_PARSERS, TOOL_PARSERS


def add_subcommands(sub: Any) -> None:
    from kiln.runtime.cli.common import add_engine_args

    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a Hugging Face hub id, directory or .gguf file; positional or --model) over an "
                    "OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                    "/detokenize, /version, /health, /metrics), with vLLM's options. Binds to 127.0.0.1 unless "
                    "--host says otherwise.",
    )
    add_engine_args(p, model_positional=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    g.add_argument("--api-key", default=os.environ.get("KILN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $KILN_API_KEY, else none)")
    g.add_argument("--served-model-name", action="append", default=None, metavar="NAME",
                   help="model name clients send (repeat for aliases; default: the model's path or name)")
    g.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="requests allowed to wait for the engine before new ones get 503; a request with more "
                        f"prompts than this gets 400 (default {DEFAULT_MAX_WAITING_REQUESTS})")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help=f"largest request body; a larger one gets 413 unread (default {DEFAULT_MAX_REQUEST_BYTES}, "
                        "4 MiB)")
    g.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest prompt (or conversation text) in characters; a longer one gets 400 before it is "
                        f"tokenized (default {PROMPT_CHARS_PER_TOKEN} x max_model_len)")
    g.add_argument("--allow-client-chat-template", action="store_true",
                   help="accept a chat template from clients (chat_template, or chat_template_kwargs.chat_template), "
                        "rendered in a sandboxed child process with a time limit (default: refused with 400)")
    g.add_argument("--chat-template-timeout", type=float, default=DEFAULT_CHAT_TEMPLATE_TIMEOUT_S,
                   help="CPU seconds a client's chat template may take to render (default "
                        f"{DEFAULT_CHAT_TEMPLATE_TIMEOUT_S:g})")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM (default 30)")
    g.add_argument("--uvicorn-log-level", "--log-level", dest="log_level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's log level (default warning)")
    v = p.add_argument_group("vLLM options")
    v.add_argument("--seed", type=int, default=None,
                   help="seed of the sampler for requests that give none (the same requests in the same order give "
                        "the same text)")
    v.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template (a file, or the template itself) used instead of the model's")
    v.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                   help="how tool calls are written by this model family, for parsing them and constraining "
                        "tool_choice (default hermes: <tool_call> JSON, Hermes / Qwen)")
    v.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="return the reasoning of this model family's replies apart from the answer, as "
                        "reasoning_content (qwen3, deepseek_r1: <think> tags; openai_gptoss: GPT-OSS's harmony "
                        "channels, tool calls included); a response_format or tool grammar then constrains only "
                        "the answer (default: none, the reply is all content)")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (the default when tools are given): the model may answer or call '
                        "tools, and calls are parsed with --tool-call-parser")
    v.add_argument("--disable-log-requests", action="store_true",
                   help="do not log one line per request (logged by default)")
    v.add_argument("--disable-log-stats", action="store_true",
                   help="do not log the throughput / KV-cache line every 10 s while serving")
    p.set_defaults(func=run_serve)


def default_served_name(model: str | None) -> str:
    if model is None:
        from kiln.compiler.model_source import default_model_path

        try:
            return default_model_path().stem
        except Exception:
            return "default"
    return model


def read_chat_template(value: str) -> str:
    """--chat-template: a file's contents, or the value itself when it is a template (as vLLM
    takes it); checked to compile, so a broken template fails at start-up, not per request."""
    from pathlib import Path

    import jinja2

    path = Path(value).expanduser()
    looks_like_template = any(marker in value for marker in ("{{", "{%"))
    if not looks_like_template:
        if not path.is_file():
            raise ValueError(f"--chat-template: {value} is neither a file nor a Jinja template")
        value = path.read_text()
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template: {e}") from None
    return value


def check_port_free(host: str, port: int) -> None:
    """Fail before the (slow) engine start if the address cannot be bound."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} cannot be resolved: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kiln.runtime.cli.common import engine_kwargs, setup_logging
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine

    setup_logging(args.verbose)
    for flag, value in (("--max-waiting-requests", args.max_waiting_requests),
                        ("--max-request-bytes", args.max_request_bytes),
                        ("--max-prompt-chars", 1 if args.max_prompt_chars is None else args.max_prompt_chars)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not args.chat_template_timeout > 0:
        raise ValueError(f"--chat-template-timeout must be > 0 seconds, got {args.chat_template_timeout}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty; give a key or leave the option out")
    chat_template = read_chat_template(args.chat_template) if args.chat_template is not None else None
    check_port_free(args.host, args.port)
    names = args.served_model_name or [default_served_name(args.model)]
    engine = LLMEngine(EngineConfig(**engine_kwargs(args), seed=args.seed))
    app = build_app(engine, ServerConfig(served_model_names=names, api_key=args.api_key,
                                         max_waiting_requests=args.max_waiting_requests,
                                         shutdown_timeout=args.shutdown_timeout,
                                         max_request_bytes=args.max_request_bytes,
                                         max_prompt_chars=args.max_prompt_chars,
                                         allow_client_chat_template=args.allow_client_chat_template,
                                         chat_template_timeout=args.chat_template_timeout,
                                         tool_call_parser=args.tool_call_parser,
                                         reasoning_parser=args.reasoning_parser,
                                         enable_auto_tool_choice=args.enable_auto_tool_choice,
                                         chat_template=chat_template,
                                         disable_log_requests=args.disable_log_requests,
                                         stats_interval=0.0 if args.disable_log_stats else DEFAULT_STATS_INTERVAL_S))
    where = f"http://{args.host}:{args.port}" if ":" not in args.host else f"http://[{args.host}]:{args.port}"
    print(f"kiln serve: {names[0]} on {where}/v1 (Ctrl-C to stop)", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=args.verbose)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM itself (graceful shutdown), then re-raises it once it has
    # restored the previous handler: with this one in place that ends in a clean exit 0
    # instead of death by signal.
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: terminated.append(sig))
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if terminated:
        print("kiln serve: stopped (SIGTERM)", file=sys.stderr, flush=True)
    # uvicorn exits quietly when it cannot bind (e.g. the port was taken meanwhile).
    return 0 if server.started else 1


