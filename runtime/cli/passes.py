"""`kiln passes list` and `kiln passes show`: what the pass pipeline is and what it does to a model.

    kiln passes list [--enable-pass NAME] [--disable-pass NAME] [--json]
        every registered pass: phase, name, uuid, enabled (in the default pipeline, after
        the given flags and $KILN_ENABLE_PASSES), and where it comes from.

    kiln passes show [MODEL] [--phase P] [--explain PASS] [--no-code] [--json] [engine options]
        capture MODEL (default: SmolLM2-135M-Instruct), run the pipeline up to and including
        phase P (default: the last), print the graph as code, its op counts, and each pass's
        stats (a pattern pass reports how many times each pattern matched). `--explain PASS`
        prints, for each pattern of PASS, its matches or the closest candidate and where it
        diverged, on the graph PASS sees (the pass need not be enabled).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from kiln.passes.registry import ENTRY_POINT_GROUP, PHASES

CAPTURED = "captured"  # the graph before any pass


@dataclass
class PassRow:
    phase: str
    name: str
    uuid: str
    enabled: bool
    source: str
    error: str | None = None
    # Whether it rewrites the graph on `device` ("yes", or "no: why"): an enabled pass can
    # still skip itself there (the fusions into Kiln's custom ops are CUDA-only by default).
    on_device: str = "yes"
    device: str = "cpu"


def current_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _on_device(p: Any, device: str) -> str:
    from kiln.passes.fuse_common import CPU_FUSIONS_ENV, CudaByDefault

    if device == "cpu" and isinstance(p, CudaByDefault) and not p.on_cpu:
        return f"no: CUDA only ({CPU_FUSIONS_ENV}=1 runs it on CPU)"
    return "yes"


def pass_rows(enable: list[str] | None = None, disable: list[str] | None = None,
              device: str | None = None) -> list[PassRow]:
    """One row per registered pass (built-in and plugin), in pipeline order; `on_device` says
    whether it applies on `device` (default: this machine's, CUDA when available)."""
    from kiln.passes.manager import enabled_pass_names
    from kiln.passes.registry import all_pass_factories, builtin_pass_factories, create_pass, plugin_load_errors

    enabled = enabled_pass_names(enable, disable)
    device = device or current_device()
    builtins = builtin_pass_factories()
    plugin_eps = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    factories = all_pass_factories()
    rows: list[PassRow] = []
    for name in factories:
        if name in builtins:
            source = "built-in"
        else:
            ep = plugin_eps.get(name)
            dist = getattr(ep, "dist", None)
            source = f"plugin {dist.name} {dist.version} ({ep.value})" if dist is not None and ep is not None else "plugin"
        try:
            p = create_pass(name)
            rows.append(PassRow(phase=p.phase, name=name, uuid=p.uuid(), enabled=name in enabled, source=source,
                                on_device=_on_device(p, device), device=device))
        except Exception as e:  # a broken pass is listed with its error, not hidden
            rows.append(PassRow(phase="?", name=name, uuid="-", enabled=False, source=source, error=f"{type(e).__name__}: {e}"))
    load_errors = plugin_load_errors()
    for name, ep in plugin_eps.items():
        if name not in factories:  # the entry point failed to load: say why, here
            dist = getattr(ep, "dist", None)
            source = f"plugin {dist.name} {dist.version} ({ep.value})" if dist is not None else f"plugin ({ep.value})"
            error = load_errors.get(name, "cannot load the entry point").removesuffix(f" (entry point {ep.value})")
            rows.append(PassRow(phase="?", name=name, uuid="-", enabled=False, source=source, error=error))
    order = {n: i for i, n in enumerate(enabled)}

    def key(r: PassRow) -> tuple[int, int, str]:
        phase = PHASES.index(r.phase) if r.phase in PHASES else len(PHASES)
        return (phase, order.get(r.name, len(order)), r.name)

    return sorted(rows, key=key)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def run_list(args: argparse.Namespace) -> int:
    rows = pass_rows(args.enable_passes, args.disable_passes)
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], indent=2))
        return 0
    device = rows[0].device if rows else current_device()
    body = [[r.phase, r.name, r.uuid, "yes" if r.enabled else "no", (r.on_device if r.enabled else "-"),
             r.source + (f"  ERROR: {r.error}" if r.error else "")] for r in rows]
    print(_table(["phase", "name", "uuid", "enabled", f"runs on {device}", "source"], body))
    if any(not r.enabled and r.source.startswith("plugin") and not r.error for r in rows):
        print("\nplugin passes are off until enabled: --enable-pass NAME, or $KILN_ENABLE_PASSES=NAME[,NAME]")
    return 0


@dataclass
class PhaseGraph:
    """The graph after running the pipeline up to a phase, with what it took to get there."""

    graph_module: Any
    records: list[Any]
    pipeline: list[str]
    config: Any
    dtype: Any
    device: Any
    model_name: str


def _resolve(args: argparse.Namespace) -> tuple[Any, str, Any, Any]:
    from kiln.compiler.model_source import resolve_model
    from kiln.runtime.config import EngineConfig

    # The graph needs the architecture only: weights are never read here.
    source = resolve_model(args.model, load_format="dummy")
    engine_config = EngineConfig(model=args.model, dtype=args.dtype, device=args.device)
    device = engine_config.resolved_device()
    dtype = engine_config.resolved_dtype(device)
    return source.config, source.name, dtype, device


def build_phase_graph(args: argparse.Namespace, until_phase: str, stop_before: str | None = None) -> tuple[PhaseGraph, Any]:
    """Capture the model and run the enabled passes up to `until_phase` (inclusive).

    With `stop_before=NAME`, stop just before pass NAME would run (adding it to the pipeline
    at its phase if it is not enabled) and also return that pass.
    """
    from kiln.compiler.capture import capture
    from kiln.passes.base import PassContext
    from kiln.passes.manager import PassManager
    from kiln.runtime.hardware_defaults import choose_batch_limits, device_memory_bytes

    config, model_name, dtype, device = _resolve(args)
    pm = PassManager.default(enable=args.enable_passes, disable=args.disable_passes)
    passes = list(pm.passes)
    target = None
    if stop_before is not None:
        passes, target = pm.split_at(stop_before)  # the same split as kiln.compiler.pass_testing
    elif until_phase != CAPTURED:
        limit = PHASES.index(until_phase)
        passes = [p for p in passes if PHASES.index(p.phase) <= limit]
    else:
        passes = []
    limits = choose_batch_limits(getattr(args, "max_num_seqs", None), args.max_num_batched_tokens, device.type,
                                 device_memory_bytes(device))
    captured = capture(config, dtype=dtype, device=device, max_num_tokens=max(limits.max_num_batched_tokens, 2))
    ctx = PassContext(config=config, dtype=dtype)
    report = PassManager(passes).run(captured.graph_module, ctx, dump_dir=args.dump_graphs)
    graph = PhaseGraph(graph_module=captured.graph_module, records=report.records, pipeline=[p.name for p in passes],
                       config=config, dtype=dtype, device=device, model_name=model_name)
    return graph, (target, ctx)


def run_show(args: argparse.Namespace) -> int:
    from kiln.passes.manager import op_counts
    from kiln.runtime.cli.common import setup_logging

    if args.verbose:
        setup_logging(True)
    explain_reports: list[Any] = []
    if args.explain:
        graph, (target, ctx) = build_phase_graph(args, until_phase=PHASES[-1], stop_before=args.explain)
        if not hasattr(target, "explain"):
            raise ValueError(f"--explain {args.explain}: that pass is not a pattern pass (kiln.passes.pattern.PatternPass); "
                             "only pattern passes can explain their matches")
        explain_reports = target.explain(graph.graph_module, ctx)
        shown_phase = f"before pass {args.explain!r} ({target.phase} phase)"
    else:
        graph, _ = build_phase_graph(args, until_phase=args.phase)
        shown_phase = f"after phase {args.phase!r}" if args.phase != CAPTURED else "as captured (no passes)"
    gm = graph.graph_module
    counts = op_counts(gm)
    arch = getattr(graph.config, "model_type", "?")
    layers = getattr(graph.config, "num_hidden_layers", "?")
    dtype = str(graph.dtype).replace("torch.", "")
    if args.json:
        out: dict[str, Any] = {
            "model": graph.model_name, "architecture": arch, "num_layers": layers, "dtype": dtype,
            "device": str(graph.device), "graph": shown_phase, "phase": args.phase, "pipeline": graph.pipeline,
            "num_nodes": len(gm.graph.nodes), "op_counts": dict(counts.most_common()),
            "passes": [{"phase": r.phase, "name": r.name, "uuid": r.uuid, "stats": r.stats, "notes": r.notes}
                       for r in graph.records],
        }
        if args.explain:
            out["explain"] = [r.to_dict() for r in explain_reports]
        if not args.no_code:
            out["code"] = gm.code
        print(json.dumps(out, indent=2))
        return 0
    write = sys.stdout.write
    write(f"# model {graph.model_name} ({arch}, {layers} layers), {dtype} on {graph.device}\n")
    write(f"# pipeline run: {' -> '.join(graph.pipeline) or '(none)'}\n")
    write(f"# graph {shown_phase}: {len(gm.graph.nodes)} nodes\n")
    if not args.no_code:
        write(gm.code.strip("\n") + "\n\n")
    write("op counts:\n")
    write("\n".join(f"  {n:6d}  {op}" for op, n in counts.most_common()) + "\n\n")
    write("passes run (stats: what each pass did; a pattern pass counts matches per pattern):\n")
    rows = [[r.phase, r.name, r.uuid, ", ".join(f"{k}={v}" for k, v in r.stats.items()) or "-"] for r in graph.records]
    write(_table(["phase", "pass", "uuid", "stats"], rows) + "\n")
    for r in graph.records:  # e.g. an enabled pass that matched nothing because another consumed its ops
        for note in r.notes:
            write(f"note: {note}\n")
    for report in explain_reports:
        write("\n" + str(report) + "\n")
    if args.explain and not explain_reports:
        write(f"\npass {args.explain!r} declares no patterns for this model (its patterns_for(ctx) is empty)\n")
    return 0


def add_subcommands(sub: Any) -> None:
    from kiln.runtime.cli.common import add_engine_args

    passes = sub.add_parser("passes", help="inspect the graph pass pipeline (list passes, show a model's graph)",
                            description="Inspect Kiln's graph pass pipeline.")
    passes_sub = passes.add_subparsers(dest="passes_command", metavar="SUBCOMMAND")
    passes.set_defaults(func=lambda args: (passes.print_help(), 2)[1])

    lst = passes_sub.add_parser("list", help="every registered pass: phase, name, uuid, enabled, source",
                                description="List every registered pass (built-in and installed plugins).")
    lst.add_argument("--enable-pass", dest="enable_passes", action="append", default=[], metavar="NAME",
                     help="show as if this pass were enabled")
    lst.add_argument("--disable-pass", dest="disable_passes", action="append", default=[], metavar="NAME",
                     help="show as if this pass were disabled")
    lst.add_argument("--json", action="store_true", help="print JSON instead of a table")
    lst.set_defaults(func=run_list)

    show = passes_sub.add_parser(
        "show", help="a model's graph at a phase, its op counts and what each pass matched",
        description="Capture MODEL, run the pass pipeline up to --phase and print the graph, op counts and pass stats.",
    )
    show.add_argument("--phase", default=PHASES[-1], choices=[CAPTURED, *PHASES],
                      help=f"show the graph after this phase (default: {PHASES[-1]}, the final graph)")
    show.add_argument("--explain", metavar="PASS", default=None,
                      help="for each pattern of PASS: its matches, or the closest candidate and where it diverged, "
                           "on the graph PASS receives (it need not be enabled; --phase is then ignored)")
    show.add_argument("--no-code", action="store_true", help="leave out the graph's code (counts and stats only)")
    show.add_argument("--json", action="store_true", help="print JSON (op_counts, passes, code, explain)")
    show.add_argument("--dump-graphs", metavar="DIR", default=None,
                      help="also write the graph after each phase to DIR (like KILN_DUMP_GRAPHS)")
    add_engine_args(show, model_positional=True)
    show.set_defaults(func=run_show)
