"""The domain request and outcome envelopes as JSON Schemas (schemas/session/, Draft 2020-12).

The spec's §1 examples must validate, and the schemas must agree with the Python codec
(`workers.types.rpc`) on what is and is not a well-formed request or outcome.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from workers.types.domain import DomainError
from workers.types.rpc import Answered, answer, parse_request

ROOT = Path(__file__).resolve().parents[2] / "schemas" / "session"
EXAMPLES: dict[str, Any] = json.loads(
    (Path(__file__).parent / "fixtures" / "domain_examples.json").read_text()
)


def load(name: str) -> Draft202012Validator:
    schema = json.loads((ROOT / name).read_text())
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    return Draft202012Validator(schema)


REQUEST = load("request.json")
OUTCOME = load("outcome.json")


def python_accepts_request(value: Any) -> bool:
    try:
        parse_request(value)
    except DomainError:
        return False
    return True


def python_accepts_outcome(value: Any) -> bool:
    return isinstance(answer("Agent.Prepare", value), Answered)


def test_the_spec_examples_validate() -> None:
    REQUEST.validate(EXAMPLES["request"])
    REQUEST.validate({"requestId": "req-3", "scope": None, "params": {}})
    OUTCOME.validate(EXAMPLES["result_outcome"])
    OUTCOME.validate(EXAMPLES["error_outcome"])


REQUEST_CASES: list[tuple[Any, bool]] = [
    (EXAMPLES["request"], True),
    ({"requestId": "req-18446744073709551615", "scope": None, "params": {}}, True),
    ({"requestId": "req-18446744073709551616", "scope": None, "params": {}}, False),
    ({"requestId": "req-0", "scope": None, "params": {}}, False),
    ({"requestId": "req-01", "scope": None, "params": {}}, False),
    ({"requestId": "req-1", "scope": None}, False),
    ({"requestId": "req-1", "scope": None, "params": {}, "x": 1}, False),
    ({"requestId": "req-1", "scope": None, "params": [1]}, False),
    ({"requestId": "req-1", "scope": {"sessionId": "demo", "epoch": "e1", "step": 2},
      "params": {}}, False),
    ({"requestId": "req-1", "scope": {"sessionId": "demo", "epoch": "e1", "step": "2",
                                      "x": 1}, "params": {}}, False),
    ({"requestId": "req-1", "scope": None, "params": {"a": [{"b": {"callId": 1}}]}}, False),
    ({"requestId": "req-1", "scope": None, "params": {"routerId": "r"}}, False),
    ({"requestId": "req-1", "scope": None, "params": {"a": ["callId"]}}, True),
    ("req-1", False),
]


@pytest.mark.parametrize(("value", "valid"), REQUEST_CASES)
def test_the_request_schema_agrees_with_the_codec(value: Any, valid: bool) -> None:
    assert REQUEST.is_valid(value) is valid
    assert python_accepts_request(value) is valid


BASE = EXAMPLES["error_outcome"]
OUTCOME_CASES: list[tuple[Any, bool]] = [
    (EXAMPLES["result_outcome"], True),
    (BASE, True),
    ({**BASE, "requestId": "req-0", "scope": None}, True),
    ({**BASE, "error": {"code": "BUSY", "message": "m", "mutation": "applied"}}, False),
    ({**BASE, "error": {"code": "BACKEND_FAILURE", "message": "m", "mutation": "applied"}},
     True),
    ({**BASE, "error": {"code": "INTERNAL", "message": "m", "mutation": "none"}}, True),
    ({**BASE, "error": {"code": "RESULT_EXPIRED", "message": "m", "mutation": "unknown"}},
     True),
    ({**BASE, "error": {"code": "RESULT_EXPIRED", "message": "m", "mutation": "none"}}, False),
    ({**BASE, "error": {**BASE["error"], "message": "é" * 512}}, True),
    ({**BASE, "error": {**BASE["error"], "message": "é" * 513}}, False),
    ({**BASE, "error": {**BASE["error"], "code": "NOPE"}}, False),
    ({**BASE, "extra": 1}, False),
    ({**BASE, "type": "result"}, False),
    ({**BASE, "type": "other"}, False),
    ({**EXAMPLES["result_outcome"], "result": []}, False),
    ({**EXAMPLES["result_outcome"], "error": BASE["error"]}, False),
    ({**BASE, "workerId": "Fly-A"}, False),
]


@pytest.mark.parametrize(("value", "valid"), OUTCOME_CASES)
def test_the_outcome_schema_agrees_with_the_codec(value: Any, valid: bool) -> None:
    assert OUTCOME.is_valid(value) is valid
    assert python_accepts_outcome(value) is valid


@given(st.integers(min_value=0, max_value=2**65))
def test_the_u64_pattern_is_exact(number: int) -> None:
    value: dict[str, Any] = {"requestId": f"req-{number}", "scope": None, "params": {}}
    assert REQUEST.is_valid(value) is (1 <= number <= 2**64 - 1)
    assert python_accepts_request(value) is (1 <= number <= 2**64 - 1)
