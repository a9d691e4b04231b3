"""Audio of the synthetic arena: its `arena` stream, an exact binary32 triangle (design/session.md
§4.6). The coordinator's side, the timelines that check any world's chunks, is
`flyd.session.audio`.

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
"""

from __future__ import annotations

import math
import struct
import sys
from array import array
from typing import Final

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
