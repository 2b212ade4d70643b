"""bench/simulate_scheduler.py's step cost models, and its budget comparison on a small workload.

The roofline model prices a step as the slower of reading the weights and computing its
tokens, plus reading the K/V its sequences attend over; the linear model as base + per token.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from pytest import approx

from bench_scripts import load_bench_script


def _simulator(monkeypatch):
    return load_bench_script(monkeypatch, "simulate_scheduler")


def _args(**overrides) -> argparse.Namespace:
    values = dict(cost="roofline", base_ms=40.0, ms_per_token=0.049, weights_ms=30.0, kv_ms_per_ktoken=0.05,
                  compute_ms_per_token=0.06, host_ms=11.0, mixed_host_ms=0.0, num_requests=40, num_kv_blocks=400,
                  block_size=16, max_num_seqs=64, seed=0)
    values.update(overrides)
    return argparse.Namespace(**values)


def _item(computed: int, new: int):
    return SimpleNamespace(seq=SimpleNamespace(num_computed_tokens=computed), num_new_tokens=new)


def test_roofline_step_is_the_slower_of_weights_and_compute_plus_kv(monkeypatch):
    sim = _simulator(monkeypatch)
    args = _args()
    decode = [_item(999, 1) for _ in range(100)]  # 100 sequences attending over 1,000 tokens each
    assert sim.step_ms(decode, args) == approx(30.0 + 0.05 * 100)  # weight-bound, + 100k tokens' K/V
    riding = decode + [_item(0, 400)]  # 400 prefill tokens ride along: 500 tokens' compute < the weights'
    assert sim.step_ms(riding, args) == approx(30.0 + 0.05 * 100.4)
    mixed = decode + [_item(0, 900)]  # 1,000 tokens: compute-bound projections
    assert sim.step_ms(mixed, args) == approx(0.06 * 1000 + 0.05 * 100.9)
    assert sim.step_ms(mixed, _args(cost="linear")) == approx(40.0 + 0.049 * 1000)


def test_budgets_change_the_simulated_run(monkeypatch):
    # Over a small KV-bound workload every budget finishes every request, and the roofline's
    # free prefill in memory-bound decode steps makes the small budget's run the shorter one.
    sim = _simulator(monkeypatch)
    runs = {budget: sim.simulate(0.5, 64, None, _args(), budget) for budget in (256, 4096)}
    for run in runs.values():
        assert run["preemptions"] == 0 and run["seconds"] > 0
    assert runs[256]["steps"] > runs[4096]["steps"]
    assert runs[256]["seconds"] < runs[4096]["seconds"], runs


def test_known_lengths_run_without_preemption_and_past_their_final_sizes(monkeypatch):
    # Requests whose drawn length is their max_tokens (EOS ignored) on a KV-bound cache, with
    # async scheduling's continuations: admission counts the blocks the first to end hand on,
    # so nothing is preempted (recomputed), and the reservation still admits work.
    sim = _simulator(monkeypatch)
    args = _args(num_kv_blocks=400, num_requests=40)
    run = sim.simulate(0.5, 448, (64, 448), args, 4096, drawn_max_tokens=True)
    assert run["preemptions"] == 0
    assert run["output_tokens_per_s"] > 0 and run["steps"] > 448
