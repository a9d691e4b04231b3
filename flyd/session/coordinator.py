"""The session coordinator (design/session.md §6): the session's state between boundaries, and the
order of its phases.

One `Coordinator` per session, an asyncio object on the node's loop with its own bus connection.
The task and the action executor are local objects; agents and the world are bus services
reached through pinned `WorkerRef`s. The parts with rules of their own are modules it calls:
every call and every failure of the epoch go through its `CallEngine` (`calls`,
`flyd.session.calls`, design/session.md §6.3, §6.4, §6.8), bootstrap's checks are
`flyd.session.bootstrap` (design/session.md §6.5), one transition up to its commit
`flyd.session.transition` (design/session.md §6.6), publication `flyd.session.publication`
(design/session.md §6.9), injections the `Injections` hook (design/session.md §6.13), capture
`flyd.session.capture` (design/state.md §5.7) and restore `flyd.session.restore`
(design/state.md §7). Those read the coordinator's public side and return what they learnt; the
coordinator adopts it.

API (design/session.md §6.1): `bootstrap()`, `step()`, `run(n)`, `pause_handle()`, `resume()`, the
probes (`probe_raw`, `worker_status`, `acknowledge_replies`), `replace_participant`,
`replace_client`, `set_deadlines`, `disable_pacing`; `capture`, `save`, `restore`, `reset`
(design/state.md §5.7, §7). Each agent's model profile is handed in (`profiles`, read by the grant);
without it the coordinator reads them itself (`flyd.session.profiles`). The decisions taken where
design/session.md §6 is silent are listed in docs/coordinator.md ("Decisions"); the ones a reader of
this class needs:
- `step()` at `Paused(k)` with a stored episode request raises `SessionFailure`
  (`INVALID_PHASE`/`none`, detail `episode`) *without* failing the epoch: design/session.md §6.7
  says the session stays paused until a reset. Without an episode request, a step from `Paused`
  fails the epoch (detail `step`), as does any step from a phase other than `Ready`.
- A `BACKEND_FAILURE` seen while the coordinator's own connection is closed gets detail `router`
  (participant: the worker whose call was pending).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from bus.client import BusClient
from flyd.launch.identities import WorkerRef
from flyd.session.audio import AudioTimelines
from flyd.session.audit import AuditLog
from flyd.session.bootstrap import (
    acknowledge_lifecycle,
    bootstrap_task,
    hello,
    initialize_agent,
    initialize_environment,
)
from flyd.session.calls import Blame, CallEngine, Deadlines, backend_failure
from flyd.session.capture import Capture, CaptureKind
from flyd.session.capture import capture as capture_boundary
from flyd.session.capture import save as save_capture
from flyd.session.fence import Detail, SessionFailure, check_replacement
from flyd.session.injections import InjectionOutcome, Injections
from flyd.session.media import HeldMedia, Media
from flyd.session.pacing import SYSTEM_CLOCK, Clock, Pacing
from flyd.session.phase import Failed, Paused, Phase, PhaseMachine, Ready, Restoring
from flyd.session.profiles import model_profiles
from flyd.session.publication import AgentValues, Feed, Publisher, check_publication
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
from flyd.session.stats import Metrics, Stats
from flyd.session.stepping import History, PauseHandle, StepReport
from flyd.session.trace import EpochRebase, TraceLog
from flyd.session.transition import DispatchOrder, NextBoundary, Transition
from flyd.state.checkpoints import CheckpointRecord, CheckpointStore
from flyd.state.writer import CheckpointWriter, Committed, SaveOutcome, SaveTicket, audit_line
from workers.protocols import (
    STRUCTURED_OBSERVATION,
    ActionExecutor,
    EpisodeRequest,
    Evaluation,
    Task,
)
from workers.types.canonical import typed_digest
from workers.types.datatypes import (
    EnvironmentDescriptor,
    TypedValue,
    ViewDescriptor,
    WorldObservation,
)
from workers.types.domain import DomainError, ErrorCode, Mutation, Scope

__all__ = ["FIRST_EPOCH", "Coordinator"]

#: The epoch every ledger row is rebased onto (design/state.md §9.2).
FIRST_EPOCH: Final = "e1"

class Coordinator:
    """One session's coordinator (design/session.md §6): it owns the phase machine and runs the
    bootstrap, each transition's transaction, the resolution of uncertain calls and the fence
    over the workers' bus services."""

    def __init__(self, spec: RunSpec, client: BusClient, refs: Mapping[str, WorkerRef], *,
                 task: Task, executor: ActionExecutor, deadlines: Deadlines | None = None,
                 order: DispatchOrder = DispatchOrder.CONCURRENT,
                 injections: Injections | None = None, clock: Clock = SYSTEM_CLOCK,
                 state: StateContext | None = None, epoch: str = "e1",
                 history: History | None = None,
                 publisher: RunPublisher | None = None,
                 profiles: Mapping[str, dict[str, Any]] | None = None,
                 pause: PauseHandle | None = None) -> None:
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
        #: a pause request, honoured at the next boundary (design/session.md §6.7); its caller holds
        #: the handle
        self._pause = pause or PauseHandle()
        self._pacing: Pacing | None = None
        if spec.pace_s is not None:
            self._pacing = Pacing.fixed(spec.pace_s, clock)
        elif spec.pacing == "realtime":
            self._pacing = Pacing(spec.world.step, clock)
        self.audit = AuditLog(limit=bound.entries)
        self.stats = Stats()
        self.metrics = Metrics(window=bound.entries)
        #: every call and every failure of the epoch; probes (design/session.md §6.13 `probe_raw` is
        #: `calls.probe`) and the deadlines in force (`calls.deadlines`) too
        self.calls = CallEngine(client, refs, deadlines or Deadlines(), self._machine,
                                audit=self.audit, stats=self.stats, metrics=self.metrics,
                                on_fail=self._drop_uncommitted)
        self.trace = TraceLog(phase_source=self._machine.phase_path, keep=bound.transitions,
                              horizon=bound.horizon)
        self.snapshots = Feed()
        #: the feed and, for a node's run (`publisher`), the run topic
        self.publication = Publisher(self.snapshots, publisher, lambda: self.calls.client)
        if publisher is not None:
            publisher.bind(self.stats)
        self.episode_request: EpisodeRequest | None = None
        self.descriptor: EnvironmentDescriptor | None = None
        self.observation: WorldObservation | None = None
        #: the task's verdict on the last committed transition (None before the first one and
        #: after a restore); kept by reference for observers of the run (`flyd.session.sample`)
        self.last_evaluation: Evaluation | None = None
        #: the committed boundary's decoded media and the in-flight transition's
        self.media = HeldMedia(self.calls.drop)
        self._audio = AudioTimelines([])
        self._tainted: set[str] = set()
        self._replaced: set[str] = set()
        self._used_epochs: set[str] = {epoch}
        self._durable: tuple[str, int] | None = None
        self.events: list[dict[str, Any]] = []
        self._progress: TypedValue | None = None
        self._last_transition: tuple[int, WorldObservation, Evaluation] | None = None
        self._last_event_ids: list[str] = []
        self._slots: dict[str, AgentSlot] = {}
        #: the world offers its inspection as structured input (learnt at bootstrap)
        self.structured_input = False
        profiles = model_profiles(spec) if profiles is None else profiles
        for agent in spec.agents:
            self._slots[agent.agent_id] = AgentSlot(
                spec=agent, profile=dict(profiles[agent.agent_id]),
                seed=spec.seed_of(agent.agent_id), model_config=dict(agent.model_config))

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
        return self.calls.last_failure

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
        pixels = self.media.committed.views.get(view.view_id)
        return None if pixels is None else (view, pixels)

    @property
    def slots(self) -> Mapping[str, AgentSlot]:
        """Each agent's slot, by id (read-only: only the coordinator changes them)."""
        return self._slots

    @property
    def descriptor_revision(self) -> int:
        return self.publication.revision

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
        """Workers that took part in an abandoned install (design/state.md §7.4), environment
        first."""
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

    def refs(self) -> dict[str, WorkerRef]:
        return dict(self.calls.refs)

    def disable_pacing(self) -> None:
        self._pacing = None

    # ---------------------------------------------------- design/session.md §6.1's probes and knobs

    def pause_handle(self) -> PauseHandle:
        """The pause request (design/session.md §6.7), safe from any task or thread."""
        return self._pause

    def set_deadlines(self, deadlines: Deadlines) -> None:
        self.calls.deadlines = deadlines

    @property
    def injection_log(self) -> list[InjectionOutcome]:
        return self.injections.log

    def live_view_handles(self) -> int:
        return self.media.count()

    async def worker_status(self, worker_id: str, ref: WorkerRef | None = None) -> dict[str, Any]:
        """`Worker.Status` at the committed scope through the full `check_reply`; any failure
        fails the epoch."""
        boundary = self._machine.committed_boundary()
        return await self.calls.status(worker_id, None if boundary is None
                                       else self._scope(boundary), ref)

    async def acknowledge_replies(self, worker_id: str, ids: list[str]) -> list[str]:
        """`Worker.Acknowledge` with the subset rule of design/session.md §6.5 step 5; any failure
        fails the epoch."""
        result: list[str] = await self.calls.guarded(lambda: self.calls.acknowledge(worker_id, ids))
        return result

    async def probe_raw(self, worker_id: str, method: str, scope: Scope | None,
                        params: dict[str, Any], ref: WorkerRef | None = None) -> dict[str, Any]:
        """One request with a fresh serial (`CallEngine.probe`); session state untouched."""
        return await self.calls.probe(worker_id, method, scope, params, ref)

    # --------------------------------------------------------------- fence (design/session.md §6.3)

    def _drop_uncommitted(self) -> None:
        """What a failed epoch forgets (the call engine's `on_fail`): the in-flight transition
        and the decoded media."""
        for slot in self._slots.values():
            slot.clear_in_flight()
        self.media.replace(committed=Media(), pending=Media())
        self.calls.drop_received()

    def fence_now(self, message: str) -> None:
        """Close the fence from outside, synchronously (a lost lease, design/distribution.md §5.5
        step 2): nothing more is dispatched. Unlike a failed step it raises nothing here; the
        next `step()` refuses. Already fenced: no change."""
        if self._machine.fenced:
            return
        with contextlib.suppress(SessionFailure):
            self.calls.fail(DomainError.before(ErrorCode.INVALID_PHASE, message), Detail.FENCED)

    def health_failure(self, worker_id: str, error: DomainError) -> SessionFailure | None:
        """A supervisor's report (design/session.md §7.4): fail the epoch (detail `health`) unless
        already fenced; returns the failure recorded, or None when the epoch was already fenced."""
        if self._machine.fenced:
            return None
        try:
            self.calls.fail(error, Detail.HEALTH, worker_id)
        except SessionFailure as failure:
            return failure

    def replace_participant(self, worker_id: str, ref: WorkerRef) -> None:
        if worker_id not in self.calls.refs:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH, f"no participant {worker_id}")
        check_replacement(self._machine, worker_id)
        self.calls.replace(worker_id, ref)
        self._replaced.add(worker_id)
        self._tainted.discard(worker_id)
        self.audit.add(f"replaced:{worker_id}")

    async def replace_client(self, client: BusClient) -> None:
        """Swap in the new client and close the old one here, within the probe deadline (its
        connection is already lost, so closing only fails what is still pending on it)."""
        if not self._machine.fenced:
            raise DomainError.before(ErrorCode.INVALID_PHASE,
                                     "replace_client needs a fenced epoch")
        old = self.calls.replace_client(client)
        if old is not client:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.calls.deadlines.probe):
                    await old.close()

    def _scope(self, step: int) -> Scope:
        return Scope(self.spec.session_id, self.epoch, step)

    # ----------------------------------------------------------- bootstrap (design/session.md §6.5)

    async def bootstrap(self) -> None:
        self.calls.refuse_if_fenced()
        await self.calls.guarded(self._bootstrap)

    async def _bootstrap(self) -> None:
        calls, audit, wid = self.calls, self.audit, self.world_id
        session_id = self.spec.session_id
        owed: dict[str, list[str]] = {}  # the replies to acknowledge at step 5, by worker
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
        self.media.replace(committed=world.media)
        self._audio = AudioTimelines.fresh(world.descriptor)
        owed.setdefault(wid, []).append(world.request_id)
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
            owed.setdefault(agent_id, []).append(request_id)
            audit.add(f"agent.initialize:{agent_id}")
        self._replaced.clear()
        # 5. acknowledge
        await acknowledge_lifecycle(calls, owed, [wid, *self.agent_ids],
                                    self.injections.duplicate_lifecycle_acknowledge,
                                    self.injections.log)
        audit.add("acknowledge.lifecycle")
        # 6. Ready(0)
        calls.move(Ready(0), Detail.STEP)
        if self._pacing is not None:
            self._pacing.restart()
        self._publish_descriptor()
        self._publish_snapshot(0)

    # ------------------------------------------------------ one transition (design/session.md §6.6)

    async def run(self, n: int) -> list[StepReport]:
        reports: list[StepReport] = []
        for _ in range(n):
            report = await self.step()
            reports.append(report)
            if report.paused:
                break
        return reports

    async def step(self) -> StepReport:
        calls = self.calls
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

    async def _transition(self, k: int) -> StepReport:
        """Phases A to D (`flyd.session.transition`), then E and F here."""
        wall = time.monotonic_ns()
        assert self._progress is not None
        done = await Transition(self, self.calls, k, progress=self._progress, audio=self._audio,
                                stage_media=lambda media: self.media.replace(pending=media)).run()
        self._adopt_transition(done, wall)
        return self._end_of_step(k + 1, done.evaluation.episode)

    def _adopt_transition(self, done: NextBoundary, wall: int) -> None:
        """E: `Ready(k+1)`; the transition's values become the session's, its records are
        traced and appended to the pending effects, and k+1 is published."""
        k = done.scope.step
        self.calls.move(Ready(k + 1), Detail.STEP)
        new, evaluation = done.observation, done.evaluation
        for agent_id in self.agent_ids:
            slot = self._slots[agent_id]
            slot.context = evaluation.next_contexts[agent_id]
            # checked equal to typed_digest(slot.context) by the transition's commit
            slot.context_digest = done.commits[agent_id]["decisionContextDigest"]
            slot.telemetry = done.telemetry[agent_id]
            slot.committed_step = k + 1
            slot.last_decision = slot.decision
        by_port = {self._slots[a].spec.port_id: self._slots[a] for a in self.agent_ids}
        for control in done.controls:
            bound = by_port.get(control.port_id)
            if bound is not None:
                bound.last_controls = control
        self.observation = new
        self.last_evaluation = evaluation
        self.media.replace(committed=self.media.pending, pending=Media())
        self._audio.advance(new.audio)
        self._progress = evaluation.progress
        self.stats.advances += 1
        self._last_event_ids = [e.id for e in evaluation.events]
        behaviour, operational = transition_records(
            done.scope, self.agent_ids, self._slots, done.batch_id, done.controls_digest, new,
            evaluation, done.commits, done.advance_request_id, wall, done.input_digests)
        try:
            self.trace.record(behaviour, operational)
        except DomainError as exc:
            raise Blame(exc, Detail.PUBLISH, None) from None
        self._last_transition = (k, new, evaluation)
        self._append_effect()
        self._publish_snapshot(k + 1, observed=True)
        for slot in self._slots.values():
            slot.clear_in_flight()

    def _end_of_step(self, boundary: int, episode: EpisodeRequest | None) -> StepReport:
        """F: a requested episode end is kept; it or a pause request pauses at `boundary`."""
        if episode is not None:
            self.episode_request = episode
        paused = False
        if self._pause.is_set() or self.episode_request is not None:
            self.calls.move(Paused(boundary), Detail.STEP)
            self._pause.clear()
            self.audit.add(f"pause:{boundary}")
            paused = True
        return StepReport(boundary, paused, self.episode_request is not None)

    # --------------------------------------------------------- publication (design/session.md §6.9)

    def _publish_descriptor(self) -> None:
        assert self.descriptor is not None
        self.publication.descriptor(self.spec.session_id, self.epoch, self.descriptor,
                                    [(a, self._slots[a]) for a in self.agent_ids],
                                    self._progress)
        self.audit.add("publish:descriptor")

    def _publish_snapshot(self, b: int, *, observed: bool = False) -> None:
        """Publish boundary `b`. `observed`: a transition's Phase C already checked this
        observation's boundary and view steps, and the ports are bound at bootstrap, so
        `check_publication` would repeat those checks; bootstrap and restore ask for it."""
        observation, evaluation = self.observation, self.last_evaluation if observed else None
        assert observation is not None and self.descriptor is not None
        try:
            if not observed:
                check_publication(self.descriptor, observation,
                                  [self._slots[a].spec.port_id for a in self.agent_ids], b)
        except DomainError as exc:
            raise Blame(exc, Detail.PUBLISH, None) from None
        fresh = b > 0
        agents: list[AgentValues] = [
            (agent_id, slot.telemetry, slot.last_decision if fresh else None,
             slot.last_controls if fresh else None)
            for agent_id, slot in ((a, self._slots[a]) for a in self.agent_ids)]
        self.publication.snapshot(
            self._scope(b), self.spec.episode_id, observation, agents, self._progress,
            self._last_event_ids, lambda: {} if evaluation is None else
            {a: evaluation.outcomes[a].rewards for a in self.agent_ids})
        self.audit.add(f"publish:{b}")
        self.stats.publications += 1

    # --------------------------------------------------------------- capture (design/state.md §5.7)

    async def capture(self, checkpoint_id: str, *, kind: CaptureKind = "durable") -> Capture:
        """Every participant's state and the coordinator's ledgers at the committed boundary
        (`flyd.session.capture`)."""
        return await capture_boundary(self, self.calls, checkpoint_id, kind=kind)

    async def save(self, checkpoint_id: str, *, kind: CaptureKind = "durable") -> SaveTicket:
        """`capture` through the session's writer (design/state.md §5.7 steps 2 and 7,
        `flyd.session.capture.save`): the ticket."""
        return await save_capture(self, self.calls, self._writer(), checkpoint_id, kind=kind)

    async def await_durable(self, ticket: SaveTicket, budget: float | None = None
                            ) -> SaveOutcome:
        """The save's outcome (design/state.md §5.5), audited; `Committed` moves the durable
        mark."""
        writer = self._writer()
        outcome = await writer.wait(ticket, self.calls.deadlines.durable if budget is None
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
        """A lost or late save reply, resolved by id (design/state.md §4.6): the stored record,
        adopted as the durable mark when newer; None when it is not stored (nothing changes)."""
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
        """The last transition's behaviour record and result, rebased onto `e1` (design/state.md
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
        """design/state.md §9.2: the last transition k → k+1's records, pending under k+1."""
        writer = None if self.state is None else self.state.writer
        if writer is None:
            return
        assert self._last_transition is not None
        record, result = self.effect_records()
        writer.pending.append(self._last_transition[0] + 1, self.epoch, record, result)

    # ----------------------------------------------------------------- restore (design/state.md §7)

    async def restore(self, checkpoint_id: str | None, proposed_epoch: str, *,
                      store: CheckpointStore | None = None, run_id: int | None = None,
                      guard: Callable[[], object] | None = None) -> RestoreReport:
        """The group install of a stored generation (the head for None) into `proposed_epoch`
        (`flyd.session.restore`). `store` and `run_id` default to the session's `StateContext`;
        `guard` is the node's lease guard (precondition 4)."""
        context = StateContext.of(self.state, store, run_id, guard)
        calls = self.calls
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
        self.audit.add(f"descriptor-revision:{self.publication.revision}")
        self._publish_snapshot(k)
        calls.move(Paused(k), Detail.RESTORE)
        self.audit.add(f"restored:{report.checkpoint_id}@{k}:{proposed_epoch}")
        return report

    def _adopt(self, installed: Installed) -> None:
        """Make an install's state the session's (design/state.md §7.2 steps 8–10)."""
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
        self.media.replace(committed=installed.media, pending=Media())
        self._audio = installed.audio
        self._durable = installed.durable
        self.epoch = installed.epoch
        self._tainted.clear()
        self._replaced.clear()

    def reset(self) -> None:
        """An episode reset: not in v1 (a terminal episode ends a node run,
        design/state.md §9.3)."""
        raise DomainError.before(ErrorCode.UNSUPPORTED,
                                 "episode reset is not supported in v1; a terminal episode ends "
                                 "the run")

    # ---------------------------------------------------- pause and resume (design/session.md §6.7)

    def resume(self) -> None:
        phase = self._machine.phase
        if not isinstance(phase, Paused):
            self.calls.fail(DomainError(ErrorCode.INVALID_PHASE,
                                         f"resume needs Paused(k); the session is {phase.label}",
                                         Mutation.NONE), Detail.RESUME)
        self.calls.move(Ready(phase.step), Detail.RESUME)
        if self._pacing is not None:
            self._pacing.restart()
