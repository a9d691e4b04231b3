"""The plugin contract (session.md §4.1, docs/plugins.md): the run spec's `executor` key, the
required attributes checked at start, structured input, and the examples package's reaching
composition through the session harness (bootstrap, steps, capture and restore of its state).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, ClassVar

import pytest

from examples.reaching import GoalSeeker, PointWorld, ReachingTask, SteeringExecutor
from examples.reaching.schemas import CONTEXT, DECISION, INSPECTION, typed
from flyd.launch.launcher import ExecutionMode
from flyd.session.runspec import RunSpec, RunSpecError
from tests.session.harness import Fixture, SessionHarness, within
from tests.session.worker_rig import agent_launch
from workers.agent import AgentEndpoint
from workers.protocols import (
    EXECUTOR_ATTRIBUTES,
    MODEL_ATTRIBUTES,
    STRUCTURED_OBSERVATION,
    TASK_ATTRIBUTES,
    WORLD_ATTRIBUTES,
    ActionExecutor,
    AgentModel,
    PluginContractError,
    Task,
    World,
    check_plugin,
)
from workers.synthetic import CounterTask, FakeBrain, IdentityExecutor
from workers.synthetic.schemas import DECISION as ARENA_DECISION
from workers.types.datatypes import TypedValue
from workers.types.domain import DomainError, Scope
from workers.types.ticks import RationalNs

ROOT = Path(__file__).resolve().parents[2]
RUN_JSON = ROOT / "examples" / "reaching" / "run.json"


def reaching_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(RUN_JSON.read_text())
    return doc


def refused(doc: dict[str, Any], path: str, **kwargs: Any) -> RunSpecError:
    with pytest.raises(RunSpecError) as info:
        RunSpec.validate(doc, **kwargs)
    assert info.value.path == path, info.value.message
    return info.value


# --------------------------------------------------------------------------------------------
# the executor key


def test_a_spec_without_an_executor_normalises_to_the_identity_executor() -> None:
    doc = RunSpec.normalise({})
    assert doc["executor"] == {"impl": "workers.synthetic:IdentityExecutor", "config": {}}
    assert RunSpec.normalise(doc) == doc
    assert RunSpec.validate({}).executor == RunSpec().executor


def test_the_executor_key_names_an_import_path_and_a_config() -> None:
    spec = RunSpec.validate(reaching_doc())
    assert (spec.executor.impl, dict(spec.executor.config)) == (
        "examples.reaching:SteeringExecutor", {"maxThrottle": 1})
    assert RunSpec.validate(spec.to_json()) == spec
    refused({"executor": {"impl": "not a path"}}, "/executor/impl")
    refused({"executor": {"impl": "a.b:C", "config": []}}, "/executor/config")
    refused({"executor": {"impls": "a.b:C"}}, "/executor/impls")
    refused({"executor": {"impl": "no_such_package.executors:Executor"}}, "/executor/impl",
            check_imports=True)


def test_terminal_is_the_tasks_own_grammar() -> None:
    assert RunSpec.validate({"task": {"impl": "examples.reaching:ReachingTask",
                                      "terminal": "goals:4"}}).task.terminal == "goals:4"
    refused({"task": {"terminal": "goals:4"}}, "/task/terminal")  # the counter task's grammar
    refused({"task": {"impl": "examples.reaching:ReachingTask", "terminal": "a b"}},
            "/task/terminal")
    with pytest.raises(DomainError, match="terminal 'nope:1' is not never, after:N or goals:N"):
        ReachingTask(config={}, terminal="nope:1", max_agents=4, epoch="e1")


def test_the_decision_schema_is_the_executors() -> None:
    assert IdentityExecutor.decision_schema == ARENA_DECISION
    assert SteeringExecutor.decision_schema == DECISION != ARENA_DECISION
    intent = SteeringExecutor(config={}).apply(
        Scope("s", "e1", 0), typed(DECISION, {"direction": [3, -4], "throttle": 0.5}),
        typed(INSPECTION, {}), typed(INSPECTION, {}), RationalNs(1, 1))
    assert [(a.id, a.value) for a in intent.axes] == [("dx", 0.3), ("dy", -0.4)]
    with pytest.raises(DomainError) as info:
        SteeringExecutor(config={}).apply(Scope("s", "e1", 0), typed(ARENA_DECISION, {}),
                                          typed(INSPECTION, {}), typed(INSPECTION, {}),
                                          RationalNs(1, 1))
    assert info.value.code == "IDENTITY_MISMATCH"
    with pytest.raises(DomainError, match="takes no config keys"):
        IdentityExecutor(config={"x": 1})


# --------------------------------------------------------------------------------------------
# required attributes


class NoDecide:
    capabilities: ClassVar[tuple[str, ...]] = ()
    model_version: ClassVar[str] = "x-v1"
    plasticity_version: ClassVar[str] = "x-v1"


def without(cls: type[Any], name: str) -> type[Any]:
    """A copy of `cls` whose MRO does not provide `name`."""
    namespace = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
    for base in cls.__mro__[1:-1]:
        for key, value in vars(base).items():
            namespace.setdefault(key, value)
    namespace.pop(name, None)
    return type(cls.__name__, (), namespace)


@pytest.mark.parametrize("kind, cls, required", [
    ("model", GoalSeeker, MODEL_ATTRIBUTES), ("model", FakeBrain, MODEL_ATTRIBUTES),
    ("world", PointWorld, WORLD_ATTRIBUTES), ("task", ReachingTask, TASK_ATTRIBUTES),
    ("task", CounterTask, TASK_ATTRIBUTES), ("executor", SteeringExecutor, EXECUTOR_ATTRIBUTES),
    ("executor", IdentityExecutor, EXECUTOR_ATTRIBUTES)])
def test_every_shipped_plugin_has_every_required_attribute(kind: str, cls: type[Any],
                                                           required: dict[str, str]) -> None:
    check_plugin(cls, kind, f"x:{cls.__name__}", required)
    for name in required:
        with pytest.raises(PluginContractError) as info:
            check_plugin(without(cls, name), kind, f"pkg.mod:{cls.__name__}", required)
        error = info.value
        assert (error.code, error.mutation, error.attribute) == ("INVALID_ARGUMENT", "none", name)
        assert error.message.startswith(f"{kind} pkg.mod:{cls.__name__}: the class lacks "
                                        f"{name} (")


def test_a_model_without_versions_is_refused_when_its_worker_starts() -> None:
    launch = agent_launch("/nonexistent.sock", model="tests.session.test_plugins:Versionless")
    with pytest.raises(PluginContractError) as info:
        AgentEndpoint(launch)
    assert info.value.message == (
        "model tests.session.test_plugins:Versionless: the class lacks model_version (a str "
        "class attribute naming the model's state format (checkpoints record it as the model's "
        "identity))")
    launch = agent_launch("/nonexistent.sock", model="tests.session.test_plugins:NoDecide")
    with pytest.raises(PluginContractError, match="NoDecide: the class lacks profile"):
        AgentEndpoint(launch)


def test_versions_explicitly_none_opt_out_of_checkpointing() -> None:
    check_plugin(OptedOut, "model", "x:OptedOut", MODEL_ATTRIBUTES)
    with pytest.raises(PluginContractError, match="lacks plasticity_version"):
        check_plugin(HalfVersioned, "model", "x:HalfVersioned", MODEL_ATTRIBUTES)


Versionless = without(FakeBrain, "model_version")


class OptedOut(FakeBrain):
    model_version: ClassVar[str | None] = None  # type: ignore[misc]
    plasticity_version: ClassVar[str | None] = None  # type: ignore[misc]


class HalfVersioned(FakeBrain):
    plasticity_version: ClassVar[int] = 3  # type: ignore[assignment]


def test_the_examples_implement_the_protocols() -> None:
    assert isinstance(GoalSeeker(agent_id="a", seed=1, threads=1, executor=None,  # type: ignore[arg-type]
                                 config={}), AgentModel)
    world = PointWorld(world_id="w", ports=["p1"], step=RationalNs(1, 1),
                       observation_delay_steps=0, threads=1, config={})
    assert isinstance(world, World) and STRUCTURED_OBSERVATION in PointWorld.capabilities
    assert isinstance(ReachingTask(config={}, terminal="never", max_agents=2, epoch="e1"), Task)
    assert isinstance(SteeringExecutor(config={}), ActionExecutor)


# --------------------------------------------------------------------------------------------
# structured input and the reaching composition in a session


def composition() -> RunSpec:
    """The example's run spec in the harness's session (`demo`)."""
    return RunSpec.validate({**reaching_doc(), "sessionId": "demo"})


def heading(decision: TypedValue) -> tuple[float, float]:
    x, y = decision.value["direction"]
    return x, y


@pytest.mark.parametrize("mode", [ExecutionMode.IN_PROCESS, ExecutionMode.THREAD])
async def test_the_world_inspection_reaches_the_agents_as_structured_input(
        mode: ExecutionMode) -> None:
    async with SessionHarness.start(Fixture(mode=mode, composition=composition())) as h:
        c = h.coordinator
        await within(c.bootstrap())
        assert c.structured_input is True
        for _ in range(3):
            await within(c.step())
        points = {p["agentId"]: p for p in c.observation.inspection.value["points"]}
        await within(c.step())
        for agent_id, slot in c.slots.items():
            # the model steers toward the goal only the structured input told it
            assert slot.last_decision is not None
            x, y = heading(slot.last_decision)
            (px, py), (gx, gy) = points[agent_id]["position"], points[agent_id]["goal"]
            length = math.hypot(gx - px, gy - py)
            jitter = slot.spec.model_config.get("jitter", 0.05)
            assert abs(x - (gx - px) / length) <= jitter + 1e-9
            assert abs(y - (gy - py) / length) <= jitter + 1e-9


async def test_a_world_without_the_capability_gives_no_structured_input() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await within(h.coordinator.bootstrap())
        assert h.coordinator.structured_input is False
        reports = await within(h.coordinator.run(3))
        assert [r.boundary for r in reports] == [1, 2, 3]


async def test_the_goal_seeker_refuses_to_start_without_structured_input() -> None:
    with pytest.raises(DomainError, match="needs structured input"):
        GoalSeeker.encode([], None)
    assert GoalSeeker.encode([], typed(INSPECTION, {"boundary": 0, "points": []})) == []


def test_the_reaching_task_rewards_distance_reduction_and_goals() -> None:
    task = ReachingTask(config={"goalBonus": 2}, terminal="goals:1", max_agents=2, epoch="e1")
    old = typed(INSPECTION, {"boundary": 0, "points": [
        {"portId": "p1", "agentId": "a", "position": [0, 0], "goal": [3, 4], "reached": 0}]})
    boot = task.bootstrap(old, [("p1", "a")])
    assert boot.contexts == {"a": typed(CONTEXT, {"step": 0})}
    new = typed(INSPECTION, {"boundary": 1, "points": [
        {"portId": "p1", "agentId": "a", "position": [3, 4], "goal": [9, 9], "reached": 1}]})
    evaluation = task.evaluate_transition(Scope("s", "e1", 0), old, new, [])
    rewards = evaluation.outcomes["a"].rewards
    assert [(r.rule_id, r.value) for r in rewards] == [("approach", 5.0), ("goal", 2.0)]
    assert [s.kind_id for s in evaluation.outcomes["a"].stimulations] == ["reaching.goal"]
    assert [e.kind_id for e in evaluation.events] == ["reaching.approach",
                                                      "reaching.goal-reached"]
    assert {e.id for e in evaluation.events} <= set(task.minted_ids("e1", 1))
    assert evaluation.episode is not None and evaluation.episode.reason == "goals-reached"
    assert task.progress().value["counter"] == 1
    again = ReachingTask(config={"goalBonus": 2}, terminal="never", max_agents=2, epoch="e1")
    again.restore(task.capture())
    assert again.capture() == task.capture() and again.progress() == task.progress()


def test_world_and_model_state_round_trip_through_capture() -> None:
    world = PointWorld(world_id="w", ports=["p1", "p2"], step=RationalNs(1, 1),
                       observation_delay_steps=0, threads=1, config={"layoutSeed": 3})
    world.reset("ep1", [("p1", "a"), ("p2", "b")])
    intent = SteeringExecutor(config={}).apply(
        Scope("s", "e1", 0), typed(DECISION, {"direction": [1, 1], "throttle": 1}),
        world.inspection(0), typed(INSPECTION, {}), RationalNs(1, 1))
    world.apply([intent.for_port("p1"), intent.for_port("p2")])
    copy_of = PointWorld(world_id="w", ports=["p1", "p2"], step=RationalNs(1, 1),
                         observation_delay_steps=0, threads=1, config={"layoutSeed": 3})
    copy_of.restore(world.capture())
    assert copy_of.inspection(1) == world.inspection(1)
    with pytest.raises(DomainError) as info:
        copy_of.restore(b'{"format":"other"}')
    assert info.value.code == "INCOMPATIBLE_STATE"
    model = GoalSeeker(agent_id="a", seed=7, threads=1, executor=None,  # type: ignore[arg-type]
                       config={})
    model.install_input(GoalSeeker.encode([], world.inspection(1)))
    model.advance(17)
    model.set_learning(True)
    model.reinforce(0.5)
    twin = GoalSeeker(agent_id="a", seed=1, threads=1, executor=None,  # type: ignore[arg-type]
                      config={})
    twin.restore(model.capture())
    context = typed(CONTEXT, {"step": 1})
    assert twin.decide(context) == model.decide(context)
    assert twin.capture() == model.capture()
    assert copy.deepcopy(model.decide(context)) == model.decide(context)  # decide is a pure read
