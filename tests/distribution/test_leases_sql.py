"""Acceptance tests of distribution.md §8, tests 1–26: migrations, fence triggers, ledger
(schema only), and the §3 statements through `PgStore`. Expiry is driven by the
`flyd.sim_clock` row, never by waiting out a TTL."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from flyd.config import DatabaseSettings, load_config
from flyd.errors import ConfigError
from flyd.leases.migrate import (
    MigrationMismatch,
    SchemaTooNew,
    apply,
    apply_migrations,
    shipped_migrations,
)
from flyd.leases.params import LeaseParams
from flyd.leases.stores.contract import (
    Checkpoint,
    Commit,
    ConflictingEffect,
    DuplicateEffect,
    Effect,
    Fenced,
    Finish,
    HeadRegression,
    Held,
    LedgerImmutable,
    NodeInfo,
    SpecMismatch,
    TerminalFinal,
    Transient,
    UnknownOutcome,
)
from flyd.leases.stores.pg import DbSettings, PgStore, classify, conninfo

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
        assert version == shipped[-1].version == 6
        cur = await conn.execute("SELECT 1 FROM information_schema.columns WHERE "
                                 "table_schema = 'flyd' AND table_name = 'nodes' "
                                 "AND column_name = 'reason'")
        assert await cur.fetchall() == [(1,)], "0006: the registry says why a node drains"
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
        newest = shipped_migrations()[-1].version
        assert results == [newest] * 4
        cur = await conns[0].execute("SELECT count(*), count(DISTINCT applied_at) "
                                     "FROM flyd.schema_migrations")
        # one migrator applied every file in one transaction; the others no-op'd
        assert await cur.fetchone() == (len(shipped_migrations()), 1)
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


# --------------------------------------------------------------------------------------------
# The §3 statements through PgStore (flyd/leases/stores/pg.py)

N1 = "n1-000000000001"
N2 = "n2-000000000002"
TTL = 30.0


@asynccontextmanager
async def pg_store(dsn: str, node: str = N1, *, settings: DbSettings | None = None,
                   params: LeaseParams | None = None,
                   capacity: int = 1) -> AsyncIterator[PgStore]:
    async with PgStore(dsn, node, settings or DbSettings(), params or LeaseParams(),
                       capacity) as store:
        yield store


def ckpt(cid: str, boundary: int) -> Checkpoint:
    return Checkpoint(checkpoint_id=cid, session_id="s1", session_epoch=1, episode_id="ep1",
                      boundary=boundary, compatibility_digest="cd",
                      envelope_digest=bytes(32), envelope=b"FLYSESS1" + cid.encode())


def effect(k: int, digest: bytes = b"\x01") -> Effect:
    return Effect(key=f"boundary-{k}", session_epoch=1, boundary=k, payload={"k": k},
                  digest=digest)


async def submit_n(store: PgStore, n: int, spec: dict[str, Any] | None = None,
                   max_attempts: int = 3) -> list[int]:
    return [(await store.submit(None, spec or {}, max_attempts)).run_id for _ in range(n)]


async def one(conn: Conn, query: str, *args: Any) -> tuple[Any, ...]:
    cur = await conn.execute(query, args or None)
    row = await cur.fetchone()
    assert row is not None
    return tuple(row)


async def wait_listening(db: Conn, node: str) -> None:
    """Until the node's `:listen` session has run its LISTEN (bounded)."""
    async with asyncio.timeout(5):
        while True:
            cur = await db.execute(
                "SELECT 1 FROM pg_stat_activity WHERE application_name = %s AND state = 'idle'",
                (f"flyd:{node}:listen",))
            if await cur.fetchone() is not None:
                return
            await asyncio.sleep(0.02)


async def collect(it: AsyncGenerator[int], n: int, out: list[int]) -> None:
    async with asyncio.timeout(5), aclosing(it):
        async for run_id in it:
            out.append(run_id)
            if len(out) == n:
                return


# 5
async def test_claim_race_grants_each_run_once(db: Conn, db_dsn: str) -> None:
    await db.execute("INSERT INTO flyd.runs (spec) SELECT '{}'::jsonb FROM generate_series(1, 400)")
    grants: list[tuple[str, int, int]] = []

    async def client(node: str, store: PgStore) -> None:
        while got := await store.claim(node, 4, 600.0):
            grants.extend((node, g.run_id, g.lease_epoch) for g in got)

    async with AsyncExitStack() as stack:                    # all 8 connected, then race
        nodes = [f"c{i}-{i:012x}" for i in range(8)]
        stores = [await stack.enter_async_context(pg_store(db_dsn, node)) for node in nodes]
        async with asyncio.TaskGroup() as tg:
            for node, store in zip(nodes, stores, strict=True):
                tg.create_task(client(node, store))
    assert len(grants) == 400
    assert len({run for _, run, _ in grants}) == 400
    assert {epoch for _, _, epoch in grants} == {1}
    assert len({node for node, _, _ in grants}) > 1
    assert await one(db, "SELECT count(*), count(DISTINCT run_id), max(lease_epoch) "
                         "FROM flyd.run_attempts") == (400, 400, 1)
    assert await one(db, "SELECT count(*) FROM flyd.runs WHERE state <> 'running'") == (0,)


# 6
async def test_claim_filters(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        first = await submit_n(store, 3)
        later = (await store.submit(None, {}, 3)).run_id
        await db.execute("UPDATE flyd.runs SET not_before = %s WHERE run_id = %s",
                         (T0 + timedelta(seconds=60), later))
        exclusive = (await store.submit("mine", {"exclusiveToSubmitter": True}, 3)).run_id
        cancelled = (await store.submit(None, {}, 3)).run_id

        got = await store.claim(N1, 2, TTL)                      # LIMIT
        assert [g.run_id for g in got] == first[:2]
        got = await store.claim(N1, 10, TTL)                     # not_before, exclusive
        assert [g.run_id for g in got] == [first[2], cancelled]
        await store.cancel(cancelled, "ops")                     # running + cancel_requested
        await set_clock(db, T0 + timedelta(seconds=TTL + 1))    # every lease expired
        got = await store.claim(N2, 10, TTL)
        assert sorted(g.run_id for g in got) == first           # expired reclaimed, not the
        assert all(g.lease_epoch == 2 for g in got)              # cancel-requested one
        await set_clock(db, T0 + timedelta(seconds=60))          # not_before passed
        assert await store.claim(N2, 10, TTL, only=cancelled) == []
        got = await store.claim(N2, 10, TTL, only=exclusive)     # naming a run takes only it
        assert [(g.run_id, g.spec) for g in got] == [(exclusive, {"exclusiveToSubmitter": True})]
        got = await store.claim(N2, 10, TTL)
        assert [g.run_id for g in got] == [later]
        assert await store.claim(N2, 10, TTL) == []


# 7
async def test_reclaim_bumps_epoch_and_closes_attempt(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        [run] = await submit_n(store, 1)
        [g1] = await store.claim(N1, 1, TTL)
        assert (g1.run_id, g1.lease_epoch, g1.attempt, g1.high_water) == (run, 1, 1, None)
        assert g1.lease_expires_at == T0 + timedelta(seconds=TTL)
        await store.commit(Commit(run, 1, N1, (effect(1),), ckpt("c1", 1)))
        assert await store.claim(N2, 1, TTL) == []              # live: not reclaimable
        await set_clock(db, T0 + timedelta(seconds=TTL + 5))
        [g2] = await store.claim(N2, 1, TTL)
        assert (g2.run_id, g2.lease_epoch, g2.attempt) == (run, 2, 2)
        assert (g2.high_water, g2.boundary) == ("c1", 1)
        assert g2.lease_expires_at == T0 + timedelta(seconds=2 * TTL + 5)
    cur = await db.execute("SELECT lease_epoch, node_id, granted_at, ended_at, end_reason "
                           "FROM flyd.run_attempts WHERE run_id = %s ORDER BY 1", (run,))
    assert await cur.fetchall() == [
        (1, N1, T0, T0 + timedelta(seconds=TTL), "expired"),
        (2, N2, T0 + timedelta(seconds=TTL + 5), None, None),
    ]


# 8
async def test_renew_returns_exactly_live_holds(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        await store.register_node(NodeInfo(N1, "n1", "host", 1, "0.1.0", 4))
        live, stale, foreign, expired = await submit_n(store, 4)
        await store.claim(N1, 2, TTL)                           # live, stale
        await store.claim(N2, 1, TTL)                           # foreign
        await store.claim(N1, 1, 5.0)                           # expired (short lease)
        await set_clock(db, T0 + timedelta(seconds=6))
        holds = [Held(live, 1), Held(stale, 7), Held(foreign, 1), Held(expired, 1)]
        got = await store.renew(N1, holds, TTL)
        assert [(r.run_id, r.lease_epoch, r.cancel_requested) for r in got] == [(live, 1, False)]
        assert got[0].lease_expires_at == T0 + timedelta(seconds=6 + TTL)
        assert await one(db, "SELECT heartbeat_at, held FROM flyd.nodes WHERE node_id = %s",
                         N1) == (T0 + timedelta(seconds=6), 4)
        exp = await one(db, "SELECT lease_expires_at FROM flyd.runs WHERE run_id = %s", expired)
        assert exp == (T0 + timedelta(seconds=5),)              # M6: never renewed
        assert await store.renew(N1, [], TTL) == []
        assert await one(db, "SELECT held FROM flyd.nodes WHERE node_id = %s", N1) == (0,)


# 9
async def test_stale_writes_fenced_lf001(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as old, pg_store(db_dsn, N2) as new:
        [run] = await submit_n(old, 1)
        await old.claim(N1, 1, TTL)
        await old.commit(Commit(run, 1, N1, (effect(1),), ckpt("c1", 1)))
        await set_clock(db, T0 + timedelta(seconds=TTL + 1))
        [g] = await new.claim(N2, 1, TTL)
        assert g.lease_epoch == 2
        before = await catalog_rows(db, run)
        for stale in (
            Commit(run, 1, N1, (effect(2),)),                              # effect
            Commit(run, 1, N1, (), ckpt("c2", 2)),                         # checkpoint + head
            Commit(run, 1, N1, (), finish=Finish("succeeded", {})),        # finish
        ):
            with pytest.raises(Fenced) as info:
                await old.commit(stale)
            assert info.value.code == "LF001" and info.value.mutation == "none"
        # each write alone, past assert_fence: the row triggers fence it
        assert await sqlstate_of(insert_effect(db, run, 1, "boundary-2")) == "LF001"
        assert await sqlstate_of(insert_checkpoint(db, run, 1, "c2")) == "LF001"
        assert await sqlstate_of(db.execute(
            "UPDATE flyd.run_heads SET boundary = 2, lease_epoch = 1 WHERE run_id = %s",
            (run,))) == "LF001"
        assert await sqlstate_of(db.execute(
            "SELECT flyd.finish_run(%s, 1, 'succeeded', '{}'::jsonb)", (run,))) == "LF001"
        assert await catalog_rows(db, run) == before
        # fault marks: the old epoch gets no row and changes nothing; the live one is idempotent
        assert await old.mark_faults_fired(run, 1, N1, ["crash@3"]) is None
        assert await one(db, "SELECT faults_fired FROM flyd.runs WHERE run_id = %s", run) == ([],)
        assert await new.mark_faults_fired(run, 2, N2, ["crash@3", "drop@1"]) == (
            "crash@3", "drop@1")
        assert await new.mark_faults_fired(run, 2, N2, ["drop@1"]) == ("crash@3", "drop@1")
        assert await new.release(run, 2, N2, refund=True, backoff_s=0) is not None
        [g3] = await new.claim(N2, 1, TTL)
        assert (g3.lease_epoch, g3.faults_fired) == (3, ("crash@3", "drop@1"))


async def catalog_rows(conn: Conn, run: int) -> tuple[Any, ...]:
    return await one(conn, """
        SELECT (SELECT array_agg(effect_key ORDER BY effect_key) FROM flyd.effects
                 WHERE run_id = %s),
               (SELECT array_agg(checkpoint_id ORDER BY checkpoint_id) FROM flyd.checkpoints
                 WHERE run_id = %s),
               (SELECT row(high_water, boundary, lease_epoch)::text FROM flyd.run_heads
                 WHERE run_id = %s),
               (SELECT row(state, lease_epoch, outcome)::text FROM flyd.runs WHERE run_id = %s)
        """, run, run, run, run)


# 12
async def test_renew_not_blocked_by_open_group_commit(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        [run] = await submit_n(store, 1)
        await store.claim(N1, 1, TTL)
        assert len(await store.renew(N1, [Held(run, 1)], TTL)) == 1     # session connected
        async with await psycopg.AsyncConnection.connect(db_dsn) as writer:
            await insert_effect(writer, run, 1)                          # open, holds KEY SHARE
            await insert_checkpoint(writer, run, 1)
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            got = await store.renew(N1, [Held(run, 1)], TTL)
            elapsed = loop.time() - t0
            assert [(r.run_id, r.lease_epoch) for r in got] == [(run, 1)]
            assert elapsed < 0.1
            await writer.commit()
    assert await one(db, "SELECT count(*) FROM flyd.effects") == (1,)


# 13
async def test_claim_and_reap_skip_fenced_row(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        [reclaimable] = await submit_n(store, 1)
        [exhausted] = await submit_n(store, 1, max_attempts=1)
        await store.claim(N1, 2, TTL)
        async with await psycopg.AsyncConnection.connect(db_dsn) as writer:
            await insert_effect(writer, reclaimable, 1)
            await insert_effect(writer, exhausted, 1)
            await set_clock(db, T0 + timedelta(seconds=TTL + 1))       # both expired
            assert await store.claim(N2, 10, TTL) == []
            assert await store.reap(10) == []
            async with db.transaction():
                await db.execute("SET LOCAL lock_timeout = '100ms'")
                assert await sqlstate_of(db.execute(
                    "UPDATE flyd.runs SET lease_epoch = lease_epoch + 1 WHERE run_id = %s",
                    (reclaimable,))) == "55P03"
                raise_rollback()
            await writer.rollback()
        assert [g.run_id for g in await store.claim(N2, 10, TTL)] == [reclaimable]
        assert [(r.run_id, r.state) for r in await store.reap(10)] == [(exhausted, "failed")]


def raise_rollback() -> None:
    raise psycopg.Rollback()


# 15
async def test_stale_commit_after_release_and_cancel_fenced(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        [run] = await submit_n(store, 1)
        await store.claim(N1, 1, TTL)
        async with await psycopg.AsyncConnection.connect(db_dsn) as writer:
            await insert_effect(writer, run, 1)                      # opened while live
            await insert_checkpoint(writer, run, 1)
            assert await store.release(run, 1, N1, refund=True, backoff_s=0) is not None
            cancelled = await store.cancel(run, "ops")
            assert cancelled is not None and cancelled.state == "cancelled"
            assert await one(db, "SELECT state, lease_epoch FROM flyd.runs "
                                 "WHERE run_id = %s", run) == ("cancelled", 1)
            assert await sqlstate_of(writer.commit()) == "LF001"
    assert await one(db, "SELECT (SELECT count(*) FROM flyd.effects), "
                         "(SELECT count(*) FROM flyd.checkpoints)") == (0, 0)


# 16
async def test_release_refunds_relinquish_charges(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store, asyncio.TaskGroup() as tg:
        [run] = await submit_n(store, 1)
        heard: list[int] = []
        tg.create_task(collect(store.listen(), 2, heard))
        await wait_listening(db, N1)
        await store.claim(N1, 1, TTL)
        released = await store.release(run, 1, N1, refund=True, backoff_s=10)
        assert released is not None and (released.run_id, released.lease_epoch) == (run, 1)
        assert await one(db, "SELECT state, attempt, not_before, owner_node, lease_expires_at "
                             "FROM flyd.runs WHERE run_id = %s", run) == (
            "pending", 0, T0 + timedelta(seconds=10), None, None)
        assert await store.release(run, 1, N1, refund=True, backoff_s=0) is None   # no-op
        assert await store.claim(N1, 1, TTL) == []                   # not_before honoured
        await set_clock(db, T0 + timedelta(seconds=10))
        [g] = await store.claim(N1, 1, TTL)
        assert (g.lease_epoch, g.attempt) == (2, 1)
        assert await store.release(run, 2, N1, refund=False, backoff_s=0) is not None
        assert await one(db, "SELECT state, attempt FROM flyd.runs WHERE run_id = %s",
                         run) == ("pending", 1)
    cur = await db.execute("SELECT lease_epoch, end_reason, ended_at FROM flyd.run_attempts "
                           "WHERE run_id = %s ORDER BY 1", (run,))
    assert await cur.fetchall() == [(1, "released", T0),
                                    (2, "released", T0 + timedelta(seconds=10))]
    assert heard == [run, run]                                       # both returns to pending


# 17
async def test_reap_exhausted_and_cancel_requested(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        [exhausted] = await submit_n(store, 1, max_attempts=1)
        [cancelled, healthy] = await submit_n(store, 2)
        await store.claim(N1, 3, TTL)
        await store.cancel(cancelled, "ops")
        assert await store.reap(10) == []                            # nothing expired yet
        await set_clock(db, T0 + timedelta(seconds=TTL + 1))
        got = await store.reap(10)
        assert [(r.run_id, r.lease_epoch, r.state) for r in got] == [
            (exhausted, 2, "failed"), (cancelled, 2, "cancelled")]
        assert await store.reap(10) == []                            # idempotent
    cur = await db.execute(
        "SELECT r.run_id, r.state, r.lease_epoch, r.attempt, r.outcome, r.finished_at, "
        "a.end_reason, a.ended_at FROM flyd.runs r JOIN flyd.run_attempts a USING (run_id) "
        "ORDER BY 1")
    assert await cur.fetchall() == [
        (exhausted, "failed", 2, 1, {"reaped": "attempts exhausted"},
         T0 + timedelta(seconds=TTL + 1), "exhausted", T0 + timedelta(seconds=TTL)),
        (cancelled, "cancelled", 2, 1, {"reaped": "cancel requested, holder gone"},
         T0 + timedelta(seconds=TTL + 1), "cancelled", T0 + timedelta(seconds=TTL)),
        (healthy, "running", 1, 1, None, None, None, None),
    ]


# 18
async def test_cancel_pending_and_running(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        [running] = await submit_n(store, 1)
        await store.claim(N1, 1, TTL)
        [pending] = await submit_n(store, 1)
        got = await store.cancel(pending, "alice")
        assert got is not None and (got.run_id, got.state) == (pending, "cancelled")
        assert await one(db, "SELECT state, outcome, finished_at, cancel_requested "
                             "FROM flyd.runs WHERE run_id = %s", pending) == (
            "cancelled", {"cancelledBy": "alice"}, T0, True)
        got = await store.cancel(running, "alice")
        assert got is not None and (got.run_id, got.state) == (running, "running")
        [r] = await store.renew(N1, [Held(running, 1)], TTL)
        assert (r.run_id, r.cancel_requested) == (running, True)
        assert await store.cancel(pending, "alice") is None          # terminal: nothing
        assert await store.cancel(424242, "alice") is None
        done = await store.commit(Commit(running, 1, N1, (), finish=Finish("cancelled", {})))
        assert done.finished == "finished"


# 22
async def test_head_monotonic_and_protected(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        [run] = await submit_n(store, 1)
        await store.claim(N1, 1, TTL)
        for k in range(1, 6):
            await store.commit(Commit(run, 1, N1, (effect(k),), ckpt(f"c{k}", k)))
        cur = await db.execute("SELECT checkpoint_id FROM flyd.checkpoints ORDER BY 1")
        assert await cur.fetchall() == [("c3",), ("c4",), ("c5",)]
        with pytest.raises(HeadRegression) as info:
            await store.commit(Commit(run, 1, N1, (), ckpt("c-low", 2)))
        assert info.value.code == "LF002"
        assert await one(db, "SELECT high_water, boundary FROM flyd.run_heads "
                             "WHERE run_id = %s", run) == ("c5", 5)
        assert await sqlstate_of(db.execute(
            "DELETE FROM flyd.checkpoints WHERE checkpoint_id = 'c5'")) == "23503"
        cur = await db.execute("SELECT checkpoint_id FROM flyd.checkpoints ORDER BY 1")
        assert await cur.fetchall() == [("c3",), ("c4",), ("c5",)]
        await store.commit(Commit(run, 1, N1, (effect(6),), ckpt("c6", 6), keep=2))
        cur = await db.execute("SELECT checkpoint_id FROM flyd.checkpoints ORDER BY 1")
        assert await cur.fetchall() == [("c5",), ("c6",)]


GATE = """
CREATE TABLE public.gate (id int PRIMARY KEY);
INSERT INTO public.gate VALUES (1);
CREATE FUNCTION public.gate_wait() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM set_config('lock_timeout', '0', true);
  PERFORM 1 FROM public.gate WHERE id = 1 FOR UPDATE;
  RETURN NEW;
END $$;
CREATE CONSTRAINT TRIGGER checkpoints_gate AFTER INSERT ON flyd.checkpoints
  DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.gate_wait();
"""


# 24
async def test_unknown_commit_resolution(db: Conn, db_dsn: str) -> None:
    """A COMMIT held at a test-only deferred gate: the client gives up after C, with the
    backend; the backend is ended, the read shows nothing committed, the identical retry
    commits."""
    await set_clock(db, T0)
    await db.execute(GATE)
    slow = DbSettings(statement_timeout_ms=60_000, lock_timeout_ms=60_000,
                      idle_in_transaction_timeout_ms=60_000,
                      client_connection_check_interval_ms=0)
    params = dataclasses.replace(LeaseParams(), commit_timeout_s=0.5)
    async with pg_store(db_dsn, settings=slow, params=params) as store:
        [run] = await submit_n(store, 1)
        await store.claim(N1, 1, TTL)
        commit = Commit(run, 1, N1, (effect(1),), ckpt("c1", 1))
        async with await psycopg.AsyncConnection.connect(db_dsn) as gate:
            await gate.execute("SELECT 1 FROM public.gate FOR UPDATE")   # COMMIT will wait
            with pytest.raises(UnknownOutcome) as info:
                await store.commit(commit)
            backend = info.value.backend
            assert backend is not None and info.value.mutation == "unknown"
            activity = ("SELECT count(*) FROM pg_stat_activity WHERE pid = %s "
                        "AND backend_start = %s")
            assert await one(db, activity + " AND wait_event_type = 'Lock'",
                             backend.pid, backend.backend_start) == (1,)
            await store.end_backend(backend)
            assert await one(db, activity, backend.pid, backend.backend_start) == (0,)
            await gate.rollback()
        read = await store.read_run(run, 1, "c1")
        assert read is not None
        assert (read.state, read.lease_epoch, read.owner_node, read.live) == (
            "running", 1, N1, True)
        assert (read.checkpoint_committed, read.high_water, read.boundary) == (False, None, 0)
        assert await one(db, "SELECT count(*) FROM flyd.effects") == (0,)
        done = await store.commit(commit)                             # identical retry
        assert done.backend is not None and done.backend != backend
        read = await store.read_run(run, 1, "c1")
        assert read is not None
        assert (read.checkpoint_committed, read.high_water, read.boundary) == (True, "c1", 1)
        assert await store.read_run(424242, 1, None) is None


# 25
async def test_idle_transaction_unblocks_reclaim(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        [run] = await submit_n(store, 1)
        await store.claim(N1, 1, TTL)
        async with await psycopg.AsyncConnection.connect(
                db_dsn, options="-c idle_in_transaction_session_timeout=300") as writer:
            await insert_effect(writer, run, 1)                       # then goes silent
            await set_clock(db, T0 + timedelta(seconds=TTL + 1))
            assert await store.claim(N2, 1, TTL) == []                # row lock still held
            async with asyncio.timeout(10):                           # the server's timeout,
                while True:                                           # not a lease TTL
                    if got := await store.claim(N2, 1, TTL):
                        break
                    await asyncio.sleep(0.05)
            assert [(g.run_id, g.lease_epoch) for g in got] == [(run, 2)]
            assert await sqlstate_of(writer.execute("SELECT 1")) == "25P03"
    assert await one(db, "SELECT count(*) FROM flyd.effects") == (0,)


# 26
async def test_submit_idempotent(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store, asyncio.TaskGroup() as tg:
        heard: list[int] = []
        tg.create_task(collect(store.listen(), 3, heard))
        await wait_listening(db, N1)
        spec = {"composition": "x", "steps": 3}
        first = await store.submit("k1", spec, 3)
        assert first.created and first.same_spec
        again = await store.submit("k1", dict(spec), 3)
        assert (again.run_id, again.created, again.same_spec) == (first.run_id, False, True)
        with pytest.raises(SpecMismatch):
            await store.submit("k1", {**spec, "steps": 4}, 3)
        other = await store.submit(None, spec, 3)
        assert other.created and other.run_id != first.run_id
        assert await one(db, "SELECT count(*) FROM flyd.runs") == (2,)
        assert await one(db, "SELECT spec, max_attempts FROM flyd.runs WHERE run_id = %s",
                         first.run_id) == (spec, 3)
        await store.claim(N1, 1, TTL)
        await store.release(first.run_id, 1, N1, refund=True, backoff_s=0)
    assert heard == [first.run_id, other.run_id, first.run_id]

    # racing submitters of one key: one creates, every other gets the same run
    async with pg_store(db_dsn, capacity=5) as store:
        results = await asyncio.gather(*(store.submit("race", spec, 3) for _ in range(8)))
    assert len({r.run_id for r in results}) == 1
    assert sum(r.created for r in results) == 1


# conninfo (§4.2, §5.3)
def test_conninfo_carries_settings_scaled() -> None:
    dsn = "postgresql://postgres:@/flyd?host=/tmp/pgsock"
    plain = conninfo_to_dict(conninfo(dsn, N1, "work", DbSettings()))
    assert plain["host"] == "/tmp/pgsock" and plain["dbname"] == "flyd"
    assert plain["application_name"] == f"flyd:{N1}:work"
    assert plain["target_session_attrs"] == "read-write"
    assert (plain["keepalives"], plain["keepalives_idle"], plain["keepalives_interval"],
            plain["keepalives_count"], plain["tcp_user_timeout"], plain["connect_timeout"]) == (
        "1", "5", "1", "3", "4000", "2")
    assert plain["options"] == (
        "-c statement_timeout=2000 -c idle_in_transaction_session_timeout=1500 "
        "-c lock_timeout=1000 -c tcp_keepalives_idle=5 -c tcp_keepalives_interval=1 "
        "-c tcp_keepalives_count=3 -c tcp_user_timeout=4000 "
        "-c client_connection_check_interval=1000")

    scaled = DbSettings(time_scale=40.0, keepalives_idle_s=60, server_keepalives_idle_s=60)
    hb = conninfo_to_dict(conninfo("host=db.example port=6432 dbname=flyd options='-c x.y=1'",
                                   N1, "heartbeat", scaled, statement_timeout_ms=2000))
    assert hb["host"] == "db.example" and hb["port"] == "6432"
    assert hb["application_name"] == f"flyd:{N1}:heartbeat"
    assert "connect_timeout" not in hb                          # omitted under time_scale
    assert (hb["keepalives_idle"], hb["keepalives_interval"], hb["keepalives_count"],
            hb["tcp_user_timeout"]) == ("2", "1", "3", "100")  # ceil(60/40) s; 4000/40 ms
    assert hb["options"] == (
        "-c x.y=1 -c statement_timeout=50 -c idle_in_transaction_session_timeout=50 "
        "-c lock_timeout=50 -c tcp_keepalives_idle=2 -c tcp_keepalives_interval=1 "
        "-c tcp_keepalives_count=3 -c tcp_user_timeout=100 "
        "-c client_connection_check_interval=50")              # floor 50 ms
    listen = conninfo_to_dict(conninfo(dsn, N1, "listen", DbSettings(connect_timeout_s=0)))
    assert listen["application_name"] == f"flyd:{N1}:listen"
    assert "connect_timeout" not in listen
    with pytest.raises(ValueError):
        conninfo(dsn, N1, "other", DbSettings())  # type: ignore[arg-type]


async def test_conninfo_settings_reach_the_server(db_dsn: str) -> None:
    info = conninfo(db_dsn, N1, "work", DbSettings(time_scale=20.0))
    async with await psycopg.AsyncConnection.connect(info, autocommit=True) as conn:
        row = await one(conn, "SELECT current_setting('statement_timeout'), "
                              "current_setting('idle_in_transaction_session_timeout'), "
                              "current_setting('lock_timeout'), "
                              "current_setting('client_connection_check_interval'), "
                              "current_setting('application_name')")
    assert row == ("100ms", "75ms", "50ms", "50ms", f"flyd:{N1}:work")


def test_db_settings_from_the_configuration(tmp_path: Path) -> None:
    """`[database]` becomes `DbSettings` in the configuration; a bad key is refused naming
    itself and the file."""
    toml = tmp_path / "flyd.toml"

    def database(text: str) -> DatabaseSettings:
        toml.write_text(f"[database]\n{text}\n")
        return load_config(toml, env={}).settings.database

    assert database("").connection == DbSettings()
    got = database('dsn = "postgresql:///flyd"\nlock_timeout_ms = 700\nconnect_timeout_s = 0')
    assert got.dsn == "postgresql:///flyd"
    assert (got.connection.lock_timeout_ms, got.connection.connect_timeout_s) == (700, 0)
    bad = [("lock_timeout = 1", "[database] lock_timeout"),
           ("time_scale = 2.0", "[database] time_scale"),
           ('statement_timeout_ms = "2s"', "[database] statement_timeout_ms"),
           ("keepalives = true", "[database] keepalives"),
           ("keepalives = 2", "[database] keepalives"),
           ("connect_timeout_s = 1", "[database] connect_timeout_s"),
           ("statement_timeout_ms = 0", "[database] statement_timeout_ms"),
           ("dsn = 5", "[database] dsn")]
    for text, name in bad:
        with pytest.raises(ConfigError) as info:
            database(text)
        assert name in str(info.value) and str(toml) in str(info.value)


# error mapping (§2.5, §5.6, §6.4)
async def test_pgstore_maps_errors_to_typed(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        [run] = await submit_n(store, 1)
        await store.claim(N1, 1, TTL)
        await store.commit(Commit(run, 1, N1, (effect(1, b"\xaa"),), ckpt("c1", 1)))
        with pytest.raises(DuplicateEffect) as dup:                  # 23505, same digest
            await store.commit(Commit(run, 1, N1, (effect(2), effect(1, b"\xaa"))))
        assert (dup.value.key, dup.value.existing_epoch, dup.value.digest) == (
            "boundary-1", 1, b"\xaa")
        assert dup.value.outcome() == {"error": "effect_duplicate", "key": "boundary-1",
                                       "existingEpoch": 1, "digest": "aa"}
        with pytest.raises(ConflictingEffect) as conflict:           # 23505, other digest
            await store.commit(Commit(run, 1, N1, (effect(1, b"\xbb"),)))
        assert (conflict.value.key, conflict.value.digest) == ("boundary-1", b"\xaa")
        assert conflict.value.outcome()["error"] == "effect_conflict"
        assert await one(db, "SELECT count(*) FROM flyd.effects") == (1,)   # nothing added
        with pytest.raises(HeadRegression):                          # LF002
            await store.commit(Commit(run, 1, N1, (), ckpt("c0", 0)))
        await set_clock(db, T0 + timedelta(seconds=TTL))
        with pytest.raises(Fenced):                                  # LF001 (expired)
            await store.commit(Commit(run, 1, N1, (effect(2),)))
        assert await store.own_grants(N1) == [Held(run, 1)]          # pool still healthy

    # LF003 and LF004 are never raised by §3's statements; the classifier maps them
    await set_clock(db, T0)
    run2 = await new_running_run(db)
    await db.execute("SELECT flyd.finish_run(%s, 1, 'succeeded', '{}'::jsonb)", (run2,))
    errors: dict[str, psycopg.Error] = {}
    for query in ("UPDATE flyd.runs SET state = 'failed' WHERE run_id = %s",
                  "DELETE FROM flyd.effects WHERE run_id = %s"):
        try:
            await db.execute(query, (run,) if "effects" in query else (run2,))
        except psycopg.Error as exc:
            errors[str(exc.sqlstate)] = exc
    assert isinstance(classify(errors["LF003"], sent=True, backend=None, what="t"),
                      TerminalFinal)
    assert isinstance(classify(errors["LF004"], sent=True, backend=None, what="t"),
                      LedgerImmutable)
    lost = psycopg.OperationalError("server closed the connection unexpectedly")
    assert isinstance(classify(lost, sent=False, backend=None, what="t"), Transient)
    unknown = classify(lost, sent=True, backend=None, what="t")
    assert isinstance(unknown, UnknownOutcome) and unknown.mutation == "unknown"
    assert isinstance(classify(TimeoutError(), sent=False, backend=None, what="t"), Transient)


# §3.1 registry, operator requeue
async def test_node_registry_and_requeue(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    async with pg_store(db_dsn) as store:
        node = NodeInfo(N1, "n1", "host-a", 4242, "0.1.0", 2)
        await store.register_node(node)
        await store.renew(N1, [Held(1, 1), Held(2, 1)], TTL)
        await store.set_node_state(N1, "draining")
        assert await one(db, "SELECT state, held FROM flyd.nodes") == ("draining", 2)
        await set_clock(db, T0 + timedelta(seconds=5))
        await store.register_node(node)                              # re-register: active
        assert await one(db, "SELECT state, heartbeat_at, capacity FROM flyd.nodes") == (
            "active", T0 + timedelta(seconds=5), 2)
        await store.set_node_state(N1, "stopped")
        assert await one(db, "SELECT state, held FROM flyd.nodes") == ("stopped", 0)
        await set_clock(db, T0 + timedelta(days=1, seconds=4))
        assert await store.prune_nodes() == 0
        await set_clock(db, T0 + timedelta(days=1, seconds=6))
        assert await store.prune_nodes() == 1

        [run] = await submit_n(store, 1, max_attempts=1)
        await store.claim(N1, 1, TTL)
        assert await store.requeue(run, "ops") is False               # only failed runs
        await store.commit(Commit(run, 1, N1, (), finish=Finish("failed", {"error": "x"})))
        assert await store.requeue(run, "ops") is True
        assert await one(db, "SELECT state, attempt, outcome, finished_at, lease_epoch "
                             "FROM flyd.runs WHERE run_id = %s", run) == (
            "pending", 0, None, None, 1)
        assert await one(db, "SELECT actor, kind, run_id, detail FROM flyd.interventions") == (
            "ops", "requeue", run, {"fromState": "failed", "leaseEpoch": 1})
        [g] = await store.claim(N2, 1, TTL)
        assert (g.run_id, g.lease_epoch, g.attempt) == (run, 2, 1)
        assert await store.requeue(run, "ops") is False


# §5.3: a cancelled call's connection is closed, never pooled, and no server cancel is awaited
async def test_cancelled_call_discards_connection(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    await db.execute(GATE)
    slow = DbSettings(statement_timeout_ms=60_000, lock_timeout_ms=60_000,
                      client_connection_check_interval_ms=0)
    async with pg_store(db_dsn, settings=slow) as store:
        [run] = await submit_n(store, 1)
        await store.claim(N1, 1, TTL)
        async with await psycopg.AsyncConnection.connect(db_dsn) as gate:
            await gate.execute("SELECT 1 FROM public.gate FOR UPDATE")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await store.commit(Commit(run, 1, N1, (effect(1),), ckpt("c1", 1)))
            assert loop.time() - t0 < 2.0
            # the abandoned session still waits at the gate: nothing cancelled it, nothing
            # reused it; later calls run on other sessions
            waiting = ("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                       "AND wait_event_type = 'Lock'")
            assert await one(db, waiting, f"flyd:{N1}:work") == (1,)
            assert await store.own_grants(N1) == [Held(run, 1)]
            await db.execute("SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
                             "WHERE application_name = %s AND wait_event_type = 'Lock'",
                             (f"flyd:{N1}:work",))
            await gate.rollback()
        assert await store.read_run(run, 1, "c1") is not None
    assert await one(db, "SELECT count(*) FROM flyd.checkpoints") == (0,)
