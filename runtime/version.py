"""Kiln's version: the installed distribution's (pyproject.toml), read once at import."""

from __future__ import annotations

import importlib.metadata


def _version() -> str:
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


__version__ = _version()
