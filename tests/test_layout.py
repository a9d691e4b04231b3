"""The layout's rules that import-linter's contracts do not state (docs/layout.md).

- No import cycle among the modules of flyd, workers and bus. Every import counts: module-level,
  function-level (lazy) and `TYPE_CHECKING` ones, since each is a dependency a reader must
  follow and a cycle of lazy imports is still a cycle of knowledge.
- No module imports or uses another module's underscore names: `from x import _y`, and `x._y`
  where `x` is a module of these packages bound by an import. A leading underscore says "mine";
  a name others need gets a public name and a place in its module's interface. The tests keep
  the rule too, and also reach no production object's underscore members, except the files
  named in `PRIVATE_IN_TESTS` with their reasons.
- No dead code: every function, class, constant and method of flyd, workers and bus is used by
  their own code (by name, as vulture judges). Runtime callbacks are named in `CALLBACKS`;
  members only tests use are named in `TEST_ONLY` until each becomes a test double, plugin API
  in `PLUGIN_API`, the client SDK's API in `SDK_API`, the designed API in `SPEC_API`; a named
  member that is used again or gone fails the check too, so the lists only shrink.
- No re-exports: a name imported from another module of these packages is there to be used. One
  that the module's body never uses (it appears in nothing but its import), or that the module
  lists in `__all__`, is exposed on another module's behalf, and a reader following it lands on
  a forwarding line instead of the definition. Importers name the defining module.
- Configuration is read in one place: outside `flyd/config.py` no module reads the key table
  by a section's name (`config.value("session", "probe_s")`, `session["probe_s"]`,
  `bus.get("limits")`); it is read once into typed settings (`flyd.config.Settings`) where the
  node is assembled, and those are handed down.
- Every `§` reference in the code names a document under docs/ and a section heading it has
  (docs/design/README.md), and no docstring is only a reference.
- Sizes: every class in bus/ within 650 lines and 35 methods, coordinator.py within 700 lines.
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


# --------------------------------------------------------------------------------------------
# dead code

#: names the runtime calls, never our code: asyncio protocol callbacks, a logging handler's
#: `emit`, pickle's `reducer_override`
CALLBACKS = frozenset({"connection_made", "data_received", "eof_received", "connection_lost",
                       "pause_writing", "resume_writing", "emit", "reducer_override"})
#: decorators that do not register their function anywhere
_PLAIN_DECORATORS = frozenset({"property", "cached_property", "staticmethod", "classmethod",
                               "cache", "abstractmethod", "overload", "setter"})
#: a plugin class or function named by an import path string (`package.module:Name`)
_IMPORT_PATH = re.compile(r"\b[a-z_][a-z0-9_.]*:([A-Za-z_][A-Za-z0-9_]*)")


#: what a plugin author or a run spec names and our code never calls
PLUGIN_API: Final = frozenset({
    "workers/adapters/pettingzoo.py:InlinePolicyModel",
    "workers/adapters/pettingzoo.py:random_policy",
    "workers/synthetic/brain.py:FakeBrain.draw",
})

#: the API the design names (design/session.md §6.1, §7.4, design/state.md §4.6 and others):
#: probes, knobs and helpers for harnesses and embedders, which flyd's own node does not call
SPEC_API: Final = frozenset({
    *(f"flyd/session/coordinator.py:Coordinator.{name}" for name in (
        "acknowledge_replies", "injection_log", "live_view_handles", "pause_handle", "probe_raw",
        "resolve_durable", "set_deadlines", "worker_status")),
    "flyd/launch/launcher.py:Launcher.set_health_policy",
    # the clocks, save outcomes, phases, audit helpers, the result cache's expiry, the worker
    # command line and the tick accumulator as design/ names them
    "flyd/leases/clock.py:LoopClock",
    "flyd/session/audit.py:AuditLog.index_of",
    "flyd/session/durability.py:TooLarge.is_durable",
    "flyd/session/phase.py:PhaseMachine.capture_origin",
    "flyd/state/writer.py:Committed.is_durable",
    "flyd/state/writer.py:DeadlineExpired.is_durable",
    "flyd/state/writer.py:Failed.is_durable",
    "flyd/state/writer.py:ReplyLost.is_durable",
    "flyd/state/writer.py:Superseded.is_durable",
    "workers/dedup.py:ResultCache.expire_step",
    "workers/launch.py:WorkerLaunch.from_argv",
    "workers/types/ticks.py:TickAccumulator.brain_time_ms",
})

#: what the client SDK offers its users (docs/bus.md) and our own code never calls
SDK_API: Final = frozenset({
    "bus/client_calls.py:CallResult.outcome_bytes",
})

#: members only the tests use, each to become a test double under tests/ (clocks, stores,
#: fakes) or to go; a new member never joins this list
TEST_ONLY: Final = frozenset({
    "flyd/config.py:validate_node_name",
    "flyd/launch/budget.py:ThreadBudget.allocation",
    "flyd/launch/budget.py:ThreadBudget.default_need",
    "flyd/launch/identities.py:SessionTags.peek",
    "flyd/launch/launcher.py:start_error",
    "flyd/leases/clock.py:ManualClock",
    "flyd/leases/clock.py:ManualClock.next_wakeup",
    "flyd/leases/clock.py:SimFileWriter",
    "flyd/leases/migrate.py:apply_migrations",
    "flyd/leases/params.py:LeaseParams.I",
    "flyd/leases/params.py:LeaseParams.short_ttl",
    "flyd/leases/params.py:LeaseParams.with_ttl",
    "flyd/node/sdnotify.py:notify",
    "flyd/session/pacing.py:Pacing.deadline_ns",
    "flyd/session/pacing.py:Pacing.period_ns",
    "flyd/session/phase.py:PhaseMachine.can_move",
    "flyd/session/phase.py:phase_of",
    "flyd/session/publication.py:Feed.publish_snapshot",
    "flyd/session/runspec.py:RunSpec.normalise",
    "flyd/session/trace.py:TraceLog.phases",
    "flyd/state/checkpoints.py:DirectCommitPath",
    "flyd/state/envelope.py:Layout.manifest_text",
    "workers/dedup.py:ResultCache.lifecycle_records",
    "workers/dedup.py:ResultCache.step_records",
    "workers/dedup.py:ResultCache.unacknowledged",
    "workers/synthetic/audio.py:frame_bytes",
    "workers/types/datatypes.py:encode_media",
    "workers/types/ticks.py:AudioBudget.set_step",
    "workers/types/ticks.py:RationalNs.millis",
})


def _registered(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> bool:
    """Decorated by something that keeps it (a click command, a pytest hook), not a plain
    descriptor or cache."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name not in _PLAIN_DECORATORS:
            return True
    return False


def definitions_and_uses() -> tuple[list[tuple[str, str]], set[str]]:
    """Every module-level function, class and constant and every method of bus, workers and
    flyd as (name, `path:Qualified.name`), and every name their code uses. A name counts as
    used wherever it appears (vulture's rule: by name, not by type), so the check never flags
    a used member and may miss a dead one that shares a used name."""
    defined: list[tuple[str, str]] = []
    used: set[str] = set()
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        where = str(path.relative_to(ROOT))
        scopes: list[tuple[list[ast.stmt], str]] = [(tree.body, "")]
        scopes += [(n.body, f"{n.name}.") for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
        for body, owner in scopes:
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    if not _registered(node):
                        defined.append((node.name, f"{where}:{owner}{node.name}"))
                elif isinstance(node, ast.Assign) and not owner:
                    defined += [(t.id, f"{where}:{t.id}") for t in node.targets
                                if isinstance(t, ast.Name) and t.id != "__all__"]
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.alias):
                used.add(node.name.split(".")[-1])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                used.update(_IMPORT_PATH.findall(node.value))
    return defined, used


def test_no_dead_code() -> None:
    """Every function, class, constant and method of bus, workers and flyd is used by their own
    code: a member only the tests call belongs in a test double under tests/."""
    defined, used = definitions_and_uses()
    unused = {where for name, where in defined
              if name not in used and name not in CALLBACKS
              and not (name.startswith("__") and name.endswith("__"))}
    named = PLUGIN_API | SDK_API | SPEC_API | TEST_ONLY
    dead = sorted(unused - named)
    assert not dead, "defined but never used by bus, workers or flyd:\n" + "\n".join(dead)
    stale = sorted(named - unused)
    assert not stale, "named as unused but used or gone (drop them):\n" + "\n".join(stale)


# --------------------------------------------------------------------------------------------
# private names in the tests

#: the tests that knowingly reach into a production class's private members (docs/layout.md)
PRIVATE_IN_TESTS: Final = {
    "tests/distribution/sim/canaries.py":
        "deliberate mutants of MemStore and NodeRuntime the oracle must catch",
    "tests/distribution/sim/world.py": "the simulator's oracle reads MemStore's rows",
    "tests/state/test_store.py": "a read that fails once, swapped into the checkpoint store",
    "tests/admin_store.py": "a MemStore test double taking raw writes, as the triggers see them",
    "tests/distribution/sim/loop.py": "the virtual-time loop runs asyncio's own loop internals",
    "tests/distribution/harness/process_bodies.py": "a node body whose router faults, by override",
    "tests/distribution/test_sim.py": "a grant scope's task, to see a cancellation not yet taken",
    "tests/session/test_launcher.py": "the hello checks unit-tested, a thread body's stuck loop",
    "tests/state/state_harness.py": "a launched worker's plan, the harness's coordinator swapped",
}


@cache
def private_members() -> frozenset[str]:
    """The underscore names bus, workers and flyd define: methods, class attributes and fields
    set on `self`."""
    names: set[str] = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self":
                names.add(node.attr)
    return frozenset(n for n in names if _private(n))


def private_reaches(path: Path) -> list[str]:
    """A test's uses of another module's underscore names, and of a production object's
    underscore members (`thing._member`, anything but `self` and `cls`, by name: an underscore
    name that bus, workers or flyd define and the test file does not)."""
    out = private_uses(path)
    tree = ast.parse(path.read_text(), str(path))
    own = {n.name for n in ast.walk(tree)
           if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    members = private_members() - own
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in members and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return out


def test_tests_reach_no_private_names_but_the_named() -> None:
    """The private-name rule over tests/: a test uses the public seams, except the named files,
    each for its stated reason; a test's own underscore names are its own."""
    tests = sorted((ROOT / "tests").rglob("*.py"))
    found = [use for path in tests if str(path.relative_to(ROOT)) not in PRIVATE_IN_TESTS
             for use in private_reaches(path)]
    assert not found, "tests using production underscore names:\n" + "\n".join(found)
    clean = [name for name in PRIVATE_IN_TESTS if not private_reaches(ROOT / name)
             and not (ROOT / name).read_text().count("self._")]
    assert not clean, f"named but reaching no private name (drop them): {clean}"


#: The names a package binds for others, on purpose, each with its reason.
RE_EXPORT_ALLOWANCES: Final[dict[str, frozenset[str]]] = {
    # The run spec names the synthetic composition's plugins by import path, and its defaults
    # are `workers.synthetic:<Name>` (docs/workers.md): the package is their public address.
    "workers/synthetic/__init__.py": frozenset(
        {"CounterArena", "CounterTask", "FakeBrain", "IdentityExecutor"}),
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


# --------------------------------------------------------------------------------------------
# sizes

#: a class of the bus a reader takes in at one sitting (trio's largest is ~530 lines)
BUS_CLASS_MAX_LINES: Final = 650
BUS_CLASS_MAX_METHODS: Final = 35
#: the coordinator reads in one sitting; its parts with rules of their own are modules of theirs
COORDINATOR_MAX_LINES: Final = 700


def test_bus_classes_and_the_coordinator_stay_readable() -> None:
    """Every class in bus/ stays within 650 lines and 35 methods, and coordinator.py within 700
    lines: past them, a part with its own concern is hiding inside (docs/layout.md)."""
    over = []
    for path in sorted((ROOT / "bus").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            methods = sum(isinstance(x, ast.FunctionDef | ast.AsyncFunctionDef)
                          for x in node.body)
            if lines > BUS_CLASS_MAX_LINES or methods > BUS_CLASS_MAX_METHODS:
                over.append(f"{path.relative_to(ROOT)}:{node.name} {lines} lines, "
                            f"{methods} methods")
    coordinator = ROOT / "flyd" / "session" / "coordinator.py"
    length = len(coordinator.read_text(encoding="utf-8").splitlines())
    if length > COORDINATOR_MAX_LINES:
        over.append(f"flyd/session/coordinator.py {length} lines")
    assert not over, (f"over {BUS_CLASS_MAX_LINES} lines or {BUS_CLASS_MAX_METHODS} methods "
                      f"(coordinator.py: {COORDINATOR_MAX_LINES} lines):\n" + "\n".join(over))
