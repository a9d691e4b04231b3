"""The routing core of a call (design/wire.md §9): its phases as data, and the books they keep.

Pure and synchronous: no sockets, no timers, no frames written. The router (`bus/router.py`)
decides when a call moves (a frame arrived, its writer dispatched, a connection ended) and does
the I/O that follows; this module decides whether the move is allowed and keeps the counts that
depend on the phase, so the rules live in one table instead of in flags set at each call site.

Rules (the edge table below is `EDGES`):

1. A call is admitted `Queued` and moves only along `EDGES`. Any other move raises
   `CallPhaseError` and changes nothing; to the router that is a broken invariant
   (design/wire.md §11).
2. `Queued` → `Dispatched` when the service's writer takes it; → `Gone` on a cancel before
   dispatch, the route's removal or the caller's disconnect.
3. `Dispatched` → `Replied` on a routed reply; → `Detached` on a cancel after dispatch or the
   caller's disconnect; → `Gone` on a release or the service's disconnect (the caller hears
   `bus.callFailed`).
4. `Detached` → `Gone` on the (unrouted) reply, a release or the service's disconnect. A detached
   call never notifies anyone.
5. `Replied` → `Gone` when the caller consumes the result or disconnects. `Gone` is final.
6. The books follow the phase alone: the caller's active-call slot is held exactly while the
   phase is in `HOLDS_SLOT` (design/wire.md §9.4); a call counts in `Ledger.calls` until `Gone`, in
   `Ledger.detached` while `Detached`, and its payload size in `Ledger.queued_bytes` while
   `Queued`; it is in its caller's `calls` map until `Gone`.

    Queued      -> Dispatched, Gone
    Dispatched  -> Replied, Detached, Gone
    Detached    -> Gone
    Replied     -> Gone
    Gone        -> (none)

What stays in the router: service FIFOs and the delivery ids of each connection (their order
is the writer's business), the notifications a move causes, and every write and timer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from enum import Enum
from typing import Any, Final, Generic, Protocol, TypeVar

__all__ = [
    "EDGES",
    "HOLDS_SLOT",
    "Call",
    "CallPhase",
    "CallPhaseError",
    "Caller",
    "Delivery",
    "Ledger",
    "Service",
]


class CallPhase(Enum):
    """The phases of design/wire.md §9.1; `Gone` is the call after its last one."""

    QUEUED = "Queued"
    DISPATCHED = "Dispatched"
    DETACHED = "Detached"
    REPLIED = "Replied"
    GONE = "Gone"

    # Members are singletons: identity hashing keeps the table lookups of every move in C
    # (Enum's own __hash__ is Python code, called for each dict or set probe).
    __hash__ = object.__hash__


QUEUED: Final = CallPhase.QUEUED
DISPATCHED: Final = CallPhase.DISPATCHED
DETACHED: Final = CallPhase.DETACHED
REPLIED: Final = CallPhase.REPLIED
GONE: Final = CallPhase.GONE

EDGES: Final[Mapping[CallPhase, frozenset[CallPhase]]] = {
    QUEUED: frozenset({DISPATCHED, GONE}),
    DISPATCHED: frozenset({REPLIED, DETACHED, GONE}),
    DETACHED: frozenset({GONE}),
    REPLIED: frozenset({GONE}),
    GONE: frozenset(),
}

HOLDS_SLOT: Final = frozenset({QUEUED, DISPATCHED, REPLIED})


class CallPhaseError(RuntimeError):
    """A move that is not an edge of `EDGES`: a router bug, never a peer's doing."""

    def __init__(self, call_id: int, source: CallPhase, target: CallPhase) -> None:
        super().__init__(f"call {call_id}: {source.value} -> {target.value} is not an edge")
        self.call_id = call_id
        self.source = source
        self.target = target


class Caller(Protocol):
    """The caller side of a call, as the books see it (the router's connection)."""

    active: int
    calls: dict[int, Any]


C = TypeVar("C", bound=Caller)


class Service(Generic[C]):
    """A registration: its FIFO of Queued calls and its in-flight count (design/wire.md §9.2)."""

    __slots__ = ("in_flight", "incarnation", "live", "max_in_flight", "max_queued", "name",
                 "owner", "queue")

    def __init__(self, name: str, incarnation: str, owner: C, max_queued: int,
                 max_in_flight: int) -> None:
        self.name = name
        self.incarnation = incarnation
        self.owner = owner
        self.max_queued = max_queued
        self.max_in_flight = max_in_flight
        self.queue: deque[Call[C]] = deque()
        self.in_flight = 0
        self.live = True


class Call(Generic[C]):
    """One admitted call. `frame` is the `bus.request` body while Queued, the `bus.result`
    body once Replied; `size` the payload's encoded size while Queued."""

    __slots__ = ("call_id", "caller", "delivery", "frame", "phase", "service", "size")

    def __init__(self, caller: C, call_id: int, service: Service[C], frame: bytes,
                 size: int) -> None:
        self.caller = caller
        self.call_id = call_id
        self.service = service
        self.frame = frame
        self.size = size
        self.phase = QUEUED
        self.delivery: Delivery[C] | None = None


class Delivery(Generic[C]):
    """A `bus.request` or `bus.result` delivered on a connection, until it is returned."""

    __slots__ = ("call", "capability", "consumed", "is_request", "serial")

    def __init__(self, serial: int, call: Call[C], is_request: bool) -> None:
        self.serial = serial
        self.call = call
        self.is_request = is_request
        self.capability = is_request
        self.consumed = False


class Ledger(Generic[C]):
    """The router-wide books of rule 6, changed only by `admit` and `move`."""

    __slots__ = ("calls", "detached", "queued_bytes")

    def __init__(self) -> None:
        self.calls = 0
        self.detached = 0
        self.queued_bytes = 0

    def admit(self, call: Call[C]) -> None:
        """A new Queued call: counted, its slot taken, in its caller's map and its FIFO."""
        self.calls += 1
        self.queued_bytes += call.size
        caller = call.caller
        caller.active += 1
        caller.calls[call.call_id] = call
        call.service.queue.append(call)

    def move(self, call: Call[C], target: CallPhase) -> None:
        """Move along an edge and settle the books; `CallPhaseError` (nothing changed) off it.
        Taking the call out of its FIFO, when it leaves Queued, is the caller's part."""
        source = call.phase
        if target not in EDGES[source]:
            raise CallPhaseError(call.call_id, source, target)
        call.phase = target
        if source is QUEUED:
            self.queued_bytes -= call.size
            call.size = 0
        elif source is DETACHED:
            self.detached -= 1
        if target is DETACHED:
            self.detached += 1
        if source in HOLDS_SLOT and target not in HOLDS_SLOT:
            call.caller.active -= 1
        if target is GONE:
            self.calls -= 1
            call.caller.calls.pop(call.call_id, None)
