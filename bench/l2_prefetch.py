"""Would an L2 prefetch of the next GEMV's weights, run beside a latency-bound kernel, speed
up decode at batch 1? An experiment on the FP8 GEMVs (kernels/triton_fp8.py), not a feature.

At batch 1 a decode step is ~2.8 ms on the H200 (bench/RESULTS.md, R2), of which ~0.7 ms are
small kernels (norms, RoPE, attention over a short context, quantization) that leave HBM
idle, and each GEMV streams its weight from HBM at 2.4-3.7 TB/s, the small ones worst (o
7.0 us for 16.8 MB). The idea: while such a kernel runs, a second stream of the CUDA graph
brings (part of) the next GEMV's weight into L2, so the GEMV starts with its bytes close.

For each FP8 projection of the Llama-3-8B shape and each `--gap-us` (the latency-bound
kernel's time: one program's chain of dependent multiply-adds, calibrated here), one CUDA
graph replays, over enough weight copies to exceed L2:

    serial:    latency kernel -> GEMV(W_i)
    prefetch:  fork; [side stream: bulk L2 prefetch of a fraction of W_i]; latency kernel;
               join; GEMV(W_i)

and prints microseconds per pair, with the GEMV alone from HBM and from L2 (one copy, timed
repeatedly) for the bounds. Launches are as the engine's (PDL where the GPU has it).

    python bench/l2_prefetch.py --out l2-prefetch.json
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import triton
import triton.language as tl

import bench_common as bc

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
THREADS = 128  # a prefetch program's threads (4 warps); each asks for one contiguous range


@triton.jit
def _latency_kernel(state_ptr, iters):
    # One program, a chain of dependent multiply-adds: busy for a set time, HBM idle.
    x = tl.load(state_ptr)
    for _ in range(iters):
        x = x * 0.999 + 0.001
    tl.store(state_ptr, x)


@triton.jit
def _l2_prefetch_kernel(w_ptr, chunk_bytes, SUB: tl.constexpr, THREADS_C: tl.constexpr):
    # Each thread asks for SUB contiguous bytes with one bulk prefetch (sm_90): no register
    # is written and nothing waits for the data.
    base = w_ptr + tl.program_id(0).to(tl.int64) * chunk_bytes
    ptrs = base + tl.arange(0, THREADS_C).to(tl.int64) * SUB
    sizes = tl.full([THREADS_C], SUB, tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                              [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, num_bytes: int, programs: int) -> None:
    flat = w.view(torch.uint8).view(-1)
    # Each range starts 16-aligned (the instruction's rule: a misaligned one faults): programs
    # are THREADS ranges of `sub` bytes apart, and the tail past programs * THREADS * sub is left.
    sub = num_bytes // programs // THREADS // 16 * 16
    if sub:
        _l2_prefetch_kernel[(programs,)](flat, THREADS * sub, SUB=sub, THREADS_C=THREADS, num_warps=THREADS // 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--gap-us", default="3,6,10", help="the latency-bound kernel's times to try")
    parser.add_argument("--fractions", default="1,0.5,0.25", help="fractions of the weight to prefetch")
    parser.add_argument("--programs", type=int, default=132)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("l2_prefetch.py times CUDA kernels; no CUDA device is available")
    import kiln.kernels  # noqa: F401
    from kiln.kernels.fp8 import quantize_fp8_rows
    from kiln.kernels.triton_fp8 import fp8_linear_triton

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    state = torch.zeros(1, device=device)
    side = torch.cuda.Stream()

    def latency_us(iters: int) -> float:
        return bc.graph_time_us([lambda: _latency_kernel[(1,)](state, iters)])

    bc.warm_gpu()
    per_iter = latency_us(20000) / 20000
    result: dict[str, Any] = {"benchmark": "l2_prefetch", "env": bc.environment(), "programs": args.programs,
                              "latency_us_per_iteration": per_iter, "shapes": {}}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        nbytes = n * k
        weights = bc.weights_past_l2(n, k, True, gen, min_copies=2)
        copies = len(weights)
        xq, xs = quantize_fp8_rows(torch.randn((1, k), device=device, dtype=torch.bfloat16, generator=gen))

        def gemv(i: int) -> None:
            fp8_linear_triton(xq, xs, weights[i][0], weights[i][1], None, torch.bfloat16)

        shape_out: dict[str, Any] = {
            "weight_bytes": nbytes,
            "gemv_hbm_us": bc.graph_time_us([lambda i=i: gemv(i) for i in range(copies)]),
            "gemv_l2_us": bc.graph_time_us([lambda: gemv(0)] * copies),
            "gaps": {},
        }
        for gap in (float(g) for g in args.gap_us.split(",")):
            iters = max(1, round(gap / per_iter))

            def pair(i: int, fraction: float | None) -> None:
                if fraction is None:
                    _latency_kernel[(1,)](state, iters)
                else:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        prefetch(weights[i][0], int(nbytes * fraction), args.programs)
                    _latency_kernel[(1,)](state, iters)
                    torch.cuda.current_stream().wait_stream(side)
                gemv(i)

            gap_out = {"latency_us": latency_us(iters),
                       "serial_us": bc.graph_time_us([lambda i=i: pair(i, None) for i in range(copies)])}
            for fraction in (float(f) for f in args.fractions.split(",")):
                gap_out[f"prefetch_{fraction:g}_us"] = bc.graph_time_us(
                    [lambda i=i: pair(i, fraction) for i in range(copies)])
            shape_out["gaps"][f"{gap:g}"] = gap_out
            best = min((v, key) for key, v in gap_out.items() if key.startswith("prefetch"))
            print(f"[{name} gap {gap:g} us] latency {gap_out['latency_us']:.1f}, serial {gap_out['serial_us']:.1f}, "
                  f"best {best[1]} {best[0]:.1f} us a pair (GEMV alone {shape_out['gemv_hbm_us']:.1f} from HBM, "
                  f"{shape_out['gemv_l2_us']:.1f} from L2)", flush=True)
        result["shapes"][name] = shape_out
        del weights
        bc.free_cuda()
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
