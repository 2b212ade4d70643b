"""The scheduler's admission policy (`kv_reserve_ratio`) on a KV-bound offline run, simulated.

Drives the real `Scheduler` and `BlockManager` through the offline workload of
bench/throughput.py (prompts of 128-1,024 tokens, seed 0) without a model: every step costs
`--base-ms` + `--ms-per-token` x its tokens, plus `--host-ms` when it is scheduled after the
previous step's tokens are read back instead of as a continuation (async scheduling). The
defaults are the Mixtral-8x7B shape's on the H200 (bench/RESULTS.md J1: 18,564 KV blocks of 16
tokens; ~54 ms a 320-sequence decode step, 42.6 of it on the device; ~400 ms a 6k-token mixed
step). With the engine's rule of J1's time (a step in which a sequence ended by length was
read back before the next was scheduled) it reproduced J1's run (223 preemptions against 218
measured, 659 decode steps against 658); with today's (such sequences are left out of the
continuation) it gives 194 at ratio 0. It compares ratios on four workloads: every request running to max_tokens
(ignore_eos, as the benchmarks do) and three whose requests stop early (a stop token at a
random length). CPU only, a few seconds a run:

    python bench/simulate_scheduler.py --ratios 0,0.5,0.7,1

`--cost roofline` prices a step's projections as the slower of reading every weight once and
computing its tokens, and adds its attention's read of the K/V of every token its sequences
attend over (other kernels: attention does not overlap the GEMMs), instead of the linear
model's base + per token: a decode step of a few hundred sequences, bound by reading a MoE
model's experts, then takes prefill tokens up to that read's time for free.
Its defaults are the Mixtral-8x7B offline run's (RESULTS U3 and P2: decode steps of ~330
sequences 40.7 ms, ~93 GB of weights and ~30 GB of K/V at ~3.0 TB/s; mixed steps of ~16k
tokens ~57 us a token). `--budgets` compares step token budgets (`max_num_batched_tokens`):

    python bench/simulate_scheduler.py --cost roofline --ratios 0.5 --workloads to_max_tokens_256 \
        --budgets 1024,2048,4096,16384

It predicted Mixtral +5% at a 1,024 budget (RESULTS AA6); the H200 measured -15.7% (AB4: 69.7 s
against 58.7 at 16,384; 2,048 -4.3%). The model leaves out what that costs: the MoE kernels'
rate between 320 and 2,048 tokens, and a mixed step's host work (steps with prefill replay no
CUDA graph); neither is profiled yet. Treat its budget comparisons as an upper bound.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

from kiln.runtime.block_manager import BlockManager  # noqa: E402
from kiln.runtime.sampling_params import SamplingParams  # noqa: E402
from kiln.runtime.scheduler import Scheduler  # noqa: E402
from kiln.runtime.sequence import Sequence  # noqa: E402

# name: (max_tokens, output lengths drawn uniformly from this range, or None: max_tokens, and
# whether a drawn length is where a stop token ends the request or is the request's own
# max_tokens, EOS ignored: benchmark_serving's way, a known length per request)
WORKLOADS: dict[str, tuple[int, tuple[int, int] | None, bool]] = {
    "to_max_tokens_256": (256, None, False),
    "stop_1_256_of_256": (256, (1, 256), False),
    "stop_64_256_of_512": (512, (64, 256), False),
    "stop_1_512_of_2048": (2048, (1, 512), False),
    "max_tokens_64_448": (448, (64, 448), True),
}


def step_ms(items: list, args: argparse.Namespace) -> float:
    """A step's device time under `args.cost` (see the module docstring)."""
    tokens = sum(item.num_new_tokens for item in items)
    if args.cost == "linear":
        return args.base_ms + args.ms_per_token * tokens
    attended = sum(item.seq.num_computed_tokens + item.num_new_tokens for item in items)
    return max(args.weights_ms, args.compute_ms_per_token * tokens) + args.kv_ms_per_ktoken * attended / 1e3


def simulate(ratio: float, max_tokens: int, out_range: tuple[int, int] | None, args: argparse.Namespace,
             budget: int, drawn_max_tokens: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(args.seed)
    prompt_lens = torch.randint(128, 1025, (args.num_requests,), generator=g).tolist()
    out_lens = (torch.randint(out_range[0], out_range[1] + 1, (args.num_requests,), generator=g).tolist()
                if out_range else [max_tokens] * args.num_requests)
    # A stop token makes a request one that may end early (its reservation is learned).
    stops = out_range is not None and not drawn_max_tokens
    params = [SamplingParams(max_tokens=n if drawn_max_tokens else max_tokens, ignore_eos=True,
                             stop_token_ids=[7] if stops else []) for n in out_lens]
    sched = Scheduler(BlockManager(args.num_kv_blocks, args.block_size, enable_prefix_caching=False),
                      args.max_num_seqs, budget, reserve_ratio=ratio)
    wanted: dict[int, int] = {}
    for i, n in enumerate(prompt_lens):
        sched.add(Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=[3] * n, params=params[i]))
        wanted[i] = out_lens[i]
    ms, tokens, outputs, synchronous = 0.0, 0, 0, 0
    by_length: list[Sequence] = []  # the last step's sequences that ended by length
    by_stop: list[Sequence] = []  # ... and by a stop token
    while sched.has_unfinished():
        # As the engine does: the next step is a continuation, launched before the last one's
        # tokens are read back, leaving out sequences whose token in flight is their last.
        # (Sequences stopping on a token are simplified: read back first. The engine runs
        # them one step more and discards that token.)
        items = sched.schedule_continuation(set(by_length)) if sched.running and not by_stop else None
        for seq in by_length + by_stop:
            sched.finish(seq, "length" if seq in by_length else "stop")
        if items is None and not sched.has_unfinished():
            break
        if items is None:
            items = sched.schedule().scheduled
            ms += args.host_ms
            synchronous += 1
        tokens += sum(item.num_new_tokens for item in items)
        ms += step_ms(items, args)
        if any(item.num_new_tokens > 1 for item in items):  # a prefill chunk: no CUDA graph
            ms += args.mixed_host_ms
        by_length, by_stop = [], []
        for item in items:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.samples:
                item.seq.append_token(5)
                outputs += 1
                if item.seq.num_output_tokens >= item.seq.params.max_tokens:
                    by_length.append(item.seq)
                elif item.seq.num_output_tokens >= wanted[item.seq.seq_id]:
                    by_stop.append(item.seq)
    return {"seconds": ms / 1e3, "output_tokens_per_s": outputs / ms * 1e3, "computed_tokens": tokens,
            "preemptions": sched.stats.num_preemptions, "steps": sched.stats.num_steps,
            "synchronous_steps": synchronous, "used_fraction": sched.used_fraction}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ratios", default="0,0.5,0.7,1", help="kv_reserve_ratio values (comma list)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--num-kv-blocks", type=int, default=18564)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--budgets", default="16384", help="max_num_batched_tokens values (comma list)")
    parser.add_argument("--cost", choices=("linear", "roofline"), default="linear", help="the step cost model")
    parser.add_argument("--base-ms", type=float, default=40.0, help="linear: a step's cost without tokens")
    parser.add_argument("--ms-per-token", type=float, default=0.049, help="linear: each token's")
    parser.add_argument("--weights-ms", type=float, default=30.8, help="roofline: reading the weights once")
    parser.add_argument("--kv-ms-per-ktoken", type=float, default=0.0434,
                        help="roofline: reading 1,000 tokens' K/V (all layers)")
    parser.add_argument("--compute-ms-per-token", type=float, default=0.057, help="roofline: a token's compute")
    parser.add_argument("--host-ms", type=float, default=11.0, help="a step scheduled after the read-back")
    parser.add_argument("--mixed-host-ms", type=float, default=0.0,
                        help="host time the device waits through in a step with prefill tokens (its inputs; "
                             "such steps replay no CUDA graph)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")]
    if any(b < 1 for b in budgets):
        parser.error(f"--budgets: every budget must be a positive token count, got {args.budgets!r}")
    result: dict[str, Any] = {"benchmark": "simulate_scheduler", "env": bc.environment(),
                              "model": {k: getattr(args, k) for k in ("num_kv_blocks", "block_size", "max_num_seqs",
                                                                      "cost", "base_ms", "ms_per_token", "weights_ms",
                                                                      "kv_ms_per_ktoken", "compute_ms_per_token",
                                                                      "host_ms", "mixed_host_ms")},
                              "workloads": {}}
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            parser.error(f"--workloads: unknown {name!r}; choose from {', '.join(WORKLOADS)}")
        max_tokens, out_range, drawn_max_tokens = WORKLOADS[name]
        for budget in budgets:
            # (keyed by the ratio alone when one budget runs, as before --budgets)
            key = "" if len(budgets) == 1 else f"budget {budget}, "
            rows = {f"{key}{r}" if key else str(r): simulate(r, max_tokens, out_range, args, budget, drawn_max_tokens)
                    for r in ratios}
            result["workloads"].setdefault(name, {}).update(rows)
            print(f"[{name}] {key}" + ", ".join(
                f"ratio {r}: {row['seconds']:.1f} s, {row['output_tokens_per_s']:.0f} output tokens/s, "
                f"{row['preemptions']} preemptions, {row['steps']} steps" for r, row in zip(ratios, rows.values())),
                file=sys.stderr, flush=True)
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
