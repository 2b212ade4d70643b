"""Real checkpoint layouts, as transformers' own `save_pretrained` writes them, read by Kiln's
loader: every tensor the captured graph takes comes back equal to the Hugging Face model's
own parameter. The layouts are checked to be the ones claimed (fused qkv, Conv1D, tied or
untied heads, biases, names transformers changes on save), so a loader that only handled
Llama-style checkpoints fails here, before any parity test."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from kiln.compiler.capture import capture
from kiln.compiler.model_source import resolve_model

# arch -> (tensor names that must be in the saved file, names that must not be there)
LAYOUTS: dict[str, tuple[list[str], list[str]]] = {
    # Phi-3: one fused qkv_proj and one fused gate_up_proj per layer.
    "phi3": (["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"],
             ["model.layers.0.self_attn.q_proj.weight"]),
    # GPT-NeoX: fused query_key_value with bias; the LM head saved as embed_out (transformers 5
    # calls it lm_head in the module tree).
    "gpt_neox": (["gpt_neox.layers.0.attention.query_key_value.weight",
                  "gpt_neox.layers.0.attention.query_key_value.bias", "embed_out.weight"], ["lm_head.weight"]),
    # GPT-2: Conv1D c_attn (fused qkv, [in, out]) with bias; tied head not stored.
    "gpt2": (["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias", "transformer.wpe.weight"],
             ["lm_head.weight"]),
    # Qwen2: q/k/v biases, tied embeddings (no lm_head tensor).
    "qwen2": (["model.layers.0.self_attn.q_proj.bias"], ["lm_head.weight"]),
    # Phi: biases everywhere, untied head with its own bias.
    "phi": (["model.layers.0.self_attn.dense.bias", "lm_head.bias", "model.final_layernorm.bias"], []),
    # GPT-BigCode multi-query: one fused c_attn of hidden + 2 * head_dim rows.
    "gpt_bigcode": (["transformer.h.0.attn.c_attn.weight"], ["lm_head.weight"]),
    # Bloom: fused query_key_value (heads interleaved q/k/v) with bias, embedding LayerNorm, tied head.
    "bloom": (["transformer.h.0.self_attention.query_key_value.weight",
               "transformer.h.0.self_attention.query_key_value.bias", "transformer.word_embeddings_layernorm.weight"],
              ["lm_head.weight"]),
    # Falcon (7B layout): multi-query fused query_key_value without bias, tied head.
    "falcon": (["transformer.h.0.self_attention.query_key_value.weight"],
               ["transformer.h.0.self_attention.query_key_value.bias", "lm_head.weight"]),
    # Falcon-RW: fused query_key_value with bias, sequential block's post-attention LayerNorm.
    "falcon_rw": (["transformer.h.0.self_attention.query_key_value.bias",
                   "transformer.h.0.post_attention_layernorm.weight"], ["lm_head.weight"]),
    # MPT: fused Wqkv, LayerNorms without bias.
    "mpt": (["transformer.blocks.0.attn.Wqkv.weight"], ["transformer.blocks.0.norm_1.bias", "lm_head.weight"]),
}


@pytest.mark.parametrize("arch", sorted(LAYOUTS))
def test_loader_reads_save_pretrained_layout(arch: str, tiny_model_dir) -> None:
    path, hf = tiny_model_dir(arch)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    present, absent = LAYOUTS[arch]
    assert set(present) <= saved, f"{arch}: expected {sorted(set(present) - saved)} in the checkpoint"
    assert not set(absent) & saved, f"{arch}: did not expect {sorted(set(absent) & saved)} in the checkpoint"

    source = resolve_model(path)
    captured = capture(source.config)
    weights = source.load_weights(captured.param_aliases, torch.float32, "cpu", progress=False)
    hf_params = dict(hf.named_parameters(remove_duplicate=False))
    assert set(weights) == set(captured.param_aliases)
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, hf_params[name], rtol=0, atol=0, msg=f"{arch}: {name}")


# Multimodal checkpoints as published (and as transformers saves them): the language model
# under `language_model.`, a vision tower beside it, the text model's config nested.
_TINY_VISION = {
    "llama4": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                   patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32),
    "gemma3": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                   patch_size=14),
    "gemma4": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, patch_size=14,
                   head_dim=16),
    "mistral3": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                     patch_size=14, head_dim=16),
    "qwen3_5_moe": dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=14, out_hidden_size=64),
}


@pytest.mark.parametrize("model_type,text_arch", [("llama4", "llama4_text"), ("gemma3", "gemma3_text"),
                                                  ("gemma4", "gemma4_e2b"), ("mistral3", "mistral"),
                                                  ("qwen3_5_moe", "qwen3_5_moe")])
def test_multimodal_checkpoint_runs_as_its_language_model(model_type: str, text_arch: str, tmp_path) -> None:
    """Llama 4, Gemma 3 and 4, Mistral Small 3.x and Qwen3.5 are published as image-text models; Kiln reads the text model's config
    out of `text_config` and its tensors from under `language_model.` (the vision tower is never
    read), and generates the multimodal model's own greedy tokens for a text prompt."""
    from tiny_models import tiny_config
    from transformers import AutoConfig, AutoModelForImageTextToText

    from kiln.runtime import LLM, SamplingParams
    from test_parity import hf_greedy

    text = tiny_config(text_arch)
    config = AutoConfig.for_model(model_type, text_config=text.to_dict(), vision_config=_TINY_VISION[model_type])
    torch.manual_seed(0)
    hf = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.08)
    hf.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert {"language_model.model.embed_tokens.weight", "model.language_model.embed_tokens.weight"} & saved
    assert any(k.startswith(("vision_model.", "vision_tower.", "model.visual.", "model.vision_tower.")) for k in saved)

    source = resolve_model(tmp_path)
    assert source.multimodal and source.config.model_type == text.model_type
    prompt = [1, 5, 7, 9, 11, 13, 2, 17]
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", progress=False)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy)
    assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, 6)


@pytest.mark.parametrize("arch", ["gpt_neox", "exaone", "nemotron_h", "mixtral", "sarvam_moe", "lara_mini"])
def test_saved_names_from_one_revert_are_those_of_one_revert_a_parameter(arch: str, monkeypatch) -> None:
    """The checkpoint names capture reads from one revert of the whole state dict (renames,
    experts stacked on load, a tensor split on load into several parameters) equal asking
    transformers for each parameter alone, which capture did before (~0.8 s of a 30-layer
    model's cold start)."""
    from tiny_models import tiny_config

    from kiln.compiler import capture as capture_module

    hf = capture_module.build_hf_model(tiny_config(arch), torch.float32, "cpu")
    at_once = capture_module._checkpoint_names(hf)
    monkeypatch.setattr(capture_module, "_saved_names_at_once", lambda hf, params, revert: {})
    assert at_once and at_once == capture_module._checkpoint_names(hf)
