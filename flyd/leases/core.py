"""The lease core: per-grant bookkeeping, self-fence decisions, the guard
(design/distribution.md §5.2).

Sans-IO and synchronous: no sockets, no tasks, no clock reads. Every input that depends on time
carries the node's own clock reading (R2: `CLOCK_BOOTTIME`, or the harness clock under test).
Outputs are action values the runtime performs: `StartScope`, `CancelScope`, `StopForCancel`,
`Relinquish`, `Forget`.

Rules:
- R2: per grant `safe_until = max(old, t_send + G)`, applied only when a reply returns that
  row (`on_granted`, `on_renewed`); `on_renew_unknown` extends nothing. Never shortened.
- A hold is *final* in `DONE` or `LOST`; a final hold is never renewed, extended or revived.
- `renew_batch(now)` holds the STARTING/ACTIVE/COMMITTING holds with `safe_until > now`
  (FINISHING and RELEASING are left out: their own statement holds the row,
  design/distribution.md §5.4).
- A row missing from a renew reply is a loss (`CancelScope(renew_missing)`) only if the hold
  still has the batch's epoch and is still in a renewable phase (STARTING/ACTIVE/COMMITTING);
  a hold that moved to FINISHING/RELEASING/DONE/LOST meanwhile is left alone.
- `expire_due(now)`: every non-final hold with `now ≥ safe_until` is lost
  (`CancelScope(safe_until)`); `next_deadline()` is the earliest such instant (watchdog,
  design/distribution.md §5.4).
- Guard: `check(run, epoch, now, min_remaining)` raises `LeaseLost` when there is no such
  hold, it is final, or `now + min_remaining ≥ safe_until`. It mutates nothing.
- LeasePhase changes follow `TRANSITIONS` (data, below); any other `begin`/`end` is a
  `LeaseCoreError` (a runtime bug); `begin` on a lost hold raises `LeaseLost`; `end` on a
  lost hold is a no-op (the scope may unwind after its cancellation).
- Entering LOST emits exactly one `CancelScope`; `scope_gone` on a LOST hold emits
  `Relinquish` then `Forget`, once; entering DONE emits `Forget`. Every hold, LOST included,
  takes capacity until forgotten (design/distribution.md §5.5: a stuck scope keeps its capacity).
- `free_capacity(now)` is 0 unless a renewal was acknowledged (reply received, empty batch
  included) with `now − t_send ≤ 2·H`.
- A cancel request seen in a grant or renew row emits `StopForCancel` once per hold.

Ambiguities resolved:
- Holds are keyed by (run, epoch). A grant of a run at a higher epoch than a non-final hold the
  node still has proves the older grant over: the older one is lost with reason `fenced`. A
  grant at an epoch not above an existing hold's is a `LeaseCoreError` (M1: epochs only grow).
- "a phase it had when the batch was built" is read as "a renewable phase": ACTIVE →
  COMMITTING after the batch was built is still a loss (an open group commit never blocks
  renew, design/distribution.md §8 test 12), while FINISHING/RELEASING may have ended the lease
  legitimately.
- `begin`/`end` take the run only (design/distribution.md §5.2); they address the run's unique
  non-final hold, or the newest one when all are final.
- Outcomes of `end`: `committed`, `failed` (not committed for certain: back to the previous
  working phase, except a release, which stays RELEASING to be sent again), `lost`
  (`CancelScope(unknown_outcome_lost)`).
- A renew reply applied after `safe_until` passed but before `expire_due` ran still extends:
  the server renewed a live lease (M6) no earlier than `t_send`, so `t_send + G` is safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final, Literal

from flyd.leases.params import LeaseParams


class LeasePhase(StrEnum):
    STARTING = "STARTING"
    ACTIVE = "ACTIVE"
    COMMITTING = "COMMITTING"
    FINISHING = "FINISHING"
    RELEASING = "RELEASING"
    DONE = "DONE"
    LOST = "LOST"


Kind = Literal["start", "commit", "finish", "release"]
Outcome = Literal["committed", "failed", "lost"]
Reason = Literal[
    "safe_until", "renew_missing", "fenced", "unknown_outcome_lost", "drain_timeout", "node_fatal"
]

RENEWABLE: Final = frozenset({LeasePhase.STARTING, LeasePhase.ACTIVE, LeasePhase.COMMITTING})
FINAL: Final = frozenset({LeasePhase.DONE, LeasePhase.LOST})

# (phase, kind) -> phase after `begin`
BEGIN: Final[dict[tuple[LeasePhase, Kind], LeasePhase]] = {
    (LeasePhase.ACTIVE, "commit"): LeasePhase.COMMITTING,
    (LeasePhase.ACTIVE, "finish"): LeasePhase.FINISHING,
    (LeasePhase.STARTING, "release"): LeasePhase.RELEASING,
    (LeasePhase.ACTIVE, "release"): LeasePhase.RELEASING,
}
# (phase, kind, outcome) -> phase after `end`; "lost" is accepted from every working phase
END: Final[dict[tuple[LeasePhase, Kind, Outcome], LeasePhase]] = {
    (LeasePhase.STARTING, "start", "committed"): LeasePhase.ACTIVE,
    (LeasePhase.COMMITTING, "commit", "committed"): LeasePhase.ACTIVE,
    (LeasePhase.COMMITTING, "commit", "failed"): LeasePhase.ACTIVE,
    (LeasePhase.FINISHING, "finish", "committed"): LeasePhase.DONE,
    (LeasePhase.FINISHING, "finish", "failed"): LeasePhase.ACTIVE,
    (LeasePhase.RELEASING, "release", "committed"): LeasePhase.DONE,
    (LeasePhase.RELEASING, "release", "failed"): LeasePhase.RELEASING,
}
TRANSITIONS: Final = {"begin": BEGIN, "end": END}


# --------------------------------------------------------------------------------------------
# Errors (values: code, message, mutation certainty)


class LeaseError(Exception):
    """Base: an error value with a code, a message and a mutation certainty."""

    code: str = "LEASE_ERROR"

    def __init__(self, message: str, mutation: str = "none") -> None:
        self.message = message
        self.mutation = mutation
        super().__init__(self.code, message, mutation)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, LeaseError) and (self.code, self.message, self.mutation)
                == (other.code, other.message, other.mutation))

    def __hash__(self) -> int:
        return hash((self.code, self.message, self.mutation))


class LeaseLost(LeaseError):
    """Guard refusal (design/distribution.md §5.4): raised before any byte is written, so mutation
    is `none`."""

    code = "LEASE_LOST"


class LeaseCoreError(LeaseError):
    """A call the core's rules forbid: a runtime bug, never a lease decision."""

    code = "LEASE_CORE_PROTOCOL"


# --------------------------------------------------------------------------------------------
# Inputs and outputs


@dataclass(frozen=True, slots=True)
class GrantRow:
    run_id: int
    epoch: int
    attempt: int
    cancel_requested: bool = False


@dataclass(frozen=True, slots=True)
class RenewRow:
    run_id: int
    epoch: int
    cancel_requested: bool = False


@dataclass(frozen=True, slots=True)
class BatchEntry:
    run_id: int
    epoch: int
    phase: LeasePhase


@dataclass(frozen=True, slots=True)
class RenewBatch:
    built_at: float
    entries: tuple[BatchEntry, ...]


@dataclass(frozen=True, slots=True)
class Hold:
    run_id: int
    epoch: int
    attempt: int
    phase: LeasePhase
    safe_until: float
    cancel_requested: bool = False
    lost_reason: Reason | None = None


@dataclass(frozen=True, slots=True)
class StartScope:
    run_id: int
    epoch: int
    attempt: int


@dataclass(frozen=True, slots=True)
class CancelScope:
    run_id: int
    epoch: int
    reason: Reason


@dataclass(frozen=True, slots=True)
class StopForCancel:
    run_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Relinquish:
    run_id: int
    epoch: int


@dataclass(frozen=True, slots=True)
class Forget:
    run_id: int
    epoch: int


Action = StartScope | CancelScope | StopForCancel | Relinquish | Forget


# --------------------------------------------------------------------------------------------


class LeaseCore:
    """design/distribution.md §5.2. `capacity` is the number of holds the node may keep (including
    lost, unforgotten)."""

    def __init__(self, params: LeaseParams, node_id: str, capacity: int = 1) -> None:
        self.params = params.validate()
        self.node_id = node_id
        self.capacity = capacity
        self._g = params.G
        self._holds: dict[tuple[int, int], Hold] = {}
        self._last_ack: float | None = None

    # -- views -----------------------------------------------------------------------------
    @property
    def holds(self) -> tuple[Hold, ...]:
        return tuple(self._holds.values())

    def hold(self, run_id: int, epoch: int) -> Hold | None:
        return self._holds.get((run_id, epoch))

    def _current(self, run_id: int) -> Hold:
        mine = [h for h in self._holds.values() if h.run_id == run_id]
        if not mine:
            raise LeaseCoreError(f"no hold for run {run_id}")
        live = [h for h in mine if h.phase not in FINAL]
        return live[0] if live else max(mine, key=lambda h: h.epoch)

    def _put(self, h: Hold) -> None:
        self._holds[(h.run_id, h.epoch)] = h

    def _lose(self, h: Hold, reason: Reason) -> list[Action]:
        if h.phase in FINAL:
            return []
        self._put(replace(h, phase=LeasePhase.LOST, lost_reason=reason))
        return [CancelScope(h.run_id, h.epoch, reason)]

    def _flag_cancel(self, h: Hold, flagged: bool) -> list[Action]:
        if flagged and not h.cancel_requested and h.phase not in FINAL:
            self._put(replace(h, cancel_requested=True))
            return [StopForCancel(h.run_id, h.epoch)]
        return []

    # -- grants and renewals (R2) -----------------------------------------------------------
    def on_granted(self, rows: Iterable[GrantRow], t_send: float) -> list[Action]:
        out: list[Action] = []
        for row in rows:
            same = self._holds.get((row.run_id, row.epoch))
            if same is not None:  # own-grant sweep returning a grant already known
                if same.phase not in FINAL:
                    self._put(replace(same, safe_until=max(same.safe_until, t_send + self._g)))
                    out += self._flag_cancel(self._holds[(row.run_id, row.epoch)],
                                             row.cancel_requested)
                continue
            for h in [h for h in self._holds.values() if h.run_id == row.run_id]:
                if h.epoch > row.epoch:
                    raise LeaseCoreError(
                        f"grant of {row.run_id} at epoch {row.epoch} below held {h.epoch}")
                out += self._lose(h, "fenced")
            h = Hold(row.run_id, row.epoch, row.attempt, LeasePhase.STARTING, t_send + self._g)
            self._put(h)
            out.append(StartScope(row.run_id, row.epoch, row.attempt))
            out += self._flag_cancel(h, row.cancel_requested)
        return out

    def renew_batch(self, now: float) -> RenewBatch:
        return RenewBatch(now, tuple(
            BatchEntry(h.run_id, h.epoch, h.phase) for h in self._holds.values()
            if h.phase in RENEWABLE and h.safe_until > now
        ))

    def on_renewed(self, batch: RenewBatch, rows: Sequence[RenewRow],
                   t_send: float) -> list[Action]:
        self._last_ack = t_send if self._last_ack is None else max(self._last_ack, t_send)
        got = {(r.run_id, r.epoch): r for r in rows}
        out: list[Action] = []
        for e in batch.entries:
            h = self._holds.get((e.run_id, e.epoch))
            if h is None or h.phase in FINAL:
                continue
            row = got.get((e.run_id, e.epoch))
            if row is None:
                if h.phase in RENEWABLE:
                    out += self._lose(h, "renew_missing")
                continue
            self._put(replace(h, safe_until=max(h.safe_until, t_send + self._g)))
            out += self._flag_cancel(self._holds[(e.run_id, e.epoch)], row.cancel_requested)
        return out

    def on_renew_unknown(self, batch: RenewBatch) -> list[Action]:
        """A renewal that timed out or failed extends nothing and proves nothing lost."""
        return []

    # -- watchdog --------------------------------------------------------------------------
    def next_deadline(self) -> float | None:
        due = [h.safe_until for h in self._holds.values() if h.phase not in FINAL]
        return min(due) if due else None

    def expire_due(self, now: float) -> list[Action]:
        out: list[Action] = []
        for h in list(self._holds.values()):
            if h.phase not in FINAL and now >= h.safe_until:
                out += self._lose(h, "safe_until")
        return out

    # -- guard -----------------------------------------------------------------------------
    def check(self, run_id: int, epoch: int, now: float, min_remaining: float) -> Hold:
        h = self._holds.get((run_id, epoch))
        if h is None:
            raise LeaseLost(f"no hold for {run_id} at epoch {epoch}")
        if h.phase in FINAL:
            raise LeaseLost(f"{run_id}@{epoch} is {h.phase} ({h.lost_reason or 'ended'})")
        if now + min_remaining >= h.safe_until:
            raise LeaseLost(f"{run_id}@{epoch}: now + {min_remaining} ≥ safe_until")
        return h

    # -- phases ----------------------------------------------------------------------------
    def begin(self, run_id: int, kind: Kind) -> Hold:
        h = self._current(run_id)
        if h.phase in FINAL:
            raise LeaseLost(f"{run_id}@{h.epoch} is {h.phase}")
        nxt = BEGIN.get((h.phase, kind))
        if nxt is None:
            raise LeaseCoreError(f"begin {kind} not allowed in {h.phase} ({run_id}@{h.epoch})")
        h = replace(h, phase=nxt)
        self._put(h)
        return h

    def end(self, run_id: int, kind: Kind, outcome: Outcome = "committed") -> list[Action]:
        h = self._current(run_id)
        if h.phase is LeasePhase.LOST:
            return []
        if outcome == "lost" and h.phase not in FINAL:
            return self._lose(h, "unknown_outcome_lost")
        nxt = END.get((h.phase, kind, outcome))
        if nxt is None:
            raise LeaseCoreError(
                f"end {kind} {outcome} not allowed in {h.phase} ({run_id}@{h.epoch})")
        self._put(replace(h, phase=nxt))
        if nxt is LeasePhase.DONE:
            del self._holds[(h.run_id, h.epoch)]
            return [Forget(h.run_id, h.epoch)]
        return []

    def fence(self, run_id: int, epoch: int, reason: Reason) -> list[Action]:
        """Evidence of loss from outside the core (LF001, drain timeout, node fatal)."""
        h = self._holds.get((run_id, epoch))
        return [] if h is None else self._lose(h, reason)

    def scope_gone(self, run_id: int, epoch: int) -> list[Action]:
        """The lost scope's cleanup finished: relinquish once, then forget."""
        h = self._holds.get((run_id, epoch))
        if h is None or h.phase is not LeasePhase.LOST:
            return []
        del self._holds[(run_id, epoch)]
        return [Relinquish(run_id, epoch), Forget(run_id, epoch)]

    # -- claiming --------------------------------------------------------------------------
    def free_capacity(self, now: float) -> int:
        if self._last_ack is None or now - self._last_ack > 2 * self.params.H:
            return 0
        return max(0, self.capacity - len(self._holds))
