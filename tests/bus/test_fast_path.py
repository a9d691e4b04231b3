"""The fast path, bus minor 3 (wire.md §22; §22.5 tests 201-204).

The router forwards the bodies it does not route on (`payload`, `outcome`) as the sender's
bytes, checked only for being one well-formed JSON value; the receiving SDK decodes them with
§3's strictness and refuses a bad one as INVALID_PARAMS of that call. Inline handlers run on the
SDK's reader with no task per request. The result cache's body digest is over the payload's
wire bytes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest

from bus import codec
from bus.client import BusClient
from bus.client_serving import Request
from bus.errors import InvalidParams
from tests.bus.bus_raw import caller, serve
from tests.session.worker_rig import (
    Rig,
    agent_launch,
    boot_digest,
    prepare_params,
    rig,  # noqa: F401 - the fixture
    scope,
    service_of,
)

pytestmark = pytest.mark.timeout(10)

# one JSON value each, in spellings a re-encoder would change: spacing, key order, number forms
ODD_PAYLOAD = (b'{ "zeta" :1.50E+3,\n\t"alpha":[ 1 , -0.0 ,1e2, 10.000 ],'
               b'"s":"\\u00e9t\\u00e9 \\/", "n" : null ,"e":{ } }')
ODD_OUTCOME = b'{"b" : [true,false] , "a":-12.5e-3,"x":"\\ud83d\\ude00"  }'


def lean_call_body(call_id: int, target: str, payload: bytes) -> bytes:
    """A `bus.call` notification written as the SDK writes it: the payload last (§22.1)."""
    head = orjson.dumps({"jsonrpc": "2.0", "method": "bus.call", "params": {
        "target": target, "expectedIncarnation": None, "method": "M", "callId": call_id,
        "payload": {}}})
    assert head.endswith(b'"payload":{}}}')
    return head[:-4] + payload + b"}}"


def lean_reply_body(delivery_id: str, outcome: bytes) -> bytes:
    head = orjson.dumps({"jsonrpc": "2.0", "method": "bus.reply", "params": {
        "deliveryId": delivery_id, "consumed": True, "outcome": {}}})
    assert head.endswith(b'"outcome":{}}}')
    return head[:-4] + outcome + b"}}"


async def counters(c: Any) -> dict[str, Any]:
    stats = await c.call("bus.stats", {})
    result: dict[str, Any] = stats["result"]["counters"]
    return result


async def test_router_forwards_bodies_byte_identical(router: Any, raw: Any) -> None:
    """201: a payload with unusual spacing, key order and number spellings reaches the service
    byte-identical, its result reaches the caller byte-identical, and both count."""
    r = await router()
    svc, _ = await serve(raw, r, "fp-svc", "svc.fp")
    c = await caller(raw, r, "fp-caller")
    before = await counters(c)
    assert codec.encode(codec.decode(ODD_PAYLOAD)) != ODD_PAYLOAD  # a re-encoding would show
    await c.send_body(lean_call_body(c.next_id, "svc.fp", ODD_PAYLOAD))
    c.next_id += 1
    frame = await svc.recv_frame()
    assert frame.endswith(b'"payload":' + ODD_PAYLOAD + b"}}"), frame
    request = codec.decode_body_frame(frame)
    assert request.body == ODD_PAYLOAD and request.problem is None
    delivery_id = request.msg["params"]["deliveryId"]

    assert codec.encode(codec.decode(ODD_OUTCOME)) != ODD_OUTCOME
    await svc.send_body(lean_reply_body(delivery_id, ODD_OUTCOME))
    result = await c.recv_frame()
    assert result.endswith(b'"outcome":' + ODD_OUTCOME + b"}}"), result
    assert codec.decode_body_frame(result).msg["method"] == "bus.result"
    after = await counters(c)
    assert after["bodiesForwardedRaw"] - before["bodiesForwardedRaw"] == 2
    assert after["repliesRouted"] - before["repliesRouted"] == 1


async def test_router_forwards_sdk_bodies_byte_identical(router: Any, sdk: Any) -> None:
    """201, through the SDKs: a caller's payload bytes are the handler's `payload_bytes`, and
    the handler's encoded outcome is the caller's `outcome_bytes`."""
    r = await router()
    seen: list[bytes] = []

    async def handler(req: Request) -> dict[str, Any]:
        seen.append(req.payload_bytes)
        return {"echo": req.payload}

    service = await sdk(r, "fp-sdk-svc")
    await service.register("svc.fp", handler)
    client: BusClient = await sdk(r, "fp-sdk-caller")
    res = await client.call("svc.fp", "M", ODD_PAYLOAD, timeout=5.0)
    assert seen == [ODD_PAYLOAD]
    assert res.outcome == {"echo": codec.decode(ODD_PAYLOAD)}
    assert res.outcome_bytes == codec.encode({"echo": codec.decode(ODD_PAYLOAD)})
    assert (await client.stats())["counters"]["bodiesForwardedRaw"] == 2


async def test_malformed_body_in_wellformed_envelope(router: Any, raw: Any, sdk: Any) -> None:
    """202: a payload that is not one JSON value is refused without reaching a handler
    (`not-dispatched`) and the connection stays; one that is well-formed but breaks §3 is
    refused by the receiving SDK before its handler, as INVALID_PARAMS `not-dispatched`."""
    r = await router()
    svc, _ = await serve(raw, r, "bad-svc", "svc.bad")
    c = await caller(raw, r, "bad-caller")
    for payload in (b'{"a":1,}', b'{"a":tru}', b'{"a":NaN}', b'{"a":"\xc0\x80"}', b'{"a":1}{}'):
        call_id = c.next_id
        await c.send_body(lean_call_body(call_id, "svc.bad", payload))
        c.next_id += 1
        note = await c.recv_notification("bus.callFailed")
        assert note["callId"] == call_id
        assert note["error"]["data"] == {"name": "INVALID_PARAMS", "dispatch": "not-dispatched"}
        assert "payload" in note["error"]["message"]
    # the request form: an error response, and the connection still answers
    rid = c.next_id
    body = orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": "bus.call", "params": {
        "target": "svc.bad", "expectedIncarnation": None, "method": "M", "payload": {}}})
    await c.send_body(body[:-4] + b'{"a":[1,]}' + b"}}")
    c.next_id += 1
    resp = await c.recv_response(rid)
    assert resp["error"]["data"] == {"name": "INVALID_PARAMS", "dispatch": "not-dispatched"}
    stats = (await c.call("bus.stats", {}))["result"]
    assert stats["counters"]["callsAdmitted"] == 0 and stats["dispatchedCalls"] == 0
    assert stats["counters"]["closes"] == {}
    # a sound body still goes through on the same connection
    await c.send_body(lean_call_body(c.next_id, "svc.bad", b'{"ok":true}'))
    c.next_id += 1
    frame = await svc.recv_frame()
    assert frame.endswith(b'"payload":{"ok":true}}}')

    # well-formed, not strict: the router forwards it, the service SDK refuses it
    ran: list[str] = []

    async def handler(req: Request) -> dict[str, Any]:
        ran.append(req.method)
        return {}

    service = await sdk(r, "strict-svc")
    await service.register("svc.strict", handler, inline={"Inline": lambda req: {}})
    client: BusClient = await sdk(r, "strict-caller")
    forwarded = (await client.stats())["counters"]["bodiesForwardedRaw"]
    for method in ("M", "Inline"):
        for body in (b'{"a":1,"a":2}', b'{"big":1e400}', b'{"i":18446744073709551616}',
                     b'{"d":' + b"[" * 128 + b"]" * 128 + b"}"):
            with pytest.raises(InvalidParams) as info:
                await client.call("svc.strict", method, body, timeout=5.0)
            assert info.value.dispatch == "not-dispatched", body
    assert ran == []
    # vacuity: the router did forward each of them (the SDK refused, not the router)
    assert (await client.stats())["counters"]["bodiesForwardedRaw"] - forwarded == 2 * 4 * 2
    assert (await client.call("svc.strict", "M", {"fine": 1}, timeout=5.0)).outcome == {}
    assert ran == ["M"]


async def test_malformed_outcome_fails_the_call_dispatched(router: Any, raw: Any,
                                                           sdk: Any) -> None:
    """202's other direction: a result whose outcome breaks §3 fails that call INVALID_PARAMS
    `dispatched` (a handler saw the request); the client carries on."""
    r = await router()
    svc, _ = await serve(raw, r, "out-svc", "svc.out")
    client: BusClient = await sdk(r, "out-caller")
    call = asyncio.ensure_future(client.call("svc.out", "M", {}, timeout=5.0))
    frame = await svc.recv_frame()
    delivery_id = codec.decode(frame)["params"]["deliveryId"]
    await svc.send_body(lean_reply_body(delivery_id, b'{"k":1,"k":1}'))
    with pytest.raises(InvalidParams) as info:
        await call
    assert info.value.dispatch == "dispatched"
    assert not client.closed


async def test_inline_handlers_run_without_tasks(router: Any, sdk: Any) -> None:
    """203: 1 000 calls to an inline handler create no asyncio task (task count sampled), and a
    delayed non-inline handler on the same service does not hold an inline one."""
    r = await router()
    loop = asyncio.get_running_loop()
    gate = asyncio.Event()
    entered = asyncio.Event()
    inline_seen: list[int] = []

    async def slow(req: Request) -> dict[str, Any]:
        entered.set()
        await gate.wait()
        return {"slow": True}

    def fast(req: Request) -> dict[str, Any]:
        inline_seen.append(req.payload["i"])
        return {"i": req.payload["i"]}

    service = await sdk(r, "inline-svc")
    await service.register("svc.inline", slow, inline={"Fast": fast})
    client: BusClient = await sdk(r, "inline-caller")
    held = asyncio.ensure_future(client.call("svc.inline", "Slow", {}, timeout=9.0))
    async with asyncio.timeout(5):
        await entered.wait()

    created = 0
    factory = loop.get_task_factory()

    def counting(lp: asyncio.AbstractEventLoop, coro: Any, **kw: Any) -> asyncio.Future[Any]:
        nonlocal created
        created += 1
        if factory is not None:
            return factory(lp, coro, **kw)  # type: ignore[arg-type]
        return asyncio.Task(coro, loop=lp, **kw)

    samples: list[int] = []
    loop.set_task_factory(counting)  # type: ignore[arg-type]
    try:
        for i in range(1000):
            res = await client.call("svc.inline", "Fast", {"i": i}, timeout=5.0)
            assert res.outcome == {"i": i}
            if i % 100 == 0:
                samples.append(len(asyncio.all_tasks(loop)))
    finally:
        loop.set_task_factory(factory)
    assert inline_seen == list(range(1000))
    assert created == 0
    assert max(samples) == min(samples), samples  # no task piled up per call
    assert not held.done()  # the delayed handler is still waiting: it held nothing
    stats = await client.stats()
    assert stats["counters"]["inlineReplies"] == 1000
    gate.set()
    assert (await held).outcome == {"slow": True}


async def test_inline_handler_that_raises_is_released(router: Any, sdk: Any) -> None:
    """§22.2 with test 101's rule: an inline handler that raises is released (the caller
    hears CALL_GONE `dispatched`); one returning None without replying is released too."""
    from bus.errors import CallGone

    r = await router()

    def boom(req: Request) -> dict[str, Any]:
        raise RuntimeError("boom")

    async def unused(req: Request) -> None:
        return None

    service = await sdk(r, "raise-svc")
    await service.register("svc.raise", unused, inline={"Boom": boom, "Nothing": lambda q: None})
    client: BusClient = await sdk(r, "raise-caller")
    for method in ("Boom", "Nothing"):
        with pytest.raises(CallGone) as info:
            await client.call("svc.raise", method, {}, timeout=5.0)
        assert info.value.dispatch == "dispatched"
    stats = await client.stats()
    assert stats["calls"] == 0 and stats["replyCapabilities"] == 0


async def test_body_digest_is_over_wire_bytes(rig: Rig) -> None:  # noqa: F811
    """204: a byte-identical retry hits the result cache (Replay, nothing runs again); the same
    params re-encoded with other spacing under the same id is a mismatch (CONFLICT)."""
    await rig.start_endpoint(agent_launch(rig.socket, "fly-a"))
    await rig.init_agent("fly-a")
    service = service_of("fly-a", "agent")
    payload = {"requestId": "req-2", "scope": scope(0),
               "params": prepare_params("fly-a", boot_digest())}
    sent = orjson.dumps(payload)
    first = await rig.coordinator.call(service, "Agent.Prepare", sent, timeout=10.0)
    assert first.outcome["type"] == "result", first.outcome
    progress = (await rig.status("fly-a"))["progressCounter"]
    again = await rig.coordinator.call(service, "Agent.Prepare", sent, timeout=10.0)
    assert again.outcome == first.outcome  # replayed
    assert again.outcome_bytes == first.outcome_bytes
    assert (await rig.status("fly-a"))["progressCounter"] == progress  # nothing ran again
    spaced = json.dumps(payload, separators=(", ", ": ")).encode()
    assert spaced != sent and codec.decode(spaced) == codec.decode(sent)  # same value
    other = await rig.coordinator.call(service, "Agent.Prepare", spaced, timeout=10.0)
    assert other.outcome["type"] == "error"
    assert (other.outcome["error"]["code"], other.outcome["error"]["mutation"]) == (
        "CONFLICT", "none")
    assert (await rig.status("fly-a"))["progressCounter"] == progress
