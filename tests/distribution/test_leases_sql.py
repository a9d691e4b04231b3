"""Schema-only acceptance tests of distribution.md §8 (migrations, fence triggers, ledger)."""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from flyd.leases.migrate import (
    MigrationMismatch,
    SchemaTooNew,
    apply,
    apply_migrations,
    shipped_migrations,
)

Conn = psycopg.AsyncConnection[Any]
T0 = datetime(2030, 1, 1, tzinfo=UTC)


async def catalog(conn: Conn) -> list[tuple[Any, ...]]:
    """Everything in schema flyd that a migration could create, plus the recorded versions."""
    cur = await conn.execute(
        """
        SELECT 'class', c.relname, c.relkind::text, c.oid::text FROM pg_class c
          JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'flyd'
        UNION ALL
        SELECT 'proc', p.proname, pg_get_function_identity_arguments(p.oid), p.oid::text
          FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'flyd'
        UNION ALL
        SELECT 'trigger', t.tgname, t.tgrelid::regclass::text, t.oid::text FROM pg_trigger t
          JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE n.nspname = 'flyd'
        UNION ALL
        SELECT 'type', t.typname, t.typtype::text, t.oid::text FROM pg_type t
          JOIN pg_namespace n ON n.oid = t.typnamespace WHERE n.nspname = 'flyd'
        UNION ALL
        SELECT 'constraint', co.conname, co.contype::text, co.oid::text FROM pg_constraint co
          JOIN pg_namespace n ON n.oid = co.connamespace WHERE n.nspname = 'flyd'
        UNION ALL
        SELECT 'migration', m.version::text, m.sha256, m.applied_at::text
          FROM flyd.schema_migrations m
        ORDER BY 1, 2, 3, 4
        """
    )
    return await cur.fetchall()


async def connect(dsn: str) -> Conn:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


async def new_running_run(conn: Conn, *, epoch: int = 1, expires: datetime | None = None) -> int:
    """A run held by node 'n1' at ``epoch`` (inserted directly; claim SQL is not schema)."""
    cur = await conn.execute(
        """
        INSERT INTO flyd.runs (spec, state, lease_epoch, attempt, owner_node, lease_expires_at)
        SELECT '{}'::jsonb, 'running', %(e)s, 1, 'n1', %(x)s
        RETURNING run_id
        """,
        {"e": epoch, "x": expires or (T0 + timedelta(seconds=30))},
    )
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def set_clock(conn: Conn, t: datetime) -> None:
    await conn.execute(
        "INSERT INTO flyd.sim_clock (t) VALUES (%(t)s) "
        "ON CONFLICT (only_row) DO UPDATE SET t = %(t)s",
        {"t": t},
    )


async def insert_effect(conn: Conn, run: int, epoch: int, key: str = "boundary-1") -> None:
    await conn.execute(
        """
        INSERT INTO flyd.effects (run_id, effect_key, lease_epoch, node_id, session_epoch,
                                  boundary, payload, payload_digest)
        VALUES (%(r)s, %(k)s, %(e)s, 'n1', 1, 1, '{}'::jsonb, '\\x00'::bytea)
        """,
        {"r": run, "k": key, "e": epoch},
    )


async def insert_checkpoint(conn: Conn, run: int, epoch: int, cid: str = "c1") -> None:
    await conn.execute(
        """
        INSERT INTO flyd.checkpoints (run_id, checkpoint_id, lease_epoch, node_id, session_id,
            session_epoch, episode_id, boundary, compatibility_digest, envelope_digest,
            byte_length, envelope)
        VALUES (%(r)s, %(c)s, %(e)s, 'n1', 's1', 1, 'ep1', 1, 'cd', '\\x00'::bytea, 1,
                '\\x00'::bytea)
        """,
        {"r": run, "c": cid, "e": epoch},
    )


async def sqlstate_of(coro: Any) -> str | None:
    try:
        await coro
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


# 1
async def test_migrations_apply_and_are_idempotent(empty_db_dsn: str) -> None:
    async with await connect(empty_db_dsn) as conn:
        version = await apply_migrations(conn)
        shipped = shipped_migrations()
        assert version == shipped[-1].version == 3
        cur = await conn.execute("SELECT version, name, sha256 FROM flyd.schema_migrations")
        rows = sorted(await cur.fetchall())
        assert rows == [(m.version, m.name, m.sha256) for m in shipped]
        cur = await conn.execute(
            "SELECT to_regclass('flyd.runs'), to_regclass('flyd.effects'), "
            "to_regclass('flyd.run_heads'), to_regprocedure('flyd.app_now()'), "
            "to_regprocedure('flyd.assert_fence(bigint,bigint,boolean)')"
        )
        assert all(v is not None for v in (await cur.fetchone() or [None]))
        before = await catalog(conn)
        assert await apply(conn) == version
        assert await catalog(conn) == before


# 2
async def test_concurrent_migrators_serialize(empty_db_dsn: str) -> None:
    conns = [await connect(empty_db_dsn) for _ in range(4)]
    try:
        results = await asyncio.gather(*(apply(c) for c in conns), return_exceptions=True)
        assert results == [3, 3, 3, 3]
        cur = await conns[0].execute("SELECT count(*), count(DISTINCT applied_at) "
                                     "FROM flyd.schema_migrations")
        # one migrator applied all three files in one transaction; the others no-op'd
        assert await cur.fetchone() == (3, 1)
    finally:
        for c in conns:
            await c.close()


# 3
async def test_migration_mismatch_and_newer_schema_refused(db: Conn) -> None:
    before = await catalog(db)
    shipped = shipped_migrations()
    altered = [*shipped[:-1], dataclasses.replace(shipped[-1], sha256="0" * 64)]
    with pytest.raises(MigrationMismatch):
        await apply(db, migrations=altered)
    assert await catalog(db) == before

    extra = dataclasses.replace(shipped[-1], version=9999, name="future", sql="SELECT 1")
    await db.execute(
        "INSERT INTO flyd.schema_migrations (version, name, sha256) VALUES (%s, %s, %s)",
        (extra.version, extra.name, extra.sha256),
    )
    mid = await catalog(db)
    with pytest.raises(SchemaTooNew):
        await apply(db)
    assert await catalog(db) == mid
    assert SchemaTooNew.exit_code == MigrationMismatch.exit_code == 2


# 4
async def test_app_now_follows_sim_clock(db: Conn) -> None:
    cur = await db.execute("SELECT flyd.app_now() = statement_timestamp()")
    assert await cur.fetchone() == (True,)
    await set_clock(db, T0)
    cur = await db.execute(
        "SELECT flyd.app_now(), flyd.app_now() = ALL (SELECT flyd.app_now() "
        "FROM generate_series(1, 1000))"
    )
    assert await cur.fetchone() == (T0, True)
    await set_clock(db, T0 + timedelta(seconds=5))
    cur = await db.execute("SELECT flyd.app_now()")
    assert await cur.fetchone() == (T0 + timedelta(seconds=5),)
    await db.execute("DELETE FROM flyd.sim_clock")
    cur = await db.execute("SELECT flyd.app_now() = statement_timestamp()")
    assert await cur.fetchone() == (True,)


# 10
async def test_commit_time_fence(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    run = await new_running_run(db, expires=T0 + timedelta(seconds=10))
    async with await psycopg.AsyncConnection.connect(db_dsn) as writer:
        await insert_effect(writer, run, 1)           # live: the BEFORE trigger passes
        await insert_checkpoint(writer, run, 1)
        await set_clock(db, T0 + timedelta(seconds=11))  # the lease expires meanwhile
        state = await sqlstate_of(writer.commit())
        assert state == "LF001"
    cur = await db.execute(
        "SELECT (SELECT count(*) FROM flyd.effects), (SELECT count(*) FROM flyd.checkpoints)"
    )
    assert await cur.fetchone() == (0, 0)


# 11
async def test_assert_fence_null_is_fenced(db: Conn) -> None:
    assert await sqlstate_of(db.execute("SELECT flyd.assert_fence(424242, 1)")) == "LF001"
    cur = await db.execute("INSERT INTO flyd.runs (spec) VALUES ('{}') RETURNING run_id")
    row = await cur.fetchone()
    assert row is not None
    pending = int(row[0])                            # lease_expires_at IS NULL
    assert await sqlstate_of(db.execute("SELECT flyd.assert_fence(%s, 0)", (pending,))) == "LF001"
    await set_clock(db, T0)
    live = await new_running_run(db)
    await db.execute("SELECT flyd.assert_fence(%s, 1)", (live,))
    assert await sqlstate_of(db.execute("SELECT flyd.assert_fence(%s, 2)", (live,))) == "LF001"


# 19
async def test_terminal_is_final(db: Conn) -> None:
    await set_clock(db, T0)
    run = await new_running_run(db)
    cur = await db.execute(
        "SELECT flyd.finish_run(%s, 1, 'succeeded', '{}'::jsonb)", (run,)
    )
    assert await cur.fetchone() == ("finished",)
    cur = await db.execute("SELECT flyd.finish_run(%s, 1, 'succeeded', '{}'::jsonb)", (run,))
    assert await cur.fetchone() == ("already",)
    leave = (
        "UPDATE flyd.runs SET state = 'pending', finished_at = NULL WHERE run_id = %s"
    )
    assert await sqlstate_of(db.execute(leave, (run,))) == "LF003"
    bump = "UPDATE flyd.runs SET lease_epoch = lease_epoch + 1 WHERE run_id = %s"
    assert await sqlstate_of(db.execute(bump, (run,))) == "LF003"
    async with db.transaction():
        await db.execute("SELECT set_config('flyd.intervention', 'on', true)")
        await db.execute(leave, (run,))
    cur = await db.execute("SELECT state FROM flyd.runs WHERE run_id = %s", (run,))
    assert await cur.fetchone() == ("pending",)


# 20
async def test_ledger_immutable(db: Conn) -> None:
    await set_clock(db, T0)
    run = await new_running_run(db)
    await insert_effect(db, run, 1)
    await insert_checkpoint(db, run, 1)
    upd = "UPDATE flyd.effects SET payload = '{\"x\": 1}' WHERE run_id = %s"
    assert await sqlstate_of(db.execute(upd, (run,))) == "LF004"
    assert await sqlstate_of(
        db.execute("DELETE FROM flyd.effects WHERE run_id = %s", (run,))
    ) == "LF004"
    assert await sqlstate_of(
        db.execute("UPDATE flyd.checkpoints SET node_id = 'x' WHERE run_id = %s", (run,))
    ) == "LF004"
    await db.execute("UPDATE flyd.effects SET delivered = true WHERE run_id = %s", (run,))
    cur = await db.execute("SELECT delivered, payload FROM flyd.effects WHERE run_id = %s", (run,))
    assert await cur.fetchone() == (True, {})


# 21
async def test_duplicate_effect_not_swallowed(db: Conn) -> None:
    await set_clock(db, T0)
    run = await new_running_run(db)
    await insert_effect(db, run, 1)
    with pytest.raises(psycopg.errors.UniqueViolation) as info:
        await insert_effect(db, run, 1)
    assert info.value.sqlstate == "23505"
    assert info.value.diag.constraint_name == "effects_pkey"
    cur = await db.execute("SELECT count(*) FROM flyd.effects WHERE run_id = %s", (run,))
    assert await cur.fetchone() == (1,)


# 23
async def test_epoch_zero_import_only_before_first_grant(db: Conn) -> None:
    cur = await db.execute("INSERT INTO flyd.runs (spec) VALUES ('{}') RETURNING run_id")
    row = await cur.fetchone()
    assert row is not None
    run = int(row[0])
    async with db.transaction():                     # import at submit: checkpoint + head
        await insert_checkpoint(db, run, 0, "c0")
        await db.execute(
            "UPDATE flyd.run_heads SET high_water = 'c0', boundary = 1 WHERE run_id = %s",
            (run,),
        )
    await set_clock(db, T0)
    await db.execute(                                # first grant
        "UPDATE flyd.runs SET state = 'running', lease_epoch = 1, attempt = 1, "
        "owner_node = 'n1', lease_expires_at = %s WHERE run_id = %s",
        (T0 + timedelta(seconds=30), run),
    )
    assert await sqlstate_of(insert_checkpoint(db, run, 0, "c1")) == "LF001"
    assert await sqlstate_of(
        db.execute("UPDATE flyd.run_heads SET boundary = 2 WHERE run_id = %s", (run,))
    ) == "LF001"


# 14
async def test_finish_with_last_effects(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    run = await new_running_run(db)
    async with await psycopg.AsyncConnection.connect(db_dsn) as writer:
        await insert_effect(writer, run, 1, "boundary-1")
        await insert_effect(writer, run, 1, "finish")
        cur = await writer.execute(
            "SELECT flyd.finish_run(%s, 1, 'succeeded', '{}'::jsonb)", (run,)
        )
        assert await cur.fetchone() == ("finished",)
        await writer.commit()                        # commit-time fence passes via the marker
    cur = await db.execute(
        "SELECT r.state::text, r.finished_at IS NOT NULL, a.end_reason, "
        "(SELECT count(*) FROM flyd.effects e WHERE e.run_id = r.run_id) "
        "FROM flyd.runs r LEFT JOIN flyd.run_attempts a USING (run_id) WHERE r.run_id = %s",
        (run,),
    )
    assert await cur.fetchone() == ("succeeded", True, None, 2)
    cur = await db.execute("SELECT flyd.finish_run(%s, 1, 'succeeded', '{}'::jsonb)", (run,))
    assert await cur.fetchone() == ("already",)
