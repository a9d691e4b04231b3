"""`IdentityExecutor`: the v1 action executor (design/session.md §4.1), the run spec's default
`executor`.

Why: the synthetic brain already decides in controller terms, so the executor only checks the
decision's schema and passes its value on as the port's intent; the coordinator validates the
intent against the port's `ControllerSchema`. Any model whose decisions are
`{buttons, axes}` objects can use it by deciding in `arena.decision.v1`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from workers.protocols import ControllerIntent
from workers.synthetic.schemas import DECISION, has_schema
from workers.types.datatypes import SchemaRef, TypedValue
from workers.types.domain import DomainError, Scope
from workers.types.ticks import RationalNs


class IdentityExecutor:
    """`arena.decision.v1` → its value `{buttons, axes}` as the controller intent."""

    decision_schema: ClassVar[SchemaRef] = DECISION

    def __init__(self, *, config: Mapping[str, Any] | None = None) -> None:
        if config:
            raise DomainError.invalid("the identity executor takes no config keys")

    def apply(self, scope: Scope, decision: TypedValue, game_state: TypedValue,
              progress: TypedValue, clock: RationalNs) -> ControllerIntent:
        if not has_schema(decision, DECISION):
            raise DomainError.before("IDENTITY_MISMATCH", "the decision is not arena.decision.v1")
        return ControllerIntent.from_json(decision.value, "decision value")
