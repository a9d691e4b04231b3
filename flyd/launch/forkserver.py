"""The node's end of the fork server (`workers.forkserver`; docs/launcher.md).

Why: the node's event loop must never fork, exec or wait for a child's start: a node that did
lost its own lease while 64 workers booted. `ForkServer` starts the server once (on the
spawner's thread, never the loop), then asks it for each worker over a `SOCK_SEQPACKET` socket
watched by the event loop; the worker's gate and output pipes are made here and their child ends
handed over with SCM_RIGHTS, so `ForkedChild` forwards output and opens the gate exactly as a
spawned child does.

Decisions:
- Sends never block the loop: a packet the socket cannot take now waits in an outbox flushed
  when the socket turns writable; the descriptors it carries are closed once it is sent.
- The server reports each exit after sweeping the child's group and keeps the zombie until the
  `reap` this end sends on that report, so a `killpg` from here before the report can never reach
  a reused process group.
- When the server is gone (killed, crashed), its children died with it (`PR_SET_PDEATHSIG`):
  every child still known here is settled as killed (−9), waiting forks fail, and the spawner
  starts a new server for the next launch.
- A fork answer that arrives after its launch gave up is killed at once.
- `ping` is the node's liveness probe (`flyd.node.parts`): a server that does not answer within
  the node's deadline is hung; `kill()` ends it (SIGKILL reaches a stopped process too) and the
  spawner starts another, as for a server that died. `on_lost` hears a loss the node did not
  ask for (the server's end closed), so a run's failure can be traced to it.
- A fork request over `MAX_REQUEST` bytes (its argv carries the model or world config) fails
  that launch alone, before anything is sent: a larger packet would not fit the socket's
  buffer, and an exec'd worker could not take such an argument either (Linux limits one to
  128 KiB).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Final

import orjson
import structlog

from flyd.launch.spawn import ChildProcess
from workers.forkserver import MAX_MESSAGE, ROOM
from workers.launch import die_with_parent

__all__ = ["MAX_REQUEST", "ForkServer", "ForkServerError", "ForkedChild"]

log = structlog.get_logger("flyd.launch.forkserver")

_KILLED: Final = -int(signal.SIGKILL)
#: the largest fork request sent (see the module docstring)
MAX_REQUEST: Final = 128 * 1024


class ForkServerError(Exception):
    """The fork server could not start, answered with an error, or is gone."""


class ForkedChild(ChildProcess):
    """A worker forked by the fork server; `exited` is settled by the server's report."""

    def __init__(self, pid: int, gate: int, output: int, fields: Mapping[str, Any]) -> None:
        super().__init__(pid, os.fdopen(gate, "wb", buffering=0),
                         os.fdopen(output, "rb", buffering=0), fields)


class ForkServer:
    """One running fork server and the children it forked for this node."""

    def __init__(self, sock: socket.socket, popen: subprocess.Popen[bytes],
                 start_timeout: float, on_lost: Callable[[], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._sock = sock
        self._popen = popen
        self.pid: int = popen.pid
        self._start_timeout = start_timeout
        self._ready_due = self._loop.time() + start_timeout
        self._ready: asyncio.Future[None] = self._loop.create_future()
        # a start nobody waits for any more (every launch cancelled) may fail unobserved
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._children: dict[int, ForkedChild] = {}
        self._outbox: collections.deque[tuple[bytes, list[int]]] = collections.deque()
        self._writing = False
        self._serial = 0
        self._on_lost = on_lost
        self.closed = False

    @classmethod
    async def start(cls, *, python: str, socket_path: str, executor: Executor,
                    timeout: float,  # noqa: ASYNC109
                    env: Mapping[str, str] | None = None,
                    on_lost: Callable[[], None] | None = None) -> ForkServer:
        """Spawn `python -m workers.forkserver` on `executor`'s thread (which must live as long
        as the node: the server's death signal follows it). The server is returned before it is
        ready: `until_ready()` waits for its `ready`, due within `timeout` seconds of now. `env`
        is its whole environment (None: the node's), which every worker it forks inherits;
        `on_lost` is called when the server's end closes without `close()`. A
        caller cancelled while the process starts still gets the server, with its task's
        cancellation left pending (`flyd.cancel.raise_if_cancelled`)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [python, "-m", "workers.forkserver", "--control-fd", str(theirs.fileno()),
                "--parent-pid", str(os.getpid()), "--socket", socket_path, "--room", " " * ROOM]
        loop = asyncio.get_running_loop()
        spawned = loop.run_in_executor(executor, functools.partial(
            die_with_parent, argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            pass_fds=(theirs.fileno(),), start_new_session=True, close_fds=True, env=env))
        popen: subprocess.Popen[bytes] | None = None
        try:
            try:
                popen = await asyncio.shield(spawned)
            except asyncio.CancelledError:
                # The thread forks and execs regardless: a server it started is returned all the
                # same (the caller re-raises the cancellation), so none is lost; a start that
                # failed ends in the cancellation itself.
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(timeout):
                        popen = await spawned
                if popen is None:
                    raise
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        server = cls(ours, popen, timeout, on_lost)
        loop.add_reader(ours.fileno(), server._on_readable)
        return server

    async def until_ready(self) -> None:
        """Wait for the server's `ready` until its start is due. A cancelled wait leaves the
        start going, so the next launch waits for the same server instead of starting (and
        importing) another; a server that exits first or misses its due time is closed and
        `ForkServerError` raised, to every waiter."""
        try:
            async with asyncio.timeout_at(self._ready_due):
                await asyncio.shield(self._ready)
        except TimeoutError:
            await self.close(1.0)
            raise ForkServerError(f"the fork server did not start within "
                                  f"{self._start_timeout:g}s") from None
        except ForkServerError:
            await self.close(1.0)
            raise

    # ------------------------------------------------------------------ receive

    def _on_readable(self) -> None:
        while not self.closed:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                if self._on_lost is not None:
                    self._on_lost()
                return
            message = orjson.loads(data)
            op = message.get("op")
            if op == "ready":
                if not self._ready.done():
                    self._ready.set_result(None)
                    log.info("forkserver.started", pid=self.pid)
            elif op in ("forked", "pong"):
                self._on_answer(message)
            elif op == "exited":
                self._on_exited(int(message["pid"]), int(message["code"]))

    def _on_answer(self, message: dict[str, Any]) -> None:
        waiter = self._pending.pop(message.get("id", -1), None)
        if waiter is not None and not waiter.done():
            waiter.set_result(message)
        elif isinstance(message.get("pid"), int):  # its launch gave up: nobody will gate it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(message["pid"], signal.SIGKILL)

    def _on_exited(self, pid: int, code: int) -> None:
        child = self._children.pop(pid, None)
        self._send({"op": "reap", "pid": pid})
        if child is not None:
            child.settle(code)

    def _lost(self) -> None:
        """The server's end closed: it is gone, and its children with it."""
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._sock.fileno())
        if self._writing:
            self._loop.remove_writer(self._sock.fileno())
            self._writing = False
        while self._outbox:
            _, fds = self._outbox.popleft()
            for fd in fds:
                os.close(fd)
        self._sock.close()
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(ForkServerError("the fork server is gone"))
        self._pending.clear()
        if not self._ready.done():
            self._ready.set_exception(ForkServerError("the fork server exited before it was "
                                                      "ready"))
        children, self._children = self._children, {}
        for child in children.values():
            child.kill()
            child.settle(_KILLED)

    # ------------------------------------------------------------------ send

    def _send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        data = orjson.dumps(message)
        if self.closed or len(data) > MAX_REQUEST:
            for fd in fds:
                os.close(fd)
            raise ForkServerError("the fork server is gone" if self.closed else
                                  f"a fork request of {len(data)} bytes exceeds {MAX_REQUEST}")
        self._outbox.append((data, list(fds)))
        self._flush()

    def _flush(self) -> None:
        while self._outbox and not self.closed:
            data, fds = self._outbox[0]
            try:
                socket.send_fds(self._sock, [data], fds)
            except BlockingIOError:
                if not self._writing:
                    self._loop.add_writer(self._sock.fileno(), self._flush)
                    self._writing = True
                return
            except OSError:
                self._lost()
                return
            self._outbox.popleft()
            for fd in fds:
                os.close(fd)
        if self._writing and not self.closed:
            self._loop.remove_writer(self._sock.fileno())
            self._writing = False

    # ------------------------------------------------------------------ fork

    async def fork(self, role: str, argv: Sequence[str], env: Mapping[str, str],
                   fields: Mapping[str, Any], timeout: float) -> ForkedChild:  # noqa: ASYNC109
        """One worker: gate and output pipes, the request, the pid; the child waits on its gate.
        `ForkServerError` when the server refuses or is gone, `TimeoutError` past `timeout`."""
        gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
        out_r, out_w = os.pipe2(os.O_CLOEXEC)
        self._serial += 1
        request = self._serial
        waiter: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending[request] = waiter
        try:
            self._send({"op": "fork", "id": request, "role": role, "argv": list(argv),
                        "env": dict(env)}, [gate_r, out_w])
            async with asyncio.timeout(timeout):
                reply = await waiter
            if "pid" not in reply:
                raise ForkServerError(f"the fork server refused: {reply.get('error')}")
        except BaseException:
            self._pending.pop(request, None)
            os.close(gate_w)
            os.close(out_r)
            raise
        child = ForkedChild(int(reply["pid"]), gate_w, out_r, fields)
        self._children[child.pid] = child
        try:
            await child.forward()
        except BaseException:
            child.kill()
            raise
        return child

    # ------------------------------------------------------------------ liveness

    @property
    def ready(self) -> bool:
        """Started and not lost: a server that can be probed."""
        return (not self.closed and self._ready.done() and not self._ready.cancelled()
                and self._ready.exception() is None)

    async def ping(self) -> None:
        """One liveness round trip (unbounded: the caller bounds it); `ForkServerError` when
        the server is gone."""
        self._serial += 1
        request = self._serial
        waiter: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending[request] = waiter
        try:
            self._send({"op": "ping", "id": request})
            await waiter
        finally:
            self._pending.pop(request, None)

    def kill(self) -> None:
        """SIGKILL the server process (hung or not); `close()` then reaps it."""
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()

    # ------------------------------------------------------------------ close

    async def close(self, timeout: float) -> None:  # noqa: ASYNC109
        """Close our end (the server kills every group left and exits), wait up to `timeout`
        for its exit, then kill it."""
        self._lost()
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(self._popen.wait, timeout)
        if self._popen.poll() is None:
            self._popen.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self._popen.wait, 1.0)
