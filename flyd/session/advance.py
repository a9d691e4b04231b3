"""Phases B and C of a transition (design/session.md §6.6): the controls an `Environment.Advance`
sends, and the checks of what it returns.

Why a module of its own: these are the two places where a transition turns decisions into world
input and world output into the next boundary; both are pure (the executor is a local plugin)
and each rule here is one the world or a plugin can break, so they read best as plain checks,
apart from the coordinator's dispatch and state.

Rules:
- `controls_for` (Phase B): each agent's decision through the executor (`apply(scope, decision,
  O[k].inspection, progress, O[k].worldTime)`; any exception fails detail `apply`, blaming the
  agent), one control per agent's port (a port taken twice fails `apply`), the controls in the
  descriptor's port order, no undeclared port, each valid for its port (`check_controls`).
- `check_advance` (Phase C): the world applied this batch, from step k, reached k+1, applied the
  controls' digest; O[k+1] parses, is of boundary k+1, at O[k]'s world time plus one step, with
  the descriptor's inspection schema, its views and audio valid (`flyd.session.media`). Any failure
  is detail `observation`, blaming the world. """

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flyd.session.audio import AudioTimelines
from flyd.session.calls import Blame, as_domain_error, backend_failure
from flyd.session.fence import Detail
from flyd.session.media import Media, check_audio, check_views
from flyd.session.slots import AgentSlot
from workers.protocols import ActionExecutor
from workers.types.datatypes import (
    Attached,
    EnvironmentDescriptor,
    PortControl,
    TypedValue,
    WorldObservation,
    check_controls,
)
from workers.types.domain import DomainError, Mutation, Scope

__all__ = ["check_advance", "controls_for"]


def controls_for(scope: Scope, descriptor: EnvironmentDescriptor, agent_ids: Sequence[str],
                 slots: Mapping[str, AgentSlot], executor: ActionExecutor,
                 progress: TypedValue, old: WorldObservation) -> list[PortControl]:
    by_port: dict[str, PortControl] = {}
    for agent_id in agent_ids:
        slot = slots[agent_id]
        assert slot.decision is not None
        try:
            intent = executor.apply(scope, slot.decision, old.inspection, progress,
                                    old.world_time)
        except Exception as exc:
            raise Blame(as_domain_error(exc), Detail.APPLY, agent_id) from None
        port = slot.spec.port_id
        if port in by_port:
            raise Blame(backend_failure(f"port {port} is taken twice"), Detail.APPLY, agent_id)
        by_port[port] = intent.for_port(port)
    try:
        extra = sorted(set(by_port) - {p.port_id for p in descriptor.ports})
        if extra:
            raise backend_failure(f"controls name undeclared ports {extra}")
        controls = [by_port[p.port_id] for p in descriptor.ports if p.port_id in by_port]
        check_controls(controls, descriptor.ports)
    except DomainError as exc:
        raise Blame(exc, Detail.APPLY, None) from None
    return controls


def check_advance(k: int, result: dict[str, Any], batch_id: str, controls_digest: str,
                  descriptor: EnvironmentDescriptor, old: WorldObservation,
                  audio: AudioTimelines, world_id: str,
                  attached: Mapping[str, Attached] | None = None,
                  ) -> tuple[WorldObservation, Media]:
    """O[k+1] and its decoded media, from the Advance's result (and its opened attachments)."""
    try:
        if result.get("batchId") != batch_id:
            raise backend_failure(f"the world applied batch {result.get('batchId')}, expected "
                                  f"{batch_id}")
        if result.get("appliedFromStep") != str(k):
            raise backend_failure(f"the world applied from step {result.get('appliedFromStep')}, "
                                  f"expected {k}")
        if result.get("nextStep") != str(k + 1):
            raise backend_failure(f"the world reached step {result.get('nextStep')}, expected "
                                  f"{k + 1}")
        if result.get("appliedControlsDigest") != controls_digest:
            raise backend_failure("the world applied other controls than were sent")
        try:
            new = WorldObservation.from_json(result["observation"])
        except DomainError as exc:
            raise backend_failure(f"observation: {exc.message}") from None
        if new.boundary != k + 1:
            raise backend_failure(f"the observation is of boundary {new.boundary}, expected "
                                  f"{k + 1}")
        if new.world_time != old.world_time + descriptor.step_duration:
            raise backend_failure(f"world time {new.world_time} is not {old.world_time} plus one "
                                  "step")
        if new.inspection.schema != descriptor.inspection_schema:
            raise backend_failure("the inspection schema differs from the descriptor's")
        media = check_views(descriptor, new, k + 1, Mutation.UNKNOWN, attached)
        check_audio(descriptor, new, media, audio, attached)
    except DomainError as exc:
        raise Blame(exc, Detail.OBSERVATION, world_id) from None
    return new, media
