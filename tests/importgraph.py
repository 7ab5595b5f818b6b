"""The import graph of the r3090d package, read from its source with ast (nothing is imported).

Every `import` and `from ... import` is resolved to absolute module names:
relative imports against their package, and `from r3090d.x import y` to
`r3090d.x.y` as well when y is a module. Imports under `if TYPE_CHECKING:` are
left out (they never run). An import inside a function runs when it is called,
not when the module is loaded: `Import.lazy` says which.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "r3090d"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name, as imported
    line: int
    lazy: bool  # inside a function: runs when it is called, not at import


@functools.cache
def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name; a package is named by its __init__.py."""
    files = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from X import` names, relative ones resolved."""
    if not node.level:
        return node.module or ""
    is_package = module_files()[module].name == "__init__.py"
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


@functools.cache
def imports_of(module: str) -> tuple[Import, ...]:
    """What `module` (one of module_files()) imports, in source order."""
    tree = ast.parse(module_files()[module].read_text(), str(module_files()[module]))
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child, lazy)
            return
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            found.append(Import(base, node.lineno, lazy))
            for alias in node.names:
                if f"{base}.{alias.name}" in module_files():
                    found.append(Import(f"{base}.{alias.name}", node.lineno, lazy))
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(tree, False)
    return tuple(found)


def is_internal(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def packages_above(module: str) -> list[str]:
    """The packages Python runs before `module`: r3090d.config for r3090d.config.schema, and r3090d."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def closure(roots: Iterable[str], follow_lazy: Callable[[str], bool] = lambda module: False) -> set[str]:
    """The package's modules that loading `roots` loads: what each imports at import time
    (plus its lazy imports where follow_lazy(module)), and the packages above each, transitively."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(packages_above(module))
        for imp in imports_of(module):
            if is_internal(imp.module) and imp.module in module_files() and (not imp.lazy or follow_lazy(module)):
                todo.append(imp.module)
    return seen


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it names in an import, lazy ones included (a dependency
    all the same). The packages Python runs above an imported module are not edges: every
    module would otherwise sit in a cycle with its own package's __init__."""
    return {
        module: {imp.module for imp in imports_of(module) if imp.module in module_files() and imp.module != module}
        for module in module_files()
    }


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found
