"""The pass manager: runs passes phase by phase, verifies after each, optionally dumps.

Set `KILN_DUMP_GRAPHS=DIR` to get, after each phase, `DIR/NN-<phase>.py` (the graph as
readable code) and `DIR/NN-<phase>.txt` (node counts by op, and each pass's stats).

Each pass's stats are logged at INFO on `kiln.passes` (`-v` on the CLI shows them). A
pattern pass that matches nothing because an earlier pass rewrote away the ops its pattern
needs (a plugin's silu * mul after the built-in `fuse_silu_mul`) gets a WARNING naming
that pass; the note is kept on its `PassRecord` too.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.compiler.graph_inputs import INPUT_META_KEY
from kiln.passes.base import GraphPass, PassContext, PassStats
from kiln.passes.registry import OPT_IN_BUILTIN_PASSES, PHASES, all_pass_factories, builtin_pass_factories, create_pass, unknown_pass_error

logger = logging.getLogger("kiln.passes")

DEFAULT_PIPELINE = ("normalize", "paged_kv", "recurrent_state", "prune_logits")
# Passes the runtime cannot do without: they connect the graph to its caches.
REQUIRED_PASSES = ("paged_kv", "recurrent_state")


class PassVerificationError(RuntimeError):
    pass


@dataclass
class PassRecord:
    phase: str
    name: str
    uuid: str
    stats: PassStats
    notes: list[str] = field(default_factory=list)  # e.g. why it matched nothing


@dataclass
class PassReport:
    records: list[PassRecord] = field(default_factory=list)


def op_counts(gm: torch.fx.GraphModule) -> Counter[str]:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def verify_graph(gm: torch.fx.GraphModule, after: str, codegen: bool = True) -> None:
    """Structural checks a pass must leave true: lint-clean, every input tagged, and (unless
    `codegen` is False) the graph's Python code generates, which also brings `gm`'s code up
    to date."""
    try:
        gm.graph.lint()
    except Exception as e:
        raise PassVerificationError(f"graph is malformed after pass {after!r}: {e}") from e
    for node in gm.graph.find_nodes(op="placeholder"):
        if INPUT_META_KEY not in node.meta:
            raise PassVerificationError(f"pass {after!r} added graph input {node.name!r} without a kiln_input role")
    if codegen:
        generate_code(gm, [after])


def generate_code(gm: torch.fx.GraphModule, passes: list[str]) -> None:
    """`gm.recompile()`, an error naming `passes` (those run since the code last generated)
    if the graph's code does not generate or compile."""
    try:
        gm.recompile()
    except Exception as e:
        which = ", ".join(repr(n) for n in passes)
        raise PassVerificationError(f"the graph's code does not generate after pass{'es' if len(passes) > 1 else ''} "
                                    f"{which}: {type(e).__name__}: {e}") from e


# Plugin passes are opt-in (issue 7): installing a package must not change everyone's
# graphs and cache keys. Turn one on with --enable-pass NAME, LLM(enable_passes=[...]) or
# this variable (comma-separated names).
ENABLE_PASSES_ENV = "KILN_ENABLE_PASSES"


def enabled_pass_names(enable: list[str] | None = None, disable: list[str] | None = None) -> list[str]:
    """The passes `PassManager.default` runs: every built-in pass, plus the passes named in
    $KILN_ENABLE_PASSES and `enable`, minus `disable`. Installed plugins, and the built-ins of
    OPT_IN_BUILTIN_PASSES (quantize_fp8), are off unless named."""
    factories = all_pass_factories()
    from_env = [n.strip() for n in os.environ.get(ENABLE_PASSES_ENV, "").split(",") if n.strip()]
    requested = set(from_env) | set(enable or [])
    names = list(DEFAULT_PIPELINE)
    # An opt-in built-in, once asked for, takes its place among the built-ins (quantize_fp8
    # must run before use_triton_linear), not after them as a plugin does.
    names += [n for n in builtin_pass_factories()
              if n not in names and (n not in OPT_IN_BUILTIN_PASSES or n in requested)]
    for name in from_env:
        if name not in factories:
            raise unknown_pass_error(f"${ENABLE_PASSES_ENV} names", name, factories)
        if name not in names:
            names.append(name)
    for name in enable or []:
        if name not in factories:
            raise unknown_pass_error("--enable-pass", name, factories)
        if name not in names:
            names.append(name)
    for name in disable or []:
        if name not in factories:
            raise unknown_pass_error("--disable-pass", name, factories)
        if name in REQUIRED_PASSES:
            raise ValueError(f"the {name} pass cannot be disabled: the runtime needs the caches it connects "
                             "(the paged KV cache, the recurrent layers' states)")
        names = [n for n in names if n != name]
    return names


def consumed_pattern_notes(graph_pass: GraphPass, stats: PassStats, ctx: PassContext,
                           history: list[tuple[str, Counter[str]]]) -> list[str]:
    """For a pattern pass that matched nothing: each op of its patterns that the graph had
    and an earlier pass rewrote away, naming that pass. `history` holds the op counts after
    capture and after each earlier pass. Empty when the pass matched or nothing was consumed."""
    from kiln.passes.pattern import PatternPass

    if not isinstance(graph_pass, PatternPass) or not stats or any(stats.values()):
        return []
    patterns = list(graph_pass.patterns_for(ctx))
    if set(stats) != {p.name for p in patterns}:
        return []  # not pattern counts (e.g. skipped_on_cpu)
    notes = []
    now = history[-1][1]
    for pattern in patterns:
        traced = pattern.traced(ctx.dtype)
        ops = dict.fromkeys(str(n.target) for n in traced.pattern.graph.nodes if n.op == "call_function")
        if any(not any(counts[op] for _, counts in history) for op in ops):
            continue  # the model never had every op of this pattern (a LayerNorm pattern on an RMSNorm model)
        for op in ops:
            if now[op]:
                continue
            consumers = [(name, before[op], after[op]) for (_, before), (name, after) in zip(history, history[1:])
                         if before[op] > after[op]]
            if not consumers:
                continue  # the model never had it: not this warning's business
            by = ", ".join(f"{name!r} ({b} -> {a})" for name, b, a in consumers)
            notes.append(
                f"pass {graph_pass.name!r} matched nothing: its pattern {pattern.name!r} needs {op}, which the graph "
                f"had until pass {by} rewrote it away. Disable that pass (--disable-pass {consumers[-1][0]}) for "
                f"this one to see those ops, or write the pattern against what it produces "
                f"(kiln passes show MODEL --explain {graph_pass.name})")
            break
    return notes


class PassManager:
    """An ordered pipeline of passes grouped into the named phases of `PHASES`."""

    def __init__(self, passes: list[GraphPass]):
        self.passes = sorted(passes, key=lambda p: PHASES.index(p.phase))  # stable within a phase

    @classmethod
    def from_names(cls, names: list[str] | tuple[str, ...] = DEFAULT_PIPELINE) -> "PassManager":
        factories = all_pass_factories()
        return cls([create_pass(n, factories) for n in names])

    @classmethod
    def default(cls, enable: list[str] | None = None, disable: list[str] | None = None) -> "PassManager":
        """The default pipeline, adjusted by enable/disable (see `enabled_pass_names`)."""
        return cls.from_names(enabled_pass_names(enable, disable))

    def uuids(self) -> dict[str, str]:
        return {p.name: p.uuid() for p in self.passes}

    def split_at(self, name: str) -> tuple[list[GraphPass], GraphPass]:
        """The passes that run before pass `name` in this pipeline, and that pass.

        A pass that is not in the pipeline (a plugin not enabled) is placed where it would
        run once enabled: last in its phase, after every pass of this pipeline there. This
        is the graph `kiln passes show --explain NAME` and the pass-test helpers show.
        """
        target = next((p for p in self.passes if p.name == name), None)
        passes = list(self.passes)
        if target is None:
            target = create_pass(name)
            passes = PassManager(passes + [target]).passes  # stable sort: last within its phase
            builtins = list(builtin_pass_factories())
            if name in builtins:  # an opt-in built-in: where enabling it puts it, among the built-ins
                order = {n: i for i, n in enumerate(builtins)}
                passes = sorted(passes, key=lambda p: (PHASES.index(p.phase), order.get(p.name, len(order))))
        return passes[: passes.index(target)], target

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext, dump_dir: str | os.PathLike | None = None) -> PassReport:
        dump = Path(dump_dir) if dump_dir else (Path(os.environ["KILN_DUMP_GRAPHS"]) if os.environ.get("KILN_DUMP_GRAPHS") else None)
        report = PassReport()
        if dump:
            self._dump(gm, dump, 0, "captured", [])
        # Op counts after each pass, to say which pass consumed what a later pattern needed.
        history: list[tuple[str, Counter[str]]] = [("capture", op_counts(gm))]
        builtins = builtin_pass_factories()
        # Built-in passes (Kiln's suite runs their graphs) are linted and their inputs' roles
        # checked after each, but the graph's code is generated once, at the end (and for a
        # phase's dump): a recompile is ~0.1 s for a 30-layer model, and one after each of ~15
        # passes was ~0.5 s of every cold start. A plugin pass is checked whole after it runs,
        # and the built-ins before it first, so that a broken graph names the pass that broke it.
        pending: list[str] = []  # built-in passes since the code last generated
        for i, phase in enumerate(PHASES, start=1):
            phase_records = []
            for p in (p for p in self.passes if p.phase == phase):
                trusted = type(p) is builtins.get(p.name)
                if not trusted and pending:
                    generate_code(gm, pending)
                    pending = []
                stats = p(gm, ctx)
                gm.graph.eliminate_dead_code()
                verify_graph(gm, p.name, codegen=not trusted)
                if trusted:
                    pending.append(p.name)
                rec = PassRecord(phase=phase, name=p.name, uuid=p.uuid(), stats=dict(stats or {}))
                rec.notes = consumed_pattern_notes(p, rec.stats, ctx, history)
                history.append((p.name, op_counts(gm)))
                report.records.append(rec)
                phase_records.append(rec)
                logger.info("pass %s (%s phase): %s", p.name, phase,
                            ", ".join(f"{k}={v}" for k, v in rec.stats.items()) or "-")
                for note in rec.notes:
                    logger.warning("%s", note)
            if dump:
                if pending:
                    generate_code(gm, pending)
                    pending = []
                self._dump(gm, dump, i, phase, phase_records)
        if pending:
            generate_code(gm, pending)
        return report

    @staticmethod
    def _dump(gm: torch.fx.GraphModule, dump: Path, index: int, phase: str, records: list[PassRecord]) -> None:
        dump.mkdir(parents=True, exist_ok=True)
        stem = dump / f"{index:02d}-{phase}"
        stem.with_suffix(".py").write_text(gm.code)
        counts = op_counts(gm)
        lines = [f"phase: {phase}", f"nodes: {len(gm.graph.nodes)}"]
        lines += [f"pass {r.name} ({r.uuid}): {r.stats}" for r in records]
        lines += [f"{n:6d}  {op}" for op, n in counts.most_common()]
        stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
