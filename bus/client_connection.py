"""One client connection to the router (design/wire.md §17): the asyncio protocol, `bus.hello`, the
frames out and in, the table of requests awaiting their responses, and the connection's end.

It applies the same strict rules to the router's frames as the router applies to ours
(design/wire.md §2–§4): any violation, EOF, `bus.closing` or a local close fails everything pending
with RouterLost (`unknown`), because after a lost connection nothing is known about what ran.

Frames out: frames queued in one loop turn leave in one write (fewer wake-ups on both sides); a
lingering one may wait up to LINGER_S for another frame's write; returned delivery credits leave
with the next write, batched. Frames in: every frame of a read is handled before the flush they
ask for, so the frames of the tasks they woke leave in one write.

The client's parts (bus/client.py puts them together: calls, serving, topics, artifacts) use
only this module's public interface: they send with `command`, `send_nowait`,
`send_notification` or a frame they encoded (`send_request`, `send_numbered`), take the
notifications they own with `on`, return credits with `return_credit`, and hear of the end
through `on_lost`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, cast

import structlog

from bus import codec
from bus.errors import BusError, MethodNotFound, RouterLost, VersionMismatch, from_wire
from bus.framing import PREFIX, FrameDecoder
from bus.limits import MAX_CONSUME_BATCH, hello_keys
from bus.schema import NOTIFICATIONS, OPS, Validator, contract_digest, validator

log = structlog.get_logger("bus.client")

# A lingering frame waits at most this long for another frame to share its write.
LINGER_S: Final = 0.002
# A full listen backlog refuses connect with EAGAIN; the SDK tries again within its timeout,
# waiting a little longer each time up to the cap.
CONNECT_RETRY_FIRST_S: Final = 0.005
CONNECT_RETRY_MAX_S: Final = 0.1
#: the notifications whose body the router forwards only checked for being well-formed
#: (design/wire.md §22.1): a body breaking design/wire.md §3 inside one is that call's fault, not
#: the router's
FORWARDED: Final = frozenset({"bus.result", "bus.request"})
_FIRST_MAX_ENVELOPE: Final = 16777216

#: what a part is given for a notification it took with `on`: the params, the frame they came
#: in, and why the frame's body breaks design/wire.md §3 (None when it does not; only for FORWARDED
#: ones)
NotificationHandler = Callable[[dict[str, Any], bytes, "str | None"], None]
#: run on a request's result as it is read, before the awaiting task resumes (a request or a
#: message it announces may follow in the same read)
ResultHook = Callable[[dict[str, Any]], None]
LostHook = Callable[[RouterLost], None]


def settle(fut: asyncio.Future[Any] | None, exc: BaseException | None = None,
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


def ignore_outcome(fut: asyncio.Future[Any]) -> None:
    """Retrieve a pipelined command's outcome so an error is not reported as never retrieved."""
    if not fut.cancelled():
        fut.exception()


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


@dataclass(frozen=True, slots=True)
class Hello:
    """What the router said of itself and of us in `bus.hello`."""

    router_id: str
    connection_id: str
    limits: dict[str, int]
    grants: dict[str, list[str]]
    store: dict[str, str] | None  # topics.md §5.1


class Connection(asyncio.Protocol):
    """One connection and its event loop; `open_transport` connects it."""

    def __init__(self, client_id: str) -> None:
        self.client_id = client_id
        self.loop = asyncio.get_running_loop()
        #: what the hello set: the router's minor (design/wire.md §21.1: >= 1 is lean) and the
        #: largest frame either side may send
        self.minor = 0
        self.lean = False
        self.max_envelope = _FIRST_MAX_ENVELOPE
        #: transport writes made: frames queued in one loop turn leave in one write
        self.writes = 0
        self._transport: asyncio.Transport | None = None
        self._decoder = FrameDecoder(_FIRST_MAX_ENVELOPE)
        self._v = Validators.get()
        self._next_id = 0
        self._pending: deque[tuple[int, str, asyncio.Future[dict[str, Any]],
                                   ResultHook | None]] = deque()
        self._handlers: dict[str, NotificationHandler] = {
            "bus.closing": lambda params, _frame, _bad: self.lose(from_wire(params["error"]))}
        self._lost_hooks: list[LostHook] = []
        self._consume: list[str] = []  # credits that leave at the next flush
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._linger_timer: asyncio.TimerHandle | None = None
        self._reading = False
        self._flush_after_read = False
        #: the frame `_on_notification` is handling, and why its body breaks design/wire.md §3
        #: (design/wire.md §22.1)
        self._frame = b""
        self._bad_body: str | None = None
        self._drained: asyncio.Future[None] | None = None
        self._closed_with: BaseException | None = None
        self._closed = self.loop.create_future()

    # the protocol ---------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
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

    def eof_received(self) -> bool:
        self.lose(RouterLost("the router closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lose(RouterLost("the router connection was lost" + (f": {exc}" if exc else "")))

    def pause_writing(self) -> None:
        if self._drained is None or self._drained.done():
            self._drained = self.loop.create_future()

    def resume_writing(self) -> None:
        if self._drained is not None:
            settle(self._drained)

    # the parts' interface -------------------------------------------------------------------
    def on(self, method: str, handler: NotificationHandler) -> None:
        """Route the notification `method` to `handler` (one part owns each)."""
        self._handlers[method] = handler

    def on_lost(self, hook: LostHook) -> None:
        """Call `hook` once when the connection ends, in the order the hooks were given."""
        self._lost_hooks.append(hook)

    @property
    def closed(self) -> bool:
        return self._closed_with is not None

    def check_open(self) -> None:
        if self._closed_with is not None:
            raise RouterLost("the connection is closed")

    def need_minor(self, minor: int, method: str) -> None:
        """An op of a later minor against an older router fails locally, nothing sent."""
        if self.minor < minor:
            raise MethodNotFound(f"{method} needs bus minor {minor}; the router speaks "
                                 f"minor {self.minor}")

    @property
    def drained(self) -> asyncio.Future[None] | None:
        """While the transport holds too many unsent bytes, the future that settles when it
        takes writes again (shared by every waiter: never cancel it); else None."""
        drained = self._drained
        return drained if drained is not None and not drained.done() else None

    async def hello(self, client_id: str, client_incarnation: str,
                    supported_majors: tuple[int, ...]) -> Hello:
        result = await self.command("bus.hello", {
            "clientId": client_id, "clientIncarnation": client_incarnation,
            "supportedMajors": list(supported_majors)})
        if result["major"] != 1:
            raise VersionMismatch(f"router speaks {result['major']}.{result['minor']}, not 1.x")
        if result["contractDigest"] != contract_digest():
            raise VersionMismatch("the router's contractDigest differs from this SDK's schemas")
        if set(result["limits"]) != hello_keys(result["minor"]):
            raise VersionMismatch("the router's limits keys differ from this SDK's")
        hello = Hello(result["routerId"], result["connectionId"], result["limits"],
                      result["grants"], result.get("store"))
        self.max_envelope = hello.limits["maxEnvelopeBytes"]
        # router frames above it are violations from now
        decoder = FrameDecoder(self.max_envelope)
        decoder.feed(self._decoder.take_buffer())
        self._decoder = decoder
        self.lean = result["minor"] >= 1
        self.minor = result["minor"]
        return hello

    async def wait_closed(self) -> BusError | None:
        """The closing BusError, RouterLost for EOF, or None after a local close."""
        await asyncio.shield(self._closed)
        result: BusError | None = self._closed.result()
        return result

    def lose(self, error: BusError | None) -> None:
        """End the connection (None: closed locally); everything pending fails RouterLost."""
        if self._closed_with is not None:
            return
        self._closed_with = error or RouterLost("the connection was closed locally")
        failure = error if isinstance(error, RouterLost) else RouterLost(
            error.message if error is not None else "the connection was closed locally")
        failure.dispatch = "unknown"
        if self._transport is not None:
            self._transport.abort()
        while self._pending:
            fut = self._pending.popleft()[2]
            settle(fut, RouterLost(failure.message))
        # before the parts' hooks: one that cancels a task must not cancel this shared future
        if self._drained is not None:
            settle(self._drained, RouterLost(failure.message))
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        for hook in self._lost_hooks:
            hook(failure)
        settle(self._closed, value=error)

    # frames out -----------------------------------------------------------------------------
    def flush(self) -> None:
        """Write every queued frame now, lingering ones included."""
        if self._out and self._closed_with is None:
            self._flush()

    async def command(self, method: str, params: dict[str, Any], *, wait_drain: bool = True,
                      on_result: ResultHook | None = None) -> dict[str, Any]:
        """A request and its result (its error raised as a BusError)."""
        self.check_open()
        if wait_drain and self._drained is not None and not self._drained.done():
            await self._drained
            self.check_open()
        return await self.send_nowait(method, params, on_result)

    def send_nowait(self, method: str, params: dict[str, Any],
                    on_result: ResultHook | None = None) -> asyncio.Future[dict[str, Any]]:
        """A request that never waits for the transport to drain (a credit-returning one, or
        one answering a frame just read); the future of its result."""
        rid = self._next_id + 1
        body = codec.encode({"jsonrpc": "2.0", "id": rid, "method": method, "params": params},
                            self.max_envelope)
        return self.send_request(rid, method, body, on_result)

    @property
    def next_id(self) -> int:
        """The id the next request takes (an encoding that fails takes none)."""
        return self._next_id + 1

    def send_request(self, rid: int, method: str, body: bytes,
                     on_result: ResultHook | None = None) -> asyncio.Future[dict[str, Any]]:
        """Send a request the caller encoded with id `rid` (`next_id`); its result's future."""
        self._next_id = rid
        fut: asyncio.Future[dict[str, Any]] = self.loop.create_future()
        self._pending.append((rid, method, fut, on_result))
        self.write(body)
        return fut

    def send_numbered(self, rid: int, body: bytes) -> None:
        """Send a notification that took the id `rid` (`next_id`) for itself (a lean call's
        callId, design/wire.md §21.2): no response follows."""
        self._next_id = rid
        self.write(body)

    def send_notification(self, method: str, params: dict[str, Any],
                          linger: bool = False) -> None:
        """A lean notification (design/wire.md §21): no id, no response, never waits to drain.
        `linger`: it may wait up to LINGER_S for another frame's write: a frame queued
        meanwhile carries it, in order, so the two cost one write and one wake-up of the
        router instead of two."""
        body = codec.encode({"jsonrpc": "2.0", "method": method, "params": params},
                            self.max_envelope)
        self._out.append(PREFIX.pack(len(body)))
        self._out.append(body)
        if not linger:
            self._schedule_flush()
        elif not self._flush_scheduled and self._linger_timer is None:
            self._linger_timer = self.loop.call_later(LINGER_S, self._flush)

    def write(self, body: bytes) -> None:
        """Queue a frame; frames of one loop turn leave in one write (fewer wakeups)."""
        self._out.append(PREFIX.pack(len(body)))
        self._out.append(body)
        self._schedule_flush()

    def return_credit(self, *delivery_ids: str) -> None:
        """Consumed deliveries: their credits go out with the next flush, batched (at most
        MAX_CONSUME_BATCH per frame)."""
        self._consume.extend(delivery_ids)
        self._schedule_flush()

    def _schedule_flush(self) -> None:
        if self._reading:
            self._flush_after_read = True
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._closed_with is not None or self._transport is None:
            self._flush_scheduled = False
            return
        while self._consume:
            batch = self._consume[:MAX_CONSUME_BATCH]
            del self._consume[:MAX_CONSUME_BATCH]
            if self.lean:
                self.send_notification("bus.consumed", {"deliveryIds": batch})
            else:
                self.send_nowait("bus.consumed", {"deliveryIds": batch})
        self._flush_scheduled = False
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        out, self._out = self._out, []
        if out:
            self.writes += 1
            self._transport.write(b"".join(out))
            if self._transport.get_write_buffer_size() > 4 * self.max_envelope:
                self.lose(RouterLost("unsent bytes above 4 x maxEnvelopeBytes"))

    # frames in ------------------------------------------------------------------------------
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
                # design/wire.md §22.1: the router forwards bodies it only checked for being
                # well-formed, so a body may break design/wire.md §3 inside a sound frame: that
                # call's fault, not the router's
                split = split_body(body)
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

    def _on_response(self, msg: dict[str, Any]) -> None:
        problem = self._v.response(msg)
        if problem is not None:
            self._violation(f"response: {problem}")
            return
        if not self._pending or self._pending[0][0] != msg["id"]:
            self._violation(f"response id {msg['id']} is not the oldest outstanding request")
            return
        _, method, fut, on_result = self._pending.popleft()
        if "error" in msg:
            settle(fut, from_wire(msg["error"]))
            return
        result = msg["result"]
        problem = self._v.results[method](result)
        if problem is not None:
            self._violation(f"{method} result: {problem}")
            return
        if on_result is not None:
            on_result(result)
        settle(fut, value=result)

    def _on_notification(self, msg: dict[str, Any]) -> None:
        method: Any = msg.get("method")
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
        if bad is not None and method not in FORWARDED:
            # a published payload is held to design/wire.md §3 by the router
            self._violation(f"{method}: {bad}")
            return
        self._handlers[method](params, frame, bad)

    def _violation(self, message: str) -> None:
        log.warning("bus.client.protocol_violation", client_id=self.client_id, error=message)
        self.lose(RouterLost(f"router protocol violation: {message}"))


def split_body(frame: bytes) -> tuple[Any, str] | None:
    """A frame that is not strict JSON as a whole: (its envelope, why its body breaks
    design/wire.md §3) when the envelope is sound and only the body is at fault, else None."""
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


async def open_transport(connection: Connection, path: str) -> None:
    """Connect, trying again while the router's listen backlog is full (EAGAIN): a burst of
    connects is a wait for the accept loop, not a refusal. The caller's timeout bounds it."""
    pause = CONNECT_RETRY_FIRST_S
    while True:
        try:
            await connection.loop.create_unix_connection(lambda: connection, path)
        except BlockingIOError:
            await asyncio.sleep(pause)
            pause = min(pause * 2, CONNECT_RETRY_MAX_S)
            continue
        return
