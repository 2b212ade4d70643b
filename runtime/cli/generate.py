"""`kiln generate` and `kiln chat`: text from the terminal, streamed as it is generated.

  kiln generate "Once upon a time" --max-tokens 50
  kiln generate "What is 2+2?" "Name a color." --chat     # several prompts run as one batch
  kiln chat --system "You are terse."                      # interactive; also reads a pipe
  kiln generate --model DIR --prompt-token-ids 1,5,9        # a prompt as token ids (any model)

A model without a tokenizer (a `save_pretrained` directory of a config and weights) takes
token-id prompts only, and its output is printed as token ids: `[1, 5, 9] -> 17 3 3 ...`.

Generated text goes to stdout as it is produced; loading progress, errors and the optional
`--stats` line go to stderr, so stdout can be piped.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, TextIO

from kiln.runtime.cli.common import add_engine_args, engine_kwargs, setup_logging
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams

CHAT_EXIT_COMMANDS = ("/exit", "/quit")
CHAT_RESET_COMMAND = "/reset"


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, metavar="N",
                   help="most tokens to generate per reply (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="randomness: 0 = greedy, always the most likely token (default); ~0.7 for varied text")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: draw only from the most likely tokens whose probabilities "
                        "add up to P, in (0, 1] (default 1 = off)")
    g.add_argument("--top-k", type=int, default=-1, metavar="K",
                   help="draw only from the K most likely tokens (default -1 = off)")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P",
                   help="drop tokens less likely than P times the most likely one, in [0, 1] (default 0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="> 1 discourages repeating tokens of the prompt and reply (default 1 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="seed for reproducible sampling (same seed, same text at temperature > 0)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT appears (not printed); repeat for several")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating after the end-of-sequence token, up to --max-tokens")
    g.add_argument("--stats", action="store_true",
                   help="after each reply, print token count, time to first token and speed to stderr")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=list(args.stop),
        ignore_eos=args.ignore_eos,
    )


def parse_token_ids(text: str) -> list[int]:
    """`"1,5,9"` -> [1, 5, 9]; argparse reports the ValueError as a usage error."""
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids (e.g. 1,5,9)") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more non-negative token ids, e.g. 1,5,9")
    return ids


def add_subcommands(sub: Any) -> None:
    gen = sub.add_parser(
        "generate", help="generate text for each PROMPT, streamed to the terminal",
        description="Generate text for each PROMPT and stream it to stdout as it is produced. "
                    "Several prompts run together as one batch and are printed one after another. "
                    "Without --chat the prompt is echoed and continued; with --chat each prompt is "
                    "a user message and only the reply is printed.",
    )
    gen.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt text (quote it); give several for a batch")
    gen.add_argument("--prompt-token-ids", dest="prompt_token_ids", action="append", default=[], metavar="IDS",
                     type=parse_token_ids,
                     help="a prompt as comma-separated token ids, e.g. 1,5,9 (repeatable; run after the text "
                          "prompts in the same batch). A model without a tokenizer takes only these, and its "
                          "output is printed as token ids")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each PROMPT as a user message in the model's chat template")
    gen.add_argument("--system", default=None, metavar="TEXT", help="system message for --chat")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser(
        "chat", help="interactive chat in the terminal (uses the model's chat template)",
        description="Chat with the model: type a message and press Enter; the reply streams back. "
                    f"{CHAT_RESET_COMMAND} forgets the conversation; {' or '.join(CHAT_EXIT_COMMANDS)} or "
                    "end of input (Ctrl-D) quits. Reads one message per line, so a pipe works too.",
    )
    chat.add_argument("--system", default=None, metavar="TEXT", help="system message that starts the conversation")
    add_sampling_args(chat)
    add_engine_args(chat, model_positional=True)
    chat.set_defaults(func=run_chat)


def _build_llm(args: argparse.Namespace) -> Any:
    from kiln.runtime.llm import LLM

    setup_logging(args.verbose)
    print(f"kiln: loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...", file=sys.stderr, flush=True)
    kwargs = engine_kwargs(args)
    kwargs.setdefault("progress", True)  # the weight-loading progress bar
    return LLM(**kwargs)


def _print_stats(out: RequestOutput, err: TextIO) -> None:
    m = out.metrics
    comp = out.outputs[0]
    parts = [f"{len(comp.token_ids)} tokens", f"finish: {comp.finish_reason}"]
    if m is not None and m.time_to_first_token is not None:
        parts.append(f"time to first token {m.time_to_first_token:.2f}s")
    if m is not None and m.time_per_output_token:
        parts.append(f"{1.0 / m.time_per_output_token:.1f} tokens/s")
    if out.num_cached_tokens:
        parts.append(f"{out.num_cached_tokens} prompt tokens from the prefix cache")
    print(f"[{', '.join(parts)}]", file=err, flush=True)


def _text(out: RequestOutput) -> str:
    return out.outputs[0].text_delta


def stream_in_order(engine: Any, prompts: list[Any], params: SamplingParams, write: Callable[[str], None],
                    before: Callable[[int], None], after: Callable[[int, RequestOutput], None],
                    render: Callable[[RequestOutput], str] = _text) -> list[RequestOutput]:
    """Run all prompts as one batch; write each one's text in prompt order as it streams.

    The prompt being shown streams live; later ones keep generating in the same batch and
    their text is shown, caught up, once it is their turn. A bad prompt is reported (by its
    index) before any generation starts.
    """
    ids = [f"cli-{i}" for i in range(len(prompts))]
    added: list[str] = []
    try:
        for i, (rid, prompt) in enumerate(zip(ids, prompts)):
            try:
                engine.add_request(rid, prompt, params)
            except ValueError as e:
                raise ValueError(f"prompt {i + 1}: {e}" if len(prompts) > 1 else str(e)) from e
            added.append(rid)
        pending: dict[str, list[str]] = {rid: [] for rid in ids}
        final: dict[str, RequestOutput] = {}
        shown = 0
        before(0)
        while shown < len(ids):
            for out in engine.step():
                pending[out.request_id].append(render(out))
                if out.finished:
                    final[out.request_id] = out
            while shown < len(ids):
                rid = ids[shown]
                if pending[rid]:
                    write("".join(pending[rid]))
                    pending[rid].clear()
                if rid not in final:
                    break
                after(shown, final[rid])
                shown += 1
                if shown < len(ids):
                    before(shown)
        return [final[rid] for rid in ids]
    finally:
        for rid in added:
            engine.abort(rid)  # no-op for finished requests; frees the rest on Ctrl-C


def run_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    token_prompts: list[list[int]] = list(args.prompt_token_ids)
    if not args.prompts and not token_prompts:
        raise ValueError("give a PROMPT or --prompt-token-ids IDS")
    if args.chat and token_prompts:
        raise ValueError("--chat renders text messages; --prompt-token-ids prompts are token ids already")
    llm = _build_llm(args)
    out, err = sys.stdout, sys.stderr
    if args.prompts and llm.tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot read text prompts; pass token ids: "
                         "--prompt-token-ids 1,5,9")
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system else []
        prompts: list[Any] = [llm.apply_chat_template(system + [{"role": "user", "content": p}]) for p in args.prompts]
    else:
        prompts = list(args.prompts)
    prompts += token_prompts
    shown = [str(p) for p in args.prompts] + [str(ids) for ids in token_prompts]
    as_ids = llm.tokenizer is None  # then the output is token ids too

    def write(text: str) -> None:
        out.write(text)
        out.flush()

    def before(i: int) -> None:
        if len(prompts) > 1:
            write(f"--- [{i + 1}/{len(prompts)}] {shown[i]}\n")
        if as_ids:
            write(f"{shown[i]} ->")
        elif not args.chat:
            write(args.prompts[i] if i < len(args.prompts) else llm.tokenizer.decode(prompts[i]))

    def after(i: int, result: RequestOutput) -> None:
        write("\n")
        if args.stats:
            _print_stats(result, err)

    render = (lambda o: "".join(f" {t}" for t in o.outputs[0].token_ids_delta)) if as_ids else _text
    stream_in_order(llm.engine, prompts, params, write, before, after, render=render)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = _build_llm(args)
    out, err = sys.stdout, sys.stderr
    start: list[dict[str, str]] = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"kiln chat: type a message; {CHAT_RESET_COMMAND} starts over, {CHAT_EXIT_COMMANDS[0]} quits.",
              file=err, flush=True)
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = sys.stdin.readline()
        if not line or line.strip() in CHAT_EXIT_COMMANDS:
            return 0
        message = line.strip()
        if not message:
            continue
        if message == CHAT_RESET_COMMAND:
            history = list(start)
            continue
        history.append({"role": "user", "content": message})
        reply: list[str] = []
        last = None
        try:
            for result in llm.stream(llm.apply_chat_template(history), params):
                delta = result.outputs[0].text_delta
                reply.append(delta)
                out.write(delta)
                out.flush()
                last = result
        except ValueError as e:  # e.g. the conversation outgrew max_model_len: say so, keep chatting
            history.pop()
            print(f"kiln chat: error: {e} ({CHAT_RESET_COMMAND} starts over)", file=err, flush=True)
            continue
        out.write("\n")
        out.flush()
        if args.stats and last is not None:
            _print_stats(last, err)
        history.append({"role": "assistant", "content": "".join(reply)})
