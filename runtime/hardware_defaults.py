"""Engine limits the user left unset, chosen from the hardware (as vLLM's `LLM` does).

- `max_num_seqs` / `max_num_batched_tokens`: on a GPU of at least 70 GiB (H100, H200,
  MI300), 1,024 sequences and 16,384 tokens per step; on smaller GPUs 256 and 8,192 (vLLM's
  offline defaults for the same two classes); on CPU 64 and 2,048 (Kiln's defaults, sized
  for the C++ backend). A value the user set always wins.
- `max_model_len`: the model's own context length, as long as one sequence of it fits in the
  KV cache; otherwise what the cache holds (and the reason is logged). A length the user set
  that the cache cannot hold is an error that says how much fits.

The choices are pure functions of the device's memory, so they are tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

GIB = 2**30
LARGE_GPU_BYTES = 70 * GIB

# (max_num_seqs, max_num_batched_tokens) per device class.
LARGE_GPU_LIMITS = (1024, 16384)
GPU_LIMITS = (256, 8192)
CPU_LIMITS = (64, 2048)
# When a config names no context length at all.
FALLBACK_CONTEXT = 4096
# Config fields that hold a model's context length, most common first (GPT-2's n_positions is
# aliased to max_position_embeddings by its attribute_map; MPT says max_seq_len).
_CONTEXT_FIELDS = ("max_position_embeddings", "max_seq_len", "seq_length", "max_sequence_length", "n_ctx")


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    reason: str  # why these values (logged at start-up)


def default_batch_limits(device_type: str, device_memory_bytes: int | None) -> tuple[int, int, str]:
    """(max_num_seqs, max_num_batched_tokens, why) for a device of this type and memory."""
    if device_type != "cuda":
        return (*CPU_LIMITS, f"{device_type} defaults")
    if device_memory_bytes is None:
        raise ValueError("default_batch_limits: a CUDA device's memory is needed to choose its defaults")
    gib = device_memory_bytes / GIB
    if device_memory_bytes >= LARGE_GPU_BYTES:
        return (*LARGE_GPU_LIMITS, f"GPU with {gib:.0f} GiB (>= 70 GiB)")
    return (*GPU_LIMITS, f"GPU with {gib:.0f} GiB (< 70 GiB)")


def choose_batch_limits(max_num_seqs: int | None, max_num_batched_tokens: int | None, device_type: str,
                        device_memory_bytes: int | None) -> BatchLimits:
    """The engine's batch limits: the user's where set, the device's defaults elsewhere."""
    if max_num_seqs is not None and max_num_batched_tokens is not None:
        return BatchLimits(int(max_num_seqs), int(max_num_batched_tokens), "set explicitly")
    seqs, tokens, why = default_batch_limits(device_type, device_memory_bytes)
    defaulted = [name for name, given in (("max_num_seqs", max_num_seqs),
                                          ("max_num_batched_tokens", max_num_batched_tokens)) if given is None]
    return BatchLimits(int(max_num_seqs) if max_num_seqs is not None else seqs,
                       int(max_num_batched_tokens) if max_num_batched_tokens is not None else tokens,
                       f"{' and '.join(defaulted)} from the device: {why}")


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device; None for other devices."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


def model_context_length(model_config: Any) -> int | None:
    """The longest sequence the model was built for, from its config; None if it names none."""
    for name in _CONTEXT_FIELDS:
        value = getattr(model_config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def choose_max_model_len(explicit: int | None, model_context: int | None, kv_capacity_tokens: int,
                         block_size: int) -> tuple[int, str]:
    """(max_model_len, why): the user's value, or the model's context if one sequence of it
    fits in the KV cache (`kv_capacity_tokens`), else the most the cache holds, in whole
    blocks. Raises ValueError when the user's value does not fit."""
    if explicit is not None:
        if explicit > kv_capacity_tokens:
            raise ValueError(
                f"max_model_len={explicit} does not fit in the KV cache ({kv_capacity_tokens} tokens): lower "
                "max_model_len, raise gpu_memory_utilization or num_kv_blocks, or lower max_num_batched_tokens")
        return int(explicit), "set explicitly"
    context = model_context or FALLBACK_CONTEXT
    source = "the model's context length" if model_context else f"no context length in the config: {FALLBACK_CONTEXT}"
    if context <= kv_capacity_tokens:
        return int(context), source
    fits = kv_capacity_tokens // block_size * block_size
    if fits < 1:
        raise ValueError(f"the KV cache holds {kv_capacity_tokens} tokens, less than one block of {block_size}")
    return int(fits), (f"{source} ({context}) does not fit in the KV cache; lowered to the {fits} tokens one "
                       "sequence can use (raise gpu_memory_utilization or lower max_num_seqs for more)")
