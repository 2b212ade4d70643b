"""Attention over a latent cache (multi-head latent attention), per launch shape.

DeepSeek-V2-Lite's attention as Kiln caches it (`caches_latent`): 16 query heads over one KV
head of 576 values (512 latent + 64 RoPE key), one cache plane read as K and V, block size 16.
Decode steps of `--decode-seqs` sequences (each count a step; contexts uniform in [128, 1280])
and a prefill of `--prefill-tokens` tokens in whole prompts of 128-1024 tokens, each timed as
`--repeats` replays of a CUDA graph of the call for: the default choice (the latent kernel,
`kiln.kernels.triton_paged_latent`), every `LatentTiling` of the sweep, and the general
kernel at `LATENT_TILING` (the head dim padded to 1,024, what `KILN_LATENT_KERNEL=0` runs).
Prints JSON: ms, the cache bytes read as TB/s (decode), FLOP/s of the absorbed products
(prefill), and each output's largest difference from the default's.

    python bench/tune_latent_attention.py --out tune-latent.json
    python bench/tune_latent_attention.py --kv-cache-dtype fp8 --decode-seqs 64,256
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import torch

import bench_common as bc
from tune_attention import make_step

HQ, HKV, D = 16, 1, 576  # DeepSeek-V2-Lite: 16 heads, kv_lora_rank 512 + qk_rope_head_dim 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-seqs", default="1,64,256", help="decode steps' sequence counts (comma list)")
    parser.add_argument("--prefill-tokens", type=int, default=8000, help="0: no prefill step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument("--timing", choices=("graph", "events"), default="graph")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("tune_latent_attention.py times the Triton kernels; no CUDA device is available")
    from kiln.kernels.triton_paged_attention import LATENT_TILING, attend_paged_triton
    from kiln.kernels.triton_paged_latent import LatentTiling

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    fp8 = args.kv_cache_dtype == "fp8"
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    kv_scale = torch.tensor([0.5, 0.5], device=device) if fp8 else None
    steps = {}
    for seqs in (int(n) for n in args.decode_seqs.split(",") if n):
        ctx = torch.randint(128, 1281, (seqs,), generator=gen).tolist()
        steps[f"decode-{seqs}"] = make_step(ctx, [], device, gen, cache_dtype, HQ, HKV, D, planes=1)
    if args.prefill_tokens:
        prompts: list[int] = []
        while sum(prompts) < args.prefill_tokens:
            prompts.append(int(torch.randint(128, 1025, (1,), generator=gen)))
        steps["prefill"] = make_step([], prompts, device, gen, cache_dtype, HQ, HKV, D, planes=1)
    result: dict[str, Any] = {"benchmark": "tune_latent_attention", "env": bc.environment(),
                              "shapes": {"heads": HQ, "kv_heads": HKV, "head_dim": D, "kv_cache_dtype": str(cache_dtype)}}
    for name, step in steps.items():
        decode = name.startswith("decode")
        sweep = [LatentTiling(16, rows, bn, warps, stages)
                 for rows, bn, warps, stages in itertools.product((16,) if decode else (16, 32, 64), (16, 32, 64),
                                                                  (4, 8), (1, 2, 3))]
        rows_out, reference = [], None
        bc.warm_gpu()
        for tiling in [None, LATENT_TILING] + sweep:
            def call(tiling: Any = tiling) -> torch.Tensor:
                return attend_paged_triton(step["q"], step["kv_cache"], step["block_tables"], step["seq_lens"],
                                           step["query_start_loc"], D ** -0.5, 0, tiling=tiling, kv_scale=kv_scale)
            try:
                ms = bc.call_ms(call, args.repeats, args.timing)
                out = call().float()
            except Exception as e:  # a launch shape the compiler rejects (shared memory, registers)
                rows_out.append({"tiling": repr(tiling), "error": str(e)[:120]})
                continue
            reference = out if reference is None else reference
            err = ((out - reference).abs().max() / reference.abs().max().clamp_min(1e-30)).item()
            label = "default" if tiling is None else ("general kernel" if tiling is LATENT_TILING else tiling.__dict__)
            rows_out.append({"tiling": label, "ms": ms, "kv_tb_s": step["kv_bytes"] / ms / 1e9,
                             "tflop_s": step["flops"] / ms / 1e9, "max_rel_err_vs_default": err})
        ok = [r for r in rows_out if "ms" in r]
        best = min(ok, key=lambda r: r["ms"])
        default = next(r for r in ok if r["tiling"] == "default")
        general = next((r for r in ok if r["tiling"] == "general kernel"), None)
        result[name] = {"default": default, "general_kernel": general, "best": best, "all": rows_out}
        print(f"[{name}] default {default['ms']:.4f} ms, general kernel "
              f"{general['ms'] if general else float('nan'):.4f} ms, best {best['ms']:.4f} ms {best['tiling']}",
              flush=True)
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
