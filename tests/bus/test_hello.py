"""Connection accept and `bus.hello` (wire.md §6; §20 tests 31-37)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

from bus import limits
from bus.limits import REMEMBERED_CLIENT_IDS, REMEMBERED_INCARNATIONS
from bus.policy import Policy, PolicyEntry
from bus.schema import SCHEMA_ROOT, contract_digest

pytestmark = pytest.mark.timeout(10)

# wire.md §14.1: the keys marked "hello", with their defaults
SPEC_HELLO_LIMITS = {
    "maxEnvelopeBytes": 1048576,
    "maxClients": 64,
    "maxServices": 256,
    "maxServiceQueued": 16,
    "maxServiceInFlight": 16,
    "maxActiveCallsPerClient": 64,
    "maxOpenRequestsPerClient": 256,
    "maxQueuedCallBytes": 67108864,
    "maxControlFrames": 128,
    "maxControlBytes": 4194304,
    "maxConsumeBatch": 64,
    "maxExpectations": 256,
    "helloTimeoutMs": 5000,
    # docs/topics.md §8 (minor 2)
    "maxTopics": 256,
    "maxSubscribersPerTopic": 64,
    "maxSubscriptionsPerClient": 64,
    "maxBoundedDepth": 64,
    "maxSubscriptionWindow": 16,
    "maxQueuedTopicBytes": 67108864,
    "maxAttachments": 16,
    "maxArtifactBytes": 16777216,
    "maxArtifacts": 65536,
    "maxStoreBytes": 1073741824,
    "maxHeldBytesPerClient": 268435456,
    "maxHoldsPerClient": 4096,
    "maxAllocationsPerClient": 64,
}


def _schemas_digest(root: Path) -> str:
    """wire.md §6.2, recomputed here from the files: SHA-256 of the canonical JSON (sorted keys,
    no whitespace, UTF-8) of {relative path: parsed content} for every file under schemas/bus/."""
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix == ".json")
    tree = {p.relative_to(root).as_posix(): json.loads(p.read_text("utf-8")) for p in files}
    canonical = json.dumps(tree, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


async def _read_to_eof(c: Any) -> bytes:
    """Everything left on the connection until EOF (refused hellos send nothing more)."""
    async with asyncio.timeout(5):
        return bytes(await c.reader.read())


def _error(resp: dict[str, Any], name: str, code: int) -> None:
    assert set(resp) == {"jsonrpc", "id", "error"}, resp
    assert resp["error"]["code"] == code, resp
    assert resp["error"]["data"] == {"name": name, "dispatch": "not-dispatched"}, resp


async def test_hello_result_shape(router, raw, sdk) -> None:
    overrides = {"maxClients": 7, "maxServiceQueued": 9, "helloTimeoutMs": 3000,
                 "maxExpectations": 0}
    r = await router(**overrides)
    c = await raw(r)
    resp = await c.hello("shape-1", "shape-1-inc")
    assert set(resp) == {"jsonrpc", "id", "result"}
    assert resp["id"] == 1
    result = resp["result"]
    assert set(result) == {"routerId", "connectionId", "major", "minor", "contractDigest",
                           "grants", "limits", "store"}
    assert result["major"] == 1 and type(result["major"]) is int
    assert result["minor"] == 3 and type(result["minor"]) is int  # wire.md §22.4: minor 3
    assert re.fullmatch(r"router-[0-9a-f]{16}", result["routerId"])
    assert result["routerId"] == r.router_id
    assert re.fullmatch(r"conn-\d+", result["connectionId"])
    assert result["connectionId"] == "conn-1"  # router-global counter from 1
    assert result["limits"] == {**SPEC_HELLO_LIMITS, **overrides}
    assert all(type(v) is int for v in result["limits"].values())
    # open policy: every grant kind is ["*"]
    assert result["grants"] == {"register": ["*"], "call": ["*"], "expect": ["*"],
                                "delegate": ["*"], "publish": ["*"], "subscribe": ["*"],
                                "manage": ["*"]}
    assert re.fullmatch(r"[0-9a-f]{64}", result["contractDigest"])
    assert result["contractDigest"] == contract_digest()

    # grants are the effective patterns after {clientId} substitution (closed policy)
    closed = await router(policy=Policy(mode="closed", entries=(
        PolicyEntry(id="w-*", register=("worker.{clientId}",), call=()),
        PolicyEntry(id="node-a", register=("node.{clientId}",), call=("*",), expect=("w-*",)),
    )))
    w = await raw(closed)
    got = (await w.hello("w-7"))["result"]["grants"]
    assert got == {"register": ["worker.w-7"], "call": [], "expect": [], "delegate": [],
                   "publish": [], "subscribe": [], "manage": []}
    n = await raw(closed)
    got = (await n.hello("node-a"))["result"]["grants"]
    assert got == {"register": ["node.node-a"], "call": ["*"], "expect": ["w-*"],
                   "delegate": [], "publish": [], "subscribe": [], "manage": []}

    # the SDK accepts it (it refuses a digest other than its own) and sees the same values
    client = await sdk(r, "shape-2")
    assert client.router_id == r.router_id
    assert client.connection_id == "conn-2"
    assert client.limits == result["limits"]


async def test_router_hello_digest_matches_schemas(router, raw) -> None:
    r = await router()
    c = await raw(r)
    resp = await c.hello("digest-1")
    digest = resp["result"]["contractDigest"]
    assert digest == contract_digest()
    assert digest == _schemas_digest(SCHEMA_ROOT)
    assert contract_digest(SCHEMA_ROOT) == digest


async def test_unsupported_major(router, raw) -> None:
    r = await router()
    c = await raw(r)
    resp = await c.hello("major-1", supported_majors=[2])
    _error(resp, "VERSION_MISMATCH", -32001)
    assert await _read_to_eof(c) == b"", "the refused hello's response must be the last frame"
    # §6.2 check 2 precedes check 3: an unknown client in a closed policy gets VERSION_MISMATCH
    closed = await router(policy=Policy(mode="closed", entries=()))
    u = await raw(closed)
    _error(await u.hello("nobody", supported_majors=[2, 3]), "VERSION_MISMATCH", -32001)
    assert await _read_to_eof(u) == b""
    # a list holding 1 among others is fine
    ok = await raw(r)
    assert "result" in await ok.hello("major-2", supported_majors=[3, 2, 1])
    stats = r.stats()
    assert stats["counters"]["helloRefused"] == 1
    assert stats["counters"]["helloOk"] == 1
    assert stats["counters"]["errors"]["VERSION_MISMATCH"] == 1


async def test_unknown_client_refused_in_closed_policy(router, raw) -> None:
    policy = Policy(mode="closed", entries=(PolicyEntry(id="known", call=("*",)),))
    r = await router(policy=policy)
    c = await raw(r)
    _error(await c.hello("stranger"), "NOT_AUTHORIZED", -32002)
    assert await _read_to_eof(c) == b""
    # the known client is admitted by the same router
    k = await raw(r)
    assert "result" in await k.hello("known")


async def test_live_client_id_conflict(router, raw) -> None:
    r = await router()
    first = await raw(r)
    assert "result" in await first.hello("dup-client", "dup-client-a")
    second = await raw(r)
    _error(await second.hello("dup-client", "dup-client-b"), "CONFLICT", -32009)
    assert await _read_to_eof(second) == b""
    stats = await first.call("bus.stats", {})
    assert "result" in stats, stats
    assert stats["result"]["clients"] == 1
    assert stats["result"]["counters"]["errors"]["CONFLICT"] == 1


async def test_incarnation_never_reused(router, raw, settle) -> None:
    r = await router()
    c = await raw(r)
    assert "result" in await c.hello("reuse", "reuse-inc-1")
    await c.close()
    await settle(r, lambda s: s["clients"] == 0 and s["connections"] == 0)
    again = await raw(r)
    _error(await again.hello("reuse", "reuse-inc-1"), "CONFLICT", -32009)
    assert await _read_to_eof(again) == b""
    fresh = await raw(r)
    resp = await fresh.hello("reuse", "reuse-inc-2")
    assert "result" in resp, resp
    assert "result" in await fresh.call("bus.stats", {})
    # after that connection closes too, both used incarnations stay refused
    await fresh.close()
    await settle(r, lambda s: s["clients"] == 0 and s["connections"] == 0)
    for inc in ("reuse-inc-1", "reuse-inc-2"):
        x = await raw(r)
        _error(await x.hello("reuse", inc), "CONFLICT", -32009)
    # incarnations are remembered per clientId: another client may use the same string
    other = await raw(r)
    assert "result" in await other.hello("reuse-other", "reuse-inc-1")


async def test_remembered_incarnations_bounded_per_client(router, raw) -> None:
    """wire.md §6.2, §14.1: only the last REMEMBERED_INCARNATIONS incarnations of a clientId
    are remembered and the oldest is forgotten, so however often a client reconnects, what the
    router keeps for it stays bounded."""
    r = await router()

    async def hello_and_close(inc: str) -> dict[str, Any]:
        c = await raw(r)
        resp = await c.hello("win", inc)
        c.writer.write_eof()
        await c.expect_eof()  # the router has torn the connection down
        return resp

    for k in range(REMEMBERED_INCARNATIONS + 1):
        assert "result" in await hello_and_close(f"win-{k}")
    remembered = tuple(r.registry.incarnations["win"])
    assert len(remembered) == REMEMBERED_INCARNATIONS
    assert "win-0" not in remembered and "win-1" in remembered
    # the forgotten one is accepted again and pushes out the next oldest
    assert "result" in await hello_and_close("win-0")
    remembered = tuple(r.registry.incarnations["win"])
    assert len(remembered) == REMEMBERED_INCARNATIONS
    assert "win-1" not in remembered
    _error(await hello_and_close("win-2"), "CONFLICT", -32009)
    assert len(r.registry.incarnations) == 1


async def test_remembered_client_ids_bounded(router, raw, monkeypatch) -> None:
    """wire.md §14.1 (amendment 2026-12-01): at most 4096 clientIds are remembered; past that
    the least recently seen clientId without a live connection is forgotten with its
    incarnations (so an incarnation of it is accepted again), while a live one never is. The
    bound is lowered here so the test needs a handful of connections, not thousands."""
    assert REMEMBERED_CLIENT_IDS == 4096
    monkeypatch.setattr(limits, "REMEMBERED_CLIENT_IDS", 3)
    r = await router()

    async def hello_and_close(client_id: str, inc: str) -> dict[str, Any]:
        c = await raw(r)
        resp = await c.hello(client_id, inc)
        c.writer.write_eof()
        await c.expect_eof()  # the router has torn the connection down
        return resp

    live = await raw(r)
    assert "result" in await live.hello("keep", "keep-1")  # the oldest, but live throughout
    for client_id in ("a", "b", "c"):  # the third one makes four: "a" goes, not "keep"
        assert "result" in await hello_and_close(client_id, f"{client_id}-1")
    assert "result" in await hello_and_close("a", "a-1")  # forgotten, so accepted again
    # that brought "a" back and pushed out "b", the least recently seen without a connection
    assert "result" in await hello_and_close("b", "b-1")
    _error(await hello_and_close("a", "a-1"), "CONFLICT", -32009)  # remembered again
    assert "result" in await hello_and_close("c", "c-1")  # pushed out by "b"
    # the live clientId was never forgotten, although it was the least recently seen
    live.writer.write_eof()
    await live.expect_eof()
    _error(await hello_and_close("keep", "keep-1"), "CONFLICT", -32009)
    assert len(r.registry.incarnations) == 3


async def test_invalid_hello_params_close(router, raw) -> None:
    r = await router()
    c = await raw(r)
    _error(await c.hello("Bad"), "INVALID_PARAMS", -32602)
    assert await _read_to_eof(c) == b""
    # check 1 precedes check 2
    m = await raw(r)
    _error(await m.hello("Bad", supported_majors=[2]), "INVALID_PARAMS", -32602)
    assert await _read_to_eof(m) == b""
    bad_params: list[dict[str, Any]] = [
        {"clientId": "ok", "clientIncarnation": "ok-1", "supportedMajors": []},
        {"clientId": "ok", "clientIncarnation": "ok-1", "supportedMajors": [1, 1]},
        {"clientId": "ok", "clientIncarnation": "ok-1", "supportedMajors": [0]},
        {"clientId": "ok", "clientIncarnation": "ok-1"},
        {"clientId": "ok", "clientIncarnation": "Ok-1", "supportedMajors": [1]},
        {"clientId": "ok", "clientIncarnation": "ok-1", "supportedMajors": [1], "x": 1},
    ]
    for params in bad_params:
        x = await raw(r)
        _error(await x.call("bus.hello", params), "INVALID_PARAMS", -32602)
        assert await _read_to_eof(x) == b""
    # requests pipelined behind a refused hello are never answered: its error is the last frame
    p = await raw(r)
    await p.request("bus.hello", {"clientId": "Bad", "clientIncarnation": "bad-1",
                                  "supportedMajors": [1]})
    await p.request("bus.stats", {})
    _error(await p.recv_obj(), "INVALID_PARAMS", -32602)
    assert await _read_to_eof(p) == b""
    stats = r.stats()
    assert stats["counters"]["helloRefused"] == 3 + len(bad_params)
    assert stats["counters"]["helloOk"] == 0


async def test_pending_connections_count_toward_max_clients(router, raw, settle) -> None:
    r = await router(maxClients=2)
    p1 = await raw(r)
    p2 = await raw(r)
    await settle(r, lambda s: s["connections"] == 2 and s["pendingConnections"] == 2)
    third = await raw(r)
    err = await third.expect_closing("QUOTA_EXCEEDED")
    assert err["code"] == -32007
    stats = r.stats()
    assert stats["counters"]["refusedAtAccept"] == 1
    await p1.close()
    await settle(r, lambda s: s["connections"] == 1)
    fourth = await raw(r)
    resp = await fourth.hello("after-free")
    assert "result" in resp, resp
    # the other pending connection is still there and may hello too
    assert "result" in await p2.hello("pending-2")
    stats = await settle(r, lambda s: s["clients"] == 2)
    assert stats["pendingConnections"] == 0
