"""The manifest every cache entry carries: what it is, what it depends on, how to check it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any


class ManifestError(ValueError):
    """A manifest that cannot be read; the entry it belongs to is unusable."""


def checksum(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Manifest:
    key: str
    kind: str  # "graph" (the model's GraphSpec) or "bucket" (one compiled artifact)
    label: str  # human name: "graph" or the bucket name, e.g. "decode-4"
    model: str  # the model's architecture name, e.g. "llama" (informational; not a key factor)
    factors: dict[str, Any]
    checksum: str  # of the entry's bytes
    size: int  # bytes
    created: float  # unix time
    compile_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> "Manifest":
        if not text:
            raise ManifestError("entry has no manifest")
        try:
            raw = json.loads(text)
            return cls(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise ManifestError(f"unreadable manifest: {e}") from e
