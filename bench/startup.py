"""Start-up: seconds to ready and to first token, cold (empty cache) and warm (cache hit).

Each measurement is a fresh process (nothing survives in memory between them):
  cold    - empty Kiln cache, empty Inductor and Triton caches: everything is compiled;
  compile - `kiln compile` of the same model and options into another cache directory (with
            Triton and Inductor caches of its own), as CI would build it;
  warm    - that cache, copied to a new path, in a process whose Triton and Inductor caches
            are new empty folders and with require_cache=True: the Kiln cache is the only
            compiled state (the server on another machine); it must compile nothing;
  hf      - the baseline: Hugging Face transformers building the same architecture on the
            GPU (random weights) and producing one token.
Reported per run: process wall time, import time, engine construction ("ready") with the
engine's own phase timings, time to the first generated token after ready, and what was
compiled in the process: Triton kernels (Triton's compilation listener) and launcher modules,
files written into the Inductor cache, and whether Dynamo was imported at all.

    python bench/startup.py --out startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROCESS_START = time.perf_counter()

import torch  # noqa: E402

import bench_common as bc  # noqa: E402

PROMPT = list(range(0, 128))  # 128 token ids (in any vocabulary of >= 128)


def _files(folder: str | None) -> int:
    return sum(1 for p in Path(folder).rglob("*") if p.is_file()) if folder and Path(folder).is_dir() else 0


def child_kiln(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.compiler.triton_kernels import count_triton_compiles
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    imported = time.perf_counter()
    with count_triton_compiles() as triton:
        llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                  cache_dir=args.cache_dir, require_cache=args.require_cache, progress=False,
                  **({"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}), **bc.bucket_options(args))
        ready = time.perf_counter()
        # torch._dynamo (with sympy) is seconds of imports that a warm start should not need.
        dynamo_at_ready = "torch._dynamo" in sys.modules
        out = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        bc.sync(args.device)
        first = time.perf_counter()
    dynamo_frames = 0
    if "torch._dynamo" in sys.modules:
        from torch._dynamo.utils import counters

        dynamo_frames = sum(counters["frames"].values())
    return {"import_s": imported - PROCESS_START, "ready_s": ready - imported, "first_token_s": first - ready,
            "process_to_first_token_s": first - PROCESS_START, "phases": dict(llm.engine.timings),
            "graph_capture_s": dict(llm.engine.graph_capture_seconds),
            "startup": llm.engine.startup_report.summary(),
            "compiles": {"triton_kernels": triton.compiled, "triton_from_disk": triton.from_disk,
                         "triton_modules_built": triton.modules_built,
                         "inductor_cache_files": _files(os.environ.get("TORCHINDUCTOR_CACHE_DIR")),
                         "dynamo_imported": "torch._dynamo" in sys.modules, "dynamo_frames": dynamo_frames},
            "dynamo_imported_at_ready": dynamo_at_ready, "greedy_tokens": list(out[0].outputs[0].token_ids)}


@torch.inference_mode()
def child_hf(args: argparse.Namespace) -> dict[str, Any]:
    config = bc.load_config(args.model, args.load_format)
    imported = time.perf_counter()
    model = bc.hf_model(config, bc.kiln_dtype(args.dtype), torch.device(args.device))
    bc.sync(args.device)
    ready = time.perf_counter()
    ids = torch.tensor([PROMPT], device=args.device)
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    bc.sync(args.device)
    first = time.perf_counter()
    return {"import_s": imported - PROCESS_START, "ready_s": ready - imported, "first_token_s": first - ready,
            "process_to_first_token_s": first - PROCESS_START}


def run_child(args: argparse.Namespace, kind: str, env: dict[str, str], cache_dir: str | None = None,
              require_cache: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, "--model", args.model, "--load-format", args.load_format,
           "--dtype", args.dtype, "--cache-dir", cache_dir or args.cache_dir, "--device", args.device]
    cmd += (["--require-cache"] if require_cache else []) + (["--max-num-seqs", str(args.max_num_seqs)]
                                                             if args.max_num_seqs else [])
    cmd += bc.bucket_flags(args)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} start-up run failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    line = next(l for l in reversed(proc.stdout.splitlines()) if l.startswith("{"))
    return {"process_wall_s": wall, **json.loads(line)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(parser)
    parser.add_argument("--cache-dir", default=None, help="Kiln cache directory (default: a fresh temporary one)")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="default: the engine's own (sized from the GPU, as a user gets it)")
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to try the script")
    parser.add_argument("--child", choices=("kiln", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--require-cache", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_kiln(args) if args.child == "kiln" else child_hf(args)), flush=True)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("startup.py measures GPU start-up; no CUDA device is available")
    work = Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    args.cache_dir = args.cache_dir or str(work / "kiln-cache")

    def fresh_env(name: str) -> dict[str, str]:
        """Inductor's and Triton's own caches in new empty folders of their own."""
        env = dict(os.environ)
        env["TORCHINDUCTOR_CACHE_DIR"] = str(work / name / "inductor-cache")
        env["TRITON_CACHE_DIR"] = str(work / name / "triton-cache")
        return env

    result: dict[str, Any] = {"benchmark": "startup", "env": bc.environment(), "model": args.model,
                              "dtype": args.dtype, "cache_dir": args.cache_dir, "buckets": bc.bucket_options(args)}
    result["cold"] = run_child(args, "kiln", fresh_env("cold"))
    print(f"[kiln] cold: ready {result['cold']['ready_s']:.1f}s", flush=True)
    # CI: `kiln compile` into a cache of its own; the server: a copy of it on another path.
    built = work / "ci-cache"
    cmd = [sys.executable, "-m", "kiln.runtime.cli", "compile", "--model", args.model, "--load-format",
           args.load_format, "--dtype", args.dtype, "--device", args.device, "--cache-dir", str(built)]
    cmd += ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
    cmd += bc.bucket_flags(args, for_compile=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=fresh_env("compile"), capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"kiln compile failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result["compile"] = {"wall_s": time.perf_counter() - t0, "command": " ".join(cmd[1:]),
                         "output": proc.stdout.strip().splitlines()[-8:]}
    print(f"[kiln] kiln compile: {result['compile']['wall_s']:.1f}s", flush=True)
    served = work / "served-cache"
    shutil.copytree(built, served)
    result["warm"] = run_child(args, "kiln", fresh_env("warm"), cache_dir=str(served), require_cache=True)
    print(f"[kiln] warm (copied cache, empty Triton/Inductor caches): ready {result['warm']['ready_s']:.1f}s, "
          f"first token {result['warm']['process_to_first_token_s']:.1f}s after process start, "
          f"compiles {result['warm']['compiles']}", flush=True)
    result["warm_same_tokens_as_cold"] = result["warm"]["greedy_tokens"] == result["cold"]["greedy_tokens"]
    env = fresh_env("hf")
    if not args.no_baseline:
        result["baseline"] = {"name": "transformers eager (sdpa), from config on the GPU", **run_child(args, "hf", env)}
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
