"""The `Store` contract (distribution.md §7.2, §8 tests 27–35): every test runs on `MemStore`
(virtual time) and on `PgStore` (a fresh migrated database whose `flyd.sim_clock` row is the
clock), and a seeded random history must give equal normalised results on both.

The per-store harness gives both sides the same vocabulary:
- `advance(s)`: MemStore's `ManualClock`; PostgreSQL's `flyd.sim_clock` row (inserted first).
- `open_fenced_transaction(commit)`: MemStore's `open_commit`; on PostgreSQL a raw session that
  runs the §3.5 statements after BEGIN and is left open (its COMMIT comes later).
- the idle-in-transaction timeout: MemStore's (1.5 sim s, lazily on use); PostgreSQL's
  `idle_in_transaction_session_timeout` set on that raw session (real time, waited for by
  polling `pg_stat_activity` under a deadline), followed by the same sim advance.
- `terminate`: `terminate_backends()` / `pg_terminate_backend`.
- normalisation: instants as sim seconds from the harness epoch (`-infinity` kept), bytes as
  hex, rows of multi-row results ordered by run id, the `Backend` of a commit dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import random
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

import psycopg
import pytest

from flyd.leases.clock import ManualClock
from flyd.leases.fit import WORKER_THREADS_SQL, Fit, worker_threads
from flyd.leases.params import LeaseParams
from flyd.leases.resolve import decide
from flyd.leases.stores import pg as pgstore
from flyd.leases.stores.contract import (
    Backend,
    Checkpoint,
    Commit,
    ConflictingEffect,
    DuplicateEffect,
    Effect,
    Fenced,
    Finish,
    HeadRegression,
    Held,
    NodeInfo,
    Store,
    StoreError,
    TerminalFinal,
    TerminalState,
    Transient,
)
from flyd.leases.stores.mem import OpenCommit
from tests.admin_store import AdminMemStore

BASE = datetime(2030, 1, 1, tzinfo=UTC)
A = "node-a-0000000000a1"
B = "node-b-0000000000b2"
IDLE_S = 1.5
PG_IDLE_MS = 600
TIME_COLUMNS = frozenset({
    "lease_expires_at", "not_before", "submitted_at", "finished_at", "granted_at", "ended_at",
    "started_at", "heartbeat_at", "committed_at", "recorded_at", "at",
})
TABLES = {
    "runs": "run_id", "run_attempts": "run_id, lease_epoch", "nodes": "node_id",
    "checkpoints": "run_id, checkpoint_id", "run_heads": "run_id",
    "effects": "run_id, effect_key", "interventions": "intervention_id",
}


# --------------------------------------------------------------------------------------------
# values


def payload_digest(payload: Mapping[str, Any]) -> bytes:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":"))
                          .encode()).digest()


def eff(k: int, tag: str = "x", session_epoch: int = 1) -> Effect:
    payload = {"boundary": k, "tag": tag}
    return Effect(key=f"boundary-{k}", session_epoch=session_epoch, boundary=k,
                  payload=payload, digest=payload_digest(payload))


def finish_eff(state: str, boundaries: int) -> Effect:
    payload = {"state": state, "boundaries": boundaries, "outcomeDigest": "00"}
    return Effect(key="finish", session_epoch=1, boundary=None, payload=payload,
                  digest=payload_digest(payload))


def ckpt(cid: str, boundary: int) -> Checkpoint:
    envelope = f"FLYSESS1:{cid}:{boundary}".encode()
    return Checkpoint(checkpoint_id=cid, session_id="sess-1", session_epoch=1,
                      episode_id="ep-1", boundary=boundary, compatibility_digest="compat-1",
                      envelope_digest=hashlib.sha256(envelope).digest(), envelope=envelope)


def node(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, node_name=node_id.rsplit("-", 1)[0], host="host-1",
                    pid=4242, version="1.0", capacity=4)


def rel(t: datetime) -> float:
    return round((t - BASE).total_seconds(), 6)


def norm(x: Any) -> Any:
    """A result as comparable plain data (module docstring)."""
    if isinstance(x, Backend):
        return None
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: norm(getattr(x, f.name)) for f in dataclasses.fields(x)
                if f.name != "backend"}
    if isinstance(x, datetime):
        return rel(x)
    if isinstance(x, bytes | bytearray | memoryview):
        return bytes(x).hex()
    if isinstance(x, Mapping):
        return {str(k): norm(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        items = [norm(v) for v in x]
        if items and all(isinstance(v, dict) and "run_id" in v for v in items):
            items.sort(key=lambda v: (v["run_id"], v.get("lease_epoch", 0)))
        return items
    return x


def norm_error(exc: StoreError) -> Any:
    if isinstance(exc, DuplicateEffect | ConflictingEffect):
        return [type(exc).__name__, exc.code, exc.outcome()]
    return [type(exc).__name__, exc.code, exc.mutation]


def norm_cell(column: str, value: Any) -> Any:
    if column in TIME_COLUMNS and value is not None:
        if isinstance(value, datetime):
            return "-infinity" if value == datetime.min.replace(tzinfo=UTC) else rel(value)
        if value == "-infinity":
            return value
        return rel(datetime.fromisoformat(value))
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, str) and value.startswith("\\x"):
        return value[2:]
    return value


# --------------------------------------------------------------------------------------------
# harness


class Tx(Protocol):
    backend: Backend

    async def commit(self) -> None: ...

    async def abort(self) -> None: ...


class Harness(Protocol):
    kind: str
    store: Store

    async def advance(self, seconds: float) -> None: ...

    async def open_fenced_transaction(self, c: Commit, *, idle_timeout: bool = False) -> Tx: ...

    async def wait_idle_timeout(self, tx: Tx, sim_s: float) -> None: ...

    async def terminate(self, tx: Tx) -> None: ...

    async def leave_terminal(self, run_id: int) -> None: ...

    async def dump(self) -> dict[str, list[dict[str, Any]]]: ...

    async def close(self) -> None: ...


class MemTx:
    def __init__(self, h: OpenCommit) -> None:
        self.h = h
        self.backend = h.backend

    async def commit(self) -> None:
        await self.h.commit()

    async def abort(self) -> None:
        self.h.abort()


class MemHarness:
    kind = "mem"

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.mem = AdminMemStore(self.clock.now, idle_in_transaction_timeout_s=IDLE_S,
                            epoch_base=BASE)
        self.store: Store = self.mem

    async def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    async def open_fenced_transaction(self, c: Commit, *, idle_timeout: bool = False) -> Tx:
        return MemTx(self.mem.open_commit(c))

    async def wait_idle_timeout(self, tx: Tx, sim_s: float) -> None:
        self.clock.advance(sim_s)
        assert tx.backend not in [h.backend for h in self.mem.open_commits()]

    async def terminate(self, tx: Tx) -> None:
        assert self.mem.terminate_backends() >= 1

    async def leave_terminal(self, run_id: int) -> None:
        self.mem.admin_update_run(run_id, state="pending")

    async def dump(self) -> dict[str, list[dict[str, Any]]]:
        return {t: [{c: norm_cell(c, v) for c, v in row.items()} for row in rows]
                for t, rows in self.mem.dump().items()}

    async def close(self) -> None:
        return None


def _typed(exc: psycopg.Error) -> StoreError:
    if exc.sqlstate == "LF001":
        return Fenced(str(exc))
    if exc.sqlstate == "LF003":
        return TerminalFinal(str(exc))
    return Transient(f"{exc.sqlstate}: {exc}")


class PgTx:
    def __init__(self, conn: psycopg.AsyncConnection[Any], backend: Backend) -> None:
        self.conn = conn
        self.backend = backend

    async def commit(self) -> None:
        try:
            async with asyncio.timeout(5):
                await self.conn.execute("COMMIT")
        except psycopg.Error as exc:
            raise _typed(exc) from exc
        finally:
            await self.conn.close()

    async def abort(self) -> None:
        await self.conn.close()


class PgHarness:
    kind = "pg"

    def __init__(self, dsn: str, admin: psycopg.AsyncConnection[Any], store: pgstore.PgStore
                 ) -> None:
        self.dsn = dsn
        self.admin = admin
        self.pg = store
        self.store: Store = store
        self.t = 0.0
        self.raw: list[psycopg.AsyncConnection[Any]] = []

    @classmethod
    async def start(cls, dsn: str) -> PgHarness:
        admin = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        await admin.execute("INSERT INTO flyd.sim_clock (t) VALUES (%s)", (BASE,))
        store = pgstore.PgStore(dsn, "harness-000000000000", pgstore.DbSettings(),
                                LeaseParams())
        await store.open()
        return cls(dsn, admin, store)

    async def advance(self, seconds: float) -> None:
        self.t += seconds
        await self.admin.execute("UPDATE flyd.sim_clock SET t = %s",
                                 (BASE + timedelta(seconds=self.t),))

    async def open_fenced_transaction(self, c: Commit, *, idle_timeout: bool = False) -> Tx:
        conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        self.raw.append(conn)
        if idle_timeout:
            await conn.execute(f"SET idle_in_transaction_session_timeout = {PG_IDLE_MS}")
        cur = await conn.execute(
            "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        row = await cur.fetchone()
        assert row is not None
        backend = Backend(pid=int(row[0]), backend_start=row[1])
        k = c.checkpoint
        base: dict[str, Any] = {"run": c.run_id, "epoch": c.lease_epoch, "node": c.node_id,
                                "ckpt": k.checkpoint_id if k is not None else None}
        try:
            await conn.execute("BEGIN")
            await conn.execute(pgstore.ASSERT_FENCE, base)
            if k is not None:
                await conn.execute(pgstore.INSERT_CHECKPOINT, {
                    **base, "session_id": k.session_id, "session_epoch": k.session_epoch,
                    "episode_id": k.episode_id, "boundary": k.boundary,
                    "compat": k.compatibility_digest, "env_digest": k.envelope_digest,
                    "byte_length": k.byte_length, "envelope": k.envelope})
            for e in c.effects:
                await conn.execute(
                    "INSERT INTO flyd.effects (run_id, effect_key, lease_epoch, node_id,"
                    " session_epoch, boundary, checkpoint_id, payload, payload_digest)"
                    " VALUES (%(run)s, %(key)s, %(epoch)s, %(node)s, %(se)s, %(b)s, %(ckpt)s,"
                    " %(payload)s, %(digest)s)",
                    {**base, "key": e.key, "se": e.session_epoch, "b": e.boundary,
                     "payload": psycopg.types.json.Jsonb(dict(e.payload)),
                     "digest": e.digest})
            if k is not None:
                await conn.execute(pgstore.MOVE_HEAD, {**base, "boundary": k.boundary})
                await conn.execute(pgstore.ROTATE, {**base, "keep": c.keep})
        except psycopg.Error as exc:
            await conn.close()
            raise _typed(exc) from exc
        return PgTx(conn, backend)

    async def wait_idle_timeout(self, tx: Tx, sim_s: float) -> None:
        async with asyncio.timeout(10):
            while True:
                cur = await self.admin.execute(
                    "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (tx.backend.pid,))
                if await cur.fetchone() is None:
                    break
                await asyncio.sleep(0.02)
        await self.advance(sim_s)

    async def terminate(self, tx: Tx) -> None:
        await self.admin.execute("SELECT pg_terminate_backend(%s, 5000)", (tx.backend.pid,))

    async def leave_terminal(self, run_id: int) -> None:
        try:
            await self.admin.execute(
                "UPDATE flyd.runs SET state = 'pending', finished_at = NULL WHERE run_id = %s",
                (run_id,))
        except psycopg.Error as exc:
            raise _typed(exc) from exc

    async def dump(self) -> dict[str, list[dict[str, Any]]]:
        out: dict[str, list[dict[str, Any]]] = {}
        for table, key in TABLES.items():
            cur = await self.admin.execute(
                f"SELECT to_jsonb(t) FROM flyd.{table} t ORDER BY {key}")
            out[table] = [{c: norm_cell(c, v) for c, v in row[0].items()}
                          for row in await cur.fetchall()]
        return out

    async def close(self) -> None:
        for conn in self.raw:
            await conn.close()
        await self.pg.close()
        await self.admin.close()


async def make_harness(dsn: str | None) -> Harness:
    """MemStore without a DSN, else PgStore on that (fresh, migrated) database."""
    if dsn is None:
        return MemHarness()
    return await PgHarness.start(dsn)


@pytest.fixture(params=["mem", "pg"])
def store_dsn(request: pytest.FixtureRequest) -> str | None:
    """None for MemStore; the test database for PgStore (created only for `pg`)."""
    if request.param == "mem":
        return None
    dsn: str = request.getfixturevalue("db_dsn")
    return dsn


@pytest.fixture
async def h(store_dsn: str | None) -> AsyncIterator[Harness]:
    harness = await make_harness(store_dsn)
    try:
        await harness.store.register_node(node(A))
        await harness.store.register_node(node(B))
        yield harness
    finally:
        await harness.close()


async def submit(h: Harness, n: int = 1, max_attempts: int = 3) -> list[int]:
    return [(await h.store.submit(None, {"i": i}, max_attempts)).run_id for i in range(n)]


# --------------------------------------------------------------------------------------------
# 27–34


async def test_contract_claim_once_and_reclaim_after_expiry(h: Harness) -> None:
    r1, r2 = await submit(h, 2, max_attempts=2)
    grants = await h.store.claim(A, 4, 4.0)
    assert sorted((g.run_id, g.lease_epoch, g.attempt) for g in grants) == [(r1, 1, 1),
                                                                           (r2, 1, 1)]
    assert all(rel(g.lease_expires_at) == 4.0 and g.high_water is None and g.boundary == 0
               for g in grants)
    assert await h.store.claim(B, 4, 4.0) == []          # no shared grant
    await h.advance(3.75)
    assert await h.store.claim(B, 4, 4.0) == []          # live: no reclaim
    await h.advance(0.25)                                # expiry is `<= now`
    again = await h.store.claim(B, 4, 4.0)
    assert sorted((g.run_id, g.lease_epoch, g.attempt) for g in again) == [(r1, 2, 2),
                                                                          (r2, 2, 2)]
    attempts = (await h.dump())["run_attempts"]
    assert [(a["run_id"], a["lease_epoch"], a["node_id"], a["ended_at"], a["end_reason"])
            for a in attempts] == [(r1, 1, A, 4.0, "expired"), (r1, 2, B, None, None),
                                   (r2, 1, A, 4.0, "expired"), (r2, 2, B, None, None)]
    await h.advance(4.0)
    assert await h.store.claim(A, 4, 4.0) == []          # attempt 2 >= max_attempts 2
    assert sorted(norm(await h.store.reap(4)), key=lambda x: x["run_id"]) == [
        {"run_id": r1, "lease_epoch": 3, "state": "failed"},
        {"run_id": r2, "lease_epoch": 3, "state": "failed"}]


async def test_contract_claim_takes_only_runs_that_fit(h: Harness) -> None:
    """Claims fit first (flyd.leases.fit): a run whose threads exceed the room is skipped, not
    granted and released, so its epoch and attempt stay 0; a batch stops where the needs add
    up beyond the room; a later run that fits is taken past one that does not."""
    specs = [{"world": {"threads": 1}, "agents": [{"threads": 4}, {"threads": 4}]},  # 9
             {},                                            # world 1 + two default agents
             {"agents": [{"threads": 2}]},                  # 3
             {"world": {"threads": "x"}}]                   # malformed: counts 0 + 2
    r1, r2, r3, r4 = [(await h.store.submit(None, spec, 3)).run_id for spec in specs]
    grants = await h.store.claim(A, 4, 5.0, fit=Fit(room=7, per_run=1))
    assert [(g.run_id, g.lease_epoch) for g in grants] == [(r2, 1)]   # r3 would make 8 > 7
    grants = await h.store.claim(A, 4, 5.0, fit=Fit(room=3, per_run=1))
    assert [(g.run_id, g.lease_epoch) for g in grants] == [(r4, 1)]
    assert await h.store.claim(A, 4, 5.0, fit=Fit(room=3, per_run=1)) == []
    runs = {r["run_id"]: r for r in (await h.dump())["runs"]}
    assert [(runs[r]["state"], runs[r]["lease_epoch"], runs[r]["attempt"]) for r in (r1, r3)] \
        == [("pending", 0, 0), ("pending", 0, 0)]
    assert {a["run_id"] for a in (await h.dump())["run_attempts"]} == {r2, r4}
    # without a fit (or with room) the rest is claimable as before
    assert [g.run_id for g in await h.store.claim(B, 4, 5.0, fit=Fit(room=14, per_run=1))] \
        == [r1, r3]


async def test_worker_threads_sql_agrees_with_python(db_dsn: str) -> None:
    """The claim's SQL reading of a spec's threads is `worker_threads`, on valid, partial and
    malformed documents alike."""
    docs: list[Any] = [
        {}, {"world": {}}, {"world": {"threads": 3}}, {"world": None}, {"world": []},
        {"world": {"threads": 2.5}}, {"world": {"threads": True}}, {"world": {"threads": -1}},
        {"world": {"threads": 10_000_000}}, {"agents": []}, {"agents": None},
        {"agents": [{}, {"threads": 7}, "x", {"threads": "2"}]}, {"agents": {"a": 1}},
        [], "spec", 5, None, {"world": {"threads": 256}, "agents": [{"threads": 256}] * 3},
    ]
    async with await psycopg.AsyncConnection.connect(db_dsn, autocommit=True) as conn:
        for doc in docs:
            cur = await conn.execute(f"SELECT {WORKER_THREADS_SQL} FROM (SELECT %s::jsonb "
                                     "AS spec) AS t", (json.dumps(doc),))
            row = await cur.fetchone()
            assert row is not None and row[0] == worker_threads(doc), doc


async def test_contract_renew_missing_means_lost(h: Harness) -> None:
    r1, r2 = await submit(h, 2)
    assert [g.run_id for g in await h.store.claim(A, 1, 5.0, only=r1)] == [r1]
    await h.advance(3.0)
    assert [g.run_id for g in await h.store.claim(A, 1, 5.0, only=r2)] == [r2]
    await h.advance(2.5)                                 # r1 expired at 5.0, r2 live to 8.0
    holds = [Held(r1, 1), Held(r2, 1), Held(r2, 0)]
    assert norm(await h.store.renew(A, holds, 5.0)) == [
        {"run_id": r2, "lease_epoch": 1, "lease_expires_at": 10.5, "cancel_requested": False}]
    assert await h.store.renew(B, [Held(r2, 1)], 5.0) == []      # foreign owner
    assert [g.run_id for g in await h.store.claim(B, 4, 5.0)] == [r1]
    assert [x.run_id for x in await h.store.renew(A, holds, 5.0)] == [r2]
    nodes = {n["node_id"]: n for n in (await h.dump())["nodes"]}
    assert nodes[A]["held"] == 3 and nodes[A]["heartbeat_at"] == 5.5
    assert await h.store.renew(A, [], 5.0) == []
    assert {n["node_id"]: n["held"] for n in (await h.dump())["nodes"]}[A] == 0


async def test_contract_heartbeat_reconnect(h: Harness) -> None:
    """§5.4: `reconnect_heartbeat()` re-establishes the session a failed renewal closed, so the
    next renewal is one statement; with the session up it changes nothing."""
    (r,) = await submit(h)
    await h.store.claim(A, 1, 5.0)
    await h.store.reconnect_heartbeat()
    assert [x.run_id for x in await h.store.renew(A, [Held(r, 1)], 5.0)] == [r]
    if isinstance(h, PgHarness):
        app = "flyd:harness-000000000000:heartbeat"
        sessions = ("SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                    "AND datname = current_database()")   # tests in parallel share the name
        (old,) = await (await h.admin.execute(sessions, (app,))).fetchall()
        await h.admin.execute("SELECT pg_terminate_backend(%s, 5000)", (old[0],))
        # a session ended while idle: the renewal is sent again on a new one (issue 23)
        assert [x.run_id for x in await h.store.renew(A, [Held(r, 1)], 5.0)] == [r]
        (old,) = await (await h.admin.execute(sessions, (app,))).fetchall()
        with pytest.raises(StoreError):
            await h.store.renew(A, [Held(r, 1)], 1e308)  # a server error: closed, not resent
        async with asyncio.timeout(5):                   # the server ends the closed session
            while True:
                if not await (await h.admin.execute(sessions, (app,))).fetchall():
                    break
                await asyncio.sleep(0.02)
        await h.store.reconnect_heartbeat()
        (new,) = await (await h.admin.execute(sessions, (app,))).fetchall()
        assert new[0] != old[0]                          # a new session, before any renewal
        await h.store.reconnect_heartbeat()              # up: no second session
        assert await (await h.admin.execute(sessions, (app,))).fetchall() == [new]
    assert [x.run_id for x in await h.store.renew(A, [Held(r, 1)], 5.0)] == [r]


async def test_contract_fenced_writes(h: Harness) -> None:
    (r,) = await submit(h)
    await h.store.claim(A, 1, 1.0)
    await h.advance(1.25)
    (g,) = await h.store.claim(B, 1, 1.0)
    assert g.lease_epoch == 2
    stale = [Commit(r, 1, A, effects=(eff(1),), checkpoint=ckpt("a1", 1)),
             Commit(r, 1, A, effects=(eff(1),)),
             Commit(r, 1, A, effects=(finish_eff("succeeded", 0),),
                    finish=Finish("succeeded", {"ok": True}))]
    for c in stale:
        with pytest.raises(Fenced) as info:
            await h.store.commit(c)
        assert info.value.code == "LF001" and info.value.mutation == "none"
    assert await h.store.mark_faults_fired(r, 1, A, ["f1"]) is None
    assert await h.store.mark_faults_fired(r, 2, B, ["f1"]) == ("f1",)
    assert await h.store.mark_faults_fired(r, 2, B, ["f1", "f0"]) == ("f0", "f1")
    # A commit across expiry: statements while live, COMMIT after the lease ran out.
    tx = await h.open_fenced_transaction(
        Commit(r, 2, B, effects=(eff(1),), checkpoint=ckpt("b1", 1)))
    await h.advance(1.0)
    with pytest.raises(Fenced):
        await tx.commit()
    dump = await h.dump()
    assert dump["effects"] == [] and dump["checkpoints"] == []
    assert dump["run_heads"][0]["high_water"] is None


async def test_contract_lock_semantics(h: Harness) -> None:
    r1, = await submit(h, 1, max_attempts=3)
    r2, = await submit(h, 1, max_attempts=1)
    assert len(await h.store.claim(A, 4, 1.0)) == 2
    tx1 = await h.open_fenced_transaction(Commit(r1, 1, A, effects=(eff(1),)),
                                          idle_timeout=True)
    tx2 = await h.open_fenced_transaction(Commit(r2, 1, A, effects=(eff(1),)),
                                          idle_timeout=True)
    async with asyncio.timeout(2):                       # renew is not blocked
        renewed = await h.store.renew(A, [Held(r1, 1), Held(r2, 1)], 1.0)
    assert sorted(x.run_id for x in renewed) == [r1, r2]
    await h.advance(1.25)                                # both expired, transactions open
    assert await h.store.claim(B, 4, 1.0) == []          # reclaim skips the locked run
    assert await h.store.reap(4) == []                   # reap too
    await h.wait_idle_timeout(tx1, 0.5)                  # the idle timeout ends both
    await h.wait_idle_timeout(tx2, 0.0)
    grants = await h.store.claim(B, 4, 1.0)
    assert [(g.run_id, g.lease_epoch) for g in grants] == [(r1, 2)]
    assert norm(await h.store.reap(4)) == [{"run_id": r2, "lease_epoch": 2, "state": "failed"}]
    for tx in (tx1, tx2):
        with pytest.raises(Transient):
            await tx.commit()
    assert (await h.dump())["effects"] == []


async def test_contract_effect_duplicate_vs_conflict(h: Harness) -> None:
    (r,) = await submit(h)
    await h.store.claim(A, 1, 10.0)
    done = await h.store.commit(Commit(r, 1, A, effects=(eff(1), eff(2)),
                                       checkpoint=ckpt("c2", 2)))
    assert done.finished is None
    with pytest.raises(DuplicateEffect) as dup:
        await h.store.commit(Commit(r, 1, A, effects=(eff(2), eff(3)),
                                    checkpoint=ckpt("c3", 3)))
    assert dup.value.outcome() == {"error": "effect_duplicate", "key": "boundary-2",
                                   "existingEpoch": 1, "digest": eff(2).digest.hex()}
    assert dup.value.code == "23505"
    with pytest.raises(ConflictingEffect) as conflict:
        await h.store.commit(Commit(r, 1, A, effects=(eff(1), eff(2, tag="other"))))
    assert conflict.value.outcome() == {"error": "effect_conflict", "key": "boundary-2",
                                        "existingEpoch": 1, "digest": eff(2).digest.hex()}
    dump = await h.dump()
    assert [e["effect_key"] for e in dump["effects"]] == ["boundary-1", "boundary-2"]
    assert [c["checkpoint_id"] for c in dump["checkpoints"]] == ["c2"]


async def test_contract_finish_and_terminal(h: Harness) -> None:
    r1, r2 = await submit(h, 2)
    await h.store.claim(A, 4, 10.0)
    final = Commit(r1, 1, A, finish=Finish("succeeded", {"result": 1}))
    assert (await h.store.commit(final)).finished == "finished"
    assert (await h.store.commit(final)).finished == "already"
    with pytest.raises(Fenced):                          # another state at that epoch
        await h.store.commit(Commit(r1, 1, A, finish=Finish("failed", {})))
    with pytest.raises(TerminalFinal) as info:
        await h.leave_terminal(r1)
    assert info.value.code == "LF003"
    # Head: five commits leave three generations; a lower boundary is refused.
    for b in range(1, 6):
        await h.store.commit(Commit(r2, 1, A, effects=(eff(b),), checkpoint=ckpt(f"k{b}", b)))
    dump = await h.dump()
    assert [c["checkpoint_id"] for c in dump["checkpoints"] if c["run_id"] == r2] == [
        "k3", "k4", "k5"]
    with pytest.raises(HeadRegression) as reg:
        await h.store.commit(Commit(r2, 1, A, effects=(eff(6),), checkpoint=ckpt("k0", 4)))
    assert reg.value.code == "LF002"
    read = await h.store.read_run(r2, 1, "k5")
    assert read is not None and (read.high_water, read.boundary) == ("k5", 5)
    # The last group commit of a run: effects, finish effect and finish_run together.
    last = Commit(r2, 1, A, effects=(eff(6), finish_eff("succeeded", 6)),
                  checkpoint=ckpt("k6", 6), finish=Finish("succeeded", {"result": 2}))
    assert (await h.store.commit(last)).finished == "finished"
    runs = {r["run_id"]: r for r in (await h.dump())["runs"]}
    assert runs[r2]["state"] == "succeeded" and runs[r2]["owner_node"] is None


async def test_contract_release_reap_cancel(h: Harness) -> None:
    r1, r2, r3, r4 = await submit(h, 4, max_attempts=2)
    await h.store.claim(A, 4, 2.0)
    # T5 release with refund, then relinquish (charged), not_before honoured.
    assert norm(await h.store.release(r1, 1, A, refund=True, backoff_s=1.0)) == {
        "run_id": r1, "lease_epoch": 1}
    assert await h.store.release(r1, 1, A, refund=True, backoff_s=0.0) is None
    assert await h.store.release(r2, 1, B, refund=True, backoff_s=0.0) is None
    assert norm(await h.store.release(r2, 1, A, refund=False, backoff_s=0.0)) == {
        "run_id": r2, "lease_epoch": 1}
    assert [(g.run_id, g.attempt) for g in await h.store.claim(B, 4, 2.0)] == [(r2, 2)]
    await h.advance(1.0)
    assert [(g.run_id, g.lease_epoch, g.attempt) for g in await h.store.claim(B, 4, 2.0)] == [
        (r1, 2, 1)]
    # T10 cancel running: flag returned by renew; T9 cancel pending.
    assert norm(await h.store.cancel(r3, "op")) == {"run_id": r3, "state": "running"}
    renewed = await h.store.renew(A, [Held(r3, 1), Held(r4, 1)], 2.0)
    assert sorted((x.run_id, x.cancel_requested) for x in renewed) == [(r3, True), (r4, False)]
    (r5,) = await submit(h, 1)
    assert norm(await h.store.cancel(r5, "op")) == {"run_id": r5, "state": "cancelled"}
    assert await h.store.cancel(r5, "op") is None
    assert await h.store.cancel(10_000, "op") is None
    # T8 reap cancel-requested, T7 reap exhausted (r2 at attempt 2 of 2).
    await h.advance(2.5)
    reaped = sorted(norm(await h.store.reap(10)), key=lambda x: x["run_id"])
    assert reaped == [{"run_id": r2, "lease_epoch": 3, "state": "failed"},
                      {"run_id": r3, "lease_epoch": 2, "state": "cancelled"}]
    dump = await h.dump()
    runs = {r["run_id"]: r for r in dump["runs"]}
    attempts = {(a["run_id"], a["lease_epoch"]): a for a in dump["run_attempts"]}
    assert runs[r5]["outcome"] == {"cancelledBy": "op"} and runs[r5]["finished_at"] == 1.0
    assert runs[r3]["outcome"] == {"reaped": "cancel requested, holder gone"}
    assert runs[r2]["outcome"] == {"reaped": "attempts exhausted"}
    assert (attempts[(r1, 1)]["end_reason"], attempts[(r1, 1)]["ended_at"]) == ("released", 0.0)
    assert (attempts[(r2, 2)]["end_reason"], attempts[(r2, 2)]["ended_at"]) == ("exhausted", 2.0)
    assert (attempts[(r3, 1)]["end_reason"], attempts[(r3, 1)]["ended_at"]) == ("cancelled", 3.0)
    assert runs[r1]["attempt"] == 1 and runs[r1]["not_before"] == 1.0
    # r4 expired with attempts left: claimable again, not reaped.
    assert [(g.run_id, g.lease_epoch) for g in await h.store.claim(B, 4, 2.0)] == [
        (r1, 3), (r4, 2)]
    assert await h.store.requeue(r2, "op") is True
    assert await h.store.requeue(r4, "op") is False
    dump = await h.dump()
    assert [(i["actor"], i["kind"], i["run_id"]) for i in dump["interventions"]] == [
        ("op", "requeue", r2)]
    run2 = {r["run_id"]: r for r in dump["runs"]}[r2]
    assert (run2["state"], run2["attempt"], run2["lease_epoch"]) == ("pending", 0, 3)


async def test_contract_a_run_is_granted_within_its_own_max_attempts(h: Harness) -> None:
    """distribution.md §1.2 T2/T3 with the run's own budget: a run submitted with
    max_attempts 1 is granted once, even when a relinquish hands it back pending (the pending
    path of the claim checks `attempt < max_attempts`); each grant carries the run's budget."""
    (one,) = await submit(h, 1, max_attempts=1)
    (three,) = await submit(h, 1, max_attempts=3)
    grants = await h.store.claim(A, 4, 2.0)
    assert sorted((g.run_id, g.attempt, g.max_attempts) for g in grants) == [
        (one, 1, 1), (three, 1, 3)]
    for run in (one, three):  # charged hand-backs: both pending at attempt 1
        assert norm(await h.store.release(run, 1, A, refund=False, backoff_s=0.0)) == {
            "run_id": run, "lease_epoch": 1}
    runs = {r["run_id"]: r for r in (await h.dump())["runs"]}
    assert [(runs[r]["state"], runs[r]["attempt"]) for r in (one, three)] == [
        ("pending", 1), ("pending", 1)]
    again = await h.store.claim(B, 4, 2.0)
    assert [(g.run_id, g.attempt, g.max_attempts) for g in again] == [(three, 2, 3)]
    assert await h.store.claim(B, 4, 2.0, only=one) == []
    runs = {r["run_id"]: r for r in (await h.dump())["runs"]}
    assert (runs[one]["state"], runs[one]["attempt"], runs[one]["lease_epoch"]) == (
        "pending", 1, 1)
    # an operator can still end it
    assert norm(await h.store.cancel(one, "op")) == {"run_id": one, "state": "cancelled"}


async def test_contract_reap_ends_an_exclusive_run_whose_submitter_is_gone(h: Harness
                                                                          ) -> None:
    """Issue 23, item 4: an exclusive run whose lease expired while its owner (the submitter's
    node) is stopped, unregistered or silent for `node_stale_after_s` is failed `{error:
    "submitter gone"}` (`cancelled` when a cancel was asked); one whose owner still beats, and
    any shared run, is left for a claim."""
    c, d = "node-c-0000000000c3", "node-d-0000000000d4"
    await h.store.register_node(node(d))
    ex = [(await h.store.submit(None, {"exclusiveToSubmitter": True, "i": i}, 3)).run_id
          for i in range(5)]
    (shared,) = await submit(h, 1)
    stopped, alive, unregistered, cancelled, silent = ex
    for owner, run in ((A, stopped), (B, alive), (c, unregistered), (A, cancelled),
                       (d, silent), (A, shared)):
        assert [g.run_id for g in await h.store.claim(owner, 1, 2.0, only=run)] == [run]
    await h.store.cancel(cancelled, "op")
    await h.store.set_node_state(A, "stopped")
    await h.advance(1.0)
    assert await h.store.reap(10) == []                  # every lease still live
    await h.advance(1.5)
    reaped = sorted(norm(await h.store.reap(10)), key=lambda x: x["run_id"])
    assert reaped == [{"run_id": stopped, "lease_epoch": 2, "state": "failed"},
                      {"run_id": unregistered, "lease_epoch": 2, "state": "failed"},
                      {"run_id": cancelled, "lease_epoch": 2, "state": "cancelled"}]
    await h.advance(6.0)                                 # d has not beaten for 8.5 s < 9 s
    await h.store.renew(B, [], 2.0)
    assert await h.store.reap(10) == []
    await h.advance(1.0)
    assert norm(await h.store.reap(10)) == [{"run_id": silent, "lease_epoch": 2,
                                             "state": "failed"}]
    assert [(g.run_id, g.lease_epoch) for g in await h.store.claim(B, 1, 2.0, only=alive)] == [
        (alive, 2)]
    assert [(g.run_id, g.lease_epoch) for g in await h.store.claim(B, 1, 2.0)] == [(shared, 2)]
    dump = await h.dump()
    runs = {r["run_id"]: r for r in dump["runs"]}
    attempts = {(a["run_id"], a["lease_epoch"]): a for a in dump["run_attempts"]}
    for run in (stopped, unregistered, silent):
        assert runs[run]["outcome"] == {"error": "submitter gone"}
        assert (attempts[(run, 1)]["end_reason"], attempts[(run, 1)]["ended_at"]) == (
            "exhausted", 2.0)
    assert runs[cancelled]["outcome"] == {"reaped": "cancel requested, holder gone"}


async def test_contract_unknown_outcome_and_sweep(h: Harness) -> None:
    r1, r2, r3 = await submit(h, 3)
    assert len(await h.store.claim(A, 2, 4.0)) == 2      # r1, r2
    # Committed: the read shows the checkpoint at my epoch.
    c1 = Commit(r1, 1, A, effects=(eff(1),), checkpoint=ckpt("u1", 1))
    await h.store.commit(c1)
    read = await h.store.read_run(r1, 1, "u1")
    assert decide(read, lease_epoch=1, node_id=A, checkpoint_id="u1", final=None) == "committed"
    # Retry: the old backend is ended, the read shows nothing, the identical commit lands.
    c2 = Commit(r1, 1, A, effects=(eff(2),), checkpoint=ckpt("u2", 2))
    tx = await h.open_fenced_transaction(c2)
    await h.store.end_backend(tx.backend)
    read = await h.store.read_run(r1, 1, "u2")
    assert read is not None and not read.checkpoint_committed and read.boundary == 1
    assert decide(read, lease_epoch=1, node_id=A, checkpoint_id="u2", final=None) == "retry"
    with pytest.raises(Transient):
        await tx.commit()
    await h.store.commit(c2)
    read = await h.store.read_run(r1, 1, "u2")
    assert decide(read, lease_epoch=1, node_id=A, checkpoint_id="u2", final=None) == "committed"
    # A final commit resolved by the terminal state at my epoch.
    await h.store.commit(Commit(r1, 1, A, effects=(finish_eff("succeeded", 2),),
                                finish=Finish("succeeded", {})))
    read = await h.store.read_run(r1, 1, None)
    assert decide(read, lease_epoch=1, node_id=A, checkpoint_id=None,
                  final="succeeded") == "committed"
    # Lost: the lease expired and another node holds the run.
    tx = await h.open_fenced_transaction(Commit(r2, 1, A, effects=(eff(1),),
                                                checkpoint=ckpt("v1", 1)))
    await h.terminate(tx)
    await h.advance(4.0)
    assert [(g.run_id, g.lease_epoch) for g in await h.store.claim(B, 1, 4.0)] == [(r2, 2)]
    read = await h.store.read_run(r2, 1, "v1")
    assert decide(read, lease_epoch=1, node_id=A, checkpoint_id="v1", final=None) == "lost"
    assert await h.store.read_run(10_000, 1, None) is None
    # Own-grant sweep: a grant A never saw is found and released with refund.
    assert [(g.run_id, g.lease_epoch) for g in await h.store.claim(A, 1, 4.0)] == [(r3, 1)]
    assert norm(await h.store.own_grants(A)) == [{"run_id": r3, "lease_epoch": 1}]
    for held in await h.store.own_grants(A):
        assert await h.store.release(held.run_id, held.lease_epoch, A, refund=True,
                                     backoff_s=0.0) is not None
    assert await h.store.own_grants(A) == []
    runs = {r["run_id"]: r for r in (await h.dump())["runs"]}
    assert (runs[r3]["state"], runs[r3]["attempt"]) == ("pending", 0)


# --------------------------------------------------------------------------------------------
# 35: random histories


class History:
    """Seeded operations over a small world; the generator only reads its own bookkeeping
    (never a store's answer), so both stores receive the identical sequence."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.runs: list[int] = []
        self.grants: list[tuple[int, int, str]] = []
        self.next_b: dict[tuple[int, int], int] = {}
        self.ckpts = 0
        self.last_node = A

    def learn(self, op: str, result: Any) -> None:
        if op == "submit" and isinstance(result, dict) and result.get("created"):
            self.runs.append(result["run_id"])
        if op == "claim" and isinstance(result, list):
            self.grants += [(g["run_id"], g["lease_epoch"], self.last_node) for g in result]

    def grant(self) -> tuple[int, int, str]:
        recent = self.grants[-3:]
        return self.rng.choice(recent if self.rng.random() < 0.7 else self.grants)

    def next_op(self) -> tuple[str, dict[str, Any]]:
        rng = self.rng
        ops = ["submit", "claim", "renew", "advance", "commit", "release", "reap", "cancel",
               "faults", "sweep", "read", "requeue"]
        weights = [3, 4, 3, 3, 6, 2, 1, 1, 1, 1, 1, 1]
        while True:
            op = rng.choices(ops, weights)[0]
            if op in ("submit", "claim", "advance", "reap", "sweep"):
                break
            if op in ("cancel", "read", "requeue") and self.runs:
                break
            if self.grants:
                break
        nd = rng.choice([A, B])
        if op == "submit":
            key = rng.choice([None, None, "k1", "k2"])
            spec: dict[str, Any] = {"w": rng.randint(0, 1)}
            if rng.random() < 0.1:
                spec["exclusiveToSubmitter"] = True
            return op, {"key": key, "spec": spec, "max_attempts": rng.randint(1, 3)}
        if op == "claim":
            self.last_node = nd
            only = rng.choice(self.runs) if self.runs and rng.random() < 0.2 else None
            return op, {"node_id": nd, "n": rng.randint(1, 3),
                        "ttl_s": rng.choice([1.0, 2.5, 4.0]), "only": only}
        if op == "renew":
            picks = rng.sample(self.grants, min(len(self.grants), rng.randint(0, 3)))
            return op, {"node_id": nd, "holds": [Held(r, e) for r, e, _ in picks],
                        "ttl_s": rng.choice([1.0, 2.5, 4.0])}
        if op == "advance":
            return op, {"seconds": rng.choice([0.25, 0.5, 1.5, 3.0])}
        if op == "release":
            r, e, n = self.grant()
            return op, {"run_id": r, "lease_epoch": e, "node_id": n,
                        "refund": rng.random() < 0.5, "backoff_s": rng.choice([0.0, 1.5])}
        if op == "reap":
            return op, {"n": rng.randint(1, 3)}
        if op == "cancel":
            return op, {"run_id": rng.choice(self.runs), "actor": "op"}
        if op == "faults":
            r, e, n = self.grant()
            return op, {"run_id": r, "lease_epoch": e, "node_id": n,
                        "faults": rng.sample(["fa", "fb", "fc"], rng.randint(1, 2))}
        if op == "sweep":
            return op, {"node_id": nd}
        if op == "read":
            return op, {"run_id": rng.choice(self.runs), "lease_epoch": rng.randint(0, 3),
                        "checkpoint_id": f"c{rng.randint(0, self.ckpts)}"}
        if op == "requeue":
            return op, {"run_id": rng.choice(self.runs), "actor": "op"}
        return op, {"commit": self.commit()}

    def commit(self) -> Commit:
        rng = self.rng
        r, e, n = self.grant()
        b = self.next_b.get((r, e), 1)
        count = rng.randint(0, 2)
        effects = [eff(k) for k in range(b, b + count)]
        if rng.random() < 0.1:
            effects.append(eff(max(1, b - 1), tag=rng.choice(["x", "y"])))  # duplicate/conflict
        self.next_b[(r, e)] = b + count
        top = b + count - 1
        checkpoint = None
        if rng.random() < 0.7:
            self.ckpts += 1
            boundary = max(0, top - (2 if rng.random() < 0.1 else 0))
            checkpoint = ckpt(f"c{self.ckpts}", boundary)
        finish = None
        if rng.random() < 0.15:
            state: TerminalState = rng.choice(["succeeded", "failed", "cancelled"])
            effects.append(finish_eff(state, top))
            finish = Finish(state, {"by": n})
        return Commit(r, e, n, effects=tuple(effects), checkpoint=checkpoint, finish=finish,
                      keep=rng.choice([1, 2, 3]))


async def apply_op(h: Harness, op: str, args: dict[str, Any]) -> Any:
    s = h.store
    try:
        if op == "submit":
            return norm(await s.submit(args["key"], args["spec"], args["max_attempts"]))
        if op == "claim":
            return norm(await s.claim(args["node_id"], args["n"], args["ttl_s"], args["only"]))
        if op == "renew":
            return norm(await s.renew(args["node_id"], args["holds"], args["ttl_s"]))
        if op == "advance":
            await h.advance(args["seconds"])
            return None
        if op == "release":
            return norm(await s.release(args["run_id"], args["lease_epoch"], args["node_id"],
                                        refund=args["refund"], backoff_s=args["backoff_s"]))
        if op == "reap":
            return norm(await s.reap(args["n"]))
        if op == "cancel":
            return norm(await s.cancel(args["run_id"], args["actor"]))
        if op == "faults":
            return norm(await s.mark_faults_fired(args["run_id"], args["lease_epoch"],
                                                  args["node_id"], args["faults"]))
        if op == "sweep":
            return norm(await s.own_grants(args["node_id"]))
        if op == "read":
            return norm(await s.read_run(args["run_id"], args["lease_epoch"],
                                         args["checkpoint_id"]))
        if op == "requeue":
            return await s.requeue(args["run_id"], args["actor"])
        return norm(await s.commit(args["commit"]))
    except StoreError as exc:
        return norm_error(exc)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_contract_random_histories_agree(seed: int, db_dsn: str) -> None:
    mem = await make_harness(None)
    pg = await make_harness(db_dsn)
    try:
        for harness in (mem, pg):
            await harness.store.register_node(node(A))
            await harness.store.register_node(node(B))
        history = History(seed)
        kinds: set[str] = set()
        for i in range(150):
            op, args = history.next_op()
            got_mem = await apply_op(mem, op, args)
            got_pg = await apply_op(pg, op, args)
            assert got_mem == got_pg, (seed, i, op, args)
            history.learn(op, got_mem)
            kinds.add(op if not isinstance(got_mem, list) or not got_mem
                      or not isinstance(got_mem[0], str) else got_mem[0])
        assert await mem.dump() == await pg.dump()
        assert {"claim", "commit", "Fenced"} <= kinds, kinds
    finally:
        await mem.close()
        await pg.close()
