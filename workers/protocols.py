"""Plugin protocols: `AgentModel`, `World`, `Task`, `ActionExecutor` (design/session.md §4.1).

Why: users put their own model and world behind the session's guarantees by implementing these
and naming the class by import path in the run spec; the synthetic classes implement the same
protocols. The worker shell owns dedup, phases, scope checks, clocks, media checks and faults, so
a plugin only implements the model. Models are not thread-safe: the shell calls them only under
its endpoint lock.

Values are the frozen dataclasses of `workers.types.datatypes` (design/session.md §1.8); this module
adds the records design/session.md §4.1 names that are not wire types of design/session.md §1.8:
`DecodedView`, `ControllerIntent`, `TaskEvent`, `AgentOutcome`, `Bootstrap`, `Evaluation`,
`EpisodeRequest`.

Resolved ambiguities:
- `Task.bootstrap(inspection, bindings)` carries no epoch, yet the bootstrap event id is minted
  from one: a task learns its epoch at construction (the synthetic `CounterTask(epoch=...)`).
- `bindings` everywhere is a sequence of `(portId, agentId)` pairs, as in
  `Environment.Initialize.portBindings`.
- `encode` receives `DecodedView`s: the view id, its producing step and the RGBA8 bytes that
  `workers.types.datatypes.decode_view` returned.
- A world's `engineFrame` is not part of `World`; a world may offer `engine_frame(boundary)`
  (the counter arena does), otherwise the shell reports null.
- Model and world `config` objects are the run spec's `modelConfig` / `config` (JSON objects).
- A task is built as `Task(config=task.config, terminal=task.terminal, max_agents=[session]
  max_agents, epoch=the session epoch)`. `terminal` is a string in the task's own grammar: the
  run spec checks it is a short string (and, for the synthetic `CounterTask`, its grammar
  `never | counter:N | after:N` through the class's static `check_terminal(terminal)`, so the
  spec needs no task's types); any other task refuses a terminal it cannot parse in its
  constructor with `DomainError.invalid`. Every task should accept `never`.
- An executor is built as `ActionExecutor(config=executor.config)` and names the one schema its
  decisions must have (`decision_schema`); the coordinator checks every prepared decision
  against it (`IDENTITY_MISMATCH` otherwise), so the decision format is the executor's.
- Structured input: a world whose class lists `STRUCTURED_OBSERVATION` in its `capabilities`
  has its inspection of boundary b handed to every agent as the `structured` part of the
  sensory input of b (`Agent.Initialize.initialInput`, `Agent.Commit.nextInput`); the model's
  `encode(views, structured)` receives it. Without the capability `structured` is null, as
  before. The inspection is not delayed like views (`observationDelaySteps`).
- Per-agent input: a world listing `PER_AGENT_INPUT` also has
  `agent_input(port_id, boundary) -> tuple[TypedValue | None, Sequence[AgentArray]]`; each
  agent then receives only its own port's value and arrays (the inspection stays the task's).
  The arrays travel as binary (`workers.types.datatypes.ArrayValue`: inline up to the launch's
  `media_inline_max_bytes`, by reference above it) and reach a model listing `ARRAY_INPUT` as
  `encode(views, structured, arrays)`, in the order the world gave them.
- Required attributes (`MODEL_ATTRIBUTES`, `WORLD_ATTRIBUTES`, `TASK_ATTRIBUTES`,
  `EXECUTOR_ATTRIBUTES`) are checked when a worker starts (model, world) or the coordinator is
  built (task, executor): `check_plugin` raises `PluginContractError` naming the class and the
  first missing attribute. A model's `model_version` and `plasticity_version` must be present:
  checkpoints record them as the model's identity, and a node captures every run at least at
  its end. A class that sets both to `None` explicitly opts out of checkpointing (its worker
  lacks `checkpoint-v1`; tests use this), which no node-run model should do.
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
from typing import Any, ClassVar, Final, Protocol, runtime_checkable

from workers.types.datatypes import (
    AssetRef,
    AxisValue,
    ButtonState,
    EnvironmentDescriptor,
    Graph,
    PortControl,
    Reward,
    SchemaRef,
    Stimulus,
    Telemetry,
    TypedValue,
)
from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    PluginFault,
    PluginStage,
    Scope,
    format_u64,
    parse_id,
    parse_u64,
)
from workers.types.ticks import RationalNs

__all__ = [
    "ARRAY_INPUT",
    "EXECUTOR_ATTRIBUTES",
    "MODEL_ATTRIBUTES",
    "PER_AGENT_INPUT",
    "STRUCTURED_OBSERVATION",
    "TASK_ATTRIBUTES",
    "WORLD_ATTRIBUTES",
    "ActionExecutor",
    "AgentArray",
    "AgentModel",
    "AgentOutcome",
    "Binding",
    "Bootstrap",
    "ControllerIntent",
    "DecodedArray",
    "DecodedView",
    "EpisodeRequest",
    "Evaluation",
    "PluginContractError",
    "Task",
    "TaskEvent",
    "World",
    "check_plugin",
]

STRUCTURED_OBSERVATION: Final = "structured-observation-v1"
"""A world capability: its inspection is every agent's structured sensory input."""
PER_AGENT_INPUT: Final = "per-agent-input-v1"
"""A world capability: each agent's structured input is its own, from the world's
`agent_input(port_id, boundary)` (an `AgentInput` of the observation), not the inspection."""
ARRAY_INPUT: Final = "array-input-v1"
"""A model capability: its `encode(views, structured, arrays)` takes the input's binary
arrays (`DecodedArray`s); a model without it refuses an input that carries arrays."""

Binding = tuple[str, str]
"""`(portId, agentId)`."""


@dataclass(frozen=True, slots=True)
class DecodedView:
    """A sensory view whose media passed `decode_view`: id, producing step, RGBA8 bytes."""

    view_id: str
    produced_step: int
    pixels: bytes


@dataclass(frozen=True, slots=True)
class AgentArray:
    """A numeric array a world gives an agent: numpy's dtype string, the shape and the C-order
    bytes (`workers.types.datatypes.ArrayValue` once staged)."""

    id: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes
    #: the SHA-256 of `data` when the world already has it (it is then not hashed again)
    digest: str | None = None


@dataclass(frozen=True, slots=True)
class DecodedArray:
    """An input's array whose bytes passed `decode_array`."""

    id: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes


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

    model_version: ClassVar[str]
    """The model's state format; checkpoints record it (a restore refuses another)."""

    plasticity_version: ClassVar[str]
    """The model's learning rule; checkpoints record it (a restore refuses another)."""

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

    def render(self, view_id: str, boundary: int) -> bytes | None:
        """The view's RGBA8 frame of `boundary`, or None when it is the frame of the previous
        boundary again (never at boundary 0): the endpoint serves that frame once more, so a
        world that redraws only every K boundaries skips the others' renders."""
        ...

    def audio(self, stream_id: str, frames: int) -> bytes:
        """`frames·channels·4` bytes of little-endian f32 interleaved samples."""
        ...

    def capture(self) -> bytes: ...

    def restore(self, payload: bytes) -> None: ...


@runtime_checkable
class Task(Protocol):
    """Coordinator-local rules of the episode; never a bus service."""

    def __init__(self, *, config: Mapping[str, Any], terminal: str, max_agents: int,
                 epoch: str) -> None:
        """`terminal` in the task's own grammar (`DomainError.invalid` when unparsable);
        `max_agents` bounds `minted_ids`; `epoch` mints the bootstrap event ids."""
        ...

    def bootstrap(self, inspection: TypedValue, bindings: Sequence[Binding]) -> Bootstrap: ...

    def evaluate_transition(self, scope: Scope, old: TypedValue, new: TypedValue,
                            controls: Sequence[PortControl]) -> Evaluation: ...

    def progress(self) -> TypedValue: ...

    def evaluations(self) -> int: ...

    def minted_ids(self, epoch: str, step: int) -> list[str]:
        """Every event id the task could mint at `step` of `epoch` (trace rebasing,
        design/session.md §6.12)."""
        ...

    def capture(self) -> bytes: ...

    def restore(self, payload: bytes) -> None: ...


@runtime_checkable
class ActionExecutor(Protocol):
    """Turns an agent's decision into the controller intent for its port."""

    decision_schema: ClassVar[SchemaRef]
    """The schema every decision must have; the coordinator refuses any other."""

    def __init__(self, *, config: Mapping[str, Any]) -> None: ...

    def apply(self, scope: Scope, decision: TypedValue, game_state: TypedValue,
              progress: TypedValue, clock: RationalNs) -> ControllerIntent: ...


#: what each kind of plugin class must have, with why (the message of a missing one)
MODEL_ATTRIBUTES: Final[dict[str, str]] = {
    "model_version": "a str class attribute naming the model's state format (checkpoints "
                     "record it as the model's identity)",
    "plasticity_version": "a str class attribute naming the model's learning rule (checkpoints "
                          "record it as the model's identity)",
    **{name: "a classmethod of AgentModel" for name in
       ("profile", "graph", "check_context", "encode")},
    **{name: "a method of AgentModel" for name in
       ("install_input", "advance", "stimulate", "decide", "reinforce", "set_learning",
        "telemetry", "mutations", "capture", "restore")},
}
WORLD_ATTRIBUTES: Final[dict[str, str]] = {
    name: "a method of World" for name in
    ("config_asset", "descriptor", "reset", "apply", "inspection", "render", "audio", "capture",
     "restore")}
TASK_ATTRIBUTES: Final[dict[str, str]] = {
    name: "a method of Task" for name in
    ("bootstrap", "evaluate_transition", "progress", "evaluations", "minted_ids", "capture",
     "restore")}
EXECUTOR_ATTRIBUTES: Final[dict[str, str]] = {
    "decision_schema": "a SchemaRef class attribute: the schema of the decisions it applies",
    "apply": "a method of ActionExecutor",
}
_VERSIONS: Final = ("model_version", "plasticity_version")
_MISSING: Final = object()


class PluginContractError(DomainError):
    """A plugin class lacks what its protocol requires: `INVALID_ARGUMENT`/`none` naming the
    import path, the attribute and what it must be."""

    def __init__(self, kind: str, path: str, attribute: str, reason: str) -> None:
        message = f"{kind} {path}: the class lacks {attribute} ({reason})"
        # the class is the same on every attempt: the fault repeats
        super().__init__(ErrorCode.INVALID_ARGUMENT, message, Mutation.NONE,
                         PluginFault(path, PluginStage.ATTRIBUTE, "PluginContractError",
                                     message, (), True))
        self.kind = kind
        self.path = path
        self.attribute = attribute


def check_plugin(cls: type[Any], kind: str, path: str, required: Mapping[str, str]) -> None:
    """Raise `PluginContractError` for the first attribute of `required` that `cls` lacks
    (a method must be callable; a model's versions must be str, or both `None` to opt out of
    checkpointing; an executor's `decision_schema` a `SchemaRef`)."""
    for attribute, reason in required.items():
        value = getattr(cls, attribute, _MISSING)
        if value is _MISSING:
            raise PluginContractError(kind, path, attribute, reason)
        if attribute in _VERSIONS:
            versions = [getattr(cls, name, None) for name in _VERSIONS]
            if versions != [None, None] and not isinstance(value, str):
                raise PluginContractError(kind, path, attribute, reason)
        elif attribute == "decision_schema":
            if not isinstance(value, SchemaRef):
                raise PluginContractError(kind, path, attribute, reason)
        elif not callable(value):
            raise PluginContractError(kind, path, attribute, reason)

