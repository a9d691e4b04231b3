"""The embedded PostgreSQL default (distribution.md §5.9)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import psycopg
import pytest

from flyd.leases.embedded import EmbeddedPostgres, embedded_dsn_if_running


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
