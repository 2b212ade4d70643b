"""From a model config to the post-pass graph the runtime runs: capture, then passes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
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

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.captured.graph_module

    def input_roles(self) -> list[str]:
        return self.captured.input_roles()


def build_model_graph(
    config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    block_size: int = 16,
    pass_manager: PassManager | None = None,
    max_num_tokens: int = 8192,
) -> ModelGraph:
    pm = pass_manager or PassManager.default()
    captured = capture(config, dtype=dtype, device=device, max_num_tokens=max_num_tokens)
    ctx = PassContext(config=config, dtype=dtype, block_size=block_size)
    report = pm.run(captured.graph_module, ctx)
    return ModelGraph(captured=captured, report=report, pass_manager=pm)
