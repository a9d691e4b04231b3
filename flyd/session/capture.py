"""Coordinator capture (design/state.md §5.7): every participant's `State.Capture` at one committed
boundary, validated per role, plus the coordinator's own ledgers, as a manifest and its payloads.

Why: a checkpoint is one boundary of the whole session or nothing. The coordinator asks only at a
committed boundary, holds the session in `Capturing(k)` while the replies are outstanding (no
Prepare can start), and refuses any reply that is not the state of that boundary in that role:
a capture that does not describe the session exactly must never become durable.

Rules, in order (`capture`):

1. Fenced → `INVALID_PHASE` (detail `fenced`). Not `Ready(k)`/`Paused(k)` → `INVALID_PHASE`
   "capture needs a committed boundary; the session is <label>". A descriptor whose recovery is
   not `exact-checkpoint` → `UNSUPPORTED`. None of these fails the epoch.
2. `→ Capturing(k)`.
3. `State.Capture {checkpointId}`, scope `(session, epoch, k)`, to the environment and every
   agent concurrently (deadline `capture`; an expiry is resolved with the same request).
4. Validate each reply (`validate_reply`): `checkpointId` echoed, `boundary == k`, the payload
   decodes (`BUFFER_INVALID`); environment: `agentIdentity` null and `compatibilityDigest` = the
   live block's; agent: an identity whose agentId, profileDigest, seed, datasetDigest and
   indexDigest are the slot's, and `compatibilityDigest = digest_of(identity)`. A failed check,
   a bus failure or a worker error with mutation ≠ `none` fails the epoch (detail `capture`).
   A worker error with `none` abandons the capture without failing the epoch: back to the
   origin phase, audit `not-durable:failed:<id>@<k>`, raise.
5. Build the coordinator payloads for k (design/state.md §6.3) and the manifest
   (design/state.md §2.4); `Worker.Acknowledge` the capture replies (one call per participant,
   concurrently); audit `captured:<id>@<k>`; the last trace record's operational `captures` gets
   `{checkpointId, boundary, kind}`.
6. Back to the origin phase; return the `Capture`.

Refusals that leave the epoch intact are `SessionFailure`s whose `fenced` state is unchanged
(like a paused step's episode refusal): the caller reads `coordinator.fenced`.

Resolved ambiguities:
- The writer's `reserve()` and `submit()` (design/state.md §5.2) wrap this function (`save`: a slot
  reserved before anyone is asked, the capture submitted after; a refusal of either audits
  `capture-refused:<id>` and raises `SessionFailure` detail `capture` without failing the
  epoch); without a writer, `Coordinator.capture` returns the `Capture` itself (manifest and
  payloads), which is exactly what `submit` takes.
- A participant without `checkpoint-v1` answers `State.Capture` with `UNSUPPORTED`/`none`
  (design/session.md §3.7), which abandons the capture without failing the epoch (rule 4).
- `brainTicks` and `remainder` of an `AgentEntry` and an executor slot are the agent's captured
  accumulator (`executed`, `remainder`): the coordinator holds no newer record of them at k.
- `eventWatermarks.issued` counts the task events of transitions 1..k (the trace's `eventIds`);
  `lastSourceStep` is k.
- The executor payload's `executor` is `{"impl": "<module>:<class>"}`: the v1 executors keep
  no state of their own.
- Errors raised after the resolution of an expired call cannot be told apart from the worker's
  own answer; one with mutation `none` abandons, anything else fails the epoch.
"""

from __future__ import annotations

import asyncio
import base64
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from flyd.session.calls import Call, CallEngine
from flyd.session.fence import Detail, SessionFailure
from flyd.session.phase import Capturing, Paused, Ready
from flyd.session.view import SessionView
from flyd.state.compat import AgentIdentity, Compatibility
from flyd.state.envelope import (
    COORDINATOR_ADMISSION,
    PRIOR_INSPECTION,
    SCHEDULER_ID,
    TASK_LEDGER,
    WORLD_PAYLOAD,
    validate_manifest,
)
from flyd.state.writer import CaptureSubmission, CheckpointWriter, SaveTicket
from workers.composition import composition_digest
from workers.protocols import ActionExecutor, EpisodeRequest
from workers.state import PAYLOAD_CONTENT_TYPE, PAYLOAD_VERSION
from workers.types.canonical import canonical, digest_bytes, digest_of, parse_strict
from workers.types.contract import contract_digest
from workers.types.datatypes import MediaBlob, WorldObservation, decode_media
from workers.types.domain import DomainError, ErrorCode, Mutation, Scope, format_u64
from workers.types.rpc import Answered, Expired, Refused

__all__ = ["Capture", "CaptureKind", "CaptureSource", "capture", "save", "validate_reply"]

CaptureKind = Literal["hot", "durable"]
ENVELOPE_VERSION: Final = 1


class CaptureSource(SessionView, Protocol):
    """What a capture reads of the session at its committed boundary (the coordinator's public
    side); nothing of it changes while the session is `Capturing(k)`."""

    @property
    def epoch(self) -> str: ...
    @property
    def observation(self) -> WorldObservation | None: ...
    @property
    def executor(self) -> ActionExecutor: ...
    @property
    def episode_request(self) -> EpisodeRequest | None: ...
    @property
    def descriptor_revision(self) -> int: ...
    def audio_positions(self) -> dict[str, int]: ...
    def issued_events(self) -> int: ...


@dataclass(frozen=True)
class Capture:
    """One boundary of the whole session: the manifest and the payloads in write order."""

    checkpoint_id: str
    boundary: int
    session_epoch: str
    episode_id: str
    kind: CaptureKind
    manifest: dict[str, Any]
    payloads: tuple[tuple[str, bytes], ...]

    @property
    def byte_length(self) -> int:
        return sum(len(data) for _, data in self.payloads)


@dataclass(frozen=True)
class _Reply:
    """A validated capture reply: the payload bytes and its decoded wrapper."""

    request_id: str
    data: bytes
    wrapper: dict[str, Any]


class _Abandon(Exception):
    """A worker refused with `none`: nothing changed anywhere."""

    def __init__(self, error: DomainError, worker_id: str) -> None:
        super().__init__(error, worker_id)
        self.error = error
        self.worker_id = worker_id


class _Fail(Exception):
    """A failed check or an uncertain call: the epoch fails (detail `capture`)."""

    def __init__(self, error: DomainError, worker_id: str | None) -> None:
        super().__init__(error, worker_id)
        self.error = error
        self.worker_id = worker_id


def _bad(message: str) -> DomainError:
    return DomainError(ErrorCode.BUFFER_INVALID, message, Mutation.UNKNOWN)


def _mismatch(message: str) -> DomainError:
    return DomainError(ErrorCode.IDENTITY_MISMATCH, message, Mutation.UNKNOWN)


def validate_reply(result: Mapping[str, Any], *, worker_id: str, checkpoint_id: str, k: int,
                   compatibility_digest: str | None,
                   slot_identity: Mapping[str, Any] | None) -> tuple[bytes, dict[str, Any]]:
    """design/state.md §5.7 step 5 for one reply: the payload bytes and decoded wrapper, or a
    `DomainError`.

    `compatibility_digest` is the live block's digest for the environment (None for an agent);
    `slot_identity` the agent slot's `{agentId, profileDigest, seed, datasetDigest,
    indexDigest}` (None for the environment)."""
    if result.get("checkpointId") != checkpoint_id:
        raise _mismatch(f"State.Capture: {worker_id} echoes checkpoint "
                        f"{result.get('checkpointId')}, expected {checkpoint_id}")
    if result.get("boundary") != format_u64(k):
        raise _mismatch(f"State.Capture: {worker_id} captured boundary "
                        f"{result.get('boundary')}, expected {k}")
    identity = result.get("agentIdentity")
    if slot_identity is None:
        if identity is not None:
            raise _mismatch(f"State.Capture: the environment {worker_id} returns an agent "
                            "identity")
        if result.get("compatibilityDigest") != compatibility_digest:
            raise _mismatch(f"State.Capture: {worker_id} reports compatibility "
                            f"{result.get('compatibilityDigest')}, this composition's is "
                            f"{compatibility_digest}")
    else:
        if identity is None:
            raise _mismatch(f"State.Capture: agent {worker_id} returns no identity")
        parsed = AgentIdentity.from_json(identity).to_json()
        for field in ("agentId", "profileDigest", "seed", "datasetDigest", "indexDigest"):
            if parsed[field] != slot_identity[field]:
                raise _mismatch(f"State.Capture: agent {worker_id} reports {field} "
                                f"{parsed[field]}, the slot holds {slot_identity[field]}")
        if result.get("compatibilityDigest") != digest_of(parsed):
            raise _mismatch(f"State.Capture: agent {worker_id}'s compatibility digest is not "
                            "the digest of its identity")
    try:
        blob = MediaBlob.from_json(result.get("payload"), "payload")
    except DomainError as exc:
        raise _bad(f"State.Capture: {worker_id}'s payload: {exc.message}") from None
    data = decode_media(blob, PAYLOAD_CONTENT_TYPE, f"{worker_id}'s state payload",
                        Mutation.UNKNOWN)
    try:
        wrapper = parse_strict(data)
    except DomainError as exc:
        raise _bad(f"State.Capture: {worker_id}'s payload is not JSON: {exc.message}") from None
    if not isinstance(wrapper, dict) or wrapper.get("checkpointId") != checkpoint_id \
            or wrapper.get("committedStep") != format_u64(k):
        raise _bad(f"State.Capture: {worker_id}'s payload is not the wrapper of "
                   f"{checkpoint_id} at {k}")
    return data, wrapper


# --------------------------------------------------------------------------------------------
# the coordinator side


async def _ask(calls: CallEngine, call: Call) -> dict[str, Any]:
    """One `State.Capture`; a worker refusal with `none` is `_Abandon`, anything else `_Fail`."""
    outcome = await calls.send(call, calls.deadline_of(call.method))
    if isinstance(outcome, Refused):
        raise _Fail(outcome.error, call.worker_id)
    if isinstance(outcome, Expired):
        try:
            return await calls.resolve(call)
        except DomainError as exc:
            if exc.mutation == Mutation.NONE:
                raise _Abandon(exc, call.worker_id) from None
            raise _Fail(exc, call.worker_id) from None
    assert isinstance(outcome, Answered)
    try:
        return calls.check_reply(call, outcome.outcome)
    except DomainError as exc:
        own = outcome.outcome.error
        if exc is own and own.mutation == Mutation.NONE:
            raise _Abandon(exc, call.worker_id) from None
        raise _Fail(exc, call.worker_id) from None


async def capture(coordinator: CaptureSource, calls: CallEngine, checkpoint_id: str, *,
                  kind: CaptureKind = "durable") -> Capture:
    """The rules of the module docstring; see there. `calls` is the session's call engine."""
    calls.refuse_if_fenced()
    origin = calls.phase
    if not isinstance(origin, Ready | Paused):
        raise SessionFailure(DomainError.before(
            ErrorCode.INVALID_PHASE,
            f"capture needs a committed boundary; the session is {origin.label}"),
            origin.label, Detail.CAPTURE)
    descriptor = coordinator.descriptor
    assert descriptor is not None
    try:
        live = Compatibility.of(descriptor)
    except DomainError as exc:
        raise SessionFailure(exc, origin.label, Detail.CAPTURE) from None
    k = origin.step
    scope = Scope(coordinator.spec.session_id, coordinator.epoch, k)
    calls.move(Capturing(k), Detail.CAPTURE)
    world_id = coordinator.world_id
    requests = {wid: calls.new_call(wid, "State.Capture", scope,
                                    {"checkpointId": checkpoint_id})
                for wid in [world_id, *coordinator.agent_ids]}
    results: dict[str, dict[str, Any]] = {}
    problems: list[_Abandon | _Fail] = []

    async def one(wid: str) -> None:
        try:
            results[wid] = await _ask(calls, requests[wid])
        except (_Abandon, _Fail) as exc:
            problems.append(exc)

    async with asyncio.TaskGroup() as group:
        for wid in requests:
            group.create_task(one(wid))
    failures = [p for p in problems if isinstance(p, _Fail)]
    if failures:
        calls.fail(failures[0].error, Detail.CAPTURE, failures[0].worker_id)
    if problems:
        _abandon(coordinator, calls, checkpoint_id, k, origin)
        first = problems[0]
        raise SessionFailure(first.error, origin.label, Detail.CAPTURE, first.worker_id)
    replies: dict[str, _Reply] = {}
    for wid, result in results.items():
        try:
            data, wrapper = validate_reply(
                result, worker_id=wid, checkpoint_id=checkpoint_id, k=k,
                compatibility_digest=live.digest() if wid == world_id else None,
                slot_identity=None if wid == world_id else _slot_identity(coordinator, wid))
        except DomainError as exc:
            calls.fail(exc, Detail.CAPTURE, wid)
        replies[wid] = _Reply(requests[wid].request_id, data, wrapper)
    try:
        built = _assemble(coordinator, checkpoint_id, k, scope, live, replies, kind)
    except DomainError as exc:
        calls.fail(exc, Detail.CAPTURE)
    await calls.guarded(functools.partial(_acknowledge_all, calls, replies))
    coordinator.audit.add(f"captured:{checkpoint_id}@{k}")
    if coordinator.trace.transitions:
        coordinator.trace.transitions[-1].operational.setdefault("captures", []).append(
            {"checkpointId": checkpoint_id, "boundary": format_u64(k), "kind": kind})
    calls.move(origin, Detail.CAPTURE)
    return built


async def save(coordinator: CaptureSource, calls: CallEngine, writer: CheckpointWriter,
               checkpoint_id: str, *, kind: CaptureKind = "durable") -> SaveTicket:
    """`capture` through `writer` (design/state.md §5.7 steps 2 and 7): the ticket."""
    phase = calls.phase
    try:
        reservation = writer.reserve()
    except DomainError as exc:
        coordinator.audit.add(f"capture-refused:{checkpoint_id}")
        raise SessionFailure(exc, phase.label, Detail.CAPTURE) from None
    try:
        built = await capture(coordinator, calls, checkpoint_id, kind=kind)
    except BaseException:
        reservation.release()
        raise
    try:
        return writer.submit(reservation, CaptureSubmission(
            checkpoint_id, built.boundary, built.session_epoch, built.episode_id,
            built.manifest, built.payloads, replaceable=kind == "hot"))
    except DomainError as exc:
        coordinator.audit.add(f"capture-refused:{checkpoint_id}")
        raise SessionFailure(exc, calls.phase.label, Detail.CAPTURE) from None


async def _acknowledge_all(calls: CallEngine, replies: Mapping[str, _Reply]) -> None:
    """One `Worker.Acknowledge` per participant, all at once: they are independent read-only
    calls, and sent one after another they were most of a capture's time at the boundary.
    The first failure in participant order is raised once every call finished."""
    failures: dict[str, BaseException] = {}

    async def one(wid: str, request_id: str) -> None:
        try:
            await calls.acknowledge(wid, [request_id])
        except Exception as exc:  # re-raised below, in participant order
            failures[wid] = exc

    async with asyncio.TaskGroup() as group:
        for wid, reply in replies.items():
            group.create_task(one(wid, reply.request_id))
    for wid in replies:
        if wid in failures:
            raise failures[wid]


def _abandon(coordinator: CaptureSource, calls: CallEngine, checkpoint_id: str, k: int,
             origin: Ready | Paused) -> None:
    calls.move(origin, Detail.CAPTURE)
    coordinator.audit.add(f"not-durable:failed:{checkpoint_id}@{k}")


def _slot_identity(coordinator: CaptureSource, agent_id: str) -> dict[str, Any]:
    slot = coordinator.slots[agent_id]
    assert slot.graph is not None
    return {"agentId": agent_id, "profileDigest": slot.profile["digest"], "seed": slot.seed,
            "datasetDigest": slot.graph.dataset_digest, "indexDigest": slot.graph.index_digest}


def _head(kind: str, checkpoint_id: str, k: int) -> dict[str, Any]:
    return {"payloadVersion": PAYLOAD_VERSION, "kind": kind, "checkpointId": checkpoint_id,
            "committedStep": format_u64(k)}


def _assemble(coordinator: CaptureSource, checkpoint_id: str, k: int, scope: Scope,
              live: Compatibility, replies: Mapping[str, _Reply], kind: CaptureKind) -> Capture:
    """The coordinator payloads (design/state.md §6.3) and the manifest (design/state.md §2.4), in
    write order (design/state.md §2.5)."""
    descriptor = coordinator.descriptor
    observation = coordinator.observation
    assert descriptor is not None and observation is not None
    agent_ids = list(coordinator.agent_ids)
    world_id = coordinator.world_id
    payloads: list[tuple[str, bytes]] = [(WORLD_PAYLOAD, replies[world_id].data)]
    entries: list[dict[str, Any]] = []
    executors: list[tuple[str, bytes]] = []
    for agent_id in agent_ids:
        wrapper = replies[agent_id].wrapper
        identity = AgentIdentity.from_json(wrapper.get("identity")).to_json()
        accumulator = wrapper.get("accumulator")
        if not isinstance(accumulator, dict):
            raise _bad(f"State.Capture: agent {agent_id}'s payload has no accumulator")
        slot = coordinator.slots[agent_id]
        assert slot.graph is not None and slot.telemetry is not None
        assert slot.tick_duration is not None and slot.context is not None
        payloads.append((f"agent-{agent_id}", replies[agent_id].data))
        entries.append({**identity, "brainTicks": accumulator["executed"],
                        "remainder": accumulator["remainder"],
                        "payload": f"agent-{agent_id}"})
        executor_impl = type(coordinator.executor)
        executors.append((f"executor-{agent_id}", canonical({
            **_head("executor", checkpoint_id, k), "agentId": agent_id,
            "executor": {"impl": f"{executor_impl.__module__}:{executor_impl.__qualname__}"},
            "slot": {"profileDigest": slot.profile["digest"],
                     "decisionContextDigest": slot.context_digest,
                     "telemetry": slot.telemetry.to_json(),
                     "brainTicks": accumulator["executed"],
                     "remainder": accumulator["remainder"],
                     "tickDuration": slot.tick_duration.to_json(),
                     "warmupTicks": format_u64(slot.warmup_ticks),
                     "graph": slot.graph.to_json()}})))
    payloads += executors
    progress = coordinator.task.progress()
    request = coordinator.episode_request
    task_state = coordinator.task.capture()
    payloads.append((TASK_LEDGER, canonical({
        **_head(TASK_LEDGER, checkpoint_id, k), "schema": progress.schema.to_json(),
        "progress": progress.to_json(),
        "contexts": [{"agentId": a, "context": _context(coordinator, a)} for a in agent_ids],
        "episodeRequest": None if request is None else {"reason": request.reason,
                                                        "outcome": request.outcome.to_json()},
        "task": {"digest": digest_bytes(task_state),
                 "data": base64.b64encode(task_state).decode("ascii")}})))
    positions = coordinator.audio_positions()
    payloads.append((PRIOR_INSPECTION, canonical({
        **_head(PRIOR_INSPECTION, checkpoint_id, k),
        "worldTime": observation.world_time.to_json(),
        "inspection": observation.inspection.to_json(),
        "views": [{"viewId": v.view_id, "producedStep": format_u64(v.produced_step),
                   "digest": v.pixels.digest} for v in observation.sensory_views],
        "audioPositions": [{"streamId": a.stream_id,
                            "position": format_u64(positions.get(a.stream_id, 0))}
                           for a in descriptor.audio]})))
    issued = coordinator.issued_events()
    watermarks = {"lastSourceStep": format_u64(k), "issued": format_u64(issued)}
    payloads.append((COORDINATOR_ADMISSION, canonical({
        **_head(COORDINATOR_ADMISSION, checkpoint_id, k), "admissions": [],
        "eventWatermarks": watermarks,
        "descriptorRevision": format_u64(coordinator.descriptor_revision)})))
    ports = {coordinator.slots[a].spec.port_id: a for a in agent_ids}
    manifest: dict[str, Any] = {
        "envelopeVersion": ENVELOPE_VERSION,
        "checkpointId": checkpoint_id,
        "sourceScope": scope.to_json(),
        "episodeId": coordinator.spec.episode_id,
        "worldTime": observation.world_time.to_json(),
        "schedulerId": SCHEDULER_ID,
        "compositionDigest": composition_digest(
            coordinator.spec.session_id, coordinator.epoch, contract_digest(),
            [(a, coordinator.slots[a].spec.port_id, coordinator.slots[a].profile["digest"])
             for a in agent_ids]),
        "portMap": [{"portId": p.port_id, "agentId": ports[p.port_id]}
                    for p in descriptor.ports if p.port_id in ports],
        "compatibility": live.to_json(),
        "agents": entries,
        "environment": {"workerId": world_id, "payload": WORLD_PAYLOAD},
        "helperState": [],
        "coordinator": {"taskLedger": TASK_LEDGER, "priorInspection": PRIOR_INSPECTION,
                        "executorState": [{"agentId": a, "payload": f"executor-{a}"}
                                          for a in agent_ids],
                        "admissionState": COORDINATOR_ADMISSION,
                        "eventWatermarks": watermarks},
        "payloads": [{"name": name, "byteLength": format_u64(len(data)),
                      "digest": digest_bytes(data)} for name, data in payloads],
    }
    validate_manifest(manifest)
    return Capture(checkpoint_id, k, coordinator.epoch, coordinator.spec.episode_id, kind,
                   manifest, tuple(payloads))


def _context(coordinator: CaptureSource, agent_id: str) -> dict[str, Any]:
    context = coordinator.slots[agent_id].context
    assert context is not None
    return context.to_json()
