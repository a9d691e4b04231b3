"""The pure artifact ledger (docs/topics.md §5.2, §6, §13; §17 test 170).

A hypothesis state machine drives `ArtifactLedger` through allocate, seal, retain, drop, frame
roots (a call, a result or a message: rooted, maybe delivered, then consumed or dropped) and
connection ends, against a plain model of holds, roots and sight, and checks the rules of the
module after every step.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from bus.artifacts import Artifact, ArtifactLedger, ArtifactState, StoreLimits
from bus.errors import BusError, QuotaExceeded

CONNS = st.integers(0, 3)
LIMITS = StoreLimits(max_artifact_bytes=40, max_artifacts=6, max_store_bytes=100,
                     max_held_bytes_per_client=60, max_holds_per_client=3,
                     max_allocations_per_client=2)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger: ArtifactLedger[int] = ArtifactLedger(LIMITS, 500)
        self.lengths: dict[str, int] = {}  # every id ever issued
        self.holds: dict[int, set[str]] = {}
        self.frames: dict[int, tuple[str, ...]] = {}  # frame key -> attachments it roots
        self.delivered: dict[int, int] = {}  # frame key -> the connection it was written to
        self.collected: set[str] = set()
        self.next_key = 0

    # model ------------------------------------------------------------------------------
    def rooted(self) -> set[str]:
        live = {i for held in self.holds.values() for i in held}
        return live | {i for ids in self.frames.values() for i in ids}

    def sight(self, conn: int) -> set[str]:
        seen = set(self.holds.get(conn, ()))
        for key, to in self.delivered.items():
            if to == conn:
                seen.update(self.frames[key])
        return seen

    def settle(self, before: set[str], returned: list[Artifact[int]]) -> None:
        """What an operation collected is exactly what lost its last root, once each."""
        ids = [a.artifact_id for a in returned]
        assert len(ids) == len(set(ids))
        assert not set(ids) & self.collected
        assert set(ids) == before - self.rooted()
        self.collected.update(ids)
        for art in returned:
            assert art.state is ArtifactState.COLLECTED

    def snapshot(self) -> object:
        ledger = self.ledger
        return (sorted(ledger.artifacts), {c: sorted(h) for c, h in ledger.holds.items()},
                dict(ledger.held_bytes), dict(ledger.allocations), ledger.bytes,
                ledger.hold_count, {c: dict(s) for c, s in ledger.sight.items()},
                sorted(ledger.frames), ledger.next_serial)

    def pick(self, conn: int, data: st.DataObject) -> list[str]:
        """Ids to attach or retain: mostly ones `conn` can see, sometimes any issued id."""
        seen = sorted(self.sight(conn))
        ids = sorted(self.lengths)
        pool = st.sampled_from(seen) if seen else st.sampled_from(ids)
        strategy = st.one_of(st.lists(pool, min_size=1, max_size=3, unique=True),
                             st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True))
        return data.draw(strategy)

    # rules ------------------------------------------------------------------------------
    @rule(conn=CONNS, length=st.integers(1, 45))
    def allocate(self, conn: int, length: int) -> None:
        before = self.snapshot()
        try:
            self.ledger.check_allocate(conn, length)
        except QuotaExceeded:
            assert self.snapshot() == before
            return
        art = self.ledger.allocate(conn, length, ("dev", length))
        assert art.artifact_id not in self.lengths
        self.lengths[art.artifact_id] = length
        self.holds.setdefault(conn, set()).add(art.artifact_id)

    @rule(conn=CONNS, data=st.data())
    def seal(self, conn: int, data: st.DataObject) -> None:
        ids = sorted(self.lengths)
        if not ids:
            return
        artifact_id = data.draw(st.sampled_from(ids))
        live = self.ledger.artifacts.get(artifact_id)
        if live is not None and data.draw(st.booleans()):
            conn = live.owner  # mostly its allocator, sometimes another connection
        before = self.snapshot()
        try:
            art = self.ledger.check_seal(conn, artifact_id)
        except BusError:
            assert self.snapshot() == before
            return
        assert art.owner == conn and art.state is ArtifactState.ALLOCATED
        self.ledger.seal(art, "d" * 64)

    @rule(conn=CONNS, data=st.data())
    def retain(self, conn: int, data: st.DataObject) -> None:
        ids = sorted(self.lengths)
        if not ids:
            return
        chosen = self.pick(conn, data)
        before = self.snapshot()
        try:
            self.ledger.retain(conn, chosen)
        except BusError:
            assert self.snapshot() == before
            return
        assert set(chosen) <= self.sight(conn)  # A3: only what it sees
        self.holds.setdefault(conn, set()).update(chosen)

    @rule(conn=CONNS, data=st.data())
    def drop(self, conn: int, data: st.DataObject) -> None:
        ids = sorted(self.lengths) or ["art-1"]
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True))
        before = self.rooted()
        held = self.holds.get(conn, set())
        expected = len(held & set(chosen))
        dropped, collected = self.ledger.drop(conn, chosen)
        assert dropped == expected
        held -= set(chosen)
        self.settle(before, collected)

    @rule(conn=CONNS, transfer=st.booleans(), data=st.data())
    def root(self, conn: int, transfer: bool, data: st.DataObject) -> None:
        """A call, reply or publish from `conn` attaching artifacts (checks A1–A3)."""
        ids = sorted(self.lengths)
        if not ids:
            return
        chosen = self.pick(conn, data)
        before_snapshot = self.snapshot()
        try:
            arts = self.ledger.attachable(conn, chosen)
        except BusError:
            assert self.snapshot() == before_snapshot
            return
        assert set(chosen) <= self.sight(conn)
        key = self.next_key
        self.next_key += 1
        self.ledger.root(key, arts)
        self.frames[key] = tuple(chosen)
        if transfer:
            before = self.rooted()
            collected = self.ledger.transfer(conn, arts)
            self.holds.get(conn, set()).difference_update(chosen)
            self.settle(before, collected)

    @precondition(lambda self: any(k not in self.delivered for k in self.frames))
    @rule(conn=CONNS, data=st.data())
    def deliver(self, conn: int, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(k for k in self.frames if k not in self.delivered)))
        self.ledger.see(conn, self.ledger.rooted(key))
        self.delivered[key] = conn

    @precondition(lambda self: bool(self.delivered))
    @rule(data=st.data())
    def consume(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.delivered)))
        conn = self.delivered.pop(key)
        before = self.rooted()
        self.ledger.unsee(conn, self.ledger.rooted(key))
        del self.frames[key]
        self.settle(before, self.ledger.unroot(key))

    @precondition(lambda self: any(k not in self.delivered for k in self.frames))
    @rule(data=st.data())
    def unroot(self, data: st.DataObject) -> None:
        """A frame that leaves undelivered (a cancelled call, a replaced message)."""
        key = data.draw(st.sampled_from(sorted(k for k in self.frames if k not in self.delivered)))
        before = self.rooted()
        del self.frames[key]
        self.settle(before, self.ledger.unroot(key))

    @rule(conn=CONNS)
    def forget_connection(self, conn: int) -> None:
        """Teardown: its deliveries' roots end, then its holds and sight."""
        before = self.rooted()
        collected: list[Artifact[int]] = []
        for key in sorted(k for k, to in self.delivered.items() if to == conn):
            del self.delivered[key]
            del self.frames[key]
            collected += self.ledger.unroot(key)
        collected += self.ledger.forget_connection(conn)
        self.holds.pop(conn, None)
        self.settle(before, collected)

    # invariants -------------------------------------------------------------------------
    @invariant()
    def live_exactly_while_rooted(self) -> None:
        assert set(self.ledger.artifacts) == self.rooted()
        assert not set(self.ledger.artifacts) & self.collected

    @invariant()
    def store_bytes(self) -> None:
        total = sum(self.lengths[i] for i in self.ledger.artifacts)
        assert self.ledger.bytes == total <= LIMITS.max_store_bytes
        assert len(self.ledger.artifacts) <= LIMITS.max_artifacts
        allocated = [a for a in self.ledger.artifacts.values()
                     if a.state is ArtifactState.ALLOCATED]
        assert self.ledger.allocated == len(allocated)
        assert dict(self.ledger.allocations) == dict(Counter(a.owner for a in allocated))

    @invariant()
    def held_bytes(self) -> None:
        for conn in range(4):
            held = self.holds.get(conn, set())
            assert set(self.ledger.holds.get(conn, {})) == held
            total = sum(self.lengths[i] for i in held)
            assert self.ledger.held_bytes.get(conn, 0) == total
            assert total <= LIMITS.max_held_bytes_per_client
            assert len(held) <= LIMITS.max_holds_per_client
        assert self.ledger.hold_count == sum(len(h) for h in self.holds.values())

    @invariant()
    def sight_only_from_holds_and_deliveries(self) -> None:
        for conn in range(4):
            for artifact_id in self.lengths:
                assert self.ledger.sees(conn, artifact_id) == (artifact_id in self.sight(conn))

    @invariant()
    def allocated_artifacts_have_only_their_allocators_hold(self) -> None:
        for art in self.ledger.artifacts.values():
            if art.state is ArtifactState.ALLOCATED:
                assert art.roots == 0
                assert art.artifact_id in self.holds.get(art.owner, set())


LedgerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
#: the pure ledger, not a wire test: 150 programs of 40 steps take seconds on a quiet host and
#: more under load, so its budget is its own (a hang still fails), not the wire tests' 10 s
test_artifact_ledger_state_machine = pytest.mark.timeout(120)(LedgerMachine.TestCase)
