"""The coordinator's audio timelines: every declared stream's position across transitions and
restores.

Why the session owns them: a restore must never restart a stream at 0 silently (design/state.md §7.2
step 8 names `AudioTimelines.restored`); the environment marks the first chunk after an
activation (`workers/environment.py`), and these objects are the checking side. They read only
the design/session.md §1.8 `AudioRef` and `EnvironmentDescriptor`, so they hold for any world that
declares audio, not only the synthetic arena's. Rules:
- `AudioTimeline` (one declared stream): the stream position and whether the epoch has accepted
  a chunk yet. A chunk below the position overlaps; at the position it must not set
  `discontinuity`, except as the epoch's first chunk (optional when fresh, required after a
  restore); above it needs `discontinuity` and is never an epoch's first chunk. So a fresh
  timeline at 0 rejects a chunk resumed elsewhere: the position, not the flag, tells the epochs
  apart. `accept` checks, then moves the position past the chunk.
- `AudioTimelines`: one timeline per declared stream. `restored(descriptor, audioPositions)`
  needs exactly one position per declared stream (`INCOMPATIBLE_STATE` otherwise);
  `check(chunks)` needs exactly one chunk per declared stream and nothing else; `advance`
  accepts them. Sample decoding (`decode_audio`) is the caller's: these objects see positions
  and flags only.

Errors: a chunk refusal is `BUFFER_INVALID` with the caller's mutation (`unknown` in the
coordinator's Phase C); a missing or bad restored position is `INCOMPATIBLE_STATE`/`none`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from workers.types.datatypes import AudioRef, EnvironmentDescriptor
from workers.types.domain import U64_MAX, DomainError, ErrorCode, Mutation, parse_u64

__all__ = ["AudioTimeline", "AudioTimelines"]


def _incompatible(message: str) -> DomainError:
    return DomainError.before(ErrorCode.INCOMPATIBLE_STATE, message)


@dataclass(slots=True)
class AudioTimeline:
    """One declared stream as the coordinator follows it within an epoch."""

    stream_id: str
    position: int = 0
    after_restore: bool = False
    started: bool = False

    @classmethod
    def fresh(cls, stream_id: str) -> AudioTimeline:
        """An epoch started by `Environment.Initialize`: position 0."""
        return cls(stream_id)

    @classmethod
    def restored(cls, stream_id: str, position: int) -> AudioTimeline:
        """An epoch started by a restore at the preserved `position`."""
        if isinstance(position, bool) or not isinstance(position, int) \
                or not 0 <= position <= U64_MAX:
            raise _incompatible(f"audio stream {stream_id} has no valid restored position")
        return cls(stream_id, position, after_restore=True)

    def check(self, chunk: AudioRef, mutation: Mutation | str = Mutation.UNKNOWN) -> None:
        """Refuse a chunk that does not continue, or properly resume, this stream."""
        sid, first, at = self.stream_id, chunk.first_sample, self.position

        def refuse(message: str) -> DomainError:
            return DomainError(ErrorCode.BUFFER_INVALID, message, mutation)

        if chunk.stream_id != sid:
            raise refuse(f"audio stream {chunk.stream_id} is not the stream {sid}")
        if first + chunk.sample_frames > U64_MAX:
            raise refuse(f"audio stream {sid} would pass 2^64-1 samples")
        if first < at:
            raise refuse(f"audio stream {sid} starts at {first}; the stream is at {at}")
        if first == at:
            if chunk.discontinuity and self.started:
                raise refuse(f"audio stream {sid} marks a discontinuity at {at}, where it "
                             "continues")
            if not chunk.discontinuity and self.after_restore and not self.started:
                raise refuse(f"audio stream {sid} resumes at {at} after a restore without "
                             "marking the discontinuity")
            return
        if not self.started or not chunk.discontinuity:
            raise refuse(f"audio stream {sid} starts at {first}; the stream is at {at}")

    def accept(self, chunk: AudioRef, mutation: Mutation | str = Mutation.UNKNOWN) -> None:
        self.check(chunk, mutation)
        self.position = chunk.first_sample + chunk.sample_frames
        self.started = True


class AudioTimelines:
    """Every declared stream's timeline, in descriptor order."""

    def __init__(self, timelines: Sequence[AudioTimeline]) -> None:
        self.timelines: dict[str, AudioTimeline] = {t.stream_id: t for t in timelines}

    @classmethod
    def fresh(cls, descriptor: EnvironmentDescriptor) -> AudioTimelines:
        return cls([AudioTimeline.fresh(a.stream_id) for a in descriptor.audio])

    @classmethod
    def restored(cls, descriptor: EnvironmentDescriptor,
                 positions: Sequence[Mapping[str, Any]]) -> AudioTimelines:
        """From a checkpoint's `audioPositions: [{streamId, position}]` (position a U64
        string): exactly one per declared stream, never a silent restart at 0."""
        declared = [a.stream_id for a in descriptor.audio]
        found: dict[str, int] = {}
        for entry in positions:
            if not isinstance(entry, Mapping) or set(entry) != {"streamId", "position"}:
                raise _incompatible("an audio position must be {streamId, position}")
            sid = entry["streamId"]
            if sid not in declared:
                raise _incompatible(f"audio position for undeclared stream {sid}")
            if sid in found:
                raise _incompatible(f"audio stream {sid} has two restored positions")
            try:
                found[sid] = parse_u64(entry["position"], f"audio stream {sid} position")
            except DomainError as exc:
                raise _incompatible(exc.message) from None
        for sid in declared:
            if sid not in found:
                raise _incompatible(f"audio stream {sid} has no restored position; a restore "
                                    "never restarts a stream at 0")
        return cls([AudioTimeline.restored(sid, found[sid]) for sid in declared])

    def positions(self) -> dict[str, int]:
        return {sid: t.position for sid, t in self.timelines.items()}

    def to_json(self) -> list[dict[str, str]]:
        """`audioPositions` as a checkpoint records them."""
        return [{"streamId": sid, "position": str(t.position)}
                for sid, t in self.timelines.items()]

    def check(self, chunks: Sequence[AudioRef],
              mutation: Mutation | str = Mutation.UNKNOWN) -> None:
        """Exactly one acceptable chunk per declared stream, and no other chunk."""
        by_id: dict[str, AudioRef] = {}
        for chunk in chunks:
            if chunk.stream_id not in self.timelines or chunk.stream_id in by_id:
                raise DomainError(ErrorCode.BUFFER_INVALID,
                                  f"audio stream {chunk.stream_id} is undeclared or repeated",
                                  mutation)
            by_id[chunk.stream_id] = chunk
        for sid, timeline in self.timelines.items():
            found = by_id.get(sid)
            if found is None:
                raise DomainError(ErrorCode.BUFFER_INVALID,
                                  f"audio stream {sid} produced no chunk for this transition",
                                  mutation)
            timeline.check(found, mutation)

    def advance(self, chunks: Sequence[AudioRef],
                mutation: Mutation | str = Mutation.UNKNOWN) -> None:
        """`check`, then move every stream past its chunk."""
        self.check(chunks, mutation)
        for chunk in chunks:
            self.timelines[chunk.stream_id].accept(chunk, mutation)
