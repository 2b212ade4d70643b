"""Helpers for testing a pass as *before graph -> after graph* on a real captured model.

    from kiln.compiler.pass_testing import capture_through, run_graph

    before = capture_through(config, "fusion", dtype=torch.float32)   # graph a fusion pass sees
    after = copy.deepcopy(before)
    stats = MyPass()(after.graph_module, PassContext(config=config))
    torch.testing.assert_close(run_graph(after), run_graph(before))

`run_graph` feeds every graph input by its `kiln_input` role: seeded random weights,
the captured constants, a one-sequence batch of `num_tokens` tokens (with the paged-KV
metadata and fresh KV caches when the graph has them), so it runs the graph at any phase.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from kiln.compiler.capture import CapturedModel, capture, parameter_shapes
from kiln.compiler.graph_inputs import StepInputs, bind, graph_input_roles, single_prefill_step
from kiln.kernels.paged_attention import kv_cache_shape
from kiln.passes.base import PassContext
from kiln.passes.manager import PassManager, PassReport
from kiln.passes.registry import PHASES


@dataclass
class PhaseCapture:
    """A captured model whose graph has been run through the pipeline up to a phase."""

    captured: CapturedModel
    report: PassReport
    block_size: int

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.captured.graph_module

    def copy(self) -> "PhaseCapture":
        return PhaseCapture(captured=copy.deepcopy(self.captured), report=self.report, block_size=self.block_size)


def capture_through(config: Any, phase: str, dtype: torch.dtype = torch.float32, block_size: int = 16,
                    pass_manager: PassManager | None = None, inclusive: bool = False) -> PhaseCapture:
    """Capture `config` and run the pipeline's passes of the phases before `phase`
    (and of `phase` itself when `inclusive`): the graph a pass of that phase receives."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
    pm = pass_manager or PassManager.default()
    limit = PHASES.index(phase) + (1 if inclusive else 0)
    passes = [p for p in pm.passes if PHASES.index(p.phase) < limit]
    captured = capture(config, dtype=dtype, device="cpu")
    report = PassManager(passes).run(captured.graph_module, PassContext(config=config, dtype=dtype))
    return PhaseCapture(captured=captured, report=report, block_size=block_size)


def random_weights(captured: CapturedModel, seed: int = 0, std: float = 0.08) -> dict[str, torch.Tensor]:
    shapes = parameter_shapes(captured.config)
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shapes[name], generator=g) * std).to(captured.dtype) for name in captured.param_aliases}


def single_sequence_batch(num_tokens: int, block_size: int, vocab_size: int, seed: int = 0) -> StepInputs:
    """One prefill of `num_tokens` random tokens in blocks 1.. (block 0 is the null block), sampling the last."""
    g = torch.Generator().manual_seed(seed)
    return single_prefill_step(num_tokens, block_size, input_ids=torch.randint(0, vocab_size, (1, num_tokens), generator=g))


def run_graph(phase_capture: PhaseCapture, num_tokens: int = 8, seed: int = 0) -> torch.Tensor:
    """Run the graph once on seeded random weights and tokens; returns its output (logits)."""
    return run_captured(phase_capture.captured, phase_capture.block_size, num_tokens, seed)


def run_captured(captured: CapturedModel, block_size: int, num_tokens: int = 8, seed: int = 0,
                 weights: dict[str, torch.Tensor] | None = None, sample_all_rows: bool = False) -> torch.Tensor:
    """`run_graph` for any captured graph: `weights` replace the seeded random ones (e.g.
    merged as the loader merges them), `sample_all_rows` samples every token's row."""
    config = captured.config
    weights = random_weights(captured, seed=seed) if weights is None else weights
    batch = single_sequence_batch(num_tokens, block_size, config.vocab_size, seed=seed)
    if sample_all_rows:
        batch["logits_indices"] = torch.arange(num_tokens)
    num_blocks = -(-num_tokens // block_size) + 1
    args = bind(graph_input_roles(captured.graph_module), params=weights, constants=captured.constants,
                kv_caches=lambda layer: torch.zeros(kv_cache_shape(config, num_blocks, block_size), dtype=captured.dtype),
                batch=batch)
    with torch.no_grad():
        return captured.graph_module(*args)


__all__ = ["PhaseCapture", "capture_through", "random_weights", "run_captured", "run_graph", "single_sequence_batch"]
