"""`TraceLog`, the trace comparator and `EpochRebase` (design/session.md §6.12). Pure.

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

import collections
import copy
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from workers.types.canonical import canonical
from workers.types.domain import DomainError, ErrorCode, Mutation

__all__ = ["EpochRebase", "Minter", "RecordStream", "TraceLog", "TransitionTrace", "compare"]


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
    """Every committed transition of a session, in order.

    Bounded form (a node's session, which lives as long as its run): `keep` full transitions
    (the newest) and, for the newest `horizon` transitions, their step and event count, so that
    `events()` and `cut(k)` stay exact for any k within the horizon; a cut further back is
    `INTERNAL` (the caller sizes the horizon to reach its oldest possible restore point).
    Without bounds every transition is kept."""

    transitions: list[TransitionTrace] = field(default_factory=list)
    phase_source: Callable[[], list[str]] | None = None
    abandoned: list[TransitionTrace] = field(default_factory=list)
    """Transitions a restore cut off (beyond its boundary, design/state.md §7.2 step 8)."""
    keep: int | None = None
    horizon: int | None = None
    _tally: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)
    _events: int = 0
    _forgotten: int | None = None
    """The newest step whose event count left the tally (None: nothing left it)."""

    @property
    def phases(self) -> list[str]:
        return [] if self.phase_source is None else self.phase_source()

    def record(self, behaviour: dict[str, Any], operational: dict[str, Any]) -> TransitionTrace:
        validate_behaviour(behaviour)
        entry = TransitionTrace(behaviour, operational)
        self.transitions.append(entry)
        count = len(behaviour.get("eventIds", []))
        self._events += count
        if self.horizon is not None:
            self._tally.append((int(behaviour["scope"]["step"]), count))
            while len(self._tally) > self.horizon:
                self._forgotten = self._tally.popleft()[0]
        if self.keep is not None and len(self.transitions) >= 2 * self.keep:
            del self.transitions[:len(self.transitions) - self.keep]
        return entry

    def events(self) -> int:
        """The task events (`eventIds`) of every transition recorded and not cut."""
        return self._events

    def cut(self, k: int) -> tuple[int, int] | None:
        """Keep the transitions that end at or before k; the kept window's others move to
        `abandoned`. Returns the abandoned boundary range `(k+1, last+1)`, or None."""
        if self._forgotten is not None and self._forgotten >= k:
            raise _invalid(f"cannot cut to boundary {k}: the trace's history starts after "
                           f"step {self._forgotten}")
        kept = [t for t in self.transitions if int(t.behaviour["scope"]["step"]) < k]
        cut = [t for t in self.transitions if int(t.behaviour["scope"]["step"]) >= k]
        if self.horizon is not None:
            gone = [(step, n) for step, n in self._tally if step >= k]
            self._tally = collections.deque(x for x in self._tally if x[0] < k)
            self._events -= sum(n for _, n in gone)
            last = max((step for step, _ in gone), default=None)
        else:
            self._events -= sum(len(t.behaviour.get("eventIds", [])) for t in cut)
            last = max((int(t.behaviour["scope"]["step"]) for t in cut), default=None)
        self.transitions[:] = kept
        self.abandoned.extend(cut)
        if self.keep is not None:
            del self.abandoned[:max(0, len(self.abandoned) - self.keep)]
        return None if last is None else (k + 1, last + 1)

    def behaviour(self) -> list[str]:
        """One canonical JSON string per transition."""
        return [t.behaviour_json() for t in self.transitions]

    def operational(self) -> list[dict[str, Any]]:
        return [t.operational for t in self.transitions]

    def __len__(self) -> int:
        return len(self.transitions)


class RecordStream:
    """One grant's behaviour records (a failed run's digest) in bounded memory: the records
    not yet durable stay here (a recovery may drop them, `rewind`); once the head covers them
    (`settle`) they are folded into a running SHA-256 of the canonical JSON list, then
    forgotten. `digest()` equals `digest_of(all records)`. (`flyd run --trace` writes them
    through `flyd.session.outputs.TraceFile`.)"""

    def __init__(self) -> None:
        self._tail: list[bytes] = []
        self._settled = 0
        self._hash = hashlib.sha256(b"[")

    def __len__(self) -> int:
        return self._settled + len(self._tail)

    def append(self, data: bytes) -> None:
        """The next record, as its canonical JSON bytes."""
        self._tail.append(data)

    def settle(self, count: int) -> None:
        """The first `count` records are durable: fold them."""
        n = min(count - self._settled, len(self._tail))
        if n <= 0:
            return
        done, self._tail = self._tail[:n], self._tail[n:]
        for data in done:
            self._hash.update(b"," + data if self._settled else data)
            self._settled += 1

    def rewind(self, count: int) -> None:
        """Keep the first `count` records (a recovery restored boundary `first + count`)."""
        if count < self._settled:
            raise _invalid(f"cannot rewind to {count} records: {self._settled} are durable")
        del self._tail[count - self._settled:]

    def digest(self) -> str:
        h = self._hash.copy()
        for i, data in enumerate(self._tail):
            h.update(b"," + data if self._settled or i else data)
        h.update(b"]")
        return h.hexdigest()


class EpochRebase:
    """Rewrite behaviour records of `from_epoch` as if they had run in `to_epoch`."""

    def __init__(self, from_epoch: str, to_epoch: str, task: Minter) -> None:
        self.from_epoch = from_epoch
        self.to_epoch = to_epoch
        self.task = task

    def id_map(self, step: int) -> dict[str, str]:
        """The event ids transition `step` → +1 may mint in `from_epoch`, each to its
        `to_epoch` spelling; empty when the epochs are the same (every id stays)."""
        if self.from_epoch == self.to_epoch:
            return {}
        return dict(zip(self.task.minted_ids(self.from_epoch, step + 1),
                        self.task.minted_ids(self.to_epoch, step + 1), strict=True))

    def apply(self, behaviour: dict[str, Any],
              ids: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The record rebased; `ids` is `id_map` of its step when the caller has it."""
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
        mapping = self.id_map(step) if ids is None else ids
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
