"""The listener wakes the claimer when another node's lease expires (expiry sends no
notification), so a reclaim does not wait for the next claim poll (docs/leases.md)."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from datetime import timedelta

from flyd.leases.params import LeaseParams
from flyd.leases.stores.pg import DbSettings, PgStore
from tests.distribution.test_leases_sql import T0, Conn, new_running_run, set_clock

# a poll period far longer than the test's bound: whatever wakes the listener is the expiry
PARAMS = LeaseParams(ttl_s=600.0, claim_poll_s=60.0)


async def test_listener_yields_a_foreign_lease_at_its_expiry(db: Conn, db_dsn: str) -> None:
    await set_clock(db, T0)
    foreign = await new_running_run(db, expires=T0 + timedelta(seconds=0.5))
    async with PgStore(db_dsn, "n2", DbSettings(), PARAMS) as store:
        async with aclosing(store.listen()) as wakes:
            woke = await asyncio.wait_for(anext(wakes), timeout=30.0)
    assert woke == foreign


async def test_listener_ignores_own_and_unreclaimable_leases(db: Conn, db_dsn: str) -> None:
    """Leases of the listening node itself, of runs out of attempts and of runs asked to
    cancel are not reclaimable by a claim: no wake-up for them, only for the foreign one."""
    await set_clock(db, T0)
    soon = T0 + timedelta(seconds=0.3)
    await new_running_run(db, expires=soon)
    await db.execute("UPDATE flyd.runs SET owner_node = 'n2'")              # n2's own
    exhausted = await new_running_run(db, expires=soon)
    await db.execute("UPDATE flyd.runs SET attempt = max_attempts WHERE run_id = %s",
                     (exhausted,))
    cancelling = await new_running_run(db, expires=soon)
    await db.execute("UPDATE flyd.runs SET cancel_requested = true WHERE run_id = %s",
                     (cancelling,))
    foreign = await new_running_run(db, expires=T0 + timedelta(seconds=1.5))
    async with PgStore(db_dsn, "n2", DbSettings(), PARAMS) as store:
        async with aclosing(store.listen()) as wakes:
            woke = await asyncio.wait_for(anext(wakes), timeout=30.0)
    assert woke == foreign
