"""The model runner: turns a scheduled step into graph inputs, runs the graph, returns logits.

The graph's inputs are fed by role (see `kiln.compiler.capture`): weights by parameter name,
config-derived constants, one KV cache per layer, and the step's batch tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kiln.runtime.block_manager import BlockManager
from kiln.runtime.scheduler import SchedulerOutput

logger = logging.getLogger("kiln.runtime")


@dataclass
class StepInputs:
    """The batch tensors of one step (token-major, packed)."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    logits_indices: torch.Tensor  # [S] int64: the rows to sample

    def as_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.__dict__)


def prepare_step_inputs(step: SchedulerOutput, block_manager: BlockManager, device: torch.device | str) -> StepInputs:
    tokens: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    starts = [0]
    sample_rows: list[int] = []
    tables = []
    for item in step.scheduled:
        seq, n = item.seq, item.num_new_tokens
        begin = seq.num_computed_tokens
        ids = seq.all_token_ids
        tokens.extend(ids[begin:begin + n])
        positions.extend(range(begin, begin + n))
        slots.extend(block_manager.slot(seq, p) for p in range(begin, begin + n))
        seq_lens.append(begin + n)
        starts.append(starts[-1] + n)
        if item.samples:
            sample_rows.append(starts[-1] - 1)
        tables.append(seq.block_table)
    width = max(1, max(len(t) for t in tables))
    block_tables = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)

    def t(x: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(x, dtype=dtype)

    inputs = StepInputs(
        input_ids=t(tokens, torch.long).unsqueeze(0),
        position_ids=t(positions, torch.long).unsqueeze(0),
        slot_mapping=t(slots, torch.long),
        block_tables=block_tables,
        seq_lens=t(seq_lens, torch.int32),
        query_start_loc=t(starts, torch.int32),
        logits_indices=t(sample_rows, torch.long),
    )
    return StepInputs(**{k: v.to(device, non_blocking=True) for k, v in inputs.as_dict().items()})


class ModelRunner:
    """Holds the runnable graph, weights, constants and KV caches; runs one step."""

    def __init__(
        self,
        graph_fn: Callable[..., Any],
        input_roles: list[str],
        weights: dict[str, torch.Tensor],
        constants: dict[str, torch.Tensor],
        kv_caches: list[torch.Tensor],
        device: torch.device,
    ):
        self.graph_fn = graph_fn
        self.input_roles = input_roles
        self.kv_caches = kv_caches
        self.device = device
        # Fixed inputs resolved once; batch inputs are filled per step.
        self._fixed: list[torch.Tensor | None] = []
        self._batch_slots: list[tuple[int, str]] = []
        for i, role in enumerate(input_roles):
            kind, _, name = role.partition(":")
            if kind == "param":
                self._fixed.append(weights[name])
            elif kind == "constant":
                self._fixed.append(constants[name].to(device))
            elif kind == "kv_cache":
                self._fixed.append(kv_caches[int(name)])
            elif kind == "batch":
                self._fixed.append(None)
                self._batch_slots.append((i, name))
            else:
                raise ValueError(f"graph input role {role!r} is unknown to the runner")

    @torch.inference_mode()
    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Run one step; returns logits [S, V] (float32) for the rows in `logits_indices`."""
        args = list(self._fixed)
        batch = inputs.as_dict()
        for i, name in self._batch_slots:
            args[i] = batch[name]
        logits = self.graph_fn(*args)
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        return logits[0].float()


def allocate_kv_caches(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> list[torch.Tensor]:
    caches = []
    for _ in range(num_layers):
        # Uninitialised: attention only reads slots a sequence has written. The null block
        # (padding's target) is zeroed so padded rows never see NaN garbage.
        cache = torch.empty((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
        cache[:, 0].zero_()
        caches.append(cache)
    return caches
