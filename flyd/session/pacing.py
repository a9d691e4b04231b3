"""Real-time pacing of transitions (design/session.md §5.4). Pure: it reads a clock, it never
sleeps.

A realtime session should start one transition per world step, without drift and without
catch-up bursts after a slow step. World time stays exact (`RationalNs`); only the *sleeping*
is rounded, to whole nanoseconds.

Rules:
- The period is `floor(step.numerator / step.denominator)` ns, or a fixed number of node-clock
  seconds (`Pacing.fixed`, the run spec's `paceS`, tests only).
- Deadlines are absolute on the monotonic clock: an object with `monotonic_ns()`, or a bare
  `() -> int` nanosecond function such as `time.monotonic_ns`.
- `before_transition()` returns how many nanoseconds to sleep before the transition starts:
  * the first call (the first transition after `Ready(0)`, or after `restart()`) returns 0 and
    sets `deadline = now + period`;
  * later: if `now < deadline` it returns `deadline − now`; else it returns 0 and adds
    `now − deadline` to `lag_ns`; then `deadline = max(deadline, now) + period`.
- The caller sleeps for the returned time and then starts the step latency timer.

Resolved ambiguities:
- `restart()` makes the next transition start at once again; the coordinator calls it on
  resume and after a restore so that a pause is not counted as lag.
- A fixed period is `round(seconds · 10^9)` ns and must be >= 1 ns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, Protocol

from workers.types.domain import DomainError, parse_finite
from workers.types.ticks import RationalNs

__all__ = ["SYSTEM_CLOCK", "Clock", "Pacing", "SystemClock"]


class Clock(Protocol):
    """A monotonic nanosecond clock (the node's, or a fake one in tests)."""

    def monotonic_ns(self) -> int: ...


class _CallableClock:
    """Adapts a bare `() -> int` nanosecond function (e.g. `time.monotonic_ns`)."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read

    def monotonic_ns(self) -> int:
        return self._read()


class SystemClock:
    def monotonic_ns(self) -> int:
        return time.monotonic_ns()


SYSTEM_CLOCK: Final = SystemClock()


class Pacing:
    """Absolute-deadline pacing: tells the caller how long to sleep before each transition."""

    def __init__(self, step: RationalNs, clock: Clock | Callable[[], int] = SYSTEM_CLOCK) -> None:
        if step.is_zero():
            raise DomainError.invalid("pacing needs a step > 0")
        self._period_ns = max(1, step.floor_ns())
        self._clock: Clock = clock if hasattr(clock, "monotonic_ns") else _CallableClock(clock)
        self._deadline_ns: int | None = None
        self._lag_ns = 0

    @classmethod
    def fixed(cls, seconds: float, clock: Clock | Callable[[], int] = SYSTEM_CLOCK) -> Pacing:
        """A fixed period in node-clock seconds (the run spec's `paceS`)."""
        period = round(parse_finite(seconds, "paceS") * 1_000_000_000)
        if period < 1:
            raise DomainError.invalid(f"paceS must be > 0; got {seconds}")
        return cls(RationalNs(period), clock)

    @property
    def period_ns(self) -> int:
        return self._period_ns

    @property
    def deadline_ns(self) -> int | None:
        """When the next transition may start; None before the first one."""
        return self._deadline_ns

    @property
    def lag_ns(self) -> int:
        """Total lateness of transitions that started after their deadline."""
        return self._lag_ns

    def before_transition(self) -> int:
        """Nanoseconds to sleep before starting the next transition (0 = start now)."""
        now = self._clock.monotonic_ns()
        deadline = self._deadline_ns
        if deadline is None:
            self._deadline_ns = now + self._period_ns
            return 0
        wait = 0
        if now < deadline:
            wait = deadline - now
        else:
            self._lag_ns += now - deadline
        self._deadline_ns = max(deadline, now) + self._period_ns
        return wait

    def restart(self) -> None:
        """The next transition starts at once (after a pause or a restore)."""
        self._deadline_ns = None
