"""Automatic recovery as node policy: attempts, backoff, classification (design/state.md §8.1–§8.3).

Pure and synchronous: the node's grant session (`flyd.node.grant`) performs the attempt; this module
decides whether there may be one, how long to wait first, and whether a failure is permanent.

Rules:
- Triggers (design/state.md §8.1): any `SessionFailure` of a session the node holds. Not a lost
  lease, a cancellation or a drain (the caller never asks then).
- `start()` begins an attempt: `attempt += 1`; past `max_attempts` → `Exhausted`. Attempts count
  consecutive recoveries without a durable commit between them: `committed()` (a `Committed`
  outcome after a resume) resets the count and the backoff. `refund()` gives back an attempt
  interrupted by a router death (the grant session reconnects and starts it again).
- Backoff before a retry of a failed attempt: `recovery_backoff_s`, doubling per failed attempt up
  to `recovery_backoff_max_s`.
- Permanent (design/state.md §8.2 step 9): `INCOMPATIBLE_STATE` from the restore's preconditions
  5–7, a stage or the ledger validation → `recovery.refused`, the run ends `failed` with
  `{code, message, checkpointId}`, no further attempt.
- Also permanent: a plugin failure that repeats (`repeats`: the error's `PluginFault` says so,
  for a model, world or task that cannot be imported, lacks its class, or raises in its
  constructor). The next attempt would build the same plugin from the same spec and fail the
  same way, so the run ends `failed` at once (`flyd.node.grant`: `{error: "plugin failed", …}`)
  without spending a recovery attempt. The mark is a flag in the error's data rather than a
  new error code: the design/session.md §1.6 codes say what kind of failure it is
  (`INVALID_ARGUMENT` for an import, `BACKEND_FAILURE` for a constructor), the flag whether trying
  again can help. A plugin's exception in a later call (`stage: call`) is retried: a restore from
  the head may not reach the same inputs. Everything else is retried.
- `RESTORE_DIVERGED` (a restored world that does not observe what its checkpoint recorded,
  design/session.md §6.12 amendment 2026-12-07) fails the attempt and is retried, never continued:
  the checkpoint itself is sound, and a world may restore differently on the next attempt (an
  adapter falling back to replay). Once the attempts are spent the run ends `recovery attempts
  exhausted` with it as `lastFailure`, naming the world and the view.
- A durable capture a participant refused with the epoch intact is no session failure (the
  session could step on), so it never starts a recovery. One refused `UNSUPPORTED`
  (`capture_repeats`: its state does not fit one bus frame, an env that cannot be pickled, a
  participant without `checkpoint-v1`) would be refused on every attempt: the next one resumes
  the same deterministic run to the same boundary. The run ends `failed` at once, like a capture
  too large for the writer (design/state.md §5.2). Any other refusal hands the run back for another
  attempt (`flyd.node.grant`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.types.domain import DomainError, ErrorCode

__all__ = ["Exhausted", "RecoveryBudget", "capture_repeats", "is_permanent", "repeats"]


@dataclass(frozen=True, slots=True)
class Exhausted:
    attempts: int


@dataclass
class RecoveryBudget:
    max_attempts: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    attempt: int = 0
    recoveries: int = 0
    _next_backoff: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self._next_backoff = self.backoff_s

    def start(self) -> int | Exhausted:
        """Begin an attempt: its number (1-based), or `Exhausted` past the bound."""
        self.attempt += 1
        if self.attempt > self.max_attempts:
            return Exhausted(self.attempt - 1)
        return self.attempt

    def failed(self) -> float:
        """The attempt failed: the backoff to sleep before the next one (doubling, capped)."""
        delay = self._next_backoff
        self._next_backoff = min(self._next_backoff * 2, self.backoff_max_s)
        return delay

    def refund(self) -> None:
        """The attempt was interrupted by something recovery itself repairs (a router death):
        it does not count, and the backoff does not grow."""
        self.attempt = max(0, self.attempt - 1)

    def resumed(self) -> None:
        """The attempt succeeded: the session steps again."""
        self.recoveries += 1

    def committed(self) -> None:
        """A durable commit after a resume: the next failure starts from attempt 1."""
        self.attempt = 0
        self._next_backoff = self.backoff_s


def repeats(error: DomainError) -> bool:
    """A plugin failure that the same spec fails the same way on every attempt."""
    return error.data is not None and error.data.repeats


def is_permanent(error: DomainError) -> bool:
    """design/state.md §8.2 step 9: an incompatible head can never be installed; a plugin failure
    that repeats recurs on every attempt. Retrying cannot help either."""
    return error.code == ErrorCode.INCOMPATIBLE_STATE or repeats(error)


def capture_repeats(error: DomainError) -> bool:
    """A participant's refusal of a durable capture that every attempt would meet again."""
    return error.code == ErrorCode.UNSUPPORTED
