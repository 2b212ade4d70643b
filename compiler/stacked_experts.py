"""Experts that transformers loops over, rebuilt as its pluggable batched_mm experts (DBRX).

Most MoE models in transformers 5 carry the pluggable experts (`use_experts_implementation`),
which capture builds as `batched_mm`: shape-static, and the form `kiln.passes.fuse_moe`
recognises. DBRX's experts (`DbrxExperts`) are not pluggable: their forward loops over the
experts each token picked (`nonzero`, `where`), which export cannot trace. `stack_experts`
replaces each such module with `StackedExperts`, whose forward is transformers' own batched_mm
over the same experts stored as the pluggable ones store them (gate_up_proj [E, 2I, H], each
expert's gate rows then its up rows; down_proj [E, H, I]). The checkpoint's per-layer matrices
(DBRX: `ffn.experts.mlp.w1` / `v1` / `w2`, [E * I, H] each, w2 applied untransposed) are
rearranged into those as they load (`kiln.compiler.model_source.checkpoint_source_layouts`).
"""

from __future__ import annotations

from typing import Any

import torch

# DBRX's experts module (transformers' class name), by the type that builds it.
LOOPED_EXPERTS = {"dbrx": "DbrxExperts"}


class StackedExperts(torch.nn.Module):
    """E gated experts of hidden size H and intermediate size I, run by transformers'
    batched_mm experts function (`transformers.integrations.moe`); hidden states of any
    leading shape (DBRX hands them over as [batch, tokens, H])."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = torch.nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size,
                                                           dtype=dtype, device=device))
        self.down_proj = torch.nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size,
                                                        dtype=dtype, device=device))
        self.act_fn = ACT2FN[activation]
        # What batched_mm reads off a pluggable experts module (use_experts_implementation's
        # defaults for gated experts without biases).
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self.has_post_expert_norm, self.is_concatenated, self._is_expert_parallel = False, False, False

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate) * up

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        shape = hidden_states.shape
        out = ALL_EXPERTS_FUNCTIONS["batched_mm"](self, hidden_states.reshape(-1, shape[-1]), top_k_index,
                                                  top_k_weights)
        return out.view(shape)


def stack_experts(model: torch.nn.Module, config: Any) -> int:
    """Replace `model`'s looped experts modules (`LOOPED_EXPERTS`) with `StackedExperts` of the
    same sizes, dtype and device, weights uninitialised; returns how many were replaced."""
    class_name = LOOPED_EXPERTS.get(getattr(config, "model_type", None))
    if class_name is None:
        return 0
    ffn = config.ffn_config
    activation = (getattr(ffn, "ffn_act_fn", None) or {}).get("name", "silu")
    replaced = 0
    for name, module in list(model.named_modules()):
        if type(module).__name__ != class_name:
            continue
        w1 = module.mlp.w1
        parent = model.get_submodule(name.rpartition(".")[0])
        setattr(parent, name.rpartition(".")[2],
                StackedExperts(int(ffn.moe_num_experts), int(ffn.hidden_size), int(ffn.ffn_hidden_size), activation,
                               w1.dtype, w1.device))
        replaced += 1
    return replaced


def stacked_from_looped(kind: str, tensors: list[torch.Tensor], num_experts: int) -> torch.Tensor:
    """A `StackedExperts` tensor from DBRX's checkpoint matrices: gate_up_proj from (w1, v1),
    down_proj from (w2,), each [E * I, H]."""
    if kind == "gate_up_proj":
        w1, v1 = (t.view(num_experts, -1, t.shape[-1]) for t in tensors)
        return torch.cat((w1, v1), dim=1)
    (w2,) = tensors
    return w2.view(num_experts, -1, w2.shape[-1]).transpose(1, 2).contiguous()
