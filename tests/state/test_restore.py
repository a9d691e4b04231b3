"""Tests 58–76: the coordinator's group install (state.md §7) and the save path around it
(§5.7), on PostgreSQL (`claimed_run`) through `StateHarness`. "All modes" tests run in the
process, thread and in-process execution modes; the others in-process."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from flyd.launch.launcher import ExecutionMode
from flyd.session.coordinator import Coordinator
from flyd.session.fence import FENCED_MESSAGE, SessionFailure
from flyd.session.phase import Failed, Paused, Ready
from flyd.session.trace import EpochRebase, compare
from flyd.state.writer import (
    CheckpointSettings,
    Committed,
    DeadlineExpired,
    ReplyLost,
    Superseded,
    WriterFaults,
)
from flyd.state.writer import (
    Failed as SaveFailed,
)
from tests.session.harness import ALL_MODES, Fixture, SessionHarness, within
from tests.session.worker_rig import prepare_params
from tests.state.capture_rig import activate, scope
from tests.state.conftest import RunCtx, effect_rows
from tests.state.state_harness import StateHarness
from workers.faults import Faults
from workers.state import StateService
from workers.synthetic import CounterArena
from workers.synthetic.profile import graph
from workers.types.canonical import canonical, digest_bytes, parse_strict
from workers.types.domain import DomainError, ErrorCode, Mutation

pytestmark = pytest.mark.timeout(90)

MODES = pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.label())


def flip_last_byte(name: str) -> Any:
    def edit(manifest: dict[str, Any], payloads: dict[str, bytes]) -> None:
        body = payloads[name]
        payloads[name] = body[:-1] + bytes([body[-1] ^ 0x01])
    return edit


def edit_json(name: str, change: Any) -> Any:
    def edit(manifest: dict[str, Any], payloads: dict[str, bytes]) -> None:
        doc = parse_strict(payloads[name])
        change(doc)
        payloads[name] = canonical(doc)
    return edit


async def refused_restore(c: Coordinator, checkpoint_id: str | None, epoch: str
                          ) -> SessionFailure:
    with pytest.raises(SessionFailure) as info:
        await within(c.restore(checkpoint_id, epoch))
    return info.value


async def failed_and_replaced(s: StateHarness, n: int = 2, checkpoint_id: str = "ckpt-1"
                              ) -> None:
    await s.bootstrap()
    await s.run_and_checkpoint(n, checkpoint_id)
    await s.fail_the_epoch()
    await s.replace_all_participants()


# 58 -------------------------------------------------------------------------------------------


@MODES
async def test_an_uninterrupted_run_and_a_resumed_run_produce_matching_traces(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    async with SessionHarness.start(Fixture(mode=mode)) as ref:
        await ref.bootstrap()
        await ref.run(4)
        reference = list(ref.coordinator.trace.transitions)
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        await failed_and_replaced(s)
        c = s.coordinator
        report = await within(c.restore("ckpt-1", "e2"))
        assert (report.checkpoint_id, report.boundary, report.epoch) == ("ckpt-1", 2, "e2")
        assert report.activated == report.staged == ("arena", "fly-a", "fly-b")
        assert [w for w, _ in report.tokens] == list(report.staged)
        assert c.phase == Paused(2) and not c.fenced
        assert "restored:ckpt-1@2:e2" in c.audit
        c.resume()
        await s.h.run(2)
        assert c.phase == Ready(4)
        resumed = list(c.trace.transitions)
        assert compare(resumed, reference) is not None          # raw behaviour differs (e2)
        assert compare(resumed, reference, EpochRebase("e2", "e1", c.task)) is None


# 59 -------------------------------------------------------------------------------------------


@MODES
async def test_corrupting_any_single_participants_payload_fails_the_install_as_a_group(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        c = s.coordinator
        await s.bootstrap()
        await s.run_and_checkpoint(2, "ckpt-1")
        await s.fail_the_epoch()
        epoch = 1
        for name in ["agent-fly-a", "agent-fly-b", "world", "task-ledger"]:
            await s.rewrite_generation("ckpt-1", flip_last_byte(name))
            await s.replace_all_participants()
            epoch += 1
            failure = await refused_restore(c, None, f"e{epoch}")
            assert failure.code in (ErrorCode.INCOMPATIBLE_STATE, ErrorCode.INVALID_ARGUMENT)
            await s.nothing_is_installed(f"e{epoch}")
            if name == "world":
                assert c.tainted() == [] and failure.participant == "arena"
            else:
                assert c.tainted() != []
            await s.rewrite_generation("ckpt-1", flip_last_byte(name))   # intact again
        await s.replace_all_participants()
        report = await within(c.restore(None, f"e{epoch + 1}"))
        assert report.boundary == 2
        c.resume()
        await s.h.run(1)
        assert c.phase == Ready(3)


# 60 -------------------------------------------------------------------------------------------


@MODES
async def test_a_lost_save_reply_does_not_advance_durable_metadata(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    faults = WriterFaults()
    async with StateHarness.start(claimed_run, Fixture(mode=mode), faults=faults) as s:
        c, store = s.coordinator, claimed_run.store
        await s.bootstrap()
        await s.h.run(1)
        # (b) aborted before COMMIT: Failed, no row, nothing to resolve, no mark
        faults.abort_before_commit_for = "ckpt-2"
        assert await within(c.checkpoint("ckpt-2")) == SaveFailed("ckpt-2",
                                                                 "aborted before commit")
        assert await store.lookup(claimed_run.run_id, "ckpt-2") is None
        assert await c.resolve_durable("ckpt-2") is None and c.durable() is None
        # (a) the reply is dropped after the commit: ReplyLost, the mark stays until resolved
        faults.drop_reply_for = "ckpt-1"
        lost = await within(c.checkpoint("ckpt-1"))
        assert lost == ReplyLost("ckpt-1") and not lost.is_durable()
        assert c.durable() is None
        assert not any(line.startswith("durable:") for line in c.audit)
        record = await c.resolve_durable("ckpt-1")
        assert record is not None and record.boundary == 1
        assert c.durable() == ("ckpt-1", 1) and store.commits == 1
        assert "resolved:ckpt-1@1" in c.audit
        # (c) a deadline: DeadlineExpired now, durable later, found by id
        gate = asyncio.Event()
        faults.gate = gate
        ticket = await within(c.save("ckpt-3"))
        late = await within(c.await_durable(ticket, 0.1))
        assert late == DeadlineExpired("ckpt-3")
        assert "not-durable:failed:ckpt-3@1" in c.audit
        gate.set()
        for _ in range(500):                             # resolve polls by id (≤ 10 s)
            if await c.resolve_durable("ckpt-3") is not None:
                break
            await asyncio.sleep(0.02)
        assert c.durable() == ("ckpt-3", 1)


# 61 -------------------------------------------------------------------------------------------


@MODES
async def test_a_failure_during_activation_cannot_resume_half_a_world(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    fixture = Fixture(mode=mode, faults={"fly-b": Faults(fail_activate_restore=True)})
    async with StateHarness.start(claimed_run, fixture) as s:
        c = s.coordinator
        await failed_and_replaced(s)
        failure = await refused_restore(c, "ckpt-1", "e2")
        assert failure.participant == "fly-b" and failure.code == ErrorCode.BACKEND_FAILURE
        assert "fail:restore:fly-b" in c.audit
        assert c.fenced and isinstance(c.phase, Failed)
        with pytest.raises(SessionFailure) as info:
            await s.h.step()
        assert info.value.code == ErrorCode.INVALID_PHASE
        assert {"arena", "fly-a"} <= set(c.tainted())
        again = await refused_restore(c, "ckpt-1", "e3")
        assert again.code == ErrorCode.INVALID_PHASE and "arena" in again.message
        await s.replace_all_participants(Faults())
        assert c.tainted() == []
        report = await within(c.restore("ckpt-1", "e4"))
        assert report.epoch == "e4"
        c.resume()
        await s.h.run(1)
        assert c.phase == Ready(3)


# 62 -------------------------------------------------------------------------------------------


@MODES
async def test_the_checkpoint_queue_under_stress_stays_bounded(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    gate = asyncio.Event()
    faults = WriterFaults(gate=gate)
    async with StateHarness.start(claimed_run, Fixture(mode=mode),
                                  config=CheckpointSettings(queue_capacity=2), faults=faults) as s:
        c, writer = s.coordinator, s.writer
        await s.bootstrap()
        await s.h.run(1)
        first = await within(c.save("ckpt-1"))
        async with asyncio.timeout(10):
            await faults.stalled.wait()
        second = await within(c.save("ckpt-2"))
        progress = await s.h.progress_of("arena")
        with pytest.raises(SessionFailure) as info:
            await within(c.save("ckpt-3"))
        assert (info.value.code, info.value.mutation) == (ErrorCode.BUSY, Mutation.NONE)
        assert await s.h.progress_of("arena") == progress
        assert "capture-refused:ckpt-3" in c.audit and not c.fenced
        await s.h.run(1)
        assert c.phase == Ready(2)
        stats = writer.stats
        assert stats.rejected == 1 and stats.peak_queue <= 2
        assert stats.peak_bytes <= 64 * 1024 * 1024
        gate.set()
        assert await within(c.await_durable(first)) == Committed("ckpt-1", 1)
        assert await within(c.await_durable(second)) == Committed("ckpt-2", 1)
        assert writer.outstanding() == 0


# 63 -------------------------------------------------------------------------------------------


@MODES
async def test_old_media_cannot_cross_a_recovery(mode: ExecutionMode,
                                                 claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        c = s.coordinator
        await s.bootstrap()
        await s.run_and_checkpoint(2, "ckpt-1")
        position = c.audio_positions()["arena"]
        assert position == 1600
        await s.fail_the_epoch()                       # no media held while fenced
        await s.replace_all_participants()
        assert c.media.count() == 0
        report = await within(c.restore("ckpt-1", "e2"))
        assert report.imported and all(h.startswith("imp-") for h in report.imported)
        assert len(set(report.imported)) == len(report.imported) == 8
        refs = c.refs()
        for worker, launched in s.h.workers.items():
            assert refs[worker].service_incarnation == launched.worker_ref().service_incarnation
        assert c.observation is not None and c.observation.audio == ()
        assert c.audio_positions()["arena"] == position
        c.resume()
        await s.h.run(1)
        [first] = c.observation.audio
        assert (first.first_sample, first.discontinuity) == (position, True)
        await s.h.run(1)
        [second] = c.observation.audio
        assert (second.first_sample, second.discontinuity) == (position + 800, False)


# 64 -------------------------------------------------------------------------------------------


@MODES
async def test_a_checkpoint_taken_by_another_parser_is_refused_by_name(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        c = s.coordinator
        await failed_and_replaced(s)

        def other_parser(manifest: dict[str, Any], payloads: dict[str, bytes]) -> None:
            manifest["compatibility"] = {**manifest["compatibility"], "parserDigest": "0" * 64}

        await s.rewrite_generation("ckpt-1", other_parser)
        failure = await refused_restore(c, "ckpt-1", "e2")
        assert failure.code == ErrorCode.INCOMPATIBLE_STATE
        assert "parserDigest" in failure.message and "0" * 64 in failure.message
        assert c.tainted() == []
        await s.nothing_is_installed("e2")


# 65 -------------------------------------------------------------------------------------------


@MODES
async def test_a_group_where_one_participant_will_not_stage_resumes_nothing(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    fixture = Fixture(mode=mode, faults={"fly-b": Faults(fail_stage_restore=True)})
    async with StateHarness.start(claimed_run, fixture) as s:
        c = s.coordinator
        await failed_and_replaced(s)
        failure = await refused_restore(c, "ckpt-1", "e2")
        assert (failure.code, failure.participant) == (ErrorCode.INCOMPATIBLE_STATE, "fly-b")
        assert not any(line.startswith("activated:") for line in c.audit)
        assert c.tainted() == ["arena", "fly-a"]
        await s.nothing_is_installed("e2")


# 66 -------------------------------------------------------------------------------------------


@MODES
async def test_a_restore_token_activates_only_once(mode: ExecutionMode,
                                                   claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        c = s.coordinator
        await failed_and_replaced(s)
        report = await within(c.restore("ckpt-1", "e2"))
        tokens = dict(report.tokens)
        with pytest.raises(DomainError) as info:
            await activate(s.h, "arena", scope("e2", 2), tokens["arena"])
        assert info.value.code == ErrorCode.CONFLICT
        old = scope("e1", 2)
        for worker, method, params in (
                ("arena", "Environment.Advance", {"batchId": "batch-e1-2", "controls": []}),
                ("fly-a", "Agent.Prepare",
                 prepare_params("fly-a", c.slots["fly-a"].context_digest))):
            with pytest.raises(DomainError) as info:
                await c.calls.probe(worker, method, old, params)
            assert info.value.code in (ErrorCode.STALE_EPOCH, ErrorCode.INVALID_ARGUMENT)


# 67 -------------------------------------------------------------------------------------------


@MODES
async def test_the_fence_lifts_only_through_a_coherent_restore(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        c = s.coordinator
        await failed_and_replaced(s, 1)
        for attempt in (c.step(), c.bootstrap(), c.capture("ckpt-9")):
            with pytest.raises(SessionFailure) as info:
                await within(attempt)
            assert info.value.code == ErrorCode.INVALID_PHASE
            assert info.value.message == FENCED_MESSAGE
        with pytest.raises(SessionFailure):
            c.resume()
        stale = await refused_restore(c, "ckpt-1", "e1")
        assert stale.code == ErrorCode.STALE_EPOCH and c.fenced
        await within(c.restore("ckpt-1", "e2"))
        assert c.phase == Paused(1) and not c.fenced
        c.resume()
        await s.h.step()
        assert c.phase == Ready(2)


# 68 -------------------------------------------------------------------------------------------


async def test_a_queued_replaceable_capture_is_superseded_rather_than_duplicated(
        claimed_run: RunCtx) -> None:
    gate = asyncio.Event()
    faults = WriterFaults(gate=gate)
    async with StateHarness.start(claimed_run, config=CheckpointSettings(queue_capacity=3),
                                  faults=faults) as s:
        c, writer = s.coordinator, s.writer
        await s.bootstrap()
        await s.h.run(1)
        t1 = await within(c.save("ckpt-1"))
        async with asyncio.timeout(10):
            await faults.stalled.wait()
        await s.h.run(1)
        t2 = await within(c.save("ckpt-2", kind="hot"))
        await s.h.run(1)
        t3 = await within(c.save("ckpt-3", kind="hot"))
        assert await within(c.await_durable(t2)) == Superseded("ckpt-2", by="ckpt-3")
        gate.set()
        assert await within(c.await_durable(t1)) == Committed("ckpt-1", 1)
        assert await within(c.await_durable(t3)) == Committed("ckpt-3", 3)
        assert (writer.stats.superseded, writer.stats.committed) == (1, 2)
        rows = await effect_rows(claimed_run)
        assert [(k, ck) for k, _, ck in rows] == [
            ("boundary-1", "ckpt-1"), ("boundary-2", "ckpt-3"), ("boundary-3", "ckpt-3")]


# 69 -------------------------------------------------------------------------------------------


async def test_a_capture_is_refused_anywhere_but_a_committed_boundary(
        claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run) as s:
        c = s.coordinator
        with pytest.raises(SessionFailure) as info:
            await within(c.save("ckpt-0"))
        assert info.value.code == ErrorCode.INVALID_PHASE
        assert not c.fenced and c.epoch == "e1" and s.writer.outstanding() == 0
        await s.bootstrap()
        await s.h.run(1)
        s.h.pause.request()
        await s.h.run(1)
        assert c.phase == Paused(2)
        assert await within(c.checkpoint("ckpt-1")) == Committed("ckpt-1", 2)
        assert c.phase == Paused(2)


# 70 -------------------------------------------------------------------------------------------


@MODES
async def test_a_corrupt_coordinator_ledger_taints_every_staged_participant(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        c = s.coordinator
        await failed_and_replaced(s)

        def later(doc: dict[str, Any]) -> None:
            doc["worldTime"] = {"numerator": "1", "denominator": "1"}

        await s.rewrite_generation("ckpt-1", edit_json("prior-inspection", later))
        failure = await refused_restore(c, "ckpt-1", "e2")
        assert (failure.code, failure.participant) == (ErrorCode.INCOMPATIBLE_STATE,
                                                       "coordinator")
        assert c.tainted() == ["arena", "fly-a", "fly-b"]
        await s.nothing_is_installed("e2")


# 71 -------------------------------------------------------------------------------------------


@MODES
async def test_preconditions_are_checked_in_order_and_taint_nobody(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    fixture = Fixture(mode=mode, faults={"fly-b": Faults(fail_stage_restore=True)})
    async with StateHarness.start(claimed_run, fixture) as s:
        c = s.coordinator
        await s.bootstrap()
        await s.run_and_checkpoint(2, "ckpt-1")
        # 1: a stepped session is neither failed nor an unstepped Ready(0)
        phase = await refused_restore(c, "ckpt-1", "e2")
        assert phase.code == ErrorCode.INVALID_PHASE and c.phase == Ready(2) and not c.fenced
        await s.fail_the_epoch()
        await s.replace_all_participants()
        # 2: an epoch this session used
        used = await refused_restore(c, "ckpt-1", "e1")
        assert used.code == ErrorCode.STALE_EPOCH
        assert "epoch e1 was already used by this session" in used.message
        # 3: a tainted worker (left by a refused stage)
        await refused_restore(c, "ckpt-1", "e2")
        tainted = await refused_restore(c, "ckpt-1", "e3")
        assert tainted.code == ErrorCode.INVALID_PHASE
        assert tainted.message == ("participant arena took part in an abandoned install; "
                                   "replace it first")
        await s.replace_all_participants(Faults())
        # 5: an unknown checkpoint
        unknown = await refused_restore(c, "nope", "e3")
        assert unknown.code == ErrorCode.INCOMPATIBLE_STATE
        assert unknown.message == f"run {claimed_run.run_id} has no checkpoint nope"
        # 9: a replacement without checkpoint-v1
        await s.replace_with_model("fly-a", "tests.state.state_harness:UnversionedBrain")
        plain = await refused_restore(c, "ckpt-1", "e3")
        assert (plain.code, plain.participant) == (ErrorCode.UNSUPPORTED, "fly-a")
        assert "checkpoint-v1" in plain.message
        for failure in (used, tainted, unknown, plain):
            assert failure.mutation == Mutation.NONE
        assert isinstance(c.phase, Failed) and c.fenced and c.tainted() == []
        assert c.audit.count("fail:restore:fly-b") == 1   # the refused stage only


# 72 -------------------------------------------------------------------------------------------


@MODES
async def test_a_replacement_that_built_another_index_cannot_install_the_checkpoint(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        c = s.coordinator
        await failed_and_replaced(s)
        await s.replace_one("fly-a", model_config={"graphVariant": 1})
        failure = await refused_restore(c, "ckpt-1", "e2")
        assert (failure.code, failure.participant) == (ErrorCode.INCOMPATIBLE_STATE, "fly-a")
        # the replacement's graph is named by its first differing field in §3's order (the
        # synthetic dataset text carries the variant too, so datasetDigest precedes indexDigest)
        variant = graph("fly-a", 1)
        assert any(f"{name} identity" in failure.message and digest in failure.message
                   for name, digest in (("datasetDigest", variant.dataset_digest),
                                        ("indexDigest", variant.index_digest))), failure.message
        await s.replace_all_participants()
        await s.replace_one("fly-a", model_config={"graphVariant": 0})
        report = await within(c.restore("ckpt-1", "e3"))
        assert report.boundary == 2


# 73 -------------------------------------------------------------------------------------------


@MODES
async def test_a_restored_boundary_publishes_a_new_revision_and_no_transition(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        c = s.coordinator
        await failed_and_replaced(s)
        assert c.snapshots.descriptor is not None
        assert c.snapshots.descriptor["revision"] == "1"
        advances = c.stats.advances
        await within(c.restore("ckpt-1", "e2"))
        assert c.snapshots.descriptor["revision"] == "2"
        snapshot = c.snapshots.latest
        assert snapshot is not None and snapshot["descriptorRevision"] == "2"
        assert snapshot["scope"] == {"sessionId": "demo", "epoch": "e2", "step": "2"}
        assert snapshot["media"]["audio"] == []
        for agent in snapshot["agents"]:
            assert agent["selectedDecision"] is None and agent["appliedControls"] is None
        assert c.stats.advances == advances
        assert c.events[-1] == {"event": "session.recovered", "oldEpoch": "e1",
                                "newEpoch": "e2", "checkpointId": "ckpt-1", "boundary": 2,
                                "abandonedFrom": None, "abandonedTo": None}


# 74 -------------------------------------------------------------------------------------------


async def test_a_restored_observation_must_match_the_prior_inspection(
        claimed_run: RunCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    original = StateService.activate

    async def another_frame(self: StateService[Any], call: Any) -> dict[str, Any]:
        result = await original(self, call)
        observation = result["observation"]
        if observation is not None:
            pixels = observation["sensoryViews"][0]["pixels"]
            data = bytes(b ^ 0xFF for b in base64.b64decode(pixels["data"]))
            pixels.update(digest=digest_bytes(data),
                          data=base64.b64encode(data).decode("ascii"))
        return result

    monkeypatch.setattr(StateService, "activate", another_frame)   # bound at each launch
    async with StateHarness.start(claimed_run) as s:
        c = s.coordinator
        await failed_and_replaced(s)
        failure = await refused_restore(c, "ckpt-1", "e2")
        assert failure.participant == "arena" and "digest" in failure.message
        assert "activated:fly-b" in c.audit        # it failed at step 6
        assert c.tainted() == ["arena", "fly-a", "fly-b"]
        assert isinstance(c.phase, Failed) and c.fenced


# verified restore (session.md §6.12, amendment 2026-12-07) --------------------------------------


async def test_a_restored_world_that_renders_another_view_fails_restore_diverged(
        claimed_run: RunCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """The restored world serves the recorded frame (so §7.2 step 6's served-view check
    passes) but renders another one from its restored state: its `observationDigests` differ
    from the checkpoint's record, the install fails `RESTORE_DIVERGED` naming the world and the
    view, after activation, everyone tainted; the recorded bytes alone never hid it."""
    restore, render = CounterArena.restore, CounterArena.render

    def restored(self: CounterArena, payload: bytes) -> None:
        restore(self, payload)
        self.forgetful = True  # type: ignore[attr-defined]

    def rendered(self: CounterArena, view_id: str, boundary: int) -> bytes:
        frame = render(self, view_id, boundary)
        return frame[:-1] + b"\x00" if getattr(self, "forgetful", False) else frame

    monkeypatch.setattr(CounterArena, "restore", restored)
    monkeypatch.setattr(CounterArena, "render", rendered)
    async with StateHarness.start(claimed_run) as s:
        c = s.coordinator
        await failed_and_replaced(s)
        failure = await refused_restore(c, "ckpt-1", "e2")
        assert failure.code == ErrorCode.RESTORE_DIVERGED and failure.participant == "arena"
        assert ("restored world arena diverged from checkpoint ckpt-1 at boundary 2: view "
                "arena is frame 2 with digest") in failure.message
        assert "activated:fly-b" in c.audit        # found after every activation
        assert c.tainted() == ["arena", "fly-a", "fly-b"]
        assert isinstance(c.phase, Failed) and c.fenced


async def test_a_world_that_finds_its_own_restore_diverged_keeps_the_code(
        claimed_run: RunCtx, monkeypatch: pytest.MonkeyPatch) -> None:
    """A world that checks itself while staging (a replay against its record, say) raises
    `RESTORE_DIVERGED`: the install fails with that code, not `INCOMPATIBLE_STATE` (the
    checkpoint is fine, and a recovery attempt may succeed another way), naming the world;
    nobody activated, nobody tainted."""
    def refusing(self: CounterArena, payload: bytes) -> None:
        raise DomainError.before(ErrorCode.RESTORE_DIVERGED, "replayed frame 2 differs")

    monkeypatch.setattr(CounterArena, "restore", refusing)
    async with StateHarness.start(claimed_run) as s:
        c = s.coordinator
        await failed_and_replaced(s)
        failure = await refused_restore(c, "ckpt-1", "e2")
        assert failure.code == ErrorCode.RESTORE_DIVERGED and failure.participant == "arena"
        assert failure.message == ("State.StageRestore: restored world arena diverged from "
                                   "checkpoint ckpt-1 at boundary 2: replayed frame 2 differs")
        assert not [line for line in c.audit if line.startswith("activated:")]
        assert c.tainted() == []


# 75 -------------------------------------------------------------------------------------------


@MODES
async def test_a_cold_install_starts_an_unstepped_session_from_a_checkpoint(
        mode: ExecutionMode, claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        await s.bootstrap()
        await s.run_and_checkpoint(3, "ckpt-1")
        c = await s.fresh_session("e1")
        await within(c.bootstrap())
        assert c.phase == Ready(0)
        report = await within(c.restore(None, "e2"))
        assert report.boundary == 3 and c.phase == Paused(3) and not c.fenced
        c.resume()
        await s.h.run(1)
        assert c.phase == Ready(4)
        refused = await refused_restore(c, None, "e3")
        assert refused.code == ErrorCode.INVALID_PHASE and c.phase == Ready(4)


# 76 -------------------------------------------------------------------------------------------


@MODES
async def test_non_empty_helper_state_is_refused(mode: ExecutionMode,
                                                 claimed_run: RunCtx) -> None:
    async with StateHarness.start(claimed_run, Fixture(mode=mode)) as s:
        c = s.coordinator
        await failed_and_replaced(s)

        def helper(manifest: dict[str, Any], payloads: dict[str, bytes]) -> None:
            manifest["helperState"] = ["helper-x"]
            payloads["helper-x"] = b"{}"

        await s.rewrite_generation("ckpt-1", helper)
        failure = await refused_restore(c, "ckpt-1", "e2")
        assert failure.code == ErrorCode.INCOMPATIBLE_STATE and "helperState" in failure.message
        assert c.tainted() == []
        await s.nothing_is_installed("e2")
