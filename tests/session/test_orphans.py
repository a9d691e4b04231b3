"""Nothing outlives its parent (session.md §7.5 `die_with_parent`, §8 test 75)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

HELPER = """
import subprocess, sys, time
from workers.launch import die_with_parent
protected = die_with_parent(["sleep", "300"])
control = subprocess.Popen(["sleep", "300"], start_new_session=True)
print(protected.pid, control.pid, flush=True)
time.sleep(300)
"""


def gone_or_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(30)
def test_a_killed_parent_takes_its_workers_with_it() -> None:
    parent = subprocess.Popen([sys.executable, "-c", HELPER], stdout=subprocess.PIPE,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                                  os.path.abspath(__file__)))))
    control = None
    try:
        assert parent.stdout is not None
        protected, control = (int(x) for x in parent.stdout.readline().split())
        assert psutil.Process(protected).is_running() and not gone_or_zombie(protected)
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        deadline = time.monotonic() + 5
        while not gone_or_zombie(protected) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gone_or_zombie(protected)
        assert not gone_or_zombie(control)  # the unprotected control still runs
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if control is not None:
            try:
                os.kill(control, signal.SIGKILL)
            except ProcessLookupError:
                pass
