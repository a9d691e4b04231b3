"""`AuditLog`: the coordinator's ordered list of audit strings (design/session.md §6.10). Pure.

Exact forms: `hello:<worker>`, `environment.initialize`, `task.bootstrap`,
`agent.initialize:<agent>`, `acknowledge.lifecycle`, `publish:descriptor`,
`descriptor-revision:<n>`, `publish:<k>`, `prepared:<agent>@<k>`, `advance:<k>`, `evaluate:<k>`,
`committed:<agent>@<k>`, `pause:<k>`, `fail:<detail>[:<participant>]`,
`resolve:<worker>:<method>`, `replaced:<worker>`.

Resolved ambiguities: `index_of` of an absent string is None (tests compare positions, so a
missing entry must not look like position -1 "before" everything).

Bound: `AuditLog(limit=n)` keeps the newest n entries (a node's session runs for as long as
its run does; positions and counts are then over those entries); without a limit it keeps all
(tests of one session read the whole log).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

__all__ = ["AuditLog"]


class AuditLog:
    """An append-only, ordered list of audit strings."""

    def __init__(self, limit: int | None = None) -> None:
        self._entries: deque[str] = deque(maxlen=limit)

    def add(self, entry: str) -> None:
        self._entries.append(entry)

    def index_of(self, entry: str) -> int | None:
        """Position of the first exact match, or None."""
        try:
            return self._entries.index(entry)
        except ValueError:
            return None

    def count(self, entry: str) -> int:
        return self._entries.count(entry)

    def entries(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, entry: object) -> bool:
        return entry in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
