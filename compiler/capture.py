"""Capture: a Hugging Face causal LM traced by `torch.export` into one flat FX graph.

The model is built from its config with a registered attention function ("kiln") that
calls the marker op `kiln::attention` once per layer; since "kiln" has no mask function,
transformers builds no attention mask. Models whose attention never reaches that interface
(Bloom, MPT and Falcon compute it inline, with their own masks and ALiBi biases) are traced
as transformers runs them, and the capture-time pass `kiln.passes.inline_attention` puts
the marker where each inline attention was, reading the scale, mask and ALiBi slopes off the
graph. `torch.export` traces token-major inputs
`input_ids[1, T]` and `position_ids[1, T]` with T dynamic. The exported program lifts
parameters and buffers to graph inputs, so the graph (and every artifact compiled from
it) holds no weights.

The parameters are never real during capture: each becomes a fake tensor (shape, dtype and
device, no memory) as soon as the module registers it, and export traces in that same fake
mode. Buffers stay real (RoPE's inv_freq is a value the graph keeps). So capturing a model
costs one parameter's memory at a time, not the model's: the Llama-3-70B shape (141 GB)
captures on one H200, which a tensor-parallel rank must do before it loads its half.

Every placeholder of the captured graph carries `meta["kiln_input"]`, a string that says
what the runtime feeds it: `param:<hf name>`, `constant:<name>` (config-derived buffers
such as RoPE's inv_freq, kept with the graph), `batch:input_ids`, `batch:position_ids`.
Passes that add inputs tag them the same way.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import kiln.kernels  # noqa: F401  (registers kiln::attention)
from kiln.compiler.graph_inputs import (
    INPUT_META_KEY, add_graph_input, batch_role, constant_role, graph_input_roles, param_role,
)
from kiln.compiler.model_source import checkpoint_part_alias
from kiln.compiler.recurrent_layers import UnsupportedRecurrentLayer, is_marked, mark_recurrent_layers
from kiln.compiler.stacked_experts import stack_experts
from kiln.kernels.paged_attention import caches_latent
from kiln.kernels.recurrent_states import attention_free

logger = logging.getLogger("kiln.compiler")

ATTN_IMPLEMENTATION = "kiln"


class UnsupportedArchitectureError(ValueError):
    """The model holds a construct Kiln cannot run; the message names it and where it is."""


# Attention sinks (GPT-OSS's `s_aux`): the marker carries them, as its `sinks`.
_SINK_KWARGS = ("s_aux", "sinks")
# Arguments transformers' attention modules hand the attention function that change what
# it computes, and which Kiln's marker does not carry: the construct each one stands for.
_REFUSED_ATTENTION_KWARGS: dict[str, str] = {
    "position_bias": "relative position bias added to attention logits",
    "alibi": "ALiBi attention bias",
    "head_mask": "attention head mask",
}
# Tensor arguments that carry nothing the marker needs (flash attention's packing metadata,
# positions). Any other tensor handed to the attention function is something it would
# compute with, which the marker would silently drop: refused by name. (Flags such as
# output_router_logits also travel in the kwargs and are not tensors.)
_IGNORED_ATTENTION_KWARGS = frozenset({
    "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "output_attentions",
    "use_cache", "cache_position", "past_key_values", "past_key_value", "layer_past", "return_dict",
    "output_hidden_states",
})


def _module_path(module: torch.nn.Module) -> str:
    return getattr(module, "_kiln_path", type(module).__name__)


def _kiln_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # Refuse, by construct, what the marker cannot express rather than computing it wrongly.
    where = _module_path(module)
    for name, construct in _REFUSED_ATTENTION_KWARGS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedArchitectureError(f"{construct} is not supported (argument {name!r} of {where})")
    sinks = next((kwargs[name] for name in _SINK_KWARGS if kwargs.get(name) is not None), None)
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise UnsupportedArchitectureError(f"attention sinks of shape {tuple(sinks.shape)} for {query.shape[1]} "
                                           f"query heads are not supported ({where})")
    unknown = sorted(k for k, v in kwargs.items()
                     if isinstance(v, torch.Tensor) and k not in _IGNORED_ATTENTION_KWARGS and k not in _SINK_KWARGS)
    if unknown:
        raise UnsupportedArchitectureError(
            f"attention argument(s) {', '.join(map(repr, unknown))} that Kiln's attention marker does not carry "
            f"are not supported ({where})")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedArchitectureError(f"bidirectional (non-causal) attention is not supported ({where})")
    if attention_mask is not None:
        # "kiln" registers no mask function, so a mask here was built by the model itself.
        raise UnsupportedArchitectureError(f"a model-built attention mask is not supported ({where})")
    if key.shape[2] != query.shape[2]:
        raise UnsupportedArchitectureError(f"cross-attention (keys from another sequence) is not supported ({where})")
    chunk = _attention_chunk(module)
    if chunk:
        if sliding_window:
            raise UnsupportedArchitectureError(f"a sliding window and chunked attention in one layer ({where})")
        sliding_window = -chunk  # the marker's encoding of chunked attention (kiln.kernels.attention)
    if getattr(module, "_kiln_latent", False):
        return _latent_attention(module, query, key, value, scaling, sliding_window, softcap, sinks)
    # HF hands [1, H, T, D]; the marker op is token-major [T, H, D] like the paged cache.
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    # Multi-head latent attention (DeepSeek-V2/V3) expands K to qk_nope + qk_rope dims and V to
    # v_head_dim: the cache holds both at the larger size (`kv_heads_and_head_dim`), the
    # smaller zero-padded (zeros add nothing to q.k, and give output columns that are cut off).
    dk, dv = key.shape[-1], value.shape[-1]
    if dk != dv:
        d = max(dk, dv)
        q, k, v = (F.pad(x, (0, d - x.shape[-1])) if x.shape[-1] < d else x for x in (q, k, v))
    out = torch.ops.kiln.attention(q, k, v, int(module.layer_idx), scale, int(sliding_window or 0),
                                   float(softcap or 0.0), **({"sinks": sinks} if sinks is not None else {}))
    if dk != dv:
        out = out[..., :dv]
    return out.unsqueeze(0), None


def _attention_chunk(module: torch.nn.Module) -> int:
    """The chunk size of a chunked-attention layer (Llama 4: `layer_types[i] ==
    "chunked_attention"`, `attention_chunk_size`), which transformers expresses only in the mask
    it builds (and "kiln" builds none); 0 for any other layer."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if not isinstance(layer_types, (list, tuple)) or not isinstance(layer, int) or layer >= len(layer_types):
        return 0
    if layer_types[layer] != "chunked_attention":
        return 0
    chunk = getattr(config, "attention_chunk_size", None)
    if not isinstance(chunk, int) or chunk <= 0:
        raise UnsupportedArchitectureError(f"chunked attention without a positive attention_chunk_size "
                                           f"({_module_path(module)})")
    return chunk


def _keep_latent(kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA module's `expand_kv` in a latent-cached model: the attention function gets the
    latent and the shared RoPE key as they are ([B, 1, T, kv_lora_rank], [B, 1, T, rope])."""
    return kv_nope, k_rot


def _latent_attention(module: torch.nn.Module, query: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                      scaling: float | None, sliding_window: int | None, softcap: float | None,
                      sinks: torch.Tensor | None) -> tuple[torch.Tensor, None]:
    """Multi-head latent attention over its latent (`kiln.kernels.paged_attention.caches_latent`).

    Each head's key is W_UK c (c the token's latent) next to the shared RoPE key, its value
    W_UV c, with W_UK, W_UV that head's rows of kv_b_proj. So q . k = (W_UK^T q_nope) . c +
    q_rot . k_rot, and the output is W_UV (sum_j p_j c_j): the marker attends with one KV head
    [c; k_rot] (kv_lora_rank + rope wide), the queries [W_UK^T q_nope; q_rot], and the head's
    W_UV applies after it. The cache then holds that one head, in one plane read as both K and
    V (the output's RoPE columns are dropped)."""
    if sinks is not None:
        raise UnsupportedArchitectureError(f"attention sinks with a latent cache ({_module_path(module)})")
    nope, rank = int(module.qk_nope_head_dim), latent.shape[-1]
    q = query[0].transpose(0, 1)  # [T, H, nope + rope]
    # kv_b_proj's rows are per head [k_nope (nope); v (v_head_dim)], each over the latent.
    w = module.kv_b_proj.weight.view(-1, nope + int(module.v_head_dim), rank)
    q_latent = torch.einsum("thn,hnr->thr", q[..., :nope], w[:, :nope])
    q = torch.cat((q_latent, q[..., nope:]), dim=-1)
    kv = torch.cat((latent[0], k_rot[0]), dim=-1).transpose(0, 1)  # [T, 1, rank + rope]
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    out = torch.ops.kiln.attention(q, kv, kv, int(module.layer_idx), scale, int(sliding_window or 0),
                                   float(softcap or 0.0))
    out = torch.einsum("thr,hvr->thv", out[..., :rank], w[:, nope:])
    return out.unsqueeze(0), None


def register_kiln_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _kiln_attention_forward)


def causal_lm_class(config: Any) -> type:
    """The transformers causal-LM class for `config`, or UnsupportedArchitectureError naming
    the construct that keeps Kiln from running it (not the architecture's name)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    # A repo's own code (config.auto_map) is never run; where transformers ships the
    # model_type (DeepSeek-V3's repo carries its code too), transformers' implementation is
    # captured, as vLLM does without trust_remote_code.
    if model_type not in CONFIG_MAPPING_NAMES:
        raise UnsupportedArchitectureError(
            f"trust_remote_code model (model_type {model_type!r} has no implementation in transformers "
            f"{transformers.__version__}; Kiln traces transformers' own code only)")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(
            f"cross-attention (an encoder-decoder model: config.is_encoder_decoder of {type(config).__name__})")
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name is None or not hasattr(transformers, class_name):
        raise UnsupportedArchitectureError(
            f"no causal-LM head (transformers maps no *ForCausalLM class to model_type {model_type!r})")
    return getattr(transformers, class_name)


# Parameter names that only state-space / recurrent layers have (Mamba's A_log and dt_bias, RWKV's
# time-mixing decay): their state is not a KV cache, so the paged cache cannot hold it.
_RECURRENT_PARAMETER_SUFFIXES = (".A_log", ".dt_bias", ".time_decay", ".time_first")


def find_unsupported_construct(model: torch.nn.Module) -> str | None:
    """The first construct in `model` Kiln cannot run, with where it is; None if none. Gated
    DeltaNet, Mamba2, Mamba and short-convolution layers given Kiln's forward
    (`kiln.compiler.recurrent_layers`) run: their states are per-sequence state caches."""
    marked = tuple(f"{name}." for name, module in model.named_modules() if is_marked(module))
    for name, _ in model.named_parameters():
        if name.endswith(_RECURRENT_PARAMETER_SUFFIXES) and not name.startswith(marked):
            return f"state-space / recurrent layer (parameter {name})"
    for name, module in model.named_modules():
        if is_marked(module) or name.startswith(marked):
            continue
        if isinstance(module, torch.nn.Conv1d):
            # A causal convolution over the sequence (LFM2's short conv, Mamba's conv): a decode
            # step would need the previous tokens' inputs, a per-sequence state Kiln lacks.
            return f"convolution over the sequence ({name}: {type(module).__name__})"
        if type(module).__name__.endswith(("Mixer", "Mamba", "MambaBlock")) and any(
                n.endswith("conv1d") and not f"{name}.{n}".startswith(marked) for n, _ in module.named_modules()):
            return f"state-space layer ({name}: {type(module).__name__})"
    return None


def _refuse_repeated_attention(gm: torch.fx.GraphModule) -> None:
    """A layer that calls attention more than once (DiffLlama's differential attention: two
    softmaxes over the halves of V) would write two K/V pairs into the one cache of its layer,
    the second over the first: refused, naming the layer."""
    calls: dict[int, int] = {}
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.attention.default):
        calls[int(node.args[3])] = calls.get(int(node.args[3]), 0) + 1
    repeated = sorted(layer for layer, n in calls.items() if n > 1)
    if repeated:
        raise UnsupportedArchitectureError(
            f"attention called {calls[repeated[0]]} times in layer {repeated[0]} (e.g. differential attention) is not "
            "supported by Kiln: its KV cache keeps one K and V per layer")


def attention_outside_interface(model: torch.nn.Module) -> str:
    """What a model whose attention never reached the "kiln" function computes instead,
    named by construct and module (ALiBi bias, or attention written inline)."""
    attention_modules = [(n, m) for n, m in model.named_modules() if "attention" in type(m).__name__.lower()]
    where = (f"{attention_modules[0][0]}: {type(attention_modules[0][1]).__name__}" if attention_modules
             else type(model).__name__)
    # ALiBi: the model's code builds an ALiBi bias, and the config does not switch it off
    # (Falcon's code has an ALiBi path that `alibi=False` configs never take).
    config = getattr(model, "config", None)
    flag = getattr(config, "alibi", None)
    if flag is None:
        flag = getattr(getattr(config, "attn_config", None), "alibi", None)
    classes = {type(m) for m in model.modules()}
    if flag is not False and any("alibi" in _class_source(cls).lower() for cls in classes):
        return f"ALiBi attention bias ({where})"
    return f"attention computed outside transformers' attention interface ({where})"


def _class_source(cls: type) -> str:
    import inspect

    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def build_hf_model(config: Any, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """The transformers model for `config`, with Kiln's attention, weights uninitialised.

    Raises UnsupportedArchitectureError naming the construct (state-space layer, ALiBi,
    cross-attention, ...) and where it is when Kiln cannot run the model.

    The model gets its own copy of `config`: transformers' `_from_config` writes the dtype,
    attention and experts implementations onto the config object it is given, and below
    `use_cache` is turned off; on the caller's object those would leak into any other model
    built from it (a Hugging Face baseline would then decode without a KV cache, with
    batched_mm experts)."""
    import copy

    from transformers import initialization as hf_init

    cls = causal_lm_class(config)
    config = copy.deepcopy(config)
    register_kiln_attention()
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
        inline = not cls._can_set_attn_implementation() or _alibi_in_mask(config)
        if inline:
            # transformers' own test: the model's attention classes never call
            # ALL_ATTENTION_FUNCTIONS. Build it as transformers would run it; capture then
            # replaces its inline attention with the marker (kiln.passes.inline_attention).
            # Named, not left to the config (whose object a caller may have built another model
            # from): transformers' own default, SDPA where the model has it. Falcon's eager ALiBi
            # path adds the bias twice (inline and folded into its mask); its SDPA path once.
            kwargs["attn_implementation"] = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
        model = cls._from_config(config, **kwargs)
        stack_experts(model, config)  # DBRX's looped experts as batched_mm ones (kiln.compiler.stacked_experts)
        try:  # recurrent layers' states behind one marker each (kiln.compiler.recurrent_layers)
            mark_recurrent_layers(model, config)
        except UnsupportedRecurrentLayer as e:
            raise UnsupportedArchitectureError(f"{e} is not supported by Kiln") from None
    model._kiln_inline_attention = inline
    if "experts_implementation" in kwargs and getattr(model.config, "_experts_implementation", None) != "batched_mm":
        raise RuntimeError(
            f"transformers built {cls.__name__} with experts implementation "
            f"{getattr(model.config, '_experts_implementation', None)!r}, not 'batched_mm': "
            "export cannot trace the others and fuse_moe would not match them")
    construct = find_unsupported_construct(model)
    if construct is not None:
        raise UnsupportedArchitectureError(f"{construct} is not supported by Kiln")
    latent = caches_latent(config)
    for name, module in model.named_modules():
        # Where each module sits, for refusals raised while tracing (attention arguments).
        module._kiln_path = f"{name} ({type(module).__name__})"
        if latent and callable(getattr(module, "expand_kv", None)) and hasattr(module, "kv_b_proj"):
            module.expand_kv = _keep_latent
            module._kiln_latent = True
    model.eval()
    model.config.use_cache = False
    return model


def _alibi_in_mask(config: Any) -> bool:
    """Falcon-RW: its ALiBi bias is added to the attention mask, which it needs built (the
    "kiln" function has no mask function, so transformers builds none). transformers 5.25
    moved Falcon's attention onto the attention-function interface, where it would reach the
    marker without its bias: such a model is captured inline as before (SDPA with the mask),
    and kiln.passes.inline_attention reads the slopes off the mask."""
    return bool(getattr(config, "alibi", False))


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
    # The constants that are persistent buffers (saved in checkpoints: DeepSeek-V3-style
    # routers' `e_score_correction_bias`) -> the names a checkpoint may store each under. The
    # loader replaces the captured value (built from the config) with the checkpoint's.
    checkpoint_buffers: dict[str, list[str]] = field(default_factory=dict)
    # Parameters the model keeps in a dtype other than the capture's (GLM-4.5's and
    # DeepSeek-V3's routers are float32 in a bfloat16 model): the loader reads them so.
    param_dtypes: dict[str, torch.dtype] = field(default_factory=dict)

    def input_roles(self) -> list[str]:
        return graph_input_roles(self.graph_module)


def _export_fake_mode() -> Any:
    """The fake-tensor mode capture builds parameters in and export traces in: export's own
    settings (a shape environment that tracks the dynamic token count)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    return FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True, export=True)


@contextlib.contextmanager
def _fake_parameters(fake_mode: Any) -> Iterator[None]:
    """While building a model, every parameter a module registers becomes a fake tensor of
    `fake_mode` (the real one, just allocated by the module, is dropped at once). Buffers
    are left real."""
    from torch._subclasses.fake_tensor import FakeTensor

    register = torch.nn.Module.register_parameter

    def register_fake(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not isinstance(param, FakeTensor):
            fake = fake_mode.from_tensor(param.detach(), static_shapes=True)
            param = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = register_fake  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


def _build_for_export(config: Any, dtype: torch.dtype, device: torch.device | str
                      ) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """(the HF model with fake parameters, its logits-only wrapper, their fake mode)."""
    fake_mode = _export_fake_mode()
    with _fake_parameters(fake_mode):
        hf = build_hf_model(config, dtype, device)
    return hf, _LogitsOnly(hf), fake_mode


def _export(wrapper: torch.nn.Module, fake_mode: Any, args: tuple[torch.Tensor, ...],
            dynamic_shapes: dict[str, Any]) -> Any:
    # Export traces in the parameters' fake mode (a tracing context that holds it is where
    # non-strict export looks for one), so that they need no conversion.
    with torch.no_grad(), torch._guards.tracing(torch._guards.TracingContext(fake_mode)):
        return torch.export.export(wrapper, args, dynamic_shapes=dynamic_shapes, strict=False)


def capture(config: Any, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
            max_num_tokens: int = 8192) -> CapturedModel:
    """Trace the HF model for `config` into a flat graph with parameters as inputs."""
    from torch.export import Dim

    example_tokens = 8
    input_ids = torch.zeros((1, example_tokens), dtype=torch.long, device=device)
    position_ids = torch.arange(example_tokens, device=device).unsqueeze(0)
    num_tokens = Dim("num_tokens", min=1, max=max_num_tokens)
    hf, wrapper, fake_mode = _build_for_export(config, dtype, device)
    inline = getattr(hf, "_kiln_inline_attention", False)
    try:
        program = _export(wrapper, fake_mode, (input_ids, position_ids),
                          {"input_ids": {1: num_tokens}, "position_ids": {1: num_tokens}})
    except torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode as e:
        raise UnsupportedArchitectureError(
            f"shapes that depend on tensor values ({_model_frame(e)}; e.g. experts that loop over the "
            "tokens each one got): Kiln traces one graph for every token count") from e
    except torch._dynamo.exc.UserError as e:
        if e.error_type != torch._dynamo.exc.UserErrorType.CONSTRAINT_VIOLATION:
            raise
        # The trace narrowed the token count's range: an inline bias sized by the model's
        # context (MPT slices a max_seq_len-long ALiBi tensor) bounds it, or the model's code
        # ties it to another input's size first (Llama 4's RoPE meets the position ids' own
        # symbol, whose range starts at 2, before the token count's). The bias is replaced by
        # the marker below and each bucket is exported again at its own static shape, and the
        # graph runs one token as well as two (tests/test_parity.py), so let export narrow it.
        # A new model and fake mode: the failed trace left its guards in the old one's shapes.
        logger.info("capture: %s narrows the token count's range (%s); tracing with the range export infers",
                    type(hf).__name__, str(e).splitlines()[1].strip() if "\n" in str(e) else e)
        hf, wrapper, fake_mode = _build_for_export(config, dtype, device)
        try:
            program = _export(wrapper, fake_mode, (input_ids, position_ids),
                              {"input_ids": {1: Dim.DYNAMIC}, "position_ids": {1: Dim.DYNAMIC}})
        except torch._dynamo.exc.UserError as again:
            raise UnsupportedArchitectureError(
                f"code that ties the token count to another size ({_model_frame(again)}; export: "
                f"{str(again).splitlines()[0].split('!')[0]}): Kiln traces one graph for every token count"
            ) from again
        upper = _token_count_upper_bound(program)
        if not inline and upper is not None and upper < max_num_tokens:
            # A bound the marker does not replace (a buffer sliced to the step, say): a step of
            # more tokens, several sequences packed, would run past it.
            raise UnsupportedArchitectureError(
                f"code that bounds the token count at {upper} ({_model_frame(e)}): a step packs up to "
                f"{max_num_tokens} tokens, and Kiln traces one graph for every token count")
    aliases: dict[int, list[str]] = {}
    for name, p in hf.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    tied = _tied_weights(hf, config)
    saved = _checkpoint_names(hf)
    persistent = _persistent_buffer_names(hf)
    checkpoint_buffers: dict[str, list[str]] = {}
    param_dtypes: dict[str, torch.dtype] = {}
    # A model of recurrent layers alone (Mamba, Falcon-Mamba) has no attention to find.
    if not inline and not attention_free(config) and not program.graph_module.graph.find_nodes(
            op="call_function", target=torch.ops.kiln.attention.default):
        raise UnsupportedArchitectureError(f"{attention_outside_interface(hf)} is not supported by Kiln")
    _refuse_repeated_attention(program.graph_module)

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
            names += [saved[n] for n in names if n in saved]
            param_aliases[hf_name] = list(dict.fromkeys([hf_name] + names))
            node.meta[INPUT_META_KEY] = param_role(hf_name)
            if named_params[spec.target].dtype != dtype:
                param_dtypes[hf_name] = named_params[spec.target].dtype
        elif kind == "BUFFER":
            name = _strip_wrapper(spec.target)
            constants[name] = named_buffers[spec.target].detach().clone()
            node.meta[INPUT_META_KEY] = constant_role(name)
            if name in persistent:
                checkpoint_buffers[name] = list(dict.fromkeys([name, *persistent[name]]))
        elif kind == "CONSTANT_TENSOR":
            name = str(spec.target)
            constants[name] = program.constants[spec.target].detach().clone()
            node.meta[INPUT_META_KEY] = constant_role(name)
        elif kind == "USER_INPUT":
            node.meta[INPUT_META_KEY] = batch_role(spec.arg.name)
        else:
            raise ValueError(f"unexpected graph input kind {kind} for {node.name}")
    if inline:
        _mark_inline_attention(gm, constants, hf)
    _unwrap_single_output(gm)
    _fold_input_free_computations(gm, constants)
    gm.recompile()
    # The HF model sits in reference cycles: collected here, not at some later point.
    del hf, wrapper, program, named_params, named_buffers, aliases
    gc.collect()
    return CapturedModel(graph_module=gm, config=config, dtype=dtype, param_aliases=param_aliases, constants=constants,
                         checkpoint_buffers=checkpoint_buffers, param_dtypes=param_dtypes)


# Ops whose output is not a function of their inputs alone (uninitialised memory, random draws)
# or that write their input: never folded (a fold would freeze or share their result).
_UNFOLDABLE_PREFIXES = ("empty", "new_empty", "rand", "normal", "bernoulli", "uniform", "_assert", "sym_")


def _fold_input_free_computations(gm: torch.fx.GraphModule, constants: dict[str, torch.Tensor]) -> int:
    """Compute, once at capture, what the graph computes from no input at all, and make each
    such result that the rest of the graph reads a constant input (`constant:folded_N`).

    Some models build tensors in their forward from nothing but the config: PhiMoE's rotary
    embedding recomputes inv_freq each call (`arange` on the CPU, then `.to(x.device)`). Left in
    the graph, that is a host-to-device copy in every step, which a CUDA graph cannot capture
    (the GPU suite's PhiMoE failed so); as a constant input it is moved to the device once with
    the others. Only pure ops are folded (nothing random, uninitialised or written in place),
    from call_function nodes that read no placeholder, directly or through another node."""
    graph = gm.graph
    free: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name.startswith(_UNFOLDABLE_PREFIXES) or name.endswith("_") or (
                isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable):
            continue
        if all(inp in free for inp in node.all_input_nodes):
            free.add(node)
    # What the rest of the graph reads: the free nodes with a user outside them, in graph order.
    frontier = [n for n in graph.nodes if n in free and any(u not in free for u in n.users)]
    if not frontier:
        return 0
    values: dict[torch.fx.Node, Any] = {}
    for node in graph.nodes:  # in order: each free node's inputs are computed before it
        if node in free:
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
            if "device" in kwargs:
                kwargs = {**kwargs, "device": "cpu"}  # computed here; the runner moves constants
            values[node] = node.target(*args, **kwargs)
    folded = 0
    for node in frontier:
        value = values[node]
        if not isinstance(value, torch.Tensor) or value.numel() > 1 << 20:
            continue  # (a large constant costs more memory than the ops that build it)
        name = f"folded_{folded}"
        while name in constants:
            name += "_"
        constants[name] = value.detach().to("cpu").clone()
        placeholder = add_graph_input(gm, name, constant_role(name), node.meta["val"])
        node.replace_all_uses_with(placeholder)
        folded += 1
    if folded:
        for node in reversed(list(graph.nodes)):  # the free nodes nothing reads any more
            if node in free and not node.users:
                graph.erase_node(node)
        gm.recompile()
        logger.info("capture: %d input-free computation(s) folded into constants", folded)
    return folded


def _mark_inline_attention(gm: torch.fx.GraphModule, constants: dict[str, torch.Tensor], hf: torch.nn.Module) -> None:
    from kiln.passes.inline_attention import InlineAttentionError, mark_inline_attention

    if gm.graph.find_nodes(op="call_function", target=torch.ops.kiln.attention.default):
        raise UnsupportedArchitectureError(
            f"attention partly through transformers' attention interface and partly inline ({type(hf).__name__})")
    try:
        report = mark_inline_attention(gm, constants, getattr(hf.config, "sliding_window", None))
    except InlineAttentionError as e:
        raise UnsupportedArchitectureError(f"{e} is not supported by Kiln") from e
    logger.info("capture: %d inline attention(s) of %s replaced by the marker (%d with ALiBi, %d windowed)",
                report.sites, type(hf).__name__, report.alibi_layers, report.sliding_window_layers)


def _tied_weights(hf: torch.nn.Module, config: Any) -> dict[str, str]:
    """Parameter name -> the name it is tied to (a checkpoint may store only the latter)."""
    if not getattr(config, "tie_word_embeddings", False):
        return {}
    keys = getattr(hf, "_tied_weights_keys", None)
    if isinstance(keys, dict):
        return dict(keys)
    return {"lm_head.weight": "model.embed_tokens.weight"}


def _saved_names_at_once(hf: torch.nn.Module, params: dict[str, torch.Tensor], revert: Any) -> dict[str, list[str]]:
    """Parameter name -> [the name `save_pretrained` writes it under], from one revert of all
    parameters, for each parameter that comes back as itself (the same tensor: renamed, or
    not) and is the only name of its tensor. A tied or converted one (several names for one
    tensor, or a new tensor) is left out: the caller asks for it alone. Reverting one
    parameter at a time rebuilds the model's conversion mapping each time (~3 ms for a
    30-layer model, a walk over its modules): ~0.8 s of SmolLM2-135M's cold start, growing
    with the square of the layers. `params`: every parameter by name, tied ones under each name."""
    by_id: dict[int, list[str]] = {}
    for n, t in params.items():
        by_id.setdefault(id(t), []).append(n)
    at_once: dict[str, list[str]] = {}
    try:
        reverted = revert(hf, params)
    except Exception:  # a conversion that needs the parameters apart: each is asked alone
        reverted = {}
    seen = Counter(id(t) for t in reverted.values())
    for saved, t in reverted.items():
        owners = by_id.get(id(t), [])
        if len(owners) == 1 and seen[id(t)] == 1:
            at_once[owners[0]] = [saved]
    return at_once


def _checkpoint_names(hf: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> the name transformers' own `save_pretrained` writes it under, where
    transformers renames it (GPT-NeoX's lm_head is saved as `embed_out`), or the run of a fused
    tensor it is saved in (`checkpoint_part_alias`). Tensors split on save (MoE experts) are the
    loader's `checkpoint_source_layouts`."""
    from transformers.core_model_loading import revert_weight_conversion

    names: dict[str, str] = {}
    owners: dict[str, set[int]] = {}  # saved name -> the parameters (by identity) saved under it
    params = dict(hf.named_parameters(remove_duplicate=False))
    at_once = _saved_names_at_once(hf, params, revert_weight_conversion)
    for name, p in params.items():
        saved = at_once[name] if name in at_once else list(revert_weight_conversion(hf, {name: p}))
        if len(saved) == 1 and saved[0] != name:
            names[name] = saved[0]
            owners.setdefault(saved[0], set()).add(id(p))
    # A name several parameters are saved under is a tensor transformers splits as it loads
    # (Sarvam's and Param-2's query_key_value, Lara's fused in_proj): each part's alias names its
    # run of that tensor (`checkpoint_part_alias`), found by reverting the conversion over
    # marked stand-ins; parts whose runs cannot be found get no alias (such a checkpoint then
    # fails to load naming the missing tensor).
    shared = {saved_name for saved_name, ids in owners.items() if len(ids) > 1}  # (tied: one parameter)
    for saved_name in shared:
        first_names: dict[int, str] = {}  # each part (a tensor) under its first name
        for name, other in names.items():
            if other == saved_name:
                first_names.setdefault(id(params[name]), name)
        runs = _runs_in_fused(hf, saved_name, [(name, params[name].shape) for name in first_names.values()]) or {}
        for name, other in list(names.items()):
            if other == saved_name:
                run = runs.get(first_names[id(params[name])])
                if run is None:
                    del names[name]
                else:
                    names[name] = checkpoint_part_alias(saved_name, *run)
    return names


def _runs_in_fused(hf: torch.nn.Module, saved_name: str, parts: list[tuple[str, torch.Size]]
                   ) -> dict[str, tuple[int, int, int]] | None:
    """Each part's (dim, start, stop) in the checkpoint tensor `saved_name` that transformers
    splits into `parts` as it loads: transformers' own conversion, reverted over stand-ins that
    keep each part's size along one dimension (1 along the others) and hold the part's number;
    the first dimension along which the stand-ins join into `saved_name` is the split's. None
    when no dimension gives one run per part."""
    from transformers.core_model_loading import revert_weight_conversion

    rank = len(parts[0][1])
    if any(len(shape) != rank or 0 in shape for _, shape in parts):
        return None
    for dim in range(rank):
        stand_ins = {}
        for i, (name, shape) in enumerate(parts):
            size = [1] * rank
            size[dim] = shape[dim]
            stand_ins[name] = torch.full(size, float(i + 1))
        try:
            fused = revert_weight_conversion(hf, stand_ins)
        except Exception:  # (a conversion that cannot join along this dimension)
            continue
        if list(fused) != [saved_name]:
            continue
        line = fused[saved_name].reshape(-1) if fused[saved_name].numel() == fused[saved_name].shape[dim] else None
        if line is None:
            continue
        runs: dict[str, tuple[int, int, int]] = {}
        for i, (name, shape) in enumerate(parts):
            where = (line == float(i + 1)).nonzero().flatten().tolist()
            if len(where) != shape[dim] or where != list(range(where[0], where[0] + len(where))):
                break
            runs[name] = (dim, where[0], where[0] + len(where))
        else:
            return runs
    return None


def _persistent_buffer_names(hf: torch.nn.Module) -> dict[str, list[str]]:
    """Each persistent buffer (one `state_dict` holds, so `save_pretrained` writes it) -> the
    other names transformers' `save_pretrained` writes it under (Exaone-MoE's
    `mlp.gate.e_score_correction_bias` is saved as `mlp.e_score_correction_bias`)."""
    from transformers.core_model_loading import revert_weight_conversion

    names: dict[str, list[str]] = {}
    for prefix, module in hf.named_modules(remove_duplicate=False):
        for local, buf in module._buffers.items():
            if buf is None or local in module._non_persistent_buffers_set:
                continue
            name = f"{prefix}.{local}" if prefix else local
            names[name] = [n for n in revert_weight_conversion(hf, {name: buf}) if n != name]
    return names


def _token_count_upper_bound(program: Any) -> int | None:
    """The largest token count an exported program's range allows (None: unbounded or static)."""
    user = [node for node, spec in zip(program.graph_module.graph.find_nodes(op="placeholder"),
                                       program.graph_signature.input_specs) if spec.kind.name == "USER_INPUT"]
    size = user[0].meta["val"].shape[1] if user else None
    if not isinstance(size, torch.SymInt):
        return None
    bound = program.range_constraints.get(size.node.expr)
    upper = getattr(bound, "upper", None)
    try:
        return int(upper) if upper is not None else None
    except (TypeError, ValueError, AttributeError):  # sympy's infinities (int_oo) have no int
        return None


def _model_frame(error: BaseException) -> str:
    """The innermost frame of transformers' modeling code in `error`'s traceback ("modeling_dbrx.py,
    in forward"), where a trace failed; "the model's forward" if none is. (No line number: the
    message names the construct, and transformers' releases move lines.)"""
    import traceback

    frames = [f for f in traceback.extract_tb(error.__traceback__) if "/transformers/models/" in f.filename]
    if not frames:
        return "the model's forward"
    last = frames[-1]
    return f"{last.filename.rsplit('/', 1)[-1]}, in {last.name}"


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
