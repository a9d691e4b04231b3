"""The node's router child process (design/cli.md §5.1, §4.1) and its configuration.

Why: `flyd serve` and `flyd run` both run `flyd router` as a child with die-with-parent, so a
killed node takes its router with it; the child gets a TOML file written here: the `[bus]` table
of the node's configuration (socket dropped: the socket is a flag), `[bus.limits]` raised to
design/cli.md §5.1's floors for the node's capacity and `max_agents`, and the default policy of
design/session.md §7.2 with the node's pid unless `[bus.policy]` is set.

Socket choice (design/cli.md §4.1): a forced path is used as given; otherwise the default socket,
unless a router already answers there, in which case a private `run-<pid>.sock` beside it.

A node never touches a path it did not bind (`check_socket_path`, `RouterChild.stop`):
- Before anything starts, the socket path is refused (`SocketPathError`, exit 2, `CONFIG`)
  when something other than a socket is there (a regular file, a directory, a symbolic link,
  ...), when a router already answers on it, and, for a path the user named (flag,
  environment, config file), when its directory does not exist: a mistyped path is an error,
  not a tree created and left behind. Only the default socket's directory (design/cli.md §2.2) is
  the node's to create.
- The router child's socket is removed by the node only if the path still holds the very socket
  (device and inode) that child bound, so a refused start, or a file that replaced the socket
  meanwhile, is left as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import stat
import sys
import time
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, Final

import orjson
import psutil
import structlog

from bus.limits import Limits, snake_case
from bus.policy import GRANT_KINDS, Policy
from bus.sockets import probe_socket
from bus.store import StoreSettings
from flyd.config import BusSettings, default_socket
from flyd.errors import ConfigError
from flyd.launch.spawn import ChildProcess, SpawnedChild
from flyd.session.runspec import DEFAULT_MAX_AGENTS

__all__ = ["RouterChild", "RouterChildError", "SocketPathError", "check_socket_path",
           "choose_socket", "required_limits", "router_answers", "router_toml"]

log = structlog.get_logger("flyd.node.router_child")

ROUTER_START_S: Final = 15.0
ROUTER_STOP_S: Final = 5.0
STOP_POLL_S: Final = 0.05


class RouterChildError(Exception):
    """The router child did not come up (exit 2, `CONFIG`)."""

    code = "CONFIG"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SocketPathError(ConfigError):
    """The node's router cannot bind this socket path without touching what is there, or the
    path's directory is missing (exit 2, `CONFIG`); nothing was changed."""


_KINDS: Final = ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"),
                 (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                 (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def check_socket_path(path: str, origin: str = "default") -> None:
    """Refuse a router socket path (module docstring) before anything starts; `origin` says
    where the path came from (`Config.origin`), `default` for the node's own default."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = os.path.dirname(path) or "."
        if origin != "default" and not os.path.isdir(parent):
            what = "is not a directory" if os.path.lexists(parent) else "does not exist"
            raise SocketPathError(f"{origin}: [bus] socket {path}: the directory {parent} "
                                  f"{what}") from None
        return
    except OSError as exc:
        raise SocketPathError(f"{origin}: [bus] socket {path}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a socket")
        raise SocketPathError(f"{origin}: [bus] socket {path} is {kind}, not a socket; not "
                              f"touching it")
    if router_answers(path):
        raise SocketPathError(f"{origin}: [bus] socket {path}: a router already answers there")


def router_answers(path: str) -> bool:
    """True when something accepts a connection on `path`; a path that cannot be probed at all
    has no router this node could use either."""
    try:
        return probe_socket(path)
    except OSError:
        return False


def choose_socket(forced: str | None) -> tuple[str, bool]:
    """design/cli.md §4.1: `(path, private)`; the default socket unless a router answers there, then
    `run-<pid>.sock` beside it; a forced path is used as given."""
    if forced:
        return forced, False
    default = default_socket()
    if not router_answers(default):
        return default, False
    return os.path.join(os.path.dirname(default), f"run-{os.getpid()}.sock"), True


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else orjson.dumps(key).decode()


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return orjson.dumps(value).decode()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to the router's configuration")


def _toml_table(prefix: str, table: Mapping[str, Any], out: list[str]) -> None:
    out.append(f"[{prefix}]")
    subtables: list[tuple[str, Mapping[str, Any]]] = []
    arrays: list[tuple[str, list[Mapping[str, Any]]]] = []
    for key, value in table.items():
        if isinstance(value, Mapping):
            subtables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            arrays.append((key, value))
        else:
            out.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, sub in subtables:
        _toml_table(f"{prefix}.{_toml_key(key)}", sub, out)
    for key, items in arrays:
        for item in items:
            out.append(f"[[{prefix}.{_toml_key(key)}]]")
            for k, v in item.items():
                out.append(f"{_toml_key(k)} = {_toml_value(v)}")


def _policy_table(policy: Policy) -> dict[str, Any]:
    clients: list[dict[str, Any]] = []
    for entry in policy.entries:
        item: dict[str, Any] = {"id": entry.id}
        for kind in GRANT_KINDS:
            patterns = list(getattr(entry, kind))
            if patterns:
                item[kind] = patterns
        if entry.require_expect:
            item["requireExpect"] = True
        if entry.pid is not None:
            item["pid"] = entry.pid
        clients.append(item)
    return {"mode": policy.mode, "client": clients}


def required_limits(capacity: int = 1, max_agents: int = DEFAULT_MAX_AGENTS) -> dict[str, int]:
    """design/cli.md §5.1: the `[bus.limits]` floors a node needs (snake_case keys). Expectations
    follow the clients' floor: every client of a session (workers, launcher, coordinator) is
    expected before it connects, and all of a composition's launches are in flight at once.
    A coordinator holds up to two calls per participant (every agent and the world) at once: a
    capture's answers, not yet consumed, while it sends every participant its
    `Worker.Acknowledge`; hence `2·(max_agents + 1)`, above cli.md's `2·max_agents`, which
    refused a 32-agent session's first checkpoint with `BACKPRESSURE`."""
    return {"max_clients": capacity * (max_agents + 3) + 8,
            "max_services": capacity * (max_agents + 1) + 1,
            "max_expectations": capacity * (max_agents + 3) + 8,
            "max_active_calls_per_client": 2 * (max_agents + 1)}


def router_toml(bus: BusSettings, node_pid: int, capacity: int = 1,
                max_agents: int = DEFAULT_MAX_AGENTS) -> str:
    """The router child's configuration: the node's `[bus]` (socket dropped: the socket is a
    flag) with `[bus.limits]` raised to `required_limits()` where the configured value is lower,
    plus the default policy with the node's pid (design/session.md §7.2) unless `bus` sets a policy.
    Limits and store settings are written where they differ from the router's defaults."""
    table: dict[str, Any] = {"allowed_uids": list(bus.allowed_uids)}
    if bus.socket_group is not None:
        table["socket_group"] = bus.socket_group
    configured = {snake_case(f.name): getattr(bus.limits, f.name) for f in fields(Limits)}
    defaults = {snake_case(f.name): getattr(Limits(), f.name) for f in fields(Limits)}
    limits = {key: value for key, value in configured.items() if value != defaults[key]}
    for key, floor in required_limits(capacity, max_agents).items():
        if configured[key] < floor:
            log.info("router.limit_raised", key=f"[bus.limits] {key}",
                     configured=configured[key], used=floor)
            limits[key] = floor
    if limits:
        table["limits"] = limits
    table["policy"] = _policy_table(bus.policy or Policy.default(node_pid))
    if bus.store != StoreSettings():
        table["store"] = {"enabled": bus.store.enabled, "root": bus.store.root}
    lines: list[str] = []
    _toml_table("bus", table, lines)
    return "\n".join(lines) + "\n"


class RouterChild:
    """`flyd router` on `socket` as a child of this process, started and stopped with bounds."""

    def __init__(self, directory: str, socket: str) -> None:
        self.directory = directory
        self.socket = socket
        self.process: ChildProcess | None = None
        self._bound: tuple[int, int] | None = None

    async def start(self, bus: BusSettings, *, capacity: int = 1,
                    max_agents: int = DEFAULT_MAX_AGENTS, quiet: int = 1) -> None:
        config = Path(self.directory) / "router.toml"
        config.write_text(router_toml(bus, os.getpid(), capacity, max_agents))
        env = {**os.environ, "FLYD_LOG_FORMAT": "json"}
        env.pop("FLYD_SOCKET", None)
        flags = ["-q"] * quiet if quiet > 0 else ["-v"] * -quiet
        self.process = await SpawnedChild.spawn(
            [sys.executable, "-m", "flyd", "router", "--socket", self.socket, "--config",
             str(config), *flags], env=env, fields={"component": "router"})
        deadline = time.monotonic() + ROUTER_START_S
        while True:
            if self.process.exited.done():
                raise RouterChildError(f"the router on {self.socket} exited with code "
                                       f"{self.process.exited.result()}")
            if await asyncio.to_thread(router_answers, self.socket):
                st = os.lstat(self.socket)
                self._bound = (st.st_dev, st.st_ino)
                return
            if time.monotonic() > deadline:
                raise RouterChildError(f"the router did not accept on {self.socket} within "
                                       f"{ROUTER_START_S:g}s")
            await asyncio.sleep(0.02)

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def remove_socket(self) -> None:
        """Remove the socket file this router child bound, if the path still holds that very
        socket (device and inode) and nothing answers on it; anything else is left alone."""
        bound, self._bound = self._bound, None
        try:
            st = os.lstat(self.socket)
        except FileNotFoundError:
            return
        if (bound == (st.st_dev, st.st_ino) and stat.S_ISSOCK(st.st_mode)
                and not router_answers(self.socket)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket)

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after `ROUTER_STOP_S`. The router's own process is checked by
        pid and command line too (a child whose exit watch fired early must not survive as an
        orphan still serving the socket). A router that had to be killed could not remove its
        socket file; that socket is removed here (`remove_socket`)."""
        router, self.process = self.process, None
        if router is None:
            return
        pid = router.pid
        if not router.exited.done() or self._serves(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            await router.wait(ROUTER_STOP_S)
            for _ in range(int(ROUTER_STOP_S / STOP_POLL_S)):  # a foreign pid: no event to await
                if not self._serves(pid):
                    break
                await asyncio.sleep(STOP_POLL_S)
            if self._serves(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        await router.close(ROUTER_STOP_S)
        await asyncio.to_thread(self.remove_socket)

    def _serves(self, pid: int) -> bool:
        """Whether `pid` is still this router (alive, not a zombie, our socket in its argv)."""
        try:
            proc = psutil.Process(pid)
            return (proc.status() != psutil.STATUS_ZOMBIE
                    and self.socket in proc.cmdline())
        except psutil.Error:
            return False
