"""The layout's rules that import-linter's contracts do not state (docs/layout.md).

- No import cycle among the modules of flyd, workers and bus. Every import counts: module-level,
  function-level (lazy) and `TYPE_CHECKING` ones, since each is a dependency a reader must
  follow and a cycle of lazy imports is still a cycle of knowledge.
- No module imports or uses another module's underscore names: `from x import _y`, and `x._y`
  where `x` is a module of these packages bound by an import. A leading underscore says "mine";
  a name others need gets a public name and a place in its module's interface.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flyd", "workers", "bus")


@cache
def _graph() -> grimp.ImportGraph:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return grimp.build_graph(*PACKAGES, include_external_packages=False, cache_dir=None)


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (or a module that
    imports itself), each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        # iterative DFS: (module, iterator over its imports)
        work: list[tuple[str, Iterator[str]]] = []
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        work.append((start, iter(sorted(graph.find_modules_directly_imported_by(start)))))
        while work:
            module, targets = work[-1]
            advanced = False
            for target in targets:
                if target not in index:
                    index[target] = low[target] = counter
                    counter += 1
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(
                        graph.find_modules_directly_imported_by(target)))))
                    advanced = True
                    break
                if target in on_stack:
                    low[module] = min(low[module], index[target])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1 or graph.direct_import_exists(
                        importer=module, imported=module):
                    found.append(sorted(component))
    return sorted(found)


def _describe(component: list[str], graph: grimp.ImportGraph) -> str:
    members = set(component)
    edges = [f"{a} -> {b}" for a in component
             for b in sorted(graph.find_modules_directly_imported_by(a)) if b in members]
    return f"{len(component)} modules: " + "; ".join(edges)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    graph = _graph()
    cycles = [c for c in strongly_connected(graph)
              if any(m == package or m.startswith(package + ".") for m in c)]
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c, graph) for c in cycles)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_uses(path: Path) -> list[str]:
    """Every use of another module's underscore name in one source file."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    out: list[str] = []
    aliases: dict[str, str] = {}  # a local name bound to a module of ours
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                    else:
                        aliases[alias.name.split(".")[0]] = alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            if not _ours(source):
                continue
            for alias in node.names:
                if _private(alias.name) and source != module:
                    out.append(f"{path.relative_to(ROOT)}:{node.lineno}: "
                               f"from {source} import {alias.name}")
                aliases.setdefault(alias.asname or alias.name, f"{source}.{alias.name}")
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain: list[str] = []
        value: ast.expr = node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in aliases:
            target = ".".join([aliases[value.id], *reversed(chain)])
            if target != module and _is_module(target):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}.{node.attr}")
    return out


def _is_module(dotted: str) -> bool:
    return dotted in _graph().modules


def _sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_no_private_names_across_modules() -> None:
    found = [use for path in _sources() for use in private_uses(path)]
    assert not found, "underscore names used across modules:\n" + "\n".join(found)
