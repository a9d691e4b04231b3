"""A group commit of thousands of effects (issue 17 item 1): a forced capture with no cadence
commits `max_pending_effects` (4096) behaviour records of ~1 KB at once. It used to hang in
psycopg's pipeline over a Unix socket (the embedded server `flyd run` starts) and to spend
~0.6 ms of event-loop CPU per effect quoting a `jsonb[]`, so it timed out after C and the run
lost its lease on every attempt. Here it commits under the default parameters, over the
embedded server's Unix socket and over TCP, with every row as sent; its deadline grows with
its size and not below the base."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

import psycopg
import pytest

from flyd.leases.embedded import EmbeddedPostgres
from flyd.leases.params import LeaseParams
from flyd.leases.stores.contract import (
    BASE_COMMIT_BYTES,
    BASE_COMMIT_ROWS,
    CanonicalPayload,
    Commit,
    Effect,
    NodeInfo,
    commit_allowance_s,
)
from flyd.leases.stores.pg import PIPELINE_MAX_BYTES, DbSettings, PgStore
from workers.types.canonical import canonical

pytestmark = pytest.mark.timeout(180)

EFFECTS = 4096
NODE = "n-large"


def record(k: int) -> dict[str, Any]:
    """A behaviour record of about 1 KB, shaped like a two-agent session's."""
    agents = [{"agentId": a, "brainTicks": str(17 * k), "committedStep": str(k),
               "decisionDigest": hashlib.sha256(f"{a}{k}".encode()).hexdigest(),
               "profileDigest": hashlib.sha256(a.encode()).hexdigest(),
               "remainder": {"denominator": "3", "numerator": "2000000"},
               "ticksAdvanced": "16"} for a in ("fly-a", "fly-b")]
    return {"acknowledgedBoundary": str(k), "agents": agents, "batchId": f"batch-e1-{k - 1}",
            "boundaryActions": [], "controlDigest": hashlib.sha256(str(k).encode()).hexdigest(),
            "eventIds": [f"ev-{k:016x}"], "outcomeIds": [f"ev-{k:016x}"],
            "publishedBoundary": str(k),
            "scope": {"epoch": "e1", "sessionId": "demo", "step": str(k - 1)}}


def effects(n: int) -> tuple[Effect, ...]:
    out = []
    for k in range(1, n + 1):
        data = canonical(record(k))
        out.append(Effect(f"boundary-{k}", 1, k, CanonicalPayload(data),
                          hashlib.sha256(data).digest()))
    return tuple(out)


async def commit_all(dsn: str) -> None:
    """Commit `EFFECTS` effects in one group commit through `PgStore` with the default
    parameters, then read every row back."""
    batch = effects(EFFECTS)
    commit_size = Commit(1, 1, NODE, batch).size()
    assert commit_size[1] > 40 * PIPELINE_MAX_BYTES, "vacuity: a parameter of megabytes"
    store = PgStore(dsn, NODE, DbSettings(), LeaseParams())
    await store.open()
    try:
        await store.register_node(NodeInfo(NODE, "large", "h", os.getpid(), "0", 1))
        run = (await store.submit(None, {"steps": str(EFFECTS)}, 1)).run_id
        grant = (await store.claim(NODE, 1, 60.0, only=run))[0]
        done = await store.commit(Commit(run, grant.lease_epoch, NODE, batch))
        assert done.finished is None
    finally:
        await store.close()
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(
            "SELECT effect_key, boundary, payload, payload_digest FROM flyd.effects "
            "WHERE run_id = %s ORDER BY boundary", (run,))
        rows = await cur.fetchall()
    assert len(rows) == EFFECTS
    for (key, boundary, payload, digest), sent in zip(rows, batch, strict=True):
        assert (key, boundary, bytes(digest)) == (sent.key, sent.boundary, sent.digest)
        assert canonical(payload) == canonical(dict(sent.payload))


async def test_4096_effects_commit_whole_over_the_embedded_servers_unix_socket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    with tempfile.TemporaryDirectory(prefix="flyd-lc-") as tmp:
        server = EmbeddedPostgres()
        dsn = await server.start(Path(tmp))
        try:
            assert "host=/" in dsn, f"the embedded server is not on a Unix socket: {dsn}"
            await commit_all(dsn)
        finally:
            await server.stop()


async def test_4096_effects_commit_whole_over_tcp(db_dsn: str) -> None:
    await commit_all(db_dsn)


def test_the_deadline_grows_with_the_commit_beyond_the_base_only() -> None:
    assert commit_allowance_s(BASE_COMMIT_ROWS, BASE_COMMIT_BYTES) == 0
    assert commit_allowance_s(60, 60_000) == 0
    one = commit_allowance_s(2048, 2 << 20)
    two = commit_allowance_s(2 * 2048 - BASE_COMMIT_ROWS, (4 << 20) - BASE_COMMIT_BYTES)
    assert one > 0 and two == pytest.approx(2 * one)
    rows, size = Commit(1, 1, NODE, effects(EFFECTS)).size()
    assert rows == EFFECTS and 0.5 < commit_allowance_s(rows, size) < LeaseParams().T / 5
