"""The trace records of one transition (design/session.md §6.12).

Why a module of its own: the behaviour record is what the golden runs compare byte for byte
(their `behaviourDigest`) and what a durable checkpoint's effects carry; its fields, and the
operational record beside it, are written down here once, from the transition's values.

- behaviour (v2, design/session.md §6.12 and its amendment of 2026-12-07): the scope of k; per agent
  (by id) its profile digest, the Prepare's `ticksAdvanced`, `brainTicks` and `remainder`, the
  decision's digest and the committed step; the batch id, the controls' digest, the
  acknowledged boundary (k+1), per view (by view id) its produced step and the digest of its
  bytes as delivered (`pixels.digest`: the router checked it at seal for a view by reference,
  the coordinator's decode for an inline one, so it is never hashed again here), per agent (by
  id) the digest of its structured input (`inputDigests`, `typed_digest` of the value sent,
  null where it got none), the rewards' event ids (by agent) and `rewardsDigest` (`digest_of`
  the rewards `[{agentId, rule, value}]` in that same order), the task events' ids, the
  published boundary and no boundary actions. A world that diverges while every decision stays
  the same therefore changes the record: its views, its inspection (the structured input) or
  the task's rewards differ.
- operational: wall time since the transition started, the Prepare, Advance and Commit request
  ids, no bus call ids, no captures yet (a capture at k+1 adds itself).
- result (`result_record`): what the boundary produced, for people and their tools (the line
  `flyctl runs export` prints): the boundary k+1 as a number, the world time at it, per agent
  (by id, every bound agent present) its rewards `{eventId, ruleId, value}`, the task events
  and the task's progress. Event ids are rebased onto `e1` like the behaviour record's, so a
  recovered run produces the same lines as an undisturbed one. Never compared or digested.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from flyd.session.slots import AgentSlot
from workers.protocols import Evaluation
from workers.types.canonical import digest_bytes, digest_of, format_number, typed_digest
from workers.types.datatypes import WorldObservation
from workers.types.domain import Scope, is_id

__all__ = ["observation_entries", "result_record", "rewards_digest", "transition_records"]


def transition_records(scope: Scope, agent_ids: Sequence[str], slots: Mapping[str, AgentSlot],
                       batch_id: str, controls_digest: str, new: WorldObservation,
                       evaluation: Evaluation, commits: Mapping[str, dict[str, Any]],
                       advance_request_id: str, wall: int,
                       input_digests: Mapping[str, str | None],
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The behaviour and operational records of transition `scope.step` → +1; `wall` is
    `time.monotonic_ns()` at its start; `input_digests` is each agent's structured-input digest
    as its Commit sent it (None where it sent none)."""
    k = scope.step
    agents = []
    outcome_ids: list[str] = []
    for agent_id in agent_ids:
        slot = slots[agent_id]
        prepared = slot.prepared or {}
        agents.append({
            "agentId": agent_id, "profileDigest": slot.profile["digest"],
            "ticksAdvanced": prepared.get("ticksAdvanced"),
            "brainTicks": prepared.get("brainTicks"),
            "remainder": prepared.get("remainder"),
            "decisionDigest": typed_digest(slot.decision) if slot.decision else None,
            "committedStep": commits[agent_id]["committedStep"]})
        outcome_ids += [r.event_id for r in evaluation.outcomes[agent_id].rewards]
    behaviour = {
        "scope": scope.to_json(), "agents": agents, "batchId": batch_id,
        "controlDigest": controls_digest,
        "acknowledgedBoundary": str(new.boundary),
        "observationBoundaries": observation_entries(new),
        "inputDigests": [{"agentId": a, "digest": input_digests[a]} for a in sorted(agent_ids)],
        "outcomeIds": outcome_ids, "rewardsDigest": rewards_digest(agent_ids, evaluation),
        "eventIds": [e.id for e in evaluation.events],
        "publishedBoundary": str(k + 1), "boundaryActions": []}
    operational = {
        "wallTimeNs": time.monotonic_ns() - wall,
        "prepareRequestIds": [{"agentId": a, "requestId": slots[a].prepare_request}
                              for a in agent_ids],
        "advanceRequestId": advance_request_id,
        "commitRequestIds": [{"agentId": a, "requestId": slots[a].commit_request}
                             for a in agent_ids],
        "busCallIds": [], "captures": []}
    return behaviour, operational


def observation_entries(observation: WorldObservation) -> list[dict[str, str]]:
    """`observationBoundaries`: per view, by view id, its produced step and the digest of its
    bytes as delivered. A restored world reports its `observationDigests` in this form
    (design/state.md §6.5) and a checkpoint's prior inspection records its views in it."""
    return [{"viewId": v.view_id, "producedStep": str(v.produced_step),
             "digest": v.pixels.digest}
            for v in sorted(observation.sensory_views, key=lambda v: v.view_id)]


def rewards_digest(agent_ids: Sequence[str], evaluation: Evaluation) -> str:
    """`digest_of` the transition's rewards `[{agentId, rule, value}]`: agents in the given
    (sorted) order, the task's order within each, as `outcomeIds` lists their event ids.

    Written directly: the keys are in canonical order already, an Id needs no escaping and
    `format_number` is canonical JSON's own number rule, so the bytes are `canonical`'s
    (tests/session/test_behaviour_record.py checks it) at a quarter of its cost, which counts
    at 64 agents. A rule or agent that is not an Id goes through `canonical` (which then
    words its refusal, if any)."""
    parts: list[str] = []
    for agent_id in agent_ids:
        for reward in evaluation.outcomes[agent_id].rewards:
            if not (is_id(agent_id) and is_id(reward.rule_id)):
                return digest_of([{"agentId": a, "rule": r.rule_id, "value": r.value}
                                  for a in agent_ids for r in evaluation.outcomes[a].rewards])
            parts.append(f'{{"agentId":"{agent_id}","rule":"{reward.rule_id}","value":'
                         f'{format_number(reward.value)}}}')
    return digest_bytes(("[" + ",".join(parts) + "]").encode("ascii"))


def result_record(k: int, agent_ids: Sequence[str], new: WorldObservation,
                  evaluation: Evaluation, ids: Mapping[str, str]) -> dict[str, Any]:
    """The result of transition k → k+1; `ids` renames the event ids minted in this epoch to
    their `e1` spelling (`EpochRebase.id_map`, empty in `e1`)."""
    rewards = {a: [{"eventId": ids.get(r.event_id, r.event_id), "ruleId": r.rule_id,
                    "value": r.value} for r in evaluation.outcomes[a].rewards]
               for a in agent_ids}
    events = []
    for event in evaluation.events:
        doc = event.to_json()
        doc["id"] = ids.get(event.id, event.id)
        events.append(doc)
    return {"boundary": k + 1, "worldTime": new.world_time.to_json(), "rewards": rewards,
            "events": events, "progress": evaluation.progress.to_json()}
