"""Registrations and listing (wire.md §7.1, §7.2, §7.8; §20 tests 38-43)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from bus.errors import ERROR_CODES
from bus.policy import Policy, PolicyEntry

pytestmark = pytest.mark.timeout(10)

SVC_RE = re.compile(r"^svc-[1-9][0-9]*$")
SERVICE_KEYS = {"name", "serviceIncarnation", "owner", "maxQueued", "maxInFlight", "queued",
                "inFlight"}


def assert_error(msg: dict[str, Any], name: str, dispatch: str = "not-dispatched") -> None:
    """An error response with exactly the §4 members, the §15 code for `name` and `dispatch`."""
    assert set(msg) == {"jsonrpc", "id", "error"}, msg
    err = msg["error"]
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


async def register(c: Any, name: str, max_queued: int = 16,
                   max_in_flight: int = 4) -> dict[str, Any]:
    msg: dict[str, Any] = await c.call("bus.register", {
        "name": name, "maxQueued": max_queued, "maxInFlight": max_in_flight})
    return msg


def svc_number(incarnation: str) -> int:
    assert SVC_RE.match(incarnation), incarnation
    return int(incarnation[4:])


async def test_register_issues_fresh_incarnations(router: Any, raw: Any) -> None:
    r = await router()
    c = await client(raw, r, "w-1")
    first = result_of(await register(c, "worker.w-1"))
    assert first["name"] == "worker.w-1"
    a = svc_number(first["serviceIncarnation"])
    assert result_of(await c.call("bus.unregister", {
        "name": "worker.w-1", "serviceIncarnation": first["serviceIncarnation"]})) == {
        "removed": True}
    second = result_of(await register(c, "worker.w-1"))
    b = svc_number(second["serviceIncarnation"])
    assert b > a

    seen = [first["serviceIncarnation"], second["serviceIncarnation"]]
    current = second["serviceIncarnation"]
    for _ in range(100):
        assert result_of(await c.call("bus.unregister", {
            "name": "worker.w-1", "serviceIncarnation": current})) == {"removed": True}
        res = result_of(await register(c, "worker.w-1"))
        assert set(res) == {"name", "serviceIncarnation"}
        current = res["serviceIncarnation"]
        assert svc_number(current) > svc_number(seen[-1])
        seen.append(current)
    assert len(set(seen)) == len(seen) == 102
    # Another name on another connection also gets an incarnation never issued before.
    other = await client(raw, r, "w-2")
    res = result_of(await register(other, "worker.w-2"))
    assert res["serviceIncarnation"] not in seen


async def test_duplicate_registration_conflicts(router: Any, raw: Any) -> None:
    r = await router()
    a = await client(raw, r, "w-a")
    b = await client(raw, r, "w-b")
    held = result_of(await register(a, "worker.shared"))

    assert_error(await register(b, "worker.shared"), "CONFLICT")
    assert_error(await register(a, "worker.shared"), "CONFLICT")
    # Different capacities do not make it a different registration either.
    assert_error(await register(a, "worker.shared", max_queued=1, max_in_flight=1), "CONFLICT")

    # The holder is unchanged: no takeover, no second holder.
    listing = result_of(await b.call("bus.services", {"prefix": ""}))["services"]
    assert [(s["name"], s["serviceIncarnation"], s["owner"]["clientId"]) for s in listing] == [
        ("worker.shared", held["serviceIncarnation"], "w-a")]
    # Both connections stay usable after the refusals.
    result_of(await a.call("bus.stats", {}))
    result_of(await b.call("bus.stats", {}))
    assert r.stats()["services"] == 1


async def test_register_needs_grant(router: Any, raw: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="nogrant"),
        PolicyEntry(id="wild", register=("worker.*",)),
        PolicyEntry(id="w-*", register=("worker.{clientId}",)),
    ))
    r = await router(policy=policy)

    none = await client(raw, r, "nogrant")
    assert_error(await register(none, "worker.a"), "NOT_AUTHORIZED")

    wild = await client(raw, r, "wild")
    assert result_of(await register(wild, "worker.a"))["name"] == "worker.a"
    assert_error(await register(wild, "other.a"), "NOT_AUTHORIZED")

    w1 = await raw(r)
    hello = result_of(await w1.hello("w-1"))
    assert hello["grants"]["register"] == ["worker.w-1"]
    assert_error(await register(w1, "worker.w-2"), "NOT_AUTHORIZED")
    assert_error(await register(w1, "worker.w-1.extra"), "NOT_AUTHORIZED")
    assert_error(await register(w1, "worker.w-10"), "NOT_AUTHORIZED")
    assert result_of(await register(w1, "worker.w-1"))["name"] == "worker.w-1"

    names = [s["name"] for s in result_of(await none.call("bus.services", {}))["services"]]
    assert names == ["worker.a", "worker.w-1"]


async def test_register_check_order(router: Any, raw: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="nogrant"),
        PolicyEntry(id="ok", register=("worker.*",)),
    ))
    r = await router(policy=policy, maxServices=2)
    none = await client(raw, r, "nogrant")
    ok = await client(raw, r, "ok")

    # 2 (grant) before 3 (capacities).
    assert_error(await register(none, "worker.a", max_queued=17), "NOT_AUTHORIZED")
    # 3: maxQueued 17 > maxServiceQueued 16, and likewise maxInFlight.
    assert_error(await register(ok, "worker.a", max_queued=17), "QUOTA_EXCEEDED")
    assert_error(await register(ok, "worker.a", max_in_flight=17), "QUOTA_EXCEEDED")
    assert r.stats()["services"] == 0

    a = result_of(await register(ok, "worker.a", max_queued=16, max_in_flight=16))
    assert a["name"] == "worker.a"
    # 3 (capacities) before 4 (conflict).
    assert_error(await register(ok, "worker.a", max_queued=17), "QUOTA_EXCEEDED")
    result_of(await register(ok, "worker.b"))
    assert r.stats()["services"] == 2

    # 5: maxServices reached.
    assert_error(await register(ok, "worker.c"), "QUOTA_EXCEEDED")
    # 4 (conflict) before 5 (maxServices).
    assert_error(await register(ok, "worker.a"), "CONFLICT")
    # 2 (grant) before 5 (maxServices).
    assert_error(await register(none, "worker.c"), "NOT_AUTHORIZED")
    assert r.stats()["services"] == 2
    names = [s["name"] for s in result_of(await ok.call("bus.services", {}))["services"]]
    assert names == ["worker.a", "worker.b"]


async def test_unregister_requires_exact_match(router: Any, raw: Any) -> None:
    r = await router()
    a = await client(raw, r, "w-a")
    b = await client(raw, r, "w-b")
    inc = result_of(await register(a, "worker.a"))["serviceIncarnation"]
    wrong = f"svc-{svc_number(inc) + 1000}"

    async def unregister(c: Any, name: str, incarnation: str) -> dict[str, Any]:
        return result_of(await c.call("bus.unregister", {
            "name": name, "serviceIncarnation": incarnation}))

    assert await unregister(a, "worker.a", wrong) == {"removed": False}
    assert await unregister(b, "worker.a", inc) == {"removed": False}
    assert await unregister(a, "worker.nope", inc) == {"removed": False}
    listing = result_of(await a.call("bus.services", {}))["services"]
    assert [(s["name"], s["serviceIncarnation"]) for s in listing] == [("worker.a", inc)]

    assert await unregister(a, "worker.a", inc) == {"removed": True}
    assert result_of(await a.call("bus.services", {}))["services"] == []
    assert await unregister(a, "worker.a", inc) == {"removed": False}
    assert r.stats()["services"] == 0
    # The name is free at once.
    assert result_of(await register(b, "worker.a"))["serviceIncarnation"] != inc


async def test_services_listing(router: Any, raw: Any) -> None:
    r = await router()
    svc = await client(raw, r, "w-1", "w-1-inc-1")
    other = await client(raw, r, "w-2", "w-2-inc-1")
    caller = await client(raw, r, "node-a")

    inc_b = result_of(await register(svc, "worker.b", max_queued=5, max_in_flight=1))[
        "serviceIncarnation"]
    inc_a = result_of(await register(other, "worker.a", max_queued=3, max_in_flight=2))[
        "serviceIncarnation"]
    inc_n = result_of(await register(other, "node.x", max_queued=1, max_in_flight=1))[
        "serviceIncarnation"]
    result_of(await register(other, "workers", max_queued=1, max_in_flight=1))

    listing = result_of(await caller.call("bus.services", {}))["services"]
    assert [s["name"] for s in listing] == ["node.x", "worker.a", "worker.b", "workers"]
    for s in listing:
        assert set(s) == SERVICE_KEYS
        assert set(s["owner"]) == {"clientId", "clientIncarnation"}
    by_name = {s["name"]: s for s in listing}
    assert by_name["node.x"] == {
        "name": "node.x", "serviceIncarnation": inc_n,
        "owner": {"clientId": "w-2", "clientIncarnation": "w-2-inc-1"},
        "maxQueued": 1, "maxInFlight": 1, "queued": 0, "inFlight": 0}
    assert by_name["worker.b"] == {
        "name": "worker.b", "serviceIncarnation": inc_b,
        "owner": {"clientId": "w-1", "clientIncarnation": "w-1-inc-1"},
        "maxQueued": 5, "maxInFlight": 1, "queued": 0, "inFlight": 0}

    # Plain string prefix: "worker." excludes "workers"; "worker" includes it.
    filtered = result_of(await caller.call("bus.services", {"prefix": "worker."}))["services"]
    assert [s["name"] for s in filtered] == ["worker.a", "worker.b"]
    assert filtered[0]["serviceIncarnation"] == inc_a
    assert [s["name"] for s in result_of(
        await caller.call("bus.services", {"prefix": "worker"}))["services"]] == [
        "worker.a", "worker.b", "workers"]
    assert result_of(await caller.call("bus.services", {"prefix": "zzz"}))["services"] == []

    async def worker_b() -> dict[str, Any]:
        found = result_of(await caller.call("bus.services", {"prefix": "worker.b"}))["services"]
        assert len(found) == 1
        entry: dict[str, Any] = found[0]
        return entry

    # Live state: maxInFlight=1, two calls -> one in flight, one queued.
    ids = []
    for n in range(2):
        resp = await caller.call("bus.call", {"target": "worker.b", "expectedIncarnation": None,
                                              "method": "M", "payload": {"n": n}})
        ids.append(result_of(resp)["callId"])
    first = await svc.recv_notification("bus.request")
    assert first["callId"] == ids[0]
    entry = await worker_b()
    assert (entry["queued"], entry["inFlight"]) == (1, 1)

    # Reply and consume the first: the second is dispatched.
    result_of(await svc.call("bus.reply", {"deliveryId": first["deliveryId"], "outcome": {}}))
    result_of(await svc.call("bus.consumed", {"deliveryIds": [first["deliveryId"]]}))
    second = await svc.recv_notification("bus.request")
    assert second["callId"] == ids[1]
    entry = await worker_b()
    assert (entry["queued"], entry["inFlight"]) == (0, 1)

    result_of(await svc.call("bus.reply", {"deliveryId": second["deliveryId"], "outcome": {}}))
    result_of(await svc.call("bus.consumed", {"deliveryIds": [second["deliveryId"]]}))
    entry = await worker_b()
    assert (entry["queued"], entry["inFlight"]) == (0, 0)
    # Any client may list, and listing changes nothing.
    assert result_of(await svc.call("bus.services", {}))["services"] == result_of(
        await other.call("bus.services", {}))["services"]
