"""Collectives of tensor parallelism as Kiln ops: `kiln::all_reduce` and `kiln::all_gather`.

The sharding pass (kiln.passes.shard_tensor_parallel) puts them in the graph: a sum over
ranks after each row-parallel projection and after the vocab-parallel embedding, a gather
of the LM head's vocabulary shards. They run over the process's default process group
(`torch.distributed`'s WORLD), which a Kiln worker initialises as its tensor-parallel group:
NCCL on CUDA, gloo on CPU. A graph whose collectives are ops is traced, compiled and cached
like any other (the fake implementations give the shapes; Inductor calls them opaquely).

Both are out of place (a new tensor, the input left alone) so that the graph stays
functional. On CUDA they are plain NCCL calls on the current stream, which a CUDA graph
captures (NCCL supports stream capture): a decode step replays with its all-reduces inside.
A process that never initialised a group gets the identity, so a graph can be run, e.g. in
a test, without one; a group of one rank still runs the collective (what the CUDA-graph
capture test on one GPU exercises).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.kernels.library import kiln_op


def _in_group() -> bool:
    return dist.is_available() and dist.is_initialized()


def _world_size() -> int:
    return dist.get_world_size() if _in_group() else 1


@kiln_op("kiln::all_reduce")
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of `x` over the ranks of the tensor-parallel group."""
    out = x.clone()
    if _in_group():
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
