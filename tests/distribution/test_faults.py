"""Tier-2 tests of distribution.md §8 (tests 52–60).

Tests 52–55 and 57 prove the harness itself: the fault proxy and its taps (against an echo
server and through psycopg to a real server), the harness clock shared by `flyd.app_now()` and
the nodes' clock file, the clock-mode refusal at node start, and the wall budget of a scenario
(`harness/runner.py`). Tests 58–59 need only a real node, a real PostgreSQL and signals.
Test 56 runs every scenario of §7.3.5 (`harness/scenarios.py`, bodies in `harness/bodies.py`)
and judges it with the oracle; test 60 is the inventory.

Inventory (test 60), decided where the spec is silent: every test that ran a registered
scenario leaves a mark in the test run's inventory directory (`runner.inventory_dir`, shared
by all xdist workers): test 56 for its scenario, `tests/distribution/conftest.py` for the
tier-1 tests of `test_sim.py`. Test 60 may run before scenarios still running on another
worker have ended (xdist does not order tests across workers), so it first waits for every
selected scenario test to leave its mark, then requires every registered scenario of both
tiers to have run and no process of this test run with a scenario marker to survive.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import psutil
import psycopg
import pytest

from flyd.leases.clock import SimFileClock, SimFileWriter
from flyd.leases.embedded import EmbeddedPostgres
from flyd.leases.migrate import shipped_migrations
from flyd.leases.params import LeaseParams
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.session.runspec import RunSpec
from tests.distribution.harness import scenarios
from tests.distribution.harness.clock import EPOCH, TICK_S, HarnessClock
from tests.distribution.harness.proxy import (
    DROP,
    HOLD,
    RESET,
    Delay,
    FaultProxy,
    HoldOnMatch,
    ProxyHost,
    Upstream,
)
from tests.distribution.harness.runner import (
    MARKER,
    RUN_ENV,
    Report,
    commit_sha,
    done_mark,
    inventory_dir,
    processes_with_marker,
    run_scenario,
)
from tests.distribution.harness.scenarios import lookup, scenario_seed, suite_seed
from tests.distribution.sim.canaries import CANARIES
from tests.distribution.sim.world import KINDS
from tests.serve_nodes import ROOT, processes_under, query, start_node, wait_for

pytestmark = pytest.mark.timeout(180)

DRAIN_S = LeaseParams().drain_timeout_s


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="flyd-f-", dir="/tmp"))
    try:
        yield path
    finally:
        survivors = processes_under(str(path))
        for proc in survivors:
            proc.kill()
        shutil.rmtree(path, ignore_errors=True)
        assert not survivors, f"processes outlived the test: {survivors}"


def test_embedded_default_without_dsn(tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLYD_DSN", "FLYD_CONFIG", "FLYD_STATE_DIR", "XDG_RUNTIME_DIR",
                        "FLYD_SOCKET")}
    proc = subprocess.run(
        [sys.executable, "-m", "flyd", "run", "--json", "--steps", "10", "--mode", "thread",
         "--state-dir", str(tmp), "--socket", str(tmp / "bus.sock")],
        cwd=ROOT, env=env, capture_output=True, timeout=150, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = orjson.loads(proc.stdout)
    assert summary["state"] == "succeeded" and summary["boundary"] == 10
    lock_dir = tmp / "run"
    assert lock_dir.is_dir() and (lock_dir.stat().st_mode & 0o777) == 0o700
    assert not [p for p in psutil.process_iter(["cmdline"])
                if str(tmp / "pg") in " ".join(p.info["cmdline"] or [])]

    async def ledger() -> tuple[int, list[str]]:
        embedded = EmbeddedPostgres()
        dsn = await embedded.start(tmp)
        try:
            async with await psycopg.AsyncConnection.connect(dsn) as conn:
                version = await (await conn.execute(
                    "SELECT max(version) FROM flyd.schema_migrations")).fetchone()
                keys = await (await conn.execute(
                    "SELECT effect_key FROM flyd.effects WHERE run_id = %s "
                    "ORDER BY boundary NULLS LAST", (summary["run"],))).fetchall()
            assert version is not None
            return int(version[0]), [str(k[0]) for k in keys]
        finally:
            await embedded.stop()

    version, keys = asyncio.run(ledger())
    assert version == shipped_migrations()[-1].version  # every shipped migration applied
    assert keys == [f"boundary-{k}" for k in range(1, 11)] + ["finish"]


async def _submit(dsn: str, n: int) -> list[int]:
    spec = RunSpec.validate({"steps": "100000", "mode": "in-process", "paceS": 0.05}).to_json()
    async with PgStore(dsn, "test", DbSettings(), LeaseParams()) as store:
        return [(await store.submit(None, spec, 3)).run_id for _ in range(n)]


def test_graceful_shutdown_exit_code(db_dsn: str, tmp: Path) -> None:
    runs = asyncio.run(_submit(db_dsn, 2))
    node = start_node(tmp, "a", db_dsn, "--capacity", "2")
    try:
        wait_for("the node to hold both runs",
                 lambda: query(db_dsn, "SELECT count(*) FROM flyd.runs "
                                       "WHERE state = 'running'") == [(2,)], 60)
        started = time.monotonic()
        node.send_signal(signal.SIGTERM)
        code = node.wait(DRAIN_S + 5)
        elapsed = time.monotonic() - started
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert code == 0 and elapsed <= DRAIN_S + 5
    rows = query(db_dsn, "SELECT run_id, state::text, attempt, lease_epoch FROM flyd.runs "
                         "ORDER BY run_id")
    assert rows == [(run, "pending", 0, 1) for run in runs], "released with refund"
    ends = query(db_dsn, "SELECT end_reason FROM flyd.run_attempts ORDER BY run_id")
    assert ends == [("released",), ("released",)]
    assert query(db_dsn, "SELECT state, held FROM flyd.nodes") == [("stopped", 0)]


# ------------------------------------------------------------------------------------------
# Harness infrastructure (tests 52–55, 57): fault proxy, taps, harness clock, budgets.

class EchoHandler(socketserver.BaseRequestHandler):
    """Swallows the startup packet, then echoes every byte and the EOF."""

    def handle(self) -> None:
        sock: socket.socket = self.request
        try:
            head = _recv_exact(sock, 4, 5.0)
            _recv_exact(sock, struct.unpack("!i", head)[0] - 4, 5.0)
            sock.settimeout(30)
            while data := sock.recv(65536):
                sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return


class EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def echo() -> Iterator[Upstream]:
    server = EchoServer(("127.0.0.1", 0), EchoHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Upstream(host="127.0.0.1", port=server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def _recv_exact(sock: socket.socket, n: int, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while len(out) < n:
        data = sock.recv(n - len(out))
        if not data:
            raise EOFError(f"EOF after {len(out)} of {n} bytes")
        out += data
    return out


def _silent(sock: socket.socket, seconds: float = 0.3) -> bool:
    """True when nothing (not even EOF) arrives within `seconds`."""
    sock.settimeout(seconds)
    try:
        sock.recv(1)
    except TimeoutError:
        return True
    return False


def _startup(application_name: str) -> bytes:
    body = struct.pack("!i", 196608) + b"user\0flyd\0application_name\0" + \
        application_name.encode() + b"\0\0"
    return struct.pack("!i", len(body) + 4) + body


def _frame(kind: bytes, text: str) -> bytes:
    body = text.encode() + b"\0"
    return kind + struct.pack("!i", len(body) + 4) + body


def _connect(proxy: FaultProxy, role: str = "probe") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    sock.sendall(_startup(f"flyd:echo-node:{role}"))
    return sock


def test_proxy_modes(echo: Upstream) -> None:
    with ProxyHost(now=time.monotonic, time_scale=1.0, seed=52) as host:
        proxy = host.add("a", echo)
        for d in ("up", "down"):
            # Messages the tap records in this direction: Query up, CommandComplete down.
            kind, tapped = (b"Q", "query") if d == "up" else (b"C", "complete")

            def taps(fate: str, *, d: str = d, tapped: str = tapped) -> list[str]:
                return [str(r.detail.get("text", r.detail.get("tag")))
                        for r in host.tap.records()
                        if r.direction == d and r.kind == tapped and r.fate == fate]

            # delay: every chunk late, order kept.
            proxy.set(d, Delay(0.03, 0.02))
            sock = _connect(proxy)
            msgs = [_frame(kind, f"{d}-delay-{i}") for i in range(20)]
            started = time.monotonic()
            for msg in msgs:
                sock.sendall(msg)
                time.sleep(0.002)
            first = _recv_exact(sock, len(msgs[0]), 5)
            assert time.monotonic() - started >= 0.01, "the delay did not bite"
            assert first + _recv_exact(sock, sum(map(len, msgs[1:])), 5) == b"".join(msgs)
            assert taps("delivered")[-20:] == [f"{d}-delay-{i}" for i in range(20)]
            sock.close()
            proxy.heal()

            # a rule for another role leaves this connection alone
            proxy.set(d, HOLD, role="other")
            sock = _connect(proxy)
            ping = _frame(kind, f"{d}-ping")
            sock.sendall(ping)
            assert _recv_exact(sock, len(ping), 5) == ping
            sock.close()
            proxy.heal()

            # hold: bytes and EOF buffered, delivered in order at heal
            proxy.set(d, HOLD)
            sock = _connect(proxy)
            msgs = [_frame(kind, f"{d}-hold-{i}") for i in range(3)]
            for msg in msgs:
                sock.sendall(msg)
            sock.shutdown(socket.SHUT_WR)
            assert _silent(sock), "held bytes leaked"
            assert taps("held")[-3:] == [f"{d}-hold-{i}" for i in range(3)]
            proxy.heal()
            assert _recv_exact(sock, sum(map(len, msgs)), 5) == b"".join(msgs)
            sock.settimeout(5)
            assert sock.recv(1) == b"", "the held EOF was not delivered"
            assert taps("delivered")[-3:] == [f"{d}-hold-{i}" for i in range(3)]
            sock.close()

            # drop: discarded; the connection is reset at heal
            proxy.set(d, DROP)
            sock = _connect(proxy)
            sock.sendall(_frame(kind, f"{d}-drop"))
            assert _silent(sock), "dropped bytes arrived"
            assert taps("dropped")[-1:] == [f"{d}-drop"]
            proxy.heal()
            sock.settimeout(5)
            with pytest.raises(ConnectionResetError):
                sock.recv(1)
            sock.close()

            # reset: existing connections RST now, new ones while active; a role rule acts
            # once the startup packet names the role
            sock = _connect(proxy)
            sock.sendall(ping)
            assert _recv_exact(sock, len(ping), 5) == ping
            proxy.set(d, RESET)
            sock.settimeout(5)
            with pytest.raises(ConnectionResetError):
                sock.recv(1)
            sock.close()
            with pytest.raises(ConnectionResetError):  # at connect or at the first read
                late = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
                try:
                    late.recv(1)
                finally:
                    late.close()
            proxy.heal()
            proxy.set(d, RESET, role="probe")
            victim = _connect(proxy, "probe")
            with pytest.raises(ConnectionResetError):
                victim.recv(1)
            victim.close()
            bystander = _connect(proxy, "other")
            bystander.sendall(ping)
            assert _recv_exact(bystander, len(ping), 5) == ping
            bystander.close()
            proxy.heal()

            # hold_on_match: passes up to the matching message, holds from it on
            proxy.set(d, HoldOnMatch("MARK"))
            sock = _connect(proxy)
            one, two, three = (_frame(kind, f"{d}-one"), _frame(kind, f"{d}-two MARK"),
                               _frame(kind, f"{d}-three"))
            sock.sendall(one + two + three)
            assert _recv_exact(sock, len(one), 5) == one
            assert _silent(sock), "bytes after the match leaked"
            assert taps("held")[-2:] == [f"{d}-two MARK", f"{d}-three"]
            proxy.heal()
            assert _recv_exact(sock, len(two + three), 5) == two + three
            sock.close()
        assert {c.role for c in proxy.connections()} <= {"probe", "other"}


def test_proxy_tap_sqlstates(db_dsn: str, tmp: Path) -> None:
    inserted = query(db_dsn, "INSERT INTO flyd.runs (spec, state, lease_epoch, attempt, "
                             "owner_node, lease_expires_at) VALUES ('{}', 'running', 1, 1, "
                             "'n-a', '2100-01-01T00:00:00Z') RETURNING run_id")
    run = int(str(inserted[0][0]))
    effect = ("INSERT INTO flyd.effects (run_id, effect_key, lease_epoch, node_id, "
              "session_epoch, boundary, payload, payload_digest) "
              "VALUES (%s, 'boundary-1', %s, 'n-a', 1, 1, '{}', '\\x00')")
    with HarnessClock(db_dsn, tmp / "clock", time_scale=20.0) as clock, \
            ProxyHost(now=clock.now, time_scale=20.0, seed=53) as host:
        proxy = host.add("a", Upstream.from_dsn(db_dsn))
        dsn = proxy.dsn(db_dsn)
        before = clock.now()
        with psycopg.connect(dsn, autocommit=True,
                             application_name="flyd:n-a:work") as work:
            work.execute(effect, (run, 1))
            with pytest.raises(psycopg.errors.UniqueViolation):
                work.execute(effect, (run, 1))
            pid = work.info.backend_pid
        with psycopg.connect(dsn, autocommit=True,
                             application_name="flyd:n-a:heartbeat") as beat, \
                pytest.raises(psycopg.Error) as fenced:
            beat.execute(effect, (run, 7))
        assert fenced.value.sqlstate == "LF001"
        after = clock.now()
    records = host.tap.records()
    dup = [r for r in records if r.kind == "error" and r.detail.get("sqlstate") == "23505"]
    lf001 = [r for r in records if r.kind == "error" and r.detail.get("sqlstate") == "LF001"]
    assert len(dup) == 1 and len(lf001) == 1
    assert dup[0].detail["constraint"] == "effects_pkey"
    assert (dup[0].role, dup[0].node, dup[0].direction, dup[0].fate) == \
        ("work", "a", "down", "delivered")
    assert (lf001[0].role, lf001[0].node) == ("heartbeat", "a")
    for rec in (dup[0], lf001[0]):
        assert before <= rec.sim_time <= after, "tap time is not the harness sim time"
    assert dup[0].conn != lf001[0].conn
    keys = [r for r in records if r.kind == "backend_key" and r.conn == dup[0].conn]
    assert [r.detail["pid"] for r in keys] == [pid]
    startups = [r for r in records if r.kind == "startup"]
    assert {str(r.detail["application_name"]) for r in startups} == \
        {"flyd:n-a:work", "flyd:n-a:heartbeat"}
    assert any(r.kind == "complete" and r.detail["tag"] == "INSERT 0 1" for r in records)
    assert any(r.kind in ("query", "parse") and "flyd.effects" in str(r.detail["text"])
               and r.role == "work" for r in records)


def test_harness_clock_shared(db_dsn: str, tmp: Path) -> None:
    def app_now(conn: psycopg.Connection[tuple[object, ...]]) -> float:
        row = conn.execute("SELECT flyd.app_now()").fetchone()
        assert row is not None and isinstance(row[0], datetime.datetime)
        return (row[0] - EPOCH).total_seconds()

    with HarnessClock(db_dsn, tmp / "clock", time_scale=20.0) as clock, \
            psycopg.connect(db_dsn, autocommit=True) as conn:
        node = SimFileClock(tmp / "clock")
        try:
            for _ in range(20):
                lo = node.now()
                db = app_now(conn)
                hi = node.now()
                tick = clock.max_step_s()             # a late tick is one larger step
                assert tick >= TICK_S * clock.time_scale
                assert lo - tick - 1e-6 <= db <= hi + tick + 1e-6
                time.sleep(0.01)
            start = node.now()
            time.sleep(0.1)
            assert node.now() - start >= 1.0, "the clock does not run at time_scale"
            clock.freeze()
            frozen_db, frozen_node = app_now(conn), node.now()
            assert abs(frozen_db - frozen_node) < 1e-6, "row and file disagree while frozen"
            time.sleep(0.1)
            assert (app_now(conn), node.now()) == (frozen_db, frozen_node)
            clock.advance(5.0)
            assert abs(app_now(conn) - (frozen_db + 5.0)) < 1e-6
            assert abs(node.now() - (frozen_node + 5.0)) < 1e-6
            clock.thaw()
            time.sleep(0.05)
            assert node.now() > frozen_node + 5.0 and app_now(conn) > frozen_db + 5.0
        finally:
            node.close()


def test_node_refuses_clock_mode_mismatch(db_dsn: str, tmp: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[bytes]:
        home = tmp / f"n{len(list(tmp.iterdir()))}"
        home.mkdir()
        env = {k: v for k, v in os.environ.items()
               if k not in ("FLYD_SOCKET", "FLYD_DSN", "FLYD_CONFIG", "FLYD_NODE_NAME",
                            "NOTIFY_SOCKET")}
        return subprocess.run(
            [sys.executable, "-m", "flyd", "serve", "--json", "--dsn", db_dsn,
             "--socket", str(home / "bus.sock"), "--state-dir", str(home),
             "--node-name", "a", *args],
            cwd=ROOT, env=env, capture_output=True, timeout=60, check=False)

    SimFileWriter(tmp / "clock").write(10**12)
    flagged = serve("--sim-clock", str(tmp / "clock"), "--time-scale", "20")
    assert flagged.returncode == 2, flagged.stderr[-2000:]
    error = orjson.loads(flagged.stdout)["error"]
    assert error["code"] == "CONFIG" and "sim clock" in error["message"]
    assert b"Traceback" not in flagged.stderr
    query(db_dsn, "INSERT INTO flyd.sim_clock (t) VALUES ('2030-01-01T00:00:00Z') RETURNING t")
    unflagged = serve()
    assert unflagged.returncode == 2, unflagged.stderr[-2000:]
    error = orjson.loads(unflagged.stdout)["error"]
    assert error["code"] == "CONFIG" and "sim_clock" in error["message"]
    assert b"Traceback" not in unflagged.stderr
    assert query(db_dsn, "SELECT count(*) FROM flyd.nodes") == [(0,)], "nothing started"


def test_budget_expiry(faults_suite: tuple[int, Report], tmp: Path) -> None:
    suite, reporter = faults_suite
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        reporter(line)

    seed = scenario_seed(suite, "budget_probe")
    started = time.monotonic()
    outcome = run_scenario("budget_probe", seed, report, budget_s=1.0, suite=suite,
                           artifacts=tmp / "records")
    assert time.monotonic() - started < 10
    assert outcome.status == "expired"
    assert lines[0] == f"[faults] budget_probe seed={seed} budget=1"
    text = "\n".join(lines)
    assert "budget expired" in text and "phase=fault" in text
    assert any(line.startswith("[faults]   node a pid=") and "last_event=started" in line
               and "holds=" in line for line in lines)
    assert "runs by state" in text
    assert f"FLYD_FAULT_SEED={suite} pytest tests/distribution/test_faults.py" in text
    assert outcome.record == tmp / "records" / f"budget_probe-{seed}.json"
    record = orjson.loads(outcome.record.read_bytes())
    assert record["seed"] == seed and record["outcome"] == "expired"
    assert record["phase"] == "fault" and record["nodes"]["a"]["last_event"] == "started"
    assert len(record["killed"]) == 2, "the node and its own-session grandchild"
    assert not [p for p in record["killed"] if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not processes_with_marker("budget_probe")

    env = {**os.environ, "FLYD_FAULT_ARTIFACTS": str(tmp / "standalone")}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.distribution.harness", "--scenario", "budget_probe",
         "--seed", str(seed), "--budget", "1"],
        cwd=ROOT, env=env, capture_output=True, timeout=60, check=False)
    assert proc.returncode == 124, proc.stderr[-2000:]
    err = proc.stderr.decode().splitlines()
    assert err[0].startswith("[faults] seed=") and " commit=" in err[0] and "time_scale=" in err[0]
    assert err[1] == f"[faults] budget_probe seed={seed} budget=1"
    assert any("budget expired" in line for line in err)
    assert (tmp / "standalone" / f"budget_probe-{seed}.json").exists()
    assert not processes_with_marker("budget_probe")


def test_the_seed_line_names_the_commit_in_a_clone_and_in_a_worktree(tmp_path: Path) -> None:
    """`commit=` of the suite's seed line (§7.3.7) from `.git` files: a clone's loose or packed
    branch, and a linked worktree's, whose `.git` file names its git directory."""
    sha, other = "a" * 40, "b" * 40
    repo = tmp_path / "repo"
    (repo / ".git" / "refs" / "heads").mkdir(parents=True)
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (repo / ".git" / "packed-refs").write_text(f"# pack-refs\n{sha} refs/heads/main\n")
    assert commit_sha(repo) == sha
    (repo / ".git" / "refs" / "heads" / "main").write_text(other + "\n")
    assert commit_sha(repo) == other
    linked = repo / ".git" / "worktrees" / "w"
    linked.mkdir(parents=True)
    (linked / "HEAD").write_text("ref: refs/heads/topic\n")
    (linked / "commondir").write_text("../..\n")
    (repo / ".git" / "refs" / "heads" / "topic").write_text(sha + "\n")
    worktree = tmp_path / "w"
    worktree.mkdir()
    (worktree / ".git").write_text(f"gitdir: {linked}\n")
    assert commit_sha(worktree) == sha
    assert commit_sha(tmp_path) == "unknown"


@pytest.mark.timeout(240)
def test_progress_is_live_under_xdist(tmp: Path) -> None:
    """§7.3.7 under pytest-xdist, as `make faults` and `make test` run the suite: the suite's
    seed line first and once, each scenario's seed line and its progress, and tier 1's `[sim]`
    lines reach the controlling pytest's stderr while their test still runs: when a line
    arrives, the controller has not yet reported that test (its stdout is unbuffered and read at
    that moment), and the scenario's node named by a `node a pid=` line is still alive."""
    tests = {"[faults] budget_probe seed=": "test_faults.py::test_budget_expiry",
             "[faults]   node a pid=": "test_faults.py::test_budget_expiry",
             "[sim] seeds 3000..": "test_sim.py::test_sim_crash_and_pause"}
    selection = sorted({f"tests/distribution/{test}" for test in tests.values()})
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", RUN_ENV))}
    stdout = tmp / "stdout"
    out = stdout.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-v", "-n", "2", "-p", "no:randomly", "-p",
         "no:cacheprovider", "--basetemp", str(tmp / "base"), *selection],
        cwd=ROOT, env={**env, "FLYD_FAULT_ARTIFACTS": str(tmp / "records"),
                       "PYTHONUNBUFFERED": "1"}, stdout=out, stderr=subprocess.PIPE)
    lines: list[str] = []
    live: dict[str, bool] = {}
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            if not line.startswith(("[faults]", "[sim]")):
                continue
            lines.append(line)
            for kind, test in tests.items():
                if line.startswith(kind) and kind not in live:
                    reported = any(f"{verdict} tests/distribution/{test}" in
                                   stdout.read_text(errors="replace")
                                   for verdict in ("PASSED", "FAILED", "ERROR"))
                    alive = True
                    if kind.endswith("pid="):
                        alive = psutil.pid_exists(int(line[len(kind):].split()[0]))
                    live[kind] = not reported and alive
        assert proc.wait(timeout=180) == 0, stdout.read_text()[-3000:]
    finally:
        out.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert lines, "no [faults] or [sim] line reached the controlling pytest's stderr"
    assert lines[0].startswith("[faults] seed=") and " commit=" in lines[0] and \
        " pg=" in lines[0] and " time_scale=" in lines[0], lines[:3]
    assert [line for line in lines if line.startswith("[faults] seed=")] == lines[:1]
    seed = scenario_seed(suite_seed(), "budget_probe")
    probe = [line for line in lines if line.startswith("[faults] budget_probe")]
    assert probe[0] == f"[faults] budget_probe seed={seed} budget=1", probe
    assert any("budget expired" in line for line in probe[1:]), probe
    assert any(line.startswith("[sim] seeds 3000..3023: ok 24, failed 0") for line in lines)
    assert all(f"PASSED tests/distribution/{test}" in stdout.read_text()
               for test in tests.values()), "the tests were reported"
    assert live == dict.fromkeys(tests, True), \
        f"a line arrived after its test ended or its node exited: {live}"


# ------------------------------------------------------------------------------------------
# The scenarios of §7.3.5 (test 56) and the inventory (test 60).

SAFETY = ("S1", "S2", "S3", "S4", "S5", "S6")
#: The tier-1 test running each registered tier-1 scenario kind and canary (test_sim.py).
TIER1_TESTS = {
    "mixed": "test_trace_deterministic", "partitions": "test_sim_partitions",
    "latency": "test_sim_latency_near_ttl", "crash_pause": "test_sim_crash_and_pause",
    "skew": "test_sim_clock_skew_within_bound",
    "cancel_exhaust_drain": "test_sim_cancel_exhaust_drain",
    "unknown_commit": "test_sim_unknown_commit_outcomes",
    "delayed_cancel": "test_sim_delayed_cancellation_safe",
    **{f"canary:{name}": "test_sim_canaries_detected" for name in CANARIES},
}
INVENTORY_WAIT_S = 540.0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario_id", scenarios.ids())
def test_scenario(scenario_id: str, faults_suite: tuple[int, Report], pg_server_dsn: str,
                  pg_template: str, request: pytest.FixtureRequest) -> None:
    suite, reporter = faults_suite
    scenario = lookup(scenario_id)
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        reporter(line)

    seed = scenario_seed(suite, scenario_id)
    outcome = run_scenario(scenario_id, seed, report, suite=suite, dsn=pg_server_dsn,
                           template=pg_template)
    ran = not outcome.message.startswith("NotWired")
    (inventory_dir(request.config) / f"tier2-{scenario_id}").write_text(
        outcome.status if ran else "not wired")
    assert lines[0] == f"[faults] {scenario_id} seed={seed} budget={scenario.budget_s:g}"
    assert outcome.status == "passed", outcome.message
    assert any(line.startswith(f"[faults] {scenario_id} t=") and " phase=" in line
               for line in lines[1:]), "no progress line"
    judgement = outcome.context.judgement
    assert judgement is not None, "the scenario was not judged"
    verdicts = {v["check"]: v for v in judgement["verdicts"]}
    if scenario.inverted:
        violated = [c for c in SAFETY if not verdicts[c]["ok"]]
        assert violated, "the oracle reported no violation: it is blind to the canary"
        report(f"[faults] {scenario_id}: violation reported by {violated}: "
               f"{verdicts[violated[0]]['evidence'][:2]}")
        return
    for check in (*SAFETY, "L1", "L2", "L3", "L4"):
        assert verdicts[check]["ok"], verdicts[check]
    for fact in scenario.vacuity:
        assert verdicts[f"vacuity:{fact}"]["ok"], f"fault did not bite: {fact}"
        assert judgement["facts"][fact] > 0
    facts = judgement["facts"]
    report(f"[faults] {scenario_id}: reclaims={facts.get('reclaim', 0)} "
           f"lf001={outcome.context.lf001()} self_fences={facts.get('self_fence', 0)} "
           f"db_fenced={facts.get('db_fenced', 0)} vacuity="
           f"{ {f: facts[f] for f in scenario.vacuity} }")


@pytest.mark.timeout(INVENTORY_WAIT_S + 60)
def test_no_orphans_and_inventory(request: pytest.FixtureRequest) -> None:
    inventory = inventory_dir(request.config)
    run = os.environ[RUN_ENV]
    selected = {item.name for item in request.session.items}
    tier2 = {f"tier2-{i}": f"test_scenario[{i}]" for i in scenarios.ids()}
    tier1 = {f"tier1-{test}": test for test in TIER1_TESTS.values()}
    awaited = sorted(mark for mark, test in {**tier2, **tier1}.items() if test in selected)
    package = Path(__file__).parent
    awaited += sorted(done_mark(inventory, item.nodeid).name for item in request.session.items
                      if item.path.is_relative_to(package) and item.nodeid != request.node.nodeid)
    deadline = time.monotonic() + INVENTORY_WAIT_S
    while any(not (inventory / mark).exists() for mark in awaited) and \
            time.monotonic() < deadline:
        time.sleep(1.0)
    assert set(TIER1_TESTS) == set(KINDS) | {f"canary:{n}" for n in CANARIES}, \
        "a tier-1 scenario kind or canary has no test in the inventory"
    missing = [i for i in scenarios.ids()
               if not (inventory / f"tier2-{i}").exists()
               or (inventory / f"tier2-{i}").read_text() == "not wired"]
    missing += [kind for kind, test in TIER1_TESTS.items()
                if not (inventory / f"tier1-{test}").exists()]
    registered = set(scenarios.ids()) | {s.id for s in scenarios.PROBES}
    survivors = [p for p in psutil.process_iter()
                 if _environ(p).get(MARKER) in registered and _environ(p).get(RUN_ENV) == run]
    described = [f"{p.pid} {_environ(p).get(MARKER)}: {_cmdline(p)}" for p in survivors]
    for proc in survivors:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    assert not described, f"processes with a scenario marker survived: {described}"
    assert not missing, f"registered scenarios that did not run: {missing}"


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:200]
    except psutil.Error:
        return "?"


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return dict(proc.environ())
    except psutil.Error:
        return {}
