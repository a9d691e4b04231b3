"""Bounded per-step history (issue 17, flat memory): a node's session keeps what a long run needs
and nothing more, with the same answers as the unbounded forms."""

from __future__ import annotations

import random
from typing import Any

import pytest

from flyd.session.audit import AuditLog
from flyd.session.phase import PhaseMachine, Preparing, Ready
from flyd.session.stats import Metrics
from flyd.session.trace import RecordStream, TraceLog
from workers.environment import BatchSet
from workers.types.canonical import canonical, digest_of
from workers.types.domain import DomainError


def behaviour(step: int, events: int) -> dict[str, Any]:
    ids = [f"ev-{step}-{i}" for i in range(events)]
    return {"scope": {"sessionId": "s", "epoch": "e1", "step": str(step)}, "agents": [],
            "acknowledgedBoundary": str(step + 1), "publishedBoundary": str(step + 1),
            "outcomeIds": ids, "eventIds": ids}


def test_a_bounded_trace_counts_and_cuts_exactly_like_the_whole_trace() -> None:
    rng = random.Random(7)
    whole, bounded = TraceLog(), TraceLog(keep=4, horizon=50)
    for step in range(300):
        b = behaviour(step, rng.randrange(4))
        whole.record(b, {})
        bounded.record(b, {})
        assert bounded.events() == whole.events() == sum(
            len(t.behaviour["eventIds"]) for t in whole.transitions)
    assert len(bounded.transitions) < 8
    assert bounded.cut(270) == whole.cut(270) == (271, 300)
    assert bounded.events() == whole.events()
    assert bounded.cut(280) is None and whole.cut(280) is None
    with pytest.raises(DomainError, match="history starts after"):
        bounded.cut(200)


def test_bounded_audit_phase_log_and_metrics_keep_the_newest() -> None:
    audit = AuditLog(limit=3)
    for k in range(10):
        audit.add(f"advance:{k}")
    assert audit.entries() == ["advance:7", "advance:8", "advance:9"]
    assert audit.index_of("advance:8") == 1 and "advance:0" not in audit
    machine = PhaseMachine(log_limit=2)
    machine.move(Ready(0))
    machine.move(Preparing(0))
    machine.fail()
    assert [target for _, target in machine.phase_log][-1].label == "Failed"
    assert len(machine.phase_log) == 2
    metrics = Metrics(window=4)
    for v in (5.0, 1.0, 2.0, 3.0, 4.0, 0.5):
        metrics.observe("step", v / 1e6)
    hist = metrics.histogram("step")
    assert hist["count"] == 6 and hist["max"] == 5.0
    assert hist["p50"] == 3.0


def test_a_record_stream_digests_every_record_and_keeps_only_the_tail() -> None:
    stream = RecordStream()
    records = [behaviour(k, 1) for k in range(10)]
    for r in records[:6]:
        stream.append(canonical(r))
    stream.settle(4)
    assert stream.digest() == digest_of(records[:6])
    stream.rewind(5)
    with pytest.raises(DomainError, match="durable"):
        stream.rewind(3)
    for r in records[5:]:
        stream.append(canonical(r))
    assert len(stream) == 10 and stream.digest() == digest_of(records)
    assert RecordStream().digest() == digest_of([])


def test_the_batch_set_is_exact_and_holds_ranges() -> None:
    rng = random.Random(3)
    ids = [f"batch-e1-{k}" for k in range(200)] + ["odd", "batch-e1-007", "batch-e2-5"]
    rng.shuffle(ids)
    batches, seen = BatchSet(), set()
    for batch_id in ids:
        assert (batch_id in batches) == (batch_id in seen)
        batches.add(batch_id)
        seen.add(batch_id)
    assert all(f"batch-e1-{k}" in batches for k in range(200))
    assert "batch-e1-200" not in batches and "batch-e3-1" not in batches
