"""`flyd serve` nodes working through the shared queue (cli.md §5, §11 tests 14–15).

Real node processes on the test's own database; runs are inserted with the production submit
statement (`PgStore.submit`), as `flyctl runs submit` does.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from flyd.leases.params import LeaseParams
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.node.process import TEMP_PREFIX, sweep_dead_node_dirs
from flyd.session.runspec import RunSpec
from tests.serve_nodes import (
    commands_under,
    node_log,
    process_dir,
    processes_under,
    query,
    start_node,
    stop,
    wait_for,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def tmp() -> Iterator[Path]:
    with process_dir("flyd-s-") as path:
        yield path


async def _submit(dsn: str, spec: Mapping[str, Any]) -> int:
    store = PgStore(dsn, "test", DbSettings(), LeaseParams())
    await store.open()
    try:
        return (await store.submit(None, spec, 3)).run_id
    finally:
        await store.close()


def submit(dsn: str, spec: Mapping[str, Any]) -> int:
    return asyncio.run(_submit(dsn, spec))


def spec_json(steps: int, agents: int = 2, mode: str = "in-process") -> dict[str, Any]:
    ids = ["fly-a", "fly-b", "fly-c", "fly-d"][:agents]
    return RunSpec.validate({
        "steps": str(steps), "mode": mode,
        "agents": [{"agentId": a, "portId": f"p{i + 1}", "seed": None}
                   for i, a in enumerate(ids)]}).to_json()


def run_state(dsn: str, run: int) -> tuple[str, int, Any]:
    row = query(dsn, "SELECT state::text, attempt, outcome FROM flyd.runs WHERE run_id = %s",
                run)[0]
    return str(row[0]), int(row[1]), row[2]  # type: ignore[call-overload]


def log_events(tmp: Path, name: str, event: str) -> list[dict[str, Any]]:
    out = []
    for line in node_log(tmp, name).splitlines():
        if line.startswith("{"):
            record = orjson.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out


def test_a_run_that_does_not_fit_is_released_not_failed(db_dsn: str, tmp: Path) -> None:
    """cli.md §11 test 14 under claims-fit-first (flyd.leases.fit; docs/configuration.md): a
    node with `[node] threads = 4` and a 3-agent run (need 5) used to claim it, log
    `run_does_not_fit` and release it with refund, bumping its lease epoch on every claim poll.
    Now the claim passes it over: it is never granted, so it is neither failed nor charged an
    attempt, and stays `pending` at epoch 0 while the same node claims and finishes a later run
    that fits (so it did claim past it); a node with 8 threads then takes it at epoch 1 and it
    succeeds. The test keeps the spec's name: what it proves (not failed, attempt unchanged,
    still pending, taken by a larger node) is the spec's, without the release."""
    run = submit(db_dsn, spec_json(20, agents=3))
    fits = submit(db_dsn, spec_json(20, agents=1))
    small = start_node(tmp, "small", db_dsn, config="[node]\nthreads = 4\n")
    big = None
    try:
        wait_for("the small node to finish the run that fits",
                 lambda: run_state(db_dsn, fits)[0] in ("succeeded", "failed", "cancelled"), 60)
        assert run_state(db_dsn, fits)[0] == "succeeded"
        rows = query(db_dsn, "SELECT state::text, lease_epoch, attempt FROM flyd.runs "
                             "WHERE run_id = %s", run)
        assert rows == [("pending", 0, 0)]
        assert query(db_dsn, "SELECT 1 FROM flyd.run_attempts WHERE run_id = %s", run) == []
        assert not log_events(tmp, "small", "run_does_not_fit")
        big = start_node(tmp, "big", db_dsn, config="[node]\nthreads = 8\n")
        wait_for("the big node to finish the run",
                 lambda: run_state(db_dsn, run)[0] in ("succeeded", "failed", "cancelled"), 120)
        final, attempt, outcome = run_state(db_dsn, run)
        assert (final, attempt) == ("succeeded", 1), outcome
        owners = query(db_dsn, "SELECT n.node_name, a.lease_epoch, a.end_reason "
                               "FROM flyd.run_attempts a JOIN flyd.nodes n USING (node_id) "
                               "WHERE a.run_id = %s ORDER BY a.lease_epoch", run)
        assert owners == [("big", 1, "finished")]
    finally:
        codes = [stop(small)] + ([stop(big)] if big is not None else [])
    assert all(code == 0 for code in codes)


def test_an_invalid_run_spec_fails_with_its_path(db_dsn: str, tmp: Path) -> None:
    bad = spec_json(10)
    bad["agents"][0]["threads"] = 0
    run = submit(db_dsn, bad)
    node = start_node(tmp, "n", db_dsn)
    try:
        wait_for("the node to end the invalid run",
                 lambda: run_state(db_dsn, run)[0] not in ("pending", "running"), 60)
        state, _, outcome = run_state(db_dsn, run)
        assert state == "failed"
        assert outcome["error"] == "invalid run spec"
        assert outcome["path"] == "/agents/0/threads" and outcome["reason"]
        assert not log_events(tmp, "n", "launcher.launched")
        keys = query(db_dsn, "SELECT effect_key FROM flyd.effects WHERE run_id = %s", run)
        assert keys == [("finish",)]
        good = submit(db_dsn, spec_json(10))
        wait_for("the node to keep serving",
                 lambda: run_state(db_dsn, good)[0] == "succeeded", 60)
    finally:
        assert stop(node) == 0


def test_the_node_restarts_its_router_and_sessions_recover(db_dsn: str, tmp: Path) -> None:
    spec = RunSpec.validate({"steps": "160", "mode": "process", "paceS": 0.03,
                             "checkpoints": {"everySteps": 10}}).to_json()
    run = submit(db_dsn, spec)
    node = start_node(tmp, "n", db_dsn)
    socket = str(tmp / "n" / "bus.sock")
    try:
        wait_for("a durable checkpoint", lambda: query(
            db_dsn, "SELECT boundary >= 20 FROM flyd.run_heads WHERE run_id = %s",
            run) == [(True,)], 90)
        [router] = [p for p, cmd in commands_under(socket)
                    if "flyd" in cmd and " router " in f" {cmd} "]
        router.kill()
        wait_for("the run to end", lambda: run_state(db_dsn, run)[0] not in (
            "pending", "running"), 120)
        state, _, outcome = run_state(db_dsn, run)
        assert state == "succeeded", outcome
        assert log_events(tmp, "n", "router.restarted")
        assert log_events(tmp, "n", "recovery.reconnected")
        assert outcome["recoveries"] >= 1 and len(outcome["epochs"]) >= 2
        clean = submit(db_dsn, spec)
        wait_for("the clean run", lambda: run_state(db_dsn, clean)[0] == "succeeded", 120)
        assert run_state(db_dsn, clean)[2]["behaviourDigest"] == outcome["behaviourDigest"]
        keys = query(db_dsn, "SELECT effect_key FROM flyd.effects WHERE run_id = %s "
                             "ORDER BY boundary NULLS LAST", run)
        assert [k for (k,) in keys] == [f"boundary-{j}" for j in range(1, 161)] + ["finish"]
        busy = submit(db_dsn, spec)
        wait_for("workers of a third run", lambda: len(
            [p for p, cmd in commands_under(socket) if "workers." in cmd]) >= 3,
            60)
        assert run_state(db_dsn, busy)[0] == "running"
        node.kill()
        node.wait(10)
        wait_for("the router and workers to die with the node",
                 lambda: not processes_under(str(tmp / "n")), 10)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_two_named_nodes_share_a_host(db_dsn: str, tmp: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.serve_nodes import ROOT

    env = {k: v for k, v in os.environ.items()
           if k not in ("FLYD_SOCKET", "FLYD_STATE_DIR", "FLYD_CONFIG", "FLYD_NODE_NAME",
                        "RUNTIME_DIRECTORY", "STATE_DIRECTORY", "NOTIFY_SOCKET")}
    env.update(XDG_RUNTIME_DIR=str(tmp / "xdg"), XDG_STATE_HOME=str(tmp / "state"),
               FLYD_DSN=db_dsn, FLYD_LOG_FORMAT="json")
    defaults = {}
    for name in ("a", "b"):
        out = subprocess.run([sys.executable, "-m", "flyd", "config", "show", "--json",
                              "--node-name", name], cwd=ROOT, env=env, capture_output=True,
                             timeout=60, check=True)
        settings = orjson.loads(out.stdout)["settings"]
        defaults[name] = (settings["node.state_dir"], settings["bus.socket"])
        assert settings["node.state_dir"]["source"] == "default"
        assert settings["node.state_dir"]["value"].endswith(f"/flyd/{name}")
        assert settings["bus.socket"]["value"] == str(tmp / "xdg" / "flyd" / name / "bus.sock")
    # the default state dir of uid 0 is /var/lib/flyd/<name>: a test run as root keeps its
    # nodes' state under its temporary directory instead (the rule itself is checked above)
    state_env = ({name: {"FLYD_STATE_DIR": str(tmp / "state" / "flyd" / name)}
                  for name in ("a", "b")} if os.geteuid() == 0 else {"a": {}, "b": {}})
    nodes = {name: subprocess.Popen([sys.executable, "-m", "flyd", "serve", "--node-name",
                                     name, "--capacity", "2"], cwd=ROOT,
                                    env={**env, **state_env[name]},
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name in ("a", "b")}
    sockets = {name: tmp / "xdg" / "flyd" / name / "bus.sock" for name in nodes}
    try:
        for name, path in sockets.items():
            wait_for(f"node {name}'s router", path.exists, 60)
        assert (tmp / "state" / "flyd" / "a").is_dir() and (tmp / "state" / "flyd" / "b").is_dir()
        assert defaults["a"] != defaults["b"]
        runs = [submit(db_dsn, spec_json(10)) for _ in range(4)]
        wait_for("every run to succeed", lambda: all(
            run_state(db_dsn, r)[0] == "succeeded" for r in runs), 120)
        registered = query(db_dsn, "SELECT node_name, state FROM flyd.nodes ORDER BY node_name")
        assert registered == [("a", "active"), ("b", "active")]
        for name, path in sockets.items():
            out = subprocess.run([sys.executable, "-c", "from flyd.cli.flyd import flyctl_main; "
                                  "flyctl_main()", "status", "--json", "--socket", str(path)],
                                 cwd=ROOT, env=env, capture_output=True, timeout=60,
                                 check=False)
            assert out.returncode == 0, out.stdout + out.stderr
            status = orjson.loads(out.stdout)
            assert status["source"] == "control"
            assert [n["nodeName"] for n in status["nodes"]] == [name]
    finally:
        codes = [stop(proc) for proc in nodes.values()]
    assert codes == [0, 0]


def test_a_node_start_sweeps_the_temp_dirs_of_killed_nodes_only(tmp_path: Path) -> None:
    """A SIGKILLed node leaves `flyd-node-<pid>-*`; the next start removes it, and never the
    directory of a live pid, another uid's, or anything not named like a node's."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    names = {"dead": f"{TEMP_PREFIX}{dead.pid}-abc", "live": f"{TEMP_PREFIX}{os.getpid()}-def",
             "odd": f"{TEMP_PREFIX}x1-ghi", "other": "flyd-chaos-jkl"}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "router.toml").write_text("")
    assert sweep_dead_node_dirs(str(tmp_path)) == [names["dead"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        names[k] for k in ("live", "odd", "other"))
    assert sweep_dead_node_dirs(str(tmp_path)) == []
