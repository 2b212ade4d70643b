"""Start-up: seconds to ready and to first token, cold (empty cache) and warm (cache hit).

Each measurement is a fresh process (nothing survives in memory between them):
  cold  - empty Kiln cache, empty Inductor and Triton caches: everything is compiled;
  warm  - the same cache directories again: artifacts are loaded, nothing is compiled;
  hf    - the baseline: Hugging Face transformers building the same architecture on the
          GPU (random weights) and producing one token.
Reported per run: process wall time, import time, engine construction ("ready") with the
engine's own phase timings, and time to the first generated token after ready.

    python bench/startup.py --out startup.json
"""

from __future__ import annotations

import argparse
import json
import os
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


def child_kiln(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    imported = time.perf_counter()
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              cache_dir=args.cache_dir, max_num_seqs=args.max_num_seqs, progress=False, **bc.bucket_options(args))
    ready = time.perf_counter()
    # torch._dynamo (with sympy) is seconds of imports that a warm start should not need.
    dynamo_at_ready = "torch._dynamo" in sys.modules
    llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    bc.sync(args.device)
    first = time.perf_counter()
    return {"import_s": imported - PROCESS_START, "ready_s": ready - imported, "first_token_s": first - ready,
            "process_to_first_token_s": first - PROCESS_START, "phases": dict(llm.engine.timings),
            "dynamo_imported_at_ready": dynamo_at_ready}


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


def run_child(args: argparse.Namespace, kind: str, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", kind, "--model", args.model, "--load-format", args.load_format,
           "--dtype", args.dtype, "--cache-dir", args.cache_dir, "--max-num-seqs", str(args.max_num_seqs),
           "--device", args.device]
    for flag, value in (("--decode-buckets", args.decode_buckets), ("--token-buckets", args.token_buckets)):
        if value:
            cmd += [flag, value]
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
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark); cpu only to try the script")
    parser.add_argument("--child", choices=("kiln", "hf"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_kiln(args) if args.child == "kiln" else child_hf(args)), flush=True)
        return
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("startup.py measures GPU start-up; no CUDA device is available")
    work = Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    args.cache_dir = args.cache_dir or str(work / "kiln-cache")
    env = dict(os.environ)
    # Cold means cold for every layer: Inductor's and Triton's own caches start empty too;
    # the warm run reuses all three, as a restarted server on the same machine would.
    env["TORCHINDUCTOR_CACHE_DIR"] = str(work / "inductor-cache")
    env["TRITON_CACHE_DIR"] = str(work / "triton-cache")
    result: dict[str, Any] = {"benchmark": "startup", "env": bc.environment(), "model": args.model,
                              "dtype": args.dtype, "cache_dir": args.cache_dir, "buckets": bc.bucket_options(args)}
    result["cold"] = run_child(args, "kiln", env)
    print(f"[kiln] cold: ready {result['cold']['ready_s']:.1f}s", flush=True)
    result["warm"] = run_child(args, "kiln", env)
    print(f"[kiln] warm: ready {result['warm']['ready_s']:.1f}s", flush=True)
    if not args.no_baseline:
        result["baseline"] = {"name": "transformers eager (sdpa), from config on the GPU", **run_child(args, "hf", env)}
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
