"""Liveness of a node's own parts (its router and its fork server): a pure state machine.

Why: a dead part is noticed by its exit and replaced; a hung one (SIGSTOPped, deadlocked, off
the CPU for good) answers nothing and exits never, so every run the node holds or claims burns
its attempts against it. A periodic probe with a deadline turns a hang into a fault: a part that
misses it is killed and replaced like a dead one. This module decides; the node's asyncio shell
(`flyd.node.parts`) sends the probes, kills and replaces, and reports back. No I/O, no clock:
every event carries `now` (seconds on the shell's monotonic clock).

States of one part (`PartLiveness.phase`):
- `idle`: answered; the next probe is due `period` after the answer (or at once on `request`).
- `probing`: a probe was sent at `sent_at` and must be answered by `next_at` (`deadline` later).
- `replacing`: the part missed its deadline or died; the shell kills it and brings up a new one.

Transitions (each returns the action the shell must take, or None):
- `tick(now)`: `idle` and due → `probing`, `Probe`; `probing` past its deadline → `replacing`,
  `Replace` (a miss; `GiveUp` instead when it is the last failure allowed: the shell replaces
  the part all the same).
- `answered(now)` (in `probing`): → `idle`; the failure count resets; a part that had been given
  up is back: `Recovered`.
- `lost(now, why)`: the part died on its own (or the probe found its connection gone) →
  `replacing`, `Replace`.
- `replaced(now)`: a new part is up → `idle`, probed at once: only an answer confirms it.
- `replace_failed(now, why)`: the replacement did not come up; the shell tries again.

Giving up: every miss and every failed replacement counts, an answer resets the count; at
`give_up_after` consecutive failures the part is given up (`GiveUp`, once): the node stops
claiming and hands its runs back (docs/launcher.md, "Hung parts"). The shell keeps trying to
replace a given-up part; its first answer after that is `Recovered`. A loss (the part died)
does not count by itself: a part that came up and was killed later (an operator's `kill`, a
burst of them) was brought back each time; a replacement that does not come up, or hangs
again, counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final

__all__ = ["GIVE_UP_AFTER", "GiveUp", "PartLiveness", "Phase", "Probe", "Recovered",
           "Replace", "Verdict"]

#: consecutive failures (misses, failed replacements) after which a part is given up
GIVE_UP_AFTER: Final = 3


class Phase(StrEnum):
    IDLE = "idle"
    PROBING = "probing"
    REPLACING = "replacing"


@dataclass(frozen=True, slots=True)
class Probe:
    """Send one probe now; its answer is due within the deadline."""

    part: str


@dataclass(frozen=True, slots=True)
class Replace:
    """Kill the part (SIGKILL; a stopped process dies too) and bring up a new one."""

    part: str
    reason: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    """The part cannot be brought back: stop claiming, hand the runs back."""

    part: str
    reason: str


@dataclass(frozen=True, slots=True)
class Recovered:
    """A given-up part answers again: claiming may resume."""

    part: str


Verdict = Probe | Replace | GiveUp | Recovered


@dataclass
class PartLiveness:
    """One part's probe state (module docstring). `period` and `deadline` are seconds."""

    part: str
    period: float
    deadline: float
    give_up_after: int = GIVE_UP_AFTER
    phase: Phase = Phase.IDLE
    next_at: float = 0.0
    sent_at: float | None = None
    answered_at: float | None = None
    failures: int = 0
    given_up: bool = False
    reason: str | None = None
    misses: int = 0
    replacements: int = 0

    def __post_init__(self) -> None:
        if self.period <= 0 or self.deadline <= 0 or self.give_up_after < 1:
            raise ValueError(f"{self.part}: period and deadline must be > 0 and give_up_after "
                             f">= 1; got {self.period}, {self.deadline}, {self.give_up_after}")

    def due(self) -> float | None:
        """When `tick` has something to do next (None while a replacement is under way)."""
        return None if self.phase is Phase.REPLACING else self.next_at

    def tick(self, now: float) -> Probe | Replace | GiveUp | None:
        if self.phase is Phase.IDLE and now >= self.next_at:
            self.phase, self.sent_at, self.next_at = Phase.PROBING, now, now + self.deadline
            return Probe(self.part)
        if self.phase is Phase.PROBING and now >= self.next_at:
            self.misses += 1
            self.phase = Phase.REPLACING
            why = f"the {self.part} did not answer its liveness probe within {self.deadline:g}s"
            give_up = self._failed(why)
            return give_up if give_up is not None else Replace(self.part, why)
        return None

    def request(self, now: float) -> None:
        """Probe at once (an idle part), e.g. when a run failed and its cause is in doubt."""
        if self.phase is Phase.IDLE:
            self.next_at = min(self.next_at, now)

    def answered(self, now: float) -> Recovered | None:
        if self.phase is not Phase.PROBING:
            return None  # a late answer from a part already being replaced
        self.phase, self.next_at, self.answered_at = Phase.IDLE, now + self.period, now
        self.failures = 0
        if self.given_up:
            self.given_up, self.reason = False, None
            return Recovered(self.part)
        self.reason = None
        return None

    def lost(self, now: float, why: str) -> Replace | None:
        if self.phase is Phase.REPLACING:
            return None
        self.phase, self.reason = Phase.REPLACING, why
        return Replace(self.part, why)

    def replaced(self, now: float) -> None:
        if self.phase is Phase.REPLACING:
            self.phase, self.next_at = Phase.IDLE, now
            self.replacements += 1

    def replace_failed(self, now: float, why: str) -> GiveUp | None:
        self.phase = Phase.REPLACING
        return self._failed(f"the {self.part} could not be brought back: {why}")

    def settled_since(self, t: float) -> bool:
        """Whether the part was found answering at or after `t`, or was given up."""
        return self.given_up or (self.answered_at is not None and self.answered_at >= t)

    def _failed(self, why: str) -> GiveUp | None:
        self.failures += 1
        self.reason = why
        if self.failures >= self.give_up_after and not self.given_up:
            self.given_up = True
            return GiveUp(self.part, why)
        return None
