"""`flyd run --trace` across re-grants and full disks (issue 34, Build item 3).

A run re-granted after a PostgreSQL interruption (the test's own database refuses connections
and its sessions are terminated, as tests/cli/test_db_blips.py terminates them, for longer than
the run's lease in database time, so the node loses the lease and claims the run again) has a
trace with every boundary once, a resume mark as each grant's first line, and the clean
behaviour digest. A trace on a full tmpfs ends the run at once, naming the
path and the errno, in one attempt, and `flyd run --json` still prints its summary.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.cli.test_db_blips import boundary_effects, latest_run
from tests.cli.test_run import _DSN, ROOT, clean_digest, env_for, flyd_run, leftovers
from tests.cli.test_run import tmp as tmp
from workers.types.canonical import digest_of

pytestmark = pytest.mark.timeout(240)

STEPS = 600
OUTAGE_S = 1.5
#: a node that missed heartbeats across the moved database time is still the run's submitter
#: (else the reaper would end the run "submitter gone" instead of letting it be re-granted)
LEASES = "[leases]\nnode_stale_after_s = 120\n"


def run_row(dsn: str, run: int) -> tuple[int, int]:
    """The run's lease epoch (grants so far) and its `run_attempts` rows."""
    with psycopg.connect(dsn) as conn:
        epoch = conn.execute("SELECT lease_epoch FROM flyd.runs WHERE run_id = %s",
                             (run,)).fetchone()
        grants = conn.execute("SELECT count(*) FROM flyd.run_attempts WHERE run_id = %s",
                              (run,)).fetchone()
    assert epoch is not None and grants is not None
    return int(epoch[0]), int(grants[0])


def trace_lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


class Outage:
    """PostgreSQL unreachable for the test's own database: no new connection is allowed
    (`ALLOW_CONNECTIONS false`) and every session of it is terminated, as
    tests/cli/test_db_blips.py terminates them, then connections are allowed again. The outage
    outlasts the run's lease in database time (`flyd.sim_clock`, which `flyd.app_now()` reads
    in test databases, is moved past the lease's expiry as connections come back), so no TTL
    is slept out: the node finds its lease expired, gives the run up and claims it again."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.name = conninfo_to_dict(dsn)["dbname"]
        self.admin = make_conninfo(dsn, dbname="postgres")

    def _allow(self, allow: bool) -> None:
        with psycopg.connect(self.admin, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(
                sql.Identifier(str(self.name)), sql.Literal(allow)))

    def hold(self, seconds: float, run: int) -> int:
        """Hold the outage for `seconds`, expiring `run`'s lease; the number of sessions it
        terminated."""
        ended = 0
        self._allow(False)
        try:
            with psycopg.connect(self.admin, autocommit=True) as conn:
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    for (done,) in conn.execute(TERMINATE_OTHERS,
                                                {"name": self.name}).fetchall():
                        ended += bool(done)
                    time.sleep(0.1)
        finally:
            self._allow(True)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("INSERT INTO flyd.sim_clock (t) SELECT lease_expires_at + interval "
                         "'1 second' FROM flyd.runs WHERE run_id = %s", (run,))
        return ended


TERMINATE_OTHERS = """
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
 WHERE datname = %(name)s AND pid <> pg_backend_pid()
"""


def test_a_run_regranted_after_a_postgresql_interruption_has_a_trace_with_every_boundary(
        tmp: Path) -> None:
    dsn = _DSN[tmp]
    reference = clean_digest(tmp, STEPS)
    before = latest_run(dsn)
    trace = tmp / "trace.jsonl"
    config = tmp / "flyd.toml"
    config.write_text(LEASES)
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--steps", str(STEPS), "--pace",
            "--mode", "thread", "--trace", str(trace), "--config", str(config),
            "--socket", str(tmp / "bus.sock")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env_for(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    outage = Outage(dsn)
    run: int | None = None
    try:
        deadline = time.monotonic() + 60
        while run is None or boundary_effects(dsn, run) < 60:
            assert proc.poll() is None and time.monotonic() < deadline, "never checkpointed"
            time.sleep(0.1)
            if run is None:
                newest = latest_run(dsn)
                run = newest if newest != before else None
        assert run is not None
        ended = outage.hold(OUTAGE_S, run)
        stdout, stderr = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    epoch, grants = run_row(dsn, run)
    assert ended > 0, "vacuous: the outage ended no session of the node"
    assert epoch > 1 and grants > 1, "vacuous: the run was never re-granted"
    assert b"Traceback" not in stderr, stderr.decode()[-3000:]
    assert proc.returncode == 0, stderr.decode()[-3000:]
    summary = orjson.loads(stdout.decode().splitlines()[-1])
    assert summary["state"] == "succeeded" and summary["behaviourDigest"] == reference
    lines = trace_lines(trace)
    marks = [(i, line["resume"]) for i, line in enumerate(lines) if "resume" in line]
    records = [line for line in lines if "resume" not in line]
    # every boundary once, in order, and the records are the ledger's
    assert [int(r["scope"]["step"]) for r in records] == list(range(STEPS))
    assert digest_of(records) == reference
    # each grant's first line says where it resumes
    grant_marks = [m for _, m in marks if m["cause"] == "grant"]
    assert marks[0][0] == 0 and marks[0][1]["cause"] == "grant"
    assert (marks[0][1]["boundary"], marks[0][1]["leaseEpoch"]) == ("0", "1")
    assert len(grant_marks) == grants, (grant_marks, grants)
    later = grant_marks[-1]
    assert int(later["leaseEpoch"]) == epoch and int(later["boundary"]) > 0
    for index, found in marks:  # a mark sits right after the record of its boundary
        before_mark = [r for r in lines[:index] if "resume" not in r]
        assert len(before_mark) == int(found["boundary"]), (index, found)
    assert not leftovers(tmp)


def test_a_recovered_run_has_a_trace_with_every_boundary_once(tmp: Path) -> None:
    """fly-b is killed at step 150: the recovery resumes from the head (boundary 120, cadence
    60) and steps 121..150 again; their records replace the ones it abandoned."""
    trace = tmp / "trace.jsonl"
    code, summary, _ = flyd_run(tmp, "--steps", "240", "--mode", "process",
                                "--fault", "kill:fly-b@150", "--trace", str(trace))
    assert code == 0 and summary["state"] == "succeeded", summary
    assert summary["recoveries"] == 1, "vacuous: nothing was recovered"
    lines = trace_lines(trace)
    marks = [(i, line["resume"]) for i, line in enumerate(lines) if "resume" in line]
    records = [line for line in lines if "resume" not in line]
    assert [int(r["scope"]["step"]) for r in records] == list(range(240))
    assert digest_of(records) == summary["behaviourDigest"]
    assert [m["cause"] for _, m in marks] == ["grant", "recovery"]
    index, recovery = marks[1]
    assert recovery["boundary"] == "120" and recovery["epoch"] == "e2", recovery
    assert index == 1 + 120  # right after record 120


@pytest.fixture
def full_tmpfs(tmp: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, filled up but for what an empty file needs (root mounts it)."""
    mount = tmp / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                   check=True)
    try:
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * 4096)
        finally:
            os.close(fd)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize(("option", "name"), [("--trace", "trace.jsonl"),
                                              ("--record", "run.gif")])
def test_a_trace_on_a_full_tmpfs_ends_the_run_at_once_naming_the_path(
        tmp: Path, full_tmpfs: Path, option: str, name: str) -> None:
    """The trace, and an output file of the same kind (the GIF of `--record`, written as the
    run goes)."""
    if os.geteuid() != 0:
        pytest.fail("mounting the tmpfs needs root (CI runs the suite as root)")
    path = full_tmpfs / name
    with pytest.raises(OSError):  # vacuity: the file system is full
        (full_tmpfs / "probe").write_bytes(b"x" * 4096)
    code, summary, stderr = flyd_run(tmp, "--steps", "600", "--mode", "thread",
                                     option, str(path))
    assert code == 1 and summary["state"] == "failed", summary
    outcome = summary["outcome"]
    assert outcome == {"error": "output write failed", "option": option,
                       "path": str(path), "errno": "ENOSPC",
                       "message": "No space left on device"}, outcome
    assert summary["recoveries"] == 0 and summary["boundary"] < 600
    assert run_row(_DSN[tmp], summary["run"]) == (1, 1), "one attempt"
    assert f"output write failed: {option} {path}: ENOSPC" in stderr
    assert "recovery.started" not in stderr
