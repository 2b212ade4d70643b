"""Kiln's CPU path against Hugging Face eager, on tiny random models of every architecture.

Greedy tokens must be identical (Kiln runs the prompts together, packed; HF one at a
time) and the first step's logits must agree within 1e-4 relative error. Every
architecture of the README's support table (`tiny_models.SUPPORTED`) is run; each tiny
model is saved by transformers' own `save_pretrained` and loaded through Kiln's loader, so
checkpoint layouts (tied embeddings, fused qkv / gate_up tensors, biases, Conv1D weights)
are exercised too.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import SUPPORTED

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.model_runner import prepare_step_inputs

PROMPTS = [[1, 5, 7, 9, 11, 13, 2], [3, 4], list(range(10, 47))]
NEW_TOKENS = 32


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding with Hugging Face's forward, no logits processors: `generate` with
    min_new_tokens would mask the EOS id, which a random tiny model may well pick (Kiln
    runs with ignore_eos, which does not)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def kiln_first_step_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Logits of the last prompt token of each prompt, computed in one packed step."""
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"logits-{i}", p, SamplingParams(max_tokens=1, temperature=0))
    step = engine.scheduler.schedule()
    assert [s.num_new_tokens for s in step.scheduled] == [len(p) for p in prompts]
    logits = engine.runner.execute(prepare_step_inputs(step, engine.block_manager, engine.device))
    for i in range(len(prompts)):
        engine.abort(f"logits-{i}")
    return logits


def assert_first_step_logits_match(llm: LLM, hf: torch.nn.Module, prompts: list[list[int]], label: str) -> None:
    """Kiln's first-step logits of `prompts` (packed in one step) within 1e-4 relative of HF's."""
    logits = kiln_first_step_logits(llm, prompts)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    rel = (logits - ref).norm() / ref.norm()
    assert rel < 1e-4, f"{label}: first-step logits differ by {rel:.2e} (relative)"


@pytest.mark.parametrize("arch", SUPPORTED)
def test_greedy_tokens_and_logits_match_hf(arch: str, tiny_model_dir) -> None:
    path, hf = tiny_model_dir(arch)
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)

    assert_first_step_logits_match(llm, hf, PROMPTS, f"{arch}")

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, NEW_TOKENS), f"{arch}: greedy tokens differ"


def test_chunked_prefill_matches_whole_prefill(tiny_model_dir) -> None:
    """A prefill in two chunks (the second continuing the cached first half) = one prefill."""
    path, hf = tiny_model_dir("llama")
    prompt = list(range(3, 43))
    whole_llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    whole = kiln_first_step_logits(whole_llm, [prompt])

    chunked = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=20, progress=False)
    engine = chunked.engine
    engine.add_request("chunked", prompt, SamplingParams(max_tokens=1, temperature=0))
    first = engine.scheduler.schedule()
    assert first.scheduled[0].num_new_tokens == 20 and not first.scheduled[0].samples
    engine.runner.execute(prepare_step_inputs(first, engine.block_manager, engine.device))
    first.scheduled[0].seq.num_computed_tokens += 20
    second = engine.scheduler.schedule()
    assert second.scheduled[0].num_new_tokens == 20 and second.scheduled[0].samples
    logits = engine.runner.execute(prepare_step_inputs(second, engine.block_manager, engine.device))
    torch.testing.assert_close(logits, whole, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1:]
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_latent_attention_caches_the_latent(tiny_model_dir, monkeypatch) -> None:
    """DeepSeek-V3's multi-head latent attention is cached as its latent: one KV "head" of
    kv_lora_rank (16) + qk_rope_head_dim (8) values a token, whatever the query heads (4 here;
    not `head_dim`, the RoPE part's 8, nor `num_key_value_heads`). The K plane holds what
    Hugging Face computes for that token (kv_a_layernorm of the latent, then the RoPE key),
    and it is the cache's one plane (read as both K and V); kv_b_proj is absorbed (the greedy
    parity tests above)."""
    import kiln.kernels.paged_attention as pa
    from tiny_models import tiny_config

    config = tiny_config("deepseek_v3")
    assert pa.is_latent_attention(config) and not pa.is_latent_attention(tiny_config("llama"))
    assert (config.head_dim, config.v_head_dim, config.kv_lora_rank) == (8, 16, 16)
    assert pa.caches_latent(config) and pa.kv_heads_and_head_dim(config) == (1, 24)
    path, hf = tiny_model_dir("deepseek_v3")
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    llm.generate([PROMPTS[2]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    cache = llm.engine.runner.kv_caches[0]
    assert cache.shape[0] == 1 and tuple(cache.shape[-2:]) == (1, 24)
    ids = torch.tensor([PROMPTS[2]])
    n = min(ids.shape[1], cache.shape[2])
    with torch.no_grad():
        attn = hf.model.layers[0].self_attn
        x = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(ids))
        latent = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., :16])[0]
    k = cache[0, 1, :n, 0]  # the prompt's first block (block 0 is the null block)
    torch.testing.assert_close(k[:, :16], latent[:n], rtol=1e-5, atol=1e-5)
    # Where transformers has no separate expansion (before its `expand_kv`), or for other MLA
    # models, every query head's K and V are cached expanded, V zero-padded to K's 24.
    monkeypatch.setattr(pa, "_attention_expands_kv_apart", lambda model_type: False)
    assert not pa.caches_latent(config) and pa.kv_heads_and_head_dim(config) == (4, 24)


def test_expand_kv_read_from_the_modeling_source() -> None:
    """Whether transformers has `expand_kv` is read from its modeling files' text (a warm start
    does not import them): the same answer as the classes the import defines, for every MLA
    type Kiln caches as its latent and for one without MLA."""
    import importlib
    import inspect

    from kiln.kernels import paged_attention as pa

    for model_type in sorted(pa.LATENT_CACHE_MODEL_TYPES) + ["llama"]:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        imported = any(inspect.isclass(c) and "expand_kv" in vars(c) for c in vars(module).values())
        assert pa._attention_expands_kv_apart(model_type) == imported, model_type
    assert pa._attention_expands_kv_apart("deepseek_v3") and not pa._attention_expands_kv_apart("llama")
    assert not pa._attention_expands_kv_apart("no_such_model")


def test_llama4_chunked_attention_matches_hf(tiny_model_dir, tmp_path) -> None:
    """Llama 4's RoPE layers attend within chunks of `attention_chunk_size` positions (its NoPE
    layers globally). At a chunk of 8, a 37-token prompt and its continuation cross four chunk
    boundaries: Kiln (the chunk carried by the attention ops) gives Hugging Face's chunk-masked
    tokens, and not those of plain causal attention."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    path, _ = tiny_model_dir("llama4_text")
    chunked = tmp_path / "llama4-chunk8"
    shutil.copytree(path, chunked)
    config = json.loads((chunked / "config.json").read_text())
    config.update(attention_chunk_size=8, layer_types=None)  # (transformers derives them from the chunk)
    (chunked / "config.json").write_text(json.dumps(config))
    hf = AutoModelForCausalLM.from_pretrained(str(chunked), dtype=torch.float32).eval()
    assert "chunked_attention" in hf.config.layer_types and "full_attention" in hf.config.layer_types
    prompt = PROMPTS[2]
    want = hf_greedy(hf, prompt, 12)
    llm = LLM(str(chunked), dtype="float32", device="cpu", progress=False)
    assert llm.engine.max_model_len > 8  # the whole context, no longer capped at one chunk
    assert_first_step_logits_match(llm, hf, [prompt], "llama4 chunked")
    (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=12, temperature=0.0,
                                                                       ignore_eos=True))
    assert list(out.outputs[0].token_ids) == want
    unchunked = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        assert not torch.allclose(unchunked(torch.tensor([prompt])).logits, hf(torch.tensor([prompt])).logits,
                                  atol=1e-4)  # the chunk matters at this length
