"""The start-up driver: how an engine (or `kiln compile`, ahead of time) gets a runnable
graph, in every compile mode: eager capture, or cache lookups -> capture and compile only what
is missing -> load artifacts.

Mode "inductor" (the CPU default with a cache):

    cache lookups ─ all hit ──────────────────────────────────► load artifacts
         │ graph spec or a bucket missing
         ▼
    graph capture (torch.export + passes) ─► compile each missing bucket ─► store ─► load

Mode "graph" (the CUDA default with a cache): the artifact is the post-pass FX graph
itself, as Python source (kiln.compiler.graph_code), one per model setup:

    cache lookups ─ spec and code hit ─► exec the code (no capture)
         │ either missing or unloadable
         ▼
    graph capture ─► store spec + code ─► run the captured graph

The cache holds one *graph spec* per model setup (kiln.compiler.pipeline.GraphSpec: input
roles, parameter names, constants, weight transforms, pass report), shared by both modes,
plus one artifact per bucket (inductor) or one graph-code entry (graph). With all of them
present nothing is traced or compiled: a warm start is a few file reads and `dlopen`s (or
one `exec`). A compile takes the key's lock first and looks again, so two processes that
miss the same key at once compile it once and both end up with it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from kiln.cache.keys import (
    BUCKET_KIND, CONFIG_KIND, GRAPH_CODE_KIND, MODEL_KIND, TRITON_KERNELS_KIND, bucket_factors, config_snapshot_factors, graph_code_factors, key_for, model_factors,
)
from kiln.cache.manifest import Manifest
from kiln.cache.store import ArtifactStore
from kiln.compiler.buckets import Bucket, BucketPlan, mixed_graph_sizes
from kiln.compiler.graph_code import (
    GRAPH_CODE_FORMAT, GraphCode, GraphCodeError, load_graph_code, serialize_graph_code,
)
from kiln.compiler.inductor_compile import (
    BucketCompileError, LoadedBucket, artifact_format, compile_bucket, load_bucket,
)
from kiln.compiler.model_source import ConfigSnapshot, ModelSourceError
from kiln.compiler.pipeline import GraphSpec, GraphSpecError, ModelGraph, build_model_graph
from kiln.compiler.triton_kernels import (
    TRITON_KERNELS_FORMAT, TritonKernelsError, capture_triton_kernels, count_triton_compiles,
    restore_triton_kernels,
)
from kiln.passes.manager import PassManager

logger = logging.getLogger("kiln.compiler")



class CompileMode(str, Enum):
    """An engine's `compile` option, and what `auto` resolves to (resolve_compile_mode)."""

    AUTO = "auto"
    EAGER = "eager"
    INDUCTOR = "inductor"
    GRAPH = "graph"
    # `auto` without an explicit cache: the artifacts if the cache holds every one, else
    # eager; never compile.
    WARM_OR_EAGER = "warm-or-eager"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


COMPILE_MODES = tuple(m.value for m in CompileMode if m is not CompileMode.WARM_OR_EAGER)
WARM_OR_EAGER = CompileMode.WARM_OR_EAGER


@dataclass
class CompileOptions:
    """What start-up needs of the engine's options (the runtime's EngineConfig.compile_options)."""

    enable_passes: list[str] = field(default_factory=list)
    disable_passes: list[str] = field(default_factory=list)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    decode_buckets: list[int] | None = None  # None: the default plan
    token_buckets: list[int] | None = None
    mode: str = "auto"
    cache_dir: str | None = None  # None: $KILN_CACHE_DIR or the user's cache directory
    require_cache: bool = False  # a miss is an error naming the missing entries
    progress: bool = True
    quantization: str | None = None  # "fp8": the quantize_fp8 pass (kiln.passes.quantize_fp8)
    kv_cache_dtype: torch.dtype | None = None  # None: the compute dtype
    # Tensor parallelism: the graph is rank tp_rank's of tp_size (kiln.passes.shard_tensor_parallel).
    tp_size: int = 1
    tp_rank: int = 0
    # CUDA graphs of mixed steps up to this many tokens (kiln.compiler.buckets.mixed_graph_sizes;
    # 0: none): their shapes pick Triton kernel variants the plan's buckets may not.
    mixed_graph_tokens: int = 0


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    """Add the seconds the block takes to `timings[name]` (start-up logs report them)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t0


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
    stored: list[str] = field(default_factory=list)  # mode "graph": keys this start-up wrote
    triton: str = ""  # CUDA with a cache: where the Triton kernels came from (triton_kernels_at_startup)

    @property
    def num_from_cache(self) -> int:
        return sum(r.status == "hit" for r in self.buckets)

    @property
    def num_compiled(self) -> int:
        return sum(r.status == "compiled" for r in self.buckets)

    def summary(self) -> str:
        text = self._graph_summary()
        return f"{text}; {self.triton}" if self.triton else text

    def _graph_summary(self) -> str:
        if self.mode == "eager":
            return "graph: eager (post-pass FX graph run directly, nothing compiled" + (
                f"; {self.note})" if self.note else ")")
        if self.mode == "graph":
            if not self.captured:
                text = "graph: post-pass FX graph from cache (capture skipped)"
            elif "store graph" in self.timings:  # stored now, or found stored by another process
                text = "graph: graph captured and cached"
            else:
                text = "graph: graph captured (cache not written)"
            if self.dropped:
                text += f", {len(self.dropped)} corrupt entries dropped" + (" and rebuilt" if self.stored else "")
            return text + (f" ({self.note})" if self.note else "")
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
    in eager and graph modes, the post-pass FX graph itself, captured or loaded as code)."""

    spec: GraphSpec
    plan: BucketPlan
    report: StartupReport
    graph: ModelGraph | None = None  # None on a warm start: nothing was captured
    bucket_fns: dict[Bucket, LoadedBucket] | None = None
    graph_code: GraphCode | None = None  # mode "graph", warm: the graph loaded from the cache
    triton_kernels: "TritonKernelsEntry | None" = None  # CUDA with a cache in use

    @property
    def graph_fn(self) -> Callable[..., Any] | None:
        """What the runner calls with the inputs in `spec.input_roles` order (None: bucket_fns)."""
        if self.bucket_fns is not None:
            return None
        if self.graph_code is not None:
            return self.graph_code
        return self.graph.graph_module if self.graph is not None else None


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
    kv_cache_dtype: torch.dtype | None = None  # None: the compute dtype
    quantization: str | None = None
    tp_size: int = 1
    tp_rank: int = 0
    mixed_graph_tokens: int = 0  # CompileOptions.mixed_graph_tokens

    def model_factors(self) -> dict[str, Any]:
        return model_factors(self.config, self.dtype, self.pass_manager.uuids(), self.device, self.block_size,
                             artifact_format(self.device), kv_cache_dtype=self.kv_cache_dtype,
                             quantization=self.quantization, tp_size=self.tp_size, tp_rank=self.tp_rank)

    def model_key(self) -> str:
        return key_for(MODEL_KIND, self.model_factors())

    def bucket_keys(self) -> dict[Bucket, str]:
        base = self.model_factors()
        return {b: key_for(BUCKET_KIND, bucket_factors(base, b)) for b in self.plan.buckets()}

    def graph_code_factors(self) -> dict[str, Any]:
        return graph_code_factors(self.model_factors(), GRAPH_CODE_FORMAT)

    def graph_code_key(self) -> str:
        return key_for(GRAPH_CODE_KIND, self.graph_code_factors())

    def triton_kernels_factors(self) -> dict[str, Any]:
        """The Triton-kernel entry's factors: the model's (Kiln, torch and Triton versions, device
        capability, ...) with the bucket plan, whose shapes pick the kernels' variants."""
        mixed = mixed_graph_sizes(self.mixed_graph_tokens) if self.device.type == "cuda" else []
        return {**self.model_factors(), "format": TRITON_KERNELS_FORMAT,
                "plan": [b.name for b in self.plan.buckets()], **({"mixed_graphs": mixed} if mixed else {})}

    def triton_kernels_key(self) -> str:
        return key_for(TRITON_KERNELS_KIND, self.triton_kernels_factors())

    @property
    def model_type(self) -> str:
        return str(getattr(self.config, "model_type", "?"))


def artifact_mode(device: torch.device) -> str:
    """The cached artifact `auto` means on `device`: "graph" on CUDA, "inductor" elsewhere.

    On CUDA the fast path is the post-pass graph run directly (its fused ops are Kiln's
    Triton kernels) with decode steps replayed from CUDA graphs, so the cache keeps that
    graph and a warm start skips only the capture (compiler/README.md says why CUDA does not
    use AOTInductor packages). On CPU, AOTI packages load in milliseconds and run 0-20%
    faster than the eager graph.
    """
    return CompileMode.GRAPH if device.type == "cuda" else CompileMode.INDUCTOR


def resolve_compile_mode(mode: str, device: torch.device, require_cache: bool, cache_dir_given: bool) -> CompileMode:
    """"eager", "inductor", "graph" or WARM_OR_EAGER for an engine's `compile` option.

    `auto` writes to the cache only when one is asked for (cache_dir given, or
    require_cache): then it is "graph" on CUDA and "inductor" on CPU (`artifact_mode`).
    Otherwise it uses the cache if it already holds every entry of that device's artifact
    for these settings (`kiln compile` fills it), and else runs the graph eagerly, writing
    nothing. Compiling at start-up is never implicit: on CPU a bucket costs ~20-25 s of
    CPU time for a step at most ~20% faster, and the default plan has 16 buckets
    (compiler/README.md). Explicit "inductor" and "graph" work on both devices ("inductor" on CUDA
    builds packages; see compiler/README.md for which torch builds load them).
    """
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}; got {mode!r}")
    if mode == CompileMode.EAGER and require_cache:
        raise ValueError("--require-cache (require_cache=True) needs cached artifacts, but --compile eager uses "
                         "none; use --compile auto, graph or inductor")
    if mode != CompileMode.AUTO:
        return CompileMode(mode)
    if require_cache or cache_dir_given:
        return artifact_mode(device)
    return WARM_OR_EAGER


def _capture(setup: ModelSetup) -> ModelGraph:
    if isinstance(setup.config, ConfigSnapshot):  # a warm start's config, and yet a capture is needed
        setup.config = setup.config.to_transformers()
    return build_model_graph(setup.config, setup.dtype, setup.device, block_size=setup.block_size,
                             pass_manager=setup.pass_manager, max_num_tokens=setup.max_num_tokens,
                             tp_size=setup.tp_size, tp_rank=setup.tp_rank)


def _capture_against(setup: ModelSetup, spec: GraphSpec | None, report: StartupReport) -> tuple[ModelGraph, bool]:
    """Capture the graph; also whether `spec`, cached under the same key, disagrees with it."""
    with timed(report.timings, "graph capture"):
        graph = _capture(setup)
    report.captured = True
    stale = spec is not None and spec.input_roles != graph.input_roles()
    if stale:
        # Same key, different graph: only possible if something outside the key changed the
        # capture. Trust the graph just built; the caller replaces the stale spec.
        logger.warning("kiln cache: graph spec %s does not match the captured graph; replacing it", setup.model_key())
    return graph, stale


def prepare_eager(setup: ModelSetup) -> PreparedModel:
    report = StartupReport(mode="eager", captured=True)
    with timed(report.timings, "graph capture"):
        graph = _capture(setup)
    return PreparedModel(spec=graph.spec(), plan=setup.plan, report=report, graph=graph)


def _read_entry(store: ArtifactStore, key: str, parse: Callable[[bytes], Any],
                errors: type[Exception] | tuple[type[Exception], ...]) -> Any:
    """`parse` of the entry's bytes; None when it is missing, or when it does not parse (then
    it is dropped as corrupt, to be rebuilt)."""
    entry = store.get(key)
    if entry is None:
        return None
    try:
        return parse(entry.data)
    except errors as e:
        store.drop(key, str(e))
        return None


def _read_spec(store: ArtifactStore, key: str) -> GraphSpec | None:
    return _read_entry(store, key, GraphSpec.from_bytes, GraphSpecError)


def _cache_miss_error(store: ArtifactStore, what: str, missing: list[tuple[str, str, str, dict[str, Any]]],
                      dropped: list[tuple[str, str]], hint: str) -> CacheMissError:
    """The require-cache error: each missing entry (label, key, kind, factors) with the factor
    that differs from the nearest stored entry, the corrupt entries dropped, and what to run."""
    from kiln.cache.explain import explain_miss

    lines = [f"  {label} ({key}): {explain_miss(store, kind, factors)}" for label, key, kind, factors in missing]
    lines += [f"  (entry {key} was corrupt and has been dropped: {problem})" for key, problem in dropped]
    return CacheMissError(f"--require-cache is set but the cache at {store.root} lacks {what}:\n"
                          + "\n".join(lines) + "\n" + hint)


def _store_once(store: ArtifactStore, manifest: Manifest, data: bytes, replace: bool = False) -> bool:
    """Store an entry under its key's lock unless another process stored it meanwhile (or,
    with `replace`, replacing what is there). True if this process wrote it."""
    with store.lock(manifest.key):
        if replace:
            store.delete(manifest.key)
        elif store.get(manifest.key) is not None:
            return False
        store.put(manifest, data)
        return True


def _spec_manifest(setup: ModelSetup, key: str) -> Manifest:
    return Manifest(key=key, kind=MODEL_KIND, label="graph", model=setup.model_type, factors=setup.model_factors(),
                    checksum="", size=0, created=time.time())


def _load_cached_graph(setup: ModelSetup, store: ArtifactStore, report: StartupReport
                       ) -> tuple[GraphSpec | None, GraphCode | None]:
    """Mode "graph": the spec and the loaded graph code from the cache (None where missing);
    a code entry that does not load is dropped as corrupt."""
    model_key, code_key = setup.model_key(), setup.graph_code_key()
    with timed(report.timings, "cache lookups"):
        spec = _read_spec(store, model_key)
        code_entry = store.get(code_key)
    if spec is None or code_entry is None:
        return spec, None
    with timed(report.timings, "load graph code"):
        try:
            return spec, load_graph_code(code_entry.data, spec.input_roles, setup.device, name=code_key)
        except GraphCodeError as e:
            store.drop(code_key, str(e))
            return spec, None


def prepare_graph(setup: ModelSetup, store: ArtifactStore, require_cache: bool = False,
                  write: bool = True) -> PreparedModel:
    """Mode "graph": the post-pass FX graph from the cache as code, or captured and stored.

    Both the graph spec and the graph-code entry present and loadable: nothing is captured
    (`report.captured` False). Otherwise the graph is captured once and, with `write`, the
    missing entries are stored under their keys' locks (looking again after taking each);
    a code entry that does not load is dropped as corrupt and rebuilt. With
    `require_cache`, a miss raises CacheMissError naming each missing entry and why.
    A graph whose source cannot be stored (kiln.compiler.graph_code) runs eagerly, with a note.
    """
    report = StartupReport(mode=CompileMode.GRAPH.value)
    model_key, code_key = setup.model_key(), setup.graph_code_key()
    dropped_before = len(store.dropped)
    spec, code = _load_cached_graph(setup, store, report)
    if code is not None:
        assert spec is not None  # loaded against it
        report.graph_from_cache = True
        report.dropped = store.dropped[dropped_before:]
        return PreparedModel(spec=spec, plan=setup.plan, report=report, graph_code=code)
    if require_cache:
        missing = [("graph code", code_key, GRAPH_CODE_KIND, setup.graph_code_factors())]
        if spec is None:
            missing.insert(0, ("graph spec", model_key, MODEL_KIND, setup.model_factors()))
        raise _cache_miss_error(
            store, ("the graph spec and the graph code" if spec is None else "the graph code") + " (compile mode 'graph')",
            missing, store.dropped[dropped_before:],
            f"run `kiln compile --device {setup.device.type} --compile graph` with the same model and settings "
            "(or drop --require-cache to capture and cache the graph now)")

    graph, stale_spec = _capture_against(setup, spec, report)
    spec = graph.spec()
    try:
        data = serialize_graph_code(graph.graph_module, spec.input_roles, setup.device)
        # Check now that what would be stored loads, rather than at the next start-up.
        load_graph_code(data, spec.input_roles, setup.device, name=code_key)
    except GraphCodeError as e:
        report.mode = CompileMode.EAGER.value
        report.note = f"compile='graph' fell back to eager: the post-pass graph cannot be cached as code ({e})"
        logger.warning("kiln cache: %s", report.note)
    else:
        if write:
            with timed(report.timings, "store graph"):
                if _store_once(store, _spec_manifest(setup, model_key), spec.to_bytes(), replace=stale_spec):
                    report.stored.append(model_key)
                capture_s = round(report.timings.get("graph capture", 0.0), 3)
                code_manifest = Manifest(key=code_key, kind=GRAPH_CODE_KIND, label="graph-code",
                                         model=setup.model_type, factors=setup.graph_code_factors(), checksum="",
                                         size=0, created=time.time(), extra={"capture_seconds": capture_s})
                if _store_once(store, code_manifest, data):
                    report.stored.append(code_key)
    report.dropped = store.dropped[dropped_before:]
    return PreparedModel(spec=spec, plan=setup.plan, report=report, graph=graph)


def _look_up_buckets(setup: ModelSetup, store: ArtifactStore, report: StartupReport
                     ) -> tuple[GraphSpec | None, dict[Bucket, bytes]]:
    """Mode "inductor": the cached spec and every cached bucket's artifact bytes."""
    found: dict[Bucket, bytes] = {}
    with timed(report.timings, "cache lookups"):
        spec = _read_spec(store, setup.model_key())
        for bucket, key in setup.bucket_keys().items():
            t0 = time.perf_counter()
            entry = store.get(key)
            if entry is not None:
                found[bucket] = entry.data
                report.buckets.append(BucketResult(bucket, key, "hit", time.perf_counter() - t0, len(entry.data)))
    report.graph_from_cache = spec is not None
    return spec, found


def _capture_for_compile(setup: ModelSetup, store: ArtifactStore, spec: GraphSpec | None,
                         report: StartupReport) -> tuple[ModelGraph, GraphSpec]:
    """Capture the graph to compile missing buckets; store its spec if the cache lacks it."""
    graph, stale = _capture_against(setup, spec, report)
    if spec is None or stale:
        spec = graph.spec()
        _store_once(store, _spec_manifest(setup, setup.model_key()), spec.to_bytes(), replace=stale)
    return graph, spec


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
    report = StartupReport(mode=CompileMode.INDUCTOR.value)
    bucket_keys = setup.bucket_keys()
    dropped_before = len(store.dropped)
    spec, found = _look_up_buckets(setup, store, report)
    missing = [b for b in setup.plan.buckets() if b not in found]
    if require_cache and (missing or spec is None):
        base = setup.model_factors()
        entries = [(b.name, bucket_keys[b], BUCKET_KIND, bucket_factors(base, b)) for b in missing]
        if spec is None:
            entries.insert(0, ("graph spec", setup.model_key(), MODEL_KIND, base))
        raise _cache_miss_error(
            store, f"{len(missing)} of {len(bucket_keys)} bucket(s)" + (" and the graph spec" if spec is None else ""),
            entries, store.dropped[dropped_before:],
            "run `kiln compile` with the same model and settings (or drop --require-cache to compile now)")
    graph = None
    if spec is None or missing:
        graph, spec = _capture_for_compile(setup, store, spec, report)
    if missing:
        assert graph is not None  # captured just above
        with timed(report.timings, "compile"):
            found.update(_compile_missing(setup, store, graph, spec, missing, report, progress))
        report.timings["compile"] -= report.timings.get("waited for another process", 0.0)
    report.dropped = store.dropped[dropped_before:]
    order = {b: i for i, b in enumerate(setup.plan.buckets())}
    report.buckets.sort(key=lambda r: order[r.bucket])  # plan order
    bucket_fns = _load_buckets(setup, found, report, store.root / "tmp") if load else None
    return PreparedModel(spec=spec, plan=setup.plan, report=report, graph=graph, bucket_fns=bucket_fns)


def _load_buckets(setup: ModelSetup, found: dict[Bucket, bytes], report: StartupReport,
                  scratch: Path) -> dict[Bucket, LoadedBucket]:
    failed = [r for r in report.buckets if r.status == "failed"]
    if failed:
        errors = "; ".join(f"{r.bucket.name}: {r.error}" for r in failed)
        raise BucketCompileError(f"{len(failed)} bucket(s) failed to compile: {errors}")
    with timed(report.timings, "load artifacts"):
        return {b: load_bucket(b, found[b], setup.device, scratch) for b in setup.plan.buckets()}


def _compile_missing(
    setup: ModelSetup,
    store: ArtifactStore,
    graph: ModelGraph,
    spec: GraphSpec,
    missing: list[Bucket],
    report: StartupReport,
    progress: bool,
) -> dict[Bucket, bytes]:
    from tqdm import tqdm

    out: dict[Bucket, bytes] = {}
    base = setup.model_factors()
    bucket_keys = setup.bucket_keys()
    scratch = store.root / "tmp"
    bar = tqdm(missing, desc="Compiling buckets", unit="bucket", disable=not progress)
    for bucket in bar:
        bar.set_postfix_str(bucket.name)
        key = bucket_keys[bucket]
        t_wait = time.perf_counter()
        with store.lock(key):
            t0 = time.perf_counter()
            waited = t0 - t_wait
            entry = store.get(key)  # another process may have compiled it while we waited
            if entry is not None:
                # Its compile seconds are the other process's: this one only waited (reported apart).
                report.timings["waited for another process"] = (
                    report.timings.get("waited for another process", 0.0) + waited)
                result = BucketResult(bucket, key, "hit", time.perf_counter() - t0, len(entry.data))
                out[bucket] = entry.data
            else:
                try:
                    data = compile_bucket(graph.graph_module, spec.input_roles, spec.constants, setup.config, bucket,
                                          setup.dtype, setup.device, setup.block_size, scratch,
                                          kv_cache_dtype=setup.kv_cache_dtype, tp_size=setup.tp_size)
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


def setup_for_engine(options: CompileOptions, model_config: Any, dtype: torch.dtype,
                     device: torch.device) -> ModelSetup:
    """The `ModelSetup` (key factors, bucket plan, pass pipeline) for these options."""
    from kiln.compiler.buckets import make_bucket_plan

    enable = list(options.enable_passes)
    if options.quantization == "fp8" and "quantize_fp8" not in enable:
        enable.append("quantize_fp8")
    elif options.quantization is not None and options.quantization != "fp8":
        raise ValueError(f"quantization must be 'fp8' or None, got {options.quantization!r}")
    if options.kv_cache_dtype == torch.float8_e4m3fn and "kv_cache_scales" not in enable:
        enable.append("kv_cache_scales")  # per-layer k/v scales as graph inputs
    pm = PassManager.default(enable=enable, disable=options.disable_passes)
    plan = make_bucket_plan(options.max_num_seqs, options.max_num_batched_tokens,
                            options.decode_buckets, options.token_buckets)
    return ModelSetup(config=model_config, dtype=dtype, device=device, pass_manager=pm,
                      block_size=options.block_size, plan=plan,
                      max_num_tokens=max(options.max_num_batched_tokens, 2),
                      kv_cache_dtype=options.kv_cache_dtype, quantization=options.quantization,
                      tp_size=options.tp_size, tp_rank=options.tp_rank, mixed_graph_tokens=options.mixed_graph_tokens)


def prepare_for_engine(options: CompileOptions, model_config: Any, dtype: torch.dtype,
                       device: torch.device, raw_config: dict[str, Any] | None = None) -> PreparedModel:
    """Engine start-up's graph phase: eager capture, or cache lookups + capture/compile + load.
    With a cache being written and `raw_config` (the config.json `model_config` was built
    from), the config's snapshot is stored too (`config_lookup` reads it next time)."""
    setup = setup_for_engine(options, model_config, dtype, device)
    mode = resolve_compile_mode(options.mode, device, options.require_cache, options.cache_dir is not None)
    if options.require_cache:  # a cache that is not there is missing every entry: do not make one
        from kiln.cache.store import default_cache_dir

        root = Path(options.cache_dir).expanduser() if options.cache_dir else default_cache_dir()
        if not root.is_dir():
            raise CacheMissError(f"--require-cache is set but the cache directory {root} does not exist (it is not "
                                 "created); fill it with `kiln compile --cache-dir DIR` with the same settings first")
    early_triton = None
    if device.type == "cuda" and mode == CompileMode.INDUCTOR:
        # Loading Inductor artifacts starts Triton's driver, which builds its utility module
        # on first use: the cached kernels (that module among them) go into Triton's folder
        # before the artifacts load, or a warm start would build it.
        early_triton = _look_up_triton_kernels(setup, options.cache_dir, require_cache=False, write=True)
        restore_triton_entry(early_triton)
    if mode == CompileMode.WARM_OR_EAGER:
        prepared = _prepare_warm_or_eager(setup, options.cache_dir, options.progress)
    elif mode == CompileMode.EAGER:
        prepared = prepare_eager(setup)
    else:
        with ArtifactStore(options.cache_dir) as store:
            if mode == CompileMode.GRAPH:
                prepared = prepare_graph(setup, store, require_cache=options.require_cache)
            else:
                prepared = prepare_compiled(setup, store, require_cache=options.require_cache,
                                            progress=options.progress)
            store_config_snapshot(store, raw_config, model_config)
    logger.debug("%s (%s)", prepared.report.summary(),
                 ", ".join(f"{k} {v:.2f}s" for k, v in prepared.report.timings.items()))
    if device.type == "cuda" and prepared.report.mode != CompileMode.EAGER.value:
        # A cache is in use: the Triton kernels are part of it (kiln.compiler.triton_kernels).
        prepared.triton_kernels = (early_triton if early_triton is not None and early_triton.data is not None else
                                   _look_up_triton_kernels(setup, options.cache_dir, options.require_cache,
                                                           write=mode != WARM_OR_EAGER))
    if not prepared.report.captured:
        # No pass ran (the spec came from the cache): log what they did when it was built,
        # as the pass manager logs a capture's passes (kiln.passes, INFO: `-v`).
        for r in prepared.spec.pass_records:
            stats = ", ".join(f"{k}={v}" for k, v in r["stats"].items()) or "-"
            logging.getLogger("kiln.passes").info("pass %s (%s phase, from the cache): %s", r["name"], r["phase"], stats)
    return prepared


def _prepare_warm_or_eager(setup: ModelSetup, cache_dir: str | None, progress: bool) -> PreparedModel:
    from kiln.cache.store import CacheStoreError

    t0 = time.perf_counter()
    artifact = artifact_mode(setup.device)
    if artifact == "graph":
        keys = [setup.model_key(), setup.graph_code_key()]
    else:
        keys = [setup.model_key(), *setup.bucket_keys().values()]
    present = 0
    try:
        with ArtifactStore(cache_dir) as store:
            present = sum(key in store for key in keys)
            if present == len(keys):
                if artifact == "graph":
                    # write=False: an entry found unloadable is dropped, and the graph then
                    # captured runs without being stored, as an eager start would.
                    prepared = prepare_graph(setup, store, write=False)
                    if prepared.report.captured and prepared.report.mode == "graph":
                        prepared.report.note = "compile=auto: the cached graph code was unusable; nothing written"
                    return prepared
                return prepare_compiled(setup, store, progress=progress)
    except CacheStoreError as e:  # an unusable default cache must not stop an eager start
        logger.debug("compile cache not usable (%s); running eagerly", e)
    lookups = time.perf_counter() - t0
    prepared = prepare_eager(setup)
    prepared.report.timings = {"cache lookups": lookups, **prepared.report.timings}
    if artifact == "graph":
        how = "`kiln compile` with these settings, or compile='graph', caches the post-pass graph"
    else:
        how = "`kiln compile` with these settings, or compile='inductor', uses Inductor artifacts"
    prepared.report.note = f"compile=auto: {present} of {len(keys)} cache entries present, none compiled; {how}"
    return prepared


@dataclass
class TritonKernelsEntry:
    """A CUDA setup's Triton-kernel entry: its key, and its bytes when the cache holds it."""

    key: str
    factors: dict[str, Any]
    cache_dir: str | None
    model: str
    write: bool  # take and store the kernels when the entry is missing
    data: bytes | None = None
    restored: tuple[int, float] | None = None  # (files, seconds) once unpacked into Triton's folder


def restore_triton_entry(entry: TritonKernelsEntry) -> None:
    """Unpack a cached entry into Triton's folder once (`entry.restored`); a damaged one is
    dropped from the store (`entry.data` becomes None) and the kernels are taken again."""
    if entry.data is None or entry.restored is not None:
        return
    t0 = time.perf_counter()
    try:
        files = restore_triton_kernels(entry.data)
    except TritonKernelsError as e:
        with ArtifactStore(entry.cache_dir) as store:
            store.drop(entry.key, str(e))
        entry.data = None
    else:
        entry.restored = (files, time.perf_counter() - t0)


def _look_up_triton_kernels(setup: ModelSetup, cache_dir: str | None, require_cache: bool,
                            write: bool) -> TritonKernelsEntry:
    key, factors = setup.triton_kernels_key(), setup.triton_kernels_factors()
    with ArtifactStore(cache_dir) as store:
        entry = store.get(key)
        if entry is None and require_cache:
            raise _cache_miss_error(
                store, "the Triton kernels of this setup (CUDA)", [("triton kernels", key, TRITON_KERNELS_KIND, factors)],
                [], "run `kiln compile --device cuda` with the same model and settings: it runs every bucket once "
                    "and stores the kernels (or drop --require-cache to compile them now)")
    return TritonKernelsEntry(key=key, factors=factors, cache_dir=cache_dir, model=setup.model_type, write=write,
                              data=entry.data if entry is not None else None)


@contextlib.contextmanager
def triton_kernels_at_startup(entry: TritonKernelsEntry | None, report: StartupReport) -> Iterator[bool]:
    """Around an engine's first kernel runs on CUDA (KV-cache sizing, warm-up, CUDA-graph capture).

    With the entry cached: its files go into Triton's cache folder first, so no kernel is
    compiled (counted; a compile is logged as a warning). With it missing and writable:
    Triton compiles into a fresh private folder, which is stored as the entry afterwards; the
    block is told (True) to run every bucket once, so that every kernel is in it. Without an
    entry (no cache in use, or CPU): nothing. `report.triton` says which happened.
    """
    if entry is None:
        yield False
        return
    restore_triton_entry(entry)  # a no-op when start-up restored it before loading Inductor artifacts
    if entry.data is not None and entry.restored is not None:
        restored, report.timings["restore Triton kernels"] = entry.restored
        with count_triton_compiles() as count:
            yield False
        report.triton = f"Triton kernels from the cache ({restored} files restored), {count.total_compiles} compiled"
        if count.total_compiles:
            logger.warning("kiln cache: %d Triton kernel(s) and %d launcher module(s) were compiled although the "
                           "cache holds this setup's kernels (%s): Triton's own hash differs (another ptxas or "
                           "Triton build?)", count.compiled, count.modules_built, ", ".join(count.names[:5]))
        return
    if not entry.write:
        with count_triton_compiles() as count:
            yield False
        report.triton = (f"Triton kernels not in the cache: {count.compiled} compiled, {count.from_disk} from "
                         "Triton's own cache (cache not written)")
        return
    with ArtifactStore(entry.cache_dir) as store:
        scratch = store.root / "tmp"
    with capture_triton_kernels(scratch) as capture:
        yield True
    if capture.data is None:
        report.triton = f"Triton kernels not cached: {capture.reason}"
        logger.info("kiln cache: %s", report.triton)
        return
    with ArtifactStore(entry.cache_dir) as store:
        manifest = Manifest(key=entry.key, kind=TRITON_KERNELS_KIND, label="triton-kernels", model=entry.model,
                            factors=entry.factors, checksum="", size=0, created=time.time(),
                            extra={"kernels": capture.num_kernels, "compiled": capture.count.compiled,
                                   "modules_built": capture.count.modules_built})
        if _store_once(store, manifest, capture.data):
            report.stored.append(entry.key)
    report.triton = (f"Triton kernels compiled ({capture.count.compiled}) and cached "
                     f"({capture.num_kernels} kernels, {len(capture.data) / 2**20:.1f} MiB)")


# ---- config snapshots: a warm start without transformers' config classes ----------------------

def _transformers_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return "?"


def config_snapshot_key(raw_config: dict[str, Any]) -> str:
    return key_for(CONFIG_KIND, config_snapshot_factors(raw_config, _transformers_version()))


def config_lookup(options: CompileOptions) -> Callable[[dict[str, Any]], ConfigSnapshot | None] | None:
    """For `resolve_model(config_from_cache=...)`: the cached snapshot of a config.json, where
    start-up reads the cache at all (not compile='eager'; without a cache directory given,
    only a default cache that already exists). None: build the config with transformers."""
    if options.mode == CompileMode.EAGER:
        return None
    from kiln.cache.store import CacheStoreError, default_cache_dir

    root = Path(options.cache_dir).expanduser() if options.cache_dir else default_cache_dir()

    def lookup(raw: dict[str, Any]) -> ConfigSnapshot | None:
        if not root.is_dir():
            return None
        try:
            with ArtifactStore(str(root)) as store:
                return _read_entry(store, config_snapshot_key(raw), ConfigSnapshot.from_bytes, ModelSourceError)
        except CacheStoreError as e:
            logger.debug("config snapshot not read (%s)", e)
            return None

    return lookup


def store_config_snapshot(store: ArtifactStore, raw_config: dict[str, Any] | None, config: Any) -> None:
    """Keep `config` (built by transformers from `raw_config`) as a snapshot, so that the next
    start-up with this config.json and cache skips transformers' config classes."""
    if raw_config is None or isinstance(config, ConfigSnapshot):
        return
    key = config_snapshot_key(raw_config)
    if key in store:
        return
    try:
        data = ConfigSnapshot.of(config).to_bytes()
    except Exception as e:  # a config that cannot be snapshotted only loses the fast start
        logger.debug("config snapshot not stored (%s: %s)", type(e).__name__, e)
        return
    manifest = Manifest(key=key, kind=CONFIG_KIND, label="config", model=str(getattr(config, "model_type", "?")),
                        factors=config_snapshot_factors(raw_config, _transformers_version()), checksum="", size=0,
                        created=time.time())
    _store_once(store, manifest, data)
