"""Chaos at CI size: `scripts/chaos.py` with 8 runs, two of each victim kind (an agent, the
environment, the holder's router, the holder node itself in the two-node setup), each SIGKILLed
at a random step, on the test's database and the harness clock.

The script proves each kill (the pid gone; a recovery in the outcome; a restarted router with a
new pid; for a node kill an expired grant and a reclaim by the other node) and that nothing is
orphaned. This test checks its summary and re-reads the database on its own: every run ended
`succeeded` with `boundary-1..N` and `finish` each exactly once and the fault-free run's
`behaviourDigest`. The work directory is the test's process directory, so no process (a killed
node's router or workers included) may outlive it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli.test_soak import run_script
from tests.serve_nodes import process_dir, query

pytestmark = pytest.mark.timeout(600)

RUNS = 8
STEPS = 50
KINDS = ("agent", "environment", "router", "node")


@pytest.fixture
def tmp() -> Iterator[Path]:
    with process_dir("flyd-chaos-") as path:
        yield path


def test_every_run_survives_a_random_sigkill(db_dsn: str, tmp: Path) -> None:
    summary = run_script("chaos.py", "--runs", str(RUNS), "--steps", str(STEPS), "--dsn",
                         db_dsn, "--work-dir", str(tmp))
    seed = summary["seed"]
    assert summary["violations"] == [], (seed, summary["violations"], summary.get("logTails"))
    assert summary["ok"] and summary["nodeExits"] == {"a": 0, "b": 0}
    assert summary["victims"] == dict.fromkeys(KINDS, RUNS // len(KINDS))
    assert summary["passedByVictim"] == summary["victims"]
    assert summary["sweptNodeTempDirs"] == summary["victims"]["node"]
    records = summary["records"]
    for record in records:
        assert record["state"] == "succeeded" and not record["problems"], (seed, record)
        assert 1 <= record["targetBoundary"] <= record["killedAtBoundary"] < STEPS
        if record["victim"] == "node":
            grants = record["grants"]
            assert [record["holder"], "expired"] in [g[1:] for g in grants], (seed, grants)
            assert grants[-1][1:] == [("b" if record["holder"] == "a" else "a"), "finished"], (
                seed, grants)
        else:
            assert record["recoveries"] >= 1 and len(record["epochs"]) >= 1, record
        if record["victim"] == "router":
            assert record["newRouterPid"] not in (None, record["oldRouterPid"]), record

    runs = query(db_dsn, "SELECT run_id, state::text, outcome->>'behaviourDigest' "
                         "FROM flyd.runs ORDER BY run_id")
    reference, *chaos = runs
    assert reference[2] == summary["faultFreeDigest"]
    assert [r[0] for r in chaos] == [r["run"] for r in records]
    assert {(r[1], r[2]) for r in runs} == {("succeeded", reference[2])}
    keys = query(db_dsn, "SELECT run_id, count(*), count(DISTINCT effect_key), "
                         "count(*) FILTER (WHERE effect_key = 'finish'), max(boundary) "
                         "FROM flyd.effects GROUP BY run_id ORDER BY run_id")
    assert keys == [(r[0], STEPS + 1, STEPS + 1, 1, STEPS) for r in runs]
    reclaimed = query(db_dsn, "SELECT DISTINCT run_id FROM flyd.run_attempts "
                              "WHERE end_reason = 'expired'")
    assert {r["run"] for r in records if r["victim"] == "node"} <= {r[0] for r in reclaimed}
