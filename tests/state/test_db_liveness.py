"""Database sessions ended under a running node (a PostgreSQL blip) on a real server: the
checkpoint store's reads reconnect and repeat, and a commit that cannot get a live session
fails `Transient` (nothing sent) within the node's own bound instead of running into it."""

from __future__ import annotations

import asyncio

import psycopg
import pytest

from flyd.leases.params import LeaseParams
from flyd.leases.stores.contract import Commit, Effect, Held, Transient
from flyd.leases.stores.pg import ClosingConnection, ReadConnection
from tests.state.conftest import NODE, RunCtx, make_job

TERMINATE = """
SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity
 WHERE datname = current_database() AND pid <> pg_backend_pid()
"""

SESSIONS = """
SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
"""


async def other_sessions(admin: psycopg.AsyncConnection[tuple[object, ...]]) -> set[int]:
    cur = await admin.execute(SESSIONS)
    return {int(str(r[0])) for r in await cur.fetchall()}


async def terminate_all(admin: psycopg.AsyncConnection[tuple[object, ...]]) -> int:
    cur = await admin.execute(TERMINATE)
    row = await cur.fetchone()
    assert row is not None
    return int(str(row[0]))


async def gone(admin: psycopg.AsyncConnection[tuple[object, ...]], pids: set[int]) -> None:
    """Until none of `pids` is in pg_stat_activity any more (bounded)."""
    async with asyncio.timeout(10):
        while True:
            if not await other_sessions(admin) & pids:
                return
            await asyncio.sleep(0.02)


async def test_checkpoint_reads_outlive_a_terminated_session(claimed_run: RunCtx) -> None:
    """A grant's first head read and a recovery's lookup after a blip (issue 23, item 1)."""
    ctx = claimed_run
    assert ctx.admin is not None
    committed = await ctx.store.commit(make_job(ctx.run_id, 1, "ck-4", 4), ctx.path)
    assert await ctx.store.head(ctx.run_id) == committed     # the store's connection is open
    before = await other_sessions(ctx.admin)
    assert await terminate_all(ctx.admin) >= 2, "the store's and the lease store's sessions"
    await gone(ctx.admin, before)
    head = await ctx.store.head(ctx.run_id)
    assert head is not None and head.checkpoint_id == "ck-4"
    assert await ctx.store.lookup(ctx.run_id, "ck-4") == head
    env = await ctx.store.read(head)
    assert env.manifest["checkpointId"] == "ck-4"
    assert not await other_sessions(ctx.admin) & before, "the reads ran on a new session"


async def test_a_commit_without_a_live_session_is_transient_within_the_nodes_bound(
        claimed_run: RunCtx, pg_server_dsn: str) -> None:
    """No new session can be opened while the old ones are gone: the commit fails `Transient`
    (the node keeps its lease) before the node's bound C runs out, and commits again once the
    database accepts sessions."""
    ctx = claimed_run
    assert ctx.admin is not None
    admin = ctx.admin
    c = LeaseParams().commit_timeout_s
    cur = await admin.execute("SELECT current_database()")
    row = await cur.fetchone()
    assert row is not None
    dbname = psycopg.sql.Identifier(str(row[0]))
    before = await other_sessions(admin)
    server = await psycopg.AsyncConnection.connect(pg_server_dsn, autocommit=True)
    await server.execute(psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false")
                         .format(dbname))
    try:
        assert await terminate_all(admin) >= 2, "the pool's sessions were ended"
        await gone(admin, before)
        fin = Effect(key="boundary-1", session_epoch=1, boundary=1, payload={"k": 1},
                     digest=b"\x01")
        commit = Commit(ctx.run_id, ctx.lease_epoch, NODE, (fin,))
        with pytest.raises(Transient):
            async with asyncio.timeout(c):                   # the node's bound (§5.6)
                await ctx.lease.commit(commit)
    finally:
        await server.execute(psycopg.sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true")
                             .format(dbname))
        await server.close()
    async with asyncio.timeout(30):
        while True:
            try:
                async with asyncio.timeout(c):
                    await ctx.lease.commit(commit)
                break
            except Transient:
                await asyncio.sleep(0.1)
    cur = await admin.execute("SELECT count(*) FROM flyd.effects WHERE run_id = %s",
                              (ctx.run_id,))
    assert await cur.fetchone() == (1,)


async def test_a_renewal_outlives_a_heartbeat_session_ended_while_idle(
        claimed_run: RunCtx) -> None:
    """A blip ends the heartbeat session between renewals: the next renewal is sent again on
    a new session within its bound R and acknowledged, instead of an unknown renewal."""
    ctx = claimed_run
    assert ctx.admin is not None
    held = [Held(ctx.run_id, ctx.lease_epoch)]
    [first] = await ctx.lease.renew(NODE, held, 60.0)
    cur = await ctx.admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name = %s",
        (f"flyd:{NODE}:heartbeat",))
    pids = {int(str(r[0])) for r in await cur.fetchall()}
    assert len(pids) == 1, "the heartbeat session is open"
    cur = await ctx.admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                  "WHERE pid = ANY(%s)", (list(pids),))
    assert await cur.fetchall() == [(True,)]
    await gone(ctx.admin, pids)
    [again] = await ctx.lease.renew(NODE, held, 60.0)
    assert (again.run_id, again.lease_epoch) == (first.run_id, first.lease_epoch)


async def test_a_cancelled_read_does_not_retry_when_its_try_absorbed_the_cancel(
        db_dsn: str) -> None:
    """`flyd.cancel`: a try that turns its cancellation into a lost-session error (as a
    connection closed on cancel may) is not repeated for a task its owner cancelled; a lost
    lease's writer would otherwise go on reading past the kill bound. Vacuity: the same error
    without a cancellation is a lost session, and the read repeats it."""
    read = ReadConnection(db_dsn, within_s=30.0)
    calls = 0
    entered = asyncio.Event()

    async def absorbs_its_cancel(conn: ClosingConnection) -> int:
        nonlocal calls
        calls += 1
        entered.set()
        try:
            await asyncio.Event().wait()  # a statement the server never answers
        except asyncio.CancelledError:
            raise psycopg.OperationalError("connection closed on cancel") from None
        return 0

    async def fails_once(conn: ClosingConnection) -> int:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise psycopg.OperationalError("connection closed on cancel")
        return 7

    try:
        task = asyncio.create_task(read.read(absorbs_its_cancel, "probe"))
        async with asyncio.timeout(10):
            await entered.wait()
        task.cancel()
        async with asyncio.timeout(10):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert calls == 1
        calls = 0
        async with asyncio.timeout(10):
            assert await read.read(fails_once, "probe") == 7
        assert calls == 2
    finally:
        await read.close()
