"""The gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE): the `fuse_shared_expert_gate`
pass before/after, `kiln::add_gated_shared_expert`'s reference and its Triton kernel.

Without a GPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported); on a GPU the same tests run on CUDA (`triton_kernels` marker).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # stays set: the interpreter reads it at every launch

import kiln.kernels  # noqa: E402,F401  (registers the ops)
from kiln.compiler.pass_testing import graph_for_pass, run_graph  # noqa: E402
from kiln.kernels.moe import add_gated_shared_expert_reference  # noqa: E402
from kiln.passes.fuse_shared_expert_gate import FuseSharedExpertGatePass  # noqa: E402
from kiln.passes.manager import op_counts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
OP = "kiln.add_gated_shared_expert.default"


def qwen2_moe_config():
    import transformers as tf

    # One MoE layer (shared expert and its gate), one dense layer (mlp_only_layers).
    return tf.Qwen2MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             vocab_size=128, max_position_embeddings=512, intermediate_size=96,
                             moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
                             num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])


def tiny(arch: str):
    from tiny_models import tiny_config

    return qwen2_moe_config() if arch == "qwen2_moe" else tiny_config(arch)


@pytest.mark.parametrize("arch,moe_layers", [("qwen2_moe", 1), ("qwen3_next", 4), ("qwen3_5_moe", 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_gated_shared_expert_becomes_one_op(arch, moe_layers, dtype):
    config = tiny(arch)
    before = graph_for_pass(config, "fuse_shared_expert_gate", cpu_fusions=True, dtype=dtype)
    after = before.copy()
    assert after.run_pass(FuseSharedExpertGatePass(on_cpu=True)) == {"add_gated_shared_expert": moe_layers}
    delta = Counter(op_counts(after.graph_module))
    delta.subtract(op_counts(before.graph_module))
    # Per block: the gate's projection, its sigmoid, the product and the sum, for the one op.
    assert {k: v for k, v in delta.items() if v and k != "aten.linear.default"} == {
        OP: moe_layers, "aten.sigmoid.default": -moe_layers, "aten.mul.Tensor": -moe_layers,
        "aten.add.Tensor": -moe_layers}
    assert delta["aten.linear.default"] == -moe_layers
    # The reference is the chain it replaces: the same numbers, in either dtype.
    assert torch.equal(run_graph(after), run_graph(before))


def test_models_without_the_gate_are_left_alone():
    # Mixtral (no shared expert) and DeepSeek-V3 (a shared expert without a gate).
    for arch in ("llama", "deepseek_v3"):
        graph = graph_for_pass(tiny(arch), "fuse_shared_expert_gate", cpu_fusions=True)
        assert graph.copy().run_pass(FuseSharedExpertGatePass(on_cpu=True)) == {"add_gated_shared_expert": 0}


def test_off_the_cpu_by_default():
    graph = graph_for_pass(tiny("qwen2_moe"), "fuse_shared_expert_gate", cpu_fusions=False)
    assert FuseSharedExpertGatePass(on_cpu=False)(graph.copy().graph_module, None) == {"skipped_on_cpu": 1}


def test_bad_input_is_refused_with_a_message():
    out, shared, hidden = torch.randn(3, 8), torch.randn(3, 8), torch.randn(3, 16)
    op = torch.ops.kiln.add_gated_shared_expert
    with pytest.raises(ValueError, match="differ in shape"):
        op(out, shared[:, :4], hidden, torch.randn(1, 16))
    with pytest.raises(ValueError, match=r"gate_weight must be \[1, 16\]"):
        op(out, shared, hidden, torch.randn(2, 16))
    with pytest.raises(ValueError, match="differ in their tokens"):
        op(out, shared, hidden[:2], torch.randn(1, 16))


@pytest.mark.triton_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden_size", [(1, 64), (5, 96), (3, 2048)])
def test_triton_kernel_is_the_reference(dtype, rows, hidden_size):
    from kiln.kernels.triton_shared_expert_gate import add_gated_shared_expert_triton

    g = torch.Generator().manual_seed(rows * hidden_size)
    out, shared, hidden = (torch.randn(rows, hidden_size, generator=g) for _ in range(3))
    gate_weight = torch.randn(1, hidden_size, generator=g) * hidden_size ** -0.5
    moe_out = torch.randn(rows, 2 * hidden_size, generator=g)[:, :hidden_size]  # strided rows, read in place
    args = [t.to(DEVICE, dtype) for t in (moe_out, shared, hidden, gate_weight)]
    y = add_gated_shared_expert_triton(*args)
    ref = add_gated_shared_expert_reference(*(t.cpu() for t in args))
    assert y.dtype == dtype and y.shape == (rows, hidden_size) and y.is_contiguous()
    # Only the gate's dot product sums in another order: its logit may differ in the last
    # place, and the gate with it, by one step of the dtype.
    step = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(y.cpu().float(), ref.float(), atol=4 * step, rtol=2 * step)
    # Under the interpreter the logit's rounding to 16 bits absorbs that order: most values
    # equal the reference's. (It rounds float32 to bfloat16 by truncation: only float16
    # compares so.) On CUDA the sigmoid and the final multiply-add round otherwise than the
    # CPU reference's torch ops: 70-80% of 16-bit values equal on an H100 (2026-12-06), the
    # rest within the tolerance above.
    if dtype == torch.float16 and DEVICE != "cuda":
        assert (y.cpu() == ref).float().mean() > 0.9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernel_replays_in_a_cuda_graph():
    # Qwen3-Next-80B's width at batch 64, captured and replayed: bit-equal to the eager launch.
    g = torch.Generator().manual_seed(3)
    out, shared, hidden = (torch.randn(64, 2048, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    gate_weight = (torch.randn(1, 2048, generator=g) * 0.02).to("cuda", torch.bfloat16)
    eager = torch.ops.kiln.add_gated_shared_expert(out, shared, hidden, gate_weight)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.ops.kiln.add_gated_shared_expert(out, shared, hidden, gate_weight)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.kiln.add_gated_shared_expert(out, shared, hidden, gate_weight)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
