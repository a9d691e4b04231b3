"""Typed structures of the domain messages, generated from `schemas/session/` at import
(design/wire.md §22.3: the schemas stay the one source), and the step path's one-pass checks with
them.

Why: the compiled Python validator (`bus.schema.compile_schema`) walks a message with one Python
call per keyword, after `parse_request`/`rpc.answer` walked its envelope; `msgspec.convert` into
a `Struct` checks envelope and body in one C pass. Each method's params/result schema becomes a
`msgspec.Struct` type tree:

- a closed object (`additionalProperties: false`) is a `Struct` refusing unknown fields; a
  required property is a required field, any other defaults to `UNSET`;
- `string` with `minLength`/`maxLength`, `integer` and `number` with their bounds, `boolean`,
  `null`, `array` with `items`/`minItems`/`maxItems`, `enum`/`const` of scalars and `$ref` map
  onto the matching annotated types (a number is `int | float`, so the value keeps its JSON
  type; an integer never accepts a bool or a float); a value with no keyword is `Any`;
- a property that is a string with a `pattern` is a plain `str`, its pattern checked after the
  conversion against a memory of the strings that matched before (`$` matches only at the very
  end, as `bus.schema` reads it): ids, digests and step numbers repeat from message to message,
  and msgspec runs a pattern's expression every time (0.27 µs a string, most of a conversion);
- `anyOf`/`oneOf` whose branches msgspec tells apart by JSON type (null or X) is a union; one
  of closed objects whose shared properties have one schema (`Media`: a blob or a reference)
  is one struct of all their properties and a check of which branches the present keys fit.

Anything else (`uniqueItems`, `if`, `propertyNames`, ...) stays on the slow path: the field is
typed `Any` and the struct's `__post_init__` runs `bus.schema`'s compiled validator on that field
alone. So every rule of the schema is checked and nothing is restated by hand.

The input is a tree the SDK's strict decode produced (design/wire.md §3: duplicate keys, non-finite
numbers, depth and integer ranges were refused there, in the one pass over the frame's bytes),
so the check adds no second parse. A refusal is not worded here: `parse_typed` and
`answer_typed` return None/fall back, and `parse_request`, `check_params` and `rpc.answer` word
it as before (the messages do not change). A bus-only key (design/session.md §1.3) can only hide in
a params field typed `Any`: only those fields are searched for one, not the whole params.
"""

from __future__ import annotations

import functools
import keyword
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Union

import msgspec
import orjson

from bus.schema import SchemaError, Validator, compile_schema, ecma_source
from workers.types.contract import METHOD_SCHEMAS
from workers.types.domain import Scope
from workers.types.rpc import (
    BUS_ONLY_KEYS,
    Answered,
    Outcome,
    Refused,
    Request,
    answer,
    holds_bus_key,
)

__all__ = [
    "METHODS",
    "OUTCOME_SCHEMA",
    "REQUEST_SCHEMA",
    "answer_typed",
    "parse_typed",
    "structure",
]

REQUEST_SCHEMA: Final = METHOD_SCHEMAS.parent / "request.json"
OUTCOME_SCHEMA: Final = METHOD_SCHEMAS.parent / "outcome.json"
SCOPES_KEPT: Final = 64
#: the methods with a params schema: only their names ever become a file path
METHODS: Final = frozenset(path.name.removesuffix(".params.json")
                           for path in METHOD_SCHEMAS.glob("*.params.json"))

_ANNOTATIONS: Final = frozenset({"title", "description", "$schema", "$comment", "examples"})


#: a union of objects: each branch's (required keys, allowed keys), and whether exactly one fits
_Variants = tuple[tuple[tuple[frozenset[str], frozenset[str]], ...], bool]


class _Unsupported(Exception):
    """A subschema msgspec cannot state exactly: it is checked by the compiled validator."""


class _Generator:
    """One schema file's types: `$defs` entries are generated once and shared."""

    def __init__(self, root: Mapping[str, Any], name: str, *, bus_keys: bool = False) -> None:
        self.name = name
        #: a request's params: no bus-only key at any depth (design/session.md §1.3)
        self.bus_keys = bus_keys
        self.defs: dict[str, Any] = dict(root.get("$defs", {}))
        self.done: dict[str, tuple[Any, str]] = {}
        self.busy: set[str] = set()
        self.count = 0

    def slow(self, schema: Any) -> Validator:
        """The compiled validator of a subschema, its `$ref`s resolved in this file's `$defs`."""
        if not isinstance(schema, dict):
            raise SchemaError(f"{self.name}: a boolean subschema")
        return compile_schema({"$defs": self.defs, **schema})

    def field(self, schema: Any) -> tuple[Any, Validator | None]:
        """A field's type, and the validator to run on it when msgspec cannot state it."""
        try:
            return self.type_of(schema)[0], None
        except _Unsupported:
            check = self.slow(schema)
            return Any, _no_bus_keys(check) if self.bus_keys else check

    def type_of(self, schema: Any) -> tuple[Any, str]:
        """The msgspec type of `schema` and its JSON kind (for telling union branches apart)."""
        if not isinstance(schema, dict):
            raise _Unsupported("a boolean schema")
        keys = set(schema) - _ANNOTATIONS
        if not keys:  # any JSON value: a field of its own (a bus-only key may hide in it)
            raise _Unsupported("any value")
        if "$ref" in keys:
            if keys != {"$ref"}:
                raise _Unsupported("$ref beside other keywords")
            return self.ref(str(schema["$ref"]))
        for union in ("anyOf", "oneOf"):
            if union in keys:
                if keys != {union}:
                    raise _Unsupported(f"{union} beside other keywords")
                merged = self.variants(schema[union], exclusive=union == "oneOf")
                if merged is not None:
                    return merged, "object"
                return self.union([self.type_of(branch) for branch in schema[union]])
        if "enum" in keys or "const" in keys:
            return self.literal(schema, keys)
        kind = schema.get("type")
        if isinstance(kind, list):
            if keys != {"type"}:
                raise _Unsupported("a list of types with keywords")
            return self.union([self.type_of({"type": one}) for one in kind])
        if kind == "object":
            return self.struct(schema, keys), "object"
        if kind == "array":
            return self.array(schema, keys), "array"
        return self.scalar(kind, schema, keys)

    def ref(self, ref: str) -> tuple[Any, str]:
        name = ref.removeprefix("#/$defs/")
        if name in self.done:
            return self.done[name]
        if name in self.busy or name not in self.defs:
            raise _Unsupported("a recursive or unknown $ref")
        self.busy.add(name)
        try:
            made = self.type_of(self.defs[name])
        finally:
            self.busy.discard(name)
        self.done[name] = made
        return made

    @staticmethod
    def union(branches: list[tuple[Any, str]]) -> tuple[Any, str]:
        kinds = [kind for _, kind in branches]
        # msgspec tells union members apart by JSON type alone: one branch per kind (a number
        # overlaps an integer), so oneOf and anyOf mean the same here
        if len(set(kinds)) != len(kinds) or ("num" in kinds and "int" in kinds):
            raise _Unsupported("branches of one JSON type")
        return Union[tuple(t for t, _ in branches)], "union"  # noqa: UP007 (built at run time)

    @staticmethod
    def literal(schema: Mapping[str, Any], keys: set[str]) -> tuple[Any, str]:
        values = schema["enum"] if "enum" in keys else [schema["const"]]
        if keys - {"enum", "const", "type"} or not values:
            raise _Unsupported("enum with other keywords")
        declared = schema.get("type", None)
        if all(isinstance(v, str) for v in values) and declared in (None, "string"):
            return Literal[tuple(values)], "str"
        if all(type(v) is int for v in values) and declared in (None, "integer"):
            return Literal[tuple(values)], "int"
        raise _Unsupported("an enum of mixed or non-scalar values, or of another type")

    def scalar(self, kind: Any, schema: Mapping[str, Any], keys: set[str]) -> tuple[Any, str]:
        allowed = {"string": {"pattern", "minLength", "maxLength"},
                   "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
                   "number": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
                   "boolean": set(), "null": set()}.get(kind)
        if allowed is None or keys - {"type"} - allowed:
            raise _Unsupported(f"type {kind!r} with {sorted(keys)}")
        if kind == "boolean":
            return bool, "bool"
        if kind == "null":
            return None, "null"
        if kind == "string":
            meta = {"pattern": ecma_source(schema["pattern"]) if "pattern" in schema else None,
                    "min_length": schema.get("minLength"), "max_length": schema.get("maxLength")}
            return self.annotated(str, meta), "str"
        bounds = {"ge": schema.get("minimum"), "le": schema.get("maximum"),
                  "gt": schema.get("exclusiveMinimum"), "lt": schema.get("exclusiveMaximum")}
        if kind == "integer":
            return self.annotated(int, bounds), "int"
        return Union[self.annotated(int, bounds), self.annotated(float, bounds)], "num"  # noqa: UP007

    @staticmethod
    def annotated(base: type, meta: Mapping[str, Any]) -> Any:
        given = {k: v for k, v in meta.items() if v is not None}
        return Annotated[base, msgspec.Meta(**given)] if given else base

    def array(self, schema: Mapping[str, Any], keys: set[str]) -> Any:
        if keys - {"type", "items", "minItems", "maxItems"}:
            raise _Unsupported(f"array with {sorted(keys)}")
        if "items" not in schema:
            raise _Unsupported("an array of any values")
        item: Any = self.type_of(schema["items"])[0]
        return self.annotated(list[item], {"min_length": schema.get("minItems"),
                                           "max_length": schema.get("maxItems")})

    def resolve(self, schema: Any) -> Any:
        """`schema` with its `$ref` chain followed (annotations aside)."""
        seen = 0
        while isinstance(schema, dict) and set(schema) - _ANNOTATIONS == {"$ref"} and seen < 8:
            schema = self.defs.get(str(schema["$ref"]).removeprefix("#/$defs/"))
            seen += 1
        return schema

    @staticmethod
    def closed(schema: Any) -> bool:
        return isinstance(schema, dict) and schema.get("type") == "object" \
            and schema.get("additionalProperties") is False \
            and not set(schema) - _ANNOTATIONS - {"type", "properties", "required",
                                                 "additionalProperties"}

    def variants(self, branches: list[Any], *, exclusive: bool) -> type[msgspec.Struct] | None:
        """A union of closed objects whose shared properties have one schema (a blob or a
        reference: `Media`) as one struct of every property, each optional, and a check of
        which branches the present keys fit: exactly one (`oneOf`) or at least one (`anyOf`).
        None when the branches are not of that form."""
        resolved = [self.resolve(branch) for branch in branches]
        if len(resolved) < 2 or not all(self.closed(one) for one in resolved):
            return None
        props: dict[str, Any] = {}
        for one in resolved:
            for name, sub in one.get("properties", {}).items():
                if props.setdefault(name, sub) != sub:
                    return None
        rules = tuple((frozenset(one.get("required", ())), frozenset(one.get("properties", {})))
                      for one in resolved)
        return self.struct({"properties": props}, set(), variants=(rules, exclusive))

    def pattern_of(self, schema: Any) -> _Pattern | None:
        """A property that is a string with a pattern and nothing else: checked after the
        conversion, against the strings that matched before (ids, digests and step numbers
        repeat from one message to the next; msgspec would run the expression every time)."""
        found = self.resolve(schema)
        if not isinstance(found, dict) or set(found) - _ANNOTATIONS != {"type", "pattern"} \
                or found["type"] != "string":
            return None
        return _pattern(str(found["pattern"]))

    def struct(self, schema: Mapping[str, Any], keys: set[str],
               variants: _Variants | None = None) -> type[msgspec.Struct]:
        if variants is None and (keys - {"type", "properties", "required",
                                         "additionalProperties"}
                                 or schema.get("additionalProperties") is not False):
            raise _Unsupported("an open object or object keywords")
        required = set(schema.get("required", ()))
        props: dict[str, Any] = schema.get("properties", {})
        if not required <= set(props):
            raise _Unsupported("a required key without a property")
        if self.bus_keys and not BUS_ONLY_KEYS.isdisjoint(props):
            raise _Unsupported("a property named as a bus-only key")
        fields: list[tuple[str, Any, Any]] = []
        rename: dict[str, str] = {}
        slow: list[tuple[str, Validator]] = []
        for index, (wire, sub) in enumerate(props.items()):
            attr = wire if wire.isidentifier() and not keyword.iskeyword(wire) \
                and not wire.startswith("_") else f"f{index}"
            rename[attr] = wire
            pattern = self.pattern_of(sub)
            kind: Any = str
            check: Validator | None = pattern
            if pattern is None:
                kind, check = self.field(sub)
            if check is not None:
                slow.append((attr, check))
            if wire in required:
                fields.append((attr, kind, msgspec.NODEFAULT))
            else:
                fields.append((attr, Union[kind, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007
        self.count += 1
        namespace = {"__post_init__": _post_init(tuple(slow), rename, variants)} \
            if slow or variants else {}
        return msgspec.defstruct(f"{self.name}{self.count}", fields, kw_only=True,
                                 forbid_unknown_fields=True, rename=rename, namespace=namespace)


class _Pattern:
    """A pattern's check with the strings it matched before (bounded: forgotten wholesale)."""

    KEPT: Final = 4096

    def __init__(self, pattern: str) -> None:
        self.search = re.compile(ecma_source(pattern)).search
        self.pattern = pattern
        self.matched: set[str] = set()

    def __call__(self, value: str) -> str | None:
        if value in self.matched:
            return None
        if self.search(value) is None:
            return f"{value!r} does not match {self.pattern}"
        if len(self.matched) >= self.KEPT:
            self.matched.clear()
        self.matched.add(value)
        return None


@functools.cache
def _pattern(pattern: str) -> _Pattern:
    return _Pattern(pattern)


def _post_init(slow: tuple[tuple[str, Validator], ...], rename: Mapping[str, str],
               variants: _Variants | None) -> Any:
    """The checks msgspec cannot state: the fields typed `Any`, and which branch of a union of
    objects the present keys fit; a refusal names the struct's path."""

    def post_init(self: msgspec.Struct) -> None:
        for attr, check in slow:
            value = getattr(self, attr)
            if value is not msgspec.UNSET:
                problem = check(value)
                if problem is not None:
                    raise ValueError(problem)
        if variants is not None:
            rules, exclusive = variants
            present = frozenset(wire for attr, wire in rename.items()
                                if getattr(self, attr) is not msgspec.UNSET)
            fits = sum(1 for need, allowed in rules if need <= present <= allowed)
            if fits == 0 or (exclusive and fits > 1):
                raise ValueError(f"the keys {sorted(present)} fit {fits} of the branches")

    return post_init


def _load(path: Path) -> dict[str, Any]:
    schema: dict[str, Any] = orjson.loads(path.read_bytes())
    return schema


@functools.cache
def structure(method: str, kind: str) -> Any:
    """The type of `schemas/session/methods/<method>.<kind>.json` (kind `params`|`result`), or
    None when even its root is outside what msgspec states. A params structure also refuses
    a bus-only key: no property is named so, and a field typed `Any` is searched for one."""
    schema = _load(METHOD_SCHEMAS / f"{method}.{kind}.json")
    generator = _Generator(schema, method.replace(".", "") + kind.title(),
                           bus_keys=kind == "params")
    try:
        return generator.type_of({k: v for k, v in schema.items() if k != "$defs"})[0]
    except _Unsupported:
        return None


def _no_bus_keys(check: Validator) -> Validator:
    """`check`, and no bus-only key at any depth of the value."""

    def checked(value: Any) -> str | None:
        problem = check(value)
        if problem is None and holds_bus_key(value):
            return "a bus-only key in params"
        return problem

    return checked


@functools.cache
def _request_type(method: str) -> Any:
    """The request of `method` as one structure: `requestId` and `scope` as `request.json`
    states them, `params` as the method's params structure (None: it has none)."""
    params = structure(method, "params")
    if params is None:
        return None
    envelope = _Generator(_load(REQUEST_SCHEMA), method.replace(".", "") + "Request")
    request_id = envelope.type_of({"$ref": "#/$defs/RequestId"})[0]
    scope = envelope.type_of({"$ref": "#/$defs/ScopeOrNull"})[0]
    made = msgspec.defstruct(envelope.name, [("requestId", request_id), ("scope", scope),
                                             ("params", params)],
                             kw_only=True, forbid_unknown_fields=True)
    return made


_scopes: dict[tuple[str, str, str], Scope] = {}


def _scope(session_id: str, epoch: str, step: str) -> Scope:
    """The `Scope` of checked fields; a step's requests share one, so the last few are kept."""
    key = (session_id, epoch, step)
    found = _scopes.get(key)
    if found is None:
        if len(_scopes) >= SCOPES_KEPT:
            _scopes.clear()
        found = _scopes[key] = Scope(session_id, epoch, int(step))
    return found


def parse_typed(method: str, payload: Any) -> Request | None:
    """`payload` as a `Request` whose params match `method`'s schema, checked in one pass; None
    when the method has no structure or the payload is refused (then `parse_request` and
    `check_params` run as before and word the refusal)."""
    typed = _request_type(method) if method in METHODS else None
    if typed is None:
        return None
    try:
        got = msgspec.convert(payload, typed)
    except msgspec.ValidationError:
        return None
    scope = got.scope
    return Request(got.requestId, None if scope is None
                   else _scope(scope.sessionId, scope.epoch, scope.step), payload["params"])


@functools.cache
def _outcome_type(method: str) -> Any:
    """A result outcome of `method` as one structure: the envelope as `outcome.json`'s
    `ResultOutcome` states it, `result` as the method's result schema (None: no structure)."""
    result = structure(method, "result")
    if result is None:
        return None
    envelope = _Generator(_load(OUTCOME_SCHEMA), method.replace(".", "") + "Outcome")
    fields = [("type", Literal["result"]),
              ("requestId", envelope.type_of({"$ref": "#/$defs/OutcomeRequestId"})[0]),
              ("workerId", envelope.type_of({"$ref": "#/$defs/Id"})[0]),
              ("incarnationId", envelope.type_of({"$ref": "#/$defs/Id"})[0]),
              ("scope", envelope.type_of({"$ref": "#/$defs/ScopeOrNull"})[0]),
              ("result", result)]
    return msgspec.defstruct(envelope.name, fields, kw_only=True, forbid_unknown_fields=True)


def answer_typed(method: str, raw: Any) -> Answered | Refused:
    """`rpc.answer` with a result outcome and its result checked in one pass (the outcome says
    `checked`, so the caller skips the result schema); an error outcome, or one the structure
    refuses, goes to `answer`, which words it."""
    typed = _outcome_type(method) if method in METHODS else None
    if typed is not None:
        try:
            got = msgspec.convert(raw, typed)
        except msgspec.ValidationError:
            return answer(method, raw)
        scope = got.scope
        return Answered(Outcome(got.requestId, got.workerId, got.incarnationId,
                                None if scope is None
                                else _scope(scope.sessionId, scope.epoch, scope.step),
                                result=raw["result"], checked=True))
    return answer(method, raw)
