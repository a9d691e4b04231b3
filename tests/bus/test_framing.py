"""Length-prefixed framing (wire.md §2, §4 check 1; §20 tests 10-17)."""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any

import orjson
import pytest

from bus import codec
from bus.schema import validator

pytestmark = pytest.mark.timeout(10)

DEFAULT_MAX = 1048576
LONGEST_DLV = "dlv-9007199254740991"  # wire.md §2: worst-case sizing of unassigned ids


def _call_request(rid: int, target: str, payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": rid,
        "method": "bus.call",
        "params": {"target": target, "expectedIncarnation": None, "method": "Svc.Echo",
                   "payload": payload},
    }


def _worst_case_request_size(call_id: int, caller: dict[str, str], target: str,
                             incarnation: str, method: str, payload: dict[str, Any]) -> int:
    """Size of the `bus.request` body (wire.md §8) with the longest delivery id (§2)."""
    return len(orjson.dumps({
        "jsonrpc": "2.0",
        "method": "bus.request",
        "params": {
            "deliveryId": LONGEST_DLV,
            "callId": call_id,
            "caller": caller,
            "target": target,
            "serviceIncarnation": incarnation,
            "method": method,
            "payload": payload,
        },
    }))


def _pad_to(build: Any, size: int) -> str:
    """The padding string `p` for which `build(p)` measures exactly `size` bytes (ASCII)."""
    base = build("")
    assert base <= size
    pad = "x" * (size - base)
    assert build(pad) == size
    return pad


async def test_frame_at_max_is_accepted(router, raw, sdk) -> None:
    r = await router()
    assert r.limits.maxEnvelopeBytes == DEFAULT_MAX
    seen: list[Any] = []

    async def handler(req: Any) -> dict[str, Any]:
        seen.append(req)
        return {}

    svc_client = await sdk(r, "svc-owner")
    await svc_client.register("svc.big", handler, max_queued=4, max_in_flight=4)

    c = await raw(r)
    assert "result" in await c.hello("caller-1")
    rid = 2

    def body_len(pad: str) -> int:
        return len(orjson.dumps(_call_request(rid, "svc.big", {"pad": pad})))

    pad = _pad_to(body_len, DEFAULT_MAX)
    body = orjson.dumps(_call_request(rid, "svc.big", {"pad": pad}))
    assert len(body) == DEFAULT_MAX
    await c.send_body(body)
    c.next_id = rid + 1
    resp = await c.recv_response(rid)
    # the frame itself was read and accepted; only the outbound bus.request would be too big
    assert resp["error"]["code"] == -32000
    assert resp["error"]["data"] == {"name": "INVALID_ENVELOPE", "dispatch": "not-dispatched"}

    stats = await c.call("bus.stats", {})
    assert "result" in stats, stats
    assert stats["result"]["activeCalls"] == 0
    assert stats["result"]["queuedCalls"] == 0
    assert stats["result"]["counters"]["callsAdmitted"] == 0
    assert seen == []


async def test_frame_one_over_max_closes_before_body(router, raw) -> None:
    r = await router()
    # before hello
    c = await raw(r)
    await c.send_bytes(struct.pack("<I", DEFAULT_MAX + 1))
    err = await c.expect_closing("INVALID_ENVELOPE")
    assert err["code"] == -32000
    # after hello: only the prefix is sent, no body byte ever follows
    c2 = await raw(r)
    assert "result" in await c2.hello("over-1")
    await c2.send_bytes(struct.pack("<I", DEFAULT_MAX + 1))
    err2 = await c2.expect_closing("INVALID_ENVELOPE")
    assert err2["code"] == -32000
    stats = r.stats()
    assert stats["counters"]["closes"].get("INVALID_ENVELOPE") == 2


async def test_zero_length_frame_closes(router, raw) -> None:
    r = await router()
    c = await raw(r)
    assert "result" in await c.hello("zero-1")
    await c.send_bytes(struct.pack("<I", 0))
    err = await c.expect_closing("INVALID_ENVELOPE")
    assert err["code"] == -32000
    # also as the very first bytes of a connection
    c2 = await raw(r)
    await c2.send_bytes(b"\x00\x00\x00\x00")
    await c2.expect_closing("INVALID_ENVELOPE")


async def test_prefix_is_little_endian(router, raw) -> None:
    r = await router()
    c = await raw(r)
    assert "result" in await c.hello("endian-1")
    body = b'{"a":"' + b"y" * 12 + b'"}'
    assert len(body) == 20
    big_endian = struct.pack(">I", len(body))
    assert struct.unpack("<I", big_endian)[0] > DEFAULT_MAX  # read as oversize
    await c.send_bytes(big_endian + body)
    err = await c.expect_closing("INVALID_ENVELOPE")
    assert err["code"] == -32000


async def test_frame_written_one_byte_at_a_time(router, raw) -> None:
    r = await router()
    c = await raw(r)
    body = orjson.dumps({
        "jsonrpc": "2.0", "id": 1, "method": "bus.hello",
        "params": {"clientId": "bytewise", "clientIncarnation": "bytewise-1",
                   "supportedMajors": [1]},
    })
    data = struct.pack("<I", len(body)) + body
    for i in range(len(data)):
        await c.send_bytes(data[i:i + 1])
        await asyncio.sleep(0.001)  # wire.md §20 test 14: 1 ms apart
    c.next_id = 2
    resp = await c.recv_response(1)
    assert "error" not in resp, resp
    assert validator("ops/bus.hello.result.json")(resp["result"]) is None
    assert resp["result"]["routerId"] == r.router_id
    # the connection is a normal client afterwards
    stats = await c.call("bus.stats", {})
    assert stats["result"]["clients"] == 1


async def test_response_read_one_byte_at_a_time(router) -> None:
    r = await router()
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, r.socket_path)
        body = orjson.dumps({
            "jsonrpc": "2.0", "id": 1, "method": "bus.hello",
            "params": {"clientId": "onebyte", "clientIncarnation": "onebyte-1",
                       "supportedMajors": [1]},
        })
        await loop.sock_sendall(sock, struct.pack("<I", len(body)) + body)
        reads = 0

        async def recv_exact(n: int) -> bytes:
            nonlocal reads
            buf = bytearray()
            while len(buf) < n:
                b = await loop.sock_recv(sock, 1)
                reads += 1
                assert len(b) == 1, "unexpected EOF"
                buf += b
            return bytes(buf)

        (n,) = struct.unpack("<I", await recv_exact(4))
        assert 1 <= n <= DEFAULT_MAX
        msg = codec.decode(await recv_exact(n))
        assert reads == 4 + n
    finally:
        sock.close()
    assert set(msg) == {"jsonrpc", "id", "result"}
    assert msg["id"] == 1
    assert validator("ops/bus.hello.result.json")(msg["result"]) is None
    assert msg["result"]["routerId"] == r.router_id


async def test_truncated_frame_disconnects_cleanly(router, raw, sdk, settle) -> None:
    r = await router()
    other = await sdk(r, "bystander")
    baseline = (await settle(r, lambda s: s["connections"] == 1))["connections"]

    # half a body, then EOF
    c = await raw(r)
    assert "result" in await c.hello("trunc-1")
    await settle(r, lambda s: s["connections"] == baseline + 1)
    await c.send_bytes(struct.pack("<I", 100) + b"{" * 50)
    c.writer.write_eof()
    async with asyncio.timeout(5):
        rest = await c.reader.read()
    assert rest == b"", "no frame may follow a truncated inbound frame"
    await settle(r, lambda s: s["connections"] == baseline)

    # half a prefix, then EOF (before hello)
    c2 = await raw(r)
    await settle(r, lambda s: s["connections"] == baseline + 1)
    await c2.send_bytes(b"\x10\x00")
    c2.writer.write_eof()
    async with asyncio.timeout(5):
        rest2 = await c2.reader.read()
    assert rest2 == b""
    stats = await settle(r, lambda s: s["connections"] == baseline)
    assert stats["counters"]["closes"].get("INVALID_ENVELOPE", 0) == 0
    assert stats["counters"]["closes"].get("PARSE_ERROR", 0) == 0

    # the others keep working
    st = await other.stats()
    assert st["clients"] == 1
    c3 = await raw(r)
    assert "result" in await c3.hello("trunc-2")
    assert "result" in await c3.call("bus.stats", {})


async def test_largest_deliverable_payload(router, raw, settle) -> None:
    r = await router()
    max_bytes = r.limits.maxEnvelopeBytes

    svc = await raw(r)
    assert "result" in await svc.hello("svc-big")
    reg = await svc.call("bus.register", {"name": "svc.big", "maxQueued": 4, "maxInFlight": 4})
    incarnation = reg["result"]["serviceIncarnation"]

    caller = await raw(r)
    caller_inc = "caller-big-inc-1"
    assert "result" in await caller.hello("caller-big", caller_inc)
    identity = {"clientId": "caller-big", "clientIncarnation": caller_inc}
    method = "Svc.Echo"

    # one byte over: refused at admission, nothing changes
    over_rid = 10

    def over_size(pad: str) -> int:
        return _worst_case_request_size(over_rid, identity, "svc.big", incarnation, method,
                                        {"pad": pad})

    over_pad = _pad_to(over_size, max_bytes + 1)
    before = (await caller.call("bus.stats", {}))["result"]
    await caller.request("bus.call", {"target": "svc.big", "expectedIncarnation": None,
                                      "method": method, "payload": {"pad": over_pad}},
                         rid=over_rid)
    resp = await caller.recv_response(over_rid)
    assert resp["error"]["code"] == -32000
    assert resp["error"]["data"] == {"name": "INVALID_ENVELOPE", "dispatch": "not-dispatched"}
    after = (await caller.call("bus.stats", {}))["result"]
    assert after["activeCalls"] == before["activeCalls"]
    assert after["calls"] == before["calls"]
    assert after["queuedCallBytes"] == before["queuedCallBytes"]
    assert after["counters"]["callsAdmitted"] == before["counters"]["callsAdmitted"]

    # exactly at the limit: admitted and delivered with an equal value
    rid = 20

    def size(pad: str) -> int:
        return _worst_case_request_size(rid, identity, "svc.big", incarnation, method,
                                        {"pad": pad})

    pad = _pad_to(size, max_bytes)
    assert len(pad) == len(over_pad) - 1
    payload = {"pad": pad}
    await caller.request("bus.call", {"target": "svc.big", "expectedIncarnation": None,
                                      "method": method, "payload": payload}, rid=rid)
    admitted = await caller.recv_response(rid)
    assert admitted.get("result") == {"callId": rid, "serviceIncarnation": incarnation}

    frame = await svc.recv_frame()
    assert len(frame) <= max_bytes
    req = codec.decode(frame)
    assert req["method"] == "bus.request"
    params = req["params"]
    assert params["callId"] == rid
    assert params["caller"] == identity
    assert params["payload"] == payload
    # the worst case was exactly the limit; the frame carries a shorter real delivery id
    assert len(frame) == max_bytes - len(LONGEST_DLV) + len(params["deliveryId"])

    reply = await svc.call("bus.reply", {"deliveryId": params["deliveryId"],
                                         "outcome": {"ok": True}})
    assert reply["result"] == {"routed": True}
    result = await caller.recv_notification("bus.result")
    assert result["callId"] == rid
    assert result["outcome"] == {"ok": True}
    assert (await caller.call("bus.consumed", {"deliveryIds": [result["deliveryId"]]}))[
        "result"] == {"released": 1}
    assert (await svc.call("bus.consumed", {"deliveryIds": [params["deliveryId"]]}))[
        "result"] == {"released": 1}
    await settle(r, lambda s: s["calls"] == 0 and s["activeCalls"] == 0)
