"""A PettingZoo `ParallelEnv` as a flyd world, a policy callable as an agent model, and the
task that turns the environment's rewards and endings into flyd's (docs/adapters.md).

- `ParallelEnvWorld` (world config `{"env": "module:callable", "kwargs": {…}, "render": bool,
  "seed": int}`): `env(**kwargs)` builds the environment. The run's ports bind to the env's
  `possible_agents` in order (the i-th agent of the run spec drives the i-th env agent; the
  counts must be equal). `reset` resets the env with `seed` (default 0), so every episode and
  every run of a spec is the same. `apply` maps each live agent's port controls to its action
  (`workers.adapters.spaces`) and steps the env once; the controls of agents that are no longer
  live are ignored, and once no agent is live the env is done and `apply` leaves it alone. The
  inspection (every agent's last observation, reward, termination and truncation, and the
  spaces) is each agent's structured input. With `render` true the env is built with
  `render_mode="rgb_array"` and its render is the world's view `frame`.
- `PolicyModel` (model config `{"policy": "module:callable"}`): when its input arrives it calls
  `policy(observation, env_agent, rng)` once, with the observation as the env gave it, the env's
  name of the agent and a numpy `Generator` seeded by the agent's seed, and decides the
  controls that make the world take the returned action (`arena.decision.v1`, so the default
  `IdentityExecutor` applies it). A policy that is a plain function keeps no state; any other
  callable object is copied per agent and its state is part of the agent's checkpoint.
- `EnvTask` (task config `{}`, terminal `never`, `done` or `after:N`): each live agent's env
  reward of a transition is its flyd reward; `done` ends the episode when every env agent has
  terminated or been truncated.

Checkpoints pickle the env (and a stateful policy). An env that cannot be pickled fails its
capture with `UNSUPPORTED` naming the env, and so does the run at its first checkpoint: such an
env cannot be recovered. Restoring unpickles a checkpoint the node wrote itself; never restore
a checkpoint from a source you do not trust.
"""

from __future__ import annotations

import copy
import importlib
import pickle
import re
import types
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, ClassVar, Final

import numpy as np

from workers.adapters.recovery import EnvRecovery
from workers.adapters.spaces import (
    CONTEXT,
    EPISODE,
    EVENT,
    INSPECTION,
    PROGRESS,
    controller,
    describe,
    expect,
    from_json,
    neutral,
    space_text,
    to_action,
    to_intent,
    to_json,
    typed,
    unsupported,
)
from workers.adapters.thread import EnvThread
from workers.canonical import canonical, digest_bytes, digest_of, parse_strict
from workers.composition import config_asset
from workers.datatypes import (
    AssetRef,
    EnvironmentDescriptor,
    Graph,
    Learning,
    PixelAspect,
    PortControl,
    PortSpec,
    RateRole,
    Reward,
    Stimulus,
    Telemetry,
    TypedValue,
    ViewDescriptor,
)
from workers.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    PluginFault,
    PluginStage,
    Scope,
    clip_message,
    parse_bool,
    parse_finite,
    parse_id,
    parse_int,
)
from workers.protocols import (
    STRUCTURED_OBSERVATION,
    AgentOutcome,
    Bootstrap,
    DecodedView,
    EpisodeRequest,
    Evaluation,
    TaskEvent,
)
from workers.synthetic.schemas import DECISION
from workers.ticks import RationalNs

VIEW_ID: Final = "frame"
WORLD_FORMAT: Final = "adapter-world-v2"
MODEL_FORMAT: Final = "adapter-policy-v1"
TASK_FORMAT: Final = "adapter-task-v1"
WORLD_KEYS: Final = frozenset({"env", "kwargs", "render", "seed", "restore"})
_IMPORT_PATH: Final = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
_TERMINAL: Final = re.compile(r"after:(0|[1-9][0-9]{0,15})")


def load_callable(path: Any, what: str) -> Callable[..., Any]:
    """The callable named by `module:attribute` (`INVALID_ARGUMENT` naming `what` else)."""
    if not isinstance(path, str) or _IMPORT_PATH.fullmatch(path) is None:
        raise DomainError.invalid(f"{what} must be an import path module:callable; got {path!r}")
    module_name, _, attribute = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise DomainError.invalid(f"{what} {path}: {type(exc).__name__}: {exc}") from None
    if not callable(obj):
        raise DomainError.invalid(f"{what} {path} is not callable")
    return obj  # type: ignore[no-any-return]


def _float(value: Any, what: str) -> float:
    return parse_finite(float(value), what)


# ============================================================================================
# the world


class ParallelEnvWorld:
    """A PettingZoo `ParallelEnv`, one port per env agent, in order."""

    capabilities: ClassVar[tuple[str, ...]] = (STRUCTURED_OBSERVATION,)
    inline_calls: ClassVar[bool] = False  # an env step may take long; the model thread runs it
    backend: ClassVar[str] = "pettingzoo-parallel-env-v1"

    def __init__(self, *, world_id: str, ports: Sequence[str], step: RationalNs,
                 observation_delay_steps: int, threads: int,
                 config: Mapping[str, Any]) -> None:
        parse_id(world_id, "world id")
        self.world_id = world_id
        self.ports = tuple(ports)
        self.step = step
        self.config = dict(config)
        extra = set(self.config) - WORLD_KEYS
        if extra:
            raise DomainError.invalid(f"world config: unknown keys {sorted(extra)} (known: "
                                      f"{sorted(WORLD_KEYS)})")
        self.env_path = str(self.config.get("env"))
        self.make = load_callable(self.config.get("env"), "world config env")
        kwargs = self.config.get("kwargs", {})
        if not isinstance(kwargs, dict):
            raise DomainError.invalid("world config kwargs must be an object")
        self.render_view = parse_bool(self.config.get("render", False), "world config render")
        if self.render_view and "render_mode" not in kwargs:
            kwargs = {**kwargs, "render_mode": "rgb_array"}
        self.kwargs = kwargs
        self.seed = parse_int(self.config.get("seed", 0), "world config seed", 0, 2**63 - 1)
        self.recovery = EnvRecovery(str(self.config.get("restore", "auto")),
                                    f"world {world_id} (env {self.env_path})")
        #: every call into the env runs on this thread (workers.adapters.thread)
        self.thread = EnvThread(f"{world_id}-env")
        self.thread.call(self._start, observation_delay_steps)

    def _start(self, observation_delay_steps: int) -> None:
        """Build the env, bind the ports, reset it and size the view (on the env thread)."""
        self.env: Any = self.build()
        names = [str(a) for a in self.env.possible_agents]
        if len(names) != len(self.ports):
            raise DomainError.invalid(f"env {self.env_path} has {len(names)} agents {names}; "
                                      f"the run binds {len(self.ports)} ports: give the run "
                                      "exactly one agent per env agent")
        self.env_agents = dict(zip(self.ports, self.env.possible_agents, strict=True))
        self.names = dict(zip(self.ports, names, strict=True))
        self.observation_spaces = {p: describe(self.env.observation_space(a))
                                   for p, a in self.env_agents.items()}
        self.action_spaces = {p: describe(self.env.action_space(a), bounds=True)
                              for p, a in self.env_agents.items()}
        self.controls = {p: controller(d) for p, d in self.action_spaces.items()}
        self.agents: dict[str, str] = {}
        self.observations: dict[str, Any] = {}
        self.rewards: dict[str, float] = {}
        self.terminated: dict[str, bool] = {}
        self.truncated: dict[str, bool] = {}
        self.steps = 0
        self.reset_env()
        self.recovery.admit(self.env)
        self.views: tuple[ViewDescriptor, ...] = ()
        if self.render_view:
            height, width = self.frame().shape[:2]
            self.views = (ViewDescriptor(VIEW_ID, width, height, 4 * width, PixelAspect(1, 1),
                                         observation_delay_steps),)

    # ------------------------------------------------------------------ the env

    def build(self) -> Any:
        """The environment, from the config's callable and kwargs."""
        try:
            return self.make(**self.kwargs)
        except DomainError:
            raise
        except Exception as exc:
            raise DomainError.invalid(f"env {self.env_path}: building it failed: "
                                      f"{type(exc).__name__}: {exc}") from None

    def live(self) -> set[str]:
        return {str(a) for a in self.env.agents}

    def reset_env(self) -> None:
        observations, _ = self.env.reset(seed=self.seed)
        self.recovery.reset(self.seed)
        self.steps = 0
        for port, agent in self.env_agents.items():
            self.observations[port] = to_json(self.observation_spaces[port], observations[agent])
            self.rewards[port] = 0.0
            self.terminated[port] = self.truncated[port] = False

    def frame(self) -> Any:
        frame = np.asarray(self.env.render())
        if frame.ndim != 3 or frame.shape[2] not in (3, 4) or frame.dtype != np.uint8:
            raise DomainError.invalid(f"env {self.env_path}: render() must return an rgb_array "
                                      f"(H×W×3 uint8); got {frame.dtype} {frame.shape}")
        return frame

    # ------------------------------------------------------------------ World

    def config_asset(self) -> AssetRef:
        return config_asset(f"{self.world_id}-config", self.config)

    def descriptor(self) -> EnvironmentDescriptor:
        config = canonical({"config": self.config, "ports": list(self.ports),
                            "step": self.step.to_json()})
        return EnvironmentDescriptor(
            backend_digest=digest_bytes(self.backend.encode()),
            content_digest=digest_bytes(f"{self.backend}\n{self.env_path}\n".encode()),
            configuration_digest=digest_bytes(config),
            step_duration=self.step,
            ports=tuple(PortSpec(p, self.controls[p]) for p in self.ports),
            inspection_schema=INSPECTION,
            views=self.views,
            audio=(),
            recovery="exact-checkpoint",
            determinism="fixed-build",
        )

    def reset(self, episode_id: str, bindings: Sequence[tuple[str, str]]) -> None:
        self.agents = {port: agent for port, agent in bindings}
        self.thread.call(self.reset_env)

    def apply(self, controls: Sequence[PortControl]) -> None:
        self.thread.call(self._apply, controls)

    def _apply(self, controls: Sequence[PortControl]) -> None:
        live = self.live()
        if not live:
            return
        actions = {self.env_agents[c.port_id]: to_action(self.action_spaces[c.port_id], c)
                   for c in controls if self.names[c.port_id] in live}
        result = self.env.step(actions)
        self.recovery.stepped(actions, result)
        observations, rewards, terminations, truncations, _ = result
        self.steps += 1
        for port, agent in self.env_agents.items():
            if self.names[port] not in live:
                self.rewards[port] = 0.0
                continue
            if agent in observations:
                self.observations[port] = to_json(self.observation_spaces[port],
                                                  observations[agent])
            self.rewards[port] = _float(rewards.get(agent, 0.0), f"{agent}'s reward")
            self.terminated[port] = bool(terminations.get(agent, False))
            self.truncated[port] = bool(truncations.get(agent, False))

    def inspection(self, boundary: int) -> TypedValue:
        live = self.thread.call(self.live)
        return typed(INSPECTION, {
            "boundary": boundary, "env": self.env_path, "steps": self.steps, "done": not live,
            "agents": [{"portId": port, "agentId": self.agents.get(port),
                        "envAgent": self.names[port], "active": self.names[port] in live,
                        "observation": self.observations[port], "reward": self.rewards[port],
                        "terminated": self.terminated[port], "truncated": self.truncated[port],
                        "observationSpace": self.observation_spaces[port],
                        "actionSpace": self.action_spaces[port]} for port in self.ports]})

    def render(self, view_id: str, boundary: int) -> bytes:
        if not self.views or view_id != VIEW_ID:
            raise DomainError.invalid(f"env {self.env_path} has no view {view_id}")
        frame = self.thread.call(self.frame)
        view = self.views[0]
        if frame.shape[:2] != (view.height, view.width):
            raise DomainError.invalid(f"env {self.env_path}: a frame of {frame.shape[1]}×"
                                      f"{frame.shape[0]}; the view is {view.width}×"
                                      f"{view.height}")
        if frame.shape[2] == 3:
            alpha = np.full((*frame.shape[:2], 1), 255, dtype=np.uint8)
            frame = np.concatenate([frame, alpha], axis=2)
        return bytes(np.ascontiguousarray(frame).tobytes())

    def audio(self, stream_id: str, frames: int) -> bytes:
        raise DomainError.invalid(f"env {self.env_path} has no audio stream {stream_id}")

    # ------------------------------------------------------------------ checkpoint

    def capture(self) -> bytes:
        """The world's state and its env's (`workers.adapters.recovery`: a snapshot, or the
        episode's record to replay), made on the env thread."""
        return self.thread.call(self._capture)

    def _capture(self) -> bytes:
        state = {"format": WORLD_FORMAT, "env": self.recovery.capture(self.env),
                 "agents": self.agents, "observations": self.observations,
                 "rewards": self.rewards, "terminated": self.terminated,
                 "truncated": self.truncated, "steps": self.steps}
        return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`: all or nothing, `INCOMPATIBLE_STATE` when it does not fit
        (or its episode does not replay exactly)."""
        self.thread.call(self._restore, payload)

    def _restore(self, payload: bytes) -> None:
        try:
            state = pickle.loads(payload)
        except Exception as exc:
            raise DomainError.before("INCOMPATIBLE_STATE", f"env {self.env_path} state: "
                                     f"{type(exc).__name__}") from None
        keys = {"format", "env", "agents", "observations", "rewards", "terminated",
                "truncated", "steps"}
        if not isinstance(state, dict) or set(state) != keys \
                or state["format"] != WORLD_FORMAT \
                or not isinstance(state["env"], dict) \
                or set(state["env"]) != {"state", "env", "log"} \
                or any(set(state[k]) != set(self.ports) for k in
                       ("observations", "rewards", "terminated", "truncated")):
            raise DomainError.before("INCOMPATIBLE_STATE", f"env {self.env_path} state: not a "
                                     f"{WORLD_FORMAT} state of ports {list(self.ports)}")
        previous = self.env
        self.env = self.recovery.restore(state["env"], previous)
        self.agents = dict(state["agents"])
        self.observations = dict(state["observations"])
        self.rewards = dict(state["rewards"])
        self.terminated = dict(state["terminated"])
        self.truncated = dict(state["truncated"])
        self.steps = int(state["steps"])
        close = getattr(previous, "close", None)
        if previous is not self.env and callable(close):
            close()


# ============================================================================================
# the policy model


def _own(structured: Any, agent_id: str) -> dict[str, Any]:
    agents = structured.get("agents") if isinstance(structured, dict) else None
    mine = next((a for a in agents or () if isinstance(a, dict) and a.get("agentId") == agent_id),
                None)
    if mine is None:
        raise DomainError.invalid(f"the world's inspection shows no env agent bound to "
                                  f"{agent_id}")
    return mine


class PolicyModel:
    """Calls a policy once per input and presses the controls of the action it returns."""

    capabilities: ClassVar[tuple[str, ...]] = ()
    inline_calls: ClassVar[bool] = False  # a policy may take long; the model thread runs it
    model_version: ClassVar[str] = "adapter-policy-v1"
    plasticity_version: ClassVar[str] = "adapter-policy-none-v1"

    @classmethod
    def profile(cls, agent_id: str, tick: RationalNs, warmup_ticks: int,
                config: Mapping[str, Any]) -> AssetRef:
        text = canonical({"model": cls.model_version, "agentId": agent_id,
                          "config": dict(config), "tick": tick.to_json(),
                          "warmupTicks": warmup_ticks})
        return AssetRef(f"policy-{agent_id}", digest_bytes(text), len(text), "fly-profile-v1")

    @classmethod
    def graph(cls, agent_id: str, config: Mapping[str, Any]) -> Graph:
        policy = str(config.get("policy"))
        return Graph(dataset_digest=digest_bytes(f"adapter-policy\n{policy}\n".encode()),
                     index_digest=digest_bytes(f"adapter-policy-index\n{agent_id}\n".encode()),
                     neuron_count=0, rate_roles=("policy",), supported_stimuli=())

    @classmethod
    def check_context(cls, context: TypedValue) -> None:
        value = expect(context, CONTEXT, "the decision context")
        if not isinstance(value, dict) or set(value) != {"step"}:
            raise DomainError.invalid("an adapter context is {step}")

    @classmethod
    def encode(cls, views: Sequence[DecodedView], structured: TypedValue | None) -> Any:
        if structured is None:
            raise DomainError.invalid("the policy model needs structured input (an adapter "
                                      "world's inspection)")
        return expect(structured, INSPECTION, "the structured input")

    def __init__(self, *, agent_id: str, seed: int, threads: int, executor: Executor,
                 config: Mapping[str, Any]) -> None:
        if set(config) != {"policy"}:
            raise DomainError.invalid("the policy model's config is exactly {policy}")
        self.agent_id = agent_id
        self.policy_path = str(config["policy"])
        policy = load_callable(config["policy"], "model config policy")
        self.stateful = not isinstance(policy, types.FunctionType | types.BuiltinFunctionType)
        self.policy = copy.deepcopy(policy) if self.stateful else policy
        self.rng = np.random.default_rng(seed & 0xFFFFFFFF)
        self.intent: dict[str, Any] = {"buttons": [], "axes": []}
        self.ticks = 0
        self.learning = False
        self.signal = 0.0
        self.total = 0.0
        self._mutations = 0

    def install_input(self, encoded: Any) -> None:
        mine = _own(encoded, self.agent_id)
        space = mine["actionSpace"]
        if mine["active"] and not encoded.get("done"):
            observation = from_json(mine["observationSpace"], mine["observation"])
            try:
                action = self.policy(observation, mine["envAgent"], self.rng)
            except DomainError:
                raise
            except Exception as exc:
                raise DomainError.invalid(f"policy {self.policy_path} failed: "
                                          f"{type(exc).__name__}: {exc}") from None
            try:
                self.intent = to_intent(space, action)
            except DomainError as exc:
                raise self._outside(action, mine["envAgent"], space, exc.message) from None
        else:
            self.intent = neutral(space)
        self._mutations += 1

    def _outside(self, action: Any, env_agent: str, space: Mapping[str, Any],
                 why: str) -> DomainError:
        """An action outside its space: the same policy returns it again on every attempt,
        so the failure repeats (the run ends at once) and names the agent and the space."""
        message = (f"agent {self.agent_id} (env agent {env_agent}): policy {self.policy_path} "
                   f"returned {np.asarray(action).tolist()!r}, outside its action space "
                   f"{space_text(space)} ({why}); make the policy return actions of that "
                   "space")
        fault = PluginFault(self.policy_path, PluginStage.CALL, "ActionOutsideSpace",
                            clip_message(message), (), True)
        return DomainError(ErrorCode.BACKEND_FAILURE, message, Mutation.UNKNOWN, fault)

    def advance(self, ticks: int) -> None:
        self.ticks += ticks
        self._mutations += ticks

    def stimulate(self, stimulus: Stimulus) -> None:
        self._mutations += 1

    def decide(self, context: TypedValue) -> TypedValue:
        self.check_context(context)
        return TypedValue(DECISION, self.intent)

    def reinforce(self, signal: float) -> None:
        self.signal = parse_finite(signal, "reinforcement signal")
        self.total += self.signal
        self._mutations += 1

    def set_learning(self, enabled: bool) -> None:
        self.learning = enabled

    def telemetry(self, brain_ticks: int) -> Telemetry:
        return Telemetry(brain_ticks, 0.0, (RateRole("policy", 0.0),),
                         Learning(self.learning, 0, 0, self.signal), None)

    def mutations(self) -> int:
        return self._mutations

    def capture(self) -> bytes:
        state = {"format": MODEL_FORMAT, "policy": self.policy if self.stateful else None,
                 "rng": self.rng.bit_generator.state, "intent": self.intent,
                 "ticks": self.ticks, "learning": self.learning, "signal": self.signal,
                 "total": self.total, "mutations": self._mutations}
        try:
            return pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:
            raise unsupported(f"policy {self.policy_path} cannot be pickled, so agent "
                              f"{self.agent_id} cannot be checkpointed: "
                              f"{type(exc).__name__}: {exc}") from None

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`: all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        try:
            state = pickle.loads(payload)
            if not isinstance(state, dict) or state.get("format") != MODEL_FORMAT \
                    or (state["policy"] is None) == self.stateful:
                raise ValueError(f"not a {MODEL_FORMAT} state of this policy")
            rng = np.random.default_rng()
            rng.bit_generator.state = state["rng"]
            intent = dict(state["intent"])
            ticks, mutations = int(state["ticks"]), int(state["mutations"])
            learning, signal = bool(state["learning"]), float(state["signal"])
            total = float(state["total"])
        except Exception as exc:
            raise DomainError.before("INCOMPATIBLE_STATE", f"policy {self.policy_path} state: "
                                     f"{type(exc).__name__}: {exc}") from None
        if self.stateful:
            self.policy = state["policy"]
        self.rng, self.intent, self.ticks, self._mutations = rng, intent, ticks, mutations
        self.learning, self.signal, self.total = learning, signal, total


# ============================================================================================
# the task


RULES: Final = ("bootstrap", "reward", "done")


def event_id(epoch: str, step: int, rule: str, ordinal: int) -> str:
    """`ev-` + 16 hex of `digest("<epoch>\\n<step>\\n<rule>\\n<ordinal>\\n")`: a re-executed
    transition mints the same ids."""
    return "ev-" + digest_bytes(f"{epoch}\n{step}\n{rule}\n{ordinal}\n".encode())[:16]


def _agents(inspection: TypedValue, which: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    value = expect(inspection, INSPECTION, f"the {which} inspection")
    agents = value.get("agents") if isinstance(value, dict) else None
    if not isinstance(agents, list) or not all(isinstance(a, dict) for a in agents):
        raise DomainError.invalid(f"the {which} inspection has no agents")
    return value, agents


class EnvTask:
    """The env's rewards as flyd rewards; the env's end as the episode's."""

    def __init__(self, *, config: Mapping[str, Any], terminal: str, max_agents: int,
                 epoch: str) -> None:
        if dict(config):
            raise DomainError.invalid("the adapter task takes no config keys")
        self.terminal: tuple[str, int] | None
        if terminal == "never":
            self.terminal = None
        elif terminal == "done":
            self.terminal = ("done", 0)
        else:
            match = _TERMINAL.fullmatch(terminal) if isinstance(terminal, str) else None
            if match is None:
                raise DomainError.invalid(f"terminal {terminal!r} is not never, done or after:N")
            self.terminal = ("after", int(match.group(1)))
        self.max_agents = parse_int(max_agents, "max_agents", 1, 256)
        self.epoch = epoch
        self.transitions = 0
        self.env_steps = 0
        self.done = False
        self.returns: dict[str, float] = {}
        self._evaluations = 0

    def bootstrap(self, inspection: TypedValue, bindings: Sequence[tuple[str, str]]
                  ) -> Bootstrap:
        _, agents = _agents(inspection, "first")
        self.returns = {agent: 0.0 for _, agent in bindings}
        event = TaskEvent(event_id(self.epoch, 0, "bootstrap", 0), "adapter.bootstrap", 0, None,
                          typed(EVENT, {"agents": len(agents)}))
        return Bootstrap(contexts={a: typed(CONTEXT, {"step": 0}) for _, a in bindings},
                         progress=self.progress(), events=(event,))

    def evaluate_transition(self, scope: Scope, old: TypedValue, new: TypedValue,
                            controls: Sequence[PortControl]) -> Evaluation:
        self._evaluations += 1
        step = scope.step + 1
        before, old_agents = _agents(old, "old")
        after, new_agents = _agents(new, "new")
        acted = {a.get("portId") for a in old_agents if a.get("active")} \
            if not before.get("done") else set()
        rewards: dict[str, list[Reward]] = {agent: [] for agent in self.returns}
        events: list[TaskEvent] = []
        returns = dict(self.returns)
        for ordinal, entry in enumerate(new_agents):
            agent = entry.get("agentId")
            if agent not in rewards:
                raise DomainError.before("IDENTITY_MISMATCH",
                                         f"port {entry.get('portId')} has no bound agent")
            if entry.get("portId") not in acted:
                continue
            value = parse_finite(entry.get("reward"), "reward")
            ident = event_id(scope.epoch, step, "reward", ordinal)
            events.append(TaskEvent(ident, "adapter.reward", step, agent, typed(EVENT, {
                "reward": value, "terminated": bool(entry.get("terminated")),
                "truncated": bool(entry.get("truncated")),
                "observationDigest": digest_of(entry.get("observation"))})))
            rewards[agent].append(Reward(ident, "env", value))
            returns[agent] += value
        done = bool(after.get("done"))
        if done and not self.done:
            events.append(TaskEvent(event_id(scope.epoch, step, "done", 0), "adapter.done",
                                    step, None, typed(EVENT, {"steps": after.get("steps")})))
        self.transitions += 1
        self.env_steps = parse_int(after.get("steps"), "steps", 0, 2**53 - 1)
        self.done = done
        self.returns = returns
        context = typed(CONTEXT, {"step": step})
        return Evaluation(
            outcomes={a: AgentOutcome(tuple(r), ()) for a, r in rewards.items()},
            next_contexts=dict.fromkeys(rewards, context), progress=self.progress(),
            events=tuple(events), episode=self.episode())

    def episode(self) -> EpisodeRequest | None:
        if self.terminal is None:
            return None
        kind, bound = self.terminal
        if kind == "done" and self.done:
            reason = "env-done"
        elif kind == "after" and self.transitions >= bound:
            reason = "transitions"
        else:
            return None
        return EpisodeRequest(reason, typed(EPISODE, {"transitions": self.transitions,
                                                      "returns": dict(self.returns)}))

    def progress(self) -> TypedValue:
        return typed(PROGRESS, {"counter": self.env_steps, "transitions": self.transitions,
                                "done": self.done, "returns": dict(self.returns)})

    def evaluations(self) -> int:
        return self._evaluations

    def minted_ids(self, epoch: str, step: int) -> list[str]:
        return [event_id(epoch, step, rule, o) for rule in RULES
                for o in range(self.max_agents + 1)]

    def capture(self) -> bytes:
        return canonical({"format": TASK_FORMAT, "transitions": self.transitions,
                          "envSteps": self.env_steps, "done": self.done,
                          "returns": self.returns, "evaluations": self._evaluations})

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`: all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        try:
            doc = parse_strict(payload)
            keys = {"format", "transitions", "envSteps", "done", "returns", "evaluations"}
            if not isinstance(doc, dict) or set(doc) != keys or doc["format"] != TASK_FORMAT \
                    or not isinstance(doc["returns"], dict):
                raise DomainError.invalid(f"not a {TASK_FORMAT} state")
            transitions = parse_int(doc["transitions"], "transitions", 0, 2**53 - 1)
            env_steps = parse_int(doc["envSteps"], "envSteps", 0, 2**53 - 1)
            done = parse_bool(doc["done"], "done")
            returns = {str(a): parse_finite(v, "return") for a, v in doc["returns"].items()}
            evaluations = parse_int(doc["evaluations"], "evaluations", 0, 2**53 - 1)
        except DomainError as exc:
            raise DomainError.before("INCOMPATIBLE_STATE",
                                     f"adapter task state: {exc.message}") from None
        self.transitions, self.env_steps, self.done = transitions, env_steps, done
        self.returns, self._evaluations = returns, evaluations
