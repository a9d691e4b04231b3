"""The node's fork server and spawner with real processes (docs/launcher.md, session.md §7.5).

The test process is the node (tests/session/conftest.py). What is checked: the event loop's
thread never starts a process in either launch method; a worker forked by the server runs the
same worker as `python -m workers.agent` (same exit codes); a fork server that dies takes its
workers with it, the launcher sees them end, and the next launch starts a new server; the
configured concurrency bounds the launches in flight; an oversized request fails its launch
alone; a worker's command line is rewritten in place and never past the room it has.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import psutil
import pytest
from structlog.testing import capture_logs

from flyd.config import load_config
from flyd.launch.budget import ThreadBudget
from flyd.launch.forkserver import MAX_REQUEST
from flyd.launch.launcher import ExecutionMode, composition_plans
from flyd.launch.spawn import groups_running
from flyd.launch.spawner import LauncherSettings, Spawner
from flyd.session.runspec import AgentSpec, RunSpec
from tests.session.conftest import children, fork_server
from workers.types.domain import DomainError

if TYPE_CHECKING:
    from tests.session.conftest import LauncherFactory

pytestmark = pytest.mark.timeout(120)


def spec(agents: int) -> RunSpec:
    return RunSpec(agents=tuple(AgentSpec(f"a{i}", f"p{i}") for i in range(1, agents + 1)))


@pytest.mark.parametrize("method", ["fork", "spawn"])
async def test_the_event_loop_thread_never_starts_a_process(
        method: Literal["fork", "spawn"], launchers: LauncherFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    started_on: list[str] = []
    real = subprocess.Popen

    def recording(*args: Any, **kwargs: Any) -> Any:
        started_on.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recording)
    loop_thread = threading.current_thread().name
    spawner = Spawner(LauncherSettings(method=method))
    try:
        launcher = await launchers(budget=ThreadBudget(8, 1), spawner=spawner)
        launched = await launcher.launch_composition(spec(3), ExecutionMode.PROCESS)
        assert len(launched) == 4
        await launcher.restart("a2")
        await launcher.close()
    finally:
        await spawner.close()
    # fork: the server's own start only; spawn: the four workers and the restart
    assert len(started_on) == (1 if method == "fork" else 5), started_on
    assert loop_thread not in started_on
    assert set(started_on) == {"launch-spawner_0"}
    assert children(servers=True) == []


async def test_a_forked_worker_exits_as_a_spawned_one_does(launchers: LauncherFactory) -> None:
    """A refused model exits 2 in both methods (`EXIT_ARGS`), and the launch names the code."""
    launcher = await launchers(budget=ThreadBudget(4, 1))
    assert launcher.spawner.method == "fork"
    identity, settings, faults = composition_plans(launcher.names, spec(1))[1]
    settings = type(settings)(port_id="p1", model="no_such_module:Model")
    with pytest.raises(DomainError) as err:
        await launcher.launch(identity, settings, ExecutionMode.PROCESS, faults=faults)
    assert "exited with code 2" in err.value.message
    assert children() == []


async def test_a_dead_fork_server_takes_its_workers_and_the_next_launch_starts_another(
        launchers: LauncherFactory) -> None:
    launcher = await launchers(budget=ThreadBudget(8, 1))
    reports: list[tuple[str, DomainError]] = []
    all_reported = asyncio.Event()

    def report(worker_id: str, error: DomainError) -> None:
        reports.append((worker_id, error))
        if len(reports) == 3:
            all_reported.set()

    launched = await launcher.launch_composition(spec(2), ExecutionMode.PROCESS)
    server = psutil.Process(await launcher.spawner.parent_pid())
    workers = [psutil.Process(w.pid) for w in launched.values() if w.pid is not None]
    assert {w.ppid() for w in workers} == {server.pid}
    async with asyncio.TaskGroup() as tg:
        watch = tg.create_task(launcher.supervise(report))
        os.kill(server.pid, signal.SIGKILL)
        async with asyncio.timeout(10):
            await all_reported.wait()
        watch.cancel()
    assert sorted(wid for wid, _ in reports) == ["a1", "a2", "arena"]
    assert all(f"exited with code {-signal.SIGKILL}" in e.message for _, e in reports)
    psutil.wait_procs(workers, timeout=5)
    assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    again = await launcher.restart("a1")
    assert again.pid is not None
    new_server = psutil.Process(again.pid).ppid()
    assert new_server != server.pid and new_server == await launcher.spawner.parent_pid()
    assert not psutil.pid_exists(server.pid), "the lost server was reaped, not left a zombie"
    assert (await launcher.health_check("a1"))["state"] == "uninitialized"


async def test_the_concurrency_bounds_the_launches_in_flight(launchers: LauncherFactory) -> None:
    spawner = Spawner(LauncherSettings(concurrency=2))
    launcher = await launchers(budget=ThreadBudget(12, 1), spawner=spawner)
    most = 0

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, spawner.in_flight)
            await asyncio.sleep(0)

    try:
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(watch())
            launched = await launcher.launch_composition(spec(7), ExecutionMode.PROCESS)
            watcher.cancel()
        assert len(launched) == 8
        assert most == 2
        await launcher.close()
    finally:
        await spawner.close()


def test_the_launcher_settings_are_read_from_the_session_section() -> None:
    assert load_config(None, {}, {}).settings.session.launcher == LauncherSettings("fork", 8)
    config = load_config(None, {"session.launcher": "spawn",
                                "session.launch_concurrency": 3}, {})
    assert config.settings.session.launcher == LauncherSettings("spawn", 3)
    with pytest.raises(ValueError, match=r"\[session\] launcher"):
        load_config(None, {"session.launcher": "exec"}, {})
    with pytest.raises(ValueError, match=r"\[session\] launch_concurrency"):
        load_config(None, {"session.launch_concurrency": 0}, {})



def test_a_command_line_longer_than_the_room_is_cut_after_its_last_whole_argument() -> None:
    """`set_cmdline` rewrites the process's argument area in place: what fits shows, NUL
    separated; an argument that does not fit is left out whole; the rest is NUL padding."""
    script = ("import sys; from workers.forkserver import set_cmdline; "
              "set_cmdline(['a' * 10, 'b' * 10, 'c' * 10000]); "
              "sys.stdout.buffer.write(open('/proc/self/cmdline', 'rb').read())")
    argv = [sys.executable, "-c", script]
    out = subprocess.run(argv, capture_output=True, check=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert len(out) == sum(len(os.fsencode(a)) + 1 for a in argv), "the room did not grow"
    assert out.rstrip(b"\0").split(b"\0") == [b"a" * 10, b"b" * 10]


async def test_an_oversized_fork_request_fails_that_launch_alone(
        launchers: LauncherFactory) -> None:
    launcher = await launchers(budget=ThreadBudget(4, 1))
    identity, settings, faults = composition_plans(launcher.names, spec(1))[1]
    huge = type(settings)(port_id="p1", model_config={"blob": "x" * (MAX_REQUEST + 1)})
    with pytest.raises(DomainError) as err:
        await launcher.launch(identity, huge, ExecutionMode.PROCESS, faults=faults)
    assert (err.value.code, err.value.mutation) == ("BACKEND_FAILURE", "none")
    assert "could not be started (fork)" in err.value.message
    assert f"exceeds {MAX_REQUEST}" in err.value.message
    assert children() == []
    launched = await launcher.launch(identity.next_generation(), settings, ExecutionMode.PROCESS,
                                     faults=faults)
    assert (await launcher.health_check(launched.worker_id))["state"] == "uninitialized"


async def _until(condition: Callable[[], bool]) -> None:
    """Poll `condition` on the loop (which must keep running: the node answers reports)."""
    async with asyncio.timeout(30):
        while True:
            if condition():
                return
            await asyncio.sleep(0.005)


async def _server_spawned() -> psutil.Process:
    """The fork server the test process started, as soon as it exists."""
    await _until(lambda: any(_is_server(p) for p in psutil.Process().children()))
    return next(p for p in psutil.Process().children() if _is_server(p))


def _is_server(proc: psutil.Process) -> bool:
    try:
        return fork_server(proc)
    except psutil.NoSuchProcess:
        return False


async def test_a_launch_cancelled_while_the_fork_server_starts_leaves_it_starting_for_the_next(
        launchers: LauncherFactory) -> None:
    """A lost lease cancels the launch that is waiting for the server's imports: the wait ends
    at once and the next launch waits for the same server rather than starting another."""
    spawner = Spawner()
    try:
        async with asyncio.TaskGroup() as tg:
            first = tg.create_task(spawner.parent_pid())
            server = await _server_spawned()
            server.suspend()  # it cannot say `ready` before the cancel
            first.cancel()
        assert first.cancelled(), "the first wait had ended before the cancel"
        assert server.is_running(), "the cancel left the server starting"
        server.resume()
        assert await spawner.parent_pid() == server.pid
        launcher = await launchers(budget=ThreadBudget(4, 1), spawner=spawner)
        launched = await launcher.launch_composition(spec(1), ExecutionMode.PROCESS)
        assert {psutil.Process(w.pid).ppid() for w in launched.values() if w.pid} == {server.pid}
        assert [p.pid for p in psutil.Process().children() if _is_server(p)] == [server.pid]
        await launcher.close()
    finally:
        await spawner.close()
    assert children(servers=True) == []


async def test_an_abandoned_launcher_waits_for_no_exit_report(
        launchers: LauncherFactory) -> None:
    """After a lost lease the launcher's kills and close wait for no worker's exit report (the
    fork server's, scheduled late on a loaded host); the killed groups are gone at once, and
    the server still reaps the zombies when it reports."""
    spawner = Spawner()  # the node's: it outlives the session's launcher
    try:
        launcher = await launchers(budget=ThreadBudget(4, 1), spawner=spawner)
        launched = await launcher.launch_composition(spec(1), ExecutionMode.PROCESS)
        server = psutil.Process(await spawner.parent_pid())
        workers = {wid: psutil.Process(w.pid) for wid, w in launched.items() if w.pid}
        server.suspend()  # no exit report can reach the node
        try:
            with capture_logs() as logs:
                await launcher.kill("a1")  # not abandoned: waits KILL_WAIT_S for the report
                groups = launcher.abandon()
                await launcher.close()
            await _until(lambda: not groups_running(groups))  # the kernel ends them alone
            arena = workers["arena"].status()
        finally:
            server.resume()
        did_not_exit = [e["worker"] for e in logs
                        if e["event"] == "launcher.process-did-not-exit"]
        assert did_not_exit == ["a1"], "vacuity: a suspended server holds the exit report back"
        assert groups == [workers["arena"].pid]
        assert arena == psutil.STATUS_ZOMBIE, "gone while the server could not reap it"
        # the node answers the late reports with `reap`
        await _until(lambda: not any(psutil.pid_exists(w.pid) for w in workers.values()))
        assert children() == []
    finally:
        await spawner.close()
