"""`PendingEffects`: committed boundaries whose ledger rows are not durable yet
(design/state.md §9.2).

Rules:
- `append(boundary, session_epoch, payload)` is called once per committed transition k → k+1
  with boundary k+1, the raw epoch `e<N>` that executed it and the behaviour record already
  rebased onto `e1`; boundaries are contiguous (the first one is any k ≥ 1, each next one is
  the previous appended + 1, or the head + 1 after a rewind). A gap, a repeat or a malformed
  epoch is `INTERNAL` (a caller bug).
- The payload is stored as its canonical bytes and SHA-256, so the ledger row's digest is
  computed once and the byte bound counts exactly what the ledger will hold.
- `append` takes the boundary's result too (`flyd.effects.result`, what `flyctl runs export`
  prints: world time, rewards, events, progress, ids rebased onto `e1`), kept as canonical
  bytes beside the payload and counted in the byte bound; it is no part of the digest, so a
  behaviour digest does not depend on it.
- `covering(after, through)` is the tuple of `flyd.effects` rows for boundaries in
  (after, through], `boundary-<j>` in order; a boundary missing from the buffer is `INTERNAL`
  (design/state.md §4.3 step 3), checked before anything is sent.
- `prune(through)` drops every boundary ≤ through, after the commit that covered them.
- `rewind(head)` drops every boundary > head (an automatic recovery restores the head into a
  new epoch; the re-executed boundaries are appended again).
- `full()` is true at `max_pending_effects` entries or `max_pending_effect_bytes` canonical
  payload bytes: the session stops stepping and forces a durable capture.

Decision where the spec is silent: a capture job never owns effects. The writer reads
(head, c] from this buffer when it sends the commit and prunes only after a durable commit, so
"taken by a job, returned on failure, handed to a superseding job" (design/distribution.md §6.2)
holds by construction: a failed or superseded job leaves the buffer as it was, and the next
committed job (whose boundary is not lower) covers every boundary the earlier one would have.
"""

from __future__ import annotations

import builtins
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from flyd.leases.stores.contract import CanonicalPayload, Effect
from workers.types.canonical import canonical
from workers.types.domain import DomainError, ErrorCode, Mutation

EPOCH_ID: Final = re.compile(r"e([1-9][0-9]*)")


def epoch_number(session_epoch: str) -> int:
    """N of a flyd session epoch `e<N>` (design/state.md §0); anything else is a caller bug."""
    m = EPOCH_ID.fullmatch(session_epoch)
    if m is None:
        raise DomainError(ErrorCode.INTERNAL, f"session epoch {session_epoch!r} is not e<N>",
                          Mutation.NONE)
    return int(m.group(1))


@dataclass(frozen=True, slots=True)
class _Pending:
    session_epoch: int
    payload: bytes
    digest: bytes
    result: bytes | None


def _size(entry: _Pending) -> int:
    return len(entry.payload) + (0 if entry.result is None else len(entry.result))


class PendingEffects:
    """The session's not-yet-durable behaviour records, keyed by boundary (module rules)."""

    def __init__(self, *, max_pending_effects: int, max_pending_effect_bytes: int) -> None:
        if max_pending_effects < 1 or max_pending_effect_bytes < 1:
            raise DomainError(ErrorCode.INTERNAL, "pending-effect bounds must be >= 1",
                              Mutation.NONE)
        self.max_pending_effects = max_pending_effects
        self.max_pending_effect_bytes = max_pending_effect_bytes
        self._entries: dict[int, _Pending] = {}
        self._bytes = 0
        self._last: int | None = None

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        """Canonical payload and result bytes held."""
        return self._bytes

    def boundaries(self) -> list[int]:
        return sorted(self._entries)

    def full(self) -> bool:
        return (len(self._entries) >= self.max_pending_effects
                or self._bytes >= self.max_pending_effect_bytes)

    def append(self, boundary: int, session_epoch: str, payload: Mapping[str, Any],
               result: Mapping[str, Any] | None = None) -> None:
        """Record boundary k+1's rebased behaviour record, its result and the raw epoch that
        executed it."""
        number = epoch_number(session_epoch)
        if self._last is not None:
            expected = self._last + 1
            if boundary != expected:
                raise DomainError(ErrorCode.INTERNAL, f"pending effect for boundary {boundary}; "
                                  f"expected {expected}", Mutation.NONE)
        elif boundary < 1:
            raise DomainError(ErrorCode.INTERNAL, f"boundary {boundary} has no effect",
                              Mutation.NONE)
        data = canonical(payload)
        produced = None if result is None else canonical(result)
        self._entries[boundary] = _Pending(number, data, hashlib.sha256(data).digest(), produced)
        self._bytes += _size(self._entries[boundary])
        self._last = boundary

    def encoded(self, boundary: int) -> builtins.bytes:
        """The canonical bytes of a pending boundary's payload (shared, not copied, by a
        record stream of the same run)."""
        entry = self._entries.get(boundary)
        if entry is None:
            raise DomainError(ErrorCode.INTERNAL, f"no pending effect for boundary {boundary}",
                              Mutation.NONE)
        return entry.payload

    def covering(self, after: int, through: int) -> tuple[Effect, ...]:
        """The ledger rows for boundaries in (after, through] (design/state.md §4.3 step 3)."""
        rows: list[Effect] = []
        for j in range(after + 1, through + 1):
            entry = self._entries.get(j)
            if entry is None:
                raise DomainError(ErrorCode.INTERNAL, f"no pending effect for boundary {j} "
                                  f"(covering {after + 1}..{through})", Mutation.NONE)
            rows.append(Effect(key=f"boundary-{j}", session_epoch=entry.session_epoch,
                               boundary=j, payload=CanonicalPayload(entry.payload),
                               digest=entry.digest,
                               result=None if entry.result is None
                               else CanonicalPayload(entry.result)))
        return tuple(rows)

    def prune(self, through: int) -> None:
        """Drop what a durable commit covered (boundaries ≤ through)."""
        for j in [b for b in self._entries if b <= through]:
            self._bytes -= _size(self._entries.pop(j))

    def rewind(self, head: int) -> None:
        """Drop boundaries beyond the head (a recovery re-executes them)."""
        for j in [b for b in self._entries if b > head]:
            self._bytes -= _size(self._entries.pop(j))
        if self._last is not None and self._last > head:
            self._last = head
