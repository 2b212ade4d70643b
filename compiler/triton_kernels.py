"""Triton's compiled kernels as a Kiln cache entry: what makes a CUDA cache self-contained.

On CUDA a step runs Triton kernels: Kiln's own (attention, RoPE, norms, MoE, ...) and any
that Inductor generated. Triton compiles each on first use and keeps the binaries in its own
on-disk cache (`TRITON_CACHE_DIR`, default `~/.triton/cache`), which a Kiln cache built
elsewhere (in CI, by `kiln compile`) does not carry. So a model setup's cache holds one more
entry, kind `tritonkernels`: every file of every Triton kernel its buckets ran, taken while
the engine that built the entry warmed every bucket up.

- **Taking them.** While the entry is missing, the engine runs its warm-up (KV-cache sizing,
  one run of every token bucket, CUDA-graph capture of the decode buckets) with Triton's
  cache pointed at a fresh private folder (`capture_triton_kernels`): every kernel the
  buckets need is compiled into it, nothing is found elsewhere, and the folder's files (the
  cubins, their metadata, the launcher modules Triton builds with the C compiler) are the
  entry. A process that already ran some kernels (they live in Triton's in-memory cache,
  so nothing is compiled and no file appears) stores nothing: the entry would be partial.
  `kiln compile` then serves a few requests and merges in any variant only real steps meet
  (`merge_triton_entries`); the driver's module and launchers this process built before
  the capture began are taken from the outer folder.
- **Putting them back.** A warm start unpacks the entry into Triton's cache folder, whatever
  it is (`restore_triton_kernels`), before the first kernel runs (with Inductor artifacts,
  before they load: loading one starts Triton's driver); Triton then finds every kernel there. Triton's group files hold absolute paths to their members, so they are
  stored with names relative to the cache folder and written back with the new folder's.
- **Counting compiles.** `count_triton_compiles` installs Triton's compilation listener
  (`triton.knobs.compilation.listener`, which reports every `compile()` call and whether it
  came from the disk cache) and also counts launcher modules that appear in the folder; the
  engine logs both and the warm-start tests assert zero.

Triton's key for a kernel covers its source, the GPU target (capability), Triton's own
version and the backend's tools (ptxas); the entry's key has the Kiln version (all of
`kernels/`), torch and Triton versions, device capability and the bucket plan, so a key
match means the same kernels. Where some other part of Triton's hash differs (another
ptxas), the warm start compiles those kernels, and says so.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from kiln.cache.keys import TRITON_KERNELS_KIND

logger = logging.getLogger("kiln.compiler")

__all__ = ["TRITON_KERNELS_KIND", "TRITON_KERNELS_FORMAT", "TritonKernelsError", "TritonCompileCount",
           "count_triton_compiles", "capture_triton_kernels", "restore_triton_kernels", "pack_triton_folder",
           "merge_triton_entries", "listener_available", "triton_cache_dir"]

TRITON_KERNELS_FORMAT = "triton-files/1"
_GROUP_PREFIX = "__grp__"
# A member of the folder: `<kernel hash>/<file>`; nothing else is packed or unpacked.
_MAX_FILE_BYTES = 256 * 2**20
_UNSET = object()


class TritonKernelsError(ValueError):
    """A stored kernel entry that cannot be unpacked; the caller drops it as corrupt."""


def triton_cache_dir() -> Path:
    """Triton's cache folder as Triton will use it now (knob, else env, else its default)."""
    try:
        from triton import knobs

        value = knobs.cache.dir
        if value:
            return Path(value)
    except (ImportError, AttributeError):
        pass
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME", os.path.expanduser("~"))) / ".triton" / "cache"


@contextlib.contextmanager
def _pointed_at(folder: Path) -> Iterator[None]:
    """Triton's cache folder is `folder` inside the block (the knob and the env variable, for
    Triton versions that read either), and what it was afterwards."""
    saved_env = os.environ.get("TRITON_CACHE_DIR")
    knobs: Any = None
    with contextlib.suppress(ImportError):
        from triton import knobs as _knobs

        knobs = _knobs if hasattr(_knobs, "cache") else None
    # A knob set in code lives in the knob object's __dict__; unset, it reads the environment.
    saved_knob = knobs.cache.__dict__.get("dir", _UNSET) if knobs is not None else _UNSET
    os.environ["TRITON_CACHE_DIR"] = str(folder)
    if knobs is not None:
        knobs.cache.dir = str(folder)
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved_env
        if knobs is not None:
            if saved_knob is _UNSET:
                knobs.cache.__dict__.pop("dir", None)
            else:
                knobs.cache.__dict__["dir"] = saved_knob


@dataclass
class TritonCompileCount:
    """What Triton did while a count was open: kernels compiled, kernels read from its disk
    cache, and launcher/utility modules built with the C compiler (files that appeared)."""

    compiled: int = 0
    from_disk: int = 0
    modules_built: int = 0
    names: list[str] = field(default_factory=list)  # the compiled kernels' names (and specialisation)
    modules: list[str] = field(default_factory=list)  # the modules built: `<hash>/<file>.so`

    @property
    def total_compiles(self) -> int:
        return self.compiled + self.modules_built


def listener_available() -> bool:
    try:
        from triton import knobs

        return hasattr(knobs, "compilation") and hasattr(knobs.compilation, "listener")
    except ImportError:
        return False


def _module_files(folder: Path, since: float = 0.0) -> set[str]:
    """Shared objects in the folder modified at or after `since`. Files restored from a Kiln
    entry carry the stored (old) modification time, so they do not count as built."""
    if not folder.is_dir():
        return set()
    return {str(p.relative_to(folder)) for p in folder.glob("*/*.so") if p.stat().st_mtime >= since}


@contextlib.contextmanager
def count_triton_compiles() -> Iterator[TritonCompileCount]:
    """Count Triton's compiles (and disk-cache hits) inside the block."""
    count = TritonCompileCount()
    folder = triton_cache_dir()
    started = time.time() - 1.0  # file systems with coarse timestamps
    modules_before = _module_files(folder)
    if not listener_available():
        logger.debug("this Triton has no compilation listener; only built modules are counted")
        yield count
        count.modules = sorted(_module_files(folder, started) - modules_before)
        count.modules_built = len(count.modules)
        return
    from triton import knobs

    previous = knobs.compilation.listener

    def listener(*, src: Any, metadata: Any, metadata_group: Any, times: Any, cache_hit: bool) -> None:
        if cache_hit:
            count.from_disk += 1
        else:
            count.compiled += 1
            # The name and what Triton specialised it on (ints == 1 / divisible by 16, aligned
            # pointers): a variant the warm-up did not meet shows up here.
            attrs = getattr(src, "attrs", None)
            count.names.append(f"{getattr(src, 'name', '?')}{'' if attrs is None else ' ' + str(attrs)}")
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    knobs.compilation.listener = listener
    try:
        yield count
    finally:
        knobs.compilation.listener = previous
        count.modules = sorted(_module_files(folder, started) - modules_before)
        count.modules_built = len(count.modules)


def pack_triton_folder(folder: Path) -> tuple[bytes, int]:
    """The folder's kernel files as a gzip'd tar (group files with relative member names),
    and how many kernels (metadata groups) it holds."""
    buf = io.BytesIO()
    kernels = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(folder.glob("*/*")):
            if not path.is_file() or ".tmp." in path.name or path.name == "lock":
                continue
            name = f"{path.parent.name}/{path.name}"
            data = path.read_bytes()
            if path.name.startswith(_GROUP_PREFIX):
                kernels += 1
                data = _relative_group(data, folder)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue(), kernels


def _relative_group(data: bytes, folder: Path) -> bytes:
    grp = json.loads(data)
    children = grp.get("child_paths")
    if isinstance(children, dict):  # the file cache manager's form: {file: absolute path}
        grp["child_paths"] = {k: os.path.relpath(v, folder) for k, v in children.items()}
    return json.dumps(grp).encode()


def restore_triton_kernels(data: bytes, folder: Path | None = None) -> int:
    """Unpack a stored entry into Triton's cache folder (or `folder`): files already there are
    kept. Returns the number of files written. Raises TritonKernelsError for a damaged entry."""
    folder = folder or triton_cache_dir()
    written = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                if (not member.isfile() or len(parts) != 2 or any(p in ("", ".", "..") for p in parts)
                        or member.size > _MAX_FILE_BYTES):
                    raise TritonKernelsError(f"unexpected member {member.name!r} in a Triton kernel entry")
                target = folder / parts[0] / parts[1]
                if target.exists():
                    continue
                blob = tar.extractfile(member)
                if blob is None:
                    raise TritonKernelsError(f"member {member.name!r} has no data")
                content = blob.read()
                if parts[1].startswith(_GROUP_PREFIX):
                    grp = json.loads(content)
                    children = grp.get("child_paths")
                    if isinstance(children, dict):
                        grp["child_paths"] = {k: str(folder / v) for k, v in children.items()}
                    content = json.dumps(grp).encode()
                target.parent.mkdir(parents=True, exist_ok=True)
                # Write then rename, as Triton does: a concurrent reader never sees half a file.
                fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{parts[1]}.tmp.")
                with os.fdopen(fd, "wb") as fh:
                    fh.write(content)
                os.replace(tmp, target)
                os.utime(target, (member.mtime, member.mtime))  # as stored: not "built" now
                written += 1
    except (tarfile.TarError, OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TritonKernelsError(f"Triton kernel entry cannot be unpacked ({type(e).__name__}: {e})") from e
    return written


@dataclass
class TritonCapture:
    """The result of `capture_triton_kernels`: the packed files (None when the capture is
    unusable) and what Triton did meanwhile."""

    count: TritonCompileCount
    data: bytes | None = None
    num_kernels: int = 0
    reason: str = ""  # why nothing was packed


@contextlib.contextmanager
def capture_triton_kernels(scratch_root: Path) -> Iterator[TritonCapture]:
    """Point Triton's cache at a fresh private folder for the block, count what it compiles,
    and pack the folder at the end (`TritonCapture.data`)."""
    scratch_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="triton-", dir=scratch_root) as d:
        folder = Path(d)
        outer = triton_cache_dir()
        with _pointed_at(folder), count_triton_compiles() as count:
            capture = TritonCapture(count=count)
            yield capture
        if listener_available() and count.compiled == 0:
            capture.reason = ("no Triton kernel was compiled (this process had run them already), so the folder "
                              "would hold only some of them")
            return
        _add_driver_modules(outer, folder)
        capture.data, capture.num_kernels = pack_triton_folder(folder)


# Triton's driver builds its utility module (`cuda_utils`) and each kernel signature's
# launcher with the C compiler on first use, and keeps them in the cache folder of that
# moment: when this process ran Triton kernels before a capture began (Inductor's compile of
# a bucket does), they are in the outer folder or Inductor's own, not the private one, and a
# server starting from the entry would build them again. The loaded driver module and the
# launchers this process built are added.
_DRIVER_MODULES = ("cuda_utils*.so", "hip_utils*.so", "__triton_launcher*.so")


def _process_start_time() -> float:
    try:
        return os.stat(f"/proc/{os.getpid()}").st_ctime
    except OSError:
        return time.time()  # unknown: add none


def _loaded_driver_module() -> Path | None:
    """The file of the driver's utility module this process loaded, wherever it was built.

    Inductor compiles a bucket with Triton's cache pointed at a folder of its own, so the
    module can be in neither the outer nor the private folder. Its functions are the
    module's own builtins, whose `__self__` is the loaded module (with its `__file__`)."""
    try:
        from triton.runtime.driver import driver

        utils = driver.active.utils
    except Exception:  # no GPU driver (CPU, TRITON_INTERPRET): no module to carry
        return None
    for name in ("load_binary", "get_device_properties"):
        module_file = getattr(getattr(getattr(utils, name, None), "__self__", None), "__file__", None)
        if module_file and Path(module_file).is_file():
            return Path(module_file)
    return None


def _add_driver_modules(outer: Path, folder: Path) -> None:
    loaded = _loaded_driver_module()
    if loaded is not None:
        # Stored as `<its key folder>/<file>`: Triton's key for the module is the same in any
        # cache folder, so a warm start finds it where it looks.
        target = folder / loaded.parent.name / loaded.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(loaded, target)
    since = _process_start_time() - 1.0
    for pattern in _DRIVER_MODULES:
        for path in outer.glob(f"*/{pattern}") if outer.is_dir() else []:
            # The driver's module is one per Triton build (an earlier process may have built
            # it); launchers are one per kernel signature: only this process's.
            if pattern.startswith("__triton_launcher") and path.stat().st_mtime < since:
                continue
            target = folder / path.parent.name / path.name
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)


def merge_triton_entries(entries: list[bytes], scratch_root: Path) -> tuple[bytes, int]:
    """Stored kernel entries as one (e.g. a setup's entry and the kernels a later workload
    compiled), with the number of kernels it holds."""
    scratch_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="triton-merge-", dir=scratch_root) as d:
        for data in entries:
            restore_triton_kernels(data, Path(d))
        return pack_triton_folder(Path(d))
