"""`TraceLog`, the trace comparator and `EpochRebase` (session.md §6.12). Pure.

A `TransitionTrace` has a **behaviour** record (canonical JSON, compared across runs) and an
**operational** record (wall time, request ids, bus ids, capture schedule: recorded, never
compared). `compare(a, b, rebase=None)` returns None or the first difference `(index, field)`:
`field` is the top-level behaviour key that differs (`agents`, `batchId`, `scope`, …), or
`"length"` with the shorter length as index when one trace has more transitions.

`EpochRebase(from_epoch, to_epoch, task)` rewrites, in a behaviour record of step k, exactly
`scope.epoch`, the epoch inside `batchId` (`batch-<epoch>-<k>`) and every event id found in
`task.minted_ids(from_epoch, k+1)` into the id at the same position of
`task.minted_ids(to_epoch, k+1)`; unknown ids stay unchanged so a comparison fails loudly.

Resolved ambiguities: `TraceLog.record` validates the record (every agent's
`committedStep == step+1`, `acknowledgedBoundary == publishedBoundary == step+1`, unique outcome
and event ids) and raises `DomainError(INTERNAL, …, unknown)` otherwise; `phases` is the
coordinator's phase path (strings) at the time it is read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.canonical import canonical
from workers.domain import DomainError, ErrorCode, Mutation

__all__ = ["EpochRebase", "Minter", "TraceLog", "TransitionTrace", "compare"]


class Minter(Protocol):
    def minted_ids(self, epoch: str, step: int) -> list[str]: ...


@dataclass(frozen=True)
class TransitionTrace:
    """One committed transition: behaviour (compared) and operational (never compared)."""

    behaviour: dict[str, Any]
    operational: dict[str, Any]

    def behaviour_json(self) -> str:
        return canonical(self.behaviour).decode("utf-8")


def _invalid(message: str) -> DomainError:
    return DomainError(ErrorCode.INTERNAL, f"trace: {message}", Mutation.UNKNOWN)


def validate_behaviour(b: dict[str, Any]) -> None:
    step = int(b["scope"]["step"])
    want = str(step + 1)
    for agent in b["agents"]:
        if agent["committedStep"] != want:
            raise _invalid(f"{agent['agentId']} committed {agent['committedStep']}, not {want}")
    if b["acknowledgedBoundary"] != want or b["publishedBoundary"] != want:
        raise _invalid(f"boundaries of step {step} are not {want}")
    for key in ("outcomeIds", "eventIds"):
        ids = b[key]
        if len(set(ids)) != len(ids):
            raise _invalid(f"{key} of step {step} are not unique")


@dataclass
class TraceLog:
    """Every committed transition of a session, in order."""

    transitions: list[TransitionTrace] = field(default_factory=list)
    phase_source: Callable[[], list[str]] | None = None
    abandoned: list[TransitionTrace] = field(default_factory=list)
    """Transitions a restore cut off (beyond its boundary, state.md §7.2 step 8)."""

    @property
    def phases(self) -> list[str]:
        return [] if self.phase_source is None else self.phase_source()

    def record(self, behaviour: dict[str, Any], operational: dict[str, Any]) -> TransitionTrace:
        validate_behaviour(behaviour)
        entry = TransitionTrace(behaviour, operational)
        self.transitions.append(entry)
        return entry

    def behaviour(self) -> list[str]:
        """One canonical JSON string per transition."""
        return [t.behaviour_json() for t in self.transitions]

    def operational(self) -> list[dict[str, Any]]:
        return [t.operational for t in self.transitions]

    def __len__(self) -> int:
        return len(self.transitions)


class EpochRebase:
    """Rewrite behaviour records of `from_epoch` as if they had run in `to_epoch`."""

    def __init__(self, from_epoch: str, to_epoch: str, task: Minter) -> None:
        self.from_epoch = from_epoch
        self.to_epoch = to_epoch
        self.task = task

    def apply(self, behaviour: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(behaviour)
        scope = out["scope"]
        if scope["epoch"] != self.from_epoch:
            return out
        step = int(scope["step"])
        scope["epoch"] = self.to_epoch
        prefix = f"batch-{self.from_epoch}-"
        batch = out.get("batchId")
        if isinstance(batch, str) and batch.startswith(prefix):
            out["batchId"] = f"batch-{self.to_epoch}-{batch[len(prefix):]}"
        mapping = dict(zip(self.task.minted_ids(self.from_epoch, step + 1),
                           self.task.minted_ids(self.to_epoch, step + 1), strict=True))
        for key in ("outcomeIds", "eventIds"):
            out[key] = [mapping.get(i, i) for i in out[key]]
        return out


def _records(trace: TraceLog | Sequence[TransitionTrace] | Sequence[dict[str, Any]]
             ) -> list[dict[str, Any]]:
    items: list[Any] = list(trace.transitions if isinstance(trace, TraceLog) else trace)
    out: list[dict[str, Any]] = []
    for item in items:
        out.append(item.behaviour if isinstance(item, TransitionTrace) else item)
    return out


def compare(a: TraceLog | Sequence[TransitionTrace] | Sequence[dict[str, Any]],
            b: TraceLog | Sequence[TransitionTrace] | Sequence[dict[str, Any]],
            rebase: EpochRebase | None = None) -> tuple[int, str] | None:
    """None when the behaviour of `a` (rebased when `rebase` is given) equals `b`'s; else the
    first difference `(index, field)`."""
    left = _records(a)
    right = _records(b)
    for index, (x, y) in enumerate(zip(left, right, strict=False)):
        if rebase is not None:
            x = rebase.apply(x)
        if canonical(x) == canonical(y):
            continue
        for key in sorted(set(x) | set(y)):
            if key not in x or key not in y or canonical(x[key]) != canonical(y[key]):
                return index, key
    if len(left) != len(right):
        return min(len(left), len(right)), "length"
    return None
