"""Pure parts of the coordinator: `format_duration`, the publication feed, the audit log and
the trace record validation (session.md §6.8–§6.12). Not numbered in §8."""

from __future__ import annotations

import pytest

from flyd.session.audit import AuditLog
from flyd.session.calls import format_duration
from flyd.session.publication import Feed
from flyd.session.trace import TraceLog
from workers.types.domain import DomainError


def test_format_duration_picks_the_largest_whole_unit() -> None:
    assert format_duration(8.0) == "8s"
    assert format_duration(0.2) == "200ms"
    assert format_duration(0.00025) == "250us"
    assert format_duration(1.5e-7) == "150ns"
    assert format_duration(3600.0) == "3600s"


async def test_a_full_feed_queue_drops_its_oldest_entry() -> None:
    feed = Feed()
    feed.publish_descriptor({"revision": "1"})
    feed.publish_snapshot({"n": 0})
    sub = feed.subscribe(depth=2, replay=True)
    assert [p.kind for p in sub.pending()] == ["descriptor", "snapshot"]
    feed.publish_snapshot({"n": 1})
    assert sub.dropped == 1
    assert [p.body for p in sub.pending()] == [{"n": 0}, {"n": 1}]
    assert (await sub.__anext__()).body == {"n": 0}
    late = feed.subscribe(depth=8, replay=False)
    assert late.pending() == []


def test_an_unwatched_feed_builds_its_snapshot_only_when_read() -> None:
    feed = Feed()
    built: list[int] = []

    def body(n: int) -> dict[str, int]:
        built.append(n)
        return {"n": n}

    feed.publish_snapshot_on_read(lambda: body(0))
    feed.publish_snapshot_on_read(lambda: body(1))
    assert built == []  # nobody watches: no body was built
    assert feed.latest == {"n": 1} and feed.latest == {"n": 1}
    assert built == [1]  # the latest only, once
    sub = feed.subscribe(depth=4, replay=True)
    assert [p.body for p in sub.pending()] == [{"n": 1}]
    feed.publish_snapshot_on_read(lambda: body(2))
    assert built == [1, 2]  # a subscriber gets every body at once
    assert [p.body for p in sub.pending()] == [{"n": 1}, {"n": 2}]


def test_the_audit_log_finds_first_matches() -> None:
    audit = AuditLog()
    for entry in ("hello:arena", "advance:0", "advance:0"):
        audit.add(entry)
    assert audit.index_of("advance:0") == 1
    assert audit.index_of("publish:1") is None
    assert audit.count("advance:0") == 2
    assert "hello:arena" in audit


def test_a_trace_record_must_name_the_boundary_it_reached() -> None:
    behaviour = {"scope": {"sessionId": "demo", "epoch": "e1", "step": "0"},
                 "agents": [{"agentId": "fly-a", "committedStep": "1"}],
                 "acknowledgedBoundary": "1", "publishedBoundary": "1",
                 "outcomeIds": ["ev-1"], "eventIds": ["ev-1"]}
    trace = TraceLog()
    trace.record(behaviour, {})
    with pytest.raises(DomainError):
        trace.record({**behaviour, "publishedBoundary": "2"}, {})
    with pytest.raises(DomainError):
        trace.record({**behaviour, "eventIds": ["ev-1", "ev-1"]}, {})
    assert len(trace) == 1
