"""The fusion-phase passes: before/after graphs, numerical equality, weight transforms, parity.

Each pass runs on top of the base pipeline (normalize, paged_kv, prune_logits) of a tiny
model. The "before" graph is the base pipeline alone; "after" adds the pass. We check what
the pass changed (ops by count, graph inputs, declared weight transforms) and that both
graphs compute the same logits for a mixed step (two prefills) followed by a decode step,
fed the tiny model's real weights (the merged ones built by `apply_weight_transforms`).
CPU graphs are rewritten because the tests ask for it (`on_cpu=True`, `KILN_CPU_FUSIONS`).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kiln.compiler.capture import graph_input_roles
from kiln.compiler.pipeline import ModelGraph, build_model_graph
from kiln.kernels.paged_attention import kv_heads_and_head_dim
from kiln.passes import PassManager, op_counts
from kiln.passes.fuse_common import CPU_FUSIONS_ENV, graph_device_type
from kiln.passes.fuse_rmsnorm import FuseRMSNormPass
from kiln.passes.fuse_rope import FuseRoPEPass
from kiln.passes.fuse_silu_mul import FuseSiluMulPass
from kiln.passes.merge_gate_up import MergeGateUpPass
from kiln.passes.merge_qkv import MergeQKVPass
from kiln.passes.registry import create_pass
from kiln.passes.weight_transforms import (ConcatWeights, WeightTransformError, apply_weight_transforms,
                                           transforms_from_json, transforms_to_json)

BASE = ("normalize", "paged_kv", "prune_logits")
LAYERS = 2  # tiny_models.COMMON
BLOCK_SIZE = 16


def build(arch: str, dtype: torch.dtype, *extra, device: str = "cpu") -> ModelGraph:
    from tiny_models import tiny_config

    passes = [create_pass(n) for n in BASE] + list(extra)
    return build_model_graph(tiny_config(arch), dtype, device, block_size=BLOCK_SIZE, pass_manager=PassManager(passes))


def stats_of(graph: ModelGraph, name: str) -> dict[str, int]:
    return next(r.stats for r in graph.report.records if r.name == name)


def param_roles(graph: ModelGraph) -> set[str]:
    return {r for r in graph_input_roles(graph.graph_module) if r.startswith("param:")}


def counts_delta(before: ModelGraph, after: ModelGraph) -> Counter:
    delta = Counter(op_counts(after.graph_module))
    delta.subtract(op_counts(before.graph_module))
    return Counter({k: v for k, v in delta.items() if v})


# ---- running a graph -----------------------------------------------------------------------

def step_batches(vocab: int) -> list[dict[str, torch.Tensor]]:
    """Two steps: prefills of 5 and 3 tokens packed together, then one decode token each."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (5,), generator=g), torch.randint(0, vocab, (3,), generator=g)]
    tables = torch.tensor([[1], [2]], dtype=torch.int32)
    prefill = dict(
        input_ids=torch.cat(prompts)[None], position_ids=torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]),
        slot_mapping=torch.tensor([16, 17, 18, 19, 20, 32, 33, 34]), block_tables=tables,
        seq_lens=torch.tensor([5, 3], dtype=torch.int32), query_start_loc=torch.tensor([0, 5, 8], dtype=torch.int32),
        logits_indices=torch.arange(8),
    )
    decode = dict(
        input_ids=torch.randint(0, vocab, (1, 2), generator=g), position_ids=torch.tensor([[5, 3]]),
        slot_mapping=torch.tensor([21, 35]), block_tables=tables, seq_lens=torch.tensor([6, 4], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32), logits_indices=torch.arange(2),
    )
    return [prefill, decode]


def run_steps(graph: ModelGraph, hf_model: torch.nn.Module, dtype: torch.dtype, device: str = "cpu"
              ) -> list[torch.Tensor]:
    """Logits of each step of `step_batches`, with weights as the engine would load them."""
    config = graph.captured.config
    state = {k: v.detach().to(device=device, dtype=dtype) for k, v in hf_model.state_dict().items()}
    weights = {name: state[next(a for a in aliases if a in state)] for name, aliases in graph.captured.param_aliases.items()}
    weights = apply_weight_transforms(weights, graph.weight_transforms)
    kv_caches = [torch.zeros(2, 4, BLOCK_SIZE, *kv_heads_and_head_dim(config, layer=i), dtype=dtype, device=device)
                 for i in range(config.num_hidden_layers)]
    outputs = []
    for batch in step_batches(config.vocab_size):
        args = []
        for role in graph_input_roles(graph.graph_module):
            kind, _, name = role.partition(":")
            if kind == "param":
                args.append(weights[name])
            elif kind == "constant":
                args.append(graph.captured.constants[name].to(device))
            elif kind == "kv_cache":
                args.append(kv_caches[int(name)])
            else:
                args.append(batch[name].to(device))
        with torch.no_grad():
            outputs.append(graph.graph_module(*args).float().cpu())
    return outputs


def assert_same_logits(before: ModelGraph, after: ModelGraph, hf_model: torch.nn.Module, dtype: torch.dtype,
                       atol: float) -> None:
    for ref, out in zip(run_steps(before, hf_model, dtype), run_steps(after, hf_model, dtype)):
        torch.testing.assert_close(out, ref, atol=atol, rtol=atol)


# ---- each pass: before/after ---------------------------------------------------------------

def test_merge_qkv_with_biases(tiny_model_dir):
    _, hf = tiny_model_dir("qwen2")  # q/k/v carry biases
    before, after = build("qwen2", torch.float32), build("qwen2", torch.float32, MergeQKVPass())
    assert stats_of(after, "merge_qkv") == {"qkv_proj_merged": LAYERS, "inputs_added": 2 * LAYERS}
    assert counts_delta(before, after) == Counter({"aten.linear.default": -2 * LAYERS, "aten.slice.Tensor": 3 * LAYERS})
    removed, added = param_roles(before) - param_roles(after), param_roles(after) - param_roles(before)
    assert len(removed) == 6 * LAYERS
    assert added == {f"param:model.layers.{i}.self_attn.qkv_proj.{leaf}" for i in range(LAYERS) for leaf in ("weight", "bias")}
    assert ConcatWeights("model.layers.0.self_attn.qkv_proj.bias", tuple(
        f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkv")) in after.weight_transforms
    assert_same_logits(before, after, hf, torch.float32, atol=1e-5)


@pytest.mark.parametrize("arch,members", [("qwen3_next", ("in_proj_qkvz", "in_proj_ba")),
                                          ("qwen3_5", ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))])
def test_merge_qkv_merges_the_gated_delta_net_inputs(arch, members):
    # Each gated DeltaNet layer's input projections (two in Qwen3-Next, four in Qwen3.5) read
    # the layer's normed input: one GEMM, its outputs slices, the same numbers.
    from tiny_models import tiny_config

    from kiln.compiler.pass_testing import graph_for_pass, run_graph

    config = tiny_config(arch)
    delta_layers = [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    before = graph_for_pass(config, "merge_qkv")
    after = before.copy()
    stats = after.run_pass(MergeQKVPass())
    attention_layers = config.num_hidden_layers - len(delta_layers)
    assert stats == {"qkv_proj_merged": attention_layers, "in_proj_qkvzba_merged": len(delta_layers),
                     "inputs_added": attention_layers + len(delta_layers)}
    merged = [t for t in after.context.weight_transforms if t.output.endswith("in_proj_qkvzba.weight")]
    assert merged == [ConcatWeights(f"model.layers.{i}.linear_attn.in_proj_qkvzba.weight",
                                    tuple(f"model.layers.{i}.linear_attn.{m}.weight" for m in members))
                      for i in delta_layers]
    delta = Counter(op_counts(after.graph_module))
    delta.subtract(op_counts(before.graph_module))
    assert delta["aten.linear.default"] == -(len(members) - 1) * len(delta_layers) - 2 * attention_layers
    assert torch.equal(run_graph(after), run_graph(before))


def test_merge_gate_up(tiny_model_dir):
    _, hf = tiny_model_dir("llama")
    before, after = build("llama", torch.float32), build("llama", torch.float32, MergeGateUpPass())
    assert stats_of(after, "merge_gate_up") == {"gate_up_proj_merged": LAYERS, "inputs_added": LAYERS}
    assert counts_delta(before, after) == Counter({"aten.linear.default": -LAYERS, "aten.slice.Tensor": 2 * LAYERS})
    assert [t.output for t in after.weight_transforms] == [f"model.layers.{i}.mlp.gate_up_proj.weight" for i in range(LAYERS)]
    assert_same_logits(before, after, hf, torch.float32, atol=1e-5)


def test_merge_gate_up_leaves_moe_experts_alone():
    graph = build("mixtral", torch.float32, MergeGateUpPass())
    assert stats_of(graph, "merge_gate_up") == {"gate_up_proj_merged": 0, "inputs_added": 0}
    assert graph.weight_transforms == []


def test_fuse_rope_llama31_scaling(tiny_model_dir):
    _, hf = tiny_model_dir("llama3.1")  # Llama 3.1 frequency scaling lives in the inv_freq constant
    before, after = build("llama3.1", torch.float32), build("llama3.1", torch.float32, FuseRoPEPass(on_cpu=True))
    assert stats_of(after, "fuse_rope") == {"qk_norm_rope": 0, "rope": LAYERS, "rope_halves": 0, "rope_token_major": 0,
                                            "rope_partial": 0, "kv_write_fused": LAYERS}
    delta = counts_delta(before, after)
    # Each layer's rope then went into its attention: rope + KV write + attention, one op.
    assert delta["kiln.rope_paged_attention.default"] == LAYERS and delta["kiln.paged_attention.default"] == -LAYERS
    assert "kiln.rope.default" not in delta
    assert delta["aten.neg.default"] == -2 * LAYERS and delta["aten.cat.default"] == -2 * LAYERS
    assert graph_input_roles(before.graph_module) == graph_input_roles(after.graph_module)
    assert_same_logits(before, after, hf, torch.float32, atol=1e-5)


def test_fuse_rope_takes_qwen3_qk_norm(tiny_model_dir):
    _, hf = tiny_model_dir("qwen3")
    before, after = build("qwen3", torch.float32), build("qwen3", torch.float32, FuseRoPEPass(on_cpu=True))
    assert stats_of(after, "fuse_rope") == {"qk_norm_rope": LAYERS, "rope": 0, "rope_halves": 0, "rope_token_major": 0,
                                            "rope_partial": 0, "kv_write_fused": LAYERS}
    delta = counts_delta(before, after)
    assert delta["kiln.rope_paged_attention.default"] == LAYERS and delta["aten.rsqrt.default"] == -2 * LAYERS
    fused = after.graph_module.graph.find_nodes(op="call_function", target=torch.ops.kiln.rope_paged_attention.default)
    assert len(fused) == LAYERS and all(n.args[5] is not None and n.args[6] is not None for n in fused)  # norm weights in
    assert_same_logits(before, after, hf, torch.float32, atol=1e-5)


def test_fuse_rope_takes_gpt_oss_rotation_by_halves(tiny_model_dir):
    """GPT-OSS rotates by halves (chunk, cos/sin of D/2, cat): one kiln::rope with cos/sin
    repeated, folded into the attention with the layer's sinks carried over."""
    _, hf = tiny_model_dir("gpt_oss")
    before, after = build("gpt_oss", torch.float32), build("gpt_oss", torch.float32, FuseRoPEPass(on_cpu=True))
    assert stats_of(after, "fuse_rope") == {"qk_norm_rope": 0, "rope": 0, "rope_halves": LAYERS, "rope_token_major": 0,
                                            "rope_partial": 0, "kv_write_fused": LAYERS}
    delta = counts_delta(before, after)
    assert delta["kiln.rope_paged_attention.default"] == LAYERS and delta["aten.chunk.default"] == -2 * LAYERS
    fused = after.graph_module.graph.find_nodes(op="call_function", target=torch.ops.kiln.rope_paged_attention.default)
    assert all(isinstance(n.kwargs.get("sinks"), torch.fx.Node) for n in fused)
    assert_same_logits(before, after, hf, torch.float32, atol=1e-5)


@pytest.mark.parametrize("arch", ["glm4_moe", "gpt_neox", "qwen3_next"])
def test_fuse_rope_takes_partial_rotary(tiny_model_dir, arch):
    """Partial rotary (cos/sin narrower than the head: GLM-4.5, GPT-NeoX, Qwen3-Next): one
    kiln::rope with the narrow cos/sin a layer, kept apart from the attention; logits unchanged."""
    _, hf = tiny_model_dir(arch)
    before, after = build(arch, torch.float32), build(arch, torch.float32, FuseRoPEPass(on_cpu=True))
    attention_layers = len(before.graph_module.graph.find_nodes(op="call_function",
                                                               target=torch.ops.kiln.paged_attention.default))
    assert attention_layers >= 1
    assert stats_of(after, "fuse_rope") == {"qk_norm_rope": 0, "rope": 0, "rope_halves": 0, "rope_token_major": 0,
                                            "rope_partial": attention_layers, "kv_write_fused": 0}
    delta = counts_delta(before, after)
    assert delta["kiln.rope.default"] == attention_layers and delta["aten.neg.default"] == -2 * attention_layers
    assert delta["aten.cat.default"] == -4 * attention_layers  # rotate_half's and the pass-through's, q and k
    ropes = after.graph_module.graph.find_nodes(op="call_function", target=torch.ops.kiln.rope.default)
    assert all(r.args[2].meta["val"].shape[-1] < r.args[0].meta["val"].shape[-1] for r in ropes)
    assert_same_logits(before, after, hf, torch.float32, atol=1e-5)


@pytest.mark.parametrize("arch", ["olmo2", "olmo"])
def test_fuse_rope_folds_float32_tables_through_their_casts(tiny_model_dir, arch):
    """The OLMo family keeps cos/sin in float32: in a bfloat16 graph its rotation is float32
    and cast back to bfloat16 before the attention. Those casts do not stop the fold (the
    fused op attends with q and k in their own dtype); logits unchanged in bfloat16."""
    _, hf = tiny_model_dir(arch)
    before, after = build(arch, torch.bfloat16), build(arch, torch.bfloat16, FuseRoPEPass(on_cpu=True))
    assert stats_of(after, "fuse_rope") == {"qk_norm_rope": 0, "rope": LAYERS, "rope_halves": 0, "rope_token_major": 0,
                                            "rope_partial": 0, "kv_write_fused": LAYERS}
    fused = after.graph_module.graph.find_nodes(op="call_function", target=torch.ops.kiln.rope_paged_attention.default)
    assert len(fused) == LAYERS and all(n.args[3].meta["val"].dtype == torch.float32 for n in fused)  # cos
    assert all(n.meta["val"].dtype == torch.bfloat16 for n in fused)
    assert counts_delta(before, after)["aten.to.dtype"] <= -2 * LAYERS  # each layer's two casts back
    assert_same_logits(before, after, hf, torch.bfloat16, atol=0)


@pytest.mark.parametrize("arch,folded", [("gemma4_text", True), ("gemma4_e2b", False)])
def test_fuse_rope_takes_gemma4s_token_major_form(tiny_model_dir, arch, folded):
    """Gemma 4 rotates q and k one at a time while token-major, in layers of two head sizes: one
    `kiln::rope` a layer with its own K, folded into the attention where only that layer reads
    the keys (in gemma4_e2b the owning layers' keys feed the sharing layers' attention too, and
    those layers rotate a q alone: left as they are); logits unchanged."""
    _, hf = tiny_model_dir(arch)
    layers = hf.config.num_hidden_layers
    before, after = build(arch, torch.float32), build(arch, torch.float32, FuseRoPEPass(on_cpu=True))
    stats = stats_of(after, "fuse_rope")
    owning = layers - (hf.config.num_kv_shared_layers or 0)
    assert stats["rope_token_major"] == owning and stats["kv_write_fused"] == (owning if folded else 0)
    assert_same_logits(before, after, hf, torch.float32, atol=1e-5)


def test_fuse_rmsnorm_with_residual(tiny_model_dir):
    _, hf = tiny_model_dir("mistral")
    before, after = build("mistral", torch.float32), build("mistral", torch.float32, FuseRMSNormPass(on_cpu=True))
    # Every norm after the first has the residual add in front: 2 per layer, minus the first, plus the final norm.
    assert stats_of(after, "fuse_rmsnorm") == {"add_rms_norm": 2 * LAYERS, "rms_norm": 1, "add_offset_rms_norm": 0,
                                               "offset_rms_norm": 0, "add_rms_norm_fp32_weight": 0,
                                               "rms_norm_fp32_weight": 0, "add_rms_norm_pow": 0, "rms_norm_pow": 0,
                                               "gated_rms_norm": 0}
    delta = counts_delta(before, after)
    assert delta["aten.rsqrt.default"] == -(2 * LAYERS + 1) and delta["aten.pow.Tensor_Scalar"] == -(2 * LAYERS + 1)
    assert delta["aten.add.Tensor"] == -(2 * LAYERS + 1) - 2 * LAYERS  # eps adds and residual adds
    assert_same_logits(before, after, hf, torch.float32, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_rmsnorm_takes_gemma4s_pow_form(tiny_model_dir, dtype):
    """Gemma 4's norm (torch.pow(mean + eps, -0.5), the weight after the norm in float32) becomes
    kiln::add_offset_rms_norm / kiln::offset_rms_norm with offset 0: its four sandwich norms and q/k
    norms a layer, the final norm; the logits unchanged. (Its weightless V and router norms stay.)"""
    _, hf = tiny_model_dir("gemma4_text")
    before, after = build("gemma4_text", dtype), build("gemma4_text", dtype, FuseRMSNormPass(on_cpu=True))
    stats = stats_of(after, "fuse_rmsnorm")
    layers = hf.config.num_hidden_layers
    # Per layer: input, post-attention, pre- and post-feedforward norms, q and k norms; the
    # residual adds feed the input and pre-feedforward norms (but layer 0's input norm).
    assert stats["add_rms_norm_pow"] == 2 * layers - 1 - (layers - 1) and stats["rms_norm_pow"] > 4 * layers
    delta = counts_delta(before, after)
    assert delta["kiln.offset_rms_norm.default"] == stats["rms_norm_pow"]
    assert delta["kiln.add_offset_rms_norm.default"] == stats["add_rms_norm_pow"]
    assert_same_logits(before, after, hf, dtype, atol=1e-5 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_fuse_rmsnorm_takes_the_offset_form(tiny_model_dir, arch):
    """Gemma's and Qwen3-Next's norms ((1 + weight) in float32) become kiln::add_offset_rms_norm /
    kiln::offset_rms_norm (Qwen3-Next's per-head q/k norms included), and Qwen3-Next's gated
    norm after each gated DeltaNet layer kiln::gated_rms_norm; the logits unchanged."""
    _, hf = tiny_model_dir(arch)
    before, after = build(arch, torch.float32), build(arch, torch.float32, FuseRMSNormPass(on_cpu=True))
    stats = stats_of(after, "fuse_rmsnorm")
    delta = counts_delta(before, after)
    fused = stats["add_offset_rms_norm"] + stats["offset_rms_norm"]
    assert stats["add_offset_rms_norm"] >= 2 * LAYERS - 1 and fused >= 2 * LAYERS + 1
    assert delta["kiln.offset_rms_norm.default"] == stats["offset_rms_norm"]
    assert delta["aten.type_as.default"] == -fused
    gated = len(getattr(hf.config, "layer_types", None) and [t for t in hf.config.layer_types
                                                              if t == "linear_attention"] or [])
    assert stats["gated_rms_norm"] == gated == delta["kiln.gated_rms_norm.default"]
    assert (gated > 0) == (arch == "qwen3_next") and delta["aten.silu.default"] == -gated
    assert_same_logits(before, after, hf, torch.float32, atol=1e-5)


@pytest.mark.parametrize("arch", ["gpt_oss", "olmo2"])
def test_fuse_rmsnorm_takes_the_fp32_weight_form_in_bf16(tiny_model_dir, arch):
    """GPT-OSS's and OLMo2's norms ((weight * h).to(dtype): the weight joined in float32) match
    Llama's patterns only in float32 graphs, where no cast is left; in bfloat16 graphs they
    become kiln::add_offset_rms_norm / kiln::offset_rms_norm with offset 0, logits unchanged."""
    _, hf = tiny_model_dir(arch)
    before, after = build(arch, torch.bfloat16), build(arch, torch.bfloat16, FuseRMSNormPass(on_cpu=True))
    stats = stats_of(after, "fuse_rmsnorm")
    fused = stats["add_rms_norm_fp32_weight"] + stats["rms_norm_fp32_weight"]
    assert fused >= 2 * LAYERS + 1 and stats["add_rms_norm"] == stats["rms_norm"] == 0
    delta = counts_delta(before, after)
    assert delta["aten.rsqrt.default"] == -fused
    offsets = after.graph_module.graph.find_nodes(op="call_function", target=torch.ops.kiln.offset_rms_norm.default)
    assert offsets and all(n.args[3] == 0.0 for n in offsets)
    assert_same_logits(before, after, hf, torch.bfloat16, atol=0)


def test_fuse_silu_mul(tiny_model_dir):
    _, hf = tiny_model_dir("llama")
    before, after = build("llama", torch.float32), build("llama", torch.float32, FuseSiluMulPass(on_cpu=True))
    assert stats_of(after, "fuse_silu_mul") == {"silu_and_mul": LAYERS, "gelu_tanh_and_mul": 0}
    assert counts_delta(before, after) == Counter({"kiln.silu_and_mul.default": LAYERS, "aten.silu.default": -LAYERS,
                                                   "aten.mul.Tensor": -LAYERS})
    assert_same_logits(before, after, hf, torch.float32, atol=1e-6)


def all_fusions(on_cpu: bool = True) -> list:
    return [MergeQKVPass(), MergeGateUpPass(), FuseRoPEPass(on_cpu=on_cpu), FuseRMSNormPass(on_cpu=on_cpu),
            FuseSiluMulPass(on_cpu=on_cpu)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_all_fusions_bfloat16_match_the_unfused_graph(arch, tiny_model_dir):
    # The fused ops round where the eager graph rounds, so bf16 logits agree to bf16 noise.
    _, hf = tiny_model_dir(arch)
    before, after = build(arch, torch.bfloat16), build(arch, torch.bfloat16, *all_fusions())
    left = {op for op in op_counts(after.graph_module)
            if op in ("aten.rsqrt.default", "aten.silu.default", "aten.neg.default", "kiln.paged_attention.default")}
    assert not left, f"unfused ops remain: {left}"
    assert_same_logits(before, after, hf, torch.bfloat16, atol=2e-2)


# ---- policy --------------------------------------------------------------------------------

def test_custom_op_fusions_skip_cpu_graphs_by_default(monkeypatch):
    monkeypatch.delenv(CPU_FUSIONS_ENV, raising=False)
    graph = build("llama", torch.float32, *all_fusions(on_cpu=None))
    assert graph_device_type(graph.graph_module) == "cpu"
    for name in ("fuse_rope", "fuse_rmsnorm", "fuse_silu_mul"):
        assert stats_of(graph, name) == {"skipped_on_cpu": 1}
    assert stats_of(graph, "merge_qkv")["qkv_proj_merged"] == LAYERS  # layout merges run everywhere
    assert not any(op.startswith("kiln.") and op != "kiln.paged_attention.default" for op in op_counts(graph.graph_module))


def test_cpu_fusion_option_changes_the_uuid(monkeypatch):
    monkeypatch.setenv(CPU_FUSIONS_ENV, "1")
    assert FuseRMSNormPass().on_cpu
    assert FuseRMSNormPass(on_cpu=True).uuid() == FuseRMSNormPass().uuid() != FuseRMSNormPass(on_cpu=False).uuid()


def test_fusion_passes_are_registered_in_run_order():
    manager = PassManager.default()
    names = [p.name for p in manager.passes]
    fusion = [n for n in names if create_pass(n).phase == "fusion"]
    assert fusion[:5] == ["merge_qkv", "merge_gate_up", "fuse_rope", "fuse_rmsnorm", "fuse_silu_mul"]
    assert set(fusion) <= set(manager.uuids())


# ---- weight transforms ---------------------------------------------------------------------

def test_apply_weight_transforms_concatenates_and_drops_inputs():
    weights = {"a.q.weight": torch.ones(2, 3), "a.k.weight": torch.zeros(1, 3), "other": torch.ones(1)}
    out = apply_weight_transforms(weights, [ConcatWeights("a.qk.weight", ("a.q.weight", "a.k.weight"))])
    assert set(out) == {"a.qk.weight", "other"}
    torch.testing.assert_close(out["a.qk.weight"], torch.tensor([[1.0] * 3, [1.0] * 3, [0.0] * 3]))


def test_apply_weight_transforms_names_what_is_missing_or_misshapen():
    with pytest.raises(WeightTransformError, match="'a.k.weight'"):
        apply_weight_transforms({"a.q.weight": torch.ones(2, 3)}, [ConcatWeights("a.qk.weight", ("a.q.weight", "a.k.weight"))])
    with pytest.raises(WeightTransformError, match="do not line up"):
        apply_weight_transforms({"q": torch.ones(2, 3), "k": torch.ones(2, 4)}, [ConcatWeights("qk", ("q", "k"))])


def test_transforms_round_trip_through_json():
    import json

    transforms = build("qwen2", torch.float32, MergeQKVPass(), MergeGateUpPass()).weight_transforms
    assert len(transforms) == 3 * LAYERS
    assert transforms_from_json(json.loads(json.dumps(transforms_to_json(transforms)))) == transforms
    with pytest.raises(WeightTransformError, match="unknown kind"):
        transforms_from_json([{"kind": "transpose", "output": "x"}])


# ---- whole model: greedy parity with Hugging Face, every fusion on -----------------------------

@pytest.mark.parametrize("arch", ["llama3.1", "qwen3", "qwen2"])
def test_engine_greedy_parity_with_all_fusions(arch, tiny_model_dir, monkeypatch):
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine

    monkeypatch.setenv(CPU_FUSIONS_ENV, "1")
    path, hf = tiny_model_dir(arch)
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32, block_size=BLOCK_SIZE, progress=False))
    ran = {r.name: r.stats for r in engine.graph.report.records}
    assert ran["fuse_rmsnorm"]["add_rms_norm"] == 2 * LAYERS and ran["merge_qkv"]["qkv_proj_merged"] == LAYERS
    assert_greedy_equals_hf(engine, hf, [[3, 17, 99, 4, 60, 12, 7, 45, 81, 2, 33], [5, 77, 21]], 8, arch)


def assert_greedy_equals_hf(engine, hf, prompts: list[list[int]], max_tokens: int, label: str) -> None:
    """Run `prompts` together through `engine` (greedy) and compare each with `hf.generate` alone."""
    from kiln.runtime.sampling_params import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                   do_sample=False)[0, len(prompt):].tolist()
        assert got[str(i)] == expected, f"{label} prompt {i}"


@pytest.mark.parametrize("arch", ["qwen3_next", "glm4_moe"])
def test_engine_with_the_new_fusions_generates_what_it_does_without(tiny_model_dir, monkeypatch, arch):
    """Through the engine (CPU, float32, greedy): Qwen3-Next with its offset and gated norms and
    partial RoPE fused (and its recurrent layers' mixed and decode steps), GLM-4.5 with partial
    RoPE fused, generate the tokens the unfused graphs do."""
    from kiln.runtime.llm import LLM
    from kiln.runtime.sampling_params import SamplingParams

    path, _ = tiny_model_dir(arch)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 17, 21, 25], [2, 4, 6]]
    tokens, ops = {}, {}
    for fused in ("", "1"):
        monkeypatch.setenv(CPU_FUSIONS_ENV, fused)
        llm = LLM(model=str(path), device="cpu", dtype="float32", progress=False, max_model_len=128)
        ops[fused] = op_counts(llm.engine.graph.graph_module)
        tokens[fused] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
    assert ops["1"]["kiln.rope.default"] >= 1 and "kiln.rope.default" not in ops[""]
    if arch == "qwen3_next":
        assert ops["1"]["kiln.gated_rms_norm.default"] >= 1 and ops["1"]["kiln.add_offset_rms_norm.default"] >= 1
    assert tokens[""] == tokens["1"] and all(len(t) == 10 for t in tokens[""])
