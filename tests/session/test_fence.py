"""The pure part of the fence and `SessionFailure` (session.md §6.3)."""

from __future__ import annotations

import pickle

import pytest

from flyd.session.fence import (
    FENCED_MESSAGE,
    Detail,
    SessionFailure,
    check_replacement,
    fenced_refusal,
    refuse_if_fenced,
)
from flyd.session.phase import (
    Applying,
    Committing,
    Failed,
    Observing,
    Paused,
    PhaseMachine,
    Preparing,
    Ready,
    Resetting,
    Restoring,
)
from workers.types.domain import DomainError, ErrorCode, Mutation

INJECTED = DomainError(
    ErrorCode.BACKEND_FAILURE,
    "injected commit failure after the next input was installed",
    Mutation.APPLIED,
)


def fenced(machine: PhaseMachine) -> bool:
    """Read the fence through a call, so a type checker does not pin it between reads."""
    return machine.fenced


def stepped_to(k: int) -> PhaseMachine:
    machine = PhaseMachine()
    machine.move(Ready(0))
    for step in range(k):
        for target in (
            Preparing(step),
            Applying(step),
            Observing(step + 1),
            Committing(step),
            Ready(step + 1),
        ):
            machine.move(target)
    return machine


def test_a_session_failure_reads_detail_phase_participant_and_error() -> None:
    failure = SessionFailure(INJECTED, "Committing(1)", Detail.COMMIT, "fly-b")
    assert str(failure) == (
        "commit at Committing(1) (fly-b): BACKEND_FAILURE: injected commit failure after the "
        "next input was installed"
    )
    assert failure.audit_entry == "fail:commit:fly-b"
    assert (failure.code, failure.mutation) == (ErrorCode.BACKEND_FAILURE, Mutation.APPLIED)
    assert failure.message == INJECTED.message
    anonymous = SessionFailure(INJECTED, "Applying(0)", "Environment.Advance")
    assert str(anonymous).startswith("Environment.Advance at Applying(0): BACKEND_FAILURE: ")
    assert anonymous.audit_entry == "fail:Environment.Advance"


def test_a_session_failure_is_a_value() -> None:
    one = SessionFailure(INJECTED, "Committing(1)", "commit", "fly-b")
    assert one == SessionFailure(INJECTED, "Committing(1)", Detail.COMMIT, "fly-b")
    assert one != SessionFailure(INJECTED, "Committing(1)", "commit", "fly-a")
    assert len({one, SessionFailure(INJECTED, "Committing(1)", "commit", "fly-b")}) == 1
    assert pickle.loads(pickle.dumps(one)) == one
    with pytest.raises(SessionFailure):
        raise one


@pytest.mark.parametrize(
    ("phase", "detail", "participant"),
    [
        ("Committing", "commit", None),  # a stepped phase without its step
        ("Failed(1)", "commit", None),
        ("Ready(01)", "commit", None),
        ("Ready(1)", "nonsense", None),
        ("Ready(1)", "Agent.Frobnicate", None),
        ("Ready(1)", "commit", "Fly-B"),
    ],
)
def test_a_malformed_failure_is_a_flyd_bug(
    phase: str, detail: str, participant: str | None
) -> None:
    with pytest.raises(DomainError) as caught:
        SessionFailure(INJECTED, phase, detail, participant)
    assert caught.value.code == ErrorCode.INTERNAL


def test_the_fence_closes_at_a_failure_and_refuses_without_touching_anything() -> None:
    machine = stepped_to(1)
    refuse_if_fenced(machine)  # open: nothing raised
    machine.move(Preparing(1))
    assert not fenced(machine)
    assert machine.fail() == Preparing(1)
    assert fenced(machine)
    log = machine.phase_log
    with pytest.raises(SessionFailure) as caught:
        refuse_if_fenced(machine)
    assert caught.value == fenced_refusal(Failed())
    assert caught.value.error == DomainError(ErrorCode.INVALID_PHASE, FENCED_MESSAGE, Mutation.NONE)
    assert (caught.value.detail, caught.value.participant) == ("fenced", None)
    assert str(caught.value) == (
        "fenced at Failed: INVALID_PHASE: the epoch is fenced; only a coherent restore resumes play"
    )
    assert machine.phase == Failed() and machine.phase_log == log


def test_the_fence_lifts_only_through_a_complete_restore() -> None:
    machine = stepped_to(2)
    machine.fail()
    machine.move(Restoring(1))
    assert fenced(machine)  # an install in progress does not lift it
    machine.fail()  # a failure after Restoring(k): back to Failed, still fenced
    assert fenced(machine)
    machine.move(Restoring(1))
    machine.move(Paused(1))
    assert not fenced(machine)
    refuse_if_fenced(machine)


def test_a_cold_install_never_closes_the_fence() -> None:
    machine = stepped_to(0)
    machine.move(Restoring(3))
    assert not fenced(machine)
    machine.move(Paused(3))
    assert not fenced(machine)


def test_a_participant_is_replaced_only_while_fenced_or_at_an_unstepped_zero() -> None:
    check_replacement(stepped_to(0), "fly-b")
    fenced = stepped_to(1)
    fenced.fail()
    check_replacement(fenced, "fly-b")
    refusals = [stepped_to(1), PhaseMachine()]
    reset = stepped_to(1)
    for target in (Paused(1), Resetting(1), Ready(0)):
        reset.move(target)
    refusals.append(reset)
    for machine in refusals:
        with pytest.raises(DomainError) as caught:
            check_replacement(machine, "fly-b")
        assert (caught.value.code, caught.value.mutation) == (
            ErrorCode.INVALID_PHASE,
            Mutation.NONE,
        )
        assert caught.value.message == (
            "replace_participant(fly-b) needs a fenced epoch or an unstepped Ready(0); "
            f"the session is {machine.phase.label}"
        )
