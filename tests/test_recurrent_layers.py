"""Recurrent hybrids, gated DeltaNet (Qwen3-Next, Qwen3.5) and Mamba2 (Granite 4.0-H, Bamba,
Nemotron-H): the ops' math, the `recurrent_state` pass, and the engine keeping each sequence's
states across chunks, decodes, slot reuse and preemption.

Parity of the tiny models with Hugging Face is in tests/test_parity.py (every architecture of
the support table); here the parts around it.
"""

from __future__ import annotations

import pytest
import torch
from test_parity import hf_greedy
from tiny_models import tiny_config

from kiln.compiler.graph_inputs import graph_input_roles
from kiln.compiler.pass_testing import graph_for_pass, run_graph
from kiln.kernels import gated_delta_net as gdn
from kiln.kernels import recurrent_states, recurrent_steps
from kiln.passes.fuse_common import CPU_FUSIONS_ENV
from kiln.passes.manager import op_counts
from kiln.passes.recurrent_state import RecurrentStatePass
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.block_manager import BlockManager
from kiln.runtime.sequence import Sequence

HK, HV, DK, DV, WIDTH = 2, 4, 16, 8, 4
CONV_DIM = 2 * HK * DK + HV * DV


def _layer_inputs(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(mixed=torch.randn(n, CONV_DIM, generator=g), a=torch.randn(n, HV, generator=g),
                b=torch.randn(n, HV, generator=g))


def _weights(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(conv_weight=torch.randn(CONV_DIM, WIDTH, generator=g), A_log=torch.randn(HV, generator=g),
                dt_bias=torch.randn(HV, generator=g))


def test_chunked_rule_equals_the_recurrence_and_transformers() -> None:
    """The WY-chunked rule (150 tokens: three chunks, the last partial) from a non-zero state
    gives the token-by-token recurrence's outputs and final state, and transformers' own."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    torch.manual_seed(0)
    n = 150
    q, k = torch.randn(n, HK, DK), torch.randn(n, HK, DK)
    v, g, beta = torch.randn(n, HV, DV), -torch.rand(n, HV), torch.rand(n, HV)
    state = torch.randn(HV, DK, DV)
    qn = gdn._l2norm(q).repeat_interleave(HV // HK, 1) * DK ** -0.5
    kn = gdn._l2norm(k).repeat_interleave(HV // HK, 1)

    out, final = gdn.delta_rule_chunked(qn, kn, v, g, beta, state)
    steps, s = [], state.unsqueeze(0)
    for t in range(n):
        o, s = gdn.delta_rule_step(qn[t:t + 1], kn[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], s)
        steps.append(o)
    torch.testing.assert_close(out, torch.cat(steps), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, s[0], rtol=1e-4, atol=1e-4)

    ref, ref_state = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                                      initial_state=state[None], output_final_state=True,
                                                      use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, ref_state[0], rtol=1e-4, atol=1e-4)


def _paged(inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], states: dict[str, torch.Tensor],
           slots: list[int], seq_lens: list[int], counts: list[int]) -> torch.Tensor:
    starts = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return gdn.paged_gated_delta_net(
        inputs["mixed"], inputs["a"], inputs["b"], weights["conv_weight"], weights["A_log"], weights["dt_bias"],
        states["conv"], states["recurrent"], torch.tensor(slots, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), starts, HK, DK, DV)


def _whole(inputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
    return gdn.gated_delta_net(inputs["mixed"], inputs["a"], inputs["b"], weights["conv_weight"], weights["A_log"],
                               weights["dt_bias"], 0, HK, DK, DV)


def test_paged_op_continues_each_sequence_from_its_slot() -> None:
    """Three sequences over mixed steps (a prefill in two chunks, decodes, a prompt shorter than
    the convolution) then a decode-only step with padded rows: each sequence's outputs equal
    its whole-sequence computation, and a fresh sequence in a slot holding another's states
    starts from zero."""
    weights = _weights()
    # Each sequence's tokens over the three steps below; causal, so its whole computation's
    # rows are its outputs step by step.
    seqs = [_layer_inputs(71, seed=10), _layer_inputs(10, seed=11), _layer_inputs(3, seed=12)]
    whole = [_whole(s, weights) for s in seqs]
    states = {"conv": torch.randn(4, CONV_DIM, WIDTH - 1), "recurrent": torch.randn(4, HV, DK, DV)}  # stale slots
    slots = [3, 1, 2]

    # Step 1: A's first 40 tokens, B's 8; step 2: A's other 30, B's last one, C's prompt of 2.
    step1 = {k: torch.cat([seqs[0][k][:40], seqs[1][k][:8]]) for k in seqs[0]}
    out1 = _paged(step1, weights, states, slots[:2], [40, 8], [40, 8])
    step2 = {k: torch.cat([seqs[0][k][40:70], seqs[1][k][8:9], seqs[2][k][:2]]) for k in seqs[0]}
    out2 = _paged(step2, weights, states, slots, [70, 9, 2], [30, 1, 2])
    torch.testing.assert_close(torch.cat([out1[:40], out2[:30]]), whole[0][:70], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([out1[40:], out2[30:31]]), whole[1][:9], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out2[31:], whole[2][:2], rtol=1e-4, atol=1e-4)

    # A decode-only step (one token a row, two padded rows: seq_len 0, the null slot 0) takes
    # the path CUDA graphs capture; it continues all three.
    pad = _layer_inputs(2, seed=99)
    step3 = {k: torch.cat([seqs[0][k][70:71], seqs[1][k][9:10], seqs[2][k][2:3], pad[k]]) for k in pad}
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    assert recurrent_steps.one_token_a_row(5, i32([0, 1, 2, 3, 3, 3]), i32([71, 10, 3, 0, 0]), i32(slots + [0, 0]))
    out3 = _paged(step3, weights, states, slots + [0, 0], [71, 10, 3, 0, 0], [1, 1, 1, 0, 0])
    for i, w in enumerate(whole):
        torch.testing.assert_close(out3[i], w[-1], rtol=1e-4, atol=1e-4)
    assert not recurrent_steps.one_token_a_row(3, i32([0, 2, 2, 3]), i32([72, 11, 4]), i32(slots))  # a row of 2 tokens


def test_prefills_are_padded_in_groups_of_bounded_waste() -> None:
    assert recurrent_steps.padding_groups([64, 60, 50, 40]) == [[0, 1, 2, 3]]
    assert recurrent_steps.padding_groups([16384, 2, 2, 2]) == [[0, 1], [2, 3]]  # 2 x 16k padded rows, not 4
    assert recurrent_steps.padding_groups([100, 30, 30, 30, 30]) == [[0, 1, 2], [3, 4]]  # 300 padded rows for 160 real: the bound


def test_a_step_reads_its_rows_on_the_host_once(monkeypatch) -> None:
    """A step's offsets, lengths and slots are read to the host once for all its recurrent
    layers (one device sync a step, not three a layer), and again after an in-place write."""
    qsl, lens, slots = (torch.tensor(x, dtype=torch.int32) for x in ([0, 3, 4], [3, 9], [2, 1]))
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real_tolist(self))
    first = recurrent_steps.step_rows(qsl, lens, slots)
    assert first == ([0, 3, 4], [3, 9], [2, 1]) and len(reads) == 1
    assert recurrent_steps.step_rows(qsl, lens, slots) is first and len(reads) == 1
    assert not recurrent_steps.one_token_a_row(2, qsl, lens, slots)  # 4 tokens, 2 rows
    lens[1] = 10  # an in-place write: read again
    assert recurrent_steps.step_rows(qsl, lens, slots)[1] == [3, 10] and len(reads) == 2
    decode = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert recurrent_steps.one_token_a_row(2, decode, lens, slots) and len(reads) == 3


def test_recurrent_state_pass_replaces_markers_and_adds_inputs() -> None:
    """Before: one `kiln::gated_delta_net` per linear-attention layer; after: the paged op, two
    state caches per layer and the slots input, with the same logits on one prefill."""
    config = tiny_config("qwen3_next")
    linear = [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    before = graph_for_pass(config, "recurrent_state")
    assert op_counts(before.graph_module)["kiln.gated_delta_net.default"] == len(linear)
    roles_before = graph_input_roles(before.graph_module)
    after = before.copy()
    stats = after.run_pass(RecurrentStatePass())

    counts = op_counts(after.graph_module)
    assert counts["kiln.gated_delta_net.default"] == 0
    assert counts["kiln.paged_gated_delta_net.default"] == len(linear)
    added = [r for r in graph_input_roles(after.graph_module) if r not in roles_before]
    assert sorted(added) == sorted([f"state:{i}.{part}" for i in linear for part in ("conv", "recurrent")]
                                   + ["batch:state_slots"])
    assert stats == {"recurrent_replaced": len(linear), "inputs_added": 2 * len(linear) + 3}
    torch.testing.assert_close(run_graph(after, num_tokens=20), run_graph(before, num_tokens=20), rtol=1e-5, atol=1e-5)


def test_block_manager_hands_out_state_slots() -> None:
    """Each admitted sequence holds its own slot (never the null slot 0) until freed; a freed
    slot is reused; prefix caching is refused with states."""
    from kiln.runtime.sampling_params import SamplingParams as Params

    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(16, 4, enable_prefix_caching=True, num_state_slots=3)
    bm = BlockManager(16, 4, enable_prefix_caching=False, num_state_slots=3)
    seqs = [Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=[1, 2, 3, 4, 5], params=Params()) for i in range(3)]
    bm.admit(seqs[0], [], 5, from_cache=False)
    bm.admit(seqs[1], [], 5, from_cache=False)
    assert sorted(s.state_slot for s in seqs[:2]) == [1, 2]
    bm.check_invariants(seqs[:2])
    with pytest.raises(RuntimeError, match="no recurrent-state slot"):
        bm.admit(seqs[2], [], 5, from_cache=False)
    freed = seqs[0].state_slot
    bm.free(seqs[0])
    assert seqs[0].state_slot == 0
    bm.admit(seqs[2], [], 5, from_cache=False)
    assert seqs[2].state_slot == freed
    bm.check_invariants(seqs[1:])


def test_engine_keeps_states_across_chunks_slot_reuse_and_preemption(tiny_model_dir) -> None:
    """Five prompts through two seats, 16-token steps (prompts prefilled in chunks) and a KV
    cache too small for both seats' growth (preemption: the states start over with the
    recompute): every completion is Hugging Face's greedy one."""
    path, hf = tiny_model_dir("qwen3_next")
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False, max_num_seqs=2, max_num_batched_tokens=16,
              block_size=4, num_kv_blocks=20, kv_reserve_ratio=0.0)
    engine = llm.engine
    assert engine.block_manager.num_state_slots == 3 and not engine.block_manager.enable_prefix_caching
    prompts = [list(range(3, 40)), [5, 9], list(range(20, 45)), [7] * 30, list(range(50, 58))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert engine.scheduler.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)
    assert sorted(engine.block_manager.free_state_slots) == [1, 2]  # every slot back


def test_engine_runs_siblings_each_from_its_own_prompt(tiny_model_dir) -> None:
    """n=2 completions of one prompt: no prompt blocks shared (the states are not), both greedy."""
    path, hf = tiny_model_dir("qwen3_5")
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    prompt = list(range(4, 30))
    out = llm.generate([prompt], SamplingParams(n=2, max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    expected = hf_greedy(hf, prompt, 8)
    assert [c.token_ids for c in out.outputs] == [expected, expected]
    assert llm.engine.scheduler.stats.num_forked_tokens == 0


@pytest.mark.parametrize("arch,fusions", [("qwen3_next", False), ("qwen3_next", True), ("granitemoehybrid", False),
                                          ("jamba", False)])
def test_two_ranks_give_one_ranks_tokens(arch: str, fusions: bool, tiny_model_dir, monkeypatch) -> None:
    """Qwen3-Next, Granite 4.0-H and Jamba at tensor_parallel_size=2 (two CPU workers over
    gloo): each rank holds its heads' or channels' states (its conv channels, its value heads,
    Mamba2 heads or Mamba channels) and reads its slices of the fused projections (a Mamba
    mixer's x_proj and out_proj all-reduced); over chunked prefills and decodes the greedy tokens
    equal TP=1's. With `fusions` the CUDA pipeline's fusions run too (the norms, RoPE, the MoE and
    the shared expert's gate, over each rank's shards). (Mamba's, Mamba2's and Falcon-H1's ranks
    against their unsharded graph: tests/test_shard_tensor_parallel.py.)"""
    if fusions:
        monkeypatch.setenv(CPU_FUSIONS_ENV, "1")  # (the workers inherit the environment)
    path, _ = tiny_model_dir(arch)
    # On CPU workers over gloo (a machine with one GPU would otherwise need two).
    options = dict(dtype="float32", device="cpu", progress=False, max_model_len=128, max_num_seqs=4,
                   max_num_batched_tokens=16)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [list(range(3, 40)), [5, 9], list(range(20, 45))]
    expected = [o.outputs[0].token_ids for o in LLM(str(path), **options).generate(prompts, greedy)]
    llm = LLM(str(path), tensor_parallel_size=2, **options)
    try:
        assert llm.engine.num_state_slots == 5 and not llm.engine.block_manager.enable_prefix_caching
        if arch == "qwen3_next":  # each rank's graph: its MoE and shared-expert gate fused or not
            for report in llm.engine.executor.reports:
                fired = {k for r in report["pass_records"] for k, v in r["stats"].items() if v}
                assert {"fused_moe", "add_gated_shared_expert"} <= fired if fusions else not (
                    {"fused_moe", "add_gated_shared_expert"} & fired), (report["rank"], fired)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected
    finally:
        llm.engine.shutdown()


def test_compiled_artifacts_carry_the_states(tiny_model_dir, tmp_path) -> None:
    """Inductor artifacts (CPU) of a hybrid model take the state caches as inputs whose slot
    count is dynamic: the compiled engine gives the eager engine's tokens."""
    path, hf = tiny_model_dir("qwen3_next")
    settings = dict(max_num_seqs=2, max_num_batched_tokens=16, decode_buckets=[2], token_buckets=[16])
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False, compile="inductor",
              cache_dir=str(tmp_path / "cache"), **settings)
    prompts = [[5, 6, 7, 8], list(range(1, 24))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert llm.engine.startup_report.mode == "inductor"
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 6)


def test_state_slots_fit_their_share_of_memory(tiny_model_dir, monkeypatch) -> None:
    """States take at most their share of the memory left: fewer slots than max_num_seqs + 1
    when they would take more (the engine then runs that many sequences), a clear error when
    not one sequence's fit."""
    from kiln.runtime import kv_cache

    assert kv_cache.state_slots_that_fit(8, 100, 10_000) == 9
    assert kv_cache.state_slots_that_fit(1024, 100, 1_000) == 5  # half of 1,000 bytes: 5 rows
    with pytest.raises(ValueError, match="no memory for one sequence's recurrent states"):
        kv_cache.state_slots_that_fit(8, 100, 300)

    path, hf = tiny_model_dir("qwen3_5")
    per_slot = recurrent_states.state_bytes_per_slot(tiny_config("qwen3_5"), torch.float32)
    ram = kv_cache.os.sysconf("SC_PHYS_PAGES") * kv_cache.os.sysconf("SC_PAGE_SIZE")
    # Memory for 4 rows' states in the share: 3 sequences at once, not 8.
    monkeypatch.setattr(kv_cache, "CPU_KV_MEMORY_FRACTION", 4.5 * per_slot / kv_cache.STATE_MEMORY_SHARE / ram)
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False, max_num_seqs=8, num_kv_blocks=64)
    assert llm.engine.block_manager.num_state_slots == 4 and llm.engine.scheduler.max_num_seqs == 3
    prompts = [[5, 6, 7, 8 + i] for i in range(5)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 4)


def _run_with_triton(code: str) -> None:
    """Run a kernel check in a fresh process, where Triton's interpreter can be switched on
    before the kernels are defined (without a GPU); it must print "ok"."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@pytest.mark.triton_kernels  # on a GPU, part of `pytest -m gpu` (tests/conftest.py)
def test_triton_decode_kernel_equals_the_reference() -> None:
    """The CUDA decode kernel (under Triton's interpreter without a GPU) gives the reference's
    outputs and states from the convolved rows and a, b as strided views: grouped value heads,
    a value width over one block (two column blocks), a row starting fresh in a slot holding
    garbage, two padded rows on the null slot, one row's a past softplus's linear threshold;
    and with OLMo Hybrid's doubled beta (`beta_scale` 2)."""
    code = r'''
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from kiln.kernels import gated_delta_net as gdn
from kiln.kernels.triton_gated_delta_net import gated_delta_decode_triton
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
rows, hk, hv, dk, dv = 5, 2, 4, 16, 40
conv = torch.randn(rows, 2 * hk * dk + hv * dv, device=dev)
ab = torch.randn(rows, 2 * hv, device=dev)  # as a fused projection's columns: a and b are views
a, b = ab[:, :hv], ab[:, hv:]
a[1, 2] = 30.0
A_log, dt_bias = torch.randn(hv, device=dev), torch.randn(hv, device=dev)
state = torch.randn(6, hv, dk, dv, device=dev)
slots = torch.tensor([3, 1, 4, 0, 0], device=dev)
continuing = torch.tensor([True, True, False, False, False], device=dev)
ref_state = state.clone()
ref = gdn.decode_rule_reference(conv, a, b, A_log, dt_bias, ref_state, slots, continuing, hk, dk, dv)
out = gated_delta_decode_triton(conv, a, b, A_log, dt_bias, state, slots, continuing, hk, dk, dv)
torch.testing.assert_close(out[:3], ref[:3], rtol=1e-5, atol=1e-5)
torch.testing.assert_close(state[1:], ref_state[1:], rtol=1e-5, atol=1e-5)
# Half-precision rows (the model's dtype): the output in it, the float32 sums rounded once.
half = [t.half() for t in (conv, a, b)]
ref16 = gdn.decode_rule_reference(*half, A_log, dt_bias, state.clone(), slots, continuing, hk, dk, dv)
out16 = gated_delta_decode_triton(*half, A_log, dt_bias, state.clone(), slots, continuing, hk, dk, dv)
assert out16.dtype == torch.float16
torch.testing.assert_close(out16[:3].float(), ref16[:3], rtol=2e-3, atol=2e-3)
doubled_ref_state, doubled_state = state.clone(), state.clone()
ref2 = gdn.decode_rule_reference(conv, a, b, A_log, dt_bias, doubled_ref_state, slots, continuing, hk, dk, dv,
                                 beta_scale=2.0)
out2 = gated_delta_decode_triton(conv, a, b, A_log, dt_bias, doubled_state, slots, continuing, hk, dk, dv,
                                 beta_scale=2.0)
torch.testing.assert_close(out2[:3], ref2[:3], rtol=1e-5, atol=1e-5)
torch.testing.assert_close(doubled_state[1:], doubled_ref_state[1:], rtol=1e-5, atol=1e-5)
assert not torch.allclose(out2[:3], out[:3])
print("ok")
'''
    _run_with_triton(code)


@pytest.mark.triton_kernels
def test_triton_conv_kernel_equals_the_reference() -> None:
    """The decode step's causal convolution as one kernel (under the interpreter without a GPU):
    the torch form's outputs and conv states, with and without bias and SiLU, for a row
    continuing its slot's inputs, one starting fresh over garbage, and a padded row; 300
    channels (two blocks, the second partial), kernels of 4 and 3 taps, float16 rows."""
    code = r'''
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from kiln.kernels.recurrent_steps import conv_single_tokens
from kiln.kernels.triton_causal_conv import conv_single_tokens_triton
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
rows, channels = 3, 300
for width, bias, silu in ((4, False, True), (4, True, True), (3, True, False)):
    x = torch.randn(rows, channels, device=dev, dtype=torch.float16)
    weight = torch.randn(channels, width, device=dev, dtype=torch.float16)
    b = torch.randn(channels, device=dev, dtype=torch.float16) if bias else None
    state = torch.randn(5, channels, width - 1, device=dev, dtype=torch.float16)
    slots = torch.tensor([2, 4, 0], device=dev)
    continuing = torch.tensor([True, False, False], device=dev)
    ref_state = state.clone()
    ref = conv_single_tokens(x, weight, b, ref_state, slots, continuing, silu)
    out = conv_single_tokens_triton(x, weight, b, state, slots, continuing, silu)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out[:2], ref[:2], rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(state[1:], ref_state[1:], rtol=0, atol=0)
print("ok")
'''
    _run_with_triton(code)


@pytest.mark.triton_kernels
def test_cuda_implementations_equal_the_references_over_mixed_and_decode_steps() -> None:
    """The three ops as their CUDA implementations compose them (the Triton convolution and
    decode rules; under the interpreter without a GPU): a mixed step (a prompt of 5, a
    continuing decode) then a decode-only step with a padded row give the plain references'
    outputs and states."""
    code = r'''
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from kiln.kernels import gated_delta_net as gdn, mamba2, short_conv
from kiln.kernels.triton_causal_conv import conv_single_tokens_triton as conv_rule
from kiln.kernels.triton_gated_delta_net import gated_delta_decode_triton
from kiln.kernels.triton_mamba2 import mamba2_decode_triton
dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
t = lambda *shape: torch.randn(*shape, generator=g).to(dev)
i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)
steps = [(6, [3, 1], [5, 7], [0, 5, 6]), (3, [3, 1, 0], [6, 8, 0], [0, 1, 2, 3])]  # tokens, slots, seq_lens, starts
hk, hv, dk, dv, width = 2, 4, 16, 8, 4
gdn_dim = 2 * hk * dk + hv * dv
heads, head_dim, groups, n = 4, 8, 2, 16
m_dim = heads * head_dim + 2 * groups * n
gdn_w, m_w, sc_w = (t(gdn_dim, width), t(hv), t(hv)), (t(m_dim, width), t(m_dim), t(heads), t(heads), t(heads)), (t(24, 3), t(24))
states = {"gdn": (t(4, gdn_dim, width - 1), t(4, hv, dk, dv)), "m": (t(4, m_dim, width - 1), t(4, heads, head_dim, n)),
          "sc": (t(4, 24, 2),)}
ref_states = {k: tuple(x.clone() for x in v) for k, v in states.items()}
for tokens, slots, lens, starts in steps:
    x_g, a, b, x_m, dt, x_s = t(tokens, gdn_dim), t(tokens, hv), t(tokens, hv), t(tokens, m_dim), t(tokens, heads), t(tokens, 24)
    common = (i32(slots), i32(lens), i32(starts))
    outs = []
    for st, rules in ((ref_states, ({}, {}, {})), (states, ({"decode_rule": gated_delta_decode_triton, "conv_rule": conv_rule},
                                                         {"decode_rule": mamba2_decode_triton, "conv_rule": conv_rule},
                                                         {"conv_rule": conv_rule}))):
        outs.append((gdn.paged_gated_delta_net_reference(x_g, a, b, *gdn_w, *st["gdn"], *common, hk, dk, dv, **rules[0]),
                     mamba2.paged_mamba2_scan_reference(x_m, dt, *m_w[:2], m_w[2], m_w[3], m_w[4], *st["m"], *common,
                                                        heads, head_dim, groups, n, **rules[1]),
                     short_conv.paged_short_conv_reference(x_s, *sc_w, *st["sc"], *common, **rules[2])))
    real = starts[len([l for l in lens if l])]
    for ref, out in zip(*outs):
        torch.testing.assert_close(out[:real], ref[:real], rtol=1e-4, atol=1e-4)
for k in states:
    for got, want in zip(states[k], ref_states[k]):
        torch.testing.assert_close(got[1:], want[1:], rtol=1e-4, atol=1e-4)
print("ok")
'''
    _run_with_triton(code)


def test_mamba2_chunked_scan_equals_the_recurrence() -> None:
    """The chunked SSM (150 tokens: three chunks, the last partial) from a non-zero state gives
    the token-by-token recurrence's outputs and final state."""
    from kiln.kernels import mamba2

    torch.manual_seed(0)
    n, heads, head_dim, state_size = 150, 4, 8, 16
    x, B, C = torch.randn(n, heads, head_dim), torch.randn(n, heads, state_size), torch.randn(n, heads, state_size)
    dt = torch.rand(n, heads)
    log_decay = -torch.rand(n, heads) * dt
    state = torch.randn(heads, head_dim, state_size)
    y, final = mamba2.scan_chunked(x, B, C, dt, log_decay, state)
    steps, s = [], state.unsqueeze(0)
    for t in range(n):
        out, s = mamba2.scan_step(x[t:t + 1], B[t:t + 1], C[t:t + 1], dt[t:t + 1], log_decay[t:t + 1], s)
        steps.append(out)
    torch.testing.assert_close(y, torch.cat(steps), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, s[0], rtol=1e-4, atol=1e-4)


def test_paged_mamba2_continues_each_sequence_from_its_slot() -> None:
    """Two sequences over a mixed step (a prefill chunk beside a prompt of 2, shorter than the
    convolution), then a decode step with a padded row: each equals its whole-sequence scan
    (the convolution's bias and D's skip included)."""
    from kiln.kernels import mamba2

    heads, head_dim, groups, state_size = 4, 8, 2, 16
    conv_dim = heads * head_dim + 2 * groups * state_size
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(conv_dim, 4, generator=g), torch.randn(conv_dim, generator=g), torch.randn(heads, generator=g),
               torch.randn(heads, generator=g), torch.randn(heads, generator=g)]  # conv w, b, A_log, D, dt_bias
    seqs = [(torch.randn(41, conv_dim, generator=g), torch.randn(41, heads, generator=g)),
            (torch.randn(3, conv_dim, generator=g), torch.randn(3, heads, generator=g))]
    whole = [mamba2.mamba2_scan(x, dt, weights[0], weights[1], weights[2], weights[3], weights[4], 0, heads, head_dim,
                                groups, state_size) for x, dt in seqs]
    conv_state, ssm_state = torch.randn(3, conv_dim, 3), torch.randn(3, heads, head_dim, state_size)  # stale

    def step(rows: list[tuple[int, int, int]], slots: list[int], lens: list[int]) -> torch.Tensor:
        x = torch.cat([seqs[i][0][a:b] for i, a, b in rows])
        dt = torch.cat([seqs[i][1][a:b] for i, a, b in rows])
        counts = [b - a for _, a, b in rows] + [0] * (len(slots) - len(rows))
        if len(counts) > len(rows):  # a padded row: a padding token, no tokens of its own
            x, dt = torch.cat([x, torch.randn(1, conv_dim)]), torch.cat([dt, torch.randn(1, heads)])
        starts = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return mamba2.paged_mamba2_scan(x, dt, *weights[:2], *weights[2:], conv_state, ssm_state,
                                        torch.tensor(slots, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32),
                                        starts, heads, head_dim, groups, state_size)

    first = step([(0, 0, 40), (1, 0, 2)], [2, 1], [40, 2])
    second = step([(0, 40, 41), (1, 2, 3)], [2, 1, 0], [41, 3, 0])  # all decodes, a padded row last
    torch.testing.assert_close(torch.cat([first[:40], second[:1]]), whole[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat([first[40:], second[1:2]]), whole[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,recurrent_op", [("granitemoehybrid", "kiln.paged_mamba2_scan.default"),
                                               ("lfm2", "kiln.paged_short_conv.default")])
def test_other_families_keep_states_across_chunks_and_preemption(arch: str, recurrent_op: str,
                                                                 tiny_model_dir) -> None:
    """Granite 4.0-H (Mamba2) and LFM2 (short convolutions, a conv state alone): five prompts
    through two seats, 16-token steps, a KV cache small enough to preempt; every completion is
    Hugging Face's greedy one."""
    path, hf = tiny_model_dir(arch)
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False, max_num_seqs=2, max_num_batched_tokens=16,
              block_size=4, num_kv_blocks=20, kv_reserve_ratio=0.0)
    prompts = [list(range(3, 40)), [5, 9], list(range(20, 45)), [7] * 30, list(range(50, 58))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 24)
    counts = op_counts(llm.engine.graph.graph_module)
    assert counts[recurrent_op] == 3 and counts["kiln.paged_attention.default"] == 1


@pytest.mark.triton_kernels  # on a GPU, part of `pytest -m gpu` (tests/conftest.py)
def test_triton_mamba2_decode_kernel_equals_the_reference() -> None:
    """The CUDA Mamba2 decode kernel (under Triton's interpreter without a GPU) gives the
    reference's outputs and states from the convolved rows and the raw dt (a strided view, one
    value past softplus's linear threshold): heads in two groups, a head_dim over one block, a
    state width that is no power of two, a row starting fresh in a stale slot, two padded rows."""
    code = r'''
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from kiln.kernels import mamba2
from kiln.kernels.triton_mamba2 import mamba2_decode_triton
dev = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
rows, heads, head_dim, groups, state = 5, 4, 24, 2, 12
conv = torch.randn(rows, heads * head_dim + 2 * groups * state, device=dev)
dt = torch.randn(rows, 2 * heads, device=dev)[:, ::2]
dt[2, 1] = 25.0
A_log, dt_bias, D = torch.randn(heads, device=dev), torch.randn(heads, device=dev), torch.randn(heads, device=dev)
ssm = torch.randn(6, heads, head_dim, state, device=dev)
slots = torch.tensor([3, 1, 4, 0, 0], device=dev)
continuing = torch.tensor([True, True, False, False, False], device=dev)
ref_state = ssm.clone()
shape = (heads, head_dim, groups, state)
ref = mamba2.decode_rule_reference(conv, dt, A_log, dt_bias, D, ref_state, slots, continuing, *shape)
out = mamba2_decode_triton(conv, dt, A_log, dt_bias, D, ssm, slots, continuing, *shape)
torch.testing.assert_close(out[:3], ref[:3], rtol=1e-5, atol=1e-5)
torch.testing.assert_close(ssm[1:], ref_state[1:], rtol=1e-5, atol=1e-5)
# Zamba2's time_step_limit: dt clamped from below after softplus.
clamped_ref_state, clamped_state = ssm.clone(), ssm.clone()
ref = mamba2.decode_rule_reference(conv, dt, A_log, dt_bias, D, clamped_ref_state, slots, continuing, *shape, dt_min=1.5)
out = mamba2_decode_triton(conv, dt, A_log, dt_bias, D, clamped_state, slots, continuing, *shape, dt_min=1.5)
torch.testing.assert_close(out[:3], ref[:3], rtol=1e-5, atol=1e-5)
torch.testing.assert_close(clamped_state[1:], clamped_ref_state[1:], rtol=1e-5, atol=1e-5)
print("ok")
'''
    _run_with_triton(code)
