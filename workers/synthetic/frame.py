"""The counter arena's `arena` view: one RGBA8 frame, top-left origin (session.md §4.6).

Why: the frame carries the counter (red), the column ramp (green) and a boundary marker column
(blue), so a stale, truncated or wrongly ordered frame changes bytes a test can check.
"""

from __future__ import annotations

from typing import Final

WIDTH: Final = 32
HEIGHT: Final = 24
BYTES_PER_PIXEL: Final = 4
ROW_STRIDE: Final = WIDTH * BYTES_PER_PIXEL
FRAME_BYTES: Final = ROW_STRIDE * HEIGHT


def render_frame(counter: int, boundary: int, width: int = WIDTH, height: int = HEIGHT) -> bytes:
    """Rows top to bottom, no padding: `R = counter & 0xff`, `G = x·255 // (w−1)`,
    `B = 255` in column `boundary mod w` else `y·255 // (h−1)`, `A = 255`."""
    red = counter & 0xFF
    marker = boundary % width
    greens = [x * 255 // (width - 1) if width > 1 else 0 for x in range(width)]
    row = bytearray(width * BYTES_PER_PIXEL)
    row[0::4] = bytes((red,)) * width
    row[1::4] = bytes(greens)
    row[3::4] = b"\xff" * width
    out = bytearray()
    for y in range(height):
        row[2::4] = bytes((y * 255 // (height - 1) if height > 1 else 0,)) * width
        if width:
            row[marker * 4 + 2] = 255
        out += row
    return bytes(out)
