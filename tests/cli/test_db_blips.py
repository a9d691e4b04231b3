"""`flyd run` under PostgreSQL blips, with real processes and a real server.

A blip is a burst of `pg_terminate_backend` on every other session of the test's own database
(the node's work pool, heartbeat and listener sessions, the checkpoint store's connection and
`flyd run`'s own end-of-run poll), repeated for a while, as a server restart or a failover
would do. The run must still succeed with the clean behaviour digest, record every boundary
exactly once, and print its `--json` summary without a traceback.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import orjson
import psycopg
import pytest

from tests.cli.test_run import _DSN, ROOT, clean_digest, env_for, ledger, leftovers
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(180)

STEPS = 1500
BURST_S = 2.0
BURST_EVERY_S = 0.15

TERMINATE = """
SELECT application_name, pg_terminate_backend(pid)
  FROM pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid()
"""


class Blips:
    """Bursts of backend terminations on one database, from a thread of the test."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.ended: list[str] = []

    def burst(self, seconds: float = BURST_S) -> None:
        end = time.monotonic() + seconds
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while time.monotonic() < end:
                for name, done in conn.execute(TERMINATE).fetchall():
                    if done:
                        self.ended.append(str(name))
                time.sleep(BURST_EVERY_S)


def boundary_effects(dsn: str, run: int) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM flyd.effects WHERE run_id = %s AND "
                           "boundary IS NOT NULL", (run,)).fetchone()
    return int(row[0]) if row is not None else 0


#: the checkpoint store's reads (flyd.state.checkpoints), as `db.read_retry` names them
CHECKPOINT_READS = {"read checkpoints", "read head", "read run", "end backend"}


def log_events(stderr: bytes) -> list[dict[str, object]]:
    """The JSON log lines of `flyd run`'s stderr (FLYD_LOG_FORMAT=json)."""
    events = []
    for line in stderr.splitlines():
        if line.startswith(b"{"):
            try:
                events.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return events


def latest_run(dsn: str) -> int | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT max(run_id) FROM flyd.runs").fetchone()
    return None if row is None or row[0] is None else int(row[0])


def test_flyd_run_survives_repeated_bursts_of_backend_terminations(tmp: Path) -> None:
    """Issue items 1 and 2: the checkpoint store's reads, the lease store's commits and the
    end-of-run poll all outlive their connections. The bursts must end the checkpoint store's
    own session (its application name) and a checkpoint read must log its retry: without the
    read connection's reconnect the run fails."""
    dsn = _DSN[tmp]
    reference = clean_digest(tmp, STEPS)
    before = latest_run(dsn)  # the reference run: the bursts wait for the new run's own row
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--steps", str(STEPS), "--pace",
            "--mode", "thread", "--socket", str(tmp / "bus.sock")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env_for(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    blips = Blips(dsn)
    bursts = 0
    try:
        deadline = time.monotonic() + 60
        run = None
        while run is None or boundary_effects(dsn, run) < 60:
            assert proc.poll() is None and time.monotonic() < deadline, "never checkpointed"
            time.sleep(0.1)
            if run is None:
                newest = latest_run(dsn)
                run = newest if newest != before else None
        while proc.poll() is None and bursts < 3:
            worker = threading.Thread(target=blips.burst)
            worker.start()
            worker.join()
            bursts += 1
            time.sleep(1.0)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert bursts >= 2, "the run ended before the blips were repeated"
    roles = {name.rsplit(":", 1)[-1] for name in blips.ended}
    assert {"work", "heartbeat", "checkpoints"} <= roles, \
        f"the bursts ended no node session, or not the checkpoint store's: {blips.ended}"
    assert b"Traceback" not in stderr, stderr.decode()[-3000:]
    # a checkpoint read found its session ended and went on over a new one
    retried = {event.get("what") for event in log_events(stderr)
               if event.get("event") == "db.read_retry"}
    assert retried & CHECKPOINT_READS, f"no checkpoint read crossed a blip: {retried}"
    assert proc.returncode == 0, stderr.decode()[-3000:]
    lines = stdout.decode().splitlines()
    assert len(lines) == 1, stdout
    summary = orjson.loads(lines[0])
    assert summary["state"] == "succeeded", summary
    assert summary["boundary"] == STEPS and summary["behaviourDigest"] == reference
    state, keys = ledger(tmp, summary["run"])
    assert state == "succeeded"
    assert keys == [f"boundary-{k}" for k in range(1, STEPS + 1)] + ["finish"]
    assert not leftovers(tmp)
