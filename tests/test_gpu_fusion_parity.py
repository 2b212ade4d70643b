"""On the GPU, with the default pipeline (every fusion on, Triton kernels), the tiny models
match the CPU reference path: float32 greedy tokens equal Hugging Face's on CPU, bfloat16
logits stay within bf16 noise of the CPU float32 graph (gpu marker)."""

from __future__ import annotations

import pytest
import torch

from test_fusion_passes import BLOCK_SIZE, LAYERS, assert_greedy_equals_hf, build, run_steps

pytestmark = pytest.mark.gpu

ARCHS = ["llama", "llama3.1", "qwen2", "qwen3", "mistral", "mixtral"]
# Every architecture through the eager graph (the Triton kernels, no Inductor), and two
# through Inductor (standalone artifacts on CUDA) with a two-bucket plan: the prompts' prefill
# fits tokens-64 and their decode decode-4 (compiling every default bucket takes minutes).
CASES = [(arch, "eager") for arch in ARCHS] + [("llama3.1", "inductor"), ("qwen3", "inductor")]


@pytest.mark.parametrize("arch,compile_mode", CASES)
def test_gpu_float32_greedy_equals_hf_cpu(arch, compile_mode, tiny_model_dir, tmp_path):
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine

    path, hf = tiny_model_dir(arch)
    buckets = ([4], [64]) if compile_mode == "inductor" else ([1, 2, 4], [16, 32, 64])
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_kv_blocks=64,
                                    block_size=BLOCK_SIZE, progress=False, compile=compile_mode,
                                    cache_dir=str(tmp_path / "cache"), max_num_seqs=4, max_num_batched_tokens=64,
                                    decode_buckets=buckets[0], token_buckets=buckets[1]))
    if engine.graph is not None:  # None only on a cache hit, which a fresh cache_dir rules out
        ran = {r.name: r.stats for r in engine.graph.report.records}
        assert ran["fuse_rmsnorm"]["add_rms_norm"] == 2 * LAYERS  # fusions are on by default on CUDA
    prompts = [[3, 17, 99, 4, 60, 12, 7, 45, 81, 2, 33, 90, 14, 5, 66, 71, 8, 23], [5, 77, 21], [9]]
    assert_greedy_equals_hf(engine, hf, prompts, 12, arch)


# (OLMo 2: float32 cos/sin beside bfloat16 heads, the RoPE kernel's F32_TABLES folded into the attention.)
@pytest.mark.parametrize("arch", ["llama3.1", "qwen3", "qwen2", "olmo2"])
def test_gpu_bfloat16_logits_near_cpu_float32(arch, tiny_model_dir):
    from kiln.passes.manager import PassManager

    _, hf = tiny_model_dir(arch)
    gpu = build(arch, torch.bfloat16, *[p for p in PassManager.default().passes
                                         if p.phase == "fusion"], device="cuda")
    assert any(r.stats.get("rope") or r.stats.get("qk_norm_rope") for r in gpu.report.records)
    assert any(r.stats.get("kv_write_fused") for r in gpu.report.records)  # OLMo 2's too, through its casts
    cpu = build(arch, torch.float32)
    checked = 0
    for step, (ref, out) in enumerate(zip(run_steps(cpu, hf, torch.float32),
                                         run_steps(gpu, hf, torch.bfloat16, device="cuda"))):
        torch.testing.assert_close(out, ref, atol=0.1, rtol=0.05)
        # Logits are [batch, tokens, vocab]: the greedy choice is per token, over the vocab.
        top2 = ref.topk(2, dim=-1).values
        margin = top2[..., 0] - top2[..., 1]
        clear = margin > 0.2  # tokens whose greedy choice is not a near-tie
        same = out.argmax(-1) == ref.argmax(-1)
        flipped = (clear & ~same).nonzero().tolist()
        assert not flipped, (
            f"step {step}: greedy token differs at (batch, token) {flipped}; margins there "
            f"{[round(margin[tuple(i)].item(), 3) for i in flipped]}, max |bf16 - fp32| there "
            f"{[round((out - ref)[tuple(i)].abs().max().item(), 3) for i in flipped]}")
        checked += int(clear.sum())
    assert checked > 0, "every token was a near-tie: the greedy check compared nothing"
