"""Fault knobs and the `--fault SPEC` grammar (session.md §4.9, cli.md §3).

Every grammar form parses into the right knob or injection; every malformed form is refused
`INVALID_ARGUMENT`/`none` naming the spec; merging into a run spec obeys the run spec's rules.
"""

from __future__ import annotations

import pytest

from flyd.session.runspec import (
    FaultSpecError,
    KillFault,
    KnobFault,
    LoseAdvanceResultFault,
    RunSpec,
    parse_fault,
    parse_faults,
)
from workers.faults import KNOBS, Faults, camel_case, role_fields

AGENTS = ("fly-a", "fly-b")
WORLD = "arena"


def parse(spec: str) -> object:
    return parse_fault(spec, agents=AGENTS, world=WORLD)


@pytest.mark.parametrize(("spec", "expected"), [
    ("fly-b.prepare_delay_ms=2600@5", KnobFault("fly-b", "prepare_delay_ms", 2600, 5,
                                                "fly-b.prepare_delay_ms=2600@5")),
    ("fly-a.prepare_delay_ms=15", KnobFault("fly-a", "prepare_delay_ms", 15, None,
                                            "fly-a.prepare_delay_ms=15")),
    ("fly-a.commit_delay_ms=0@0", KnobFault("fly-a", "commit_delay_ms", 0, 0,
                                            "fly-a.commit_delay_ms=0@0")),
    ("fly-b.fail_commit_at_step=1", KnobFault("fly-b", "fail_commit_at_step", 1, None,
                                              "fly-b.fail_commit_at_step=1")),
    ("fly-a.acknowledge_extra_id=req-9999", KnobFault("fly-a", "acknowledge_extra_id",
                                                      "req-9999", None,
                                                      "fly-a.acknowledge_extra_id=req-9999")),
    ("arena.acknowledge_extra_id=req-1", KnobFault("arena", "acknowledge_extra_id", "req-1",
                                                   None, "arena.acknowledge_extra_id=req-1")),
    ("arena.advance_delay_ms=120@0", KnobFault("arena", "advance_delay_ms", 120, 0,
                                               "arena.advance_delay_ms=120@0")),
    ("arena.omit_view_at_boundary=1", KnobFault("arena", "omit_view_at_boundary", 1, None,
                                                "arena.omit_view_at_boundary=1")),
    ("arena.stale_view_at_boundary=2", KnobFault("arena", "stale_view_at_boundary", 2, None,
                                                 "arena.stale_view_at_boundary=2")),
    ("arena.truncated_view_at_boundary=3", KnobFault("arena", "truncated_view_at_boundary", 3,
                                                     None,
                                                     "arena.truncated_view_at_boundary=3")),
    ("arena.omit_audio_at_boundary=4", KnobFault("arena", "omit_audio_at_boundary", 4, None,
                                                 "arena.omit_audio_at_boundary=4")),
    ("arena.overlapping_audio_at_boundary=5",
     KnobFault("arena", "overlapping_audio_at_boundary", 5, None,
               "arena.overlapping_audio_at_boundary=5")),
    ("fly-a.fail_capture=true", KnobFault("fly-a", "fail_capture", True, None,
                                          "fly-a.fail_capture=true")),
    ("arena.fail_stage_restore=false", KnobFault("arena", "fail_stage_restore", False, None,
                                                 "arena.fail_stage_restore=false")),
    ("fly-b.fail_activate_restore=true", KnobFault("fly-b", "fail_activate_restore", True,
                                                   None, "fly-b.fail_activate_restore=true")),
    ("kill:fly-a@2", KillFault("fly-a", 2, "kill:fly-a@2")),
    ("kill:arena@0", KillFault("arena", 0, "kill:arena@0")),
    ("lose-advance-result@2", LoseAdvanceResultFault(2, "lose-advance-result@2")),
])
def test_every_grammar_form_parses(spec: str, expected: object) -> None:
    assert parse(spec) == expected


def test_a_dotted_worker_id_splits_at_the_last_dot() -> None:
    fault = parse_fault("fly.a.commit_delay_ms=3", agents=["fly.a"], world="arena")
    assert fault == KnobFault("fly.a", "commit_delay_ms", 3, None, "fly.a.commit_delay_ms=3")


@pytest.mark.parametrize("spec", [
    "fly-a.prepare_delay_ms=x",           # wrong type
    "fly-a.fail_commit_at_step=3@4",      # @STEP on a knob that is no delay
    "fly-z.commit_delay_ms=1",            # unknown worker
    "arena.commit_delay_ms=1",            # a knob of the other role
    "fly-a.advance_delay_ms=1",           # a knob of the other role
    "kill:fly-a",                         # kill without a step
    "kill:fly-z@1",                       # kill of an unknown worker
    "kill:fly-a@x",
    "kill:fly-a@01",
    "lose-advance-result",
    "lose-advance-result@",
    "lose-advance-result@-1",
    "lose-advance-results@1",
    "fly-a.bogus_knob=1",
    "fly-a.prepare_delay_ms=-1",
    "fly-a.prepare_delay_ms=1.5",
    "fly-a.prepare_delay_ms=01",
    "fly-a.prepare_delay_ms=5@",
    "fly-a.prepare_delay_ms=5@1@2",
    "fly-a.prepare_delay_ms=",
    "fly-a.prepare_delay_ms",
    "fly-a=1",
    ".prepare_delay_ms=1",
    "arena.omit_view_at_boundary=0",      # boundary 0 is rendered at bootstrap
    "arena.omit_view_at_boundary=18446744073709551616",
    "arena.stale_view_at_boundary=1@1",
    "fly-a.fail_capture=yes",
    "fly-a.fail_capture=True",
    "fly-a.acknowledge_extra_id=req-0",
    "fly-a.acknowledge_extra_id=9999",
    "fly-a.acknowledge_extra_id=req-9@1",
    "nonsense",
    "",
])
def test_a_malformed_spec_is_refused_naming_it(spec: str) -> None:
    with pytest.raises(FaultSpecError) as err:
        parse(spec)
    error = err.value
    assert (error.code, error.mutation) == ("INVALID_ARGUMENT", "none")
    assert error.spec == spec
    assert repr(spec) in error.message


@pytest.mark.parametrize("specs", [
    ["fly-a.prepare_delay_ms=5", "fly-a.prepare_delay_ms=6@2"],
    ["arena.fail_capture=true", "arena.fail_capture=false"],
    ["kill:fly-b@1", "kill:fly-b@1"],
    ["lose-advance-result@3", "lose-advance-result@3"],
])
def test_a_knob_given_twice_is_refused(specs: list[str]) -> None:
    with pytest.raises(FaultSpecError) as err:
        parse_faults(specs, agents=AGENTS, world=WORLD)
    assert err.value.code == "INVALID_ARGUMENT"
    assert repr(specs[1]) in err.value.message and "twice" in err.value.message


def test_the_same_knob_on_two_workers_and_two_kills_are_fine() -> None:
    parsed = parse_faults(["fly-a.commit_delay_ms=1", "fly-b.commit_delay_ms=1",
                           "kill:fly-a@1", "kill:fly-a@2", "fly-a.fail_capture=true",
                           "arena.fail_capture=true"], agents=AGENTS, world=WORLD)
    assert len(parsed) == 6


def test_fault_specs_merge_into_a_run_spec() -> None:
    base = RunSpec.validate({"steps": "4"})
    spec = base.with_faults(["fly-a.prepare_delay_ms=12", "fly-b.commit_delay_ms=9@3",
                             "fly-b.fail_commit_at_step=1", "arena.advance_delay_ms=120@0",
                             "arena.omit_audio_at_boundary=4", "arena.fail_capture=true",
                             "kill:fly-b@2", "kill:arena@1", "lose-advance-result@2",
                             "lose-advance-result@0"])
    assert spec.faults_of("fly-a") == Faults(prepare_delay_ms=12)
    assert spec.faults_of("fly-b") == Faults(commit_delay_ms=9, commit_delay_at_step=3,
                                             fail_commit_at_step=1)
    assert spec.faults_of("arena") == Faults(advance_delay_ms=120, advance_delay_at_step=0,
                                             omit_audio_at_boundary=4, fail_capture=True)
    assert spec.injections.to_json() == {
        "kill": [{"worker": "arena", "step": "1"}, {"worker": "fly-b", "step": "2"}],
        "loseAdvanceResultAt": ["0", "2"]}
    assert RunSpec.validate(spec.to_json()) == spec
    assert base.with_faults([]) == base


@pytest.mark.parametrize(("spec", "reason"), [
    ("fly-a.fail_commit_at_step=4", "not a step of this run"),
    ("arena.omit_view_at_boundary=5", "not a boundary of this run"),
    ("fly-b.prepare_delay_ms=1@4", "not a step of this run"),
    ("kill:fly-a@4", "not a step of this run"),
    ("lose-advance-result@9", "not a step of this run"),
    ("fly-a.commit_delay_ms=7", "already set by the run spec"),
    ("kill:fly-b@1", "given twice"),
])
def test_a_merged_fault_the_run_spec_refuses_names_the_fault(spec: str, reason: str) -> None:
    base = RunSpec.validate({"steps": "4", "agents": [
        {"agentId": "fly-a", "portId": "p1", "faults": {"commitDelayMs": 5}},
        {"agentId": "fly-b", "portId": "p2"}],
        "injections": {"kill": [{"worker": "fly-b", "step": "1"}]}})
    with pytest.raises(FaultSpecError) as err:
        base.with_faults([spec])
    assert (err.value.code, err.value.mutation) == ("INVALID_ARGUMENT", "none")
    assert repr(spec) in err.value.message and reason in err.value.message


def test_the_knob_table_matches_the_run_spec_keys() -> None:
    assert {k for k, knob in KNOBS.items() if "agent" in knob.roles} == {
        "prepare_delay_ms", "commit_delay_ms", "fail_commit_at_step", "acknowledge_extra_id",
        "fail_capture", "fail_stage_restore", "fail_activate_restore"}
    assert {k for k, knob in KNOBS.items() if "environment" in knob.roles} == {
        "advance_delay_ms", "omit_view_at_boundary", "stale_view_at_boundary",
        "truncated_view_at_boundary", "omit_audio_at_boundary",
        "overlapping_audio_at_boundary", "acknowledge_extra_id", "fail_capture",
        "fail_stage_restore", "fail_activate_restore"}
    assert [camel_case(f) for f in role_fields("agent")] == [
        "prepareDelayMs", "prepareDelayAtStep", "commitDelayMs", "commitDelayAtStep",
        "failCommitAtStep", "acknowledgeExtraId", "failCapture", "failStageRestore",
        "failActivateRestore"]
    assert set(Faults().to_json("environment")) == {camel_case(f) for f in
                                                    role_fields("environment")}


def test_a_delay_with_a_step_sleeps_only_at_that_step() -> None:
    faults = Faults(prepare_delay_ms=15, prepare_delay_at_step=2, commit_delay_ms=9)
    assert [faults.delay_ms("prepare_delay_ms", k) for k in range(4)] == [0, 0, 15, 0]
    assert [faults.delay_ms("commit_delay_ms", k) for k in range(3)] == [9, 9, 9]
    assert faults.delay_ms("advance_delay_ms", 0) == 0
    with pytest.raises(ValueError):
        faults.delay_ms("fail_commit_at_step", 0)
    assert faults.step_addressed("fly-a") == [("fly-a.prepare_delay_ms", 2)]
    assert faults.without(["prepare_delay_ms"]) == Faults(commit_delay_ms=9)
    assert Faults(omit_view_at_boundary=0).step_addressed("arena") == []
    assert Faults(stale_view_at_boundary=3).step_addressed("arena") == [
        ("arena.stale_view_at_boundary", 2)]
    assert Faults(fail_commit_at_step=1, fail_capture=True).foreign_fields("environment") == [
        "fail_commit_at_step"]
    assert faults.is_set("prepare_delay_ms") and not faults.is_set("fail_capture")
