"""Reaching: points in a plane steer toward goals (docs/plugins.md walks through it).

A run spec names these classes by import path (`examples/reaching/run.json`):

- `examples.reaching:PointWorld`: the world. Each port moves a point by its `dx`/`dy` axes;
  a point that comes within `goalRadius` of its goal gets the next one. Its inspection (every
  point's position, goal and count of goals reached) is also the agents' structured input.
- `examples.reaching:GoalSeeker`: the agent model. Steers toward its own goal with a seeded
  jitter; rewards tune its gain.
- `examples.reaching:ReachingTask`: the task. Rewards distance reduction, mints an event and a
  stimulation when a goal is reached; terminal `never`, `after:N` or `goals:N`.
- `examples.reaching:SteeringExecutor`: the executor. Turns a `reaching.decision.v1`
  (`{direction, throttle}`) into the port's `dx`/`dy` axes.
"""

from examples.reaching.executor import SteeringExecutor
from examples.reaching.model import GoalSeeker
from examples.reaching.task import ReachingTask
from examples.reaching.world import PointWorld

__all__ = ["GoalSeeker", "PointWorld", "ReachingTask", "SteeringExecutor"]
