"""FP8 (issue 16): the ops, the `quantize_fp8` pass, FP8 checkpoints, the FP8 KV cache, the
cache key, and how close the quantized engine stays to the unquantized one.

The Triton kernels (per-token quantization, the FP8 KV cache in the attention kernels) are
tested against their references in test_kernels_triton.py (interpreter on CPU) and at real
shapes in test_gpu_kernels.py.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from tiny_models import tiny_config

from kiln.compiler.pass_testing import graph_for_pass, run_graph
from kiln.kernels.fp8 import (FP8_DTYPE, FP8_MAX, fp8_linear, linear_fp8_dequantized, quantize_fp8_per_token,
                              quantize_fp8_rows, quantize_fp8_rowwise)
from kiln.passes import op_counts
from kiln.passes.quantize_fp8 import QuantizeFP8Pass
from kiln.passes.weight_transforms import (ConcatWeights, QuantizeFP8Weight, WeightTransformError,
                                           apply_weight_transforms, fp8_scale_name, fp8_weight_names,
                                           load_time_quantizer, transforms_from_json, transforms_to_json)
from kiln.runtime import LLM, SamplingParams

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"


# ---- ops ---------------------------------------------------------------------------------------

def test_quantize_rows_keeps_e4m3_precision():
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 16)[:, None]
    xq, scale = quantize_fp8_rows(x)
    assert xq.dtype == FP8_DTYPE and scale.shape == (16, 1)
    assert torch.equal(xq.float().abs().amax(-1), torch.full((16,), FP8_MAX))  # each row uses the whole range
    back = xq.float() * scale
    normal = x.abs() > scale * 2.0 ** -6  # e4m3's normal range: relative error <= half a step (2^-4)
    assert ((back - x).abs() <= x.abs() * 2.0 ** -4 + 1e-12)[normal].all()
    zq, zscale = quantize_fp8_rows(torch.zeros(2, 8))
    assert (zscale > 0).all() and not zq.float().any()  # a zero row: no division by zero


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_the_dequantized_product(out_dtype):
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(2, 5, 64, generator=g), torch.randn(48, 64, generator=g) * 0.1, torch.randn(48, generator=g)
    wq, ws = quantize_fp8_rowwise(w)
    xq, xs = quantize_fp8_per_token(x)
    y = fp8_linear(xq, xs, wq, ws, b, out_dtype)
    assert y.shape == (2, 5, 48) and y.dtype == out_dtype
    exact = linear_fp8_dequantized(xq.float() * xs, wq, ws, b)  # torch._scaled_mm computes exactly this
    torch.testing.assert_close(y.float(), exact, atol=1e-4 if out_dtype == torch.float32 else 0.05, rtol=1e-2)
    full = torch.nn.functional.linear(x, w, b)
    assert (y.float() - full).abs().max() < 0.1 * full.abs().max()  # and FP8 stays near full precision


def test_fp8_linear_refuses_bad_input():
    wq, ws = quantize_fp8_rowwise(torch.randn(8, 16))
    xq, xs = quantize_fp8_per_token(torch.randn(3, 16))
    with pytest.raises(ValueError, match="xq and weight must be"):
        fp8_linear(xq.float(), xs, wq, ws, None, torch.float32)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        fp8_linear(xq, xs, wq, ws[:4], None, torch.float32)
    with pytest.raises(ValueError, match="does not match x"):
        fp8_linear(xq[:, :8], xs, wq, ws, None, torch.float32)


# ---- the pass ----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("qwen2", torch.bfloat16), ("mixtral", torch.float32)])
def test_quantize_fp8_pass(arch, dtype):
    config = tiny_config(arch)
    before = graph_for_pass(config, "quantize_fp8", dtype=dtype)
    after = before.copy()
    stats = after.run_pass(QuantizeFP8Pass())
    layers = config.num_hidden_layers
    # Merged QKV, O, merged gate/up and down per layer (Mixtral's experts are kiln::fused_moe
    # on CUDA, batched matmuls here: not projections of this form; its routers stay too).
    per_layer = 2 if arch == "mixtral" else 4
    # (On CPU the norms and activations are ATen ops: nothing to fuse the quantization into.)
    assert stats == {"fp8_linear": per_layer * layers, "kept_high_precision": 1 + (layers if arch == "mixtral" else 0),
                     "rms_norm_quant_fused": 0, "silu_and_mul_quant_fused": 0}
    counts = op_counts(after.graph_module)
    assert counts["kiln.fp8_linear.default"] == per_layer * layers
    assert counts["kiln.quantize_fp8_per_token.default"] == per_layer * layers  # one per distinct input
    assert counts["aten.linear.default"] == stats["kept_high_precision"]  # the LM head (and routers)
    quantized = [t.weight for t in after.context.weight_transforms if isinstance(t, QuantizeFP8Weight)]
    assert len(quantized) == per_layer * layers and not any("lm_head" in n or "embed" in n for n in quantized)
    roles = [n.meta["kiln_input"] for n in after.graph_module.graph.find_nodes(op="placeholder")]
    assert all(f"param:{fp8_scale_name(n)}" in roles for n in quantized)
    out, ref = run_graph(after), run_graph(before)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert (out.float() - ref.float()).abs().max() < 0.05 * ref.float().abs().max()
    assert not torch.equal(out, ref)  # it did quantize


def test_quantize_fp8_keeps_the_first_and_last_layers():
    # Meta's FP8 recipe: the first and last decoder layers stay in the compute dtype (the
    # most sensitive on SmolLM2; a model of fewer than 4 layers, above, quantizes them all).
    from kiln.passes.quantize_fp8 import in_edge_layer

    config = tiny_config("llama")
    config.num_hidden_layers = 5
    before = graph_for_pass(config, "quantize_fp8")  # captured once: each pass below runs on a copy
    after = before.copy()
    stats = after.run_pass(QuantizeFP8Pass())
    assert stats["fp8_linear"] == 4 * 3 and stats["kept_high_precision"] == 4 * 2 + 1
    quantized = {t.weight for t in after.context.weight_transforms if isinstance(t, QuantizeFP8Weight)}
    assert {int(n.split(".")[2]) for n in quantized} == {1, 2, 3}
    assert in_edge_layer("model.layers.29.mlp.down_proj.weight", 30) and not in_edge_layer("model.layers.1.x.weight", 30)
    assert not in_edge_layer("model.layers.0.mlp.down_proj.weight", 2)
    plain = before.copy().run_pass(QuantizeFP8Pass(keep_edge_layers=False))
    assert plain["fp8_linear"] == 4 * 5
    assert QuantizeFP8Pass().uuid() != QuantizeFP8Pass(keep_edge_layers=False).uuid()
    assert before.copy().run_pass(QuantizeFP8Pass(keep_edge_layers=True)) == stats


def test_quantize_fp8_quantizes_every_layer_of_a_large_model(monkeypatch):
    # The default keeps the edge layers only in models of fewer than EDGE_LAYERS_MAX_PARAMS
    # parameters (as vLLM's online FP8, a larger model quantizes every decoder layer). The tiny
    # model's count: a bound at it makes it "large". A tensor-parallel rank counts its share x
    # tp_size.
    import kiln.passes.quantize_fp8 as quantize_fp8

    config = tiny_config("llama")
    config.num_hidden_layers = 5
    before = graph_for_pass(config, "quantize_fp8")
    params = quantize_fp8.model_parameters(before.graph_module)
    hf_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert params == hf_params < quantize_fp8.EDGE_LAYERS_MAX_PARAMS
    monkeypatch.setattr(quantize_fp8, "EDGE_LAYERS_MAX_PARAMS", params)
    assert before.copy().run_pass(QuantizeFP8Pass())["fp8_linear"] == 4 * 5
    assert before.copy().run_pass(QuantizeFP8Pass(keep_edge_layers=True))["fp8_linear"] == 4 * 3
    monkeypatch.setattr(quantize_fp8, "EDGE_LAYERS_MAX_PARAMS", params + 1)
    assert before.copy().run_pass(QuantizeFP8Pass())["fp8_linear"] == 4 * 3
    before.context.tp_size = 2
    assert before.copy().run_pass(QuantizeFP8Pass())["fp8_linear"] == 4 * 5


def test_quantize_fp8_keeps_what_the_checkpoint_left_unquantized():
    # A pre-quantized checkpoint's own list of unquantized modules wins over the size rule:
    # compressed-tensors' `ignore` (names, "re:" regexes) and transformers' FP8
    # `modules_to_not_convert` (substrings); a merged QKV / gate-up stays if a part is listed.
    config = tiny_config("llama")
    config.num_hidden_layers = 5
    before = graph_for_pass(config, "quantize_fp8")

    def quantized_layers(quantization_config):
        graph = before.copy()
        graph.context.config = copy.copy(graph.context.config)
        graph.context.config.quantization_config = quantization_config
        graph.run_pass(QuantizeFP8Pass(keep_edge_layers=False))
        return sorted((int(t.weight.split(".")[2]), t.weight.split(".")[-2])
                      for t in graph.context.weight_transforms if isinstance(t, QuantizeFP8Weight))

    every = quantized_layers(None)
    assert len(every) == 4 * 5
    ignore = {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:model\\.layers\\.2\\..*",
                                                               "model.layers.4.self_attn.k_proj"]}
    assert quantized_layers(ignore) == [e for e in every if e[0] != 2 and e != (4, "qkv_proj")]
    hf_fp8 = {"quant_method": "fp8", "modules_to_not_convert": ["lm_head", "layers.3.mlp"]}
    assert quantized_layers(hf_fp8) == [e for e in every if not (e[0] == 3 and e[1] in ("gate_up_proj", "down_proj"))]


def test_quantize_fp8_is_opt_in_and_enters_the_cache_key():
    from kiln.compiler.startup import CompileOptions, setup_for_engine

    config = tiny_config("llama")
    setup = lambda **o: setup_for_engine(CompileOptions(**o), config, torch.float32, torch.device("cpu"))  # noqa: E731
    plain, fp8, fp8_kv = setup(), setup(quantization="fp8"), setup(kv_cache_dtype=FP8_DTYPE)
    assert "quantize_fp8" not in plain.pass_manager.uuids() and "quantize_fp8" in fp8.pass_manager.uuids()
    assert plain.model_factors().keys() == setup(kv_cache_dtype=torch.float32).model_factors().keys()
    assert fp8.model_factors()["quantization"] == "fp8" and "quantization" not in plain.model_factors()
    assert fp8_kv.model_factors()["kv_cache_dtype"] == "float8_e4m3fn"
    keys = {plain.model_key(), fp8.model_key(), fp8_kv.model_key()}
    assert len(keys) == 3 and plain.model_key() == setup().model_key()


# ---- weight transforms for FP8 checkpoints ------------------------------------------------------

def test_fp8_checkpoint_parts_concatenate_with_their_scales():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(8, 16, generator=g), torch.randn(4, 16, generator=g)
    qq, qs = quantize_fp8_rowwise(q)                      # per channel: [8]
    kq = (k / 0.01).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # per tensor: one scale
    weights = {"q": qq, "q_scale": qs.view(8, 1), "k": kq, "k_scale": torch.tensor([0.01])}
    transforms = [ConcatWeights("qk", ("q", "k")), QuantizeFP8Weight("qk")]
    assert fp8_weight_names(transforms) == {"qk", "q", "k"}
    assert transforms_from_json(json.loads(json.dumps(transforms_to_json(transforms)))) == transforms
    out = apply_weight_transforms(weights, transforms)
    assert set(out) == {"qk", "qk_scale"}
    assert out["qk"].dtype == FP8_DTYPE and torch.equal(out["qk"].view(torch.uint8),
                                                       torch.cat([qq, kq]).view(torch.uint8))  # values as they were
    torch.testing.assert_close(out["qk_scale"], torch.cat([qs, torch.full((4,), 0.01)]))
    with pytest.raises(WeightTransformError, match="has no scale"):
        apply_weight_transforms({"w": qq}, [QuantizeFP8Weight("w")])


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)) if x.dtype == FP8_DTYPE else torch.equal(x, y), name


def test_quantizing_as_weights_load_gives_what_quantizing_after_gives():
    """load_time_quantizer: each weight (each part of a merged one, each stacked expert tensor)
    quantized as it loads, then the transforms, equal the transforms over the 16-bit weights:
    per output channel scales make a merge's parts quantize as the merge does."""
    g = torch.Generator().manual_seed(3)
    loaded = {"q": torch.randn(8, 16, generator=g), "k": torch.randn(4, 16, generator=g),
              "v": torch.randn(4, 16, generator=g) * 3, "o": torch.randn(16, 8, generator=g),
              "experts": torch.randn(3, 10, 16, generator=g), "up_a": torch.randn(4, 6, generator=g),
              "up_b": torch.randn(4, 2, generator=g), "norm": torch.randn(16, generator=g)}
    transforms = [ConcatWeights("qkv", ("q", "k", "v")), ConcatWeights("up", ("up_a", "up_b"), dim=1),
                  QuantizeFP8Weight("qkv"), QuantizeFP8Weight("o"), QuantizeFP8Weight("experts"),
                  QuantizeFP8Weight("up")]
    hook = load_time_quantizer(transforms)
    streamed: dict[str, torch.Tensor] = {}
    for name, tensor in loaded.items():
        streamed.update(hook(name, tensor))
    # Quantized as they loaded: every part of qkv, o and the experts; not the parts of a merge
    # along the input dim (FP8 parts concatenate along the output channels only), not the norm.
    assert {n for n, t in streamed.items() if t.dtype == FP8_DTYPE} == {"q", "k", "v", "o", "experts"}
    assert streamed[fp8_scale_name("experts")].shape == (3, 10)
    _same_weights(apply_weight_transforms(streamed, transforms), apply_weight_transforms(dict(loaded), transforms))
    assert load_time_quantizer([ConcatWeights("qkv", ("q", "k", "v"))]) is None  # nothing to quantize


def test_a_quantized_model_loads_its_weights_quantized(tiny_model_dir):
    """The engine's loader quantizes while it loads (the dummy and safetensors loaders both
    hand each tensor to the hook): the weights the graph gets are those of quantizing after."""
    from kiln.compiler.model_source import resolve_model

    src, _ = tiny_model_dir("llama")
    llm = LLM(str(src), compile="eager", progress=False, quantization="fp8")
    spec = llm.engine.graph_spec
    for load_format in ("auto", "dummy"):
        source = resolve_model(str(src), load_format=load_format)
        hook = load_time_quantizer(spec.weight_transforms)
        streamed = source.load_weights(spec.param_aliases, torch.float32, "cpu", progress=False, on_tensor=hook)
        assert sum(t.dtype == FP8_DTYPE for t in streamed.values()) >= 8  # before any transform ran
        after = source.load_weights(spec.param_aliases, torch.float32, "cpu", progress=False)
        _same_weights(apply_weight_transforms(streamed, spec.weight_transforms),
                      apply_weight_transforms(after, spec.weight_transforms))


def test_the_loaders_keep_no_16_bit_weight_once_quantized(tiny_model_dir):
    """What lets a model whose 16-bit weights do not fit load as FP8: when the loader hands the
    hook its next tensor, no 16-bit weight the hook quantized before is still alive."""
    import weakref

    from kiln.compiler.model_source import resolve_model

    src, _ = tiny_model_dir("llama")
    llm = LLM(str(src), compile="eager", progress=False, quantization="fp8")
    spec = llm.engine.graph_spec
    quantize = load_time_quantizer(spec.weight_transforms)
    for load_format in ("auto", "dummy"):
        handed: list[weakref.ref] = []

        def hook(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
            alive = [r() for r in handed if r() is not None]
            assert not alive, f"{len(alive)} quantized 16-bit weights still alive when {name} arrives"
            kept = quantize(name, tensor)
            if kept[name] is not tensor:
                handed.append(weakref.ref(tensor))
            return kept

        weights = resolve_model(str(src), load_format=load_format).load_weights(
            spec.param_aliases, torch.float32, "cpu", progress=False, on_tensor=hook)
        assert len(handed) >= 8 and sum(t.dtype == FP8_DTYPE for t in weights.values()) == len(handed)


# ---- pre-quantized checkpoints, laid out as on the Hub --------------------------------------------

def _quantized_linear(name: str) -> bool:
    return name.endswith("_proj.weight") and ".layers." in name


def save_fp8_checkpoint(src: Path, dst: Path, form: str) -> None:
    """`src` (a save_pretrained directory) rewritten as an FP8 checkpoint of `form`:
    "ct-channel" / "ct-tensor" (compressed-tensors, llm-compressor's FP8_DYNAMIC / FP8
    schemes: `weight_scale` [N, 1] or [1], FP8 also a static `input_scale`), or "hf-block"
    (transformers' FineGrainedFP8: `weight_scale_inv` per 32 x 32 block)."""
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, w in tensors.items():
        if not _quantized_linear(name):
            out[name] = w
            continue
        if form == "ct-channel":
            wq, scale = quantize_fp8_rowwise(w)
            out[name], out[name + "_scale"] = wq, scale.view(-1, 1)
        elif form == "ct-tensor":
            scale = w.abs().amax().float() / FP8_MAX
            out[name], out[name + "_scale"] = (w / scale).to(FP8_DTYPE), scale.view(1)
            out[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.05])  # static: not used
        else:
            n, k = w.shape
            blocks = w.float().reshape(n // 32, 32, k // 32, 32)
            scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [n/32, k/32]
            out[name] = (blocks / scale[:, None, :, None]).reshape(n, k).to(FP8_DTYPE)
            out[name + "_scale_inv"] = scale
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    if form == "hf-block":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                         "weight_block_size": [32, 32]}
    else:
        strategy = "channel" if form == "ct-channel" else "tensor"
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token" if strategy == "channel"
                                      else "tensor", "dynamic": strategy == "channel", "symmetric": True}}}}
    (dst / "config.json").write_text(json.dumps(config))


GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [1, 5, 9, 20, 33, 7]}, {"prompt_token_ids": list(range(3, 30))},
           {"prompt_token_ids": [4, 4, 8, 15, 16, 23, 42]}]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


_ENGINE_TOKENS: dict[tuple, list[list[int]]] = {}


def engine_tokens(path: Path, **options) -> list[list[int]]:
    """`_tokens(LLM(path, compile="eager", progress=False, **options))`, from a fresh engine,
    once per module: several tests compare with the same engine's greedy tokens (the tiny
    Llama unquantized, or quantized at load), a deterministic computation that costs an
    engine start each time. A copy: a test cannot change what the next one gets."""
    key = (str(path), tuple(sorted(options.items())))
    if key not in _ENGINE_TOKENS:
        _ENGINE_TOKENS[key] = _tokens(LLM(str(path), compile="eager", progress=False, **options))
    return [list(t) for t in _ENGINE_TOKENS[key]]


def teacher_forced_agreement(llm: LLM, reference: list[list[int]]) -> float:
    """Of the tokens the reference engine picked greedily, the share `llm` ranks first given
    the same prefix (one prompt-logprobs pass per sequence; a free-running comparison would
    count everything after the first near-tie as a miss)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"] + r} for p, r in zip(PROMPTS, reference)], params)
    hits = total = 0
    for prompt, ref, out in zip(PROMPTS, reference, outs):
        start = len(prompt["prompt_token_ids"])
        for pos, token in enumerate(ref, start=start):
            top = next(t for t, lp in out.prompt_logprobs[pos].items() if lp.rank == 1)
            hits += top == token
            total += 1
    return hits / total


@pytest.mark.parametrize("form", ["ct-channel", "ct-tensor", "hf-block"])
def test_prequantized_checkpoint_loads_as_it_is(tiny_model_dir, tmp_path, form):
    src, _ = tiny_model_dir("llama")
    dst = tmp_path / form
    save_fp8_checkpoint(src, dst, form)
    llm = LLM(str(dst), compile="eager", progress=False)  # quantization="fp8" implied by the checkpoint
    assert llm.engine.quantization == "fp8"
    stats = {r["name"]: r["stats"] for r in llm.engine.graph_spec.pass_records}
    assert stats["quantize_fp8"]["fp8_linear"] == 8
    # What the loader hands the graph: the checkpoint's e4m3 values, untouched (block-wise
    # scales are requantized per channel), and one scale per output channel.
    from kiln.compiler.model_source import resolve_model

    spec = llm.engine.graph_spec
    weights = resolve_model(str(dst)).load_weights(spec.param_aliases, torch.float32, "cpu", progress=False,
                                                     keep_fp8=fp8_weight_names(spec.weight_transforms))
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    checkpoint = load_file(str(dst / "model.safetensors"))
    if form.startswith("ct"):
        assert weights[o_proj].dtype == FP8_DTYPE
        assert torch.equal(weights[o_proj].view(torch.uint8), checkpoint[o_proj].view(torch.uint8))
        assert weights[fp8_scale_name(o_proj)].shape == ((64,) if form == "ct-channel" else (1,))
    else:
        assert weights[o_proj].dtype == torch.float32  # dequantized: requantized per channel by the transform
    tokens = _tokens(llm)
    reference = engine_tokens(src, quantization="fp8")
    if form == "ct-channel":
        # The same per-channel quantization as quantize-at-load: the same numbers exactly.
        assert tokens == reference
    else:
        rate = teacher_forced_agreement(llm, engine_tokens(src))
        print(f"{form}: teacher-forced greedy agreement with the unquantized model {rate:.1%}")
        assert rate >= 0.7


def _rank_weights(path: Path, tp_size: int, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """What the loader hands rank `rank` of `tp_size` for the checkpoint at `path` (before the
    merges and quantization: the checkpoint's tensors, this rank's slices), and the cuts."""
    import dataclasses

    from kiln.compiler.model_source import resolve_model
    from kiln.compiler.startup import prepare_for_engine
    from kiln.passes.weight_transforms import shard_transforms
    from kiln.runtime.config import EngineConfig

    source = resolve_model(str(path))
    config = EngineConfig(model=str(path), compile="eager", progress=False, tensor_parallel_size=tp_size)
    options = dataclasses.replace(config.compile_options(source.config), tp_rank=rank)
    spec = prepare_for_engine(options, source.config, torch.float32, torch.device("cpu")).spec
    cuts = shard_transforms(spec.weight_transforms)
    weights = source.load_weights(spec.param_aliases, torch.float32, "cpu", progress=False,
                                  keep_fp8=fp8_weight_names(spec.weight_transforms), shards=cuts)
    return weights, cuts


@pytest.mark.parametrize("arch,form", [("llama", "ct-channel"), ("llama", "ct-tensor"), ("llama", "hf-block"),
                                       ("phi3", "ct-channel")])
def test_prequantized_checkpoint_loads_each_ranks_slice(tiny_model_dir, tmp_path, arch, form):
    """Tensor parallelism over an FP8 checkpoint: each rank reads its slice of the e4m3 values
    as they are, and their scales cut with the output channels (a cut across the input keeps
    them whole; a per-tensor scale stays one value); block-wise weights are the cut of the
    dequantized whole; Phi-3's fused qkv_proj and gate_up_proj, a range per part. Exactly what
    cutting the unsharded load gives."""
    src, _ = tiny_model_dir(arch)
    dst = tmp_path / form
    save_fp8_checkpoint(src, dst, form)
    whole, _ = _rank_weights(dst, 1, 0)
    for rank in (0, 1):
        part, cuts = _rank_weights(dst, 2, rank)
        kept_fp8 = 0
        for name, cut in cuts.items():
            want, got = cut.read_shard(whole[name]), part[name]
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8) if got.dtype == FP8_DTYPE else got,
                                                           want.view(torch.uint8) if want.dtype == FP8_DTYPE else want), name
            scale = fp8_scale_name(name)
            if scale in whole:
                kept_fp8 += 1
                per_row = whole[scale].numel() > 1
                assert torch.equal(part[scale], cut.read_shard(whole[scale]) if cut.dim == 0 and per_row else whole[scale])
                assert part[scale].numel() == (got.shape[0] if per_row else 1), name
        # 2 layers x 7 projections (Phi-3: x 4, q/k/v and gate/up fused): e4m3 as stored, or
        # (block-wise) dequantized; o_proj and down_proj cut across the input.
        assert kept_fp8 == (0 if form == "hf-block" else 8 if arch == "phi3" else 14)
        assert sum(cut.dim == 1 for cut in cuts.values()) == 4
        assert (arch == "phi3") == any(len(cut.ranges) > 1 for name, cut in cuts.items()
                                     if fp8_scale_name(name) in whole)


def test_other_quantized_checkpoints_are_refused(tiny_model_dir, tmp_path):
    src, _ = tiny_model_dir("llama")
    dst = tmp_path / "awq"
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
        LLM(str(dst), compile="eager", progress=False)


def test_engine_options_are_checked():
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        LLM(quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        LLM(kv_cache_dtype="fp16")


# ---- the engine against the unquantized one --------------------------------------------------------

AGREEMENT_ARCHS = ("llama", "qwen2", "qwen3", "mixtral", "gemma2", "phi3")


@pytest.mark.parametrize("arch", AGREEMENT_ARCHS)
def test_greedy_agreement_with_the_unquantized_model(tiny_model_dir, arch):
    path, _ = tiny_model_dir(arch)
    reference = engine_tokens(path)
    rates = {}
    for name, options in (("fp8 weights", {"quantization": "fp8"}), ("fp8 KV", {"kv_cache_dtype": "fp8"}),
                          ("fp8 weights + KV", {"quantization": "fp8", "kv_cache_dtype": "fp8"})):
        llm = LLM(str(path), compile="eager", progress=False, **options)
        assert llm.engine.runner.kv_caches[0].dtype == (FP8_DTYPE if "kv_cache_dtype" in options
                                                            else torch.float32)
        rates[name] = teacher_forced_agreement(llm, reference)
    print(f"{arch}: teacher-forced greedy agreement " + ", ".join(f"{k} {v:.1%}" for k, v in rates.items()))
    # Tiny random models have flat logits (128 tokens, near-ties everywhere): most picks
    # still agree; on a real model (below) the rate is higher.
    assert min(rates.values()) >= 0.75, rates


# ---- perplexity of the real default model ---------------------------------------------------------

def passages() -> list[str]:
    """The perplexity text's passages (separated by lines of `=====`): openings of six
    public-domain novels, ~3,600 tokens in all."""
    return [p.strip() for p in TEXT.read_text().split("\n=====\n")]


def perplexity(llm: LLM, texts: list[str]) -> float:
    """exp of the mean negative log-likelihood over every token of `texts` (each a prompt of
    its own, all in one generate call)."""
    tokenizer = llm.get_tokenizer()
    outs = llm.generate([{"prompt_token_ids": tokenizer.encode(t)} for t in texts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0))
    logprobs = [d[t].logprob for out in outs for t, d in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.mark.slow
def test_default_model_perplexity_fp8():
    texts = passages()
    assert len(texts) == 6
    base = perplexity(LLM(compile="eager", progress=False), texts)
    results = {name: perplexity(LLM(compile="eager", progress=False, **options), texts)
               for name, options in (("fp8 weights", {"quantization": "fp8"}),
                                     ("fp8 weights + fp8 KV", {"quantization": "fp8", "kv_cache_dtype": "fp8"}))}
    print(f"SmolLM2-135M perplexity over {TEXT.name}: unquantized {base:.3f}, "
          + ", ".join(f"{k} {v:.3f} ({v / base - 1:+.2%})" for k, v in results.items()))
    for name, ppl in results.items():
        assert ppl > base * 0.99, name  # FP8 does not make the model better: it ran quantized
        assert ppl <= base * PERPLEXITY_LIMITS[name], f"{name}: {ppl:.3f} vs {base:.3f}"


# Issue 16 asks for 3%. Measured on CPU (float32, 2026-12-02, ~3,560 tokens): 30.23 -> 30.76
# (+1.8%) with FP8 weights (first and last decoder layers kept in the compute dtype,
# kiln.passes.quantize_fp8), 30.64 (+1.4%) with FP8 weights + KV (scales calibrated at
# start-up, kiln.runtime.kv_scale_calibration). Passage by passage the figures spread from
# about 0% to +3.1% (weights) and -1.6% to +5.0% (with KV):
# the text was the first passage alone until then (428 tokens), whose figure moved from +1.5%
# to +3.1% between machines with the same code and packages, as rounding to e4m3 turns the
# last bits of float32 sums into different values.
PERPLEXITY_LIMITS = {"fp8 weights": 1.03, "fp8 weights + fp8 KV": 1.03}


def test_quantize_fp8_fuses_into_norms_and_activations():
    # The CUDA pipeline's graph (kiln::rms_norm, kiln::add_rms_norm, kiln::silu_and_mul there):
    # the quantization of a projection's input moves into the op that produces it.
    config = tiny_config("llama")
    before = graph_for_pass(config, "quantize_fp8", cpu_fusions=True)
    assert before.pipeline[-1] == "prune_logits"  # before use_triton_linear, as enabling it places it
    after = before.copy()
    stats = after.run_pass(QuantizeFP8Pass())
    layers = config.num_hidden_layers
    assert stats == {"fp8_linear": 4 * layers, "kept_high_precision": 1,
                     "rms_norm_quant_fused": 2 * layers, "silu_and_mul_quant_fused": layers}
    counts = op_counts(after.graph_module)
    assert counts["kiln.rms_norm_quant_fp8.default"] + counts["kiln.add_rms_norm_quant_fp8.default"] == 2 * layers
    assert counts["kiln.silu_and_mul_quant_fp8.default"] == layers
    assert counts["kiln.quantize_fp8_per_token.default"] == layers  # the attention output, before o_proj
    assert counts["kiln.add_rms_norm.default"] == 1  # the final norm, before the LM head
    # The fused references round as the unfused chain does: the same numbers as the CPU graph.
    unfused = graph_for_pass(config, "quantize_fp8", cpu_fusions=False)
    unfused.run_pass(QuantizeFP8Pass())
    assert torch.equal(run_graph(after), run_graph(unfused))


def test_fp8_fuses_gemmas_norms_and_geglu():
    # Gemma 3's norms (x (1 + weight) in float32: kiln::offset_rms_norm / add_offset_rms_norm on
    # the CUDA pipeline) and its GeGLU (kiln::gelu_tanh_and_mul) take their projection's
    # quantization (quantize_fp8), then the projection itself (fuse_fp8_linear_inputs), as
    # Llama's norms and SiLU-and-mul do; in bfloat16, the numbers of the unfused graph at each step.
    from kiln.passes.fuse_fp8_linear_inputs import FuseFP8LinearInputsPass

    config = tiny_config("gemma3_text")
    layers = config.num_hidden_layers
    before = graph_for_pass(config, "quantize_fp8", cpu_fusions=True, dtype=torch.bfloat16)
    quantized = before.copy()
    stats = quantized.run_pass(QuantizeFP8Pass())
    # Each layer's input norm (-> qkv) and pre-feedforward norm (-> gate/up), and its GeGLU
    # (-> down: kiln::gelu_tanh_and_mul_quant_fp8).
    assert stats["rms_norm_quant_fused"] == 2 * layers and stats["silu_and_mul_quant_fused"] == layers
    counts = op_counts(quantized.graph_module)
    assert (counts["kiln.offset_rms_norm_quant_fp8.default"]
            + counts["kiln.add_offset_rms_norm_quant_fp8.default"]) == 2 * layers
    assert counts["kiln.gelu_tanh_and_mul_quant_fp8.default"] == layers
    unfused = graph_for_pass(config, "quantize_fp8", cpu_fusions=False, dtype=torch.bfloat16)
    unfused.run_pass(QuantizeFP8Pass())
    assert torch.equal(run_graph(quantized), run_graph(unfused))
    linear_inputs = graph_for_pass(config, "fuse_fp8_linear_inputs", enable=["quantize_fp8"], cpu_fusions=True,
                                   dtype=torch.bfloat16)
    fused = linear_inputs.copy()
    stats = fused.run_pass(FuseFP8LinearInputsPass(on_cpu=True))
    assert stats["offset_rms_norm_fp8_linear"] + stats["add_offset_rms_norm_fp8_linear"] == 2 * layers
    assert stats["gelu_tanh_and_mul_fp8_linear"] == layers
    counts = op_counts(fused.graph_module)
    assert not any(counts.get(f"kiln.{op}.default") for op in ("offset_rms_norm_quant_fp8",
                                                               "add_offset_rms_norm_quant_fp8",
                                                               "gelu_tanh_and_mul_quant_fp8"))
    assert torch.equal(run_graph(fused), run_graph(linear_inputs))


def test_fuse_fp8_linear_inputs():
    # After quantize_fp8 on the CUDA pipeline's graph: every projection's quantizing producer
    # and the projection become one op; the CPU references are the chains, so the numbers
    # do not change.
    from kiln.passes.fuse_fp8_linear_inputs import FuseFP8LinearInputsPass

    config = tiny_config("llama")
    before = graph_for_pass(config, "fuse_fp8_linear_inputs", enable=["quantize_fp8"], cpu_fusions=True)
    assert before.pipeline[-1] == "quantize_fp8"
    after = before.copy()
    stats = after.run_pass(FuseFP8LinearInputsPass(on_cpu=True))
    layers = config.num_hidden_layers
    assert stats == {"rms_norm_fp8_linear": 1, "add_rms_norm_fp8_linear": 2 * layers - 1,
                     "offset_rms_norm_fp8_linear": 0, "add_offset_rms_norm_fp8_linear": 0,
                     "silu_and_mul_fp8_linear": layers, "gelu_tanh_and_mul_fp8_linear": 0,
                     "quantize_fp8_linear": layers}
    counts = op_counts(after.graph_module)
    for op in ("fp8_linear", "rms_norm_quant_fp8", "add_rms_norm_quant_fp8", "silu_and_mul_quant_fp8",
               "quantize_fp8_per_token"):
        assert counts.get(f"kiln.{op}.default", 0) == 0, op
    assert counts["kiln.add_rms_norm.default"] == 1  # the final norm, before the LM head (bf16)
    assert torch.equal(run_graph(after), run_graph(before))
    # Off the CPU by default, as the other fusions.
    assert FuseFP8LinearInputsPass(on_cpu=False)(before.copy().graph_module, None) == {"skipped_on_cpu": 1}
    # A tensor-parallel rank's graph: the same pairs (o and down before their all-reduce).
    rank = graph_for_pass(config, "fuse_fp8_linear_inputs", enable=["quantize_fp8"], cpu_fusions=True,
                          tp_size=2, tp_rank=1)
    assert rank.copy().run_pass(FuseFP8LinearInputsPass(on_cpu=True)) == stats


def test_fuse_fp8_linear_inputs_keeps_a_shared_quantized_input():
    # Unmerged q/k/v share one quantized input: fusing would normalise it three times.
    from kiln.passes.fuse_fp8_linear_inputs import FuseFP8LinearInputsPass

    config = tiny_config("llama")
    before = graph_for_pass(config, "fuse_fp8_linear_inputs", enable=["quantize_fp8"], disable=["merge_qkv"],
                            cpu_fusions=True)
    after = before.copy()
    stats = after.run_pass(FuseFP8LinearInputsPass(on_cpu=True))
    layers = config.num_hidden_layers
    assert stats["rms_norm_fp8_linear"] + stats["add_rms_norm_fp8_linear"] == layers  # gate/up only
    assert op_counts(after.graph_module)["kiln.fp8_linear.default"] == 3 * layers  # q, k, v
    assert torch.equal(run_graph(after), run_graph(before))


def test_quantization_pipeline_order_when_enabled():
    from kiln.passes.manager import enabled_pass_names

    names = enabled_pass_names(enable=["quantize_fp8"])
    assert names.index("prune_logits") < names.index("quantize_fp8") < names.index("use_triton_linear")
    assert "quantize_fp8" not in enabled_pass_names()


def test_kiln_compile_of_an_fp8_checkpoint_gives_a_warm_start(tiny_model_dir, tmp_path):
    # `kiln compile` reads the checkpoint's config: its implied quantization="fp8" and an
    # explicit --kv-cache-dtype fp8 enter the keys it fills, and the engine's keys match them.
    from kiln.runtime.cli import main

    src, _ = tiny_model_dir("llama")
    dst, cache = tmp_path / "ct", str(tmp_path / "cache")
    save_fp8_checkpoint(src, dst, "ct-channel")
    options = ["--compile", "graph", "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
    assert main(["compile", str(dst), "--cache-dir", cache, "--kv-cache-dtype", "fp8", *options]) == 0
    llm = LLM(str(dst), cache_dir=cache, compile="graph", require_cache=True, kv_cache_dtype="fp8", progress=False,
              max_num_seqs=2, max_num_batched_tokens=32)
    assert not llm.engine.startup_report.captured
    assert llm.engine.runner.kv_caches[0].dtype == FP8_DTYPE
    with pytest.raises(Exception, match="kv_cache_dtype"):  # the miss names the factor
        LLM(str(dst), cache_dir=cache, compile="graph", require_cache=True, progress=False, max_num_seqs=2,
            max_num_batched_tokens=32)


# ---- FP8 KV cache scales ----------------------------------------------------------------------

def test_kv_cache_scales_from_the_checkpoint(tiny_model_dir, tmp_path):
    # v_proj scaled up 1000x (o_proj down as much: the same model) makes V overflow e4m3 at
    # scale 1; the checkpoint's per-layer v_scale / k_scale (as llm-compressor writes them)
    # bring it back into range, and the engine stays with the unquantized model.
    src, _ = tiny_model_dir("llama")
    tensors = load_file(str(src / "model.safetensors"))
    for name in list(tensors):
        if name.endswith("v_proj.weight"):
            tensors[name] = tensors[name] * 1000
        elif name.endswith("o_proj.weight"):
            tensors[name] = tensors[name] / 1000
    plain, scaled = tmp_path / "plain", tmp_path / "scaled"
    for dst in (plain, scaled):
        shutil.copytree(src, dst)
        save_file(tensors, str(dst / "model.safetensors"))
    layers = tiny_config("llama").num_hidden_layers
    with_scales = dict(tensors)
    for i in range(layers):
        with_scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01)
        with_scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(8.0)
    save_file(with_scales, str(scaled / "model.safetensors"))

    reference = _tokens(LLM(str(plain), compile="eager", progress=False))
    llm = LLM(str(scaled), compile="eager", progress=False, kv_cache_dtype="fp8")
    stats = {r["name"]: r["stats"] for r in llm.engine.graph_spec.pass_records}
    assert stats["kv_cache_scales"] == {"kv_scales_added": layers}
    fed = llm.engine.runner.param_input("model.layers.0.self_attn.kv_cache_scales")
    torch.testing.assert_close(fed, torch.tensor([0.01, 8.0]))  # the checkpoint's, as the graph gets them
    scaled_rate = teacher_forced_agreement(llm, reference)
    unit_rate = teacher_forced_agreement(LLM(str(plain), compile="eager", progress=False, kv_cache_dtype="fp8",
                                             calculate_kv_scales=False), reference)
    # Without checkpoint scales the engine calibrates its own (amax / 448): they fix it too.
    calibrated_rate = teacher_forced_agreement(LLM(str(plain), compile="eager", progress=False,
                                                   kv_cache_dtype="fp8"), reference)
    print(f"teacher-forced agreement: checkpoint scales {scaled_rate:.1%}, calibrated {calibrated_rate:.1%}, "
          f"scale 1 (V saturates) {unit_rate:.1%}")
    assert scaled_rate >= 0.9 and calibrated_rate >= 0.9
    assert unit_rate < scaled_rate  # at scale 1 the V values saturate at 448: the scale is what fixes it


def test_kv_cache_scales_transform():
    from kiln.passes.weight_transforms import KVCacheScales

    a = "model.layers.0.self_attn"
    t = KVCacheScales(f"{a}.kv_cache_scales", a)
    assert transforms_from_json(json.loads(json.dumps(transforms_to_json([t])))) == [t]
    w = {f"{a}.kv_scale": torch.tensor([0.5])}  # the older single scale serves both
    t.apply(w)
    assert torch.equal(w.pop(f"{a}.kv_cache_scales"), torch.tensor([0.5, 0.5])) and not w
    w = {f"{a}.k_proj.output_scale": torch.tensor(2.0)}
    t.apply(w)
    assert torch.equal(w[f"{a}.kv_cache_scales"], torch.tensor([2.0, 1.0]))  # no v scale: 1
    with pytest.raises(WeightTransformError, match="one positive finite value"):
        t.apply({f"{a}.v_scale": torch.tensor(-1.0)})


# ---- KV-scale calibration at start-up (kiln.runtime.kv_scale_calibration) ----------------------------

def _fed_kv_scales(llm: LLM) -> dict[str, torch.Tensor]:
    """The scales the graph gets, by parameter name, as the runner feeds them."""
    from kiln.runtime.kv_scale_calibration import kv_scale_inputs

    runner = llm.engine.runner
    return {name: runner.param_input(name).clone() for _, name in kv_scale_inputs(runner.input_roles)}


def test_kv_scales_are_calibrated_when_the_checkpoint_has_none(tiny_model_dir):
    from kiln.runtime.kv_scale_calibration import CALIBRATION_TOKENS, calibration_ids

    path, hf = tiny_model_dir("llama")
    layers = tiny_config("llama").num_hidden_layers
    llm = LLM(str(path), compile="eager", progress=False, kv_cache_dtype="fp8")
    fed = _fed_kv_scales(llm)
    assert len(fed) == layers and fed.keys() == llm.engine.kv_scales.keys()
    for name, scales in fed.items():
        torch.testing.assert_close(scales, llm.engine.kv_scales[name])
        assert (scales != 1.0).all() and (scales > 0).all()
    # Layer 0's V is v_proj of the normed embeddings (no FP8 layer before it): the calibrated
    # v_scale is exactly amax(|V|) / 448 of the calibration ids, as the HF model computes V.
    ids = calibration_ids(int(hf.config.vocab_size), CALIBRATION_TOKENS)
    seen = []
    hook = hf.model.layers[0].self_attn.v_proj.register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    hook.remove()
    expected = seen[0].abs().amax().float() / FP8_MAX
    torch.testing.assert_close(fed["model.layers.0.self_attn.kv_cache_scales"][1], expected, rtol=1e-4, atol=0)
    # Turned off: the uncalibrated default, 1.0.
    off = LLM(str(path), compile="eager", progress=False, kv_cache_dtype="fp8", calculate_kv_scales=False)
    assert off.engine.kv_scales == {} and all(torch.equal(s, torch.ones(2)) for s in _fed_kv_scales(off).values())
    # Calibrated scales stay at least as close to the unquantized model as scale 1.
    reference = engine_tokens(path)
    assert teacher_forced_agreement(llm, reference) >= 0.75


def test_checkpoint_kv_scales_win_over_calibration(tiny_model_dir, tmp_path):
    src, _ = tiny_model_dir("llama")
    dst = tmp_path / "with-scales"
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for i in range(tiny_config("llama").num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.5)
    save_file(tensors, str(dst / "model.safetensors"))
    llm = LLM(str(dst), compile="eager", progress=False, kv_cache_dtype="fp8")  # calculate_kv_scales on
    assert llm.engine.kv_scales == {}
    assert all(torch.equal(s, torch.tensor([0.25, 0.5])) for s in _fed_kv_scales(llm).values())


def test_kv_scale_calibration_with_compiled_artifacts(tiny_model_dir, tmp_path):
    # The scales are inputs of the compiled artifacts: calibration sets them in place and the
    # artifacts read them (one calibration step of 32 tokens, the step budget, in both modes).
    path, _ = tiny_model_dir("llama")
    limits = {"max_num_seqs": 2, "max_num_batched_tokens": 32}
    eager = LLM(str(path), compile="eager", progress=False, kv_cache_dtype="fp8", **limits)
    compiled = LLM(str(path), compile="graph", cache_dir=str(tmp_path / "cache"), progress=False,
                   kv_cache_dtype="fp8", **limits)
    assert compiled.engine.kv_scales.keys() == eager.engine.kv_scales.keys() != set()
    for name, scales in _fed_kv_scales(compiled).items():
        torch.testing.assert_close(scales, eager.engine.kv_scales[name], rtol=1e-3, atol=0)
    assert _tokens(compiled) == _tokens(eager)


def test_kv_scale_helpers():
    from kiln.kernels.paged_attention import recording_kv_amax, write_kv_cache
    from kiln.runtime.kv_scale_calibration import MIN_KV_SCALE, calibration_ids, scales_from_amax

    assert calibration_ids(100, 8) == calibration_ids(100, 8) and max(calibration_ids(100, 64)) < 100
    torch.testing.assert_close(scales_from_amax(torch.tensor([448.0, 0.0])), torch.tensor([1.0, MIN_KV_SCALE]))
    with pytest.raises(ValueError, match="at least one token"):
        calibration_ids(100, 0)
    cache = torch.zeros(2, 3, 4, 1, 2, dtype=FP8_DTYPE)
    k, v = torch.tensor([[[9.0, 1.0]], [[2.0, -3.0]]]), torch.tensor([[[0.5, 0.0]], [[0.0, -0.25]]])
    scale = torch.ones(2)
    with recording_kv_amax() as seen:
        write_kv_cache(k, v, cache, torch.tensor([0, 5]), scale)  # slot 0: the null block's padding, left out
    torch.testing.assert_close(seen[scale.data_ptr()], torch.tensor([3.0, 0.25]))
    write_kv_cache(k, v, cache, torch.tensor([4, 5]), scale)  # no recording active: nothing kept
    assert seen[scale.data_ptr()].tolist() == [3.0, 0.25]
