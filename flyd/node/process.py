"""The node process: database, router child, node connection, store, lease runtime, executor.

Why: `flyd serve` and `flyd run` are the same node (design/distribution.md §5, design/cli.md §4–§5);
they differ only in what they claim (`only`: `flyd run` claims the one run it submitted) and in when
they stop. This module wires the parts in order and takes them down in reverse, each step
bounded:

start: the socket path checked (`flyd.node.router_child.check_socket_path`: nothing that is not
the node's is ever touched) → embedded PostgreSQL under `<state-dir>/pg` when no DSN is
configured (design/distribution.md §5.9) → migrations → router child on the socket
(design/cli.md §5.1; `--no-router` connects to a router managed separately) → node connection
`node.<node_id>` → `PgStore` → `GrantExecutor`.
serve: `NodeRuntime(...).run()` until drained or stopped; SIGTERM/SIGINT drain (a second one
skips the checkpoints, design/distribution.md §5.8). Beside it, the router's supervisor and the
parts watch (`flyd.node.parts`): a router or fork server that misses its liveness probe is killed
and replaced like a dead one; a part that cannot be brought back holds the node's claims
(`NodeRuntime.hold_claims`: it stops claiming and hands its runs back, `flyctl status` shows
`draining` with the reason) until the part answers again.
close: metrics endpoint, control service, store, node connection, router (SIGTERM, SIGKILL
after 5 s), embedded server.
metrics: with `setup.metrics` (`flyd serve --metrics`), the Prometheus endpoint of
`flyd.node.metrics` listens once everything above is up; a port that cannot be bound is a
start error (exit 2).

Decisions:
- The thread budget is the configured `[node] threads` for `flyd serve`; `flyd run`, which holds
  exactly its own run, raises it to the run's need when the configured budget is smaller.
- The router's `[bus.limits]` floors follow the node's capacity and `[session] max_agents`.
- The node's temporary directory is `flyd-node-<pid>-*` in `TMPDIR`; a SIGKILLed node cannot
  remove it, so every node start removes those of this uid whose pid is gone
  (`sweep_dead_node_dirs`, logged as `node.temp_swept`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import socket as socketlib
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psutil
import psycopg
import structlog

from bus.client import BusClient, connect
from bus.errors import BusError
from bus.ownership import Trust, UnsafeDirectory, check_dir, make_dirs
from flyd.config import Settings
from flyd.launch.budget import ThreadBudget
from flyd.launch.identities import node_client_id
from flyd.launch.launcher import Launcher
from flyd.launch.orphans import become_subreaper
from flyd.launch.spawner import Spawner, add_import_roots
from flyd.leases import queries
from flyd.leases.clock import BootClock, LeaseClock, SimFileClock
from flyd.leases.core import LeasePhase
from flyd.leases.embedded import EmbeddedPostgres
from flyd.leases.fit import ThreadRoom
from flyd.leases.migrate import migrate
from flyd.leases.runtime import NodeRuntime
from flyd.leases.stores.contract import NodeInfo
from flyd.leases.stores.pg import PgStore
from flyd.node.control import ControlService, RunView
from flyd.node.executor import GrantExecutor
from flyd.node.metrics import CONTENT_TYPE, NodeMetrics
from flyd.node.metrics_http import MetricsAddress, MetricsEndpoint
from flyd.node.parts import ForkServerPart, Part, PartsWatch, RouterPart
from flyd.node.router_child import RouterChild, RouterChildError, check_socket_path
from flyd.state.checkpoints import CheckpointStore

__all__ = ["NodeProcess", "NodeSetup", "NodeStartError"]

log = structlog.get_logger("flyd.node.process")

TEMP_PREFIX: Final = "flyd-node-"

VERSION: Final = "0.1.0"
CLOSE_S: Final = 5.0
ROUTER_BACKOFF_S: Final = 0.1
ROUTER_BACKOFF_MAX_S: Final = 5.0
ROUTER_STABLE_S: Final = 60.0


class NodeStartError(Exception):
    """The node could not start (exit 2, `CONFIG`): unreachable DSN, router, socket."""

    code = "CONFIG"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class NodeSetup:
    """What a node process needs, resolved from configuration and flags: the typed settings
    and the node's own values, which `flyd run` chooses differently from them (socket,
    capacity, threads)."""

    settings: Settings
    node_id: str
    node_name: str
    socket: str
    state_dir: Path
    capacity: int
    threads: int
    router: bool = True
    router_quiet: int = 1
    socket_origin: str = "default"
    sim_clock: Path | None = None
    time_scale: float = 1.0
    clock_rate: float = 1.0
    #: where to serve the metrics (`flyd serve --metrics`); None: not served
    metrics: MetricsAddress | None = None

    @property
    def dsn(self) -> str | None:
        return self.settings.database.dsn


def sweep_dead_node_dirs(root: str | None = None) -> list[str]:
    """Remove the temporary directories of nodes that were killed (a clean close removes its
    own): `flyd-node-<pid>-*` of this uid whose pid is no longer a process. A live pid's
    directory stays, even if the pid was reused; the next sweep after that process ends takes
    it."""
    base = Path(root or tempfile.gettempdir())
    swept = []
    for path in base.glob(f"{TEMP_PREFIX}*-*"):
        pid_text = path.name[len(TEMP_PREFIX):].split("-", 1)[0]
        try:
            if (not pid_text.isdigit() or not path.is_dir() or path.is_symlink()
                    or path.stat().st_uid != os.getuid() or psutil.pid_exists(int(pid_text))):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        swept.append(path.name)
    return sorted(swept)


class ControlView:
    """The node as its control service sees it (`NodeView`): read through to the node's parts
    as they are now, since the runtime and the executor appear only during start."""

    def __init__(self, node: NodeProcess) -> None:
        self._node = node
        setup = node.setup
        self.node_id = setup.node_id
        self.node_name = setup.node_name
        self.socket = setup.socket
        self.capacity = setup.capacity
        self.health_fail_s = setup.settings.session.health.fail
        self.budget = node.budget

    @property
    def dsn(self) -> str:
        return self._node.dsn

    @property
    def client(self) -> BusClient | None:
        return self._node.client

    def holds(self) -> list[tuple[int, int, LeasePhase, float]] | None:
        runtime = self._node.runtime
        return None if runtime is None else runtime.held()

    def launcher(self, run_id: int) -> Launcher | None:
        executor = self._node.executor
        return None if executor is None else executor.launcher(run_id)

    def run_view(self, run_id: int) -> RunView | None:
        executor = self._node.executor
        report = None if executor is None else executor.reports.get(run_id)
        if report is None:
            return None
        coordinator = report.coordinator
        topic = report.topic
        return RunView(epoch=None if coordinator is None else coordinator.epoch,
                       phase=None if coordinator is None else coordinator.phase.label,
                       boundary=report.boundary, recoveries=len(report.recoveries),
                       topic=None if topic is None else (topic.name, topic.incarnation),
                       descriptor=None if coordinator is None
                       else coordinator.snapshots.descriptor)

    def run_events(self, run_id: int) -> Sequence[Mapping[str, Any]] | None:
        executor = self._node.executor
        ring = None if executor is None else executor.rings.get(run_id)
        return None if ring is None else list(ring.ring)

    async def node_row(self) -> dict[str, Any] | None:
        dsn = self._node.dsn
        if not dsn:
            return None
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            rows = await queries.nodes(conn)
        return next((r for r in rows if r["nodeId"] == self.node_id), None)

    def drain(self) -> None:
        self._node.drain()

    def impaired(self) -> str | None:
        return self._node.impaired()


class NodeProcess:
    """One node's parts, owned for an orderly start and a bounded teardown."""

    def __init__(self, setup: NodeSetup) -> None:
        self.setup = setup
        self.params = setup.settings.leases
        swept = sweep_dead_node_dirs()
        if swept:
            log.info("node.temp_swept", count=len(swept), directories=swept)
        self.directory = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
        self.embedded: EmbeddedPostgres | None = None
        self.dsn = ""
        self.router: RouterChild | None = None
        self.client: BusClient | None = None
        self.store: PgStore | None = None
        self.executor: GrantExecutor | None = None
        self.checkpoints: CheckpointStore | None = None
        self.runtime: NodeRuntime | None = None
        self.control: ControlService | None = None
        self.metrics: MetricsEndpoint | None = None
        self.drain_listeners: list[Callable[[], None]] = []
        self.spawner: Spawner | None = None
        self.watch: PartsWatch | None = None
        self.budget = ThreadBudget.for_this_machine(
            setup.capacity, threads=setup.threads,
            coordinator_reservation=setup.settings.node.coordinator_reservation)

    # ------------------------------------------------------------------ start

    def _prepare_socket_dir(self) -> None:
        """Before anything starts: the socket's directory is created 0700 (0750 with a socket
        group) or must be one no other user controls (design/wire.md §13); else exit 2 naming it."""
        setup, gid = self.setup, self.setup.settings.bus.socket_gid
        parent = os.path.dirname(os.path.abspath(setup.socket))
        try:
            make_dirs(parent, 0o750 if gid is not None else 0o700, gid)
            check_dir(parent, Trust.own(gid))
        except UnsafeDirectory as exc:
            raise NodeStartError(f"{setup.socket_origin}: [bus] socket {setup.socket}: "
                                 f"{exc.message}") from None
        except OSError as exc:
            raise NodeStartError(f"{setup.socket_origin}: [bus] socket {setup.socket}: cannot "
                                 f"create {parent}: {exc.strerror or exc}") from None

    async def start(self) -> None:
        setup = self.setup
        if not become_subreaper():  # orphans of workers' processes come here (docs/launcher.md)
            log.warning("node.no_subreaper", detail="prctl(PR_SET_CHILD_SUBREAPER) failed")
        if setup.router:
            check_socket_path(setup.socket, setup.socket_origin)
            self._prepare_socket_dir()
        setup.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if setup.dsn is None:
            self.embedded = EmbeddedPostgres()
            self.dsn = await self.embedded.start(setup.state_dir)
        else:
            self.dsn = setup.dsn
        await migrate(self.dsn, sim_clock=setup.sim_clock is not None)
        if setup.router:
            self.router = RouterChild(self.directory, setup.socket)
            await self.router.start(setup.settings.bus, capacity=setup.capacity,
                                    max_agents=setup.settings.session.max_agents,
                                    quiet=setup.router_quiet)
        try:
            self.client = await connect(setup.socket, client_id=node_client_id(setup.node_id),
                                        socket_gid=setup.settings.bus.socket_gid)
        except (BusError, OSError) as exc:
            raise NodeStartError(f"cannot connect to the router on {setup.socket}: "
                                 f"{exc}") from None
        settings = dataclasses.replace(setup.settings.database.connection,
                                       time_scale=setup.time_scale)
        self.store = PgStore(self.dsn, setup.node_id, settings, self.params,
                             capacity=setup.capacity)
        await self.store.open()
        self.checkpoints = CheckpointStore(self.store)
        session = setup.settings.session
        add_import_roots(session.launcher.plugin_paths)
        self.spawner = Spawner(session.launcher, socket=setup.socket)
        self.executor = GrantExecutor(
            socket=setup.socket, node=self.client, node_id=setup.node_id, budget=self.budget,
            claim_poll_s=self.params.claim_poll_s,
            checkpoints=self.checkpoints, ledger=self.read_ledger,
            writer_defaults=setup.settings.checkpoints,
            drain_timeout_s=self.params.drain_timeout_s,
            max_agents=session.max_agents, health=session.health,
            deadlines=session.deadlines,
            spawner=self.spawner)
        self.control = ControlService(ControlView(self))
        await self.control.start()
        if setup.metrics is not None:
            await self.serve_metrics(setup.metrics)

    async def serve_metrics(self, address: MetricsAddress) -> None:
        """Listen for scrapes (docs/operations.md); the endpoint closes with the node."""
        metrics = NodeMetrics(self, node_id=self.setup.node_id, node_name=self.setup.node_name,
                              version=VERSION)
        self.metrics = MetricsEndpoint(address, metrics.render, CONTENT_TYPE)
        try:
            bound = await self.metrics.start()
        except OSError as exc:
            self.metrics = None
            raise NodeStartError(f"cannot serve metrics on {address}: "
                                 f"{exc.strerror or exc}") from None
        log.info("metrics.listening", address=str(bound), host=bound.host, port=bound.port)

    async def read_ledger(self, run_id: int, through: int) -> queries.LedgerFold:
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            return await queries.fold_ledger(conn, run_id, through)

    def info(self) -> NodeInfo:
        return NodeInfo(node_id=self.setup.node_id, node_name=self.setup.node_name,
                        host=socketlib.gethostname(), pid=os.getpid(), version=VERSION,
                        capacity=self.setup.capacity)

    # ------------------------------------------------------------------ serve

    def clock(self) -> LeaseClock:
        """The node's clock (R2): CLOCK_BOOTTIME, or the harness clock file under test."""
        if self.setup.sim_clock is not None:
            return SimFileClock(self.setup.sim_clock, rate=self.setup.clock_rate)
        return BootClock()

    def make_runtime(self, only: int | None = None) -> NodeRuntime:
        assert self.store is not None and self.executor is not None
        self.runtime = NodeRuntime(
            params=self.params, store=self.store, clock=self.clock(), executor=self.executor,
            groups=self.executor, node=self.info(), capacity=self.setup.capacity, only=only,
            threads=ThreadRoom(self.budget.total, self.budget.coordinator_reservation),
            listen=self.store.listen,
            log=log.bind(node=self.setup.node_id))
        return self.runtime

    async def serve(self) -> int:
        """`flyd serve`: run until drained; SIGTERM/SIGINT drain (a second one hurries)."""
        runtime = self.make_runtime()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.drain)
        try:
            return await self.run_runtime(runtime)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def run_runtime(self, runtime: NodeRuntime) -> int:
        """The lease runtime with the router's supervisor and the parts watch beside it; both
        end with the runtime."""
        self.watch = self.make_watch(runtime)
        if self.executor is not None:
            self.executor.watch = self.watch
        async with asyncio.TaskGroup() as tg:
            helpers = [tg.create_task(self.supervise_router()), tg.create_task(self.watch.run())]
            try:
                return await runtime.run()
            finally:
                for task in helpers:
                    task.cancel()

    def make_watch(self, runtime: NodeRuntime) -> PartsWatch:
        """The liveness watch of this node's router (unless `--no-router`) and fork server, on
        the `[session]` health budgets; a part given up holds the runtime's claims."""
        parts: list[Part] = []
        router = self.router
        if router is not None:
            parts.append(RouterPart(lambda: router.process, lambda: self.client))
        if self.spawner is not None:
            parts.append(ForkServerPart(self.spawner))
        health = self.setup.settings.session.health
        executor = self.executor

        def on_change(reason: str | None) -> None:
            runtime.hold_claims(reason)
            if executor is not None:
                executor.parts_changed(reason)

        return PartsWatch(parts, period=health.probe, deadline=health.fail,
                          on_change=on_change)

    def impaired(self) -> str | None:
        """Why the node holds its claims (a part given up), None when it does not."""
        return None if self.watch is None else self.watch.reason

    # ------------------------------------------------------------------ router supervision

    async def supervise_router(self) -> None:
        """design/cli.md §5.1: restart a router child that exited (backoff from 0.1 s doubling to
        5 s, reset after 60 s of uptime), reconnect the node connection with a new incarnation,
        re-register the control service; the sessions recover through design/state.md §8.2 step
        0."""
        router = self.router
        if router is None:
            return
        backoff = ROUTER_BACKOFF_S
        while True:
            process = router.process
            if process is None:
                return
            started = time.monotonic()
            code = await process.exited  # lifetime wait: the router's exit ends it
            if self.executor is not None:
                self.executor.router_lost()
            if self.watch is not None:
                self.watch.lost("router", f"the router exited with code {code}")
            if time.monotonic() - started >= ROUTER_STABLE_S:
                backoff = ROUTER_BACKOFF_S
            log.warning("router.exited", code=code, restart_in_s=backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, ROUTER_BACKOFF_MAX_S)
            try:
                await self._restart_router(router)
            except (RouterChildError, BusError, OSError) as exc:
                log.error("router.restart_failed", error=str(exc))
                if self.watch is not None and not self._killed_starting(router):
                    self.watch.replace_failed("router", str(exc))
                continue
            log.info("router.restarted", socket=self.setup.socket, pid=router.pid)
            if self.watch is not None:
                self.watch.replaced("router")

    @staticmethod
    def _killed_starting(router: RouterChild) -> bool:
        """The new router was killed by a signal while it started (an operator's `kill`): a
        loss like any other, not a router that cannot be brought back."""
        process = router.process
        return (process is not None and process.exited.done()
                and process.exited.result() < 0)

    async def _restart_router(self, router: RouterChild) -> None:
        setup = self.setup
        await asyncio.to_thread(router.remove_socket)
        await router.start(setup.settings.bus, capacity=setup.capacity,
                           max_agents=setup.settings.session.max_agents,
                           quiet=setup.router_quiet)
        old, self.client = self.client, None
        if old is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_S):
                    await old.close()
        self.client = await connect(setup.socket, client_id=node_client_id(setup.node_id),
                                    socket_gid=setup.settings.bus.socket_gid)
        if self.control is not None:
            self.control.service = None
            await self.control.start()
        if self.executor is not None:
            self.executor.router_back(self.client)

    def drain(self) -> None:
        """Start (a second call: hurry) the drain of design/distribution.md §5.8, for SIGTERM,
        SIGINT and `Control.Drain` alike; each of `drain_listeners` hears every call first
        (`flyd serve` sends `STOPPING=1`)."""
        for listener in self.drain_listeners:
            listener()
        if self.runtime is not None:
            self.runtime.drain()

    # ------------------------------------------------------------------ close

    async def close(self) -> None:
        """Control service, store, node connection, router, embedded server; every step
        bounded."""
        metrics, self.metrics = self.metrics, None
        if metrics is not None:
            await metrics.close()
        control, self.control = self.control, None
        if control is not None:
            await control.close()
        self.checkpoints = None  # its connections are the lease store's, closed next
        store, self.store = self.store, None
        if store is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_S):
                    await store.close()
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(CLOSE_S):
                    await client.close()
        spawner, self.spawner = self.spawner, None
        if spawner is not None:
            await spawner.close()
        router, self.router = self.router, None
        if router is not None:
            await router.stop()
        embedded, self.embedded = self.embedded, None
        if embedded is not None:
            with contextlib.suppress(Exception):
                await embedded.stop()
        shutil.rmtree(self.directory, ignore_errors=True)
