"""`flyd serve`: the node service (design/cli.md §5; design/distribution.md §5).

Why: a host joins the shared queue by running this. It resolves the configuration (defaults <
file < environment < flags), starts the node (`flyd.node.process.NodeProcess`), registers it,
and works through the queue until a drain (SIGTERM, SIGINT) ends it with exit 0: it claims runs
while its capacity and thread budget allow, executes them, renews their leases and finishes them.
A run whose spec carries `exclusiveToSubmitter: true` belongs to the `flyd run` that submitted
it and is never claimed here.

Errors before serving (bad configuration, unreachable DSN, a router that does not come up, a
malformed `$NOTIFY_SOCKET`) exit 2 with code `CONFIG`, as JSON on stdout under `--json`.

With `--metrics ADDR` (or `[node] metrics`) the node serves Prometheus metrics on ADDR
(`flyd.node.metrics`, docs/operations.md); an address that cannot be bound exits 2.

Under systemd (design/cli.md §5.2, §10; `flyd.node.sdnotify`), while serving:
- `READY=1` (with the first `STATUS=`) once `node.start()` returned, i.e. the router accepts and
  the database is migrated. It is sent from the status task's first step, which runs only after
  `node.serve()` has installed its SIGTERM/SIGINT handlers and suspended, so a stop request that
  follows readiness always drains.
- `STATUS=` every `STATUS_S` seconds: `serving: <held>/<capacity> runs held, <x> steps/s` (the
  steps the node's sessions took since the previous line, per second), `draining: ...` once a
  drain started.
- `WATCHDOG=1` every half `WATCHDOG_USEC` from a task on the event loop, so a blocked loop misses
  its pings and systemd restarts the node. No ping is sent while the node holds its claims
  because a part of its own (router, fork server) could not be brought back
  (`NodeProcess.impaired`): the node cannot launch runs, and a restart of the whole unit is
  the remedy left; the `STATUS=` line then reads `impaired: <reason>`.
- `STOPPING=1` once, when the first drain request arrives (SIGTERM, SIGINT, `Control.Drain`:
  `NodeProcess.drain_listeners`), i.e. at step 1 of design/distribution.md §5.8.
The notification variables are removed from the environment at start, so the router and the
workers never speak for the unit.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson
import psycopg
import structlog

from flyd.config import load_config
from flyd.errors import ConfigError
from flyd.launch.identities import new_node_id
from flyd.leases.migrate import MigrationError
from flyd.leases.stores.contract import StoreError
from flyd.logs import LogFlags
from flyd.node.grant import RunReport
from flyd.node.process import NodeProcess, NodeSetup, NodeStartError
from flyd.node.router_child import RouterChildError
from flyd.node.sdnotify import Notifier, NotifyError

__all__ = ["ServeOptions", "serve"]

log = structlog.get_logger("flyd.cli.serve")

EXIT_CONFIG = 2
STATUS_S: Final = 5.0


@dataclass(frozen=True)
class ServeOptions:
    config_file: Path | None = None
    dsn: str | None = None
    socket: str | None = None
    state_dir: Path | None = None
    node_name: str | None = None
    capacity: int | None = None
    router: bool | None = None
    lease_ttl: float | None = None
    as_json: bool = False
    log: LogFlags = field(default_factory=LogFlags)
    sim_clock: Path | None = None
    time_scale: float = 1.0
    clock_rate: float = 1.0
    plugin_paths: tuple[Path, ...] = ()
    metrics: str | None = None

    def flags(self) -> dict[str, Any]:
        return {"database.dsn": self.dsn, "bus.socket": self.socket,
                "node.state_dir": self.state_dir, "node.name": self.node_name,
                "node.capacity": self.capacity, "node.router": self.router,
                "leases.ttl_s": self.lease_ttl, "node.log_format": self.log.format,
                "plugins.paths": self.plugin_paths or None, "node.metrics": self.metrics}


def _error(opts: ServeOptions, message: str) -> int:
    print(f"flyd serve: {message}", file=sys.stderr)
    if opts.as_json:
        sys.stdout.write(orjson.dumps({"error": {"code": "CONFIG", "message": message}})
                         .decode() + "\n")
    return EXIT_CONFIG


async def serve(opts: ServeOptions) -> int:
    """Run the node until it is drained; returns the exit code."""
    try:
        config = load_config(opts.config_file, flags=opts.flags())
        logging = config.log_settings(opts.log)
        logging.apply()
        notifier = Notifier.from_environ(unset=True)
    except ConfigError as exc:
        return _error(opts, str(exc))
    except NotifyError as exc:
        return _error(opts, exc.message)
    settings = config.settings
    own = settings.node
    setup = NodeSetup(
        settings=settings, node_id=new_node_id(own.name), node_name=own.name,
        socket=settings.bus.socket, state_dir=own.state_dir, capacity=own.capacity,
        threads=own.threads, router=own.router, router_quiet=logging.router_quiet,
        socket_origin=settings.bus.socket_origin,
        sim_clock=opts.sim_clock, time_scale=opts.time_scale, clock_rate=opts.clock_rate,
        metrics=own.metrics)
    node = NodeProcess(setup)
    try:
        try:
            await node.start()
        except (NodeStartError, RouterChildError, ConfigError, MigrationError, StoreError,
                psycopg.Error, OSError) as exc:
            return _error(opts, getattr(exc, "message", None) or str(exc))
        log.info("serve.started", node=setup.node_id, socket=setup.socket,
                 capacity=setup.capacity, threads=setup.threads)
        code = await _serve_notified(node, notifier)
        log.info("serve.stopped", node=setup.node_id, code=code)
        return code
    finally:
        await node.close()


class ServiceNotes:
    """The systemd notifications of one serving node (module docstring)."""

    def __init__(self, notifier: Notifier, node: NodeProcess) -> None:
        self.notifier = notifier
        self.node = node
        self.steps = 0
        self.stopping = False
        self._counted = 0
        self._since = time.monotonic()

    def on_step(self, report: RunReport) -> None:
        """`GrantExecutor.on_progress`: one call per step taken by any session."""
        self.steps += 1

    def on_drain(self) -> None:
        """`NodeProcess.drain_listeners`: `STOPPING=1` at the first drain request."""
        if not self.stopping:
            self.stopping = True
            self.notifier.send(STOPPING=1, STATUS=self.summary())

    def summary(self) -> str:
        """One line: state, runs held of capacity, steps/s since the previous summary."""
        now = time.monotonic()
        rate = (self.steps - self._counted) / max(now - self._since, 1e-3)
        self._counted, self._since = self.steps, now
        held = len(self.node.runtime.held()) if self.node.runtime is not None else 0
        impaired = self.node.impaired()
        if impaired is not None and not self.stopping:
            return f"impaired: {impaired}; {held}/{self.node.setup.capacity} runs held"
        state = "draining" if self.stopping else "serving"
        return (f"{state}: {held}/{self.node.setup.capacity} runs held, "
                f"{rate:.1f} steps/s")

    async def status(self) -> None:
        """`READY=1` with the first summary, then `STATUS=` every `STATUS_S` (lifetime task)."""
        self.notifier.send(READY=1, STATUS=self.summary())
        while True:
            await asyncio.sleep(STATUS_S)
            self.notifier.send(STATUS=self.summary())

    async def watchdog(self, interval: float) -> None:
        """`WATCHDOG=1` every `interval` from the event loop while the node is not impaired
        (lifetime task)."""
        while True:
            if self.node.impaired() is None:
                self.notifier.send(WATCHDOG=1)
            await asyncio.sleep(interval)


async def _serve_notified(node: NodeProcess, notifier: Notifier) -> int:
    """`node.serve()` with the notification tasks alongside, owned by one TaskGroup."""
    notes = ServiceNotes(notifier, node)
    executor = node.executor
    if executor is not None:
        previous = executor.on_progress

        def on_progress(report: RunReport) -> None:
            notes.on_step(report)
            if previous is not None:
                previous(report)

        executor.on_progress = on_progress
    node.drain_listeners.append(notes.on_drain)
    interval = notifier.watchdog_interval
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(notes.status())]
        if interval is not None:
            tasks.append(tg.create_task(notes.watchdog(interval)))
        try:
            return await node.serve()
        finally:
            for task in tasks:
                task.cancel()
