"""No process outlives its run (issue 34, Build item 5): a model that starts a helper with
`setsid -f` (a double fork into a session of its own, tests/fixtures/plugins/faulty.py's
`DetachingModel`) leaves nothing behind once `flyd run` ended. The helper is seen running, out
of its worker's process group and session, while the run goes on (else the test would prove
nothing), and is gone afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import orjson
import psutil
import pytest

from tests.cli.test_run import ROOT, env_for, leftovers
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(180)

MODEL = "tests.fixtures.plugins.faulty:DetachingModel"


def running(pid: int, created: float) -> bool:
    """Whether the process seen as `pid` (created at `created`) still runs."""
    try:
        proc = psutil.Process(pid)
        return bool(proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def helpers(tmp: Path) -> dict[int, float]:
    """The running helpers of this test's workers: pid → creation time."""
    found: dict[int, float] = {}
    for proc in psutil.process_iter(["cmdline", "create_time", "status"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if ("flyd-detached" in cmdline and str(tmp) in cmdline
                and proc.info["status"] != psutil.STATUS_ZOMBIE):
            found[proc.pid] = proc.info["create_time"]
    return found


@pytest.mark.parametrize(("launcher", "per_process"), [("fork", 1), ("spawn", 1), ("fork", 2)])
def test_a_plugin_that_double_forks_leaves_no_process_after_the_run(
        tmp: Path, launcher: str, per_process: int) -> None:
    """With the fork server, with plain spawn, and with both agents in one agent host."""
    config = tmp / "flyd.toml"
    config.write_text(f'[session]\nlauncher = "{launcher}"\n'
                      f"agents_per_process = {per_process}\n")
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--steps", "240", "--pace",
            "--mode", "process", "--model", MODEL, "--plugin-path", str(ROOT),
            "--config", str(config), "--socket", str(tmp / "bus.sock")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env_for(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    seen: dict[int, float] = {}
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 2 and proc.poll() is None and time.monotonic() < deadline:
            for pid, created in helpers(tmp).items():
                try:
                    # detached: a session of its own, not below any worker's group
                    assert os.getsid(pid) == pid
                except ProcessLookupError:
                    continue
                seen[pid] = created
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(seen) == 2, f"vacuous: the agents' helpers were never seen running: {seen}"
    assert proc.returncode == 0, stderr.decode()[-3000:]
    summary = orjson.loads(stdout.decode().splitlines()[-1])
    assert summary["state"] == "succeeded", summary
    survivors = [pid for pid, created in seen.items() if running(pid, created)]
    assert not survivors, f"helpers outlived the run: {survivors}"
    assert not leftovers(tmp)


def test_a_helper_ends_with_its_worker_when_a_recovery_replaces_it(tmp: Path) -> None:
    """fly-b is killed at step 60; the recovery replaces every worker, and each old worker's
    helper is gone before any new worker starts its own: never more than one per agent."""
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--steps", "240", "--pace",
            "--mode", "process", "--model", MODEL, "--plugin-path", str(ROOT),
            "--fault", "kill:fly-b@60", "--socket", str(tmp / "bus.sock")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env_for(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    seen: dict[int, float] = {}
    most = 0
    try:
        while proc.poll() is None:
            now = helpers(tmp)
            most = max(most, len(now))
            seen.update(now)
            time.sleep(0.02)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr.decode()[-3000:]
    summary = orjson.loads(stdout.decode().splitlines()[-1])
    assert summary["state"] == "succeeded" and summary["recoveries"] == 1, summary
    assert len(seen) == 4, f"vacuous: two generations of helpers were not both seen: {seen}"
    assert most == 2, f"{most} helpers ran at once: an old worker's outlived it"
    assert not [pid for pid, created in seen.items() if running(pid, created)]
