"""Agent methods (session.md §3.1–§3.3) over a real router: every check in its order, the
effects on the model and the status cell, and the agent fault knobs of §4.9.

Refusals are checked one at a time and, where two could apply, pairwise (the earlier check must
answer). Every refusal is `mutation: none` and leaves the agent exactly where it was.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import pytest

from tests.session.worker_rig import (
    Rig,
    agent_init_params,
    agent_launch,
    boot_digest,
    commit_params,
    context_digest,
    prepare_params,
    profile_of,
    rig,
    scope,
    sensory,
    view_ref,
    wait_for,
)
from workers.faults import Faults
from workers.shell import Call, Endpoint
from workers.synthetic.brain import FakeBrain
from workers.synthetic.schemas import synthetic_schema
from workers.synthetic.task import context
from workers.types.canonical import typed_digest
from workers.types.datatypes import TypedValue
from workers.types.rpc import Request

__all__ = ["rig"]

DATASET = "3abe76e912cb936270c4d84c7407a663663d965e0b0c5df526d51302ddebd29c"
INDEX_FLY_A = "479093e456fee800e2a827d35fc37b94d0b9e053d261964c0e598d290b0dc423"
MILESTONE = {"id": "ev-1", "kindId": "arena.milestone", "durationMs": 4.0}


async def agent(rig: Rig, faults: Faults | None = None, threads: int = 1) -> Endpoint:
    return await rig.start_endpoint(agent_launch(rig.socket, faults=faults, threads=threads))


async def initialized(rig: Rig, faults: Faults | None = None) -> Endpoint:
    endpoint = await agent(rig, faults)
    await rig.init_agent()
    return endpoint


async def prepared(rig: Rig, k: int = 0, stimuli: list[dict[str, Any]] | None = None
                   ) -> tuple[str, dict[str, Any]]:
    rid = rig.next_id("fly-a")
    result = await rig.ok("fly-a", "Agent.Prepare",
                          prepare_params("fly-a", context_digest(k), stimuli), scope(k),
                          request_id=rid)
    return rid, result


async def step(rig: Rig, k: int) -> None:
    rid, _ = await prepared(rig, k)
    await rig.ok("fly-a", "Agent.Commit", commit_params("fly-a", rid, k), scope(k))


async def refused(rig: Rig, method: str, params: dict[str, Any], at: dict[str, str] | None,
                  code: str) -> dict[str, Any]:
    before = await rig.status("fly-a")
    error = await rig.error("fly-a", method, params, at)
    assert (error["code"], error["mutation"]) == (code, "none"), error
    after = await rig.status("fly-a")
    assert {k: v for k, v in after.items() if k != "lastCompletedRequestId"} == \
        {k: v for k, v in before.items() if k != "lastCompletedRequestId"}
    assert after["lastCompletedRequestId"] == before["lastCompletedRequestId"]
    return error


def without(params: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k != key}


def bad_digest_view() -> dict[str, Any]:
    view = view_ref(0, 0)
    view["pixels"]["digest"] = "0" * 64
    return view


def bad_base64_view() -> dict[str, Any]:
    view = view_ref(0, 0)
    view["pixels"]["data"] = "!!!" + view["pixels"]["data"][3:]
    return view


def wrong_type_view() -> dict[str, Any]:
    view = view_ref(0, 0)
    view["pixels"]["contentType"] = "image/png"
    return view


def short_view() -> dict[str, Any]:
    view = view_ref(0, 0)
    view["pixels"]["byteLength"] = "3071"
    return view


OTHER_SCHEMA_CONTEXT = TypedValue(synthetic_schema("arena.progress.v1"),
                                  {"available": ["inc"]}).to_json()
BAD_AVAILABLE_CONTEXT = TypedValue(synthetic_schema("arena.context.v1"),
                                   {"available": "inc"}).to_json()


# --------------------------------------------------------------------------------------------
# Agent.Initialize (§3.1)


async def test_initialize_installs_the_warmed_up_model(rig: Rig) -> None:
    await agent(rig)
    result = await rig.init_agent()
    assert result == {
        "agentId": "fly-a",
        "profileDigest": "e50a471c6327ca4d9295c7efaebba8b4e2f8d08bcefc0b10b2a513e7f8d0a08c",
        "tickDuration": {"numerator": "1000000", "denominator": "1"},
        "warmupTicks": "10",
        "committedStep": "0",
        "decisionContextDigest": boot_digest(),
        "telemetry": {"brainTicks": "10", "populationRateHz": 36.3,
                      "rates": [{"roleId": "kc", "hz": 16.3}, {"roleId": "mbon", "hz": 7.3}],
                      "learning": {"enabled": True, "updates": "0", "changed": "0",
                                   "signal": 0.0},
                      "stimulusRemainingMs": None},
        "graph": {"datasetDigest": DATASET, "indexDigest": INDEX_FLY_A,
                  "neuronCount": "1024", "rateRoles": ["kc", "mbon"],
                  "supportedStimuli": ["arena.milestone"]},
    }
    status = await rig.status("fly-a")
    assert status == {"state": "ready", "currentScope": scope(0), "activeRequestId": None,
                      "lastCompletedRequestId": "req-1", "lastBatchId": None,
                      "progressCounter": "11"}


async def test_initialize_encodes_the_first_pixel_byte_of_every_view(rig: Rig) -> None:
    endpoint = await agent(rig)
    # counter 5: every R byte is 5, so the input is 5 and the state differs from counter 0's
    await rig.ok("fly-a", "Agent.Initialize",
                 agent_init_params(views=[view_ref(5, 0)]), scope(0))
    model = endpoint.model  # type: ignore[attr-defined]
    reference = FakeBrain(agent_id="fly-a", seed=7, threads=1, config={})
    reference.install_input(5)
    reference.advance(10)
    assert model.state == reference.state and model.mutations() == 11


async def test_a_second_initialize_is_invalid_phase(rig: Rig) -> None:
    await initialized(rig)
    error = await refused(rig, "Agent.Initialize", agent_init_params(), scope(0),
                          "INVALID_PHASE")
    assert "restore uses State.*" in error["message"]


def mutate(**changes: Any) -> dict[str, Any]:
    return {**agent_init_params(), **changes}


INITIALIZE_REFUSALS: list[tuple[str, dict[str, Any], dict[str, str] | None, str]] = [
    ("scope-null", agent_init_params(), None, "INVALID_ARGUMENT"),
    ("other-session", agent_init_params(), scope(0, session="other"), "IDENTITY_MISMATCH"),
    ("step-1", agent_init_params(), scope(1), "FUTURE_STEP"),
    ("missing-key", without(agent_init_params(), "seed"), scope(0), "INVALID_ARGUMENT"),
    ("extra-key", mutate(extra=1), scope(0), "INVALID_ARGUMENT"),
    ("seed-float", mutate(seed=7.0), scope(0), "INVALID_ARGUMENT"),
    ("seed-bool", mutate(seed=True), scope(0), "INVALID_ARGUMENT"),
    ("seed-range", mutate(seed=2**31), scope(0), "INVALID_ARGUMENT"),
    ("threads-0", mutate(workerThreads=0), scope(0), "INVALID_ARGUMENT"),
    ("other-agent", mutate(agentId="fly-z"), scope(0), "IDENTITY_MISMATCH"),
    ("threads-8", mutate(workerThreads=8), scope(0), "BUSY"),
    ("other-profile", mutate(profile=profile_of("fly-b")), scope(0), "IDENTITY_MISMATCH"),
    ("profile-warmup", mutate(profile=profile_of("fly-a", warmup=11)), scope(0),
     "IDENTITY_MISMATCH"),
    ("context-schema", mutate(initialDecisionContext=OTHER_SCHEMA_CONTEXT), scope(0),
     "IDENTITY_MISMATCH"),
    ("context-available", mutate(initialDecisionContext=BAD_AVAILABLE_CONTEXT), scope(0),
     "INVALID_ARGUMENT"),
    ("boundary-1", mutate(initialInput=sensory(1, [view_ref(0, 0)])), scope(0),
     "INVALID_ARGUMENT"),
    ("bad-base64", mutate(initialInput=sensory(0, [bad_base64_view()])), scope(0),
     "BUFFER_INVALID"),
    ("bad-digest", mutate(initialInput=sensory(0, [bad_digest_view()])), scope(0),
     "BUFFER_INVALID"),
    ("bad-length", mutate(initialInput=sensory(0, [short_view()])), scope(0),
     "BUFFER_INVALID"),
    ("content-type", mutate(initialInput=sensory(0, [wrong_type_view()])), scope(0),
     "BUFFER_INVALID"),
    ("future-view", mutate(initialInput=sensory(0, [view_ref(0, 0, produced=1)])), scope(0),
     "BUFFER_INVALID"),
    # pairs: the earlier check answers
    ("session-before-step", agent_init_params(), scope(1, session="other"),
     "IDENTITY_MISMATCH"),
    ("step-before-params", mutate(seed="x"), scope(1), "FUTURE_STEP"),
    ("params-before-agent", mutate(agentId="fly-z", seed="x"), scope(0), "INVALID_ARGUMENT"),
    ("agent-before-threads", mutate(agentId="fly-z", workerThreads=8), scope(0),
     "IDENTITY_MISMATCH"),
    ("threads-before-profile", mutate(workerThreads=8, profile=profile_of("fly-b")), scope(0),
     "BUSY"),
    ("profile-before-context", mutate(profile=profile_of("fly-b"),
                                      initialDecisionContext=BAD_AVAILABLE_CONTEXT), scope(0),
     "IDENTITY_MISMATCH"),
    ("context-before-input", mutate(initialDecisionContext=OTHER_SCHEMA_CONTEXT,
                                    initialInput=sensory(0, [bad_digest_view()])), scope(0),
     "IDENTITY_MISMATCH"),
    ("boundary-before-views", mutate(initialInput=sensory(1, [bad_digest_view()])), scope(0),
     "INVALID_ARGUMENT"),
]


@pytest.mark.parametrize(("params", "at", "code"), [c[1:] for c in INITIALIZE_REFUSALS],
                         ids=[c[0] for c in INITIALIZE_REFUSALS])
async def test_initialize_checks_in_order(rig: Rig, params: dict[str, Any],
                                          at: dict[str, str] | None, code: str) -> None:
    await agent(rig)
    error = await refused(rig, "Agent.Initialize", params, at, code)
    assert (await rig.status("fly-a"))["state"] == "uninitialized"
    if code == "BUSY":
        assert "8" in error["message"] and "1" in error["message"]
    # the refusal freed its key: the same agent initializes afterwards
    await rig.init_agent()


# --------------------------------------------------------------------------------------------
# Agent.Prepare (§3.2)


async def test_prepare_advances_the_ticks_of_one_interval_and_decides(rig: Rig) -> None:
    endpoint = await initialized(rig)
    rid, result = await prepared(rig)
    assert result["agentId"] == "fly-a"
    assert result["ticksAdvanced"] == "16" and result["brainTicks"] == "26"
    assert result["remainder"] == {"numerator": "2000000", "denominator": "3"}
    assert result["decision"]["value"] == {
        "buttons": [{"id": "inc", "down": False}, {"id": "dec", "down": False}],
        "axes": [{"id": "bias", "value": -0.25}]}
    model = endpoint.model  # type: ignore[attr-defined]
    assert result["decision"] == model.decide(context(0, boot=True)).to_json()
    status = await rig.status("fly-a")
    assert status["state"] == "prepared" and status["currentScope"] == scope(0)
    assert status["progressCounter"] == "27" and status["lastCompletedRequestId"] == rid


async def test_pre_step_stimulations_run_before_the_ticks(rig: Rig) -> None:
    endpoint = await initialized(rig)
    reference = FakeBrain(agent_id="fly-a", seed=7, threads=1, config={})
    reference.install_input(0)
    reference.advance(10)
    from workers.types.datatypes import Stimulus

    reference.stimulate(Stimulus.from_json(MILESTONE))
    reference.stimulate(Stimulus.from_json({**MILESTONE, "durationMs": 2.5}))
    reference.advance(16)
    await prepared(rig, 0, [MILESTONE, {**MILESTONE, "durationMs": 2.5}])
    model = endpoint.model  # type: ignore[attr-defined]
    assert model.state == reference.state
    assert (await rig.status("fly-a"))["progressCounter"] == "29"


def prep(**changes: Any) -> dict[str, Any]:
    return {**prepare_params("fly-a", boot_digest()), **changes}


PREPARE_REFUSALS: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
    ("other-session", prep(), scope(0, session="other"), "IDENTITY_MISMATCH"),
    ("other-epoch", prep(), scope(0, "e2"), "STALE_EPOCH"),
    ("future-step", prep(), scope(1), "FUTURE_STEP"),
    ("missing-key", without(prep(), "interval"), scope(0), "INVALID_ARGUMENT"),
    ("zero-interval", prep(interval={"numerator": "0", "denominator": "1"}), scope(0),
     "INVALID_ARGUMENT"),
    ("unreduced-interval", prep(interval={"numerator": "6", "denominator": "4"}), scope(0),
     "INVALID_ARGUMENT"),
    ("zero-duration", prep(preStepStimulations=[{**MILESTONE, "durationMs": 0}]), scope(0),
     "INVALID_ARGUMENT"),
    ("65-stimuli", prep(preStepStimulations=[MILESTONE] * 65), scope(0), "INVALID_ARGUMENT"),
    ("other-agent", prep(agentId="fly-b"), scope(0), "IDENTITY_MISMATCH"),
    ("other-profile", prep(profileDigest=profile_of("fly-b")["digest"]), scope(0),
     "IDENTITY_MISMATCH"),
    ("other-context", prep(decisionContextDigest=context_digest(1)), scope(0),
     "IDENTITY_MISMATCH"),
    ("undeclared-kind", prep(preStepStimulations=[{**MILESTONE, "kindId": "arena.zap"}]),
     scope(0), "UNSUPPORTED"),
    # pairs
    ("session-before-epoch", prep(), scope(0, "e2", session="other"), "IDENTITY_MISMATCH"),
    ("epoch-before-step", prep(), scope(3, "e2"), "STALE_EPOCH"),
    ("step-before-params", without(prep(), "interval"), scope(1), "FUTURE_STEP"),
    ("params-before-identity", prep(agentId="fly-b", interval={"numerator": "0",
                                                               "denominator": "1"}),
     scope(0), "INVALID_ARGUMENT"),
    ("identity-before-kind", prep(agentId="fly-b", preStepStimulations=[
        {**MILESTONE, "kindId": "arena.zap"}]), scope(0), "IDENTITY_MISMATCH"),
]


@pytest.mark.parametrize(("params", "at", "code"), [c[1:] for c in PREPARE_REFUSALS],
                         ids=[c[0] for c in PREPARE_REFUSALS])
async def test_prepare_checks_in_order(rig: Rig, params: dict[str, Any], at: dict[str, str],
                                       code: str) -> None:
    await initialized(rig)
    error = await refused(rig, "Agent.Prepare", params, at, code)
    if code == "UNSUPPORTED":
        assert "arena.zap" in error["message"]
    _, result = await prepared(rig)  # nothing moved: the real Prepare still gives step 0's
    assert result["ticksAdvanced"] == "16"


async def test_prepare_before_initialize_is_invalid_phase(rig: Rig) -> None:
    await agent(rig)
    await refused(rig, "Agent.Prepare", prep(), scope(0), "INVALID_PHASE")


async def test_prepare_while_prepared_is_invalid_phase(rig: Rig) -> None:
    await initialized(rig)
    await prepared(rig)
    error = await refused(rig, "Agent.Prepare", prep(), scope(1), "INVALID_PHASE")
    assert "prepared" in error["message"]


async def test_the_handler_refuses_an_older_step_with_stale_step(rig: Rig) -> None:
    endpoint = await initialized(rig)
    await step(rig, 0)
    # the cache answers a re-sent step 0 itself; the handler's own check is defence in depth
    call = Call("Agent.Prepare", Request("req-99", scope_obj(0), prep()), "s7.coordinator")
    with pytest.raises(Exception) as info:
        await endpoint.handlers["Agent.Prepare"](call)
    assert getattr(info.value, "code", None) == "STALE_STEP"
    rid, _ = await prepared(rig, 1)
    call = Call("Agent.Commit", Request("req-98", scope_obj(0), commit_params("fly-a", rid, 0)),
                "s7.coordinator")
    with pytest.raises(Exception) as info:
        await endpoint.handlers["Agent.Commit"](call)
    assert getattr(info.value, "code", None) == "STALE_STEP"


def scope_obj(step: int) -> Any:
    from workers.types.domain import Scope

    return Scope("demo", "e1", step)


# --------------------------------------------------------------------------------------------
# Agent.Commit (§3.3)


async def test_commit_installs_the_input_reinforces_once_and_moves_to_the_next_step(
        rig: Rig) -> None:
    endpoint = await initialized(rig)
    rid, _ = await prepared(rig)
    rewards = [{"eventId": "ev-a", "ruleId": "counter-delta", "value": 1.0},
               {"eventId": "ev-b", "ruleId": "counter-delta", "value": -1.0},
               {"eventId": "ev-c", "ruleId": "bonus", "value": 0.5}]
    result = await rig.ok("fly-a", "Agent.Commit",
                          commit_params("fly-a", rid, 0, counter=3, rewards=rewards,
                                        stimuli=[MILESTONE]), scope(0))
    assert result["agentId"] == "fly-a" and result["committedStep"] == "1"
    assert result["decisionContextDigest"] == typed_digest(context(1, boot=False))
    assert result["telemetry"]["learning"] == {"enabled": True, "updates": "1", "changed": "1",
                                               "signal": 0.5}
    assert result["telemetry"]["brainTicks"] == "26"  # no ticks run in Commit
    model = endpoint.model  # type: ignore[attr-defined]
    assert model.reinforcements == 1
    status = await rig.status("fly-a")
    assert status["state"] == "ready" and status["currentScope"] == scope(1)
    assert status["progressCounter"] == "30"  # 27 + install + stimulus + reinforce


async def test_a_commit_without_rewards_still_reinforces_with_zero(rig: Rig) -> None:
    await initialized(rig)
    for k in range(3):
        rid, _ = await prepared(rig, k)
        result = await rig.ok("fly-a", "Agent.Commit", commit_params("fly-a", rid, k), scope(k))
        assert result["telemetry"]["learning"] == {"enabled": True, "updates": str(k + 1),
                                                   "changed": "0", "signal": 0.0}


def com(rid: str = "req-2", **changes: Any) -> dict[str, Any]:
    return {**commit_params("fly-a", rid, 0), **changes}


COMMIT_REFUSALS: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
    ("other-session", com(), scope(0, session="other"), "IDENTITY_MISMATCH"),
    ("other-epoch", com(), scope(0, "e0"), "STALE_EPOCH"),
    ("k-plus-1", com(), scope(1), "FUTURE_STEP"),
    ("missing-key", without(com(), "rewards"), scope(0), "INVALID_ARGUMENT"),
    ("reward-string", com(rewards=[{"eventId": "e", "ruleId": "r", "value": "1"}]), scope(0),
     "INVALID_ARGUMENT"),
    ("other-agent", com(agentId="fly-b"), scope(0), "IDENTITY_MISMATCH"),
    ("other-prepare", com(preparedRequestId="req-1"), scope(0), "IDENTITY_MISMATCH"),
    ("boundary-k", com(nextInput=sensory(0, [view_ref(0, 0)])), scope(0), "INVALID_ARGUMENT"),
    ("boundary-k-plus-2", com(nextInput=sensory(2, [view_ref(0, 2)])), scope(0),
     "INVALID_ARGUMENT"),
    ("zero-duration", com(taskStimulations=[{**MILESTONE, "durationMs": 0}]), scope(0),
     "INVALID_ARGUMENT"),
    ("65-rewards", com(rewards=[{"eventId": "e", "ruleId": "r", "value": 1}] * 65), scope(0),
     "INVALID_ARGUMENT"),
    ("undeclared-kind", com(taskStimulations=[{**MILESTONE, "kindId": "arena.zap"}]), scope(0),
     "UNSUPPORTED"),
    ("context-schema", com(nextDecisionContext=OTHER_SCHEMA_CONTEXT), scope(0),
     "IDENTITY_MISMATCH"),
    ("bad-view", com(nextInput=sensory(1, [bad_digest_view() | {"producedStep": "0"}])),
     scope(0), "BUFFER_INVALID"),
    # pairs
    ("step-before-params", without(com(), "rewards"), scope(1), "FUTURE_STEP"),
    ("params-before-identity", com(agentId="fly-b", rewards="none"), scope(0),
     "INVALID_ARGUMENT"),
    ("identity-before-input", com(preparedRequestId="req-1",
                                  nextInput=sensory(0, [view_ref(0, 0)])), scope(0),
     "IDENTITY_MISMATCH"),
    ("input-before-kind", com(nextInput=sensory(0, [view_ref(0, 0)]),
                              taskStimulations=[{**MILESTONE, "kindId": "arena.zap"}]),
     scope(0), "INVALID_ARGUMENT"),
    ("kind-before-context", com(taskStimulations=[{**MILESTONE, "kindId": "arena.zap"}],
                                nextDecisionContext=OTHER_SCHEMA_CONTEXT), scope(0),
     "UNSUPPORTED"),
    ("context-before-views", com(nextDecisionContext=OTHER_SCHEMA_CONTEXT,
                                 nextInput=sensory(1, [bad_base64_view()])), scope(0),
     "IDENTITY_MISMATCH"),
]


@pytest.mark.parametrize(("params", "at", "code"), [c[1:] for c in COMMIT_REFUSALS],
                         ids=[c[0] for c in COMMIT_REFUSALS])
async def test_commit_checks_in_order_before_anything_is_applied(
        rig: Rig, params: dict[str, Any], at: dict[str, str], code: str) -> None:
    endpoint = await initialized(rig)
    rid, _ = await prepared(rig)
    assert rid == "req-2"
    model = endpoint.model  # type: ignore[attr-defined]
    state = model.state
    await refused(rig, "Agent.Commit", params, at, code)
    assert model.state == state
    assert (await rig.status("fly-a"))["state"] == "prepared"
    await rig.ok("fly-a", "Agent.Commit", com(), scope(0))


async def test_commit_while_ready_is_invalid_phase(rig: Rig) -> None:
    await initialized(rig)
    await refused(rig, "Agent.Commit", com(), scope(0), "INVALID_PHASE")


# --------------------------------------------------------------------------------------------
# fault knobs (§4.9)


async def test_a_prepare_delay_sleeps_in_preparing_before_any_mutation(rig: Rig) -> None:
    await initialized(rig, Faults(prepare_delay_ms=250))
    started = time.monotonic()
    call = asyncio.create_task(prepared(rig))
    await wait_for(lambda: _state(rig, "preparing"))
    assert (await rig.status("fly-a"))["progressCounter"] == "11"
    await call
    assert time.monotonic() - started >= 0.25


async def test_a_delay_at_step_k_sleeps_only_at_k(rig: Rig) -> None:
    await initialized(rig, Faults(prepare_delay_ms=500, prepare_delay_at_step=1,
                                  commit_delay_ms=500, commit_delay_at_step=0))
    durations = []
    for k in range(3):
        started = time.monotonic()
        rid, _ = await prepared(rig, k)
        prepare_s = time.monotonic() - started
        started = time.monotonic()
        await rig.ok("fly-a", "Agent.Commit", commit_params("fly-a", rid, k), scope(k))
        durations.append((prepare_s, time.monotonic() - started))
    assert durations[1][0] >= 0.5 and durations[0][0] < 0.4 and durations[2][0] < 0.4
    assert durations[0][1] >= 0.5 and durations[1][1] < 0.4 and durations[2][1] < 0.4


async def test_a_commit_delay_sleeps_in_committing_before_the_input_is_installed(
        rig: Rig) -> None:
    endpoint = await initialized(rig, Faults(commit_delay_ms=250))
    rid, _ = await prepared(rig)
    model = endpoint.model  # type: ignore[attr-defined]
    state, mutations = model.state, model.mutations()
    call = asyncio.create_task(rig.ok("fly-a", "Agent.Commit",
                                      commit_params("fly-a", rid, 0, counter=3), scope(0),
                                      request_id="req-3"))
    await wait_for(lambda: _state(rig, "committing"))
    status = await rig.status("fly-a")
    assert status["activeRequestId"] == "req-3"
    assert (model.state, model.mutations()) == (state, mutations)
    await call
    assert model.state != state and model.mutations() == mutations + 2


async def test_fail_commit_at_step_fails_after_the_input_is_installed(rig: Rig) -> None:
    endpoint = await initialized(rig, Faults(fail_commit_at_step=1))
    await step(rig, 0)
    rid, _ = await prepared(rig, 1)
    model = endpoint.model  # type: ignore[attr-defined]
    reinforcements = model.reinforcements
    mutations = model.mutations()
    error = await rig.error("fly-a", "Agent.Commit", commit_params("fly-a", rid, 1), scope(1))
    assert error == {"code": "BACKEND_FAILURE", "mutation": "applied",
                     "message": "injected commit failure after the next input was installed"}
    assert model.reinforcements == reinforcements and model.mutations() == mutations + 1
    status = await rig.status("fly-a")
    assert status["state"] == "failed" and status["currentScope"] == scope(1)
    await refused(rig, "Agent.Prepare", prep(decisionContextDigest=context_digest(2)), scope(2),
                  "INVALID_PHASE")


async def _state(rig: Rig, state: str) -> bool:
    return (await rig.status("fly-a"))["state"] == state


async def test_initialize_with_a_model_config_builds_that_graph(rig: Rig) -> None:
    await rig.start(agent_launch(rig.socket, model_config={"graphVariant": 2}))
    result = await rig.init_agent()
    assert result["graph"] == FakeBrain.graph("fly-a", {"graphVariant": 2}).to_json()
    assert result["graph"] != FakeBrain.graph("fly-a", {}).to_json()


async def test_views_carry_the_bytes_the_model_encodes(rig: Rig) -> None:
    """The first pixel byte of each view is the input (§4.3), base64 decoded exactly."""
    endpoint = await agent(rig)
    view = view_ref(200, 0)
    assert base64.b64decode(view["pixels"]["data"])[0] == 200
    await rig.ok("fly-a", "Agent.Initialize", agent_init_params(views=[view]), scope(0))
    reference = FakeBrain(agent_id="fly-a", seed=7, threads=1, config={})
    reference.install_input(200)
    reference.advance(10)
    assert endpoint.model.state == reference.state  # type: ignore[attr-defined]
