"""Socket permissions, peer credentials, pid binding, grants and log hygiene
(wire.md §1, §6, §7.10, §12, §13; §20 tests 87-97)."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from bus.client_serving import Request
from bus.errors import CallGone, Conflict, NoService, NotAuthorized, TargetChanged
from bus.policy import Policy, PolicyEntry

pytestmark = pytest.mark.timeout(10)

ROOT = Path(__file__).resolve().parents[2]
NOT_AUTHORIZED = -32002

# A subprocess client: reads "<socket path> <client id>" from stdin, connects with the SDK,
# prints the hello outcome as one JSON line, then waits for another stdin line and closes.
CHILD = r"""
import asyncio, json, sys
from bus.client import connect
from bus.errors import BusError

async def main():
    path, client_id = sys.stdin.readline().split()
    try:
        client = await connect(path, client_id=client_id)
    except BusError as exc:
        print(json.dumps({"ok": False, "name": exc.name, "code": exc.code,
                          "dispatch": exc.dispatch}), flush=True)
        return
    print(json.dumps({"ok": True, "clientId": client.client_id, "grants": client.grants,
                      "connectionId": client.connection_id}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    await client.close()

asyncio.run(main())
"""


class Child:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def hello(self, path: str, client_id: str) -> dict[str, Any]:
        """Tell the child to connect; return its printed hello outcome."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{path} {client_id}\n".encode())
        await self.proc.stdin.drain()
        async with asyncio.timeout(8):
            while True:
                line = await self.proc.stdout.readline()
                if not line:
                    raise AssertionError(f"child exited: {await self._stderr()}")
                with contextlib.suppress(ValueError):
                    out = json.loads(line)
                    if isinstance(out, dict) and "ok" in out:
                        return out

    async def finish(self) -> int:
        assert self.proc.stdin is not None
        with contextlib.suppress(ConnectionError):
            self.proc.stdin.write(b"\n")
            await self.proc.stdin.drain()
        return await asyncio.wait_for(self.proc.wait(), 8)

    async def _stderr(self) -> str:
        assert self.proc.stderr is not None
        return (await self.proc.stderr.read()).decode(errors="replace")


@pytest.fixture
async def child() -> AsyncIterator[Any]:
    children: list[Child] = []

    async def spawn() -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, cwd=ROOT, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        c = Child(proc)
        children.append(c)
        return c

    yield spawn
    for c in children:
        if c.proc.returncode is None:
            c.proc.kill()
            await c.proc.wait()


@pytest.fixture
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="flyd-t-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def clean_eof(conn: Any) -> None:
    """The previous frame was the last one: EOF follows with no byte (no bus.closing)."""
    async with asyncio.timeout(5):
        assert await conn.reader.read() == b""


async def refused_hello(conn: Any, client_id: str, name: str, code: int,
                        incarnation: str | None = None) -> dict[str, Any]:
    """A refused hello: its error response is the final frame, then EOF."""
    resp = await conn.hello(client_id, incarnation)
    assert "result" not in resp, resp
    err: dict[str, Any] = resp["error"]
    assert err["code"] == code
    assert err["data"] == {"name": name, "dispatch": "not-dispatched"}
    await clean_eof(conn)
    return err


async def ok_hello(conn: Any, client_id: str, incarnation: str | None = None) -> dict[str, Any]:
    resp = await conn.hello(client_id, incarnation)
    assert "result" in resp, resp
    result: dict[str, Any] = resp["result"]
    return result


def error_data(resp: dict[str, Any]) -> dict[str, Any]:
    assert "error" in resp, resp
    data: dict[str, Any] = resp["error"]["data"]
    return data


async def test_socket_mode_0600(router: Any, raw: Any, sock_dir: str) -> None:
    r = await router()
    st = os.lstat(r.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert st.st_mode & 0o777 == 0o600
    assert "result" in await (await raw(r)).hello("c-1")

    # a missing parent directory is created 0700
    path = os.path.join(sock_dir, "sub", "bus.sock")
    r2 = await router(socket_path=path)
    assert os.lstat(r2.socket_path).st_mode & 0o777 == 0o600
    assert os.lstat(os.path.dirname(path)).st_mode & 0o777 == 0o700


async def test_socket_mode_0660_with_group(router: Any, raw: Any, sock_dir: str) -> None:
    gid = os.getegid()
    group = grp.getgrgid(gid).gr_name
    r = await router(socket_group=group)
    st = os.lstat(r.socket_path)
    assert stat.S_ISSOCK(st.st_mode)
    assert st.st_mode & 0o777 == 0o660
    assert st.st_gid == gid
    assert "result" in await (await raw(r)).hello("c-1")

    # with a group, a missing parent directory is created 0750
    path = os.path.join(sock_dir, "sub", "bus.sock")
    r2 = await router(socket_group=group, socket_path=path)
    assert os.lstat(r2.socket_path).st_mode & 0o777 == 0o660
    parent = os.lstat(os.path.dirname(path))
    assert parent.st_mode & 0o777 == 0o750


async def test_wrong_uid_refused(router: Any, raw: Any) -> None:
    r = await router(allowed_uids=(os.geteuid() + 1,))
    c = await raw(r)
    # nothing sent: the very first frame is the closing
    msg = await c.recv_obj()
    assert msg["method"] == "bus.closing"
    err = msg["params"]["error"]
    assert err["code"] == NOT_AUTHORIZED
    assert err["data"] == {"name": "NOT_AUTHORIZED", "dispatch": "unknown"}
    await clean_eof(c)
    st = r.stats()
    assert st["counters"]["refusedAtAccept"] == 1
    assert st["counters"]["accepted"] == 0
    assert st["counters"]["helloOk"] == 0 and st["counters"]["helloRefused"] == 0
    assert st["counters"]["closes"].get("NOT_AUTHORIZED") == 1


async def test_pid_binding_refuses_other_pid(router: Any, raw: Any, sdk: Any) -> None:
    r = await router()
    launcher = await sdk(r, "launcher")
    assert await launcher.expect("w-1", 1) == 30.0
    c = await raw(r)
    await refused_hello(c, "w-1", "NOT_AUTHORIZED", NOT_AUTHORIZED)
    st = r.stats()
    assert st["expectations"] == 1  # a refused hello consumes nothing
    assert st["counters"]["helloRefused"] == 1


async def test_pid_binding_accepts_expected_pid_and_is_consumed(router: Any, raw: Any,
                                                                sdk: Any) -> None:
    r = await router()
    launcher = await sdk(r, "launcher")
    await launcher.expect("w-1", os.getpid())
    assert r.stats()["expectations"] == 1
    result = await ok_hello(await raw(r), "w-1")
    assert result["major"] == 1
    st = r.stats()
    assert st["expectations"] == 0
    assert (await launcher.stats())["expectations"] == 0


async def test_pid_binding_subprocess(router: Any, raw: Any, sdk: Any, child: Any,
                                      settle: Any) -> None:
    r = await router()
    launcher = await sdk(r, "launcher")
    kid = await child()
    await launcher.expect("w-1", kid.pid)

    # the parent is another process: refused, and the expectation stays
    await refused_hello(await raw(r), "w-1", "NOT_AUTHORIZED", NOT_AUTHORIZED)
    assert r.stats()["expectations"] == 1

    out = await kid.hello(r.socket_path, "w-1")
    assert out["ok"] is True, out
    assert out["clientId"] == "w-1"
    st = r.stats(detail=True)
    assert st["expectations"] == 0
    detail = [d for d in st["connectionsDetail"] if d["clientId"] == "w-1"]
    assert len(detail) == 1 and detail[0]["pid"] == kid.pid
    assert await kid.finish() == 0
    await settle(r, lambda s: s["clients"] == 1)


async def test_require_expect(router: Any, raw: Any, sdk: Any, child: Any,
                              settle: Any) -> None:
    kid = await child()
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="launcher", call=("*",), expect=("w-*",)),
        PolicyEntry(id="w-*", register=("worker.{clientId}",), require_expect=True),
        PolicyEntry(id="pinned", register=("pinned.svc",), pid=kid.pid),
    ))
    r = await router(policy=policy)
    launcher = await sdk(r, "launcher")

    # requireExpect without an expectation
    await refused_hello(await raw(r), "w-1", "NOT_AUTHORIZED", NOT_AUTHORIZED)

    # with one
    await launcher.expect("w-1", os.getpid())
    w1 = await raw(r)
    result = await ok_hello(w1, "w-1")
    assert result["grants"] == {"register": ["worker.w-1"], "call": [], "expect": [],
                                "delegate": [], "publish": [], "subscribe": [], "manage": []}
    resp = await w1.call("bus.register", {"name": "worker.w-1", "maxQueued": 1,
                                          "maxInFlight": 1})
    assert "result" in resp

    # after the expectation's ttl passes
    assert await launcher.expect("w-2", os.getpid(), ttl=0.1) == pytest.approx(0.1)
    assert r.stats()["expectations"] == 1
    await settle(r, lambda s: s["expectations"] == 0)
    await refused_hello(await raw(r), "w-2", "NOT_AUTHORIZED", NOT_AUTHORIZED)

    # an entry with a pid admits only that process
    await refused_hello(await raw(r), "pinned", "NOT_AUTHORIZED", NOT_AUTHORIZED)
    out = await kid.hello(r.socket_path, "pinned")
    assert out["ok"] is True, out
    assert out["grants"]["register"] == ["pinned.svc"]
    assert await kid.finish() == 0


async def test_expect_needs_grant_and_dies_with_launcher(router: Any, raw: Any, sdk: Any,
                                                         settle: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="nolaunch", call=("*",)),
        PolicyEntry(id="launcher", expect=("w-*",)),
        PolicyEntry(id="w-*", require_expect=True),
    ))
    r = await router(policy=policy)
    nolaunch = await sdk(r, "nolaunch")
    with pytest.raises(NotAuthorized) as info:
        await nolaunch.expect("w-1", os.getpid())
    assert info.value.code == NOT_AUTHORIZED and info.value.dispatch == "not-dispatched"
    assert (await nolaunch.stats())["expectations"] == 0  # the connection stays

    launcher = await raw(r)
    await ok_hello(launcher, "launcher")
    for cid in ("w-1", "w-2"):
        resp = await launcher.call("bus.expect", {"clientId": cid, "pid": os.getpid()})
        assert resp["result"] == {"clientId": cid, "expiresInMs": 30000}
    resp = await launcher.call("bus.expect", {"clientId": "x-1", "pid": os.getpid()})
    assert error_data(resp) == {"name": "NOT_AUTHORIZED", "dispatch": "not-dispatched"}
    assert r.stats()["expectations"] == 2

    await launcher.close()
    await settle(r, lambda s: s["expectations"] == 0)
    await refused_hello(await raw(r), "w-1", "NOT_AUTHORIZED", NOT_AUTHORIZED)


async def test_expect_incarnation_binding(router: Any, raw: Any, sdk: Any,
                                          settle: Any) -> None:
    r = await router()
    launcher = await sdk(r, "launcher")
    await launcher.expect("w-1", os.getpid(), client_incarnation="w-1-inc-a")
    await refused_hello(await raw(r), "w-1", "NOT_AUTHORIZED", NOT_AUTHORIZED, "w-1-inc-b")
    assert r.stats()["expectations"] == 1

    w1 = await raw(r)
    await ok_hello(w1, "w-1", "w-1-inc-a")
    assert r.stats()["expectations"] == 0
    with pytest.raises(Conflict) as live:
        await launcher.expect("w-1", os.getpid(), client_incarnation="w-1-inc-c")
    assert live.value.dispatch == "not-dispatched"
    await w1.close()
    await settle(r, lambda s: s["clients"] == 1)

    with pytest.raises(Conflict) as info:
        await launcher.expect("w-1", os.getpid(), client_incarnation="w-1-inc-a")
    assert info.value.code == -32009 and info.value.dispatch == "not-dispatched"
    assert r.stats()["expectations"] == 0
    # a fresh incarnation is fine
    await launcher.expect("w-1", os.getpid(), client_incarnation="w-1-inc-d")
    assert r.stats()["expectations"] == 1


async def test_expect_grants_replace_policy_grants(router: Any, raw: Any) -> None:
    policy = Policy(mode="closed", entries=(
        PolicyEntry(id="launcher", expect=("s1.*",), delegate=("s1.*",)),
        PolicyEntry(id="s1.*", register=("*",), call=("*",), require_expect=True),
        PolicyEntry(id="launcher2", expect=("w-*",), delegate=("agent.{clientId}",)),
        PolicyEntry(id="w-*", register=("*",), call=("*",), expect=("*",), delegate=("*",)),
    ))
    r = await router(policy=policy)
    launcher = await raw(r)
    await ok_hello(launcher, "launcher")
    pid = os.getpid()

    resp = await launcher.call("bus.expect", {
        "clientId": "s1.fly-a.g1", "pid": pid,
        "grants": {"register": ["s1.agent.fly-a"], "call": []}})
    assert resp["result"]["clientId"] == "s1.fly-a.g1"
    agent = await raw(r)
    result = await ok_hello(agent, "s1.fly-a.g1")
    assert result["grants"] == {"register": ["s1.agent.fly-a"], "call": [], "expect": [],
                                "delegate": [], "publish": [], "subscribe": [], "manage": []}
    resp = await agent.call("bus.register", {"name": "s1.agent.fly-a", "maxQueued": 1,
                                             "maxInFlight": 1})
    assert "result" in resp
    resp = await agent.call("bus.register", {"name": "s1.agent.fly-b", "maxQueued": 1,
                                             "maxInFlight": 1})
    assert error_data(resp) == {"name": "NOT_AUTHORIZED", "dispatch": "not-dispatched"}
    for target in ("s1.agent.fly-a", "s1.agent.fly-b", "other.svc"):
        resp = await agent.call("bus.call", {"target": target, "expectedIncarnation": None,
                                             "method": "M.x", "payload": {}})
        assert error_data(resp) == {"name": "NOT_AUTHORIZED", "dispatch": "not-dispatched"}

    # grants beyond the launcher's delegate patterns
    for grants in ({"register": ["s2.agent.x"], "call": []},
                   {"register": [], "call": ["s2.agent.x"]}):
        resp = await launcher.call("bus.expect", {"clientId": "s1.fly-b.g1", "pid": pid,
                                                  "grants": grants})
        assert error_data(resp) == {"name": "NOT_AUTHORIZED", "dispatch": "not-dispatched"}
    assert r.stats()["expectations"] == 0

    # {clientId} in a delegate pattern is the expected client's id
    launcher2 = await raw(r)
    await ok_hello(launcher2, "launcher2")
    resp = await launcher2.call("bus.expect", {"clientId": "w-2", "pid": pid,
                                               "grants": {"register": ["agent.w-2"]}})
    assert resp["result"]["clientId"] == "w-2"
    resp = await launcher2.call("bus.expect", {"clientId": "w-2", "pid": pid,
                                               "grants": {"register": ["agent.w-3"]}})
    assert error_data(resp) == {"name": "NOT_AUTHORIZED", "dispatch": "not-dispatched"}
    assert r.stats()["expectations"] == 1  # the refused expect replaced nothing

    w2 = await raw(r)
    result = await ok_hello(w2, "w-2")
    # a missing list grants nothing; an expected client gets no expect/delegate grants
    assert result["grants"] == {"register": ["agent.w-2"], "call": [], "expect": [],
                                "delegate": [], "publish": [], "subscribe": [], "manage": []}
    resp = await w2.call("bus.register", {"name": "agent.w-2", "maxQueued": 1,
                                          "maxInFlight": 1})
    assert "result" in resp
    resp = await w2.call("bus.register", {"name": "agent.w-3", "maxQueued": 1,
                                          "maxInFlight": 1})
    assert error_data(resp) == {"name": "NOT_AUTHORIZED", "dispatch": "not-dispatched"}

    # the {clientId} token in expect grants is substituted with the expected client's id
    resp = await launcher2.call("bus.expect", {"clientId": "w-4", "pid": pid,
                                               "grants": {"register": ["agent.{clientId}"]}})
    assert resp["result"]["clientId"] == "w-4"
    w4 = await raw(r)
    result = await ok_hello(w4, "w-4")
    assert result["grants"]["register"] == ["agent.w-4"]
    resp = await w4.call("bus.register", {"name": "agent.w-4", "maxQueued": 1,
                                          "maxInFlight": 1})
    assert "result" in resp
    assert r.fatal is None


async def test_payload_never_logged(router: Any, raw: Any, sdk: Any, settle: Any) -> None:
    marker = "zz-secret-payload-marker-7c1f"

    async def echo(req: Request) -> dict[str, Any]:
        return {"echo": req.payload, "note": marker}

    async def boom(req: Request) -> dict[str, Any]:
        raise ValueError(f"handler failed on {req.payload}")

    async def huge(req: Request) -> dict[str, Any]:
        return {"blob": marker * 8000}

    with structlog.testing.capture_logs() as logs:
        r = await router(maxEnvelopeBytes=65536, maxQueuedCallBytes=65536)
        svc = await sdk(r, "svc-1")
        echo_svc = await svc.register("svc.echo", echo)
        await svc.register("svc.boom", boom)
        await svc.register("svc.huge", huge)
        caller = await sdk(r, "caller-1")
        payload = {"secret": marker, "nested": {"k": [marker]}}

        res = await caller.call("svc.echo", "Echo.Run", payload, timeout=5)
        assert res.outcome == {"echo": payload, "note": marker}
        with pytest.raises(CallGone):
            await caller.call("svc.boom", "Boom.Run", payload, timeout=5)
        with pytest.raises(CallGone):
            await caller.call("svc.huge", "Huge.Run", payload, timeout=5)
        with pytest.raises(TargetChanged):
            await caller.call("svc.echo", "Echo.Run", payload, timeout=5,
                              expected_incarnation="svc-1")
        with pytest.raises(NoService):
            await caller.call("svc.none", "None.Run", payload, timeout=5)
        assert await echo_svc.unregister() is True

        # a raw client whose malformed payload (duplicate key) names the marker: since minor 3
        # the router forwards the body and the service's SDK refuses it (wire.md §22.1)
        bad = await raw(r)
        await ok_hello(bad, "bad-1")
        body = ('{"jsonrpc":"2.0","id":2,"method":"bus.call","params":{"target":"svc.boom",'
                '"expectedIncarnation":null,"method":"Boom.Run","payload":{"'
                + marker + '":1,"' + marker + '":2}}}').encode()
        await bad.send_body(body)
        bad.next_id = 3
        assert "result" in await bad.recv_response(2)
        refused = await bad.recv_notification("bus.result")
        assert refused["outcome"]["bus.error"]["data"] == {"name": "INVALID_PARAMS",
                                                          "dispatch": "not-dispatched"}
        assert (await bad.call("bus.consumed", {"deliveryIds": [refused["deliveryId"]]}))[
            "result"] == {"released": 1}
        await bad.close()
        await caller.close()
        await settle(r, lambda s: s["calls"] == 0 and s["clients"] == 1)

    text = repr(logs)
    assert marker not in text
    events = {entry["event"] for entry in logs}
    assert {"bus.hello", "bus.register", "bus.close"} <= events
    # methods and ids may be logged
    failed = [e for e in logs if e["event"] == "bus.client.handler_failed"]
    assert failed and failed[0]["method"] == "Boom.Run" and isinstance(failed[0]["call_id"], int)
    refused = [e for e in logs if e["event"] == "bus.client.reply_refused"]
    assert refused and refused[0]["method"] == "Huge.Run"
