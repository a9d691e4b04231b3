"""`flyctl runs submit|list|show|cancel|requeue` against a real database and a `flyd serve` node.

Also the shared process helpers of the flyctl suites (`test_flyctl.py`, `test_control.py`,
`test_errors.py` import them): every process runs with a private temporary socket and state dir
and `FLYD_DSN` naming the test's own database; no process naming the temporary directory may
outlive a test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson
import psutil
import psycopg
import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
FLYCTL = [sys.executable, "-c", "from flyd.cli.flyd import flyctl_main; flyctl_main()"]


@dataclass
class Site:
    """One test's private directory, database and environment."""

    path: Path
    dsn: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def socket(self) -> str:
        return str(self.path / "bus.sock")

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if k not in ("FLYD_SOCKET", "RUNTIME_DIRECTORY", "FLYD_CONFIG", "FLYD_NODE_NAME",
                            "FLYD_DSN", "NOTIFY_SOCKET")}
        env.update(XDG_RUNTIME_DIR=str(self.path / "xdg"), FLYD_LOG_FORMAT="json",
                   FLYD_STATE_DIR=str(self.path / "state"), FLYD_DSN=self.dsn)
        env.update(extra)
        return env


def leftovers(path: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
        except (psutil.Error, TypeError):
            continue
        if str(path) in cmdline and proc.pid != os.getpid():
            found.append(proc)
    return found


@pytest.fixture
def site(db_dsn: str) -> Iterator[Site]:
    path = Path(tempfile.mkdtemp(prefix="flyctl-t-", dir="/tmp"))
    s = Site(path, db_dsn)
    try:
        yield s
    finally:
        for proc in s.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in s.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        deadline = time.monotonic() + 5
        survivors = leftovers(path)
        while survivors and time.monotonic() < deadline:
            time.sleep(0.1)
            survivors = leftovers(path)
        for proc in survivors:
            proc.kill()
        shutil.rmtree(path, ignore_errors=True)
        assert not survivors, f"processes outlived the test: {survivors}"


@dataclass
class Ran:
    code: int
    out: str
    err: str

    @property
    def json(self) -> Any:
        lines = self.out.splitlines()
        assert len(lines) == 1, (self.out, self.err)
        return orjson.loads(lines[0])


def flyctl(site: Site, *args: str, json: bool = True, socket: bool = True,
           env: dict[str, str] | None = None, timeout: float = 60) -> Ran:
    """Run one `flyctl` command; never a traceback on either stream."""
    argv = [*FLYCTL, *args]
    if json:
        argv.append("--json")
    if socket:
        argv += ["--socket", site.socket]
    out = subprocess.run(argv, cwd=ROOT, env=env or site.env(), capture_output=True,
                         timeout=timeout, check=False)
    ran = Ran(out.returncode, out.stdout.decode(), out.stderr.decode())
    assert "Traceback" not in ran.out and "Traceback" not in ran.err, ran
    return ran


def start_process(site: Site, argv: list[str], log: str,
                  env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    stderr: IO[bytes] = (site.path / log).open("wb")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env or site.env(), stdout=subprocess.PIPE,
                            stderr=stderr)
    site.procs.append(proc)
    return proc


def serve(site: Site, name: str = "n1", *extra: str, socket: str | None = None,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`flyd serve` on the site's socket (or `socket`); returns once its control service
    answers `flyctl status`."""
    sock = socket or site.socket
    proc = start_process(site, [sys.executable, "-m", "flyd", "serve", "--dsn", site.dsn,
                                "--socket", sock, "--state-dir", str(site.path / name),
                                "--node-name", name, *extra], f"serve-{name}.log", env)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, (site.path / f"serve-{name}.log").read_text()
        if os.path.exists(sock):
            ran = flyctl(site, "status", "--node", name, socket=False,
                         env=site.env(FLYD_SOCKET=sock))
            if ran.code == 0 and ran.json["source"] == "control":
                return proc
        time.sleep(0.2)
    raise AssertionError("flyd serve did not come up")


def run_row(site: Site, run_id: int) -> dict[str, Any]:
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT state::text, lease_epoch, attempt, outcome, cancel_requested "
                           "FROM flyd.runs WHERE run_id = %s", (run_id,)).fetchone()
    assert row is not None
    return {"state": row[0], "leaseEpoch": row[1], "attempt": row[2], "outcome": row[3],
            "cancelRequested": row[4]}


def wait_state(site: Site, run_id: int, states: set[str], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        row = run_row(site, run_id)
        if row["state"] in states:
            return row
        assert time.monotonic() < deadline, f"run {run_id} stayed {row['state']}"
        time.sleep(0.2)


def submit(site: Site, *args: str) -> int:
    ran = flyctl(site, "runs", "submit", *args, socket=False)
    assert ran.code == 0, ran
    run = ran.json["run"]
    assert isinstance(run, int)
    return run


# --------------------------------------------------------------------------------------------


def test_runs_submit_list_show_cancel_requeue(site: Site) -> None:
    # submit without a node: pending; idempotent with --key; the spec is claimable by any node
    first = submit(site, "--steps", "30", "--mode", "thread", "--key", "k1")
    assert submit(site, "--steps", "30", "--mode", "thread", "--key", "k1") == first
    clash = flyctl(site, "runs", "submit", "--steps", "31", "--key", "k1", socket=False)
    assert clash.code == 1 and clash.json["error"]["code"] == "CONFLICT"
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        found = conn.execute("SELECT spec, max_attempts FROM flyd.runs WHERE run_id = %s",
                             (first,)).fetchone()
    assert found is not None
    spec, max_attempts = found
    assert spec["steps"] == "30" and spec["mode"] == "thread" and max_attempts == 3
    assert not spec.get("exclusiveToSubmitter", False)
    assert spec["checkpoints"]["everySteps"] == 60

    listed = flyctl(site, "runs", "list", socket=False)
    assert listed.code == 0
    assert [(r["run"], r["state"]) for r in listed.json["runs"]] == [(first, "pending")]
    # the table is the result: on stdout, so `flyctl runs list | grep pending` finds the run
    table = flyctl(site, "runs", "list", socket=False, json=False)
    assert table.code == 0 and table.err == ""
    assert [line.split()[:2] for line in table.out.splitlines() if "pending" in line] == [
        [str(first), "pending"]]
    assert {"leaseEpoch", "attempt", "maxAttempts", "ownerNode", "leaseExpiresAt",
            "boundary"} <= set(listed.json["runs"][0])

    # cancel a pending run: cancelled at once; a second cancel is refused
    second = submit(site, "--steps", "30", "--mode", "thread", "--max-attempts", "1")
    ran = flyctl(site, "runs", "cancel", str(second), socket=False)
    assert ran.code == 0 and ran.json["state"] == "cancelled"
    again = flyctl(site, "runs", "cancel", str(second), socket=False)
    assert again.code == 1 and again.json["error"]["code"] == "INVALID_PHASE"
    assert flyctl(site, "runs", "list", "--state", "cancelled",
                  socket=False).json["runs"][0]["run"] == second

    # a node executes the first run; runs show lists its grant and outcome
    serve(site)
    wait_state(site, first, {"succeeded"})
    shown = flyctl(site, "runs", "show", str(first))
    assert shown.code == 0
    doc = shown.json
    assert doc["state"] == "succeeded" and doc["outcome"]["boundary"] == 30
    assert [g["endReason"] for g in doc["grants"]] == ["finished"]
    assert doc["grants"][0]["nodeId"].startswith("n1-")
    assert doc["effects"] == 31 and doc["epochs"] == ["e1"] and doc["recoveries"] == 0
    assert doc["outcome"]["behaviourDigest"] and doc["phase"] is None and doc["events"] is None
    human = flyctl(site, "runs", "show", str(first), json=False)
    assert human.code == 0 and human.err == "" and "LEASE-EPOCH" in human.out
    assert " checkpoints kept " in human.out.splitlines()[0]

    # a failing run, requeued by the operator: pending again, logged as an intervention
    bad = submit(site, "--steps", "30", "--mode", "thread", "--max-attempts", "1",
                 "--fault", "arena.acknowledge_extra_id=req-9999")
    wait_state(site, bad, {"failed"})
    refused = flyctl(site, "runs", "requeue", str(first), socket=False)
    assert refused.code == 1 and refused.json["error"]["code"] == "INVALID_PHASE"
    requeued = flyctl(site, "runs", "requeue", str(bad), socket=False)
    assert requeued.code == 0 and requeued.json == {"run": bad, "state": "pending"}
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        kinds = conn.execute("SELECT kind, run_id FROM flyd.interventions").fetchall()
    assert ("requeue", bad) in kinds
    wait_state(site, bad, {"failed"})

    # unknown runs are bad arguments
    for verb in ("show", "cancel", "requeue"):
        unknown = flyctl(site, "runs", verb, "999", socket=False)
        assert unknown.code == 2 and unknown.json["error"]["code"] == "USAGE"
