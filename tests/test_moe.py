"""Mixture-of-experts: `kiln::fused_moe`, the `fuse_moe` pass, and parity with Hugging Face for
Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE and OLMoE on tiny random models (float32, CPU).

Parity runs each architecture twice: unfused (the CPU default: `fuse_moe` leaves CPU graphs
alone, the experts run as transformers' batched_mm graph) and fused (`KILN_CPU_FUSIONS=1`:
the experts run as `kiln::fused_moe`'s CPU reference). The tiny checkpoints are written by
transformers' `save_pretrained`, which stores the experts one matrix per expert as on the
Hub; Kiln's loader stacks them back.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.kernels.moe import fused_moe_grouped_mm, fused_moe_reference
from kiln.passes.base import PassContext
from kiln.passes.fuse_common import CPU_FUSIONS_ENV
from kiln.passes.fuse_moe import FuseMoEPass
from kiln.passes.manager import op_counts

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
              max_position_embeddings=512)
MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# MoE blocks per tiny model (Qwen2-MoE's second layer is a dense MLP: mlp_only_layers).
MOE_LAYERS = {"mixtral": 2, "qwen2_moe": 1, "qwen3_moe": 2, "olmoe": 2}
FUSED_OP = "kiln.fused_moe.default"


def moe_config(arch: str) -> Any:
    """Tiny configs keeping what differs: renormalised top-k or not, shared expert with its
    sigmoid gate (Qwen2-MoE), q/k norms (Qwen3-MoE, OLMoE), dense layers between MoE ones."""
    import transformers as tf

    if arch == "mixtral":  # renormalised top-2, float32 routing weights
        return tf.MixtralConfig(**COMMON, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    if arch == "qwen2_moe":  # un-renormalised, shared expert, one dense layer
        return tf.Qwen2MoeConfig(**COMMON, intermediate_size=96, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
                                 norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False)
    if arch == "qwen3_moe":  # renormalised, q/k norm
        return tf.Qwen3MoeConfig(**COMMON, head_dim=32, moe_intermediate_size=32, num_experts=6,
                                 num_experts_per_tok=3, norm_topk_prob=True)
    if arch == "olmoe":  # un-renormalised, q/k norm over all heads
        return tf.OlmoeConfig(**COMMON, intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                              norm_topk_prob=False, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    raise ValueError(arch)


def save_moe_model(arch: str, path: Path, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(arch), attn_implementation="eager").eval()
    with torch.no_grad():  # spread the logits (and the router's choices) as tests/tiny_models.py does
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory):
    made: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(arch: str) -> tuple[Path, torch.nn.Module]:
        if arch not in made:
            path = tmp_path_factory.mktemp(f"moe-{arch}")
            made[arch] = (path, save_moe_model(arch, path))
        return made[arch]

    return make


# ---- the op's reference ------------------------------------------------------------------------

def naive_moe(hidden: torch.Tensor, logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
              top_k: int, renormalize: bool) -> torch.Tensor:
    """Token by token, expert by expert: the definition, written independently of the op."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        top = torch.topk(probs, top_k)
        weights = top.values / top.values.sum() if renormalize else top.values
        for w, e in zip(weights.tolist(), top.indices.tolist()):
            gu = w_gate_up[e] @ hidden[t]
            out[t] += w * (w_down[e] @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_reference_matches_definition(renormalize: bool) -> None:
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 11, 24, 16, 5, 2
    hidden, logits = torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)
    w_gate_up, w_down = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    logits[0] = -10.0  # some experts get no token at all
    logits[:, 3] = -10.0
    out = torch.ops.kiln.fused_moe(hidden, logits, w_gate_up, w_down, k, renormalize, True)
    ref = naive_moe(hidden, logits, w_gate_up, w_down, k, renormalize)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert out.shape == (t, h) and out.dtype == hidden.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize,fp32_weights", [(True, True), (False, False)])
def test_fused_moe_grouped_mm_equals_the_reference(dtype: torch.dtype, renormalize: bool, fp32_weights: bool) -> None:
    # torch's grouped GEMM in place of the reference's loop over experts: the same products,
    # the same roundings, so the same bits on CPU; experts without a token are empty groups.
    g = torch.Generator().manual_seed(1)
    t, h, i, e, k = 13, 32, 24, 6, 2
    hidden, logits = torch.randn(t, h, generator=g).to(dtype), torch.randn(t, e, generator=g)
    logits[:, 2] = -10.0
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.2).to(dtype)
    w_down = (torch.randn(e, h, i, generator=g) * 0.2).to(dtype)
    out = fused_moe_grouped_mm(hidden, logits, w_gate_up, w_down, k, renormalize, fp32_weights)
    ref = fused_moe_reference(hidden, logits, w_gate_up, w_down, k, renormalize, fp32_weights)
    assert out.dtype == dtype and torch.equal(out, ref)


def test_fused_moe_rejects_bad_shapes() -> None:
    hidden, logits = torch.randn(3, 8), torch.randn(3, 4)
    w_gate_up, w_down = torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    with pytest.raises(ValueError, match="top_k"):
        fused_moe_reference(hidden, logits, w_gate_up, w_down, 5, True, True)
    with pytest.raises(ValueError, match="w_down"):
        fused_moe_reference(hidden, logits, w_gate_up, torch.randn(4, 8, 5), 2, True, True)
    with pytest.raises(ValueError, match="disagree"):
        fused_moe_reference(hidden, torch.randn(3, 5), w_gate_up, w_down, 2, True, True)


def naive_experts(hidden: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                  w_down: torch.Tensor) -> torch.Tensor:
    """moe_experts' definition, token by token: the routing given."""
    inter = w_gate_up.shape[1] // 2
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gu = w_gate_up[e].double() @ hidden[t].double()
            out[t] += w * (w_down[e].double() @ (F.silu(gu[:inter]) * gu[inter:]))
    return out.to(hidden.dtype)


def random_routing(t: int, e: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, k] distinct experts a token (expert 3 never chosen) and positive weights (unnormalised)."""
    scores = torch.rand(t, e, generator=g)
    scores[:, 3] = -1.0
    return torch.rand(t, k, generator=g) * 2.5, torch.topk(scores, k).indices


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_moe_experts_reference_matches_definition(ids_dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    t, h, i, e, k = 11, 24, 16, 6, 3
    hidden = torch.randn(t, h, generator=g)
    w_gate_up, w_down = torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    weights, ids = random_routing(t, e, k, g)
    out = torch.ops.kiln.moe_experts(hidden, weights, ids.to(ids_dtype), w_gate_up, w_down)
    torch.testing.assert_close(out, naive_experts(hidden, weights, ids, w_gate_up, w_down), rtol=1e-5, atol=1e-5)
    assert out.shape == (t, h) and out.dtype == hidden.dtype
    # fused_moe is the softmax router followed by these experts.
    logits = torch.randn(t, e, generator=g)
    probs = torch.softmax(logits, -1)
    top = torch.topk(probs, k)
    torch.testing.assert_close(torch.ops.kiln.fused_moe(hidden, logits, w_gate_up, w_down, k, False, True),
                               torch.ops.kiln.moe_experts(hidden, top.values, top.indices, w_gate_up, w_down))


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_grouped_mm_equals_the_reference(weights_dtype: torch.dtype) -> None:
    from kiln.kernels.moe import moe_experts_grouped_mm, moe_experts_reference

    g = torch.Generator().manual_seed(3)
    t, h, i, e, k = 13, 32, 24, 6, 2
    hidden = torch.randn(t, h, generator=g).bfloat16()
    w_gate_up = (torch.randn(e, 2 * i, h, generator=g) * 0.2).bfloat16()
    w_down = (torch.randn(e, h, i, generator=g) * 0.2).bfloat16()
    weights, ids = random_routing(t, e, k, g)
    weights = weights.to(weights_dtype)
    out = moe_experts_grouped_mm(hidden, weights, ids, w_gate_up, w_down)
    assert out.dtype == torch.bfloat16 and torch.equal(out, moe_experts_reference(hidden, weights, ids, w_gate_up, w_down))


def test_moe_experts_rejects_bad_routing() -> None:
    hidden, w_gate_up, w_down = torch.randn(3, 8), torch.randn(4, 12, 8), torch.randn(4, 8, 6)
    weights, ids = torch.rand(3, 2), torch.tensor([[0, 1], [2, 3], [1, 2]])
    with pytest.raises(ValueError, match="both be \\[T, k\\] with T = 3"):
        torch.ops.kiln.moe_experts(hidden, weights[:2], ids[:2], w_gate_up, w_down)
    with pytest.raises(ValueError, match="both be"):
        torch.ops.kiln.moe_experts(hidden, weights, ids[:, :1], w_gate_up, w_down)
    with pytest.raises(ValueError, match="int64 or int32"):
        torch.ops.kiln.moe_experts(hidden, weights, ids.float(), w_gate_up, w_down)
    with pytest.raises(ValueError, match="must be in 1..4"):
        torch.ops.kiln.moe_experts(hidden, torch.rand(3, 5), torch.zeros(3, 5, dtype=torch.long), w_gate_up, w_down)
    with pytest.raises(ValueError, match="disagree"):
        torch.ops.kiln.moe_experts(hidden, weights, ids, w_gate_up, torch.randn(4, 8, 5))


# ---- the pass: before / after -------------------------------------------------------------------

@pytest.mark.parametrize("arch,dtype", [(a, torch.float32) for a in MOE_ARCHS]
                         + [("mixtral", torch.bfloat16), ("qwen2_moe", torch.bfloat16)])
def test_fuse_moe_rewrites_each_block_and_equals_the_unfused_graph(arch: str, dtype: torch.dtype) -> None:
    from kiln.compiler.pass_testing import capture_through, run_graph

    config = moe_config(arch)
    before = capture_through(config, "fusion", dtype=dtype)
    after = before.copy()
    stats = FuseMoEPass(on_cpu=True)(after.graph_module, PassContext(config=config, dtype=dtype))
    n = MOE_LAYERS[arch]
    assert stats == {"fused_moe": n, "moe_experts": 0}
    ops_before, ops_after = Counter(op_counts(before.graph_module)), Counter(op_counts(after.graph_module))
    assert ops_after[FUSED_OP] == n and ops_before[FUSED_OP] == 0
    # The experts' gathers and batched GEMMs, the router's softmax and top-k are all gone.
    for op in ("aten.bmm.default", "aten.index.Tensor", "aten.topk.default", "aten.repeat_interleave.self_int"):
        assert ops_before[op] > 0 and ops_after[op] == 0, op
    # The router GEMM stays (one aten.linear per block, feeding the op).
    fused = [nd for nd in after.graph_module.graph.nodes if str(nd.target) == FUSED_OP]
    assert all(nd.args[1].target == torch.ops.aten.linear.default for nd in fused)
    renorm = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}[arch]
    assert {nd.args[5] for nd in fused} == {renorm}
    assert {nd.args[4] for nd in fused} == {config.num_experts_per_tok}
    # The CPU reference computes what the unfused graph computes (13 tokens: odd, > top_k).
    out, ref = run_graph(after, num_tokens=13), run_graph(before, num_tokens=13)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # same roundings as the graph (fp32 or model-dtype routing weights): at most a last-place flip
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
        assert (out == ref).float().mean() > 0.99


# Routers other than a softmax and a top-k (tiny configs of tests/tiny_models.py): the router
# stays in the graph, the experts after it become kiln::moe_experts.
ROUTED_ARCHS = {"glm4_moe": 1, "ernie4_5_moe": 1, "phimoe": 2, "granitemoe": 2, "minimax_m2": 2}
EXPERTS_OP = "kiln.moe_experts.default"


@pytest.mark.parametrize("arch,dtype", [(a, torch.float32) for a in ROUTED_ARCHS] + [("glm4_moe", torch.bfloat16)])
def test_fuse_moe_fuses_the_experts_behind_any_router(arch: str, dtype: torch.dtype) -> None:
    from tiny_models import tiny_config

    from kiln.compiler.pass_testing import capture_through, run_graph

    config = tiny_config(arch)
    before = capture_through(config, "fusion", dtype=dtype)
    after = before.copy()
    n = ROUTED_ARCHS[arch]
    assert FuseMoEPass(on_cpu=True)(after.graph_module, PassContext(config=config, dtype=dtype)) == {
        "fused_moe": 0, "moe_experts": n}
    ops_before, ops_after = op_counts(before.graph_module), op_counts(after.graph_module)
    assert ops_after[EXPERTS_OP] == n and ops_after[FUSED_OP] == 0
    for op in ("aten.bmm.default", "aten.index.Tensor", "aten.repeat_interleave.self_int"):
        assert ops_before[op] - ops_after[op] == (1 if op.startswith("aten.repeat") else 2) * n, op  # (RoPE repeats too)
    # The router is untouched: what picks the experts (top-k or max) still runs in the graph.
    selects = ("aten.topk.default", "aten.max.dim")
    assert sum(ops_after[op] for op in selects) == sum(ops_before[op] for op in selects) > 0
    out, ref = run_graph(after, num_tokens=13), run_graph(before, num_tokens=13)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
        assert (out == ref).float().mean() > 0.99


def assert_runs_like(after: Any, before: Any, dtype: torch.dtype) -> None:
    """The fused graph's logits equal the unfused one's (within bf16 rounding in bfloat16)."""
    from kiln.compiler.pass_testing import run_graph

    out, ref = run_graph(after, num_tokens=13), run_graph(before, num_tokens=13)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_moe_fuses_gpt_oss_experts(dtype: torch.dtype) -> None:
    """GPT-OSS's experts ([E, in, out] weights with gate and up channels interleaved, biases, the
    clamped SwiGLU) become `kiln::moe_experts` over rearranged weights: new inputs that the
    loader builds (`RearrangeExperts`, through the transforms' JSON as a cached graph's are),
    the checkpoint's own no longer bound; the result equals the unfused graph's."""
    from tiny_models import tiny_config

    from kiln.compiler.graph_inputs import param_name
    from kiln.compiler.pass_testing import capture_through
    from kiln.passes.weight_transforms import RearrangeExperts, transforms_from_json, transforms_to_json

    config = tiny_config("gpt_oss")
    before = capture_through(config, "fusion", dtype=dtype)
    after = before.copy()
    assert after.run_pass(FuseMoEPass(on_cpu=True)) == {"fused_moe": 0, "moe_experts": 2}
    ops_before, ops_after = op_counts(before.graph_module), op_counts(after.graph_module)
    assert ops_after[EXPERTS_OP] == 2
    # The gathers' batched GEMMs and the activation's clamps and sigmoids are all gone.
    for op, per_layer in (("aten.bmm.default", 2), ("aten.sigmoid.default", 1), ("aten.clamp.default", 2)):
        assert ops_before[op] == 2 * per_layer and ops_after[op] == 0, op
    node = next(n for n in after.graph_module.graph.nodes if str(n.target) == EXPERTS_OP)
    assert node.kwargs["activation"] == "swiglu_oai" and node.kwargs["limit"] == config.swiglu_limit
    assert node.kwargs["alpha"] == pytest.approx(1.702)
    assert param_name(node.args[3]) == "model.layers.0.mlp.experts.w_gate_up"
    assert param_name(node.kwargs["b_down"]) == "model.layers.0.mlp.experts.down_proj_bias"
    bound = {param_name(p) for p in after.graph_module.graph.find_nodes(op="placeholder")}
    assert "model.layers.0.mlp.experts.gate_up_proj" not in bound and "model.layers.0.mlp.experts.w_down" in bound
    transforms = after.context.weight_transforms
    assert sum(isinstance(t, RearrangeExperts) for t in transforms) == 3 * 2
    assert transforms_from_json(transforms_to_json(transforms)) == transforms
    assert_runs_like(after, before, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fuse_moe_fuses_llama4_experts(dtype: torch.dtype) -> None:
    """Llama 4's experts (every expert on every token, its input scaled by the token's sigmoid
    score, 0 off the top k) become `kiln::moe_experts` over the top-k pairs alone, on inputs
    scaled as the model scales them, with the [E, in, out] weights transposed at load; the
    shared expert and the router stay; the result equals the unfused graph's."""
    from tiny_models import tiny_config

    from kiln.compiler.graph_inputs import param_name
    from kiln.compiler.pass_testing import capture_through
    from kiln.passes.weight_transforms import RearrangeExperts, transforms_from_json, transforms_to_json

    config = tiny_config("llama4_text")
    layers = sum(1 for i in range(config.num_hidden_layers) if i in config.moe_layers)
    before = capture_through(config, "fusion", dtype=dtype)
    after = before.copy()
    assert after.run_pass(FuseMoEPass(on_cpu=True)) == {"fused_moe": 0, "moe_experts": layers}
    ops_before, ops_after = op_counts(before.graph_module), op_counts(after.graph_module)
    assert ops_after[EXPERTS_OP] == layers > 0
    assert ops_before["aten.bmm.default"] == 2 * layers and ops_after["aten.bmm.default"] == 0
    assert ops_after["aten.repeat.default"] == ops_before["aten.repeat.default"] - layers
    assert ops_after["aten.topk.default"] == ops_before["aten.topk.default"] == layers  # the router stays
    node = next(n for n in after.graph_module.graph.nodes if str(n.target) == EXPERTS_OP)
    prefix = f"model.layers.{min(config.moe_layers)}.feed_forward.experts"
    assert param_name(node.args[3]) == f"{prefix}.w_gate_up" and param_name(node.args[4]) == f"{prefix}.w_down"
    bound = {param_name(p) for p in after.graph_module.graph.find_nodes(op="placeholder")}
    assert f"{prefix}.gate_up_proj" not in bound and f"{prefix}.down_proj" not in bound
    transforms = after.context.weight_transforms
    assert sum(isinstance(t, RearrangeExperts) and t.transpose and not t.deinterleave for t in transforms) == 2 * layers
    assert transforms_from_json(transforms_to_json(transforms)) == transforms
    assert_runs_like(after, before, dtype)


def test_gpt_oss_experts_in_fp8_keep_their_biases_and_activation() -> None:
    """FP8 experts (`experts=True`) over GPT-OSS's rearranged weights: `moe_experts_fp8` with the
    same biases and activation, quantized after the rearrangement; close to the 16-bit graph."""
    from tiny_models import tiny_config

    from kiln.compiler.pass_testing import graph_for_pass, run_graph
    from kiln.passes.quantize_fp8 import QuantizeFP8Pass
    from kiln.passes.weight_transforms import QuantizeFP8Weight, RearrangeExperts

    before = graph_for_pass(tiny_config("gpt_oss"), "quantize_fp8", cpu_fusions=True)
    assert op_counts(before.graph_module)[EXPERTS_OP] == 2
    plain, fp8 = before.copy(), before.copy()
    plain.run_pass(QuantizeFP8Pass(keep_edge_layers=False, experts=False))
    assert fp8.run_pass(QuantizeFP8Pass(keep_edge_layers=False))["fp8_experts"] == 2  # by default
    node = next(n for n in fp8.graph_module.graph.nodes if str(n.target) == "kiln.moe_experts_fp8.default")
    assert node.kwargs["activation"] == "swiglu_oai" and node.kwargs["b_gate_up"] is not None
    transforms = fp8.context.weight_transforms
    name = "model.layers.0.mlp.experts.w_gate_up"
    rearranged = next(i for i, t in enumerate(transforms) if isinstance(t, RearrangeExperts) and t.output == name)
    quantized = next(i for i, t in enumerate(transforms) if isinstance(t, QuantizeFP8Weight) and t.weight == name)
    assert rearranged < quantized  # the loader rearranges, then quantizes
    out, ref = run_graph(fp8, num_tokens=13), run_graph(plain, num_tokens=13)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max() and not torch.equal(out, ref)


def test_rearrange_experts_transposes_and_deinterleaves() -> None:
    from kiln.passes.weight_transforms import RearrangeExperts, WeightTransformError

    w = torch.arange(2 * 3 * 4).reshape(2, 3, 4)  # [E, in, out]: out channels g0 u0 g1 u1
    weights = {"w": w}
    RearrangeExperts("new", "w", transpose=True, deinterleave=True).apply(weights)
    assert set(weights) == {"new"}
    expected = torch.stack([w[:, :, 0], w[:, :, 2], w[:, :, 1], w[:, :, 3]], dim=1)  # [E, out, in]: g0 g1 u0 u1
    assert torch.equal(weights["new"], expected) and weights["new"].is_contiguous()
    bias = {"b": torch.tensor([[1, 2, 3, 4]])}
    RearrangeExperts("nb", "b", deinterleave=True).apply(bias)
    assert bias["nb"].tolist() == [[1, 3, 2, 4]]
    with pytest.raises(WeightTransformError, match="lack 'missing'"):
        RearrangeExperts("x", "missing").apply({})


def test_fuse_moe_leaves_experts_whose_ids_it_cannot_vouch_for() -> None:
    """The kernels index the expert weights by the ids unchecked: ids the pass cannot trace to a
    top-k or max over the experts' scores (here, the top-k's ids plus zero) are left unfused."""
    from tiny_models import tiny_config

    from kiln.compiler.pass_testing import capture_through, run_graph

    config = tiny_config("glm4_moe")
    before = capture_through(config, "fusion")
    graph = before.graph_module.graph
    for rep in graph.find_nodes(op="call_function", target=torch.ops.aten.repeat_interleave.self_int):
        from kiln.passes.fuse_moe import match_experts

        ids = match_experts(rep).topk_ids
        flat = next(u for u in ids.users if u.target in (torch.ops.aten.reshape.default, torch.ops.aten.view.default)
                    and list(u.args[1]) == [-1])
        with graph.inserting_before(flat):
            shifted = graph.call_function(torch.ops.aten.add.Tensor, (ids, 0))
        shifted.meta["val"] = ids.meta["val"]
        flat.replace_input_with(ids, shifted)
    before.graph_module.recompile()
    after = before.copy()
    assert FuseMoEPass(on_cpu=True)(after.graph_module, PassContext(config=config)) == {"fused_moe": 0,
                                                                                       "moe_experts": 0}
    torch.testing.assert_close(run_graph(after, num_tokens=5), run_graph(before, num_tokens=5))


@pytest.mark.parametrize("arch,routers", [
    ("phimoe", ["model.layers.0.mlp.router.weight", "model.layers.1.mlp.router.weight"]),
    ("granitemoe", ["model.layers.0.block_sparse_moe.router.weight", "model.layers.1.block_sparse_moe.router.weight"]),
    ("glm4_moe", ["model.layers.1.mlp.gate.weight"])])  # (its layer 0 is dense)
def test_router_projections_are_found_by_structure_and_stay_unquantized(arch: str, routers: list[str]) -> None:
    """quantize_fp8 keeps routers in the model dtype whatever their name (PhiMoE's and Granite's
    `router`): the projections that decide a block's routing, found in the graph with the
    experts fused or not, and nothing else (Granite's router output takes the block input's
    dtype by `type_as`: a path back to every earlier layer if the walk followed it)."""
    from tiny_models import tiny_config

    from kiln.compiler.graph_inputs import param_name
    from kiln.compiler.pass_testing import capture_through, graph_for_pass
    from kiln.passes.fuse_moe import router_projections
    from kiln.passes.quantize_fp8 import QuantizeFP8Pass

    config = tiny_config(arch)
    unfused = capture_through(config, "fusion")
    fused = graph_for_pass(config, "quantize_fp8", cpu_fusions=True)
    for graph in (unfused, fused):
        assert sorted(param_name(n.args[1]) for n in router_projections(graph.graph_module)) == routers
    stats = fused.run_pass(QuantizeFP8Pass(keep_edge_layers=False, experts=True))
    assert stats["fp8_experts"] == ROUTED_ARCHS[arch]
    counts = op_counts(fused.graph_module)
    assert counts["kiln.moe_experts_fp8.default"] == ROUTED_ARCHS[arch] and counts[EXPERTS_OP] == 0
    linears = {param_name(n.args[1]) for n in fused.graph_module.graph.find_nodes(
        op="call_function", target=torch.ops.aten.linear.default)}
    assert set(routers) <= linears  # the routers stay unquantized linears


@pytest.mark.parametrize("fused", [False, True])
def test_bfloat16_engine_reads_the_float32_router_as_float32(fused: bool, tiny_model_dir, monkeypatch) -> None:
    """GLM-4.5's router weight is float32 in a bfloat16 model (the graph multiplies float32
    hidden states by it): the spec records it and the loader reads it so, or the step fails."""
    monkeypatch.setenv(CPU_FUSIONS_ENV, "1" if fused else "0")
    from kiln.runtime import LLM, SamplingParams

    path, hf = tiny_model_dir("glm4_moe")
    llm = LLM(str(path), dtype="bfloat16", device="cpu", progress=False)
    assert llm.engine.graph_spec.param_dtypes == {"model.layers.1.mlp.gate.weight": torch.float32}
    out = llm.generate([[1, 5, 7, 9, 11]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6


def test_moe_experts_fp8_is_the_dequantized_op() -> None:
    from kiln.kernels.fp8 import quantize_fp8_rows
    from kiln.kernels.moe import dequantize_experts, moe_experts_reference

    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(9, 32, generator=g)
    w_gate_up, w_down = torch.randn(4, 48, 32, generator=g), torch.randn(4, 32, 24, generator=g)
    weights, ids = random_routing(9, 4, 2, g)
    (gq, gs), (dq, ds) = quantize_fp8_rows(w_gate_up), quantize_fp8_rows(w_down)
    gs, ds = gs.squeeze(-1), ds.squeeze(-1)
    out = torch.ops.kiln.moe_experts_fp8(hidden, weights, ids, gq, gs, dq, ds)
    ref = moe_experts_reference(hidden, weights, ids, dequantize_experts(gq, gs, torch.float32),
                                dequantize_experts(dq, ds, torch.float32))
    torch.testing.assert_close(out, ref)
    with pytest.raises(ValueError, match="one scale per expert and output channel"):
        torch.ops.kiln.moe_experts_fp8(hidden, weights, ids, gq, gs[:, :10], dq, ds)


def test_checkpoint_buffers_replace_the_captured_values(tmp_path) -> None:
    """A router's selection bias is a persistent buffer: zero when captured from the config,
    trained in the checkpoint. The loader takes the checkpoint's (under the name transformers
    saves it, Exaone-MoE's `mlp.e_score_correction_bias` for the model's
    `mlp.gate.e_score_correction_bias`), keeps the captured value where a checkpoint lacks it,
    and refuses one of another shape."""
    from safetensors.torch import load_file, save_file
    from tiny_models import save_tiny_model

    from kiln.compiler.capture import capture
    from kiln.compiler.model_source import resolve_model
    from kiln.runtime.model_loading import constants_from_checkpoint

    model = save_tiny_model("exaone_moe", tmp_path)
    captured = capture(model.config)
    name = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert captured.checkpoint_buffers[name] == [name, "model.layers.1.mlp.e_score_correction_bias"]
    assert torch.count_nonzero(captured.constants[name]) == 0
    source = resolve_model(str(tmp_path))
    loaded = constants_from_checkpoint(captured.constants, captured.checkpoint_buffers, source)
    torch.testing.assert_close(loaded[name], dict(model.named_buffers())[name])
    assert torch.count_nonzero(loaded[name]) > 0
    tensors = load_file(tmp_path / "model.safetensors")
    saved = tensors.pop("model.layers.1.mlp.e_score_correction_bias")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    kept = constants_from_checkpoint(captured.constants, captured.checkpoint_buffers, source)
    assert torch.equal(kept[name], captured.constants[name])
    tensors["model.layers.1.mlp.e_score_correction_bias"] = torch.cat([saved, saved])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint and its config.json disagree"):
        constants_from_checkpoint(captured.constants, captured.checkpoint_buffers, source)


# ---- FP8 experts (QuantizeFP8Pass(experts=True), kiln::fused_moe_fp8) ------------------------------

@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_fp8_experts_rewrite_each_fused_moe_and_stay_close(arch: str) -> None:
    """With experts=True each fused MoE block runs e4m3 experts (one scale per expert and output
    channel, quantized at load by the weight transforms); the logits stay close to the
    unquantized graph's. With experts=False they stay in the model dtype."""
    from kiln.compiler.pass_testing import graph_for_pass, run_graph
    from kiln.passes.quantize_fp8 import QuantizeFP8Pass
    from kiln.passes.weight_transforms import QuantizeFP8Weight, fp8_scale_name

    config = moe_config(arch)
    before = graph_for_pass(config, "quantize_fp8", cpu_fusions=True)
    assert op_counts(before.graph_module)[FUSED_OP] == MOE_LAYERS[arch]
    plain, fp8 = before.copy(), before.copy()
    plain_stats = plain.run_pass(QuantizeFP8Pass(keep_edge_layers=False, experts=False))
    assert "fp8_experts" not in plain_stats and op_counts(plain.graph_module)[FUSED_OP] == MOE_LAYERS[arch]
    stats = fp8.run_pass(QuantizeFP8Pass(keep_edge_layers=False, experts=True))
    assert stats["fp8_experts"] == MOE_LAYERS[arch] and stats["kept_high_precision_experts"] == 0
    counts = op_counts(fp8.graph_module)
    assert counts["kiln.fused_moe_fp8.default"] == MOE_LAYERS[arch] and counts[FUSED_OP] == 0
    experts = [t.weight for t in fp8.context.weight_transforms
               if isinstance(t, QuantizeFP8Weight) and ".experts." in t.weight]
    assert len(experts) == 2 * MOE_LAYERS[arch]
    roles = {n.meta["kiln_input"] for n in fp8.graph_module.graph.find_nodes(op="placeholder")}
    assert all(f"param:{fp8_scale_name(n)}" in roles for n in experts)
    out, ref = run_graph(fp8, num_tokens=13), run_graph(plain, num_tokens=13)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert not torch.equal(out, ref)  # the experts did change
    assert QuantizeFP8Pass(experts=True).uuid() != QuantizeFP8Pass(experts=False).uuid()


def test_experts_run_in_fp8_by_default(monkeypatch) -> None:
    """quantization="fp8" quantizes the experts too, as vLLM does: a 16-bit checkpoint's at load,
    a pre-quantized FP8 checkpoint's kept FP8 (widened to 16 bits they would hold twice its
    bytes); not where the checkpoint left them unquantized or KILN_FP8_EXPERTS=0 says so."""
    import copy

    from kiln.compiler.pass_testing import graph_for_pass
    from kiln.passes.quantize_fp8 import QuantizeFP8Pass

    monkeypatch.delenv("KILN_FP8_EXPERTS", raising=False)
    config = moe_config("qwen3_moe")
    before = graph_for_pass(config, "quantize_fp8", cpu_fusions=True)

    def fp8_experts(quantization_config: dict | None, **pass_options) -> int:
        graph = before.copy()
        graph.context.config = copy.copy(graph.context.config)
        graph.context.config.quantization_config = quantization_config
        stats = graph.run_pass(QuantizeFP8Pass(keep_edge_layers=False, **pass_options))
        return stats.get("fp8_experts", 0)

    layers = MOE_LAYERS["qwen3_moe"]
    hf_fp8 = {"quant_method": "fp8", "weight_block_size": [32, 32], "modules_to_not_convert": ["lm_head"]}
    compressed = {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*mlp\\.gate$"]}
    assert fp8_experts(None) == layers
    assert fp8_experts(hf_fp8) == layers and fp8_experts(compressed) == layers
    assert fp8_experts({**hf_fp8, "modules_to_not_convert": ["lm_head", "mlp.experts"]}) == 0
    assert fp8_experts({**compressed, "ignore": ["re:.*mlp\\.experts\\..*"]}) == 0
    monkeypatch.setenv("KILN_FP8_EXPERTS", "0")
    assert fp8_experts(hf_fp8) == 0 and fp8_experts(None) == 0
    monkeypatch.setenv("KILN_FP8_EXPERTS", "1")
    assert fp8_experts(None) == layers
    assert fp8_experts(None, experts=False) == 0  # the pass's own option outranks the environment
    monkeypatch.delenv("KILN_FP8_EXPERTS")
    assert len({QuantizeFP8Pass(experts=e).uuid() for e in (None, True, False)}) == 3  # auto, on, off


def test_fp8_moe_checkpoint_loads_with_fp8_experts(tmp_path, moe_model_dir, monkeypatch) -> None:
    """End to end: a block-wise FP8 Qwen3-MoE checkpoint (every projection, the per-expert Hub
    tensors included, in e4m3) runs its experts as kiln::fused_moe_fp8 without being asked,
    and its greedy tokens mostly agree with the 16-bit model's."""
    from test_fp8 import save_fp8_checkpoint

    from kiln.runtime import LLM, SamplingParams

    monkeypatch.delenv("KILN_FP8_EXPERTS", raising=False)
    monkeypatch.setenv(CPU_FUSIONS_ENV, "1")
    path, _ = moe_model_dir("qwen3_moe")
    save_fp8_checkpoint(path, tmp_path / "fp8", "hf-block")
    prompts = [[1, 5, 9, 20, 33, 7], list(range(3, 30))]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in LLM(str(path), dtype="float32", progress=False).generate(
        prompts, greedy)]
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", progress=False)
    records = {r["name"]: r["stats"] for r in llm.engine.graph_spec.pass_records}
    assert records["quantize_fp8"]["fp8_experts"] == MOE_LAYERS["qwen3_moe"]
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    same = sum(a == b for x, y in zip(out, reference) for a, b in zip(x, y)) / sum(map(len, reference))
    assert same > 0.5, (out, reference)


def test_fp8_experts_op_is_the_dequantized_fused_moe_and_checks_its_scales() -> None:
    from kiln.kernels.fp8 import quantize_fp8_rows
    from kiln.kernels.moe import dequantize_experts

    g = torch.Generator().manual_seed(0)
    hidden, logits = torch.randn(9, 32, generator=g), torch.randn(9, 4, generator=g)
    w_gate_up, w_down = torch.randn(4, 48, 32, generator=g), torch.randn(4, 32, 24, generator=g)
    (gq, gs), (dq, ds) = quantize_fp8_rows(w_gate_up), quantize_fp8_rows(w_down)
    gs, ds = gs.squeeze(-1), ds.squeeze(-1)
    out = torch.ops.kiln.fused_moe_fp8(hidden, logits, gq, gs, dq, ds, 2, True, True)
    ref = fused_moe_reference(hidden, logits, dequantize_experts(gq, gs, torch.float32),
                              dequantize_experts(dq, ds, torch.float32), 2, True, True)
    torch.testing.assert_close(out, ref)
    exact = fused_moe_reference(hidden, logits, w_gate_up, w_down, 2, True, True)
    assert (out - exact).abs().max() < 0.1 * exact.abs().max()  # e4m3's 2^-4 steps, not more
    with pytest.raises(ValueError, match="one scale per expert and output channel"):
        torch.ops.kiln.fused_moe_fp8(hidden, logits, gq, gs[:, :10], dq, ds, 2, True, True)
    with pytest.raises(ValueError, match="expert weights must be"):
        torch.ops.kiln.fused_moe_fp8(hidden, logits, w_gate_up, gs, dq, ds, 2, True, True)


def test_fp8_expert_weights_quantize_at_load_and_refuse_prequantized_ones() -> None:
    from kiln.kernels.fp8 import FP8_DTYPE
    from kiln.passes.weight_transforms import QuantizeFP8Weight, WeightTransformError

    w = torch.randn(3, 8, 16)
    weights = {"model.layers.0.mlp.experts.gate_up_proj": w.clone()}
    QuantizeFP8Weight("model.layers.0.mlp.experts.gate_up_proj").apply(weights)
    q, scale = weights["model.layers.0.mlp.experts.gate_up_proj"], weights["model.layers.0.mlp.experts.gate_up_proj_scale"]
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and scale.shape == (3, 8) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, w.abs().amax(dim=-1) / 448.0)
    with pytest.raises(WeightTransformError, match="pre-quantized FP8 expert weights"):
        QuantizeFP8Weight("e").apply({"e": w.to(FP8_DTYPE)})


def test_fuse_moe_matches_after_fuse_silu_mul() -> None:
    """Whichever runs first: after fuse_silu_mul the experts' activation is kiln::silu_and_mul."""
    from kiln.passes.fuse_silu_mul import FuseSiluMulPass
    from kiln.compiler.pass_testing import capture_through, run_graph

    config = moe_config("qwen3_moe")
    before = capture_through(config, "fusion")
    after = before.copy()
    ctx = PassContext(config=config)
    assert FuseSiluMulPass(on_cpu=True)(after.graph_module, ctx)["silu_and_mul"] == 2
    assert FuseMoEPass(on_cpu=True)(after.graph_module, ctx) == {"fused_moe": 2, "moe_experts": 0}
    assert op_counts(after.graph_module)["kiln.silu_and_mul.default"] == 0
    torch.testing.assert_close(run_graph(after, num_tokens=5), run_graph(before, num_tokens=5), rtol=1e-5, atol=1e-5)


def test_fuse_moe_follows_the_device_policy_and_ignores_dense_models(monkeypatch) -> None:
    from tiny_models import tiny_config

    from kiln.compiler.pass_testing import capture_through

    monkeypatch.delenv(CPU_FUSIONS_ENV, raising=False)
    moe = capture_through(moe_config("mixtral"), "fusion")
    assert FuseMoEPass()(moe.graph_module, PassContext(config=None)) == {"skipped_on_cpu": 1}
    monkeypatch.setenv(CPU_FUSIONS_ENV, "1")
    assert FuseMoEPass()(moe.graph_module, PassContext(config=None)) == {"fused_moe": 2, "moe_experts": 0}
    dense = capture_through(tiny_config("llama"), "fusion")
    assert FuseMoEPass()(dense.graph_module, PassContext(config=None)) == {"fused_moe": 0, "moe_experts": 0}
    assert FuseMoEPass(on_cpu=True).uuid() != FuseMoEPass(on_cpu=False).uuid()


def test_fuse_moe_is_registered_in_the_fusion_phase() -> None:
    from kiln.passes.registry import create_pass

    p = create_pass("fuse_moe")
    assert p.phase == "fusion" and isinstance(p, FuseMoEPass)


# ---- checkpoints in the Hub layout --------------------------------------------------------------

@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_loader_stacks_hub_expert_tensors(arch: str, moe_model_dir) -> None:
    from safetensors import safe_open

    from kiln.compiler.capture import capture
    from kiln.compiler.model_source import resolve_model

    path, hf = moe_model_dir(arch)
    keys: set[str] = set()
    for shard in path.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            keys.update(f.keys())
    # One matrix per expert on disk, as the Hub stores them; none stacked.
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    expert_key = {"mixtral": "model.layers.0.block_sparse_moe.experts.3.w1.weight"}.get(
        arch, "model.layers.0.mlp.experts.3.gate_proj.weight")
    assert expert_key in keys

    source = resolve_model(str(path))
    captured = capture(source.config, torch.float32)
    weights = source.load_weights(captured.param_aliases, torch.float32, "cpu", progress=False)
    expected = dict(hf.named_parameters())
    assert set(weights) == set(expected)
    stacked = [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(stacked) == 2 * MOE_LAYERS[arch]
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)


def test_loader_stacks_experts_spread_over_shards(moe_model_dir, tmp_path) -> None:
    """A sharded checkpoint (as large ones are) with one layer's experts split across files."""
    from safetensors import safe_open

    from kiln.compiler.capture import capture
    from kiln.compiler.model_source import resolve_model

    _, hf = moe_model_dir("qwen3_moe")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    where = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), shard.name))
    layer0 = {where[f"model.layers.0.mlp.experts.{e}.{w}.weight"] for e in range(6)
              for w in ("gate_proj", "up_proj", "down_proj")}
    assert len(layer0) > 1, "the test needs layer 0's experts in more than one shard"
    source = resolve_model(str(tmp_path))
    weights = source.load_weights(capture(source.config).param_aliases, torch.float32, "cpu", progress=False)
    for name, p in hf.named_parameters():
        torch.testing.assert_close(weights[name], p, rtol=0, atol=0, msg=name)


# ---- parity with Hugging Face -------------------------------------------------------------------

PROMPTS = [[1, 5, 7, 9, 11, 13, 2], [3, 4], list(range(10, 47))]
NEW_TOKENS = 24
_HF_GREEDY: dict[str, list[list[int]]] = {}


def hf_greedy(arch: str, hf: torch.nn.Module) -> list[list[int]]:
    if arch not in _HF_GREEDY:
        outs = []
        for p in PROMPTS:
            out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
        _HF_GREEDY[arch] = outs
    return _HF_GREEDY[arch]


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_greedy_tokens_and_logits_match_hf(arch: str, fused: bool, moe_model_dir, monkeypatch) -> None:
    from test_parity import assert_first_step_logits_match

    from kiln.runtime import LLM, SamplingParams

    if fused:
        monkeypatch.setenv(CPU_FUSIONS_ENV, "1")
    else:
        monkeypatch.delenv(CPU_FUSIONS_ENV, raising=False)
    path, hf = moe_model_dir(arch)
    llm = LLM(str(path), dtype="float32", device="cpu", progress=False)
    graph = llm.engine.graph
    assert graph is not None
    n_fused = op_counts(graph.graph_module)[FUSED_OP]
    assert n_fused == (MOE_LAYERS[arch] if fused else 0)
    if not fused:
        assert op_counts(graph.graph_module)["aten.bmm.default"] == 2 * MOE_LAYERS[arch]

    assert_first_step_logits_match(llm, hf, PROMPTS, f"{arch}")

    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(arch, hf), f"{arch}: greedy tokens differ"


# ---- GPU: the whole pipeline with the Triton kernel ---------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_gpu_moe_float32_greedy_equals_hf_cpu(arch: str, moe_model_dir, tmp_path) -> None:
    """CUDA, default pipeline (fuse_moe on by default there; kiln::fused_moe runs the Triton
    grouped GEMM, including inside the decode CUDA graphs): greedy tokens equal HF's on CPU."""
    from kiln.runtime.config import EngineConfig
    from kiln.runtime.engine import LLMEngine
    from kiln.runtime.sampling_params import SamplingParams

    path, hf = moe_model_dir(arch)
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="float32", num_kv_blocks=64,
                                    block_size=16, progress=False, compile="eager",
                                    cache_dir=str(tmp_path / "cache"), max_num_seqs=4, max_num_batched_tokens=64,
                                    decode_buckets=[1, 2, 4], token_buckets=[16, 32, 64]))
    assert engine.graph is not None
    assert op_counts(engine.graph.graph_module)[FUSED_OP] == MOE_LAYERS[arch]
    outs = hf_greedy(arch, hf)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id] = list(out.outputs[0].token_ids)
    assert [got[str(i)] for i in range(len(PROMPTS))] == outs, f"{arch}: greedy tokens differ on the GPU"


# ---- transformers versions: the experts implementation and the ids clamp ------------------------

def _config_state(config: Any) -> dict[str, Any]:
    return {"dict": config.to_dict(), "experts": getattr(config, "_experts_implementation", None),
            "attn": getattr(config, "_attn_implementation", None), "use_cache": config.use_cache}


def test_capture_builds_batched_mm_on_a_copy_of_the_callers_config() -> None:
    """transformers' `_from_config` writes the experts/attention implementation and dtype onto
    the config it is given, and capture turns `use_cache` off: on the caller's object those
    made a later Hugging Face baseline decode without a KV cache and with batched_mm experts."""
    from kiln.compiler.capture import build_hf_model, capture

    config = moe_config("mixtral")
    state = _config_state(config)
    model = build_hf_model(config, torch.bfloat16, "meta")
    assert model.config is not config
    assert model.config._experts_implementation == "batched_mm" and model.config.use_cache is False
    captured = capture(config)
    assert op_counts(captured.graph_module)["aten.bmm.default"] == 2 * MOE_LAYERS["mixtral"]
    assert _config_state(config) == state


def _insert_ids_clamp(gm: torch.fx.GraphModule, high_minus_e: int) -> int:
    """Put clamp(ids, 0, E - 1 + high_minus_e) between each block's flat ids and its two expert
    gathers, as transformers up to 5.17 traces batched_mm. Returns how many were inserted."""
    aten = torch.ops.aten
    count = 0
    for ids in list(gm.graph.nodes):
        gathers = [u for u in ids.users if u.target == aten.index.Tensor]
        if ids.target != aten.reshape.default or len(gathers) not in (2, 4):  # (4: GPT-OSS's biases too)
            continue
        num_experts = gathers[0].args[0].meta["val"].shape[0]
        with gm.graph.inserting_after(ids):
            clamp = gm.graph.call_function(aten.clamp.default, (ids, 0, num_experts - 1 + high_minus_e))
        clamp.meta["val"] = ids.meta["val"]
        for g in gathers:
            g.args = (g.args[0], [clamp])
        count += 1
    gm.recompile()
    return count


def test_fuse_moe_matches_the_ids_clamp_of_older_transformers() -> None:
    """transformers 5.17's batched_mm clamps the expert ids to [0, E - 1] before gathering
    (5.24 no longer does outside expert parallelism): that no-op clamp is part of the block;
    any other clamp changes the routing and the block must stay unfused."""
    from kiln.compiler.pass_testing import capture_through, run_graph

    config = moe_config("qwen3_moe")
    plain = capture_through(config, "fusion")
    ctx = PassContext(config=config)
    for high_minus_e, fused in ((0, MOE_LAYERS["qwen3_moe"]), (-1, 0)):
        before = plain.copy()
        n_clamps = sum(1 for nd in before.graph_module.graph.nodes if nd.target == torch.ops.aten.clamp.default)
        if n_clamps == 0:  # traced by a transformers that does not clamp: add it as 5.17 does
            assert _insert_ids_clamp(before.graph_module, high_minus_e) == MOE_LAYERS["qwen3_moe"]
        elif high_minus_e != 0:
            continue  # already the 5.17 form with the right bounds; the wrong-bounds case needs the insert
        after = before.copy()
        assert FuseMoEPass(on_cpu=True)(after.graph_module, ctx) == {"fused_moe": fused, "moe_experts": 0}
        if fused:
            assert op_counts(after.graph_module)["aten.clamp.default"] == 0
            torch.testing.assert_close(run_graph(after, num_tokens=7), run_graph(before, num_tokens=7),
                                       rtol=1e-5, atol=1e-5)


def test_fuse_moe_matches_gpt_oss_experts_behind_the_ids_clamp_of_older_transformers() -> None:
    """GPT-OSS's experts as transformers 5.17 (the GPU image's) traces them: the ids clamped to
    [0, E - 1] before the four gathers (weights and biases). Fused with that clamp, unfused
    with any other."""
    from tiny_models import tiny_config

    from kiln.compiler.pass_testing import capture_through, run_graph

    plain = capture_through(tiny_config("gpt_oss"), "fusion")
    ids_clamps = sum(1 for nd in plain.graph_module.graph.nodes if nd.target == torch.ops.aten.clamp.default
                     and nd.args[1:] == (0, 3))
    for high_minus_e, fused in ((0, 2), (-1, 0)):
        before = plain.copy()
        if ids_clamps == 0:
            assert _insert_ids_clamp(before.graph_module, high_minus_e) == 2
        elif high_minus_e != 0:
            continue
        after = before.copy()
        assert after.run_pass(FuseMoEPass(on_cpu=True)) == {"fused_moe": 0, "moe_experts": fused}
        if fused:
            torch.testing.assert_close(run_graph(after, num_tokens=7), run_graph(before, num_tokens=7),
                                       rtol=1e-5, atol=1e-5)


def _bench_moe(monkeypatch) -> Any:
    import importlib.util
    import sys

    bench = Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("kiln_bench_moe", bench / "moe.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_baseline_keeps_a_kv_cache_and_no_batched_mm_after_capture(monkeypatch) -> None:
    """bench/moe.py builds the Hugging Face baseline from the config Kiln captured: it must
    decode with a KV cache (one token a step) and never run batched_mm, not even through
    generate's decode-time switch to it on GPUs."""
    from kiln.compiler.capture import parameter_shapes

    bench = _bench_moe(monkeypatch)
    config = moe_config("mixtral")
    parameter_shapes(config)  # what the bench does first (weight and expert byte counts)
    model = bench.hf_moe_model(config, torch.float32, torch.device("cpu"), None)
    assert model.config._experts_implementation in ("grouped_mm", "eager")
    calls: list[tuple[int, str]] = []
    for m in model.modules():
        if hasattr(m, "gate_up_proj"):
            m.register_forward_pre_hook(lambda mod, args: calls.append((args[0].shape[0], mod.config._experts_implementation)))
    prompt_len = 6
    model.generate(torch.ones(1, prompt_len, dtype=torch.long), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    impl = model.config._experts_implementation
    assert calls == [(prompt_len, impl)] * MOE_LAYERS["mixtral"] + [(1, impl)] * (2 * MOE_LAYERS["mixtral"])
    # On a GPU generate would switch grouped_mm to batched_mm for its decode loop; that switch is off.
    with model._optimize_model_for_decode():
        assert model.config._experts_implementation == impl
    # And should transformers switch anyway, the baseline stops instead of running it.
    model.set_experts_implementation("batched_mm")
    with pytest.raises(RuntimeError, match="batched_mm"):
        model(torch.ones(1, 2, dtype=torch.long))


def test_bench_counts_the_weight_bytes_the_engine_holds(monkeypatch, tiny_model_dir) -> None:
    """bench/moe.py's decode limit and bandwidth use the bytes the engine holds as loaded: each
    tensor once, the experts a token does not reach left out of its active bytes, and FP8
    projections at one byte an element. (On CPU the experts stay unfused, so KILN_FP8_EXPERTS
    cannot quantize them here: tests/test_moe_triton.py covers their kernels.)"""
    from kiln.runtime import LLM

    bench = _bench_moe(monkeypatch)
    src, _ = tiny_model_dir("mixtral")
    experts, top_k = 4, 2  # tests/tiny_models.py's Mixtral
    llm = LLM(str(src), compile="eager", progress=False)
    runner = llm.engine.runner
    params = {r[len("param:"):]: runner.param_input(r[len("param:"):]) for r in runner.input_roles
              if r.startswith("param:")}
    expert_bytes = sum(t.numel() * t.element_size() for n, t in params.items() if ".experts." in n and t.dim() == 3)
    total, active = bench.engine_weight_bytes(llm, top_k, experts)
    assert expert_bytes > 0 and total - active == expert_bytes * (experts - top_k) // experts
    assert total <= sum(t.numel() * t.element_size() for t in params.values())  # tied weights once
    total_fp8, active_fp8 = bench.engine_weight_bytes(
        LLM(str(src), compile="eager", progress=False, quantization="fp8"), top_k, experts)
    assert total_fp8 < total and active_fp8 < active  # e4m3 projections
