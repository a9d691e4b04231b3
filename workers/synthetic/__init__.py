"""The synthetic composition (session.md §4.2–§4.7): `FakeBrain`, `CounterArena`, `CounterTask`,
`IdentityExecutor` and the schema helpers.

Why: the run spec names plugins by import path, and the defaults are `workers.synthetic:FakeBrain`,
`workers.synthetic:CounterArena` and `workers.synthetic:CounterTask`, so those names are exported
here; each concept lives in its own module.
"""

from typing import TYPE_CHECKING

from workers.synthetic.arena import CounterArena
from workers.synthetic.brain import FakeBrain
from workers.synthetic.executor import IdentityExecutor
from workers.synthetic.schemas import synthetic_schema
from workers.synthetic.task import CounterTask, Terminal, event_id

__all__ = [
    "CounterArena",
    "CounterTask",
    "FakeBrain",
    "IdentityExecutor",
    "Terminal",
    "event_id",
    "synthetic_schema",
]

if TYPE_CHECKING:  # the type checker proves the synthetic classes implement the protocols
    from workers.protocols import ActionExecutor, AgentModel, Task, World

    _model: type[AgentModel] = FakeBrain
    _world: type[World] = CounterArena
    _task: Task = CounterTask()
    _executor: ActionExecutor = IdentityExecutor()
