"""The typed structures generated from schemas/ (`workers.types.structures`, wire.md §22.3)
accept exactly what the compiled schema validator and `parse_request` accept.

The structures are made from the schema files at import, so they cannot drift from them; what
this checks is the generator: every valid request of the step path, and every one-edit mutation
of it (a member dropped, added or replaced by a value of another type, range or spelling), gets
the same verdict from `parse_typed` as from the path it replaces.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.session.worker_rig import (
    advance_params,
    agent_init_params,
    boot_digest,
    commit_params,
    env_init_params,
    prepare_params,
    sensory,
)
from workers.types.contract import METHOD_SCHEMAS, check_params, method_validator
from workers.types.domain import DomainError
from workers.types.rpc import Answered, answer, parse_request
from workers.types.structures import answer_typed, parse_typed, structure

SCOPE = {"sessionId": "s1", "epoch": "e-1", "step": "3"}

VALID: list[tuple[str, dict[str, Any]]] = [
    ("Agent.Prepare", prepare_params("fly-a", boot_digest(),
                                     [{"id": "s1", "kindId": "puff", "durationMs": 12.5}])),
    ("Agent.Commit", commit_params("fly-a", "req-4", 3,
                                   rewards=[{"ruleId": "r1", "eventId": "e1", "value": 0.5}])),
    ("Agent.Commit", {**commit_params("fly-a", "req-4", 3), "nextInput": sensory(4, [])}),
    ("Environment.Advance", advance_params(3)),
    ("Agent.Initialize", agent_init_params()),
    ("Environment.Initialize", env_init_params()),
    ("Worker.Acknowledge", {"requestIds": ["req-1", "req-2"]}),
    ("Worker.Status", {}),
]

ODD_VALUES: list[Any] = [
    None, True, 0, 1, -1, 1.5, 2**64, "", "x", "req-0", "a" * 65, "0" * 64, "1\n", [], {},
    {"callId": "c-1"},
]


#: results recorded from a run (one of each method the node checks on the step path)
RESULTS: dict[str, dict[str, Any]] = json.loads(
    (Path(__file__).parent / "fixtures" / "step_results.json").read_text())


def old_accepts(method: str, payload: Any) -> bool:
    try:
        check_params(method, parse_request(payload).params)
    except DomainError:
        return False
    return True


def mutations(value: Any) -> Iterator[Any]:
    """Every one-edit variant of `value`: at each place a member dropped, one added, or a value
    replaced by each of `ODD_VALUES` (a string also with a trailing newline)."""
    yield from (odd for odd in ODD_VALUES if odd != value)
    if isinstance(value, str):
        yield value + "\n"
    if isinstance(value, dict):
        for key in value:
            yield {k: v for k, v in value.items() if k != key}
            for inner in mutations(value[key]):
                yield {**value, key: inner}
        yield {**value, "extra": 1}
        yield {**value, "clientId": "x"}
    if isinstance(value, list):
        for index, item in enumerate(value):
            for inner in mutations(item):
                changed = copy.copy(value)
                changed[index] = inner
                yield changed
        if value:
            yield value[1:]
            yield [*value, value[0]]


@pytest.mark.parametrize(("method", "params"), VALID, ids=[m for m, _ in VALID])
def test_a_valid_request_is_parsed_alike(method: str, params: dict[str, Any]) -> None:
    for scope in (SCOPE, None):
        payload = {"requestId": "req-7", "scope": scope, "params": params}
        assert old_accepts(method, payload)
        assert parse_typed(method, payload) == parse_request(payload)


@pytest.mark.parametrize(("method", "params"), VALID, ids=[m for m, _ in VALID])
def test_every_mutation_gets_the_verdict_of_the_validator(method: str,
                                                          params: dict[str, Any]) -> None:
    payload = {"requestId": "req-7", "scope": SCOPE, "params": params}
    seen = 0
    for mutated in mutations(payload):
        typed = parse_typed(method, mutated)
        assert (typed is not None) == old_accepts(method, mutated), mutated
        if typed is not None:
            assert typed == parse_request(mutated)
        seen += 1
    assert seen > 50


def test_every_method_schema_has_a_structure() -> None:
    """Each params and result schema is a structure (some fields may stay with the validator):
    an unsupported construct at a schema's root would put the whole method on the slow path."""
    for path in sorted(METHOD_SCHEMAS.glob("*.json")):
        method, kind, _ = path.name.rsplit(".", 2)
        made = structure(method, kind)
        assert isinstance(made, type) and issubclass(made, msgspec.Struct), path.name


def old_answer(method: str, raw: Any) -> bool:
    """Whether `answer` and the result schema (the node's `check_reply`) take the outcome."""
    got = answer(method, raw)
    if not isinstance(got, Answered):
        return False
    result = got.outcome.result
    return result is None or method_validator(method, "result")(result) is None


@pytest.mark.parametrize("method", sorted(RESULTS))
def test_every_outcome_mutation_gets_the_verdict_of_the_validator(method: str) -> None:
    outcome = {"type": "result", "requestId": "req-7", "workerId": "fly-a",
               "incarnationId": "fly-a-inc-1", "scope": SCOPE, "result": RESULTS[method]}
    got = answer_typed(method, outcome)
    assert isinstance(got, Answered) and got.outcome.checked
    assert got == answer(method, outcome)
    for mutated in mutations(outcome):
        typed = answer_typed(method, mutated)
        accepted = isinstance(typed, Answered) and (
            typed.outcome.checked or old_answer(method, mutated))
        assert accepted == old_answer(method, mutated), mutated
        assert typed == answer(method, mutated)
