"""Canonical JSON and digests (design/session.md §1.5, design/state.md §1).

Digests name bodies, contexts, controls and checkpoints across processes and releases, so one
JSON value must have exactly one byte form. The form is RFC 8785 compatible:

1. Objects: members sorted by key, keys compared as UTF-16 code units (`key.encode("utf-16-be")`);
   keys must be strings.
2. No whitespace; separators `,` and `:`; no trailing newline.
3. Strings: `"` and `\\` escaped; U+0008 `\\b`, U+0009 `\\t`, U+000A `\\n`, U+000C `\\f`, U+000D
   `\\r`; every other code point below U+0020 as `\\u00xx` (lowercase hex); everything else
   literal UTF-8; a surrogate code point (a lone surrogate) is refused.
4. `true`, `false`, `null`; a Python `bool` is never a number.
5. Numbers: NaN/±Infinity refused. An integral value (an int, or a float such as `100.0`) must
   satisfy |v| <= 2^53-1 and is written as a decimal integer (`-0.0` -> `0`). Any other float is
   written as ECMAScript `Number.prototype.toString` does, from the shortest round-trip digits
   that Python's `repr` supplies.

Values are dicts (any `Mapping` with str keys), lists/tuples, str, int, float, bool and None;
an object with a `to_json()` method (the frozen dataclasses of `workers.types.datatypes`, `Scope`,
`RationalNs`) is written as what that method returns. Nesting deeper than 128 is refused, as
the strict parser refuses it. Every refusal is `DomainError` `INVALID_ARGUMENT`/`none`.

`parse_strict(bytes)` is the matching strict reader (design/state.md §1): valid UTF-8 without a BOM,
no duplicate keys at any depth, no NaN/Infinity, no lone surrogate escapes, depth <= 128,
nothing after the value. "Canonical bytes" are bytes `b` with `canonical(parse_strict(b)) == b`.

Digests are lowercase hex SHA-256: `digest_of(v)` of canonical bytes, `digest_bytes(b)` of raw
bytes, `body_digest(method, scope, params)` of `{"method", "scope", "params"}`,
`typed_digest(tv)` of `{"schema", "value"}`, `controls_digest(cs)` of the control list in
descriptor port order. `typed_canonical(schema_bytes, value)` writes `{"schema", "value"}` with
the schema reference's bytes given (a `TypedValue` remembers them per reference).

Speed: `canonical` first rewrites the value into a tree orjson writes byte-for-byte in this form
(`_fast_tree`: `to_json` applied, every float replaced by an `orjson.Fragment` of its
`format_number` spelling) and lets orjson (`OPT_SORT_KEYS | OPT_STRICT_INTEGER`) write it:
orjson escapes strings exactly as rule 3 does, refuses lone surrogates, non-str keys and integers
outside ±(2^53-1), and sorts keys by code point, which is UTF-16 order unless a key holds a
supplementary-plane character. Anything else — such a key, a subclass of a JSON type, a value
orjson or the rules refuse, nesting within 8 levels of `MAX_DEPTH` — goes to `_canonical_slow`,
the reference writer, which produces the bytes or the refusal. tests/session/test_canonical_fast.py
checks both against the original writer, kept there verbatim as the oracle.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring
from typing import Any, Final

import orjson

from workers.types.domain import DomainError, Scope, short

__all__ = [
    "MAX_DEPTH",
    "MAX_SAFE_INTEGER",
    "body_digest",
    "canonical",
    "canonical_size",
    "controls_digest",
    "digest_bytes",
    "digest_of",
    "format_number",
    "is_canonical",
    "parse_strict",
    "plain",
    "typed_canonical",
    "typed_digest",
]

MAX_SAFE_INTEGER: Final = 2**53 - 1
MAX_DEPTH: Final = 128
_BOM: Final = b"\xef\xbb\xbf"


def _refuse(message: str) -> DomainError:
    return DomainError.invalid(f"canonical JSON: {message}")


def format_number(value: int | float) -> str:
    """The canonical spelling of a JSON number (rule 5)."""
    if isinstance(value, bool):
        raise _refuse("a boolean is not a number")
    if isinstance(value, int):
        if abs(value) > MAX_SAFE_INTEGER:
            raise _refuse(f"the integer {value} lies outside ±(2^53-1)")
        return str(value)
    if not math.isfinite(value):
        raise _refuse(f"{value} is not a finite number")
    if value.is_integer():
        if abs(value) > MAX_SAFE_INTEGER:
            raise _refuse(f"the integral value {value!r} lies outside ±(2^53-1)")
        return str(int(value))
    text = repr(value)
    if "e" not in text:
        # repr's fixed notation (1e-4 <= |value| < 1e16) places the shortest digits as
        # ECMAScript does for a non-integral value in 1e-6 <= |value| < 1e21
        return text
    sign = "-" if value < 0 else ""
    mantissa, _, exponent_text = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
    # value = 0.<digits> × 10^n before stripping leading zeros from the digits
    n = len(whole) + int(exponent_text or 0)
    stripped = digits.lstrip("0")
    n -= len(digits) - len(stripped)
    digits = stripped.rstrip("0")
    k = len(digits)
    if 0 < n <= 21:
        if k <= n:
            return sign + digits + "0" * (n - k)
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * -n + digits
    exponent = n - 1
    head = digits[0] + ("." + digits[1:] if k > 1 else "")
    return f"{sign}{head}e{'+' if exponent >= 0 else '-'}{abs(exponent)}"


def _string(value: str) -> str:
    # json.dumps(ensure_ascii=False) escapes exactly rule 3's set, with lowercase hex; for a str
    # it is `encode_basestring`. A strict UTF-8 encode fails at the first surrogate code point.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _refuse(f"lone surrogate U+{ord(value[exc.start]):04X} in a string") from None
    return encode_basestring(value)


def _key(key: str) -> bytes:
    return key.encode("utf-16-be")


def _write(value: Any, out: list[str], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _refuse(f"nesting deeper than {MAX_DEPTH}")
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, int | float):
        out.append(format_number(value))
    elif isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise _refuse(f"object key {short(key)} is not a string")
            _string(key)  # refuses lone surrogates before utf-16 sorting would
        out.append("{")
        for index, key in enumerate(sorted(value, key=_key)):
            if index:
                out.append(",")
            out.append(_string(key))
            out.append(":")
            _write(value[key], out, depth + 1)
        out.append("}")
    elif isinstance(value, list | tuple):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _write(item, out, depth + 1)
        out.append("]")
    elif callable(getattr(value, "to_json", None)):
        _write(value.to_json(), out, depth)
    else:
        raise _refuse(f"{type(value).__name__} is not a JSON value")


def _canonical_slow(value: Any) -> bytes:
    out: list[str] = []
    _write(value, out, 1)
    return "".join(out).encode("utf-8")


_FAST_OPTIONS: Final = orjson.OPT_SORT_KEYS | orjson.OPT_STRICT_INTEGER
# The fast writer hands anything this deep to the reference writer, which words the depth
# refusal; below it, no value it builds is deeper than MAX_DEPTH.
_FAST_DEPTH: Final = MAX_DEPTH - 8
_LEAVES: Final[frozenset[type]] = frozenset({str, int, bool, type(None)})
_BMP_END: Final = "\uffff"


class _Fallback(Exception):
    """The fast writer cannot vouch for this value; `_canonical_slow` decides."""


def _fast_keys(value: Mapping[Any, Any]) -> None:
    # str.join refuses non-str keys; code point order is UTF-16 order without astral keys.
    keys = "".join(value)
    if not keys.isascii() and max(keys) > _BMP_END:
        raise _Fallback


def _fast_tree(value: Any, depth: int) -> Any:
    """`value` as dict/list/str/int/bool/None/Fragment that orjson writes canonically.

    Exact `str`, `int`, `bool` and `None` are kept as they are (children are tested inline);
    a float becomes a Fragment of its `format_number` spelling; `to_json` is applied."""
    if depth > _FAST_DEPTH:
        raise _Fallback
    kind = type(value)
    if kind in _LEAVES:
        return value
    below = depth + 1
    if kind is dict:
        if value:
            keys = "".join(value)  # as _fast_keys, inline: most values are dicts
            if not keys.isascii() and max(keys) > _BMP_END:
                raise _Fallback
        return {key: item if type(item) in _LEAVES else _fast_tree(item, below)
                for key, item in value.items()}
    if kind is list or kind is tuple:
        return [item if type(item) in _LEAVES else _fast_tree(item, below) for item in value]
    if kind is float:
        return orjson.Fragment(format_number(value))
    if isinstance(value, str | int | float | list | tuple):
        raise _Fallback  # a subclass: the reference writer's spelling applies
    if isinstance(value, Mapping):
        _fast_keys(value)
        return {key: _fast_tree(value[key], below) for key in value}
    to_json = getattr(value, "to_json", None)
    if callable(to_json):
        return _fast_tree(to_json(), depth)
    raise _Fallback


def canonical(value: Any) -> bytes:
    """The canonical UTF-8 bytes of a JSON value."""
    try:
        return orjson.dumps(_fast_tree(value, 1), option=_FAST_OPTIONS)
    except Exception:
        # a refusal, or a value outside the fast path: the reference writer decides
        return _canonical_slow(value)


def typed_canonical(schema: bytes, value: Any) -> bytes:
    """`canonical({"schema": s, "value": value})` given `schema` = `canonical(s)`, so that a
    schema reference used by many values is written once: the two members in key order, the
    value written (or refused) at depth 2 exactly as the whole object's writer would."""
    try:
        data = orjson.dumps(_fast_tree(value, 2), option=_FAST_OPTIONS)
    except Exception:
        out: list[str] = []
        _write(value, out, 2)
        data = "".join(out).encode("utf-8")
    return b'{"schema":' + schema + b',"value":' + data + b"}"


def plain(value: Any) -> Any:
    """The value as plain JSON (dicts, lists, str, int, float, bool, None), `to_json` applied."""
    return json.loads(canonical(value))


def canonical_size(value: Any) -> int:
    return len(canonical(value))


# --------------------------------------------------------------------------------------------
# Strict parsing


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, item in pairs:
        if key in result:
            raise _refuse(f"duplicate key {short(key)}")
        result[key] = item
    return result


def _no_constant(name: str) -> Any:
    raise _refuse(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise _refuse(f"{short(text)} overflows to infinity")
    return number


def _check_parsed(value: Any, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise _refuse(f"nesting deeper than {MAX_DEPTH}")
    if isinstance(value, str):
        _string(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _string(key)
            _check_parsed(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_parsed(item, depth + 1)


def parse_strict(data: bytes | bytearray | memoryview) -> Any:
    """Read JSON bytes, refusing everything JSON leaves open (see the module docstring)."""
    raw = bytes(data)
    if raw.startswith(_BOM):
        raise _refuse("a byte order mark is not allowed")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _refuse(f"invalid UTF-8 at byte {exc.start}") from None
    try:
        value = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constant,
            parse_float=_finite_float,
        )
    except RecursionError:
        raise _refuse(f"nesting deeper than {MAX_DEPTH}") from None
    except json.JSONDecodeError as exc:
        raise _refuse(f"not JSON: {exc.msg} at character {exc.pos}") from None
    except ValueError as exc:  # e.g. an integer literal beyond the interpreter's digit limit
        raise _refuse(f"not JSON: {exc}") from None
    _check_parsed(value, 1)
    return value


def is_canonical(data: bytes | bytearray | memoryview) -> bool:
    raw = bytes(data)
    try:
        return canonical(parse_strict(raw)) == raw
    except DomainError:
        return False


# --------------------------------------------------------------------------------------------
# Digests


def digest_bytes(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_of(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def body_digest(method: str, scope: Scope | Mapping[str, Any] | None, params: Any) -> str:
    """What the result cache compares: a re-sent request must have this digest unchanged."""
    return digest_of({"method": method, "scope": scope, "params": params})


def typed_digest(typed_value: Any) -> str:
    """`digest_of({"schema", "value"})` of a `TypedValue` (or its JSON object); a `TypedValue`
    hashes the canonical bytes it computed on construction."""
    cached = getattr(typed_value, "canonical_bytes", None)
    if cached is not None:
        return digest_bytes(cached())
    if isinstance(typed_value, Mapping):
        if set(typed_value) != {"schema", "value"}:
            raise _refuse("a TypedValue has exactly the keys schema and value")
        return digest_of({"schema": typed_value["schema"], "value": typed_value["value"]})
    return digest_of({"schema": typed_value.schema, "value": typed_value.value})


def controls_digest(controls: Sequence[Any]) -> str:
    """`digest_of([PortControl, …])`; the caller keeps descriptor port order."""
    return digest_of(list(controls))
