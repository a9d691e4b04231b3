"""What each agent receives of a world observation: its `SensoryInput` (design/session.md §6.5 step
4, §6.6 D). Pure.

Why a module: bootstrap's `Agent.Initialize` and every transition's `Agent.Commit` build the
same input by one rule, and the behaviour record digests what was delivered.

Rules:
- Views go to every agent, as before (one JSON value shared by every call).
- Structured input: a world offering `PER_AGENT_INPUT` gives each agent its own port's
  `AgentInput` (structured value and binary arrays) and nothing of the others'; a world offering
  `STRUCTURED_OBSERVATION` gives every agent its inspection; otherwise it is null.
- The attachments of an agent's call are the artifacts its views and its own arrays name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workers.artifacts import referenced_artifacts
from workers.types.datatypes import AgentInput, TypedValue, WorldObservation
from workers.types.domain import DomainError, ErrorCode, Mutation

__all__ = ["Inputs", "sensory_inputs"]


@dataclass(frozen=True, slots=True)
class Inputs:
    """Per agent: the `SensoryInput` JSON, its attachments and its structured value."""

    json: dict[str, dict[str, Any]]
    attachments: dict[str, list[str]]
    structured: dict[str, TypedValue | None]


def sensory_inputs(observation: WorldObservation, bindings: list[tuple[str, str]],
                   structured: bool, boundary: int, mutation: Mutation) -> Inputs:
    """Every bound agent's input of `observation` (`boundary` as its `boundary`)."""
    views = [v.to_json() for v in observation.sensory_views]
    shared = referenced_artifacts(observation.sensory_views)
    out = Inputs({}, {}, {})
    for port, agent in bindings:
        own: AgentInput | None = None
        if observation.agent_inputs is not None:
            own = observation.agent_input(port)
            if own is None:
                raise DomainError(ErrorCode.BACKEND_FAILURE, f"the world's observation of "
                                  f"boundary {boundary} has no input for port {port}", mutation)
        value = own.structured if own is not None else \
            (observation.inspection if structured else None)
        doc: dict[str, Any] = {"boundary": str(boundary), "views": views,
                               "structured": None if value is None else value.to_json()}
        attachments = shared
        if own is not None and own.arrays:
            doc["arrays"] = [a.to_json() for a in own.arrays]
            attachments = [*shared, *referenced_artifacts((), (), own.arrays)]
        out.json[agent] = doc
        out.attachments[agent] = attachments
        out.structured[agent] = value
    return out
