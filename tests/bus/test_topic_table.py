"""The pure topic books and lane turn (docs/topics.md §13; §17 tests 168-169)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bus.errors import BusError
from bus.lanes import TOPIC_TURN, Lane, LaneTurn
from bus.topics import Message, Removal, Subscription, TopicLimits, TopicTable

ROOT = Path(__file__).resolve().parents[2]
CONNS = st.integers(0, 3)
NAMES = st.sampled_from(["t.a", "t.b", "t.c"])
LIMITS = TopicLimits(max_topics=2, max_subscribers_per_topic=3, max_subscriptions_per_client=2,
                     max_bounded_depth=3, max_subscription_window=2,
                     max_queued_topic_bytes=40)


class TopicMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table: TopicTable[int] = TopicTable(LIMITS, 1, str)
        self.deliveries: list[tuple[int, Subscription[int], Message]] = []
        self.accepted: dict[str, list[int]] = {}  # incarnation -> sequences accepted

    def snapshot(self) -> Any:
        t = self.table
        subs = sorted(
            (c, s.incarnation, s.mode, tuple(m.sequence for m in s.queue), s.skipped,
             s.unconsumed, s.closing)
            for c, reader in t.readers.items() for s in reader.subs)
        topics = sorted((n, x.incarnation, x.sequence,
                         None if x.retained is None else x.retained.sequence)
                        for n, x in t.topics.items())
        return (subs, topics, t.queued_bytes, t.queued_messages, t.deliveries, t.replaced,
                t.dropped, t.subscriptions)

    @rule(conn=CONNS, name=NAMES, retain=st.booleans(), max_bounded=st.integers(0, 4))
    def declare(self, conn: int, name: str, retain: bool, max_bounded: int) -> None:
        before = self.snapshot()
        try:
            topic = self.table.declare(conn, name, retain, max_bounded)
        except BusError:
            assert self.snapshot() == before
            return
        self.accepted[topic.incarnation] = []

    @rule(conn=CONNS, name=NAMES, size=st.integers(1, 25))
    def publish(self, conn: int, name: str, size: int) -> None:
        before = self.snapshot()
        payload = b"x" * size
        try:
            topic = self.table.check_publish(name, None, size)
        except BusError:
            assert self.snapshot() == before  # a refused publish changed nothing
            return
        outcome = self.table.accept_publish(topic, conn, payload)
        self.accepted[topic.incarnation].append(outcome.message.sequence)

    @rule(conn=CONNS, name=NAMES, bounded=st.booleans(), depth=st.integers(1, 4),
          window=st.integers(1, 3), retained=st.booleans())
    def subscribe(self, conn: int, name: str, bounded: bool, depth: int, window: int,
                  retained: bool) -> None:
        before = self.snapshot()
        try:
            self.table.subscribe(conn, name, "bounded" if bounded else "latest", depth, window,
                                 retained, 0)
        except BusError:
            assert self.snapshot() == before

    @rule(conn=CONNS)
    def take(self, conn: int) -> None:
        sub = self.table.next_ready(conn, 2**53)
        if sub is None:
            return
        assert sub.unconsumed < sub.window or (sub.closing and not sub.queue)
        item = self.table.take(sub)
        if isinstance(item, Removal):
            assert item.incarnation == sub.incarnation
            return
        msg, _ = item
        self.deliveries.append((conn, sub, msg))

    @precondition(lambda self: self.deliveries)
    @rule(data=st.data())
    def consume(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.deliveries) - 1))
        _, sub, msg = self.deliveries.pop(index)
        self.table.consume(sub, msg)

    @rule(conn=CONNS, name=NAMES)
    def unsubscribe(self, conn: int, name: str) -> None:
        self.table.unsubscribe(conn, name)

    @rule(name=NAMES)
    def remove(self, name: str) -> None:
        topic = self.table.topics.get(name)
        if topic is not None:
            removed, _, _ = self.table.undeclare(topic.owner, name, topic.incarnation)
            assert removed

    @rule(conn=CONNS)
    def forget_connection(self, conn: int) -> None:
        mine = [(s, m) for c, s, m in self.deliveries if c == conn]
        self.deliveries = [d for d in self.deliveries if d[0] != conn]
        self.table.forget_connection(conn, mine)
        assert conn not in self.table.readers and conn not in self.table.owned

    @invariant()
    def books_balance(self) -> None:
        t = self.table
        for sequences in self.accepted.values():
            assert sequences == list(range(1, len(sequences) + 1))  # gapless
        queued: dict[int, int] = {}
        delivered: dict[int, int] = {}
        messages: dict[int, Message] = {}
        subs = [s for reader in t.readers.values() for s in reader.subs]
        for topic in t.topics.values():
            if topic.retained is not None:
                queued[id(topic.retained)] = queued.get(id(topic.retained), 0) + 1
                messages[id(topic.retained)] = topic.retained
        for sub in subs:
            assert len(sub.queue) <= (sub.depth if sub.mode == "bounded" else 1)
            assert sub.unconsumed <= sub.window
            for m in sub.queue:
                queued[id(m)] = queued.get(id(m), 0) + 1
                messages[id(m)] = m
        for _, _, m in self.deliveries:
            delivered[id(m)] = delivered.get(id(m), 0) + 1
            messages[id(m)] = m
        for key, m in messages.items():
            assert m.queued == queued.get(key, 0)
            assert m.delivered == delivered.get(key, 0)
        assert t.queued_bytes == sum(len(messages[k].payload) for k in queued)
        assert t.queued_bytes <= LIMITS.max_queued_topic_bytes
        assert t.queued_messages == sum(len(s.queue) for s in subs)
        assert t.deliveries == len(self.deliveries)
        assert t.subscriptions == len(subs)
        for sub in subs:
            assert sub.unconsumed == sum(1 for _, s, _ in self.deliveries if s is sub)


TopicMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_topic_table_state_machine = TopicMachine.TestCase


def test_lane_turn() -> None:
    turn = LaneTurn()
    picks = [turn.pick(True, True) for _ in range(17 * 6)]
    assert [k for k, lane in enumerate(picks, 1) if lane is Lane.TOPIC] == list(
        range(17, 17 * 6 + 1, 17))
    assert TOPIC_TURN == 16
    idle = LaneTurn()
    assert [idle.pick(True, False) for _ in range(20)] == [Lane.TOPIC] * 20
    assert idle.pick(False, False) is None and idle.since_topic == 0
    assert idle.pick(False, True) is Lane.OTHER and idle.since_topic == 1
    # the pure state machines import no module that does I/O
    for module in ("bus/topics.py", "bus/lanes.py", "bus/artifacts.py"):
        assert not imports_of(module) & FORBIDDEN, module


FORBIDDEN = {"asyncio", "os", "socket", "mmap", "fcntl"}


def imports_of(module: str) -> set[str]:
    tree = ast.parse((ROOT / module).read_text(encoding="utf-8"))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    return imported
