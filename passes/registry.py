"""Registry of passes by name: the built-ins plus third-party passes from entry points.

A third-party package registers a pass factory (a class or zero-argument callable returning
a pass) under the `kiln.passes` entry-point group; it then appears in `kiln passes list`
and runs in its declared phase, with its uuid in the cache key.
"""

from __future__ import annotations

import logging
from importlib.metadata import EntryPoint, entry_points
from typing import Callable, Iterable

from kiln.passes.base import GraphPass

logger = logging.getLogger("kiln.passes")

ENTRY_POINT_GROUP = "kiln.passes"

# Built-in passes that change numerics, not just speed: off unless asked for (an engine
# option such as quantization="fp8" turns one on, as --enable-pass does).
OPT_IN_BUILTIN_PASSES = frozenset({"quantize_fp8", "kv_cache_scales"})

# Phases in the order the pass manager runs them.
PHASES = ("normalize", "attention", "fusion", "logits")


def builtin_pass_factories() -> dict[str, Callable[[], GraphPass]]:
    from kiln.passes.normalize import NormalizePass
    from kiln.passes.paged_kv import PagedKVPass
    from kiln.passes.prune_logits import PruneLogitsPass
    from kiln.passes.recurrent_state import RecurrentStatePass
    from kiln.passes.shard_tensor_parallel import ShardTensorParallelPass

    factories: dict[str, Callable[[], GraphPass]] = {
        "normalize": NormalizePass, "paged_kv": PagedKVPass, "prune_logits": PruneLogitsPass,
        # Gated DeltaNet layers' per-sequence states (a no-op on models without them).
        "recurrent_state": RecurrentStatePass,
        # Tensor parallelism (issue 14): a no-op at tensor_parallel_size 1.
        "shard_tensor_parallel": ShardTensorParallelPass,
    }
    # Fusion phase (issue 5), in run order: merges first; fuse_rope before fuse_rmsnorm so
    # that it takes Qwen3's q/k norms into kiln::rope. See kiln.passes.fuse_common for which
    # devices each runs on.
    from kiln.passes.fuse_layernorm import FuseLayerNormPass
    from kiln.passes.fuse_moe import FuseMoEPass
    from kiln.passes.fuse_rmsnorm import FuseRMSNormPass
    from kiln.passes.fuse_rope import FuseRoPEPass
    from kiln.passes.fuse_shared_expert_gate import FuseSharedExpertGatePass
    from kiln.passes.fuse_silu_mul import FuseSiluMulPass
    from kiln.passes.merge_gate_up import MergeGateUpPass
    from kiln.passes.merge_qkv import MergeQKVPass

    factories.update({
        "merge_qkv": MergeQKVPass, "merge_gate_up": MergeGateUpPass, "fuse_rope": FuseRoPEPass,
        "fuse_rmsnorm": FuseRMSNormPass, "fuse_silu_mul": FuseSiluMulPass, "fuse_layernorm": FuseLayerNormPass,
        # Mixture-of-experts blocks (issue 17). fuse_silu_mul has by then turned the experts'
        # silu * up into kiln::silu_and_mul; fuse_moe matches either form.
        "fuse_moe": FuseMoEPass,
        # The gated shared expert's sum with fuse_moe's output (Qwen2-MoE, Qwen3-Next).
        "fuse_shared_expert_gate": FuseSharedExpertGatePass,
    })
    # Logits phase, after prune_logits (which finds the LM head as an aten.linear): the
    # projections, merged and pruned, become kiln::linear (CUDA graphs by default).
    # quantize_fp8 (opt-in, OPT_IN_BUILTIN_PASSES) before use_triton_linear, which would
    # otherwise take the projections it quantizes.
    from kiln.passes.quantize_fp8 import QuantizeFP8Pass
    from kiln.passes.use_triton_linear import UseTritonLinearPass

    factories["quantize_fp8"] = QuantizeFP8Pass
    # After quantize_fp8: its quantized inputs and FP8 projections, one op each (a no-op
    # without FP8 projections).
    from kiln.passes.fuse_fp8_linear_inputs import FuseFP8LinearInputsPass

    factories["fuse_fp8_linear_inputs"] = FuseFP8LinearInputsPass
    # kv_cache_scales (opt-in: on with an FP8 KV cache) after the attention fusions.
    from kiln.passes.kv_cache_scales import KVCacheScalesPass

    factories["kv_cache_scales"] = KVCacheScalesPass
    factories["use_triton_linear"] = UseTritonLinearPass
    return factories


# What loading each entry point gave, by (name, value): the factory, or the error. Loading
# once per process means a broken plugin is reported once (not once per listing, pipeline
# and flag check), and every caller sees the same error.
_LOADED: dict[tuple[str, str], Callable[[], GraphPass] | Exception] = {}


def _load(ep: EntryPoint) -> Callable[[], GraphPass] | Exception:
    key = (ep.name, ep.value)
    if key not in _LOADED:
        try:
            _LOADED[key] = ep.load()
        except Exception as e:  # a broken plugin must not take the engine down
            _LOADED[key] = e
            logger.warning("cannot load pass %r from entry point %s: %s: %s", ep.name, ep.value, type(e).__name__, e)
    return _LOADED[key]


def plugin_pass_factories() -> dict[str, Callable[[], GraphPass]]:
    """The installed plugins' pass factories by pass name (those that load)."""
    found: dict[str, Callable[[], GraphPass]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        loaded = _load(ep)
        if not isinstance(loaded, Exception):
            found[ep.name] = loaded
    return found


def plugin_load_errors() -> dict[str, str]:
    """Installed plugins that fail to load: pass name -> "ErrorType: message (entry point)"."""
    errors: dict[str, str] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        loaded = _load(ep)
        if isinstance(loaded, Exception):
            errors[ep.name] = f"{type(loaded).__name__}: {loaded} (entry point {ep.value})"
    return errors


def unknown_pass_error(flag: str, name: str, known: Iterable[str]) -> ValueError:
    """The error for a flag naming a pass that is not available: a plugin that failed to
    load says so and why; otherwise the known names."""
    failed = plugin_load_errors().get(name)
    if failed is not None:
        return ValueError(f"{flag} {name!r}: the plugin providing it failed to load: {failed}")
    return ValueError(f"{flag} {name!r}: no such pass; known: {', '.join(sorted(known))}")


def all_pass_factories() -> dict[str, Callable[[], GraphPass]]:
    factories = builtin_pass_factories()
    for name, factory in plugin_pass_factories().items():
        if name in factories:
            logger.warning("plugin pass %r shadows a built-in pass of the same name; keeping the built-in", name)
            continue
        factories[name] = factory
    return factories


def create_pass(name: str, factories: dict[str, Callable[[], GraphPass]] | None = None) -> GraphPass:
    """Pass `name`, from `factories` (default: `all_pass_factories()`, which lists the
    installed plugins: ~6 ms a call here, so a pipeline lists them once for all its passes)."""
    if factories is None:
        factories = all_pass_factories()
    if name not in factories:
        if name in plugin_load_errors():
            raise unknown_pass_error("pass", name, factories)
        raise ValueError(f"unknown pass {name!r}; known passes: {', '.join(sorted(factories))}")
    p = factories[name]()
    if p.phase not in PHASES:
        raise ValueError(f"pass {name!r} declares phase {p.phase!r}; phases are {', '.join(PHASES)}")
    return p
