"""The FP8 projections fused with their input's producer (kiln.kernels.fp8_fused_linear): the
ops' references are the unfused chains; the CUDA kernels' GEMVs (weight-only FP8 at decode
sizes) against the float32 product of the unquantized input and the dequantized weight.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before the
kernel module is imported) with small tiles, in float16 and bfloat16. On a GPU the same
tests run on CUDA, and the `gpu` tests at the end take the Llama-3-8B shapes with the
table's tilings.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # stays set: the interpreter reads it at every launch

import kiln.kernels  # noqa: E402,F401  (registers the ops)
from kiln.kernels import fp8_fused_linear as fused  # noqa: E402
from kiln.kernels import triton_fp8_fused_linear as triton_fused  # noqa: E402
from kiln.kernels.activation import gelu_tanh_and_mul_reference, silu_and_mul_reference  # noqa: E402
from kiln.kernels.fp8 import dequantize_fp8, quantize_fp8_rowwise  # noqa: E402
from kiln.kernels.rms_norm import (add_offset_rms_norm_reference, add_rms_norm_reference,  # noqa: E402
                                   offset_rms_norm_reference, rms_norm_reference)
from kiln.kernels.triton_linear import GemvConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.triton_kernels  # on a GPU, part of `pytest -m gpu` (tests/conftest.py)
EPS = 1e-5
PROLOGUES = ("rms_norm", "add_rms_norm", "offset_rms_norm", "add_offset_rms_norm", "silu_and_mul", "gelu_tanh_and_mul",
             "plain")
ACTIVATIONS = ("silu_and_mul", "gelu_tanh_and_mul")
OFFSET = 1.0  # Gemma's and Qwen3-Next's norms: x (1 + weight), the weights near zero
SUMMING = ("add_rms_norm", "add_offset_rms_norm")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def operands(prologue: str, m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    """(inputs of the op before the weight, wq, ws, bias). A residual stream of order 4, so the
    norm's 1/rms matters; weights of order 1/sqrt(K): outputs of order one."""
    if prologue in ACTIVATIONS:
        gate_up = randn(1, m, 2 * k, seed=seed, dtype=dtype, scale=2.0)
        inputs = (gate_up[..., :k], gate_up[..., k:])  # the halves of a merged projection, in place
    elif prologue == "plain":
        inputs = (randn(1, m, k, seed=seed, dtype=dtype),)
    else:
        x = randn(1, m, k, seed=seed, dtype=dtype, scale=4.0)
        g = (int("offset" not in prologue) + randn(k, seed=seed + 1, scale=0.2)).to(dtype)
        inputs = (x, g) if prologue not in SUMMING else (x, randn(1, m, k, seed=seed + 2, dtype=dtype), g)
    wq, ws = quantize_fp8_rowwise(randn(n, k, seed=seed + 3, scale=k ** -0.5))
    b = randn(n, seed=seed + 4, dtype=dtype) if bias else None
    return inputs, wq, ws, b


def projection_input(prologue: str, inputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the GEMV multiplies (the unfused producer's output), and the residual sum."""
    cpu = [t.cpu() for t in inputs]
    if prologue == "rms_norm":
        return rms_norm_reference(cpu[0], cpu[1], EPS), None
    if prologue == "add_rms_norm":
        return add_rms_norm_reference(cpu[0], cpu[1], cpu[2], EPS)
    if prologue == "offset_rms_norm":
        return offset_rms_norm_reference(cpu[0], cpu[1], EPS, OFFSET), None
    if prologue == "add_offset_rms_norm":
        return add_offset_rms_norm_reference(cpu[0], cpu[1], cpu[2], EPS, OFFSET)
    if prologue == "silu_and_mul":
        return silu_and_mul_reference(*cpu), None
    if prologue == "gelu_tanh_and_mul":
        return gelu_tanh_and_mul_reference(*cpu), None
    return cpu[0], None


def run_triton(prologue: str, inputs, wq, ws, b, out_dtype, config=None):
    if prologue == "rms_norm":
        return triton_fused.rms_norm_fp8_linear_triton(inputs[0], inputs[1], EPS, wq, ws, b, out_dtype, config), None
    if prologue == "add_rms_norm":
        return triton_fused.add_rms_norm_fp8_linear_triton(*inputs, EPS, wq, ws, b, out_dtype, config)
    if prologue == "offset_rms_norm":
        return triton_fused.offset_rms_norm_fp8_linear_triton(inputs[0], inputs[1], EPS, OFFSET, wq, ws, b, out_dtype,
                                                              config), None
    if prologue == "add_offset_rms_norm":
        return triton_fused.add_offset_rms_norm_fp8_linear_triton(*inputs, EPS, OFFSET, wq, ws, b, out_dtype, config)
    if prologue == "silu_and_mul":
        return triton_fused.silu_and_mul_fp8_linear_triton(*inputs, wq, ws, b, out_dtype, config), None
    if prologue == "gelu_tanh_and_mul":
        return triton_fused.gelu_tanh_and_mul_fp8_linear_triton(*inputs, wq, ws, b, out_dtype, config), None
    return triton_fused.quantize_fp8_linear_triton(inputs[0], wq, ws, b, out_dtype, config), None


def run_op(prologue: str, inputs, wq, ws, b, out_dtype):
    if prologue == "rms_norm":
        return fused.rms_norm_fp8_linear(inputs[0], inputs[1], EPS, wq, ws, b, out_dtype), None
    if prologue == "add_rms_norm":
        return fused.add_rms_norm_fp8_linear(*inputs, EPS, wq, ws, b, out_dtype)
    if prologue == "offset_rms_norm":
        return fused.offset_rms_norm_fp8_linear(inputs[0], inputs[1], EPS, OFFSET, wq, ws, b, out_dtype), None
    if prologue == "add_offset_rms_norm":
        return fused.add_offset_rms_norm_fp8_linear(*inputs, EPS, OFFSET, wq, ws, b, out_dtype)
    if prologue == "silu_and_mul":
        return fused.silu_and_mul_fp8_linear(*inputs, wq, ws, b, out_dtype), None
    if prologue == "gelu_tanh_and_mul":
        return fused.gelu_tanh_and_mul_fp8_linear(*inputs, wq, ws, b, out_dtype), None
    return fused.quantize_fp8_linear(inputs[0], wq, ws, b, out_dtype), None


def weight_only_reference(prologue, inputs, wq, ws, b) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The float32 product of the unquantized input and the dequantized weight (+ bias)."""
    a, summed = projection_input(prologue, inputs)
    y = a.float() @ dequantize_fp8(wq.cpu(), ws.cpu(), torch.float32).t()
    if b is not None:
        y = y + b.cpu().float()
    return y, summed


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("dtype,bias", [(torch.float16, True), (torch.bfloat16, False)])
def test_fused_gemv_is_the_weight_only_product(prologue, dtype, bias):
    m, n, k = 1, 40, 128  # three column tiles of 16, the last partial; four K tiles of 32
    inputs, wq, ws, b = operands(prologue, m, n, k, dtype, bias)
    config = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2)
    y, summed = run_triton(prologue, inputs, wq, ws, b, dtype, config)
    ref, ref_summed = weight_only_reference(prologue, inputs, wq, ws, b)
    assert y.shape == (1, m, n) and y.dtype == dtype
    # Within the output's rounding (and the norm's 1/rms applied to the sums, not each element).
    torch.testing.assert_close(y.cpu().float(), ref, atol=2e-2, rtol=2e-2)
    # (the interpreter rounds float32 to bfloat16 by truncation, here and in the prologue's roundings)
    assert relative_error(y.cpu(), ref) < (2e-2 if dtype == torch.bfloat16 and DEVICE == "cpu" else 5e-3)
    if prologue in SUMMING:
        assert summed.shape == inputs[0].shape
        if dtype == torch.bfloat16 and DEVICE == "cpu":  # truncated: within one bfloat16 step
            torch.testing.assert_close(summed.cpu(), ref_summed, atol=0, rtol=2 ** -7)
        else:
            assert torch.equal(summed.cpu(), ref_summed)  # x + residual, as the unfused op writes it
    # The op's reference (the chain: the input quantized per token to e4m3) is close, not equal.
    chain, _ = run_op(prologue, [t.cpu() for t in inputs], wq.cpu(), ws.cpu(), None if b is None else b.cpu(),
                      torch.float32)
    assert relative_error(chain, ref) < 0.05


@pytest.mark.parametrize("prologue", PROLOGUES)
def test_ops_are_their_unfused_chains(prologue):
    inputs, wq, ws, b = operands(prologue, 5, 48, 64, torch.bfloat16, bias=True, seed=7)
    inputs, wq, ws, b = [t.cpu() for t in inputs], wq.cpu(), ws.cpu(), b.cpu()
    y, summed = run_op(prologue, inputs, wq, ws, b, torch.bfloat16)
    if prologue == "rms_norm":
        chain = fused.rms_norm_fp8_linear_chain(inputs[0], inputs[1], EPS, wq, ws, b, torch.bfloat16)
    elif prologue == "add_rms_norm":
        chain, chain_summed = fused.add_rms_norm_fp8_linear_chain(*inputs, EPS, wq, ws, b, torch.bfloat16)
        assert torch.equal(summed, chain_summed)
    elif prologue == "offset_rms_norm":
        chain = fused.offset_rms_norm_fp8_linear_chain(inputs[0], inputs[1], EPS, OFFSET, wq, ws, b, torch.bfloat16)
    elif prologue == "add_offset_rms_norm":
        chain, chain_summed = fused.add_offset_rms_norm_fp8_linear_chain(*inputs, EPS, OFFSET, wq, ws, b,
                                                                         torch.bfloat16)
        assert torch.equal(summed, chain_summed)
    elif prologue == "silu_and_mul":
        chain = fused.silu_and_mul_fp8_linear_chain(*inputs, wq, ws, b, torch.bfloat16)
    elif prologue == "gelu_tanh_and_mul":
        chain = fused.gelu_tanh_and_mul_fp8_linear_chain(*inputs, wq, ws, b, torch.bfloat16)
    else:
        chain = fused.quantize_fp8_linear_chain(inputs[0], wq, ws, b, torch.bfloat16)
    assert torch.equal(y, chain)


@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("case", ["two rows", "turned off"])
def test_elsewhere_the_chain_runs(prologue, case, monkeypatch):
    # Above one row (or with KILN_FP8_FUSED_GEMV=0): the op's chain, exactly.
    m = 2 if case == "two rows" else 1
    if case == "turned off":
        monkeypatch.setattr(triton_fused, "FUSED_GEMV", False)
    assert triton_fused.fused_gemv_config(4096, 4096, m) is None
    inputs, wq, ws, _ = operands(prologue, m, 48, 64, torch.float16, bias=False, seed=3)
    inputs, wq, ws = [t.cpu() for t in inputs], wq.cpu(), ws.cpu()
    launched = []
    monkeypatch.setattr(triton_fused, "_launch", lambda *a, **k: launched.append(a))
    y, summed = run_triton(prologue, inputs, wq, ws, None, torch.float16)
    chain, chain_summed = run_op(prologue, inputs, wq, ws, None, torch.float16)
    assert not launched and torch.equal(y, chain)
    if prologue in SUMMING:
        assert torch.equal(summed, chain_summed)


def test_fused_row_table():
    assert triton_fused.fused_gemv_config(4096, 4096, 1) == GemvConfig(4, 1024, 4, 3)  # o
    assert triton_fused.fused_gemv_config(4096, 14336, 1) == GemvConfig(8, 1024, 8, 3)  # down
    assert triton_fused.fused_gemv_config(6144, 4096, 1) == GemvConfig(16, 512, 8, 3)  # qkv
    assert triton_fused.fused_gemv_config(28672, 4096, 1) is None  # gate/up: the chain's dot GEMV is faster
    assert triton_fused.fused_gemv_config(4096, 4608, 1) == GemvConfig(8, 512, 8, 3)  # 4,608 = 9 x 512
    assert triton_fused.fused_gemv_config(4096, 4000, 1) is None  # no K tile divides 4,000


def test_bad_input_is_refused_with_a_message():
    inputs, wq, ws, _ = operands("add_rms_norm", 2, 32, 64, torch.bfloat16, bias=False)
    x, r, g = (t.cpu() for t in inputs)
    wq, ws = wq.cpu(), ws.cpu()
    with pytest.raises(ValueError, match="add_rms_norm: residual"):
        fused.add_rms_norm_fp8_linear(x, r[..., :32], g, EPS, wq, ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="rms_norm_fp8_linear: weight of shape"):
        fused.rms_norm_fp8_linear(x[..., :32], g[:32], EPS, wq, ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="silu_and_mul_fp8_linear: gate"):
        fused.silu_and_mul_fp8_linear(x, r[..., :32], wq, ws, None, torch.bfloat16)
    with pytest.raises(ValueError, match="quantize_fp8_linear: weight_scale"):
        fused.quantize_fp8_linear(x, wq, ws[:3], None, torch.bfloat16)


# ---- on the GPU: Llama-3-8B shapes, the table's tilings ---------------------------------------

LLAMA3_8B = {"qkv": (6144, 4096, "add_rms_norm"), "o": (4096, 4096, "plain"),
             "down": (4096, 14336, "silu_and_mul"), "qkv_first": (6144, 4096, "rms_norm"),
             "qkv_offset": (6144, 4096, "add_offset_rms_norm"), "qkv_first_offset": (6144, 4096, "offset_rms_norm"),
             "down_gelu": (4096, 14336, "gelu_tanh_and_mul")}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(LLAMA3_8B))
def test_fused_gemv_llama3_shapes(name):
    n, k, prologue = LLAMA3_8B[name]
    inputs, wq, ws, b = operands(prologue, 1, n, k, torch.bfloat16, bias=name == "qkv", seed=11)
    assert triton_fused.fused_gemv_config(n, k, 1) is not None
    y, summed = run_op(prologue, inputs, wq, ws, b, torch.bfloat16)  # the op, as the graph calls it
    ref, ref_summed = weight_only_reference(prologue, inputs, wq, ws, b)
    assert relative_error(y.cpu(), ref) < 5e-3
    if summed is not None:
        assert torch.equal(summed.cpu(), ref_summed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_gemvs_replay_in_a_cuda_graph():
    # Two fused GEMVs, the second reading the first's output (under PDL where on), captured and replayed:
    # bit-equal to the eager launches.
    n, k = 6144, 4096
    inputs, wq, ws, _ = operands("add_rms_norm", 1, n, k, torch.bfloat16, bias=False, seed=5)
    wo, wos = quantize_fp8_rowwise(randn(k, n, seed=6, scale=n ** -0.5))
    x, r, g = inputs

    def chain():
        y, s = fused.add_rms_norm_fp8_linear(x, r, g, EPS, wq, ws, None, torch.bfloat16)
        return fused.quantize_fp8_linear(y, wo, wos, None, torch.bfloat16), s

    eager = chain()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])
