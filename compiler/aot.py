"""The compile driver shared by `kiln compile` (ahead of time) and engine start-up (warm start).

    cache lookups ─ all hit ──────────────────────────────────► load artifacts
         │ graph spec or a bucket missing
         ▼
    graph capture (torch.export + passes) ─► compile each missing bucket ─► store ─► load

The cache holds one *graph spec* per model setup (kiln.compiler.pipeline.GraphSpec: input
roles, parameter names, constants, weight transforms, pass report) and one artifact per
bucket. With all of them present nothing is traced or compiled: a warm start is a few
file reads and `dlopen`s. A compile takes the key's lock first and looks again, so two
processes that miss the same key at once compile it once and both end up with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from kiln.cache.keys import BUCKET_KIND, MODEL_KIND, bucket_factors, key_for, model_factors
from kiln.cache.manifest import Manifest
from kiln.cache.store import ArtifactStore
from kiln.compiler.buckets import Bucket, BucketPlan
from kiln.compiler.inductor_compile import (
    ARTIFACT_FORMAT, BucketCompileError, LoadedBucket, compile_bucket, load_bucket,
)
from kiln.compiler.pipeline import GraphSpec, GraphSpecError, ModelGraph, build_model_graph
from kiln.passes.manager import PassManager

logger = logging.getLogger("kiln.compiler")

COMPILE_MODES = ("auto", "eager", "inductor")


class CacheMissError(ValueError):
    """require_cache was set and the cache lacks entries; the message names them and why."""


@dataclass
class BucketResult:
    bucket: Bucket
    key: str
    status: str  # "hit" | "compiled" | "failed"
    seconds: float  # compile seconds (or lookup+load seconds for a hit)
    size: int = 0
    error: str | None = None


@dataclass
class StartupReport:
    """What start-up did about the graph: phase seconds and where each bucket came from."""

    mode: str
    timings: dict[str, float] = field(default_factory=dict)
    graph_from_cache: bool = False
    captured: bool = False
    buckets: list[BucketResult] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # corrupt entries found and dropped
    note: str = ""  # why this mode, when it is not what was asked for literally

    @property
    def num_from_cache(self) -> int:
        return sum(r.status == "hit" for r in self.buckets)

    @property
    def num_compiled(self) -> int:
        return sum(r.status == "compiled" for r in self.buckets)

    def summary(self) -> str:
        if self.mode == "eager":
            return "graph: eager (post-pass FX graph run directly, nothing compiled" + (
                f"; {self.note})" if self.note else ")")
        parts = [f"graph: inductor, {self.num_from_cache}/{len(self.buckets)} buckets from cache"]
        if self.num_compiled:
            parts.append(f"{self.num_compiled} compiled")
        parts.append("spec from cache, capture skipped" if not self.captured else "graph captured")
        if self.dropped:
            parts.append(f"{len(self.dropped)} corrupt entries dropped and rebuilt")
        return ", ".join(parts)


@dataclass
class PreparedModel:
    """The runnable model minus weights and KV cache: a spec plus an artifact per bucket (or,
    in eager mode, the post-pass FX graph itself)."""

    spec: GraphSpec
    plan: BucketPlan
    report: StartupReport
    graph: ModelGraph | None = None  # None on a warm start: nothing was captured
    bucket_fns: dict[Bucket, LoadedBucket] | None = None

    @property
    def graph_fn(self) -> Callable[..., Any] | None:
        return self.graph.graph_module if self.graph is not None and self.bucket_fns is None else None


@dataclass
class ModelSetup:
    """Everything the cache key and the compile depend on, for one model configuration."""

    config: Any
    dtype: torch.dtype
    device: torch.device
    pass_manager: PassManager
    block_size: int
    plan: BucketPlan
    max_num_tokens: int = 8192

    def model_factors(self) -> dict[str, Any]:
        return model_factors(self.config, self.dtype, self.pass_manager.uuids(), self.device, self.block_size,
                             ARTIFACT_FORMAT)

    def model_key(self) -> str:
        return key_for(MODEL_KIND, self.model_factors())

    def bucket_keys(self) -> dict[Bucket, str]:
        base = self.model_factors()
        return {b: key_for(BUCKET_KIND, bucket_factors(base, b)) for b in self.plan.buckets()}

    @property
    def model_type(self) -> str:
        return str(getattr(self.config, "model_type", "?"))


# resolve_compile_mode's answer for `auto` without an explicit cache: use the artifacts if
# the cache already holds every one, else run eagerly; never compile.
WARM_OR_EAGER = "warm-or-eager"


def resolve_compile_mode(mode: str, device: torch.device, require_cache: bool, cache_dir_given: bool) -> str:
    """"eager", "inductor" or WARM_OR_EAGER for an engine's `compile` option.

    `auto` compiles only when a cache is asked for (cache_dir given, or require_cache);
    otherwise it uses the cache if `kiln compile` already filled it for these settings, and
    else runs the graph eagerly. Compiling at start-up is never implicit: on CPU a bucket
    costs ~20-25 s of CPU time for a step at most ~20% faster, on CUDA about a minute even
    for a tiny model (Triton autotuning), and the default plan has 16 buckets (README
    design notes). `device` is accepted for symmetry; the rule is the same on both.
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}; got {mode!r}")
    if mode == "eager" and require_cache:
        raise ValueError("require_cache=True needs compiled artifacts, but compile='eager' runs none; "
                         "use compile='inductor' or 'auto'")
    if mode != "auto":
        return mode
    if require_cache or cache_dir_given:
        return "inductor"
    return WARM_OR_EAGER


def _timed(timings: dict[str, float], name: str) -> "_Timer":
    return _Timer(timings, name)


class _Timer:
    def __init__(self, timings: dict[str, float], name: str):
        self.timings, self.name = timings, name

    def __enter__(self) -> None:
        self.t = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timings[self.name] = self.timings.get(self.name, 0.0) + time.perf_counter() - self.t


def prepare_eager(setup: ModelSetup) -> PreparedModel:
    report = StartupReport(mode="eager", captured=True)
    with _timed(report.timings, "graph capture"):
        graph = build_model_graph(setup.config, setup.dtype, setup.device, block_size=setup.block_size,
                                  pass_manager=setup.pass_manager, max_num_tokens=setup.max_num_tokens)
    return PreparedModel(spec=graph.spec(), plan=setup.plan, report=report, graph=graph)


def prepare_compiled(
    setup: ModelSetup,
    store: ArtifactStore,
    require_cache: bool = False,
    progress: bool = True,
    load: bool = True,
) -> PreparedModel:
    """Look every bucket up, capture and compile what is missing, and load the artifacts.

    With `require_cache`, a missing entry raises CacheMissError (naming each missing bucket
    and, from the nearest stored entry, the key factor that differs) instead of compiling.
    `load=False` (kiln compile) stores artifacts without loading them. A bucket whose compile
    fails is recorded as failed and the others go on; the caller decides what that means.
    """
    report = StartupReport(mode="inductor")
    scratch = store.root / "tmp"
    model_key = setup.model_key()
    bucket_keys = setup.bucket_keys()
    dropped_before = len(store.dropped)

    with _timed(report.timings, "cache lookups"):
        spec = None
        spec_entry = store.get(model_key)
        if spec_entry is not None:
            try:
                spec = GraphSpec.from_bytes(spec_entry.data)
            except GraphSpecError as e:
                store.drop(model_key, str(e))
        found: dict[Bucket, bytes] = {}
        for bucket, key in bucket_keys.items():
            t0 = time.perf_counter()
            entry = store.get(key)
            if entry is not None:
                found[bucket] = entry.data
                report.buckets.append(BucketResult(bucket, key, "hit", time.perf_counter() - t0, len(entry.data)))
    missing = [b for b in setup.plan.buckets() if b not in found]
    report.graph_from_cache = spec is not None

    if require_cache and (missing or spec is None):
        from kiln.cache.explain import explain_miss

        lines = []
        if spec is None:
            lines.append(f"  graph spec ({model_key}): {explain_miss(store, MODEL_KIND, setup.model_factors())}")
        base = setup.model_factors()
        for b in missing:
            why = explain_miss(store, BUCKET_KIND, bucket_factors(base, b))
            lines.append(f"  {b.name} ({bucket_keys[b]}): {why}")
        lines += [f"  (entry {key} was corrupt and has been dropped: {problem})"
                  for key, problem in store.dropped[dropped_before:]]
        raise CacheMissError(
            f"require_cache is set but the cache at {store.root} lacks {len(missing)} of {len(bucket_keys)} "
            f"bucket(s){' and the graph spec' if spec is None else ''}:\n" + "\n".join(lines)
            + "\nrun `kiln compile` with the same model and settings (or drop --require-cache to compile now)"
        )

    graph = None
    if spec is None or missing:
        with _timed(report.timings, "graph capture"):
            graph = build_model_graph(setup.config, setup.dtype, setup.device, block_size=setup.block_size,
                                      pass_manager=setup.pass_manager, max_num_tokens=setup.max_num_tokens)
        report.captured = True
        if spec is not None and spec.input_roles != graph.input_roles():
            # Same key, different graph: only possible if something outside the key changed
            # the capture. Trust the graph just built and replace the stale spec.
            logger.warning("kiln cache: graph spec %s does not match the captured graph; replacing it", model_key)
            store.delete(model_key)
            spec = None
        if spec is None:
            spec = graph.spec()
            with store.lock(model_key):
                if store.get(model_key) is None:
                    store.put(Manifest(key=model_key, kind=MODEL_KIND, label="graph", model=setup.model_type,
                                       factors=setup.model_factors(), checksum="", size=0, created=time.time()),
                              spec.to_bytes())

    if missing:
        assert graph is not None  # captured just above
        with _timed(report.timings, "compile"):
            found.update(_compile_missing(setup, store, graph, spec, missing, bucket_keys, report, scratch,
                                          progress))
    report.dropped = store.dropped[dropped_before:]
    # Report buckets in plan order.
    order = {b: i for i, b in enumerate(setup.plan.buckets())}
    report.buckets.sort(key=lambda r: order[r.bucket])

    bucket_fns = None
    if load:
        failed = [r.bucket.name for r in report.buckets if r.status == "failed"]
        if failed:
            errors = "; ".join(f"{r.bucket.name}: {r.error}" for r in report.buckets if r.status == "failed")
            raise BucketCompileError(f"{len(failed)} bucket(s) failed to compile: {errors}")
        with _timed(report.timings, "load artifacts"):
            bucket_fns = {b: load_bucket(b, found[b], setup.device, scratch) for b in setup.plan.buckets()}
    return PreparedModel(spec=spec, plan=setup.plan, report=report, graph=graph, bucket_fns=bucket_fns)


def _compile_missing(
    setup: ModelSetup,
    store: ArtifactStore,
    graph: ModelGraph,
    spec: GraphSpec,
    missing: list[Bucket],
    bucket_keys: dict[Bucket, str],
    report: StartupReport,
    scratch: Path,
    progress: bool,
) -> dict[Bucket, bytes]:
    from tqdm import tqdm

    out: dict[Bucket, bytes] = {}
    base = setup.model_factors()
    bar = tqdm(missing, desc="Compiling buckets", unit="bucket", disable=not progress)
    for bucket in bar:
        bar.set_postfix_str(bucket.name)
        key = bucket_keys[bucket]
        t0 = time.perf_counter()
        with store.lock(key):
            entry = store.get(key)  # another process may have compiled it while we waited
            if entry is not None:
                result = BucketResult(bucket, key, "hit", time.perf_counter() - t0, len(entry.data))
                out[bucket] = entry.data
            else:
                try:
                    data = compile_bucket(graph.graph_module, spec.input_roles, spec.constants, setup.config, bucket,
                                          setup.dtype, setup.device, setup.block_size, scratch)
                except BucketCompileError as e:
                    logger.error("%s", e)
                    result = BucketResult(bucket, key, "failed", time.perf_counter() - t0, error=str(e))
                else:
                    seconds = time.perf_counter() - t0
                    store.put(Manifest(key=key, kind=BUCKET_KIND, label=bucket.name, model=setup.model_type,
                                       factors=bucket_factors(base, bucket), checksum="", size=0,
                                       created=time.time(), compile_seconds=round(seconds, 3)), data)
                    result = BucketResult(bucket, key, "compiled", seconds, len(data))
                    out[bucket] = data
        report.buckets.append(result)
    bar.close()
    return out


def setup_for_engine(engine_config: Any, model_config: Any, dtype: torch.dtype, device: torch.device) -> ModelSetup:
    """The `ModelSetup` an engine with `engine_config` (a kiln.runtime EngineConfig) runs."""
    from kiln.compiler.buckets import make_bucket_plan

    pm = PassManager.default(enable=engine_config.enable_passes, disable=engine_config.disable_passes)
    plan = make_bucket_plan(engine_config.max_num_seqs, engine_config.max_num_batched_tokens,
                            engine_config.decode_buckets, engine_config.token_buckets)
    return ModelSetup(config=model_config, dtype=dtype, device=device, pass_manager=pm,
                      block_size=engine_config.block_size, plan=plan,
                      max_num_tokens=max(engine_config.max_num_batched_tokens, 2))


def prepare_for_engine(engine_config: Any, model_config: Any, dtype: torch.dtype, device: torch.device) -> PreparedModel:
    """Engine start-up's graph phase: eager capture, or cache lookups + compile + load."""
    setup = setup_for_engine(engine_config, model_config, dtype, device)
    mode = resolve_compile_mode(engine_config.compile, device, engine_config.require_cache,
                                engine_config.cache_dir is not None)
    if mode == WARM_OR_EAGER:
        prepared = _prepare_warm_or_eager(setup, engine_config.cache_dir, engine_config.progress)
    elif mode == "eager":
        prepared = prepare_eager(setup)
    else:
        with ArtifactStore(engine_config.cache_dir) as store:
            prepared = prepare_compiled(setup, store, require_cache=engine_config.require_cache,
                                        progress=engine_config.progress)
    logger.debug("%s (%s)", prepared.report.summary(),
                ", ".join(f"{k} {v:.2f}s" for k, v in prepared.report.timings.items()))
    return prepared


def _prepare_warm_or_eager(setup: ModelSetup, cache_dir: str | None, progress: bool) -> PreparedModel:
    from kiln.cache.store import CacheStoreError

    t0 = time.perf_counter()
    keys = [setup.model_key(), *setup.bucket_keys().values()]
    present = 0
    try:
        with ArtifactStore(cache_dir) as store:
            present = sum(key in store for key in keys)
            if present == len(keys):
                return prepare_compiled(setup, store, progress=progress)
    except CacheStoreError as e:  # an unusable default cache must not stop an eager start
        logger.debug("compile cache not usable (%s); running eagerly", e)
    lookups = time.perf_counter() - t0
    prepared = prepare_eager(setup)
    prepared.report.timings = {"cache lookups": lookups, **prepared.report.timings}
    prepared.report.note = (f"compile=auto: {present} of {len(keys)} cache entries present, none compiled; "
                            "`kiln compile` with these settings, or compile='inductor', uses Inductor artifacts")
    return prepared
