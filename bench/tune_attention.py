"""Paged attention (`attend_paged_triton`) on the steps of the throughput workload, per tiling.

Three step shapes of the offline-throughput run (Llama-3-8B heads: 32 query, 8 KV, dim
128; block size 16; contexts drawn like its requests):
  decode  - `--decode-seqs` sequences, one new token each, contexts uniform in [128, 1280];
  prefill - `--prefill-tokens` new tokens in whole prompts of 128-1024 tokens;
  mixed   - both in one call, as a mixed step of continuous batching runs them
(decode + prefill, each at its best tiling, is what splitting a mixed step's launch in two
would cost). Each is timed for every tiling in the sweep and for the default choice, as
`--repeats` replays of a CUDA graph of the call (`--timing events`: the median of eager
calls, which also times the launcher), with the KV bytes read (decode) and FLOPs (prefill)
turned into TB/s and TFLOP/s. `--kv-cache-dtype fp8` runs them over an e4m3 cache (with
k/v scales), whose decode sweep adds 256-key tiles (the bytes of a 128-key bf16 tile); both
sweep the keys-as-rows decode kernel (`keys_as_rows`: e4m3 MMAs over an FP8 cache, bf16 ones
over a bf16 cache; `--decode-sweep rows` times only it).

    python bench/tune_attention.py --out tune-attention.json
    python bench/tune_attention.py --kv-cache-dtype fp8 --out tune-attention-fp8.json
    python bench/tune_attention.py --mask-ab    # each kind's default, and it with the other masking
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from typing import Any

import torch

import bench_common as bc

HQ, HKV, D, BLOCK = 32, 8, 128, 16


def make_step(decode_ctx: list[int], prompts: list[int], device: torch.device, gen: torch.Generator,
              cache_dtype: torch.dtype = torch.bfloat16, hq: int = HQ, hkv: int = HKV, d: int = D,
              planes: int = 2) -> dict[str, Any]:
    """Inputs of one attention call: decodes first, then whole-prompt prefills (as scheduled);
    `planes` 1: a latent cache, whose one plane is K and V."""
    new = [1] * len(decode_ctx) + prompts
    ctx = decode_ctx + prompts
    blocks_per_seq = [-(-c // BLOCK) for c in ctx]
    width = max(blocks_per_seq)
    total_blocks = sum(blocks_per_seq) + 1
    perm = torch.randperm(total_blocks - 1, generator=gen) + 1  # scattered blocks, 0 is the null block
    tables = torch.zeros((len(ctx), width), dtype=torch.int32)
    at = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[at:at + n]
        at += n
    qsl = torch.tensor([0] + list(itertools.accumulate(new)), dtype=torch.int32)
    t = int(qsl[-1])
    kv = torch.randn((planes, total_blocks, BLOCK, hkv, d), generator=gen).to(cache_dtype)
    return {
        "q": torch.randn((t, hq, d), generator=gen).to(torch.bfloat16).to(device),
        "kv_cache": kv.to(device), "block_tables": tables.to(device),
        "seq_lens": torch.tensor(ctx, dtype=torch.int32, device=device), "query_start_loc": qsl.to(device),
        "kv_bytes": sum(ctx) * hkv * d * planes * kv.element_size(),
        "flops": sum(4 * n * (c - n + (n + 1) / 2) * hq * d for n, c in zip(new, ctx) if n > 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-seqs", type=int, default=256)
    parser.add_argument("--prefill-tokens", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="the cache's dtype: bf16 (auto) or e4m3 with k/v scales (fp8)")
    parser.add_argument("--kinds", default="decode,prefill,mixed", help="which steps to sweep (comma list)")
    parser.add_argument("--decode-sweep", choices=("all", "wide", "rows"), default="all",
                        help="wide: only decode tiles of 32 and 64 rows (next to the default; 64 rows take Hopper's "
                             "wgmma, which reads its B tiles from shared memory), to fit a device command; rows "
                             ": only the keys-as-rows kernel (e4m3 MMAs over an FP8 cache, bf16 MMAs over a bf16 one)")
    parser.add_argument("--prefill-sweep", choices=("all", "focus"), default="all",
                        help="prefill and mixed tilings: all (rows x keys x warps x stages), or focus: 64/128 "
                             "rows, 64 keys, 4 warps, 2-3 stages, each with e4m3 widened by inline assembly "
                             "(FP8 cache) and with every block masked (the kernel before the interior blocks "
                             "ran unmasked)")
    parser.add_argument("--mask-ab", action="store_true",
                        help="time only the default tiling and the same with the other masking (every key "
                             "block, or only those a tile's rows see in part), per kind")
    parser.add_argument("--timing", choices=("graph", "events"), default="graph",
                        help="graph: replays of a CUDA graph of the call, as a decode step runs it (default); "
                             "events: eager calls, which also time the launcher's Python (~60 us at 1,024 "
                             "sequences; the runs before 2026-12-01's L-series timed this way)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("tune_attention.py times the Triton kernels; no CUDA device is available")
    from kiln.kernels.triton_paged_attention import AttentionTiling, attend_paged_triton, default_tiling

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    decode_ctx = torch.randint(128, 1281, (args.decode_seqs,), generator=gen).tolist()
    prompts: list[int] = []
    while sum(prompts) < args.prefill_tokens:
        prompts.append(int(torch.randint(128, 1025, (1,), generator=gen)))
    fp8 = args.kv_cache_dtype == "fp8"
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    kv_scale = torch.tensor([0.5, 0.25], device=device) if fp8 else None
    steps = {
        "decode": make_step(decode_ctx, [], device, gen, cache_dtype),
        "prefill": make_step([], prompts, device, gen, cache_dtype),
        "mixed": make_step(decode_ctx, prompts, device, gen, cache_dtype),
    }
    # Decode-shaped steps use one-token tiles whatever the row count: sweep their inner loop.
    if fp8:  # with the ways of widening e4m3 tiles: by inline assembly, V loaded as [D, N] and transposed
        decode_tilings = [AttentionTiling(16, bn, warps, stages, widen_asm=asm, v_trans=vt)
                          for bn, warps, stages, asm, vt in itertools.product(
                              (64, 128), (4, 8), (1, 2, 3, 4), (False, True), (False, True))]
    else:
        decode_tilings = [AttentionTiling(16, bn, warps, stages)
                          for bn, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4))]
    # and taller tiles, although a decode fills 4 of their rows: on sm_90, 64 rows on 4 warps
    # take wgmma, whose B operand (K, V) is read from shared memory as it was stored.
    wide_tilings = [AttentionTiling(rows, bn, 4, stages, widen_asm=fp8, v_trans=vt)
                    for rows, bn, stages, vt in itertools.product((32, 64), (64, 128), (1, 2, 3),
                                                                  (False, True) if fp8 else (False,))]
    # Keys as the MMA's rows (kiln.kernels.triton_paged_decode_fp8): e4m3 dots over an e4m3
    # cache, the cache dtype's over a bf16 one (not a default choice there until measured).
    rows_tilings = [AttentionTiling(16, bn, warps, stages, widen_asm=fp8, keys_as_rows=True, heads_fastest=hf)
                    for bn, warps, stages, hf in itertools.product((64, 128) + ((256,) if fp8 else ()), (4, 8),
                                                                   (1, 2, 3), (False, True))
                    if not hf or stages == 1]
    decode_tilings = {"wide": wide_tilings, "rows": rows_tilings}.get(args.decode_sweep,
                                                                       decode_tilings + wide_tilings + rows_tilings)
    prefill_tilings = [AttentionTiling(rows, bn, warps, stages, v_trans=vt)
                       for rows, bn, warps, stages, vt in itertools.product((64, 128), (64, 128), (4, 8), (2, 3),
                                                                            (False, True) if fp8 else (False,))]
    if args.prefill_sweep == "focus":
        prefill_tilings = [AttentionTiling(rows, 64, 4, stages, widen_asm=asm, mask_all_blocks=mask_all)
                           for rows, stages, asm, mask_all in itertools.product(
                               (64, 128), (2, 3), (False, True) if fp8 else (False,), (False, True))]
    result: dict[str, Any] = {"benchmark": "tune_attention", "env": bc.environment(),
                              "shapes": {"heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": BLOCK,
                                         "decode_seqs": args.decode_seqs, "prefill_prompts": prompts,
                                         "kv_cache_dtype": str(cache_dtype)}}
    for name, step in steps.items():
        if name not in args.kinds.split(","):
            continue
        rows = []
        reference = None  # the default tiling's output: every tiling's error is measured against it
        bc.warm_gpu()  # the default is timed first: not at idle clocks
        tilings = decode_tilings if name == "decode" else prefill_tilings
        if args.mask_ab:
            default = default_tiling(step["q"], step["kv_cache"], step["block_tables"].shape[0])
            tilings = [dataclasses.replace(default, mask_all_blocks=not default.mask_all_blocks)]
        for tiling in [None] + tilings:
            def call(tiling: AttentionTiling | None = tiling) -> torch.Tensor:
                return attend_paged_triton(step["q"], step["kv_cache"], step["block_tables"], step["seq_lens"],
                                           step["query_start_loc"], D ** -0.5, 0, tiling=tiling, kv_scale=kv_scale)
            try:
                ms = bc.call_ms(call, args.repeats, args.timing)
                out = call().float()
            except Exception as e:  # a tiling the compiler rejects (shared memory): skip it
                rows.append({"tiling": repr(tiling), "error": str(e)[:120]})
                continue
            reference = out if reference is None else reference
            rel_err = ((out - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()
            rows.append({"tiling": "default" if tiling is None else tiling.__dict__, "ms": ms,
                         "kv_tb_s": step["kv_bytes"] / ms / 1e9, "tflop_s": step["flops"] / ms / 1e9,
                         "max_rel_err_vs_default": rel_err})
        ok = [r for r in rows if "ms" in r]
        best = min(ok, key=lambda r: r["ms"])
        default = next(r for r in ok if r["tiling"] == "default")
        result[name] = {"default": default, "best": best, "all": rows}
        print(f"[{name}] default {default['ms']:.3f} ms, best {best['ms']:.3f} ms {best['tiling']}", flush=True)
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
