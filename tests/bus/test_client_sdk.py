"""The client SDK contract (wire.md §17; §20 tests 100-107)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import fields
from typing import Any

import orjson
import pytest
import uvloop

from bus.client import BusClient, connect
from bus.client_calls import CallResult
from bus.client_serving import HANDLER_REAP_S, Request
from bus.errors import (
    CallDeadlineExceeded,
    CallGone,
    InvalidEnvelope,
    NoService,
    RouterLost,
    VersionMismatch,
)
from bus.limits import HELLO_KEYS_MINOR_1, Limits
from bus.router import Router
from bus.schema import contract_digest

pytestmark = pytest.mark.timeout(10)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _router_conn(r: Router, client_id: str) -> asyncio.Transport:
    """The router's transport of `client_id`'s live connection (to drop it from the router
    side)."""
    conn = r.registry.live.get(client_id)
    if conn is None or conn.closing or conn.transport is None:
        raise AssertionError(f"{client_id} has no live connection")
    return conn.transport


async def _raises_router_lost(aw: Awaitable[Any]) -> RouterLost:
    with pytest.raises(RouterLost) as info:
        async with asyncio.timeout(5):
            await aw
    assert info.value.dispatch == "unknown"
    assert info.value.name == "ROUTER_LOST"
    assert info.value.code == -32008
    return info.value


# --- 100 --------------------------------------------------------------------------------------


async def test_context_managers_close_and_unregister(router, sdk, settle) -> None:
    r = await router()
    observer = await sdk(r, "cm-observer")
    baseline = (await settle(r, lambda s: s["clients"] == 1))["connections"]

    async def handler(req: Request) -> dict[str, Any]:
        return {"echo": req.payload}

    async with connect(r.socket_path, client_id="cm-client") as bus:
        assert isinstance(bus, BusClient)
        assert not bus.closed
        await settle(r, lambda s: s["connections"] == baseline + 1 and s["clients"] == 2)
        async with await bus.register("cm.svc", handler) as svc:
            listed = await observer.services()
            assert [(e["name"], e["serviceIncarnation"]) for e in listed] == [
                ("cm.svc", svc.incarnation)]
            res = await observer.call("cm.svc", "Echo", {"x": 1}, timeout=5)
            assert res.outcome == {"echo": {"x": 1}}
        # leaving `async with register` unregistered the service
        assert await observer.services() == []
        assert await bus.services() == []
        with pytest.raises(NoService):
            await observer.call("cm.svc", "Echo", {}, timeout=5)
        assert not bus.closed
    # leaving `async with connect` closed the connection
    assert bus.closed
    assert await bus.wait_closed() is None
    stats = await settle(r, lambda s: s["connections"] == baseline and s["clients"] == 1)
    assert stats["services"] == 0
    await _raises_router_lost(bus.stats())


# --- 101 --------------------------------------------------------------------------------------


async def test_handler_exception_releases(router, sdk, settle) -> None:
    r = await router()
    service = await sdk(r, "hx-svc")
    caller = await sdk(r, "hx-caller")

    async def handler(req: Request) -> dict[str, Any]:
        if req.method == "Boom":
            raise RuntimeError("handler bug")
        return {"ok": req.payload["n"]}

    # maxInFlight=1: serving again proves the release and the consumed returned the slot
    await service.register("hx.svc", handler, max_in_flight=1)
    for round_ in range(2):
        with pytest.raises(CallGone) as info:
            await caller.call("hx.svc", "Boom", {}, timeout=5)
        err = info.value
        assert not isinstance(err, CallDeadlineExceeded)
        assert err.name == "CALL_GONE"
        assert err.code == -32006
        assert err.dispatch == "dispatched"
        for n in range(3):
            res = await caller.call("hx.svc", "Ok", {"n": n}, timeout=5)
            assert res.outcome == {"ok": n}
        stats = await settle(r, lambda s: s["calls"] == 0 and s["dispatchedCalls"] == 0)
        assert stats["counters"]["errors"].get("CALL_GONE") == round_ + 1
        assert stats["counters"]["repliesRouted"] == 3 * (round_ + 1)
    assert not service.closed
    assert [e["name"] for e in await caller.services()] == ["hx.svc"]


# --- 102 --------------------------------------------------------------------------------------


async def test_connection_loss_fails_everything_pending(router, sdk, settle) -> None:
    r = await router()
    service = await sdk(r, "cl-svc")
    caller = await sdk(r, "cl-caller")
    started = asyncio.Event()
    never = asyncio.Event()
    handler_cancelled = asyncio.Event()

    async def handler(req: Request) -> dict[str, Any]:
        started.set()
        try:
            await never.wait()
        except asyncio.CancelledError:
            handler_cancelled.set()
            raise
        return {}

    await service.register("cl.svc", handler, max_in_flight=1)
    dispatched_call = asyncio.create_task(caller.call("cl.svc", "Hold", {}, timeout=None))
    await started.wait()
    pending = await caller.start_call("cl.svc", "Queued", {})
    awaiting_result = asyncio.create_task(pending.result())
    queued_call = asyncio.create_task(caller.call("cl.svc", "Queued", {}, timeout=30))
    await settle(r, lambda s: s["queuedCalls"] == 2 and s["dispatchedCalls"] == 1)

    # Commands and calls whose response never comes: the router stops reading this connection.
    transport = _router_conn(r, "cl-caller")
    transport.pause_reading()
    command = asyncio.create_task(caller.stats())
    unadmitted_call = asyncio.create_task(caller.call("cl.svc", "Late", {}, timeout=None))
    unadmitted_start = asyncio.create_task(caller.start_call("cl.svc", "Late", {}))
    waiting = [dispatched_call, awaiting_result, queued_call, command, unadmitted_call,
               unadmitted_start]
    for _ in range(3):
        await asyncio.sleep(0)  # let the new tasks write their requests
    assert not any(t.done() for t in waiting)

    transport.abort()  # the router drops the connection

    for task in waiting:
        await _raises_router_lost(task)
    assert caller.closed
    closed_with = await caller.wait_closed()
    assert isinstance(closed_with, RouterLost)
    # later API calls raise RouterLost at once
    await _raises_router_lost(caller.stats())
    await _raises_router_lost(caller.call("cl.svc", "After", {}, timeout=1))
    await _raises_router_lost(caller.start_call("cl.svc", "After", {}))
    await _raises_router_lost(caller.register("cl.other", handler))
    # the router tore the connection down: queued calls gone, the dispatched one detached
    await settle(r, lambda s: s["clients"] == 1 and s["activeCalls"] == 0
                 and s["queuedCalls"] == 0 and s["calls"] == 1 and s["detachedCalls"] == 1)
    assert not service.closed
    assert [e["name"] for e in await service.services()] == ["cl.svc"]
    assert not handler_cancelled.is_set()

    # the service's connection drops too: its handler task is cancelled, its commands fail
    _router_conn(r, "cl-svc").abort()
    async with asyncio.timeout(5):
        await handler_cancelled.wait()
    assert isinstance(await service.wait_closed(), RouterLost)
    await _raises_router_lost(service.services())
    await settle(r, lambda s: s["connections"] == 0 and s["calls"] == 0 and s["services"] == 0)


async def test_close_is_bounded_by_a_handler_that_ignores_cancellation(router, sdk) -> None:
    """close() cancels handler tasks and waits at most HANDLER_REAP_S, not for ever."""
    r = await router()
    service = await sdk(r, "stubborn-svc")
    caller = await sdk(r, "stubborn-caller")
    started = asyncio.Event()
    let_go = asyncio.Event()
    cancels = 0

    async def handler(req: Request) -> dict[str, Any]:
        nonlocal cancels
        started.set()
        while not let_go.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                cancels += 1  # swallowed on purpose: the bug under test
        return {}

    await service.register("stubborn.svc", handler)
    pending = await caller.start_call("stubborn.svc", "Op", {})
    await asyncio.wait_for(started.wait(), 5)
    try:
        async with asyncio.timeout(HANDLER_REAP_S + 5):
            await service.close()
        assert cancels >= 1, "the handler was never cancelled: the case did not bite"
        assert service.closed
    finally:
        let_go.set()
    with pytest.raises(NoService) as gone:  # the caller hears the service left mid-call
        async with asyncio.timeout(5):
            await pending.result()
    assert gone.value.dispatch == "dispatched"


# --- fake routers (103, 104) ------------------------------------------------------------------

FakeScript = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_msg(reader: asyncio.StreamReader) -> dict[str, Any]:
    (n,) = struct.unpack("<I", await reader.readexactly(4))
    msg: dict[str, Any] = orjson.loads(await reader.readexactly(n))
    return msg


def _send_body(writer: asyncio.StreamWriter, body: bytes) -> None:
    writer.write(struct.pack("<I", len(body)) + body)


def _send(writer: asyncio.StreamWriter, obj: dict[str, Any]) -> None:
    _send_body(writer, orjson.dumps(obj))


def _hello_result(rid: int, digest: str | None = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "result": {
        "routerId": "router-0123456789abcdef",
        "connectionId": "conn-1",
        "major": 1,
        "minor": 0,
        "contractDigest": digest if digest is not None else contract_digest(),
        "grants": {"register": ["*"], "call": ["*"], "expect": [], "delegate": []},
        "limits": {k: v for k, v in Limits().hello().items() if k in HELLO_KEYS_MINOR_1},
    }}


class FakeRouter:
    """A Unix server that runs `script` on its first connection and records the SDK's EOF."""

    def __init__(self, script: FakeScript) -> None:
        self.script = script
        self.dir = tempfile.mkdtemp(prefix="flyd-fake-", dir="/tmp")
        self.path = os.path.join(self.dir, "fake.sock")
        self.server: asyncio.base_events.Server | None = None
        self.eof: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.requests: list[dict[str, Any]] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await self.script(reader, writer)
            await writer.drain()
            rest = await reader.read()  # the SDK must close: EOF (or a reset) ends this
            while rest:
                rest = await reader.read()
            if not self.eof.done():
                self.eof.set_result(b"")
        except Exception as exc:  # a reset by the SDK, or the script's own assertion
            if not self.eof.done():
                self.eof.set_exception(exc)
        finally:
            writer.close()

    async def __aenter__(self) -> FakeRouter:
        self.server = await asyncio.start_unix_server(self._handle, self.path)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        shutil.rmtree(self.dir, ignore_errors=True)


async def _expect_sdk_closed(fake: FakeRouter) -> None:
    """The SDK closed its end: the fake router reads EOF (or a reset)."""
    async with asyncio.timeout(5):
        with contextlib.suppress(ConnectionError):
            await fake.eof


BAD_FRAMES = ["duplicate-keys", "unknown-result-field", "out-of-order-id",
              "unknown-notification-field"]


@pytest.mark.parametrize("variant", BAD_FRAMES)
async def test_sdk_refuses_bad_router_frames(variant: str) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await _read_msg(reader)
        assert hello["method"] == "bus.hello"
        _send(writer, _hello_result(hello["id"]))
        call = await _read_msg(reader)
        stats = await _read_msg(reader)
        services = await _read_msg(reader)
        assert [call["method"], stats["method"], services["method"]] == [
            "bus.call", "bus.stats", "bus.services"]
        cid = call["id"]
        if variant == "duplicate-keys":
            _send_body(writer, b'{"jsonrpc":"2.0","id":%d,"result":{"callId":%d,'
                               b'"callId":%d,"serviceIncarnation":"svc-1"}}' % (cid, cid, cid))
            return
        if variant == "unknown-result-field":
            _send(writer, {"jsonrpc": "2.0", "id": cid, "result": {
                "callId": cid, "serviceIncarnation": "svc-1", "extra": True}})
            return
        # the call is admitted first; the bad frame comes while its result is awaited
        _send(writer, {"jsonrpc": "2.0", "id": cid,
                       "result": {"callId": cid, "serviceIncarnation": "svc-1"}})
        if variant == "out-of-order-id":
            # a well-formed answer, but to the newer of two outstanding requests
            _send(writer, {"jsonrpc": "2.0", "id": services["id"], "result": {"services": []}})
            return
        assert variant == "unknown-notification-field"
        _send(writer, {"jsonrpc": "2.0", "method": "bus.result", "params": {
            "deliveryId": "dlv-1", "callId": cid, "serviceIncarnation": "svc-1",
            "responder": {"clientId": "x", "clientIncarnation": "y"}, "outcome": {},
            "extra": 1}})

    async with FakeRouter(script) as fake:
        bus = await connect(fake.path, client_id="fake-client", timeout=5)
        assert bus.router_id == "router-0123456789abcdef"
        admitted_first = variant in ("out-of-order-id", "unknown-notification-field")
        first: asyncio.Task[Any] = asyncio.create_task(
            bus.start_call("fake.svc", "M", {}) if admitted_first
            else bus.call("fake.svc", "M", {}, timeout=None))
        stats = asyncio.create_task(bus.stats())
        services = asyncio.create_task(bus.services())
        if admitted_first:
            pending = await first
            assert pending.call_id == 2
            call = asyncio.create_task(pending.result())
        else:
            call = first  # not yet admitted
        for task in (call, stats, services):
            await _raises_router_lost(task)
        assert bus.closed
        assert isinstance(await bus.wait_closed(), RouterLost)
        await _expect_sdk_closed(fake)
        await _raises_router_lost(bus.stats())


# --- 104 --------------------------------------------------------------------------------------


async def test_sdk_refuses_contract_digest_mismatch() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await _read_msg(reader)
        assert hello["method"] == "bus.hello"
        assert set(hello["params"]) == {"clientId", "clientIncarnation", "supportedMajors"}
        other = "0" * 64
        assert other != contract_digest()
        _send(writer, _hello_result(hello["id"], digest=other))

    async with FakeRouter(script) as fake:
        with pytest.raises(VersionMismatch) as info:
            await connect(fake.path, client_id="fake-client", timeout=5)
        assert info.value.name == "VERSION_MISMATCH"
        assert info.value.code == -32001
        assert info.value.dispatch == "not-dispatched"
        await _expect_sdk_closed(fake)


# --- 105 --------------------------------------------------------------------------------------


async def test_sdk_local_refusals_send_nothing(router, sdk) -> None:
    r = await router()
    bus = await sdk(r, "lr-client")
    await bus.stats()
    frames_in = r.stats()["counters"]["framesIn"]
    bytes_in = r.stats()["counters"]["bytesIn"]
    oversize = {"blob": "x" * bus.limits["maxEnvelopeBytes"]}
    bad_payloads = [{"x": float("nan")}, {"x": float("inf")}, {"x": [1, -float("inf")]},
                    {"n": 2**64}, oversize]
    for payload in bad_payloads:
        for attempt in ("call", "start_call"):
            with pytest.raises(InvalidEnvelope) as info:
                if attempt == "call":
                    await bus.call("lr.svc", "M", payload, timeout=5)
                else:
                    await bus.start_call("lr.svc", "M", payload)
            assert info.value.name == "INVALID_ENVELOPE"
            assert info.value.dispatch == "not-dispatched"
            assert not bus.closed
    # nothing reached the router: the next request is the only new frame it reads
    assert r.stats()["counters"]["framesIn"] == frames_in
    stats = await bus.stats()
    assert stats["counters"]["framesIn"] == frames_in + 1
    assert r.stats()["counters"]["framesIn"] == frames_in + 1
    assert r.stats()["counters"]["bytesIn"] > bytes_in
    assert "INVALID_ENVELOPE" not in stats["counters"]["errors"]


# --- 106 --------------------------------------------------------------------------------------


async def test_timeout_is_required_keyword(router, sdk) -> None:
    r = await router()
    service = await sdk(r, "tk-svc")
    caller = await sdk(r, "tk-caller")
    started = asyncio.Event()
    release = asyncio.Event()

    async def handler(req: Request) -> dict[str, Any]:
        started.set()
        await release.wait()
        return {"done": True}

    await service.register("tk.svc", handler)
    await caller.stats()
    frames_in = r.stats()["counters"]["framesIn"]
    with pytest.raises(TypeError):
        await caller.call("tk.svc", "M", {})  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        await caller.call("tk.svc", "M", {}, 5.0)  # type: ignore[misc]
    for bad in (0, 0.0, -1.0):
        with pytest.raises(ValueError):
            await caller.call("tk.svc", "M", {}, timeout=bad)
    assert r.stats()["counters"]["framesIn"] == frames_in  # nothing was sent

    waiting = asyncio.create_task(caller.call("tk.svc", "M", {}, timeout=None))
    await started.wait()
    assert not waiting.done()
    release.set()
    result = await waiting
    assert isinstance(result, CallResult)
    assert result.outcome == {"done": True}


# --- 107 --------------------------------------------------------------------------------------

_ID_SHAPES = [(re.compile(r"^(router-)[0-9a-f]{16}$"), r"\1<hex>"),
              (re.compile(r"^(svc-|conn-|dlv-)[1-9][0-9]*$"), r"\1<n>"),
              (re.compile(r"^inc-[0-9a-f]{32}$"), "inc-<hex>")]


def _id_shape(value: str) -> str:
    for pattern, repl in _ID_SHAPES:
        if pattern.match(value):
            return pattern.sub(repl, value)
    return f"<unexpected id {value!r}>"


def _error_entry(step: str, exc: BaseException) -> list[Any]:
    assert isinstance(exc, CallGone | NoService | RouterLost), exc
    return [step, type(exc).__name__, exc.name, exc.code, exc.dispatch,
            getattr(exc, "cancel_state", None)]


async def sdk_scenario(path: str, tag: str) -> list[Any]:
    """One client: connect, register, call itself, cancel (queued and dispatched), errors,
    unregister, close. The trace keeps methods, field sets, states and codes, never ids."""
    trace: list[Any] = []
    seen: dict[str, list[Any]] = {}
    started = asyncio.Event()
    unblock = asyncio.Event()
    late: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    client_id = f"scn-{tag}"
    name = f"scn.{tag}"

    async def handler(req: Request) -> dict[str, Any] | None:
        seen[req.method] = [
            sorted(a for a in dir(req) if not a.startswith("_")),
            req.caller.client_id == client_id,
            req.target == name,
            _id_shape(req.delivery_id),
            type(req.call_id).__name__,
            req.payload,
        ]
        if req.method == "Echo":
            return {"echo": req.payload}
        if req.method == "Boom":
            raise RuntimeError("scenario handler failure")
        started.set()
        await unblock.wait()
        late.set_result(await req.reply({"late": True}))
        return None

    bus = await connect(path, client_id=client_id)
    try:
        trace.append(["connect", _id_shape(bus.router_id), _id_shape(bus.connection_id),
                      bus.client_id == client_id, _id_shape(bus.client_incarnation),
                      sorted(bus.limits.items()), sorted(bus.grants.items()), bus.closed])
        svc = await bus.register(name, handler, max_queued=4, max_in_flight=1)
        trace.append(["register", svc.name == name, _id_shape(svc.incarnation)])
        listed = await bus.services(prefix=name)
        trace.append(["services", len(listed), sorted(listed[0]), sorted(listed[0]["owner"]),
                      [listed[0][k] for k in ("maxQueued", "maxInFlight", "queued", "inFlight")]])

        res = await bus.call(name, "Echo", {"n": 1, "s": "x"}, timeout=5)
        trace.append(["call", sorted(f.name for f in fields(CallResult)), res.outcome,
                      res.responder.client_id == client_id, res.call_id > 0,
                      _id_shape(res.service_incarnation), seen.pop("Echo")])

        first = await bus.start_call(name, "Block", {"k": "first"})
        await started.wait()
        second = await bus.start_call(name, "Block", {"k": "second"})
        trace.append(["start_call", _id_shape(first.service_incarnation),
                      second.call_id > first.call_id])
        for pc in (second, first):  # queued, then dispatched
            state = await pc.cancel()
            try:
                await pc.result()
            except CallGone as exc:
                trace.append(["cancel", state, pc.cancel_state, *_error_entry("result", exc)])
        unblock.set()
        trace.append(["late-reply-routed", await late, seen.pop("Block")])
        assert not seen  # the queued call was never delivered

        for step, target, method in (("no-service", f"{name}.none", "Echo"),
                                     ("boom", name, "Boom")):
            try:
                await bus.call(target, method, {}, timeout=5)
            except (CallGone, NoService) as exc:
                trace.append(_error_entry(step, exc))
        trace.append(["boom-request", seen.pop("Boom")])

        stats = await bus.stats()
        trace.append(["stats", sorted(stats), sorted(stats["counters"]),
                      sorted(stats["counters"]["cancels"]), stats["connectionsDetail"]])
        trace.append(["unregister", await svc.unregister(), await svc.unregister()])
    finally:
        await bus.close()
    trace.append(["close", bus.closed, await bus.wait_closed()])
    try:
        await bus.stats()
    except RouterLost as exc:
        trace.append(_error_entry("after-close", exc))
    return trace


_SUBPROCESS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import uvloop
from test_client_sdk import sdk_scenario
trace = uvloop.run(sdk_scenario(sys.argv[2], sys.argv[3]))
print("TRACE " + json.dumps(trace), flush=True)
"""


def _normal(trace: list[Any]) -> list[Any]:
    result: list[Any] = json.loads(json.dumps(trace))
    return result


async def test_thread_and_subprocess_clients_match(router, settle) -> None:
    r = await router()

    in_loop = _normal(await sdk_scenario(r.socket_path, "loop"))

    def in_thread() -> list[Any]:
        return uvloop.run(sdk_scenario(r.socket_path, "thread"))  # type: ignore[no-any-return]

    threaded = _normal(await asyncio.to_thread(in_thread))

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SUBPROCESS, HERE, r.socket_path, "proc",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)
    out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")
    lines = [ln for ln in out.decode().splitlines() if ln.startswith("TRACE ")]
    assert len(lines) == 1, out.decode(errors="replace")
    subprocess_trace = _normal(json.loads(lines[0][len("TRACE "):]))

    # the trace holds what the spec promises, not just three equal nothings
    steps = [entry[0] for entry in in_loop]
    assert steps == ["connect", "register", "services", "call", "start_call", "cancel",
                     "cancel", "late-reply-routed", "no-service", "boom", "boom-request",
                     "stats", "unregister", "close", "after-close"]
    cancels = [entry for entry in in_loop if entry[0] == "cancel"]
    assert [c[1] for c in cancels] == ["cancelled-before-dispatch", "execution-unknown"]
    assert [c[2] for c in cancels] == [c[1] for c in cancels]
    assert [c[5:8] for c in cancels] == [["CALL_GONE", -32006, "not-dispatched"],
                                         ["CALL_GONE", -32006, "dispatched"]]
    assert in_loop[steps.index("late-reply-routed")][1] is False
    assert in_loop[steps.index("no-service")][2:5] == ["NO_SERVICE", -32003, "not-dispatched"]
    assert in_loop[steps.index("boom")][2:5] == ["CALL_GONE", -32006, "dispatched"]
    assert in_loop[steps.index("after-close")][2:5] == ["ROUTER_LOST", -32008, "unknown"]
    assert in_loop[steps.index("unregister")][1:] == [True, False]
    assert "<unexpected" not in json.dumps(in_loop)

    assert threaded == in_loop
    assert subprocess_trace == in_loop
    stats = await settle(r, lambda s: s["connections"] == 0)
    assert stats["calls"] == 0
    assert stats["services"] == 0
    assert stats["counters"]["helloOk"] == 3


async def test_call_deadline_covers_the_wait_for_write_credit() -> None:
    """A call that cannot be written (the router reads nothing and the transport paused)
    still ends at its deadline, certainly not dispatched, and leaves the wait for the drain
    to the others: the earlier calls are still pending until the connection closes."""
    release = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await _read_msg(reader)
        _send(writer, _hello_result(hello["id"]))
        await writer.drain()
        async with asyncio.timeout(30):
            await release.wait()  # reads nothing until the test is done

    async with FakeRouter(script) as fake:
        bus = await connect(fake.path, client_id="fake-client", timeout=5)
        # three frames of 900 kB, more than any socket buffer takes, less than the 4 x
        # maxEnvelopeBytes of unsent bytes past which the SDK gives the connection up
        big = [asyncio.create_task(bus.call("fake.svc", "M", {"blob": "x" * 900_000},
                                            timeout=None)) for _ in range(3)]
        try:
            writes = bus.writes
            for _ in range(10):  # the tasks start, their frames leave in one write: it pauses
                await asyncio.sleep(0)
            assert bus.writes == writes + 1
            with pytest.raises(CallDeadlineExceeded) as info:
                async with asyncio.timeout(5):
                    await bus.call("fake.svc", "M", {}, timeout=0.2)
            assert info.value.dispatch == "not-dispatched"
            assert "write credit" in info.value.message
            assert not any(task.done() for task in big)
        finally:
            release.set()
            await bus.close()
        for task in big:
            await _raises_router_lost(task)
