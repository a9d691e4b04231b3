"""Router stop, kill and restart (wire.md §1, §11, §17; §20 tests 82-86)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import stat
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.client_calls import PendingCall
from bus.client_serving import Request
from bus.errors import RouterLost
from bus.router import SUN_PATH_MAX, staging_path

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
#: a deadline that tells a router that never comes up from one slow to start on a loaded host
READY_TIMEOUT_S = 30.0


@pytest.fixture
def sock_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="flyd-t-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


class RouterProcess:
    """`python -m flyd router --socket PATH --open` as a child process."""

    def __init__(self, proc: asyncio.subprocess.Process, path: str, log: Path) -> None:
        self.proc = proc
        self.path = path
        self.log = log

    @classmethod
    async def spawn(cls, path: str, log_name: str = "router.log") -> RouterProcess:
        log = Path(path).parent / log_name
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "flyd", "router", "--socket", path, "--open",
                cwd=ROOT, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL, stderr=err,
            )
        return cls(proc, path, log)

    async def ready(self) -> None:
        """Retry a connection until the router accepts one."""
        async with asyncio.timeout(READY_TIMEOUT_S):
            while True:
                assert self.proc.returncode is None, self.log.read_text()
                try:
                    _, writer = await asyncio.open_unix_connection(self.path)
                except OSError:
                    await asyncio.sleep(0.02)
                    continue
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()
        await self.proc.wait()


@pytest.fixture
async def spawn_router() -> AsyncIterator[Any]:
    procs: list[RouterProcess] = []

    async def make(path: str, log_name: str = "router.log") -> RouterProcess:
        rp = await RouterProcess.spawn(path, log_name)
        procs.append(rp)
        return rp

    yield make
    for rp in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rp.proc.pid, signal.SIGCONT)
        await rp.kill()


def exists(path: str) -> bool:
    return os.path.exists(path)


def assert_router_lost(exc: BaseException | None) -> None:
    assert isinstance(exc, RouterLost), repr(exc)
    assert exc.name == "ROUTER_LOST"
    assert exc.code == -32008
    assert exc.dispatch == "unknown"


async def outcome(aw: Any) -> BaseException | None:
    try:
        await aw
    except BaseException as exc:  # the outcome under test
        return exc
    return None


async def test_orderly_stop_sends_router_lost(router: Any, raw: Any, sdk: Any) -> None:
    r = await router()
    path = r.socket_path
    svc = await raw(r)
    assert "result" in await svc.hello("svc-1")
    resp = await svc.call("bus.register", {"name": "svc.a", "maxQueued": 4, "maxInFlight": 1})
    assert "result" in resp
    pending_hello = await raw(r)  # never sends bus.hello
    client = await sdk(r, "caller-1")

    dispatched = asyncio.create_task(client.call("svc.a", "A.Run", {}, timeout=None))
    req = await svc.recv_notification("bus.request")
    queued: PendingCall = await client.start_call("svc.a", "A.Run", {})
    queued_result = asyncio.create_task(queued.result())
    assert r.stats()["queuedCalls"] == 1
    assert req["caller"]["clientId"] == "caller-1"

    await r.stop()

    for conn in (svc, pending_hello):
        error = await conn.expect_closing("ROUTER_LOST")
        assert error["code"] == -32008
        assert "stopping" in error["message"]
    assert not exists(path)
    assert_router_lost(await outcome(dispatched))
    assert_router_lost(await outcome(queued_result))
    assert_router_lost(await client.wait_closed())
    assert client.closed
    assert_router_lost(await outcome(client.stats()))


async def test_router_kill_gives_router_lost(sock_dir: str, spawn_router: Any,
                                             sdk: Any) -> None:
    path = os.path.join(sock_dir, "bus.sock")
    rp = await spawn_router(path)
    await rp.ready()

    entered = asyncio.Event()
    cancelled = asyncio.Event()
    release = asyncio.Event()

    async def handler(req: Request) -> dict[str, Any]:
        entered.set()
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {}

    owner = await sdk(path, "svc-owner")
    await owner.register("svc.k", handler, max_queued=4, max_in_flight=1)
    caller = await sdk(path, "caller-1")

    dispatched = asyncio.create_task(caller.call("svc.k", "K.Run", {"n": 1}, timeout=None))
    await entered.wait()
    queued: PendingCall = await caller.start_call("svc.k", "K.Run", {"n": 2})
    queued_result = asyncio.create_task(queued.result())

    # Freeze the router so that the next requests stay unanswered, then kill it.
    os.kill(rp.proc.pid, signal.SIGSTOP)
    await asyncio.to_thread(os.waitid, os.P_PID, rp.proc.pid, os.WSTOPPED | os.WNOWAIT)
    unadmitted = asyncio.create_task(caller.call("svc.k", "K.Run", {"n": 3}, timeout=None))
    command = asyncio.create_task(caller.stats())
    owner_command = asyncio.create_task(owner.services())
    pending = [dispatched, queued_result, unadmitted, command, owner_command]
    for _ in range(5):
        await asyncio.sleep(0)  # let the tasks write their requests (a loop turn, no wait)
    assert not any(t.done() for t in pending)

    os.kill(rp.proc.pid, signal.SIGKILL)
    assert await rp.proc.wait() == -signal.SIGKILL

    for task in pending:
        assert_router_lost(await outcome(task))
    assert_router_lost(await caller.wait_closed())
    assert_router_lost(await owner.wait_closed())
    await asyncio.wait_for(cancelled.wait(), 5)  # handler tasks are cancelled
    assert_router_lost(await outcome(caller.call("svc.k", "K.Run", {}, timeout=1.0)))


async def test_restart_new_router_id_and_fresh_state(router: Any, raw: Any,
                                                     sock_dir: str) -> None:
    path = os.path.join(sock_dir, "bus.sock")
    r1 = await router(socket_path=path)
    s1 = await raw(r1)
    assert "result" in await s1.hello("svc-1", "svc-1-inc-1")
    old = (await s1.call("bus.register", {"name": "svc.x", "maxQueued": 4,
                                          "maxInFlight": 1}))["result"]["serviceIncarnation"]
    c1 = await raw(r1)
    hello1 = (await c1.hello("caller-1", "caller-1-inc-1"))["result"]
    await r1.stop()
    await s1.expect_closing("ROUTER_LOST")
    await c1.expect_closing("ROUTER_LOST")

    r2 = await router(socket_path=path)
    c2 = await raw(r2)
    # remembered incarnations are gone too: the same incarnation is accepted again
    hello2 = (await c2.hello("caller-1", "caller-1-inc-1"))["result"]
    assert re.fullmatch(r"router-[0-9a-f]{16}", hello2["routerId"])
    assert hello2["routerId"] != hello1["routerId"]
    assert hello2["connectionId"] == "conn-1"
    assert (await c2.call("bus.services", {}))["result"] == {"services": []}
    st = r2.stats()
    assert st["services"] == 0 and st["calls"] == 0 and st["expectations"] == 0

    params = {"target": "svc.x", "expectedIncarnation": old, "method": "X.Do", "payload": {}}
    resp = await c2.call("bus.call", params)
    assert resp["error"]["code"] == -32003
    assert resp["error"]["data"] == {"name": "NO_SERVICE", "dispatch": "not-dispatched"}

    s2 = await raw(r2)
    assert "result" in await s2.hello("svc-1", "svc-1-inc-1")
    new = (await s2.call("bus.register", {"name": "svc.x", "maxQueued": 4,
                                          "maxInFlight": 1}))["result"]["serviceIncarnation"]
    assert new != old
    resp = await c2.call("bus.call", params)
    assert resp["error"]["code"] == -32004
    assert resp["error"]["data"] == {"name": "TARGET_CHANGED", "dispatch": "not-dispatched"}

    notes: list[dict[str, Any]] = []
    assert "result" in await s2.call("bus.stats", {}, notes=notes)
    assert notes == []  # never delivered
    st = r2.stats()
    assert st["calls"] == 0 and st["counters"]["callsAdmitted"] == 0
    assert st["counters"]["callsRefused"] == 2


async def test_stale_socket_replaced_live_socket_refused(sock_dir: str, spawn_router: Any,
                                                         sdk: Any) -> None:
    path = os.path.join(sock_dir, "bus.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)
    stale.close()  # the file stays behind, nothing listens
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with pytest.raises(ConnectionRefusedError):
        probe.connect(path)
    probe.close()

    first = await spawn_router(path, "first.log")
    await first.ready()
    client = await sdk(path, "watcher")
    assert (await client.stats())["connections"] == 1
    mode = os.lstat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600

    second = await spawn_router(path, "second.log")
    code = await asyncio.wait_for(second.proc.wait(), 8)
    assert code != 0
    assert "live router" in second.log.read_text()

    # the first router keeps serving: the old connection and new ones work
    assert first.proc.returncode is None
    assert exists(path)
    st = await client.stats()
    assert st["routerId"] == client.router_id
    other = await sdk(path, "watcher-2")
    assert other.router_id == client.router_id

    first.proc.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(first.proc.wait(), 8) == 0
    assert not exists(path)
    assert_router_lost(await client.wait_closed())


async def test_sdk_reconnect_uses_new_incarnation(router: Any, sdk: Any, settle: Any) -> None:
    r = await router()
    first = await sdk(r, "cli-r")
    inc1 = first.client_incarnation
    await first.close()
    await settle(r, lambda st: st["clients"] == 0)

    second = await sdk(r, "cli-r")
    inc2 = second.client_incarnation
    assert inc1 != inc2
    for inc in (inc1, inc2):
        assert re.fullmatch(r"inc-[0-9a-f]{32}", inc)
    detail = r.stats(detail=True)["connectionsDetail"]
    assert [(d["clientId"], d["clientIncarnation"]) for d in detail] == [("cli-r", inc2)]
    assert r.stats()["counters"]["helloOk"] == 2


@pytest.mark.timeout(5 * 2 * READY_TIMEOUT_S)
async def test_socket_file_appears_only_when_the_router_accepts(sock_dir: str,
                                                               spawn_router: Any) -> None:
    """The router listens under a staging name and links the socket's path afterwards, so a
    client that waits for the file (as the launcher's children and flyctl do) is never refused
    by a socket that is bound but not yet listening. Spinning on the path and connecting at
    the first sight of it, several starts in a row."""
    for attempt in range(5):
        path = os.path.join(sock_dir, f"bus-{attempt}.sock")
        rp = await spawn_router(path, f"router-{attempt}.log")
        async with asyncio.timeout(READY_TIMEOUT_S):
            while not exists(path):
                assert rp.proc.returncode is None, rp.log.read_text()
                await asyncio.sleep(0)
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)  # refused only if the file came before listen
        finally:
            probe.close()
        # the router unlinks the staging name right after the link, so it may still be there
        # at the first sight of the path; it must go without anything else happening
        expected = sorted(f"bus-{k}.sock" for k in range(attempt + 1))
        staging = os.path.basename(str(staging_path(path, rp.proc.pid)))
        async with asyncio.timeout(READY_TIMEOUT_S):
            while (names := sorted(n for n in os.listdir(sock_dir)
                                   if not n.endswith(".log"))) != expected:
                assert set(names) - set(expected) <= {staging}, names
                await asyncio.sleep(0.001)
        mode = os.lstat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_staging_name_fits_sun_path_or_the_router_binds_in_place() -> None:
    short = "/tmp/flyd-x/bus.sock"
    staging = staging_path(short)
    assert staging is not None
    assert os.path.dirname(staging) == "/tmp/flyd-x"
    assert os.path.basename(staging) == f".bus.sock.{os.getpid()}.bind"
    assert staging_path(short, 42) == "/tmp/flyd-x/.bus.sock.42.bind"
    long = "/tmp/" + "d" * (SUN_PATH_MAX - len("/tmp/") - len("/bus.sock")) + "/bus.sock"
    assert len(long) == SUN_PATH_MAX
    assert staging_path(long) is None
