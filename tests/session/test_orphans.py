"""Nothing outlives its parent (session.md §7.5 `die_with_parent`, §8 test 75), and a killed
group counts as dead once only zombies are left (distribution.md §5.5: confirming a run's process
groups dead after SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from flyd.launch.spawn import groups_running
from workers import launch

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


# A leader in its own session that forks a child; both sleep. Prints the child's pid.
FORKING_LEADER = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(300)
    os._exit(0)
print(child, flush=True)
time.sleep(300)
"""


def _state(pid: int) -> str | None:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None


@pytest.mark.timeout(30)
def test_a_killed_group_left_as_zombies_is_not_running() -> None:
    """The leader stays an unreaped zombie of ours, so `killpg(pgid, 0)` still succeeds (the
    liveness check this replaced said "alive" here until someone reaped); `groups_running` must
    say dead, while it said running before the kill."""
    leader = subprocess.Popen([sys.executable, "-c", FORKING_LEADER], stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        assert os.getpgid(child) == leader.pid
        assert groups_running([leader.pid])
        os.killpg(leader.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _state(leader.pid) != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(leader.pid) == psutil.STATUS_ZOMBIE
        os.killpg(leader.pid, 0)  # the group still exists: the zombie leader is in it
        while _state(child) not in (None, psutil.STATUS_ZOMBIE) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not groups_running([leader.pid])
    finally:
        leader.kill()
        leader.wait(5)
    assert not groups_running([leader.pid])  # reaped: the group is gone altogether


@pytest.mark.timeout(30)
def test_one_live_member_keeps_a_group_running() -> None:
    """The leader is killed and reaped; its forked child, not signalled, still runs in the
    group."""
    leader = subprocess.Popen([sys.executable, "-c", FORKING_LEADER], stdout=subprocess.PIPE,
                              start_new_session=True)
    child = None
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        leader.kill()
        leader.wait(5)
        assert _state(child) not in (None, psutil.STATUS_ZOMBIE)
        assert groups_running([leader.pid])
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)


@pytest.mark.timeout(30)
def test_groups_with_zombie_leaders_cost_one_pass_over_proc(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease runtime asks on its event loop while a lost scope's workers die: a running
    leader answers from its own stat file, a gone group from `killpg`, and every group whose
    leader is an unreaped zombie is settled in one pass over /proc together."""
    leaders = [subprocess.Popen([sys.executable, "-c", FORKING_LEADER], stdout=subprocess.PIPE,
                                start_new_session=True) for _ in range(3)]
    children = []
    passes: list[str] = []
    listdir = os.listdir

    def counting(path: str) -> list[str]:
        if path == "/proc":
            passes.append(path)
        return listdir(path)

    monkeypatch.setattr(os, "listdir", counting)
    try:
        for leader in leaders:
            assert leader.stdout is not None
            children.append(int(leader.stdout.readline()))
        assert groups_running([leader.pid for leader in leaders])
        assert passes == []  # a running leader settles it without scanning
        for leader in leaders:
            os.killpg(leader.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        for pid in [leader.pid for leader in leaders] + children:
            while _state(pid) not in (None, psutil.STATUS_ZOMBIE) and time.monotonic() < deadline:
                time.sleep(0.01)
        assert all(_state(leader.pid) == psutil.STATUS_ZOMBIE for leader in leaders)
        assert not groups_running([leader.pid for leader in leaders] + [leaders[0].pid])
        assert passes == ["/proc"]  # three suspect groups, one pass
    finally:
        for leader in leaders:
            leader.kill()
            leader.wait(5)
    passes.clear()
    # reaped leaders: the groups are gone, or hold only the children's orphan zombies
    assert not groups_running([leader.pid for leader in leaders])
    assert len(passes) <= 1


def test_resolving_prctl_starts_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """`die_with_parent` (in the node) and `arm_die_with_parent` (in every worker) resolve
    libc's `prctl`; doing so through `ctypes.util.find_library` ran `ldconfig -p` in a child,
    which a SIGKILL of the worker's group left behind as an orphan zombie."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(os, "posix_spawn", refuse)
    monkeypatch.setattr(os, "fork", refuse)
    launch.libc_prctl.cache_clear()
    assert callable(launch.libc_prctl())
