"""Mixture-of-experts serving: decode tokens/s at batch 1 and 64, and offline throughput.

Shapes (dummy bfloat16 weights, `load_format="dummy"`):
  mixtral-8x7b       hidden 4,096, intermediate 14,336, 32 layers, 8 experts, top-2 (~93 GB):
                     decode batch 1 and 64, and the 1,000-request offline workload of
                     bench/throughput.py (prompts of 128-1,024 tokens, 256 output tokens each)
  qwen3-moe-30b-a3b  hidden 2,048, expert intermediate 768, 48 layers, 128 experts, top-8
                     (~61 GB): decode batch 1 and 64
For each shape the Hugging Face transformers baseline (eager, sdpa, transformers' default
experts implementation, the same shape, dtype and requests) runs first in the same process
and is freed before Kiln starts, as in bench/latency.py: the two ~93 GB models do not fit on
one GPU together. Decode is timed as bench/latency.py times it (after every prefill is done);
the offline workload as bench/throughput.py does (the baseline on a whole number of static
batches of 64, `--hf-requests`).

Besides the total weight bytes, each decode figure reports the *active* weight bytes: a token
reads the attention, norms, router and LM head, and only top_k of each layer's experts, so
batch-1 decode is bound by active bytes / bandwidth; at batch 64 nearly every expert is read
once per step.

`--tiny` runs the same benchmark on CPU with tiny configs of the two architectures (seconds,
to check the script; the fused-MoE pass is enabled on CPU there, `KILN_CPU_FUSIONS=1`).

    python bench/moe.py --shape mixtral-8x7b --out moe_mixtral.json          # on the H200
    python bench/moe.py --shape qwen3-moe-30b-a3b --out moe_qwen3.json
    (--no-offline / --no-decode split the Mixtral run in two, e.g. under a per-command limit;
    --offline runs the offline workload for a shape that skips it by default, e.g. Qwen3-MoE's)
    python bench/moe.py --tiny                                               # CPU check

`--kv-cache-dtype fp8` runs Kiln with the FP8 KV cache (not the default): beside ~93 GB of
Mixtral weights the KV cache bounds the offline run's batch (~330 sequences in bf16, P2), and
e4m3 holds twice the tokens. The baseline is unchanged (bf16 KV).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import bench_common as bc
from latency import hf_decode, kiln_decode
from throughput import HF_BATCH, hf_throughput, kiln_throughput, workload


@dataclass(frozen=True)
class MoEShape:
    name: str
    config: str            # a config .json under bench/ (real shape) or a dict (tiny)
    offline: bool          # run the offline workload too


SHAPES = {
    "mixtral-8x7b": MoEShape("mixtral-8x7b", "mixtral_8x7b.json", offline=True),
    "qwen3-moe-30b-a3b": MoEShape("qwen3-moe-30b-a3b", "qwen3_moe_30b_a3b.json", offline=False),
    # Multi-head latent attention (cached expanded, V padded to K's 192) and kiln::moe_experts
    # behind a router fused_moe does not take (softmax top-6, then scaled); ~31 GB in bf16.
    "deepseek-v2-lite": MoEShape("deepseek-v2-lite", "deepseek_v2_lite.json", offline=False),
    # GPT-OSS-20B (openai/gpt-oss-20b's config without its MXFP4 quantization_config: dummy
    # bf16 weights, ~41 GB): attention sinks, 64 query heads of 64 over 8 KV heads, windowed
    # (128) and global layers, 32 biased experts top-4 with the clamped SwiGLU.
    "gpt-oss-20b": MoEShape("gpt-oss-20b", "gpt_oss_20b.json", offline=False),
    # Llama 4 Scout's language model (107.8 B parameters: 16 experts top-1 and a shared expert in
    # all 48 layers, chunked attention with NoPE every 4th layer): 216 GB in bf16, so on one
    # H200 only with --quantization fp8 (the experts too, by default; ~108 GB), and
    # without the Hugging Face baseline, which would need the bf16 weights on the device.
    "llama4-scout": MoEShape("llama4-scout", "llama4_scout.json", offline=False),
    # Qwen3-Next-80B-A3B: 36 gated DeltaNet layers (per-sequence recurrent states, ~74 MiB a
    # sequence) and 12 gated attention layers, 512 experts top-10 and a gated shared expert in
    # all 48: ~160 GB in bf16, so on one H200 only with --quantization fp8 (its experts too;
    # ~81 GB) and without the Hugging Face baseline.
    "qwen3-next-80b": MoEShape("qwen3-next-80b", "qwen3_next_80b.json", offline=False),
}

# --tiny: the architectures at test-model size (tests/test_moe.py's scale).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         num_local_experts=8, num_experts_per_tok=2, vocab_size=256, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "qwen3-moe-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64,
                              intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=16,
                              num_experts_per_tok=4, norm_topk_prob=True, vocab_size=256,
                              max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "deepseek-v2-lite": dict(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"], hidden_size=64,
                             intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                             n_shared_experts=1, num_experts_per_tok=2, topk_method="greedy", first_k_dense_replace=1,
                             vocab_size=256, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                             eos_token_id=2),
    "llama4-scout": dict(model_type="llama4_text", architectures=["Llama4ForCausalLM"], hidden_size=64,
                         intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
                         no_rope_layers=[1, 0], vocab_size=256, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "qwen3-next-80b": dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], hidden_size=64,
                           intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=16, linear_value_head_dim=8, vocab_size=256,
                           max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "gpt-oss-20b": dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], hidden_size=64,
                        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"], vocab_size=256,
                        max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
}


def expert_bytes(config: Any, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of all routed experts' weights, bytes of the top_k experts a token uses), summed
    over layers: the stacked `experts.gate_up_proj` / `experts.down_proj` parameters."""
    from kiln.compiler.capture import parameter_shapes

    elem = torch.empty((), dtype=dtype).element_size()
    total = active = 0
    top_k = int(config.num_experts_per_tok)
    for name, shape in parameter_shapes(config).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            size = math.prod(shape) * elem
            total += size
            active += size * top_k // shape[0]
    return total, active


def hf_moe_model(config: Any, dtype: torch.dtype, device: torch.device, experts_implementation: str | None
                 ) -> torch.nn.Module:
    """bench_common.hf_model with transformers' own choice of experts implementation (or the
    one asked for), kept for the whole of `generate`.

    batched_mm gathers every (token, expert) pair's expert matrices: at Mixtral-8x7B shape
    ~350 MB per pair per layer, tens of GB at a 128-token prefill or a batch of 64 (the
    baseline must be transformers at its best, not that). So unless --hf-experts asks for
    it: the model gets its own copy of the config with the implementation set explicitly
    (None: transformers resolves it, grouped_mm where it can dispatch, else eager), and
    `generate`'s switch from grouped_mm to batched_mm for its decode loop on GPUs
    (`_optimize_model_for_decode`, transformers 5.17 and 5.24) is turned off on this model.
    A pre-hook on each experts module makes any batched_mm call that still happens an
    error rather than an out-of-memory or a quietly different baseline."""
    import contextlib
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config.use_cache = True  # whatever the caller's object says: the baseline decodes with a KV cache
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa",
                                                     experts_implementation=experts_implementation)
        except ValueError as e:  # GPT-OSS's sinks: transformers has no sdpa path for it, only eager
            if "scaled_dot_product_attention" not in str(e):
                raise
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager",
                                                     experts_implementation=experts_implementation)
    model.eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.use_cache = True
    chosen = getattr(model.config, "_experts_implementation", None)
    if experts_implementation != "batched_mm":
        if chosen == "batched_mm":
            raise RuntimeError("transformers chose batched_mm experts for the baseline; pass --hf-experts")
        if hasattr(model, "_optimize_model_for_decode"):
            model._optimize_model_for_decode = contextlib.nullcontext
        experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "config")]
        for module in experts:
            module.register_forward_pre_hook(_refuse_batched_mm)
    return model


def _refuse_batched_mm(module: torch.nn.Module, args: Any) -> None:
    if getattr(module.config, "_experts_implementation", None) == "batched_mm":
        raise RuntimeError(f"{type(module).__name__} is about to run batched_mm experts in the baseline "
                           "(transformers switched implementation inside generate)")


def pass_stats(llm: Any, name: str) -> dict[str, int] | None:
    for record in llm.engine.graph_spec.pass_records:
        if record["name"] == name:
            return dict(record["stats"])
    return None


def engine_weight_bytes(llm: Any, top_k: int, num_experts: int) -> tuple[int, int] | None:
    """(all, active per token) bytes of the weights the engine holds, as loaded (FP8 weights at
    one byte, their scales included; each stacked expert tensor at top_k / experts of its bytes
    per token); None for a tensor-parallel engine (its weights are the workers')."""
    runner = llm.engine.runner
    if not hasattr(runner, "param_input"):
        return None
    seen, total, experts = set(), 0, 0
    for role in runner.input_roles:
        if not role.startswith("param:"):
            continue
        name = role[len("param:"):]
        tensor = runner.param_input(name)
        if tensor.data_ptr() in seen:
            continue  # a tied weight, bound twice
        seen.add(tensor.data_ptr())
        size = tensor.numel() * tensor.element_size()
        total += size
        if ".experts." in name and tensor.dim() == 3:
            experts += size
    return total, total - experts + experts * top_k // num_experts


def run_shape(shape: MoEShape, args: argparse.Namespace, device: torch.device, tmp: Path) -> dict[str, Any]:
    from kiln.kernels.paged_attention import caches_latent
    from kiln.runtime.llm import LLM

    if args.tiny:
        model_dir = tmp / shape.name
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(TINY_CONFIGS[shape.name]))
        model = str(model_dir / "config.json")
    else:
        model = str(bc.BENCH_DIR / shape.config)
    dtype = bc.kiln_dtype(args.dtype)
    config = bc.load_config(model, "dummy")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    decode_batches = [] if args.no_decode else batches
    wbytes = bc.weight_bytes(config, dtype)
    experts_total, experts_active = expert_bytes(config, dtype)
    active_bytes = wbytes - experts_total + experts_active
    result: dict[str, Any] = {
        "shape": shape.name, "model": model, "weight_bytes": wbytes, "active_weight_bytes_per_token": active_bytes,
        "num_experts": _num_experts(config),
        "top_k": int(config.num_experts_per_tok),
    }
    bandwidth = bc.copy_bandwidth(device) if device.type == "cuda" else None
    if bandwidth:
        result["copy_bandwidth_tb_s"] = bandwidth / 1e12
        result["batch1_limit_tokens_per_s"] = bandwidth / active_bytes
    offline = (shape.offline or args.offline) and not args.no_offline
    prompts = workload(args.num_requests, config.vocab_size, args.seed, args.min_prompt_len, args.max_prompt_len) \
        if offline else []

    if not args.no_baseline:
        model_hf = hf_moe_model(config, dtype, device, args.hf_experts)
        result["baseline"] = {"name": f"transformers eager ({model_hf.config._attn_implementation} attention)",
                              "experts_implementation": getattr(model_hf.config, "_experts_implementation", None),
                              # generate's decode loop runs it too (its switch to batched_mm is off)
                              "experts_implementation_pinned": True,
                              "decode": {}}
        for b in decode_batches:
            r = hf_decode(model_hf, b, args.prompt_len, args.hf_steps, config.vocab_size, seed=b)
            result["baseline"]["decode"][str(b)] = r
            print(f"[hf {shape.name}] decode batch {b}: {r['tokens_per_s']:.1f} tokens/s", flush=True)
        if offline:
            n_hf = min(len(prompts), max(HF_BATCH, (min(args.hf_requests, args.num_requests) // HF_BATCH) * HF_BATCH))
            result["baseline"]["offline"] = hf_throughput(model_hf, prompts[:n_hf], args.output_len)
            print(f"[hf {shape.name}] offline: {result['baseline']['offline']['output_tokens_per_s']:.0f} "
                  f"output tokens/s on {n_hf} requests", flush=True)
        del model_hf
        bc.free_cuda()

    t0 = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", dtype=args.dtype, device=device.type,
              max_num_seqs=max(max(batches), args.max_num_seqs if offline else 0),
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=max(args.prompt_len + args.steps, args.max_prompt_len + args.output_len) + 16,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization, progress=False,
              **bc.bucket_options(args))
    result["kiln_startup_s"] = time.perf_counter() - t0
    result["kiln_kv_cache_dtype"] = args.kv_cache_dtype
    result["kiln_quantization"] = args.quantization
    result["kiln_quantize_fp8"] = pass_stats(llm, "quantize_fp8") if args.quantization else None
    result["kiln_num_kv_blocks"] = llm.engine.num_kv_blocks
    # Multi-head latent attention cached as its latent or K/V expanded per head (the block
    # count alone does not say: max_num_seqs x max_model_len caps it before memory does).
    result["kiln_kv_cache_latent"] = caches_latent(llm.engine.model_config)
    print(f"[kiln {shape.name}] start-up {result['kiln_startup_s']:.1f} s; KV cache {llm.engine.num_kv_blocks} blocks"
          f"{', the latent' if result['kiln_kv_cache_latent'] else ''}", flush=True)
    result["kiln_fuse_moe"] = pass_stats(llm, "fuse_moe")
    # The bytes a decode step reads are the engine's as loaded: with FP8 weights (and
    # FP8 experts, the default with it) about half the config's 16-bit figure above.
    held = engine_weight_bytes(llm, result["top_k"], result["num_experts"])
    kiln_active_bytes = active_bytes
    if held:
        result["kiln_weight_bytes"], kiln_active_bytes = held
        result["kiln_active_weight_bytes_per_token"] = kiln_active_bytes
        if bandwidth:
            result["kiln_batch1_limit_tokens_per_s"] = bandwidth / kiln_active_bytes
    engine = llm.engine
    if decode_batches:
        kiln_decode(engine, 1, args.prompt_len, 2, config.vocab_size, seed=999)  # warm-up
    result["kiln"] = {"decode": {}}
    for b in decode_batches:
        r = kiln_decode(engine, b, args.prompt_len, args.steps, config.vocab_size, seed=b)
        r["active_bytes_read_tb_s"] = kiln_active_bytes * r["steps_per_s"] / 1e12  # a lower bound above batch 1
        if bandwidth:
            # Against the engine's own weight bytes (FP8: its smaller limit)
            r["batch1_percent_of_limit"] = 100 * r["tokens_per_s"] / b / (bandwidth / kiln_active_bytes)
        if "baseline" in result and str(b) in result["baseline"]["decode"]:
            r["speedup_vs_baseline"] = r["tokens_per_s"] / result["baseline"]["decode"][str(b)]["tokens_per_s"]
        result["kiln"]["decode"][str(b)] = r
        print(f"[kiln {shape.name}] decode batch {b}: {r['tokens_per_s']:.1f} tokens/s", flush=True)
    if offline:
        kiln_throughput(llm, prompts[:4], 4)  # warm-up
        r = kiln_throughput(llm, prompts, args.output_len)
        if "baseline" in result:
            r["speedup_vs_baseline"] = r["output_tokens_per_s"] / result["baseline"]["offline"]["output_tokens_per_s"]
        result["kiln"]["offline"] = r
        result["workload"] = {"requests": args.num_requests, "prompt_len": [args.min_prompt_len, args.max_prompt_len],
                              "output_len": args.output_len, "ignore_eos": True, "seed": args.seed,
                              "prompt_tokens": sum(map(len, prompts))}
        print(f"[kiln {shape.name}] offline: {r['output_tokens_per_s']:.0f} output tokens/s", flush=True)
    del llm, engine
    bc.free_cuda()
    return result


def _num_experts(config: Any) -> int:
    from kiln.compiler.model_source import config_num_experts

    return int(config_num_experts(config) or 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="all", help=f"{', '.join(SHAPES)} or all (default)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs of the same architectures, on CPU")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    parser.add_argument("--out", default=None, help="write the JSON result here (also printed)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the Hugging Face transformers baseline")
    parser.add_argument("--no-offline", action="store_true", help="skip the offline workload")
    parser.add_argument("--offline", action="store_true",
                        help="run the offline workload for a shape that skips it by default (all but Mixtral's)")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode figures (offline workload only)")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--prompt-len", type=int, default=None, help="decode prompts (default 128; 16 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="Kiln decode steps timed (default 128; 8 with --tiny)")
    parser.add_argument("--hf-steps", type=int, default=None, help="baseline decode steps timed (default 32; 4 tiny)")
    parser.add_argument("--num-requests", type=int, default=None, help="offline requests (default 1000; 24 tiny)")
    parser.add_argument("--output-len", type=int, default=None, help="offline output tokens (default 256; 8 tiny)")
    parser.add_argument("--hf-requests", type=int, default=64, help="baseline offline subset, batches of 64")
    parser.add_argument("--hf-experts", default=None, choices=["eager", "grouped_mm", "batched_mm"],
                        help="the baseline's experts implementation (default: transformers' choice, grouped_mm)")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="Kiln's KV-cache dtype (default auto: the model's; fp8 holds twice the tokens)")
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="Kiln's FP8 projections, the experts too (KILN_FP8_EXPERTS=0: experts in 16 bits)")
    parser.add_argument("--decode-buckets", default=None, help="comma-separated decode bucket sizes (default: the engine's)")
    parser.add_argument("--token-buckets", default=None, help="comma-separated token bucket sizes (default: the engine's)")
    bc.add_mixed_graph_arg(parser)
    args = parser.parse_args()
    tiny = args.tiny
    defaults = dict(dtype="float32" if tiny else "bfloat16", prompt_len=16 if tiny else 128, steps=8 if tiny else 128,
                    hf_steps=4 if tiny else 32, num_requests=24 if tiny else 1000, output_len=8 if tiny else 256)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.min_prompt_len, args.max_prompt_len = (8, 48) if tiny else (128, 1024)
    if tiny:
        args.max_num_seqs = min(args.max_num_seqs, 64)
        args.max_num_batched_tokens = min(args.max_num_batched_tokens, 512)
        os.environ.setdefault("KILN_CPU_FUSIONS", "1")  # the fused-MoE op on CPU too
        device = torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            parser.error("moe.py measures GPU serving; no CUDA device is available (--tiny runs on CPU)")
        device = torch.device("cuda")
    names = list(SHAPES) if args.shape == "all" else [args.shape]
    for name in names:
        if name not in SHAPES:
            parser.error(f"--shape {name!r}: one of {', '.join(SHAPES)} or all")

    result: dict[str, Any] = {"benchmark": "moe", "env": bc.environment(), "dtype": args.dtype, "tiny": tiny,
                              "device": device.type, "shapes": {}}
    with tempfile.TemporaryDirectory(prefix="kiln-moe-bench-") as tmp:
        for name in names:
            if len(names) > 1:
                # One process per shape: nothing of the previous shape's ~93 GB (weights, KV
                # cache, CUDA graph pools) can be left behind for the next on the GPU.
                result["shapes"][name] = _run_shape_in_subprocess(name, Path(tmp))
            else:
                result["shapes"][name] = run_shape(SHAPES[name], args, device, Path(tmp))
    bc.emit(result, args.out)


def _run_shape_in_subprocess(name: str, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    argv = [a for a in sys.argv[1:]]
    for flag in ("--shape", "--out"):  # this run's own values replace the parent's
        while flag in argv:
            i = argv.index(flag)
            del argv[i:i + 2]
        argv = [a for a in argv if not a.startswith(flag + "=")]
    subprocess.run([sys.executable, str(Path(__file__).resolve()), *argv, "--shape", name, "--out", str(out)],
                   check=True)
    return json.loads(out.read_text())["shapes"][name]


if __name__ == "__main__":
    main()
