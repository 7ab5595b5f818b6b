"""The package's shape, read from its source: layers, no import cycles, every module documented."""

from __future__ import annotations

import re
from pathlib import Path

from tests import importgraph

ARCHITECTURE_DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def test_effectors_do_not_import_the_service():
    """Effectors change the world for the service; the service wires them, never the other way."""
    offending = [
        f"{module} imports {imp.module} (line {imp.line})"
        for module in importgraph.module_files()
        if module.startswith("r3090d.effectors")
        for imp in importgraph.imports_of(module)
        if imp.module == "r3090d.service" or imp.module.startswith("r3090d.service.")
    ]
    assert offending == []


def test_no_import_cycles():
    """Imports inside functions count: a lazy import that closes a cycle only hides it."""
    edges = importgraph.graph()
    assert "r3090d.core.snapshot" in edges["r3090d.core.policy"]  # the graph does see the package's imports
    assert importgraph.cycles(edges) == []


def test_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert importgraph.cycles(edges) == [["a", "b", "c"]]


def documented_modules(text: str) -> set[str]:
    """The module paths the doc's tree names: `core/` opens a package, `    snapshot.py` is
    core/snapshot.py, `  argv.py` is a top-level module; one line may name several."""
    tree = text.split("```\nr3090d/\n", 1)[1].split("```", 1)[0]
    named: set[str] = set()
    package = ""
    for line in tree.splitlines():
        m = re.match(r"^( +)([\w/]+\.py(?:, [\w]+\.py)*|\w+/)(?:\s|$)", line)
        if m is None:
            continue
        indent, names = len(m.group(1)), m.group(2)
        if names.endswith("/"):
            package = names
            named.add(names)
        elif indent == 2:
            package = ""
            named.add(names)
        else:
            named.update(package + name for name in names.split(", "))
    return named


def test_every_module_is_named_in_the_architecture_doc():
    named = documented_modules(ARCHITECTURE_DOC.read_text())
    assert "core/policy.py" in named and "units.py" in named  # the tree was read
    files = importgraph.module_files().values()
    wanted = {
        str(path.parent.relative_to(importgraph.PACKAGE_DIR)) + "/"
        if path.name == "__init__.py"
        else str(path.relative_to(importgraph.PACKAGE_DIR))
        for path in files
        if path.parent != importgraph.PACKAGE_DIR or path.name != "__init__.py"
    }
    assert sorted(wanted - named) == []
    assert sorted(named - wanted) == []  # nor names a module that is gone
