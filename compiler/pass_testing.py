"""Helpers for testing a pass as *before graph -> after graph* on a real captured model.

    from kiln.compiler.pass_testing import graph_for_pass, run_graph

    before = graph_for_pass(config, "my_fusion", dtype=torch.float32)  # what my_fusion receives
    after = before.copy()
    stats = after.run_pass(MyFusion())      # as the pass manager runs it (dead code removed, verified)
    torch.testing.assert_close(run_graph(after), run_graph(before))

`graph_for_pass` runs exactly the passes the engine runs before the named pass (the same
`PassManager.default(enable, disable)`, in the same phase and order, with the built-in
fusions' device policy: on CPU the custom-op fusions skip unless KILN_CPU_FUSIONS=1 or
`cpu_fusions=True`), so a pattern written from a `kiln passes show` dump meets the same
graph here. `run_graph` feeds every graph input by its `kiln_input` role: seeded random
weights (or real ones, by their Hugging Face names) with the weight transforms of the
layout passes that ran (merged QKV / gate-up, as the loader applies them), the captured
constants, a one-sequence batch of `num_tokens` tokens and fresh KV caches.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.compiler.capture import CapturedModel, capture, parameter_shapes
from kiln.compiler.graph_inputs import StepInputs, bind, graph_input_roles, single_prefill_step
from kiln.kernels.recurrent_states import allocate_state_caches
from kiln.kernels.paged_attention import kv_cache_shape
from kiln.passes.base import GraphPass, PassContext, PassStats
from kiln.passes.fuse_common import CudaByDefault
from kiln.passes.manager import PassManager, PassRecord, PassReport, verify_graph
from kiln.passes.registry import PHASES
from kiln.passes.weight_transforms import apply_weight_transforms


@dataclass
class PhaseCapture:
    """A captured model whose graph has been run through (part of) the pipeline.

    `context` is the `PassContext` the passes ran with: its `weight_transforms` are what the
    loader would apply to the checkpoint for this graph, so `run_graph` applies them too.
    """

    captured: CapturedModel
    report: PassReport
    block_size: int
    context: PassContext = field(default_factory=lambda: PassContext(config=None))
    pipeline: list[str] = field(default_factory=list)  # names of the passes that ran, in order

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.captured.graph_module

    @property
    def config(self) -> Any:
        return self.captured.config

    @property
    def dtype(self) -> torch.dtype:
        return self.captured.dtype

    def copy(self) -> "PhaseCapture":
        """An independent copy (graph, report, context) to run a pass on."""
        return PhaseCapture(captured=copy.deepcopy(self.captured), report=copy.deepcopy(self.report),
                            block_size=self.block_size, context=copy.deepcopy(self.context),
                            pipeline=list(self.pipeline))

    def run_pass(self, graph_pass: GraphPass) -> PassStats:
        """Run one pass on this graph as the pass manager does: with this capture's context,
        then dead-code elimination and the manager's checks (lint, input roles, codegen)."""
        gm = self.graph_module
        stats = dict(graph_pass(gm, self.context) or {})
        gm.graph.eliminate_dead_code()
        verify_graph(gm, graph_pass.name)
        self.report.records.append(PassRecord(phase=graph_pass.phase, name=graph_pass.name,
                                              uuid=graph_pass.uuid(), stats=stats))
        self.pipeline.append(graph_pass.name)
        return stats


def _pipeline(enable: list[str] | None, disable: list[str] | None, cpu_fusions: bool | None) -> PassManager:
    pm = PassManager.default(enable=enable, disable=disable)
    if cpu_fusions is not None:
        for p in pm.passes:
            if isinstance(p, CudaByDefault):
                p.on_cpu = cpu_fusions
    return pm


def _run(config: Any, passes: list[GraphPass], dtype: torch.dtype, device: torch.device | str,
         block_size: int, tp_size: int = 1, tp_rank: int = 0) -> PhaseCapture:
    captured = capture(config, dtype=dtype, device=device)
    ctx = PassContext(config=config, dtype=dtype, tp_size=tp_size, tp_rank=tp_rank)
    report = PassManager(passes).run(captured.graph_module, ctx)
    return PhaseCapture(captured=captured, report=report, block_size=block_size, context=ctx,
                        pipeline=[p.name for p in passes])


def graph_for_pass(config: Any, graph_pass: str | GraphPass, dtype: torch.dtype = torch.float32,
                   device: torch.device | str = "cpu", enable: list[str] | None = None,
                   disable: list[str] | None = None, cpu_fusions: bool | None = None,
                   block_size: int = 16, tp_size: int = 1, tp_rank: int = 0) -> PhaseCapture:
    """The graph `graph_pass` (a name, or a pass object) receives in the engine's pipeline.

    The pipeline is the engine's: `PassManager.default(enable, disable)` (built-ins plus
    the plugins named in `enable` or $KILN_ENABLE_PASSES, minus `disable`), captured on
    `device` in `dtype`. Every pass before it runs, in the manager's order; a pass that is
    not enabled is placed where enabling it would put it (last in its phase). `cpu_fusions`
    overrides the built-in fusions' CPU policy (None: $KILN_CPU_FUSIONS, as the engine).
    `tp_size` / `tp_rank`: the graph of that rank of a tensor-parallel group.
    """
    name = graph_pass if isinstance(graph_pass, str) else graph_pass.name
    pm = _pipeline(enable, disable, cpu_fusions)
    if not isinstance(graph_pass, str) and name not in {p.name for p in pm.passes}:
        # An object not registered (a pass under development): place it as enabling would.
        pm = PassManager(list(pm.passes) + [graph_pass])
    before, _ = pm.split_at(name)
    return _run(config, before, dtype, device, block_size, tp_size, tp_rank)


def capture_through(config: Any, phase: str, dtype: torch.dtype = torch.float32, block_size: int = 16,
                    pass_manager: PassManager | None = None, inclusive: bool = False,
                    device: torch.device | str = "cpu", tp_size: int = 1, tp_rank: int = 0) -> PhaseCapture:
    """Capture `config` and run the pipeline's passes of the phases before `phase` (and of
    `phase` itself when `inclusive`). A pass of `phase` receives more than this (the
    earlier passes of its own phase): use `graph_for_pass` for that graph."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r} is not one of {', '.join(PHASES)}")
    pm = pass_manager or PassManager.default()
    limit = PHASES.index(phase) + (1 if inclusive else 0)
    passes = [p for p in pm.passes if PHASES.index(p.phase) < limit]
    return _run(config, passes, dtype, device, block_size, tp_size, tp_rank)


def random_weights(captured: CapturedModel, seed: int = 0, std: float = 0.08) -> dict[str, torch.Tensor]:
    shapes = parameter_shapes(captured.config)
    g = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(shapes[name], generator=g) * std).to(captured.param_dtypes.get(name, captured.dtype))
            for name in captured.param_aliases}


def single_sequence_batch(num_tokens: int, block_size: int, vocab_size: int, seed: int = 0) -> StepInputs:
    """One prefill of `num_tokens` random tokens in blocks 1.. (block 0 is the null block), sampling the last."""
    g = torch.Generator().manual_seed(seed)
    return single_prefill_step(num_tokens, block_size, input_ids=torch.randint(0, vocab_size, (1, num_tokens), generator=g))


def run_graph(phase_capture: PhaseCapture, num_tokens: int = 8, seed: int = 0,
              weights: dict[str, torch.Tensor] | None = None, sample_all_rows: bool = False) -> torch.Tensor:
    """Run the graph once; returns its output (logits).

    `weights` maps Hugging Face parameter names to tensors (a checkpoint's, or
    `model.state_dict()`); without it, seeded random ones. Either way the layout passes'
    weight transforms (merged QKV / gate-up) are applied as the loader applies them, so
    graphs after the merge passes run too. The same seed gives the same weights and tokens
    to every graph of one model, so the outputs of a graph before and after a pass compare.
    """
    return run_captured(phase_capture.captured, phase_capture.block_size, num_tokens, seed, weights=weights,
                        sample_all_rows=sample_all_rows, transforms=phase_capture.context.weight_transforms,
                        tp_size=phase_capture.context.tp_size)


def run_captured(captured: CapturedModel, block_size: int, num_tokens: int = 8, seed: int = 0,
                 weights: dict[str, torch.Tensor] | None = None, sample_all_rows: bool = False,
                 transforms: list[Any] | None = None, tp_size: int = 1) -> torch.Tensor:
    """`run_graph` for any captured graph: `weights` (by Hugging Face name) replace the seeded
    random ones, `transforms` (a PassContext's weight_transforms) are applied to them as the
    loader does, `sample_all_rows` samples every token's row."""
    config = captured.config
    if weights is None:
        weights = random_weights(captured, seed=seed)
    else:
        weights = {name: t.to(captured.param_dtypes.get(name, captured.dtype))  # a copy: transforms consume it
                   for name, t in weights.items()}
    weights = apply_weight_transforms(weights, transforms or [])
    batch = single_sequence_batch(num_tokens, block_size, config.vocab_size, seed=seed)
    if sample_all_rows:
        batch["logits_indices"] = torch.arange(num_tokens)
    num_blocks = -(-num_tokens // block_size) + 1
    args = bind(graph_input_roles(captured.graph_module), params=weights, constants=captured.constants,
                kv_caches=lambda layer: torch.zeros(kv_cache_shape(config, num_blocks, block_size, tp_size, int(layer)),
                                                    dtype=captured.dtype),
                batch=batch, states=allocate_state_caches(config, 2, captured.dtype, "cpu", tp_size))
    with torch.no_grad():
        return captured.graph_module(*args)


__all__ = ["PhaseCapture", "capture_through", "graph_for_pass", "random_weights", "run_captured", "run_graph", "single_sequence_batch"]
