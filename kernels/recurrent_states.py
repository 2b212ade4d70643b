"""The recurrent layers' state caches: which layers keep states, their shapes, their memory.

A model's recurrent layers are of one family (`recurrent_family`): gated DeltaNet (Qwen3-Next,
Qwen3.5: the config names `linear_num_key_heads`), Mamba2 (Granite 4.0-H, Nemotron-H, Bamba:
`mamba_*` sizes), Mamba's selective scan (Mamba, Falcon-Mamba: `time_step_rank`; Jamba:
`mamba_dt_rank`) or LFM2's short convolutions (`conv_L_cache`). Each layer keeps, per sequence,
"<layer>.conv" (its convolution's last inputs, in the model's dtype) and, but for LFM2's,
"<layer>.recurrent" (float32), allocated as caches with one row per state slot
(kiln.runtime.block_manager). The graph's `state:<layer>.<part>` inputs are these.
"""

from __future__ import annotations

from typing import Any

import torch

# Layer kinds that keep recurrent states, by config's `layer_types` / `layers_block_type`
# (transformers 5.25 calls Mamba layers "linear_attention" too).
# Falcon-H1's "hybrid" layers run attention and a Mamba2 mixer side by side: states and a KV cache.
RECURRENT_KINDS = frozenset({"linear_attention", "mamba", "mamba2", "conv", "hybrid"})  # (conv: LFM2's short convolutions)
# Recurrent kinds that have no attention beside them.
RECURRENT_ONLY_KINDS = RECURRENT_KINDS - {"hybrid"}
# Mamba2 sizes: the first attribute of each tuple the config has.
# (Mamba2's own config names them plainly; a hybrid's `head_dim` is its attention's, so the
# plain names come last.)
_MAMBA2_SIZES = {
    "heads": ("mamba_n_heads", "mamba_num_heads", "num_heads"),
    "head_dim": ("mamba_d_head", "mamba_head_dim", "head_dim"),
    "state": ("mamba_d_state", "ssm_state_size", "state_size"),
    "kernel": ("mamba_d_conv", "conv_kernel"),
    "groups": ("mamba_n_groups", "n_groups"),
}


def layer_kinds(config: Any) -> list[str]:
    return list(getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or [])


def recurrent_layers(config: Any) -> list[int]:
    return [i for i, kind in enumerate(layer_kinds(config)) if kind in RECURRENT_KINDS]


def attention_free(config: Any) -> bool:
    """Whether every layer is recurrent with no attention beside it (Mamba, Falcon-Mamba, Mamba2)."""
    kinds = layer_kinds(config)
    return len(kinds) == int(config.num_hidden_layers) and all(kind in RECURRENT_ONLY_KINDS for kind in kinds)


def recurrent_family(config: Any) -> str | None:
    """"gated_delta_net", "mamba2", "mamba" (the selective scan), "short_conv" (LFM2), or None
    for a model without recurrent layers."""
    if not recurrent_layers(config):
        return None
    if getattr(config, "conv_L_cache", None) is not None:
        return "short_conv"
    if getattr(config, "linear_num_key_heads", None) is not None:
        return "gated_delta_net"
    if any(getattr(config, name, None) is not None for name in _MAMBA2_SIZES["heads"]):
        return "mamba2"  # (Mamba2's config has a time_step_rank too, unused)
    if getattr(config, "time_step_rank", None) is not None or getattr(config, "mamba_dt_rank", None) is not None:
        return "mamba"
    return "mamba2"


def mamba_sizes(config: Any) -> tuple[int, int, int]:
    """A Mamba (selective-scan) config's (intermediate channels, state size, conv kernel)."""
    if getattr(config, "mamba_dt_rank", None) is not None:  # Jamba: `intermediate_size` is its MLPs'
        return int(config.mamba_expand) * int(config.hidden_size), int(config.mamba_d_state), int(config.mamba_d_conv)
    return int(config.intermediate_size), int(config.state_size), int(config.conv_kernel)


def _size(config: Any, what: str) -> int:
    for name in _MAMBA2_SIZES[what]:
        if getattr(config, name, None) is not None:
            return int(getattr(config, name))
    raise ValueError(f"{type(config).__name__} names no Mamba2 {what} ({' or '.join(_MAMBA2_SIZES[what])})")


def mamba2_sizes(config: Any) -> tuple[int, int, int, int, int]:
    """A Mamba2 config's (heads, head_dim, groups, state size, conv kernel)."""
    return (_size(config, "heads"), _size(config, "head_dim"), _size(config, "groups"), _size(config, "state"),
            _size(config, "kernel"))


def state_shapes(config: Any, dtype: torch.dtype, tp_size: int = 1) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each recurrent layer's two states for one sequence, by state name: (shape, dtype), on one
    rank of `tp_size` (its share of the heads). Empty for a model without recurrent layers."""
    layers = recurrent_layers(config)
    family = recurrent_family(config)
    if family is None:
        return {}
    if family == "short_conv":  # LFM2: a short convolution's last inputs alone
        conv = (config.hidden_size // tp_size, config.conv_L_cache - 1)
        return {f"{layer}.conv": (conv, dtype) for layer in layers}
    if family == "mamba":  # a state row of `state_size` a channel
        channels, state, kernel = mamba_sizes(config)
        conv, recurrent = (channels // tp_size, kernel - 1), (channels // tp_size, state)
    elif family == "gated_delta_net":
        num_k, head_k = config.linear_num_key_heads // tp_size, config.linear_key_head_dim
        num_v, head_v = config.linear_num_value_heads // tp_size, config.linear_value_head_dim
        conv = (2 * num_k * head_k + num_v * head_v, config.linear_conv_kernel_dim - 1)
        recurrent = (num_v, head_k, head_v)
    else:  # Mamba2: a rank's heads, and its groups (or its heads' one group, with fewer groups than ranks)
        heads, head_dim, groups, state, kernel = mamba2_sizes(config)
        heads, groups = heads // tp_size, groups // tp_size if groups % tp_size == 0 else 1
        conv = (heads * head_dim + 2 * groups * state, kernel - 1)
        recurrent = (heads, head_dim, state)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for layer in layers:
        shapes[f"{layer}.conv"] = (conv, dtype)
        shapes[f"{layer}.recurrent"] = (recurrent, torch.float32)
    return shapes


def state_bytes_per_slot(config: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of every recurrent layer's states for one sequence (on one rank of `tp_size`)."""
    total = 0
    for shape, state_dtype in state_shapes(config, dtype, tp_size).values():
        numel = 1
        for n in shape:
            numel *= n
        total += numel * torch.empty((), dtype=state_dtype).element_size()
    return total


def allocate_state_caches(config: Any, num_slots: int, dtype: torch.dtype, device: torch.device | str,
                          tp_size: int = 1) -> dict[str, torch.Tensor]:
    """Zeroed state caches of `num_slots` rows (row 0 is the null slot padded rows write), of
    one rank's heads."""
    return {name: torch.zeros((num_slots, *shape), dtype=state_dtype, device=device)
            for name, (shape, state_dtype) in state_shapes(config, dtype, tp_size).items()}
