"""FP8 projections at Llama-3-8B shapes: torch._scaled_mm against Kiln's Triton FP8 GEMV, and
the bf16 projection (cuBLAS / Kiln's bf16 GEMV, what kiln::linear runs) as the baseline.

For M = 1..16 rows (decode) and larger M (prefill-sized), each of QKV (6144 x 4096), O
(4096 x 4096), gate/up (28672 x 4096) and down (4096 x 14336) is timed inside a CUDA graph
(20 replays of 10 calls) and reported as microseconds and achieved weight bandwidth (TB/s),
so the choice `kiln.kernels.triton_fp8.FP8_GEMV_MAX_ROWS` makes (GEMV at <= 16 rows) can be
checked: if _scaled_mm wins, run with KILN_FP8_GEMV_MAX_ROWS=0 (or lower the constant).

_scaled_mm runs both with and without fast accumulation (`kiln.kernels.fp8.FP8_FAST_ACCUM`),
with TFLOP/s, and each one's error: relative to the float32 product of the same e4m3 operands
(what the accumulation adds) and to the bf16 product of the unquantized operands (everything
FP8 costs), both as ||y - ref|| / ||ref||.

    python bench/fp8_gemm.py --out fp8_gemm.json
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

import bench_common as bc

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def time_us(fn: Callable[[], Any], calls: int = 10) -> float:
    """Microseconds per call of `fn`, `calls` of them in one CUDA graph (bench_common)."""
    return bc.graph_time_us([fn] * calls)


def errors(y: torch.Tensor, exact: torch.Tensor, unquantized: torch.Tensor, prefix: str) -> dict[str, float]:
    """Relative errors of an FP8 product `y`: against `exact`, the float32 product of the same
    e4m3 operands (`_accum_err`), and `unquantized`, the bf16 product of the unquantized ones
    (`_total_err`)."""
    y = y.float()
    return {f"{prefix}_accum_err": ((y - exact).norm() / exact.norm()).item(),
            f"{prefix}_total_err": ((y - unquantized).norm() / unquantized.norm()).item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16,32,128,1024,2048,16384")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("fp8_gemm.py times GPU kernels; no CUDA device is available")
    import kiln.kernels  # noqa: F401  (registers the CUDA kernels)
    from kiln.kernels.fp8 import fp8_linear_reference, quantize_fp8_rows, quantize_fp8_rowwise
    from kiln.kernels.triton_fp8 import fp8_gemv_config, fp8_linear_triton
    from kiln.kernels.triton_linear import linear_triton

    rows = [int(r) for r in args.rows.split(",")]
    result: dict[str, Any] = {"benchmark": "fp8_gemm", "env": bc.environment(), "results": []}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_fp8_rowwise(w)
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_fp8_rows(x)
            row: dict[str, Any] = {"proj": name, "n": n, "k": k, "m": m}
            row["bf16_us"] = time_us(lambda: linear_triton(x, w))
            exact = (xq.float() * xs) @ (wq.float() * ws[:, None]).t()
            unquantized = (x @ w.t()).float()
            for key, fast in (("scaled_mm_us", False), ("scaled_mm_fast_us", True)):
                call = lambda fast=fast: fp8_linear_reference(xq, xs, wq, ws, None, torch.bfloat16, fast_accum=fast)
                row[key] = time_us(call)
                row[key.replace("_us", "_tflop_s")] = 2 * m * n * k / (row[key] * 1e-6) / 1e12
                row.update(errors(call(), exact, unquantized, key.replace("_us", "")))
            if fp8_gemv_config(n, k, m) is not None:
                row["fp8_gemv_us"] = time_us(lambda: fp8_linear_triton(xq, xs, wq, ws, None, torch.bfloat16))
            for key in ("bf16_us", "scaled_mm_us", "scaled_mm_fast_us", "fp8_gemv_us"):
                if key in row:
                    weight_bytes = n * k * (2 if key == "bf16_us" else 1)
                    row[key.replace("_us", "_tb_s")] = weight_bytes / (row[key] * 1e-6) / 1e12
            result["results"].append(row)
            print(f"[{name} m={m}] bf16 {row['bf16_us']:.1f} us, scaled_mm {row['scaled_mm_us']:.1f} us"
                  f" (fast accum {row['scaled_mm_fast_us']:.1f}; accumulation error"
                  f" {row['scaled_mm_accum_err']:.2e} vs {row['scaled_mm_fast_accum_err']:.2e} fast, total"
                  f" {row['scaled_mm_total_err']:.2e} vs {row['scaled_mm_fast_total_err']:.2e})"
                  + (f", fp8 GEMV {row['fp8_gemv_us']:.1f} us" if "fp8_gemv_us" in row else ""), flush=True)
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
