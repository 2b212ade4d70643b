"""Mamba's selective scan (Mamba, Falcon-Mamba, Jamba): the op's math against transformers',
the paged op over mixed steps, its Triton kernel, the marker pass, and the engine keeping each
sequence's states across chunks, decodes, preemption and a warm start; models without
attention layers at all (Mamba, and Mamba2's own model).

Parity of the tiny models with Hugging Face is in tests/test_parity.py (every architecture of
the support table); here the parts around it.
"""

from __future__ import annotations

import pytest
import torch
from test_parity import hf_greedy
from test_recurrent_layers import _run_with_triton
from tiny_models import tiny_config

from kiln.compiler.graph_inputs import graph_input_roles
from kiln.compiler.pass_testing import graph_for_pass, run_graph
from kiln.kernels import mamba
from kiln.passes.manager import op_counts
from kiln.passes.recurrent_state import RecurrentStatePass
from kiln.runtime import LLM, SamplingParams

CHANNELS, STATE = 24, 6


def _sequence(n: int, g: torch.Generator) -> list[torch.Tensor]:
    """x, dt (raw), B, C, z of n tokens."""
    return [torch.randn(n, CHANNELS, generator=g), torch.randn(n, CHANNELS, generator=g),
            torch.randn(n, STATE, generator=g), torch.randn(n, STATE, generator=g),
            torch.randn(n, CHANNELS, generator=g)]


def _weights(g: torch.Generator) -> list[torch.Tensor]:
    """A_log [D, N], D [D], dt_bias [D]."""
    return [torch.randn(CHANNELS, STATE, generator=g), torch.randn(CHANNELS, generator=g),
            torch.randn(CHANNELS, generator=g)]


def test_scan_equals_transformers_selective_scan() -> None:
    """The marker's reference over one sequence (softplus, the decay per channel and state
    column, D's skip, the SiLU gate) gives transformers' own `mamba_selective_scan`."""
    from transformers.models.mamba.modeling_mamba import mamba_selective_scan

    g = torch.Generator().manual_seed(0)
    x, dt, B, C, z = _sequence(37, g)
    A_log, D, dt_bias = _weights(g)
    ours = mamba.selective_scan(x, dt, B, C, z, A_log, D, dt_bias, 0)
    theirs = mamba_selective_scan(x.t()[None], dt.t()[None], -A_log.exp(), B.t()[None], C.t()[None], D=D,
                                  z=z.t()[None], delta_bias=dt_bias, delta_softplus=True)
    torch.testing.assert_close(ours, theirs[0].t(), rtol=1e-5, atol=1e-5)


def _paged_step(seqs: list[list[torch.Tensor]], rows: list[tuple[int, int, int]], slots: list[int], lens: list[int],
                weights: list[torch.Tensor], ssm_state: torch.Tensor, g: torch.Generator,
                scan=mamba.paged_selective_scan) -> torch.Tensor:
    """One step: `rows` (sequence, first token, end) of `seqs`, then padded rows (no tokens of
    their own in a decode step: one padding token each)."""
    parts = [torch.cat([seqs[i][k][a:b] for i, a, b in rows]) for k in range(5)]
    counts = [b - a for _, a, b in rows] + [1] * (len(slots) - len(rows))
    for _ in range(len(slots) - len(rows)):
        parts = [torch.cat([p, torch.randn(1, p.shape[1], generator=g)]) for p in parts]
    starts = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return scan(*parts, *weights, ssm_state, torch.tensor(slots, dtype=torch.int32),
                torch.tensor(lens, dtype=torch.int32), starts)


def test_paged_scan_continues_each_sequence_from_its_slot() -> None:
    """Two sequences over a mixed step (a prefill chunk beside a prompt of 2) from stale slots,
    then a decode step with a padded row: each equals its whole-sequence scan."""
    g = torch.Generator().manual_seed(3)
    weights = _weights(g)
    seqs = [_sequence(41, g), _sequence(3, g)]
    whole = [mamba.selective_scan(*s, *weights, 0) for s in seqs]
    ssm_state = torch.randn(3, CHANNELS, STATE)  # stale: sequences that start must not read it
    first = _paged_step(seqs, [(0, 0, 40), (1, 0, 2)], [2, 1], [40, 2], weights, ssm_state, g)
    second = _paged_step(seqs, [(0, 40, 41), (1, 2, 3)], [2, 1, 0], [41, 3, 0], weights, ssm_state, g)
    torch.testing.assert_close(torch.cat([first[:40], second[:1]]), whole[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([first[40:], second[1:2]]), whole[1], rtol=1e-4, atol=1e-4)


@pytest.mark.triton_kernels  # on a GPU, part of `pytest -m gpu` (tests/conftest.py)
def test_triton_scan_kernel_equals_the_reference() -> None:
    """The CUDA kernel (under Triton's interpreter without a GPU) gives the reference's outputs
    and states over a mixed step (a chunk continuing its slot, a fresh prompt in a stale slot, a
    decode) and a decode step with padded rows: channels over one block, a state width that is
    no power of two, x and z strided views of one projection, a dt past softplus's threshold;
    a mixed step's padding tokens stay zero."""
    code = r'''
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from kiln.kernels import mamba
from kiln.kernels.triton_mamba import selective_scan_triton
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
D, N = 40, 12
A_log, skip, dt_bias = torch.randn(D, N, device=dev), torch.randn(D, device=dev), torch.randn(D, device=dev)
state = torch.randn(5, D, N, device=dev)
ref_state = state.clone()

def step(counts, lens, slots, padding=0):
    T = sum(counts) + padding
    xz = torch.randn(T, 2 * D, device=dev)
    x, z = xz[:, :D], xz[:, D:]
    dt, B, C = torch.randn(T, D, device=dev), torch.randn(T, N, device=dev), torch.randn(T, N, device=dev)
    dt[0, 3] = 30.0
    starts = torch.tensor([0, *counts], device=dev).cumsum(0).to(torch.int32)
    args = (x, dt, B, C, z, A_log, skip, dt_bias)
    meta = (torch.tensor(slots, device=dev, dtype=torch.int32), torch.tensor(lens, device=dev, dtype=torch.int32),
            starts)
    ref = mamba.paged_selective_scan_reference(*args, ref_state, *meta)
    out = selective_scan_triton(*args, state, *meta)
    real = sum(counts)
    torch.testing.assert_close(out[:real], ref[:real], rtol=1e-4, atol=1e-4)
    assert bool((out[real:] == 0).all())
    torch.testing.assert_close(state[1:], ref_state[1:], rtol=1e-4, atol=1e-4)

step([5, 3, 1], [9, 3, 7], [2, 4, 1], padding=2)
step([1, 1, 1, 1], [10, 4, 0, 0], [2, 4, 0, 0])
print("ok")
'''
    _run_with_triton(code)


def test_recurrent_state_pass_gives_each_mixer_a_conv_and_a_scan_state() -> None:
    """Before: a `kiln::short_conv` (with SiLU) and a `kiln::selective_scan` per Mamba layer of
    Jamba; after: their paged ops, the conv state and the SSM state of each layer, same logits."""
    config = tiny_config("jamba")
    layers = [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    before = graph_for_pass(config, "recurrent_state")
    counts = op_counts(before.graph_module)
    assert counts["kiln.selective_scan.default"] == counts["kiln.short_conv.default"] == len(layers) == 2
    roles_before = graph_input_roles(before.graph_module)
    after = before.copy()
    stats = after.run_pass(RecurrentStatePass())
    counts = op_counts(after.graph_module)
    assert counts["kiln.paged_selective_scan.default"] == counts["kiln.paged_short_conv.default"] == 2
    added = [r for r in graph_input_roles(after.graph_module) if r not in roles_before]
    assert sorted(added) == sorted([f"state:{i}.{part}" for i in layers for part in ("conv", "recurrent")]
                                   + ["batch:state_slots"])
    assert stats == {"recurrent_replaced": 4, "inputs_added": 4 + 3}
    torch.testing.assert_close(run_graph(after, num_tokens=20), run_graph(before, num_tokens=20), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch,scan", [("mamba", "kiln.paged_selective_scan.default"),
                                       ("jamba", "kiln.paged_selective_scan.default"),
                                       ("mamba2", "kiln.paged_mamba2_scan.default")])
def test_engine_keeps_states_across_chunks_and_preemption(arch: str, scan: str, tiny_model_dir) -> None:
    """Five prompts through two seats, 16-token steps and a block budget small enough to
    preempt (for Mamba and Mamba2, whose blocks hold no memory, the budget alone): every
    completion is Hugging Face's greedy one. Without attention layers the KV cache is empty."""
    path, hf = tiny_model_dir(arch)
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False, max_num_seqs=2, max_num_batched_tokens=16,
              block_size=4, num_kv_blocks=20, kv_reserve_ratio=0.0)
    prompts = [list(range(3, 40)), [5, 9], list(range(20, 45)), [7] * 30, list(range(50, 58))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)
    counts = op_counts(llm.engine.graph.graph_module)
    assert counts[scan] == 2
    assert counts.get("kiln.paged_attention.default", 0) == (2 if arch == "jamba" else 0)
    if arch != "jamba":
        assert all(cache.numel() == 0 for cache in llm.engine.runner.kv_caches)


def test_mamba_warm_starts_from_its_compile_cache(tiny_model_dir, tmp_path) -> None:
    """A second engine over the same cache takes the graph from it (a config snapshot: Mamba's
    layer kinds are a config property, not a config.json field) and decodes the same tokens."""
    path, _ = tiny_model_dir("mamba")
    options = dict(dtype="float32", device="cpu", progress=False, compile="graph", cache_dir=str(tmp_path / "cache"))
    prompts = [list(range(3, 30)), [5, 9, 11]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cold = LLM(str(path), **options)
    expected = [o.outputs[0].token_ids for o in cold.generate(prompts, params)]
    warm = LLM(str(path), **options)
    assert warm.engine.startup_report.graph_from_cache
    assert [o.outputs[0].token_ids for o in warm.generate(prompts, params)] == expected


def test_tensor_parallel_falcon_h1_with_its_grouped_norm_is_refused_by_name() -> None:
    """Falcon-H1's gated norm over groups has no sharding rule: the check says so before any
    shape goes wrong. (Two ranks of Jamba: tests/test_recurrent_layers.py; of Mamba, Mamba2 and
    Falcon-H1 without it, against their unsharded graphs: tests/test_shard_tensor_parallel.py.)"""
    from kiln.passes.shard_tensor_parallel import check_tp_size

    with pytest.raises(ValueError, match="Falcon-H1 models with mamba_rms_norm"):
        check_tp_size(tiny_config("falcon_h1_rms"), 2)
