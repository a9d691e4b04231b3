"""An abandoned `flyd run` is ended by a live `flyd serve` node's reaper, end to end
(docs/leases.md, "Reap"; docs/cli.md, `flyd run`).

`flyd run` is SIGKILLed mid-run: its router and workers die with it and its run stays `running`
in the database. Database time (`flyd.sim_clock`, which `flyd.app_now()` reads in test databases)
is then moved past the run's lease and the submitter's staleness bound, so no TTL is slept out;
the `flyd serve` node on the same database ends the run `failed` with outcome
`{"error": "submitter gone"}` at its next reap, and `flyctl runs show` says so.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psycopg
import pytest

from tests.cli.test_flyctl_runs import ROOT, Site, flyctl, leftovers, run_row, serve, wait_state
from tests.cli.test_flyctl_runs import site as site

pytestmark = pytest.mark.timeout(120)


def running_run(site: Site, proc: subprocess.Popen[bytes]) -> int:
    """The run `flyd run` submitted, once it has committed a few boundaries."""
    deadline = time.monotonic() + 60
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "flyd run ended early"
            row = conn.execute(
                "SELECT r.run_id FROM flyd.runs r WHERE r.state = 'running' AND EXISTS ("
                "SELECT 1 FROM flyd.effects e WHERE e.run_id = r.run_id "
                "AND e.boundary >= 10)").fetchone()
            if row is not None:
                return int(row[0])
            time.sleep(0.1)
    raise AssertionError("flyd run committed no boundary within 60 s")


def test_a_killed_flyd_run_is_ended_submitter_gone_by_a_serve_reaper(site: Site) -> None:
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--steps", "100000", "--pace",
            "--mode", "process", "--dsn", site.dsn, "--socket", str(site.path / "run.sock"),
            "--state-dir", str(site.path / "run-state")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=site.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    site.procs.append(proc)
    run = running_run(site, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while leftovers(site.path) and time.monotonic() < deadline:  # die-with-parent
        time.sleep(0.1)
    assert not leftovers(site.path), "the router or a worker outlived flyd run"
    # vacuity: the run is abandoned, not ended by its own node
    assert run_row(site, run)["state"] == "running"

    serve(site, "reaper")
    assert run_row(site, run)["state"] == "running", "reaped before the lease could expire"
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO flyd.sim_clock (t) SELECT greatest(max(r.lease_expires_at), "
            "max(n.heartbeat_at) + make_interval(secs => 60)) + interval '1 second' "
            "FROM flyd.runs r, flyd.nodes n WHERE r.run_id = %s", (run,))
    ended = wait_state(site, run, {"failed", "succeeded", "cancelled"}, timeout=60)
    assert ended["state"] == "failed"
    assert ended["outcome"] == {"error": "submitter gone"}

    shown = flyctl(site, "runs", "show", str(run), socket=False)
    assert shown.code == 0
    assert shown.json["state"] == "failed"
    assert shown.json["outcome"] == {"error": "submitter gone"}
