"""`MotorExecutor`: a `fly.decision.v1` → the port's `turn` and `speed` axes.

Why an executor: the brain decides in its own terms (`{turn, speed}`); the world's ports take
controls (`fly.controller.v1`: a bipolar `turn` axis and a unipolar `speed` axis). The executor
is the coordinator-local translation between the two (its `decision_schema` is the one schema
the coordinator accepts from the agents), and the place to cap the flies' speed for a run.

`turn` is clamped to `[-1, 1]`, `speed` to `[0, maxSpeed]`. Config: `maxSpeed` (default 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Final

from examples.fly_arena.schemas import DECISION, expect, settings
from workers.protocols import ControllerIntent
from workers.types.datatypes import AxisValue, SchemaRef, TypedValue
from workers.types.domain import DomainError, Scope, parse_finite
from workers.types.ticks import RationalNs

DEFAULTS: Final = {"maxSpeed": (1.0, 0.0, 1.0)}


class MotorExecutor:
    """Turn and speed to axes."""

    decision_schema: ClassVar[SchemaRef] = DECISION

    def __init__(self, *, config: Mapping[str, Any]) -> None:
        self.max_speed = settings(dict(config), "motor executor", DEFAULTS)["maxSpeed"]

    def apply(self, scope: Scope, decision: TypedValue, game_state: TypedValue,
              progress: TypedValue, clock: RationalNs) -> ControllerIntent:
        value = expect(decision, DECISION, "the decision")
        if not isinstance(value, dict) or set(value) != {"turn", "speed"}:
            raise DomainError.invalid("a fly decision is {turn, speed}")
        turn = min(1.0, max(-1.0, parse_finite(value["turn"], "turn")))
        speed = min(self.max_speed, max(0.0, parse_finite(value["speed"], "speed")))
        return ControllerIntent((), (AxisValue("turn", turn), AxisValue("speed", speed)))
