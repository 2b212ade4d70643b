"""The `kiln` command line. Each sub-command lives with the code it drives:

  kiln generate / chat   -> kiln.runtime.cli_generate
  kiln serve             -> kiln.runtime.server   (OpenAI-compatible HTTP server)
  kiln compile / cache   -> kiln.cache.cli        (ahead-of-time compile, cache tools)
  kiln passes            -> kiln.passes.cli       (pass pipeline inspection)

A module registers its sub-commands with `add_subcommands(subparsers)`; each parser sets
`func` to a callable taking the parsed args and returning an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = (
    "kiln.runtime.cli_generate",
    "kiln.runtime.server",
    "kiln.cache.cli",
    "kiln.passes.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln", description="Kiln: a compiler-first LLM execution engine.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                continue  # that part of Kiln is not built yet
            raise
        module.add_subcommands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
