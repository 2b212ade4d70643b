"""The fused ops' references against Hugging Face's own modules, and each op's registration.

The references are the CPU implementations and the ground truth the Triton kernels are
tested against, so they must compute exactly what the eager model computes.
`torch.library.opcheck` checks schema, fake implementation and dispatch of every op.
"""

from __future__ import annotations

import pytest
import torch

import kiln.kernels  # noqa: F401  (registers the ops)
from kiln.kernels.rope import rope_reference

kiln_ops = torch.ops.kiln


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_ops_equal_hf_module(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(48, seed=0))
    x, residual = _randn(2, 3, 48, seed=1, dtype=dtype), _randn(2, 3, 48, seed=2, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(kiln_ops.rms_norm(x, norm.weight, 1e-5), norm(x), atol=0, rtol=0)
        out, summed = kiln_ops.add_rms_norm(x, residual, norm.weight, 1e-5)
        torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
        torch.testing.assert_close(out, norm(x + residual), atol=0, rtol=0)


@pytest.mark.parametrize("module", ["gemma3.modeling_gemma3.Gemma3RMSNorm",
                                    "qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offset_rms_norm_ops_equal_hf_module(dtype, module):
    """Gemma's and Qwen3-Next's norm (weights as offsets from 1, one rounding): bit for bit."""
    import importlib

    path, _, name = module.rpartition(".")
    norm = getattr(importlib.import_module(f"transformers.models.{path}"), name)(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(48, seed=0) * 0.3)
    x, residual = _randn(2, 3, 48, seed=1, dtype=dtype), _randn(2, 3, 48, seed=2, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(kiln_ops.offset_rms_norm(x, norm.weight, 1e-6, 1.0), norm(x), atol=0, rtol=0)
        out, summed = kiln_ops.add_offset_rms_norm(x, residual, norm.weight, 1e-6, 1.0)
        torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
        torch.testing.assert_close(out, norm(x + residual), atol=0, rtol=0)
        if dtype == torch.bfloat16:  # the Llama form (the norm rounded before the weight) differs
            assert not torch.equal(kiln_ops.rms_norm(x, norm.weight + 1, 1e-6), norm(x))


@pytest.mark.parametrize("module", ["gpt_oss.modeling_gpt_oss.GptOssRMSNorm", "olmo2.modeling_olmo2.Olmo2RMSNorm",
                                    "nemotron_h.modeling_nemotron_h.NemotronHRMSNorm"])
def test_fp32_weight_rms_norms_are_the_offset_op_at_zero(module):
    """GPT-OSS's, OLMo2's and Nemotron-H's norms (the weight joined in float32, one rounding):
    `kiln::offset_rms_norm` with offset 0, bit for bit in bfloat16, where Llama's op differs."""
    import importlib

    path, _, name = module.rpartition(".")
    norm = getattr(importlib.import_module(f"transformers.models.{path}"), name)(48, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_randn(48, seed=0))
    x, residual = _randn(2, 3, 48, seed=1, dtype=torch.bfloat16), _randn(2, 3, 48, seed=2, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(kiln_ops.offset_rms_norm(x, norm.weight, 1e-6, 0.0), norm(x), atol=0, rtol=0)
        out, _ = kiln_ops.add_offset_rms_norm(x, residual, norm.weight, 1e-6, 0.0)
        torch.testing.assert_close(out, norm(x + residual), atol=0, rtol=0)
        assert not torch.equal(kiln_ops.rms_norm(x, norm.weight, 1e-6), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_op_equals_hf_module(dtype):
    """Qwen3-Next's gated norm (norm, weight, then SiLU(gate) in float32): bit for bit."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    norm = Qwen3NextRMSNormGated(16, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(16, seed=0))
    x, gate = _randn(3, 4, 16, seed=1, dtype=dtype), _randn(3, 4, 16, seed=2, dtype=dtype)
    with torch.no_grad():
        torch.testing.assert_close(kiln_ops.gated_rms_norm(x, gate, norm.weight, 1e-6), norm(x, gate), atol=0, rtol=0)
    with pytest.raises(ValueError, match="differ in shape"):
        kiln_ops.gated_rms_norm(x, gate[:, :2], norm.weight, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_op_equals_hf_rotary_with_qwen3_norm(dtype):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    t, hq, hkv, d = 5, 4, 2, 16
    q, k = _randn(1, t, hq, d, seed=3, dtype=dtype), _randn(1, t, hkv, d, seed=4, dtype=dtype)
    cos, sin = _randn(1, t, d, seed=5, dtype=dtype), _randn(1, t, d, seed=6, dtype=dtype)
    q_norm, k_norm = Qwen3RMSNorm(d, eps=1e-6).to(dtype), Qwen3RMSNorm(d, eps=1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(_randn(d, seed=7))
        k_norm.weight.copy_(_randn(d, seed=8))
        hf_q, hf_k = apply_rotary_pos_emb(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)
        out_q, out_k = kiln_ops.rope(q[0], k[0], cos[0], sin[0], q_norm.weight, k_norm.weight, 1e-6)
        plain_q, _ = kiln_ops.rope(q[0], k[0], cos[0], sin[0], None, None, 1e-6)
        hf_plain_q, _ = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    torch.testing.assert_close(out_q, hf_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(out_k, hf_k[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(plain_q, hf_plain_q[0].transpose(0, 1), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_rope_op_equals_hf_rotary(dtype):
    """Partial rotary (GLM-4.5's / Qwen3-Next's apply_rotary_pos_emb: cos/sin of R < D, the
    first R dims rotated, the rest passed): bit for bit; cos/sin of another odd width refused."""
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    t, hq, hkv, d, r = 5, 4, 2, 16, 8
    q, k = _randn(1, t, hq, d, seed=3, dtype=dtype), _randn(1, t, hkv, d, seed=4, dtype=dtype)
    cos, sin = _randn(1, t, r, seed=5, dtype=dtype), _randn(1, t, r, seed=6, dtype=dtype)
    with torch.no_grad():
        hf_q, hf_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        out_q, out_k = kiln_ops.rope(q[0], k[0], cos[0], sin[0], None, None, 1e-6)
    torch.testing.assert_close(out_q, hf_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(out_k, hf_k[0].transpose(0, 1), atol=0, rtol=0)
    with pytest.raises(ValueError, match="even R"):
        kiln_ops.rope(q[0], k[0], cos[0, :, :5], sin[0, :, :5], None, None, 1e-6)


def test_silu_and_mul_equals_hf_mlp_activation():
    from transformers.activations import ACT2FN

    gate, up = _randn(3, 40, seed=9, dtype=torch.bfloat16), _randn(3, 40, seed=10, dtype=torch.bfloat16)
    torch.testing.assert_close(kiln_ops.silu_and_mul(gate, up), ACT2FN["silu"](gate) * up, atol=0, rtol=0)


def test_ops_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="weight of shape"):
        kiln_ops.rms_norm(_randn(2, 8, seed=0), _randn(4, seed=1), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        kiln_ops.add_rms_norm(_randn(2, 8, seed=0), _randn(3, 8, seed=1), _randn(8, seed=2), 1e-6)
    with pytest.raises(ValueError, match="differ in shape"):
        kiln_ops.silu_and_mul(_randn(2, 8, seed=0), _randn(2, 9, seed=1))
    with pytest.raises(ValueError, match="cos/sin"):
        kiln_ops.rope(_randn(3, 2, 8, seed=0), _randn(3, 1, 8, seed=1), _randn(2, 8, seed=2), _randn(2, 8, seed=3),
                      None, None, 1e-6)


@pytest.mark.parametrize("op,args", [
    (kiln_ops.rms_norm.default, (_randn(3, 16, seed=0), _randn(16, seed=1), 1e-6)),
    (kiln_ops.add_rms_norm.default, (_randn(3, 16, seed=0), _randn(3, 16, seed=2), _randn(16, seed=1), 1e-6)),
    (kiln_ops.rope.default, (_randn(3, 4, 8, seed=0), _randn(3, 2, 8, seed=1), _randn(3, 8, seed=2),
                             _randn(3, 8, seed=3), _randn(8, seed=4), _randn(8, seed=5), 1e-6)),
    (kiln_ops.rope.default, (_randn(3, 4, 8, seed=0), _randn(3, 2, 8, seed=1), _randn(3, 8, seed=2),
                             _randn(3, 8, seed=3), None, None, 1e-6)),
    (kiln_ops.silu_and_mul.default, (_randn(3, 16, seed=0), _randn(3, 16, seed=1))),
    (kiln_ops.rope_paged_attention.default, (
        _randn(3, 4, 8, seed=0), _randn(3, 2, 8, seed=1), _randn(3, 2, 8, seed=2), _randn(3, 8, seed=3),
        _randn(3, 8, seed=4), None, None, 1e-6, torch.zeros(2, 3, 4, 2, 8), torch.tensor([4, 5, 6]),
        torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32), 0.35, 0)),
], ids=["rms_norm", "add_rms_norm", "rope_norm", "rope", "silu_and_mul", "rope_paged_attention"])
def test_opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_rope_reference_is_a_rotation():
    # Rotation preserves each (d, d + D/2) pair's norm when cos^2 + sin^2 = 1.
    t, d = 4, 8
    angles = _randn(t, d // 2, seed=11)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q = _randn(t, 2, d, seed=12)
    out, _ = rope_reference(q, q, cos, sin, None, None, 1e-6)
    pair_norm = lambda x: x[..., : d // 2] ** 2 + x[..., d // 2:] ** 2  # noqa: E731
    torch.testing.assert_close(pair_norm(out), pair_norm(q))
