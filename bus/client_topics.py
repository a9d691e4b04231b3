"""The client's topics (topics.md §12): topics it declares, publications, and its
subscriptions with the messages they deliver.

A subscription's message is consumed when the next one is asked for or the subscription is
left, so at most `window` unconsumed messages are ever held."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from bus.client_artifacts import Artifacts, Attachment, AttachmentRef, artifact_ids
from bus.client_connection import Connection, ignore_outcome
from bus.client_identity import Identities, Identity
from bus.errors import BusError, RouterLost, from_wire

log = structlog.get_logger("bus.client")

PublishFailedHook = Callable[[str, BusError], None]


@dataclass(frozen=True, slots=True)
class PublishResult:
    """An accepted publish (topics.md §3.4, request form)."""

    topic: str
    topic_incarnation: str
    sequence: int
    latest: int
    bounded: int


@dataclass(frozen=True, slots=True)
class Message:
    """One `bus.message` of a subscription (topics.md §3.8)."""

    topic: str
    topic_incarnation: str
    sequence: int
    skipped: int
    publisher: Identity
    payload: dict[str, Any]
    delivery_id: str
    attachments: tuple[Attachment, ...] = ()
    artifacts: Artifacts | None = field(default=None, compare=False, repr=False)

    async def retain(self) -> list[Attachment]:
        """Keep this message's attachments beyond its delivery (before asking for the next)."""
        if not self.attachments or self.artifacts is None:
            return []
        return await self.artifacts.retain([a.artifact_id for a in self.attachments])


class Topic:
    """A topic this client declared; `async with` undeclares it on exit."""

    def __init__(self, topics: Topics, name: str, incarnation: str) -> None:
        self._topics = topics
        self._conn = topics.connection
        self.name = name
        self.incarnation = incarnation

    @property
    def closed(self) -> bool:
        """Its connection ended (the router removed the topic)."""
        return self._conn.closed

    def publish_nowait(self, payload: dict[str, Any], *, linger: bool = False) -> None:
        """`BusClient.publish_nowait` to this incarnation of the topic."""
        self._topics.publish_nowait(self.name, payload, expected_incarnation=self.incarnation,
                                    linger=linger)

    async def undeclare(self) -> bool:
        result = await self._conn.command("bus.undeclare", {
            "topic": self.name, "topicIncarnation": self.incarnation})
        return bool(result["removed"])

    def undeclare_nowait(self) -> None:
        """`bus.undeclare` pipelined: sent now, its answer never awaited, for an owner that
        must not wait on the router (a grant whose lease was lost). Frames of one connection
        are taken in order, so what was sent before is handled first; a closed connection
        removed the topic already."""
        if self._conn.closed:
            return
        fut = self._conn.send_nowait("bus.undeclare", {
            "topic": self.name, "topicIncarnation": self.incarnation})
        fut.add_done_callback(ignore_outcome)

    async def __aenter__(self) -> Topic:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._conn.closed:
            await self.undeclare()


class Subscription:
    """One subscription: an async iterator of `Message`s and a context manager (exit
    unsubscribes). Iteration ends after `bus.topicRemoved` (`removed_reason`); a lost
    connection raises RouterLost. `deliver`, `removed` and `fail` are the SDK's."""

    def __init__(self, topics: Topics, result: dict[str, Any]) -> None:
        self._topics = topics
        self._conn = topics.connection
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

    @property
    def active(self) -> bool:
        """Not left: its messages are still read."""
        return self._active

    def deliver(self, msg: Message) -> None:
        self._inbox.append(msg)
        self._wake()

    def removed(self, reason: str) -> None:
        self.removed_reason = reason
        self._wake()

    def fail(self, error: BusError) -> None:
        self._failure = error
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _release_current(self) -> None:
        if self._current is not None:
            if not self._conn.closed:
                self._conn.return_credit(self._current.delivery_id)
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
            self._waiter = self._conn.loop.create_future()
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
            self._conn.return_credit(self._inbox.popleft().delivery_id)
        self._wake()
        if self.removed_reason is not None or self._conn.closed:
            self._topics.forget(self)
            return False
        result = await self._conn.command("bus.unsubscribe", {"topic": self.topic})
        self._topics.forget(self)
        return bool(result["removed"])

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._conn.closed:
            return
        await self.unsubscribe()


class Topics:
    """The topics side of one connection: declare, publish and subscribe out; `bus.message`,
    `bus.topicRemoved` and `bus.publishFailed` in."""

    def __init__(self, connection: Connection, artifacts: Artifacts, identities: Identities,
                 on_publish_failed: PublishFailedHook | None) -> None:
        self.connection = connection
        self._artifacts = artifacts
        self._identities = identities
        self._on_publish_failed = on_publish_failed
        self._subscriptions: dict[str, Subscription] = {}  # by topic incarnation
        connection.on("bus.message", self._on_message)
        connection.on("bus.topicRemoved", self._on_topic_removed)
        connection.on("bus.publishFailed", self._publish_failed)
        connection.on_lost(self._lost)

    async def declare(self, topic: str, *, retain: bool = False, max_bounded: int = 0) -> Topic:
        self.connection.need_minor(2, "bus.declare")
        result = await self.connection.command("bus.declare", {
            "topic": topic, "retain": retain, "maxBounded": max_bounded})
        return Topic(self, result["topic"], result["topicIncarnation"])

    async def publish(self, topic: str, payload: dict[str, Any], *,
                      expected_incarnation: str | None = None,
                      attachments: tuple[AttachmentRef, ...] = (),
                      transfer: bool = False) -> PublishResult:
        self.connection.need_minor(2, "bus.publish")
        result = await self.connection.command(
            "bus.publish", _publish_params(topic, payload, expected_incarnation, attachments,
                                           transfer))
        return PublishResult(result["topic"], result["topicIncarnation"], result["sequence"],
                             result["latest"], result["bounded"])

    def publish_nowait(self, topic: str, payload: dict[str, Any], *,
                       expected_incarnation: str | None = None,
                       attachments: tuple[AttachmentRef, ...] = (),
                       transfer: bool = False, linger: bool = False) -> None:
        self.connection.check_open()
        self.connection.need_minor(2, "bus.publish")
        self.connection.send_notification("bus.publish", _publish_params(
            topic, payload, expected_incarnation, attachments, transfer), linger)

    async def subscribe(self, topic: str, *, mode: str = "latest", window: int = 1,
                        depth: int | None = None, retained: bool = True) -> Subscription:
        self.connection.need_minor(2, "bus.subscribe")
        params: dict[str, Any] = {"topic": topic, "mode": mode, "window": window,
                                  "retained": retained}
        if depth is not None:
            params["depth"] = depth
        bound: list[Subscription] = []

        def bind(result: dict[str, Any]) -> None:
            # Bind now: its first message may follow in the same read (topics.md §4.2).
            sub = Subscription(self, result)
            self._subscriptions[sub.topic_incarnation] = sub
            bound.append(sub)

        await self.connection.command("bus.subscribe", params, on_result=bind)
        assert bound, "a subscribe result binds its subscription"
        return bound[0]

    async def topics(self, prefix: str = "") -> list[dict[str, Any]]:
        self.connection.need_minor(2, "bus.topics")
        result = await self.connection.command("bus.topics", {"prefix": prefix})
        topics: list[dict[str, Any]] = result["topics"]
        return topics

    def forget(self, subscription: Subscription) -> None:
        """A subscription left: its messages are no longer routed to it."""
        self._subscriptions.pop(subscription.topic_incarnation, None)

    def _on_message(self, params: dict[str, Any], _frame: bytes, _bad: str | None) -> None:
        sub = self._subscriptions.get(params["topicIncarnation"])
        if sub is None or not sub.active:  # left already: nobody will read it
            self.connection.return_credit(params["deliveryId"])
            return
        sub.deliver(Message(params["topic"], params["topicIncarnation"], params["sequence"],
                            params["skipped"], self._identities.get(params["publisher"]),
                            params["payload"], params["deliveryId"],
                            self._artifacts.attachments(params), self._artifacts))

    def _on_topic_removed(self, params: dict[str, Any], _frame: bytes,
                          _bad: str | None) -> None:
        sub = self._subscriptions.pop(params["topicIncarnation"], None)
        if sub is not None:
            sub.removed(params["reason"])

    def _publish_failed(self, params: dict[str, Any], _frame: bytes, _bad: str | None) -> None:
        hook = self._on_publish_failed
        if hook is None:
            log.warning("bus.client.publish_failed", topic=params["topic"],
                        error=params["error"]["data"]["name"])
            return
        try:
            hook(params["topic"], from_wire(params["error"]))
        except Exception:
            log.exception("bus.client.publish_failed_hook_failed")

    def _lost(self, failure: RouterLost) -> None:
        for sub in self._subscriptions.values():
            sub.fail(RouterLost(failure.message))
        self._subscriptions.clear()


def _publish_params(topic: str, payload: dict[str, Any], expected_incarnation: str | None,
                    attachments: tuple[AttachmentRef, ...], transfer: bool) -> dict[str, Any]:
    params: dict[str, Any] = {"topic": topic, "expectedIncarnation": expected_incarnation,
                              "payload": payload}
    if attachments:
        params["attachments"] = artifact_ids(attachments)
        params["transfer"] = transfer
    return params
