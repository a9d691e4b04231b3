"""A Gymnasium single-agent `Env` as a flyd world with one agent (docs/adapters.md).

`EnvWorld` takes the same config as `workers.adapters.pettingzoo:ParallelEnvWorld`
(`{"env": "module:callable", "kwargs": {…}, "render": bool, "seed": int}`; `env` may be
`gymnasium:make` with `kwargs` `{"id": "CartPole-v1"}`) and behaves the same way: the env is
wrapped as a parallel env of one agent named `agent`, so the run binds exactly one agent, the
`PolicyModel` and `EnvTask` of that module drive it unchanged, and an episode ends when the
env terminates or is truncated (the next one starts at once, as for a parallel env).
Checkpoints and recovery are the parallel world's (`restore: auto | snapshot | replay`,
`workers.adapters.recovery`), applied to the wrapped env.
"""

from __future__ import annotations

from typing import Any, ClassVar, Final

from workers.adapters.pettingzoo import ParallelEnvWorld

AGENT: Final = "agent"


class SingleAgentParallel:
    """A Gymnasium `Env` seen through the `ParallelEnv` calls the world makes."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.possible_agents = [AGENT]
        self.agents: list[str] = []

    def observation_space(self, agent: str) -> Any:
        return self.env.observation_space

    def action_space(self, agent: str) -> Any:
        return self.env.action_space

    def reset(self, seed: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        observation, info = self.env.reset(seed=seed)
        self.agents = [AGENT]
        return {AGENT: observation}, {AGENT: info}

    def step(self, actions: dict[str, Any]) -> tuple[dict[str, Any], ...]:
        observation, reward, terminated, truncated, info = self.env.step(actions[AGENT])
        if terminated or truncated:
            self.agents = []
        return ({AGENT: observation}, {AGENT: reward}, {AGENT: terminated},
                {AGENT: truncated}, {AGENT: info})

    @property
    def unwrapped(self) -> Any:
        """The Gymnasium env's own (its `dt` sets the world's step)."""
        return self.env.unwrapped

    @property
    def metadata(self) -> Any:
        return getattr(self.env, "metadata", {})

    def render(self) -> Any:
        return self.env.render()

    def close(self) -> None:
        self.env.close()


class EnvWorld(ParallelEnvWorld):
    """A single-agent Gymnasium `Env`: one port, bound to the env's only agent."""

    backend: ClassVar[str] = "gymnasium-env-v1"

    @classmethod
    def wrap(cls, env: Any) -> Any:
        return SingleAgentParallel(env)
