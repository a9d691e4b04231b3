"""What a caller steers a session's coordinator with, and what a step tells it
(design/session.md §6.1, §6.7).

Why a module of its own: these are the plain values at the coordinator's edge — a node or a test
builds a `History` and holds a `PauseHandle`, and reads `StepReport`s — with no rule of the
transaction in them; stating them apart keeps the coordinator to the session's state and phases.

- `History`: how much per-step history a coordinator keeps (all by default; a node bounds it).
- `StepReport`: the boundary a step reached, whether the session paused there, and whether the
  episode ended (a terminal report is also a paused one).
- `PauseHandle`: a pause request, settable from any task or thread; the coordinator reads and
  clears it only at a committed boundary (design/session.md §6.7).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["History", "PauseHandle", "StepReport"]


@dataclass(frozen=True)
class History:
    """How much per-step history a coordinator keeps (all of it by default: a test reads the
    whole session). A node's session passes bounds, so its memory does not grow with the run:
    the newest `entries` audit entries, phase edges and latency samples; the newest
    `transitions` traced transitions in full; the step and event count of the newest `horizon`
    transitions (to reach back to the oldest boundary a recovery can restore)."""

    entries: int | None = None
    transitions: int | None = None
    horizon: int | None = None


@dataclass(frozen=True)
class StepReport:
    boundary: int
    paused: bool
    terminal: bool


class PauseHandle:
    """A pause request flag, settable from any task or thread."""

    def __init__(self) -> None:
        self._flag = threading.Event()

    def request(self) -> None:
        self._flag.set()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def clear(self) -> None:
        self._flag.clear()
