"""The session coordinator (session.md §6): bootstrap, the lockstep transaction, resolution of
uncertain calls, the fence, local publication, audit, stats, trace and injections.

One `Coordinator` per session, an asyncio object on the node's loop with its own bus connection.
The task and the action executor are local objects; agents and the world are bus services
reached through pinned `WorkerRef`s. Every call has a deadline (`Deadlines`), every concurrent
dispatch runs inside a `TaskGroup`, and every failure fails the epoch through `fail_now`
(`SessionFailure`, §6.3); `capture` delegates to `flyd.state.capture` (state.md §5.7).

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
- The spec object is the run spec (`flyd.runspec.RunSpec`, the `SessionSpec` of §6.1); the
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
- The feed (`snapshots`) yields `Publication(kind, body)` items: `kind` is `descriptor` or
  `snapshot`; a replaying subscriber first gets the descriptor, then the latest snapshot. A
  snapshot body is built when someone reads it: at once while the feed has subscribers, else on
  the first read of `latest`; its builder holds only the boundary's immutable values, so the body
  is the same either way and an unwatched session builds none per step.
- Snapshot `sequence` counts snapshots of the session from 0 (boundary 0's snapshot is 0).
- The executor's `clock` argument is the world time of boundary k.
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
- `capture` always returns the `Capture` (callers that own a writer submit it themselves);
  with a `StateContext` whose writer is set (`state=`), `save` is §5.7 with steps 2 and 7
  (reserve before anyone is asked, submit after) returning the `SaveTicket`, `checkpoint` is
  `save` then `await_durable`, and every committed transition appends its behaviour record,
  rebased onto `e1`, to the writer's `PendingEffects` (state.md §9.2).
- `restore(id, epoch, *, store=, run_id=, guard=)` takes the store and run from the arguments
  when given, else from the session's `StateContext` (`flyd.state.restore`).
- Audio is checked by `AudioTimelines` (state.md §7.5): fresh at bootstrap, restored at an
  install; `_audio_position` is its positions, as a capture records them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum, StrEnum
from typing import Any, Final, NoReturn

from bus.client import BusClient, PendingCall
from bus.errors import BusError, CallDeadlineExceeded
from flyd.launch.identities import WorkerRef
from flyd.session.audit import AuditLog
from flyd.session.capture import Capture, CaptureKind
from flyd.session.capture import capture as capture_boundary
from flyd.session.fence import Detail, SessionFailure, check_replacement, refuse_if_fenced
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
)
from flyd.session.restore import RestoreReport, StateContext
from flyd.session.restore import restore as restore_checkpoint
from flyd.session.runspec import AgentSpec, RunSpec
from flyd.session.trace import EpochRebase, TraceLog
from flyd.state.checkpoints import CheckpointRecord, CheckpointStore
from flyd.state.envelope import SCHEDULER_ID
from flyd.state.writer import (
    CaptureSubmission,
    CheckpointWriter,
    Committed,
    SaveOutcome,
    SaveTicket,
    audit_line,
)
from workers.canonical import canonical, controls_digest, typed_digest
from workers.composition import composition_digest, config_asset
from workers.datatypes import (
    AudioRef,
    EnvironmentDescriptor,
    Graph,
    PortControl,
    SchemaRef,
    Telemetry,
    TypedValue,
    ViewRef,
    WorldObservation,
    check_controls,
    decode_audio,
    decode_view,
)
from workers.domain import DomainError, ErrorCode, Mutation, Scope, format_request_id, parse_u64
from workers.protocols import ActionExecutor, EpisodeRequest, Evaluation, Task
from workers.rpc import Answered, CallOutcome, Expired, Outcome, Refused, answer, from_bus_error
from workers.shell import contract_digest, load_plugin, method_validator
from workers.synthetic.audio import AudioTimelines
from workers.synthetic.schemas import DECISION
from workers.ticks import RationalNs

__all__ = [
    "RESOLVE_PAUSE",
    "Coordinator",
    "Deadlines",
    "DispatchOrder",
    "Feed",
    "InjectionOutcome",
    "Injections",
    "PauseHandle",
    "Publication",
    "ResolutionEnd",
    "SessionFailure",
    "Stats",
    "StepReport",
    "format_duration",
]

RESOLVE_PAUSE: Final = 0.002
LOSS_POLLS: Final = 500


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
class Deadlines:
    """Seconds (§6.1)."""

    probe: float = 2.0
    resolve: float = 8.0
    resolve_attempts: int = 8192
    boot: float = 30.0
    capture: float = 30.0
    durable: float = 60.0


class ResolutionEnd(StrEnum):
    ANSWERED = "Answered"
    BUDGET_EXPIRED = "BudgetExpired"
    ATTEMPTS_EXHAUSTED = "AttemptsExhausted"


@dataclass
class Stats:
    advances: int = 0
    publications: int = 0
    prepares: int = 0
    commits: int = 0
    resolutions: int = 0
    in_progress_replies: int = 0
    last_resolution: ResolutionEnd | None = None
    last_resolution_attempts: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"advances": self.advances, "publications": self.publications,
                "prepares": self.prepares, "commits": self.commits,
                "resolutions": self.resolutions, "inProgressReplies": self.in_progress_replies,
                "lastResolution": None if self.last_resolution is None
                else self.last_resolution.value,
                "lastResolutionAttempts": self.last_resolution_attempts}


class Metrics:
    """Latency histograms per method and for `step` (µs), and pacing lag.

    `Metrics(window=n)` keeps the newest n samples per name (a long run's node): `count` and
    `max` still cover every sample, the percentiles the window; without a window, all."""

    def __init__(self, window: int | None = None) -> None:
        self._samples: dict[str, collections.deque[float]] = collections.defaultdict(
            lambda: collections.deque(maxlen=window))
        self._count: collections.Counter[str] = collections.Counter()
        self._max: dict[str, float] = {}
        self.lag_ns = 0

    def observe(self, name: str, seconds: float) -> None:
        value = seconds * 1e6
        self._samples[name].append(value)
        self._count[name] += 1
        self._max[name] = max(self._max.get(name, value), value)

    def histogram(self, name: str) -> dict[str, float | int]:
        values = sorted(self._samples.get(name, ()))
        if not values:
            return {"count": 0, "p50": 0.0, "p99": 0.0, "max": 0.0}

        def pick(q: float) -> float:
            return values[min(len(values) - 1, int(q * len(values)))]

        return {"count": self._count[name], "p50": pick(0.5), "p99": pick(0.99),
                "max": self._max[name]}

    def to_json(self) -> dict[str, Any]:
        return {"latencyUs": {name: self.histogram(name) for name in sorted(self._samples)},
                "lagNs": self.lag_ns}


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


@dataclass(frozen=True)
class InjectionOutcome:
    what: str
    code: str | None
    identical: bool


KillCallback = Callable[[str], Awaitable[Any]]


@dataclass
class Injections:
    """Test injections (§6.13); the per-step ones act at `at_step`."""

    at_step: int | None = None
    duplicate_prepare: str | None = None
    duplicate_commit: str | None = None
    altered_advance_controls: bool = False
    consume_advance_artifact_then_retry: bool = False
    duplicate_lifecycle_acknowledge: bool = False
    lose_advance_result_at: tuple[int, ...] = ()
    kill_at: tuple[tuple[str, int], ...] = ()
    kill: KillCallback | None = None


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


def format_duration(seconds: float) -> str:
    """`8s`, `200ms`, `250us`, else `<n>ns` (§6.8)."""
    ns = round(seconds * 1_000_000_000)
    if ns % 1_000_000_000 == 0:
        return f"{ns // 1_000_000_000}s"
    if ns % 1_000_000 == 0:
        return f"{ns // 1_000_000}ms"
    if ns % 1_000 == 0:
        return f"{ns // 1_000}us"
    return f"{ns}ns"


# --------------------------------------------------------------------------------------------
# publication feed (§6.9)


@dataclass(frozen=True)
class Publication:
    kind: str  # "descriptor" | "snapshot"
    body: dict[str, Any]


class Subscription:
    """A bounded queue of publications; a full queue drops its oldest entry (`dropped`)."""

    def __init__(self, depth: int) -> None:
        self._queue: collections.deque[Publication] = collections.deque(maxlen=depth)
        self._event = asyncio.Event()
        self.dropped = 0

    def push(self, item: Publication) -> None:
        if self._queue.maxlen is not None and len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(item)
        self._event.set()

    def pending(self) -> list[Publication]:
        return list(self._queue)

    def __aiter__(self) -> AsyncIterator[Publication]:
        return self

    async def __anext__(self) -> Publication:
        while not self._queue:
            self._event.clear()
            await self._event.wait()
        return self._queue.popleft()


class Feed:
    """The session's local, never-blocking publication feed."""

    def __init__(self) -> None:
        self.descriptor: dict[str, Any] | None = None
        self._latest: dict[str, Any] | None = None
        self._build: Callable[[], dict[str, Any]] | None = None
        self._subscribers: list[Subscription] = []

    @property
    def latest(self) -> dict[str, Any] | None:
        """The latest snapshot body, built on first read."""
        if self._build is not None:
            self._latest, self._build = self._build(), None
        return self._latest

    def subscribe(self, depth: int = 8, replay: bool = True) -> Subscription:
        sub = Subscription(depth)
        if replay:
            if self.descriptor is not None:
                sub.push(Publication("descriptor", self.descriptor))
            if self.latest is not None:
                sub.push(Publication("snapshot", self.latest))
        self._subscribers.append(sub)
        return sub

    def _publish(self, item: Publication) -> None:
        for sub in self._subscribers:
            sub.push(item)

    def publish_descriptor(self, body: dict[str, Any]) -> None:
        self.descriptor = body
        self._publish(Publication("descriptor", body))

    def publish_snapshot(self, body: dict[str, Any]) -> None:
        self.publish_snapshot_on_read(lambda: body)

    def publish_snapshot_on_read(self, build: Callable[[], dict[str, Any]]) -> None:
        """Publish the snapshot `build` returns: now when someone subscribes, else when read."""
        if self._subscribers:
            self._latest, self._build = build(), None
            self._publish(Publication("snapshot", self._latest))
        else:
            self._latest, self._build = None, build


# --------------------------------------------------------------------------------------------
# internal state


class _Blame(Exception):
    """A failure inside a phase, with what failed and whom it blames (turned into fail_now)."""

    def __init__(self, error: DomainError, detail: str, participant: str | None) -> None:
        super().__init__(error, detail, participant)
        self.error = error
        self.detail = detail
        self.participant = participant


@dataclass
class _AgentSlot:
    spec: AgentSpec
    profile: dict[str, Any]
    seed: int
    model_config: dict[str, Any]
    context: TypedValue | None = None
    context_digest: str = ""
    graph: Graph | None = None
    telemetry: Telemetry | None = None
    tick_duration: RationalNs | None = None
    warmup_ticks: int = 0
    committed_step: int = 0
    decision: TypedValue | None = None
    prepared: dict[str, Any] | None = None
    prepare_request: str | None = None
    commit_request: str | None = None
    last_decision: TypedValue | None = None
    last_controls: PortControl | None = None


@dataclass
class _Call:
    """One request as sent: the same id and body are re-sent by resolution and injections."""

    worker_id: str
    ref: WorkerRef
    method: str
    request_id: str
    scope: Scope | None
    params: dict[str, Any]

    def payload(self) -> dict[str, Any]:
        return {"requestId": self.request_id,
                "scope": None if self.scope is None else self.scope.to_json(),
                "params": self.params}


@dataclass
class _Media:
    views: dict[str, bytes] = field(default_factory=dict)
    audio: dict[str, bytes] = field(default_factory=dict)

    def count(self) -> int:
        return len(self.views) + len(self.audio)


def _mismatch(message: str) -> DomainError:
    return DomainError(ErrorCode.IDENTITY_MISMATCH, message, Mutation.NONE)


def _backend(message: str) -> DomainError:
    return DomainError(ErrorCode.BACKEND_FAILURE, message, Mutation.UNKNOWN)


def _media(message: str) -> DomainError:
    return DomainError(ErrorCode.BUFFER_INVALID, message, Mutation.UNKNOWN)


def _as_domain(exc: Exception) -> DomainError:
    if isinstance(exc, DomainError):
        return exc
    return DomainError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", Mutation.UNKNOWN)


@functools.cache
def decision_schema_of(model_path: str) -> SchemaRef:
    """A model class's registered decision schema: a class attribute, so it is looked up once per
    model path rather than once per Prepare (a failed look-up is not cached)."""
    model = load_plugin(model_path, "model")
    schema = getattr(model, "decision_schema", DECISION)
    assert isinstance(schema, SchemaRef)
    return schema


# --------------------------------------------------------------------------------------------
# the coordinator


class Coordinator:
    """One session's coordinator (§6)."""

    def __init__(self, spec: RunSpec, client: BusClient, refs: Mapping[str, WorkerRef], *,
                 task: Task, executor: ActionExecutor, deadlines: Deadlines | None = None,
                 order: DispatchOrder = DispatchOrder.CONCURRENT,
                 injections: Injections | None = None, clock: Clock = SYSTEM_CLOCK,
                 state: StateContext | None = None, epoch: str = "e1",
                 history: History | None = None) -> None:
        self.spec = spec
        self._client = client
        self._refs: dict[str, WorkerRef] = dict(refs)
        self.task = task
        self.executor = executor
        self.deadlines = deadlines or Deadlines()
        self.order = order
        self.injections = injections or Injections()
        self.clock = clock
        self.state = state
        self.epoch = epoch
        self.world_id = spec.world.world_id
        self.agent_ids = sorted(a.agent_id for a in spec.agents)
        missing = [w for w in [self.world_id, *self.agent_ids] if w not in self._refs]
        if missing:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"no worker reference for {', '.join(missing)}")
        bound = history or History()
        self._machine = PhaseMachine(log_limit=bound.entries)
        self._serials: dict[str, int] = dict.fromkeys(self._refs, 0)
        self._pause = PauseHandle()
        self._pacing: Pacing | None = None
        if spec.pace_s is not None:
            self._pacing = Pacing.fixed(spec.pace_s, clock)
        elif spec.pacing == "realtime":
            self._pacing = Pacing(spec.world.step, clock)
        self.audit = AuditLog(limit=bound.entries)
        self.stats = Stats()
        self.metrics = Metrics(window=bound.entries)
        self.trace = TraceLog(phase_source=self._machine.phase_path, keep=bound.transitions,
                              horizon=bound.horizon)
        self.snapshots = Feed()
        self.injection_log: list[InjectionOutcome] = []
        self.episode_request: EpisodeRequest | None = None
        self.last_failure: SessionFailure | None = None
        self.descriptor: EnvironmentDescriptor | None = None
        self.observation: WorldObservation | None = None
        self._media = _Media()
        self._pending_media = _Media()
        self._audio = AudioTimelines([])
        self._tainted: set[str] = set()
        self._replaced: set[str] = set()
        self._used_epochs: set[str] = {epoch}
        self._durable: tuple[str, int] | None = None
        self.events: list[dict[str, Any]] = []
        self._owed: dict[str, list[str]] = {}
        self._progress: TypedValue | None = None
        self._descriptor_revision = 0
        self._snapshot_sequence = 0
        self._last_event_ids: list[str] = []
        self._controls_digest = ""
        self._slots: dict[str, _AgentSlot] = {}
        for agent in spec.agents:
            model = load_plugin(agent.model, "model")
            profile = model.profile(agent.agent_id, agent.tick, agent.warmup_ticks,
                                    dict(agent.model_config))
            self._slots[agent.agent_id] = _AgentSlot(
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

    def progress(self) -> TypedValue:
        return self.task.progress()

    def evaluations(self) -> int:
        return self.task.evaluations()

    def live_view_handles(self) -> int:
        return self._media.count() + self._pending_media.count()

    @property
    def _audio_position(self) -> dict[str, int]:
        """Each declared stream's position (what a capture records)."""
        return self._audio.positions()

    def issued_events(self) -> int:
        """The task events of the traced transitions (their `eventIds`): a running count."""
        return self.trace.events()

    def participants(self) -> list[str]:
        """The environment, then the agents by id (the order of stages and activations)."""
        return [self.world_id, *self.agent_ids]

    def tainted(self) -> list[str]:
        """Workers that took part in an abandoned install (state.md §7.4), environment first."""
        return [w for w in self.participants() if w in self._tainted]

    def durable(self) -> tuple[str, int] | None:
        """The newest checkpoint known durable: `(checkpointId, boundary)`."""
        return self._durable

    def status_json(self) -> dict[str, Any]:
        """Phase, fence, stats, evaluations and metrics as camelCase JSON (§6.11)."""
        return {"phase": self._machine.phase.label, "fenced": self._machine.fenced,
                "committedBoundary": self._machine.committed_boundary(),
                "stats": self.stats.to_json(), "evaluations": self.task.evaluations(),
                "metrics": self.metrics.to_json(),
                "lastFailure": None if self.last_failure is None else str(self.last_failure)}

    def refs(self) -> dict[str, WorkerRef]:
        return dict(self._refs)

    def pause_handle(self) -> PauseHandle:
        return self._pause

    def set_deadlines(self, deadlines: Deadlines) -> None:
        self.deadlines = deadlines

    def disable_pacing(self) -> None:
        self._pacing = None

    # ------------------------------------------------------------------ fence (§6.3)

    def _fail_now(self, error: DomainError, detail: str,
                  participant: str | None = None) -> NoReturn:
        phase_label = self._machine.phase.label
        if not isinstance(self._machine.phase, Failed):
            self._machine.fail()
        self._owed.clear()
        for slot in self._slots.values():
            slot.prepared = None
            slot.decision = None
            slot.prepare_request = None
            slot.commit_request = None
        self._media = _Media()
        self._pending_media = _Media()
        failure = SessionFailure(error, phase_label, detail, participant)
        self.audit.add(failure.audit_entry)
        self.last_failure = failure
        raise failure

    def fence_now(self, message: str) -> None:
        """Close the fence from outside, synchronously (a lost lease, distribution.md §5.5
        step 2): nothing more is dispatched. Unlike a failed step it raises nothing here; the
        next `step()` refuses. Already fenced: no change."""
        if self._machine.fenced:
            return
        with contextlib.suppress(SessionFailure):
            self._fail_now(DomainError.before(ErrorCode.INVALID_PHASE, message), Detail.FENCED)

    def _refuse_if_fenced(self) -> None:
        refuse_if_fenced(self._machine)

    def _move(self, target: Phase, detail: str) -> None:
        try:
            self._machine.move(target)
        except DomainError as exc:
            self._fail_now(exc, detail)

    def replace_participant(self, worker_id: str, ref: WorkerRef) -> None:
        if worker_id not in self._refs:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH, f"no participant {worker_id}")
        check_replacement(self._machine, worker_id)
        self._refs[worker_id] = ref
        self._serials[worker_id] = 0
        self._replaced.add(worker_id)
        self._tainted.discard(worker_id)
        self.audit.add(f"replaced:{worker_id}")

    def _pin(self, worker_id: str, incarnation_id: str) -> None:
        """Pin the domain incarnation a `Worker.Hello` returned."""
        self._refs[worker_id] = replace(self._refs[worker_id], domain_incarnation=incarnation_id)

    async def replace_client(self, client: BusClient) -> None:
        """Swap in the new client and close the old one here, within the probe deadline (its
        connection is already lost, so closing only fails what is still pending on it)."""
        if not self._machine.fenced:
            raise DomainError.before(ErrorCode.INVALID_PHASE,
                                     "replace_client needs a fenced epoch")
        old = self._client
        self._client = client
        if old is not client:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.deadlines.probe):
                    await old.close()

    # ------------------------------------------------------------------ calls (§6.4)

    def _scope(self, step: int) -> Scope:
        return Scope(self.spec.session_id, self.epoch, step)

    def _deadline_of(self, method: str) -> float:
        if method == "Worker.Hello" or method.endswith(".Initialize"):
            return self.deadlines.boot
        if method.startswith("State."):
            return self.deadlines.capture
        return self.deadlines.probe

    def _new_call(self, worker_id: str, method: str, scope: Scope | None,
                  params: dict[str, Any], ref: WorkerRef | None = None) -> _Call:
        self._serials[worker_id] = self._serials.get(worker_id, 0) + 1
        return _Call(worker_id, ref or self._refs[worker_id], method,
                     format_request_id(self._serials[worker_id]), scope, params)

    async def _send(self, call: _Call, timeout: float,  # noqa: ASYNC109
                    params: dict[str, Any] | None = None) -> CallOutcome:
        """One bus call of `call` (optionally with other params, same id); never raises for
        bus or deadline failures."""
        payload = call.payload()
        if params is not None:
            payload["params"] = params
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout + 2.0):
                result = await self._client.call(
                    call.ref.service, call.method, payload, timeout=timeout,
                    expected_incarnation=call.ref.service_incarnation)
        except (CallDeadlineExceeded, TimeoutError):
            return Expired()
        except BusError as exc:
            return Refused(from_bus_error(call.method, exc))
        finally:
            self.metrics.observe(call.method, time.perf_counter() - started)
        return answer(call.method, result.outcome)

    def check_reply(self, call: _Call, outcome: Outcome) -> dict[str, Any]:
        """Identity and echo checks (§6.4); a domain error outcome is raised; the result is
        validated against the method's result schema."""
        method = call.method
        if outcome.worker_id != call.ref.worker_id:
            raise _mismatch(f"{method}: the reply names worker {outcome.worker_id}, expected "
                            f"{call.ref.worker_id}")
        want_inc = call.ref.domain_incarnation
        if want_inc is not None and outcome.incarnation_id != want_inc:
            raise _mismatch(f"{method}: the reply comes from incarnation "
                            f"{outcome.incarnation_id}, expected {want_inc}")
        if outcome.scope != call.scope:  # equal values, equal JSON: the text only to word it
            got_scope = None if outcome.scope is None else outcome.scope.to_json()
            want_scope = None if call.scope is None else call.scope.to_json()
            raise _mismatch(f"{method}: the reply echoes scope "
                            f"{canonical(got_scope).decode()}, expected "
                            f"{canonical(want_scope).decode()}")
        if outcome.request_id != call.request_id:
            raise _mismatch(f"{method}: the reply echoes request {outcome.request_id}, "
                            f"expected {call.request_id}")
        if outcome.error is not None:
            raise outcome.error
        assert outcome.result is not None
        problem = method_validator(method, "result")(outcome.result)
        if problem is not None:
            raise _backend(f"{method}: the result does not match its schema: {problem}")
        return outcome.result

    async def _settle(self, call: _Call, outcome: CallOutcome) -> dict[str, Any]:
        """The result of a sent call: check an answer, resolve an expiry, raise a refusal."""
        if isinstance(outcome, Refused):
            raise outcome.error
        if isinstance(outcome, Expired):
            return await self._resolve(call)
        return self.check_reply(call, outcome.outcome)

    async def _call(self, call: _Call) -> dict[str, Any]:
        return await self._settle(call, await self._send(call, self._deadline_of(call.method)))

    # ------------------------------------------------------------------ resolution (§6.8)

    async def _resolve(self, call: _Call) -> dict[str, Any]:
        """Re-send the same request until it answers, or fail with the bound that ran out.
        Raises a DomainError (the caller blames the worker)."""
        d = self.deadlines
        self.stats.resolutions += 1
        self.stats.last_resolution = None
        self.stats.last_resolution_attempts = 0
        self.audit.add(f"resolve:{call.worker_id}:{call.method}")
        started = time.monotonic()
        end = ResolutionEnd.ATTEMPTS_EXHAUSTED
        for _ in range(d.resolve_attempts):
            if time.monotonic() - started >= d.resolve:
                end = ResolutionEnd.BUDGET_EXPIRED
                break
            self.stats.last_resolution_attempts += 1
            outcome = await self._send(call, d.probe)
            if isinstance(outcome, Expired):
                await asyncio.sleep(RESOLVE_PAUSE)
                continue
            if isinstance(outcome, Refused):
                raise DomainError(outcome.error.code, outcome.error.message, Mutation.UNKNOWN)
            try:
                result = self.check_reply(call, outcome.outcome)
            except DomainError as exc:
                if exc.code == ErrorCode.IN_PROGRESS:
                    self.stats.in_progress_replies += 1
                    await asyncio.sleep(RESOLVE_PAUSE)
                    continue
                raise
            self.stats.last_resolution = ResolutionEnd.ANSWERED
            return result
        self.stats.last_resolution = end
        if end is ResolutionEnd.BUDGET_EXPIRED:
            why, bound = "its resolution budget", format_duration(d.resolve)
        else:
            why, bound = "its resolution attempt guard", f"{d.resolve_attempts} attempts"
        raise _backend(f"{call.method}: {call.worker_id} never resolved; {why} of {bound} ran "
                       "out and the operation's outcome is unknown")

    # ------------------------------------------------------------------ guarded runs

    async def _guarded(self, body: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await body()
        except _Blame as blame:
            detail = blame.detail
            if self._client.closed and blame.error.code == ErrorCode.BACKEND_FAILURE:
                detail = Detail.ROUTER  # the coordinator's own connection was lost
            self._fail_now(blame.error, detail, blame.participant)
        except SessionFailure:
            raise
        except Exception as exc:  # a flyd or plugin bug must still fence the epoch
            self._fail_now(_as_domain(exc), Detail.STEP)
        except asyncio.CancelledError:
            # a step abandoned half-way leaves the workers' state unknown: fence, then go on
            # being cancelled
            if not self._machine.fenced and not self._machine.is_committed_boundary():
                with contextlib.suppress(SessionFailure):
                    self._fail_now(_backend("the operation was cancelled half-way"),
                                   Detail.STEP)
            raise

    def health_failure(self, worker_id: str, error: DomainError) -> SessionFailure | None:
        """A supervisor's report (§7.4): fail the epoch (detail `health`) unless already
        fenced; returns the failure recorded, or None when the epoch was already fenced."""
        if self._machine.fenced:
            return None
        try:
            self._fail_now(error, Detail.HEALTH, worker_id)
        except SessionFailure as failure:
            return failure

    async def _blamed(self, call: _Call, detail: str | None = None) -> dict[str, Any]:
        try:
            return await self._call(call)
        except DomainError as exc:
            raise _Blame(exc, detail or call.method, call.worker_id) from None

    # ------------------------------------------------------------------ bootstrap (§6.5)

    async def bootstrap(self) -> None:
        self._refuse_if_fenced()
        await self._guarded(self._bootstrap)

    async def _hello(self, worker_id: str, role: str, capability: str) -> None:
        call = self._new_call(worker_id, "Worker.Hello", None, {
            "sessionId": self.spec.session_id, "expectedWorkerId": worker_id, "role": role,
            "supportedMajors": [1]})
        result = await self._blamed(call)
        problem: DomainError | None = None
        if result.get("workerId") != worker_id or result.get("role") != role:
            problem = _mismatch(f"Worker.Hello: {worker_id} answers as "
                                f"{result.get('workerId')}/{result.get('role')}, expected "
                                f"{worker_id}/{role}")
        elif result.get("contractDigest") != contract_digest():
            problem = _mismatch(f"Worker.Hello: {worker_id} has contract "
                                f"{result.get('contractDigest')}, expected {contract_digest()}")
        elif capability not in result.get("capabilities", []):
            problem = DomainError(ErrorCode.UNSUPPORTED,
                                  f"Worker.Hello: {worker_id} lacks {capability}", Mutation.NONE)
        if problem is not None:
            raise _Blame(problem, "Worker.Hello", worker_id)
        self._pin(worker_id, result["incarnationId"])
        self.audit.add(f"hello:{worker_id}")

    def _bindings(self) -> list[tuple[str, str]]:
        return [(self._slots[a].spec.port_id, a) for a in self.agent_ids]

    async def _bootstrap(self) -> None:
        world = self.spec.world
        wid = self.world_id
        await self._hello(wid, "environment", "world-step-v1")
        for agent_id in self.agent_ids:
            await self._hello(agent_id, "agent", "agent-step-v1")
        # 2. Environment.Initialize
        call = self._new_call(wid, "Environment.Initialize", self._scope(0), {
            "backendConfig": config_asset(f"{wid}-config", dict(world.config)).to_json(),
            "taskConfig": config_asset(f"{wid}-task", dict(self.spec.task.config)).to_json(),
            "episodeId": self.spec.episode_id,
            "portBindings": [[p, a] for p, a in self._bindings()]})
        result = await self._blamed(call)
        try:
            descriptor = EnvironmentDescriptor.from_json(result["descriptor"])
            observation = WorldObservation.from_json(result["observation"])
        except DomainError as exc:
            raise _Blame(_backend(f"Environment.Initialize: {exc.message}"),
                         "Environment.Initialize", wid) from None
        ports = sorted(p.port_id for p in descriptor.ports)
        want = sorted(p for p, _ in self._bindings())
        if ports != want:
            raise _Blame(_mismatch(f"the world declares ports {ports}; the composition binds "
                                   f"{want}"), Detail.PORT_ASSIGNMENT, wid)
        try:
            if observation.boundary != 0 or not observation.world_time.is_zero():
                raise _backend("O[0] is not at boundary 0, world time 0/1")
            if observation.inspection.schema != descriptor.inspection_schema:
                raise _backend("O[0] inspection schema differs from the descriptor's")
            if observation.audio:
                raise _backend("O[0] carries audio")
            media = self._check_views(descriptor, observation, 0, Mutation.NONE)
        except DomainError as exc:
            raise _Blame(exc, "Environment.Initialize", wid) from None
        self.descriptor = descriptor
        self.observation = observation
        self._media = media
        self._audio = AudioTimelines.fresh(descriptor)
        self._owed.setdefault(wid, []).append(call.request_id)
        self.audit.add("environment.initialize")
        # 3. task bootstrap
        try:
            boot = self.task.bootstrap(observation.inspection, self._bindings())
            for event in boot.events:
                if event.source_step != 0:
                    raise _backend(f"bootstrap event {event.id} has sourceStep "
                                   f"{event.source_step}")
            for agent_id in self.agent_ids:
                if agent_id not in boot.contexts:
                    raise _backend(f"the task gives {agent_id} no decision context")
        except Exception as exc:
            raise _Blame(_as_domain(exc), Detail.TASK_BOOTSTRAP, None) from None
        self._progress = boot.progress
        self._last_event_ids = [e.id for e in boot.events]
        for agent_id in self.agent_ids:
            slot = self._slots[agent_id]
            slot.context = boot.contexts[agent_id]
            slot.context_digest = typed_digest(slot.context)
        self.audit.add("task.bootstrap")
        # 4. agents
        for agent_id in self.agent_ids:
            await self._initialize_agent(agent_id, observation)
        self._replaced.clear()
        # 5. acknowledge
        for worker_id in [wid, *self.agent_ids]:
            ids = self._owed.get(worker_id, [])
            if not ids:
                continue
            await self._acknowledge(worker_id, ids, require_all=False)
            if self.injections.duplicate_lifecycle_acknowledge:
                again = await self._acknowledge(worker_id, ids, require_all=False)
                self.injection_log.append(
                    InjectionOutcome("duplicate-lifecycle-acknowledge", None, again == []))
        self._owed.clear()
        self.audit.add("acknowledge.lifecycle")
        # 6. Ready(0)
        self._move(Ready(0), Detail.STEP)
        if self._pacing is not None:
            self._pacing.restart()
        self._publish_descriptor()
        self._publish_snapshot(0)

    async def _initialize_agent(self, agent_id: str, observation: WorldObservation) -> None:
        slot = self._slots[agent_id]
        assert slot.context is not None
        call = self._new_call(agent_id, "Agent.Initialize", self._scope(0), {
            "agentId": agent_id, "profile": slot.profile, "seed": slot.seed,
            "initialInput": {"boundary": "0",
                             "views": [v.to_json() for v in observation.sensory_views],
                             "structured": None},
            "initialDecisionContext": slot.context.to_json(),
            "workerThreads": slot.spec.threads})
        result = await self._blamed(call)
        try:
            if result.get("committedStep") != "0":
                raise _backend(f"Agent.Initialize: {agent_id} committed "
                               f"{result.get('committedStep')}, expected 0")
            if result.get("profileDigest") != slot.profile["digest"]:
                raise _mismatch(f"Agent.Initialize: {agent_id} has profile "
                                f"{result.get('profileDigest')}, expected "
                                f"{slot.profile['digest']}")
            if result.get("decisionContextDigest") != slot.context_digest:
                raise _mismatch(f"Agent.Initialize: {agent_id} holds context "
                                f"{result.get('decisionContextDigest')}, expected "
                                f"{slot.context_digest}")
            graph = Graph.from_json(result["graph"])
            telemetry = Telemetry.from_json(result["telemetry"])
            telemetry.check_rates(graph)
            slot.tick_duration = RationalNs.from_json(result["tickDuration"])
            slot.warmup_ticks = parse_u64(result["warmupTicks"])
        except DomainError as exc:
            raise _Blame(exc, "Agent.Initialize", agent_id) from None
        slot.graph = graph
        slot.telemetry = telemetry
        slot.committed_step = 0
        self._owed.setdefault(agent_id, []).append(call.request_id)
        self.audit.add(f"agent.initialize:{agent_id}")

    async def _acknowledge(self, worker_id: str, ids: Sequence[str],
                           require_all: bool) -> list[str]:
        call = self._new_call(worker_id, "Worker.Acknowledge", None, {"requestIds": list(ids)})
        result = await self._blamed(call)
        acknowledged = list(result.get("acknowledged", []))
        for rid in acknowledged:
            if rid not in ids:
                raise _Blame(_mismatch(f"Worker.Acknowledge: {worker_id} acknowledged {rid}, "
                                       "which it was never asked about"),
                             Detail.ACKNOWLEDGE, worker_id)
        return acknowledged

    async def acknowledge_replies(self, worker_id: str, ids: Sequence[str]) -> list[str]:
        """`Worker.Acknowledge` with the subset rule of §6.5 step 5."""
        result: list[str] = await self._guarded(
            lambda: self._acknowledge(worker_id, ids, require_all=False))
        return result

    # ------------------------------------------------------------------ media checks

    def _check_views(self, descriptor: EnvironmentDescriptor, observation: WorldObservation,
                     boundary: int, mutation: Mutation) -> _Media:
        media = _Media()
        by_id = {v.view_id: v for v in observation.sensory_views}
        for view in descriptor.views:
            ref = by_id.get(view.view_id)
            if ref is None:
                raise DomainError(ErrorCode.BUFFER_INVALID,
                                  f"view {view.view_id} is missing at boundary {boundary}",
                                  mutation)
            want = max(0, boundary - view.observation_delay_steps)
            if ref.produced_step != want:
                raise DomainError(ErrorCode.BUFFER_INVALID,
                                  f"view {view.view_id} at boundary {boundary} was produced at "
                                  f"{ref.produced_step}; the descriptor requires {want}",
                                  mutation)
            media.views[view.view_id] = decode_view(ref, view, mutation)
        return media

    def _check_audio(self, descriptor: EnvironmentDescriptor, observation: WorldObservation,
                     media: _Media) -> None:
        by_id = {a.stream_id: a for a in observation.audio}
        for stream in descriptor.audio:
            chunk = by_id.get(stream.stream_id)
            if chunk is None:
                raise _media(f"audio stream {stream.stream_id} produced no chunk for this "
                             "transition")
            media.audio[stream.stream_id] = decode_audio(chunk, stream, Mutation.UNKNOWN)
        self._audio.check(observation.audio, Mutation.UNKNOWN)

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
        self._refuse_if_fenced()
        phase = self._machine.phase
        if isinstance(phase, Paused) and self.episode_request is not None:
            error = DomainError(ErrorCode.INVALID_PHASE,
                                f"the episode ended ({self.episode_request.reason}); the "
                                "session stays paused until a reset", Mutation.NONE)
            raise SessionFailure(error, phase.label, Detail.EPISODE)
        if not isinstance(phase, Ready):
            self._fail_now(DomainError(ErrorCode.INVALID_PHASE,
                                       f"step needs Ready(k); the session is {phase.label}",
                                       Mutation.NONE), Detail.STEP)
        if self.episode_request is not None:
            self._fail_now(DomainError(ErrorCode.INVALID_PHASE,
                                       "the episode ended; only a reset starts another",
                                       Mutation.NONE), Detail.EPISODE)
        if self._pacing is not None:
            wait = self._pacing.before_transition()
            self.metrics.lag_ns = self._pacing.lag_ns
            if wait > 0:
                await asyncio.sleep(wait / 1e9)
        started = time.perf_counter()
        report: StepReport = await self._guarded(lambda: self._transition(phase.step))
        self.metrics.observe("step", time.perf_counter() - started)
        return report

    def _agents_in_order(self) -> list[str]:
        if self.order is DispatchOrder.REVERSED:
            return list(reversed(self.agent_ids))
        return list(self.agent_ids)

    async def _kill_injection(self, k: int) -> None:
        inj = self.injections
        for worker, step in inj.kill_at:
            if step != k:
                continue
            identical = False
            code: str | None = None
            if inj.kill is not None:
                try:
                    outcome = await inj.kill(worker)
                    identical = getattr(outcome, "label", None) == "Terminated"
                except DomainError as exc:
                    code = exc.code.value
            self.injection_log.append(InjectionOutcome("kill", code, identical))

    async def _dispatch(self, calls: list[_Call], k: int | None,
                        ) -> dict[str, CallOutcome]:
        """Send one call per agent per the dispatch order; kill injections of step `k` run once
        every call was dispatched."""
        outcomes: dict[str, CallOutcome] = {}

        async def one(call: _Call) -> None:
            outcomes[call.worker_id] = await self._send(call, self._deadline_of(call.method))

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
                    await self._kill_injection(k)
            else:
                for index, call in enumerate(calls):
                    task = tg.create_task(one(call))
                    if index == len(calls) - 1 and kills:
                        assert k is not None
                        await asyncio.sleep(0)
                        await self._kill_injection(k)
                    await task
        return outcomes

    async def _transition(self, k: int) -> StepReport:
        wall = time.monotonic_ns()
        assert self.descriptor is not None and self.observation is not None
        descriptor = self.descriptor
        old = self.observation
        scope = self._scope(k)
        # A. Prepare
        self._move(Preparing(k), Detail.STEP)
        interval = descriptor.step_duration.to_json()  # one JSON value shared by every call
        calls = [self._new_call(a, "Agent.Prepare", scope, {
            "agentId": a, "profileDigest": self._slots[a].profile["digest"],
            "interval": interval,
            "decisionContextDigest": self._slots[a].context_digest,
            "preStepStimulations": []}) for a in self._agents_in_order()]
        by_agent = {c.worker_id: c for c in calls}
        outcomes = await self._dispatch(calls, k)
        for agent_id in self.agent_ids:
            call = by_agent[agent_id]
            try:
                result = await self._settle(call, outcomes[agent_id])
                if result.get("agentId") != agent_id:
                    raise _mismatch(f"Agent.Prepare: the decision names {result.get('agentId')}, "
                                    f"expected {agent_id}")
                decision = TypedValue.from_json(result["decision"])
                if decision.schema != self._decision_schema(agent_id):
                    raise _mismatch(f"Agent.Prepare: {agent_id} decided in schema "
                                    f"{decision.schema.id}, not the registered one")
            except DomainError as exc:
                raise _Blame(exc, "Agent.Prepare", agent_id) from None
            slot = self._slots[agent_id]
            slot.prepared = result
            slot.decision = decision
            slot.prepare_request = call.request_id
            self.audit.add(f"prepared:{agent_id}@{k}")
            self.stats.prepares += 1
        if self.injections.at_step == k and self.injections.duplicate_prepare is not None:
            await self._duplicate(by_agent[self.injections.duplicate_prepare],
                                  self._slots[self.injections.duplicate_prepare].prepared,
                                  "duplicate-prepare")
        # B. Apply
        self._move(Applying(k), Detail.STEP)
        controls = self._controls(scope, old)
        wire_controls = [c.to_json() for c in controls]
        self._controls_digest = controls_digest(wire_controls)
        batch_id = f"batch-{self.epoch}-{k}"
        self.audit.add(f"advance:{k}")
        advance = self._new_call(self.world_id, "Environment.Advance", scope, {
            "batchId": batch_id, "controls": wire_controls})
        try:
            if k in self.injections.lose_advance_result_at:
                step_result = await self._lose_advance_result(advance, batch_id)
            else:
                step_result = await self._call(advance)
        except DomainError as exc:
            raise _Blame(exc, "Environment.Advance", self.world_id) from None
        # C. Observe
        self._move(Observing(k + 1), Detail.STEP)
        new, media = self._observe(k, step_result, batch_id, controls, old)
        self._pending_media = media
        if self.injections.at_step == k:
            await self._advance_injections(advance, step_result, descriptor)
        try:
            evaluation = self.task.evaluate_transition(scope, old.inspection, new.inspection,
                                                       controls)
            for agent_id in self.agent_ids:
                if agent_id not in evaluation.outcomes or agent_id not in \
                        evaluation.next_contexts:
                    raise _backend(f"the task's evaluation misses {agent_id}")
        except Exception as exc:
            raise _Blame(_as_domain(exc), Detail.TASK_EVALUATE, None) from None
        self.audit.add(f"evaluate:{k}")
        # D. Commit
        self._move(Committing(k), Detail.STEP)
        commits, telemetry = await self._commit(k, scope, new, evaluation)
        # E. Ready(k+1)
        self._move(Ready(k + 1), Detail.STEP)
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
        self._media = self._pending_media
        self._pending_media = _Media()
        self._audio.advance(new.audio)
        self._progress = evaluation.progress
        self.stats.advances += 1
        self._last_event_ids = [e.id for e in evaluation.events]
        self._record_trace(k, batch_id, controls, new, evaluation, commits, advance, wall)
        self._append_effect(k)
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
            self._move(Paused(k + 1), Detail.STEP)
            self._pause.clear()
            self.audit.add(f"pause:{k + 1}")
            paused = True
        return StepReport(k + 1, paused, self.episode_request is not None)

    def _decision_schema(self, agent_id: str) -> SchemaRef:
        """The model's registered decision schema (`decision_schema`, default
        `arena.decision.v1`)."""
        return decision_schema_of(self._slots[agent_id].spec.model)

    def _controls(self, scope: Scope, old: WorldObservation) -> list[PortControl]:
        assert self.descriptor is not None and self._progress is not None
        descriptor = self.descriptor
        by_port: dict[str, PortControl] = {}
        for agent_id in self.agent_ids:
            slot = self._slots[agent_id]
            assert slot.decision is not None
            try:
                intent = self.executor.apply(scope, slot.decision, old.inspection,
                                             self._progress, old.world_time)
            except Exception as exc:
                raise _Blame(_as_domain(exc), Detail.APPLY, agent_id) from None
            port = slot.spec.port_id
            if port in by_port:
                raise _Blame(_backend(f"port {port} is taken twice"), Detail.APPLY, agent_id)
            by_port[port] = intent.for_port(port)
        try:
            extra = sorted(set(by_port) - {p.port_id for p in descriptor.ports})
            if extra:
                raise _backend(f"controls name undeclared ports {extra}")
            controls = [by_port[p.port_id] for p in descriptor.ports if p.port_id in by_port]
            check_controls(controls, descriptor.ports)
        except DomainError as exc:
            raise _Blame(exc, Detail.APPLY, None) from None
        return controls

    def _observe(self, k: int, result: dict[str, Any], batch_id: str,
                 controls: Sequence[PortControl], old: WorldObservation,
                 ) -> tuple[WorldObservation, _Media]:
        assert self.descriptor is not None
        descriptor = self.descriptor
        try:
            if result.get("batchId") != batch_id:
                raise _backend(f"the world applied batch {result.get('batchId')}, expected "
                               f"{batch_id}")
            if result.get("appliedFromStep") != str(k):
                raise _backend(f"the world applied from step {result.get('appliedFromStep')}, "
                               f"expected {k}")
            if result.get("nextStep") != str(k + 1):
                raise _backend(f"the world reached step {result.get('nextStep')}, expected "
                               f"{k + 1}")
            if result.get("appliedControlsDigest") != self._controls_digest:
                raise _backend("the world applied other controls than were sent")
            try:
                new = WorldObservation.from_json(result["observation"])
            except DomainError as exc:
                raise _backend(f"observation: {exc.message}") from None
            if new.boundary != k + 1:
                raise _backend(f"the observation is of boundary {new.boundary}, expected {k + 1}")
            if new.world_time != old.world_time + descriptor.step_duration:
                raise _backend(f"world time {new.world_time} is not {old.world_time} plus one "
                               "step")
            if new.inspection.schema != descriptor.inspection_schema:
                raise _backend("the inspection schema differs from the descriptor's")
            media = self._check_views(descriptor, new, k + 1, Mutation.UNKNOWN)
            self._check_audio(descriptor, new, media)
        except DomainError as exc:
            raise _Blame(exc, Detail.OBSERVATION, self.world_id) from None
        return new, media

    async def _commit(self, k: int, scope: Scope, new: WorldObservation, evaluation: Evaluation,
                      ) -> tuple[dict[str, dict[str, Any]], dict[str, Telemetry]]:
        """Commit every agent: the results and their parsed telemetry, by agent."""
        calls: list[_Call] = []
        # every agent receives the same views: one JSON value shared by every call
        views = [v.to_json() for v in new.sensory_views]
        for agent_id in self._agents_in_order():
            slot = self._slots[agent_id]
            outcome = evaluation.outcomes[agent_id]
            assert slot.prepare_request is not None
            calls.append(self._new_call(agent_id, "Agent.Commit", scope, {
                "agentId": agent_id, "preparedRequestId": slot.prepare_request,
                "nextInput": {"boundary": str(k + 1), "views": views, "structured": None},
                "nextDecisionContext": evaluation.next_contexts[agent_id].to_json(),
                "rewards": [r.to_json() for r in outcome.rewards],
                "taskStimulations": [s.to_json() for s in outcome.stimulations]}))
        results: dict[str, dict[str, Any] | DomainError] = {}
        telemetry: dict[str, Telemetry] = {}

        async def one(call: _Call) -> None:
            agent_id = call.worker_id
            try:
                result = await self._call(call)
                if result.get("committedStep") != str(k + 1):
                    raise _backend(f"Agent.Commit: {agent_id} committed "
                                   f"{result.get('committedStep')}, expected {k + 1}")
                want = typed_digest(evaluation.next_contexts[agent_id])
                if result.get("decisionContextDigest") != want:
                    raise _mismatch(f"Agent.Commit: {agent_id} holds context "
                                    f"{result.get('decisionContextDigest')}, expected {want}")
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
                raise _Blame(got, Detail.COMMIT, agent_id)
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
            await self._duplicate(call, out[agent_id], "duplicate-commit")
        return out, telemetry

    # ------------------------------------------------------------------ trace and publication

    def _record_trace(self, k: int, batch_id: str, controls: Sequence[PortControl],
                      new: WorldObservation, evaluation: Evaluation,
                      commits: Mapping[str, dict[str, Any]], advance: _Call, wall: int) -> None:
        agents = []
        outcome_ids: list[str] = []
        for agent_id in self.agent_ids:
            slot = self._slots[agent_id]
            prepared = slot.prepared or {}
            agents.append({
                "agentId": agent_id, "profileDigest": slot.profile["digest"],
                "ticksAdvanced": prepared.get("ticksAdvanced"),
                "brainTicks": prepared.get("brainTicks"),
                "remainder": prepared.get("remainder"),
                "decisionDigest": typed_digest(slot.decision) if slot.decision else None,
                "committedStep": commits[agent_id]["committedStep"]})
            outcome_ids += [r.event_id for r in evaluation.outcomes[agent_id].rewards]
        behaviour = {
            "scope": self._scope(k).to_json(), "agents": agents, "batchId": batch_id,
            "controlDigest": self._controls_digest,
            "acknowledgedBoundary": str(new.boundary),
            "observationBoundaries": [{"viewId": v.view_id, "producedStep": str(v.produced_step)}
                                      for v in sorted(new.sensory_views,
                                                      key=lambda v: v.view_id)],
            "outcomeIds": outcome_ids, "eventIds": [e.id for e in evaluation.events],
            "publishedBoundary": str(k + 1), "boundaryActions": []}
        operational = {
            "wallTimeNs": time.monotonic_ns() - wall,
            "prepareRequestIds": [{"agentId": a, "requestId": self._slots[a].prepare_request}
                                  for a in self.agent_ids],
            "advanceRequestId": advance.request_id,
            "commitRequestIds": [{"agentId": a, "requestId": self._slots[a].commit_request}
                                 for a in self.agent_ids],
            "busCallIds": [], "captures": []}
        try:
            self.trace.record(behaviour, operational)
        except DomainError as exc:
            raise _Blame(exc, Detail.PUBLISH, None) from None

    def _publish_descriptor(self) -> None:
        assert self.descriptor is not None
        self._descriptor_revision += 1
        agents = []
        for agent_id in self.agent_ids:
            slot = self._slots[agent_id]
            assert slot.graph is not None
            graph = slot.graph.to_json()
            agents.append({"agentId": agent_id, "portId": slot.spec.port_id,
                           "profileDigest": slot.profile["digest"],
                           "datasetDigest": graph["datasetDigest"],
                           "indexDigest": graph["indexDigest"],
                           "neuronCount": graph["neuronCount"],
                           "rateRoles": graph["rateRoles"],
                           "supportedStimuli": graph["supportedStimuli"]})
        body = {
            "sessionId": self.spec.session_id, "revision": str(self._descriptor_revision),
            "compositionDigest": composition_digest(
                self.spec.session_id, self.epoch, contract_digest(),
                [(a, self._slots[a].spec.port_id, self._slots[a].profile["digest"])
                 for a in self.agent_ids]),
            "schedulerId": SCHEDULER_ID, "environment": self.descriptor.to_json(),
            "taskSchema": None if self._progress is None else self._progress.schema.to_json(),
            "agents": agents, "assets": [self._slots[a].profile for a in self.agent_ids]}
        self.snapshots.publish_descriptor(body)
        self.audit.add("publish:descriptor")

    def _check_publication(self, b: int) -> None:
        assert self.descriptor is not None and self.observation is not None
        ports = sorted(p.port_id for p in self.descriptor.ports)
        if ports != sorted(self._slots[a].spec.port_id for a in self.agent_ids):
            raise DomainError.before(ErrorCode.BUFFER_INVALID,
                                     "the agents' ports disagree with the descriptor")
        if self.observation.boundary != b:
            raise DomainError.before(ErrorCode.BUFFER_INVALID,
                                     f"the media are of boundary {self.observation.boundary}, "
                                     f"not {b}")
        for view in self.descriptor.views:
            ref = next((v for v in self.observation.sensory_views
                        if v.view_id == view.view_id), None)
            if ref is None or ref.produced_step != max(0, b - view.observation_delay_steps):
                raise DomainError.before(ErrorCode.BUFFER_INVALID,
                                         f"view {view.view_id} is not the one of boundary {b}")

    def _publish_snapshot(self, b: int, *, observed: bool = False) -> None:
        """Publish boundary `b`. `observed`: a transition's Phase C already checked this
        observation's boundary and view steps (`_observe`), and the ports are bound at bootstrap,
        so `_check_publication` would repeat those checks; bootstrap and restore ask for it."""
        assert self.observation is not None and self.descriptor is not None
        try:
            if not observed:
                self._check_publication(b)
        except DomainError as exc:
            raise _Blame(exc, Detail.PUBLISH, None) from None
        obs = self.observation
        fresh = b > 0
        # the boundary's values, all immutable: the body is built from them only when read
        agents = [(agent_id, slot.telemetry, slot.last_decision if fresh else None,
                   slot.last_controls if fresh else None)
                  for agent_id, slot in ((a, self._slots[a]) for a in self.agent_ids)]
        revision, scope, episode_id = self._descriptor_revision, self._scope(b), \
            self.spec.episode_id
        sequence, progress, event_ids = self._snapshot_sequence, self._progress, \
            tuple(self._last_event_ids)

        def body() -> dict[str, Any]:
            views: list[ViewRef] = list(obs.sensory_views)
            audio: list[AudioRef] = list(obs.audio)
            return {
                "descriptorRevision": str(revision), "scope": scope.to_json(),
                "episodeId": episode_id, "sequence": str(sequence),
                "worldTime": obs.world_time.to_json(),
                "agents": [{
                    "agentId": agent_id,
                    "telemetry": None if telemetry is None else telemetry.to_json(),
                    "selectedDecision": None if decision is None else decision.to_json(),
                    "appliedControls": None if controls is None else controls.to_json()}
                    for agent_id, telemetry, decision, controls in agents],
                "progress": None if progress is None else progress.to_json(),
                "media": {"views": [v.to_json() for v in views],
                          "audio": [a.to_json() for a in audio]},
                "eventIds": list(event_ids)}

        self._snapshot_sequence += 1
        self.snapshots.publish_snapshot_on_read(body)
        self.audit.add(f"publish:{b}")
        self.stats.publications += 1

    # ------------------------------------------------------------------ capture (state.md §5.7)

    async def capture(self, checkpoint_id: str, *, kind: CaptureKind = "durable") -> Capture:
        """Every participant's state and the coordinator's ledgers at the committed boundary
        (`flyd.state.capture`)."""
        return await capture_boundary(self, checkpoint_id, kind=kind)

    async def save(self, checkpoint_id: str, *, kind: CaptureKind = "durable") -> SaveTicket:
        """`capture` through the session's writer (state.md §5.7 steps 2 and 7): a slot is
        reserved before anyone is asked, the capture submitted after; the ticket."""
        writer = self._writer()
        phase = self._machine.phase
        try:
            reservation = writer.reserve()
        except DomainError as exc:
            self.audit.add(f"capture-refused:{checkpoint_id}")
            raise SessionFailure(exc, phase.label, Detail.CAPTURE) from None
        try:
            built = await capture_boundary(self, checkpoint_id, kind=kind)
        except BaseException:
            reservation.release()
            raise
        try:
            return writer.submit(reservation, CaptureSubmission(
                checkpoint_id, built.boundary, built.session_epoch, built.episode_id,
                built.manifest, built.payloads, replaceable=kind == "hot"))
        except DomainError as exc:
            self.audit.add(f"capture-refused:{checkpoint_id}")
            raise SessionFailure(exc, self._machine.phase.label, Detail.CAPTURE) from None

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

    def _append_effect(self, k: int) -> None:
        """§9.2: transition k → k+1's behaviour record, rebased onto `e1`, pending under k+1."""
        writer = None if self.state is None else self.state.writer
        if writer is None:
            return
        record = self.trace.transitions[-1].behaviour
        writer.pending.append(k + 1, self.epoch,
                              EpochRebase(self.epoch, "e1", self.task).apply(record))

    # ------------------------------------------------------------------ restore (state.md §7)

    async def restore(self, checkpoint_id: str | None, proposed_epoch: str, *,
                      store: CheckpointStore | None = None, run_id: int | None = None,
                      guard: Callable[[], object] | None = None) -> RestoreReport:
        """The group install of a stored generation (the head for None) into `proposed_epoch`
        (`flyd.state.restore`). `store` and `run_id` default to the session's `StateContext`;
        `guard` is the node's lease guard (precondition 4)."""
        context = self.state
        if store is not None and run_id is not None:
            context = StateContext(store, run_id,
                                   writer=None if context is None else context.writer,
                                   guard=guard if guard is not None or context is None
                                   else context.guard)
        elif context is not None and guard is not None:
            context = replace(context, guard=guard)
        if context is None:
            raise SessionFailure(DomainError.before(
                ErrorCode.UNSUPPORTED, "this session has no checkpoint store"),
                self._machine.phase.label, Detail.RESTORE)
        return await restore_checkpoint(self, checkpoint_id, proposed_epoch, context)

    def reset(self) -> None:
        """An episode reset: not in v1 (a terminal episode ends a node run, state.md §9.3)."""
        raise DomainError.before(ErrorCode.UNSUPPORTED,
                                 "episode reset is not supported in v1; a terminal episode ends "
                                 "the run")

    # ------------------------------------------------------------------ pause and resume (§6.7)

    def resume(self) -> None:
        phase = self._machine.phase
        if not isinstance(phase, Paused):
            self._fail_now(DomainError(ErrorCode.INVALID_PHASE,
                                       f"resume needs Paused(k); the session is {phase.label}",
                                       Mutation.NONE), Detail.RESUME)
        self._move(Ready(phase.step), Detail.RESUME)
        if self._pacing is not None:
            self._pacing.restart()

    # ------------------------------------------------------------------ status and probes

    async def worker_status(self, worker_id: str, ref: WorkerRef | None = None) -> dict[str, Any]:
        """`Worker.Status` through the full `check_reply`; any failure fails the epoch."""
        boundary = self._machine.committed_boundary()
        scope = None if boundary is None else self._scope(boundary)
        call = self._new_call(worker_id, "Worker.Status", scope, {}, ref)
        result: dict[str, Any] = await self._guarded(lambda: self._blamed(call))
        return result

    async def probe_raw(self, worker_id: str, method: str, scope: Scope | None,
                        params: dict[str, Any], ref: WorkerRef | None = None) -> dict[str, Any]:
        """One request with a fresh serial; the result, or its DomainError raised; session state
        untouched."""
        call = self._new_call(worker_id, method, scope, params, ref)
        outcome = await self._send(call, self.deadlines.probe)
        if isinstance(outcome, Expired):
            raise _backend(f"{method}: {worker_id} did not answer within "
                           f"{format_duration(self.deadlines.probe)}")
        if isinstance(outcome, Refused):
            raise outcome.error
        if outcome.outcome.error is not None:
            raise outcome.outcome.error
        assert outcome.outcome.result is not None
        return outcome.outcome.result

    # ------------------------------------------------------------------ injections (§6.13)

    async def _duplicate(self, call: _Call, original: dict[str, Any] | None, what: str) -> None:
        outcome = await self._send(call, self.deadlines.probe)
        code: str | None = None
        identical = False
        if isinstance(outcome, Expired):
            code = ErrorCode.BACKEND_FAILURE.value
        elif isinstance(outcome, Refused):
            code = outcome.error.code.value
        else:
            try:
                result = self.check_reply(call, outcome.outcome)
                identical = canonical(result) == canonical(original)
            except DomainError as exc:
                code = exc.code.value
        self.injection_log.append(InjectionOutcome(what, code, identical))

    async def _advance_injections(self, advance: _Call, result: dict[str, Any],
                                  descriptor: EnvironmentDescriptor) -> None:
        inj = self.injections
        if inj.altered_advance_controls:
            params = dict(advance.params)
            controls = [dict(c) for c in params["controls"]]
            first = dict(controls[0])
            buttons = [dict(b) for b in first["buttons"]]
            buttons[0]["down"] = not buttons[0]["down"]
            first["buttons"] = buttons
            controls[0] = first
            params["controls"] = controls
            outcome = await self._send(advance, self.deadlines.probe, params=params)
            code: str | None = None
            if isinstance(outcome, Refused):
                code = outcome.error.code.value
            elif isinstance(outcome, Answered):
                try:
                    self.check_reply(advance, outcome.outcome)
                except DomainError as exc:
                    code = exc.code.value
            self.injection_log.append(InjectionOutcome("altered-advance-controls", code,
                                                       code is None))
        if inj.consume_advance_artifact_then_retry and descriptor.views:
            view = descriptor.views[0]
            before = self._pending_media.views.pop(view.view_id, None)
            identical = False
            code = None
            outcome = await self._send(advance, self.deadlines.probe)
            try:
                replay = await self._settle(advance, outcome)
                obs = WorldObservation.from_json(replay["observation"])
                ref = next(v for v in obs.sensory_views if v.view_id == view.view_id)
                data = decode_view(ref, view, Mutation.UNKNOWN)
                identical = data == before and canonical(replay) == canonical(result)
                self._pending_media.views[view.view_id] = data
            except DomainError as exc:
                code = exc.code.value
                if before is not None:
                    self._pending_media.views[view.view_id] = before
            self.injection_log.append(InjectionOutcome("cached-artifact-after-consumption",
                                                       code, identical))

    async def _lose_advance_result(self, advance: _Call, batch_id: str) -> dict[str, Any]:
        pending: PendingCall | None = None
        try:
            pending = await self._client.start_call(
                advance.ref.service, advance.method, advance.payload(),
                expected_incarnation=advance.ref.service_incarnation)
        except BusError as exc:
            raise from_bus_error(advance.method, exc) from None
        found = False
        # at most LOSS_POLLS polls and, all of them together, the resolve budget
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.deadlines.resolve):
                for _ in range(LOSS_POLLS):
                    status_call = self._new_call(self.world_id, "Worker.Status", None, {})
                    outcome = await self._send(status_call, self.deadlines.probe)
                    if isinstance(outcome, Answered) and outcome.outcome.result is not None:
                        st = outcome.outcome.result
                        if st.get("lastBatchId") == batch_id or advance.request_id in (
                                st.get("activeRequestId"), st.get("lastCompletedRequestId")):
                            found = True
                            break
                    await asyncio.sleep(RESOLVE_PAUSE)
        self.injection_log.append(InjectionOutcome("status-after-loss", None, found))
        state = "call-gone"
        try:
            async with asyncio.timeout(self.deadlines.probe):
                state = await pending.cancel()
        except (BusError, TimeoutError):
            pass
        self.injection_log.append(InjectionOutcome("lost-advance-result", None,
                                                   state != "cancelled-before-dispatch"))
        return await self._resolve(advance)
