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
from typing import Any, Iterable

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
        ranks = {p.dim() for p in parts}
        if len(ranks) != 1 or any(p.shape[:self.dim] + p.shape[self.dim + 1:] != parts[0].shape[:self.dim]
                                  + parts[0].shape[self.dim + 1:] for p in parts):
            raise WeightTransformError(
                f"cannot build {self.output!r}: shapes {[tuple(p.shape) for p in parts]} of "
                f"{', '.join(self.inputs)} do not line up along dim {self.dim}"
            )
        weights[self.output] = torch.cat(parts, dim=self.dim)


WeightTransform = ConcatWeights  # the only kind so far; a union when there are more

_KINDS: dict[str, type] = {"concat": ConcatWeights}


def apply_weight_transforms(weights: dict[str, torch.Tensor], transforms: Iterable[WeightTransform]
                            ) -> dict[str, torch.Tensor]:
    """The weights the rewritten graph takes, built in `weights` itself, which is returned.

    The dict is consumed on purpose: each merged input is removed (and freed, if nothing
    else holds it) as soon as its concatenation exists, so peak memory grows by one merged
    tensor at a time rather than by a second copy of most of the model.
    """
    for transform in transforms:
        transform.apply(weights)
    return weights


def transforms_to_json(transforms: Iterable[WeightTransform]) -> list[dict[str, Any]]:
    return [{**asdict(t), "inputs": list(t.inputs)} for t in transforms]


def transforms_from_json(data: list[dict[str, Any]]) -> list[WeightTransform]:
    out = []
    for i, item in enumerate(data):
        kind = item.get("kind")
        if kind not in _KINDS:
            raise WeightTransformError(f"weight transform #{i} has unknown kind {kind!r}; known: {', '.join(_KINDS)}")
        fields = {k: v for k, v in item.items() if k != "kind"}
        fields["inputs"] = tuple(fields.get("inputs", ()))
        out.append(_KINDS[kind](**fields))
    return out
