"""Route removal, disconnects and teardown (wire.md §8, §9.1, §10; §20 tests 75-81)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.bus.bus_raw import caller, serve

pytestmark = pytest.mark.timeout(10)

NO_SERVICE = -32003


async def admit(c: Any, target: str, payload: dict[str, Any] | None = None,
                expected: str | None = None) -> int:
    """`bus.call` and require admission; returns the callId."""
    resp = await c.call("bus.call", {"target": target, "expectedIncarnation": expected,
                                     "method": "Test.Op", "payload": payload or {}})
    assert "result" in resp, resp
    assert resp["result"]["callId"] == resp["id"]
    return int(resp["id"])


async def quiet_roundtrip(c: Any) -> list[dict[str, Any]]:
    """A `bus.stats` round trip; returns every notification read before its response."""
    notes: list[dict[str, Any]] = []
    resp = await c.call("bus.stats", {}, notes=notes)
    assert "result" in resp
    return notes


async def read_until_failed(c: Any, count: int) -> list[dict[str, Any]]:
    """Read frames until `count` bus.callFailed notifications have arrived."""
    frames: list[dict[str, Any]] = []
    while sum(1 for f in frames if f.get("method") == "bus.callFailed") < count:
        frames.append(await c.recv_obj())
    return frames


def failed_by_call(frames: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for f in frames:
        if f.get("method") == "bus.callFailed":
            assert f["params"]["callId"] not in out, "one terminal outcome per call"
            out[f["params"]["callId"]] = f["params"]
    return out


def assert_no_service(params: dict[str, Any], inc: str, dispatch: str) -> None:
    assert set(params) == {"callId", "serviceIncarnation", "error"}
    assert params["serviceIncarnation"] == inc
    err = params["error"]
    assert set(err) == {"code", "message", "data"}
    assert err["code"] == NO_SERVICE
    assert err["data"] == {"name": "NO_SERVICE", "dispatch": dispatch}


async def test_service_disconnect_fails_calls(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    s, inc = await serve(raw, r, "svc-1", "svc.a", max_in_flight=1)
    c1 = await caller(raw, r, "caller-1")
    c2 = await caller(raw, r, "caller-2")

    dispatched = await admit(c1, "svc.a")
    req = await s.recv_notification("bus.request")
    assert req["callId"] == dispatched
    queued1 = await admit(c1, "svc.a")
    queued2 = await admit(c2, "svc.a")
    st = r.stats()
    assert st["queuedCalls"] == 2 and st["dispatchedCalls"] == 1

    await s.close()

    frames1 = await read_until_failed(c1, 2)
    frames2 = await read_until_failed(c2, 1)
    for frames in (frames1, frames2):
        # exactly one routeRemoved, written before the callFailed frames it causes
        assert frames[0]["method"] == "bus.routeRemoved"
        assert frames[0]["params"] == {"name": "svc.a", "serviceIncarnation": inc,
                                       "reason": "disconnected"}
        assert [f["method"] for f in frames[1:]] == ["bus.callFailed"] * (len(frames) - 1)
    f1 = failed_by_call(frames1)
    assert set(f1) == {dispatched, queued1}
    assert_no_service(f1[dispatched], inc, "dispatched")
    assert_no_service(f1[queued1], inc, "not-dispatched")
    f2 = failed_by_call(frames2)
    assert set(f2) == {queued2}
    assert_no_service(f2[queued2], inc, "not-dispatched")

    # nothing more (no second routeRemoved, no second terminal outcome)
    assert await quiet_roundtrip(c1) == []
    assert await quiet_roundtrip(c2) == []
    st = await settle(r, lambda s: s["calls"] == 0 and s["services"] == 0)
    assert st["activeCalls"] == 0 and st["queuedCallBytes"] == 0


async def test_unregister_keeps_dispatched_calls_answerable(router: Any, raw: Any,
                                                          settle: Any) -> None:
    r = await router()
    s, inc = await serve(raw, r, "svc-1", "svc.a", max_in_flight=1)
    c = await caller(raw, r, "caller-1")
    dispatched = await admit(c, "svc.a", {"n": 1})
    req = await s.recv_notification("bus.request")
    assert req["callId"] == dispatched
    queued = await admit(c, "svc.a", {"n": 2})

    resp = await s.call("bus.unregister", {"name": "svc.a", "serviceIncarnation": inc})
    assert resp["result"] == {"removed": True}

    frames = await read_until_failed(c, 1)
    assert [f["method"] for f in frames] == ["bus.routeRemoved", "bus.callFailed"]
    assert frames[0]["params"] == {"name": "svc.a", "serviceIncarnation": inc,
                                   "reason": "unregistered"}
    failed = failed_by_call(frames)
    assert set(failed) == {queued}
    assert_no_service(failed[queued], inc, "not-dispatched")

    # the dispatched call stays answerable: the reply is routed and the result arrives
    resp = await s.call("bus.reply", {"deliveryId": req["deliveryId"],
                                      "outcome": {"answer": 1}})
    assert resp["result"] == {"routed": True}
    result = await c.recv_notification("bus.result")
    assert result["callId"] == dispatched
    assert result["serviceIncarnation"] == inc
    assert result["outcome"] == {"answer": 1}
    resp = await c.call("bus.consumed", {"deliveryIds": [result["deliveryId"]]})
    assert resp["result"] == {"released": 1}

    # the queued call never reached the service
    resp = await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]})
    assert resp["result"] == {"released": 1}
    assert await quiet_roundtrip(s) == []
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


async def test_release_after_unregister_is_no_service(router: Any, raw: Any,
                                                      settle: Any) -> None:
    r = await router()
    s, inc = await serve(raw, r, "svc-1", "svc.a")
    c = await caller(raw, r, "caller-1")
    call_id = await admit(c, "svc.a")
    req = await s.recv_notification("bus.request")
    resp = await s.call("bus.unregister", {"name": "svc.a", "serviceIncarnation": inc})
    assert resp["result"] == {"removed": True}
    removed = await c.recv_notification("bus.routeRemoved")
    assert removed["reason"] == "unregistered"

    resp = await s.call("bus.release", {"deliveryId": req["deliveryId"]})
    assert resp["result"] == {"released": True}
    failed = await c.recv_notification("bus.callFailed")
    assert failed["callId"] == call_id
    assert_no_service(failed, inc, "dispatched")
    assert await quiet_roundtrip(c) == []
    await settle(r, lambda st: st["calls"] == 0 and st["activeCalls"] == 0)


async def test_caller_disconnect_detaches(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc-1", "svc.a", max_in_flight=2)
    c1 = await caller(raw, r, "caller-1")
    gone = await admit(c1, "svc.a", {"who": "c1"})
    req = await s.recv_notification("bus.request")
    assert req["callId"] == gone and req["caller"]["clientId"] == "caller-1"

    await c1.close()
    st = await settle(r, lambda st: st["detachedCalls"] == 1 and st["clients"] == 1)
    assert st["calls"] == 1 and st["activeCalls"] == 0 and st["dispatchedCalls"] == 1

    resp = await s.call("bus.reply", {"deliveryId": req["deliveryId"], "outcome": {}})
    assert resp["result"] == {"routed": False}
    resp = await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]})
    assert resp["result"] == {"released": 1}

    # the service still serves another caller
    c2 = await caller(raw, r, "caller-2")
    call_id = await admit(c2, "svc.a", {"who": "c2"})
    req2 = await s.recv_notification("bus.request")
    assert req2["callId"] == call_id and req2["caller"]["clientId"] == "caller-2"
    resp = await s.call("bus.reply", {"deliveryId": req2["deliveryId"], "outcome": {"ok": 1}})
    assert resp["result"] == {"routed": True}
    result = await c2.recv_notification("bus.result")
    assert result["callId"] == call_id and result["outcome"] == {"ok": 1}
    await c2.call("bus.consumed", {"deliveryIds": [result["deliveryId"]]})
    await s.call("bus.consumed", {"deliveryIds": [req2["deliveryId"]]})

    st = await settle(r, lambda st: st["calls"] == 0)
    assert st["detachedCalls"] == 0
    assert st["counters"]["repliesUnrouted"] == 1
    assert st["counters"]["repliesRouted"] == 1


async def test_caller_disconnect_removes_queued_calls(router: Any, raw: Any,
                                                      settle: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc-1", "svc.a", max_in_flight=1)
    c1 = await caller(raw, r, "caller-1")
    first = await admit(c1, "svc.a")
    req = await s.recv_notification("bus.request")
    assert req["callId"] == first
    for _ in range(3):
        await admit(c1, "svc.a", {"queued": True})
    assert r.stats()["queuedCalls"] == 3

    await c1.close()
    st = await settle(r, lambda st: st["queuedCalls"] == 0 and st["clients"] == 1)
    assert st["calls"] == 1 and st["detachedCalls"] == 1 and st["queuedCallBytes"] == 0
    assert (await s.call("bus.services", {}))["result"]["services"][0]["queued"] == 0

    # free the in-flight slot: the next request the service sees is another caller's
    resp = await s.call("bus.reply", {"deliveryId": req["deliveryId"], "outcome": {}})
    assert resp["result"] == {"routed": False}
    notes: list[dict[str, Any]] = []
    await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]}, notes=notes)
    assert notes == []
    c2 = await caller(raw, r, "caller-2")
    call_id = await admit(c2, "svc.a")
    req2 = await s.recv_notification("bus.request")
    assert req2["callId"] == call_id and req2["caller"]["clientId"] == "caller-2"
    assert await quiet_roundtrip(s) == []
    st = r.stats()
    assert st["counters"]["callsAdmitted"] == 5


async def test_reconnect_revives_nothing(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc-1", "svc.s", max_in_flight=1)
    old = await raw(r)
    assert "result" in await old.hello("cli-a", "cli-a-inc-1")
    resp = await old.call("bus.register", {"name": "svc.old", "maxQueued": 4, "maxInFlight": 1})
    old_svc = resp["result"]["serviceIncarnation"]
    dispatched = await admit(old, "svc.s")
    req = await s.recv_notification("bus.request")
    assert req["callId"] == dispatched
    await admit(old, "svc.s")  # queued behind it

    await old.close()
    await settle(r, lambda st: st["clients"] == 1 and st["services"] == 1
                 and st["queuedCalls"] == 0)

    new = await raw(r)
    hello = await new.hello("cli-a", "cli-a-inc-2")
    assert "result" in hello

    # a late reply to the old call is not routed to the new connection
    resp = await s.call("bus.reply", {"deliveryId": req["deliveryId"], "outcome": {"x": 1}})
    assert resp["result"] == {"routed": False}
    await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]})
    assert await quiet_roundtrip(s) == []  # the old queued call is never delivered
    assert await quiet_roundtrip(new) == []  # no result or notification for old calls

    services = (await new.call("bus.services", {}))["result"]["services"]
    assert [svc["name"] for svc in services] == ["svc.s"]
    resp = await new.call("bus.call", {"target": "svc.old", "expectedIncarnation": old_svc,
                                       "method": "Test.Op", "payload": {}})
    assert resp["error"]["data"] == {"name": "NO_SERVICE", "dispatch": "not-dispatched"}
    st = await settle(r, lambda st: st["calls"] == 0)
    detail = [d for d in r.stats(detail=True)["connectionsDetail"] if d["clientId"] == "cli-a"]
    assert len(detail) == 1
    assert detail[0]["clientIncarnation"] == "cli-a-inc-2"
    assert detail[0]["services"] == [] and detail[0]["activeCalls"] == 0
    assert detail[0]["detachedCalls"] == 0 and detail[0]["openRequests"] == 0
    assert st["activeCalls"] == 0


async def test_routeremoved_only_to_attached_callers(router: Any, raw: Any,
                                                     settle: Any) -> None:
    r = await router()
    s = await caller(raw, r, "svc-1")
    incs = {}
    for name in ("svc.u", "svc.d"):
        resp = await s.call("bus.register", {"name": name, "maxQueued": 4, "maxInFlight": 2})
        incs[name] = resp["result"]["serviceIncarnation"]
    c1 = await caller(raw, r, "caller-1")
    c2 = await caller(raw, r, "caller-2")

    # c1's calls are dispatched, then cancelled: execution-unknown, detached
    c1_calls = [await admit(c1, "svc.u"), await admit(c1, "svc.d")]
    got = [await s.recv_notification("bus.request") for _ in range(2)]
    assert sorted(g["callId"] for g in got if g["caller"]["clientId"] == "caller-1") == c1_calls
    for call_id in c1_calls:
        resp = await c1.call("bus.cancel", {"callId": call_id})
        assert resp["result"] == {"state": "execution-unknown"}
    # c2's calls are dispatched and attached
    c2_u, c2_d = await admit(c2, "svc.u"), await admit(c2, "svc.d")
    got += [await s.recv_notification("bus.request") for _ in range(2)]
    st = r.stats()
    assert st["detachedCalls"] == 2 and st["dispatchedCalls"] == 4

    # unregister: only the attached caller hears of it
    resp = await s.call("bus.unregister", {"name": "svc.u", "serviceIncarnation": incs["svc.u"]})
    assert resp["result"] == {"removed": True}
    removed = await c2.recv_notification("bus.routeRemoved")
    assert removed == {"name": "svc.u", "serviceIncarnation": incs["svc.u"],
                       "reason": "unregistered"}
    assert await quiet_roundtrip(c1) == []

    # disconnect: c2 gets routeRemoved for svc.d, then a callFailed per dispatched call
    await s.close()
    frames = await read_until_failed(c2, 2)
    assert frames[0]["method"] == "bus.routeRemoved"
    assert frames[0]["params"] == {"name": "svc.d", "serviceIncarnation": incs["svc.d"],
                                   "reason": "disconnected"}
    assert [f["method"] for f in frames[1:]] == ["bus.callFailed", "bus.callFailed"]
    failed = failed_by_call(frames)
    assert set(failed) == {c2_u, c2_d}
    assert_no_service(failed[c2_u], incs["svc.u"], "dispatched")
    assert_no_service(failed[c2_d], incs["svc.d"], "dispatched")

    # the detached caller got no routeRemoved (and no callFailed) at all
    assert await quiet_roundtrip(c1) == []
    assert await quiet_roundtrip(c2) == []
    await settle(r, lambda st: st["calls"] == 0 and st["detachedCalls"] == 0)
