"""PostgreSQL wire taps of the fault proxy (distribution.md §7.3.2).

The tap is the server-side witness of what crossed (or did not cross) a node's link: fenced
rejections, duplicate attempts and the backend pid that ties a transaction to a node's
`write_begin`, independent of what the nodes log.

Rules:
- Framing only; TLS and GSS encryption are disabled on proxied links (`sslmode=disable
  gssencmode=disable`), so every byte is protocol v3. Up (node→server) starts with one untyped
  message (StartupMessage, CancelRequest, or an SSL/GSS request, which is answered by a single
  byte and followed by another untyped message); every other message, both ways, is a type byte
  and an int32 length that counts itself.
- Recorded up: startup parameters (`startup`), Query and Parse text prefixes (`query`, `parse`,
  `PREFIX` characters), CancelRequest (`cancel`). Recorded down: BackendKeyData pid
  (`backend_key`), ErrorResponse SQLSTATE, constraint and message (`error`), CommandComplete
  tags (`complete`). Other messages are framed (hold_on_match needs them) but not recorded.
- A stream that stops looking like the protocol (a length outside 4..`MAX_MESSAGE`) is
  unframed from then on: the decoder reports no more messages and never blocks delivery.
- Each record carries true sim time (the harness clock), node, role (from `application_name`
  `flyd:<node_id>:<role>`), the connection's ordinal on its node's proxy, the direction and its
  fate: `delivered`, `held` or `dropped`. Decision where the spec is silent: a held message is
  recorded `held` when it is buffered and again `delivered` when the heal releases it (or
  `dropped` when its connection is reset first), so the sim time of both events is known; a
  message's fate is that of the delivery decision for the bytes that complete it.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Final, Literal

Direction = Literal["up", "down"]
Fate = Literal["delivered", "held", "dropped"]

MAX_MESSAGE: Final = 1 << 30
PREFIX: Final = 200
PROTOCOL_V3: Final = 196608
CANCEL_REQUEST: Final = 80877102
SSL_REQUEST: Final = 80877103
GSSENC_REQUEST: Final = 80877104
_INT32: Final = struct.Struct("!i")


@dataclass(frozen=True, slots=True)
class Message:
    """One framed message: `kind` is the type byte (`b""` for an untyped start message);
    `start`/`end` are absolute offsets in the direction's byte stream."""

    kind: bytes
    body: bytes
    start: int
    end: int


class Decoder:
    """Incremental framer of one direction (module rules)."""

    def __init__(self, direction: Direction) -> None:
        self.direction = direction
        self.untyped = direction == "up"
        self.framed = True
        self._buf = bytearray()
        self._at = 0  # absolute offset of _buf[0]

    def feed(self, data: bytes) -> list[Message]:
        """Complete messages that `data` finishes, in stream order."""
        if not self.framed:
            self._at += len(data)
            return []
        self._buf += data
        out: list[Message] = []
        while True:
            head = 4 if self.untyped else 5
            if len(self._buf) < head:
                break
            kind = b"" if self.untyped else bytes(self._buf[:1])
            (length,) = _INT32.unpack_from(self._buf, head - 4)
            if length < 4 or length > MAX_MESSAGE:
                self.framed = False
                self._at += len(self._buf)
                self._buf.clear()
                break
            total = length + (head - 4)
            if len(self._buf) < total:
                break
            body = bytes(self._buf[head:total])
            out.append(Message(kind, body, self._at, self._at + total))
            del self._buf[:total]
            self._at += total
            if self.untyped:
                code = _INT32.unpack_from(body, 0)[0] if len(body) >= 4 else 0
                self.untyped = code in (SSL_REQUEST, GSSENC_REQUEST)
        return out

    @property
    def complete_upto(self) -> int:
        """Absolute offset just after the last complete message (all bytes if unframed)."""
        return self._at


def _cstrings(body: bytes) -> list[str]:
    return [part.decode("utf-8", "replace") for part in body.split(b"\0")]


def startup_parameters(body: bytes) -> dict[str, str] | None:
    """The key/value pairs of a StartupMessage body (protocol code first), else None."""
    if len(body) < 4 or _INT32.unpack_from(body, 0)[0] != PROTOCOL_V3:
        return None
    parts = _cstrings(body[4:])
    return {parts[i]: parts[i + 1] for i in range(0, len(parts) - 1, 2) if parts[i]}


def role_of(application_name: str | None) -> str | None:
    """`flyd:<node_id>:<role>` → role; anything else has no role."""
    if not application_name:
        return None
    parts = application_name.split(":")
    return parts[2] if len(parts) == 3 and parts[0] == "flyd" and parts[2] else None


def describe(direction: Direction, msg: Message) -> tuple[str, dict[str, str | int]] | None:
    """The recorded kind and detail of a message, or None for messages taps do not record."""
    if direction == "up":
        if msg.kind == b"":
            code = _INT32.unpack_from(msg.body, 0)[0] if len(msg.body) >= 4 else 0
            if code == CANCEL_REQUEST and len(msg.body) >= 8:
                return "cancel", {"pid": _INT32.unpack_from(msg.body, 4)[0]}
            params = startup_parameters(msg.body)
            return None if params is None else ("startup", dict(params))
        if msg.kind == b"Q":
            return "query", {"text": _cstrings(msg.body)[0][:PREFIX]}
        if msg.kind == b"P":
            parts = _cstrings(msg.body)
            return "parse", {"statement": parts[0], "text": (parts[1] if len(parts) > 1
                                                              else "")[:PREFIX]}
        return None
    if msg.kind == b"K" and len(msg.body) >= 4:
        return "backend_key", {"pid": _INT32.unpack_from(msg.body, 0)[0]}
    if msg.kind == b"C":
        return "complete", {"tag": _cstrings(msg.body)[0]}
    if msg.kind == b"E":
        fields: dict[str, str | int] = {}
        names = {"C": "sqlstate", "n": "constraint", "M": "message", "S": "severity"}
        for part in msg.body.split(b"\0"):
            if part[:1].decode("latin-1") in names:
                fields[names[part[:1].decode("latin-1")]] = part[1:].decode("utf-8", "replace")
        return "error", fields
    return None


@dataclass(frozen=True, slots=True)
class TapRecord:
    sim_time: float
    node: str
    role: str | None
    conn: int
    direction: Direction
    kind: str
    fate: Fate
    detail: dict[str, str | int] = field(default_factory=dict)

    def to_json(self) -> dict[str, object]:
        return {"t": self.sim_time, "node": self.node, "role": self.role, "conn": self.conn,
                "dir": self.direction, "kind": self.kind, "fate": self.fate,
                "detail": self.detail}


class Tap:
    """All records of a harness's proxies, appended from the proxy thread, read from any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[TapRecord] = []

    def add(self, record: TapRecord) -> None:
        with self._lock:
            self._records.append(record)

    def records(self) -> list[TapRecord]:
        with self._lock:
            return list(self._records)

    def __iter__(self) -> Iterator[TapRecord]:
        return iter(self.records())

    def errors(self, sqlstate: str | None = None) -> list[TapRecord]:
        """Delivered or not, every ErrorResponse (of one SQLSTATE)."""
        return [r for r in self.records() if r.kind == "error"
                and (sqlstate is None or r.detail.get("sqlstate") == sqlstate)]
