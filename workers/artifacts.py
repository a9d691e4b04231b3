"""Media by reference (docs/topics.md §14.2): the producer's `MediaSink` and the consumers'
`open_attached`.

Why: a 256×256 view is 256 KiB; inline it is base64-encoded, hashed and decoded at every hop.
Above a threshold the world writes it once into a sealed artifact of the router's store and the
reply carries a reference; the router checks the digest once, at seal, and nobody hashes again.

Rules:
- `MediaSink.stage` (any thread, the world renders in its model thread) hashes a blob once and
  returns it inline when it is at most `threshold` bytes or the sink is off, else an
  `ArtifactBlob` naming a staged placeholder id.
- `MediaSink.seal` (on the loop) allocates every staged blob (or takes a spare), writes and
  seals it with the digest it was staged with (the allocations pipelined, then the seals), and
  returns the observation with the real artifact ids and the sealed attachments, to be sent
  with the reply (the worker shell keeps its holds until its next reply with attachments, so a
  replay can attach them again). A refused allocate or seal (QUOTA_EXCEEDED, STORE_FAILURE,
  NOT_AUTHORIZED, any store error) sends that blob inline instead, logged once per reason
  (docs/topics.md §16 decision 21); an allocation already made for it is dropped.
- While a reply's seals are in flight, the sink allocates the next boundary's artifacts of the
  same lengths (spares), so a boundary costs one store round trip. A store operation not
  answered within `STORE_OP_S` counts as a refusal.
- `MediaSink.configure` turns the sink off for good when the router offers no store or when
  three boundaries of large views (the last reply's, the sealing ones, the spares) exceed the
  hello's `maxHeldBytesPerClient`, logging why once.
- `open_attached` maps each attachment of a received frame read-only; one that cannot be opened
  maps to `data: None`, so the media check fails `BUFFER_INVALID` where an inline blob would.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, replace
from typing import Final, TypeVar

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
#: a world holds the last reply's artifacts, the ones it seals and the spares for the next
HELD_BOUNDARIES: Final = 3
#: every store operation of a reply is answered within this (a lost router answers at once)
STORE_OP_S: Final = 10.0

T = TypeVar("T")


async def _attempt(op: Awaitable[T]) -> T | BusError | TimeoutError:
    """`op`'s value, or the store error or timeout that refused it."""
    try:
        async with asyncio.timeout(STORE_OP_S):
            return await op
    except (BusError, TimeoutError) as exc:
        return exc


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
        #: allocations made for the next boundary while this one seals, by length: a
        #: boundary then costs one store round trip (the seals), not two
        self._spares: dict[int, list[Allocation]] = {}

    def configure(self, client: BusClient | None, view_sizes: Iterable[int]) -> None:
        """Decide once per connection and descriptor whether media may go by reference, from
        the sizes of the declared views (the fallback is logged only when some view is large
        enough to have gone by reference). Spare allocations of an earlier decision are
        dropped."""
        if self.client is not None:
            self.client.drop_nowait([a.artifact_id for spare in self._spares.values()
                                     for a in spare])
        self._spares = {}
        self.client = client
        large = sum(size for size in view_sizes if size > self.threshold)
        if client is None or client.store is None:
            self.enabled = False
            if large:
                self._once("no-store", "the router offers no artifact store")
            return
        held = int(client.limits.get("maxHeldBytesPerClient", 0))
        if HELD_BOUNDARIES * large > held:
            self.enabled = False
            self._once("held-bytes", f"{HELD_BOUNDARIES} boundaries of views "
                       f"({HELD_BOUNDARIES * large} bytes) exceed maxHeldBytesPerClient {held}")
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
        # 1. an allocation per blob: a spare one of its length, else one allocated now
        writes: dict[str, Allocation] = {}
        async with asyncio.TaskGroup() as tg:
            asked: dict[str, asyncio.Task[Allocation | BusError | TimeoutError]] = {}
            for key in keys:
                spare = self._spares.get(len(staged[key].data))
                if spare:
                    writes[key] = spare.pop()
                else:
                    asked[key] = tg.create_task(_attempt(client.allocate(len(staged[key].data))))
        for key, task in asked.items():
            alloc = task.result()
            if isinstance(alloc, Allocation):
                writes[key] = alloc
            else:
                self._refused("allocate", alloc)
        for key, alloc in writes.items():
            alloc.view()[:] = staged[key].data
        # 2. the seals, and the next boundary's allocations in the same round trip
        async with asyncio.TaskGroup() as tg:
            seals = {k: tg.create_task(_attempt(writes[k].seal(staged[k].digest)))
                     for k in writes}
            refills = [tg.create_task(_attempt(client.allocate(length)))
                       for length in self._refill(staged.values())]
        done: dict[str, Attachment] = {}
        failed: list[str] = []
        for key, sealing in seals.items():
            result = sealing.result()
            if isinstance(result, Attachment):
                done[key] = result
            else:
                self._refused("seal", result)
                failed.append(writes[key].artifact_id)
        for refill in refills:
            made = refill.result()
            if isinstance(made, Allocation):
                self._spares.setdefault(made.length, []).append(made)
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

    def _refill(self, staged: Iterable[_Staged]) -> list[int]:
        """The lengths to allocate so the spares match this reply's blobs, one per blob;
        spares of lengths this reply did not use (audio chunk sizes vary) are dropped."""
        need = collections.Counter(len(s.data) for s in staged)
        stale = [a.artifact_id for length, spare in self._spares.items() if length not in need
                 for a in spare]
        if stale and self.client is not None:
            self.client.drop_nowait(stale)
        self._spares = {length: spare for length, spare in self._spares.items()
                        if length in need}
        return [length for length, count in need.items()
                for _ in range(count - len(self._spares.get(length, ())))]

    def _refused(self, op: str, exc: BusError | TimeoutError) -> None:
        if isinstance(exc, TimeoutError):
            self._once(f"{op}:timeout", f"{op} had no answer within {STORE_OP_S:g} s")
        else:
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
