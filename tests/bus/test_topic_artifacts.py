"""Attachments on topic messages (docs/topics.md §5.2 rule 3, §6; §17 tests 165-166).

A message roots its attachments while the retained value, a slot, a queue or an unconsumed
delivery references it; raw connections show exactly which deliveries are outstanding.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import pytest

from bus.client_connection import Validators
from tests.bus.bus_raw import caller
from tests.bus.conftest import store_dir, store_files

pytestmark = pytest.mark.timeout(10)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_file(r: Any, artifact_id: str, data: bytes) -> None:
    with open(os.path.join(store_dir(r), artifact_id), "r+b") as f:
        f.write(data)


async def sealed(c: Any, r: Any, data: bytes) -> str:
    artifact_id: str = (await c.call("bus.allocate", {"length": len(data)}))["result"][
        "artifactId"]
    write_file(r, artifact_id, data)
    resp = await c.call("bus.seal", {"artifactId": artifact_id, "digest": sha(data)})
    assert "result" in resp, resp
    return artifact_id


async def publish(c: Any, topic: str, attachments: list[str] | None = None) -> None:
    params: dict[str, Any] = {"topic": topic, "expectedIncarnation": None, "payload": {}}
    if attachments:
        params["attachments"] = attachments
        params["transfer"] = True
    resp = await c.call("bus.publish", params)
    assert "result" in resp, resp


async def consume(c: Any, delivery_id: str) -> None:
    resp = await c.call("bus.consumed", {"deliveryIds": [delivery_id]})
    assert resp["result"] == {"released": 1}


async def test_message_attachments_are_rooted_while_referenced(router: Any, raw: Any) -> None:
    r = await router()
    p = await caller(raw, r, "pub")
    s = await caller(raw, r, "sub")
    assert "result" in await p.call("bus.declare", {"topic": "t.art", "retain": True})
    assert "result" in await s.call("bus.subscribe", {"topic": "t.art", "mode": "latest",
                                                      "window": 1})
    first = await sealed(p, r, b"first")
    await publish(p, "t.art", [first])
    msg1 = await s.recv_notification("bus.message")
    assert msg1["attachments"] == [{"artifactId": first, "length": 5, "digest": sha(b"first")}]
    assert store_files(r) == [first]  # the retained value and the delivery
    await publish(p, "t.art")  # replaces the retained value; the slot takes it
    assert store_files(r) == [first]  # the unconsumed delivery still roots it
    await consume(s, msg1["deliveryId"])
    assert store_files(r) == []
    msg2 = await s.recv_notification("bus.message")
    assert "attachments" not in msg2
    # a subscriber that retained an attachment keeps it until it drops it
    kept = await sealed(p, r, b"kept")
    await publish(p, "t.art", [kept])
    await consume(s, msg2["deliveryId"])
    msg3 = await s.recv_notification("bus.message")
    assert [a["artifactId"] for a in msg3["attachments"]] == [kept]
    assert "result" in await s.call("bus.retain", {"artifactIds": [kept]})
    await publish(p, "t.art")
    await consume(s, msg3["deliveryId"])
    await s.recv_notification("bus.message")
    assert store_files(r) == [kept]
    assert (await s.call("bus.drop", {"artifactIds": [kept]}))["result"] == {"dropped": 1}
    assert store_files(r) == []


async def test_a_stopped_latest_subscriber_pins_at_most_two_messages(router: Any, raw: Any,
                                                                     settle: Any) -> None:
    r = await router()
    p = await caller(raw, r, "pub")
    s = await caller(raw, r, "sub")
    assert "result" in await p.call("bus.declare", {"topic": "t.stop"})
    assert "result" in await s.call("bus.subscribe", {"topic": "t.stop", "mode": "latest",
                                                      "window": 1})
    frame = os.urandom(65536)
    for _ in range(100):
        art = await sealed(p, r, frame)
        await publish(p, "t.stop", [art])
        assert r.stats()["store"]["artifacts"] <= 2
    assert r.stats()["store"]["artifacts"] == 2
    await s.close()
    await settle(r, lambda st: st["store"]["artifacts"] == 0)
    assert store_files(r) == []


async def test_sdk_message_attachments(router: Any, sdk: Any, settle: Any) -> None:
    """docs/topics.md §12: a subscriber reads a message's attachments while the message is
    unconsumed, and `msg.retain()` keeps them past its consumption until it drops them."""
    r = await router()
    pub = await sdk(r, "sdk-pub")
    reader = await sdk(r, "sdk-reader")
    topic = await pub.declare("t.media")
    async with await reader.subscribe("t.media", window=1) as sub:
        for n in range(2):
            alloc = await pub.allocate(1024)
            alloc.view()[:] = bytes([n]) * 1024
            art = await alloc.seal()
            await pub.publish("t.media", {"n": n}, attachments=(art,),
                              transfer=True)
        seen = []
        async for msg in sub:
            (att,) = msg.attachments
            assert bytes(reader.open_artifact(att)) == bytes([msg.payload["n"]]) * 1024
            seen.append(att)
            if msg.payload["n"] == 0:
                assert [a.artifact_id for a in await msg.retain()] == [att.artifact_id]
            else:
                break
    await topic.undeclare()
    kept, last = seen
    await settle(r, lambda st: st["store"]["artifacts"] == 1)
    assert store_files(r) == [kept.artifact_id] and last.artifact_id != kept.artifact_id
    async with kept:  # drops the hold
        pass
    await settle(r, lambda st: st["store"]["artifacts"] == 0)


async def test_publish_attachment_checks(router: Any, raw: Any) -> None:
    """docs/topics.md §3.4 checks 5-7: after NO_TOPIC and TARGET_CHANGED, before BACKPRESSURE;
    the notification form reports them in `bus.publishFailed`."""
    r = await router()
    p = await caller(raw, r, "pub")
    other = await caller(raw, r, "other")
    s = await caller(raw, r, "sub")
    incarnation = (await p.call("bus.declare", {"topic": "t.chk", "maxBounded": 1}))[
        "result"]["topicIncarnation"]
    assert "result" in await s.call("bus.subscribe", {"topic": "t.chk", "mode": "bounded",
                                                      "depth": 1, "window": 1})
    mine = await sealed(p, r, b"mine")
    theirs = await sealed(other, r, b"theirs")
    unsealed = (await p.call("bus.allocate", {"length": 4}))["result"]["artifactId"]
    gone = f"art-{int(mine[4:]) - 1}"

    async def refused(params: dict[str, Any]) -> str:
        resp = await p.call("bus.publish", {"topic": "t.chk", "expectedIncarnation": None,
                                            "payload": {}, **params})
        assert "error" in resp, resp
        assert Validators.get().response(resp) is None
        name: str = resp["error"]["data"]["name"]
        return name

    assert await refused({"topic": "t.none", "attachments": [gone]}) == "NO_TOPIC"
    assert await refused({"expectedIncarnation": "top-1" if incarnation != "top-1" else "top-2",
                          "attachments": [gone]}) == "TARGET_CHANGED"
    assert await refused({"attachments": [gone]}) == "ARTIFACT_GONE"
    assert await refused({"attachments": [unsealed]}) == "ARTIFACT_UNSEALED"
    assert await refused({"attachments": [theirs]}) == "OWNER_INVALID"
    await publish(p, "t.chk")  # written to the subscriber
    await publish(p, "t.chk")  # queued: the bounded subscriber is full now
    assert await refused({}) == "BACKPRESSURE"
    assert await refused({"attachments": [gone]}) == "ARTIFACT_GONE"
    await p.send_obj({"jsonrpc": "2.0", "method": "bus.publish", "params": {
        "topic": "t.chk", "expectedIncarnation": None, "payload": {}, "attachments": [theirs]}})
    failed = await p.recv_notification("bus.publishFailed")
    assert failed["error"]["data"]["name"] == "OWNER_INVALID"
    assert Validators.get().notifications["bus.publishFailed"](failed) is None
    assert r.stats()["topics"] == 1 and mine in store_files(r)
