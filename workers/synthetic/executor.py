"""`IdentityExecutor`: the v1 action executor (session.md §4.1).

Why: the synthetic brain already decides in controller terms, so the executor only checks the
decision's schema and passes its value on as the port's intent; the coordinator validates the
intent against the port's `ControllerSchema`.
"""

from __future__ import annotations

from workers.datatypes import TypedValue
from workers.domain import DomainError, Scope
from workers.protocols import ControllerIntent
from workers.synthetic.schemas import DECISION, has_schema
from workers.ticks import RationalNs


class IdentityExecutor:
    """`arena.decision.v1` → its value `{buttons, axes}` as the controller intent."""

    def apply(self, scope: Scope, decision: TypedValue, game_state: TypedValue,
              progress: TypedValue, clock: RationalNs) -> ControllerIntent:
        if not has_schema(decision, DECISION):
            raise DomainError.before("IDENTITY_MISMATCH", "the decision is not arena.decision.v1")
        return ControllerIntent.from_json(decision.value, "decision value")
