"""The client's side of the artifact store (topics.md §5, §12): the store directory the
hello names, allocations written and sealed, attachments as deliveries carry them, and this
client's holds on them (`retain`, `drop`)."""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from bus.client_connection import Connection, ignore_outcome
from bus.errors import RouterLost, StoreFailure
from bus.store import map_for_write, open_store_dir, read_sealed, write_whole

log = structlog.get_logger("bus.client")

# `bus.drop` takes at most this many ids per frame (topics.md §5.7)
MAX_DROP_IDS: Final = 16


@dataclass(frozen=True, slots=True)
class Attachment:
    """A sealed artifact as a delivery carries it (topics.md §6.1). As an async context
    manager it drops this client's hold on exit (the SDK's `call()` retains result ones)."""

    artifact_id: str
    length: int
    digest: str
    artifacts: Artifacts | None = field(default=None, compare=False, repr=False)

    async def __aenter__(self) -> Attachment:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.artifacts is not None and not self.artifacts.closed:
            await self.artifacts.drop([self.artifact_id])


#: an attachment as the SDK's calls take it: an artifact id or an `Attachment`
AttachmentRef = str | Attachment


def artifact_ids(attachments: Iterable[AttachmentRef]) -> list[str]:
    """The wire form of attachments given as ids or `Attachment`s (topics.md §12)."""
    return [a if isinstance(a, str) else a.artifact_id for a in attachments]


class Allocation:
    """An Allocated artifact of this client: write its bytes (`write()` at once, or through
    `view()`), then `seal()`."""

    def __init__(self, artifacts: Artifacts, artifact_id: str, length: int) -> None:
        self.artifacts = artifacts
        self.artifact_id = artifact_id
        self.length = length
        self._map: mmap.mmap | None = None

    def view(self) -> memoryview:
        """A writable view of the file's bytes (mapped on first use)."""
        if self._map is None:
            self._map = map_for_write(self.artifacts.store_fd(), self.artifact_id, self.length)
        return memoryview(self._map)

    def write(self, data: bytes | memoryview) -> None:
        """The whole contents at once, without a mapping (topics.md §5.4; cheaper than
        `view()` for a frame written in one piece). Not while a `view()` mapping is open."""
        if self._map is not None:
            raise BufferError(f"{self.artifact_id} is mapped: write through view()")
        write_whole(self.artifacts.store_fd(), self.artifact_id, self.length, data)

    async def seal(self, digest: str | None = None) -> Attachment:
        """Hash (unless `digest` is given), unmap, then `bus.seal`: the sealed artifact, held
        by this client. A view still exported keeps the mapping, so the seal is refused
        locally (BufferError), nothing sent."""
        if self._map is not None:
            if digest is None:
                digest = hashlib.sha256(self._map).hexdigest()
            self._map.close()  # BufferError while a view is exported
            self._map = None
        elif digest is None:
            with map_for_write(self.artifacts.store_fd(), self.artifact_id, self.length) as m:
                digest = hashlib.sha256(m).hexdigest()
        return await self.artifacts.seal(self.artifact_id, digest)


class Artifacts:
    """One connection's store directory and holds."""

    def __init__(self, connection: Connection) -> None:
        self._conn = connection
        self._store: dict[str, str] | None = None
        self._store_dir = -1
        connection.on_lost(self._lost)

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def open_store(self, store: dict[str, str] | None) -> None:
        """Open the directory the hello named (`store`, None when the router offers none)."""
        self._store = store
        if store is not None:
            try:
                self._store_dir = open_store_dir(store["path"])
            except StoreFailure as exc:
                # calls and topics work without it; store calls will say why they cannot
                log.warning("bus.client.store_unavailable", client_id=self._conn.client_id,
                            error=exc.message)

    def store_fd(self) -> int:
        """The store directory's descriptor (StoreFailure when there is none)."""
        self._conn.check_open()
        if self._store_dir < 0:
            raise StoreFailure("the router offers no store to this client" if self._store is None
                               else f"the store directory {self._store['path']} could not be "
                               "opened")
        return self._store_dir

    def attachment(self, wire: dict[str, Any]) -> Attachment:
        return Attachment(wire["artifactId"], wire["length"], wire["digest"], self)

    def attachments(self, params: dict[str, Any]) -> tuple[Attachment, ...]:
        """The attachments a delivery's params carry."""
        wire = params.get("attachments")
        return tuple(self.attachment(a) for a in wire) if wire else ()

    async def allocate(self, length: int) -> Allocation:
        self._conn.need_minor(2, "bus.allocate")
        self._conn.check_open()
        result = await self._conn.command("bus.allocate", {"length": length})
        return Allocation(self, result["artifactId"], result["length"])

    async def seal(self, artifact_id: str, digest: str) -> Attachment:
        result = await self._conn.command("bus.seal", {"artifactId": artifact_id,
                                                       "digest": digest})
        return self.attachment(result)

    def open_artifact(self, attachment: Attachment) -> memoryview:
        return read_sealed(self.store_fd(), attachment.artifact_id, attachment.length)

    async def retain(self, artifact_ids: list[str]) -> list[Attachment]:
        self._conn.need_minor(2, "bus.retain")
        result = await self._conn.command("bus.retain", {"artifactIds": list(artifact_ids)})
        return [self.attachment(a) for a in result["artifacts"]]

    async def drop(self, artifact_ids: list[str]) -> int:
        self._conn.need_minor(2, "bus.drop")
        result = await self._conn.command("bus.drop", {"artifactIds": list(artifact_ids)})
        return int(result["dropped"])

    def drop_nowait(self, artifact_ids: list[str]) -> None:
        if not artifact_ids or self._conn.closed:
            return
        self._conn.need_minor(2, "bus.drop")
        for start in range(0, len(artifact_ids), MAX_DROP_IDS):
            fut = self._conn.send_nowait(
                "bus.drop", {"artifactIds": artifact_ids[start:start + MAX_DROP_IDS]})
            fut.add_done_callback(ignore_outcome)

    def _lost(self, _failure: RouterLost) -> None:
        if self._store_dir >= 0:  # open mappings stay readable
            os.close(self._store_dir)
            self._store_dir = -1
