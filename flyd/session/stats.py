"""A session's counters and latency histograms (design/session.md §6.11). Pure, no I/O.

Why a module of its own: the coordinator counts its phases, the call engine (`flyd.session.calls`)
its resolutions and every call's latency, and each exports itself as camelCase JSON
(`to_json`, design/session.md §6.11); one pair of objects, shared by reference, keeps them one set
of figures.

- `ResolutionEnd`: how the last resolution ended (`Answered`, `BudgetExpired`,
  `AttemptsExhausted`).
- `Stats`: advances, publications (and run-topic publications refused), prepares, commits,
  resolutions, `IN_PROGRESS` replies seen while resolving, and the last resolution's end and
  attempts; `to_json` is camelCase.
- `Metrics`: latency samples in µs per name (a method, or `step`) and the pacing lag.
  `Metrics(window=n)` keeps the newest n samples per name (a long run's node): `count` and
  `max` still cover every sample, the percentiles the window; without a window, all.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = ["Metrics", "ResolutionEnd", "Stats"]


class ResolutionEnd(StrEnum):
    """How the last resolution of an uncertain call ended (design/session.md §6.8)."""

    ANSWERED = "Answered"
    BUDGET_EXPIRED = "BudgetExpired"
    ATTEMPTS_EXHAUSTED = "AttemptsExhausted"


@dataclass
class Stats:
    advances: int = 0
    publications: int = 0
    #: run-topic publications the router refused (topics.md §14.1 rule 3)
    publications_refused: int = 0
    prepares: int = 0
    commits: int = 0
    resolutions: int = 0
    in_progress_replies: int = 0
    last_resolution: ResolutionEnd | None = None
    last_resolution_attempts: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"advances": self.advances, "publications": self.publications,
                "publicationsRefused": self.publications_refused,
                "prepares": self.prepares, "commits": self.commits,
                "resolutions": self.resolutions, "inProgressReplies": self.in_progress_replies,
                "lastResolution": None if self.last_resolution is None
                else self.last_resolution.value,
                "lastResolutionAttempts": self.last_resolution_attempts}


class Metrics:
    """Latency histograms per method and for `step` (µs), and pacing lag (module docstring)."""

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
