"""Suite-wide test configuration.

- Every asyncio test runs on uvloop, as production does.
- PostgreSQL fixtures (distribution.md §7.3.1), used by the distribution, state and cli suites:
  ``FLYD_TEST_DSN`` names the server (a role with CREATEDB); if it does not answer, the tests
  error with a clear message (they never skip). When it is unset, the local server on
  127.0.0.1:5432 is used if it answers, else an embedded pgserver cluster in a temporary
  directory (one per test process), stopped and removed at the end of the session. The schema
  is migrated once per session into a template database; each test gets a fresh database made
  from it (``CREATE DATABASE ... TEMPLATE``) and dropped afterwards.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import Any

import psycopg
import pytest
import uvloop
from psycopg import sql
from psycopg.conninfo import make_conninfo

from flyd.leases.migrate import migrate


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], Any]]:
    return {"uvloop": uvloop.new_event_loop}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `long` (minutes each) go first. `make test` hands xdist's workers one test
    at a time (`--maxschedchunk 1`), so the long ones start at once on their own workers and
    no short test waits queued behind one; the fault suite's inventory test (test 60), which
    waits for every test of its package, then never waits for one stuck in such a queue."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


LOCAL_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def _admin(server_dsn: str) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(server_dsn, autocommit=True, connect_timeout=5)


def _create_db(server_dsn: str, name: str, template: str | None = None) -> str:
    with _admin(server_dsn) as conn:
        if template is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        else:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                    sql.Identifier(name), sql.Identifier(template)
                )
            )
    return make_conninfo(server_dsn, dbname=name)


def _drop_db(server_dsn: str, name: str) -> None:
    with _admin(server_dsn) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def _answers(dsn: str) -> str | None:
    """None when the server answers, else why not."""
    try:
        with _admin(dsn) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def pg_server_dsn() -> Iterator[str]:
    """DSN of the test server's maintenance database (role with CREATEDB)."""
    dsn = os.environ.get("FLYD_TEST_DSN")
    if dsn:
        problem = _answers(dsn)
        if problem is not None:
            pytest.fail(f"FLYD_TEST_DSN ({dsn}) does not answer: {problem}", pytrace=False)
        yield dsn
        return
    if _answers(LOCAL_DSN) is None:
        yield LOCAL_DSN
        return
    import pgserver  # the embedded fallback: only needed on a machine without a server

    datadir = tempfile.mkdtemp(prefix="flyd-test-pg-")
    server = pgserver.get_server(datadir, cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
        shutil.rmtree(datadir, ignore_errors=True)


@pytest.fixture(scope="session")
def pg_template(pg_server_dsn: str) -> Iterator[str]:
    """Name of a per-session template database with the schema migrated."""
    name = f"flyd_tpl_{uuid.uuid4().hex[:12]}"
    dsn = _create_db(pg_server_dsn, name)
    try:
        asyncio.run(migrate(dsn))
        yield name
    finally:
        _drop_db(pg_server_dsn, name)


@pytest.fixture
def db_dsn(pg_server_dsn: str, pg_template: str) -> Iterator[str]:
    """DSN of a fresh, migrated database for this test; dropped afterwards."""
    name = f"flyd_t_{uuid.uuid4().hex[:12]}"
    dsn = _create_db(pg_server_dsn, name, template=pg_template)
    try:
        yield dsn
    finally:
        _drop_db(pg_server_dsn, name)


@pytest.fixture
def empty_db_dsn(pg_server_dsn: str) -> Iterator[str]:
    """DSN of a fresh database without the flyd schema; dropped afterwards."""
    name = f"flyd_e_{uuid.uuid4().hex[:12]}"
    dsn = _create_db(pg_server_dsn, name)
    try:
        yield dsn
    finally:
        _drop_db(pg_server_dsn, name)


@pytest.fixture
async def db(db_dsn: str) -> AsyncIterator[psycopg.AsyncConnection[tuple[object, ...]]]:
    """An autocommit async connection to the test's migrated database."""
    conn = await psycopg.AsyncConnection.connect(db_dsn, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()
