"""The topics' side of the router (topics.md §3, §4): the topic ops and the topic lane.

`bus/topics.py` is the pure core (topics, subscriptions, their queues and credits); this module
checks grants, builds the `bus.message` and `bus.topicRemoved` frames the topic lane writes,
wakes the writers of the connections a step made ready, and roots a message's attachments
until nothing references it (topics.md §5.2 rule 3).
"""

from __future__ import annotations

from typing import Any

import orjson
import structlog

from bus.artifact_ops import ArtifactOps
from bus.artifacts import Artifact
from bus.connection import Conn
from bus.errors import (
    BusError,
    InvalidEnvelope,
    InvalidParams,
    NotAuthorized,
    NoTopic,
    TargetChanged,
    error_object,
)
from bus.inbound import Inbound
from bus.limits import LONGEST_DELIVERY_ID, MAX_ID, Limits, message_frame
from bus.outbound import Outbound
from bus.policy import any_matches
from bus.schema import Validator
from bus.topics import Message, Removal, Subscription, TopicLimits, TopicTable

log = structlog.get_logger("bus.router")


class TopicOps:
    """The topic table of one router and the ops on it."""

    def __init__(self, lim: Limits, out: Outbound, inbound: Inbound, arts: ArtifactOps,
                 publish_params: Validator, seed: int) -> None:
        self.limits = lim
        self.table: TopicTable[Conn] = TopicTable(
            TopicLimits(lim.maxTopics, lim.maxSubscribersPerTopic, lim.maxSubscriptionsPerClient,
                        lim.maxBoundedDepth, lim.maxSubscriptionWindow, lim.maxQueuedTopicBytes),
            seed, Conn.label)
        self._out = out
        self._in = inbound
        self._arts = arts
        self._publish_params = publish_params

    def lean_publish(self, conn: Conn, p: dict[str, Any]) -> None:
        """topics.md §3.4 notification form: success sends nothing; a refusal is one
        `bus.publishFailed`; a frame naming no topic cannot be answered and closes."""
        if self._in.before_hello(conn):
            return
        out = self._out
        name = p.get("topic")
        if type(name) is not str:
            out.close(conn, "INVALID_REQUEST", "a bus.publish notification needs a string topic")
            return
        out.counters["leanPublishes"] += 1
        problem = self._publish_params(p) or self._in.body_refused(strict=True)
        try:
            if problem is not None:
                raise InvalidParams(f"bus.publish: {problem}")
            self.op_publish(conn, p, 0)
        except BusError as exc:
            out.count_error(exc.name)
            topic = self.table.topics.get(name)
            out.notice(conn, "bus.publishFailed", {
                "topic": name,
                "topicIncarnation": None if topic is None else topic.incarnation,
                "error": error_object(exc.name, exc.message, "not-dispatched"),
            })

    def op_declare(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        name: str = p["topic"]
        if not any_matches(conn.grants.manage, name):
            raise NotAuthorized(f"no manage grant for {name}")
        topic = self.table.declare(conn, name, p.get("retain", False), p.get("maxBounded", 0))
        log.info("bus.declare", connection_id=conn.connection_id, topic=name,
                 topic_incarnation=topic.incarnation)
        return {"topic": name, "topicIncarnation": topic.incarnation}

    def op_undeclare(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        removed, wake, released = self.table.undeclare(conn, p["topic"], p["topicIncarnation"])
        for other in wake:
            self._out.mark(other)
        self.messages_released(released)
        return {"removed": removed}

    def op_publish(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        """topics.md §3.4; every refusal after the params counts in `publishRefused`."""
        try:
            return self._publish(conn, p)
        except BusError:
            self._out.counters["publishRefused"] += 1
            raise

    def _publish(self, conn: Conn, p: dict[str, Any]) -> dict[str, Any]:
        name: str = p["topic"]
        if not any_matches(conn.grants.publish, name):
            raise NotAuthorized(f"no publish grant for {name}")
        payload, _ = self._in.body_bytes(p, "payload")
        table = self.table
        ids = p.get("attachments")
        arts: tuple[Artifact[Conn], ...] = ()
        if ids:  # checks 5–7 come after 3 and 4, before the transient 8 and 9
            current = table.topics.get(name)
            if current is None:
                raise NoTopic(f"no topic declared under {name}")
            expected = p["expectedIncarnation"]
            if expected is not None and expected != current.incarnation:
                raise TargetChanged(f"{name} is now {current.incarnation}, not {expected}")
            arts = self._arts.attachable(conn, ids)
        topic = table.check_publish(name, p["expectedIncarnation"], len(payload))
        size = len(message_frame(LONGEST_DELIVERY_ID, name, topic.incarnation,
                                 topic.sequence + 1, MAX_ID, conn.identity,
                                 orjson.Fragment(payload),
                                 [a.wire() for a in arts] if arts else None))
        if size > self.limits.maxEnvelopeBytes:
            raise InvalidEnvelope(f"the bus.message frame would be {size} bytes "
                                  f"(maxEnvelopeBytes {self.limits.maxEnvelopeBytes})")
        outcome = table.accept_publish(topic, conn.identity, payload)
        out = self._out
        out.counters["published"] += 1
        for other in outcome.wake:
            out.mark(other)
        if arts:
            msg = outcome.message
            if msg not in outcome.released:
                self._arts.ledger.root(msg, arts)
            if p.get("transfer"):
                self._arts.collect(self._arts.ledger.transfer(conn, arts))
        self.messages_released(outcome.released)
        return {"topic": name, "topicIncarnation": topic.incarnation,
                "sequence": outcome.message.sequence, "latest": outcome.latest,
                "bounded": outcome.bounded}

    def op_subscribe(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        name: str = p["topic"]
        mode = p["mode"]
        if (mode == "bounded") != ("depth" in p):
            raise InvalidParams("bus.subscribe: depth is required with bounded and refused "
                                "with latest")
        if not any_matches(conn.grants.subscribe, name):
            raise NotAuthorized(f"no subscribe grant for {name}")
        # its messages wait until the writer took the response enqueued right after (topics.md §4.2
        # r4)
        gate = conn.control_taken + len(conn.control) + 1
        sub, retained = self.table.subscribe(conn, name, mode, p.get("depth", 1),
                                             p.get("window", 1), p.get("retained", True), gate)
        topic = sub.topic
        self._out.mark(conn)
        return {"topic": name, "topicIncarnation": topic.incarnation,
                "sequence": topic.sequence, "retained": retained}

    def op_unsubscribe(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        removed, released = self.table.unsubscribe(conn, p["topic"])
        self.messages_released(released)
        return {"removed": removed}

    def op_topics(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        prefix: str = p.get("prefix", "")
        topics = self.table.topics
        out = []
        for name in sorted(topics):
            if not name.startswith(prefix):
                continue
            topic = topics[name]
            owner = topic.owner
            out.append({
                "topic": name,
                "topicIncarnation": topic.incarnation,
                "owner": {"clientId": owner.client_id,
                          "clientIncarnation": owner.client_incarnation},
                "retain": topic.retain,
                "maxBounded": topic.max_bounded,
                "sequence": topic.sequence,
                "latest": len(topic.subscriptions) - topic.bounded,
                "bounded": topic.bounded,
            })
        return {"topics": out}

    def release_message(self, conn: Conn, serial: int) -> int:
        """A message delivery's credit returns (topics.md §4.3); 1 if it was live, else 0."""
        entry = conn.messages.pop(serial, None)
        if entry is None:
            return 0
        sub, msg = entry
        ready, released = self.table.consume(sub, msg)
        if ready:
            self._out.mark(conn)
        ledger = self._arts.ledger
        if ledger.frames:
            ledger.unsee(conn, ledger.rooted(msg))
            if released is not None:
                self._arts.collect(ledger.unroot(msg))
        return 1

    def messages_released(self, released: tuple[Message, ...] | list[Message]) -> None:
        """Messages nothing references any more release their attachments (topics.md §5.2 rule
        3)."""
        if self._arts.ledger.frames:
            for msg in released:
                self._arts.unroot(msg)

    def frame(self, conn: Conn, sub: Subscription[Conn]) -> bytes:
        """The next frame of a ready subscription, for the topic lane: a `bus.message` (now
        a delivery of this connection) or its `bus.topicRemoved`."""
        item = self.table.take(sub)
        if isinstance(item, Removal):
            return orjson.dumps({"jsonrpc": "2.0", "method": "bus.topicRemoved", "params": {
                "topic": item.topic, "topicIncarnation": item.incarnation,
                "reason": item.reason}})
        msg, skipped = item
        conn.dlv += 1
        serial = conn.dlv
        conn.messages[serial] = (sub, msg)
        self._out.counters["messagesDelivered"] += 1
        ledger = self._arts.ledger
        arts = ledger.rooted(msg) if ledger.frames else ()
        if arts:
            ledger.see(conn, arts)
        return message_frame(f"dlv-{serial}", msg.topic, msg.incarnation, msg.sequence, skipped,
                             msg.publisher, orjson.Fragment(msg.payload),
                             [a.wire() for a in arts] if arts else None)

    def forget_connection(self, conn: Conn) -> None:
        """design/wire.md §10.2 steps 7 and 8: its subscriptions and written messages; the topics it
        owns (topics.md §11)."""
        deliveries = list(conn.messages.values())
        conn.messages.clear()
        table = self.table
        if deliveries or conn in table.readers or conn in table.owned:
            wake, released = table.forget_connection(conn, deliveries)
            for other in wake:
                self._out.mark(other)
            self.messages_released(released)
