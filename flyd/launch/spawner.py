"""How a node starts its process-mode workers: the fork server or plain spawn (docs/launcher.md).

Why: one object per node owns everything a worker start needs beyond one session: the launch
method of `[session] launcher` (`fork`: children of the fork server, `workers.forkserver`;
`spawn`: `python -m workers.<role>` forked and exec'd by the node), the thread that runs every
blocking fork/exec (the fork server's own start, and each plain spawn) so the event loop never
does, and the bound on launches in flight (`[session] launch_concurrency`), which the launcher
holds from the start of a worker until it identified.

    spawner = Spawner(LauncherSettings(), socket=path)
    parent = await spawner.parent_pid()          # what the worker's --parent-pid names
    async with spawner.launch_slot():            # one of `concurrency` launches in flight
        child = await spawner.start(launch, env=..., fields=..., timeout=...)
    await spawner.close()

Decisions:
- The spawner's thread is a one-thread executor that lives until `close()`: the death signal of
  a child follows the thread that forked it, so the thread must outlive every child it started
  (the node closes its spawner after its sessions reaped their workers).
- A launch waits for its slot without a deadline of its own: every holder's start and identify
  are bounded by `[session] health_boot_s`, so the wait is bounded by the launches ahead of it.
- The fork server starts at the first process-mode launch (a node that runs only thread-mode
  sessions never pays for it) and again after it was lost. Its start belongs to the spawner,
  not to the launch that asked first: a launch cancelled meanwhile (a lost lease must end its
  scope within K, on a host where the server's imports take seconds) stops waiting, and the
  next launch waits for the same server.
- A hung fork server is the node's to notice (`flyd.node.parts` probes `server` with
  `ForkServer.ping`); `replace_server()` kills it and starts another. `losses` counts servers
  lost while in use, replaced or died on their own: a run whose workers died with one is given
  its attempt back; so is one whose launch met a server that could not start (within
  `SERVER_START_S`: its imports are not a liveness probe's business).
- In fork mode a worker's `--parent-pid` is the fork server's pid; the server itself dies with
  the node, so nothing a node started outlives it either way.
- The environment of a forked worker is the server's (the node's at the server's start) plus
  the launch's thread variables and `PYTHONUNBUFFERED`; a spawned one gets the node's current
  environment plus the same.
- Plugin import roots (`[plugins] paths`, `--plugin-path`) reach every place a plugin is
  imported: the node's own `sys.path` (`add_import_roots`: the spec's import check and
  thread-mode workers) and, first on `PYTHONPATH`, the fork server's environment (its children
  inherit the `sys.path` it started with; an environment set after the fork would come too
  late for the interpreter) and every spawned worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, Literal

import structlog

from flyd.cancel import raise_if_cancelled
from flyd.launch.forkserver import ForkServer, ForkServerError
from flyd.launch.spawn import ChildProcess, SpawnedChild, spawn_worker
from workers.host import HostLaunch
from workers.launch import DEFAULT_MEDIA_INLINE_MAX_BYTES, WorkerLaunch

__all__ = ["LauncherSettings", "Spawner", "add_import_roots", "python_path"]

log = structlog.get_logger("flyd.launch.spawner")

#: how long the fork server may take to start (the interpreter and the worker imports)
SERVER_START_S: Final = 30.0


@dataclass(frozen=True, slots=True)
class LauncherSettings:
    """How a node starts process-mode workers (`[session] launcher`, `launch_concurrency`;
    docs/launcher.md): `fork` from the node's fork server or `spawn` with fork + exec, and how
    many launches may be in flight at once."""

    method: Literal["fork", "spawn"] = "fork"
    concurrency: int = 8
    #: absolute directories searched for plugin packages before the installed ones
    plugin_paths: tuple[str, ...] = ()
    #: `[session] media_inline_max_bytes`: every worker's threshold for media by reference
    #: (topics.md §14.2); transport, so not part of the run spec
    media_inline_max_bytes: int = DEFAULT_MEDIA_INLINE_MAX_BYTES
    #: `[session] agents_per_process`: agents per process-mode worker process (an agent host,
    #: `workers.host`; docs/launcher.md, "Agent hosts"); 1 is one process per agent
    agents_per_process: int = 1


def add_import_roots(paths: Sequence[str]) -> None:
    """Put the plugin import roots first on this process's `sys.path` (once each)."""
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    if paths:
        importlib.invalidate_caches()


def python_path(paths: Sequence[str], env: Mapping[str, str]) -> dict[str, str]:
    """The variables a child needs to import from `paths` first: `PYTHONPATH` with them ahead
    of `env`'s own; nothing when there are none."""
    if not paths:
        return {}
    inherited = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join([*paths, *inherited])}


class Spawner:
    """A node's worker starts: method, thread, fork server, concurrency bound."""

    def __init__(self, settings: LauncherSettings | None = None, *, socket: str = "",
                 python: str = sys.executable) -> None:
        self.settings = settings or LauncherSettings()
        self.socket = socket
        self.python = python
        self._slots = asyncio.Semaphore(self.settings.concurrency)
        #: process launches holding a slot now
        self.in_flight = 0
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="launch-spawner")
        self._server: ForkServer | None = None
        self._server_lock = asyncio.Lock()
        self._closed = False
        #: fork servers lost while in use (module docstring)
        self.losses = 0

    @property
    def method(self) -> str:
        """`fork` or `spawn` (`[session] launcher`), as launch errors name it."""
        return self.settings.method

    @contextlib.asynccontextmanager
    async def launch_slot(self) -> AsyncIterator[None]:
        """One of `concurrency` launches in flight, for the start and identify of a worker."""
        async with self._slots:
            self.in_flight += 1
            try:
                yield
            finally:
                self.in_flight -= 1

    async def fork_server(self) -> ForkServer:
        """The running fork server, started (again) when there is none. Its start is bounded
        by `SERVER_START_S`, not by a launch's boot budget: it happens once per node, and a
        launch cancelled while it starts (its lease lost) leaves it starting for the next."""
        async with self._server_lock:
            if self._closed:
                raise ForkServerError("the spawner is closed: the node is stopping")
            if self._server is None or self._server.closed:
                if self._server is not None:  # lost: reap it before starting the next
                    await self._server.close(1.0)
                env = python_path(self.settings.plugin_paths, os.environ)
                self._server = await ForkServer.start(
                    python=self.python, socket_path=self.socket, executor=self._thread,
                    timeout=SERVER_START_S, env={**os.environ, **env} if env else None,
                    on_lost=self._lost)
                raise_if_cancelled()
            server = self._server
        try:
            await server.until_ready()
        except ForkServerError:
            self.losses += 1  # a server that could not start failed the launch, not the run
            raise
        return server

    @property
    def server(self) -> ForkServer | None:
        """The fork server started last (None before the first process launch)."""
        return self._server

    def _lost(self) -> None:
        self.losses += 1

    async def replace_server(self) -> ForkServer:
        """Kill the current fork server (its workers die with it) and start another."""
        async with self._server_lock:
            old, self._server = self._server, None
        if old is not None:
            if not old.closed:
                self.losses += 1
            old.kill()
            await old.close(1.0)
        return await self.fork_server()

    async def parent_pid(self) -> int:
        """The pid a process worker's `--parent-pid` names: the fork server's or ours."""
        if self.settings.method == "fork":
            return (await self.fork_server()).pid
        return os.getpid()

    async def start(self, launch: WorkerLaunch | HostLaunch, *, env: Mapping[str, str],
                    fields: Mapping[str, Any], timeout: float) -> ChildProcess:  # noqa: ASYNC109
        """Start one worker process (one worker, or an agent host); it blocks on its start gate
        until `open_gate()`."""
        if self.settings.method == "fork":
            server = await self.fork_server()
            return await server.fork(launch.role, launch.to_argv(), env, fields, timeout)
        full = dict(os.environ)
        full.update(python_path(self.settings.plugin_paths, os.environ))
        full.update(env)
        popen = await asyncio.get_running_loop().run_in_executor(
            self._thread, spawn_worker, launch.command(self.python), full)
        return await SpawnedChild.start(popen, fields)

    async def close(self) -> None:
        """Stop the fork server (it kills what is left of its children) and the thread."""
        async with self._server_lock:
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            await server.close(5.0)
        self._thread.shutdown(wait=False)
