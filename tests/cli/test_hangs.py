"""Hangs are faults (issue 34, item 2): real `flyd serve` nodes, real PostgreSQL, real signals.

A router or fork server SIGSTOPped for longer than the node's call deadline (`[session]
health_fail_s`, short here) misses its liveness probe, is killed and replaced like a dead one,
and the run it held succeeds with the clean behaviour digest and no attempt spent. A node whose
router cannot be brought back stops claiming, hands its run back with refund, says why in
`flyctl status` and stops its systemd watchdog pings; once the router is back it claims again.
A fork server that cannot be started again (a `sitecustomize` on its plugin path that exits)
is given up the same way, and `flyctl status` (the router answers) names it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from flyd.session.runspec import RunSpec
from tests.cli.test_flyctl_runs import FLYCTL
from tests.cli.test_serve import log_events, run_state, submit
from tests.cli.test_systemd import FakeManager
from tests.serve_nodes import (
    ROOT,
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


def _start_notified(tmp: Path, db_dsn: str, manager: FakeManager) -> subprocess.Popen[bytes]:
    """`flyd serve` as node `n` under a fake service manager with `WATCHDOG_USEC` 1 s."""
    home = tmp / "n"
    home.mkdir(exist_ok=True)
    (home / "flyd.toml").write_text(HEALTH)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLYD_", "WATCHDOG_")) and k != "NOTIFY_SOCKET"}
    env.update(NOTIFY_SOCKET=manager.address, WATCHDOG_USEC="1000000")
    return subprocess.Popen(
        [sys.executable, "-m", "flyd", "serve", "--dsn", db_dsn, "--socket",
         str(home / "bus.sock"), "--state-dir", str(home), "--node-name", "n",
         "--config", str(home / "flyd.toml"), "--log-format", "json", "-v", "--capacity", "1"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=(home / "node.log").open("ab"))


def _status(tmp: Path, db_dsn: str) -> dict[str, Any]:
    ran = subprocess.run([*FLYCTL, "status", "--json", "--socket", str(tmp / "n" / "bus.sock"),
                          "--dsn", db_dsn], cwd=ROOT, capture_output=True, timeout=60,
                         check=False)
    assert ran.returncode == 0, ran.stderr.decode()[-2000:]
    return dict(orjson.loads(ran.stdout))


def test_a_node_whose_router_cannot_be_brought_back_stops_claiming_and_says_why(
        db_dsn: str, tmp: Path) -> None:
    manager = FakeManager(str(tmp / "notify.sock"), str(tmp / "notify.sock"))
    node = _start_notified(tmp, db_dsn, manager)
    socket = tmp / "n" / "bus.sock"
    try:
        manager.until("READY", 60)
        run = submit(db_dsn, _spec())
        stopped = _stop_part(tmp, db_dsn, run, "router")
        # Nothing can bind the socket path any more: every restart of the router fails.
        socket.rename(tmp / "n" / "moved.sock")
        socket.mkdir()
        wait_for("the router to be given up",
                 lambda: bool(log_events(tmp, "n", "part.given_up")), 60)
        assert not _alive(stopped)
        [given_up] = log_events(tmp, "n", "part.given_up")
        assert given_up["part"] == "router"
        assert "could not be brought back" in str(given_up["reason"])
        wait_for("the run handed back with refund", lambda: run_state(db_dsn, run)[:2] == (
            "pending", 0), 60)
        assert [e for e in log_events(tmp, "n", "claims_held")], "claims held"
        wait_for("the registry to say why", lambda: query(
            db_dsn, "SELECT state, reason IS NOT NULL FROM flyd.nodes") == [("draining", True)],
            30)
        shown = _status(tmp, db_dsn)
        assert shown["source"] == "database", "no router answers"
        [row] = shown["nodes"]
        assert row["state"] == "draining" and "router" in row["reason"], row
        status = manager.until_status(r"impaired: ", 30)
        assert "could not be brought back" in status
        since = time.monotonic()
        manager.drain_for(3.0)
        assert not manager.times("WATCHDOG", since=since), "no watchdog ping while impaired"
        assert run_state(db_dsn, run)[:2] == ("pending", 0), "the node claims nothing"
        # The path is free again: the router comes back, the node claims and runs the run.
        socket.rmdir()
        wait_for("the router back", lambda: bool(log_events(tmp, "n", "part.recovered")), 60)
        resumed = time.monotonic()
        wait_for("the run to end", lambda: run_state(db_dsn, run)[0] not in (
            "pending", "running"), 150)
        state, attempt, outcome = run_state(db_dsn, run)
        assert state == "succeeded" and attempt == 1, (outcome, node_log(tmp, "n")[-3000:])
        manager.drain_for(1.5)
        assert manager.times("WATCHDOG", since=resumed), "pings again once the router is back"
        assert query(db_dsn, "SELECT state, reason FROM flyd.nodes") == [("active", None)]
    finally:
        assert stop(node) == 0
        manager.close()


def test_a_node_whose_fork_server_cannot_be_brought_back_says_why_in_flyctl_status(
        db_dsn: str, tmp: Path) -> None:
    plugins = tmp / "plugins"
    plugins.mkdir()
    config = HEALTH + f"[plugins]\npaths = [{str(plugins)!r}]\n"
    run = submit(db_dsn, _spec())
    node = start_node(tmp, "n", db_dsn, config=config)
    try:
        stopped = _stop_part(tmp, db_dsn, run, "-m", "workers.forkserver")
        # A fork server started from now on (plugin roots lead its PYTHONPATH) cannot start.
        (plugins / "sitecustomize.py").write_text("raise SystemExit(3)\n")
        wait_for("the fork server to be given up",
                 lambda: bool(log_events(tmp, "n", "part.given_up")), 90)
        assert not _alive(stopped)
        [given_up] = log_events(tmp, "n", "part.given_up")
        assert given_up["part"] == "fork server"
        wait_for("the run handed back with refund", lambda: run_state(db_dsn, run)[:2] == (
            "pending", 0), 60)
        shown = _status(tmp, db_dsn)
        assert shown["source"] == "control", "the router answers"
        [row] = shown["nodes"]
        assert row["state"] == "draining", row
        assert row["reason"].startswith("the fork server could not be brought back"), row
        human = subprocess.run([*FLYCTL, "status", "--socket", str(tmp / "n" / "bus.sock"),
                                "--dsn", db_dsn], cwd=ROOT, capture_output=True, timeout=60,
                               check=False)
        assert f"reason {row['reason']}" in human.stdout.decode()
        (plugins / "sitecustomize.py").unlink()
        wait_for("the fork server back",
                 lambda: bool(log_events(tmp, "n", "part.recovered")), 60)
        wait_for("the run to end", lambda: run_state(db_dsn, run)[0] not in (
            "pending", "running"), 150)
        state, attempt, outcome = run_state(db_dsn, run)
        assert state == "succeeded" and attempt == 1, (outcome, node_log(tmp, "n")[-3000:])
        assert _status(tmp, db_dsn)["nodes"][0]["reason"] is None
    finally:
        assert stop(node) == 0
