"""Domain RPC: scalars, canonical JSON and digests, request/outcome codec, bus mapping.

session.md §8 tests 1-4 (§1.2-§1.7).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bus.errors import ERROR_CLASSES, ERROR_CODES, RouterLost
from workers.types.canonical import (
    body_digest,
    canonical,
    controls_digest,
    digest_of,
    format_number,
    is_canonical,
    parse_strict,
)
from workers.types.domain import (
    BEFORE_MUTATION,
    CODES,
    FAULT_FRAMES,
    FAULT_LINE,
    DomainError,
    ErrorCode,
    Mutation,
    PluginFault,
    PluginStage,
    Scope,
    parse_digest,
    parse_i32,
    parse_id,
    parse_request_id,
    parse_u64,
    serial,
)
from workers.types.rpc import (
    Answered,
    Outcome,
    Refused,
    answer,
    check_outcome,
    from_bus_error,
    map_bus_error,
    parse_request,
    unparsable_outcome,
)

EXAMPLES: dict[str, Any] = json.loads(
    (Path(__file__).parent / "fixtures" / "domain_examples.json").read_text()
)

# session.md §1.5, the controls of the Environment.Advance vector: p1 inc down, dec up,
# bias -0.5; p2 inc up, dec down, bias 0.25 ("down" = pressed).
VECTOR_CONTROLS = [
    {
        "portId": "p1",
        "buttons": [{"id": "inc", "down": True}, {"id": "dec", "down": False}],
        "axes": [{"id": "bias", "value": -0.5}],
    },
    {
        "portId": "p2",
        "buttons": [{"id": "inc", "down": False}, {"id": "dec", "down": True}],
        "axes": [{"id": "bias", "value": 0.25}],
    },
]


def refused_invalid(call: Any, *args: Any, **kwargs: Any) -> DomainError:
    with pytest.raises(DomainError) as info:
        call(*args, **kwargs)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert info.value.mutation == Mutation.NONE
    return info.value


def test_scalars_accept_and_refuse() -> None:
    # Id
    assert parse_id("a" * 64) == "a" * 64
    assert parse_id("fly-a.v1_2") == "fly-a.v1_2"
    for bad in ["a" * 65, "Fly-a", "", "-a", ".a", "a b", "a\n", 5, None]:
        refused_invalid(parse_id, bad)

    # U64
    assert parse_u64("0") == 0
    assert parse_u64("18446744073709551615") == 2**64 - 1
    for bad_u64 in ["01", "18446744073709551616", 5, True, "-1", "", "1.0", " 1", "1e3"]:
        refused_invalid(parse_u64, bad_u64)

    # I32: a JSON integer, never a bool or a float
    assert parse_i32(-(2**31)) == -(2**31)
    assert parse_i32(2**31 - 1) == 2**31 - 1
    for bad_i32 in [2**31, -(2**31) - 1, True, False, 1.0, "7"]:
        refused_invalid(parse_i32, bad_i32)

    # RequestId: canonical decimal, req-0 only as an outcome's fallback
    assert parse_request_id("req-7") == "req-7"
    assert serial("req-18446744073709551615") == 2**64 - 1
    assert parse_request_id("req-0", allow_zero=True) == "req-0"
    for bad_rid in ["req-0", "req-07", "req-", "req-18446744073709551616", "REQ-1", 7]:
        refused_invalid(parse_request_id, bad_rid)

    # Digest
    assert parse_digest("0" * 64) == "0" * 64
    for bad_digest in ["A" * 64, "0" * 63, "0" * 65, "g" * 64]:
        refused_invalid(parse_digest, bad_digest)

    # Scope: exact keys, Id/Id/U64
    scope = Scope.from_json({"sessionId": "demo", "epoch": "e1", "step": "2"})
    assert scope == Scope("demo", "e1", 2)
    assert scope.to_json() == {"sessionId": "demo", "epoch": "e1", "step": "2"}
    for bad_scope in [
        {"sessionId": "demo", "epoch": "e1", "step": 2},
        {"sessionId": "demo", "epoch": "e1"},
        {"sessionId": "demo", "epoch": "e1", "step": "2", "x": 1},
        {"sessionId": "Demo", "epoch": "e1", "step": "2"},
        {"sessionId": "demo", "epoch": "E1", "step": "2"},
        {"sessionId": "demo", "epoch": "e1", "step": "18446744073709551616"},
    ]:
        refused_invalid(Scope.from_json, bad_scope)
    # `at` keeps the checked session and epoch and checks the new step
    assert scope.at(3) == Scope("demo", "e1", 3)
    assert hash(scope.at(3)) == hash(Scope("demo", "e1", 3))
    for bad_step in [-1, 2**64, True]:
        refused_invalid(scope.at, bad_step)


def test_canonical_json_and_digest_vectors() -> None:
    # every number vector of §1.5
    vectors = [
        (0.1, "0.1"),
        (1.5, "1.5"),
        (0.25, "0.25"),
        (1e-06, "0.000001"),
        (1e-07, "1e-7"),
        (1.23e-18, "1.23e-18"),
        (5e-324, "5e-324"),
        (100.0, "100"),
        (-0.0, "0"),
    ]
    for value, text in vectors:
        assert format_number(value) == text
        assert canonical(value) == text.encode()
        assert canonical([value]) == f"[{text}]".encode()
    refused_invalid(canonical, 2**53)
    refused_invalid(canonical, float(2**53))
    refused_invalid(canonical, float("nan"))
    refused_invalid(canonical, float("inf"))
    assert canonical(2**53 - 1) == b"9007199254740991"
    assert canonical(True) == b"true" and canonical([False, None]) == b"[false,null]"

    # strings: control characters as lowercase \u00xx, the short escapes, the rest literal
    assert canonical("\u001f") == b'"\\u001f"'
    assert canonical('\b\t\n\f\r"\\') == b'"\\b\\t\\n\\f\\r\\"\\\\"'
    assert canonical("\u007f\u2028é😀") == '"\u007f\u2028é😀"'.encode()
    refused_invalid(canonical, "\ud800")
    refused_invalid(canonical, {"\udc00": 1})

    # keys sort by UTF-16 code units: U+1F600 (D83D DE00) before U+E000
    assert canonical({"\ue000": 1, "\U0001f600": 2}) == '{"😀":2,"\ue000":1}'.encode()
    assert canonical({"b": 1, "a": {"y": [], "x": {}}}) == b'{"a":{"x":{},"y":[]},"b":1}'

    # strict parsing and canonical bytes (state.md §1)
    assert digest_of({"b": [1, "x"], "a": {"d": True, "c": None}}) == (
        "49bd9631390b56109ef9a77080d397067fdd5bfde2d9f67de64a11d73af2e3d3"
    )
    assert is_canonical(b'{"a":{"c":null,"d":true},"b":[1,"x"]}')
    assert not is_canonical(b'{"b":[1,"x"],"a":{"d":true,"c":null}}')
    for bad_bytes in [b'{"a":1,"a":2}', b"NaN", b"[1e400]", b'"\\ud800"', b"\xef\xbb\xbf{}",
                      b"\xff", b"{} x", b"[" * 129 + b"]" * 129]:
        refused_invalid(parse_strict, bad_bytes)
    assert parse_strict(b"[" * 128 + b"]" * 128) is not None

    # the digest vectors
    status = canonical({"method": "Worker.Status", "scope": None, "params": {}})
    assert status == b'{"method":"Worker.Status","params":{},"scope":null}'
    assert body_digest("Worker.Status", None, {}) == (
        "5998d642972c96ac17869a8961eb112cfc3c5eacd1137fce2675e8f765005db3"
    )
    advance = body_digest(
        "Environment.Advance",
        Scope("demo", "e1", 0),
        {"batchId": "batch-e1-0", "controls": VECTOR_CONTROLS},
    )
    assert advance == "ac64d1cb36ea0ff6bab8c97658e6bb17520b9b158ef208b31aab287bcd286772"
    assert controls_digest(VECTOR_CONTROLS) == (
        "38c88e325bb1f20e0e98934a829ae9c7569ebe0c2ce11643576d6f11008e5689"
    )
    # a scope object and its JSON form digest the same
    assert advance == body_digest(
        "Environment.Advance",
        {"sessionId": "demo", "epoch": "e1", "step": "0"},
        {"batchId": "batch-e1-0", "controls": VECTOR_CONTROLS},
    )


def malformed(raw: Any) -> DomainError:
    result = answer("Agent.Prepare", raw)
    assert isinstance(result, Refused), raw
    error = result.error
    assert error.code == ErrorCode.BACKEND_FAILURE
    assert error.mutation == Mutation.UNKNOWN
    assert error.message.startswith("Agent.Prepare: malformed outcome: ")
    assert "malformed outcome" in error.message
    return error


def test_requests_and_outcomes_are_validated() -> None:
    # the spec's request parses; its body digest covers method, scope and params
    request = parse_request(EXAMPLES["request"])
    assert request.request_id == "req-7" and request.serial == 7
    assert request.scope == Scope("demo", "e1", 2)
    assert request.to_json() == EXAMPLES["request"]
    assert request.digest("Agent.Prepare") == body_digest(
        "Agent.Prepare", request.scope, request.params
    )
    assert parse_request({"requestId": "req-1", "scope": None, "params": {}}).scope is None

    # bus-only keys are refused at any depth
    for key in ["callId", "deliveryId", "expectedIncarnation", "serviceIncarnation",
                "clientId", "clientIncarnation", "routerId"]:
        error = refused_invalid(
            parse_request,
            {"requestId": "req-1", "scope": None, "params": {"a": [{"b": {key: 1}}]}},
        )
        assert key in error.message
    # exact key set, types, req-0
    for bad in [
        {"requestId": "req-1", "scope": None},
        {"requestId": "req-1", "scope": None, "params": {}, "extra": 1},
        {"requestId": "req-0", "scope": None, "params": {}},
        {"requestId": "req-1", "scope": None, "params": []},
        {"requestId": "req-1", "scope": {"sessionId": "demo"}, "params": {}},
        "not an object",
    ]:
        refused_invalid(parse_request, bad)

    # an unparsable request is answered INVALID_ARGUMENT/none, scope null, req-0 or its id
    for garbage in ["garbage", [1, 2], {"requestId": 5}, {"requestId": "req-01", "params": {}}]:
        with pytest.raises(DomainError) as info:
            parse_request(garbage)
        reply = unparsable_outcome(garbage, info.value, "fly-a", "fly-a-inc-1").to_json()
        assert reply["requestId"] == "req-0"
        assert reply["scope"] is None
        assert reply["error"]["code"] == "INVALID_ARGUMENT"
        assert reply["error"]["mutation"] == "none"
    readable = {"requestId": "req-9", "scope": "bad", "params": {}}
    with pytest.raises(DomainError) as info:
        parse_request(readable)
    reply = unparsable_outcome(readable, info.value, "fly-a", "fly-a-inc-1").to_json()
    assert (reply["requestId"], reply["scope"], reply["type"]) == ("req-9", None, "error")

    # the spec's outcomes are well formed and round-trip
    for name in ["result_outcome", "error_outcome"]:
        result = answer("Agent.Prepare", EXAMPLES[name])
        assert isinstance(result, Answered)
        assert result.outcome.to_json() == EXAMPLES[name]
    error_outcome = check_outcome("Agent.Prepare", EXAMPLES["error_outcome"])
    assert error_outcome.error == DomainError(
        "STALE_STEP", "Agent.Prepare names step 2; this worker is at 3", "none"
    )
    assert check_outcome("Worker.Hello", {**EXAMPLES["result_outcome"], "requestId": "req-0",
                                          "scope": None}).scope is None

    # malformed outcomes are Refused BACKEND_FAILURE/unknown "malformed outcome"
    base = EXAMPLES["error_outcome"]
    for code in sorted(BEFORE_MUTATION):
        for mutation in ["applied", "unknown"]:
            malformed({**base, "error": {"code": code, "message": "m", "mutation": mutation}})
    malformed({**base, "error": {"code": "RESULT_EXPIRED", "message": "m", "mutation": "none"}})
    message_512 = {**base, "error": {**base["error"], "message": "é" * 512}}
    assert isinstance(answer("Agent.Prepare", message_512), Answered)
    malformed({**base, "error": {**base["error"], "message": "é" * 513}})
    malformed({**base, "extra": 1})
    malformed({**base, "error": {**base["error"], "extra": 1}})
    malformed({**EXAMPLES["result_outcome"], "error": base["error"]})
    malformed({**base, "type": "result"})
    malformed({**base, "type": "reply"})
    malformed({k: v for k, v in base.items() if k != "workerId"})
    malformed({**base, "error": {**base["error"], "code": "NOPE"}})
    malformed({**base, "error": {**base["error"], "mutation": "maybe"}})
    malformed({**base, "requestId": "req-01"})
    malformed({**EXAMPLES["result_outcome"], "result": [1]})
    malformed("not an object")
    # before-mutation codes carry none; the others may carry an explicit mutation
    for code, rule in CODES.items():
        if rule.mutation == "explicit":
            for mutation in ["none", "applied", "unknown"]:
                raw = {**base, "error": {"code": code.value, "message": "m", "mutation": mutation}}
                assert isinstance(answer("Agent.Commit", raw), Answered)

    # a worker's own outcome clips its message to 512 code points (511 plus …)
    long_error = DomainError("BACKEND_FAILURE", "x" * 600, "applied")
    wire = Outcome.failure(request, "fly-a", "fly-a-inc-1", long_error).to_json()
    assert wire["error"]["message"] == "x" * 511 + "…"
    assert isinstance(answer("Agent.Prepare", wire), Answered)
    assert DomainError.from_json(long_error.to_json()).message == "x" * 511 + "…"
    assert DomainError.before("BUSY", "b") == DomainError("BUSY", "b", "none")


def test_bus_errors_map_to_domain_errors() -> None:
    expected = {name: ErrorCode.BACKEND_FAILURE for name in ERROR_CODES}
    expected.update(
        TARGET_CHANGED=ErrorCode.IDENTITY_MISMATCH,
        NO_SERVICE=ErrorCode.IDENTITY_MISMATCH,
        BACKPRESSURE=ErrorCode.BUSY,
        QUOTA_EXCEEDED=ErrorCode.BUSY,
    )
    dispatches = {
        "not-dispatched": Mutation.NONE,
        "dispatched": Mutation.UNKNOWN,
        "unknown": Mutation.UNKNOWN,
    }
    for name, code in expected.items():
        for dispatch, mutation in dispatches.items():
            error = map_bus_error("Agent.Prepare", name, "the reason", dispatch)
            assert error == DomainError(
                code, f"Agent.Prepare: bus {name}: the reason", mutation
            )
            # the same through the SDK's exception classes
            raised = ERROR_CLASSES[name]("the reason", dispatch)  # type: ignore[arg-type]
            assert from_bus_error("Agent.Prepare", raised) == error

    # standard JSON-RPC codes are backend failures, named in the message
    for number, name in [(-32700, "PARSE_ERROR"), (-32600, "INVALID_REQUEST"),
                         (-32601, "METHOD_NOT_FOUND"), (-32602, "INVALID_PARAMS")]:
        error = map_bus_error("Worker.Status", number, "bad", "not-dispatched")
        assert error == DomainError(
            "BACKEND_FAILURE", f"Worker.Status: bus {name}: bad", "none"
        )
    # a bus name this build does not know is a backend failure too
    unknown = map_bus_error("Worker.Status", "SOMETHING_NEW", "m", "dispatched")
    assert (unknown.code, unknown.mutation) == (ErrorCode.BACKEND_FAILURE, Mutation.UNKNOWN)

    # a closed client: the SDK raises ROUTER_LOST with dispatch unknown
    closed = from_bus_error("Environment.Advance", RouterLost("the connection is closed"))
    assert closed == DomainError(
        "BACKEND_FAILURE",
        "Environment.Advance: bus ROUTER_LOST: the connection is closed",
        "unknown",
    )
    assert Refused(closed).error is closed


def _raise_deep(depth: int) -> None:
    if depth:
        _raise_deep(depth - 1)
    raise ValueError("bad gain 42 " + "x" * 600)


def test_a_plugin_fault_is_bounded_data_on_the_wire() -> None:
    with pytest.raises(ValueError) as caught:
        _raise_deep(8)
    fault = PluginFault.of(caught.value, "pkg.mod:Model", PluginStage.CONSTRUCT)
    assert fault.exception == "ValueError" and fault.repeats
    assert fault.message.startswith("bad gain 42") and len(fault.message) == 512
    assert len(fault.frames) == FAULT_FRAMES
    assert all(len(f) <= FAULT_LINE and "\n" not in f for f in fault.frames)
    assert "in _raise_deep" in fault.frames[-1] and "raise ValueError" in fault.frames[-1]
    assert not PluginFault.of(caught.value, "pkg.mod:Model", PluginStage.CALL).repeats
    error = DomainError(ErrorCode.BACKEND_FAILURE, "Agent.Initialize: building the model "
                        "failed: ValueError", Mutation.NONE, fault)
    wire = json.loads(json.dumps(error.to_json()))
    assert set(wire) == {"code", "message", "mutation", "data"}
    assert DomainError.from_json(wire) == error
    assert DomainError.from_json(wire).data == fault
    assert "data" not in DomainError.invalid("x").to_json()
    for broken in ({**wire["data"], "frames": ["f"] * (FAULT_FRAMES + 1)},
                   {**wire["data"], "stage": "later"},
                   {**wire["data"], "repeats": "yes"},
                   {k: v for k, v in wire["data"].items() if k != "plugin"}):
        with pytest.raises(DomainError) as refused:
            DomainError.from_json({**wire, "data": broken})
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT
        assert "error.data" in refused.value.message
