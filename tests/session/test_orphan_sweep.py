"""`flyd.launch.orphans.sweep`: which processes a scope reaches. The test process stands for the
node; its helpers are real child processes with `FLYD_SCOPE` set."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from flyd.launch.orphans import SCOPE_VAR, reap, sweep


@pytest.fixture
def helpers() -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    started: dict[str, subprocess.Popen[bytes]] = {}
    for scope in ("n.s1/a1", "n.s1/a2,a3", "n.s2/a1"):
        started[scope] = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)"],
            env={**os.environ, SCOPE_VAR: scope})
    yield started
    for proc in started.values():
        proc.kill()
        proc.wait()


def wait_environ(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """Until each helper's environment is its own (readable once it exec'd)."""
    for scope, proc in procs.items():
        for _ in range(200):
            with contextlib.suppress(psutil.Error):
                if psutil.Process(proc.pid).environ().get(SCOPE_VAR) == scope:
                    break
            time.sleep(0.01)
        else:
            raise AssertionError(f"{scope}: environment never readable")


@pytest.mark.parametrize(("scope", "deep", "reached"), [
    ("n.s1/a1", False, {"n.s1/a1"}),
    ("n.s1/a3", False, {"n.s1/a2,a3"}),  # an agent host naming a3
    ("n.s1/a4", True, set()),
    ("n.s1", True, {"n.s1/a1", "n.s1/a2,a3"}),  # the session: all its workers' scopes
    ("n.s", True, set()),  # a prefix of another session's scope is not it
])
def test_a_scope_reaches_its_own_processes_only(
        helpers: dict[str, subprocess.Popen[bytes]], scope: str, deep: bool,
        reached: set[str]) -> None:
    wait_environ(helpers)
    killed = sweep(scope, deep=deep)
    assert {p.pid for p in killed} == {helpers[s].pid for s in reached}
    assert reap(killed, 5.0) == []
    for name, proc in helpers.items():
        assert (proc.poll() is not None) == (name in reached), name


def test_spared_pids_are_left_alone(helpers: dict[str, subprocess.Popen[bytes]]) -> None:
    wait_environ(helpers)
    spared = helpers["n.s1/a1"].pid
    killed = sweep("n.s1", spare={spared})
    assert spared not in {p.pid for p in killed} and helpers["n.s1/a1"].poll() is None
