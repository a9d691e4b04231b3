"""Typed structures of the domain messages, generated from `schemas/session/methods/` at import
(wire.md §22.3: a compiled decoder that validates while it converts; the schemas stay the one
source).

Why: the compiled Python validator (`bus.schema.compile_schema`) walks a message with one Python
call per keyword; `msgspec.convert` into a `Struct` checks the same shape in one C pass. Each
method's `params`/`result` schema becomes a `msgspec.Struct` type tree:

- a closed object (`additionalProperties: false`) is a `Struct` refusing unknown fields; a
  required property is a required field, any other defaults to `UNSET`;
- `string` with `pattern`/`minLength`/`maxLength`, `integer` and `number` with their bounds,
  `boolean`, `null`, `array` with `items`/`minItems`/`maxItems`, `enum`/`const` of scalars and
  `$ref` map onto the matching annotated types (`$` in a pattern matches only at the very end, as
  `bus.schema` reads it; a number is `int | float`, so the value keeps its JSON type; an integer
  never accepts a bool or a float);
- `anyOf`/`oneOf` whose branches msgspec can tell apart by JSON type (in practice: null or X)
  become a union.

A subschema outside that set (a union of two objects, `uniqueItems`, `if`, `propertyNames`, a
free-form value, ...) stays on the slow path: its field is typed `Any` and the struct's
`__post_init__` runs `bus.schema`'s compiled validator on that field alone. So every rule of the
schema is checked, most of them in C, and nothing is restated by hand.

The input is a value the SDK's strict decode produced (wire.md §3: duplicate keys, non-finite
numbers, depth and integer ranges were refused there), so the conversion adds no second parse.
`check` says only accept or refuse; the wording of a refusal stays the compiled validator's
(`workers.shell.check_params`, `flyd.session.calls`), so messages are as before.
"""

from __future__ import annotations

import functools
import keyword
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Union

import msgspec
import orjson

import schemas as _schemas_package
from bus.schema import Validator, compile_schema
from workers.domain import Scope
from workers.rpc import Answered, Outcome, Refused, Request, answer, holds_bus_key

__all__ = [
    "METHODS",
    "METHOD_SCHEMAS",
    "OUTCOME_SCHEMA",
    "REQUEST_SCHEMA",
    "answer_typed",
    "check",
    "parse_typed",
    "structure",
]

SESSION_SCHEMAS: Final = Path(_schemas_package.__file__).resolve().parent / "session"
METHOD_SCHEMAS: Final = SESSION_SCHEMAS / "methods"
REQUEST_SCHEMA: Final = SESSION_SCHEMAS / "request.json"
OUTCOME_SCHEMA: Final = SESSION_SCHEMAS / "outcome.json"
SCOPES_KEPT: Final = 64
#: the methods with a params schema: only their names ever become a file path
METHODS: Final = frozenset(path.name.removesuffix(".params.json")
                           for path in METHOD_SCHEMAS.glob("*.params.json"))

_ANNOTATIONS: Final = frozenset({"title", "description", "$schema", "$comment", "examples"})
_KIND: Final[dict[str, str]] = {
    "string": "str", "integer": "int", "number": "num", "boolean": "bool", "null": "null",
    "array": "array", "object": "object",
}


class _Unsupported(Exception):
    """A subschema msgspec cannot state exactly: it is checked by the compiled validator."""


def _ecma(pattern: str) -> str:
    """The pattern with every unescaped `$` outside a class as `\\Z` (ASCII classes, as
    `bus.schema` compiles it)."""
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


class _Generator:
    """One schema file's types: `$defs` entries are generated once and shared."""

    def __init__(self, root: Mapping[str, Any], name: str) -> None:
        self.root = root
        self.name = name
        self.defs: dict[str, Any] = dict(root.get("$defs", {}))
        self.done: dict[str, tuple[Any, str]] = {}
        self.busy: set[str] = set()
        self.count = 0
        #: whether some field was left to the compiled validator (typed `Any`)
        self.open = False

    def slow(self, schema: Any) -> Validator:
        return compile_schema({"$defs": self.defs, **schema} if isinstance(schema, dict)
                              else {"$defs": self.defs, "allOf": [schema]})

    def field(self, schema: Any) -> tuple[Any, Validator | None]:
        """A field's type, and the validator to run on it when msgspec cannot state it."""
        try:
            return self.type_of(schema)[0], None
        except _Unsupported:
            self.open = True
            return Any, self.slow(schema)

    def type_of(self, schema: Any) -> tuple[Any, str]:
        """The msgspec type of `schema` and its JSON kind (for telling union branches apart)."""
        if schema is True or schema == {}:
            raise _Unsupported("any value")
        if not isinstance(schema, dict):
            raise _Unsupported("a boolean schema")
        keys = set(schema) - _ANNOTATIONS
        if "$ref" in keys:
            if keys != {"$ref"}:
                raise _Unsupported("$ref beside other keywords")
            return self.ref(str(schema["$ref"]))
        for union in ("anyOf", "oneOf"):
            if union in keys:
                if keys != {union}:
                    raise _Unsupported(f"{union} beside other keywords")
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
        if all(isinstance(v, str) for v in values):
            return Literal[tuple(values)], "str"
        if all(type(v) is int for v in values):
            return Literal[tuple(values)], "int"
        raise _Unsupported("an enum of mixed or non-scalar values")

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
            meta = {"pattern": _ecma(schema["pattern"]) if "pattern" in schema else None,
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

    def struct(self, schema: Mapping[str, Any], keys: set[str]) -> type[msgspec.Struct]:
        if keys - {"type", "properties", "required", "additionalProperties"} \
                or schema.get("additionalProperties") is not False:
            raise _Unsupported("an open object or object keywords")
        required = set(schema.get("required", ()))
        props: dict[str, Any] = schema.get("properties", {})
        if not required <= set(props):
            raise _Unsupported("a required key without a property")
        fields: list[tuple[str, Any, Any]] = []
        rename: dict[str, str] = {}
        slow: list[tuple[str, Validator]] = []
        for index, (wire, sub) in enumerate(props.items()):
            attr = wire if wire.isidentifier() and not keyword.iskeyword(wire) \
                and not wire.startswith("_") else f"f{index}"
            rename[attr] = wire
            kind, check = self.field(sub)
            if check is not None:
                slow.append((attr, check))
            if wire in required:
                fields.append((attr, kind, msgspec.NODEFAULT))
            else:
                fields.append((attr, Union[kind, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007
        self.count += 1
        namespace = {"__post_init__": _post_init(tuple(slow))} if slow else {}
        return msgspec.defstruct(f"{self.name}{self.count}", fields, kw_only=True,
                                 forbid_unknown_fields=True, rename=rename, namespace=namespace)


def _post_init(slow: tuple[tuple[str, Validator], ...]) -> Any:
    """The check of the fields msgspec cannot state; a refusal names the field's path."""

    def post_init(self: msgspec.Struct) -> None:
        for attr, check in slow:
            value = getattr(self, attr)
            if value is not msgspec.UNSET:
                problem = check(value)
                if problem is not None:
                    raise ValueError(problem)

    return post_init


def _load(path: Path) -> dict[str, Any]:
    schema: dict[str, Any] = orjson.loads(path.read_bytes())
    return schema


@functools.cache
def structure(method: str, kind: str) -> Any:
    """The type of `schemas/session/methods/<method>.<kind>.json` (kind `params`|`result`), or
    None when even its root is outside what msgspec states (then `check` is the validator's)."""
    return _typed(method, kind)[0]


def _typed(method: str, kind: str) -> tuple[Any, bool]:
    """(the type or None, whether some field of it is checked by the compiled validator)."""
    schema = _load(METHOD_SCHEMAS / f"{method}.{kind}.json")
    generator = _Generator(schema, method.replace(".", "") + kind.title())
    try:
        made = generator.type_of({k: v for k, v in schema.items() if k != "$defs"})[0]
    except _Unsupported:
        return None, True
    return made, generator.open


@functools.cache
def _slow(method: str, kind: str) -> Validator:
    return compile_schema(_load(METHOD_SCHEMAS / f"{method}.{kind}.json"))


def check(method: str, kind: str, value: Any) -> bool:
    """Whether `value` (a strictly decoded tree) matches the method's `kind` schema."""
    typed = structure(method, kind)
    if typed is None:
        return _slow(method, kind)(value) is None
    try:
        msgspec.convert(value, typed)
    except msgspec.ValidationError:
        return False
    return True


@functools.cache
def _request_type(method: str) -> tuple[Any, bool] | None:
    """The request of `method` as one structure: `requestId` and `scope` as `request.json`
    states them, `params` as the method's params schema; and whether its params hold a field
    typed `Any` (only there can a bus-only key hide: every other object is closed)."""
    params, open_ = _typed(method, "params")
    if params is None:
        return None
    envelope = _Generator(_load(REQUEST_SCHEMA), method.replace(".", "") + "Request")
    request_id = envelope.type_of({"$ref": "#/$defs/RequestId"})[0]
    scope = envelope.type_of({"$ref": "#/$defs/ScopeOrNull"})[0]
    made = msgspec.defstruct(envelope.name, [("requestId", request_id), ("scope", scope),
                                             ("params", params)],
                             kw_only=True, forbid_unknown_fields=True)
    return made, open_


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
    kind, open_ = typed
    try:
        got = msgspec.convert(payload, kind)
    except msgspec.ValidationError:
        return None
    params = payload["params"]
    if open_ and holds_bus_key(params):
        return None
    scope = got.scope
    return Request(got.requestId, None if scope is None
                   else _scope(scope.sessionId, scope.epoch, scope.step), params)


@functools.cache
def _outcome_type(method: str) -> Any:
    """A result outcome of `method` as one structure: the envelope as `outcome.json`'s
    `ResultOutcome` states it, `result` as the method's result schema (None: no structure)."""
    result, _ = _typed(method, "result")
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
