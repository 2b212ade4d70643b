"""Decode latency: tokens/s and achieved memory bandwidth at batch 1, 8, 32, 128.

Each batch of B requests gets a `--prompt-len`-token prompt (random ids); after every
request has its first token (the prefill is done), the next `--steps` decode steps are
timed: decode tokens/s = B x steps / seconds, and achieved bandwidth = weight bytes x steps/s
(decode at small batch reads every weight once per step). The bandwidth limit is measured
in the same run (device-to-device copy), so "percent of limit" compares like with like.
The baseline is Hugging Face transformers (eager, sdpa, same architecture and dtype,
random weights) timed the same way: generate(1 token) vs generate(1 + steps tokens).

    python bench/latency.py --out latency.json            # Llama-3-8B shape, dummy weights, bf16
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

import bench_common as bc


def hf_decode_runs(model: torch.nn.Module, batches: list[int], prompt_len: int, steps: int, vocab: int,
                   weight_bytes: int) -> dict[str, dict[str, float]]:
    """`hf_decode` at each batch size, with the weight bandwidth it achieved, printed as it goes."""
    runs = {}
    for b in batches:
        r = hf_decode(model, b, prompt_len, steps, vocab, seed=b)
        r["achieved_bandwidth_tb_s"] = weight_bytes * r["steps_per_s"] / 1e12
        runs[str(b)] = r
        print(f"[hf] batch {b}: {r['tokens_per_s']:.1f} tokens/s", flush=True)
    return runs


def kiln_decode(engine: Any, batch: int, prompt_len: int, steps: int, vocab: int, seed: int) -> dict[str, float]:
    from kiln.runtime.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    ids = [f"lat-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
    produced = dict.fromkeys(ids, 0)
    t_start = time.perf_counter()
    t_decode = None
    decode_steps = 0
    while engine.has_unfinished():
        outs = engine.step()
        for out in outs:
            produced[out.request_id] = len(out.outputs[0].token_ids)
        if t_decode is None:
            if all(n >= 1 for n in produced.values()):
                t_decode = time.perf_counter()  # every prefill is done: decode steps from here
        else:
            decode_steps += 1
    t_end = time.perf_counter()
    if t_decode is None or decode_steps == 0:
        raise RuntimeError(f"batch {batch}: no decode step was timed (prefill never finished?)")
    elapsed = t_end - t_decode
    return {"prefill_s": t_decode - t_start, "decode_s": elapsed, "decode_steps": decode_steps,
            "tokens_per_s": batch * decode_steps / elapsed, "steps_per_s": decode_steps / elapsed}


@torch.inference_mode()
def hf_decode(model: torch.nn.Module, batch: int, prompt_len: int, steps: int, vocab: int, seed: int
              ) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (batch, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)

    def run(n: int) -> float:
        bc.sync(device)
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        bc.sync(device)
        return time.perf_counter() - start

    run(2)  # warm-up
    prefill = run(1)
    full = run(1 + steps)
    elapsed = full - prefill
    return {"prefill_s": prefill, "decode_s": elapsed, "decode_steps": steps,
            "tokens_per_s": batch * steps / elapsed, "steps_per_s": steps / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(parser)
    bc.add_precision_args(parser)
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--compile", default="auto", choices=["auto", "eager", "graph", "inductor"],
                        help="the engine's compile mode (inductor: Inductor artifacts per bucket, compiled into "
                             "--cache-dir first when missing; use --decode-buckets/--token-buckets to bound it)")
    parser.add_argument("--cache-dir", default=None, help="Kiln cache directory for --compile graph/inductor")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step (default: the engine's); with --token-buckets, their largest")
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed per batch size (Kiln)")
    parser.add_argument("--hf-steps", type=int, default=32, help="decode steps timed per batch size (baseline)")
    parser.add_argument("--hf-batch-sizes", default=None, help="baseline batch sizes (default: --batch-sizes)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("latency.py measures GPU decode; no CUDA device is available")
    device = torch.device("cuda")
    dtype = bc.kiln_dtype(args.dtype)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    config = bc.load_config(args.model, args.load_format)
    wbytes = bc.weight_bytes(config, dtype)
    bandwidth = bc.copy_bandwidth(device)
    limit_tok_s = bandwidth / wbytes
    result: dict[str, Any] = {
        "benchmark": "latency", "env": bc.environment(), "model": args.model, "dtype": args.dtype,
        "prompt_len": args.prompt_len, "weight_bytes": wbytes,
        "copy_bandwidth_tb_s": bandwidth / 1e12, "batch1_limit_tokens_per_s": limit_tok_s,
    }

    if not args.no_baseline:  # first: the KV cache Kiln sizes from free memory would crowd it out
        model = bc.hf_model(config, dtype, device)
        hf_batches = [int(x) for x in (args.hf_batch_sizes or args.batch_sizes).split(",")]
        result["baseline"] = {"name": f"transformers eager ({bc.hf_attention(config)})",
                              "runs": hf_decode_runs(model, hf_batches, args.prompt_len, args.hf_steps,
                                                     config.vocab_size, wbytes)}
        del model
        bc.free_cuda()

    from kiln.runtime.llm import LLM

    for key, options in bc.precision_variants(args):  # unquantized first, then --quantization / --kv-cache-dtype
        t0 = time.perf_counter()
        llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device="cuda",
                  max_num_seqs=max(batches), max_model_len=args.prompt_len + args.steps + 16, progress=False,
                  compile=args.compile, cache_dir=args.cache_dir, **bc.bucket_options(args), **options,
                  **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}))
        startup = time.perf_counter() - t0
        engine = llm.engine
        # What a decode step reads of the weights: FP8 projections are one byte per parameter.
        step_bytes = bc.weight_bytes_quantized(config, dtype) if options.get("quantization") else wbytes
        if key == "kiln":
            result["kiln_compile"] = args.compile
            result["kiln_startup_report"] = engine.startup_report.summary()
            result["kiln_startup_s"] = startup
            result["kiln_startup_phases"] = dict(engine.timings)
        else:
            result[key + "_options"] = options
            result[key + "_weight_bytes"] = step_bytes
            result[key + "_batch1_limit_tokens_per_s"] = bandwidth / step_bytes
        kiln_decode(engine, 1, args.prompt_len, 4, config.vocab_size, seed=999)  # warm-up
        result[key] = {}
        for b in batches:
            r = kiln_decode(engine, b, args.prompt_len, args.steps, config.vocab_size, seed=b)
            r["achieved_bandwidth_tb_s"] = step_bytes * r["steps_per_s"] / 1e12
            r["percent_of_limit"] = 100 * r["achieved_bandwidth_tb_s"] * 1e12 / bandwidth
            result[key][str(b)] = r
            print(f"[{key}] batch {b}: {r['tokens_per_s']:.1f} tokens/s ({r['percent_of_limit']:.0f}% of limit)",
                  flush=True)
        del llm, engine
        bc.free_cuda()
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
