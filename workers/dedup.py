"""The worker's result cache: admission, replay and retention (design/session.md §2.3, §2.4). Pure.

A reply can be lost and a call re-sent; the worker must then answer from memory and never run a
mutation twice. The cache decides, for every StepMutation or Lifecycle request, before any
handler runs: **Execute** (a `Ticket`), **Replay** (a stored `Record`) or **Refuse** (a
`DomainError`). It holds no I/O and no clock; the shell calls it synchronously in the reader.

Operation classes (design/session.md §2.3, `METHOD_CLASSES`):

    StepMutation  Agent.Prepare, Agent.Commit, Environment.Advance
                  key (sessionId, epoch, step, method, workerId); records of the current and
                  previous step of the table's epoch
    Lifecycle     Agent.Initialize, Environment.Initialize, State.Capture, State.StageRestore,
                  State.ActivateRestore; key requestId; kept until acknowledged, at most 16
    ReadOnly      Worker.Hello, Worker.Status, Worker.Acknowledge, Worker.Shutdown; never
                  cached, never admitted here

State: `E` epoch of the step table (None before the first adoption), `W` highest step begun or
recorded in E, `H` highest serial admitted for execution (any class), `A` highest acknowledged
serial, step records, lifecycle records, and at most one `active` operation.

`admit_step(scope, method, request_id, digest)`, first matching rule wins (`STEP_RULES`), s =
scope.step:
1. E is None or scope.epoch != E: only rule 3 applies, then Execute *unrecorded* (W untouched,
   nothing stored at completion; the handler refuses it, and E's records are not its business).
2. A record for the key: same request id and digest -> Replay; else CONFLICT/none.
3. An active mutation: same key (for lifecycle: same request id), same id and digest ->
   IN_PROGRESS/none; same key otherwise -> CONFLICT/none; any other -> BUSY/none. Mutations are
   never queued.
4. W set and s + 2 <= W (older than the retained pair), or s <= the `expire_step` floor:
   serial <= H -> RESULT_EXPIRED/unknown; else STALE_STEP/none.
5. A set and serial <= A -> RESULT_EXPIRED/unknown.
6. Execute: H = max(H, serial), W = max(W, s), active = the ticket.

`admit_lifecycle(request_id, digest)` (`LIFECYCLE_RULES`): (1) a record: same digest -> Replay,
else CONFLICT; (2) the active rule; (3) serial <= A -> RESULT_EXPIRED/unknown; (4) 16
unacknowledged records -> BUSY/none; (5) Execute, H = max(H, serial).

`complete(ticket, outcome)` stores the outcome (step: W = max(W, s), then records with step <
W - 1 are dropped; lifecycle: kept until acknowledged); `abandon(ticket)` stores nothing (a
`none` failure frees the key). Both clear `active`. `acknowledge(ids)` drops the named
lifecycle records and returns the dropped ids in request order, A = max(A, their serials);
unknown or repeated ids are ignored. `adopt_epoch(e)`: E = e, W = None, step records cleared;
H, A and lifecycle records kept. `expire_step(k)` (tests) drops step records with step <= k.
Eviction never re-enables execution: the watermarks decide.

Violations of the protocol by the caller (completing a ticket that is not the active one,
adopting an epoch twice) raise `DomainError` `INTERNAL`/`none`; the cache is then unchanged.

Body digest (design/wire.md §22.3): `wire_digest(method, payload_bytes)`, the SHA-256 of the method
and the request's payload exactly as the caller wrote it (the router forwards those bytes
untouched). A retry resends the bytes it sent, so it matches; the same value spelled otherwise
under the same id is a mismatch (CONFLICT), as a different body always was. Nothing is parsed or
re-encoded for it.

Resolved ambiguities:
- The digest covers the whole payload (requestId, scope, params) and the method: the key
  already holds the scope and the id is compared on its own, so the payload's other members
  change nothing, and hashing the bytes the bus delivered needs no search for `params`.
- An unrecorded execution (rule 1) still raises H: it was admitted for execution, and the
  caller's serials only grow. It never touches W or A's rule.
- W is raised at admission (rule 6) and an `abandon` does not lower it ("begun").
- `expire_step(k)` also raises a floor so that an expired step in the retained pair is refused
  like an older one (rule 4): without it, an eviction by a test could re-enable execution.
- Re-adopting an epoch this cache adopted before is refused: it would clear that epoch's
  records and let a key run twice (a session never reuses an epoch).
- The record of a completed step is only stored while its epoch is still E.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Generic, NamedTuple, TypeAlias, TypeVar

from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    Scope,
    parse_digest,
    parse_id,
    parse_request_id,
    serial,
)

__all__ = [
    "LIFECYCLE_RULES",
    "MAX_UNACKNOWLEDGED",
    "METHOD_CLASSES",
    "STEP_RULES",
    "Admission",
    "Execute",
    "OpClass",
    "Record",
    "Refuse",
    "Replay",
    "ResultCache",
    "StepKey",
    "Ticket",
    "class_of",
    "wire_digest",
]

O = TypeVar("O")  # noqa: E741 - the stored outcome type, as in the spec's Record(…, outcome)

MAX_UNACKNOWLEDGED: Final = 16


def wire_digest(method: str, payload: bytes) -> str:
    """The result cache's body digest: SHA-256 of `<method>\n<payload wire bytes>`."""
    h = hashlib.sha256(method.encode())
    h.update(b"\n")
    h.update(payload)
    return h.hexdigest()


class OpClass(StrEnum):
    STEP_MUTATION = "StepMutation"
    LIFECYCLE = "Lifecycle"
    READ_ONLY = "ReadOnly"


METHOD_CLASSES: Final[dict[str, OpClass]] = {
    "Agent.Prepare": OpClass.STEP_MUTATION,
    "Agent.Commit": OpClass.STEP_MUTATION,
    "Environment.Advance": OpClass.STEP_MUTATION,
    "Agent.Initialize": OpClass.LIFECYCLE,
    "Environment.Initialize": OpClass.LIFECYCLE,
    "State.Capture": OpClass.LIFECYCLE,
    "State.StageRestore": OpClass.LIFECYCLE,
    "State.ActivateRestore": OpClass.LIFECYCLE,
    "Worker.Hello": OpClass.READ_ONLY,
    "Worker.Status": OpClass.READ_ONLY,
    "Worker.Acknowledge": OpClass.READ_ONLY,
    "Worker.Shutdown": OpClass.READ_ONLY,
}


def class_of(method: str) -> OpClass | None:
    """The operation class of a domain method, or None for a name no endpoint serves."""
    return METHOD_CLASSES.get(method)


class StepKey(NamedTuple):
    session_id: str
    epoch: str
    step: int
    method: str
    worker_id: str

    def describe(self) -> str:
        return f"{self.method} at step {self.step} of epoch {self.epoch}"


@dataclass(frozen=True, slots=True)
class Record(Generic[O]):
    """A stored outcome: replayed to an exact duplicate, never recomputed."""

    request_id: str
    digest: str
    outcome: O
    step: int | None


@dataclass(frozen=True, slots=True)
class Ticket:
    """The permission to run one admitted operation; handed back to `complete`/`abandon`."""

    op_class: OpClass
    key: StepKey | str
    request_id: str
    digest: str
    serial: int
    step: int | None
    recorded: bool


@dataclass(frozen=True, slots=True)
class Execute:
    ticket: Ticket


@dataclass(frozen=True, slots=True)
class Replay(Generic[O]):
    record: Record[O]

    @property
    def outcome(self) -> O:
        return self.record.outcome


@dataclass(frozen=True, slots=True)
class Refuse:
    error: DomainError


Admission: TypeAlias = Execute | Replay[O] | Refuse


@dataclass(frozen=True, slots=True)
class _Attempt:
    """One admission question, as the rules see it."""

    op_class: OpClass
    key: StepKey | str
    request_id: str
    digest: str
    serial: int
    step: int | None


def _none(code: ErrorCode, message: str) -> Refuse:
    return Refuse(DomainError(code, message, Mutation.NONE))


def _expired(message: str) -> Refuse:
    return Refuse(DomainError(ErrorCode.RESULT_EXPIRED, message, Mutation.UNKNOWN))


def _describe(key: StepKey | str) -> str:
    return key.describe() if isinstance(key, StepKey) else f"lifecycle request {key}"


# --------------------------------------------------------------------------------------------
# the rules, in order (a rule answers, or returns None to pass the question on)


def _rule_active(cache: ResultCache[O], attempt: _Attempt) -> Admission[O] | None:
    active = cache.active
    if active is None:
        return None
    if active.op_class == attempt.op_class and active.key == attempt.key:
        if active.request_id == attempt.request_id and active.digest == attempt.digest:
            return _none(
                ErrorCode.IN_PROGRESS,
                f"{attempt.request_id} is still running; this call started nothing",
            )
        return _none(
            ErrorCode.CONFLICT,
            f"{_describe(attempt.key)} is running as {active.request_id} with another body",
        )
    return _none(
        ErrorCode.BUSY,
        f"another mutation ({active.request_id}) is running; mutations are never queued",
    )


def _rule_foreign_epoch(cache: ResultCache[O], attempt: _Attempt) -> Admission[O] | None:
    assert isinstance(attempt.key, StepKey)
    if cache.epoch is not None and attempt.key.epoch == cache.epoch:
        return None
    return _rule_active(cache, attempt) or cache._execute(attempt, recorded=False)


def _rule_step_record(cache: ResultCache[O], attempt: _Attempt) -> Admission[O] | None:
    assert isinstance(attempt.key, StepKey)
    record = cache._steps.get(attempt.key)
    if record is None:
        return None
    if record.request_id == attempt.request_id and record.digest == attempt.digest:
        return Replay(record)
    return _none(
        ErrorCode.CONFLICT,
        f"{attempt.key.describe()} already ran as {record.request_id}; this request has "
        f"another id or body and the earlier result stands",
    )


def _rule_evicted(cache: ResultCache[O], attempt: _Attempt) -> Admission[O] | None:
    step = attempt.step
    assert step is not None
    older = cache.highest_step is not None and step + 2 <= cache.highest_step
    floor = cache._expired_floor is not None and step <= cache._expired_floor
    if not (older or floor):
        return None
    if cache.highest_serial is not None and attempt.serial <= cache.highest_serial:
        return _expired(
            f"the result of {_describe(attempt.key)} is no longer kept; it is never recomputed"
        )
    return _none(
        ErrorCode.STALE_STEP,
        f"{_describe(attempt.key)} is behind this worker, which is at step "
        f"{cache.highest_step}",
    )


def _rule_acknowledged(cache: ResultCache[O], attempt: _Attempt) -> Admission[O] | None:
    acknowledged = cache.acknowledged_serial
    if acknowledged is None or attempt.serial > acknowledged:
        return None
    return _expired(
        f"{attempt.request_id} is not newer than the acknowledged serial {acknowledged}; "
        f"its result is no longer kept"
    )


def _rule_lifecycle_record(cache: ResultCache[O], attempt: _Attempt) -> Admission[O] | None:
    record = cache._lifecycle.get(attempt.request_id)
    if record is None:
        return None
    if record.digest == attempt.digest:
        return Replay(record)
    return _none(
        ErrorCode.CONFLICT,
        f"{attempt.request_id} already ran with another body; the earlier result stands",
    )


def _rule_capacity(cache: ResultCache[O], attempt: _Attempt) -> Admission[O] | None:
    if len(cache._lifecycle) < MAX_UNACKNOWLEDGED:
        return None
    return _none(
        ErrorCode.BUSY,
        f"{MAX_UNACKNOWLEDGED} lifecycle replies are unacknowledged; acknowledge some first",
    )


STEP_RULES: Final = (
    ("foreign epoch", _rule_foreign_epoch),
    ("recorded", _rule_step_record),
    ("active", _rule_active),
    ("evicted", _rule_evicted),
    ("acknowledged", _rule_acknowledged),
)
"""`admit_step`'s rules in order; none answering means Execute."""

LIFECYCLE_RULES: Final = (
    ("recorded", _rule_lifecycle_record),
    ("active", _rule_active),
    ("acknowledged", _rule_acknowledged),
    ("capacity", _rule_capacity),
)
"""`admit_lifecycle`'s rules in order; none answering means Execute."""


# --------------------------------------------------------------------------------------------
# the cache


def _internal(message: str) -> DomainError:
    return DomainError(ErrorCode.INTERNAL, message, Mutation.NONE)


class ResultCache(Generic[O]):
    """One worker incarnation's admission state; `O` is the stored outcome type."""

    def __init__(self, worker_id: str = "worker") -> None:
        self.worker_id = parse_id(worker_id, "worker id")
        self._epoch: str | None = None
        self._highest_step: int | None = None
        self._highest_serial: int | None = None
        self._acknowledged: int | None = None
        self._expired_floor: int | None = None
        self._steps: dict[StepKey, Record[O]] = {}
        self._lifecycle: dict[str, Record[O]] = {}
        self._active: Ticket | None = None
        self._adopted: set[str] = set()

    # read-only view ------------------------------------------------------------------------

    @property
    def epoch(self) -> str | None:
        """E: the step table's epoch."""
        return self._epoch

    @property
    def highest_step(self) -> int | None:
        """W: the highest step begun or recorded in E."""
        return self._highest_step

    @property
    def highest_serial(self) -> int | None:
        """H: the highest serial admitted for execution."""
        return self._highest_serial

    @property
    def acknowledged_serial(self) -> int | None:
        """A: the highest acknowledged lifecycle serial."""
        return self._acknowledged

    @property
    def active(self) -> Ticket | None:
        return self._active

    @property
    def unacknowledged(self) -> int:
        return len(self._lifecycle)

    def step_records(self) -> dict[StepKey, Record[O]]:
        return dict(self._steps)

    def lifecycle_records(self) -> dict[str, Record[O]]:
        return dict(self._lifecycle)

    def step_key(self, scope: Scope, method: str) -> StepKey:
        return StepKey(scope.session_id, scope.epoch, scope.step, method, self.worker_id)

    # admission -----------------------------------------------------------------------------

    def admit_step(self, scope: Scope, method: str, request_id: str, digest: str) -> Admission[O]:
        attempt = _Attempt(
            OpClass.STEP_MUTATION,
            self.step_key(scope, method),
            request_id,
            parse_digest(digest),
            serial(parse_request_id(request_id)),
            scope.step,
        )
        for _name, rule in STEP_RULES:
            answer: Admission[O] | None = rule(self, attempt)
            if answer is not None:
                return answer
        return self._execute(attempt, recorded=True)

    def admit_lifecycle(self, request_id: str, digest: str) -> Admission[O]:
        attempt = _Attempt(
            OpClass.LIFECYCLE,
            request_id,
            request_id,
            parse_digest(digest),
            serial(parse_request_id(request_id)),
            None,
        )
        for _name, rule in LIFECYCLE_RULES:
            answer: Admission[O] | None = rule(self, attempt)
            if answer is not None:
                return answer
        return self._execute(attempt, recorded=True)

    def _execute(self, attempt: _Attempt, *, recorded: bool) -> Execute:
        ticket = Ticket(
            attempt.op_class,
            attempt.key,
            attempt.request_id,
            attempt.digest,
            attempt.serial,
            attempt.step,
            recorded,
        )
        self._highest_serial = max(self._highest_serial or 0, attempt.serial)
        if recorded and attempt.step is not None:
            self._highest_step = max(self._highest_step or 0, attempt.step)
        self._active = ticket
        return Execute(ticket)

    # completion ----------------------------------------------------------------------------

    def _release(self, ticket: Ticket) -> None:
        if self._active is None or self._active != ticket:
            raise _internal(f"{ticket.request_id} is not the active operation")
        self._active = None

    def complete(self, ticket: Ticket, outcome: O) -> None:
        """Keep the outcome for replay: a success, or a failure that may have mutated."""
        self._release(ticket)
        record = Record(ticket.request_id, ticket.digest, outcome, ticket.step)
        if ticket.op_class == OpClass.LIFECYCLE:
            self._lifecycle[ticket.request_id] = record
            return
        key = ticket.key
        assert isinstance(key, StepKey) and ticket.step is not None
        if not ticket.recorded or key.epoch != self._epoch:
            return
        self._steps[key] = record
        high = max(self._highest_step or 0, ticket.step)
        self._highest_step = high
        for old in [k for k, r in self._steps.items() if r.step is not None and r.step < high - 1]:
            del self._steps[old]

    def abandon(self, ticket: Ticket) -> None:
        """Forget a `none` failure: the key is free for a corrected request."""
        self._release(ticket)

    # acknowledgement, epochs, eviction -----------------------------------------------------

    def acknowledge(self, request_ids: Iterable[str]) -> list[str]:
        dropped: list[str] = []
        for request_id in request_ids:
            if self._lifecycle.pop(request_id, None) is not None:
                dropped.append(request_id)
                self._acknowledged = max(self._acknowledged or 0, serial(request_id))
        return dropped

    def adopt_epoch(self, epoch: str) -> None:
        """A new step table for `epoch` (Initialize or ActivateRestore installed it)."""
        parse_id(epoch, "epoch")
        if epoch in self._adopted:
            raise _internal(f"epoch {epoch} was already adopted; a session never reuses one")
        self._adopted.add(epoch)
        self._epoch = epoch
        self._highest_step = None
        self._expired_floor = None
        self._steps.clear()

    def expire_step(self, step: int) -> None:
        """Drop step records with step <= `step` (tests); the watermarks keep them refused."""
        for key in [k for k, r in self._steps.items() if r.step is not None and r.step <= step]:
            del self._steps[key]
        self._expired_floor = max(self._expired_floor or 0, step)
