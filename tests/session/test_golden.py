"""Test 32: the golden run through the coordinator matches §4.8's reference numbers, and its
behaviour records (session.md §6.12, record v2 of the amendment of 2026-12-07) the golden
behaviour digest."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest

from flyd.session.publication import Publication
from tests.session.harness import Fixture, SessionHarness
from workers.types.canonical import digest_of

pytestmark = pytest.mark.timeout(60)

# digest_of the golden run's three behaviour records (v2: each view's content digest, each
# agent's structured-input digest, the rewards digest); byte-identical from here on
GOLDEN_BEHAVIOUR_DIGEST = "c87ba56343ce399bc709bc34a1a5dd65f523063d8e5fc995efbb5af41bd08392"

# k -> {agent: (inc, dec, bias)}, counter after k, ticks, remainder
GOLDEN = [
    ({"fly-a": (False, False, -0.25), "fly-b": (True, False, 0.0)}, 1, "16",
     {"numerator": "2000000", "denominator": "3"}),
    ({"fly-a": (True, False, -0.5), "fly-b": (True, False, 0.25)}, 3, "17",
     {"numerator": "1000000", "denominator": "3"}),
    ({"fly-a": (False, True, 0.5), "fly-b": (True, False, -0.25)}, 3, "17",
     {"numerator": "0", "denominator": "1"}),
]


def _decision(snapshot: dict[str, Any], agent_id: str) -> tuple[bool, bool, float]:
    agent = next(a for a in snapshot["agents"] if a["agentId"] == agent_id)
    value = agent["selectedDecision"]["value"]
    buttons = {b["id"]: b["down"] for b in value["buttons"]}
    return buttons["inc"], buttons["dec"], value["axes"][0]["value"]


def _telemetry(snapshot: dict[str, Any], agent_id: str) -> dict[str, Any]:
    agent = next(a for a in snapshot["agents"] if a["agentId"] == agent_id)
    telemetry: dict[str, Any] = agent["telemetry"]
    return telemetry


async def test_the_golden_run_matches_the_reference_numbers() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        c = h.coordinator
        for agent_id in ("fly-a", "fly-b"):
            assert await h.mutations_of(agent_id) == 11
        boot = c.snapshots.latest
        assert boot is not None
        rates = {a: _telemetry(boot, a) for a in ("fly-a", "fly-b")}
        assert rates["fly-a"]["brainTicks"] == "10"
        assert rates["fly-a"]["populationRateHz"] == 36.3
        assert [r["hz"] for r in rates["fly-a"]["rates"]] == [16.3, 7.3]
        assert rates["fly-b"]["populationRateHz"] == 6.5
        assert [r["hz"] for r in rates["fly-b"]["rates"]] == [16.5, 26.5]
        feed = c.snapshots.subscribe(depth=16, replay=False)
        reports = await h.run(3)
        assert [r.boundary for r in reports] == [1, 2, 3]
        snapshots = [p.body for p in feed.pending() if isinstance(p, Publication)
                     and p.kind == "snapshot"]
        assert len(snapshots) == 3
        behaviour = [t.behaviour for t in c.trace.transitions]
        for k, (decisions, counter, ticks, remainder) in enumerate(GOLDEN):
            snap = snapshots[k]
            for agent_id, want in decisions.items():
                assert _decision(snap, agent_id) == want, (k, agent_id)
            assert snap["progress"]["value"]["counter"] == counter
            for agent in behaviour[k]["agents"]:
                assert agent["ticksAdvanced"] == ticks
                assert agent["remainder"] == remainder
            # each view's digest is that of the bytes the agents were sent
            assert behaviour[k]["observationBoundaries"] == [
                {"viewId": v["viewId"], "producedStep": v["producedStep"],
                 "digest": hashlib.sha256(base64.b64decode(v["pixels"]["data"])).hexdigest()}
                for v in snap["media"]["views"]]
            # the arena offers no structured input
            assert behaviour[k]["inputDigests"] == [{"agentId": a, "digest": None}
                                                    for a in ("fly-a", "fly-b")]
        assert digest_of(behaviour) == GOLDEN_BEHAVIOUR_DIGEST
        assert c.observation is not None
        last_chunk = c.observation.audio[0]
        assert last_chunk.first_sample + last_chunk.sample_frames == 2400
        assert [s["media"]["audio"][0]["firstSample"] for s in snapshots] == ["0", "800", "1600"]
        last = snapshots[-1]
        for agent_id in ("fly-a", "fly-b"):
            assert await h.mutations_of(agent_id) == 67
            telemetry = _telemetry(last, agent_id)
            assert telemetry["brainTicks"] == "60"
            assert telemetry["learning"]["updates"] == "3"
        assert _telemetry(last, "fly-a")["learning"]["changed"] == "2"
        assert _telemetry(last, "fly-a")["learning"]["signal"] == -1.0
        assert _telemetry(last, "fly-b")["learning"]["changed"] == "3"
        assert _telemetry(last, "fly-b")["learning"]["signal"] == 1.0
        assert c.progress().value == {"counter": 3, "transitions": 3, "totalReward": 3.0}
        assert await h.progress_of("arena") == 4
        assert c.phase.label == "Ready(3)" and c.stats.to_json()["advances"] == 3
        assert c.metrics.to_json()["latencyUs"]["step"]["count"] == 3
