"""Audio for the session: the counter arena's `arena` stream, an exact binary32 triangle
(session.md §4.6), and the coordinator's audio timelines across a restore (state.md §7.5).

Why the triangle: the pitch follows the counter and the phase persists across chunks, so a
dropped, repeated or overlapping chunk changes bytes; every operation is rounded to IEEE binary32
(round to nearest even), so the bytes are the same on every platform. A sample depends only
on the phase and the channel, so each channel count has one column of `SAMPLE_RATE` binary32
samples per channel, computed in bulk at its first chunk: every rounding `frame_bytes` does
one value at a time (`struct`, a C cast to float) is done for the whole column at once by
`array("f")` (the same C cast), so the samples are the same. The phase moves by a fixed
increment per frame (one of 8, set by the counter), so for each increment the frames are laid
out once in stepping order (`_Ring`): a chunk is then one or two byte slices instead of a
Python operation per frame (the arena renders a chunk every step, on the step's critical
path).

Why the timelines live here: a restore must never restart a stream at 0 silently (state.md
§7.2 step 8 names `AudioTimelines.restored`); the environment marks the first chunk after an
activation (`workers/environment.py`), and these objects are the checking side. Rules:
- `AudioTimeline` (coordinator side, one declared stream): the stream position and whether the
  epoch has accepted a chunk yet. A chunk below the position overlaps; at the position it must
  not set `discontinuity`, except as the epoch's first chunk (optional when fresh, required
  after a restore); above it needs `discontinuity` and is never an epoch's first chunk. So a
  fresh timeline at 0 rejects a chunk resumed elsewhere: the position, not the flag, tells the
  epochs apart. `accept` checks, then moves the position past the chunk.
- `AudioTimelines`: one timeline per declared stream. `restored(descriptor, audioPositions)`
  needs exactly one position per declared stream (`INCOMPATIBLE_STATE` otherwise);
  `check(chunks)` needs exactly one chunk per declared stream and nothing else; `advance`
  accepts them. Sample decoding (`decode_audio`) is the caller's: these objects see positions
  and flags only.

Errors: a chunk refusal is `BUFFER_INVALID` with the caller's mutation (`unknown` in the
coordinator's Phase C); a missing or bad restored position is `INCOMPATIBLE_STATE`/`none`.
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from workers.datatypes import AudioRef, EnvironmentDescriptor
from workers.domain import U64_MAX, DomainError, ErrorCode, Mutation, parse_u64

SAMPLE_RATE: Final = 48000
CHANNELS: Final = 2
BASE_HZ: Final = 220
STEP_HZ: Final = 55
AMPLITUDE: Final = 0.25
#: the phase's step per frame: one pitch per value of the counter modulo 8
INCREMENTS: Final = tuple(BASE_HZ + k * STEP_HZ for k in range(8))

_F32: Final = struct.Struct("<f")
_BIG_ENDIAN: Final = sys.byteorder == "big"


def f32(x: float) -> float:
    """Round a Python float to the nearest binary32 value."""
    result: float = _F32.unpack(_F32.pack(x))[0]
    return result


def frame_bytes(phase: int, channels: int) -> bytes:
    """The interleaved little-endian f32 sample frame at `phase` (0..SAMPLE_RATE-1)."""
    rate = f32(float(SAMPLE_RATE))
    p = f32(f32(float(phase)) / rate)
    v = f32(1.0 - f32(2.0 * abs(f32(f32(2.0 * p) - 1.0))))
    scaled = f32(v * AMPLITUDE)
    return b"".join(_F32.pack(f32(scaled / (c + 1))) for c in range(channels))


def _rounded(values: list[float]) -> list[float]:
    """`f32` of every value: array("f") stores each as the C float struct packs."""
    return array("f", values).tolist()


def _table(channels: int) -> bytes:
    """`frame_bytes` of every phase, joined in phase order: the same operations and roundings,
    a whole column of phases per operation."""
    rate = f32(float(SAMPLE_RATE))
    p = _rounded([x / rate for x in _rounded([float(phase) for phase in range(SAMPLE_RATE)])])
    u = _rounded([x - 1.0 for x in _rounded([2.0 * x for x in p])])
    v = _rounded([1.0 - x for x in _rounded([2.0 * abs(x) for x in u])])
    scaled = _rounded([x * AMPLITUDE for x in v])
    out = array("f", bytes(4 * channels * SAMPLE_RATE))
    for c in range(channels):
        out[c::channels] = array("f", [x / (c + 1) for x in scaled])
    if _BIG_ENDIAN:
        out.byteswap()
    return out.tobytes()


class _Ring:
    """Every frame of one channel count in the order an increment visits the phases.

    With g = gcd(increment, SAMPLE_RATE), orbit o (0 <= o < g) is the phases o, o + increment,
    o + 2·increment, … modulo SAMPLE_RATE: L = SAMPLE_RATE / g distinct phases, stored at
    frames o·L .. o·L + L − 1. Phase o + g·m is at step k = m · (increment/g)^-1 mod L of its
    orbit, and the frames that follow it are the next ones of the orbit, wrapping at its end.
    """

    __slots__ = ("data", "frame_size", "g", "inverse", "length")

    def __init__(self, increment: int, channels: int, table: bytes) -> None:
        g = math.gcd(increment, SAMPLE_RATE)
        length = SAMPLE_RATE // g
        size = 4 * channels
        self.g = g
        self.length = length
        self.frame_size = size
        self.inverse = pow(increment // g, -1, length)
        self.data = b"".join(
            table[phase * size:phase * size + size]
            for phase in [(o + increment * k) % SAMPLE_RATE for o in range(g)
                          for k in range(length)])

    def take(self, first: int, frames: int) -> bytes:
        """`frames` frames from phase `first` on."""
        g, length, size = self.g, self.length, self.frame_size
        orbit = first % g
        base = orbit * length * size
        end = base + length * size
        at = base + (first - orbit) // g * self.inverse % length * size
        need = frames * size
        if at + need <= end:
            return self.data[at:at + need]
        parts: list[bytes] = []
        while need > 0:
            n = min(need, end - at)
            parts.append(self.data[at:at + n])
            need -= n
            at = base
        return b"".join(parts)


#: (increment, channel count) -> its ring; a channel count's first chunk lays out the rings of
#: all `INCREMENTS` at once (about 0.1 s of CPU, a few MB), so a stream's memory is flat from its
#: first chunk on instead of growing as the counter first reaches each pitch
_RINGS: Final[dict[tuple[int, int], _Ring]] = {}


def _ring(increment: int, channels: int) -> _Ring:
    found = _RINGS.get((increment, channels))
    if found is None:
        table = _table(channels)
        for each in INCREMENTS:
            _RINGS.setdefault((each, channels), _Ring(each, channels, table))
        found = _RINGS[(increment, channels)]
    return found


class TriangleSource:
    """The stream's only state is `phase` (0..47999); it starts at 0 and persists."""

    def __init__(self, phase: int = 0) -> None:
        self.phase = phase

    def reset(self) -> None:
        self.phase = 0

    def chunk(self, counter: int, frames: int, channels: int = CHANNELS) -> bytes:
        """`frames` interleaved little-endian f32 sample frames at the current counter."""
        increment = INCREMENTS[counter % len(INCREMENTS)]
        start = self.phase
        count = max(frames, 0)
        self.phase = (start + increment * count) % SAMPLE_RATE
        if count == 0:
            return b""
        # the frames at phases start + increment·i, i = 1..frames (modulo SAMPLE_RATE)
        return _ring(increment, channels).take((start + increment) % SAMPLE_RATE, count)


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
