"""The fast paths of workers/ against the reference implementations they replaced.

`canonical` writes through orjson, `TypedValue` measures itself without `plain`'s round trip,
`decode_audio` checks finiteness with one sum, `decode_media` re-encodes only the last base64
group, the synthetic triangle memoises its frames and `render_frame` fills a cached template.
The oracles below are the replaced code, verbatim (the canonical writer as it stood before
orjson: `json.dumps` per string, a per-character surrogate scan); every fast path must give the
same bytes, or the same refusal with the same words.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import json
import math
import random
import struct
from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from workers.synthetic.audio import AMPLITUDE, BASE_HZ, SAMPLE_RATE, STEP_HZ, TriangleSource
from workers.synthetic.frame import render_frame
from workers.types.canonical import MAX_DEPTH, MAX_SAFE_INTEGER, canonical, format_number
from workers.types.datatypes import (
    AUDIO_CONTENT_TYPE,
    MAX_TYPED_VALUE_BYTES,
    AudioDescriptor,
    AudioRef,
    MediaBlob,
    SchemaRef,
    TypedValue,
    decode_audio,
    decode_media,
    encode_media,
)
from workers.types.domain import DomainError, short

# --------------------------------------------------------------------------------------------
# the reference canonical writer (workers/types/canonical.py before the orjson path), verbatim


def _refuse(message: str) -> DomainError:
    return DomainError.invalid(f"canonical JSON: {message}")


def reference_number(value: int | float) -> str:
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
    sign = "-" if value < 0 else ""
    mantissa, _, exponent_text = repr(abs(value)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = whole + fraction
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
    for char in value:
        if "\ud800" <= char <= "\udfff":
            raise _refuse(f"lone surrogate U+{ord(char):04X} in a string")
    return json.dumps(value, ensure_ascii=False)


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
        out.append(reference_number(value))
    elif isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise _refuse(f"object key {short(key)} is not a string")
            _string(key)
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


def oracle(value: Any) -> bytes:
    out: list[str] = []
    _write(value, out, 1)
    return "".join(out).encode("utf-8")


def outcome(fn: Callable[[Any], Any], value: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(value)
    except DomainError as exc:
        return "refused", (exc.code, exc.message)


# --------------------------------------------------------------------------------------------
# values

# a loaded CI machine must not turn generation time into a failure
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much]


class Wrapped:
    """A `to_json` object, as the frozen dataclasses are."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def to_json(self) -> Any:
        return self.inner

    def __repr__(self) -> str:
        return f"Wrapped({self.inner!r})"


class Text(str):
    pass


class Whole(int):
    pass


class Opaque:
    pass


_SPECIAL_CHARS = "\x00\x01\x08\t\n\x0b\x0c\r\x1f \"\\/\x7f\x80\u2028\u2029\ud7ff\ud800\udbff" \
    "\udc00\udfff\ue000\uffef\ufeff\uffff\U00010000\U0001f600\U0010ffff"
_chars = st.one_of(st.characters(), st.sampled_from(_SPECIAL_CHARS))
_text = st.text(_chars, max_size=12)
_keys = st.one_of(_text, st.sampled_from(["a", "b", "ab", "\ue000", "\U00010000", "\uffff",
                                          "\U0001f600x", "a\ue000", "a\U00010000"]))
_ints = st.one_of(
    st.integers(),
    st.sampled_from([0, 1, -1, MAX_SAFE_INTEGER, -MAX_SAFE_INTEGER, MAX_SAFE_INTEGER + 1,
                     -MAX_SAFE_INTEGER - 1, 2**63, -(2**63), 2**64]),
)
_floats = st.one_of(
    st.floats(),
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 100.0, 0.1, 1e21, 1e-7, 1.5e-6, 123456789012345680.0,
                     float(MAX_SAFE_INTEGER), float(2**53), 5e-324, 1.7976931348623157e308,
                     math.nan, math.inf, -math.inf]),
)
_scalars = st.one_of(
    st.none(), st.booleans(), _ints, _floats, _text,
    st.builds(Text, _text), st.builds(Whole, st.integers(-5, 5)), st.builds(Opaque),
)


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=5),
        st.lists(children, max_size=5).map(tuple),
        st.dictionaries(_keys, children, max_size=5),
        st.dictionaries(_keys, children, max_size=3).map(MappingProxyType),
        st.dictionaries(st.one_of(_keys, st.integers(), st.none()), children, max_size=3),
        st.builds(Wrapped, children),
    )


json_values = st.recursive(_scalars, _containers, max_leaves=30)
# values the rules accept (no surrogates, finite numbers, exact types): the byte-writing path
_valid_text = st.text(st.characters(exclude_categories=["Cs"]), max_size=12)
valid_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-MAX_SAFE_INTEGER, MAX_SAFE_INTEGER),
              st.floats(allow_nan=False, allow_infinity=False, min_value=-1e300, max_value=1e300)
              .filter(lambda x: not x.is_integer() or abs(x) <= MAX_SAFE_INTEGER),
              _valid_text),
    lambda children: st.one_of(
        st.lists(children, max_size=5),
        st.lists(children, max_size=5).map(tuple),
        st.dictionaries(st.one_of(_valid_text, st.sampled_from(["\ue000", "\U00010000", "a"])),
                        children, max_size=5),
        st.builds(Wrapped, children),
    ),
    max_leaves=30,
)


def nested(depth: int, leaf: Any = 0) -> Any:
    value: Any = leaf
    for i in range(depth - 1):
        value = [value] if i % 2 else {"k": value}
    return value


# --------------------------------------------------------------------------------------------
# canonical


@pytest.mark.timeout(300)
@settings(max_examples=400, deadline=None, suppress_health_check=_SLOW_OK)
@given(valid_values)
def test_canonical_writes_the_reference_bytes(value: Any) -> None:
    assert canonical(value) == oracle(value)


@pytest.mark.timeout(300)
@settings(max_examples=400, deadline=None, suppress_health_check=_SLOW_OK)
@given(json_values)
@example({"\ue000": 1, "\U00010000": 2})
@example({"b": 1.5, "a": [True, None, -0.0, 1e21, 1e-7]})
@example({"k": "\ud800"})
@example({"\udfff": 1, 3: 2})
@example([MAX_SAFE_INTEGER + 1, math.nan])
def test_canonical_matches_the_reference_writer(value: Any) -> None:
    assert outcome(canonical, value) == outcome(oracle, value)


@pytest.mark.parametrize("depth", [1, 2, MAX_DEPTH - 9, MAX_DEPTH - 8, MAX_DEPTH - 7, MAX_DEPTH - 1,
                                   MAX_DEPTH, MAX_DEPTH + 1, MAX_DEPTH + 5])
@pytest.mark.parametrize("leaf", [0, "x", 1.5, [], {}, math.inf, Wrapped(2)])
def test_canonical_matches_the_reference_writer_at_every_depth(depth: int, leaf: Any) -> None:
    value = nested(depth, leaf)
    assert outcome(canonical, value) == outcome(oracle, value)
    assert outcome(canonical, [value, math.nan]) == outcome(oracle, [value, math.nan])


@settings(max_examples=3000, deadline=None, suppress_health_check=_SLOW_OK)
@given(st.one_of(st.floats(), st.integers(), _floats,
                 st.floats(min_value=1e-8, max_value=1e-3),
                 st.floats(min_value=1e14, max_value=1e23),
                 st.floats(min_value=-1e23, max_value=-1e14)))
@example(1e-4)
@example(9.999999999999999e-05)
@example(1e16 + 2.0)
@example(1234567890123456.8)
@example(-0.0001)
def test_format_number_matches_the_reference(value: float) -> None:
    assert outcome(format_number, value) == outcome(reference_number, value)


def test_canonical_escapes_every_code_point_as_the_reference_writer() -> None:
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    text = "".join(chars)
    assert canonical(text) == oracle(text)
    assert canonical({c: 0 for c in chars[:0x3000]}) == oracle({c: 0 for c in chars[:0x3000]})


def test_canonical_of_long_media_strings_matches() -> None:
    rng = random.Random(7)
    blob = encode_media(AUDIO_CONTENT_TYPE, rng.randbytes(6400))
    value = {"method": "Agent.Commit", "scope": None, "params": {"samples": blob, "n": 3}}
    assert canonical(value) == oracle(value)


# --------------------------------------------------------------------------------------------
# TypedValue's size


SCHEMA = SchemaRef("test.schema", 1, "0" * 64)


def reference_typed_value(value: Any) -> tuple[str, Any]:
    """The original `TypedValue.__post_init__`: canonical_size of {schema, plain(value)}."""
    try:
        plain = json.loads(oracle(value))
        size = len(oracle({"schema": SCHEMA.to_json(), "value": plain}))
    except DomainError as exc:
        return "refused", (exc.code, exc.message)
    if size > MAX_TYPED_VALUE_BYTES:
        return "refused", ("INVALID_ARGUMENT",
                           f"a TypedValue of schema {SCHEMA.id} has {size} canonical bytes; "
                           f"at most {MAX_TYPED_VALUE_BYTES}")
    return "ok", oracle({"schema": SCHEMA.to_json(), "value": plain})


def typed_value(value: Any) -> tuple[str, Any]:
    try:
        typed = TypedValue(SCHEMA, value)
    except DomainError as exc:
        return "refused", (str(exc.code), exc.message)
    return "ok", canonical(typed)


@pytest.mark.timeout(300)
@settings(max_examples=300, deadline=None, suppress_health_check=_SLOW_OK)
@given(st.one_of(json_values, valid_values))
@example("x" * (MAX_TYPED_VALUE_BYTES - 120))
@example("x" * MAX_TYPED_VALUE_BYTES)
@example([nested(MAX_DEPTH - 1), math.nan])
@example([nested(MAX_DEPTH), math.nan])
@example(nested(MAX_DEPTH))
def test_typed_value_measures_and_refuses_as_before(value: Any) -> None:
    want = reference_typed_value(value)
    got = typed_value(value)
    if want[0] == "refused":
        assert got[0] == "refused"
        assert (str(got[1][0]), got[1][1]) == (str(want[1][0]), want[1][1])
    else:
        assert got == want


def test_typed_value_size_boundary() -> None:
    overhead = len(canonical({"schema": SCHEMA, "value": ""}))
    TypedValue(SCHEMA, "x" * (MAX_TYPED_VALUE_BYTES - overhead))
    with pytest.raises(DomainError, match="canonical bytes"):
        TypedValue(SCHEMA, "x" * (MAX_TYPED_VALUE_BYTES - overhead + 1))


# --------------------------------------------------------------------------------------------
# audio finiteness


DESCRIPTOR = AudioDescriptor("s", 48000, 2)
_F32_BITS = struct.Struct("<I")


def chunk_of(words: list[int]) -> AudioRef:
    data = b"".join(_F32_BITS.pack(w) for w in words)
    return AudioRef("s", 0, len(words) // 2, encode_media(AUDIO_CONTENT_TYPE, data), False)


def finite_reference(words: list[int]) -> bool:
    data = b"".join(_F32_BITS.pack(w) for w in words)
    return all(math.isfinite(x) for (x,) in struct.iter_unpack("<f", data))


_words = st.one_of(
    st.integers(0, 2**32 - 1),
    st.sampled_from([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7F7FFFFF,
                     0xFF7FFFFF, 0x00000001, 0x80000000, 0x3E800000]),
)


@pytest.mark.timeout(300)
@settings(max_examples=300, deadline=None, suppress_health_check=_SLOW_OK)
@given(st.lists(_words, max_size=40).filter(lambda w: len(w) % 2 == 0))
@example([0x7F7FFFFF] * 4000)  # the largest finite samples: their sum stays finite
@example([0x7F7FFFFF, 0x7F800000])
@example([0x7F800000, 0xFF800000])  # inf + -inf
def test_decode_audio_refuses_exactly_the_non_finite_chunks(words: list[int]) -> None:
    ref = chunk_of(words)
    if finite_reference(words):
        assert decode_audio(ref, DESCRIPTOR) == b"".join(_F32_BITS.pack(w) for w in words)
    else:
        with pytest.raises(DomainError, match="holds a sample that is not finite"):
            decode_audio(ref, DESCRIPTOR)


# --------------------------------------------------------------------------------------------
# the synthetic arena's media (workers/synthetic before memoising), verbatim

_F32 = struct.Struct("<f")


def f32(x: float) -> float:
    result: float = _F32.unpack(_F32.pack(x))[0]
    return result


class ReferenceTriangle:
    def __init__(self, phase: int = 0) -> None:
        self.phase = phase

    def chunk(self, counter: int, frames: int, channels: int = 2) -> bytes:
        increment = BASE_HZ + (counter % 8) * STEP_HZ
        rate = f32(float(SAMPLE_RATE))
        out = bytearray()
        phase = self.phase
        for _ in range(frames):
            phase = (phase + increment) % SAMPLE_RATE
            p = f32(f32(float(phase)) / rate)
            v = f32(1.0 - f32(2.0 * abs(f32(f32(2.0 * p) - 1.0))))
            scaled = f32(v * AMPLITUDE)
            for c in range(channels):
                out += _F32.pack(f32(scaled / (c + 1)))
        self.phase = phase
        return bytes(out)


def reference_frame(counter: int, boundary: int, width: int = 32, height: int = 24) -> bytes:
    red = counter & 0xFF
    marker = boundary % width
    greens = [x * 255 // (width - 1) if width > 1 else 0 for x in range(width)]
    out = bytearray()
    for y in range(height):
        blue = y * 255 // (height - 1) if height > 1 else 0
        for x in range(width):
            out += bytes((red, greens[x], 255 if x == marker else blue, 255))
    return bytes(out)


def _chunks(seed: int) -> Iterator[tuple[int, int, int]]:
    rng = random.Random(seed)
    for _ in range(400):
        yield (rng.randrange(-40, 40), rng.choice([0, 1, 2, 799, 800, 801, 1601, 4000]),
               rng.choice([1, 2, 2, 3, 8]))


@pytest.mark.parametrize("start", [0, 1, 47999, 12345])
def test_triangle_chunks_are_the_reference_bytes(start: int) -> None:
    fast, slow = TriangleSource(start), ReferenceTriangle(start)
    for counter, frames, channels in _chunks(start):
        assert fast.chunk(counter, frames, channels) == slow.chunk(counter, frames, channels)
        assert fast.phase == slow.phase


def test_frames_are_the_reference_bytes() -> None:
    for width in range(1, 9):
        for height in range(1, 6):
            for counter in (-300, -1, 0, 5, 255, 256, 1000):
                for boundary in range(0, 20):
                    assert render_frame(counter, boundary, width, height) == \
                        reference_frame(counter, boundary, width, height)
    for counter in range(-3, 300):
        for boundary in (0, 7, 31, 32, 39, 10**9):
            assert render_frame(counter, boundary) == reference_frame(counter, boundary)


# --------------------------------------------------------------------------------------------
# decode_media: the whole-text re-encoding it replaced, verbatim


def reference_decode_media(blob: MediaBlob, content_type: str, name: str) -> bytes:
    if blob.content_type != content_type:
        raise DomainError("BUFFER_INVALID", f"{name} has content type "
                          f"{short(blob.content_type)}; expected {content_type}", "none")
    try:
        data = base64.b64decode(blob.data, validate=True)
    except (binascii.Error, ValueError):
        raise DomainError("BUFFER_INVALID", f"{name} is not valid base64", "none") from None
    if base64.b64encode(data).decode("ascii") != blob.data:
        raise DomainError("BUFFER_INVALID", f"{name} is not canonical padded base64", "none")
    if len(data) != blob.byte_length:
        raise DomainError("BUFFER_INVALID", f"{name} decodes to {len(data)} bytes; byteLength "
                          f"says {blob.byte_length}", "none")
    if hashlib.sha256(data).hexdigest() != blob.digest:
        raise DomainError("BUFFER_INVALID", f"{name} does not match its digest", "none")
    return data


def _texts() -> Iterator[str]:
    """Every text of up to 5 characters over an alphabet with each kind of trouble (a bit the
    last group must not set, padding, a line break, non-ASCII), and longer random ones."""
    alphabet = "AQB/=+gw\n\u00e9"
    for length in range(6):
        for chars in itertools.product(alphabet, repeat=length):
            yield "".join(chars)
    rng = random.Random(192)
    for _ in range(20000):
        yield "".join(rng.choice(alphabet) for _ in range(rng.randrange(6, 14)))
    for size in range(1, 40):
        text = base64.b64encode(rng.randbytes(size)).decode("ascii")
        yield text
        yield text[:-1] + "B"
        yield text.rstrip("=")


def test_decode_media_refuses_exactly_as_the_whole_re_encoding() -> None:
    for text in _texts():
        try:
            expected = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            expected = b""
        blob = MediaBlob("image/x-rgba8", len(expected), hashlib.sha256(expected).hexdigest(),
                         text)
        assert outcome(lambda b: decode_media(b, "image/x-rgba8", "view v"), blob) == \
            outcome(lambda b: reference_decode_media(b, "image/x-rgba8", "view v"), blob), text
