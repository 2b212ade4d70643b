"""The artifact store: compiled artifacts and graph specs on disk, on `diskcache`.

Layout under the cache directory:

    entries/   diskcache.Cache: key -> the entry's bytes, tagged with its manifest (JSON).
               Size-limited, least-recently-used eviction. Value and manifest are one row,
               so they are written and evicted together.
    index/     diskcache.Cache: key -> manifest, for listing without reading (and without
               refreshing the LRU clock of) every artifact; entries evicted since are
               pruned from it as they are found.
    locks/     one lock file per key being compiled (fcntl.flock, released by the kernel
               if the holder dies), so two processes never compile the same key at once.

Every read checks the bytes against the manifest's size and SHA-256. A corrupt, truncated
or half-deleted entry is reported (a warning naming the key and what is wrong), dropped,
and reported to the caller as a miss, so it is rebuilt; it is never loaded.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import logging
import os
import re
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

    @property
    def healthy(self) -> bool:
        return not self.dropped and not self.warnings


@dataclass
class ImportReport:
    imported: list[str] = field(default_factory=list)
    already_present: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)


class ArtifactStore:
    """Checked, size-limited, process-safe storage of cache entries (see module doc)."""

    def __init__(self, root: str | os.PathLike | None = None, size_limit: int | None = None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        if self.root.exists() and not self.root.is_dir():
            raise CacheStoreError(f"cache directory {self.root} exists and is not a directory")
        if size_limit is None:
            size_limit = parse_size(os.environ[SIZE_LIMIT_ENV]) if os.environ.get(SIZE_LIMIT_ENV) else DEFAULT_SIZE_LIMIT
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            (self.root / "locks").mkdir(exist_ok=True)
            # cull_limit=0: diskcache's own culling evicts ten rows at a time, which can include
            # the entry just written; put() evicts least-recently-used entries one by one instead.
            self.entries = diskcache.Cache(str(self.root / "entries"), size_limit=int(size_limit),
                                           eviction_policy="least-recently-used", cull_limit=0)
            self.index = diskcache.Cache(str(self.root / "index"), eviction_policy="none")
        except OSError as e:
            raise CacheStoreError(f"cannot use cache directory {self.root}: {e}") from e
        # Keys dropped as corrupt by this store object, with the reason (for start-up reports).
        self.dropped: list[tuple[str, str]] = []

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
        self.evict(keep=manifest.key)
        return manifest

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
        return found

    def clear(self) -> int:
        """Remove every entry; returns how many there were."""
        n = len(self.entries)
        self.entries.clear(retry=True)
        self.index.clear(retry=True)
        for lock in (self.root / "locks").glob("*.lock"):
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
    def verify(self) -> VerifyReport:
        """Read and check every entry; corrupt ones are dropped and listed."""
        report = VerifyReport()
        before = len(self.dropped)
        for key in list(self.entries.iterkeys()):
            entry = self.get(key)
            if entry is not None:
                report.ok.append(entry.manifest)
                if self.index.get(key, retry=True) is None:
                    self.index.set(key, entry.manifest.to_json(), retry=True)  # written before a crash
        report.dropped = self.dropped[before:]
        report.warnings = [str(w.message) for w in self.entries.check()]
        for key in list(self.index.iterkeys()):
            if key not in self.entries:
                self.index.delete(key, retry=True)
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


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = int(time.time())
    tar.addfile(info, io.BytesIO(data))

