"""Soak at CI size: `scripts/soak.py` with 20 clean sessions and 5 with a worker SIGKILLed at a
random step, on one long-lived `flyd serve` node and the test's database.

The script applies the criteria of its docstring (no growth of the node's and the router's fds,
threads and RSS between the first and the last tenth of the measured sessions, an idle node with
only its router, no leftover socket or temporary file, a clean drain) and reports them; this test
checks its summary and re-reads the database on its own: every run `succeeded` once with
`boundary-1..N` and `finish` each exactly once and one behaviour digest per kind of session, and
every kill proven. Every fifth session (the last kill session among them) renders 256×256 views,
which travel as artifacts of the router's store: after every session the store is empty again.
The work directory is the test's process directory, so no process may outlive it.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.serve_nodes import ROOT, process_dir, query

pytestmark = pytest.mark.timeout(600)

SESSIONS = 20
KILLS = 5
STEPS = 50
MEDIA_EVERY = 5


@pytest.fixture
def tmp() -> Iterator[Path]:
    with process_dir("flyd-soak-") as path:
        yield path


def run_script(name: str, *args: str) -> dict[str, Any]:
    """The script's JSON summary (stdout); its progress lines are kept for the failure text."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=ROOT,
                         capture_output=True, timeout=540, check=False)
    assert out.stdout.strip(), out.stderr.decode(errors="replace")[-3000:]
    summary: dict[str, Any] = orjson.loads(out.stdout)
    assert out.returncode == (0 if summary["ok"] else 1)
    return summary


def test_soak_sessions_leave_nothing_behind(db_dsn: str, tmp: Path) -> None:
    summary = run_script("soak.py", "--sessions", str(SESSIONS), "--kill-sessions", str(KILLS),
                         "--steps", str(STEPS), "--dsn", db_dsn, "--work-dir", str(tmp))
    seed = summary["seed"]
    assert summary["violations"] == [], (seed, summary["violations"])
    assert summary["ok"] and summary["nodeExit"] == 0
    assert summary["samplesMeasured"] == SESSIONS + KILLS - summary["warmup"] >= 15
    growth = summary["growth"]
    for metric in ("node_fds", "node_threads", "router_fds", "router_threads"):
        assert growth[metric]["lastTenthMedian"] <= growth[metric]["firstTenthMedian"], metric
    for metric in ("node_rss", "router_rss"):
        assert growth[metric]["lastTenthMedian"] <= 1.1 * growth[metric]["firstTenthMedian"]
    assert growth["descendants"] == [1]
    assert len({s["router_pid"] for s in summary["samples"]}) == 1
    kills = summary["kills"]
    assert len(kills) == KILLS
    for kill in kills:
        assert kill["victim"] in ("fly-a", "fly-b", "arena")
        assert 1 <= kill["targetBoundary"] <= kill["killedAtBoundary"] < STEPS
        assert kill["state"] == "succeeded" and kill["recoveries"] >= 1, (seed, kill)

    runs = query(db_dsn, "SELECT run_id, state::text, outcome->>'behaviourDigest', "
                         "(outcome->>'recoveries')::int FROM flyd.runs ORDER BY run_id")
    assert [r[1] for r in runs] == ["succeeded"] * (SESSIONS + KILLS)
    media = {r[0] for i, r in enumerate(runs, start=1) if i % MEDIA_EVERY == 0}
    assert summary["mediaSessions"] == len(media) == (SESSIONS + KILLS) // MEDIA_EVERY
    assert {r[2] for r in runs if r[0] not in media} == {summary["behaviourDigest"]}
    assert {r[2] for r in runs if r[0] in media} == {summary["mediaBehaviourDigest"]}
    assert any(k["media"] for k in kills)  # a recovery by reference too
    # by reference, really: the arena's view of every boundary, and every artifact collected
    assert summary["artifactsAllocated"] >= len(media) * STEPS
    assert all(s["store_artifacts"] == s["store_bytes"] == s["store_files"] == 0
               for s in summary["samples"])
    assert {k["run"] for k in kills} <= {r[0] for r in runs if r[3] >= 1}
    keys = query(db_dsn, "SELECT run_id, count(*), count(DISTINCT effect_key), "
                         "count(*) FILTER (WHERE effect_key = 'finish'), max(boundary) "
                         "FROM flyd.effects GROUP BY run_id ORDER BY run_id")
    assert keys == [(r[0], STEPS + 1, STEPS + 1, 1, STEPS) for r in runs]
    assert not list((tmp / "soak" / "run").iterdir())
    assert not list((tmp / "soak" / "tmp").iterdir())
