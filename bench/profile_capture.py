"""Where a warm start's CUDA-graph capture time goes, graph by graph and function by function.

    python3 bench/profile_capture.py --cuda-graph-mixed-tokens 512 [--model bench/llama3_8b.json]

First `kiln compile` builds a Kiln cache in a child process (empty Triton and Inductor caches
of its own); then a second child starts `LLM(...)` from that cache with empty Triton and
Inductor caches too (a server's warm start, as bench/startup.py's warm run), with one cProfile
per kind of graph (decode, mixed) over its `BucketGraphs.capture` calls. The JSON gives each
graph's capture seconds, split into phases (`BucketGraphs.capture_phases`: the warm-up run with
the device's time, the capture with its garbage collection and graph instantiation, the
synchronize after it), their sums by kind, and per kind the functions with the most cumulative
time per graph: host time, where a `synchronize` stands for the device's work. Set side by
side, the two kinds' lists say what a mixed capture does that a decode capture does not.
The seconds are the profiler's (each Python call costs more under it): bench/startup.py's
`graph_capture_s` gives them without.
Why it was written: AQ3 (bench/RESULTS.md) charged the mixed-step graphs ~0.42 s each of a warm
start; AR1, this script's first run, found ~0.07 s each under the profiler, no more than a
decode graph, and `cuda_graph_mixed_tokens` became 512 by default.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_common as bc


def profiled_start(args: argparse.Namespace) -> dict[str, Any]:
    """The child: LLM(...) from the cache, one cProfile per kind of graph over its captures."""
    from kiln.runtime.cuda_graphs import BucketGraphs, capture_seconds_by_kind

    profiles: dict[str, cProfile.Profile] = {}
    counts: dict[str, int] = {}
    capture = BucketGraphs.capture

    def profiled(self: BucketGraphs, bucket: Any, *a: Any, **k: Any) -> None:
        kind = str(getattr(bucket, "kind", "other"))
        profile = profiles.setdefault(kind, cProfile.Profile())
        counts[kind] = counts.get(kind, 0) + 1
        profile.enable()
        try:
            capture(self, bucket, *a, **k)
        finally:
            profile.disable()

    BucketGraphs.capture = profiled  # type: ignore[method-assign]
    from kiln.runtime.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              cache_dir=args.cache_dir, require_cache=True, progress=False, **bc.bucket_options(args))
    ready = time.perf_counter() - t0
    seconds = dict(llm.engine.graph_capture_seconds)
    graphs = getattr(llm.engine.runner, "_graphs", None)  # (none where nothing was captured: CPU, --enforce-eager)
    phases = {getattr(b, "name", str(b)): p for b, p in (graphs.capture_phases.items() if graphs else ())}
    top: dict[str, list[dict[str, Any]]] = {}
    for kind, profile in profiles.items():
        profile.create_stats()
        rows = [{"function": f"{Path(path).name}:{line}({name})", "calls_per_graph": calls / counts[kind],
                 "cumulative_s_per_graph": cumulative / counts[kind]}
                for (path, line, name), (_, calls, _, cumulative, _) in profile.stats.items()]  # type: ignore[attr-defined]
        top[kind] = sorted(rows, key=lambda r: -r["cumulative_s_per_graph"])[:args.top]
    return {"ready_s": ready, "phases": dict(llm.engine.timings), "graph_capture_s": seconds,
            "graph_capture_phases_s": phases, "by_kind": capture_seconds_by_kind(seconds), "graphs_by_kind": counts,
            "top_functions_by_kind": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(parser)
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to try the script")
    parser.add_argument("--top", type=int, default=40, help="how many functions to list")
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)  # the child's: the built cache
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(profiled_start(args)), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="kiln-capture-"))
    cache = work / "kiln-cache"

    def env(name: str) -> dict[str, str]:
        return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / name / "inductor"),
                "TRITON_CACHE_DIR": str(work / name / "triton")}

    common = ["--model", args.model, "--load-format", args.load_format, "--dtype", args.dtype, "--device", args.device]
    t0 = time.perf_counter()
    built = subprocess.run([sys.executable, "-m", "kiln.runtime.cli", "compile", *common, "--cache-dir", str(cache),
                            *bc.bucket_flags(args, for_compile=True)], env=env("compile"), capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"kiln compile failed (exit {built.returncode}):\n{built.stderr[-4000:]}")
    compile_s = time.perf_counter() - t0
    proc = subprocess.run([sys.executable, __file__, "--child", *common, *bc.bucket_flags(args), "--cache-dir", str(cache),
                           "--top", str(args.top)], env=env("warm"), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the warm start failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    warm = json.loads(next(l for l in reversed(proc.stdout.splitlines()) if l.startswith("{")))
    result = {"benchmark": "profile_capture", "env": bc.environment(), "model": args.model,
              "buckets": bc.bucket_options(args), "compile_s": compile_s, "warm": warm}
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
