"""The artifact store: compiled artifacts and graph specs on disk, on `diskcache`.

Layout under the cache directory:

    entries/   diskcache.Cache: key -> the entry's bytes, tagged with its manifest (JSON).
               Size-limited, least-recently-used eviction. Value and manifest are one row,
               so they are written and evicted together.
    index/     diskcache.Cache: key -> manifest, for listing without reading (and without
               refreshing the LRU clock of) every artifact; entries evicted since are
               pruned from it as they are found.
    manifests/ one JSON file per entry (its manifest), next to the data files: what a
               damaged database is rebuilt from.
    locks/     one lock file per key being compiled (fcntl.flock, released by the kernel
               if the holder dies), so two processes never compile the same key at once.

Every read checks the bytes against the manifest's size and SHA-256. A corrupt, truncated
or half-deleted entry is reported (a warning naming the key and what is wrong), dropped,
and reported to the caller as a miss, so it is rebuilt; it is never loaded.

Opening the store checks both SQLite databases (`PRAGMA quick_check` and a read of
diskcache's table, which fail fast). A damaged or empty (0-byte) database is moved aside
(`cache.db.damaged-<time>`, with a warning naming the file) and rebuilt: the entries'
database from the data files whose size and checksum match a manifest (from `manifests/`
or the index), the index from the entries. Data files no database row points to (orphans)
are listed by `verify()` and removed by `verify(repair=True)` and `clear()`. Every entry is
stored as a file (never inline in the database), so each one can be recovered this way.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import re
import sqlite3
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import diskcache

from kiln.cache.manifest import Manifest, ManifestError, checksum

logger = logging.getLogger("kiln.cache")

CACHE_DIR_ENV = "KILN_CACHE_DIR"
SIZE_LIMIT_ENV = "KILN_CACHE_SIZE_LIMIT"
DEFAULT_SIZE_LIMIT = 20 * 2**30  # 20 GiB: a few hundred CPU buckets, or tens of large CUDA ones
EXPORT_FORMAT = "kiln-cache-export/1"
EXPORT_INDEX = "kiln-cache-export.json"
_KEY_RE = re.compile(r"^[a-z]+-[0-9a-f]{32}$")


class CacheStoreError(ValueError):
    """A cache directory or export file that cannot be used; the message says which and why."""


def default_cache_dir() -> Path:
    """$KILN_CACHE_DIR, else the user's cache directory ($XDG_CACHE_HOME or ~/.cache) / kiln."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "kiln"


def parse_size(text: str) -> int:
    """'20G', '500M', '1048576' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)i?[bB]?\s*", text)
    if not m:
        raise CacheStoreError(f"cache size limit {text!r}: expected a number of bytes, e.g. 20G or 500M")
    scale = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


@dataclass
class StoredEntry:
    manifest: Manifest
    data: bytes


@dataclass
class VerifyReport:
    ok: list[Manifest] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (key, what was wrong)
    warnings: list[str] = field(default_factory=list)
    orphans: list[Path] = field(default_factory=list)  # data files no entry points to (left in place)
    removed_orphans: list[Path] = field(default_factory=list)  # ... removed (repair=True)
    adopted: list[str] = field(default_factory=list)  # keys recovered from orphan files (repair=True)

    @property
    def healthy(self) -> bool:
        return not self.dropped and not self.warnings and not self.orphans


@dataclass
class DatabaseRepair:
    """One damaged database found on open: moved aside and rebuilt."""

    path: Path  # the database file that was damaged
    problem: str
    moved_to: Path | None
    recovered: list[str] = field(default_factory=list)  # keys rebuilt from data files


@dataclass
class ImportReport:
    imported: list[str] = field(default_factory=list)
    already_present: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)


class ArtifactStore:
    """Checked, size-limited, process-safe storage of cache entries (see module doc)."""

    def __init__(self, root: str | os.PathLike | None = None, size_limit: int | None = None, create: bool = True):
        """Open (with `create`, make) the cache at `root`; see the module doc for the checks on open.

        Raises CacheStoreError for a directory that cannot be used (and, with
        `create=False`, for one that does not exist), never a database error.
        """
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        if self.root.exists() and not self.root.is_dir():
            raise CacheStoreError(f"cache directory {self.root} exists and is not a directory")
        if not create and not self.root.is_dir():
            raise CacheStoreError(f"cache directory {self.root} does not exist")
        if size_limit is None:
            size_limit = parse_size(os.environ[SIZE_LIMIT_ENV]) if os.environ.get(SIZE_LIMIT_ENV) else DEFAULT_SIZE_LIMIT
        # Keys dropped as corrupt by this store object, with the reason (for start-up reports).
        self.dropped: list[tuple[str, str]] = []
        # Damaged databases found (and rebuilt) when this store was opened.
        self.repairs: list[DatabaseRepair] = []
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "locks").mkdir(exist_ok=True)
            (self.root / "manifests").mkdir(exist_ok=True)
            # One process at a time checks (and, if need be, rebuilds) the databases.
            with open(self.root / "locks" / "open.lock", "a+b") as fh:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
                damaged = {name: self._check_database(name) for name in ("entries", "index")}
                self._open(int(size_limit))
                if damaged["entries"] is not None:
                    self._rebuild_entries(damaged["entries"])
                if damaged["entries"] is not None or damaged["index"] is not None:
                    self._sync_index()
        except OSError as e:
            raise CacheStoreError(f"cannot use cache directory {self.root}: {e}") from e
        except sqlite3.Error as e:  # damaged in a way the checks on open did not catch
            raise CacheStoreError(f"the cache database in {self.root} cannot be used ({e}); move the directory "
                                  "aside or delete it") from e

    def _open(self, size_limit: int) -> None:
        # cull_limit=0: diskcache's own culling evicts ten rows at a time, which can include
        # the entry just written; put() evicts least-recently-used entries one by one instead.
        # disk_min_file_size=0: every value is a file, so a lost database can be rebuilt from them.
        self.entries = diskcache.Cache(str(self.root / "entries"), size_limit=size_limit,
                                       eviction_policy="least-recently-used", cull_limit=0, disk_min_file_size=0)
        self.index = diskcache.Cache(str(self.root / "index"), eviction_policy="none")

    def _check_database(self, name: str) -> DatabaseRepair | None:
        """Check `name`/cache.db; if it is damaged or empty, move it aside (warning) and say so."""
        path = self.root / name / "cache.db"
        if not path.exists():
            return None
        problem = database_problem(path)
        if problem is None:
            return None
        aside = path.with_name(f"cache.db.damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        for suffix in ("", "-wal", "-shm"):  # a stale write-ahead log must not meet the new database
            part = Path(str(path) + suffix)
            if part.exists():
                os.replace(part, Path(str(aside) + suffix))
        logger.warning("kiln cache: the database %s is damaged (%s); moved it to %s and rebuilding it%s",
                       path, problem, aside.name,
                       " from the data files that still verify" if name == "entries" else " from the entries")
        repair = DatabaseRepair(path=path, problem=problem, moved_to=aside)
        self.repairs.append(repair)
        return repair

    def _known_manifests(self) -> dict[str, Manifest]:
        """Every manifest on disk (manifests/ files, then the index), newest per key."""
        found: dict[str, Manifest] = {}

        def consider(text: str | None) -> None:
            try:
                m = Manifest.from_json(text)
            except ManifestError:
                return
            if _KEY_RE.match(m.key) and (m.key not in found or m.created > found[m.key].created):
                found[m.key] = m

        for f in (self.root / "manifests").glob("*.json"):
            with contextlib.suppress(OSError, UnicodeDecodeError):
                consider(f.read_text())
        with contextlib.suppress(sqlite3.Error):
            for key in list(self.index.iterkeys()):
                consider(self.index.get(key, retry=True))
        return found

    def _rebuild_entries(self, repair: DatabaseRepair | None) -> list[str]:
        """Store again every orphan data file whose size and checksum match a manifest; returns their keys."""
        orphans = self.orphan_files()
        if not orphans:
            return []
        by_size: dict[int, list[Path]] = {}
        for f in orphans:
            with contextlib.suppress(OSError):
                by_size.setdefault(f.stat().st_size, []).append(f)
        recovered = []
        for key, manifest in self._known_manifests().items():
            if key in self.entries:
                continue
            for f in by_size.get(manifest.size, []):
                try:
                    data = f.read_bytes()
                except OSError:
                    continue
                if checksum(data) != manifest.checksum:
                    continue
                self.entries.set(key, data, tag=manifest.to_json(), retry=True)
                by_size[manifest.size].remove(f)
                self._remove_data_file(f)  # stored again under a new name just above
                recovered.append(key)
                break
        if repair is not None:
            repair.recovered = recovered
        if recovered:
            logger.warning("kiln cache: recovered %d entries of %s from their data files: %s", len(recovered),
                           self.root, ", ".join(recovered))
        self.evict()
        return recovered

    def _sync_index(self) -> None:
        """Make the index hold exactly the entries' manifests (after a rebuild)."""
        keys = set(self.entries.iterkeys())
        for key in keys:
            _, tag = self.entries.get(key, default=None, read=True, tag=True, retry=True)
            if tag is not None and self.index.get(key, retry=True) is None:
                self.index.set(key, tag, retry=True)
        for key in list(self.index.iterkeys()):
            if key not in keys:
                self.index.delete(key, retry=True)

    def _remove_data_file(self, f: Path) -> bool:
        """Delete a data file and the directories diskcache made for it, if now empty (its check
        warns about empty directories)."""
        try:
            f.unlink()
        except OSError:
            return False
        base = self.root / "entries"
        for d in (f.parent, f.parent.parent):
            if d != base and base in d.parents:
                with contextlib.suppress(OSError):
                    d.rmdir()  # fails, as wanted, when not empty
        return True

    def orphan_files(self) -> list[Path]:
        """Data files under entries/ that no row of the entries' database points to."""
        referenced = {row[0] for row in self.entries._sql("SELECT filename FROM Cache WHERE filename IS NOT NULL")}
        base = self.root / "entries"
        return sorted(f for f in base.rglob("*.val") if f.relative_to(base).as_posix() not in referenced)

    # ---- reading ----------------------------------------------------------------------
    def get(self, key: str) -> StoredEntry | None:
        """The entry's verified bytes and manifest, or None on a miss (or a dropped corrupt entry)."""
        try:
            got = self.entries.get(key, default=None, read=True, tag=True, retry=True)
        except Exception as e:  # a damaged database row or value file
            self.drop(key, f"cannot be read ({e})")
            return None
        handle, tag = got
        if handle is None:
            if key in self.entries:
                self.drop(key, "its data file is missing")
            return None
        if isinstance(handle, (bytes, bytearray)):
            data = bytes(handle)  # small values live inline in the database, not in a file
        else:
            with handle:
                data = handle.read()
        problem = None
        try:
            manifest = Manifest.from_json(tag)
        except ManifestError as e:
            problem = str(e)
        else:
            if len(data) != manifest.size:
                problem = f"truncated or overwritten: {len(data)} bytes on disk, manifest says {manifest.size}"
            elif checksum(data) != manifest.checksum:
                problem = "checksum mismatch: the bytes on disk are not the bytes that were stored"
            elif manifest.key != key:
                problem = f"manifest belongs to another key ({manifest.key})"
        if problem:
            self.drop(key, problem)
            return None
        return StoredEntry(manifest=manifest, data=data)

    def __contains__(self, key: str) -> bool:
        """Whether an entry is stored under `key` (unverified, and without touching its LRU time)."""
        return key in self.entries

    def manifest(self, key: str) -> Manifest | None:
        """The manifest of `key` from the index, without reading the entry's bytes."""
        text = self.index.get(key, default=None, retry=True)
        if text is None or key not in self.entries:
            return None
        try:
            return Manifest.from_json(text)
        except ManifestError:
            return None

    def manifests(self) -> list[Manifest]:
        """Every stored entry's manifest (oldest first); index entries whose data was evicted are pruned."""
        out = []
        for key in list(self.index.iterkeys()):
            if key not in self.entries:
                self.index.delete(key, retry=True)  # evicted by the size limit, or dropped
                continue
            try:
                out.append(Manifest.from_json(self.index.get(key, retry=True)))
            except ManifestError:
                self.index.delete(key, retry=True)
        return sorted(out, key=lambda m: m.created)

    def entry_path(self, key: str) -> Path | None:
        """The file holding `key`'s bytes (None when it is missing or stored inline in the database)."""
        got = self.entries.get(key, default=None, read=True, retry=True)
        if got is None or isinstance(got, (bytes, bytearray)):
            return None
        with got:
            name = getattr(got, "name", None)
        return Path(name) if isinstance(name, str) else None

    def volume(self) -> int:
        """Bytes on disk used by entries (diskcache's own measure, which the size limit applies to)."""
        return int(self.entries.volume())

    @property
    def size_limit(self) -> int:
        return int(self.entries.size_limit)

    # ---- writing ----------------------------------------------------------------------
    def put(self, manifest: Manifest, data: bytes) -> Manifest:
        """Store `data` under `manifest.key`; size and checksum are filled in here."""
        manifest.size = len(data)
        manifest.checksum = checksum(data)
        text = manifest.to_json()
        self.entries.set(manifest.key, data, tag=text, retry=True)
        self.index.set(manifest.key, text, retry=True)
        _write_atomic(self._manifest_file(manifest.key), text.encode())
        self.evict(keep=manifest.key)
        return manifest

    def _manifest_file(self, key: str) -> Path:
        return self.root / "manifests" / f"{key}.json"

    def evict(self, keep: str | None = None) -> list[str]:
        """Drop least-recently-used entries (never `keep`) until the volume fits the size limit."""
        evicted: list[str] = []
        if self.entries.volume() <= self.size_limit:
            return evicted
        # diskcache keeps each row's access time (refreshed by every get under this policy);
        # it has no public "keys by access time", so read its documented Cache table directly.
        rows = self.entries._sql("SELECT key FROM Cache ORDER BY access_time").fetchall()
        for (key,) in rows:
            if self.entries.volume() <= self.size_limit:
                break
            if key == keep:
                continue
            if self.delete(key):
                evicted.append(key)
        if evicted:
            logger.info("kiln cache: evicted %d least-recently-used entries to stay under %d bytes: %s",
                        len(evicted), self.size_limit, ", ".join(evicted))
        return evicted

    def delete(self, key: str) -> bool:
        found = bool(self.entries.delete(key, retry=True))
        self.index.delete(key, retry=True)
        if _KEY_RE.match(key):
            with contextlib.suppress(OSError):
                self._manifest_file(key).unlink()
        return found

    def clear(self) -> int:
        """Remove every entry, orphan data file and manifest; returns how many entries there were."""
        n = len(self.entries)
        self.entries.clear(retry=True)
        self.index.clear(retry=True)
        for f in self.orphan_files():
            self._remove_data_file(f)
        for f in [*(self.root / "manifests").glob("*.json"), *self.root.glob("*/cache.db.damaged-*")]:
            with contextlib.suppress(OSError):
                f.unlink()
        for lock in (self.root / "locks").glob("*.lock"):
            if lock.name != "open.lock":  # held by whoever is opening the store right now
                with contextlib.suppress(OSError):
                    lock.unlink()
        return n

    def drop(self, key: str, problem: str) -> None:
        """Report `key` as corrupt (a warning naming it and the problem) and delete it."""
        logger.warning("kiln cache: entry %s in %s is corrupt (%s); dropping it, so it is rebuilt instead of loaded",
                       key, self.root, problem)
        self.dropped.append((key, problem))
        with contextlib.suppress(Exception):
            self.delete(key)

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[None]:
        """Hold `key`'s lock: one process compiles a key at a time; others wait, then read its entry."""
        if not _KEY_RE.match(key):
            raise CacheStoreError(f"not a cache key: {key!r}")
        path = self.root / "locks" / f"{key}.lock"
        with open(path, "a+b") as fh:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    # ---- checking, export, import -----------------------------------------------------
    def verify(self, repair: bool = False) -> VerifyReport:
        """Read and check every entry; corrupt ones are dropped and listed. Data files no entry
        points to are listed as orphans; with `repair`, those matching a manifest are stored
        again and the rest removed."""
        report = VerifyReport()
        if repair:
            report.adopted = self._rebuild_entries(None)
        before = len(self.dropped)
        for key in list(self.entries.iterkeys()):
            entry = self.get(key)
            if entry is not None:
                report.ok.append(entry.manifest)
                if self.index.get(key, retry=True) is None:
                    self.index.set(key, entry.manifest.to_json(), retry=True)  # written before a crash
        report.dropped = self.dropped[before:]
        for key in list(self.index.iterkeys()):
            if key not in self.entries:
                self.index.delete(key, retry=True)
        report.orphans = self.orphan_files()
        if repair:
            report.removed_orphans = [f for f in report.orphans if self._remove_data_file(f)]
            report.orphans = [f for f in report.orphans if f not in report.removed_orphans]
            live = set(self.entries.iterkeys())
            for f in (self.root / "manifests").glob("*.json"):
                if f.stem not in live:  # the manifest of an entry that is gone
                    with contextlib.suppress(OSError):
                        f.unlink()
        # diskcache's own consistency check; orphans are reported above, not again as "unknown file".
        report.warnings = [str(w.message) for w in self.entries.check(fix=repair)
                           if not issubclass(w.category, diskcache.UnknownFileWarning)]
        if repair:
            report.warnings = [w for w in report.warnings if not w.startswith("empty directory")]  # fixed
        return report

    def export_to(self, path: str | os.PathLike) -> list[Manifest]:
        """Write every valid entry to a tar file (entries are checked as they are read)."""
        path = Path(path)
        exported = []
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with tarfile.open(tmp, "w") as tar:
            for key in list(self.entries.iterkeys()):
                entry = self.get(key)
                if entry is None:
                    continue
                _add_bytes(tar, f"entries/{key}", entry.data)
                exported.append(entry.manifest)
            index = {"format": EXPORT_FORMAT, "created": time.time(),
                     "entries": [json.loads(m.to_json()) for m in exported]}
            _add_bytes(tar, EXPORT_INDEX, json.dumps(index, indent=1).encode())
        os.replace(tmp, path)
        return exported

    def import_from(self, path: str | os.PathLike) -> ImportReport:
        """Add the entries of an export file; each is checked before it is stored."""
        path = Path(path)
        if not path.is_file():
            raise CacheStoreError(f"cache export file not found: {path}")
        report = ImportReport()
        try:
            tar = tarfile.open(path, "r")
        except tarfile.TarError as e:
            raise CacheStoreError(f"{path} is not a kiln cache export (not a tar file: {e})") from e
        with tar:
            try:
                index_member = tar.extractfile(EXPORT_INDEX)
            except KeyError:
                index_member = None
            if index_member is None:
                raise CacheStoreError(f"{path} is not a kiln cache export: it has no {EXPORT_INDEX}")
            try:
                index = json.loads(index_member.read())
            except json.JSONDecodeError as e:
                raise CacheStoreError(f"{path}: {EXPORT_INDEX} is not valid JSON ({e})") from e
            if index.get("format") != EXPORT_FORMAT:
                raise CacheStoreError(f"{path}: export format {index.get('format')!r}, expected {EXPORT_FORMAT!r}")
            for raw in index.get("entries", []):
                try:
                    manifest = Manifest(**raw)
                except TypeError as e:
                    report.rejected.append((str(raw.get("key")), f"bad manifest ({e})"))
                    continue
                key = manifest.key
                if not _KEY_RE.match(key):
                    report.rejected.append((key, "not a cache key"))
                    continue
                try:
                    member = tar.extractfile(f"entries/{key}")
                    data = member.read() if member is not None else None
                except (KeyError, tarfile.TarError, OSError) as e:
                    report.rejected.append((key, f"cannot be read from the export ({e})"))
                    continue
                if data is None or len(data) != manifest.size or checksum(data) != manifest.checksum:
                    report.rejected.append((key, "checksum mismatch: the export file is damaged"))
                    continue
                if self.get(key) is not None:
                    report.already_present.append(key)
                    continue
                self.put(manifest, data)
                report.imported.append(key)
        return report

    def close(self) -> None:
        self.entries.close()
        self.index.close()

    def __enter__(self) -> "ArtifactStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def database_problem(path: Path) -> str | None:
    """What is wrong with the SQLite database at `path` (None: it is usable). Fails fast:
    `PRAGMA quick_check` plus one read of diskcache's table."""
    try:
        if path.stat().st_size == 0:
            return "the file is empty (0 bytes)"
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    try:
        con = sqlite3.connect(str(path), timeout=30)
    except sqlite3.Error as e:
        return str(e)
    try:
        rows = con.execute("PRAGMA quick_check").fetchall()
        if rows != [("ok",)]:
            return "; ".join(str(r[0]) for r in rows[:3])[:300] or "quick_check failed"
        con.execute("SELECT count(*) FROM Cache").fetchone()
    except sqlite3.Error as e:
        return str(e)
    finally:
        con.close()
    return None


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))

