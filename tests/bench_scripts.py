"""Loading a script of bench/ as a module in a test (bench/ is no package; its scripts import
their neighbours, such as bench_common, by path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench_script(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """bench/<name>.py as a fresh module, with bench/ on sys.path for the test's duration."""
    monkeypatch.syspath_prepend(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"kiln_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module
