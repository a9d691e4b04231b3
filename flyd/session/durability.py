"""One session's durability: cadence captures, pending effects and the writer (design/state.md §5.7,
§9).

Why: the coordinator knows boundaries, the writer knows commits; something must decide after
each committed transition whether a capture is due, keep the transition's effect pending until
a checkpoint covers it, stop stepping at the pending-effects bound, and end a run with its last
transaction. The node's executor and the state tests drive sessions through this one class.

Rules:
- `record(k, epoch, payload)` after each committed transition: boundary k's behaviour record,
  already rebased onto `e1`, joins `PendingEffects` with the raw epoch that executed it.
- `after_boundary(coordinator, k)`: at the pending-effects bound a **forced** durable capture
  is taken and awaited until it commits (retrying after `recovery_backoff_s`; only lease loss or
  cancellation ends the wait); else, when the cadence is due, a **hot** capture: a slot is
  reserved before any participant is asked (`BUSY` → audit `capture-refused:<id>`, the capture
  stays due, stepping goes on), the coordinator captures, the writer queues it (replaceable).
  A capture refused with the epoch intact (a worker error with mutation `none`) is skipped the
  same way; one that failed the epoch raises its `SessionFailure`.
- `durable(coordinator, kind, finish=None, budget=None)`: a durable capture (`final`, `drain`,
  `forced`): reserve (waiting for a slot), capture, submit (never coalesced), await the outcome.
  `UNSUPPORTED` (too large for `max_envelope_bytes`, or more payloads than an envelope holds,
  `MAX_PAYLOADS`) is returned as `TooLarge` with both sizes, never retried; a
  forced capture raises it as `CheckpointTooLarge`, which ends the run. A payload-count refusal's
  outcome adds `payloadCount` and `payloadLimit` to design/state.md §5.2's
  `{error, byteLength, limit}`.
- A durable capture a participant refused with the epoch intact is returned as `Refusal`: the
  id and the participant's `SessionFailure` (who, code, message), so the grant can end the run
  naming it (`flyd.node.grant`); a forced one raises it as `CaptureRefused`. Every refusal is
  also logged `checkpoint.capture_refused`.
- Ids come from the cadence (`ck-e<N>-<n>[-final|-drain|-forced]`), so none recurs in a run.
- `committed` counts the generations this grant committed; `head` is the writer's (id, k).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import structlog

from flyd.session.fence import SessionFailure
from flyd.state.cadence import Cadence, Kind
from flyd.state.checkpoints import FinishRun
from flyd.state.envelope import MAX_PAYLOADS
from flyd.state.writer import (
    CaptureSubmission,
    CheckpointWriter,
    Committed,
    EnvelopeTooLarge,
    Reservation,
    SaveOutcome,
    SaveTicket,
)
from workers.types.domain import DomainError, ErrorCode

if TYPE_CHECKING:
    from flyd.session.coordinator import Coordinator

__all__ = ["CaptureRefused", "CheckpointTooLarge", "Durability", "Refusal", "TooLarge"]

log = structlog.get_logger("flyd.session.durability")

SLOT_POLL_S: Final = 0.05


@dataclass(frozen=True, slots=True)
class TooLarge:
    """A durable capture the writer refused as larger than `max_envelope_bytes`
    (design/state.md §5.2)."""

    checkpoint_id: str
    message: str
    byte_length: int
    limit: int
    payload_count: int | None = None

    def is_durable(self) -> bool:
        return False

    def outcome(self) -> dict[str, object]:
        """The failed run's outcome (design/state.md §5.2); a capture refused for its payload count
        adds `payloadCount` and `payloadLimit` (module rules)."""
        outcome: dict[str, object] = {"error": "checkpoint too large",
                                      "byteLength": self.byte_length, "limit": self.limit}
        if self.payload_count is not None:
            outcome.update(payloadCount=self.payload_count, payloadLimit=MAX_PAYLOADS)
        return outcome


class CheckpointTooLarge(Exception):
    """A forced capture can never commit: the session ends the run `failed` (design/state.md §5.2,
    §9.3)."""

    def __init__(self, refused: TooLarge) -> None:
        super().__init__(refused.message)
        self.refused = refused


@dataclass(frozen=True, slots=True)
class Refusal:
    """A durable capture a participant refused with the epoch intact (a worker error with
    mutation `none`, `flyd.session.capture` rule 4)."""

    checkpoint_id: str
    failure: SessionFailure


class CaptureRefused(Exception):
    """A forced capture a participant refused: stepping cannot go on without it."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.failure.message)
        self.refusal = refusal


class Durability:
    """Cadence + pending effects + writer for one session (module rules)."""

    def __init__(self, writer: CheckpointWriter, cadence: Cadence, *,
                 clock: Callable[[], float] = time.monotonic,
                 audit: Callable[[str], None] | None = None) -> None:
        self.writer = writer
        self.cadence = cadence
        self.clock = clock
        self.audit = audit or (lambda line: None)
        self.committed = 0

    @property
    def head(self) -> tuple[str, int] | None:
        return self.writer.head

    @property
    def head_boundary(self) -> int:
        return self.writer.head[1] if self.writer.head is not None else 0

    def record(self, boundary: int, session_epoch: str, payload: dict[str, Any],
               result: dict[str, Any] | None = None) -> None:
        self.writer.pending.append(boundary, session_epoch, payload, result)

    def restart(self, boundary: int, session_epoch: str) -> None:
        """Bootstrap or restore at `boundary` in `session_epoch`: pending effects beyond the head
        go (they will be executed again), the cadence restarts."""
        self.writer.pending.rewind(self.head_boundary)
        self.cadence.reset(boundary, self.clock(), session_epoch)

    # ------------------------------------------------------------------ after each boundary

    async def after_boundary(self, coordinator: Coordinator, boundary: int) -> None:
        if self.writer.pending.full():
            await self.forced(coordinator)
        elif self.cadence.due(boundary, self.clock()):
            await self.hot(coordinator, boundary)

    async def hot(self, coordinator: Coordinator, boundary: int) -> None:
        checkpoint_id = self.cadence.next_id("hot")
        try:
            reservation = self.writer.reserve()
        except DomainError as exc:
            self.audit(f"capture-refused:{checkpoint_id}")
            log.info("checkpoint.deferred", checkpoint_id=checkpoint_id, reason=exc.message)
            return
        ticket = await self._capture_and_submit(coordinator, checkpoint_id, reservation,
                                                replaceable=True, finish=None)
        if isinstance(ticket, SaveTicket):
            self.cadence.submitted(boundary, self.clock())
            ticket.add_done_callback(self._count)

    async def forced(self, coordinator: Coordinator) -> None:
        """Stop stepping until a durable capture commits (design/state.md §9.2); retries after a
        failure."""
        backoff = self.writer.config.recovery_backoff_s
        while True:
            outcome = await self.durable(coordinator, "forced")
            if isinstance(outcome, Committed):
                return
            if isinstance(outcome, TooLarge):
                raise CheckpointTooLarge(outcome)
            if isinstance(outcome, Refusal):
                raise CaptureRefused(outcome)
            log.warning("checkpoint.forced_retry", checkpoint_id=outcome.checkpoint_id,
                        outcome=type(outcome).__name__, backoff_s=backoff)
            await asyncio.sleep(backoff)

    # ------------------------------------------------------------------ durable captures

    async def durable(self, coordinator: Coordinator, kind: Kind,
                      finish: FinishRun | None = None, budget: float | None = None,
                      checkpoint_id: str | None = None) -> SaveOutcome | TooLarge | Refusal:
        """`checkpoint_id`: one the caller took from the cadence already (a final capture's
        outcome names its id before the capture exists)."""
        checkpoint_id = checkpoint_id or self.cadence.next_id(kind)
        reservation = await self._reserve()
        try:
            ticket = await self._capture_and_submit(coordinator, checkpoint_id, reservation,
                                                    replaceable=False, finish=finish)
        except EnvelopeTooLarge as exc:
            return TooLarge(checkpoint_id, exc.message, exc.byte_length, exc.limit,
                            exc.payload_count)
        if isinstance(ticket, Refusal):
            return ticket
        assert ticket is not None  # the writer drops only a replaceable (hot) capture
        outcome = await self.writer.wait(ticket, budget)
        if isinstance(outcome, Committed):
            self.committed += 1
        return outcome

    async def _reserve(self) -> Reservation:
        while True:
            try:
                return self.writer.reserve()
            except DomainError as exc:
                if exc.code != ErrorCode.BUSY or self.writer.stopping:
                    raise
            await asyncio.sleep(SLOT_POLL_S)

    async def _capture_and_submit(self, coordinator: Coordinator, checkpoint_id: str,
                                  reservation: Reservation, *, replaceable: bool,
                                  finish: FinishRun | None) -> SaveTicket | Refusal | None:
        """The writer's ticket; a participant's refusal; None when the writer refused a hot
        capture (it stays due)."""
        try:
            capture = await coordinator.capture(checkpoint_id,
                                                kind="hot" if replaceable else "durable")
        except SessionFailure as exc:
            reservation.release()
            if coordinator.fenced:
                raise
            # the participant's reason (an unpicklable world names itself) reaches the log and
            # a durable capture's outcome, instead of vanishing
            log.warning("checkpoint.capture_refused", checkpoint_id=checkpoint_id,
                        participant=exc.participant, code=str(exc.error.code),
                        reason=exc.error.message)
            return Refusal(checkpoint_id, exc)
        except BaseException:
            reservation.release()
            raise
        try:
            return self.writer.submit(reservation, CaptureSubmission(
                checkpoint_id=capture.checkpoint_id, boundary=capture.boundary,
                session_epoch=capture.session_epoch, episode_id=capture.episode_id,
                manifest=capture.manifest, payloads=capture.payloads,
                replaceable=replaceable, finish=finish))
        except DomainError as exc:
            self.audit(f"capture-refused:{checkpoint_id}")
            if replaceable and exc.code in (ErrorCode.BUSY, ErrorCode.UNSUPPORTED):
                log.info("checkpoint.refused", checkpoint_id=checkpoint_id, reason=exc.message)
                return None
            raise

    def _count(self, ticket: SaveTicket) -> None:
        if isinstance(ticket.outcome(), Committed):
            self.committed += 1
