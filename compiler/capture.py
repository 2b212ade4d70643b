"""Capture: a Hugging Face causal LM traced by `torch.export` into one flat FX graph.

The model is built from its config with a registered attention function ("kiln") that
calls the marker op `kiln::attention` once per layer; since "kiln" has no mask function,
transformers builds no attention mask. `torch.export` traces token-major inputs
`input_ids[1, T]` and `position_ids[1, T]` with T dynamic. The exported program lifts
parameters and buffers to graph inputs, so the graph (and every artifact compiled from
it) holds no weights.

Every placeholder of the captured graph carries `meta["kiln_input"]`, a string that says
what the runtime feeds it: `param:<hf name>`, `constant:<name>` (config-derived buffers
such as RoPE's inv_freq, kept with the graph), `batch:input_ids`, `batch:position_ids`.
Passes that add inputs tag them the same way.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

import kiln.kernels  # noqa: F401  (registers kiln::attention)
from kiln.compiler.graph_inputs import (
    INPUT_META_KEY, batch_role, constant_role, graph_input_roles, param_role,
)

logger = logging.getLogger("kiln.compiler")

# model_type -> the transformers class capture builds.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}

ATTN_IMPLEMENTATION = "kiln"


class UnsupportedArchitectureError(ValueError):
    pass


def _kiln_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # HF hands [1, H, T, D]; the marker op is token-major [T, H, D] like the paged cache.
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = float(scaling if scaling is not None else module.head_dim**-0.5)
    out = torch.ops.kiln.attention(q, k, v, int(module.layer_idx), scale, int(sliding_window or 0))
    return out.unsqueeze(0), None


def register_kiln_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _kiln_attention_forward)


def check_architecture(config: Any) -> str:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"architecture {model_type!r} is not supported by Kiln capture; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return model_type


def build_hf_model(config: Any, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """The transformers model for `config`, with Kiln's attention, weights uninitialised.

    The model gets its own copy of `config`: transformers' `_from_config` writes the dtype,
    attention and experts implementations onto the config object it is given, and below
    `use_cache` is turned off; on the caller's object those would leak into any other model
    built from it (a Hugging Face baseline would then decode without a KV cache, with
    batched_mm experts)."""
    import copy

    import transformers
    from transformers import initialization as hf_init

    model_type = check_architecture(config)
    config = copy.deepcopy(config)
    register_kiln_attention()
    cls = getattr(transformers, SUPPORTED_ARCHITECTURES[model_type])
    kwargs: dict[str, Any] = {"attn_implementation": ATTN_IMPLEMENTATION, "dtype": dtype}
    if getattr(cls, "_can_set_experts_implementation", lambda: False)():
        # Any model with transformers' pluggable experts (Mixtral, Qwen2/3-MoE, OLMoE, ...):
        # the default ("eager") experts loop over `nonzero()` hits, which export cannot trace;
        # batched_mm gathers each token's expert weights and stays shape-static. It is also
        # the form `fuse_moe` (kiln.passes.fuse_moe) recognises. The kwarg works the same on
        # every transformers 5.x checked (README, Mixture of experts); the check after the
        # build catches a version where it would not.
        kwargs["experts_implementation"] = "batched_mm"
    with torch.device(device), hf_init.no_init_weights():
        model = cls._from_config(config, **kwargs)
    if "experts_implementation" in kwargs and getattr(model.config, "_experts_implementation", None) != "batched_mm":
        raise RuntimeError(
            f"transformers built {cls.__name__} with experts implementation "
            f"{getattr(model.config, '_experts_implementation', None)!r}, not 'batched_mm': "
            "export cannot trace the others and fuse_moe would not match them")
    model.eval()
    model.config.use_cache = False
    return model


def parameter_shapes(config: Any) -> dict[str, torch.Size]:
    """Shapes of every parameter of the architecture, from a meta-device model (no memory)."""
    model = build_hf_model(config, torch.float32, "meta")
    return {name: p.shape for name, p in model.named_parameters(remove_duplicate=False)}


class _LogitsOnly(torch.nn.Module):
    """Wraps the HF model so the exported graph maps (input_ids, position_ids) -> logits."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


@dataclass
class CapturedModel:
    """A flat FX graph of the model plus what the runtime needs to feed it."""

    graph_module: torch.fx.GraphModule
    config: Any
    dtype: torch.dtype
    # Each lifted parameter's HF name -> all names of that tensor (tied weights share one input).
    param_aliases: dict[str, list[str]]
    # Config-derived buffers/constants by name (RoPE inv_freq): small, not weights.
    constants: dict[str, torch.Tensor] = field(default_factory=dict)

    def input_roles(self) -> list[str]:
        return graph_input_roles(self.graph_module)


def capture(config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
            max_num_tokens: int = 8192) -> CapturedModel:
    """Trace the HF model for `config` into a flat graph with parameters as inputs."""
    from torch.export import Dim

    check_architecture(config)
    hf = build_hf_model(config, dtype, device)
    aliases: dict[int, list[str]] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    tied = _tied_weights(hf, config)
    wrapper = _LogitsOnly(hf)

    example_tokens = 8
    input_ids = torch.zeros((1, example_tokens), dtype=torch.long, device=device)
    position_ids = torch.arange(example_tokens, device=device).unsqueeze(0)
    num_tokens = Dim("num_tokens", min=1, max=max_num_tokens)
    dynamic_shapes = {"input_ids": {1: num_tokens}, "position_ids": {1: num_tokens}}
    with torch.no_grad():
        program = torch.export.export(wrapper, (input_ids, position_ids), dynamic_shapes=dynamic_shapes, strict=False)

    gm = program.graph_module
    sig = program.graph_signature
    named_params = dict(wrapper.named_parameters(remove_duplicate=False))
    named_buffers = dict(wrapper.named_buffers(remove_duplicate=False))
    param_aliases: dict[str, list[str]] = {}
    constants: dict[str, torch.Tensor] = {}
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    for node, spec in zip(placeholders, sig.input_specs):
        kind = spec.kind.name
        if kind == "PARAMETER":
            hf_name = _strip_wrapper(spec.target)
            names = [_strip_wrapper(n) for n in aliases[id(named_params[spec.target])]]
            names += [tied[n] for n in names if n in tied]
            param_aliases[hf_name] = list(dict.fromkeys([hf_name] + names))
            node.meta[INPUT_META_KEY] = param_role(hf_name)
        elif kind == "BUFFER":
            name = _strip_wrapper(spec.target)
            constants[name] = named_buffers[spec.target].detach().clone()
            node.meta[INPUT_META_KEY] = constant_role(name)
        elif kind == "CONSTANT_TENSOR":
            name = str(spec.target)
            constants[name] = program.constants[spec.target].detach().clone()
            node.meta[INPUT_META_KEY] = constant_role(name)
        elif kind == "USER_INPUT":
            node.meta[INPUT_META_KEY] = batch_role(spec.arg.name)
        else:
            raise ValueError(f"unexpected graph input kind {kind} for {node.name}")
    _unwrap_single_output(gm)
    gm.recompile()
    # The HF model sits in reference cycles, so without a collection its parameters (real
    # memory when capturing on CUDA) outlive capture and the runtime would load the weights
    # next to them: at Mixtral-8x7B's 93 GB that does not fit an H200 twice.
    del hf, wrapper, program, named_params, named_buffers, aliases
    gc.collect()
    return CapturedModel(graph_module=gm, config=config, dtype=dtype, param_aliases=param_aliases, constants=constants)


def _tied_weights(hf: torch.nn.Module, config: Any) -> dict[str, str]:
    """Parameter name -> the name it is tied to (a checkpoint may store only the latter)."""
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    keys = getattr(hf, "_tied_weights_keys", None)
    if isinstance(keys, dict):
        return dict(keys)
    return {"lm_head.weight": "model.embed_tokens.weight"}


def _strip_wrapper(name: str) -> str:
    return name[len("hf."):] if name.startswith("hf.") else name


def _unwrap_single_output(gm: torch.fx.GraphModule) -> None:
    """Make the graph return the logits tensor itself rather than a 1-tuple."""
    out = next(iter(gm.graph.find_nodes(op="output")))
    value = out.args[0]
    if isinstance(value, (tuple, list)) and len(value) == 1:
        out.args = (value[0],)
    # The exported module carries a pytree codegen for its tuple output; drop it so the
    # plain graph returns the tensor it computes.
    gm.graph._codegen = torch.fx.graph.CodeGen()
