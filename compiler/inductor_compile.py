"""Per-bucket compile: the post-pass graph -> one AOTInductor package per bucket, and back.

Form: an AOTInductor package (`torch._inductor.aoti_compile_and_package`), chosen by
measurement (compiler/README.md, "Compile and cache"). A package holds the generated
C++/Triton code already built into a shared library, so loading one is a `dlopen`: no
Dynamo, no AOTAutograd, no Inductor code generation, and on CPU no C++ compiler run.
`standalone_compile` artifacts, by contrast, hold Inductor's Python wrapper and kernel
sources, and on CPU rebuild every C++ kernel when the Inductor cache directory is fresh.

How a bucket is compiled: the post-pass FX graph is exported again with the bucket's
static shapes (`torch.export`), then handed to AOTInductor. Every graph input stays an
input, parameters included, so a package holds no weights: it serves any checkpoint of
the architecture. Two dimensions stay dynamic so that an artifact does not depend on the
machine it runs on or on the engine's length limits:

- the KV cache's `num_blocks` (dim 1 of every `kv_cache:<layer>` input), sized at start-up
  from free memory;
- the block tables' width (dim 1 of `batch:block_tables`), the most blocks any sequence of
  the step holds; the runner may pass any width >= 1 (it passes the step's maximum).

Kiln's custom ops (`kiln::paged_attention`, which writes the KV cache in place) stay
opaque calls inside the package, dispatched at run time to whatever implementation is
registered (Triton on CUDA, the torch reference on CPU).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

# torch's own export/AOTInductor code still builds pytree `LeafSpec`s, which torch 2.10+
# deprecates with a FutureWarning that nothing on Kiln's side can act on; printed from
# inside the compile it lands on top of the progress bar.
warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)

from kiln.compiler.buckets import Bucket
from kiln.compiler.graph_inputs import BATCH_INPUTS, InputRole, RoleKind, bind, bucket_sizes, empty_step, param_role
from kiln.kernels.paged_attention import kv_cache_shape

logger = logging.getLogger("kiln.compiler")

ARTIFACT_FORMAT = "aoti-pt2/1"
MAX_KV_BLOCKS = 2**24
MAX_BLOCK_TABLE_WIDTH = 2**20

EXAMPLE_NUM_BLOCKS = 64
EXAMPLE_BLOCK_TABLE_WIDTH = 8
# Whether the user chose Inductor's cache directory, read before torch's first use of it
# (torch writes its default into the environment then, and it would look chosen).
_USER_INDUCTOR_CACHE_DIR = bool(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))


class BucketCompileError(RuntimeError):
    """Compiling one bucket failed; the message names the bucket and the cause."""


def inductor_options(device: torch.device) -> dict[str, Any]:
    """Inductor settings for bucket artifacts.

    The AOTInductor wrapper (the function that calls every kernel of the graph in order) is
    built at -O0: for a 30-layer model it is one large C++ function, and optimizing it
    costs about half of the CPU compile time while the step time does not change
    measurably (compiler/README.md). The kernels themselves keep Inductor's -O3.
    """
    return {"aot_inductor.compile_wrapper_opt_level": "O0"}


def example_inputs(
    gm: torch.fx.GraphModule,
    roles: list[str],
    constants: dict[str, torch.Tensor],
    config: Any,
    bucket: Bucket,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    tp_size: int = 1,
) -> tuple[list[torch.Tensor], list[dict[int, Any] | None]]:
    """Tensors with the bucket's shapes for every graph input, and export's dynamic_shapes.

    Values do not matter (export and AOTInductor read only shapes, dtypes and devices), so
    weights are uninitialised; the batch inputs hold a valid empty step (graph_inputs.empty_step).
    """
    from torch.export import Dim

    num_blocks = Dim("num_kv_blocks", min=2, max=MAX_KV_BLOCKS)
    width = Dim("block_table_width", min=1, max=MAX_BLOCK_TABLE_WIDTH)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(roles):
        raise BucketCompileError(f"graph has {len(placeholders)} inputs but {len(roles)} roles")
    node_of = {role: node for node, role in zip(placeholders, roles)}

    def param(name: str) -> torch.Tensor:
        val = node_of[param_role(name)].meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise BucketCompileError(f"graph input {param_role(name)} has no recorded shape")
        return torch.empty(tuple(int(s) for s in val.shape), dtype=val.dtype, device=device)

    kv_shape = kv_cache_shape(config, EXAMPLE_NUM_BLOCKS, block_size, tp_size)
    sizes = bucket_sizes(bucket.num_tokens, bucket.num_seqs, bucket.num_samples, EXAMPLE_BLOCK_TABLE_WIDTH)
    try:
        args = bind(roles, params=param, constants=lambda name: constants[name].to(device),
                    kv_caches=lambda layer: torch.zeros(kv_shape, dtype=dtype, device=device),
                    batch=empty_step(sizes, device))
    except ValueError as e:
        raise BucketCompileError(f"bucket {bucket.name}: {e}") from e
    dynamic: list[dict[int, Any] | None] = []
    for role in map(InputRole.parse, roles):
        if role.kind is RoleKind.KV_CACHE:
            dynamic.append({1: num_blocks})
        elif role.kind is RoleKind.BATCH and "W" in BATCH_INPUTS[role.name].dims:
            dynamic.append({BATCH_INPUTS[role.name].dims.index("W"): width})
        else:
            dynamic.append(None)
    return args, dynamic  # type: ignore[return-value]


@contextlib.contextmanager
def inductor_scratch_dir(scratch_root: Path) -> Iterator[None]:
    """Point Inductor's own cache at a private temporary folder for the compile, unless the
    user chose one ($TORCHINDUCTOR_CACHE_DIR): what it writes there is an intermediate that
    the package already contains, and Kiln's cache is the one that is kept and size-limited."""
    if _USER_INDUCTOR_CACHE_DIR:
        yield
        return
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with tempfile.TemporaryDirectory(prefix="inductor-", dir=scratch_root) as d, temporary_cache_dir(d):
        yield


def compile_bucket(
    gm: torch.fx.GraphModule,
    roles: list[str],
    constants: dict[str, torch.Tensor],
    config: Any,
    bucket: Bucket,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    scratch_root: Path,
    tp_size: int = 1,
) -> bytes:
    """The AOTInductor package (bytes) of `gm` at `bucket`'s shapes."""
    scratch_root.mkdir(parents=True, exist_ok=True)
    try:
        args, dynamic = example_inputs(gm, roles, constants, config, bucket, dtype, device, block_size, tp_size)
        with torch.no_grad():
            program = torch.export.export(gm, tuple(args), dynamic_shapes=tuple(dynamic), strict=False)
        del args
        with inductor_scratch_dir(scratch_root), tempfile.TemporaryDirectory(prefix="pkg-", dir=scratch_root) as out:
            path = torch._inductor.aoti_compile_and_package(
                program, package_path=str(Path(out) / f"{bucket.name}.pt2"),
                inductor_configs=inductor_options(device),
            )
            return Path(path).read_bytes()
    except BucketCompileError:
        raise
    except Exception as e:
        raise BucketCompileError(f"compiling bucket {bucket.name} failed: {type(e).__name__}: {e}") from e


@dataclass
class LoadedBucket:
    """A loaded bucket artifact: call it with the flat list of graph inputs, get the logits."""

    bucket: Bucket
    loader: Any  # torch._C._aoti.AOTIModelPackageLoader: run(list of inputs) -> list of outputs
    load_seconds: float

    def __call__(self, args: list[torch.Tensor]) -> torch.Tensor:
        return self.loader.run(args)[0]


def open_package(path: str, device_index: int) -> Any:
    """Unpack a package and `dlopen` its library (the file is not needed afterwards).

    This calls the C++ loader directly: the Python wrapper `torch._inductor.aoti_load_package`
    first probes the CPU's vector ISA by *compiling* test programs with the C++ compiler
    (torch 2.13), which a warm start must not do.
    """
    loader_cls = torch._C._aoti.AOTIModelPackageLoader
    try:
        return loader_cls(path, "model", False, 1, device_index)
    except TypeError:  # older torch: (path, model_name, run_single_threaded, num_runners)
        return loader_cls(path, "model", False, 1)


def load_bucket(bucket: Bucket, data: bytes, device: torch.device, scratch_root: Path) -> LoadedBucket:
    """Load a package from its bytes (checked by the store beforehand). No compiler runs."""
    t0 = time.perf_counter()
    scratch_root.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=f"{bucket.name}-", suffix=".pt2", dir=scratch_root)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        device_index = device.index if device.index is not None else (
            torch.cuda.current_device() if device.type == "cuda" else -1)
        loader = open_package(path, device_index)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return LoadedBucket(bucket=bucket, loader=loader, load_seconds=time.perf_counter() - t0)
