"""The run spec (session.md §4.10): normalisation, validation, derived facts, one-shot faults.

Every rule that refuses input has a case asserting `INVALID_ARGUMENT`/`none` and that the error
names the offending field (its JSON Pointer `path`, also in the message).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from flyd.session.runspec import RunSpec, RunSpecError
from workers.faults import Faults
from workers.types.canonical import canonical

DIGEST = "ab" * 32


def agent(agent_id: str = "fly-a", port_id: str = "p1", **fields: Any) -> dict[str, Any]:
    return {"agentId": agent_id, "portId": port_id, **fields}


def two(**fields: Any) -> dict[str, Any]:
    """A spec whose first agent (fly-a) carries `fields`."""
    return {"agents": [agent(**fields), agent("fly-b", "p2")]}


def refuse(doc: Any, path: str, **kwargs: Any) -> RunSpecError:
    with pytest.raises(RunSpecError) as err:
        RunSpec.validate(doc, **kwargs)
    error = err.value
    assert (error.code, error.mutation) == ("INVALID_ARGUMENT", "none")
    assert error.path == path, error.message
    assert f"run spec {path or '/'}: " in error.message
    assert error.outcome() == {"error": "invalid run spec", "path": path,
                               "reason": error.reason}
    return error


# --------------------------------------------------------------------------------------------
# normalisation


def test_agents_per_process_is_kept_when_set_and_refused_out_of_range() -> None:
    """The agent-host key (docs/launcher.md, "Agent hosts"): absent from the normal form unless
    set; 1..256 as a JSON integer."""
    assert RunSpec.validate({"agentsPerProcess": 4}).to_json()["agentsPerProcess"] == 4
    assert RunSpec.validate({"agentsPerProcess": None}).agents_per_process is None
    for bad in (0, 257, "4", 2.0, True):
        refuse({"agentsPerProcess": bad}, "/agentsPerProcess")


def test_the_empty_spec_normalises_to_the_synthetic_defaults() -> None:
    doc = RunSpec.normalise({})
    assert doc == RunSpec().to_json()
    assert set(doc) == {"specVersion", "sessionId", "episodeId", "steps", "seed", "mode",
                        "dispatch", "pacing", "paceS", "exclusiveToSubmitter", "agents",
                        "world", "task", "executor", "checkpoints", "injections",
                        "startFrom"}
    assert (doc["specVersion"], doc["sessionId"], doc["episodeId"], doc["steps"],
            doc["seed"]) == (1, "demo", "ep1", "600", "7")
    assert (doc["mode"], doc["dispatch"], doc["pacing"], doc["paceS"],
            doc["exclusiveToSubmitter"], doc["startFrom"]) == (
        "process", "concurrent", "off", None, False, None)
    assert [(a["agentId"], a["portId"], a["seed"]) for a in doc["agents"]] == [
        ("fly-a", "p1", 7), ("fly-b", "p2", 11)]
    first = doc["agents"][0]
    assert (first["model"], first["modelConfig"], first["tick"], first["warmupTicks"],
            first["threads"]) == ("workers.synthetic:FakeBrain", {},
                                  {"numerator": "1000000", "denominator": "1"}, "10", 1)
    assert first["faults"] == {
        "prepareDelayMs": None, "prepareDelayAtStep": None, "commitDelayMs": None,
        "commitDelayAtStep": None, "failCommitAtStep": None, "acknowledgeExtraId": None,
        "failCapture": False, "failStageRestore": False, "failActivateRestore": False}
    world = doc["world"]
    assert (world["worldId"], world["impl"], world["config"], world["step"],
            world["observationDelaySteps"], world["threads"]) == (
        "arena", "workers.synthetic:CounterArena", {},
        {"numerator": "50000000", "denominator": "3"}, 0, 1)
    assert set(world["faults"]) == {
        "advanceDelayMs", "advanceDelayAtStep", "omitViewAtBoundary", "staleViewAtBoundary",
        "truncatedViewAtBoundary", "omitAudioAtBoundary", "overlappingAudioAtBoundary",
        "acknowledgeExtraId", "failCapture", "failStageRestore", "failActivateRestore"}
    assert doc["task"] == {"impl": "workers.synthetic:CounterTask", "config": {},
                           "terminal": "never"}
    assert doc["executor"] == {"impl": "workers.synthetic:IdentityExecutor", "config": {}}
    assert doc["injections"] == {"kill": [], "loseAdvanceResultAt": []}
    assert len(doc["checkpoints"]) == 15 and set(doc["checkpoints"].values()) == {None}
    canonical(doc)  # storable as canonical JSON


def test_equal_specs_normalise_equal_and_normalising_is_idempotent() -> None:
    a = {"steps": "4", "agents": [agent("fly-b", "p2", threads=2), agent("fly-a", "p1")],
         "injections": {"kill": [{"worker": "fly-b", "step": "3"},
                                 {"worker": "arena", "step": "1"},
                                 {"worker": "fly-a", "step": "1"}],
                        "loseAdvanceResultAt": ["3", "0", "2"]}}
    b = {"specVersion": 1, "steps": "4", "mode": "process",
         "agents": [agent("fly-a", "p1", seed=None), agent("fly-b", "p2", threads=2)],
         "injections": {"loseAdvanceResultAt": ["0", "2", "3"],
                        "kill": [{"step": "1", "worker": "fly-a"},
                                 {"worker": "arena", "step": "1"},
                                 {"worker": "fly-b", "step": "3"}]}}
    na, nb = RunSpec.normalise(a), RunSpec.normalise(b)
    assert canonical(na) == canonical(nb)
    assert [x["agentId"] for x in na["agents"]] == ["fly-a", "fly-b"]
    assert na["injections"] == {
        "kill": [{"worker": "arena", "step": "1"}, {"worker": "fly-a", "step": "1"},
                 {"worker": "fly-b", "step": "3"}],
        "loseAdvanceResultAt": ["0", "2", "3"]}
    assert RunSpec.normalise(na) == na
    assert RunSpec.validate(na) == RunSpec.validate(a)
    before = copy.deepcopy(a)
    RunSpec.normalise(a)
    assert a == before  # the input is never modified


def test_derived_facts_of_a_spec() -> None:
    spec = RunSpec.validate({"seed": "42", "agents": [
        agent("fly-a", "p1", threads=2), agent("fly-b", "p2", seed=-5), agent("fly-c", "p3"),
        agent("fly-d", "p4")], "world": {"threads": 3}})
    assert spec.thread_need(1) == 1 + 3 + 2 + 1 + 1 + 1
    assert [spec.seed_of(a) for a in ("fly-a", "fly-b", "fly-c", "fly-d")] == [
        1329356413, -5, 1569564501, 343394545]
    assert spec.worker_ids() == ["fly-a", "fly-b", "fly-c", "fly-d", "arena"]
    default = RunSpec.validate({})
    assert (default.seed_of("fly-a"), default.seed_of("fly-b")) == (7, 11)
    assert default.thread_need(1) == 4
    derived = RunSpec.validate({"seed": "0", "agents": [agent("fly-a", "p1")]})
    assert derived.seed_of("fly-a") == -1350275275


def test_a_spec_may_hold_up_to_the_hosts_max_agents() -> None:
    five = {"agents": [agent(f"fly-{c}", f"p{i}") for i, c in enumerate("abcde")]}
    refuse(five, "/agents")
    assert len(RunSpec.validate(five, max_agents=8).agents) == 5
    refuse(five, "/agents", max_agents=4)
    assert len(RunSpec.normalise(five)["agents"]) == 5  # a submitter without a node config


def test_a_full_spec_round_trips() -> None:
    doc = {
        "specVersion": 1, "sessionId": "s-1", "episodeId": "ep.2", "steps": "10",
        "seed": "18446744073709551615", "mode": "in-process", "dispatch": "reversed",
        "pacing": "realtime", "paceS": 0.05, "exclusiveToSubmitter": True,
        "agents": [agent("fly-a", "p1", model="mypkg.models:Brain",
                         modelConfig={"graphVariant": 2, "x": [1.5, None]}, seed=-2147483648,
                         tick={"numerator": "500000", "denominator": "1"},
                         warmupTicks="0", threads=256,
                         faults={"prepareDelayMs": 12, "prepareDelayAtStep": "3",
                                 "commitDelayMs": 0, "failCommitAtStep": "9",
                                 "acknowledgeExtraId": "req-9999", "failCapture": True,
                                 "failStageRestore": None})],
        "world": {"worldId": "w.1", "impl": "mypkg.worlds:World", "config": {"k": "v"},
                  "step": {"numerator": "1000000000", "denominator": "7"},
                  "observationDelaySteps": 8, "threads": 2,
                  "faults": {"advanceDelayMs": 5, "omitViewAtBoundary": "1",
                             "staleViewAtBoundary": "10", "truncatedViewAtBoundary": "2",
                             "omitAudioAtBoundary": "3", "overlappingAudioAtBoundary": "4"}},
        "task": {"impl": "mypkg.tasks:Task", "config": {"a": 1}, "terminal": "counter:-3"},
        "checkpoints": {"everySteps": 0, "everySeconds": 1.5, "keepGenerations": 100,
                        "queueCapacity": 16, "maxQueuedBytes": 2**30, "retry": "retry",
                        "retryAttempts": 10, "retryBackoffS": 0.2, "durableTimeoutS": 60,
                        "recoveryMaxAttempts": 1, "recoveryBackoffS": 1.0,
                        "recoveryBackoffMaxS": 30, "maxPendingEffects": 1,
                        "maxPendingEffectBytes": 2**20, "maxEnvelopeBytes": 2**30 - 1},
        "injections": {"kill": [{"worker": "w.1", "step": "9"}],
                       "loseAdvanceResultAt": ["0"]},
        "startFrom": None,
    }
    spec = RunSpec.validate(doc)
    out = spec.to_json()
    assert out["agents"][0]["faults"]["failStageRestore"] is False
    assert out["agents"][0]["faults"]["prepareDelayAtStep"] == "3"
    assert out["world"]["faults"]["omitViewAtBoundary"] == "1"
    assert out["checkpoints"] == doc["checkpoints"]
    assert RunSpec.validate(out) == spec
    assert spec.agents[0].faults == Faults(
        prepare_delay_ms=12, prepare_delay_at_step=3, commit_delay_ms=0,
        fail_commit_at_step=9, acknowledge_extra_id="req-9999", fail_capture=True)


def test_an_import_bounds_its_faults_above_the_imported_boundary() -> None:
    start = {"checkpointId": "ck-1", "envelopeDigest": DIGEST}
    doc = {"steps": "5", "startFrom": start, "injections": {"loseAdvanceResultAt": ["100"]}}
    assert RunSpec.validate(doc).start_from is not None  # boundary unknown: no upper bound
    assert RunSpec.validate(doc, start_boundary=98).injections.lose_advance_result_at == (100,)
    refuse(doc, "/injections/loseAdvanceResultAt/0", start_boundary=90)
    refuse(doc, "/injections/loseAdvanceResultAt/0", start_boundary=101)


def test_the_node_checks_that_import_paths_resolve() -> None:
    RunSpec.validate({}, check_imports=True)
    spec = two(model="no_such_package_xyz.models:Brain")
    RunSpec.validate(spec)  # submitters do not look modules up
    error = refuse(spec, "/agents/0/model", check_imports=True)
    assert "no_such_package_xyz.models" in error.message
    refuse({"world": {"impl": "workers.nothing_here:World"}}, "/world/impl",
           check_imports=True)
    refuse({"task": {"impl": "flyd.no_task:Task"}}, "/task/impl", check_imports=True)


# --------------------------------------------------------------------------------------------
# validation: every refusing rule names its field

LONG_ID = "f" * 49

CASES: list[tuple[str, Any, str]] = [
    ("not an object", [], ""),
    ("unknown top key", {"stepz": "1"}, "/stepz"),
    ("key with a slash", {"a/b": 1}, "/a~1b"),
    ("specVersion 2", {"specVersion": 2}, "/specVersion"),
    ("specVersion string", {"specVersion": "1"}, "/specVersion"),
    ("specVersion bool", {"specVersion": True}, "/specVersion"),
    ("specVersion float", {"specVersion": 1.0}, "/specVersion"),
    ("sessionId upper", {"sessionId": "Demo"}, "/sessionId"),
    ("episodeId empty", {"episodeId": ""}, "/episodeId"),
    ("steps negative integer", {"steps": -600}, "/steps"),
    ("steps zero", {"steps": "0"}, "/steps"),
    ("steps leading zero", {"steps": "01"}, "/steps"),
    ("steps too large", {"steps": "18446744073709551616"}, "/steps"),
    ("seed float", {"seed": 7.0}, "/seed"),
    ("seed negative", {"seed": "-1"}, "/seed"),
    ("mode alias", {"mode": "inprocess"}, "/mode"),
    ("dispatch", {"dispatch": "parallel"}, "/dispatch"),
    ("pacing", {"pacing": "on"}, "/pacing"),
    ("paceS zero", {"paceS": 0}, "/paceS"),
    ("paceS negative", {"paceS": -1.0}, "/paceS"),
    ("paceS string", {"paceS": "1"}, "/paceS"),
    ("paceS bool", {"paceS": True}, "/paceS"),
    ("paceS nan", {"paceS": float("nan")}, "/paceS"),
    ("exclusive string", {"exclusiveToSubmitter": "yes"}, "/exclusiveToSubmitter"),
    ("agents object", {"agents": {}}, "/agents"),
    ("agents empty", {"agents": []}, "/agents"),
    ("agent not object", {"agents": ["fly-a"]}, "/agents/0"),
    ("agent unknown key", two(port="p1"), "/agents/0/port"),
    ("agent missing id", {"agents": [{"portId": "p1"}]}, "/agents/0/agentId"),
    ("agent missing port", {"agents": [{"agentId": "fly-a"}]}, "/agents/0/portId"),
    ("agentId not Id", {"agents": [agent("Fly-A")]}, "/agents/0/agentId"),
    ("agentId too long", {"agents": [agent(LONG_ID)]}, "/agents/0/agentId"),
    ("portId not Id", {"agents": [agent("fly-a", "P1")]}, "/agents/0/portId"),
    ("model not a path", two(model="workers.synthetic.FakeBrain"), "/agents/0/model"),
    ("model empty class", two(model="workers.synthetic:"), "/agents/0/model"),
    ("modelConfig list", two(modelConfig=[]), "/agents/0/modelConfig"),
    ("modelConfig nan", two(modelConfig={"x": float("inf")}), "/agents/0/modelConfig"),
    ("seed too large", two(seed=2**31), "/agents/0/seed"),
    ("seed string", two(seed="7"), "/agents/0/seed"),
    ("seed bool", two(seed=True), "/agents/0/seed"),
    ("tick zero", two(tick={"numerator": "0", "denominator": "1"}), "/agents/0/tick"),
    ("tick unreduced", two(tick={"numerator": "6", "denominator": "4"}), "/agents/0/tick"),
    ("tick shape", two(tick={"numerator": "1"}), "/agents/0/tick"),
    ("tick negative integers", two(tick={"numerator": -1, "denominator": 1}), "/agents/0/tick"),
    ("warmupTicks negative", two(warmupTicks=-10), "/agents/0/warmupTicks"),
    ("threads zero", two(threads=0), "/agents/0/threads"),
    ("threads 257", two(threads=257), "/agents/0/threads"),
    ("threads string", two(threads="1"), "/agents/0/threads"),
    ("duplicate agent", {"agents": [agent("fly-a", "p1"), agent("fly-a", "p2")]},
     "/agents/1/agentId"),
    ("duplicate port", {"agents": [agent("fly-a", "p1"), agent("fly-b", "p1")]},
     "/agents/1/portId"),
    ("world not object", {"world": "arena"}, "/world"),
    ("world unknown key", {"world": {"ports": ["p1"]}}, "/world/ports"),
    ("worldId not Id", {"world": {"worldId": "Arena"}}, "/world/worldId"),
    ("worldId too long", {"world": {"worldId": LONG_ID}}, "/world/worldId"),
    ("worldId is an agent", {"world": {"worldId": "fly-a"}}, "/world/worldId"),
    ("impl not a path", {"world": {"impl": "arena"}}, "/world/impl"),
    ("world config", {"world": {"config": None}}, "/world/config"),
    ("world step zero", {"world": {"step": {"numerator": "0", "denominator": "1"}}},
     "/world/step"),
    ("delay 9", {"world": {"observationDelaySteps": 9}}, "/world/observationDelaySteps"),
    ("delay negative", {"world": {"observationDelaySteps": -1}},
     "/world/observationDelaySteps"),
    ("world threads", {"world": {"threads": 0}}, "/world/threads"),
    ("task unknown key", {"task": {"terminals": "never"}}, "/task/terminals"),
    ("task impl", {"task": {"impl": ":CounterTask"}}, "/task/impl"),
    ("task config", {"task": {"config": "x"}}, "/task/config"),
    ("terminal", {"task": {"terminal": "after:-1"}}, "/task/terminal"),
    ("terminal type", {"task": {"terminal": 3}}, "/task/terminal"),
    ("checkpoints unknown", {"checkpoints": {"every_steps": 1}}, "/checkpoints/every_steps"),
    ("everySteps string", {"checkpoints": {"everySteps": "60"}}, "/checkpoints/everySteps"),
    ("everySteps negative", {"checkpoints": {"everySteps": -1}}, "/checkpoints/everySteps"),
    ("everySeconds negative", {"checkpoints": {"everySeconds": -0.5}},
     "/checkpoints/everySeconds"),
    ("keepGenerations 0", {"checkpoints": {"keepGenerations": 0}},
     "/checkpoints/keepGenerations"),
    ("queueCapacity 17", {"checkpoints": {"queueCapacity": 17}}, "/checkpoints/queueCapacity"),
    ("maxQueuedBytes small", {"checkpoints": {"maxQueuedBytes": 2**20 - 1}},
     "/checkpoints/maxQueuedBytes"),
    ("retry", {"checkpoints": {"retry": "sometimes"}}, "/checkpoints/retry"),
    ("retryAttempts 11", {"checkpoints": {"retryAttempts": 11}}, "/checkpoints/retryAttempts"),
    ("retryBackoffS 0", {"checkpoints": {"retryBackoffS": 0}}, "/checkpoints/retryBackoffS"),
    ("durableTimeoutS bool", {"checkpoints": {"durableTimeoutS": True}},
     "/checkpoints/durableTimeoutS"),
    ("recoveryMaxAttempts 101", {"checkpoints": {"recoveryMaxAttempts": 101}},
     "/checkpoints/recoveryMaxAttempts"),
    ("recoveryBackoffS -1", {"checkpoints": {"recoveryBackoffS": -1}},
     "/checkpoints/recoveryBackoffS"),
    ("recoveryBackoffMaxS 0", {"checkpoints": {"recoveryBackoffMaxS": 0.0}},
     "/checkpoints/recoveryBackoffMaxS"),
    ("maxPendingEffects 0", {"checkpoints": {"maxPendingEffects": 0}},
     "/checkpoints/maxPendingEffects"),
    ("maxPendingEffectBytes small", {"checkpoints": {"maxPendingEffectBytes": 1024}},
     "/checkpoints/maxPendingEffectBytes"),
    ("maxEnvelopeBytes 2^30", {"checkpoints": {"maxEnvelopeBytes": 2**30}},
     "/checkpoints/maxEnvelopeBytes"),
    ("maxEnvelopeBytes float", {"checkpoints": {"maxEnvelopeBytes": 2.0**20}},
     "/checkpoints/maxEnvelopeBytes"),
    ("injections unknown", {"injections": {"killAt": []}}, "/injections/killAt"),
    ("kill not list", {"injections": {"kill": {}}}, "/injections/kill"),
    ("kill entry unknown key", {"injections": {"kill": [{"worker": "fly-a", "step": "1",
                                                          "signal": "KILL"}]}},
     "/injections/kill/0/signal"),
    ("kill missing step", {"injections": {"kill": [{"worker": "fly-a"}]}},
     "/injections/kill/0/step"),
    ("kill unknown worker", {"injections": {"kill": [{"worker": "fly-z", "step": "1"}]}},
     "/injections/kill/0/worker"),
    ("kill step bool", {"injections": {"kill": [{"worker": "fly-a", "step": True}]}},
     "/injections/kill/0/step"),
    ("kill step beyond", {"steps": "3", "injections": {"kill": [{"worker": "fly-a",
                                                                 "step": "3"}]}},
     "/injections/kill/0/step"),
    ("kill twice", {"injections": {"kill": [{"worker": "fly-a", "step": "1"},
                                            {"worker": "fly-a", "step": "1"}]}},
     "/injections/kill/1"),
    ("lose not list", {"injections": {"loseAdvanceResultAt": "1"}},
     "/injections/loseAdvanceResultAt"),
    ("lose negative", {"injections": {"loseAdvanceResultAt": [-1]}},
     "/injections/loseAdvanceResultAt/0"),
    ("lose beyond", {"steps": "2", "injections": {"loseAdvanceResultAt": ["0", "2"]}},
     "/injections/loseAdvanceResultAt/1"),
    ("lose twice", {"injections": {"loseAdvanceResultAt": ["1", "1"]}},
     "/injections/loseAdvanceResultAt/1"),
    ("startFrom list", {"startFrom": []}, "/startFrom"),
    ("startFrom missing digest", {"startFrom": {"checkpointId": "ck-1"}},
     "/startFrom/envelopeDigest"),
    ("startFrom bad id", {"startFrom": {"checkpointId": "CK", "envelopeDigest": DIGEST}},
     "/startFrom/checkpointId"),
    ("startFrom bad digest", {"startFrom": {"checkpointId": "ck-1",
                                            "envelopeDigest": DIGEST.upper()}},
     "/startFrom/envelopeDigest"),
    # faults (§4.9 through the run spec)
    ("faults not object", two(faults=None), "/agents/0/faults"),
    ("world knob on an agent", two(faults={"advanceDelayMs": 1}),
     "/agents/0/faults/advanceDelayMs"),
    ("agent knob on the world", {"world": {"faults": {"prepareDelayMs": 1}}},
     "/world/faults/prepareDelayMs"),
    ("snake_case knob", two(faults={"prepare_delay_ms": 1}),
     "/agents/0/faults/prepare_delay_ms"),
    ("delay negative", two(faults={"prepareDelayMs": -1}), "/agents/0/faults/prepareDelayMs"),
    ("delay float", two(faults={"commitDelayMs": 1.5}), "/agents/0/faults/commitDelayMs"),
    ("delay string", two(faults={"commitDelayMs": "5"}), "/agents/0/faults/commitDelayMs"),
    ("at step without delay", two(faults={"prepareDelayAtStep": "1"}),
     "/agents/0/faults/prepareDelayAtStep"),
    ("at step float", two(faults={"commitDelayMs": 5, "commitDelayAtStep": 1.0}),
     "/agents/0/faults/commitDelayAtStep"),
    ("at step beyond", {"steps": "4", **two(faults={"prepareDelayMs": 5,
                                                    "prepareDelayAtStep": "4"})},
     "/agents/0/faults/prepareDelayAtStep"),
    ("world at step without delay", {"world": {"faults": {"advanceDelayAtStep": "0"}}},
     "/world/faults/advanceDelayAtStep"),
    ("fail commit beyond", {"steps": "600", **two(faults={"failCommitAtStep": "600"})},
     "/agents/0/faults/failCommitAtStep"),
    ("fail commit negative", two(faults={"failCommitAtStep": -1}),
     "/agents/0/faults/failCommitAtStep"),
    ("boundary zero", {"world": {"faults": {"omitViewAtBoundary": "0"}}},
     "/world/faults/omitViewAtBoundary"),
    ("boundary beyond", {"steps": "3", "world": {"faults": {"staleViewAtBoundary": "4"}}},
     "/world/faults/staleViewAtBoundary"),
    ("boundary bool", {"world": {"faults": {"truncatedViewAtBoundary": True}}},
     "/world/faults/truncatedViewAtBoundary"),
    ("audio boundary zero", {"world": {"faults": {"omitAudioAtBoundary": "0"}}},
     "/world/faults/omitAudioAtBoundary"),
    ("overlap boundary", {"world": {"faults": {"overlappingAudioAtBoundary": "x"}}},
     "/world/faults/overlappingAudioAtBoundary"),
    ("extra id req-0", two(faults={"acknowledgeExtraId": "req-0"}),
     "/agents/0/faults/acknowledgeExtraId"),
    ("extra id shape", {"world": {"faults": {"acknowledgeExtraId": "9999"}}},
     "/world/faults/acknowledgeExtraId"),
    ("fail flag string", two(faults={"failCapture": "true"}), "/agents/0/faults/failCapture"),
    ("world fail flag int", {"world": {"faults": {"failActivateRestore": 1}}},
     "/world/faults/failActivateRestore"),
]


@pytest.mark.parametrize(("doc", "path"), [(doc, path) for _, doc, path in CASES],
                         ids=[name for name, _, _ in CASES])
def test_an_invalid_run_spec_is_refused_naming_its_field(doc: Any, path: str) -> None:
    error = refuse(doc, path)
    field = path.rsplit("/", 1)[-1]
    if field and not field.isdigit():
        assert field.replace("~1", "/") in error.message


def test_an_invalid_host_limit_is_refused() -> None:
    for bad in (0, 257, True):
        with pytest.raises(RunSpecError) as err:
            RunSpec.validate({}, max_agents=bad)
        assert err.value.code == "INVALID_ARGUMENT" and "max_agents" in err.value.message


# --------------------------------------------------------------------------------------------
# one-shot faults (§4.9)


def test_step_addressed_faults_fire_once_and_standing_faults_stay() -> None:
    spec = RunSpec.validate({
        "steps": "10",
        "agents": [agent("fly-a", "p1", faults={"prepareDelayMs": 15, "prepareDelayAtStep": "2",
                                               "commitDelayMs": 9,
                                               "acknowledgeExtraId": "req-5"}),
                   agent("fly-b", "p2", faults={"failCommitAtStep": "2", "failCapture": True})],
        "world": {"faults": {"omitViewAtBoundary": "3", "advanceDelayMs": 1}},
        "injections": {"kill": [{"worker": "fly-b", "step": "2"}],
                       "loseAdvanceResultAt": ["2", "5"]}})
    assert sorted(spec.one_shot_faults()) == sorted([
        ("fly-a.prepare_delay_ms", 2), ("fly-b.fail_commit_at_step", 2),
        ("arena.omit_view_at_boundary", 2), ("kill:fly-b@2", 2),
        ("lose-advance-result@2", 2), ("lose-advance-result@5", 5)])
    fired = spec.faults_at(2)
    assert sorted(fired) == ["arena.omit_view_at_boundary", "fly-a.prepare_delay_ms",
                             "fly-b.fail_commit_at_step", "kill:fly-b@2",
                             "lose-advance-result@2"]
    assert spec.faults_at(4) == []
    later = spec.without_fired(fired)
    assert later.one_shot_faults() == [("lose-advance-result@5", 5)]
    assert later.faults_of("fly-a") == Faults(commit_delay_ms=9, acknowledge_extra_id="req-5")
    assert later.faults_of("fly-b") == Faults(fail_capture=True)
    assert later.faults_of("arena") == Faults(advance_delay_ms=1)
    assert later.injections.kill == ()
    assert later.without_fired(["nothing"]) == later
    RunSpec.validate(later.to_json())


def test_integers_are_accepted_wherever_the_spec_takes_a_u64_string() -> None:
    """What a person writes (`"steps": 50`) is the U64 it names; the normalised spec writes
    the canonical strings back, so it is the spec of the string form exactly."""
    written = {"steps": 50, "seed": 7,
               "agents": [agent(tick={"numerator": 1000000, "denominator": 1}, warmupTicks=3,
                                faults={"failCommitAtStep": 4}), agent("fly-b", "p2")],
               "world": {"step": {"numerator": 20000000, "denominator": 1},
                         "faults": {"truncatedViewAtBoundary": 2}},
               "injections": {"kill": [{"worker": "fly-a", "step": 9}],
                              "loseAdvanceResultAt": [3]}}
    strings = json.loads(json.dumps(written), parse_int=str)
    assert strings["steps"] == "50"
    normal = RunSpec.normalise(written)
    assert normal == RunSpec.normalise(strings)
    assert normal["steps"] == "50" and normal["seed"] == "7"
    assert normal["injections"]["kill"] == [{"worker": "fly-a", "step": "9"}]
