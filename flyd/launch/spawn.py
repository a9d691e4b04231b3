"""Worker child processes: spawn, exit watch, output forwarding, kill, psutil info
(design/session.md §7.5, §7.6).

Why: the launcher's process mode needs a handful of careful OS mechanics that have nothing to do
with sessions: a child in its own session and process group (pgid = pid) with a start-gate pipe
on stdin, the child's stdout and stderr forwarded line by line into our log with the worker's
identity attached (design/cli.md §9), and `killpg(SIGKILL)` of the whole group. `ChildProcess` owns
that for one child; `SpawnedChild` adds the start through `workers.launch.die_with_parent`
(`spawn_worker`) and an exit watch that costs no thread (a pidfd registered with the event
loop). A worker forked by the fork server is `flyd.launch.forkserver.ForkedChild`.

Decisions:
- The exit watch is `os.pidfd_open` + `loop.add_reader`: when the pidfd turns readable the child
  is a zombie, so its pid (= its pgid) cannot be reused yet; the watcher first sweeps the group
  with SIGKILL (nothing of a worker outlives it), then reaps with `Popen.poll()`.
- `spawn_worker` blocks (fork, then the wait for exec): the spawner runs it on its own thread,
  which lives as long as the node, never on the event loop.
- stdout and stderr share one pipe (stderr=STDOUT); a protocol splits it into lines in
  `data_received` (no reader task). A JSON object line (the worker's structlog output) is
  re-logged at its own level with its own event and fields plus `worker`, `incarnation`, `pid`;
  any other line is logged as `worker.output` with `line`. Lines are cut at 16 KiB.
- Why a child ended is kept for the launcher (`refusal`, `last_lines`): the `error` object of
  its `REFUSED_LAUNCH` line (a worker that could not build its model or world says why, as the
  wire `error` with its plugin fault) and its last `TAIL_LINES` (5) output lines, each cut to
  `TAIL_LINE` (240) characters (a crash that wrote only a traceback). `drained(timeout)` waits
  (bounded) for the end of the output, since the exit can be seen before the last lines.
- `kill()` is synchronous (design/distribution.md §5.5 step 3 runs it before any await); `wait()` is
  the bounded asynchronous part.
- `info()` reads psutil and `VmHWM` (peak RSS) from `/proc/<pid>/status`; a gone process gives
  None fields rather than an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO, Final

import orjson
import psutil
import structlog

from workers.launch import REFUSED_LAUNCH, START_GATE, die_with_parent

__all__ = ["MAX_LINE", "TAIL_LINE", "TAIL_LINES", "ChildProcess", "ProcessInfo",
           "SpawnedChild", "groups_running", "peak_rss_kib", "process_info", "settled_within",
           "spawn_worker"]

log = structlog.get_logger("flyd.launch.spawn")

MAX_LINE: Final = 16 * 1024
TAIL_LINES: Final = 5
TAIL_LINE: Final = 240
_LEVELS: Final = ("debug", "info", "warning", "error", "critical")
_SKIP: Final = frozenset({"level", "event", "ts", "timestamp"})
#: `/proc/<pid>/stat` states of a process that executes nothing: zombie, dead
_DEAD_STATES: Final = frozenset({"Z", "X", "x"})


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """psutil facts about one process (None where the process is gone or hides them)."""

    pid: int
    status: str | None
    rss_kib: int | None
    peak_rss_kib: int | None
    cpu_user_s: float | None
    cpu_system_s: float | None
    num_threads: int | None


def peak_rss_kib(pid: int) -> int | None:
    """`VmHWM` of `/proc/<pid>/status` in KiB, or None."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def groups_running(pgids: Iterable[int]) -> bool:
    """Whether one of the process groups `pgids` has a member that is not a zombie.

    `killpg(pgid, 0)` also succeeds for a group of zombies, and a killed worker's own children
    are orphans whose zombies only init reaps, on its own schedule (or never, when init does
    not reap). A zombie executes nothing, so for "the run's processes are dead"
    (design/distribution.md §5.5) it counts as dead.

    The node's lease runtime asks this on its event loop every `WORKER_POLL_S` while a lost
    scope's workers die, so it must stay cheap however many processes the host runs (a pass
    of psutil over every process took ≈ 12 ms per group on a 2-core host with 100 processes,
    enough to starve the watchdog): a group that is gone costs one `killpg`; a group whose
    leader runs, one read of the leader's `/proc/<pid>/stat`; only groups that exist with a
    dead leader (its zombie not reaped yet, or orphaned members) cost one pass over `/proc`,
    all of them together.
    """
    suspects: set[int] = set()
    for pgid in set(pgids):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            return True
        found = _proc_stat(pgid)
        if found is not None and found[1] == pgid and found[0] not in _DEAD_STATES:
            return True
        suspects.add(pgid)
    if not suspects:
        return False
    for name in os.listdir("/proc"):
        if name.isdigit():
            found = _proc_stat(int(name))
            if found is not None and found[1] in suspects and found[0] not in _DEAD_STATES:
                return True
    return False


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) from `/proc/<pid>/stat`, or None when it is gone. The
    command name in parentheses may hold spaces and parentheses: fields follow the last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2:].split(b" ", 4)
    return fields[0].decode("ascii", "replace"), int(fields[2])


def process_info(pid: int) -> ProcessInfo:
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            status: str | None = str(proc.status())
            rss: int | None = int(proc.memory_info().rss) // 1024
            cpu = proc.cpu_times()
            user: float | None = float(cpu.user)
            system: float | None = float(cpu.system)
            threads: int | None = int(proc.num_threads())
    except (psutil.Error, OSError):
        status, rss, user, system, threads = None, None, None, None, None
    return ProcessInfo(pid, status, rss, peak_rss_kib(pid), user, system, threads)


class _Lines(asyncio.Protocol):
    """Splits a child's output into lines and hands each to `sink`."""

    def __init__(self, sink: Callable[[bytes], None]) -> None:
        self._sink = sink
        self._buf = bytearray()
        self._dropping = False
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self._buf += data
        while True:
            cut = self._buf.find(b"\n")
            if cut < 0:
                break
            line = bytes(self._buf[:cut])
            del self._buf[:cut + 1]
            if self._dropping:
                self._dropping = False
                continue
            self._sink(line)
        if len(self._buf) > MAX_LINE:
            if not self._dropping:
                self._sink(bytes(self._buf[:MAX_LINE]) + " …".encode())
            self._dropping = True
            self._buf.clear()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._buf and not self._dropping:
            self._sink(bytes(self._buf))
        self._buf.clear()
        if not self.closed.done():
            self.closed.set_result(None)



async def settled_within(fut: asyncio.Future[Any], timeout: float) -> bool:  # noqa: ASYNC109
    """Wait up to `timeout` seconds for `fut` without cancelling it; True when it is done."""
    if fut.done():
        return True
    try:
        async with asyncio.timeout(timeout):
            await asyncio.shield(fut)
    except TimeoutError:
        return False
    return True

class ChildProcess:
    """One worker child: own process group, start gate, output forwarding, kill.

    `exited` resolves with the exit code once the child is gone. How the child was started and
    how its exit is learnt is the subclass's: `SpawnedChild` (our own child, a pidfd watch) or
    `flyd.launch.forkserver.ForkedChild` (the fork server's child, whose exit the server reports).
    """

    def __init__(self, pid: int, gate: BinaryIO, output: BinaryIO,
                 fields: Mapping[str, Any]) -> None:
        self._loop = asyncio.get_running_loop()
        self.pid: int = pid
        self.pgid: int = pid
        self._gate = gate
        self._output = output
        self._fields = dict(fields, pid=pid)
        self.exited: asyncio.Future[int] = self._loop.create_future()
        self._transport: asyncio.ReadTransport | None = None
        self._lines: _Lines | None = None
        self.refusal: dict[str, Any] | None = None
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)

    def settle(self, code: int) -> None:
        """Record the exit code (once); the exit watch (ours or the fork server's) calls it."""
        if not self.exited.done():
            self.exited.set_result(code)

    # output --------------------------------------------------------------------------------
    async def forward(self) -> None:
        """Start forwarding the child's output into our log (no reader task)."""
        transport, protocol = await self._loop.connect_read_pipe(
            lambda: _Lines(self._log_line), self._output)
        self._transport = transport
        self._lines = protocol

    def last_lines(self) -> list[str]:
        """The child's last output lines (at most `TAIL_LINES`, each cut to `TAIL_LINE`)."""
        return list(self._tail)

    async def drained(self, timeout: float) -> bool:  # noqa: ASYNC109 - a bound
        """Wait up to `timeout` seconds for the end of the child's output; True when it ended."""
        if self._lines is None:
            return True
        return await settled_within(self._lines.closed, timeout)

    def _keep(self, text: str) -> None:
        if text:
            self._tail.append(text if len(text) <= TAIL_LINE else text[:TAIL_LINE - 1] + "…")

    def _log_line(self, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip("\r")
        record: Any = None
        if line.startswith(b"{"):
            with contextlib.suppress(orjson.JSONDecodeError):
                record = orjson.loads(line)
        if isinstance(record, dict):
            level = record.get("level")
            event = record.get("event")
            meth = level if isinstance(level, str) and level in _LEVELS else "info"
            extra = {k: v for k, v in record.items() if k not in _SKIP and k not in self._fields}
            ours = {k: v for k, v in self._fields.items()
                    if not (k == "incarnation" and "incarnation_id" in record)}
            getattr(log, meth)(event if isinstance(event, str) else "worker.log", **ours, **extra)
            message = record.get("message")
            self._keep(f"{event}: {message}" if isinstance(message, str) else str(event))
            if event == REFUSED_LAUNCH and isinstance(record.get("error"), dict):
                self.refusal = record["error"]
        else:
            self._keep(text)
            if text:
                log.info("worker.output", **self._fields, line=text)

    # control -------------------------------------------------------------------------------
    def open_gate(self) -> None:
        """Write the start gate (`go\\n`) and close it."""
        try:
            self._gate.write(START_GATE)
            self._gate.flush()
        finally:
            with contextlib.suppress(OSError):
                self._gate.close()

    @property
    def returncode(self) -> int | None:
        return self.exited.result() if self.exited.done() else None

    def kill(self) -> None:
        """`killpg(SIGKILL)` of the child's group (synchronous, idempotent)."""
        if self.exited.done():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)

    async def wait(self, timeout: float) -> bool:  # noqa: ASYNC109 - a bound, not a deadline API
        """Wait up to `timeout` seconds for the exit; True when it exited."""
        return await settled_within(self.exited, timeout)

    async def close(self, timeout: float) -> bool:  # noqa: ASYNC109
        """Kill, wait up to `timeout` for the exit and for the output pipe to drain; True when
        the child is gone."""
        self.kill()
        gone = await self.wait(timeout)
        if self._lines is not None and gone:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.5):
                    await asyncio.shield(self._lines.closed)
        if self._transport is not None:  # owns (and closes) the output pipe
            self._transport.close()
        else:
            with contextlib.suppress(OSError):
                self._output.close()
        with contextlib.suppress(OSError):
            self._gate.close()
        return gone

    def info(self) -> ProcessInfo:
        return process_info(self.pid)


class SpawnedChild(ChildProcess):
    """A worker started with fork + exec by this process (`spawn_worker`), its exit watched by
    a pidfd on the event loop and reaped here."""

    def __init__(self, popen: subprocess.Popen[bytes], fields: Mapping[str, Any]) -> None:
        assert popen.stdin is not None and popen.stdout is not None
        super().__init__(popen.pid, popen.stdin, popen.stdout, fields)  # type: ignore[arg-type]
        self._popen = popen
        self._pidfd: int | None = None

    @classmethod
    async def spawn(cls, argv: Sequence[str], *, env: Mapping[str, str],
                    fields: Mapping[str, Any]) -> SpawnedChild:
        """`spawn_worker` on the calling thread, then `start`: for the node's own children (the
        router) started once, from the event-loop thread, which lives as long as the node."""
        return await cls.start(spawn_worker(argv, env), fields)

    @classmethod
    async def start(cls, popen: subprocess.Popen[bytes],
                    fields: Mapping[str, Any]) -> SpawnedChild:
        """Watch and forward a child `spawn_worker` started; killed on any failure."""
        child = cls(popen, fields)
        try:
            child._watch()
            await child.forward()
        except BaseException:
            child.kill()
            raise
        return child

    def _watch(self) -> None:
        try:
            self._pidfd = os.pidfd_open(self.pid)
        except ProcessLookupError:  # already reaped by someone: treat as exited
            self._finish()
            return
        self._loop.add_reader(self._pidfd, self._on_pidfd)

    def _on_pidfd(self) -> None:
        # Only an exited child is swept: a wakeup is checked first (WNOWAIT leaves the zombie
        # in place), so a spurious one can never SIGKILL a live child's group. While the child
        # is a zombie its pgid cannot be reused: sweep the group, then reap.
        try:
            exited = os.waitid(os.P_PID, self.pid,
                               os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:  # reaped by someone else already
            exited = True
        if not exited:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)
        if self._popen.poll() is None:  # not reapable yet
            return
        self._finish()

    def _finish(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        code = self._popen.poll()
        self.settle(code if code is not None else -int(signal.SIGKILL))


def spawn_worker(argv: Sequence[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start `argv` (no shell) in a new session with die-with-parent; stdin is the start-gate
    pipe, stdout and stderr one output pipe. Blocking (fork, then the wait for exec): callers
    run it on a thread that lives as long as the node (the death signal follows the forking
    thread, design/session.md §7.5), never on the event loop."""
    return die_with_parent(
        list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, env=dict(env), start_new_session=True, close_fds=True)
