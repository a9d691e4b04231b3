"""Lease benchmarks: claim latency, renew round trip, failover after a node kill.

Runs against `FLYD_TEST_DSN`'s server (or the local one on 127.0.0.1:5432, or an embedded
pgserver), in a temporary database created and dropped here. Prints JSON lines:

  {"bench":"claim","claims":..,"median_ms":..,"p99_ms":..,"floor_ms":..,"ratio":..}
  {"bench":"renew","holds":..,"median_ms":..,"p99_ms":..,"floor_ms":..,"ratio":..}
  {"bench":"failover","ttl_s":..,"reclaim_s":..,"ttl_multiple":..}

The floor of claim and renew is a committed single-row UPDATE (one WAL flush, the least any
durable lease write costs) on a plain connection in the same run; `read_floor_ms` is a bare
`SELECT 1` round trip for reference. Run it as `python -P bench/leases.py` (`-P`: the bench
directory's `bus.py` must not shadow the `bus` package). Failover is
measured with two real `flyd serve` nodes in real time: SIGKILL of the holder to the next
grant (`run_attempts.granted_at` of the first epoch above the one the killed holder held), at
the default TTL (15 s) and the short-TTL profile (4 s); the target is <= 1.0 x TTL + 1 s (the
holder's last renewal already covered part of the
TTL, so the reclaim can come earlier than a full TTL).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from flyd.leases.migrate import migrate
from flyd.leases.params import LeaseParams
from flyd.leases.stores.contract import Held
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.session.runspec import RunSpec

ROOT = Path(__file__).resolve().parent.parent
LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"
SHORT_TTL = ("[leases]\nttl_s = 4\nheartbeat_interval_s = 0.6\nrenew_timeout_s = 0.5\n"
             "safety_margin_s = 1.75\ncommit_timeout_s = 0.5\ncommit_budget_s = 0.75\n"
             "claim_poll_s = 0.5\n[database]\nstatement_timeout_ms = 500\n"
             "idle_in_transaction_timeout_ms = 500\nconnect_timeout_s = 0\n")


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def emit(line: dict[str, Any]) -> None:
    print(orjson.dumps(line).decode(), flush=True)


def server_dsn() -> str:
    return os.environ.get("FLYD_TEST_DSN") or LOCAL


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


FLOOR: dict[str, float] = {}


async def bench_write_floor(dsn: str) -> None:
    """The bare cost of one committed single-row write (a WAL flush) on this server."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("CREATE TABLE bench_floor (id int PRIMARY KEY, n int)")
        await conn.execute("INSERT INTO bench_floor VALUES (1, 0)")
        times: list[float] = []
        for _ in range(300):
            t0 = time.perf_counter()
            await conn.execute("UPDATE bench_floor SET n = n + 1 WHERE id = 1")
            times.append((time.perf_counter() - t0) * 1000)
    FLOOR["write_ms"] = statistics.median(times)


async def bench_statements(dsn: str) -> None:
    spec = RunSpec.validate({"steps": "10", "mode": "in-process"}).to_json()
    params = LeaseParams(ttl_s=3600.0, heartbeat_interval_s=1.0)
    async with PgStore(dsn, "bench-node", DbSettings(), params, capacity=4) as store:
        for _ in range(500):
            await store.submit(None, spec, 3)
        floor: list[float] = []
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            for _ in range(500):
                t0 = time.perf_counter()
                await conn.execute("SELECT 1")
                floor.append((time.perf_counter() - t0) * 1000)
        claims: list[float] = []
        held: list[Held] = []
        for _ in range(500):
            t0 = time.perf_counter()
            grants = await store.claim("bench-node", 1, params.ttl_s)
            claims.append((time.perf_counter() - t0) * 1000)
            held += [Held(g.run_id, g.lease_epoch) for g in grants]
        floor_ms = FLOOR["write_ms"]
        emit({"bench": "claim", "claims": len(held), "median_ms": round(statistics.median(
            claims), 3), "p99_ms": round(pct(claims, 0.99), 3), "floor_ms": round(floor_ms, 3),
            "read_floor_ms": round(statistics.median(floor), 3),
            "ratio": round(statistics.median(claims) / floor_ms, 2)})
        for holds in (1, 4, 64):
            renews: list[float] = []
            for _ in range(300):
                t0 = time.perf_counter()
                rows = await store.renew("bench-node", held[:holds], params.ttl_s)
                renews.append((time.perf_counter() - t0) * 1000)
                assert len(rows) == holds
            emit({"bench": "renew", "holds": holds,
                  "median_ms": round(statistics.median(renews), 3),
                  "p99_ms": round(pct(renews, 0.99), 3), "floor_ms": round(floor_ms, 3),
                  "ratio": round(statistics.median(renews) / floor_ms, 2)})


def serve(tmp: Path, name: str, dsn: str, config: str) -> subprocess.Popen[bytes]:
    home = tmp / name
    home.mkdir()
    (home / "flyd.toml").write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    return subprocess.Popen(
        [sys.executable, "-m", "flyd", "serve", "--dsn", dsn, "--socket",
         str(home / "bus.sock"), "--state-dir", str(home), "--node-name", name, "--config",
         str(home / "flyd.toml"), "-q", "-q"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one(conn: psycopg.Connection[Any], query: str, *args: Any) -> Any:
    row = conn.execute(query, args).fetchone()  # type: ignore[arg-type]
    return None if row is None else row[0]


async def submit_one(dsn: str) -> int:
    spec = RunSpec.validate({"steps": "100000", "mode": "in-process", "paceS": 0.05}).to_json()
    async with PgStore(dsn, "bench", DbSettings(), LeaseParams()) as store:
        return (await store.submit(None, spec, 5)).run_id


def bench_failover(dsn: str, ttl: float, config: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-"))
    tag = f"t{int(ttl)}"
    a = serve(tmp, f"a{tag}", dsn, config)
    b: subprocess.Popen[bytes] | None = None
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while one(conn, "SELECT count(*) FROM flyd.nodes WHERE node_name = %s "
                            "AND state = 'active'", f"a{tag}") == 0:
                time.sleep(0.05)
            run = asyncio.run(submit_one(dsn))
            while one(conn, "SELECT count(*) FROM flyd.run_attempts WHERE run_id = %s",
                      run) == 0:
                time.sleep(0.05)
            holder = one(conn, "SELECT n.node_name FROM flyd.run_attempts a JOIN flyd.nodes n "
                               "USING (node_id) WHERE a.run_id = %s", run)
            assert holder == f"a{tag}", holder
            b = serve(tmp, f"b{tag}", dsn, config)
            while one(conn, "SELECT count(*) FROM flyd.nodes WHERE node_name = %s "
                            "AND state = 'active'", f"b{tag}") == 0:
                time.sleep(0.05)
            time.sleep(1.0)
            held = conn.execute("SELECT r.lease_epoch, n.node_name, clock_timestamp() "
                                "FROM flyd.runs r JOIN flyd.nodes n ON n.node_id = r.owner_node "
                                "WHERE r.run_id = %s", (run,)).fetchone()
            a.send_signal(signal.SIGKILL)
            if held is None or held[1] != f"a{tag}":
                raise RuntimeError(f"run {run} was not held by a{tag} at the kill: {held}")
            epoch, killed_at = int(held[0]), held[2]
            deadline = time.monotonic() + 4 * ttl + 10
            while True:
                granted = one(conn, "SELECT min(granted_at) FROM flyd.run_attempts WHERE "
                                    "run_id = %s AND lease_epoch > %s", run, epoch)
                if granted is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            reclaim = (granted - killed_at).total_seconds() if granted is not None else None
            emit({"bench": "failover", "ttl_s": ttl,
                  "reclaim_s": None if reclaim is None else round(reclaim, 3),
                  "ttl_multiple": None if reclaim is None else round(reclaim / ttl, 3)})
            conn.execute("UPDATE flyd.runs SET cancel_requested = true WHERE run_id = %s",
                         (run,))
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    admin = server_dsn()
    name = f"flyd_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin, dbname=name)
    try:
        asyncio.run(migrate(dsn))
        progress("claim and renew round trips")
        asyncio.run(bench_write_floor(dsn))
        asyncio.run(bench_statements(dsn))
        progress("failover at the short-TTL profile (4 s)")
        bench_failover(dsn, 4.0, SHORT_TTL)
        progress("failover at the default TTL (15 s)")
        bench_failover(dsn, 15.0, "")
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


if __name__ == "__main__":
    main()
