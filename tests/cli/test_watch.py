"""`flyctl watch [RUN]` (docs/topics.md §15, tests 188–191) against real `flyd serve` nodes.

Test 189 does not compare wall-clock speeds (a 2-core machine shared with other suites makes a
10 % bound noise): it asserts the evidence that a stopped watcher cannot slow the run. While
the watcher is SIGSTOPped its connection holds one latest subscription of window 1 with at
most one unconsumed message, the router's `queuedMessages` stays at most 1 and
`messagesReplaced` grows (the slot is overwritten, nothing queues), and the run succeeds. The
speed itself is measured by bench/watch.py (steps/s alone, watched, and with a stopped watcher,
in one sitting).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from typing import Any

import orjson
import pytest

from bus.client import connect
from bus.errors import BusError
from bus.policy import Policy
from bus.router import Router, RouterConfig
from tests.cli.test_flyctl_runs import FLYCTL, ROOT, Site, flyctl, serve, submit, wait_state
from tests.cli.test_flyctl_runs import site as site
from tests.serve_nodes import commands_under

pytestmark = pytest.mark.timeout(60)

FAIL = ("--fault", "fly-a.fail_commit_at_step=60", "--fault", "fly-a.fail_stage_restore=true")


def fast_recovery(site: Site) -> dict[str, str]:
    """The node's environment: one recovery attempt, short backoff (a failing run ends soon)."""
    path = site.path / "flyd.toml"
    path.write_text("[checkpoints]\nevery_steps = 30\nrecovery_max_attempts = 1\n"
                    "recovery_backoff_s = 0.1\n")
    return site.env(FLYD_CONFIG=str(path))


def watcher(site: Site, *args: str, json: bool = True) -> subprocess.Popen[bytes]:
    argv = [*FLYCTL, "watch", *args, "--socket", site.socket, *(["--json"] if json else [])]
    proc = subprocess.Popen(argv, cwd=ROOT, env=site.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    site.procs.append(proc)
    return proc


def finish(proc: subprocess.Popen[bytes], timeout: float = 45) -> tuple[int, list[str], str]:
    out, err = proc.communicate(timeout=timeout)
    text, errors = out.decode(), err.decode()
    assert "Traceback" not in text and "Traceback" not in errors, (text, errors)
    return proc.returncode, text.splitlines(), errors


def objects(lines: list[str]) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in lines]


def running(site: Site, *args: str) -> int:
    run = submit(site, *args)
    wait_state(site, run, {"running"})
    return run


#: paced runs the watcher must see stepping: 10 s of world time, so a watcher that takes a few
#: seconds to start on a loaded host still sees boundaries before the end
WATCHED_STEPS = "600"


@pytest.mark.timeout(120)
def test_watch_prints_boundaries_and_the_final_state(site: Site) -> None:
    serve(site, "n1", env=fast_recovery(site))
    run = running(site, "--steps", WATCHED_STEPS, "--pace", "--mode", "thread")
    code, lines, _ = finish(watcher(site, str(run)))
    assert code == 0, lines
    *boundaries, end = objects(lines)
    assert boundaries and end == {"run": run, "state": "succeeded",
                                  "boundary": int(WATCHED_STEPS), "error": None}
    for line in boundaries:
        assert {"run", "boundary", "worldTime", "stepsPerSecond"} <= set(line)
        assert line["run"] == run
    seen = [line["boundary"] for line in boundaries]
    assert seen == sorted(set(seen))

    failing = running(site, "--steps", "600", "--pace", "--mode", "thread", *FAIL)
    code, lines, _ = finish(watcher(site, str(failing)))
    end = objects(lines)[-1]
    assert code == 1 and (end["run"], end["state"]) == (failing, "failed") and end["error"]

    cancelled = running(site, "--steps", "6000", "--pace", "--mode", "thread")
    proc = watcher(site, str(cancelled))
    assert proc.stdout is not None and proc.stdout.readline()  # watching
    assert flyctl(site, "runs", "cancel", str(cancelled), socket=False).code == 0
    code, lines, _ = finish(proc)
    assert code == 1 and objects(lines)[-1]["state"] == "cancelled"

    human = running(site, "--steps", WATCHED_STEPS, "--pace", "--mode", "thread")
    code, lines, _ = finish(watcher(site, str(human), json=False))
    assert code == 0
    *read, final = lines
    assert read and all(line.startswith(f"run {human}  boundary ") and " steps/s " in line
                        for line in read)
    assert final == f"run {human}  succeeded at boundary {WATCHED_STEPS}"


async def _watcher_connection(socket: str, pid: int) -> dict[str, Any]:
    """Router stats, and the watcher's connection in them."""
    async with connect(socket, client_id=f"ctl-{os.getpid()}-0000beef") as probe:
        stats = await probe.stats(detail=True)
    (mine,) = [c for c in stats["connectionsDetail"]
               if c["clientId"].startswith(f"ctl-{pid}-")]
    return {"stats": stats, "watcher": mine}


def test_a_stopped_watcher_does_not_slow_a_run(site: Site) -> None:
    serve(site, "n1")
    run = running(site, "--steps", "1200", "--no-pace", "--mode", "process")
    proc = watcher(site, str(run))
    assert proc.stdout is not None
    first = orjson.loads(proc.stdout.readline())
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        before = asyncio.run(_watcher_connection(site.socket, proc.pid))
        replaced = before["stats"]["counters"]["messagesReplaced"]
        deadline = time.monotonic() + 20
        after = before
        while (after["stats"]["counters"]["messagesReplaced"] < replaced + 20
               and time.monotonic() < deadline):
            time.sleep(0.2)
            after = asyncio.run(_watcher_connection(site.socket, proc.pid))
        for seen in (before, after):
            assert seen["watcher"]["subscriptions"] == 1
            assert seen["watcher"]["messageDeliveries"] <= 1
            assert seen["stats"]["queuedMessages"] <= 1
        assert after["stats"]["counters"]["messagesReplaced"] >= replaced + 20
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    code, lines, _ = finish(proc)
    assert code == 0
    *boundaries, end = objects(lines)
    # the one delivery written before the stop (in the socket, skipped 0), then the slot:
    # the boundary of the moment, with every boundary published meanwhile skipped
    assert boundaries[0]["boundary"] > first["boundary"]
    assert any(line["skipped"] >= 20 for line in boundaries[:2]), boundaries[:2]
    assert end["state"] == "succeeded" and end["boundary"] == 1200
    assert wait_state(site, run, {"succeeded"})["state"] == "succeeded"


def test_watch_resolves_the_run(site: Site) -> None:
    serve(site, "n1", "--capacity", "2")
    none = flyctl(site, "watch")
    assert none.code == 2 and "no run is held by a reachable node" in none.err

    only = running(site, "--steps", "200", "--pace", "--mode", "in-process")
    code, lines, _ = finish(watcher(site))
    assert code == 0 and objects(lines)[-1]["run"] == only

    first = running(site, "--steps", "6000", "--pace", "--mode", "in-process")
    second = running(site, "--steps", "6000", "--pace", "--mode", "in-process")
    both = flyctl(site, "watch")
    assert both.code == 2 and f"{first} (node " in both.err and f"{second} (node " in both.err
    for run in (first, second):
        assert flyctl(site, "runs", "cancel", str(run), socket=False).code == 0
        wait_state(site, run, {"cancelled"})

    finished = flyctl(site, "watch", str(only))
    assert finished.code == 0
    assert finished.json == {"run": only, "state": "succeeded", "boundary": 200, "error": None}
    gone = flyctl(site, "watch", str(first))
    assert gone.code == 1 and gone.json["state"] == "cancelled"
    unknown = flyctl(site, "watch", "999")
    assert unknown.code == 2 and "run 999 is not held by a reachable node" in unknown.err


async def test_watch_follows_a_run_across_nodes(site: Site) -> None:
    router = Router(RouterConfig(socket_path=site.socket, policy=Policy.default(None)))
    await router.start()
    try:
        await asyncio.to_thread(serve, site, "n1", "--no-router")
        run = await asyncio.to_thread(running, site, "--steps", "900", "--pace", "--mode",
                                      "in-process")
        proc = watcher(site, str(run), json=False)
        assert proc.stdout is not None
        assert (await asyncio.to_thread(proc.stdout.readline)).startswith(b"run ")
        drained = await asyncio.to_thread(flyctl, site, "drain")
        assert drained.code == 0
        await asyncio.to_thread(site.procs[0].wait, 30)
        await asyncio.to_thread(serve, site, "n2", "--no-router")
        code, lines, _ = await asyncio.to_thread(finish, proc)
    finally:
        await router.stop()
    assert code == 0, lines
    switched = [line for line in lines if "now on node n2-" in line]
    assert len(switched) == 1, lines
    assert lines[-1] == f"run {run}  succeeded at boundary 900"



async def _run_topic_back(socket: str, run: int) -> dict[str, Any]:
    """The run topic, once the node declared it again on its restarted router."""
    async with asyncio.timeout(30):
        while True:
            with contextlib.suppress(OSError, BusError):
                async with connect(socket, client_id=f"ctl-{os.getpid()}-0000cafe") as probe:
                    listed = await probe.topics(f"flyd.run.{run}")
                    if listed:
                        return listed[0]
            await asyncio.sleep(0.2)


def test_watch_outlives_a_router_restart(site: Site) -> None:
    """§15 rule 5 (with 191): the node's router is SIGKILLed mid-run; the node restarts it and
    declares the run topic again, and watch reconnects, resolves the run anew and ends with
    its final state."""
    serve(site, "n1")
    run = running(site, "--steps", "900", "--pace", "--mode", "in-process")
    proc = watcher(site, str(run))
    assert proc.stdout is not None
    first = orjson.loads(proc.stdout.readline())
    (router,) = [p for p, cmd in commands_under(site.socket)
                 if "flyd" in cmd and " router " in f" {cmd} "]
    router.kill()
    redeclared = asyncio.run(_run_topic_back(site.socket, run))
    code, lines, err = finish(proc)
    assert code == 0, (lines, err)
    *boundaries, end = objects(lines)
    assert end == {"run": run, "state": "succeeded", "boundary": 900, "error": None}
    assert boundaries and boundaries[-1]["boundary"] > first["boundary"]
    assert redeclared["owner"]["clientId"].startswith("node.n1-")
