"""`ThreadBudget`: the node's worker-thread allocations (design/session.md §7.3).

Why: every session's workers and its coordinator get threads from one per-node budget, so a node
never oversubscribes its CPUs; the budget is pure bookkeeping (no I/O) so the node, the launcher
and the harness share it and it is tested exhaustively. Refusals are `DomainError` values:
`INVALID_ARGUMENT` for impossible requests, `CONFLICT` for a holder asking twice, `BUSY` when the
threads are not there.

Resolved ambiguities:
- `for_this_machine(capacity)` also takes the configured `[node] threads` and
  `[node] coordinator_reservation` (keywords); without them it uses the design/cli.md §2.3 defaults.
  Range checks of those keys (`threads ≥ reservation + 3`) belong to configuration loading.
- A session's coordinator holds its reservation under the name `coordinator-<tag>`; worker
  holders are their worker ids, so two sessions' workers must be named apart by the caller.
"""

from __future__ import annotations

import os
from typing import Final

from workers.types.domain import DomainError

DEFAULT_COORDINATOR_RESERVATION: Final = 1
#: threads of the default composition besides the reservation: the world and two agents
DEFAULT_COMPOSITION_WORKERS: Final = 3


def _plain(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def cpus() -> int:
    """CPUs this process may run on (`len(os.sched_getaffinity(0))`)."""
    return len(os.sched_getaffinity(0))


class ThreadBudget:
    """`total` threads shared by named holders; a session's coordinator holds a reservation."""

    def __init__(self, total: int, coordinator_reservation: int) -> None:
        if not _plain(total) or total <= 0:
            raise DomainError.invalid(f"a thread budget needs a total ≥ 1; got {total!r}")
        if not _plain(coordinator_reservation) or coordinator_reservation <= 0:
            raise DomainError.invalid(
                f"the coordinator reservation must be ≥ 1; got {coordinator_reservation!r}")
        if coordinator_reservation > total:
            raise DomainError.invalid(
                f"the coordinator reservation {coordinator_reservation} exceeds the total "
                f"{total}")
        self.total = total
        self.coordinator_reservation = coordinator_reservation
        self._held: dict[str, int] = {}

    @classmethod
    def for_this_machine(cls, capacity: int, *, threads: int | None = None,
                         coordinator_reservation: int = DEFAULT_COORDINATOR_RESERVATION
                         ) -> ThreadBudget:
        """The node's budget: `[node] threads` (default `max(cpus, 4·capacity)`) and
        `[node] coordinator_reservation` (default 1)."""
        if not _plain(capacity) or capacity < 1:
            raise DomainError.invalid(f"capacity must be ≥ 1; got {capacity!r}")
        total = threads if threads is not None else max(cpus(), 4 * capacity)
        return cls(total, coordinator_reservation)

    @property
    def used(self) -> int:
        return sum(self._held.values())

    @property
    def remaining(self) -> int:
        return max(0, self.total - self.used)

    def holders(self) -> dict[str, int]:
        """A copy of the current allocations."""
        return dict(self._held)

    def allocation(self, who: str) -> int | None:
        return self._held.get(who)

    def allocate(self, who: str, want: int) -> int:
        """Give `who` `want` threads, all or nothing; returns `want`."""
        if not _plain(want) or want <= 0:
            raise DomainError.invalid(f"{who} wants {want!r} threads; at least 1 is needed")
        if who in self._held:
            raise DomainError.before(
                "CONFLICT", f"{who} already holds {self._held[who]} threads")
        if want > self.remaining:
            raise DomainError.before(
                "BUSY", f"{who} wants {want} threads; {self.remaining} of {self.total} remain")
        self._held[who] = want
        return want

    def release(self, who: str) -> bool:
        """Return `who`'s threads; False when it held none."""
        return self._held.pop(who, None) is not None

    @staticmethod
    def session_holder(tag: str) -> str:
        return f"coordinator-{tag}"

    def open_session(self, tag: str) -> int:
        """Reserve the coordinator's threads of session `tag`."""
        return self.allocate(self.session_holder(tag), self.coordinator_reservation)

    def close_session(self, tag: str) -> bool:
        return self.release(self.session_holder(tag))

    def fits(self, need: int) -> bool:
        """True when a composition needing `need` threads can start now."""
        return need <= self.remaining

    def default_need(self) -> int:
        """The default composition's need: reservation + world + two agents."""
        return self.coordinator_reservation + DEFAULT_COMPOSITION_WORKERS

    def __repr__(self) -> str:
        return (f"ThreadBudget(total={self.total}, reservation={self.coordinator_reservation}, "
                f"used={self.used})")
