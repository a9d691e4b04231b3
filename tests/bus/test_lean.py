"""Lean calls, bus minor 1 (wire.md §21; §21.8 tests 111-122).

`bus.call`, `bus.reply` and `bus.consumed` may travel as notifications: success sends nothing,
a refusal that can be answered is one `bus.callFailed` or `bus.replyFailed`, and one that
cannot closes the connection. Credits ride inside `bus.call` (`consumed`) and `bus.reply`
(`consumed: true`). "Nothing was sent" is shown without waiting on a clock: a `bus.stats`
request follows, and its response must be the next frame on that connection (§4: the router
answers one connection's requests in order, and notices go on the same lane).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import struct
import tempfile
from collections.abc import Awaitable
from typing import Any

import orjson
import pytest

from bus.client import connect
from bus.errors import ERROR_CODES, CallGone, NoService
from bus.limits import HELLO_KEYS_MINOR_1, Limits
from bus.policy import Policy, PolicyEntry
from bus.schema import contract_digest
from tests.bus.bus_raw import call_params, caller, serve

pytestmark = pytest.mark.timeout(10)


def lean_call(c: Any, params: dict[str, Any], **extra: Any) -> Awaitable[None]:
    """A `bus.call` notification whose callId is the connection's next id (§21.2)."""
    call_id = c.next_id
    c.next_id += 1
    c.last_call_id = call_id
    return c.send_obj({"jsonrpc": "2.0", "method": "bus.call",
                       "params": {**params, "callId": call_id, **extra}})


def notify(c: Any, method: str, params: dict[str, Any]) -> Awaitable[None]:
    return c.send_obj({"jsonrpc": "2.0", "method": method, "params": params})


async def frames_before_stats(c: Any) -> list[dict[str, Any]]:
    """Every frame the router sends `c` before the response to a new `bus.stats`."""
    notes: list[dict[str, Any]] = []
    rid = await c.request("bus.stats", {})
    resp = await c.recv_response(rid, notes=notes)
    assert "result" in resp, resp
    return notes


def call_failed(msg: dict[str, Any], call_id: int, name: str,
                incarnation: str | None) -> None:
    assert msg["method"] == "bus.callFailed", msg
    params = msg["params"]
    assert params["callId"] == call_id and params["serviceIncarnation"] == incarnation, msg
    err = params["error"]
    assert err["code"] == ERROR_CODES[name], msg
    assert err["data"] == {"name": name, "dispatch": "not-dispatched"}, msg


def reply_failed(msg: dict[str, Any], delivery_id: str, name: str) -> None:
    assert msg["method"] == "bus.replyFailed", msg
    assert msg["params"]["deliveryId"] == delivery_id, msg
    err = msg["params"]["error"]
    assert err["code"] == ERROR_CODES[name], msg
    assert err["data"] == {"name": name, "dispatch": "not-dispatched"}, msg


# --- 111 ------------------------------------------------------------------------------------

class MinorZeroRouter:
    """A router stub that speaks bus 1.0: hello `minor: 0`, then echoes calls, with the
    request forms' responses; it records every frame the SDK sends."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="flyd-m0-", dir="/tmp")
        self.path = os.path.join(self.dir, "m0.sock")
        self.frames: list[dict[str, Any]] = []
        self.consumed = asyncio.Event()
        self.server: asyncio.base_events.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        dlv = 0
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (n,) = struct.unpack("<I", await reader.readexactly(4))
                msg = orjson.loads(await reader.readexactly(n))
                self.frames.append(msg)
                method, rid = msg["method"], msg["id"]  # a notification fails the test here
                if method == "bus.hello":
                    result: dict[str, Any] = {
                        "routerId": "router-0123456789abcdef", "connectionId": "conn-1",
                        "major": 1, "minor": 0, "contractDigest": contract_digest(),
                        "grants": {"register": [], "call": ["*"], "expect": [],
                                   "delegate": []},
                        "limits": {k: v for k, v in Limits().hello().items()
                                   if k in HELLO_KEYS_MINOR_1}}
                elif method == "bus.call":
                    result = {"callId": rid, "serviceIncarnation": "svc-1"}
                elif method == "bus.consumed":
                    result = {"released": len(msg["params"]["deliveryIds"])}
                    self.consumed.set()
                else:
                    result = {}
                self._send(writer, {"jsonrpc": "2.0", "id": rid, "result": result})
                if method == "bus.call":
                    dlv += 1
                    self._send(writer, {"jsonrpc": "2.0", "method": "bus.result", "params": {
                        "deliveryId": f"dlv-{dlv}", "callId": rid, "serviceIncarnation": "svc-1",
                        "responder": {"clientId": "echo", "clientIncarnation": "echo-1"},
                        "outcome": msg["params"]["payload"]}})

    def consumed_ids(self) -> list[str]:
        return sorted(d for f in self.frames if f["method"] == "bus.consumed"
                      for d in f["params"]["deliveryIds"])

    @staticmethod
    def _send(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
        body = orjson.dumps(obj)
        writer.write(struct.pack("<I", len(body)) + body)

    async def __aenter__(self) -> MinorZeroRouter:
        self.server = await asyncio.start_unix_server(self._handle, self.path)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def test_hello_announces_minor_1(router: Any, raw: Any) -> None:
    r = await router()
    c = await raw(r)
    result = (await c.hello("m1"))["result"]
    # minor 2 (docs/topics.md §1) and minor 3 (wire.md §22) keep every rule of minor 1
    assert result["major"] == 1 and result["minor"] == 3

    async with MinorZeroRouter() as stub:
        async with connect(stub.path, client_id="m0-caller") as bus:
            for n in range(3):
                res = await bus.call("echo", "Echo", {"n": n}, timeout=5)
                assert res.outcome == {"n": n}
            # the result credits leave as bus.consumed requests before the close
            async with asyncio.timeout(5):
                while len(stub.consumed_ids()) < 3:
                    await stub.consumed.wait()
                    stub.consumed.clear()
        methods = [f["method"] for f in stub.frames]
        assert methods[0] == "bus.hello" and methods.count("bus.call") == 3
        assert all("id" in f for f in stub.frames)  # request forms only
        calls = [f for f in stub.frames if f["method"] == "bus.call"]
        assert all(set(f["params"]) == {"target", "expectedIncarnation", "method", "payload"}
                   for f in calls)  # neither callId nor carried credits
        assert stub.consumed_ids() == ["dlv-1", "dlv-2", "dlv-3"]


# --- 112 ------------------------------------------------------------------------------------

async def test_lean_call_costs_four_frames(router: Any, raw: Any) -> None:
    r = await router()
    svc, inc = await serve(raw, r, "l4-svc", "lean.four")
    c = await caller(raw, r, "l4-caller")
    before = r.stats()["counters"]
    await lean_call(c, call_params("lean.four", {"x": 1}))
    req = await svc.recv_obj()
    assert req["method"] == "bus.request" and req["params"]["callId"] == c.last_call_id
    await notify(svc, "bus.reply", {"deliveryId": req["params"]["deliveryId"],
                                    "outcome": {"y": 2}, "consumed": True})
    res = await c.recv_obj()
    assert res["method"] == "bus.result", res
    assert res["params"]["callId"] == c.last_call_id and res["params"]["outcome"] == {"y": 2}
    assert res["params"]["serviceIncarnation"] == inc
    after = r.stats()["counters"]
    assert after["framesIn"] - before["framesIn"] == 2
    assert after["framesOut"] - before["framesOut"] == 2
    assert after["leanCalls"] - before["leanCalls"] == 1
    assert after["leanReplies"] - before["leanReplies"] == 1
    assert after["creditsCarried"] - before["creditsCarried"] == 1
    # nothing else was written to either side
    assert await frames_before_stats(c) == []
    assert await frames_before_stats(svc) == []


# --- 113 ------------------------------------------------------------------------------------

async def test_lean_call_refusals_are_call_failed(router: Any, raw: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="lr-svc", register=("lean.*",), call=()),
        PolicyEntry(id="lr-caller", register=(), call=("lean.*",)),
    ))
    r = await router(policy=policy, maxActiveCallsPerClient=2, maxEnvelopeBytes=65536,
                     maxControlBytes=65536, maxQueuedCallBytes=65536)
    svc, inc = await serve(raw, r, "lr-svc", "lean.r", max_queued=1, max_in_flight=1)
    c = await caller(raw, r, "lr-caller")
    refused_before = r.stats()["counters"]["callsRefused"]

    async def refused(params: dict[str, Any], name: str, incarnation: str | None) -> None:
        await lean_call(c, params)
        notes = await frames_before_stats(c)
        assert len(notes) == 1, notes  # one callFailed, and no response frame
        call_failed(notes[0], c.last_call_id, name, incarnation)

    await refused(call_params("other.x"), "NOT_AUTHORIZED", None)
    await refused(call_params("lean.none"), "NO_SERVICE", None)
    await refused({**call_params("lean.r"), "expectedIncarnation": "svc-1"}, "TARGET_CHANGED",
                  inc)
    # an inbound frame of exactly maxEnvelopeBytes: its worst-case bus.request cannot fit
    head = len(orjson.dumps({"jsonrpc": "2.0", "method": "bus.call", "params": {
        **call_params("lean.r", {"blob": ""}), "callId": c.next_id}}))
    big = {"blob": "x" * (65536 - head)}
    await refused(call_params("lean.r", big), "INVALID_ENVELOPE", inc)
    # one dispatched (maxInFlight 1), one queued (maxQueued 1): the service queue is full
    await lean_call(c, call_params("lean.r", {"n": 1}))
    assert (await svc.recv_obj())["params"]["payload"] == {"n": 1}
    await lean_call(c, call_params("lean.r", {"n": 2}))
    await refused(call_params("lean.r"), "BACKPRESSURE", inc)
    assert r.stats()["counters"]["callsRefused"] - refused_before == 5
    assert r.stats()["activeCalls"] == 2


# --- 114 ------------------------------------------------------------------------------------

async def test_lean_call_id_shares_the_request_sequence(router: Any, raw: Any) -> None:
    r = await router()
    await serve(raw, r, "ls-svc", "lean.s")
    # a callId equal to an earlier request id
    a = await caller(raw, r, "ls-a")  # hello was id 1
    rid = await a.request("bus.stats", {})
    await a.recv_response(rid)
    await a.send_obj({"jsonrpc": "2.0", "method": "bus.call",
                      "params": {**call_params("lean.s"), "callId": rid}})
    await a.expect_closing("INVALID_REQUEST")
    # a request id equal to an earlier callId
    b = await caller(raw, r, "ls-b")
    await lean_call(b, call_params("lean.s"))
    await b.request("bus.stats", {}, rid=b.last_call_id)
    await b.expect_closing("INVALID_REQUEST")
    # a missing callId, and one that is not an integer
    m = await caller(raw, r, "ls-m")
    await notify(m, "bus.call", call_params("lean.s"))
    await m.expect_closing("INVALID_REQUEST")
    f = await caller(raw, r, "ls-f")
    await notify(f, "bus.call", {**call_params("lean.s"), "callId": 7.0})
    await f.expect_closing("INVALID_REQUEST")
    # gaps are allowed, as for request ids, and the request form refuses a callId
    g = await caller(raw, r, "ls-g")
    g.next_id = 50
    await lean_call(g, call_params("lean.s"))
    rid = await g.request("bus.call", {**call_params("lean.s"), "callId": 99})
    resp = await g.recv_response(rid)
    assert resp["error"]["data"] == {"name": "INVALID_PARAMS", "dispatch": "not-dispatched"}
    assert rid == 51


# --- 115 ------------------------------------------------------------------------------------

async def test_lean_call_can_be_cancelled(router: Any, raw: Any) -> None:
    r = await router()
    svc, _ = await serve(raw, r, "lc-svc", "lean.c", max_in_flight=1)
    c = await caller(raw, r, "lc-caller")
    await lean_call(c, call_params("lean.c", {"n": 1}))
    dispatched = c.last_call_id
    await lean_call(c, call_params("lean.c", {"n": 2}))
    queued = c.last_call_id
    req = (await svc.recv_obj())["params"]
    assert req["callId"] == dispatched
    assert (await c.call("bus.cancel", {"callId": queued}))["result"] == {
        "state": "cancelled-before-dispatch"}
    assert (await c.call("bus.cancel", {"callId": dispatched}))["result"] == {
        "state": "execution-unknown"}
    unrouted = r.stats()["counters"]["repliesUnrouted"]
    await notify(svc, "bus.reply", {"deliveryId": req["deliveryId"], "outcome": {},
                                    "consumed": True})
    assert await frames_before_stats(svc) == []  # the queued call never arrives either
    assert await frames_before_stats(c) == []
    stats = r.stats()
    assert stats["counters"]["repliesUnrouted"] == unrouted + 1
    assert stats["calls"] == 0 and stats["activeCalls"] == 0 and stats["detachedCalls"] == 0


# --- 116 ------------------------------------------------------------------------------------

async def test_credits_ride_on_calls(router: Any, raw: Any) -> None:
    r = await router(maxActiveCallsPerClient=2)
    svc, inc = await serve(raw, r, "lk-svc", "lean.k", max_in_flight=2)
    c = await caller(raw, r, "lk-caller")
    results = []
    for n in range(2):
        await lean_call(c, call_params("lean.k", {"n": n}))
        req = (await svc.recv_obj())["params"]
        await notify(svc, "bus.reply", {"deliveryId": req["deliveryId"], "outcome": {"n": n},
                                        "consumed": True})
        results.append((await c.recv_obj())["params"]["deliveryId"])
    assert r.stats()["activeCalls"] == 2
    # without credits the third call is refused
    await lean_call(c, call_params("lean.k"))
    notes = await frames_before_stats(c)
    call_failed(notes[0], c.last_call_id, "BACKPRESSURE", inc)
    # a never-issued id refuses the whole frame and releases nothing, in both forms
    carried = r.stats()["counters"]["creditsCarried"]
    await lean_call(c, call_params("lean.k"), consumed=[results[0], "dlv-99"])
    notes = await frames_before_stats(c)
    call_failed(notes[0], c.last_call_id, "INVALID_PARAMS", inc)
    rid = await c.request("bus.call", {**call_params("lean.k"), "consumed": ["dlv-99"]})
    resp = await c.recv_response(rid)
    assert resp["error"]["data"] == {"name": "INVALID_PARAMS", "dispatch": "not-dispatched"}
    stats = r.stats()
    assert stats["activeCalls"] == 2 and stats["counters"]["creditsCarried"] == carried
    # with the two credits carried, it is admitted and dispatched
    await lean_call(c, call_params("lean.k", {"n": 9}), consumed=results)
    req = (await svc.recv_obj())["params"]
    assert req["callId"] == c.last_call_id and req["payload"] == {"n": 9}
    stats = r.stats()
    assert stats["activeCalls"] == 1
    assert stats["counters"]["creditsCarried"] == carried + 2
    # the request form carries them too: a repeat is a silent no-op
    rid = await c.request("bus.call", {**call_params("lean.k"), "consumed": results})
    assert "result" in await c.recv_response(rid)
    assert r.stats()["counters"]["creditsCarried"] == carried + 2


# --- 117 ------------------------------------------------------------------------------------

async def test_reply_consumed_true_frees_the_in_flight_slot(router: Any, raw: Any) -> None:
    r = await router()
    svc, _ = await serve(raw, r, "li-svc", "lean.i", max_in_flight=1)
    c = await caller(raw, r, "li-caller")
    await lean_call(c, call_params("lean.i", {"n": 1}))
    await lean_call(c, call_params("lean.i", {"n": 2}))
    first = (await svc.recv_obj())["params"]
    assert first["payload"] == {"n": 1}
    assert r.stats()["queuedCalls"] == 1
    consumed_before = r.stats()["counters"]["leanConsumed"]
    framesin = r.stats()["counters"]["framesIn"]
    await notify(svc, "bus.reply", {"deliveryId": first["deliveryId"], "outcome": {},
                                    "consumed": True})
    second = await svc.recv_obj()
    assert second["method"] == "bus.request" and second["params"]["payload"] == {"n": 2}
    stats = r.stats()
    assert stats["counters"]["framesIn"] == framesin + 1  # the reply alone
    assert stats["counters"]["leanConsumed"] == consumed_before
    assert stats["queuedCalls"] == 0


# --- 118 ------------------------------------------------------------------------------------

async def test_lean_reply_refusals_are_reply_failed(router: Any, raw: Any) -> None:
    r = await router(maxEnvelopeBytes=65536, maxControlBytes=65536, maxQueuedCallBytes=65536)
    svc, _ = await serve(raw, r, "lf-svc", "lean.f", max_in_flight=2)
    c = await caller(raw, r, "lf-caller")
    await lean_call(c, call_params("lean.f", {"n": 1}))
    await lean_call(c, call_params("lean.f", {"n": 2}))
    one = (await svc.recv_obj())["params"]["deliveryId"]
    two = (await svc.recv_obj())["params"]["deliveryId"]
    # a second reply
    await notify(svc, "bus.reply", {"deliveryId": one, "outcome": {"first": True},
                                    "consumed": True})
    await notify(svc, "bus.reply", {"deliveryId": one, "outcome": {"second": True}})
    notes = await frames_before_stats(svc)
    assert len(notes) == 1, notes
    reply_failed(notes[0], one, "CALL_GONE")
    res = await c.recv_obj()
    assert res["params"]["outcome"] == {"first": True}
    # a reply too large for its bus.result keeps the capability (and is not consumed); its
    # frame is exactly maxEnvelopeBytes
    head = len(orjson.dumps({"jsonrpc": "2.0", "method": "bus.reply", "params": {
        "deliveryId": two, "outcome": {"blob": ""}, "consumed": True}}))
    await notify(svc, "bus.reply", {"deliveryId": two, "outcome": {"blob": "x" * (65536 - head)},
                                    "consumed": True})
    notes = await frames_before_stats(svc)
    assert len(notes) == 1, notes
    reply_failed(notes[0], two, "INVALID_ENVELOPE")
    assert r.stats()["replyCapabilities"] == 1
    assert (await svc.call("bus.release", {"deliveryId": two}))["result"] == {"released": True}
    failed = await c.recv_obj()
    assert failed["method"] == "bus.callFailed"
    assert failed["params"]["error"]["data"] == {"name": "CALL_GONE", "dispatch": "dispatched"}
    await notify(svc, "bus.consumed", {"deliveryIds": [two]})  # both in-flight slots free
    # an outcome that is not an object: INVALID_PARAMS, answered
    await lean_call(c, call_params("lean.f", {"n": 3}))
    three = (await svc.recv_obj())["params"]["deliveryId"]
    await notify(svc, "bus.reply", {"deliveryId": three, "outcome": [1]})
    notes = await frames_before_stats(svc)
    reply_failed(notes[0], three, "INVALID_PARAMS")
    # a deliveryId never issued on this connection cannot be answered
    await notify(svc, "bus.reply", {"deliveryId": "dlv-999", "outcome": {}})
    await svc.expect_closing("INVALID_REQUEST")
    other, _ = await serve(raw, r, "lf-svc2", "lean.f2")
    await notify(other, "bus.reply", {"deliveryId": "dlv-x", "outcome": {}})
    await other.expect_closing("INVALID_REQUEST")


# --- 119 ------------------------------------------------------------------------------------

async def test_lean_consumed_notification(router: Any, raw: Any, settle: Any) -> None:
    r = await router()
    svc, _ = await serve(raw, r, "lm-svc", "lean.m", max_in_flight=2)
    c = await caller(raw, r, "lm-caller")
    dlvs = []
    for n in range(2):
        await lean_call(c, call_params("lean.m", {"n": n}))
        req = (await svc.recv_obj())["params"]
        await notify(svc, "bus.reply", {"deliveryId": req["deliveryId"], "outcome": {},
                                        "consumed": True})
        dlvs.append((await c.recv_obj())["params"]["deliveryId"])
    assert r.stats()["activeCalls"] == 2
    lean_before = r.stats()["counters"]["leanConsumed"]
    await notify(c, "bus.consumed", {"deliveryIds": [dlvs[0]]})
    assert await frames_before_stats(c) == []  # released silently
    stats = r.stats()
    assert stats["activeCalls"] == 1 and stats["calls"] == 1
    assert stats["counters"]["leanConsumed"] == lean_before + 1
    # a never-issued id closes, and the live id beside it is not released
    await notify(c, "bus.consumed", {"deliveryIds": [dlvs[1], "dlv-99"]})
    await c.expect_closing("INVALID_REQUEST")
    stats = r.stats()
    assert stats["counters"]["leanConsumed"] == lean_before + 1
    assert stats["counters"]["closes"]["INVALID_REQUEST"] == 1
    await settle(r, lambda s: s["calls"] == 0)


# --- 120 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["bus.register", "bus.cancel", "bus.hello", "bus.stats",
                                    "bus.release"])
async def test_other_notifications_still_close(router: Any, raw: Any, method: str) -> None:
    r = await router()
    params = {"bus.register": {"name": "lean.n", "maxQueued": 1, "maxInFlight": 1},
              "bus.cancel": {"callId": 1}, "bus.stats": {},
              "bus.release": {"deliveryId": "dlv-1"},
              "bus.hello": {"clientId": "ln-2", "clientIncarnation": "ln-2-i",
                            "supportedMajors": [1]}}[method]
    c = await caller(raw, r, "ln-1")
    await notify(c, method, params)
    await c.expect_closing("INVALID_REQUEST")
    if method == "bus.hello":  # also as the very first frame
        fresh = await raw(r)
        await notify(fresh, method, params)
        await fresh.expect_closing("INVALID_REQUEST")
    assert r.stats()["services"] == 0


# --- 121 ------------------------------------------------------------------------------------

class RecordingProxy:
    """Sits between SDK clients and the router; records every frame in both directions."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.dir = tempfile.mkdtemp(prefix="flyd-px-", dir="/tmp")
        self.path = os.path.join(self.dir, "px.sock")
        self.frames: list[tuple[str, dict[str, Any]]] = []  # ("in" to the router | "out", msg)
        self.server: asyncio.base_events.Server | None = None
        self.pipes: list[asyncio.Task[None]] = []

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    direction: str) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                prefix = await reader.readexactly(4)
                body = await reader.readexactly(struct.unpack("<I", prefix)[0])
                self.frames.append((direction, orjson.loads(body)))
                writer.write(prefix + body)
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(self.target, limit=2**25)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._pipe(reader, up_writer, "in"))
            tg.create_task(self._pipe(up_reader, writer, "out"))

    async def __aenter__(self) -> RecordingProxy:
        self.server = await asyncio.start_unix_server(self._handle, self.path, limit=2**25)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def test_sdk_uses_lean_forms(router: Any, settle: Any) -> None:
    r = await router()
    async with RecordingProxy(r.socket_path) as proxy:
        async with connect(proxy.path, client_id="lp-svc") as service, \
                connect(proxy.path, client_id="lp-caller") as client:

            async def echo(req: Any) -> dict[str, Any]:
                return {"echo": req.payload}

            await service.register("lean.p", echo, max_in_flight=4)
            for n in range(100):
                res = await client.call("lean.p", "Echo", {"n": n}, timeout=5)
                assert res.outcome == {"echo": {"n": n}}
            await settle(r, lambda s: s["calls"] == 0 and s["activeCalls"] == 0)
        sent = [m for d, m in proxy.frames if d == "in"]
        calls = [m for m in sent if m["method"] == "bus.call"]
        assert len(calls) == 100 and all("id" not in m for m in calls)
        replies = [m for m in sent if m["method"] == "bus.reply"]
        assert len(replies) == 100
        assert all("id" not in m and m["params"]["consumed"] is True for m in replies)
        consumed = [m for m in sent if m["method"] == "bus.consumed"]
        assert len(consumed) <= 100 // 64 + 2, consumed
        responses = {m["id"] for d, m in proxy.frames if d == "out" and "id" in m}
        request_ids = {m["id"] for m in sent if "id" in m}
        assert responses == request_ids  # hello, register, unregister: nothing else answered
        assert len(responses) <= 4
    stats = r.stats()["counters"]
    assert stats["leanCalls"] == 100 and stats["leanReplies"] == 100
    assert stats["creditsCarried"] >= 100  # every reply's, and results' riding on calls


async def test_sdk_lean_refusal_raises_its_error(router: Any, sdk: Any) -> None:
    """§21.6: a refused lean call raises the refusal's BusError with `not-dispatched`, and
    the SDK accepts a `bus.callFailed` with a null serviceIncarnation."""
    r = await router()
    client = await sdk(r, "lq-caller")
    with pytest.raises(NoService) as info:
        await client.call("lean.none", "M", {}, timeout=5)
    assert info.value.dispatch == "not-dispatched"
    assert not client.closed
    assert r.stats()["counters"]["leanCalls"] == 1

    async def fail(req: Any) -> dict[str, Any]:
        raise RuntimeError("handler failure")

    service = await sdk(r, "lq-svc")
    await service.register("lean.q", fail)
    with pytest.raises(CallGone):
        await client.call("lean.q", "M", {}, timeout=5)


# --- 122 ------------------------------------------------------------------------------------

@pytest.mark.timeout(300)  # a router process and hypothesis examples, like test_fuzz.py's
def test_lean_and_request_forms_agree() -> None:
    """The fuzz state machine of §20 with a random mix of both forms (tests/bus/test_fuzz.py,
    `Sock.lean`): every call of a clean caller gets exactly one terminal outcome, and the
    router's gauges settle back to the baseline."""
    from tests.bus.test_fuzz import run_mixed_forms_machine

    summary = run_mixed_forms_machine(frames=20_000, tracked=101)
    assert summary["leanCalls"] > 0 and summary["requestCalls"] > 0, summary
    assert summary["leanReplies"] > 0 and summary["leanConsumed"] > 0, summary
    assert summary["callsTracked"] > 100, summary
    assert summary["problems"] == [], summary

