"""Weight loading from real safetensors: Kiln's load rate next to the disk's read rate.

Writes a checkpoint of the model's shape (`--model`, default the Llama-3-8B shape; values
uninitialised, which does not change a read) as safetensors shards with its config.json,
drops the shards from the page cache (fsync + POSIX_FADV_DONTNEED: no root, nothing else on
the machine is touched), then in a fresh process starts `LLM(dir)` and reports its
"load weights" phase as GB/s. The disk's own rate is read the same way: shards dropped from
the page cache again, then read start to end in 64 MiB chunks. Both figures are cold reads
from the same files.

    python bench/load_weights.py --out load_weights.json
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

import torch

import bench_common as bc


def drop_from_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_rate(paths: list[Path]) -> float:
    """GB/s of reading the files once, start to end (cold after drop_from_page_cache)."""
    total, t0 = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while chunk := fh.read(64 * 2**20):
                total += len(chunk)
    return total / (time.perf_counter() - t0) / 1e9


def write_checkpoint(config_path: str, dtype: torch.dtype, out: Path, shard_bytes: int) -> list[Path]:
    from safetensors.torch import save_file

    from kiln.compiler.capture import parameter_shapes
    from kiln.compiler.model_source import load_config

    config = load_config(Path(config_path))
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(Path(config_path).read_text())
    shards, current, size = [], {}, 0
    for name, shape in parameter_shapes(config).items():
        if name in current or any(name in s for s in shards):
            continue
        t = torch.empty(shape, dtype=dtype)
        current[name] = t
        size += t.numel() * t.element_size()
        if size >= shard_bytes:
            shards.append(current)
            current, size = {}, 0
    if current:
        shards.append(current)
    paths = []
    for i, tensors in enumerate(shards):
        path = out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(path))
        paths.append(path)
    return paths


def child(args: argparse.Namespace) -> dict[str, Any]:
    from kiln.runtime.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=args.dir, dtype=args.dtype, device=args.device, enforce_eager=True, max_num_seqs=8,
              progress=False)
    return {"ready_s": time.perf_counter() - t0, "phases": dict(llm.engine.timings)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(parser)
    parser.add_argument("--shard-gb", type=float, default=5.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="kiln-load-"))
    args.dir = str(work / "checkpoint")
    t0 = time.perf_counter()
    paths = write_checkpoint(args.model, bc.kiln_dtype(args.dtype), Path(args.dir), int(args.shard_gb * 1e9))
    total = sum(p.stat().st_size for p in paths)
    result: dict[str, Any] = {"benchmark": "load_weights", "env": bc.environment(), "model": args.model,
                              "dtype": args.dtype, "checkpoint_gb": total / 1e9, "shards": len(paths),
                              "write_s": time.perf_counter() - t0}
    drop_from_page_cache(paths)
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype, "--dir", args.dir,
           "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "TRITON_CACHE_DIR": str(work / "triton")})
    if proc.returncode != 0:
        raise RuntimeError(f"load run failed:\n{proc.stderr[-3000:]}")
    kiln = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))
    seconds = kiln["phases"]["load weights"]
    result["kiln"] = {**kiln, "load_weights_s": seconds, "load_gb_s": total / seconds / 1e9}
    drop_from_page_cache(paths)
    result["disk_cold_read_gb_s"] = read_rate(paths)
    result["page_cache_read_gb_s"] = read_rate(paths)  # the same files again, now cached
    print(f"[kiln] load weights {seconds:.1f}s = {result['kiln']['load_gb_s']:.2f} GB/s; disk (cold) "
          f"{result['disk_cold_read_gb_s']:.2f} GB/s, page cache {result['page_cache_read_gb_s']:.2f} GB/s", flush=True)
    bc.emit(result, args.out)
    for p in paths:
        p.unlink()


if __name__ == "__main__":
    main()
