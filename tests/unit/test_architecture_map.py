"""docs/architecture.md's module map names every module of the four packages, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("store", "worker", "producer", "devkit")


def _tree() -> set[str]:
    """Each package's modules (``store/records.py``) and sub-packages (``store/memory/``), ``__init__`` aside."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).iterdir():
            if path.is_dir() and ((path / "__init__.py").exists() or path.name == "migrations"):
                found.add(f"{package}/{path.name}/")
            elif path.suffix == ".py" and path.name != "__init__.py":
                found.add(f"{package}/{path.name}")
    return found


def _mapped() -> set[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    rows = [
        line for line in section.splitlines() if line.startswith("| `") and not line.split("|")[1].endswith("module ")
    ]
    first_cells = [row.split("|")[1] for row in rows]
    return {name for cell in first_cells for name in re.findall(r"`([^`]+)`", cell)}


def test_the_module_map_matches_the_tree() -> None:
    tree, mapped = _tree(), _mapped()
    assert sorted(tree - mapped) == [], "modules missing from docs/architecture.md's module map"
    assert sorted(mapped - tree) == [], "the module map names modules that are not in the tree"


def test_every_store_row_says_its_kind() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    kinds = {
        row.split("|")[1].strip(" `"): row.split("|")[2].strip()
        for row in section.splitlines()
        if row.startswith("| `store/") and "` module" not in row
    }
    allowed = ("pure", "Postgres", "Redis", "kernel")
    assert kinds and all(kind.startswith(allowed) for kind in kinds.values()), kinds


#: Above this many lines a module is split, or its docstring says why it stays whole.
MODULE_LINES = 400


def test_a_module_over_the_size_says_why_it_stays_whole() -> None:
    import ast

    unexplained = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            text = path.read_text()
            if text.count("\n") <= MODULE_LINES:
                continue
            docstring = ast.get_docstring(ast.parse(text)) or ""
            if "Stays whole:" not in docstring:
                unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert unexplained == [], "split these, or say in their docstring why they stay whole ('Stays whole: ...')"
