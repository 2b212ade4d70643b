"""`kiln generate` and `kiln chat`: text from the terminal, streamed as it is generated."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kiln.runtime.cli_common import add_engine_args, engine_kwargs, setup_logging
from kiln.runtime.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); higher = more random")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1 = all)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed)


def add_subcommands(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate a continuation of each PROMPT",
                         description="Generate text for each PROMPT and stream it to the terminal.")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="prompt text (several run as one batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="interactive chat in the terminal (uses the chat template)",
                          description="Chat with the model. Type a message and press Enter; /exit or EOF quits.")
    chat.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=run_chat)


def _build_llm(args: argparse.Namespace) -> Any:
    from kiln.runtime.llm import LLM

    setup_logging(args.verbose)
    return LLM(**engine_kwargs(args))


def _stream(llm: Any, prompt: Any, params: SamplingParams) -> str:
    printed = ""
    for out in llm.stream(prompt, params):
        text = out.outputs[0].text
        if text.startswith(printed):
            sys.stdout.write(text[len(printed):])
            sys.stdout.flush()
            printed = text
    return printed


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = _build_llm(args)
    for i, prompt in enumerate(args.prompts):
        if len(args.prompts) > 1:
            print(f"--- [{i}] {prompt}")
        source = llm.apply_chat_template([{"role": "user", "content": prompt}]) if args.chat else prompt
        if not args.chat:
            sys.stdout.write(prompt)
        _stream(llm, source, params)
        sys.stdout.write("\n")
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = _build_llm(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stdout.write("> ")
            sys.stdout.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line.strip()})
        reply = _stream(llm, llm.apply_chat_template(history), params)
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": reply})
