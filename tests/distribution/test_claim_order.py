"""The claim statement `PgStore` sends against §3.3's text: the same grants from the same table
and locks, without visiting held runs (docs/leases.md, "Claim order")."""

from __future__ import annotations

import random
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from flyd.leases.stores.pg import CLAIM
from tests.distribution.test_leases_sql import T0, Conn, set_clock

# distribution.md §3.3, verbatim: the reference the rewritten statement must agree with.
SPEC_CLAIM = """
WITH picked AS MATERIALIZED (
  SELECT run_id, state AS prev_state, lease_expires_at AS prev_expiry
    FROM flyd.runs
   WHERE ((state = 'pending' AND not_before <= flyd.app_now())
       OR (state = 'running' AND lease_expires_at <= flyd.app_now()
           AND attempt < max_attempts AND NOT cancel_requested))
     AND CASE WHEN %(only)s::bigint IS NULL
              THEN NOT coalesce((spec ->> 'exclusiveToSubmitter')::boolean, false)
              ELSE run_id = %(only)s::bigint END
   ORDER BY run_id LIMIT %(n)s
   FOR UPDATE SKIP LOCKED
), granted AS (
  UPDATE flyd.runs r
     SET state = 'running', lease_epoch = r.lease_epoch + 1, attempt = r.attempt + 1,
         owner_node = %(node)s,
         lease_expires_at = flyd.app_now() + make_interval(secs => %(ttl)s)
    FROM picked p
   WHERE r.run_id = p.run_id
  RETURNING r.run_id, r.lease_epoch, r.lease_expires_at, r.attempt, r.cancel_requested, r.spec,
            r.faults_fired
), closed AS (
  UPDATE flyd.run_attempts a
     SET ended_at = p.prev_expiry, end_reason = 'expired'
    FROM picked p JOIN granted g USING (run_id)
   WHERE p.prev_state = 'running' AND a.run_id = g.run_id AND a.lease_epoch = g.lease_epoch - 1
), opened AS (
  INSERT INTO flyd.run_attempts (run_id, lease_epoch, node_id, granted_at)
  SELECT run_id, lease_epoch, %(node)s, flyd.app_now() FROM granted
)
SELECT g.run_id, g.lease_epoch, g.lease_expires_at, g.attempt, g.cancel_requested, g.spec,
       g.faults_fired, h.high_water, h.boundary
  FROM granted g JOIN flyd.run_heads h USING (run_id);
"""

KINDS = ("pending", "pending_later", "held", "expired", "exhausted", "cancel_asked", "done")


async def add_run(conn: Conn, kind: str, *, exclusive: bool = False) -> int:
    """One run of `kind` relative to the sim clock T0, with its open attempt when running."""
    spec = Jsonb({"exclusiveToSubmitter": True} if exclusive else {})
    running = kind in ("held", "expired", "exhausted", "cancel_asked")
    expires = T0 + timedelta(seconds=30 if kind == "held" else -5)
    cur = await conn.execute(
        """
        INSERT INTO flyd.runs (spec, state, lease_epoch, attempt, max_attempts, owner_node,
                               lease_expires_at, not_before, cancel_requested, finished_at)
        VALUES (%(spec)s, %(state)s, %(epoch)s, %(attempt)s, 3, %(owner)s, %(expires)s,
                %(not_before)s, %(cancel)s, %(finished)s)
        RETURNING run_id
        """,
        {"spec": spec, "state": "succeeded" if kind == "done" else
                                  "running" if running else "pending",
         "epoch": 1 if running or kind == "done" else 0,
         "attempt": 3 if kind == "exhausted" else 1 if running or kind == "done" else 0,
         "owner": "old" if running else None, "expires": expires if running else None,
         "not_before": T0 + timedelta(seconds=60) if kind == "pending_later" else T0,
         "cancel": kind == "cancel_asked",
         "finished": T0 if kind == "done" else None})
    row = await cur.fetchone()
    assert row is not None
    run = int(row[0])
    if running:
        await conn.execute(
            "INSERT INTO flyd.run_attempts (run_id, lease_epoch, node_id, granted_at) "
            "VALUES (%s, 1, 'old', %s)", (run, T0 - timedelta(seconds=40)))
    return run


async def outcome(dsn: str, query: str, params: dict[str, Any]) -> tuple[Any, ...]:
    """The grants and the attempt rows one claim produces, then rolled back."""
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        rows = await (await conn.execute(query, params)).fetchall()
        attempts = await (await conn.execute(
            "SELECT run_id, lease_epoch, node_id, granted_at, ended_at, end_reason "
            "FROM flyd.run_attempts ORDER BY run_id, lease_epoch")).fetchall()
        await conn.rollback()
    return sorted(rows, key=lambda r: int(r[0])), attempts


async def test_claim_grants_what_the_spec_statement_grants(db: Conn, db_dsn: str) -> None:
    """Seeded mixes of every run kind, some rows locked by another session (a fenced writer's
    KEY SHARE, a renewal's NO KEY UPDATE): for every n and `only`, both statements grant the
    same runs at the same epochs and close and open the same attempts."""
    await set_clock(db, T0)
    rng = random.Random(7)
    runs = [await add_run(db, rng.choice(KINDS), exclusive=rng.random() < 0.15)
            for _ in range(60)]
    async with await psycopg.AsyncConnection.connect(db_dsn) as locker:
        for run in rng.sample(runs, 12):
            lock = rng.choice(("FOR KEY SHARE", "FOR NO KEY UPDATE"))
            await locker.execute(f"SELECT 1 FROM flyd.runs WHERE run_id = %s {lock}", (run,))
        compared = 0
        for only in (None, *rng.sample(runs, 10)):
            for n in (1, 3, 8, 100):
                params = {"only": only, "n": n, "node": "n2", "ttl": 15.0, "room": None,
                          "per_run": 0}
                want = await outcome(db_dsn, SPEC_CLAIM, params)
                grants, attempts = await outcome(db_dsn, CLAIM, params)
                # CLAIM also returns each run's max_attempts (every run here has 3)
                assert {r[9] for r in grants} <= {3}, params
                assert ([r[:9] for r in grants], attempts) == want, params
                compared += len(want[0])
        await locker.rollback()
    assert compared > 20                                      # the mix granted something


def scanned_rows(plan: dict[str, Any]) -> int:
    """Rows a plan read from flyd.runs: returned plus removed by a filter, over all loops."""
    own = 0
    if plan.get("Relation Name") == "runs":
        kept = plan["Actual Rows"] + plan.get("Rows Removed by Filter", 0)
        own = kept * plan["Actual Loops"]
    return own + sum(scanned_rows(p) for p in plan.get("Plans", []))


async def test_claim_does_not_visit_held_runs(db: Conn, db_dsn: str) -> None:
    """2000 held runs ahead of 3000 pending ones: §3.3's text reads at least the held ones
    (walking the primary key) or every claimable one (a bitmap scan and a sort), the statement
    sent reads a handful of rows whatever the number held or pending."""
    await set_clock(db, T0)
    await db.execute(
        "INSERT INTO flyd.runs (spec, state, lease_epoch, attempt, owner_node, lease_expires_at) "
        "SELECT '{}'::jsonb, 'running', 1, 1, 'old', %s FROM generate_series(1, 2000)",
        (T0 + timedelta(seconds=30),))
    await db.execute(
        "INSERT INTO flyd.runs (spec) SELECT '{}'::jsonb FROM generate_series(1, 3000)")
    await db.execute("VACUUM ANALYZE flyd.runs")
    params = {"only": None, "n": 4, "node": "n2", "ttl": 15.0, "room": None, "per_run": 0}
    read = {}
    for name, query in (("spec", SPEC_CLAIM), ("sent", CLAIM)):
        async with await psycopg.AsyncConnection.connect(db_dsn) as conn:
            cur = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + query, params)
            row = await cur.fetchone()
            assert row is not None
            read[name] = scanned_rows(row[0][0]["Plan"])
            await conn.rollback()
    assert read["spec"] >= 2000
    assert read["sent"] <= 20


async def test_claim_skips_no_run_for_a_malformed_exclusivity_flag(db: Conn, db_dsn: str) -> None:
    """A spec whose `exclusiveToSubmitter` is not a boolean (written without the submit path's
    validation) makes §3.3's cast fail for every claim; the statement sent grants that run like
    any other (the scope's spec check then fails it) and still skips an exclusive one."""
    await set_clock(db, T0)
    ids = {}
    for name, spec in (("malformed", {"exclusiveToSubmitter": "maybe"}), ("plain", {}),
                       ("exclusive", {"exclusiveToSubmitter": True})):
        cur = await db.execute("INSERT INTO flyd.runs (spec) VALUES (%s) RETURNING run_id",
                               (Jsonb(spec),))
        row = await cur.fetchone()
        assert row is not None
        ids[name] = int(row[0])
    params = {"only": None, "n": 10, "node": "n2", "ttl": 15.0, "room": None, "per_run": 0}
    try:
        await outcome(db_dsn, SPEC_CLAIM, params)
    except psycopg.errors.InvalidTextRepresentation:
        pass
    else:
        raise AssertionError("§3.3's cast accepted a non-boolean flag")
    grants, _ = await outcome(db_dsn, CLAIM, params)
    assert [int(g[0]) for g in grants] == sorted([ids["malformed"], ids["plain"]])
    only, _ = await outcome(db_dsn, CLAIM, {**params, "only": ids["exclusive"]})
    assert [int(g[0]) for g in only] == [ids["exclusive"]]
