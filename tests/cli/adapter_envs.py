"""Small deterministic environments and policies for the adapters' tests (no network, no ROMs).

- `LineEnv`: a PettingZoo `ParallelEnv`. Two walkers on the integer line `0..size` each walk
  toward their own target (starts in the first quarter, targets in the last; `Discrete(3)`:
  left, stay, right; observation `Box` `[position, target]`). Each step rewards
  `-|position − target| / size`, plus 1 on arrival, which terminates the walker; all are
  truncated after `maxSteps`. Starts and targets come from the env's seeded `np_random`.
  `render_mode="rgb_array"` draws a strip with one coloured cell per walker and target.
- `UnpicklableLineEnv`: the same, holding a lock, so it cannot be pickled.
- `EzLineEnv`: the same, inheriting `gymnasium.utils.EzPickle` as most published envs do (a
  plain pickle of it is a fresh, never-reset env).
- `DriftingLineEnv`: the same, but an unpickled copy has every walker one cell further right:
  deliberately not the env that was pickled.
- `HomesickLineEnv`: the same, but a copy unpickled in another process than the one that made
  the env has every walker one cell further right (a copy in the same process is exact).
- `GlobalRandomLineEnv`: the same, but its walkers slip at random by the process-wide
  `random` module, so neither its pickle nor a replay from its seed continues it.
- `ThreadLineEnv`: the same, noting the thread of every call into it (`threads`).
- `SlideEnv`: a Gymnasium `Env` of one agent on `[-1, 1]` with a `Box(-1, 1, (1,))` action
  (the velocity), terminated within 0.05 of its target.
- `BadRewardLineEnv`: `LineEnv` whose rewards turn to `reward` (NaN by default) at step
  `atStep`.
- `CrowdEnv`: `LineEnv` with `agents` walkers (a wide run).
- `TallyLineEnv`: `LineEnv` that appends the count of its steps in the whole run (not reset
  with its episodes) to the file `renderLog` at every render: which boundaries it drew.
- `TimedLineEnv`: `LineEnv` with `metadata["render_fps"] = 25`; `DtSlideEnv`: `SlideEnv` with
  `dt = 0.02`.
- `walk` (a function) and `StubbornPolicy` (a callable object with state) for `LineEnv`;
  `slide` for `SlideEnv`; `pistons` and `spread` (four-argument policies) for PettingZoo's
  pistonball and MPE2's simple_spread, checking the observation each receives is its own.
"""

from __future__ import annotations

import os
import random
import threading
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.utils import EzPickle
from pettingzoo import ParallelEnv

CELL = 4


class LineEnv(ParallelEnv):  # type: ignore[misc]
    metadata = {"name": "line_v0", "render_modes": ["rgb_array"]}

    def __init__(self, size: int = 16, maxSteps: int = 30,
                 render_mode: str | None = None) -> None:
        self.size = size
        self.max_steps = maxSteps
        self.render_mode = render_mode
        self.possible_agents = ["walker_0", "walker_1"]
        self.agents: list[str] = []
        self.positions: dict[str, int] = {}
        self.targets: dict[str, int] = {}
        self.steps = 0
        self.np_random = np.random.default_rng(0)

    def observation_space(self, agent: str) -> spaces.Box:
        return spaces.Box(0.0, float(self.size), (2,), np.float32)

    def action_space(self, agent: str) -> spaces.Discrete:
        return spaces.Discrete(3)

    def observe(self, agent: str) -> np.ndarray:
        return np.array([self.positions[agent], self.targets[agent]], dtype=np.float32)

    def reset(self, seed: int | None = None, options: Any = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        if seed is not None:
            self.np_random = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self.steps = 0
        for agent in self.agents:
            self.positions[agent] = int(self.np_random.integers(0, self.size // 4 + 1))
            self.targets[agent] = int(self.np_random.integers(3 * self.size // 4, self.size + 1))
        return {a: self.observe(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        self.steps += 1
        observations, rewards, terminations, truncations = {}, {}, {}, {}
        for agent in self.agents:
            move = int(actions[agent]) - 1
            self.positions[agent] = min(self.size, max(0, self.positions[agent] + move))
            gap = abs(self.positions[agent] - self.targets[agent])
            arrived = gap == 0
            rewards[agent] = -gap / self.size + (1.0 if arrived else 0.0)
            terminations[agent] = arrived
            truncations[agent] = self.steps >= self.max_steps
            observations[agent] = self.observe(agent)
        self.agents = [a for a in self.agents if not (terminations[a] or truncations[a])]
        return observations, rewards, terminations, truncations, {a: {} for a in observations}

    def render(self) -> np.ndarray:
        strip = np.zeros((CELL * 2, CELL * (self.size + 1), 3), dtype=np.uint8)
        strip[:, :, 2] = 40
        for row, agent in enumerate(self.possible_agents):
            rows = slice(row * CELL, (row + 1) * CELL)
            target = self.targets.get(agent, 0)
            strip[rows, target * CELL:(target + 1) * CELL, 1] = 200
            position = self.positions.get(agent, 0)
            strip[rows, position * CELL:(position + 1) * CELL, 0] = 255
        return strip


class UnpicklableLineEnv(LineEnv):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lock = threading.Lock()


class EzLineEnv(LineEnv, EzPickle):
    def __init__(self, size: int = 16, maxSteps: int = 30,
                 render_mode: str | None = None) -> None:
        LineEnv.__init__(self, size, maxSteps, render_mode)
        EzPickle.__init__(self, size, maxSteps, render_mode)


class DriftingLineEnv(LineEnv):
    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.positions = {a: min(self.size, p + 1) for a, p in self.positions.items()}


class HomesickLineEnv(LineEnv):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.home = os.getpid()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.home != os.getpid():
            self.positions = {a: min(self.size, p + 1) for a, p in self.positions.items()}


class GlobalRandomLineEnv(LineEnv):
    def step(self, actions: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        slips = {a: random.random() < 0.5 for a in self.agents}
        return super().step({a: 1 if slips[a] else actions[a] for a in actions})


class ThreadLineEnv(LineEnv):
    threads: set[int] = set()

    def __init__(self, **kwargs: Any) -> None:
        ThreadLineEnv.threads.add(threading.get_ident())
        super().__init__(**kwargs)

    def reset(self, seed: int | None = None, options: Any = None
              ) -> tuple[dict[str, Any], dict[str, Any]]:
        ThreadLineEnv.threads.add(threading.get_ident())
        return super().reset(seed, options)

    def step(self, actions: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        ThreadLineEnv.threads.add(threading.get_ident())
        return super().step(actions)

    def render(self) -> np.ndarray:
        ThreadLineEnv.threads.add(threading.get_ident())
        return super().render()

    def __getstate__(self) -> dict[str, Any]:
        ThreadLineEnv.threads.add(threading.get_ident())
        return self.__dict__


def walk(observation: np.ndarray, agent_id: str, rng: np.random.Generator) -> int:
    """Toward the target, with a random step one time in four."""
    assert observation.dtype == np.float32 and observation.shape == (2,)
    assert agent_id in ("walker_0", "walker_1")
    if rng.random() < 0.25:
        return int(rng.integers(0, 3))
    position, target = observation
    return 1 if position == target else (2 if target > position else 0)


class StubbornPolicy:
    """Walks toward the target but stays put every third call: its count is its state."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, observation: np.ndarray, agent_id: str,
                 rng: np.random.Generator) -> int:
        self.calls += 1
        if self.calls % 3 == 0:
            return 1
        return walk(observation, agent_id, rng)


stubborn = StubbornPolicy()


class SlideEnv(gymnasium.Env):  # type: ignore[type-arg]
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, maxSteps: int = 40, render_mode: str | None = None) -> None:
        self.max_steps = maxSteps
        self.render_mode = render_mode
        self.observation_space = spaces.Box(-1.0, 1.0, (2,), np.float64)
        self.action_space = spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.x = self.target = 0.0
        self.steps = 0

    def reset(self, *, seed: int | None = None, options: Any = None
              ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.x = float(self.np_random.uniform(-1, 1))
        self.target = float(self.np_random.uniform(-1, 1))
        self.steps = 0
        return np.array([self.x, self.target]), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        noise = float(self.np_random.normal(0.0, 0.01))
        self.x = min(1.0, max(-1.0, self.x + 0.1 * float(np.asarray(action)[0]) + noise))
        gap = abs(self.x - self.target)
        return (np.array([self.x, self.target]), -gap, gap < 0.05,
                self.steps >= self.max_steps, {})

    def render(self) -> np.ndarray:
        frame = np.zeros((4, 41, 3), dtype=np.uint8)
        frame[:, round((self.target + 1) * 20), 1] = 255
        frame[:, round((self.x + 1) * 20), 0] = 255
        return frame


def slide(observation: np.ndarray, agent_id: str, rng: np.random.Generator) -> np.ndarray:
    assert agent_id == "agent" and observation.shape == (2,)
    x, target = observation
    return np.array([np.clip((target - x) * 5, -1, 1)], dtype=np.float32)


class BadRewardLineEnv(LineEnv):
    def __init__(self, atStep: int = 3, reward: float = float("nan"), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at_step = atStep
        self.bad = reward

    def step(self, actions: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        observations, rewards, terminations, truncations, infos = super().step(actions)
        if self.steps >= self.at_step:
            rewards = dict.fromkeys(rewards, self.bad)
        return observations, rewards, terminations, truncations, infos


class TimedLineEnv(LineEnv):
    metadata = {"name": "timed_line_v0", "render_modes": ["rgb_array"], "render_fps": 25}


class DtSlideEnv(SlideEnv):
    dt = 0.02


def pistons(observation: np.ndarray, agent_id: str, rng: np.random.Generator,
            spaces: Any) -> np.ndarray:
    """A random piston move; the observation is this piston's own picture."""
    assert observation.dtype == np.uint8 and observation.shape == spaces.observation.shape
    assert observation.ndim == 3 and agent_id.startswith("piston_")
    low, high = spaces.action.low, spaces.action.high
    return rng.uniform(low, high).astype(spaces.action.dtype)


def spread(observation: np.ndarray, agent_id: str, rng: np.random.Generator,
           spaces: Any) -> int:
    """A random move of one of many particles; its observation is its own vector."""
    assert observation.shape == spaces.observation.shape and agent_id.startswith("agent_")
    return int(rng.integers(0, spaces.action.n))


def last_action(observation: np.ndarray, agent_id: str, rng: np.random.Generator,
                spaces: Any) -> int:
    """The last action of a `Discrete` space, from the spaces the policy is given."""
    assert observation.shape == spaces.observation.shape
    return int(spaces.action.n) - 1


def first_action(observation: np.ndarray, agent_id: str) -> int:
    """A policy of the two-argument form."""
    return 0


def wild(observation: np.ndarray, agent_id: str, rng: np.random.Generator) -> int:
    """An action outside `LineEnv`'s `Discrete(3)` once the walker is past cell 2."""
    return 7 if observation[0] > 2 else 2


def balance(observation: np.ndarray, agent_id: str, rng: np.random.Generator) -> np.ndarray:
    """Keeps MuJoCo's `InvertedPendulum-v5` pole up (a linear feedback on its 4 observations),
    with a little noise from `rng`."""
    gains = np.array([1.0, 30.0, 2.0, 4.0])
    force = float(gains @ observation) + float(rng.normal(0.0, 0.05))
    return np.array([np.clip(force, -3.0, 3.0)], dtype=np.float32)


def roam(observation: np.ndarray, agent_id: str, rng: np.random.Generator) -> int:
    """A pursuer of PettingZoo's `pursuit` moving at random (5 actions)."""
    assert observation.shape == (7, 7, 3)
    return int(rng.integers(0, 5))


class CrowdEnv(LineEnv):
    """`LineEnv` with `agents` walkers (a wide run)."""

    def __init__(self, agents: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.possible_agents = [f"walker_{i}" for i in range(agents)]


class TallyLineEnv(LineEnv):
    """`LineEnv` noting, at every render, its steps in the run in the file `renderLog`."""

    def __init__(self, renderLog: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.render_log = renderLog
        self.clock = 0

    def step(self, actions: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        self.clock += 1
        return super().step(actions)

    def render(self) -> np.ndarray:
        with open(self.render_log, "a") as log:
            log.write(f"{self.clock}\n")
        return super().render()
