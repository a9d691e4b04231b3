"""The asyncio client SDK (design/wire.md §17); works on the default loop and under uvloop.

One `BusClient` is one connection and belongs to one event loop. It is a facade over the
connection's parts, each owning its state and reached only through its public interface:

- bus/client_connection.py: the protocol, the hello, frames out and in, requests awaiting
  their responses, and the end of the connection (RouterLost `unknown` for all pending);
- bus/client_calls.py: calls, their deadlines and the result credits they carry;
- bus/client_serving.py: registrations, requests delivered to them, handlers and replies;
- bus/client_topics.py: declared topics, publications and subscriptions;
- bus/client_artifacts.py: the artifact store, allocations, attachments and holds;
- bus/client_identity.py: peers' identities.

Deadlines live on the caller's monotonic clock: at a deadline the SDK cancels and reports the
certainty the cancel proved.
"""

from __future__ import annotations

import asyncio
import types
from collections.abc import Generator, Mapping
from typing import Any

from bus.client_artifacts import Allocation, Artifacts, Attachment, AttachmentRef
from bus.client_calls import CallResult, Calls, PendingCall
from bus.client_connection import Connection, open_transport
from bus.client_identity import Identities, new_incarnation
from bus.client_serving import Handler, InlineHandler, RouteRemovedHook, Service, Serving
from bus.client_topics import PublishFailedHook, PublishResult, Subscription, Topic, Topics
from bus.errors import BusError, RouterLost
from bus.ownership import Trust, check_socket_dir


class BusClient:
    """One connection to the router (created by `connect`)."""

    def __init__(self, path: str, client_id: str, client_incarnation: str,
                 on_route_removed: RouteRemovedHook | None,
                 on_publish_failed: PublishFailedHook | None = None) -> None:
        self.path = path
        self.client_id = client_id
        self.client_incarnation = client_incarnation
        # what the hello says (`open`)
        self.router_id = ""
        self.connection_id = ""
        self.limits: dict[str, int] = {}
        self.grants: dict[str, list[str]] = {}
        self.store: dict[str, str] | None = None  # topics.md §5.1
        # the order of the parts is the order a lost connection fails them in
        self._conn = Connection(client_id)
        identities = Identities()
        self._artifacts = Artifacts(self._conn)
        self._calls = Calls(self._conn, self._artifacts, identities)
        self._topics = Topics(self._conn, self._artifacts, identities, on_publish_failed)
        self._serving = Serving(self._conn, self._artifacts, identities, on_route_removed)

    # connection ---------------------------------------------------------------------------
    async def open(self, supported_majors: tuple[int, ...]) -> None:
        """Connect and complete `bus.hello` (what `connect` does; once)."""
        await open_transport(self._conn, self.path)
        hello = await self._conn.hello(self.client_id, self.client_incarnation,
                                       supported_majors)
        self.router_id = hello.router_id
        self.connection_id = hello.connection_id
        self.limits = hello.limits
        self.grants = hello.grants
        self.store = hello.store
        self._artifacts.open_store(hello.store)

    @property
    def closed(self) -> bool:
        return self._conn.closed

    @property
    def writes(self) -> int:
        """Transport writes made: frames queued in one loop turn leave in one write."""
        return self._conn.writes

    async def wait_closed(self) -> BusError | None:
        """The closing BusError, RouterLost for EOF, or None after a local close."""
        return await self._conn.wait_closed()

    async def close(self) -> None:
        """Close locally; everything pending fails with RouterLost `unknown`. Frames queued
        before the close (a notification sent just before it, a lingering one) are written
        first: `..._nowait` promises they leave, not that the connection outlives them."""
        self._conn.flush()
        self._conn.lose(None)
        await self._serving.reap_tasks()

    def flush(self) -> None:
        """Write every queued frame now, lingering ones included: for a publisher whose next
        frame goes out on another connection and must come after these."""
        self._conn.flush()

    async def __aenter__(self) -> BusClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # services and calls ------------------------------------------------------------------
    async def register(self, name: str, handler: Handler, *, max_queued: int = 16,
                       max_in_flight: int = 4,
                       inline: Mapping[str, InlineHandler] | None = None) -> Service:
        """Register `name`. `inline` maps methods to handlers that complete without awaiting
        (design/wire.md §22.2): they run on the reader, no task per request."""
        return await self._serving.register(name, handler, max_queued=max_queued,
                                            max_in_flight=max_in_flight, inline=inline)

    async def start_call(self, target: str, method: str, payload: dict[str, Any] | bytes, *,
                         expected_incarnation: str | None = None) -> PendingCall:
        """Admit a call and return its handle (raises the refusal's BusError)."""
        return await self._calls.start_call(target, method, payload,
                                            expected_incarnation=expected_incarnation)

    async def call(self, target: str, method: str, payload: dict[str, Any] | bytes, *,
                   timeout: float | None,  # noqa: ASYNC109 - the SDK contract (design/wire.md §17)
                   expected_incarnation: str | None = None,
                   attachments: tuple[AttachmentRef, ...] = (), transfer: bool = False,
                   keep_attachments: bool = True) -> CallResult:
        """One call with a required deadline (seconds, or None for none). The deadline
        covers the whole call, a wait for write credit included, so with a deadline `call`
        returns or raises within `timeout` plus one cancel exchange
        (`client_calls.CANCEL_WAIT_S`). A result's attachments are retained before its credit
        leaves unless `keep_attachments` is False (topics.md §12); the caller drops
        them."""
        return await self._calls.call(target, method, payload, timeout=timeout,
                                      expected_incarnation=expected_incarnation,
                                      attachments=attachments, transfer=transfer,
                                      keep_attachments=keep_attachments)

    async def services(self, prefix: str = "") -> list[dict[str, Any]]:
        result = await self._conn.command("bus.services", {"prefix": prefix})
        services: list[dict[str, Any]] = result["services"]
        return services

    async def stats(self, detail: bool = False) -> dict[str, Any]:
        return await self._conn.command("bus.stats", {"detail": detail})

    async def expect(self, client_id: str, pid: int, *, client_incarnation: str | None = None,
                     ttl: float = 30.0, grants: dict[str, list[str]] | None = None) -> float:
        """Pre-bind client_id to pid (launcher); returns the expiry in seconds."""
        result = await self._conn.command("bus.expect", {
            "clientId": client_id, "pid": pid, "clientIncarnation": client_incarnation,
            "ttlMs": max(1, int(ttl * 1000)), "grants": grants})
        return float(result["expiresInMs"]) / 1000.0

    # topics (topics.md §12) ------------------------------------------------------------
    async def declare(self, topic: str, *, retain: bool = False, max_bounded: int = 0) -> Topic:
        return await self._topics.declare(topic, retain=retain, max_bounded=max_bounded)

    async def publish(self, topic: str, payload: dict[str, Any], *,
                      expected_incarnation: str | None = None,
                      attachments: tuple[AttachmentRef, ...] = (),
                      transfer: bool = False) -> PublishResult:
        """The request form: the result says which sequence the message got."""
        return await self._topics.publish(topic, payload,
                                          expected_incarnation=expected_incarnation,
                                          attachments=attachments, transfer=transfer)

    def publish_nowait(self, topic: str, payload: dict[str, Any], *,
                       expected_incarnation: str | None = None,
                       attachments: tuple[AttachmentRef, ...] = (),
                       transfer: bool = False, linger: bool = False) -> None:
        """The notification form: one frame, no answer on success; a refusal reaches the
        `on_publish_failed` hook. Never waits for the transport to drain.

        `linger`: the frame may wait up to `client_connection.LINGER_S` for the next frame
        of this connection and leave in its write (a publisher that sends calls right after,
        as a lockstep coordinator does, then costs no write and no router wake-up of its
        own)."""
        self._topics.publish_nowait(topic, payload, expected_incarnation=expected_incarnation,
                                    attachments=attachments, transfer=transfer, linger=linger)

    async def subscribe(self, topic: str, *, mode: str = "latest", window: int = 1,
                        depth: int | None = None, retained: bool = True) -> Subscription:
        return await self._topics.subscribe(topic, mode=mode, window=window, depth=depth,
                                            retained=retained)

    async def topics(self, prefix: str = "") -> list[dict[str, Any]]:
        return await self._topics.topics(prefix)

    # the artifact store (topics.md §5, §12) --------------------------------------------
    async def allocate(self, length: int) -> Allocation:
        """`bus.allocate`: an Allocated artifact of `length` bytes, held by this client."""
        return await self._artifacts.allocate(length)

    def open_artifact(self, attachment: Attachment) -> memoryview:
        """A read-only view of an artifact this client can see (a private copy up to 1 MiB, a
        mapping above); it stays readable after the artifact is collected or the connection is
        lost. ArtifactGone / ArtifactMismatch (SDK-local, `not-dispatched`) when the file is
        gone or not the sealed one."""
        return self._artifacts.open_artifact(attachment)

    async def retain(self, artifact_ids: list[str]) -> list[Attachment]:
        """`bus.retain`: hold artifacts this client can see (all or nothing)."""
        return await self._artifacts.retain(artifact_ids)

    async def drop(self, artifact_ids: list[str]) -> int:
        """`bus.drop`: end this client's holds; returns how many ended."""
        return await self._artifacts.drop(artifact_ids)

    def drop_nowait(self, artifact_ids: list[str]) -> None:
        """`bus.drop` pipelined: sent now, its answer never awaited. `bus.drop` fails only on
        params, so nothing is lost by not waiting; a closed connection dropped every hold
        already (topics.md §11 step 9), so it is a no-op then."""
        self._artifacts.drop_nowait(artifact_ids)


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
        # design/wire.md §13: a socket in a directory another user controls may be an impostor's
        check_socket_dir(path, Trust.client(self._socket_gid))
        client = BusClient(path, client_id, incarnation or new_incarnation(), hook,
                           self._on_publish_failed)
        try:
            async with asyncio.timeout(timeout):
                await client.open(majors)
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
    """Open a connection and complete `bus.hello` (design/wire.md §17). The socket's directory must
    be one no other user controls (`bus.ownership.Trust.client`; `socket_gid` is the configured
    `[bus] socket_group`), else `UnsafeDirectory` (NOT_AUTHORIZED) before any connect."""
    return _Connect(path, client_id, client_incarnation, tuple(supported_majors), timeout,
                    on_route_removed, on_publish_failed, socket_gid)
