"""The layout's rules that import-linter's contracts do not state (docs/layout.md).

- No import cycle among the modules of flyd, workers and bus. Every import counts: module-level,
  function-level (lazy) and `TYPE_CHECKING` ones, since each is a dependency a reader must
  follow and a cycle of lazy imports is still a cycle of knowledge.
- No module imports or uses another module's underscore names: `from x import _y`, and `x._y`
  where `x` is a module of these packages bound by an import. A leading underscore says "mine";
  a name others need gets a public name and a place in its module's interface.
- No re-exports: a name imported from another module of these packages is there to be used. One
  that the module's body never uses (it appears in nothing but its import), or that the module
  lists in `__all__`, is exposed on another module's behalf, and a reader following it lands on
  a forwarding line instead of the definition. Importers name the defining module.
- Configuration is read in one place: outside `flyd/config.py` no module reads the key table
  by a section's name (`config.value("session", "probe_s")`, `session["probe_s"]`,
  `bus.get("limits")`); it is read once into typed settings (`flyd.config.Settings`) where the
  node is assembled, and those are handed down.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Final

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


#: The names a package binds for others, on purpose, each with its reason.
RE_EXPORT_ALLOWANCES: Final[dict[str, frozenset[str]]] = {
    # The run spec names the synthetic composition's plugins by import path, and its defaults
    # are `workers.synthetic:<Name>` (docs/workers.md): the package is their public address.
    "workers/synthetic/__init__.py": frozenset(
        {"CounterArena", "CounterTask", "FakeBrain", "IdentityExecutor"}),
    # Pending: the coordinator's own split removes these; drop this entry when it lands.
    "flyd/session/coordinator.py": frozenset(
        {"Deadlines", "Feed", "InjectionOutcome", "Injections", "LOSS_POLLS", "Metrics",
         "Publication", "RESOLVE_PAUSE", "ResolutionEnd", "SessionFailure", "Stats",
         "format_duration"}),
}


def _exported(tree: ast.Module) -> set[str]:
    """The names `__all__` lists (assigned, annotated or extended)."""
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) \
                    and isinstance(node.value, ast.List | ast.Tuple):
                out.update(e.value for e in node.value.elts
                           if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return out


def _referenced(tree: ast.Module) -> set[str]:
    """Every name the module reads, string annotations included."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                quoted = ast.parse(node.value, mode="eval")
            except SyntaxError:
                continue
            out.update(n.id for n in ast.walk(quoted) if isinstance(n, ast.Name))
    return out


def re_exports(path: Path) -> list[str]:
    """Every name one source file imports from another module of ours only to expose it."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    imported: dict[str, tuple[int, str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _absolute(node, module, path.name == "__init__.py")
            if _ours(source) and source != module:
                for alias in node.names:
                    imported[alias.asname or alias.name] = (node.lineno, source)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name):
                    imported[alias.asname or alias.name.split(".")[0]] = (node.lineno,
                                                                          alias.name)
    exported, referenced = _exported(tree), _referenced(tree)
    allowed = RE_EXPORT_ALLOWANCES.get(str(path.relative_to(ROOT)), frozenset())
    out = []
    for name, (line, source) in sorted(imported.items()):
        if name in allowed:
            continue
        if name in exported:
            out.append(f"{path.relative_to(ROOT)}:{line}: {name} (from {source}) in __all__")
        elif name not in referenced:
            out.append(f"{path.relative_to(ROOT)}:{line}: {name} (from {source}) never used")
    return out


def test_no_re_exports() -> None:
    found = [line for path in _sources() for line in re_exports(path)]
    assert not found, "names imported only to be exposed (import from the defining module):\n" \
        + "\n".join(found)


SECTIONS: Final = frozenset({"node", "bus", "database", "leases", "session", "checkpoints",
                             "plugins"})
KEY_TABLE_READS: Final = frozenset({"value", "setting", "source", "origin", "section"})


def keyed_config_reads(path: Path) -> list[str]:
    """Reads of the configuration by a section's name: a key-table call naming a section, and a
    string key taken from a variable named like a section (`session["probe_s"]`,
    `bus.get("limits")`)."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(ROOT)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            if node.func.attr in KEY_TABLE_READS and first.value in SECTIONS:
                out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif node.func.attr == "get" and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id in SECTIONS:
                out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                and node.value.id in SECTIONS and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str):
            out.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_configuration_is_read_only_in_config() -> None:
    found = [read for path in _sources() if path != ROOT / "flyd" / "config.py"
             for read in keyed_config_reads(path)]
    assert not found, "keyed configuration reads outside flyd/config.py:\n" + "\n".join(found)
