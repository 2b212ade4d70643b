"""Each Triton kernel against its plain-torch reference on random inputs, small shapes.

Without a GPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below
before the kernel modules are imported: Triton decides at definition time); with one they
run compiled on it. Shapes are tiny because the interpreter executes every program in
Python. Real shapes are in test_gpu_kernels.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Stays set for the session: the interpreter reads it again at every launch.
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402  (after TRITON_INTERPRET: triton.language's own jit functions are defined at import)
import triton.language as tl  # noqa: E402

from kiln.kernels.activation import gelu_tanh_and_mul_reference, silu_and_mul_reference  # noqa: E402
from kiln.kernels.paged_attention import paged_attention_reference  # noqa: E402
from kiln.kernels.rms_norm import add_rms_norm_reference, rms_norm_reference  # noqa: E402
from kiln.kernels.rope import rope_reference  # noqa: E402
from kiln.kernels.triton_activation import gelu_tanh_and_mul_triton, silu_and_mul_triton  # noqa: E402
from kiln.kernels.triton_common import converts_e4m3_in_hardware  # noqa: E402
from kiln.kernels.triton_norm import add_rms_norm_triton, rms_norm_triton  # noqa: E402
from kiln.kernels.triton_paged_attention import (LATENT_TILING, SMALL_DECODE_ROWS_16BIT_BLOCK_N,  # noqa: E402
                                                 SMALL_DECODE_ROWS_BLOCK_N, AttentionTiling,
                                                 attend_paged_triton, choose_num_splits, choose_tiling,
                                                 paged_attention_triton, rope_paged_attention_triton)
from kiln.kernels.triton_paged_decode_fp8 import _key_range, _reads_a_new_key  # noqa: E402
from kiln.kernels.triton_rope import rope_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.triton_kernels  # on a GPU, part of `pytest -m gpu` (tests/conftest.py)


def test_kernels_run_where_this_machine_can():
    # Without a GPU every kernel must have been defined under the interpreter (a module
    # imported earlier without TRITON_INTERPRET=1 would need a GPU to launch).
    from triton.runtime.interpreter import InterpretedFunction

    from kiln.kernels import triton_norm, triton_paged_attention

    interpreted = isinstance(triton_paged_attention._paged_attention_kernel, InterpretedFunction)
    assert interpreted == (DEVICE == "cpu")
    assert isinstance(triton_norm._rms_norm_kernel, InterpretedFunction) == interpreted


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(device=DEVICE, dtype=dtype)


# ---- RMSNorm ---------------------------------------------------------------------------------

def assert_mostly_bit_exact(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Half-precision results must round where the eager graph rounds: nearly every element
    is bit-identical (a last-place flip from a float32 rsqrt/exp of another library is fine,
    a missing or extra rounding step is not)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    differing = (out != ref).float().mean().item()
    assert differing <= 0.01, f"{differing:.1%} of elements differ from the reference"


# Triton's interpreter rounds float32 -> bfloat16 by truncation (and, in Triton 3.9, its
# tl.dot on bfloat16 operands returns garbage), so half precision is checked in float16 on
# CPU; bfloat16 is checked on the GPU (test_gpu_kernels.py).
HALF = torch.float16


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_rms_norm_matches_reference(dtype):
    x, w = randn(5, 48, seed=0, dtype=dtype), randn(48, seed=1, dtype=dtype)
    out = rms_norm_triton(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    assert out.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        assert_mostly_bit_exact(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_offset_rms_norm_matches_reference(dtype):
    """Gemma's / Qwen3-Next's form (`kiln::offset_rms_norm`), alone and after the residual add."""
    from kiln.kernels.rms_norm import add_offset_rms_norm_reference, offset_rms_norm_reference
    from kiln.kernels.triton_norm import add_offset_rms_norm_triton, offset_rms_norm_triton

    x, r, w = randn(1, 6, 40, seed=7, dtype=dtype), randn(1, 6, 40, seed=8, dtype=dtype), randn(40, seed=9, dtype=dtype)
    out = offset_rms_norm_triton(x, w, 1e-6, 1.0)
    add_out, summed = add_offset_rms_norm_triton(x, r, w, 1e-6, 1.0)
    ref, (ref_add, ref_sum) = offset_rms_norm_reference(x, w, 1e-6, 1.0), add_offset_rms_norm_reference(x, r, w, 1e-6, 1.0)
    assert out.dtype == add_out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(summed, ref_sum, atol=0, rtol=0)
    for got, want in ((out, ref), (add_out, ref_add)):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            assert_mostly_bit_exact(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_gated_rms_norm_matches_reference(dtype):
    """Qwen3-Next's gated norm over value heads, the gate a strided slice of a wider projection."""
    from kiln.kernels.rms_norm import gated_rms_norm_reference
    from kiln.kernels.triton_norm import gated_rms_norm_triton

    x, w = randn(3, 4, 24, seed=10, dtype=dtype), randn(24, seed=11, dtype=dtype)
    gate = randn(3, 2 * 4 * 24, seed=12, dtype=dtype)[:, 4 * 24:].view(3, 4, 24)
    out, ref = gated_rms_norm_triton(x, gate, w, 1e-6), gated_rms_norm_reference(x, gate, w, 1e-6)
    assert out.dtype == dtype and out.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    else:
        assert_mostly_bit_exact(out, ref)


def test_rms_norm_on_strided_head_view():
    # Qwen3's q norm after a merged QKV projection: the q heads are a strided slice.
    t, h, d = 3, 4, 16
    merged = randn(1, t, 3 * h * d, seed=2)
    q = merged[..., : h * d].view(1, t, h, d)
    w = randn(d, seed=3)
    torch.testing.assert_close(rms_norm_triton(q, w, 1e-6), rms_norm_reference(q, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_add_rms_norm_matches_reference(dtype):
    x, r, w = (randn(1, 6, 40, seed=4, dtype=dtype), randn(1, 6, 40, seed=5, dtype=dtype),
               randn(40, seed=6, dtype=dtype))
    out, summed = add_rms_norm_triton(x, r, w, 1e-5)
    ref_out, ref_sum = add_rms_norm_reference(x, r, w, 1e-5)
    torch.testing.assert_close(summed, ref_sum, atol=0, rtol=0)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    else:
        assert_mostly_bit_exact(out, ref_out)


# ---- RoPE (+ q/k norm) -------------------------------------------------------------------------

def _cos_sin(t: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 100, (t,), generator=_gen(seed)).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(DEVICE), emb.sin().to(DEVICE)


@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_matches_reference(with_norm):
    t, hq, hkv, d = 5, 4, 2, 16
    # q as the graph hands it: [T, H, D] view of a [1, H, T, D] tensor (non-contiguous).
    q = randn(1, hq, t, d, seed=7)[0].transpose(0, 1)
    k = randn(t, hkv, d, seed=8)
    cos, sin = _cos_sin(t, d, seed=9)
    qw = randn(d, seed=10) if with_norm else None
    kw = randn(d, seed=11) if with_norm else None
    q_out, k_out = rope_triton(q, k, cos, sin, qw, kw, 1e-6)
    q_ref, k_ref = rope_reference(q, k, cos, sin, qw, kw, 1e-6)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_partial_rope_matches_reference(with_norm, dtype):
    """Partial rotary: the first R = D/4 dims of each head rotated (cos/sin [T, R]), the rest
    passed unchanged (normalised first with the q/k norm)."""
    t, hq, hkv, d, r = 5, 4, 2, 32, 8
    q = randn(1, hq, t, d, seed=17, dtype=dtype)[0].transpose(0, 1)
    k = randn(t, hkv, d, seed=18, dtype=dtype)
    cos, sin = (x.to(dtype) for x in _cos_sin(t, r, seed=19))
    qw = randn(d, seed=20, dtype=dtype) if with_norm else None
    kw = randn(d, seed=21, dtype=dtype) if with_norm else None
    outs, refs = rope_triton(q, k, cos, sin, qw, kw, 1e-6), rope_reference(q, k, cos, sin, qw, kw, 1e-6)
    for out, ref in zip(outs, refs):
        if dtype == torch.float32:
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        else:
            assert_mostly_bit_exact(out, ref)
    if not with_norm:  # the passed dims are the input's, bit for bit
        torch.testing.assert_close(outs[0][..., r:], q[..., r:], atol=0, rtol=0)


@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_rounds_like_the_eager_graph(with_norm):
    t, hq, hkv, d = 4, 4, 2, 32
    q, k = randn(t, hq, d, seed=12, dtype=HALF), randn(t, hkv, d, seed=13, dtype=HALF)
    cos, sin = (x.to(HALF) for x in _cos_sin(t, d, seed=14))
    qw = randn(d, seed=15, dtype=HALF) if with_norm else None
    kw = randn(d, seed=16, dtype=HALF) if with_norm else None
    for out, ref in zip(rope_triton(q, k, cos, sin, qw, kw, 1e-6), rope_reference(q, k, cos, sin, qw, kw, 1e-6)):
        assert_mostly_bit_exact(out, ref)


# Compiles `_rope_kernel` for an H100/H200 (sm_90) with the launcher's options and lists the
# PTX instructions that multiply or add. Compiling needs no GPU (Triton ships ptxas), but it
# needs the kernel defined without the interpreter, hence a fresh process.
_ROPE_PTX_SCRIPT = """
import itertools, json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels.triton_rope import COMPILE_OPTIONS, _rope_kernel as fn
found = {}
variants = [(n, w, f, -1, False) for n, w, f in itertools.product([False, True], repeat=3) if w or not f]
# then partial rotary, and the OLMo family's float32 tables (the op's float32 outputs; the cache write)
variants += [(True, False, False, 64, False), (False, False, False, -1, True), (False, True, False, -1, True)]
for has_norm, write_kv, fp8, rot_dim, f32 in variants:
    scalar_types = {"slot_ptr": "*i64", "kv_scale_ptr": "*fp32", "n_q_heads": "i32", "n_k_heads": "i32",
                    "eps": "fp32", **({"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv"} if fp8 else {}),
                    **({"cos_ptr": "*fp32", "sin_ptr": "*fp32"} if f32 else {}),
                    **({"q_out_ptr": "*fp32", "k_out_ptr": "*fp32"} if f32 and not write_kv else {})}
    consts = dict(HEAD_DIM=128, D_PAD=128, HQ_PAD=32, HK_PAD=8, HAS_NORM=has_norm, WRITE_KV=write_kv,
                  CACHE_BLOCK=16, KV_SCALE=fp8, ROT_DIM=rot_dim, F32_TABLES=f32)
    signature = {name: "constexpr" if name in consts else
                 scalar_types.get(name, "*bf16" if name.endswith("_ptr") else "i64") for name in fn.arg_names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, **COMPILE_OPTIONS}).asm["ptx"]
    ops = {line.split()[0] for line in ptx.splitlines() if line.strip()[:4] in ("fma.", "mul.", "add.", "cvt.")}
    found[f"norm={has_norm},write_kv={write_kv},fp8_cache={fp8},rot_dim={rot_dim},f32_tables={f32}"] = sorted(ops)
print(json.dumps(found))
"""


def test_rope_kernel_compiles_without_fma_contraction():
    """Regression (H200, bf16): with Triton's default FP contraction, LLVM fused `x * cos`
    (rounded to bf16) and the following add into `fma.rn.bf16`, skipping the rounding the
    eager graph does, and ~17% of outputs differed from it. The interpreter never contracts,
    so this is checked on the kernel compiled for sm_90."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the launcher's options must turn it off themselves
    proc = subprocess.run([sys.executable, "-c", _ROPE_PTX_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for variant, ops in json.loads(proc.stdout.strip().splitlines()[-1]).items():
        assert any(op.startswith("mul.") for op in ops), f"{variant}: no multiply found in the PTX: {ops}"
        assert not [op for op in ops if op.startswith("fma")], f"{variant}: FMA in the PTX: {ops}"


def test_rope_rejects_bad_shapes():
    q, k = randn(3, 2, 16, seed=0), randn(3, 1, 16, seed=1)
    cos, sin = _cos_sin(4, 16, seed=2)
    with pytest.raises(ValueError, match="cos/sin"):
        rope_triton(q, k, cos, sin, None, None, 1e-6)


# ---- SiLU-and-mul ------------------------------------------------------------------------------

@pytest.mark.parametrize("affine,dtype", [(True, torch.float32), (False, torch.float32), (True, HALF)])
def test_add_layer_norm(affine, dtype):
    from kiln.kernels.layer_norm import add_layer_norm_reference
    from kiln.kernels.triton_norm import add_layer_norm_triton

    # 40 columns (not a power of two: masked lanes must not enter the mean or variance).
    x, residual = randn(3, 5, 40, seed=51, dtype=dtype) * 2 + 1, randn(3, 5, 40, seed=52, dtype=dtype)
    weight, bias = (randn(40, seed=53, dtype=dtype), randn(40, seed=54, dtype=dtype)) if affine else (None, None)
    out, summed = add_layer_norm_triton(x, residual, weight, bias, 1e-5)
    ref_out, ref_summed = add_layer_norm_reference(x, residual, weight, bias, 1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)


def test_gelu_tanh_and_mul_on_merged_halves():
    # Gemma's gated MLP: the two halves of a merged gate/up projection, read in place.
    merged = randn(6, 2 * 40, seed=41) * 3
    gate, up = merged[:, :40], merged[:, 40:]
    out = gelu_tanh_and_mul_triton(gate, up)
    torch.testing.assert_close(out, gelu_tanh_and_mul_reference(gate, up), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(out, silu_and_mul_reference(gate, up), atol=1e-2)  # really GELU, not SiLU


def test_silu_and_mul_on_merged_halves():
    t, inter = 7, 40
    merged = randn(1, t, 2 * inter, seed=12)
    gate, up = merged[..., :inter], merged[..., inter:]
    out = silu_and_mul_triton(gate, up)
    assert out.is_contiguous() and out.shape == (1, t, inter)
    torch.testing.assert_close(out, silu_and_mul_reference(gate, up), atol=1e-6, rtol=1e-5)
    half = merged.to(HALF)
    assert_mostly_bit_exact(silu_and_mul_triton(half[..., :inter], half[..., inter:]),
                            silu_and_mul_reference(half[..., :inter], half[..., inter:]))


# ---- paged attention ---------------------------------------------------------------------------

def make_paged_batch(new_tokens: list[int], cached: list[int], hq: int, hkv: int, d: int, block_size: int,
                     num_blocks: int, pad_tokens: int = 0, seed: int = 0, dtype: torch.dtype = torch.float32,
                     device: str = DEVICE) -> dict:
    """A packed step: sequence i brings new_tokens[i] after cached[i] tokens already in the cache.

    Blocks are handed out in a shuffled order so block tables are not the identity; block 0
    stays the null block. A sequence with 0 new tokens is a padded batch slot (seq_len 0).
    """
    g = _gen(seed)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables, slots, seq_lens = [], [], []
    starts = [0]
    for n, c in zip(new_tokens, cached):
        total = n + c if n else 0
        need = -(-total // block_size)
        blocks = [perm.pop() for _ in range(need)]
        tables.append(blocks)
        seq_lens.append(total)
        starts.append(starts[-1] + n)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    t = starts[-1] + pad_tokens
    slots += [0] * pad_tokens
    width = max(1, max(len(b) for b in tables)) + 1  # wider than needed, like a static buffer
    block_tables = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, b in enumerate(tables):
        block_tables[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
    kv_cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(dtype)
    kv_cache[:, 0] = 0
    # Never-written slots may hold anything, NaN included: the kernel must not read them.
    for blocks, total in zip(tables, seq_lens):
        for p in range(total, len(blocks) * block_size):
            kv_cache[:, blocks[p // block_size], p % block_size] = float("nan")
    return dict(
        q=torch.randn(t, hq, d, generator=g).to(device=device, dtype=dtype),
        k=torch.randn(t, hkv, d, generator=g).to(device=device, dtype=dtype),
        v=torch.randn(t, hkv, d, generator=g).to(device=device, dtype=dtype),
        kv_cache=kv_cache.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
    )


def _row_owners(batch: dict) -> list[tuple[int, int] | None]:
    """For each token row of the step: (sequence, position in it), or None for a padded row."""
    starts = batch["query_start_loc"].tolist()
    lens = batch["seq_lens"].tolist()
    owners: list[tuple[int, int] | None] = [None] * batch["q"].shape[0]
    for i, seq_len in enumerate(lens):
        n_new = starts[i + 1] - starts[i]
        for j in range(n_new):
            owners[starts[i] + j] = (i, seq_len - n_new + j)
    return owners


def attention_mismatch_report(out: torch.Tensor, ref: torch.Tensor, batch: dict, atol: float, rtol: float,
                              limit: int = 12) -> str:
    """'' when out and ref are close; else which sequences, positions and heads differ."""
    bad = ~torch.isclose(out.float(), ref.float(), atol=atol, rtol=rtol)  # NaN anywhere counts as bad
    if not bad.any():
        return ""
    diff = (out.float() - ref.float()).abs().nan_to_num(float("inf"))
    owners = _row_owners(batch)
    starts = batch["query_start_loc"].tolist()
    lens = batch["seq_lens"].tolist()
    bad_rows = bad.any(-1)  # [T, Hq]
    lines = [f"attention output: {int(bad.sum())} of {bad.numel()} elements differ (atol={atol}, rtol={rtol}), "
             f"in {int(bad_rows.sum())} (token, head) pairs; max |diff| {diff.max().item():.4g}"]
    per_seq: dict[object, list[tuple[int, int, int, float]]] = {}
    for t, h in bad_rows.nonzero().tolist():
        owner = owners[t]
        key = "padded rows" if owner is None else owner[0]
        per_seq.setdefault(key, []).append((t, -1 if owner is None else owner[1], h, diff[t, h].max().item()))
    for key, rows in per_seq.items():
        if key == "padded rows":
            head = "padded rows (must be zero)"
        else:
            n_new = starts[key + 1] - starts[key]
            head = f"sequence {key} (new {n_new}, cached {lens[key] - n_new}, seq_len {lens[key]})"
        positions = sorted({r[1] for r in rows})
        lines.append(f"  {head}: {len(rows)} (token, head) pairs, positions {_ranges(positions)}, "
                     f"heads {_ranges(sorted({r[2] for r in rows}))}")
        for t, pos, h, d in rows[:limit]:
            lines.append(f"    token row {t} position {pos} head {h}: max |diff| {d:.4g}")
    return "\n".join(lines)


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7' (at most 20 runs)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:20])
    return text + (f", ... ({len(runs)} runs)" if len(runs) > 20 else "")


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor, batch: dict, atol: float, rtol: float) -> None:
    report = attention_mismatch_report(out, ref, batch, atol, rtol)
    assert not report, report


def assert_cache_matches(cache: torch.Tensor, ref_cache: torch.Tensor, batch: dict, atol: float = 0.0,
                         rtol: float = 0.0, limit: int = 12) -> None:
    """Every cache block but the null block matches the reference (never-written NaN slots
    compare equal); on failure, says which slots differ and whose they are.

    The null block (0) is left out on purpose: every padded token writes its K/V to slot 0
    of it, several per step, so what it holds afterwards is whichever write lands last. On a
    GPU that is not the reference's choice (the Triton write programs race, and CUDA's
    index_copy_ with repeated indices is itself nondeterministic); no sequence owns the null
    block and no kernel reads it, so its content is unspecified by the op's contract."""
    good = torch.isclose(cache[:, 1:].float(), ref_cache[:, 1:].float(), atol=atol, rtol=rtol, equal_nan=True)
    if good.all():
        return
    block_size = cache.shape[2]
    slot_rows = {s: t for t, s in enumerate(batch["slot_mapping"].tolist())}
    owner_of_block = {b: (i, j) for i, row in enumerate(batch["block_tables"].tolist())
                      for j, b in enumerate(row[: -(-batch["seq_lens"][i].item() // block_size)])}
    bad_slots = (~good).any(-1)  # [2, num_blocks - 1, block_size, Hkv]
    lines = [f"KV cache outside the null block: {int((~good).sum())} elements differ (atol={atol}, rtol={rtol}) "
             f"in {int(bad_slots.sum())} (K/V, slot, head) triples"]
    for kv, b, off, h in bad_slots.nonzero().tolist()[:limit]:
        block = b + 1
        slot = block * block_size + off
        owner = owner_of_block.get(block)
        whose = "no sequence" if owner is None else f"sequence {owner[0]} position {owner[1] * block_size + off}"
        written = f"written this step by token row {slot_rows[slot]}" if slot in slot_rows else "not written this step"
        lines.append(f"  {'KV'[kv]} block {block} offset {off} head {h}: {whose}, {written}; "
                     f"got {cache[kv, block, off, h, :4].tolist()}..., expected {ref_cache[kv, block, off, h, :4].tolist()}...")
    raise AssertionError("\n".join(lines))


def check_paged_attention(batch: dict, scale: float, window: int, num_splits: int | None,
                          atol: float = 2e-5, rtol: float = 2e-5, tiling: AttentionTiling | None = None,
                          softcap: float = 0.0, alibi_slopes: torch.Tensor | None = None,
                          sinks: torch.Tensor | None = None) -> None:
    ref_batch = {k: v.clone() for k, v in batch.items()}
    out = paged_attention_triton(**batch, scale=scale, sliding_window=window, num_splits=num_splits, tiling=tiling,
                                 softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    ref = paged_attention_reference(**ref_batch, scale=scale, sliding_window=window, softcap=softcap,
                                    alibi_slopes=alibi_slopes, sinks=sinks)
    assert_attention_close(out, ref, batch, atol, rtol)
    # The cache after the write must match too (the write is a copy: exactly).
    assert_cache_matches(batch["kv_cache"], ref_batch["kv_cache"], batch)


# A step mixing a prefill continuing a cached prefix, a fresh prefill, two decodes and a
# padded batch slot, followed by padded tokens.
MIXED = dict(new_tokens=[5, 9, 1, 1, 0], cached=[11, 0, 12, 3, 0], pad_tokens=2)


def test_cache_check_ignores_only_the_null_block():
    # Padded tokens race for the null block's slot 0 on a GPU: its content is unspecified and
    # left out; a wrong value anywhere else, even in a slot nobody wrote this step, fails.
    batch = make_paged_batch(**MIXED, hq=4, hkv=2, d=16, block_size=4, num_blocks=24, seed=5)
    cache = batch["kv_cache"]
    other = cache.clone()
    other[:, 0, 0] = 1.5
    assert_cache_matches(other, cache, batch)
    owned = batch["block_tables"][0, 0].item()
    other[1, owned, 2, 1, 3] += 1
    with pytest.raises(AssertionError, match=f"V block {owned} offset 2 head 1: sequence 0 position 2, "
                                             "not written this step"):
        assert_cache_matches(other, cache, batch)


@pytest.mark.parametrize("hq,hkv,block_size,splits", [
    (4, 2, 4, 1),    # GQA, one pass over the KV
    (4, 2, 4, 3),    # split-K with a combine
    (6, 2, 16, 2),   # group of 3 (padded to 4 in the tile), block size 16
    (2, 2, 8, 1),    # MHA
])
def test_paged_attention_mixed_step(hq, hkv, block_size, splits):
    batch = make_paged_batch(**MIXED, hq=hq, hkv=hkv, d=16, block_size=block_size, num_blocks=24, seed=hq + splits)
    check_paged_attention(batch, scale=0.25, window=0, num_splits=splits)


def test_paged_attention_sliding_window():
    batch = make_paged_batch(new_tokens=[6, 1], cached=[10, 17], hq=4, hkv=2, d=16, block_size=4, num_blocks=16,
                             seed=3)
    check_paged_attention(batch, scale=0.25, window=5, num_splits=2)


@pytest.mark.parametrize("chunk,splits,block_size", [(5, 1, 4), (5, 3, 4), (8, 2, 4), (3, 1, 16)])
def test_paged_attention_chunked(chunk, splits, block_size):
    # Llama 4's chunked attention (sliding_window = -chunk): each query sees its own chunk of
    # positions up to itself. Prefill chunks that cross chunk boundaries, decodes at and past
    # one; the chunk must change the result (against a global layer) or the test says nothing.
    batch = make_paged_batch(**MIXED, hq=4, hkv=2, d=16, block_size=block_size, num_blocks=24,
                             seed=61 + chunk + splits)
    plain = paged_attention_reference(**{k: v.clone() for k, v in batch.items()}, scale=0.25, sliding_window=0)
    chunked = paged_attention_reference(**{k: v.clone() for k, v in batch.items()}, scale=0.25,
                                        sliding_window=-chunk)
    assert (chunked - plain).abs().max() > 1e-2
    check_paged_attention(batch, scale=0.25, window=-chunk, num_splits=splits)


@pytest.mark.parametrize("hkv,window,splits", [
    (2, 0, 1),   # GQA, global layer
    (1, 5, 2),   # multi-query, windowed layer, split-K
])
def test_paged_attention_softcap(hkv, window, splits):
    # Gemma 2's logit soft-capping; scale 2 pushes logits well into tanh's saturated range,
    # so a kernel that skipped or misplaced the cap (after the mask, before the scale) fails.
    batch = make_paged_batch(**MIXED, hq=4, hkv=hkv, d=16, block_size=4, num_blocks=24, seed=31 + hkv)
    ref_batch = {k: v.clone() for k, v in batch.items()}
    uncapped = paged_attention_reference(**ref_batch, scale=2.0, sliding_window=window)
    capped = paged_attention_reference(**{k: v.clone() for k, v in batch.items()}, scale=2.0, sliding_window=window,
                                       softcap=1.5)
    assert (capped - uncapped).abs().max() > 1e-2  # the cap changes the result at this scale
    check_paged_attention(batch, scale=2.0, window=window, num_splits=splits, softcap=1.5)


@pytest.mark.parametrize("hq,hkv,splits", [
    (4, 4, 1),   # MHA (Bloom, MPT), prefill chunks and decodes in one pass
    (4, 1, 3),   # multi-query (Falcon-RW style), split-K with a combine
    (6, 2, 2),   # grouped heads padded in the tile: each row must get its own head's slope
])
def test_paged_attention_alibi(hq, hkv, splits):
    # ALiBi slopes as Bloom's formula gives them, scaled up so the bias dominates the logits:
    # a kernel that used the wrong head's slope, the wrong sign or absolute positions fails.
    batch = make_paged_batch(**MIXED, hq=hq, hkv=hkv, d=16, block_size=4, num_blocks=24, seed=41 + hq + hkv)
    slopes = 4.0 * 2.0 ** (-8.0 * torch.arange(1, hq + 1, dtype=torch.float32) / hq)
    slopes = slopes.to(batch["q"].device)
    plain = paged_attention_reference(**{k: v.clone() for k, v in batch.items()}, scale=0.25, sliding_window=0)
    biased = paged_attention_reference(**{k: v.clone() for k, v in batch.items()}, scale=0.25, sliding_window=0,
                                       alibi_slopes=slopes)
    assert (biased - plain).abs().max() > 1e-2  # the bias changes the result at these slopes
    check_paged_attention(batch, scale=0.25, window=0, num_splits=splits, alibi_slopes=slopes)


@pytest.mark.parametrize("hq,hkv,window,splits", [
    (4, 2, 0, 1),   # GQA, one pass: every row starts at its head's sink
    (4, 2, 5, 3),   # windowed (GPT-OSS's alternate layers), split-K: the sink counted once over the splits
    (6, 2, 0, 2),   # grouped heads padded in the tile: each row must get its own head's sink
])
def test_paged_attention_sinks(hq, hkv, window, splits):
    # GPT-OSS's attention sinks, large enough to take most of the probability in some heads
    # and none in others: a kernel that dropped a sink, counted it in every split or read
    # another head's fails.
    batch = make_paged_batch(**MIXED, hq=hq, hkv=hkv, d=16, block_size=4, num_blocks=24, seed=61 + hq + splits)
    sinks = torch.linspace(-4.0, 3.0, hq).to(batch["q"].device)
    plain = paged_attention_reference(**{k: v.clone() for k, v in batch.items()}, scale=0.25, sliding_window=window)
    sunk = paged_attention_reference(**{k: v.clone() for k, v in batch.items()}, scale=0.25, sliding_window=window,
                                     sinks=sinks)
    assert (sunk - plain).abs().max() > 1e-2
    check_paged_attention(batch, scale=0.25, window=window, num_splits=splits, sinks=sinks)
    # In half precision with a bf16 sink parameter (as the model holds it) too.
    half = make_paged_batch(**MIXED, hq=hq, hkv=hkv, d=16, block_size=4, num_blocks=24, seed=62, dtype=HALF)
    check_paged_attention(half, scale=0.25, window=window, num_splits=splits, sinks=sinks.to(HALF),
                          atol=2e-3, rtol=2e-3)


def test_paged_attention_half_precision():
    batch = make_paged_batch(**MIXED, hq=4, hkv=2, d=16, block_size=4, num_blocks=24, seed=9, dtype=HALF)
    check_paged_attention(batch, scale=0.25, window=0, num_splits=2, atol=2e-3, rtol=2e-3)


def test_paged_attention_decode_heuristic_splits():
    # Decode of 2 sequences on a "GPU" of 4 SMs: the heuristic splits, and the result holds.
    batch = make_paged_batch(new_tokens=[1, 1], cached=[30, 7], hq=4, hkv=2, d=32, block_size=8, num_blocks=12,
                             seed=4)
    assert choose_num_splits(2, 2, 2, 4, 64, kv_capacity=batch["block_tables"].shape[1] * 8, num_sms=4) == 1
    assert choose_num_splits(2, 2, 2, 4, 64, kv_capacity=4096, num_sms=132) == 16
    assert choose_num_splits(2048, 1, 8, 16, 64, kv_capacity=4096, num_sms=132) == 1
    check_paged_attention(batch, scale=32 ** -0.5, window=0, num_splits=None)


def test_paged_attention_latent_shape():
    """Multi-head latent attention over its latent: one KV head that 16 query heads read,
    head dim over 256 (DeepSeek's 576 scaled down to 288: padded to 512), in its own
    tiling (`LATENT_TILING`, chosen for every step shape there), split and not, over a
    one-plane cache."""
    assert choose_tiling(5, 2, 512, 232448, fills_gpu=False) == LATENT_TILING
    assert choose_tiling(8000, 256, 1024, 232448, fills_gpu=True, fp8_cache=True, e4m3_mma=True) == LATENT_TILING
    batch = make_paged_batch(new_tokens=[3, 1, 0], cached=[5, 9, 0], pad_tokens=1, hq=16, hkv=1, d=288, block_size=4,
                             num_blocks=12, seed=7)
    # The latent cache's one plane, read as both K and V (the op's k and v are one tensor).
    batch["kv_cache"], batch["v"] = batch["kv_cache"][:1].clone(), batch["k"]
    for splits in (1, 2):
        check_paged_attention({k: v.clone() for k, v in batch.items()}, scale=288 ** -0.5, window=0,
                              num_splits=splits, tiling=LATENT_TILING)


@pytest.mark.parametrize("hq,hkv,steps", [(16, 1, "mixed"), (40, 1, "decode"), (40, 2, "mixed"), (8, 1, "decode")])
def test_paged_latent_attention_kernel(hq, hkv, steps):
    """The latent kernel (`kiln.kernels.triton_paged_latent`: the head dim as 256 + 32 here,
    DeepSeek's 512 + 64 scaled down; the keys read once as K and V), which a one-plane cache
    takes by default: against the reference over mixed and decode-shaped steps with padded
    tokens, split and not, with a group wider than a program's 16 heads (40: three head
    blocks, the last partial), two KV heads, and a group narrower than 16."""
    from kiln.kernels.triton_paged_latent import latent_dims, latent_kernel_applies, latent_tiling

    assert latent_dims(576) == (512, 64) and latent_dims(288) == (256, 32) and latent_dims(300) is None
    shape = MIXED if steps == "mixed" else dict(new_tokens=[1, 1, 1, 0], cached=[6, 13, 2, 0], pad_tokens=2)
    batch = make_paged_batch(**shape, hq=hq, hkv=hkv, d=288, block_size=4, num_blocks=40, seed=hq + hkv)
    batch["kv_cache"], batch["v"] = batch["kv_cache"][:1].clone(), batch["k"]
    assert latent_kernel_applies(batch["kv_cache"], 288, 0, 0.0, None, None)
    assert not latent_kernel_applies(batch["kv_cache"], 288, 4, 0.0, None, None)  # a window: the general kernel
    t, num_seqs = batch["q"].shape[0], batch["block_tables"].shape[0]
    assert latent_tiling(t, num_seqs, hq // hkv).heads == min(16, hq // hkv)
    for splits in (1, 3):
        check_paged_attention({k: v.clone() for k, v in batch.items()}, scale=288 ** -0.5, window=0,
                              num_splits=splits)


def test_paged_attention_latent_fp8_values_use_the_key_scale():
    """An FP8 one-plane cache stores the keys with k_scale, and its values are those keys: the
    read scales both by k_scale, whatever v_scale says (a checkpoint's scales may differ), in
    the reference and in the Triton attention (the K tile reused as V, `V_IS_K`); on CUDA the
    Triton write stores what the reference's does (the interpreter's e4m3 casts differ)."""
    batch = make_paged_batch(new_tokens=[3, 1], cached=[5, 9], hq=16, hkv=1, d=288, block_size=4, num_blocks=8,
                             seed=9, dtype=HALF)
    batch["kv_cache"], batch["v"] = batch["kv_cache"][:1].clone(), batch["k"]
    batch = _fp8_cache(batch)

    def reference(k_scale: float, v_scale: float) -> tuple[torch.Tensor, dict]:
        kv_scale = torch.tensor([k_scale, v_scale], dtype=torch.float32, device=DEVICE)
        written = {k: v.clone() for k, v in batch.items()}
        return paged_attention_reference(**written, scale=288 ** -0.5, sliding_window=0, kv_scale=kv_scale), written

    ref, written = reference(0.05, 4.0)
    assert torch.equal(ref, reference(0.05, 0.05)[0]) and torch.equal(ref, reference(0.05, 0.1)[0])
    assert not torch.allclose(ref, reference(0.1, 4.0)[0])  # k_scale does matter
    kv_scale = torch.tensor([0.05, 4.0], dtype=torch.float32, device=DEVICE)
    for splits, tiling in itertools.product((1, 2), (None, LATENT_TILING)):  # the latent kernel, the general one
        out = attend_paged_triton(*_attention_args(written)[:5], 288 ** -0.5, 0, num_splits=splits,
                                  kv_scale=kv_scale, tiling=tiling)
        assert_attention_close(out, ref, batch, 2e-3, 2e-3)
    if DEVICE == "cuda":
        triton_written = {k: v.clone() for k, v in batch.items()}
        paged_attention_triton(**triton_written, scale=288 ** -0.5, sliding_window=0, kv_scale=kv_scale)
        assert_cache_matches(triton_written["kv_cache"], written["kv_cache"], batch)


def test_attention_tiling_choice():
    h200_smem, a100_smem = 232448, 166912
    # Large-batch decode: 128 keys per iteration, 3 stages, where shared memory holds them;
    # every key block masked (P4: the interior-block branch costs more than it saves there).
    assert choose_tiling(256, 256, 128, h200_smem, fills_gpu=True) == AttentionTiling(16, 128, 4, 3,
                                                                                      mask_all_blocks=True)
    assert choose_tiling(256, 256, 128, a100_smem, fills_gpu=True).block_n == 64
    # Small-batch decode (split over the KV length) and head dim 256 keep 64 / 32 keys.
    assert choose_tiling(8, 8, 128, h200_smem, fills_gpu=False).block_n == 64
    assert choose_tiling(256, 256, 256, h200_smem, fills_gpu=True).block_n == 32
    # Prefill and mixed steps: 64-row tiles on 4 warps, interior key blocks unmasked.
    assert choose_tiling(8000, 256, 128, h200_smem, fills_gpu=True) == AttentionTiling(64, 64, 4, 2)
    assert all(choose_tiling(8, 8, 128, smem, fills_gpu=False).mask_all_blocks for smem in (h200_smem, a100_smem))
    # Over an FP8 cache a GPU-filling decode loads its tiles in one stage, V as [D, N] (J4).
    fp8 = choose_tiling(1024, 1024, 128, h200_smem, fills_gpu=True, fp8_cache=True, widen_asm=True)
    assert fp8 == AttentionTiling(16, 128, 4, 1, widen_asm=True, v_trans=True, mask_all_blocks=True)
    assert choose_tiling(8, 8, 128, h200_smem, fills_gpu=False, fp8_cache=True).block_n == 64
    assert choose_tiling(8000, 256, 128, h200_smem, fills_gpu=True, fp8_cache=True) == AttentionTiling(64, 64, 4, 2)
    # Where the e4m3-MMA decode kernel runs: it takes GPU-filling decodes, not prefills (L1),
    # with a sequence's KV heads side by side in its grid (N4).
    rows = choose_tiling(1024, 1024, 128, h200_smem, fills_gpu=True, fp8_cache=True, widen_asm=True, e4m3_mma=True)
    assert rows == AttentionTiling(16, 128, 4, 1, widen_asm=True, keys_as_rows=True, heads_fastest=True)
    # ... and small-batch decodes too, split over the KV length (W1: shorter load chains).
    small = choose_tiling(8, 8, 128, h200_smem, fills_gpu=False, fp8_cache=True, widen_asm=True, e4m3_mma=True)
    assert small.keys_as_rows == bool(SMALL_DECODE_ROWS_BLOCK_N)  # KILN_ATTENTION_SMALL_DECODE_ROWS=0: off
    assert not small.keys_as_rows or small.block_n == SMALL_DECODE_ROWS_BLOCK_N
    # Over a 16-bit cache too (X6; KILN_ATTENTION_SMALL_DECODE_ROWS_16BIT=0: off), and only
    # small-batch decodes.
    small16 = choose_tiling(8, 8, 128, h200_smem, fills_gpu=False, rows_16bit=True)
    assert small16.keys_as_rows == bool(SMALL_DECODE_ROWS_16BIT_BLOCK_N)
    assert not small16.keys_as_rows or (small16.block_n, small16.widen_asm) == (SMALL_DECODE_ROWS_16BIT_BLOCK_N, False)
    assert not choose_tiling(256, 256, 128, h200_smem, fills_gpu=True, rows_16bit=True).keys_as_rows
    mixed = choose_tiling(8000, 256, 128, h200_smem, fills_gpu=True, fp8_cache=True, widen_asm=True, e4m3_mma=True)
    assert not mixed.keys_as_rows and mixed.singles_as_rows  # a mixed step's decodes go to it
    assert not choose_tiling(8000, 256, 128, h200_smem, fills_gpu=True, fp8_cache=True).singles_as_rows


def test_paged_attention_more_sequences_than_one_search_chunk():
    # 70 sequences (the kernel scans tile starts 64 at a time): decodes, then two prefills.
    new_tokens = [1] * 68 + [6, 3]
    cached = [(i * 7) % 13 for i in range(68)] + [0, 5]
    batch = make_paged_batch(new_tokens=new_tokens, cached=cached, hq=4, hkv=2, d=16, block_size=4,
                             num_blocks=4 * 70 + 8, seed=6)
    check_paged_attention(batch, scale=0.25, window=0, num_splits=1)


def test_paged_attention_explicit_tilings_agree():
    batch = make_paged_batch(**MIXED, hq=4, hkv=2, d=16, block_size=4, num_blocks=24, seed=5)
    for tiling in (AttentionTiling(16, 32, 4, 2), AttentionTiling(64, 64, 4, 3), AttentionTiling(32, 16, 2, 2)):
        check_paged_attention(batch, scale=0.25, window=0, num_splits=1, tiling=tiling)


@pytest.mark.parametrize("window,splits,fp8", [
    (0, 1, False),   # blocks wholly below a tile's first position run unmasked
    (0, 3, False),   # per split: a split's last block ends on its boundary, unmasked
    (21, 1, False),  # a sliding window: every block masked
    (0, 1, True),
])
def test_paged_attention_masks_only_the_blocks_rows_see_in_part(window, splits, fp8):
    # Contexts of several 16-key blocks, prefills starting mid-block and tiles of 8 tokens
    # (16 rows, group of 2): interior blocks, the causal diagonal and the cache's end all
    # occur. Masking every block is the same computation on the allowed logits, so the two
    # kernels agree bit for bit, and both match the reference (which also writes the cache
    # they read).
    batch = make_paged_batch(new_tokens=[20, 45, 1, 1, 0], cached=[40, 0, 37, 70, 0], hq=4, hkv=2, d=16,
                             block_size=4, num_blocks=4 * 70, pad_tokens=3, seed=8, dtype=HALF if fp8 else torch.float32)
    kv_scale = None
    if fp8:
        batch = _fp8_cache(batch)
        kv_scale = torch.tensor([0.05, 4.0], dtype=torch.float32, device=DEVICE)
    ref = paged_attention_reference(**batch, scale=0.25, sliding_window=window, kv_scale=kv_scale)
    args = (batch["q"], batch["kv_cache"], batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 0.25,
            window)
    tiling = AttentionTiling(16, 16, 2, 2)
    masked_in_part, masked_all = (
        attend_paged_triton(*args, num_splits=splits, tiling=dataclasses.replace(tiling, mask_all_blocks=mask_all),
                            kv_scale=kv_scale) for mask_all in (False, True))
    assert torch.equal(masked_in_part, masked_all)
    tol = 2e-3 if fp8 else 2e-5
    assert_attention_close(masked_in_part, ref, batch, tol, tol)


@pytest.mark.parametrize("with_norm,splits", [(False, 1), (True, 2)])
def test_rope_paged_attention_writes_rotated_keys(with_norm, splits):
    batch = make_paged_batch(**MIXED, hq=4, hkv=2, d=16, block_size=4, num_blocks=24, seed=21)
    t = batch["q"].shape[0]
    cos, sin = _cos_sin(t, 16, seed=22)
    norms = (randn(16, seed=23), randn(16, seed=24)) if with_norm else (None, None)
    ref_batch = {k: v.clone() for k, v in batch.items()}
    # With the norm, also a soft-cap and a window (Gemma 2's windowed layers): the fused op
    # hands both through to the attention.
    softcap, window = (1.5, 5) if with_norm else (0.0, 0)
    out = rope_paged_attention_triton(batch["q"], batch["k"], batch["v"], cos, sin, *norms, 1e-6, batch["kv_cache"],
                                      batch["slot_mapping"], batch["block_tables"], batch["seq_lens"],
                                      batch["query_start_loc"], 0.25, window, num_splits=splits, softcap=softcap)
    # The reference is what the op's CPU implementation composes: rope, then paged attention.
    q_rot, k_rot = rope_reference(ref_batch["q"], ref_batch["k"], cos, sin, *norms, 1e-6)
    ref = paged_attention_reference(q_rot, k_rot, ref_batch["v"], ref_batch["kv_cache"], ref_batch["slot_mapping"],
                                    ref_batch["block_tables"], ref_batch["seq_lens"], ref_batch["query_start_loc"],
                                    0.25, window, softcap)
    assert_attention_close(out, ref, batch, atol=2e-5, rtol=2e-5)
    assert_cache_matches(batch["kv_cache"], ref_batch["kv_cache"], batch, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("partial", [False, True])
def test_rope_with_float32_tables(partial):
    # The OLMo family's graph: float32 cos/sin beside 16-bit heads, the rotation computed in
    # float32 (and cast back by the graph). The op returns float32 as that graph's rotation
    # is; with write_kv (kiln::rope_paged_attention) the rotated q comes back in its own dtype
    # and the key goes into the cache, each rounded once.
    from kiln.kernels.paged_attention import write_kv_cache
    from kiln.kernels.rope import rotated_for_attention
    from kiln.kernels.triton_rope import rope_triton

    t, hq, hkv, d = 5, 4, 2, 32
    r = 8 if partial else d
    q = randn(1, hq, t, d, seed=31, dtype=HALF)[0].transpose(0, 1)
    k = randn(t, hkv, d, seed=32, dtype=HALF)
    cos, sin = _cos_sin(t, r, seed=33)
    assert cos.dtype == torch.float32
    outs, refs = rope_triton(q, k, cos, sin, None, None, 0.0), rope_reference(q, k, cos, sin, None, None, 0.0)
    for out, ref in zip(outs, refs):
        assert out.dtype == ref.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)  # float32 products and sum, unrounded
    batch = make_paged_batch(**MIXED, hq=hq, hkv=hkv, d=d, block_size=4, num_blocks=24, seed=34, dtype=HALF)
    n = batch["q"].shape[0]
    cos, sin = _cos_sin(n, r, seed=35)
    ref_cache = batch["kv_cache"].clone()
    q_rot, _ = rope_triton(batch["q"], batch["k"], cos, sin, None, None, 0.0,
                           write_kv=(batch["v"], batch["kv_cache"], batch["slot_mapping"]))
    ref_q, ref_k = rotated_for_attention(*rope_reference(batch["q"], batch["k"], cos, sin, None, None, 0.0),
                                         batch["q"], batch["k"], None)
    write_kv_cache(ref_k, batch["v"], ref_cache, batch["slot_mapping"])
    assert q_rot.dtype == HALF
    assert_mostly_bit_exact(q_rot, ref_q)
    assert_cache_matches(batch["kv_cache"], ref_cache, batch, atol=1e-3, rtol=1e-3)


def test_rope_paged_attention_with_float32_tables():
    # The fused op over float32 tables: the RoPE kernel's launch (with the cache write), then
    # the attention over q in its own dtype: what the op's CPU implementation composes.
    from kiln.kernels.rope_paged_attention import rope_paged_attention

    batch = make_paged_batch(**MIXED, hq=4, hkv=2, d=16, block_size=4, num_blocks=24, seed=36, dtype=HALF)
    cos, sin = _cos_sin(batch["q"].shape[0], 16, seed=37)
    ref_batch = {k: v.clone() for k, v in batch.items()}
    args = ("q", "k", "v")
    out = rope_paged_attention_triton(*(batch[a] for a in args), cos, sin, None, None, 0.0, batch["kv_cache"],
                                      batch["slot_mapping"], batch["block_tables"], batch["seq_lens"],
                                      batch["query_start_loc"], 0.25, 0)
    ref_cache = ref_batch["kv_cache"].cpu()  # the CPU implementation writes into it
    ref = rope_paged_attention(*(ref_batch[a].cpu() for a in args), cos.cpu(), sin.cpu(), None, None, 0.0,
                               ref_cache, ref_batch["slot_mapping"].cpu(), ref_batch["block_tables"].cpu(),
                               ref_batch["seq_lens"].cpu(), ref_batch["query_start_loc"].cpu(), 0.25, 0)
    assert out.dtype == ref.dtype == HALF
    assert_attention_close(out, ref.to(out.device), batch, atol=2e-3, rtol=2e-3)
    assert_cache_matches(batch["kv_cache"], ref_cache.to(out.device), batch, atol=1e-3, rtol=1e-3)


def _new_tokens_decode(cache: str, seed: int, keys_as_rows: bool = True
                       ) -> tuple[dict, torch.Tensor | None, AttentionTiling]:
    """A decode step for the keys-as-rows kernel writing the new tokens itself: padded
    sequences and a padded token, one sequence bringing two tokens; over a 16-bit or e4m3
    cache (scales far from 1); the kernel's tiling (or, keys_as_rows False, the general one)."""
    batch = make_paged_batch(new_tokens=[1, 1, 0, 2, 1, 1, 0], cached=[40, 3, 0, 17, 64, 29, 0], hq=8, hkv=2, d=32,
                             block_size=16, num_blocks=32, pad_tokens=1, seed=seed, dtype=HALF)
    fp8 = cache == "fp8"
    kv_scale = torch.tensor([0.05, 4.0], dtype=torch.float32, device=DEVICE) if fp8 else None
    widen = converts_e4m3_in_hardware(torch.device(DEVICE)) and fp8
    tiling = AttentionTiling(16, 32, 4, 1, widen_asm=widen, keys_as_rows=keys_as_rows, heads_fastest=True)
    return (_fp8_cache(batch) if fp8 else batch), kv_scale, tiling


@pytest.mark.parametrize("cache,splits,window,rows,one_writer,norm", [
    ("16bit", 1, 0, True, False, False), ("16bit", 3, 20, True, False, False), ("16bit", 3, 20, True, True, False),
    ("fp8", 1, 0, True, False, False), ("fp8", 2, 20, True, False, False), ("fp8", 3, 0, True, True, False),
    ("fp8", 2, 0, False, False, False), ("16bit", 2, 0, True, False, True), ("fp8", 3, 20, True, True, True),
    ("fp8", 1, 0, False, False, True)])
def test_keys_as_rows_decode_rotates_and_writes_the_new_tokens(monkeypatch, cache, splits, window, rows, one_writer,
                                                               norm):
    # With fuse_rope the keys-as-rows decode kernel rotates its query heads and writes the
    # step's rotated keys and values into the cache itself before reading it, in one launch:
    # the same output and cache, bit for bit, as the RoPE kernel's launch first, with splits
    # (every split writes the same bytes; with `one_writer` only those that read a new key),
    # a window, padded sequences and tokens, and one sequence that brings two tokens (its
    # second attends to its first's key). Over another tiling (`rows` False) the RoPE kernel
    # runs first, as without fuse_rope. With Qwen3's q/k norms (`norm`) too.
    import kiln.kernels.triton_paged_attention as attention
    import kiln.kernels.triton_paged_decode_fp8 as decode

    monkeypatch.setattr(decode, "NEW_KV_ONE_WRITER", one_writer)

    batch, kv_scale, tiling = _new_tokens_decode(cache, seed=17 + splits, keys_as_rows=rows)
    fp8 = cache == "fp8"
    t = batch["q"].shape[0]
    cos, sin = (x.to(HALF) for x in _cos_sin(t, 32, seed=18))
    norms = (randn(32, seed=19, dtype=HALF), randn(32, seed=20, dtype=HALF)) if norm else (None, None)

    def run(fuse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        b = {k: v.clone() for k, v in batch.items()}
        out = rope_paged_attention_triton(b["q"], b["k"], b["v"], cos, sin, *norms, 1e-6, b["kv_cache"],
                                          b["slot_mapping"], b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                          0.2, window, num_splits=splits, kv_scale=kv_scale, tiling=tiling,
                                          fuse_rope=fuse, fuse_norms=fuse)
        return out, b["kv_cache"]

    separate, separate_cache = run(False)
    rope_calls = []
    rope_triton_ = attention.rope_triton
    monkeypatch.setattr(attention, "rope_triton", lambda *a, **kw: rope_calls.append(1) or rope_triton_(*a, **kw))
    fused, fused_cache = run(True)
    assert len(rope_calls) == (0 if rows else 1)
    real = int(batch["query_start_loc"][-1])
    assert fused[:real].abs().amax(dim=(1, 2)).min() > 0 and not fused[real:].any()
    if norm and DEVICE != "cpu":
        # Compiled, the norms' sums of squares run in another order than the RoPE kernel's
        # (another tile layout): a rounding of the normed q or k may flip, and with it one
        # e4m3 step of a cached key.
        torch.testing.assert_close(fused, separate, atol=2e-3, rtol=2e-3)
        assert_cache_matches(fused_cache.float(), separate_cache.float(), batch, atol=1e-3,
                             rtol=0.13 if fp8 else 1e-3)
    else:
        assert torch.equal(fused, separate)
        assert_cache_matches(fused_cache, separate_cache, batch)
    assert not torch.equal(fused_cache, batch["kv_cache"])  # (the step's tokens were written)


@pytest.mark.parametrize("cache,splits,window,fuse_rope", [("16bit", 1, 0, False), ("16bit", 3, 20, True),
                                                          ("fp8", 2, 0, True), ("fp8", 1, 20, False),
                                                          ("16bit", 2, -7, False)])  # chunked (Llama 4)
def test_keys_as_rows_decode_takes_attention_sinks(cache, splits, window, fuse_rope):
    # GPT-OSS's sinks in the keys-as-rows decode kernel (each head's softmax starts at its sink
    # in the first split only), with the rotation and cache write fused in or not: over a 16-bit
    # cache the reference's output. Over an e4m3 cache the kernel quantizes the query too, which
    # moves its output from the reference's as much without sinks as with them; but a sink only
    # scales each token's head output by 1 / (1 + exp(sink - lse)), so the kernel's output with
    # sinks must be its own sink-free output times the reference's factor for that head.
    batch, kv_scale, tiling = _new_tokens_decode(cache, seed=71 + splits)
    t, hq = batch["q"].shape[:2]
    cos, sin = (x.to(HALF) for x in _cos_sin(t, 32, seed=72))
    sinks = torch.linspace(-3.0, 4.0, hq).to(DEVICE, HALF)

    def run(with_sinks: bool, reference: bool, rows: bool = True) -> torch.Tensor:
        b = {k: v.clone() for k, v in batch.items()}
        args = (b["q"], b["k"], b["v"], cos, sin, None, None, 1e-6, b["kv_cache"], b["slot_mapping"],
                b["block_tables"], b["seq_lens"], b["query_start_loc"], 0.2, window)
        if reference:
            q_rot, k_rot = rope_reference(b["q"], b["k"], cos, sin, None, None, 1e-6)
            return paged_attention_reference(q_rot, k_rot, *args[2:3], *args[8:], kv_scale=kv_scale,
                                             sinks=sinks if with_sinks else None)
        return rope_paged_attention_triton(*args, num_splits=splits, kv_scale=kv_scale,
                                           tiling=tiling if rows else dataclasses.replace(tiling, keys_as_rows=False),
                                           fuse_rope=fuse_rope, sinks=sinks if with_sinks else None)

    real = int(batch["query_start_loc"][-1])
    out, plain = run(True, False)[:real].float(), run(False, False)[:real].float()
    assert (out - plain).abs().max() > 0.1
    if cache == "16bit":
        torch.testing.assert_close(out, run(True, True)[:real].float(), atol=2e-3, rtol=2e-3)
        return

    def factor(with_sinks: torch.Tensor, without: torch.Tensor) -> torch.Tensor:  # per token and head
        return (with_sinks * without).sum(-1) / (without * without).sum(-1)

    ref_factor = factor(run(True, True)[:real].float(), run(False, True)[:real].float())
    kernel_factor = factor(out, plain)
    assert ref_factor.min() < 0.2 and ref_factor.max() > 0.8  # the sinks weigh very differently per head
    torch.testing.assert_close(kernel_factor, ref_factor, atol=0.05, rtol=0.05)
    torch.testing.assert_close(out, kernel_factor[..., None] * plain, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("min_tokens,new_tokens,fused", [(2, [1], False), (2, [1, 1], True), (0, [1, 1], False),
                                                       (1, [1], True)])
def test_norms_fuse_into_the_decode_kernel_from_a_token_count(monkeypatch, min_tokens, new_tokens, fused):
    # With q/k norms and fuse_norms left to the default, the decode kernel takes the norms and
    # RoPE only for a decode of FUSED_ROPE_NORMS_MIN_TOKENS tokens or more (0: never); else the
    # RoPE kernel runs first. Either way the same output.
    import kiln.kernels.triton_paged_attention as attention

    monkeypatch.setattr(attention, "FUSED_ROPE_NORMS_MIN_TOKENS", min_tokens)
    batch = make_paged_batch(new_tokens=new_tokens, cached=[9, 20][:len(new_tokens)], hq=4, hkv=2, d=32,
                             block_size=16, num_blocks=8, seed=31, dtype=HALF)
    tiling = AttentionTiling(16, 32, 4, 1, keys_as_rows=True, heads_fastest=True)
    cos, sin = (x.to(HALF) for x in _cos_sin(len(new_tokens), 32, seed=32))
    norms = (randn(32, seed=33, dtype=HALF), randn(32, seed=34, dtype=HALF))
    rope_calls = []
    rope_triton_ = attention.rope_triton
    monkeypatch.setattr(attention, "rope_triton", lambda *a, **kw: rope_calls.append(1) or rope_triton_(*a, **kw))
    b = {k: v.clone() for k, v in batch.items()}
    out = rope_paged_attention_triton(b["q"], b["k"], b["v"], cos, sin, *norms, 1e-6, b["kv_cache"],
                                      b["slot_mapping"], b["block_tables"], b["seq_lens"], b["query_start_loc"],
                                      0.2, 0, num_splits=2, tiling=tiling)
    assert len(rope_calls) == (0 if fused else 1)
    q_rot, k_rot = rope_reference(batch["q"], batch["k"], cos, sin, *norms, 1e-6)
    ref = paged_attention_reference(q_rot, k_rot, batch["v"], batch["kv_cache"], batch["slot_mapping"],
                                    batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 0.2, 0, 0.0)
    assert_attention_close(out, ref, batch, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache,splits", [("16bit", 3), ("fp8", 2)])
def test_keys_as_rows_decode_writes_the_new_tokens_without_rope(cache, splits):
    # `NewTokensKV` without cos/sin: the kernel writes the step's keys and values as they are,
    # as `paged_attention_triton`'s write kernel would, then attends: the same output and
    # cache, bit for bit.
    from kiln.kernels.triton_paged_decode_fp8 import NewTokensKV

    batch, kv_scale, tiling = _new_tokens_decode(cache, seed=23)
    separate = {k: v.clone() for k, v in batch.items()}
    ref = paged_attention_triton(**separate, scale=0.2, sliding_window=0, num_splits=splits, tiling=tiling,
                                 kv_scale=kv_scale)
    fused = {k: v.clone() for k, v in batch.items()}
    out = attend_paged_triton(*_attention_args(fused), num_splits=splits, tiling=tiling, kv_scale=kv_scale,
                              new_kv=NewTokensKV(fused["k"], fused["v"], fused["slot_mapping"]))
    real = int(batch["query_start_loc"][-1])
    assert out[:real].abs().amax(dim=(1, 2)).min() > 0
    assert torch.equal(out, ref)
    assert_cache_matches(fused["kv_cache"], separate["kv_cache"], batch)
    assert not torch.equal(fused["kv_cache"], batch["kv_cache"])


@triton.jit
def _key_ranges_kernel(seq_lens_ptr, n_new_ptr, writes_ptr, ranges_ptr, window, NUM_SPLITS: tl.constexpr,
                       BLOCK_N: tl.constexpr, MAX_NEW: tl.constexpr):
    """Per (sequence, split): whether it writes the new keys (`_reads_a_new_key`), and the key
    range it reads for each new token (`_key_range`, as the attention loop)."""
    seq = tl.program_id(0)
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    n_new = tl.load(n_new_ptr + seq)
    writes = _reads_a_new_key(seq_len, n_new, window, split, NUM_SPLITS, BLOCK_N)
    tl.store(writes_ptr + seq * NUM_SPLITS + split, writes.to(tl.int32))
    for tok in range(n_new):
        lo, hi = _key_range(seq_len - n_new + tok + 1, window, split, NUM_SPLITS, BLOCK_N)
        base = ranges_ptr + ((seq * NUM_SPLITS + split) * MAX_NEW + tok) * 2
        tl.store(base, lo)
        tl.store(base + 1, hi)


def test_only_splits_that_read_a_new_key_write_them():
    # NEW_KV_ONE_WRITER: a split program writes the step's new keys only if it reads one of
    # them, and reads nothing it has not written itself (the interpreter runs programs one
    # after another, so the test above cannot see a missing writer; a GPU would race). Here,
    # for contexts, new-token counts and windows around the split and tile edges: every key
    # range a program reads (`_key_range`, the attention loop's) that holds a new position
    # belongs to a writer, and every sequence with new tokens has one.
    seq_lens = [1, 2, 31, 32, 33, 64, 65, 95, 96, 97, 200, 3, 40]
    n_new = [1, 2, 1, 1, 1, 1, 1, 3, 1, 2, 1, 3, 0]
    for splits, block_n, window in ((3, 32, 0), (4, 16, 0), (3, 32, 20), (5, 16, 7), (2, 64, 0)):
        n = len(seq_lens)
        writes = torch.full((n, splits), -1, dtype=torch.int32, device=DEVICE)
        ranges = torch.full((n, splits, 3, 2), -1, dtype=torch.int32, device=DEVICE)
        _key_ranges_kernel[(n, splits)](torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
                                   torch.tensor(n_new, dtype=torch.int32, device=DEVICE), writes, ranges, window,
                                   NUM_SPLITS=splits, BLOCK_N=block_n, MAX_NEW=3)
        writes, ranges = writes.cpu(), ranges.cpu()
        assert set(writes.flatten().tolist()) <= {0, 1}
        for i, (length, new) in enumerate(zip(seq_lens, n_new)):
            assert bool(writes[i].any()) == (new > 0), (splits, block_n, window, i)
            for split in range(splits):
                reads_new = any(lo < hi and hi > length - new for lo, hi in ranges[i, split, :new].tolist())
                assert bool(writes[i, split]) == reads_new, (splits, block_n, window, i, split)
        assert 0 < int(writes.sum()) < int((torch.tensor(n_new) > 0).sum()) * splits  # fewer writers than programs


# ---- FP8 (issue 16): e4m3 KV cache, per-token activation quantization -----------------------

FP8 = torch.float8_e4m3fn
# One e4m3 step: where an input was rounded in another place (a norm's rsqrt, a sigmoid), the
# value may sit across a rounding boundary of e4m3.
FP8_NEIGHBOUR = 0.13


def assert_fp8_close(out: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> None:
    """On a GPU, assert_close. Triton's interpreter (Triton 3.x) casts to e4m3 wrongly when
    rounding carries into the exponent (1.96 -> 1.0 where round-to-nearest gives 2.0; every
    other value matches torch's cast), so there at least 95% of the elements must be close."""
    if DEVICE != "cpu":
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)
        return
    close = torch.isclose(out.float(), ref.float(), atol=atol, rtol=rtol, equal_nan=True)
    assert close.float().mean() >= 0.95, f"{int((~close).sum())} of {close.numel()} elements differ"


def _fp8_cache(batch: dict) -> dict:
    from kiln.kernels.paged_attention import to_cache_dtype

    return {**batch, "kv_cache": to_cache_dtype(batch["kv_cache"], FP8)}


def _attention_args(batch: dict, window: int = 0) -> tuple:
    """attend_paged_triton's positional arguments for `batch`: softmax scale 0.2, `window`."""
    return (batch["q"], batch["kv_cache"], batch["block_tables"], batch["seq_lens"], batch["query_start_loc"], 0.2,
            window)


def test_paged_attention_fp8_decode_tiling_matches_the_default():
    # The FP8 decode tiling (V tiles loaded as [D, N] and transposed; on a GPU also widened by
    # inline assembly) reads the same e4m3 values: the same output as the bf16-shaped tiling.
    batch = _fp8_cache(make_paged_batch(new_tokens=[1] * 6, cached=[40, 3, 17, 64, 1, 29], hq=8, hkv=2, d=32,
                                        block_size=16, num_blocks=24, seed=61, dtype=HALF))
    kv_scale = torch.tensor([0.05, 4.0], dtype=torch.float32, device=DEVICE)
    args = _attention_args(batch)
    widen = converts_e4m3_in_hardware(torch.device(DEVICE))
    fp8_tiling = AttentionTiling(16, 32, 4, 1, widen_asm=widen, v_trans=True)
    out = attend_paged_triton(*args, num_splits=1, tiling=fp8_tiling, kv_scale=kv_scale)
    ref = attend_paged_triton(*args, num_splits=1, tiling=AttentionTiling(16, 32, 4, 2), kv_scale=kv_scale)
    assert out.abs().max() > 0
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("hq,splits,window", [(8, 1, 0), (8, 3, 0), (16, 2, 20), (4, 1, 9), (6, 2, 0)])
def test_paged_decode_fp8_keys_as_rows_matches_the_default(hq, splits, window):
    # The e4m3-MMA decode kernel (keys as the MMA's rows, the query split into hi + lo / 16)
    # against the general kernel over the same e4m3 cache: GQA groups of 4, 8, 2 and 3 (padded
    # to 8 columns), splits, a sliding window, per-layer scales far from 1, padded
    # sequences (no token) and one sequence that brings two tokens (run one after the other).
    batch = _fp8_cache(make_paged_batch(new_tokens=[1, 1, 0, 2, 1, 1, 0], cached=[40, 3, 0, 17, 64, 29, 0], hq=hq,
                                        hkv=2, d=32, block_size=16, num_blocks=32, pad_tokens=1, seed=71 + hq,
                                        dtype=HALF))
    kv_scale = torch.tensor([0.05, 4.0], dtype=torch.float32, device=DEVICE)
    args = _attention_args(batch, window)
    widen = converts_e4m3_in_hardware(torch.device(DEVICE))
    rows_tiling = AttentionTiling(16, 32, 4, 2, widen_asm=widen, keys_as_rows=True)
    out = attend_paged_triton(*args, num_splits=splits, tiling=rows_tiling, kv_scale=kv_scale)
    ref = attend_paged_triton(*args, num_splits=1, tiling=AttentionTiling(16, 32, 4, 2), kv_scale=kv_scale)
    rows = int(batch["query_start_loc"][-1])
    assert out[:rows].abs().amax(dim=(1, 2)).min() > 0 and not out[rows:].any()
    # The split query's error is at most ~2^-8 of an element (the e4m3 cache's is 2^-4).
    # Relative RMS difference here 1.2-1.4e-3 (Triton's interpreter rounds some casts to e4m3
    # wrongly; a GPU is closer); with hi alone 2.2-3.2e-3.
    diff = (out.float() - ref.float())[:rows]
    assert diff.abs().max() < 0.05
    assert diff.pow(2).mean().sqrt() < 1.8e-3 * ref.float()[:rows].pow(2).mean().sqrt()


@pytest.mark.parametrize("hq,splits,window,heads_fastest", [(8, 1, 0, False), (8, 3, 0, True), (16, 2, 20, False),
                                                           (6, 2, 0, True)])
def test_paged_decode_keys_as_rows_over_a_16_bit_cache(hq, splits, window, heads_fastest):
    # The keys-as-rows kernel over a 16-bit cache (the cache dtype's MMAs, the query as it
    # is) against the general kernel: GQA groups of 4, 8 and 3 (padded to 8 columns), splits,
    # a sliding window, padded sequences and one sequence bringing two tokens.
    batch = make_paged_batch(new_tokens=[1, 1, 0, 2, 1, 1, 0], cached=[40, 3, 0, 17, 64, 29, 0], hq=hq, hkv=2, d=32,
                             block_size=16, num_blocks=32, pad_tokens=1, seed=31 + hq, dtype=HALF)
    args = _attention_args(batch, window)
    rows_tiling = AttentionTiling(16, 32, 4, 2, keys_as_rows=True, heads_fastest=heads_fastest)
    out = attend_paged_triton(*args, num_splits=splits, tiling=rows_tiling)
    ref = attend_paged_triton(*args, num_splits=1, tiling=AttentionTiling(16, 32, 4, 2))
    rows = int(batch["query_start_loc"][-1])
    assert out[:rows].abs().amax(dim=(1, 2)).min() > 0 and not out[rows:].any()
    # Both take f32 sums of f16 products; p is rounded to f16 for the second dot in both.
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("splits,window", [(1, 0), (3, 20)])
def test_paged_decode_fp8_heads_first_grid_changes_nothing(splits, window):
    # `heads_fastest` only reorders the grid (KV heads as its first axis): the same output
    # bit for bit, with splits, a window, and contexts that end mid-iteration.
    batch = _fp8_cache(make_paged_batch(new_tokens=[1, 1, 1, 0, 1], cached=[40, 3, 95, 0, 64], hq=8, hkv=2, d=32,
                                        block_size=16, num_blocks=40, pad_tokens=1, seed=5, dtype=HALF))
    kv_scale = torch.tensor([0.5, 2.0], dtype=torch.float32, device=DEVICE)
    args = _attention_args(batch, window)
    widen = converts_e4m3_in_hardware(torch.device(DEVICE))
    tiling = AttentionTiling(16, 32, 4, 1, widen_asm=widen, keys_as_rows=True)
    plain = attend_paged_triton(*args, num_splits=splits, tiling=tiling, kv_scale=kv_scale)
    reordered = attend_paged_triton(*args, num_splits=splits, tiling=dataclasses.replace(tiling, heads_fastest=True),
                                    kv_scale=kv_scale)
    assert plain.abs().max() > 0
    assert torch.equal(reordered, plain)


@pytest.mark.parametrize("cache,tiling,decode", [
    ("bf16", AttentionTiling(16, 32, 4, 2), True), ("bf16", AttentionTiling(64, 32, 4, 2), False),
    ("fp8", AttentionTiling(16, 32, 4, 2), False), ("fp8", AttentionTiling(16, 32, 4, 1, keys_as_rows=True), True),
    ("fp8", AttentionTiling(64, 32, 4, 2, singles_as_rows=True), False),
    ("bf16", AttentionTiling(16, 32, 4, 1, keys_as_rows=True), True)])
@pytest.mark.parametrize("splits", [1, 2])
def test_attention_output_needs_no_fill(monkeypatch, cache, tiling, decode, splits):
    # The launcher allocates its output (and split partials) without filling them: the kernels
    # write every row, the padded tokens' as zeros. Here every fresh allocation holds NaN, and
    # the output must be the same as with zero-filled ones, bit for bit, for the general
    # kernel, the keys-as-rows decode kernel (e4m3 and 16-bit), the two together in a mixed
    # step, and the combine.
    shape = dict(new_tokens=[1, 1, 0, 1, 1], cached=[40, 3, 0, 17, 29]) if decode else MIXED
    batch = make_paged_batch(**{**shape, "pad_tokens": 3}, hq=8, hkv=2, d=32, block_size=16, num_blocks=24,
                             seed=97, dtype=HALF)
    batch = _fp8_cache(batch) if cache == "fp8" else batch
    kv_scale = torch.tensor([0.5, 2.0], dtype=torch.float32, device=DEVICE) if cache == "fp8" else None
    widen = converts_e4m3_in_hardware(torch.device(DEVICE))
    tiling = dataclasses.replace(tiling, widen_asm=widen and cache == "fp8")
    args = _attention_args(batch)
    empty_like, empty = torch.empty_like, torch.empty
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: empty_like(x, **kw).fill_(0.0))
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(0.0))
    zeroed = attend_paged_triton(*args, num_splits=splits, tiling=tiling, kv_scale=kv_scale)
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: empty_like(x, **kw).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    poisoned = attend_paged_triton(*args, num_splits=splits, tiling=tiling, kv_scale=kv_scale)
    real = int(batch["query_start_loc"][-1])
    assert batch["q"].shape[0] - real == 3 and zeroed[:real].abs().amax(dim=(1, 2)).min() > 0
    assert torch.equal(poisoned, zeroed) and not poisoned[real:].any()


@pytest.mark.parametrize("cache,heads_fastest,window", [("fp8", True, 0), ("fp8", False, 20), ("bf16", True, 0)])
def test_keys_as_rows_decode_merges_its_own_splits(monkeypatch, cache, heads_fastest, window):
    # With fuse_combine the keys-as-rows decode kernel's last split of each (token, KV head)
    # merges the partials itself and `_combine_splits_kernel` is not launched: the same output
    # (to rounding: the splits are summed in order, not as a tree), the padded tokens' rows
    # zeroed though every allocation holds NaN, and the arrival counters back at zero.
    import kiln.kernels.triton_paged_attention as attention
    from kiln.kernels.triton_common import SPLIT_K_COUNTERS

    # (No more tokens than sequence slots: the launcher's condition for that kernel.)
    batch = make_paged_batch(new_tokens=[1, 1, 0, 1, 1, 0, 0], cached=[40, 3, 0, 17, 64, 0, 0], hq=8, hkv=2, d=32,
                             block_size=16, num_blocks=32, pad_tokens=3, seed=13, dtype=HALF)
    batch = _fp8_cache(batch) if cache == "fp8" else batch
    kv_scale = torch.tensor([0.5, 2.0], dtype=torch.float32, device=DEVICE) if cache == "fp8" else None
    widen = converts_e4m3_in_hardware(torch.device(DEVICE)) and cache == "fp8"
    tiling = AttentionTiling(16, 32, 4, 1, widen_asm=widen, keys_as_rows=True, heads_fastest=heads_fastest)
    args = _attention_args(batch, window)
    separate = attend_paged_triton(*args, num_splits=3, tiling=tiling, kv_scale=kv_scale, fuse_combine=False)

    class NotLaunched:
        def __getitem__(self, grid):
            raise AssertionError("_combine_splits_kernel was launched")

    counters = torch.zeros(SPLIT_K_COUNTERS, dtype=torch.int32, device=DEVICE)
    monkeypatch.setattr(attention, "_combine_splits_kernel", NotLaunched())
    monkeypatch.setattr(attention, "split_k_counters", lambda device: counters)
    empty_like, empty = torch.empty_like, torch.empty
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: empty_like(x, **kw).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    fused = attend_paged_triton(*args, num_splits=3, tiling=tiling, kv_scale=kv_scale, fuse_combine=True)
    real = int(batch["query_start_loc"][-1])
    assert batch["q"].shape[0] - real == 3 and not fused[real:].any()
    assert fused[:real].abs().amax(dim=(1, 2)).min() > 0 and not separate[real:].any()
    torch.testing.assert_close(fused.float(), separate.float(), atol=1e-3, rtol=2e-3)
    assert not counters.any()


@pytest.mark.parametrize("heads_fastest", [False, True])
@pytest.mark.parametrize("single_tokens_only", [False, True])
def test_paged_decode_fp8_zeroes_the_rows_of_padded_tokens(heads_fastest, single_tokens_only):
    # Without splits the launcher hands the e4m3-MMA decode kernel an uninitialised `out`: the
    # kernel must zero the rows of padded tokens (here 9 of them for 7 sequence slots, so
    # some slots zero two rows) and write its sequences' rows as over a zeroed `out`. In a
    # mixed step (`single_tokens_only`) the rows of multi-token sequences are the general
    # kernel's: left as they were.
    from kiln.kernels.triton_paged_decode_fp8 import launch_paged_decode_fp8

    new_tokens = [1, 1, 0, 3, 1, 1, 0] if single_tokens_only else [1, 1, 0, 1, 1, 1, 0]
    batch = _fp8_cache(make_paged_batch(new_tokens=new_tokens, cached=[40, 3, 0, 17, 64, 29, 0], hq=8, hkv=2, d=32,
                                        block_size=16, num_blocks=32, pad_tokens=9, seed=91, dtype=HALF))
    q, kv_cache = batch["q"], batch["kv_cache"]
    kv_scale = torch.tensor([0.5, 2.0], dtype=torch.float32, device=DEVICE)
    widen = converts_e4m3_in_hardware(torch.device(DEVICE))

    def run(out: torch.Tensor) -> torch.Tensor:
        launch_paged_decode_fp8(q, kv_cache, out, out, out, batch["block_tables"], batch["seq_lens"],
                                batch["query_start_loc"], kv_scale, 0.2, 0, num_splits=1, block_n=16, num_warps=4,
                                num_stages=1, widen_asm=widen, single_tokens_only=single_tokens_only,
                                heads_fastest=heads_fastest)
        return out

    poisoned = run(torch.full_like(q, float("nan")))
    zeroed = run(torch.zeros_like(q))
    starts = batch["query_start_loc"].tolist()
    real = starts[-1]
    ours = [r for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1 for r in range(starts[i], starts[i + 1])]
    others = [r for r in range(real) if r not in ours]
    assert q.shape[0] - real == 9 and not poisoned[real:].isnan().any() and not poisoned[real:].any()
    assert torch.equal(poisoned[ours], zeroed[ours]) and poisoned[ours].abs().max() > 0
    assert bool(poisoned[others].isnan().all()) and len(others) == (3 if single_tokens_only else 0)


@pytest.mark.parametrize("splits", [1, 2])
def test_mixed_step_single_tokens_go_to_the_keys_as_rows_kernel(splits):
    # A mixed step over an e4m3 cache with `singles_as_rows`: the one-token sequences' rows
    # come from the e4m3-MMA kernel (close to the general kernel's, not bit-equal: the split
    # query), the prefills' rows from the general kernel (bit-equal), padded rows stay zero.
    batch = _fp8_cache(make_paged_batch(new_tokens=[5, 1, 9, 1, 0, 1], cached=[11, 30, 0, 3, 0, 17], hq=8, hkv=2,
                                        d=32, block_size=16, num_blocks=24, pad_tokens=2, seed=81, dtype=HALF))
    kv_scale = torch.tensor([0.05, 4.0], dtype=torch.float32, device=DEVICE)
    args = _attention_args(batch)
    widen = converts_e4m3_in_hardware(torch.device(DEVICE))
    out = attend_paged_triton(*args, num_splits=splits, tiling=AttentionTiling(64, 32, 4, 2, widen_asm=widen,
                                                                               singles_as_rows=True), kv_scale=kv_scale)
    ref = attend_paged_triton(*args, num_splits=splits, tiling=AttentionTiling(64, 32, 4, 2, widen_asm=widen),
                              kv_scale=kv_scale)
    starts = batch["query_start_loc"].tolist()
    single = [starts[i] for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
    prefill = [r for i in range(len(starts) - 1) if starts[i + 1] - starts[i] > 1 for r in range(starts[i], starts[i + 1])]
    assert torch.equal(out[prefill], ref[prefill])
    assert not out[starts[-1]:].any()
    diff = (out[single].float() - ref[single].float())
    assert 0 < diff.pow(2).mean().sqrt() < 1.8e-3 * ref[single].float().pow(2).mean().sqrt()


@pytest.mark.parametrize("splits,rope,scaled,norm", [(1, False, False, False), (2, False, False, False),
                                                     (2, True, False, False), (1, True, True, False),
                                                     (2, True, True, True)])
def test_paged_attention_fp8_kv_cache(splits, rope, scaled, norm):
    # The step's K/V go into an e4m3 cache and every read converts back: the Triton kernels
    # (write, RoPE's fused write with and without per-layer scales, attention with and
    # without splits) against the reference.
    batch = _fp8_cache(make_paged_batch(**MIXED, hq=4, hkv=2, d=16, block_size=4, num_blocks=24, seed=41 + splits,
                                        dtype=HALF))
    ref_batch = {k: v.clone() for k, v in batch.items()}
    meta = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
    # Scales far from 1 (k / 0.05 uses e4m3's upper range, v / 4 its lower one), so a write or
    # a read that ignored them would be far off.
    kv_scale = torch.tensor([0.05, 4.0], dtype=torch.float32, device=DEVICE) if scaled else None
    if rope:
        t = batch["q"].shape[0]
        cos, sin = _cos_sin(t, 16, seed=42)
        cos, sin = cos.to(HALF), sin.to(HALF)
        # Qwen3's q/k norms, in the model dtype like the rest (mixed dtypes take torch's path).
        norms = (randn(16, seed=43, dtype=HALF), randn(16, seed=44, dtype=HALF)) if norm else (None, None)
        out = rope_paged_attention_triton(batch["q"], batch["k"], batch["v"], cos, sin, *norms, 1e-6,
                                          batch["kv_cache"], *(batch[m] for m in meta), 0.25, 0, num_splits=splits,
                                          kv_scale=kv_scale)
        q_rot, k_rot = rope_reference(ref_batch["q"], ref_batch["k"], cos, sin, *norms, 1e-6)
        ref = paged_attention_reference(q_rot, k_rot, ref_batch["v"], ref_batch["kv_cache"],
                                        *(ref_batch[m] for m in meta), 0.25, 0, kv_scale=kv_scale)
    else:
        out = paged_attention_triton(**batch, scale=0.25, sliding_window=0, num_splits=splits)
        ref = paged_attention_reference(**ref_batch, scale=0.25, sliding_window=0)
    assert batch["kv_cache"].dtype == FP8
    rows = int(batch["query_start_loc"][-1])
    written = batch["slot_mapping"][:rows].long()
    for kv in (0, 1):  # the slots this step wrote (the rest is the same tensor on both sides)
        got = batch["kv_cache"][kv].flatten(0, 1)[written].float()
        assert_fp8_close(got, ref_batch["kv_cache"][kv].flatten(0, 1)[written].float(), atol=0, rtol=0)
    assert not out[rows:].any()
    # The read: attention over the cache as the reference wrote it, against the reference.
    from kiln.kernels.triton_paged_attention import attend_paged_triton

    q = q_rot if rope else ref_batch["q"]
    read = attend_paged_triton(q, ref_batch["kv_cache"], *(ref_batch[m] for m in meta[1:]), 0.25, 0,
                               num_splits=splits, kv_scale=kv_scale)
    assert_attention_close(read, ref, batch, atol=2e-3, rtol=2e-3)
    if DEVICE != "cpu":  # the fused write, too (the interpreter's cast: assert_fp8_close)
        assert_attention_close(out, ref, batch, atol=2e-3, rtol=2e-3)
    if not rope:
        # ... and the FP8 cache holds these K/V: the reference over a float16 cache (the same
        # cached prefix) is close, not equal (the new tokens' e4m3 rounding shows).
        plain = paged_attention_reference(**{**{k: v.clone() for k, v in batch.items()},
                                             "kv_cache": batch["kv_cache"].to(HALF)},
                                          scale=0.25, sliding_window=0)
        rows = int(batch["query_start_loc"][-1])
        assert (ref[:rows].float() - plain[:rows].float()).abs().max() > 0
        torch.testing.assert_close(ref[:rows].float(), plain[:rows].float(), atol=0.1, rtol=0.1)


@pytest.mark.parametrize("shape,block_k", [((5, 48), 16), ((2, 3, 100), 32), ((1, 1024), 1024)])
def test_quantize_fp8_per_token(shape, block_k):
    from kiln.kernels.fp8 import quantize_fp8_rows
    from kiln.kernels.triton_fp8 import quantize_fp8_per_token_triton

    x = randn(*shape, seed=51, dtype=HALF) * 5
    x[..., 0, :] = 0  # a row of zeros gets a positive scale, and zeros
    xq, scale = quantize_fp8_per_token_triton(x, block_k=block_k)
    ref_q, ref_scale = quantize_fp8_rows(x)
    assert xq.dtype == FP8 and xq.shape == x.shape and scale.shape == (*shape[:-1], 1)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    assert_fp8_close(xq.float(), ref_q.float(), atol=0, rtol=0)
    assert (xq.float().abs().amax(-1) <= 448).all()


def test_quantize_fp8_gathered_rows_equal_quantize_then_gather():
    """W8A8 MoE's input in one launch: row r is pair r's token quantized (padding pairs, >= the
    pair count, token 0's), bit for bit what quantizing every token then gathering gives."""
    from kiln.kernels.triton_fp8 import quantize_fp8_gathered_rows_triton, quantize_fp8_per_token_triton

    top_k, tokens = 2, 5
    x = randn(tokens, 96, seed=53, dtype=HALF) * 5
    x[3] = 0  # a row of zeros: a positive scale, zeros
    pairs = torch.tensor([7, 0, 3, 10, 10, 9, 2, 6], dtype=torch.int32, device=x.device)  # 10 pairs: two padding
    xq, scale = quantize_fp8_gathered_rows_triton(x, pairs, tokens * top_k, top_k, block_k=32)
    ref_q, ref_scale = quantize_fp8_per_token_triton(x, block_k=32)
    token = torch.where(pairs < tokens * top_k, pairs // top_k, 0).long()
    assert xq.dtype == FP8 and xq.shape == (8, 96) and scale.shape == (8,)
    assert torch.equal(scale, ref_scale.reshape(-1)[token])
    assert torch.equal(xq.view(torch.uint8), ref_q.view(torch.uint8)[token])
    with pytest.raises(ValueError, match="top_k"):
        quantize_fp8_gathered_rows_triton(x, pairs, tokens * top_k, 0)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("offset", [None, 1.0, 0.0])
def test_rms_norm_quant_fp8(residual, offset):
    # offset: kiln::offset_rms_norm's forms (Gemma's 1 + weight; 0, the weight-in-float32 norm).
    from kiln.kernels import fp8
    from kiln.kernels import triton_fp8 as tf

    x, w = randn(2, 5, 96, seed=61, dtype=HALF) * 4, randn(96, seed=62, dtype=HALF)
    if offset is not None:
        w = w * 0.2  # Gemma's weights sit near zero: (1 + w) near one
    offset_args = () if offset is None else (offset,)
    if residual:
        r = randn(2, 5, 96, seed=63, dtype=HALF)
        fused, reference = ((tf.add_rms_norm_quant_fp8_triton, fp8.add_rms_norm_quant_fp8) if offset is None else
                            (tf.add_offset_rms_norm_quant_fp8_triton, fp8.add_offset_rms_norm_quant_fp8))
        xq, scale, summed = fused(x, r, w, 1e-6, *offset_args)
        ref_q, ref_scale, ref_summed = reference(x.cpu(), r.cpu(), w.cpu(), 1e-6, *offset_args)
        assert torch.equal(summed.cpu(), ref_summed)
    else:
        fused, reference = ((tf.rms_norm_quant_fp8_triton, fp8.rms_norm_quant_fp8) if offset is None else
                            (tf.offset_rms_norm_quant_fp8_triton, fp8.offset_rms_norm_quant_fp8))
        xq, scale = fused(x, w, 1e-6, *offset_args)
        ref_q, ref_scale = reference(x.cpu(), w.cpu(), 1e-6, *offset_args)
    assert xq.dtype == FP8 and scale.shape == (2, 5, 1)
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=2e-3, atol=0)  # the norm's rsqrt may differ in the last place
    assert_fp8_close(xq.cpu().float(), ref_q.float(), atol=0, rtol=FP8_NEIGHBOUR)


@pytest.mark.parametrize("kind", ["rms_norm", "add_rms_norm", "rms_norm_quant", "add_rms_norm_quant"])
def test_norm_weight_loaded_early_changes_nothing(kind, monkeypatch):
    # KILN_NORM_EARLY_WEIGHT: the norm weight loaded before the PDL wait (under PDL on a GPU)
    # instead of after the sum of squares: the same outputs, bit for bit.
    from kiln.kernels import triton_fp8, triton_norm

    x, r, w = randn(3, 5, 96, seed=65, dtype=HALF) * 4, randn(3, 5, 96, seed=66, dtype=HALF), randn(96, seed=67,
                                                                                                   dtype=HALF)
    launch = {"rms_norm": lambda: (rms_norm_triton(x, w, 1e-6),),
              "add_rms_norm": lambda: add_rms_norm_triton(x, r, w, 1e-6),
              "rms_norm_quant": lambda: triton_fp8.rms_norm_quant_fp8_triton(x, w, 1e-6),
              "add_rms_norm_quant": lambda: triton_fp8.add_rms_norm_quant_fp8_triton(x, r, w, 1e-6)}[kind]
    outputs = []
    for early in (False, True):
        monkeypatch.setattr(triton_norm, "NORM_EARLY_WEIGHT", early)
        monkeypatch.setattr(triton_fp8, "NORM_EARLY_WEIGHT", early)
        outputs.append([t.float() for t in launch()])
    for late, early in zip(*outputs):
        assert torch.equal(late, early)


@pytest.mark.parametrize("one_pass", [False, True])
@pytest.mark.parametrize("gelu_tanh", [False, True])  # Gemma's GeGLU: kiln::gelu_tanh_and_mul_quant_fp8
def test_silu_and_mul_quant_fp8(one_pass, gelu_tanh):
    from kiln.kernels.fp8 import gelu_tanh_and_mul_quant_fp8, silu_and_mul_quant_fp8
    from kiln.kernels.triton_fp8 import silu_and_mul_quant_fp8_triton

    gate_up = randn(7, 2 * 80, seed=64, dtype=HALF) * 3
    gate, up = gate_up[:, :80], gate_up[:, 80:]  # the halves of a merged projection, read in place
    xq, scale = silu_and_mul_quant_fp8_triton(gate, up, block=32, one_pass=one_pass, gelu_tanh=gelu_tanh)
    ref_q, ref_scale = (gelu_tanh_and_mul_quant_fp8 if gelu_tanh else silu_and_mul_quant_fp8)(gate.cpu(), up.cpu())
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=2e-3, atol=0)
    assert_fp8_close(xq.cpu().float(), ref_q.float(), atol=0, rtol=FP8_NEIGHBOUR)


def test_silu_and_mul_quant_plan():
    from kiln.kernels.triton_fp8 import silu_and_mul_quant_plan

    assert silu_and_mul_quant_plan(1, 14336) == (True, 16384, 16)  # decode: the whole row at once
    assert silu_and_mul_quant_plan(64, 80) == (True, 128, 4)
    assert silu_and_mul_quant_plan(16384, 14336) == (True, 16384, 16)  # prefill-sized too
    assert silu_and_mul_quant_plan(1, 65536)[0] is False  # a row too wide for one block


@pytest.mark.parametrize("m,bias,dot", [(1, False, False), (1, True, False), (1, True, True), (5, True, False),
                                        (16, False, False)])
def test_fp8_gemv(m, bias, dot, monkeypatch):
    from kiln.kernels import triton_fp8
    from kiln.kernels.fp8 import fp8_linear_reference, quantize_fp8_rows, quantize_fp8_rowwise
    from kiln.kernels.triton_fp8 import fp8_linear_triton
    from kiln.kernels.triton_linear import GemvConfig

    if dot:
        monkeypatch.setattr(triton_fp8, "_fp8_gemv_row_kernel", None)  # a launch of it would fail
    n, k = 40, 128
    w = randn(n, k, seed=71) * 0.1
    x = randn(1, m, k, seed=72, dtype=HALF)
    wq, ws = quantize_fp8_rowwise(w)
    xq, xs = quantize_fp8_rows(x)
    b = randn(n, seed=73, dtype=HALF) if bias else None
    # 3 column blocks, the last partial; `dot`: one row through the tl.dot kernel too
    config = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, dot=dot)
    y = fp8_linear_triton(xq, xs, wq, ws, b, HALF, config=config)
    ref = fp8_linear_reference(xq.cpu(), xs.cpu(), wq.cpu(), ws.cpu(), None if b is None else b.cpu(), torch.float32)
    assert y.shape == (1, m, n) and y.dtype == HALF
    torch.testing.assert_close(y.cpu().float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("splits,rope", [(1, False), (2, True)])
def test_paged_attention_fp8_kv_cache_scales(splits, rope):
    # Per-layer k/v scales: the write stores k / k_scale, v / v_scale, the read multiplies
    # back. K/V of magnitude ~1000 overflow e4m3 (448) at scale 1; with the scales they fit.
    kv_scale = torch.tensor([4.0, 8.0], device=DEVICE)
    batch = make_paged_batch(**MIXED, hq=4, hkv=2, d=16, block_size=4, num_blocks=24, seed=51 + splits, dtype=HALF)
    batch = {**batch, "k": batch["k"] * 300, "v": batch["v"] * 1000}
    cached = batch["kv_cache"].float() * torch.tensor([300.0, 1000.0], device=DEVICE).view(2, 1, 1, 1, 1)
    batch["kv_cache"] = (cached / kv_scale.view(2, 1, 1, 1, 1)).nan_to_num(0).to(FP8)
    ref_batch = {k: v.clone() for k, v in batch.items()}
    meta = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
    if rope:
        cos, sin = _cos_sin(batch["q"].shape[0], 16, seed=52)
        cos, sin = cos.to(HALF), sin.to(HALF)
        out = rope_paged_attention_triton(batch["q"], batch["k"], batch["v"], cos, sin, None, None, 1e-6,
                                          batch["kv_cache"], *(batch[m] for m in meta), 0.01, 0, num_splits=splits,
                                          kv_scale=kv_scale)
        q, k = rope_reference(ref_batch["q"], ref_batch["k"], cos, sin, None, None, 1e-6)
    else:
        out = paged_attention_triton(**batch, scale=0.01, sliding_window=0, num_splits=splits, kv_scale=kv_scale)
        q, k = ref_batch["q"], ref_batch["k"]
    ref = paged_attention_reference(q, k, ref_batch["v"], ref_batch["kv_cache"], *(ref_batch[m] for m in meta),
                                    0.01, 0, kv_scale=kv_scale)
    rows = int(batch["query_start_loc"][-1])
    written = batch["slot_mapping"][:rows].long()
    for kv in (0, 1):  # stored divided by the scale, well inside e4m3's range
        got = batch["kv_cache"][kv].flatten(0, 1)[written].float()
        assert got.abs().max() < 448 and got.abs().max() > 10
        assert_fp8_close(got, ref_batch["kv_cache"][kv].flatten(0, 1)[written].float(), atol=0, rtol=0)
    # The read (the interpreter's e4m3 cast is off by a step at a few elements, so on CPU over
    # the cache as the reference wrote it; on a GPU the kernels' own write too).
    from kiln.kernels.triton_paged_attention import attend_paged_triton

    read = attend_paged_triton(q, ref_batch["kv_cache"], *(ref_batch[m] for m in meta[1:]), 0.01, 0,
                               num_splits=splits, kv_scale=kv_scale)
    assert_attention_close(read, ref, batch, atol=1.0, rtol=2e-3)
    if DEVICE != "cpu":
        assert_attention_close(out, ref, batch, atol=1.0, rtol=2e-3)
    assert not out[rows:].any()
    # The cache holds the values divided by their scale: times it, they are k and v to e4m3's
    # precision (half a step: 2^-4), which at scale 1 would have saturated at 448.
    for kv, x in ((0, k), (1, ref_batch["v"])):
        back = ref_batch["kv_cache"][kv].flatten(0, 1)[written].float() * kv_scale[kv]
        assert x[:rows].float().abs().max() > 448
        torch.testing.assert_close(back, x[:rows].float(), atol=1.0, rtol=2.0 ** -4)
    with pytest.raises(ValueError, match="kv_scale must be"):
        paged_attention_reference(q, k, ref_batch["v"], ref_batch["kv_cache"], *(ref_batch[m] for m in meta),
                                  0.01, 0, kv_scale=kv_scale[:1])


def test_paged_attention_fp8_cache_query_beyond_f16_range():
    # With an e4m3 cache the dots run in f16 (kernels/triton_paged_attention.py): a bf16 query
    # past f16's 65,504 must come through scaled (by a power of two), not as inf and NaN.
    batch = make_paged_batch(**MIXED, hq=4, hkv=2, d=16, block_size=4, num_blocks=24, seed=57,
                             dtype=torch.bfloat16)
    batch["q"] = batch["q"] * 2e5
    assert batch["q"].float().abs().max() > 65504
    batch["kv_cache"] = batch["kv_cache"].float().nan_to_num(0).to(FP8)
    ref_batch = {k: v.clone() for k, v in batch.items()}
    from kiln.kernels.triton_paged_attention import attend_paged_triton

    meta = ("block_tables", "seq_lens", "query_start_loc")
    paged_attention_triton(**batch, scale=1e-5, sliding_window=0)  # writes this step's K and V
    ref = paged_attention_reference(**ref_batch, scale=1e-5, sliding_window=0)
    out = attend_paged_triton(batch["q"], ref_batch["kv_cache"], *(ref_batch[m] for m in meta), 1e-5, 0)
    assert out.isfinite().all()
    assert_attention_close(out.float(), ref.float(), batch, atol=2e-2, rtol=2e-2)


# Compiles `_paged_attention_kernel` for an H100/H200 (sm_90) at a decode tiling, as the
# launcher would for a bf16 query (a fresh process: the kernel must be defined without the
# interpreter), and counts the PTX's MMAs, conversions and shared-memory loads per variant.
# A variant: name, e4m3 cache, WIDEN_ASM, V_TRANS, stages, and whether pointers and strides
# are specialized as multiples of 16 (as at a real launch with such strides).
_ATTENTION_PTX_SCRIPT = """
import collections, json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kiln.kernels.triton_paged_attention import _paged_attention_kernel as fn
found = {}
for name, fp8, asm, v_trans, stages, divisible in json.loads(sys.argv[1]):
    consts = dict(SOFTCAP=False, ALIBI=False, KV_SCALE=fp8, GROUP=4, GROUP_PAD=4, BLOCK_T=4, BLOCK_M=16,
                  BLOCK_N=128, HEAD_DIM=128, D_PAD=128, SEQ_CHUNK=64, CACHE_BLOCK=16, NUM_SPLITS=1, FP8_CACHE=fp8,
                  WIDEN_ASM=asm, V_TRANS=v_trans, SKIP_SINGLE_TOKENS=False, MASK_ALL_BLOCKS=True, SINKS=False)
    cache = "*fp8e4nv" if fp8 else "*bf16"
    types = {"q_ptr": "*bf16", "k_cache_ptr": cache, "v_cache_ptr": cache, "out_ptr": "*bf16",
             "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "alibi_slopes_ptr": "*fp32", "kv_scale_ptr": "*fp32",
             "sinks_ptr": "*fp32",
             "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
             "scale": "fp32", "softcap": "fp32"}
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if divisible and (n.endswith("_ptr") or n.startswith("stride"))}
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": stages}).asm["ptx"]
    ops = [line.strip().split(None, 1)[-1] if line.strip().startswith("@") else line.strip() for line in ptx.splitlines()]
    found[name] = collections.Counter(op.split()[0] for op in ops if op.startswith(("cvt.", "mma.", "ld.shared", "ldmatrix")))
print(json.dumps(found))
"""


def _attention_ptx_counts(variants: list[tuple]) -> dict:
    """Per variant of `_ATTENTION_PTX_SCRIPT`, how often each counted PTX instruction occurs."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _ATTENTION_PTX_SCRIPT, json.dumps(variants)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_fp8_attention_dots_run_in_f16():
    """Over an e4m3 cache the kernel's MMAs are f16 ones, so each key and value pair widens in
    one instruction (cvt.rn.f16x2.e4m3x2). Before, the tiles went e4m3 -> f16 -> bf16 for bf16
    MMAs: 256 more `cvt.bf16.f16` per thread and tile, the likely limit of the FP8 kernel's
    1.86 TB/s against bf16's 3.8 (bench/RESULTS.md)."""
    found = _attention_ptx_counts([("bf16", False, False, False, 3, False), ("fp8", True, False, False, 3, False)])
    bf16_mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    f16_mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    assert found["bf16"].get(bf16_mma, 0) > 0 and f16_mma not in found["bf16"], found["bf16"]
    assert found["fp8"].get(f16_mma, 0) == found["bf16"][bf16_mma] and bf16_mma not in found["fp8"], found["fp8"]
    assert found["fp8"].get("cvt.rn.f16x2.e4m3x2", 0) > 0, found["fp8"]
    assert "cvt.bf16.f16" not in found["fp8"], found["fp8"]


def test_fp8_decode_tiling_moves_no_single_bytes_through_shared_memory():
    """The FP8 decode tiling (J4), compiled here for sm_90: its V tiles, widened to f16 before
    their layout change, take no byte-wide shared-memory loads; the cast after the layout
    change loads V byte by byte (128 loads per thread and tile)."""
    found = _attention_ptx_counts([("cast", True, False, False, 3, True), ("fp8_decode", True, True, True, 1, True)])
    assert found["cast"].get("ld.shared.b8", 0) >= 128, found["cast"]
    assert "ld.shared.b8" not in found["fp8_decode"], found["fp8_decode"]
    f16_mma = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
    assert found["fp8_decode"].get(f16_mma) == found["cast"].get(f16_mma) == 64


# ---- programmatic dependent launch -----------------------------------------------------------

def test_pdl_only_where_the_gpu_has_it(monkeypatch):
    from kiln.kernels import triton_common

    assert triton_common.pdl_launch_args(torch.device("cpu"), "norm") == {}
    if DEVICE == "cuda":
        hopper = torch.cuda.get_device_capability() >= (9, 0)
        later = {"PDL": True, "launch_pdl": True} if hopper and triton_common.PDL_ENABLED else {}
        first = {"PDL": triton_common.PDL_TRIGGER_FIRST, "launch_pdl": True} if later else {}
        # whatever KILN_PDL_EARLY_TRIGGER says
        monkeypatch.setattr(triton_common, "PDL_EARLY_TRIGGER", frozenset())
        assert triton_common.pdl_launch_args(torch.device("cuda"), "linear") == later
        monkeypatch.setattr(triton_common, "PDL_EARLY_TRIGGER", frozenset({"linear"}))
        assert triton_common.pdl_launch_args(torch.device("cuda"), "linear") == first
        assert triton_common.pdl_launch_args(torch.device("cuda"), "fp8") == later
    with pytest.raises(ValueError, match="unknown PDL kernel family 'gemv'"):
        triton_common.pdl_launch_args(torch.device(DEVICE), "gemv")
    monkeypatch.setattr(triton_common, "PDL_ENABLED", False)
    assert triton_common.pdl_launch_args(torch.device(DEVICE), "norm") == {}


def test_early_trigger_setting_names_kernel_families():
    from kiln.kernels import triton_common
    from kiln.kernels.triton_common import PDL_KERNEL_FAMILIES, parse_early_trigger

    assert parse_early_trigger("0") == parse_early_trigger("") == frozenset()
    assert parse_early_trigger("1") == parse_early_trigger("all") == frozenset(PDL_KERNEL_FAMILIES)
    assert parse_early_trigger(" linear, norm ,") == {"linear", "norm"}
    assert parse_early_trigger(triton_common.DEFAULT_EARLY_TRIGGER) == {"norm", "rope", "attention", "activation"}
    with pytest.raises(ValueError, match=r"unknown kernel families \['gemv'\]; use 0, 1, or a comma list of norm"):
        parse_early_trigger("linear,gemv")


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("early_trigger", ["0", "all", "linear", "norm,rope,attention,activation"])
def test_pdl_chain_in_a_cuda_graph_matches_plain_launches(monkeypatch, early_trigger):
    # 128 kernels, each reading what the one before wrote: a kernel that did not wait for its
    # predecessor (griddepcontrol.wait) would read a half-written input in some replay. Where
    # `early_trigger` (a KILN_PDL_EARLY_TRIGGER value) names a kernel's family, it lets the next
    # launch before its own wait, so a kernel two back may still run while one waits ("linear":
    # the GEMVs trigger first, the norms after their wait; the default, the other way round).
    from kiln.kernels import triton_common, triton_linear
    from kiln.kernels.triton_linear import linear_triton

    if not triton_common.uses_pdl(torch.device("cuda")):
        pytest.skip("programmatic dependent launch needs sm_90 or newer (and KILN_PDL unset or 1)")
    monkeypatch.setattr(triton_common, "PDL_EARLY_TRIGGER", triton_common.parse_early_trigger(early_trigger))
    weights = [randn(2048, 2048, seed=900 + i, dtype=torch.bfloat16) / 40 for i in range(4)]
    norm_weight = randn(2048, seed=910, dtype=torch.bfloat16)
    x0 = randn(1, 2048, seed=911, dtype=torch.bfloat16)

    def chain(x):
        for i in range(64):
            x = rms_norm_triton(linear_triton(x, weights[i % 4]), norm_weight, 1e-6)
        return x

    static_x = x0.clone()
    chain(static_x)  # compile the PDL variants outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x)
    results = []
    for _ in range(3):
        graph.replay()
        results.append(static_out.clone())
    torch.cuda.synchronize()

    monkeypatch.setattr(triton_common, "PDL_ENABLED", False)
    plain = chain(x0)
    for out in results:
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
    # The PDL launches really were compiled with the wait.
    y = torch.empty(1, 2048, dtype=torch.bfloat16, device=DEVICE)
    compiled = triton_linear._gemv_row_kernel[(2048 // 16,)](x0, weights[0], y, y, 2048, 2048, HAS_BIAS=False,
                                                             BLOCK_N=16, BLOCK_K=512, PDL=True, launch_pdl=True)
    assert "griddepcontrol.wait" in compiled.asm["ptx"]
