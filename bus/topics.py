"""Declared pub/sub topics (topics.md §3, §4): the books, as a pure state machine.

Pure and synchronous: no sockets, no timers, no frames written. The router (`bus/router.py`)
checks grants, sizes frames, assigns delivery ids and writes; this module decides whether a
declare, publish or subscribe is allowed, where each message goes and which messages are
released, so the atomicity and counting rules live in one place.

Rules:

1. A topic lives from `declare` to `remove_topic` (undeclare or its owner's end); its name is
   free at once. Sequences count accepted publishes per incarnation: 1, 2, 3, … with no gap.
2. A publish is atomic: `check_publish` raises (and changes nothing) or `accept_publish`
   gives the message to every subscription that is not closing. A latest subscription's slot
   never refuses: a newer message replaces the held one (`skipped` +1). A bounded one holding
   `depth` messages refuses the whole publish (`Backpressure`).
3. A message is one record, however many places hold it. `queued` counts its references from
   slots, queues and the retained value; `delivered` those from written, unconsumed
   deliveries. Its payload counts in `queued_bytes` exactly while `queued > 0`; it is released
   (returned to the caller, for its attachments) when both reach 0.
4. A subscription hands out a message only while it has fewer than `window` unconsumed
   deliveries, and only after the writer took its subscribe response (`gate`). A closing
   subscription (its topic removed) takes nothing new, drains, then hands out one removal
   notice and is gone.
5. A broken rule is `TopicError` (a router bug, never a peer's doing); a refused request is a
   `BusError` raised before any change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Generic, Literal, TypeVar

from bus.errors import Backpressure, Conflict, NoTopic, QuotaExceeded, TargetChanged

__all__ = [
    "Message",
    "PublishOutcome",
    "Removal",
    "Subscription",
    "Topic",
    "TopicError",
    "TopicLimits",
    "TopicTable",
]

Mode = Literal["latest", "bounded"]
Reason = Literal["undeclared", "disconnected"]
MAX_BOUNDED: Final = 65535

C = TypeVar("C")


class TopicError(RuntimeError):
    """A move the rules forbid: a router bug."""


@dataclass(frozen=True, slots=True)
class TopicLimits:
    """The topic limits of topics.md §8, in wire names' order."""

    max_topics: int = 256
    max_subscribers_per_topic: int = 64
    max_subscriptions_per_client: int = 64
    max_bounded_depth: int = 64
    max_subscription_window: int = 16
    max_queued_topic_bytes: int = 67108864


class Message:
    """One accepted publish. `payload` is its encoded JSON, `publisher` the publisher's
    identity as the router encodes it (opaque here)."""

    __slots__ = ("delivered", "incarnation", "payload", "publisher", "queued", "sequence",
                 "topic")

    def __init__(self, topic: str, incarnation: str, sequence: int, publisher: object,
                 payload: bytes) -> None:
        self.topic = topic
        self.incarnation = incarnation
        self.sequence = sequence
        self.publisher = publisher
        self.payload = payload
        self.queued = 0
        self.delivered = 0


class Topic(Generic[C]):
    """A declared topic; `subscriptions` excludes closing ones (they left with removal)."""

    __slots__ = ("bounded", "incarnation", "live", "max_bounded", "name", "owner", "retain",
                 "retained", "sequence", "subscriptions")

    def __init__(self, name: str, incarnation: str, owner: C, retain: bool,
                 max_bounded: int) -> None:
        self.name = name
        self.incarnation = incarnation
        self.owner = owner
        self.retain = retain
        self.max_bounded = max_bounded
        self.sequence = 0
        self.retained: Message | None = None
        self.subscriptions: list[Subscription[C]] = []
        self.bounded = 0
        self.live = True


class Subscription(Generic[C]):
    """One connection's subscription to one topic incarnation."""

    __slots__ = ("closing", "conn", "depth", "gate", "incarnation", "mode", "queue", "reason",
                 "skipped", "topic", "unconsumed", "window")

    def __init__(self, conn: C, topic: Topic[C], mode: Mode, depth: int, window: int,
                 gate: int) -> None:
        self.conn = conn
        self.topic = topic
        self.incarnation = topic.incarnation
        self.mode = mode
        self.depth = depth if mode == "bounded" else 1
        self.window = window
        self.gate = gate
        self.queue: deque[Message] = deque()  # a latest slot is a queue of at most one
        self.skipped = 0
        self.unconsumed = 0
        self.closing = False
        self.reason: Reason = "undeclared"

    def ready(self, taken: int) -> bool:
        """The topic lane may write for it now (topics.md §4.2 rule 1 and 4); `taken` is the control
        frames the writer has taken on its connection."""
        if taken < self.gate:
            return False
        if self.queue:
            return self.unconsumed < self.window
        return self.closing


@dataclass(frozen=True, slots=True)
class Removal:
    """The `bus.topicRemoved` a drained closing subscription hands out last."""

    topic: str
    incarnation: str
    reason: Reason


@dataclass(frozen=True, slots=True)
class PublishOutcome(Generic[C]):
    """An accepted publish: its message, how many subscriptions took it, whom to wake and
    what it released (a replaced retained value or slot, or itself when nobody took it)."""

    message: Message
    latest: int
    bounded: int
    wake: tuple[C, ...]
    released: tuple[Message, ...]


class _Reader(Generic[C]):
    """A connection's subscriptions in subscription order (closing ones included) and the
    round-robin position of its topic lane."""

    __slots__ = ("by_topic", "rr", "subs")

    def __init__(self) -> None:
        self.subs: list[Subscription[C]] = []
        self.by_topic: dict[str, Subscription[C]] = {}  # not closing
        self.rr = 0


class TopicTable(Generic[C]):
    """Every topic, subscription and undelivered message of one router."""

    def __init__(self, limits: TopicLimits, first_incarnation: int,
                 label: Callable[[C], str] = repr) -> None:
        self.limits = limits
        self.label = label  # names a subscriber in a BACKPRESSURE message
        self.topics: dict[str, Topic[C]] = {}
        self.readers: dict[C, _Reader[C]] = {}
        self.owned: dict[C, dict[str, Topic[C]]] = {}
        self.next_incarnation = first_incarnation
        self.subscriptions = 0  # closing ones included
        self.queued_messages = 0  # per subscription, slots and queues
        self.queued_bytes = 0
        self.deliveries = 0  # written, unconsumed
        self.replaced = 0
        self.dropped = 0

    # topics --------------------------------------------------------------------------------
    def declare(self, owner: C, name: str, retain: bool, max_bounded: int) -> Topic[C]:
        """topics.md §3.2 checks 3–5 (the router checked params and the grant)."""
        lim = self.limits
        if max_bounded > lim.max_subscribers_per_topic:
            raise QuotaExceeded(f"maxBounded {max_bounded} is above maxSubscribersPerTopic "
                                f"({lim.max_subscribers_per_topic})")
        if name in self.topics:
            raise Conflict(f"topic {name} is already declared")
        if len(self.topics) >= lim.max_topics:
            raise QuotaExceeded(f"maxTopics ({lim.max_topics}) reached")
        topic = Topic(name, f"top-{self.next_incarnation}", owner, retain, max_bounded)
        self.next_incarnation += 1
        self.topics[name] = topic
        self.owned.setdefault(owner, {})[name] = topic
        return topic

    def undeclare(self, owner: C, name: str, incarnation: str) -> tuple[bool, tuple[C, ...],
                                                                      tuple[Message, ...]]:
        """topics.md §3.3: (removed, connections to wake, messages released)."""
        topic = self.topics.get(name)
        if topic is None or topic.owner != owner or topic.incarnation != incarnation:
            return False, (), ()
        wake, released = self.remove_topic(topic, "undeclared")
        return True, wake, released

    def remove_topic(self, topic: Topic[C], reason: Reason) -> tuple[tuple[C, ...],
                                                                     tuple[Message, ...]]:
        """Free the name, drop the retained value, make every subscription closing."""
        if not topic.live:
            raise TopicError(f"topic {topic.name} {topic.incarnation} is already removed")
        topic.live = False
        del self.topics[topic.name]
        owned = self.owned[topic.owner]
        del owned[topic.name]
        if not owned:
            del self.owned[topic.owner]
        released: list[Message] = []
        if topic.retained is not None:
            self._unqueue(topic.retained, released)
            topic.retained = None
        wake: dict[int, C] = {}
        for sub in topic.subscriptions:
            sub.closing = True
            sub.reason = reason
            reader = self.readers[sub.conn]
            del reader.by_topic[topic.name]
            wake[id(sub.conn)] = sub.conn
        topic.subscriptions = []
        topic.bounded = 0
        return tuple(wake.values()), tuple(released)

    # publish -------------------------------------------------------------------------------
    def check_publish(self, name: str, expected: str | None, size: int) -> Topic[C]:
        """topics.md §3.4 checks 3, 4, 8 and 9; raises before any change."""
        topic = self.topics.get(name)
        if topic is None:
            raise NoTopic(f"no topic declared under {name}")
        if expected is not None and expected != topic.incarnation:
            raise TargetChanged(f"{name} is now {topic.incarnation}, not {expected}")
        holders = topic.retain
        for sub in topic.subscriptions:
            holders = True
            if sub.mode == "bounded" and len(sub.queue) >= sub.depth:
                raise Backpressure(f"subscriber {self.label(sub.conn)} full ({sub.depth})")
        if holders and self.queued_bytes + size > self.limits.max_queued_topic_bytes:
            raise Backpressure(f"router queued-topic bytes budget exhausted "
                               f"({self.limits.max_queued_topic_bytes})")
        return topic

    def accept_publish(self, topic: Topic[C], publisher: object,
                       payload: bytes) -> PublishOutcome[C]:
        """The accept steps of topics.md §3.4, after `check_publish` passed for the same payload."""
        if not topic.live:
            raise TopicError(f"publish to removed topic {topic.name}")
        topic.sequence += 1
        msg = Message(topic.name, topic.incarnation, topic.sequence, publisher, payload)
        released: list[Message] = []
        wake: dict[int, C] = {}
        latest = bounded = 0
        if topic.retain:
            old = topic.retained
            topic.retained = msg
            self._enqueue(msg)
            if old is not None:
                self._unqueue(old, released)
        for sub in topic.subscriptions:
            queue = sub.queue
            if sub.mode == "latest":
                latest += 1
                if queue:
                    old = queue.popleft()
                    self.queued_messages -= 1
                    sub.skipped += 1
                    self.replaced += 1
                    self._unqueue(old, released)
            else:
                bounded += 1
                if len(queue) >= sub.depth:
                    raise TopicError(f"bounded subscription of {topic.name} over its depth")
            queue.append(msg)
            self.queued_messages += 1
            self._enqueue(msg)
            wake[id(sub.conn)] = sub.conn
        if msg.queued == 0:
            released.append(msg)
        return PublishOutcome(msg, latest, bounded, tuple(wake.values()), tuple(released))

    # subscriptions -------------------------------------------------------------------------
    def subscribe(self, conn: C, name: str, mode: Mode, depth: int, window: int,
                  retained: bool, gate: int) -> tuple[Subscription[C], bool]:
        """topics.md §3.5 checks 3–8 and the accept; returns the subscription and whether the
        retained value was put in it. `gate`: the control frames the writer must have taken
        first."""
        lim = self.limits
        if window > lim.max_subscription_window:
            raise QuotaExceeded(f"window {window} is above maxSubscriptionWindow "
                                f"({lim.max_subscription_window})")
        if mode == "bounded" and depth > lim.max_bounded_depth:
            raise QuotaExceeded(f"depth {depth} is above maxBoundedDepth "
                                f"({lim.max_bounded_depth})")
        topic = self.topics.get(name)
        if topic is None:
            raise NoTopic(f"no topic declared under {name}")
        reader = self.readers.get(conn)
        if reader is not None and name in reader.by_topic:
            raise Conflict(f"this connection already subscribes to {name}")
        if mode == "bounded" and topic.bounded >= topic.max_bounded:
            raise QuotaExceeded(f"topic {name} admits {topic.max_bounded} bounded "
                                "subscriptions (its owner's maxBounded)")
        if len(topic.subscriptions) >= lim.max_subscribers_per_topic:
            raise QuotaExceeded(f"maxSubscribersPerTopic ({lim.max_subscribers_per_topic}) "
                                "reached")
        if (0 if reader is None else len(reader.subs)) >= lim.max_subscriptions_per_client:
            raise QuotaExceeded(f"maxSubscriptionsPerClient "
                                f"({lim.max_subscriptions_per_client}) reached")
        if reader is None:
            reader = self.readers[conn] = _Reader()
        sub = Subscription(conn, topic, mode, depth, window, gate)
        reader.subs.append(sub)
        reader.by_topic[name] = sub
        topic.subscriptions.append(sub)
        if mode == "bounded":
            topic.bounded += 1
        self.subscriptions += 1
        put = retained and topic.retained is not None
        if put:
            msg = topic.retained
            assert msg is not None
            sub.queue.append(msg)
            self.queued_messages += 1
            self._enqueue(msg)
        return sub, put

    def unsubscribe(self, conn: C, name: str) -> tuple[bool, tuple[Message, ...]]:
        """topics.md §3.6: (removed, messages released). Written deliveries stay."""
        reader = self.readers.get(conn)
        sub = None if reader is None else reader.by_topic.get(name)
        if sub is None:
            return False, ()
        released: list[Message] = []
        self.dropped += len(sub.queue)
        self._drop(sub, released)
        return True, tuple(released)

    def next_ready(self, conn: C, taken: int) -> Subscription[C] | None:
        """The next ready subscription of `conn`, round robin in subscription order."""
        reader = self.readers.get(conn)
        if reader is None:
            return None
        subs = reader.subs
        count = len(subs)
        start = reader.rr
        for k in range(count):
            sub = subs[(start + k) % count]
            if sub.ready(taken):
                reader.rr = (start + k + 1) % count
                return sub
        return None

    def take(self, sub: Subscription[C]) -> tuple[Message, int] | Removal:
        """Hand the writer the subscription's next message (now a delivery: one credit
        spent; returns it with its `skipped`) or, drained and closing, its removal notice."""
        if sub.queue:
            if sub.unconsumed >= sub.window:
                raise TopicError("take beyond the subscription's window")
            msg = sub.queue.popleft()
            self.queued_messages -= 1
            sub.unconsumed += 1
            skipped = sub.skipped
            sub.skipped = 0
            msg.delivered += 1
            self.deliveries += 1
            released: list[Message] = []
            self._unqueue(msg, released)
            if released:
                raise TopicError("a message being delivered was released")
            return msg, skipped
        if not sub.closing:
            raise TopicError("take from an empty subscription")
        self._detach(sub)
        return Removal(sub.topic.name, sub.incarnation, sub.reason)

    def consume(self, sub: Subscription[C], msg: Message) -> tuple[bool, Message | None]:
        """A message delivery's credit returns: (its subscription may be ready again, the
        message if this released it)."""
        if msg.delivered <= 0:
            raise TopicError("consume of a message with no delivery")
        msg.delivered -= 1
        self.deliveries -= 1
        sub.unconsumed -= 1
        released = msg if msg.queued == 0 and msg.delivered == 0 else None
        live = sub.conn in self.readers and sub in self.readers[sub.conn].subs
        return live and bool(sub.queue or sub.closing), released

    def forget_connection(self, conn: C, deliveries: list[tuple[Subscription[C], Message]]
                          ) -> tuple[tuple[C, ...], tuple[Message, ...]]:
        """Teardown steps 7 and 8 (topics.md §11): drop `conn`'s subscriptions (undelivered messages
        count in `dropped`) and written deliveries, then remove the topics it owns. Returns
        the connections to wake and the messages released."""
        released: list[Message] = []
        for sub, msg in deliveries:
            _, gone = self.consume(sub, msg)
            if gone is not None:
                released.append(gone)
        reader = self.readers.get(conn)
        if reader is not None:
            for sub in list(reader.subs):
                self.dropped += len(sub.queue)  # closing or not: never delivered
                self._drop(sub, released)
        wake: dict[int, C] = {}
        for topic in list(self.owned.get(conn, {}).values()):
            woken, gone_msgs = self.remove_topic(topic, "disconnected")
            released.extend(gone_msgs)
            for c in woken:
                wake[id(c)] = c
        return tuple(wake.values()), tuple(released)

    # internals -----------------------------------------------------------------------------
    def _enqueue(self, msg: Message) -> None:
        if msg.queued == 0:
            self.queued_bytes += len(msg.payload)
        msg.queued += 1

    def _unqueue(self, msg: Message, released: list[Message]) -> None:
        msg.queued -= 1
        if msg.queued < 0:
            raise TopicError("message reference count below zero")
        if msg.queued == 0:
            self.queued_bytes -= len(msg.payload)
            if msg.delivered == 0:
                released.append(msg)

    def _drop(self, sub: Subscription[C], released: list[Message]) -> None:
        """Release what the subscription holds and remove it (not its deliveries)."""
        while sub.queue:
            self.queued_messages -= 1
            self._unqueue(sub.queue.popleft(), released)
        topic = sub.topic
        if not sub.closing:
            topic.subscriptions.remove(sub)
            if sub.mode == "bounded":
                topic.bounded -= 1
            del self.readers[sub.conn].by_topic[topic.name]
        self._detach(sub)

    def _detach(self, sub: Subscription[C]) -> None:
        reader = self.readers[sub.conn]
        index = reader.subs.index(sub)
        del reader.subs[index]
        if index < reader.rr:
            reader.rr -= 1
        if reader.subs:
            reader.rr %= len(reader.subs)
        else:
            del self.readers[sub.conn]
        self.subscriptions -= 1
