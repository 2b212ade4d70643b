"""The constructs issue 18 added, on the GPU: Triton kernels (every fusion on, as on CUDA by
default) and CUDA-graph decode, float32, must give the CPU reference path's greedy tokens
and Hugging Face's (gpu marker; skipped without CUDA).

    gemma2       attention + final-logit soft-capping, windowed layers mixed with global ones
    phi          partial rotary (1/2), parallel attention/MLP block, LayerNorm with bias
    gpt_neox     partial rotary (1/4), parallel residual, fused qkv
    gpt_bigcode  multi-query attention (one KV head), learned absolute positions
    cohere2      windowed RoPE layers mixed with global layers without RoPE, parallel block
    smollm3      layers without RoPE
    bloom        ALiBi (6 heads), attention written inline (capture's inline_attention pass)
    falcon_rw    ALiBi folded into the model's own SDPA mask
    falcon       multi-query, parallel block, attention through the model's own SDPA call
    codegen      QKV in mp_num blocks; inline attention with the mask added before the scaling
                 on transformers 5.17 (the GPU image's version), the interface's on 5.24+
    glm4_moe, ernie4_5_moe, minimax_m2, phimoe, granitemoe
                 MoE routers other than softmax + top-k (`kiln::moe_experts` on the Triton
                 kernels), selection biases read from the checkpoint; GLM-4.5's float32 router
                 in a bfloat16 model
    deepseek_v3, glm4_moe_lite
                 multi-head latent attention: K of 24 dims and V of 16 per head, cached padded
                 to 24 (the kernels' head-size padding past a power of two), DeepSeek-V3 routing
    gpt_oss      attention sinks (the general attention kernel, not the keys-as-rows decode),
                 biased experts with the clamped SwiGLU in the MoE kernels' epilogues
    mamba, jamba Mamba's selective scan on its Triton kernel (every step kind), the convolution's
                 decode kernel with SiLU; Mamba without any attention layer (an empty KV cache)
    mamba2, falcon_h1
                 Mamba2's own model (no attention); Falcon-H1's attention and Mamba2 side by side
    olmo_hybrid  the gated DeltaNet's decode kernel with beta doubled
    gemma4_text, gemma4_e2b, gemma4_moe, gemma3n_text
                 a KV cache shape per layer (global layers' own head size and KV heads), layers
                 attending over another layer's cache, GELU-tanh experts in the MoE kernels
    mimo_v2_flash
                 windowed layers with twice the KV heads, values narrower than keys, sinks

Architectures the GPU image's transformers lacks are skipped.
"""

from __future__ import annotations

import pytest
import torch
from test_parity import NEW_TOKENS, PROMPTS, hf_greedy
from tiny_models import SUPPORTED

from kiln.runtime import LLM, SamplingParams

pytestmark = pytest.mark.gpu

MOE_ROUTER_ARCHS = ["glm4_moe", "ernie4_5_moe", "minimax_m2", "phimoe", "granitemoe", "deepseek_v3", "glm4_moe_lite"]
ARCHS = ["gemma2", "phi", "gpt_neox", "gpt_bigcode", "cohere2", "smollm3", "bloom", "falcon_rw", "falcon",
         "codegen", *MOE_ROUTER_ARCHS, "gpt_oss", "qwen3_next", "qwen3_5", "granitemoehybrid", "nemotron_h",
         "mamba", "jamba", "mamba2", "falcon_h1", "olmo_hybrid", "gemma4_text", "gemma4_e2b", "gemma4_moe",
         "gemma3n_text", "mimo_v2_flash"]


@pytest.mark.parametrize("arch", ARCHS)
def test_gpu_greedy_equals_cpu_reference_and_hf(arch: str, tiny_model_dir) -> None:
    if arch not in SUPPORTED:
        pytest.skip(f"this transformers has no {arch}")
    path, hf = tiny_model_dir(arch)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    cpu = LLM(str(path), device="cpu", dtype="float32", progress=False)
    gpu = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=8, progress=False)
    cpu_out = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, params)]
    gpu_out = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, params)]
    assert gpu_out == cpu_out, f"{arch}: CUDA (Triton, CUDA graphs) tokens differ from the CPU reference"
    replays = {k: v for k, v in gpu.engine.runner.bucket_counts.items() if k.startswith("cudagraph-decode")}
    assert sum(replays.values()) >= NEW_TOKENS - 2, replays  # decode steps replayed CUDA graphs
    for prompt, toks in zip(PROMPTS, cpu_out):
        assert toks == hf_greedy(hf, prompt, NEW_TOKENS), f"{arch}: tokens differ from Hugging Face"
    if arch == "gemma2":
        # The soft-cap reached the CUDA graph's attention ops (the Triton kernel honours it).
        records = {r["name"]: r["stats"] for r in gpu.engine.graph_spec.pass_records}
        assert records["paged_kv"]["attention_replaced"] == 2
        assert hf.config.attn_logit_softcapping > 0
    if arch in ("bloom", "falcon_rw"):
        # The compiled graphs take the ALiBi slopes (their attention runs the Triton kernel's ALIBI path).
        assert "constant:alibi_slopes" in gpu.engine.graph_spec.input_roles
        assert gpu.engine.graph_spec.constants["alibi_slopes"].abs().min() > 0
    if arch in MOE_ROUTER_ARCHS:
        records = {r["name"]: r["stats"] for r in gpu.engine.graph_spec.pass_records}
        assert records["fuse_moe"]["moe_experts"] >= 1, records["fuse_moe"]


def test_gpu_bfloat16_model_keeps_its_float32_router(tiny_model_dir) -> None:
    """GLM-4.5 keeps its router weight in float32 in a bfloat16 model (its forward multiplies
    float32 hidden states by it): the loader must read it so, or the router's GEMM fails."""
    if "glm4_moe" not in SUPPORTED:
        pytest.skip("this transformers has no glm4_moe")
    from transformers import AutoModelForCausalLM

    path, hf = tiny_model_dir("glm4_moe")
    with torch.device("meta"):  # which parameters this transformers keeps in float32 in a bf16 model
        kept = {n for n, p in AutoModelForCausalLM.from_config(hf.config, dtype=torch.bfloat16).named_parameters()
                if p.dtype == torch.float32}
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=8, progress=False)
    assert set(llm.engine.graph_spec.param_dtypes) == kept
    assert all(d == torch.float32 for d in llm.engine.graph_spec.param_dtypes.values())
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)
