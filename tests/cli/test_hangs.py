"""Hangs are faults (issue 34, item 2): real `flyd serve` nodes, real PostgreSQL, real signals.

A router or fork server SIGSTOPped for longer than the node's call deadline (`[session]
health_fail_s`, short here) misses its liveness probe, is killed and replaced like a dead one,
and the run it held succeeds with the clean behaviour digest and no attempt spent. A node whose
router cannot be brought back stops claiming and says why; a run submitted then waits, its
attempts untouched.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from flyd.session.runspec import RunSpec
from tests.cli.test_serve import log_events, run_state, submit
from tests.serve_nodes import (
    commands_under,
    node_log,
    process_dir,
    query,
    start_node,
    stop,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)

STEPS = 900
EVERY = 60
#: short health budgets: a probe every 0.5 s, 2 s for its answer (the call deadline)
HEALTH = "[session]\nhealth_probe_s = 0.5\nhealth_fail_s = 2.0\n"
#: how long a part stays stopped before the test looks: well past the deadline
STOPPED_S = 2.0


@pytest.fixture
def tmp() -> Iterator[Path]:
    with process_dir("flyd-h-") as path:
        yield path


def _spec() -> dict[str, Any]:
    return RunSpec.validate({"steps": str(STEPS), "mode": "process", "paceS": 1 / 60,
                             "checkpoints": {"everySteps": EVERY}}).to_json()


def _pids(tmp: Path, *needles: str) -> list[int]:
    return [p.pid for p, cmd in commands_under(str(tmp / "n"))
            if all(f" {n} " in f" {cmd} " for n in needles)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_part(tmp: Path, db_dsn: str, run: int, *needles: str) -> int:
    """Once the run has a durable checkpoint: SIGSTOP the part found by `needles`."""
    wait_for("a durable checkpoint", lambda: query(
        db_dsn, "SELECT boundary >= %s FROM flyd.run_heads WHERE run_id = %s",
        EVERY, run) == [(True,)], 90)
    wait_for(f"one {' '.join(needles)}", lambda: len(_pids(tmp, *needles)) == 1, 30)
    [pid] = _pids(tmp, *needles)
    os.kill(pid, signal.SIGSTOP)
    return pid


def _succeeded_clean(tmp: Path, db_dsn: str, run: int) -> dict[str, Any]:
    """The run ended `succeeded` on its first lease attempt, every boundary once, with the
    behaviour digest of a clean run of the same spec; no recovery attempt was charged."""
    wait_for("the run to end", lambda: run_state(db_dsn, run)[0] not in (
        "pending", "running"), 150)
    state, attempt, outcome = run_state(db_dsn, run)
    assert state == "succeeded", (outcome, node_log(tmp, "n")[-4000:])
    assert attempt == 1, "no lease attempt was spent"
    spent = log_events(tmp, "n", "recovery.attempt_failed")
    assert not spent, f"recovery attempts spent on a hung part: {spent}"
    keys = query(db_dsn, "SELECT effect_key FROM flyd.effects WHERE run_id = %s "
                         "ORDER BY boundary NULLS LAST", run)
    assert [k for (k,) in keys] == [f"boundary-{j}" for j in range(1, STEPS + 1)] + ["finish"]
    clean = submit(db_dsn, _spec())
    wait_for("the clean run", lambda: run_state(db_dsn, clean)[0] == "succeeded", 120)
    assert run_state(db_dsn, clean)[2]["behaviourDigest"] == outcome["behaviourDigest"]
    return dict(outcome)


def test_router_sigstop_beyond_the_call_deadline_ends_in_a_replaced_router(
        db_dsn: str, tmp: Path) -> None:
    run = submit(db_dsn, _spec())
    node = start_node(tmp, "n", db_dsn, config=HEALTH)
    try:
        stopped = _stop_part(tmp, db_dsn, run, "router")
        wait_for("the stopped router to be killed", lambda: not _alive(stopped), 30)
        wait_for("a new router", lambda: len(_pids(tmp, "router")) == 1, 30)
        assert _pids(tmp, "router") != [stopped]
        replacing = log_events(tmp, "n", "part.replacing")
        assert [e["part"] for e in replacing] == ["router"], replacing
        assert "did not answer its liveness probe within 2s" in str(replacing[0]["reason"])
        wait_for("the router's replacement", lambda: bool(log_events(tmp, "n", "part.replaced")),
                 30)
        assert [e["part"] for e in log_events(tmp, "n", "part.replaced")] == ["router"]
        _succeeded_clean(tmp, db_dsn, run)
    finally:
        assert stop(node) == 0


def test_fork_server_sigstop_ends_in_a_replaced_fork_server(db_dsn: str, tmp: Path) -> None:
    run = submit(db_dsn, _spec())
    node = start_node(tmp, "n", db_dsn, config=HEALTH)
    try:
        stopped = _stop_part(tmp, db_dsn, run, "-m", "workers.forkserver")
        # A worker's death needs the fork server for the recovery's launches.
        [agent] = _pids(tmp, "workers.agent", "fly-a")
        os.kill(agent, signal.SIGKILL)
        wait_for("the stopped fork server to be killed", lambda: not _alive(stopped), 30)
        wait_for("a new fork server",
                 lambda: len(_pids(tmp, "-m", "workers.forkserver")) == 1, 60)
        assert _pids(tmp, "-m", "workers.forkserver") != [stopped]
        replacing = log_events(tmp, "n", "part.replacing")
        assert {e["part"] for e in replacing} == {"fork server"}, replacing
        assert "did not answer its liveness probe within 2s" in str(replacing[0]["reason"])
        outcome = _succeeded_clean(tmp, db_dsn, run)
        assert outcome["recoveries"] >= 1
    finally:
        assert stop(node) == 0
