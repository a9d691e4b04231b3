"""The behaviour record v2 (session.md §6.12, amendment 2026-12-07), at the record builder.

A world can diverge while every agent decides exactly as before (a policy that ignores what it
sees, a changed pixel no model reads): the v1 record held only the views' step numbers and the
rewards' event ids, so such a divergence left the behaviour digest unchanged. Each test below
changes one thing the v1 record did not hold — one byte of one view, one value of the
structured input, one reward value — and shows that the v1 fields stay identical while the v2
record, and so the digest over the records, differs.
"""

from __future__ import annotations

import hashlib
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flyd.session.records import rewards_digest, transition_records
from flyd.session.runspec import AgentSpec
from flyd.session.slots import AgentSlot
from flyd.session.trace import EpochRebase, compare
from workers.protocols import AgentOutcome, Evaluation
from workers.synthetic.task import CounterTask
from workers.types.canonical import canonical, digest_of, typed_digest
from workers.types.datatypes import (
    VIEW_CONTENT_TYPE,
    Reward,
    SchemaRef,
    TypedValue,
    ViewRef,
    WorldObservation,
    encode_media,
)
from workers.types.domain import Scope
from workers.types.ticks import RationalNs

SCHEMA = SchemaRef("test.value.v1", 1, "0" * 64)
AGENTS = ("fly-a", "fly-b")
V2_KEYS = ("inputDigests", "rewardsDigest")


def typed(value: Any) -> TypedValue:
    return TypedValue(SCHEMA, value)


def slots() -> dict[str, AgentSlot]:
    out = {}
    for index, agent_id in enumerate(AGENTS):
        slot = AgentSlot(AgentSpec(agent_id, f"p{index + 1}"), {"digest": "e" * 64}, index, {})
        slot.prepared = {"ticksAdvanced": "16", "brainTicks": "26",
                         "remainder": {"numerator": "2", "denominator": "3"}}
        slot.decision = typed({"inc": index == 0})
        out[agent_id] = slot
    return out


def observation(pixels: bytes, inspection: dict[str, Any]) -> WorldObservation:
    view = ViewRef("arena", 1, encode_media(VIEW_CONTENT_TYPE, pixels))
    return WorldObservation(1, RationalNs(1, 60), None, (view,), typed(inspection), ("arena",),
                            ())


TASK = CounterTask(max_agents=4)


def evaluation(reward_a: float, epoch: str) -> Evaluation:
    first, second = TASK.minted_ids(epoch, 1)[:2]
    outcomes = {"fly-a": AgentOutcome((Reward(first, "score", reward_a),)),
                "fly-b": AgentOutcome((Reward(second, "score", 1.0),))}
    return Evaluation(outcomes, {a: typed({"available": []}) for a in AGENTS},
                      typed({"counter": 1}), (), None)


def record(pixels: bytes = bytes(16), inspection: dict[str, Any] | None = None,
           reward_a: float = 0.5, structured: bool = True, epoch: str = "e1") -> dict[str, Any]:
    """The behaviour record of transition 0 → 1; the structured input each agent was sent is
    the observation's inspection (the coordinator's `_commit`), digested once."""
    new = observation(pixels, {"counter": 1} if inspection is None else inspection)
    digest = typed_digest(new.inspection) if structured else None
    behaviour, _ = transition_records(
        Scope("demo", epoch, 0), list(AGENTS), slots(), f"batch-{epoch}-0", "c" * 64, new,
        evaluation(reward_a, epoch), {a: {"committedStep": "1"} for a in AGENTS}, "req-1", 0,
        {a: digest for a in AGENTS})
    return behaviour


def v1(behaviour: dict[str, Any]) -> dict[str, Any]:
    """The same record as the v1 builder wrote it."""
    out = {k: v for k, v in behaviour.items() if k not in V2_KEYS}
    out["observationBoundaries"] = [{k: v for k, v in e.items() if k != "digest"}
                                    for e in behaviour["observationBoundaries"]]
    return out


def assert_only_v2_sees(base: dict[str, Any], changed: dict[str, Any], field: str) -> None:
    assert canonical(v1(base)) == canonical(v1(changed)), "v1 would have seen it too"
    assert digest_of([v1(base)]) == digest_of([v1(changed)])
    assert digest_of([base]) != digest_of([changed])
    assert compare([changed], [base]) == (0, field)


def test_the_record_carries_the_delivered_digests() -> None:
    pixels = bytes(range(16))
    behaviour = record(pixels)
    assert behaviour["observationBoundaries"] == [
        {"viewId": "arena", "producedStep": "1", "digest": hashlib.sha256(pixels).hexdigest()}]
    want = typed_digest(typed({"counter": 1}))
    assert behaviour["inputDigests"] == [{"agentId": a, "digest": want} for a in AGENTS]
    assert behaviour["rewardsDigest"] == digest_of([
        {"agentId": "fly-a", "rule": "score", "value": 0.5},
        {"agentId": "fly-b", "rule": "score", "value": 1.0}])
    assert record(structured=False)["inputDigests"] == [
        {"agentId": a, "digest": None} for a in AGENTS]


def test_changing_one_observation_byte_changes_the_behaviour_digest() -> None:
    pixels = bytes(16)
    flipped = pixels[:-1] + b"\x01"
    assert_only_v2_sees(record(pixels), record(flipped), "observationBoundaries")


def test_changing_one_input_value_changes_the_behaviour_digest() -> None:
    base = record(inspection={"counter": 1, "position": [0.25, 0.5]})
    changed = record(inspection={"counter": 1, "position": [0.25, 0.5000001]})
    assert_only_v2_sees(base, changed, "inputDigests")


def test_changing_one_reward_changes_the_behaviour_digest() -> None:
    assert_only_v2_sees(record(reward_a=0.5), record(reward_a=0.25), "rewardsDigest")


def test_an_epoch_rebase_leaves_the_v2_digests_untouched() -> None:
    e1, e2 = record(epoch="e1"), record(epoch="e2")
    rebased = EpochRebase("e2", "e1", TASK).apply(e2)
    for key in ("inputDigests", "rewardsDigest", "observationBoundaries"):
        assert rebased[key] == e2[key] == e1[key]
    assert rebased["scope"]["epoch"] == "e1" and rebased["batchId"] == "batch-e1-0"
    assert compare([e2], [e1], EpochRebase("e2", "e1", TASK)) is None


ids = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,63}", fullmatch=True)
values = st.one_of(st.floats(allow_nan=False, allow_infinity=False, min_value=-(2.0**53 - 1),
                             max_value=2.0**53 - 1),
                   st.integers(min_value=-(2**53) + 1, max_value=2**53 - 1),
                   st.sampled_from([0.0, -0.0, 1e-7, 2.5e-7, 1.5e-300, 123456789.125, 1 / 3]))


@settings(deadline=None, max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(ids, st.lists(st.tuples(ids, values), max_size=3)), max_size=6,
                unique_by=lambda agent: agent[0]))
def test_the_rewards_digest_is_digest_of_its_canonical_list(
        agents: list[tuple[str, list[tuple[str, float]]]]) -> None:
    """The record builder writes the rewards' canonical bytes itself; they must be exactly
    `canonical`'s, for every number spelling (integers, integral floats, exponents, -0)."""
    outcomes = {a: AgentOutcome(tuple(Reward(f"ev-{i}", rule, value)
                                      for i, (rule, value) in enumerate(rewards)))
                for a, rewards in agents}
    evaluation = Evaluation(outcomes, {}, typed({}), (), None)
    order = sorted(outcomes)
    assert rewards_digest(order, evaluation) == digest_of(
        [{"agentId": a, "rule": rule, "value": value}
         for a in order for rule, value in ((r.rule_id, r.value) for r in outcomes[a].rewards)])
