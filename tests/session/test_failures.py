"""Tests 48–58: duplicates, lost results, partial commits, replaced workers and bad media
(session.md §6.3, §6.4, §6.8, §6.13)."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass
from typing import Any

import pytest

from bus.errors import BusError
from flyd.launch.identities import WorkerRef
from flyd.launch.launcher import ExecutionMode
from flyd.session.calls import Deadlines
from flyd.session.fence import SessionFailure
from flyd.session.injections import LOSS_POLLS, InjectionOutcome, Injections
from flyd.session.phase import Failed
from flyd.session.stats import ResolutionEnd
from tests.session.harness import Fixture, SessionHarness, within, worker_status
from tests.session.worker_rig import context_digest, prepare_params
from workers.faults import Faults
from workers.types.domain import DomainError, Scope

pytestmark = pytest.mark.timeout(60)

STEPS = 4
INJECT_AT = 2
AGENTS = ("fly-a", "fly-b")


@dataclass
class Run:
    behaviour: list[str]
    mutations: dict[str, int]
    counter: int
    advances: int
    injections: list[InjectionOutcome]
    in_progress_replies: int


async def run_with(fixture: Fixture) -> Run:
    async with SessionHarness.start(fixture) as h:
        await h.bootstrap()
        await h.run(STEPS)
        c = h.coordinator
        return Run(c.trace.behaviour(), {a: await h.mutations_of(a) for a in AGENTS},
                   c.progress().value["counter"], c.stats.advances, list(c.injections.log),
                   c.stats.in_progress_replies)


_CLEAN: Run | None = None


async def clean() -> Run:
    global _CLEAN
    if _CLEAN is None:
        _CLEAN = await run_with(Fixture())
    return _CLEAN


async def assert_same(run: Run) -> None:
    reference = await clean()
    assert run.behaviour == reference.behaviour
    assert run.mutations == reference.mutations
    assert run.counter == reference.counter
    assert run.advances == reference.advances == STEPS
    assert reference.in_progress_replies == 0


def logged(run: Run, what: str) -> InjectionOutcome:
    return next(o for o in run.injections if o.what == what)


async def test_a_duplicate_prepare_after_a_lost_reply_repeats_nothing() -> None:
    run = await run_with(Fixture(injections=Injections(at_step=INJECT_AT,
                                                       duplicate_prepare="fly-a")))
    outcome = logged(run, "duplicate-prepare")
    assert outcome.code is None and outcome.identical
    await assert_same(run)


async def test_a_duplicate_commit_replays_without_a_second_reinforcement() -> None:
    run = await run_with(Fixture(injections=Injections(at_step=INJECT_AT,
                                                       duplicate_commit="fly-b")))
    outcome = logged(run, "duplicate-commit")
    assert outcome.code is None and outcome.identical
    await assert_same(run)


async def test_the_same_batch_with_altered_controls_conflicts() -> None:
    run = await run_with(Fixture(injections=Injections(at_step=INJECT_AT,
                                                       altered_advance_controls=True)))
    assert logged(run, "altered-advance-controls").code == "CONFLICT"
    await assert_same(run)


async def test_a_lost_advance_result_resolves_the_same_operation() -> None:
    run = await run_with(Fixture(injections=Injections(lose_advance_result_at=(INJECT_AT,))))
    assert logged(run, "lost-advance-result").identical
    assert logged(run, "status-after-loss").identical
    await assert_same(run)


async def test_status_polls_after_a_lost_result_end_within_the_resolve_budget() -> None:
    """A world that answers nothing (stopped) after a lost Advance result: the Worker.Status
    polls stop at the resolve budget, not after LOSS_POLLS probe deadlines (~100 s here), and the
    step fails in about two resolve budgets."""
    deadlines = Deadlines(probe=0.2, resolve=1.0)
    fixture = Fixture(mode=ExecutionMode.PROCESS, deadlines=deadlines,
                      injections=Injections(lose_advance_result_at=(1,)))
    assert LOSS_POLLS * deadlines.probe > 30 * deadlines.resolve  # the bound is what stops it
    async with SessionHarness.start(fixture) as h:
        await h.bootstrap()
        await h.step()
        pid = h.workers["arena"].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(SessionFailure) as caught:
                async with asyncio.timeout(30):
                    await h.coordinator.step()
        finally:
            os.kill(pid, signal.SIGCONT)
        assert caught.value.participant == "arena"
        polled = next(o for o in h.coordinator.injections.log if o.what == "status-after-loss")
        assert not polled.identical  # the world never answered: the case bit
        assert h.coordinator.stats.last_resolution is ResolutionEnd.BUDGET_EXPIRED
        # the fenced coordinator swaps its client and has closed the old one when it returns
        old = h.coordinator_client
        assert old is not None and not old.closed
        fresh = await h.client("ctl-replacement")
        try:
            await within(h.coordinator.replace_client(fresh))
            assert old.closed
            assert not fresh.closed
        finally:
            await fresh.close()


async def test_a_cached_artifact_consumed_by_its_first_caller_survives_a_retry() -> None:
    run = await run_with(Fixture(injections=Injections(
        at_step=INJECT_AT, consume_advance_artifact_then_retry=True)))
    outcome = logged(run, "cached-artifact-after-consumption")
    assert outcome.code is None and outcome.identical
    await assert_same(run)


async def test_one_commit_failing_after_another_succeeds_fails_the_epoch() -> None:
    faults = {"fly-b": Faults(fail_commit_at_step=1, commit_delay_ms=15)}
    async with SessionHarness.start(Fixture(faults=faults)) as h:
        await h.bootstrap()
        c = h.coordinator
        await h.step()
        with pytest.raises(SessionFailure) as caught:
            await h.step()
        failure = caught.value
        assert (failure.code, failure.mutation) == ("BACKEND_FAILURE", "applied")
        assert failure.detail == "commit" and failure.participant == "fly-b"
        assert c.phase == Failed()
        assert c.stats.advances == 1
        assert (await h.status_of("arena"))["currentScope"]["step"] == "2"
        with pytest.raises(SessionFailure) as again:
            await h.step()
        assert again.value.code == "INVALID_PHASE"
        assert (await h.status_of("arena"))["currentScope"]["step"] == "2"
        assert (await h.status_of("fly-a"))["currentScope"]["step"] == "2"
        assert (await h.status_of("fly-b"))["state"] == "failed"
        assert c.audit.index_of("publish:2") is None
        one, advance = c.audit.index_of("publish:1"), c.audit.index_of("advance:1")
        assert one is not None and advance is not None and one < advance


async def test_a_replaced_registration_is_not_silently_reached() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        await h.step()
        await h.restart_agent("fly-b")
        with pytest.raises(SessionFailure) as caught:
            await h.step()
        assert caught.value.code == "IDENTITY_MISMATCH"
        assert h.coordinator.phase == Failed()
        assert h.coordinator.stats.advances == 1


async def test_a_reply_from_another_incarnation_is_rejected() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        old = h.coordinator.refs()["fly-b"]
        new = await h.restart_agent("fly-b")
        ref = WorkerRef(service=new.identity.service,
                        service_incarnation=new.service_incarnation, worker_id="fly-b",
                        domain_incarnation=old.domain_incarnation)
        with pytest.raises(SessionFailure) as caught:
            await worker_status(h.coordinator, "fly-b", ref)
        assert caught.value.code == "IDENTITY_MISMATCH"
        assert "comes from incarnation" in caught.value.message
        assert h.coordinator.phase == Failed()


async def test_a_world_that_advanced_without_sensory_data_fails_the_transition() -> None:
    async with SessionHarness.start(Fixture(faults={"arena": Faults(omit_view_at_boundary=1)})
                                    ) as h:
        await h.bootstrap()
        c = h.coordinator
        with pytest.raises(SessionFailure) as caught:
            await h.step()
        failure = caught.value
        assert (failure.code, failure.mutation) == ("BUFFER_INVALID", "unknown")
        assert failure.detail == "observation"
        assert c.phase == Failed()
        assert c.evaluations() == 0
        assert c.progress().value["totalReward"] == 0.0
        assert not any(e.startswith("committed:") for e in c.audit)
        assert c.audit.index_of("publish:1") is None


async def test_an_exact_duplicate_of_a_running_operation_is_in_progress() -> None:
    fixture = Fixture(faults={"arena": Faults(advance_delay_ms=120)},
                      injections=Injections(lose_advance_result_at=(0,)))
    async with SessionHarness.start(fixture) as h:
        await h.bootstrap()
        await h.step()
        c = h.coordinator
        assert c.stats.in_progress_replies > 0
        assert c.stats.advances == 1
        assert c.observation is not None and c.observation.boundary == 1
        assert c.stats.last_resolution is ResolutionEnd.ANSWERED


async def test_an_old_epoch_operation_is_refused_with_stale_epoch() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        await h.step()
        with pytest.raises(BusError) as refused:
            await h.client(f"{h.names.tag}.coordinator2")
        assert refused.value.name == "NOT_AUTHORIZED"
        params: dict[str, Any] = prepare_params("fly-a", context_digest(1))
        with pytest.raises(DomainError) as caught:
            await h.coordinator.calls.probe("fly-a", "Agent.Prepare", Scope("demo", "e0", 1),
                                          params)
        assert (caught.value.code, caught.value.mutation) == ("STALE_EPOCH", "none")
        assert h.coordinator.stats.advances == 1
        assert not h.coordinator.fenced
