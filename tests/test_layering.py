"""The package's import layering: the import-linter contracts in pyproject.toml hold, and
no module imports another that imports it back (scripts/import_graph.py), counting
lazy (function-level) and ``TYPE_CHECKING`` imports too (docs/architecture.md, Layers)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.import_graph import ALL_KINDS, RUNTIME_KINDS, cycles, describe, edges, graph

ROOT = Path(__file__).resolve().parent.parent


def test_no_import_cycles() -> None:
    all_edges = edges()
    assert len(all_edges) > 300, "the import graph looks empty: is the package found?"
    found = cycles(graph(all_edges, ALL_KINDS))
    report = "\n".join(" <-> ".join(c) + "\n" + "\n".join(describe(c, all_edges))
                       for c in found)
    assert not found, f"import cycles (move the shared piece down a layer):\n{report}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_cycle_finder_follows_lazy_typing_and_relative_imports(tmp_path: Path) -> None:
    """The checker itself: a circle closed by a function-level import, a relative
    ``from . import`` and a TYPE_CHECKING import is found; type edges only count as such."""
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.sub import b\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def f():\n    from . import c\n",
        "pkg/sub/c.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from ..a import X\n"),
        "pkg/d.py": "import pkg.a\n",
    })
    found_edges = edges(pkg)
    kinds = {(e.importer, e.imported): e.kind for e in found_edges}
    assert kinds == {("pkg.a", "pkg.sub.b"): "module", ("pkg.sub.b", "pkg.sub.c"): "function",
                     ("pkg.sub.c", "pkg.a"): "type", ("pkg.d", "pkg.a"): "module"}
    assert cycles(graph(found_edges, ALL_KINDS)) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    assert cycles(graph(found_edges, RUNTIME_KINDS)) == []


def _lint_imports() -> str:
    found = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(found).exists():
        pytest.fail("lint-imports is missing: install the test extra (make setup)")
    return found


def test_import_linter_contracts_hold() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([_lint_imports(), "--no-cache"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_import_linter_sees_a_broken_layer(tmp_path: Path) -> None:
    """The contracts are not vacuous: the stack contract, run over a copy of the package
    where the model imports the engine, is broken."""
    shutil.copytree(ROOT / "roseinfer", tmp_path / "roseinfer",
                    ignore=shutil.ignore_patterns("__pycache__", "csrc", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    rope = tmp_path / "roseinfer" / "model" / "rope.py"
    rope.write_text(rope.read_text() + "\nfrom roseinfer.engine import engine as _e  # noqa\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([_lint_imports(), "--no-cache", "--contract", "stack"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout[-4000:]
    assert "roseinfer.model.rope -> roseinfer.engine.engine" in out.stdout
