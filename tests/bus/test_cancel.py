"""bus.cancel (wire.md §7.6, §9, §17; §20 tests 60-67)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from bus.errors import ERROR_CODES, CallDeadlineExceeded, CallGone
from bus.schema import SCHEMA_ROOT
from tests.bus.bus_raw import answer, call_params, caller, consume, serve

pytestmark = pytest.mark.timeout(10)

CANCEL_STATES = ["cancelled-before-dispatch", "execution-unknown", "completed", "call-gone"]


# helpers ------------------------------------------------------------------------------------
async def admit(c: Any, target: str, payload: dict[str, Any] | None = None) -> int:
    """`bus.call` and require admission; returns the callId."""
    resp = await c.call("bus.call", call_params(target, payload))
    assert "result" in resp, resp
    assert resp["result"]["callId"] == resp["id"]
    return int(resp["id"])


async def cancel(c: Any, call_id: int, notes: list[dict[str, Any]] | None = None) -> str:
    resp = await c.call("bus.cancel", {"callId": call_id}, notes=notes)
    assert set(resp) == {"jsonrpc", "id", "result"}, resp
    assert set(resp["result"]) == {"state"}
    state: str = resp["result"]["state"]
    assert state in CANCEL_STATES
    return state


def call_ids(frames: list[dict[str, Any]]) -> list[int]:
    return [f["params"]["callId"] for f in frames if "callId" in f.get("params", {})]


def no_open_deliveries(r: Any) -> bool:
    detail = r.stats(True)["connectionsDetail"]
    return all(c["openRequests"] == 0 for c in detail)


# raw wire ---------------------------------------------------------------------------------
async def test_cancel_before_dispatch(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc-1", "svc.a", max_queued=4, max_in_flight=1)
    c = await caller(raw, r, "caller-1")

    busy = await admit(c, "svc.a", {"n": 1})
    req1 = await s.recv_notification("bus.request")
    assert req1["callId"] == busy
    queued = await admit(c, "svc.a", {"n": 2})
    before = await settle(r, lambda st: st["queuedCalls"] == 1 and st["dispatchedCalls"] == 1)
    assert before["activeCalls"] == 2 and before["calls"] == 2

    assert await cancel(c, queued) == "cancelled-before-dispatch"
    after = r.stats()
    assert after["activeCalls"] == before["activeCalls"] - 1
    assert after["queuedCalls"] == 0 and after["queuedCallBytes"] == 0
    assert after["calls"] == 1 and after["dispatchedCalls"] == 1
    assert after["counters"]["cancels"]["cancelled-before-dispatch"] == 1

    # Free the service's only in-flight slot: were the cancelled call still queued it would be
    # dispatched now. The next request the service sees must be a later call.
    assert await answer(s, req1, {"r": 1}) is True
    caller_frames: list[dict[str, Any]] = []
    result = await c.recv_notification("bus.result", notes=caller_frames)
    assert result["callId"] == busy
    assert await consume(c, result["deliveryId"]) == 1
    later = await admit(c, "svc.a", {"n": 3})
    svc_frames: list[dict[str, Any]] = []
    req3 = await s.recv_notification("bus.request", notes=svc_frames)
    assert req3["callId"] == later
    assert svc_frames == []
    # the caller never hears of the cancelled call again
    assert queued not in call_ids(caller_frames)
    assert await answer(s, req3) is True
    result = await c.recv_notification("bus.result", notes=caller_frames)
    assert result["callId"] == later
    assert caller_frames == []
    assert await consume(c, result["deliveryId"]) == 1
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


async def test_cancel_after_dispatch_is_execution_unknown(router: Any, raw: Any,
                                                          settle: Any) -> None:
    r = await router()
    s, inc = await serve(raw, r, "svc-1", "svc.a", max_in_flight=1)
    c = await caller(raw, r, "caller-1")

    call_id = await admit(c, "svc.a", {"n": 1})
    req = await s.recv_notification("bus.request")
    assert req["callId"] == call_id

    assert await cancel(c, call_id) == "execution-unknown"
    st = r.stats()
    assert st["detachedCalls"] == 1
    assert st["activeCalls"] == 0
    assert st["calls"] == 1
    # the service still holds the request and its reply capability
    assert st["dispatchedCalls"] == 1 and st["replyCapabilities"] == 1
    assert st["counters"]["cancels"]["execution-unknown"] == 1
    resp = await s.call("bus.services", {"prefix": "svc.a"})
    [entry] = resp["result"]["services"]
    assert entry["serviceIncarnation"] == inc and entry["inFlight"] == 1

    # the service is not told: its next frame is the reply's response, which is routed:false
    svc_frames: list[dict[str, Any]] = []
    rid = await s.request("bus.reply", {"deliveryId": req["deliveryId"], "outcome": {"late": 1}})
    resp = await s.recv_response(rid, notes=svc_frames)
    assert svc_frames == []
    assert resp["result"] == {"routed": False}
    st = r.stats()
    assert st["detachedCalls"] == 0 and st["calls"] == 0
    assert st["counters"]["repliesUnrouted"] == 1 and st["counters"]["repliesRouted"] == 0
    assert (await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]}))["result"] == {
        "released": 1}

    # the caller receives nothing more about it: a later call's result is the next delivery
    later = await admit(c, "svc.a", {"n": 2})
    req2 = await s.recv_notification("bus.request")
    assert req2["callId"] == later
    assert await answer(s, req2, {"ok": 2}) is True
    caller_frames: list[dict[str, Any]] = []
    result = await c.recv_notification("bus.result", notes=caller_frames)
    assert result["callId"] == later and result["outcome"] == {"ok": 2}
    assert caller_frames == []
    assert await consume(c, result["deliveryId"]) == 1
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


async def test_cancel_after_reply_is_completed(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    s, inc = await serve(raw, r, "svc-1", "svc.a")
    c = await caller(raw, r, "caller-1")

    call_id = await admit(c, "svc.a", {"n": 1})
    req = await s.recv_notification("bus.request")
    assert await answer(s, req, {"value": 42}) is True
    before = r.stats()
    assert before["repliedCalls"] == 1 and before["activeCalls"] == 1

    # the caller has not consumed (it may not even have read the result yet)
    notes: list[dict[str, Any]] = []
    assert await cancel(c, call_id, notes) == "completed"
    after = r.stats()
    for key in ("calls", "activeCalls", "repliedCalls", "detachedCalls", "dispatchedCalls"):
        assert after[key] == before[key], key  # nothing changes
    assert after["counters"]["cancels"]["completed"] == 1

    results = [n["params"] for n in notes if n["method"] == "bus.result"]
    if not results:
        results = [await c.recv_notification("bus.result", notes=notes)]
    [result] = results
    assert result["callId"] == call_id
    assert result["serviceIncarnation"] == inc
    assert result["outcome"] == {"value": 42}
    assert [n["method"] for n in notes if n["method"] != "bus.result"] == []
    assert await consume(c, result["deliveryId"]) == 1
    st = await settle(r, lambda st: st["calls"] == 0)
    assert st["activeCalls"] == 0 and st["repliedCalls"] == 0


async def test_cancel_unknown_or_finished_is_call_gone(router: Any, raw: Any,
                                                       settle: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc-1", "svc.a", max_queued=4, max_in_flight=1)
    c = await caller(raw, r, "caller-1")
    gone = 0

    # a refused callId (never admitted)
    resp = await c.call("bus.call", call_params("svc.nope"))
    assert resp["error"]["data"] == {"name": "NO_SERVICE", "dispatch": "not-dispatched"}
    assert await cancel(c, resp["id"]) == "call-gone"
    gone += 1
    # a request id that was not a call at all
    resp = await c.call("bus.stats", {})
    assert await cancel(c, resp["id"]) == "call-gone"
    gone += 1

    # a consumed call
    done = await admit(c, "svc.a", {"n": 1})
    req = await s.recv_notification("bus.request")
    assert await answer(s, req) is True
    result = await c.recv_notification("bus.result")
    assert result["callId"] == done
    assert await consume(c, result["deliveryId"]) == 1
    assert await cancel(c, done) == "call-gone"
    gone += 1

    # a failed call (released without reply → bus.callFailed)
    failed = await admit(c, "svc.a", {"n": 2})
    req = await s.recv_notification("bus.request")
    assert (await s.call("bus.release", {"deliveryId": req["deliveryId"]}))["result"] == {
        "released": True}
    assert (await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]}))["result"] == {
        "released": 1}
    note = await c.recv_notification("bus.callFailed")
    assert note["callId"] == failed
    assert note["error"]["data"] == {"name": "CALL_GONE", "dispatch": "dispatched"}
    assert await cancel(c, failed) == "call-gone"
    gone += 1

    # a second cancel, after execution-unknown (detached) and after cancelled-before-dispatch
    detached = await admit(c, "svc.a", {"n": 3})
    req = await s.recv_notification("bus.request")
    assert req["callId"] == detached
    queued = await admit(c, "svc.a", {"n": 4})
    await settle(r, lambda st: st["queuedCalls"] == 1)
    assert await cancel(c, detached) == "execution-unknown"
    assert await cancel(c, detached) == "call-gone"
    gone += 1
    assert await cancel(c, queued) == "cancelled-before-dispatch"
    assert await cancel(c, queued) == "call-gone"
    gone += 1

    # a callId that is not an earlier request id: equal to the cancel's own id, or later
    for offset in (0, 7):
        rid = c.next_id
        await c.request("bus.cancel", {"callId": rid + offset}, rid=rid)
        resp = await c.recv_response(rid)
        err = resp["error"]
        assert err["code"] == ERROR_CODES["INVALID_PARAMS"] == -32602
        assert err["data"] == {"name": "INVALID_PARAMS", "dispatch": "not-dispatched"}
    # the connection stays
    assert "result" in await c.call("bus.stats", {})

    cancels = r.stats()["counters"]["cancels"]
    assert cancels == {"cancelled-before-dispatch": 1, "execution-unknown": 1, "completed": 0,
                       "call-gone": gone}
    assert await answer(s, req) is False
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


def test_cancel_states_are_exactly_four() -> None:
    result = json.loads((SCHEMA_ROOT / "ops" / "bus.cancel.result.json").read_text("utf-8"))
    assert result["properties"]["state"]["enum"] == [
        "cancelled-before-dispatch",
        "execution-unknown",
        "completed",
        "call-gone",
    ]


# SDK deadlines ----------------------------------------------------------------------------
class Blocking:
    """A handler that records the calls it sees and blocks on `gate` until the test opens it."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.seen: list[int] = []
        self.routed: list[bool] = []
        self.replied = asyncio.Event()

    async def __call__(self, req: Any) -> dict[str, Any] | None:
        self.seen.append(req.call_id)
        self.entered.set()
        await self.gate.wait()
        self.routed.append(await req.reply({"callId": req.call_id}))
        self.replied.set()
        return None


async def test_sdk_deadline_on_queued_call(router: Any, sdk: Any, settle: Any) -> None:
    r = await router()
    service = await sdk(r, "svc-1")
    handler = Blocking()
    await service.register("svc.a", handler, max_queued=4, max_in_flight=1)
    client = await sdk(r, "caller-1")

    first = await client.start_call("svc.a", "Test.Block", {"n": 1})
    await handler.entered.wait()
    with pytest.raises(CallDeadlineExceeded) as info:
        await client.call("svc.a", "Test.Queued", {"n": 2}, timeout=0.2)
    exc = info.value
    assert isinstance(exc, CallGone)
    assert exc.name == "CALL_GONE" and exc.code == ERROR_CODES["CALL_GONE"]
    assert exc.cancel_state == "cancelled-before-dispatch"
    assert exc.dispatch == "not-dispatched"
    st = r.stats()
    assert st["queuedCalls"] == 0 and st["activeCalls"] == 1
    assert st["counters"]["cancels"]["cancelled-before-dispatch"] == 1

    handler.gate.set()
    res = await first.result()
    assert res.call_id == first.call_id and res.outcome == {"callId": first.call_id}
    later = await client.call("svc.a", "Test.Later", {"n": 3}, timeout=5.0)
    # the handler never saw the cancelled call
    assert handler.seen == [first.call_id, later.call_id]
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


async def test_sdk_deadline_on_dispatched_call(router: Any, sdk: Any, settle: Any) -> None:
    r = await router()
    service = await sdk(r, "svc-1")
    handler = Blocking()
    await service.register("svc.a", handler, max_in_flight=1)
    client = await sdk(r, "caller-1")

    with pytest.raises(CallDeadlineExceeded) as info:
        await client.call("svc.a", "Test.Block", {"n": 1}, timeout=0.5)
    exc = info.value
    assert isinstance(exc, CallGone)
    assert exc.name == "CALL_GONE"
    assert exc.cancel_state == "execution-unknown"
    assert exc.dispatch == "dispatched"
    assert handler.entered.is_set()
    st = r.stats()
    assert st["detachedCalls"] == 1 and st["activeCalls"] == 0
    assert st["counters"]["cancels"]["execution-unknown"] == 1

    # the handler finishes later: its reply is not routed and the record goes away
    handler.gate.set()
    await handler.replied.wait()
    assert handler.routed == [False]
    st = await settle(r, lambda st: st["calls"] == 0 and st["replyCapabilities"] == 0)
    assert st["detachedCalls"] == 0 and st["counters"]["repliesUnrouted"] == 1
    await settle(r, lambda _: no_open_deliveries(r))


async def test_task_cancellation_cancels_and_consumes_late_result(router: Any, raw: Any,
                                                                  sdk: Any,
                                                                  settle: Any) -> None:
    r = await router()
    service = await sdk(r, "svc-1")
    handler = Blocking()
    await service.register("svc.a", handler, max_in_flight=1)
    raw_svc, _ = await serve(raw, r, "svc-2", "svc.b")
    client = await sdk(r, "caller-1")

    # 1. cancelled while dispatched: the best-effort cancel detaches the call
    task = asyncio.create_task(client.call("svc.a", "Test.Block", {"n": 1}, timeout=None))
    await handler.entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    st = await settle(r, lambda st: st["counters"]["cancels"]["execution-unknown"] == 1)
    assert st["detachedCalls"] == 1 and st["activeCalls"] == 0
    handler.gate.set()
    await handler.replied.wait()
    assert handler.routed == [False]
    st = await settle(r, lambda st: st["calls"] == 0 and st["replyCapabilities"] == 0)
    assert st["detachedCalls"] == 0
    await settle(r, lambda _: no_open_deliveries(r))

    # 2. cancelled just after the service replied: the cancel finds the call Replied and the
    # late bus.result is still consumed by the SDK
    task = asyncio.create_task(client.call("svc.b", "Test.Late", {"n": 2}, timeout=None))
    req = await raw_svc.recv_notification("bus.request")
    rid = await raw_svc.request("bus.reply", {"deliveryId": req["deliveryId"],
                                              "outcome": {"late": True}})
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    resp = await raw_svc.recv_response(rid)
    routed = resp["result"]["routed"]
    assert (await raw_svc.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]}))[
        "result"] == {"released": 1}
    st = await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)
    # The reply reached the router before the task's cancel was even written, so the cancel
    # finds the call Replied (`completed`) and the bus.result arrives after the task ended.
    assert routed is True
    cancels = st["counters"]["cancels"]
    assert cancels["completed"] == 1 and cancels["execution-unknown"] == 1
    assert st["counters"]["repliesRouted"] == 1 and st["repliedCalls"] == 0
    assert cancels["call-gone"] == 0
    await settle(r, lambda _: no_open_deliveries(r))

    # the client is still fully usable
    later = client.call("svc.b", "Test.After", {"n": 3}, timeout=5.0)
    later_task = asyncio.create_task(later)
    req = await raw_svc.recv_notification("bus.request")
    assert await answer(raw_svc, req, {"after": 1}) is True
    assert (await later_task).outcome == {"after": 1}
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)
