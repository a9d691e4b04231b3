"""The embedded PostgreSQL default (distribution.md §5.9)."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import psutil
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from flyd.leases.embedded import EmbeddedPostgres, embedded_dsn_if_running, start_failure_cause


def _postmasters(pgdata: Path) -> list[psutil.Process]:
    """Running `postgres` processes serving `pgdata`."""
    found = []
    for proc in psutil.process_iter(attrs=["name", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if proc.info["name"] == "postgres" and str(pgdata) in cmdline:
            found.append(proc)
    return found


@pytest.fixture
def state_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short state dir (the server's socket lives in its data dir), XDG_RUNTIME_DIR unset."""
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    with tempfile.TemporaryDirectory(prefix="flyd-emb-") as tmp:
        yield Path(tmp)


async def _flyd_runs_exists(dsn: str) -> bool:
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute("SELECT to_regclass('flyd.runs') IS NOT NULL, "
                                 "(SELECT count(*) FROM flyd.sim_clock)")
        row = await cur.fetchone()
    assert row is not None
    assert row[1] == 0  # no sim_clock row (§5.9)
    return bool(row[0])


async def test_embedded_server_lives_under_the_state_dir(state_dir: Path) -> None:
    embedded = EmbeddedPostgres()
    dsn = await embedded.start(state_dir)
    pgdata = state_dir / "pg"
    try:
        run = state_dir / "run"
        assert run.is_dir() and stat.S_IMODE(run.stat().st_mode) == 0o700
        assert (run / "python_PostgresServer").is_dir()  # pgserver's lock directory
        assert "XDG_RUNTIME_DIR" not in os.environ
        assert (pgdata / "PG_VERSION").is_file()
        assert await _flyd_runs_exists(dsn)
        assert embedded.schema_version >= 1
        found = embedded_dsn_if_running(state_dir)
        assert found is not None
        assert await _flyd_runs_exists(found)
        assert len(_postmasters(pgdata)) == 1
    finally:
        await embedded.stop()
    assert _postmasters(pgdata) == []
    assert embedded_dsn_if_running(state_dir) is None

    again = EmbeddedPostgres()
    dsn = await again.start(state_dir)
    try:
        assert await _flyd_runs_exists(dsn)  # the same data directory, already migrated
    finally:
        await again.stop()
    assert _postmasters(pgdata) == []


def test_db_migrate_prints_the_schema_version(db_dsn: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    proc = subprocess.run([sys.executable, "-m", "flyd", "db", "migrate", "--dsn", db_dsn,
                           "--json"], env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    version = psycopg.connect(db_dsn).execute(
        "SELECT max(version) FROM flyd.schema_migrations").fetchone()
    assert version is not None
    assert proc.stdout.strip() == f'{{"schemaVersion":{version[0]}}}'
    human = subprocess.run([sys.executable, "-m", "flyd", "db", "migrate", "--dsn", db_dsn],
                           env=env, capture_output=True, text=True, timeout=60, check=False)
    assert human.returncode == 0 and human.stdout.strip() == f"schema version {version[0]}"


def test_db_migrate_without_a_dsn_uses_the_embedded_server(state_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLYD_") and k != "XDG_RUNTIME_DIR"}
    env["FLYD_STATE_DIR"] = str(state_dir)
    proc = subprocess.run([sys.executable, "-m", "flyd", "db", "migrate", "--json"], env=env,
                          capture_output=True, text=True, timeout=90, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith('{"schemaVersion":')
    assert (state_dir / "pg" / "PG_VERSION").is_file()
    assert stat.S_IMODE((state_dir / "run").stat().st_mode) == 0o700
    assert _postmasters(state_dir / "pg") == []


def _creating(admin: psycopg.Connection[Any]) -> set[int]:
    """Backends whose `CREATE DATABASE` waits for a lock."""
    rows = admin.execute("SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                         "AND query ILIKE 'CREATE DATABASE%'").fetchall()
    return {int(r[0]) for r in rows}


@pytest.mark.timeout(240)
def test_two_flyd_runs_on_a_fresh_state_dir_both_create_the_database(state_dir: Path) -> None:
    """Two `flyd run` started together on a state dir without database `flyd` both find it
    missing and both create it; the loser of that race joins the winner's database instead of
    failing with a raw `duplicate key … pg_database_datname_index`. The race is made certain:
    the test holds `pg_database` until both processes wait inside `CREATE DATABASE` (the
    vacuity check), then lets them go."""
    embedded = EmbeddedPostgres()  # keeps the server up, so the runs join it
    dsn = asyncio.run(embedded.start(state_dir))
    procs: list[subprocess.Popen[str]] = []
    try:
        admin_dsn = make_conninfo(dsn, dbname="postgres")
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute("DROP DATABASE flyd")
            holder = psycopg.connect(admin_dsn)
            holder.execute("LOCK TABLE pg_database IN EXCLUSIVE MODE")
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith("FLYD_") and k != "XDG_RUNTIME_DIR"}
            for name in ("a", "b"):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "flyd", "run", "--json", "--steps", "3", "--mode",
                     "in-process", "--state-dir", str(state_dir), "--socket",
                     str(state_dir / f"{name}.sock")],
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            deadline = time.monotonic() + 120
            while len(_creating(admin)) < 2:
                assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
                assert time.monotonic() < deadline, "the runs never both reached CREATE DATABASE"
                time.sleep(0.1)
            holder.commit()
            holder.close()
        for proc in procs:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, (out, err[-3000:])
            assert "Traceback" not in err and "duplicate key" not in out + err, err[-3000:]
            assert orjson.loads(out.splitlines()[-1])["state"] == "succeeded"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        asyncio.run(embedded.stop())
    assert _postmasters(state_dir / "pg") == []


def test_a_start_failure_names_the_line_that_says_why() -> None:
    """`start_failure_cause` picks, from pgserver's captured error lines and the server log, a
    full disk first, then a permission, then any PostgreSQL error; nothing useful gives ""."""
    lines = ["pg_ctl: could not start server", "Examine the log output.",
             "2026-01-01 FATAL:  could not open file \"global/pg_filenode.map\": Permission denied",
             "initdb: error: could not write to file \"x\": No space left on device"]
    assert start_failure_cause(lines) == lines[3]
    assert start_failure_cause(lines[:3]) == lines[2]
    assert start_failure_cause(lines[:2]) == lines[0]
    assert start_failure_cause(["", "  ", "waiting for server to start"]) == ""
    assert len(start_failure_cause(["FATAL: " + "x" * 1000])) == 300
