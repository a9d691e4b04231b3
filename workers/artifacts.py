"""Media by reference (topics.md §14.2): the producer's `MediaSink` and the consumers'
`open_attached`.

Why: a 256×256 view is 256 KiB; inline it is base64-encoded, hashed and decoded at every hop.
Above a threshold the world writes it once into a sealed artifact of the router's store and the
reply carries a reference; the router checks the digest once, at seal, and nobody hashes again.

Rules:
- `MediaSink.stage` (any thread, the world renders in its model thread) hashes a blob once and
  returns it inline when it is at most `threshold` bytes or the sink is off, else an
  `ArtifactBlob` naming a staged placeholder id.
- A view's frames go through `render` and `serve` instead (rule 3's delayed views): `render`
  stages the frame a boundary rendered, and once sealed the sink keeps it, by `(view id,
  produced step)`, as long as the world retains the frame (`retain_only`); `serve` names the
  kept artifact, so a frame served by boundary s + d, or by every clamped boundary 0..d, is one
  artifact sealed when it was rendered. A frame no longer retained is forgotten, and dropped
  unless the shell's last reply names it (the shell then drops it with its next reply).
- `MediaSink.seal` (on the loop) allocates every staged blob (or takes a spare), writes and
  seals it with the digest it was staged with (the allocations pipelined, then the seals), and
  returns the observation with the real artifact ids and the sealed attachments, to be sent
  with the reply (the worker shell keeps its holds until its next reply with attachments, so a
  replay can attach them again). A refused allocate or seal (QUOTA_EXCEEDED, STORE_FAILURE,
  NOT_AUTHORIZED, any store error) sends that blob inline instead, logged once per reason
  (topics.md §16 decision 21); an allocation already made for it is dropped.
- While a reply's seals are in flight, the sink allocates the next boundary's artifacts of the
  same lengths (spares), so a boundary costs one store round trip. A store operation not
  answered within `STORE_OP_S` counts as a refusal.
- `MediaSink.configure` turns the sink off for good when the router offers no store or when
  what the world may hold of its large views (per view: its d + 1 kept frames, the spares and
  one the shell holds for a replay) exceeds the hello's `maxHeldBytesPerClient`, logging why
  once.
- `open_attached` maps each attachment of a received frame read-only; one that cannot be opened
  maps to `data: None`, so the media check fails `BUFFER_INVALID` where an inline blob would.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Awaitable, Collection, Iterable
from dataclasses import dataclass, replace
from typing import Final, TypeVar

import structlog

from bus.client import BusClient
from bus.client_artifacts import Allocation, Attachment
from bus.errors import BusError
from workers.types.datatypes import (
    ArrayValue,
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
#: a world holds the last reply's artifacts, the ones it seals and the spares for the next,
#: and a view's d earlier frames on top (topics.md §14.2 rule 3)
HELD_BOUNDARIES: Final = 3
#: every store operation of a reply is answered within this (a lost router answers at once)
STORE_OP_S: Final = 10.0

T = TypeVar("T")
#: a rendered frame: (view id, produced step)
FrameKey = tuple[str, int]


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
        #: sealed frames the world may still serve (its hold), by (view id, produced step)
        self._kept: dict[FrameKey, Attachment] = {}
        #: staged placeholders of rendered frames, kept once sealed
        self._keys: dict[str, FrameKey] = {}
        #: the frames this reply serves, attached with it
        self._serving: list[FrameKey] = []

    def configure(self, client: BusClient | None, views: Iterable[tuple[int, int]],
                  replaying: Collection[str] = ()) -> None:
        """Decide once per connection and descriptor whether media may go by reference, from
        the `(byte length, observation delay)` of the declared views (the fallback is logged
        only when some view is large enough to have gone by reference). Spare allocations and
        kept frames of an earlier decision are dropped, except what `replaying` (the shell's
        last reply) names."""
        self.retain_only((), replaying)
        if self.client is not None:
            self.client.drop_nowait([a.artifact_id for spare in self._spares.values()
                                     for a in spare])
        self._spares = {}
        self.client = client
        views = list(views)
        # a view's kept frames (delay + 1), the spares and the last reply's forgotten one
        large = sum(size * (HELD_BOUNDARIES + delay) for size, delay in views
                    if size > self.threshold)
        if client is None or client.store is None:
            self.enabled = False
            if large:
                self._once("no-store", "the router offers no artifact store")
            return
        held = int(client.limits.get("maxHeldBytesPerClient", 0))
        if large > held:
            self.enabled = False
            self._once("held-bytes", f"{HELD_BOUNDARIES} boundaries of views and their "
                       f"delayed frames ({large} bytes) exceed maxHeldBytesPerClient {held}")
            return
        self.enabled = True

    def stage(self, content_type: str, data: bytes, digest: str | None = None) -> MediaValue:
        """A blob of `data`: inline when small or off, else a staged reference. `digest`:
        the SHA-256 of `data` when the caller has it already."""
        if digest is None:
            digest = hashlib.sha256(data).hexdigest()
        if not self.enabled or len(data) <= self.threshold:
            return inline_media(content_type, data, digest)
        self._serial += 1
        key = f"{_STAGED}{self._serial}"
        self._staged[key] = _Staged(content_type, data, digest)
        return ArtifactBlob(content_type, len(data), digest, key)

    def render(self, key: FrameKey, content_type: str, data: bytes) -> None:
        """Stage the frame a boundary rendered, to be sealed with this reply and kept while
        the world retains it (nothing when it would travel inline)."""
        if self.enabled and len(data) > self.threshold and key not in self._kept \
                and key not in self._keys.values():
            blob = self.stage(content_type, data)
            assert isinstance(blob, ArtifactBlob)
            self._keys[blob.artifact_id] = key

    def serve(self, key: FrameKey, content_type: str, data: bytes) -> MediaValue:
        """The blob of a retained frame this reply serves: its kept artifact, the one staged
        by `render`, or (after a restore or a refused seal) one staged and kept now."""
        kept = self._kept.get(key)
        if kept is not None:
            self._serving.append(key)
            return ArtifactBlob(content_type, kept.length, kept.digest, kept.artifact_id)
        self.render(key, content_type, data)
        staged = next((sid for sid, k in self._keys.items() if k == key), None)
        if staged is None:
            return self.stage(content_type, data)
        self._serving.append(key)
        s = self._staged[staged]
        return ArtifactBlob(content_type, len(s.data), s.digest, staged)

    def retain_only(self, keys: Collection[FrameKey], replaying: Collection[str]) -> None:
        """Forget the kept frames not in `keys` (the world no longer retains them); their
        holds end now unless `replaying` names them, the artifacts of the shell's last reply,
        which it drops with its next reply."""
        gone = [key for key in self._kept if key not in keys]
        ids = [self._kept.pop(key).artifact_id for key in gone]
        if self.client is not None:
            self.client.drop_nowait([i for i in ids if i not in replaying])

    def kept(self) -> frozenset[str]:
        """The artifact ids of the frames the sink keeps (the world's holds)."""
        return frozenset(a.artifact_id for a in self._kept.values())

    def discard(self) -> None:
        """Forget staged blobs of a reply that will not be sent."""
        self._staged.clear()
        self._keys.clear()
        self._serving.clear()

    async def seal(self, observation: WorldObservation,
                   ) -> tuple[WorldObservation, tuple[Attachment, ...]]:
        """The observation with every staged blob sealed (or inline after a refusal)."""
        staged, self._staged = self._staged, {}
        keys_of, self._keys = self._keys, {}
        serving, self._serving = self._serving, []
        if not staged:
            named = {v.pixels.artifact_id for v in observation.sensory_views
                     if isinstance(v.pixels, ArtifactBlob)}
            return observation, tuple({a.artifact_id: a for k in serving
                                       if (a := self._kept[k]).artifact_id in named}.values())
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
            alloc.write(staged[key].data)
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
                if key in keys_of:
                    self._kept[keys_of[key]] = result
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
        inputs = None if observation.agent_inputs is None else tuple(
            replace(i, arrays=tuple(replace(a, bytes=resolve(a.bytes)) for a in i.arrays))
            for i in observation.agent_inputs)
        # the reply attaches its fresh blobs and the kept frames it names, never a rendered
        # frame only a later boundary will serve
        named = {b.artifact_id for b in (*(v.pixels for v in views),
                                         *(a.samples for a in audio),
                                         *(a.bytes for i in inputs or () for a in i.arrays))
                 if isinstance(b, ArtifactBlob)}
        attached = {done[k].artifact_id: done[k] for k in keys
                    if k in done and (k not in keys_of or done[k].artifact_id in named)}
        for k in serving:
            att = self._kept.get(k)
            if att is not None and att.artifact_id in named:
                attached.setdefault(att.artifact_id, att)
        return replace(observation, sensory_views=views, audio=audio, agent_inputs=inputs), \
            tuple(attached.values())

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
        any(isinstance(a.samples, ArtifactBlob) for a in observation.audio) or \
        any(isinstance(a.bytes, ArtifactBlob) for i in observation.agent_inputs or ()
            for a in i.arrays)


def referenced_artifacts(views: Iterable[ViewRef], audio: Iterable[AudioRef] = (),
                         arrays: Iterable[ArrayValue] = ()) -> list[str]:
    """The artifact ids the by-reference blobs of `views`, `audio` and `arrays` name, once
    each, in order."""
    ids: dict[str, None] = {}
    for v in views:
        if isinstance(v.pixels, ArtifactBlob):
            ids[v.pixels.artifact_id] = None
    for a in audio:
        if isinstance(a.samples, ArtifactBlob):
            ids[a.samples.artifact_id] = None
    for arr in arrays:
        if isinstance(arr.bytes, ArtifactBlob):
            ids[arr.bytes.artifact_id] = None
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
