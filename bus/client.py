"""The asyncio client SDK (wire.md §17); works on the default loop and under uvloop.

One `BusClient` is one connection and belongs to one event loop. It applies the same strict
rules to the router's frames as the router applies to ours (§2–§4): any violation, EOF,
`bus.closing` or `close()` fails everything pending with RouterLost (`unknown`), because after
a lost connection nothing is known about what ran. Deadlines live here, on the caller's
monotonic clock: at a deadline the SDK cancels and reports the certainty the cancel proved.

Against a router of minor >= 1 (wire.md §21) `call()` and handlers' returned replies use the
lean notification forms, and credits ride inside them: a call carries the result deliveries
consumed since the last one, a reply returns its request delivery (`consumed: true`); result
credits no call took within CREDIT_DELAY_S leave in one `bus.consumed` notification.

Task ownership: every handler task is owned by its client, tracked in `_tasks` and cancelled
and awaited when the connection ends; the SDK starts no other tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import mmap
import os
import types
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

import orjson
import structlog

from bus import codec
from bus.errors import (
    AttachmentsNotKept,
    BusError,
    CallDeadlineExceeded,
    CallGone,
    InvalidEnvelope,
    InvalidParams,
    MethodNotFound,
    QuotaExceeded,
    RouterLost,
    StoreFailure,
    VersionMismatch,
    error_object,
    from_wire,
)
from bus.framing import PREFIX, FrameDecoder
from bus.limits import MAX_CONSUME_BATCH, hello_keys
from bus.ownership import Trust, check_socket_dir
from bus.schema import NOTIFICATIONS, OPS, Validator, contract_digest, validator
from bus.store import map_for_write, open_store_dir, read_sealed, write_whole

log = structlog.get_logger("bus.client")

CANCEL_WAIT_S: Final = 0.5
IDENTITY_CACHE: Final = 1024
CREDIT_DELAY_S: Final = 0.005  # result credits wait this long for a call to carry them (§21.6)
# A lingering publication waits at most this long for another frame to share its write.
LINGER_S: Final = 0.002
# A credit window with less than this left when its timer fires is due now, not re-armed.
CREDIT_SLACK_S: Final = 0.0005
# How long `close()` waits for cancelled handler tasks to end.
HANDLER_REAP_S: Final = 2.0
# A full listen backlog refuses connect with EAGAIN; the SDK tries again within its timeout,
# waiting a little longer each time up to the cap.
CONNECT_RETRY_FIRST_S: Final = 0.005
CONNECT_RETRY_MAX_S: Final = 0.1
MAX_ID: Final = 2**53 - 1
# `bus.drop` takes at most this many ids per frame (docs/topics.md §5.7)
MAX_DROP_IDS: Final = 16

Handler = Callable[["Request"], Awaitable["dict[str, Any] | Reply | None"]]
#: a handler that completes without awaiting (wire.md §22.2): run on the reader, no task
InlineHandler = Callable[["Request"], "dict[str, Any] | Reply | None"]
#: the outcome member a service SDK answers with when it refuses a request's payload itself
#: (wire.md §22.3): `{"bus.error": <error object>}`; the caller's SDK raises that error
REFUSAL_KEY: Final = "bus.error"
RouteRemovedHook = Callable[[str, str, str], None]


@dataclass(frozen=True, slots=True)
class Identity:
    client_id: str
    client_incarnation: str


@dataclass(frozen=True, slots=True)
class Attachment:
    """A sealed artifact as a delivery carries it (docs/topics.md §6.1). As an async context
    manager it drops this client's hold on exit (the SDK's `call()` retains result ones)."""

    artifact_id: str
    length: int
    digest: str
    client: BusClient | None = field(default=None, compare=False, repr=False)

    async def __aenter__(self) -> Attachment:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client is not None and not self.client.closed:
            await self.client.drop([self.artifact_id])


#: what `Allocation.seal()` returns: the sealed artifact, held by its allocator
Artifact = Attachment
#: an attachment as the SDK's calls take it: an artifact id or an `Attachment`
AttachmentRef = str | Attachment


def artifact_ids(attachments: Iterable[AttachmentRef]) -> list[str]:
    """The wire form of attachments given as ids or `Attachment`s (docs/topics.md §12)."""
    return [a if isinstance(a, str) else a.artifact_id for a in attachments]


@dataclass(frozen=True, slots=True)
class CallResult:
    call_id: int
    service_incarnation: str
    responder: Identity
    outcome: dict[str, Any]
    attachments: tuple[Attachment, ...] = ()
    frame: bytes = field(default=b"", repr=False, compare=False)  # the bus.result frame

    @property
    def outcome_bytes(self) -> bytes:
        """The outcome as the responder wrote it (wire.md §22.1; against a router of minor
        < 3, as that router re-encoded it), found in the frame on each use."""
        found = codec.body_bytes(self.frame, "outcome")
        return found if found is not None else codec.encode(self.outcome)


@dataclass(frozen=True, slots=True)
class Reply:
    """A handler's outcome with attachments (docs/topics.md §12); `transfer` hands the
    handler's holds on them to the result."""

    outcome: dict[str, Any]
    attachments: tuple[AttachmentRef, ...] = ()
    transfer: bool = False


class Allocation:
    """An Allocated artifact of this client: write its bytes (`write()` at once, or through
    `view()`), then `seal()`."""

    def __init__(self, client: BusClient, artifact_id: str, length: int) -> None:
        self.client = client
        self.artifact_id = artifact_id
        self.length = length
        self._map: mmap.mmap | None = None

    def view(self) -> memoryview:
        """A writable view of the file's bytes (mapped on first use)."""
        if self._map is None:
            self._map = map_for_write(self.client._store_fd(), self.artifact_id, self.length)
        return memoryview(self._map)

    def write(self, data: bytes | memoryview) -> None:
        """The whole contents at once, without a mapping (docs/topics.md §5.4; cheaper than
        `view()` for a frame written in one piece). Not while a `view()` mapping is open."""
        if self._map is not None:
            raise BufferError(f"{self.artifact_id} is mapped: write through view()")
        write_whole(self.client._store_fd(), self.artifact_id, self.length, data)

    async def seal(self, digest: str | None = None) -> Attachment:
        """Hash (unless `digest` is given), unmap, then `bus.seal`. A view still exported
        keeps the mapping, so the seal is refused locally (BufferError), nothing sent."""
        if self._map is not None:
            if digest is None:
                digest = hashlib.sha256(self._map).hexdigest()
            self._map.close()  # BufferError while a view is exported
            self._map = None
        elif digest is None:
            with map_for_write(self.client._store_fd(), self.artifact_id, self.length) as m:
                digest = hashlib.sha256(m).hexdigest()
        result = await self.client._command("bus.seal", {"artifactId": self.artifact_id,
                                                         "digest": digest})
        return self.client._attachment(result)


def _ignore_outcome(fut: asyncio.Future[Any]) -> None:
    """Retrieve a pipelined command's outcome so an error is not reported as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def _payload_bytes(payload: bytes) -> bytes:
    """A payload given as wire bytes (a retry resends what it sent, wire.md §22.3). They get
    the router's check, one well-formed JSON object, else InvalidEnvelope and nothing is sent;
    §3's strictness inside them is the receiver's to check, as for any forwarded body."""
    problem = codec.body_problem(payload) if payload[:1] == b"{" else "not a JSON object"
    if problem is not None:
        raise InvalidEnvelope(f"payload: {problem}", "not-dispatched")
    return payload


def new_incarnation() -> str:
    return "inc-" + os.urandom(16).hex()


class Validators:
    """Compiled schemas for everything the router may send (loaded once per process)."""

    _cache: Validators | None = None

    def __init__(self) -> None:
        self.response = validator("response.json")
        self.results: dict[str, Validator] = {
            op: validator(f"ops/{op}.result.json") for op in OPS
        }
        self.notifications = {m: validator(f"notifications/{m}.json") for m in NOTIFICATIONS}
        self.error = validator("error.json")

    @classmethod
    def get(cls) -> Validators:
        if cls._cache is None:
            cls._cache = cls()
        return cls._cache


class Request:
    """A `bus.request` delivered to one of our services; answer it once."""

    __slots__ = ("_answered", "_client", "_frame", "_payload_bytes", "attachments", "call_id",
                 "caller", "delivery_id", "method", "payload", "service_incarnation", "target")

    def __init__(self, client: BusClient, params: dict[str, Any], frame: bytes = b"") -> None:
        self._client = client
        self.delivery_id: str = params["deliveryId"]
        self.call_id: int = params["callId"]
        caller = params["caller"]
        self.caller = client._identity(caller)
        self.target: str = params["target"]
        self.service_incarnation: str = params["serviceIncarnation"]
        self.method: str = params["method"]
        #: the value, decoded with §3's strictness; its wire bytes are `payload_bytes`
        self.payload: dict[str, Any] = params["payload"]
        self._frame = frame
        self._payload_bytes: bytes | None = None
        self.attachments = client._attachments(params)
        self._answered = False

    @property
    def payload_bytes(self) -> bytes:
        """The payload exactly as the caller wrote it (wire.md §22.3: what a body digest
        hashes), found in the frame on first use."""
        if self._payload_bytes is None:
            found = codec.body_bytes(self._frame, "payload")
            self._payload_bytes = found if found is not None else codec.encode(self.payload)
        return self._payload_bytes

    async def retain(self, ids: list[str] | None = None) -> list[Attachment]:
        """Keep attachments (all by default) beyond the handler (docs/topics.md §12)."""
        return await self._client.retain(
            ids if ids is not None else [a.artifact_id for a in self.attachments])

    @property
    def answered(self) -> bool:
        return self._answered

    async def reply(self, outcome: dict[str, Any], *,
                    attachments: tuple[AttachmentRef, ...] = (),
                    transfer: bool = False) -> bool:
        """Send the reply; True when routed to an attached caller."""
        params: dict[str, Any] = {"deliveryId": self.delivery_id}
        if attachments:
            params["attachments"] = artifact_ids(attachments)
            params["transfer"] = transfer
        params["outcome"] = outcome  # last: the router's split (wire.md §22.1)
        result = await self._client._command("bus.reply", params)
        self._answered = True
        return bool(result["routed"])

    async def release(self) -> bool:
        """Give up the reply capability (the caller gets CALL_GONE `dispatched`)."""
        self._answered = True
        result = await self._client._command(
            "bus.release", {"deliveryId": self.delivery_id}, wait_drain=False
        )
        return bool(result["released"])


class Service:
    """A registration; as an async context manager it unregisters on exit."""

    def __init__(self, client: BusClient, name: str, incarnation: str, handler: Handler,
                 inline: Mapping[str, InlineHandler] | None = None) -> None:
        self._client = client
        self.name = name
        self.incarnation = incarnation
        self.handler = handler
        self.inline: Mapping[str, InlineHandler] = inline or {}

    async def unregister(self) -> bool:
        self._client._services.pop(self.name, None)
        result = await self._client._command(
            "bus.unregister", {"name": self.name, "serviceIncarnation": self.incarnation}
        )
        return bool(result["removed"])

    async def __aenter__(self) -> Service:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._client.closed:
            with contextlib.suppress(RouterLost):
                await self.unregister()


class _CallState:
    """SDK-side record of one bus.call: admission, then exactly one terminal outcome.

    `admitted` exists only for a request-form call (`start_call` awaits the admission); a
    lean call has no admission response to wait for."""

    __slots__ = ("admitted", "call_id", "done", "keep", "service_incarnation")

    def __init__(self, loop: asyncio.AbstractEventLoop, call_id: int, admission: bool) -> None:
        self.call_id = call_id
        self.admitted: asyncio.Future[str] | None = None
        if admission:
            self.admitted = loop.create_future()
        self.done: asyncio.Future[CallResult] = loop.create_future()
        self.service_incarnation: str | None = None
        self.keep = True  # retain a result's attachments (docs/topics.md §12)


class _DeadlineReached(Exception):
    """Set on a call's `done` future when its deadline passes (the outcome moves on to a
    fresh future that `_deadline` reads)."""


def _deliver(state: _CallState, exc: BaseException | None = None, value: Any = None) -> None:
    """Settle a call's outcome. `call()` awaits `done` directly (no shield: one wake-up
    fewer), so a task cancellation may have cancelled it; the outcome then goes to a fresh
    future that `_deadline` reads."""
    if state.done.cancelled():
        state.done = asyncio.get_running_loop().create_future()
    _settle(state.done, exc, value)


def _settle(fut: asyncio.Future[Any] | None, exc: BaseException | None = None,
            value: Any = None) -> None:
    """Settle a future once. A failure is marked retrieved at once (a pending call nobody
    awaits may fail), which costs nothing per call, unlike a done-callback on every future;
    an awaiting task still gets the exception."""
    if fut is not None and not fut.done():
        if exc is not None:
            fut.set_exception(exc)
            fut.exception()
        else:
            fut.set_result(value)


def _expire(state: _CallState) -> None:
    """A `call()` deadline: wake the caller with _DeadlineReached; a later outcome goes to a
    fresh future."""
    done = state.done
    if not done.done():
        state.done = done.get_loop().create_future()
        done.set_exception(_DeadlineReached())


class PendingCall:
    """An admitted call (`start_call`): await `result()`, or `cancel()` it."""

    def __init__(self, client: BusClient, state: _CallState) -> None:
        self._client = client
        self._state = state
        self.call_id = state.call_id
        self.service_incarnation: str = state.service_incarnation or ""
        self.cancel_state: str | None = None

    async def result(self) -> CallResult:
        """Wait for the outcome (no deadline; abandoning the wait does not cancel)."""
        return await asyncio.shield(self._state.done)

    async def cancel(self) -> str:
        """`bus.cancel`; afterwards `result()` raises CallGone unless the state is completed."""
        if self._state.done.done():
            self.cancel_state = "completed" if not self._state.done.exception() else "call-gone"
            return self.cancel_state
        res = await self._client._command("bus.cancel", {"callId": self.call_id},
                                          wait_drain=False)
        state: str = res["state"]
        self.cancel_state = state
        if state != "completed":
            self._client._finish_cancelled(self._state, state)
        return state

    async def __aenter__(self) -> PendingCall:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._state.done.done() and not self._client.closed:
            with contextlib.suppress(BusError):
                await self.cancel()


_CERTAINTY: Final = {
    "cancelled-before-dispatch": "not-dispatched",
    "execution-unknown": "dispatched",
}


PublishFailedHook = Callable[[str, BusError], None]


@dataclass(frozen=True, slots=True)
class PublishResult:
    """An accepted publish (docs/topics.md §3.4, request form)."""

    topic: str
    topic_incarnation: str
    sequence: int
    latest: int
    bounded: int


@dataclass(frozen=True, slots=True)
class Message:
    """One `bus.message` of a subscription (docs/topics.md §3.8)."""

    topic: str
    topic_incarnation: str
    sequence: int
    skipped: int
    publisher: Identity
    payload: dict[str, Any]
    delivery_id: str
    attachments: tuple[Attachment, ...] = ()
    client: BusClient | None = field(default=None, compare=False, repr=False)

    async def retain(self) -> list[Attachment]:
        """Keep this message's attachments beyond its delivery (before asking for the next)."""
        if not self.attachments or self.client is None:
            return []
        return await self.client.retain([a.artifact_id for a in self.attachments])


class Topic:
    """A topic this client declared; `async with` undeclares it on exit."""

    def __init__(self, client: BusClient, name: str, incarnation: str) -> None:
        self.client = client
        self.name = name
        self.incarnation = incarnation

    async def undeclare(self) -> bool:
        result = await self.client._command("bus.undeclare", {
            "topic": self.name, "topicIncarnation": self.incarnation})
        return bool(result["removed"])

    def undeclare_nowait(self) -> None:
        """`bus.undeclare` pipelined: sent now, its answer never awaited, for an owner that
        must not wait on the router (a grant whose lease was lost). Frames of one connection
        are taken in order, so what was sent before is handled first; a closed connection
        removed the topic already."""
        if self.client.closed:
            return
        fut = self.client._send_nowait("bus.undeclare", {
            "topic": self.name, "topicIncarnation": self.incarnation})
        fut.add_done_callback(_ignore_outcome)

    async def __aenter__(self) -> Topic:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self.client.closed:
            await self.undeclare()


class Subscription:
    """One subscription: an async iterator of `Message`s and a context manager (exit
    unsubscribes). A message's delivery is consumed when the next one is asked for or the
    subscription is left, so at most `window` unconsumed messages are ever held. Iteration
    ends after `bus.topicRemoved` (`removed_reason`); a lost connection raises RouterLost."""

    def __init__(self, client: BusClient, result: dict[str, Any]) -> None:
        self.client = client
        self.topic: str = result["topic"]
        self.topic_incarnation: str = result["topicIncarnation"]
        self.sequence: int = result["sequence"]
        self.retained: bool = result["retained"]
        self.removed_reason: str | None = None
        self._inbox: deque[Message] = deque()
        self._current: Message | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._failure: BusError | None = None
        self._active = True

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _deliver(self, msg: Message) -> None:
        self._inbox.append(msg)
        self._wake()

    def _removed(self, reason: str) -> None:
        self.removed_reason = reason
        self._wake()

    def _fail(self, error: BusError) -> None:
        self._failure = error
        self._wake()

    def _release_current(self) -> None:
        if self._current is not None:
            if self.client._closed_with is None:
                self.client._queue_consumed(self._current.delivery_id)
            self._current = None

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Message:
        self._release_current()
        while not self._inbox:
            if self._failure is not None:
                raise RouterLost(self._failure.message)
            if self.removed_reason is not None or not self._active:
                raise StopAsyncIteration
            self._waiter = self.client._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self._current = self._inbox.popleft()
        return self._current

    async def unsubscribe(self) -> bool:
        """Leave: the held and buffered deliveries are consumed; returns `removed`."""
        self._active = False
        self._release_current()
        while self._inbox:
            self.client._queue_consumed(self._inbox.popleft().delivery_id)
        self._wake()
        if self.removed_reason is not None or self.client.closed:
            self.client._subscriptions.pop(self.topic_incarnation, None)
            return False
        result = await self.client._command("bus.unsubscribe", {"topic": self.topic})
        self.client._subscriptions.pop(self.topic_incarnation, None)
        return bool(result["removed"])

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.client.closed:
            return
        await self.unsubscribe()


class _Protocol(asyncio.Protocol):
    def __init__(self, client: BusClient) -> None:
        self.client = client

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.client._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.client._on_data(data)

    def eof_received(self) -> bool:
        self.client._lost(RouterLost("the router closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.client._lost(RouterLost(
            "the router connection was lost" + (f": {exc}" if exc else "")))

    def pause_writing(self) -> None:
        self.client._pause_writing()

    def resume_writing(self) -> None:
        self.client._resume_writing()


class BusClient:
    """One connection to the router (created by `connect`)."""

    def __init__(self, path: str, client_id: str, client_incarnation: str,
                 on_route_removed: RouteRemovedHook | None,
                 on_publish_failed: PublishFailedHook | None = None) -> None:
        self.path = path
        self.client_id = client_id
        self.client_incarnation = client_incarnation
        self.router_id = ""
        self.connection_id = ""
        self.limits: dict[str, int] = {}
        self.grants: dict[str, list[str]] = {}
        self._max_envelope = 16777216
        self._on_route_removed = on_route_removed
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._decoder = FrameDecoder(16777216)
        self._v = Validators.get()
        self._next_id = 0
        self._pending: deque[tuple[int, str, asyncio.Future[dict[str, Any]]]] = deque()
        self._calls: dict[int, _CallState] = {}
        self._services: dict[str, Service] = {}
        self._registering: dict[int, tuple[Handler, dict[str, InlineHandler]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._lean = False  # the router announced minor >= 1 (wire.md §21.1)
        self._minor = 0
        self._on_publish_failed = on_publish_failed
        self._subscriptions: dict[str, Subscription] = {}  # by topic incarnation
        self._subscribing: dict[int, Subscription | None] = {}  # subscribe request id -> bound
        self._identities: dict[tuple[str, str], Identity] = {}
        self._consume: list[str] = []  # credits that leave at the next flush
        self._credits: list[str] = []  # result credits waiting for a call to carry them
        self._credit_timer: asyncio.TimerHandle | None = None
        self._last_credit = 0.0
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._linger_timer: asyncio.TimerHandle | None = None
        #: transport writes made: frames queued in one loop turn leave in one write
        self.writes = 0
        self._reading = False
        self._flush_after_read = False
        #: the frame `_on_notification` is handling, and why its body breaks §3 (wire.md §22.1)
        self._frame = b""
        self._bad_body: str | None = None
        self._drained: asyncio.Future[None] | None = None
        self._closed_with: BaseException | None = None
        self._closed = self._loop.create_future()
        self.store: dict[str, str] | None = None  # the hello's `store` (docs/topics.md §5.1)
        self._store_dir = -1

    # connection ---------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed_with is not None

    async def wait_closed(self) -> BusError | None:
        """The closing BusError, RouterLost for EOF, or None after a local close."""
        await asyncio.shield(self._closed)
        result: BusError | None = self._closed.result()
        return result

    async def close(self) -> None:
        """Close locally; everything pending fails with RouterLost `unknown`. Frames queued
        before the close (a notification sent just before it, a lingering one) are written
        first: `..._nowait` promises they leave, not that the connection outlives them."""
        self.flush()
        self._lost(None)
        await self._reap_tasks()

    def flush(self) -> None:
        """Write every queued frame now, lingering ones included: for a publisher whose next
        frame goes out on another connection and must come after these."""
        if self._out and self._closed_with is None:
            self._flush()

    async def __aenter__(self) -> BusClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _reap_tasks(self) -> None:
        """Cancel the handler tasks and wait for them, at most HANDLER_REAP_S: a handler that
        swallows its cancellation must not hold `close()` forever. One still running is left
        in `_tasks` (the client keeps owning it) and logged."""
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            done, stuck = await asyncio.wait(tasks, timeout=HANDLER_REAP_S)
            for t in done:
                if not t.cancelled():
                    t.exception()  # retrieved: the handler's own failure was logged already
            if stuck:
                log.warning("bus.client.handlers_ignore_cancel", client_id=self.client_id,
                            handlers=len(stuck), waited_s=HANDLER_REAP_S)

    def _lost(self, error: BusError | None) -> None:
        if self._closed_with is not None:
            return
        self._closed_with = error or RouterLost("the connection was closed locally")
        failure = error if isinstance(error, RouterLost) else RouterLost(
            error.message if error is not None else "the connection was closed locally")
        failure.dispatch = "unknown"
        if self._transport is not None:
            self._transport.abort()
        while self._pending:
            _, _, fut = self._pending.popleft()
            _settle(fut, RouterLost(failure.message))
        for state in self._calls.values():
            _settle(state.admitted, RouterLost(failure.message))
            _settle(state.done, RouterLost(failure.message))
        self._calls.clear()
        self._services.clear()
        for sub in self._subscriptions.values():
            sub._fail(RouterLost(failure.message))
        self._subscriptions.clear()
        if self._drained is not None:
            _settle(self._drained, RouterLost(failure.message))
        if self._credit_timer is not None:
            self._credit_timer.cancel()
            self._credit_timer = None
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        for t in self._tasks:
            t.cancel()
        if self._store_dir >= 0:  # open mappings stay readable
            os.close(self._store_dir)
            self._store_dir = -1
        _settle(self._closed, value=error)

    def _violation(self, message: str) -> None:
        log.warning("bus.client.protocol_violation", client_id=self.client_id, error=message)
        self._lost(RouterLost(f"router protocol violation: {message}"))

    def _check_open(self) -> None:
        if self._closed_with is not None:
            raise RouterLost("the connection is closed")

    # outbound ----------------------------------------------------------------------------
    def _pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = self._loop.create_future()

    def _resume_writing(self) -> None:
        if self._drained is not None:
            _settle(self._drained)

    def _write(self, body: bytes) -> None:
        """Queue a frame; frames of one loop turn leave in one write (fewer wakeups)."""
        self._out.append(PREFIX.pack(len(body)))
        self._out.append(body)
        self._schedule_flush()

    def _write_lingering(self, body: bytes) -> None:
        """Queue a frame that may wait up to LINGER_S for another frame's write: a frame
        queued meanwhile carries it, in order, so the two cost one write and one wake-up of
        the router instead of two."""
        self._out.append(PREFIX.pack(len(body)))
        self._out.append(body)
        if not self._flush_scheduled and self._linger_timer is None:
            self._linger_timer = self._loop.call_later(LINGER_S, self._linger_due)

    def _linger_due(self) -> None:
        self._linger_timer = None
        self._flush()

    def _schedule_flush(self) -> None:
        if self._reading:
            self._flush_after_read = True
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._closed_with is not None or self._transport is None:
            self._flush_scheduled = False
            return
        while self._consume:
            batch = self._consume[:MAX_CONSUME_BATCH]
            del self._consume[:MAX_CONSUME_BATCH]
            if self._lean:
                self._notify("bus.consumed", {"deliveryIds": batch})
            else:
                self._send_nowait("bus.consumed", {"deliveryIds": batch})
        self._flush_scheduled = False
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        out, self._out = self._out, []
        if out:
            self.writes += 1
            self._transport.write(b"".join(out))
            if self._transport.get_write_buffer_size() > 4 * self._max_envelope:
                self._lost(RouterLost("unsent bytes above 4 x maxEnvelopeBytes"))

    def _encode_request(self, rid: int, method: str, params: dict[str, Any]) -> bytes:
        return codec.encode({"jsonrpc": "2.0", "id": rid, "method": method, "params": params},
                            self._max_envelope)

    def _encode_call(self, rid: int, target: str, method: str, payload: dict[str, Any] | bytes,
                     expected_incarnation: str | None, lean: bool,
                     attachments: tuple[str, ...] = (), transfer: bool = False) -> bytes:
        """A `bus.call` frame, the notification form when `lean` (its callId is `rid`);
        a lean router also takes the pending result credits with it (wire.md §21.3).

        Only the payload needs the strict encoder's value checks: the envelope around it is
        strings, ints and maybe a null, and the strict encoder would walk the whole value
        again just because that null might be a NaN."""
        params: dict[str, Any] = {"target": target, "expectedIncarnation": expected_incarnation,
                                  "method": method}
        if lean:
            params["callId"] = rid
        if attachments:
            params["attachments"] = artifact_ids(attachments)
            params["transfer"] = transfer
        credits = self._credits[:MAX_CONSUME_BATCH] if self._lean else None
        if credits:
            params["consumed"] = credits
        # last: the router's split (wire.md §22.1); given bytes are sent as they are
        params["payload"] = orjson.Fragment(_payload_bytes(payload)) \
            if isinstance(payload, bytes) else payload
        msg: dict[str, Any] = ({"jsonrpc": "2.0", "method": "bus.call", "params": params} if lean
                               else {"jsonrpc": "2.0", "id": rid, "method": "bus.call",
                                     "params": params})
        if type(target) is not str or type(method) is not str or not (
                expected_incarnation is None or type(expected_incarnation) is str):
            body = codec.encode(msg, self._max_envelope)
        else:
            if not isinstance(payload, bytes):
                params["payload"] = orjson.Fragment(codec.encode(payload))
            body = codec.encode_trusted(msg, self._max_envelope)
        if credits:  # they leave with this frame
            del self._credits[:len(credits)]
        return body

    async def _command(self, method: str, params: dict[str, Any], *,
                       wait_drain: bool = True,
                       on_id: Callable[[int], None] | None = None) -> dict[str, Any]:
        self._check_open()
        if wait_drain and self._drained is not None and not self._drained.done():
            await self._drained
            self._check_open()
        rid = self._next_id + 1
        body = self._encode_request(rid, method, params)
        self._next_id = rid
        if on_id is not None:
            on_id(rid)
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending.append((rid, method, fut))
        self._write(body)
        return await fut

    def _queue_consumed(self, delivery_id: str) -> None:
        """Credits go out with the next flush, batched (at most MAX_CONSUME_BATCH per frame)."""
        self._consume.append(delivery_id)
        self._schedule_flush()

    def _queue_result_credit(self, delivery_id: str) -> None:
        """A consumed `bus.result`. A lean router takes it inside the next `bus.call`; if
        none leaves within CREDIT_DELAY_S of the last result, or MAX_CONSUME_BATCH credits
        are waiting, they go in one `bus.consumed` (wire.md §21.6). One timer serves the
        whole window, not one per result."""
        if not self._lean:
            self._queue_consumed(delivery_id)
            return
        credits = self._credits
        credits.append(delivery_id)
        if len(credits) >= MAX_CONSUME_BATCH:
            self._release_credits()
            return
        self._last_credit = self._loop.time()
        if self._credit_timer is None:
            self._credit_timer = self._loop.call_later(CREDIT_DELAY_S, self._credits_due)

    def _credits_due(self) -> None:
        self._credit_timer = None
        if not self._credits or self._closed_with is not None:
            return
        left = self._last_credit + CREDIT_DELAY_S - self._loop.time()
        if left > CREDIT_SLACK_S:
            self._credit_timer = self._loop.call_later(left, self._credits_due)
            return
        self._release_credits()

    def _release_credits(self) -> None:
        self._consume.extend(self._credits)
        self._credits.clear()
        self._schedule_flush()

    def _notify(self, method: str, params: dict[str, Any], linger: bool = False) -> None:
        """A lean notification (wire.md §21): no id, no response, never waits to drain."""
        body = codec.encode({"jsonrpc": "2.0", "method": method, "params": params},
                            self._max_envelope)
        if linger:
            self._write_lingering(body)
        else:
            self._write(body)

    def _send_nowait(self, method: str, params: dict[str, Any]) -> asyncio.Future[dict[str, Any]]:
        """A credit-returning command: never waits for the transport to drain."""
        rid = self._next_id + 1
        body = self._encode_request(rid, method, params)
        self._next_id = rid
        fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self._pending.append((rid, method, fut))
        self._write(body)
        return fut

    # inbound -----------------------------------------------------------------------------
    def _on_data(self, data: bytes) -> None:
        """Handle every frame of a read; the flush they ask for is scheduled after the
        tasks they woke or started, so those tasks' frames leave in the same write one loop
        iteration later (a handler's reply, a caller's next request) instead of one after."""
        if self._closed_with is not None:
            return
        self._decoder.feed(data)
        self._reading = True
        try:
            self._read_frames()
        finally:
            self._reading = False
        if self._flush_after_read:
            self._flush_after_read = False
            self._schedule_flush()

    def _read_frames(self) -> None:
        while self._closed_with is None:
            try:
                body = self._decoder.next_frame()
            except BusError as exc:
                self._violation(exc.message)
                return
            if body is None:
                return
            bad: str | None = None
            try:
                msg = codec.decode(body)
            except BusError as exc:
                # §22.1: the router forwards bodies it only checked for being well-formed, so
                # a body may break §3 inside a sound frame: that call's fault, not the router's
                split = self._split(body)
                if split is None:
                    self._violation(exc.message)
                    return
                msg, bad = split
            if type(msg) is not dict or msg.get("jsonrpc") != "2.0":
                self._violation("not a JSON-RPC 2.0 object")
                return
            if "id" in msg:
                self._on_response(msg)
            else:
                self._frame, self._bad_body = body, bad
                self._on_notification(msg)

    @staticmethod
    def _split(frame: bytes) -> tuple[Any, str] | None:
        """A frame that is not strict JSON as a whole: (its envelope, why its body breaks §3)
        when the envelope is sound and only the body is at fault, else None."""
        if b'"payload"' not in frame and b'"outcome"' not in frame:
            return None
        try:
            read = codec.decode_body_frame(frame)
        except BusError:
            return None
        if read.body is None:
            return None
        if read.problem is not None:
            return read.msg, read.problem
        try:
            codec.decode(read.body)
        except BusError as exc:
            return read.msg, exc.message
        return None

    def _on_response(self, msg: dict[str, Any]) -> None:
        problem = self._v.response(msg)
        if problem is not None:
            self._violation(f"response: {problem}")
            return
        if not self._pending or self._pending[0][0] != msg["id"]:
            self._violation(f"response id {msg['id']} is not the oldest outstanding request")
            return
        _, method, fut = self._pending.popleft()
        if "error" in msg:
            _settle(fut, from_wire(msg["error"]))
            return
        result = msg["result"]
        problem = self._v.results[method](result)
        if problem is not None:
            self._violation(f"{method} result: {problem}")
            return
        if method == "bus.register":
            # Bind the handler now: a request may follow in the same read, before the
            # awaiting register() resumes.
            binding = self._registering.pop(msg["id"], None)
            if binding is not None:
                self._services[result["name"]] = Service(
                    self, result["name"], result["serviceIncarnation"], *binding)
        elif method == "bus.subscribe":
            # Bind now: its first message may follow in the same read (docs/topics.md §4.2).
            sub = Subscription(self, result)
            self._subscriptions[sub.topic_incarnation] = sub
            self._subscribing[msg["id"]] = sub
        elif method == "bus.call":
            state = self._calls.get(msg["id"])
            if state is not None:
                state.service_incarnation = result["serviceIncarnation"]
                _settle(state.admitted, value=result["serviceIncarnation"])
        _settle(fut, value=result)

    def _on_notification(self, msg: dict[str, Any]) -> None:
        method = msg.get("method")
        check = self._v.notifications.get(method) if isinstance(method, str) else None
        params = msg.get("params")
        # jsonrpc and method are present: three members with params are exactly the three
        if check is None or len(msg) != 3 or "params" not in msg:
            self._violation(f"unexpected notification {method!r}")
            return
        problem = check(params)
        if problem is not None:
            self._violation(f"{method}: {problem}")
            return
        assert isinstance(params, dict)
        frame, bad = self._frame, self._bad_body
        self._frame, self._bad_body = b"", None
        if bad is not None and method not in ("bus.result", "bus.request"):
            self._violation(f"{method}: {bad}")  # a published payload is held to §3 by the router
            return
        if method == "bus.result":
            state = self._calls.pop(params["callId"], None)
            if state is not None:
                self._on_result(state, params, frame, bad)
            # queued after the wake-up: the credit leaves with the caller's next request
            self._queue_result_credit(params["deliveryId"])
        elif method == "bus.request":
            self._on_request(params, frame, bad)
        elif method == "bus.callFailed":
            state = self._calls.pop(params["callId"], None)
            if state is not None:
                err = from_wire(params["error"])
                _settle(state.admitted, err)
                _deliver(state, err)
        elif method == "bus.replyFailed":
            self._reply_failed(params)
        elif method == "bus.message":
            self._on_message(params)
        elif method == "bus.topicRemoved":
            self._on_topic_removed(params)
        elif method == "bus.publishFailed":
            self._publish_failed(params)
        elif method == "bus.routeRemoved":
            hook = self._on_route_removed
            if hook is not None:
                try:
                    hook(params["name"], params["serviceIncarnation"], params["reason"])
                except Exception:
                    log.exception("bus.client.route_removed_hook_failed")
        else:
            self._lost(from_wire(params["error"]))

    def _on_result(self, state: _CallState, params: dict[str, Any], frame: bytes,
                   bad: str | None) -> None:
        """A call's `bus.result`. An outcome that breaks §3 (wire.md §22.3) fails the call
        INVALID_PARAMS, `dispatched` (a handler saw the request); a service SDK's refusal
        (`{"bus.error": ...}`) is raised as that error."""
        if bad is not None:
            _deliver(state, InvalidParams(f"call {state.call_id}: the outcome is malformed: "
                                          f"{bad}", "dispatched"))
            return
        outcome = params["outcome"]
        if len(outcome) == 1 and REFUSAL_KEY in outcome:
            error = outcome[REFUSAL_KEY]
            if self._v.error(error) is None:
                _deliver(state, from_wire(error))
                return
        result = CallResult(params["callId"], params["serviceIncarnation"],
                            self._identity(params["responder"]), outcome,
                            self._attachments(params), frame)
        if result.attachments and state.keep:
            self._keep(state, result)  # the retain leaves before the credit
        else:
            _deliver(state, value=result)

    def _attachments(self, params: dict[str, Any]) -> tuple[Attachment, ...]:
        wire = params.get("attachments")
        return tuple(self._attachment(a) for a in wire) if wire else ()

    def _attachment(self, wire: dict[str, Any]) -> Attachment:
        return Attachment(wire["artifactId"], wire["length"], wire["digest"], self)

    def _keep(self, state: _CallState, result: CallResult) -> None:
        """docs/topics.md §12: retain a result's attachments before its credit leaves (the
        router handles our frames in order, so the hold exists before the delivery goes)."""
        fut = self._send_nowait("bus.retain",
                                {"artifactIds": [a.artifact_id for a in result.attachments]})

        def kept(f: asyncio.Future[dict[str, Any]]) -> None:
            exc = None if f.cancelled() else f.exception()
            if exc is None:
                _deliver(state, value=result)
            elif isinstance(exc, QuotaExceeded):
                _deliver(state, AttachmentsNotKept(
                    f"the result's attachments were not kept: {exc.message}", result))
            else:
                _deliver(state, exc)

        fut.add_done_callback(kept)

    def _identity(self, wire: dict[str, str]) -> Identity:
        """The Identity of a caller or responder; the same few peers recur, so each is built
        once (bounded: the cache starts over when full)."""
        key = (wire["clientId"], wire["clientIncarnation"])
        found = self._identities.get(key)
        if found is None:
            if len(self._identities) >= IDENTITY_CACHE:
                self._identities.clear()
            found = self._identities[key] = Identity(*key)
        return found

    def _on_request(self, params: dict[str, Any], frame: bytes = b"",
                    bad: str | None = None) -> None:
        svc = self._services.get(params["target"])
        req = Request(self, params, frame)
        if svc is None or svc.incarnation != req.service_incarnation:
            # Unregistered while the request was in flight: give the capability back.
            self._send_nowait("bus.release", {"deliveryId": req.delivery_id})
            self._queue_consumed(req.delivery_id)
            return
        if bad is not None:  # wire.md §22.3: no handler sees it
            self._refuse(req, InvalidParams(f"payload: {bad}", "not-dispatched"))
            return
        inline = svc.inline.get(req.method)
        if inline is not None:
            self._run_inline(inline, req)
            return
        task = self._loop.create_task(self._run_handler(svc, req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refuse(self, req: Request, error: BusError) -> None:
        """wire.md §22.3: a request whose payload breaks §3 is refused before any handler saw
        it; the caller's SDK raises `error` (INVALID_PARAMS, `not-dispatched`)."""
        # the message may quote the payload (a duplicated key): it goes to the caller only
        log.warning("bus.client.payload_refused", method=req.method, call_id=req.call_id,
                    error=error.name)
        self._reply_now(req, Reply({REFUSAL_KEY: error_object(error.name, error.message,
                                                              "not-dispatched")}))

    def _run_inline(self, handler: InlineHandler, req: Request) -> None:
        """wire.md §22.2: an inline handler runs here, on the reader, in arrival order; its
        reply joins the reader's next write. One that raises is released as a handler
        exception is (§17)."""
        try:
            outcome = handler(req)
        except Exception as exc:
            log.warning("bus.client.handler_failed", method=req.method, call_id=req.call_id,
                        error=type(exc).__name__)
            outcome = None
        if outcome is not None and not req.answered:
            self._reply_now(req, outcome if isinstance(outcome, Reply) else Reply(outcome),
                            inline=True)
        if not req.answered:
            req._answered = True
            self._send_nowait("bus.release", {"deliveryId": req.delivery_id})
            self._queue_consumed(req.delivery_id)

    def _reply_now(self, req: Request, reply: Reply, *, inline: bool = False) -> None:
        """Queue a reply without waiting for write credit (it answers a frame just read, as a
        credit does); a reply refused locally (too large) is released instead."""
        try:
            if self._encode_reply(req, reply, inline):
                return
        except InvalidEnvelope as exc:
            log.warning("bus.client.reply_refused", method=req.method, call_id=req.call_id,
                        error=exc.message)
            req._answered = True
            self._send_nowait("bus.release", {"deliveryId": req.delivery_id})
        self._queue_consumed(req.delivery_id)

    async def _run_handler(self, svc: Service, req: Request) -> None:
        consumed = False
        try:
            try:
                outcome = await svc.handler(req)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("bus.client.handler_failed", method=req.method, call_id=req.call_id,
                            error=type(exc).__name__)
                outcome = None
            if not req.answered:
                if outcome is not None:
                    reply = outcome if isinstance(outcome, Reply) else Reply(outcome)
                    if self._lean:
                        consumed = await self._send_reply(req, reply)
                    else:
                        # the credit leaves in the same write as the reply, right behind it
                        self._queue_consumed(req.delivery_id)
                        consumed = True
                        await self._send_reply(req, reply)
                if not req.answered:
                    await req.release()
        except RouterLost:
            return
        finally:
            if self._closed_with is None and not consumed:
                self._queue_consumed(req.delivery_id)

    def _reply_failed(self, params: dict[str, Any]) -> None:
        """A lean reply was refused (wire.md §21.4, §21.6): the frame changed nothing, so give
        the capability back (if still held, the caller hears CALL_GONE instead of nothing) and
        return the delivery its `consumed: true` did not."""
        delivery_id: str = params["deliveryId"]
        log.warning("bus.client.reply_refused", delivery_id=delivery_id,
                    error=params["error"]["data"]["name"], message=params["error"]["message"])
        self._send_nowait("bus.release", {"deliveryId": delivery_id})
        self._queue_consumed(delivery_id)

    async def _send_reply(self, req: Request, reply: Reply) -> bool:
        """Send the reply a handler returned without waiting for the router's answer: the
        task ends now instead of waking once more. Only a refusal as too large needs a
        follow-up (a release): the answer's callback, or a `bus.replyFailed`, does it.
        Returns True when the reply also returned the delivery (lean `consumed: true`)."""
        self._check_open()
        if self._drained is not None and not self._drained.done():
            await self._drained
            self._check_open()
        try:
            return self._encode_reply(req, reply)
        except InvalidEnvelope as exc:
            log.warning("bus.client.reply_refused", method=req.method, call_id=req.call_id,
                        error=exc.message)
            return False

    def _encode_reply(self, req: Request, reply: Reply, inline: bool = False) -> bool:
        """Queue `bus.reply` for `reply` (InvalidEnvelope, nothing sent, when it cannot be
        encoded or is too large); True when it also returned the delivery (lean
        `consumed: true`). The outcome goes last, for the router's split (wire.md §22.1)."""
        params: dict[str, Any] = {"deliveryId": req.delivery_id}
        if reply.attachments:
            params["attachments"] = artifact_ids(reply.attachments)
            params["transfer"] = reply.transfer
        if self._lean:
            params["consumed"] = True
            if inline and self._minor >= 3:
                params["inline"] = True
            # only the handler's outcome needs the strict encoder; the router issued the
            # delivery id (a checked string)
            params["outcome"] = orjson.Fragment(codec.encode(reply.outcome))
            self._write(codec.encode_trusted(
                {"jsonrpc": "2.0", "method": "bus.reply", "params": params}, self._max_envelope))
            req._answered = True
            return True
        params["outcome"] = reply.outcome
        fut = self._send_nowait("bus.reply", params)
        req._answered = True
        fut.add_done_callback(lambda f: self._reply_answered(req, f))
        return False

    def _reply_answered(self, req: Request, fut: asyncio.Future[dict[str, Any]]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if isinstance(exc, InvalidEnvelope) and self._closed_with is None:
            # the router refused the reply (its bus.result would be too large) and kept the
            # capability: give it back so the caller hears CALL_GONE instead of nothing
            log.warning("bus.client.reply_refused", method=req.method, call_id=req.call_id,
                        error=exc.message)
            self._send_nowait("bus.release", {"deliveryId": req.delivery_id})

    def _finish_cancelled(self, state: _CallState, cancel_state: str) -> None:
        self._calls.pop(state.call_id, None)
        dispatch = _CERTAINTY.get(cancel_state, "unknown")
        _settle(state.done, CallGone(f"call {state.call_id} cancelled ({cancel_state})",
                                     dispatch))  # type: ignore[arg-type]

    def _task_cancel_answered(self, state: _CallState,
                              fut: asyncio.Future[dict[str, Any]]) -> None:
        """A cancelled `call()` task's best-effort cancel was answered: forget the call
        unless its result is still due (`completed`; the result is consumed on arrival)."""
        if fut.cancelled() or fut.exception() is not None:
            return
        cancel_state: str = fut.result()["state"]
        if cancel_state != "completed":
            self._finish_cancelled(state, cancel_state)

    # API ---------------------------------------------------------------------------------
    async def register(self, name: str, handler: Handler, *, max_queued: int = 16,
                       max_in_flight: int = 4,
                       inline: Mapping[str, InlineHandler] | None = None) -> Service:
        """Register `name`. `inline` maps methods to handlers that complete without awaiting
        (wire.md §22.2): they run on the reader, no task per request."""
        ids: list[int] = []
        binding = (handler, dict(inline or {}))

        def bind(rid: int) -> None:
            ids.append(rid)
            self._registering[rid] = binding

        try:
            result = await self._command("bus.register", {
                "name": name, "maxQueued": max_queued, "maxInFlight": max_in_flight},
                on_id=bind)
        finally:
            for rid in ids:
                self._registering.pop(rid, None)
        return self._services[result["name"]]

    def _admit(self, target: str, method: str, payload: dict[str, Any] | bytes,
               expected_incarnation: str | None, *, lean: bool = False,
               attachments: tuple[str, ...] = (), transfer: bool = False,
               keep: bool = True) -> _CallState:
        """Send a `bus.call`: the request form (an admission response follows), or with
        `lean` the notification form, whose only answer is the outcome (wire.md §21.2)."""
        self._check_open()
        rid = self._next_id + 1
        body = self._encode_call(rid, target, method, payload, expected_incarnation, lean,
                                 attachments, transfer)
        self._next_id = rid
        state = _CallState(self._loop, rid, not lean)
        state.keep = keep
        if not lean:
            fut: asyncio.Future[dict[str, Any]] = self._loop.create_future()
            fut.add_done_callback(lambda f: self._admission_failed(state, f))
            self._pending.append((rid, "bus.call", fut))
        self._calls[rid] = state
        self._write(body)
        return state

    def _admission_failed(self, state: _CallState, fut: asyncio.Future[dict[str, Any]]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:
            self._calls.pop(state.call_id, None)
            _settle(state.admitted, exc)
            _deliver(state, exc)

    async def start_call(self, target: str, method: str, payload: dict[str, Any] | bytes, *,
                         expected_incarnation: str | None = None) -> PendingCall:
        """Admit a call and return its handle (raises the refusal's BusError)."""
        if self._drained is not None and not self._drained.done():
            await self._drained
        state = self._admit(target, method, payload, expected_incarnation)
        assert state.admitted is not None
        await state.admitted
        return PendingCall(self, state)

    async def call(self, target: str, method: str, payload: dict[str, Any] | bytes, *,
                   timeout: float | None,  # noqa: ASYNC109 - the SDK contract (wire.md §17)
                   expected_incarnation: str | None = None,
                   attachments: tuple[AttachmentRef, ...] = (), transfer: bool = False,
                   keep_attachments: bool = True) -> CallResult:
        """One call with a required deadline (seconds, or None for none). The deadline
        covers the whole call, a wait for write credit included, so with a deadline `call`
        returns or raises within `timeout` plus one cancel exchange (CANCEL_WAIT_S). A
        result's attachments are retained before its credit leaves unless `keep_attachments`
        is False (docs/topics.md §12); the caller drops them."""
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be > 0 seconds, or None")
        deadline = None if timeout is None else self._loop.time() + timeout
        if self._drained is not None and not self._drained.done():
            await self._drain_until(self._drained, deadline)
        state = self._admit(target, method, payload, expected_incarnation, lean=self._lean,
                            attachments=tuple(artifact_ids(attachments)), transfer=transfer,
                            keep=keep_attachments)
        # One plain loop timer, not asyncio.timeout: that one also cancels and uncancels the
        # task and, on Python 3.11, calls getpid() through get_running_loop() on every call.
        timer = None if deadline is None else self._loop.call_at(deadline, _expire, state)
        try:
            # `done` also settles on a refused admission: not waking up for the
            # admission response saves a task step per call
            return await state.done
        except _DeadlineReached:
            return await self._deadline(state)
        except asyncio.CancelledError:
            finished = state.done.done() and not state.done.cancelled()
            if not finished and self._closed_with is None:
                fut = self._send_nowait("bus.cancel", {"callId": state.call_id})
                fut.add_done_callback(lambda f: self._task_cancel_answered(state, f))
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def _drain_until(self, drained: asyncio.Future[None], deadline: float | None) -> None:
        """Wait for write credit until the call's deadline. Nothing of the call was sent, so
        a deadline here is certainly `not-dispatched`. `drained` is shared by every waiter and
        is never cancelled by one."""
        if deadline is None:
            await drained
            return
        await asyncio.wait((drained,), timeout=max(0.0, deadline - self._loop.time()))
        if not drained.done():
            raise CallDeadlineExceeded("deadline while waiting for write credit; nothing was "
                                       "sent", "not-dispatched")
        drained.result()  # a lost connection raises its RouterLost

    async def _deadline(self, state: _CallState) -> CallResult:
        if state.done.cancelled():
            state.done = self._loop.create_future()
        elif state.done.done():
            return state.done.result()
        self._check_open()
        fut = self._send_nowait("bus.cancel", {"callId": state.call_id})
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                cancel_state: str = (await fut)["state"]
        except (TimeoutError, BusError):
            self._calls.pop(state.call_id, None)
            raise CallDeadlineExceeded(f"call {state.call_id}: deadline; no cancel answer",
                                       "unknown") from None
        if cancel_state == "completed":
            return await asyncio.shield(state.done)
        if cancel_state == "call-gone" and state.done.done():
            return state.done.result()
        self._calls.pop(state.call_id, None)
        dispatch = _CERTAINTY.get(cancel_state, "unknown")
        exc = CallDeadlineExceeded(f"call {state.call_id}: deadline ({cancel_state})",
                                   dispatch, cancel_state)  # type: ignore[arg-type]
        _settle(state.done, exc)
        raise exc

    async def services(self, prefix: str = "") -> list[dict[str, Any]]:
        result = await self._command("bus.services", {"prefix": prefix})
        services: list[dict[str, Any]] = result["services"]
        return services

    async def stats(self, detail: bool = False) -> dict[str, Any]:
        return await self._command("bus.stats", {"detail": detail})

    async def expect(self, client_id: str, pid: int, *, client_incarnation: str | None = None,
                     ttl: float = 30.0, grants: dict[str, list[str]] | None = None) -> float:
        """Pre-bind client_id to pid (launcher); returns the expiry in seconds."""
        result = await self._command("bus.expect", {
            "clientId": client_id, "pid": pid, "clientIncarnation": client_incarnation,
            "ttlMs": max(1, int(ttl * 1000)), "grants": grants})
        return float(result["expiresInMs"]) / 1000.0

    # topics (docs/topics.md §12) ------------------------------------------------------------
    def _need_minor(self, minor: int, method: str) -> None:
        """An op of a later minor against an older router fails locally, nothing sent."""
        if self._minor < minor:
            raise MethodNotFound(f"{method} needs bus minor {minor}; the router speaks "
                                 f"minor {self._minor}")

    async def declare(self, topic: str, *, retain: bool = False, max_bounded: int = 0) -> Topic:
        self._need_minor(2, "bus.declare")
        result = await self._command("bus.declare", {"topic": topic, "retain": retain,
                                                     "maxBounded": max_bounded})
        return Topic(self, result["topic"], result["topicIncarnation"])

    async def publish(self, topic: str, payload: dict[str, Any], *,
                      expected_incarnation: str | None = None,
                      attachments: tuple[AttachmentRef, ...] = (),
                      transfer: bool = False) -> PublishResult:
        """The request form: the result says which sequence the message got."""
        self._need_minor(2, "bus.publish")
        params: dict[str, Any] = {"topic": topic, "expectedIncarnation": expected_incarnation,
                                  "payload": payload}
        if attachments:
            params["attachments"] = artifact_ids(attachments)
            params["transfer"] = transfer
        result = await self._command("bus.publish", params)
        return PublishResult(result["topic"], result["topicIncarnation"], result["sequence"],
                             result["latest"], result["bounded"])

    def publish_nowait(self, topic: str, payload: dict[str, Any], *,
                       expected_incarnation: str | None = None,
                       attachments: tuple[AttachmentRef, ...] = (),
                       transfer: bool = False, linger: bool = False) -> None:
        """The notification form: one frame, no answer on success; a refusal reaches the
        `on_publish_failed` hook. Never waits for the transport to drain.

        `linger`: the frame may wait up to LINGER_S for the next frame of this connection
        and leave in its write (a publisher that sends calls right after, as a lockstep
        coordinator does, then costs no write and no router wake-up of its own)."""
        self._check_open()
        self._need_minor(2, "bus.publish")
        params: dict[str, Any] = {"topic": topic, "expectedIncarnation": expected_incarnation,
                                  "payload": payload}
        if attachments:
            params["attachments"] = artifact_ids(attachments)
            params["transfer"] = transfer
        self._notify("bus.publish", params, linger)

    async def subscribe(self, topic: str, *, mode: str = "latest", window: int = 1,
                        depth: int | None = None, retained: bool = True) -> Subscription:
        self._need_minor(2, "bus.subscribe")
        params: dict[str, Any] = {"topic": topic, "mode": mode, "window": window,
                                  "retained": retained}
        if depth is not None:
            params["depth"] = depth
        ids: list[int] = []
        try:
            await self._command("bus.subscribe", params, on_id=ids.append)
        finally:
            sub = self._subscribing.pop(ids[0], None) if ids else None
        assert sub is not None, "a subscribe result binds its subscription"
        return sub

    async def topics(self, prefix: str = "") -> list[dict[str, Any]]:
        self._need_minor(2, "bus.topics")
        result = await self._command("bus.topics", {"prefix": prefix})
        topics: list[dict[str, Any]] = result["topics"]
        return topics

    def _on_message(self, params: dict[str, Any]) -> None:
        sub = self._subscriptions.get(params["topicIncarnation"])
        if sub is None or not sub._active:  # left already: nobody will read it
            self._queue_consumed(params["deliveryId"])
            return
        sub._deliver(Message(params["topic"], params["topicIncarnation"], params["sequence"],
                             params["skipped"], self._identity(params["publisher"]),
                             params["payload"], params["deliveryId"],
                             self._attachments(params), self))

    def _on_topic_removed(self, params: dict[str, Any]) -> None:
        sub = self._subscriptions.pop(params["topicIncarnation"], None)
        if sub is not None:
            sub._removed(params["reason"])

    def _publish_failed(self, params: dict[str, Any]) -> None:
        hook = self._on_publish_failed
        if hook is None:
            log.warning("bus.client.publish_failed", topic=params["topic"],
                        error=params["error"]["data"]["name"])
            return
        try:
            hook(params["topic"], from_wire(params["error"]))
        except Exception:
            log.exception("bus.client.publish_failed_hook_failed")

    # the artifact store (docs/topics.md §5, §12) --------------------------------------------
    def _store_fd(self) -> int:
        self._check_open()
        if self._store_dir < 0:
            raise StoreFailure("the router offers no store to this client" if self.store is None
                               else f"the store directory {self.store['path']} could not be "
                               "opened")
        return self._store_dir

    async def allocate(self, length: int) -> Allocation:
        """`bus.allocate`: an Allocated artifact of `length` bytes, held by this client."""
        self._need_minor(2, "bus.allocate")
        self._check_open()
        result = await self._command("bus.allocate", {"length": length})
        return Allocation(self, result["artifactId"], result["length"])

    def open_artifact(self, attachment: Attachment) -> memoryview:
        """A read-only view of an artifact this client can see (a private copy up to 1 MiB, a
        mapping above); it stays readable after the artifact is collected or the connection is
        lost. ArtifactGone / ArtifactMismatch (SDK-local, `not-dispatched`) when the file is
        gone or not the sealed one."""
        return read_sealed(self._store_fd(), attachment.artifact_id, attachment.length)

    async def retain(self, artifact_ids: list[str]) -> list[Attachment]:
        """`bus.retain`: hold artifacts this client can see (all or nothing)."""
        self._need_minor(2, "bus.retain")
        result = await self._command("bus.retain", {"artifactIds": list(artifact_ids)})
        return [self._attachment(a) for a in result["artifacts"]]

    async def drop(self, artifact_ids: list[str]) -> int:
        """`bus.drop`: end this client's holds; returns how many ended."""
        self._need_minor(2, "bus.drop")
        result = await self._command("bus.drop", {"artifactIds": list(artifact_ids)})
        return int(result["dropped"])

    def drop_nowait(self, artifact_ids: list[str]) -> None:
        """`bus.drop` pipelined: sent now, its answer never awaited. `bus.drop` fails only on
        params, so nothing is lost by not waiting; a closed connection dropped every hold
        already (docs/topics.md §11 step 9), so it is a no-op then."""
        if not artifact_ids or self.closed:
            return
        self._need_minor(2, "bus.drop")
        for start in range(0, len(artifact_ids), MAX_DROP_IDS):
            fut = self._send_nowait("bus.drop",
                                    {"artifactIds": artifact_ids[start:start + MAX_DROP_IDS]})
            fut.add_done_callback(_ignore_outcome)

    # hello -------------------------------------------------------------------------------
    async def _hello(self, supported_majors: tuple[int, ...]) -> None:
        result = await self._command("bus.hello", {
            "clientId": self.client_id, "clientIncarnation": self.client_incarnation,
            "supportedMajors": list(supported_majors)})
        if result["major"] != 1:
            raise VersionMismatch(f"router speaks {result['major']}.{result['minor']}, not 1.x")
        if result["contractDigest"] != contract_digest():
            raise VersionMismatch("the router's contractDigest differs from this SDK's schemas")
        if set(result["limits"]) != hello_keys(result["minor"]):
            raise VersionMismatch("the router's limits keys differ from this SDK's")
        self.router_id = result["routerId"]
        self.connection_id = result["connectionId"]
        self.limits = result["limits"]
        self.grants = result["grants"]
        self._max_envelope = self.limits["maxEnvelopeBytes"]
        self._decoder = _rebound(self._decoder, self._max_envelope)
        self._lean = result["minor"] >= 1
        self._minor = result["minor"]
        self.store = result.get("store")
        if self.store is not None:
            try:
                self._store_dir = open_store_dir(self.store["path"])
            except StoreFailure as exc:
                # calls and topics work without it; store calls will say why they cannot
                log.warning("bus.client.store_unavailable", client_id=self.client_id,
                            error=exc.message)


def _rebound(decoder: FrameDecoder, max_bytes: int) -> FrameDecoder:
    """The hello told us maxEnvelopeBytes; router frames above it are violations from now."""
    fresh = FrameDecoder(max_bytes)
    fresh.feed(decoder.take_buffer())
    return fresh


async def _open_transport(loop: asyncio.AbstractEventLoop, client: BusClient,
                          path: str) -> asyncio.Transport:
    """Connect, trying again while the router's listen backlog is full (EAGAIN): a burst of
    connects is a wait for the accept loop, not a refusal. The caller's timeout bounds it."""
    pause = CONNECT_RETRY_FIRST_S
    while True:
        try:
            transport, _ = await loop.create_unix_connection(lambda: _Protocol(client), path)
        except BlockingIOError:
            await asyncio.sleep(pause)
            pause = min(pause * 2, CONNECT_RETRY_MAX_S)
            continue
        return transport


class _Connect:
    """`connect(...)` is both awaitable (-> BusClient) and an async context manager."""

    def __init__(self, path: str, client_id: str, client_incarnation: str | None,
                 supported_majors: tuple[int, ...], timeout: float | None,
                 on_route_removed: RouteRemovedHook | None,
                 on_publish_failed: PublishFailedHook | None = None,
                 socket_gid: int | None = None) -> None:
        self._args = (path, client_id, client_incarnation, supported_majors, timeout,
                      on_route_removed)
        self._on_publish_failed = on_publish_failed
        self._socket_gid = socket_gid
        self._client: BusClient | None = None

    async def _open(self) -> BusClient:
        path, client_id, incarnation, majors, timeout, hook = self._args
        # wire.md §13: a socket in a directory another user controls may be an impostor's
        check_socket_dir(path, Trust.client(self._socket_gid))
        loop = asyncio.get_running_loop()
        client = BusClient(path, client_id, incarnation or new_incarnation(), hook,
                           self._on_publish_failed)
        try:
            async with asyncio.timeout(timeout):
                transport = await _open_transport(loop, client, path)
                client._transport = transport
                await client._hello(majors)
        except TimeoutError:
            await client.close()
            raise RouterLost(f"connect to {path} timed out") from None
        except (OSError, BusError) as exc:
            await client.close()
            if isinstance(exc, OSError):
                raise RouterLost(f"cannot connect to {path}: {exc.strerror or exc}") from exc
            raise
        return client

    def __await__(self) -> Generator[Any, None, BusClient]:
        return self._open().__await__()

    async def __aenter__(self) -> BusClient:
        self._client = await self._open()
        return self._client

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: types.TracebackType | None) -> None:
        if self._client is not None:
            await self._client.close()


def connect(path: str, *, client_id: str, client_incarnation: str | None = None,
            supported_majors: tuple[int, ...] = (1,), timeout: float | None = 5.0,
            on_route_removed: RouteRemovedHook | None = None,
            on_publish_failed: PublishFailedHook | None = None,
            socket_gid: int | None = None) -> _Connect:
    """Open a connection and complete `bus.hello` (wire.md §17). The socket's directory must be
    one no other user controls (`bus.ownership.Trust.client`; `socket_gid` is the configured
    `[bus] socket_group`), else `UnsafeDirectory` (NOT_AUTHORIZED) before any connect."""
    return _Connect(path, client_id, client_incarnation, tuple(supported_majors), timeout,
                    on_route_removed, on_publish_failed, socket_gid)
