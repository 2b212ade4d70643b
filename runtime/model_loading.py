"""One rank's model: the graph (cache or capture, kiln.compiler.startup), its weights loaded
and transformed, and runners over KV caches. The engine uses it for a single-GPU model; each
tensor-parallel worker (kiln.runtime.tp_worker) for its rank."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kiln.compiler.model_source import ModelSource
from kiln.compiler.startup import PreparedModel, prepare_for_engine, timed
from kiln.passes.weight_transforms import (apply_weight_transforms, fp8_weight_names, load_time_quantizer,
                                           optional_checkpoint_names, shard_transforms)
from kiln.runtime.config import EngineConfig
from kiln.runtime.model_runner import ModelRunner


@dataclass
class LoadedModel:
    prepared: PreparedModel
    weights: dict[str, torch.Tensor]
    device: torch.device
    # The FP8 KV-cache scales the checkpoint ships (k_scale, v_scale, ...; by checkpoint
    # name): when there are any, they are used and start-up calibrates none.
    checkpoint_kv_scales: list[str] = dataclasses.field(default_factory=list)
    # The graph's constants: the spec's, with the checkpoint's values of its persistent buffers.
    constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def make_runner(self, kv_caches: list[torch.Tensor], states: dict[str, torch.Tensor] | None = None) -> ModelRunner:
        spec = self.prepared.spec
        return ModelRunner(self.prepared.graph_fn, spec.input_roles, self.weights, self.constants, kv_caches,
                           self.device, bucket_fns=self.prepared.bucket_fns, plan=self.prepared.plan,
                           states=states or {})


def load_model(config: EngineConfig, source: ModelSource, dtype: torch.dtype, device: torch.device,
               timings: dict[str, float], tp_rank: int = 0) -> LoadedModel:
    """The graph of rank `tp_rank` (of config.tensor_parallel_size) and that rank's weights.

    A sharded graph's weight transforms say which slice of each tensor the rank holds; the
    loader reads only those slices, then the other transforms (merged QKV / gate-up, FP8
    quantization) run. A pre-quantized checkpoint's FP8 tensors that the graph takes in FP8
    load as they are."""
    # With the model's config: a pre-quantized checkpoint implies quantization="fp8".
    options = dataclasses.replace(config.compile_options(source.config), tp_rank=tp_rank)
    prepared = prepare_for_engine(options, source.config, dtype, device, raw_config=source.raw_config)
    timings.update(prepared.report.timings)
    with timed(timings, "load weights"):
        transforms = prepared.spec.weight_transforms
        # FP8 quantization runs as each weight loads (load_time_quantizer): only the FP8
        # weights and one 16-bit tensor at a time need to fit.
        weights = source.load_weights(prepared.spec.param_aliases, dtype, device, progress=config.progress,
                                      keep_fp8=fp8_weight_names(transforms), shards=shard_transforms(transforms),
                                      on_tensor=load_time_quantizer(transforms),
                                      param_dtypes=prepared.spec.param_dtypes)
        # Tensors some checkpoints carry and others not (an FP8 KV cache's scales).
        optional = source.load_tensors_if_present(optional_checkpoint_names(transforms), device)
        weights.update(optional)
        # Layout passes (merged QKV / gate-up) declared how to build the tensors they take.
        weights = apply_weight_transforms(weights, transforms, skip_shards=True)
        constants = constants_from_checkpoint(prepared.spec.constants, prepared.spec.checkpoint_buffers, source)
    return LoadedModel(prepared=prepared, weights=weights, device=device, checkpoint_kv_scales=sorted(optional),
                       constants=constants)


def constants_from_checkpoint(constants: dict[str, torch.Tensor], checkpoint_buffers: dict[str, list[str]],
                              source: ModelSource) -> dict[str, torch.Tensor]:
    """`constants` with each persistent buffer the checkpoint stores (under any of its names)
    replaced by the checkpoint's value, in the captured constant's dtype. The captured value
    comes from the config alone: a DeepSeek-V3-style router's `e_score_correction_bias` is zero
    there and trained in the checkpoint. A checkpoint without it keeps the captured value (as
    transformers leaves a missing buffer at its initial value); one of another shape is an error."""
    names = [n for aliases in checkpoint_buffers.values() for n in aliases]
    stored = source.load_tensors_if_present(names, "cpu")
    out = dict(constants)
    for name, aliases in checkpoint_buffers.items():
        found = next((stored[a] for a in aliases if a in stored), None)
        if found is None or name not in out:
            continue
        if found.shape != out[name].shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(found.shape)}, but the model's config "
                             f"gives {tuple(out[name].shape)}: the checkpoint and its config.json disagree")
        out[name] = found.to(out[name].dtype)
    return out


def peak_memory(device: torch.device) -> dict[str, Any]:
    """This process's peak host memory (RSS) and, on CUDA, its peak device allocation, in bytes."""
    import resource

    out: dict[str, Any] = {"host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        out["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return out
