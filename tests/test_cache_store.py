"""The artifact store on diskcache: checksums, corruption, LRU eviction, export/import, the CLI."""

from __future__ import annotations

import io
import logging
import os
import tarfile
import time

import pytest

from kiln.cache.manifest import Manifest, checksum
from kiln.cache.store import ArtifactStore, CacheStoreError, default_cache_dir, parse_size


def _key(n: int, kind: str = "bucket") -> str:
    return f"{kind}-{n:032x}"


def _manifest(key: str, label: str = "decode-1") -> Manifest:
    return Manifest(key=key, kind="bucket", label=label, model="llama", factors={"torch": "x", "bucket": {"seqs": 1}},
                    checksum="", size=0, created=time.time(), compile_seconds=1.5)


def _payload(n: int, size: int = 100_000) -> bytes:
    return (f"artifact {n} ".encode() * (size // 10 + 1))[:size]


def test_put_get_roundtrip(tmp_path):
    with ArtifactStore(tmp_path) as store:
        stored = store.put(_manifest(_key(1)), _payload(1))
        assert stored.size == 100_000 and stored.checksum == checksum(_payload(1))
        entry = store.get(_key(1))
        assert entry is not None and entry.data == _payload(1) and entry.manifest.label == "decode-1"
        assert store.get(_key(2)) is None
        assert [m.key for m in store.manifests()] == [_key(1)]
        assert store.entry_path(_key(1)).stat().st_size == 100_000


def test_small_entries_are_files_too(tmp_path):
    """Every entry is a file with its manifest beside it (none inline in the database, as
    diskcache would keep values under 32 KiB), so a lost database can be rebuilt from them."""
    with ArtifactStore(tmp_path) as store:
        store.put(_manifest(_key(3)), b"tiny")
        assert store.get(_key(3)).data == b"tiny"
        assert store.entry_path(_key(3)).read_bytes() == b"tiny"
        assert (tmp_path / "manifests" / f"{_key(3)}.json").is_file()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_entry_is_reported_dropped_and_never_returned(tmp_path, caplog, damage):
    with ArtifactStore(tmp_path) as store:
        store.put(_manifest(_key(1)), _payload(1))
        path = store.entry_path(_key(1))
        if damage == "truncate":
            os.truncate(path, 5000)
        elif damage == "flip":
            data = bytearray(path.read_bytes())
            data[123] ^= 0xFF
            path.write_bytes(bytes(data))
        else:
            path.unlink()
        with caplog.at_level(logging.WARNING, logger="kiln.cache"):
            assert store.get(_key(1)) is None
        assert _key(1) in caplog.text and "corrupt" in caplog.text
        expected = {"truncate": "truncated", "flip": "checksum mismatch", "delete": "data file is missing"}[damage]
        assert expected in caplog.text
        assert [k for k, _ in store.dropped] == [_key(1)]
        assert _key(1) not in store and store.manifests() == []
        # Rebuilt: the next put under the same key is a good entry again.
        store.put(_manifest(_key(1)), _payload(1))
        assert store.get(_key(1)).data == _payload(1)


def test_verify_reports_and_drops_corrupt_entries(tmp_path):
    with ArtifactStore(tmp_path) as store:
        store.put(_manifest(_key(1)), _payload(1))
        store.put(_manifest(_key(2)), _payload(2))
        os.truncate(store.entry_path(_key(2)), 10)
        report = store.verify()
        assert [m.key for m in report.ok] == [_key(1)]
        assert [k for k, _ in report.dropped] == [_key(2)]
        assert not report.healthy
        again = store.verify()
        assert again.healthy and len(again.ok) == 1


def test_lru_eviction_keeps_recently_used_and_newest(tmp_path):
    """Over the size limit, the least recently *used* entry goes first, never the new one."""
    with ArtifactStore(tmp_path, size_limit=600_000) as store:
        for n in (1, 2, 3):
            store.put(_manifest(_key(n)), _payload(n, 150_000))
        assert all(_key(n) in store for n in (1, 2, 3))
        assert store.get(_key(1)) is not None  # 1 is now more recently used than 2 and 3
        store.put(_manifest(_key(4)), _payload(4, 150_000))  # volume > limit: evict 2 (LRU)
        assert _key(2) not in store
        assert all(_key(n) in store for n in (1, 3, 4))
        assert store.volume() <= 600_000
        assert {m.key for m in store.manifests()} == {_key(1), _key(3), _key(4)}
        # An entry larger than the limit on its own is kept (everything else goes).
        store.put(_manifest(_key(5)), _payload(5, 700_000))
        assert [m.key for m in store.manifests()] == [_key(5)]


def test_export_import_roundtrip_and_damage(tmp_path):
    with ArtifactStore(tmp_path / "a") as a:
        a.put(_manifest(_key(1)), _payload(1))
        a.put(_manifest(_key(2), "tokens-16"), _payload(2))
        exported = a.export_to(tmp_path / "cache.tar")
    assert {m.key for m in exported} == {_key(1), _key(2)}
    with ArtifactStore(tmp_path / "b") as b:
        report = b.import_from(tmp_path / "cache.tar")
        assert sorted(report.imported) == sorted([_key(1), _key(2)]) and not report.rejected
        assert b.get(_key(2)).data == _payload(2) and b.get(_key(2)).manifest.label == "tokens-16"
        again = b.import_from(tmp_path / "cache.tar")
        assert sorted(again.already_present) == sorted([_key(1), _key(2)]) and not again.imported
    # A damaged member is rejected, the good one imported.
    with tarfile.open(tmp_path / "cache.tar") as src, tarfile.open(tmp_path / "bad.tar", "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name == f"entries/{_key(1)}":
                data = data[:-1] + b"!"
            member.size = len(data)
            dst.addfile(member, io.BytesIO(data))
    with ArtifactStore(tmp_path / "c") as c:
        report = c.import_from(tmp_path / "bad.tar")
        assert report.imported == [_key(2)]
        assert report.rejected and report.rejected[0][0] == _key(1) and "checksum" in report.rejected[0][1]
    with pytest.raises(CacheStoreError, match="not a kiln cache export"):
        (tmp_path / "junk.tar").write_bytes(b"not a tar")
        ArtifactStore(tmp_path / "d").import_from(tmp_path / "junk.tar")


def test_default_location_and_sizes(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("KILN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "kiln"
    assert parse_size("20G") == 20 * 2**30 and parse_size("512MiB") == 512 * 2**20 and parse_size("1000") == 1000
    with pytest.raises(CacheStoreError, match="expected a number of bytes"):
        parse_size("lots")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CacheStoreError, match="is not a directory"):
        ArtifactStore(tmp_path / "file")


def test_lock_serializes_holders(tmp_path):
    """The per-key lock is exclusive across processes (flock): a second holder waits."""
    import subprocess
    import sys

    with ArtifactStore(tmp_path) as store:
        key = _key(7)
        code = (
            "import sys, time; from kiln.cache.store import ArtifactStore\n"
            f"s = ArtifactStore({str(tmp_path)!r})\n"
            "print('ready', flush=True)\n"
            "t = time.perf_counter()\n"
            f"with s.lock({key!r}): print(round(time.perf_counter() - t, 2))\n"
        )
        with store.lock(key):
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            # Hold the lock for 1.5 s from when the child is about to ask for it: its start-up
            # (imports) takes a second or more on a loaded machine and must not count.
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(1.5)
            assert proc.poll() is None  # still waiting for the lock
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and float(out.strip()) >= 1.0
        with pytest.raises(CacheStoreError, match="not a cache key"):
            with store.lock("../etc/passwd"):
                pass


def test_cache_cli_ls_info_verify_clear_export_import(tmp_path, capsys):
    from kiln.runtime.cli import main

    with ArtifactStore(tmp_path / "a") as store:
        store.put(_manifest(_key(1)), _payload(1))
        store.put(_manifest(_key(2), "tokens-16"), _payload(2))
        os.truncate(store.entry_path(_key(2)), 100)
    a = str(tmp_path / "a")
    assert main(["cache", "ls", "--cache-dir", a]) == 0
    out = capsys.readouterr().out
    assert _key(1) in out and "decode-1" in out and "2 entries" in out
    assert main(["cache", "info", _key(1), "--cache-dir", a]) == 0
    info = capsys.readouterr().out
    assert '"label": "decode-1"' in info and '"path":' in info
    assert main(["cache", "info", "bucket-ffff", "--cache-dir", a]) == 2
    assert "no cache entry has a key starting with" in capsys.readouterr().err
    assert main(["cache", "verify", "--cache-dir", a]) == 1
    out = capsys.readouterr().out
    assert f"dropped corrupt entry {_key(2)}" in out and "1 entries ok" in out
    assert main(["cache", "verify", "--cache-dir", a]) == 0
    capsys.readouterr()
    assert main(["cache", "export", str(tmp_path / "x.tar"), "--cache-dir", a]) == 0
    assert "exported 1 entries" in capsys.readouterr().out
    assert main(["cache", "import", str(tmp_path / "x.tar"), "--cache-dir", str(tmp_path / "b")]) == 0
    assert "imported 1 entries" in capsys.readouterr().out
    assert main(["cache", "clear", "--cache-dir", a]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert main(["cache", "ls", "--cache-dir", a]) == 0
    assert "empty" in capsys.readouterr().out
