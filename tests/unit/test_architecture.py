"""The package's shape, read from its source: layers, no import cycles, every module documented."""

from __future__ import annotations

import re
from pathlib import Path

from tests import importgraph

ARCHITECTURE_DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


# The layers, lowest first, written once: a module imports from its own layer and those below it, never above.
# docs/architecture.md describes them; a piece two layers share lives in the lower one.
LAYERS = (
    ("leaf", ("r3090d", "r3090d.units", "r3090d.engineflags", "r3090d.exitcodes", "r3090d.versions", "r3090d.atomicfile",
              "r3090d.procstat", "r3090d.cards", "r3090d.pydanticerrors", "r3090d.vllmlines", "r3090d.shipped")),
    ("config", ("r3090d.config",)),
    ("core", ("r3090d.core",)),
    ("engine command line", ("r3090d.argv",)),
    ("probes", ("r3090d.probes",)),
    ("measure", ("r3090d.measure",)),
    ("effectors", ("r3090d.effectors",)),
    ("preflight", ("r3090d.preflight",)),
    ("router", ("r3090d.router",)),
    ("service", ("r3090d.service",)),
    ("cli", ("r3090d.cli", "r3090d.__main__")),
)  # fmt: skip


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix that names `module`."""
    best, found = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), index
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


def climbing_imports(edges) -> list[str]:
    """Imports (lazy ones too: they run all the same) from a module to one of a higher layer."""
    return sorted(
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in edges.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    )


def test_every_module_is_in_a_layer_and_no_import_climbs_one():
    edges = importgraph.graph()
    assert "r3090d.service.fleet" in edges and "r3090d.router.link" in edges["r3090d.service.fleet"]
    assert climbing_imports(edges) == []


def test_a_climbing_import_is_found():
    edges = {"r3090d.config.schema": {"r3090d.core.snapshot"}, "r3090d.router.app": {"r3090d.service.journal"},
             "r3090d.service.fleet": {"r3090d.router.link"}}  # fmt: skip
    assert climbing_imports(edges) == [
        "r3090d.config.schema (config) imports r3090d.core.snapshot (core)",
        "r3090d.router.app (router) imports r3090d.service.journal (service)",
    ]


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
