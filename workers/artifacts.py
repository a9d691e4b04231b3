"""Media by reference (docs/topics.md §14.2): the producer's `MediaSink` and the consumers'
`open_attached`.

Why: a 256×256 view is 256 KiB; inline it is base64-encoded, hashed and decoded at every hop.
Above a threshold the world writes it once into a sealed artifact of the router's store and the
reply carries a reference; the router checks the digest once, at seal, and nobody hashes again.

Rules:
- `MediaSink.stage` (any thread, the world renders in its model thread) hashes a blob once and
  returns it inline when it is at most `threshold` bytes or the sink is off, else an
  `ArtifactBlob` naming a staged placeholder id.
- `MediaSink.seal` (on the loop) allocates every staged blob, writes and seals it with the
  digest it was staged with (the allocations pipelined, then the seals: two round trips however
  many blobs), and returns the observation with the real artifact ids and the sealed
  attachments, to be sent with the reply (the worker shell keeps its holds until its next
  reply with attachments, so a replay can attach them again). A refused allocate or seal
  (QUOTA_EXCEEDED, STORE_FAILURE, NOT_AUTHORIZED, any store error) sends that blob inline
  instead, logged once per reason (docs/topics.md §16 decision 21); an allocation already made
  for it is dropped.
- `MediaSink.configure` turns the sink off for good when the router offers no store or when
  twice a boundary's media exceed the hello's `maxHeldBytesPerClient` (the coordinator keeps
  two boundaries), logging why once.
- `open_attached` maps each attachment of a received frame read-only; one that cannot be opened
  maps to `data: None`, so the media check fails `BUFFER_INVALID` where an inline blob would.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Final

import structlog

from bus.client import Allocation, Attachment, BusClient
from bus.errors import BusError
from workers.datatypes import (
    ArtifactBlob,
    Attached,
    AudioRef,
    MediaValue,
    ViewRef,
    WorldObservation,
    inline_media,
)

__all__ = [
    "MediaSink",
    "any_by_reference",
    "open_attached",
    "referenced_artifacts",
]

log = structlog.get_logger("workers.artifacts")

_STAGED: Final = "staged-"


@dataclass(frozen=True, slots=True)
class _Staged:
    content_type: str
    data: bytes
    digest: str


class MediaSink:
    """One producer's staging area; not shared between replies (`seal` empties it)."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.client: BusClient | None = None
        self.enabled = False
        self._staged: dict[str, _Staged] = {}
        self._serial = 0
        self._logged: set[str] = set()

    def configure(self, client: BusClient | None, media_bytes_per_boundary: int) -> None:
        """Decide once per connection and descriptor whether media may go by reference."""
        self.client = client
        if client is None or client.store is None:
            self.enabled = False
            self._once("no-store", "the router offers no artifact store")
            return
        held = int(client.limits.get("maxHeldBytesPerClient", 0))
        if 2 * media_bytes_per_boundary > held:
            self.enabled = False
            self._once("held-bytes", f"twice a boundary's media ({2 * media_bytes_per_boundary} "
                       f"bytes) exceed maxHeldBytesPerClient {held}")
            return
        self.enabled = True

    def stage(self, content_type: str, data: bytes) -> MediaValue:
        """A blob of `data`: inline when small or off, else a staged reference."""
        digest = hashlib.sha256(data).hexdigest()
        if not self.enabled or len(data) <= self.threshold:
            return inline_media(content_type, data, digest)
        self._serial += 1
        key = f"{_STAGED}{self._serial}"
        self._staged[key] = _Staged(content_type, data, digest)
        return ArtifactBlob(content_type, len(data), digest, key)

    def discard(self) -> None:
        """Forget staged blobs of a reply that will not be sent."""
        self._staged.clear()

    async def seal(self, observation: WorldObservation,
                   ) -> tuple[WorldObservation, tuple[Attachment, ...]]:
        """The observation with every staged blob sealed (or inline after a refusal)."""
        staged, self._staged = self._staged, {}
        if not staged:
            return observation, ()
        client = self.client
        assert client is not None
        keys = list(staged)
        allocated = await asyncio.gather(*(client.allocate(len(staged[k].data)) for k in keys),
                                         return_exceptions=True)
        writes: dict[str, Allocation] = {}
        for key, alloc in zip(keys, allocated, strict=True):
            if isinstance(alloc, Allocation):
                alloc.view()[:] = staged[key].data
                writes[key] = alloc
            elif isinstance(alloc, BusError):
                self._refused("allocate", alloc)
            else:
                raise alloc
        sealed = await asyncio.gather(*(writes[k].seal(staged[k].digest) for k in writes),
                                      return_exceptions=True)
        done: dict[str, Attachment] = {}
        failed: list[str] = []
        for key, result in zip(writes, sealed, strict=True):
            if isinstance(result, Attachment):
                done[key] = result
            elif isinstance(result, BusError):
                self._refused("seal", result)
                failed.append(writes[key].artifact_id)
            else:
                raise result
        client.drop_nowait(failed)

        def resolve(blob: MediaValue) -> MediaValue:
            if not isinstance(blob, ArtifactBlob) or blob.artifact_id not in staged:
                return blob
            att = done.get(blob.artifact_id)
            if att is None:
                s = staged[blob.artifact_id]
                return inline_media(s.content_type, s.data, s.digest)
            return replace(blob, artifact_id=att.artifact_id)

        views = tuple(replace(v, pixels=resolve(v.pixels)) for v in observation.sensory_views)
        audio = tuple(replace(a, samples=resolve(a.samples)) for a in observation.audio)
        return (replace(observation, sensory_views=views, audio=audio),
                tuple(done[k] for k in keys if k in done))

    def _refused(self, op: str, exc: BusError) -> None:
        self._once(f"{op}:{exc.name}", f"{op} refused: {exc.name}: {exc.message}")

    def _once(self, key: str, reason: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("media.inline_fallback", reason=reason)


def any_by_reference(observation: WorldObservation) -> bool:
    """Whether some view or chunk of the observation travels by reference (the others are
    then at most the threshold each)."""
    return any(isinstance(v.pixels, ArtifactBlob) for v in observation.sensory_views) or \
        any(isinstance(a.samples, ArtifactBlob) for a in observation.audio)


def referenced_artifacts(views: Iterable[ViewRef], audio: Iterable[AudioRef] = ()) -> list[str]:
    """The artifact ids the by-reference blobs of `views` and `audio` name, once each, in
    order."""
    ids: dict[str, None] = {}
    for v in views:
        if isinstance(v.pixels, ArtifactBlob):
            ids[v.pixels.artifact_id] = None
    for a in audio:
        if isinstance(a.samples, ArtifactBlob):
            ids[a.samples.artifact_id] = None
    return list(ids)


def open_attached(client: BusClient, attachments: Iterable[Attachment]) -> dict[str, Attached]:
    """Each attachment mapped read-only by id; one that cannot be opened has `data: None`."""
    out: dict[str, Attached] = {}
    for att in attachments:
        try:
            data: memoryview | None = client.open_artifact(att)
        except BusError:
            data = None
        out[att.artifact_id] = Attached(att.length, att.digest, data)
    return out
