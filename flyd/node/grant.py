"""One grant's session on this node: start or resume, step under the cadence, recover, end.

Why: a grant is the node's right to execute a run for a while. Within it the session must
advance from the head (or from zero), make its work durable in checkpoint-sized steps, survive
the loss of any worker by restoring every participant from the head into a new epoch, and end
the run with exactly one fenced transaction. This module is that sequence (design/state.md §8, §9;
design/distribution.md §5.7, §6); the executor (`flyd.node.executor`) validates the spec and owns
the processes, the coordinator steps, the durability layer (`flyd.session.durability`) captures and
commits.

Sequence:
1. Launch the composition (the spec's faults minus those already fired) and the coordinator
   client. Without a head: bootstrap in `e1`. With a head at `e<h>` (design/state.md §8.5):
   bootstrap in `e<h+1>`, install the head with `restore(None, e<h+2>)` from that unstepped
   `Ready(0)`, resume. The writer's head is the claimed head; its first commit inserts only later
   boundaries.
2. Step to the target. Before `step()` from `Ready(k)` the step-addressed faults of step k not
   yet fired are recorded as fired (design/distribution.md §3.11) and dropped from the coordinator's
   injections, so they never recur, recoveries included. Each committed transition's behaviour
   record, rebased onto `e1`, joins the pending effects; captures follow the cadence.
3. A `SessionFailure` (a worker's death, a health failure, a partial commit, …) starts automatic
   recovery (design/state.md §8.2): drain the writer and read the head, drop the abandoned range,
   replace every participant, take the next epoch, restore the head (or, with none, bootstrap a
   fresh coordinator), resume. Attempts are bounded (`flyd.state.recovery`); an incompatible head is
   refused at once.
   A launch that fails (a worker that dies or does not identify within the boot budget) hands
   the run back charged, `claim_poll` from now, for another attempt here or elsewhere; on the
   run's last attempt it ends the run `failed` with `{error: "launch failed", failure}`. A
   launch refused for its arguments (`INVALID_ARGUMENT`, `launch_refusal_repeats`) would be
   refused again on every node and attempt, so it ends the run that way at once.
   A plugin failure that repeats (`flyd.state.recovery.repeats`: a model, world or task that
   cannot be imported, lacks its class or raises in its constructor), at launch, bootstrap or
   in a recovery attempt, ends the run `failed` at once, no recovery attempt spent, with
   `{error: "plugin failed", failure: {detail, participant, code, mutation, message}, plugin:
   {plugin, stage, exception, message, frames, repeats}}` (`workers.types.domain.PluginFault`) and
   logs `run.plugin_failed`. Every `failure` value of a report or an outcome carries the
   `plugin` key when its error had a plugin fault.
4. End (design/state.md §9.3): the target → a final durable capture carrying the remaining effects,
   `finish` and `finish_run(succeeded)` in one transaction; a cancel request → the pending effects,
   `finish` and `finish_run(cancelled)` without a checkpoint; exhausted or refused recovery, or a
   final or forced capture too large → `finish` and `finish_run(failed)` only, outcome
   `{error: "checkpoint too large", byteLength, limit}`; a drain → a durable capture
   at the current boundary (bounded by the drain window), then release with refund.
   A final or forced capture a participant refused (`flyd.session.durability.Refusal`) is
   named in the outcome as `failure` (`{detail: "capture", participant, code, mutation,
   message, checkpointId}`): refused in a way every attempt would meet again
   (`flyd.state.recovery.capture_repeats`, `UNSUPPORTED`), the run ends `failed` at once with
   `{error: "checkpoint capture refused", failure}`; otherwise the run is handed back charged,
   `claim_poll` from now, and on its last attempt ends `failed` with `{error: "attempts
   exhausted", lastCaptureRefusal: failure}`. Both log `run.capture_refused` (with `retry`).

Decisions:
- The guard of restore precondition 4 is the runtime's own (every commit checks it); a lost
  lease cancels this task through the scope, never through recovery.
- A router death never costs a recovery attempt: an attempt reconnects first (design/state.md §8.2
  step 0) when any of the coordinator's, the node's or the launcher's connection is closed, and an
  attempt that fails while one of them is closed, or during which the router exited (the
  executor's `router_exits`; its workers may report the loss only after the router is back,
  as an exit with code 3), is given back (`recovery.attempt_interrupted`) and started again
  once the router is back; so is a successful attempt whose failure was a router death (the
  router exited since the session last resumed, or the attempt before it was interrupted by
  one: `recovery.attempt_refunded`). Routers killed
  in a burst therefore never end a run "recovery attempts exhausted"; a router that does not
  come back within `durable_timeout_s` abandons the run locally, as before.
- A hung part is a fault like a dead one (`flyd.node.parts`): an attempt that failed, and a
  launch that failed, first has the node probe its router and fork server (`check_parts`); a
  part that missed its probe is killed and replaced meanwhile, and the host's `parts_lost`
  (router exits and fork servers lost) then tells the attempt was the node's fault: it is given
  back (`recovery.attempt_interrupted`), and a failed launch hands the run back with refund
  (`run.handed_back`). A node whose parts cannot be brought back (`parts_down`) hands each
  run back with refund instead of spending its attempts (`run.handed_back`, also from a
  grant waiting for a router that was given up).
- A recovery that cannot drain the writer within `durable_timeout_s` abandons the run locally
  (`recovery.abandoned_run`): the task returns without ending the run and the runtime
  relinquishes it; the next holder resumes from the head.
- An output file the run writes as it goes (`flyd run --trace`, `--record`) that cannot be
  written (`flyd.session.outputs.OutputWriteError`, e.g. `ENOSPC`) ends the run `failed` at
  once with `{error: "output write failed", option, path, errno, message}` and logs
  `run.output_failed`: no attempt can repair a full disk. The trace (`RunReport.trace`, shared
  by the run's grants on this node) is cut back and marked where each grant and each recovery
  resumes, and flushed before the final transaction, so a run cannot succeed with an unwritten
  trace.
- A task value that cannot be encoded fails the step as a plugin failure that repeats
  (`flyd.session.task_output`); met while stepping, it ends the run at once like one met at
  launch or bootstrap.
- `outcome.recoveries` and `epochs` count this grant's recoveries and the raw epochs of the
  ledger's boundaries (committed ones read back from `flyd.effects`, pending ones from memory),
  followed by the current epoch when it is not the last of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol

import structlog

from bus.client import BusClient
from bus.client_topics import Topic
from bus.errors import BusError
from flyd.launch.identities import SessionNames
from flyd.launch.launcher import ExecutionMode, LaunchedWorker, Launcher, composition_plans
from flyd.leases.queries import LedgerFold
from flyd.leases.runtime import GrantScope
from flyd.outcome import describe
from flyd.session.calls import Deadlines
from flyd.session.coordinator import Coordinator
from flyd.session.durability import (
    CaptureRefused,
    CheckpointTooLarge,
    Durability,
    Refusal,
    TooLarge,
)
from flyd.session.fence import SessionFailure
from flyd.session.injections import Injections
from flyd.session.outputs import OutputWriteError, TraceFile
from flyd.session.profiles import model_profiles
from flyd.session.run_topic import (
    EndState,
    RunEnd,
    RunPublisher,
    declare_run_topic,
    end_run_topic,
)
from flyd.session.runspec import RunSpec
from flyd.session.stepping import History
from flyd.session.trace import RecordStream
from flyd.session.transition import DispatchOrder
from flyd.state.cadence import Cadence
from flyd.state.checkpoints import CheckpointRecord, CheckpointStore, FinishRun
from flyd.state.effects import epoch_number
from flyd.state.recovery import (
    Exhausted,
    RecoveryBudget,
    capture_repeats,
    is_permanent,
    repeats,
)
from flyd.state.writer import CheckpointSettings, CheckpointWriter, Committed, EventRing
from workers.plugins import construct_plugin, load_plugin
from workers.protocols import (
    EXECUTOR_ATTRIBUTES,
    TASK_ATTRIBUTES,
    ActionExecutor,
    Task,
    check_plugin,
)
from workers.types.domain import DomainError, ErrorCode

__all__ = [
    "GrantHost",
    "GrantSession",
    "RunAbandoned",
    "RunReport",
    "error_json",
    "launch_refusal_repeats",
    "worker_json",
    "writer_config",
]

log = structlog.get_logger("flyd.node.grant")

FIRST_EPOCH: Final = "e1"
CLOSE_S: Final = 5.0
#: The coordinator's per-step history a grant keeps (`History`): audit entries, phase edges and
#: latency samples, and whole traced transitions; its event tally reaches back to the head.
HISTORY_ENTRIES: Final = 1024
HISTORY_TRANSITIONS: Final = 8
Ending = Literal["succeeded", "cancelled", "drained"]
#: a grant's final report state as the run topic's `end` says it (anything else: `released`)
_END_STATES: Final[dict[str | None, EndState]] = {
    "succeeded": "succeeded", "failed": "failed", "cancelled": "cancelled"}

#: the committed ledger rows up to a boundary, folded in boundary order
LedgerReader = Callable[[int, int], Awaitable[LedgerFold]]

_SPEC_KEYS: Final = {
    "everySteps": "every_steps", "everySeconds": "every_seconds",
    "keepGenerations": "keep_generations", "queueCapacity": "queue_capacity",
    "maxQueuedBytes": "max_queued_bytes", "retry": "retry", "retryAttempts": "retry_attempts",
    "retryBackoffS": "retry_backoff_s", "durableTimeoutS": "durable_timeout_s",
    "recoveryMaxAttempts": "recovery_max_attempts", "recoveryBackoffS": "recovery_backoff_s",
    "recoveryBackoffMaxS": "recovery_backoff_max_s",
}


def worker_json(w: LaunchedWorker) -> dict[str, Any]:
    """design/cli.md §4.2's `workers` entry (the node's own pid in thread and in-process modes)."""
    return {"workerId": w.worker_id, "role": w.identity.role,
            "incarnationId": w.identity.incarnation_id,
            "pid": w.pid if w.pid is not None else os.getpid(),
            "threads": w.identity.worker_threads}


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
    records: RecordStream = field(default_factory=RecordStream)
    #: the run's `--trace` file (`flyd run`), shared by its grants on this node
    trace: TraceFile | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    recoveries: list[dict[str, Any]] = field(default_factory=list)
    coordinator: Coordinator | None = None
    lost_reason: str | None = None
    #: the run topic while the grant's session has one (topics.md §14.1)
    topic: Topic | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    def fence(self, reason: str) -> None:
        """The lease is lost (design/distribution.md §5.5 step 2): the session dispatches nothing
        more."""
        self.lost_reason = reason
        if self.coordinator is not None:
            self.coordinator.fence_now(f"lease lost ({reason})")


class GrantHost(Protocol):
    """What a grant's session asks of the node that executes it (`GrantExecutor`): the node's
    identity and limits, its launchers and bus connections, and what it reports upward. The
    session owns its sequence; the host owns the processes and connections, so it can kill and
    close them whatever the session is doing."""

    @property
    def node_id(self) -> str: ...

    @property
    def max_agents(self) -> int: ...

    @property
    def deadlines(self) -> Deadlines: ...

    @property
    def parts_lost(self) -> int:
        """The node's own parts lost so far, router exits and fork servers (a recovery attempt
        that saw one is given back)."""

    async def check_parts(self) -> None:
        """Probe the node's router and fork server now; a hung one is replaced before this
        returns (bounded)."""

    def parts_down(self) -> str | None:
        """Why the node cannot launch runs now (a part it could not bring back), or None."""

    async def open_launcher(self, run_id: int, session_id: str,
                            agents_per_process: int | None = None
                            ) -> tuple[SessionNames, Launcher]:
        """A launcher for the run under fresh session names (a new tag)."""

    @property
    def node(self) -> BusClient:
        """The node's own connection (it owns the run topics)."""

    async def connect_coordinator(self, run_id: int, names: SessionNames,
                                  publisher: RunPublisher | None) -> BusClient | None:
        """Connect the run's coordinator client, with the right to publish on the run topic
        and `publisher`'s refusal hook when given; returns the one it replaces (to be
        closed)."""

    def coordinator_client(self, run_id: int) -> BusClient: ...

    def connections_closed(self, run_id: int) -> bool:
        """Whether the run's coordinator client or the node's own connection is closed."""

    async def router_ready(self, timeout_s: float) -> bool:
        """Wait (bounded) until the node's connection is open again; False when it stayed down."""

    def kill(self, run_id: int) -> None:
        """SIGKILL the run's workers' process groups, synchronously."""

    def progressed(self, report: RunReport) -> None:
        """One step was taken."""

    def recovered(self, report: RunReport, info: dict[str, Any]) -> None:
        """A recovery resumed the session."""


class PartsDown(Exception):
    """The node gave up a part of its own (its router, its fork server) while the grant
    needed it: the run is handed back with refund."""


class RunAbandoned(Exception):
    """The grant's work cannot go on here (the writer would not drain); the runtime
    relinquishes the run and the next holder resumes from the head."""


def launch_refusal_repeats(exc: DomainError | BusError) -> bool:
    """Whether a launch failure would recur on any node and attempt: the launch values built
    from the spec were refused (`INVALID_ARGUMENT`, which includes a model or world that cannot
    be imported) or a plugin failed in a way that repeats, not a process, the bus or the
    budget."""
    return isinstance(exc, DomainError) and (exc.code == ErrorCode.INVALID_ARGUMENT
                                             or repeats(exc))


def writer_config(node: CheckpointSettings, spec: RunSpec) -> CheckpointSettings:
    """The node's `[checkpoints]` defaults, overridden by the run spec's `checkpoints`."""
    given = {_SPEC_KEYS[k]: v for k, v in spec.checkpoints.items()
             if v is not None and k in _SPEC_KEYS}
    return dataclasses.replace(node, **given)


class GrantSession:
    """One grant's session (module rules)."""

    def __init__(self, *, host: GrantHost, scope: GrantScope, spec: RunSpec,
                 report: RunReport, config: CheckpointSettings, checkpoints: CheckpointStore,
                 ledger: LedgerReader, drain_timeout_s: float) -> None:
        self.host = host
        self.scope = scope
        self.spec = spec
        self.report = report
        self.config = config
        self.checkpoints = checkpoints
        self.ledger = ledger
        self.drain_timeout_s = drain_timeout_s
        self.run_id = scope.run_id
        self.log = log.bind(run=scope.run_id, lease_epoch=scope.lease_epoch,
                            node=host.node_id)
        self.fired: set[str] = set(scope.grant.faults_fired)
        self._parts_lost_seen = host.parts_lost  # part losses answered so far
        self.budget = RecoveryBudget(config.recovery_max_attempts, config.recovery_backoff_s,
                                     config.recovery_backoff_max_s)
        self.max_epoch = 0
        self.names: SessionNames | None = None
        self.launcher: Launcher | None = None
        self.coordinator: Coordinator | None = None
        self.durability: Durability | None = None
        self.ring = EventRing()
        self.started = time.monotonic()
        self.generation = 1
        #: the boundary the current epoch began stepping from (a resume, a restart or the grant)
        self._stepped_from = 0
        self.fresh_launcher = False
        #: the run topic (topics.md §14.1), declared when the session starts; None leaves
        #: the run unwatched
        self.topic: Topic | None = None
        self.publisher: RunPublisher | None = None
        self.end_error: str | None = None

    # ------------------------------------------------------------------ helpers

    @property
    def live_spec(self) -> RunSpec:
        """The spec with every fault fired so far omitted (launches and injections use it)."""
        return self.spec.without_fired(self.fired)

    def _coordinator(self) -> Coordinator:
        assert self.coordinator is not None
        return self.coordinator

    def _durability(self) -> Durability:
        assert self.durability is not None
        return self.durability

    def _rlog(self) -> Any:
        """The grant's logger with the session's current epoch (design/state.md §8.4: every
        `recovery.*` line has `run`, `epoch`, `node`)."""
        epoch = self.coordinator.epoch if self.coordinator is not None else None
        return self.log.bind(epoch=epoch)

    def _audit(self, line: str) -> None:
        if self.coordinator is not None:
            self.coordinator.audit.add(line)

    def _next_epoch(self) -> str:
        self.max_epoch += 1
        return f"e{self.max_epoch}"

    def _new_coordinator(self, epoch: str) -> Coordinator:
        """A coordinator for the live workers in `epoch` (not bootstrapped)."""
        spec, launcher = self.live_spec, self.launcher
        assert launcher is not None and self.names is not None
        task_class = load_plugin(spec.task.impl, "task")
        check_plugin(task_class, "task", spec.task.impl, TASK_ATTRIBUTES)
        executor_class = load_plugin(spec.executor.impl, "executor")
        check_plugin(executor_class, "executor", spec.executor.impl, EXECUTOR_ATTRIBUTES)
        task: Task = construct_plugin(task_class, spec.task.impl, "task",
                                      config=dict(spec.task.config),
                                      terminal=spec.task.terminal,
                                      max_agents=self.host.max_agents, epoch=epoch)
        executor: ActionExecutor = construct_plugin(executor_class, spec.executor.impl,
                                                    "executor",
                                                    config=dict(spec.executor.config))
        coordinator = Coordinator(
            self.spec, self.host.coordinator_client(self.run_id),
            {wid: w.worker_ref() for wid, w in launcher.workers().items()},
            profiles=model_profiles(self.spec),
            task=task, executor=executor, deadlines=self.host.deadlines,
            order=DispatchOrder.from_label(spec.dispatch), injections=self._injections(),
            epoch=epoch, history=History(entries=HISTORY_ENTRIES,
                                         transitions=HISTORY_TRANSITIONS,
                                         horizon=self.config.pending_effects_bound() + 2),
            publisher=self.publisher)
        if spec.pacing == "off" and spec.pace_s is None:
            coordinator.disable_pacing()
        self.coordinator = coordinator
        self.report.coordinator = coordinator
        return coordinator

    def _injections(self) -> Injections:
        spec, launcher = self.live_spec, self.launcher
        assert launcher is not None
        return Injections(lose_advance_result_at=spec.injections.lose_advance_result_at,
                          kill_at=tuple((k.worker, k.step) for k in spec.injections.kill),
                          kill=launcher.kill)

    async def _writer_idle(self) -> bool:
        """Wait until no capture is outstanding (≤ `durable_timeout_s`)."""
        writer = self._durability().writer
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.config.durable_timeout_s):
                await writer.idle()
        return writer.outstanding() == 0

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        head = (await self.checkpoints.head(self.run_id)
                if self.scope.grant.high_water is not None else None)
        self.scope.keep = self.config.keep_generations
        writer = CheckpointWriter(self.checkpoints, self.scope, self.config,
                                  head=(head.checkpoint_id, head.boundary) if head else None,
                                  sink=self.ring)
        self.durability = Durability(writer, Cadence(self.config.every_steps,
                                                     self.config.every_seconds),
                                     audit=self._audit)
        self.topic = self.report.topic = await declare_run_topic(self.host.node, self.run_id,
                                                                 CLOSE_S)
        if self.topic is not None:
            self.publisher = RunPublisher(self.run_id)
        try:
            async with asyncio.TaskGroup() as tg:
                writer_task = tg.create_task(writer.run())
                try:
                    await self._lifecycle(head)
                except BaseException:
                    # a lost lease cancels this task: nothing of this grant may be written any
                    # more, so the writer's current job is cancelled, not awaited
                    # (design/distribution.md §5.5)
                    writer_task.cancel()
                    raise
                await writer.shutdown()
        finally:
            await self._end_topic()

    async def _end_topic(self) -> None:
        """The run topic's `end` (topics.md §14.1 rule 4), then its removal. A grant that ends
        without a final state (abandoned, a lost lease) is `released`: another node may go on."""
        topic, self.topic = self.topic, None
        self.report.topic = None
        if topic is None:
            return
        ended = _END_STATES.get(self.report.state, "released")
        await end_run_topic(topic, RunEnd(self.run_id, ended, self.report.boundary,
                                          self.end_error if ended == "failed" else None),
                            CLOSE_S, self.publisher)

    async def _lifecycle(self, head: CheckpointRecord | None) -> None:
        try:
            await self._session(head)
        except OutputWriteError as exc:
            await self._output_failed(exc)

    async def _session(self, head: CheckpointRecord | None) -> None:
        self._resume_trace(head.boundary if head is not None else 0, "grant")
        try:
            await self._launch()
        except (DomainError, BusError) as exc:
            await self._launch_failed(exc)
            return
        failure: SessionFailure | None = None
        try:
            await self._begin(head)
        except SessionFailure as exc:
            if is_permanent(exc.error):
                await self._permanent(exc.error, head.checkpoint_id if head else None,
                                      exc.detail, exc.participant)
                return
            failure = exc
        except DomainError as exc:
            if is_permanent(exc):
                await self._permanent(exc, head.checkpoint_id if head else None, "bootstrap",
                                      None)
                return
            raise
        while True:
            if failure is not None:
                ended = await self._recover(failure)
                if ended:
                    return
                failure = None
            try:
                ending = await self._step_to_end()
                break
            except SessionFailure as exc:
                if repeats(exc.error):  # a task value that cannot be encoded, a world's bad reward
                    await self._permanent(exc.error, None, exc.detail, exc.participant)
                    return
                failure = exc
            except CheckpointTooLarge as exc:
                await self._failed(exc.refused.outcome())
                return
            except CaptureRefused as exc:
                await self._capture_refused(exc.refusal)
                return
        await self._end(ending)

    def _resume_trace(self, boundary: int, cause: Literal["grant", "recovery"]) -> None:
        """The trace resumes after `boundary` (`flyd.session.outputs.TraceFile`): what follows
        it is cut, and a mark says where and why execution resumes. A grant's mark comes
        before its launch (its epoch is not known yet); a recovery's names its new epoch."""
        trace = self.report.trace
        if trace is None:
            return
        mark = {"boundary": str(boundary), "cause": cause,
                "leaseEpoch": str(self.scope.lease_epoch), "node": self.host.node_id}
        if cause == "recovery":
            mark["epoch"] = self._coordinator().epoch
        trace.resume(boundary, mark)

    def _flush_trace(self) -> None:
        if self.report.trace is not None:
            self.report.trace.flush()

    async def _output_failed(self, exc: OutputWriteError) -> None:
        """An output file could not be written: the run fails at once, naming it (no attempt
        can repair a full disk)."""
        self._rlog().error("run.output_failed", option=exc.option, path=str(exc.path),
                           errno=exc.errno, message=exc.strerror)
        await self._failed(exc.outcome())

    async def _launch(self) -> None:
        self.names, self.launcher = await self.host.open_launcher(
            self.run_id, self.spec.session_id, self.spec.agents_per_process)
        launched = await self.launcher.launch_composition(
            self.live_spec, ExecutionMode.from_label(self.spec.mode))
        self.report.workers = [worker_json(launched[w]) for w in self.spec.worker_ids()
                               if w in launched]
        await self.host.connect_coordinator(self.run_id, self.names, self.publisher)

    async def _launch_failed(self, exc: DomainError | BusError) -> None:
        if isinstance(exc, DomainError):
            self.report.failure = error_json(exc, "launch", None)
        else:
            self.report.failure = {"detail": "launch", "participant": None, "code": exc.name,
                                   "mutation": "none", "message": exc.message}
        code, message = self.report.failure["code"], self.report.failure["message"]
        self.report.failures.append(self.report.failure)
        if not launch_refusal_repeats(exc):
            await self.host.check_parts()
            down = self.host.parts_down()
            if down is not None or self.host.parts_lost != self._parts_lost_seen:
                await self._hand_back(down or "a router or fork server was lost during the "
                                      "launch", code=code, message=message)
                return
        await self._durability().writer.shutdown()
        if not launch_refusal_repeats(exc) and await self.scope.retry_later():
            self.log.warning("run.launch_failed", code=code, message=message, retry=True)
            self.report.state = "released"
            return
        self.log.error("run.launch_failed", code=code, message=message, retry=False)
        if isinstance(exc, DomainError) and repeats(exc):
            await self._plugin_failed(self.report.failure)
            return
        await self._failed({"error": "launch failed", "failure": self.report.failure})

    async def _hand_back(self, why: str, **fields: Any) -> None:
        """The node's own part failed this grant, not the run: hand the run back with refund,
        `claim_poll` from now, for this node once its parts are back or for another."""
        self.log.warning("run.handed_back", reason=why, **fields)
        await self._durability().writer.shutdown()
        self.report.state = "released"
        await self.scope.hand_back()

    async def _begin(self, head: CheckpointRecord | None) -> None:
        durability = self._durability()
        if head is None:
            epoch = self._next_epoch()
            coordinator = self._new_coordinator(epoch)
            await coordinator.bootstrap()
            durability.restart(0, epoch)
            self.report.boundary = 0
            return
        self.max_epoch = epoch_number(head.session_epoch)
        coordinator = self._new_coordinator(self._next_epoch())
        await coordinator.bootstrap()
        epoch = self._next_epoch()
        restored = await coordinator.restore(None, epoch, store=self.checkpoints,
                                             run_id=self.run_id)
        coordinator.resume()
        durability.restart(restored.boundary, epoch)
        self.report.boundary = restored.boundary
        self.log.info("run.resumed", checkpoint_id=restored.checkpoint_id,
                      boundary=restored.boundary, new_epoch=epoch)

    # ------------------------------------------------------------------ stepping

    async def _step_to_end(self) -> Ending:
        """Step until the target, a cancel request or a drain, under health supervision; a
        failed epoch raises its `SessionFailure` (a health failure included)."""
        launcher = self.launcher
        assert launcher is not None
        health: list[SessionFailure] = []
        async with asyncio.TaskGroup() as tg:
            stepper = tg.create_task(self._steps_or_failure())

            def on_health(worker_id: str, error: DomainError) -> None:
                failure = self._coordinator().health_failure(worker_id, error)
                if failure is not None and not stepper.done():
                    health.append(failure)
                    stepper.cancel()

            supervisor = tg.create_task(launcher.supervise(on_health))
            stepper.add_done_callback(lambda _: supervisor.cancel())
        if stepper.cancelled():
            if health:
                raise health[0]
            raise asyncio.CancelledError
        result = stepper.result()
        if isinstance(result, SessionFailure | CheckpointTooLarge | CaptureRefused
                      | OutputWriteError):
            raise result
        return result

    async def _steps_or_failure(self) -> (Ending | SessionFailure | CheckpointTooLarge
                                          | CaptureRefused | OutputWriteError):
        """A failed epoch (or a forced capture that can never commit, or that a participant
        refused, or an output file that could not be written) as a value, so it leaves the
        task group as itself."""
        try:
            return await self._steps()
        except (SessionFailure, CheckpointTooLarge, CaptureRefused, OutputWriteError) as exc:
            return exc

    async def _steps(self) -> Ending:
        coordinator = self._coordinator()
        durability = self._durability()
        report = self.report
        started = time.monotonic()
        done_at_start = self._stepped_from = report.boundary
        while report.boundary < self.spec.steps:
            if self.scope.cancel_requested.is_set():
                return "cancelled"
            if self.scope.drain_requested.is_set():
                return "drained"
            await self._fire_due(report.boundary)
            step = await coordinator.step()
            report.boundary = step.boundary
            report.advances += 1
            report.step_seconds += time.monotonic() - started
            started = time.monotonic()
            record, result = coordinator.effect_records()
            durability.record(step.boundary, coordinator.epoch, record, result)
            data = durability.writer.pending.encoded(step.boundary)
            report.records.append(data)
            if report.trace is not None:
                report.trace.append(step.boundary, data)
            self.host.progressed(report)
            if step.terminal or step.paused or step.boundary >= self.spec.steps:
                # the final capture replaces a cadence capture due here (design/state.md §9.1)
                break
            await durability.after_boundary(coordinator, step.boundary)
            report.records.settle(durability.head_boundary - self._first_local())
            if report.trace is not None:
                report.trace.durable(durability.head_boundary)
            if self.budget.attempt and durability.head_boundary > done_at_start:
                self.budget.committed()
        return "succeeded"

    async def _fire_due(self, boundary: int) -> None:
        """Record step k's unfired one-shot faults as fired before the step that fires them;
        the coordinator keeps only those (and unfired later ones) in its injections."""
        due = [f for f in self.spec.faults_at(boundary) if f not in self.fired]
        if not due:
            return
        earlier = set(self.fired)
        await self.scope.mark_faults_fired(due)
        self.fired.update(due)
        coordinator = self._coordinator()
        kills = tuple((k.worker, k.step) for k in self.spec.injections.kill
                      if k.fault_id not in earlier)
        lost = tuple(s for s in self.spec.injections.lose_advance_result_at
                     if f"lose-advance-result@{s}" not in earlier)
        coordinator.injections = dataclasses.replace(
            coordinator.injections, kill_at=kills, lose_advance_result_at=lost)
        self.log.info("faults.fired", faults=sorted(due))

    # -------------------------------------------------------------- recovery (design/state.md §8.2)

    async def _recover(self, failure: SessionFailure) -> bool:
        """Recover until the session steps again (False) or the run ended here (True)."""
        last = failure
        router_death = False  # `last` is a router death an interrupted attempt ran into
        if self.budget.attempt and self._durability().head_boundary > self._stepped_from:
            # a commit landed after the resume though no boundary of this epoch saw it: the
            # failure follows a durable commit, so the attempts count from one again
            self.budget.committed()
        while True:
            attempt = self.budget.start()
            if isinstance(attempt, Exhausted):
                self._rlog().error("recovery.exhausted", attempts=attempt.attempts,
                               last_failure=_failure_fields(last))
                await self._failed({"error": "recovery attempts exhausted",
                                    "attempts": attempt.attempts,
                                    "lastFailure": _failure_json(last)})
                return True
            coordinator = self._coordinator()
            self.report.failures.append(_failure_json(last))
            self._rlog().info("recovery.started", failed_epoch=coordinator.epoch, attempt=attempt,
                          max_attempts=self.budget.max_attempts,
                          failure=_failure_fields(last))
            try:
                await self._attempt(attempt, last)
            except RunAbandoned:
                raise
            except PartsDown as exc:
                self.budget.refund()
                await self._hand_back(str(exc))
                return True
            except (SessionFailure, DomainError) as exc:
                error = exc.error if isinstance(exc, SessionFailure) else exc
                if is_permanent(error):
                    head = self._durability().head
                    detail, participant = ((exc.detail, exc.participant)
                                           if isinstance(exc, SessionFailure)
                                           else ("restore", None))
                    await self._permanent(error, head[0] if head is not None else None,
                                          detail, participant)
                    return True
                last = exc if isinstance(exc, SessionFailure) else SessionFailure(
                    exc, self._coordinator().phase.label, "restore", None)
            else:
                if router_death or self.host.parts_lost != self._parts_lost_seen:
                    self.budget.refund()  # the failure recovered from was a router death
                    self._rlog().info("recovery.attempt_refunded", attempt=attempt,
                                      reason="a router or fork server lost")
                self._parts_lost_seen = self.host.parts_lost
                return False
            await self.host.check_parts()
            down = self.host.parts_down()
            if down is not None:
                await self._hand_back(down)
                return True
            if self._router_lost() or self.host.parts_lost != self._parts_lost_seen:
                self._parts_lost_seen = self.host.parts_lost
                self.budget.refund()
                router_death = True
                self._rlog().warning("recovery.attempt_interrupted", attempt=attempt,
                                     code=str(last.code), message=last.message,
                                     participant=last.participant)
                continue
            router_death = False
            backoff = self.budget.failed()
            self._rlog().warning("recovery.attempt_failed", attempt=attempt, code=str(last.code),
                             message=last.message, participant=last.participant,
                             tainted=self._tainted(), backoff_s=backoff)
            await asyncio.sleep(backoff)

    def _tainted(self) -> list[str]:
        coordinator = self.coordinator
        tainted = getattr(coordinator, "tainted", None)
        return list(tainted()) if callable(tainted) else []

    async def _reconnect(self) -> None:
        """design/state.md §8.2 step 0, per session: the router was lost; once the node is
        reconnected, open a new launcher and coordinator client (new incarnations; the old
        expectations died with the old connections)."""
        if not await self.host.router_ready(self.config.durable_timeout_s):
            down = self.host.parts_down()
            if down is not None:
                raise PartsDown(down)
            self._rlog().error("recovery.abandoned_run", reason="the router did not come back")
            raise RunAbandoned(f"run {self.run_id}: the router did not come back")
        old = self.launcher
        if old is not None:
            self.host.kill(self.run_id)
            with contextlib.suppress(DomainError, BusError, TimeoutError):
                async with asyncio.timeout(CLOSE_S):
                    await old.close()
        self.names, self.launcher = await self.host.open_launcher(
            self.run_id, self.spec.session_id, self.spec.agents_per_process)
        if self.topic is not None:
            self.topic = await declare_run_topic(self.host.node, self.run_id, CLOSE_S)
            self.report.topic = self.topic
        previous = await self.host.connect_coordinator(self.run_id, self.names, self.publisher)
        client = self.host.coordinator_client(self.run_id)
        if previous is not None:
            with contextlib.suppress(BusError, TimeoutError):
                async with asyncio.timeout(CLOSE_S):
                    await previous.close()
        await self._coordinator().replace_client(client)
        self.fresh_launcher = True
        self._rlog().info("recovery.reconnected", router_id=None, sessions=1)

    def _router_lost(self) -> bool:
        """A connection recovery needs is closed: the coordinator's client, the node's, or the
        one the launcher was opened with. A router death closes them all, in whatever order
        their readers notice, so any one of them closed means the router is gone."""
        launcher = self.launcher
        return (self.host.connections_closed(self.run_id)
                or (launcher is not None and launcher.node.closed))

    async def _attempt(self, attempt: int, failure: SessionFailure) -> None:
        if self._router_lost():
            await self._reconnect()
        durability = self._durability()
        writer = durability.writer
        before = writer.outstanding()
        if not await self._writer_idle():
            self._rlog().error("recovery.abandoned_run", reason="the checkpoint writer did not "
                           "drain within durable_timeout_s")
            raise RunAbandoned(f"run {self.run_id}: writer did not drain")
        head = durability.head
        record = (await self.checkpoints.lookup(self.run_id, head[0])
                  if head is not None else None)
        self._rlog().info("recovery.drained", outstanding_before=before,
                          head=None if head is None else {
                              "checkpoint_id": head[0], "boundary": head[1],
                              "session_epoch": record.session_epoch if record else None})
        failed_epoch = self._coordinator().epoch
        reached = self.report.boundary
        head_boundary = durability.head_boundary
        if reached > head_boundary:
            self._rlog().info("recovery.abandoned", failed_epoch=failed_epoch,
                          from_boundary=head_boundary + 1, to_boundary=reached)
        writer.pending.rewind(head_boundary)
        await self._replace_all()
        epoch = self._next_epoch()
        if head is None:
            coordinator = self._new_coordinator(epoch)
            await coordinator.bootstrap()
            boundary = 0
            self._rlog().info("recovery.restarted", new_epoch=epoch)
        else:
            coordinator = self._coordinator()
            coordinator.injections = self._injections()
            restored = await coordinator.restore(None, epoch, store=self.checkpoints,
                                                 run_id=self.run_id)
            boundary = restored.boundary
            self._rlog().info("recovery.restored", checkpoint_id=restored.checkpoint_id,
                          boundary=boundary, new_epoch=epoch, staged=list(restored.staged),
                          activated=list(restored.activated))
            coordinator.resume()
        self.report.boundary = boundary
        self.report.records.rewind(max(0, boundary - self._first_local()))
        self._resume_trace(boundary, "recovery")
        durability.restart(boundary, epoch)
        self.budget.resumed()
        self.host.recovered(self.report, {"participant": failure.participant,
                                        "code": str(failure.code), "boundary": boundary,
                                        "epoch": epoch})
        self._rlog().info("recovery.resumed", boundary=boundary, new_epoch=epoch, attempt=attempt)

    def _first_local(self) -> int:
        """The boundary this grant's local records start after (the claimed head)."""
        return self.scope.grant.boundary

    async def _replace_all(self) -> None:
        """design/state.md §8.2 step 5: every participant killed and replaced by its next generation
        (after a router loss, launched by the new launcher)."""
        launcher, coordinator = self.launcher, self._coordinator()
        assert launcher is not None and self.names is not None
        spec = self.live_spec
        self.generation += 1
        if self.fresh_launcher:
            self.fresh_launcher = False
            plans = composition_plans(self.names, spec, generation=self.generation)
            launched = await launcher.launch_all(plans, ExecutionMode.from_label(spec.mode))
            for wid in spec.worker_ids():
                coordinator.replace_participant(wid, launched[wid].worker_ref())
                self._rlog().info("recovery.replaced", worker=wid, old_incarnation=None,
                              new_incarnation=launched[wid].identity.incarnation_id,
                              reap="router-lost")
            return
        olds = coordinator.refs()
        replacements = await launcher.restart_all(spec.worker_ids(), spec.faults_of)
        for wid in spec.worker_ids():
            old = olds.get(wid)
            coordinator.replace_participant(wid, replacements[wid].worker_ref())
            self._rlog().info("recovery.replaced", worker=wid,
                              old_incarnation=old.domain_incarnation if old else None,
                              new_incarnation=replacements[wid].identity.incarnation_id,
                              reap="killed")

    # --------------------------------------------------------------- endings (design/state.md §9.3)

    async def _end(self, ending: Ending) -> None:
        if ending == "succeeded":
            await self._final()
        elif ending == "cancelled":
            await self._cancelled()
        else:
            await self._drained()

    async def _ledger(self, through: int) -> tuple[str, list[str]]:
        """The behaviour digest of boundaries 1..through (committed, then pending) and the raw
        epochs that executed them, in order of first boundary; folded as read, so a long run's
        ledger is never held in memory."""
        durability = self._durability()
        head_boundary = durability.head_boundary
        fold = await self.ledger(self.run_id, head_boundary) if head_boundary else LedgerFold()
        for effect in durability.writer.pending.covering(head_boundary, through):
            fold.add(effect.session_epoch, effect.payload)
        epochs = list(fold.epochs)
        current = self._coordinator().epoch
        if not epochs or epochs[-1] != current:
            epochs.append(current)
        return fold.digest(), epochs

    async def _final(self) -> None:
        durability = self._durability()
        coordinator = self._coordinator()
        self._flush_trace()  # before the run can succeed: a write error still fails it
        while True:
            await self._writer_idle()
            boundary = self.report.boundary
            behaviour_digest, epochs = await self._ledger(boundary)
            checkpoint_id = durability.cadence.next_id("final")
            outcome = {"boundary": boundary, "advances": self.report.advances,
                       "recoveries": self.budget.recoveries, "epochs": epochs,
                       "finalCheckpointId": checkpoint_id,
                       "behaviourDigest": behaviour_digest}
            result = await durability.durable(
                coordinator, "final", checkpoint_id=checkpoint_id,
                finish=FinishRun("succeeded", outcome, boundary,
                                 epoch_number(coordinator.epoch)))
            if isinstance(result, Committed):
                self.report.state = "succeeded"
                return
            if isinstance(result, TooLarge):
                await self._failed(result.outcome())
                return
            if isinstance(result, Refusal):
                await self._capture_refused(result)
                return
            backoff = self.config.recovery_backoff_s
            self.log.warning("checkpoint.final_retry", checkpoint_id=checkpoint_id,
                             outcome=type(result).__name__, backoff_s=backoff)
            await asyncio.sleep(backoff)

    async def _cancelled(self) -> None:
        durability = self._durability()
        await durability.writer.shutdown()
        boundary = self.report.boundary
        _, epochs = await self._ledger(boundary)
        effects = durability.writer.pending.covering(durability.head_boundary, boundary)
        self._flush_trace()
        self.report.state = "cancelled"
        await self.scope.finish("cancelled", {"boundary": boundary,
                                              "recoveries": self.budget.recoveries,
                                              "epochs": epochs},
                                effects, boundaries=boundary,
                                session_epoch=epoch_number(self._coordinator().epoch))

    async def _drained(self) -> None:
        durability = self._durability()
        if not self.scope.drain_hurry.is_set():
            budget = min(self.config.durable_timeout_s,
                         max(0.0, self.drain_timeout_s - (time.monotonic() - self.started) - 1))
            with contextlib.suppress(DomainError):
                result = await durability.durable(self._coordinator(), "drain", budget=budget)
                self.log.info("run.drain_checkpoint", outcome=type(result).__name__)
        await durability.writer.shutdown()
        self.report.state = "released"
        await self.scope.release(refund=True)

    async def _failed(self, outcome: dict[str, Any]) -> None:
        self.end_error = describe(outcome)
        durability = self._durability()
        await durability.writer.shutdown()
        self.report.state = "failed"
        epoch = self.coordinator.epoch if self.coordinator is not None else FIRST_EPOCH
        await self.scope.finish("failed", outcome, boundaries=durability.head_boundary,
                                session_epoch=epoch_number(epoch))

    async def _capture_refused(self, refusal: Refusal) -> None:
        """A final or forced capture a participant refused (module sequence, step 4): the
        outcome names the refusal, which otherwise only the log would."""
        failure = {**_failure_json(refusal.failure), "checkpointId": refusal.checkpoint_id}
        self.report.failure = failure
        self.report.failures.append(failure)
        fields = {"checkpoint_id": refusal.checkpoint_id, "participant": failure["participant"],
                  "code": failure["code"], "message": failure["message"]}
        if capture_repeats(refusal.failure.error):
            self._rlog().error("run.capture_refused", retry=False, **fields)
            await self._failed({"error": "checkpoint capture refused", "failure": failure})
            return
        await self._durability().writer.shutdown()
        if await self.scope.retry_later():
            self._rlog().warning("run.capture_refused", retry=True, **fields)
            self.report.state = "released"
            return
        self._rlog().error("run.capture_refused", retry=False, **fields)
        await self._failed({"error": "attempts exhausted", "lastCaptureRefusal": failure})

    async def _permanent(self, error: DomainError, checkpoint_id: str | None, detail: str,
                         participant: str | None) -> None:
        """A failure no attempt can repair: a repeating plugin failure, else a refused
        restore."""
        if repeats(error):
            failure = error_json(error, detail, participant)
            self.report.failure = failure
            self.report.failures.append(failure)
            await self._plugin_failed(failure)
        else:
            await self._refused(error, checkpoint_id)

    async def _plugin_failed(self, failure: dict[str, Any]) -> None:
        plugin = failure["plugin"]
        self._rlog().error("run.plugin_failed", detail=failure["detail"],
                           participant=failure["participant"], code=failure["code"],
                           message=failure["message"], plugin=plugin["plugin"],
                           stage=plugin["stage"], exception=plugin["exception"],
                           exception_message=plugin["message"], frames=plugin["frames"])
        await self._failed({"error": "plugin failed",
                            "failure": {k: v for k, v in failure.items() if k != "plugin"},
                            "plugin": plugin})

    async def _refused(self, exc: DomainError, checkpoint_id: str | None) -> None:
        self._rlog().error("recovery.refused", code=str(exc.code), message=exc.message,
                       checkpoint_id=checkpoint_id)
        await self._failed({"code": str(exc.code), "message": exc.message,
                            "checkpointId": checkpoint_id})



def error_json(error: DomainError, detail: str, participant: str | None) -> dict[str, Any]:
    """A failure as reports and outcomes show it; `plugin` is the error's plugin fault."""
    doc: dict[str, Any] = {"detail": detail, "participant": participant,
                           "code": str(error.code), "mutation": str(error.mutation),
                           "message": error.message}
    if error.data is not None:
        doc["plugin"] = error.data.to_json()
    return doc


def _failure_json(failure: SessionFailure) -> dict[str, Any]:
    return error_json(failure.error, failure.detail, failure.participant)


def _failure_fields(failure: SessionFailure) -> dict[str, Any]:
    return {"code": str(failure.code), "mutation": str(failure.mutation),
            "detail": failure.detail, "participant": failure.participant,
            "phase": failure.phase, "message": failure.message}

