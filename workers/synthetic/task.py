"""`CounterTask`: the synthetic task and its event ids (design/session.md §4.5).

Why: the task turns world inspections into rewards, stimulations, events and decision contexts,
coordinator-side and deterministically; event ids are minted from `(epoch, step, rule, ordinal)`
so a re-executed transition mints the same ids and a trace can be rebased onto another epoch.

Resolved ambiguities:
- `bootstrap()` has no epoch parameter, yet its event id needs one: the task is constructed with
  the session epoch (`epoch=`, default `"e1"`); `evaluate_transition` uses `scope.epoch`.
- Transition events carry `sourceStep` = k+1 (the step their ids are minted at).
- `evaluations()` counts every call of `evaluate_transition`, including one that fails;
  progress, bindings and totals change only when the evaluation succeeds (a failure fences the
  epoch anyway, and nothing is left half-updated).
- The terminal `counter:N` takes a signed canonical decimal (the counter is signed); `after:N` a
  U64. Both end the episode with reason `"counter-target"`.
- `minted_ids` ordinals run over `0..2·max_agents` inclusive.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

from workers.protocols import AgentOutcome, Bootstrap, EpisodeRequest, Evaluation, TaskEvent
from workers.synthetic.arena import control_delta
from workers.synthetic.schemas import (
    CONTEXT,
    EPISODE,
    EVENT,
    INSPECTION,
    PROGRESS,
    has_schema,
    typed,
)
from workers.types.canonical import canonical, digest_bytes, parse_strict
from workers.types.datatypes import PortControl, Reward, Stimulus, TypedValue
from workers.types.domain import U64_MAX, DomainError, Scope, parse_finite, parse_int, parse_u64

RULES: Final = ("bootstrap", "counter-delta", "milestone")
MILESTONE_EVERY: Final = 5
MILESTONE_MS: Final = 4.0
EPISODE_REASON: Final = "counter-target"
CAPTURE_FORMAT: Final = "counter-task-v1"
U64_RE: Final = re.compile(r"0|[1-9][0-9]{0,19}")
_SIGNED_RE: Final = re.compile(r"0|-?[1-9][0-9]{0,15}")
_SAFE_INT: Final = (1 << 53) - 1


def event_id(epoch: str, step: int, rule: str, ordinal: int) -> str:
    """`"ev-"` + the first 16 hex characters of
    `digest_bytes("<epoch>\\n<step>\\n<rule>\\n<ordinal>\\n")`."""
    text = f"{epoch}\n{step}\n{rule}\n{ordinal}\n"
    return "ev-" + digest_bytes(text.encode("utf-8"))[:16]


def context(step: int, *, boot: bool) -> TypedValue:
    """The `arena.context.v1` decision context at boundary `step`."""
    return typed(CONTEXT, {"available": ["inc", "dec"], "boot": boot, "step": step})


@dataclass(frozen=True)
class Terminal:
    """`never` | `counter:N` (counter ≥ N) | `after:N` (transitions ≥ N)."""

    kind: Literal["never", "counter", "after"]
    bound: int = 0

    @classmethod
    def parse(cls, text: object) -> Terminal:
        """Parse the terminal grammar; `INVALID_ARGUMENT` naming the text otherwise."""
        if text == "never":
            return cls("never")
        if isinstance(text, str):
            kind, sep, number = text.partition(":")
            if sep and kind == "counter" and _SIGNED_RE.fullmatch(number) \
                    and abs(int(number)) <= _SAFE_INT:
                return cls("counter", int(number))
            if sep and kind == "after" and U64_RE.fullmatch(number) and int(number) <= U64_MAX:
                return cls("after", int(number))
        raise DomainError.before("INVALID_ARGUMENT",
                                 f"terminal {text!r} is not never, counter:N or after:N")

    def __str__(self) -> str:
        return self.kind if self.kind == "never" else f"{self.kind}:{self.bound}"

    def reached(self, counter: int, transitions: int) -> bool:
        if self.kind == "counter":
            return counter >= self.bound
        if self.kind == "after":
            return transitions >= self.bound
        return False


def _counter_of(inspection: TypedValue, which: str) -> int:
    if not has_schema(inspection, INSPECTION):
        raise DomainError.before("IDENTITY_MISMATCH",
                                 f"the {which} inspection is not arena.inspection.v1")
    value = inspection.value
    counter = value.get("counter") if isinstance(value, dict) else None
    if isinstance(counter, bool) or not isinstance(counter, int):
        raise DomainError("BACKEND_FAILURE", f"the {which} inspection has no integer counter",
                          "unknown")
    return counter


class CounterTask:
    """Rewards every press: +1 for `inc`, −1 for `dec`; a milestone every multiple of 5."""

    def __init__(self, *, config: Mapping[str, Any] | None = None, terminal: str = "never",
                 max_agents: int = 4, epoch: str = "e1") -> None:
        if config:
            raise DomainError.before("INVALID_ARGUMENT", "the counter task takes no config keys")
        parse_int(max_agents, "max_agents", 1, 256)
        self.terminal = Terminal.parse(terminal)
        self.max_agents = max_agents
        self.epoch = epoch
        self.ports: dict[str, str] = {}
        self.counter = 0
        self.transitions = 0
        self.total_reward = 0.0
        self._evaluations = 0

    @staticmethod
    def check_terminal(terminal: object) -> None:
        """The terminal grammar, for a run spec checked before the task is built."""
        Terminal.parse(terminal)

    def _agents(self) -> list[str]:
        return sorted(set(self.ports.values()))

    def bootstrap(self, inspection: TypedValue, bindings: Sequence[tuple[str, str]]) -> Bootstrap:
        counter = _counter_of(inspection, "bootstrap")
        ports: dict[str, str] = {}
        for port_id, agent_id in bindings:
            if port_id in ports:
                raise DomainError.before("INVALID_ARGUMENT", f"port {port_id} is bound twice")
            ports[port_id] = agent_id
        self.ports = ports
        self.counter = counter
        self.transitions = 0
        self.total_reward = 0.0
        event = TaskEvent(event_id(self.epoch, 0, "bootstrap", 0), "arena.bootstrap", 0, None,
                          typed(EVENT, {"counter": counter}))
        return Bootstrap(contexts=dict.fromkeys(self._agents(), context(0, boot=True)),
                         progress=self.progress(), events=(event,))

    def evaluate_transition(self, scope: Scope, old: TypedValue, new: TypedValue,
                            controls: Sequence[PortControl]) -> Evaluation:
        self._evaluations += 1
        old_counter = _counter_of(old, "old")
        new_counter = _counter_of(new, "new")
        k1 = scope.step + 1
        rewards: dict[str, list[Reward]] = {a: [] for a in self._agents()}
        stimulations: dict[str, list[Stimulus]] = {a: [] for a in self._agents()}
        events: list[TaskEvent] = []
        ordinal = 0
        total = 0
        for control in controls:
            agent_id = self.ports.get(control.port_id)
            if agent_id is None:
                raise DomainError.before("IDENTITY_MISMATCH",
                                         f"port {control.port_id} is bound to no agent")
            delta = control_delta(control)
            eid = event_id(scope.epoch, k1, "counter-delta", ordinal)
            ordinal += 1
            events.append(TaskEvent(eid, "arena.counter-delta", k1, agent_id,
                                    typed(EVENT, {"delta": delta, "counter": new_counter})))
            rewards[agent_id].append(Reward(eid, "counter-delta", float(delta)))
            total += delta
            if delta != 0 and new_counter % MILESTONE_EVERY == 0:
                stimulations[agent_id].append(Stimulus(
                    event_id(scope.epoch, k1, "milestone", ordinal), "arena.milestone",
                    MILESTONE_MS))
        if new_counter != old_counter + total:
            raise DomainError("BACKEND_FAILURE",
                              f"the counter moved {old_counter} -> {new_counter}; the controls "
                              f"add {total}", "unknown")
        self.counter = new_counter
        self.transitions += 1
        self.total_reward += float(total)
        episode = None
        if self.terminal.reached(new_counter, self.transitions):
            episode = EpisodeRequest(EPISODE_REASON, typed(EPISODE, {
                "counter": new_counter, "transitions": self.transitions}))
        agents = self._agents()
        shared = context(k1, boot=False)  # every agent's, the same immutable value
        return Evaluation(
            outcomes={a: AgentOutcome(tuple(rewards[a]), tuple(stimulations[a])) for a in agents},
            next_contexts=dict.fromkeys(agents, shared),
            progress=self.progress(), events=tuple(events), episode=episode)

    def progress(self) -> TypedValue:
        return typed(PROGRESS, {"counter": self.counter, "transitions": self.transitions,
                                "totalReward": self.total_reward})

    def evaluations(self) -> int:
        return self._evaluations

    def minted_ids(self, epoch: str, step: int) -> list[str]:
        return [event_id(epoch, step, rule, o) for rule in RULES
                for o in range(2 * self.max_agents + 1)]

    def capture(self) -> bytes:
        return canonical({
            "format": CAPTURE_FORMAT,
            "bindings": [[p, a] for p, a in self.ports.items()],
            "counter": self.counter,
            "transitions": self.transitions,
            "totalReward": self.total_reward,
            "evaluations": str(self._evaluations),
        })

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`; all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        keys = {"format", "bindings", "counter", "transitions", "totalReward", "evaluations"}
        try:
            doc = parse_strict(payload)
            if not isinstance(doc, dict) or set(doc) != keys or doc["format"] != CAPTURE_FORMAT:
                raise DomainError.invalid("not a counter-task-v1 state")
            bindings = doc["bindings"]
            if not isinstance(bindings, list) or not all(
                    isinstance(b, list) and len(b) == 2 and all(isinstance(x, str) for x in b)
                    for b in bindings):
                raise DomainError.invalid("bindings must be [[portId, agentId], ...]")
            counter = parse_int(doc["counter"], "counter", -_SAFE_INT, _SAFE_INT)
            transitions = parse_int(doc["transitions"], "transitions", 0, _SAFE_INT)
            total_reward = parse_finite(doc["totalReward"], "totalReward")
            evaluations = parse_u64(doc["evaluations"], "evaluations")
        except DomainError as exc:
            raise DomainError.before("INCOMPATIBLE_STATE",
                                     f"counter task state: {exc.message}") from None
        self.ports = {p: a for p, a in bindings}
        self.counter = counter
        self.transitions = transitions
        self.total_reward = total_reward
        self._evaluations = evaluations
