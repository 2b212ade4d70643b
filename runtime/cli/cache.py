"""`kiln compile` (ahead-of-time compile into the cache) and `kiln cache ...` (inspect and move it).

    kiln compile [MODEL] [engine options] [--buckets ...] [--cache-dir D] [--compile auto|inductor|graph] [--dry-run]
    kiln cache ls | info KEY | verify | clear | export FILE | import FILE | explain [MODEL] [options]

`kiln compile` takes the same engine options as `kiln serve`, because they decide the
bucket plan and the cache keys: compile with the options you will serve with. What it
fills depends on the device (kiln.compiler.startup.artifact_mode): on CPU an AOTInductor
package per bucket, on CUDA the post-pass FX graph as code (`--compile` overrides).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from typing import Any, Iterator, TextIO


def add_subcommands(sub: Any) -> None:
    from kiln.runtime.cli.common import add_engine_args

    comp = sub.add_parser(
        "compile", help="fill the compile cache for a model (ahead of time)",
        description="Fill the compile cache for MODEL, so that engines started later with the same options "
                    "start warm. On CPU: compile the post-pass graph with Inductor for every bucket of the "
                    "plan. On CUDA: store the post-pass FX graph itself as code (AOTInductor CUDA packages "
                    "do not load on torch 2.11+cu130), then run every bucket once on the GPU (dummy weights) "
                    "and store the binaries of every Triton kernel they ran. Exits non-zero if any bucket "
                    "fails.",
    )
    add_engine_args(comp, model_positional=True, serving=False)
    _add_mode_arg(comp)
    comp.add_argument("--dry-run", action="store_true", help="print the bucket plan and cache keys; compile nothing")
    comp.set_defaults(func=run_compile)

    cache = sub.add_parser("cache", help="inspect, check and move the compile cache",
                           description="Inspect, check, clear, export and import Kiln's compile cache.")
    csub = cache.add_subparsers(dest="cache_command", metavar="ACTION")

    def action(name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
        p = csub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--cache-dir", default=None, metavar="DIR",
                       help="compile cache directory (default: $KILN_CACHE_DIR or ~/.cache/kiln)")
        p.set_defaults(func=func)
        return p

    action("ls", "list the cache's entries", run_ls)
    info = action("info", "show one entry's manifest (key or unique key prefix)", run_info)
    info.add_argument("key", metavar="KEY")
    verify = action("verify", "check every entry's bytes against its checksum; drop corrupt ones; list data files "
                              "no entry points to", run_verify)
    verify.add_argument("--repair", action="store_true",
                        help="also store again the orphan data files that match a manifest, and remove the rest")
    action("clear", "remove every entry (and every orphan data file)", run_clear)
    exp = action("export", "write every entry to a tar file", run_export)
    exp.add_argument("file", metavar="FILE")
    imp = action("import", "add the entries of a file written by `kiln cache export`", run_import)
    imp.add_argument("file", metavar="FILE")
    explain = csub.add_parser("explain", help="which buckets of MODEL would hit, and why the others miss",
                              description="For MODEL and engine options, say which buckets the cache holds "
                                          "and, for each miss, which key factor differs from the nearest entry.")
    add_engine_args(explain, model_positional=True, serving=False)
    _add_mode_arg(explain)
    explain.set_defaults(func=run_explain)
    cache.set_defaults(func=lambda args: (cache.print_help(), 2)[1])


# ---- helpers ---------------------------------------------------------------------------------

def _add_mode_arg(parser: argparse.ArgumentParser) -> None:
    # dest is not "compile": engine_kwargs() reads args.compile as the engine's option
    # (with --require-cache), which these commands do not have.
    parser.add_argument("--compile", dest="compile_mode", default="auto", choices=["auto", "inductor", "graph"],
                        help="which artifact: inductor (a package per bucket), graph (the post-pass FX graph as "
                             "code), or auto (graph on CUDA, inductor on CPU; what an engine's compile='auto' uses)")


def _mode(args: argparse.Namespace, setup: Any) -> str:
    from kiln.compiler.startup import artifact_mode

    mode = getattr(args, "compile_mode", "auto")
    return artifact_mode(setup.device) if mode == "auto" else mode


@contextlib.contextmanager
def _store(args: argparse.Namespace) -> Iterator[Any]:
    """The store at --cache-dir, opened (damaged databases are rebuilt on open, with a warning);
    a database error while it is used becomes a one-line error naming the directory, not a traceback."""
    import sqlite3

    from kiln.cache.store import ArtifactStore, CacheStoreError

    store = ArtifactStore(args.cache_dir)
    try:
        yield store  # a database rebuilt on open was reported by the store's warning (logger kiln.cache)
    except sqlite3.Error as e:
        raise CacheStoreError(f"the cache database in {store.root} failed while in use ({e}); run the command again "
                              "(a damaged database is rebuilt when the cache is opened)") from None
    finally:
        with contextlib.suppress(Exception):
            store.close()


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def print_table(rows: list[list[str]], header: list[str], out: TextIO | None = None) -> None:
    out = out or sys.stdout
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    print(line(header), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print(line(r), file=out)


def _setup(args: argparse.Namespace) -> Any:
    """The ModelSetup for a model and engine options (config only: no weights are read)."""
    from kiln.compiler.startup import setup_for_engine
    from kiln.compiler.model_source import resolve_model
    from kiln.runtime.cli.common import engine_kwargs
    from kiln.runtime.config import EngineConfig

    config = EngineConfig(**engine_kwargs(args))
    device = config.resolved_device()
    dtype = config.resolved_dtype(device)
    source = resolve_model(config.model, "dummy" if config.load_format == "dummy" else "auto",
                           revision=config.revision, download_dir=config.download_dir)
    setup = setup_for_engine(config.compile_options(source.config), source.config, dtype, device)
    args.raw_config = source.raw_config  # for store_config_snapshot after a compile
    return setup


def _rank_setups(args: argparse.Namespace) -> list[Any]:
    """One ModelSetup per tensor-parallel rank (each rank's graph is its own cache entry)."""
    import dataclasses

    setup = _setup(args)
    return [dataclasses.replace(setup, tp_rank=rank) for rank in range(setup.tp_size)]


def _rank_label(setup: Any) -> str:
    return f" [tensor-parallel rank {setup.tp_rank} of {setup.tp_size}]" if setup.tp_size > 1 else ""


# ---- kiln compile ----------------------------------------------------------------------------

def run_compile(args: argparse.Namespace) -> int:
    """`kiln compile`: every bucket of the model, of every rank with -tp N."""
    from kiln.runtime.cli.common import setup_logging

    setup_logging(args.verbose)
    status = 0
    for setup in _rank_setups(args):
        if setup.tp_size > 1:
            print(f"kiln compile:{_rank_label(setup)}", file=sys.stderr)
        status = max(status, _compile_rank(args, setup))
    return status


def _compile_rank(args: argparse.Namespace, setup: Any) -> int:
    from kiln.compiler.startup import prepare_compiled, store_config_snapshot

    if _mode(args, setup) == "graph":
        return _run_compile_graph(args, setup)
    with _store(args) as store:
        keys = setup.bucket_keys()
        if args.dry_run:
            print(setup.plan.describe())
            print(f"model: {setup.model_type}  dtype: {str(setup.dtype).removeprefix('torch.')}  "
                  f"device: {setup.device.type}  cache: {store.root}")
            rows = [["graph", setup.model_key(), "cached" if setup.model_key() in store else "to compile"]]
            rows += [[b.name, k, "cached" if k in store else "to compile"] for b, k in keys.items()]
            print_table(rows, ["entry", "key", "state"])
            return 0
        print(f"kiln compile: {len(keys)} buckets of {setup.model_type} "
              f"({str(setup.dtype).removeprefix('torch.')}, {setup.device.type}) into {store.root}", file=sys.stderr)
        prepared = prepare_compiled(setup, store, progress=True, load=False)
        store_config_snapshot(store, args.raw_config, setup.config)
    report = prepared.report
    rows = [[r.bucket.name, "cache hit" if r.status == "hit" else r.status, f"{r.seconds:.1f}",
             _size(r.size) if r.size else "-", r.key] for r in report.buckets]
    print_table(rows, ["bucket", "result", "seconds", "size", "key"])
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in report.timings.items())
    print(f"{report.num_from_cache} from cache, {report.num_compiled} compiled ({phases})")
    failed = [r for r in report.buckets if r.status == "failed"]
    for r in failed:
        print(f"kiln compile: bucket {r.bucket.name} failed: {r.error}", file=sys.stderr)
    if failed:
        return 1
    return _take_triton_kernels(args, setup, "inductor") if setup.device.type == "cuda" else 0


def _run_compile_graph(args: argparse.Namespace, setup: Any) -> int:
    """`kiln compile` in mode "graph": the graph spec and the post-pass graph's code, no buckets."""
    from kiln.compiler.startup import prepare_graph, store_config_snapshot

    model_key, code_key = setup.model_key(), setup.graph_code_key()
    where = f"{setup.model_type} ({str(setup.dtype).removeprefix('torch.')}, {setup.device.type})"
    with _store(args) as store:
        if args.dry_run:
            print(f"model: {setup.model_type}  dtype: {str(setup.dtype).removeprefix('torch.')}  "
                  f"device: {setup.device.type}  compile mode: graph (no per-bucket artifacts)  cache: {store.root}")
            rows = [[label, key, "cached" if key in store else "to capture"]
                    for label, key in (("graph", model_key), ("graph-code", code_key))]
            print_table(rows, ["entry", "key", "state"])
            return 0
        print(f"kiln compile: the post-pass graph of {where} as code into {store.root} "
              "(compile mode graph: no per-bucket packages)", file=sys.stderr)
        had = {key: key in store for key in (model_key, code_key)}
        prepared = prepare_graph(setup, store)
        store_config_snapshot(store, args.raw_config, setup.config)
        sizes = {key: (m.size if (m := store.manifest(key)) is not None else 0) for key in (model_key, code_key)}
    report = prepared.report
    dropped = {key for key, _ in report.dropped}
    rows = []
    for label, key in (("graph", model_key), ("graph-code", code_key)):
        result = "stored" if key in report.stored else ("cache hit" if had[key] and key not in dropped else "-")
        rows.append([label, result, _size(sizes[key]) if sizes[key] else "-", key])
    print_table(rows, ["entry", "result", "size", "key"])
    phases = ", ".join(f"{k} {v:.1f}s" for k, v in report.timings.items())
    print(f"{report.summary()} ({phases})")
    if report.mode != "graph":
        print(f"kiln compile: {report.note}", file=sys.stderr)
        return 1
    if setup.device.type == "cuda":
        return _take_triton_kernels(args, setup, "graph")
    return 0


def _take_triton_kernels(args: argparse.Namespace, setup: Any, mode: str) -> int:
    """CUDA: start an engine on the device (dummy weights) from the entries just stored; it runs
    every bucket once and stores the Triton kernels (kiln.compiler.triton_kernels), so that a
    server starting from this cache on another machine compiles nothing."""
    from kiln.runtime.cli.common import engine_kwargs
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine

    if setup.tp_size > 1:  # each rank's worker would have to take its own (not built yet)
        print("kiln compile: Triton kernels are not cached for tensor-parallel setups yet; the workers compile "
              "them on first use", file=sys.stderr)
        return 0
    key = setup.triton_kernels_key()
    with _store(args) as store:
        if key in store:
            print_table([["triton-kernels", "cache hit", "-", key]], ["entry", "result", "size", "key"])
            return 0
    config = EngineConfig(**{**engine_kwargs(args), "load_format": "dummy", "compile": mode, "progress": False})
    print(f"kiln compile: running every bucket once on {setup.device} to take its Triton kernels",
          file=sys.stderr)
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    report = engine.startup_report
    with _store(args) as store:
        extra = _serve_a_workload(engine, store, key) if key in store else ""
        manifest = store.manifest(key)
    seconds = time.perf_counter() - t0
    del engine
    print_table([["triton-kernels", "stored" if manifest is not None else "not stored",
                  _size(manifest.size) if manifest is not None else "-", key]], ["entry", "result", "size", "key"])
    print(f"{report.triton}{extra} ({seconds:.1f}s)")
    return 0 if manifest is not None else 1


def _serve_a_workload(engine: Any, store: Any, key: str) -> str:
    """Serve a few requests of mixed lengths (chunked prefills, decode batches of several
    sizes) after start-up, Triton pointed at a fresh folder: kernel variants that only real
    steps meet (they are specialised on values start-up's warm-up did not use) are compiled
    there and added to the entry. Returns what was added, for the summary line."""
    from kiln.cache.manifest import Manifest
    from kiln.compiler.triton_kernels import capture_triton_kernels, merge_triton_entries
    from kiln.runtime.sampling_params import SamplingParams

    vocab = int(engine.model_config.vocab_size)
    longest = max(1, min(engine.max_model_len - 9, engine.config.max_num_batched_tokens + 7))
    lengths = sorted({1, 3, 17, min(100, longest), longest})
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with capture_triton_kernels(store.root / "tmp") as capture:
        for i, n in enumerate(lengths):
            engine.add_request(f"kiln-compile-warm-{i}", [(7 * j + i) % vocab for j in range(n)], params)
        while engine.has_unfinished():
            engine.step()
    if capture.data is None:
        return ""
    entry = store.get(key)
    old = store.manifest(key)
    if entry is None or old is None:
        return ""
    data, kernels = merge_triton_entries([entry.data, capture.data], store.root / "tmp")
    extra = {**old.extra, "kernels": kernels, "compiled_serving": capture.count.compiled}
    with store.lock(key):
        store.delete(key)
        store.put(Manifest(key=key, kind=old.kind, label=old.label, model=old.model, factors=old.factors,
                           checksum="", size=0, created=old.created, extra=extra), data)
    return f"; {capture.count.compiled} more compiled while serving a few requests, added ({kernels} kernels)"


# ---- kiln cache ... --------------------------------------------------------------------------

def run_ls(args: argparse.Namespace) -> int:
    from kiln.cache.keys import BUCKET_KIND

    with _store(args) as store:
        manifests = store.manifests()
        if not manifests:
            print(f"{store.root}: empty")
            return 0
        rows = []
        for m in manifests:
            f = m.factors
            created = datetime.datetime.fromtimestamp(m.created).strftime("%Y-%m-%d %H:%M")
            rows.append([m.key, m.model, m.label, f.get("dtype", "?"), f"{f.get('device', '?')}/{f.get('capability', '?')}",
                         _size(m.size), f"{m.compile_seconds:.1f}" if m.kind == BUCKET_KIND else "-", created])
        print_table(rows, ["key", "model", "entry", "dtype", "device", "size", "compile s", "created"])
        print(f"{len(manifests)} entries, {_size(store.volume())} of {_size(store.size_limit)} ({store.root})")
    return 0


def run_info(args: argparse.Namespace) -> int:
    with _store(args) as store:
        matches = [m for m in store.manifests() if m.key.startswith(args.key)]
        if not matches:
            raise ValueError(f"no cache entry has a key starting with {args.key!r} in {store.root} (see `kiln cache ls`)")
        if len(matches) > 1:
            raise ValueError(f"key prefix {args.key!r} matches {len(matches)} entries; give more of the key")
        m = matches[0]
        info = json.loads(m.to_json())
        path = store.entry_path(m.key)
        info["path"] = str(path) if path else None
        info["passes"] = _entry_passes(store, m)
        print(json.dumps(info, indent=2, sort_keys=True))
    return 0


def _entry_passes(store: Any, manifest: Any) -> list[dict[str, Any]]:
    """The pass pipeline an entry was built with, in run order: from the graph spec of a
    graph entry (with each pass's stats), else name and uuid from the key factors."""
    from kiln.cache.keys import MODEL_KIND
    from kiln.compiler.pipeline import GraphSpec, GraphSpecError

    if manifest.kind == MODEL_KIND:
        entry = store.get(manifest.key)
        try:
            if entry is not None:
                return [dict(r) for r in GraphSpec.from_bytes(entry.data).pass_records]
        except GraphSpecError:
            pass  # a damaged spec: fall back to the key factors below
    return [{"name": n, "uuid": u} for n, u in (manifest.factors.get("passes") or {}).items()]


def run_verify(args: argparse.Namespace) -> int:
    with _store(args) as store:
        report = store.verify(repair=args.repair)
        print(f"{len(report.ok)} entries ok in {store.root}")
        for key in report.adopted:
            print(f"recovered entry {key} from an orphan data file")
        for key, problem in report.dropped:
            print(f"dropped corrupt entry {key}: {problem}")
        for w in report.warnings:
            print(f"warning: {w}")
        if report.removed_orphans:
            print(f"removed {len(report.removed_orphans)} orphan data files (no entry pointed to them)")
        if report.orphans:
            print(f"{len(report.orphans)} orphan data files (no entry points to them; "
                  f"`kiln cache verify --repair` or `kiln cache clear` removes them), e.g. {report.orphans[0]}")
    # Anything found wrong (even if fixed now) exits 1; the next verify of a healthy cache exits 0.
    found = store.repairs or report.adopted or report.removed_orphans
    return 0 if report.healthy and not found else 1


def run_clear(args: argparse.Namespace) -> int:
    with _store(args) as store:
        n = store.clear()
        print(f"removed {n} entries from {store.root}")
    return 0


def run_export(args: argparse.Namespace) -> int:
    with _store(args) as store:
        exported = store.export_to(args.file)
        print(f"exported {len(exported)} entries ({_size(sum(m.size for m in exported))}) to {args.file}")
    return 0


def run_import(args: argparse.Namespace) -> int:
    with _store(args) as store:
        report = store.import_from(args.file)
        print(f"imported {len(report.imported)} entries into {store.root} "
              f"({len(report.already_present)} already present, {len(report.rejected)} rejected)")
        for key, why in report.rejected:
            print(f"rejected {key}: {why}", file=sys.stderr)
    return 1 if report.rejected else 0


def run_explain(args: argparse.Namespace) -> int:
    from kiln.cache.explain import explain_setup

    for setup in _rank_setups(args):
        mode = _mode(args, setup)
        with _store(args) as store:
            rows = explain_setup(store, setup, mode)
            hits = sum(r.hit for r in rows)
            print(f"{setup.model_type} ({str(setup.dtype).removeprefix('torch.')}, {setup.device.type})"
                  f"{_rank_label(setup)} against {store.root}: {hits} of {len(rows)} entries would hit")
            for r in rows:
                print(f"  {r.label:<12} {r.key}  {'hit' if r.hit else r.reason}")
    return 0
