"""Claim-throughput benchmark: claims/s with 1, 4 and 8 concurrent nodes over 10k pending runs.

Each node is its own `PgStore` (its own pool, connection and node id) in this process; all of
them run concurrently on one asyncio loop and claim through the production CLAIM (`PgStore.claim`:
`FOR UPDATE SKIP LOCKED`, the grant and the attempt row in one statement) until the level's quota
of grants is taken. Two batch sizes per level: one grant per round trip (`batch` 1, a node with
one free slot) and `claim_batch` grants per round trip (4 by default, what a node with free
capacity asks for, distribution.md §5.7). The queue holds at least 10k pending runs throughout:
10k plus the quota are inserted once, and every measurement starts from the same queue (the
previous one's grants are put back to pending by a direct UPDATE and the table vacuumed); the
grants a measurement makes stay held while it runs, so later claims pass over them.

Floor, measured in the same run with the same concurrency: each of N plain autocommit
connections repeats a trivial one-row UPDATE of its own row (one WAL flush per commit, the least
any durable claim statement costs), N concurrent on the same loop. Prints one JSON line per level
and batch size:

  {"bench":"claims","nodes":N,"batch":B,"claims":..,"claims_per_s":..,"statements_per_s":..,
   "floor_updates_per_s":..,"ratio":..,"pending_at_start":..,"target_per_s":1000,"met":..}

`ratio` = statements_per_s / floor_updates_per_s (claim statements against one-row UPDATEs, both
one commit each); the target (8 nodes) is ≥ 1000 claims/s absolute, `met` says whether this line
reaches it (only the 8-node lines carry the target). Runs against `FLYD_TEST_DSN`'s server (or
127.0.0.1:5432) in a database created and dropped here. Run it as `python -P bench/claims.py`.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.types.json import Jsonb

from flyd.leases.migrate import migrate
from flyd.leases.params import LeaseParams
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.session.runspec import RunSpec

LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"
LEVELS = (1, 4, 8)
PENDING = 10_000
TTL_S = 3600.0
TARGET = 1000
DEADLINE_S = 120.0


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def emit(line: dict[str, Any]) -> None:
    print(orjson.dumps(line).decode(), flush=True)


async def seed(dsn: str, runs: int) -> None:
    """`runs` pending runs of one small spec, in one INSERT (the triggers add their heads)."""
    spec = RunSpec.validate({"steps": "10", "mode": "in-process"}).to_json()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("INSERT INTO flyd.runs (spec, max_attempts) "
                           "SELECT %s, 3 FROM generate_series(1, %s)", (Jsonb(spec), runs))


async def requeue_all(dsn: str) -> None:
    """Every held run back to pending (a bench reset, not a lease operation)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("UPDATE flyd.runs SET state = 'pending', owner_node = NULL, "
                           "lease_expires_at = NULL WHERE state = 'running'")
        await conn.execute("VACUUM ANALYZE flyd.runs")


async def pending(dsn: str) -> int:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        row = await (await conn.execute(
            "SELECT count(*) FROM flyd.runs WHERE state = 'pending'")).fetchone()
    assert row is not None
    return int(row[0])


async def claims_per_s(dsn: str, nodes: int, batch: int,
                       quota: int) -> tuple[int, int, float]:
    """`nodes` stores claim `batch` runs per statement until `quota` grants are made in total;
    returns (grants, statements, seconds)."""
    params = LeaseParams(ttl_s=TTL_S, heartbeat_interval_s=1.0)
    names = [f"bench-claim-{nodes}-{i}" for i in range(nodes)]
    stores = [PgStore(dsn, name, DbSettings(), params) for name in names]
    taken = 0
    statements = 0

    async def claimer(store: PgStore, name: str) -> None:
        nonlocal taken, statements
        while taken < quota:
            grants = await store.claim(name, batch, TTL_S)
            if not grants:
                raise RuntimeError("the queue ran dry")
            taken += len(grants)
            statements += 1

    try:
        for store in stores:
            await store.open()
        for store, name in zip(stores, names, strict=True):  # one warm-up claim each
            await store.claim(name, 1, TTL_S)
        async with asyncio.timeout(DEADLINE_S):
            t0 = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for store, name in zip(stores, names, strict=True):
                    tg.create_task(claimer(store, name))
            elapsed = time.perf_counter() - t0
    finally:
        for store in stores:
            await store.close()
    return taken, statements, elapsed


async def updates_per_s(dsn: str, nodes: int, quota: int) -> float:
    """The floor: `nodes` connections each updating its own row until `quota` commits."""
    conns = [await psycopg.AsyncConnection.connect(dsn, autocommit=True) for _ in range(nodes)]
    done = 0

    async def updater(conn: psycopg.AsyncConnection[Any], row: int) -> None:
        nonlocal done
        while done < quota:
            await conn.execute("UPDATE bench_floor SET n = n + 1 WHERE id = %s", (row,))
            done += 1

    try:
        await conns[0].execute("CREATE TABLE IF NOT EXISTS bench_floor "
                               "(id int PRIMARY KEY, n int NOT NULL)")
        await conns[0].execute("INSERT INTO bench_floor SELECT g, 0 FROM generate_series(0, 7) g "
                               "ON CONFLICT DO NOTHING")
        for i, conn in enumerate(conns):
            await conn.execute("UPDATE bench_floor SET n = n + 1 WHERE id = %s", (i,))
        async with asyncio.timeout(DEADLINE_S):
            t0 = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for i, conn in enumerate(conns):
                    tg.create_task(updater(conn, i))
            elapsed = time.perf_counter() - t0
    finally:
        for conn in conns:
            await conn.close()
    return done / elapsed


async def bench(dsn: str, quota: int) -> None:
    await migrate(dsn)
    batches = (1, LeaseParams().claim_batch)
    progress(f"seeding {PENDING} + {quota} pending runs")
    await seed(dsn, PENDING + quota + 2 * max(LEVELS) * max(batches))
    for nodes in LEVELS:
        floor = 0.0
        for batch in batches:
            await requeue_all(dsn)
            waiting = await pending(dsn)
            progress(f"{nodes} nodes, batch {batch}: {quota} claims over {waiting} pending runs")
            taken, statements, elapsed = await claims_per_s(dsn, nodes, batch, quota)
            if not floor:
                progress(f"{nodes} nodes: the floor")
                floor = await updates_per_s(dsn, nodes, quota)
            rate = taken / elapsed
            line: dict[str, Any] = {
                "bench": "claims", "nodes": nodes, "batch": batch, "claims": taken,
                "claims_per_s": round(rate, 1), "statements_per_s": round(statements / elapsed, 1),
                "floor_updates_per_s": round(floor, 1),
                "ratio": round(statements / elapsed / floor, 3), "pending_at_start": waiting}
            if nodes == max(LEVELS):
                line |= {"target_per_s": TARGET, "met": rate >= TARGET}
            emit(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--claims", type=int, default=400, help="claims per level")
    args = ap.parse_args()
    admin = os.environ.get("FLYD_TEST_DSN") or LOCAL
    name = f"flyd_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        asyncio.run(bench(make_conninfo(admin, dbname=name), args.claims))
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


if __name__ == "__main__":
    main()
