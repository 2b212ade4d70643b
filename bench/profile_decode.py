"""Where a decode step's time goes: end-to-end step vs CUDA-graph replay vs kernels.

For each batch size B (after a `--prompt-len`-token prefill, random ids):
  step_ms      - one `engine.step()` (schedule, inputs to the GPU, replay, sample, outputs),
                 with the engine's async scheduling as configured;
  replay_ms    - the captured decode graph alone, replayed back to back (GPU time per step);
  host_gap_ms  - step_ms - replay_ms: what the host adds between replays;
  kernels      - the kernels of one decode step from the profiler (eager run of the same
                 post-pass graph, since a graph replay hides its kernels on some builds):
                 total and per-launch microseconds by kernel name, and the launch count;
  replay_gaps  - the captured graph's replay under the profiler: kernel time, the idle time
                 between consecutive kernels (what replay_ms holds beyond the kernels) and
                 the kernels after which the GPU idled longest; replay_kernels is the
                 replay's own kernel table (both empty where the build's profiler does not
                 see a replay's kernels). Each kernel row has its recorded durations and
                 its exclusive time (what no kernel before it overlapped: with programmatic
                 dependent launch the recorded durations include each kernel's wait);
  gemv         - cuBLAS at this batch for each weight shape alone: microseconds and TB/s.
Also the device-to-device copy bandwidth of the run, the ceiling for all of the above.

    python bench/profile_decode.py --batch-sizes 1,8 --out profile.json
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from typing import Any

import torch

import bench_common as bc


def _start_decode(engine: Any, batch: int, prompt_len: int, vocab: int, max_tokens: int) -> list[str]:
    from kiln.runtime.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"prof-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_prompt_tokens
                                          for s in engine.scheduler.running):
        engine.step()
    return ids


def _time_cuda(fn: Any, n: int) -> float:
    """Milliseconds per call of `fn`, timed with CUDA events over `n` back-to-back calls."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _device_spans(prof: Any) -> list[tuple[float, float, str]]:
    """(start, end, name) of each device kernel, in start order."""
    return sorted((ev.time_range.start, ev.time_range.end, ev.name[:90]) for ev in prof.events()
                  if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0)


def _kernel_table(prof: Any, steps: int) -> list[dict[str, Any]]:
    """Per kernel name: the recorded durations (`us_per_step`), and `exclusive_us_per_step`,
    the part of each that no kernel before it overlapped: from the later of its start and
    the end of everything before it, to its end. With programmatic dependent launch a
    kernel is recorded from the launch of its programs, which then wait for the kernel
    before: its recorded duration holds that wait (R1: 6.2 ms of durations in a 3.4 ms
    step), the exclusive time does not. Rows by exclusive time."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    busy_until = float("-inf")
    for start, end, name in _device_spans(prof):
        row = totals[name]
        row[0] += end - start
        row[1] += 1
        row[2] += max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    rows = [{"kernel": k, "us_per_step": v[0] / steps, "launches_per_step": v[1] / steps,
             "us_per_launch": v[0] / v[1], "exclusive_us_per_step": v[2] / steps} for k, v in totals.items()]
    return sorted(rows, key=lambda r: -r["exclusive_us_per_step"])


def _gap_table(prof: Any, steps: int) -> dict[str, Any]:
    """Idle time between consecutive device kernels (start-ordered), per step, by the kernel
    that ran before the gap."""
    spans = _device_spans(prof)
    if not spans:
        return {}
    gaps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    busy_until = spans[0][1]
    for (start, end, name), prev_name in zip(spans[1:], [s[2] for s in spans]):
        if start > busy_until:
            gaps[prev_name][0] += start - busy_until
            gaps[prev_name][1] += 1
        busy_until = max(busy_until, end)
    total = sum(v[0] for v in gaps.values())
    rows = [{"after_kernel": k, "gap_us_per_step": v[0] / steps, "gaps_per_step": v[1] / steps,
             "us_per_gap": v[0] / v[1]} for k, v in gaps.items()]
    return {"span_us_per_step": (busy_until - spans[0][0]) / steps,
            "kernel_us_per_step": sum(e - s for s, e, _ in spans) / steps,
            "gap_us_per_step": total / steps,
            "largest_gaps": sorted(rows, key=lambda r: -r["gap_us_per_step"])[:15]}


@torch.inference_mode()
def profile_batch(engine: Any, batch: int, prompt_len: int, vocab: int, steps: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from kiln.runtime.model_runner import pad_step_inputs, prepare_step_inputs
    from kiln.compiler.buckets import decode_bucket

    _start_decode(engine, batch, prompt_len, vocab, max_tokens=4 * steps + 64)
    out: dict[str, Any] = {}
    # 1. end-to-end engine steps
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    out["step_ms"] = (time.perf_counter() - t0) * 1e3 / steps

    # 2. the graph alone, and 3. the host's share of a step, pieces timed on the host.
    # Scheduling by hand below needs no step in flight: read the async one back first.
    async_scheduling = engine.config.async_scheduling
    engine.config.async_scheduling = False
    engine.step()
    runner = engine.runner
    sched = engine.scheduler.schedule()
    inputs = prepare_step_inputs(sched, engine.block_manager, engine.device)
    graphs = getattr(runner, "_graphs", None)
    if graphs is not None:
        bucket = runner._graph_bucket(batch, batch, batch)  # the decode graph this batch replays
        padded = pad_step_inputs(inputs, bucket).as_dict()
        captured = graphs.buckets[bucket]
        graphs.replay(bucket, padded)
        out["replay_ms"] = _time_cuda(captured.graph.replay, steps)
        out["replay_with_input_copies_ms"] = _time_cuda(lambda: graphs.replay(bucket, padded), steps)
        out["host_gap_ms"] = out["step_ms"] - out["replay_ms"]
        out["graph_bucket"] = bucket.num_seqs
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as replay_prof:
            for _ in range(5):
                captured.graph.replay()
            torch.cuda.synchronize()
        out["replay_gaps"] = _gap_table(replay_prof, 5)
        out["replay_kernels"] = _kernel_table(replay_prof, 5)[:30]
    t0 = time.perf_counter()
    for _ in range(steps):
        prepare_step_inputs(sched, engine.block_manager, engine.device)
    torch.cuda.synchronize()
    out["prepare_inputs_ms"] = (time.perf_counter() - t0) * 1e3 / steps
    logits = runner.execute(inputs)
    seqs = [item.seq for item in sched.scheduled]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.sampler.sample(logits, seqs)
    out["sample_ms"] = (time.perf_counter() - t0) * 1e3 / steps

    # 4. kernels of the eager graph (the same kernels the graph replays)
    fn = runner._step_fn(decode_bucket(batch))
    batch_inputs = inputs.as_dict()
    fn(**batch_inputs)
    torch.cuda.synchronize()
    prof_steps = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_steps):
            fn(**batch_inputs)
        torch.cuda.synchronize()
    table = _kernel_table(prof, prof_steps)
    out["kernel_us_per_step"] = sum(r["us_per_step"] for r in table)
    out["kernel_launches_per_step"] = sum(r["launches_per_step"] for r in table)
    out["kernels"] = table[:30]
    out["eager_forward_ms"] = _time_cuda(lambda: fn(**batch_inputs), 10)
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.config.async_scheduling = async_scheduling
    return out


def gemv_table(config: Any, dtype: torch.dtype, batch: int, bandwidth: float) -> list[dict[str, Any]]:
    """cuBLAS for each (merged) weight shape of one layer, and the LM head, at `batch` rows."""
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    hd = getattr(config, "head_dim", None) or h // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * hd
    shapes = {"qkv": (qkv, h), "o": (h, config.num_attention_heads * hd), "gate_up": (2 * inter, h),
              "down": (h, inter), "lm_head": (vocab, h)}
    rows = []
    for name, (n, k) in shapes.items():
        # Several copies rotated, so that the weight never sits in the 50 MB L2 between calls.
        copies = max(2, int(400e6 // (n * k * 2)) + 1)
        ws = [torch.randn(n, k, device="cuda", dtype=dtype) for _ in range(copies)]
        x = torch.randn(batch, k, device="cuda", dtype=dtype)
        i = [0]

        def run() -> None:
            torch.nn.functional.linear(x, ws[i[0] % copies])
            i[0] += 1

        ms = _time_cuda(run, 200)
        tb_s = n * k * 2 / (ms * 1e-3) / 1e12
        rows.append({"weight": name, "shape": [n, k], "us": ms * 1e3, "tb_s": tb_s,
                     "percent_of_copy_bw": 100 * tb_s * 1e12 / bandwidth})
        del ws
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(parser)
    bc.add_precision_args(parser)  # here: profile the engine with these options (one engine)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compile", default="auto", choices=["auto", "eager", "graph", "inductor"],
                        help="the engine's compile mode; with inductor the kernels listed are the artifacts' "
                             "(bound the plan with --decode-buckets/--token-buckets)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per step (default: the engine's); with --token-buckets, their largest")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("profile_decode.py profiles GPU decode; no CUDA device is available")
    dtype = bc.kiln_dtype(args.dtype)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    config = bc.load_config(args.model, args.load_format)
    bandwidth = bc.copy_bandwidth(torch.device("cuda"))
    result: dict[str, Any] = {"benchmark": "profile_decode", "env": bc.environment(), "model": args.model,
                              "copy_bandwidth_tb_s": bandwidth / 1e12,
                              "weight_bytes": (bc.weight_bytes_quantized(config, dtype) if args.quantization
                                               else bc.weight_bytes(config, dtype)),
                              "options": bc.quantized_options(args)}
    result["gemv"] = {str(b): gemv_table(config, dtype, b, bandwidth) for b in batches}

    from kiln.runtime.llm import LLM

    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device="cuda",
              max_num_seqs=max(batches), max_model_len=args.prompt_len + 4 * args.steps + 128, progress=False,
              compile=args.compile, cache_dir=args.cache_dir, **bc.bucket_options(args), **bc.quantized_options(args),
              **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}))
    result["compile"] = llm.engine.startup_report.summary()
    result["startup_phases"] = dict(llm.engine.timings)
    result["batches"] = {}
    for b in batches:
        r = profile_batch(llm.engine, b, args.prompt_len, config.vocab_size, args.steps)
        result["batches"][str(b)] = r
        print(f"[profile] batch {b}: step {r['step_ms']:.3f} ms, replay {r.get('replay_ms', float('nan')):.3f} ms, "
              f"kernels {r['kernel_us_per_step'] / 1e3:.3f} ms in {r['kernel_launches_per_step']:.0f} launches", flush=True)
        gaps = r.get("replay_gaps") or {}
        if gaps:
            print(f"[replay] batch {b}: span {gaps['span_us_per_step'] / 1e3:.3f} ms, kernels "
                  f"{gaps['kernel_us_per_step'] / 1e3:.3f} ms, idle between kernels {gaps['gap_us_per_step'] / 1e3:.3f} ms",
                  flush=True)
            for row in gaps["largest_gaps"][:8]:
                print(f"    idle {row['gap_us_per_step']:8.1f} us/step ({row['gaps_per_step']:.0f} x "
                      f"{row['us_per_gap']:.1f}) after {row['after_kernel']}", flush=True)
        # The replay's own kernels where the profiler sees them (the eager run's otherwise);
        # exclusive time first: under PDL the recorded durations overlap.
        for row in (r.get("replay_kernels") or r["kernels"])[:15]:
            print(f"    {row['exclusive_us_per_step']:8.1f} us exclusive ({row['us_per_step']:8.1f} recorded)  "
                  f"x{row['launches_per_step']:5.0f}  {row['kernel']}", flush=True)
    for b, rows in result["gemv"].items():
        print(f"[gemv] batch {b}: " + ", ".join(f"{r['weight']} {r['us']:.1f}us {r['tb_s']:.2f}TB/s" for r in rows))
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
