"""All-reduce latency on the GPUs of this host: NCCL against Kiln's one-shot all-reduce
(kiln.kernels.collectives: PyTorch symmetric memory, peer-to-peer loads), eager and
captured in a CUDA graph, per message size, with the one-shot results checked against NCCL's.

One process per GPU (spawned here), a `torch.distributed` NCCL group over them. Each figure
is the mean time of one all-reduce over `--iters` back-to-back calls (in a graph: `--iters`
calls captured once, the graph replayed `--replays` times), as `kiln::all_reduce` runs them
in a decode step. Sizes are bf16 element counts (4,096: one decode token of an 8B model's
hidden size; 8,192: the 70B's).

    python bench/allreduce.py --out allreduce.json              # every GPU of the host
    python bench/allreduce.py --world-size 2 --sizes 4096,8192,65536
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import bench_common as bc


def _time_eager(fn: Any, x: torch.Tensor, iters: int) -> float:
    for _ in range(5):
        fn(x)
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def _time_graph(fn: Any, x: torch.Tensor, iters: int, replays: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (replays * iters)


def _rank_main(rank: int, world: int, init: str, args: argparse.Namespace, out_file: str) -> None:
    from kiln.kernels import collectives

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world, device_id=device)
    sizes = [int(s) for s in args.sizes.split(",")]
    max_bytes = max(sizes) * 2
    one_shot = collectives.enable_one_shot_all_reduce(torch.bfloat16, device, max_bytes=max_bytes)
    rows: list[dict[str, Any]] = []

    def nccl(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    for n in sizes:
        gen = torch.Generator(device=device).manual_seed(rank * 1000 + n)
        x = torch.randn(n, device=device, dtype=torch.bfloat16, generator=gen)
        row: dict[str, Any] = {"numel": n, "bytes": 2 * n}
        row["nccl_eager_us"] = 1e6 * _time_eager(nccl, x, args.iters)
        row["nccl_graph_us"] = 1e6 * _time_graph(nccl, x, args.iters, args.replays)
        if one_shot is not None and one_shot.takes(x):
            # Exact equality is not expected (NCCL may sum in another order); bf16 rounding is.
            expected, got = nccl(x).float(), one_shot.all_reduce(x).float()
            row["one_shot_max_abs_err"] = float((expected - got).abs().max())
            row["one_shot_eager_us"] = 1e6 * _time_eager(one_shot.all_reduce, x, args.iters)
            row["one_shot_graph_us"] = 1e6 * _time_graph(one_shot.all_reduce, x, args.iters, args.replays)
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({"one_shot_enabled": one_shot is not None, "rows": rows}, f)
    collectives.disable_one_shot_all_reduce()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=0, help="GPUs to use (0: all)")
    parser.add_argument("--sizes", default="4096,8192,32768,65536,262144,524288,1048576,2097152")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    world = args.world_size or torch.cuda.device_count()
    if world < 2 or world > torch.cuda.device_count():
        parser.error(f"needs 2 or more GPUs ({torch.cuda.device_count()} visible; --world-size {args.world_size})")
    with tempfile.TemporaryDirectory() as scratch:
        out_file = os.path.join(scratch, "rows.json")
        mp.start_processes(_rank_main, args=(world, f"file://{scratch}/rendezvous", args, out_file), nprocs=world,
                           start_method="spawn")
        with open(out_file) as f:
            measured = json.load(f)
    result = {"benchmark": "allreduce", "env": bc.environment(), "world_size": world,
              "gpu": torch.cuda.get_device_name(0), **measured}
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
