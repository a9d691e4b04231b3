"""What the router sends that no lane schedules: responses, notices and the closing frame.

Every part of the router answers through one `Outbound`: a response or a notice is queued on
the connection's control lane (design/wire.md §14.2), the connection is marked, and one flush after
the wake-up's reads runs each marked connection's writer, so replies from several services to
one caller (a lockstep phase's fan-in) leave in one write. A control lane that overflows while
its writer is blocked closes the client; `close` writes `bus.closing` as the connection's last
frame (design/wire.md §4) and lingers until the peer's EOF or the grace abort.

The counters of design/wire.md §16 live here because every part counts through it;
`bus/router_stats.py` reads them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

import orjson

from bus.connection import Conn
from bus.errors import Dispatch, error_object
from bus.framing import PREFIX
from bus.limits import Limits

CLOSE_GRACE_S: Final = 4.0
CANCEL_STATES: Final = (
    "cancelled-before-dispatch",
    "execution-unknown",
    "completed",
    "call-gone",
)


def new_counters() -> dict[str, Any]:
    """The counters of design/wire.md §16 at a router's start, in the order `bus.stats` lists
    them."""
    return {
        "accepted": 0, "refusedAtAccept": 0, "helloOk": 0, "helloRefused": 0, "closed": 0,
        "callsAdmitted": 0, "callsRefused": 0, "callsFailed": 0, "repliesRouted": 0,
        "repliesUnrouted": 0, "cancels": dict.fromkeys(CANCEL_STATES, 0), "errors": {},
        "closes": {}, "framesIn": 0, "framesOut": 0, "bytesIn": 0, "bytesOut": 0,
        "leanCalls": 0, "leanReplies": 0, "leanConsumed": 0, "creditsCarried": 0,
        "published": 0, "publishRefused": 0, "leanPublishes": 0, "messagesDelivered": 0,
        "sealsRefused": 0, "bodiesForwardedRaw": 0, "inlineReplies": 0,
    }


class Outbound:
    """The control lane, the flush of marked connections and the closing frame.

    `pump` is the connection's writer, `teardown` ends a connection (design/wire.md §10.2) and
    `broken` handles a broken invariant (design/wire.md §11); the router hands in all three."""

    def __init__(self, limits: Limits, pump: Callable[[Conn], None],
                 teardown: Callable[[Conn, str], None],
                 broken: Callable[[BaseException], None]) -> None:
        self.limits = limits
        self.counters = new_counters()
        self.loop: asyncio.AbstractEventLoop | None = None
        #: the router still accepts: a close lingers (write_eof) instead of closing at once
        self.serving = False
        self._pump = pump
        self._teardown = teardown
        self._broken = broken
        self._dirty: list[Conn] = []
        self._flush_scheduled = False

    def respond(self, conn: Conn, rid: int, result: Any) -> None:
        self.control(conn, orjson.dumps({"jsonrpc": "2.0", "id": rid, "result": result}))

    def count_error(self, name: str) -> None:
        errors = self.counters["errors"]
        errors[name] = errors.get(name, 0) + 1

    def respond_error(self, conn: Conn, rid: int, name: str, message: str,
                      dispatch: Dispatch) -> None:
        self.count_error(name)
        self.control(conn, orjson.dumps(
            {"jsonrpc": "2.0", "id": rid, "error": error_object(name, message, dispatch)}
        ))

    def notice(self, conn: Conn, method: str, params: dict[str, Any]) -> None:
        """A notification from the router (`bus.callFailed`, `bus.routeRemoved`, …)."""
        self.control(conn, orjson.dumps({"jsonrpc": "2.0", "method": method, "params": params}))

    def control(self, conn: Conn, body: bytes) -> None:
        """Enqueue on the control lane; overflow while the writer is blocked closes the client."""
        if conn.closing:
            return
        if conn.write_paused and (
            len(conn.control) + 1 > self.limits.maxControlFrames
            or conn.control_bytes + len(body) > self.limits.maxControlBytes
        ):
            self.close(conn, "QUOTA_EXCEEDED", "control lane exhausted")
            return
        conn.control.append(body)
        conn.control_bytes += len(body)
        self.mark(conn)

    def mark(self, conn: Conn) -> None:
        """The connection has something to write: its writer runs in this wake-up's flush."""
        if not conn.dirty and not conn.closing:
            conn.dirty = True
            self._dirty.append(conn)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                assert self.loop is not None
                self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, []
        for conn in dirty:
            conn.dirty = False
            try:
                self._pump(conn)
            except Exception as exc:
                self._broken(exc)
                return

    def wrote(self, conn: Conn, frames: int, nbytes: int) -> None:
        """Count frames a writer handed to the transport."""
        conn.frames_out += frames
        counters = self.counters
        counters["framesOut"] += frames
        counters["bytesOut"] += nbytes

    def close(self, conn: Conn, name: str, message: str) -> None:
        """The router ends a connection: `bus.closing` is the last frame (design/wire.md §4)."""
        if conn.closing:
            return
        self.count_error(name)
        transport = conn.transport
        frame = orjson.dumps({"jsonrpc": "2.0", "method": "bus.closing",
                              "params": {"error": error_object(name, message, "unknown")}})
        self._teardown(conn, name)
        if transport is not None:
            transport.write(PREFIX.pack(len(frame)) + frame)
            self.wrote(conn, 1, len(frame) + 4)
            self.finish_close(conn)

    def finish_close(self, conn: Conn) -> None:
        """Close a torn-down connection whose last frame is written."""
        transport = conn.transport
        assert transport is not None and self.loop is not None
        if self.serving and transport.can_write_eof():
            # Lingering close: shut our side down once the last frame is flushed, but keep
            # reading (data_received discards it) until the peer's EOF or the grace abort, so
            # a peer still sending sees its frames, then EOF, instead of a reset (design/wire.md §20
            # #73).
            transport.write_eof()
            if conn.read_paused:
                conn.read_paused = False
                transport.resume_reading()
        else:
            if conn.read_paused:
                conn.read_paused = False
            transport.close()
        self.loop.call_later(CLOSE_GRACE_S, transport.abort)
