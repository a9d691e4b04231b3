"""The strict JSON codec (bus/codec.py): every refusal, the limits' edges, and round trips."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus import codec
from bus.errors import InvalidEnvelope, ParseError


def refused(data: bytes) -> ParseError:
    with pytest.raises(ParseError) as info:
        codec.decode(data)
    assert info.value.name == "PARSE_ERROR"
    assert info.value.code == -32700
    return info.value


def refused_encode(value: Any, max_bytes: int | None = None) -> InvalidEnvelope:
    with pytest.raises(InvalidEnvelope) as info:
        codec.encode(value, max_bytes)
    assert info.value.name == "INVALID_ENVELOPE"
    assert info.value.dispatch == "not-dispatched"
    return info.value


def nested_arrays(depth: int, filler: bytes = b"") -> bytes:
    return b"[" * depth + filler + b"]" * depth


def nested_objects(depth: int, filler: bytes = b"1") -> bytes:
    return b'{"k":' * depth + filler + b"}" * depth


# --- the required cases -----------------------------------------------------------------------


def test_duplicate_keys_rejected_at_every_depth() -> None:
    assert "duplicate" in refused(b'{"a":1,"a":2}').message
    deep = b'{"x":' * 4 + b'{"a":1,"a":2}' + b"}" * 4
    assert "duplicate" in refused(deep).message
    inside_array = b'[1,[{"x":[{"b":true,"a":null,"b":false}]}]]'
    assert "duplicate" in refused(inside_array).message


def test_non_finite_numbers_rejected() -> None:
    for literal in (b"NaN", b"Infinity", b"-Infinity"):
        assert literal.decode() in refused(literal).message
        assert "non-finite" in refused(b'{"a":[' + literal + b"]}").message
    for big in (b"1e400", b"-1e400", b"1" + b"0" * 400, b'{"a":1.8e308}'):
        assert "infinite" in refused(big).message


def test_invalid_utf8_rejected() -> None:
    for bad in (b"\xff", b"\xc0\x80", b"\xed\xa0\x80"):
        error = refused(b'{"a":"' + bad + b'"}')
        assert "invalid UTF-8 at byte 6" in error.message
    assert "UTF-8" in refused(b'["ok", "\xe2\x82"]').message  # truncated sequence


def test_lone_surrogate_escape_rejected() -> None:
    assert "surrogate" in refused(b'{"a":"\\ud800"}').message
    assert "surrogate" in refused(b'"\\udc00"').message
    assert "surrogate" in refused(b'"\\ud800\\u0041"').message
    assert codec.decode(b'{"a":"\\ud83d\\ude00"}') == {"a": "\U0001f600"}


def test_trailing_and_leading_bytes_rejected() -> None:
    for data in (b"{} ", b" {}", b"{}x", b"{}{}", b"\n[]", b"1\r", b"{}\x00", b"\xef\xbb\xbf{}"):
        refused(data)
    assert "whitespace" in refused(b"{} ").message
    assert "whitespace" in refused(b" {}").message
    assert "empty" in refused(b"").message


def test_depth_limit() -> None:
    assert codec.MAX_DEPTH == 128
    ok = codec.decode(nested_arrays(128))
    for _ in range(127):
        ok = ok[0]
    assert ok == []
    assert "deeper than 128" in refused(nested_arrays(129)).message
    assert codec.decode(nested_objects(128)) is not None
    assert "deeper than 128" in refused(nested_objects(129)).message
    assert "deeper than 128" in refused(nested_arrays(5000)).message  # past orjson's own limit


def test_integer_range() -> None:
    assert (codec.INT_MIN, codec.INT_MAX) == (-(2**63), 2**64 - 1)
    assert codec.decode(b"18446744073709551615") == 2**64 - 1
    assert codec.decode(b"-9223372036854775808") == -(2**63)
    assert codec.decode(b"[18446744073709551615,-9223372036854775808]") == [2**64 - 1, -(2**63)]
    for bad in (b"18446744073709551616", b"-9223372036854775809"):
        assert "outside" in refused(bad).message
        assert "outside" in refused(b"[" + bad + b"]").message
        assert "outside" in refused(b'{"a": ' + bad + b"}").message  # not canonical bytes


def test_encoder_refuses_nan_and_is_compact() -> None:
    assert "nan" in refused_encode({"x": float("nan")}).message
    assert codec.encode({"a": [1, 2]}) == b'{"a":[1,2]}'
    expected = '{"b":1,"a":{"c":null,"d":"é"}}'.encode()
    assert codec.encode({"b": 1, "a": {"c": None, "d": "é"}}) == expected


def json_values(max_leaves: int = 30) -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=codec.INT_MIN, max_value=codec.INT_MAX)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text()
    )
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=5)
        | st.dictionaries(st.text(max_size=8), children, max_size=5),
        max_leaves=max_leaves,
    )


# Recursive JSON values are slow to draw on a loaded machine; the property is the round trip.
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(json_values())
def test_roundtrip_property(value: Any) -> None:
    body = codec.encode(value)
    assert codec.decode(body) == value
    assert codec.encode_trusted(codec.decode(body)) == body
    # another encoder's spelling (spaces, \u escapes, other float forms) decodes to the same value
    foreign = json.dumps(value, ensure_ascii=True, separators=(", ", ": ")).encode()
    assert codec.decode(foreign) == value


# --- further cases ----------------------------------------------------------------------------


def test_raw_control_characters_in_strings_rejected() -> None:
    for char in (b"\x00", b"\x01", b"\t", b"\n", b"\x1f"):
        assert "control character" in refused(b'{"a":"x' + char + b'y"}').message
    assert codec.decode(b'"\\t\\n\\u0000\x7f"') == "\t\n\x00\x7f"  # escaped, and DEL is no control


def test_other_malformed_json_rejected() -> None:
    for data in (b"[1,]", b"{'a':1}", b"01", b"+1", b".5", b"[1 2]", b'{"a"}', b"tru", b'"abc'):
        assert refused(data).message.startswith("invalid JSON")


def test_string_contents_do_not_confuse_duplicate_detection() -> None:
    accepted = [
        b'{"a:b":1,"a":2}',
        b'{"\\"a":1,"a":2}',
        b'{"a\\\\":1,"a":2}',
        b'{"\\u003a":1,"b":":"}',
        b'{"a": "x:y:z", "b": {"c": ":", "d": "\\u003A"}}',
        b'{"k":"\\\\u003a","j":1}',
    ]
    for data in accepted:
        assert codec.decode(data) == json.loads(data)


def test_duplicates_spelled_differently_rejected() -> None:
    for data in (
        b'{"a":1,"\\u0061":2}',
        b'{"\\u003a":1,":":2}',
        b'{"\\/":1,"/":2}',
        b'{"\\ud83d\\ude00":1,"\xf0\x9f\x98\x80":2}',
        # a \u003a colon elsewhere must not hide the member the duplicate dropped
        b'{"a":1,"a":2,"b":"\\u003a"}',
        b'{"a" : 1 , "a" : 2}',
    ):
        assert "duplicate" in refused(data).message


def test_duplicate_key_is_named() -> None:
    assert refused(b'{"x":{"name":1,"name":2}}').message == 'duplicate object key "name"'


def test_long_digit_runs_that_are_not_integers_accepted() -> None:
    data = b'{"id": "123456789012345678901234567890", "f": 1e19, "g": 18446744073709551616.0,' \
        b' "h": 0.12345678901234567890123, "i": 1.5e+300, "j": 2E-400}'
    assert codec.decode(data) == json.loads(data)
    assert codec.decode(b'["1e+19", 1e+19, 5]') == ["1e+19", 1e19, 5]
    assert "outside" in refused(b'["1e+19", 100000000000000000000]').message


def test_depth_limit_on_every_size_path() -> None:
    pad = b'"' + b"p" * 8000 + b'"'  # pushes the body past the bracket-count size
    for make in (nested_arrays, nested_objects):
        assert codec.decode(make(128, pad)) is not None
        assert "deeper" in refused(make(129, pad)).message
        wide = b"[" + b"[0]," * 300 + b"0]"  # two levels, many brackets
        assert codec.decode(make(126, wide)) is not None
        assert "deeper" in refused(make(127, wide)).message
    many_shallow = b"[" + b"[[]]," * 2000 + b"[]]"
    assert len(codec.decode(many_shallow)) == 2001


def test_depth_limit_without_orjson_recursion_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "_WRAP", None)
    pad = b'"' + b"p" * 8000 + b'"'
    assert codec.decode(nested_arrays(128, pad)) is not None
    assert "deeper" in refused(nested_arrays(129, pad)).message


def test_decode_accepts_bytes_like() -> None:
    body = b'{"a":[1,2.5,"x",null,true]}'
    expected = {"a": [1, 2.5, "x", None, True]}
    assert codec.decode(bytearray(body)) == expected
    assert codec.decode(memoryview(body)) == expected
    assert codec.decode(memoryview(b"xx" + body)[2:]) == expected


def test_encoder_refuses_what_decode_refuses() -> None:
    for bad in (float("inf"), -math.inf, [1.0, {"x": (math.nan,)}]):
        assert "non-finite" in refused_encode(bad).message
    for big in (2**64, -(2**63) - 1, {"n": [10**30]}):
        assert "outside" in refused_encode(big).message
    assert "not a string" in refused_encode({1: "x"}).message
    assert "not a string" in refused_encode({"a": {None: 1}}).message
    assert "surrogate" in refused_encode("\ud800").message
    assert "surrogate" in refused_encode({"a": ["ok", "x\udfff"]}).message
    assert "surrogate" in refused_encode({"\ud800": 1}).message
    assert "$.a[1]" in refused_encode({"a": [0, math.nan]}).message


def test_encoder_depth_limit() -> None:
    ok: Any = []
    for _ in range(127):
        ok = [ok]
    assert codec.encode(ok) == nested_arrays(128)
    assert "deeper than 128" in refused_encode([ok]).message
    # orjson does not count tuples towards its recursion limit: the codec must
    deep_tuple: Any = ()
    for _ in range(128):
        deep_tuple = (deep_tuple,)
    assert "deeper than 128" in refused_encode(deep_tuple).message
    deep_dict: Any = 1
    for _ in range(129):
        deep_dict = {"k": deep_dict}
    assert "deeper than 128" in refused_encode(deep_dict).message
    cycle: list[Any] = []
    cycle.append(cycle)
    assert "deeper than 128" in refused_encode(cycle).message


def test_encoder_size_limit() -> None:
    value = {"blob": "x" * 100}
    body = codec.encode(value, max_bytes=111)
    assert len(body) == 111
    error = refused_encode(value, max_bytes=110)
    assert "111 bytes" in error.message and "110" in error.message


def test_encoder_refuses_non_json_types() -> None:
    @dataclasses.dataclass
    class Point:
        x: int

    for value in ({1, 2}, b"bytes", Point(1), datetime.date(2020, 1, 1), object()):
        refused_encode({"v": value})


def test_canonical_sorts_keys_and_is_strict() -> None:
    a = codec.canonical({"b": 1, "a": {"d": [True, None], "c": 1.5}})
    b = codec.canonical({"a": {"c": 1.5, "d": [True, None]}, "b": 1})
    assert a == b == b'{"a":{"c":1.5,"d":[true,null]},"b":1}'
    with pytest.raises(InvalidEnvelope):
        codec.canonical({"x": math.inf})
    with pytest.raises(InvalidEnvelope):
        codec.canonical({2: "x"})


def test_encode_trusted_matches_encode_for_decoded_values() -> None:
    body = b'{"z":1,"a":[1.0,-0.0,"\\u00e9",18446744073709551615,{"q":null}]}'
    value = codec.decode(body)
    assert codec.encode_trusted(value) == codec.encode(value)
    assert codec.encode_trusted(value) == orjson.dumps(value)
    with pytest.raises(InvalidEnvelope):
        codec.encode_trusted({"s": {1, 2}})


def test_null_and_tuples_encode_normally() -> None:
    assert codec.encode([None, "null", (1, (2,))]) == b'[null,"null",[1,[2]]]'
    assert codec.encode(-0.0) == b"-0.0"
    assert codec.decode(codec.encode(-0.0)) == 0.0


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(max_size=4), st.integers(0, 9), min_size=1, max_size=6),
       st.data())
def test_duplicate_detection_property(members: dict[str, int], data: st.DataObject) -> None:
    """Any object with one key repeated (however spelled) is refused; without repeats, accepted."""
    items = [json.dumps(k, ensure_ascii=data.draw(st.booleans())) + ":" + str(v)
             for k, v in members.items()]
    body = ("{" + ",".join(items) + "}").encode()
    assert codec.decode(body) == members
    key = data.draw(st.sampled_from(sorted(members)))
    respelled = json.dumps(key, ensure_ascii=True)
    where = data.draw(st.integers(0, len(items)))
    items.insert(where, respelled + ":" + str(members[key]))
    refused(("{" + ",".join(items) + "}").encode())


def reference_decode(data: bytes) -> Any:
    """The rules written out slowly with the stdlib parser, to check the fast path against."""
    text = data.decode("utf-8")
    if not text or text[0] in " \t\n\r" or text[-1] in " \t\n\r":
        raise ValueError("whitespace around the value")

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        if len({key for key, _ in items}) != len(items):
            raise ValueError("duplicate key")
        return dict(items)

    def parse_int(literal: str) -> int:
        if not codec.INT_MIN <= int(literal) <= codec.INT_MAX:
            raise ValueError("integer out of range")
        return int(literal)

    def parse_float(literal: str) -> float:
        if not math.isfinite(float(literal)):
            raise ValueError("non-finite")
        return float(literal)

    def parse_constant(literal: str) -> Any:
        raise ValueError(literal)

    value = json.loads(text, object_pairs_hook=pairs, parse_int=parse_int,
                       parse_float=parse_float, parse_constant=parse_constant)
    pending = [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, dict | list):
            if depth > codec.MAX_DEPTH:
                raise ValueError("too deep")
            pending += [(key, depth) for key in node if isinstance(node, dict)]
            pending += [(item, depth + 1) for item in (
                node.values() if isinstance(node, dict) else node)]
        elif isinstance(node, str):
            node.encode("utf-8")  # a lone surrogate raises
    return value


TRICKY_SCALARS = [
    '"a"', '"\\u0061"', '"a:b"', '"\\u003a"', '"\\u003A"', '":"', '"\\""', '"\\\\"', '"e+19,"',
    '"\\ud83d\\ude00"', '"\U0001f600"', '"18446744073709551616"', "1", "-0", "1.5", "1e19",
    "1E+19", "9.3e18", "18446744073709551615", "18446744073709551616", "-9223372036854775808",
    "-9223372036854775809", "100000000000000000000", "12345678901234567890.5", "1e400", "null",
]
TRICKY_KEYS = ['"a"', '"\\u0061"', '"a:b"', '"\\u003a"', '":"', '"\\"a"', '"a\\\\"', '"\\/"', '"/"']


@st.composite
def tricky_documents(draw: st.DrawFn, depth: int = 0) -> str:
    kind = draw(st.integers(0, 2 if depth < 4 else 0))
    if kind == 0:
        return draw(st.sampled_from(TRICKY_SCALARS))
    gap = draw(st.sampled_from(["", " "]))
    count = draw(st.integers(0, 4))
    if kind == 1:
        return "[" + f",{gap}".join(draw(tricky_documents(depth + 1)) for _ in range(count)) + "]"
    members = (
        draw(st.sampled_from(TRICKY_KEYS)) + f":{gap}" + draw(tricky_documents(depth + 1))
        for _ in range(count)
    )
    return "{" + f",{gap}".join(members) + "}"


@settings(max_examples=200, deadline=None)
@given(tricky_documents())
def test_decode_agrees_with_slow_reference_property(document: str) -> None:
    data = document.encode()
    try:
        expected = reference_decode(data)
    except ValueError:
        refused(data)
    else:
        assert codec.decode(data) == expected
