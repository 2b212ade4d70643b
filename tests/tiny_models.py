"""Tiny random models of every architecture Kiln is tested on, built from config objects.

Nothing is downloaded: each config is small enough (2 layers, hidden 64) to build and run in
well under a second on CPU, yet keeps the constructs that matter for its family: GQA and
multi-query attention, tied embeddings, q/k norm, MoE, sliding windows mixed with global
layers, Llama 3.1 rope scaling, partial rotary, parallel attention/MLP blocks, learned
absolute positions, attention and final-logit soft-capping, embedding/residual/logit
multipliers, layers without RoPE, ALiBi and attention written inline (Bloom, MPT, Falcon),
fused qkv and gate/up checkpoint tensors, biases.

`SUPPORTED` lists the architectures Kiln runs (each has a parity test); `REFUSED` lists
architectures Kiln refuses, each with the construct its message must name. The README's
support table is generated from both (`tests/support_table.py`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Architectures whose configs have no KV-head count (every head has its own K/V).
MHA = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}
# DeepSeek-V2/V3-style multi-head latent attention at tiny sizes (K 16 + 8, V 16 per head).
_MLA = dict(num_key_value_heads=4, moe_intermediate_size=32, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16)
# Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5): linear-attention layers with 2 key and 4 value
# heads, a width-4 convolution, every fourth layer full attention (partial rotary, gated output).
_GDN = dict(head_dim=16, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            partial_rotary_factor=0.25)
# Mamba2 hybrids (Granite 4.0-H, Bamba, Nemotron-H): 8 heads of 16 over a 16-wide state in 2
# groups, a width-4 convolution (with its bias), one attention layer among the Mamba2 ones.
_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
               num_hidden_layers=4)
# Falcon-H1 with multipliers of every kind away from 1.
_FALCON_H1 = dict(head_dim=16, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_ssm=128,
                  ssm_multipliers=[0.5, 1.5, 0.7, 1.2, 0.9], mlp_multipliers=[0.8, 1.3], key_multiplier=0.6,
                  attention_in_multiplier=1.4, attention_out_multiplier=0.7, ssm_in_multiplier=1.1,
                  ssm_out_multiplier=0.9, embedding_multiplier=2.0, lm_head_multiplier=0.5)
# Most prompts in the parity tests are longer than this: windowed layers really cut.
WINDOW = 6
ALTERNATING = ["sliding_attention", "full_attention"]
# Gemma 4 at tiny sizes: windowed layers of 2 KV heads of 16, global ones of 1 KV head of 32.
_GEMMA4 = dict(head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
               sliding_window=WINDOW, num_hidden_layers=4, layer_types=ALTERNATING * 2, vocab_size_per_layer_input=128,
               final_logit_softcapping=3.0)


def _partial_rope(factor: float, theta: float = 10000.0) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": factor}


# model_type -> (config overrides, what the tiny config exercises). Keys that are not a
# model_type name a variant ("llama2", "llama3.1"), built from the model_type in "model_type".
_CONFIGS: dict[str, tuple[dict[str, Any], str]] = {
    "llama": (dict(tie_word_embeddings=False), "GQA, RoPE, RMSNorm, SiLU-gated MLP"),
    "llama2": (dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=True), "MHA, tied embeddings"),
    "llama3.1": (dict(model_type="llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}), "llama3 rope scaling"),
    "mistral": (dict(sliding_window=24), "sliding window on every layer"),
    "qwen2": (dict(tie_word_embeddings=True), "qkv bias, tied embeddings"),
    "qwen3": (dict(head_dim=32), "q/k RMSNorm, head_dim != hidden/heads"),
    "mixtral": (dict(num_local_experts=4, num_experts_per_tok=2), "MoE (batched_mm experts)"),
    "gemma": (dict(head_dim=16), "(1+w) RMSNorm, GELU-tanh gated MLP, embedding scaled by sqrt(hidden)"),
    "gemma2": (dict(head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING, attn_logit_softcapping=1.0,
                    final_logit_softcapping=3.0, query_pre_attn_scalar=32),
               "attention and final-logit soft-capping, windowed + global layers, query_pre_attn_scalar, sandwich norms"),
    "gemma3_text": (dict(head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING, query_pre_attn_scalar=24),
                    "windowed + global layers with their own RoPE bases, q/k norm, query_pre_attn_scalar"),
    # Gemma 4: its global layers have a head size and KV heads of their own (a heterogeneous
    # config: `per_layer_config`), and there the keys are the values too (`attention_k_eq_v`).
    "gemma4_text": (dict(_GEMMA4, hidden_size_per_layer_input=0),
                    "global layers with their own head size and KV heads (a cache shape per layer), K as V there, "
                    "proportional partial RoPE, soft-capping, layer scalars"),
    "gemma4_e2b": (dict(_GEMMA4, model_type="gemma4_text", hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                        use_double_wide_mlp=True),
                   "per-layer embeddings, the last layers attending over earlier layers' K/V (no cache of their "
                   "own), double-wide MLPs there"),
    "gemma4_moe": (dict(_GEMMA4, model_type="gemma4_text", hidden_size_per_layer_input=0, enable_moe_block=True,
                        num_experts=4, top_k_experts=2, moe_intermediate_size=32),
                   "a dense MLP and experts side by side in every layer, a router with its own norm and "
                   "per-expert scales"),
    # Gemma 3n's text model (E2B/E4B): AltUp's 4 predicted streams, LAuReL's low-rank residual,
    # activation sparsity (a Gaussian top-k of the gate) in the first layers, KV sharing, PLE.
    "gemma3n_text": (dict(head_dim=16, sliding_window=WINDOW, num_hidden_layers=4, layer_types=ALTERNATING * 2,
                          vocab_size_per_layer_input=128, hidden_size_per_layer_input=8, num_kv_shared_layers=2,
                          intermediate_size=[128] * 4, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0],
                          laurel_rank=8, altup_num_inputs=4, final_logit_softcapping=3.0),
                     "AltUp streams, LAuReL residuals, activation sparsity, per-layer embeddings, the last layers "
                     "attending over earlier layers' K/V"),
    # MiMo-V2-Flash: keys of 24 and values of 16 a head, windowed layers with twice the config's
    # KV heads (its attention module doubles them), attention sinks, sigmoid-routed experts.
    "mimo_v2_flash": (dict(head_dim=24, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, sliding_window=WINDOW, num_hidden_layers=3),
                      "values narrower than keys, windowed layers with twice the KV heads (a cache shape per "
                      "layer), attention sinks, value scaling, sigmoid-routed experts"),
    "phi": (dict(MHA, rope_parameters=_partial_rope(0.5), qk_layernorm=False),
            "partial rotary (1/2), parallel attention/MLP block, LayerNorm with bias, GELU MLP, biases"),
    "phi3": (dict(), "fused qkv and gate_up checkpoint tensors"),
    "olmo": (dict(), "LayerNorm without weights"),
    "olmo2": (dict(), "q/k RMSNorm over all heads, post-norms"),
    "olmo3": (dict(sliding_window=WINDOW, layer_types=ALTERNATING), "windowed + global layers, post-norms"),
    "cohere": (dict(logit_scale=0.5, use_qk_norm=False), "parallel block, LayerNorm without bias, logit scale"),
    "cohere2": (dict(sliding_window=WINDOW, layer_types=ALTERNATING, logit_scale=0.5),
                "windowed layers with RoPE, global layers without RoPE, parallel block"),
    "gpt_neox": (dict(MHA, rope_parameters=_partial_rope(0.25), use_parallel_residual=True),
                 "partial rotary (1/4), parallel residual, fused qkv, LayerNorm with bias, GELU"),
    "gpt2": (dict(MHA), "learned absolute positions, Conv1D fused qkv, GELU-tanh, LayerNorm with bias"),
    "gpt_bigcode": (dict(MHA, multi_query=True), "multi-query attention, learned absolute positions"),
    "starcoder2": (dict(sliding_window=WINDOW), "sliding window, biases, LayerNorm, GELU-tanh MLP"),
    "stablelm": (dict(rope_parameters=_partial_rope(0.25), use_qkv_bias=True),
                 "partial rotary (1/4), qkv bias, LayerNorm"),
    "granite": (dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
                "embedding, residual, attention and logit multipliers"),
    "smollm3": (dict(no_rope_layers=[1, 0]), "layers without RoPE"),
    "helium": (dict(head_dim=16), "Llama-like with head_dim != hidden/heads"),
    "glm": (dict(head_dim=16), "partial rotary with interleaved (GPT-J style) halves, fused gate_up"),
    "glm4": (dict(head_dim=16), "partial interleaved rotary, sandwich norms, fused gate_up"),
    "exaone4": (dict(sliding_window=WINDOW, layer_types=ALTERNATING),
                "windowed layers with RoPE, global layers without, q/k norm, post-norms"),
    "gptj": (dict(MHA, rotary_dim=8, tie_word_embeddings=False),
             "interleaved partial rotary (rotary_dim 8), parallel block, GELU MLP"),
    "codegen": (dict(MHA, rotary_dim=8, tie_word_embeddings=False), "fused qkv (mp-sharded layout), parallel block"),
    "persimmon": (dict(MHA, rope_parameters=_partial_rope(0.5), qk_layernorm=True),
                  "partial rotary, q/k LayerNorm, squared-ReLU MLP"),
    "nemotron": (dict(head_dim=16, rope_parameters=_partial_rope(0.5)),
                 "partial rotary, LayerNorm1P (1+w), squared-ReLU MLP"),
    "opt": (dict(MHA, ffn_dim=128, enable_bias=True), "learned absolute positions with offset, ReLU MLP"),
    "biogpt": (dict(MHA, scale_embedding=True), "learned absolute positions, scaled embeddings"),
    "arcee": (dict(head_dim=16), "squared-ReLU MLP without gate"),
    "seed_oss": (dict(head_dim=16, attention_bias=True), "qkv bias without output bias"),
    "apertus": (dict(), "xIELU activation, q/k norm"),
    "hunyuan_v1_dense": (dict(head_dim=16), "q/k norm after RoPE"),
    "ernie4_5": (dict(head_dim=16), "interleaved RoPE"),
    "ministral": (dict(head_dim=16, sliding_window=WINDOW, layer_types=ALTERNATING), "windowed + global layers"),
    "ministral3": (dict(head_dim=16), "YaRN rope scaling with Llama 4 attention-temperature scaling of q"),
    "internlm3": (dict(head_dim=16), "Llama-like (InternLM 3)"),
    "exaone": (dict(head_dim=16), "Llama-like (EXAONE 3.5)"),
    "bitnet": (dict(head_dim=16), "sub-norms inside attention and MLP, squared-ReLU gated MLP"),
    "jais2": (dict(head_dim=16), "LayerNorm, biases everywhere, squared-ReLU MLP without gate"),
    "vaultgemma": (dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=1.0, final_logit_softcapping=3.0),
                   "soft-capping, windowed + global layers, Gemma norms without post-norms"),
    # Mixture-of-experts beyond Mixtral (tests/test_moe.py has Qwen2-MoE, Qwen3-MoE and OLMoE):
    # routers other than a softmax and a top-k stay in the graph, their experts become
    # kiln::moe_experts; selection biases (persistent buffers) are random, so they must load.
    "glm4_moe": (dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                      topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                      use_qk_norm=True),
                 "DeepSeek-V3 routing (sigmoid scores, selection bias, expert groups, scaling), shared expert, "
                 "dense first layer, partial rotary"),
    "dots1": (dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                   norm_topk_prob=True, layer_types=["full_attention"] * 2),
              "DeepSeek-V3 routing without groups, q/k norm"),
    "ernie4_5_moe": (dict(head_dim=16, moe_intermediate_size=32, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                          moe_layer_start_index=1, moe_layer_end_index=1),
                     "softmax router with a selection bias, shared experts, dense first layer"),
    "minimax_m2": (dict(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
                   "sigmoid router with a selection bias, q/k norm over all heads"),
    "exaone_moe": (dict(head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, n_group=2,
                        topk_group=1, num_shared_experts=1, first_k_dense_replace=1, sliding_window=WINDOW,
                        layer_types=ALTERNATING, mlp_layer_types=["dense", "sparse"]),
                   "grouped sigmoid router with a selection bias (kept under another checkpoint name), windowed layers"),
    "hunyuan_v1_moe": (dict(head_dim=16, num_experts=4, moe_topk=2, moe_intermediate_size=32),
                       "softmax top-k router (kiln::fused_moe), shared MLP, q/k norm after RoPE"),
    "phimoe": (dict(num_local_experts=4, num_experts_per_tok=2), "sparsemixer router (two maxima), LayerNorm"),
    "granitemoe": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, embedding_multiplier=2.0,
                        residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0),
                   "softmax over the top-k logits, stacked experts in the checkpoint, multipliers"),
    "granitemoeshared": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                              shared_intermediate_size=48), "as granitemoe, with a shared expert"),
    "afmoe": (dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                   num_dense_layers=1, sliding_window=WINDOW, layer_types=ALTERNATING, route_scale=2.0),
              "sigmoid router with a selection bias, gated attention, pre/post MLP norms, dense first layer"),
    "solar_open": (dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1), "sigmoid router with a selection bias, shared expert"),
    "flex_olmo": (dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32),
                  "softmax top-k router (kiln::fused_moe), q/k norm over all heads, post-norms"),
    "cohere2_moe": (dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1, sliding_window=WINDOW,
                         layer_types=ALTERNATING),
                    "parallel block with experts, shared expert averaged in, windowed + global layers"),
    "minicpm5_moe": (dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                          n_shared_experts=1, routed_scaling_factor=2.0),
                     "sigmoid router with a selection bias and scaling, gated attention output, dense first layer"),
    # GLM-4.5's MoE code under their own model_types (transformers maps them to Glm4Moe*).
    "param2moe": (dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                       n_shared_experts=1), "GLM-4.5 MoE (Param-2's checkpoints)"),
    "sarvam_moe": (dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                        n_shared_experts=1), "GLM-4.5 MoE (Sarvam's checkpoints)"),
    "granitemoe_swa": (dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=WINDOW,
                            layer_types=["full_attention", "sliding_attention"]),
                       "attention sinks as a sink scaling, windowed + global layers, Granite multipliers"),
    # Multi-head latent attention: K (qk_nope + qk_rope dims) and V (v_head_dim) per head from a
    # shared latent, which the cache holds (kv_lora_rank + qk_rope_head_dim values a token).
    "deepseek_v3": (dict(_MLA, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                         n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5),
                    "multi-head latent attention (q and kv LoRA, K and V of other sizes), DeepSeek-V3 routing"),
    "deepseek_v2": (dict(_MLA, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                         first_k_dense_replace=1, topk_method="greedy"),
                    "multi-head latent attention without q LoRA, softmax top-k router"),
    "glm4_moe_lite": (dict(_MLA, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                           n_shared_experts=1, first_k_dense_replace=1),
                      "multi-head latent attention (GLM-4.7-Flash), sigmoid router with a selection bias"),
    # Llama 4 (the text model): its RoPE ties the token count to the position ids' own symbol
    # (capture lets export narrow the range), NoPE layers with attention-temperature tuning, L2
    # q/k norm, a sigmoid top-1 router and experts computed densely (not the pluggable kind).
    "llama4_text": (dict(head_dim=16, intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4,
                         num_experts_per_tok=1, no_rope_layers=[1, 0]),
                    "RoPE and NoPE layers with attention-temperature tuning, L2 q/k norm, dense top-1 experts"),
    # GPT-OSS: attention sinks (a learned per-head logit in every softmax's denominator),
    # alternating windowed and global layers, biased experts with a clamped SwiGLU over
    # interleaved gate/up columns behind a biased softmax-of-top-k router.
    "gpt_oss": (dict(COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                     layer_types=["sliding_attention", "full_attention"]),
                "attention sinks, windowed and global layers, biased experts with a clamped SwiGLU"),
    # Attention written inline (no attention interface): capture's inline_attention pass.
    "bloom": (dict(_IDS, hidden_size=96, n_layer=2, n_head=6, vocab_size=128),
              "ALiBi (6 heads: slopes of a non-power-of-two count) in baddbmm, fused qkv, embedding LayerNorm"),
    "mpt": (dict(_IDS, d_model=96, n_heads=6, n_layers=2, expansion_ratio=2, vocab_size=128, max_seq_len=128),
            "ALiBi (MPT's slopes) sliced from a max_seq_len bias, LayerNorm without bias, fused qkv"),
    "falcon": (dict(_IDS, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128),
               "multi-query, parallel block, RoPE, attention through the model's own SDPA call and mask"),
    "falcon_rw": (dict(_IDS, model_type="falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       vocab_size=128, alibi=True, multi_query=False, parallel_attn=False, bias=True),
                  "ALiBi folded into the model-built SDPA mask (Falcon-RW), sequential block, biases"),
    # DBRX: experts that transformers loops over (the tokens each one got), which capture
    # rebuilds as batched_mm ones (kiln.compiler.stacked_experts); q/k/v clipping; a softmax
    # router renormalised by an L1 norm.
    "dbrx": (dict(d_model=64, n_heads=4, n_layers=2, max_seq_len=512, vocab_size=128,
                  attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                  ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
             "looped experts rebuilt as batched_mm, q/k/v clipping, fused Wqkv, LayerNorm without bias"),
    # Hybrids of gated DeltaNet (linear attention: a conv state and a recurrent state per
    # sequence, kiln.kernels.gated_delta_net) and gated full attention: three of four layers
    # linear, as released (2 value heads per key head, as Qwen3-Next-80B's 32 over 16).
    "qwen3_next": (dict(_GDN, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32),
                   "gated DeltaNet + gated attention layers (recurrent states), experts with a gated shared expert"),
    # OLMo Hybrid: separate q/k/v/a/b/g projections, beta doubled (`allow_neg_eigval`), the
    # convolution saved as three tensors; OLMo 3 attention layers.
    "olmo_hybrid": (dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=8),
                    "gated DeltaNet (separate projections, doubled beta) + attention layers, q/k norm, post-norms"),
    "qwen3_5": (dict(_GDN, model_type="qwen3_5_text"), "gated DeltaNet + gated attention layers (Qwen3.5, dense)"),
    "qwen3_5_moe": (dict(_GDN, model_type="qwen3_5_moe_text", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32, shared_expert_intermediate_size=32),
                    "gated DeltaNet + gated attention layers (Qwen3.5), experts with a gated shared expert"),
    "granitemoehybrid": (dict(_MAMBA2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                              shared_intermediate_size=48,
                              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]),
                         "Mamba2 + attention layers (recurrent states), experts with a shared MLP, Granite multipliers"),
    "bamba": (dict(_MAMBA2, attn_layer_indices=[1]), "Mamba2 + attention layers (recurrent states)"),
    "nemotron_h": (dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, head_dim=16,
                        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
                        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1),
                   "Mamba2, attention, MLP and MoE blocks (ReLU-squared experts without a gate, sigmoid router)"),
    # LFM2: gated short convolutions (a conv state per sequence, no SSM) and attention layers.
    "lfm2": (dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"]),
             "gated short convolutions (a conv state per sequence) + attention layers, q/k norm"),
    "lfm2_moe": (dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "conv"], num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1),
                 "as lfm2, with experts behind a sigmoid router with a selection bias, a dense first layer"),
    # Newer architectures of transformers 5.2x, each run as captured (no per-model code).
    "apertus1p5_text": (dict(output_vocab_size=96), "xIELU non-gated MLP, q/k norm, llama3 RoPE, an LM head over part of the vocabulary"),
    "beam": (dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  mlp_layer_types=["dense", "sparse", "sparse"], sliding_window=8, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                  final_logit_softcapping=30.0),
             "windowed + global NoPE layers, q/k norm, attention gate, sandwich norms, grouped sigmoid router"),
    "cwm": (dict(num_hidden_layers=4, layer_types=["full_attention"] + ["sliding_attention"] * 3, sliding_window=8),
            "windowed + global layers (one in four global), llama3 RoPE"),
    "flint": (dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "full_attention"],
                   mlp_only_layers=[0], sliding_window=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=64),
              "windowed + global NoPE layers, attention sinks, q/k norm, sigmoid experts with a shared expert"),
    "granite_swa": (dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                         layer_rope_theta=[0, 10000.0, 50000.0], sliding_window=8, embedding_multiplier=12.0,
                         attention_multiplier=0.0625, residual_multiplier=0.22, logits_scaling=4.0),
                    "windowed + global layers, a RoPE base per layer (0: NoPE), sinks, Granite multipliers"),
    "hy_v3": (dict(num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], num_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1),
              "q/k norm, dense then MoE layers, biased and scaled sigmoid router, shared expert"),
    "hyperclovax": (dict(embedding_multiplier=4.0, attention_multiplier=0.1, residual_multiplier=0.5, logits_scaling=0.25,
                         use_post_norm=True), "post-norms around each block, muP multipliers, logits multiplied"),
    "iquestcoder": ({}, "Llama-like (IQuest-Coder)"),
    "kolibri1": (dict(num_hidden_layers=3, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                      sliding_window=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
                 "windowed + global NoPE layers, q/k norm, sandwich norms, sigmoid experts with a shared expert"),
    "laguna": (dict(num_hidden_layers=3, layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                    sliding_window=8, num_attention_heads_per_layer=[4, 8, 4], mlp_layer_types=["dense", "sparse", "sparse"],
                    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                    moe_routed_scaling_factor=2.5, moe_router_logit_softcapping=10.0, gating=True),
               "windowed + global layers, a head count per layer, softplus head gate, sigmoid experts, shared expert"),
    "lara_mini": (dict(num_hidden_layers=5, layer_types=["linear_attention", "sliding_attention", "linear_attention",
                                                         "full_attention", "sliding_attention"],
                       sliding_window=8, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=32),
                  "gated DeltaNet (one fused in_proj in the checkpoint) + windowed + global NoPE layers, experts"),
    "lfm3": (dict(num_hidden_layers=4, layer_types=["conv", "sliding_attention", "conv", "full_attention"],
                  sliding_window=8, conv_L_cache=3),
             "short convolutions + windowed + global layers, q/k norm, sigmoid head gate, sandwich norms"),
    "mellum": (dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    mlp_layer_types=["dense", "sparse", "sparse"], sliding_window=8, num_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=32),
               "windowed + global layers with their own RoPE bases, q/k norm, dense then MoE layers"),
    "nanochat": (dict(final_logit_softcapping=15.0),
                 "norms without weights (one after the embedding), RoPE before q/k norm, ReLU-squared MLP, soft-capping"),
    "xglm": (dict(MHA, ffn_dim=128), "sinusoidal positions, scaled embeddings, LayerNorm, GELU MLP, biases"),
    "ctrl": (dict(MHA, dff=128), "sinusoidal positions, scaled embeddings, LayerNorm, ReLU MLP, an LM head bias"),
    "modernbert-decoder": (dict(MHA, num_hidden_layers=3,
                                layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                local_attention=16),
                           "windowed + global layers with their own RoPE bases, embedding norm, GeGLU, prediction head"),
    # Mamba's selective scan (a decay per channel and state column; kiln.kernels.mamba): the
    # pure state-space models have no attention layer at all; Jamba interleaves attention
    # (without RoPE) and MoE.
    "mamba": (dict(_IDS, hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128, state_size=16,
                   time_step_rank=8), "selective-scan layers alone (no attention), residual in float32"),
    "falcon_mamba": (dict(_IDS, hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=128,
                          state_size=16, time_step_rank=8),
                     "selective-scan layers alone, RMS norms without weights on dt, B and C"),
    # Falcon-H1: every layer attention and a Mamba2 mixer side by side (a KV cache and states),
    # with its multipliers (mup_vector over in_proj's parts); the scan gated by SiLU(z) as the
    # 0.5B's config has it, or (falcon_h1_rms) by the gated norm over groups.
    "falcon_h1": (dict(_FALCON_H1, mamba_rms_norm=False),
                  "attention and Mamba2 side by side in every layer, muP multipliers"),
    "falcon_h1_rms": (dict(_FALCON_H1, model_type="falcon_h1", mamba_rms_norm=True, mamba_norm_before_gate=False),
                      "as falcon_h1, the scan's output through the gated norm over groups"),
    "mamba2": (dict(_IDS, hidden_size=64, num_hidden_layers=2, vocab_size=128, num_heads=8, head_dim=16, n_groups=2,
                    state_size=16, expand=2), "Mamba2 layers alone (no attention), heads in two groups"),
    "jamba": (dict(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_dt_rank=8),
              "selective-scan + attention layers without RoPE, dt/B/C norms, experts every other layer"),
}

# Architectures Kiln refuses: model_type -> (config overrides, the construct the refusal names).
_REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "diffllama": ({**COMMON}, "attention called 2 times"),
    "rwkv": (dict(hidden_size=64, num_hidden_layers=2, vocab_size=128, attention_hidden_size=64, intermediate_size=128),
             "state-space"),
    "t5": (dict(d_model=64, d_ff=128, num_layers=2, num_heads=4, vocab_size=128), "cross-attention"),
    "bart": (dict(d_model=64, encoder_layers=2, decoder_layers=2, vocab_size=128), "cross-attention"),
}


# The Hugging Face attention a parity reference runs where eager is not transformers' own
# default: Falcon's eager ALiBi path adds the bias twice (inline, and folded into the mask it
# builds), 11% off its SDPA path in transformers 5.17 and 5.24; Kiln follows SDPA (the
# default, and ALiBi as Falcon-RW was trained).
_HF_ATTENTION = {"falcon_rw": "sdpa"}


def tiny_config(arch: str) -> Any:
    from transformers import AutoConfig

    if arch in _REFUSED:
        overrides = _REFUSED[arch][0]
        return AutoConfig.for_model(arch, **overrides)
    if arch not in _CONFIGS:
        raise ValueError(f"no tiny config for {arch!r}")
    overrides = dict(_CONFIGS[arch][0])
    model_type = overrides.pop("model_type", arch)
    # Overrides built on MHA carry every size themselves (and must not get COMMON's KV heads).
    base = {} if {"hidden_size", "d_model"} & overrides.keys() else COMMON
    kwargs = {**base, **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def exercises(arch: str) -> str:
    """What the tiny config of `arch` exercises (a line of the support table)."""
    return _CONFIGS[arch][1]


def refusal_construct(arch: str) -> str:
    return _REFUSED[arch][1]


def _installed(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return model_type in CONFIG_MAPPING_NAMES


SUPPORTED = tuple(a for a, (o, _) in _CONFIGS.items() if _installed(o.get("model_type", a)))
REFUSED = tuple(a for a in _REFUSED if _installed(a))
# The original parity set (kept name: other tests parametrize over it).
ARCHS = ("llama", "llama2", "llama3.1", "mistral", "qwen2", "qwen3", "mixtral")


def save_tiny_model(arch: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """Build the HF model with random weights, save it (safetensors + config) and return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=_HF_ATTENTION.get(arch, "eager")).eval()
    # Larger-than-default init spreads the logits so greedy choices are not near-ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
        # Routers' selection biases start at zero: random ones check that the checkpoint's load.
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.5)
            if name.endswith("layer_scalar"):  # Gemma 4's per-layer output scale (ones at init)
                b.uniform_(0.5, 1.5)
        for name, p in model.named_parameters():  # Gemma 4's router scales (ones at init)
            if name.endswith(("router.scale", "router.per_expert_scale")):
                p.uniform_(0.5, 1.5)
        # GPT-OSS's attention sinks (one logit per head) of the size trained ones reach.
        for name, p in model.named_parameters():
            if name.endswith(".sinks"):
                p.normal_(0.0, 2.0)
    model.save_pretrained(path)
    return model
