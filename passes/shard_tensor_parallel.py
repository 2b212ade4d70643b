"""`shard_tensor_parallel`: turn the captured graph into one rank's graph of a
tensor-parallel group (Megatron-style), and tell the loader which slice of each weight that
rank reads.

At `tp_size` 1 (the default) the pass changes nothing. Otherwise, on rank r of tp:

- column-parallel projections (q, k, v, gate, up): the rank keeps its rows of the weight
  (and bias): its attention heads, its part of the MLP's intermediate dimension. Query heads
  split evenly; KV heads split too when there are at least as many as ranks, and otherwise
  each rank keeps the one KV head its query heads read (replicated over tp / kv_heads ranks);
- row-parallel projections (o, down): the rank keeps the matching columns, and the partial
  products are summed over ranks by `kiln::all_reduce` (the bias, if any, added once after it);
- the embedding is vocab-parallel: the rank holds ceil(V / tp) rows, looks up the tokens it
  owns, zeroes the others, and `kiln::all_reduce` sums;
- the LM head is vocab-parallel too: each rank projects onto its rows of the vocabulary and
  `kiln::all_gather` joins them. prune_logits (later) selects the sampled rows before the
  head, so only those rows are projected and gathered;
- MoE experts (transformers' stacked `experts.gate_up_proj` [E, 2I, H] and
  `experts.down_proj` [E, H, I]): each expert's intermediate dimension is split like a
  dense MLP's, the router stays whole, and the experts' sum is all-reduced;
- fused checkpoint tensors (`_FUSED`, per model_type): [q; k; v] (Phi-3's qkv_proj, MPT's
  Wqkv) and [gate; up] (Phi-3, GLM) are read as one range per part, and the slices that
  split the product move to the rank's offsets (GPT-BigCode's multi-query c_attn: every rank
  reads the one K/V head); a per-head [q_h; k_h; v_h] layout (GPT-NeoX,
  Persimmon, Bloom, Falcon-RW) is one run of rows, the rank's heads; CodeGen's qkv_proj
  (4 blocks of [q; v; k], a quarter of the heads each) is one run of whole blocks, so tp
  must divide 4;
- modules whose names say nothing of their role (CTRL's Sequential `ffn.0` / `ffn.2`,
  ModernBERT's attention and MLP `Wo`) take the role their parent gives them (`_RENAMED`);
  a gate per query head (`g_proj`: LFM3's, Laguna's) splits by heads, and so do Laguna's
  per-layer query-head counts, each layer's evenly, and parameters of one value per head read
  outside a projection (Beam's attention-gate bias, `_PER_HEAD_VECTORS`); one of a list of
  projections (Gemma 3n's `altup_projections.0`) takes the list's role;
- configs whose layers differ (transformers' heterogeneous configs: Gemma 4's full-attention
  layers have a head_dim and KV heads of their own) get a plan a layer (`_LayerPlans`): a
  parameter's rows are its layer's heads', and a view's spelled-out sizes its layer's;
- projections that are no `aten.linear`: GPT-2's Conv1D, `addmm(bias, x, W)` with W
  [in, out] (column-parallel keeps W's columns, row-parallel its rows and becomes `mm`, the
  bias added after the all-reduce; the views that spell out the widths get the rank's), and
  Falcon's `matmul(x, W.T)` followed by a separate bias add (its multi-query
  query_key_value viewed as [..., heads + 2, head_dim] gets the rank's count; the grouped
  new_decoder_architecture layout is refused);
- norms over all heads' width (OLMo2's q/k norm, BitNet's sub-norms): the rank keeps its
  slice of the weight, and the mean of squares becomes a sum, all-reduced, over the full
  count (refused when KV heads are replicated: a head would count once per rank); a standard
  deviation likewise from the all-reduced sums of x and x * x (Gemma 3n's activation sparsity
  over the MLP's channels, `_global_std`). Any other reduction over a dimension the rank
  holds part of is refused, naming the node;
- ALiBi slopes (Bloom, MPT): sliced in the graph to the rank's heads;
- gated DeltaNet layers (Qwen3-Next, Qwen3.5, OLMo Hybrid): by key heads, each with its value
  heads (`_GatedDeltaPlan`): Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped per key head, are
  one run of rows; Qwen3.5's in_proj_qkv and the convolution's channels are [q; k; v], three
  runs; in_proj_z / _b / _a, A_log and dt_bias the rank's value heads; OLMo Hybrid's separate
  q_proj / k_proj by key heads, v_proj / g_proj / a_proj / b_proj by value heads (its gated
  norm's `reshape(-1, head_dim)` takes the rank's heads: a view that only cuts rows of a width
  the rank holds whole, `_merges_leading_dims`); out_proj (o_proj) row-parallel over them; the
  `kiln::gated_delta_net` marker gets the rank's key-head count, the views that spell out a
  head count the rank's, and the state caches hold the rank's heads;
- multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): q_b_proj / q_proj and kv_b_proj
  keep the rank's heads' rows (whatever a head's width: `_Plan.head_rows`), kv_b_proj also
  where it is no linear but the per-head weight the latent cache's absorbed attention views;
  q_a_proj and kv_a_proj_with_mqa (into the shared latents) are replicated, and so is the
  latent cache's one KV head.

Shapes in the graph's views mostly use -1 for the head count (`[1, T, -1, head_dim]`), so
after the weights shrink, fake-tensor propagation gives every node its rank's shape (a view
that spells the head count out is rewritten to the rank's, including OPT's, whose -1 on the
tokens would otherwise silently take the difference), and the KV cache
(`kv_heads_and_head_dim(config, tp_size)`) holds the rank's KV heads. Each sliced weight gets a `ShardWeight`
transform; the merge passes that run later concatenate the already-sliced q/k/v and gate/up.
The graph depends on the rank (the vocabulary offset of its embedding), so the rank and tp
size are cache-key factors. Architectures are taken one by one once their tensor names and
per-head constructs are known to shard this way (`TP_ARCHITECTURES`, each tested at two
ranks against the unsharded graph); others are refused with a message at tp > 1.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from kiln.compiler.graph_inputs import param_name
from kiln.kernels.paged_attention import is_latent_attention, kv_heads_and_head_dim, layer_config
from kiln.passes.base import KilnPass, PassContext, PassStats
from kiln.passes.fuse_moe import router_projections
from kiln.passes.prune_logits import find_lm_head
from kiln.passes.weight_transforms import ShardWeight

aten = torch.ops.aten

# model_type -> why it shards with the rules above (names q/k/v/o_proj, gate/up/down_proj,
# per-head or per-element norms only). Others are refused at tp > 1.
TP_ARCHITECTURES = {
    "llama": "q/k/v/o, gate/up/down",
    "mistral": "as llama; sliding window is per head",
    "qwen2": "as llama, with q/k/v biases",
    "qwen3": "as llama; q/k RMSNorm over head_dim (per head)",
    "granite": "as llama, with scalar multipliers",
    "helium": "as llama",
    "smollm3": "as llama",
    "mixtral": "as llama; experts split along their intermediate dimension",
    "glm4_moe": "as mixtral; the router (with its selection bias) replicated, shared expert as an MLP",
    "dots1": "as glm4_moe; q/k norm per head",
    "solar_open": "as glm4_moe",
    "exaone_moe": "as glm4_moe; sliding window is per head",
    "minimax_m2": "as mixtral; q/k norm over all heads, as olmo2's",
    "ernie4_5_moe": "as mixtral; shared experts as an MLP",
    "hunyuan_v1_moe": "as mixtral; q/k norm per head; the router `gate.wg` replicated",
    "phimoe": "as mixtral; the router `router` replicated, LayerNorms",
    "granitemoe": "as mixtral with Granite's multipliers; the router `router` replicated",
    "granitemoeshared": "as granitemoe; the shared MLP's fused input_linear [gate; up] per part, output_linear",
    "afmoe": "as mixtral; gated attention's gate_proj per head",
    "cohere2_moe": "as cohere2 (parallel block: both partial sums all-reduced); experts as mixtral, the router "
                   "replicated, the shared expert as an MLP",
    "minicpm5_moe": "as glm4_moe; gated attention's fused q_gate_proj ([q; gate] per head) by heads",
    "param2moe": "as glm4_moe",
    "sarvam_moe": "as glm4_moe",
    "granitemoe_swa": "as granitemoe; attention sinks per head, sliding window is per head",
    "flex_olmo": "as mixtral; q/k norm over all heads, as olmo2's",
    "gpt_oss": "as mixtral over [E, in, out] experts whose gate/up channels alternate (a rank's pairs are one run "
               "of columns) with biases (the down projection's on rank 0 only); attention sinks per head; "
               "o_proj's bias after the all-reduce",
    "deepseek_v3": "multi-head latent attention: q_b_proj / kv_b_proj per head (kv_b_proj a view when the latent is "
                   "cached), the latents' projections replicated, o_proj by heads; experts as mixtral, the "
                   "router (with its selection bias) replicated, shared experts as an MLP",
    "deepseek_v2": "as deepseek_v3, q_proj by heads (no q LoRA), the softmax router replicated",
    "glm4_moe_lite": "as deepseek_v3",
    "qwen3_next": "gated DeltaNet layers by key heads (in_proj_qkvz / in_proj_ba per key head, the convolution, "
                  "A_log and dt_bias, out_proj row-parallel); gated attention's q_proj ([q; gate] per head) by "
                  "heads; experts as mixtral, the shared expert as an MLP, its gate replicated",
    "qwen3_5_text": "as qwen3_next, in_proj_qkv as [q; k; v] and in_proj_z / _b / _a by value heads",
    "qwen3_5_moe_text": "as qwen3_5_text; experts as qwen3_next",
    "granitemoehybrid": "Mamba2 mixers by heads (in_proj's gate, x and dt, the convolution's x channels, A_log, D, "
                        "dt_bias and the norm's weight; B and C by groups, or the heads' group replicated; out_proj "
                        "row-parallel); experts as granitemoe, the shared MLP's fused input_linear per part",
    "bamba": "Mamba2 mixers as granitemoehybrid's; a Llama MLP",
    "apertus1p5_text": "as llama; an xIELU MLP, q/k norm per head",
    "cwm": "as mistral",
    "flint": "as llama; sinks by heads, experts as glm4_moe",
    "granite_swa": "as granite; sinks by heads",
    "hy_v3": "as glm4_moe",
    "hyperclovax": "as granite",
    "iquestcoder": "as llama",
    "kolibri1": "as glm4_moe",
    "lara_mini": "gated DeltaNet layers as qwen3_5_text's; experts as qwen3_next",
    "mellum": "as glm4_moe",
    "nanochat": "as llama",
    "xglm": "as llama, with biases",
    "mamba": "Mamba mixers by channels (in_proj's x and z, the convolution, dt_proj, A_log, D, dt_bias); x_proj and "
             "out_proj row-parallel, all-reduced",
    "falcon_mamba": "as mamba; the dt/B/C norms on every rank",
    "jamba": "Mamba mixers as mamba's, their dt/B/C norms on every rank; attention as llama; experts as mixtral, the "
             "router replicated",
    "mamba2": "Mamba2 mixers as granitemoehybrid's, no attention",
    "falcon_h1": "Mamba2 mixers as granitemoehybrid's beside the attention in every layer (mup_vector sliced as "
                 "in_proj's rows; not with mamba_rms_norm); a Llama MLP",
    "lfm2": "gated short convolutions by channels (in_proj's [B; C; x] as three runs, the convolution's channels, "
            "out_proj row-parallel); attention as llama's with out_proj; w1/w3/w2 as gate/up/down",
    "lfm2_moe": "as lfm2; experts as mixtral, the router (with its selection bias) replicated",
    "nemotron_h": "Mamba2 mixers as granitemoehybrid's; ReLU-squared MLP blocks by the intermediate dimension; MoE "
                  "blocks' experts (up_proj and down_proj, no gate) as mixtral's, the shared experts as an MLP, the "
                  "router replicated",
    "llama4_text": "as llama; its [E, in, out] experts split along their intermediate dimension (the routed sum "
                   "all-reduced before the shared expert's output is added), the router replicated; chunked "
                   "attention per head",
    "gemma": "as llama; embedding scaled after the all-reduce",
    "gemma2": "as llama; soft-capping per head and on the gathered logits",
    "gemma3_text": "as llama; q/k norm per head",
    "gemma4_text": "as gemma3_text; each layer's own heads and head_dim (its full-attention layers' KV heads, "
                   "replicated where fewer than the ranks, K read as V), planned per layer (`_LayerPlans`); the "
                   "per-layer inputs' projections replicated; experts split along their intermediate dimension",
    "mimo_v2_flash": "as glm4_moe; v_proj by the same KV heads at v_head_dim (`_Plan.v`), the windowed layers' "
                     "twice the KV heads planned per layer, the sinks by heads",
    "gemma3n_text": "as gemma3_text; AltUp, LAuReL and the per-layer inputs replicated, the activation sparsity's "
                    "std over the rank's intermediate channels from all-reduced sums (`_global_std`)",
    "olmo": "as llama; LayerNorm without weights",
    "cohere": "parallel attention/MLP block: both partial sums all-reduced",
    "cohere2": "as cohere",
    "exaone4": "as llama; q/k norm per head",
    "starcoder2": "q/k/v/o with biases, c_fc/c_proj",
    "phi": "q/k/v, dense, fc1/fc2, parallel block, biases",
    "gptj": "q/k/v, out_proj, fc_in/fc_out, parallel block",
    "stablelm": "as llama; its views spell out the head count (rewritten per rank)",
    "nemotron": "as llama without gate; LayerNorm1P, squared ReLU",
    "opt": "q/k/v, out_proj, fc1/fc2, biases; learned positions",
    "biogpt": "q/k/v, out_proj, fc1/fc2, biases; learned positions",
    "arcee": "as llama without gate; squared ReLU",
    "seed_oss": "as llama, with q/k/v biases",
    "apertus": "as llama without gate; q/k norm per head, xIELU",
    "hunyuan_v1_dense": "as llama; q/k norm per head",
    "ernie4_5": "as llama; interleaved RoPE is per head",
    "ministral": "as llama; sliding window is per head",
    "ministral3": "as llama; attention-temperature scaling of q is per token",
    "internlm3": "as llama",
    "exaone": "as llama",
    "jais2": "as llama without gate; biases everywhere",
    "vaultgemma": "as gemma2",
    "olmo2": "as llama; q/k RMSNorm over all heads: weight sliced, mean of squares all-reduced",
    "olmo3": "as olmo2",
    "bitnet": "as llama; sub-norms over the attention output and the intermediate dimension, as olmo2's",
    "phi3": "fused qkv_proj and gate_up_proj: each rank reads its q, k, v (gate, up) rows of them",
    "glm": "as llama, fused gate_up_proj",
    "glm4": "as glm",
    "gpt_neox": "fused query_key_value per head: the rank's heads are one run of rows; dense_h_to_4h/4h_to_h",
    "persimmon": "as gpt_neox; q/k LayerNorm per head",
    "bloom": "as gpt_neox; ALiBi slopes sliced to the rank's heads; embedding LayerNorm after the all-reduce",
    "mpt": "fused Wqkv as phi3's; ALiBi slopes sliced to the rank's heads; up/down_proj, out_proj",
    "dbrx": "fused Wqkv as mpt's (q/k/v clipping is elementwise), out_proj; experts as mixtral (stacked at "
            "capture), the router `ffn.router.layer` replicated",
    "gpt_bigcode": "fused c_attn [q; k; v] with one (multi-query) KV head, replicated; c_fc/c_proj",
    "codegen": "qkv_proj in 4 [q; v; k] blocks: the rank's whole blocks are one run of rows (tp divides 4); parallel block",
    "falcon": "FalconLinear matmul(x, W.T): query_key_value multi-query (one K/V head, replicated) or per head; "
              "dense, dense_h_to_4h/4h_to_h; ALiBi slopes sliced (Falcon-RW). Not new_decoder_architecture",
    "ctrl": "Wq/Wk/Wv/dense and the ffn's Linear-ReLU-Linear as llama's q/k/v/o and up/down (_RENAMED); the "
            "sinusoidal positions and the LM head's bias (vocab-parallel) per rank",
    "modernbert-decoder": "as llama with attn.Wo as o_proj; the GeGLU's fused Wi [input; gate] as phi3's gate_up, "
                          "mlp.Wo as down_proj (_RENAMED); the prediction head's dense replicated",
    "olmo_hybrid": "gated DeltaNet layers as qwen3_5_text's, their separate projections q_proj / k_proj by key "
                   "heads, v_proj / g_proj / a_proj / b_proj by value heads, o_proj row-parallel; attention as olmo2's",
    "beam": "as glm4_moe; q/k norm per head, the attention gate's gate_proj and gate_bias by heads",
    "laguna": "as glm4_moe; a query-head count per layer (each split evenly, its rows one run a rank), the softplus "
              "head gate g_proj by heads",
    "lfm3": "as lfm2 (short convolutions by channels); attention as llama, q/k norm per head, the sigmoid head gate "
            "g_proj by heads",
    "gpt2": "Conv1D addmm with [in, out] weights: fused c_attn [q; k; v] by columns, c_fc, row-parallel c_proj",
}
# Projection module names -> which split: "q" (query heads), "kv" (KV heads), "mlp" (the
# intermediate dimension, evenly). Names of the architectures in TP_ARCHITECTURES: Llama's
# q/k/v/o_proj and gate/up/down_proj, Phi's dense and fc1/fc2, StarCoder2's c_fc/c_proj,
# GPT-J's out_proj and fc_in/fc_out.
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp",
           "w1": "mlp", "w3": "mlp",  # LFM2's gate and up
           "fc1": "mlp", "c_fc": "mlp", "fc_in": "mlp", "dense_h_to_4h": "mlp",
           # Multi-head latent attention's up-projections from the latents: rows per head
           # (q_b_proj: nope + rope; kv_b_proj, where it is a linear: k_nope + v).
           "q_b_proj": "q", "kv_b_proj": "q",
           # MiniCPM 5's query and output gate, [q; gate] rows per head: the rank's heads are one run.
           "q_gate_proj": "q",
           # A gate per query head (LFM3's sigmoid, Laguna's softplus): rows per head, one run a rank.
           "g_proj": "q"}
_ROW = {"o_proj": "q", "dense": "q", "out_proj": "q", "down_proj": "mlp", "fc2": "mlp", "c_proj": "mlp", "w2": "mlp",
        "fc_out": "mlp", "dense_4h_to_h": "mlp", "output_linear": "mlp"}
# Modules whose names say nothing of their role (CTRL's Sequential ffn, ModernBERT's two Wo),
# per model_type: "parent.module" -> the name of the role above (or of _FUSED below).
_RENAMED = {
    "ctrl": {"multi_head_attention.Wq": "q_proj", "multi_head_attention.Wk": "k_proj",
             "multi_head_attention.Wv": "v_proj", "ffn.0": "up_proj", "ffn.2": "down_proj"},
    "modernbert-decoder": {"attn.Wo": "o_proj", "mlp.Wo": "down_proj", "lm_head.dense": "prediction_head"},
}
# Fused checkpoint tensors, per model_type (a name alone does not say the layout: Falcon's
# and CodeGen's fused qkv are laid out otherwise): module -> `_Plan.fused` layout.
_FUSED = {
    "phi3": {"qkv_proj": "qkv", "gate_up_proj": "gate_up"},
    "mpt": {"Wqkv": "qkv"},
    "dbrx": {"Wqkv": "qkv"},
    "gpt_bigcode": {"c_attn": "qkv"},
    "codegen": {"qkv_proj": "mp4"},
    "gpt2": {"c_attn": "qkv"},  # along the columns of Conv1D's [in, out] weight
    "glm": {"gate_up_proj": "gate_up"},
    "glm4": {"gate_up_proj": "gate_up"},
    "modernbert-decoder": {"Wi": "gate_up"},  # the GeGLU's [input; gate] (Wqkv: transformers splits it)
    "granitemoeshared": {"input_linear": "gate_up"},  # the shared MLP's [gate; up]
    "granitemoehybrid": {"input_linear": "gate_up"},
    "gpt_neox": {"query_key_value": "heads3"},
    "persimmon": {"query_key_value": "heads3"},
    "bloom": {"query_key_value": "heads3"},
}
# Architectures whose projections are `matmul(x, W.T)` (Falcon's FalconLinear), not linear.
_TRANSPOSED_MATMUL = {"falcon"}
# CodeGenAttention.mp_num: transformers fixes it at 4 for every CodeGen checkpoint.
_CODEGEN_MP_NUM = 4
# Replicated: every rank computes the whole projection (MoE routers: small, and every rank
# needs all experts' scores). Routers of any name are found by kiln.passes.fuse_moe's
# router_projections too (PhiMoE's and Granite's `router`, Hunyuan's `gate.wg`).
# (MLA's: into the shared q and kv latents; the shared expert's one-column gate of Qwen2-MoE and Qwen3-Next.)
# (ModernBERT's prediction head: a [hidden, hidden] dense before the LM head.)
# (Gemma 4's per-layer inputs, its E2B/E4B models': the residual stream into a few hundred
# columns a layer and back, small beside the layer's MLP.)
# (Gemma 3n's AltUp, its stream predictions and their router and coefficients, and its LAuReL
# low-rank residual: every one reads and writes the residual streams every rank holds whole.)
_REPLICATED = {"gate", "router", "q_a_proj", "kv_a_proj_with_mqa", "shared_expert_gate", "prediction_head",
               "per_layer_model_projection", "per_layer_input_gate", "per_layer_projection",
               "altup_projections", "altup_unembed_projections", "modality_router", "prediction_coefs",
               "correction_coefs", "linear_left", "linear_right"}
# Parameters of one value per query head, by name (Beam's attention-gate bias): the rank's heads'.
_PER_HEAD_VECTORS = {"gate_bias"}
# Gated DeltaNet projections (`_GatedDeltaPlan.rows`), and its row-parallel output projection.
_GATED_DELTA_COLUMN = {"in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"}
# OLMo Hybrid's: a projection each (`linear_attn.`): q and k by key heads, the rest by value heads.
_GATED_DELTA_SEPARATE = {"q_proj", "k_proj", "v_proj", "g_proj", "a_proj", "b_proj"}
# Where an MoE block's output ends: the residual add (or the graph output); for Llama 4's
# experts also the in-place add of the routed sum to the shared expert's (reduced) output.
_BLOCK_END = {aten.add.Tensor, "output"}
_LLAMA4_BLOCK_END = _BLOCK_END | {aten.add_.Tensor}
# Stacked experts kept as [E, in, out] (Llama 4's), not transformers' pluggable [E, out, in].
_TRANSPOSED_EXPERTS = {"llama4_text"}
_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|up_proj|down_proj)$")  # (up_proj: Nemotron-H's, no gate)
_OAI_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)(_bias)?$")


def _module_role(name: str, model_type: str) -> str:
    """The module name of a parameter (`...self_attn.q_proj.weight` -> `q_proj`), or the role
    `_RENAMED` gives its parent and module for `model_type`."""
    parts = name.split(".")
    module = parts[-2] if len(parts) >= 2 else name
    if module.isdigit() and len(parts) >= 3:
        module = parts[-3]  # one of a list of projections (Gemma 3n's `altup_projections.0`): the list's role
    return _RENAMED.get(model_type, {}).get(".".join(parts[-3:-1]), module)


def attention_heads(config: Any, layer: int | None = None) -> int:
    """The config's attention heads (of `layer`: Laguna's `num_attention_heads_per_layer`, a
    heterogeneous config's layer config); 0 for a model without attention (Mamba2's own)."""
    per_layer = getattr(config, "num_attention_heads_per_layer", None)
    if layer is not None and per_layer:
        return int(per_layer[layer])
    config = config if layer is None else layer_config(config, layer)
    return int(getattr(config, "num_attention_heads", None) or 0)


def layers_differ(config: Any) -> bool:
    """Whether the config's attention layers differ in heads or head_dim: transformers'
    heterogeneous configs (Gemma 4), or MiMo-V2-Flash's windowed layers of twice the KV heads."""
    if getattr(config, "is_heterogeneous", False):
        return True
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    return len({kv_heads_and_head_dim(config, layer=i) for i in range(layers)}) > 1


def _check_heads(config: Any, tp_size: int, layer: int | None = None) -> None:
    """ValueError where tp_size splits the attention heads (of `layer`, where layers differ)
    unevenly, or the KV heads neither evenly nor by replication."""
    heads = attention_heads(config, layer)
    kv_heads, _ = kv_heads_and_head_dim(config, layer=layer)
    of = "" if layer is None else f" of layer {layer}"
    if heads % tp_size:
        raise ValueError(f"tensor_parallel_size={tp_size} does not divide the {heads} attention heads{of}")
    if kv_heads and kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp_size}: the {kv_heads} KV heads{of} can be neither split over nor "
                         f"replicated across {tp_size} ranks (one must divide the other)")


def check_tp_size(config: Any, tp_size: int) -> None:
    """ValueError naming what does not divide, for a config that cannot be split tp_size ways."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp_size!r}")
    if tp_size == 1:
        return
    model_type = str(getattr(config, "model_type", "?"))
    if model_type not in TP_ARCHITECTURES:
        raise ValueError(f"tensor_parallel_size={tp_size}: Kiln does not shard {model_type!r} models yet (it shards "
                         f"{', '.join(sorted(TP_ARCHITECTURES))}); run it with tensor_parallel_size=1")
    if model_type == "falcon" and getattr(config, "new_decoder_architecture", False):
        # Its query_key_value holds [q heads; k; v] per KV group, and the graph broadcasts K/V
        # to every query head with a shape that spells out the group count: no rule yet.
        raise ValueError(f"tensor_parallel_size={tp_size}: Kiln does not shard Falcon models with "
                         "new_decoder_architecture (grouped query_key_value, as Falcon-40B/180B) yet; run it with "
                         "tensor_parallel_size=1")
    if model_type == "falcon_h1" and getattr(config, "mamba_rms_norm", False):
        # Its gated norm views the rank's channels as [groups, size] with the full model's
        # counts spelled out, and multiplies a weight viewed alike: no rule yet.
        raise ValueError(f"tensor_parallel_size={tp_size}: Kiln does not shard Falcon-H1 models with mamba_rms_norm "
                         "(the gated norm over groups) yet; run it with tensor_parallel_size=1")
    if model_type == "codegen" and _CODEGEN_MP_NUM % tp_size:
        # Each rank must hold whole [q; v; k] blocks of qkv_proj (_Plan.fused's "mp4").
        raise ValueError(f"tensor_parallel_size={tp_size}: CodeGen's qkv_proj is laid out in {_CODEGEN_MP_NUM} "
                         f"[q; v; k] blocks, which {tp_size} ranks cannot take whole; use a tensor_parallel_size "
                         f"that divides {_CODEGEN_MP_NUM}")
    if layers_differ(config) or getattr(config, "num_attention_heads_per_layer", None):
        # Each layer's own counts: Gemma 4's full-attention layers' num_global_key_value_heads,
        # MiMo's doubled windowed ones, Laguna's query heads (each layer's split evenly, so that a
        # rank's rows of its projections, `_Plan.head_rows`' 1/tp run of them, hold whole heads).
        for layer in range(int(config.num_hidden_layers)):
            _check_heads(config, tp_size, layer)
    else:
        _check_heads(config, tp_size)
    intermediate = getattr(config, "intermediate_size", None)
    for layer, size in enumerate(intermediate if isinstance(intermediate, (list, tuple)) else [intermediate]):
        if isinstance(size, int) and size % tp_size:  # (Gemma 3n's: one a layer)
            of = f" of layer {layer}" if isinstance(intermediate, (list, tuple)) else ""
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide intermediate_size={size}{of}")
    from kiln.kernels.recurrent_states import mamba2_sizes, mamba_sizes, recurrent_family, recurrent_layers

    if recurrent_family(config) == "mamba":
        channels = mamba_sizes(config)[0]
        if channels % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the Mamba layers' {channels} channels")
    elif recurrent_layers(config):
        key_heads = getattr(config, "linear_num_key_heads", None)
        if key_heads is not None and key_heads % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the {key_heads} key heads of the gated "
                             "DeltaNet layers")
        if getattr(config, "conv_L_cache", None) is not None:  # LFM2's short convolutions: by channels
            if int(config.hidden_size) % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} does not divide hidden_size={config.hidden_size}")
        elif key_heads is None:
            mamba_heads, _, groups, _, _ = mamba2_sizes(config)
            if mamba_heads % tp_size or (groups % tp_size and tp_size % groups):
                raise ValueError(f"tensor_parallel_size={tp_size}: the Mamba2 layers' {mamba_heads} heads in {groups} "
                                 "groups do not split over it (it must divide the heads, and divide or be a multiple "
                                 "of the groups)")



class _GatedDeltaPlan:
    """Rank r's part of a gated DeltaNet layer: key heads [k0, k1), each with its value heads."""

    def __init__(self, config: Any, tp: int, rank: int):
        self.num_k, self.num_v = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        self.head_k, self.head_v = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        per_k = self.num_k // tp
        self.k0, self.k1 = rank * per_k, (rank + 1) * per_k
        group = self.num_v // self.num_k
        self.v0, self.v1 = self.k0 * group, self.k1 * group
        self.local_k = per_k

    def qkv(self) -> list[tuple[int, int]]:
        """The rank's channels of [q; k; v] (Qwen3.5's in_proj_qkv, the convolution's channels)."""
        key_dim = self.num_k * self.head_k
        return [(self.k0 * self.head_k, self.k1 * self.head_k),
                (key_dim + self.k0 * self.head_k, key_dim + self.k1 * self.head_k),
                (2 * key_dim + self.v0 * self.head_v, 2 * key_dim + self.v1 * self.head_v)]

    def rows(self, module: str, size: int, what: str) -> list[tuple[int, int]]:
        """The rank's output rows of one of the layer's input projections (`size` rows in all)."""
        if module == "in_proj_qkv":
            return self.qkv()
        # One block per key head (its value heads inside Qwen3-Next's fused projections; OLMo
        # Hybrid's separate q_proj / k_proj are one key head's rows a block).
        if module in ("in_proj_qkvz", "in_proj_ba", "q_proj", "k_proj"):
            if size % self.num_k:
                raise ValueError(f"shard_tensor_parallel: {what} ({size} rows) is not one block per key head")
            width = size // self.num_k
            return [(self.k0 * width, self.k1 * width)]
        # A block per value head: in_proj_z, v_proj, g_proj (head_v rows), in_proj_b / _a, a_proj, b_proj (1).
        width = size // self.num_v
        if size % self.num_v:
            raise ValueError(f"shard_tensor_parallel: {what} ({size} rows) is not one block per value head")
        return [(self.v0 * width, self.v1 * width)]

    def size_map(self) -> dict[int, int]:
        tp = self.num_k // self.local_k
        return {self.num_k: self.local_k, self.num_v: self.num_v // tp}


class _Mamba2Plan:
    """Rank r's part of a Mamba2 mixer: heads [h0, h1) and the groups of B and C they read
    (whole groups where the groups split over the ranks, else the one group of its heads)."""

    def __init__(self, config: Any, tp: int, rank: int):
        from kiln.kernels.recurrent_states import mamba2_sizes

        self.heads, self.head_dim, self.groups, self.state, _ = mamba2_sizes(config)
        per = self.heads // tp
        self.h0, self.h1 = rank * per, (rank + 1) * per
        if self.groups % tp == 0:
            self.g0, self.g1 = rank * self.groups // tp, (rank + 1) * self.groups // tp
        else:  # fewer groups than ranks: this rank's heads are all in one group
            self.g0 = self.h0 * self.groups // self.heads
            self.g1 = self.g0 + 1
        self.local_heads, self.local_groups = per, self.g1 - self.g0

    def channels(self) -> list[tuple[int, int]]:
        """The rank's channels of [x; B; C] (the convolution's)."""
        inner, bc = self.heads * self.head_dim, self.groups * self.state
        return [(self.h0 * self.head_dim, self.h1 * self.head_dim),
                (inner + self.g0 * self.state, inner + self.g1 * self.state),
                (inner + bc + self.g0 * self.state, inner + bc + self.g1 * self.state)]

    def in_proj_rows(self) -> list[tuple[int, int]]:
        """The rank's rows of in_proj: [gate; x; B; C; dt]."""
        inner = self.heads * self.head_dim
        gate = (self.h0 * self.head_dim, self.h1 * self.head_dim)
        dt = 2 * inner + 2 * self.groups * self.state
        return [gate, *((a + inner, b + inner) for a, b in self.channels()), (dt + self.h0, dt + self.h1)]

    def size_map(self) -> dict[int, int]:
        return {self.heads: self.local_heads, self.groups: self.local_groups,
                self.heads * self.head_dim: self.local_heads * self.head_dim}


class _MambaPlan:
    """Rank r's part of a Mamba (selective-scan) mixer: channels [c0, c1) of its intermediate
    width (each channel's state row, its convolution and its D are its own; B, C and dt's
    low-rank input are every channel's)."""

    def __init__(self, config: Any, tp: int, rank: int):
        from kiln.kernels.recurrent_states import mamba_sizes

        self.full = mamba_sizes(config)[0]
        self.local = self.full // tp
        self.channels = (rank * self.local, (rank + 1) * self.local)


class _Plan:
    """The row ranges of rank r for each kind of projection output (of `layer`'s attention,
    where the config's layers differ: `_LayerPlans`)."""

    def __init__(self, config: Any, tp: int, rank: int, layer: int | None = None):
        self.tp, self.rank = tp, rank
        heads = attention_heads(config, layer)
        kv_heads, self.head_dim = kv_heads_and_head_dim(config, layer=layer)
        per = heads // tp
        self.num_heads, self.heads_per_rank = heads, per
        self.q = (rank * per * self.head_dim, (rank + 1) * per * self.head_dim)
        self.kv_heads, self.kv_replicated = kv_heads, kv_heads < tp
        self.full_width = {"q": heads * self.head_dim, "kv": kv_heads * self.head_dim}
        if kv_heads >= tp:
            kv_per = kv_heads // tp
            self.kv = (rank * kv_per * self.head_dim, (rank + 1) * kv_per * self.head_dim)
        else:  # replicated: the KV head of this rank's query heads
            kv_index = rank * kv_heads // tp
            self.kv = (kv_index * self.head_dim, (kv_index + 1) * self.head_dim)
        # Values narrower than the keys (MiMo-V2-Flash's v_head_dim): v_proj's rows are the same
        # KV heads at their own width. (Latent attention's v_head_dim is kv_b_proj's, per query head.)
        v_dim = int(getattr(config, "v_head_dim", None) or 0)
        self.v: tuple[int, int] | None = None
        if v_dim and self.head_dim and v_dim != self.head_dim and not is_latent_attention(config):
            first, last = self.kv[0] // self.head_dim, self.kv[1] // self.head_dim
            self.v, self.v_head_dim = (first * v_dim, last * v_dim), v_dim
            self.full_width["v"] = kv_heads * v_dim

    def size_map(self) -> dict[int, int]:
        """Full-model sizes a view may spell out (head counts, their widths) -> this rank's."""
        heads, kv_heads = self.num_heads, self.kv_heads
        if not heads:
            return {}  # no attention (Mamba2's own model): no head counts to map
        kv_rank = (self.kv[1] - self.kv[0]) // self.head_dim
        sizes = {heads: heads // self.tp, heads * self.head_dim: heads * self.head_dim // self.tp,
                 kv_heads: kv_rank, kv_heads * self.head_dim: kv_rank * self.head_dim}
        if self.v is not None:
            sizes[kv_heads * self.v_head_dim] = kv_rank * self.v_head_dim
            sizes[heads * self.v_head_dim] = heads * self.v_head_dim // self.tp  # (the attention output)
        return sizes

    def head_rows(self, size: int, what: str) -> tuple[int, int]:
        """This rank's part of a dimension laid out per query head, whatever a head's width (MLA's
        q_b_proj and kv_b_proj rows are not head_dim a head): `q` where the width is head_dim."""
        if size % self.num_heads:
            raise ValueError(f"shard_tensor_parallel: {what} of size {size} is not {self.num_heads} heads' rows")
        width = size // self.num_heads
        return (self.rank * self.heads_per_rank * width, (self.rank + 1) * self.heads_per_rank * width)

    def even(self, size: int, what: str) -> tuple[int, int]:
        if size % self.tp:
            raise ValueError(f"shard_tensor_parallel: {what} of size {size} does not divide by tp={self.tp}")
        per = size // self.tp
        return (self.rank * per, (self.rank + 1) * per)

    def fused(self, layout: str, rows: int, what: str) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """A fused projection's rows of this rank, and where the boundaries between its parts
        (full model -> rank) move: "qkv" is [q; k; v] (Phi-3's qkv_proj, MPT's Wqkv),
        "gate_up" is [gate; up], "heads3" is per head [q_h; k_h; v_h] (GPT-NeoX, Bloom,
        Persimmon: the rank's heads are one run of rows, and the views that split them count
        heads)."""
        if layout == "qkv":
            q_full, kv_full = self.full_width["q"], self.full_width["kv"]
            if rows != q_full + 2 * kv_full:
                raise ValueError(f"shard_tensor_parallel: {what} has {rows} rows, not q + k + v = "
                                 f"{q_full} + 2 x {kv_full}")
            (q0, q1), (k0, k1) = self.q, self.kv
            q, k = q1 - q0, k1 - k0
            return ([(q0, q1), (q_full + k0, q_full + k1), (q_full + kv_full + k0, q_full + kv_full + k1)],
                    {0: 0, q_full: q, q_full + kv_full: q + k, q_full + 2 * kv_full: q + 2 * k})
        if layout == "gate_up":
            inter = rows // 2
            a, b = self.even(inter, what)
            return [(a, b), (inter + a, inter + b)], {0: 0, inter: b - a, rows: 2 * (b - a)}
        if layout == "heads3":
            if self.kv_replicated or self.full_width["kv"] != self.full_width["q"] or rows != 3 * self.full_width["q"]:
                raise ValueError(f"shard_tensor_parallel: {what} ({rows} rows) is not one [q; k; v] block per "
                                 "head of a model whose every head has its own K/V")
            (q0, q1) = self.q
            return [(3 * q0, 3 * q1)], {}
        if layout == "mp4":
            # CodeGen: 4 blocks (the model-parallel shards it was trained with), each
            # [q; v; k] of its quarter of the heads in order, read through
            # `view(..., -1, 3 * hidden / 4)` and `split(hidden / 4)`. A rank holding whole
            # blocks reads one run of rows, and those views and splits stay as they are.
            if self.kv_replicated or self.full_width["kv"] != self.full_width["q"] or rows != 3 * self.full_width["q"]:
                raise ValueError(f"shard_tensor_parallel: {what} ({rows} rows) is not CodeGen's [q; v; k] blocks of "
                                 "a model whose every head has its own K/V")
            if _CODEGEN_MP_NUM % self.tp:
                raise ValueError(f"shard_tensor_parallel: {what} is laid out in {_CODEGEN_MP_NUM} [q; v; k] blocks, "
                                 f"which tp={self.tp} does not split into whole blocks per rank; use a "
                                 f"tensor_parallel_size that divides {_CODEGEN_MP_NUM}")
            per = rows // self.tp
            return [(self.rank * per, (self.rank + 1) * per)], {}
        raise ValueError(f"shard_tensor_parallel: unknown fused layout {layout!r} of {what}")

    @property
    def heads(self) -> tuple[int, int]:
        """This rank's query heads [first, last) ((0, 0) without attention)."""
        if not self.head_dim:
            return 0, 0
        return self.q[0] // self.head_dim, self.q[1] // self.head_dim

    def vocab(self, size: int) -> tuple[tuple[int, int], int]:
        per = -(-size // self.tp)
        start = min(size, self.rank * per)
        return (start, min(size, start + per)), per


class _LayerPlans:
    """One `_Plan` for the model, or one a layer where the config's layers differ (`layers_differ`:
    Gemma 4's full-attention layers have a head_dim and KV heads of their own, MiMo-V2-Flash's
    windowed layers twice the KV heads). A parameter's plan is its layer's (by the `layers.N.`
    in its name), a node's that of the module it was traced in (its `nn_module_stack`);
    anything outside the layers (the embeddings, the LM head) takes the first layer's, whose
    head counts it does not read."""

    def __init__(self, config: Any, tp: int, rank: int):
        self.by_layer: dict[int, _Plan] = {}
        if layers_differ(config):
            self.by_layer = {i: _Plan(config, tp, rank, i) for i in range(int(config.num_hidden_layers))}
            self.model = self.by_layer[0]
        else:
            self.model = _Plan(config, tp, rank)
        # Each plan's view sizes (full model -> rank), kept: the recurrent layers' join them.
        self._size_maps = {id(p): p.size_map() for p in (self.by_layer.values() if self.by_layer else [self.model])}

    def of_name(self, name: str | None) -> _Plan:
        match = _LAYER_INDEX.search(name or "")
        return self.by_layer.get(int(match.group(1)), self.model) if match else self.model

    def of_node(self, node: torch.fx.Node) -> _Plan:
        if not self.by_layer:
            return self.model
        stack = node.meta.get("nn_module_stack") or {}
        return self.of_name(list(stack.values())[-1][0] if stack else None)

    def size_maps(self) -> list[dict[int, int]]:
        """Every plan's `size_map` (one without per-layer plans), as `size_map_of` gives them."""
        return list(self._size_maps.values())

    def size_map_of(self, node: torch.fx.Node) -> dict[int, int]:
        """The sizes a view traced in `node`'s layer may spell out -> the rank's."""
        return self._size_maps[id(self.of_node(node))]


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _all_reduce_at_block_end(down_proj: torch.fx.Node, all_reduce_after: Any,
                             ends: set[object] = _BLOCK_END) -> int:
    """An all-reduce where each reader of a row-sharded experts' down projection leads, through
    single-use nodes (the routing weights, the sum over a token's experts, reshapes: linear in
    it), to the block's end (`ends`: the residual add); how many were placed."""
    count = 0
    for user in [u for u in down_proj.users if u.op == "call_function"]:
        target = user
        while len(target.users) == 1 and next(iter(target.users)).target not in ends:
            target = next(iter(target.users))
        all_reduce_after(target)
        count += 1
    return count


class ShardTensorParallelPass(KilnPass):
    name = "shard_tensor_parallel"
    # Last of the normalize phase: every later pass (paged_kv's KV-cache shape, the merges'
    # widths, the fusions) sees this rank's graph, as if the model were this small.
    phase = "normalize"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassStats:
        tp, rank = int(ctx.tp_size), int(ctx.tp_rank)
        if tp == 1:
            return {"tp_size": 1}
        if not 0 <= rank < tp:
            raise ValueError(f"shard_tensor_parallel: rank {rank} is outside [0, {tp})")
        check_tp_size(ctx.config, tp)
        plans = _LayerPlans(ctx.config, tp, rank)
        plan = plans.model
        from kiln.kernels.recurrent_states import recurrent_family, recurrent_layers

        recurrent = recurrent_layers(ctx.config)
        family = recurrent_family(ctx.config)
        gated_delta = _GatedDeltaPlan(ctx.config, tp, rank) if family == "gated_delta_net" else None
        short_convs = family == "short_conv"  # LFM2
        mamba2 = _Mamba2Plan(ctx.config, tp, rank) if family == "mamba2" else None
        mamba = _MambaPlan(ctx.config, tp, rank) if family == "mamba" else None
        mamba_layers = {f"layers.{i}." for i in recurrent} if mamba2 is not None or mamba is not None else set()
        model_type = str(getattr(ctx.config, "model_type", ""))
        graph = gm.graph
        shards: dict[str, ShardWeight] = {}
        new_shapes: dict[torch.fx.Node, list[int]] = {}

        def shard(param: torch.fx.Node, dim: int, ranges: list[tuple[int, int]], size: int) -> None:
            name = param_name(param)
            assert name is not None  # callers pass parameter placeholders only
            transform = ShardWeight(name=name, dim=dim, ranges=tuple(ranges), size=size)
            if shards.setdefault(name, transform) != transform:
                raise ValueError(f"shard_tensor_parallel: {name!r} is read by two ops that shard it differently")
            shape = list(param.meta["val"].shape)
            shape[dim] = size
            new_shapes[param] = shape

        def all_reduce_after(node: torch.fx.Node, bias: Any = None) -> None:
            with graph.inserting_after(node):
                reduced = graph.call_function(torch.ops.kiln.all_reduce.default, (node,))
            node.replace_all_uses_with(reduced, delete_user_cb=lambda user: user is not reduced)
            if bias is not None:
                with graph.inserting_after(reduced):
                    biased = graph.call_function(aten.add.Tensor, (reduced, bias))
                reduced.replace_all_uses_with(biased, delete_user_cb=lambda user: user is not biased)

        stats = {"column_parallel": 0, "row_parallel": 0, "vocab_parallel": 0, "experts_sharded": 0,
                 "all_reduce": 0, "all_gather": 0}
        lm_head = find_lm_head(gm)
        unknown: list[str] = []
        routers = router_projections(gm)
        for node in list(graph.find_nodes(op="call_function", target=aten.linear.default)):
            weight = node.args[1]
            name = param_name(weight)
            bias = node.args[2] if len(node.args) > 2 else None
            if name is None or node in routers:  # (routers: replicated, whatever their name)
                continue
            if node is lm_head:
                ranges, size = plan.vocab(weight.meta["val"].shape[0])
                shard(weight, 0, [ranges], size)
                if bias is not None:
                    shard(bias, 0, [ranges], size)
                vocab = weight.meta["val"].shape[0]
                with graph.inserting_after(node):
                    gathered = graph.call_function(torch.ops.kiln.all_gather.default, (node, -1, tp))
                with graph.inserting_after(gathered):
                    out = (graph.call_function(aten.slice.Tensor, (gathered, -1, 0, vocab))
                           if size * tp != vocab else gathered)
                node.replace_all_uses_with(out, delete_user_cb=lambda user: user not in (gathered, out))
                stats["vocab_parallel"] += 1
                stats["all_gather"] += 1
                continue
            module = _module_role(name, model_type)
            fused = _FUSED.get(model_type, {}).get(module)
            if gated_delta is not None and (module in _GATED_DELTA_COLUMN or ".linear_attn." in name
                                            and module in _GATED_DELTA_SEPARATE):
                ranges = gated_delta.rows(module, weight.meta["val"].shape[0], name)
                shard(weight, 0, ranges, sum(b - a for a, b in ranges))
                stats["column_parallel"] += 1
            elif gated_delta is not None and ".linear_attn." in name and module in ("out_proj", "o_proj"):
                cols = (gated_delta.v0 * gated_delta.head_v, gated_delta.v1 * gated_delta.head_v)
                shard(weight, 1, [cols], cols[1] - cols[0])
                all_reduce_after(node)
                stats["row_parallel"] += 1
                stats["all_reduce"] += 1
            elif short_convs and ".conv." in name and module in ("in_proj", "out_proj"):
                hidden = int(ctx.config.hidden_size)
                c0, c1 = plan.even(hidden, name)
                if module == "in_proj":  # [B; C; x]: the rank's channels of each
                    ranges = [(part * hidden + c0, part * hidden + c1) for part in range(3)]
                    shard(weight, 0, ranges, 3 * (c1 - c0))
                    if bias is not None:
                        shard(bias, 0, ranges, 3 * (c1 - c0))
                    stats["column_parallel"] += 1
                else:
                    shard(weight, 1, [(c0, c1)], c1 - c0)
                    if bias is not None:
                        node.args = node.args[:2]
                    all_reduce_after(node, bias)
                    stats["row_parallel"] += 1
                    stats["all_reduce"] += 1
            elif mamba2 is not None and module == "in_proj" and any(f".{m}" in f".{name}" for m in mamba_layers):
                ranges = mamba2.in_proj_rows()
                shard(weight, 0, ranges, sum(b - a for a, b in ranges))
                _slice_output_multiplier(graph, node, ranges, weight.meta["val"].shape[0])
                _remap_split(node, [mamba2.heads * mamba2.head_dim, mamba2.heads * mamba2.head_dim
                                    + 2 * mamba2.groups * mamba2.state, mamba2.heads],
                             [mamba2.local_heads * mamba2.head_dim, mamba2.local_heads * mamba2.head_dim
                              + 2 * mamba2.local_groups * mamba2.state, mamba2.local_heads])
                stats["column_parallel"] += 1
            elif mamba2 is not None and module == "out_proj" and any(f".{m}" in f".{name}" for m in mamba_layers):
                cols = (mamba2.h0 * mamba2.head_dim, mamba2.h1 * mamba2.head_dim)
                shard(weight, 1, [cols], cols[1] - cols[0])
                all_reduce_after(node)
                stats["row_parallel"] += 1
                stats["all_reduce"] += 1
            elif (mamba is not None and module in ("in_proj", "x_proj", "dt_proj", "out_proj")
                  and any(f".{m}" in f".{name}" for m in mamba_layers)):
                kind = self._shard_mamba_projection(node, module, mamba, shard, all_reduce_after)
                stats[kind] += 1
                stats["all_reduce"] += kind == "row_parallel"
            elif fused is not None:
                ranges, boundaries = plan.fused(fused, weight.meta["val"].shape[0], name)
                size = sum(b - a for a, b in ranges)
                shard(weight, 0, ranges, size)
                if bias is not None:
                    shard(bias, 0, ranges, size)
                _remap_slices(node, boundaries)
                stats["column_parallel"] += 1
            elif module in _COLUMN:
                kind = _COLUMN[module]
                layer_plan = plans.of_name(name)
                rows = (layer_plan.head_rows(weight.meta["val"].shape[0], name) if kind == "q"
                        else layer_plan.v if module == "v_proj" and layer_plan.v is not None
                        else layer_plan.kv if kind == "kv" else plan.even(weight.meta["val"].shape[0], name))
                shard(weight, 0, [rows], rows[1] - rows[0])
                if bias is not None:
                    shard(bias, 0, [rows], rows[1] - rows[0])
                stats["column_parallel"] += 1
            elif module in _ROW:
                cols = (plans.of_name(name).head_rows(weight.meta["val"].shape[1], name) if _ROW[module] == "q"
                        else plan.even(weight.meta["val"].shape[1], name))
                shard(weight, 1, [cols], cols[1] - cols[0])
                if bias is not None:
                    node.args = node.args[:2]
                all_reduce_after(node, bias)
                stats["row_parallel"] += 1
                stats["all_reduce"] += 1
            elif module not in _REPLICATED:
                unknown.append(name)
        for node in list(graph.find_nodes(op="call_function", target=aten.addmm.default)):
            kind = self._shard_conv1d(node, plan, model_type, shard, all_reduce_after)
            if kind is None:
                unknown.append(str(param_name(node.args[2])))
            elif kind:
                stats[kind] += 1
                stats["all_reduce"] += kind == "row_parallel"
        if model_type in _TRANSPOSED_MATMUL:
            for node in list(graph.find_nodes(op="call_function", target=aten.matmul.default)):
                kind = self._shard_transposed_matmul(node, plan, ctx.config, shard, all_reduce_after)
                if kind is None:
                    unknown.append(str(param_name(node.args[1].args[0])))
                elif kind:
                    stats[kind] += 1
                    stats["all_reduce"] += kind == "row_parallel"
        if unknown:
            raise ValueError(f"shard_tensor_parallel: no sharding rule for the projection(s) {', '.join(unknown[:4])}"
                             f"{' ...' if len(unknown) > 4 else ''}")
        for node in list(graph.find_nodes(op="call_function", target=aten.embedding.default)):
            weight = node.args[0]
            if param_name(weight) is None:
                continue
            (start, stop), size = plan.vocab(weight.meta["val"].shape[0])
            shard(weight, 0, [(start, stop)], size)
            all_reduce_after(self._mask_embedding(graph, node, start, stop))
            stats["vocab_parallel"] += 1
            stats["all_reduce"] += 1
        if model_type == "gpt_oss":
            stats["experts_sharded"] = self._shard_oai_experts(gm, plan, shard, all_reduce_after)
        else:
            stats["experts_sharded"] = self._shard_experts(gm, plan, shard, all_reduce_after,
                                                           transposed=model_type in _TRANSPOSED_EXPERTS)
        stats["all_reduce"] += stats["experts_sharded"]
        stats["wide_norms_sharded"] = self._shard_wide_norms(gm, plans, shard, ctx.config)
        stats["alibi_sliced"] = self._slice_alibi_slopes(gm, plan)
        stats["sinks_sharded"] = self._shard_sinks(gm, plan, shard)
        stats["per_head_vectors_sharded"] = self._shard_per_head_vectors(gm, plan, shard)
        stats["latent_up_projections_sharded"] = self._shard_latent_up_projections(gm, plan, shard)
        size_maps = plans.size_maps()
        if mamba2 is not None:
            stats["mamba2_mixers_sharded"] = self._shard_mamba2_mixers(gm, mamba2, shard)
        if mamba is not None:
            stats["mamba_mixers_sharded"] = self._shard_mamba_mixers(gm, mamba, shard)
        if short_convs:
            stats["short_convs_sharded"] = self._shard_short_convs(gm, plan.even(int(ctx.config.hidden_size), "hidden"),
                                                                   shard)
        recurrent_plan = gated_delta or mamba2
        if recurrent_plan is not None:
            if gated_delta is not None:
                stats["gated_delta_nets_sharded"] = self._shard_gated_delta_nets(gm, gated_delta, shard)
            for size_map in size_maps:
                for full, local in recurrent_plan.size_map().items():
                    if size_map.setdefault(full, local) != local:
                        raise ValueError(f"shard_tensor_parallel: a view of size {full} could be attention's (-> "
                                         f"{size_map[full]}) or the gated DeltaNet's (-> {local}); no rule tells "
                                         "them apart")
        stats["all_reduce"] += _reshape_params(gm, new_shapes, plans)
        ctx.weight_transforms.extend(shards.values())
        stats["weights_sharded"] = len(shards)
        return stats

    @staticmethod
    def _shard_conv1d(node: torch.fx.Node, plan: _Plan, model_type: str, shard: Any,
                      all_reduce_after: Any) -> str | None:
        """GPT-2's Conv1D: `addmm(bias, x.view(-1, in), W)` with W [in, out], the transpose of
        a linear's weight, and its output viewed back as `[..., out]`. Column-parallel (c_fc,
        the fused c_attn) keeps the rank's columns of W and of the bias, and the views that
        spell out the output width get the rank's; row-parallel (c_proj) keeps the rank's rows
        of W, becomes `mm` (the bias must be added once, after `kiln::all_reduce`), and the
        view that flattens its input gets the rank's width. Returns which kind it was, "" for
        an addmm that reads no parameter weight, None for a weight with no rule."""
        bias, x, weight = node.args[:3]
        name = param_name(weight)
        if name is None:
            return ""
        if len(node.args) > 3 or node.kwargs:
            raise ValueError(f"shard_tensor_parallel: {node.name} scales its addmm ({node.args[3:]}, {node.kwargs}); "
                             "only Conv1D's plain addmm(bias, x, W) has a sharding rule")
        if param_name(bias) is None:
            raise ValueError(f"shard_tensor_parallel: the bias of {name!r}'s addmm ({node.name}) is computed in the "
                             "graph, not a weight the rank can read a slice of")
        module = _module_role(name, model_type)
        in_full, out_full = (int(d) for d in weight.meta["val"].shape)
        fused = _FUSED.get(model_type, {}).get(module)
        if fused is not None or module in _COLUMN:
            if fused is not None:
                ranges, boundaries = plan.fused(fused, out_full, name)
            else:
                kind = _COLUMN[module]
                cols = plan.q if kind == "q" else plan.kv if kind == "kv" else plan.even(out_full, name)
                ranges, boundaries = [cols], {0: 0, out_full: cols[1] - cols[0]}
            size = sum(b - a for a, b in ranges)
            shard(weight, 1, ranges, size)  # W is [in, out]: the output features are its columns
            shard(bias, 0, ranges, size)
            _remap_slices(node, boundaries)
            return "column_parallel"
        if module in _ROW:
            rows = plan.q if _ROW[module] == "q" else plan.even(in_full, name)
            shard(weight, 0, [rows], rows[1] - rows[0])
            if x.target in _VIEWS and x.args[1][-1] == in_full:
                # `x.view(-1, in)`: the rank's input is only its part of the in features.
                x.args = (x.args[0], [*x.args[1][:-1], rows[1] - rows[0]], *x.args[2:])
                x.meta[_RESIZED] = True
            node.target, node.args = aten.mm.default, (x, weight)
            all_reduce_after(node, bias)
            return "row_parallel"
        return None if module not in _REPLICATED else ""

    @staticmethod
    def _shard_transposed_matmul(node: torch.fx.Node, plan: _Plan, config: Any, shard: Any,
                                 all_reduce_after: Any) -> str | None:
        """Falcon's FalconLinear: `matmul(x, W.T)` (W [out, in], as a linear's), then
        `+ bias` as a separate add. Column-parallel keeps the rank's rows of W and of the
        bias; query_key_value's layout depends on the config (`_falcon_qkv_layout`), and a
        view that splits its output into `[..., heads + 2, head_dim]` (multi-query) gets the
        rank's head count. Row-parallel keeps the rank's columns and all-reduces the matmul,
        so the add that follows adds the bias once. Returns which kind it was, "" for a
        matmul that reads no transposed parameter, None for a weight with no rule."""
        t = node.args[1]
        if not (isinstance(t, torch.fx.Node) and t.target in (aten.numpy_T.default, aten.t.default)):
            return ""
        weight = t.args[0]
        name = param_name(weight)
        if name is None or weight.meta["val"].dim() != 2:
            return ""
        module = _module_role(name, str(getattr(config, "model_type", "")))
        out_full = int(weight.meta["val"].shape[0])
        users = list(node.users)
        bias_add = users[0] if (len(users) == 1 and users[0].target == aten.add.Tensor
                                and users[0].args[0] is node and isinstance(users[0].args[1], torch.fx.Node)
                                and param_name(users[0].args[1]) is not None) else None
        if module == "query_key_value" or module in _COLUMN:
            if module == "query_key_value":
                ranges, _ = plan.fused(_falcon_qkv_layout(config), out_full, name)
            else:
                kind = _COLUMN[module]
                ranges = [plan.q if kind == "q" else plan.kv if kind == "kv" else plan.even(out_full, name)]
            size = sum(b - a for a, b in ranges)
            shard(weight, 0, ranges, size)
            if bias_add is not None:
                shard(bias_add.args[1], 0, ranges, size)
            out = bias_add or node
            for view in [u for u in out.users if u.target in _VIEWS]:
                shape = list(view.args[1])
                if (len(shape) >= 2 and shape[-1] == plan.head_dim and isinstance(shape[-2], int)
                        and shape[-2] * plan.head_dim == out_full):
                    # `view(..., heads + 2, head_dim)`: a head count that no -1 stands for.
                    view.args = (view.args[0], [*shape[:-2], size // plan.head_dim, shape[-1]], *view.args[2:])
                    view.meta[_RESIZED] = True
            return "column_parallel"
        if module in _ROW:
            cols = plan.q if _ROW[module] == "q" else plan.even(int(weight.meta["val"].shape[1]), name)
            shard(weight, 1, [cols], cols[1] - cols[0])
            all_reduce_after(node)  # before the bias add, which now reads the sum: added once
            return "row_parallel"
        return None if module not in _REPLICATED else ""

    @staticmethod
    def _mask_embedding(graph: torch.fx.Graph, node: torch.fx.Node, start: int, stop: int) -> torch.fx.Node:
        """embedding(w, ids) -> embedding(w_shard, owned ? ids - start : 0) * owned."""
        ids = node.args[1]
        with graph.inserting_before(node):
            ge = graph.call_function(aten.ge.Scalar, (ids, start))
            lt = graph.call_function(aten.lt.Scalar, (ids, stop))
            owned = graph.call_function(aten.logical_and.default, (ge, lt))
            shifted = graph.call_function(aten.sub.Tensor, (ids, start))
            local = graph.call_function(aten.mul.Tensor, (shifted, owned))
        node.args = (node.args[0], local)
        with graph.inserting_after(node):
            mask = graph.call_function(aten.unsqueeze.default, (owned, -1))
        with graph.inserting_after(mask):
            masked = graph.call_function(aten.mul.Tensor, (node, mask))
        node.replace_all_uses_with(masked, delete_user_cb=lambda user: user is not masked)
        return masked

    @staticmethod
    def _shard_experts(gm: torch.fx.GraphModule, plan: _Plan, shard: Any, all_reduce_after: Any,
                       transposed: bool = False) -> int:
        """Stacked experts: gate_up_proj [E, 2I, H] keeps each half's rows of this rank,
        down_proj [E, H, I] its columns (`transposed`: Llama 4's [E, in, out] experts,
        gate_up_proj [E, H, 2I] each half's columns, down_proj [E, I, H] its rows). What follows
        the down projection (routing weights, the sum over each token's experts, reshapes) is
        linear in it, so the all-reduce goes at the end of that chain, where the block's output
        meets the residual add (or a shared expert's, already reduced): one [T, H] message per
        layer rather than one per routed token."""
        out_dim, in_dim = (2, 1) if transposed else (1, 2)
        count = 0
        for node in gm.graph.find_nodes(op="placeholder"):
            name = param_name(node)
            match = _EXPERTS.search(name or "")
            if match is None:
                continue
            shape = node.meta["val"].shape
            if match.group(1) == "gate_up_proj":
                inter = shape[out_dim] // 2
                a, b = plan.even(inter, name)
                shard(node, out_dim, [(a, b), (inter + a, inter + b)], 2 * (b - a))
            elif match.group(1) == "up_proj":  # [E, I, H] without a gate
                a, b = plan.even(shape[out_dim], name)
                shard(node, out_dim, [(a, b)], b - a)
            else:
                a, b = plan.even(shape[in_dim], name)
                shard(node, in_dim, [(a, b)], b - a)
                count += _all_reduce_at_block_end(node, all_reduce_after,
                                                  _LLAMA4_BLOCK_END if transposed else _BLOCK_END)
        return count

    @staticmethod
    def _shard_oai_experts(gm: torch.fx.GraphModule, plan: _Plan, shard: Any, all_reduce_after: Any) -> int:
        """GPT-OSS's experts, [E, in, out] with gate and up channels alternating: gate_up_proj
        [E, H, 2I] (and its bias [E, 2I]) keeps the columns of this rank's channel pairs, one run;
        down_proj [E, I, H] its rows, all-reduced where the block ends as in `_shard_experts`.
        The down projection's bias [E, H] is added before the routing weights and the sum over a
        token's experts, which the all-reduce then adds up over the ranks: rank 0 keeps it, the
        others read zeros (a zero-padded empty shard), so it is added once."""
        count = 0
        for node in gm.graph.find_nodes(op="placeholder"):
            name = param_name(node)
            match = _OAI_EXPERTS.search(name or "")
            if match is None:
                continue
            shape = node.meta["val"].shape
            kind, is_bias = match.group(1), match.group(2) is not None
            if kind == "gate_up_proj":
                a, b = plan.even(shape[-1] // 2, name)
                shard(node, len(shape) - 1, [(2 * a, 2 * b)], 2 * (b - a))
            elif is_bias:
                shard(node, 1, [(0, shape[1] if plan.rank == 0 else 0)], shape[1])
            else:
                a, b = plan.even(shape[1], name)
                shard(node, 1, [(a, b)], b - a)
                count += _all_reduce_at_block_end(node, all_reduce_after)
        return count

    @staticmethod
    def _shard_latent_up_projections(gm: torch.fx.GraphModule, plan: _Plan, shard: Any) -> int:
        """Multi-head latent attention cached as its latent (kiln.compiler.capture's
        `_latent_attention`): kv_b_proj is no linear but a per-head [k_nope; v] weight read by
        `view(-1, ...)` into the queries and outputs; each rank reads its heads' rows, and the
        latent (one KV head) is replicated."""
        count = 0
        for node in gm.graph.find_nodes(op="placeholder"):
            name = param_name(node)
            if (name is None or not name.endswith(".kv_b_proj.weight")
                    or any(u.target == aten.linear.default for u in node.users)):
                continue
            (a, b) = plan.head_rows(int(node.meta["val"].shape[0]), name)
            shard(node, 0, [(a, b)], b - a)
            count += 1
        return count

    @staticmethod
    def _shard_per_head_vectors(gm: torch.fx.GraphModule, plan: _Plan, shard: Any) -> int:
        """Parameters of one value per query head read outside a projection (`_PER_HEAD_VECTORS`:
        Beam's attention-gate bias, added to its gate's logits by heads): the rank's heads'."""
        h0, h1 = plan.heads
        count = 0
        for node in gm.graph.find_nodes(op="placeholder"):
            name = param_name(node)
            if name is None or name.rsplit(".", 1)[-1] not in _PER_HEAD_VECTORS:
                continue
            if tuple(node.meta["val"].shape) != (plan.num_heads,):
                raise ValueError(f"shard_tensor_parallel: {name} {tuple(node.meta['val'].shape)} is not one value "
                                 f"per query head ({plan.num_heads})")
            shard(node, 0, [(h0, h1)], h1 - h0)
            count += 1
        return count

    @staticmethod
    def _shard_sinks(gm: torch.fx.GraphModule, plan: _Plan, shard: Any) -> int:
        """Attention sinks (GPT-OSS): a parameter of one logit per query head; each rank reads
        its heads' (the attention markers carry them as `sinks`)."""
        h0, h1 = plan.heads
        count = 0
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.attention.default):
            sinks = node.kwargs.get("sinks")
            if isinstance(sinks, torch.fx.Node) and param_name(sinks) is not None:
                shard(sinks, 0, [(h0, h1)], h1 - h0)
                count += 1
        return count

    @staticmethod
    def _shard_gated_delta_nets(gm: torch.fx.GraphModule, plan: _GatedDeltaPlan, shard: Any) -> int:
        """Each `kiln::gated_delta_net` marker: the rank's channels of the convolution (whose
        weight the marker reads through a view), its value heads' A_log and dt_bias, and its
        key-head count."""
        count = 0
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.gated_delta_net.default):
            conv, a_log, dt_bias = _param_behind_views(node.args[3]), node.args[4], node.args[5]
            for param, ranges in ((conv, plan.qkv()), (a_log, [(plan.v0, plan.v1)]), (dt_bias, [(plan.v0, plan.v1)])):
                if not isinstance(param, torch.fx.Node) or param_name(param) is None:
                    raise ValueError(f"shard_tensor_parallel: {node.name} reads a convolution weight, A_log or "
                                     "dt_bias that is no checkpoint weight")
                shard(param, 0, ranges, sum(b - a for a, b in ranges))
            node.args = (*node.args[:7], plan.local_k, *node.args[8:])
            count += 1
        return count

    @staticmethod
    def _shard_short_convs(gm: torch.fx.GraphModule, channels: tuple[int, int], shard: Any) -> int:
        """Each `kiln::short_conv` marker (LFM2): the rank's channels of the convolution's
        weight and bias."""
        count = 0
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.short_conv.default):
            weight, bias = _param_behind_views(node.args[1]), node.args[2]
            for param in (weight, bias):
                if param is None:
                    continue
                if not isinstance(param, torch.fx.Node) or param_name(param) is None:
                    raise ValueError(f"shard_tensor_parallel: {node.name} reads a convolution weight or bias that is "
                                     "no checkpoint weight")
                shard(param, 0, [channels], channels[1] - channels[0])
            count += 1
        return count

    @staticmethod
    def _shard_mamba_projection(node: torch.fx.Node, module: str, plan: _MambaPlan, shard: Any,
                                all_reduce_after: Any) -> str:
        """A Mamba mixer's projection over the rank's channels [c0, c1): in_proj's rows of x and
        of z, dt_proj's rows (its bias is the scan's dt_bias); x_proj and out_proj read the
        rank's channels, so their partial products are all-reduced (x_proj's: dt, B and C are
        every channel's, each rank then has all of them)."""
        weight = node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        (c0, c1), width = plan.channels, plan.local
        if module in ("in_proj", "dt_proj"):
            ranges = [(c0, c1), (plan.full + c0, plan.full + c1)] if module == "in_proj" else [(c0, c1)]
            shard(weight, 0, ranges, width * len(ranges))
            if bias is not None:
                shard(bias, 0, ranges, width * len(ranges))
            return "column_parallel"
        shard(weight, 1, [(c0, c1)], width)
        if bias is not None:
            node.args = node.args[:2]
        all_reduce_after(node, bias)
        return "row_parallel"

    @staticmethod
    def _shard_mamba_mixers(gm: torch.fx.GraphModule, plan: _MambaPlan, shard: Any) -> int:
        """Each Mamba mixer's markers: the rank's channels of the convolution's weight and bias
        (`kiln::short_conv`) and of the scan's A_log, D and dt_bias (`kiln::selective_scan`)."""
        count = 0
        channels = [plan.channels]
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.short_conv.default):
            for param in (_param_behind_views(node.args[1]), node.args[2]):
                if param is not None:
                    if not isinstance(param, torch.fx.Node) or param_name(param) is None:
                        raise ValueError(f"shard_tensor_parallel: {node.name} reads a convolution weight or bias that "
                                         "is no checkpoint weight")
                    shard(param, 0, channels, plan.local)
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.selective_scan.default):
            for param in node.args[5:8]:
                if not isinstance(param, torch.fx.Node) or param_name(param) is None:
                    raise ValueError(f"shard_tensor_parallel: {node.name} reads an A_log, D or dt_bias that is no "
                                     "checkpoint weight")
                shard(param, 0, channels, plan.local)
            count += 1
        return count

    @staticmethod
    def _shard_mamba2_mixers(gm: torch.fx.GraphModule, plan: _Mamba2Plan, shard: Any) -> int:
        """Each `kiln::mamba2_scan` marker: the rank's channels of the convolution (weight and
        bias), its heads' A_log, D and dt_bias, its head and group counts; and the gated norm
        after it (its weight's rows of the rank's heads)."""
        count = 0
        heads = [(plan.h0, plan.h1)]
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.mamba2_scan.default):
            conv = _param_behind_views(node.args[2])
            sharded = [(conv, plan.channels()), (node.args[4], heads), (node.args[5], heads), (node.args[6], heads)]
            if node.args[3] is not None:
                sharded.append((node.args[3], plan.channels()))
            for param, ranges in sharded:
                if not isinstance(param, torch.fx.Node) or param_name(param) is None:
                    raise ValueError(f"shard_tensor_parallel: {node.name} reads a convolution weight or bias, A_log, D "
                                     "or dt_bias that is no checkpoint weight")
                shard(param, 0, ranges, sum(b - a for a, b in ranges))
            node.args = (*node.args[:8], plan.local_heads, node.args[9], plan.local_groups, *node.args[11:])
            # The gated norm after the scan: a weight of one entry per head_dim row of every head.
            norm = _norm_weight_after(node)
            if norm is not None:
                shard(norm, 0, [(plan.h0 * plan.head_dim, plan.h1 * plan.head_dim)],
                      plan.local_heads * plan.head_dim)
            count += 1
        return count

    @staticmethod
    def _slice_alibi_slopes(gm: torch.fx.GraphModule, plan: _Plan) -> int:
        """ALiBi (Bloom, MPT): one slope per query head, a constant graph input computed at
        capture for all heads. Each rank's attention gets the slopes of its heads, sliced in
        the graph (the input stays whole, so its binding does not depend on the rank)."""
        sliced: dict[torch.fx.Node, torch.fx.Node] = {}
        h0, h1 = plan.heads
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.attention.default):
            slopes = node.args[7] if len(node.args) > 7 else node.kwargs.get("alibi_slopes")
            if not isinstance(slopes, torch.fx.Node):
                continue
            if slopes not in sliced:
                with gm.graph.inserting_before(node):  # the first attention that reads them
                    sliced[slopes] = gm.graph.call_function(aten.slice.Tensor, (slopes, 0, h0, h1))
            if len(node.args) > 7:
                node.args = (*node.args[:7], sliced[slopes], *node.args[8:])
            else:
                node.kwargs = {**node.kwargs, "alibi_slopes": sliced[slopes]}
        return len(sliced)

    @staticmethod
    def _shard_wide_norms(gm: torch.fx.GraphModule, plans: _LayerPlans, shard: Any, config: Any) -> int:
        """Norm weights as wide as all heads (OLMo2's q_norm over num_heads * head_dim,
        BitNet's sub-norms over the attention output and the MLP's intermediate dimension):
        the rank keeps the slice its sharded activations meet. Per-head norms ([head_dim])
        stay whole. The mean of squares they divide by is made global in `_reshape_params`."""
        count = 0
        for node in gm.graph.find_nodes(op="placeholder"):
            name = param_name(node)
            if name is None or name.count(".") < 1:
                continue
            kind = _WIDE_NORMS.get(name.rsplit(".", 2)[-2])
            val = node.meta.get("val")
            if kind is None or not isinstance(val, torch.Tensor) or val.dim() != 1:
                continue
            plan = plans.of_name(name)
            if kind == "mlp":
                if val.shape[0] != getattr(config, "intermediate_size", None):
                    continue
                rows = plan.even(val.shape[0], name)
            else:
                rows = plan.q if kind == "q" else plan.kv
                if val.shape[0] != plan.full_width[kind] or plan.full_width[kind] == plan.head_dim:
                    continue  # per head (one KV head's is both): every rank's heads use the whole weight
                if kind == "kv" and plan.kv_replicated:
                    raise ValueError(f"shard_tensor_parallel: {name!r} normalizes over all {plan.kv_heads} KV "
                                     f"heads at once, and tp={plan.tp} replicates them (a global sum of squares "
                                     "would count a head once per rank); use a tensor_parallel_size that divides "
                                     "the KV heads")
            shard(node, 0, [rows], rows[1] - rows[0])
            count += 1
        return count


def _falcon_qkv_layout(config: Any) -> str:
    """Falcon's query_key_value layout (FalconAttention._split_heads): multi-query is
    [q; k; v] with one K/V head (replicated on every rank), otherwise per head
    [q_h; k_h; v_h]. The grouped layout (new_decoder_architecture) is refused in
    check_tp_size."""
    return "qkv" if getattr(config, "multi_query", False) else "heads3"


def _remap_slices(linear: torch.fx.Node, boundaries: dict[int, int]) -> None:
    """The slices and splits that cut a fused projection's output into its parts (Phi-3's
    `qkv[..., :q_width]`, GPT-BigCode's `split([q_width, kv_width, kv_width])`, seen through
    an unsqueeze) cut at full-model offsets: move each to the rank's. A cut at an offset
    that is no part boundary is an error."""
    width = max(boundaries, default=0)

    def moved(b: int, user: torch.fx.Node) -> int:
        if b not in boundaries:
            raise ValueError(f"shard_tensor_parallel: {user.name} cuts the fused {linear.name} at {b}, which is no "
                             f"boundary between its parts ({sorted(boundaries)})")
        return boundaries[b]

    frontier = [linear]
    while frontier:
        node = frontier.pop()
        last = node.meta["val"].dim() - 1
        for user in list(node.users):  # (setting a user's args re-registers it in node.users)
            if user.target == aten.unsqueeze.default and user.args[1] % (last + 2) != last + 1:
                frontier.append(user)  # the fused dimension stays last
            elif user.target == aten.slice.Tensor and user.args[1] % (last + 1) == last:
                # An open end (past the whole width) stays: the rank's width ends it.
                bounds = [b if b is None or b > width else moved(b, user) for b in user.args[2:4]]
                user.args = (user.args[0], user.args[1], *bounds, *user.args[4:])
            elif user.target in _VIEWS and user.args[1][-1] in (width, -1) \
                    and user.meta["val"].shape[-1] == width == node.meta["val"].shape[-1]:
                # Conv1D's `view(out, [..., out_width])`: only the leading dimensions change.
                if user.args[1][-1] == width:
                    user.args = (user.args[0], [*user.args[1][:-1], boundaries[width]], *user.args[2:])
                    user.meta[_RESIZED] = True
                frontier.append(user)
            elif (user.target == aten.split.Tensor
                  and (user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)) % (last + 1) == last):
                # GPT-2's `split(hidden, dim=2)`: equal parts, which on the rank may still be equal.
                step = user.args[1]
                cuts = [*range(0, width, step), width]
                rank_cuts = [moved(c, user) for c in cuts]
                sizes = [b - a for a, b in zip(rank_cuts, rank_cuts[1:])]
                if len(set(sizes)) == 1:
                    user.args = (user.args[0], sizes[0], *user.args[2:])
                else:
                    user.target, user.args = aten.split_with_sizes.default, (user.args[0], sizes, *user.args[2:])
            elif (user.target == aten.split_with_sizes.default and len(user.args) > 2
                  and user.args[2] % (last + 1) == last):
                cuts = [sum(user.args[1][:i]) for i in range(len(user.args[1]) + 1)]
                rank_cuts = [moved(c, user) for c in cuts]
                user.args = (user.args[0], [b - a for a, b in zip(rank_cuts, rank_cuts[1:])], *user.args[2:])


_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# Marks a view whose last dimension the pass has set to the rank's width itself (Conv1D's):
# the check that a view changed only head counts and their widths does not apply to it.
_RESIZED = "tp_resized_view"
# Norm modules whose weight may span all heads (or the whole intermediate dimension): which
# rows of it a rank keeps, as for the projections ("q", "kv", "mlp").
_WIDE_NORMS = {"q_norm": "q", "k_norm": "kv", "attn_sub_norm": "q", "ffn_sub_norm": "mlp"}
# Reductions a rank cannot compute alone over a sharded dimension; mean is rewritten (a sum,
# all-reduced, over the full count), these are refused.
_PARTIAL_REDUCTIONS = {aten.sum.dim_IntList, aten.var.correction, aten.var_mean.correction, aten.amax.default,
                       aten._softmax.default, aten.native_layer_norm.default}
# Standard deviations over a sharded dimension: rewritten from all-reduced sums (`_global_std`;
# Gemma 3n's activation sparsity, a cutoff at mean + k std over the MLP's intermediate channels).
_STD = {aten.std.dim, aten.std.correction}


def _reshape_params(gm: torch.fx.GraphModule, new_shapes: dict[torch.fx.Node, list[int]], plans: _LayerPlans) -> int:
    """Give the sharded inputs their new fake values and recompute every node's (so that
    later passes see the rank's shapes). A view that spells out a full-model size (StableLM's
    `view(1, T, num_heads, head_dim)`) gets the rank's, one dimension tried at a time; a mean
    over a dimension the rank holds part of (the RMS of a norm over all heads) becomes a sum,
    `kiln::all_reduce`d, over the full count; any other node whose shape arithmetic cannot
    follow, or another reduction over a sharded dimension, is an error naming it. The sizes a
    view may spell out are its layer's (`_LayerPlans.size_map_of`). Returns the number of
    all-reduces added."""
    from torch._guards import detect_fake_mode

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    mode = detect_fake_mode([n.meta.get("val") for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)])
    if mode is None:
        raise ValueError("shard_tensor_parallel: the graph's inputs carry no fake values to propagate shapes with")
    full_vals = {node: node.meta.get("val") for node in gm.graph.nodes}
    reduced = 0
    # Only what the sharded inputs reach is recomputed: re-running the rest (DeepSeek-V2's
    # complex-valued RoPE) could add a guard that pins the symbolic token count to its example
    # value, and every later shape would come out fixed.
    reached: set[torch.fx.Node] = set(new_shapes)
    combined: set[torch.fx.Node] = set()  # `_global_std`'s nodes: their reductions are already global
    with mode:
        for node, shape in new_shapes.items():
            old = node.meta["val"]
            node.meta["val"] = torch.empty(shape, dtype=old.dtype, device=old.device)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if "val" in node.meta and not any(a in reached for a in node.all_input_nodes):
                continue
            reached.add(node)
            old = node.meta.get("val")
            size_map = plans.size_map_of(node)
            shrunk = {} if node in combined else _shrunk_reduced_dims(node, full_vals)
            if shrunk and node.target == aten.mean.dim:
                _global_mean(gm.graph, node, shrunk, plans.of_node(node))
                reduced += 1
            elif shrunk and node.target in _STD:
                combined.update(_global_std(gm.graph, node, shrunk))
                reduced += 2
            elif shrunk and node.target in _PARTIAL_REDUCTIONS:
                raise ValueError(f"shard_tensor_parallel: node {node.name} ({node.target}) reduces over a dimension "
                                 f"each rank holds only part of ({shrunk}); no rule combines it across ranks")
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
            try:
                node.meta["val"] = (_padded(*args) if node.target in _PADS else node.target(*args, **kwargs))
            except Exception as e:
                if not ((node.target in _VIEWS and _fix_view(node, args, old, size_map))
                        or (node.target in _SIZES_ARG and _fix_sizes(node, args, size_map))):
                    raise ValueError(f"shard_tensor_parallel: node {node.name} ({node.target}) cannot take the "
                                     f"sharded shapes: {e}") from e
                continue
            # A view that spells out the head count and puts -1 on the tokens (OPT's
            # `view(1, -1, num_heads, head_dim)`) does not fail on the rank's smaller input:
            # it silently halves the tokens. Its other dimensions must keep their values. Only
            # where no spelled-out count can be given the rank's may a -1 standing for a fixed
            # size (Falcon's heads in transformers 5.25, `view(1, T, -1, head_dim)`) follow the
            # rank's input: a bucket exported at a static token count has a fixed size there too.
            if (node.target in _VIEWS and isinstance(old, torch.Tensor) and not node.meta.pop(_RESIZED, False)
                    and not _view_takes_rank_shapes(node, args, old, size_map)):
                raise ValueError(f"shard_tensor_parallel: view {node.name} {list(node.args[1])} cannot take the "
                                 f"sharded shapes (it gives {tuple(node.meta['val'].shape)})")
    gm.recompile()
    return reduced


def _shrunk_reduced_dims(node: torch.fx.Node, full_vals: dict[torch.fx.Node, Any]) -> dict[int, int]:
    """For a reduction (its input, then its dims), the reduced dimensions whose size the
    sharding changed -> their full-model size. Empty for anything else."""
    if (node.target not in _PARTIAL_REDUCTIONS and node.target != aten.mean.dim and node.target not in _STD) \
            or not node.args \
            or not isinstance(node.args[0], torch.fx.Node):
        return {}
    x = node.args[0]
    full, now = full_vals.get(x), x.meta.get("val")
    if not isinstance(full, torch.Tensor) or not isinstance(now, torch.Tensor) or full.dim() != now.dim():
        return {}
    if node.target == aten.native_layer_norm.default:
        dims: Any = range(full.dim() - len(node.args[1]), full.dim())
    elif node.target == aten._softmax.default:
        dims = [node.args[1]]
    else:
        dims = node.args[1] if len(node.args) > 1 and node.args[1] is not None else range(full.dim())
        dims = [dims] if isinstance(dims, int) else dims
    out = {}
    for d in dims:
        d = d % full.dim()
        if not _same_dim(full.shape[d], now.shape[d]) and isinstance(full.shape[d], int):
            out[d] = full.shape[d]
    return out


def _global_mean(graph: torch.fx.Graph, node: torch.fx.Node, shrunk: dict[int, int], plan: _Plan) -> None:
    """mean(x, dims) over a sharded dimension -> all_reduce(sum(x, dims)) / full count: the
    mean each rank would get from the whole tensor (OLMo2's q/k RMS over all heads). Rewritten
    in place, so the recomputation that follows gives the new nodes their values."""
    if any(size == plan.full_width["kv"] and plan.kv_replicated for size in shrunk.values()):
        raise ValueError(f"shard_tensor_parallel: node {node.name} averages over all KV heads, which tp={plan.tp} "
                         "replicates (the all-reduced sum would count a head once per rank)")
    x, dims = node.args[0], node.args[1]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    rank = x.meta["val"].dim()
    full_count = 1
    for d in ([dims] if isinstance(dims, int) else dims):
        full_count *= shrunk.get(d % rank) or int(x.meta["val"].shape[d % rank])
    node.target = aten.sum.dim_IntList
    node.args = (x, dims, keepdim)
    node.kwargs = {k: v for k, v in node.kwargs.items() if k == "dtype"}
    with graph.inserting_after(node):
        summed = graph.call_function(torch.ops.kiln.all_reduce.default, (node,))
    with graph.inserting_after(summed):
        mean = graph.call_function(aten.div.Tensor, (summed, full_count))
    node.replace_all_uses_with(mean, delete_user_cb=lambda user: user is not summed)


# Padding ops, whose fake implementations pin a symbolic token count to its example value (a
# guard): their output's shape is computed here instead (MiMo-V2-Flash's values padded to the
# keys' width for the attention op).
_PADS = {aten.pad.default, aten.constant_pad_nd.default}


def _padded(x: torch.Tensor, pad: list[int], *_: Any) -> torch.Tensor:
    """A fake value of `x` padded by `pad` (before and after, last dimension first)."""
    shape = list(x.shape)
    for i in range(len(pad) // 2):
        shape[-1 - i] = shape[-1 - i] + pad[2 * i] + pad[2 * i + 1]
    return x.new_empty(shape)


def _global_std(graph: torch.fx.Graph, node: torch.fx.Node, shrunk: dict[int, int]) -> list[torch.fx.Node]:
    """std(x, dims) over a sharded dimension -> from the all-reduced sums of x and of x * x
    over the full count n: sqrt((S2 - S1^2 / n) / (n - correction)), in float32 (the sums of a
    16-bit x would round away the difference). Rewritten in place, as `_global_mean`; returns
    the nodes added after it."""
    x, dims = node.args[0], node.args[1] if len(node.args) > 1 else None
    if node.target == aten.std.dim:
        correction = 1 if (node.args[2] if len(node.args) > 2 else node.kwargs.get("unbiased", True)) else 0
        keepdim = node.args[3] if len(node.args) > 3 else node.kwargs.get("keepdim", False)
    else:
        correction = node.kwargs.get("correction")
        correction = 1 if correction is None else correction
        keepdim = node.kwargs.get("keepdim", False)
    rank = x.meta["val"].dim()
    dims = list(range(rank)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    count = 1
    for d in dims:
        count *= shrunk.get(d % rank) or int(x.meta["val"].shape[d % rank])
    dtype = x.meta["val"].dtype
    created: list[torch.fx.Node] = []

    def then(target: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        with graph.inserting_after(created[-1] if created else node):
            created.append(graph.call_function(target, args, kwargs))
        return created[-1]

    # The node itself becomes x in float32; the rest follows it, so the recomputation after
    # this gives every new node its value in order.
    node.target, node.args, node.kwargs = aten._to_copy.default, (x,), {"dtype": torch.float32}
    s1 = then(torch.ops.kiln.all_reduce.default, then(aten.sum.dim_IntList, node, dims, True))
    s2 = then(torch.ops.kiln.all_reduce.default, then(aten.sum.dim_IntList, then(aten.mul.Tensor, node, node), dims, True))
    centred = then(aten.sub.Tensor, s2, then(aten.div.Tensor, then(aten.mul.Tensor, s1, s1), count))
    var = then(aten.clamp_min.default, then(aten.div.Tensor, centred, max(count - correction, 1)), 0.0)
    out = then(aten._to_copy.default, then(aten.sqrt.default, var), dtype=dtype)
    if not keepdim:
        out = then(aten.squeeze.dims, out, dims)
    node.replace_all_uses_with(out, delete_user_cb=lambda user: user not in created)
    return created


def _same_dim(a: Any, b: Any) -> bool:
    """Whether two sizes are the same: equal ints, or symbolic sizes of the same expression
    (compared structurally: `==` on SymInts would add a guard)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def _keeps_unsharded_dims(old: torch.Tensor, new: torch.Tensor, size_map: dict[int, int],
                          free: frozenset[int] = frozenset()) -> bool:
    """Whether `new` (a view's value on the rank's shapes) differs from `old` (on the full
    model's) only in dimensions that were full-model sizes (head counts, their widths), or
    in the dimensions `free` may change."""
    if old.dim() != new.dim():
        return False
    return all(i in free or _same_dim(a, b) or (isinstance(a, int) and a in size_map and _same_dim(size_map[a], b))
               for i, (a, b) in enumerate(zip(old.shape, new.shape)))


def _view_takes_rank_shapes(node: torch.fx.Node, args: tuple[Any, ...], old: torch.Tensor,
                            size_map: dict[int, int]) -> bool:
    """Whether a view that ran on the rank's input (value in node.meta) is right there, or
    can be made so by giving one spelled-out count the rank's (then rewritten in place)."""
    return (_keeps_unsharded_dims(old, node.meta["val"], size_map)
            or _fix_view(node, args, old, size_map)
            or _keeps_unsharded_dims(old, node.meta["val"], size_map, _inferred_fixed_dims(node, old))
            or _merges_leading_dims(node, args))


def _merges_leading_dims(node: torch.fx.Node, args: tuple[Any, ...]) -> bool:
    """Whether the view only merges its input's leading dimensions into its -1 and keeps its
    last ones, or cuts the last one into rows of one spelled-out width that divides the rank's
    (OLMo Hybrid's per-head gated norm: `reshape(-1, head_dim)` over [.., heads, head_dim] and
    over the gate's [.., heads * head_dim]). A rank's slice of that dimension is one run at a
    multiple of its width, so every row stays one of the full model's rows: a smaller -1 is the
    rank's (tokens times its heads), never fewer tokens. (A width the rank's does not divide,
    a full row spelled over the rank's half, is refused.)"""
    shape = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else None
    source = args[0] if args else None
    if not shape or shape[0] != -1 or not isinstance(source, torch.Tensor) or len(shape) > source.dim():
        return False
    kept = list(shape[1:])
    if not all(isinstance(d, int) and d > 0 for d in kept):
        return False
    if kept == list(source.shape[source.dim() - len(kept):]):
        return True
    last = source.shape[-1]
    return len(kept) == 1 and isinstance(last, int) and last % kept[0] == 0


def _inferred_fixed_dims(node: torch.fx.Node, old: torch.Tensor) -> frozenset[int]:
    """The dimensions a view leaves to -1 where the full model's size there is a fixed
    number (not the token count, a symbol): they follow the sharded input."""
    shape = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], (list, tuple)) else ()
    return frozenset(i for i, d in enumerate(shape)
                     if isinstance(d, int) and d == -1 and i < old.dim() and isinstance(old.shape[i], int))


# Ops that take a list of sizes, by the position of that list: a full-model count in it
# (Falcon's `split([num_heads, 1, 1])` of its multi-query heads, Falcon-RW's
# `unflatten(-2, (num_heads, 3))`, both in transformers 5.25) becomes the rank's.
_SIZES_ARG = {aten.split_with_sizes.default: 1, aten.unflatten.int: 2}


def _fix_sizes(node: torch.fx.Node, args: tuple[Any, ...], size_map: dict[int, int]) -> bool:
    """Give an op of `_SIZES_ARG` the rank's counts where its sizes spell full-model ones,
    if it then takes the rank's input."""
    at = _SIZES_ARG[node.target]
    sizes = list(node.args[at])
    trial = [size_map.get(d, d) if isinstance(d, int) else d for d in sizes]
    if trial == sizes:
        return False
    try:
        val = node.target(*args[:at], trial, *args[at + 1:])
    except Exception:
        return False
    node.args = (*node.args[:at], trial, *node.args[at + 1:])
    node.meta["val"] = val
    return True


def _fix_view(node: torch.fx.Node, args: tuple[Any, ...], old: Any, size_map: dict[int, int]) -> bool:
    """Rewrite one literal dimension of a view to the rank's size, if one works: the view
    then runs and (where the full-model value is known) keeps every other dimension."""
    shape = list(node.args[1])
    for i, dim in enumerate(shape):
        if isinstance(dim, int) and dim in size_map:
            trial = shape[:i] + [size_map[dim]] + shape[i + 1:]
            fake_trial = list(args[1])
            fake_trial[i] = size_map[dim]
            try:
                val = node.target(args[0], fake_trial)
            except Exception:
                continue
            if isinstance(old, torch.Tensor) and not _keeps_unsharded_dims(old, val, size_map):
                continue
            node.args = (node.args[0], trial, *node.args[2:])
            node.meta["val"] = val
            return True
    return False



def _param_behind_views(node: Any) -> Any:
    """The parameter a recurrent marker reads through views (a convolution's weight squeezed to
    [channels, kernel]), or `node` itself when there is none to walk back to."""
    while isinstance(node, torch.fx.Node) and param_name(node) is None and node.all_input_nodes:
        node = node.args[0]
    return node


def _remap_split(node: torch.fx.Node, full: list[int], local: list[int]) -> None:
    """The `split_with_sizes` of a projection's output into its parts (Mamba2's in_proj: gate,
    x B C, dt), given the rank's sizes."""
    frontier = list(node.users)
    while frontier:
        user = frontier.pop()
        if user.target in (aten.select.int, aten.squeeze.dim, aten.view.default, aten.reshape.default,
                           aten.mul.Tensor):
            # (the step's one sequence taken out of the batch dim; Falcon-H1's multiplier)
            frontier.extend(user.users)
        elif user.target is aten.split_with_sizes.default and list(user.args[1]) == full:
            user.args = (user.args[0], local, *user.args[2:])


def _slice_output_multiplier(graph: torch.fx.Graph, node: torch.fx.Node, ranges: list[tuple[int, int]],
                             full: int) -> None:
    """A constant multiplied into a column-parallel projection's whole output (Falcon-H1's
    `mup_vector` over in_proj's [gate; x B C; dt]): the rank's `ranges` of it, sliced in the
    graph (the input stays whole, so its binding does not depend on the rank)."""
    for user in list(node.users):
        if user.target is not aten.mul.Tensor:
            continue
        for i, arg in enumerate(user.args):
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) and arg is not node else None
            if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.shape[-1] != full:
                continue
            with graph.inserting_before(user):
                parts = [graph.call_function(aten.slice.Tensor, (arg, -1, a, b)) for a, b in ranges]
                sliced = parts[0] if len(parts) == 1 else graph.call_function(aten.cat.default, (parts, -1))
            user.args = (*user.args[:i], sliced, *user.args[i + 1:])


def _norm_weight_after(scan: torch.fx.Node) -> torch.fx.Node | None:
    """The weight parameter of the gated norm a Mamba2 scan's output goes through: the first
    parameter multiplied in along the single-use chain after it (views, casts, the gate)."""
    seen: set[torch.fx.Node] = set()
    frontier = list(scan.users)
    while frontier:
        node = frontier.pop(0)
        if node in seen or node.op != "call_function":
            continue
        seen.add(node)
        if node.target is aten.mul.Tensor:
            for arg in node.args:
                if isinstance(arg, torch.fx.Node) and param_name(arg) is not None:
                    return arg
        if node.target is aten.linear.default:
            return None  # out_proj: past the norm
        frontier.extend(node.users)
    return None
