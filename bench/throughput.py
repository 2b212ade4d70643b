"""Offline throughput: many requests at once, output tokens per second.

Workload (seeded): `--num-requests` requests (1,000 by default), prompt lengths uniform in
[128, 1024] (random token ids), `--output-len` (256) output tokens each with ignore_eos.
Kiln gets every request at once (`LLM.generate`, continuous batching) with up to 1,024
running sequences and 16,384 tokens per step, vLLM's defaults for offline use on GPUs of
70 GiB or more (`--max-num-seqs`, `--max-num-batched-tokens`). The baseline is
Hugging Face transformers eager on the same requests in static batches of 64, left-padded
to the longest prompt of the batch; it runs the first `--hf-requests` requests (a whole
number of batches) and its tokens/s is reported for that subset, which is the same
per-batch work as the full set, so the ratio compares like with like.

    python bench/throughput.py --out throughput.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import bench_common as bc

HF_BATCH = 64


def workload(n: int, vocab: int, seed: int, min_len: int = 128, max_len: int = 1024) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (n_tok,), generator=g).tolist() for n_tok in lengths]


@torch.inference_mode()
def hf_throughput(model: torch.nn.Module, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    device = next(model.parameters()).device
    total_out = 0
    bc.sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), HF_BATCH):
        batch = prompts[i:i + HF_BATCH]
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(batch):  # left padding: generation continues every row's last token
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False)
        total_out += (out.shape[1] - width) * len(batch)
    bc.sync(device)
    elapsed = time.perf_counter() - start
    return {"requests": len(prompts), "output_tokens": total_out, "seconds": elapsed,
            "output_tokens_per_s": total_out / elapsed, "batch_size": HF_BATCH}


def kiln_throughput(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    from kiln.runtime.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    stats = llm.engine.scheduler.stats
    preemptions, continuations = stats.num_preemptions, stats.num_continuation_steps
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    total_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if total_out != len(prompts) * output_len:
        raise RuntimeError(f"expected {len(prompts) * output_len} output tokens (ignore_eos), got {total_out}")
    return {"requests": len(prompts), "output_tokens": total_out, "seconds": elapsed,
            "output_tokens_per_s": total_out / elapsed,
            "total_tokens_per_s": (total_out + sum(map(len, prompts))) / elapsed,
            # The run's preemptions, and its decode steps launched before the previous step's
            # tokens were read (async scheduling's continuations).
            "preemptions": stats.num_preemptions - preemptions,
            "continuation_steps": stats.num_continuation_steps - continuations,
            "num_kv_blocks": llm.engine.num_kv_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(parser)
    bc.add_precision_args(parser)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--hf-requests", type=int, default=128, help="baseline subset (rounded to batches of 64)")
    # vLLM's defaults for its offline LLM class on GPUs of >= 70 GiB (H100, H200).
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", default="auto",
                        help="the engine's compile mode; a comma list (e.g. graph,inductor) runs each in turn in this "
                             "process, the first as 'kiln', the others as 'kiln_<mode>' (inductor compiles its buckets "
                             "into --cache-dir first when missing; bound it with --decode-buckets/--token-buckets)")
    parser.add_argument("--cache-dir", default=None, help="Kiln cache directory for --compile graph/inductor")
    args = parser.parse_args()
    modes = [m.strip() for m in args.compile.split(",") if m.strip()]
    bad = sorted(set(modes) - {"auto", "eager", "graph", "inductor"})
    if bad or not modes:
        parser.error(f"--compile: unknown mode(s) {bad or args.compile!r}; choose from auto, eager, graph, inductor")
    if not torch.cuda.is_available():
        parser.error("throughput.py measures GPU throughput; no CUDA device is available")
    device = torch.device("cuda")
    dtype = bc.kiln_dtype(args.dtype)
    config = bc.load_config(args.model, args.load_format)
    prompts = workload(args.num_requests, config.vocab_size, args.seed)
    result: dict[str, Any] = {
        "benchmark": "throughput", "env": bc.environment(), "model": args.model, "dtype": args.dtype,
        "workload": {"requests": args.num_requests, "prompt_len": [128, 1024], "output_len": args.output_len,
                     "ignore_eos": True, "seed": args.seed, "prompt_tokens": sum(map(len, prompts))},
    }
    if not args.no_baseline:
        n_hf = max(HF_BATCH, (min(args.hf_requests, args.num_requests) // HF_BATCH) * HF_BATCH)
        model = bc.hf_model(config, dtype, device)
        model.generate(torch.zeros((2, 8), dtype=torch.long, device=device), max_new_tokens=2)  # warm-up
        result["baseline"] = {"name": "transformers eager (sdpa), static batches of 64, left-padded",
                              **hf_throughput(model, prompts[:n_hf], args.output_len)}
        print(f"[hf] {result['baseline']['output_tokens_per_s']:.0f} output tokens/s on {n_hf} requests", flush=True)
        del model
        bc.free_cuda()

    from kiln.runtime.llm import LLM

    variants = [(key if i == 0 else f"{key}_{mode}", mode, options)
                for i, mode in enumerate(modes) for key, options in bc.precision_variants(args)]
    for key, mode, options in variants:  # per mode: unquantized first, then --quantization / --kv-cache-dtype
        t0 = time.perf_counter()
        llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device="cuda",
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=1024 + args.output_len + 16, progress=False, compile=mode, cache_dir=args.cache_dir,
                  **bc.bucket_options(args), **options)
        startup = time.perf_counter() - t0
        kiln_throughput(llm, prompts[:8], 8)  # warm-up
        result[key] = {**kiln_throughput(llm, prompts, args.output_len), "options": options, "compile": mode,
                       "startup_s": startup, "num_kv_blocks": llm.engine.num_kv_blocks}
        print(f"[{key}] {mode} {options or ''} {result[key]['output_tokens_per_s']:.0f} output tokens/s", flush=True)
        if key == "kiln":
            result["kiln_startup_s"] = startup
            result["kiln_config"] = {"max_num_seqs": args.max_num_seqs,
                                     "max_num_batched_tokens": args.max_num_batched_tokens,
                                     "num_kv_blocks": llm.engine.num_kv_blocks}
        del llm
        bc.free_cuda()
    for key, mode, _ in variants[len(bc.precision_variants(args)):]:
        base = key[:-len(f"_{mode}")]
        result[f"{key}_vs_{base}"] = result[key]["output_tokens_per_s"] / result[base]["output_tokens_per_s"]
    if "baseline" in result and "kiln" in result:
        result["speedup_vs_baseline"] = result["kiln"]["output_tokens_per_s"] / result["baseline"]["output_tokens_per_s"]
    if "kiln_quantized" in result and "kiln" in result:
        result["quantized_speedup_vs_kiln"] = (result["kiln_quantized"]["output_tokens_per_s"]
                                               / result["kiln"]["output_tokens_per_s"])
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
