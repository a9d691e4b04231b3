"""The run spec: normalisation, validation and the fault grammar (design/session.md §4.9, §4.10).

Why: a run is a JSON document stored in PostgreSQL and claimed by any node, so the document must
have one canonical form (every default filled, lists sorted: equal specs compare equal under
`submit_key`) and one validator that the submitters and the claiming node share. Pure: no I/O
except `importlib.util.find_spec` when the node asks for its import-path check.

Every refusal is a `RunSpecError` (`INVALID_ARGUMENT`/`none`) carrying the JSON Pointer `path` of
the offending field and a `reason`; its message names both, and `outcome()` is the node's
`{error: "invalid run spec", path, reason}`. A malformed `--fault SPEC` is a `FaultSpecError`
(`INVALID_ARGUMENT`/`none`) naming the spec.

Resolved ambiguities:
- `normalise` validates too (it cannot fill defaults into a malformed document); it checks the
  agent count against the caller's `max_agents` (default 256, the range's top, so a submitter
  without a node configuration refuses nothing a node could accept).
- Step-addressed faults must name an existing transition: a step K in `0..steps−1`, a boundary B
  in `1..steps`. For an import (`startFrom` set) `steps` counts above the imported boundary,
  which the pure validator does not know: pass `start_boundary` to check `[b, b+steps)`, else
  only the lower bounds are checked.
- Boolean fault knobs accept `null` as "unset" and normalise to `false`; numeric knobs normalise
  to `null`. `*DelayMs` values are JSON integers in 0..2^53−1 (milliseconds), steps and
  boundaries U64 strings, `acknowledgeExtraId` a `RequestId` other than `req-0`.
- Duplicate `injections.kill` entries (same worker and step) and duplicate
  `loseAdvanceResultAt` steps are refused, as a knob given twice is; `kill` is sorted by step,
  then worker.
- "Ports declared by the world" (design/session.md §7.2) cannot be checked from the document: the
  counter arena declares exactly the agents' ports; a plugin world's descriptor is checked at
  bootstrap.
- `terminal` is in the task's own grammar (`workers.protocols`): the spec checks it is a string
  of 1..200 printable ASCII characters, and for the synthetic task
  (`workers.synthetic:CounterTask`) its grammar (`never`, `counter:N` signed, `after:N` U64),
  asked of the task class's `check_terminal` so the spec imports no task's types; another task
  refuses a terminal it cannot parse when it is built.
- `executor` (`{impl, config}`, default `workers.synthetic:IdentityExecutor` and `{}`) names the
  `ActionExecutor` that turns decisions into controls; its `decision_schema` is the format every
  agent's decisions must have. The key is part of the normalised form like every other.
- `--fault` specs merged into a spec (`RunSpec.with_faults`) refuse a knob the spec already sets,
  and a value the spec's rules refuse (e.g. a step beyond `steps`) names the fault spec.
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, TypeVar

import orjson

from flyd.durations import DURATION_RULE, MAX_DURATION_S, is_duration_s
from flyd.pgtext import bad_strings, text_problem
from workers.composition import derive_seed
from workers.faults import KNOBS, Faults, Knob, Role, camel_case, role_fields, role_knobs
from workers.types.canonical import canonical
from workers.types.domain import (
    DomainError,
    parse_bool,
    parse_digest,
    parse_i32,
    parse_id,
    parse_int,
    parse_request_id,
    parse_u64,
    parse_worker_id,
)
from workers.types.ticks import RationalNs

__all__ = [
    "DEFAULT_MAX_AGENTS",
    "AgentSpec",
    "ExecutorSpec",
    "FaultSpec",
    "FaultSpecError",
    "InjectionSpec",
    "KillAt",
    "KillFault",
    "KnobFault",
    "LoseAdvanceResultFault",
    "RunSpec",
    "RunSpecError",
    "StartFrom",
    "TaskSpec",
    "WorldSpec",
    "check_storable",
    "is_import_path",
    "parse_fault",
    "parse_faults",
]

SPEC_VERSION: Final = 1
#: a spec's compact JSON encoding (UTF-8) is at most this many bytes (docs/configuration.md)
MAX_SPEC_BYTES: Final = 1 << 20
#: object keys in the whole document, every nested config included
MAX_SPEC_KEYS: Final = 65_536
#: nesting of objects and arrays
MAX_SPEC_DEPTH: Final = 64
DEFAULT_MAX_AGENTS: Final = 4
MAX_AGENTS_LIMIT: Final = 256
MAX_THREADS: Final = 256
MAX_OBSERVATION_DELAY: Final = 8
MAX_SAFE: Final = 2**53 - 1
MODES: Final = ("process", "thread", "in-process")
DISPATCHES: Final = ("concurrent", "sequential", "reversed")
PACINGS: Final = ("off", "realtime")
DEFAULT_MODEL: Final = "workers.synthetic:FakeBrain"
DEFAULT_WORLD: Final = "workers.synthetic:CounterArena"
DEFAULT_TASK: Final = "workers.synthetic:CounterTask"
DEFAULT_EXECUTOR: Final = "workers.synthetic:IdentityExecutor"
DEFAULT_TICK: Final = RationalNs(1_000_000, 1)
DEFAULT_STEP: Final = RationalNs(50_000_000, 3)
DEFAULT_AGENTS: Final = (("fly-a", "p1", 7), ("fly-b", "p2", 11))
#: the adapters' worlds and their task (docs/adapters.md): an adapter world's default task is
#: `ADAPTER_TASK`, and the two do not pair with any other world or the synthetic task
ADAPTER_WORLDS: Final = frozenset({"workers.adapters.pettingzoo:ParallelEnvWorld",
                                   "workers.adapters.gymnasium:EnvWorld"})
ADAPTER_TASK: Final = "workers.adapters.pettingzoo:EnvTask"

TOP_KEYS: Final = ("specVersion", "sessionId", "episodeId", "steps", "seed", "mode", "dispatch",
                   "pacing", "paceS", "exclusiveToSubmitter", "agentsPerProcess", "agents",
                   "world", "task", "executor", "checkpoints", "injections", "startFrom")
AGENT_KEYS: Final = ("agentId", "portId", "model", "modelConfig", "seed", "tick", "warmupTicks",
                     "threads", "faults")
WORLD_KEYS: Final = ("worldId", "impl", "config", "step", "observationDelaySteps", "threads",
                     "faults")
TASK_KEYS: Final = ("impl", "config", "terminal")
EXECUTOR_KEYS: Final = ("impl", "config")
_TERMINAL: Final = re.compile(r"[!-~]{1,200}")
INJECTION_KEYS: Final = ("kill", "loseAdvanceResultAt")
KILL_KEYS: Final = ("worker", "step")
START_KEYS: Final = ("checkpointId", "envelopeDigest")

_INT: Final = "int"
_NUMBER: Final = "number"
#: camelCase key → (kind, low, high, exclusive low); the `[checkpoints]` keys of
#: design/state.md §5.1.
CHECKPOINT_KEYS: Final[dict[str, tuple[str, float, float, bool]]] = {
    "everySteps": (_INT, 0, MAX_SAFE, False),
    "everySeconds": (_NUMBER, 0, MAX_DURATION_S, False),
    "keepGenerations": (_INT, 1, 100, False),
    "queueCapacity": (_INT, 1, 16, False),
    "maxQueuedBytes": (_INT, 2**20, 2**30, False),
    "retry": ("retry", 0, 0, False),
    "retryAttempts": (_INT, 1, 10, False),
    "retryBackoffS": (_NUMBER, 0, MAX_DURATION_S, True),
    "durableTimeoutS": (_NUMBER, 0, MAX_DURATION_S, True),
    "recoveryMaxAttempts": (_INT, 1, 100, False),
    "recoveryBackoffS": (_NUMBER, 0, MAX_DURATION_S, True),
    "recoveryBackoffMaxS": (_NUMBER, 0, MAX_DURATION_S, True),
    "maxPendingEffects": (_INT, 1, MAX_SAFE, False),
    "maxPendingEffectBytes": (_INT, 2**20, MAX_SAFE, False),
    "maxEnvelopeBytes": (_INT, 2**20, 2**30 - 1, False),
}
RETRY_POLICIES: Final = ("release", "retry")

_IMPORT_PATH: Final = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
    r"(\.[A-Za-z_][A-Za-z0-9_]*)*")
_U64_TEXT: Final = re.compile(r"0|[1-9][0-9]{0,19}")

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Size and text: refused before any field is read, the same at submit and at claim


def check_storable(doc: Any) -> None:
    """`RunSpecError` for a document PostgreSQL cannot store as given (a string with NUL or a
    lone surrogate, `flyd.pgtext`) or over the limits: `MAX_SPEC_DEPTH`, `MAX_SPEC_KEYS`,
    `MAX_SPEC_BYTES`. The walk stops at the first limit, so a document of millions of keys
    costs no more than one at the limit."""
    keys = 0
    stack: list[tuple[Any, int, str]] = [(doc, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict | list):
            if depth >= MAX_SPEC_DEPTH:
                where = path if text_problem(path) is None else ""
                raise RunSpecError(where, f"nested deeper than {MAX_SPEC_DEPTH} levels")
            if isinstance(value, dict):
                keys += len(value)
                if keys > MAX_SPEC_KEYS:
                    raise RunSpecError("", f"a run spec has at most {MAX_SPEC_KEYS} object keys "
                                           "in all")
                items: Iterable[tuple[Any, Any]] = value.items()
            else:
                items = enumerate(value)
            stack.extend((item, depth + 1, _ptr(path, key)) for key, item in items)
    for path, problem in bad_strings(doc):
        raise RunSpecError(path, problem)
    try:
        size = len(orjson.dumps(doc))
    except (orjson.JSONEncodeError, TypeError):
        return  # not JSON at all: the field rules name what is wrong
    if size > MAX_SPEC_BYTES:
        raise RunSpecError("", f"a run spec is at most {MAX_SPEC_BYTES} bytes of JSON "
                               f"({MAX_SPEC_BYTES >> 20} MiB); this one is {size}")


# --------------------------------------------------------------------------------------------
# Errors


class RunSpecError(DomainError):
    """An invalid run spec: `INVALID_ARGUMENT`/`none` with the JSON Pointer of the field."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__("INVALID_ARGUMENT", f"run spec {path or '/'}: {reason}", "none")
        self.path = path
        self.reason = reason

    def outcome(self) -> dict[str, str]:
        """The run's outcome when a node refuses the spec (design/distribution.md §3.5)."""
        return {"error": "invalid run spec", "path": self.path, "reason": self.reason}


class FaultSpecError(DomainError):
    """A malformed `--fault` spec: `INVALID_ARGUMENT`/`none` naming the spec."""

    def __init__(self, spec: str, reason: str) -> None:
        super().__init__("INVALID_ARGUMENT", f"fault spec {spec!r}: {reason}", "none")
        self.spec = spec
        self.reason = reason


def _ptr(path: str, key: str | int) -> str:
    """Append one JSON Pointer token (RFC 6901 escaping)."""
    token = str(key).replace("~", "~0").replace("/", "~1")
    return f"{path}/{token}"


def _at(path: str, parse: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a domain scalar parser; its refusal becomes a `RunSpecError` at `path`."""
    try:
        return parse(*args, **kwargs)
    except DomainError as exc:
        raise RunSpecError(path, exc.message) from None


def _object(value: Any, path: str, keys: Collection[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RunSpecError(path, "must be an object")
    for key in value:
        if key not in keys:
            raise RunSpecError(_ptr(path, key), f"unknown key {key!r}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise RunSpecError(path, "must be a list")
    return value


def _choice(value: Any, path: str, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise RunSpecError(path, f"must be one of {', '.join(choices)}; got {value!r}")
    return value


def _worker_id(value: Any, path: str, what: str) -> str:
    return _at(path, parse_worker_id, value, what)


def is_import_path(value: object) -> bool:
    """Whether `value` is an import path `package.module:Class` (as a spec's `model`, `impl`)."""
    return isinstance(value, str) and _IMPORT_PATH.fullmatch(value) is not None


def _import_path(value: Any, path: str) -> str:
    if not isinstance(value, str) or not is_import_path(value):
        raise RunSpecError(path, f"must be an import path package.module:Class; got {value!r}")
    return value


def _config(value: Any, path: str) -> dict[str, Any]:
    """A free-form JSON object (model, world or task config)."""
    if not isinstance(value, dict):
        raise RunSpecError(path, "must be an object")
    _at(path, canonical, value)
    return value


def spec_u64(value: Any, what: str = "value") -> int:
    """A U64 of the spec: the canonical decimal string, or a JSON integer ≥ 0 (what a person
    writes: `"steps": 50`); the normalised spec writes it back as the string."""
    if type(value) is int and value >= 0:
        value = str(value)
    return parse_u64(value, what)


def _duration(value: Any, path: str, what: str) -> RationalNs:
    if isinstance(value, dict):
        value = {k: str(v) if type(v) is int and v >= 0 else v for k, v in value.items()}
    duration = _at(path, RationalNs.from_json, value, what)
    if duration.numerator == 0:
        raise RunSpecError(path, f"{what} must be greater than zero")
    return duration


# --------------------------------------------------------------------------------------------
# Parts


@dataclass(frozen=True)
class AgentSpec:
    """`agents[]`: one agent worker."""

    agent_id: str
    port_id: str
    model: str = DEFAULT_MODEL
    model_config: Mapping[str, Any] = field(default_factory=dict)
    seed: int | None = None
    tick: RationalNs = DEFAULT_TICK
    warmup_ticks: int = 10
    threads: int = 1
    faults: Faults = field(default_factory=Faults)

    def to_json(self) -> dict[str, Any]:
        return {"agentId": self.agent_id, "portId": self.port_id, "model": self.model,
                "modelConfig": dict(self.model_config), "seed": self.seed,
                "tick": self.tick.to_json(), "warmupTicks": str(self.warmup_ticks),
                "threads": self.threads, "faults": self.faults.to_json("agent")}


@dataclass(frozen=True)
class WorldSpec:
    """`world`: the environment worker."""

    world_id: str = "arena"
    impl: str = DEFAULT_WORLD
    config: Mapping[str, Any] = field(default_factory=dict)
    step: RationalNs = DEFAULT_STEP
    observation_delay_steps: int = 0
    threads: int = 1
    faults: Faults = field(default_factory=Faults)

    def to_json(self) -> dict[str, Any]:
        return {"worldId": self.world_id, "impl": self.impl, "config": dict(self.config),
                "step": self.step.to_json(),
                "observationDelaySteps": self.observation_delay_steps,
                "threads": self.threads, "faults": self.faults.to_json("environment")}


@dataclass(frozen=True)
class TaskSpec:
    """`task`: the coordinator-local task."""

    impl: str = DEFAULT_TASK
    config: Mapping[str, Any] = field(default_factory=dict)
    terminal: str = "never"

    def to_json(self) -> dict[str, Any]:
        return {"impl": self.impl, "config": dict(self.config), "terminal": self.terminal}


@dataclass(frozen=True)
class ExecutorSpec:
    """`executor`: the coordinator-local action executor."""

    impl: str = DEFAULT_EXECUTOR
    config: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"impl": self.impl, "config": dict(self.config)}


@dataclass(frozen=True, order=True)
class KillAt:
    """`kill:W@K`: kill worker W once every Prepare of step K was dispatched."""

    step: int
    worker: str

    @property
    def fault_id(self) -> str:
        return f"kill:{self.worker}@{self.step}"


@dataclass(frozen=True)
class InjectionSpec:
    """`injections`: node-side injections, sorted by step."""

    kill: tuple[KillAt, ...] = ()
    lose_advance_result_at: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"kill": [{"worker": k.worker, "step": str(k.step)} for k in self.kill],
                "loseAdvanceResultAt": [str(s) for s in self.lose_advance_result_at]}


@dataclass(frozen=True)
class StartFrom:
    """`startFrom`: the imported checkpoint a run starts from."""

    checkpoint_id: str
    envelope_digest: str

    def to_json(self) -> dict[str, str]:
        return {"checkpointId": self.checkpoint_id, "envelopeDigest": self.envelope_digest}


@dataclass(frozen=True)
class _Bounds:
    """Where step-addressed faults may point: steps in [low, high), boundaries in (low, high]."""

    low: int
    high: int | None

    def step(self, value: int, path: str, what: str) -> None:
        if value < self.low or (self.high is not None and value >= self.high):
            top = "" if self.high is None else f"..{self.high - 1}"
            raise RunSpecError(path, f"{what} {value} is not a step of this run ({self.low}{top})")

    def boundary(self, value: int, path: str, what: str) -> None:
        if value <= self.low or (self.high is not None and value > self.high):
            top = "" if self.high is None else f"..{self.high}"
            raise RunSpecError(
                path, f"{what} {value} is not a boundary of this run ({self.low + 1}{top})")


def _faults(value: Any, path: str, role: Role, bounds: _Bounds) -> Faults:
    keys = [camel_case(name) for name in role_fields(role)]
    obj = _object(value, path, keys)
    values: dict[str, Any] = {}
    for knob in role_knobs(role):
        values.update(_knob_value(obj, path, knob, bounds))
    return Faults(**values)


def _knob_value(obj: Mapping[str, Any], path: str, knob: Knob,
                bounds: _Bounds) -> dict[str, Any]:
    camel = knob.camel
    where = _ptr(path, camel)
    raw = obj.get(camel)
    if knob.kind == "flag":
        return {knob.name: False if raw is None else _at(where, parse_bool, raw, camel)}
    if knob.kind == "delay":
        assert knob.at_step is not None
        at_camel = camel_case(knob.at_step)
        at_where = _ptr(path, at_camel)
        ms = None if raw is None else _at(where, parse_int, raw, camel, 0, MAX_SAFE)
        at_raw = obj.get(at_camel)
        at = None if at_raw is None else _at(at_where, spec_u64, at_raw, at_camel)
        if at is not None:
            if ms is None:
                raise RunSpecError(at_where, f"{at_camel} is set without {camel}")
            bounds.step(at, at_where, at_camel)
        return {knob.name: ms, knob.at_step: at}
    if raw is None:
        return {knob.name: None}
    if knob.kind == "request_id":
        return {knob.name: _at(where, parse_request_id, raw, camel)}
    number = _at(where, spec_u64, raw, camel)
    if knob.kind == "step":
        bounds.step(number, where, camel)
    else:
        bounds.boundary(number, where, camel)
    return {knob.name: number}


def _agent(value: Any, path: str, bounds: _Bounds) -> AgentSpec:
    obj = _object(value, path, AGENT_KEYS)
    for key in ("agentId", "portId"):
        if key not in obj:
            raise RunSpecError(_ptr(path, key), f"{key} is required")
    seed = obj.get("seed")
    return AgentSpec(
        agent_id=_worker_id(obj["agentId"], _ptr(path, "agentId"), "agentId"),
        port_id=_at(_ptr(path, "portId"), parse_id, obj["portId"], "portId"),
        model=_import_path(obj.get("model", DEFAULT_MODEL), _ptr(path, "model")),
        model_config=_config(obj.get("modelConfig", {}), _ptr(path, "modelConfig")),
        seed=None if seed is None else _at(_ptr(path, "seed"), parse_i32, seed, "seed"),
        tick=(_duration(obj["tick"], _ptr(path, "tick"), "tick") if "tick" in obj
              else DEFAULT_TICK),
        warmup_ticks=_at(_ptr(path, "warmupTicks"), spec_u64, obj.get("warmupTicks", "10"),
                         "warmupTicks"),
        threads=_at(_ptr(path, "threads"), parse_int, obj.get("threads", 1), "threads", 1,
                    MAX_THREADS),
        faults=_faults(obj.get("faults", {}), _ptr(path, "faults"), "agent", bounds),
    )


def _world(value: Any, path: str, bounds: _Bounds) -> WorldSpec:
    obj = _object(value, path, WORLD_KEYS)
    return WorldSpec(
        world_id=_worker_id(obj.get("worldId", "arena"), _ptr(path, "worldId"), "worldId"),
        impl=_import_path(obj.get("impl", DEFAULT_WORLD), _ptr(path, "impl")),
        config=_config(obj.get("config", {}), _ptr(path, "config")),
        step=(_duration(obj["step"], _ptr(path, "step"), "step") if "step" in obj
              else _natural_step(obj, path)),
        observation_delay_steps=_at(_ptr(path, "observationDelaySteps"), parse_int,
                                    obj.get("observationDelaySteps", 0),
                                    "observationDelaySteps", 0, MAX_OBSERVATION_DELAY),
        threads=_at(_ptr(path, "threads"), parse_int, obj.get("threads", 1), "threads", 1,
                    MAX_THREADS),
        faults=_faults(obj.get("faults", {}), _ptr(path, "faults"), "environment", bounds),
    )


def _natural_step(obj: Mapping[str, Any], path: str) -> RationalNs:
    """The step of a world whose class knows its own (`natural_step(config)`: an adapter
    world's env `dt` or render rate), else `DEFAULT_STEP`. Only the adapters' worlds are asked,
    so validating any other spec imports nothing."""
    impl = obj.get("impl", DEFAULT_WORLD)
    if impl not in ADAPTER_WORLDS:
        return DEFAULT_STEP
    module, _, name = str(impl).partition(":")
    try:
        natural = getattr(importlib.import_module(module), name).natural_step
        step = natural(_config(obj.get("config", {}), _ptr(path, "config")))
    except RunSpecError:
        raise
    except DomainError as exc:
        raise RunSpecError(_ptr(path, "config"), exc.message) from None
    except ImportError as exc:
        raise RunSpecError(_ptr(path, "impl"), f"{impl}: {type(exc).__name__}: {exc} (install "
                                               "the pettingzoo extra)") from None
    return DEFAULT_STEP if step is None else step


def _task(value: Any, path: str, world: WorldSpec) -> TaskSpec:
    obj = _object(value, path, TASK_KEYS)
    adapter_world = world.impl in ADAPTER_WORLDS
    impl = _import_path(obj.get("impl", ADAPTER_TASK if adapter_world else DEFAULT_TASK),
                        _ptr(path, "impl"))
    if (adapter_world and impl == DEFAULT_TASK) or (not adapter_world and impl == ADAPTER_TASK):
        raise RunSpecError(_ptr(path, "impl"), f"task {impl} does not fit world {world.impl}: "
                                               f"an adapter world takes {ADAPTER_TASK} (the "
                                               "default when task.impl is left out)")
    terminal = obj.get("terminal", "never")
    where = _ptr(path, "terminal")
    if impl == DEFAULT_TASK:
        _at(where, _terminal_check(impl), terminal)
    elif not isinstance(terminal, str) or _TERMINAL.fullmatch(terminal) is None:
        raise RunSpecError(where, f"terminal must be 1..200 printable ASCII characters; got "
                                  f"{terminal!r}")
    return TaskSpec(impl=impl, config=_config(obj.get("config", {}), _ptr(path, "config")),
                    terminal=terminal)


def _terminal_check(impl: str) -> Callable[[object], None]:
    """The task class's own terminal check (`check_terminal`, workers.protocols). Only the
    synthetic task is asked, as only the adapters' worlds are asked their step, so validating
    another spec imports nothing."""
    module, _, name = impl.partition(":")
    check: Callable[[object], None] = getattr(importlib.import_module(module), name).check_terminal
    return check


def _executor(value: Any, path: str) -> ExecutorSpec:
    obj = _object(value, path, EXECUTOR_KEYS)
    return ExecutorSpec(impl=_import_path(obj.get("impl", DEFAULT_EXECUTOR), _ptr(path, "impl")),
                        config=_config(obj.get("config", {}), _ptr(path, "config")))


def _checkpoints(value: Any, path: str) -> dict[str, Any]:
    obj = _object(value, path, CHECKPOINT_KEYS)
    out: dict[str, Any] = {}
    for key, (kind, low, high, open_low) in CHECKPOINT_KEYS.items():
        raw = obj.get(key)
        where = _ptr(path, key)
        if raw is None:
            out[key] = None
        elif kind == "retry":
            out[key] = _choice(raw, where, RETRY_POLICIES)
        elif kind == _INT:
            out[key] = _at(where, parse_int, raw, key, int(low), int(high))
        else:
            if isinstance(raw, bool) or not isinstance(raw, int | float) \
                    or not math.isfinite(raw):
                raise RunSpecError(where, f"{key} must be a finite number; got {raw!r}")
            if raw < low or (open_low and raw == low) or raw > high:
                bound = f"> {low:g}" if open_low else f"≥ {low:g}"
                raise RunSpecError(where, f"{key} must be {bound} and {DURATION_RULE}; got "
                                          f"{raw!r}")
            out[key] = raw
    return out


def _injections(value: Any, path: str, workers: Collection[str],
                bounds: _Bounds) -> InjectionSpec:
    obj = _object(value, path, INJECTION_KEYS)
    kills: list[KillAt] = []
    kill_path = _ptr(path, "kill")
    for i, item in enumerate(_list(obj.get("kill", []), kill_path)):
        where = _ptr(kill_path, i)
        entry = _object(item, where, KILL_KEYS)
        for key in KILL_KEYS:
            if key not in entry:
                raise RunSpecError(_ptr(where, key), f"{key} is required")
        worker = _at(_ptr(where, "worker"), parse_id, entry["worker"], "worker")
        if worker not in workers:
            raise RunSpecError(_ptr(where, "worker"),
                               f"kill names {worker}, which is no worker of the composition")
        step = _at(_ptr(where, "step"), spec_u64, entry["step"], "step")
        bounds.step(step, _ptr(where, "step"), "step")
        kill = KillAt(step, worker)
        if kill in kills:
            raise RunSpecError(where, f"{kill.fault_id} is given twice")
        kills.append(kill)
    losses: list[int] = []
    lose_path = _ptr(path, "loseAdvanceResultAt")
    for i, item in enumerate(_list(obj.get("loseAdvanceResultAt", []), lose_path)):
        where = _ptr(lose_path, i)
        step = _at(where, spec_u64, item, "loseAdvanceResultAt")
        bounds.step(step, where, "loseAdvanceResultAt")
        if step in losses:
            raise RunSpecError(where, f"lose-advance-result@{step} is given twice")
        losses.append(step)
    return InjectionSpec(tuple(sorted(kills)), tuple(sorted(losses)))


def _start_from(value: Any, path: str) -> StartFrom | None:
    if value is None:
        return None
    obj = _object(value, path, START_KEYS)
    for key in START_KEYS:
        if key not in obj:
            raise RunSpecError(_ptr(path, key), f"{key} is required")
    return StartFrom(
        _at(_ptr(path, "checkpointId"), parse_id, obj["checkpointId"], "checkpointId"),
        _at(_ptr(path, "envelopeDigest"), parse_digest, obj["envelopeDigest"],
            "envelopeDigest"))


def _default_agents() -> tuple[AgentSpec, ...]:
    """fly-a/p1/seed 7 and fly-b/p2/seed 11 (design/session.md §4.7 defaults)."""
    return tuple(AgentSpec(agent_id=a, port_id=p, seed=s) for a, p, s in DEFAULT_AGENTS)


def _module_exists(import_path: str) -> bool:
    module = import_path.partition(":")[0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# --------------------------------------------------------------------------------------------
# The run spec


@dataclass(frozen=True)
class RunSpec:
    """A validated run spec (design/session.md §4.10); `to_json()` is its normalised, canonical
    form."""

    spec_version: int = SPEC_VERSION
    session_id: str = "demo"
    episode_id: str = "ep1"
    steps: int = 600
    seed: int = 7
    mode: str = "process"
    dispatch: str = "concurrent"
    pacing: str = "off"
    pace_s: float | None = None
    exclusive_to_submitter: bool = False
    #: agents per process in process mode (docs/launcher.md, "Agent hosts"); None: the node's
    #: `[session] agents_per_process`
    agents_per_process: int | None = None
    agents: tuple[AgentSpec, ...] = field(default_factory=lambda: _default_agents())
    world: WorldSpec = WorldSpec()
    task: TaskSpec = TaskSpec()
    executor: ExecutorSpec = ExecutorSpec()
    checkpoints: Mapping[str, Any] = field(
        default_factory=lambda: dict.fromkeys(CHECKPOINT_KEYS))
    injections: InjectionSpec = InjectionSpec()
    start_from: StartFrom | None = None

    # ------------------------------------------------------------------ validation

    @classmethod
    def validate(cls, doc: Any, *, max_agents: int = DEFAULT_MAX_AGENTS,
                 check_imports: bool = False, start_boundary: int | None = None) -> RunSpec:
        """Parse and check a spec document; `RunSpecError` naming the first bad field.

        `max_agents` is the validating host's `[session] max_agents`; `check_imports` (the
        claiming node only) refuses import paths whose module cannot be found.
        """
        limit = _at("", parse_int, max_agents, "max_agents", 1, MAX_AGENTS_LIMIT)
        check_storable(doc)
        obj = _object(doc, "", TOP_KEYS)
        version = obj.get("specVersion", SPEC_VERSION)
        if isinstance(version, bool) or version != SPEC_VERSION or not isinstance(version, int):
            raise RunSpecError("/specVersion", f"only specVersion {SPEC_VERSION} is supported; "
                                               f"got {version!r}")
        steps = _at("/steps", spec_u64, obj.get("steps", "600"), "steps")
        if steps < 1:
            raise RunSpecError("/steps", "steps must be at least 1")
        start_from = _start_from(obj.get("startFrom"), "/startFrom")
        if start_from is None:
            bounds = _Bounds(0, steps)
        elif start_boundary is not None:
            bounds = _Bounds(start_boundary, start_boundary + steps)
        else:
            bounds = _Bounds(0, None)
        pace_s = obj.get("paceS")
        if pace_s is not None and not is_duration_s(pace_s):
            raise RunSpecError("/paceS", f"paceS must be a number > 0 and {DURATION_RULE}, or "
                                         f"null; got {pace_s!r}")
        exclusive = _at("/exclusiveToSubmitter", parse_bool,
                        obj.get("exclusiveToSubmitter", False), "exclusiveToSubmitter")
        per_process = obj.get("agentsPerProcess")
        if per_process is not None:
            per_process = _at("/agentsPerProcess", parse_int, per_process, "agentsPerProcess",
                              1, MAX_AGENTS_LIMIT)

        if "agents" in obj:
            raw_agents = _list(obj["agents"], "/agents")
            agents = [_agent(a, _ptr("/agents", i), bounds) for i, a in enumerate(raw_agents)]
        else:
            agents = list(_default_agents())
        if not 1 <= len(agents) <= limit:
            raise RunSpecError("/agents", f"a composition has 1..{limit} agents; "
                                          f"got {len(agents)}")
        seen_ids: dict[str, int] = {}
        seen_ports: dict[str, int] = {}
        for i, agent in enumerate(agents):
            if agent.agent_id in seen_ids:
                raise RunSpecError(f"/agents/{i}/agentId",
                                   f"agent {agent.agent_id} is given twice")
            if agent.port_id in seen_ports:
                raise RunSpecError(f"/agents/{i}/portId",
                                   f"port {agent.port_id} is bound to two agents")
            seen_ids[agent.agent_id] = i
            seen_ports[agent.port_id] = i
        world = _world(obj.get("world", {}), "/world", bounds)
        if world.world_id in seen_ids:
            raise RunSpecError("/world/worldId",
                               f"world id {world.world_id} is also an agent id")
        task = _task(obj.get("task", {}), "/task", world)
        workers = [*seen_ids, world.world_id]
        spec = cls(
            spec_version=SPEC_VERSION,
            session_id=_at("/sessionId", parse_id, obj.get("sessionId", "demo"), "sessionId"),
            episode_id=_at("/episodeId", parse_id, obj.get("episodeId", "ep1"), "episodeId"),
            steps=steps,
            seed=_at("/seed", spec_u64, obj.get("seed", "7"), "seed"),
            mode=_choice(obj.get("mode", "process"), "/mode", MODES),
            dispatch=_choice(obj.get("dispatch", "concurrent"), "/dispatch", DISPATCHES),
            pacing=_choice(obj.get("pacing", "off"), "/pacing", PACINGS),
            pace_s=pace_s,
            exclusive_to_submitter=exclusive,
            agents_per_process=per_process,
            agents=tuple(sorted(agents, key=lambda a: a.agent_id)),
            world=world,
            task=task,
            executor=_executor(obj.get("executor", {}), "/executor"),
            checkpoints=_checkpoints(obj.get("checkpoints", {}), "/checkpoints"),
            injections=_injections(obj.get("injections", {}), "/injections", workers, bounds),
            start_from=start_from,
        )
        if check_imports:
            spec.check_imports(raw_order=agents)
        return spec

    def check_imports(self, raw_order: Sequence[AgentSpec] | None = None) -> None:
        """The node-only rule: every import path's module can be found (`find_spec`)."""
        for i, agent in enumerate(raw_order if raw_order is not None else self.agents):
            if not _module_exists(agent.model):
                raise RunSpecError(f"/agents/{i}/model",
                                   f"module of {agent.model} cannot be found")
        if not _module_exists(self.world.impl):
            raise RunSpecError("/world/impl", f"module of {self.world.impl} cannot be found")
        if not _module_exists(self.task.impl):
            raise RunSpecError("/task/impl", f"module of {self.task.impl} cannot be found")
        if not _module_exists(self.executor.impl):
            raise RunSpecError("/executor/impl",
                               f"module of {self.executor.impl} cannot be found")

    @classmethod
    def normalise(cls, doc: Any, *, max_agents: int = MAX_AGENTS_LIMIT) -> dict[str, Any]:
        """Every key present, defaults filled, `agents` and `injections` sorted."""
        return cls.validate(doc, max_agents=max_agents).to_json()

    def to_json(self) -> dict[str, Any]:
        checkpoints = dict(self.checkpoints)
        return {
            "specVersion": self.spec_version,
            "sessionId": self.session_id,
            "episodeId": self.episode_id,
            "steps": str(self.steps),
            "seed": str(self.seed),
            "mode": self.mode,
            "dispatch": self.dispatch,
            "pacing": self.pacing,
            "paceS": self.pace_s,
            "exclusiveToSubmitter": self.exclusive_to_submitter,
            "agents": [a.to_json() for a in sorted(self.agents, key=lambda a: a.agent_id)],
            "world": self.world.to_json(),
            "task": self.task.to_json(),
            "executor": self.executor.to_json(),
            "checkpoints": {key: checkpoints.get(key) for key in CHECKPOINT_KEYS},
            "injections": self.injections.to_json(),
            "startFrom": None if self.start_from is None else self.start_from.to_json(),
            # an addition to design/session.md §4.10's keys, present only when set: the normal form
            # of every spec without it stays the same
            **({} if self.agents_per_process is None
               else {"agentsPerProcess": self.agents_per_process}),
        }

    # ------------------------------------------------------------------ derived facts

    def worker_ids(self) -> list[str]:
        """Agent ids (sorted), then the world id."""
        return [a.agent_id for a in self.agents] + [self.world.world_id]

    def agent(self, agent_id: str) -> AgentSpec:
        for agent in self.agents:
            if agent.agent_id == agent_id:
                return agent
        raise DomainError.before("IDENTITY_MISMATCH", f"no agent {agent_id} in the run spec")

    def seed_of(self, agent_id: str) -> int:
        """The agent's configured seed, or the one derived from the master seed
        (design/session.md §4.7)."""
        agent = self.agent(agent_id)
        return agent.seed if agent.seed is not None else derive_seed(self.seed, agent_id)

    def thread_need(self, coordinator_reservation: int) -> int:
        """`coordinator reservation + world threads + Σ agent threads` (design/session.md §7.3)."""
        return coordinator_reservation + self.world.threads + sum(a.threads for a in self.agents)

    def faults_of(self, worker_id: str) -> Faults:
        if worker_id == self.world.world_id:
            return self.world.faults
        return self.agent(worker_id).faults

    # ----------------------------------------------------- one-shot faults (design/session.md §4.9)

    def one_shot_faults(self) -> list[tuple[str, int]]:
        """`(fault id, step)` of every step-addressed fault: worker knobs, kills, lost results."""
        out: list[tuple[str, int]] = []
        for agent in self.agents:
            out += agent.faults.step_addressed(agent.agent_id)
        out += self.world.faults.step_addressed(self.world.world_id)
        out += [(k.fault_id, k.step) for k in self.injections.kill]
        out += [(f"lose-advance-result@{s}", s) for s in self.injections.lose_advance_result_at]
        return out

    def faults_at(self, step: int) -> list[str]:
        """The ids a node records as fired before it calls `step()` from `Ready(step)`."""
        return [fault_id for fault_id, at in self.one_shot_faults() if at == step]

    def without_fired(self, fired: Iterable[str]) -> RunSpec:
        """The spec a later launch or coordinator uses: fired one-shot faults omitted."""
        gone = set(fired)

        def clear(worker_id: str, faults: Faults) -> Faults:
            knobs = [fid.partition(".")[2] for fid, _ in faults.step_addressed(worker_id)
                     if fid in gone]
            return faults.without(knobs)

        return replace(
            self,
            agents=tuple(replace(a, faults=clear(a.agent_id, a.faults)) for a in self.agents),
            world=replace(self.world, faults=clear(self.world.world_id, self.world.faults)),
            injections=InjectionSpec(
                tuple(k for k in self.injections.kill if k.fault_id not in gone),
                tuple(s for s in self.injections.lose_advance_result_at
                      if f"lose-advance-result@{s}" not in gone)),
        )

    def with_faults(self, specs: Sequence[str]) -> RunSpec:
        """Merge `--fault SPEC`s (design/cli.md §3); `FaultSpecError` naming the refused spec."""
        parsed = parse_faults(specs, agents=[a.agent_id for a in self.agents],
                              world=self.world.world_id)
        doc = self.to_json()
        spec = self
        for fault in parsed:
            _merge(doc, fault, self.world.world_id)
            try:
                spec = RunSpec.validate(doc, max_agents=MAX_AGENTS_LIMIT)
            except RunSpecError as exc:
                raise FaultSpecError(fault.spec, exc.reason) from None
        return spec


def _merge(doc: dict[str, Any], fault: FaultSpec, world_id: str) -> None:
    injections = doc["injections"]
    if isinstance(fault, KillFault):
        injections["kill"].append({"worker": fault.worker, "step": str(fault.step)})
        return
    if isinstance(fault, LoseAdvanceResultFault):
        injections["loseAdvanceResultAt"].append(str(fault.step))
        return
    if fault.worker == world_id:
        faults = doc["world"]["faults"]
    else:
        faults = next(a["faults"] for a in doc["agents"] if a["agentId"] == fault.worker)
    knob = KNOBS[fault.knob]
    if faults[knob.camel] not in (None, False):
        raise FaultSpecError(fault.spec, f"{fault.worker}.{fault.knob} is already set by the "
                                         "run spec")
    if knob.kind in ("delay", "flag", "request_id"):
        faults[knob.camel] = fault.value
    else:
        faults[knob.camel] = str(fault.value)
    if knob.at_step is not None and fault.at_step is not None:
        faults[camel_case(knob.at_step)] = str(fault.at_step)


# --------------------------------------------------------------------------------------------
# Fault grammar (design/session.md §4.9, design/cli.md §3)


@dataclass(frozen=True)
class KnobFault:
    """`WORKER.KNOB=VALUE[@STEP]`."""

    worker: str
    knob: str
    value: int | str | bool
    at_step: int | None
    spec: str


@dataclass(frozen=True)
class KillFault:
    """`kill:WORKER@STEP` → `Injections.kill_at` gets `(worker, step)`."""

    worker: str
    step: int
    spec: str


@dataclass(frozen=True)
class LoseAdvanceResultFault:
    """`lose-advance-result@STEP` → `Injections.lose_advance_result_at` gets `step`."""

    step: int
    spec: str


FaultSpec = KnobFault | KillFault | LoseAdvanceResultFault

_GRAMMAR: Final = "expected WORKER.KNOB=VALUE[@STEP], kill:WORKER@STEP or lose-advance-result@STEP"


def _u64_text(text: str, spec: str, what: str,
              expected: str = "a canonical decimal U64") -> int:
    if _U64_TEXT.fullmatch(text) is None or int(text) > 2**64 - 1:
        raise FaultSpecError(spec, f"{what} must be {expected}; got {text!r}")
    return int(text)


def _knob_text(knob: Knob, text: str, spec: str) -> int | str | bool:
    if knob.kind == "delay":
        value = _u64_text(text, spec, knob.name, "integer milliseconds ≥ 0 (canonical decimal)")
        if value > MAX_SAFE:
            raise FaultSpecError(spec, f"{knob.name} {value} is too large")
        return value
    if knob.kind == "step":
        return _u64_text(text, spec, knob.name, "a step (canonical decimal U64)")
    if knob.kind == "boundary":
        value = _u64_text(text, spec, knob.name, "a boundary ≥ 1 (canonical decimal U64)")
        if value < 1:
            raise FaultSpecError(spec, f"{knob.name} must be a boundary ≥ 1; boundary 0 is "
                                       "rendered at bootstrap")
        return value
    if knob.kind == "request_id":
        try:
            return parse_request_id(text, knob.name)
        except DomainError as exc:
            raise FaultSpecError(spec, exc.message) from None
    if text not in ("true", "false"):
        raise FaultSpecError(spec, f"{knob.name} must be true or false; got {text!r}")
    return text == "true"


def parse_fault(spec: str, *, agents: Collection[str], world: str) -> FaultSpec:
    """Parse one `SPEC` against a composition (agent ids and the world id)."""
    if not isinstance(spec, str):
        raise FaultSpecError(repr(spec), "a fault spec is a string")
    workers = f"{', '.join(sorted(agents))}, {world}"
    if spec.startswith("kill:"):
        worker, at, step = spec[len("kill:"):].partition("@")
        if not at:
            raise FaultSpecError(spec, "kill needs @STEP (kill:WORKER@STEP)")
        if worker not in agents and worker != world:
            raise FaultSpecError(spec, f"unknown worker {worker!r} (the composition has "
                                       f"{workers})")
        return KillFault(worker, _u64_text(step, spec, "STEP"), spec)
    if spec.startswith("lose-advance-result"):
        head, at, step = spec.partition("@")
        if head != "lose-advance-result" or not at:
            raise FaultSpecError(spec, "expected lose-advance-result@STEP")
        return LoseAdvanceResultFault(_u64_text(step, spec, "STEP"), spec)
    lhs, eq, rhs = spec.partition("=")
    worker, dot, name = lhs.rpartition(".")
    if not eq or not dot or not worker or not name:
        raise FaultSpecError(spec, _GRAMMAR)
    role: Role
    if worker in agents:
        role = "agent"
    elif worker == world:
        role = "environment"
    else:
        raise FaultSpecError(spec, f"unknown worker {worker!r} (the composition has {workers})")
    knob = KNOBS.get(name)
    if knob is None:
        raise FaultSpecError(spec, f"unknown knob {name!r}")
    if role not in knob.roles:
        raise FaultSpecError(spec, f"{name} is not a knob of the {role} {worker}")
    value_text, at, step_text = rhs.partition("@")
    at_step: int | None = None
    if at:
        if knob.kind != "delay":
            raise FaultSpecError(spec, f"@STEP is allowed only on *_delay_ms knobs, not {name}")
        at_step = _u64_text(step_text, spec, "STEP")
    return KnobFault(worker, name, _knob_text(knob, value_text, spec), at_step, spec)


def parse_faults(specs: Iterable[str], *, agents: Collection[str],
                 world: str) -> list[FaultSpec]:
    """Parse every spec; a knob given twice for one worker (or a repeated injection) is refused."""
    out: list[FaultSpec] = []
    seen: set[tuple[str, ...]] = set()
    for spec in specs:
        fault = parse_fault(spec, agents=agents, world=world)
        if isinstance(fault, KnobFault):
            key: tuple[str, ...] = ("knob", fault.worker, fault.knob)
            again = f"{fault.worker}.{fault.knob} is given twice"
        elif isinstance(fault, KillFault):
            key = ("kill", fault.worker, str(fault.step))
            again = f"kill:{fault.worker}@{fault.step} is given twice"
        else:
            key = ("lose", str(fault.step))
            again = f"lose-advance-result@{fault.step} is given twice"
        if key in seen:
            raise FaultSpecError(spec, again)
        seen.add(key)
        out.append(fault)
    return out
