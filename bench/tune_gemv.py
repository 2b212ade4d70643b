"""`kiln::linear`'s Triton GEMVs per tiling, at the Llama-3-8B projections (decode rows).

For each projection (QKV 6144 x 4096, O 4096 x 4096, gate/up 28672 x 4096, down 4096 x
14336, LM head 128256 x 4096) and each row count of `--rows`, the GEMV is timed inside a CUDA
graph with the tiling `choose_config` picks (`kernels/triton_linear.py`'s tables), with every
tiling of a sweep, and as cuBLAS (`F.linear`). A decode step reads each weight once, from
HBM: so each call here reads another of enough weight copies that together they exceed the
L2 cache (O's 33.5 MB alone would fit in the H200's 50 MB). Results: microseconds, achieved
weight TB/s, the best tiling per projection and row count, and its gain over the table's.
At batch 1 the H200 profiles (bench/RESULTS.md, H2/H5) put QKV at 2.85 TB/s and O at 1.96
against ~4 for the wide projections: this says whether a tiling closes that gap.

At one row the sweep also takes the 2-16-row (tl.dot) kernel's tilings (`GemvConfig.dot`);
at every row count that kernel with a 64-row tile too (`GemvConfig.block_m`: warpgroup MMA).
`--sweep wide` times only the 64-row tile, `--sweep narrow` only its 16-column and
deep-pipeline tilings, `--sweep split_k` only FP8 tilings that split K
(`GemvConfig.split_k`), `--sweep swap` only FP8 tilings with the weight as the MMA's rows
(`GemvConfig.swap_ab`), `--sweep none` only the table's tiling and the baseline.
With `--fp8` the same for `kiln::fp8_linear`'s FP8 GEMVs (e4m3 weights with per-channel
scales, per-token quantized rows; `kernels/triton_fp8.py`), against `torch._scaled_mm`: the
row kernel's K tiles are twice the bf16 sweep's (one-byte weights, the same bytes a tile).

    python bench/tune_gemv.py --out tune-gemv.json
    python bench/tune_gemv.py --fp8 --out tune-gemv-fp8.json
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch
import torch.nn.functional as F

import bench_common as bc

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def split_k_sweep(m: int) -> list[Any]:
    """FP8 GEMVs with K split over 2-8 programs per column tile (`GemvConfig.split_k`): for
    the narrow projections (o, down: 4,096 columns), whose 2-16-row tiles give 128 programs
    for 132 SMs (down 23.4 us at eight rows against 17.5 at one, R2)."""
    from kiln.kernels.triton_linear import GemvConfig

    if m == 1:
        grid = itertools.product((4, 8, 16), (512, 1024), (4, 8), (3,), (2, 4))
        return [GemvConfig(n, k, w, st, split_k=sp) for n, k, w, st, sp in grid]
    grid = itertools.product((16, 32), (256, 512), (4, 8), (3, 4), (2, 4, 7))
    wide = itertools.product((32, 64), (256, 512), (4,), (3, 4), (2, 4, 7))  # the 64-row tile split too
    return ([GemvConfig(n, k, w, st, split_k=sp) for n, k, w, st, sp in grid]
            + [GemvConfig(n, k, w, st, block_m=64, split_k=sp) for n, k, w, st, sp in wide])


def sweep(m: int, fp8: bool = False, kind: str = "all") -> list[Any]:
    from kiln.kernels.triton_linear import GemvConfig

    if kind == "none":
        return []
    if kind == "split_k":
        return split_k_sweep(m) if fp8 else []
    if kind == "swap":
        # The FP8 weight tile as the MMA's rows (`GemvConfig.swap_ab`): 64 or 128 output
        # columns a program (o and down, 4,096 columns: 64 or 32 programs unsplit, so K split
        # in two too), rows as the 16 columns.
        grid = itertools.product((64, 128), (256, 512), (4,), (3, 4, 5), (1, 2))
        return [GemvConfig(n, k, w, st, swap_ab=True, split_k=sp) for n, k, w, st, sp in grid] if fp8 else []

    # Deeper pipelines too (5-6 stages): at eight rows o and down, one program an SM, streamed
    # at 1.9-2.5 TB/s with the table's 4 (R2).
    dot_grid = itertools.product((16, 32, 64, 128), (64, 128, 256, 512), (4, 8), (3, 4, 5, 6))
    # The tl.dot kernel with a 64-row tile (`GemvConfig.block_m`): Hopper's warpgroup MMA, on
    # e4m3 tiles as they are for FP8 (the 16-row tile converts them to float16 first).
    wide = [GemvConfig(*t, dot=m == 1, block_m=64)
            for t in itertools.product((32, 64, 128), (128, 256, 512), (4, 8), (2, 3, 4))]
    if kind == "wide":
        return wide
    if kind == "narrow":
        # The 64-row tile on narrower columns and longer K tiles: o and down at 2-16 rows have
        # 4,096 columns, 128 programs of the table's 32 for 132 SMs, each streaming its K alone
        # at ~2.1-2.8 TB/s (S1); 16 columns give two programs an SM, deeper pipelines more
        # bytes in flight each.
        narrow = itertools.product((16,), (256, 512, 1024), (4,), (3, 4, 5, 6))
        deep = itertools.product((32,), (512, 1024), (4,), (5, 6))
        return [GemvConfig(*t, dot=m == 1, block_m=64) for t in itertools.chain(narrow, deep)]
    if m == 1:
        # Narrow tiles and long K tiles too: QKV and O (few programs) sat at 2.0-2.9 TB/s
        # with the last sweep's best. Then the tl.dot kernel at one row (`GemvConfig.dot`):
        # FP8 gate/up at eight rows beat the row kernel at one (I4), and took the table's row
        # at one (R1).
        k_tiles = (512, 1024, 2048, 4096) if fp8 else (256, 512, 1024, 2048)
        grid = itertools.product((4, 8, 16, 32), k_tiles, (4, 8, 16), (3, 4))
        return [GemvConfig(*t) for t in grid] + [GemvConfig(*t, dot=True) for t in dot_grid] + wide
    return [GemvConfig(*t) for t in dot_grid] + wide


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--fp8", action="store_true", help="kiln::fp8_linear's FP8 GEMVs against torch._scaled_mm")
    parser.add_argument("--sweep", default="all", choices=["all", "wide", "narrow", "split_k", "swap", "none"],
                        help="the tilings to time beside the table's and the baseline: every one, only the "
                             "64-row tile (warpgroup MMA), only its 16-column and deep-pipeline tilings, "
                             "only split K (--fp8), only the weight as the MMA's rows (--fp8), or none")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("tune_gemv.py times the CUDA kernels; no CUDA device is available")
    import kiln.kernels  # noqa: F401  (registers the CUDA kernels)
    from kiln.kernels.fp8 import fp8_linear_reference, quantize_fp8_rows
    from kiln.kernels.triton_fp8 import fp8_gemv_config, fp8_linear_triton
    from kiln.kernels.triton_linear import choose_config, linear_triton

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    # shape_dims: for KILN_FP8_GEMV_TUNED (kernels/triton_fp8.py), which reads a result's winners
    result: dict[str, Any] = {"benchmark": "tune_gemv", "env": bc.environment(), "fp8": args.fp8, "shapes": {},
                              "shape_dims": {name: list(SHAPES[name]) for name in args.shapes.split(",")
                                             if name in SHAPES}}
    baseline = "scaled_mm" if args.fp8 else "cublas"
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"--shapes: unknown {name!r}; choose from {', '.join(SHAPES)}")
        n, k = SHAPES[name]
        weight_bytes = n * k * (1 if args.fp8 else 2)
        weights = bc.weights_past_l2(n, k, args.fp8, gen)  # with --fp8: (e4m3 [n, k], float32 [n]) each
        rows_out: dict[str, Any] = {}
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn((m, k), device=device, dtype=torch.bfloat16, generator=gen)
            xq, xs = quantize_fp8_rows(x) if args.fp8 else (None, None)

            def timed(config: Any) -> float:
                if args.fp8:
                    if config == baseline:
                        calls = [lambda w=w: fp8_linear_reference(xq, xs, w[0], w[1], None, torch.bfloat16)
                                 for w in weights]
                    else:
                        calls = [lambda w=w: fp8_linear_triton(xq, xs, w[0], w[1], None, torch.bfloat16, config=config)
                                 for w in weights]
                    return bc.graph_time_us(calls)
                if config == baseline:
                    return bc.graph_time_us([lambda w=w: F.linear(x, w) for w in weights])
                return bc.graph_time_us([lambda w=w: linear_triton(x, w, config=config) for w in weights])

            bc.warm_gpu()  # the baseline and the table's tiling are timed first: not at idle clocks
            default = fp8_gemv_config(n, k, m) if args.fp8 else choose_config(n, k, m)
            table = default if default is not None else baseline  # what the op runs at this shape
            candidates = [(baseline, timed(baseline))]
            if default is not None:
                candidates.append((default, timed(default)))
            for config in sweep(m, args.fp8, args.sweep):
                if k % (config.block_k * config.split_k):
                    continue  # the kernel's K loop has no mask (choose_config refuses these too)
                try:
                    candidates.append((config, timed(config)))
                except Exception as e:  # a tiling the compiler rejects (shared memory): skipped, named
                    print(f"[{name} m={m}] {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            best, best_us = min(candidates, key=lambda c: c[1])
            default_us = next(us for c, us in candidates if c == table)

            def describe(config: Any) -> Any:
                return config if config == baseline else vars(config)

            rows_out[str(m)] = {
                "default": {"config": describe(table), "us": default_us,
                            "tb_s": weight_bytes / default_us / 1e6},
                "best": {"config": describe(best), "us": best_us, "tb_s": weight_bytes / best_us / 1e6},
                "gain_of_best": default_us / best_us,
                "all": [{"config": describe(c), "us": us} for c, us in sorted(candidates, key=lambda c: c[1])],
            }
            print(f"[{name} m={m}] table {default_us:.1f} us ({weight_bytes / default_us / 1e6:.2f} TB/s) {table}; "
                  f"best {best_us:.1f} us ({weight_bytes / best_us / 1e6:.2f} TB/s) {best}", flush=True)
        result["shapes"][name] = rows_out
        del weights
        bc.free_cuda()
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
