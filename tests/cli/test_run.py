"""`flyd run` end to end with real processes (cli.md §4) on a fresh test database.

Every run is `python -m flyd run …` in a subprocess with a private temporary `--socket` (or a
temporary `XDG_RUNTIME_DIR`) and `FLYD_DSN` naming the test's own database, so no test touches a
real system path or another test's queue; after each run no process whose command line names
the temporary directory may remain (router and workers all carry `--socket <path>`).
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
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from flyd.node.router_child import router_answers
from tests.cli.test_flyctl_runs import FLYCTL, Site
from tests.cli.test_flyctl_runs import site as site

pytestmark = pytest.mark.timeout(120)

STEPS = 40
ROOT = Path(__file__).resolve().parents[2]


_DSN: dict[Path, str] = {}


@pytest.fixture
def tmp(db_dsn: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="flyd-t-", dir="/tmp"))
    _DSN[path] = db_dsn
    try:
        yield path
    finally:
        _DSN.pop(path, None)
        survivors = leftovers(path)
        for proc in survivors:
            proc.kill()
        shutil.rmtree(path, ignore_errors=True)
        assert not survivors, f"processes outlived the test: {survivors}"


def env_for(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLYD_SOCKET", "RUNTIME_DIRECTORY", "FLYD_CONFIG", "FLYD_NODE_NAME")}
    env["XDG_RUNTIME_DIR"] = str(tmp / "xdg")
    env["FLYD_LOG_FORMAT"] = "json"
    env["FLYD_STATE_DIR"] = str(tmp / "state")
    env["FLYD_DSN"] = _DSN[tmp]
    return env


def leftovers(tmp: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
        except (psutil.Error, TypeError):
            continue
        if str(tmp) in cmdline and proc.pid != os.getpid():
            found.append(proc)
    return found


def flyd_run(tmp: Path, *args: str, socket: bool = True,
             timeout: float = 90) -> tuple[int, dict[str, Any], str]:
    argv = [sys.executable, "-m", "flyd", "run", "--json", *args]
    if socket:
        argv += ["--socket", str(tmp / "bus.sock")]
    out = subprocess.run(argv, cwd=ROOT, env=env_for(tmp), capture_output=True,
                         timeout=timeout, check=False)
    assert not leftovers(tmp), "a router or worker outlived flyd run"
    assert b"Traceback" not in out.stderr and b"Traceback" not in out.stdout
    lines = out.stdout.decode().splitlines()
    assert len(lines) == 1, out.stdout
    return out.returncode, orjson.loads(lines[0]), out.stderr.decode()


SUMMARY_KEYS = {"run", "state", "steps", "boundary", "epochs", "recoveries", "advances",
                "checkpoints", "behaviourDigest", "worldProgress", "counter", "wallSeconds",
                "stepsPerSecond", "mode", "workers", "failures", "outcome"}

_CLEAN: dict[int, str] = {}


def clean_digest(tmp: Path, steps: int = STEPS) -> str:
    if steps not in _CLEAN:
        code, summary, _ = flyd_run(tmp, "--steps", str(steps), "--mode", "thread")
        assert code == 0 and summary["state"] == "succeeded"
        _CLEAN[steps] = summary["behaviourDigest"]
    return _CLEAN[steps]


@pytest.mark.parametrize("mode", ["process", "thread", "inprocess"])
def test_the_behaviour_digest_is_the_same_in_every_mode(tmp: Path, mode: str) -> None:
    code, summary, _ = flyd_run(tmp, "--steps", str(STEPS), "--mode", mode)
    assert code == 0
    assert set(summary) == SUMMARY_KEYS
    assert summary["state"] == "succeeded"
    assert summary["mode"] == ("in-process" if mode == "inprocess" else mode)
    assert summary["boundary"] == summary["advances"] == summary["steps"] == STEPS
    assert summary["epochs"] == ["e1"] and summary["recoveries"] == 0
    assert summary["checkpoints"] == 1 and isinstance(summary["run"], int)  # the final one
    assert summary["worldProgress"] == str(STEPS + 1)
    assert summary["failures"] == []
    assert sorted(w["workerId"] for w in summary["workers"]) == ["arena", "fly-a", "fly-b"]
    assert all(w["incarnationId"] == f"{w['workerId']}-inc-1" for w in summary["workers"])
    if mode == "process":
        assert len({w["pid"] for w in summary["workers"]}) == 3
    if mode == "thread":  # this is the clean reference run itself
        _CLEAN.setdefault(STEPS, summary["behaviourDigest"])
    assert summary["behaviourDigest"] == clean_digest(tmp)


@pytest.mark.parametrize("dispatch", ["sequential", "reversed"])
def test_the_behaviour_digest_is_the_same_in_every_dispatch_order(tmp: Path,
                                                                   dispatch: str) -> None:
    code, summary, _ = flyd_run(tmp, "--steps", str(STEPS), "--mode", "thread",
                                "--dispatch", dispatch)
    assert code == 0 and summary["state"] == "succeeded"
    assert summary["behaviourDigest"] == clean_digest(tmp)


def test_flyd_run_prints_the_summary(tmp: Path) -> None:
    trace = tmp / "trace.jsonl"
    code, summary, _ = flyd_run(tmp, "--steps", "120", "--trace", str(trace))
    assert code == 0 and set(summary) == SUMMARY_KEYS
    assert summary["state"] == "succeeded" and summary["boundary"] == 120
    assert summary["epochs"] == ["e1"] and summary["recoveries"] == 0
    assert summary["checkpoints"] == 2, "cadence 60: one at 60, the final one at 120"
    lines = [orjson.loads(line) for line in trace.read_bytes().splitlines()]
    assert lines[0]["resume"]["boundary"] == "0" and lines[0]["resume"]["cause"] == "grant"
    records = lines[1:]
    assert len(records) == 120 and not any("resume" in r for r in records)
    assert [r["scope"]["step"] for r in records[:2]] == ["0", "1"]
    from workers.types.canonical import digest_of

    assert digest_of(records) == summary["behaviourDigest"]
    import psycopg

    from flyd.session.runspec import RunSpec

    with psycopg.connect(_DSN[tmp]) as conn:
        payloads = [r[0] for r in conn.execute(
            "SELECT payload FROM flyd.effects WHERE run_id = %s AND boundary IS NOT NULL "
            "ORDER BY boundary", (summary["run"],)).fetchall()]
        finish = conn.execute("SELECT count(*) FROM flyd.effects WHERE run_id = %s AND "
                              "effect_key = 'finish'", (summary["run"],)).fetchone()
        row = conn.execute("SELECT spec FROM flyd.runs WHERE run_id = %s",
                           (summary["run"],)).fetchone()
    assert digest_of(payloads) == summary["behaviourDigest"]
    assert finish == (1,)
    assert row is not None
    stored = RunSpec.validate(row[0])
    assert (stored.seed_of("fly-a"), stored.seed_of("fly-b")) == (7, 11)
    code, seeded, _ = flyd_run(tmp, "--steps", "3", "--mode", "inprocess", "--seed", "42")
    assert code == 0 and seeded["mode"] == "in-process"
    with psycopg.connect(_DSN[tmp]) as conn:
        row = conn.execute("SELECT spec FROM flyd.runs WHERE run_id = %s",
                           (seeded["run"],)).fetchone()
    assert row is not None
    derived = RunSpec.validate(row[0])
    assert [derived.seed_of(a) for a in ("fly-a", "fly-b")] == [1329356413, 1459314961]


def test_a_cancelled_or_failed_run_exits_1(tmp: Path) -> None:
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--pace", "--steps", "600",
            "--socket", str(tmp / "bus.sock")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env_for(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        import psycopg

        from tests.serve_nodes import wait_for

        def running() -> bool:
            with psycopg.connect(_DSN[tmp]) as conn:
                return conn.execute("SELECT count(*) FROM flyd.runs WHERE state = 'running'"
                                    ).fetchone() == (1,)

        wait_for("the paced run to be running", running, 60)
        with psycopg.connect(_DSN[tmp]) as conn:
            found = conn.execute("SELECT run_id FROM flyd.runs").fetchone()
        assert found is not None
        cancel = subprocess.run([*FLYCTL, "runs", "cancel", str(found[0]), "--json", "--dsn",
                                 _DSN[tmp]], cwd=ROOT, env=env_for(tmp), capture_output=True,
                                timeout=60, check=False)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, stderr[-2000:]
    summary = orjson.loads(stdout)
    assert summary["state"] == "cancelled" and summary["boundary"] < 600
    state, keys = ledger(tmp, summary["run"])
    assert state == "cancelled"
    assert keys == [f"boundary-{k}" for k in range(1, summary["boundary"] + 1)] + ["finish"]
    code, failed, _ = flyd_run(tmp, "--steps", "20", "--mode", "in-process", "--fault",
                               "arena.acknowledge_extra_id=req-9999", timeout=120)
    assert code == 1 and failed["state"] == "failed"
    with psycopg.connect(_DSN[tmp]) as conn:
        row = conn.execute("SELECT outcome FROM flyd.runs WHERE run_id = %s",
                           (failed["run"],)).fetchone()
    assert row is not None and row[0]["error"] == "recovery attempts exhausted"
    assert row[0]["attempts"] == 3


def test_the_default_budget_runs_the_default_composition_on_two_cpus(tmp: Path) -> None:
    two = {0, 1} if len(os.sched_getaffinity(0)) >= 2 else set(os.sched_getaffinity(0))

    def pinned() -> None:
        os.sched_setaffinity(0, two)

    def show(*args: str) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "flyd", "config", "show", "--json", *args],
                             cwd=ROOT, env=env_for(tmp), capture_output=True, timeout=60,
                             check=False, preexec_fn=pinned)
        assert out.returncode == 0, out.stdout + out.stderr
        settings: dict[str, Any] = orjson.loads(out.stdout)["settings"]
        return settings

    plain = show()
    assert plain["node.capacity"]["value"] == 1 and plain["node.threads"]["value"] == 4
    assert show("--capacity", "3")["node.threads"]["value"] == 12
    out = subprocess.run([sys.executable, "-m", "flyd", "run", "--json", "--steps", "60",
                          "--socket", str(tmp / "bus.sock")], cwd=ROOT, env=env_for(tmp),
                         capture_output=True, timeout=120, check=False, preexec_fn=pinned)
    assert out.returncode == 0, out.stderr[-2000:]
    assert orjson.loads(out.stdout)["state"] == "succeeded"


@pytest.mark.parametrize("fault", ["fly-b.prepare_delay_ms=2600@5", "lose-advance-result@7"])
def test_a_recoverable_fault_keeps_the_clean_digest(tmp: Path, fault: str) -> None:
    code, summary, _ = flyd_run(tmp, "--steps", str(STEPS), "--mode", "thread",
                                "--fault", fault)
    assert code == 0 and summary["state"] == "succeeded", summary["failures"]
    assert summary["behaviourDigest"] == clean_digest(tmp)


def test_a_killed_worker_before_the_first_checkpoint_restarts_from_zero(tmp: Path) -> None:
    code, summary, _ = flyd_run(tmp, "--steps", str(STEPS), "--mode", "thread",
                                "--fault", "kill:fly-b@5")
    assert code == 0, summary["failures"]
    assert summary["state"] == "succeeded" and summary["recoveries"] == 1
    assert [f["participant"] for f in summary["failures"]] == ["fly-b"]
    assert set(summary["failures"][0]) == {"detail", "participant", "code", "mutation",
                                           "message"}
    assert summary["epochs"] == ["e2"], "nothing was durable: every boundary ran again in e2"
    assert summary["behaviourDigest"] == clean_digest(tmp)
    state, keys = ledger(tmp, summary["run"])
    assert state == "succeeded"
    assert keys == [f"boundary-{k}" for k in range(1, STEPS + 1)] + ["finish"]


@pytest.mark.parametrize(("args", "needle"), [
    (["--fault", "fly-z.prepare_delay_ms=5"], "fly-z.prepare_delay_ms=5"),
    (["--agents", "Fly-A,fly-b"], "/agents/0/agentId"),
    (["--mode", "bogus"], "--mode"),
])
def test_a_bad_spec_or_fault_exits_2_with_a_json_error(tmp: Path, args: list[str],
                                                        needle: str) -> None:
    code, out, _ = flyd_run(tmp, "--steps", "10", *args)
    assert code == 2
    assert set(out) == {"error"} and set(out["error"]) == {"code", "message"}
    assert out["error"]["code"] == "USAGE"
    assert needle in out["error"]["message"]
    assert not (tmp / "bus.sock").exists()


@pytest.mark.parametrize(("faults", "steps", "agents", "needle"), [
    (("arena.prepare_delay_ms=5",), 10, None, "arena.prepare_delay_ms=5"),
    (("kill:fly-b",), 10, None, "kill:fly-b"),
    (("fly-a.prepare_delay_ms=1@99",), 10, None, "fly-a.prepare_delay_ms=1@99"),
    (("fly-a.prepare_delay_ms=1", "fly-a.prepare_delay_ms=2"), 10, None,
     "fly-a.prepare_delay_ms=2"),
    ((), 0, None, "/steps"),
    ((), 10, ("a", "b", "c", "d", "e"), "/agents"),
])
def test_build_spec_names_the_bad_path_or_fault(faults: tuple[str, ...], steps: int,
                                                agents: tuple[str, ...] | None,
                                                needle: str) -> None:
    from flyd.cli.run import RunOptions, RunUsageError, build_spec

    with pytest.raises(RunUsageError) as caught:
        build_spec(RunOptions(steps=steps, agents=agents, faults=faults))
    assert caught.value.code == "USAGE" and needle in caught.value.message


def test_the_default_socket_is_used_when_free_and_a_private_one_when_busy(tmp: Path) -> None:
    default = tmp / "xdg" / "flyd" / "bus.sock"
    code, summary, err = flyd_run(tmp, "--steps", "3", "--mode", "in-process", socket=False)
    assert code == 0 and summary["state"] == "succeeded"
    assert f"router socket {default}" in err
    blocker = subprocess.Popen(
        [sys.executable, "-m", "flyd", "router", "--socket", str(default), "-q"], cwd=ROOT,
        env=env_for(tmp), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not router_answers(str(default)):
            assert blocker.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        argv = [sys.executable, "-m", "flyd", "run", "--json", "--steps", "3", "--mode",
                "in-process"]
        proc = subprocess.Popen(argv, cwd=ROOT, env=env_for(tmp), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr[-2000:]
        private = default.parent / f"run-{proc.pid}.sock"
        assert f"using the private socket {private}".encode() in stderr
        assert orjson.loads(stdout)["state"] == "succeeded"
        assert default.exists() and not private.exists()
        assert blocker.poll() is None  # the other router was left alone
    finally:
        blocker.terminate()
        blocker.wait(timeout=20)


def test_sigint_cancels_the_run_and_exits_130(tmp: Path) -> None:
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--steps", "100000", "--socket",
            str(tmp / "bus.sock")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env_for(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len([p for p in leftovers(tmp) if "workers." in " ".join(p.cmdline())]) < 3:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr[-2000:]
    summary = orjson.loads(stdout)
    assert summary["state"] == "cancelled"
    assert summary["boundary"] == summary["advances"] < 100000
    assert b"Traceback" not in stderr
    assert not leftovers(tmp)
    state, keys = ledger(tmp, summary["run"])
    assert state == "cancelled"
    n = summary["boundary"]
    assert keys == [f"boundary-{k}" for k in range(1, n + 1)] + ["finish"]


def ledger(tmp: Path, run: int) -> tuple[str, list[str]]:
    """The run's state and its effect keys in boundary order (`finish` last)."""
    import psycopg

    with psycopg.connect(_DSN[tmp]) as conn:
        state = conn.execute("SELECT state::text FROM flyd.runs WHERE run_id = %s",
                             (run,)).fetchone()
        rows = conn.execute("SELECT effect_key FROM flyd.effects WHERE run_id = %s "
                            "ORDER BY boundary NULLS LAST", (run,)).fetchall()
    assert state is not None
    return str(state[0]), [str(r[0]) for r in rows]


def test_router_toml_carries_the_node_pid_and_the_limit_floors() -> None:
    import tomllib

    from bus.policy import Policy
    from flyd.config import load_config
    from flyd.node.router_child import router_toml

    bus = load_config(None, {"bus.socket": "/x.sock",
                             "bus.limits": {"max_clients": 9, "max_services": 99}}, {})
    text = router_toml(bus.settings.bus, 4242)
    doc = tomllib.loads(text)
    assert "socket" not in doc["bus"]
    assert doc["bus"]["limits"] == {"max_clients": 15, "max_services": 99}
    assert Policy.from_config(doc["bus"]["policy"]) == Policy.default(4242)


def test_a_bad_config_key_exits_2_with_a_config_error(tmp: Path) -> None:
    config = tmp / "flyd.toml"
    config.write_text("[bus]\nbogus = 1\n")
    code, out, _ = flyd_run(tmp, "--steps", "3", "--config", str(config))
    assert code == 2 and out["error"]["code"] == "CONFIG"
    assert "bogus" in out["error"]["message"] and str(config) in out["error"]["message"]


def test_seeds_follow_the_options() -> None:
    from flyd.cli.run import RunOptions, build_spec
    from workers.composition import derive_seed

    default = build_spec(RunOptions())
    assert (default.seed, default.seed_of("fly-a"), default.seed_of("fly-b")) == (7, 7, 11)
    assert default.exclusive_to_submitter and default.mode == "process"
    seeded = build_spec(RunOptions(seed=42))
    assert [seeded.seed_of(a) for a in ("fly-a", "fly-b")] == [1329356413, 1459314961]
    agents = build_spec(RunOptions(agents=("fly-a", "fly-b", "fly-c")))
    assert [a.port_id for a in agents.agents] == ["p1", "p2", "p3"]
    assert agents.seed_of("fly-c") == derive_seed(7, "fly-c")
    assert build_spec(RunOptions(mode="inprocess", pace=True)).to_json()["mode"] == "in-process"
    assert build_spec(RunOptions(pace=True)).pacing == "realtime"


def embedded_env(tmp: Path) -> dict[str, str]:
    """No DSN anywhere and no XDG_RUNTIME_DIR: `flyd run` must start its own PostgreSQL."""
    env = {k: v for k, v in env_for(tmp).items()
           if k not in ("FLYD_DSN", "XDG_RUNTIME_DIR", "FLYD_STATE_DIR")}
    return env


def postmasters_of(datadir: Path) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"])
            if str(datadir) in " ".join(p.info["cmdline"] or [])]


def test_embedded_default_under_a_dedicated_state_dir(tmp: Path) -> None:
    state = tmp / "st"
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--steps", "5", "--mode",
            "in-process", "--state-dir", str(state), "--socket", str(tmp / "bus.sock")]
    first = subprocess.run(argv, cwd=ROOT, env=embedded_env(tmp), capture_output=True,
                           timeout=120, check=False)
    assert first.returncode == 0, first.stderr[-2000:]
    assert orjson.loads(first.stdout)["state"] == "succeeded"
    assert (state / "pg" / "PG_VERSION").exists()
    run_dir = state / "run"
    assert run_dir.is_dir() and (run_dir.stat().st_mode & 0o777) == 0o700
    assert any(run_dir.iterdir()), "pgserver's lock directory lives under <state-dir>/run"
    assert not postmasters_of(state / "pg")
    stamp = (state / "pg" / "PG_VERSION").stat().st_ino
    second = subprocess.run(argv, cwd=ROOT, env=embedded_env(tmp), capture_output=True,
                            timeout=120, check=False)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = orjson.loads(second.stdout)
    assert summary["state"] == "succeeded" and summary["run"] == 2
    assert (state / "pg" / "PG_VERSION").stat().st_ino == stamp
    assert not postmasters_of(state / "pg")


def test_flyd_run_is_isolated_from_the_queue(tmp: Path) -> None:
    import asyncio

    from flyd.leases.params import LeaseParams
    from flyd.leases.stores.pg import DbSettings, PgStore
    from flyd.session.runspec import RunSpec
    from tests.serve_nodes import query, stop, wait_for

    dsn = _DSN[tmp]
    shared = RunSpec.validate({"steps": "5", "mode": "in-process"}).to_json()

    async def submit() -> int:
        async with PgStore(dsn, "test", DbSettings(), LeaseParams()) as store:
            return (await store.submit(None, shared, 3)).run_id

    env = env_for(tmp)
    serve_env = {k: v for k, v in env.items() if k != "FLYD_STATE_DIR"}
    serve_env["FLYD_STATE_DIR"] = str(tmp / "serve-state")
    serve = subprocess.Popen([sys.executable, "-m", "flyd", "serve", "--log-format", "json"],
                             cwd=ROOT, env=serve_env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    default = tmp / "xdg" / "flyd" / "bus.sock"
    try:
        wait_for("the serve node's router", default.exists, 60)
        queued = asyncio.run(submit())
        proc = subprocess.run([sys.executable, "-m", "flyd", "run", "--json", "--steps", "5",
                               "--mode", "in-process"], cwd=ROOT, env=env,
                              capture_output=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        mine = orjson.loads(proc.stdout)["run"]
        private = default.parent / "run-"
        assert f"using the private socket {private}".encode() in proc.stderr
        wait_for("the serve node to finish the queued run",
                 lambda: query(dsn, "SELECT state::text FROM flyd.runs WHERE run_id = %s",
                               queued) == [("succeeded",)], 60)
        serve_ids = {str(r[0]) for r in query(
            dsn, "SELECT node_id FROM flyd.nodes WHERE pid = %s", serve.pid)}
        granted = {int(r[0]): str(r[1]) for r in query(  # type: ignore[call-overload]
            dsn, "SELECT run_id, node_id FROM flyd.run_attempts")}
        assert set(granted) == {queued, mine}, "one grant each, nothing else"
        assert granted[queued] in serve_ids and granted[mine] not in serve_ids
    finally:
        assert stop(serve) == 0


def test_a_pending_exclusive_leftover_is_not_claimed_by_the_next_run(tmp: Path) -> None:
    import asyncio

    from flyd.cli.run import RunOptions, build_spec
    from flyd.leases.embedded import EmbeddedPostgres
    from flyd.leases.params import LeaseParams
    from flyd.leases.stores.pg import DbSettings, PgStore

    state = tmp / "st"
    leftover = build_spec(RunOptions(steps=5, mode="in-process")).to_json()

    async def plant() -> int:
        embedded = EmbeddedPostgres()
        dsn = await embedded.start(state)
        try:
            async with PgStore(dsn, "test", DbSettings(), LeaseParams()) as store:
                return (await store.submit("leftover", leftover, 3)).run_id
        finally:
            await embedded.stop()

    planted = asyncio.run(plant())
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--steps", "5", "--mode",
            "in-process", "--state-dir", str(state), "--socket", str(tmp / "bus.sock")]
    proc = subprocess.run(argv, cwd=ROOT, env=embedded_env(tmp), capture_output=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = orjson.loads(proc.stdout)
    assert summary["state"] == "succeeded" and summary["run"] != planted

    async def leftover_state() -> str:
        embedded = EmbeddedPostgres()
        dsn = await embedded.start(state)
        try:
            import psycopg

            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                cur = await conn.execute("SELECT state::text, lease_epoch FROM flyd.runs "
                                         "WHERE run_id = %s", (planted,))
                row = await cur.fetchone()
                assert row is not None
                return f"{row[0]}@{row[1]}"
        finally:
            await embedded.stop()

    assert asyncio.run(leftover_state()) == "pending@0"
    assert not postmasters_of(state / "pg")


UNREACHABLE = "postgresql://nobody@127.0.0.1:1/nothing?connect_timeout=2"


def test_flyctl_resolves_the_database_without_starting_one(site: Site) -> None:
    """The embedded-server level of the DSN order is shown with a `postmaster.pid` naming a live
    process (this test's own) and an unused port: `flyctl` must pick it up (and fail to reach
    it) without starting anything."""
    state = site.path / "state"
    (state / "pg").mkdir(parents=True)
    (state / "pg" / "postmaster.pid").write_text(
        f"{os.getpid()}\n{state / 'pg'}\n0\n1\n{site.path}\nlocalhost\n")
    config = site.path / "flyd.toml"
    env = {k: v for k, v in site.env().items() if k != "FLYD_DSN"}

    def runs_list(*args: str, **extra: str) -> tuple[int, str]:
        out = subprocess.run([*FLYCTL, "runs", "list", "--json", *args], cwd=ROOT,
                             env={**env, **extra}, capture_output=True, timeout=60, check=False)
        stdout, stderr = out.stdout.decode(), out.stderr.decode()
        assert "Traceback" not in stdout + stderr
        return out.returncode, stdout + stderr

    good, bad = site.dsn, UNREACHABLE
    config.write_text(f'[database]\ndsn = "{good}"\n')
    assert runs_list("--dsn", good, FLYD_DSN=bad, FLYD_CONFIG=str(config))[0] == 0
    assert runs_list("--dsn", bad, FLYD_DSN=good)[0] == 2
    assert runs_list(FLYD_DSN=good, FLYD_CONFIG=str(config))[0] == 0
    config.write_text(f'[database]\ndsn = "{bad}"\n')
    assert runs_list(FLYD_DSN=good, FLYD_CONFIG=str(config))[0] == 0
    assert runs_list(FLYD_CONFIG=str(config))[0] == 2
    config.write_text(f'[database]\ndsn = "{good}"\n')
    assert runs_list(FLYD_CONFIG=str(config))[0] == 0
    # no DSN anywhere: the running server's postmaster.pid (socket dir and port) is used
    code, text = runs_list()
    assert code == 2 and f"host={site.path}" in text and "port=1" in text
    (state / "pg" / "postmaster.pid").unlink()
    code, text = runs_list()
    assert code == 2 and "no database: pass --dsn" in text and '"CONFIG"' in text
    assert sorted(p.name for p in (state / "pg").iterdir()) == []
    assert not [p for p in psutil.process_iter(["name", "cmdline"])
                if "postgres" in (p.info["name"] or "")
                and str(site.path) in " ".join(p.info["cmdline"] or [])]


def test_a_launch_failure_is_retried_until_the_last_attempt(tmp: Path) -> None:
    """Workers that cannot identify within the boot budget fail the launch: each grant but the
    last hands the run back charged (a `released` attempt, another grant later); the last one
    ends the run `failed` with the launch failure as its outcome."""
    import psycopg

    config = tmp / "flyd.toml"
    config.write_text("[session]\nhealth_boot_s = 0.001\n")
    code, summary, stderr = flyd_run(tmp, "--steps", "10", "--mode", "process",
                                     "--config", str(config), timeout=150)
    assert code == 1 and summary["state"] == "failed", stderr[-2000:]
    with psycopg.connect(_DSN[tmp]) as conn:
        row = conn.execute("SELECT outcome, attempt, max_attempts FROM flyd.runs "
                           "WHERE run_id = %s", (summary["run"],)).fetchone()
        ends = conn.execute("SELECT end_reason FROM flyd.run_attempts WHERE run_id = %s "
                            "ORDER BY lease_epoch", (summary["run"],)).fetchall()
    assert row is not None
    outcome, attempt, max_attempts = row
    assert outcome["error"] == "launch failed", outcome
    assert outcome["failure"]["detail"] == "launch"
    assert attempt == max_attempts == len(ends)
    assert [e[0] for e in ends[:-1]] == ["released"] * (max_attempts - 1)
    assert stderr.count('"run.launch_failed"') >= max_attempts
