"""The node's control service `flyd.control.<node_id>` (design/cli.md §8).

Why: `flyctl` steers a node through the bus, never through signals or files, so the router's
policy decides who may steer (design/session.md §7.2: `ctl-*` clients and node connections only) and
every answer is a domain outcome a caller can check like any other.

Rules:
- Registered on the node connection `node.<node_id>` with `maxQueued 16`, `maxInFlight 4`.
- Envelope: the request and outcome objects of design/session.md §1.3/§1.4. The scope must be null;
  an outcome's `workerId` is the node id and its `incarnationId` the node connection's client
  incarnation. An unparsable request is answered `INVALID_ARGUMENT` with scope null and the
  readable request id (else `req-0`).
- Params and results are validated against `schemas/control/<method>.{params,result}.json`
  (those files are part of the session contract digest, design/session.md §2.5).
- Errors are domain errors with mutation `none`: malformed params → `INVALID_ARGUMENT`; an unknown
  method → `UNSUPPORTED`; a run this node does not hold → `IDENTITY_MISMATCH` ("run <r> is not
  held by node <id>"); `run: null` naming a worker of several held runs → `INVALID_ARGUMENT`
  naming them; a result failing its own schema → `INTERNAL`.
- Each request executes once; there is no result cache: a repeated Kill answers `AlreadyGone`, a
  repeated Drain `{draining: true}`. Drain is the node's own drain (`NodeProcess.drain`, as for
  SIGTERM); only the first Drain starts it, so a repeated Drain never hurries it the way a second
  SIGTERM does.

Decisions where the spec is silent:
- A run is held when the lease runtime holds it in a non-final phase; its workers are those of the
  run's launcher. Kill of a worker the run's launcher never launched (not in its composition) is
  refused `IDENTITY_MISMATCH` "no worker <w> in run <r>; workers: <ids>"; with `run: null` the
  runs searched are all those held, and a worker of a held run's composition that is no longer
  live answers `AlreadyGone` with that run. A node holding no run answers `AlreadyGone` with
  `run: null` (it has no composition to judge the name by).
- Status: the node's `state` and `lastHeartbeat` come from its `flyd.nodes` row (read with a short
  deadline); without an answer, `state` is what this process knows (`starting` before the lease
  runtime exists, `draining` after a Drain, else `active`) and `lastHeartbeat` is null.
  `reason` says why a node holds its claims (a router or fork server it could not bring back;
  its `state` is then `draining`), null otherwise.
- Status: every live worker gets one `Worker.Status` bounded by `[session] health_fail_s`, all
  concurrently; no answer → `alive: false` with `state` and `step` null. `step` is the step of the
  worker's current scope. `uptimeMs` is the age of the worker's own process (process mode) and
  null for thread and in-process workers, which have no process of their own.
- Status: `recoveries` counts the recoveries the executor reports for the run's current grant.
- RunEvents: the executor's checkpoint event ring of the run (oldest first, at most 256); a held
  run without a ring yet (still launching) has an empty one.
- Watch (topics.md §14.3): `run: null` picks the only held run (none → `IDENTITY_MISMATCH`,
  several → `INVALID_ARGUMENT` naming them); a held run whose topic declare was refused, or
  whose grant has not declared it yet, answers `UNSUPPORTED`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import psutil
import psycopg
import structlog

from bus.client import BusClient
from bus.client_serving import Request, Service
from bus.errors import BusError
from flyd.config import redact_dsn
from flyd.launch.budget import ThreadBudget
from flyd.launch.launcher import Launcher
from flyd.leases.core import FINAL, LeasePhase
from flyd.node.control_protocol import control_service, control_validator
from workers.types.domain import DomainError, ErrorCode, Mutation
from workers.types.rpc import Outcome, parse_request, unparsable_outcome

__all__ = ["ControlService", "NodeView", "RunView"]

log = structlog.get_logger("flyd.node.control")

MAX_QUEUED: Final = 16
MAX_IN_FLIGHT: Final = 4
DB_READ_S: Final = 2.0
STATS_S: Final = 5.0
CLOSE_S: Final = 2.0
KILL_REASON: Final = "flyctl-kill"
MAX_EVENTS: Final = 256


@dataclass(frozen=True)
class RunView:
    """What the control service shows of one run the node executes: its coordinator's epoch
    and phase (None before there is a coordinator), its boundary and its recoveries; its run
    topic and incarnation (None while it has none, topics.md §14.1 rule 2) and the current
    descriptor body (None before bootstrap)."""

    epoch: str | None
    phase: str | None
    boundary: int
    recoveries: int
    topic: tuple[str, str] | None = None
    descriptor: dict[str, Any] | None = None


class NodeView(Protocol):
    """What the control service reads and asks of its node. The node hands one in, so the
    service follows no chain of the node's parts and opens no connection of its own."""

    @property
    def node_id(self) -> str: ...

    @property
    def node_name(self) -> str: ...

    @property
    def socket(self) -> str: ...

    @property
    def capacity(self) -> int: ...

    @property
    def health_fail_s(self) -> float:
        """The bound of one worker's `Worker.Status` (`[session] health_fail_s`)."""

    @property
    def dsn(self) -> str:
        """The node's database DSN ("" before it is known)."""

    @property
    def client(self) -> BusClient | None:
        """The node connection the service is registered on."""

    @property
    def budget(self) -> ThreadBudget: ...

    def holds(self) -> Sequence[tuple[int, int, LeasePhase, float]] | None:
        """`(run, lease epoch, phase, seconds until safe_until)` of every hold; None before
        the lease runtime exists."""

    def launcher(self, run_id: int) -> Launcher | None:
        """The launcher of a run the node is executing."""

    def run_view(self, run_id: int) -> RunView | None:
        """The node's report of a run it is executing, if it has one."""

    def run_events(self, run_id: int) -> Sequence[Mapping[str, Any]] | None:
        """The run's checkpoint event ring, oldest first (None: no ring yet)."""

    async def node_row(self) -> dict[str, Any] | None:
        """This node's registry row (None without a database or a row); a database error
        is raised as it is."""

    def drain(self) -> None:
        """Start the node's own drain (as SIGTERM does)."""

    def impaired(self) -> str | None:
        """Why the node holds its claims (a part of its own it could not bring back)."""


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))


class ControlService:
    """One node's control service; `start()` registers it, `close()` gives it up."""

    def __init__(self, node: NodeView) -> None:
        self.node = node
        self.node_id = node.node_id
        self.name = control_service(self.node_id)
        self.health_fail_s = node.health_fail_s
        self.service: Service | None = None
        self.drain_requested = False
        self._handlers: dict[str, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]] = {
            "Control.Status": self.status,
            "Control.Kill": self.kill,
            "Control.Drain": self.drain,
            "Control.RunEvents": self.run_events,
            "Control.Watch": self.watch,
        }

    async def start(self) -> None:
        client = self.node.client
        assert client is not None
        self.service = await client.register(self.name, self.handle, max_queued=MAX_QUEUED,
                                             max_in_flight=MAX_IN_FLIGHT)

    async def close(self) -> None:
        service, self.service = self.service, None
        if service is not None:
            with contextlib.suppress(BusError, TimeoutError):
                async with asyncio.timeout(CLOSE_S):
                    await service.unregister()

    # ------------------------------------------------------------------ envelope

    @property
    def incarnation(self) -> str:
        client = self.node.client
        assert client is not None
        return client.client_incarnation

    async def handle(self, req: Request) -> dict[str, Any]:
        """One request → one outcome object (never raises a domain error)."""
        try:
            request = parse_request(req.payload)
            if request.scope is not None:
                raise DomainError.invalid("a control request has scope null")
        except DomainError as exc:
            return unparsable_outcome(req.payload, exc, self.node_id, self.incarnation).to_json()
        try:
            result = await self._execute(req.method, request.params)
        except DomainError as exc:
            log.info("control.refused", method=req.method, caller=req.caller.client_id,
                     code=str(exc.code), message=exc.message)
            return Outcome.failure(request, self.node_id, self.incarnation, exc).to_json()
        log.info("control.answered", method=req.method, caller=req.caller.client_id)
        return Outcome.success(request, self.node_id, self.incarnation, result).to_json()

    async def _execute(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        handler = self._handlers.get(method)
        if handler is None:
            raise DomainError.before(ErrorCode.UNSUPPORTED,
                                     f"{method} is not a method of {self.name}")
        problem = control_validator(method, "params")(params)
        if problem is not None:
            raise DomainError.invalid(f"{method} params: {problem}")
        result = await handler(params)
        problem = control_validator(method, "result")(result)
        if problem is not None:
            raise DomainError(ErrorCode.INTERNAL, f"{method} result: {problem}", Mutation.NONE)
        return result

    # ------------------------------------------------------------------ what this node holds

    def held(self) -> dict[int, tuple[int, float]]:
        """run → (lease epoch, seconds until safe_until) of every non-final hold."""
        holds = self.node.holds()
        if holds is None:
            return {}
        return {run: (epoch, left) for run, epoch, phase, left in holds if phase not in FINAL}

    def launcher(self, run_id: int) -> Launcher | None:
        return self.node.launcher(run_id)

    def _not_held(self, run_id: int) -> DomainError:
        return DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                  f"run {run_id} is not held by node {self.node_id}")

    # ------------------------------------------------------------------ Control.Status

    async def status(self, params: dict[str, Any]) -> dict[str, Any]:
        client = self.node.client
        assert client is not None
        async with asyncio.timeout(STATS_S):
            stats = await client.stats()
        router = {"routerId": stats["routerId"], "socket": self.node.socket,
                  "uptimeMs": stats["uptimeMs"], "connections": stats["connections"],
                  "activeCalls": stats["activeCalls"]}
        held = self.held()
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(self._run_status(run, epoch))
                     for run, (epoch, _) in sorted(held.items())]
        runs = [t.result() for t in tasks]
        return {"source": "control", "router": router, "nodes": [await self._node_status(held)],
                "runs": runs}

    async def _node_status(self, held: dict[int, tuple[int, float]]) -> dict[str, Any]:
        node = self.node
        state = ("starting" if node.holds() is None
                 else "draining" if self.drain_requested else "active")
        heartbeat: str | None = None
        row = await self._node_row()
        if row is not None:
            state, heartbeat = str(row["state"]), row["heartbeatAt"]
        impaired = node.impaired()
        if impaired is not None and state == "active":
            state = "draining"  # its registry write may not have landed yet
        budget = self.node.budget
        me = psutil.Process(os.getpid())
        return {
            "nodeId": self.node_id, "nodeName": node.node_name, "pid": os.getpid(),
            "state": state, "uptimeMs": _ms(time.time() - me.create_time()),
            "capacity": node.capacity,
            "threads": {"total": budget.total, "used": budget.total - budget.remaining},
            "runs": sorted(held),
            "leases": [{"run": run, "leaseEpoch": epoch, "safeUntilInMs": round(left * 1000)}
                       for run, (epoch, left) in sorted(held.items())],
            "lastHeartbeat": heartbeat,
            "dsn": redact_dsn(self.node.dsn) if self.node.dsn else None,
            "reason": impaired,
        }

    async def _node_row(self) -> dict[str, Any] | None:
        """This node's registry row, or None when the database does not answer in time."""
        try:
            async with asyncio.timeout(DB_READ_S):
                return await self.node.node_row()
        except (psycopg.Error, OSError, TimeoutError) as exc:
            log.warning("control.node_row_unavailable", error=str(exc))
            return None

    async def _run_status(self, run_id: int, lease_epoch: int) -> dict[str, Any]:
        view = self.node.run_view(run_id)
        launcher = self.launcher(run_id)
        workers: list[dict[str, Any]] = []
        if launcher is not None:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._worker_status(launcher, wid))
                         for wid in sorted(launcher.workers())]
            workers = [t.result() for t in tasks]
        return {
            "run": run_id, "leaseEpoch": lease_epoch,
            "epoch": None if view is None else view.epoch,
            "phase": None if view is None else view.phase,
            "boundary": 0 if view is None else view.boundary,
            "recoveries": 0 if view is None else view.recoveries,
            "workers": workers,
        }

    async def _worker_status(self, launcher: Launcher, worker_id: str) -> dict[str, Any]:
        launched = launcher.workers().get(worker_id)
        if launched is None:
            raise DomainError(ErrorCode.INTERNAL, f"{worker_id} left the launcher's table",
                              Mutation.NONE)
        state: str | None = None
        step: int | None = None
        alive = False
        try:
            async with asyncio.timeout(self.health_fail_s):
                answer = await launcher.health_check(worker_id)
        except (DomainError, TimeoutError):
            pass
        else:
            alive = True
            state = str(answer["state"])
            scope = answer.get("currentScope")
            step = int(scope["step"]) if isinstance(scope, dict) else None
        uptime: int | None = None
        if launched.pid is not None:
            with contextlib.suppress(psutil.Error):
                uptime = _ms(time.time() - psutil.Process(launched.pid).create_time())
        return {"workerId": worker_id, "role": launched.identity.role, "pid": launched.pid,
                "incarnationId": launched.domain_incarnation, "state": state, "step": step,
                "threads": launched.identity.worker_threads, "alive": alive,
                "uptimeMs": uptime}

    # ------------------------------------------------------------------ Control.Kill

    async def kill(self, params: dict[str, Any]) -> dict[str, Any]:
        worker_id: str = params["workerId"]
        run: int | None = params["run"]
        held = self.held()
        if run is not None:
            if run not in held:
                raise self._not_held(run)
        else:
            having = [r for r in sorted(held) if worker_id in self._workers_of(r)]
            if len(having) > 1:
                raise DomainError.invalid(
                    f"{worker_id} is a worker of runs {', '.join(map(str, having))}; "
                    "name one with run")
            run = having[0] if having else self._composed_of(worker_id, sorted(held))
            if run is None and len(held) > 1:
                names = sorted({w for r in held for w in self._launched_of(r)})
                raise DomainError.before(
                    ErrorCode.IDENTITY_MISMATCH,
                    f"no worker {worker_id} in runs {', '.join(map(str, sorted(held)))}; "
                    f"workers: {', '.join(names)}")
        launcher = None if run is None else self.launcher(run)
        if launcher is None:
            return {"workerId": worker_id, "run": run, "outcome": "AlreadyGone"}
        if worker_id not in launcher.launched_ids():
            raise DomainError.before(
                ErrorCode.IDENTITY_MISMATCH,
                f"no worker {worker_id} in run {run}; workers: "
                f"{', '.join(launcher.launched_ids())}")
        if params["signal"] == "KILL":
            outcome = (await launcher.kill(worker_id)).label
        else:
            outcome = (await launcher.reap(worker_id, KILL_REASON)).label
        log.warning("control.kill", run=run, worker=worker_id, signal=params["signal"],
                    outcome=outcome)
        return {"workerId": worker_id, "run": run, "outcome": outcome}

    def _composed_of(self, worker_id: str, runs: list[int]) -> int | None:
        """The held run whose composition has `worker_id` (the first), else the only held run
        (so the refusal can list its workers), else None."""
        for run in runs:
            if worker_id in self._launched_of(run):
                return run
        return runs[0] if len(runs) == 1 else None

    def _launched_of(self, run_id: int) -> list[str]:
        launcher = self.launcher(run_id)
        return [] if launcher is None else launcher.launched_ids()

    def _workers_of(self, run_id: int) -> set[str]:
        launcher = self.launcher(run_id)
        return set() if launcher is None else set(launcher.workers())

    # ------------------------------------------------------------------ Control.Drain

    async def drain(self, params: dict[str, Any]) -> dict[str, Any]:
        if self.node.holds() is None:
            raise DomainError.before(ErrorCode.INVALID_PHASE,
                                     f"node {self.node_id} is still starting")
        if not self.drain_requested:
            self.drain_requested = True
            log.warning("control.drain", node=self.node_id)
            self.node.drain()
        return {"draining": True}

    # ------------------------------------------------------------------ Control.RunEvents

    async def run_events(self, params: dict[str, Any]) -> dict[str, Any]:
        run: int = params["run"]
        if run not in self.held():
            raise self._not_held(run)
        ring = self.node.run_events(run)
        events = [] if ring is None else [dict(e) for e in ring][-MAX_EVENTS:]
        return {"run": run, "events": events}

    # ------------------------------------------------------------------ Control.Watch

    async def watch(self, params: dict[str, Any]) -> dict[str, Any]:
        """The run topic of a held run (topics.md §14.3): `flyctl watch` subscribes to it."""
        run: int | None = params["run"]
        held = sorted(self.held())
        if run is None:
            if not held:
                raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                         f"node {self.node_id} holds no run")
            if len(held) > 1:
                raise DomainError.invalid(
                    f"node {self.node_id} holds runs {', '.join(map(str, held))}; name one with "
                    "run")
            run = held[0]
        elif run not in held:
            raise self._not_held(run)
        view = self.node.run_view(run)
        if view is None or view.topic is None:
            raise DomainError.before(ErrorCode.UNSUPPORTED,
                                     f"run {run} has no run topic on node {self.node_id}")
        topic, incarnation = view.topic
        return {"run": run, "topic": topic, "topicIncarnation": incarnation,
                "descriptor": view.descriptor}
