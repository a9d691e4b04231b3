"""The client's services (design/wire.md §17): registrations, the requests the router delivers to
them, the handlers that answer them, and the replies.

Against a router of minor >= 1 (design/wire.md §21) a handler's returned reply uses the lean
notification form and returns its request delivery with it (`consumed: true`). A handler that
completes without awaiting may be inline (design/wire.md §22.2): it runs on the reader, no task.

Task ownership: every handler task is owned by this part, tracked in `_tasks` and cancelled and
awaited when the connection ends; the SDK starts no other tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson
import structlog

from bus import codec
from bus.client_artifacts import Artifacts, Attachment, AttachmentRef, artifact_ids
from bus.client_connection import Connection
from bus.client_identity import Identities, Identity
from bus.errors import BusError, InvalidEnvelope, InvalidParams, RouterLost, error_object

log = structlog.get_logger("bus.client")

# How long `close()` waits for cancelled handler tasks to end.
HANDLER_REAP_S: Final = 2.0
#: the outcome member a service SDK answers with when it refuses a request's payload itself
#: (design/wire.md §22.3): `{"bus.error": <error object>}`; the caller's SDK raises that error
REFUSAL_KEY: Final = "bus.error"

Handler = Callable[["Request"], Awaitable["dict[str, Any] | Reply | None"]]
#: a handler that completes without awaiting (design/wire.md §22.2): run on the reader, no task
InlineHandler = Callable[["Request"], "dict[str, Any] | Reply | None"]
RouteRemovedHook = Callable[[str, str, str], None]


@dataclass(frozen=True, slots=True)
class Reply:
    """A handler's outcome with attachments (topics.md §12); `transfer` hands the
    handler's holds on them to the result."""

    outcome: dict[str, Any]
    attachments: tuple[AttachmentRef, ...] = ()
    transfer: bool = False


class Request:
    """A `bus.request` delivered to one of our services; answer it once."""

    __slots__ = ("_frame", "_payload_bytes", "_serving", "answered", "attachments", "call_id",
                 "caller", "delivery_id", "method", "payload", "service_incarnation", "target")

    def __init__(self, serving: Serving, params: dict[str, Any], caller: Identity,
                 attachments: tuple[Attachment, ...], frame: bytes = b"") -> None:
        self._serving = serving
        self.delivery_id: str = params["deliveryId"]
        self.call_id: int = params["callId"]
        self.caller = caller
        self.target: str = params["target"]
        self.service_incarnation: str = params["serviceIncarnation"]
        self.method: str = params["method"]
        #: the value, decoded with design/wire.md §3's strictness; its wire bytes are
        #: `payload_bytes`
        self.payload: dict[str, Any] = params["payload"]
        self._frame = frame
        self._payload_bytes: bytes | None = None
        self.attachments = attachments
        #: a reply or a release was sent (the SDK's to set)
        self.answered = False

    @property
    def payload_bytes(self) -> bytes:
        """The payload exactly as the caller wrote it (design/wire.md §22.3: what a body digest
        hashes), found in the frame on first use."""
        if self._payload_bytes is None:
            found = codec.body_bytes(self._frame, "payload")
            self._payload_bytes = found if found is not None else codec.encode(self.payload)
        return self._payload_bytes

    async def retain(self, ids: list[str] | None = None) -> list[Attachment]:
        """Keep attachments (all by default) beyond the handler (topics.md §12)."""
        return await self._serving.artifacts.retain(
            ids if ids is not None else [a.artifact_id for a in self.attachments])

    async def reply(self, outcome: dict[str, Any], *,
                    attachments: tuple[AttachmentRef, ...] = (),
                    transfer: bool = False) -> bool:
        """Send the reply; True when routed to an attached caller."""
        params: dict[str, Any] = {"deliveryId": self.delivery_id}
        if attachments:
            params["attachments"] = artifact_ids(attachments)
            params["transfer"] = transfer
        params["outcome"] = outcome  # last: the router's split (design/wire.md §22.1)
        result = await self._serving.connection.command("bus.reply", params)
        self.answered = True
        return bool(result["routed"])

    async def release(self) -> bool:
        """Give up the reply capability (the caller gets CALL_GONE `dispatched`)."""
        self.answered = True
        result = await self._serving.connection.command(
            "bus.release", {"deliveryId": self.delivery_id}, wait_drain=False
        )
        return bool(result["released"])


class Service:
    """A registration; as an async context manager it unregisters on exit."""

    def __init__(self, serving: Serving, name: str, incarnation: str, handler: Handler,
                 inline: Mapping[str, InlineHandler] | None = None) -> None:
        self._serving = serving
        self.name = name
        self.incarnation = incarnation
        self.handler = handler
        self.inline: Mapping[str, InlineHandler] = inline or {}

    async def unregister(self) -> bool:
        return await self._serving.unregister(self)

    async def __aenter__(self) -> Service:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._serving.connection.closed:
            with contextlib.suppress(RouterLost):
                await self.unregister()


class Serving:
    """The services of one connection: `bus.register` out, `bus.request` and the replies'
    fate (`bus.replyFailed`, `bus.routeRemoved`) in."""

    def __init__(self, connection: Connection, artifacts: Artifacts, identities: Identities,
                 on_route_removed: RouteRemovedHook | None) -> None:
        self.connection = connection
        self.artifacts = artifacts
        self._identities = identities
        self._on_route_removed = on_route_removed
        self._services: dict[str, Service] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        connection.on("bus.request", self._on_request)
        connection.on("bus.replyFailed", self._reply_failed)
        connection.on("bus.routeRemoved", self._route_removed)
        connection.on_lost(self._lost)

    async def register(self, name: str, handler: Handler, *, max_queued: int = 16,
                       max_in_flight: int = 4,
                       inline: Mapping[str, InlineHandler] | None = None) -> Service:
        waiting = True
        binding = (handler, dict(inline or {}))

        def bind(result: dict[str, Any]) -> None:
            # Bind the handler now: a request may follow in the same read, before the
            # awaiting register() resumes.
            if waiting:
                self._services[result["name"]] = Service(
                    self, result["name"], result["serviceIncarnation"], *binding)

        try:
            result = await self.connection.command("bus.register", {
                "name": name, "maxQueued": max_queued, "maxInFlight": max_in_flight},
                on_result=bind)
        finally:
            waiting = False
        return self._services[result["name"]]

    async def unregister(self, service: Service) -> bool:
        self._services.pop(service.name, None)
        result = await self.connection.command(
            "bus.unregister", {"name": service.name, "serviceIncarnation": service.incarnation})
        return bool(result["removed"])

    async def reap_tasks(self) -> None:
        """Cancel the handler tasks and wait for them, at most HANDLER_REAP_S: a handler that
        swallows its cancellation must not hold `close()` forever. One still running is left
        in `_tasks` (this part keeps owning it) and logged."""
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        if tasks:
            done, stuck = await asyncio.wait(tasks, timeout=HANDLER_REAP_S)
            for t in done:
                if not t.cancelled():
                    t.exception()  # retrieved: the handler's own failure was logged already
            if stuck:
                log.warning("bus.client.handlers_ignore_cancel",
                            client_id=self.connection.client_id, handlers=len(stuck),
                            waited_s=HANDLER_REAP_S)

    def _on_request(self, params: dict[str, Any], frame: bytes, bad: str | None) -> None:
        svc = self._services.get(params["target"])
        req = Request(self, params, self._identities.get(params["caller"]),
                      self.artifacts.attachments(params), frame)
        if svc is None or svc.incarnation != req.service_incarnation:
            # Unregistered while the request was in flight: give the capability back.
            self._release_now(req.delivery_id)
            return
        if bad is not None:  # design/wire.md §22.3: no handler sees it
            self._refuse(req, InvalidParams(f"payload: {bad}", "not-dispatched"))
            return
        inline = svc.inline.get(req.method)
        if inline is not None:
            self._run_inline(inline, req)
            return
        task = self.connection.loop.create_task(self._run_handler(svc, req))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _release_now(self, delivery_id: str) -> None:
        """Give the reply capability back and return the delivery, without waiting."""
        self.connection.send_nowait("bus.release", {"deliveryId": delivery_id})
        self.connection.return_credit(delivery_id)

    def _refuse(self, req: Request, error: BusError) -> None:
        """design/wire.md §22.3: a request whose payload breaks design/wire.md §3 is refused before
        any handler saw it; the caller's SDK raises `error` (INVALID_PARAMS, `not-dispatched`)."""
        # the message may quote the payload (a duplicated key): it goes to the caller only
        log.warning("bus.client.payload_refused", method=req.method, call_id=req.call_id,
                    error=error.name)
        self._reply_now(req, Reply({REFUSAL_KEY: error_object(error.name, error.message,
                                                              "not-dispatched")}))

    def _run_inline(self, handler: InlineHandler, req: Request) -> None:
        """design/wire.md §22.2: an inline handler runs here, on the reader, in arrival order; its
        reply joins the reader's next write. One that raises is released as a handler
        exception is (design/wire.md §17)."""
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
            req.answered = True
            self._release_now(req.delivery_id)

    def _reply_now(self, req: Request, reply: Reply, *, inline: bool = False) -> None:
        """Queue a reply without waiting for write credit (it answers a frame just read, as a
        credit does); a reply refused locally (too large) is released instead."""
        try:
            if self._encode_reply(req, reply, inline):
                return
        except InvalidEnvelope as exc:
            log.warning("bus.client.reply_refused", method=req.method, call_id=req.call_id,
                        error=exc.message)
            req.answered = True
            self.connection.send_nowait("bus.release", {"deliveryId": req.delivery_id})
        self.connection.return_credit(req.delivery_id)

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
                    if self.connection.lean:
                        consumed = await self._send_reply(req, reply)
                    else:
                        # the credit leaves in the same write as the reply, right behind it
                        self.connection.return_credit(req.delivery_id)
                        consumed = True
                        await self._send_reply(req, reply)
                if not req.answered:
                    await req.release()
        except RouterLost:
            return
        finally:
            if not self.connection.closed and not consumed:
                self.connection.return_credit(req.delivery_id)

    def _reply_failed(self, params: dict[str, Any], _frame: bytes, _bad: str | None) -> None:
        """A lean reply was refused (design/wire.md §21.4, §21.6): the frame changed nothing, so
        give the capability back (if still held, the caller hears CALL_GONE instead of nothing) and
        return the delivery its `consumed: true` did not."""
        delivery_id: str = params["deliveryId"]
        log.warning("bus.client.reply_refused", delivery_id=delivery_id,
                    error=params["error"]["data"]["name"], message=params["error"]["message"])
        self._release_now(delivery_id)

    async def _send_reply(self, req: Request, reply: Reply) -> bool:
        """Send the reply a handler returned without waiting for the router's answer: the
        task ends now instead of waking once more. Only a refusal as too large needs a
        follow-up (a release): the answer's callback, or a `bus.replyFailed`, does it.
        Returns True when the reply also returned the delivery (lean `consumed: true`)."""
        self.connection.check_open()
        drained = self.connection.drained
        if drained is not None:
            await drained
            self.connection.check_open()
        try:
            return self._encode_reply(req, reply)
        except InvalidEnvelope as exc:
            log.warning("bus.client.reply_refused", method=req.method, call_id=req.call_id,
                        error=exc.message)
            return False

    def _encode_reply(self, req: Request, reply: Reply, inline: bool = False) -> bool:
        """Queue `bus.reply` for `reply` (InvalidEnvelope, nothing sent, when it cannot be
        encoded or is too large); True when it also returned the delivery (lean
        `consumed: true`). The outcome goes last, for the router's split (design/wire.md §22.1)."""
        conn = self.connection
        params: dict[str, Any] = {"deliveryId": req.delivery_id}
        if reply.attachments:
            params["attachments"] = artifact_ids(reply.attachments)
            params["transfer"] = reply.transfer
        if conn.lean:
            params["consumed"] = True
            if inline and conn.minor >= 3:
                params["inline"] = True
            # only the handler's outcome needs the strict encoder; the router issued the
            # delivery id (a checked string)
            params["outcome"] = orjson.Fragment(codec.encode(reply.outcome))
            conn.write(codec.encode_trusted(
                {"jsonrpc": "2.0", "method": "bus.reply", "params": params}, conn.max_envelope))
            req.answered = True
            return True
        params["outcome"] = reply.outcome
        fut = conn.send_nowait("bus.reply", params)
        req.answered = True
        fut.add_done_callback(lambda f: self._reply_answered(req, f))
        return False

    def _reply_answered(self, req: Request, fut: asyncio.Future[dict[str, Any]]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if isinstance(exc, InvalidEnvelope) and not self.connection.closed:
            # the router refused the reply (its bus.result would be too large) and kept the
            # capability: give it back so the caller hears CALL_GONE instead of nothing
            log.warning("bus.client.reply_refused", method=req.method, call_id=req.call_id,
                        error=exc.message)
            self.connection.send_nowait("bus.release", {"deliveryId": req.delivery_id})

    def _route_removed(self, params: dict[str, Any], _frame: bytes, _bad: str | None) -> None:
        hook = self._on_route_removed
        if hook is not None:
            try:
                hook(params["name"], params["serviceIncarnation"], params["reason"])
            except Exception:
                log.exception("bus.client.route_removed_hook_failed")

    def _lost(self, _failure: RouterLost) -> None:
        self._services.clear()
        for t in self._tasks:
            t.cancel()
