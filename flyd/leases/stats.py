"""The lease runtime's own figures: renewal latency, lease losses, checkpoint commits. Pure.

Why: an operator scraping a node (`flyd serve --metrics`, docs/operations.md) wants to see how
close renewals come to R and how often holds are lost, and what checkpoint commits cost. The
runtime already reads its clock around each renewal and each group commit; counting here costs
a few integer operations per heartbeat or commit and nothing per step, and keeps this layer free
of any metrics library (the node's collector turns these into Prometheus families at scrape
time).

- `Histogram`: cumulative-ready bucket counts with a sum and a count, fixed upper bounds.
- `LeaseStats`: `renew` (acknowledged renewals, in lease-clock seconds from send to reply),
  `renew_unknown` (renewals abandoned or failed: no latency is known), `losses` by reason
  (`flyd.leases.core.Reason`), `checkpoint_commit` (group commits that carried a checkpoint,
  send to committed reply, retries after an unknown outcome included) and `checkpoint_bytes`
  (their envelopes' bytes).
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

__all__ = ["LATENCY_BOUNDS_S", "Histogram", "LeaseStats"]

#: bucket upper bounds (seconds) for database round trips: 1 ms .. 10 s; above goes to +Inf
LATENCY_BOUNDS_S: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                           5.0, 10.0)


class Histogram:
    """Counts per bucket (`counts[i]`: observations ≤ `bounds[i]` and > `bounds[i-1]`; the
    last entry is above every bound), their sum and count."""

    def __init__(self, bounds: Sequence[float] = LATENCY_BOUNDS_S) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations ≤ it) per bucket, `inf` last (Prometheus `le`)."""
        out, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((bound, total))
        return out


@dataclass
class LeaseStats:
    renew: Histogram = field(default_factory=Histogram)
    renew_unknown: int = 0
    losses: collections.Counter[str] = field(default_factory=collections.Counter)
    checkpoint_commit: Histogram = field(default_factory=Histogram)
    checkpoint_bytes: int = 0
