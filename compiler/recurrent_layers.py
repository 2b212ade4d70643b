"""Recurrent layers captured around marker ops: gated DeltaNet (Qwen3-Next, Qwen3.5),
Mamba2 mixers (Granite 4.0-H, Nemotron-H, Bamba), whose state-keeping part is
`kiln::mamba2_scan` (kiln.kernels.mamba2), Mamba mixers (Mamba, Falcon-Mamba, Jamba: their
convolution `kiln::short_conv` with SiLU, their selective scan `kiln::selective_scan`,
kiln.kernels.mamba, with the projections between them graph code) and LFM2's short
convolutions (`kiln::short_conv`, kiln.kernels.short_conv), as the gated DeltaNet's is below.

transformers' gated DeltaNet module keeps its recurrent and conv states in a `Cache` object
and picks its kernel by sequence length; neither can be traced into a graph that serves any
batch of sequences. `mark_recurrent_layers` gives each such module a forward that computes the
same layer with the stateful part, convolution through the gated delta rule, as one
`kiln::gated_delta_net` marker (kiln.kernels.gated_delta_net), which `kiln.passes.recurrent_state`
replaces with the op that reads and writes the per-sequence states. Everything around it stays
ordinary graph code that passes see: the input projections (FP8 and tensor-parallel passes
treat them as any linear), the gated RMSNorm and the output projection.

The module keeps its class (a subclass that only overrides `forward`) and its parameters, so
checkpoint names are transformers' own. Two projection layouts are known: Qwen3-Next's fused
`in_proj_qkvz` / `in_proj_ba` (grouped per key head, taken apart by the module's own
`fix_query_key_value_ordering`) and Qwen3.5's separate `in_proj_qkv`, `in_proj_z`, `in_proj_b`,
`in_proj_a`. A gated DeltaNet of another layout, activation or with a conv bias is refused by
name, not run wrongly.
"""

from __future__ import annotations

from typing import Any

import torch

import torch.nn.functional as F

from kiln.kernels.gated_delta_net import gated_delta_net
from kiln.kernels.mamba import selective_scan
from kiln.kernels.mamba2 import mamba2_scan
from kiln.kernels.short_conv import short_conv

_COMMON = ("conv1d", "A_log", "dt_bias", "norm", "out_proj", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
           "layer_idx")
_FUSED = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")
_SPLIT = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


class UnsupportedRecurrentLayer(ValueError):
    """A recurrent layer whose form Kiln's forward does not reproduce."""


def is_gated_delta_net(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")


def _projections(module: torch.nn.Module, hidden: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mixed q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]) of hidden [1, T, H]."""
    t = hidden.shape[1]
    if hasattr(module, "in_proj_qkvz"):
        query, key, value, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden),
                                                                          module.in_proj_ba(hidden))
        mixed = torch.cat([x.reshape(1, t, -1) for x in (query, key, value)], dim=-1)
    else:
        mixed, z, b, a = (module.in_proj_qkv(hidden), module.in_proj_z(hidden), module.in_proj_b(hidden),
                          module.in_proj_a(hidden))
    return mixed[0], z.reshape(t, -1, module.head_v_dim), b.reshape(t, -1), a.reshape(t, -1)


def _kiln_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The layer over one packed step [1, T, hidden], its states behind the marker."""
    t = hidden_states.shape[1]
    mixed, z, b, a = _projections(self, hidden_states)
    core = gated_delta_net(mixed, a, b, self.conv1d.weight.squeeze(1), self.A_log,
                           self.dt_bias, self.layer_idx, self.num_k_heads, self.head_k_dim, self.head_v_dim)
    core = self.norm(core, z)  # per value head (over its last dim, as transformers' flattened rows)
    return self.out_proj(core.reshape(1, t, -1))


# OLMo Hybrid's gated DeltaNet: separate q/k/v/a/b projections, its gate from g_proj, beta
# doubled with `allow_neg_eigval`, o_norm and o_proj.
_SEPARATE = ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_norm", "o_proj", "conv1d", "A_log",
             "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "allow_neg_eigval", "layer_idx")


def _separate_projections_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any,
                                  **kwargs: Any) -> torch.Tensor:
    """OLMo Hybrid's gated DeltaNet over one packed step [1, T, hidden]: [q; k; v] from their
    own projections into the marker (beta_scale 2 with `allow_neg_eigval`), then the gated norm
    by g_proj's gate per value head, and o_proj."""
    t = hidden_states.shape[1]
    mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
    core = gated_delta_net(mixed[0], self.a_proj(hidden_states)[0], self.b_proj(hidden_states)[0],
                           self.conv1d.weight.squeeze(1), self.A_log, self.dt_bias, self.layer_idx, self.num_k_heads,
                           self.head_k_dim, self.head_v_dim, 2.0 if self.allow_neg_eigval else 1.0)
    gate = self.g_proj(hidden_states)
    core = self.o_norm(core.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim))
    return self.o_proj(core.reshape(1, t, -1))


def why_not_separate(module: torch.nn.Module, config: Any) -> str | None:
    """What keeps `module` (OLMo Hybrid's gated DeltaNet) from Kiln's forward, or None."""
    missing = [name for name in _SEPARATE if not hasattr(module, name)]
    if missing:
        return f"a gated DeltaNet of an unknown layout ({', '.join(missing)})"
    if module.conv1d.bias is not None:
        return "a gated DeltaNet with a convolution bias"
    if getattr(module, "activation", None) not in ("silu", "swish"):
        return f"a gated DeltaNet with a {module.activation!r} convolution activation (Kiln's op applies SiLU)"
    if module.num_v_heads % module.num_k_heads:
        return f"a gated DeltaNet with {module.num_v_heads} value heads over {module.num_k_heads} key heads"
    return None


_MAMBA2 = ("in_proj", "conv1d", "A_log", "D", "dt_bias", "norm", "out_proj", "num_heads", "head_dim", "n_groups",
           "ssm_state_size", "intermediate_size", "conv_dim", "layer_idx")


def _mamba2_parts(self: torch.nn.Module, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj's output [1, T, gate + x B C + dt] -> (gate [T, I], the scan's y [T, H * P]
    float32): the convolution and the SSD scan (with D's skip, dt at least its
    `time_step_limit`'s lower end) behind the marker."""
    gate, x_bc, dt = projected[0].split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
    dt_min = float(tuple(getattr(self, "time_step_limit", None) or (0.0,))[0])
    y = mamba2_scan(x_bc, dt, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.A_log, self.D, self.dt_bias,
                    self.layer_idx, self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size, dt_min)
    return gate, y


def _mamba2_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The Mamba2 mixer over one packed step [1, T, hidden]: in_proj gives [gate; x B C; dt],
    the convolution and the scan run behind the marker, then the gated norm and out_proj as the
    model computes them."""
    gate, y = _mamba2_parts(self, self.in_proj(hidden_states))
    return self.out_proj(self.norm(y.unsqueeze(0), gate.unsqueeze(0)).to(hidden_states.dtype))


def _falcon_h1_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """Falcon-H1's Mamba2 mixer: Mamba2's with its multipliers (the input's, and `mup_vector`
    over in_proj's [gate; x B C; dt]), the scan's output gated by SiLU(gate) or, with
    `mamba_rms_norm`, by the gated grouped norm."""
    gate, y = _mamba2_parts(self, self.in_proj(hidden_states * self.ssm_in_multiplier) * self.mup_vector)
    if self.mamba_rms_norm:
        y = self.norm(y.unsqueeze(0), gate.unsqueeze(0))
    else:
        y = (y * F.silu(gate)).unsqueeze(0)
    return self.out_proj(y.to(hidden_states.dtype))


# The Mamba2 mixers Kiln runs, by class, with the forward that reproduces each (each checked by
# a parity test). Others of the kind (Zamba2's, whose shared attention blocks all carry
# layer_idx -1) stay refused.
MAMBA2_FORWARDS = {"GraniteMoeHybridMambaLayer": _mamba2_forward, "NemotronHMamba2Mixer": _mamba2_forward,
                   "BambaMixer": _mamba2_forward, "Mamba2Mixer": _mamba2_forward, "FalconH1Mixer": _falcon_h1_forward}


def is_mamba2_mixer(module: torch.nn.Module) -> bool:
    """A Mamba2 mixer Kiln runs (Granite 4.0-H, Nemotron-H, Bamba, Mamba2, Falcon-H1: `MAMBA2_FORWARDS`)."""
    return type(module).__name__ in MAMBA2_FORWARDS


def why_not_mamba2(module: torch.nn.Module, config: Any) -> str | None:
    """What keeps `module` (a Mamba2 mixer) from Kiln's forward, or None."""
    missing = [name for name in _MAMBA2 if not hasattr(module, name)]
    if missing:
        return f"a Mamba2 mixer of an unknown layout ({', '.join(missing)})"
    expected = module.intermediate_size + module.conv_dim + module.num_heads
    if module.in_proj.out_features != expected:
        return (f"a Mamba2 mixer whose in_proj gives {module.in_proj.out_features} features, not gate + x B C + dt = "
                f"{expected} (an MLP branch beside it)")
    activation = getattr(module, "activation", None)
    if activation not in ("silu", "swish"):
        return f"a Mamba2 mixer with a {activation!r} convolution activation (Kiln's op applies SiLU)"
    if module.num_heads % module.n_groups:
        return f"a Mamba2 mixer with {module.num_heads} heads in {module.n_groups} groups"
    limit = tuple(float(v) for v in (getattr(module, "time_step_limit", None) or (0.0, float("inf"))))
    if limit[1] != float("inf"):
        return f"a Mamba2 mixer clamping dt to at most {limit[1]} (Kiln's op clamps from below only)"
    return None


# The Mamba (selective-scan) mixers `_mamba_forward` reproduces: Mamba's, Falcon-Mamba's (RMS
# norms without weights on dt, B and C) and Jamba's (with weights).
MAMBA_MIXERS = frozenset({"MambaMixer", "FalconMambaMixer", "JambaMambaMixer"})
_MAMBA = ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj", "time_step_rank", "ssm_state_size",
          "intermediate_size", "layer_idx")
_MAMBA_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")


def is_mamba_mixer(module: torch.nn.Module) -> bool:
    """A Mamba (selective-scan) mixer Kiln runs (`MAMBA_MIXERS`)."""
    return type(module).__name__ in MAMBA_MIXERS


def _mamba_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The Mamba mixer over one packed step [1, T, hidden]: in_proj gives [x; z]; x's convolution
    (SiLU after) and the scan run behind their markers; x_proj (dt, B, C, each normed where the
    model norms them) and dt_proj's weight (its bias is the scan's dt_bias) stay graph code."""
    x, z = self.in_proj(hidden_states)[0].chunk(2, dim=-1)
    x = short_conv(x, self.conv1d.weight.squeeze(1), self.conv1d.bias, self.layer_idx, True)
    time_step, B, C = self.x_proj(x).split([self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
    if hasattr(self, "dt_layernorm"):
        time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
    dt = F.linear(time_step, self.dt_proj.weight)
    y = selective_scan(x, dt, B, C, z, self.A_log, self.D, self.dt_proj.bias, self.layer_idx)
    return self.out_proj(y.unsqueeze(0))


def why_not_mamba(module: torch.nn.Module, config: Any) -> str | None:
    """What keeps `module` (a Mamba mixer) from Kiln's forward, or None."""
    missing = [name for name in _MAMBA if not hasattr(module, name)]
    norms = [name for name in _MAMBA_NORMS if hasattr(module, name)]
    if missing or norms not in ([], list(_MAMBA_NORMS)):
        return f"a Mamba mixer of an unknown layout ({', '.join(missing) or 'some of ' + ', '.join(_MAMBA_NORMS)})"
    if module.in_proj.out_features != 2 * module.intermediate_size:
        return (f"a Mamba mixer whose in_proj gives {module.in_proj.out_features} features, not x + z = "
                f"{2 * module.intermediate_size}")
    if module.dt_proj.bias is None:
        return "a Mamba mixer whose dt_proj has no bias"
    activation = getattr(module, "activation", None)
    if activation not in ("silu", "swish"):
        return f"a Mamba mixer with a {activation!r} convolution activation (Kiln's op applies SiLU)"
    return None


def is_short_conv(module: torch.nn.Module) -> bool:
    """LFM2's gated short convolution (`Lfm2ShortConv`, LFM2-MoE's `Lfm2MoeShortConv`)."""
    return type(module).__name__.endswith("ShortConv") and all(
        hasattr(module, name) for name in ("in_proj", "conv", "out_proj", "layer_idx"))


def _short_conv_forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """LFM2's conv layer over one packed step [1, T, hidden]: in_proj gives [B; C; x], the
    convolution of B * x runs behind the marker, gated by C, then out_proj."""
    B, C, x = self.in_proj(hidden_states)[0].chunk(3, dim=-1)
    y = C * short_conv(B * x, self.conv.weight.squeeze(1), self.conv.bias, self.layer_idx)
    return self.out_proj(y.unsqueeze(0))


def why_not_markable(module: torch.nn.Module, config: Any) -> str | None:
    """What keeps `module` (a gated DeltaNet) from Kiln's forward, or None."""
    missing = [name for name in _COMMON if not hasattr(module, name)]
    layouts = [layout for layout in (_FUSED, _SPLIT) if all(hasattr(module, name) for name in layout)]
    if missing or not layouts:
        return f"a gated DeltaNet of an unknown layout ({', '.join(missing) or 'its input projections'})"
    if module.conv1d.bias is not None:
        return "a gated DeltaNet with a convolution bias"
    activation = getattr(module, "activation", getattr(config, "hidden_act", None))
    if activation not in ("silu", "swish"):
        return f"a gated DeltaNet with a {activation!r} convolution activation (Kiln's op applies SiLU)"
    if module.num_v_heads % module.num_k_heads:
        return f"a gated DeltaNet with {module.num_v_heads} value heads over {module.num_k_heads} key heads"
    return None


def mark_recurrent_layers(model: torch.nn.Module, config: Any) -> int:
    """Give every recurrent layer of `model` (gated DeltaNet, a known Mamba2 or Mamba mixer, LFM2's
    short convolution) its marker forward; returns how many. Raises UnsupportedRecurrentLayer naming a
    module whose form it does not know."""
    count = 0
    for name, module in model.named_modules():
        if is_gated_delta_net(module) and hasattr(module, "g_proj"):  # OLMo Hybrid's
            why, forward = why_not_separate(module, config), _separate_projections_forward
        elif is_gated_delta_net(module):
            why, forward = why_not_markable(module, config), _kiln_forward
        elif is_mamba2_mixer(module):
            why, forward = why_not_mamba2(module, config), MAMBA2_FORWARDS[type(module).__name__]
        elif is_mamba_mixer(module):
            why, forward = why_not_mamba(module, config), _mamba_forward
        elif is_short_conv(module):
            why, forward = None, _short_conv_forward
        else:
            continue
        if why is not None:
            raise UnsupportedRecurrentLayer(f"{why} ({name}: {type(module).__name__})")
        module.__class__ = _marked_class(type(module), forward)
        count += 1
    return count


_MARKED: dict[type, type] = {}  # one subclass per transformers class (a cache of types, not request state)


def _marked_class(cls: type, forward: Any) -> type:
    if cls not in _MARKED:
        _MARKED[cls] = type(cls.__name__, (cls,), {"forward": forward, "_kiln_recurrent": True})
    return _MARKED[cls]


def is_marked(module: torch.nn.Module) -> bool:
    return bool(getattr(type(module), "_kiln_recurrent", False))


def linear_attention_layers(config: Any) -> list[int]:
    """The layers of `config` that are gated DeltaNets (`layer_types` "linear_attention")."""
    return [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind == "linear_attention"]
