"""`AdminMemStore`: a `MemStore` that also takes raw writes outside the store protocol, as an
operator's SQL would, so the tests of the triggers run against the in-memory store too, and
the faults and views the contract tests and the simulator use: every backend with an open
commit killed at once (`terminate_backends`, as `pg_terminate_backend` over all sessions) and
the open commits themselves.

Why a test double: production code never writes outside the protocol, so these writes are no
part of `MemStore`; they keep what PostgreSQL's triggers keep (LF003: a terminal run stays
final unless it is an intervention; LF004: checkpoint rows are immutable). As a subclass it
uses the store's own tables; it is one of the named places in the tests that read a production
class's private members (tests/test_layout.py).
"""

from __future__ import annotations

from typing import Any

from flyd.leases.stores.contract import TERMINAL, LedgerImmutable, TerminalFinal
from flyd.leases.stores.mem import MemStore, OpenCommit

__all__ = ["AdminMemStore"]


class AdminMemStore(MemStore):
    """`MemStore` plus the raw `UPDATE`s the trigger tests send."""

    def admin_update_run(self, run_id: int, *, intervention: bool = False,
                         **changes: Any) -> None:
        """A raw `UPDATE flyd.runs` (`runs_terminal_is_final`, LF003)."""
        self._tick()
        r = self._runs.get(run_id)
        if r is None:
            return
        self._wait_for_row(run_id)
        if (r.state in TERMINAL and not intervention
                and (changes.get("state", r.state) != r.state
                     or changes.get("lease_epoch", r.lease_epoch) != r.lease_epoch)):
            raise TerminalFinal(f"run {run_id} is terminal ({r.state})")
        for name, value in changes.items():
            setattr(r, name, value)

    def admin_update_checkpoint(self, run_id: int, checkpoint_id: str) -> None:
        """A raw `UPDATE flyd.checkpoints` of any column (LF004)."""
        self._tick()
        if (run_id, checkpoint_id) in self._checkpoints:
            raise LedgerImmutable("UPDATE on flyd.checkpoints is not allowed")

    def open_commits(self) -> list[OpenCommit]:
        """Commits whose statements ran and whose COMMIT has not come, by backend pid."""
        self._tick()
        return [self._open[pid] for pid in sorted(self._open)]

    def terminate_backends(self) -> int:
        """Kill every session with an open commit (a backend-kill fault); returns how many."""
        self._tick()
        victims = [self._open[pid] for pid in sorted(self._open)]
        for h in victims:
            self._end(h, "terminated")
        return len(victims)
