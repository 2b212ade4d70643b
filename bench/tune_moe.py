"""`kiln::fused_moe`'s Triton kernels per tiling, at the MoE shapes of bench/moe.py.

For each shape (Mixtral-8x7B: 8 experts, hidden 4,096, intermediate 14,336, top-2;
Qwen3-MoE-30B-A3B: 128 experts, hidden 2,048, intermediate 768, top-8) and each token count
of `--tokens` (decode batches and prefill-sized steps), one layer's `fused_moe_triton` is
timed (CUDA events, median of `--repeats`; routing and grouping included, as a step runs
them) with the tiling `choose_tiling` picks and with every tiling of a sweep: decode-sized
steps (BLOCK_M <= 64 by the rows per expert) sweep narrow row tiles, steps of one 128-row
block an expert (Mixtral's ~330-sequence decode) 128-row tiles of every width, K tile, warp
count and depth, prefill-sized ones wide row and column tiles and the programs' order
(`MoETiling.group_m`). By default every timing
is of the op replayed inside a CUDA graph, as a decode step runs it (`--timing events` times
eager calls instead: in I3 the routing's launches made the same decode tiling differ by up
to 25% from one eager timing to the next). Each result carries TFLOP/s (2 x pairs x 3 x
hidden x intermediate) and the weight bytes' TB/s, and the best tiling per shape, so the
table in `kernels/triton_moe.py` (`choose_tiling`) can be set from it (`--max-tilings` cuts
each sweep short to fit a device command). Each shape and token count also times
`kiln.kernels.moe.fused_moe_grouped_mm` (torch's grouped GEMM, the `KILN_MOE_GROUPED_MM_MIN_ROWS`
alternative) and its largest difference from the kernels' output. `--sweeps tma` (or
`kernels,tma`) also times the sorted-rows kernels (`KILN_MOE_TMA_MIN_ROWS`: rows gathered into
expert order once, tiles loaded by tensor descriptors) at the default tiling and a short sweep,
with their largest difference from the default kernels' output. `--sweeps gate_up,down` sweeps
each GEMM's tiling alone, the other at the default (the row blocks stay the default's; each on
the path the step takes by default, the sorted-rows kernels from `KILN_MOE_TMA_MIN_ROWS` rows an
expert): the default tables give both GEMMs one tiling. `--sweeps grouping` times the pairs'
grouping by torch ops (`group_pairs`) against one kernel (`group_pairs_in_one_kernel`), alone
and as part of the whole op (`KILN_MOE_GROUPING_KERNEL_MAX_PAIRS`). `--sweeps dense` times, for
steps of at least 2,048 tokens, what cuBLAS would do: the rows sorted by expert, then each
expert's gate/up and down as dense `torch.mm` (kiln::silu_and_mul between), the products
weighted and summed per token (eager, events timing; the experts' row counts read to the host
once a layer, as an eagerly run prefill step could): whether prefill-sized steps should leave
the Triton kernels for per-expert GEMMs. `--sweeps fp8` times FP8 experts (e4m3, one scale an
expert and channel) three ways at each size: weight-only (the pointer kernels widen each tile
in the K loop), widened once (`dequantize_experts_triton`, then the 16-bit path; the widening
timed with it) and W8A8 (`fp8_activations`: e4m3 rows on the sorted-rows kernels' e4m3 MMAs, at
the default tiling, whose K tiles are `W8A8_BLOCK_K` deep, and at the 16-bit tiling's), each with its largest relative difference from
the 16-bit default's output: which `KILN_MOE_FP8_DEQUANT_MIN_ROWS` /
`KILN_MOE_FP8_ACTIVATIONS_MIN_ROWS` to set. (A `swap` sweep timed the pointer kernels with the
weight tile as the MMA's M side; they lost at every decode size, bench/RESULTS.md AO1, and went.)

    python bench/tune_moe.py --shapes mixtral-8x7b --tokens 1,8,64,320,1600 --sweeps kernels,fp8

    python bench/tune_moe.py --out tune-moe.json
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

import bench_common as bc

SHAPES = {  # experts, hidden, intermediate, top_k, renormalize
    "mixtral-8x7b": (8, 4096, 14336, 2, True),
    "qwen3-moe-30b-a3b": (128, 2048, 768, 8, True),
    "glm-4.5-air": (128, 4096, 1408, 8, True),        # kiln::moe_experts behind DeepSeek-V3 routing
    "deepseek-v2-lite": (64, 2048, 1408, 6, False),
}


def sweep(decode: bool, one_block_per_expert: bool = False) -> list[Any]:
    from kiln.kernels.triton_moe import MoETiling

    if decode:
        grid = itertools.product((16, 32, 64), (16, 32, 64, 128), (64, 128), (4,), (3, 4))
        return [MoETiling(*t) for t in grid]
    if one_block_per_expert:
        # 65-128 rows per expert (Mixtral's offline decode steps of ~330 sequences): one row block
        # an expert, so each weight tile is read once and the step streams every expert's weights;
        # narrower column tiles and longer K tiles than prefill's, for more programs and more
        # bytes in flight each (the prefill leaders first, for comparison).
        leaders = [MoETiling(128, 128, 64, 8, 4), MoETiling(128, 128, 64, 8, 3)]
        grid = itertools.product((128,), (32, 64, 128), (64, 128), (4, 8), (2, 3, 4, 5))
        # Smaller row blocks pad an expert's ~80 rows less (128-row tiles: 48 rows of MMA work
        # for nothing, at ~435 TFLOP/s counted with them), and the grouped order runs one
        # expert's 2-3 blocks across each column tile together, so the extra weight reads
        # should come from L2 (not yet timed: AC runs swept 128-row blocks only here).
        smaller = itertools.product((32, 64), (64, 128), (64, 128), (4, 8), (3, 4), (4, 8))
        return (leaders + [MoETiling(*t) for t in grid if MoETiling(*t) not in leaders]
                + [MoETiling(m, n, k, w, st, group_m=g) for m, n, k, w, st, g in smaller])
    # Prefill-sized steps: the program order (`group_m`: 0, or G row blocks across every column
    # tile first) over the tilings that led the I3 sweep, and the rest of that sweep in order 0.
    leaders = [(128, 128, 64, 8, 4), (128, 128, 64, 8, 3), (64, 256, 64, 8, 4), (128, 64, 64, 4, 4),
               (128, 256, 64, 8, 3)]
    grid = [MoETiling(*t, group_m=g) for t in leaders for g in (0, 8, 16, 32)]
    rest = itertools.product((64, 128), (64, 128, 256), (64,), (4, 8), (3, 4))
    return grid + [MoETiling(*t) for t in rest if t not in leaders]


def tma_sweep(block_m: int) -> list[Any]:
    """Tilings for the sorted-rows (tensor descriptor) kernels: the pointer kernels' prefill
    leader in several program orders, and narrower row tiles where the rows per expert are few."""
    from kiln.kernels.triton_moe import MoETiling

    if block_m < 128:
        grid = itertools.product((block_m,), (32, 64, 128), (64, 128), (4,), (3, 4))
        return [MoETiling(*t) for t in grid]
    # The leaders of the first sweep (AC1 in bench/RESULTS.md) and wider or narrower program
    # groups (warp specialization, tried in AC2, gained nothing at 8 warps and failed to compile at 4).
    return [MoETiling(128, 128, 64, 8, 3, group_m=16), MoETiling(128, 128, 64, 8, 4, group_m=16),
            MoETiling(128, 128, 64, 8, 3, group_m=32), MoETiling(128, 128, 64, 8, 3, group_m=8)]


def part_sweep(default: Any) -> list[Any]:
    """One GEMM's tilings with the default's row blocks (BLOCK_M) and program order."""
    from kiln.kernels.triton_moe import MoETiling

    grid = itertools.product((32, 64, 128), (64, 128), (4, 8), (3, 4))
    return [MoETiling(default.block_m, n, k, w, st, group_m=default.group_m) for n, k, w, st in grid]


def per_expert_dense(x: torch.Tensor, logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     top_k: int, renorm: bool) -> torch.Tensor:
    """fused_moe's result by one dense GEMM pair per expert over its rows (sorted by expert)."""
    from kiln.kernels.moe import route

    t, h = x.shape
    experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    routing = route(logits, top_k, renorm, True, x.dtype)
    pairs = routing.experts.reshape(-1)
    order = torch.argsort(pairs, stable=True)
    tokens = order // top_k
    counts = torch.bincount(pairs, minlength=experts).tolist()  # the one host read
    rows = x.index_select(0, tokens)
    products = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(counts):
        if n:
            gate_up = torch.mm(rows[start:start + n], w_gate_up[e].t())
            act = torch.ops.kiln.silu_and_mul(gate_up[:, :inter], gate_up[:, inter:])
            torch.mm(act, w_down[e].t(), out=products[start:start + n])
        start += n
    weighted = products.float() * routing.weights.reshape(-1)[order, None].float()
    return torch.zeros((t, h), dtype=torch.float32, device=x.device).index_add_(0, tokens, weighted).to(x.dtype)


def quantized_experts(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(gate/up e4m3, its [E, 2I] scales, down e4m3, its [E, H] scales), as the loader quantizes them."""
    from kiln.passes.weight_transforms import QuantizeFP8Weight, fp8_scale_name

    out = []
    for w in (w_gate_up, w_down):
        entry = {"experts": w}
        QuantizeFP8Weight("experts").apply(entry)
        out += [entry["experts"], entry[fp8_scale_name("experts")]]
    return tuple(out)


def time_fp8_experts(x: torch.Tensor, logits: torch.Tensor, experts: tuple[torch.Tensor, ...], top_k: int,
                     renorm: bool, reference: torch.Tensor, default: Any, args: Any, name: str, t: int,
                     flops: float) -> dict[str, Any]:
    """FP8 experts' three paths at one size (see the module docstring): ms, TFLOP/s, difference."""

    from kiln.kernels.triton_moe import dequantize_experts_triton, fused_moe_triton, pair_per_block

    gq, gs, dq, ds = experts
    num_experts = gq.shape[0]
    paths = {
        "weight_only": lambda: fused_moe_triton(x, logits, gq, dq, top_k, renorm, True, tma=False,
                                                w_gate_up_scale=gs, w_down_scale=ds),
        "widened_once": lambda: fused_moe_triton(x, logits, dequantize_experts_triton(gq, gs, x.dtype),
                                                 dequantize_experts_triton(dq, ds, x.dtype), top_k, renorm, True),
    }
    if not pair_per_block(t * top_k, num_experts):
        paths["w8a8"] = lambda: fused_moe_triton(x, logits, gq, dq, top_k, renorm, True, w_gate_up_scale=gs,
                                                 w_down_scale=ds, fp8_activations=True)
        # The 16-bit tiling as it is (64-element K tiles from 64 rows an expert), as W8A8 ran
        # before W8A8_BLOCK_K: what the default's 128-element K tiles gain.
        paths["w8a8_16bit_tiling"] = lambda: fused_moe_triton(x, logits, gq, dq, top_k, renorm, True, tiling=default,
                                                              w_gate_up_scale=gs, w_down_scale=ds,
                                                              fp8_activations=True)
    row: dict[str, Any] = {}
    ref = reference.float()
    for label, fn in paths.items():
        try:
            ms = bc.call_ms(fn, args.repeats, args.timing)
            rel = float((fn().float() - ref).norm() / ref.norm())
        except Exception as e:  # a tiling that does not fit: named, skipped
            print(f"[{name} T={t}] fp8 {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        row[label] = {"ms": ms, "tflop_s": flops / ms / 1e9, "relative_difference_vs_16_bit": rel}
        print(f"[{name} T={t}] fp8 {label}: {ms:.3f} ms ({flops / ms / 1e9:.0f} TFLOP/s), "
              f"relative difference {rel:.2e}", flush=True)
    return row


def time_group(group: Any, experts_of: torch.Tensor, num_experts: int, block_m: int, args: Any) -> float:
    """One grouping of the pairs, ms (as `bc.call_ms` times the op); the output checked against torch's."""
    from kiln.kernels.triton_moe import group_pairs

    blocks, ref = group(experts_of, num_experts, block_m), group_pairs(experts_of, num_experts, block_m)
    if not (torch.equal(blocks.sorted_pairs.int(), ref.sorted_pairs.int())
            and torch.equal(blocks.block_expert.int(), ref.block_expert.int())):
        raise RuntimeError(f"{group.__name__}: blocks differ from group_pairs'")
    return bc.call_ms(lambda: group(experts_of, num_experts, block_m), args.repeats, args.timing)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    # 320: the decode batch of the Mixtral offline run, which its KV cache bounds (J1).
    parser.add_argument("--tokens", default="1,8,64,256,320,2048,16384")
    parser.add_argument("--max-tilings", type=int, default=0,
                        help="time only the first N tilings of each sweep (0: all), to fit a device command")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timing", choices=("graph", "events"), default="graph",
                        help="graph: replays of a CUDA graph of the op (default); events: eager calls")
    parser.add_argument("--sweeps", default="kernels",
                        help="comma list: kernels (the pointer kernels' tilings), tma (the sorted-rows kernels'), "
                             "gate_up and down (each GEMM's tiling apart), grouping (the pairs' grouping), dense "
                             "(per-expert cuBLAS GEMMs), fp8 (FP8 experts' paths)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    sweeps = set(args.sweeps.split(","))
    if not sweeps <= {"kernels", "tma", "gate_up", "down", "grouping", "dense", "fp8"}:
        parser.error(f"--sweeps: {args.sweeps!r}; a comma list of kernels, tma, gate_up, down, grouping, dense, fp8")
    if not torch.cuda.is_available():
        parser.error("tune_moe.py times the CUDA kernels; no CUDA device is available")
    from kiln.kernels.moe import fused_moe_grouped_mm
    from kiln.kernels import triton_moe
    from kiln.kernels.triton_moe import choose_tiling, fused_moe_triton, pair_per_block

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    result: dict[str, Any] = {"benchmark": "tune_moe", "env": bc.environment(), "timing": args.timing, "shapes": {}}
    for name in args.shapes.split(","):
        if name not in SHAPES:
            parser.error(f"--shapes: unknown {name!r}; choose from {', '.join(SHAPES)}")
        experts, hidden, inter, top_k, renorm = SHAPES[name]
        w_gate_up = torch.randn((experts, 2 * inter, hidden), device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        w_down = torch.randn((experts, hidden, inter), device=device, dtype=torch.bfloat16, generator=gen) * 0.02
        weight_bytes = (w_gate_up.numel() + w_down.numel()) * 2
        fp8_experts = quantized_experts(w_gate_up, w_down) if "fp8" in sweeps else None
        rows: dict[str, Any] = {}
        for t in (int(x) for x in args.tokens.split(",")):
            x = torch.randn((t, hidden), device=device, dtype=torch.bfloat16, generator=gen)
            logits = torch.randn((t, experts), device=device, dtype=torch.float32, generator=gen)
            pairs = t * top_k
            touched = min(experts, pairs)  # at most: the bytes a step must read
            flops = 2 * pairs * 3 * hidden * inter

            def run(tiling: Any = None, tma: bool | None = False, down: Any = None) -> Any:
                return fused_moe_triton(x, logits, w_gate_up, w_down, top_k, renorm, True, tiling=tiling, tma=tma,
                                        down_tiling=down)

            def time_ms(tiling: Any = None, tma: bool | None = False, down: Any = None) -> float:
                return bc.call_ms(lambda: run(tiling, tma, down), args.repeats, args.timing)

            default = choose_tiling(pairs, experts, inter, hidden)
            bc.warm_gpu()  # the default is timed first: not at idle clocks
            default_ms = time_ms(tma=None)  # the path a step takes
            timings = [(default_ms, default)]  # the default competes too
            tilings = sweep(decode=default.block_m <= 64, one_block_per_expert=pairs <= 128 * experts)
            if "kernels" not in sweeps:
                tilings = []
            for tiling in tilings[:args.max_tilings or len(tilings)]:
                try:
                    timings.append((time_ms(tiling), tiling))
                except Exception as e:  # a tiling that does not fit (shared memory): skipped, named
                    print(f"[{name} T={t}] {tiling}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            best_ms, best = min(timings, key=lambda r: r[0])
            def grouped() -> Any:  # torch's grouped GEMM (CUTLASS on sm_90): the alternative for prefill
                return fused_moe_grouped_mm(x, logits, w_gate_up, w_down, top_k, renorm, True)

            try:
                grouped_ms = bc.call_ms(grouped, args.repeats, args.timing)
                grouped_err = float((grouped().float() - run().float()).abs().max())
            except Exception as e:
                print(f"[{name} T={t}] grouped_mm: {type(e).__name__}: {str(e)[:160]}", flush=True)
                grouped_ms, grouped_err = None, None

            def figures(ms: float) -> dict[str, float]:
                return {"ms": ms, "tflop_s": flops / ms / 1e9,
                        "weight_tb_s": weight_bytes * touched / experts / ms / 1e9}

            tma_row = None
            if "tma" in sweeps and not pair_per_block(pairs, experts):
                tma_timings, tma_default_ms = [], None
                for tiling in [default] + tma_sweep(default.block_m):
                    try:
                        tma_timings.append((time_ms(tiling, tma=True), tiling))
                        if tiling is default:
                            tma_default_ms = tma_timings[-1][0]
                    except Exception as e:
                        print(f"[{name} T={t}] tma {tiling}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                if tma_timings:
                    tma_ms, tma_tiling = min(tma_timings, key=lambda r: r[0])
                    tma_err = float((run(tma_tiling, tma=True).float() - run().float()).abs().max())
                    tma_row = {"default": None if tma_default_ms is None else figures(tma_default_ms),
                               "best": {"tiling": vars(tma_tiling), **figures(tma_ms),
                                        "max_abs_diff_vs_default": tma_err},
                               "speedup_of_best_vs_default": default_ms / tma_ms,
                               "sweep": [{"tiling": vars(tl), "ms": ms} for ms, tl in sorted(tma_timings, key=lambda r: r[0])]}
                    print(f"[{name} T={t}] tma: best {tma_ms:.3f} ms ({flops / tma_ms / 1e9:.0f} TFLOP/s) {tma_tiling} "
                          f"({default_ms / tma_ms:.2f}x the default path), max diff {tma_err:.3g}", flush=True)

            parts: dict[str, Any] = {}
            for part in ("gate_up", "down"):
                if part not in sweeps or pair_per_block(pairs, experts):
                    continue
                part_timings = []
                for tiling in part_sweep(default):
                    try:  # the other GEMM at the default tiling, on the default path
                        ms = (time_ms(tiling, None, default) if part == "gate_up" else time_ms(default, None, tiling))
                        part_timings.append((ms, tiling))
                    except Exception as e:
                        print(f"[{name} T={t}] {part} {tiling}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                if part_timings:
                    part_ms, part_best = min(part_timings, key=lambda r: r[0])
                    parts[part] = {"best": {"tiling": vars(part_best), **figures(part_ms)},
                                   "speedup_of_best": default_ms / part_ms,
                                   "sweep": [{"tiling": vars(tl), "ms": ms}
                                             for ms, tl in sorted(part_timings, key=lambda r: r[0])]}
                    print(f"[{name} T={t}] {part} alone: best {part_ms:.3f} ms {part_best} "
                          f"({default_ms / part_ms:.2f}x the default {default_ms:.3f})", flush=True)
            grouping: dict[str, Any] = {}
            if "grouping" in sweeps and not pair_per_block(pairs, experts):
                experts_of = torch.topk(logits, top_k, dim=-1).indices
                grouping["torch_ops_ms"] = time_group(triton_moe.group_pairs, experts_of, experts, default.block_m, args)
                grouping["one_kernel_ms"] = time_group(triton_moe.group_pairs_in_one_kernel, experts_of, experts,
                                                       default.block_m, args)
                saved = triton_moe.GROUPING_KERNEL_MAX_PAIRS, triton_moe.GROUPING_KERNEL_MAX_EXPERTS
                triton_moe.GROUPING_KERNEL_MAX_EXPERTS = experts  # this shape's experts too, whatever the limit
                for label, limit in (("op_torch_ops_ms", 0), ("op_one_kernel_ms", 1 << 30)):
                    triton_moe.GROUPING_KERNEL_MAX_PAIRS = limit
                    grouping[label] = time_ms(tma=None)
                triton_moe.GROUPING_KERNEL_MAX_PAIRS, triton_moe.GROUPING_KERNEL_MAX_EXPERTS = saved
                print(f"[{name} T={t}] grouping: torch ops {grouping['torch_ops_ms'] * 1e3:.1f} us, one kernel "
                      f"{grouping['one_kernel_ms'] * 1e3:.1f} us; the op {grouping['op_torch_ops_ms']:.3f} against "
                      f"{grouping['op_one_kernel_ms']:.3f} ms", flush=True)
            dense: dict[str, Any] = {}
            if "dense" in sweeps and t >= 2048:
                dense_ms = bc.call_ms(lambda: per_expert_dense(x, logits, w_gate_up, w_down, top_k, renorm),
                                      args.repeats, "events")
                eager_ms = bc.call_ms(lambda: run(tma=None), args.repeats, "events")
                dense_err = float((per_expert_dense(x, logits, w_gate_up, w_down, top_k, renorm).float()
                                   - run(tma=None).float()).abs().max())
                dense = {**figures(dense_ms), "default_events_ms": eager_ms, "speedup_vs_default": eager_ms / dense_ms,
                         "max_abs_diff_vs_default": dense_err}
                print(f"[{name} T={t}] dense per expert: {dense_ms:.3f} ms ({flops / dense_ms / 1e9:.0f} TFLOP/s) "
                      f"against the default's {eager_ms:.3f} eager ({eager_ms / dense_ms:.2f}x), max diff "
                      f"{dense_err:.3g}", flush=True)
            fp8_row = time_fp8_experts(x, logits, fp8_experts, top_k, renorm, run(tma=None), default, args,
                                       name, t, flops) if fp8_experts else {}
            rows[str(t)] = {"pairs": pairs, "dense": dense, "fp8": fp8_row, "default": {"tiling": vars(default), **figures(default_ms)},
                            "best": {"tiling": vars(best), **figures(best_ms)},
                            "speedup_of_best": default_ms / best_ms,
                            "grouped_mm": None if grouped_ms is None else {**figures(grouped_ms),
                                                                           "max_abs_diff_vs_default": grouped_err},
                            "sweep": [{"tiling": vars(tl), "ms": ms} for ms, tl in sorted(timings, key=lambda r: r[0])],
                            "tma": tma_row, "parts": parts, "grouping": grouping}
            print(f"[{name} T={t}] default {default_ms:.3f} ms ({flops / default_ms / 1e9:.0f} TFLOP/s) "
                  f"{default}; best {best_ms:.3f} ms {best} ({default_ms / best_ms:.2f}x); grouped_mm "
                  + ("failed" if grouped_ms is None else f"{grouped_ms:.3f} ms ({default_ms / grouped_ms:.2f}x)"),
                  flush=True)
        result["shapes"][name] = rows
        del w_gate_up, w_down, fp8_experts
        bc.free_cuda()
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
