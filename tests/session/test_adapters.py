"""The adapters' parts (docs/adapters.md): the space mappings, the world's checkpoint (a
pickled env that continues exactly, an unpicklable env whose capture names it, also through a
session), a stateful policy's checkpoint, the rules the world refuses at start, the task's
rewards and endings, and that nothing outside `workers/adapters` imports the optional packages.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gymnasium import spaces

from flyd.launch.launcher import ExecutionMode
from flyd.session.runspec import RunSpec
from tests.cli.adapter_envs import EzLineEnv, LineEnv, ThreadLineEnv
from tests.session.harness import Fixture, SessionHarness, within
from workers.adapters import snapshot
from workers.adapters.gymnasium import EnvWorld
from workers.adapters.pettingzoo import EnvTask, ParallelEnvWorld, PolicyModel, episode_seed
from workers.adapters.spaces import (
    CONTEXT,
    controller,
    decode_observation,
    describe,
    encode_observation,
    to_action,
    to_intent,
    to_space,
    typed,
)
from workers.protocols import ControllerIntent, DecodedArray
from workers.types.datatypes import (
    AxisValue,
    ButtonState,
    PortControl,
    PortSpec,
    check_port_control,
)
from workers.types.domain import DomainError, Scope
from workers.types.ticks import RationalNs

ROOT = Path(__file__).resolve().parents[2]
ENVS = "tests.cli.adapter_envs"
PORTS = ("p1", "p2")
BINDINGS = (("p1", "walker-a"), ("p2", "walker-b"))


def line_world(env: str = "LineEnv", **config: Any) -> ParallelEnvWorld:
    return ParallelEnvWorld(world_id="line", ports=PORTS, step=RationalNs.millis(10),
                            observation_delay_steps=0, threads=1,
                            config={"env": f"{ENVS}:{env}", "seed": 3, **config})


def policies() -> dict[str, PolicyModel]:
    pool = ThreadPoolExecutor(1)
    return {agent: PolicyModel(agent_id=agent, seed=7, threads=1, executor=pool,
                               config={"policy": f"{ENVS}:{policy}"})
            for agent, policy in (("walker-a", "walk"), ("walker-b", "stubborn"))}


def delivered(world: ParallelEnvWorld, port: str, boundary: int) -> Any:
    """The port's input as its agent's model encodes it (arrays as the agent decodes them)."""
    structured, arrays = world.agent_input(port, boundary)
    return PolicyModel.encode([], structured, [DecodedArray(a.id, a.dtype, a.shape, a.data)
                                               for a in arrays])


def run(world: ParallelEnvWorld, models: dict[str, PolicyModel], steps: int,
        start: int = 0) -> list[Any]:
    """`steps` transitions of the world driven by the models; every inspection after one."""
    seen = []
    for k in range(start, start + steps):
        controls = []
        for port, agent in BINDINGS:
            models[agent].install_input(delivered(world, port, k))
            decision = models[agent].decide(typed(CONTEXT, {"step": k}))
            controls.append(ControllerIntent.from_json(decision.value).for_port(port))
        world.apply(controls)
        seen.append(world.inspection(k + 1).value)
    return seen


# --------------------------------------------------------------------------------------------
# spaces


def test_a_discrete_action_is_one_button_and_a_box_action_is_axes() -> None:
    discrete = describe(spaces.Discrete(3, start=-1), bounds=True)
    schema = controller(discrete)
    assert schema.buttons == ("a0", "a1", "a2") and schema.axes == ()
    intent = to_intent(discrete, 1)
    assert [b["down"] for b in intent["buttons"]] == [False, False, True]
    control = ControllerIntent.from_json(intent).for_port("p1")
    check_port_control(control, PortSpec("p1", schema))
    assert to_action(discrete, control) == 1
    released = tuple(ButtonState(b.id, False) for b in control.buttons)
    assert to_action(discrete, PortControl("p1", released, ())) == -1  # none pressed: start

    box = describe(spaces.Box(np.array([-2, 0], np.float32), np.array([2, 10], np.float32)),
                   bounds=True)
    schema = controller(box)
    assert [a.id for a in schema.axes] == ["x0", "x1"] and schema.buttons == ()
    intent = to_intent(box, np.array([1.0, 2.5], dtype=np.float32))
    assert [a["value"] for a in intent["axes"]] == [0.5, -0.5]
    action = to_action(box, ControllerIntent.from_json(intent).for_port("p1"))
    assert action.dtype == np.float32 and action.tolist() == [1.0, 2.5]


@pytest.mark.parametrize("space, reason", [
    (spaces.Box(-np.inf, np.inf, (2,)), "finite bounds"),
    (spaces.Box(0, 5, (2,), dtype=np.int64), "floating dtype"),
    (spaces.MultiDiscrete([3, 3]), "not supported"),
    (spaces.Discrete(40), "at most 32 buttons"),
])
def test_unmappable_action_spaces_are_unsupported(space: Any, reason: str) -> None:
    with pytest.raises(DomainError, match=reason) as info:
        controller(describe(space, bounds=True))
    assert info.value.code == "UNSUPPORTED"


def test_observations_travel_as_binary_arrays_and_round_trip() -> None:
    space = spaces.Dict({"pos": spaces.Box(0, 1, (2, 2), np.float32),
                         "mode": spaces.Discrete(4),
                         "bits": spaces.Tuple((spaces.MultiBinary(3),)),
                         "pixels": spaces.Box(0, 255, (64, 48, 3), np.uint8)})
    space.seed(1)
    value = space.sample()
    desc = describe(space)
    structured, arrays = encode_observation(desc, value)
    # no number of an array is written as JSON: the structured value names arrays by id and
    # digest, and the arrays are the raw bytes with their dtype and shape
    assert structured["mode"] == int(value["mode"])
    # leaves in the space's key order (gymnasium sorts a plain dict's keys)
    assert structured["pos"] == {"array": "o2", "digest": hashlib.sha256(
        value["pos"].tobytes()).hexdigest()}
    assert [(a.id, a.dtype, a.shape) for a in arrays] == [
        ("o0", "|i1", (3,)), ("o1", "|u1", (64, 48, 3)), ("o2", "<f4", (2, 2))]
    assert arrays[1].data == value["pixels"].tobytes()
    back = decode_observation(desc, structured, {a.id: DecodedArray(a.id, a.dtype, a.shape,
                                                                    a.data) for a in arrays})
    assert back["pos"].dtype == np.float32 and np.array_equal(back["pos"], value["pos"])
    assert back["mode"] == value["mode"]
    assert np.array_equal(back["bits"][0], value["bits"][0])
    assert np.array_equal(back["pixels"], value["pixels"])
    rebuilt = to_space(desc)
    assert rebuilt["pixels"] == space["pixels"] and rebuilt["pos"] == space["pos"]


# --------------------------------------------------------------------------------------------
# the world and the policy model


def test_a_restored_world_and_policy_continue_exactly() -> None:
    world, models = line_world(), policies()
    world.reset("ep1", BINDINGS)
    run(world, models, 4)
    saved = world.capture()
    states = {agent: model.capture() for agent, model in models.items()}
    expected = run(world, models, 6, start=4)

    twin, twins = line_world(), policies()
    twin.reset("ep1", BINDINGS)
    twin.restore(saved)
    for agent, model in twins.items():
        model.restore(states[agent])
    assert twins["walker-b"].policy.calls == 4  # the stateful policy's count came back
    assert run(twin, twins, 6, start=4) == expected


def restored(saved: bytes, env: str = "LineEnv", **config: Any) -> ParallelEnvWorld:
    """A fresh world (as a staged restore builds it) with `saved` installed."""
    twin = line_world(env, **config)
    twin.reset("ep1", BINDINGS)
    twin.restore(saved)
    return twin


def continues(env: str, saved_at: int, **config: Any) -> tuple[ParallelEnvWorld, bytes]:
    """A world run `saved_at` steps, then captured and run on; the restored capture must
    run on with the same inspections. Returns the world and its capture."""
    world, models = line_world(env, **config), policies()
    world.reset("ep1", BINDINGS)
    run(world, models, saved_at)
    saved = world.capture()
    states = {agent: model.capture() for agent, model in models.items()}
    expected = run(world, models, 8, start=saved_at)
    twins = policies()
    for agent, model in twins.items():
        model.restore(states[agent])
    assert run(restored(saved, env, **config), twins, 8, start=saved_at) == expected
    return world, saved


def test_an_ezpickle_env_is_captured_with_its_whole_state() -> None:
    env = EzLineEnv()
    env.reset(seed=3)
    env.step({"walker_0": 2, "walker_1": 2})
    plain = pickle.loads(pickle.dumps(env))
    assert plain.agents == [] and plain.positions == {}, "EzPickle's own pickle kept the state"
    exact = snapshot.loads(snapshot.dumps(env))
    assert exact.agents == env.agents and exact.positions == env.positions
    assert exact.steps == 1
    assert exact.np_random.bit_generator.state == env.np_random.bit_generator.state


def test_auto_checks_the_first_capture_then_trusts_snapshots() -> None:
    world, _ = continues("EzLineEnv", 2)
    # the first capture started the check; its twin matched the next steps
    assert world.recovery.state == "snapshot"
    later = pickle.loads(zlib.decompress(world.capture()))["env"]
    assert later["state"] == "snapshot" and later["env"] is not None
    assert later["log"] is not None  # kept for a snapshot that restores differently
    assert later["frame"] is None  # this world does not render
    continues("EzLineEnv", 5, restore="snapshot")


def test_an_env_that_diverges_after_restore_is_recovered_by_replay() -> None:
    world, saved = continues("DriftingLineEnv", 2)
    assert world.recovery.state == "replay"
    assert "diverged 1 step(s) after the first capture" in world.recovery.reason
    # the first capture was made before the check, and replays as well
    assert pickle.loads(zlib.decompress(saved))["env"]["state"] == "checking"
    # the same env restored from a snapshot would not have continued (the check's reason)
    world, models = line_world("DriftingLineEnv", restore="snapshot"), policies()
    world.reset("ep1", BINDINGS)
    run(world, models, 2)
    saved = world.capture()
    twins = policies()
    for agent, model in models.items():
        twins[agent].restore(model.capture())
    expected = run(world, models, 3, start=2)
    assert run(restored(saved, "DriftingLineEnv", restore="snapshot"), twins, 3,
               start=2) != expected


def test_a_snapshot_that_renders_another_picture_once_restored_is_replayed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`HomesickLineEnv` passes the in-process check; restored in another process (its pid
    patched here) it drifts, its render shows it, and `auto` replays the record instead."""
    world, models = line_world("HomesickLineEnv", render=True), policies()
    world.reset("ep1", BINDINGS)
    run(world, models, 2)
    world.capture()
    run(world, models, 4, start=2)
    assert world.recovery.state == "snapshot"
    # the endpoint renders a boundary's view before its capture, which keeps that frame's digest
    assert world.render("frame", 6) is not None
    saved = world.capture()
    states = {agent: model.capture() for agent, model in models.items()}
    expected = run(world, models, 5, start=6)
    home = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: home + 1)
    twins = policies()
    for agent, model in twins.items():
        model.restore(states[agent])
    twin = restored(saved, "HomesickLineEnv", render=True)
    assert twin.recovery.state == "replay"
    assert twin.recovery.reason == "its snapshot rendered another picture once restored"
    assert run(twin, twins, 5, start=6) == expected
    # without the picture the snapshot would have been installed, one cell off
    drifted = restored(saved, "HomesickLineEnv")
    assert drifted.recovery.state == "snapshot"
    assert drifted.env.positions != twin.env.positions


def test_an_unpicklable_env_is_recovered_by_replay_in_auto() -> None:
    world, saved = continues("UnpicklableLineEnv", 4)
    assert world.recovery.state == "replay" and "cannot be pickled" in world.recovery.reason
    part = pickle.loads(zlib.decompress(saved))["env"]
    assert part["env"] is None and len(part["log"].actions) == 4
    continues("UnpicklableLineEnv", 3, restore="replay")


def test_a_replay_starts_at_the_episode_the_capture_is_in() -> None:
    _, saved = continues("UnpicklableLineEnv", 7, kwargs={"size": 4, "maxSteps": 5})
    state = pickle.loads(zlib.decompress(saved))
    assert state["episode"] >= 1, "no episode ended before the capture"
    log = state["env"]["log"]
    assert log.seed == episode_seed(3, state["episode"])
    assert 0 < len(log.actions) < 7  # only the current episode's steps


def test_snapshot_refuses_an_unpicklable_env_when_the_world_starts() -> None:
    with pytest.raises(DomainError) as info:
        line_world("UnpicklableLineEnv", restore="snapshot")
    assert info.value.code == "INVALID_ARGUMENT" and info.value.mutation == "none"
    assert info.value.message.startswith(f"world line (env {ENVS}:UnpicklableLineEnv) cannot "
                                         "be pickled (TypeError: cannot pickle '_thread.lock'")
    assert "set restore to auto or replay" in info.value.message
    with pytest.raises(DomainError, match="restore must be one of auto, snapshot, replay"):
        line_world(restore="always")


def test_a_replay_that_differs_from_the_record_is_restore_diverged_naming_the_step() -> None:
    world, models = line_world("GlobalRandomLineEnv", restore="replay"), policies()
    world.reset("ep1", BINDINGS)
    random.seed(1)
    run(world, models, 6)
    saved = world.capture()
    random.seed(2)
    with pytest.raises(DomainError) as info:
        restored(saved, "GlobalRandomLineEnv", restore="replay")
    assert info.value.code == "RESTORE_DIVERGED"
    assert re.search(r"did not replay its episode: step \d+'s result differs from the "
                     r"recorded one; the env is not deterministic", info.value.message)


def test_every_call_into_the_env_runs_on_one_thread() -> None:
    ThreadLineEnv.threads.clear()
    world = line_world("ThreadLineEnv", render=True)
    world.reset("ep1", BINDINGS)
    with ThreadPoolExecutor(1) as other:
        other.submit(run, world, policies(), 3).result()
        other.submit(world.render, "frame", 3).result()
        saved = other.submit(world.capture).result()
    world.capture()
    assert ThreadLineEnv.threads == {world.thread.ident()}
    assert world.thread.ident() != threading.get_ident()
    twin = restored(saved, "ThreadLineEnv", render=True)
    twin.render("frame", 3)
    assert ThreadLineEnv.threads == {world.thread.ident(), twin.thread.ident()}


def test_a_mujoco_env_renders_one_picture_whatever_thread_asks_and_after_a_restore(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """MuJoCo draws black frames when asked from a thread other than the one that made its
    OpenGL context; the world's env thread makes every render the same. A capture made after
    rendering (the renderer then holds a context) restores into a world that renders the
    same picture."""
    monkeypatch.setenv("MUJOCO_GL", "egl")

    def pole() -> EnvWorld:
        world = EnvWorld(world_id="pole", ports=("p1",), step=RationalNs.millis(40),
                         observation_delay_steps=0, threads=1,
                         config={"env": "gymnasium:make", "render": True, "seed": 1,
                                 "kwargs": {"id": "InvertedPendulum-v5", "width": 64,
                                            "height": 48}})
        world.reset("ep1", (("p1", "balancer"),))
        return world

    world = pole()
    push = PortControl("p1", (), (AxisValue("x0", 0.5),))
    for _ in range(3):
        world.apply([push])
    here = world.render("frame", 3)
    with ThreadPoolExecutor(1) as other:
        there = other.submit(world.render, "frame", 3).result()
    assert here == there
    assert len(set(here[0::4])) > 8, "a black or blank frame"
    twin = pole()
    twin.restore(world.capture())
    assert twin.render("frame", 3) == here
    world.apply([push])
    twin.apply([push])
    assert twin.render("frame", 4) == world.render("frame", 4) != here


def test_an_action_outside_its_space_fails_at_once_naming_the_agent_and_the_space() -> None:
    world = line_world()
    world.reset("ep1", BINDINGS)
    model = PolicyModel(agent_id="walker-a", seed=7, threads=1, executor=ThreadPoolExecutor(1),
                        config={"policy": f"{ENVS}:wild"})
    for k in range(20):
        try:
            model.install_input(delivered(world, "p1", k))
        except DomainError as exc:
            error = exc
            break
        controls = ControllerIntent.from_json(model.decide(typed(CONTEXT, {"step": k})).value)
        world.apply([controls.for_port("p1"), controls.for_port("p2")])
    assert error.code == "BACKEND_FAILURE" and error.data is not None
    assert error.data.repeats is True  # the run ends at once: another attempt fails the same
    assert error.message.startswith(f"agent walker-a (env agent walker_0): policy {ENVS}:wild "
                                    "returned 7, outside its action space Discrete(3, start=0)")


async def test_a_session_captures_an_unpicklable_env_by_its_record() -> None:
    doc = {"sessionId": "demo", "steps": "10",
           "agents": [{"agentId": a, "portId": p, "model": "workers.adapters.pettingzoo:"
                       "PolicyModel", "modelConfig": {"policy": f"{ENVS}:walk"}}
                      for p, a in BINDINGS],
           "world": {"worldId": "line", "impl": "workers.adapters.pettingzoo:ParallelEnvWorld",
                     "config": {"env": f"{ENVS}:UnpicklableLineEnv"}},
           "task": {"impl": "workers.adapters.pettingzoo:EnvTask", "config": {},
                    "terminal": "never"}}
    fixture = Fixture(mode=ExecutionMode.IN_PROCESS, composition=RunSpec.validate(doc))
    async with SessionHarness.start(fixture) as h:
        await within(h.coordinator.bootstrap())
        await within(h.coordinator.step())
        await within(h.coordinator.capture("ck-1"))
        await within(h.coordinator.step())
        assert h.coordinator.committed_boundary() == 2


def test_the_world_binds_exactly_one_port_per_env_agent() -> None:
    with pytest.raises(DomainError, match=r"has 2 agents \['walker_0', 'walker_1'\]; the run "
                                          r"binds 1 ports"):
        ParallelEnvWorld(world_id="line", ports=("p1",), step=RationalNs.millis(10),
                         observation_delay_steps=0, threads=1,
                         config={"env": f"{ENVS}:LineEnv"})
    with pytest.raises(DomainError, match="unknown keys"):
        line_world(rendering=True)


def test_the_render_is_the_view_and_a_gymnasium_env_has_one_agent() -> None:
    world = line_world(render=True, kwargs={"size": 8})
    world.reset("ep1", BINDINGS)
    (view,) = world.descriptor().views
    frame = world.render("frame", 0)
    assert (view.width, view.height) == (36, 8) and len(frame) == view.byte_length
    assert len(set(frame[0::4])) > 1  # not a constant picture

    gym = EnvWorld(world_id="track", ports=("p1",), step=RationalNs.millis(10),
                   observation_delay_steps=0, threads=1,
                   config={"env": f"{ENVS}:SlideEnv", "seed": 2})
    gym.reset("ep1", (("p1", "slider"),))
    structured, _arrays = gym.agent_input("p1", 0)
    assert structured.value["spaces"]["agent"] == "agent"
    assert structured.value["spaces"]["action"]["kind"] == "box"
    assert "spaces" not in gym.agent_input("p1", 1)[0].value  # the spaces travel once
    assert [a.id for a in gym.descriptor().ports[0].controls.axes] == ["x0"]


# --------------------------------------------------------------------------------------------
# the task


def test_the_task_rewards_live_agents_and_ends_the_episode_when_the_env_is_done() -> None:
    world, models = line_world(kwargs={"size": 4}, episodes=1), policies()
    world.reset("ep1", BINDINGS)
    task = EnvTask(config={}, terminal="done", max_agents=4, epoch="e1")
    old = world.inspection(0)
    task.bootstrap(old, BINDINGS)
    for k in range(30):
        run(world, models, 1, start=k)
        new = world.inspection(k + 1)
        evaluation = task.evaluate_transition(Scope("demo", "e1", k), old, new, [])
        after, before = new.value, old.value
        for i, agent in enumerate(after["agentIds"]):
            rewards = evaluation.outcomes[agent].rewards
            acted = before["active"][before["agentIds"].index(agent)]
            assert [r.value for r in rewards] == ([after["rewards"][i]] if acted else [])
        old = new
        if evaluation.episode is not None:
            break
    assert evaluation.episode is not None and evaluation.episode.reason == "env-done"
    assert task.progress().value["done"] is True
    with pytest.raises(DomainError, match="not never, done or after:N"):
        EnvTask(config={}, terminal="counter:3", max_agents=4, epoch="e1")


def test_only_the_adapters_import_the_optional_packages() -> None:
    pattern = re.compile(r"^\s*(from|import)\s+(numpy|gymnasium|pettingzoo)\b", re.MULTILINE)
    offenders = [str(path.relative_to(ROOT)) for package in ("bus", "workers", "flyd")
                 for path in (ROOT / package).rglob("*.py")
                 if "adapters" not in path.parts and pattern.search(path.read_text())]
    assert offenders == []


# --------------------------------------------------------------------------------------------
# friction: the spec's defaults follow the env (docs/adapters.md)


def adapter_doc(env: str, **world: Any) -> dict[str, Any]:
    return {"agents": [{"agentId": a, "portId": p, "model": "workers.adapters.pettingzoo:"
                        "PolicyModel", "modelConfig": {"policy": f"{ENVS}:walk"}}
                       for p, a in BINDINGS],
            "world": {"worldId": "line", "impl": "workers.adapters.pettingzoo:ParallelEnvWorld",
                      "config": {"env": f"{ENVS}:{env}"}, **world}}


def test_the_world_step_follows_the_env_unless_the_spec_sets_it() -> None:
    timed = RunSpec.validate(adapter_doc("TimedLineEnv"))  # metadata render_fps 25
    assert timed.world.step == RationalNs.millis(40)
    assert timed.task.impl == "workers.adapters.pettingzoo:EnvTask"  # the default task
    given = RunSpec.validate(adapter_doc("TimedLineEnv", step={"numerator": "5000000",
                                                               "denominator": "1"}))
    assert given.world.step == RationalNs.millis(5)
    untimed = RunSpec.validate(adapter_doc("LineEnv"))
    assert untimed.world.step == RunSpec.validate({}).world.step  # neither dt nor fps
    gym = RunSpec.validate({"agents": [{"agentId": "slider", "portId": "p1"}],
                            "world": {"impl": "workers.adapters.gymnasium:EnvWorld",
                                      "config": {"env": f"{ENVS}:DtSlideEnv"}}})
    assert gym.world.step == RationalNs.millis(20)  # the env's dt
    # the normalised spec carries the step, so a node launches what the submitter saw
    assert RunSpec.validate(timed.to_json()).world.step == RationalNs.millis(40)


def test_a_policy_gets_its_spaces_and_two_or_three_argument_policies_still_work() -> None:
    world = line_world()
    world.reset("ep1", BINDINGS)
    pool = ThreadPoolExecutor(1)
    pressed = {}
    for name in ("last_action", "first_action", "walk"):  # 4, 2 and 3 arguments
        model = PolicyModel(agent_id="walker-a", seed=1, threads=1, executor=pool,
                            config={"policy": f"{ENVS}:{name}"})
        model.install_input(delivered(world, "p1", 0))
        decision = model.decide(typed(CONTEXT, {"step": 0})).value
        pressed[name] = [b["id"] for b in decision["buttons"] if b["down"]]
        # the spaces came once, with the boundary-0 input, as gymnasium spaces
        assert model.gym_spaces() == (spaces.Box(0.0, 16.0, (2,), np.float32), spaces.Discrete(3))
        model.install_input(delivered(world, "p1", 1))  # no spaces: the model kept them
    assert pressed["last_action"] == ["a2"] and pressed["first_action"] == ["a0"]
    assert len(pressed["walk"]) == 1


def test_episodes_reset_within_the_run_seeded_from_the_seed_and_episode() -> None:
    world, models = line_world(kwargs={"size": 4, "maxSteps": 5}, episodes=3), policies()
    world.reset("ep1", BINDINGS)
    starts = [world.observations["p1"].copy()]
    episode = 0
    for k in range(40):
        run(world, models, 1, start=k)
        if world.episode != episode:
            episode = world.episode
            starts.append(world.observations["p1"].copy())
        if world.done():
            break
    assert world.done() and world.ended == 3 and len(starts) == 3
    assert world.inspection(k + 1).value["done"] is True
    for e, start in enumerate(starts):  # each reset is the env's reset with that seed
        fresh = LineEnv(size=4, maxSteps=5)
        observations, _ = fresh.reset(seed=episode_seed(3, e))
        assert np.array_equal(observations["walker_0"], start)
    assert episode_seed(3, 0) == 3 and len({episode_seed(3, e) for e in range(50)}) == 50


def test_the_inspection_of_256_agents_fits_a_typed_value() -> None:
    """The task's inspection holds no observation, only a digest and a few scalars per agent,
    by column: the widest run (256 agents) fits the 32 KiB of a typed value."""
    ports = tuple(f"p{i:03d}" for i in range(256))
    world = ParallelEnvWorld(world_id="crowd", ports=ports, step=RationalNs.millis(10),
                             observation_delay_steps=0, threads=1,
                             config={"env": f"{ENVS}:CrowdEnv", "kwargs": {"agents": 256}})
    bindings = tuple((p, f"walker-{p}") for p in ports)
    world.reset("ep1", bindings)
    intents = {p: ControllerIntent.from_json(to_intent(world.action_spaces[p], 1)).for_port(p)
               for p in ports}
    world.apply([intents[p] for p in ports])
    inspection = world.inspection(1)
    assert len(inspection.value["rewards"]) == 256
    assert len(inspection.canonical_bytes()) <= 32 * 1024
    task = EnvTask(config={}, terminal="never", max_agents=256, epoch="e1")
    task.bootstrap(world.inspection(0), bindings)
    evaluation = task.evaluate_transition(Scope("demo", "e1", 0), world.inspection(0),
                                          inspection, [])
    assert all(len(evaluation.outcomes[a].rewards) == 1 for _, a in bindings)
