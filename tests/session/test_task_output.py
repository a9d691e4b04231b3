"""The task's values checked where it runs (flyd.session.task_output): the first value canonical
JSON cannot hold is named by the task and its path, and the error repeats (no recovery); any
other exception of a task call keeps the retried form."""

from __future__ import annotations

import math

import pytest

from flyd.session.task_output import check_evaluation, task_error
from flyd.state.recovery import is_permanent
from workers.protocols import AgentOutcome, Evaluation
from workers.synthetic.schemas import synthetic_schema
from workers.types.datatypes import Reward, Stimulus, TypedValue
from workers.types.domain import DomainError

TASK = "pkg.tasks:Task"
PROGRESS = synthetic_schema("arena.progress.v1")


def evaluation(**outcomes: AgentOutcome) -> Evaluation:
    progress = TypedValue(PROGRESS, {"counter": 0})
    return Evaluation(outcomes=dict(outcomes), next_contexts={a: progress for a in outcomes},
                      progress=progress, events=(), episode=None)


def refusal(ev: Evaluation) -> DomainError:
    with pytest.raises(DomainError) as caught:
        check_evaluation(ev, TASK, sorted(ev.outcomes))
    return caught.value


def test_values_that_can_be_encoded_pass() -> None:
    check_evaluation(evaluation(a=AgentOutcome((Reward("ev-1", "r", 2.5),),
                                               (Stimulus("s-1", "k", 4.0),))), TASK, ["a"])


@pytest.mark.parametrize(("outcome", "path"), [
    (AgentOutcome((Reward("ev-1", "r", 1.0), Reward("ev-2", "r", 1e16))),
     "/outcomes/b/rewards/1/value"),
    (AgentOutcome((Reward("ev-1", "r", math.inf),)), "/outcomes/b/rewards/0/value"),
    (AgentOutcome((Reward("ev-1", "r", "1"),)), "/outcomes/b/rewards/0/value"),  # type: ignore[arg-type]
    (AgentOutcome((), (Stimulus("s-1", "k", 0.0),)), "/outcomes/b/stimulations/0/durationMs"),
    (AgentOutcome((Reward("ev-\ud800", "r", 1.0),)), "/outcomes/b/rewards/0/eventId"),
])
def test_the_first_refused_value_is_named_with_the_task_and_repeats(
        outcome: AgentOutcome, path: str) -> None:
    error = refusal(evaluation(a=AgentOutcome(), b=outcome))
    assert error.message.startswith(f"task {TASK}: {path}: "), error.message
    assert str(error.code) == "INVALID_ARGUMENT" and str(error.mutation) == "unknown"
    assert error.data is not None and error.data.plugin == TASK and error.data.repeats
    assert is_permanent(error)


def test_a_typed_value_the_task_cannot_build_names_the_task_and_repeats() -> None:
    with pytest.raises(DomainError) as caught:
        TypedValue(PROGRESS, {"counter": 0, "totalReward": math.nan})
    error = task_error(caught.value, TASK)
    assert error.message.startswith(f"task {TASK}: ") and "nan" in error.message
    assert error.data is not None and error.data.repeats


def test_any_other_task_exception_is_retried() -> None:
    error = task_error(KeyError("terminal"), TASK)
    assert error.data is not None and not error.data.repeats and not is_permanent(error)
