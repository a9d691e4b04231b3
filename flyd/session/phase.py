"""The coordinator's phase machine (design/session.md §6.2). Pure, synchronous, no I/O.

Why a machine of its own: a lockstep session is only coherent if every transition k → k+1 runs
Prepare, Apply, Observe and Commit in that order, and pauses, captures, restores and resets only
happen at a committed boundary. Writing those rules down once, as data, and refusing everything
else with one typed error keeps the coordinator from ever drifting into a half-step state, and
lets the rules be tested exhaustively without a bus.

Rules (in the style of h11's `_state.py`):

1. A session starts at `Starting` and moves only along the edges of `EDGES`; a phase carries its
   step (`Ready(k)`, `Observing(k+1)`, …) and an edge fixes the target's step relative to the
   source's (`StepRule`). Anything else raises `DomainError(INVALID_PHASE, "<from label> -> <to
   label> is not an edge", none)` and leaves the machine exactly as it was.
2. `move(target)` takes every edge but the failure edges; `fail()` is the only way into `Failed`,
   from every phase except `Failed` itself.
3. One transition k → k+1 is exactly `Ready(k) → Preparing(k) → Applying(k) → Observing(k+1) →
   Committing(k) → Ready(k+1)`: a step is never skipped or rewound.
4. Only a committed boundary (`Ready(k)`, `Paused(k)`) pauses or captures. `Capturing(k)` returns
   to the phase it came from (`capture_origin`), never to the other one.
5. `Ready(k) → Restoring(j)` (a cold install of a checkpoint as the start) exists only at k = 0
   while no transition was ever started (`stepped` is false); `Failed → Restoring(j)` exists for
   any j. `Restoring(k)` lands only on `Paused(k)`; `Resetting(k)` only on `Ready(0)`.
6. Every taken edge appends `(from, to)` to `phase_log`; `phase_path()` renders them as
   `"<from> -> <to>"`.
7. The fence (design/session.md §6.3), in its pure part: `fail()` closes it; only the
   `Restoring(k) → Paused(k)` edge lifts it. It is closed exactly while the phase is `Failed` or a
   `Restoring(k)` entered from `Failed`. What a fenced coordinator refuses, and `SessionFailure`,
   are in `flyd.session.fence`.

The edge table (design/session.md §6.2), as `EDGES`:

    Starting        -> Ready(0)
    Ready(k)        -> Preparing(k), Paused(k), Capturing(k);
                       Restoring(j) only when k = 0 and no transition was ever started
    Preparing(k)    -> Applying(k)
    Applying(k)     -> Observing(k+1)
    Observing(k+1)  -> Committing(k)
    Committing(k)   -> Ready(k+1)
    Paused(k)       -> Ready(k), Capturing(k), Resetting(k)
    Capturing(k)    -> capture_origin (Ready(k) or Paused(k))
    Failed          -> Restoring(j) for any j
    Restoring(k)    -> Paused(k)
    Resetting(k)    -> Ready(0)
    every phase but Failed -> Failed (only through fail())

`committed_boundary()` is k for `Ready(k)`, `Paused(k)`, `Capturing(k)`, else None;
`is_committed_boundary()` is true only for `Ready` and `Paused` (it guards publication and
capture).

API: phase values `Starting()`, `Ready(k)`, `Preparing(k)`, `Applying(k)`, `Observing(k+1)`,
`Committing(k)`, `Paused(k)`, `Capturing(k)`, `Failed()`, `Restoring(k)`, `Resetting(k)` (frozen,
hashable; `label`; `step` on the `Stepped` ones; `step_of`, `phase_of`); `PhaseMachine` with
`phase`, `move(target)`, `fail()`, `can_move`/`edge_to` (ask without raising),
`capture_origin`, `stepped`, `is_unstepped_zero()`, `fenced`, `committed_boundary()`,
`is_committed_boundary()`, `phase_log`, `phase_path()`; the table `EDGES` (by source:
`TRANSITIONS`) of `Edge(source, target, StepRule, Guard, Via)`; `not_an_edge(from, to)`.

Resolved ambiguities:
- "No transition was ever started" means `Preparing(k)` was never entered in this machine's
  lifetime. The mark is sticky: neither a reset to `Ready(0)` (design/session.md §8 test 26) nor a
  restore clears it. A session that reached `Ready(0)` through a restore at step 0 and never stepped
  may still cold-install; choosing a fresh epoch is the coordinator's concern
  (design/state.md §7.1).
- `move(Failed())` is refused with the ordinary message: the failure edges exist only through
  `fail()`, so the coordinator cannot enter `Failed` without its fail path. `fail()` from
  `Failed` is refused as `"Failed -> Failed is not an edge"`.
- A move to the phase the machine is already in (`Ready(3) -> Ready(3)`) is not an edge.
- `fail()` returns the phase it left, so the caller can name it in its `SessionFailure`;
  `capture_origin` is cleared when `Capturing` is left, whichever way.
- Steps are U64 (0..2^64-1), like a scope's step; `Observing(0)` does not exist (an observation
  follows a transition). Building such a phase is a flyd bug: `DomainError(INTERNAL, …, none)`.
- The fence state is kept here (`fenced`) because it is a function of the phase history alone;
  the coordinator reads it instead of keeping a second flag that could disagree.
- `PhaseMachine(log_limit=n)` keeps the newest n edges of the log (a node's long-running
  session); the guards never read the log, so the bound changes nothing but `phase_log`.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import ClassVar, Final

from workers.types.domain import U64_MAX, DomainError, ErrorCode, Mutation

__all__ = [
    "EDGES",
    "PHASE_CLASSES",
    "TRANSITIONS",
    "Applying",
    "Capturing",
    "Committing",
    "Edge",
    "Failed",
    "Guard",
    "Observing",
    "Paused",
    "Phase",
    "PhaseMachine",
    "PhaseName",
    "Preparing",
    "Ready",
    "Resetting",
    "Restoring",
    "Starting",
    "StepRule",
    "Stepped",
    "Via",
    "not_an_edge",
    "phase_of",
    "step_of",
]


class PhaseName(StrEnum):
    """The eleven phases of design/session.md §6.2; the value is the label's name part."""

    STARTING = "Starting"
    READY = "Ready"
    PREPARING = "Preparing"
    APPLYING = "Applying"
    OBSERVING = "Observing"
    COMMITTING = "Committing"
    PAUSED = "Paused"
    CAPTURING = "Capturing"
    FAILED = "Failed"
    RESTORING = "Restoring"
    RESETTING = "Resetting"


# --------------------------------------------------------------------------------------------
# Phases (values)


@dataclass(frozen=True, slots=True)
class Phase:
    """A phase value (abstract: build a leaf class); equal when class and step are equal."""

    name: ClassVar[PhaseName]

    @property
    def label(self) -> str:
        """`Failed`, `Ready(3)`, `Observing(4)`: the form of messages, logs and failures."""
        return self.name.value

    def __str__(self) -> str:
        return self.label


@dataclass(frozen=True, slots=True)
class Stepped(Phase):
    """A phase carrying a step (abstract): the boundary (Ready, Paused, …) or transition step."""

    step: int
    #: the smallest step the phase can carry (`Observing(0)` does not exist)
    minimum: ClassVar[int] = 0

    def __post_init__(self) -> None:
        step = self.step
        if isinstance(step, bool) or not isinstance(step, int):
            raise _bug(f"{self.name.value} needs an integer step; got {step!r}")
        if not self.minimum <= step <= U64_MAX:
            raise _bug(
                f"{self.name.value}({step}) does not exist: its step lies in "
                f"{self.minimum}..{U64_MAX}"
            )

    @property
    def label(self) -> str:
        return f"{self.name.value}({self.step})"


@dataclass(frozen=True, slots=True)
class Starting(Phase):
    """Before bootstrap reached `Ready(0)`."""

    name: ClassVar[PhaseName] = PhaseName.STARTING


@dataclass(frozen=True, slots=True)
class Ready(Stepped):
    """Boundary k is committed; the next transition may start."""

    name: ClassVar[PhaseName] = PhaseName.READY


@dataclass(frozen=True, slots=True)
class Preparing(Stepped):
    """Phase A of transition k: every agent prepares its decision."""

    name: ClassVar[PhaseName] = PhaseName.PREPARING


@dataclass(frozen=True, slots=True)
class Applying(Stepped):
    """Phase B of transition k: the controls go to the world (`Environment.Advance`)."""

    name: ClassVar[PhaseName] = PhaseName.APPLYING


@dataclass(frozen=True, slots=True)
class Observing(Stepped):
    """Phase C: the world reached boundary k+1 (the step carried); its observation is checked."""

    name: ClassVar[PhaseName] = PhaseName.OBSERVING
    minimum: ClassVar[int] = 1


@dataclass(frozen=True, slots=True)
class Committing(Stepped):
    """Phase D of transition k: every agent commits the next input."""

    name: ClassVar[PhaseName] = PhaseName.COMMITTING


@dataclass(frozen=True, slots=True)
class Paused(Stepped):
    """Boundary k is committed and play is held (pause, terminal episode, after a restore)."""

    name: ClassVar[PhaseName] = PhaseName.PAUSED


@dataclass(frozen=True, slots=True)
class Capturing(Stepped):
    """A checkpoint of boundary k is being captured; returns to where it came from."""

    name: ClassVar[PhaseName] = PhaseName.CAPTURING


@dataclass(frozen=True, slots=True)
class Failed(Phase):
    """The epoch failed and is fenced; only a restore leads out."""

    name: ClassVar[PhaseName] = PhaseName.FAILED


@dataclass(frozen=True, slots=True)
class Restoring(Stepped):
    """A checkpoint of boundary k is being installed (group restore or cold install)."""

    name: ClassVar[PhaseName] = PhaseName.RESTORING


@dataclass(frozen=True, slots=True)
class Resetting(Stepped):
    """An episode reset from `Paused(k)`; lands on `Ready(0)`."""

    name: ClassVar[PhaseName] = PhaseName.RESETTING


PHASE_CLASSES: Final[Mapping[PhaseName, type[Phase]]] = {
    cls.name: cls
    for cls in (
        Starting,
        Ready,
        Preparing,
        Applying,
        Observing,
        Committing,
        Paused,
        Capturing,
        Failed,
        Restoring,
        Resetting,
    )
}


def step_of(phase: Phase) -> int | None:
    """The step a phase carries, or None for `Starting` and `Failed`."""
    return phase.step if isinstance(phase, Stepped) else None


def phase_of(name: PhaseName, step: int | None = None) -> Phase:
    """Build a phase from its name and step (None exactly for `Starting` and `Failed`)."""
    cls = PHASE_CLASSES[PhaseName(name)]
    if issubclass(cls, Stepped):
        if step is None:
            raise _bug(f"{cls.name.value} needs a step")
        return cls(step)
    if step is not None:
        raise _bug(f"{cls.name.value} carries no step; got {step!r}")
    return cls()


# --------------------------------------------------------------------------------------------
# The edge table (data)


class StepRule(Enum):
    """How an edge fixes the target's step from the source's step s."""

    SAME = "k -> k"
    NEXT = "k -> k+1"
    PREVIOUS = "k+1 -> k"
    ZERO = "-> 0"
    ANY = "-> any j"
    NONE = "-> no step"

    def admits(self, source: int | None, target: int | None) -> bool:
        """True when a target step fits this rule for this source step."""
        if self is StepRule.NONE:
            return target is None
        if target is None:
            return False
        if self is StepRule.ZERO:
            return target == 0
        if self is StepRule.ANY:
            return True
        if source is None:
            return False
        if self is StepRule.SAME:
            return target == source
        if self is StepRule.NEXT:
            return target == source + 1
        return target == source - 1  # PREVIOUS


class Guard(Enum):
    """A condition on the machine's history that an edge needs besides the steps."""

    ALWAYS = "always"
    #: the source is `Ready(0)` and no transition was ever started
    UNSTEPPED_ZERO = "k = 0 and no transition was ever started"
    #: the target is the phase the capture came from
    CAPTURE_ORIGIN = "the target is capture_origin"


class Via(Enum):
    """Which call takes an edge."""

    MOVE = "move"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Edge:
    """One row of the design/session.md §6.2 table: source kind → target kind, step rule, guard,
    entry point."""

    source: PhaseName
    target: PhaseName
    step: StepRule
    guard: Guard = Guard.ALWAYS
    via: Via = Via.MOVE


EDGES: Final[tuple[Edge, ...]] = (
    Edge(PhaseName.STARTING, PhaseName.READY, StepRule.ZERO),
    Edge(PhaseName.READY, PhaseName.PREPARING, StepRule.SAME),
    Edge(PhaseName.READY, PhaseName.PAUSED, StepRule.SAME),
    Edge(PhaseName.READY, PhaseName.CAPTURING, StepRule.SAME),
    Edge(PhaseName.READY, PhaseName.RESTORING, StepRule.ANY, Guard.UNSTEPPED_ZERO),
    Edge(PhaseName.PREPARING, PhaseName.APPLYING, StepRule.SAME),
    Edge(PhaseName.APPLYING, PhaseName.OBSERVING, StepRule.NEXT),
    Edge(PhaseName.OBSERVING, PhaseName.COMMITTING, StepRule.PREVIOUS),
    Edge(PhaseName.COMMITTING, PhaseName.READY, StepRule.NEXT),
    Edge(PhaseName.PAUSED, PhaseName.READY, StepRule.SAME),
    Edge(PhaseName.PAUSED, PhaseName.CAPTURING, StepRule.SAME),
    Edge(PhaseName.PAUSED, PhaseName.RESETTING, StepRule.SAME),
    Edge(PhaseName.CAPTURING, PhaseName.READY, StepRule.SAME, Guard.CAPTURE_ORIGIN),
    Edge(PhaseName.CAPTURING, PhaseName.PAUSED, StepRule.SAME, Guard.CAPTURE_ORIGIN),
    Edge(PhaseName.FAILED, PhaseName.RESTORING, StepRule.ANY),
    Edge(PhaseName.RESTORING, PhaseName.PAUSED, StepRule.SAME),
    Edge(PhaseName.RESETTING, PhaseName.READY, StepRule.ZERO),
    # every phase except Failed -> Failed, only through fail()
    Edge(PhaseName.STARTING, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
    Edge(PhaseName.READY, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
    Edge(PhaseName.PREPARING, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
    Edge(PhaseName.APPLYING, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
    Edge(PhaseName.OBSERVING, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
    Edge(PhaseName.COMMITTING, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
    Edge(PhaseName.PAUSED, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
    Edge(PhaseName.CAPTURING, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
    Edge(PhaseName.RESTORING, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
    Edge(PhaseName.RESETTING, PhaseName.FAILED, StepRule.NONE, via=Via.FAIL),
)

#: `EDGES` indexed by source kind, in table order
TRANSITIONS: Final[Mapping[PhaseName, tuple[Edge, ...]]] = {
    name: tuple(edge for edge in EDGES if edge.source is name) for name in PhaseName
}


def not_an_edge(source: Phase, target: Phase) -> DomainError:
    """The one error of this module: `INVALID_PHASE`/`none`, naming both phases
    (design/session.md §6.2)."""
    return DomainError(
        ErrorCode.INVALID_PHASE, f"{source.label} -> {target.label} is not an edge", Mutation.NONE
    )


def _bug(message: str) -> DomainError:
    return DomainError(ErrorCode.INTERNAL, message, Mutation.NONE)


# --------------------------------------------------------------------------------------------
# The machine


class PhaseMachine:
    """The session's phase, the history the guards need, and the phase log. Starts at Starting."""

    def __init__(self, log_limit: int | None = None) -> None:
        self._phase: Phase = Starting()
        self._capture_origin: Ready | Paused | None = None
        self._stepped = False
        self._fenced = False
        self._log: collections.deque[tuple[Phase, Phase]] = collections.deque(maxlen=log_limit)

    # -- read-only state ---------------------------------------------------------------------

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def capture_origin(self) -> Ready | Paused | None:
        """While `Capturing(k)`: the phase it must return to; otherwise None."""
        return self._capture_origin

    @property
    def stepped(self) -> bool:
        """True once any transition was started (`Preparing` entered); never cleared."""
        return self._stepped

    @property
    def fenced(self) -> bool:
        """Closed by `fail()`; lifted only by `Restoring(k) -> Paused(k)`
        (design/session.md §6.3)."""
        return self._fenced

    @property
    def phase_log(self) -> tuple[tuple[Phase, Phase], ...]:
        """Every edge taken, `(from, to)`, oldest first (the newest `log_limit` when set)."""
        return tuple(self._log)

    def phase_path(self) -> list[str]:
        """The phase log as `"<from> -> <to>"` strings."""
        return [f"{source.label} -> {target.label}" for source, target in self._log]

    def committed_boundary(self) -> int | None:
        """k at `Ready(k)`, `Paused(k)` and `Capturing(k)`; None elsewhere."""
        phase = self._phase
        if isinstance(phase, Ready | Paused | Capturing):
            return phase.step
        return None

    def is_committed_boundary(self) -> bool:
        """True only at `Ready`/`Paused`: where publication and a capture may start."""
        return isinstance(self._phase, Ready | Paused)

    def is_unstepped_zero(self) -> bool:
        """`Ready(0)` of a session that never started a transition (cold install, replacement)."""
        return self._phase == Ready(0) and not self._stepped

    # -- questions -----------------------------------------------------------------------------

    def edge_to(self, target: Phase) -> Edge | None:
        """The table row `move(target)` would take now, or None when it would be refused."""
        return self._find(target, Via.MOVE)

    def can_move(self, target: Phase) -> bool:
        return self.edge_to(target) is not None

    # -- transitions -----------------------------------------------------------------------------

    def move(self, target: Phase) -> None:
        """Take the edge to `target`, or raise `INVALID_PHASE`/`none` and change nothing."""
        if self._find(target, Via.MOVE) is None:
            raise not_an_edge(self._phase, target)
        self._enter(target)

    def fail(self) -> Phase:
        """Move to `Failed` and close the fence; returns the phase left. Refused at `Failed`."""
        left = self._phase
        if self._find(Failed(), Via.FAIL) is None:
            raise not_an_edge(left, Failed())
        self._enter(Failed())
        return left

    # -- internals -------------------------------------------------------------------------------

    def _find(self, target: Phase, via: Via) -> Edge | None:
        source = self._phase
        for edge in TRANSITIONS[source.name]:
            if edge.via is not via or edge.target is not target.name:
                continue
            if not edge.step.admits(step_of(source), step_of(target)):
                continue
            if self._guard_holds(edge.guard, source, target):
                return edge
        return None

    def _guard_holds(self, guard: Guard, source: Phase, target: Phase) -> bool:
        if guard is Guard.ALWAYS:
            return True
        if guard is Guard.UNSTEPPED_ZERO:
            return step_of(source) == 0 and not self._stepped
        return target == self._capture_origin  # CAPTURE_ORIGIN

    def _enter(self, target: Phase) -> None:
        """Apply an edge already found in the table, with the history it updates."""
        source = self._phase
        self._capture_origin = None
        if isinstance(target, Capturing) and isinstance(source, Ready | Paused):
            self._capture_origin = source  # the table enters Capturing from nothing else
        if isinstance(target, Preparing):
            self._stepped = True
        if isinstance(target, Failed):
            self._fenced = True
        elif isinstance(source, Restoring) and isinstance(target, Paused):
            self._fenced = False
        self._log.append((source, target))
        self._phase = target

    def __repr__(self) -> str:
        return (
            f"PhaseMachine(phase={self._phase.label}, stepped={self._stepped}, "
            f"fenced={self._fenced}, capture_origin="
            f"{None if self._capture_origin is None else self._capture_origin.label})"
        )
