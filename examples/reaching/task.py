"""`ReachingTask`: rewards for getting closer, an event and a stimulation for a goal reached.

Per transition k → k+1 and per point (in the world's port order):
- rule `approach`: an event `reaching.approach` and a reward equal to the distance reduction
  toward the goal the point had at k (`|p_k − g_k| − |p_k+1 − g_k|`; positive when it got
  closer, also on the step that reaches the goal);
- rule `goal`, when the point's `reached` count grew: an event `reaching.goal-reached`, a
  reward of `goalBonus` and a stimulation `reaching.goal` (10 ms) for its agent.

Event ids are `ev-` + 16 hex characters of
`digest_bytes("<epoch>\\n<step>\\n<rule>\\n<ordinal>\\n")` (the format of session.md §4.5),
minted at step k+1 with one ordinal per rule and point, so a re-executed transition mints the
same ids and `minted_ids` can list every id a step could mint.

`terminal`: `never`, `after:N` (N transitions) or `goals:N` (the agents reached N goals in
all); the episode ends with reason `goals-reached` or `transitions`. A task is built with the
session's epoch (its bootstrap event's id needs one) and `max_agents` (bounds `minted_ids`).

Config: `goalBonus` (default 1).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from examples.reaching.schemas import (
    CONTEXT,
    EPISODE,
    EVENT,
    INSPECTION,
    PROGRESS,
    distance,
    expect,
    point,
    settings,
    typed,
)
from workers.protocols import AgentOutcome, Bootstrap, EpisodeRequest, Evaluation, TaskEvent
from workers.types.canonical import canonical, digest_bytes, parse_strict
from workers.types.datatypes import PortControl, Reward, Stimulus, TypedValue
from workers.types.domain import DomainError, Scope, parse_finite, parse_int, parse_u64

CAPTURE_FORMAT: Final = "reaching-task-v1"
RULES: Final = ("bootstrap", "approach", "goal")
GOAL_STIMULUS_MS: Final = 10.0
DEFAULTS: Final = {"goalBonus": (1.0, 0.0, 1000.0)}
_TERMINAL: Final = re.compile(r"(after|goals):(0|[1-9][0-9]{0,15})")


def event_id(epoch: str, step: int, rule: str, ordinal: int) -> str:
    text = f"{epoch}\n{step}\n{rule}\n{ordinal}\n"
    return "ev-" + digest_bytes(text.encode("utf-8"))[:16]


def _points(inspection: TypedValue, which: str) -> list[dict[str, Any]]:
    value = expect(inspection, INSPECTION, f"the {which} inspection")
    points = value.get("points") if isinstance(value, dict) else None
    if not isinstance(points, list) or not all(isinstance(p, dict) for p in points):
        raise DomainError("BACKEND_FAILURE", f"the {which} inspection has no points", "unknown")
    return points


class ReachingTask:
    """Distance reduction and goals reached, per agent."""

    def __init__(self, *, config: Mapping[str, Any], terminal: str, max_agents: int,
                 epoch: str) -> None:
        self.bonus = settings(dict(config), "reaching task", DEFAULTS)["goalBonus"]
        if terminal == "never":
            self.terminal: tuple[str, int] | None = None
        else:
            match = _TERMINAL.fullmatch(terminal) if isinstance(terminal, str) else None
            if match is None:
                raise DomainError.invalid(f"terminal {terminal!r} is not never, after:N or "
                                          "goals:N")
            self.terminal = (match.group(1), int(match.group(2)))
        self.max_agents = parse_int(max_agents, "max_agents", 1, 256)
        self.epoch = epoch
        self.transitions = 0
        self.reached: dict[str, int] = {}
        self.total_reward = 0.0
        self._evaluations = 0

    def bootstrap(self, inspection: TypedValue, bindings: Sequence[tuple[str, str]]
                  ) -> Bootstrap:
        points = _points(inspection, "first")
        self.reached = {agent: 0 for _, agent in bindings}
        event = TaskEvent(event_id(self.epoch, 0, "bootstrap", 0), "reaching.bootstrap", 0, None,
                          typed(EVENT, {"points": len(points)}))
        return Bootstrap(contexts={agent: typed(CONTEXT, {"step": 0}) for _, agent in bindings},
                         progress=self.progress(), events=(event,))

    def evaluate_transition(self, scope: Scope, old: TypedValue, new: TypedValue,
                            controls: Sequence[PortControl]) -> Evaluation:
        self._evaluations += 1
        before = {p.get("portId"): p for p in _points(old, "old")}
        step = scope.step + 1
        outcomes: dict[str, tuple[list[Reward], list[Stimulus]]] = {
            agent: ([], []) for agent in self.reached}
        events: list[TaskEvent] = []
        reached = dict(self.reached)
        total = self.total_reward
        for ordinal, now in enumerate(_points(new, "new")):
            agent, prior = now.get("agentId"), before.get(now.get("portId"))
            if agent not in outcomes or prior is None:
                raise DomainError.before("IDENTITY_MISMATCH",
                                         f"point {now.get('portId')} has no bound agent")
            goal = point(prior.get("goal"), "goal")
            gain = (distance(point(prior.get("position"), "position"), goal)
                    - distance(point(now.get("position"), "position"), goal))
            rewards, stimulations = outcomes[agent]
            approach = event_id(scope.epoch, step, "approach", ordinal)
            events.append(TaskEvent(approach, "reaching.approach", step, agent,
                                    typed(EVENT, {"gain": gain})))
            rewards.append(Reward(approach, "approach", gain))
            total += gain
            count = parse_int(now.get("reached"), "reached", 0, 2**53 - 1)
            if count > parse_int(prior.get("reached"), "reached", 0, 2**53 - 1):
                hit = event_id(scope.epoch, step, "goal", ordinal)
                events.append(TaskEvent(hit, "reaching.goal-reached", step, agent,
                                        typed(EVENT, {"reached": count})))
                rewards.append(Reward(hit, "goal", self.bonus))
                stimulations.append(Stimulus(event_id(scope.epoch, step, "goal", ordinal),
                                             "reaching.goal", GOAL_STIMULUS_MS))
                total += self.bonus
                reached[agent] = reached.get(agent, 0) + 1
        self.transitions += 1
        self.reached = reached
        self.total_reward = total
        context = typed(CONTEXT, {"step": step})
        return Evaluation(
            outcomes={a: AgentOutcome(tuple(r), tuple(s)) for a, (r, s) in outcomes.items()},
            next_contexts=dict.fromkeys(outcomes, context), progress=self.progress(),
            events=tuple(events), episode=self._episode())

    def _episode(self) -> EpisodeRequest | None:
        if self.terminal is None:
            return None
        kind, bound = self.terminal
        if kind == "after" and self.transitions >= bound:
            reason = "transitions"
        elif kind == "goals" and sum(self.reached.values()) >= bound:
            reason = "goals-reached"
        else:
            return None
        return EpisodeRequest(reason, typed(EPISODE, {"transitions": self.transitions,
                                                      "reached": dict(self.reached)}))

    def progress(self) -> TypedValue:
        return typed(PROGRESS, {"counter": sum(self.reached.values()),
                                "transitions": self.transitions, "reached": dict(self.reached),
                                "totalReward": self.total_reward})

    def evaluations(self) -> int:
        return self._evaluations

    def minted_ids(self, epoch: str, step: int) -> list[str]:
        return [event_id(epoch, step, rule, o) for rule in RULES
                for o in range(self.max_agents + 1)]

    def capture(self) -> bytes:
        return canonical({"format": CAPTURE_FORMAT, "transitions": self.transitions,
                          "reached": self.reached, "totalReward": self.total_reward,
                          "evaluations": str(self._evaluations)})

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`: all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        try:
            doc = parse_strict(payload)
            keys = {"format", "transitions", "reached", "totalReward", "evaluations"}
            if not isinstance(doc, dict) or set(doc) != keys \
                    or doc["format"] != CAPTURE_FORMAT or not isinstance(doc["reached"], dict):
                raise DomainError.invalid(f"not a {CAPTURE_FORMAT} state")
            transitions = parse_int(doc["transitions"], "transitions", 0, 2**53 - 1)
            reached = {str(a): parse_int(n, "reached", 0, 2**53 - 1)
                       for a, n in doc["reached"].items()}
            total = parse_finite(doc["totalReward"], "totalReward")
            evaluations = parse_u64(doc["evaluations"], "evaluations")
        except DomainError as exc:
            raise DomainError.before("INCOMPATIBLE_STATE",
                                     f"reaching task state: {exc.message}") from None
        self.transitions, self.reached, self.total_reward = transitions, reached, total
        self._evaluations = evaluations
