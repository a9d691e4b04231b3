"""What the task produces, checked where the task runs (the coordinator's process).

Why: the task is a local object of the coordinator, but its rewards and stimulations travel to
the agents inside `Agent.Commit`, and its progress, contexts and event payloads into records and
checkpoints. A value that canonical JSON cannot hold (a NaN, an integral value outside
±(2^53−1), a non-number) used to surface only at the agent, as a failed commit of that agent
(`BACKEND_FAILURE … CALL_GONE`), and was retried on every recovery attempt. The task is at
fault, and the same task fed the same inputs produces the same value again, so:

- `check_evaluation` looks at every reward and stimulation of a transition's evaluation (the
  task's `TypedValue`s — progress, contexts, event payloads, at bootstrap too — were checked
  when the task built them, see `task_error`) and refuses the first value that cannot be
  encoded, naming the task's import path and the value's JSON path
  (`/outcomes/fly-a/rewards/0/value`). Numbers and ASCII ids take a fast path (0.28 ms per
  step for 256 agents with one reward each, on the loaded 2-CPU test host); anything else is
  asked of canonical JSON itself. A stimulation's
  `durationMs` must also be > 0, as the agent requires.
- `task_error` turns what a task call raised into the error that fails the epoch: a refused
  value (`INVALID_ARGUMENT` raised while the task built a `TypedValue`, or found here) names the
  task and carries a `PluginFault` (stage `call`) that **repeats**, so the grant session ends
  the run `failed` at once (`{error: "plugin failed", …}`) without spending a recovery attempt;
  any other exception keeps the retried `as_domain_error` form.

Code: `INVALID_ARGUMENT` (design/session.md §1.6: a value out of range or schema), mutation
`unknown`: it is a local coordinator error raised after the world advanced (for a transition) and
design/session.md §1.6 lets such errors carry a before-mutation code with `unknown`. That it repeats
is the fault's flag, as for every other deterministic plugin failure
(`flyd.state.recovery.repeats`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from flyd.session.calls import as_domain_error
from workers.protocols import AgentOutcome, Evaluation
from workers.types.canonical import MAX_SAFE_INTEGER, canonical
from workers.types.domain import DomainError, ErrorCode, Mutation, PluginFault, PluginStage

__all__ = ["check_evaluation", "task_error", "value_fault"]


def value_fault(plugin: str, path: str, reason: str) -> DomainError:
    """The error of a task value that cannot be encoded: repeats, names task and path."""
    where = f"{path}: " if path else ""
    message = f"task {plugin}: {where}{reason}"
    fault = PluginFault(plugin, PluginStage.CALL, "ValueError", message, (), True)
    return DomainError(ErrorCode.INVALID_ARGUMENT, message, Mutation.UNKNOWN, fault)


def task_error(exc: Exception, plugin: str) -> DomainError:
    """What a task call raised, as the error failing the epoch (module rules)."""
    if (isinstance(exc, DomainError) and exc.code == ErrorCode.INVALID_ARGUMENT
            and exc.data is None):
        return value_fault(plugin, "", exc.message)
    return as_domain_error(exc)


def _refusal(value: Any) -> str | None:
    """Why canonical JSON refuses `value` (None when it holds it)."""
    try:
        canonical(value)
    except DomainError as exc:
        return exc.message
    return None


def _number_refusal(value: Any) -> str | None:
    """A finite number, integral ones within ±(2^53−1) (fast path first: every step has one
    reward per agent)."""
    if type(value) is float:
        if math.isfinite(value) and (abs(value) <= MAX_SAFE_INTEGER or not value.is_integer()):
            return None
    elif type(value) is int and abs(value) <= MAX_SAFE_INTEGER:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{type(value).__name__} {value!r} is not a number"
    return _refusal(value)


def _string_refusal(value: Any) -> str | None:
    if type(value) is str and value.isascii():
        return None
    return _refusal(value)


def _check_outcome(plugin: str, path: str, outcome: AgentOutcome) -> None:
    for i, reward in enumerate(outcome.rewards):
        for key, reason in (("eventId", _string_refusal(reward.event_id)),
                            ("ruleId", _string_refusal(reward.rule_id)),
                            ("value", _number_refusal(reward.value))):
            if reason is not None:
                raise value_fault(plugin, f"{path}/rewards/{i}/{key}", reason)
    for i, stimulus in enumerate(outcome.stimulations):
        duration = stimulus.duration_ms
        late = _number_refusal(duration)
        if late is None and not duration > 0:
            late = f"{duration!r} is not > 0"
        for key, reason in (("id", _string_refusal(stimulus.id)),
                            ("kindId", _string_refusal(stimulus.kind_id)),
                            ("durationMs", late)):
            if reason is not None:
                raise value_fault(plugin, f"{path}/stimulations/{i}/{key}", reason)


def _check_outcomes(plugin: str, outcomes: Mapping[str, AgentOutcome],
                    agents: Iterable[str]) -> None:
    for agent_id in agents:
        outcome = outcomes.get(agent_id)
        if outcome is not None:
            _check_outcome(plugin, f"/outcomes/{agent_id}", outcome)


def check_evaluation(evaluation: Evaluation, plugin: str, agents: Iterable[str]) -> None:
    """Every reward and stimulation of a transition's evaluation can be encoded."""
    _check_outcomes(plugin, evaluation.outcomes, agents)
