"""The synthetic composition (design/session.md §4.2–§4.7): `FakeBrain`, `CounterArena`,
`CounterTask`, `IdentityExecutor`; the schema helpers live in `workers.synthetic.schemas`.

Why: the run spec names plugins by import path, and the defaults are `workers.synthetic:FakeBrain`,
`workers.synthetic:CounterArena`, `workers.synthetic:CounterTask` and
`workers.synthetic:IdentityExecutor`, so those four names, and only they, are bound here (the one
allowance of the no-re-export rule, tests/test_layout.py); each concept lives in its own module.
"""

from typing import TYPE_CHECKING

from workers.synthetic.arena import CounterArena
from workers.synthetic.brain import FakeBrain
from workers.synthetic.executor import IdentityExecutor
from workers.synthetic.task import CounterTask

__all__ = [
    "CounterArena",
    "CounterTask",
    "FakeBrain",
    "IdentityExecutor",
]

if TYPE_CHECKING:  # the type checker proves the synthetic classes implement the protocols
    from workers.protocols import ActionExecutor, AgentModel, Task, World

    _model: type[AgentModel] = FakeBrain
    _world: type[World] = CounterArena
    _task: Task = CounterTask()
    _executor: ActionExecutor = IdentityExecutor()
