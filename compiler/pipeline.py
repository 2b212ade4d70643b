"""From a model config to the post-pass graph the runtime runs: capture, then passes.

`GraphSpec` is everything the runtime needs from that graph besides a compiled artifact:
the input roles in call order, the checkpoint names of each parameter, the config-derived
constants (RoPE's inv_freq), the weight transforms of layout passes, and the pass report.
The compile cache stores it once per model (kiln.compiler.startup), so a warm start needs no
capture at all: it reads the spec, loads weights by its names and calls the artifacts.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compiler.capture import CapturedModel, capture
from kiln.passes.base import PassContext
from kiln.passes.manager import PassManager, PassReport

logger = logging.getLogger("kiln.compiler")


@dataclass
class ModelGraph:
    """The rewritten graph with what it needs at run time (not weights)."""

    captured: CapturedModel
    report: PassReport
    pass_manager: PassManager
    # Layout changes the loader applies to checkpoint tensors (merged QKV / gate-up), see
    # kiln.passes.weight_transforms; the runtime calls apply_weight_transforms after loading.
    weight_transforms: list[Any] = field(default_factory=list)

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.captured.graph_module

    def input_roles(self) -> list[str]:
        return self.captured.input_roles()

    def spec(self) -> "GraphSpec":
        from kiln.passes.weight_transforms import transforms_to_json

        return GraphSpec(
            input_roles=self.input_roles(),
            param_aliases={k: list(v) for k, v in self.captured.param_aliases.items()},
            constants={k: v.detach().cpu().clone() for k, v in self.captured.constants.items()},
            weight_transforms_json=transforms_to_json(self.weight_transforms),
            pass_records=[{"phase": r.phase, "name": r.name, "uuid": r.uuid, "stats": dict(r.stats)}
                          for r in self.report.records],
            checkpoint_buffers={k: list(v) for k, v in self.captured.checkpoint_buffers.items()},
            param_dtype_names={k: str(v).removeprefix("torch.") for k, v in self.captured.param_dtypes.items()},
        )


# 2: checkpoint_buffers, param_dtype_names (specs of format 1 are dropped and built again).
GRAPH_SPEC_FORMAT = 2


class GraphSpecError(ValueError):
    """A stored graph spec that cannot be read (wrong format or damaged)."""


@dataclass
class GraphSpec:
    """What the runtime feeds a compiled graph, without the graph itself (see module doc)."""

    input_roles: list[str]
    param_aliases: dict[str, list[str]]
    constants: dict[str, torch.Tensor]
    weight_transforms_json: list[dict[str, Any]] = field(default_factory=list)
    pass_records: list[dict[str, Any]] = field(default_factory=list)
    # Constants a checkpoint may hold values of (kiln.compiler.capture.CapturedModel).
    checkpoint_buffers: dict[str, list[str]] = field(default_factory=dict)
    # Parameters loaded in another dtype than the model's, by dtype name ("float32").
    param_dtype_names: dict[str, str] = field(default_factory=dict)

    @property
    def param_dtypes(self) -> dict[str, torch.dtype]:
        return {k: getattr(torch, v) for k, v in self.param_dtype_names.items()}

    @property
    def weight_transforms(self) -> list[Any]:
        from kiln.passes.weight_transforms import transforms_from_json

        return transforms_from_json(self.weight_transforms_json)

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        torch.save({
            "format": GRAPH_SPEC_FORMAT, "input_roles": self.input_roles, "param_aliases": self.param_aliases,
            "constants": self.constants, "weight_transforms": self.weight_transforms_json,
            "pass_records": self.pass_records, "checkpoint_buffers": self.checkpoint_buffers,
            "param_dtype_names": self.param_dtype_names,
        }, buf)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> "GraphSpec":
        try:
            raw = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as e:  # a damaged zip/pickle raises many kinds
            raise GraphSpecError(f"cannot read graph spec: {e}") from e
        if not isinstance(raw, dict) or raw.get("format") != GRAPH_SPEC_FORMAT:
            raise GraphSpecError(f"graph spec has format {raw.get('format') if isinstance(raw, dict) else '?'}, "
                                 f"expected {GRAPH_SPEC_FORMAT}")
        return cls(input_roles=list(raw["input_roles"]), param_aliases=dict(raw["param_aliases"]),
                   constants=dict(raw["constants"]), weight_transforms_json=list(raw["weight_transforms"]),
                   pass_records=list(raw["pass_records"]), checkpoint_buffers=dict(raw["checkpoint_buffers"]),
                   param_dtype_names=dict(raw["param_dtype_names"]))


def build_model_graph(
    config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    block_size: int = 16,
    pass_manager: PassManager | None = None,
    max_num_tokens: int = 8192,
    tp_size: int = 1,
    tp_rank: int = 0,
) -> ModelGraph:
    pm = pass_manager or PassManager.default()
    if hasattr(config, "to_transformers"):  # a warm start's ConfigSnapshot (kiln.compiler.model_source)
        config = config.to_transformers()
    captured = capture(config, dtype=dtype, device=device, max_num_tokens=max_num_tokens)
    ctx = PassContext(config=config, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank)
    report = pm.run(captured.graph_module, ctx)
    return ModelGraph(captured=captured, report=report, pass_manager=pm, weight_transforms=ctx.weight_transforms)
