"""The `kiln` command line, the one front door. Every sub-command's module is in this package,
so that the folders below `runtime/` (cache, passes, compiler) import nothing from it:

  kiln generate / chat   -> kiln.runtime.cli.generate
  kiln serve             -> kiln.runtime.cli.serve    (the server itself: kiln.runtime.serving)
  kiln compile / cache   -> kiln.runtime.cli.cache    (ahead-of-time compile, cache tools)
  kiln passes            -> kiln.runtime.cli.passes   (pass pipeline inspection)

A module registers its sub-commands with `add_subcommands(subparsers)`; each parser sets
`func` to a callable taking the parsed args and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = (
    "kiln.runtime.cli.generate",
    "kiln.runtime.cli.serve",
    "kiln.runtime.cli.cache",
    "kiln.runtime.cli.passes",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="Kiln: a compiler-first LLM execution engine.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from kiln.runtime.version import __version__

    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_subcommands(sub)
    return parser


def merge_model_option(args: argparse.Namespace) -> None:
    """Commands with a positional MODEL take `--model` too (vLLM's scripts write either):
    the flag's value becomes `args.model`; both, differing, is an error."""
    flag_model = getattr(args, "model_option", None)
    if flag_model is None:
        return
    if getattr(args, "model", None) not in (None, flag_model):
        raise ValueError(f"the model is given twice: {args.model!r} and --model {flag_model!r}")
    args.model = flag_model


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        merge_model_option(args)
    except ValueError as e:
        parser.error(str(e))
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"kiln {args.command}: error: {e}", file=sys.stderr)
        return 2

