"""The bounded checkpoint writer (state.md §5; §10 tests 36–43), on the memory store.

`MiniSession` plays the coordinator's part of §5.7 that the writer serves: steps append to
`PendingEffects`, a capture reserves a slot *before* asking anyone (`asked` counts the
participants' `State.Capture` round), submits, and `await_durable` audits per §5.5.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import pytest
from structlog.testing import capture_logs

from flyd.leases.stores.contract import Checkpoint, Effect, Transient
from flyd.state.envelope import MAX_PAYLOADS
from flyd.state.writer import (
    CaptureSubmission,
    CheckpointSettings,
    CheckpointWriter,
    Committed,
    DeadlineExpired,
    EnvelopeTooLarge,
    EventRing,
    Failed,
    ReplyLost,
    SaveOutcome,
    SaveTicket,
    Superseded,
    WriterFaults,
    audit_line,
)
from tests.state.conftest import RunCtx, behaviour, effect_rows, make_capture
from workers.types.domain import DomainError, ErrorCode, Mutation

EVENT_FIELDS = {"event", "run", "leaseEpoch", "checkpointId", "sessionId", "epoch", "episodeId",
                "boundary", "byteLength"}


class MiniSession:
    def __init__(self, writer: CheckpointWriter) -> None:
        self.writer = writer
        self.boundary = 0
        self.asked = 0
        self.audit: list[str] = []

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.boundary += 1
            self.writer.pending.append(self.boundary, "e1", behaviour(self.boundary))

    def capture(self, checkpoint_id: str, *, kind: str = "durable",
                world: bytes | None = None) -> SaveTicket:
        try:
            reservation = self.writer.reserve()
        except DomainError:
            self.audit.append(f"capture-refused:{checkpoint_id}")
            raise
        self.asked += 1
        manifest, payloads = make_capture(checkpoint_id, self.boundary, world=world)
        self.audit.append(f"captured:{checkpoint_id}@{self.boundary}")
        try:
            return self.writer.submit(reservation, CaptureSubmission(
                checkpoint_id, self.boundary, "e1", "ep-1", manifest, payloads,
                replaceable=kind == "hot"))
        except DomainError:
            self.audit.append(f"capture-refused:{checkpoint_id}")
            raise

    async def await_durable(self, ticket: SaveTicket, budget: float | None = None
                            ) -> SaveOutcome:
        outcome = await self.writer.wait(ticket, budget)
        self.audit.append(audit_line(outcome, ticket.boundary))
        return outcome


@asynccontextmanager
async def running(writer: CheckpointWriter) -> AsyncIterator[MiniSession]:
    async with asyncio.TaskGroup() as tg:
        tg.create_task(writer.run())
        try:
            yield MiniSession(writer)
        finally:
            await writer.shutdown()


def gated(**config: Any) -> tuple[CheckpointSettings, WriterFaults, asyncio.Event]:
    gate = asyncio.Event()
    return CheckpointSettings(**config), WriterFaults(gate=gate), gate


async def stalled(faults: WriterFaults) -> None:
    """Wait until the writer has taken a job and waits at the gate."""
    async with asyncio.timeout(5):
        await faults.stalled.wait()


# 36
async def test_a_full_queue_refuses_before_anyone_is_asked(mem_run: RunCtx) -> None:
    config, faults, gate = gated(queue_capacity=1)
    writer = CheckpointWriter(mem_run.store, mem_run.path, config, faults=faults)
    async with running(writer) as s:
        s.step(2)
        first = s.capture("ck-1")
        await stalled(faults)                                # taken, waiting at the gate
        asked, queued = s.asked, writer.stats.queued
        with pytest.raises(DomainError) as info:
            s.capture("ck-2")
        err = info.value
        assert (err.code, err.mutation) == (ErrorCode.BUSY, Mutation.NONE)
        assert err.message == ("checkpoint writer is saturated: 1 of 1 captures outstanding")
        assert writer.stats.rejected == 1
        assert (s.asked, writer.stats.queued, writer.outstanding()) == (asked, queued, 1)
        assert s.audit[-1] == "capture-refused:ck-2"
        s.step()                                             # the session keeps stepping
        gate.set()
        assert await s.await_durable(first, 5) == Committed("ck-1", 2)


# 37
async def test_the_byte_budget_is_checked_at_submit(mem_run: RunCtx) -> None:
    mib = 1 << 20
    config, faults, _ = gated(max_queued_bytes=mib, max_envelope_bytes=4 * mib)
    writer = CheckpointWriter(mem_run.store, mem_run.path, config, faults=faults)
    async with running(writer) as s:
        s.step()
        with pytest.raises(DomainError) as info:
            s.capture("ck-big", world=bytes(mib + 1))
        err = info.value
        assert (err.code, err.mutation) == (ErrorCode.BUSY, Mutation.NONE)
        assert err.message.startswith("checkpoint writer byte budget: ")
        assert err.message.endswith(f" of {mib} bytes")
        assert writer.outstanding() == 0 and writer.queued_bytes == 0
        assert writer.stats.rejected == 1 and writer.stats.queued == 0
        with pytest.raises(DomainError) as info:                 # larger than any envelope
            s.capture("ck-huge", world=bytes(4 * mib + 1))
        assert info.value.code == ErrorCode.UNSUPPORTED
        assert "exceeds max_envelope_bytes" in info.value.message
        assert writer.outstanding() == 0 and writer.stats.rejected == 2


async def test_a_capture_with_more_payloads_than_an_envelope_holds_is_refused_at_submit(
        mem_run: RunCtx) -> None:
    """state.md §2.1: an envelope holds `MAX_PAYLOADS` (1024) payloads: a capture of exactly
    1024 commits and reads back whole; one with more can never commit, so it is refused at
    submit (`UNSUPPORTED`/`none`, both counts) and nothing is queued. (The widest session, 256
    agents, needs 516: tests/cli/test_wide_runs.py checkpoints it.)"""
    writer = CheckpointWriter(mem_run.store, mem_run.path, CheckpointSettings())
    async with running(writer) as s:
        s.step()
        manifest, full = make_capture("ck-full", s.boundary, helpers=MAX_PAYLOADS - 4)
        assert len(full) == 1024
        ticket = writer.submit(writer.reserve(), CaptureSubmission(
            "ck-full", s.boundary, "e1", "ep-1", manifest, full, replaceable=False))
        assert await s.await_durable(ticket, 5) == Committed("ck-full", s.boundary)
        head = await mem_run.store.head(mem_run.run_id)
        assert head is not None
        read = await mem_run.store.read(head)
        assert read.checkpoint_id == "ck-full" and read.payloads == tuple(full)
        manifest, payloads = make_capture("ck-wide", s.boundary)
        extra = [(f"helper-{i}", b"x") for i in range(MAX_PAYLOADS + 1 - len(payloads))]
        with pytest.raises(EnvelopeTooLarge) as info:
            writer.submit(writer.reserve(), CaptureSubmission(
                "ck-wide", s.boundary, "e1", "ep-1", manifest, payloads + extra,
                replaceable=False))
        err = info.value
        assert (err.code, err.mutation) == (ErrorCode.UNSUPPORTED, Mutation.NONE)
        assert err.payload_count == MAX_PAYLOADS + 1
        assert err.message == ("checkpoint of 1025 payloads exceeds the envelope's 1024 "
                               "(4 plus 2 per agent)")
        assert writer.outstanding() == 0 and writer.stats.rejected == 1
        assert writer.stats.queued == 1 and writer.stats.committed == 1  # ck-full alone


# 38
async def test_a_durable_capture_is_never_coalesced(mem_run: RunCtx) -> None:
    config, faults, gate = gated(queue_capacity=3)
    writer = CheckpointWriter(mem_run.store, mem_run.path, config, faults=faults)
    async with running(writer) as s:
        s.step()
        t1 = s.capture("ck-1")
        await stalled(faults)
        s.step()
        t2 = s.capture("ck-2")
        s.step()
        t3 = s.capture("ck-3")
        assert writer.stats.superseded == 0 and writer.outstanding() == 3
        gate.set()
        outcomes = [await s.await_durable(t, 5) for t in (t1, t2, t3)]
    assert outcomes == [Committed("ck-1", 1), Committed("ck-2", 2), Committed("ck-3", 3)]
    assert writer.stats.committed == 3 and writer.stats.superseded == 0
    assert [r.checkpoint_id for r in await mem_run.store.list(mem_run.run_id)] == [
        "ck-3", "ck-2", "ck-1"]


# 39
async def test_the_slot_is_free_when_the_outcome_arrives(mem_run: RunCtx) -> None:
    writer = CheckpointWriter(mem_run.store, mem_run.path, CheckpointSettings())
    seen: list[tuple[bool, int]] = []
    async with running(writer) as s:
        s.step()
        ticket = s.capture("ck-1")
        assert writer.outstanding() == 1
        ticket.add_done_callback(lambda t: seen.append((t.done, writer.outstanding())))
        assert await s.await_durable(ticket, 5) == Committed("ck-1", 1)
    assert seen == [(True, 0)]


class FlakyPath:
    """The grant's path, failing its first `failures` sends with a server error."""

    def __init__(self, ctx: RunCtx, failures: int) -> None:
        self.inner = ctx.path
        self.run_id, self.lease_epoch = ctx.run_id, ctx.lease_epoch
        self.node_id = ctx.path.node_id
        self.failures = failures
        self.sent = 0

    async def commit(self, effects: Sequence[Effect], checkpoint: Checkpoint | None = None
                     ) -> None:
        self.sent += 1
        if self.sent <= self.failures:
            raise Transient("deadlock detected (40P01)")
        await self.inner.commit(effects, checkpoint)

    async def finish(self, state: Any, outcome: Mapping[str, Any],
                     effects: Sequence[Effect] = (), *, boundaries: int, session_epoch: int,
                     checkpoint: Checkpoint | None = None) -> None:
        raise AssertionError("not a final commit")


# 40
async def test_retry_then_release_repeats_the_whole_transaction(mem_run: RunCtx) -> None:
    path = FlakyPath(mem_run, failures=2)
    config = CheckpointSettings(retry="retry", retry_attempts=3, retry_backoff_s=0.01)
    writer = CheckpointWriter(mem_run.store, path, config)
    async with running(writer) as s:
        s.step(2)
        assert await s.await_durable(s.capture("ck-1"), 5) == Committed("ck-1", 2)
    assert path.sent == 3
    assert [r.checkpoint_id for r in await mem_run.store.list(mem_run.run_id)] == ["ck-1"]
    assert [k for k, _, _ in await effect_rows(mem_run)] == ["boundary-1", "boundary-2"]

    path = FlakyPath(mem_run, failures=1)
    writer = CheckpointWriter(mem_run.store, path, CheckpointSettings(retry="release"))
    writer.head = ("ck-1", 2)
    async with running(writer) as s:
        s.boundary = 2
        s.step()
        assert await s.await_durable(s.capture("ck-2"), 5) == Failed("ck-2", "transient")
        assert len(writer.pending) == 1                      # kept for the next capture
    assert path.sent == 1 and writer.stats.failed == 1


# 41
async def test_reply_lost_and_deadline_expired_are_different_facts(mem_run: RunCtx) -> None:
    faults = WriterFaults(drop_reply_for="ck-1")
    writer = CheckpointWriter(mem_run.store, mem_run.path, CheckpointSettings(), faults=faults)
    async with running(writer) as s:
        s.step()
        lost = await s.await_durable(s.capture("ck-1"), 5)
        assert lost == ReplyLost("ck-1") and not lost.is_durable()
        assert faults.fired == ["drop_reply:ck-1"]
        assert s.audit[-1] == "not-durable:failed:ck-1@1"
        assert await mem_run.store.lookup(mem_run.run_id, "ck-1") is not None   # it landed

        gate = asyncio.Event()
        faults.gate = gate
        s.step()
        ticket = s.capture("ck-2")
        late = await s.await_durable(ticket, 0.1)
        assert late == DeadlineExpired("ck-2") and not late.is_durable()
        assert s.audit[-1] == "not-durable:failed:ck-2@2"
        assert await mem_run.store.lookup(mem_run.run_id, "ck-2") is None
        gate.set()
        committed = await s.await_durable(ticket, 5)             # it may still commit: it did
        assert committed == Committed("ck-2", 2) and committed.is_durable()


# 42
async def test_events_and_audit_follow_the_outcome(mem_run: RunCtx) -> None:
    events: list[dict[str, Any]] = []
    config, faults, gate = gated(queue_capacity=3)
    faults.abort_before_commit_for = "ck-4"
    writer = CheckpointWriter(mem_run.store, mem_run.path, config, faults=faults,
                              sink=lambda e: events.append(dict(e)))
    async with running(writer) as s:
        s.step()
        t1 = s.capture("ck-1")
        await stalled(faults)
        s.step()
        t2 = s.capture("ck-2", kind="hot")
        s.step()
        t3 = s.capture("ck-3", kind="hot")
        assert await s.await_durable(t2, 5) == Superseded("ck-2", by="ck-3")
        gate.set()
        assert await s.await_durable(t1, 5) == Committed("ck-1", 1)
        assert await s.await_durable(t3, 5) == Committed("ck-3", 3)
        t4 = s.capture("ck-4")
        assert await s.await_durable(t4, 5) == Failed("ck-4", "aborted before commit")
    assert [(e["event"], e["checkpointId"]) for e in events] == [
        ("queued", "ck-1"), ("queued", "ck-2"), ("superseded", "ck-2"), ("queued", "ck-3"),
        ("committed", "ck-1"), ("committed", "ck-3"), ("queued", "ck-4"), ("failed", "ck-4")]
    for e in events:
        extra = set(e) - EVENT_FIELDS
        assert EVENT_FIELDS <= set(e)
        assert extra == {"superseded": {"supersededBy"}, "failed": {"reason"}}.get(
            e["event"], set())
        assert (e["run"], e["leaseEpoch"], e["sessionId"], e["epoch"], e["episodeId"]) == (
            mem_run.run_id, 1, "demo", "e1", "ep-1")
        assert e["byteLength"] > 0
    assert events[2]["supersededBy"] == "ck-3" and events[2]["boundary"] == 2
    assert events[-1]["reason"] == "aborted before commit"
    assert [a for a in s.audit if not a.startswith("captured:")] == [
        "not-durable:superseded:ck-2@2", "durable:ck-1@1", "durable:ck-3@3",
        "not-durable:failed:ck-4@3"]
    assert (writer.stats.queued, writer.stats.committed, writer.stats.failed,
            writer.stats.superseded) == (4, 2, 1, 1)
    # ck-3 carried every effect through its boundary, the superseded ck-2's included
    assert [(k, c) for k, _, c in await effect_rows(mem_run)] == [
        ("boundary-1", "ck-1"), ("boundary-2", "ck-3"), ("boundary-3", "ck-3")]

    def broken(event: Mapping[str, Any]) -> None:
        raise OSError("sink gone")

    writer = CheckpointWriter(mem_run.store, mem_run.path, CheckpointSettings(), sink=broken,
                              head=("ck-3", 3))
    async with running(writer) as s:
        s.boundary = 3
        s.step()
        assert await s.await_durable(s.capture("ck-5"), 5) == Committed("ck-5", 4)
    assert writer.stats.events_dropped == 2 and writer.stats.committed == 1

    ring = EventRing()
    writer = CheckpointWriter(mem_run.store, mem_run.path, CheckpointSettings(), sink=ring,
                              head=("ck-5", 4))
    with capture_logs() as logs:
        async with running(writer) as s:
            s.boundary = 4
            s.step()
            assert await s.await_durable(s.capture("ck-6"), 5) == Committed("ck-6", 5)
    assert [e["event"] for e in ring.ring] == ["queued", "committed"]
    line = next(entry for entry in logs if entry["event"] == "checkpoint.committed")
    assert (line["checkpoint_id"], line["lease_epoch"], line["byte_length"]) == (
        "ck-6", 1, ring.ring[1]["byteLength"])


# 43
async def test_shutdown_ends_every_queued_job_explicitly(mem_run: RunCtx) -> None:
    config, faults, gate = gated(queue_capacity=3)
    writer = CheckpointWriter(mem_run.store, mem_run.path, config, faults=faults)
    s = MiniSession(writer)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(writer.run())
        s.step()
        t1 = s.capture("ck-1")
        await stalled(faults)
        s.step()
        t2 = s.capture("ck-2")
        t3 = s.capture("ck-3", kind="hot")
        stopping = tg.create_task(writer.shutdown())
        assert await writer.wait(t2, 1) == Failed("ck-2", "writer stopped")
        assert await writer.wait(t3, 1) == Failed("ck-3", "writer stopped")
        with pytest.raises(DomainError) as info:
            writer.reserve()
        assert info.value.code == ErrorCode.BUSY
        gate.set()                                           # the current job finishes
        await stopping
    assert await writer.wait(t1, 1) == Committed("ck-1", 1)
    assert writer.outstanding() == 0 and writer.queued_bytes == 0
    assert (writer.stats.committed, writer.stats.failed) == (1, 2)

    # a current job that cannot finish in time is cancelled and its ticket closed
    config, faults, gate = gated(durable_timeout_s=0.2)
    writer = CheckpointWriter(mem_run.store, mem_run.path, config, faults=faults,
                              head=("ck-1", 1))
    async with asyncio.TaskGroup() as tg:
        tg.create_task(writer.run())
        s.writer = writer
        s.step()
        stuck = s.capture("ck-4")
        await stalled(faults)
        await writer.shutdown()
    assert await writer.wait(stuck, 1) == ReplyLost("ck-4")
    assert writer.outstanding() == 0
