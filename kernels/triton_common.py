"""Small helpers shared by Kiln's Triton kernels (importing this module imports Triton).

Launchers built on these never synchronise with the GPU (no `.item()`, no host copies):
every launch decision comes from tensor shapes, so a launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4; without it, kernels launch as before
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _TRITON_HAS_PDL = True
except ImportError:  # pragma: no cover - both Tritons Kiln runs on have it
    _TRITON_HAS_PDL = False

# Programmatic dependent launch (PDL, sm_90 and newer): each Triton kernel of Kiln's is
# launched with `launch_pdl=True`, so the GPU may start its programs while the kernel before
# it in the stream is still finishing; every such kernel first waits (`griddepcontrol.wait`)
# until that kernel has completed and its writes are visible, then lets the next kernel
# launch. What overlaps is the launch and the programs' set-up with the previous kernel's
# last programs: a decode step at batch 1 is ~350 kernels of a few microseconds each.
# On the H200 (bench/RESULTS.md, Q1): decode at batch 1 +4.7% (bf16) and +6.8% (FP8).
# KILN_PDL=0 in the environment (read once, at import) launches them plainly.
PDL_ENABLED = os.environ.get("KILN_PDL", "1") != "0"
# Where a kernel lets the next one launch: after its wait (the default), so at most two
# kernels are resident at once (one running, the next at its wait), or right before it
# (`PDL_TRIGGER_FIRST`), so the kernel after the next can launch while the running one still
# runs, and its programs' loads before the wait (the GEMVs' first weight tiles) overlap it:
# at batch 1 the o projection's weights could stream during attention, which leaves most of
# the memory system idle. Correct either way: every kernel's wait returns only once the
# kernel before it has completed, which in turn waited for the one before. On the H200
# (bench/RESULTS.md, AA2), in every kernel: bf16 decode +1.7% at batch 1 (+0.1% at 8), FP8 +
# FP8 KV -0.4% / -2.1% (more programs resident at their waits may crowd the running one), so
# it is chosen per kernel family: `KILN_PDL_EARLY_TRIGGER` (read once, at import) is 0 (none),
# 1 (all), or a comma list of PDL_KERNEL_FAMILIES; unset, DEFAULT_EARLY_TRIGGER. By family
# (AB1, `bash bench/gpu_smoke.sh pdl_trigger_families_ab`, two runs each): the small kernels
# (norms, RoPE, attention, activation) first gave bf16 decode +2.4% at batch 1 (249.7 -> 255.6
# tokens/s) and FP8 + FP8 KV +0.2% / +0.03%; the GEMVs ("linear") first gave neither anything,
# and FP8's quantizing kernels first ("fp8_quant", AB6) cost FP8 decode 1.0% / 6.0% at batch
# 1 / 8. Why the one helps and the other hurts is not profiled: both let a GEMV launch during
# a short kernel; the FP8 GEMVs at 2-16 rows hold more programs than the bf16 one-row GEMV.
# A kernel's family is mostly its module's: "fp8" is the FP8 GEMVs (triton_fp8's and the
# fused ones of triton_fp8_fused_linear), "fp8_quant" triton_fp8's small kernels that make
# their input (per-token quantization, the quantizing RMSNorm, SiLU-and-mul-and-quantize: the
# FP8 model's counterparts of the small kernels the default names), "linear" the 16-bit
# GEMVs, "attention" the paged attention kernels and their cache writes.
PDL_KERNEL_FAMILIES = ("norm", "rope", "attention", "linear", "activation", "fp8", "fp8_quant", "moe")
PDL_TRIGGER_FIRST = 2  # the value of a kernel's `PDL` constexpr for it
DEFAULT_EARLY_TRIGGER = "norm,rope,attention,activation"


def parse_early_trigger(setting: str) -> frozenset[str]:
    """The kernel families a KILN_PDL_EARLY_TRIGGER value names (see PDL_KERNEL_FAMILIES)."""
    setting = setting.strip()
    if setting in ("", "0"):
        return frozenset()
    if setting in ("1", "all"):
        return frozenset(PDL_KERNEL_FAMILIES)
    families = frozenset(name.strip() for name in setting.split(",") if name.strip())
    unknown = sorted(families - set(PDL_KERNEL_FAMILIES))
    if unknown:
        raise ValueError(f"KILN_PDL_EARLY_TRIGGER={setting!r}: unknown kernel families {unknown}; "
                         f"use 0, 1, or a comma list of {', '.join(PDL_KERNEL_FAMILIES)}")
    return families


PDL_EARLY_TRIGGER = parse_early_trigger(os.environ.get("KILN_PDL_EARLY_TRIGGER", DEFAULT_EARLY_TRIGGER))
# The GEMVs (bf16 one row; FP8 one row and 2-16 rows) load their first K tile of weights
# before that wait (the weights are no earlier kernel's output): under PDL the loads of every
# program launched early are in flight while the previous kernel finishes, instead of
# starting after it. On the H200 (bench/RESULTS.md, R3): FP8 decode +1.3% at batch 1, +1.8%
# at 8; bf16 +1.2% at batch 1 (its 2-16-row kernel does without: -5% at 8 with it).
# KILN_GEMV_EARLY_TILE=0 in the environment (read once, at import) loads every tile after the wait.
GEMV_EARLY_TILE = os.environ.get("KILN_GEMV_EARLY_TILE", "1") != "0"
# The same for the RMSNorm kernels (kiln::rms_norm / add_rms_norm and their FP8-quantizing
# forms, two launches a decoder layer): their norm weight is loaded before the wait instead
# of after the row's sum of squares, where its load's latency sat on the step's critical
# path. On the H200 (bench/RESULTS.md, Y1, alternating): bf16 decode +0.5% at batch 1, +0.4%
# at 8; FP8 + FP8 KV +0.05% / +0.2%. KILN_NORM_EARLY_WEIGHT=0 (read once, at import) loads it
# after the sum of squares again.
NORM_EARLY_WEIGHT = os.environ.get("KILN_NORM_EARLY_WEIGHT", "1") != "0"


def pow2_at_least(n: int, minimum: int = 2) -> int:
    """The smallest power of two >= max(n, minimum): Triton block shapes must be powers of two
    (and blocks of one element are avoided: they are where compilers' corner cases live)."""
    return max(int(minimum), triton.next_power_of_2(max(int(n), 1)))


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device; "cuda" alone means the current one."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """SMs of a CUDA device; for CPU tensors (the Triton interpreter in tests) a small stand-in."""
    if device.type != "cuda":
        return 4
    return _sm_count(_cuda_index(device))


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def converts_e4m3_in_hardware(device: torch.device) -> bool:
    """Whether the device widens e4m3 pairs in one instruction (cvt.rn.f16x2.e4m3x2: sm_89 and
    newer); False for CPU tensors (the interpreter runs no inline assembly)."""
    if device.type != "cuda":
        return False
    return _capability(_cuda_index(device)) >= (8, 9)


@functools.cache
def _max_shared_memory(device_index: int) -> int:
    return int(triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"])


def max_shared_memory(device: torch.device) -> int:
    """Bytes of shared memory one program may use on a CUDA device (0 for CPU tensors: the
    interpreter, where launch shapes only need to be valid)."""
    if device.type != "cuda":
        return 0
    return _max_shared_memory(_cuda_index(device))


def uses_pdl(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch (see PDL_ENABLED)."""
    return (PDL_ENABLED and _TRITON_HAS_PDL and device.type == "cuda"
            and _capability(_cuda_index(device)) >= (9, 0))


def pdl_launch_args(device: torch.device, family: str) -> dict:
    """Keyword arguments for a launch of a kernel taking a `PDL: tl.constexpr` (which it passes
    to `wait_for_previous_kernel`): {PDL, launch_pdl} where `uses_pdl`, else nothing (the
    kernel's default, PDL=False: the interpreter runs no griddepcontrol); PDL is
    PDL_TRIGGER_FIRST where PDL_EARLY_TRIGGER names the kernel's `family`."""
    if family not in PDL_KERNEL_FAMILIES:
        raise ValueError(f"unknown PDL kernel family {family!r} (one of {PDL_KERNEL_FAMILIES})")
    if not uses_pdl(device):
        return {}
    return {"PDL": PDL_TRIGGER_FIRST if family in PDL_EARLY_TRIGGER else True, "launch_pdl": True}


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one has completed and its memory is
    visible, then let the next kernel's programs launch (they wait in turn); with PDL ==
    PDL_TRIGGER_FIRST, let them launch first, then wait. A kernel launched with `launch_pdl`
    must call this before it reads anything an earlier kernel wrote, and before it writes
    anything (computing addresses, and loading weights, may come first)."""
    if PDL == 2:  # PDL_TRIGGER_FIRST (a jit function reads no module global but a constexpr)
        gdc_launch_dependents()
        gdc_wait()
    elif PDL:
        gdc_wait()
        gdc_launch_dependents()


def num_warps_for(block_elements: int) -> int:
    """Warps for a one-row-per-program kernel touching `block_elements` elements."""
    if block_elements >= 8192:
        return 16
    if block_elements >= 2048:
        return 8
    return 4


@triton.jit
def e4m3_to_f16(x):
    """e4m3 -> f16 in a kernel, four values a call (two cvt.rn.f16x2.e4m3x2: sm_89 and newer,
    see `converts_e4m3_in_hardware`). Inline assembly: CUDA only, not interpreted."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def kv_split_range(kv_lo, kv_hi, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [kv_lo, kv_hi) of KV split `split` of NUM_SPLITS (flash-decoding): equal chunks,
    each a whole number of BLOCK_N tiles; the last may be short or empty."""
    if NUM_SPLITS > 1:
        chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_lo + split * chunk
        kv_hi = tl.minimum(kv_hi, kv_lo + chunk)
    return kv_lo, kv_hi


@triton.jit
def online_softmax_start(sinks_ptr, heads, heads_ok, split, ROWS: tl.constexpr, SINKS: tl.constexpr):
    """(running max, running sum) of ROWS rows' online softmax before their first key: -inf and
    0; with attention sinks (SINKS, `sinks_ptr` [Hq], the rows' `heads`) each row's head's sink
    and 1 (exp(sink - sink)), the sink being one more logit of the row with no value. Only the
    first KV split starts there, so a split-K combine counts each sink once."""
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    if SINKS:
        if split == 0:
            m_i = tl.load(sinks_ptr + heads, mask=heads_ok, other=0.0).to(tl.float32)
            l_i = tl.full([ROWS], 1.0, tl.float32)
    return m_i, l_i


@triton.jit
def locate_query_tile(query_start_loc_ptr, num_seqs, tile_id, BLOCK_T: tl.constexpr, SEQ_CHUNK: tl.constexpr):
    """Where query tile `tile_id` of a paged attention launch lies: (its sequence, the
    sequence's first row in q, its new tokens, the tile's first token among them; past them
    the tile has nothing to do). Sequence b owns the tiles from query_start_loc[b] // BLOCK_T +
    b on (`kiln.kernels.triton_paged_attention`'s numbering): it is the count of sequences
    whose first tile is at or before this one, minus one, SEQ_CHUNK starts at a time."""
    seq = -1
    for chunk in range(0, num_seqs, SEQ_CHUNK):
        offs_b = chunk + tl.arange(0, SEQ_CHUNK)
        q_starts = tl.load(query_start_loc_ptr + offs_b, mask=offs_b < num_seqs, other=0)
        tile_starts = tl.where(offs_b < num_seqs, q_starts // BLOCK_T + offs_b, 2147483647)
        seq += tl.sum((tile_starts <= tile_id).to(tl.int32), axis=0)
    q_start = tl.load(query_start_loc_ptr + seq)
    n_new = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tok0 = (tile_id - (q_start // BLOCK_T + seq)) * BLOCK_T
    return seq, q_start, n_new, tok0


@triton.jit
def zero_padded_rows(out_ptr, query_start_loc_ptr, num_seqs, num_tokens, first, step, kv_head, stride_ot, stride_oh,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """Zero the attention output of KV head `kv_head`'s GROUP query heads in the rows of
    padded tokens (those after the last sequence's, query_start_loc[num_seqs]), rows
    `first`, `first + step`, ... of them: the attention kernels spread these rows over their
    programs, so that their launcher need not fill the whole output with zeros first."""
    heads = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    zeros = tl.zeros([GROUP_PAD, D_PAD], tl.float32).to(out_ptr.dtype.element_ty)
    mask = (heads < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    for row in range(tl.load(query_start_loc_ptr + num_seqs) + first, num_tokens, step):
        tl.store(out_ptr + tl.cast(row, tl.int64) * stride_ot + (kv_head * GROUP + heads)[:, None] * stride_oh
                 + offs_d[None, :], zeros, mask=mask)


# ---- split K within one launch -------------------------------------------------------------
# A GEMV whose output is narrow (o and down of Llama-3-8B: 4,096 columns) has few programs
# at 2-16 rows (128 for 132 SMs at the tables' 32-column tiles), each streaming a long K
# alone. Splitting K over SPLIT_K programs per column tile gives the GPU more in flight; the
# last program of a tile to finish sums the partials, in split order (the result does not
# depend on which finishes last), and writes the output: no second launch, no zero fill.
# The arrival counters are zero before and after every launch; one buffer per device serves
# every such kernel, since kernels on a stream run one after the other (under PDL a kernel
# touches them only after its wait). It is allocated outside graph capture (the warm-up runs
# before each capture call the launchers first); a launcher that finds none while a graph is
# being captured runs unsplit.
SPLIT_K_COUNTERS = 1 << 16


_SPLIT_K_COUNTERS: dict[int, torch.Tensor] = {}  # device index -> counters (always zero between launches)


def split_k_counters(device: torch.device) -> torch.Tensor | None:
    """The device's arrival counters for split-K launches (CPU: a fresh zero buffer each
    call, for the interpreter), or None while a CUDA graph is being captured and they do not
    exist yet."""
    if device.type != "cuda":
        return torch.zeros(SPLIT_K_COUNTERS, dtype=torch.int32, device=device)
    index = _cuda_index(device)
    counters = _SPLIT_K_COUNTERS.get(index)
    if counters is None:
        if torch.cuda.is_current_stream_capturing():
            return None  # an allocation now would belong to the graph's memory pool
        counters = _SPLIT_K_COUNTERS[index] = torch.zeros(SPLIT_K_COUNTERS, dtype=torch.int32,
                                                          device=torch.device("cuda", index))
    return counters


@triton.jit
def arrived_last(count_ptr, tile, SPLITS: tl.constexpr):
    """After this program's stores of its partials: count its arrival at `tile`; whether it
    is the last of the SPLITS programs there. The last reads the others' partials with
    `cache_modifier=".cg"` (from L2, where their stores are, never a stale L1 line), then
    resets the counter to zero for the next launch."""
    # Every thread's partials are written before one thread's release of the count; the
    # last program's acquire, and the barrier behind it, make all splits' visible to it.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return arrived == SPLITS - 1


@triton.jit
def split_k_sum(acc, part_ptr, count_ptr, tile, split, offs, mask, plane, SPLIT_K: tl.constexpr):
    """Store this program's partial sums `acc` (float32) at `offs` of split `split`'s plane
    (`plane` elements apart), then count the arrival at column tile `tile`. Returns (last,
    total): whether this program arrived last, and then the sum of every split's partials in
    split order (zeros otherwise). The last resets the tile's counter for the next launch."""
    tl.store(part_ptr + split * plane + offs, acc, mask=mask)
    last = arrived_last(count_ptr, tile, SPLIT_K)
    total = tl.zeros_like(acc)
    if last:
        for s in tl.static_range(SPLIT_K):
            # .cg: from L2, where the other programs' stores are, never a stale L1 line.
            total += tl.load(part_ptr + s * plane + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(count_ptr + tile, 0)
    return last, total
