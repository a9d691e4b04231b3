"""Length-prefixed framing (design/wire.md §2), sans-IO.

A frame is a u32 little-endian body length N (1 <= N <= maxEnvelopeBytes) followed by N body
bytes. The decoder validates N before it buffers any body byte, so a hostile prefix can never
make either side allocate more than one envelope.
"""

from __future__ import annotations

import struct
from typing import Final

from bus.errors import InvalidEnvelope

PREFIX: Final = struct.Struct("<I")
PREFIX_SIZE: Final = PREFIX.size


def frame(body: bytes) -> bytes:
    """Prefix and body as one buffer, so a writer never emits them separately."""
    return PREFIX.pack(len(body)) + body


class FrameDecoder:
    """Incremental decoder: feed bytes in any split, take whole bodies out.

    After an error the decoder is poisoned: the connection must end, nothing more is read.
    """

    __slots__ = ("_buf", "_max", "_need")

    def __init__(self, max_bytes: int) -> None:
        self._buf = bytearray()
        self._max = max_bytes
        self._need = -1

    def feed(self, data: bytes) -> None:
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The next complete body, or None when more bytes are needed.

        Raises InvalidEnvelope (dispatch unknown) for a zero or oversize length prefix.
        """
        buf = self._buf
        if self._need < 0:
            if len(buf) < PREFIX_SIZE:
                return None
            (n,) = PREFIX.unpack_from(buf, 0)
            if n == 0:
                raise InvalidEnvelope("zero-length frame", "unknown")
            if n > self._max:
                raise InvalidEnvelope(
                    f"frame length {n} exceeds maxEnvelopeBytes {self._max}", "unknown"
                )
            del buf[:PREFIX_SIZE]
            self._need = n
        n = self._need
        if len(buf) < n:
            return None
        body = bytes(buf[:n])
        del buf[:n]
        self._need = -1
        return body

    def take_buffer(self) -> bytes:
        """Unconsumed bytes (used to re-bound a decoder once the hello told the limit)."""
        data = bytes(self._buf)
        self._buf.clear()
        return data
