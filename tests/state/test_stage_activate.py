"""Tests 49–57: `State.StageRestore` and `State.ActivateRestore` on the workers, raw calls
through the coordinator's call engine (`calls.probe`, the spec's `probe_raw`; state.md
§6.4–§6.6), in-process."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest

from tests.session.harness import Fixture, SessionHarness
from tests.session.worker_rig import prepare_params
from tests.state.capture_rig import (
    DelayFixture,
    activate,
    capture_raw,
    refused,
    scope,
    stage,
    stage_params,
    wrapper_of,
)
from workers.faults import Faults
from workers.state import restore_token
from workers.types.canonical import parse_strict
from workers.types.datatypes import WorldObservation
from workers.types.domain import ErrorCode, Scope

pytestmark = pytest.mark.timeout(60)

SOURCE = scope("e1", 2)
TARGET = scope("e2", 2)


async def started(h: SessionHarness, steps: int = 2) -> None:
    await h.bootstrap()
    await h.run(steps)


# 49 -------------------------------------------------------------------------------------------


async def test_stage_checks_run_in_order() -> None:
    fixture = Fixture(faults={"fly-b": Faults(fail_stage_restore=True)})
    async with SessionHarness.start(fixture) as h:
        await started(h)
        c = h.coordinator
        a = await capture_raw(h, "fly-a", 2)
        b = await capture_raw(h, "fly-b", 2)
        good = stage_params(a, SOURCE)
        bad = {**good, "extra": 1}
        # 1: scope null; another session (even with bad params)
        await refused(stage(h, "fly-a", None, good), ErrorCode.INVALID_ARGUMENT)
        await refused(stage(h, "fly-a", Scope("other", "e2", 2), bad),
                      ErrorCode.IDENTITY_MISMATCH)
        # 2: a mid-step (prepared) worker cannot stage, whatever else is wrong
        await c.calls.probe("fly-b", "Agent.Prepare", SOURCE,
                          prepare_params("fly-b", c.slots["fly-b"].context_digest))
        await refused(stage(h, "fly-b", scope("e1", 2), bad), ErrorCode.INVALID_PHASE,
                      contains="replace it")
        # 4: the adopted epoch (before the params check)
        await refused(stage(h, "fly-a", scope("e1", 2), bad), ErrorCode.STALE_EPOCH)
        # 5: params schema; sourceScope.step differs from the scope's step
        await refused(stage(h, "fly-a", TARGET, bad), ErrorCode.INVALID_ARGUMENT)
        await refused(stage(h, "fly-a", scope("e2", 3), good), ErrorCode.INVALID_ARGUMENT,
                      contains="sourceScope.step")
        # 6: content type, base64 (before length and digest)
        wrong_type = {**good, "payload": {**good["payload"], "contentType": "text/plain",
                                          "digest": "0" * 64}}
        await refused(stage(h, "fly-a", TARGET, wrong_type), ErrorCode.BUFFER_INVALID)
        not_base64 = {**good, "payload": {**good["payload"], "data": "***"}}
        await refused(stage(h, "fly-a", TARGET, not_base64), ErrorCode.BUFFER_INVALID)
        # 7: length, digest
        length = {**good, "payload": {**good["payload"], "byteLength": "1"}}
        await refused(stage(h, "fly-a", TARGET, length), ErrorCode.INCOMPATIBLE_STATE,
                      contains="byteLength")
        digest = {**good, "payload": {**good["payload"], "digest": "0" * 64}}
        await refused(stage(h, "fly-a", TARGET, digest), ErrorCode.INCOMPATIBLE_STATE,
                      contains="digest")
        # 8: the wrapper (not canonical JSON; the role checks are test 50's)
        raw = base64.b64decode(good["payload"]["data"]) + b" "
        spaced = {**good, "payload": {
            "contentType": good["payload"]["contentType"], "byteLength": str(len(raw)),
            "digest": hashlib.sha256(raw).hexdigest(),
            "data": base64.b64encode(raw).decode("ascii")}}
        await refused(stage(h, "fly-a", TARGET, spaced), ErrorCode.INVALID_ARGUMENT)
        # 3: a staged restore is kept; a second stage is CONFLICT before the epoch check
        staged = await stage(h, "fly-a", TARGET, good)
        await refused(stage(h, "fly-a", scope("e1", 2), bad), ErrorCode.CONFLICT,
                      contains="already staged")
        await activate(h, "fly-a", TARGET, staged["restoreToken"])
        # 10: the same token again (after another activation moved the epoch on) is CONFLICT
        second = await stage(h, "fly-a", scope("e3", 2), good)
        await activate(h, "fly-a", scope("e3", 2), second["restoreToken"])
        await refused(stage(h, "fly-a", TARGET, good), ErrorCode.CONFLICT,
                      contains=staged["restoreToken"])
    async with SessionHarness.start(fixture) as h:
        await started(h)
        b = await capture_raw(h, "fly-b", 2)
        # 9: the injected stage failure comes after the wrapper validation
        await refused(stage(h, "fly-b", TARGET, stage_params(b, SOURCE, lambda d: d.update(
            agentId="fly-a"))), ErrorCode.IDENTITY_MISMATCH)
        await refused(stage(h, "fly-b", TARGET, stage_params(b, SOURCE)),
                      ErrorCode.INCOMPATIBLE_STATE, contains="injected stage failure")
        assert (await h.status_of("fly-b"))["state"] == "ready"


# 50 -------------------------------------------------------------------------------------------


def set_identity(field: str, value: Any) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        doc["identity"][field] = value

    return edit


def set_accumulator(field: str, value: Any) -> Any:
    def edit(doc: dict[str, Any]) -> None:
        doc["accumulator"][field] = value

    return edit


async def test_agent_wrapper_validation_names_what_differs() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await started(h)
        captured = await capture_raw(h, "fly-a", 2)
        own = captured["agentIdentity"]

        async def refuse(edit: Any, code: ErrorCode, *contains: str) -> None:
            error = await refused(stage(h, "fly-a", TARGET, stage_params(captured, SOURCE, edit)),
                                  code)
            for text in contains:
                assert text in error.message, error.message

        await refuse(lambda d: d.update(agentId="fly-b"), ErrorCode.IDENTITY_MISMATCH, "fly-b")
        await refuse(lambda d: d.update(checkpointId="ckpt-9"), ErrorCode.INCOMPATIBLE_STATE,
                     "ckpt-9")
        await refuse(lambda d: d.update(committedStep="1"), ErrorCode.INCOMPATIBLE_STATE,
                     "step")
        await refuse(set_identity("seed", 8), ErrorCode.INCOMPATIBLE_STATE,
                     "agent fly-a: the checkpoint's seed identity 8 differs from this "
                     "worker's 7")
        other = "ab" * 32
        await refuse(set_identity("indexDigest", other), ErrorCode.INCOMPATIBLE_STATE,
                     f"agent fly-a: the checkpoint's indexDigest identity {other} differs from "
                     f"this worker's {own['indexDigest']}")
        await refuse(set_accumulator("tick", {"numerator": "1", "denominator": "1"}),
                     ErrorCode.INCOMPATIBLE_STATE, "tick")
        tick = wrapper_of(captured)["accumulator"]["tick"]
        await refuse(set_accumulator("remainder", tick), ErrorCode.INCOMPATIBLE_STATE,
                     "remainder")
        # the identity digest must be the params' compatibilityDigest
        params = stage_params(captured, SOURCE)
        params["compatibilityDigest"] = "0" * 64
        await refused(stage(h, "fly-a", TARGET, params), ErrorCode.INCOMPATIBLE_STATE,
                      contains="compatibilityDigest")
        # the untouched wrapper stages
        assert (await stage(h, "fly-a", TARGET, stage_params(captured, SOURCE)))[
            "restoreToken"].startswith("rt-")


# 51 -------------------------------------------------------------------------------------------


async def test_only_one_restore_is_staged_at_a_time() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await started(h)
        captured = await capture_raw(h, "arena", 2)
        first = await stage(h, "arena", TARGET, stage_params(captured, SOURCE))
        await refused(stage(h, "arena", scope("e3", 2), stage_params(captured, SOURCE)),
                      ErrorCode.CONFLICT, contains="kept")
        result = await activate(h, "arena", TARGET, first["restoreToken"])
        assert (result["checkpointId"], result["committedStep"]) == ("ckpt-1", "2")
        status = await h.status_of("arena")
        assert (status["state"], status["currentScope"]) == ("ready", TARGET.to_json())


# 52 -------------------------------------------------------------------------------------------


async def test_staged_state_is_invisible_until_activation() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await started(h)
        c = h.coordinator
        workers = ("arena", "fly-a", "fly-b")
        captured = {w: await capture_raw(h, w, 2) for w in workers}
        refs = c.refs()
        refs["fly-b"] = (await h.restart_agent("fly-b")).worker_ref()
        before = {w: await h.status_of(w) for w in workers}
        assert before["fly-b"]["currentScope"] is None  # the replacement is uninitialized
        for w in workers:
            await stage(h, w, TARGET, stage_params(captured[w], SOURCE), refs[w])
            after = await h.status_of(w)
            assert after["state"] == "staged-restore"
            assert after["currentScope"] == before[w]["currentScope"]
            assert after["progressCounter"] == before[w]["progressCounter"]
        assert before["arena"]["currentScope"] == SOURCE.to_json()
        # a staged worker serves nothing of the proposed epoch and no step of the old one
        await refused(capture_raw(h, "arena", 2, epoch="e2"), ErrorCode.STALE_EPOCH)
        await refused(c.calls.probe("fly-a", "Agent.Prepare", SOURCE,
                                  prepare_params("fly-a", c.slots["fly-a"].context_digest)),
                      ErrorCode.INVALID_PHASE)


# 53 -------------------------------------------------------------------------------------------


async def test_the_restore_token_vector_and_incarnation_binding() -> None:
    empty = hashlib.sha256(b"").hexdigest()
    assert restore_token("ckpt-1", Scope("demo", "e2", 2), empty, "fly-a-inc-2") == \
        "rt-a993a655d6a4ed28ef5150b08b5a72c6"
    assert restore_token("ckpt-1", Scope("demo", "e2", 2), empty, "fly-a-inc-3") == \
        "rt-641a8e5a76e310fedf624fb2ecb67c90"
    async with SessionHarness.start(Fixture()) as h:
        await started(h)
        captured = await capture_raw(h, "fly-a", 2)
        params = stage_params(captured, SOURCE)
        old_incarnation = h.workers["fly-a"].domain_incarnation
        old = await stage(h, "fly-a", TARGET, params)
        assert old["restoreToken"] == restore_token("ckpt-1", TARGET,
                                                    params["payload"]["digest"], old_incarnation)
        # a replacement mints another token for the same checkpoint, scope and payload
        fresh = await h.restart_agent("fly-a")
        ref = fresh.worker_ref()
        assert fresh.domain_incarnation != old_incarnation
        new = await stage(h, "fly-a", TARGET, params, ref)
        assert new["restoreToken"] == restore_token("ckpt-1", TARGET,
                                                    params["payload"]["digest"],
                                                    fresh.domain_incarnation)
        assert new["restoreToken"] != old["restoreToken"]
        # the old incarnation's token activates nothing on the replacement (kept)
        await refused(activate(h, "fly-a", TARGET, old["restoreToken"], ref),
                      ErrorCode.IDENTITY_MISMATCH, contains="kept")
        result = await activate(h, "fly-a", TARGET, new["restoreToken"], ref)
        assert result == {"checkpointId": "ckpt-1", "committedStep": "2", "observation": None,
                          "observationDigests": None}


# 54 -------------------------------------------------------------------------------------------


async def test_activate_checks_run_in_order() -> None:
    fixture = Fixture(faults={"fly-b": Faults(fail_activate_restore=True)})
    async with SessionHarness.start(fixture) as h:
        await started(h)
        a = await capture_raw(h, "fly-a", 2)
        # 1: scope null; params schema
        await refused(activate(h, "fly-a", None, "rt-x"), ErrorCode.INVALID_ARGUMENT)
        await refused(h.coordinator.calls.probe("fly-a", "State.ActivateRestore", TARGET,
                                              {"restoreToken": "rt-x", "more": 1}),
                      ErrorCode.INVALID_ARGUMENT)
        # 3: nothing staged
        await refused(activate(h, "fly-a", TARGET, "rt-0"), ErrorCode.INVALID_PHASE,
                      contains="nothing staged")
        staged = await stage(h, "fly-a", TARGET, stage_params(a, SOURCE))
        token = staged["restoreToken"]
        # 4: another token, another scope: refused, the staged restore is kept
        await refused(activate(h, "fly-a", TARGET, "rt-0"), ErrorCode.IDENTITY_MISMATCH,
                      contains="kept")
        await refused(activate(h, "fly-a", scope("e3", 2), token), ErrorCode.IDENTITY_MISMATCH)
        assert (await h.status_of("fly-a"))["state"] == "staged-restore"
        await activate(h, "fly-a", TARGET, token)
        # 2: a used token, even with nothing staged any more, is CONFLICT
        await refused(activate(h, "fly-a", TARGET, token), ErrorCode.CONFLICT)
        # 5: the injected activation failure keeps the staged restore and fails the worker
        b = await capture_raw(h, "fly-b", 2)
        staged_b = await stage(h, "fly-b", TARGET, stage_params(b, SOURCE))
        await refused(activate(h, "fly-b", TARGET, staged_b["restoreToken"]),
                      ErrorCode.BACKEND_FAILURE, contains="kept")
        status = await h.status_of("fly-b")
        assert status["state"] == "failed"
        assert status["currentScope"] == SOURCE.to_json()
        # kept: the same token still names the staged restore (and still fails)
        await refused(activate(h, "fly-b", TARGET, staged_b["restoreToken"]),
                      ErrorCode.BACKEND_FAILURE)
        await refused(activate(h, "fly-b", TARGET, "rt-0"), ErrorCode.IDENTITY_MISMATCH)


# 55 -------------------------------------------------------------------------------------------


async def test_activation_advances_no_tick() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await started(h, 3)
        k = 3
        source = scope("e1", k)
        target = scope("e2", k)
        workers = ("arena", "fly-a", "fly-b")
        captured = {w: await capture_raw(h, w, k) for w in workers}
        mutations = {a: await h.mutations_of(a) for a in ("fly-a", "fly-b")}
        refs = {}
        for w in workers:
            refs[w] = (await h.restart_agent(w)).worker_ref()
        for w in workers:
            staged = await stage(h, w, target, stage_params(captured[w], source), refs[w])
            assert (await h.status_of(w))["progressCounter"] == "0"
            await activate(h, w, target, staged["restoreToken"], refs[w])
            status = await h.status_of(w)
            assert (status["state"], status["currentScope"]) == ("ready", target.to_json())
        for a in ("fly-a", "fly-b"):
            assert await h.mutations_of(a) == mutations[a]
        # captured again in e2: the saved brains, accumulators and world, exactly
        for w in workers:
            again = wrapper_of(await capture_raw(h, w, k, "ckpt-2", "e2", refs[w]))
            first = wrapper_of(captured[w])
            if w == "arena":
                assert again["world"] == first["world"]
                assert h.task is not None
                assert parse_strict(base64.b64decode(first["world"]["data"]))["counter"] == \
                    h.task.counter
                assert (again["frames"], again["audio"], again["progress"]) == (
                    first["frames"], first["audio"], first["progress"])
            else:
                assert again["model"] == first["model"]
                assert again["accumulator"] == first["accumulator"]
                assert again["contextDigest"] == first["contextDigest"]


# 56 -------------------------------------------------------------------------------------------


async def test_a_duplicate_activate_replays_and_a_fresh_one_conflicts() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await started(h)
        captured = await capture_raw(h, "arena", 2)
        staged = await stage(h, "arena", TARGET, stage_params(captured, SOURCE))
        ref = h.coordinator.refs()["arena"]
        client = h.coordinator_client
        assert client is not None
        payload = {"requestId": "req-900", "scope": TARGET.to_json(),
                   "params": {"restoreToken": staged["restoreToken"]}}
        outcomes = []
        for _ in range(2):
            reply = await client.call(ref.service, "State.ActivateRestore", payload,
                                      timeout=5.0, expected_incarnation=ref.service_incarnation)
            outcomes.append(reply.outcome)
        assert outcomes[0]["type"] == "result"
        assert outcomes[1] == outcomes[0]  # replayed, not executed twice
        error = await refused(activate(h, "arena", TARGET, staged["restoreToken"]),
                              ErrorCode.CONFLICT)
        assert staged["restoreToken"] in error.message
        assert (await h.status_of("arena"))["currentScope"] == TARGET.to_json()


# 57 -------------------------------------------------------------------------------------------


async def test_the_restored_observation_is_the_recorded_one() -> None:
    async with SessionHarness.start(DelayFixture(delay=2)) as h:
        await started(h, 4)
        k = 4
        source, target = scope("e1", k), scope("e2", k)
        recorded = h.coordinator.observation
        assert recorded is not None and recorded.boundary == k
        captured = {w: await capture_raw(h, w, k) for w in ("arena", "fly-a")}
        refs = {w: (await h.restart_agent(w)).worker_ref() for w in captured}
        results = {}
        for w in captured:
            staged = await stage(h, w, target, stage_params(captured[w], source), refs[w])
            results[w] = await activate(h, w, target, staged["restoreToken"], refs[w])
        assert results["fly-a"]["observation"] is None
        observation = WorldObservation.from_json(results["arena"]["observation"])
        assert observation.boundary == k
        assert observation.world_time == recorded.world_time
        assert observation.audio == ()
        assert observation.inspection == recorded.inspection
        (view,) = observation.sensory_views
        (before,) = recorded.sensory_views
        assert view.produced_step == 2
        assert view.pixels == before.pixels  # the recorded bytes, byte for byte
        # a delayed view serves a frame only the checkpoint holds: reported as recorded
        assert results["arena"]["observationDigests"] == [
            {"viewId": view.view_id, "producedStep": "2", "digest": before.pixels.digest}]
        assert results["fly-a"]["observationDigests"] is None

