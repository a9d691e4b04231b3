"""The counter arena's `arena` view: one RGBA8 frame, top-left origin (design/session.md §4.6).

Why: the frame carries the counter (red), the column ramp (green) and a boundary marker column
(blue), so a stale, truncated or wrongly ordered frame changes bytes a test can check.
"""

from __future__ import annotations

import functools
from typing import Final

WIDTH: Final = 32
HEIGHT: Final = 24
BYTES_PER_PIXEL: Final = 4
ROW_STRIDE: Final = WIDTH * BYTES_PER_PIXEL
FRAME_BYTES: Final = ROW_STRIDE * HEIGHT


@functools.lru_cache(maxsize=4)
def _template(width: int, height: int) -> bytes:
    """The frame's parts that depend on neither counter nor boundary: `G` by column, `B` by row,
    `A = 255` (`R` 0, no marker). A world renders every boundary at one size, so each frame is
    this template with two slice writes instead of a row by row build."""
    greens = bytes(x * 255 // (width - 1) if width > 1 else 0 for x in range(width))
    out = bytearray(width * height * BYTES_PER_PIXEL)
    for y in range(height):
        row = y * width * BYTES_PER_PIXEL
        out[row + 1:row + width * BYTES_PER_PIXEL:4] = greens
        out[row + 2:row + width * BYTES_PER_PIXEL:4] = \
            bytes((y * 255 // (height - 1) if height > 1 else 0,)) * width
    out[3::4] = b"\xff" * (width * height)
    return bytes(out)


def render_frame(counter: int, boundary: int, width: int = WIDTH, height: int = HEIGHT) -> bytes:
    """Rows top to bottom, no padding: `R = counter & 0xff`, `G = x·255 // (w−1)`,
    `B = 255` in column `boundary mod w` else `y·255 // (h−1)`, `A = 255`."""
    out = bytearray(_template(width, height))
    out[0::4] = bytes((counter & 0xFF,)) * (width * height)
    out[(boundary % width) * BYTES_PER_PIXEL + 2::width * BYTES_PER_PIXEL] = b"\xff" * height
    return bytes(out)
