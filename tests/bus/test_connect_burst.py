"""A burst of connects to a busy router waits in the listen backlog instead of being refused.

The router runs as a real child process and is stopped (SIGSTOP) while the burst arrives, so
nothing is accepted during it: every connect must fit the kernel's queue. The SDK's `connect`
treats a full queue (EAGAIN) as a wait within its timeout, not as a lost router.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from bus.client import BusClient, connect
from bus.errors import RouterLost
from bus.router import listen_backlog
from tests.bus.test_restart import RouterProcess

pytestmark = pytest.mark.timeout(30)

BURST = 2000


@pytest.fixture
async def rp() -> AsyncIterator[RouterProcess]:
    """A ready router child process (`flyd router --open`), killed at the end."""
    d = tempfile.mkdtemp(prefix="flyd-t-", dir="/tmp")
    proc = await RouterProcess.spawn(os.path.join(d, "r.sock"))
    try:
        await proc.ready()
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.proc.pid, signal.SIGCONT)
        await proc.kill()
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def stopped(proc: asyncio.subprocess.Process) -> Iterator[None]:
    """The router process frozen: it accepts nothing until the block ends."""
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def raw_connect(path: str) -> socket.socket:
    """A non-blocking connect, as a client in a hurry makes it; raises EAGAIN on a full queue."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
    except OSError:
        s.close()
        raise
    return s


async def stats_once_room(path: str) -> dict[str, Any]:
    """`bus.stats` from a fresh client, once the router has dropped enough of the burst's
    connections to be under maxClients again."""
    async with asyncio.timeout(10):
        while True:
            try:
                async with connect(path, client_id="after-burst", timeout=10) as bus:
                    return await bus.stats()
            except RouterLost as exc:
                assert "maxClients" in exc.message, exc
                await asyncio.sleep(0.05)


async def test_connect_burst_of_2000_is_queued_not_refused(rp: RouterProcess) -> None:
    held: list[socket.socket] = []
    refused: list[int] = []
    try:
        with stopped(rp.proc):
            for i in range(BURST):
                try:
                    s = raw_connect(rp.path)
                except OSError as exc:
                    refused.append(exc.errno or 0)
                    continue
                if i % 2:
                    s.send(b"\xff\xff\xff\xffgarbage")  # half of them speak nonsense
                held.append(s)
        assert refused == [], f"{len(refused)} of {BURST} connects refused (errno {refused[0]})"
        for s in held:
            s.close()
        # the router drains the queue, sees the burst go, and serves a well-behaved client
        stats = await stats_once_room(rp.path)
        assert stats["clients"] >= 1
        assert rp.proc.returncode is None
    finally:
        for s in held:
            s.close()


async def test_sdk_connect_waits_out_a_full_backlog(rp: RouterProcess) -> None:
    held: list[socket.socket] = []
    try:
        with stopped(rp.proc):
            eagain = False
            for _ in range(listen_backlog(64) + 64):
                try:
                    held.append(raw_connect(rp.path))
                except BlockingIOError:
                    eagain = True
                    break
            assert eagain, "the backlog never filled: the case did not bite"
            with pytest.raises(BlockingIOError) as info:
                raw_connect(rp.path)
            assert info.value.errno == errno.EAGAIN

            async def patient() -> BusClient:
                return await connect(rp.path, client_id="patient", timeout=10)

            attempt = asyncio.create_task(patient())
            await asyncio.sleep(0.3)
            assert not attempt.done(), attempt.exception()  # still trying, not RouterLost
            for s in held:
                s.close()
            held.clear()
        bus = await attempt
        try:
            assert isinstance(bus, BusClient) and bus.connection_id
            assert (await bus.stats())["clients"] >= 1
        finally:
            await bus.close()
    finally:
        for s in held:
            s.close()
