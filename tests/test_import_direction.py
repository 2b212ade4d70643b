"""Folder imports run one way (DESIGN.md): runtime -> compiler -> passes -> kernels, and
compiler -> cache. Checked on the source, imports inside functions included, so that a lazy
import cannot hide a dependency that runs back up.

One module is everyone's: `kiln.compiler.graph_inputs`, the graph's calling convention (role
tags, the batch-input table, `bind`). It is a leaf that imports no other Kiln module, so the
passes that add graph inputs can read it without depending on the rest of the compiler."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# folder -> the folders it may import from (besides itself)
LEAF = "kiln.compiler.graph_inputs"
ALLOWED: dict[str, set[str]] = {
    "kernels": set(),
    "cache": set(),
    "passes": {"kernels"},
    "compiler": {"passes", "kernels", "cache"},
    "runtime": {"compiler", "passes", "kernels", "cache"},
}


def kiln_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every `kiln.<folder>...` import in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kiln" and len(parts) > 1:
                found.append((node.lineno, name))
    return found


def test_folder_imports_run_one_way() -> None:
    wrong = []
    for folder, allowed in ALLOWED.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "examples" in path.relative_to(ROOT).parts:
                continue
            for line, module in kiln_imports(path):
                target = module.split(".")[1]
                if target != folder and target not in allowed and module != LEAF:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not wrong, "imports that run back up the folder order:\n" + "\n".join(wrong)


def test_the_calling_convention_is_a_leaf() -> None:
    assert kiln_imports(ROOT / "compiler" / "graph_inputs.py") == []


def test_the_check_sees_function_level_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from kiln.runtime.engine import EngineConfig\n")
    assert kiln_imports(probe) == [(2, "kiln.runtime.engine")]
