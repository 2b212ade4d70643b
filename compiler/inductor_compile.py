"""Per-bucket compile: the post-pass graph -> one Inductor artifact per bucket, and back.

Two forms, one per device, each chosen by measurement (compiler/README.md, "Compile and cache"):

- **CPU: an AOTInductor package** (`torch._inductor.aoti_compile_and_package`). A package
  holds the generated C++ already built into a shared library, so loading one is a `dlopen`:
  no Dynamo, no AOTAutograd, no Inductor code generation, no C++ compiler run.
  `standalone_compile` artifacts hold C++ kernel *sources* and rebuild every kernel when the
  Inductor cache directory is fresh (15 kernels, 21.6 s for the tiny model).
- **CUDA: a `standalone_compile` artifact** (`torch._inductor.standalone_compile`, saved in
  its `binary` form). On the lent H200 image (torch 2.11+cu130) loading *any* AOTInductor
  CUDA package segfaults inside torch; a standalone artifact loads there, and carries the
  compiled Triton kernels (cubins) of the graph, so loading it runs no Dynamo, no
  AOTAutograd and no Inductor code generation (its FX-graph-cache entry is read back) and
  compiles no Triton kernel. What it costs is importing `torch._inductor` (seconds).

How a bucket is compiled: for a package, the post-pass FX graph is exported again with the
bucket's static shapes (`torch.export`), then handed to AOTInductor; for a standalone
artifact, the graph and example inputs of the bucket's shapes go to `standalone_compile`
with the dynamic dimensions marked. Every graph input stays an input, parameters included,
so an artifact holds no weights: it serves any checkpoint of the architecture. Two
dimensions stay dynamic so that an artifact does not depend on the machine it runs on or on
the engine's length limits:

- the KV cache's `num_blocks` (dim 1 of every `kv_cache:<layer>` input), sized at start-up
  from free memory;
- the block tables' width (dim 1 of `batch:block_tables`), the most blocks any sequence of
  the step holds; the runner may pass any width >= 1 (it passes the step's maximum).

Kiln's custom ops (`kiln::paged_attention`, which writes the KV cache in place) stay
opaque calls inside the artifact, dispatched at run time to whatever implementation is
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
from typing import Any, Callable, Iterator

import torch

# torch's own export/AOTInductor code still builds pytree `LeafSpec`s, which torch 2.10+
# deprecates with a FutureWarning that nothing on Kiln's side can act on; printed from
# inside the compile it lands on top of the progress bar.
warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated", category=FutureWarning)

from kiln.compiler.buckets import Bucket
from kiln.compiler.graph_inputs import BATCH_INPUTS, InputRole, RoleKind, bind, bucket_sizes, empty_step, param_role
from kiln.kernels import recurrent_states
from kiln.kernels.paged_attention import kv_cache_shape

logger = logging.getLogger("kiln.compiler")

ARTIFACT_FORMAT = "aoti-pt2/1"  # the CPU form
STANDALONE_FORMAT = "inductor-standalone/1"  # the CUDA form
# Forces the standalone form on CPU too: for tests of that path on machines without a GPU.
STANDALONE_ENV = "KILN_INDUCTOR_STANDALONE"
MAX_KV_BLOCKS = 2**24
MAX_BLOCK_TABLE_WIDTH = 2**20

EXAMPLE_NUM_BLOCKS = 64
EXAMPLE_NUM_STATE_SLOTS = 4  # rows of a recurrent layer's state caches (dynamic, as the blocks)
EXAMPLE_BLOCK_TABLE_WIDTH = 8
# Whether the user chose Inductor's cache directory, read before torch's first use of it
# (torch writes its default into the environment then, and it would look chosen).
_USER_INDUCTOR_CACHE_DIR = bool(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))


def artifact_format(device: torch.device) -> str:
    """The artifact form (and key factor) for `device`: AOTInductor packages on CPU, standalone
    Inductor artifacts on CUDA (see the module doc for why)."""
    if device.type == "cuda" or os.environ.get(STANDALONE_ENV) == "1":
        return STANDALONE_FORMAT
    return ARTIFACT_FORMAT


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
    kv_cache_dtype: torch.dtype | None = None,
    tp_size: int = 1,
) -> tuple[list[torch.Tensor], list[dict[int, Any] | None]]:
    """Tensors with the bucket's shapes for every graph input, and export's dynamic_shapes.

    Values do not matter (export and AOTInductor read only shapes, dtypes and devices), so
    weights are uninitialised; the batch inputs hold a valid empty step (graph_inputs.empty_step).
    """
    from torch.export import Dim

    num_blocks = Dim("num_kv_blocks", min=2, max=MAX_KV_BLOCKS)
    num_slots = Dim("num_state_slots", min=2, max=MAX_KV_BLOCKS)
    state_shapes = recurrent_states.state_shapes(config, dtype, tp_size)
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

    sizes = bucket_sizes(bucket.num_tokens, bucket.num_seqs, bucket.num_samples, EXAMPLE_BLOCK_TABLE_WIDTH)
    try:
        args = bind(roles, params=param, constants=lambda name: constants[name].to(device),
                    kv_caches=lambda layer: torch.zeros(
                        kv_cache_shape(config, EXAMPLE_NUM_BLOCKS, block_size, tp_size, int(layer)),
                        dtype=kv_cache_dtype or dtype, device=device),
                    batch=empty_step(sizes, device),
                    states=lambda name: torch.zeros((EXAMPLE_NUM_STATE_SLOTS, *state_shapes[name][0]),
                                                    dtype=state_shapes[name][1], device=device))
    except ValueError as e:
        raise BucketCompileError(f"bucket {bucket.name}: {e}") from e
    dynamic: list[dict[int, Any] | None] = []
    for role in map(InputRole.parse, roles):
        if role.kind is RoleKind.KV_CACHE:
            dynamic.append({1: num_blocks})
        elif role.kind is RoleKind.STATE:
            dynamic.append({0: num_slots})
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
    kv_cache_dtype: torch.dtype | None = None,
    tp_size: int = 1,
) -> bytes:
    """The AOTInductor package (bytes) of `gm` at `bucket`'s shapes."""
    scratch_root.mkdir(parents=True, exist_ok=True)
    try:
        args, dynamic = example_inputs(gm, roles, constants, config, bucket, dtype, device, block_size,
                                       kv_cache_dtype, tp_size)
        if artifact_format(device) == STANDALONE_FORMAT:
            return _compile_standalone(gm, args, dynamic, bucket, scratch_root)
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


def _compile_standalone(gm: torch.fx.GraphModule, args: list[torch.Tensor], dynamic: list[dict[int, Any] | None],
                        bucket: Bucket, scratch_root: Path) -> bytes:
    """`standalone_compile` of `gm` at the example inputs' shapes, the dynamic dims marked."""
    from torch._inductor import standalone_compile

    # The dynamic dimensions come from an export with them declared: its placeholders hold
    # fake tensors with the symbols (num_kv_blocks, block_table_width), which are the example
    # inputs, and `dynamic_shapes="from_graph"` takes their fake mode (and shape env) from the
    # output's `example_value`, where Dynamo graphs keep it (export's graphs say `val`).
    # Marking real inputs dynamic instead does not hold: the artifact came out with the
    # example's width fixed and other sizes duck-shaped into one symbol.
    with torch.no_grad():
        program = torch.export.export(gm, tuple(args), dynamic_shapes=tuple(dynamic), strict=False)
    graph = program.graph_module
    fake_inputs = [node.meta["val"] for node in graph.graph.find_nodes(op="placeholder")]
    output = next(iter(reversed(graph.graph.nodes)))
    for node in output.args[0] if isinstance(output.args[0], (list, tuple)) else [output.args[0]]:
        if isinstance(node, torch.fx.Node) and "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]
    del args
    with inductor_scratch_dir(scratch_root), tempfile.TemporaryDirectory(prefix="art-", dir=scratch_root) as out:
        with torch.no_grad():
            artifact = standalone_compile(graph, fake_inputs, dynamic_shapes="from_graph")
        path = Path(out) / f"{bucket.name}.bin"
        artifact.save(path=str(path), format="binary")
        return path.read_bytes()


@dataclass
class LoadedBucket:
    """A loaded bucket artifact: call it with the flat list of graph inputs, get the logits."""

    bucket: Bucket
    run: Callable[[list[torch.Tensor]], Any]  # flat inputs -> the graph's outputs (a list)
    load_seconds: float

    def __call__(self, args: list[torch.Tensor]) -> torch.Tensor:
        return self.run(args)[0]


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
    """Load an artifact from its bytes (checked by the store beforehand). No compiler runs."""
    t0 = time.perf_counter()
    scratch_root.mkdir(parents=True, exist_ok=True)
    standalone = artifact_format(device) == STANDALONE_FORMAT
    fd, path = tempfile.mkstemp(prefix=f"{bucket.name}-", suffix=".bin" if standalone else ".pt2", dir=scratch_root)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        if standalone:
            from torch._inductor import CompiledArtifact

            artifact = CompiledArtifact.load(path=path, format="binary")
            run: Callable[[list[torch.Tensor]], Any] = lambda args: artifact(*args)  # noqa: E731
        else:
            device_index = device.index if device.index is not None else (
                torch.cuda.current_device() if device.type == "cuda" else -1)
            run = open_package(path, device_index).run
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return LoadedBucket(bucket=bucket, run=run, load_seconds=time.perf_counter() - t0)
