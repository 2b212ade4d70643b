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

# name: (max_tokens, output lengths drawn uniformly from this range, or None: max_tokens)
WORKLOADS: dict[str, tuple[int, tuple[int, int] | None]] = {
    "to_max_tokens_256": (256, None),
    "stop_1_256_of_256": (256, (1, 256)),
    "stop_64_256_of_512": (512, (64, 256)),
    "stop_1_512_of_2048": (2048, (1, 512)),
}


def simulate(ratio: float, max_tokens: int, out_range: tuple[int, int] | None, args: argparse.Namespace
             ) -> dict[str, Any]:
    g = torch.Generator().manual_seed(args.seed)
    prompt_lens = torch.randint(128, 1025, (args.num_requests,), generator=g).tolist()
    out_lens = (torch.randint(out_range[0], out_range[1] + 1, (args.num_requests,), generator=g).tolist()
                if out_range else [max_tokens] * args.num_requests)
    # A stop token makes a request one that may end early (its reservation is learned).
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop_token_ids=[7] if out_range else [])
    sched = Scheduler(BlockManager(args.num_kv_blocks, args.block_size, enable_prefix_caching=False),
                      args.max_num_seqs, args.max_num_batched_tokens, reserve_ratio=ratio)
    wanted: dict[int, int] = {}
    for i, n in enumerate(prompt_lens):
        sched.add(Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=[3] * n, params=params))
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
        step_tokens = sum(item.num_new_tokens for item in items)
        tokens += step_tokens
        ms += args.base_ms + args.ms_per_token * step_tokens
        by_length, by_stop = [], []
        for item in items:
            item.seq.num_computed_tokens += item.num_new_tokens
            if item.samples:
                item.seq.append_token(5)
                outputs += 1
                if item.seq.num_output_tokens >= max_tokens:
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
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--base-ms", type=float, default=40.0, help="a step's cost without tokens")
    parser.add_argument("--ms-per-token", type=float, default=0.049)
    parser.add_argument("--host-ms", type=float, default=11.0, help="a step scheduled after the read-back")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ratios = [float(r) for r in args.ratios.split(",")]
    result: dict[str, Any] = {"benchmark": "simulate_scheduler", "env": bc.environment(),
                              "model": {k: getattr(args, k) for k in ("num_kv_blocks", "block_size", "max_num_seqs",
                                                                      "max_num_batched_tokens", "base_ms",
                                                                      "ms_per_token", "host_ms")},
                              "workloads": {}}
    for name in args.workloads.split(","):
        if name not in WORKLOADS:
            parser.error(f"--workloads: unknown {name!r}; choose from {', '.join(WORKLOADS)}")
        max_tokens, out_range = WORKLOADS[name]
        rows = {str(r): simulate(r, max_tokens, out_range, args) for r in ratios}
        result["workloads"][name] = rows
        print(f"[{name}] " + ", ".join(f"ratio {r}: {row['seconds']:.1f} s, {row['preemptions']} preemptions"
                                        for r, row in rows.items()), file=sys.stderr, flush=True)
    bc.emit(result, args.out)


if __name__ == "__main__":
    main()
