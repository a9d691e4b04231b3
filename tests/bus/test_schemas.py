"""The bus schema contract (wire.md §18; §20 tests 108-110).

`schemas/bus/` is the single source of truth for every wire shape: the spec's JSON examples
(kept as fixtures) must validate against it, its digest is the hello `contractDigest`, and the
router's compiled validator (`bus.schema`) must agree with a reference implementation
(`jsonschema`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from bus.errors import ERROR_CODES
from bus.limits import HELLO_KEYS, HELLO_KEYS_MINOR_1, Limits
from bus.schema import (
    NOTIFICATIONS,
    OPS,
    SCHEMA_ROOT,
    SchemaError,
    compile_schema,
    contract_digest,
    load_schemas,
    validator,
)
from tests.bus.bus_raw import SPEC_ERROR_CODES

EXAMPLES = Path(__file__).parent / "fixtures" / "examples.json"
NO_WIRE_EXAMPLE = {"bus.replyFailed", "bus.message", "bus.topicRemoved", "bus.publishFailed"}
MAX_INT = 2**53 - 1

SCHEMA_FILES = sorted(
    ["request.json", "response.json", "error.json"]
    + [f"ops/{op}.{part}.json" for op in OPS for part in ("params", "result")]
    + [f"notifications/{method}.json" for method in NOTIFICATIONS]
)



def schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMA_ROOT / name).read_text(encoding="utf-8"))
    return loaded


def reference(name: str) -> Draft202012Validator:
    return Draft202012Validator(schema(name), format_checker=Draft202012Validator.FORMAT_CHECKER)


def load_examples() -> list[dict[str, Any]]:
    examples: list[dict[str, Any]] = json.loads(EXAMPLES.read_text(encoding="utf-8"))
    return examples


def targets(example: dict[str, Any]) -> list[tuple[str, Any]]:
    """The (schema file, instance) pairs one spec example must satisfy."""
    kind, message = example["kind"], example["message"]
    if "jsonrpc" not in message:  # a bare object, e.g. the §16 stats result
        return [(kind, message)]
    if "method" in message and "id" in message:
        assert kind == f"ops/{message['method']}.params.json"
        return [("request.json", message), (kind, message.get("params", {}))]
    if "method" in message:
        assert set(message) == {"jsonrpc", "method", "params"}
        assert message["jsonrpc"] == "2.0"
        assert message["method"] in NOTIFICATIONS
        assert kind == f"notifications/{message['method']}.json"
        return [(kind, message["params"])]
    if "result" in message:
        return [("response.json", message), (kind, message["result"])]
    assert kind == "error.json"
    return [("response.json", message), (kind, message["error"])]


def test_schema_files_are_the_spec_set_and_valid_draft_2020_12() -> None:
    assert sorted(load_schemas()) == SCHEMA_FILES
    for name in SCHEMA_FILES:
        Draft202012Validator.check_schema(schema(name))
        assert schema(name)["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_examples_validate() -> None:
    examples = load_examples()
    assert len(examples) == 28
    assert {e["section"] for e in examples} == {
        "6.2", "7.1", "7.2", "7.3", "7.4", "7.5", "7.6", "7.7", "7.8", "7.9", "7.10", "8", "16"
    }  # fmt: skip
    # §21 adds bus.replyFailed without an example; every §8 notification has one (the topic
    # notifications have theirs in docs/topics.md: test_topic_and_store_examples_validate)
    assert {e["kind"] for e in examples} >= {f"notifications/{m}.json" for m in NOTIFICATIONS
                                             if m not in NO_WIRE_EXAMPLE}
    checked: set[str] = set()
    for example in examples:
        for name, instance in targets(example):
            Draft202012Validator.check_schema(schema(name))
            errors = [e.message for e in reference(name).iter_errors(instance)]
            assert errors == [], (example["section"], name, errors)
            assert validator(name)(instance) is None, (example["section"], name)
            checked.add(name)
    assert "request.json" in checked and "response.json" in checked and "error.json" in checked


def recomputed_digest(root: Path) -> str:
    """The §6.2 digest, recomputed here independently of bus.schema."""
    mapping = {
        path.relative_to(root).as_posix(): json.loads(path.read_text(encoding="utf-8"))
        for path in root.rglob("*.json")
    }
    canonical = json.dumps(mapping, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def test_contract_digest_stable(tmp_path: Path) -> None:
    digest = contract_digest()
    assert re.fullmatch(r"[0-9a-f]{64}", digest)
    assert contract_digest() == digest
    assert contract_digest(SCHEMA_ROOT) == digest
    assert recomputed_digest(SCHEMA_ROOT) == digest

    copy_root = tmp_path / "bus"
    shutil.copytree(SCHEMA_ROOT, copy_root)
    assert contract_digest(copy_root) == digest
    assert contract_digest(copy_root) == digest

    # Layout outside strings is not part of the content: re-indenting keeps the digest.
    target = copy_root / "ops" / "bus.call.params.json"
    original = target.read_text(encoding="utf-8")
    target.write_text(json.dumps(json.loads(original), indent=4), encoding="utf-8")
    assert contract_digest(copy_root) == digest

    # One space inside a string of any file changes the digest.
    seen = {digest}
    for name in SCHEMA_FILES:
        path = copy_root / name
        before = path.read_text(encoding="utf-8")
        content = json.loads(before)
        content["title"] += " "
        path.write_text(json.dumps(content, indent=2), encoding="utf-8")
        changed = contract_digest(copy_root)
        assert changed not in seen, name
        assert changed == recomputed_digest(copy_root)
        seen.add(changed)
        path.write_text(before, encoding="utf-8")
    assert contract_digest(copy_root) == digest

    # A changed value, and an added file, change it too.
    path = copy_root / "error.json"
    path.write_text(path.read_text().replace('"maxLength": 512', '"maxLength": 513'))
    assert contract_digest(copy_root) != digest
    shutil.copy(SCHEMA_ROOT / "error.json", path)
    assert contract_digest(copy_root) == digest
    (copy_root / "notifications" / "extra.json").write_text("{}")
    assert contract_digest(copy_root) != digest


def test_error_codes_fixed() -> None:
    assert ERROR_CODES == SPEC_ERROR_CODES
    assert len(set(ERROR_CODES.values())) == len(ERROR_CODES)

    error = schema("error.json")
    names = error["properties"]["data"]["properties"]["name"]["enum"]
    assert sorted(names) == sorted(ERROR_CODES) and len(names) == len(ERROR_CODES)
    assert sorted(error["properties"]["code"]["enum"]) == sorted(ERROR_CODES.values())
    assert error["properties"]["data"]["properties"]["dispatch"]["enum"] == [
        "not-dispatched",
        "dispatched",
        "unknown",
    ]
    pairs = {
        branch["properties"]["data"]["properties"]["name"]["const"]: branch["properties"]["code"][
            "const"
        ]
        for branch in error["anyOf"]
    }
    assert pairs == ERROR_CODES
    check = validator("error.json")
    for name, code in ERROR_CODES.items():
        good = {"code": code, "message": "m", "data": {"name": name, "dispatch": "unknown"}}
        assert check(good) is None
        other = -32009 if code != -32009 else -32700
        assert check({**good, "code": other}) is not None


# --------------------------------------------------------------------------------------------
# The compiled validator against the reference implementation

SVC_MAX = f"svc-{MAX_INT}"
GOOD_CALL = {
    "target": "worker.w-1",
    "expectedIncarnation": "svc-12",
    "method": "Worker.Status",
    "payload": {"requestId": "req-3", "scope": None, "params": {}},
}


def err(name: str, dispatch: str, *, code: Any = None, message: str = "x", **data: Any) -> Any:
    """A wire error object; `code` defaults to the §15 code of `name`."""
    code = ERROR_CODES.get(name, -32000) if code is None else code
    return {"code": code, "message": message, "data": {"name": name, "dispatch": dispatch, **data}}


# schema file -> (valid instances, invalid instances)
CASES: dict[str, tuple[list[Any], list[Any]]] = {
    "ops/bus.hello.params.json": (
        [
            {"clientId": "node-a", "clientIncarnation": "inc-1", "supportedMajors": [1]},
            {"clientId": "a", "clientIncarnation": "0", "supportedMajors": [1, 2, 65535]},
            {
                "clientId": "a" * 64,
                "clientIncarnation": "a.b_c-d",
                "supportedMajors": list(range(1, 17)),
            },
        ],
        [
            {"clientId": "Bad", "clientIncarnation": "inc-1", "supportedMajors": [1]},
            {"clientId": "-a", "clientIncarnation": "inc-1", "supportedMajors": [1]},
            {"clientId": "a" * 65, "clientIncarnation": "inc-1", "supportedMajors": [1]},
            {"clientId": "", "clientIncarnation": "inc-1", "supportedMajors": [1]},
            {"clientId": "a", "clientIncarnation": "inc-1", "supportedMajors": []},
            {"clientId": "a", "clientIncarnation": "inc-1", "supportedMajors": [1, 1]},
            {"clientId": "a", "clientIncarnation": "inc-1", "supportedMajors": [0]},
            {"clientId": "a", "clientIncarnation": "inc-1", "supportedMajors": [65536]},
            {"clientId": "a", "clientIncarnation": "inc-1", "supportedMajors": [True]},
            {"clientId": "a", "clientIncarnation": "inc-1", "supportedMajors": list(range(1, 18))},
            {"clientId": "a", "clientIncarnation": "inc-1", "supportedMajors": 1},
            {"clientId": "a", "clientIncarnation": "inc-1"},
            {"clientId": "a", "clientIncarnation": "inc-1", "supportedMajors": [1], "x": 1},
            {"clientId": "a", "clientIncarnation": None, "supportedMajors": [1]},
            [],
        ],
    ),
    "ops/bus.register.params.json": (
        [
            {"name": "worker.w-1", "maxQueued": 1, "maxInFlight": 65535},
            {"name": "a", "maxQueued": 16, "maxInFlight": 4},
            {"name": "a" * 192, "maxQueued": 16, "maxInFlight": 4},
            {"name": "a_b-c.0.-", "maxQueued": 16, "maxInFlight": 4},
        ],
        [
            {"name": "a..b", "maxQueued": 16, "maxInFlight": 4},
            {"name": ".a", "maxQueued": 16, "maxInFlight": 4},
            {"name": "a.", "maxQueued": 16, "maxInFlight": 4},
            {"name": ".", "maxQueued": 16, "maxInFlight": 4},
            {"name": "", "maxQueued": 16, "maxInFlight": 4},
            {"name": "A", "maxQueued": 16, "maxInFlight": 4},
            {"name": "a b", "maxQueued": 16, "maxInFlight": 4},
            {"name": "a*", "maxQueued": 16, "maxInFlight": 4},
            {"name": "a" * 193, "maxQueued": 16, "maxInFlight": 4},
            {"name": "é", "maxQueued": 16, "maxInFlight": 4},
            {"name": "a", "maxQueued": 0, "maxInFlight": 4},
            {"name": "a", "maxQueued": 65536, "maxInFlight": 4},
            {"name": "a", "maxQueued": True, "maxInFlight": 4},
            {"name": "a", "maxQueued": "16", "maxInFlight": 4},
            {"name": "a", "maxQueued": 16, "maxInFlight": 4, "extra": True},
            {"name": "a", "maxQueued": 16},
            {"name": 5, "maxQueued": 16, "maxInFlight": 4},
        ],
    ),
    "ops/bus.unregister.params.json": (
        [
            {"name": "worker.w-1", "serviceIncarnation": "svc-1"},
            {"name": "worker.w-1", "serviceIncarnation": SVC_MAX},
            {"name": "worker.w-1", "serviceIncarnation": "svc-1099511627776"},
        ],
        [
            {"name": "worker.w-1", "serviceIncarnation": "svc-0"},
            {"name": "worker.w-1", "serviceIncarnation": "svc-012"},
            {"name": "worker.w-1", "serviceIncarnation": f"svc-{MAX_INT + 1}"},
            {"name": "worker.w-1", "serviceIncarnation": "svc-99999999999999999"},
            {"name": "worker.w-1", "serviceIncarnation": "svc-"},
            {"name": "worker.w-1", "serviceIncarnation": "svc--1"},
            {"name": "worker.w-1", "serviceIncarnation": "dlv-1"},
            {"name": "worker.w-1", "serviceIncarnation": "svc-1x"},
            {"name": "worker.w-1", "serviceIncarnation": None},
            {"name": "worker.w-1"},
        ],
    ),
    "ops/bus.call.params.json": (
        [
            GOOD_CALL,
            {**GOOD_CALL, "expectedIncarnation": None},
            {**GOOD_CALL, "method": " ~" * 64},
            {**GOOD_CALL, "payload": {}},
        ],
        [
            {**GOOD_CALL, "target": "a..b"},
            {**GOOD_CALL, "target": ".a"},
            {**GOOD_CALL, "target": "a."},
            {**GOOD_CALL, "target": "worker.*"},
            {**GOOD_CALL, "expectedIncarnation": "svc-0"},
            {**GOOD_CALL, "expectedIncarnation": 12},
            {**GOOD_CALL, "expectedIncarnation": False},
            {**GOOD_CALL, "method": ""},
            {**GOOD_CALL, "method": "x" * 129},
            {**GOOD_CALL, "method": "tab\there"},
            {**GOOD_CALL, "method": "caf\u00e9"},
            {**GOOD_CALL, "method": "\x7f"},
            {**GOOD_CALL, "payload": None},
            {**GOOD_CALL, "payload": []},
            {**GOOD_CALL, "payload": "x"},
            {**GOOD_CALL, "foo": 1},
            {k: v for k, v in GOOD_CALL.items() if k != "expectedIncarnation"},
            {k: v for k, v in GOOD_CALL.items() if k != "payload"},
        ],
    ),
    "ops/bus.reply.params.json": (
        [
            {"deliveryId": "dlv-1", "outcome": {}},
            {"deliveryId": f"dlv-{MAX_INT}", "outcome": {"a": [1]}},
        ],
        [
            {"deliveryId": "dlv-0", "outcome": {}},
            {"deliveryId": "svc-1", "outcome": {}},
            {"deliveryId": "dlv-1", "outcome": []},
            {"deliveryId": "dlv-1"},
            {"deliveryId": "dlv-1", "outcome": {}, "routed": True},
        ],
    ),
    "ops/bus.release.params.json": (
        [{"deliveryId": "dlv-6"}],
        [{"deliveryId": 6}, {"deliveryId": "dlv-06"}, {}, {"deliveryId": "dlv-6", "x": None}],
    ),
    "ops/bus.cancel.params.json": (
        [{"callId": 1}, {"callId": MAX_INT}],
        [
            {"callId": 0},
            {"callId": -1},
            {"callId": MAX_INT + 1},
            {"callId": True},
            {"callId": "41"},
            {"callId": None},
            {},
            {"callId": 41, "force": True},
        ],
    ),
    "ops/bus.consumed.params.json": (
        [{"deliveryIds": ["dlv-5"]}, {"deliveryIds": [f"dlv-{i}" for i in range(1, 65)]}],
        [
            {"deliveryIds": []},
            {"deliveryIds": [f"dlv-{i}" for i in range(1, 66)]},
            {"deliveryIds": ["dlv-5", "dlv-5"]},
            {"deliveryIds": ["dlv-5", "svc-5"]},
            {"deliveryIds": "dlv-5"},
            {"deliveryIds": [5]},
            {},
        ],
    ),
    "ops/bus.services.params.json": (
        [{}, {"prefix": ""}, {"prefix": "worker."}, {"prefix": "a..b."}, {"prefix": "x" * 192}],
        [
            {"prefix": "x" * 193},
            {"prefix": "Worker"},
            {"prefix": "w*"},
            {"prefix": None},
            {"prefix": "", "all": True},
        ],
    ),
    "ops/bus.stats.params.json": (
        [{}, {"detail": True}, {"detail": False}],
        [{"detail": 1}, {"detail": 0}, {"detail": None}, {"detail": "true"}, {"verbose": True}],
    ),
    "ops/bus.expect.params.json": (
        [
            {"clientId": "w-1", "pid": 48211},
            {"clientId": "w-1", "pid": 1, "clientIncarnation": None, "ttlMs": 1, "grants": None},
            {"clientId": "w-1", "pid": 4194304, "clientIncarnation": "w-1-inc-1", "ttlMs": 300000},
            {"clientId": "w-2", "pid": 7, "grants": {"register": ["agent.w-2"]}},
            {"clientId": "w-2", "pid": 7, "grants": {"call": []}},
            {"clientId": "w-2", "pid": 7, "grants": {}},
            {
                "clientId": "s1.fly-a.g1",
                "pid": 7,
                "grants": {
                    "register": ["s1.agent.fly-a", "agent.{clientId}", "{clientId}"],
                    "call": ["*", "s1.*", "w-*", "{clientId}.*", "a..*", "." + "*"],
                },
            },
        ],
        [
            {"clientId": "W-1", "pid": 1},
            {"clientId": "w-1", "pid": 0},
            {"clientId": "w-1", "pid": 4194305},
            {"clientId": "w-1", "pid": 1.5},
            {"clientId": "w-1", "pid": 1, "ttlMs": 0},
            {"clientId": "w-1", "pid": 1, "ttlMs": 300001},
            {"clientId": "w-1", "pid": 1, "clientIncarnation": "Inc"},
            {"clientId": "w-1", "pid": 1, "grants": []},
            {"clientId": "w-1", "pid": 1, "grants": {"expect": ["x"]}},
            {"clientId": "w-1", "pid": 1, "grants": {"register": ["a..b"]}},
            {"clientId": "w-1", "pid": 1, "grants": {"register": [".a"]}},
            {"clientId": "w-1", "pid": 1, "grants": {"register": ["a*b"]}},
            {"clientId": "w-1", "pid": 1, "grants": {"register": ["**"]}},
            {"clientId": "w-1", "pid": 1, "grants": {"register": [""]}},
            {"clientId": "w-1", "pid": 1, "grants": {"register": ["{clientid}"]}},
            {"clientId": "w-1", "pid": 1, "grants": {"register": ["{clientId"]}},
            {"clientId": "w-1", "pid": 1, "grants": {"register": "x"}},
            {"clientId": "w-1"},
            {"pid": 1},
            {"clientId": "w-1", "pid": 1, "delegate": []},
        ],
    ),
    "notifications/bus.closing.json": (
        [
            {"error": err("ROUTER_LOST", "unknown", message="router stopping")},
            {"error": err("INVALID_ENVELOPE", "unknown", message="")},
            {"error": err("QUOTA_EXCEEDED", "unknown", message="x" * 512)},
        ],
        [
            {"error": err("ROUTER_LOST", "dispatched")},
            {"error": err("NO_SERVICE", "unknown")},
            {"error": err("ROUTER_LOST", "unknown", code=-32007)},
            {"error": err("ROUTER_LOST", "unknown", message="x" * 513)},
            {"error": err("ROUTER_LOST", "unknown", x=1)},
            {"error": {"code": -32008, "data": {"name": "ROUTER_LOST", "dispatch": "unknown"}}},
            {"error": {**err("ROUTER_LOST", "unknown"), "data": {"name": "ROUTER_LOST"}}},
            {},
        ],
    ),
    "notifications/bus.callFailed.json": (
        [
            {
                "callId": 41,
                "serviceIncarnation": "svc-12",
                "error": err("NO_SERVICE", "dispatched"),
            },
            {
                "callId": 1,
                "serviceIncarnation": "svc-1",
                "error": err("NO_SERVICE", "not-dispatched"),
            },
            {"callId": 1, "serviceIncarnation": "svc-1", "error": err("CALL_GONE", "dispatched")},
        ],
        [
            {
                "callId": 1,
                "serviceIncarnation": "svc-1",
                "error": err("BACKPRESSURE", "dispatched"),
            },
            {"callId": 1, "serviceIncarnation": "svc-1", "error": err("CALL_GONE", "unknown")},
            {"callId": 1, "serviceIncarnation": "svc-1", "error": err("CALL_GONE", "x")},
            {"callId": 0, "serviceIncarnation": "svc-1", "error": err("CALL_GONE", "dispatched")},
            {"callId": 1, "serviceIncarnation": None, "error": err("CALL_GONE", "dispatched")},
            {"callId": 1, "serviceIncarnation": "svc-1"},
        ],
    ),
    "response.json": (
        [
            {"jsonrpc": "2.0", "id": 1, "result": {}},
            {"jsonrpc": "2.0", "id": MAX_INT, "error": err("INVALID_PARAMS", "not-dispatched")},
            {"jsonrpc": "2.0", "id": 5, "error": err("CONFLICT", "not-dispatched")},
        ],
        [
            {"jsonrpc": "2.0", "id": 1},
            {"jsonrpc": "2.0", "id": 0, "result": {}},
            {"jsonrpc": "2.0", "id": None, "result": {}},
            {"jsonrpc": "1.0", "id": 1, "result": {}},
            {"jsonrpc": "2.0", "id": 1, "result": {}, "error": {}},
            {"jsonrpc": "2.0", "id": 1, "result": []},
            {"jsonrpc": "2.0", "id": 1, "error": err("INVALID_PARAMS", "unknown")},
            {"jsonrpc": "2.0", "id": 1, "error": err("ROUTER_LOST", "not-dispatched")},
            {"jsonrpc": "2.0", "id": 1, "error": err("PARSE_ERROR", "not-dispatched")},
            {"jsonrpc": "2.0", "id": 1, "error": err("CONFLICT", "not-dispatched", code=-32602)},
        ],
    ),
    "request.json": (
        [
            {"jsonrpc": "2.0", "id": 1, "method": "bus.stats"},
            {"jsonrpc": "2.0", "id": MAX_INT, "method": "bus.nope", "params": {}},
        ],
        [
            {"jsonrpc": "2.0", "id": 0, "method": "bus.stats"},
            {"jsonrpc": "2.0", "id": MAX_INT + 1, "method": "bus.stats"},
            {"jsonrpc": "2.0", "id": True, "method": "bus.stats"},
            {"jsonrpc": "2.0", "id": "4", "method": "bus.stats"},
            {"jsonrpc": "2.0", "id": None, "method": "bus.stats"},
            {"jsonrpc": "2.0", "method": "bus.stats"},
            {"jsonrpc": "1.0", "id": 1, "method": "bus.stats"},
            {"jsonrpc": "2.0", "id": 1, "method": "bus.stats", "params": []},
            {"jsonrpc": "2.0", "id": 1, "method": 5},
            {"jsonrpc": "2.0", "id": 1, "method": "bus.stats", "extra": 1},
            [{"jsonrpc": "2.0", "id": 1, "method": "bus.stats"}],
        ],
    ),
}


def case_ids() -> Iterator[Any]:
    for name, (valid, invalid) in CASES.items():
        for i, instance in enumerate(valid):
            yield pytest.param(name, instance, True, id=f"{name}-valid-{i}")
        for i, instance in enumerate(invalid):
            yield pytest.param(name, instance, False, id=f"{name}-invalid-{i}")


@pytest.mark.parametrize(("name", "instance", "expected"), list(case_ids()))
def test_compiled_validator_agrees_with_jsonschema(
    name: str, instance: Any, expected: bool
) -> None:
    reference_ok = reference(name).is_valid(instance)
    message = validator(name)(instance)
    assert reference_ok is expected
    assert (message is None) is expected, message


def test_messages_name_the_path_and_rule() -> None:
    register = validator("ops/bus.register.params.json")
    good = {"name": "worker.w-1", "maxQueued": 16, "maxInFlight": 4}
    assert register({**good, "maxQueued": 0}) == "maxQueued: 0 is less than the minimum 1"
    assert register({**good, "foo": 1}) == "unexpected member 'foo'"
    assert register({"maxQueued": 16, "maxInFlight": 4}) == "missing member 'name'"
    assert (
        register({**good, "maxInFlight": True}) == "maxInFlight: expected integer, got boolean true"
    )
    assert register({**good, "name": "a..b"}) == 'name: "a..b" is not a valid service name'
    expect = validator("ops/bus.expect.params.json")
    assert expect({"clientId": "w", "pid": 1, "grants": {"register": ["x", "a..b"]}}) == (
        'grants.register[1]: "a..b" is not a valid grant pattern'
    )
    assert expect({"clientId": "w", "pid": 1, "grants": 3}) == (
        "grants: expected null or object, got integer 3"
    )
    consumed = validator("ops/bus.consumed.params.json")
    assert consumed({"deliveryIds": ["dlv-1", "dlv-1"]}) == "deliveryIds: item [1] repeats item [0]"
    call = validator("ops/bus.call.params.json")
    assert call({**GOOD_CALL, "expectedIncarnation": "svc-0"}) == (
        'expectedIncarnation: "svc-0" is not a valid service incarnation'
    )
    cancel = validator("ops/bus.cancel.result.json")
    assert cancel({"state": "gone"}) is not None and "call-gone" in str(cancel({"state": "x"}))


def test_stricter_than_jsonschema_where_the_wire_is() -> None:
    """Floats are never integers, and `$` does not match before a trailing newline."""
    assert validator("ops/bus.cancel.params.json")({"callId": 3.0}) is not None
    assert validator("request.json")({"jsonrpc": "2.0", "id": 3.0, "method": "bus.stats"})
    register = validator("ops/bus.register.params.json")
    assert register({"name": "worker\n", "maxQueued": 1, "maxInFlight": 1}) is not None
    assert validator("ops/bus.hello.params.json")(
        {"clientId": "a\n", "clientIncarnation": "b", "supportedMajors": [1]}
    )
    assert validator("ops/bus.release.params.json")({"deliveryId": "dlv-1\n"}) is not None
    closing = validator("notifications/bus.closing.json")
    assert closing({"error": err("ROUTER_LOST", "unknown", code=-32008.0)}) is not None


def test_hello_limits_are_the_hello_keys() -> None:
    limits = schema("ops/bus.hello.result.json")["properties"]["limits"]
    assert tuple(limits["required"]) == HELLO_KEYS_MINOR_1  # minor 2's keys are optional
    assert tuple(limits["properties"]) == HELLO_KEYS
    hello = load_examples()[1]["message"]["result"]
    check = validator("ops/bus.hello.result.json")
    assert check({**hello, "limits": Limits().hello()}) is None
    assert check({**hello, "limits": {**Limits().hello(), "writeHighWaterBytes": 262144}})
    assert check({**hello, "limits": {**Limits().hello(), "maxConsumeBatch": 65}})
    for key in HELLO_KEYS_MINOR_1:
        partial = {k: v for k, v in Limits().hello().items() if k != key}
        assert check({**hello, "limits": partial}) == f"limits: missing member {key!r}"


def walk(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        yield where, node
        for key, value in node.items():
            yield from walk(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{where}/{i}")


def test_objects_are_closed_and_files_self_contained() -> None:
    opaque = {"payload", "outcome"}
    envelope_opaque = {("request.json", "params"), ("response.json", "result")}
    for name, content in load_schemas().items():
        compile_schema(content)
        for where, node in walk(content, "#"):
            ref = node.get("$ref")
            if isinstance(ref, str):
                assert ref.startswith("#/$defs/"), (name, where)
            if node.get("type") == "object":
                key = where.rsplit("/", 1)[-1]
                if node.get("additionalProperties") is False:
                    continue
                assert node == {"type": "object"} or set(node) == {"type", "description"}, where
                assert key in opaque or (name, key) in envelope_opaque, (name, where)


def test_compiler_refuses_unsupported_keywords() -> None:
    bad_schemas: list[dict[str, Any]] = [
        {"type": "string", "format": "email"},
        {"type": "object", "propertyNames": {"pattern": "^a$"}},
        {"if": {}, "then": {}},
        {"$ref": "other.json#/$defs/Id"},
        {"$ref": "#/$defs/Missing"},
        {"type": "array", "items": [{"type": "string"}]},
        {"type": "integer", "exclusiveMinimum": 0},
        {"type": "strings"},
        {"type": "string", "pattern": "("},
        {"$schema": "http://json-schema.org/draft-07/schema#"},
        {"properties": {"a": {"$defs": {}}}},
    ]
    for bad in bad_schemas:
        with pytest.raises(SchemaError):
            compile_schema(bad)


def test_compiler_semantics() -> None:
    """Keywords apply only to their own type; enum/const use JSON equality; $ref may recurse."""
    loose = compile_schema({"minLength": 2, "minimum": 3, "required": ["a"]})
    assert loose(5) is None and loose(None) is None and loose("ab") is None
    assert loose("a") and loose(2) and loose({})
    assert compile_schema({"enum": [1, "a"]})(True) is not None
    assert compile_schema({"enum": [1, "a"]})(1.0) is None
    assert compile_schema({"const": False})(0) is not None
    assert compile_schema({"type": "number"})(True) is not None
    assert compile_schema({"type": "number", "maximum": 1})(1.5) is not None
    assert compile_schema({"uniqueItems": True})([1, True]) is None
    assert compile_schema({"uniqueItems": True})([{"a": 1}, {"a": 1.0}]) is not None
    assert compile_schema({"oneOf": [{"type": "integer"}, {"minimum": 0}]})(1) is not None
    assert compile_schema({"oneOf": [{"type": "integer"}, {"minimum": 0}]})(-1) is None
    tree = compile_schema(
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        }
    )
    assert tree({"kids": [{"kids": []}, {}]}) is None
    assert tree({"kids": [{"kids": [{"x": 1}]}]}) == "kids[0].kids[0]: unexpected member 'x'"


# --------------------------------------------------------------------------------------------
# Randomised agreement with jsonschema

INTERESTING_STRINGS = [
    "", "a", "A", "a..b", ".a", "a.", "worker.w-1", "svc-12", "svc-0", "svc-01", SVC_MAX,
    f"svc-{MAX_INT + 1}", "dlv-5", "dlv-0", "conn-7", "router-3fa85f6457174562", "*", "w-*",
    "{clientId}", "agent.{clientId}", "2.0", "bus.stats", "execution-unknown", "call-gone",
    "NO_SERVICE", "BACKPRESSURE", "ROUTER_LOST", "unknown", "dispatched", "not-dispatched",
    "unregistered", "disconnected", "x" * 64, "x" * 65, "x" * 192, "x" * 193, "é", "a b",
]  # fmt: skip
INTERESTING_INTS = [0, 1, 2, 7, 8, 63, 64, 65, 100, 512, 65535, 65536, 300000, 4194304,
                    4194305, MAX_INT, MAX_INT + 1, -1, -32005, -32008]  # fmt: skip
ALL_KEYS = sorted(
    {
        key
        for content in load_schemas().values()
        for _, node in walk(content, "#")
        for key in node.get("properties", {})
    }
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(INTERESTING_INTS),
    st.integers(-(2**60), 2**60),
    st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer()),
    st.sampled_from(INTERESTING_STRINGS),
    st.text(alphabet="abz09._-*{}A \n", max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.sampled_from([*ALL_KEYS, "foo"]), inner, max_size=6),
    ),
    max_leaves=12,
)


def base_instances() -> list[tuple[str, Any]]:
    bases = [pair for example in load_examples() for pair in targets(example)]
    bases += [(name, v) for name, (valid, _) in CASES.items() for v in valid]
    return bases


def mutate(draw: st.DrawFn, value: Any, depth: int = 0) -> Any:
    if isinstance(value, dict) and value and depth < 4:
        value = dict(value)
        key = draw(st.sampled_from(sorted(value)))
        action = draw(st.sampled_from(["recurse", "replace", "delete", "add"]))
        if action == "recurse":
            value[key] = mutate(draw, value[key], depth + 1)
        elif action == "replace":
            value[key] = draw(json_values)
        elif action == "delete":
            del value[key]
        else:
            value[draw(st.sampled_from([*ALL_KEYS, "foo"]))] = draw(json_values)
        return value
    if isinstance(value, list) and value and depth < 4:
        value = list(value)
        i = draw(st.integers(0, len(value) - 1))
        action = draw(st.sampled_from(["recurse", "duplicate", "delete"]))
        if action == "recurse":
            value[i] = mutate(draw, value[i], depth + 1)
        elif action == "duplicate":
            value.append(copy.deepcopy(value[i]))
        else:
            del value[i]
        return value
    return draw(json_values)


BASES = base_instances()


@st.composite
def schema_and_instance(draw: st.DrawFn) -> tuple[str, Any]:
    if draw(st.booleans()):
        name, base = draw(st.sampled_from(BASES))
        count = draw(st.integers(0, 2))
        instance = base
        for _ in range(count):
            instance = mutate(draw, instance)
        return name, instance
    return draw(st.sampled_from(SCHEMA_FILES)), draw(json_values)


def has_known_divergence(value: Any) -> bool:
    """Values where bus.schema is deliberately stricter than jsonschema (see the module doc)."""
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, str):
        return value.endswith("\n")
    if isinstance(value, list):
        return any(has_known_divergence(v) for v in value)
    if isinstance(value, dict):
        return any(has_known_divergence(v) for v in value.values())
    return False


@pytest.mark.timeout(240)  # 1500 examples: minutes on a loaded 2-CPU host
@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema_and_instance())
def test_random_instances_agree_with_jsonschema(pair: tuple[str, Any]) -> None:
    name, instance = pair
    if has_known_divergence(instance):
        return
    message = validator(name)(instance)
    assert reference(name).is_valid(instance) is (message is None), (name, instance, message)


def test_schema_files_are_ascii() -> None:
    """The digest is over canonical JSON; ASCII-only files make escaped and raw UTF-8 agree."""
    for path in sorted(SCHEMA_ROOT.rglob("*.json")):
        assert path.read_bytes().isascii(), f"{path.name} holds non-ASCII bytes"


TOPIC_EXAMPLES = Path(__file__).parent / "fixtures" / "topic_examples.json"
TOPICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "topics.md"


def test_topic_and_store_examples_validate() -> None:
    """docs/topics.md §17 test 172: the examples of §3 and §5 (attachments included)
    validate, and each is a line of the page, verbatim; every such line is a fixture."""
    examples = json.loads(TOPIC_EXAMPLES.read_text(encoding="utf-8"))
    doc_lines = {json.dumps(json.loads(line), separators=(",", ":"))
                 for line in TOPICS_DOC.read_text(encoding="utf-8").splitlines()
                 if line.startswith('{"jsonrpc"')}
    kinds = set()
    for example in examples:
        assert json.dumps(example["message"], separators=(",", ":")) in doc_lines
        if "method" in example["message"] and "id" not in example["message"]:
            # a notification form of an op (§3.4) uses the op's params schema
            pairs = [(example["kind"], example["message"]["params"])]
        else:
            pairs = targets(example)
        for name, instance in pairs:
            assert [e.message for e in reference(name).iter_errors(instance)] == [], name
            assert validator(name)(instance) is None, (example["section"], name)
        kinds.add(example["kind"])
    assert {f"ops/{op}.{part}.json" for op in ("bus.declare", "bus.publish", "bus.subscribe",
                                                 "bus.allocate", "bus.seal")
            for part in ("params", "result")} <= kinds
    assert {json.dumps(e["message"], separators=(",", ":")) for e in examples} == doc_lines
    assert {name: ERROR_CODES[name] for name in (
        "NO_TOPIC", "ARTIFACT_GONE", "ARTIFACT_UNSEALED", "ARTIFACT_MISMATCH", "OWNER_INVALID",
        "STORE_FAILURE")} == {"NO_TOPIC": -32010, "ARTIFACT_GONE": -32011,
                              "ARTIFACT_UNSEALED": -32012, "ARTIFACT_MISMATCH": -32013,
                              "OWNER_INVALID": -32014, "STORE_FAILURE": -32015}
    assert len(set(ERROR_CODES.values())) == len(ERROR_CODES)
