"""The fly arena: flies walk in a 2D arena toward an odour source (docs/examples.md).

A run spec names these classes by import path (`examples/fly_arena/run.json`):

- `examples.fly_arena:FlyArena`: the world (numpy). Flies turn and walk; a fly that reaches the
  source counts a visit and is released elsewhere. Views: `arena`, the top-down picture, and
  `eyes`, every fly's own sensor view (one retina row per fly). Its inspection is also the
  agents' structured input.
- `examples.fly_arena:FlyBrain`: the agent model. A tiny perceptron with seeded numpy weights
  from the fly's left, middle and right odour senses to `{turn, speed}`.
- `examples.fly_arena:OdourTask`: the task. Rewards the distance closed on the source, mints an
  event and a stimulation when a fly reaches it; terminal `never`, `after:N` or `visits:N`.
- `examples.fly_arena:MotorExecutor`: the executor. Turns a `fly.decision.v1` into the port's
  `turn`/`speed` axes.

It needs numpy: `pip install 'flyd[examples]'` (the `dev` extra includes it).
"""

from examples.fly_arena.brain import FlyBrain
from examples.fly_arena.executor import MotorExecutor
from examples.fly_arena.task import OdourTask
from examples.fly_arena.world import FlyArena

__all__ = ["FlyArena", "FlyBrain", "MotorExecutor", "OdourTask"]
