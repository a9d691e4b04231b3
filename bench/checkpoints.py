"""Checkpoint benchmarks: durable group-commit throughput, and stepping while checkpointing.

Prints JSON lines:
  {"bench":"checkpoint_commit","mb":..,"mb_per_s":..,"floor_mb_per_s":..,"ratio":..}
  {"bench":"checkpoint_stepping","steps":..,"every_steps":..,"steps_per_s":..,
   "floor_steps_per_s":..,"ratio":..}

`checkpoint_commit`: a durable commit of a 1, 16 and 64 MiB envelope through the production path
(`PgCheckpointStore.commit` over the lease layer's fenced group commit on a claimed run), median
of 9, 5 and 3 commits alternated with the floor's; the floor is an INSERT of the same bytes
into a bytea column in one transaction from psycopg, in the same run. `ratio` = mb_per_s /
floor_mb_per_s (target ≥ 0.8).
`checkpoint_stepping`: `flyd run` steps/s with a capture every 10 steps and at every step
(`--checkpoint-every 1`: the writer is never idle) against no cadence (`--checkpoint-every 0`,
the floor); `ratio` = with / without (target ≥ 0.8). A capture asks every participant for its
state at the boundary before the next step starts; the commit runs behind the stepping.
Run it as `python -P bench/checkpoints.py` (the bench directory's `bus.py` must not shadow the
`bus` package). Uses `FLYD_TEST_DSN`'s server or the local one on 127.0.0.1:5432.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
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
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.state.checkpoints import CommitJob, DirectCommitPath, PgCheckpointStore
from flyd.state.compat import STATE_FORMAT_ID
from flyd.state.envelope import encode
from workers.types.canonical import canonical, digest_bytes, digest_of
from workers.types.ticks import RationalNs

ROOT = Path(__file__).resolve().parent.parent
LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"
MIB = 1 << 20
NODE = "bench-000000000001"
COMPAT = {"stateFormatId": STATE_FORMAT_ID, "backendDigest": "1" * 64,
          "contentDigest": "2" * 64, "patchDigest": "3" * 64, "controllerDigest": "4" * 64,
          "parserDigest": "5" * 64}


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def emit(line: dict[str, Any]) -> None:
    print(orjson.dumps(line).decode(), flush=True)


def envelope(checkpoint_id: str, boundary: int, world: bytes) -> bytes:
    """A valid FLYSESS1 envelope whose world payload is `world` (no agents)."""
    payloads = [("world", world), ("task-ledger", canonical({"boundary": boundary})),
                ("prior-inspection", b"{}"), ("coordinator-admission", b"{}")]
    manifest: dict[str, Any] = {
        "envelopeVersion": 1, "checkpointId": checkpoint_id,
        "sourceScope": {"sessionId": "bench", "epoch": "e1", "step": str(boundary)},
        "episodeId": "ep-1", "worldTime": RationalNs(0).to_json(), "schedulerId": "lockstep-v1",
        "compositionDigest": "6" * 64, "portMap": [], "compatibility": dict(COMPAT),
        "agents": [], "environment": {"workerId": "arena", "payload": "world"},
        "helperState": [],
        "coordinator": {"taskLedger": "task-ledger", "priorInspection": "prior-inspection",
                        "executorState": [], "admissionState": "coordinator-admission",
                        "eventWatermarks": {"lastSourceStep": "0", "issued": "0"}},
        "payloads": [{"name": n, "byteLength": str(len(b)), "digest": digest_bytes(b)}
                     for n, b in payloads]}
    return encode(manifest, payloads)


async def bench_commit(dsn: str) -> None:
    spec: dict[str, Any] = {}
    async with PgStore(dsn, NODE, DbSettings(statement_timeout_ms=60000,
                                             idle_in_transaction_timeout_ms=60000),
                       LeaseParams(ttl_s=3600.0, heartbeat_interval_s=1.0,
                                   commit_timeout_s=60.0, commit_budget_s=61.0,
                                   safety_margin_s=200.0, statement_timeout_ms=60000.0,
                                   idle_in_transaction_timeout_ms=60000.0)) as lease:
        run = (await lease.submit(None, spec, 3)).run_id
        [grant] = await lease.claim(NODE, 1, 3600.0)
        path = DirectCommitPath(lease, run, grant.lease_epoch, NODE)
        store = PgCheckpointStore(dsn, timeout_s=120.0)
        boundary = 0
        try:
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
                await conn.execute("CREATE TABLE bench_floor (id bigserial PRIMARY KEY, "
                                   "data bytea NOT NULL)")
                await conn.execute("ALTER TABLE bench_floor ALTER COLUMN data "
                                   "SET STORAGE EXTERNAL")
                for mb, repeats in ((1, 9), (16, 5), (64, 3)):
                    world = os.urandom(mb * MIB)
                    ours: list[float] = []
                    floor: list[float] = []
                    for _ in range(repeats):
                        boundary += 1
                        cid = f"ck-e1-{boundary}"
                        data = envelope(cid, boundary, world)
                        job = CommitJob(run_id=run, lease_epoch=grant.lease_epoch,
                                        checkpoint_id=cid, session_id="bench",
                                        session_epoch="e1", episode_id="ep-1",
                                        boundary=boundary,
                                        compatibility_digest=digest_of(COMPAT), envelope=data,
                                        envelope_digest=hashlib.sha256(data).digest())
                        t0 = time.perf_counter()
                        await store.commit(job, path)
                        ours.append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        async with conn.transaction():
                            await conn.execute("INSERT INTO bench_floor (data) VALUES (%s)",
                                               (data,))
                        floor.append(time.perf_counter() - t0)
                    size = len(data) / MIB
                    rate = size / statistics.median(ours)
                    floor_rate = size / statistics.median(floor)
                    emit({"bench": "checkpoint_commit", "mb": mb,
                          "mb_per_s": round(rate, 1), "floor_mb_per_s": round(floor_rate, 1),
                          "ratio": round(rate / floor_rate, 3)})
        finally:
            await store.close()


def steps_per_s(dsn: str, every: int, steps: int) -> float:
    tmp = tempfile.mkdtemp(prefix="flyd-bench-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    try:
        out = subprocess.run(
            [sys.executable, "-m", "flyd", "run", "--json", "-q", "--steps", str(steps),
             "--mode", "process", "--checkpoint-every", str(every), "--dsn", dsn, "--socket",
             os.path.join(tmp, "run.sock")], cwd=ROOT, env=env, capture_output=True, check=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    summary = orjson.loads(out.stdout)
    if summary["state"] != "succeeded":
        raise RuntimeError(f"flyd run ended {summary['state']}: {summary['failures']}")
    return float(summary["stepsPerSecond"])


def main() -> None:
    admin = os.environ.get("FLYD_TEST_DSN") or LOCAL
    name = f"flyd_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin, dbname=name)
    try:
        asyncio.run(migrate(dsn))
        progress("durable commits of 1, 16 and 64 MiB envelopes")
        asyncio.run(bench_commit(dsn))
        progress("steps/s with captures every 10 steps and at every step, against none")
        steps = 300
        without = statistics.median(steps_per_s(dsn, 0, steps) for _ in range(3))
        for every in (10, 1):
            rate = statistics.median(steps_per_s(dsn, every, steps) for _ in range(3))
            emit({"bench": "checkpoint_stepping", "steps": steps, "every_steps": every,
                  "steps_per_s": rate, "floor_steps_per_s": without,
                  "ratio": round(rate / without, 3)})
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


if __name__ == "__main__":
    main()
