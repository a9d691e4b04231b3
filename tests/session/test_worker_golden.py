"""The golden run (session.md §4.8) driven through real workers over a real router, the test
acting as the coordinator (`worker_rig.Driver`): the worker shell, the agent and environment
endpoints and the synthetic models together reproduce every reference number."""

from __future__ import annotations

import base64
import hashlib

from tests.session.worker_rig import Driver, Rig, agent_launch, environment_launch, rig

__all__ = ["rig"]

DECISIONS = {  # k -> agent -> (inc, dec, bias)
    0: {"fly-a": (False, False, -0.25), "fly-b": (True, False, 0.0)},
    1: {"fly-a": (True, False, -0.5), "fly-b": (True, False, 0.25)},
    2: {"fly-a": (False, True, 0.5), "fly-b": (True, False, -0.25)},
}
COUNTERS = {0: 1, 1: 3, 2: 3}
TICKS = {0: ("16", {"numerator": "2000000", "denominator": "3"}),
         1: ("17", {"numerator": "1000000", "denominator": "3"}),
         2: ("17", {"numerator": "0", "denominator": "1"})}
AUDIO = ["28b7a3fab25556429c78716089033bbaaf1baba3d88701ad44a461fc7ac5e536",
         "1d194c015a4ad833c2cfc26b771b1d6dfd0a3dd3f33c08a2a776c8fdc565aef8",
         "2fd1f6120441542d5697ace118f3eaa83d43055a3a31df558a989105fdf3667d"]


def decision_of(prepared: dict[str, object]) -> tuple[bool, bool, float]:
    value = prepared["decision"]["value"]  # type: ignore[index]
    buttons = {b["id"]: b["down"] for b in value["buttons"]}
    return buttons["inc"], buttons["dec"], value["axes"][0]["value"]


async def test_a_shell_driven_golden_run_matches_the_reference_numbers(rig: Rig) -> None:
    await rig.start(environment_launch(rig.socket))
    await rig.start(agent_launch(rig.socket, "fly-a", "p1"))
    await rig.start(agent_launch(rig.socket, "fly-b", "p2"))
    driver = Driver(rig)
    env = await driver.bootstrap()
    o0 = env["observation"]
    assert o0["boundary"] == "0" and o0["worldTime"] == {"numerator": "0", "denominator": "1"}
    assert o0["audio"] == [] and o0["engineFrame"] == "0"
    assert o0["sensoryViews"][0]["pixels"]["digest"] == (
        "4fb13d9f44c918a13f61ee818bd6b46fe2170a2c712d871d88eab2e883f40bcd")
    for agent in ("fly-a", "fly-b"):
        status = await rig.status(agent)
        assert status["progressCounter"] == "11" and status["state"] == "ready"
    assert (await rig.status("arena"))["progressCounter"] == "1"

    positions = []
    for k in range(3):
        t = await driver.step()
        for agent in ("fly-a", "fly-b"):
            assert decision_of(t.prepared[agent]) == DECISIONS[k][agent], (k, agent)
            assert (t.prepared[agent]["ticksAdvanced"], t.prepared[agent]["remainder"]) \
                == TICKS[k]
            assert t.committed[agent]["committedStep"] == str(k + 1)
        obs = t.advanced["observation"]
        assert obs["inspection"]["value"] == {"counter": COUNTERS[k], "boundary": k + 1}
        assert t.advanced["appliedFromStep"] == str(k) and t.advanced["nextStep"] == str(k + 1)
        (chunk,) = obs["audio"]
        positions.append(int(chunk["firstSample"]))
        assert chunk["sampleFrames"] == 800 and chunk["discontinuity"] is False
        assert hashlib.sha256(base64.b64decode(chunk["samples"]["data"])).hexdigest() == AUDIO[k]
    assert positions == [0, 800, 1600]

    for agent, changed, signal in (("fly-a", "2", -1.0), ("fly-b", "3", 1.0)):
        status = await rig.status(agent)
        assert status["progressCounter"] == "67"
        assert status["currentScope"]["step"] == "3"
        telemetry = driver.transitions[-1].committed[agent]["telemetry"]
        assert telemetry["brainTicks"] == "60"
        assert telemetry["learning"] == {"enabled": True, "updates": "3", "changed": changed,
                                         "signal": signal}
    assert driver.task.progress().value == {"counter": 3, "transitions": 3, "totalReward": 3.0}
    env_status = await rig.status("arena")
    assert env_status["progressCounter"] == "4"
    assert env_status["lastBatchId"] == "batch-e1-2"
    assert env_status["currentScope"]["step"] == "3"


async def test_the_runtime_and_reference_validators_agree_on_real_traffic(rig: Rig) -> None:
    """The worker checks params with `bus.schema.compile_schema` over the same files the
    reference validator (jsonschema, Draft 2020-12) reads; both accept every real request and
    result of a golden run, and both refuse the same broken copies."""
    import copy

    from tests.session.worker_rig import method_schema
    from workers.types.contract import method_validator

    await rig.start(environment_launch(rig.socket))
    await rig.start(agent_launch(rig.socket, "fly-a", "p1"))
    await rig.start(agent_launch(rig.socket, "fly-b", "p2"))
    driver = Driver(rig)
    await driver.bootstrap()
    for _ in range(2):
        await driver.step()
    methods = set()
    for method, payload, outcome in rig.traffic:
        if outcome["type"] != "result":
            continue
        methods.add(method)
        for kind, value in (("params", payload["params"]), ("result", outcome["result"])):
            assert method_validator(method, kind)(value) is None, (method, kind)
            assert method_schema(method, kind).is_valid(value)
            broken = copy.deepcopy(value)
            broken["unexpected"] = True
            assert method_validator(method, kind)(broken) is not None
            assert not method_schema(method, kind).is_valid(broken)
            if value:
                key = sorted(value)[0]
                del broken[key]
                assert method_validator(method, kind)(broken) is not None
                assert not method_schema(method, kind).is_valid(broken)
    assert methods == {"Environment.Initialize", "Agent.Initialize", "Worker.Acknowledge",
                       "Agent.Prepare", "Environment.Advance", "Agent.Commit"}
