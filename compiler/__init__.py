"""Model sources, capture into FX, the graph's calling convention (graph_inputs), the pass
pipeline, buckets, per-bucket compile and the start-up driver.

The names below load on first use: `kiln.compiler.graph_inputs`, which passes import, must
stay cheap to import (capture pulls in transformers).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CapturedModel": "kiln.compiler.capture",
    "UnsupportedArchitectureError": "kiln.compiler.capture", "capture": "kiln.compiler.capture",
    "ModelSource": "kiln.compiler.model_source", "ModelSourceError": "kiln.compiler.model_source",
    "default_model_path": "kiln.compiler.model_source", "resolve_model": "kiln.compiler.model_source",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kiln.compiler' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
