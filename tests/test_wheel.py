"""The built wheel contains every module of the source tree (a sub-package left out of
pyproject's `packages` would be silently missing from it, while editable installs still work)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("compiler", "passes", "runtime", "kernels", "cache")


def source_modules() -> list[str]:
    mods = []
    for folder in PACKAGE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "examples" in rel.parts:
                continue  # out-of-tree example packages are not part of kiln
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods.append("kiln." + ".".join(parts))
    return mods


def test_wheel_has_every_module(tmp_path) -> None:
    wheel_dir, target, src = tmp_path / "wheel", tmp_path / "site", tmp_path / "src"
    # Build from a clean copy: an in-tree build/ folder left by an earlier build would
    # otherwise leak modules into the wheel that `packages` no longer lists.
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", ".whl", "build", "*.egg-info",
                                                             "__pycache__", ".pytest_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheel_dir), str(src)], check=True, cwd=tmp_path)
    wheel = next(wheel_dir.glob("kiln-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, cwd=tmp_path)
    modules = source_modules()
    assert "kiln.runtime.engine" in modules and "kiln.passes.paged_kv" in modules
    check = (
        "import importlib, sys\n"
        f"target = {str(target)!r}\n"
        "bad = []\n"
        f"for m in {modules!r}:\n"
        "    mod = importlib.import_module(m)\n"
        "    if not str(getattr(mod, '__file__', '')).startswith(target): bad.append((m, mod.__file__))\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    # -S: no site-packages .pth files, so the editable install cannot answer the imports;
    # third-party packages come from site-packages placed after the wheel's target.
    env = {"PYTHONPATH": f"{target}:{sysconfig.get_paths()['purelib']}", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-S", "-c", check], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    entry_points = next(target.glob("kiln-*.dist-info")) / "entry_points.txt"
    assert "kiln = kiln.runtime.cli:main" in entry_points.read_text()
