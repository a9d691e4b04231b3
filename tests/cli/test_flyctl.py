"""`flyctl status` and `flyctl kill` against live paced `flyd run` sessions (cli.md §7, §11 #1).

Each kill is followed by an automatic recovery (state.md §8): the run ends `succeeded` with the
behaviour digest of the same run without faults.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import orjson
import pytest

from tests.cli.test_flyctl_runs import ROOT, Site, flyctl, start_process
from tests.cli.test_flyctl_runs import site as site

pytestmark = pytest.mark.timeout(120)


# 20 s of world time: two kills, their recoveries and a few flyctl processes fit with room to
# spare on a loaded two-core machine (10 s did not always).
PACED_STEPS = "1200"


def paced_run(s: Site, log: str) -> Any:
    """`flyd run --pace --steps PACED_STEPS` on the site's socket."""
    return start_process(s, [sys.executable, "-m", "flyd", "run", "--pace", "--steps", PACED_STEPS,
                             "--json", "--socket", s.socket], log)


def live_status(s: Site, workers: int = 3, timeout: float = 30) -> dict[str, Any]:
    """`flyctl status --json` once the run's workers are all alive and stepping."""
    deadline = time.monotonic() + timeout
    while True:
        ran = flyctl(s, "status")
        if ran.code == 0:
            doc = ran.json
            if (doc["source"] == "control" and doc["runs"]
                    and len(doc["runs"][0]["workers"]) == workers
                    and all(w["alive"] and (w["step"] or 0) > 0
                            for w in doc["runs"][0]["workers"])):
                return dict(doc)
        assert time.monotonic() < deadline, ran
        time.sleep(0.3)


def _recovered(s: Site, count: int, timeout: float = 60) -> dict[str, Any]:
    """The run entry of `flyctl status` once `count` recoveries happened and every worker is
    alive again."""
    deadline = time.monotonic() + timeout
    while True:
        ran = flyctl(s, "status")
        if ran.code == 0 and ran.json["source"] == "control" and ran.json["runs"]:
            entry = ran.json["runs"][0]
            if entry["recoveries"] >= count and len(entry["workers"]) == 3 and all(
                    w["alive"] for w in entry["workers"]):
                return dict(entry)
        assert time.monotonic() < deadline, ran
        time.sleep(0.3)


def clean_digest(s: Site) -> str:
    """The behaviour digest of the same steps without faults (thread mode, unpaced)."""
    out = subprocess.run([sys.executable, "-m", "flyd", "run", "--steps", PACED_STEPS, "--mode",
                          "thread", "--json", "--socket", s.socket], cwd=ROOT, env=s.env(),
                         capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return str(orjson.loads(out.stdout)["behaviourDigest"])


def test_flyctl_status_and_kill_against_a_live_paced_run(site: Site) -> None:
    run = paced_run(site, "run.log")
    doc = live_status(site)
    assert set(doc) == {"source", "router", "nodes", "runs"}
    assert doc["router"]["uptimeMs"] > 0 and doc["router"]["socket"] == site.socket
    assert doc["router"]["connections"] >= 5
    (node,) = doc["nodes"]
    (entry,) = doc["runs"]
    assert node["runs"] == [entry["run"]] and node["state"] == "active"
    assert node["leases"] == [{"run": entry["run"], "leaseEpoch": 1,
                               "safeUntilInMs": node["leases"][0]["safeUntilInMs"]}]
    assert node["leases"][0]["safeUntilInMs"] > 0
    assert node["threads"]["used"] >= 4 and node["lastHeartbeat"]
    assert entry["leaseEpoch"] == 1 and entry["epoch"] == "e1" and entry["recoveries"] == 0
    assert entry["phase"] and entry["boundary"] > 0
    workers = {w["workerId"]: w for w in entry["workers"]}
    assert set(workers) == {"arena", "fly-a", "fly-b"}
    assert len({w["pid"] for w in workers.values()}) == 3
    for wid, w in workers.items():
        assert w["incarnationId"] == f"{wid}-inc-1"
        assert w["role"] == ("environment" if wid == "arena" else "agent")
        assert w["alive"] and w["state"] and w["step"] > 0
        assert w["threads"] >= 1 and w["uptimeMs"] > 0

    # a worker that does not exist is named as such, with the run's workers (exit 1)
    nobody = f"no worker fly-z in run {entry['run']}; workers: arena, fly-a, fly-b"
    gone = flyctl(site, "kill", "fly-z")
    assert gone.code == 1
    assert gone.json == {"error": {"code": "IDENTITY_MISMATCH", "message": nobody}}
    assert gone.err.strip() == f"flyctl kill: {nobody}"  # the diagnostic line on stderr
    killed = flyctl(site, "kill", "fly-b")
    assert killed.code == 0
    assert killed.json == {"workerId": "fly-b", "run": entry["run"], "outcome": "Terminated"}
    after = _recovered(site, 1)
    assert {w["workerId"]: w["incarnationId"] for w in after["workers"]}["fly-b"] != "fly-b-inc-1"

    stopped = flyctl(site, "kill", "fly-a", "--signal", "TERM")
    assert stopped.code == 0
    assert stopped.json == {"workerId": "fly-a", "run": entry["run"], "outcome": "Stopped"}
    _recovered(site, 2)

    out, _ = run.communicate(timeout=90)
    assert run.returncode == 0, (site.path / "run.log").read_text()[-2000:]
    summary = orjson.loads(out)
    assert summary["state"] == "succeeded" and summary["recoveries"] == 2
    assert [f["participant"] for f in summary["failures"]] == ["fly-b", "fly-a"]
    log = (site.path / "run.log").read_text()
    recoveries = [line for line in log.splitlines() if line.startswith("flyd run: recovered")]
    assert len(recoveries) == 2 and "fly-b" in recoveries[0] and "fly-a" in recoveries[1]
    assert summary["behaviourDigest"] == clean_digest(site)
