"""`kiln::linear`'s Triton GEMV against F.linear: small shapes here, Llama-3-8B shapes on the GPU.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before
the kernel module is imported: Triton decides at definition time), with explicit small
blocks so each launch is a handful of programs. The interpreter rounds float32 -> bfloat16
by truncation and its tl.dot on bfloat16 returns garbage (Triton 3.9), so on CPU bfloat16
is checked on the row kernel (M == 1) only, with a tolerance of two bf16 ulps; the dot
kernel's bfloat16 is checked on the GPU (the `gpu` tests at the end).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # stays set: the interpreter reads it at every launch

import kiln.kernels  # noqa: E402,F401  (registers the ops)
import triton  # noqa: E402
from kiln.kernels import triton_linear  # noqa: E402
from kiln.kernels.triton_linear import GEMV_MAX_ROWS, GemvConfig, choose_config, linear_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.triton_kernels  # on a GPU, part of `pytest -m gpu` (tests/conftest.py)
INTERPRETED = DEVICE == "cpu"
SMALL = GemvConfig(block_n=16, block_k=64, num_warps=4, num_stages=2)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dtype)


def operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    # Weights scaled by 1/sqrt(K): outputs of order one, so one tolerance serves every K.
    x = randn(1, m, k, seed=seed, dtype=dtype)
    w = randn(n, k, seed=seed + 1, dtype=dtype, scale=k ** -0.5)
    b = randn(n, seed=seed + 2, dtype=dtype) if bias else None
    return x, w, b


def assert_matches_f_linear(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    ref = F.linear(x, w, b)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    tol = TOL[x.dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def test_kernels_are_interpreted_exactly_when_there_is_no_gpu():
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_linear._gemv_row_kernel, InterpretedFunction) == INTERPRETED
    assert isinstance(triton_linear._gemv_dot_kernel, InterpretedFunction) == INTERPRETED


# N = 40 is not a multiple of BLOCK_N: the last program's columns past N are not stored.
@pytest.mark.parametrize("m", [1, 3, 8, 16, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(m, dtype, bias):
    x, w, b = operands(m, 40, 256, dtype, bias)
    assert_matches_f_linear(linear_triton(x, w, b, SMALL), x, w, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_row_through_the_dot_kernel(dtype, monkeypatch):
    # GemvConfig.dot: one row takes the tl.dot kernel's 16-row tile, the other 15 masked.
    monkeypatch.setattr(triton_linear, "_gemv_row_kernel", None)  # a launch of it would fail
    x, w, b = operands(1, 40, 256, dtype, bias=True, seed=11)
    config = dataclasses.replace(SMALL, dot=True)
    assert_matches_f_linear(linear_triton(x, w, b, config), x, w, b)
    assert choose_config(4096, 4096, 1).dot is False  # the bf16 tables: no sweep has found it faster


@pytest.mark.parametrize("m", [1, 8])
def test_the_64_row_tile(m, monkeypatch):
    # GemvConfig.block_m = 64: the dot kernels' row tile for Hopper's warpgroup MMA (the FP8
    # one on e4m3 operands as they are), rows past M masked; one row goes through it with dot.
    from kiln.kernels import triton_fp8
    from kiln.kernels.fp8 import fp8_linear_reference, quantize_fp8_rows, quantize_fp8_rowwise

    class Recorded:  # the kernel, launched as before, with each launch's keywords kept
        def __init__(self, kernel):
            self.kernel, self.launches = kernel, []

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                self.launches.append(kwargs)
                return self.kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_linear, "_gemv_row_kernel", None)  # a launch of either row kernel fails
    monkeypatch.setattr(triton_fp8, "_fp8_gemv_row_kernel", None)
    bf16_dot, fp8_dot = Recorded(triton_linear._gemv_dot_kernel), Recorded(triton_fp8._fp8_gemv_dot_kernel)
    monkeypatch.setattr(triton_linear, "_gemv_dot_kernel", bf16_dot)
    monkeypatch.setattr(triton_fp8, "_fp8_gemv_dot_kernel", fp8_dot)
    config = dataclasses.replace(SMALL, dot=True, block_m=64)
    x, w, b = operands(m, 40, 256, torch.float32, bias=True, seed=17)
    assert_matches_f_linear(linear_triton(x, w, b, config), x, w, b)
    (xq, xs), (wq, ws) = quantize_fp8_rows(x), quantize_fp8_rowwise(w)
    y = triton_fp8.fp8_linear_triton(xq, xs, wq, ws, b, torch.float32, config=config)
    ref = fp8_linear_reference(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), b.cpu(), torch.float32)
    torch.testing.assert_close(y.cpu(), ref, atol=2e-3, rtol=2e-3)
    assert [k["BLOCK_M"] for k in bf16_dot.launches + fp8_dot.launches] == [64, 64]
    # Its staged tiles count 64 rows, num_stages buffers (+1 for an early tile), as sm_90
    # compiles allocate them (FP8 32 x 512, 4 stages: 196,608 bytes, 245,760 with the early
    # tile, over the H200's 232,448): fewer stages, then shorter K tiles.
    fit = triton_linear.fit_shared_memory
    assert fit(GemvConfig(32, 512, 4, 4, block_m=64), 1, 232448) == GemvConfig(32, 512, 4, 4, block_m=64)
    assert fit(GemvConfig(32, 512, 4, 4, block_m=64), 1, 232448, early_tile=True) == GemvConfig(32, 512, 4, 3, block_m=64)
    assert fit(GemvConfig(32, 512, 4, 4, block_m=64), 1, 101376) == GemvConfig(32, 512, 4, 2, block_m=64)
    assert fit(GemvConfig(32, 512, 4, 4, block_m=64), 1, 90000) == GemvConfig(32, 256, 4, 2, block_m=64)


@pytest.mark.parametrize("m,dot,split_k", [(1, False, 2), (1, True, 4), (8, False, 2), (8, False, 4)])
def test_fp8_gemv_split_k(m, dot, split_k):
    # GemvConfig.split_k: K over split_k programs per column tile, the last to arrive summing
    # the partials in split order. The same products as unsplit, summed in another grouping:
    # equal to the reference within rounding, the same bits on every run (whichever program
    # arrives last), and the arrival counters back at zero for the next launch.
    from kiln.kernels import triton_fp8
    from kiln.kernels.fp8 import fp8_linear_reference, quantize_fp8_rows, quantize_fp8_rowwise
    from kiln.kernels.triton_common import split_k_counters

    x, w, b = operands(m, 40, 512, torch.float32, bias=True, seed=19)
    (xq, xs), (wq, ws) = quantize_fp8_rows(x), quantize_fp8_rowwise(w)
    config = dataclasses.replace(SMALL, dot=dot, split_k=split_k)
    ref = fp8_linear_reference(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), b.cpu(), torch.float32)
    unsplit = triton_fp8.fp8_linear_triton(xq, xs, wq, ws, b, torch.float32, config=dataclasses.replace(config, split_k=1))
    runs = [triton_fp8.fp8_linear_triton(xq, xs, wq, ws, b, torch.float32, config=config) for _ in range(3)]
    torch.testing.assert_close(runs[0].cpu(), ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(runs[0], unsplit, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(runs[0], r) for r in runs[1:])
    if DEVICE == "cuda":
        assert int(split_k_counters(xq.device).count_nonzero()) == 0
    # A split whose share of K the tile does not divide is refused (the reference runs).
    assert triton_linear.fit_block_k(GemvConfig(16, 256, 4, 2, split_k=3), 4096) is None
    assert triton_linear.fit_block_k(GemvConfig(16, 256, 4, 2, split_k=7), 14336) == GemvConfig(16, 256, 4, 2, split_k=7)


@pytest.mark.parametrize("m,n,split_k", [(1, 40, 1), (8, 100, 1), (16, 64, 2), (5, 130, 4)])
def test_fp8_gemv_with_the_weight_as_the_mma_rows(m, n, split_k, monkeypatch):
    # GemvConfig.swap_ab: y^T = W x^T, the weight tile as the MMA's 64 rows and the 1-16 rows
    # of x as its 16 columns (rows past M masked): the reference's output within rounding,
    # stored transposed into y's [M, N] (columns past N masked too), split K included.
    from kiln.kernels import triton_fp8
    from kiln.kernels.fp8 import fp8_linear_reference, quantize_fp8_rows, quantize_fp8_rowwise

    launched = []
    dot = triton_fp8._fp8_gemv_dot_kernel

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((grid, kwargs["SWAP_AB"], kwargs["BLOCK_M"]))
                return dot[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(triton_fp8, "_fp8_gemv_dot_kernel", Recorded())
    x, w, b = operands(m, n, 512, torch.float32, bias=True, seed=23)
    (xq, xs), (wq, ws) = quantize_fp8_rows(x), quantize_fp8_rowwise(w)
    config = GemvConfig(block_n=64, block_k=64, num_warps=4, num_stages=2, swap_ab=True, split_k=split_k)
    y = triton_fp8.fp8_linear_triton(xq, xs, wq, ws, b, torch.float32, config=config)
    ref = fp8_linear_reference(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), b.cpu(), torch.float32)
    assert launched == [((triton.cdiv(n, 64), split_k), True, 16)] and y.shape == ref.shape
    torch.testing.assert_close(y.cpu(), ref, atol=2e-3, rtol=2e-3)


def test_a_tune_gemv_result_overrides_the_fp8_tables_at_its_shapes(tmp_path, monkeypatch):
    # KILN_FP8_GEMV_TUNED: bench/tune_gemv.py --fp8's winners replace the table's tiling at the
    # shapes and row classes the sweep timed (one row; 2-16 rows from the nearest swept count);
    # other shapes keep the tables; a winner of _scaled_mm means no GEMV; a bad file says so.
    import json

    from kiln.kernels import triton_fp8

    swap = {"block_n": 64, "block_k": 512, "num_warps": 4, "num_stages": 4, "dot": False, "block_m": 16,
            "split_k": 2, "swap_ab": True}
    sweep = {"benchmark": "tune_gemv", "fp8": True, "shape_dims": {"o": [4096, 4096], "down": [4096, 14336]},
             "shapes": {"o": {"1": {"best": {"config": "scaled_mm"}}, "8": {"best": {"config": swap}}},
                        "down": {"8": {"best": {"config": swap}}}}}
    path = tmp_path / "tune.json"
    path.write_text(json.dumps(sweep))
    tuned = triton_fp8.load_tuned_gemv_configs(str(path))
    assert tuned[(4096, 4096, 8)] == GemvConfig(**swap) and tuned[(4096, 4096, 1)] is None
    monkeypatch.setattr(triton_fp8, "FP8_GEMV_TUNED", tuned)
    assert triton_fp8.fp8_gemv_config(4096, 4096, 12) == GemvConfig(**swap)
    assert triton_fp8.fp8_gemv_config(4096, 4096, 1) is None  # _scaled_mm won
    assert triton_fp8.fp8_gemv_config(4096, 14336, 1) == triton_fp8.FP8_ROW_TABLE[0][2]  # one row not swept
    assert triton_fp8.fp8_gemv_config(6144, 4096, 8) == triton_fp8.FP8_DOT_TABLE[1][2]  # qkv not swept
    path.write_text(json.dumps({**sweep, "fp8": False}))
    with pytest.raises(ValueError, match="bf16 sweep"):
        triton_fp8.load_tuned_gemv_configs(str(path))
    path.write_text(json.dumps({"shapes": {}}))
    with pytest.raises(ValueError, match="shape_dims"):
        triton_fp8.load_tuned_gemv_configs(str(path))


@pytest.mark.parametrize("m,dot", [(1, False), (1, True), (8, False)])
def test_the_early_weight_tile_changes_no_bit(m, dot, monkeypatch):
    # GEMV_EARLY_TILE: the GEMVs (bf16 one row, FP8 row and dot kernels) load their first K
    # tile of weights before the PDL wait, outside the loop. The products and their order are
    # the loop's, so the output is bit-equal to loading every tile in the loop.
    from kiln.kernels import triton_fp8
    from kiln.kernels.fp8 import quantize_fp8_rows, quantize_fp8_rowwise

    x, w, b = operands(m, 40, 256, torch.float32, bias=True, seed=13)
    (xq, xs), (wq, ws) = quantize_fp8_rows(x), quantize_fp8_rowwise(w)
    config = dataclasses.replace(SMALL, dot=dot)
    outs = {}
    for early in (True, False):
        monkeypatch.setattr(triton_linear, "GEMV_EARLY_TILE", early)
        monkeypatch.setattr(triton_fp8, "GEMV_EARLY_TILE", early)
        outs[early] = (linear_triton(x, w, b, config),
                       triton_fp8.fp8_linear_triton(xq, xs, wq, ws, b, torch.float32, config=config))
    assert_matches_f_linear(outs[True][0], x, w, b)
    torch.testing.assert_close(outs[True][1], F.linear(x, w, b), atol=0.1, rtol=0.1)  # e4m3 operands
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])


@pytest.mark.parametrize("m", [1, 8])
def test_gemv_bfloat16(m):
    if m > 1 and INTERPRETED:
        pytest.skip("the interpreter's tl.dot on bfloat16 is broken; checked on the GPU")
    x, w, b = operands(m, 48, 128, torch.bfloat16, bias=True, seed=3)
    assert_matches_f_linear(linear_triton(x, w, b, SMALL), x, w, b)


@pytest.mark.parametrize("m", [1, 8])
def test_table_configs_at_small_shapes(m):
    # No config given: the table's tiles (BLOCK_K 512 for 2-byte weights, 256 for float32).
    x, w, _ = operands(m, 48, 512, torch.float32, bias=False, seed=5)
    assert choose_config(48, 512, m, element_size=4) is not None
    assert_matches_f_linear(linear_triton(x, w), x, w, None)


def test_strided_rows_and_leading_dims():
    # x as a slice of a wider tensor (a row stride of 2K) with two leading dimensions.
    merged = randn(2, 3, 128, seed=6)
    x = merged[..., :64]
    w = randn(24, 64, seed=7, scale=0.125)
    out = linear_triton(x, w, None, SMALL)
    assert out.shape == (2, 3, 24)
    assert_matches_f_linear(out, x, w, None)
    vec = randn(64, seed=8)  # one-dimensional x, as F.linear allows
    assert_matches_f_linear(linear_triton(vec, w, None, SMALL), vec, w, None)


def test_heuristic_table_holds_the_h200_configs():
    llama = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    row = {"qkv": (16, 512, 8, 4), "o": (4, 1024, 4, 4), "gate_up": (4, 2048, 8, 4), "down": (8, 1024, 4, 4)}
    dot = {"qkv": (64, 256, 4, 4), "o": (32, 512, 4, 4), "gate_up": None, "down": (32, 512, 4, 4),
           "lm_head": (64, 128, 4, 3)}
    llama["lm_head"], row["lm_head"] = (128256, 4096), (4, 2048, 8, 4)
    for name, (n, k) in llama.items():
        assert choose_config(n, k, 1) == GemvConfig(*row[name])
        for m in (2, 8, GEMV_MAX_ROWS):  # gate/up keeps cuBLAS above one row
            assert choose_config(n, k, m) == (GemvConfig(*dot[name]) if dot[name] else None)
    assert choose_config(4096, 4096, GEMV_MAX_ROWS + 1) is None  # cuBLAS from 17 rows
    assert choose_config(4096, 4096, 0) is None
    assert choose_config(4096, 4000, 1) is None  # K not a multiple of BLOCK_K, nor of its halvings to 256
    # A K the table's tile does not divide takes the largest halving that does: 5,120 (Qwen,
    # Mistral-Small hidden sizes), 11,008 (Llama-2-7B's MLP).
    assert choose_config(28672, 5120, 1) == GemvConfig(4, 1024, 8, 4)
    assert choose_config(4096, 11008, 1) == GemvConfig(8, 256, 4, 4)
    assert choose_config(4096, 11008 + 128, 1) is None
    # The FP8 GEMV (one-byte weights) has its own tables (the same sweep), fitted to K the same way.
    from kiln.kernels.triton_fp8 import fp8_gemv_config

    fp8_row = {"qkv": (4, 512, 4, 4), "o": (8, 1024, 8, 3), "gate_up": (128, 256, 8, 3, True), "down": (8, 1024, 8, 3)}
    # 2-16 rows: the weight tile as the MMA's 64 rows, x's rows as its 16 columns (swap_ab),
    # the H200 sweep's best at eight rows (X1-X2).
    fp8_dot = {"qkv": (64, 256, 4, 5), "o": (64, 512, 4, 4), "gate_up": (64, 256, 4, 4), "down": (64, 512, 4, 4)}
    for name, (n, k) in llama.items():
        if name != "lm_head":  # stays bf16 under quantization="fp8"
            assert fp8_gemv_config(n, k, 1) == GemvConfig(*fp8_row[name])
            assert fp8_gemv_config(n, k, 8) == GemvConfig(*fp8_dot[name], swap_ab=True)
    assert fp8_gemv_config(4096, 4608, 1) == GemvConfig(8, 512, 8, 3)  # 4,608 = 9 x 512
    assert fp8_gemv_config(4096, 4096, 17) is None  # _scaled_mm
    # 2-16 rows on a GPU of less shared memory (an L4's 99 KB): fewer stages, then shorter K
    # tiles; the H200's 227 KB holds the tables as they are.
    l4_smem, h200_smem = 101376, 232448
    assert choose_config(4096, 4096, 8, shared_memory=h200_smem) == GemvConfig(32, 512, 4, 4)
    assert choose_config(4096, 4096, 8, shared_memory=l4_smem) == GemvConfig(32, 512, 4, 3)
    assert choose_config(6144, 4096, 8, shared_memory=l4_smem) == GemvConfig(64, 256, 4, 3)
    assert choose_config(4096, 4096, 1, shared_memory=l4_smem) == GemvConfig(4, 1024, 4, 4)  # one row: nothing staged
    # The swap keeps num_stages buffers and one for the early tile, of (16 + 64) x BLOCK_K
    # bytes: gate/up's (4 + 1) x 80 x 256 = 100 KB is just over an L4's 99 KB, 4 x 80 x 256
    # fits; down's 512-wide tile fits at no depth, so 256 at 2 stages. The 64-row tile the
    # same way: (3 + 1) x (64 + 128) x 128 = 96 KB fits.
    swap = functools.partial(GemvConfig, swap_ab=True)
    assert fp8_gemv_config(28672, 4096, 8, shared_memory=l4_smem) == swap(64, 256, 4, 3)
    assert fp8_gemv_config(4096, 14336, 8, shared_memory=l4_smem) == swap(64, 256, 4, 2)
    assert fp8_gemv_config(28672, 4096, 8, shared_memory=64 * 1024) == swap(64, 256, 4, 2)
    assert fp8_gemv_config(28672, 4096, 8, shared_memory=32 * 1024) == swap(64, 128, 4, 2)
    assert triton_linear.fit_shared_memory(GemvConfig(128, 128, 4, 3, block_m=64), 1, l4_smem, early_tile=True) == GemvConfig(128, 128, 4, 3, block_m=64)
    # float32: half the K tile, the same bytes (the bf16 tiles overflow shared memory).
    assert choose_config(4096, 4096, 8, element_size=4) == GemvConfig(32, 256, 4, 4)


class _NoLaunch:
    def __getitem__(self, grid):
        raise AssertionError("the Triton kernel was launched where F.linear was expected")


def test_falls_back_to_f_linear(monkeypatch):
    monkeypatch.setattr(triton_linear, "_gemv_row_kernel", _NoLaunch())
    monkeypatch.setattr(triton_linear, "_gemv_dot_kernel", _NoLaunch())
    x, w, _ = operands(1, 32, 128, torch.float32, bias=False)
    cases = [
        (x, w.t().contiguous().t(), SMALL),                 # weight not contiguous
        (x[..., :96], w[:, :96].contiguous(), SMALL),       # K = 96 not a multiple of 64
        (randn(17, 128, seed=9), w, SMALL),                 # too many rows
        (x.to(torch.float64), w.to(torch.float64), SMALL),  # dtype without a kernel
        (x[:, :0], w, SMALL),                               # no rows
    ]
    for xi, wi, config in cases:
        assert torch.equal(linear_triton(xi, wi, None, config), F.linear(xi, wi))


def test_shape_errors():
    x, w = randn(3, 64, seed=0), randn(16, 64, seed=1)
    bad = [
        ((x, randn(16, 32, seed=2), None), "does not match the last dimension"),
        ((x, randn(64, seed=2), None), "must be 2-D"),
        ((x, w, randn(8, seed=3)), "bias of shape"),
        ((x, w.to(torch.float16), None), "share a dtype"),
        ((torch.tensor(1.0, device=DEVICE), w, None), "at least one dimension"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            linear_triton(*args)
        with pytest.raises(ValueError, match=message):
            torch.ops.kiln.linear(*args)


@pytest.mark.parametrize("bias", [False, True])
def test_op_is_f_linear_and_passes_opcheck(bias):
    x, w, b = operands(3, 16, 32, torch.float32, bias)
    x, w, b = x.cpu(), w.cpu(), (b.cpu() if b is not None else None)
    assert torch.equal(torch.ops.kiln.linear(x, w, b), F.linear(x, w, b))
    torch.library.opcheck(torch.ops.kiln.linear.default, (x, w, b), test_utils=("test_schema", "test_faketensor"))


# ---- on the GPU: the Llama-3-8B decode shapes, the op's dispatch, CUDA-graph capture -------------

LLAMA3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
             "lm_head": (128256, 4096)}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("name", list(LLAMA3_8B))
def test_gpu_llama3_8b_decode_shapes(name, m):
    n, k = LLAMA3_8B[name]
    x, w, _ = operands(m, n, k, torch.bfloat16, bias=False, seed=11)
    config = choose_config(n, k, m)
    if config is None:  # gate/up above one row: the engine uses cuBLAS; the kernel is checked anyway
        assert name == "gate_up"
        config = GemvConfig(64, 128, 4, 3)
    else:  # the op dispatches to this very kernel on CUDA
        assert torch.equal(torch.ops.kiln.linear(x, w), linear_triton(x, w))
    out = linear_triton(x, w, config=config)
    ref = F.linear(x.float(), w.float())
    # Both sides accumulate in fp32 and round once: within two bf16 ulps of the exact product.
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 5e-3


@pytest.mark.gpu
def test_gpu_gemv_replays_in_a_cuda_graph():
    x, w, b = operands(8, 4096, 4096, torch.bfloat16, bias=True, seed=12)
    static_x = x.clone()
    linear_triton(static_x, w, b)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = linear_triton(static_x, w, b)
    static_x.copy_(randn(1, 8, 4096, seed=13, dtype=torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(static_out, linear_triton(static_x, w, b), atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8])
def test_gpu_fp8_split_k_replays_in_a_cuda_graph(m):
    # Two split-K GEMVs back to back (as o and down are in a step), replayed many times from
    # one graph under PDL: each replay's arrival counts start from zero, and the output is the
    # eager launch's, bit for bit.
    from kiln.kernels import triton_fp8
    from kiln.kernels.fp8 import quantize_fp8_rows, quantize_fp8_rowwise
    from kiln.kernels.triton_common import split_k_counters

    x, w1, _ = operands(m, 4096, 4096, torch.bfloat16, bias=False, seed=21)
    _, w2, _ = operands(m, 4096, 4096, torch.bfloat16, bias=False, seed=22)
    (wq1, ws1), (wq2, ws2) = quantize_fp8_rowwise(w1), quantize_fp8_rowwise(w2)
    config = GemvConfig(32 if m > 1 else 8, 512, 4, 3, split_k=4)

    def step(x):
        xq, xs = quantize_fp8_rows(x)
        h = triton_fp8.fp8_linear_triton(xq, xs, wq1, ws1, None, torch.bfloat16, config=config)
        hq, hs = quantize_fp8_rows(h)
        return triton_fp8.fp8_linear_triton(hq, hs, wq2, ws2, None, torch.bfloat16, config=config)

    static_x = x.clone()
    step(static_x)  # compile, and allocate the counters, outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x)
    for seed in range(30, 50):
        static_x.copy_(randn(1, m, 4096, seed=seed, dtype=torch.bfloat16))
        graph.replay()
        torch.testing.assert_close(static_out, step(static_x), atol=0, rtol=0)
    torch.cuda.synchronize()
    assert int(split_k_counters(x.device).count_nonzero()) == 0
