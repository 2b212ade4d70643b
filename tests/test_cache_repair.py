"""A compile cache whose SQLite database is damaged on disk heals, and no command shows a traceback.

The database is damaged the three ways a disk, a crash or a stray `>` leave it: garbage
bytes, truncated (a malformed image) and empty (0 bytes). Every `kiln` command runs as a
user runs it, in a subprocess, and must: say which file was damaged, move it aside,
rebuild the cache from the data files that still verify, and go on (exit 0 for `ls`,
`clear` and `generate`; `verify` exits 1 once for what it found). Orphan data files (the
state an older Kiln left after an empty database) are listed by `verify` and removed by
`verify --repair` and `clear`.

The ~40 commands run each in a process of its own forked from one that imported torch and
Kiln once (tests/cli_forkserver.py): importing them was most of each command's time. The
warm-start fixture's cold `kiln generate` runs as a plain `python -m kiln.runtime.cli`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import diskcache
import pytest

from kiln.cache.manifest import Manifest
from kiln.cache.store import ArtifactStore, database_problem

from cli_forkserver import CliForkServer
from runtime_text_model import text_model_dir

KILN = [sys.executable, "-m", "kiln.runtime.cli"]
DAMAGES = ("garbage", "truncated", "empty")


def _key(n: int) -> str:
    return f"bucket-{n:032x}"


def _fill(root: Path, n: int = 3) -> list[str]:
    keys = [_key(i) for i in range(n)]
    with ArtifactStore(root) as store:
        for i, key in enumerate(keys):
            store.put(Manifest(key=key, kind="bucket", label=f"decode-{i}", model="llama", factors={"bucket": i},
                               checksum="", size=0, created=time.time(), compile_seconds=1.0),
                      os.urandom(5000 + 1000 * i))
    return keys


def damage(db: Path, how: str) -> None:
    """Damage a (closed) SQLite database file in place."""
    for extra in (Path(f"{db}-wal"), Path(f"{db}-shm")):
        extra.unlink(missing_ok=True)  # what is left is only the damaged file itself
    size = db.stat().st_size
    if how == "garbage":
        db.write_bytes(os.urandom(size))
    elif how == "truncated":
        db.write_bytes(db.read_bytes()[: size // 2])
    else:
        db.write_bytes(b"")
    assert database_problem(db) is not None


_cli: CliForkServer | None = None


@pytest.fixture(scope="module", autouse=True)
def cli_fork_server():
    """One fork server for the module's commands, started on the first one."""
    yield
    global _cli
    if _cli is not None:
        _cli.close()
        _cli = None


def kiln(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
         fresh_interpreter: bool = False) -> subprocess.CompletedProcess:
    """`kiln ARGS` in a process of its own: forked from the fork server (imports done), or with
    `fresh_interpreter`, `python -m kiln.runtime.cli ARGS` from the start."""
    global _cli
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if fresh_interpreter:
        proc = subprocess.run([*KILN, *args], capture_output=True, text=True, timeout=timeout, env=env)
    else:
        if _cli is None:
            _cli = CliForkServer().start()
        proc = _cli.run(list(args), env=env, timeout=timeout)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


def assert_reported(proc: subprocess.CompletedProcess, db: Path) -> None:
    assert f"the database {db} is damaged" in proc.stderr, proc.stderr[-2000:]
    assert "moved it to cache.db.damaged-" in proc.stderr


def data_files(root: Path) -> list[Path]:
    return sorted((root / "entries").rglob("*.val"))


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("which", ["entries", "index"])
def test_damaged_database_heals_for_ls_verify_clear(tmp_path, how, which):
    root = tmp_path / "cache"
    keys = _fill(root)
    db = root / which / "cache.db"

    damage(db, how)
    ls = kiln("cache", "ls", "--cache-dir", str(root))
    assert ls.returncode == 0, ls.stderr[-2000:]
    assert_reported(ls, db)
    assert all(key in ls.stdout for key in keys) and "3 entries" in ls.stdout
    assert list(db.parent.glob("cache.db.damaged-*")), "the damaged file was not kept aside"

    damage(db, how)
    verify = kiln("cache", "verify", "--cache-dir", str(root))
    assert_reported(verify, db)
    assert verify.returncode == 1 and "3 entries ok" in verify.stdout, verify.stdout
    again = kiln("cache", "verify", "--cache-dir", str(root))
    assert again.returncode == 0 and "3 entries ok" in again.stdout and not again.stderr.strip(), again

    damage(db, how)
    clear = kiln("cache", "clear", "--cache-dir", str(root))
    assert clear.returncode == 0, clear.stderr[-2000:]
    assert "removed 3 entries" in clear.stdout
    assert data_files(root) == [] and list((root / "manifests").glob("*.json")) == []
    assert kiln("cache", "ls", "--cache-dir", str(root)).stdout.strip().endswith("empty")


def test_both_databases_damaged_rebuild_from_files_and_manifests(tmp_path):
    root = tmp_path / "cache"
    keys = _fill(root)
    damage(root / "entries" / "cache.db", "empty")
    damage(root / "index" / "cache.db", "garbage")
    # A data file that no longer verifies is not taken back.
    victim = max(data_files(root), key=lambda f: f.stat().st_size)
    victim.write_bytes(b"\0" * victim.stat().st_size)
    with ArtifactStore(root) as store:
        assert sorted(r.path.parent.name for r in store.repairs) == ["entries", "index"]
        recovered = {m.key for m in store.manifests()}
        assert recovered == set(keys) - {_key(2)}  # the largest, zeroed file held entry 2
        assert all(store.get(k) is not None for k in recovered)
        report = store.verify()
        assert [f.name for f in report.orphans] == [victim.name]


def test_orphans_are_listed_then_recovered_or_removed(tmp_path):
    """The state an empty database left before this fix: a fresh, valid but empty database
    next to the old data files. Nothing is damaged, so only verify/clear can see them."""
    root = tmp_path / "cache"
    keys = _fill(root, 2)
    for part in (root / "entries").glob("cache.db*"):
        part.unlink()
    diskcache.Cache(str(root / "entries")).close()  # what diskcache makes of a missing database
    junk = root / "entries" / "ab" / "cd" / "0123456789abcdef.val"
    junk.parent.mkdir(parents=True)
    junk.write_bytes(b"not an artifact")

    verify = kiln("cache", "verify", "--cache-dir", str(root))
    assert verify.returncode == 1 and "0 entries ok" in verify.stdout
    assert "3 orphan data files" in verify.stdout and "--repair" in verify.stdout, verify.stdout

    repair = kiln("cache", "verify", "--repair", "--cache-dir", str(root))
    assert repair.returncode == 1, repair.stdout  # it found (and fixed) problems
    assert all(f"recovered entry {k}" in repair.stdout for k in keys), repair.stdout
    assert "removed 1 orphan data files" in repair.stdout and not junk.exists()
    assert kiln("cache", "verify", "--cache-dir", str(root)).returncode == 0

    for part in (root / "entries").glob("cache.db*"):
        part.unlink()
    diskcache.Cache(str(root / "entries")).close()
    clear = kiln("cache", "clear", "--cache-dir", str(root))
    assert clear.returncode == 0 and data_files(root) == []


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> tuple[str, Path]:
    """The tiny text model's post-pass graph stored by a cold `kiln generate --compile graph`."""
    model = str(text_model_dir(tmp_path_factory))
    root = tmp_path_factory.mktemp("repair-warm") / "cache"
    cold = kiln("generate", "--model", model, "--cache-dir", str(root), "--compile", "graph", "--max-tokens", "3",
                "--max-model-len", "128", "Hello", fresh_interpreter=True)
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert len(data_files(root)) == 3  # the graph spec, the graph code and the config's snapshot
    return model, root


@pytest.mark.parametrize("how", DAMAGES)
def test_warm_start_and_generate_with_a_damaged_database(warm_cache, how):
    model, root = warm_cache
    db = root / "entries" / "cache.db"
    damage(db, how)
    # --require-cache fails unless every entry is there: the warm start proves the rebuild.
    warm = kiln("generate", "--model", model, "--cache-dir", str(root), "--compile", "graph", "--require-cache",
                "--max-tokens", "3", "--max-model-len", "128", "--verbose", "Hello")
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert_reported(warm, db)
    assert "capture skipped" in warm.stderr, warm.stderr[-3000:]
    # Plain `kiln generate` (no --cache-dir) with the damaged cache as the default one.
    damage(db, how)
    plain = kiln("generate", "--model", model, "--max-tokens", "3", "--max-model-len", "128", "Hello",
                 env={"KILN_CACHE_DIR": str(root)})
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert_reported(plain, db)
    assert plain.stdout.strip()


def test_require_cache_does_not_create_a_missing_directory(warm_cache, tmp_path):
    model, _ = warm_cache
    missing = tmp_path / "no-such-cache"
    proc = kiln("generate", "--model", model, "--cache-dir", str(missing), "--require-cache", "--max-tokens", "2",
                "--max-model-len", "128", "Hello")
    assert proc.returncode == 2 and not missing.exists()
    assert "--require-cache" in proc.stderr and "does not exist" in proc.stderr and "require_cache " not in proc.stderr
