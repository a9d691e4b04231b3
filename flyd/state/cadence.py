"""Checkpoint cadence and capture ids (design/state.md §9.1). Pure: the caller passes the time.

Rules:
- After each committed transition (boundary k) a capture is *due* when `every_steps > 0` and
  `k − last ≥ every_steps`, or `every_seconds > 0` and `now − last_time ≥ every_seconds`,
  whichever comes first. Both reset at every submitted capture, at bootstrap and at a restore
  (`reset(k, now)`).
- A due capture is hot, id `ck-e<N>-<n>`; final, drain and forced captures are
  `ck-e<N>-<n>-final`, `-drain`, `-forced`. `e<N>` is the session epoch; `n` counts every capture
  started in that epoch from 1 (a new epoch restarts it), so an id never recurs in a run.
- `BUSY` (the writer refused) leaves the capture due: the next boundary asks again, stepping
  goes on (the caller simply does not call `submitted`).
- With both cadences 0 nothing is ever due; final, drain and forced captures still happen.
- Captures are read-only and absent from behaviour, so no cadence changes behaviour.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

Kind = Literal["hot", "final", "drain", "forced"]
SUFFIX: Final[dict[Kind, str]] = {"hot": "", "final": "-final", "drain": "-drain",
                                  "forced": "-forced"}


class CadenceError(ValueError):
    """A cadence configuration no run could use (negative or non-finite values)."""

    code = "INVALID_ARGUMENT"
    mutation = "none"


@dataclass
class Cadence:
    every_steps: int
    every_seconds: float
    last_boundary: int = 0
    last_time: float = 0.0
    epoch: str = "e1"
    _count: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.every_steps, bool) or not isinstance(self.every_steps, int) \
                or self.every_steps < 0:
            raise CadenceError(f"every_steps must be an integer ≥ 0; got {self.every_steps!r}")
        seconds = self.every_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) \
                or not seconds >= 0 or seconds == float("inf"):
            raise CadenceError(f"every_seconds must be a finite number ≥ 0; got {seconds!r}")

    def reset(self, boundary: int, now: float, epoch: str | None = None) -> None:
        """Bootstrap, restore, or a submitted capture: both clocks restart here. A new epoch
        restarts the id counter."""
        self.last_boundary = boundary
        self.last_time = now
        if epoch is not None and epoch != self.epoch:
            self.epoch = epoch
            self._count = 0

    def due(self, boundary: int, now: float) -> bool:
        by_steps = self.every_steps > 0 and boundary - self.last_boundary >= self.every_steps
        by_time = self.every_seconds > 0 and now - self.last_time >= self.every_seconds
        return by_steps or by_time

    def next_id(self, kind: Kind = "hot") -> str:
        """A fresh capture id of this epoch (every started capture takes one)."""
        self._count += 1
        return f"ck-{self.epoch}-{self._count}{SUFFIX[kind]}"

    def submitted(self, boundary: int, now: float) -> None:
        self.reset(boundary, now)
