"""Limits and backpressure (wire.md §7.3, §9.2, §14; §20 tests 68-74)."""

from __future__ import annotations

import contextlib
import struct
import time
from typing import Any

import orjson
import pytest

from bus import codec
from bus.errors import ERROR_CODES
from tests.bus.bus_raw import answer, call_params, caller, consume, serve

pytestmark = pytest.mark.timeout(10)

BACKPRESSURE = ERROR_CODES["BACKPRESSURE"]


# helpers ------------------------------------------------------------------------------------
async def admit(c: Any, target: str, payload: dict[str, Any] | None = None,
                notes: list[dict[str, Any]] | None = None) -> int:
    """`bus.call` and require admission; returns the callId (notifications go to `notes`)."""
    resp = await c.call("bus.call", call_params(target, payload), notes=notes)
    assert "result" in resp, resp
    assert resp["result"]["callId"] == resp["id"]
    return int(resp["id"])


def assert_backpressure(resp: dict[str, Any]) -> None:
    assert "result" not in resp, resp
    err = resp["error"]
    assert set(err) == {"code", "message", "data"}
    assert err["code"] == BACKPRESSURE
    assert err["data"] == {"name": "BACKPRESSURE", "dispatch": "not-dispatched"}


async def take_results(c: Any, count: int, notes: list[dict[str, Any]]) -> list[int]:
    """Collect `count` bus.result notifications (first from `notes`), consume each; returns
    their callIds in arrival order. Any other notification fails the test."""
    results = [n["params"] for n in notes if n.get("method") == "bus.result"]
    assert len(results) == len(notes), notes
    notes.clear()
    while len(results) < count:
        results.append(await c.recv_notification("bus.result", notes=notes))
        assert notes == [], notes
    assert len(results) == count
    for result in results:
        assert await consume(c, result["deliveryId"]) == 1
    return [res["callId"] for res in results]


def sized_payload(size: int) -> dict[str, Any]:
    """A payload whose encoded (compact) size is exactly `size` bytes."""
    payload = {"blob": "x" * (size - len(b'{"blob":""}'))}
    assert len(codec.encode(payload)) == size
    return payload


# tests --------------------------------------------------------------------------------------
async def test_service_queue_full(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    s, inc = await serve(raw, r, "svc-1", "svc.a", max_queued=2, max_in_flight=1)
    c = await caller(raw, r, "caller-1")

    first = await admit(c, "svc.a", {"n": 1})
    req1 = await s.recv_notification("bus.request")
    assert req1["callId"] == first
    second = await admit(c, "svc.a", {"n": 2})
    third = await admit(c, "svc.a", {"n": 3})
    st = await settle(r, lambda st: st["queuedCalls"] == 2 and st["dispatchedCalls"] == 1)
    assert st["activeCalls"] == 3

    t0 = time.monotonic()
    resp = await c.call("bus.call", call_params("svc.a", {"n": 4}))
    elapsed = time.monotonic() - t0
    assert_backpressure(resp)
    assert elapsed < 0.05, elapsed  # answered at once, never parked (§14.2)
    st = r.stats()
    assert st["queuedCalls"] == 2 and st["activeCalls"] == 3 and st["calls"] == 3
    assert st["counters"]["callsRefused"] == 1
    assert st["counters"]["errors"]["BACKPRESSURE"] == 1
    [entry] = (await c.call("bus.services", {"prefix": "svc.a"}))["result"]["services"]
    assert entry["serviceIncarnation"] == inc
    assert (entry["queued"], entry["inFlight"]) == (2, 1)

    # the queue drains in order; the refused call is never delivered
    assert await answer(s, req1) is True
    req2 = await s.recv_notification("bus.request")
    assert req2["callId"] == second
    assert await answer(s, req2) is True
    req3 = await s.recv_notification("bus.request")
    assert req3["callId"] == third
    assert await answer(s, req3) is True
    notes: list[dict[str, Any]] = []
    fifth = await admit(c, "svc.a", {"n": 5}, notes)
    req5 = await s.recv_notification("bus.request")
    assert req5["callId"] == fifth  # not the refused call
    assert await answer(s, req5) is True
    assert await take_results(c, 4, notes) == [first, second, third, fifth]
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


async def test_active_call_limit(router: Any, raw: Any, settle: Any) -> None:
    r = await router(maxActiveCallsPerClient=3)
    s, _ = await serve(raw, r, "svc-1", "svc.a", max_queued=8, max_in_flight=8)
    c = await caller(raw, r, "caller-1")

    ids = [await admit(c, "svc.a", {"n": i}) for i in range(3)]
    reqs = {}
    for _ in ids:
        req = await s.recv_notification("bus.request")
        reqs[req["callId"]] = req
    assert sorted(reqs) == ids
    assert_backpressure(await c.call("bus.call", call_params("svc.a", {"n": 3})))

    # a routed but unconsumed result still holds its slot
    assert await answer(s, reqs[ids[0]], {"n": 0}) is True
    result = await c.recv_notification("bus.result")
    assert result["callId"] == ids[0]
    assert_backpressure(await c.call("bus.call", call_params("svc.a", {"n": 4})))
    # consuming it frees the slot
    assert await consume(c, result["deliveryId"]) == 1
    admitted = await admit(c, "svc.a", {"n": 5})
    req = await s.recv_notification("bus.request")
    assert req["callId"] == admitted
    reqs[admitted] = req
    st = r.stats()
    assert st["activeCalls"] == 3
    assert_backpressure(await c.call("bus.call", call_params("svc.a", {"n": 6})))

    # detached calls do not count: cancel one dispatched call, and a new call fits
    resp = await c.call("bus.cancel", {"callId": ids[1]})
    assert resp["result"] == {"state": "execution-unknown"}
    st = r.stats()
    assert st["activeCalls"] == 2 and st["detachedCalls"] == 1
    another = await admit(c, "svc.a", {"n": 7})
    req = await s.recv_notification("bus.request")
    assert req["callId"] == another
    reqs[another] = req
    st = r.stats()
    assert st["activeCalls"] == 3 and st["detachedCalls"] == 1 and st["calls"] == 4
    assert_backpressure(await c.call("bus.call", call_params("svc.a", {"n": 8})))
    assert r.stats()["counters"]["errors"]["BACKPRESSURE"] == 4

    # clean up: answer everything, consume every result
    assert await answer(s, reqs[ids[1]]) is False
    for call_id in (ids[2], admitted, another):
        assert await answer(s, reqs[call_id]) is True
        result = await c.recv_notification("bus.result")
        assert result["callId"] == call_id
        assert await consume(c, result["deliveryId"]) == 1
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


async def test_active_limit_checked_before_target(router: Any, raw: Any) -> None:
    r = await router(maxActiveCallsPerClient=1)
    s, _ = await serve(raw, r, "svc-1", "svc.a")
    c = await caller(raw, r, "caller-1")
    await admit(c, "svc.a")
    await s.recv_notification("bus.request")

    # at the limit, even an unknown target is refused for backpressure (check 3 before 4)
    assert_backpressure(await c.call("bus.call", call_params("svc.nope")))
    # and a pinned call with a stale incarnation likewise (check 3 before 5)
    resp = await c.call("bus.call", {**call_params("svc.a"), "expectedIncarnation": "svc-1"})
    assert_backpressure(resp)
    # below the limit the same unknown target is NO_SERVICE
    other = await caller(raw, r, "caller-2")
    resp = await other.call("bus.call", call_params("svc.nope"))
    assert resp["error"]["data"] == {"name": "NO_SERVICE", "dispatch": "not-dispatched"}
    assert resp["error"]["code"] == ERROR_CODES["NO_SERVICE"]
    st = r.stats()
    assert st["activeCalls"] == 1 and st["calls"] == 1
    assert st["counters"]["errors"]["BACKPRESSURE"] == 2


async def test_queued_call_bytes_budget(router: Any, raw: Any, settle: Any) -> None:
    r = await router(maxEnvelopeBytes=65536, maxQueuedCallBytes=200000)
    s, _ = await serve(raw, r, "svc-1", "svc.a", max_queued=16, max_in_flight=1)
    c = await caller(raw, r, "caller-1")

    first = await admit(c, "svc.a", {"n": 1})
    req1 = await s.recv_notification("bus.request")
    assert req1["callId"] == first
    await settle(r, lambda st: st["dispatchedCalls"] == 1)
    assert r.stats()["queuedCallBytes"] == 0  # a dispatched call's payload no longer counts

    big = [sized_payload(60000) for _ in range(3)]
    queued = [await admit(c, "svc.a", p) for p in big]
    expected = sum(len(codec.encode(p)) for p in big)
    st = r.stats()
    assert st["queuedCalls"] == 3
    assert st["queuedCallBytes"] == expected == 180000

    # 180000 + 60000 > 200000
    resp = await c.call("bus.call", call_params("svc.a", sized_payload(60000)))
    assert_backpressure(resp)
    assert r.stats()["queuedCallBytes"] == expected
    # exactly up to the budget is admitted; anything more is not
    fits = sized_payload(200000 - expected)
    queued.append(await admit(c, "svc.a", fits))
    expected += len(codec.encode(fits))
    assert r.stats()["queuedCallBytes"] == expected == 200000
    assert_backpressure(await c.call("bus.call", call_params("svc.a", {})))
    st = r.stats()
    assert st["queuedCalls"] == 4 and st["counters"]["errors"]["BACKPRESSURE"] == 2

    # dispatch takes a payload out of the budget
    assert await answer(s, req1) is True
    req = await s.recv_notification("bus.request")
    assert req["callId"] == queued[0]
    assert req["payload"] == big[0]
    st = await settle(r, lambda st: st["queuedCalls"] == 3)
    assert st["queuedCallBytes"] == expected - 60000
    # a cancel does too
    notes: list[dict[str, Any]] = []
    resp = await c.call("bus.cancel", {"callId": queued[1]}, notes=notes)
    assert resp["result"] == {"state": "cancelled-before-dispatch"}
    assert r.stats()["queuedCallBytes"] == expected - 120000

    # drain the rest
    assert await answer(s, req) is True
    for call_id in (queued[2], queued[3]):
        req = await s.recv_notification("bus.request")
        assert req["callId"] == call_id
        assert await answer(s, req) is True
    assert await take_results(c, 4, notes) == [first, queued[0], queued[2], queued[3]]
    st = await settle(r, lambda st: st["calls"] == 0)
    assert st["queuedCallBytes"] == 0


async def test_slow_reader_does_not_block_router(router: Any, raw: Any, sdk: Any,
                                                 settle: Any) -> None:
    r = await router(maxServiceQueued=64)
    service = await sdk(r, "svc-1")

    async def handler(req: Any) -> dict[str, Any]:
        # large outcomes for the slow reader, so its results back up inside the router
        return {"blob": "y" * req.payload.get("fill", 0), "n": req.payload["n"]}

    await service.register("svc.a", handler, max_queued=64, max_in_flight=16)

    # a raw caller pipelines 64 calls (its whole active-call allowance) and never reads
    slow = await caller(raw, r, "slow-1")
    slow.writer.transport.pause_reading()  # from now on its socket is never read
    frames = b"".join(
        _frame({"jsonrpc": "2.0", "id": 100 + i, "method": "bus.call",
                "params": call_params("svc.a", {"n": i, "fill": 200000})})
        for i in range(64)
    )
    await slow.send_bytes(frames)
    slow.next_id = 100 + 64
    st = await settle(r, lambda st: st["repliedCalls"] == 64)
    assert st["activeCalls"] == 64 and st["calls"] == 64
    detail = {d["clientId"]: d for d in r.stats(True)["connectionsDetail"]}
    assert detail["slow-1"]["activeCalls"] == 64

    # everyone else keeps being served promptly
    fast = await sdk(r, "fast-1")
    watcher = await caller(raw, r, "watcher-1")
    for i in range(20):
        t0 = time.monotonic()
        res = await fast.call("svc.a", "Test.Fast", {"n": i}, timeout=5.0)
        elapsed = time.monotonic() - t0
        assert res.outcome == {"blob": "", "n": i}
        assert elapsed < 0.1, elapsed
        t0 = time.monotonic()
        resp = await watcher.call("bus.stats", {})
        elapsed = time.monotonic() - t0
        assert elapsed < 0.1, elapsed
        assert resp["result"]["repliedCalls"] >= 64
    # the slow reader's results are still pending, unconsumed, most of them not even written
    # (its writer waits for its transport; hello + 64 responses + 64 results would be 129)
    st = r.stats()
    assert st["repliedCalls"] >= 64
    detail = {d["clientId"]: d for d in r.stats(True)["connectionsDetail"]}
    assert detail["slow-1"]["activeCalls"] == 64
    assert detail["slow-1"]["framesOut"] < 1 + 64 + 64

    # once it reads again, everything arrives intact and can be consumed
    slow.writer.transport.resume_reading()
    responses: list[int] = []
    results: dict[int, str] = {}
    while len(responses) < 64 or len(results) < 64:
        msg = await slow.recv_obj()
        if "id" in msg:
            assert msg["result"]["callId"] == msg["id"]
            responses.append(msg["id"])
        else:
            assert msg["method"] == "bus.result"
            params = msg["params"]
            assert params["callId"] in responses  # the response precedes its result
            assert params["outcome"] == {"blob": "y" * 200000, "n": params["callId"] - 100}
            results[params["callId"]] = params["deliveryId"]
    assert responses == [100 + i for i in range(64)]
    assert sorted(results) == responses
    resp = await slow.call("bus.consumed", {"deliveryIds": list(results.values())})
    assert resp["result"] == {"released": 64}
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


async def test_control_lane_overflow_closes_client(router: Any, raw: Any, sdk: Any,
                                                   settle: Any) -> None:
    r = await router(maxControlFrames=8)
    service = await sdk(r, "svc-1")

    async def handler(req: Any) -> dict[str, Any]:
        return {"n": req.payload["n"]}

    await service.register("svc.a", handler)
    bystander = await sdk(r, "other-1")
    base = r.stats()
    closes_before = base["counters"]["closes"].get("QUOTA_EXCEEDED", 0)

    flood = await caller(raw, r, "flood-1")
    blob = b"".join(
        _frame({"jsonrpc": "2.0", "id": 10 + i, "method": "bus.stats", "params": {}})
        for i in range(10000)
    )
    flood.writer.transport.pause_reading()  # the client stops reading its socket altogether
    flood.writer.write(blob)  # pipelined; nothing is read until the router gives up
    st = await settle(r, lambda st: st["counters"]["closes"].get("QUOTA_EXCEEDED", 0)
                      == closes_before + 1)
    assert st["connections"] == base["connections"]  # flood-1 is closing
    flood.writer.transport.resume_reading()

    # drain what the router sent: stats responses in order, then bus.closing, then EOF
    ids: list[int] = []
    closing: dict[str, Any] | None = None
    while True:
        msg = await flood.recv_obj()
        if msg.get("method") == "bus.closing":
            closing = msg["params"]["error"]
            break
        assert msg["result"]["routerId"] == r.router_id
        ids.append(msg["id"])
    assert closing is not None
    assert closing["code"] == ERROR_CODES["QUOTA_EXCEEDED"]
    assert closing["data"] == {"name": "QUOTA_EXCEEDED", "dispatch": "unknown"}
    assert ids == list(range(10, 10 + len(ids)))
    assert len(ids) < 10000
    await flood.expect_eof()
    with contextlib.suppress(ConnectionError):
        await flood.writer.drain()

    st = await settle(r, lambda st: st["connections"] == base["connections"])
    assert st["counters"]["closes"].get("QUOTA_EXCEEDED", 0) == closes_before + 1
    assert st["counters"]["errors"]["QUOTA_EXCEEDED"] >= 1

    # other clients are unaffected
    for i in range(5):
        res = await bystander.call("svc.a", "Test.Echo", {"n": i}, timeout=5.0)
        assert res.outcome == {"n": i}
    stats = await bystander.stats()
    assert stats["clients"] == 2
    assert not bystander.closed and not service.closed


async def test_open_requests_per_client_bound(router: Any, raw: Any, settle: Any) -> None:
    r = await router(maxOpenRequestsPerClient=2)
    s, _ = await serve(raw, r, "svc-1", "svc.a", max_queued=8, max_in_flight=4)
    c = await caller(raw, r, "caller-1")

    ids = [await admit(c, "svc.a", {"n": i}) for i in range(3)]
    reqs = [await s.recv_notification("bus.request") for _ in range(2)]
    assert [q["callId"] for q in reqs] == ids[:2]
    st = await settle(r, lambda st: st["queuedCalls"] == 1 and st["dispatchedCalls"] == 2)
    assert st["activeCalls"] == 3
    [entry] = (await c.call("bus.services", {"prefix": "svc.a"}))["result"]["services"]
    # in-flight room remains (2 < 4): the connection bound is what holds the third call
    assert (entry["queued"], entry["inFlight"]) == (1, 2)
    detail = {d["clientId"]: d for d in r.stats(True)["connectionsDetail"]}
    assert detail["svc-1"]["openRequests"] == 2

    resp = await c.call("bus.cancel", {"callId": ids[2]})
    assert resp["result"] == {"state": "cancelled-before-dispatch"}
    st = r.stats()
    assert st["queuedCalls"] == 0 and st["activeCalls"] == 2

    # once an open request is answered and consumed, the next dispatch is a later call: the
    # cancelled one was never delivered
    assert await answer(s, reqs[0]) is True
    notes: list[dict[str, Any]] = []
    later = await admit(c, "svc.a", {"n": 9}, notes)
    svc_notes: list[dict[str, Any]] = []
    req = await s.recv_notification("bus.request", notes=svc_notes)
    assert req["callId"] == later and svc_notes == []
    for q in (reqs[1], req):
        assert await answer(s, q) is True
    assert await take_results(c, 3, notes) == [ids[0], ids[1], later]
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


def _frame(obj: dict[str, Any]) -> bytes:
    body = orjson.dumps(obj)
    return struct.pack("<I", len(body)) + body

