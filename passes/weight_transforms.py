"""Weight transforms: how a pass that changes parameter layout tells the loader what to do.

A pass that merges projections (QKV, gate/up) rewrites the graph to take one new input,
role `param:<new name>`, in place of the inputs of the tensors it merged, and records a
`ConcatWeights` in `PassContext.weight_transforms`. After loading the checkpoint's tensors
by their Hugging Face names (`CapturedModel.param_aliases`, unchanged by passes), the
engine calls `apply_weight_transforms(weights, transforms)` once; the result maps every
`param:` role of the rewritten graph to a tensor.

Transforms are plain data (strings and ints), so the compile cache can store them with the
graph (`transforms_to_json` / `transforms_from_json`): a warm start that loads a cached
graph must apply the same transforms, or the graph would ask for weights that do not exist.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable

import torch


class WeightTransformError(ValueError):
    """A transform that cannot be applied to the loaded weights; the message names the tensor."""


@dataclass(frozen=True)
class ConcatWeights:
    """`weights[output] = cat([weights[i] for i in inputs], dim)`; the inputs are dropped."""

    output: str
    inputs: tuple[str, ...]
    dim: int = 0
    kind: str = "concat"

    def apply(self, weights: dict[str, torch.Tensor]) -> None:
        missing = [name for name in self.inputs if name not in weights]
        if missing:
            raise WeightTransformError(
                f"cannot build {self.output!r}: the loaded weights lack {', '.join(repr(m) for m in missing)} "
                "(the checkpoint does not match the graph's architecture, or a transform ran twice)"
            )
        parts = [weights.pop(name) for name in self.inputs]
        if any(p.dtype.is_floating_point and p.element_size() == 1 for p in parts):
            # FP8 parts of a pre-quantized checkpoint: their scales are concatenated too,
            # per output channel (a per-tensor scale repeated over its rows).
            scales = [_row_scales(name, weights, p.shape[0]) for name, p in zip(self.inputs, parts)]
            if self.dim != 0:
                raise WeightTransformError(f"cannot build {self.output!r}: FP8 weights concatenate along dim 0 only")
            weights[fp8_scale_name(self.output)] = torch.cat(scales)
        ranks = {p.dim() for p in parts}
        if len(ranks) != 1 or any(p.shape[:self.dim] + p.shape[self.dim + 1:] != parts[0].shape[:self.dim]
                                  + parts[0].shape[self.dim + 1:] for p in parts):
            raise WeightTransformError(
                f"cannot build {self.output!r}: shapes {[tuple(p.shape) for p in parts]} of "
                f"{', '.join(self.inputs)} do not line up along dim {self.dim}"
            )
        weights[self.output] = torch.cat(parts, dim=self.dim)


@dataclass(frozen=True)
class RearrangeExperts:
    """`weights[output]` = `weights[input]` (dropped) in `kiln::moe_experts`' layout: with
    `transpose`, its last two dimensions swapped (GPT-OSS keeps experts as [E, in, out]); with
    `deinterleave`, its output channels (dim 1: a weight's rows once transposed, a bias's
    columns), which alternate gate, up, reordered as every gate channel, then every up one."""

    output: str
    input: str
    transpose: bool = False
    deinterleave: bool = False
    kind: str = "rearrange_experts"

    def apply(self, weights: dict[str, torch.Tensor]) -> None:
        if self.input not in weights:
            raise WeightTransformError(f"cannot build {self.output!r}: the loaded weights lack {self.input!r}")
        w = weights.pop(self.input)
        if self.transpose:
            w = w.transpose(1, 2)
        if self.deinterleave:
            if w.shape[1] % 2:
                raise WeightTransformError(f"cannot build {self.output!r}: {self.input!r} has {w.shape[1]} "
                                           "output channels, not gate/up pairs")
            w = torch.cat([w[:, 0::2], w[:, 1::2]], dim=1)
        weights[self.output] = w.contiguous()


def fp8_scale_name(weight_name: str) -> str:
    """Where an FP8 weight's per-output-channel scale lives in the weights dict (and its graph
    input's `param:` role): `<name>_scale`, which is also compressed-tensors' checkpoint name
    (`...q_proj.weight_scale`), so the loader stores a checkpoint's scales under it as read."""
    return weight_name + "_scale"


def _row_scales(name: str, weights: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
    """The [rows] float32 scales of FP8 weight `name` (a per-tensor scale repeated)."""
    scale_name = fp8_scale_name(name)
    if scale_name not in weights:
        raise WeightTransformError(f"FP8 weight {name!r} has no scale {scale_name!r} (a pre-quantized checkpoint "
                                   "must carry one scale per tensor or per output channel)")
    scale = weights.pop(scale_name).float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(rows)
    if scale.numel() != rows:
        raise WeightTransformError(f"FP8 weight {name!r} has {rows} output channels but its scale has "
                                   f"{scale.numel()} values (only per-tensor and per-channel scales are supported)")
    return scale.contiguous()


@dataclass(frozen=True)
class QuantizeFP8Weight:
    """`weights[weight]` as e4m3 with one float32 scale per output channel at
    `weights[fp8_scale_name(weight)]` (stacked experts [E, N, K]: per expert and channel,
    [E, N]). A weight already in FP8 (a pre-quantized checkpoint, its scale loaded beside it)
    keeps its values; its scale is only brought to that form."""

    weight: str
    kind: str = "quantize_fp8"

    def apply(self, weights: dict[str, torch.Tensor]) -> None:
        from kiln.kernels.fp8 import FP8_DTYPE, quantize_fp8_rows, quantize_fp8_rowwise

        if self.weight not in weights:
            raise WeightTransformError(f"cannot quantize {self.weight!r}: the loaded weights lack it")
        w = weights.pop(self.weight)
        if w.dim() == 3:  # stacked MoE experts [E, N, K]: one scale per expert and output channel, [E, N]
            scale = weights.get(fp8_scale_name(self.weight))
            if w.dtype == FP8_DTYPE and scale is not None and tuple(scale.shape) == tuple(w.shape[:2]):
                weights[self.weight] = w  # quantized as it loaded (load_time_quantizer)
                return
            if w.dtype == FP8_DTYPE:
                # The loader dequantizes a checkpoint's per-expert FP8 tensors as it stacks them, so
                # a stacked FP8 tensor comes from elsewhere, without the scales to read it by.
                raise WeightTransformError(
                    f"cannot load {self.weight!r}: pre-quantized FP8 expert weights arrived stacked without "
                    "their scales; give them per expert (as on the Hub), with their scales, or in bf16/fp16")
            # One expert at a time: the float32 temporaries of a whole layer's experts (Mixtral:
            # 3.8 GB each) would sit beside every other weight already loaded.
            if _fragments(w):
                # The result first, in memory of its own: else the allocator carves it out of
                # the last layer's freed 16-bit experts, and the rest of each such block stays
                # reserved and unusable (Mixtral: 26 GiB, and the KV cache's allocation failed).
                torch.cuda.empty_cache()
            wq = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
            scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):
                q, s = quantize_fp8_rows(w[e])
                wq[e], scale[e] = q, s.squeeze(-1)
            weights[self.weight] = wq
            weights[fp8_scale_name(self.weight)] = scale
            return
        if w.dim() != 2:
            raise WeightTransformError(f"cannot quantize {self.weight!r} to FP8: it has shape {tuple(w.shape)}, "
                                       "not [out_features, in_features] (or [experts, out, in])")
        if w.dtype == FP8_DTYPE:
            scale = _row_scales(self.weight, weights, w.shape[0]).to(w.device)
        else:
            # A large weight's result in memory of its own, as for the experts above: allocated
            # right after the cache is emptied, before the quantization's temporaries.
            wq = None
            if _fragments(w):
                torch.cuda.empty_cache()
                wq = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
            q, scale = quantize_fp8_rowwise(w)
            w = q if wq is None else wq.copy_(q)
            del q
        weights[self.weight] = w.contiguous()
        weights[fp8_scale_name(self.weight)] = scale




# Weights from this size quantize into memory of their own (`_fragments`); below it what a
# freed block's rest pins is small, and emptying the cache for each weight would cost start-up
# time (each call gives the freed blocks back to the driver, and the next load takes them again).
FRAGMENTING_BYTES = 256 << 20


def _fragments(w: torch.Tensor) -> bool:
    """Whether quantizing CUDA weight `w` first empties the allocator's cache (FRAGMENTING_BYTES)."""
    return w.is_cuda and w.numel() * w.element_size() >= FRAGMENTING_BYTES


def load_time_quantizer(transforms: Iterable[WeightTransform]) -> Callable[[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """A loader hook (`ModelSource.load_weights`' `on_tensor`) that quantizes each weight the
    transforms will quantize to FP8 as soon as it is loaded, instead of after every 16-bit weight
    is on the device: a model fits when its FP8 weights do (Llama-3-70B: 70 GB, where its 140 GB
    of bf16 never fit one H200 at once). The parts of a merged weight (QKV, gate/up: concatenated
    along dim 0, the output channels) are quantized each on its own: per output channel scales
    make that the same e4m3 values and scales as quantizing their concatenation, which
    `ConcatWeights` and `QuantizeFP8Weight` then take as a pre-quantized checkpoint's. None when
    nothing is quantized."""
    transforms = list(transforms)
    quantized = {t.weight for t in transforms if isinstance(t, QuantizeFP8Weight)}
    if not quantized:
        return None
    early = set(quantized)
    for t in transforms:
        if isinstance(t, ConcatWeights) and t.output in quantized:
            # (FP8 parts concatenate along dim 0 only: other merges are quantized once built)
            (early.update if t.dim == 0 else early.difference_update)(t.inputs)
    if any(isinstance(t, ConcatWeights) and t.output in early and t.output not in quantized for t in transforms):
        return None  # a merge of merges: keep the order the transforms give

    def quantize_on_load(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        from kiln.kernels.fp8 import FP8_DTYPE

        if name not in early or tensor.dtype == FP8_DTYPE or tensor.dim() not in (2, 3):
            return {name: tensor}
        entry = {name: tensor}
        del tensor  # the 16-bit tensor is freed as soon as its e4m3 copy exists
        QuantizeFP8Weight(name).apply(entry)
        return entry

    return quantize_on_load


def fp8_weight_names(transforms: Iterable[WeightTransform]) -> frozenset[str]:
    """The checkpoint tensors the rewritten graph takes in FP8: each quantized weight, and the
    inputs of a concatenation whose output is quantized (the loader keeps those of an FP8
    checkpoint as they are; kiln.compiler.fp8_checkpoint)."""
    names: set[str] = set()
    for transform in reversed(list(transforms)):
        if isinstance(transform, QuantizeFP8Weight):
            names.add(transform.weight)
        elif isinstance(transform, ConcatWeights) and transform.output in names:
            names.update(transform.inputs)
    return frozenset(names)


@dataclass(frozen=True)
class ShardWeight:
    """One rank's slice of a tensor (tensor parallelism): `weights[name]` becomes the
    concatenation along `dim` of its `ranges` ([start, stop) each, in the full tensor),
    zero-padded to `size` along `dim` (a vocabulary that does not divide by the rank count).

    Several ranges serve a tensor that holds several projections side by side (a fused
    q/k/v or gate/up): each rank takes its part of each. The loader reads only these slices
    from the checkpoint (`read_shard`); `apply` cuts an already loaded full tensor (tests,
    weights made in memory)."""

    name: str
    dim: int
    ranges: tuple[tuple[int, int], ...]
    size: int
    kind: str = "shard"

    def apply(self, weights: dict[str, torch.Tensor]) -> None:
        if self.name not in weights:
            raise WeightTransformError(f"cannot shard {self.name!r}: the loaded weights lack it")
        weights[self.name] = self.read_shard(weights.pop(self.name))

    def read_shard(self, full: Any) -> torch.Tensor:
        """The shard from `full`: a tensor, or anything sliceable like one along `dim`
        (safetensors' `get_slice`, which then reads only these bytes)."""
        shape = tuple(full.shape) if isinstance(full, torch.Tensor) else tuple(full.get_shape())
        if self.dim >= len(shape) or any(not 0 <= a <= b <= shape[self.dim] for a, b in self.ranges):
            raise WeightTransformError(f"cannot shard {self.name!r} of shape {shape}: ranges {list(self.ranges)} "
                                       f"along dim {self.dim} do not fit (the checkpoint is of another shape)")
        lead = (slice(None),) * self.dim
        parts = [full[(*lead, slice(a, b))] for a, b in self.ranges]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        missing = self.size - out.shape[self.dim]
        if missing > 0:
            pad_shape = list(out.shape)
            pad_shape[self.dim] = missing
            out = torch.cat([out, out.new_zeros(pad_shape)], dim=self.dim)
        return out


@dataclass(frozen=True)
class KVCacheScales:
    """`weights[output]` = [k_scale, v_scale] float32, one layer's FP8 KV-cache scales, from
    the checkpoint tensors of attention module `attention` where it has them (vLLM's and
    llm-compressor's `k_scale` / `v_scale`, the older single `kv_scale`, or AutoFP8's
    `k_proj.output_scale` / `v_proj.output_scale`; loaded by `source_names`), else `default`
    (kiln.passes.kv_cache_scales says which)."""

    output: str
    attention: str
    default: float = 1.0
    kind: str = "kv_cache_scales"

    def source_names(self) -> list[str]:
        a = self.attention
        return [f"{a}.k_scale", f"{a}.v_scale", f"{a}.kv_scale", f"{a}.k_proj.output_scale",
                f"{a}.v_proj.output_scale"]

    def apply(self, weights: dict[str, torch.Tensor]) -> None:
        found = {name: weights.pop(name) for name in self.source_names() if name in weights}
        a = self.attention
        scales = []
        for which in ("k", "v"):
            name = next((n for n in (f"{a}.{which}_scale", f"{a}.{which}_proj.output_scale", f"{a}.kv_scale")
                         if n in found), None)
            if name is None:
                scales.append(self.default)
                continue
            value = found[name].float().reshape(-1)
            if value.numel() != 1 or not torch.isfinite(value).all() or value.item() <= 0:
                raise WeightTransformError(f"KV-cache scale {name!r} must be one positive finite value, got "
                                           f"{value.tolist()[:4]} (per-head KV scales are not supported)")
            scales.append(value.item())
        device = next((t.device for t in weights.values()), torch.device("cpu"))
        weights[self.output] = torch.tensor(scales, dtype=torch.float32, device=device)


def optional_checkpoint_names(transforms: Iterable[Any]) -> list[str]:
    """Checkpoint tensors the transforms use where the checkpoint has them (KV-cache scales)."""
    return [name for t in transforms if isinstance(t, KVCacheScales) for name in t.source_names()]


WeightTransform = ConcatWeights | QuantizeFP8Weight | ShardWeight | KVCacheScales | RearrangeExperts

_KINDS: dict[str, type] = {"concat": ConcatWeights, "quantize_fp8": QuantizeFP8Weight, "shard": ShardWeight,
                           "kv_cache_scales": KVCacheScales, "rearrange_experts": RearrangeExperts}


def shard_transforms(transforms: Iterable[WeightTransform]) -> dict[str, ShardWeight]:
    """The shards among `transforms`, by tensor name: what the loader reads slice by slice
    (they precede every other transform, whose inputs they produce)."""
    return {t.name: t for t in transforms if isinstance(t, ShardWeight)}


def apply_weight_transforms(weights: dict[str, torch.Tensor], transforms: Iterable[WeightTransform],
                            skip_shards: bool = False) -> dict[str, torch.Tensor]:
    """The weights the rewritten graph takes, built in `weights` itself, which is returned.

    The dict is consumed on purpose: each merged input is removed (and freed, if nothing
    else holds it) as soon as its concatenation exists, so peak memory grows by one merged
    tensor at a time rather than by a second copy of most of the model.

    `skip_shards`: the weights were loaded already sharded (the loader read each rank's
    slices), so only the other transforms remain.
    """
    for transform in transforms:
        if not (skip_shards and isinstance(transform, ShardWeight)):
            transform.apply(weights)
    return weights


def transforms_to_json(transforms: Iterable[WeightTransform]) -> list[dict[str, Any]]:
    out = []
    for t in transforms:
        data = asdict(t)
        if isinstance(t, ConcatWeights):
            data["inputs"] = list(t.inputs)
        elif isinstance(t, ShardWeight):
            data["ranges"] = [list(r) for r in t.ranges]
        out.append(data)
    return out


def transforms_from_json(data: list[dict[str, Any]]) -> list[WeightTransform]:
    out = []
    for i, item in enumerate(data):
        kind = item.get("kind")
        if kind not in _KINDS:
            raise WeightTransformError(f"weight transform #{i} has unknown kind {kind!r}; known: {', '.join(_KINDS)}")
        fields = {k: v for k, v in item.items() if k != "kind"}
        if kind == "concat":
            fields["inputs"] = tuple(fields.get("inputs", ()))
        elif kind == "shard":
            fields["ranges"] = tuple(tuple(r) for r in fields.get("ranges", ()))
        out.append(_KINDS[kind](**fields))
    return out
