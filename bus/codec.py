"""The bus's strict JSON codec.

The router and every SDK must read a frame as the same value, so whatever JSON leaves open is
refused instead of guessed: invalid UTF-8, bytes around the value, duplicate keys, non-finite
numbers, integers outside [-2^63, 2^64-1], lone surrogates, control characters in strings and
nesting deeper than 128. orjson does the parsing and printing, because every frame crosses this
module on the router's hot path; the rules orjson does not enforce itself are proved with a few
C-speed byte operations (an orjson round trip compared with the input, substring counts), and
only a suspicious input pays for a slower, exact look.
"""

from __future__ import annotations

import json
import math
import re
from enum import Enum
from typing import Any, Final

import msgspec
import orjson

from bus.errors import InvalidEnvelope, ParseError
from bus.limits import MAX_JSON_DEPTH

MAX_DEPTH: Final[int] = MAX_JSON_DEPTH
INT_MIN: Final[int] = -(2**63)
INT_MAX: Final[int] = 2**64 - 1

_RANGE_TEXT: Final = "[-2^63, 2^64-1]"
_WHITESPACE: Final = b" \t\n\r"
# A document shorter than this cannot nest deeper than MAX_DEPTH (it needs 2 bytes a level).
_SHALLOW_BYTES: Final = 2 * MAX_DEPTH + 2
# Up to this size brackets are counted outright; above it a find loop stops at MAX_DEPTH + 1.
_COUNT_BYTES: Final = 4096
# Naming the duplicated key re-parses with the stdlib; only small bodies get that courtesy.
_NAME_DUPLICATE_BYTES: Final = 65536
# strict encoders refuse dataclasses and datetimes (orjson would print them as objects/strings)
_ENCODE_OPTIONS: Final = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME

# One JSON string literal, escapes included (the input is already known to be valid JSON).
_STRING: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# An integer literal long enough (19+ digits) to leave the range, once strings are blanked out.
_LONG_INTEGER: Final = re.compile(rb"(?<![0-9.eE+-])-?[0-9]{19,}(?![0-9.eE])")
# How orjson prints, inside an array or object, a float of magnitude >= 1e18 (which is what an
# out-of-range integer literal decodes to): the exponent, then what must come before it.
_BIG_EXPONENT: Final = re.compile(rb"e\+(?:1[89]|[2-9][0-9]|[0-9]{3})(?=[,\]}])")
_MANTISSA: Final = re.compile(rb"[,:\[]-?[0-9](?:\.[0-9]{1,17})?\Z")


def _calibrate() -> tuple[int | None, bool]:
    """Measure the orjson behaviour the fast checks lean on, so an upgrade cannot void them.

    Returns (how many arrays to wrap a value in so that orjson.dumps refuses exactly the depths
    over MAX_DEPTH, or None when orjson has no usable recursion limit; whether orjson prints big
    floats the way _holds_big_float expects).
    """

    def encodes(depth: int) -> bool:
        value: Any = []
        for _ in range(depth - 1):
            value = [value]
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError:
            return False
        return True

    wrap: int | None = None
    if not encodes(MAX_DEPTH):
        raise ImportError(f"orjson cannot encode {MAX_DEPTH} nested arrays")
    if not encodes(1024):
        low, high = MAX_DEPTH, 1024  # encodes(low), not encodes(high)
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if encodes(mid) else (low, mid)
        wrap = low - MAX_DEPTH
    samples = (float(INT_MIN), float(INT_MAX), 1e18, -1.2345678901234567e300, 5e307)
    big_floats_found = all(
        _holds_big_float(orjson.dumps([x])) and _holds_big_float(orjson.dumps({"k": [0, x, 0]}))
        for x in samples
    ) and not _holds_big_float(orjson.dumps([9.99e17, -1e17, 1e-300, "1e+19,"]))
    return wrap, big_floats_found


def _holds_big_float(out: bytes) -> bool:
    """Whether orjson output may hold a float of magnitude >= 1e18 in an array or object."""
    if out.find(b"+") < 0:  # one byte: memchr, far cheaper than a two-byte search
        return False
    for match in _BIG_EXPONENT.finditer(out):
        end = match.start()
        if _MANTISSA.search(out, max(0, end - 21), end):
            return True
    return False


_WRAP, _BIG_FLOATS_FOUND = _calibrate()
_loads: Final = orjson.loads
_dumps: Final = orjson.dumps


# --- decoding ---------------------------------------------------------------------------------


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The one JSON value in `data`; raises ParseError naming the first rule broken."""
    if type(data) is not bytes:
        data = bytes(data)
    if not data:
        raise ParseError("empty body: expected one JSON value")
    if data[0] in _WHITESPACE:
        raise ParseError("whitespace before the JSON value")
    if data[-1] in _WHITESPACE:
        raise ParseError("whitespace after the JSON value")
    try:
        value = _loads(data)
    except orjson.JSONDecodeError as exc:
        raise ParseError(_explain(data, exc)) from None
    kind = type(value)
    if kind is dict or kind is list:
        # _check_tree's common case inlined for the router's small frames: too few brackets to
        # nest past MAX_DEPTH, and exactly the bytes orjson itself writes for the value
        size = len(data)
        shallow = size < _SHALLOW_BYTES or (
            size <= _COUNT_BYTES and data.count(b"[") + data.count(b"{") <= MAX_DEPTH
        )
        if not (shallow and _dumps(value) == data):
            _check_tree(data, value)
    elif kind is float and b"." not in data and b"e" not in data and b"E" not in data:
        # orjson turns an out-of-range integer literal into a float
        raise ParseError(f"integer {_abbreviate(data)} is outside {_RANGE_TEXT}")
    return value


def _check_tree(data: bytes, value: Any) -> None:
    """Depth, duplicate keys and integer range of a decoded object or array.

    orjson has already refused bad UTF-8, NaN/Infinity, infinite numbers, lone surrogates,
    control characters and trailing bytes. Re-encoding the value gives the canonical bytes; when
    the input is exactly those (every frame our own encoder writes), no key was dropped and no
    integer turned into a float, so only depth is left to prove.
    """
    out = _dumps_within_depth(value) if _many_brackets(data) else orjson.dumps(value)
    if out == data:
        return
    if b"{" in data:
        _check_duplicates(data, out)
    # an integer literal out of range decodes to a float beyond 9.2e18; a body with no float
    # that large has none (the exact look blanks strings out, which is slow)
    if not _BIG_FLOATS_FOUND or _holds_big_float(out):
        _check_integer_literals(data)


def _many_brackets(buf: bytes) -> bool:
    """Whether `buf` holds more than MAX_DEPTH '[' and '{' bytes, the least a too-deep value has.

    Brackets inside strings count too, so True only means the depth needs an exact check.
    """
    size = len(buf)
    if size < _SHALLOW_BYTES:
        return False
    if size <= _COUNT_BYTES:
        return buf.count(b"[") + buf.count(b"{") > MAX_DEPTH
    seen = 0  # bytes.count walks every byte; memchr-backed finds can stop early
    for opener in (b"[", b"{"):
        at = buf.find(opener)
        while at >= 0:
            seen += 1
            if seen > MAX_DEPTH:
                return True
            at = buf.find(opener, at + 1)
    return False


def _dumps_within_depth(value: Any) -> bytes:
    """orjson.dumps(value), refusing nesting deeper than MAX_DEPTH.

    orjson refuses to encode past its own recursion limit, so the value is wrapped in just
    enough arrays that the limit falls at MAX_DEPTH: the depth check runs in C.
    """
    wrap = _WRAP
    if wrap is None:
        if _too_deep(value):
            raise ParseError(f"nesting deeper than {MAX_DEPTH}")
        return orjson.dumps(value)
    wrapped = value
    for _ in range(wrap):
        wrapped = [wrapped]
    try:
        out = orjson.dumps(wrapped)
    except orjson.JSONEncodeError:
        raise ParseError(f"nesting deeper than {MAX_DEPTH}") from None
    return out[wrap:-wrap] if wrap else out


def _too_deep(value: Any) -> bool:
    """Whether a decoded value (dicts and lists only) nests deeper than MAX_DEPTH."""
    level = [value]
    depth = 1
    while True:
        level = [
            item
            for node in level
            for item in (node.values() if type(node) is dict else node)
            if type(item) is dict or type(item) is list
        ]
        if not level:
            return False
        depth += 1
        if depth > MAX_DEPTH:
            return True


def _check_duplicates(data: bytes, out: bytes) -> None:
    """Refuse a duplicate key, which orjson silently resolves to the last one.

    Each member costs one ':' in the input and one in the re-encoding `out`, which drops the
    members a duplicate overwrote. Colons inside strings are the same on both sides unless the
    input spells one as an escape (\\u003a), so equal totals prove no member was lost; escapes
    fall back to counting only the colons outside strings.
    """
    if b"\\u003" not in data:
        if data.count(b":") == out.count(b":"):
            return
    elif _STRING.sub(b'""', data).count(b":") == _STRING.sub(b'""', out).count(b":"):
        return
    raise ParseError(_duplicate_message(data))


def _duplicate_message(data: bytes) -> str:
    if len(data) > _NAME_DUPLICATE_BYTES:
        return "duplicate object key"
    found: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in items:
            if key in seen and not found:
                found.append(key)
            seen.add(key)
        return dict(items)

    json.loads(data, object_pairs_hook=pairs)
    if not found:
        return "duplicate object key"
    return f"duplicate object key {_abbreviate(json.dumps(found[0]).encode())}"


def _check_integer_literals(data: bytes) -> None:
    """Refuse an integer literal outside the range (orjson decodes it as a float instead)."""
    for match in _LONG_INTEGER.finditer(_STRING.sub(b'""', data)):
        text = match.group()
        if len(text.lstrip(b"-")) > 20 or not INT_MIN <= int(text) <= INT_MAX:
            raise ParseError(f"integer {_abbreviate(text)} is outside {_RANGE_TEXT}")


def _explain(data: bytes, exc: orjson.JSONDecodeError) -> str:
    """A ParseError message for an orjson refusal, naming the rule where orjson is vague."""
    message = exc.msg
    where = f"line {exc.lineno} column {exc.colno}"
    if "UTF-8" in message:
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            return f"invalid UTF-8 at byte {err.start}: {err.reason}"
        return f"invalid JSON: {message}"
    if "depth limit" in message:
        return f"nesting deeper than {MAX_DEPTH}"
    if "infinity" in message:
        return f"number out of range (decodes to an infinite float) at {where}"
    if "surrogate" in message:
        return f"lone surrogate escape in a string at {where}"
    if "control character" in message:
        return f"raw control character in a string at {where}"
    doc, pos = exc.doc, exc.pos
    for literal in ("NaN", "Infinity"):
        if doc.startswith(literal, pos):
            sign = "-" if pos > 0 and doc[pos - 1] == "-" else ""
            return f"non-finite number {sign}{literal} is not allowed at {where}"
    return f"invalid JSON: {message} at {where}"


def _abbreviate(text: bytes, limit: int = 48) -> str:
    shown = text.decode("utf-8", "replace")
    return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(shown)} chars)"


# --- encoding ---------------------------------------------------------------------------------


def encode(value: Any, max_bytes: int | None = None) -> bytes:
    """Compact UTF-8 JSON for `value`, keys in insertion order.

    Raises InvalidEnvelope (not dispatched) for a non-finite float, an integer outside
    [-2^63, 2^64-1], a non-string key, a lone surrogate, nesting deeper than 128, a type that is
    not JSON data (dataclasses and datetimes included), or a body over `max_bytes`. Tuples encode
    as arrays; orjson.Fragment contents are copied unchecked.
    """
    return _within(_strict_dumps(value, _ENCODE_OPTIONS), max_bytes)


def canonical(value: Any) -> bytes:
    """Like encode but with object keys sorted: the same value always gives the same bytes."""
    return _strict_dumps(value, _ENCODE_OPTIONS | orjson.OPT_SORT_KEYS)


def encode_trusted(value: Any, max_bytes: int | None = None) -> bytes:
    """Compact orjson encoding without the strict checks, for values that came out of decode
    (or hold strictly encoded parts as orjson.Fragment); InvalidEnvelope over `max_bytes`."""
    try:
        out = orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        raise InvalidEnvelope(f"cannot encode: {exc}", "not-dispatched") from None
    return _within(out, max_bytes)


def _within(out: bytes, max_bytes: int | None) -> bytes:
    """`out`, or InvalidEnvelope (not dispatched) when it is over `max_bytes`."""
    if max_bytes is not None and len(out) > max_bytes:
        raise InvalidEnvelope(
            f"encoded body is {len(out)} bytes, over the {max_bytes}-byte limit", "not-dispatched"
        )
    return out


def _strict_dumps(value: Any, option: int) -> bytes:
    """orjson.dumps plus the rules orjson does not enforce (it prints NaN as null, for one)."""
    try:
        out = orjson.dumps(value, option=option)
    except orjson.JSONEncodeError as exc:
        reason = _encode_problem(value, check_strings=True) or str(exc)
        raise InvalidEnvelope(f"cannot encode: {reason}", "not-dispatched") from None
    # orjson prints a non-finite float as null, and does not count tuples towards its recursion
    # limit: only output with a null or many brackets needs a look at the value.
    if (b"null" in out or _many_brackets(out)) and _suspect(value):
        problem = _encode_problem(value, check_strings=False)
        if problem is not None:
            raise InvalidEnvelope(f"cannot encode: {problem}", "not-dispatched")
    return out


_PLAIN: Final = frozenset({str, int, bool, type(None)})


def _suspect(value: Any) -> bool:
    """Whether a value orjson encoded may hold a non-finite float or nest too deep.

    A quick level-by-level pass on exact types; anything unusual (an enum, a subclass) also
    answers True, and _encode_problem then decides exactly.
    """
    level: list[Any] = [(value,)]  # a stand-in array at depth 0 around the value
    depth = 0
    while level:
        deeper: list[Any] = []
        for node in level:
            for item in node.values() if type(node) is dict else node:
                kind = type(item)
                if kind in _PLAIN:
                    continue
                if kind is float:
                    if item - item != 0.0:  # only inf and nan give nan
                        return True
                elif kind is dict or kind is list or kind is tuple:
                    deeper.append(item)
                else:
                    return True
        depth += 1
        if deeper and depth > MAX_DEPTH:
            return True
        level = deeper
    return False


# A location inside a value being encoded: None for the top, else (parent location, key/index).
_Path = tuple["_Path", str | int] | None


def _encode_problem(value: Any, *, check_strings: bool) -> str | None:
    """The first thing in `value` encode must refuse, with where it is; None when there is none.

    orjson already refuses non-string keys, out-of-range integers and lone surrogates; the walk
    repeats those checks only to name the place (check_strings=True, on the error path).
    """
    stack: list[tuple[Any, int, _Path]] = [(value, 0, None)]
    while stack:
        node, depth, path = stack.pop()
        while isinstance(node, Enum):  # orjson encodes an enum member as its value
            node = node.value
        if isinstance(node, str):
            if check_strings and _has_lone_surrogate(node):
                return f"lone surrogate in the string at {_render(path)}"
        elif node is None or isinstance(node, bool):
            continue
        elif isinstance(node, int):
            if not INT_MIN <= node <= INT_MAX:
                return f"integer at {_render(path)} is outside {_RANGE_TEXT}"
        elif isinstance(node, float):
            if not math.isfinite(node):
                return f"non-finite float {node!r} at {_render(path)}"
        elif isinstance(node, dict):
            if depth >= MAX_DEPTH:
                return f"nesting deeper than {MAX_DEPTH} at {_render(path)}"
            for key, item in node.items():
                if not isinstance(key, str):
                    return f"object key {repr(key)[:48]} at {_render(path)} is not a string"
                if check_strings and _has_lone_surrogate(key):
                    return f"lone surrogate in an object key at {_render(path)}"
                stack.append((item, depth + 1, (path, key)))
        elif isinstance(node, (list, tuple)):
            if depth >= MAX_DEPTH:
                return f"nesting deeper than {MAX_DEPTH} at {_render(path)}"
            stack.extend((item, depth + 1, (path, i)) for i, item in enumerate(node))
    return None


def _render(path: _Path) -> str:
    parts: list[str] = []
    while path is not None:
        path, key = path
        if isinstance(key, int):
            parts.append(f"[{key}]")
        elif key.isidentifier():
            parts.append(f".{key}")
        else:
            parts.append(f"[{_abbreviate(orjson.dumps(key.encode('utf-8', 'replace').decode()))}]")
    return "$" + "".join(reversed(parts))


def _has_lone_surrogate(text: str) -> bool:
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


# --- frames that carry a body (design/wire.md §22) ------------------------------------------------


class _BodyMembers(msgspec.Struct):
    payload: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    outcome: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


class _BodyShape(msgspec.Struct):
    params: _BodyMembers | msgspec.UnsetType = msgspec.UNSET


# finds where a frame's body lies; validates the whole frame's syntax while it skips the body
_body_shape: Final = msgspec.json.Decoder(_BodyShape)
_BODY_KEYS: Final = {"payload": re.compile(rb'"payload"[ \t\n\r]*:[ \t\n\r]*'),
                     "outcome": re.compile(rb'"outcome"[ \t\n\r]*:[ \t\n\r]*')}
# a malformed body is looked for after at most this many occurrences of its key
_BODY_CANDIDATES: Final = 4
PLACEHOLDER: Final = b"{}"


class BodyFrame:
    """A frame whose `params` carries a body member (`payload` or `outcome`), read in the
    fast path's split: `msg` is the frame strictly decoded (design/wire.md §3) with that member's
    value replaced by `{}` (when `body` is not None), and `body` the member's wire bytes, untouched.

    `problem` is None when the body is one well-formed JSON object (syntax and UTF-8: what
    the router forwards); else it says why not (the envelope around it is still sound).
    A frame read whole (`body` None) is a frame without the member, or one whose body is not
    an object: its `msg` holds the decoded value as always.
    """

    __slots__ = ("body", "key", "msg", "problem")

    def __init__(self, msg: Any, body: bytes | None, problem: str | None,
                 key: str = "payload") -> None:
        self.msg = msg
        self.body = body
        self.problem = problem
        self.key = key


def decode_body_frame(data: bytes) -> BodyFrame:
    """Read a frame that may carry a body member (`payload`, else `outcome`: design/wire.md §22.1)
    without parsing the body into a value; raises ParseError when the frame around the body
    is not strict JSON.

    The body's bytes are found in one compiled pass over the frame (msgspec validates the
    syntax of what it skips). Only the envelope, with the body replaced by `{}`, goes through
    `decode`: the body's own strictness (duplicate keys, number ranges, depth) is its
    receiver's to check (`decode(body)`). When the body is the last member of `params` and
    `params` the last member of the frame (the SDK and the router write every frame so) the
    split costs one slice; any other member order is still read, whole and strictly.
    """
    try:
        shape = _body_shape.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _malformed_body_frame(data)
    members = shape.params
    if members is msgspec.UNSET:
        return BodyFrame(decode(data), None, None)
    key = "payload"
    raw = members.payload
    if raw is msgspec.UNSET:
        key = "outcome"
        raw = members.outcome
        if raw is msgspec.UNSET:
            return BodyFrame(decode(data), None, None)
    body = bytes(raw)
    if body[:1] != b"{":  # the op's schema refuses it, naming the member
        return BodyFrame(decode(data), None, None)
    end = len(data) - 2
    start = end - len(body)
    if data.endswith(b"}}") and data.startswith(body, start) and data[start - 1:start] == b":":
        msg = decode(data[:start] + PLACEHOLDER + data[end:])
    else:
        msg = decode(data)
    return BodyFrame(msg, body, None if body.isascii() else _utf8_problem(body), key)


def body_bytes(data: bytes, key: str) -> bytes | None:
    """The wire bytes of the body member `params.<key>` of a well-formed frame, found by the
    compiled pass without building a value; None when it has none."""
    try:
        shape = _body_shape.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    members = shape.params
    if members is msgspec.UNSET:
        return None
    raw = getattr(members, key, msgspec.UNSET)
    return None if raw is msgspec.UNSET else bytes(raw)


def _utf8_problem(body: bytes) -> str | None:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as err:
        return f"invalid UTF-8 at byte {err.start}: {err.reason}"
    return None


def _malformed_body_frame(data: bytes) -> BodyFrame:
    """The frame is not well-formed JSON. When the fault lies inside the body alone (the body
    last, as the SDK writes it, and the envelope around it strict), the frame is sound and only
    the body is refused; otherwise the frame is malformed (ParseError, as `decode` words it)."""
    try:
        return BodyFrame(decode(data), None, None)
    except ParseError as exc:
        failure = exc
    if not data.endswith(b"}}"):
        raise failure
    for key, pattern in _BODY_KEYS.items():
        for n, match in enumerate(pattern.finditer(data)):
            if n == _BODY_CANDIDATES:
                break
            start = match.end()
            try:
                msg = decode(data[:start] + PLACEHOLDER + data[-2:])
            except ParseError:
                continue
            params = msg.get("params") if type(msg) is dict else None
            if type(params) is dict and params.get(key) == {}:
                body = data[start:-2]
                return BodyFrame(msg, body, body_problem(body) or "not one JSON value", key)
    raise failure


def body_problem(body: bytes) -> str | None:
    """Why `body` is not one well-formed JSON value (syntax, UTF-8), or None when it is: the
    check the router makes on a body it forwards (design/wire.md §22.1), not design/wire.md §3's
    strictness."""
    try:
        _any_raw.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return f"not one JSON value: {exc}"
    except RecursionError:
        return "not one JSON value: nested too deep to read"
    return None if body.isascii() else _utf8_problem(body)


_any_raw: Final = msgspec.json.Decoder(msgspec.Raw)
