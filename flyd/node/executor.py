"""`GrantExecutor`: what a node does with one grant (design/distribution.md §5.7, §6;
design/session.md §7).

Why: the lease runtime (`flyd.leases.runtime`) knows grants, not sessions. This module checks a
claimed run, owns the processes and bus clients of its session, and hands the session itself to
`flyd.node.grant.GrantSession` (start or resume, cadence checkpoints, automatic recovery, the final
transaction). It also answers the runtime's `ProcessGroups` questions, so a lost lease SIGKILLs
the run's workers synchronously.

Sequence per grant:
1. Validate the claimed spec (design/session.md §4.10) against this node's limits; invalid →
   `finish` `failed` with `{error: "invalid run spec", path, reason}`; nothing is launched. The
   stored document is validated as it is (a JSON array, string or null written straight into
   `flyd.runs` is refused at path "" on the first claim, not coerced or retried), and a
   `startFrom` whose checkpoint the run has no head for (a spec inserted without
   `flyctl checkpoints import`) is refused at `/startFrom` rather than started from 0.
2. Fit the composition into the node's thread budget. The claim already took only runs that
   fit (`flyd.leases.fit`), so this is a safety net for a spec the claim's reading of `threads`
   counts differently: such a run is released with refund and `backoff = claim_poll` and
   `run_does_not_fit` is logged with both numbers.
3. The grant session runs it (`flyd.node.grant`); afterwards the workers are reaped and the
   session's clients closed, whatever happened.

Decisions:
- Effect payloads are the behaviour records rebased onto `e1` (design/state.md §9.2); the committed
  ones are read back from `flyd.effects` when a run's outcome needs every record
  (`behaviourDigest`).
- The checkpoint event ring of each run (design/state.md §5.6) stays readable after the grant ends,
  for `Control.RunEvents`, until the node executes the run again.
- A run's `RunReport` (its behaviour records, its coordinator) is dropped when the grant's
  execution ends, so a long-lived `flyd serve` node holds nothing of the runs it finished (the
  soak measured a steady RSS growth per run before); `flyd run`, which reads its one run's report
  after the end, sets `keep_reports`.
- `on_boundary` (`flyd run --record`, `--plot`) gets a `BoundarySample` of each committed
  transition, built from the coordinator only while it is set (`flyd.session.sample`).
- `totals` (`GrantTotals`) keeps what the node's metrics need of grants whose reports are
  gone: their steps, their end states, recoveries by cause. It is updated once per grant end and
  once per recovery, never per step (a live grant's steps are read from its report).
- A report's behaviour records are a `RecordStream`: only those beyond the durable head are
  held; the rest went into a running digest. With `trace_path` (`flyd run --trace`) every
  record also goes to that file, through one `TraceFile` per run that all the run's grants on
  this node share, so a re-granted run appends to it (`flyd.session.outputs`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import structlog

from bus.client import BusClient
from flyd.errors import ConfigError
from flyd.launch.budget import ThreadBudget
from flyd.launch.health import HealthPolicy
from flyd.launch.identities import SessionNames, SessionTags
from flyd.launch.launcher import Launcher, connect_expected
from flyd.launch.spawn import groups_running
from flyd.launch.spawner import SERVER_START_S, Spawner
from flyd.leases.runtime import GrantScope
from flyd.node.grant import GrantSession, LedgerReader, RunAbandoned, RunReport, writer_config
from flyd.node.parts import PartsWatch
from flyd.session.calls import Deadlines
from flyd.session.outputs import TraceFile
from flyd.session.run_topic import RunPublisher
from flyd.session.runspec import DEFAULT_MAX_AGENTS, RunSpec, RunSpecError
from flyd.session.sample import BoundarySample, boundary_sample
from flyd.session.trace import RecordStream
from flyd.state.checkpoints import CheckpointStore
from flyd.state.writer import CheckpointSettings, EventRing
from workers.types.domain import DomainError

__all__ = ["GrantExecutor", "GrantTotals"]

log = structlog.get_logger("flyd.node.executor")

REAP_S: Final = 10.0
WORLD_READ_S: Final = 2.0


@dataclass
class GrantTotals:
    """What this node's grants did, kept after their reports are dropped (the node's metrics):
    steps of ended grants, grants ended by state, recoveries by the failure's code."""

    steps: int = 0
    states: collections.Counter[str] = field(default_factory=collections.Counter)
    recoveries: collections.Counter[str] = field(default_factory=collections.Counter)

    def ended(self, report: RunReport) -> None:
        """Count a grant whose execution ended; a grant that neither finished nor released
        its run (a lost lease, an abandoned session) counts as `lost` or `released`."""
        self.steps += report.advances
        self.states[report.state or ("lost" if report.lost_reason is not None
                                     else "released")] += 1


class GrantExecutor:
    """Executes grants on this node: one session per grant, sharing the node's thread budget.
    The lease runtime's `GrantHandler`; each grant's session reaches it as its `GrantHost`."""

    def __init__(self, *, socket: str, node: BusClient, node_id: str, budget: ThreadBudget,
                 claim_poll_s: float, checkpoints: CheckpointStore, ledger: LedgerReader,
                 writer_defaults: CheckpointSettings, drain_timeout_s: float,
                 max_agents: int = DEFAULT_MAX_AGENTS, health: HealthPolicy | None = None,
                 deadlines: Deadlines | None = None, spawner: Spawner | None = None,
                 on_progress: Callable[[RunReport], None] | None = None,
                 on_recovery: Callable[[RunReport, dict[str, Any]], None] | None = None) -> None:
        self.socket = socket
        self.node = node
        self.node_id = node_id
        self.budget = budget
        self.claim_poll_s = claim_poll_s
        self.checkpoints = checkpoints
        self.ledger = ledger
        self.writer_defaults = writer_defaults
        self.drain_timeout_s = drain_timeout_s
        self.max_agents = max_agents
        self.health = health or HealthPolicy()
        self.spawner = spawner
        self.deadlines = deadlines or Deadlines()
        self.on_progress = on_progress
        self.on_recovery = on_recovery
        #: called after each committed transition with what an observer sees of it
        #: (`flyd run --record`, `--plot`); no sample is built while it is None
        self.on_boundary: Callable[[RunReport, BoundarySample], None] | None = None
        self.rings: dict[int, EventRing] = {}
        self._router_up = asyncio.Event()
        self.router_exits = 0
        self._router_up.set()
        #: the liveness watch of the node's router and fork server (set while serving)
        self.watch: PartsWatch | None = None
        self._parts_down = asyncio.Event()
        self.reports: dict[int, RunReport] = {}
        self.keep_reports = False
        #: `flyd run --trace`: the file every run's grants write (`TraceFile`)
        self.trace_path: Path | None = None
        self._trace_files: dict[int, TraceFile] = {}
        self._launchers: dict[int, Launcher] = {}
        self._groups: dict[int, set[int]] = {}
        self._clients: dict[int, BusClient] = {}
        self._tags = SessionTags()
        self.totals = GrantTotals()

    def launcher(self, run_id: int) -> Launcher | None:
        """The launcher of a run this node is executing (the control service's view)."""
        return self._launchers.get(run_id)

    def worker_count(self) -> int:
        """The live workers of every run this node is executing (the metrics' view)."""
        return sum(len(launcher.workers()) for launcher in self._launchers.values())

    # ------------------------------------------------------------------ ProcessGroups

    def kill(self, run_id: int) -> None:
        """SIGKILL every process group of the run's workers, synchronously
        (design/distribution.md §5.5 step 3); the launcher is abandoned, so the scope's teardown
        waits for no worker's exit report."""
        launcher = self._launchers.get(run_id)
        if launcher is not None:
            self._groups.setdefault(run_id, set()).update(launcher.abandon())

    def alive(self, run_id: int) -> bool:
        """Whether a process of the run's signalled groups still runs (zombies are dead)."""
        groups = set(self._groups.get(run_id, ()))
        launcher = self._launchers.get(run_id)
        if launcher is not None:
            groups.update(w.pid for w in launcher.workers().values() if w.pid is not None)
        return groups_running(groups)

    # ------------------------------------------------------------------ Executor

    async def execute(self, scope: GrantScope) -> None:
        report = RunReport(scope.run_id, scope.lease_epoch, records=RecordStream(),
                           trace=self._trace_file(scope.run_id))
        self.reports[scope.run_id] = report
        try:
            await self._execute(scope, report)
        finally:
            report.ended.set()
            self.totals.ended(report)
            if not self.keep_reports and self.reports.get(scope.run_id) is report:
                del self.reports[scope.run_id]

    def _trace_file(self, run_id: int) -> TraceFile | None:
        """The run's `--trace` file, one for all its grants on this node."""
        if self.trace_path is None:
            return None
        return self._trace_files.setdefault(run_id, TraceFile(self.trace_path))

    async def _execute(self, scope: GrantScope, report: RunReport) -> None:
        bound = log.bind(run=scope.run_id, lease_epoch=scope.lease_epoch, node=self.node_id)
        try:
            spec = RunSpec.validate(scope.grant.spec, max_agents=self.max_agents,
                                    check_imports=True)
            if spec.start_from is not None and scope.grant.high_water is None:
                raise RunSpecError("/startFrom", f"checkpoint {spec.start_from.checkpoint_id} "
                                                 f"is not stored for run {scope.run_id}")
        except RunSpecError as exc:
            bound.error("run.invalid_spec", path=exc.path, reason=exc.reason)
            report.state = "failed"
            await scope.finish("failed", exc.outcome(), boundaries=0, session_epoch=0)
            return
        spec = spec.without_fired(scope.grant.faults_fired)
        report.spec = spec
        need = spec.thread_need(self.budget.coordinator_reservation)
        if not self.budget.fits(need):
            bound.warning("run_does_not_fit", need=need, remaining=self.budget.remaining,
                          total=self.budget.total)
            await scope.release(refund=True, backoff_s=self.claim_poll_s)
            return
        scope.on_fence(report.fence)
        try:
            config = writer_config(self.writer_defaults, spec)
        except ConfigError as exc:
            bound.error("run.invalid_spec", path="/checkpoints", reason=str(exc))
            await scope.finish("failed", {"error": "invalid run spec", "path": "/checkpoints",
                                          "reason": str(exc)}, boundaries=0, session_epoch=0)
            return
        session = GrantSession(host=self, scope=scope, spec=spec, report=report,
                               config=config, checkpoints=self.checkpoints, ledger=self.ledger,
                               drain_timeout_s=self.drain_timeout_s)
        self.rings[scope.run_id] = session.ring
        try:
            await session.run()
        except RunAbandoned as exc:
            bound.error("run.abandoned", reason=str(exc))
        finally:
            if report.lost_reason is None:
                await self._read_world(scope.run_id, spec, report)
            await self._teardown(scope.run_id, spec, report)

    # ---------------------------------------------------- router loss (design/state.md §8.2 step 0)

    def router_lost(self) -> None:
        """The router exited: sessions wait for `router_back` before reconnecting.
        `router_exits` counts these, so a recovery attempt can tell that a router death fell
        within it even after the router is back."""
        self.router_exits += 1
        self._router_up.clear()

    def router_back(self, node: BusClient) -> None:
        """The router is back and the node reconnected (a new incarnation)."""
        self.node = node
        self._router_up.set()

    @property
    def parts_lost(self) -> int:
        """The node's own parts lost so far: router exits and fork servers lost in use (hung
        and replaced, or dead). A run's attempt that saw one is given back."""
        return self.router_exits + (self.spawner.losses if self.spawner is not None else 0)

    async def check_parts(self) -> None:
        """Probe the router and the fork server now and wait until each answered, or was
        replaced and answered, or was given up (bounded by two probe deadlines and a start)."""
        if self.watch is not None:
            await self.watch.check(2 * self.health.fail + SERVER_START_S)

    def parts_down(self) -> str | None:
        """Why this node cannot launch runs now (a part given up); None when it can."""
        return None if self.watch is None else self.watch.reason

    def parts_changed(self, reason: str | None) -> None:
        """The watch gave a part up (`reason`) or has every part back (None): a session
        waiting for the router stops waiting when it was given up."""
        if reason is None:
            self._parts_down.clear()
        else:
            self._parts_down.set()

    async def router_ready(self, timeout_s: float) -> bool:
        """Wait until the node's connection is open (bounded); False when it stayed down, or
        the router was given up meanwhile. A closed connection means the router is gone even
        before its supervisor noticed."""
        if self.node.closed:
            self._router_up.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s), asyncio.TaskGroup() as tg:
                up = tg.create_task(self._router_up.wait())
                down = tg.create_task(self._parts_down.wait())
                await asyncio.wait((up, down), return_when=asyncio.FIRST_COMPLETED)
                up.cancel()
                down.cancel()
        return self._router_up.is_set() and not self.node.closed

    # ------------------------------------------------------------------ for the grant session

    async def open_launcher(self, run_id: int, session_id: str,
                            agents_per_process: int | None = None
                            ) -> tuple[SessionNames, Launcher]:
        """A session's launcher; a run spec's `agentsPerProcess` overrides the node's."""
        names = SessionNames(session_id=session_id, tag=self._tags.next(), node_id=self.node_id)
        launcher = await Launcher.open(names=names, socket=self.socket, node=self.node,
                                       budget=self.budget, health=self.health,
                                       max_agents=self.max_agents, spawner=self.spawner)
        if agents_per_process is not None:
            launcher.agents_per_process = agents_per_process
        self._launchers[run_id] = launcher
        return names, launcher

    async def connect_coordinator(self, run_id: int, names: SessionNames,
                                  publisher: RunPublisher | None) -> BusClient | None:
        client = await connect_expected(
            self.node, self.socket, names.coordinator_client_id,
            grants=names.coordinator_grants(run_id),
            on_publish_failed=None if publisher is None else publisher.on_publish_failed)
        old = self._clients.get(run_id)
        self._clients[run_id] = client
        return old

    def coordinator_client(self, run_id: int) -> BusClient:
        return self._clients[run_id]

    def connections_closed(self, run_id: int) -> bool:
        return self._clients[run_id].closed or self.node.closed

    def progressed(self, report: RunReport) -> None:
        if self.on_boundary is not None and report.coordinator is not None:
            sample = boundary_sample(report.coordinator)
            if sample is not None:
                self.on_boundary(report, sample)
        if self.on_progress is not None:
            self.on_progress(report)

    def recovered(self, report: RunReport, info: dict[str, Any]) -> None:
        report.recoveries.append(info)
        self.totals.recoveries[str(info["code"])] += 1
        if self.on_recovery is not None:
            self.on_recovery(report, info)

    async def _read_world(self, run_id: int, spec: RunSpec, report: RunReport) -> None:
        """The world's `progressCounter` and the task's counter before the reap."""
        launcher = self._launchers.get(run_id)
        coordinator = report.coordinator
        if coordinator is not None:
            with contextlib.suppress(Exception):
                report.counter = int(coordinator.progress().value["counter"])
        if launcher is None:
            return
        world = spec.world.world_id
        with contextlib.suppress(DomainError, TimeoutError):
            if world in launcher.workers():
                async with asyncio.timeout(WORLD_READ_S):
                    status = await launcher.health_check(world)
                counter = status.get("progressCounter")
                report.world_progress = None if counter is None else str(counter)

    async def _teardown(self, run_id: int, spec: RunSpec, report: RunReport) -> None:
        """Reap the workers and close the session's clients; every step bounded. After a lost
        lease the workers were SIGKILLed already and the launcher abandoned: nothing is asked of
        them and no exit report awaited, so the scope ends within the runtime's bound."""
        launcher = self._launchers.get(run_id)
        if launcher is not None:
            if report.lost_reason is None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(REAP_S):
                        await launcher.reap_all("run-ended")
                groups = launcher.kill_process_groups()
            else:
                groups = launcher.abandon()
            self._groups.setdefault(run_id, set()).update(groups)
            with contextlib.suppress(Exception):
                async with asyncio.timeout(REAP_S):
                    await launcher.close()
            self._launchers.pop(run_id, None)
        client = self._clients.pop(run_id, None)
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await client.close()
