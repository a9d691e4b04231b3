"""The artifact store's side of the router (topics.md §5, §6): its ops and its files.

`bus/artifacts.py` keeps the books (holds, frame roots, sight, quotas) and says what each step
collected; `bus/store.py` does the file calls; this module joins them: it answers
`bus.allocate`, `bus.seal`, `bus.retain` and `bus.drop`, checks attachments for the call and
topic ops, and unlinks every collected artifact's file in the same step (topics.md §5.2 rule 4).

A seal above SEAL_INLINE_BYTES hashes on the store's thread while only its own connection
stops reading (topics.md §5.5 rule 4): the op answers `DEFERRED`, and the hash's callback responds
and hands the connection back to the router's reader.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable, Hashable
from typing import Any, Final

import structlog

from bus.artifacts import Artifact, ArtifactLedger, StoreLimits
from bus.connection import Conn
from bus.errors import ArtifactGone, ArtifactMismatch, BusError, NotAuthorized, StoreFailure
from bus.limits import Limits
from bus.outbound import Outbound
from bus.store import SEAL_INLINE_BYTES, SealFile, Store, StoreSettings, store_offer

log = structlog.get_logger("bus.router")

#: an op whose response comes later (a seal hashing off the loop, topics.md §5.5 rule 4)
DEFERRED: Final = object()


class ArtifactOps:
    """The store of one router start and the ops on it.

    `resume` is the router's reader: a connection whose off-loop hash finished reads on."""

    def __init__(self, lim: Limits, out: Outbound, resume: Callable[[Conn], None],
                 seed: int) -> None:
        self.limits = lim
        self.ledger: ArtifactLedger[Conn] = ArtifactLedger(
            StoreLimits(lim.maxArtifactBytes, lim.maxArtifacts, lim.maxStoreBytes,
                        lim.maxHeldBytesPerClient, lim.maxHoldsPerClient,
                        lim.maxAllocationsPerClient),
            seed)
        #: the store directory of this start, or None when disabled
        self.store: Store | None = None
        self._wire: dict[str, str] | None = None
        self._out = out
        self._resume = resume
        self._euid = os.geteuid()

    # start and stop (topics.md §5.1) --------------------------------------------------------------
    def open(self, settings: StoreSettings) -> None:
        """topics.md §5.1: the store directory of this start, or none when disabled. Raises
        StoreStartError."""
        if not settings.enabled:
            return
        store = Store.open(settings.root)
        # a lease break would signal SIGIO, whose default action ends the process
        with contextlib.suppress(ValueError):  # not the main thread: its owner decides
            signal.signal(signal.SIGIO, signal.SIG_IGN)
        self.store = store
        self._wire = {"storeId": store.store_id, "path": store.path}
        log.info("router.store", store_id=store.store_id, path=store.path)

    def remove(self) -> None:
        """topics.md §5.1 rule 7: every artifact file and the store directory go."""
        store, self.store = self.store, None
        if store is None:
            return
        self.ledger.clear()
        store.remove()

    def offer(self, conn: Conn) -> dict[str, str] | None:
        """The hello's `store` member for this peer (topics.md §5.1)."""
        return store_offer(conn.uid, self._euid, self._wire)

    def stats(self) -> dict[str, Any] | None:
        """`bus.stats`'s `store` member: None when disabled."""
        store = self.store
        if store is None:
            return None
        art = self.ledger
        return {"storeId": store.store_id, "failed": store.failed,
                "artifacts": len(art.artifacts), "allocated": art.allocated, "bytes": art.bytes,
                "holds": art.hold_count, "hashing": store.hashing}

    # what the call and topic ops ask -------------------------------------------------------
    def attachable(self, conn: Conn, ids: list[str]) -> tuple[Artifact[Conn], ...]:
        """The artifacts `ids` as `conn` may attach them (checks A1–A3 of design/wire.md §6.2):
        a connection the store is not offered to gets none."""
        store = self.store
        if store is None or store.failed or conn.uid != self._euid:
            raise ArtifactGone(f"{ids[0]}: no store is offered to this connection")
        return self.ledger.attachable(conn, ids)

    def collect(self, arts: list[Artifact[Conn]]) -> None:
        """topics.md §5.2 rule 4: collected artifacts' files are unlinked in the same step."""
        store = self.store
        if store is None:
            return
        for art in arts:
            store.unlink(art.artifact_id)

    def unroot(self, key: Hashable) -> None:
        """A frame root ends (topics.md §5.2 rule 2): what it alone kept is collected."""
        if key in self.ledger.frames:
            self.collect(self.ledger.unroot(key))

    def unsee(self, conn: Conn, key: Hashable) -> None:
        """A delivery's credit returned: its sight and its root end (topics.md §5.2 rule 2)."""
        if self.ledger.frames:
            self.ledger.unsee(conn, self.ledger.rooted(key))
            self.unroot(key)

    def forget_connection(self, conn: Conn) -> None:
        """design/wire.md §10.2 steps 9 and 10: its holds end, its Allocated artifacts go."""
        ledger = self.ledger
        if conn in ledger.holds or conn in ledger.sight:
            self.collect(ledger.forget_connection(conn))

    # ops (topics.md §5.3–§5.7) --------------------------------------------------------------------
    def _usable_store(self, conn: Conn) -> Store:
        """topics.md §5.3 checks 2 and 3 (and topics.md §5.7's): the store, for a peer of the
        router's uid."""
        if conn.uid != self._euid:
            raise NotAuthorized(f"the store is offered to uid {self._euid} only")
        store = self.store
        if store is None or store.failed:
            raise StoreFailure("the store is disabled" if store is None else
                               "the store has failed")
        return store

    def op_allocate(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        store = self._usable_store(conn)
        length: int = p["length"]
        ledger = self.ledger
        ledger.check_allocate(conn, length)
        artifact_id = ledger.next_id()
        file = store.create(artifact_id, length)
        ledger.allocate(conn, length, file)
        return {"artifactId": artifact_id, "length": length}

    def op_seal(self, conn: Conn, p: dict[str, Any], rid: int) -> Any:
        """topics.md §5.5: the file checks in the handler; the hash inline up to SEAL_INLINE_BYTES,
        else on the hashing thread with this connection's reading paused."""
        store = self.store
        if store is None or store.failed:
            raise StoreFailure("the store is disabled" if store is None else
                               "the store has failed")
        art = self.ledger.check_seal(conn, p["artifactId"])
        try:
            seal = store.open_for_seal(art.artifact_id, art.length, art.file)
        except BusError:
            self._out.counters["sealsRefused"] += 1
            raise
        except OSError as exc:
            store.failed = True
            raise StoreFailure(f"seal of {art.artifact_id} failed: {exc.strerror}") from exc
        if art.length <= SEAL_INLINE_BYTES:
            try:
                actual = store.hash(seal)
            except OSError as exc:
                self._seal_failed(store, seal)
                raise StoreFailure(f"hashing {art.artifact_id} failed: {exc.strerror}") from exc
            return self._apply_seal(conn, art, seal, actual, p["digest"])
        loop = self._out.loop
        assert loop is not None
        conn.sealing = True
        store.hashing += 1
        fut = loop.run_in_executor(store.executor(), store.hash, seal)
        fut.add_done_callback(
            lambda f: self._hashed(conn, rid, art, seal, p["digest"], f))
        return DEFERRED

    def _hashed(self, conn: Conn, rid: int, art: Artifact[Conn], seal: SealFile,
                digest: str, fut: asyncio.Future[str]) -> None:
        """An off-loop hash finished: apply it on the loop, respond, read on."""
        store = self.store
        if store is not None:
            store.hashing -= 1
        conn.sealing = False
        out = self._out
        loop = out.loop
        assert loop is not None
        if fut.cancelled() or fut.exception() is not None or store is None or conn.torn_down:
            if store is None or conn.torn_down:  # the allocation went with its connection
                with contextlib.suppress(OSError):
                    os.close(seal.fd)
                return
            self._seal_failed(store, seal)
            out.respond_error(conn, rid, "STORE_FAILURE",
                              f"hashing {art.artifact_id} failed", "not-dispatched")
            loop.call_soon(self._resume, conn)
            return
        try:
            result = self._apply_seal(conn, art, seal, fut.result(), digest)
        except BusError as exc:
            out.respond_error(conn, rid, exc.name, exc.message, exc.dispatch)
        else:
            out.respond(conn, rid, result)
        loop.call_soon(self._resume, conn)

    def _seal_failed(self, store: Store, seal: SealFile) -> None:
        """A store syscall failed unexpectedly: the store is failed (topics.md §5.1 rule 8)."""
        store.failed = True
        with contextlib.suppress(OSError):
            store.finish_seal(seal, False)

    def _apply_seal(self, conn: Conn, art: Artifact[Conn], seal: SealFile, actual: str,
                    digest: str) -> dict[str, Any]:
        """Check 8 of topics.md §5.5 (the declared digest against the bytes hashed), then the
        accept; a store syscall failing here marks the store failed, since the file's state is
        then unknown."""
        store = self.store
        assert store is not None
        accepted = actual == digest
        try:
            store.finish_seal(seal, accepted)
        except OSError as exc:
            store.failed = True
            raise StoreFailure(f"sealing {art.artifact_id} failed: {exc.strerror}") from exc
        if not accepted:
            self._out.counters["sealsRefused"] += 1
            raise ArtifactMismatch(f"{art.artifact_id}: the digest differs from the bytes")
        self.ledger.seal(art, digest)
        return art.wire()

    def op_retain(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        self._usable_store(conn)
        arts = self.ledger.retain(conn, p["artifactIds"])
        return {"artifacts": [a.wire() for a in arts]}

    def op_drop(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        dropped, collected = self.ledger.drop(conn, p["artifactIds"])
        self.collect(collected)
        return {"dropped": dropped}
