"""Failover benchmark: SIGKILL of the holder to the run's next committed boundary elsewhere.

Two real `flyd serve` nodes share a database created and dropped here for each TTL (a fresh one
per TTL, so no run of the first case is claimed in the second; `FLYD_TEST_DSN`'s server or
127.0.0.1:5432). Node A claims a paced run (process mode, `paceS` 0.05, a checkpoint every 5
steps) and commits boundaries; node B starts and idles; A is killed with SIGKILL. The clock is the
database's: `killed_at` = `clock_timestamp()` just before the kill; `reclaim_s` = the grant of
lease epoch 2 (`run_attempts.granted_at`); `commit_s` = the first `effects` row written under
epoch 2 (`recorded_at`), i.e. the run's next committed boundary on B after the restore, relaunch
and the steps up to the next checkpoint. The line splits `commit_s` into where the time went:
`expiry_s` (kill to the expiry of A's lease, `ended_at` of epoch 1: what A's last renewal left
of the TTL), `notice_s` (expiry to B's grant: B noticing the expired lease and claiming it) and
`start_s` (grant to the committed boundary: worker launch, restore of the head, the steps to the
next capture and its group commit). Measured at the short-TTL profile (4 s, the config file of
`bench/leases.py`) and at the default TTL (15 s). Prints one JSON line per TTL:

  {"bench":"failover","to":"committed_boundary","ttl_s":..,"reclaim_s":..,"commit_s":..,
   "expiry_s":..,"notice_s":..,"start_s":..,"ttl_multiple":..,"target_s":..,"met":..}

`ttl_multiple` = commit_s / ttl_s; the target is commit_s ≤ 1.0 × TTL + 1 s (the holder's last
renewal already used part of the TTL, so the reclaim itself comes before a full TTL).
`bench/leases.py`'s `failover` line measures only the reclaim. Run it as
`python -P bench/failover.py`. Progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from flyd.leases.migrate import migrate
from flyd.leases.params import LeaseParams
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.session.runspec import RunSpec

ROOT = Path(__file__).resolve().parent.parent
LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"
PACE_S = 0.05
EVERY_STEPS = 5
POLL_S = 0.05
START_S = 60.0


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def emit(line: dict[str, Any]) -> None:
    print(orjson.dumps(line).decode(), flush=True)


def leases_bench() -> ModuleType:
    """bench/leases.py by path (its `serve`, `one` and `SHORT_TTL`)."""
    spec = importlib.util.spec_from_file_location("bench_leases", ROOT / "bench" / "leases.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def submit(dsn: str) -> int:
    spec = RunSpec.validate({"steps": "100000", "mode": "process", "paceS": PACE_S,
                             "checkpoints": {"everySteps": EVERY_STEPS}}).to_json()
    async with PgStore(dsn, "bench", DbSettings(), LeaseParams()) as store:
        return (await store.submit(None, spec, 5)).run_id


def wait_for(conn: psycopg.Connection[Any], what: str, query: str, *args: Any,
             timeout: float = START_S) -> Any:
    """Poll `query` (first column of the first row) until it is not None/0, within `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        row = conn.execute(query, args).fetchone()
        if row is not None and row[0]:
            return row[0]
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: nothing after {timeout:g}s")
        time.sleep(POLL_S)


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def bench_failover(leases: ModuleType, dsn: str, ttl: float, config: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-"))
    tag = f"t{int(ttl)}"
    active = ("SELECT count(*) FROM flyd.nodes WHERE node_name = %s AND state = 'active'")
    a: subprocess.Popen[bytes] = leases.serve(tmp, f"a{tag}", dsn, config)
    b: subprocess.Popen[bytes] | None = None
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_for(conn, "node A active", active, f"a{tag}")
            run = asyncio.run(submit(dsn))
            wait_for(conn, "a boundary committed by A",
                     "SELECT count(*) FROM flyd.effects WHERE run_id = %s AND lease_epoch = 1",
                     run)
            b = leases.serve(tmp, f"b{tag}", dsn, config)
            wait_for(conn, "node B active", active, f"b{tag}")
            time.sleep(1.0)
            killed_at = wait_for(conn, "clock", "SELECT clock_timestamp()")
            a.send_signal(signal.SIGKILL)
            bound = 4 * ttl + 20
            granted = wait_for(conn, "the grant of epoch 2",
                               "SELECT granted_at FROM flyd.run_attempts WHERE run_id = %s "
                               "AND lease_epoch = 2", run, timeout=bound)
            committed = wait_for(conn, "a boundary committed under epoch 2",
                                 "SELECT min(recorded_at) FROM flyd.effects WHERE run_id = %s "
                                 "AND lease_epoch = 2", run, timeout=bound)
            expired = leases.one(conn, "SELECT ended_at FROM flyd.run_attempts "
                                       "WHERE run_id = %s AND lease_epoch = 1", run)
            holder = leases.one(conn, "SELECT n.node_name FROM flyd.run_attempts a JOIN "
                                      "flyd.nodes n USING (node_id) WHERE a.run_id = %s AND "
                                      "a.lease_epoch = 2", run)
            assert holder == f"b{tag}", holder
            reclaim = (granted - killed_at).total_seconds()
            commit = (committed - killed_at).total_seconds()
            emit({"bench": "failover", "to": "committed_boundary", "ttl_s": ttl,
                  "reclaim_s": round(reclaim, 3), "commit_s": round(commit, 3),
                  "expiry_s": round((expired - killed_at).total_seconds(), 3),
                  "notice_s": round((granted - expired).total_seconds(), 3),
                  "start_s": round((committed - granted).total_seconds(), 3),
                  "ttl_multiple": round(commit / ttl, 3), "target_s": ttl + 1.0,
                  "met": commit <= ttl + 1.0})
            conn.execute("UPDATE flyd.runs SET cancel_requested = true WHERE run_id = %s",
                         (run,))
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
        stop(b)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    admin = os.environ.get("FLYD_TEST_DSN") or LOCAL
    leases = leases_bench()
    for ttl, config, profile in ((4.0, leases.SHORT_TTL, "short-TTL profile"),
                                 (15.0, "", "default TTL")):
        name = f"flyd_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        dsn = make_conninfo(admin, dbname=name)
        try:
            asyncio.run(migrate(dsn))
            progress(f"failover to the next committed boundary, {profile} ({ttl:g} s)")
            bench_failover(leases, dsn, ttl, config)
        finally:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(name)))


if __name__ == "__main__":
    main()
