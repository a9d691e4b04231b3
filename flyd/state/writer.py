"""The bounded checkpoint writer (design/state.md §5): reserve, submit, one writer loop, outcomes.

Rules:
- `reserve()` runs before any `State.Capture` is sent; at `queue_capacity` outstanding captures
  it counts `rejected` and raises `BUSY`/`none`. A `Reservation` is held until its job ends;
  `release()` is idempotent. `outstanding()` counts live reservations.
- `submit(reservation, submission)` checks `max_envelope_bytes` (`UNSUPPORTED`/`none`), then,
  in one critical section (no await), picks the victim (the first queued replaceable job, for a
  replaceable submission), checks `max_queued_bytes` (`BUSY`/`none`) and enqueues. A refused
  submission releases its reservation and drops its payloads. A victim is delivered
  `Superseded(old, by=new)` with its reservation released.
- Job life, as data (`JOB_TRANSITIONS`): queued → taken (the writer took it from the front; it
  can no longer be superseded) → ended; queued → ended (superseded, refused at shutdown). An
  ended job has delivered exactly one outcome or closed its ticket without one.
- The loop, per job (design/state.md §5.3): wait at the `gate` fault while it is installed and
  closed; `queued_bytes −= bytes`; in a worker thread check every payload against the manifest and
  encode; `store.commit` under the retry policy; count; publish the event; release the slot and
  drop the bytes; deliver (or, for `drop_reply_for`, close the ticket without an outcome).
- The writer keeps the head h exactly: one job at a time, and a commit's unknown outcome is
  settled inside `store.commit` before the next starts. On success h = (id, c) and
  `PendingEffects` is pruned through c; the effects sent are (h.boundary, c].
- `wait(ticket, budget)`: the budget ran out → `DeadlineExpired`; closed → `ReplyLost`; else
  the outcome. `is_durable()` is true only for `Committed`.
- `shutdown()` takes no new job, lets the current one finish (≤ `durable_timeout_s`, else it is
  cancelled), ends every queued job `Failed` "writer stopped" (counted as failed) with its
  reservation released, and waits for the loop to end. A dying loop closes every open ticket
  and releases every reservation it holds.
- Events (design/state.md §5.6) are telemetry:
  `{event, run, leaseEpoch, checkpointId, sessionId, epoch, episodeId, boundary, byteLength}` (+
  `reason` / `supersededBy`) handed to the sink; a sink that raises adds 1 to `events_dropped` and
  is not retried. `EventRing` is the v1 sink: a structlog line `checkpoint.<event>` with snake_case
  fields and a 256-entry ring.

Decisions where the spec is silent:
- `byteLength` in events is the job's payload bytes (the sum design/state.md §5.2 budgets), known at
  every event; the envelope adds a few hundred bytes of header, table and manifest.
- `Failed` reasons: `fenced`, `grant lost`, `aborted before commit`, `writer stopped`,
  `effect_duplicate`, `effect_conflict`, `head regression`, `reused id`, `transient` (the last
  attempt's error is logged), `payload <name> is not the content its capture declared`, and
  an `INTERNAL` error's message (e.g. a boundary missing from `PendingEffects`).
- `reserve()` and `submit()` after `shutdown()` are `BUSY`/`none` ("checkpoint writer is
  stopped"), so the session keeps stepping rather than failing.
- The run's `session_id` and compatibility digest come from the submission's manifest
  (`sourceScope.sessionId`, `digest_of(compatibility)`), the same values S5 checks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import structlog

from flyd.cancel import raise_if_cancelled
from flyd.durations import DURATION_RULE, is_duration_s
from flyd.errors import ConfigError
from flyd.state.checkpoints import (
    CheckpointStore,
    CommitFailure,
    CommitFaults,
    CommitJob,
    CommitPath,
    FinishRun,
)
from flyd.state.effects import PendingEffects
from flyd.state.envelope import MAX_ENVELOPE_BYTES, MAX_PAYLOADS, encode
from workers.types.canonical import digest_of
from workers.types.domain import DomainError, ErrorCode, Mutation

__all__ = [
    "CaptureSubmission",
    "CheckpointSettings",
    "CheckpointWriter",
    "Committed",
    "DeadlineExpired",
    "EventRing",
    "Failed",
    "ReleaseAndReport",
    "ReplyLost",
    "Reservation",
    "RetryPolicy",
    "RetryThenRelease",
    "SaveOutcome",
    "SaveTicket",
    "Superseded",
    "WriterFaults",
    "WriterStats",
    "audit_line",
]

RING_SIZE: Final = 256
MIB: Final = 1 << 20

# --------------------------------------------------------------------------------------------
# Configuration (design/state.md §5.1)


@dataclass(frozen=True, slots=True)
class ReleaseAndReport:
    """One attempt; a failure releases the payloads and reports `Failed` (the default)."""

    def attempts(self) -> int:
        return 1

    def backoff_s(self, attempt: int) -> float:
        return 0.0


@dataclass(frozen=True, slots=True)
class RetryThenRelease:
    """Up to `max(attempts, 1)` attempts of the whole transaction, sleeping
    `backoff·2^(i−1)` after failed attempt i, for retryable failures only."""

    attempts_: int = 3
    backoff: float = 0.2

    def attempts(self) -> int:
        return max(self.attempts_, 1)

    def backoff_s(self, attempt: int) -> float:
        return float(self.backoff * 2 ** (attempt - 1))


RetryPolicy = ReleaseAndReport | RetryThenRelease



class EnvelopeTooLarge(DomainError):
    """`UNSUPPORTED`/`none` at submit: the capture's payload bytes exceed `max_envelope_bytes`,
    or it has more payloads than an envelope holds (`MAX_PAYLOADS`, design/state.md §2.1: a session
    needs 4 plus 2 per agent, 516 at `[session] max_agents` 256); the sizes travel with it because a
    forced or final capture ends the run with them (design/state.md §5.2). Either can never commit,
    so neither is retried."""

    def __init__(self, byte_length: int, limit: int, payload_count: int | None = None) -> None:
        if payload_count is None:
            message = f"checkpoint of {byte_length} bytes exceeds max_envelope_bytes {limit}"
        else:
            message = (f"checkpoint of {payload_count} payloads exceeds the envelope's "
                       f"{MAX_PAYLOADS} (4 plus 2 per agent)")
        super().__init__(ErrorCode.UNSUPPORTED, message, Mutation.NONE)
        self.byte_length = byte_length
        self.limit = limit
        self.payload_count = payload_count

@dataclass(frozen=True, slots=True)
class CheckpointSettings:
    """TOML `[checkpoints]` (design/state.md §5.1); `max_pending_effects` None = its derived
    default."""

    every_steps: int = 60
    every_seconds: float = 0.0
    keep_generations: int = 3
    queue_capacity: int = 2
    max_queued_bytes: int = 64 * MIB
    retry: Literal["release", "retry"] = "release"
    retry_attempts: int = 3
    retry_backoff_s: float = 0.2
    durable_timeout_s: float = 60.0
    recovery_max_attempts: int = 3
    recovery_backoff_s: float = 1.0
    recovery_backoff_max_s: float = 30.0
    max_pending_effects: int | None = None
    max_pending_effect_bytes: int = 16 * MIB
    max_envelope_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = _problem(f.name, getattr(self, f.name))
            if problem is not None:
                raise ConfigError(f"[checkpoints] {f.name} = {getattr(self, f.name)!r} "
                                  f"must be {problem}")

    def pending_effects_bound(self) -> int:
        if self.max_pending_effects is not None:
            return self.max_pending_effects
        return 4 * self.every_steps if self.every_steps > 0 else 4096

    def retry_policy(self) -> RetryPolicy:
        if self.retry == "retry":
            return RetryThenRelease(self.retry_attempts, self.retry_backoff_s)
        return ReleaseAndReport()

    def pending_effects(self) -> PendingEffects:
        return PendingEffects(max_pending_effects=self.pending_effects_bound(),
                              max_pending_effect_bytes=self.max_pending_effect_bytes)


def _int_in(value: object, low: int, high: float = math.inf) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and low <= value <= high
    return None if ok else (f"an integer in {low}..{high}" if high != math.inf
                            else f"an integer ≥ {low}")


def _positive(value: object, *, zero: bool = False) -> str | None:
    """A duration in seconds (`flyd.durations`)."""
    ok = is_duration_s(value, zero=zero)
    return None if ok else (f"a number ≥ 0 and {DURATION_RULE}" if zero
                            else f"a number > 0 and {DURATION_RULE}")


def _problem(name: str, value: object) -> str | None:
    rules: dict[str, Callable[[object], str | None]] = {
        "every_steps": lambda v: _int_in(v, 0),
        "every_seconds": lambda v: _positive(v, zero=True),
        "keep_generations": lambda v: _int_in(v, 1, 100),
        "queue_capacity": lambda v: _int_in(v, 1, 16),
        "max_queued_bytes": lambda v: _int_in(v, MIB, 1 << 30),
        "retry": lambda v: None if v in ("release", "retry") else '"release" or "retry"',
        "retry_attempts": lambda v: _int_in(v, 1, 10),
        "retry_backoff_s": _positive,
        "durable_timeout_s": _positive,
        "recovery_max_attempts": lambda v: _int_in(v, 1, 100),
        "recovery_backoff_s": _positive,
        "recovery_backoff_max_s": _positive,
        "max_pending_effects": lambda v: None if v is None else _int_in(v, 1),
        "max_pending_effect_bytes": lambda v: _int_in(v, MIB),
        "max_envelope_bytes": lambda v: _int_in(v, MIB, MAX_ENVELOPE_BYTES),
    }
    return rules[name](value)


# --------------------------------------------------------------------------------------------
# Outcomes (design/state.md §5.5)


@dataclass(frozen=True, slots=True)
class Committed:
    checkpoint_id: str
    boundary: int

    def is_durable(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class Failed:
    checkpoint_id: str
    reason: str

    def is_durable(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class Superseded:
    checkpoint_id: str
    by: str

    def is_durable(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class ReplyLost:
    checkpoint_id: str

    def is_durable(self) -> bool:
        return False


@dataclass(frozen=True, slots=True)
class DeadlineExpired:
    checkpoint_id: str

    def is_durable(self) -> bool:
        return False


SaveOutcome = Committed | Failed | Superseded | ReplyLost | DeadlineExpired


def audit_line(outcome: SaveOutcome, boundary: int) -> str:
    """The audit string `await_durable` records for an outcome at boundary k
    (design/state.md §5.5)."""
    cid = outcome.checkpoint_id
    if isinstance(outcome, Committed):
        return f"durable:{cid}@{boundary}"
    if isinstance(outcome, Superseded):
        return f"not-durable:superseded:{cid}@{boundary}"
    return f"not-durable:failed:{cid}@{boundary}"


# --------------------------------------------------------------------------------------------
# Faults, stats, events


@dataclass(slots=True)
class WriterFaults(CommitFaults):
    """Test hooks: the store's commit faults, plus `drop_reply_for` (close the ticket without
    an outcome) and `gate` (while installed and not set, the writer waits before each job,
    having taken it; `stalled` is set while it waits there)."""

    drop_reply_for: str | None = None
    gate: asyncio.Event | None = None
    stalled: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class WriterStats:
    queued: int = 0
    committed: int = 0
    failed: int = 0
    superseded: int = 0
    rejected: int = 0
    events_dropped: int = 0
    peak_queue: int = 0
    peak_bytes: int = 0


# One line per checkpoint written is logged at debug, so an info log is not mostly checkpoints
# (`-v` shows them under JSON, `-vv` on a terminal); the ring keeps them all regardless.
PER_WRITE: Final = frozenset({"queued", "committed", "superseded"})


class EventRing:
    """The v1 checkpoint sink: a structlog line `checkpoint.<event>` and a 256-entry ring."""

    def __init__(self, size: int = RING_SIZE,
                 logger: structlog.typing.FilteringBoundLogger | None = None) -> None:
        self.ring: deque[dict[str, Any]] = deque(maxlen=size)
        self._log = logger if logger is not None else structlog.get_logger("flyd.state")

    def __call__(self, event: Mapping[str, Any]) -> None:
        fields = {_snake(k): v for k, v in event.items() if k != "event"}
        level = "debug" if event["event"] in PER_WRITE else "info"
        getattr(self._log, level)(f"checkpoint.{event['event']}", **fields)
        self.ring.append(dict(event))


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name)


# --------------------------------------------------------------------------------------------
# Reservations, submissions, tickets, jobs

JobState = Literal["queued", "taken", "ended"]
JOB_TRANSITIONS: Final[dict[JobState, frozenset[JobState]]] = {
    "queued": frozenset({"taken", "ended"}),
    "taken": frozenset({"ended"}),
    "ended": frozenset(),
}


class Reservation:
    """One writer slot, held from before `State.Capture` until the job ends."""

    def __init__(self, writer: CheckpointWriter) -> None:
        self._writer = writer
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._writer._outstanding -= 1
            if self._writer._outstanding == 0:
                self._writer._idle.set()


@dataclass(frozen=True, slots=True)
class CaptureSubmission:
    """design/state.md §5.2: a validated capture; `session_epoch` is the Id `e<N>`."""

    checkpoint_id: str
    boundary: int
    session_epoch: str
    episode_id: str
    manifest: Mapping[str, Any]
    payloads: Sequence[tuple[str, bytes]]
    replaceable: bool
    finish: FinishRun | None = None


class SaveTicket:
    """The caller's handle on one job: an outcome, or closed without one."""

    def __init__(self, checkpoint_id: str, boundary: int) -> None:
        self.checkpoint_id = checkpoint_id
        self.boundary = boundary
        self._future: asyncio.Future[SaveOutcome | None] = (
            asyncio.get_running_loop().create_future())

    @property
    def done(self) -> bool:
        return self._future.done()

    def outcome(self) -> SaveOutcome | None:
        """The delivered outcome; None while pending or when closed without one."""
        if not self._future.done() or self._future.cancelled():
            return None
        return self._future.result()

    def add_done_callback(self, callback: Callable[[SaveTicket], None]) -> None:
        """Called synchronously when the ticket gets its outcome or closes without one."""
        self._future.add_done_callback(lambda _: callback(self))

    def _deliver(self, outcome: SaveOutcome | None) -> None:
        if not self._future.done():
            self._future.set_result(outcome)


@dataclass(slots=True)
class _Job:
    sub: CaptureSubmission
    reservation: Reservation
    ticket: SaveTicket
    size: int
    session_id: str
    state: JobState = "queued"
    payloads: Sequence[tuple[str, bytes]] = field(default_factory=tuple)

    def move(self, to: JobState) -> None:
        if to not in JOB_TRANSITIONS[self.state]:
            raise DomainError(ErrorCode.INTERNAL, f"job {self.sub.checkpoint_id}: "
                              f"{self.state} → {to} is not a transition", Mutation.NONE)
        self.state = to


# --------------------------------------------------------------------------------------------
# The writer


class CheckpointWriter:
    """One per session (module rules). Run `run()` in the session's TaskGroup."""

    def __init__(self, store: CheckpointStore, path: CommitPath, config: CheckpointSettings, *,
                 pending: PendingEffects | None = None, head: tuple[str, int] | None = None,
                 faults: WriterFaults | None = None,
                 sink: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        self.store = store
        self.path = path
        self.config = config
        self.policy = config.retry_policy()
        self.pending = pending if pending is not None else config.pending_effects()
        self.head = head
        self.faults = faults if faults is not None else WriterFaults()
        self.sink: Callable[[Mapping[str, Any]], None] = sink if sink is not None else EventRing()
        self.stats = WriterStats()
        self.queued_bytes = 0
        self._outstanding = 0
        self._queue: deque[_Job] = deque()
        self._current: _Job | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._ended = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._open: list[_Job] = []
        self._idle = asyncio.Event()
        self._idle.set()

    def outstanding(self) -> int:
        return self._outstanding

    async def idle(self) -> None:
        """Return once no capture is outstanding (bound it with `asyncio.timeout`)."""
        await self._idle.wait()

    @property
    def stopping(self) -> bool:
        """True once `shutdown()` began: no new reservation will be granted."""
        return self._stopping

    # -- reserve / submit ----------------------------------------------------------------
    def reserve(self) -> Reservation:
        """A slot before any participant is asked (design/state.md §5.2)."""
        cap = self.config.queue_capacity
        if self._stopping:
            self.stats.rejected += 1
            raise DomainError(ErrorCode.BUSY, "checkpoint writer is stopped", Mutation.NONE)
        if self._outstanding >= cap:
            self.stats.rejected += 1
            raise DomainError(ErrorCode.BUSY, f"checkpoint writer is saturated: "
                              f"{self._outstanding} of {cap} captures outstanding",
                              Mutation.NONE)
        self._outstanding += 1
        self._idle.clear()
        return Reservation(self)

    def submit(self, reservation: Reservation, sub: CaptureSubmission) -> SaveTicket:
        """Queue a validated capture (design/state.md §5.2); refusals release the reservation."""
        if reservation.released or reservation._writer is not self:
            raise DomainError(ErrorCode.INTERNAL, f"capture {sub.checkpoint_id} submitted "
                              "without a live reservation of this writer", Mutation.NONE)
        size = sum(len(data) for _, data in sub.payloads)
        limit = self.config.max_envelope_bytes
        if self._stopping:
            self.stats.rejected += 1
            reservation.release()
            raise DomainError(ErrorCode.BUSY, "checkpoint writer is stopped", Mutation.NONE)
        if size > limit or len(sub.payloads) > MAX_PAYLOADS:
            self.stats.rejected += 1
            reservation.release()
            raise EnvelopeTooLarge(size, limit, None if size > limit else len(sub.payloads))
        victim = (next((j for j in self._queue if j.sub.replaceable), None)
                  if sub.replaceable else None)
        after = self.queued_bytes - (victim.size if victim is not None else 0) + size
        if after > self.config.max_queued_bytes:
            self.stats.rejected += 1
            reservation.release()
            raise DomainError(ErrorCode.BUSY, f"checkpoint writer byte budget: {after} of "
                              f"{self.config.max_queued_bytes} bytes", Mutation.NONE)
        session_id = str(sub.manifest["sourceScope"]["sessionId"])
        job = _Job(sub=sub, reservation=reservation,
                   ticket=SaveTicket(sub.checkpoint_id, sub.boundary), size=size,
                   session_id=session_id, payloads=tuple(sub.payloads))
        if victim is not None:
            self._queue.remove(victim)
        self._queue.append(job)
        self._open.append(job)
        self.queued_bytes = after
        self.stats.queued += 1
        self.stats.peak_queue = max(self.stats.peak_queue, self._outstanding)
        self.stats.peak_bytes = max(self.stats.peak_bytes, after)
        if victim is not None:
            self.stats.superseded += 1
            self._event("superseded", victim, supersededBy=sub.checkpoint_id)
            self._end(victim, Superseded(victim.sub.checkpoint_id, by=sub.checkpoint_id))
        self._event("queued", job)
        self._wake.set()
        return job.ticket

    async def wait(self, ticket: SaveTicket, budget: float | None = None) -> SaveOutcome:
        """design/state.md §5.5: the outcome, `DeadlineExpired` when the budget runs out,
        `ReplyLost` when the ticket closed without one."""
        seconds = self.config.durable_timeout_s if budget is None else budget
        try:
            async with asyncio.timeout(seconds):
                outcome = await asyncio.shield(ticket._future)
        except TimeoutError:
            return DeadlineExpired(ticket.checkpoint_id)
        return ReplyLost(ticket.checkpoint_id) if outcome is None else outcome

    # -- loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        """The writer task: one job at a time from the front until shut down."""
        self._task = asyncio.current_task()
        try:
            while True:
                while not self._queue and not self._stopping:
                    self._wake.clear()
                    await self._wake.wait()  # lifetime wait: ends at work or shutdown
                if self._stopping:
                    return
                job = self._queue.popleft()
                job.move("taken")
                self._current = job
                await self._write(job)
                self._current = None
        finally:
            for job in list(self._open):
                job.reservation.release()
                job.payloads = ()
                job.ticket._deliver(None)
                job.state = "ended"
            self._open.clear()
            self._queue.clear()
            self._ended.set()

    async def _write(self, job: _Job) -> None:
        sub = job.sub
        gate = self.faults.gate
        if gate is not None and not gate.is_set():
            self.faults.stalled.set()
            try:
                await gate.wait()  # a test stalls the writer; shutdown bounds this wait
            finally:
                self.faults.stalled.clear()
        self.queued_bytes -= job.size
        outcome: Committed | Failed
        try:
            envelope, digest = await asyncio.to_thread(_encode_checked, sub.manifest,
                                                       job.payloads)
            outcome = await self._commit(job, envelope, digest)
        except DomainError as exc:
            outcome = Failed(sub.checkpoint_id, exc.message)
        if isinstance(outcome, Committed):
            self.stats.committed += 1
            self._event("committed", job)
        else:
            self.stats.failed += 1
            self._event("failed", job, reason=outcome.reason)
        if self.faults.drop_reply_for == sub.checkpoint_id:
            self.faults.fired.append(f"drop_reply:{sub.checkpoint_id}")
            self._end(job, None)
        else:
            self._end(job, outcome)

    async def _commit(self, job: _Job, envelope: bytes, digest: bytes) -> Committed | Failed:
        sub = job.sub
        after = self.head[1] if self.head is not None else 0
        effects = self.pending.covering(after, sub.boundary) if sub.boundary > after else ()
        commit_job = CommitJob(
            run_id=self.path.run_id, lease_epoch=self.path.lease_epoch,
            checkpoint_id=sub.checkpoint_id, session_id=job.session_id,
            session_epoch=sub.session_epoch, episode_id=sub.episode_id, boundary=sub.boundary,
            compatibility_digest=digest_of(sub.manifest["compatibility"]), envelope=envelope,
            envelope_digest=digest, effects=effects, keep=self.config.keep_generations,
            finish=sub.finish)
        attempts = self.policy.attempts()
        for attempt in range(1, attempts + 1):
            try:
                await self.store.commit(commit_job, self.path, self.faults)
            except CommitFailure as exc:
                raise_if_cancelled()
                if exc.retryable and attempt < attempts:
                    structlog.get_logger("flyd.state").warning(
                        "checkpoint.retry", checkpoint_id=sub.checkpoint_id, attempt=attempt,
                        error=exc.message)
                    await asyncio.sleep(self.policy.backoff_s(attempt))
                    continue
                structlog.get_logger("flyd.state").warning(
                    "checkpoint.commit_failed", checkpoint_id=sub.checkpoint_id,
                    reason=exc.reason, error=exc.message, attempts=attempt)
                return Failed(sub.checkpoint_id, exc.reason)
            break
        self.head = (sub.checkpoint_id, sub.boundary)
        self.pending.prune(sub.boundary)
        return Committed(sub.checkpoint_id, sub.boundary)

    def _end(self, job: _Job, outcome: SaveOutcome | None) -> None:
        """Release the slot and drop the bytes, then deliver (design/state.md §5.3 steps 6–7)."""
        job.move("ended")
        job.reservation.release()
        job.payloads = ()
        if job in self._open:
            self._open.remove(job)
        job.ticket._deliver(outcome)

    def _event(self, name: str, job: _Job, **extra: Any) -> None:
        sub = job.sub
        event = {"event": name, "run": self.path.run_id, "leaseEpoch": self.path.lease_epoch,
                 "checkpointId": sub.checkpoint_id, "sessionId": job.session_id,
                 "epoch": sub.session_epoch, "episodeId": sub.episode_id,
                 "boundary": sub.boundary, "byteLength": job.size, **extra}
        try:
            self.sink(event)
        except Exception:  # a sink failure is counted, never retried, never an outcome
            self.stats.events_dropped += 1

    # -- shutdown ------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Take no new job, finish the current one (≤ `durable_timeout_s`), fail the queued
        ones "writer stopped", and wait for the loop to end."""
        self._stopping = True
        for job in list(self._queue):
            self._queue.remove(job)
            self.queued_bytes -= job.size
            self.stats.failed += 1
            self._event("failed", job, reason="writer stopped")
            self._end(job, Failed(job.sub.checkpoint_id, "writer stopped"))
        self._wake.set()
        if self._task is None:
            self._ended.set()
            return
        try:
            async with asyncio.timeout(self.config.durable_timeout_s):
                await self._ended.wait()
        except TimeoutError:
            self._task.cancel()
            async with asyncio.timeout(self.config.durable_timeout_s):
                await self._ended.wait()


def _encode_checked(manifest: Mapping[str, Any], payloads: Sequence[tuple[str, bytes]]
                    ) -> tuple[bytes, bytes]:
    """design/state.md §5.3 step 3 (in a worker thread): every payload is what the manifest
    declares; the envelope and its SHA-256."""
    declared = {str(p["name"]): p for p in manifest["payloads"]}
    for name, data in payloads:
        entry = declared.get(name)
        if (entry is None or str(entry["byteLength"]) != str(len(data))
                or entry["digest"] != hashlib.sha256(data).hexdigest()):
            raise DomainError(ErrorCode.INTERNAL,
                              f"payload {name} is not the content its capture declared",
                              Mutation.NONE)
    envelope = encode(manifest, payloads)
    return envelope, hashlib.sha256(envelope).digest()
