"""Tensor parallelism: decode tokens/s at batch 1/8/64 and offline throughput, for each
tensor-parallel size, against the weight-bandwidth limit measured in the same run and the
Hugging Face baseline on one device.

For each TP size in `--tensor-parallel-sizes` (default "1,2"), one engine (`LLM(...,
tensor_parallel_size=N)`, one worker per GPU, NCCL) runs:
- decode: B sequences of `--prompt-len` random tokens, `--steps` decode steps timed once
  every prefill is done (as bench/latency.py); tokens/s and achieved bandwidth = weight bytes
  x steps/s, summed over the ranks (each GPU reads its 1/N of the weights per step); and
  per rank, the milliseconds per step spent handling the step (inputs in, replay, logits
  out) and waiting for the engine's next one (`worker_step_stats`);
- offline: `--num-requests` requests, prompts uniform in [`--min-prompt`, `--max-prompt`],
  `--output-len` tokens each with ignore_eos, all at once (as bench/throughput.py).
The limit is N x (one GPU's copy bandwidth) / weight bytes: decode at small batch reads every
weight once per step, split N ways. Per-rank peak host and device memory come from the workers.
The baseline (transformers eager, one device) runs only where the weights fit one device
(the Llama-3-70B shape does not fit one H200: its baseline is skipped, with the reason).

    python bench/tp.py --model bench/llama3_70b.json --tensor-parallel-sizes 2 --out tp70b.json   # 2 GPUs
    python bench/tp.py --model bench/llama3_8b.json --tensor-parallel-sizes 1,2 --out tp8b.json
    python bench/tp.py --device cpu --model bench/tiny_llama.json --dtype float32 --batch-sizes 1,8 \\
        --steps 16 --num-requests 16 --output-len 16 --min-prompt 16 --max-prompt 64   # CPU, gloo
    python bench/tp.py --model bench/llama3_70b.json --tensor-parallel-sizes 2 --quantization fp8 \\
        --kv-cache-dtype fp8 --out tp70b-fp8.json   # 2 GPUs, 70 GB of e4m3 weights
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

import bench_common as bc
from latency import hf_decode_runs, kiln_decode
from throughput import kiln_throughput, workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(parser)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (NCCL, one GPU per rank) or cpu (gloo, one process per rank)")
    parser.add_argument("--tensor-parallel-sizes", default="1,2")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed per batch size")
    parser.add_argument("--hf-steps", type=int, default=32, help="decode steps timed per batch size (baseline)")
    parser.add_argument("--num-requests", type=int, default=1000, help="offline workload (0: skip it)")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=128)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--bandwidth-gib", type=float, default=4.0, help="size of the copy that measures bandwidth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="FP8 projections (each rank quantizes its slices as they load), the one engine per size")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="an e4m3 KV cache (each rank calibrates its heads' scales)")
    parser.add_argument("--one-shot-too", action="store_true",
                        help="for each TP size > 1, also decode with the one-shot all-reduce for messages up to "
                             "4 MiB ($KILN_ONE_SHOT_ALL_REDUCE_MAX_BYTES=4194304; NCCL alone by default), "
                             "as run '<N>-one-shot'")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = [int(x) for x in args.tensor_parallel_sizes.split(",")]
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("no CUDA device is available (use --device cpu for the gloo run)")
        if max(sizes) > torch.cuda.device_count():
            parser.error(f"--tensor-parallel-sizes {args.tensor_parallel_sizes} needs {max(sizes)} GPUs; "
                         f"{torch.cuda.device_count()} are visible")
    dtype = bc.kiln_dtype(args.dtype)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    config = bc.load_config(args.model, args.load_format)
    # What a decode step reads: the projections at one byte a parameter under FP8.
    wbytes = (bc.weight_bytes_quantized if args.quantization else bc.weight_bytes)(config, dtype)
    bandwidth = bc.copy_bandwidth(device, gib=args.bandwidth_gib)
    result: dict[str, Any] = {
        "benchmark": "tensor_parallel", "env": bc.environment(), "model": args.model, "dtype": args.dtype,
        "device": device.type, "prompt_len": args.prompt_len, "weight_bytes": wbytes,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype,
        "copy_bandwidth_tb_s_per_device": bandwidth / 1e12,
        "batch1_limit_tokens_per_s": {str(n): n * bandwidth / wbytes for n in sizes},
    }

    if not args.no_baseline:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        if free is not None and wbytes > 0.9 * free:
            result["baseline"] = {"skipped": f"the weights ({wbytes / 2**30:.0f} GiB) do not fit one GPU "
                                             f"({free / 2**30:.0f} GiB free)"}
        else:
            model = bc.hf_model(config, dtype, device)
            result["baseline"] = {"name": "transformers eager (sdpa), one device",
                                  "runs": hf_decode_runs(model, batches, args.prompt_len, args.hf_steps,
                                                         config.vocab_size, wbytes)}
            del model
            bc.free_cuda()

    from kiln.runtime.llm import LLM

    prompts = workload(args.num_requests, config.vocab_size, args.seed, args.min_prompt, args.max_prompt)
    result["workload"] = {"requests": args.num_requests, "prompt_len": [args.min_prompt, args.max_prompt],
                          "output_len": args.output_len, "ignore_eos": True, "seed": args.seed}
    result["kiln"] = {}

    def save_partial() -> None:
        """What is done so far, in --out: it survives a run cut at its time limit."""
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2, default=str)

    runs = [(str(n), n, None) for n in sizes]
    if args.one_shot_too:
        runs += [(f"{n}-one-shot", n, str(4 * 2**20)) for n in sizes if n > 1]
    for label, n, one_shot_max in runs:
        if one_shot_max is not None:  # the workers inherit this process's environment
            os.environ["KILN_ONE_SHOT_ALL_REDUCE_MAX_BYTES"] = one_shot_max
        t0 = time.perf_counter()
        llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
                  tensor_parallel_size=n, max_num_seqs=max(args.max_num_seqs, max(batches)),
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=max(args.max_prompt, args.prompt_len) + max(args.output_len, args.steps) + 16,
                  progress=False, **bc.bucket_options(args),
                  **({"quantization": args.quantization} if args.quantization else {}),
                  **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {}))
        engine = llm.engine
        run: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "num_kv_blocks": engine.num_kv_blocks,
                               "startup_phases": dict(engine.timings)}
        if engine.executor is not None:
            run["ranks"] = [{"rank": r["rank"], "device": r["device"], "kv_blocks_fit": r["num_blocks"],
                             "after_weights": r["memory"], "with_kv_cache": r.get("memory_with_kv_cache"),
                             "one_shot_all_reduce_max_bytes": r.get("one_shot_all_reduce_max_bytes"),
                             "timings": r.get("timings")}
                            for r in engine.executor.reports]
        result["kiln"][label] = run
        try:
            kiln_decode(engine, 1, args.prompt_len, 4, config.vocab_size, seed=999)  # warm-up
            run["decode"] = {}
            stats = getattr(engine.executor, "step_stats", None)  # the mp backend's per-rank step times
            for b in batches:
                if stats is not None:
                    stats()  # reset
                r = kiln_decode(engine, b, args.prompt_len, args.steps, config.vocab_size, seed=b)
                if stats is not None:  # the prefill steps of the run included
                    r["worker_step_stats"] = stats()
                r["achieved_bandwidth_tb_s"] = wbytes * r["steps_per_s"] / 1e12
                r["percent_of_limit"] = 100 * wbytes * r["steps_per_s"] / (n * bandwidth)
                run["decode"][str(b)] = r
                print(f"[kiln tp={label}] batch {b}: {r['tokens_per_s']:.1f} tokens/s "
                      f"({r['percent_of_limit']:.0f}% of the {n}-device limit)", flush=True)
            save_partial()
            if args.num_requests and one_shot_max is None:
                run["offline"] = kiln_throughput(llm, prompts, args.output_len)
                print(f"[kiln tp={label}] offline: {run['offline']['output_tokens_per_s']:.0f} output tokens/s",
                      flush=True)
        finally:
            engine.shutdown()
            del llm, engine
            bc.free_cuda()
            os.environ.pop("KILN_ONE_SHOT_ALL_REDUCE_MAX_BYTES", None)
        save_partial()
    base = result.get("baseline", {}).get("runs")
    if base:
        result["speedup_vs_baseline"] = {
            n: {b: r["tokens_per_s"] / base[b]["tokens_per_s"] for b, r in run["decode"].items() if b in base}
            for n, run in result["kiln"].items()}
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
