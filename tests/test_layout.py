"""The layout's rules that import-linter's contracts do not state (docs/layout.md).

- No import cycle among the modules of flyd, workers and bus. Every import counts: module-level,
  function-level (lazy) and `TYPE_CHECKING` ones, since each is a dependency a reader must
  follow and a cycle of lazy imports is still a cycle of knowledge.
- No module imports or uses another module's underscore names: `from x import _y`, and `x._y`
  where `x` is a module of these packages bound by an import. A leading underscore says "mine";
  a name others need gets a public name and a place in its module's interface.
- Every `§` reference in the code names a document under docs/ and a section heading it has
  (docs/design/README.md), and no docstring is only a reference.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
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


# A `§` reference names its document as a path under docs/ (`design/wire.md §3.2`); a chain
# (`§6.2/§14.1`, `§4–§16`, `§3.1 step 7, §3.3`) names it once, at its head.
REFERENCE = re.compile(r"§§?(\d+(?:\.\d+)*)")
HEAD = re.compile(r"([\w/.-]+\.md)(?:\s*\n\s*#:?)?\s+$")
CHAIN_GAP = re.compile(r"[^().;:§\n]{0,20}")
# a clause label is a value, not a reference: a string that is only one ("§4.3.2"), or one quoted
# in backticks in a docstring or comment (`§4.3.2`)
CLAUSE_CODE = re.compile(r"""^[rbuf]*(['"])§\d+(?:\.\d+)*\1$""")
DOCS = ROOT / "docs"


@cache
def doc_sections(doc: str) -> frozenset[str] | None:
    """The section numbers the headings of docs/<doc> carry, or None when there is no such
    document."""
    path = DOCS / doc
    if not path.is_file():
        return None
    return frozenset(m.group(1) for m in re.finditer(
        r"^#+\s+§?(\d+(?:\.\d+)*)\.?\s", path.read_text(), re.M))


def _reference_texts(path: Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of each string and each run of full-line comments holding a `§`."""
    source = path.read_text()
    lines = source.splitlines()
    run: list[tokenize.TokenInfo] = []

    def flush() -> Iterator[tuple[int, str]]:
        text = "\n".join(t.string for t in run)
        if "§" in text:
            yield run[0].start[0], text
        run.clear()

    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.NL:
            continue
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1].lstrip().startswith("#") \
                and (not run or (run[-1].start[0] == tok.start[0] - 1
                                 and run[-1].start[1] == tok.start[1])):
            run.append(tok)
            continue
        yield from flush()
        if tok.type == tokenize.COMMENT:
            run.append(tok)
        elif tok.type == tokenize.STRING and "§" in tok.string \
                and not CLAUSE_CODE.match(tok.string):
            yield tok.start[0], tok.string
    yield from flush()


def references(path: Path) -> Iterator[tuple[int, str | None, str]]:
    """(line, document or None, section) of every `§` reference in one source file."""
    for first, text in _reference_texts(path):
        last_end: int | None = None
        doc: str | None = None
        for m in REFERENCE.finditer(text):
            if text[:m.start()].endswith("`"):
                continue  # a quoted clause label (`§4.3.2`) is a value, not a reference
            head = HEAD.search(text[:m.start()])
            if head:
                doc = head.group(1)
            elif last_end is None or doc is None or not CHAIN_GAP.fullmatch(
                    re.sub(r"\n\s*(#:? ?)?", " ", text[last_end:m.start()])):
                doc = None
            yield first + text[:m.start()].count("\n"), doc, m.group(1).rstrip(".")
            last_end = m.end()


def test_references_name_a_document_and_a_section() -> None:
    """Every `§` reference in the code names a document under docs/ and a section that document
    has, so a reader can follow it."""
    found: list[str] = []
    count = 0
    for path in _sources():
        for line, doc, section in references(path):
            count += 1
            where = f"{path.relative_to(ROOT)}:{line}: §{section}"
            sections = doc_sections(doc) if doc else None
            if doc is None:
                found.append(f"{where} names no document (write `design/<doc>.md §{section}`)")
            elif sections is None:
                found.append(f"{where}: docs/{doc} does not exist")
            elif section not in sections:
                found.append(f"{where}: docs/{doc} has no section {section}")
    assert count > 500, f"only {count} references found: is the pattern still right?"
    assert not found, "unresolved references:\n" + "\n".join(found)


def test_no_docstring_is_only_a_reference() -> None:
    """A reference says where the rule is written; the docstring still says what the code does and
    why, in a few words of its own."""
    found: list[str] = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node, clean=False)
            if not doc or "§" not in doc:
                continue
            words = re.findall(r"[A-Za-z]{2,}", re.sub(
                r"[\w/.-]+\.md|§§?[\d.]+(?:[–-]§?[\d.]+)?", "", doc))
            if len(words) < 4:
                found.append(f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 1)}: {doc!r}")
    assert not found, "docstrings that are only a reference:\n" + "\n".join(found)


def test_the_reference_check_sees_bare_and_dangling_references(tmp_path: Path) -> None:
    """The check above can fail: a bare reference has no document, a chain inherits its head's,
    a quoted clause label is no reference, and a section is looked up in its document."""
    source = tmp_path / "sample.py"
    source.write_text(
        '"""Bare §3.2; design/wire.md §6.2/§14.1 and §99; a label `§4.3.2`."""\n'
        "# design/state.md §2.6 checks R1–R8,\n"
        "# §4.5 step 2\n"
        'CODE = "§4.3.2"\n')
    found = [(doc, section) for _, doc, section in references(source)]
    assert found == [(None, "3.2"), ("design/wire.md", "6.2"), ("design/wire.md", "14.1"),
                     ("design/wire.md", "99"), ("design/state.md", "2.6"),
                     ("design/state.md", "4.5")]
    wire = doc_sections("design/wire.md")
    assert wire is not None and "14.1" in wire and "99" not in wire
    assert doc_sections("design/nowhere.md") is None
