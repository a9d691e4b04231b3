"""The artifact store's books (topics.md §5.2, §6): states, roots, sight and quotas.

Pure and synchronous: no files, no sockets, no timers. The router (`bus/router.py`) creates,
checks and unlinks the files (`bus/store.py`) and writes frames; this module decides whether an
allocate, seal, retain or attachment is allowed, keeps every root and the per-client charge, and
says which artifacts an operation collected, so the liveness rules live in one place.

Rules:

1. An artifact is `Allocated` from `allocate` until `seal`, then `Sealed`. Its moves are the
   data in `EDGES`; any other move is `LedgerError` (a router bug, never a peer's doing).
2. Roots keep an artifact alive: a connection's **hold** (a set per connection: allocate and
   retain add one, drop, transfer and the connection's end remove it) and **frame roots**, one
   per key (a Queued call or its request delivery, a routed result, a message), taken by
   `root(key, ...)` and ended by `unroot(key)`. An artifact with no root is collected in the
   same call that ended its last root, and returned from it exactly once.
3. A connection **sees** an artifact while it holds it or one of its unconsumed deliveries
   carries it (`see` / `unsee`, counted per connection). Only what it sees may it attach or
   retain (check A3); its own Queued frames give it no sight.
4. Store bytes count an artifact from allocate to collection; only allocate adds bytes, so the
   store never exceeds `max_store_bytes`. `held_bytes` of a connection is the sum of the
   lengths it holds, never above its quota: only holds are charged.
5. A refused request is a `BusError` raised before any change.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final, Generic, TypeVar

from bus.errors import (
    ArtifactGone,
    ArtifactUnsealed,
    Conflict,
    OwnerInvalid,
    QuotaExceeded,
)

__all__ = [
    "EDGES",
    "Artifact",
    "ArtifactLedger",
    "ArtifactState",
    "LedgerError",
    "StoreLimits",
]

C = TypeVar("C", bound=Hashable)


class ArtifactState(Enum):
    ALLOCATED = "Allocated"
    SEALED = "Sealed"
    COLLECTED = "Collected"


ALLOCATED: Final = ArtifactState.ALLOCATED
SEALED: Final = ArtifactState.SEALED
COLLECTED: Final = ArtifactState.COLLECTED

EDGES: Final = {
    ALLOCATED: frozenset({SEALED, COLLECTED}),
    SEALED: frozenset({COLLECTED}),
    COLLECTED: frozenset[ArtifactState](),
}


class LedgerError(RuntimeError):
    """A move the rules forbid: a router bug."""


@dataclass(frozen=True, slots=True)
class StoreLimits:
    """The store limits of topics.md §8, in wire names' order."""

    max_artifact_bytes: int = 16777216
    max_artifacts: int = 65536
    max_store_bytes: int = 1073741824
    max_held_bytes_per_client: int = 268435456
    max_holds_per_client: int = 4096
    max_allocations_per_client: int = 64


class Artifact(Generic[C]):
    """One artifact. `file` is the router's identity of its file (opaque here); `wire` its
    attachment object once sealed."""

    __slots__ = ("artifact_id", "digest", "file", "holders", "length", "owner", "roots",
                 "state")

    def __init__(self, artifact_id: str, length: int, owner: C, file: object) -> None:
        self.artifact_id = artifact_id
        self.length = length
        self.owner = owner
        self.file = file
        self.state = ALLOCATED
        self.digest = ""
        self.holders = 0
        self.roots = 0  # frame roots

    def wire(self) -> dict[str, object]:
        return {"artifactId": self.artifact_id, "length": self.length, "digest": self.digest}


class ArtifactLedger(Generic[C]):
    """Every live artifact of one store, its roots, and each connection's holds and sight."""

    def __init__(self, limits: StoreLimits, first_serial: int) -> None:
        self.limits = limits
        self.next_serial = first_serial
        self.artifacts: dict[str, Artifact[C]] = {}
        self.holds: dict[C, dict[str, Artifact[C]]] = {}
        self.held_bytes: dict[C, int] = {}
        self.allocations: dict[C, int] = {}  # Allocated artifacts per allocator
        self.sight: dict[C, dict[str, int]] = {}  # unconsumed deliveries carrying each id
        self.frames: dict[Hashable, tuple[Artifact[C], ...]] = {}
        self.bytes = 0
        self.allocated = 0
        self.hold_count = 0
        self.allocated_total = 0
        self.sealed_total = 0
        self.collected_total = 0

    # allocate and seal ----------------------------------------------------------------------
    def next_id(self) -> str:
        """The id the next allocation gets (the router names its file with it first)."""
        return f"art-{self.next_serial}"

    def check_allocate(self, conn: C, length: int) -> None:
        """The quota checks 4–7 of topics.md §5.3, in that order, so a refused allocation names
        the first limit it would break and creates nothing."""
        lim = self.limits
        if length > lim.max_artifact_bytes:
            raise QuotaExceeded(f"length {length} is above maxArtifactBytes "
                                f"({lim.max_artifact_bytes})")
        if self.allocations.get(conn, 0) >= lim.max_allocations_per_client:
            raise QuotaExceeded(f"maxAllocationsPerClient ({lim.max_allocations_per_client}) "
                                "reached")
        self._check_hold(conn, 1, length)
        if len(self.artifacts) >= lim.max_artifacts:
            raise QuotaExceeded(f"maxArtifacts ({lim.max_artifacts}) reached")
        if self.bytes + length > lim.max_store_bytes:
            raise QuotaExceeded(f"maxStoreBytes ({lim.max_store_bytes}) would be exceeded")

    def allocate(self, conn: C, length: int, file: object) -> Artifact[C]:
        """The accept of topics.md §5.3, after `check_allocate` passed and the file exists."""
        art = Artifact(self.next_id(), length, conn, file)
        self.next_serial += 1
        self.artifacts[art.artifact_id] = art
        self.bytes += length
        self.allocated += 1
        self.allocated_total += 1
        self.allocations[conn] = self.allocations.get(conn, 0) + 1
        self._hold(conn, art)
        return art

    def check_seal(self, conn: C, artifact_id: str) -> Artifact[C]:
        """topics.md §5.5 checks 3–5: the Allocated artifact `conn` may seal."""
        art = self.artifacts.get(artifact_id)
        if art is None:
            raise ArtifactGone(f"{artifact_id} is not an artifact of this store")
        if art.state is SEALED:
            raise Conflict(f"{artifact_id} is already sealed")
        if art.owner != conn:
            raise OwnerInvalid(f"{artifact_id} was allocated by another connection")
        return art

    def seal(self, art: Artifact[C], digest: str) -> None:
        """topics.md §5.5 accept: the file checks and the hash passed."""
        self._move(art, SEALED)
        art.digest = digest
        self.allocated -= 1
        self.sealed_total += 1
        self._decrement_allocations(art.owner)

    # attachments, retain, drop -------------------------------------------------------------
    def attachable(self, conn: C, ids: Sequence[str]) -> tuple[Artifact[C], ...]:
        """Checks A1–A3 of topics.md §6.2, in order over all ids (A1 for every id, then A2, then
        A3)."""
        arts = []
        for artifact_id in ids:
            art = self.artifacts.get(artifact_id)
            if art is None:
                raise ArtifactGone(f"{artifact_id} is not an artifact of this store")
            arts.append(art)
        for art in arts:
            if art.state is not SEALED:
                raise ArtifactUnsealed(f"{art.artifact_id} is not sealed")
        for art in arts:
            if not self.sees(conn, art.artifact_id):
                raise OwnerInvalid(f"this connection cannot see {art.artifact_id}")
        return tuple(arts)

    def sees(self, conn: C, artifact_id: str) -> bool:
        """Rule 3."""
        return (artifact_id in self.holds.get(conn, ())
                or artifact_id in self.sight.get(conn, ()))

    def retain(self, conn: C, ids: Sequence[str]) -> tuple[Artifact[C], ...]:
        """topics.md §5.7 `bus.retain` checks 4–7 and the accept, all or nothing."""
        arts = self.attachable(conn, ids)
        held = self.holds.get(conn, {})
        new = [a for a in arts if a.artifact_id not in held]
        self._check_hold(conn, len(new), sum(a.length for a in new))
        for art in new:
            self._hold(conn, art)
        return arts

    def drop(self, conn: C, ids: Iterable[str]) -> tuple[int, list[Artifact[C]]]:
        """topics.md §5.7 `bus.drop`: (holds ended, artifacts collected). Unknown or unheld ids are
        no-ops; a dropped Allocated artifact is collected (nothing else can root it)."""
        dropped = 0
        collected: list[Artifact[C]] = []
        held = self.holds.get(conn)
        if held is None:
            return 0, collected
        for artifact_id in ids:
            art = held.get(artifact_id)
            if art is None:
                continue
            dropped += 1
            self._unhold(conn, art, collected)
        return dropped, collected

    def transfer(self, conn: C, arts: Iterable[Artifact[C]]) -> list[Artifact[C]]:
        """topics.md §6.3: end `conn`'s holds on `arts` (those it only saw are unaffected); returns
        the artifacts collected (those the frame did not root)."""
        collected: list[Artifact[C]] = []
        held = self.holds.get(conn)
        if held is None:
            return collected
        for art in arts:
            if art.artifact_id in held:
                self._unhold(conn, art, collected)
        return collected

    # frame roots and sight -----------------------------------------------------------------
    def root(self, key: Hashable, arts: tuple[Artifact[C], ...]) -> None:
        """A frame (call, result, message) roots `arts` until `unroot(key)`."""
        if key in self.frames:
            raise LedgerError(f"{key!r} already roots artifacts")
        for art in arts:
            if art.state is not SEALED:
                raise LedgerError(f"{art.artifact_id} rooted by a frame while {art.state.value}")
            art.roots += 1
        self.frames[key] = arts

    def rooted(self, key: Hashable) -> tuple[Artifact[C], ...]:
        return self.frames.get(key, ())

    def unroot(self, key: Hashable) -> list[Artifact[C]]:
        """End the frame root of `key` (none is a no-op); returns the artifacts collected."""
        collected: list[Artifact[C]] = []
        for art in self.frames.pop(key, ()):
            art.roots -= 1
            if art.roots < 0:
                raise LedgerError(f"{art.artifact_id}: frame roots below zero")
            self._maybe_collect(art, collected)
        return collected

    def see(self, conn: C, arts: Iterable[Artifact[C]]) -> None:
        """A delivery carrying `arts` was written to `conn`."""
        seen = self.sight.setdefault(conn, {})
        for art in arts:
            seen[art.artifact_id] = seen.get(art.artifact_id, 0) + 1

    def unsee(self, conn: C, arts: Iterable[Artifact[C]]) -> None:
        """That delivery was consumed (or dropped with its connection)."""
        seen = self.sight.get(conn)
        if seen is None:
            return
        for art in arts:
            left = seen.get(art.artifact_id, 0) - 1
            if left < 0:
                raise LedgerError(f"{art.artifact_id}: sight below zero")
            if left:
                seen[art.artifact_id] = left
            else:
                del seen[art.artifact_id]
        if not seen:
            del self.sight[conn]

    def forget_connection(self, conn: C) -> list[Artifact[C]]:
        """Teardown step 9 (topics.md §11): its holds end (its Allocated artifacts are collected)
        and its sight goes; returns the artifacts collected."""
        collected: list[Artifact[C]] = []
        self.sight.pop(conn, None)
        for art in list(self.holds.get(conn, {}).values()):
            self._unhold(conn, art, collected)
        return collected

    def clear(self) -> list[Artifact[C]]:
        """The store ends (orderly stop): every live artifact, for the router to unlink."""
        arts = list(self.artifacts.values())
        self.artifacts.clear()
        self.holds.clear()
        self.held_bytes.clear()
        self.allocations.clear()
        self.sight.clear()
        self.frames.clear()
        self.bytes = self.allocated = self.hold_count = 0
        return arts

    # internals -----------------------------------------------------------------------------
    def _check_hold(self, conn: C, count: int, length: int) -> None:
        lim = self.limits
        if len(self.holds.get(conn, ())) + count > lim.max_holds_per_client:
            raise QuotaExceeded(f"maxHoldsPerClient ({lim.max_holds_per_client}) reached")
        if self.held_bytes.get(conn, 0) + length > lim.max_held_bytes_per_client:
            raise QuotaExceeded(f"maxHeldBytesPerClient ({lim.max_held_bytes_per_client}) "
                                "would be exceeded")

    def _hold(self, conn: C, art: Artifact[C]) -> None:
        self.holds.setdefault(conn, {})[art.artifact_id] = art
        self.held_bytes[conn] = self.held_bytes.get(conn, 0) + art.length
        art.holders += 1
        self.hold_count += 1

    def _unhold(self, conn: C, art: Artifact[C], collected: list[Artifact[C]]) -> None:
        held = self.holds[conn]
        del held[art.artifact_id]
        if not held:
            del self.holds[conn]
        left = self.held_bytes[conn] - art.length
        if left:
            self.held_bytes[conn] = left
        else:
            del self.held_bytes[conn]
        art.holders -= 1
        self.hold_count -= 1
        self._maybe_collect(art, collected)

    def _maybe_collect(self, art: Artifact[C], collected: list[Artifact[C]]) -> None:
        if art.holders or art.roots:
            return
        if art.state is ALLOCATED:
            self.allocated -= 1
            self._decrement_allocations(art.owner)
        self._move(art, COLLECTED)
        del self.artifacts[art.artifact_id]
        self.bytes -= art.length
        self.collected_total += 1
        collected.append(art)

    def _decrement_allocations(self, conn: C) -> None:
        left = self.allocations[conn] - 1
        if left:
            self.allocations[conn] = left
        else:
            del self.allocations[conn]

    def _move(self, art: Artifact[C], target: ArtifactState) -> None:
        if target not in EDGES[art.state]:
            raise LedgerError(f"{art.artifact_id}: {art.state.value} -> {target.value} "
                              "is not an edge")
        art.state = target
