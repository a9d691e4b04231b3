"""A PettingZoo `ParallelEnv` as a flyd world, a policy callable as an agent model, and the
task that turns the environment's rewards and endings into flyd's (docs/adapters.md).

- `ParallelEnvWorld` (world config `{"env": "module:callable", "kwargs": {…}, "render": bool,
  "render_every": int, "seed": int, "episodes": int, "restore": "auto" | "snapshot" |
  "replay"}`): `env(**kwargs)`
  builds the environment. The run's ports bind to the env's `possible_agents` in order (the i-th
  agent of the run spec drives the i-th env agent; the counts must be equal). `reset` resets the
  env with the episode's seed (`seed`, default 0, for episode 0; `episode_seed(seed, e)` for
  episode e). `apply` maps each live agent's port controls to its action
  (`workers.adapters.spaces`) and steps the env once; the controls of agents that are no longer
  live are ignored. When no agent is live the episode has ended: the env is reset at once for the
  next episode, up to `episodes` (unbounded when left out: episodes follow each other until the
  run's step count), after which it is done and `apply` leaves it alone. The world offers
  `per-agent-input-v1`: each agent receives only its own observation (binary arrays), reward and
  endings (`adapter.input.v1`), its spaces once at boundary 0; the inspection
  (`adapter.inspection.v2`, rewards and endings, no observations) is the task's. With `render`
  true the env is built with `render_mode="rgb_array"` and its render is the world's view `frame`,
  drawn at the boundaries b with `b % render_every == 0` only (default 1; `flyd run
  --record-every K` sets K): at the others `render` returns None and the environment endpoint
  serves the previous boundary's frame again. So the view keeps one frame per boundary
  (design/session.md §3.5) while the env draws only the frames a recording keeps, and a restore at
  any boundary serves the undisturbed run's frame (the checkpoint holds its boundary's frame).
  The world's step follows the env (`natural_step`: its `dt`, else `1 / metadata["render_fps"]`)
  unless the run spec sets one.
- `PolicyModel` (model config `{"policy": "module:callable"}`): when its input arrives it calls
  `policy(observation, env_agent, rng, spaces)` once (a policy taking two or three positional
  arguments gets the first two or three), with the observation as the env gave it, the env's
  name of the agent, a numpy `Generator` seeded by the agent's seed and the agent's
  `Spaces(observation, action)`, and decides the controls that make the world take the
  returned action (`arena.decision.v1`, so the default `IdentityExecutor` applies it). A policy
  that is a plain function keeps no state; any other callable object is copied per agent and
  its state is part of the agent's checkpoint.
- `EnvTask` (task config `{}`, terminal `never`, `done` or `after:N`): each live agent's env
  reward of a transition is its flyd reward; `done` ends the episode when every episode the
  world runs has ended.

A reward that is not finite or lies outside ±`MAX_REWARD` fails the step at once, naming the
env, the agent and the task, as a failure that repeats (the run ends without a retry: the same
env gives the same reward again).

Checkpoints hold the env's whole state or its episode's actions, as the world config's
`restore` (`auto`, the default, `snapshot` or `replay`) says: `workers.adapters.recovery`; the
world's capture is compressed. Every call into the env runs on the world's own env thread
(`workers.adapters.thread`). An action outside its space ends the run at once, naming the agent
and the space. Restoring unpickles a checkpoint the node wrote itself; never restore a
checkpoint from a source you do not trust.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import inspect
import math
import pickle
import re
import types
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, ClassVar, Final, NamedTuple

import numpy as np

from workers.adapters.recovery import EnvRecovery
from workers.adapters.replay import observation_digest
from workers.adapters.spaces import (
    CONTEXT,
    EPISODE,
    EVENT,
    INPUT,
    INSPECTION,
    PROGRESS,
    controller,
    decode_observation,
    describe,
    encode_observation,
    expect,
    neutral,
    space_text,
    to_action,
    to_intent,
    to_space,
    typed,
    unsupported,
)
from workers.adapters.thread import EnvThread
from workers.composition import config_asset
from workers.protocols import (
    ARRAY_INPUT,
    PER_AGENT_INPUT,
    AgentArray,
    AgentOutcome,
    Bootstrap,
    DecodedArray,
    DecodedView,
    EpisodeRequest,
    Evaluation,
    TaskEvent,
)
from workers.synthetic.schemas import DECISION
from workers.types.canonical import canonical, digest_bytes, parse_strict
from workers.types.datatypes import (
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
from workers.types.domain import (
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
from workers.types.ticks import RationalNs

VIEW_ID: Final = "frame"
WORLD_FORMAT: Final = "adapter-world-v4"
MODEL_FORMAT: Final = "adapter-policy-v2"
TASK_FORMAT: Final = "adapter-task-v1"
TASK_PATH: Final = "workers.adapters.pettingzoo:EnvTask"
WORLD_KEYS: Final = frozenset({"env", "kwargs", "render", "render_every", "seed", "episodes",
                               "restore"})
#: the largest reward magnitude an env may give (beyond it sums lose every unit digit)
MAX_REWARD: Final = 1e12
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


def episode_seed(seed: int, episode: int) -> int:
    """The reset seed of episode `episode` of a run whose world seed is `seed`: `seed` itself
    for episode 0 (a one-episode run resets as before), else 63 bits of
    `SHA-256("<seed>\\n<episode>\\n")`, so every episode differs and a recovered run
    resets exactly as the undisturbed one."""
    if episode == 0:
        return seed
    digest = hashlib.sha256(f"{seed}\n{episode}\n".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def step_of(seconds: float, what: str) -> RationalNs:
    """A step of `seconds` (> 0, finite) as exact nanoseconds, rounded to the nanosecond."""
    if not isinstance(seconds, int | float) or not math.isfinite(seconds) or seconds <= 0:
        raise DomainError.invalid(f"{what} must be a positive number of seconds; got "
                                  f"{seconds!r}")
    return RationalNs.of(max(1, round(seconds * 1e9)), 1)


def bad_reward(env_path: str, agent: str, value: Any) -> DomainError:
    """A reward the task cannot take: a failure that repeats, so the run ends at once."""
    shown = f"{value:g}" if isinstance(value, float) else repr(value)
    message = (f"env {env_path}: agent {agent}'s reward is {shown}; task {TASK_PATH} takes "
               f"finite rewards within ±{MAX_REWARD:g} (fix the env's reward)")
    return DomainError(ErrorCode.BACKEND_FAILURE, message, Mutation.APPLIED,
                       PluginFault(env_path, PluginStage.CALL, "ValueError", message, (), True))


def checked_reward(env_path: str, agent: str, value: Any) -> float:
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise bad_reward(env_path, agent, value) from None
    if not math.isfinite(reward) or abs(reward) > MAX_REWARD:
        raise bad_reward(env_path, agent, reward)
    return reward


# ============================================================================================
# the world


class ParallelEnvWorld:
    """A PettingZoo `ParallelEnv`, one port per env agent, in order."""

    capabilities: ClassVar[tuple[str, ...]] = (PER_AGENT_INPUT,)
    inline_calls: ClassVar[bool] = False  # an env step may take long; the model thread runs it
    backend: ClassVar[str] = "pettingzoo-parallel-env-v1"

    @classmethod
    def natural_step(cls, config: Mapping[str, Any]) -> RationalNs | None:
        """The env's own step: its `dt` (the unwrapped env's, as MuJoCo envs give it), else
        `1 / metadata["render_fps"]`; None when it has neither. Builds the env once."""
        env = cls.check_config(config)[0]()
        try:
            dt = getattr(getattr(env, "unwrapped", env), "dt", None)
            if dt is not None:
                return step_of(dt, f"env {config.get('env')} dt")
            fps = (getattr(env, "metadata", None) or {}).get("render_fps")
            if fps is not None:
                if isinstance(fps, bool) or not isinstance(fps, int | float) or fps <= 0:
                    raise DomainError.invalid(f"env {config.get('env')} metadata render_fps "
                                              f"{fps!r} is not a positive rate")
                return RationalNs.of(10**9, int(fps)) if float(fps).is_integer() \
                    else step_of(1.0 / fps, f"env {config.get('env')} 1/render_fps")
            return None
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                close()

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> tuple[Callable[[], Any], str]:
        """A builder of the env the config names, and its import path."""
        extra = set(config) - WORLD_KEYS
        if extra:
            raise DomainError.invalid(f"world config: unknown keys {sorted(extra)} (known: "
                                      f"{sorted(WORLD_KEYS)})")
        env_path = str(config.get("env"))
        make = load_callable(config.get("env"), "world config env")
        kwargs = config.get("kwargs", {})
        if not isinstance(kwargs, dict):
            raise DomainError.invalid("world config kwargs must be an object")
        if parse_bool(config.get("render", False), "world config render") \
                and "render_mode" not in kwargs:
            kwargs = {**kwargs, "render_mode": "rgb_array"}

        def build() -> Any:
            try:
                return cls.wrap(make(**kwargs))
            except DomainError:
                raise
            except Exception as exc:
                raise DomainError.invalid(f"env {env_path}: building it failed: "
                                          f"{type(exc).__name__}: {exc}") from None

        return build, env_path

    @classmethod
    def wrap(cls, env: Any) -> Any:
        """The env as the world steps it (a parallel env; the Gymnasium world wraps)."""
        return env

    def __init__(self, *, world_id: str, ports: Sequence[str], step: RationalNs,
                 observation_delay_steps: int, threads: int,
                 config: Mapping[str, Any]) -> None:
        parse_id(world_id, "world id")
        self.world_id = world_id
        self.ports = tuple(ports)
        self.step = step
        self.config = dict(config)
        self.builder, self.env_path = self.check_config(self.config)
        self.render_view = parse_bool(self.config.get("render", False), "world config render")
        #: the env renders at boundaries b with b % render_every == 0 (docs/adapters.md)
        self.render_every = parse_int(self.config.get("render_every", 1),
                                      "world config render_every", 1, 2**31 - 1)
        #: what the env rendered at the current boundary (None until it renders, and after
        #: every step or reset): the frame a capture's snapshot check compares
        self.drawn: Any = None
        self.seed = parse_int(self.config.get("seed", 0), "world config seed", 0, 2**63 - 1)
        episodes = self.config.get("episodes")
        self.episodes: int | None = None if episodes is None else \
            parse_int(episodes, "world config episodes", 1, 2**53 - 1)
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
        #: each port's `observation_digest` of its observation, taken when it arrived
        self.digests: dict[str, str] = {}
        self.rewards: dict[str, float] = {}
        self.terminated: dict[str, bool] = {}
        self.truncated: dict[str, bool] = {}
        self.steps = 0
        self.episode = 0
        self.ended = 0  # episodes that ended
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
        return self.builder()

    def live(self) -> set[str]:
        """The env's live agents (on the env thread; `alive` keeps them for other threads)."""
        return {str(a) for a in self.env.agents}

    def done(self) -> bool:
        """Every episode the world runs has ended."""
        return self.episodes is not None and self.ended >= self.episodes

    def reset_env(self, *, rewards: bool = True) -> None:
        """Reset the env for `self.episode` with that episode's seed."""
        seed = episode_seed(self.seed, self.episode)
        self.drawn = None
        observations, _ = self.env.reset(seed=seed)
        self.recovery.reset(seed)
        #: the live agents as of the env's last reset or step, read without a call into it
        self.alive = self.live()
        for port, agent in self.env_agents.items():
            self.observations[port] = observations[agent]
            self.digests[port] = observation_digest(observations[agent])
            if rewards:
                self.rewards[port] = 0.0
            self.terminated[port] = self.truncated[port] = False

    def frame(self, env: Any = None) -> Any:
        """The render of `env` (the world's own by default) as an H×W×3|4 uint8 array."""
        frame = np.asarray((self.env if env is None else env).render())
        if frame.ndim != 3 or frame.shape[2] not in (3, 4) or frame.dtype != np.uint8:
            raise DomainError.invalid(f"env {self.env_path}: render() must return an rgb_array "
                                      f"(H×W×3 uint8); got {frame.dtype} {frame.shape}")
        return frame

    def _draw(self) -> Any:
        self.drawn = self.frame()
        return self.drawn

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
        self.steps = self.episode = self.ended = 0
        self.thread.call(self.reset_env)

    def apply(self, controls: Sequence[PortControl]) -> None:
        self.thread.call(self._apply, controls)

    def _apply(self, controls: Sequence[PortControl]) -> None:
        if self.done():
            for port in self.ports:
                self.rewards[port] = 0.0
            return
        live = self.live()
        actions = {self.env_agents[c.port_id]: to_action(self.action_spaces[c.port_id], c)
                   for c in controls if self.names[c.port_id] in live}
        self.drawn = None
        result = self.env.step(actions)
        observations, rewards, terminations, truncations, _ = result
        # each observation hashed once, for the inspection and the recovery's record
        observed = {agent: observation_digest(o) for agent, o in observations.items()}
        self.recovery.stepped(actions, result, observed)
        self.steps += 1
        for port, agent in self.env_agents.items():
            if self.names[port] not in live:
                self.rewards[port] = 0.0
                continue
            if agent in observations:
                self.observations[port] = observations[agent]
                self.digests[port] = observed[agent]
            self.rewards[port] = checked_reward(self.env_path, self.names[port],
                                                rewards.get(agent, 0.0))
            self.terminated[port] = bool(terminations.get(agent, False))
            self.truncated[port] = bool(truncations.get(agent, False))
        self.alive = self.live()
        if not self.alive:
            self.ended += 1
            if not self.done():
                self.episode += 1
                self.reset_env(rewards=False)

    def inspection(self, boundary: int) -> TypedValue:
        live = self.alive
        # by column, agents in port order: no key repeated per agent, so 256 agents fit the
        # 32 KiB of a typed value
        done = self.done()
        return typed(INSPECTION, {
            "boundary": boundary, "env": self.env_path, "steps": self.steps,
            "episode": self.episode, "episodesDone": self.ended, "done": done,
            "agentIds": [self.agents.get(port) for port in self.ports],
            "active": [self.names[port] in live and not done for port in self.ports],
            "rewards": [self.rewards[port] for port in self.ports],
            "terminated": [self.terminated[port] for port in self.ports],
            "truncated": [self.truncated[port] for port in self.ports],
            "observationDigests": [self.digests[port] for port in self.ports]})

    def agent_input(self, port_id: str, boundary: int
                    ) -> tuple[TypedValue, Sequence[AgentArray]]:
        """The agent on `port_id`'s own input: its observation (binary arrays), reward and
        endings; its spaces at boundary 0 only."""
        observation, arrays = encode_observation(self.observation_spaces[port_id],
                                                 self.observations[port_id])
        value: dict[str, Any] = {
            "step": self.steps, "episode": self.episode, "done": self.done(),
            "active": self.names[port_id] in self.alive and not self.done(),
            "reward": self.rewards[port_id], "terminated": self.terminated[port_id],
            "truncated": self.truncated[port_id], "observation": observation}
        if boundary == 0:
            value["spaces"] = {"agent": self.names[port_id],
                               "observation": self.observation_spaces[port_id],
                               "action": self.action_spaces[port_id]}
        return typed(INPUT, value), arrays

    def render(self, view_id: str, boundary: int) -> bytes | None:
        """The env's render at a boundary `render_every` keeps; None (the previous frame
        again, which the endpoint serves) at the others, without a call into the env."""
        if not self.views or view_id != VIEW_ID:
            raise DomainError.invalid(f"env {self.env_path} has no view {view_id}")
        if boundary % self.render_every:
            return None
        frame = self.thread.call(self._draw)
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

    def picture(self) -> Callable[[Any], str] | None:
        """The digest of an env's render, for a world that renders."""
        if not self.render_view:
            return None
        return lambda env: observation_digest(self.frame(env))

    def drawn_digest(self) -> str | None:
        """The digest of what the env rendered at this boundary (None when it drew nothing)."""
        return None if self.drawn is None else observation_digest(self.drawn)

    def capture(self) -> bytes:
        """The world's state and its env's (`workers.adapters.recovery`: a snapshot, or the
        episode's record to replay), made on the env thread."""
        return self.thread.call(self._capture)

    def _capture(self) -> bytes:
        state = {"format": WORLD_FORMAT, "env": self.recovery.capture(self.env, self.drawn_digest),
                 "agents": self.agents, "observations": self.observations,
                 "rewards": self.rewards, "terminated": self.terminated,
                 "truncated": self.truncated, "steps": self.steps, "episode": self.episode,
                 "ended": self.ended}
        # compressed: an env's pickle holds its screens and the last observations (a pixel
        # env's 2 MB shrink to tens of KB), and a capture must fit one bus frame
        return zlib.compress(pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL), 1)

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`: all or nothing, `INCOMPATIBLE_STATE` when it does not fit
        (or its episode does not replay exactly)."""
        self.thread.call(self._restore, payload)

    def _restore(self, payload: bytes) -> None:
        try:
            state = pickle.loads(zlib.decompress(payload))
        except Exception as exc:
            raise DomainError.before("INCOMPATIBLE_STATE", f"env {self.env_path} state: "
                                     f"{type(exc).__name__}") from None
        keys = {"format", "env", "agents", "observations", "rewards", "terminated",
                "truncated", "steps", "episode", "ended"}
        if not isinstance(state, dict) or set(state) != keys \
                or state["format"] != WORLD_FORMAT \
                or not isinstance(state["env"], dict) \
                or set(state["env"]) != {"state", "env", "log", "frame"} \
                or any(set(state[k]) != set(self.ports) for k in
                       ("observations", "rewards", "terminated", "truncated")):
            raise DomainError.before("INCOMPATIBLE_STATE", f"env {self.env_path} state: not a "
                                     f"{WORLD_FORMAT} state of ports {list(self.ports)}")
        previous = self.env
        self.env = self.recovery.restore(state["env"], previous, self.picture())
        self.agents = dict(state["agents"])
        self.observations = dict(state["observations"])
        self.digests = {p: observation_digest(o) for p, o in self.observations.items()}
        self.rewards = dict(state["rewards"])
        self.terminated = dict(state["terminated"])
        self.truncated = dict(state["truncated"])
        self.steps = int(state["steps"])
        self.episode, self.ended = int(state["episode"]), int(state["ended"])
        self.alive = self.live()
        close = getattr(previous, "close", None)
        if previous is not self.env and callable(close):
            close()


# ============================================================================================
# the policy model


class Spaces(NamedTuple):
    """An agent's spaces as gymnasium spaces (the policy's fourth argument)."""

    observation: Any
    action: Any


def random_policy(observation: Any, agent_id: str, rng: np.random.Generator,
                  spaces: Spaces) -> Any:
    """A uniformly random action of the agent's action space, drawn from `rng` (so a run of
    it is reproducible): a ready policy to try an env with (`workers.adapters.pettingzoo:
    random_policy`)."""
    space = spaces.action
    if hasattr(space, "n"):  # Discrete
        return int(space.start) + int(rng.integers(0, int(space.n)))
    if hasattr(space, "low"):  # Box
        return rng.uniform(space.low, space.high).astype(space.dtype)
    return rng.integers(0, 2, size=space.shape).astype(np.int8)  # MultiBinary



def _arity(policy: Callable[..., Any]) -> int:
    """How many positional arguments the policy takes, 2..4 (4 when it takes `*args`)."""
    try:
        params = inspect.signature(policy).parameters.values()
    except (TypeError, ValueError):
        return 4
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
        return 4
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:
        raise DomainError.invalid("a policy takes (observation, agent_id[, rng[, spaces]])")
    return min(4, len(positional))


class PolicyModel:
    """Calls a policy once per input and presses the controls of the action it returns."""

    capabilities: ClassVar[tuple[str, ...]] = (ARRAY_INPUT,)
    inline_calls: ClassVar[bool] = False  # a policy may take long; the model thread runs it
    model_version: ClassVar[str] = "adapter-policy-v2"
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
    def encode(cls, views: Sequence[DecodedView], structured: TypedValue | None,
               arrays: Sequence[DecodedArray] = ()) -> Any:
        if structured is None:
            raise DomainError.invalid("the policy model needs an adapter world's input")
        value = expect(structured, INPUT, "the structured input")
        if not isinstance(value, dict):
            raise DomainError.invalid("an adapter input is an object")
        return value, {a.id: a for a in arrays}

    def __init__(self, *, agent_id: str, seed: int, threads: int, executor: Executor,
                 config: Mapping[str, Any]) -> None:
        if set(config) != {"policy"}:
            raise DomainError.invalid("the policy model's config is exactly {policy}")
        self.agent_id = agent_id
        self.policy_path = str(config["policy"])
        policy = load_callable(config["policy"], "model config policy")
        self.stateful = not isinstance(policy, types.FunctionType | types.BuiltinFunctionType)
        self.policy = copy.deepcopy(policy) if self.stateful else policy
        self.arity = _arity(self.policy)
        self.rng = np.random.default_rng(seed & 0xFFFFFFFF)
        self.spaces: dict[str, Any] | None = None  # described, from the boundary-0 input
        self.built: Spaces | None = None
        self.intent: dict[str, Any] = {"buttons": [], "axes": []}
        self.ticks = 0
        self.learning = False
        self.signal = 0.0
        self.total = 0.0
        self._mutations = 0

    def gym_spaces(self) -> Spaces:
        """The agent's spaces as gymnasium spaces, rebuilt once from their descriptions."""
        if self.built is None:
            assert self.spaces is not None
            self.built = Spaces(to_space(self.spaces["observation"]),
                                to_space(self.spaces["action"]))
        return self.built

    def install_input(self, encoded: Any) -> None:
        value, arrays = encoded
        if "spaces" in value:
            self.spaces, self.built = dict(value["spaces"]), None
        if self.spaces is None:
            raise DomainError.invalid(f"agent {self.agent_id} has no spaces: they come with "
                                      "the world's first input")
        action_space = self.spaces["action"]
        if value.get("active") and not value.get("done"):
            observation = decode_observation(self.spaces["observation"], value["observation"],
                                             arrays)
            args: tuple[Any, ...] = (observation, self.spaces["agent"], self.rng,
                                     self.gym_spaces())
            try:
                action = self.policy(*args[:self.arity])
            except DomainError:
                raise
            except Exception as exc:
                raise DomainError.invalid(f"policy {self.policy_path} failed: "
                                          f"{type(exc).__name__}: {exc}") from None
            try:
                self.intent = to_intent(action_space, action)
            except DomainError as exc:
                raise self._outside(action, action_space, exc.message) from None
        else:
            self.intent = neutral(action_space)
        self._mutations += 1

    def _outside(self, action: Any, space: Mapping[str, Any], why: str) -> DomainError:
        """An action outside its space: the same policy returns it again on every attempt,
        so the failure repeats (the run ends at once) and names the agent and the space."""
        assert self.spaces is not None
        message = (f"agent {self.agent_id} (env agent {self.spaces['agent']}): policy "
                   f"{self.policy_path} returned {np.asarray(action).tolist()!r}, outside its "
                   f"action space {space_text(space)} ({why}); make the policy return actions "
                   "of that space")
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
                 "spaces": self.spaces,
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
            described = state["spaces"]
            ticks, mutations = int(state["ticks"]), int(state["mutations"])
            learning, signal = bool(state["learning"]), float(state["signal"])
            total = float(state["total"])
        except Exception as exc:
            raise DomainError.before("INCOMPATIBLE_STATE", f"policy {self.policy_path} state: "
                                     f"{type(exc).__name__}: {exc}") from None
        if self.stateful:
            self.policy = state["policy"]
        self.rng, self.intent, self.ticks, self._mutations = rng, intent, ticks, mutations
        self.spaces, self.built = described, None
        self.learning, self.signal, self.total = learning, signal, total


class InlinePolicyModel(PolicyModel):
    """`PolicyModel` whose calls run on the agent worker's event loop instead of its model
    thread: for a policy that answers in well under a millisecond (a lookup, a small linear
    map), it saves two thread hand-offs a step. A slow policy here holds the worker's loop (its
    replies to health probes included), so keep `PolicyModel` for anything heavier."""

    inline_calls: ClassVar[bool] = True


# ============================================================================================
# the task


RULES: Final = ("bootstrap", "reward", "done")


def event_id(epoch: str, step: int, rule: str, ordinal: int) -> str:
    """`ev-` + 16 hex of `digest("<epoch>\\n<step>\\n<rule>\\n<ordinal>\\n")`: a re-executed
    transition mints the same ids."""
    return "ev-" + digest_bytes(f"{epoch}\n{step}\n{rule}\n{ordinal}\n".encode())[:16]


_COLUMNS: Final = {"agentIds": "agentId", "active": "active", "rewards": "reward",
                   "terminated": "terminated", "truncated": "truncated",
                   "observationDigests": "observationDigest"}


def _agents(inspection: TypedValue, which: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The inspection and its agents, one `{agentId, active, reward, terminated, truncated,
    observationDigest}` per port, from its columns."""
    value = expect(inspection, INSPECTION, f"the {which} inspection")
    columns = [value.get(c) if isinstance(value, dict) else None for c in _COLUMNS]
    if not all(isinstance(c, list) for c in columns) \
            or len({len(c) for c in columns if isinstance(c, list)}) != 1:
        raise DomainError.invalid(f"the {which} inspection has no agents")
    return value, [dict(zip(_COLUMNS.values(), row, strict=True))
                   for row in zip(*columns, strict=True)]


class EnvTask:
    """The env's rewards as flyd rewards; the end of the world's last episode as the run's
    episode end (terminal `done`)."""

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
        acted = {a.get("agentId") for a in old_agents if a.get("active")} \
            if not before.get("done") else set()
        rewards: dict[str, list[Reward]] = {agent: [] for agent in self.returns}
        events: list[TaskEvent] = []
        returns = dict(self.returns)
        for ordinal, entry in enumerate(new_agents):
            agent = entry.get("agentId")
            if agent not in rewards:
                raise DomainError.before("IDENTITY_MISMATCH",
                                         f"the inspection's agent {ordinal} is not bound")
            if agent not in acted:
                continue
            value = parse_finite(entry.get("reward"), "reward")
            ident = event_id(scope.epoch, step, "reward", ordinal)
            events.append(TaskEvent(ident, "adapter.reward", step, agent, typed(EVENT, {
                "reward": value, "terminated": bool(entry.get("terminated")),
                "truncated": bool(entry.get("truncated")),
                "observationDigest": entry.get("observationDigest")})))
            rewards[agent].append(Reward(ident, "env", value))
            returns[agent] += value
        done = bool(after.get("done"))
        if after.get("episodesDone") != before.get("episodesDone"):
            events.append(TaskEvent(event_id(scope.epoch, step, "done", 0), "adapter.done",
                                    step, None, typed(EVENT, {
                                        "steps": after.get("steps"),
                                        "episodesDone": after.get("episodesDone"),
                                        "done": done})))
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
