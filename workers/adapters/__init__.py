"""Adapters that run existing environments as flyd worlds (docs/adapters.md).

`workers.adapters.pettingzoo` (a PettingZoo `ParallelEnv` as the world, a policy callable as
the agent model, the task of the env's rewards and endings) and `workers.adapters.gymnasium`
(a single-agent Gymnasium `Env` as a world of one agent). They need the `pettingzoo` extra
(`pip install 'flyd[pettingzoo]'`: pettingzoo, gymnasium, numpy); nothing outside this package
imports them, so flyd runs without it.
"""
