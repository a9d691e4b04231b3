"""Tests 35–47: the lockstep transaction through the harness (session.md §6.5–§6.7, §6.9)."""

from __future__ import annotations

import asyncio
import json

import pytest

from flyd.session.audit import AuditLog
from flyd.session.fence import SessionFailure
from flyd.session.phase import Paused, Phase, Ready
from flyd.session.runspec import AgentSpec
from flyd.session.transition import DispatchOrder
from tests.session.harness import Fixture, SessionHarness, within
from workers.faults import Faults

pytestmark = pytest.mark.timeout(60)

STEPS = 3
AGENTS = ("fly-a", "fly-b")


def before(audit: AuditLog, first: str, second: str) -> bool:
    i, j = audit.index_of(first), audit.index_of(second)
    assert i is not None, first
    assert j is not None, second
    return i < j


async def test_one_world_advance_per_complete_batch() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        progress = await h.progress_of("arena")
        reports = await h.run(STEPS)
        c = h.coordinator
        assert len(reports) == STEPS
        assert c.stats.advances == STEPS
        assert c.phase == Ready(STEPS)
        assert c.observation is not None and c.observation.boundary == STEPS
        assert await h.progress_of("arena") == progress + STEPS
        assert c.audit.count("advance:0") == 1
        assert len(c.trace.transitions) == STEPS


async def test_every_agent_is_prepared_before_the_world_advances() -> None:
    faults = {"fly-a": Faults(prepare_delay_ms=15), "fly-b": Faults(prepare_delay_ms=1)}
    async with SessionHarness.start(Fixture(faults=faults)) as h:
        await h.bootstrap()
        await h.run(STEPS)
        for k in range(STEPS):
            for agent in AGENTS:
                assert before(h.coordinator.audit, f"prepared:{agent}@{k}", f"advance:{k}")


async def test_the_task_evaluates_each_transition_once() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        assert h.coordinator.evaluations() == 0
        await h.run(STEPS)
        assert h.coordinator.evaluations() == STEPS
        for k in range(STEPS):
            assert h.coordinator.audit.count(f"evaluate:{k}") == 1


async def test_every_agent_commits_before_the_next_prepare_or_publication() -> None:
    async with SessionHarness.start(Fixture(faults={"fly-a": Faults(commit_delay_ms=12)})) as h:
        await h.bootstrap()
        await h.run(STEPS)
        audit = h.coordinator.audit
        for k in range(STEPS):
            for agent in AGENTS:
                assert before(audit, f"committed:{agent}@{k}", f"publish:{k + 1}")
                if k + 1 < STEPS:
                    for other in AGENTS:
                        assert before(audit, f"committed:{agent}@{k}", f"prepared:{other}@{k + 1}")
        assert h.coordinator.stats.publications == STEPS + 1


async def test_a_60_hz_world_with_a_1_ms_tick_runs_16_17_17_per_agent_in_a_session() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        await h.run(STEPS)
        behaviour = [t.behaviour for t in h.coordinator.trace.transitions]
        for agent in AGENTS:
            rows = [next(a for a in b["agents"] if a["agentId"] == agent) for b in behaviour]
            ticks = [int(r["ticksAdvanced"]) for r in rows]
            assert ticks == [16, 17, 17]
            assert sum(ticks) == 50
            assert rows[-1]["remainder"] == {"numerator": "0", "denominator": "1"}
            assert rows[-1]["brainTicks"] == "60"


async def test_a_pause_mid_step_completes_the_step_and_pauses_at_the_boundary() -> None:
    faults = {"fly-a": Faults(commit_delay_ms=40), "fly-b": Faults(commit_delay_ms=60)}
    async with SessionHarness.start(Fixture(faults=faults)) as h:
        await h.bootstrap()
        c = h.coordinator
        first = await h.step()
        assert first.boundary == 1 and not first.paused
        step = asyncio.ensure_future(c.step())
        await asyncio.sleep(0.010)
        h.pause.request()
        report = await within(step)
        assert report.boundary == 2 and report.paused
        assert c.phase == Paused(2)
        assert c.stats.advances == 2
        for agent in AGENTS:
            assert before(c.audit, f"committed:{agent}@1", "pause:2")
        assert before(c.audit, "publish:2", "pause:2")
        status = await h.status_of("arena")
        assert status["currentScope"]["step"] == "2"
        c.resume()
        resumed: Phase = c.phase
        assert resumed == Ready(2)
        nxt = await h.step()
        assert nxt.boundary == 3 and not nxt.paused


async def test_bootstrap_cannot_advance_the_world_or_produce_a_reward() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        c = h.coordinator
        assert c.phase == Ready(0)
        assert c.observation is not None
        assert c.observation.boundary == 0
        assert c.observation.world_time.to_json() == {"numerator": "0", "denominator": "1"}
        assert c.stats.advances == 0
        assert c.evaluations() == 0
        status = await h.status_of("arena")
        assert status["currentScope"]["step"] == "0"
        assert status["lastBatchId"] is None
        for agent in AGENTS:
            assert await h.mutations_of(agent) >= 10
        progress = c.progress().value
        assert progress["totalReward"] == 0.0
        assert progress["transitions"] == 0


async def test_the_committed_snapshot_names_the_boundary_that_just_ended() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        feed = h.coordinator.snapshots.subscribe(depth=8, replay=True)
        await h.run(2)
        snapshots = [p.body for p in feed.pending() if p.kind == "snapshot"]
        assert [s["scope"]["step"] for s in snapshots] == ["0", "1", "2"]
        assert all(a["selectedDecision"] is None for a in snapshots[0]["agents"])
        for snap in snapshots[1:]:
            assert all(a["selectedDecision"] is not None for a in snap["agents"])
            views = snap["media"]["views"]
            assert [v["viewId"] for v in views] == ["arena"]
            assert views[0]["pixels"]["byteLength"] == "3072"


async def test_a_terminal_episode_pauses_at_its_own_boundary() -> None:
    async with SessionHarness.start(Fixture(terminal="after:3")) as h:
        await h.bootstrap()
        reports = await h.run(5)
        c = h.coordinator
        assert len(reports) == 3
        assert reports[-1].terminal and reports[-1].paused
        assert c.phase == Paused(3)
        assert c.episode_request is not None
        with pytest.raises(SessionFailure) as caught:
            await h.step()
        assert caught.value.code == "INVALID_PHASE"


async def test_status_answers_with_the_committed_boundary() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        await h.run(2)
        for agent in AGENTS:
            status = await h.status_of(agent)
            assert status["state"] == "ready"
            assert status["currentScope"]["step"] == "2"
            again = await h.status_of(agent)
            assert again["progressCounter"] == status["progressCounter"]


async def test_a_worker_refuses_a_second_initialize() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        with pytest.raises(SessionFailure) as caught:
            await h.bootstrap()
        failure = caught.value
        assert failure.code == "INVALID_PHASE"
        assert failure.detail == "Environment.Initialize"
        assert failure.participant == "arena"


async def test_a_single_agent_composition_runs_the_same_transaction() -> None:
    fixture = Fixture(agents=(AgentSpec("fly-a", "p1", seed=7),))
    async with SessionHarness.start(fixture) as h:
        await h.bootstrap()
        await h.run(STEPS)
        c = h.coordinator
        assert c.stats.advances == STEPS
        ticks = [int(t.behaviour["agents"][0]["ticksAdvanced"]) for t in c.trace.transitions]
        assert ticks == [16, 17, 17]


async def test_sequential_concurrent_and_reversed_orders_agree() -> None:
    faults = {"fly-a": Faults(prepare_delay_ms=12), "fly-b": Faults(commit_delay_ms=9)}
    lists = []
    for order in DispatchOrder:
        async with SessionHarness.start(Fixture(order=order, faults=faults)) as h:
            await h.bootstrap()
            await h.run(4)
            behaviour = h.coordinator.trace.behaviour()
            assert len(behaviour) == 4
            lists.append(behaviour)
            for op in h.coordinator.trace.operational():
                assert len(op["prepareRequestIds"]) == 2
                assert len(op["commitRequestIds"]) == 2
                assert all(r["requestId"] for r in op["prepareRequestIds"])
                assert all(r["requestId"] for r in op["commitRequestIds"])
    assert lists[0] == lists[1] == lists[2]
    assert json.loads(lists[0][0])["batchId"] == "batch-e1-0"
