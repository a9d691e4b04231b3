"""Tier-2 tests of distribution.md §8 with real node processes (tests 58–59 so far).

The scenario registry, fault proxy and oracle of §7.3 join this file with the fault suite; the
tests here need only a real node, a real PostgreSQL and signals.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import psutil
import psycopg
import pytest

from flyd.leases.embedded import EmbeddedPostgres
from flyd.leases.params import LeaseParams
from flyd.leases.pgstore import DbSettings, PgStore
from flyd.runspec import RunSpec
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
    assert version == 3
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
