"""KV-scale calibration at start-up: per-layer FP8 KV-cache scales when the checkpoint has none.

An FP8 (e4m3) KV cache stores K / k_scale and V / v_scale (kiln.passes.kv_cache_scales). A
checkpoint calibrated by llm-compressor ships the scales; others get 1.0, which keeps values
up to 448 but loses the small ones: e4m3's normal range starts at 2^-6, and on SmolLM2 43% of
layer 0's V values fall below it. As vLLM's `calculate_kv_scales`, the engine then measures
them: one prefill of a fixed calibration input, recording each layer's amax(|K|) and amax(|V|)
as the cache write sees them (kiln.kernels.paged_attention.recording_kv_amax), and sets
scale = max(amax * margin / 448, floor).

The scales are graph inputs (one float32 [2] per layer), so they are overwritten in place:
the compiled artifacts and CUDA graphs, which read those tensors, stay valid as they are.

The input is 256 seeded random token ids (uniform below the vocabulary size, the same every
start): tokenizer-independent (any model, with or without a tokenizer), reproducible, and
never the text a test evaluates. It also measured better than text on SmolLM2-135M (FP8
weights + FP8 KV, perplexity over the first passage of tests/data/perplexity_text.txt, 428 tokens, unquantized 13.266;
figures of that one passage spread by ~1.5% between machines, README "FP8"):
random ids +1.6% (seed 0; seeds 1 and 2: +1.5%, +2.7%), a built-in English paragraph
+3.8%, the evaluated text itself +4.6%, scale 1.0 +4.6%. Text gave larger maxima in most
layers (layer 0's V: 1.6x) and so larger scales; our reading: they push more of the bulk of
the values below e4m3's normal range, while the few outliers random ids miss saturate at 448,
which costs less. vLLM
calibrates on the first real batch instead, which makes the scales depend on whichever
request comes first.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.compiler.graph_inputs import InputRole, RoleKind, single_prefill_step
from kiln.compiler.startup import timed
from kiln.kernels.paged_attention import recording_kv_amax
from kiln.passes.kv_cache_scales import SCALES_SUFFIX

FP8_E4M3_MAX = 448.0
# amax * margin maps to e4m3's top (448). 1.0, as llm-compressor writes them: a larger margin
# leaves room for prompts beyond the calibration maxima but pushes more small values below
# 2^-6 (SmolLM2, text calibration: margin 2 +4.3% perplexity vs 1 +3.8%; 0.5, saturating
# the largest values, +7.9%).
DEFAULT_MARGIN = 1.0
# No scale below this: a layer whose K or V is all zero (amax 0) would otherwise divide by
# zero; real amaxes are orders of magnitude above it.
MIN_KV_SCALE = 1e-6
# Tokens the calibration prefill runs (at most; fewer when the step budget or the cache is smaller).
CALIBRATION_TOKENS = 256

CALIBRATION_SEED = 0


def calibration_ids(vocab_size: int, num_tokens: int, seed: int = CALIBRATION_SEED) -> list[int]:
    """`num_tokens` seeded random ids below `vocab_size` (the same every start, so the same scales)."""
    if num_tokens < 1 or vocab_size < 1:
        raise ValueError(f"calibration needs at least one token of a non-empty vocabulary, got {num_tokens} "
                         f"tokens, vocab_size {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_tokens,), generator=g).tolist()


def kv_scale_inputs(input_roles: list[str]) -> list[tuple[int, str]]:
    """(argument index, parameter name) of every FP8 KV-cache scales input of a graph."""
    out = []
    for i, tag in enumerate(input_roles):
        role = InputRole.parse(tag)
        if role.kind is RoleKind.PARAM and role.name.endswith(f".{SCALES_SUFFIX}"):
            out.append((i, role.name))
    return out


def scales_from_amax(amax: torch.Tensor, margin: float = DEFAULT_MARGIN) -> torch.Tensor:
    """float32 [2] (k_scale, v_scale) = max(amax * margin / 448, MIN_KV_SCALE)."""
    if margin <= 0:
        raise ValueError(f"margin must be positive, got {margin}")
    return (amax.float() * margin / FP8_E4M3_MAX).clamp_min(MIN_KV_SCALE)


@torch.inference_mode()
def calibrate_kv_scales(runner: Any, names: list[str], input_ids: list[int], block_size: int,
                        margin: float = DEFAULT_MARGIN) -> dict[str, torch.Tensor]:
    """Run `input_ids` as one prefill on `runner` (a ModelRunner over the engine's FP8 KV
    cache, which must hold len(input_ids) tokens past the null block) and set the scales
    inputs named `names` to amax / 448 of the K and V each layer wrote, in place.

    Returns the new scales by name. The prefill writes into blocks 1.. of the cache, which no
    sequence owns yet (the engine calibrates before its block manager exists)."""
    absent = [n for n in names if f"param:{n}" not in runner.input_roles]
    if absent:
        raise ValueError(f"calibrate_kv_scales: the graph has no input for {absent[:3]}")
    # Measured at scale 1 (the uncalibrated default): the maxima are recorded before the
    # write divides, so no scale is needed to see them; 1 also keeps a second calibration of
    # the same runner from depending on the first.
    for name in names:
        runner.param_input(name).fill_(1.0)
    n = len(input_ids)
    step = single_prefill_step(n, block_size, input_ids=torch.tensor(input_ids, dtype=torch.long))
    with recording_kv_amax() as seen:
        runner.execute(step)
    out = {}
    for name in names:
        scales = runner.param_input(name)
        amax = seen.get(scales.data_ptr())
        if amax is None:
            raise RuntimeError(f"KV-scale calibration: no cache write of {name!r} was observed (its attention "
                               "op does not record K/V maxima on this device); start with calculate_kv_scales=False")
        scales.copy_(scales_from_amax(amax.to(scales.device), margin))
        out[name] = scales.detach().cpu().clone()
    return out


def kv_scales_at_startup(runner: Any, input_roles: list[str], checkpoint_scales: list[str], config: Any,
                         vocab_size: int, max_model_len: int, num_blocks: int,
                         timings: dict[str, float]) -> tuple[dict[str, torch.Tensor], str | None]:
    """An engine's (or a tensor-parallel rank's) FP8 KV-cache scales at start-up: the
    checkpoint's where it has them, 1.0 with `config.calculate_kv_scales` False, else calibrated
    on `runner` (over a cache of `num_blocks` blocks) by one prefill of real blocks (1..; block 0
    is the null block) within the step budget and `max_model_len` (`calibrate_kv_scales`, in
    place, before any request or CUDA-graph capture; its time goes into `timings`). Returns the calibrated scales by
    parameter name ({} when none were calibrated) and the line to log (None without an FP8 KV
    cache). The ranks of a tensor-parallel group each call it at once (the prefill's
    collectives need them all), each measuring the K/V heads it holds: per-rank scales, as
    vLLM's calculate_kv_scales gives."""
    names = [name for _, name in kv_scale_inputs(input_roles)]
    if not names:
        return {}, None
    if checkpoint_scales:
        return {}, f"FP8 KV cache: {len(checkpoint_scales)} scales from the checkpoint ({checkpoint_scales[0]}, ...)"
    if not config.calculate_kv_scales:
        return {}, "FP8 KV cache: no scales in the checkpoint, calculate_kv_scales=False: scale 1.0"
    room = min(config.max_num_batched_tokens, max_model_len, (num_blocks - 1) * config.block_size)
    num_tokens = min(CALIBRATION_TOKENS, room)
    with timed(timings, "calibrate KV scales"):
        scales = calibrate_kv_scales(runner, names, calibration_ids(vocab_size, num_tokens), config.block_size)
    return scales, (f"FP8 KV cache: no scales in the checkpoint; calibrated on {num_tokens} tokens: "
                    f"{describe_scales(scales)}")


def describe_scales(scales: dict[str, torch.Tensor]) -> str:
    """One line for the log: the range of the k and v scales over the layers."""
    stacked = torch.stack(list(scales.values()))
    k, v = stacked[:, 0], stacked[:, 1]
    return (f"{len(scales)} layers, k_scale {k.min().item():.3g}..{k.max().item():.3g}, "
            f"v_scale {v.min().item():.3g}..{v.max().item():.3g}")
