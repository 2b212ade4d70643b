"""Where a warm start's CUDA-graph capture time goes, graph by graph and function by function.

    python3 bench/profile_capture.py --cuda-graph-mixed-tokens 512 [--model bench/llama3_8b.json]

First `kiln compile` builds a Kiln cache in a child process (empty Triton and Inductor caches
of its own); then a second child starts `LLM(...)` from that cache with empty Triton and
Inductor caches too (a server's warm start, as bench/startup.py's warm run), under cProfile
from the moment `ModelRunner.capture_cuda_graphs` is entered to its return. The JSON gives
each graph's capture seconds (`BucketGraphs.capture`: its warm-up run, the capture, the
synchronize after it), their sums by kind, and the functions with the most cumulative time
inside the capture phase: host time, where a `synchronize` stands for the device's work.
The seconds are the profiler's (each Python call costs more under it): bench/startup.py's
`graph_capture_s` gives them without.
Why: mixed-step graphs took ~0.42 s each against ~0.08 s for a decode graph in AQ3
(bench/RESULTS.md), which keeps `cuda_graph_mixed_tokens` off by default.
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
    """The child: LLM(...) from the cache, cProfile over the graph capture."""
    from kiln.runtime.cuda_graphs import capture_seconds_by_kind
    from kiln.runtime.llm import LLM
    from kiln.runtime.model_runner import ModelRunner

    profile = cProfile.Profile()
    capture = ModelRunner.capture_cuda_graphs

    def profiled(self: ModelRunner, *a: Any, **k: Any) -> dict[str, float]:
        profile.enable()
        try:
            return capture(self, *a, **k)
        finally:
            profile.disable()

    ModelRunner.capture_cuda_graphs = profiled  # type: ignore[method-assign]
    t0 = time.perf_counter()
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              cache_dir=args.cache_dir, require_cache=True, progress=False, **bc.bucket_options(args))
    ready = time.perf_counter() - t0
    seconds = dict(llm.engine.graph_capture_seconds)
    profile.create_stats()  # (empty where nothing was captured: CPU, --enforce-eager)
    rows = []
    for (path, line, name), (_, calls, _, cumulative, _) in profile.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(path).name}:{line}({name})", "calls": calls, "cumulative_s": cumulative})
    rows.sort(key=lambda r: -r["cumulative_s"])
    return {"ready_s": ready, "phases": dict(llm.engine.timings), "graph_capture_s": seconds,
            "by_kind": capture_seconds_by_kind(seconds), "top_functions": rows[:args.top]}


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
