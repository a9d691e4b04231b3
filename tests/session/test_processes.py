"""Tests 59–74: the session in every execution mode — orders, acknowledgements, slow and dead
participants, resolution bounds, supervision and the thread budget (session.md §6, §7)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psutil
import pytest

from bus.errors import BusError
from flyd.launch.budget import ThreadBudget
from flyd.launch.health import HealthPolicy
from flyd.launch.launcher import AlreadyGone, ExecutionMode, Stopped, Terminated
from flyd.session.calls import Deadlines
from flyd.session.fence import SessionFailure
from flyd.session.injections import Injections
from flyd.session.phase import Failed, Ready
from flyd.session.stats import ResolutionEnd
from flyd.session.transition import DispatchOrder
from tests.session.harness import (
    ALL_MODES,
    Fixture,
    SessionHarness,
    acknowledge_replies,
    within,
    worker_status,
)
from tests.session.worker_rig import agent_init_params, context_digest, prepare_params
from workers.faults import Faults
from workers.types.domain import DomainError, ErrorCode, Scope

pytestmark = pytest.mark.timeout(60)

STEPS = 4
AGENTS = ("fly-a", "fly-b")
BIG = 2**32 - 1

modes = pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.label())


async def clean_behaviour(mode: ExecutionMode, steps: int) -> tuple[list[str], int]:
    async with SessionHarness.start(Fixture(mode=mode)) as h:
        await h.bootstrap()
        await h.run(steps)
        return h.coordinator.trace.behaviour(), await h.progress_of("arena")


async def wait_for(predicate: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"not reached within {seconds} s")


async def test_sequential_reversed_and_parallel_completion_agree() -> None:
    faults = {"fly-a": Faults(prepare_delay_ms=12), "fly-b": Faults(commit_delay_ms=9)}
    lists = []
    for mode in ALL_MODES:
        for order in DispatchOrder:
            async with SessionHarness.start(Fixture(mode=mode, order=order, faults=faults)) as h:
                await h.bootstrap()
                await h.run(STEPS)
                lists.append(h.coordinator.trace.behaviour())
    assert len(lists) == 9
    assert all(x == lists[0] for x in lists)
    assert len(lists[0]) == STEPS


@modes
async def test_an_acknowledge_that_releases_nothing_is_not_a_failure(mode: ExecutionMode) -> None:
    async with SessionHarness.start(Fixture(mode=mode)) as h:
        await h.bootstrap()
        c = h.coordinator
        assert await acknowledge_replies(c, "fly-a", ["req-1", "req-2", "req-3"]) == []
        assert not c.fenced and c.phase == Ready(0)
        report = await h.step()
        assert report.boundary == 1 and c.stats.advances == 1


@modes
async def test_bootstrap_survives_the_second_acknowledge_its_resolution_makes(
        mode: ExecutionMode) -> None:
    fixture = Fixture(mode=mode, injections=Injections(duplicate_lifecycle_acknowledge=True))
    async with SessionHarness.start(fixture) as h:
        await h.bootstrap()
        c = h.coordinator
        assert not c.fenced and c.phase == Ready(0)
        assert (await h.step()).boundary == 1


async def test_an_acknowledged_id_outside_the_request_is_refused() -> None:
    fixture = Fixture(faults={"fly-a": Faults(acknowledge_extra_id="req-9999")})
    async with SessionHarness.start(fixture) as h:
        with pytest.raises(SessionFailure) as caught:
            await h.bootstrap()
        failure = caught.value
        assert (failure.code, failure.mutation) == ("IDENTITY_MISMATCH", "none")
        assert "never asked about" in failure.message
        assert failure.detail == "acknowledge" and failure.participant == "fly-a"


@modes
async def test_a_slow_participant_is_resolved_rather_than_failed(mode: ExecutionMode) -> None:
    faults = {"fly-b": Faults(prepare_delay_ms=500), "arena": Faults(advance_delay_ms=500)}
    async with SessionHarness.start(Fixture(mode=mode, faults=faults)) as h:
        await h.bootstrap()
        c = h.coordinator
        c.calls.deadlines = Deadlines(probe=0.12, resolve=15.0, resolve_attempts=BIG)
        await h.run(2)
        assert c.phase == Ready(2) and not c.fenced
        assert c.stats.resolutions >= 2
        assert c.stats.in_progress_replies > 0
        assert c.stats.last_resolution is ResolutionEnd.ANSWERED
        assert c.stats.advances == 2
        behaviour = c.trace.behaviour()
        progress = await h.progress_of("arena")
        batches = {t.behaviour["batchId"] for t in c.trace.transitions}
        ticks = [int(t.behaviour["agents"][0]["ticksAdvanced"]) for t in c.trace.transitions]
    clean, clean_progress = await clean_behaviour(mode, 2)
    assert behaviour == clean
    assert progress == clean_progress
    assert len(batches) == 2
    assert ticks == [16, 17]


@modes
async def test_a_resolution_says_which_of_its_two_bounds_ended_it(mode: ExecutionMode) -> None:
    faults = {"fly-a": Faults(prepare_delay_ms=600_000)}
    cases = [(Deadlines(probe=0.05, resolve=0.2, resolve_attempts=BIG),
              ResolutionEnd.BUDGET_EXPIRED, ("resolution budget", "200ms")),
             (Deadlines(probe=0.05, resolve=3600.0, resolve_attempts=3),
              ResolutionEnd.ATTEMPTS_EXHAUSTED, ("attempt guard", "3 attempts"))]
    for deadlines, end, words in cases:
        async with SessionHarness.start(Fixture(mode=mode, faults=faults)) as h:
            await h.bootstrap()
            c = h.coordinator
            c.calls.deadlines = deadlines
            with pytest.raises(SessionFailure) as caught:
                await h.step()
            failure = caught.value
            assert c.stats.last_resolution is end
            for word in words:
                assert word in failure.message
            if end is ResolutionEnd.BUDGET_EXPIRED:
                assert 1 <= c.stats.last_resolution_attempts < 100
            else:
                assert c.stats.last_resolution_attempts == 3
            assert (failure.code, failure.mutation) == ("BACKEND_FAILURE", "unknown")
            assert failure.participant == "fly-a" and failure.detail == "Agent.Prepare"
            assert c.fenced


@modes
async def test_a_delayed_one_agent_result_holds_the_world(mode: ExecutionMode) -> None:
    async with SessionHarness.start(Fixture(mode=mode,
                                            faults={"fly-b": Faults(prepare_delay_ms=400)})) as h:
        await h.bootstrap()
        c = h.coordinator
        step = asyncio.ensure_future(c.step())
        await asyncio.sleep(0.12)
        status = await h.launched.health_check("arena")
        assert status["state"] == "ready"
        assert status["progressCounter"] == "1"
        report = await within(step)
        assert report.boundary == 1
        for agent in AGENTS:
            i, j = c.audit.index_of(f"prepared:{agent}@0"), c.audit.index_of("advance:0")
            assert i is not None and j is not None and i < j
        assert c.stats.advances == 1


@modes
async def test_a_worker_death_has_a_bounded_diagnosed_outcome(mode: ExecutionMode) -> None:
    async with SessionHarness.start(Fixture(mode=mode,
                                            faults={"fly-b": Faults(prepare_delay_ms=5000)})) as h:
        await h.bootstrap()
        c = h.coordinator
        step = asyncio.ensure_future(c.step())

        async def preparing() -> bool:
            status = await h.status_of("fly-b")
            return status["state"] == "preparing" and status["activeRequestId"] is not None

        await wait_for(preparing)
        assert isinstance(await h.kill("fly-b"), Terminated)
        started = time.monotonic()
        with pytest.raises(SessionFailure) as caught:
            await within(step)
        assert time.monotonic() - started < 20
        failure = caught.value
        assert failure.participant == "fly-b"
        assert failure.mutation != "none"
        assert c.phase == Failed() and c.fenced
        assert c.stats.advances == 0
        assert c.audit.index_of("publish:1") is None
        with pytest.raises(SessionFailure) as again:
            await h.step()
        assert again.value.code == "INVALID_PHASE"


@modes
async def test_a_helper_death_has_a_bounded_diagnosed_outcome(mode: ExecutionMode) -> None:
    async with SessionHarness.start(Fixture(mode=mode,
                                            faults={"arena": Faults(advance_delay_ms=5000)})) as h:
        await h.bootstrap()
        c = h.coordinator
        step = asyncio.ensure_future(c.step())

        async def advanced() -> bool:
            return (await h.status_of("arena"))["lastBatchId"] is not None

        await wait_for(advanced)
        assert isinstance(await h.kill("arena"), Terminated)
        with pytest.raises(SessionFailure) as caught:
            await within(step)
        failure = caught.value
        assert failure.participant == "arena"
        assert failure.mutation != "none"
        assert c.phase == Failed() and c.fenced
        assert c.stats.advances == 0 and c.stats.commits == 0
        assert c.audit.index_of("publish:1") is None


@modes
async def test_an_uncertain_advance_never_creates_a_second_batch(mode: ExecutionMode) -> None:
    fixture = Fixture(mode=mode, injections=Injections(lose_advance_result_at=(2,)))
    async with SessionHarness.start(fixture) as h:
        await h.bootstrap()
        await h.run(STEPS)
        c = h.coordinator
        assert c.stats.advances == STEPS
        behaviour = c.trace.behaviour()
        progress = await h.progress_of("arena")
        assert len({t.behaviour["batchId"] for t in c.trace.transitions}) == STEPS
        lost = next(o for o in c.injections.log if o.what == "lost-advance-result")
        assert lost.identical
    clean, clean_progress = await clean_behaviour(mode, STEPS)
    assert behaviour == clean and progress == clean_progress


@modes
async def test_a_partial_commit_never_permits_next_step_play(mode: ExecutionMode) -> None:
    async with SessionHarness.start(Fixture(mode=mode,
                                            faults={"fly-b": Faults(fail_commit_at_step=1)})) as h:
        await h.bootstrap()
        c = h.coordinator
        await h.step()
        with pytest.raises(SessionFailure) as caught:
            await h.step()
        assert caught.value.participant == "fly-b"
        assert c.phase == Failed() and c.fenced
        progress = await h.progress_of("arena")
        with pytest.raises(SessionFailure) as again:
            await h.step()
        assert again.value.code == "INVALID_PHASE"
        assert await h.progress_of("arena") == progress
        assert (await h.status_of("arena"))["currentScope"]["step"] == "2"
        assert c.audit.index_of("publish:2") is None
        assert c.committed_boundary() is None


@modes
async def test_every_participant_answers_its_supervisor(mode: ExecutionMode) -> None:
    async with SessionHarness.start(Fixture(mode=mode)) as h:
        await h.bootstrap()
        launcher = h.launched
        ports = {"fly-a": "p1", "fly-b": "p2", "arena": None}
        for wid, launched in launcher.workers().items():
            identity = launched.identity
            assert identity.worker_id == wid
            assert launched.domain_incarnation == identity.incarnation_id
            assert launched.service_incarnation
            assert identity.port_id == ports[wid]
            assert (await launcher.health_check(wid))["state"] == "ready"
        c = h.coordinator
        hello = await c.calls.probe("fly-a", "Worker.Hello", None, {
            "sessionId": "demo", "expectedWorkerId": "fly-a", "role": "agent",
            "supportedMajors": [1]})
        assert hello["limits"]["workerThreads"] == launcher.get("fly-a").identity.worker_threads
        with pytest.raises(DomainError) as caught:
            await c.calls.probe("fly-a", "Worker.Hello", None, {
                "sessionId": "demo", "expectedWorkerId": "fly-z", "role": "agent",
                "supportedMajors": [1]})
        assert caught.value.code == ErrorCode.IDENTITY_MISMATCH
        pid = launcher.get("fly-a").pid
        assert isinstance(await launcher.reap("fly-a", "done"), Stopped)
        assert isinstance(await launcher.reap("fly-a", "done"), AlreadyGone)
        if mode is ExecutionMode.PROCESS:
            assert pid is not None
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == \
                psutil.STATUS_ZOMBIE


@modes
async def test_worker_threads_lie_within_the_launcher_allocation(mode: ExecutionMode) -> None:
    budget = ThreadBudget(4, 1)
    budget.open_session("s1")
    assert budget.remaining == 3
    budget.allocate("arena", 1)
    budget.allocate("fly-a", 2)
    with pytest.raises(DomainError) as busy:
        budget.allocate("fly-b", 1)
    assert busy.value.message == "fly-b wants 1 threads; 0 of 4 remain"
    assert budget.release("fly-a")
    budget.allocate("fly-b", 1)
    with pytest.raises(BusError) as refused:
        async with SessionHarness.start(Fixture(mode=mode, thread_budget=2)):
            pass
    assert refused.value.name == "QUOTA_EXCEEDED"
    async with SessionHarness.start(Fixture(mode=mode)) as h:
        c = h.coordinator
        with pytest.raises(DomainError) as caught:
            await c.calls.probe("fly-a", "Agent.Initialize", Scope("demo", "e1", 0),
                              agent_init_params("fly-a", threads=8))
        assert (caught.value.code, caught.value.mutation) == ("BUSY", "none")
        assert (await h.status_of("fly-a"))["state"] == "uninitialized"
        await h.bootstrap()
        assert c.phase == Ready(0)


async def test_a_router_restart_during_a_world_advance_fences_the_epoch() -> None:
    fixture = Fixture(mode=ExecutionMode.PROCESS, router="process",
                      health=HealthPolicy(probe=0.2, fail=0.5, boot=30.0),
                      faults={"arena": Faults(advance_delay_ms=3000)})
    async with SessionHarness.start(fixture) as h:
        await h.bootstrap()
        c = h.coordinator
        step = asyncio.ensure_future(c.step())
        await asyncio.sleep(0.25)
        started = time.monotonic()
        await h.router.shutdown()
        with pytest.raises(SessionFailure) as caught:
            await within(step)
        assert time.monotonic() - started < 20
        failure = caught.value
        assert failure.participant == "arena"
        assert failure.detail == "router"
        assert failure.mutation != "none"
        assert c.phase == Failed() and c.fenced
        assert c.media.count() == 0
        assert c.stats.advances == 0
        assert c.audit.index_of("publish:1") is None
        assert c.observation is not None and c.observation.boundary == 0
        with pytest.raises(SessionFailure) as again:
            await h.step()
        assert again.value.code == "INVALID_PHASE"


async def test_an_old_worker_reply_after_a_restart_is_rejected_on_stale_epoch_or_incarnation(
        ) -> None:
    async with SessionHarness.start(Fixture(mode=ExecutionMode.PROCESS)) as h:
        await h.bootstrap()
        await h.step()
        c = h.coordinator
        old = h.launched.get("fly-b")
        new = await h.restart_agent("fly-b")
        assert new.pid != old.pid
        assert new.service_incarnation != old.service_incarnation
        with pytest.raises(SessionFailure) as caught:
            await worker_status(c, "fly-b")
        assert caught.value.code == "IDENTITY_MISMATCH"
        assert caught.value.participant == "fly-b"
        assert c.phase == Failed() and c.fenced
        assert c.stats.advances == 1


async def test_a_restarted_worker_refuses_an_operation_from_the_old_epoch() -> None:
    async with SessionHarness.start(Fixture(mode=ExecutionMode.PROCESS)) as h:
        await h.bootstrap()
        await h.step()
        c = h.coordinator
        new = await h.restart_agent("fly-b")
        with pytest.raises(DomainError) as stale:
            await c.calls.probe("fly-a", "Agent.Prepare", Scope("demo", "e0", 1),
                              prepare_params("fly-a", context_digest(1)))
        assert (stale.value.code, stale.value.mutation) == ("STALE_EPOCH", "none")
        with pytest.raises(DomainError) as phase:
            await c.calls.probe("fly-b", "Agent.Prepare", Scope("demo", "e1", 1),
                              prepare_params("fly-b", context_digest(1)),
                              ref=new.worker_ref())
        assert (phase.value.code, phase.value.mutation) == ("INVALID_PHASE", "none")
        assert c.stats.advances == 1
        assert os.getpid() != new.pid
