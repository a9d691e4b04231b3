"""The session coordinator (session.md §6): the lockstep transaction, and the session's state
between boundaries.

One `Coordinator` per session, an asyncio object on the node's loop with its own bus connection.
The task and the action executor are local objects; agents and the world are bus services
reached through pinned `WorkerRef`s. The coordinator holds the session's state and runs its
phases; the parts with rules of their own are modules it calls, each with a public interface:
every call and every failure of the epoch go through its `CallEngine` (`flyd.session.calls`:
deadlines, `check_reply`, resolution, `fail`, §6.3, §6.4, §6.8); bootstrap's checks are
`flyd.session.bootstrap` (§6.5), publication `flyd.session.publication` (§6.9), injections
`flyd.session.injections` (§6.13), capture `flyd.session.capture` (state.md §5.7) and restore
`flyd.session.restore` (state.md §7). Those modules read the coordinator's public side and return
what they learnt; only the coordinator changes its own state. Every concurrent dispatch runs inside
a `TaskGroup`.

API (§6.1):

    coordinator = Coordinator(spec, client, refs, task=..., executor=..., deadlines=...,
                              order=DispatchOrder.CONCURRENT, injections=Injections(),
                              clock=SYSTEM_CLOCK, epoch="e1")
    await coordinator.bootstrap()                 # -> Ready(0)
    report = await coordinator.step()             # StepReport{boundary, paused, terminal}
    reports = await coordinator.run(n)            # stops early after a paused report
    coordinator.pause_handle().request(); coordinator.resume()
    await coordinator.worker_status(wid, ref=None); await coordinator.acknowledge_replies(wid, ids)
    await coordinator.probe_raw(wid, method, scope, params, ref=None)
    capture = await coordinator.capture(checkpoint_id, kind="durable")   # state.md §5.7
    ticket = await coordinator.save(checkpoint_id); await coordinator.await_durable(ticket)
    coordinator.replace_participant(wid, ref); await coordinator.replace_client(client)
    report = await coordinator.restore(checkpoint_id | None, "e2")      # state.md §7
    coordinator.tainted(); coordinator.durable(); coordinator.reset()   # reset: UNSUPPORTED

Resolved ambiguities (where §6 is silent):
- The spec object is the run spec (`flyd.session.runspec.RunSpec`, the `SessionSpec` of §6.1); the
  epoch is a constructor keyword (default `e1`). Agents' `workerThreads` are their spec
  `threads` (the launcher allocates exactly that).
- `step()` at `Paused(k)` with a stored episode request raises `SessionFailure`
  (`INVALID_PHASE`/`none`, detail `episode`) *without* failing the epoch: §6.7 says the session
  stays paused until a reset. Without an episode request, a step from `Paused` fails the epoch
  (detail `step`), as does any step from a phase other than `Ready`.
- Phase D failures (including an unresolved Commit) use detail `commit` (§6.6 D is more specific
  than §6.8 step 3).
- `Worker.Status` from the coordinator carries the committed scope of the session (null before
  `Ready(0)` or while no boundary is committed).
- `probe_raw` checks only the outcome's shape; identity checks are `worker_status`'s.
- Snapshot `sequence` counts snapshots of the session from 0 (boundary 0's snapshot is 0).
- The executor's `clock` argument is the world time of boundary k; every prepared decision
  must have the executor's `decision_schema` (else `IDENTITY_MISMATCH`, blamed on the agent).
- Structured input: when the world's `Worker.Hello` lists `structured-observation-v1`
  (`workers.protocols.STRUCTURED_OBSERVATION`), the inspection of boundary b is every agent's
  `structured` input of b (Initialize and Commit); otherwise it is null. The coordinator learns
  it at bootstrap, which every restore of a node's coordinator follows.
- An exception that is not a `DomainError` inside the transaction (a plugin bug) is an
  `INTERNAL`/`unknown` failure of the phase's detail; anything unexpected that escapes a phase
  (a flyd bug) still fences the epoch, with detail `step`; so does a `step()`/`bootstrap()`
  cancelled away from a committed boundary (`BACKEND_FAILURE`/`unknown`, then the
  cancellation propagates).
- A `BACKEND_FAILURE` seen while the coordinator's own bus connection is closed gets detail
  `router` (participant: the worker whose call was pending), since the cause is the lost
  connection, not the worker.
- `health_failure(worker_id, error)` is how a supervisor's report (§7.4) fails the epoch
  (detail `health`); it returns the `SessionFailure` instead of raising it, since the caller is
  the health loop, not a step.
- `capture` returns the `Capture`; with a `StateContext` whose writer is set (`state=`), `save`
  submits it (`flyd.session.capture.save`), `checkpoint` is `save` then `await_durable`, and every
  committed transition appends its behaviour record, rebased onto `e1`, to the writer's
  `PendingEffects` (state.md §9.2). `restore` takes the store and run from its arguments when
  given, else from the `StateContext`.
- Audio is checked by `AudioTimelines` (state.md §7.5): fresh at bootstrap, restored at an
  install; `audio_positions()` is its positions, as a capture records them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Final

from bus.client import BusClient
from flyd.launch.identities import WorkerRef
from flyd.session.advance import check_advance, controls_for
from flyd.session.audio import AudioTimelines
from flyd.session.audit import AuditLog
from flyd.session.bootstrap import (
    acknowledge_lifecycle,
    bootstrap_task,
    hello,
    initialize_agent,
    initialize_environment,
)
from flyd.session.calls import (
    RESOLVE_PAUSE,
    Blame,
    Call,
    CallEngine,
    Deadlines,
    backend_failure,
    format_duration,
    identity_mismatch,
)
from flyd.session.capture import Capture, CaptureKind
from flyd.session.capture import capture as capture_boundary
from flyd.session.capture import save as save_capture
from flyd.session.fence import Detail, SessionFailure, check_replacement
from flyd.session.injections import (
    LOSS_POLLS,
    InjectionOutcome,
    Injections,
    advance_injections,
    duplicate,
    kill_injection,
    lose_advance_result,
)
from flyd.session.inputs import sensory_inputs
from flyd.session.media import Media
from flyd.session.pacing import SYSTEM_CLOCK, Clock, Pacing
from flyd.session.phase import (
    Applying,
    Committing,
    Failed,
    Observing,
    Paused,
    Phase,
    PhaseMachine,
    Preparing,
    Ready,
    Restoring,
)
from flyd.session.publication import (
    AgentValues,
    Feed,
    Publication,
    check_publication,
    descriptor_body,
    snapshot_body,
)
from flyd.session.records import result_record, transition_records
from flyd.session.restore import (
    InstallAborted,
    Installed,
    RestoreReport,
    StateContext,
    install,
    prepare,
    recovered,
)
from flyd.session.run_topic import RunPublisher
from flyd.session.runspec import RunSpec
from flyd.session.slots import AgentSlot
from flyd.session.stats import Metrics, ResolutionEnd, Stats
from flyd.session.task_output import check_evaluation, task_error
from flyd.session.trace import EpochRebase, TraceLog
from flyd.state.checkpoints import CheckpointRecord, CheckpointStore
from flyd.state.writer import (
    CheckpointWriter,
    Committed,
    SaveOutcome,
    SaveTicket,
    audit_line,
)
from workers.artifacts import any_by_reference, open_attached, referenced_artifacts
from workers.plugins import load_plugin
from workers.protocols import (
    STRUCTURED_OBSERVATION,
    ActionExecutor,
    EpisodeRequest,
    Evaluation,
    Task,
)
from workers.types.canonical import controls_digest, typed_digest
from workers.types.datatypes import (
    EnvironmentDescriptor,
    Graph,
    Telemetry,
    TypedValue,
    ViewDescriptor,
    WorldObservation,
)
from workers.types.domain import DomainError, ErrorCode, Mutation, Scope
from workers.types.rpc import CallOutcome

__all__ = [
    "FIRST_EPOCH",
    "LOSS_POLLS",
    "RESOLVE_PAUSE",
    "Coordinator",
    "Deadlines",
    "DispatchOrder",
    "Feed",
    "History",
    "InjectionOutcome",
    "Injections",
    "Metrics",
    "PauseHandle",
    "Publication",
    "ResolutionEnd",
    "SessionFailure",
    "Stats",
    "StepReport",
    "format_duration",
]

#: The epoch every ledger row is rebased onto (state.md §9.2).
FIRST_EPOCH: Final = "e1"

# --------------------------------------------------------------------------------------------
# small value types


class DispatchOrder(Enum):
    CONCURRENT = "concurrent"
    SEQUENTIAL = "sequential"
    REVERSED = "reversed"

    @classmethod
    def from_label(cls, label: str) -> DispatchOrder:
        return cls(label)


@dataclass(frozen=True)
class History:
    """How much per-step history a coordinator keeps (all of it by default: a test reads the
    whole session). A node's session passes bounds, so its memory does not grow with the run:
    the newest `entries` audit entries, phase edges and latency samples; the newest
    `transitions` traced transitions in full; the step and event count of the newest `horizon`
    transitions (to reach back to the oldest boundary a recovery can restore)."""

    entries: int | None = None
    transitions: int | None = None
    horizon: int | None = None


@dataclass(frozen=True)
class StepReport:
    boundary: int
    paused: bool
    terminal: bool


class PauseHandle:
    """A pause request flag, settable from any task or thread."""

    def __init__(self) -> None:
        self._flag = threading.Event()

    def request(self) -> None:
        self._flag.set()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def clear(self) -> None:
        self._flag.clear()


# --------------------------------------------------------------------------------------------
# the coordinator


class Coordinator:
    """One session's coordinator (§6)."""

    def __init__(self, spec: RunSpec, client: BusClient, refs: Mapping[str, WorkerRef], *,
                 task: Task, executor: ActionExecutor, deadlines: Deadlines | None = None,
                 order: DispatchOrder = DispatchOrder.CONCURRENT,
                 injections: Injections | None = None, clock: Clock = SYSTEM_CLOCK,
                 state: StateContext | None = None, epoch: str = "e1",
                 history: History | None = None,
                 publisher: RunPublisher | None = None) -> None:
        self.spec = spec
        self.task = task
        self.executor = executor
        self.order = order
        self.injections = injections or Injections()
        self.clock = clock
        self.state = state
        self.epoch = epoch
        self.world_id = spec.world.world_id
        self.agent_ids = sorted(a.agent_id for a in spec.agents)
        missing = [w for w in [self.world_id, *self.agent_ids] if w not in refs]
        if missing:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"no worker reference for {', '.join(missing)}")
        bound = history or History()
        self._machine = PhaseMachine(log_limit=bound.entries)
        self._pause = PauseHandle()
        self._pacing: Pacing | None = None
        if spec.pace_s is not None:
            self._pacing = Pacing.fixed(spec.pace_s, clock)
        elif spec.pacing == "realtime":
            self._pacing = Pacing(spec.world.step, clock)
        self.audit = AuditLog(limit=bound.entries)
        self.stats = Stats()
        self.metrics = Metrics(window=bound.entries)
        self._calls = CallEngine(client, refs, deadlines or Deadlines(), self._machine,
                                 audit=self.audit, stats=self.stats, metrics=self.metrics,
                                 on_fail=self._drop_uncommitted)
        self.trace = TraceLog(phase_source=self._machine.phase_path, keep=bound.transitions,
                              horizon=bound.horizon)
        self.snapshots = Feed()
        #: the run topic's publisher (a node's run); None publishes nothing beyond the feed
        self.publisher = publisher
        if publisher is not None:
            publisher.bind(self.stats)
        self.injection_log: list[InjectionOutcome] = []
        self.episode_request: EpisodeRequest | None = None
        self.descriptor: EnvironmentDescriptor | None = None
        self.observation: WorldObservation | None = None
        #: the task's verdict on the last committed transition (None before the first one and
        #: after a restore); kept by reference for observers of the run (`flyd.session.sample`)
        self.last_evaluation: Evaluation | None = None
        self._media = Media()
        self._pending_media = Media()
        self._audio = AudioTimelines([])
        self._tainted: set[str] = set()
        self._replaced: set[str] = set()
        self._used_epochs: set[str] = {epoch}
        self._durable: tuple[str, int] | None = None
        self.events: list[dict[str, Any]] = []
        self._owed: dict[str, list[str]] = {}
        self._progress: TypedValue | None = None
        self._last_transition: tuple[int, WorldObservation, Evaluation] | None = None
        self._descriptor_revision = 0
        self._snapshot_sequence = 0
        self._last_event_ids: list[str] = []
        self._controls_digest = ""
        self._slots: dict[str, AgentSlot] = {}
        #: the world offers its inspection as structured input (learnt at bootstrap)
        self.structured_input = False
        for agent in spec.agents:
            model = load_plugin(agent.model, "model")
            profile = model.profile(agent.agent_id, agent.tick, agent.warmup_ticks,
                                    dict(agent.model_config))
            self._slots[agent.agent_id] = AgentSlot(
                spec=agent, profile=profile.to_json(), seed=spec.seed_of(agent.agent_id),
                model_config=dict(agent.model_config))

    # ------------------------------------------------------------------ read-only state

    @property
    def phase(self) -> Phase:
        return self._machine.phase

    @property
    def fenced(self) -> bool:
        return self._machine.fenced

    @property
    def phase_log(self) -> tuple[tuple[Phase, Phase], ...]:
        return self._machine.phase_log

    def phase_path(self) -> list[str]:
        return self._machine.phase_path()

    def committed_boundary(self) -> int | None:
        return self._machine.committed_boundary()

    @property
    def last_failure(self) -> SessionFailure | None:
        """The failure that fenced the epoch last, if any."""
        return self._calls.last_failure

    @property
    def deadlines(self) -> Deadlines:
        return self._calls.deadlines

    def set_deadlines(self, deadlines: Deadlines) -> None:
        self._calls.deadlines = deadlines

    def progress(self) -> TypedValue:
        return self.task.progress()

    def evaluations(self) -> int:
        return self.task.evaluations()

    def committed_view(self) -> tuple[ViewDescriptor, bytes] | None:
        """The committed boundary's first declared view and its RGBA8 bytes (the view a world
        meant for people declares first: `flyd run --record`); None without views or before
        the bootstrap."""
        if self.descriptor is None or not self.descriptor.views:
            return None
        view = self.descriptor.views[0]
        pixels = self._media.views.get(view.view_id)
        return None if pixels is None else (view, pixels)

    def live_view_handles(self) -> int:
        return self._media.count() + self._pending_media.count()

    @property
    def slots(self) -> Mapping[str, AgentSlot]:
        """Each agent's slot, by id (read-only: only the coordinator changes them)."""
        return self._slots

    @property
    def descriptor_revision(self) -> int:
        return self._descriptor_revision

    def audio_positions(self) -> dict[str, int]:
        """Each declared stream's position (what a capture records)."""
        return self._audio.positions()

    def issued_events(self) -> int:
        """The task events of the traced transitions (their `eventIds`): a running count."""
        return self.trace.events()

    def participants(self) -> list[str]:
        """The environment, then the agents by id (the order of stages and activations)."""
        return [self.world_id, *self.agent_ids]

    def bindings(self) -> list[tuple[str, str]]:
        """`(portId, agentId)` in agent order."""
        return [(self._slots[a].spec.port_id, a) for a in self.agent_ids]

    def tainted(self) -> list[str]:
        """Workers that took part in an abandoned install (state.md §7.4), environment first."""
        return [w for w in self.participants() if w in self._tainted]

    def was_replaced(self, worker_id: str) -> bool:
        """Whether `worker_id` was replaced since the last successful install or bootstrap."""
        return worker_id in self._replaced

    def epoch_used(self, epoch: str) -> bool:
        """Whether this session ever ran, or tried to install, `epoch`."""
        return epoch in self._used_epochs

    def durable(self) -> tuple[str, int] | None:
        """The newest checkpoint known durable: `(checkpointId, boundary)`."""
        return self._durable

    def status_json(self) -> dict[str, Any]:
        """Phase, fence, stats, evaluations and metrics as camelCase JSON (§6.11)."""
        last_failure = self._calls.last_failure
        return {"phase": self._machine.phase.label, "fenced": self._machine.fenced,
                "committedBoundary": self._machine.committed_boundary(),
                "stats": self.stats.to_json(), "evaluations": self.task.evaluations(),
                "metrics": self.metrics.to_json(),
                "lastFailure": None if last_failure is None else str(last_failure)}

    def refs(self) -> dict[str, WorkerRef]:
        return dict(self._calls.refs)

    def pause_handle(self) -> PauseHandle:
        return self._pause

    def disable_pacing(self) -> None:
        self._pacing = None

    # ------------------------------------------------------------------ fence (§6.3)

    def _drop_uncommitted(self) -> None:
        """What a failed epoch forgets (the call engine's `on_fail`): owed acknowledgements,
        the in-flight transition and the decoded media."""
        self._owed.clear()
        for slot in self._slots.values():
            slot.prepared = None
            slot.decision = None
            slot.prepare_request = None
            slot.commit_request = None
        self._set_media(committed=Media(), pending=Media())
        self._calls.drop_received()

    def _set_media(self, *, committed: Media | None = None, pending: Media | None = None) -> None:
        """Replace the committed and/or the in-flight media, dropping the holds on artifacts
        (docs/topics.md §14.2 rule 5) that neither of them keeps any more."""
        old = (self._media, self._pending_media)
        if committed is not None:
            self._media = committed
        if pending is not None:
            self._pending_media = pending
        keep = set(self._media.held) | set(self._pending_media.held)
        self._calls.drop([a for media in old for a in media.held if a not in keep])

    def fence_now(self, message: str) -> None:
        """Close the fence from outside, synchronously (a lost lease, distribution.md §5.5
        step 2): nothing more is dispatched. Unlike a failed step it raises nothing here; the
        next `step()` refuses. Already fenced: no change."""
        if self._machine.fenced:
            return
        with contextlib.suppress(SessionFailure):
            self._calls.fail(DomainError.before(ErrorCode.INVALID_PHASE, message), Detail.FENCED)

    def health_failure(self, worker_id: str, error: DomainError) -> SessionFailure | None:
        """A supervisor's report (§7.4): fail the epoch (detail `health`) unless already
        fenced; returns the failure recorded, or None when the epoch was already fenced."""
        if self._machine.fenced:
            return None
        try:
            self._calls.fail(error, Detail.HEALTH, worker_id)
        except SessionFailure as failure:
            return failure

    def replace_participant(self, worker_id: str, ref: WorkerRef) -> None:
        if worker_id not in self._calls.refs:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH, f"no participant {worker_id}")
        check_replacement(self._machine, worker_id)
        self._calls.replace(worker_id, ref)
        self._replaced.add(worker_id)
        self._tainted.discard(worker_id)
        self.audit.add(f"replaced:{worker_id}")

    async def replace_client(self, client: BusClient) -> None:
        """Swap in the new client and close the old one here, within the probe deadline (its
        connection is already lost, so closing only fails what is still pending on it)."""
        if not self._machine.fenced:
            raise DomainError.before(ErrorCode.INVALID_PHASE,
                                     "replace_client needs a fenced epoch")
        old = self._calls.replace_client(client)
        if old is not client:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.deadlines.probe):
                    await old.close()

    def _scope(self, step: int) -> Scope:
        return Scope(self.spec.session_id, self.epoch, step)

    # ------------------------------------------------------------------ bootstrap (§6.5)

    async def bootstrap(self) -> None:
        self._calls.refuse_if_fenced()
        await self._calls.guarded(self._bootstrap)

    async def _bootstrap(self) -> None:
        calls, audit, wid = self._calls, self.audit, self.world_id
        session_id = self.spec.session_id
        capabilities = await hello(calls, session_id, wid, "environment", "world-step-v1")
        self.structured_input = STRUCTURED_OBSERVATION in capabilities
        audit.add(f"hello:{wid}")
        for agent_id in self.agent_ids:
            await hello(calls, session_id, agent_id, "agent", "agent-step-v1")
            audit.add(f"hello:{agent_id}")
        # 2. Environment.Initialize
        world = await initialize_environment(calls, self.spec, self._scope(0), self.bindings())
        self.descriptor = world.descriptor
        self.observation = observation = world.observation
        self._set_media(committed=world.media)
        self._audio = AudioTimelines.fresh(world.descriptor)
        self._owed.setdefault(wid, []).append(world.request_id)
        audit.add("environment.initialize")
        # 3. task bootstrap
        boot = bootstrap_task(self.task, observation, self.bindings(), self.agent_ids,
                              self.spec.task.impl)
        self._progress = boot.progress
        self._last_event_ids = [e.id for e in boot.events]
        for agent_id in self.agent_ids:
            slot = self._slots[agent_id]
            slot.context = boot.contexts[agent_id]
            slot.context_digest = typed_digest(slot.context)
        audit.add("task.bootstrap")
        # 4. agents
        for agent_id in self.agent_ids:
            request_id = await initialize_agent(calls, self._scope(0), agent_id,
                                                self._slots[agent_id], observation,
                                                self.structured_input)
            self._owed.setdefault(agent_id, []).append(request_id)
            audit.add(f"agent.initialize:{agent_id}")
        self._replaced.clear()
        # 5. acknowledge
        await acknowledge_lifecycle(calls, self._owed, [wid, *self.agent_ids],
                                    self.injections.duplicate_lifecycle_acknowledge,
                                    self.injection_log)
        self._owed.clear()
        audit.add("acknowledge.lifecycle")
        # 6. Ready(0)
        calls.move(Ready(0), Detail.STEP)
        if self._pacing is not None:
            self._pacing.restart()
        self._publish_descriptor()
        self._publish_snapshot(0)

    async def acknowledge_replies(self, worker_id: str, ids: Sequence[str]) -> list[str]:
        """`Worker.Acknowledge` with the subset rule of §6.5 step 5."""
        result: list[str] = await self._calls.guarded(
            lambda: self._calls.acknowledge(worker_id, ids))
        return result

    # ------------------------------------------------------------------ one transition (§6.6)

    async def run(self, n: int) -> list[StepReport]:
        reports: list[StepReport] = []
        for _ in range(n):
            report = await self.step()
            reports.append(report)
            if report.paused:
                break
        return reports

    async def step(self) -> StepReport:
        calls = self._calls
        calls.refuse_if_fenced()
        phase = self._machine.phase
        if isinstance(phase, Paused) and self.episode_request is not None:
            error = DomainError(ErrorCode.INVALID_PHASE,
                                f"the episode ended ({self.episode_request.reason}); the "
                                "session stays paused until a reset", Mutation.NONE)
            raise SessionFailure(error, phase.label, Detail.EPISODE)
        if not isinstance(phase, Ready):
            calls.fail(DomainError(ErrorCode.INVALID_PHASE,
                                   f"step needs Ready(k); the session is {phase.label}",
                                   Mutation.NONE), Detail.STEP)
        if self.episode_request is not None:
            calls.fail(DomainError(ErrorCode.INVALID_PHASE,
                                   "the episode ended; only a reset starts another",
                                   Mutation.NONE), Detail.EPISODE)
        if self._pacing is not None:
            wait = self._pacing.before_transition()
            self.metrics.lag_ns = self._pacing.lag_ns
            if wait > 0:
                await asyncio.sleep(wait / 1e9)
        started = time.perf_counter()
        report: StepReport = await calls.guarded(lambda: self._transition(phase.step))
        self.metrics.observe("step", time.perf_counter() - started)
        return report

    def _agents_in_order(self) -> list[str]:
        if self.order is DispatchOrder.REVERSED:
            return list(reversed(self.agent_ids))
        return list(self.agent_ids)

    async def _dispatch(self, calls: list[Call], k: int | None,
                        ) -> dict[str, CallOutcome]:
        """Send one call per agent per the dispatch order; kill injections of step `k` run once
        every call was dispatched."""
        outcomes: dict[str, CallOutcome] = {}
        engine = self._calls

        async def one(call: Call) -> None:
            outcomes[call.worker_id] = await engine.send(call, engine.deadline_of(call.method))

        # a kill injection waits one loop pass so that every call has left; a step without one
        # saves that pass
        kills = k is not None and any(step == k for _, step in self.injections.kill_at)
        async with asyncio.TaskGroup() as tg:
            if self.order is DispatchOrder.CONCURRENT:
                for call in calls:
                    tg.create_task(one(call))
                if kills:
                    assert k is not None
                    await asyncio.sleep(0)
                    await kill_injection(self.injections, k, self.injection_log)
            else:
                for index, call in enumerate(calls):
                    task = tg.create_task(one(call))
                    if index == len(calls) - 1 and kills:
                        assert k is not None
                        await asyncio.sleep(0)
                        await kill_injection(self.injections, k, self.injection_log)
                    await task
        return outcomes

    async def _transition(self, k: int) -> StepReport:
        wall = time.monotonic_ns()
        assert self.descriptor is not None and self.observation is not None
        descriptor = self.descriptor
        old = self.observation
        scope = self._scope(k)
        engine = self._calls
        # A. Prepare
        engine.move(Preparing(k), Detail.STEP)
        interval = descriptor.step_duration.to_json()  # one JSON value shared by every call
        calls = [engine.new_call(a, "Agent.Prepare", scope, {
            "agentId": a, "profileDigest": self._slots[a].profile["digest"],
            "interval": interval,
            "decisionContextDigest": self._slots[a].context_digest,
            "preStepStimulations": []}) for a in self._agents_in_order()]
        by_agent = {c.worker_id: c for c in calls}
        outcomes = await self._dispatch(calls, k)
        for agent_id in self.agent_ids:
            call = by_agent[agent_id]
            try:
                result = await engine.settle(call, outcomes[agent_id])
                if result.get("agentId") != agent_id:
                    raise identity_mismatch(f"Agent.Prepare: the decision names "
                                            f"{result.get('agentId')}, expected {agent_id}")
                decision = TypedValue.from_json(result["decision"])
                want = self.executor.decision_schema
                if decision.schema != want:
                    raise identity_mismatch(f"Agent.Prepare: {agent_id} decided in schema "
                                            f"{decision.schema.id} v{decision.schema.version}, "
                                            f"not the executor's {want.id} v{want.version}")
            except DomainError as exc:
                raise Blame(exc, "Agent.Prepare", agent_id) from None
            slot = self._slots[agent_id]
            slot.prepared = result
            slot.decision = decision
            slot.prepare_request = call.request_id
            self.audit.add(f"prepared:{agent_id}@{k}")
            self.stats.prepares += 1
        if self.injections.at_step == k and self.injections.duplicate_prepare is not None:
            await duplicate(engine, by_agent[self.injections.duplicate_prepare],
                            self._slots[self.injections.duplicate_prepare].prepared,
                            "duplicate-prepare", self.injection_log)
        # B. Apply
        engine.move(Applying(k), Detail.STEP)
        assert self._progress is not None
        controls = controls_for(scope, descriptor, self.agent_ids, self._slots, self.executor,
                                self._progress, old)
        wire_controls = [c.to_json() for c in controls]
        self._controls_digest = controls_digest(wire_controls)
        batch_id = f"batch-{self.epoch}-{k}"
        self.audit.add(f"advance:{k}")
        advance = engine.new_call(self.world_id, "Environment.Advance", scope, {
            "batchId": batch_id, "controls": wire_controls})
        try:
            if k in self.injections.lose_advance_result_at:
                step_result = await lose_advance_result(engine, advance, batch_id, self.world_id,
                                                        self.injection_log)
            else:
                step_result = await engine.call(advance)
        except DomainError as exc:
            raise Blame(exc, "Environment.Advance", self.world_id) from None
        # C. Observe
        engine.move(Observing(k + 1), Detail.STEP)
        received = engine.take_attachments(advance)
        try:
            attached = open_attached(engine.client, received) if received else None
            new, media = check_advance(k, step_result, batch_id, self._controls_digest,
                                       descriptor, old, self._audio, self.world_id, attached)
        except BaseException:
            engine.drop([a.artifact_id for a in received])
            raise
        media.held = tuple(a.artifact_id for a in received)
        self._set_media(pending=media)
        if self.injections.at_step == k:
            await advance_injections(engine, self.injections, advance, step_result, descriptor,
                                     media.views, self.injection_log)
        try:
            evaluation = self.task.evaluate_transition(scope, old.inspection, new.inspection,
                                                       controls)
            for agent_id in self.agent_ids:
                if agent_id not in evaluation.outcomes or agent_id not in \
                        evaluation.next_contexts:
                    raise backend_failure(f"the task's evaluation misses {agent_id}")
            check_evaluation(evaluation, self.spec.task.impl, self.agent_ids)
        except Exception as exc:
            raise Blame(task_error(exc, self.spec.task.impl), Detail.TASK_EVALUATE,
                        None) from None
        self.audit.add(f"evaluate:{k}")
        # D. Commit
        engine.move(Committing(k), Detail.STEP)
        commits, telemetry, inputs = await self._commit(k, scope, new, evaluation)
        # E. Ready(k+1)
        engine.move(Ready(k + 1), Detail.STEP)
        for agent_id in self.agent_ids:
            slot = self._slots[agent_id]
            slot.context = evaluation.next_contexts[agent_id]
            # checked equal to typed_digest(slot.context) by _commit
            slot.context_digest = commits[agent_id]["decisionContextDigest"]
            slot.telemetry = telemetry[agent_id]
            slot.committed_step = k + 1
            slot.last_decision = slot.decision
        by_port = {self._slots[a].spec.port_id: self._slots[a] for a in self.agent_ids}
        for control in controls:
            bound = by_port.get(control.port_id)
            if bound is not None:
                bound.last_controls = control
        self.observation = new
        self.last_evaluation = evaluation
        self._set_media(committed=self._pending_media, pending=Media())
        self._audio.advance(new.audio)
        self._progress = evaluation.progress
        self.stats.advances += 1
        self._last_event_ids = [e.id for e in evaluation.events]
        behaviour, operational = transition_records(
            scope, self.agent_ids, self._slots, batch_id, self._controls_digest, new, evaluation,
            commits, advance.request_id, wall, inputs)
        try:
            self.trace.record(behaviour, operational)
        except DomainError as exc:
            raise Blame(exc, Detail.PUBLISH, None) from None
        self._last_transition = (k, new, evaluation)
        self._append_effect()
        self._publish_snapshot(k + 1, observed=True)
        for slot in self._slots.values():
            slot.prepared = None
            slot.decision = None
            slot.prepare_request = None
            slot.commit_request = None
        # F. episode and pause
        if evaluation.episode is not None:
            self.episode_request = evaluation.episode
        paused = False
        if self._pause.is_set() or self.episode_request is not None:
            engine.move(Paused(k + 1), Detail.STEP)
            self._pause.clear()
            self.audit.add(f"pause:{k + 1}")
            paused = True
        return StepReport(k + 1, paused, self.episode_request is not None)

    async def _commit(self, k: int, scope: Scope, new: WorldObservation, evaluation: Evaluation,
                      ) -> tuple[dict[str, dict[str, Any]], dict[str, Telemetry],
                                 dict[str, str | None]]:
        """Commit every agent: the results, their parsed telemetry and the digest of the
        structured input each was sent (the behaviour record's `inputDigests`), by agent."""
        engine = self._calls
        calls: list[Call] = []
        # every agent receives the same views (one JSON value shared by every call) and its
        # own structured input (flyd.session.inputs)
        try:
            inputs = sensory_inputs(new, self.bindings(), self.structured_input, k + 1,
                                    Mutation.APPLIED)
        except DomainError as exc:
            raise Blame(exc, Detail.COMMIT, self.world_id) from None
        # the behaviour record's inputDigests: each agent's structured input as sent (its
        # canonical bytes are kept on the value; a shared inspection is hashed once)
        digests: dict[str, str | None] = {}
        hashed: dict[int, str] = {}
        for agent_id in self.agent_ids:
            value = inputs.structured[agent_id]
            if value is not None and id(value) not in hashed:
                hashed[id(value)] = typed_digest(value)
            digests[agent_id] = None if value is None else hashed[id(value)]
        for agent_id in self._agents_in_order():
            slot = self._slots[agent_id]
            outcome = evaluation.outcomes[agent_id]
            assert slot.prepare_request is not None
            calls.append(engine.new_call(agent_id, "Agent.Commit", scope, {
                "agentId": agent_id, "preparedRequestId": slot.prepare_request,
                "nextInput": inputs.json[agent_id],
                "nextDecisionContext": evaluation.next_contexts[agent_id].to_json(),
                "rewards": [r.to_json() for r in outcome.rewards],
                "taskStimulations": [s.to_json() for s in outcome.stimulations]},
                attachments=inputs.attachments[agent_id]))
        results: dict[str, dict[str, Any] | DomainError] = {}
        telemetry: dict[str, Telemetry] = {}

        async def one(call: Call) -> None:
            agent_id = call.worker_id
            try:
                result = await engine.call(call)
                if result.get("committedStep") != str(k + 1):
                    raise backend_failure(f"Agent.Commit: {agent_id} committed "
                                          f"{result.get('committedStep')}, expected {k + 1}")
                want = typed_digest(evaluation.next_contexts[agent_id])
                if result.get("decisionContextDigest") != want:
                    raise identity_mismatch(f"Agent.Commit: {agent_id} holds context "
                                            f"{result.get('decisionContextDigest')}, "
                                            f"expected {want}")
                parsed = Telemetry.from_json(result["telemetry"])
                parsed.check_rates(self._slots[agent_id].graph or Graph.from_json(None))
                telemetry[agent_id] = parsed
                results[agent_id] = result
            except DomainError as exc:
                results[agent_id] = exc

        async with asyncio.TaskGroup() as tg:
            for call in calls:
                task = tg.create_task(one(call))
                if self.order is not DispatchOrder.CONCURRENT:
                    await task
        for agent_id in self.agent_ids:
            got = results[agent_id]
            if isinstance(got, DomainError):
                raise Blame(got, Detail.COMMIT, agent_id)
        out: dict[str, dict[str, Any]] = {}
        request_ids = {c.worker_id: c.request_id for c in calls}
        for agent_id in self.agent_ids:
            got = results[agent_id]
            assert not isinstance(got, DomainError)
            out[agent_id] = got
            self._slots[agent_id].commit_request = request_ids[agent_id]
            self.audit.add(f"committed:{agent_id}@{k}")
            self.stats.commits += 1
        if self.injections.at_step == k and self.injections.duplicate_commit is not None:
            agent_id = self.injections.duplicate_commit
            call = next(c for c in calls if c.worker_id == agent_id)
            await duplicate(engine, call, out[agent_id], "duplicate-commit", self.injection_log)
        return out, telemetry, digests

    # ------------------------------------------------------------------ publication (§6.9)

    def _publish_descriptor(self) -> None:
        assert self.descriptor is not None
        self._descriptor_revision += 1
        body = descriptor_body(
            self.spec.session_id, self.epoch, self._descriptor_revision, self.descriptor,
            [(a, self._slots[a]) for a in self.agent_ids], self._progress)
        self.snapshots.publish_descriptor(body)
        if self.publisher is not None:
            self.publisher.descriptor(self._calls.client, body)
        self.audit.add("publish:descriptor")

    def _publish_snapshot(self, b: int, *, observed: bool = False) -> None:
        """Publish boundary `b`. `observed`: a transition's Phase C already checked this
        observation's boundary and view steps (`_observe`), and the ports are bound at bootstrap,
        so `check_publication` would repeat those checks; bootstrap and restore ask for it."""
        assert self.observation is not None and self.descriptor is not None
        try:
            if not observed:
                check_publication(self.descriptor, self.observation,
                                  [self._slots[a].spec.port_id for a in self.agent_ids], b)
        except DomainError as exc:
            raise Blame(exc, Detail.PUBLISH, None) from None
        fresh = b > 0
        # the boundary's values, all immutable: the body is built from them only when read
        agents: list[AgentValues] = [
            (agent_id, slot.telemetry, slot.last_decision if fresh else None,
             slot.last_controls if fresh else None)
            for agent_id, slot in ((a, self._slots[a]) for a in self.agent_ids)]
        body = functools.partial(
            snapshot_body, self._descriptor_revision, self._scope(b), self.spec.episode_id,
            self._snapshot_sequence, self.observation, agents, self._progress,
            tuple(self._last_event_ids))
        self.snapshots.publish_snapshot_on_read(body)
        self._snapshot_sequence += 1
        if self.publisher is not None:
            evaluation = self.last_evaluation if observed else None
            # the snapshot rides along only when large media are by reference (run_topic)
            by_reference = any_by_reference(self.observation)
            self.publisher.boundary(
                self._calls.client, b, self.observation.world_time,
                {} if evaluation is None else
                {a: evaluation.outcomes[a].rewards for a in self.agent_ids},
                self._last_event_ids, body() if by_reference else None,
                referenced_artifacts(self.observation.sensory_views, self.observation.audio)
                if by_reference else ())
        self.audit.add(f"publish:{b}")
        self.stats.publications += 1

    # ------------------------------------------------------------------ capture (state.md §5.7)

    async def capture(self, checkpoint_id: str, *, kind: CaptureKind = "durable") -> Capture:
        """Every participant's state and the coordinator's ledgers at the committed boundary
        (`flyd.session.capture`)."""
        return await capture_boundary(self, self._calls, checkpoint_id, kind=kind)

    async def save(self, checkpoint_id: str, *, kind: CaptureKind = "durable") -> SaveTicket:
        """`capture` through the session's writer (state.md §5.7 steps 2 and 7,
        `flyd.session.capture.save`): the ticket."""
        return await save_capture(self, self._calls, self._writer(), checkpoint_id, kind=kind)

    async def await_durable(self, ticket: SaveTicket, budget: float | None = None
                            ) -> SaveOutcome:
        """The save's outcome (state.md §5.5), audited; `Committed` moves the durable mark."""
        writer = self._writer()
        outcome = await writer.wait(ticket, self.deadlines.durable if budget is None
                                    else budget)
        self.audit.add(audit_line(outcome, ticket.boundary))
        if isinstance(outcome, Committed):
            self._adopt_durable(outcome.checkpoint_id, outcome.boundary)
        return outcome

    async def checkpoint(self, checkpoint_id: str, *, kind: CaptureKind = "durable"
                         ) -> SaveOutcome:
        """`save` then `await_durable`."""
        return await self.await_durable(await self.save(checkpoint_id, kind=kind))

    async def resolve_durable(self, checkpoint_id: str) -> CheckpointRecord | None:
        """A lost or late save reply, resolved by id (state.md §4.6): the stored record, adopted
        as the durable mark when newer; None when it is not stored (nothing changes)."""
        if self.state is None:
            raise DomainError.before(ErrorCode.UNSUPPORTED, "this session has no checkpoint store")
        record = await self.state.store.lookup(self.state.run_id, checkpoint_id)
        if record is None:
            return None
        self._adopt_durable(record.checkpoint_id, record.boundary)
        self.audit.add(f"resolved:{record.checkpoint_id}@{record.boundary}")
        return record

    def _writer(self) -> CheckpointWriter:
        if self.state is None or self.state.writer is None:
            raise DomainError.before(ErrorCode.UNSUPPORTED,
                                     "this session has no checkpoint writer")
        return self.state.writer

    def _adopt_durable(self, checkpoint_id: str, boundary: int) -> None:
        if self._durable is None or boundary >= self._durable[1]:
            self._durable = (checkpoint_id, boundary)

    def effect_records(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The last transition's behaviour record and result, rebased onto `e1` (state.md
        §9.2): what its ledger row holds (`flyd.session.records`)."""
        if self._last_transition is None:
            raise DomainError(ErrorCode.INTERNAL, "no transition has committed in this epoch",
                              Mutation.NONE)
        k, new, evaluation = self._last_transition
        record = self.trace.transitions[-1].behaviour
        if self.epoch == FIRST_EPOCH:
            return dict(record), result_record(k, self.agent_ids, new, evaluation, {})
        rebase = EpochRebase(self.epoch, FIRST_EPOCH, self.task)
        ids = rebase.id_map(k)
        return (rebase.apply(record, ids),
                result_record(k, self.agent_ids, new, evaluation, ids))

    def _append_effect(self) -> None:
        """§9.2: the last transition k → k+1's records, pending under k+1."""
        writer = None if self.state is None else self.state.writer
        if writer is None:
            return
        assert self._last_transition is not None
        record, result = self.effect_records()
        writer.pending.append(self._last_transition[0] + 1, self.epoch, record, result)

    # ------------------------------------------------------------------ restore (state.md §7)

    async def restore(self, checkpoint_id: str | None, proposed_epoch: str, *,
                      store: CheckpointStore | None = None, run_id: int | None = None,
                      guard: Callable[[], object] | None = None) -> RestoreReport:
        """The group install of a stored generation (the head for None) into `proposed_epoch`
        (`flyd.session.restore`). `store` and `run_id` default to the session's `StateContext`;
        `guard` is the node's lease guard (precondition 4)."""
        context = self.state
        if store is not None and run_id is not None:
            context = StateContext(store, run_id,
                                   writer=None if context is None else context.writer,
                                   guard=guard if guard is not None or context is None
                                   else context.guard)
        elif context is not None and guard is not None:
            context = replace(context, guard=guard)
        calls = self._calls
        if context is None:
            raise SessionFailure(DomainError.before(
                ErrorCode.UNSUPPORTED, "this session has no checkpoint store"),
                self._machine.phase.label, Detail.RESTORE)
        plan = await prepare(self, calls, checkpoint_id, proposed_epoch, context)
        k, old_epoch = plan.k, self.epoch
        calls.move(Restoring(k), Detail.RESTORE)
        self._used_epochs.add(proposed_epoch)
        try:
            installed = await install(plan, context)
        except InstallAborted as abort:
            self._tainted.update(abort.tainted)
            calls.fail(abort.error, Detail.RESTORE, abort.participant)
        except BaseException:  # cancelled or a flyd bug: never leave a half install unfenced
            self._tainted.update(plan.tainted)
            if not isinstance(self._machine.phase, Failed):
                with contextlib.suppress(SessionFailure):
                    calls.fail(backend_failure("the restore was interrupted half-way"),
                               Detail.RESTORE)
            raise
        self._adopt(installed)
        report = installed.report
        self.events.append(recovered(self.spec.session_id, old_epoch, report))
        self._publish_descriptor()
        self.audit.add(f"descriptor-revision:{self._descriptor_revision}")
        self._publish_snapshot(k)
        calls.move(Paused(k), Detail.RESTORE)
        self.audit.add(f"restored:{report.checkpoint_id}@{k}:{proposed_epoch}")
        return report

    def _adopt(self, installed: Installed) -> None:
        """Make an install's state the session's (state.md §7.2 steps 8–10)."""
        k = installed.boundary
        for agent_id, agent in installed.agents.items():
            slot = self._slots[agent_id]
            slot.context = agent.context
            slot.context_digest = agent.context_digest
            slot.graph = agent.graph
            slot.telemetry = agent.telemetry
            slot.tick_duration = agent.tick_duration
            slot.warmup_ticks = agent.warmup_ticks
            slot.committed_step = k
            slot.last_decision = None
            slot.last_controls = None
        self._progress = installed.progress
        self._last_transition = None
        self.episode_request = None
        self._last_event_ids = []
        self.observation = installed.observation
        self.last_evaluation = None
        self._set_media(committed=installed.media, pending=Media())
        self._audio = installed.audio
        self._durable = installed.durable
        self.epoch = installed.epoch
        self._tainted.clear()
        self._replaced.clear()

    def reset(self) -> None:
        """An episode reset: not in v1 (a terminal episode ends a node run, state.md §9.3)."""
        raise DomainError.before(ErrorCode.UNSUPPORTED,
                                 "episode reset is not supported in v1; a terminal episode ends "
                                 "the run")

    # ------------------------------------------------------------------ pause and resume (§6.7)

    def resume(self) -> None:
        phase = self._machine.phase
        if not isinstance(phase, Paused):
            self._calls.fail(DomainError(ErrorCode.INVALID_PHASE,
                                         f"resume needs Paused(k); the session is {phase.label}",
                                         Mutation.NONE), Detail.RESUME)
        self._calls.move(Ready(phase.step), Detail.RESUME)
        if self._pacing is not None:
            self._pacing.restart()

    # ------------------------------------------------------------------ status and probes

    async def worker_status(self, worker_id: str, ref: WorkerRef | None = None) -> dict[str, Any]:
        """`Worker.Status` through the full `check_reply`; any failure fails the epoch."""
        boundary = self._machine.committed_boundary()
        scope = None if boundary is None else self._scope(boundary)
        calls = self._calls
        call = calls.new_call(worker_id, "Worker.Status", scope, {}, ref)
        result: dict[str, Any] = await calls.guarded(lambda: calls.blamed(call))
        return result

    async def probe_raw(self, worker_id: str, method: str, scope: Scope | None,
                        params: dict[str, Any], ref: WorkerRef | None = None) -> dict[str, Any]:
        """One request with a fresh serial (`CallEngine.probe`); session state untouched."""
        return await self._calls.probe(worker_id, method, scope, params, ref)
