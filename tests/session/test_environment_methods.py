"""Environment methods (session.md §3.4, §3.5) over a real router: every check in its order, the
world time, the batch set, the view pipeline, the audio budget, and the environment fault knobs
of §4.9 (advance delay and the media faults).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import Sequence
from typing import Any

import pytest

from tests.session.worker_rig import (
    Rig,
    advance_params,
    control,
    env_init_params,
    environment_launch,
    rig,
    scope,
    wait_for,
)
from workers.composition import config_asset
from workers.faults import Faults
from workers.roles import endpoint_for
from workers.shell import Call, Endpoint
from workers.synthetic import CounterArena
from workers.synthetic.frame import render_frame
from workers.types.canonical import controls_digest
from workers.types.datatypes import PortControl
from workers.types.domain import DomainError, Scope
from workers.types.rpc import Request
from workers.types.ticks import RationalNs

__all__ = ["rig"]

O0_DIGEST = "4fb13d9f44c918a13f61ee818bd6b46fe2170a2c712d871d88eab2e883f40bcd"
BACKEND = "2fb50676f712f3f1ea2b2b085027711beafb4ec6ede69bb27ebd052b22380849"
CONTENT = "f2b01bea1ea5348acec4345444fcb4617029e06a4edc0625b664f90e4360e801"
CONFIGURATION = "19d4b0beffd13556d2f0da539a373c52f22a55708ef6da188a7d1eb8d8040027"
STEP = {"numerator": "50000000", "denominator": "3"}


class FlakyArena(CounterArena):
    """Renders fine except at boundary 2."""

    def render(self, view_id: str, boundary: int) -> bytes:
        if boundary == 2:
            raise RuntimeError("GPU lost")
        return super().render(view_id, boundary)


class BrokenApplyArena(CounterArena):
    def apply(self, controls: Sequence[PortControl]) -> None:
        self.counter += 1
        raise RuntimeError("physics diverged")


class ShortFrameArena(CounterArena):
    def render(self, view_id: str, boundary: int) -> bytes:
        return super().render(view_id, boundary)[:100]


class SubsetPortArena(CounterArena):
    def descriptor(self) -> Any:
        from dataclasses import replace

        d = super().descriptor()
        return replace(d, ports=d.ports[:1])


async def env(rig: Rig, **kwargs: Any) -> Endpoint:
    return await rig.start_endpoint(environment_launch(rig.socket, **kwargs))


async def initialized(rig: Rig, **kwargs: Any) -> tuple[Endpoint, dict[str, Any]]:
    endpoint = await env(rig, **kwargs)
    result = await rig.init_env()
    return endpoint, result


async def advance(rig: Rig, k: int, inc: tuple[bool, bool] = (False, False),
                  dec: tuple[bool, bool] = (False, False)) -> dict[str, Any]:
    controls = [control("p1", inc[0], dec[0]), control("p2", inc[1], dec[1])]
    return await rig.ok("arena", "Environment.Advance", advance_params(k, controls), scope(k))


async def refused(rig: Rig, method: str, params: dict[str, Any], at: dict[str, str] | None,
                  code: str) -> dict[str, Any]:
    before = await rig.status("arena")
    error = await rig.error("arena", method, params, at)
    assert (error["code"], error["mutation"]) == (code, "none"), error
    assert await rig.status("arena") == before
    return error


def pixels(view: dict[str, Any]) -> bytes:
    data = base64.b64decode(view["pixels"]["data"])
    assert hashlib.sha256(data).hexdigest() == view["pixels"]["digest"]
    assert len(data) == int(view["pixels"]["byteLength"])
    return data


# --------------------------------------------------------------------------------------------
# Environment.Initialize (§3.4)


async def test_initialize_resets_the_world_and_renders_o0(rig: Rig) -> None:
    _, result = await initialized(rig)
    descriptor = result["descriptor"]
    assert (descriptor["backendDigest"], descriptor["contentDigest"],
            descriptor["configurationDigest"]) == (BACKEND, CONTENT, CONFIGURATION)
    assert descriptor["stepDuration"] == STEP
    assert [p["portId"] for p in descriptor["ports"]] == ["p1", "p2"]
    assert descriptor["views"][0]["observationDelaySteps"] == 0
    o0 = result["observation"]
    assert o0["boundary"] == "0" and o0["worldTime"] == {"numerator": "0", "denominator": "1"}
    assert o0["engineFrame"] == "0" and o0["audio"] == [] and o0["broadcastViews"] == ["arena"]
    (view,) = o0["sensoryViews"]
    assert view["producedStep"] == "0" and view["pixels"]["contentType"] == "image/x-rgba8"
    assert hashlib.sha256(pixels(view)).hexdigest() == O0_DIGEST
    assert o0["inspection"]["value"] == {"counter": 0, "boundary": 0}
    assert await rig.status("arena") == {
        "state": "ready", "currentScope": scope(0), "activeRequestId": None,
        "lastCompletedRequestId": "req-1", "lastBatchId": None, "progressCounter": "1"}


def mutate(**changes: Any) -> dict[str, Any]:
    return {**env_init_params(), **changes}


OTHER_CONFIG = config_asset("arena-config", {"x": 1}).to_json()
INITIALIZE_REFUSALS: list[tuple[str, dict[str, Any], dict[str, str] | None, str]] = [
    ("scope-null", env_init_params(), None, "INVALID_ARGUMENT"),
    ("other-session", env_init_params(), scope(0, session="other"), "IDENTITY_MISMATCH"),
    ("step-1", env_init_params(), scope(1), "FUTURE_STEP"),
    ("missing-key", {k: v for k, v in env_init_params().items() if k != "episodeId"}, scope(0),
     "INVALID_ARGUMENT"),
    ("one-element-binding", mutate(portBindings=[["p1"]]), scope(0), "INVALID_ARGUMENT"),
    ("bad-episode", mutate(episodeId="Episode One"), scope(0), "INVALID_ARGUMENT"),
    ("five-bindings", mutate(portBindings=[["p1", f"fly-{i}"] for i in range(5)]), scope(0),
     "INVALID_ARGUMENT"),
    ("unknown-port", mutate(portBindings=[["p9", "fly-a"]]), scope(0), "IDENTITY_MISMATCH"),
    ("port-twice", mutate(portBindings=[["p1", "fly-a"], ["p1", "fly-b"]]), scope(0),
     "INVALID_ARGUMENT"),
    ("agent-twice", mutate(portBindings=[["p1", "fly-a"], ["p2", "fly-a"]]), scope(0),
     "INVALID_ARGUMENT"),
    ("other-backend", mutate(backendConfig=OTHER_CONFIG), scope(0), "IDENTITY_MISMATCH"),
    ("other-backend-id", mutate(backendConfig=config_asset("world-config", {}).to_json()),
     scope(0), "IDENTITY_MISMATCH"),
    # pairs
    ("session-before-step", env_init_params(), scope(1, session="other"), "IDENTITY_MISMATCH"),
    ("step-before-params", mutate(episodeId=7), scope(1), "FUTURE_STEP"),
    ("count-before-ports", mutate(portBindings=[["p9", f"fly-{i}"] for i in range(5)]),
     scope(0), "INVALID_ARGUMENT"),
    ("unknown-port-before-twice", mutate(portBindings=[["p1", "fly-a"], ["p1", "fly-b"],
                                                       ["p9", "fly-c"]]), scope(0),
     "IDENTITY_MISMATCH"),
    ("twice-before-backend", mutate(portBindings=[["p1", "fly-a"], ["p1", "fly-b"]],
                                    backendConfig=OTHER_CONFIG), scope(0), "INVALID_ARGUMENT"),
]


@pytest.mark.parametrize(("params", "at", "code"), [c[1:] for c in INITIALIZE_REFUSALS],
                         ids=[c[0] for c in INITIALIZE_REFUSALS])
async def test_initialize_checks_in_order(rig: Rig, params: dict[str, Any],
                                          at: dict[str, str] | None, code: str) -> None:
    await env(rig)
    await refused(rig, "Environment.Initialize", params, at, code)
    assert (await rig.status("arena"))["state"] == "uninitialized"
    await rig.init_env()


async def test_a_second_initialize_is_invalid_phase(rig: Rig) -> None:
    await initialized(rig)
    await refused(rig, "Environment.Initialize", env_init_params(), scope(0), "INVALID_PHASE")


async def test_a_partial_binding_is_accepted(rig: Rig) -> None:
    endpoint, _ = await initialized(rig)
    assert endpoint.bindings == (("p1", "fly-a"), ("p2", "fly-b"))  # type: ignore[attr-defined]
    await env(rig, world_id="arena2", ports=("p1", "p2"))
    result = await rig.ok("arena2", "Environment.Initialize",
                          env_init_params([["p2", "fly-b"]], world_id="arena2"), scope(0))
    assert result["observation"]["boundary"] == "0"


# --------------------------------------------------------------------------------------------
# Environment.Advance (§3.5)


async def test_advance_applies_the_batch_and_renders_the_next_boundary(rig: Rig) -> None:
    await initialized(rig)
    controls = [control("p1", inc=True, bias=-0.5), control("p2", inc=True, bias=1)]
    result = await rig.ok("arena", "Environment.Advance", advance_params(0, controls), scope(0))
    assert result["batchId"] == "batch-e1-0"
    assert (result["appliedFromStep"], result["nextStep"]) == ("0", "1")
    assert result["appliedControlsDigest"] == controls_digest(
        [PortControl.from_json(c).to_json() for c in controls])
    obs = result["observation"]
    assert obs["boundary"] == "1" and obs["worldTime"] == STEP and obs["engineFrame"] == "1"
    assert obs["inspection"]["value"] == {"counter": 2, "boundary": 1}
    (view,) = obs["sensoryViews"]
    assert view["producedStep"] == "1" and pixels(view) == render_frame(2, 1)
    (chunk,) = obs["audio"]
    assert (chunk["streamId"], chunk["firstSample"], chunk["sampleFrames"]) == ("arena", "0",
                                                                                800)
    assert chunk["samples"]["contentType"] == "audio/x-f32le"
    assert chunk["samples"]["byteLength"] == "6400" and chunk["discontinuity"] is False
    assert await rig.status("arena") == {
        "state": "ready", "currentScope": scope(1), "activeRequestId": None,
        "lastCompletedRequestId": "req-2", "lastBatchId": "batch-e1-0", "progressCounter": "2"}


async def test_world_time_is_exact_and_the_audio_positions_follow_the_budget(rig: Rig) -> None:
    await initialized(rig)
    positions = []
    for k in range(6):
        obs = (await advance(rig, k))["observation"]
        assert obs["worldTime"] == RationalNs(50_000_000, 3).times(k + 1).to_json()
        positions.append(int(obs["audio"][0]["firstSample"]))
    assert positions == [0, 800, 1600, 2400, 3200, 4000]
    assert (await rig.status("arena"))["progressCounter"] == "7"


async def test_an_uneven_step_gets_an_exact_sample_budget(rig: Rig) -> None:
    step = RationalNs(1_000_000_000, 7)
    await rig.start(environment_launch(rig.socket, step=step))
    await rig.init_env()
    frames = [(await advance(rig, k))["observation"]["audio"][0]["sampleFrames"]
              for k in range(7)]
    assert sum(frames) == 48000 and set(frames) <= {6857, 6858}


def adv(k: int = 0, **changes: Any) -> dict[str, Any]:
    return {**advance_params(k), **changes}


BAD_CONTROLS = {
    "missing-port": [control("p1")],
    "extra-port": [control("p1"), control("p2"), control("p3")],
    "reversed": [control("p2"), control("p1")],
    "buttons-reordered": [{"portId": "p1", "buttons": [{"id": "dec", "down": False},
                                                       {"id": "inc", "down": False}],
                           "axes": [{"id": "bias", "value": 0}]}, control("p2")],
    "extra-button": [{**control("p1"), "buttons": control("p1")["buttons"] + [
        {"id": "jump", "down": True}]}, control("p2")],
    "missing-axis": [{**control("p1"), "axes": []}, control("p2")],
    "axis-range": [control("p1"), control("p2", bias=1.5)],
    "axis-bool": [control("p1"), {**control("p2"), "axes": [{"id": "bias", "value": True}]}],
}


@pytest.mark.parametrize("name", list(BAD_CONTROLS))
async def test_controls_must_match_the_descriptor_exactly(rig: Rig, name: str) -> None:
    await initialized(rig)
    error = await refused(rig, "Environment.Advance", adv(controls=BAD_CONTROLS[name]),
                          scope(0), "INVALID_ARGUMENT")
    if name in ("axis-range", "buttons-reordered", "extra-button", "missing-axis"):
        assert "port p" in error["message"]
    await advance(rig, 0)


ADVANCE_REFUSALS: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
    ("other-session", adv(), scope(0, session="other"), "IDENTITY_MISMATCH"),
    ("other-epoch", adv(), scope(0, "e0"), "STALE_EPOCH"),
    ("future-step", adv(1), scope(1), "FUTURE_STEP"),
    ("bad-batch-id", adv(batchId="Batch 0"), scope(0), "INVALID_ARGUMENT"),
    ("missing-controls", {"batchId": "b0"}, scope(0), "INVALID_ARGUMENT"),
    ("extra-key", adv(more=1), scope(0), "INVALID_ARGUMENT"),
    # pairs
    ("epoch-before-step", adv(), scope(4, "e0"), "STALE_EPOCH"),
    ("step-before-params", {"batchId": "b0"}, scope(1), "FUTURE_STEP"),
    ("params-before-controls", {**adv(controls=[control("p2")]), "x": 1}, scope(0),
     "INVALID_ARGUMENT"),
]


@pytest.mark.parametrize(("params", "at", "code"), [c[1:] for c in ADVANCE_REFUSALS],
                         ids=[c[0] for c in ADVANCE_REFUSALS])
async def test_advance_checks_in_order(rig: Rig, params: dict[str, Any], at: dict[str, str],
                                       code: str) -> None:
    await initialized(rig)
    await refused(rig, "Environment.Advance", params, at, code)
    assert (await advance(rig, 0))["nextStep"] == "1"


async def test_advance_before_initialize_is_invalid_phase(rig: Rig) -> None:
    await env(rig)
    await refused(rig, "Environment.Advance", adv(), scope(0), "INVALID_PHASE")


async def test_a_batch_id_applied_in_this_epoch_conflicts(rig: Rig) -> None:
    await initialized(rig)
    await advance(rig, 0)
    error = await refused(rig, "Environment.Advance", adv(1, batchId="batch-e1-0"), scope(1),
                          "CONFLICT")
    assert "batch-e1-0" in error["message"]
    assert (await rig.status("arena"))["lastBatchId"] == "batch-e1-0"


async def test_controls_are_checked_after_the_batch_id(rig: Rig) -> None:
    await initialized(rig)
    await advance(rig, 0)
    await refused(rig, "Environment.Advance",
                  adv(1, batchId="batch-e1-0", controls=[control("p2")]), scope(1), "CONFLICT")


async def test_the_handler_refuses_an_older_step_with_stale_step(rig: Rig) -> None:
    endpoint, _ = await initialized(rig)
    await advance(rig, 0)
    call = Call("Environment.Advance", Request("req-50", Scope("demo", "e1", 0),
                                               adv(0, batchId="b-x")), "s7.coordinator")
    with pytest.raises(DomainError) as info:
        await endpoint.handlers["Environment.Advance"](call)
    assert info.value.code == "STALE_STEP"


async def test_an_advance_delay_sleeps_after_the_world_applied_the_batch(rig: Rig) -> None:
    await initialized(rig, faults=Faults(advance_delay_ms=300))
    started = time.monotonic()
    call = asyncio.create_task(rig.ok("arena", "Environment.Advance", adv(), scope(0),
                                      request_id="req-2"))
    await wait_for(lambda: _state(rig, "advancing"))
    status = await rig.status("arena")
    assert status["lastBatchId"] == "batch-e1-0" and status["currentScope"] == scope(1)
    assert status["progressCounter"] == "2" and status["activeRequestId"] == "req-2"
    result = await call
    assert time.monotonic() - started >= 0.3 and result["nextStep"] == "1"
    assert (await rig.status("arena"))["state"] == "ready"


async def test_an_advance_delay_at_step_k_sleeps_only_at_k(rig: Rig) -> None:
    await initialized(rig, faults=Faults(advance_delay_ms=500, advance_delay_at_step=1))
    durations = []
    for k in range(3):
        started = time.monotonic()
        await advance(rig, k)
        durations.append(time.monotonic() - started)
    assert durations[1] >= 0.5 and durations[0] < 0.4 and durations[2] < 0.4


async def _state(rig: Rig, state: str) -> bool:
    return (await rig.status("arena"))["state"] == state


# --------------------------------------------------------------------------------------------
# view pipeline and media faults


async def test_a_delayed_view_repeats_o0_and_then_lags_by_the_delay(rig: Rig) -> None:
    _, result = await initialized(rig, delay=2)
    assert result["descriptor"]["views"][0]["observationDelaySteps"] == 2
    assert result["descriptor"]["configurationDigest"] != CONFIGURATION
    served = [(result["observation"]["sensoryViews"][0]["producedStep"],
               pixels(result["observation"]["sensoryViews"][0]))]
    counters = [0]
    for k in range(5):
        obs = (await advance(rig, k, inc=(True, False)))["observation"]
        counters.append(k + 1)
        (view,) = obs["sensoryViews"]
        served.append((view["producedStep"], pixels(view)))
    expected = [max(0, b - 2) for b in range(6)]
    assert [int(p) for p, _ in served] == expected
    for boundary, (produced, data) in enumerate(served):
        p = int(produced)
        assert data == render_frame(counters[p], p), boundary


async def test_omit_view_at_boundary_serves_no_view(rig: Rig) -> None:
    await initialized(rig, faults=Faults(omit_view_at_boundary=1))
    obs = (await advance(rig, 0))["observation"]
    assert obs["sensoryViews"] == [] and obs["broadcastViews"] == []
    assert len((await advance(rig, 1))["observation"]["sensoryViews"]) == 1


async def test_omit_view_at_boundary_zero_empties_o0(rig: Rig) -> None:
    _, result = await initialized(rig, faults=Faults(omit_view_at_boundary=0))
    assert result["observation"]["sensoryViews"] == []


async def test_stale_view_at_boundary_serves_the_previous_frame_again(rig: Rig) -> None:
    await initialized(rig, faults=Faults(stale_view_at_boundary=2))
    first = (await advance(rig, 0, inc=(True, True)))["observation"]["sensoryViews"][0]
    stale = (await advance(rig, 1, inc=(True, True)))["observation"]["sensoryViews"][0]
    assert stale == first and stale["producedStep"] == "1"
    fresh = (await advance(rig, 2))["observation"]["sensoryViews"][0]
    assert fresh["producedStep"] == "3" and pixels(fresh) == render_frame(4, 3)


async def test_truncated_view_at_boundary_is_one_row_short_and_described_honestly(
        rig: Rig) -> None:
    await initialized(rig, faults=Faults(truncated_view_at_boundary=1))
    view = (await advance(rig, 0))["observation"]["sensoryViews"][0]
    assert view["pixels"]["byteLength"] == str(3072 - 128)
    assert pixels(view) == render_frame(0, 1)[:-128]


async def test_omit_audio_at_boundary_drops_the_chunk_and_leaves_a_gap(rig: Rig) -> None:
    await initialized(rig, faults=Faults(omit_audio_at_boundary=2))
    assert (await advance(rig, 0))["observation"]["audio"][0]["firstSample"] == "0"
    assert (await advance(rig, 1))["observation"]["audio"] == []
    assert (await advance(rig, 2))["observation"]["audio"][0]["firstSample"] == "1600"


async def test_overlapping_audio_at_boundary_starts_one_sample_early(rig: Rig) -> None:
    await initialized(rig, faults=Faults(overlapping_audio_at_boundary=1))
    chunk = (await advance(rig, 0))["observation"]["audio"][0]
    assert chunk["firstSample"] == "0"  # saturating at 0


async def test_overlapping_audio_later_in_the_stream(rig: Rig) -> None:
    await initialized(rig, faults=Faults(overlapping_audio_at_boundary=2))
    await advance(rig, 0)
    chunk = (await advance(rig, 1))["observation"]["audio"][0]
    assert chunk["firstSample"] == "799" and chunk["sampleFrames"] == 800


# --------------------------------------------------------------------------------------------
# world failures and launch refusals


async def test_a_render_failure_after_the_step_applied_is_backend_failure_applied(
        rig: Rig) -> None:
    await rig.start(world_launch(rig, "FlakyArena"))
    await rig.init_env()
    await advance(rig, 0)
    payload = {"requestId": "req-9", "scope": scope(1), "params": adv(1)}
    first = (await rig.raw("arena", "Environment.Advance", payload)).outcome
    data = first["error"].pop("data")
    assert first["error"] == {"code": "BACKEND_FAILURE", "mutation": "applied",
                              "message": "render failed: RuntimeError: GPU lost"}
    # the world's exception as data: a call's failure is retried (`repeats` false)
    assert (data["plugin"], data["stage"], data["exception"], data["message"],
            data["repeats"]) == (f"{__name__}:FlakyArena", "call", "RuntimeError", "GPU lost",
                                 False)
    assert "in render" in data["frames"][-1]
    first["error"]["data"] = data
    assert (await rig.raw("arena", "Environment.Advance", payload)).outcome == first
    status = await rig.status("arena")
    assert status["state"] == "failed" and status["lastBatchId"] == "batch-e1-1"
    assert status["currentScope"] == scope(2) and status["progressCounter"] == "3"
    await refused(rig, "Environment.Advance", adv(2), scope(2), "INVALID_PHASE")


def world_launch(rig: Rig, world: str) -> Any:
    from dataclasses import replace

    base = environment_launch(rig.socket)
    return replace(base, settings=replace(base.environment, world=f"{__name__}:{world}"))


async def test_a_world_failure_while_applying_is_backend_failure_unknown(rig: Rig) -> None:
    await rig.start(world_launch(rig, "BrokenApplyArena"))
    await rig.init_env()
    error = await rig.error("arena", "Environment.Advance", adv(), scope(0))
    assert error.pop("data")["message"] == "physics diverged"
    assert error == {"code": "BACKEND_FAILURE", "mutation": "unknown",
                     "message": "Environment.Advance failed: RuntimeError: physics diverged"}
    assert (await rig.status("arena"))["state"] == "failed"


async def test_a_frame_of_the_wrong_size_is_a_render_failure(rig: Rig) -> None:
    await rig.start(world_launch(rig, "ShortFrameArena"))
    error = await rig.error("arena", "Environment.Initialize", env_init_params(), scope(0))
    assert (error["code"], error["mutation"]) == ("BACKEND_FAILURE", "applied")
    assert "3072" in error["message"]


async def test_a_world_declaring_other_ports_than_the_launch_is_refused(rig: Rig) -> None:
    from workers.bodies import run_worker

    with pytest.raises(DomainError) as info:
        await run_worker(world_launch(rig, "SubsetPortArena"), endpoint_factory=endpoint_for)
    assert info.value.code == "INVALID_ARGUMENT" and "ports" in info.value.message


async def test_an_unknown_world_class_is_refused_at_launch(rig: Rig) -> None:
    from workers.bodies import run_worker

    with pytest.raises(DomainError) as info:
        await run_worker(world_launch(rig, "NoSuchArena"), endpoint_factory=endpoint_for)
    assert "NoSuchArena" in info.value.message
