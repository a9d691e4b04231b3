"""Bus wire schemas (design/wire.md §18): loading, the contract digest and a compiled validator.

The JSON Schema files under `schemas/bus/` are the single source of truth for the shape of every
bus message: the router validates each request's params with them (check 7 of design/wire.md §4),
the SDK checks router frames with them, and the SHA-256 of their canonical JSON is the
`contractDigest` both sides compare at hello. Nothing here restates a field rule by hand.

`jsonschema` is too slow for a per-request check, so `compile_schema` turns the subset of Draft
2020-12 these files use into nested closures once; validating is then plain Python checks, with
no schema interpretation per call. Any keyword outside that subset is refused at compile time,
so the files cannot grow a rule that the router would silently skip. Deliberate differences
from the letter of JSON Schema, all stricter and all matching the wire rules: a float such as
`3.0` is never an integer (nor is a bool), and `$` in a pattern matches only at the very end of
the string (as in ECMA-262, not before a trailing newline as Python's `re` would).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, TypeAlias

import schemas as _schemas_package

__all__ = [
    "NOTIFICATIONS",
    "OPS",
    "SCHEMA_ROOT",
    "SchemaError",
    "Validator",
    "compile_schema",
    "contract_digest",
    "load_schemas",
    "validator",
]

SCHEMA_ROOT: Final[Path] = Path(_schemas_package.__file__).resolve().parent / "bus"

OPS: Final = (
    "bus.hello",
    "bus.register",
    "bus.unregister",
    "bus.call",
    "bus.reply",
    "bus.release",
    "bus.cancel",
    "bus.consumed",
    "bus.services",
    "bus.stats",
    "bus.expect",
    "bus.declare",
    "bus.undeclare",
    "bus.publish",
    "bus.subscribe",
    "bus.unsubscribe",
    "bus.topics",
    "bus.allocate",
    "bus.seal",
    "bus.retain",
    "bus.drop",
)
NOTIFICATIONS: Final = (
    "bus.request",
    "bus.result",
    "bus.callFailed",
    "bus.replyFailed",
    "bus.routeRemoved",
    "bus.closing",
    "bus.message",
    "bus.topicRemoved",
    "bus.publishFailed",
)

DRAFT_2020_12: Final = "https://json-schema.org/draft/2020-12/schema"

Validator: TypeAlias = Callable[[Any], str | None]
"""Returns None when the value is valid, else a short message naming the path and the rule."""


class SchemaError(ValueError):
    """A schema uses a keyword or form that `compile_schema` does not support, or is malformed."""


# --------------------------------------------------------------------------------------------
# Loading and the contract digest


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise SchemaError(f"duplicate key {key!r} in a schema file")
        result[key] = value
    return result


def _refuse_constant(name: str) -> Any:
    raise SchemaError(f"non-finite number {name} in a schema file")


def _read_json(path: Path) -> Any:
    return json.loads(
        path.read_text(encoding="utf-8"),
        object_pairs_hook=_refuse_duplicates,
        parse_constant=_refuse_constant,
    )


def load_schemas(root: Path = SCHEMA_ROOT) -> dict[str, Any]:
    """Map every `*.json` file under `root` (relative, '/'-separated, sorted) to its content.

    Only `*.json` files count: they are what the package installs (`package-data`), so a source
    tree and an installed copy give the same mapping and the same digest.
    """
    paths = {p.relative_to(root).as_posix(): p for p in root.rglob("*.json") if p.is_file()}
    return {rel: _read_json(paths[rel]) for rel in sorted(paths)}


def _canonical_json(value: Any) -> bytes:
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


@functools.lru_cache(maxsize=1)
def _default_digest() -> str:
    return hashlib.sha256(_canonical_json(load_schemas(SCHEMA_ROOT))).hexdigest()


def contract_digest(root: Path = SCHEMA_ROOT) -> str:
    """Lowercase hex SHA-256 of the canonical JSON of `load_schemas(root)` (design/wire.md §6.2).

    Canonical: keys sorted, no whitespace, UTF-8 with non-ASCII kept as is. The value for the
    installed `schemas/bus/` is computed once and cached.
    """
    if root == SCHEMA_ROOT:
        return _default_digest()
    return hashlib.sha256(_canonical_json(load_schemas(root))).hexdigest()


@functools.cache
def validator(name: str) -> Validator:
    """The compiled, cached validator of a file under SCHEMA_ROOT ("ops/bus.call.params.json")."""
    path = (SCHEMA_ROOT / name).resolve()
    if SCHEMA_ROOT not in path.parents or path.suffix != ".json":
        raise SchemaError(f"{name!r} is not a schema file under {SCHEMA_ROOT}")
    schema = _read_json(path)
    if not isinstance(schema, dict):
        raise SchemaError(f"{name}: the root schema must be an object")
    return compile_schema(schema)


# --------------------------------------------------------------------------------------------
# The compiled validator


class _Fail:
    """One validation failure; `path` is built innermost first while the failure unwinds."""

    __slots__ = ("message", "path")

    def __init__(self, message: str) -> None:
        self.message = message
        self.path: list[str | int] = []

    def __str__(self) -> str:
        if not self.path:
            return self.message
        parts: list[str] = []
        for key in reversed(self.path):
            if isinstance(key, int):
                parts.append(f"[{key}]")
            else:
                parts.append(f".{key}" if parts else key)
        return f"{''.join(parts)}: {self.message}"


_Check: TypeAlias = Callable[[Any], "_Fail | None"]

_ANNOTATIONS: Final = frozenset({"title", "description", "$comment", "default"})
_ROOT_ONLY: Final = frozenset({"$schema", "$defs"})
_GENERIC: Final = frozenset({"$ref", "enum", "const", "anyOf", "oneOf"})
_TYPE_KEYWORDS: Final[Mapping[str, str]] = {
    "minLength": "string",
    "maxLength": "string",
    "pattern": "string",
    "minimum": "number",
    "maximum": "number",
    "items": "array",
    "minItems": "array",
    "maxItems": "array",
    "uniqueItems": "array",
    "properties": "object",
    "required": "object",
    "additionalProperties": "object",
}
_SUPPORTED: Final = _ANNOTATIONS | _GENERIC | {"type"} | frozenset(_TYPE_KEYWORDS)
_TYPES: Final = frozenset({"null", "boolean", "integer", "number", "string", "array", "object"})
_MAX_SHOWN: Final = 48
_MEMO_SIZE: Final = 4096


def _kind(x: Any) -> str:
    """The JSON type of a decoded value; a float is always "number", never "integer"."""
    t = type(x)
    if t is str:
        return "string"
    if t is int:
        return "integer"
    if t is bool:
        return "boolean"
    if x is None:
        return "null"
    if t is dict:
        return "object"
    if t is list:
        return "array"
    if t is float:
        return "number"
    if isinstance(x, bool):
        return "boolean"
    if isinstance(x, int):
        return "integer"
    if isinstance(x, float):
        return "number"
    if isinstance(x, str):
        return "string"
    if isinstance(x, dict):
        return "object"
    if isinstance(x, list):
        return "array"
    return type(x).__name__


def _show(x: Any) -> str:
    """A short JSON-like rendering of a value for messages."""
    if isinstance(x, str):
        if len(x) > _MAX_SHOWN:
            return json.dumps(x[:_MAX_SHOWN]) + "..."
        return json.dumps(x)
    if x is None or isinstance(x, bool | int | float):
        return json.dumps(x)
    return "an object" if isinstance(x, dict) else "an array" if isinstance(x, list) else repr(x)


def _member(key: str) -> str:
    return repr(key if len(key) <= _MAX_SHOWN else key[:_MAX_SHOWN] + "...")


def _describe(x: Any) -> str:
    kind = _kind(x)
    if kind in ("boolean", "integer", "number"):
        return f"{kind} {_show(x)}"
    return kind


def _freeze(x: Any) -> Any:
    """A hashable key with JSON equality: 1 == 1.0, but true != 1."""
    if isinstance(x, bool):
        return ("b", x)
    if isinstance(x, int | float):
        return ("n", x)
    if isinstance(x, str):
        return ("s", x)
    if x is None:
        return ("z",)
    if isinstance(x, list):
        return ("a", tuple(_freeze(item) for item in x))
    if isinstance(x, dict):
        return ("o", frozenset((k, _freeze(v)) for k, v in x.items()))
    return ("?", repr(x))


def ecma_source(pattern: str) -> str:
    """An ECMA-262 style pattern as Python's `re` reads it: every unescaped `$` outside a class
    becomes `\\Z` (ECMA's `$` never matches before a final newline), classes ASCII (`(?a)`).
    The one translation: every checker of these schemas compiles its patterns through it."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "$":
            ch = r"\Z"
        out.append(ch)
        i += 1
    return "(?a)" + "".join(out)


def _ecma_pattern(pattern: str) -> re.Pattern[str]:
    """Compile an ECMA-262 style pattern (`ecma_source`)."""
    try:
        return re.compile(ecma_source(pattern))
    except re.error as exc:
        raise SchemaError(f"invalid pattern {pattern!r}: {exc}") from None


def _accept(x: Any) -> _Fail | None:
    return None


def _reject(x: Any) -> _Fail | None:
    return _Fail("no value is allowed here")


def _is_int(x: Any) -> bool:
    return type(x) is int or (isinstance(x, int) and not isinstance(x, bool))


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


_TYPE_TESTS: Final[Mapping[str, Callable[[Any], bool]]] = {
    "null": lambda x: x is None,
    "boolean": lambda x: isinstance(x, bool),
    "integer": _is_int,
    "number": _is_number,
    "string": lambda x: isinstance(x, str),
    "array": lambda x: isinstance(x, list),
    "object": lambda x: isinstance(x, dict),
}


def _number(x: Any, where: str) -> int | float:
    if not _is_number(x):
        raise SchemaError(f"{where}: expected a number, got {x!r}")
    return x  # type: ignore[no-any-return]


def _count(x: Any, where: str) -> int:
    if not _is_int(x) or x < 0:
        raise SchemaError(f"{where}: expected a non-negative integer, got {x!r}")
    return x  # type: ignore[no-any-return]


class _Compiler:
    def __init__(self, root: Mapping[str, Any]) -> None:
        defs = root.get("$defs", {})
        if not isinstance(defs, dict):
            raise SchemaError("#/$defs: must be an object")
        self.defs: dict[str, Any] = defs
        self.compiled: dict[str, _Check] = {}
        self.in_progress: set[str] = set()

    # -- entry points -------------------------------------------------------------------------

    def root(self, schema: Mapping[str, Any]) -> _Check:
        if "$schema" in schema and schema["$schema"] != DRAFT_2020_12:
            raise SchemaError(f"#: unsupported $schema {schema['$schema']!r}")
        for name in self.defs:  # every entry is compiled, so an unused one cannot hide an error
            self.ref(name, f"#/$defs/{name}")
        return self.compile(schema, "#", root=True)

    def ref(self, name: str, where: str) -> _Check:
        done = self.compiled.get(name)
        if done is not None:
            return done
        if name not in self.defs:
            raise SchemaError(f"{where}: $ref to an undefined $defs entry {name!r}")
        if name in self.in_progress:  # recursive reference: resolve at call time
            compiled = self.compiled

            def deferred(x: Any) -> _Fail | None:
                return compiled[name](x)

            return deferred
        self.in_progress.add(name)
        check = self.compile(self.defs[name], f"#/$defs/{name}")
        self.in_progress.discard(name)
        self.compiled[name] = check
        return check

    def root_types(self, schema: Any) -> frozenset[str] | None:
        """The JSON types a schema can accept at its root (None: any), resolving $ref/anyOf."""
        if schema is True or not isinstance(schema, dict):
            return None if schema is True else frozenset()
        found: frozenset[str] | None = None
        if "type" in schema:
            types = schema["type"]
            found = frozenset([types] if isinstance(types, str) else types)
            if "number" in found:
                found |= {"integer"}
        if "$ref" in schema:
            name = str(schema["$ref"]).removeprefix("#/$defs/")
            sub = self.root_types(self.defs.get(name, True))
            found = sub if found is None else (found if sub is None else found & sub)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                union: frozenset[str] = frozenset()
                for branch in schema[key]:
                    sub = self.root_types(branch)
                    if sub is None:
                        break
                    union |= sub
                else:
                    found = union if found is None else found & union
        return found

    # -- one schema ---------------------------------------------------------------------------

    def compile(self, schema: Any, where: str, root: bool = False) -> _Check:
        if schema is True:
            return _accept
        if schema is False:
            return _reject
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object or a boolean")
        for key in schema:
            if key in _ROOT_ONLY and root:
                continue
            if key not in _SUPPORTED:
                raise SchemaError(f"{where}: unsupported keyword {key!r}")

        types = self.types(schema, where)
        by_kind: dict[str, _Check] = {}
        if "string" in types or any(_TYPE_KEYWORDS.get(k) == "string" for k in schema):
            by_kind["string"] = self.string(schema, where)
        if any(_TYPE_KEYWORDS.get(k) == "number" for k in schema):
            check = self.number(schema, where)
            by_kind["integer"] = by_kind["number"] = check
        if any(_TYPE_KEYWORDS.get(k) == "array" for k in schema):
            by_kind["array"] = self.array(schema, where)
        if any(_TYPE_KEYWORDS.get(k) == "object" for k in schema):
            by_kind["object"] = self.object(schema, where)

        generic = [self.generic(key, schema, where) for key in schema if key in _GENERIC]
        if not types:
            base = self.dispatch_by_kind(None, by_kind)
        elif len(types) == 1:
            (only,) = types
            base = self.single_type(only, by_kind.get(only))
        else:
            base = self.dispatch_by_kind(types, by_kind)
        return _chain(base, generic)

    def types(self, schema: Mapping[str, Any], where: str) -> tuple[str, ...]:
        if "type" not in schema:
            return ()
        raw = schema["type"]
        types = [raw] if isinstance(raw, str) else raw
        if not isinstance(types, list) or not types or not all(t in _TYPES for t in types):
            raise SchemaError(f"{where}/type: unsupported type {raw!r}")
        if len(set(types)) != len(types):
            raise SchemaError(f"{where}/type: repeated type")
        return tuple(types)

    def single_type(self, only: str, check: _Check | None) -> _Check:
        """A check for a schema with exactly one type: the type test, then its keywords."""
        if check is not None and only in ("string", "array", "object", "integer", "number"):
            # these kind checks start with their own type test, reporting `expected <only>`
            if only in ("integer", "number"):
                return self.typed_number(only, check)
            return check
        test = _TYPE_TESTS[only]

        def typed(x: Any) -> _Fail | None:
            if test(x):
                return None
            return _Fail(f"expected {only}, got {_describe(x)}")

        return typed

    def typed_number(self, only: str, check: _Check) -> _Check:
        if only == "integer":

            def integer(x: Any) -> _Fail | None:
                if type(x) is not int and not _is_int(x):
                    return _Fail(f"expected integer, got {_describe(x)}")
                return check(x)

            return integer

        def number(x: Any) -> _Fail | None:
            if not _is_number(x):
                return _Fail(f"expected number, got {_describe(x)}")
            return check(x)

        return number

    def dispatch_by_kind(self, types: tuple[str, ...] | None, by_kind: dict[str, _Check]) -> _Check:
        allowed: frozenset[str] | None = None
        expected = ""
        if types is not None:
            allowed = frozenset(types) | ({"integer"} if "number" in types else frozenset())
            expected = " or ".join(types)
        if allowed is None and not by_kind:
            return _accept

        def by_type(x: Any) -> _Fail | None:
            kind = _kind(x)
            if allowed is not None and kind not in allowed:
                return _Fail(f"expected {expected}, got {_describe(x)}")
            check = by_kind.get(kind)
            return None if check is None else check(x)

        return by_type

    # -- keyword groups (each check starts with its own type test) ----------------------------

    def string(self, schema: Mapping[str, Any], where: str) -> _Check:
        lo = _count(schema.get("minLength", 0), f"{where}/minLength")
        hi = schema.get("maxLength")
        hi = None if hi is None else _count(hi, f"{where}/maxLength")
        pattern = schema.get("pattern")
        if pattern is not None and not isinstance(pattern, str):
            raise SchemaError(f"{where}/pattern: must be a string")
        search = None if pattern is None else _ecma_pattern(pattern).search
        # Names, incarnations and methods repeat from request to request: a string that
        # passed once passes again, and a set lookup is several times cheaper than the
        # length and regex checks. Only passes are remembered, so a miss is never cached.
        passed: set[str] = set()
        title = schema.get("title")
        bad_pattern = (
            f"is not a valid {title}" if isinstance(title, str) else f"does not match {pattern}"
        )
        top = hi if hi is not None else -1

        def string(x: Any) -> _Fail | None:
            if not isinstance(x, str):
                return _Fail(f"expected string, got {_describe(x)}")
            if x in passed:
                return None
            n = len(x)
            if n < lo:
                return _Fail(f"{_show(x)} is shorter than the minimum length {lo}")
            if n > top >= 0:
                return _Fail(f"{_show(x)} is longer than the maximum length {top}")
            if search is not None and search(x) is None:
                return _Fail(f"{_show(x)} {bad_pattern}")
            if search is not None:  # plain strings (payload text) are not worth remembering
                if len(passed) >= _MEMO_SIZE:
                    passed.clear()
                passed.add(x)
            return None

        return string

    def number(self, schema: Mapping[str, Any], where: str) -> _Check:
        lo = schema.get("minimum")
        hi = schema.get("maximum")
        lo = None if lo is None else _number(lo, f"{where}/minimum")
        hi = None if hi is None else _number(hi, f"{where}/maximum")

        def number(x: Any) -> _Fail | None:
            if lo is not None and x < lo:
                return _Fail(f"{_show(x)} is less than the minimum {lo}")
            if hi is not None and x > hi:
                return _Fail(f"{_show(x)} is greater than the maximum {hi}")
            return None

        return number

    def array(self, schema: Mapping[str, Any], where: str) -> _Check:
        if isinstance(schema.get("items"), list):
            raise SchemaError(f"{where}/items: the array form is not Draft 2020-12")
        items = self.compile(schema["items"], f"{where}/items") if "items" in schema else None
        lo = _count(schema.get("minItems", 0), f"{where}/minItems")
        hi_raw = schema.get("maxItems")
        hi = -1 if hi_raw is None else _count(hi_raw, f"{where}/maxItems")
        unique = schema.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise SchemaError(f"{where}/uniqueItems: must be a boolean")

        def array(x: Any) -> _Fail | None:
            if not isinstance(x, list):
                return _Fail(f"expected array, got {_describe(x)}")
            n = len(x)
            if n < lo:
                return _Fail(f"has {n} items, fewer than the minimum {lo}")
            if n > hi >= 0:
                return _Fail(f"has {n} items, more than the maximum {hi}")
            if items is not None:
                for i, item in enumerate(x):
                    fail = items(item)
                    if fail is not None:
                        fail.path.append(i)
                        return fail
            if unique and n > 1:
                seen: dict[Any, int] = {}
                for i, item in enumerate(x):
                    key = item if type(item) is str else _freeze(item)
                    first = seen.setdefault(key, i)
                    if first != i:
                        return _Fail(f"item [{i}] repeats item [{first}]")
            return None

        return array

    def object(self, schema: Mapping[str, Any], where: str) -> _Check:
        raw_props = schema.get("properties", {})
        if not isinstance(raw_props, dict):
            raise SchemaError(f"{where}/properties: must be an object")
        props: dict[str, _Check] = {
            key: self.compile(sub, f"{where}/properties/{key}") for key, sub in raw_props.items()
        }
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            raise SchemaError(f"{where}/required: must be a list of strings")
        if len(set(required)) != len(required):
            raise SchemaError(f"{where}/required: repeated name")
        required_names = tuple(required)
        extra_raw = schema.get("additionalProperties", True)
        if extra_raw is False:
            missing = [k for k in required_names if k not in props]
            if missing:
                raise SchemaError(f"{where}: required {missing} can never be present")
        extra = None if extra_raw is True else self.compile(extra_raw, f"{where}/additional")

        def missing_member(x: dict[str, Any]) -> _Fail | None:
            for key in required_names:
                if key not in x:
                    return _Fail(f"missing member {_member(key)}")
            return None

        if extra_raw is False:
            get = props.get

            def closed(x: Any) -> _Fail | None:
                if not isinstance(x, dict):
                    return _Fail(f"expected object, got {_describe(x)}")
                for key in required_names:
                    if key not in x:
                        return _Fail(f"missing member {_member(key)}")
                for key, value in x.items():
                    check = get(key)
                    if check is None:
                        return _Fail(f"unexpected member {_member(key)}")
                    fail = check(value)
                    if fail is not None:
                        fail.path.append(key)
                        return fail
                return None

            return closed

        if extra is not None:
            extra_check = extra

            def open_with_schema(x: Any) -> _Fail | None:
                if not isinstance(x, dict):
                    return _Fail(f"expected object, got {_describe(x)}")
                fail = missing_member(x)
                if fail is not None:
                    return fail
                for key, value in x.items():
                    fail = props.get(key, extra_check)(value)
                    if fail is not None:
                        fail.path.append(key)
                        return fail
                return None

            return open_with_schema

        prop_items = tuple(props.items())

        def open_object(x: Any) -> _Fail | None:
            if not isinstance(x, dict):
                return _Fail(f"expected object, got {_describe(x)}")
            fail = missing_member(x)
            if fail is not None:
                return fail
            for key, check in prop_items:
                if key in x:
                    fail = check(x[key])
                    if fail is not None:
                        fail.path.append(key)
                        return fail
            return None

        return open_object

    # -- type-independent keywords --------------------------------------------------------------

    def generic(self, key: str, schema: Mapping[str, Any], where: str) -> _Check:
        value = schema[key]
        if key == "$ref":
            if not isinstance(value, str) or not value.startswith("#/$defs/"):
                raise SchemaError(f"{where}/$ref: only local '#/$defs/<name>' references")
            name = value.removeprefix("#/$defs/")
            if "/" in name or "~" in name:
                raise SchemaError(f"{where}/$ref: only local '#/$defs/<name>' references")
            return self.ref(name, where)
        if key == "enum":
            if not isinstance(value, list) or not value:
                raise SchemaError(f"{where}/enum: must be a non-empty list")
            return _enum(value)
        if key == "const":
            return _const(value)
        if not isinstance(value, list) or not value:
            raise SchemaError(f"{where}/{key}: must be a non-empty list of schemas")
        branches = [self.compile(sub, f"{where}/{key}/{i}") for i, sub in enumerate(value)]
        branch_types = [self.root_types(sub) for sub in value]
        return _any_of(branches, branch_types, exactly_one=key == "oneOf")


def _chain(base: _Check, more: list[_Check]) -> _Check:
    if not more:
        return base
    checks = ([] if base is _accept else [base]) + more
    if len(checks) == 1:
        return checks[0]
    if len(checks) == 2:
        first, second = checks

        def both(x: Any) -> _Fail | None:
            fail = first(x)
            return fail if fail is not None else second(x)

        return both
    all_checks = tuple(checks)

    def every(x: Any) -> _Fail | None:
        for check in all_checks:
            fail = check(x)
            if fail is not None:
                return fail
        return None

    return every


def _enum(values: list[Any]) -> _Check:
    if all(isinstance(v, str) for v in values):
        allowed_strings = frozenset(values)
        message = _enum_message(values)

        def string_enum(x: Any) -> _Fail | None:
            if isinstance(x, str) and x in allowed_strings:
                return None
            return _Fail(f"{_show(x)} {message}")

        return string_enum
    allowed = frozenset(_freeze(v) for v in values)
    message = _enum_message(values)

    def enum(x: Any) -> _Fail | None:
        if _freeze(x) in allowed:
            return None
        return _Fail(f"{_show(x)} {message}")

    return enum


def _enum_message(values: list[Any]) -> str:
    if len(values) <= 6:
        return "is not one of " + ", ".join(_show(v) for v in values)
    return "is not an allowed value"


def _const(value: Any) -> _Check:
    key = _freeze(value)
    shown = _show(value)

    def const(x: Any) -> _Fail | None:
        if _freeze(x) == key:
            return None
        return _Fail(f"{_show(x)} is not {shown}")

    return const


def _any_of(
    branches: list[_Check], branch_types: list[frozenset[str] | None], *, exactly_one: bool
) -> _Check:
    """anyOf/oneOf. A failure reports the deepest branch failure among the branches whose
    type admits the value (so a nullable string reports the string's rule), or a type error."""
    pairs = tuple(zip(branches, branch_types, strict=True))
    null_ok = any(t == frozenset({"null"}) for t in branch_types)
    expected_types: list[str] = []
    for t in branch_types:
        for name in sorted(t or ()):
            if name not in expected_types:
                expected_types.append(name)
    if any(t is None for t in branch_types):
        expected_types = []
    expected = " or ".join(expected_types)

    def explain(x: Any, fails: list[_Fail]) -> _Fail:
        if not fails:
            return _Fail(f"expected {expected}, got {_describe(x)}")
        return max(fails, key=lambda fail: len(fail.path))

    def admits(types: frozenset[str] | None, x: Any) -> bool:
        if types is None:
            return True
        kind = _kind(x)
        return kind in types or (kind == "integer" and "number" in types)

    if not exactly_one:
        rest = tuple(pair for pair in pairs if pair[1] != frozenset({"null"}))
        if null_ok and len(rest) == 1:
            ((only, only_types),) = rest

            def nullable(x: Any) -> _Fail | None:
                if x is None:
                    return None
                fail = only(x)
                if fail is None or admits(only_types, x):
                    return fail
                return _Fail(f"expected {expected}, got {_describe(x)}")

            return nullable

        def any_of(x: Any) -> _Fail | None:
            fails: list[_Fail] = []
            for check, types in pairs:
                fail = check(x)
                if fail is None:
                    return None
                if admits(types, x):
                    fails.append(fail)
            return explain(x, fails)

        return any_of

    def one_of(x: Any) -> _Fail | None:
        fails: list[_Fail] = []
        matched = 0
        for check, types in pairs:
            fail = check(x)
            if fail is None:
                matched += 1
            elif admits(types, x):
                fails.append(fail)
        if matched == 1:
            return None
        if matched > 1:
            return _Fail(f"matches {matched} alternatives, exactly one is allowed")
        return explain(x, fails)

    return one_of


def compile_schema(schema: Mapping[str, Any]) -> Validator:
    """Compile a self-contained schema (local `#/$defs/...` references only) into a validator.

    Supported: type, properties, required, additionalProperties, items, minItems, maxItems,
    uniqueItems, enum, const, pattern, minLength, maxLength, minimum, maximum, anyOf, oneOf,
    $ref, plus the annotations title (used in pattern messages), description, $comment and
    default. Anything else raises SchemaError.
    """
    check = _Compiler(schema).root(schema)

    def validate(value: Any) -> str | None:
        fail = check(value)
        return None if fail is None else str(fail)

    return validate
