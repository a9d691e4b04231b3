"""One router connection (design/wire.md §4): its state as plain fields, its protocol callbacks.

The router's parts share this object instead of keeping per-connection maps of their own: the
hello sets its identity and grants, the call ops its services, calls and deliveries, the topic
ops its lane and message deliveries, the writer its lanes and counts. Every protocol callback
forwards to the `ConnectionHost` (the router), which alone decides what a byte or an EOF
causes, so this module holds no routing rule.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Protocol, cast

import orjson

from bus.call_phases import Call, Delivery, Service
from bus.framing import FrameDecoder
from bus.lanes import LaneTurn
from bus.policy import Grants
from bus.topics import Message, Subscription


class ConnectionHost(Protocol):
    """What a connection's callbacks ask of the router."""

    def accepted(self, conn: Conn) -> None:
        """A new connection's transport is ready."""

    def readable(self, conn: Conn) -> None:
        """Bytes were fed to the connection's decoder: handle the frames they complete."""

    def ended(self, conn: Conn, reason: str) -> None:
        """The connection ends (design/wire.md §10.2); idempotent."""

    def lost(self, conn: Conn) -> None:
        """The transport is closed: forget the connection."""

    def writable(self, conn: Conn) -> None:
        """The transport drained below its low-water mark: write what is ready."""


class Conn(asyncio.Protocol):
    """One connection: protocol callbacks forward to the host; state is plain fields."""

    def __init__(self, host: ConnectionHost, max_envelope_bytes: int) -> None:
        self.host = host
        self.transport: asyncio.Transport | None = None
        self.number = 0
        self.connection_id = ""
        self.pid = self.uid = self.gid = -1
        self.created = time.monotonic()
        self.client_id: str | None = None
        self.client_incarnation: str | None = None
        self.identity = orjson.Fragment(b"null")  # {clientId, clientIncarnation}, encoded once
        self.grants = Grants()
        self.may_call: dict[str, bool] = {}  # target -> a call grant matches (grants are fixed)
        self.last_id = 0
        self.decoder = FrameDecoder(max_envelope_bytes)
        self.hello_timer: asyncio.TimerHandle | None = None
        self.services: dict[str, Service[Conn]] = {}
        self.service_list: list[Service[Conn]] = []  # registration order (dispatch)
        self.rr = 0
        self.calls: dict[int, Call[Conn]] = {}
        self.active = 0
        self.deliveries: dict[int, Delivery[Conn]] = {}
        self.dlv = 0
        self.open_requests = 0
        self.capabilities = 0
        self.expectations: set[str] = set()
        self.control: deque[bytes] = deque()
        self.control_bytes = 0
        self.results: deque[Call[Conn]] = deque()
        self.write_paused = False
        self.read_paused = False
        self.dirty = False
        self.closing = False
        self.torn_down = False
        self.frames_in = 0
        self.frames_out = 0
        # topics (topics.md §4): the lane turn, control frames the writer took while the
        # connection had subscriptions, and its written, unconsumed message deliveries
        self.lane = LaneTurn()
        self.control_taken = 0
        self.messages: dict[int, tuple[Subscription[Conn], Message]] = {}
        # the store (topics.md §5): a seal hashing off the loop pauses this connection
        self.sealing = False

    def label(self) -> str:
        """A subscriber as a BACKPRESSURE message names it (topics.md §3.4 check 8)."""
        return self.client_id or self.connection_id

    # asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.host.accepted(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.decoder.feed(data)
        self.host.readable(self)

    def eof_received(self) -> bool:
        self.host.ended(self, "eof")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.host.ended(self, "eof" if exc is None else "io")
        self.host.lost(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.host.writable(self)
