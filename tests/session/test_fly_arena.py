"""The fly-arena example's pieces (examples/fly_arena, docs/examples.md) in the test process:
the world's physics and views, the brain's network, the task's rewards and events, and the
exact round trip of every capture. The composition end to end is tests/cli/test_fly_arena.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from examples.fly_arena import FlyArena, FlyBrain, MotorExecutor, OdourTask
from examples.fly_arena.schemas import CONTEXT, DECISION, typed
from workers.protocols import DecodedView
from workers.types.datatypes import AxisValue, PortControl
from workers.types.domain import DomainError, Scope
from workers.types.ticks import RationalNs

PORTS = ("p1", "p2", "p3")
AGENTS = ("fly-1", "fly-2", "fly-3")


def arena(**config: float) -> FlyArena:
    world = FlyArena(world_id="arena", ports=PORTS, step=RationalNs(50_000_000, 3),
                     observation_delay_steps=0, threads=1, config=config)
    world.reset("ep1", list(zip(PORTS, AGENTS, strict=True)))
    return world


def controls(turn: float, speed: float) -> list[PortControl]:
    return [PortControl(p, (), (AxisValue("turn", turn), AxisValue("speed", speed)))
            for p in PORTS]


def brain(agent: str = "fly-1", seed: int = 11) -> FlyBrain:
    return FlyBrain(agent_id=agent, seed=seed, threads=1, executor=None,  # type: ignore[arg-type]
                    config={})


def step_all(world: FlyArena, brains: list[FlyBrain], boundary: int) -> list[PortControl]:
    """One closed-loop step: views → encode → decide → execute → apply."""
    views = [DecodedView(v.view_id, boundary, world.render(v.view_id, boundary))
             for v in world.descriptor().views]
    encoded = FlyBrain.encode(views, world.inspection(boundary))
    executor = MotorExecutor(config={})
    scope = Scope("fly-arena", "e1", boundary)
    out = []
    for port, fly in zip(PORTS, brains, strict=True):
        fly.install_input(encoded)
        decision = fly.decide(typed(CONTEXT, {"step": boundary}))
        intent = executor.apply(scope, decision, world.inspection(boundary),
                                typed(CONTEXT, {"step": boundary}), RationalNs(0, 1))
        out.append(intent.for_port(port))
    world.apply(out)
    return out


def test_the_views_have_their_declared_sizes_and_are_not_constant() -> None:
    world = arena(viewSize=48, eyePixels=9)
    views = {v.view_id: v for v in world.descriptor().views}
    assert set(views) == {"arena", "eyes"}
    assert (views["arena"].width, views["arena"].height) == (48, 48)
    assert (views["eyes"].width, views["eyes"].height) == (9, len(PORTS))
    for view_id, spec in views.items():
        frame = world.render(view_id, 0)
        assert len(frame) == spec.byte_length
        pixels = np.frombuffer(frame, dtype=np.uint8).reshape(spec.height, spec.width, 4)
        assert (pixels[..., 3] == 255).all()
        assert len(np.unique(pixels[..., :3].reshape(-1, 3), axis=0)) > 3, view_id


def test_the_top_down_view_shows_the_source_and_every_fly() -> None:
    world = arena()
    pixels = np.frombuffer(world.render("arena", 0), dtype=np.uint8).reshape(64, 64, 4)
    rgb = pixels[..., :3].reshape(-1, 3).tolist()
    assert [255, 220, 40] in rgb  # the source
    assert rgb.count([230, 50, 50]) >= len(PORTS)  # the flies' bodies
    world.position[0] = (-9.9, 9.9)  # top-left corner, facing right: its head 2.5 px ahead
    world.heading[0] = (1.0, 0.0)
    pixels = np.frombuffer(world.render("arena", 0), dtype=np.uint8).reshape(64, 64, 4)
    assert pixels[0, 0, :3].tolist() == pixels[1, 1, :3].tolist() == [230, 50, 50]
    assert pixels[0, 2, :3].tolist() == [255, 255, 255]


def test_a_fly_walks_along_its_heading_turns_and_bounces_off_a_wall() -> None:
    world = arena(maxSpeed=0.5, turnRate=0.4)
    world.position[:] = (0.0, -5.0)
    world.heading[:] = (1.0, 0.0)
    world.apply(controls(0.0, 1.0))
    assert world.position[0].tolist() == [0.5, -5.0]
    world.apply(controls(1.0, 0.0))  # a full left turn on the spot: 2·atan(0.4)
    angle = math.atan2(world.heading[0, 1], world.heading[0, 0])
    assert angle == pytest.approx(2 * math.atan(0.4), abs=1e-12)
    assert math.hypot(*world.heading[0]) == pytest.approx(1.0, abs=1e-15)
    world.position[:] = (9.8, 3.0)
    world.heading[:] = (1.0, 0.0)
    world.apply(controls(0.0, 1.0))
    assert world.position[0].tolist() == pytest.approx([9.7, 3.0])  # 10 − (10.3 − 10)
    assert world.heading[0].tolist() == [-1.0, 0.0]


def test_a_fly_that_reaches_the_source_counts_a_visit_and_is_released_elsewhere() -> None:
    world = arena()
    sx, sy = world.source.tolist()
    world.position[0] = (sx - 1.2, sy)
    world.heading[0] = (1.0, 0.0)
    world.apply(controls(0.0, 1.0))
    assert world.reached[0] == 1 and world.reached[1:] == [0, 0]
    assert math.dist(world.position[0].tolist(), (sx, sy)) > world.radius


def test_each_fly_sees_its_own_row_and_turns_toward_the_stronger_side() -> None:
    world = arena()
    sx, sy = world.source.tolist()
    world.position[:] = (sx, sy - 6.0)  # every fly below the source
    world.heading[0] = (1.0, 0.0)  # the source on its left
    world.heading[1] = (-1.0, 0.0)  # the source on its right
    world.heading[2] = (0.0, 1.0)  # the source ahead
    views = [DecodedView(v, 0, world.render(v, 0)) for v in ("arena", "eyes")]
    encoded = FlyBrain.encode(views, world.inspection(0))
    senses = encoded["senses"]
    assert senses[0][0] > senses[0][2] and senses[1][2] > senses[1][0]
    assert senses[2][1] > senses[2][0] and senses[2][1] > senses[2][2]
    turns = []
    for agent in AGENTS:
        fly = FlyBrain(agent_id=agent, seed=3, threads=1, executor=None,  # type: ignore[arg-type]
                       config={"noise": 0})
        fly.install_input(encoded)
        turns.append(fly.decide(typed(CONTEXT, {"step": 0})).value["turn"])
    assert turns[0] > 0.5 and turns[1] < -0.5 and abs(turns[2]) < 0.1


def test_the_flies_find_the_source() -> None:
    world = arena()
    brains = [brain(a, 20 + i) for i, a in enumerate(AGENTS)]
    for k in range(150):
        step_all(world, brains, k)
    assert sum(world.reached) >= 3


def test_the_brain_is_seeded_and_decides_purely() -> None:
    a, b, again = brain(seed=1), brain(seed=2), brain(seed=1)
    assert all(np.array_equal(a.params[k], again.params[k]) for k in a.params)
    assert not np.array_equal(a.params["w1"], b.params["w1"])
    a.install_input({"agents": ["fly-1"], "senses": [[0.2, 0.5, 0.4]]})
    before = (a.capture(), a.mutations())
    first = a.decide(typed(CONTEXT, {"step": 3}))
    assert first.schema == DECISION and set(first.value) == {"turn", "speed"}
    assert a.decide(typed(CONTEXT, {"step": 3})) == first
    assert (a.capture(), a.mutations()) == before
    with pytest.raises(DomainError):
        a.decide(typed(DECISION, {"step": 3}))


def test_every_capture_restores_exactly_and_the_run_continues_identically() -> None:
    world = arena()
    brains = [brain(a, 30 + i) for i, a in enumerate(AGENTS)]
    for fly in brains:
        fly.set_learning(True)
        fly.reinforce(0.37)
    for k in range(40):
        step_all(world, brains, k)
    twin = arena()
    twin.restore(world.capture())
    twins = [brain(a, 30 + i) for i, a in enumerate(AGENTS)]
    for fly, copy in zip(brains, twins, strict=True):
        copy.restore(fly.capture())
        copy.set_learning(True)
        assert copy.capture() == fly.capture()
    assert twin.capture() == world.capture()
    for k in range(40, 80):
        assert step_all(world, brains, k) == step_all(twin, twins, k)
        assert twin.render("eyes", k) == world.render("eyes", k)
    assert twin.capture() == world.capture() and twin.render("arena", 80) == \
        world.render("arena", 80)
    with pytest.raises(DomainError) as info:
        twin.restore(b'{"format":"fly-arena-v0"}')
    assert info.value.code == "INCOMPATIBLE_STATE"


def test_the_task_rewards_approach_and_mints_an_event_for_a_visit() -> None:
    world = arena()
    task = OdourTask(config={"sourceBonus": 2}, terminal="visits:1", max_agents=4, epoch="e1")
    task.bootstrap(world.inspection(0), list(zip(PORTS, AGENTS, strict=True)))
    sx, sy = world.source.tolist()
    world.position[0] = (sx - 1.2, sy)
    world.heading[0] = (1.0, 0.0)
    world.position[1] = (sx - 5.0, sy)
    world.heading[1] = (1.0, 0.0)
    world.position[2] = (sx - 5.0, sy)
    world.heading[2] = (-1.0, 0.0)
    old = world.inspection(0)
    world.apply(controls(0.0, 1.0))
    result = task.evaluate_transition(Scope("fly-arena", "e1", 0), old, world.inspection(1), [])
    rewards = {a: [(r.rule_id, r.value) for r in o.rewards] for a, o in result.outcomes.items()}
    assert rewards["fly-1"] == [("approach", pytest.approx(0.2)), ("source", 2.0)]
    assert rewards["fly-2"] == [("approach", pytest.approx(0.5))]
    assert rewards["fly-3"] == [("approach", pytest.approx(-0.5))]
    assert [s.kind_id for s in result.outcomes["fly-1"].stimulations] == ["fly.source"]
    kinds = [e.kind_id for e in result.events]
    assert kinds.count("fly.approach") == 3 and kinds.count("fly.source-reached") == 1
    assert {e.id for e in result.events} <= set(task.minted_ids("e1", 1))
    assert result.episode is not None and result.episode.reason == "visits"
    assert task.progress().value["counter"] == 1
