"""The Triton-kernel cache entry (kiln.compiler.triton_kernels): taking a setup's kernels into
Kiln's cache and putting them back into another Triton cache folder.

On CPU no Triton kernel is compiled, so these tests stand in for Triton where it would act:
inside a capture they write what Triton writes (a kernel's files and its group file, whose
member paths are absolute) and report the compile through Triton's own compilation listener.
The real thing - a CUDA cache built by `kiln compile` in one folder, a fresh process on
another with empty Triton and Inductor caches, zero compiles - is
tests/test_gpu_warm_start.py.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
import torch

from kiln.cache.store import ArtifactStore
from kiln.compiler.startup import StartupReport, TritonKernelsEntry, triton_kernels_at_startup
from kiln.compiler.triton_kernels import (
    TritonKernelsError, count_triton_compiles, listener_available, pack_triton_folder, restore_triton_kernels,
    triton_cache_dir,
)

pytestmark = pytest.mark.skipif(not listener_available(), reason="this Triton has no compilation listener")


def write_kernel(folder: Path, kernel_hash: str, name: str) -> None:
    """What Triton's file cache manager leaves for one compiled kernel."""
    d = folder / kernel_hash
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.cubin").write_bytes(b"\x7fELF cubin of " + name.encode())
    (d / f"{name}.json").write_text(json.dumps({"name": name, "hash": kernel_hash}))
    children = {f"{name}.cubin": str(d / f"{name}.cubin"), f"{name}.json": str(d / f"{name}.json")}
    (d / f"__grp__{name}.json").write_text(json.dumps({"child_paths": children}))


def compile_in_triton(kernel_hash: str, name: str, cache_hit: bool = False) -> None:
    """Triton's compile of one kernel: its files in the current cache folder, then the listener."""
    from triton import knobs

    folder = triton_cache_dir()
    if not cache_hit:
        write_kernel(folder, kernel_hash, name)
    knobs.compilation.listener(src=type("Src", (), {"name": name})(), metadata={}, metadata_group={}, times=None,
                               cache_hit=cache_hit)


def test_pack_and_restore_rewrite_group_paths_to_the_new_folder(tmp_path: Path) -> None:
    built, served = tmp_path / "built", tmp_path / "served"
    write_kernel(built, "a" * 64, "_rms_norm_kernel")
    write_kernel(built, "b" * 64, "_paged_attention_kernel")
    (built / ("a" * 64) / "_rms_norm_kernel.cubin.tmp.pid_1_x").write_bytes(b"half")  # Triton's temp file
    data, kernels = pack_triton_folder(built)
    assert kernels == 2
    assert restore_triton_kernels(data, served) == 6
    grp = json.loads((served / ("b" * 64) / "__grp___paged_attention_kernel.json").read_text())
    for child in grp["child_paths"].values():
        assert Path(child).parent.parent == served and Path(child).is_file()
    assert not list(served.rglob("*.tmp.*"))
    # Files already there are kept, not rewritten.
    (served / ("a" * 64) / "_rms_norm_kernel.cubin").write_bytes(b"local")
    assert restore_triton_kernels(data, served) == 0
    assert (served / ("a" * 64) / "_rms_norm_kernel.cubin").read_bytes() == b"local"


@pytest.mark.parametrize("name", ["../evil", "/abs/path", "a/b/c", "onlyfile"])
def test_restore_refuses_members_outside_a_kernel_folder(tmp_path: Path, name: str) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(TritonKernelsError, match="unexpected member"):
        restore_triton_kernels(buf.getvalue(), tmp_path / "t")
    with pytest.raises(TritonKernelsError, match="cannot be unpacked"):
        restore_triton_kernels(b"not a tar", tmp_path / "t")


def test_count_triton_compiles_tells_compiles_from_disk_hits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with count_triton_compiles() as count:
        compile_in_triton("c" * 64, "_rope_kernel")
        compile_in_triton("c" * 64, "_rope_kernel", cache_hit=True)
        (tmp_path / ("d" * 64)).mkdir()
        (tmp_path / ("d" * 64) / "__triton_launcher.so").write_bytes(b"so")  # built with the C compiler
    assert (count.compiled, count.from_disk, count.modules_built) == (1, 1, 1)
    assert count.names == ["_rope_kernel"] and count.total_compiles == 2
    from triton import knobs

    assert knobs.compilation.listener is None  # put back


def test_startup_takes_the_kernels_then_a_fresh_folder_gets_them_back(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's start-up on CUDA, Triton's part: a cold start (entry missing) compiles into a
    private folder that becomes the entry; a warm start elsewhere restores it and compiles nothing."""
    cache_dir = str(tmp_path / "kiln-cache")
    user_triton = tmp_path / "user-triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(user_triton))
    entry = TritonKernelsEntry(key="tritonkernels-" + "0" * 32, factors={"capability": "9.0", "plan": ["decode-1"]},
                               cache_dir=cache_dir, model="llama", write=True)
    cold = StartupReport(mode="graph")
    with triton_kernels_at_startup(entry, cold) as run_every_bucket:
        assert run_every_bucket
        private = triton_cache_dir()
        assert private != user_triton and private.is_dir()
        compile_in_triton("e" * 64, "_silu_and_mul_kernel")
        compile_in_triton("f" * 64, "_write_kv_kernel")
        (private / ("0" * 64)).mkdir()
        (private / ("0" * 64) / "__triton_launcher.so").write_bytes(b"so")  # a launcher built with gcc
    assert cold.stored and private not in triton_cache_dir().parents
    assert triton_cache_dir() == user_triton and not private.exists()  # put back, scratch removed
    assert not user_triton.exists()  # the user's folder was not written
    assert entry.key in cold.stored and "compiled (2) and cached (2 kernels" in cold.triton

    # A copy of the cache on "another machine": a fresh Triton folder, nothing compiled.
    copy = tmp_path / "copied-cache"
    with ArtifactStore(cache_dir) as store:
        stored = store.get(entry.key)
        assert stored is not None
        store.export_to(tmp_path / "cache.tar")
    with ArtifactStore(str(copy)) as store:
        store.import_from(tmp_path / "cache.tar")
    fresh = tmp_path / "fresh-triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    warm_entry = TritonKernelsEntry(key=entry.key, factors=entry.factors, cache_dir=str(copy), model="llama",
                                    write=True, data=stored.data)
    warm = StartupReport(mode="graph")
    with triton_kernels_at_startup(warm_entry, warm) as run_every_bucket:
        assert not run_every_bucket
        assert (fresh / ("e" * 64) / "_silu_and_mul_kernel.cubin").is_file()
        compile_in_triton("e" * 64, "_silu_and_mul_kernel", cache_hit=True)
        (fresh / ("e" * 64) / "__triton_launcher.so").write_bytes(b"so")  # built now: counted
    # The restored launcher is not counted as built; the one written during the block is.
    assert warm.triton == "Triton kernels from the cache (7 files restored), 1 compiled"
    warm = StartupReport(mode="graph")
    again = TritonKernelsEntry(key=entry.key, factors=entry.factors, cache_dir=str(copy), model="llama",
                               write=True, data=stored.data)  # a second start-up looks the entry up again
    with triton_kernels_at_startup(again, warm):
        pass  # restored files (kept from before) are not counted as built
    assert warm.triton == "Triton kernels from the cache (0 files restored), 0 compiled"
    grp = json.loads((fresh / ("f" * 64) / "__grp___write_kv_kernel.json").read_text())
    assert all(Path(p).is_file() and fresh in Path(p).parents for p in grp["child_paths"].values())


def test_startup_stores_nothing_when_the_process_compiled_nothing(tmp_path: Path) -> None:
    """Kernels already in Triton's in-memory cache are not compiled again, so their files never
    reach the private folder: such a capture would be partial and is not stored."""
    entry = TritonKernelsEntry(key="tritonkernels-" + "1" * 32, factors={}, cache_dir=str(tmp_path / "c"),
                               model="llama", write=True)
    report = StartupReport(mode="graph")
    with triton_kernels_at_startup(entry, report):
        pass
    assert "not cached: no Triton kernel was compiled" in report.triton
    with ArtifactStore(entry.cache_dir) as store:
        assert entry.key not in store


def test_a_damaged_entry_is_dropped_and_taken_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "t"))
    entry = TritonKernelsEntry(key="tritonkernels-" + "2" * 32, factors={}, cache_dir=str(tmp_path / "c"),
                               model="llama", write=True, data=b"garbage")
    report = StartupReport(mode="graph")
    with triton_kernels_at_startup(entry, report) as run_every_bucket:
        assert run_every_bucket  # taken again
        compile_in_triton("9" * 64, "_rms_norm_kernel")
    assert "cached (1 kernels" in report.triton


def test_driver_module_built_before_a_capture_joins_the_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's driver module (cuda_utils) is built once per process, in whatever folder is
    current then: a capture that begins later takes it from there, or a server would build it."""
    from kiln.compiler.triton_kernels import capture_triton_kernels

    outer = tmp_path / "outer"
    (outer / ("a" * 64)).mkdir(parents=True)
    (outer / ("a" * 64) / "cuda_utils.cpython-312-x86_64-linux-gnu.so").write_bytes(b"so")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(outer))
    with capture_triton_kernels(tmp_path / "scratch") as capture:
        compile_in_triton("b" * 64, "_rms_norm_kernel")
    assert capture.data is not None
    restored = tmp_path / "restored"
    restore_triton_kernels(capture.data, restored)
    assert (restored / ("a" * 64) / "cuda_utils.cpython-312-x86_64-linux-gnu.so").is_file()


def test_loaded_driver_module_joins_the_entry_wherever_it_was_built(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor builds the driver module inside its own Triton folder (neither the outer nor
    the private one): the module this process loaded is taken from its own file."""
    from kiln.compiler import triton_kernels
    from kiln.compiler.triton_kernels import capture_triton_kernels

    inductors = tmp_path / "inductor-triton" / ("e" * 64)
    inductors.mkdir(parents=True)
    module = inductors / "cuda_utils.cpython-312-x86_64-linux-gnu.so"
    module.write_bytes(b"so")
    monkeypatch.setattr(triton_kernels, "_loaded_driver_module", lambda: module)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "outer"))
    with capture_triton_kernels(tmp_path / "scratch") as capture:
        compile_in_triton("b" * 64, "_rms_norm_kernel")
    restored = tmp_path / "restored"
    restore_triton_kernels(capture.data, restored)
    assert (restored / ("e" * 64) / module.name).read_bytes() == b"so"


def test_no_driver_module_without_a_gpu_driver() -> None:
    from kiln.compiler.triton_kernels import _loaded_driver_module

    if torch.cuda.is_available():
        pytest.skip("a GPU driver is loaded here")
    assert _loaded_driver_module() is None


def test_merged_entries_hold_the_kernels_of_both(tmp_path: Path) -> None:
    from kiln.compiler.triton_kernels import merge_triton_entries

    first, second = tmp_path / "first", tmp_path / "second"
    write_kernel(first, "c" * 64, "_rms_norm_kernel")
    write_kernel(second, "d" * 64, "_rms_norm_kernel")  # another specialisation of the same kernel
    data, kernels = merge_triton_entries([pack_triton_folder(first)[0], pack_triton_folder(second)[0]],
                                         tmp_path / "scratch")
    assert kernels == 2
    out = tmp_path / "out"
    assert restore_triton_kernels(data, out) == 6
    grp = json.loads((out / ("d" * 64) / "__grp___rms_norm_kernel.json").read_text())
    assert all(Path(p).is_file() and out in Path(p).parents for p in grp["child_paths"].values())
