"""Collectives of tensor parallelism as Kiln ops: `kiln::all_reduce` and `kiln::all_gather`.

The sharding pass (kiln.passes.shard_tensor_parallel) puts them in the graph: a sum over
ranks after each row-parallel projection and after the vocab-parallel embedding, a gather
of the LM head's vocabulary shards. They run over the process's default process group
(`torch.distributed`'s WORLD), which a Kiln worker initialises as its tensor-parallel group:
NCCL on CUDA, gloo on CPU. A graph whose collectives are ops is traced, compiled and cached
like any other (the fake implementations give the shapes; Inductor calls them opaquely).

Both are out of place (a new tensor, the input left alone) so that the graph stays
functional. On CUDA they run on the current stream, which a CUDA graph captures: a decode
step replays with its all-reduces inside. An all-reduce is NCCL's, except, when
$KILN_ONE_SHOT_ALL_REDUCE_MAX_BYTES asks for it, for small messages once a worker has called
`enable_one_shot_all_reduce`: then it is one kernel over
peer-to-peer buffers (PyTorch's symmetric memory, `symm_mem::one_shot_all_reduce_copy`):
each rank copies its input into its own buffer, the ranks meet at a barrier of signal pads,
and each reads every peer's buffer over NVLink and sums. No NVLink multicast (the one-shot
kernel uses plain peer loads). See ONE_SHOT_MAX_BYTES for why it is off by default.
A process that never initialised a group gets the identity, so a graph can be run, e.g. in
a test, without one; a group of one rank still runs the collective (what the CUDA-graph
capture test on one GPU exercises).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.kernels.library import kiln_op


logger = logging.getLogger("kiln.kernels")

# Messages up to this many bytes take the one-shot path: every rank reads every peer's
# whole message, so the cost grows with size x ranks, and NCCL's ring/tree algorithms win
# for large messages (prefill chunks). 0 (the default) keeps NCCL for everything: on two
# H200s NCCL inside a CUDA graph took 7.8 us against the one-shot kernel's 6.7 us for a
# decode-sized message (bench/allreduce.py), a 3.7% gain at batch 1 end to end, and the
# two-GPU correctness test of the one-shot path inside CUDA graphs has not yet run to its
# end on the device (bench/RESULTS.md, G5). $KILN_ONE_SHOT_ALL_REDUCE_MAX_BYTES=4194304
# turns it on for messages up to 4 MiB (every decode step's).
ONE_SHOT_MAX_BYTES = 0


@dataclass
class OneShotAllReduce:
    """This process's symmetric buffer for the one-shot all-reduce, rendezvoused over the
    tensor-parallel group. One per process, like the process group it belongs to."""

    buffer: torch.Tensor  # flat, of the model's activation dtype
    group_name: str
    max_bytes: int

    def takes(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        # The kernel loads 16-byte vectors: the message must be made of whole ones.
        return (x.dtype == self.buffer.dtype and x.device == self.buffer.device and 0 < nbytes <= self.max_bytes
                and nbytes % 16 == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        symm = self.buffer[: x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(symm, x, "sum", self.group_name)


_one_shot: OneShotAllReduce | None = None


def enable_one_shot_all_reduce(dtype: torch.dtype, device: torch.device,
                               max_bytes: int | None = None) -> OneShotAllReduce | None:
    """Collective over the default group (every rank calls it, with the same arguments):
    allocate and rendezvous this process's symmetric buffer, so that all-reduces of up to
    `max_bytes` take the one-shot path. Returns None, leaving NCCL for everything, when
    symmetric memory is not available here or fails on any rank (the ranks agree on it
    through an NCCL all-reduce, so no rank takes a path the others do not)."""
    global _one_shot
    if max_bytes is None:
        max_bytes = int(os.environ.get("KILN_ONE_SHOT_ALL_REDUCE_MAX_BYTES", ONE_SHOT_MAX_BYTES))
    if not _in_group() or device.type != "cuda" or max_bytes <= 0:
        return None
    state = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = dist.group.WORLD.group_name  # type: ignore[union-attr]
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            with warnings.catch_warnings():  # deprecated (a no-op) in newer torch
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(group_name)
        numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        symm_mem.rendezvous(buffer, group_name)
        state = OneShotAllReduce(buffer, group_name, max_bytes)
    except Exception as e:  # no P2P between these GPUs, an old torch, ...
        logger.warning("one-shot all-reduce unavailable (%s: %s); all-reduces go through NCCL",
                       type(e).__name__, e)
    ok = torch.tensor([1 if state is not None else 0], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    _one_shot = state if int(ok.item()) == 1 else None
    return _one_shot


def disable_one_shot_all_reduce() -> None:
    """Back to NCCL for every all-reduce (the worker's shutdown)."""
    global _one_shot
    _one_shot = None


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world_size() -> int:
    return dist.get_world_size() if _in_group() else 1


@kiln_op("kiln::all_reduce")
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of `x` over the ranks of the tensor-parallel group."""
    if not _in_group():
        return x.clone()
    one_shot = _one_shot
    if one_shot is not None and one_shot.takes(x):
        return one_shot.all_reduce(x)
    out = x.clone()
    dist.all_reduce(out)
    return out


@all_reduce.register_fake
def _all_reduce_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@kiln_op("kiln::all_gather")
def all_gather(x: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (shapes must match).

    `world_size` is the group's size as the graph was built for (so that the fake knows the
    output's shape without a process group); running in a group of another size is an error."""
    world = _world_size()
    if world != world_size:
        raise ValueError(f"kiln::all_gather: the graph was sharded for {world_size} ranks, but this process's "
                         f"tensor-parallel group has {world}")
    if not _in_group():
        return x.clone()
    dim = dim % x.dim()
    # Gathered along a new leading dimension (one contiguous buffer: NCCL's
    # all_gather_into_tensor, which CUDA graphs capture), then laid out along `dim`.
    src = x.contiguous()
    gathered = torch.empty((world, *src.shape), dtype=src.dtype, device=src.device)
    if src.device.type == "cuda":
        dist.all_gather_into_tensor(gathered, src)
    else:  # gloo has the list form only
        dist.all_gather(list(gathered.unbind(0)), src)
    return torch.cat(gathered.unbind(0), dim=dim)


@all_gather.register_fake
def _all_gather_fake(x: torch.Tensor, dim: int, world_size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim % x.dim()] = shape[dim % x.dim()] * world_size
    return x.new_empty(shape)
