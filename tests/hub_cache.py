"""A Hugging Face hub cache laid out by hand, as huggingface_hub writes it (no network):

    <cache>/models--ORG--NAME/blobs/<sha256>            the files' contents
    <cache>/models--ORG--NAME/snapshots/<commit>/FILE   symlinks to the blobs
    <cache>/models--ORG--NAME/refs/<branch or tag>      the commit a ref points to

Tests then resolve hub ids with HF_HUB_OFFLINE=1, through huggingface_hub's own code.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def add_to_hub_cache(cache: Path, repo_id: str, files_dir: Path, commit: str = "a" * 40,
                     refs: tuple[str, ...] = ("main",), skip: tuple[str, ...] = ()) -> Path:
    """Put every file of `files_dir` into `cache` as snapshot `commit` of `repo_id`; returns the snapshot dir."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(files_dir.iterdir()):
        if not f.is_file() or f.name in skip:
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / f.name
        if not link.exists():
            os.symlink(os.path.relpath(blob, snapshot), link)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
