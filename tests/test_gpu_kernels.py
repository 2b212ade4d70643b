"""Triton kernels against their references at real shapes, on the GPU (gpu marker).

Head dims 64 and 128, GQA and MHA, KV block sizes 16 and 32, contexts up to 8k tokens,
bfloat16 and float32; the references run on the same GPU with plain torch ops. Also
checks that the ops dispatch to Triton on CUDA and that paged attention replays inside a
CUDA graph with new metadata (no host synchronisation in the launch path).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if torch.cuda.is_available():
    import kiln.kernels
    from kiln.kernels.activation import silu_and_mul_reference
    from kiln.kernels.paged_attention import paged_attention_reference
    from kiln.kernels.rms_norm import add_rms_norm_reference, rms_norm_reference
    from kiln.kernels.rope import rope_reference
    from kiln.kernels.triton_activation import silu_and_mul_triton
    from kiln.kernels.triton_norm import add_rms_norm_triton, rms_norm_triton
    from kiln.kernels.triton_paged_attention import paged_attention_triton, rope_paged_attention_triton
    from kiln.kernels.triton_rope import rope_triton
    from test_kernels_triton import assert_attention_close, assert_cache_matches, make_paged_batch

DEV = "cuda"


def randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEV, dtype=torch.float32).to(dtype)


def rounding_report(out: torch.Tensor, ref: torch.Tensor, what: str, limit: int = 8) -> str:
    """How out departs from ref: the share of differing elements, the distance in units in
    the last place of out's dtype, and the first differing positions."""
    differ = out != ref
    n = int(differ.sum())
    if n == 0:
        return f"{what}: bit-identical to the reference"
    refs = ref.float()
    _, exponent = torch.frexp(refs)
    # Spacing of out's dtype around ref: 2^(e-1) * eps for |ref| in [2^(e-1), 2^e).
    ulp = torch.finfo(out.dtype).eps * torch.ldexp(torch.ones_like(refs), exponent - 1)
    ulps = ((out.float() - refs).abs() / ulp)[differ]
    lines = [f"{what}: {n / out.numel():.3%} of {out.numel()} elements differ from the reference; "
             f"distance in {out.dtype} ulps: max {ulps.max().item():.3g}, "
             f"share within 1 ulp {(ulps <= 1).float().mean().item():.1%}"]
    for idx in differ.nonzero()[:limit].tolist():
        lines.append(f"  at {tuple(idx)}: got {out[tuple(idx)].item():.6g}, expected {ref[tuple(idx)].item():.6g}")
    return "\n".join(lines)


def assert_rounds_like_reference(out: torch.Tensor, ref: torch.Tensor, what: str = "output") -> None:
    """Close, and for half precision rounded where the eager graph rounds: a missing or an
    extra rounding step (e.g. an FMA that skips a product's rounding) flips ~15-20% of the
    last bits; float32 rsqrt/exp of another library flip well under 1%."""
    torch.testing.assert_close(out, ref, atol=2e-2 if out.dtype == torch.bfloat16 else 1e-5, rtol=2e-2,
                               msg=lambda m: f"{m}\n{rounding_report(out, ref, what)}")
    differing = (out != ref).float().mean().item()
    if out.dtype != torch.float32:
        assert differing <= 0.01, rounding_report(out, ref, what)


def test_triton_kernels_are_registered_for_cuda():
    assert kiln.kernels.triton_kernels_available()
    x, w = randn(4, 256, seed=0, dtype=torch.bfloat16), randn(256, seed=1, dtype=torch.bfloat16)
    # Dispatch reaches the Triton kernel: same result as calling it directly.
    torch.testing.assert_close(torch.ops.kiln.rms_norm(x, w, 1e-5), rms_norm_triton(x, w, 1e-5), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [4096, 8192])
def test_rms_norm_real_shapes(dtype, hidden):
    x, r = randn(1, 300, hidden, seed=1, dtype=dtype), randn(1, 300, hidden, seed=2, dtype=dtype)
    w = randn(hidden, seed=3, dtype=dtype)
    assert_rounds_like_reference(rms_norm_triton(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
    out, summed = add_rms_norm_triton(x, r, w, 1e-5)
    ref_out, ref_sum = add_rms_norm_reference(x, r, w, 1e-5)
    torch.testing.assert_close(summed, ref_sum, atol=0, rtol=0)
    assert_rounds_like_reference(out, ref_out)


@pytest.mark.parametrize("head_dim,hq,hkv", [(128, 32, 8), (64, 16, 16), (128, 64, 8)])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_real_shapes(head_dim, hq, hkv, with_norm):
    t, dt = 257, torch.bfloat16
    merged = randn(t, (hq + 2 * hkv) * head_dim, seed=4, dtype=dt)  # q, k as slices of a merged QKV
    q = merged[:, : hq * head_dim].view(t, hq, head_dim)
    k = merged[:, hq * head_dim: (hq + hkv) * head_dim].view(t, hkv, head_dim)
    pos = torch.arange(t, device=DEV).float() * 7
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    qw = randn(head_dim, seed=5, dtype=dt) if with_norm else None
    kw = randn(head_dim, seed=6, dtype=dt) if with_norm else None
    outs, refs = rope_triton(q, k, cos, sin, qw, kw, 1e-6), rope_reference(q, k, cos, sin, qw, kw, 1e-6)
    for what, out, ref in zip(("rotated q [T, Hq, D]", "rotated k [T, Hkv, D]"), outs, refs):
        assert_rounds_like_reference(out, ref, what)


@pytest.mark.parametrize("inter", [14336, 11008])
def test_silu_and_mul_real_shapes(inter):
    merged = randn(1, 129, 2 * inter, seed=7, dtype=torch.bfloat16)
    gate, up = merged[..., :inter], merged[..., inter:]
    assert_rounds_like_reference(silu_and_mul_triton(gate, up), silu_and_mul_reference(gate, up))


ATTN_CASES = [
    # head_dim, hq, hkv, block_size
    (128, 32, 8, 16),   # Llama-3-8B
    (128, 32, 8, 32),
    (64, 16, 16, 16),   # MHA, head dim 64
    (64, 32, 4, 32),    # group of 8
]


@pytest.mark.parametrize("head_dim,hq,hkv,block_size", ATTN_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_decode_long_context(head_dim, hq, hkv, block_size, dtype):
    # Small-batch decode over long contexts: the split-K path.
    cached = [8191, 4000, 1500, 17]
    batch = make_paged_batch(new_tokens=[1] * 4, cached=cached, hq=hq, hkv=hkv, d=head_dim, block_size=block_size,
                             num_blocks=sum(c // block_size + 2 for c in cached) + 2, seed=head_dim + hq,
                             dtype=dtype, device=DEV)
    _check(batch, head_dim, dtype, window=0)


@pytest.mark.parametrize("head_dim,hq,hkv,block_size", ATTN_CASES)
def test_paged_attention_prefill_continuing_prefix(head_dim, hq, hkv, block_size):
    # Chunked prefill after a cached prefix, a fresh prefill, decodes and padding, in one step.
    new, cached = [700, 1024, 1, 1, 0], [1300, 0, 2047, 60, 0]
    batch = make_paged_batch(new_tokens=new, cached=cached, hq=hq, hkv=hkv, d=head_dim, block_size=block_size,
                             num_blocks=sum((n + c) // block_size + 2 for n, c in zip(new, cached)) + 2,
                             pad_tokens=5, seed=3, dtype=torch.bfloat16, device=DEV)
    _check(batch, head_dim, torch.bfloat16, window=0)


def test_paged_attention_sliding_window_long():
    batch = make_paged_batch(new_tokens=[300, 1], cached=[3000, 5000], hq=32, hkv=8, d=128, block_size=16,
                             num_blocks=560, seed=5, dtype=torch.bfloat16, device=DEV)
    _check(batch, 128, torch.bfloat16, window=1024)


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("new_tokens,cached", [([1, 1, 1], [4000, 700, 33]), ([500, 1, 0], [900, 3000, 0])])
def test_rope_paged_attention_real_shapes(with_norm, new_tokens, cached):
    hq, hkv, d, bs, dt = 32, 8, 128, 16, torch.bfloat16
    batch = make_paged_batch(new_tokens=new_tokens, cached=cached, hq=hq, hkv=hkv, d=d, block_size=bs,
                             num_blocks=sum((n + c) // bs + 2 for n, c in zip(new_tokens, cached)) + 2, pad_tokens=3,
                             seed=17, dtype=dt, device=DEV)
    t = batch["q"].shape[0]
    pos = torch.arange(t, device=DEV).float() * 3
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos().to(dt), emb.sin().to(dt)
    norms = (randn(d, seed=18, dtype=dt), randn(d, seed=19, dtype=dt)) if with_norm else (None, None)
    ref_batch = {k: v.clone() for k, v in batch.items()}
    meta = [batch[n] for n in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")]
    out = rope_paged_attention_triton(batch["q"], batch["k"], batch["v"], cos, sin, *norms, 1e-6, batch["kv_cache"],
                                      *meta, d ** -0.5, 0)
    q_rot, k_rot = rope_reference(ref_batch["q"], ref_batch["k"], cos, sin, *norms, 1e-6)
    ref = paged_attention_reference(q_rot, k_rot, ref_batch["v"], ref_batch["kv_cache"], *meta, d ** -0.5, 0)
    assert_attention_close(out, ref, batch, atol=2e-2, rtol=2e-2)
    # Every slot but the null block's (padded tokens race for it: see assert_cache_matches)
    # holds the reference's K/V, the rotated keys rounded like the eager graph's.
    assert_cache_matches(batch["kv_cache"], ref_batch["kv_cache"], batch, atol=2e-2, rtol=2e-2)
    cache, ref_cache = batch["kv_cache"][:, 1:], ref_batch["kv_cache"][:, 1:]
    written = ~torch.isnan(ref_cache)  # never-written slots hold NaN in both
    assert_rounds_like_reference(cache[0][written[0]], ref_cache[0][written[0]], "rotated keys in the cache")
    assert torch.equal(cache[1][written[1]], ref_cache[1][written[1]]), "values in the cache"


def _check(batch: dict, head_dim: int, dtype: torch.dtype, window: int) -> None:
    ref_batch = {k: v.clone() for k, v in batch.items()}
    scale = head_dim ** -0.5
    out = paged_attention_triton(**batch, scale=scale, sliding_window=window)
    ref = paged_attention_reference(**ref_batch, scale=scale, sliding_window=window)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
    assert_attention_close(out, ref, batch, atol=tol, rtol=tol)
    # The write is a copy: exact, outside the null block that padded tokens race for.
    assert_cache_matches(batch["kv_cache"], ref_batch["kv_cache"], batch)


def test_paged_attention_replays_in_a_cuda_graph():
    """Captured once, replayed with other sequence lengths and slots: results follow the data."""
    hq, hkv, d, bs = 32, 8, 128, 16
    batch = make_paged_batch(new_tokens=[1, 1], cached=[100, 900], hq=hq, hkv=hkv, d=d, block_size=bs,
                             num_blocks=80, seed=11, dtype=torch.bfloat16, device=DEV)
    static = {k: v.clone() for k, v in batch.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.kiln.paged_attention(**static, scale=d ** -0.5, sliding_window=0)  # warm-up compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.kiln.paged_attention(**static, scale=d ** -0.5, sliding_window=0)
    # New step: both sequences grew by one token (same blocks, next slot), new q/k/v.
    step = {k: v.clone() for k, v in static.items()}
    step["seq_lens"] += 1
    step["slot_mapping"] += 1
    for name in ("q", "k", "v"):
        step[name] = torch.randn_like(step[name])
    for name, value in step.items():
        if name != "kv_cache":
            static[name].copy_(value)
    reference_cache = static["kv_cache"].clone()
    graph.replay()
    expected = paged_attention_reference(**{**step, "kv_cache": reference_cache}, scale=d ** -0.5, sliding_window=0)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
