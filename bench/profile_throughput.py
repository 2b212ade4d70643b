"""Where the offline-throughput run's time goes, step by step.

Runs the workload of `throughput.py` (same seeded requests, same engine settings) through
`LLMEngine.step()` and times every model step on the device with CUDA events recorded
around `ModelRunner.execute` (no synchronisation is added, so async scheduling and the
overlap it buys are unchanged). Steps are grouped by kind:
  decode-graph - a decode-only step replayed from a captured CUDA graph;
  decode       - a decode-only step of more sequences than the largest decode graph, run
                 through the FX graph (padded to a token bucket);
  mixed        - decodes and prefill chunks in one step, run through the FX graph;
  prefill      - prefill chunks only;
  mixed-graph, prefill-graph - the same, replayed from a mixed-step CUDA graph
                 (`--cuda-graph-mixed-tokens`).
Per kind: steps, tokens, device milliseconds (from one step's start event to the next
one's, so device idle time waiting for the host counts too) and the forward's own share.
Host side, per `engine.step()` call (grouped by the kind of the first step it launches):
seconds in scheduling, building step inputs, `ModelRunner.execute` (launching the graph or
replaying it), the sampler's launch, reading the draw back (waiting for the device) and the
rest of processing the step's tokens, so that the host time a mixed step waits through
(J2: ~40 ms) can be split. Then `--profile-steps` steps from the steady state (after
`--profile-after` mixed steps) run under torch.profiler and their kernels are summed by family (GEMM, attention,
norm/RoPE/activation, other); decode steps replayed from a CUDA graph show no kernels there.
In that window the device's idle time between kernels is grouped by what the host was doing
when each gap began and ended (`device_gaps`), and the calls that waited for the device are
listed by call site (`torch.cuda.set_sync_debug_mode`). Over the whole run the caching
allocator's retries and device allocations are counted (a retry waits for the device).

    python bench/profile_throughput.py --num-requests 1000 --out profile-throughput.json
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

import bench_common as bc
from throughput import workload

KERNEL_FAMILIES = (  # first match wins; names as the profiler reports them
    ("attention", ("paged_attention", "attn", "flash")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90", "splitk", "splitK", "cublas")),
    ("norm/rope/act", ("rms", "rope", "silu")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    for family, keys in KERNEL_FAMILIES:
        if any(k.lower() in low for k in keys):
            return family
    return "other"


def is_device_work(ev: Any) -> bool:
    """A kernel, copy or memset on the device: not the device-side span the profiler draws for
    a host range (the `kiln:` phases here), which covers the kernels launched inside it."""
    return (ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0
            and not getattr(ev, "is_user_annotation", False) and not ev.name.startswith("kiln:"))


def _phase_at(ranges: list[tuple[float, float, str]], t: float) -> str:
    """The innermost range of `ranges` (start-sorted) that holds time `t`."""
    inside = [name for start, end, name in ranges if start <= t <= end]
    return inside[-1] if inside else "-"


def device_gaps(prof: Any, steps: int) -> dict[str, Any]:
    """Device idle time between kernels in the profiled window, grouped by what the host was
    doing when each gap began and when it ended: the `kiln:` host phase (engine.step, and the
    scheduling, step inputs, execute, sampler and read-back inside it) and the innermost op."""
    cpu = torch.autograd.DeviceType.CPU
    events = prof.events()
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in events if is_device_work(ev))
    host = sorted((ev.time_range.start, ev.time_range.end, ev.name[:60]) for ev in events if ev.device_type == cpu)
    # The wrappers' phases are `kiln:<name>`; custom ops (`kiln::linear`) are ops.
    is_phase = [r[2].startswith("kiln:") and not r[2].startswith("kiln::") for r in host]
    phases = [r for r, phase in zip(host, is_phase) if phase]
    ops = [r for r, phase in zip(host, is_phase) if not phase]
    if not spans:
        return {}
    groups: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    busy_until, total = spans[0][1], 0.0
    for start, end in spans[1:]:
        if start > busy_until + 2.0:  # µs; launch-to-launch jitter below this is not idle time
            gap = start - busy_until
            key = (_phase_at(phases, busy_until), _phase_at(phases, start), _phase_at(ops, start))
            groups[key][0] += gap
            groups[key][1] += 1
            total += gap
        busy_until = max(busy_until, end)
    rows = [{"host_at_start": k[0], "host_at_end": k[1], "op_at_end": k[2], "ms_per_step": v[0] / steps / 1e3,
             "gaps_per_step": v[1] / steps} for k, v in groups.items()]
    # Where `execute` spends its host time: CUDA API calls (a launch that waits for room in the
    # device's queue shows here as a long cudaLaunchKernel / cuLaunchKernel).
    executes = [(a, b) for a, b, name in phases if name == "kiln:execute"]
    api: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    for ev in events:
        if ev.device_type == cpu and ev.name.startswith("cu"):
            a, b = ev.time_range.start, ev.time_range.end
            if any(x <= a and b <= y for x, y in executes):
                row = api[ev.name]
                row[0] += b - a
                row[1] += 1
                row[2] = max(row[2], b - a)
    return {"span_ms_per_step": (busy_until - spans[0][0]) / steps / 1e3, "idle_ms_per_step": total / steps / 1e3,
            "largest": sorted(rows, key=lambda r: -r["ms_per_step"])[:15],
            "execute_host_ms_per_step": sum(b - a for a, b in executes) / steps / 1e3,
            "execute_cuda_api": sorted(({"call": k, "ms_per_step": v[0] / steps / 1e3, "calls_per_step": v[1] / steps,
                                         "longest_ms": v[2] / 1e3} for k, v in api.items()),
                                       key=lambda r: -r["ms_per_step"])[:10]}


def synchronizing_calls(caught: list[warnings.WarningMessage]) -> list[dict[str, Any]]:
    """The calls `torch.cuda.set_sync_debug_mode("warn")` reported, by call site."""
    sites: dict[str, int] = defaultdict(int)
    for w in caught:
        sites[f"{Path(w.filename).name}:{w.lineno}: {str(w.message)[:80]}"] += 1
    return [{"site": k, "calls": n} for k, n in sorted(sites.items(), key=lambda kv: -kv[1])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bc.add_common_args(parser)
    bc.add_precision_args(parser)  # here: profile the engine with these options (one engine)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=256)
    # vLLM's defaults for its offline LLM class on GPUs of >= 70 GiB (H100, H200).
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--profile-steps", type=int, default=6, help="steps to run under the profiler")
    parser.add_argument("--profile-after", type=int, default=10,
                        help="start profiling after this many mixed steps (the steady state)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("profile_throughput.py profiles the GPU; no CUDA device is available")
    from torch.profiler import ProfilerActivity, profile, record_function

    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    config = bc.load_config(args.model, args.load_format)
    prompts = workload(args.num_requests, config.vocab_size, args.seed)
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, device="cuda",
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=1024 + args.output_len + 16, progress=False, **bc.bucket_options(args), **bc.quantized_options(args))
    engine = llm.engine
    runner = engine.runner
    llm.generate(prompts[:8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up

    steps: list[dict[str, Any]] = []
    execute = runner.execute

    def timed_execute(inputs: Any, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        t, b, s = inputs.input_ids.shape[1], inputs.seq_lens.shape[0], inputs.logits_indices.shape[0]
        qsl = inputs.query_start_loc.tolist()  # CPU tensors here: no device sync
        chunk = [qsl[i + 1] - qsl[i] for i in range(b)]
        decodes, real = sum(1 for n in chunk if n == 1), sum(1 for n in chunk if n > 0)
        bucket = runner._graph_bucket(t, b, s)  # the captured graph the step replays, if any
        kind = "decode-graph" if bucket is not None and bucket.kind == "decode" else (
            "decode" if decodes == real else "prefill" if decodes == 0 else "mixed")
        if kind in ("mixed", "prefill") and bucket is not None:
            kind += "-graph"  # replayed from a mixed-step CUDA graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = execute(inputs, input_ids)
        end.record()
        steps.append({"kind": kind, "tokens": t, "seqs": b, "decodes": decodes, "start": start, "end": end})
        return out

    runner.execute = timed_execute

    # Host phases: wrap what engine.step() calls (wall seconds; the draw's read-back includes
    # the wait for the device).
    import kiln.runtime.engine as engine_module

    host: dict[str, float] = defaultdict(float)

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                with record_function(f"kiln:{name}"):  # a host phase, for `device_gaps`
                    return fn(*a, **k)
            finally:
                host[name] += time.perf_counter() - t
        return wrapper

    engine.scheduler.schedule = timed("schedule", engine.scheduler.schedule)
    engine.scheduler.schedule_continuation = timed("schedule", engine.scheduler.schedule_continuation)
    engine_module.prepare_step_inputs = timed("prepare_inputs", engine_module.prepare_step_inputs)
    runner.execute = timed("execute", runner.execute)
    engine.sampler.launch = timed("sampler_launch", engine.sampler.launch)
    engine.sampler.collect = timed("read_back", engine.sampler.collect)
    host_by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    engine_step = engine.step

    def timed_step() -> Any:
        host.clear()
        first = len(steps)
        t = time.perf_counter()
        with record_function("kiln:step"):
            out = engine_step()
        total = time.perf_counter() - t
        row = host_by_kind[steps[first]["kind"] if len(steps) > first else "none"]
        row["calls"] += 1
        row["step"] += total
        for name, sec in host.items():
            row[name] += sec
        row["other"] += total - sum(host.values())
        return out

    engine.step = timed_step
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params, every_step=False)
    profiled: dict[str, Any] = {}
    torch.cuda.synchronize()
    memory_before = torch.cuda.memory_stats()
    t0 = time.perf_counter()
    prof_ctx = None
    mixed_seen = 0
    while engine.has_unfinished():
        engine.step()
        if steps and steps[-1]["kind"] in ("mixed", "mixed-graph"):
            mixed_seen += 1
        if prof_ctx is None and not profiled and mixed_seen == args.profile_after:
            prof_ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof_ctx.__enter__()
            prof_first = len(steps)
            syncs = warnings.catch_warnings(record=True)
            caught = syncs.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")  # ops that wait for the device, by call site
        elif prof_ctx is not None and len(steps) - prof_first >= args.profile_steps:
            torch.cuda.set_sync_debug_mode("default")
            syncs.__exit__(None, None, None)
            torch.cuda.synchronize()
            prof_ctx.__exit__(None, None, None)
            window = steps[prof_first:]
            families: dict[str, float] = defaultdict(float)
            top: dict[str, float] = defaultdict(float)
            for ev in prof_ctx.events():
                if is_device_work(ev):
                    families[kernel_family(ev.name)] += ev.device_time / 1e3
                    top[ev.name[:80]] += ev.device_time / 1e3
            profiled = {"steps": [{k: s[k] for k in ("kind", "tokens", "seqs", "decodes")} for s in window],
                        "kernel_ms_by_family": dict(families),
                        "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:25]),
                        "device_gaps": device_gaps(prof_ctx, args.profile_steps),
                        "synchronizing_calls": synchronizing_calls(caught)}
            prof_ctx = None
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    memory_after = torch.cuda.memory_stats()

    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    forwards: dict[str, list[float]] = defaultdict(list)
    for i, s in enumerate(steps):
        nxt = steps[i + 1]["start"] if i + 1 < len(steps) else s["end"]
        row = by_kind[s["kind"]]
        row["steps"] += 1
        row["tokens"] += s["tokens"]
        row["decode_tokens"] += s["decodes"]
        row["device_ms"] += s["start"].elapsed_time(nxt)
        forwards[s["kind"]].append(s["start"].elapsed_time(s["end"]))
    for kind, row in by_kind.items():
        ms = sorted(forwards[kind])
        row["forward_ms"] = sum(ms)
        row["forward_ms_median"] = ms[len(ms) // 2]
        row["forward_ms_max"] = ms[-1]
        row["forward_ms_top5"] = sum(ms[-5:])  # one-off costs (Triton compiles) show here
        row["ms_per_step"] = row["device_ms"] / row["steps"]
        row["tokens_per_step"] = row["tokens"] / row["steps"]
    result = {
        "benchmark": "profile_throughput", "env": bc.environment(), "model": args.model, "dtype": args.dtype,
        "workload": {"requests": args.num_requests, "output_len": args.output_len,
                     "prompt_tokens": sum(map(len, prompts))},
        "engine": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "num_kv_blocks": engine.num_kv_blocks,
                   "preemptions": engine.scheduler.stats.num_preemptions},
        "wall_s": wall, "output_tokens_per_s": args.num_requests * args.output_len / wall,
        "steps_by_kind": {k: dict(v) for k, v in by_kind.items()},
        "host_ms_per_call_by_kind": {k: {(f"{n}_ms" if n != "calls" else n): (v / row["calls"] * 1e3 if n != "calls"
                                                                             else v) for n, v in row.items()}
                                     for k, row in host_by_kind.items()},
        "profiled_window": profiled,
        # Allocator events over the run: a retry frees cached blocks and waits for the device.
        "allocator": {k: memory_after.get(k, 0) - memory_before.get(k, 0)
                      for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")},
    }
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
