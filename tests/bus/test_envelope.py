"""The JSON-RPC envelope and the inbound check order (wire.md §4, §6.1, §15; §20 tests 18-30)."""

from __future__ import annotations

import struct
import time
from typing import Any

import orjson
import pytest

from bus.policy import Policy, PolicyEntry
from tests.bus.bus_raw import SPEC_ERROR_CODES

pytestmark = pytest.mark.timeout(10)

DISPATCH = ("not-dispatched", "dispatched", "unknown")


async def _helloed(raw, r, client_id: str) -> Any:
    c = await raw(r)
    resp = await c.hello(client_id)
    assert "result" in resp, resp
    return c


def _request(rid: Any, method: str = "bus.stats", params: Any = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
    msg["params"] = {} if params is None else params
    return msg


async def test_hello_must_be_first(router, raw) -> None:
    r = await router()
    c = await raw(r)
    await c.request("bus.stats", {})
    err = await c.expect_closing("INVALID_ENVELOPE")
    assert err["code"] == -32000
    # check 5 comes before check 6: an unknown method first is a sequence violation too
    c2 = await raw(r)
    await c2.request("bus.nope", {})
    await c2.expect_closing("INVALID_ENVELOPE")
    # and before check 7: a register with valid params, before hello
    c3 = await raw(r)
    await c3.request("bus.register", {"name": "svc.a", "maxQueued": 1, "maxInFlight": 1})
    await c3.expect_closing("INVALID_ENVELOPE")
    stats = r.stats()
    assert stats["services"] == 0
    assert stats["counters"]["helloOk"] == 0


async def test_second_hello_closes(router, raw, settle) -> None:
    r = await router()
    c = await _helloed(raw, r, "twice")
    await settle(r, lambda s: s["clients"] == 1)
    await c.request("bus.hello", {"clientId": "twice", "clientIncarnation": "twice-2",
                                  "supportedMajors": [1]})
    err = await c.expect_closing("INVALID_ENVELOPE")
    assert err["code"] == -32000
    stats = await settle(r, lambda s: s["clients"] == 0 and s["connections"] == 0)
    assert stats["counters"]["helloOk"] == 1


async def test_ids_must_strictly_increase(router, raw) -> None:
    r = await router()
    c = await raw(r)
    hello = await c.call("bus.hello", {"clientId": "ids-1", "clientIncarnation": "ids-1-a",
                                       "supportedMajors": [1]})
    assert hello["id"] == 1 and "result" in hello
    for rid in (5, 100):
        await c.request("bus.stats", {}, rid=rid)
        resp = await c.recv_response(rid)
        assert "result" in resp, resp
    await c.request("bus.stats", {}, rid=100)
    err = await c.expect_closing("INVALID_REQUEST")
    assert err["code"] == -32600

    c2 = await _helloed(raw, r, "ids-2")
    await c2.request("bus.stats", {}, rid=9)
    assert "result" in await c2.recv_response(9)
    await c2.request("bus.stats", {}, rid=7)
    await c2.expect_closing("INVALID_REQUEST")


async def test_bad_ids_close(router, raw) -> None:
    r = await router()
    bad_ids: list[Any] = [3.0, True, "4", None, 0, 2**53]
    for n, rid in enumerate(bad_ids):
        c = await _helloed(raw, r, f"badid-{n}")
        await c.send_obj(_request(rid))
        err = await c.expect_closing("INVALID_REQUEST")
        assert err["code"] == -32600, rid
    # negative ids are refused too
    c = await _helloed(raw, r, "badid-neg")
    await c.send_obj(_request(-1))
    await c.expect_closing("INVALID_REQUEST")
    # the largest id, 2^53-1, is valid
    c = await _helloed(raw, r, "badid-max")
    await c.request("bus.stats", {}, rid=2**53 - 1)
    assert "result" in await c.recv_response(2**53 - 1)
    # a missing id
    c = await _helloed(raw, r, "badid-missing")
    await c.send_obj({"jsonrpc": "2.0", "method": "bus.stats", "params": {}})
    await c.expect_closing("INVALID_REQUEST")
    # check 4 precedes check 5: a bad id before hello is INVALID_REQUEST, not INVALID_ENVELOPE
    c = await raw(r)
    await c.send_obj(_request(0, "bus.hello", {"clientId": "badid-pre",
                                               "clientIncarnation": "badid-pre-1",
                                               "supportedMajors": [1]}))
    await c.expect_closing("INVALID_REQUEST")
    closes = r.stats()["counters"]["closes"]
    assert closes["INVALID_REQUEST"] == len(bad_ids) + 3


async def test_client_notification_response_and_batch_refused(router, raw) -> None:
    r = await router()
    frames: list[Any] = [
        {"jsonrpc": "2.0", "method": "bus.stats", "params": {}},  # notification
        {"jsonrpc": "2.0", "id": 2, "result": {}},  # response
        {"jsonrpc": "2.0", "id": 2, "error": {"code": -32600, "message": "x",
                                              "data": {"name": "INVALID_REQUEST",
                                                       "dispatch": "unknown"}}},
        [_request(2)],  # batch
        [],  # empty batch
    ]
    for n, frame in enumerate(frames):
        c = await _helloed(raw, r, f"shape-{n}")
        await c.send_obj(frame)
        err = await c.expect_closing("INVALID_REQUEST")
        assert err["code"] == -32600, frame
    # before hello, too
    c = await raw(r)
    await c.send_obj([_request(1, "bus.hello", {"clientId": "shape-pre",
                                                "clientIncarnation": "shape-pre-1",
                                                "supportedMajors": [1]})])
    await c.expect_closing("INVALID_REQUEST")


async def test_wrong_jsonrpc_or_extra_member_closes(router, raw) -> None:
    r = await router()
    frames: list[dict[str, Any]] = [
        {"jsonrpc": "1.0", "id": 2, "method": "bus.stats", "params": {}},
        {"id": 2, "method": "bus.stats", "params": {}},  # jsonrpc missing
        {"jsonrpc": "2.0", "id": 2, "method": "bus.stats", "params": {}, "extra": 1},
        {"jsonrpc": "2.0", "id": 2, "method": "bus.stats", "extra": 1},
        {"jsonrpc": "2.0", "id": 2, "method": "bus.stats", "params": []},
        {"jsonrpc": "2.0", "id": 2, "method": "bus.stats", "params": [True]},
        {"jsonrpc": "2.0", "id": 2, "method": "bus.stats", "params": None},
        {"jsonrpc": "2.0", "id": 2, "method": 5, "params": {}},
    ]
    for n, frame in enumerate(frames):
        c = await _helloed(raw, r, f"member-{n}")
        await c.send_obj(frame)
        err = await c.expect_closing("INVALID_REQUEST")
        assert err["code"] == -32600, frame
    # check 3 precedes check 5: a malformed first request is INVALID_REQUEST, not
    # INVALID_ENVELOPE
    c = await raw(r)
    await c.send_obj({**_request(1, "bus.hello", {"clientId": "member-pre",
                                                  "clientIncarnation": "member-pre-1",
                                                  "supportedMajors": [1]}), "extra": 1})
    await c.expect_closing("INVALID_REQUEST")
    assert r.stats()["counters"]["helloOk"] == len(frames)


async def test_parse_error_closes(router, raw) -> None:
    r = await router()
    bodies = [
        b'{"jsonrpc":"2.0","id":2,"id":3,"method":"bus.stats","params":{}}',
        b'{"jsonrpc":"2.0","id":2,"method":"bus.stats","params":{"detail":true,"detail":false}}',
        b'{"jsonrpc":"2.0","id":2,"method":"bus.stats","method":"bus.stats","params":{}}',
    ]
    for n, body in enumerate(bodies):
        c = await _helloed(raw, r, f"dup-{n}")
        await c.send_body(body)
        err = await c.expect_closing("PARSE_ERROR")
        assert err["code"] == -32700
    # check 2 precedes check 3: duplicate keys in a non-request body are still PARSE_ERROR
    c = await _helloed(raw, r, "dup-x")
    await c.send_body(b'[{"a":1,"a":1}]')
    await c.expect_closing("PARSE_ERROR")
    assert r.stats()["counters"]["closes"]["PARSE_ERROR"] == len(bodies) + 1


async def test_unknown_method_keeps_connection(router, raw) -> None:
    r = await router()
    c = await _helloed(raw, r, "nope-1")
    resp = await c.call("bus.nope", {})
    assert set(resp) == {"jsonrpc", "id", "error"}
    assert resp["error"]["code"] == -32601
    assert resp["error"]["data"] == {"name": "METHOD_NOT_FOUND", "dispatch": "not-dispatched"}
    stats = await c.call("bus.stats", {})
    assert "result" in stats, stats
    assert stats["result"]["clients"] == 1
    assert stats["result"]["counters"]["errors"]["METHOD_NOT_FOUND"] == 1


async def test_bad_params_keep_connection(router, raw) -> None:
    r = await router()
    c = await _helloed(raw, r, "params-1")
    bad = [
        {"name": "svc.a", "maxQueued": 1, "maxInFlight": 1, "extra": True},
        {"name": "svc.a", "maxQueued": 1},
        {"name": "svc.a", "maxQueued": 0, "maxInFlight": 1},
    ]
    for params in bad:
        resp = await c.call("bus.register", params)
        assert resp["error"]["code"] == -32602, params
        assert resp["error"]["data"] == {"name": "INVALID_PARAMS",
                                          "dispatch": "not-dispatched"}
    # the connection stays, and nothing was registered
    services = await c.call("bus.services", {})
    assert services["result"] == {"services": []}
    stats = await c.call("bus.stats", {})
    assert stats["result"]["clients"] == 1
    assert stats["result"]["services"] == 0
    ok = await c.call("bus.register", {"name": "svc.a", "maxQueued": 1, "maxInFlight": 1})
    assert ok["result"]["name"] == "svc.a"


async def test_params_may_be_omitted_when_all_optional(router, raw) -> None:
    r = await router()
    c = await _helloed(raw, r, "noparams")
    rid = await c.request("bus.stats")  # no `params` member at all
    resp = await c.recv_response(rid)
    assert "result" in resp, resp
    assert resp["result"]["routerId"] == r.router_id
    assert resp["result"]["connectionsDetail"] is None  # detail defaults to false
    rid = await c.request("bus.services")
    resp = await c.recv_response(rid)
    assert resp["result"] == {"services": []}


async def test_responses_follow_request_order(router, raw) -> None:
    r = await router()
    c = await _helloed(raw, r, "pipeline")
    kinds: list[tuple[str, dict[str, Any]]] = []
    for i in range(50):
        k = i % 10
        if k == 0:
            kinds.append(("bus.register", {"name": f"svc.p{i}", "maxQueued": 16,
                                           "maxInFlight": 16}))
        elif k == 1:
            kinds.append(("bus.stats", {}))
        elif k == 2:
            kinds.append(("bus.nope", {}))
        elif k == 3:
            kinds.append(("bus.call", {"target": f"svc.p{i - 3}", "expectedIncarnation": None,
                                       "method": "M", "payload": {"i": i}}))
        elif k == 4:
            kinds.append(("bus.call", {"target": "svc.none", "expectedIncarnation": None,
                                       "method": "M", "payload": {}}))
        elif k == 5:
            kinds.append(("bus.services", {"prefix": "svc."}))
        elif k == 6:
            kinds.append(("bus.register", {"name": "svc.p0", "maxQueued": 1,
                                           "maxInFlight": 1}))  # CONFLICT
        elif k == 7:
            kinds.append(("bus.register", {"name": "svc.bad", "maxQueued": 0}))  # bad params
        elif k == 8:
            kinds.append(("bus.unregister", {"name": "svc.none",
                                             "serviceIncarnation": "svc-1"}))
        else:
            kinds.append(("bus.consumed", {"deliveryIds": ["dlv-999999"]}))
    sent: list[int] = []
    data = bytearray()
    rid = 1
    for i, (method, params) in enumerate(kinds):
        rid += 1 + (i % 3)  # gaps are allowed
        sent.append(rid)
        body = orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
        data += struct.pack("<I", len(body)) + body
    await c.send_bytes(bytes(data))  # all 50 pipelined before reading anything
    c.next_id = rid + 1

    got: list[int] = []
    outcomes: list[str] = []
    notes = 0
    while len(got) < len(sent):
        msg = await c.recv_obj()
        if "id" in msg:
            got.append(msg["id"])
            outcomes.append("ok" if "result" in msg else msg["error"]["data"]["name"])
        else:
            notes += 1
    assert got == sent
    # the mix really was mixed: successes and several distinct errors, plus deliveries
    assert {"ok", "METHOD_NOT_FOUND", "NO_SERVICE", "CONFLICT", "INVALID_PARAMS"} <= set(
        outcomes)
    assert outcomes[3] == "ok"  # the call to the registered svc.p0
    stats = await c.call("bus.stats", {})
    assert stats["result"]["counters"]["callsAdmitted"] == 5


async def test_hello_deadline(router, raw) -> None:
    r = await router(helloTimeoutMs=200)
    t0 = time.monotonic()
    c = await raw(r)
    helloed = await _helloed(raw, r, "in-time")  # the hello stops its timer
    msg = await c.recv_obj(timeout=3.0)
    elapsed_ms = (time.monotonic() - t0) * 1000
    assert msg["method"] == "bus.closing"
    err = msg["params"]["error"]
    assert err["data"] == {"name": "INVALID_ENVELOPE", "dispatch": "unknown"}
    assert err["code"] == -32000
    assert "hello deadline" in err["message"]
    assert 180 <= elapsed_ms <= 1000, elapsed_ms
    await c.expect_eof()
    # the connection that completed its hello in time outlives the deadline
    stats = await helloed.call("bus.stats", {})
    assert stats["result"]["clients"] == 1
    assert stats["result"]["counters"]["closes"] == {"INVALID_ENVELOPE": 1}


def _check_error_object(err: Any) -> tuple[str, str]:
    assert isinstance(err, dict)
    assert set(err) == {"code", "message", "data"}, err
    assert isinstance(err["message"], str) and len(err["message"]) <= 512
    assert isinstance(err["data"], dict) and set(err["data"]) == {"name", "dispatch"}, err
    name, dispatch = err["data"]["name"], err["data"]["dispatch"]
    assert name in SPEC_ERROR_CODES, name
    assert type(err["code"]) is int and err["code"] == SPEC_ERROR_CODES[name], err
    assert dispatch in DISPATCH
    return name, dispatch


async def test_error_object_shape(router, raw) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="e-*", register=("svc.*",), call=("svc.*",), publish=("svc.*",)),
    ))
    r = await router(policy=policy, maxEnvelopeBytes=65536)
    seen: dict[str, str] = {}

    def check(resp: dict[str, Any], name: str, dispatch: str = "not-dispatched") -> None:
        assert set(resp) == {"jsonrpc", "id", "error"}, resp
        got = _check_error_object(resp["error"])
        assert got == (name, dispatch), resp
        seen[name] = dispatch

    svc = await _helloed(raw, r, "e-svc")
    reg = await svc.call("bus.register", {"name": "svc.a", "maxQueued": 1, "maxInFlight": 1})
    incarnation = reg["result"]["serviceIncarnation"]
    c = await _helloed(raw, r, "e-caller")

    check(await c.call("bus.nope", {}), "METHOD_NOT_FOUND")
    check(await c.call("bus.publish", {"topic": "svc.t", "expectedIncarnation": None,
                                       "payload": {}}), "NO_TOPIC")  # docs/topics.md §9
    check(await c.call("bus.register", {"name": "svc.b"}), "INVALID_PARAMS")
    # the store's errors (docs/topics.md §9)
    check(await c.call("bus.seal", {"artifactId": "art-1", "digest": "0" * 64}),
          "ARTIFACT_GONE")
    art = (await c.call("bus.allocate", {"length": 16}))["result"]["artifactId"]
    check(await c.call("bus.retain", {"artifactIds": [art]}), "ARTIFACT_UNSEALED")
    check(await svc.call("bus.seal", {"artifactId": art, "digest": "0" * 64}), "OWNER_INVALID")
    check(await c.call("bus.seal", {"artifactId": art, "digest": "0" * 64}), "ARTIFACT_MISMATCH")
    storeless = await router(policy=policy, store_enabled=False)
    s = await _helloed(raw, storeless, "e-caller")
    check(await s.call("bus.allocate", {"length": 16}), "STORE_FAILURE")
    check(await c.call("bus.register", {"name": "other.b", "maxQueued": 1, "maxInFlight": 1}),
          "NOT_AUTHORIZED")
    check(await c.call("bus.register", {"name": "svc.b", "maxQueued": 17, "maxInFlight": 1}),
          "QUOTA_EXCEEDED")
    check(await c.call("bus.register", {"name": "svc.a", "maxQueued": 1, "maxInFlight": 1}),
          "CONFLICT")
    call = {"target": "svc.none", "expectedIncarnation": None, "method": "M", "payload": {}}
    check(await c.call("bus.call", call), "NO_SERVICE")
    check(await c.call("bus.call", {**call, "target": "other.x"}), "NOT_AUTHORIZED")
    stale = f"svc-{int(incarnation[4:]) + 1000}"
    check(await c.call("bus.call", {**call, "target": "svc.a", "expectedIncarnation": stale}),
          "TARGET_CHANGED")
    check(await c.call("bus.cancel", {"callId": 10**6}), "INVALID_PARAMS")

    # an outbound frame over maxEnvelopeBytes: refused, the connection stays
    big = {**call, "target": "svc.a", "payload": {"pad": "x" * 65300}}
    check(await c.call("bus.call", big), "INVALID_ENVELOPE")

    # call 1 dispatched, call 2 queued, call 3 refused
    ok = {**call, "target": "svc.a"}
    assert "result" in await c.call("bus.call", ok)
    assert "result" in await c.call("bus.call", ok)
    check(await c.call("bus.call", ok), "BACKPRESSURE")

    # a second reply to the same delivery: CALL_GONE
    req = await svc.recv_notification("bus.request")
    assert (await svc.call("bus.reply", {"deliveryId": req["deliveryId"],
                                         "outcome": {}}))["result"] == {"routed": True}
    check(await svc.call("bus.reply", {"deliveryId": req["deliveryId"], "outcome": {}}),
          "CALL_GONE")
    # consumed and answered: the in-flight slot returns and call 2 is dispatched
    assert (await svc.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]}))[
        "result"] == {"released": 1}
    # released without reply: the caller's callFailed carries the same error shape
    req2 = await svc.recv_notification("bus.request")
    assert (await svc.call("bus.release", {"deliveryId": req2["deliveryId"]}))["result"] == {
        "released": True}
    failed = await c.recv_notification("bus.callFailed")
    assert _check_error_object(failed["error"]) == ("CALL_GONE", "dispatched")

    # refused hellos: the error response is the last frame
    v = await raw(r)
    check(await v.hello("e-ver", supported_majors=[2]), "VERSION_MISMATCH")
    u = await raw(r)
    check(await u.hello("unknown-client"), "NOT_AUTHORIZED")
    d = await raw(r)
    check(await d.hello("e-svc"), "CONFLICT")

    # a long unknown method name: the message stays within 512 characters
    check(await c.call("bus." + "n" * 2000, {}), "METHOD_NOT_FOUND")

    # bus.closing carries the same shape, dispatch unknown
    x = await _helloed(raw, r, "e-close")
    await x.send_obj(_request(1))
    closing = await x.expect_closing("INVALID_REQUEST")
    assert _check_error_object(closing) == ("INVALID_REQUEST", "unknown")
    seen["INVALID_REQUEST"] = "unknown"
    y = await _helloed(raw, r, "e-parse")
    await y.send_body(b'{"jsonrpc":"2.0","jsonrpc":"2.0","id":2,"method":"bus.stats"}')
    closing = await y.expect_closing("PARSE_ERROR")
    assert _check_error_object(closing) == ("PARSE_ERROR", "unknown")
    seen["PARSE_ERROR"] = "unknown"
    z = await _helloed(raw, r, "e-stop")
    await r.stop()
    closing = await z.expect_closing("ROUTER_LOST")
    assert _check_error_object(closing) == ("ROUTER_LOST", "unknown")
    seen["ROUTER_LOST"] = "unknown"

    assert set(seen) == set(SPEC_ERROR_CODES)
