"""The counter arena's `arena` audio stream: an exact binary32 triangle (session.md §4.6).

Why: the pitch follows the counter and the phase persists across chunks, so a dropped, repeated
or overlapping chunk changes bytes; every operation is rounded to IEEE binary32 (round to nearest
even) through `struct`, so the bytes are the same on every platform.

A sample frame depends only on the phase and the channel count, so `frame_bytes` memoises it
(at most `SAMPLE_RATE` frames per channel count); `chunk` joins memoised frames.
"""

from __future__ import annotations

import struct
from functools import cache
from typing import Final

SAMPLE_RATE: Final = 48000
CHANNELS: Final = 2
BASE_HZ: Final = 220
STEP_HZ: Final = 55
AMPLITUDE: Final = 0.25

_F32: Final = struct.Struct("<f")


def f32(x: float) -> float:
    """Round a Python float to the nearest binary32 value."""
    result: float = _F32.unpack(_F32.pack(x))[0]
    return result


@cache
def frame_bytes(phase: int, channels: int) -> bytes:
    """The interleaved little-endian f32 sample frame at `phase` (0..SAMPLE_RATE-1)."""
    rate = f32(float(SAMPLE_RATE))
    p = f32(f32(float(phase)) / rate)
    v = f32(1.0 - f32(2.0 * abs(f32(f32(2.0 * p) - 1.0))))
    scaled = f32(v * AMPLITUDE)
    return b"".join(_F32.pack(f32(scaled / (c + 1))) for c in range(channels))


class TriangleSource:
    """The stream's only state is `phase` (0..47999); it starts at 0 and persists."""

    def __init__(self, phase: int = 0) -> None:
        self.phase = phase

    def reset(self) -> None:
        self.phase = 0

    def chunk(self, counter: int, frames: int, channels: int = CHANNELS) -> bytes:
        """`frames` interleaved little-endian f32 sample frames at the current counter."""
        increment = BASE_HZ + (counter % 8) * STEP_HZ
        start = self.phase
        phases = [(start + increment * i) % SAMPLE_RATE for i in range(1, frames + 1)]
        if phases:
            self.phase = phases[-1]
        return b"".join([frame_bytes(phase, channels) for phase in phases])
