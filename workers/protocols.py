"""Plugin protocols: `AgentModel`, `World`, `Task`, `ActionExecutor` (session.md §4.1).

Why: users put their own model and world behind the session's guarantees by implementing these
and naming the class by import path in the run spec; the synthetic classes implement the same
protocols. The worker shell owns dedup, phases, scope checks, clocks, media checks and faults, so
a plugin only implements the model. Models are not thread-safe: the shell calls them only under
its endpoint lock.

Values are the frozen dataclasses of `workers.datatypes` (§1.8); this module adds the records
§4.1 names that are not wire types of §1.8: `DecodedView`, `ControllerIntent`, `TaskEvent`,
`AgentOutcome`, `Bootstrap`, `Evaluation`, `EpisodeRequest`.

Resolved ambiguities:
- `Task.bootstrap(inspection, bindings)` carries no epoch, yet the bootstrap event id is minted
  from one: a task learns its epoch at construction (the synthetic `CounterTask(epoch=...)`).
- `bindings` everywhere is a sequence of `(portId, agentId)` pairs, as in
  `Environment.Initialize.portBindings`.
- `encode` receives `DecodedView`s: the view id, its producing step and the RGBA8 bytes that
  `workers.datatypes.decode_view` returned.
- A world's `engineFrame` is not part of `World`; a world may offer `engine_frame(boundary)`
  (the counter arena does), otherwise the shell reports null.
- Model and world `config` objects are the run spec's `modelConfig` / `config` (JSON objects).
- A model or world class may declare `inline_calls: ClassVar[bool] = True` when every call is
  short pure-Python work (the synthetic classes do): the shell then runs its calls on the
  worker's event loop instead of handing each one to the model thread and back, which costs
  two thread wake-ups per call on the step's critical path. Such calls have no
  `MODEL_CALL_TIMEOUT_S` deadline and the loop answers nothing else while one runs. Absent or
  false, the model thread is used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from workers.datatypes import (
    AssetRef,
    AxisValue,
    ButtonState,
    EnvironmentDescriptor,
    Graph,
    PortControl,
    Reward,
    Stimulus,
    Telemetry,
    TypedValue,
)
from workers.domain import DomainError, Scope, format_u64, parse_id, parse_u64
from workers.ticks import RationalNs

__all__ = [
    "ActionExecutor",
    "AgentModel",
    "AgentOutcome",
    "Binding",
    "Bootstrap",
    "ControllerIntent",
    "DecodedView",
    "EpisodeRequest",
    "Evaluation",
    "Task",
    "TaskEvent",
    "World",
]

Binding = tuple[str, str]
"""`(portId, agentId)`."""


@dataclass(frozen=True, slots=True)
class DecodedView:
    """A sensory view whose media passed `decode_view`: id, producing step, RGBA8 bytes."""

    view_id: str
    produced_step: int
    pixels: bytes


@dataclass(frozen=True, slots=True)
class ControllerIntent:
    """What an executor wants pressed: a `PortControl` without its `portId`."""

    buttons: tuple[ButtonState, ...]
    axes: tuple[AxisValue, ...]

    @classmethod
    def from_json(cls, value: Any, what: str = "intent") -> ControllerIntent:
        if not isinstance(value, dict) or set(value) != {"buttons", "axes"}:
            raise DomainError.invalid(f"{what} must be an object with exactly buttons and axes")
        control = PortControl.from_json({"portId": "intent", **value}, what)
        return cls(control.buttons, control.axes)

    def for_port(self, port_id: str) -> PortControl:
        return PortControl(port_id, self.buttons, self.axes)

    def to_json(self) -> dict[str, Any]:
        return {"buttons": [b.to_json() for b in self.buttons],
                "axes": [a.to_json() for a in self.axes]}


@dataclass(frozen=True, slots=True)
class TaskEvent:
    """`{id, kindId, sourceStep: U64, agentId | null, payload: TypedValue}`."""

    id: str
    kind_id: str
    source_step: int
    agent_id: str | None
    payload: TypedValue

    @classmethod
    def from_json(cls, value: Any, what: str = "event") -> TaskEvent:
        keys = {"id", "kindId", "sourceStep", "agentId", "payload"}
        if not isinstance(value, dict) or set(value) != keys:
            raise DomainError.invalid(f"{what} must have exactly {', '.join(sorted(keys))}")
        agent = value["agentId"]
        return cls(parse_id(value["id"], f"{what}.id"),
                   parse_id(value["kindId"], f"{what}.kindId"),
                   parse_u64(value["sourceStep"], f"{what}.sourceStep"),
                   None if agent is None else parse_id(agent, f"{what}.agentId"),
                   TypedValue.from_json(value["payload"], f"{what}.payload"))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kindId": self.kind_id,
                "sourceStep": format_u64(self.source_step), "agentId": self.agent_id,
                "payload": self.payload.to_json()}


@dataclass(frozen=True, slots=True)
class EpisodeRequest:
    """A task's request to end the episode (its terminal condition was reached)."""

    reason: str
    outcome: TypedValue


@dataclass(frozen=True, slots=True)
class AgentOutcome:
    """What one agent receives at Commit for one transition."""

    rewards: tuple[Reward, ...] = ()
    stimulations: tuple[Stimulus, ...] = ()


@dataclass(frozen=True, slots=True)
class Bootstrap:
    """The task's start: one decision context per bound agent, initial progress, events."""

    contexts: dict[str, TypedValue]
    progress: TypedValue
    events: tuple[TaskEvent, ...]


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The task's verdict on one transition; every agent has an outcome and a next context."""

    outcomes: dict[str, AgentOutcome]
    next_contexts: dict[str, TypedValue]
    progress: TypedValue
    events: tuple[TaskEvent, ...]
    episode: EpisodeRequest | None


@runtime_checkable
class AgentModel(Protocol):
    """One simulated brain. Class methods serve the coordinator without an instance."""

    capabilities: ClassVar[tuple[str, ...]]
    """Extras beyond `agent-step-v1`."""

    @classmethod
    def profile(cls, agent_id: str, tick: RationalNs, warmup_ticks: int,
                config: Mapping[str, Any]) -> AssetRef: ...

    @classmethod
    def graph(cls, agent_id: str, config: Mapping[str, Any]) -> Graph: ...

    @classmethod
    def check_context(cls, context: TypedValue) -> None:
        """Raise `DomainError` (mutation `none`) for a context this model cannot use."""
        ...

    @classmethod
    def encode(cls, views: Sequence[DecodedView], structured: TypedValue | None) -> Any:
        """Pure: the model's input from decoded views and optional structured data."""
        ...

    def __init__(self, *, agent_id: str, seed: int, threads: int, executor: Executor,
                 config: Mapping[str, Any]) -> None: ...

    def install_input(self, encoded: Any) -> None: ...

    def advance(self, ticks: int) -> None: ...

    def stimulate(self, stimulus: Stimulus) -> None: ...

    def decide(self, context: TypedValue) -> TypedValue:
        """Pure read of the current state."""
        ...

    def reinforce(self, signal: float) -> None: ...

    def set_learning(self, enabled: bool) -> None: ...

    def telemetry(self, brain_ticks: int) -> Telemetry: ...

    def mutations(self) -> int:
        """Monotonic count of state mutations (the agent's progress counter)."""
        ...

    def capture(self) -> bytes: ...

    def restore(self, payload: bytes) -> None: ...


@runtime_checkable
class World(Protocol):
    """The shared environment; `apply` is exactly one step."""

    capabilities: ClassVar[tuple[str, ...]]
    """Extras beyond `world-step-v1`."""

    def __init__(self, *, world_id: str, ports: Sequence[str], step: RationalNs,
                 observation_delay_steps: int, threads: int,
                 config: Mapping[str, Any]) -> None: ...

    def config_asset(self) -> AssetRef: ...

    def descriptor(self) -> EnvironmentDescriptor: ...

    def reset(self, episode_id: str, bindings: Sequence[Binding]) -> None: ...

    def apply(self, controls: Sequence[PortControl]) -> None: ...

    def inspection(self, boundary: int) -> TypedValue: ...

    def render(self, view_id: str, boundary: int) -> bytes: ...

    def audio(self, stream_id: str, frames: int) -> bytes:
        """`frames·channels·4` bytes of little-endian f32 interleaved samples."""
        ...

    def capture(self) -> bytes: ...

    def restore(self, payload: bytes) -> None: ...


@runtime_checkable
class Task(Protocol):
    """Coordinator-local rules of the episode; never a bus service."""

    def bootstrap(self, inspection: TypedValue, bindings: Sequence[Binding]) -> Bootstrap: ...

    def evaluate_transition(self, scope: Scope, old: TypedValue, new: TypedValue,
                            controls: Sequence[PortControl]) -> Evaluation: ...

    def progress(self) -> TypedValue: ...

    def evaluations(self) -> int: ...

    def minted_ids(self, epoch: str, step: int) -> list[str]:
        """Every event id the task could mint at `step` of `epoch` (trace rebasing, §6.12)."""
        ...

    def capture(self) -> bytes: ...

    def restore(self, payload: bytes) -> None: ...


@runtime_checkable
class ActionExecutor(Protocol):
    """Turns an agent's decision into the controller intent for its port."""

    def apply(self, scope: Scope, decision: TypedValue, game_state: TypedValue,
              progress: TypedValue, clock: RationalNs) -> ControllerIntent: ...
