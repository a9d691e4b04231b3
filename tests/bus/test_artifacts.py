"""The artifact store and attachments (docs/topics.md §5, §6, §8–§12; §17 tests 143-164).

Routers run in-process with a store under a fresh /dev/shm root per test (conftest); raw
connections show every frame, the SDK is used where the test is about it. Files are written and
inspected directly in the store directory, as a client of the router's uid would.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import mmap
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson
import pytest

from bus import store as bus_store
from bus.client_connection import Validators
from bus.client_serving import Reply, Request
from bus.errors import ArtifactGone, ArtifactMismatch, AttachmentsNotKept, RouterLost
from bus.router import RouterStartError
from bus.store import StoreSettings
from flyd.config import load_config, router_config
from flyd.errors import ConfigError
from tests.bus.bus_raw import answer, call_params, caller, serve
from tests.bus.conftest import SHM, short_socket_dir, store_dir, store_files

T = TypeVar("T")

pytestmark = pytest.mark.timeout(10)

EXT4_MAGIC = 0xEF53


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def error_of(resp: dict[str, Any]) -> tuple[str, int]:
    """(name, code) of a refusal, which is always `not-dispatched` here."""
    assert "error" in resp, resp
    err = resp["error"]
    assert err["data"]["dispatch"] == "not-dispatched", err
    return err["data"]["name"], err["code"]


def name_of(resp: dict[str, Any]) -> str:
    return error_of(resp)[0]


def write_file(r: Any, artifact_id: str, data: bytes) -> None:
    with open(os.path.join(store_dir(r), artifact_id), "r+b") as f:
        f.write(data)


def mode_of(r: Any, artifact_id: str) -> int:
    return stat.S_IMODE(os.stat(os.path.join(store_dir(r), artifact_id)).st_mode)


async def allocate(c: Any, length: int) -> str:
    resp = await c.call("bus.allocate", {"length": length})
    assert "result" in resp, resp
    artifact_id: str = resp["result"]["artifactId"]
    return artifact_id


async def sealed(c: Any, r: Any, data: bytes) -> str:
    """A sealed artifact of `data`, held by `c`."""
    artifact_id = await allocate(c, len(data))
    write_file(r, artifact_id, data)
    resp = await c.call("bus.seal", {"artifactId": artifact_id, "digest": sha(data)})
    assert resp["result"] == {"artifactId": artifact_id, "length": len(data),
                              "digest": sha(data)}, resp
    return artifact_id


def unknown_id(known: str) -> str:
    """An id this store never issued: ids count up from a random first one."""
    return f"art-{int(known[4:]) - 1}"


def gauges(r: Any) -> dict[str, Any]:
    stats = r.stats()
    return {**stats["store"], "files": store_files(r)}


def detail(r: Any, client_id: str) -> dict[str, Any]:
    for row in r.stats(detail=True)["connectionsDetail"]:
        if row["clientId"] == client_id:
            found: dict[str, Any] = row
            return found
    raise AssertionError(f"no connection of {client_id}")


# 143 ---------------------------------------------------------------------------------------
async def test_allocate_write_seal_open(router: Any, sdk: Any) -> None:
    r = await router()
    c = await sdk(r, "writer")
    alloc = await c.allocate(4096)
    assert store_files(r) == [alloc.artifact_id]
    st = os.stat(os.path.join(store_dir(r), alloc.artifact_id))
    assert (stat.S_IMODE(st.st_mode), st.st_size) == (0o600, 4096)
    data = os.urandom(4096)
    view = alloc.view()
    view[:] = data
    view.release()
    art = await alloc.seal()
    assert (art.artifact_id, art.length, art.digest) == (alloc.artifact_id, 4096, sha(data))
    assert mode_of(r, art.artifact_id) == 0o444
    read = c.open_artifact(art)
    assert bytes(read) == data
    with pytest.raises(TypeError):
        read[0] = 1
    store = r.stats()["store"]
    assert (store["bytes"], store["artifacts"], store["allocated"]) == (4096, 1, 0)


# 144 ---------------------------------------------------------------------------------------
async def test_wrong_digest_keeps_the_allocation(router: Any, raw: Any) -> None:
    r = await router()
    c = await caller(raw, r, "c")
    artifact_id = await allocate(c, 4096)
    data = os.urandom(4096)
    write_file(r, artifact_id, data)
    resp = await c.call("bus.seal", {"artifactId": artifact_id, "digest": sha(b"other")})
    assert error_of(resp) == ("ARTIFACT_MISMATCH", -32013)
    assert mode_of(r, artifact_id) == 0o600
    assert r.stats()["store"]["allocated"] == 1
    data = os.urandom(4096)
    write_file(r, artifact_id, data)
    resp = await c.call("bus.seal", {"artifactId": artifact_id, "digest": sha(data)})
    assert resp["result"]["digest"] == sha(data)
    assert r.stats()["counters"]["sealsRefused"] == 1


# 145 ---------------------------------------------------------------------------------------
async def test_seal_refuses_while_open_for_writing(router: Any, raw: Any) -> None:
    r = await router()
    c = await caller(raw, r, "c")
    artifact_id = await allocate(c, 4096)
    data = os.urandom(4096)
    write_file(r, artifact_id, data)
    seal = {"artifactId": artifact_id, "digest": sha(data)}
    fd = os.open(os.path.join(store_dir(r), artifact_id), os.O_RDWR)
    try:
        assert error_of(await c.call("bus.seal", seal)) == ("ARTIFACT_UNSEALED", -32012)
        assert mode_of(r, artifact_id) == 0o600
        mapping = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED,
                            prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        assert name_of(await c.call("bus.seal", seal)) == "ARTIFACT_UNSEALED"
        assert mode_of(r, artifact_id) == 0o600
    finally:
        mapping.close()
    assert "result" in await c.call("bus.seal", seal)
    assert mode_of(r, artifact_id) == 0o444


# 146 ---------------------------------------------------------------------------------------
async def test_seal_refuses_a_replaced_or_resized_file(router: Any, raw: Any) -> None:
    r = await router()
    c = await caller(raw, r, "c")
    data = os.urandom(4096)
    artifact_id = await allocate(c, 4096)
    path = os.path.join(store_dir(r), artifact_id)
    write_file(r, artifact_id, data)
    os.truncate(path, 4095)
    seal = {"artifactId": artifact_id, "digest": sha(data)}
    assert name_of(await c.call("bus.seal", seal)) == "ARTIFACT_MISMATCH"
    decoy_dir = tempfile.mkdtemp(dir=SHM)
    try:
        decoy = os.path.join(decoy_dir, "decoy")
        _write(decoy, data)
        os.chmod(decoy, 0o600)
        os.unlink(path)
        os.symlink(decoy, path)
        assert name_of(await c.call("bus.seal", seal)) == "ARTIFACT_MISMATCH"
        assert stat.S_IMODE(os.stat(decoy).st_mode) == 0o600
        assert _read(decoy) == data
        linked = await allocate(c, 4096)
        write_file(r, linked, data)
        os.link(os.path.join(store_dir(r), linked), os.path.join(decoy_dir, "link"))
        resp = await c.call("bus.seal", {"artifactId": linked, "digest": sha(data)})
        assert name_of(resp) == "ARTIFACT_MISMATCH"
    finally:
        for name in os.listdir(decoy_dir):
            os.unlink(os.path.join(decoy_dir, name))
        os.rmdir(decoy_dir)


# 147 ---------------------------------------------------------------------------------------
async def test_seal_ownership(router: Any, raw: Any) -> None:
    r = await router()
    c = await caller(raw, r, "c")
    other = await caller(raw, r, "other")
    data = os.urandom(64)
    artifact_id = await allocate(c, 64)
    write_file(r, artifact_id, data)
    seal = {"artifactId": artifact_id, "digest": sha(data)}
    assert error_of(await other.call("bus.seal", seal)) == ("OWNER_INVALID", -32014)
    assert "result" in await c.call("bus.seal", seal)
    assert name_of(await c.call("bus.seal", seal)) == "CONFLICT"
    never = {"artifactId": unknown_id(artifact_id), "digest": sha(data)}
    assert error_of(await c.call("bus.seal", never)) == ("ARTIFACT_GONE", -32011)
    dropped = await allocate(c, 64)
    assert (await c.call("bus.drop", {"artifactIds": [dropped]}))["result"] == {"dropped": 1}
    assert dropped not in store_files(r)
    resp = await c.call("bus.seal", {"artifactId": dropped, "digest": sha(data)})
    assert name_of(resp) == "ARTIFACT_GONE"


# 148 ---------------------------------------------------------------------------------------
class GatedExecutor(ThreadPoolExecutor):
    """The store's hashing thread as a test double: each job waits for `gate` (at most 8 s)
    before it runs, so a test observes what proceeds while a hash is under way."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(max_workers=1, thread_name_prefix="bus-hash-gated")
        self.gate = gate

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        def held() -> T:
            self.gate.wait(8)
            return fn(*args, **kwargs)

        return super().submit(held)


async def test_large_seal_pauses_only_its_connection(router: Any, raw: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The hash is held on the hashing thread by a gate (no clock): meanwhile another client
    gets its answers and the sealing connection gets nothing; once released, its seal
    response comes before the `bus.stats` it pipelined behind the seal."""
    length = 64 * 1024 * 1024
    r = await router(maxArtifactBytes=length)
    gate = threading.Event()
    hashing = GatedExecutor(gate)
    monkeypatch.setattr(bus_store.Store, "executor", lambda self: hashing)
    s = await caller(raw, r, "sealer")
    other = await caller(raw, r, "other")
    artifact_id = await allocate(s, length)
    data = os.urandom(1024) * (length // 1024)
    write_file(r, artifact_id, data)
    try:
        seal_id = await s.request("bus.seal", {"artifactId": artifact_id, "digest": sha(data)})
        stats_id = await s.request("bus.stats", {})
        for _ in range(200):
            if r.stats()["store"]["hashing"] == 1:
                break
            await asyncio.sleep(0.01)
        assert r.stats()["store"]["hashing"] == 1
        for _ in range(50):
            assert "result" in await other.call("bus.stats", {})
        assert r.stats()["store"]["hashing"] == 1
    finally:
        gate.set()
        hashing.shutdown(wait=False)
    # the first frame the sealing connection gets is its seal response: nothing was written
    # to it while the hash was held, and its pipelined request waited behind the seal
    first = await s.recv_obj()
    second = await s.recv_obj()
    assert first["id"] == seal_id and first["result"]["digest"] == sha(data)
    assert second["id"] == stats_id
    assert r.stats()["store"]["hashing"] == 0


# 149 ---------------------------------------------------------------------------------------
async def test_attachments_checked_at_call_admission(router: Any, raw: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc", "svc.a", max_queued=8, max_in_flight=8)
    c = await caller(raw, r, "c")
    o = await caller(raw, r, "o")
    mine = await sealed(c, r, b"mine")
    unsealed = await allocate(c, 8)
    theirs = await sealed(o, r, b"theirs")
    cases = [([unknown_id(mine)], "ARTIFACT_GONE"), ([unsealed], "ARTIFACT_UNSEALED"),
             ([theirs], "OWNER_INVALID")]
    before = r.stats()
    for ids, name in cases:
        resp = await c.call("bus.call", {**call_params("svc.a"), "attachments": ids})
        assert name_of(resp) == name
        call_id = c.next_id
        c.next_id += 1
        await c.send_obj({"jsonrpc": "2.0", "method": "bus.call", "params": {
            **call_params("svc.a"), "callId": call_id, "attachments": ids}})
        failed = await c.recv_notification("bus.callFailed")
        assert failed["callId"] == call_id and failed["error"]["data"]["name"] == name
        assert Validators.get().response(resp) is None  # the store's codes are in the schemas
        assert Validators.get().notifications["bus.callFailed"](failed) is None
        after = r.stats()
        assert (after["activeCalls"], after["calls"]) == (before["activeCalls"], before["calls"])
    assert "result" in await c.call("bus.call", {**call_params("svc.a"), "attachments": [mine]})
    req = await s.recv_notification("bus.request")
    assert req["attachments"] == [{"artifactId": mine, "length": 4, "digest": sha(b"mine")}]
    assert "result" in await c.call("bus.call", call_params("svc.a"))
    req = await s.recv_notification("bus.request")
    assert "attachments" not in req


# 150 ---------------------------------------------------------------------------------------
async def test_attachment_checks_precede_backpressure(router: Any, raw: Any) -> None:
    r = await router()
    await serve(raw, r, "svc", "svc.a", max_queued=1, max_in_flight=1)
    c = await caller(raw, r, "c")
    mine = await sealed(c, r, b"x")
    assert "result" in await c.call("bus.call", call_params("svc.a"))  # dispatched
    assert "result" in await c.call("bus.call", call_params("svc.a"))  # queued: full
    assert name_of(await c.call("bus.call", call_params("svc.a"))) == "BACKPRESSURE"
    resp = await c.call("bus.call", {**call_params("svc.a"), "attachments": [unknown_id(mine)]})
    assert name_of(resp) == "ARTIFACT_GONE"


# 151 ---------------------------------------------------------------------------------------
async def test_call_roots_keep_artifacts_alive(router: Any, raw: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc", "svc.a")
    c = await caller(raw, r, "c")
    artifact_id = await sealed(c, r, os.urandom(1000))
    collected = r.stats()["counters"]["artifactsCollected"]
    resp = await c.call("bus.call", {**call_params("svc.a"), "attachments": [artifact_id],
                                     "transfer": True})
    assert "result" in resp
    assert detail(r, "c")["holds"] == 0
    assert store_files(r) == [artifact_id]
    req = await s.recv_notification("bus.request")
    assert store_files(r) == [artifact_id]
    assert (await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]}))["result"] == {
        "released": 1}
    assert store_files(r) == []
    stats = r.stats()
    assert stats["store"]["bytes"] == 0
    assert stats["counters"]["artifactsCollected"] == collected + 1


# 152 ---------------------------------------------------------------------------------------
async def test_reply_attachments_rooted_until_the_result_is_consumed(router: Any,
                                                                      raw: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc", "svc.a", max_in_flight=4)
    c = await caller(raw, r, "c")
    o = await caller(raw, r, "o")
    # routed: rooted by the result until the caller consumes it
    assert "result" in await c.call("bus.call", call_params("svc.a"))
    req = await s.recv_notification("bus.request")
    reply_art = await sealed(s, r, b"reply")
    resp = await s.call("bus.reply", {"deliveryId": req["deliveryId"], "outcome": {},
                                      "attachments": [reply_art], "transfer": True})
    assert resp["result"] == {"routed": True}
    assert (await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]}))["result"] == {
        "released": 1}
    result = await c.recv_notification("bus.result")
    assert result["attachments"] == [{"artifactId": reply_art, "length": 5,
                                      "digest": sha(b"reply")}]
    assert detail(r, "svc")["holds"] == 0 and store_files(r) == [reply_art]
    await c.call("bus.consumed", {"deliveryIds": [result["deliveryId"]]})
    assert store_files(r) == []
    # the caller cancelled after dispatch: the reply roots nothing and is collected at once
    call = await c.call("bus.call", call_params("svc.a"))
    req = await s.recv_notification("bus.request")
    cancel = await c.call("bus.cancel", {"callId": call["id"]})
    assert cancel["result"] == {"state": "execution-unknown"}
    late = await sealed(s, r, b"late")
    resp = await s.call("bus.reply", {"deliveryId": req["deliveryId"], "outcome": {},
                                      "attachments": [late], "transfer": True})
    assert resp["result"] == {"routed": False}
    assert late not in store_files(r)
    await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]})
    # a refused reply keeps its capability
    assert "result" in await c.call("bus.call", call_params("svc.a"))
    req = await s.recv_notification("bus.request")
    theirs = await sealed(o, r, b"theirs")
    resp = await s.call("bus.reply", {"deliveryId": req["deliveryId"], "outcome": {},
                                      "attachments": [theirs]})
    assert name_of(resp) == "OWNER_INVALID"
    await s.send_obj({"jsonrpc": "2.0", "method": "bus.reply", "params": {
        "deliveryId": req["deliveryId"], "outcome": {}, "attachments": [theirs]}})
    failed = await s.recv_notification("bus.replyFailed")
    assert failed["error"]["data"]["name"] == "OWNER_INVALID"
    assert Validators.get().notifications["bus.replyFailed"](failed) is None
    assert await answer(s, req) is True


# 153 ---------------------------------------------------------------------------------------
async def test_retain_and_drop(router: Any, raw: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc", "svc.a")
    c = await caller(raw, r, "c")
    data = os.urandom(300)
    artifact_id = await sealed(c, r, data)
    assert "result" in await c.call("bus.call", {**call_params("svc.a"),
                                                 "attachments": [artifact_id]})
    req = await s.recv_notification("bus.request")
    resp = await s.call("bus.retain", {"artifactIds": [artifact_id]})
    assert resp["result"] == {"artifacts": [{"artifactId": artifact_id, "length": 300,
                                             "digest": sha(data)}]}
    assert await answer(s, req) is True
    assert (await c.call("bus.drop", {"artifactIds": [artifact_id]}))["result"] == {
        "dropped": 1}
    assert store_files(r) == [artifact_id]  # the service's hold survived the consumption
    hidden = await sealed(c, r, b"hidden")
    assert name_of(await s.call("bus.retain", {"artifactIds": [hidden]})) == "OWNER_INVALID"
    before = detail(r, "svc")
    assert (before["holds"], before["heldBytes"]) == (1, 300)
    assert "result" in await s.call("bus.retain", {"artifactIds": [artifact_id]})
    after = detail(r, "svc")
    assert (after["holds"], after["heldBytes"]) == (1, 300)
    assert (await s.call("bus.drop", {"artifactIds": [artifact_id]}))["result"] == {
        "dropped": 1}
    assert artifact_id not in store_files(r)
    resp = await s.call("bus.drop", {"artifactIds": [artifact_id, unknown_id(artifact_id)]})
    assert resp["result"] == {"dropped": 0}


# 154 ---------------------------------------------------------------------------------------
class RecordingProxy:
    """A Unix-socket proxy that records the frames each way, in order."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.path = os.path.join(short_socket_dir(), "proxy.sock")
        self.upstream: list[dict[str, Any]] = []  # client -> router
        self.downstream: list[dict[str, Any]] = []  # router -> client
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_unix_connection(self.target)
        self.writers += [writer, up_writer]
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._pump(reader, up_writer, self.upstream))
            tg.create_task(self._pump(up_reader, writer, self.downstream))

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    record: list[dict[str, Any]]) -> None:
        try:
            while True:
                prefix = await reader.readexactly(4)
                body = await reader.readexactly(int.from_bytes(prefix, "little"))
                record.append(orjson.loads(body))
                writer.write(prefix + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        await self.server.wait_closed()


def _carries(frame: dict[str, Any], delivery_id: str) -> bool:
    params = frame.get("params", {})
    return delivery_id in params.get("deliveryIds", ()) or delivery_id in params.get(
        "consumed", ())


async def test_sdk_keeps_result_attachments_before_consuming(router: Any, sdk: Any,
                                                             settle: Any) -> None:
    r = await router(maxArtifactBytes=4096, maxHeldBytesPerClient=4096)
    service = await sdk(r, "svc")

    async def handler(req: Request) -> Reply:
        alloc = await service.allocate(4096)
        art = await alloc.seal(sha(bytes(4096)))
        return Reply({"n": req.payload["n"]}, attachments=(art.artifact_id,), transfer=True)

    await service.register("svc.a", handler)
    proxy = RecordingProxy(r.socket_path)
    await proxy.start()
    try:
        c = await sdk(proxy.path, "c")
        res = await c.call("svc.a", "M", {"n": 1}, timeout=5)
        assert [a.length for a in res.attachments] == [4096]
        kept = res.attachments[0]
        await c.call("svc.a", "M", {"n": 2}, timeout=5, keep_attachments=False)
        await settle(r, lambda st: st["calls"] == 0)
        results = [f["params"] for f in proxy.downstream if f.get("method") == "bus.result"]
        first, second = results[0]["deliveryId"], results[1]["deliveryId"]
        retains = [i for i, f in enumerate(proxy.upstream) if f.get("method") == "bus.retain"]
        assert len(retains) == 1  # keep_attachments=False retained nothing
        credit = next(i for i, f in enumerate(proxy.upstream) if _carries(f, first))
        assert retains[0] < credit
        assert proxy.upstream[retains[0]]["params"] == {"artifactIds": [kept.artifact_id]}
        assert any(_carries(f, second) for f in proxy.upstream)
        # the caller holds 4096 bytes already: the next result's retain is refused
        with pytest.raises(AttachmentsNotKept) as info:
            await c.call("svc.a", "M", {"n": 3}, timeout=5)
        assert info.value.result.outcome == {"n": 3}
        assert info.value.name == "QUOTA_EXCEEDED"
        async with kept:
            pass
        await settle(r, lambda st: st["store"]["artifacts"] == 0)
        await c.close()
    finally:
        await proxy.stop()


# 155 ---------------------------------------------------------------------------------------
async def test_carried_credits_are_released_before_attachment_checks(router: Any,
                                                                     raw: Any) -> None:
    r = await router()
    s, _ = await serve(raw, r, "svc", "svc.a")
    c = await caller(raw, r, "c")
    assert "result" in await c.call("bus.call", call_params("svc.a"))
    req = await s.recv_notification("bus.request")
    art = await sealed(s, r, b"seen-once")
    await s.call("bus.reply", {"deliveryId": req["deliveryId"], "outcome": {},
                               "attachments": [art], "transfer": True, "consumed": True})
    result = await c.recv_notification("bus.result")
    admitted = r.stats()["counters"]["callsAdmitted"]
    await c.send_obj({"jsonrpc": "2.0", "method": "bus.call", "params": {
        **call_params("svc.a"), "callId": 100, "consumed": [result["deliveryId"]],
        "attachments": [art]}})
    failed = await c.recv_notification("bus.callFailed")
    assert failed["callId"] == 100
    assert failed["error"]["data"]["name"] in ("OWNER_INVALID", "ARTIFACT_GONE")
    assert r.stats()["counters"]["callsAdmitted"] == admitted
    assert store_files(r) == []


# 156 ---------------------------------------------------------------------------------------
async def _refused(r: Any, c: Any, method: str, params: dict[str, Any]) -> None:
    """`method` is refused QUOTA_EXCEEDED and the store is unchanged."""
    before = gauges(r)
    assert name_of(await c.call(method, params)) == "QUOTA_EXCEEDED"
    assert gauges(r) == before


async def _seen_through_a_call(raw: Any, r: Any, s: Any, data: bytes) -> str:
    """An artifact the service `s` sees only through a request delivery."""
    c = await caller(raw, r, f"c{os.urandom(3).hex()}")
    art = await sealed(c, r, data)
    assert "result" in await c.call("bus.call", {**call_params("svc.a"), "attachments": [art]})
    await s.recv_notification("bus.request")
    return art


async def test_store_quotas(router: Any, raw: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    r = await router(maxArtifactBytes=8192)
    c = await caller(raw, r, "c")
    await _refused(r, c, "bus.allocate", {"length": 8193})

    r = await router(maxAllocationsPerClient=2)
    c = await caller(raw, r, "c")
    await allocate(c, 1)
    await allocate(c, 1)
    await _refused(r, c, "bus.allocate", {"length": 1})

    r = await router(maxHoldsPerClient=1)
    s, _ = await serve(raw, r, "svc", "svc.a")
    await sealed(s, r, b"held")
    await _refused(r, s, "bus.allocate", {"length": 1})
    seen = await _seen_through_a_call(raw, r, s, b"seen")
    await _refused(r, s, "bus.retain", {"artifactIds": [seen]})

    r = await router(maxArtifactBytes=4096, maxHeldBytesPerClient=4096)
    s, _ = await serve(raw, r, "svc", "svc.a")
    await sealed(s, r, bytes(4000))
    await _refused(r, s, "bus.allocate", {"length": 97})
    seen = await _seen_through_a_call(raw, r, s, bytes(97))
    await _refused(r, s, "bus.retain", {"artifactIds": [seen]})

    r = await router(maxArtifacts=2)
    a = await caller(raw, r, "a")
    b = await caller(raw, r, "b")
    await allocate(a, 1)
    await allocate(b, 1)
    await _refused(r, a, "bus.allocate", {"length": 1})

    r = await router(maxArtifactBytes=4096, maxHeldBytesPerClient=4096, maxStoreBytes=8192)
    a = await caller(raw, r, "a")
    b = await caller(raw, r, "b")
    await allocate(a, 4096)
    await allocate(b, 4096)
    await _refused(r, a, "bus.allocate", {"length": 1})

    # a full memory file system: STORE_FAILURE, no file left, the store not failed
    r = await router()
    c = await caller(raw, r, "c")

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    before = gauges(r)
    with monkeypatch.context() as patch:
        patch.setattr(os, "posix_fallocate", full)
        assert error_of(await c.call("bus.allocate", {"length": 10})) == ("STORE_FAILURE",
                                                                          -32015)
    assert gauges(r) == before and before["failed"] is False
    await allocate(c, 10)


# 157 ---------------------------------------------------------------------------------------
def _flyd_router(socket_path: str, config: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "flyd", "router", "--open", "--socket",
                             socket_path, "--config", config],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _config(root: str) -> str:
    path = os.path.join(short_socket_dir(), "flyd.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(f'[bus.store]\nroot = "{root}"\n')
    return path


async def test_store_directory_rules(router: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    r = await router()
    parent = os.path.dirname(store_dir(r))
    assert os.path.basename(parent) == f"flyd-store-{os.geteuid()}"
    assert stat.S_IMODE(os.lstat(parent).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(store_dir(r)).st_mode) == 0o700
    root = tempfile.mkdtemp(prefix="flyd-t-rules-", dir=SHM)
    elsewhere = tempfile.mkdtemp(prefix="flyd-t-target-", dir=SHM)
    bad_parent = os.path.join(root, f"flyd-store-{os.geteuid()}")
    try:
        os.mkdir(bad_parent, 0o700)
        os.chmod(bad_parent, 0o755)
        with pytest.raises(RouterStartError, match=r"\[bus\.store\] root"):
            await router(store_root=root)
        proc = await asyncio.to_thread(
            lambda: _flyd_router(os.path.join(short_socket_dir(), "bus.sock"), _config(root))
            .communicate(timeout=8))
        assert b"[bus.store] root" in proc[1]
        os.rmdir(bad_parent)
        os.symlink(elsewhere, bad_parent)
        with pytest.raises(RouterStartError, match=r"\[bus\.store\] root"):
            await router(store_root=root)
        child = _flyd_router(os.path.join(short_socket_dir(), "bus.sock"), _config(root))
        await asyncio.to_thread(child.communicate, timeout=8)
        assert child.returncode == 2
        os.unlink(bad_parent)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(elsewhere, ignore_errors=True)
    assert bus_store.memory_fs(bus_store.TMPFS_MAGIC) and bus_store.memory_fs(
        bus_store.RAMFS_MAGIC)
    assert not bus_store.memory_fs(EXT4_MAGIC)
    monkeypatch.setattr(bus_store, "statfs_type", lambda path: EXT4_MAGIC)
    with pytest.raises(RouterStartError, match=r"\[bus\.store\] root.*tmpfs"):
        await router()


# 158 ---------------------------------------------------------------------------------------
async def test_symlinks_are_never_followed(router: Any, sdk: Any) -> None:
    r = await router()
    c = await sdk(r, "c")
    alloc = await c.allocate(16)
    alloc.view()[:] = b"a" * 16
    art = await alloc.seal()
    decoy_dir = tempfile.mkdtemp(prefix="flyd-t-decoy-", dir=SHM)
    decoy = os.path.join(decoy_dir, "decoy")
    _write(decoy, b"b" * 16)
    os.chmod(decoy, 0o444)
    path = os.path.join(store_dir(r), art.artifact_id)
    os.unlink(path)
    os.symlink(decoy, path)
    with pytest.raises(ArtifactMismatch):
        c.open_artifact(art)
    assert _read(decoy) == b"b" * 16
    os.unlink(path)
    # a store-* symlink in the parent: the sweep of the next start neither follows nor
    # removes it
    parent = os.path.dirname(store_dir(r))
    planted = os.path.join(parent, "store-" + "0" * 16)
    os.symlink(decoy_dir, planted)
    try:
        await router(store_root=os.path.dirname(parent))
        assert os.lstat(planted).st_mode & 0o170000 == stat.S_IFLNK
        assert os.listdir(decoy_dir) == ["decoy"]
    finally:
        os.unlink(planted)
        os.chmod(decoy, 0o600)
        os.unlink(decoy)
        os.rmdir(decoy_dir)


# 159 ---------------------------------------------------------------------------------------
async def test_store_is_offered_to_the_routers_uid_only(router: Any, raw: Any) -> None:
    marker = object()
    assert bus_store.store_offer(1000, 1000, marker) is marker
    assert bus_store.store_offer(1001, 1000, marker) is None
    assert bus_store.store_offer(0, 1000, marker) is None
    r = await router()
    c = await raw(r)
    result = (await c.hello("same-uid"))["result"]
    assert result["store"]["path"] == store_dir(r)
    off = await router(store_enabled=False)
    await serve(raw, off, "svc", "svc.a")
    c = await raw(off)
    assert (await c.hello("c"))["result"]["store"] is None
    assert error_of(await c.call("bus.allocate", {"length": 1})) == ("STORE_FAILURE", -32015)
    resp = await c.call("bus.call", {**call_params("svc.a"), "attachments": ["art-1"]})
    assert name_of(resp) == "ARTIFACT_GONE"
    assert off.stats()["store"] is None


# 160 ---------------------------------------------------------------------------------------
async def test_disconnect_collects_what_only_it_rooted(router: Any, raw: Any,
                                                       settle: Any) -> None:
    r = await router()
    s1, _ = await serve(raw, r, "svc1", "svc.one", max_queued=4, max_in_flight=1)
    s2, _ = await serve(raw, r, "svc2", "svc.two")
    x = await caller(raw, r, "x")
    baseline = r.stats()["store"]["holds"]
    allocated = await allocate(x, 8)
    only_held = await sealed(x, r, b"held")
    queued = await sealed(x, r, b"queued")
    dispatched = await sealed(x, r, b"dispatched")
    assert "result" in await x.call("bus.call", call_params("svc.one"))  # takes the slot
    await s1.recv_notification("bus.request")
    assert "result" in await x.call("bus.call", {**call_params("svc.one"),
                                                 "attachments": [queued]})
    assert r.stats()["queuedCalls"] == 1
    assert "result" in await x.call("bus.call", {**call_params("svc.two"),
                                                 "attachments": [dispatched]})
    req = await s2.recv_notification("bus.request")
    await x.close()
    await settle(r, lambda st: st["clients"] == 2)
    assert store_files(r) == [dispatched]
    assert {allocated, only_held, queued}.isdisjoint(store_files(r))
    await s2.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]})
    assert store_files(r) == []
    assert r.stats()["store"]["holds"] == baseline


# 161 ---------------------------------------------------------------------------------------
async def test_router_restart_sweeps_the_old_store(router: Any, sdk: Any) -> None:
    root = tempfile.mkdtemp(prefix="flyd-t-restart-", dir=SHM)
    live = await router(store_root=root)
    sock = os.path.join(short_socket_dir(), "bus.sock")
    child = _flyd_router(sock, _config(root))
    try:
        c = None
        for _ in range(500):  # the socket file exists between bind and listen too
            if _exists(sock):
                with contextlib.suppress(RouterLost):
                    c = await sdk(sock, "artist")
                    break
            await asyncio.sleep(0.01)
        assert c is not None, "the router child did not accept"
        for n in range(3):
            alloc = await c.allocate(100)
            alloc.view()[:] = bytes([n]) * 100
            await alloc.seal()
        old = c.store["path"]
        assert len(os.listdir(old)) == 3
        child.send_signal(signal.SIGKILL)
        await asyncio.to_thread(child.wait, 5)
        assert len(os.listdir(old)) == 3  # a crash leaves the directory behind
        fresh = await router(store_root=root)
        assert store_dir(fresh) != old
        assert not _exists(old)
        assert _exists(store_dir(live))
        await fresh.stop()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(5)
        child.communicate()
        await live.stop()
        shutil.rmtree(root, ignore_errors=True)


# 162 ---------------------------------------------------------------------------------------
async def test_orderly_stop_removes_the_store(router: Any, sdk: Any) -> None:
    r = await router()
    c = await sdk(r, "c")
    alloc = await c.allocate(64)
    alloc.view()[:] = b"z" * 64
    art = await alloc.seal()
    view = c.open_artifact(art)
    directory = store_dir(r)
    await r.stop()
    assert not _exists(directory)
    await c.wait_closed()
    with pytest.raises(RouterLost):
        await c.allocate(1)
    with pytest.raises(RouterLost):
        c.open_artifact(art)
    with pytest.raises(RouterLost):
        await c.retain([art.artifact_id])
    assert bytes(view) == b"z" * 64


# 163 ---------------------------------------------------------------------------------------
async def test_artifact_stats_follow_a_scenario(router: Any, raw: Any) -> None:
    r = await router()
    c = await caller(raw, r, "c")
    a = await sealed(c, r, b"a" * 10)
    b = await sealed(c, r, b"b" * 20)
    unsealed = await allocate(c, 30)
    resp = await c.call("bus.seal", {"artifactId": unsealed, "digest": sha(b"nope")})
    assert name_of(resp) == "ARTIFACT_MISMATCH"
    assert (await c.call("bus.drop", {"artifactIds": [a]}))["result"] == {"dropped": 1}
    stats = (await c.call("bus.stats", {"detail": True}))["result"]
    counters = stats["counters"]
    assert (counters["artifactsAllocated"], counters["artifactsSealed"],
            counters["sealsRefused"], counters["artifactsCollected"]) == (3, 2, 1, 1)
    store = stats["store"]
    assert (store["artifacts"], store["allocated"], store["bytes"]) == (2, 1, 50)
    assert store_files(r) == sorted([b, unsealed])
    row = next(row for row in stats["connectionsDetail"] if row["clientId"] == "c")
    assert (row["holds"], row["heldBytes"], row["allocations"]) == (2, 50, 1)


# 164 ---------------------------------------------------------------------------------------
async def test_reader_mapping_survives_collection(router: Any, sdk: Any) -> None:
    r = await router()
    c = await sdk(r, "c")
    alloc = await c.allocate(4096)
    data = os.urandom(4096)
    alloc.view()[:] = data
    art = await alloc.seal()
    view = c.open_artifact(art)
    assert await c.drop([art.artifact_id]) == 1
    assert store_files(r) == []
    assert bytes(view) == data
    with pytest.raises(ArtifactGone):
        c.open_artifact(art)


async def test_sdk_write_puts_the_whole_contents_without_a_mapping(router: Any, sdk: Any) -> None:
    """docs/topics.md §12: `Allocation.write` writes the whole contents with the fd closed
    before it returns, so the seal goes through; a wrong length or an open `view()` mapping is
    refused locally and leaves the allocation as it was."""
    r = await router()
    c = await sdk(r, "c")
    alloc = await c.allocate(4096)
    with pytest.raises(ValueError, match="4096 bytes; got 10"):
        alloc.write(b"x" * 10)
    view = alloc.view()
    with pytest.raises(BufferError, match="mapped"):
        alloc.write(b"y" * 4096)
    view.release()
    await alloc.seal(sha(bytes(4096)))
    other = await c.allocate(4096)
    data = os.urandom(4096)
    other.write(data)
    art = await other.seal(sha(data))
    assert art.digest == sha(data)
    assert bytes(c.open_artifact(art)) == data


async def test_open_artifact_copies_a_frame_and_maps_a_larger_artifact(router: Any,
                                                                       sdk: Any) -> None:
    """docs/topics.md §5.6: up to READ_COPY_MAX bytes the reader gets a private copy (one
    pread); above it a read-only mapping. Both are read-only and outlive the collection."""
    r = await router()
    c = await sdk(r, "c")
    views = []
    for length in (bus_store.READ_COPY_MAX, bus_store.READ_COPY_MAX + 1):
        alloc = await c.allocate(length)
        data = os.urandom(length)
        alloc.write(data)
        art = await alloc.seal(sha(data))
        view = c.open_artifact(art)
        assert await c.drop([art.artifact_id]) == 1
        views.append((view, data))
    (small, small_data), (large, large_data) = views
    assert type(small.obj) is bytes and bytes(small) == small_data
    assert isinstance(large.obj, mmap.mmap) and bytes(large) == large_data
    for view in (small, large):
        with pytest.raises(TypeError):
            view[0] = 1
    assert store_files(r) == []


async def test_sdk_seal_refuses_while_a_view_is_exported(router: Any, sdk: Any) -> None:
    """docs/topics.md §12: the unmap before the seal cannot happen while a view is exported,
    so the SDK refuses locally and sends nothing; released, the seal goes through."""
    r = await router()
    c = await sdk(r, "c")
    alloc = await c.allocate(32)
    view = alloc.view()
    view[:] = b"v" * 32
    frames = detail(r, "c")["framesIn"]
    with pytest.raises(BufferError):
        await alloc.seal()
    assert detail(r, "c")["framesIn"] == frames
    view.release()
    art = await alloc.seal(sha(b"v" * 32))
    assert bytes(c.open_artifact(art)) == b"v" * 32


def test_store_settings_are_read_once_by_the_config_layer(tmp_path: Path) -> None:
    """`[bus.store]` (docs/topics.md §5.1) becomes typed settings in the router's config;
    a bad key or value names itself; `flyd config show` lists both keys with their source."""
    good = tmp_path / "good.toml"
    good.write_text('[bus.store]\nenabled = false\nroot = "/dev/shm/elsewhere"\n')
    cfg = router_config(good, str(tmp_path / "bus.sock"))
    assert cfg.store == StoreSettings(enabled=False, root="/dev/shm/elsewhere")
    assert router_config(None, str(tmp_path / "bus.sock")).store == StoreSettings()
    shown = load_config(good).show()
    assert shown["bus.store.enabled"] == {"value": False, "source": "file"}
    assert shown["bus.store.root"] == {"value": "/dev/shm/elsewhere", "source": "file"}
    for text, message in (('[bus.store]\nbogus = 1\n', "[bus.store] bogus"),
                          ('[bus.store]\nroot = "shm"\n', "[bus.store] root"),
                          ('[bus.store]\nenabled = "yes"\n', "[bus.store] enabled")):
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            router_config(bad, str(tmp_path / "bus.sock"))
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(bad)


async def test_a_removed_store_directory_fails_the_store(router: Any, raw: Any) -> None:
    """docs/topics.md §5.1 rule 8: with its directory gone the store is failed for the rest of
    the router's life (STORE_FAILURE, `store.failed`), while calls keep working."""
    r = await router()
    s, _ = await serve(raw, r, "svc", "svc.a")
    c = await caller(raw, r, "c")
    kept = await sealed(c, r, b"kept")
    shutil.rmtree(store_dir(r))
    assert error_of(await c.call("bus.allocate", {"length": 1})) == ("STORE_FAILURE", -32015)
    assert r.stats()["store"]["failed"] is True
    assert name_of(await c.call("bus.allocate", {"length": 1})) == "STORE_FAILURE"
    resp = await c.call("bus.call", {**call_params("svc.a"), "attachments": [kept]})
    assert name_of(resp) == "ARTIFACT_GONE"
    assert "result" in await c.call("bus.call", call_params("svc.a"))
    req = await s.recv_notification("bus.request")
    assert await answer(s, req) is True
    await c.recv_notification("bus.result")
