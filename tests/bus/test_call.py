"""Calls, replies, releases and credits (wire.md §7.3-§7.7, §8, §9; §20 tests 44-59)."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from bus.errors import ERROR_CODES
from bus.policy import Policy, PolicyEntry

pytestmark = pytest.mark.timeout(10)

REQUEST_KEYS = {"deliveryId", "callId", "caller", "target", "serviceIncarnation", "method",
                "payload"}
RESULT_KEYS = {"deliveryId", "callId", "serviceIncarnation", "responder", "outcome"}
CALL_FAILED_KEYS = {"callId", "serviceIncarnation", "error"}


def assert_error(msg: dict[str, Any], name: str, dispatch: str = "not-dispatched") -> None:
    """An error response with exactly the §4 members, the §15 code for `name` and `dispatch`."""
    assert set(msg) == {"jsonrpc", "id", "error"}, msg
    assert_error_obj(msg["error"], name, dispatch)


def assert_error_obj(err: dict[str, Any], name: str, dispatch: str) -> None:
    assert set(err) == {"code", "message", "data"}, err
    assert err["code"] == ERROR_CODES[name], err
    assert err["data"] == {"name": name, "dispatch": dispatch}, err


def result_of(msg: dict[str, Any]) -> dict[str, Any]:
    assert "result" in msg and "error" not in msg, msg
    result: dict[str, Any] = msg["result"]
    return result


async def client(raw: Any, r: Any, client_id: str, incarnation: str | None = None) -> Any:
    c = await raw(r)
    result_of(await c.hello(client_id, incarnation))
    return c


async def register(c: Any, name: str, max_queued: int = 16, max_in_flight: int = 4) -> str:
    res = result_of(await c.call("bus.register", {
        "name": name, "maxQueued": max_queued, "maxInFlight": max_in_flight}))
    incarnation: str = res["serviceIncarnation"]
    return incarnation


def call_params(target: str, payload: dict[str, Any] | None = None, method: str = "M",
                expected: str | None = None) -> dict[str, Any]:
    return {"target": target, "expectedIncarnation": expected, "method": method,
            "payload": payload if payload is not None else {}}


async def recv_note(c: Any, method: str, notes: list[dict[str, Any]] | None = None
                    ) -> dict[str, Any]:
    """The next notification `method`, checking the notification envelope is exact."""
    while True:
        msg = await c.recv_obj()
        assert "id" not in msg, f"unexpected response {msg}"
        assert set(msg) == {"jsonrpc", "method", "params"}, msg
        if msg["method"] == method:
            params: dict[str, Any] = msg["params"]
            return params
        if notes is not None:
            notes.append(msg)


async def drain_until_response(c: Any, method: str = "bus.stats") -> list[dict[str, Any]]:
    """Send a harmless request and return every notification that arrives before its
    response: proves (per-connection ordering) that nothing else was pending."""
    notes: list[dict[str, Any]] = []
    result_of(await c.call(method, {}, notes=notes))
    return notes


async def test_request_reply_roundtrip(router: Any, raw: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a", "node-a-inc-1")
    svc = await client(raw, r, "w-1", "w-1-inc-1")
    inc = await register(svc, "worker.w-1")
    payload = {"requestId": "req-3", "scope": None, "params": {"n": [1, 2.5, -3],
               "s": "é\u00e9\U0001f600", "big": 2**63, "t": True}}

    rid = await caller.request("bus.call", call_params("worker.w-1", payload, "Worker.Status",
                                                       inc))
    assert result_of(await caller.recv_response(rid)) == {
        "callId": rid, "serviceIncarnation": inc}

    req = await recv_note(svc, "bus.request")
    assert set(req) == REQUEST_KEYS
    assert req == {
        "deliveryId": "dlv-1",
        "callId": rid,
        "caller": {"clientId": "node-a", "clientIncarnation": "node-a-inc-1"},
        "target": "worker.w-1",
        "serviceIncarnation": inc,
        "method": "Worker.Status",
        "payload": payload,
    }

    outcome = {"type": "result", "requestId": "req-3", "result": {"x": [None, 0.125, "ü"]}}
    assert result_of(await svc.call("bus.reply", {
        "deliveryId": req["deliveryId"], "outcome": outcome})) == {"routed": True}

    res = await recv_note(caller, "bus.result")
    assert set(res) == RESULT_KEYS
    assert res == {
        "deliveryId": "dlv-1",
        "callId": rid,
        "serviceIncarnation": inc,
        "responder": {"clientId": "w-1", "clientIncarnation": "w-1-inc-1"},
        "outcome": outcome,
    }
    assert result_of(await caller.call("bus.consumed", {"deliveryIds": [res["deliveryId"]]})) \
        == {"released": 1}
    assert result_of(await svc.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]})) \
        == {"released": 1}
    stats = r.stats()
    assert (stats["calls"], stats["activeCalls"], stats["replyCapabilities"]) == (0, 0, 0)
    assert stats["counters"]["repliesRouted"] == 1


async def test_call_response_precedes_result(router: Any, raw: Any, sdk: Any) -> None:
    n_calls = 200
    r = await router(maxServiceQueued=n_calls, maxActiveCallsPerClient=n_calls)
    svc = await sdk(r, "w-1")

    async def handler(req: Any) -> dict[str, Any]:
        return {"echo": req.payload["n"]}

    await svc.register("worker.w-1", handler, max_queued=n_calls, max_in_flight=16)
    caller = await client(raw, r, "node-a")

    admitted: set[int] = set()
    results: dict[int, Any] = {}

    async def reader() -> None:
        while len(admitted) < n_calls or len(results) < n_calls:
            msg = await caller.recv_obj()
            if "id" in msg:
                call_id = result_of(msg)["callId"]
                assert call_id == msg["id"]
                admitted.add(call_id)
            else:
                assert msg["method"] == "bus.result", msg
                p = msg["params"]
                assert p["callId"] in admitted, f"result for {p['callId']} before its response"
                assert p["callId"] not in results
                results[p["callId"]] = p["outcome"]

    task = asyncio.create_task(reader())
    sent: dict[int, int] = {}
    for n in range(n_calls):
        rid = await caller.request("bus.call", call_params("worker.w-1", {"n": n}))
        sent[rid] = n
    await task
    assert admitted == set(sent)
    assert results == {rid: {"echo": n} for rid, n in sent.items()}


async def test_pinned_incarnation_target_changed(router: Any, raw: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    old_holder = await client(raw, r, "w-1")
    old = await register(old_holder, "worker.w-1")
    assert result_of(await old_holder.call("bus.unregister", {
        "name": "worker.w-1", "serviceIncarnation": old})) == {"removed": True}
    new_holder = await client(raw, r, "w-2")
    new = await register(new_holder, "worker.w-1")
    assert new != old

    refused = await caller.call("bus.call", call_params("worker.w-1", {"k": 1}, expected=old))
    assert_error(refused, "TARGET_CHANGED")
    stats = r.stats()
    assert (stats["calls"], stats["queuedCalls"], stats["activeCalls"]) == (0, 0, 0)
    assert stats["counters"]["callsRefused"] == 1
    assert stats["counters"]["callsAdmitted"] == 0

    # The re-registration by the same client is a replacement too.
    renewed = await register(old_holder, "worker.w-2")
    assert result_of(await old_holder.call("bus.unregister", {
        "name": "worker.w-2", "serviceIncarnation": renewed})) == {"removed": True}
    renewed2 = await register(old_holder, "worker.w-2")
    assert_error(await caller.call("bus.call", call_params("worker.w-2", expected=renewed)),
                 "TARGET_CHANGED")

    # The new holder receives nothing: the first request it ever sees is a later marker call.
    marker = result_of(await caller.call("bus.call", call_params("worker.w-1", {"marker": 1},
                                                                 expected=new)))
    req = await recv_note(new_holder, "bus.request")
    assert req["callId"] == marker["callId"]
    assert req["payload"] == {"marker": 1}
    assert req["deliveryId"] == "dlv-1"
    marker2 = result_of(await caller.call("bus.call", call_params("worker.w-2", {"m": 2},
                                                                  expected=renewed2)))
    req2 = await recv_note(old_holder, "bus.request")
    assert (req2["callId"], req2["deliveryId"]) == (marker2["callId"], "dlv-1")


async def test_unpinned_call_reaches_current_holder(router: Any, raw: Any,
                                                    settle: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    old_holder = await client(raw, r, "w-1", "w-1-inc-1")
    old = await register(old_holder, "worker.x")
    await old_holder.close()
    await settle(r, lambda s: s["services"] == 0)
    new_holder = await client(raw, r, "w-2", "w-2-inc-1")
    new = await register(new_holder, "worker.x")
    assert new != old

    admitted = result_of(await caller.call("bus.call", call_params("worker.x", {"v": 1})))
    assert admitted["serviceIncarnation"] == new
    req = await recv_note(new_holder, "bus.request")
    assert (req["callId"], req["serviceIncarnation"], req["payload"]) == (
        admitted["callId"], new, {"v": 1})
    result_of(await new_holder.call("bus.reply", {"deliveryId": req["deliveryId"],
                                                  "outcome": {"ok": True}}))
    res = await recv_note(caller, "bus.result")
    assert res["callId"] == admitted["callId"]
    assert res["serviceIncarnation"] == new
    assert res["responder"] == {"clientId": "w-2", "clientIncarnation": "w-2-inc-1"}
    assert res["outcome"] == {"ok": True}


async def test_unknown_target_no_service(router: Any, raw: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    msg = await caller.call("bus.call", call_params("worker.nobody", {"a": 1}))
    assert_error(msg, "NO_SERVICE", "not-dispatched")
    # Pinned to an incarnation, still NO_SERVICE (check 4 before 5).
    msg = await caller.call("bus.call", call_params("worker.nobody", expected="svc-5"))
    assert_error(msg, "NO_SERVICE", "not-dispatched")
    stats = r.stats()
    assert stats["counters"]["callsRefused"] == 2
    assert stats["counters"]["errors"]["NO_SERVICE"] == 2
    assert (stats["calls"], stats["activeCalls"]) == (0, 0)
    # The connection stays.
    result_of(await caller.call("bus.stats", {}))


async def test_call_needs_grant_and_prefix_is_not_a_route(router: Any, raw: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="nocall", register=("worker.*",)),
        PolicyEntry(id="caller", call=("worker.*",)),
        PolicyEntry(id="w-y", register=("worker.y",)),
    ))
    r = await router(policy=policy)
    holder = await client(raw, r, "w-y")
    await register(holder, "worker.y")
    nocall = await client(raw, r, "nocall")
    caller = await client(raw, r, "caller")

    # No call grant: refused even though the target exists (and even if it did not).
    assert_error(await nocall.call("bus.call", call_params("worker.y")), "NOT_AUTHORIZED")
    assert_error(await nocall.call("bus.call", call_params("worker.nobody")), "NOT_AUTHORIZED")
    # Outside the grant.
    assert_error(await caller.call("bus.call", call_params("other.y")), "NOT_AUTHORIZED")
    # A prefix grant is not a route: worker.x is granted but not registered.
    assert_error(await caller.call("bus.call", call_params("worker.x")), "NO_SERVICE")
    assert_error(await caller.call("bus.call", call_params("worker.")), "INVALID_PARAMS")

    # worker.y saw none of it: its first request is a later marker call.
    marker = result_of(await caller.call("bus.call", call_params("worker.y", {"marker": 1})))
    req = await recv_note(holder, "bus.request")
    assert (req["callId"], req["payload"], req["deliveryId"]) == (
        marker["callId"], {"marker": 1}, "dlv-1")
    assert r.stats()["counters"]["callsAdmitted"] == 1


async def test_fifo_dispatch_out_of_order_replies(router: Any, raw: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    svc = await client(raw, r, "w-1")
    await register(svc, "worker.w-1", max_in_flight=4)

    rids = [await caller.request("bus.call", call_params("worker.w-1", {"n": n}))
            for n in range(4)]
    for rid in rids:
        assert result_of(await caller.recv_response(rid))["callId"] == rid

    reqs = [await recv_note(svc, "bus.request") for _ in range(4)]
    assert [q["callId"] for q in reqs] == rids
    assert [q["payload"] for q in reqs] == [{"n": n} for n in range(4)]

    reply_ids = [await svc.request("bus.reply", {"deliveryId": q["deliveryId"],
                                                 "outcome": {"for": q["payload"]["n"]}})
                 for q in reversed(reqs)]
    for rid in reply_ids:
        assert result_of(await svc.recv_response(rid)) == {"routed": True}

    results = [await recv_note(caller, "bus.result") for _ in range(4)]
    assert [res["callId"] for res in results] == list(reversed(rids))
    for res in results:
        assert res["outcome"] == {"for": rids.index(res["callId"])}
    assert len({res["deliveryId"] for res in results}) == 4


async def test_out_of_order_replies_across_two_callers(router: Any, raw: Any) -> None:
    r = await router()
    svc = await client(raw, r, "w-1")
    await register(svc, "worker.w-1", max_queued=16, max_in_flight=16)
    callers = {"a": await client(raw, r, "caller-a", "caller-a-inc"),
               "b": await client(raw, r, "caller-b", "caller-b-inc")}

    # Interleaved: a0 b0 a1 b1 ...; the two connections' callIds overlap on purpose.
    sent: dict[str, dict[int, int]] = {"a": {}, "b": {}}
    for n in range(6):
        for who in ("a", "b"):
            c = callers[who]
            resp = await c.call("bus.call", call_params("worker.w-1", {"who": who, "n": n}))
            sent[who][result_of(resp)["callId"]] = n
    assert set(sent["a"]) == set(sent["b"])  # same callIds, different callers

    reqs = [await recv_note(svc, "bus.request") for _ in range(12)]
    assert [(q["payload"]["n"], q["payload"]["who"]) for q in reqs] == [
        (n, who) for n in range(6) for who in ("a", "b")]
    for q in reqs:
        who = q["payload"]["who"]
        assert q["caller"] == {"clientId": f"caller-{who}", "clientIncarnation":
                               f"caller-{who}-inc"}
        assert sent[who][q["callId"]] == q["payload"]["n"]

    order = list(range(12))
    random.Random(1234).shuffle(order)
    for i in order:
        q = reqs[i]
        assert result_of(await svc.call("bus.reply", {
            "deliveryId": q["deliveryId"], "outcome": {"echo": q["payload"]}})) == {
            "routed": True}

    for who, c in callers.items():
        got: dict[int, Any] = {}
        for _ in range(6):
            res = await recv_note(c, "bus.result")
            assert res["callId"] not in got
            got[res["callId"]] = res["outcome"]
        assert got == {cid: {"echo": {"who": who, "n": n}} for cid, n in sent[who].items()}
        assert await drain_until_response(c) == []


async def test_status_answers_while_another_handler_is_delayed(router: Any, sdk: Any) -> None:
    r = await router()
    worker = await sdk(r, "w-1")
    caller = await sdk(r, "node-a")
    started = asyncio.Event()
    gate = asyncio.Event()

    async def handler(req: Any) -> dict[str, Any]:
        if req.method == "Worker.Advance":
            started.set()
            await gate.wait()
            return {"advanced": req.payload["step"]}
        return {"status": "busy" if started.is_set() and not gate.is_set() else "idle"}

    await worker.register("worker.w-1", handler, max_in_flight=2)
    advance = asyncio.create_task(
        caller.call("worker.w-1", "Worker.Advance", {"step": 7}, timeout=8.0))
    await started.wait()

    t0 = time.monotonic()
    status = await caller.call("worker.w-1", "Worker.Status", {}, timeout=5.0)
    elapsed = time.monotonic() - t0
    assert status.outcome == {"status": "busy"}
    assert elapsed < 0.1, f"Status took {elapsed * 1000:.1f} ms"
    assert not advance.done()

    gate.set()
    res = await advance
    assert res.outcome == {"advanced": 7}
    assert res.responder.client_id == "w-1"
    assert res.call_id != status.call_id


async def test_second_reply_is_call_gone(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    svc = await client(raw, r, "w-1")
    await register(svc, "worker.w-1")
    cid = result_of(await caller.call("bus.call", call_params("worker.w-1")))["callId"]
    req = await recv_note(svc, "bus.request")

    assert result_of(await svc.call("bus.reply", {"deliveryId": req["deliveryId"],
                                                  "outcome": {"n": 1}})) == {"routed": True}
    assert_error(await svc.call("bus.reply", {"deliveryId": req["deliveryId"],
                                              "outcome": {"n": 2}}), "CALL_GONE")
    # A release after the reply finds no capability either.
    assert result_of(await svc.call("bus.release", {"deliveryId": req["deliveryId"]})) == {
        "released": False}

    res = await recv_note(caller, "bus.result")
    assert (res["callId"], res["outcome"]) == (cid, {"n": 1})
    assert result_of(await caller.call("bus.consumed", {"deliveryIds": [res["deliveryId"]]})) \
        == {"released": 1}
    assert await drain_until_response(caller) == []
    stats = await settle(r, lambda s: s["calls"] == 0)
    assert stats["counters"]["repliesRouted"] == 1
    assert stats["counters"]["repliesUnrouted"] == 0
    assert stats["counters"]["errors"]["CALL_GONE"] == 1
    assert stats["counters"]["callsFailed"] == 0


async def test_reply_with_never_issued_delivery_id(router: Any, raw: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    svc = await client(raw, r, "w-1")
    await register(svc, "worker.w-1")
    other = await client(raw, r, "w-2")
    cid = result_of(await caller.call("bus.call", call_params("worker.w-1")))["callId"]
    req = await recv_note(svc, "bus.request")
    assert req["deliveryId"] == "dlv-1"

    assert_error(await svc.call("bus.reply", {"deliveryId": "dlv-999", "outcome": {}}),
                 "INVALID_PARAMS")
    assert_error(await svc.call("bus.release", {"deliveryId": "dlv-999"}), "INVALID_PARAMS")
    # Another connection, which has received no deliveries, cannot spend w-1's dlv-1.
    assert_error(await other.call("bus.reply", {"deliveryId": "dlv-1",
                                                "outcome": {"forged": True}}),
                 "INVALID_PARAMS")
    assert_error(await other.call("bus.release", {"deliveryId": "dlv-1"}), "INVALID_PARAMS")
    assert r.stats()["replyCapabilities"] == 1

    # The caller received nothing from those: its first result is the real reply.
    result_of(await svc.call("bus.reply", {"deliveryId": "dlv-1", "outcome": {"real": True}}))
    notes: list[dict[str, Any]] = []
    res = await recv_note(caller, "bus.result", notes)
    assert notes == []
    assert (res["callId"], res["outcome"]) == (cid, {"real": True})
    assert r.stats()["counters"]["repliesRouted"] == 1


async def test_release_fails_call_with_call_gone(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    svc = await client(raw, r, "w-1")
    inc = await register(svc, "worker.w-1")
    cid = result_of(await caller.call("bus.call", call_params("worker.w-1")))["callId"]
    req = await recv_note(svc, "bus.request")

    assert result_of(await svc.call("bus.release", {"deliveryId": req["deliveryId"]})) == {
        "released": True}
    failed = await recv_note(caller, "bus.callFailed")
    assert set(failed) == CALL_FAILED_KEYS
    assert (failed["callId"], failed["serviceIncarnation"]) == (cid, inc)
    assert_error_obj(failed["error"], "CALL_GONE", "dispatched")

    assert result_of(await svc.call("bus.release", {"deliveryId": req["deliveryId"]})) == {
        "released": False}
    assert_error(await svc.call("bus.reply", {"deliveryId": req["deliveryId"],
                                              "outcome": {}}), "CALL_GONE")
    assert await drain_until_response(caller) == []
    # The call is over for the caller: its slot is free and a cancel finds nothing.
    assert result_of(await caller.call("bus.cancel", {"callId": cid})) == {"state": "call-gone"}
    stats = await settle(r, lambda s: s["calls"] == 0)
    assert stats["activeCalls"] == 0
    assert stats["counters"]["callsFailed"] == 1
    # The service is still live and serves the next call.
    cid2 = result_of(await caller.call("bus.call", call_params("worker.w-1")))["callId"]
    assert (await recv_note(svc, "bus.request"))["callId"] == cid2


async def test_in_flight_credit_needs_reply_and_consume(router: Any, raw: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    svc = await client(raw, r, "w-1")
    await register(svc, "worker.w-1", max_in_flight=1)
    cids = [result_of(await caller.call("bus.call", call_params("worker.w-1", {"n": n})))[
        "callId"] for n in range(3)]

    async def in_flight() -> tuple[int, int]:
        entry = result_of(await caller.call("bus.services", {"prefix": "worker.w-1"}))[
            "services"][0]
        return entry["queued"], entry["inFlight"]

    first = await recv_note(svc, "bus.request")
    assert first["callId"] == cids[0]
    assert await in_flight() == (2, 1)

    # Replied but not consumed: no credit.
    result_of(await svc.call("bus.reply", {"deliveryId": first["deliveryId"], "outcome": {}}))
    assert await drain_until_response(svc) == []
    assert await in_flight() == (2, 1)
    assert r.stats()["queuedCalls"] == 2
    # Consumed as well: the second call is dispatched.
    result_of(await svc.call("bus.consumed", {"deliveryIds": [first["deliveryId"]]}))
    second = await recv_note(svc, "bus.request")
    assert second["callId"] == cids[1]
    assert await in_flight() == (1, 1)

    # Consumed but not answered: no credit.
    assert result_of(await svc.call("bus.consumed", {"deliveryIds": [second["deliveryId"]]})) \
        == {"released": 1}
    assert await drain_until_response(svc) == []
    assert await in_flight() == (1, 1)
    assert r.stats()["queuedCalls"] == 1
    # Answered as well: the third call is dispatched.
    result_of(await svc.call("bus.reply", {"deliveryId": second["deliveryId"], "outcome": {}}))
    third = await recv_note(svc, "bus.request")
    assert third["callId"] == cids[2]
    assert await in_flight() == (0, 1)


async def test_no_automatic_retry_or_failover(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    svc = await client(raw, r, "w-1")
    inc = await register(svc, "worker.w-1")
    cid = result_of(await caller.call("bus.call", call_params("worker.w-1", {"job": 1})))[
        "callId"]
    req = await recv_note(svc, "bus.request")
    assert req["callId"] == cid
    await svc.close()

    notes: list[dict[str, Any]] = []
    failed = await recv_note(caller, "bus.callFailed", notes)
    assert [n["method"] for n in notes] == ["bus.routeRemoved"]
    assert notes[0]["params"] == {"name": "worker.w-1", "serviceIncarnation": inc,
                                  "reason": "disconnected"}
    assert (failed["callId"], failed["serviceIncarnation"]) == (cid, inc)
    assert_error_obj(failed["error"], "NO_SERVICE", "dispatched")

    # A replacement registered at once receives no request for the failed call.
    replacement = await client(raw, r, "w-2")
    new = await register(replacement, "worker.w-1")
    assert new != inc
    stats = await settle(r, lambda s: s["calls"] == 0)
    assert (stats["queuedCalls"], stats["activeCalls"]) == (0, 0)
    marker = result_of(await caller.call("bus.call", call_params("worker.w-1", {"marker": 1})))
    first = await recv_note(replacement, "bus.request")
    assert (first["callId"], first["payload"], first["deliveryId"]) == (
        marker["callId"], {"marker": 1}, "dlv-1")
    assert r.stats()["counters"]["callsAdmitted"] == 2


async def test_bus_never_deduplicates(router: Any, raw: Any) -> None:
    r = await router()
    caller = await client(raw, r, "node-a")
    svc = await client(raw, r, "w-1")
    await register(svc, "worker.w-1")
    payload = {"requestId": "req-1", "scope": None, "params": {"same": True}}

    first = result_of(await caller.call("bus.call", call_params("worker.w-1", payload, "W.Do")))
    second = result_of(await caller.call("bus.call", call_params("worker.w-1", payload, "W.Do")))
    assert first["callId"] != second["callId"]

    reqs = [await recv_note(svc, "bus.request") for _ in range(2)]
    assert [q["callId"] for q in reqs] == [first["callId"], second["callId"]]
    assert reqs[0]["payload"] == reqs[1]["payload"] == payload
    assert reqs[0]["deliveryId"] != reqs[1]["deliveryId"]
    for q in reqs:
        assert result_of(await svc.call("bus.reply", {"deliveryId": q["deliveryId"],
                                                      "outcome": {"same": True}})) == {
            "routed": True}
    results = [await recv_note(caller, "bus.result") for _ in range(2)]
    assert sorted(res["callId"] for res in results) == sorted(
        [first["callId"], second["callId"]])
    assert r.stats()["counters"]["callsAdmitted"] == 2


async def test_consumed_watermark_rules(router: Any, raw: Any, sdk: Any) -> None:
    r = await router(maxServiceQueued=128, maxActiveCallsPerClient=128)
    worker = await sdk(r, "w-1")

    async def handler(req: Any) -> dict[str, Any]:
        return {"n": req.payload["n"]}

    await worker.register("worker.w-1", handler, max_queued=128, max_in_flight=16)
    caller = await client(raw, r, "node-a")

    rids = [await caller.request("bus.call", call_params("worker.w-1", {"n": n}))
            for n in range(65)]
    results: list[dict[str, Any]] = []
    for rid in rids:
        result_of(await caller.recv_response(rid, notes=results))
    while len(results) < 65:
        results.append(await caller.recv_obj())
    assert {m["method"] for m in results} == {"bus.result"}
    dlvs = [m["params"]["deliveryId"] for m in results]
    assert sorted(dlvs) == sorted(f"dlv-{i}" for i in range(1, 66))
    stats = r.stats()
    assert (stats["activeCalls"], stats["repliedCalls"]) == (65, 65)

    # 65 ids in one batch (all issued): refused whole.
    assert_error(await caller.call("bus.consumed", {"deliveryIds": dlvs}), "INVALID_PARAMS")
    assert r.stats()["activeCalls"] == 65

    # A never-issued id refuses the whole batch; the valid id in it stays unreleased.
    assert_error(await caller.call("bus.consumed", {"deliveryIds": [dlvs[0], "dlv-66"]}),
                 "INVALID_PARAMS")
    assert_error(await caller.call("bus.consumed", {"deliveryIds": ["dlv-999", dlvs[0]]}),
                 "INVALID_PARAMS")
    assert r.stats()["activeCalls"] == 65

    assert result_of(await caller.call("bus.consumed", {"deliveryIds": dlvs[:64]})) == {
        "released": 64}
    assert result_of(await caller.call("bus.consumed", {"deliveryIds": dlvs[:64]})) == {
        "released": 0}
    assert r.stats()["activeCalls"] == 1
    assert result_of(await caller.call("bus.consumed", {"deliveryIds": [dlvs[0], dlvs[64]]})) \
        == {"released": 1}
    assert result_of(await caller.call("bus.consumed", {"deliveryIds": [dlvs[64]]})) == {
        "released": 0}
    stats = r.stats()
    assert (stats["activeCalls"], stats["calls"]) == (0, 0)
    # Duplicates within a batch are a params error.
    assert_error(await caller.call("bus.consumed", {"deliveryIds": [dlvs[1], dlvs[1]]}),
                 "INVALID_PARAMS")
