"""Fixtures of the state suite's store and writer tests.

- `make_capture(id, boundary)` builds a valid checkpoint manifest and payloads (no agents: the
  world and the three coordinator payloads), so the store and writer are tested without workers.
- `claimed_run` (PostgreSQL) and `mem_run` (the in-memory lease store) create and claim a run at
  lease epoch 1 with a long TTL; `run_ctx` is parametrized over both (`pg`, `mem`). A `RunCtx`
  carries the lease store, the checkpoint store, the grant's `DirectCommitPath` and the
  backend-specific moves the tests need: `advance` (the `flyd.sim_clock` row or the
  `ManualClock`), `reclaim` (expire, then a claim by another node), raw row writes
  (`update_checkpoint_row`), and `open_then_expire` (the statements of a commit run, then the
  lease expires, then COMMIT).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from flyd.leases.clock import ManualClock
from flyd.leases.params import LeaseParams
from flyd.leases.stores import pg as pgstore
from flyd.leases.stores.contract import Checkpoint, Commit, Effect, LedgerImmutable, Store
from flyd.state.checkpoints import (
    CommitJob,
    DirectCommitPath,
    FinishRun,
    MemoryCheckpointStore,
    PgCheckpointStore,
)
from flyd.state.compat import STATE_FORMAT_ID
from flyd.state.envelope import encode
from tests.admin_store import AdminMemStore
from workers.types.canonical import canonical, digest_bytes, digest_of
from workers.types.ticks import RationalNs

BASE = datetime(2030, 1, 1, tzinfo=UTC)
NODE = "node-a-0000000000a1"
OTHER = "node-b-0000000000b2"
TTL = 3600.0
SESSION = "demo"

COMPAT: dict[str, str] = {
    "stateFormatId": STATE_FORMAT_ID,
    "backendDigest": "1" * 64,
    "contentDigest": "2" * 64,
    "patchDigest": "3" * 64,
    "controllerDigest": "4" * 64,
    "parserDigest": "5" * 64,
}


def make_capture(checkpoint_id: str, boundary: int, *, session_epoch: str = "e1",
                 world: bytes | None = None, session_id: str = SESSION, helpers: int = 0
                 ) -> tuple[dict[str, Any], list[tuple[str, bytes]]]:
    """A manifest that passes R7/R8 and its payloads in §2.5 order, with `helpers` helper
    payloads declared in `helperState`."""
    helper_names = [f"helper-{i}" for i in range(helpers)]
    payloads = [
        ("world", world if world is not None else f"world@{boundary}".encode()),
        ("task-ledger", canonical({"boundary": boundary})),
        ("prior-inspection", b"{}"),
        ("coordinator-admission", b"{}"),
        *((name, name.encode()) for name in helper_names),
    ]
    manifest: dict[str, Any] = {
        "envelopeVersion": 1,
        "checkpointId": checkpoint_id,
        "sourceScope": {"sessionId": session_id, "epoch": session_epoch, "step": str(boundary)},
        "episodeId": "ep-1",
        "worldTime": RationalNs(0).to_json(),
        "schedulerId": "lockstep-v1",
        "compositionDigest": "6" * 64,
        "portMap": [],
        "compatibility": dict(COMPAT),
        "agents": [],
        "environment": {"workerId": "arena", "payload": "world"},
        "helperState": helper_names,
        "coordinator": {
            "taskLedger": "task-ledger", "priorInspection": "prior-inspection",
            "executorState": [], "admissionState": "coordinator-admission",
            "eventWatermarks": {"lastSourceStep": "0", "issued": "0"},
        },
        "payloads": [{"name": n, "byteLength": str(len(b)), "digest": digest_bytes(b)}
                     for n, b in payloads],
    }
    return manifest, payloads


def behaviour(j: int) -> dict[str, Any]:
    """A stand-in behaviour record for boundary j (already rebased onto e1)."""
    return {"boundary": j, "epoch": "e1", "decision": f"d{j}"}


def effects_through(after: int, through: int, session_epoch: int = 1) -> tuple[Effect, ...]:
    return tuple(Effect(key=f"boundary-{j}", session_epoch=session_epoch, boundary=j,
                        payload=behaviour(j), digest=hashlib.sha256(canonical(behaviour(j))
                                                                    ).digest())
                 for j in range(after + 1, through + 1))


def make_job(run_id: int, lease_epoch: int, checkpoint_id: str, boundary: int, *,
             after: int = 0, keep: int = 3, finish: FinishRun | None = None,
             session_epoch: str = "e1") -> CommitJob:
    """A `CommitJob` with a real envelope and the effects (after, boundary]."""
    manifest, payloads = make_capture(checkpoint_id, boundary, session_epoch=session_epoch)
    envelope = encode(manifest, payloads)
    return CommitJob(run_id=run_id, lease_epoch=lease_epoch, checkpoint_id=checkpoint_id,
                     session_id=SESSION, session_epoch=session_epoch, episode_id="ep-1",
                     boundary=boundary, compatibility_digest=digest_of(COMPAT),
                     envelope=envelope, envelope_digest=hashlib.sha256(envelope).digest(),
                     effects=effects_through(after, boundary), keep=keep, finish=finish)


@dataclass
class RunCtx:
    kind: str
    lease: Store
    store: MemoryCheckpointStore | PgCheckpointStore
    run_id: int
    lease_epoch: int
    path: DirectCommitPath
    mem: AdminMemStore | None = None
    clock: ManualClock | None = None
    dsn: str | None = None
    admin: psycopg.AsyncConnection[Any] | None = None
    t: float = 0.0
    extra: list[Any] = field(default_factory=list)

    async def advance(self, seconds: float) -> None:
        self.t += seconds
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            assert self.admin is not None
            await self.admin.execute("UPDATE flyd.sim_clock SET t = %s",
                                     (BASE + timedelta(seconds=self.t),))

    async def reclaim(self) -> int:
        """Expire the grant and let another node claim it; the new lease epoch."""
        await self.advance(TTL + 1)
        [grant] = await self.lease.claim(OTHER, 1, TTL)
        return grant.lease_epoch

    async def update_checkpoint_row(self, checkpoint_id: str) -> str | None:
        """A raw UPDATE of a checkpoint row; the SQLSTATE that refused it (None: accepted)."""
        if self.mem is not None:
            try:
                self.mem.admin_update_checkpoint(self.run_id, checkpoint_id)
            except LedgerImmutable as exc:
                return exc.code
            return None
        assert self.admin is not None
        try:
            await self.admin.execute("UPDATE flyd.checkpoints SET node_id = 'x' "
                                     "WHERE run_id = %s AND checkpoint_id = %s",
                                     (self.run_id, checkpoint_id))
        except psycopg.Error as exc:
            return exc.sqlstate
        return None

    async def open_then_expire(self, commit: Commit) -> None:
        """Run the commit's statements, let the lease expire, then send COMMIT."""
        if self.mem is not None:
            handle = self.mem.open_commit(commit)
            await self.advance(TTL + 1)
            await handle.commit()
            return
        assert self.dsn is not None
        conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
        k = commit.checkpoint
        assert k is not None
        base: dict[str, Any] = {"run": commit.run_id, "epoch": commit.lease_epoch,
                                "node": commit.node_id, "ckpt": k.checkpoint_id}
        async with conn:
            await conn.execute("BEGIN")
            await conn.execute(pgstore.ASSERT_FENCE, base)
            await conn.execute(pgstore.INSERT_CHECKPOINT, {
                **base, "session_id": k.session_id, "session_epoch": k.session_epoch,
                "episode_id": k.episode_id, "boundary": k.boundary,
                "compat": k.compatibility_digest, "env_digest": k.envelope_digest,
                "byte_length": k.byte_length, "envelope": k.envelope})
            await conn.execute(pgstore.MOVE_HEAD, {**base, "boundary": k.boundary})
            await self.advance(TTL + 1)
            try:
                await conn.execute("COMMIT")
            except psycopg.Error as exc:
                raise pgstore.classify(exc, sent=True, backend=None, what="commit") from exc


class ExpiringPath(DirectCommitPath):
    """A grant whose lease runs out between the commit's statements and its COMMIT."""

    def __init__(self, ctx: RunCtx) -> None:
        super().__init__(ctx.lease, ctx.run_id, ctx.lease_epoch, NODE)
        self.ctx = ctx

    async def commit(self, effects: Sequence[Effect], checkpoint: Checkpoint | None = None
                     ) -> None:
        await self.ctx.open_then_expire(Commit(self.run_id, self.lease_epoch, self.node_id,
                                               tuple(effects), checkpoint))


async def _pg_ctx(db_dsn: str) -> AsyncIterator[RunCtx]:
    admin = await psycopg.AsyncConnection.connect(db_dsn, autocommit=True)
    await admin.execute("INSERT INTO flyd.sim_clock (t) VALUES (%s)", (BASE,))
    lease = pgstore.PgStore(db_dsn, NODE, pgstore.DbSettings(), LeaseParams())
    await lease.open()
    store = PgCheckpointStore(db_dsn)
    try:
        run_id = (await lease.submit(None, {}, 3)).run_id
        [grant] = await lease.claim(NODE, 1, TTL)
        yield RunCtx(kind="pg", lease=lease, store=store, run_id=run_id,
                     lease_epoch=grant.lease_epoch,
                     path=DirectCommitPath(lease, run_id, grant.lease_epoch, NODE),
                     dsn=db_dsn, admin=admin)
    finally:
        await store.close()
        await lease.close()
        await admin.close()


async def _mem_ctx() -> AsyncIterator[RunCtx]:
    clock = ManualClock()
    mem = AdminMemStore(clock.now, idle_in_transaction_timeout_s=0, epoch_base=BASE)
    run_id = (await mem.submit(None, {}, 3)).run_id
    [grant] = await mem.claim(NODE, 1, TTL)
    yield RunCtx(kind="mem", lease=mem, store=MemoryCheckpointStore(mem), run_id=run_id,
                 lease_epoch=grant.lease_epoch,
                 path=DirectCommitPath(mem, run_id, grant.lease_epoch, NODE), mem=mem,
                 clock=clock)


@pytest.fixture
async def claimed_run(db_dsn: str) -> AsyncIterator[RunCtx]:
    """A run claimed at lease epoch 1 (long TTL) on PostgreSQL with a sim clock row."""
    async for ctx in _pg_ctx(db_dsn):
        yield ctx


@pytest.fixture
async def mem_run() -> AsyncIterator[RunCtx]:
    """The same on the in-memory lease store (virtual clock)."""
    async for ctx in _mem_ctx():
        yield ctx


@pytest.fixture(params=["pg", "mem"])
async def run_ctx(request: pytest.FixtureRequest, db_dsn: str) -> AsyncIterator[RunCtx]:
    """`claimed_run` and `mem_run` in turn (the contract tests run on both stores)."""
    if request.param == "pg":
        async for ctx in _pg_ctx(db_dsn):
            yield ctx
    else:
        async for ctx in _mem_ctx():
            yield ctx


async def effect_rows(ctx: RunCtx) -> list[tuple[str, int, str | None]]:
    """(effect_key, lease_epoch, checkpoint_id) of the run's ledger, ordered by key."""
    if ctx.mem is not None:
        rows = [(e["effect_key"], e["lease_epoch"], e["checkpoint_id"])
                for e in ctx.mem.dump()["effects"] if e["run_id"] == ctx.run_id]
    else:
        assert ctx.admin is not None
        cur = await ctx.admin.execute("SELECT effect_key, lease_epoch, checkpoint_id "
                                      "FROM flyd.effects WHERE run_id = %s", (ctx.run_id,))
        rows = [(str(k), int(e), c) for k, e, c in await cur.fetchall()]
    return sorted(rows)


async def run_state(ctx: RunCtx) -> tuple[str, Mapping[str, Any] | None]:
    if ctx.mem is not None:
        [row] = [r for r in ctx.mem.dump()["runs"] if r["run_id"] == ctx.run_id]
        return str(row["state"]), row["outcome"]
    assert ctx.admin is not None
    cur = await ctx.admin.execute("SELECT state::text, outcome FROM flyd.runs WHERE run_id = %s",
                                  (ctx.run_id,))
    found = await cur.fetchone()
    assert found is not None
    return str(found[0]), found[1]
