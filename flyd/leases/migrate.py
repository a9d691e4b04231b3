"""Schema migrations for the ``flyd`` PostgreSQL schema (design/distribution.md §2.1).

The shipped files ``flyd/leases/migrations/NNNN_<name>.sql`` are applied in one transaction
under the advisory lock of design/distribution.md §2.5; each applied file is recorded in
``flyd.schema_migrations`` with its SHA-256, so re-running is a no-op and a failure leaves the
database unchanged.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, cast

import psycopg

__all__ = [
    "ADVISORY_LOCK_KEY",
    "ClockModeMismatch",
    "Migration",
    "MigrationError",
    "MigrationMismatch",
    "SchemaTooNew",
    "ServerTooOld",
    "apply",
    "apply_migrations",
    "migrate",
    "shipped_migrations",
]

ADVISORY_LOCK_KEY = 7210650201
MIN_SERVER_VERSION = 150000
_FILE_RE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


class MigrationError(Exception):
    """A migration refusal; commands exit with ``exit_code``."""

    exit_code = 2


class MigrationMismatch(MigrationError):
    """A recorded migration's checksum differs from the shipped file."""


class SchemaTooNew(MigrationError):
    """The database records a version newer than any shipped migration."""


class ServerTooOld(MigrationError):
    """The server is older than PostgreSQL 15."""


class ClockModeMismatch(MigrationError):
    """A ``flyd.sim_clock`` row exists iff the node was started with a sim clock
    (design/distribution.md §2.1)."""


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str
    sha256: str


def shipped_migrations() -> list[Migration]:
    """The package's migration files, in version order."""
    root = resources.files("flyd.leases").joinpath("migrations")
    found: list[Migration] = []
    for entry in root.iterdir():
        m = _FILE_RE.match(entry.name)
        if m is None:
            continue
        data = entry.read_bytes()
        found.append(
            Migration(
                version=int(m.group(1)),
                name=m.group(2),
                sql=data.decode("utf-8"),
                sha256=hashlib.sha256(data).hexdigest(),
            )
        )
    found.sort(key=lambda mig: mig.version)
    versions = [mig.version for mig in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"duplicate migration versions shipped: {versions}")
    return found


async def apply(
    conn: psycopg.AsyncConnection[Any],
    *,
    sim_clock: bool | None = None,
    migrations: list[Migration] | None = None,
) -> int:
    """Apply the shipped migrations idempotently; return the schema version.

    ``sim_clock``: when not None, the presence of a ``flyd.sim_clock`` row must equal it
    (else :class:`ClockModeMismatch`). ``migrations`` overrides the shipped list (tests).
    """
    shipped = shipped_migrations() if migrations is None else migrations
    async with conn.transaction():
        await conn.execute("SET LOCAL lock_timeout = '10s'")
        await conn.execute("SELECT pg_advisory_xact_lock(%(key)s)", {"key": ADVISORY_LOCK_KEY})
        cur = await conn.execute("SELECT current_setting('server_version_num')::int")
        row = await cur.fetchone()
        assert row is not None
        server_version = cast(int, row[0])
        if server_version < MIN_SERVER_VERSION:
            raise ServerTooOld(
                f"PostgreSQL 15 or newer required (server_version_num {server_version})"
            )
        await conn.execute("CREATE SCHEMA IF NOT EXISTS flyd")
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS flyd.schema_migrations (version int PRIMARY KEY, "
            "name text NOT NULL, sha256 text NOT NULL, "
            "applied_at timestamptz NOT NULL DEFAULT now())"
        )
        cur = await conn.execute("SELECT version, sha256 FROM flyd.schema_migrations")
        recorded = {cast(int, v): cast(str, s) for v, s in await cur.fetchall()}
        newest_shipped = max((mig.version for mig in shipped), default=0)
        too_new = sorted(v for v in recorded if v > newest_shipped)
        if too_new:
            raise SchemaTooNew(
                f"database schema version {too_new[-1]} is newer than this flyd "
                f"(newest shipped {newest_shipped})"
            )
        for mig in shipped:
            have = recorded.get(mig.version)
            if have is not None:
                if have != mig.sha256:
                    raise MigrationMismatch(
                        f"migration {mig.version:04d}_{mig.name}: recorded sha256 {have} "
                        f"!= shipped {mig.sha256}"
                    )
                continue
            # No parameters: psycopg sends the file as is (several statements, '%' literal).
            await conn.execute(mig.sql)
            await conn.execute(
                "INSERT INTO flyd.schema_migrations (version, name, sha256) "
                "VALUES (%(v)s, %(n)s, %(s)s)",
                {"v": mig.version, "n": mig.name, "s": mig.sha256},
            )
        cur = await conn.execute("SELECT coalesce(max(version), 0) FROM flyd.schema_migrations")
        row = await cur.fetchone()
        assert row is not None
        version = cast(int, row[0])
        if sim_clock is not None:
            cur = await conn.execute("SELECT EXISTS (SELECT 1 FROM flyd.sim_clock)")
            row = await cur.fetchone()
            assert row is not None
            if bool(row[0]) != sim_clock:
                raise ClockModeMismatch(
                    "started with a sim clock but flyd.sim_clock is empty"
                    if sim_clock
                    else "flyd.sim_clock has a row but no sim clock was given"
                )
    return version


async def apply_migrations(conn: psycopg.AsyncConnection[Any]) -> int:
    """Alias of :func:`apply` without the clock-mode check."""
    return await apply(conn)


async def migrate(dsn: str, *, sim_clock: bool | None = None) -> int:
    """Connect to ``dsn``, apply migrations, return the schema version (``flyd db migrate``)."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        return await apply(conn, sim_clock=sim_clock)
