"""Shared session fixtures: a closed-policy router in the test process, a node connection, a
session's names and thread budget, and launchers (session.md §7.2, §7.8).

The test process is the node: the router runs in-process on a short /tmp socket with
`Policy.default(os.getpid())`, and the node connection `node.<node_id>` (fresh node id) makes
every `bus.expect`, exactly as a node does.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psutil
import pytest

from bus.client import BusClient, connect
from bus.policy import Policy
from bus.router import Router, RouterConfig
from flyd.launch.budget import ThreadBudget
from flyd.launch.health import HealthPolicy
from flyd.launch.identities import SessionNames, SessionTags, new_node_id, node_client_id
from flyd.launch.launcher import Launcher


def short_socket_path() -> tuple[str, str]:
    """(directory, socket path) under /tmp: sun_path is 107 bytes."""
    d = tempfile.mkdtemp(prefix="flyd-s-", dir="/tmp")
    return d, os.path.join(d, "bus.sock")


@dataclass
class Node:
    """The test acting as a node: its router, its node connection and its ids."""

    router: Router
    socket: str
    node_id: str
    client: BusClient
    tags: SessionTags

    def names(self, session_id: str = "demo") -> SessionNames:
        return SessionNames(session_id=session_id, tag=self.tags.next(), node_id=self.node_id)


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    d, path = short_socket_path()
    router = Router(RouterConfig(socket_path=path, policy=Policy.default(os.getpid())))
    await router.start()
    node_id = new_node_id("test")
    client = await connect(path, client_id=node_client_id(node_id))
    try:
        yield Node(router, path, node_id, client, SessionTags())
    finally:
        await client.close()
        await router.stop()
        shutil.rmtree(d, ignore_errors=True)


LauncherFactory = Callable[..., Awaitable[Launcher]]


@pytest.fixture
async def launchers(node: Node) -> AsyncIterator[LauncherFactory]:
    """`await launchers(budget=..., health=..., session_id=...)` opens a session's launcher on
    the test node; every launcher is closed at teardown."""
    opened: list[Launcher] = []

    async def make(budget: ThreadBudget | None = None, health: HealthPolicy | None = None,
                   session_id: str = "demo", **kwargs: Any) -> Launcher:
        launcher = await Launcher.open(
            names=node.names(session_id), socket=node.socket, node=node.client,
            budget=budget or ThreadBudget(16, 1), health=health, **kwargs)
        opened.append(launcher)
        return launcher

    yield make
    for launcher in opened:
        await launcher.close()


def children(*, servers: bool = False) -> list[psutil.Process]:
    """Every live (non-zombie) descendant of the test process: the workers, and with `servers`
    also the fork servers (which live as long as their launcher or node, not a worker)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and (servers or not fork_server(child)):
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def fork_server(proc: psutil.Process) -> bool:
    """A fork server: its command line names `workers.forkserver` (a worker it forked shows the
    `workers.agent|environment` command line it stands for)."""
    return "workers.forkserver" in proc.cmdline()
