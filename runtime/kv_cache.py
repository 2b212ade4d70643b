"""Start-up's KV-cache work: size the paged KV cache from memory, allocate it, and pick the
decode batch sizes to capture as CUDA graphs. The engine calls `build_kv_cache` once; the
per-step loop (kiln.runtime.engine) never comes here.

On CUDA, the largest step the engine may run (max_num_batched_tokens tokens, one prefill) is
profiled first with a one-block cache: every token writes to the null slot and attends over
the null block, so the probe needs no real cache, and the activations it measures are a
real step's. The KV cache then gets what is left of `gpu_memory_utilization` after the
weights, that peak, and a reserve for the CUDA graphs' pool. On CPU it gets a fixed share of
RAM.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kiln.compiler.buckets import BucketPlan, mixed_graph_sizes
from kiln.compiler.graph_inputs import StepInputs, single_prefill_step
from kiln.kernels.recurrent_states import RECURRENT_ONLY_KINDS, allocate_state_caches, layer_kinds, state_bytes_per_slot
from kiln.kernels.paged_attention import caches_latent, kv_heads_and_head_dim, kv_planes, kv_sharing
from kiln.runtime.config import EngineConfig

logger = logging.getLogger("kiln.runtime")

# KV-cache budget on CPU when the caller gives no num_kv_blocks: a fraction of RAM.
CPU_KV_MEMORY_FRACTION = 0.2
# CUDA: memory kept back from the KV cache for the CUDA graphs' pool and fragmentation.
CUDA_RESERVE_BYTES = 512 * 2**20
# Recurrent layers' states (per sequence, not per token) take at most this share of the memory
# left after the weights; the rest goes to the KV cache and the activations.
STATE_MEMORY_SHARE = 0.5


@dataclass
class KVCache:
    """The allocated cache: one tensor per layer, [planes, num_blocks, block_size, kv_heads, head_dim]
    (planes: K and V, or a latent's one, `kv_planes`; an empty one for a recurrent layer), and
    the recurrent layers' state caches by name ("<layer>.conv", ...: kiln.kernels.gated_delta_net),
    max_num_seqs + 1 rows each (row 0 the null slot)."""

    layers: list[torch.Tensor]
    num_blocks: int
    activation_peak_bytes: int  # profiled on CUDA; 0 on CPU or when num_kv_blocks was given
    states: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_state_slots(self) -> int:
        return next(iter(self.states.values())).shape[0] if self.states else 0


# Layer kinds without a KV cache: recurrent ones (not Falcon-H1's "hybrid", attention beside a
# Mamba2 mixer), and Nemotron-H's MLP-only and MoE-only blocks.
_NO_KV_KINDS = RECURRENT_ONLY_KINDS | {"mlp", "moe"}


def attention_layers(model_config: Any) -> list[int]:
    """The layers with a KV cache: all of them but a hybrid model's recurrent ones (and blocks
    without attention)."""
    kinds = layer_kinds(model_config)
    return [i for i in range(model_config.num_hidden_layers) if i >= len(kinds) or kinds[i] not in _NO_KV_KINDS]


def cache_layers(model_config: Any) -> list[int]:
    """The layers with a cache of their own: the attention layers but those that read another
    layer's (`kv_sharing`: Gemma 4's last layers)."""
    shared = kv_sharing(model_config)
    return [i for i in attention_layers(model_config) if i not in shared]


def kv_layer_shapes(model_config: Any, tp_size: int = 1) -> dict[int, tuple[int, int]]:
    """(KV heads, head_dim) of each attention layer (on one rank of `tp_size`); layers may
    differ (Gemma 4's global layers: `layer_config`)."""
    return {i: kv_heads_and_head_dim(model_config, tp_size, i) for i in attention_layers(model_config)}


def kv_bytes_per_token(model_config: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of K and V per token over all layers (on one rank of `tp_size`)."""
    elem = torch.empty((), dtype=dtype).element_size()
    shapes = kv_layer_shapes(model_config, tp_size)
    values = sum(heads * dim for heads, dim in (shapes[i] for i in cache_layers(model_config)))
    return kv_planes(model_config) * values * elem


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device, planes: int = 2, without: Collection[int] = (),
    layer_shapes: dict[int, tuple[int, int]] | None = None,
) -> list[torch.Tensor]:
    """One cache per layer, of `layer_shapes[layer]` (KV heads, head_dim) where given, else
    `num_kv_heads` x `head_dim`; the layers in `without` (recurrent ones, those that read
    another layer's cache) get an empty one."""
    caches = []
    for layer in range(num_layers):
        heads, dim = (layer_shapes or {}).get(layer, (num_kv_heads, head_dim))
        if layer in without:
            caches.append(torch.empty((planes, 0, block_size, heads, dim), dtype=dtype, device=device))
            continue
        # Uninitialised: attention only reads slots a sequence has written. The null block
        # (padding's target) is zeroed so padded rows never see NaN garbage.
        cache = torch.empty((planes, num_blocks, block_size, heads, dim), dtype=dtype, device=device)
        cache[:, 0].zero_()
        caches.append(cache)
    return caches


def profile_step(num_tokens: int, block_size: int, max_model_len: int, device: torch.device | str = "cpu"
                 ) -> StepInputs:
    """The step memory profiling runs: `num_tokens` tokens, K/V to the null block. Positions
    wrap at max_model_len: a step that large is several sequences, and a model with learned
    absolute positions (GPT-2, GPT-BigCode) has no embedding past its context length."""
    inputs = single_prefill_step(num_tokens, block_size, null_blocks=True, device=device)
    inputs["position_ids"] = inputs["position_ids"] % max_model_len
    return inputs


@torch.inference_mode()
def profile_step_memory(runner: Any, num_tokens: int, block_size: int, max_model_len: int) -> int:
    """Peak bytes a step of `num_tokens` tokens (`profile_step`) allocates beyond what is
    held. `runner` is a ModelRunner over a one-block cache."""
    dev = runner.device
    inputs = profile_step(num_tokens, block_size, max_model_len, dev)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    runner.execute(inputs)
    torch.cuda.synchronize(dev)
    return torch.cuda.max_memory_allocated(dev) - before


@torch.inference_mode()
def run_token_buckets(runner: Any, plan: BucketPlan, block_size: int, max_model_len: int) -> None:
    """Run every token bucket of `plan` once (a `profile_step` of its size: K/V to the null
    block), so that every kernel variant those steps use has run: what taking a setup's Triton
    kernels into the cache needs (kiln.compiler.triton_kernels). Decode buckets run when their
    CUDA graphs are captured."""
    for bucket in plan.buckets():
        if bucket.kind != "decode":
            runner.execute(profile_step(bucket.num_tokens, block_size, max_model_len, runner.device))
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


def num_kv_blocks(config: EngineConfig, model_config: Any, dtype: torch.dtype, device: torch.device,
                  max_model_len: int, activation_peak_bytes: int) -> int:
    """Blocks for max_num_seqs sequences of max_model_len, capped by what memory holds."""
    bs = config.block_size
    if config.num_kv_blocks is not None:
        return int(config.num_kv_blocks)
    per_block = kv_bytes_per_token(model_config, dtype, config.tensor_parallel_size) * bs
    wanted = -(-config.max_num_seqs * max_model_len // bs) + 1
    if per_block == 0:  # no attention layer (Mamba): blocks only count tokens, they hold no memory
        return max(2, wanted)
    if device.type == "cpu":
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        fit = int(ram * CPU_KV_MEMORY_FRACTION) // per_block
    else:
        _, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization)
        free_for_kv = budget - torch.cuda.memory_allocated(device) - activation_peak_bytes - CUDA_RESERVE_BYTES
        fit = free_for_kv // per_block
        if fit < 2:
            raise ValueError(
                f"no GPU memory left for the KV cache at gpu_memory_utilization={config.gpu_memory_utilization}: "
                f"weights and a {config.max_num_batched_tokens}-token step already take it; lower "
                "max_num_batched_tokens or raise gpu_memory_utilization"
            )
        logger.info("KV cache: %d blocks (%d tokens) fit in %.1f GiB (activation peak %.2f GiB)",
                    min(wanted, fit), min(wanted, fit) * bs, free_for_kv / 2**30, activation_peak_bytes / 2**30)
    return max(2, min(wanted, fit))


def allocate_kv_cache(config: EngineConfig, model_config: Any, num_blocks: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    """`num_blocks` blocks per layer with a cache of its own, of this rank's KV heads (tensor
    parallelism: its share)."""
    owning = cache_layers(model_config)
    # Every attention layer's own shape, the empty caches of those that share one's too.
    shapes = kv_layer_shapes(model_config, config.tensor_parallel_size)
    kv_heads, head_dim = next(iter(shapes.values()), (0, 0))  # recurrent layers' empty caches
    return allocate_kv_caches(model_config.num_hidden_layers, num_blocks, config.block_size, kv_heads, head_dim,
                              dtype, device, kv_planes(model_config),
                              without=set(range(model_config.num_hidden_layers)) - set(owning), layer_shapes=shapes)


def state_slots_that_fit(max_num_seqs: int, bytes_per_slot: int, free_bytes: int) -> int:
    """State-cache rows for `max_num_seqs` sequences plus the null slot, fewer when they would
    take more than STATE_MEMORY_SHARE of `free_bytes` (the rest stays for the KV cache and the
    activations). Raises ValueError when not even one sequence's states fit."""
    fit = int(free_bytes * STATE_MEMORY_SHARE) // max(1, bytes_per_slot)
    if fit < 2:
        raise ValueError(f"no memory for one sequence's recurrent states ({bytes_per_slot / 2**20:.1f} MiB) in "
                         f"{STATE_MEMORY_SHARE:.0%} of the {free_bytes / 2**30:.2f} GiB left after the weights; "
                         "raise gpu_memory_utilization or use a smaller model")
    return min(max_num_seqs + 1, fit)


def allocate_states(config: EngineConfig, model_config: Any, dtype: torch.dtype, device: torch.device
                    ) -> dict[str, torch.Tensor]:
    """The recurrent layers' state caches, one row per sequence the engine may run plus the null
    slot ({} for a model without recurrent layers). States keep the model's dtype (the conv
    inputs) and float32 (the recurrent state), whatever the KV cache's dtype. Where
    max_num_seqs sequences' states would take more than STATE_MEMORY_SHARE of the memory left
    (Qwen3-Next-80B: ~74 MiB a sequence, 75 GiB for 1,024), fewer rows are allocated and the
    engine runs fewer sequences at once (`KVCache.num_state_slots`; logged)."""
    tp_size = config.tensor_parallel_size
    per_slot = state_bytes_per_slot(model_config, dtype, tp_size)
    if not per_slot:
        return {}
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        free = int(total * config.gpu_memory_utilization) - torch.cuda.memory_allocated(device) - CUDA_RESERVE_BYTES
    else:
        free = int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_KV_MEMORY_FRACTION)
    slots = state_slots_that_fit(config.max_num_seqs, per_slot, free)
    states = allocate_state_caches(model_config, slots, dtype, device, tp_size)
    logger.info("recurrent states: %d layers, %.1f MiB a sequence, %d sequences (%.2f GiB)%s",
                len(states) // 2, per_slot / 2**20, slots - 1, per_slot * slots / 2**30,
                "" if slots == config.max_num_seqs + 1 else
                f": max_num_seqs {config.max_num_seqs} lowered, their states would take more than "
                f"{STATE_MEMORY_SHARE:.0%} of the memory left")
    return states


def size_kv_cache(config: EngineConfig, model_config: Any, dtype: torch.dtype, device: torch.device,
                  max_model_len: int, make_runner: Callable[..., Any],
                  states: dict[str, torch.Tensor] | None = None) -> tuple[int, int]:
    """(blocks that fit, profiled activation peak bytes): profiling a probe runner from
    `make_runner(kv_caches, states)` on CUDA (with the recurrent `states`, already allocated,
    whose null slot the probe writes). A tensor-parallel worker reports its count and the
    engine gives every rank the smallest (kiln.runtime.tp_executor)."""
    peak = 0
    if device.type == "cuda" and config.num_kv_blocks is None:
        probe = make_runner(allocate_kv_cache(config, model_config, 1, dtype, device), states or {})
        peak = profile_step_memory(probe, config.max_num_batched_tokens, config.block_size, max_model_len)
        del probe
        torch.cuda.empty_cache()
    return num_kv_blocks(config, model_config, dtype, device, max_model_len, peak), peak


def build_kv_cache(config: EngineConfig, model_config: Any, dtype: torch.dtype, device: torch.device,
                   max_model_len: int, make_runner: Callable[..., Any],
                   state_dtype: torch.dtype | None = None) -> KVCache:
    """Allocate the recurrent states (in `state_dtype`, default `dtype`), then size (profiling
    a probe runner from `make_runner` on CUDA) and allocate the KV cache in what is left."""
    states = allocate_states(config, model_config, state_dtype or dtype, device)
    blocks, peak = size_kv_cache(config, model_config, dtype, device, max_model_len, make_runner, states)
    if caches_latent(model_config):
        logger.info("KV cache: multi-head latent attention cached as its latent (one head of %d values a token)",
                    kv_heads_and_head_dim(model_config)[1])
    return KVCache(layers=allocate_kv_cache(config, model_config, blocks, dtype, device), num_blocks=blocks,
                   activation_peak_bytes=peak, states=states)


def cuda_graph_sizes(plan: BucketPlan) -> list[int]:
    """Decode batch sizes to capture: the plan's decode buckets."""
    return sorted({b.num_seqs for b in plan.buckets() if b.kind == "decode"})


def mixed_graph_token_sizes(config: EngineConfig, plan: BucketPlan, has_states: bool) -> list[int]:
    """Token counts of the mixed-step graphs to capture (kiln.compiler.buckets.mixed_graph_sizes,
    up to `config.cuda_graph_mixed_tokens` and the step budget); none for models with
    recurrent layers, whose mixed steps read the chunks' lengths on the host
    (kiln.kernels.recurrent_steps), which no graph can."""
    if has_states:
        return []
    return mixed_graph_sizes(min(config.cuda_graph_mixed_tokens, plan.max_num_batched_tokens))
