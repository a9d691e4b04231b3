"""The fork server: one process per node that has imported the worker modules and forks every
process-mode worker from itself (design/session.md §7.5; docs/launcher.md).

Why: a worker started with `python -m workers.agent` pays the interpreter's start and the
imports, about 0.4 s of CPU and a full private copy of every module; 64 of them at once starved
a node on two CPUs for seconds. A child forked from a process that already imported everything
starts in a few milliseconds and shares the imported pages copy-on-write. The node never forks:
it sends a request here and gets the pid back.

Protocol: one `SOCK_SEQPACKET` socket (one JSON object per packet), the node's end held by
`flyd.forkserver.ForkServer`:

    server → node  {"op": "ready", "pid": P}                               once, after the imports
    node → server  {"op": "fork", "id": N, "role": R, "argv": [...], "env": {...}}
                   with two descriptors (SCM_RIGHTS): the start-gate pipe's read end and the
                   output pipe's write end
    server → node  {"op": "forked", "id": N, "pid": P} | {"op": "forked", "id": N, "error": TEXT}
    server → node  {"op": "exited", "pid": P, "code": C}   C: the exit code, or −signal
    node → server  {"op": "reap", "pid": P}
    node → server  {"op": "ping", "id": N}    server → node  {"op": "pong", "id": N}
                   (the node's liveness probe: a server that stops answering is replaced)

The child (between the fork and the worker's `main`): a new session and process group
(pgid = pid), `PR_SET_PDEATHSIG(SIGKILL)` towards this server (which itself dies with the node),
the gate on stdin, the output pipe on stdout and stderr, every other descriptor closed, the
launch's environment variables set, and its command line (`/proc/<pid>/cmdline`) rewritten to
the `python -m workers.<role> <argv>` it stands for, so `ps`, psutil and every tool that finds
workers by their command line sees a forked worker as a spawned one; then exactly what
`python -m workers.<role>` runs, and `os._exit` with its code (nothing of the server's own state
runs again in the child). Role `host` (an agent host, `workers.host`) runs `python -m
workers.host`'s main the same way.

Command line: the kernel shows a process's argument area, which a process may overwrite in
place but not grow; the node starts the server with `--room` and `ROOM` spaces so there is room
for a worker's arguments (a longer one is cut after the last whole argument that fits; the
padding after it is NUL bytes, which psutil reports as empty trailing arguments).

Exit watch: a pidfd per child. When it turns readable the child is a zombie (`waitid` with
`WNOWAIT` reads its status and leaves it), so its pid, which is its pgid, cannot be reused: the
group is swept with SIGKILL (nothing of a worker outlives it) and the exit is reported. The
zombie is reaped only when the node answers `reap`, so the node's own `killpg` of a group it has
not yet seen exit can never reach a reused pgid. When the node's end closes, every group left
is killed and the server exits.

The server is single-threaded (a child of a multi-threaded process could inherit a held lock),
so it never starts a thread or an event loop, and it imports only what every worker needs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib
import os
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Sequence
from typing import Any, Final, NoReturn

import orjson

from workers.host import HOST_MODULE, HOST_ROLE
from workers.host import main as host_main
from workers.launch import CRASHED_EXIT, MODULES, arm_die_with_parent

__all__ = ["MAX_MESSAGE", "PRELOAD", "ROOM", "exit_code", "main", "set_cmdline", "warm"]

#: the largest packet either side sends (a launch's argv carries its model config)
MAX_MESSAGE: Final = 1 << 20
#: bytes of command line a forked worker can show (the server's `--room` padding)
ROOM: Final = 4096
#: what the server imports before it forks anything: both roles and their map, their shell, the
#: bus client, the synthetic plugins (the defaults) and the event loop every worker runs
PRELOAD: Final = ("uvloop", "workers.agent", "workers.environment", "workers.host",
                  "workers.roles", "workers.synthetic")
#: the module each role a fork request may name runs
ROLE_MODULES: Final[dict[str, str]] = {HOST_ROLE: HOST_MODULE, **dict(MODULES.items())}


def exit_code(info: os.waitid_result) -> int:
    """The exit code `Popen.returncode` would report: the status, or −signal."""
    if info.si_code == os.CLD_EXITED:
        return int(info.si_status)
    return -int(info.si_status)


class Server:
    """The fork server's state: the control socket and the children not yet reaped."""

    def __init__(self, control: socket.socket) -> None:
        self.control = control
        self.pid = os.getpid()
        self.selector = selectors.DefaultSelector()
        self.pidfds: dict[int, int] = {}  # pid → pidfd, for children still running
        self.zombies: set[int] = set()  # exited and reported, not yet reaped

    def send(self, message: dict[str, Any]) -> None:
        """One packet to the node (blocking: the server has nothing else to do meanwhile)."""
        self.control.send(orjson.dumps(message))

    def serve(self) -> int:
        """Announce `ready`, then answer the node and report exits until the node's end
        closes; returns the server's exit code."""
        self.selector.register(self.control, selectors.EVENT_READ, None)
        self.send({"op": "ready", "pid": self.pid})
        while True:
            for key, _ in self.selector.select():
                if key.data is None:
                    if not self.on_control():
                        self.shutdown()
                        return 0
                else:
                    self.on_exit(key.data)

    def on_control(self) -> bool:
        """One request from the node; False when the node's end is closed."""
        try:
            data, fds, _, _ = socket.recv_fds(self.control, MAX_MESSAGE, 2)
        except ConnectionResetError:
            return False
        if not data:
            for fd in fds:
                os.close(fd)
            return False
        try:
            message = orjson.loads(data)
            op = message.get("op")
            if op == "fork":
                self.fork(message, fds)
            elif op == "ping":
                self.send({"op": "pong", "id": message.get("id")})
            elif op == "reap" and message.get("pid") in self.zombies:
                self.zombies.discard(message["pid"])
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(message["pid"], 0)
        finally:
            for fd in fds:
                os.close(fd)
        return True

    def fork(self, message: dict[str, Any], fds: list[int]) -> None:
        """Fork one worker (`child`) and watch its pidfd; a malformed request or a failed
        fork is answered `forked` with an error, and the server goes on."""
        request = message.get("id")
        role, argv, env = message.get("role"), message.get("argv"), message.get("env")
        if (role not in ROLE_MODULES or len(fds) != 2 or not isinstance(argv, list)
                or not isinstance(env, dict)):
            self.send({"op": "forked", "id": request, "error": "malformed fork request"})
            return
        try:
            pid = os.fork()
        except OSError as exc:
            self.send({"op": "forked", "id": request, "error": f"fork: {exc}"})
            return
        if pid == 0:
            child(self.pid, role, argv, env, fds[0], fds[1])
        pidfd = os.pidfd_open(pid)
        self.pidfds[pid] = pidfd
        self.selector.register(pidfd, selectors.EVENT_READ, pid)
        self.send({"op": "forked", "id": request, "pid": pid})

    def on_exit(self, pid: int) -> None:
        """A child's pidfd turned readable: sweep its group and report the exit, keeping the
        zombie until the node's `reap` (module docstring, exit watch)."""
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is None:  # a spurious wakeup: the child still runs
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        pidfd = self.pidfds.pop(pid)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        self.zombies.add(pid)
        self.send({"op": "exited", "pid": pid, "code": exit_code(info)})

    def shutdown(self) -> None:
        """The node is gone: kill every group that is left and reap what can be reaped."""
        for pid in [*self.pidfds, *self.zombies]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for pid in [*self.pidfds, *self.zombies]:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def warm() -> None:
    """Fill the caches every worker fills at its start (the build and contract digests, every
    method schema compiled), so each child inherits them instead of computing them again."""
    from workers.types import contract

    contract.build_digest()
    contract.contract_digest()
    for path in sorted(contract.METHOD_SCHEMAS.glob("*.json")):
        method, kind, _ = path.name.rsplit(".", 2)
        contract.method_validator(method, kind)


def set_cmdline(argv: Sequence[str]) -> None:
    """Overwrite this process's argument area (`arg_start`..`arg_end` of `/proc/self/stat`)
    with `argv`, NUL-separated and NUL-padded; what does not fit is left out whole."""
    with open("/proc/self/stat", "rb") as fh:
        stat = fh.read()
    fields = stat[stat.rindex(b")") + 2:].split()
    start, end = int(fields[45]), int(fields[46])  # fields 48 and 49 of proc(5)
    room = end - start
    data = b""
    for arg in argv:
        item = os.fsencode(arg) + b"\0"
        if len(data) + len(item) > room:
            break
        data += item
    ctypes.memmove(start, data.ljust(room, b"\0"), room)


def child(server_pid: int, role: str, argv: Sequence[str], env: dict[str, str], gate: int,
          output: int) -> NoReturn:
    """The forked worker: detach, arm, rewire its standard streams, run the role's `main`."""
    code = CRASHED_EXIT
    try:
        os.setsid()
        arm_die_with_parent(server_pid)
        os.dup2(gate, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        os.environ.update(env)
        set_cmdline([sys.executable, "-m", ROLE_MODULES[role], *argv])
        sys.stdin = os.fdopen(0, "r", closefd=False)
        sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
        sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
        if role == HOST_ROLE:
            code = host_main(list(argv))
        else:
            from workers.main import main as worker_main
            from workers.roles import endpoint_for

            # the role's endpoint, as `python -m workers.<role>` gives it
            code = worker_main(role, list(argv), endpoint_factory=endpoint_for)  # type: ignore[arg-type]
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # the child must end here, whatever happened
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m workers.forkserver --control-fd N --parent-pid P [--socket PATH] [--room S]`;
    the socket is the node's bus socket, named only so the command line says whose server this
    is; `--room` is spaces that make room for a forked worker's command line."""
    parser = argparse.ArgumentParser(prog="python -m workers.forkserver")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--socket", default="")
    parser.add_argument("--room", default="")
    args = parser.parse_args(argv)
    arm_die_with_parent(args.parent_pid)
    for module in PRELOAD:
        importlib.import_module(module)
    warm()
    # The imported objects move to the permanent generation: a child's collections never
    # touch (and so never copy) the pages they share with the server.
    gc.collect()
    gc.freeze()
    control = socket.socket(fileno=args.control_fd)
    return Server(control).serve()


if __name__ == "__main__":
    sys.exit(main())

