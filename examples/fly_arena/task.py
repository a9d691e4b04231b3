"""`OdourTask`: rewards for getting closer to the odour source, an event when a fly reaches it.

Per transition k → k+1 and per fly (in the world's port order):
- rule `approach`: an event `fly.approach` and a reward equal to the distance the fly closed on
  the source (`|p_k − s| − |p_k+1 − s|`; negative when it walked away). On the step a fly
  reaches the source it is released elsewhere, so that step's reward is `|p_k − s| − radius`,
  the distance it closed up to the source's rim;
- rule `source`, when the fly's `reached` count grew: an event `fly.source-reached`, a reward of
  `sourceBonus` and a stimulation `fly.source` (10 ms) for its agent.

Event ids are `ev-` + 16 hex characters of
`digest_bytes("<epoch>\\n<step>\\n<rule>\\n<ordinal>\\n")` (the format of session.md §4.5),
minted at step k+1 with one ordinal per rule and fly, so a re-executed transition mints the
same ids and `minted_ids` can list every id a step could mint.

`terminal`: `never`, `after:N` (N transitions) or `visits:N` (the flies reached the source N
times in all); the episode ends with reason `transitions` or `visits`.

Config: `sourceBonus` (default 1).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

from examples.fly_arena.schemas import (
    CONTEXT,
    EPISODE,
    EVENT,
    INSPECTION,
    PROGRESS,
    expect,
    pair,
    settings,
    typed,
)
from workers.protocols import AgentOutcome, Bootstrap, EpisodeRequest, Evaluation, TaskEvent
from workers.types.canonical import canonical, digest_bytes, parse_strict
from workers.types.datatypes import PortControl, Reward, Stimulus, TypedValue
from workers.types.domain import DomainError, Scope, parse_finite, parse_int, parse_u64

CAPTURE_FORMAT: Final = "odour-task-v1"
RULES: Final = ("bootstrap", "approach", "source")
SOURCE_STIMULUS_MS: Final = 10.0
DEFAULTS: Final = {"sourceBonus": (1.0, 0.0, 1000.0)}
_TERMINAL: Final = re.compile(r"(after|visits):(0|[1-9][0-9]{0,15})")


def event_id(epoch: str, step: int, rule: str, ordinal: int) -> str:
    text = f"{epoch}\n{step}\n{rule}\n{ordinal}\n"
    return "ev-" + digest_bytes(text.encode("utf-8"))[:16]


def distance(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Euclidean distance with `+ - * /` and `sqrt` only: correctly rounded everywhere."""
    dx, dy = a[0] - b[0], a[1] - b[1]
    return math.sqrt(dx * dx + dy * dy)


def _scene(inspection: TypedValue, which: str
           ) -> tuple[tuple[float, float], float, list[dict[str, Any]]]:
    """The source, its radius and the flies of an inspection."""
    value = expect(inspection, INSPECTION, f"the {which} inspection")
    flies = value.get("flies") if isinstance(value, dict) else None
    if not isinstance(flies, list) or not all(isinstance(f, dict) for f in flies):
        raise DomainError("BACKEND_FAILURE", f"the {which} inspection has no flies", "unknown")
    return pair(value.get("source"), "source"), parse_finite(value.get("radius"), "radius"), flies


class OdourTask:
    """Distance closed on the source and visits, per fly."""

    def __init__(self, *, config: Mapping[str, Any], terminal: str, max_agents: int,
                 epoch: str) -> None:
        self.bonus = settings(dict(config), "odour task", DEFAULTS)["sourceBonus"]
        if terminal == "never":
            self.terminal: tuple[str, int] | None = None
        else:
            match = _TERMINAL.fullmatch(terminal) if isinstance(terminal, str) else None
            if match is None:
                raise DomainError.invalid(f"terminal {terminal!r} is not never, after:N or "
                                          "visits:N")
            self.terminal = (match.group(1), int(match.group(2)))
        self.max_agents = parse_int(max_agents, "max_agents", 1, 256)
        self.epoch = epoch
        self.transitions = 0
        self.reached: dict[str, int] = {}
        self.total_reward = 0.0
        self._evaluations = 0

    def bootstrap(self, inspection: TypedValue, bindings: Sequence[tuple[str, str]]
                  ) -> Bootstrap:
        _, _, flies = _scene(inspection, "first")
        self.reached = {agent: 0 for _, agent in bindings}
        event = TaskEvent(event_id(self.epoch, 0, "bootstrap", 0), "fly.bootstrap", 0, None,
                          typed(EVENT, {"flies": len(flies)}))
        return Bootstrap(contexts={agent: typed(CONTEXT, {"step": 0}) for _, agent in bindings},
                         progress=self.progress(), events=(event,))

    def evaluate_transition(self, scope: Scope, old: TypedValue, new: TypedValue,
                            controls: Sequence[PortControl]) -> Evaluation:
        self._evaluations += 1
        source, radius, old_flies = _scene(old, "old")
        before = {f.get("portId"): f for f in old_flies}
        step = scope.step + 1
        outcomes: dict[str, tuple[list[Reward], list[Stimulus]]] = {
            agent: ([], []) for agent in self.reached}
        events: list[TaskEvent] = []
        reached = dict(self.reached)
        total = self.total_reward
        for ordinal, now in enumerate(_scene(new, "new")[2]):
            agent, prior = now.get("agentId"), before.get(now.get("portId"))
            if agent not in outcomes or prior is None:
                raise DomainError.before("IDENTITY_MISMATCH",
                                         f"fly {now.get('portId')} has no bound agent")
            count = parse_int(now.get("reached"), "reached", 0, 2**53 - 1)
            arrived = count > parse_int(prior.get("reached"), "reached", 0, 2**53 - 1)
            was = distance(pair(prior.get("position"), "position"), source)
            gain = was - (radius if arrived else
                          distance(pair(now.get("position"), "position"), source))
            rewards, stimulations = outcomes[agent]
            approach = event_id(scope.epoch, step, "approach", ordinal)
            events.append(TaskEvent(approach, "fly.approach", step, agent,
                                    typed(EVENT, {"gain": gain})))
            rewards.append(Reward(approach, "approach", gain))
            total += gain
            if arrived:
                hit = event_id(scope.epoch, step, "source", ordinal)
                events.append(TaskEvent(hit, "fly.source-reached", step, agent,
                                        typed(EVENT, {"reached": count})))
                rewards.append(Reward(hit, "source", self.bonus))
                stimulations.append(Stimulus(hit, "fly.source", SOURCE_STIMULUS_MS))
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
        elif kind == "visits" and sum(self.reached.values()) >= bound:
            reason = "visits"
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
                                     f"odour task state: {exc.message}") from None
        self.transitions, self.reached, self.total_reward = transitions, reached, total
        self._evaluations = evaluations
