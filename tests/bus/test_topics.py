"""Bus topics, minor 2 (docs/topics.md §1–§4, §7–§10; §17 tests 123-142).

Raw connections throughout, so every frame the router writes is seen in order. "Exactly n
messages arrive" is shown by a `bus.stats` round trip on the subscriber: whatever the router
wrote for it before that response is everything it had to write.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Awaitable
from typing import Any

import orjson
import pytest

import bus.client_connection as client_module
from bus.client_connection import Validators
from bus.policy import Policy, PolicyEntry
from tests.bus.conftest import store_dir

pytestmark = pytest.mark.timeout(10)

# wire.md §14.1 hello keys and docs/topics.md §8's topic keys, written out from the specs
HELLO_LIMIT_KEYS = {
    "maxEnvelopeBytes", "maxClients", "maxServices", "maxServiceQueued", "maxServiceInFlight",
    "maxActiveCallsPerClient", "maxOpenRequestsPerClient", "maxQueuedCallBytes",
    "maxControlFrames", "maxControlBytes", "maxConsumeBatch", "maxExpectations",
    "helloTimeoutMs",
    "maxTopics", "maxSubscribersPerTopic", "maxSubscriptionsPerClient", "maxBoundedDepth",
    "maxSubscriptionWindow", "maxQueuedTopicBytes",
    "maxAttachments", "maxArtifactBytes", "maxArtifacts", "maxStoreBytes",
    "maxHeldBytesPerClient", "maxHoldsPerClient", "maxAllocationsPerClient",
}
TOPIC_GAUGES = {"topics", "subscriptions", "queuedMessages", "queuedTopicBytes",
                "messageDeliveries"}
TOPIC_COUNTERS = {"published", "publishRefused", "leanPublishes", "messagesDelivered",
                  "messagesReplaced", "messagesDropped"}
TOPIC_DETAIL = {"subscriptions", "messageDeliveries"}
NO_TOPIC = -32010


def notify(c: Any, method: str, params: dict[str, Any]) -> Awaitable[None]:
    return c.send_obj({"jsonrpc": "2.0", "method": method, "params": params})


def error_name(resp: dict[str, Any]) -> str:
    assert "error" in resp, resp
    assert resp["error"]["data"]["dispatch"] == "not-dispatched", resp
    name: str = resp["error"]["data"]["name"]
    return name


async def helloed(raw: Any, r: Any, client_id: str) -> Any:
    c = await raw(r)
    assert "result" in await c.hello(client_id)
    return c


async def declare(c: Any, topic: str, retain: bool = False, max_bounded: int = 0) -> str:
    resp = await c.call("bus.declare", {"topic": topic, "retain": retain,
                                        "maxBounded": max_bounded})
    incarnation: str = resp["result"]["topicIncarnation"]
    return incarnation


async def publish(c: Any, topic: str, payload: dict[str, Any] | None = None,
                  expected: str | None = None) -> dict[str, Any]:
    resp: dict[str, Any] = await c.call("bus.publish", {
        "topic": topic, "expectedIncarnation": expected,
        "payload": payload if payload is not None else {}})
    return resp


async def subscribe(c: Any, topic: str, mode: str = "latest", window: int = 1,
                    depth: int | None = None, retained: bool = True) -> dict[str, Any]:
    params: dict[str, Any] = {"topic": topic, "mode": mode, "window": window,
                              "retained": retained}
    if depth is not None:
        params["depth"] = depth
    resp: dict[str, Any] = await c.call("bus.subscribe", params)
    return resp


async def pending(c: Any) -> list[dict[str, Any]]:
    """Every frame the router wrote `c` before the response to a new `bus.stats`."""
    notes: list[dict[str, Any]] = []
    rid = await c.request("bus.stats", {})
    resp = await c.recv_response(rid, notes=notes)
    assert "result" in resp, resp
    return notes


async def message(c: Any) -> dict[str, Any]:
    """The next frame, which must be a schema-valid `bus.message`."""
    msg = await c.recv_obj()
    assert msg.get("method") == "bus.message", msg
    params: dict[str, Any] = msg["params"]
    assert Validators.get().notifications["bus.message"](params) is None
    return params


async def consume(c: Any, *delivery_ids: str) -> int:
    resp = await c.call("bus.consumed", {"deliveryIds": list(delivery_ids)})
    released: int = resp["result"]["released"]
    return released


async def test_hello_announces_minor_2_store_grants_and_limits(router: Any, raw: Any) -> None:
    r = await router()
    c = await raw(r)
    result = (await c.hello("h2"))["result"]
    assert result["major"] == 1 and result["minor"] >= 2  # minor 3 (wire.md §22) keeps minor 2
    store = result["store"]  # docs/topics.md §5.1
    assert re.fullmatch(r"store-[0-9a-f]{16}", store["storeId"])
    assert store["path"] == store_dir(r) and os.stat(store["path"]).st_mode & 0o777 == 0o700
    for kind in ("publish", "subscribe", "manage"):
        assert result["grants"][kind] == ["*"]
    assert set(result["limits"]) == HELLO_LIMIT_KEYS
    assert Validators.get().results["bus.hello"](result) is None


async def test_declare_checks_in_order(router: Any, raw: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="own-*", manage=("t.*",)),
        PolicyEntry(id="nope", manage=("other.*",)),
    ))
    r = await router(policy=policy, maxTopics=2, maxSubscribersPerTopic=4)
    nope = await helloed(raw, r, "nope")
    a = await helloed(raw, r, "own-a")
    b = await helloed(raw, r, "own-b")
    resp = await nope.call("bus.declare", {"topic": "t.one"})
    assert error_name(resp) == "NOT_AUTHORIZED"
    resp = await a.call("bus.declare", {"topic": "t.one", "maxBounded": 5})
    assert error_name(resp) == "QUOTA_EXCEEDED"
    assert r.stats()["topics"] == 0
    first = await a.call("bus.declare", {"topic": "t.one"})
    assert first["result"]["topic"] == "t.one"
    assert first["result"]["topicIncarnation"].startswith("top-")
    for who in (a, b):
        resp = await who.call("bus.declare", {"topic": "t.one"})
        assert error_name(resp) == "CONFLICT"
    await declare(b, "t.two")
    resp = await a.call("bus.declare", {"topic": "t.three"})
    assert error_name(resp) == "QUOTA_EXCEEDED"
    assert r.stats()["topics"] == 2


async def test_publish_checks_and_sequences(router: Any, raw: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="pub", manage=("t.*",), publish=("t.*",)),
        PolicyEntry(id="mute", publish=("other.*",)),
    ))
    r = await router(policy=policy)
    p = await helloed(raw, r, "pub")
    mute = await helloed(raw, r, "mute")
    incarnation = await declare(p, "t.a")
    assert error_name(await publish(mute, "t.a")) == "NOT_AUTHORIZED"
    resp = await publish(p, "t.missing")
    assert error_name(resp) == "NO_TOPIC" and resp["error"]["code"] == NO_TOPIC
    assert error_name(await publish(p, "t.a", expected="top-1")) == "TARGET_CHANGED"
    first = (await publish(p, "t.a", expected=incarnation))["result"]
    assert first == {"topic": "t.a", "topicIncarnation": incarnation, "sequence": 1,
                     "latest": 0, "bounded": 0}
    assert (await publish(p, "t.a"))["result"]["sequence"] == 2
    assert r.stats()["counters"]["publishRefused"] == 3


async def test_sequences_are_per_topic_and_gapless(router: Any, raw: Any) -> None:
    r = await router(maxBoundedDepth=200)
    p1 = await helloed(raw, r, "p1")
    p2 = await helloed(raw, r, "p2")
    subs = {}
    for topic in ("t.a", "t.b"):
        await declare(p1, topic, max_bounded=1)
        subs[topic] = await helloed(raw, r, f"s-{topic}")
        assert "result" in await subscribe(subs[topic], topic, "bounded", window=16, depth=200)
    seqs: dict[str, list[int]] = {"t.a": [], "t.b": []}
    for n in range(100):
        for k, topic in enumerate(("t.a", "t.b")):
            pub = (p1, p2)[(n + k) % 2]  # both publishers on both topics, interleaved
            resp = await publish(pub, topic, {"n": n})
            seqs[topic].append(resp["result"]["sequence"])
    for topic, sub in subs.items():
        assert seqs[topic] == list(range(1, 101))
        got = []
        for _ in range(100):
            msg = await message(sub)
            got.append((msg["sequence"], msg["skipped"], msg["payload"]["n"]))
            await notify(sub, "bus.consumed", {"deliveryIds": [msg["deliveryId"]]})
        assert got == [(n + 1, 0, n) for n in range(100)]


async def test_latest_slot_replaces_and_never_refuses(router: Any, raw: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    s = await helloed(raw, r, "sub")
    await declare(p, "t.a")
    assert "result" in await subscribe(s, "t.a", window=1)
    highest = 0
    for n in range(1000):
        assert "result" in await publish(p, "t.a", {"n": n})
        highest = max(highest, r.stats()["queuedMessages"])
    assert highest <= 1
    first = await pending(s)
    assert [m["params"]["sequence"] for m in first] == [1]
    assert await consume(s, first[0]["params"]["deliveryId"]) == 1
    rest = await pending(s)
    assert [(m["params"]["sequence"], m["params"]["skipped"]) for m in rest] == [(1000, 998)]
    assert r.stats()["counters"]["messagesReplaced"] == 998


async def test_full_bounded_subscriber_refuses_the_whole_publish(router: Any, raw: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    bounded = await helloed(raw, r, "slow-bounded")
    latest = await helloed(raw, r, "slow-latest")
    await declare(p, "t.a", max_bounded=1)
    assert "result" in await subscribe(bounded, "t.a", "bounded", window=1, depth=2)
    assert "result" in await subscribe(latest, "t.a", window=1)
    for seq in (1, 2, 3):
        resp = await publish(p, "t.a", {"seq": seq})
        assert resp["result"]["sequence"] == seq
        assert (resp["result"]["latest"], resp["result"]["bounded"]) == (1, 1)
    refused = await publish(p, "t.a", {"seq": "refused"})
    assert error_name(refused) == "BACKPRESSURE"
    assert "slow-bounded" in refused["error"]["message"]
    first = await message(latest)
    assert first["sequence"] == 1
    assert await consume(latest, first["deliveryId"]) == 1
    then = await message(latest)
    assert (then["sequence"], then["skipped"], then["payload"]) == (3, 1, {"seq": 3})
    b1 = await message(bounded)
    assert await consume(bounded, b1["deliveryId"]) == 1
    assert (await publish(p, "t.a", {"seq": 4}))["result"]["sequence"] == 4


async def test_bounded_subscriptions_need_the_owners_allowance(router: Any, raw: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    s1 = await helloed(raw, r, "s1")
    s2 = await helloed(raw, r, "s2")
    await declare(p, "t.none")
    assert error_name(await subscribe(s1, "t.none", "bounded", depth=1)) == "QUOTA_EXCEEDED"
    assert "result" in await subscribe(s1, "t.none", "latest")
    await declare(p, "t.one", max_bounded=1)
    assert "result" in await subscribe(s1, "t.one", "bounded", depth=1)
    assert error_name(await subscribe(s2, "t.one", "bounded", depth=1)) == "QUOTA_EXCEEDED"


async def test_subscribe_checks_in_order(router: Any, raw: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="own", manage=("*",)),
        PolicyEntry(id="s-*", subscribe=("t.*",)),
        PolicyEntry(id="blind", subscribe=("other.*",)),
    ))
    r = await router(policy=policy, maxSubscriptionWindow=4, maxSubscribersPerTopic=1,
                     maxSubscriptionsPerClient=1)
    own = await helloed(raw, r, "own")
    s1 = await helloed(raw, r, "s-1")
    s2 = await helloed(raw, r, "s-2")
    blind = await helloed(raw, r, "blind")
    await declare(own, "t.a", max_bounded=1)
    await declare(own, "t.b")
    assert error_name(await subscribe(blind, "t.a")) == "NOT_AUTHORIZED"
    assert error_name(await subscribe(s1, "t.a", window=5)) == "QUOTA_EXCEEDED"
    assert error_name(await subscribe(s1, "t.missing", window=5)) == "QUOTA_EXCEEDED"
    assert error_name(await subscribe(s1, "t.missing")) == "NO_TOPIC"
    assert error_name(await subscribe(s1, "t.a", "latest", depth=2)) == "INVALID_PARAMS"
    assert error_name(await subscribe(s1, "t.a", "bounded")) == "INVALID_PARAMS"
    assert "result" in await subscribe(s1, "t.a")
    assert error_name(await subscribe(s1, "t.a")) == "CONFLICT"
    assert error_name(await subscribe(s2, "t.a")) == "QUOTA_EXCEEDED"  # per topic
    assert error_name(await subscribe(s1, "t.b")) == "QUOTA_EXCEEDED"  # per client
    assert r.stats()["subscriptions"] == 1


async def test_retained_value_comes_first(router: Any, raw: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    await declare(p, "t.kept", retain=True)
    await declare(p, "t.plain")
    for n in range(1, 6):
        await publish(p, "t.kept", {"n": n})
        await publish(p, "t.plain", {"n": n})
    s = await helloed(raw, r, "s-kept")
    resp = await subscribe(s, "t.kept")
    assert (resp["result"]["sequence"], resp["result"]["retained"]) == (5, True)
    first = await message(s)
    assert (first["sequence"], first["skipped"], first["payload"]) == (5, 0, {"n": 5})
    fresh = await helloed(raw, r, "s-fresh")
    resp = await subscribe(fresh, "t.kept", retained=False)
    assert (resp["result"]["sequence"], resp["result"]["retained"]) == (5, False)
    assert await pending(fresh) == []
    await publish(p, "t.kept", {"n": 6})
    assert (await message(fresh))["sequence"] == 6
    plain = await helloed(raw, r, "s-plain")
    resp = await subscribe(plain, "t.plain")
    assert (resp["result"]["sequence"], resp["result"]["retained"]) == (5, False)


async def test_subscribe_response_precedes_its_messages(router: Any, raw: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    await declare(p, "t.kept", retain=True)
    await publish(p, "t.kept", {"n": 1})
    s = await helloed(raw, r, "sub")
    frames = []
    for rid in range(2, 42):
        frames.append(orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": "bus.stats"}))
    frames.append(orjson.dumps({"jsonrpc": "2.0", "id": 42, "method": "bus.subscribe",
                                "params": {"topic": "t.kept", "mode": "latest"}}))
    await s.send_bytes(b"".join(len(f).to_bytes(4, "little") + f for f in frames))
    seen = [await s.recv_obj() for _ in range(42)]
    kinds = [m.get("id", m.get("method")) for m in seen]
    assert kinds.index(42) < kinds.index("bus.message")
    assert kinds == [*range(2, 43), "bus.message"]


async def test_window_credits(router: Any, raw: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    s = await helloed(raw, r, "sub")
    await declare(p, "t.a", max_bounded=1)
    assert "result" in await subscribe(s, "t.a", "bounded", window=3, depth=10)
    for n in range(10):
        await publish(p, "t.a", {"n": n})
    first = await pending(s)
    assert [m["params"]["sequence"] for m in first] == [1, 2, 3]
    ids = [m["params"]["deliveryId"] for m in first]
    # a never-issued id refuses the whole batch and releases nothing
    resp = await s.call("bus.consumed", {"deliveryIds": [ids[0], "dlv-999999"]})
    assert error_name(resp) == "INVALID_PARAMS"
    assert r.stats()["messageDeliveries"] == 3
    assert await pending(s) == []
    # request form
    assert await consume(s, ids[0]) == 1
    assert [m["params"]["sequence"] for m in await pending(s)] == [4]
    # notification form
    await notify(s, "bus.consumed", {"deliveryIds": [ids[1]]})
    assert (await message(s))["sequence"] == 5
    assert await pending(s) == []
    # carried by a lean call (refused: no such service; the credit is released first)
    await s.send_obj({"jsonrpc": "2.0", "method": "bus.call", "params": {
        "callId": s.next_id, "target": "nobody.here", "expectedIncarnation": None,
        "method": "X", "payload": {}, "consumed": [ids[2]]}})
    s.next_id += 1
    got = [await s.recv_obj(), await s.recv_obj()]
    assert [m["method"] for m in got] == ["bus.callFailed", "bus.message"]  # control first
    assert got[1]["params"]["sequence"] == 6
    assert r.stats()["counters"]["creditsCarried"] == 1


async def test_topic_lane_gets_one_frame_after_sixteen(router: Any, raw: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    s = await helloed(raw, r, "sub")
    await declare(p, "t.a", max_bounded=1)
    assert "result" in await subscribe(s, "t.a", "bounded", window=16, depth=32)
    for n in range(32):
        await publish(p, "t.a", {"n": n})
    first = [await message(s) for _ in range(16)]
    ids = [m["deliveryId"] for m in first]
    frames = [orjson.dumps({"jsonrpc": "2.0", "id": s.next_id, "method": "bus.consumed",
                            "params": {"deliveryIds": ids}})]
    for rid in range(s.next_id + 1, s.next_id + 32):
        frames.append(orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": "bus.stats"}))
    s.next_id += 32
    await s.send_bytes(b"".join(len(f).to_bytes(4, "little") + f for f in frames))
    seen = [await s.recv_obj() for _ in range(48)]
    shape = ["response" if "id" in m else m["method"] for m in seen]
    assert shape == (["response"] * 16 + ["bus.message"] + ["response"] * 16
                     + ["bus.message"] * 15)
    sequences = [m["params"]["sequence"] for m in seen if "id" not in m]
    assert sequences == list(range(17, 33))


async def test_unsubscribe_drops_undelivered_messages(router: Any, raw: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    s = await helloed(raw, r, "sub")
    await declare(p, "t.a", max_bounded=1)
    assert "result" in await subscribe(s, "t.a", "bounded", window=1, depth=8)
    for n in range(6):
        await publish(p, "t.a", {"n": n})
    written = await message(s)
    assert r.stats()["queuedMessages"] == 5
    resp = await s.call("bus.unsubscribe", {"topic": "t.a"})
    assert resp["result"] == {"removed": True}
    stats = r.stats()
    assert stats["queuedMessages"] == 0 and stats["counters"]["messagesDropped"] == 5
    assert await pending(s) == []
    assert await consume(s, written["deliveryId"]) == 1
    assert await pending(s) == []
    resp = await s.call("bus.unsubscribe", {"topic": "t.a"})
    assert resp["result"] == {"removed": False}


async def test_topic_removal_drains_then_notifies(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "owner")
    other = await helloed(raw, r, "other")
    s = await helloed(raw, r, "sub")
    old = await declare(p, "t.a", max_bounded=1)
    assert "result" in await subscribe(s, "t.a", "bounded", window=1, depth=8)
    for n in range(4):
        await publish(p, "t.a", {"n": n})
    first = await message(s)
    assert r.stats()["queuedMessages"] == 3
    resp = await other.call("bus.undeclare", {"topic": "t.a", "topicIncarnation": old})
    assert resp["result"] == {"removed": False}
    resp = await p.call("bus.undeclare", {"topic": "t.a", "topicIncarnation": "top-1"})
    assert resp["result"] == {"removed": False}
    resp = await p.call("bus.undeclare", {"topic": "t.a", "topicIncarnation": old})
    assert resp["result"] == {"removed": True}
    new = await declare(p, "t.a")
    assert new != old
    resubscribed = await subscribe(s, "t.a")
    assert resubscribed["result"]["topicIncarnation"] == new
    got = [first["payload"]["n"]]
    await notify(s, "bus.consumed", {"deliveryIds": [first["deliveryId"]]})
    while True:
        msg = await s.recv_obj()
        if msg["method"] == "bus.topicRemoved":
            break
        got.append(msg["params"]["payload"]["n"])
        await notify(s, "bus.consumed", {"deliveryIds": [msg["params"]["deliveryId"]]})
    assert got == [0, 1, 2, 3]
    assert msg["params"] == {"topic": "t.a", "topicIncarnation": old, "reason": "undeclared"}
    assert Validators.get().notifications["bus.topicRemoved"](msg["params"]) is None
    await p.close()
    removed = await s.recv_notification("bus.topicRemoved")
    assert removed == {"topic": "t.a", "topicIncarnation": new, "reason": "disconnected"}
    await settle(r, lambda st: st["topics"] == 0 and st["subscriptions"] == 0)


async def test_subscriber_end_unblocks_publishers(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    s = await helloed(raw, r, "sub")
    await declare(p, "t.a", max_bounded=1)
    assert "result" in await subscribe(s, "t.a", "bounded", window=1, depth=1)
    await publish(p, "t.a")
    await publish(p, "t.a")
    assert error_name(await publish(p, "t.a", {"again": True})) == "BACKPRESSURE"
    await s.close()
    await settle(r, lambda st: st["subscriptions"] == 0)
    assert (await publish(p, "t.a", {"again": True}))["result"]["sequence"] == 3


async def test_lean_publish(router: Any, raw: Any, settle: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="pub*", manage=("t.*",), publish=("t.*",), subscribe=("t.*",)),
    ))
    r = await router(policy=policy)
    p = await helloed(raw, r, "pub")
    s = await helloed(raw, r, "pub-sub")
    await declare(p, "t.a", max_bounded=1)
    assert "result" in await subscribe(s, "t.a", "bounded", window=1, depth=1)

    def frames_out() -> int:
        rows = r.stats(detail=True)["connectionsDetail"]
        out: int = next(row["framesOut"] for row in rows if row["clientId"] == "pub")
        return out

    before = frames_out()
    await notify(p, "bus.publish", {"topic": "t.a", "expectedIncarnation": None,
                                    "payload": {"n": 1}})
    stats = await settle(r, lambda st: st["counters"]["published"] == 1)
    assert stats["counters"]["leanPublishes"] == 1
    assert frames_out() == before
    await notify(p, "bus.publish", {"topic": "t.a", "expectedIncarnation": None,
                                    "payload": {"n": 2}})  # queued: depth 1 is now full

    async def refused(params: dict[str, Any], name: str, incarnation: str | None) -> None:
        await notify(p, "bus.publish", params)
        failed = await p.recv_notification("bus.publishFailed")
        assert Validators.get().notifications["bus.publishFailed"](failed) is None
        assert failed["topic"] == params["topic"]
        assert failed["topicIncarnation"] == incarnation
        assert failed["error"]["data"] == {"name": name, "dispatch": "not-dispatched"}

    topics = (await p.call("bus.topics", {}))["result"]["topics"]
    incarnation = topics[0]["topicIncarnation"]
    await refused({"topic": "t.none", "expectedIncarnation": None, "payload": {}},
                  "NO_TOPIC", None)
    await refused({"topic": "x.y", "expectedIncarnation": None, "payload": {}},
                  "NOT_AUTHORIZED", None)
    await refused({"topic": "t.a", "expectedIncarnation": None, "payload": {}},
                  "BACKPRESSURE", incarnation)
    await refused({"topic": "t.a", "payload": {}}, "INVALID_PARAMS", incarnation)
    assert r.stats()["counters"]["leanPublishes"] == 6
    await notify(p, "bus.publish", {"topic": 7, "expectedIncarnation": None, "payload": {}})
    await p.expect_closing("INVALID_REQUEST")
    await notify(s, "bus.subscribe", {"topic": "t.a", "mode": "latest"})
    await s.expect_closing("INVALID_REQUEST")


async def test_publish_frame_size(router: Any, raw: Any) -> None:
    r = await router(maxEnvelopeBytes=65536)
    p = await raw(r)
    assert "result" in await p.hello("pub", "pub-inc")
    s = await helloed(raw, r, "sub")
    incarnation = await declare(p, "t.a")
    assert "result" in await subscribe(s, "t.a")

    def worst(n: int) -> int:
        """The worst-case bus.message of payload {"x": "a" * n} (docs/topics.md §3.4 #10)."""
        return len(orjson.dumps({"jsonrpc": "2.0", "method": "bus.message", "params": {
            "deliveryId": f"dlv-{2**53 - 1}", "topic": "t.a", "topicIncarnation": incarnation,
            "sequence": 1, "skipped": 2**53 - 1,
            "publisher": {"clientId": "pub", "clientIncarnation": "pub-inc"},
            "payload": {"x": "a" * n}}}))

    n = 65536 - worst(0)
    assert worst(n) == 65536
    resp = await publish(p, "t.a", {"x": "a" * (n + 1)})
    assert error_name(resp) == "INVALID_ENVELOPE"
    assert (await p.call("bus.topics", {}))["result"]["topics"][0]["sequence"] == 0
    resp = await publish(p, "t.a", {"x": "a" * n})
    assert resp["result"]["sequence"] == 1
    delivered = await message(s)
    assert delivered["payload"] == {"x": "a" * n}


async def test_queued_topic_bytes_budget(router: Any, raw: Any, settle: Any) -> None:
    """The written delivery holding the subscriber's one credit is no longer queued (§10), so
    a small first publish takes it and the large ones stay queued."""
    r = await router(maxEnvelopeBytes=65536, maxQueuedTopicBytes=200000)
    p = await helloed(raw, r, "pub")
    s = await helloed(raw, r, "sub")
    await declare(p, "t.a", max_bounded=1)
    assert "result" in await subscribe(s, "t.a", "bounded", window=1, depth=10)
    await publish(p, "t.a", {"small": True})
    big = [{"x": str(k) * 60000} for k in range(4)]
    for payload in big[:3]:
        assert "result" in await publish(p, "t.a", payload)
    assert error_name(await publish(p, "t.a", big[3])) == "BACKPRESSURE"
    assert r.stats()["queuedTopicBytes"] == sum(len(orjson.dumps(b)) for b in big[:3])
    await s.close()
    await settle(r, lambda st: st["queuedTopicBytes"] == 0)

    await declare(p, "t.b")
    latest = [await helloed(raw, r, f"l-{k}") for k in range(5)]
    for c in latest:
        assert "result" in await subscribe(c, "t.b")
    await publish(p, "t.b", {"small": True})
    resp = await publish(p, "t.b", big[0])
    assert resp["result"]["latest"] == 5
    assert r.stats()["queuedTopicBytes"] == len(orjson.dumps(big[0]))


async def test_topics_listing(router: Any, raw: Any) -> None:
    r = await router()
    p = await raw(r)
    assert "result" in await p.hello("own", "own-inc")
    s1 = await helloed(raw, r, "s1")
    s2 = await helloed(raw, r, "s2")
    b_inc = await declare(p, "t.b", retain=True, max_bounded=2)
    await declare(p, "t.a")
    await declare(p, "u.c")
    await publish(p, "t.b")
    assert "result" in await subscribe(s1, "t.b", "bounded", depth=4)
    assert "result" in await subscribe(s2, "t.b")
    assert "result" in await subscribe(s2, "t.a")
    await publish(p, "t.a")  # written to s2, which does not consume it
    await publish(p, "t.a")  # in s2's slot
    resp = await s1.call("bus.topics", {"prefix": "t."})
    assert Validators.get().results["bus.topics"](resp["result"]) is None
    listed = resp["result"]["topics"]
    assert [t["topic"] for t in listed] == ["t.a", "t.b"]
    assert listed[1] == {"topic": "t.b", "topicIncarnation": b_inc,
                         "owner": {"clientId": "own", "clientIncarnation": "own-inc"},
                         "retain": True, "maxBounded": 2, "sequence": 1, "latest": 1,
                         "bounded": 1}
    everything = (await s1.call("bus.topics", {}))["result"]["topics"]
    assert [t["topic"] for t in everything] == ["t.a", "t.b", "u.c"]
    # a closing subscription is not counted: t.a removed, s2 has yet to drain its slot
    await p.call("bus.undeclare", {"topic": "t.a", "topicIncarnation":
                                   everything[0]["topicIncarnation"]})
    await declare(p, "t.a")
    again = (await s1.call("bus.topics", {"prefix": "t.a"}))["result"]["topics"]
    assert (again[0]["latest"], again[0]["bounded"]) == (0, 0)
    assert r.stats()["subscriptions"] == 3


async def test_topic_stats_follow_a_scenario(router: Any, raw: Any) -> None:
    r = await router()
    p = await helloed(raw, r, "pub")
    latest = await helloed(raw, r, "latest")
    bounded = await helloed(raw, r, "bounded")
    stats = (await p.call("bus.stats", {"detail": True}))["result"]
    assert TOPIC_GAUGES <= set(stats) and TOPIC_COUNTERS <= set(stats["counters"])
    assert all(TOPIC_DETAIL <= set(row) for row in stats["connectionsDetail"])
    assert Validators.get().results["bus.stats"](stats) is None
    await declare(p, "t.a", max_bounded=1)
    await publish(p, "t.a")  # nobody takes it
    assert "result" in await subscribe(latest, "t.a")
    assert "result" in await subscribe(bounded, "t.a", "bounded", depth=1)
    await publish(p, "t.a")  # written to both
    await publish(p, "t.a")  # in the slot and the queue
    assert error_name(await publish(p, "t.a")) == "BACKPRESSURE"
    assert (await bounded.call("bus.unsubscribe", {"topic": "t.a"}))["result"]["removed"]
    await publish(p, "t.a")  # replaces the slot
    await publish(p, "t.a")  # replaces it again
    stats = (await p.call("bus.stats", {"detail": True}))["result"]
    counters = stats["counters"]
    assert {k: counters[k] for k in TOPIC_COUNTERS} == {
        "published": 5, "publishRefused": 1, "leanPublishes": 0, "messagesDelivered": 2,
        "messagesReplaced": 2, "messagesDropped": 1}
    assert counters["errors"]["BACKPRESSURE"] == 1
    assert {k: stats[k] for k in TOPIC_GAUGES} == {
        "topics": 1, "subscriptions": 1, "queuedMessages": 1, "queuedTopicBytes": 2,
        "messageDeliveries": 2}
    rows = {row["clientId"]: row for row in stats["connectionsDetail"]}
    assert (rows["latest"]["subscriptions"], rows["latest"]["messageDeliveries"]) == (1, 1)
    assert (rows["bounded"]["subscriptions"], rows["bounded"]["messageDeliveries"]) == (0, 1)


async def test_sdk_topics(router: Any, sdk: Any, settle: Any) -> None:
    """docs/topics.md §12: Topic, publish (both forms), Subscription, the publish-failed hook."""
    r = await router()
    failures: list[tuple[str, str]] = []
    owner = await sdk(r, "sdk-owner",
                      on_publish_failed=lambda topic, err: failures.append((topic, err.name)))
    reader = await sdk(r, "sdk-reader")
    topic = await owner.declare("t.sdk", retain=True)
    first = await owner.publish("t.sdk", {"n": 0}, expected_incarnation=topic.incarnation)
    assert (first.sequence, first.latest, first.bounded) == (1, 0, 0)
    async with await reader.subscribe("t.sdk", window=2) as sub:
        assert (sub.sequence, sub.retained) == (1, True)
        seen = []
        async with topic:
            for n in range(1, 4):
                owner.publish_nowait("t.sdk", {"n": n})
            owner.publish_nowait("t.missing", {"n": -1})
            async for msg in sub:
                seen.append((msg.sequence, msg.payload["n"]))
                assert msg.publisher.client_id == "sdk-owner"
                if msg.payload["n"] == 3:
                    break
        async for msg in sub:  # the topic was undeclared: iteration ends after draining
            seen.append((msg.sequence, msg.payload["n"]))
        assert sub.removed_reason == "undeclared"
    assert seen[0] == (1, 0) and seen[-1] == (4, 3)
    assert [s for s, _ in seen] == sorted({s for s, _ in seen})
    assert failures == [("t.missing", "NO_TOPIC")]
    await settle(r, lambda st: st["subscriptions"] == 0 and st["messageDeliveries"] == 0
                 and st["topics"] == 0)


async def test_sdk_lingering_publish_shares_the_next_write(router: Any, sdk: Any,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`publish_nowait(..., linger=True)`: the frame waits for the connection's next frame and
    leaves in its write, ahead of it; with nothing after it, it leaves alone once the window
    ends. The window is stretched for the first part so that a slow loop turn cannot end it."""
    r = await router()
    owner = await sdk(r, "sdk-linger")
    reader = await sdk(r, "sdk-linger-reader")
    await owner.declare("t.linger", retain=True)
    async with await reader.subscribe("t.linger", window=2) as sub:
        monkeypatch.setattr(client_module, "LINGER_S", 60.0)
        before = owner.writes
        owner.publish_nowait("t.linger", {"n": 1}, linger=True)
        for _ in range(5):
            await asyncio.sleep(0)
        assert owner.writes == before, "a lingering frame left without company"
        stats = await owner.stats()
        assert owner.writes == before + 1, "the publication and the stats request share a write"
        assert stats["counters"]["published"] == 1, "the publication went first"
        async with asyncio.timeout(5):
            first = await anext(aiter(sub))
        assert first.payload == {"n": 1}

        monkeypatch.setattr(client_module, "LINGER_S", 0.002)
        before = owner.writes
        owner.publish_nowait("t.linger", {"n": 2}, linger=True)
        async with asyncio.timeout(5):
            second = await anext(aiter(sub))
        assert (second.payload, second.sequence) == ({"n": 2}, first.sequence + 1)
        assert owner.writes == before + 1
