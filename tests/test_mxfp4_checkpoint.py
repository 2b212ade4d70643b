"""MXFP4 checkpoints (GPT-OSS's release format): the experts' FP4 blocks and e8m0 scales
dequantize exactly as transformers' own MXFP4 code does, and a tiny GPT-OSS saved in that
format gives Hugging Face's logits and greedy tokens (HF dequantizing on load, as it does
without an MXFP4 kernel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_parity import NEW_TOKENS, PROMPTS, assert_first_step_logits_match, hf_greedy
from tiny_models import save_tiny_model

from kiln.compiler.capture import capture
from kiln.compiler.model_source import resolve_model
from kiln.compiler.mxfp4_checkpoint import (MXFP4CheckpointError, dequantize_mxfp4, expert_tensor_from_mxfp4,
                                            quantize_mxfp4)
from kiln.runtime import LLM, SamplingParams

pytest.importorskip("transformers.integrations.mxfp4")


def test_dequantize_known_values() -> None:
    # Byte 0x21: low nibble 1 (0.5) first, high nibble 2 (1.0); 0xF8: -0.0 then -6.0. Scale
    # 128 is 2^1, 125 is 2^-2.
    blocks = torch.zeros(2, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[1, 0, 0] = 0x21, 0xF8
    scales = torch.tensor([[128], [125]], dtype=torch.uint8)
    out = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert out.shape == (2, 32)
    assert out[0, :2].tolist() == [1.0, 2.0] and out[1, :2].tolist() == [0.0, -1.5]
    assert out[:, 2:].abs().sum() == 0


def test_dequantize_equals_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    weight = torch.randn(3, 48, 64) * torch.logspace(-3, 1, 48)[None, :, None]  # rows of very different ranges
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (3, 48, 2, 16) and scales.shape == (3, 48, 2)
    ours = expert_tensor_from_mxfp4(blocks, scales, torch.bfloat16)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    assert ours.shape == (3, 64, 48)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # The round trip is FP4-accurate: within half e2m1's largest step (4 to 6) times the block's
    # scale, which is at most a third of the block's largest magnitude (it maps that into (3, 6]).
    err = (ours.float().transpose(1, 2) - weight).abs().reshape(3, 48, 2, 32).amax(-1)
    assert (err <= weight.abs().reshape(3, 48, 2, 32).amax(-1) / 3.0 + 1e-6).all()
    assert err.max() > 0  # (and it is lossy: the check above is not vacuous)


def test_mismatched_blocks_are_refused() -> None:
    with pytest.raises(MXFP4CheckpointError, match="do not match scales"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8), torch.float32)


def save_mxfp4_gpt_oss(path: Path) -> None:
    """A tiny GPT-OSS as OpenAI's checkpoints are: experts as MXFP4 blocks and scales."""
    save_tiny_model("gpt_oss", path)
    tensors = load_file(str(path / "model.safetensors"))
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))  # stored [E, out, in]
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


def test_mxfp4_gpt_oss_matches_hf(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    save_mxfp4_gpt_oss(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    # The loader builds each expert tensor from its blocks and scales, equal to HF's.
    source = resolve_model(tmp_path)
    captured = capture(source.config)
    weights = source.load_weights(captured.param_aliases, torch.float32, "cpu", progress=False)
    hf_params = dict(hf.named_parameters())
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        torch.testing.assert_close(weights[name], hf_params[name], rtol=0, atol=0, msg=name)

    llm = LLM(str(tmp_path), dtype="float32", device="cpu")
    assert_first_step_logits_match(llm, hf, PROMPTS, "MXFP4 gpt_oss")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS)


def test_mxfp4_gpt_oss_at_tp2_gives_tp1_tokens(tmp_path: Path) -> None:
    """GPT-OSS at tensor_parallel_size=2 (two CPU workers over gloo) from the MXFP4 checkpoint:
    each rank dequantizes the experts and reads its slices (its gate/up channel pairs, its
    heads' sinks, the down projection's bias on rank 0 only); greedy tokens equal TP=1's."""
    save_mxfp4_gpt_oss(tmp_path)
    options = dict(progress=False, max_model_len=128, max_num_seqs=8)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **options).generate(PROMPTS, greedy)]
    llm = LLM(str(tmp_path), tensor_parallel_size=2, **options)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)] == expected
    finally:
        llm.engine.shutdown()
