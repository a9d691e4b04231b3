"""The frame in hand: how the router reads one, and the checks every op shares (design/wire.md §4).

A frame whose body member (`payload` or `outcome`) may be present is read with the
design/wire.md §22.1 split: the member is kept as the sender's wire bytes, the rest decoded and
checked as always, so a routed body is forwarded without a decode and re-encode. `Inbound` keeps
that body until the next frame; the op that routes it asks for its bytes (`body_bytes`) and whether
it was one well-formed JSON value (`body_refused`).

Check 4 (ids rise on a connection) and check 5 (the hello comes first) are here too, because
both the request path and the lean notifications of design/wire.md §21 run them.
"""

from __future__ import annotations

from typing import Any

from bus import codec
from bus.connection import Conn
from bus.errors import BusError
from bus.limits import MAX_ID
from bus.outbound import Outbound


def serial_of(delivery_id: object) -> int | None:
    """The serial of a well-formed `dlv-<n>` (design/wire.md §5), else None."""
    if type(delivery_id) is not str or not delivery_id.startswith("dlv-"):
        return None
    digits = delivery_id[4:]
    if not digits.isascii() or not digits.isdigit() or digits[0] == "0" or len(digits) > 16:
        return None
    serial = int(digits)
    return serial if serial <= MAX_ID else None


class Inbound:
    """The body member of the frame in hand, as the sender wrote it (design/wire.md §22.1)."""

    __slots__ = ("_body", "_key", "_out", "_problem")

    def __init__(self, out: Outbound) -> None:
        self._out = out
        self._body: bytes | None = None
        self._key = "payload"
        self._problem: str | None = None

    def read(self, body: bytes) -> Any:
        """The frame decoded, its body member (if any) kept as bytes; BusError if malformed."""
        if b'"payload"' in body or b'"outcome"' in body:
            # design/wire.md §22.1: the body is carried as its wire bytes, the rest checked as
            # always
            read = codec.decode_body_frame(body)
            self._body, self._key, self._problem = read.body, read.key, read.problem
            return read.msg
        msg = codec.decode(body)
        self._body = self._problem = None
        return msg

    def body_refused(self, *, strict: bool = False) -> str | None:
        """Check 7's last part for a frame whose body member is not one well-formed JSON
        value: INVALID_PARAMS naming it (the envelope around it was sound). A published
        payload (`strict`) reaches subscribers that never answer, so the router holds it to
        design/wire.md §3 itself, as before minor 3."""
        if self._problem is not None:
            return f"{self._key} is {self._problem}"
        if strict and self._body is not None:
            try:
                codec.decode(self._body)
            except BusError as exc:
                return f"{self._key}: {exc.message}"
        return None

    def body_bytes(self, p: dict[str, Any], key: str) -> tuple[bytes, bool]:
        """The wire bytes to forward for the body member `key` of the frame in hand, and
        whether they are the sender's own (else re-encoded from a frame read whole)."""
        body = self._body
        if body is not None and self._key == key:
            return body, True
        return codec.encode_trusted(p[key]), False

    def next_id(self, conn: Conn, value: object, name: str, malformed: str) -> int | None:
        """Check 4 (design/wire.md §4): a request's id, or a lean call's callId in its place, is an
        integer in 1..2^53-1 above every id before it on this connection. Returns it, now the
        connection's latest; or closes the connection (with `malformed` when it is no such
        integer) and returns None."""
        if type(value) is not int or not 1 <= value <= MAX_ID:
            self._out.close(conn, "INVALID_REQUEST", malformed)
            return None
        if value <= conn.last_id:
            self._out.close(conn, "INVALID_REQUEST",
                            f"{name} {value} is not greater than the previous id {conn.last_id}")
            return None
        conn.last_id = value
        return value

    def before_hello(self, conn: Conn) -> bool:
        """Check 5 (design/wire.md §4) for a lean notification, which is never `bus.hello`: before
        the hello it closes the connection and returns True."""
        if conn.client_id is not None:
            return False
        self._out.close(conn, "INVALID_ENVELOPE", "the first request must be bus.hello")
        return True
