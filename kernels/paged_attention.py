"""`kiln::paged_attention`: write this step's K/V into the paged cache, then attend.

One call serves any mix of sequences in one step: whole prefills, prefill chunks that
continue a cached prefix, and single-token decodes. The step's tokens are packed
(token-major, no padding between sequences).

Shapes and meaning (B sequences, T tokens in the step):
  q            [T, Hq, D]    queries of the step's tokens
  k, v         [T, Hkv, D]   keys/values of the step's tokens, written to the cache
  kv_cache     [2, num_blocks, block_size, Hkv, D]  this layer's cache (0 = K, 1 = V); mutated.
               A latent cache (multi-head latent attention, `caches_latent`) has one plane,
               [1, ...], which is read as both K and V (its k and v are the same tensor)
  slot_mapping [T] int64     flat cache slot (block * block_size + offset) of each token;
                             padded tokens point at the null block 0, which no sequence owns
  block_tables [B, max_blocks] int32  the blocks of each sequence, in order
  seq_lens     [B] int32     tokens in each sequence's context after this step (cached + new)
  query_start_loc [B+1] int32 offsets of each sequence's tokens in q (cumulative)
  scale        softmax scale; sliding_window > 0 limits attention to the last N positions,
               < 0 to the query's own chunk of -N positions (`kiln.kernels.attention`);
  softcap      > 0: logits capped as softcap * tanh(logits / softcap) (Gemma 2); 0 = off.
  alibi_slopes [Hq] float32 or None: ALiBi, slope[h] * (k_pos - q_pos) added to the logits
               (positions within the sequence), as in `kiln.kernels.attention`.
  kv_scale     [2] float32 or None: the FP8 cache's per-layer scales (k_scale, v_scale). The
               write stores k / k_scale and v / v_scale in e4m3 (saturating at +-448), the
               read multiplies by them, so values far from e4m3's range (which is fixed:
               normal numbers from 2^-6 to 448) are stored near it (a one-plane cache, whose
               values are its keys, reads both with k_scale). None: scale 1. Read from
               the checkpoint or 1.0 (kiln.passes.kv_cache_scales); a tensor, not a float,
               so an artifact serves any checkpoint's scales.
  sinks        [Hq] or None, keyword-only: attention sinks (GPT-OSS), one more logit per
               head in every query's softmax, with no value (`kiln.kernels.attention`).
Returns [T, Hq, D]; rows of padded tokens (past query_start_loc[-1]) are zero.

The CPU reference below is plain torch with a Python loop over sequences; the CUDA
implementation (Triton) is registered by `kiln.kernels.triton_paged_attention` when
Triton and a GPU are present.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from pathlib import Path
from typing import Any, Iterator

import torch

from kiln.kernels.attention import causal_attention
from kiln.kernels.library import kiln_op


def is_latent_attention(config: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash): K and V of each
    head are expanded from a shared latent, with head sizes of their own."""
    return all(isinstance(getattr(config, a, None), int)
               for a in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))


# MLA architectures whose latent cache (absorbed attention, kiln.compiler.capture) is tested
# against Hugging Face (tests/test_parity.py). Other MLA models cache K and V expanded.
LATENT_CACHE_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "glm4_moe_lite"})


def caches_latent(config: Any) -> bool:
    """Whether `config`'s multi-head latent attention is cached as its latent: one KV "head"
    of kv_lora_rank + qk_rope_head_dim values a token (576 for DeepSeek-V2/V3, against 16-128
    heads of 2 x 192 expanded), with kv_b_proj absorbed into the query and the output.

    Needs transformers' `expand_kv` (the expansion isolated in a method, transformers PR
    47460, so that engines can skip it): with an older transformers the expanded cache stays."""
    model_type = getattr(config, "model_type", None)
    return (is_latent_attention(config) and model_type in LATENT_CACHE_MODEL_TYPES
            and _attention_expands_kv_apart(model_type))


@functools.lru_cache(maxsize=None)
def _attention_expands_kv_apart(model_type: str) -> bool:
    """Whether transformers' modeling file for `model_type` defines a method `expand_kv`. Read
    as text, not imported: importing it takes seconds, and a warm start needs nothing else from
    it (it sizes the KV cache from this). Capture then finds the method on the modules."""
    try:
        spec = importlib.util.find_spec(f"transformers.models.{model_type}.modeling_{model_type}")
        source = Path(spec.origin).read_text() if spec is not None and spec.origin else ""
    except (ImportError, ValueError, OSError):
        return False
    return re.search(r"^\s+def expand_kv\(", source, re.MULTILINE) is not None


def layer_config(config: Any, layer: int) -> Any:
    """Layer `layer`'s view of `config`. transformers' heterogeneous configs (`per_layer_config`:
    Gemma 4's full-attention layers have a head_dim and KV heads of their own) give each layer
    its own and refuse to say the model-wide value of a field that differs between layers; any
    other config is every layer's."""
    if getattr(config, "is_heterogeneous", False):
        return config.per_layer_config[layer]
    return config


def kv_sharing(config: Any) -> dict[int, int]:
    """Layers that attend over another layer's K and V instead of their own (Gemma 3n's and
    Gemma 4's `num_kv_shared_layers`, the last layers of the model), each mapped to the layer
    whose cache it reads: the last layer of its kind (windowed or global) before the shared
    ones, as transformers' `kv_sharing_modes` picks it. Such a layer has no K/V projections
    and no cache of its own."""
    shared = int(getattr(config, "num_kv_shared_layers", 0) or 0)
    if shared <= 0:
        return {}
    layers = int(config.num_hidden_layers)
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    first = layers - shared
    producers = {kind: i for i, kind in enumerate(kinds[:first])}  # the last of each kind wins
    missing = sorted({kinds[i] for i in range(first, layers)} - set(producers))
    if missing:
        raise ValueError(f"config shares K/V across its last {shared} layers, but no earlier layer of kind "
                         f"{', '.join(missing)} has a cache to share")
    return {i: producers[kinds[i]] for i in range(first, layers)}


# Architectures whose windowed layers have twice the config's KV heads: their attention module
# says so (`num_key_value_heads * 2 if is_swa`), their config does not.
_DOUBLE_WINDOWED_KV_HEADS = frozenset({"mimo_v2_flash"})


def _doubles_windowed_kv_heads(config: Any, layer: int) -> bool:
    kinds = getattr(config, "layer_types", None) or []
    return (getattr(config, "model_type", None) in _DOUBLE_WINDOWED_KV_HEADS and layer < len(kinds)
            and kinds[layer] == "sliding_attention")


def kv_heads_and_head_dim(config: Any, tp_size: int = 1, layer: int | None = None) -> tuple[int, int]:
    """A Hugging Face config's KV heads and head size (of `layer`, where layers differ:
    `layer_config`; a heterogeneous config's model-wide values raise).

    GQA configs name the KV heads (`num_key_value_heads`); multi-query configs that predate
    that name set a flag instead (GPT-BigCode's `multi_query`: one KV head); otherwise every
    query head has its own. Configs without `head_dim` split hidden_size evenly across the
    attention heads. The paged-KV pass checks the result against each layer's traced k.

    With `tp_size` > 1, the KV heads of one rank of a tensor-parallel group: its share, or
    one (replicated) when there are fewer KV heads than ranks (kiln.passes.shard_tensor_parallel)."""
    doubled = layer is not None and _doubles_windowed_kv_heads(config, layer)
    if layer is not None:
        config = layer_config(config, layer)
    if getattr(config, "num_attention_heads", None) is None:
        return 0, 0  # no attention at all (Mamba, Falcon-Mamba): an empty KV cache
    heads = getattr(config, "num_key_value_heads", None)
    if heads is None and getattr(config, "multi_query", False):
        heads = 1
    heads = int(heads or config.num_attention_heads) * (2 if doubled else 1)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    if caches_latent(config):
        # The latent (kv_lora_rank) and the shared RoPE key, one "head" that every query head
        # reads (`caches_latent`).
        heads, head_dim = 1, int(config.kv_lora_rank + config.qk_rope_head_dim)
    elif is_latent_attention(config):
        # DeepSeek-V2/V3's K per head is qk_nope + qk_rope dims, V v_head_dim: both cached at
        # the larger (capture pads the other with zeros); its `head_dim` is the RoPE part's.
        # Every query head gets its own K and V from the latent, whatever num_key_value_heads says.
        heads = int(config.num_attention_heads)
        head_dim = max(config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim)
    elif isinstance(getattr(config, "v_head_dim", None), int):
        # Values narrower or wider than the keys (MiMo-V2-Flash: 192 and 128): both cached at the larger.
        head_dim = max(head_dim, int(config.v_head_dim))
    if tp_size > 1:
        heads = heads // tp_size if heads >= tp_size else 1
    return heads, head_dim


def kv_planes(config: Any) -> int:
    """Planes of `config`'s cache: K and V (2), or the latent alone (1), which attention reads
    as both (its V plane would repeat it)."""
    return 1 if caches_latent(config) else 2


def kv_cache_shape(config: Any, num_blocks: int, block_size: int, tp_size: int = 1,
                   layer: int | None = None) -> tuple[int, ...]:
    """Layer `layer`'s cache for `config` (one rank's of `tp_size`): [planes, num_blocks, block_size,
    kv_heads, head_dim], planes 2 (K, V) or 1 (`kv_planes`)."""
    return (kv_planes(config), num_blocks, block_size, *kv_heads_and_head_dim(config, tp_size, layer))


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x as the cache stores it: for an FP8 (e4m3) cache x / scale (scale: a one-element
    float32 tensor, None for 1), saturating at +-448 instead of turning an outlier into NaN
    (torch's cast does not saturate; the Triton kernels' does)."""
    if cache_dtype == torch.float8_e4m3fn:
        limit = torch.finfo(cache_dtype).max
        xf = x.float() if scale is None else x.float() / scale.float()
        return xf.clamp(-limit, limit).to(cache_dtype)
    return x.to(cache_dtype)


def check_kv_scale(kv_scale: torch.Tensor | None, kv_cache: torch.Tensor) -> None:
    """ValueError unless kv_scale is None or [2] float32 on the cache's device."""
    if kv_scale is None:
        return
    if tuple(kv_scale.shape) != (2,) or kv_scale.dtype != torch.float32 or kv_scale.device != kv_cache.device:
        raise ValueError(f"paged_attention: kv_scale must be [2] float32 (k_scale, v_scale) on {kv_cache.device}, "
                         f"got {tuple(kv_scale.shape)} {kv_scale.dtype} on {kv_scale.device}")


# KV-scale calibration (kiln.runtime.kv_scale_calibration): while a recorder is active, every
# cache write of a scaled (FP8) cache records its K and V absolute maxima before they are
# divided and cast, keyed by the data pointer of the layer's `kv_scale` tensor (the graph
# input the calibration then overwrites in place). A module-level hook rather than an op
# argument: the compiled artifacts stay the ones every run uses, and the CPU reference and
# the Triton writer (which both call `record_kv_amax`) see the K the op writes (after RoPE
# and any K norm in rope_paged_attention).
_amax_recorder: dict[int, torch.Tensor] | None = None


@contextlib.contextmanager
def recording_kv_amax() -> Iterator[dict[int, torch.Tensor]]:
    """Within the block, cache writes that carry a `kv_scale` record amax(|K|), amax(|V|)
    (float32 [2], running maxima) by `kv_scale.data_ptr()` into the dict yielded."""
    global _amax_recorder
    if _amax_recorder is not None:
        raise RuntimeError("recording_kv_amax: a recording is already active")
    _amax_recorder = {}
    try:
        yield _amax_recorder
    finally:
        _amax_recorder = None


def kv_amax_recording() -> bool:
    """Whether start-up's KV-scale calibration is recording (`recording_kv_amax`)."""
    return _amax_recorder is not None


def record_kv_amax(k: torch.Tensor, v: torch.Tensor, kv_scale: torch.Tensor | None, slot_mapping: torch.Tensor,
                   block_size: int) -> None:
    """Record this write's K/V maxima if a recording is active (a no-op otherwise, and for
    an unscaled cache: only FP8 caches have scales to calibrate). Rows bound for the null
    block (slots below `block_size`: a bucket's padding, token 0 at position 0) are left
    out: they are not the calibration text's."""
    if _amax_recorder is None or kv_scale is None:
        return
    real = slot_mapping[: k.shape[0]] >= block_size
    if not bool(real.any()):
        return
    amax = torch.stack([k.detach()[real].abs().amax().float(), v.detach()[real].abs().amax().float()])
    key = kv_scale.data_ptr()
    seen = _amax_recorder.get(key)
    _amax_recorder[key] = amax if seen is None else torch.maximum(seen, amax)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   kv_scale: torch.Tensor | None = None) -> None:
    """Scatter the step's K/V rows into their cache slots (in place); an FP8 cache stores
    them divided by `kv_scale` ([2]: k_scale, v_scale; None: 1)."""
    if kv_cache.element_size() == 1:
        record_kv_amax(k, v, kv_scale, slot_mapping, kv_cache.shape[2])
    planes, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(planes, num_blocks * block_size, hkv, d)  # (one plane: v is k, written once)
    if kv_cache.element_size() == 1:
        # index_copy_ has no FP8 kernel: copy the bytes.
        k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[1])
        flat = flat.view(torch.uint8)
        flat[0].index_copy_(0, slot_mapping, to_cache_dtype(k, kv_cache.dtype, k_scale).view(torch.uint8))
        if planes == 2:
            flat[1].index_copy_(0, slot_mapping, to_cache_dtype(v, kv_cache.dtype, v_scale).view(torch.uint8))
        return
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    if planes == 2:
        flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def read_kv_cache(cache: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached K or V rows in `dtype`; an FP8 cache's values times its scale (None: 1)."""
    if cache.element_size() == 1 and scale is not None:
        return (cache.float() * scale.float()).to(dtype)
    return cache.to(dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    check_kv_scale(kv_scale, kv_cache)
    write_kv_cache(k, v, kv_cache, slot_mapping, kv_scale)
    block_size = kv_cache.shape[2]
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        n_new = q_end - q_start
        if n_new == 0 or seq_len == 0:
            continue
        n_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :n_blocks].long()
        # An FP8 cache is read back in the query's dtype, times its scales.
        # (A one-plane cache holds keys only, stored with k_scale: its values are those keys.)
        k_scale, v_scale = (None, None) if kv_scale is None else (kv_scale[0], kv_scale[kv_cache.shape[0] - 1])
        keys = read_kv_cache(kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len], k_scale, q.dtype)
        values = read_kv_cache(kv_cache[-1, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len], v_scale, q.dtype)
        positions = torch.arange(seq_len, device=q.device)
        out[q_start:q_end] = causal_attention(
            q[q_start:q_end], keys, values, scale, sliding_window,
            q_positions=positions[seq_len - n_new:], k_positions=positions, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks,
        )
    return out


@kiln_op("kiln::paged_attention", mutates_args=("kv_cache",))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    return paged_attention_reference(
        q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
        alibi_slopes, kv_scale, sinks,
    )


@paged_attention.register_fake
def _paged_attention_fake(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                          softcap=0.0, alibi_slopes=None, kv_scale=None, *, sinks=None):
    return torch.empty_like(q)
