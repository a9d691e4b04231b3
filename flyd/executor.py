"""`SessionExecutor`: what a node does with one grant (distribution.md §5.7, §6; session.md §7).

Why: the lease runtime (`flyd.leases.node`) knows grants, not sessions. This module turns a grant
into a session on this host — launcher, workers, coordinator, in the run spec's execution mode —
steps it, and ends the grant through the scope: `finish` in one fenced transaction with the
run's effects, or a release. It also answers the runtime's `ProcessGroups` questions, so a lost
lease SIGKILLs the run's workers synchronously.

Sequence per grant:
1. Validate the claimed spec (session.md §4.10) against this node's limits; invalid → `finish`
   `failed` with `{error: "invalid run spec", path, reason}`; nothing is launched.
2. Fit the composition into the node's thread budget; a run that does not fit is released with
   refund and `backoff = claim_poll` and `run_does_not_fit` is logged with both numbers.
3. Launch with the spec's faults minus `faults_fired`; bootstrap; step. Before calling `step()`
   from `Ready(k)`, the step-addressed faults of step k are recorded as fired (§3.11), so each
   fires once per run whatever node or grant executes it.
4. End: the step target → `succeeded` with `{boundary, advances, recoveries, epochs,
   finalCheckpointId, behaviourDigest}`; a cancel request (claim or renew flag) → `cancelled` at the
   next committed boundary with `{boundary, recoveries, epochs}` and the effects so far; a session
   failure → `failed` with `{error: "session failed", failure}` and no boundary effects (state.md
   §9.3); a drain → release with refund (the next holder re-executes from the head).

Decisions (this stage has no checkpoints; state.md brings them):
- Every `boundary-<k>` effect is committed with the run's final transaction (`max_pending_effects`
  unbounded); a run reclaimed elsewhere re-executes from boundary 0, producing identical payloads.
- A session failure ends the run `failed` (no automatic recovery yet); the failure is the
  coordinator's `SessionFailure` as cli.md §4.2's `failures` entry.
- Effect payloads are the behaviour records rebased onto `e1`; the executing epoch is `e1`, so the
  raw `session_epoch` is 1 and `epochs` is `["e1"]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from bus.client import BusClient
from bus.errors import BusError
from flyd.budget import ThreadBudget
from flyd.coordinator import Coordinator, Deadlines, DispatchOrder, Injections
from flyd.fence import SessionFailure
from flyd.health import HealthPolicy
from flyd.identities import SessionNames, SessionTags
from flyd.launcher import ExecutionMode, LaunchedWorker, Launcher, connect_expected
from flyd.leases.node import Scope
from flyd.leases.store import Effect
from flyd.runspec import DEFAULT_MAX_AGENTS, RunSpec, RunSpecError
from flyd.trace import EpochRebase
from workers.canonical import canonical, digest_of
from workers.domain import DomainError
from workers.shell import load_plugin
from workers.synthetic.executor import IdentityExecutor

__all__ = ["RunReport", "SessionExecutor", "boundary_effect", "failure_json"]

log = structlog.get_logger("flyd.executor")

EPOCH: Final = "e1"
SESSION_EPOCH: Final = 1
REAP_S: Final = 10.0
WORLD_READ_S: Final = 2.0


def failure_json(failure: SessionFailure) -> dict[str, Any]:
    """cli.md §4.2's `failures` entry."""
    return {"detail": failure.detail, "participant": failure.participant,
            "code": str(failure.code), "mutation": str(failure.mutation),
            "message": failure.message}


def worker_json(w: LaunchedWorker) -> dict[str, Any]:
    """cli.md §4.2's `workers` entry (the node's own pid in thread and in-process modes)."""
    return {"workerId": w.worker_id, "role": w.identity.role,
            "incarnationId": w.identity.incarnation_id,
            "pid": w.pid if w.pid is not None else os.getpid(),
            "threads": w.identity.worker_threads}


def boundary_effect(boundary: int, record: dict[str, Any], session_epoch: int) -> Effect:
    """`boundary-<k>` with the rebased behaviour record as payload (distribution.md §6.1)."""
    return Effect(key=f"boundary-{boundary}", session_epoch=session_epoch, boundary=boundary,
                  payload=record, digest=hashlib.sha256(canonical(record)).digest())


@dataclass
class RunReport:
    """What this node saw of one grant's session (for `flyd run`'s summary and status views)."""

    run_id: int
    lease_epoch: int
    state: str | None = None
    spec: RunSpec | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)
    failure: dict[str, Any] | None = None
    boundary: int = 0
    advances: int = 0
    step_seconds: float = 0.0
    world_progress: str | None = None
    counter: int | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    coordinator: Coordinator | None = None
    lost_reason: str | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def fence(self, reason: str) -> None:
        """The lease is lost (§5.5 step 2): the session dispatches nothing more."""
        self.lost_reason = reason
        if self.coordinator is not None:
            self.coordinator.fence_now(f"lease lost ({reason})")


class SessionExecutor:
    """Executes grants on this node: one session per grant, sharing the node's thread budget."""

    def __init__(self, *, socket: str, node: BusClient, node_id: str, budget: ThreadBudget,
                 claim_poll_s: float, max_agents: int = DEFAULT_MAX_AGENTS,
                 health: HealthPolicy | None = None, deadlines: Deadlines | None = None,
                 on_progress: Callable[[RunReport], None] | None = None) -> None:
        self.socket = socket
        self.node = node
        self.node_id = node_id
        self.budget = budget
        self.claim_poll_s = claim_poll_s
        self.max_agents = max_agents
        self.health = health or HealthPolicy()
        self.deadlines = deadlines or Deadlines()
        self.on_progress = on_progress
        self.reports: dict[int, RunReport] = {}
        self._launchers: dict[int, Launcher] = {}
        self._groups: dict[int, list[int]] = {}
        self._clients: dict[int, BusClient] = {}
        self._tags = SessionTags()

    # ------------------------------------------------------------------ ProcessGroups

    def kill(self, run_id: int) -> None:
        """SIGKILL every process group of the run's workers, synchronously (§5.5 step 3)."""
        launcher = self._launchers.get(run_id)
        if launcher is not None:
            self._groups.setdefault(run_id, []).extend(launcher.kill_process_groups())

    def alive(self, run_id: int) -> bool:
        """Whether a process of the run's signalled groups still exists."""
        groups = list(self._groups.get(run_id, ()))
        launcher = self._launchers.get(run_id)
        if launcher is not None:
            groups += [w.pid for w in launcher.workers().values() if w.pid is not None]
        for pgid in groups:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                return True
            return True
        return False

    # ------------------------------------------------------------------ Executor

    async def execute(self, scope: Scope) -> None:
        report = RunReport(scope.run_id, scope.lease_epoch)
        self.reports[scope.run_id] = report
        try:
            await self._execute(scope, report)
        finally:
            report.ended.set()

    async def _execute(self, scope: Scope, report: RunReport) -> None:
        bound = log.bind(run=scope.run_id, lease_epoch=scope.lease_epoch, node=self.node_id)
        try:
            spec = RunSpec.validate(dict(scope.grant.spec), max_agents=self.max_agents,
                                    check_imports=True)
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
            await self._session(scope, spec, report, bound)
        finally:
            await self._teardown(scope.run_id, spec, report)

    async def _session(self, scope: Scope, spec: RunSpec, report: RunReport,
                       bound: structlog.typing.FilteringBoundLogger) -> None:
        names = SessionNames(session_id=spec.session_id, tag=self._tags.next(),
                             node_id=self.node_id)
        try:
            coordinator = await self._start(scope.run_id, spec, names, report)
        except (DomainError, BusError) as exc:
            code, mutation, message = (
                (str(exc.code), str(exc.mutation), exc.message) if isinstance(exc, DomainError)
                else (exc.name, "none", exc.message))
            report.failure = {"detail": "launch", "participant": None, "code": code,
                              "mutation": mutation, "message": message}
            bound.error("run.launch_failed", code=code, message=message)
            report.state = "failed"
            await scope.finish("failed", {"error": "launch failed", "failure": report.failure},
                               boundaries=0, session_epoch=0)
            return
        launcher = self._launchers[scope.run_id]
        if spec.pacing == "off" and spec.pace_s is None:
            coordinator.disable_pacing()
        report.coordinator = coordinator
        health_failure: list[SessionFailure] = []
        stepper = asyncio.get_running_loop().create_task(
            self._steps(scope, spec, coordinator, report))

        def on_health(worker_id: str, error: DomainError) -> None:
            failure = coordinator.health_failure(worker_id, error)
            if failure is not None and not stepper.done():
                health_failure.append(failure)
                stepper.cancel()

        supervisor = asyncio.get_running_loop().create_task(launcher.supervise(on_health))
        outcome: str
        try:
            outcome = await stepper
        except SessionFailure as failure:
            outcome = "failed"
            report.failure = failure_json(failure)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if (current is not None and current.cancelling()) or not health_failure:
                raise
            outcome = "failed"
            report.failure = failure_json(health_failure[0])
        finally:
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor
        await self._read_world(scope.run_id, spec, report)
        report.state = outcome
        if outcome == "drained":
            await scope.release(refund=True)
            return
        effects = [boundary_effect(i + 1, r, SESSION_EPOCH) for i, r in enumerate(report.records)]
        if outcome == "failed":
            bound.error("run.failed", **{k: v for k, v in (report.failure or {}).items()
                                         if v is not None})
            await scope.finish("failed", {"error": "session failed", "failure": report.failure},
                               boundaries=report.boundary, session_epoch=SESSION_EPOCH)
        elif outcome == "cancelled":
            await scope.finish("cancelled", {"boundary": report.boundary, "recoveries": 0,
                                             "epochs": [EPOCH]},
                               effects, boundaries=report.boundary,
                               session_epoch=SESSION_EPOCH)
        else:
            await scope.finish("succeeded", {
                "boundary": report.boundary, "advances": report.advances, "recoveries": 0,
                "epochs": [EPOCH], "finalCheckpointId": None,
                "behaviourDigest": digest_of(report.records)},
                effects, boundaries=report.boundary, session_epoch=SESSION_EPOCH)

    async def _start(self, run_id: int, spec: RunSpec, names: SessionNames,
                     report: RunReport) -> Coordinator:
        launcher = await Launcher.open(names=names, socket=self.socket, node=self.node,
                                       budget=self.budget, health=self.health,
                                       max_agents=self.max_agents)
        self._launchers[run_id] = launcher
        launched = await launcher.launch_composition(spec, ExecutionMode.from_label(spec.mode))
        report.workers = [worker_json(launched[w]) for w in spec.worker_ids() if w in launched]
        client = await connect_expected(self.node, self.socket, names.coordinator_client_id,
                                        grants=names.client_grants())
        self._clients[run_id] = client
        task = load_plugin(spec.task.impl, "task")(config=dict(spec.task.config),
                                                   terminal=spec.task.terminal,
                                                   max_agents=self.max_agents, epoch=EPOCH)
        injections = Injections(
            lose_advance_result_at=spec.injections.lose_advance_result_at,
            kill_at=tuple((k.worker, k.step) for k in spec.injections.kill),
            kill=launcher.kill)
        return Coordinator(
            spec, client, {wid: w.worker_ref() for wid, w in launcher.workers().items()},
            task=task, executor=IdentityExecutor(), deadlines=self.deadlines,
            order=DispatchOrder.from_label(spec.dispatch), injections=injections, epoch=EPOCH)

    async def _steps(self, scope: Scope, spec: RunSpec, coordinator: Coordinator,
                     report: RunReport) -> str:
        await coordinator.bootstrap()
        started = time.monotonic()
        while report.boundary < spec.steps:
            if scope.cancel_requested.is_set():
                return "cancelled"
            if scope.drain_requested.is_set():
                return "drained"
            due = spec.faults_at(report.boundary)
            if due:
                await scope.mark_faults_fired(due)
            step = await coordinator.step()
            report.boundary = step.boundary
            report.advances = coordinator.stats.advances
            report.step_seconds = time.monotonic() - started
            report.records = self._behaviour(coordinator)
            if self.on_progress is not None:
                self.on_progress(report)
            if step.terminal or step.paused:
                break
        return "succeeded"

    @staticmethod
    def _behaviour(coordinator: Coordinator) -> list[dict[str, Any]]:
        records = [t.behaviour for t in coordinator.trace.transitions]
        if coordinator.epoch == EPOCH:
            return records
        rebase = EpochRebase(coordinator.epoch, EPOCH, coordinator.task)
        return [rebase.apply(r) for r in records]

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
        """Reap the workers and close the session's clients; every step bounded."""
        launcher = self._launchers.get(run_id)
        if launcher is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(REAP_S):
                    await launcher.reap_all("run-ended")
            self._groups.setdefault(run_id, []).extend(launcher.kill_process_groups())
            with contextlib.suppress(Exception):
                async with asyncio.timeout(REAP_S):
                    await launcher.close()
            self._launchers.pop(run_id, None)
        client = self._clients.pop(run_id, None)
        if client is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await client.close()
