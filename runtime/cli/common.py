"""Options shared by every `kiln` command that builds an engine (generate, chat, serve, compile),
derived from `EngineConfig`'s fields (kiln.runtime.config): names, defaults, help, choices."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing
from typing import Any

from kiln.runtime.config import MODEL_HELP, EngineConfig

_FIELD_TYPES = typing.get_type_hints(EngineConfig)


def _flag_type(name: str) -> Any:
    hint = _FIELD_TYPES[name]
    for t in (int, float, str):
        if hint is t or t in typing.get_args(hint):
            return t
    return str


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False, serving: bool = True) -> None:
    """The engine's options; `serving=False` (kiln compile) leaves out those that only matter
    when an engine runs (--compile, --require-cache)."""
    groups = {"engine": parser.add_argument_group("model and engine")}
    if model_positional:
        groups["engine"].add_argument("model", nargs="?", default=None, help=MODEL_HELP)
        # vLLM's scripts also write --model; kiln.runtime.cli.main merges the two.
        groups["engine"].add_argument("--model", dest="model_option", default=None, metavar="MODEL",
                                      help="the model, as a flag (same as the positional MODEL)")
    else:
        groups["engine"].add_argument("--model", "-m", default=None, help=MODEL_HELP)
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata
        if meta.get("flag") is None or (meta["serving_only"] and not serving):
            continue
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"])
        g = groups[meta["group"]]
        flag = meta["flag"] or "--" + f.name.replace("_", "-")
        flags = (flag, meta["short"]) if meta.get("short") else (flag,)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if _FIELD_TYPES[f.name] is bool:
            # "--no-x" switches a default-on option off; others ("--enforce-eager") switch one on.
            g.add_argument(flag, dest=f.name, action="store_false" if default else "store_true", help=meta["help"])
        elif isinstance(default, list):
            g.add_argument(flag, dest=f.name, action="append", default=[], metavar="NAME", help=meta["help"])
        else:
            shown = f" (default {default})" if default is not None else ""
            g.add_argument(*flags, dest=f.name, type=_flag_type(f.name), default=default, choices=meta["choices"],
                           help=meta["help"] + shown)
    cache = groups.setdefault("compile cache", parser.add_argument_group("compile cache"))
    cache.add_argument("--buckets", nargs="+", default=[], metavar="KIND:N,N",
                       help="bucket sizes instead of the default plan, e.g. --buckets decode:1,2,4 tokens:64,256")
    groups["engine"].add_argument("--verbose", "-v", action="store_true", help="log start-up phases and more")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments from parsed `add_engine_args` flags."""
    from kiln.compiler.buckets import parse_bucket_spec

    # Only the fields that have a flag here (and the model): a command's own option of the
    # same name (`kiln generate --seed`, the request's seed) is not an engine option.
    out = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
           if hasattr(args, f.name) and (f.metadata.get("flag") is not None or f.name == "model")}
    out["decode_buckets"], out["token_buckets"] = parse_bucket_spec(getattr(args, "buckets", []) or [])
    return out


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Start-up phase timings are always worth showing on stderr; each pass's stats only with
    # --verbose (warnings, e.g. a pass that matched nothing because another consumed its
    # pattern, always).
    logging.getLogger("kiln").setLevel(logging.INFO)
    logging.getLogger("kiln.passes").setLevel(logging.INFO if verbose else logging.WARNING)
