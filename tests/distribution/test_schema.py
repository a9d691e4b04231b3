"""Schema-level checks of distribution.md §2 beyond the §8 list: fence triggers and codes."""

from __future__ import annotations

from datetime import timedelta

import psycopg

from tests.distribution.test_leases_sql import (
    T0,
    Conn,
    insert_checkpoint,
    insert_effect,
    new_running_run,
    set_clock,
    sqlstate_of,
)


async def test_stale_epoch_writes_refused_immediately(db: Conn) -> None:
    await set_clock(db, T0)
    run = await new_running_run(db, epoch=2)
    assert await sqlstate_of(insert_effect(db, run, 1)) == "LF001"
    assert await sqlstate_of(insert_checkpoint(db, run, 1)) == "LF001"
    assert await sqlstate_of(
        db.execute(
            "UPDATE flyd.run_heads SET lease_epoch = 1, boundary = 1 WHERE run_id = %s", (run,)
        )
    ) == "LF001"
    assert await sqlstate_of(
        db.execute("SELECT flyd.finish_run(%s, 1, 'failed', '{}'::jsonb)", (run,))
    ) == "LF001"
    await insert_effect(db, run, 2)                  # the live epoch passes


async def test_deferred_trigger_refuses_stale_head_move_at_commit(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    run = await new_running_run(db, expires=T0 + timedelta(seconds=10))
    async with await psycopg.AsyncConnection.connect(db_dsn) as writer:
        await insert_checkpoint(writer, run, 1, "c1")
        await writer.execute(
            "UPDATE flyd.run_heads SET high_water = 'c1', boundary = 1, lease_epoch = 1 "
            "WHERE run_id = %s",
            (run,),
        )
        await set_clock(db, T0 + timedelta(seconds=10))  # expiry is exclusive: now = expiry
        assert await sqlstate_of(writer.commit()) == "LF001"
    cur = await db.execute(
        "SELECT high_water, boundary FROM flyd.run_heads WHERE run_id = %s", (run,)
    )
    assert await cur.fetchone() == (None, 0)


async def test_deferred_trigger_refuses_after_release_and_cancel(db: Conn, db_dsn: str) -> None:
    """A transaction opened live; the run is released then cancelled (epoch unchanged)."""
    await set_clock(db, T0)
    run = await new_running_run(db)
    async with await psycopg.AsyncConnection.connect(db_dsn) as writer:
        await insert_effect(writer, run, 1)
        # FOR NO KEY UPDATE-compatible updates: they do not wait for the writer's KEY SHARE
        await db.execute(
            "UPDATE flyd.runs SET state = 'pending', owner_node = NULL, "
            "lease_expires_at = NULL WHERE run_id = %s",
            (run,),
        )
        await db.execute(
            "UPDATE flyd.runs SET state = 'cancelled', finished_at = flyd.app_now() "
            "WHERE run_id = %s",
            (run,),
        )
        assert await sqlstate_of(writer.commit()) == "LF001"
    cur = await db.execute("SELECT count(*) FROM flyd.effects")
    assert await cur.fetchone() == (0,)


async def test_head_regression_lf002(db: Conn) -> None:
    await set_clock(db, T0)
    run = await new_running_run(db)
    await insert_checkpoint(db, run, 1, "c5")
    await db.execute(
        "UPDATE flyd.run_heads SET high_water = 'c5', boundary = 5, lease_epoch = 1 "
        "WHERE run_id = %s",
        (run,),
    )
    assert await sqlstate_of(
        db.execute("UPDATE flyd.run_heads SET boundary = 4 WHERE run_id = %s", (run,))
    ) == "LF002"
    await db.execute("UPDATE flyd.run_heads SET boundary = 5 WHERE run_id = %s", (run,))


async def test_finish_run_rejects_non_terminal_state(db: Conn) -> None:
    await set_clock(db, T0)
    run = await new_running_run(db)
    assert await sqlstate_of(
        db.execute("SELECT flyd.finish_run(%s, 1, 'running', NULL)", (run,))
    ) == "22023"


async def test_insert_and_requeue_notify_and_create_head(db: Conn, db_dsn: str) -> None:
    async with await psycopg.AsyncConnection.connect(db_dsn, autocommit=True) as listener:
        await listener.execute("LISTEN flyd_claimable")
        cur = await db.execute("INSERT INTO flyd.runs (spec) VALUES ('{}') RETURNING run_id")
        row = await cur.fetchone()
        assert row is not None
        run = int(row[0])
        cur = await db.execute("SELECT count(*) FROM flyd.run_heads WHERE run_id = %s", (run,))
        assert await cur.fetchone() == (1,)
        await set_clock(db, T0)
        await db.execute(
            "UPDATE flyd.runs SET state = 'running', lease_epoch = 1, owner_node = 'n1', "
            "lease_expires_at = %s WHERE run_id = %s",
            (T0 + timedelta(seconds=30), run),
        )
        await db.execute(
            "UPDATE flyd.runs SET state = 'pending', owner_node = NULL, "
            "lease_expires_at = NULL WHERE run_id = %s",
            (run,),
        )
        got: list[str] = []
        async for note in listener.notifies(timeout=2.0, stop_after=2):
            got.append(note.payload)
        assert got == [str(run), str(run)]
