"""The coordinator's group install (design/state.md §7): one checkpoint into every participant and
the coordinator, as a group, into a new epoch, or nothing.

Why a group: a lockstep session is one state. A world restored without its agents, or agents
activated beside a world that refused, would run half a session; so every participant stages
before anyone activates, the coordinator's own ledgers are checked before the first activation,
and anything that goes wrong after the first stage fails the epoch and taints whoever might
hold the proposed state, until a replacement clears it.

Who does what: the coordinator runs a restore in three steps and owns every change to its own
state. `prepare(target, calls, id, epoch, state)` checks the preconditions and returns the
`Install` it admits; the coordinator enters `Restoring(k)` and marks the epoch used;
`install(plan, state)` runs the install through the session's call engine (`flyd.session.calls`) and
returns what it installed (`Installed`: observation, media, audio, progress, agent slots, the
durable mark, the epoch and the `RestoreReport`), which the coordinator adopts before it
publishes and moves to `Paused(k)`. Neither function changes the coordinator's own state: they
read the public side a `RestoreTarget` names, send through the `CallEngine` they are handed, and
`install` restores the session's shared task, trace and pending effects to k.

Rules:

- Preconditions, in order (`prepare`); a failure raises `SessionFailure` (detail
  `restore`) and changes nothing, taints nobody, leaves the phase and the fence as they were:
  1. phase `Failed`, or an unstepped `Ready(0)` (cold install) — else `INVALID_PHASE`;
  2. the proposed epoch is `e<N>` and was never used by this session — else `STALE_EPOCH`;
  3. no tainted participant (environment first, then agents sorted) — else `INVALID_PHASE`;
  4. `guard()` (the node's lease guard; `LeaseLost` propagates unchanged);
  5. `store.select(run, id, for_restore=True)` and `store.read` (S1–S5);
  6. the recorded compatibility block equals the live one (design/state.md §3);
  7. shape: environment worker, agent set, port map, `helperState == []`, then each agent's
     agentId, profileDigest and seed against the configuration — `INCOMPATIBLE_STATE`;
  8. every payload fits one bus frame as `StageRestoreParams` — else `UNSUPPORTED`;
  9. each participant replaced since the failure passes `Worker.Hello` with the bootstrap
     checks plus `checkpoint-v1`.
- Install, after `→ Restoring(k)`: import, stage (environment first, then
  agents by id, one at a time), validate the coordinator ledgers (design/state.md §7.3), activate
  (same order), check the results, acknowledge, install the coordinator state, publish,
  `→ Paused(k)`.
- Verified restore (design/session.md §6.12, amendment 2026-12-07): the environment's activation
  reports `observationDigests`, its views as its restored world renders them now, in the
  behaviour record's form; they and the restored inspection are compared with the checkpoint's
  record of boundary k (the prior inspection ledger, whose views are exactly the last
  behaviour record's `observationBoundaries`). The first difference (views by id, then the
  inspection) fails the install `RESTORE_DIVERGED`, naming the world and the view: a restored
  world that does not observe what its checkpoint recorded never runs on silently. A served
  observation that is not the recorded one stays a `BACKEND_FAILURE` (the world broke the
  protocol; its state is not what is in question).
- A failure after `Restoring(k)` is `InstallAborted`, on which the coordinator fails the epoch
  (audit `fail:restore[:<participant>]`), keeping the refusing participant's code and naming
  it (a worker id or `coordinator`). Tainted (`InstallAborted.tainted`, `Install.tainted`):
  every worker that staged or activated, plus any whose stage or activation stayed uncertain
  (an expired call, or an error whose mutation is not `none`). The imported buffers are
  dropped; nothing is installed in the coordinator.

Decisions where the spec is silent:
- A proposed epoch must have the form `e<N>` (flyd sessions always do, design/state.md §0); another
  Id is refused `INVALID_ARGUMENT` at precondition 2.
- An epoch counts as used once the session entered `Restoring(k)` with it (a worker may have
  adopted it), even when the install then failed; precondition refusals use nothing.
- Precondition 8 measures `canonical(StageRestoreParams)` plus `FRAME_OVERHEAD` bytes for the
  bus envelope around it, against the router's `maxEnvelopeBytes` as the coordinator's client
  learnt it at hello.
- "Replaced since the failure" is every participant passed to `replace_participant` since the
  last successful install (or bootstrap).
- `report.imported` lists the import handles in payload write order; `tokens` lists `(worker,
  token)` in stage order.
- The `session.recovered` event goes to the coordinator's `events` outbox and to the log
  (structlog `session.recovered`); `abandonedFrom`/`abandonedTo` are null when nothing of the
  failed epoch lay beyond k.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, Protocol

import structlog

from flyd.session.audio import AudioTimelines
from flyd.session.calls import Call, CallEngine
from flyd.session.fence import Detail, SessionFailure
from flyd.session.media import Media, check_views
from flyd.session.phase import Failed
from flyd.session.view import SessionView
from flyd.state.checkpoints import CheckpointStore
from flyd.state.compat import AgentIdentity, Compatibility
from flyd.state.effects import EPOCH_ID
from flyd.state.envelope import (
    COORDINATOR_ADMISSION,
    PRIOR_INSPECTION,
    TASK_LEDGER,
    WORLD_PAYLOAD,
    Envelope,
)
from workers.artifacts import open_attached
from workers.state import CHECKPOINT_CAPABILITY, PAYLOAD_CONTENT_TYPE, PAYLOAD_VERSION
from workers.types.canonical import canonical, digest_bytes, digest_of, parse_strict, typed_digest
from workers.types.contract import contract_digest
from workers.types.datatypes import (
    Attached,
    EnvironmentDescriptor,
    Graph,
    MediaBlob,
    Telemetry,
    TypedValue,
    WorldObservation,
    decode_view,
)
from workers.types.domain import DomainError, ErrorCode, Mutation, Scope, is_id, parse_u64
from workers.types.rpc import Expired
from workers.types.ticks import RationalNs

if TYPE_CHECKING:
    from flyd.state.writer import CheckpointWriter

__all__ = [
    "COORDINATOR",
    "FRAME_OVERHEAD",
    "ImportedBuffer",
    "Install",
    "InstallAborted",
    "Installed",
    "InstalledAgent",
    "RestoreReport",
    "RestoreTarget",
    "StateContext",
    "install",
    "prepare",
    "recovered",
]

log = structlog.get_logger("flyd.restore")

COORDINATOR: Final = "coordinator"
FRAME_OVERHEAD: Final = 4096

_handles = itertools.count(1)


@dataclass(frozen=True)
class StateContext:
    """What a session's coordinator needs of the state layer (design/session.md §6.1): the store,
    the writer (None: no captures are submitted), the node's lease guard (None in tests and
    tools) and the run whose generations it installs."""

    store: CheckpointStore
    run_id: int
    writer: CheckpointWriter | None = None
    guard: Callable[[], object] | None = None

    @staticmethod
    def of(state: StateContext | None, store: CheckpointStore | None, run_id: int | None,
           guard: Callable[[], object] | None) -> StateContext | None:
        """A restore's context: `store` and `run_id` when both are given (keeping the session's
        writer), else the session's `state`; `guard`, when given, replaces the session's."""
        if store is not None and run_id is not None:
            return StateContext(store, run_id, writer=None if state is None else state.writer,
                                guard=guard if guard is not None or state is None
                                else state.guard)
        if state is not None and guard is not None:
            return replace(state, guard=guard)
        return state


class RestoreTarget(SessionView, Protocol):
    """What a restore reads of the session it installs into (the coordinator's public side)."""

    def participants(self) -> list[str]: ...
    def tainted(self) -> list[str]: ...
    def bindings(self) -> list[tuple[str, str]]: ...
    def epoch_used(self, epoch: str) -> bool: ...
    def was_replaced(self, worker_id: str) -> bool: ...


@dataclass(frozen=True)
class ImportedBuffer:
    """One payload as a fresh immutable buffer of this node (design/state.md §7.2 step 2)."""

    handle: str
    name: str
    data: bytes
    digest: str


@dataclass(frozen=True)
class RestoreReport:
    """What a group install returns (design/state.md §7.2 step 11): the checkpoint and boundary
    installed, the new epoch, who staged and activated with their tokens, the imported buffers
    and the abandoned range, for recovery to log and count."""

    checkpoint_id: str
    boundary: int
    epoch: str
    staged: tuple[str, ...]
    activated: tuple[str, ...]
    tokens: tuple[tuple[str, str], ...]
    imported: tuple[str, ...]
    abandoned: tuple[int, int] | None


class _Abort(Exception):
    """A failure after `Restoring(k)`: the error and whom it names."""

    def __init__(self, error: DomainError, participant: str) -> None:
        super().__init__(error, participant)
        self.error = error
        self.participant = participant


def _incompatible(message: str) -> DomainError:
    return DomainError.before(ErrorCode.INCOMPATIBLE_STATE, message)


class InstallAborted(Exception):
    """The install failed after `Restoring(k)`: the error, whom it names (a worker id or
    `coordinator`) and the workers it taints."""

    def __init__(self, error: DomainError, participant: str, tainted: frozenset[str]) -> None:
        super().__init__(error, participant, tainted)
        self.error = error
        self.participant = participant
        self.tainted = tainted


@dataclass
class Install:
    """The bookkeeping of one install attempt (`prepare` makes it, `install` runs it)."""

    target: RestoreTarget
    calls: CallEngine
    env: Envelope
    k: int
    epoch: str
    staged: dict[str, str] = field(default_factory=dict)
    stage_requests: dict[str, str] = field(default_factory=dict)
    activated: list[str] = field(default_factory=list)
    activate_requests: dict[str, str] = field(default_factory=dict)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    buffers: dict[str, ImportedBuffer] = field(default_factory=dict)
    uncertain: set[str] = field(default_factory=set)
    #: the restored media by reference (topics.md §14.2 rule 7): the world's activation
    #: result's attachments, opened, and the ids the engine's connection holds for them
    attached: dict[str, Attached] = field(default_factory=dict)
    held: tuple[str, ...] = ()

    @property
    def manifest(self) -> dict[str, Any]:
        return self.env.manifest

    @property
    def tainted(self) -> frozenset[str]:
        """Every worker that staged, or whose stage or activation stayed uncertain."""
        return frozenset(self.staged) | self.uncertain


@dataclass(frozen=True)
class InstalledAgent:
    """One agent's slot as the checkpoint recorded it."""

    context: TypedValue
    context_digest: str
    graph: Graph
    telemetry: Telemetry
    tick_duration: RationalNs
    warmup_ticks: int


@dataclass(frozen=True)
class Installed:
    """What a successful install leaves the coordinator to adopt (design/state.md §7.2 steps 8–10):
    the boundary's observation, decoded views and audio timelines, the task's progress, every
    agent's slot, the durable mark, the new epoch, and the report. The task, the trace and the
    writer's pending effects are already restored to k."""

    report: RestoreReport
    observation: WorldObservation
    media: Media
    audio: AudioTimelines
    progress: TypedValue
    agents: Mapping[str, InstalledAgent]

    @property
    def boundary(self) -> int:
        return self.report.boundary

    @property
    def epoch(self) -> str:
        return self.report.epoch

    @property
    def durable(self) -> tuple[str, int]:
        return (self.report.checkpoint_id, self.report.boundary)


# --------------------------------------------------------------------------------------------
# preconditions (design/state.md §7.1)


def _refuse(calls: CallEngine, error: DomainError,
            participant: str | None = None) -> SessionFailure:
    return SessionFailure(error, calls.phase.label, Detail.RESTORE, participant)


def _check_phase(calls: CallEngine) -> None:
    machine = calls.machine
    if isinstance(machine.phase, Failed) or machine.is_unstepped_zero():
        return
    raise _refuse(calls, DomainError.before(
        ErrorCode.INVALID_PHASE, "a restore needs a failed epoch or an unstepped Ready(0); the "
        f"session is {machine.phase.label}"))


def _check_epoch(target: RestoreTarget, calls: CallEngine, proposed: str) -> None:
    if not is_id(proposed) or EPOCH_ID.fullmatch(proposed) is None:
        raise _refuse(calls, DomainError.invalid(
            f"proposed epoch {proposed!r} is not a session epoch e<N>"))
    if target.epoch_used(proposed):
        raise _refuse(calls, DomainError.before(
            ErrorCode.STALE_EPOCH, f"epoch {proposed} was already used by this session; a "
            "restore needs a new epoch"))


def _check_taint(target: RestoreTarget, calls: CallEngine) -> None:
    tainted = target.tainted()
    if tainted:
        raise _refuse(calls, DomainError.before(
            ErrorCode.INVALID_PHASE, f"participant {tainted[0]} took part in an abandoned "
            "install; replace it first"), tainted[0])


def _check_shape(target: RestoreTarget, manifest: Mapping[str, Any]) -> None:
    world_id = manifest["environment"]["workerId"]
    if world_id != target.world_id:
        raise _incompatible(f"checkpoint {manifest['checkpointId']}: environment {world_id} is "
                            f"not this composition's {target.world_id}")
    agents = [a["agentId"] for a in manifest["agents"]]
    if agents != target.agent_ids:
        raise _incompatible(f"checkpoint {manifest['checkpointId']}: agents {agents} are not "
                            f"this composition's {target.agent_ids}")
    recorded = sorted((p["portId"], p["agentId"]) for p in manifest["portMap"])
    if recorded != sorted(target.bindings()):
        raise _incompatible(f"checkpoint {manifest['checkpointId']}: portMap {recorded} differs "
                            f"from the bindings {sorted(target.bindings())}")
    if manifest["helperState"] != []:
        raise _incompatible(f"checkpoint {manifest['checkpointId']}: helperState "
                            f"{manifest['helperState']} is not supported in v1")
    for entry in manifest["agents"]:
        slot = target.slots[entry["agentId"]]
        for name, want in (("profileDigest", slot.profile["digest"]), ("seed", slot.seed)):
            if entry[name] != want:
                raise _incompatible(f"checkpoint {manifest['checkpointId']}: agent "
                                    f"{entry['agentId']}'s {name} {entry[name]} differs from "
                                    f"the configured {want}")


def _stage_params(world_id: str, manifest: Mapping[str, Any], worker: str,
                  data: bytes) -> dict[str, Any]:
    if worker == world_id:
        compat = digest_of(manifest["compatibility"])
    else:
        entry = next(a for a in manifest["agents"] if a["agentId"] == worker)
        compat = AgentIdentity.from_json(
            {name: entry[name] for name in ("agentId", "profileDigest", "datasetDigest",
                                            "indexDigest", "modelVersion",
                                            "plasticityVersion", "seed")}).digest()
    blob = MediaBlob(PAYLOAD_CONTENT_TYPE, len(data), digest_bytes(data),
                     base64.b64encode(data).decode("ascii"))
    return {"checkpointId": manifest["checkpointId"], "sourceScope": manifest["sourceScope"],
            "compatibilityDigest": compat, "payload": blob.to_json()}


def _payload_of(worker: str, world_id: str) -> str:
    return WORLD_PAYLOAD if worker == world_id else f"agent-{worker}"


def _check_frames(target: RestoreTarget, calls: CallEngine, env: Envelope) -> None:
    limit = calls.client.limits.get("maxEnvelopeBytes", 0)
    for worker in target.participants():
        name = _payload_of(worker, target.world_id)
        size = len(canonical(_stage_params(target.world_id, env.manifest, worker,
                                           env.payload(name)))) + FRAME_OVERHEAD
        if limit and size > limit:
            raise DomainError.before(
                ErrorCode.UNSUPPORTED, f"payload {name} needs a frame of {size} bytes as "
                f"StageRestoreParams; one bus frame holds {limit}")


async def _hello(target: RestoreTarget, calls: CallEngine, worker: str) -> None:
    role = "environment" if worker == target.world_id else "agent"
    step_capability = "world-step-v1" if role == "environment" else "agent-step-v1"
    call = calls.new_call(worker, "Worker.Hello", None, {
        "sessionId": target.spec.session_id, "expectedWorkerId": worker, "role": role,
        "supportedMajors": [1]})
    try:
        result = await calls.call(call)
    except DomainError as exc:
        raise _refuse(calls, DomainError.before(exc.code, exc.message), worker) from None
    problem: DomainError | None = None
    capabilities = result.get("capabilities", [])
    if result.get("workerId") != worker or result.get("role") != role:
        problem = DomainError.before(
            ErrorCode.IDENTITY_MISMATCH, f"Worker.Hello: {worker} answers as "
            f"{result.get('workerId')}/{result.get('role')}, expected {worker}/{role}")
    elif result.get("contractDigest") != contract_digest():
        problem = DomainError.before(
            ErrorCode.IDENTITY_MISMATCH, f"Worker.Hello: {worker} has contract "
            f"{result.get('contractDigest')}, expected {contract_digest()}")
    else:
        for capability in (step_capability, CHECKPOINT_CAPABILITY):
            if capability not in capabilities:
                problem = DomainError.before(ErrorCode.UNSUPPORTED,
                                             f"Worker.Hello: {worker} lacks {capability}")
                break
    if problem is not None:
        raise _refuse(calls, problem, worker)
    calls.pin(worker, str(result["incarnationId"]))
    target.audit.add(f"hello:{worker}")


async def prepare(target: RestoreTarget, calls: CallEngine, checkpoint_id: str | None,
                  proposed: str, state: StateContext) -> Install:
    """The preconditions (design/state.md §7.1), in order; the install they admit (nothing is
    changed yet)."""
    _check_phase(calls)
    _check_epoch(target, calls, proposed)
    _check_taint(target, calls)
    if state.guard is not None:
        state.guard()
    try:
        record = await state.store.select(state.run_id, checkpoint_id, for_restore=True)
        env = await state.store.read(record)
        assert target.descriptor is not None
        env.compatibility.compare(Compatibility.of(target.descriptor),
                                  checkpoint_id=env.checkpoint_id)
        _check_shape(target, env.manifest)
        _check_frames(target, calls, env)
    except DomainError as exc:
        raise _refuse(calls, exc) from None
    for worker in target.participants():
        if target.was_replaced(worker):
            await _hello(target, calls, worker)
    return Install(target, calls, env, env.source_scope.step, proposed)


# --------------------------------------------------------------------------------------------
# the install (design/state.md §7.2)


def _import(install: Install) -> None:
    env = install.env
    listed = {p["name"]: p["digest"] for p in install.manifest["payloads"]}
    for name, data in env.payloads:
        digest = hashlib.sha256(data).hexdigest()
        if digest != listed.get(name):
            raise _Abort(_incompatible(f"payload {name} does not hash to its recorded digest"),
                         COORDINATOR)
        handle = f"imp-{next(_handles)}"
        install.buffers[name] = ImportedBuffer(handle, name, bytes(data), digest)
    install.target.audit.add(f"imported:{env.checkpoint_id}@{install.k}")


async def _ask(install: Install, worker: str, call: Call) -> dict[str, Any]:
    """One stage or activation; a refusal or an uncertain outcome aborts the install."""
    calls = install.calls
    outcome = await calls.send(call, calls.deadline_of(call.method))
    try:
        return await calls.settle(call, outcome)
    except DomainError as exc:
        if exc.mutation != Mutation.NONE or isinstance(outcome, Expired):
            install.uncertain.add(worker)
        if exc.code == ErrorCode.RESTORE_DIVERGED:  # the world found it itself: name them
            raise _diverged(install, worker, exc.message.removeprefix(f"{call.method}: "),
                            call.method, exc.mutation) from None
        raise _Abort(exc, worker) from None


async def _stage(install: Install) -> None:
    target = install.target
    scope = Scope(target.spec.session_id, install.epoch, install.k)
    for worker in target.participants():
        name = _payload_of(worker, target.world_id)
        params = _stage_params(target.world_id, install.manifest, worker,
                               install.buffers[name].data)
        call = install.calls.new_call(worker, "State.StageRestore", scope, params)
        result = await _ask(install, worker, call)
        install.staged[worker] = str(result.get("restoreToken"))
        install.stage_requests[worker] = call.request_id
        target.audit.add(f"staged:{worker}")
        if result.get("checkpointId") != install.env.checkpoint_id:
            raise _Abort(DomainError(ErrorCode.IDENTITY_MISMATCH, f"State.StageRestore: {worker} "
                                     f"staged {result.get('checkpointId')}, expected "
                                     f"{install.env.checkpoint_id}", Mutation.UNKNOWN), worker)


async def _activate(install: Install) -> None:
    target = install.target
    scope = Scope(target.spec.session_id, install.epoch, install.k)
    for worker in target.participants():
        call = install.calls.new_call(worker, "State.ActivateRestore", scope,
                                      {"restoreToken": install.staged[worker]})
        install.uncertain.add(worker)  # from here on it may hold the proposed epoch
        result = await _ask(install, worker, call)
        received = install.calls.take_attachments(call)
        if received:
            install.held += tuple(a.artifact_id for a in received)
            install.attached.update(open_attached(install.calls.client, received))
        install.results[worker] = result
        install.activated.append(worker)
        install.activate_requests[worker] = call.request_id
        target.audit.add(f"activated:{worker}")


# -- design/state.md §7.3 ledgers


def _ledger(install: Install, name: str, kind: str) -> dict[str, Any]:
    data = install.buffers[name].data
    try:
        doc = parse_strict(data)
        if canonical(doc) != data:
            raise DomainError.invalid("not canonical JSON")
    except DomainError as exc:
        raise _Abort(DomainError.invalid(f"{name}: {exc.message}"), COORDINATOR) from None
    if not isinstance(doc, dict):
        raise _Abort(DomainError.invalid(f"{name}: not a JSON object"), COORDINATOR)
    expected = {"payloadVersion": PAYLOAD_VERSION, "kind": kind,
                "checkpointId": install.env.checkpoint_id, "committedStep": str(install.k)}
    for key, want in expected.items():
        if doc.get(key) != want:
            raise _Abort(_incompatible(f"{name}: {key} is {doc.get(key)!r}, expected {want!r}"),
                         COORDINATOR)
    return doc


@dataclass(frozen=True)
class _Ledgers:
    task: dict[str, Any]
    inspection: dict[str, Any]
    executors: dict[str, dict[str, Any]]
    admission: dict[str, Any]
    task_state: bytes


def _validate_ledgers(install: Install) -> _Ledgers:
    target = install.target
    manifest = install.manifest
    descriptor = target.descriptor
    assert descriptor is not None

    def fail(message: str) -> _Abort:
        return _Abort(_incompatible(message), COORDINATOR)

    executors: dict[str, dict[str, Any]] = {}
    for entry in manifest["agents"]:
        agent_id = entry["agentId"]
        doc = _ledger(install, f"executor-{agent_id}", "executor")
        slot = doc.get("slot")
        if doc.get("agentId") != agent_id or not isinstance(slot, dict):
            raise fail(f"executor-{agent_id}: not the executor ledger of {agent_id}")
        for key in ("brainTicks", "remainder"):
            if slot.get(key) != entry[key]:
                raise fail(f"executor-{agent_id}: {key} {slot.get(key)} differs from the "
                           f"manifest's {entry[key]}")
        executors[agent_id] = doc
    task = _ledger(install, TASK_LEDGER, TASK_LEDGER)
    try:
        blob = task["task"]
        task_state = base64.b64decode(blob["data"], validate=True)
        if digest_bytes(task_state) != blob["digest"]:
            raise _incompatible("the task state does not hash to its digest")
        copy.deepcopy(target.task).restore(task_state)
        contexts = {c["agentId"]: TypedValue.from_json(c["context"]) for c in task["contexts"]}
    except (DomainError, KeyError, TypeError, ValueError) as exc:
        message = exc.message if isinstance(exc, DomainError) else f"{type(exc).__name__}: {exc}"
        raise fail(f"{TASK_LEDGER}: {message}") from None
    if sorted(contexts) != target.agent_ids:
        raise fail(f"{TASK_LEDGER}: contexts for {sorted(contexts)}, expected "
                   f"{target.agent_ids}")
    for agent_id, context in contexts.items():
        want = executors[agent_id]["slot"].get("decisionContextDigest")
        if typed_digest(context) != want:
            raise fail(f"{TASK_LEDGER}: {agent_id}'s context digest {typed_digest(context)} "
                       f"differs from the slot's {want}")
    inspection = _ledger(install, PRIOR_INSPECTION, PRIOR_INSPECTION)
    if inspection.get("worldTime") != manifest["worldTime"]:
        raise fail(f"{PRIOR_INSPECTION}: worldTime {inspection.get('worldTime')} differs from "
                   f"the manifest's {manifest['worldTime']}")
    try:
        recorded = TypedValue.from_json(inspection.get("inspection"))
    except DomainError as exc:
        raise fail(f"{PRIOR_INSPECTION}: {exc.message}") from None
    if recorded.schema != descriptor.inspection_schema:
        raise fail(f"{PRIOR_INSPECTION}: the inspection schema is not the descriptor's")
    views = sorted(v.get("viewId") for v in inspection.get("views", []))
    if views != sorted(v.view_id for v in descriptor.views):
        raise fail(f"{PRIOR_INSPECTION}: views {views} are not the declared views")
    streams = sorted(a.get("streamId") for a in inspection.get("audioPositions", []))
    if streams != sorted(a.stream_id for a in descriptor.audio):
        raise fail(f"{PRIOR_INSPECTION}: audio positions {streams} are not the declared "
                   "streams")
    admission = _ledger(install, COORDINATOR_ADMISSION, COORDINATOR_ADMISSION)
    watermarks = manifest["coordinator"]["eventWatermarks"]
    if admission.get("eventWatermarks") != watermarks:
        raise fail(f"{COORDINATOR_ADMISSION}: eventWatermarks "
                   f"{admission.get('eventWatermarks')} differ from the manifest's {watermarks}")
    return _Ledgers(task, inspection, executors, admission, task_state)


# -- design/state.md §7.2 step 6


def _check_results(install: Install, ledgers: _Ledgers) -> WorldObservation:
    target = install.target
    descriptor = target.descriptor
    assert descriptor is not None
    k = install.k
    observation: WorldObservation | None = None
    for worker in target.participants():
        result = install.results[worker]

        def fail(message: str, who: str = worker) -> _Abort:
            return _Abort(DomainError(ErrorCode.BACKEND_FAILURE,
                                      f"State.ActivateRestore: {who} {message}",
                                      Mutation.UNKNOWN), who)

        if result.get("checkpointId") != install.env.checkpoint_id:
            raise fail(f"activated {result.get('checkpointId')}")
        if result.get("committedStep") != str(k):
            raise fail(f"committed step {result.get('committedStep')}, expected {k}")
        if worker != target.world_id:
            if result.get("observation") is not None:
                raise fail("returned an observation")
            if result.get("observationDigests") is not None:
                raise fail("returned observationDigests")
            continue
        try:
            observation = WorldObservation.from_json(result.get("observation"))
        except DomainError as exc:
            raise fail(f"returned no observation: {exc.message}") from None
        _check_observation(observation, descriptor, install, ledgers, fail)
        _check_current(result.get("observationDigests"), observation, descriptor, install,
                       ledgers, fail)
    assert observation is not None
    return observation


def _diverged(install: Install, world: str, what: str,
              method: str = "State.ActivateRestore",
              mutation: Mutation = Mutation.UNKNOWN) -> _Abort:
    """`RESTORE_DIVERGED` naming the world and what differs (design/session.md §6.12 amendment)."""
    return _Abort(DomainError(
        ErrorCode.RESTORE_DIVERGED,
        f"{method}: restored world {world} diverged from checkpoint "
        f"{install.env.checkpoint_id} at boundary {install.k}: {what}", mutation), world)


def _check_current(reported: Any, observation: WorldObservation,
                   descriptor: EnvironmentDescriptor, install: Install, ledgers: _Ledgers,
                   fail: Callable[[str], _Abort]) -> None:
    """Verified restore: what the restored world observes now (`observationDigests`, its
    views rendered from the restored state) and its inspection (the agents' structured input)
    against the checkpoint's record of boundary k (the prior inspection, whose views are the
    last behaviour record's `observationBoundaries`). The first difference, views by id first,
    fails the install `RESTORE_DIVERGED`; a malformed report is the world's `BACKEND_FAILURE`."""
    world = install.target.world_id
    declared = sorted(v.view_id for v in descriptor.views)
    if not isinstance(reported, list) or not all(
            isinstance(e, dict) and set(e) == {"viewId", "producedStep", "digest"}
            for e in reported):
        raise fail("returned no observationDigests [{viewId, producedStep, digest}]")
    if [e["viewId"] for e in reported] != declared:
        raise fail(f"returned observationDigests of views "
                   f"{[e['viewId'] for e in reported]}, not the declared views {declared}")
    recorded = {v["viewId"]: v for v in ledgers.inspection["views"]}
    for entry in reported:
        want = recorded[entry["viewId"]]
        if entry["producedStep"] != want["producedStep"] or entry["digest"] != want["digest"]:
            raise _diverged(install, world,
                            f"view {entry['viewId']} is frame {entry['producedStep']} with "
                            f"digest {entry['digest']}; the checkpoint recorded frame "
                            f"{want['producedStep']} with digest {want['digest']}")
    recorded_input = TypedValue.from_json(ledgers.inspection["inspection"])
    if observation.inspection.canonical_bytes() != recorded_input.canonical_bytes():
        raise _diverged(install, world,
                        f"its inspection (the agents' structured input) has digest "
                        f"{typed_digest(observation.inspection)}; the checkpoint recorded "
                        f"{typed_digest(recorded_input)}")


def _check_observation(observation: WorldObservation, descriptor: EnvironmentDescriptor,
                       install: Install, ledgers: _Ledgers,
                       fail: Callable[[str], _Abort]) -> None:
    k = install.k
    if observation.boundary != k:
        raise fail(f"restored boundary {observation.boundary}, expected {k}")
    if observation.world_time != RationalNs.from_json(install.manifest["worldTime"]):
        raise fail(f"restored world time {observation.world_time}, the checkpoint's is "
                   f"{install.manifest['worldTime']}")
    if observation.audio:
        raise fail("returned audio with the restored observation")
    recorded = {v["viewId"]: v for v in ledgers.inspection["views"]}
    by_id = {v.view_id: v for v in observation.sensory_views}
    for view in descriptor.views:
        ref = by_id.get(view.view_id)
        want = max(0, k - view.observation_delay_steps)
        if ref is None or ref.produced_step != want:
            raise fail(f"restored view {view.view_id} not at producedStep {want}")
        if ref.pixels.digest != recorded[view.view_id]["digest"]:
            raise fail(f"restored view {view.view_id} with digest {ref.pixels.digest}; the "
                       f"checkpoint recorded {recorded[view.view_id]['digest']}")
        try:
            decode_view(ref, view, Mutation.UNKNOWN, install.attached)
        except DomainError as exc:
            raise fail(exc.message) from None


async def _acknowledge(install: Install) -> None:
    for worker in install.target.participants():
        ids = [install.stage_requests[worker], install.activate_requests[worker]]
        try:
            await install.calls.acknowledge(worker, ids)
        except Exception as exc:  # a `Blame` of a bad acknowledgement, or a DomainError
            error = getattr(exc, "error", exc)
            if not isinstance(error, DomainError):
                raise
            raise _Abort(error, worker) from None


# -- design/state.md §7.2 steps 8–10


def _installed(install: Install, ledgers: _Ledgers, observation: WorldObservation,
               state: StateContext) -> Installed:
    """The coordinator state to install, with the task, the trace and the pending effects
    restored to k."""
    target = install.target
    descriptor = target.descriptor
    assert descriptor is not None
    k = install.k
    audio = AudioTimelines.restored(descriptor, ledgers.inspection["audioPositions"])
    media = check_views(descriptor, observation, k, Mutation.UNKNOWN, install.attached)
    media.held, install.held = install.held, ()
    target.task.restore(ledgers.task_state)
    task = ledgers.task
    contexts = {c["agentId"]: TypedValue.from_json(c["context"]) for c in task["contexts"]}
    agents: dict[str, InstalledAgent] = {}
    for agent_id in target.agent_ids:
        saved = ledgers.executors[agent_id]["slot"]
        context = contexts[agent_id]
        agents[agent_id] = InstalledAgent(
            context, typed_digest(context), Graph.from_json(saved["graph"]),
            Telemetry.from_json(saved["telemetry"]), RationalNs.from_json(saved["tickDuration"]),
            parse_u64(saved["warmupTicks"]))
    progress = TypedValue.from_json(task["progress"])
    abandoned = target.trace.cut(k)
    if state.writer is not None:
        state.writer.pending.rewind(k)
    report = RestoreReport(checkpoint_id=install.env.checkpoint_id, boundary=k,
                           epoch=install.epoch, staged=tuple(install.staged),
                           activated=tuple(install.activated),
                           tokens=tuple(install.staged.items()),
                           imported=tuple(b.handle for b in install.buffers.values()),
                           abandoned=abandoned)
    return Installed(report, observation, media, audio, progress, agents)


def recovered(session_id: str, old_epoch: str, report: RestoreReport) -> dict[str, Any]:
    """The `session.recovered` event of an install (logged here; the caller keeps it)."""
    abandoned = report.abandoned
    event = {"event": "session.recovered", "oldEpoch": old_epoch, "newEpoch": report.epoch,
             "checkpointId": report.checkpoint_id, "boundary": report.boundary,
             "abandonedFrom": None if abandoned is None else abandoned[0],
             "abandonedTo": None if abandoned is None else abandoned[1]}
    log.info("session.recovered", session=session_id, old_epoch=old_epoch,
             new_epoch=report.epoch, checkpoint_id=report.checkpoint_id,
             boundary=report.boundary, abandoned_from=event["abandonedFrom"],
             abandoned_to=event["abandonedTo"])
    return event


async def install(plan: Install, state: StateContext) -> Installed:
    """design/state.md §7.2 steps 2–10 of an install `prepare` admitted, once the session is
    `Restoring(k)`: what to install; a failure raises `InstallAborted` (any other exception
    propagates, and `plan.tainted` says whom it taints). The imported buffers are dropped either
    way."""
    try:
        _import(plan)
        await _stage(plan)
        ledgers = _validate_ledgers(plan)
        await _activate(plan)
        observation = _check_results(plan, ledgers)
        await _acknowledge(plan)
        try:
            return _installed(plan, ledgers, observation, state)
        except DomainError as exc:
            raise _Abort(exc, COORDINATOR) from None
    except _Abort as abort:
        raise InstallAborted(abort.error, abort.participant, plan.tainted) from None
    finally:
        plan.buffers.clear()
        # restored media not handed over in `Installed.media` (an abort) are dropped
        plan.calls.drop(plan.held)
        plan.held = ()
