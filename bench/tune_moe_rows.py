"""`fused_moe`'s per-pair GEMV kernels (`kiln.kernels.triton_moe.ROW_KERNELS`) per tiling, against
the 16-row dot kernels, at the small-batch decode steps of models with many small experts.

For each shape (Qwen3-30B-A3B: 128 experts, hidden 2,048, intermediate 768, top-8;
Qwen3-Next-80B: 512 experts, intermediate 512, top-10; DeepSeek-V2-Lite: 64 experts, 1,408,
top-6), expert dtype (bf16; e4m3 with channel scales) and token count of `--tokens` that runs
per pair (`pair_per_block`), one layer's `fused_moe_triton` is timed (replays of a CUDA graph
of the op, median of `--repeats`; routing included) on the dot kernels, on the row kernels at
`row_tiling`'s choice, and with each GEMM's row tiling swept (the other at its default):
BLOCK_N columns, BLOCK_K of K a loop step, warps and pipeline depth. Each result carries the
weight bytes the pairs read (TB/s). Prints JSON (bench_common.emit).

    python bench/tune_moe_rows.py --shapes qwen3-moe-30b-a3b,qwen3-next-80b --tokens 1,8 --out rows.json
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

import bench_common as bc

SHAPES = {  # experts, hidden, intermediate, top_k
    "qwen3-moe-30b-a3b": (128, 2048, 768, 8),
    "qwen3-next-80b": (512, 2048, 512, 10),
    "deepseek-v2-lite": (64, 2048, 1408, 6),
}


def row_sweep(element_size: int) -> list[Any]:
    from kiln.kernels.triton_moe import RowTiling

    ks = (256, 512, 1024) if element_size == 1 else (128, 256, 512)
    return [RowTiling(n, k, w, 3) for n, k, w in itertools.product((4, 8, 16), ks, (4, 8))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="1,8")
    parser.add_argument("--cases", default=None,
                        help="only these shape:dtype:tokens cases, comma-separated (e.g. qwen3-next-80b:fp8:1)")
    parser.add_argument("--dtypes", default="bf16,fp8", help="expert dtypes: bf16, fp8 (e4m3, channel scales)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--max-tilings", type=int, default=0, help="time only the first N of each sweep (0: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("tune_moe_rows.py times the CUDA kernels; no CUDA device is available")
    from kiln.kernels import triton_moe
    from kiln.kernels.triton_moe import fused_moe_triton, pair_per_block
    from tune_moe import quantized_experts

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    default_rows = triton_moe.row_tiling
    result: dict[str, Any] = {"benchmark": "tune_moe_rows", "env": bc.environment(), "shapes": {}}
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"--shapes: unknown {name!r}; choose from {', '.join(SHAPES)}")
        experts, hidden, inter, top_k = SHAPES[name]
        w_gate_up = torch.randn((experts, 2 * inter, hidden), device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        w_down = torch.randn((experts, hidden, inter), device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        shape_rows: dict[str, Any] = {}
        for dtype in args.dtypes.split(","):
            if dtype == "fp8":
                gq, gs, dq, ds = quantized_experts(w_gate_up, w_down)
                weights, scales, elem = (gq, dq), {"w_gate_up_scale": gs, "w_down_scale": ds}, 1
            else:
                weights, scales, elem = (w_gate_up, w_down), {}, 2
            for t in (int(x) for x in args.tokens.split(",")):
                pairs = t * top_k
                if args.cases and f"{name}:{dtype}:{t}" not in args.cases.split(","):
                    continue
                if not pair_per_block(pairs, experts):
                    print(f"[{name} {dtype} T={t}] not a per-pair step: skipped", flush=True)
                    continue
                x = torch.randn((t, hidden), device=device, dtype=torch.bfloat16, generator=gen)
                logits = torch.randn((t, experts), device=device, dtype=torch.float32, generator=gen)
                read = pairs * 3 * hidden * inter * elem  # each pair's expert read once (pairs rarely share one)

                def time_ms(row_kernels: bool) -> float:
                    return bc.call_ms(lambda: fused_moe_triton(x, logits, *weights, top_k, True, True, per_pair=True,
                                                               row_kernels=row_kernels, **scales),
                                      args.repeats, "graph")

                bc.warm_gpu()
                dot_ms, row_ms = time_ms(False), time_ms(True)
                gu_default = default_rows(pairs, inter, hidden, elem, halves=2)
                down_default = default_rows(pairs, hidden, inter, elem)
                parts: dict[str, list[dict[str, Any]]] = {}
                for part, default in (("gate_up", gu_default), ("down", down_default)):
                    timings = []
                    for tiling in row_sweep(elem)[:args.max_tilings or None]:
                        def pick(num_pairs: int, n: int, k: int, element_size: int = 2, halves: int = 1,
                                 _part: str = part, _tiling: Any = tiling) -> Any:
                            mine = (halves == 2) == (_part == "gate_up")
                            return _tiling if mine else default_rows(num_pairs, n, k, element_size, halves)

                        triton_moe.row_tiling = pick
                        try:
                            timings.append({"tiling": vars(tiling), "ms": time_ms(True)})
                        except Exception as e:  # a tiling that does not compile or fit: named, skipped
                            print(f"[{name} {dtype} T={t}] {part} {tiling}: {type(e).__name__}: {str(e)[:100]}",
                                  flush=True)
                        finally:
                            triton_moe.row_tiling = default_rows
                    parts[part] = sorted(timings, key=lambda r: r["ms"])
                best = {p: rows[0] for p, rows in parts.items() if rows}
                row = {"pairs": pairs, "weight_bytes": read, "dot_ms": dot_ms, "row_ms": row_ms,
                       "dot_tb_s": read / dot_ms / 1e9, "row_tb_s": read / row_ms / 1e9,
                       "row_default": {"gate_up": vars(gu_default), "down": vars(down_default)},
                       "best": best, "sweeps": {p: rows[:10] for p, rows in parts.items()}}
                shape_rows[f"{dtype} T={t}"] = row
                print(f"[{name} {dtype} T={t}] dot {dot_ms * 1e3:.1f} us ({row['dot_tb_s']:.2f} TB/s), rows "
                      f"{row_ms * 1e3:.1f} us ({row['row_tb_s']:.2f} TB/s) at {gu_default} / {down_default}; best "
                      + ", ".join(f"{p} {r['ms'] * 1e3:.1f} us {r['tiling']}" for p, r in best.items()), flush=True)
        result["shapes"][name] = shape_rows
        del w_gate_up, w_down
        bc.free_cuda()
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
