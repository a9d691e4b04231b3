"""`SteeringExecutor`: a `reaching.decision.v1` → the port's `dx`/`dy` axes.

Why an executor: the model decides in its own terms (a direction and a throttle); the world's
ports take controls (`reaching.controller.v1`: two bipolar axes). The executor is the
coordinator-local translation between the two, and its `decision_schema` is the one schema the
coordinator accepts from the agents.

`(dx, dy) = min(throttle, maxThrottle) · direction / |direction|`, each clamped to `[-1, 1]`;
a zero direction is no movement. Config: `maxThrottle` (default 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from examples.reaching.schemas import DECISION, expect, point, settings
from workers.protocols import ControllerIntent
from workers.types.datatypes import AxisValue, SchemaRef, TypedValue
from workers.types.domain import DomainError, Scope, parse_finite
from workers.types.ticks import RationalNs

DEFAULTS: Final = {"maxThrottle": (1.0, 0.0, 1.0)}


class SteeringExecutor:
    """Direction and throttle to axes."""

    decision_schema: ClassVar[SchemaRef] = DECISION

    def __init__(self, *, config: Mapping[str, Any]) -> None:
        self.max_throttle = settings(dict(config), "steering executor", DEFAULTS)["maxThrottle"]

    def apply(self, scope: Scope, decision: TypedValue, game_state: TypedValue,
              progress: TypedValue, clock: RationalNs) -> ControllerIntent:
        value = expect(decision, DECISION, "the decision")
        if not isinstance(value, dict) or set(value) != {"direction", "throttle"}:
            raise DomainError.invalid("a reaching decision is {direction, throttle}")
        x, y = point(value["direction"], "direction")
        throttle = min(self.max_throttle, max(0.0, parse_finite(value["throttle"], "throttle")))
        length = math.sqrt(x * x + y * y)
        if length == 0:
            dx = dy = 0.0
        else:
            dx = min(1.0, max(-1.0, throttle * x / length))
            dy = min(1.0, max(-1.0, throttle * y / length))
        return ControllerIntent((), (AxisValue("dx", dx), AxisValue("dy", dy)))
