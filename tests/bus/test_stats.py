"""bus.stats (wire.md §7.9, §16; §20 tests 98-99)."""

from __future__ import annotations

from typing import Any

import pytest

from bus.client_connection import Validators

pytestmark = pytest.mark.timeout(10)

# wire.md §16, the example object and its prose.
STATS_KEYS = {
    "routerId", "uptimeMs", "connections", "pendingConnections", "clients", "services",
    "expectations", "calls", "activeCalls", "queuedCalls", "dispatchedCalls", "detachedCalls",
    "repliedCalls", "replyCapabilities", "queuedCallBytes", "counters", "connectionsDetail",
    "topics", "subscriptions", "queuedMessages", "queuedTopicBytes", "messageDeliveries",  # topics
    "store",  # docs/topics.md §10
}
COUNTER_KEYS = {
    "accepted", "refusedAtAccept", "helloOk", "helloRefused", "closed", "callsAdmitted",
    "callsRefused", "callsFailed", "repliesRouted", "repliesUnrouted", "cancels", "errors",
    "closes", "framesIn", "framesOut", "bytesIn", "bytesOut",
    "leanCalls", "leanReplies", "leanConsumed", "creditsCarried",  # §21.7
    "published", "publishRefused", "leanPublishes", "messagesDelivered", "messagesReplaced",
    "messagesDropped",  # docs/topics.md §10
    "artifactsAllocated", "artifactsSealed", "artifactsCollected", "sealsRefused",
    "bodiesForwardedRaw", "inlineReplies",  # §22.4
}
CANCEL_KEYS = {"cancelled-before-dispatch", "execution-unknown", "completed", "call-gone"}
DETAIL_KEYS = {
    "connectionId", "clientId", "clientIncarnation", "pid", "uid", "gid", "ageMs", "services",
    "activeCalls", "detachedCalls", "openRequests", "controlFrames", "controlBytes", "framesIn",
    "framesOut", "subscriptions", "messageDeliveries", "holds", "heldBytes", "allocations",
}


def _check_integers(stats: dict[str, Any]) -> None:
    for key in STATS_KEYS - {"routerId", "counters", "connectionsDetail", "store"}:
        assert type(stats[key]) is int and stats[key] >= 0, key
    counters = stats["counters"]
    for key in COUNTER_KEYS - {"cancels", "errors", "closes"}:
        assert type(counters[key]) is int and counters[key] >= 0, key
    for group in ("cancels", "errors", "closes"):
        for key, value in counters[group].items():
            assert type(value) is int and value >= 0, (group, key)


async def test_stats_fields_exact(router, raw, settle) -> None:
    r = await router()
    svc = await raw(r)
    hello = await svc.hello("stats-svc")
    assert "result" in hello
    reg = await svc.call("bus.register", {"name": "stats.svc", "maxQueued": 4, "maxInFlight": 2})
    assert "result" in reg
    await raw(r)  # an un-helloed connection: null identity fields in the detail
    await settle(r, lambda s: s["pendingConnections"] == 1)
    check = Validators.get().results["bus.stats"]

    for params in (None, {}, {"detail": False}):
        resp = await svc.call("bus.stats", params)
        stats = resp["result"]
        assert set(stats) == STATS_KEYS
        assert set(stats["counters"]) == COUNTER_KEYS
        assert set(stats["counters"]["cancels"]) == CANCEL_KEYS
        assert stats["connectionsDetail"] is None
        assert stats["routerId"] == r.router_id
        assert check(stats) is None
        _check_integers(stats)

    detail = (await svc.call("bus.stats", {"detail": True}))["result"]
    assert set(detail) == STATS_KEYS
    assert check(detail) is None
    rows = detail["connectionsDetail"]
    assert isinstance(rows, list)
    assert len(rows) == detail["connections"] == 2
    for row in rows:
        assert set(row) == DETAIL_KEYS
    numbers = [int(row["connectionId"].removeprefix("conn-")) for row in rows]
    assert numbers == sorted(numbers)
    mine = next(row for row in rows if row["clientId"] == "stats-svc")
    assert mine["connectionId"] == hello["result"]["connectionId"]
    assert mine["services"] == ["stats.svc"]
    other = next(row for row in rows if row["clientId"] is None)
    assert other["clientIncarnation"] is None
    assert detail["pendingConnections"] == 1
    assert detail["clients"] == 1
    assert detail["services"] == 1


async def test_stats_counts_follow_a_scenario(router, raw, settle) -> None:
    r = await router()
    svc = await raw(r)
    assert "result" in await svc.hello("sc-svc")
    assert "result" in await svc.call(
        "bus.register", {"name": "sc.svc", "maxQueued": 8, "maxInFlight": 4})
    caller = await raw(r)
    assert "result" in await caller.hello("sc-caller")

    def call_params(target: str, tag: str) -> dict[str, Any]:
        return {"target": target, "expectedIncarnation": None, "method": "M",
                "payload": {"tag": tag}}

    ids = {}
    for tag in "ABC":
        resp = await caller.call("bus.call", call_params("sc.svc", tag))
        assert "result" in resp, resp
        ids[tag] = resp["result"]["callId"]
    refused = await caller.call("bus.call", call_params("sc.none", "D"))
    assert refused["error"]["data"] == {"name": "NO_SERVICE", "dispatch": "not-dispatched"}

    deliveries: dict[str, str] = {}
    while len(deliveries) < 3:
        req = await svc.recv_notification("bus.request")
        deliveries[req["payload"]["tag"]] = req["deliveryId"]

    # B cancelled after dispatch
    cancel = await caller.call("bus.cancel", {"callId": ids["B"]})
    assert cancel["result"] == {"state": "execution-unknown"}
    # C released
    rel = await svc.call("bus.release", {"deliveryId": deliveries["C"]})
    assert rel["result"] == {"released": True}
    failed = await caller.recv_notification("bus.callFailed")
    assert failed["callId"] == ids["C"]
    assert failed["error"]["data"] == {"name": "CALL_GONE", "dispatch": "dispatched"}
    # A replied, and the caller consumes the result
    rep = await svc.call("bus.reply", {"deliveryId": deliveries["A"], "outcome": {"ok": 1}})
    assert rep["result"] == {"routed": True}
    result = await caller.recv_notification("bus.result")
    assert result["callId"] == ids["A"]
    consumed = await caller.call("bus.consumed", {"deliveryIds": [result["deliveryId"]]})
    assert consumed["result"] == {"released": 1}

    stats = await settle(r, lambda s: s["activeCalls"] == 0 and s["calls"] == 1)
    c = stats["counters"]
    assert c["callsAdmitted"] == 3
    assert c["callsRefused"] == 1
    assert c["callsFailed"] == 1
    assert c["cancels"] == {"cancelled-before-dispatch": 0, "execution-unknown": 1,
                           "completed": 0, "call-gone": 0}
    assert c["errors"] == {"NO_SERVICE": 1, "CALL_GONE": 1}
    assert c["repliesRouted"] == 1
    assert c["repliesUnrouted"] == 0
    assert stats["calls"] == 1
    assert stats["detachedCalls"] == 1
    assert stats["dispatchedCalls"] == 1  # B: dispatched, unreplied, detached
    assert stats["activeCalls"] == 0
    assert stats["queuedCalls"] == 0
    # the same numbers over the wire
    wire = (await caller.call("bus.stats"))["result"]
    for key in ("calls", "detachedCalls", "activeCalls", "queuedCalls"):
        assert wire[key] == stats[key], key
    for key in ("callsAdmitted", "callsRefused", "callsFailed", "repliesRouted", "cancels",
                "errors"):
        assert wire["counters"][key] == c[key], key

    # the service answers the detached call B
    late = await svc.call("bus.reply", {"deliveryId": deliveries["B"], "outcome": {"ok": 2}})
    assert late["result"] == {"routed": False}
    stats = await settle(r, lambda s: s["calls"] == 0)
    assert stats["counters"]["repliesUnrouted"] == 1
    assert stats["counters"]["repliesRouted"] == 1
    assert stats["detachedCalls"] == 0
    assert stats["activeCalls"] == 0
