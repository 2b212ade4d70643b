"""KV caches whose shape differs between layers, and layers that read another layer's cache,
beyond the parity rows of the models that have them (tests/tiny_models.py: gemma4_text,
gemma4_e2b, gemma4_moe, gemma3n_text, mimo_v2_flash): transformers' heterogeneous configs
(Gemma 4's global layers), MiMo-V2-Flash's windowed layers with twice the KV heads, Gemma 3n's
and 4's `num_kv_shared_layers`; through a warm start, an FP8 cache and the config snapshot."""

from __future__ import annotations

import torch
from test_parity import hf_greedy
from tiny_models import tiny_config

from kiln.compiler.model_source import ConfigSnapshot
from kiln.kernels.paged_attention import kv_heads_and_head_dim, kv_sharing
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.kv_cache import kv_bytes_per_token

PROMPTS = [list(range(3, 30)), [5, 9, 11]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_layers_read_their_shapes_from_a_heterogeneous_config() -> None:
    """Windowed layers: 2 KV heads of 16; global ones: 1 of 32 (`per_layer_config`). The last two
    layers share the cache of the last earlier layer of their kind; the snapshot a warm start
    reads answers alike."""
    config = tiny_config("gemma4_e2b")
    assert config.is_heterogeneous
    shapes = [kv_heads_and_head_dim(config, layer=i) for i in range(4)]
    assert shapes == [(2, 16), (1, 32), (2, 16), (1, 32)]
    assert kv_sharing(config) == {2: 0, 3: 1}
    assert kv_sharing(tiny_config("gemma4_text")) == {}
    snapshot = ConfigSnapshot.from_bytes(ConfigSnapshot.of(config).to_bytes())
    assert [kv_heads_and_head_dim(snapshot, layer=i) for i in range(4)] == shapes
    assert kv_sharing(snapshot) == {2: 0, 3: 1}
    # Two planes (K, V) of each owning layer's heads x head_dim, float32.
    assert kv_bytes_per_token(config, torch.float32) == 2 * (2 * 16 + 1 * 32) * 4
    assert kv_bytes_per_token(tiny_config("gemma4_text"), torch.float32) == 2 * 2 * (2 * 16 + 1 * 32) * 4


def test_shared_layers_attend_over_the_owning_layers_cache(tiny_model_dir) -> None:
    """The engine gives each layer its own cache shape, none to the sharing layers, whose
    attention reads the owning layer's cache input: Hugging Face's tokens."""
    path, hf = tiny_model_dir("gemma4_e2b")
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    caches = llm.engine.runner.kv_caches
    assert [tuple(c.shape[3:]) for c in caches] == [(2, 16), (1, 32), (2, 16), (1, 32)]
    assert [c.shape[1] > 0 for c in caches] == [True, True, False, False]
    roles = [r for r in llm.engine.graph_spec.input_roles if r.startswith("kv_cache:")]
    assert sorted(roles) == ["kv_cache:0", "kv_cache:1"]
    records = {r["name"]: r["stats"] for r in llm.engine.graph_spec.pass_records}
    assert records["paged_kv"]["attention_replaced"] == 4
    outs = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def test_gemma4_warm_starts_from_its_compile_cache(tiny_model_dir, tmp_path) -> None:
    """A second engine over the same cache takes the graph and the config (a snapshot whose
    layers keep their own head sizes) from it and decodes the same tokens."""
    path, _ = tiny_model_dir("gemma4_e2b")
    options = dict(dtype="float32", device="cpu", progress=False, compile="graph", cache_dir=str(tmp_path / "cache"))
    cold = LLM(str(path), **options)
    expected = [o.outputs[0].token_ids for o in cold.generate(PROMPTS, GREEDY)]
    warm = LLM(str(path), **options)
    assert warm.engine.startup_report.graph_from_cache
    assert [tuple(c.shape[3:]) for c in warm.engine.runner.kv_caches] == [(2, 16), (1, 32), (2, 16), (1, 32)]
    assert [o.outputs[0].token_ids for o in warm.generate(PROMPTS, GREEDY)] == expected


def test_fp8_cache_shared_layers_take_the_owning_layers_scales(tiny_model_dir) -> None:
    """An FP8 cache: a sharing layer writes and reads the owning layer's cache with that layer's
    scales (one scales input per cache, calibrated at start-up over both layers' writes), and
    teacher-forced greedy picks keep the float cache's as on the other tiny models."""
    from test_fp8 import engine_tokens, teacher_forced_agreement

    path, _ = tiny_model_dir("gemma4_e2b")
    llm = LLM(str(path), compile="eager", progress=False, kv_cache_dtype="fp8")
    scales = [r for r in llm.engine.graph_spec.input_roles if r.endswith(".kv_cache_scales")]
    assert sorted(scales) == [f"param:model.layers.{i}.self_attn.kv_cache_scales" for i in (0, 1)], scales
    assert len(llm.engine.kv_scales) == 2, llm.engine.kv_scales.keys()
    assert all(c.dtype == torch.float8_e4m3fn for c in llm.engine.runner.kv_caches)
    scale_of_cache = {}
    for node in llm.engine.graph.graph_module.graph.find_nodes(op="call_function",
                                                               target=torch.ops.kiln.paged_attention.default):
        assert scale_of_cache.setdefault(node.args[3], node.kwargs["kv_scale"]) is node.kwargs["kv_scale"]
    assert len(scale_of_cache) == 2
    # The tiny config's logits are soft-capped at 3.0 (near-ties everywhere): FP8 weights alone
    # keep 65% of its picks, an FP8 cache 73% (gemma4_text's 88%).
    assert teacher_forced_agreement(llm, engine_tokens(path)) >= 0.6


def test_mimo_windowed_layers_have_twice_the_kv_heads(tiny_model_dir) -> None:
    """MiMo-V2-Flash's attention module doubles the config's KV heads in its windowed layers, and
    its values (16) are narrower than its keys (24): each layer's cache has its own heads, at
    the keys' width."""
    config = tiny_config("mimo_v2_flash")
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert [kv_heads_and_head_dim(config, layer=i) for i in range(3)] == [(2, 24), (4, 24), (4, 24)]
    path, hf = tiny_model_dir("mimo_v2_flash")
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    assert [tuple(c.shape[3:]) for c in llm.engine.runner.kv_caches] == [(2, 24), (4, 24), (4, 24)]
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)
