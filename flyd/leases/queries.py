"""Read-only views of the queue for people and summaries (design/cli.md §4.2, §7.2, §7.4).

Why apart from the `Store`: the node's protocol statements (design/distribution.md §3) are what the
runtime may send; these reads serve `flyd run`'s summary, `flyctl runs list|show` and
`flyctl status`'s database view. They never take locks and never write. Rows come back as camelCase
dicts ready to print as JSON (design/cli.md §1), timestamps as ISO 8601 strings.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Mapping
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from flyd.leases.stores.contract import CanonicalPayload
from workers.types.canonical import canonical, digest_of

__all__ = ["LedgerFold", "attempts", "behaviour", "effects", "fold_ledger", "last_result",
           "list_runs", "nodes", "results", "run_row"]

#: Rows fetched per round trip when a run's ledger is folded.
FOLD_BATCH: Final = 100
#: Rows fetched per round trip when a run's results are exported.
RESULT_BATCH: Final = 500

Conn = psycopg.AsyncConnection[Any]


def _iso(value: Any) -> Any:
    return value.isoformat() if isinstance(value, datetime) else value


def _camel(row: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in row.items():
        head, *rest = key.split("_")
        out[head + "".join(p.title() for p in rest)] = _iso(value)
    return out


async def _rows(conn: Conn, query: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(query, params)
        return [dict(r) for r in await cur.fetchall()]


async def run_row(conn: Conn, run_id: int) -> dict[str, Any] | None:
    """One run with its head, or None."""
    rows = await _rows(conn, """
        SELECT r.run_id AS run, r.state::text AS state, r.lease_epoch, r.attempt, r.max_attempts,
               r.owner_node, r.lease_expires_at,
               CASE WHEN isfinite(r.not_before) THEN r.not_before END AS not_before,
               r.cancel_requested,
               r.faults_fired, r.outcome, r.spec, r.submit_key, r.submitted_at, r.finished_at,
               h.high_water, h.boundary
          FROM flyd.runs r LEFT JOIN flyd.run_heads h USING (run_id)
         WHERE r.run_id = %(run)s""", {"run": run_id})
    if not rows:
        return None
    return _camel(rows[0])


async def list_runs(conn: Conn, state: str | None = None) -> list[dict[str, Any]]:
    """design/cli.md §7.2 `runs list`: state, lease epoch, attempts, owner, expiry, boundary."""
    return [_camel(r) for r in await _rows(conn, """
        SELECT r.run_id AS run, r.state::text AS state, r.lease_epoch, r.attempt,
               r.max_attempts, r.owner_node, r.lease_expires_at, h.boundary
          FROM flyd.runs r LEFT JOIN flyd.run_heads h USING (run_id)
         WHERE %(state)s::text IS NULL OR r.state::text = %(state)s::text
         ORDER BY r.run_id""", {"state": state})]


async def attempts(conn: Conn, run_id: int) -> list[dict[str, Any]]:
    """The grant history of one run (`run_attempts`), oldest first."""
    return [_camel(r) for r in await _rows(conn, """
        SELECT lease_epoch, node_id, granted_at, ended_at, end_reason
          FROM flyd.run_attempts WHERE run_id = %(run)s ORDER BY lease_epoch""",
        {"run": run_id})]


async def effects(conn: Conn, run_id: int) -> list[dict[str, Any]]:
    """The run's ledger rows in key order of boundary (`finish` last)."""
    return [_camel(r) for r in await _rows(conn, """
        SELECT effect_key, lease_epoch, node_id, session_epoch, boundary, checkpoint_id,
               payload, encode(payload_digest, 'hex') AS payload_digest, recorded_at
          FROM flyd.effects WHERE run_id = %(run)s
         ORDER BY boundary NULLS LAST, effect_key""", {"run": run_id})]


def behaviour(rows: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """`(behaviourDigest, epochs)` of design/cli.md §4.2 from a run's effect rows: the digest of the
    boundary payloads in boundary order, and the raw session epochs in order of first boundary."""
    boundary_rows = [r for r in rows if r["boundary"] is not None]
    boundary_rows.sort(key=lambda r: int(r["boundary"]))
    epochs: list[str] = []
    for r in boundary_rows:
        label = f"e{r['sessionEpoch']}"
        if label not in epochs:
            epochs.append(label)
    return digest_of([r["payload"] for r in boundary_rows]), epochs


async def nodes(conn: Conn) -> list[dict[str, Any]]:
    """The node registry with liveness judged by the database clock."""
    return [_camel(r) for r in await _rows(conn, """
        SELECT node_id, node_name, host, pid, version, capacity, held, state, reason,
               started_at, heartbeat_at,
               extract(epoch FROM flyd.app_now() - heartbeat_at)::float8 AS silent_for_s
          FROM flyd.nodes ORDER BY node_id""", {})]


class LedgerFold:
    """A run's behaviour payloads folded in boundary order, without holding them: the running
    SHA-256 of their canonical JSON list (`digest()` = `digest_of(payloads)`), how many, and
    the raw session epochs in order of first boundary."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256(b"[")
        self.count = 0
        self.epochs: list[str] = []

    def add(self, session_epoch: int, payload: Mapping[str, Any]) -> None:
        data = payload.data if isinstance(payload, CanonicalPayload) else canonical(payload)
        self._hash.update(b"," + data if self.count else data)
        self.count += 1
        label = f"e{session_epoch}"
        if label not in self.epochs:
            self.epochs.append(label)

    def digest(self) -> str:
        h = self._hash.copy()
        h.update(b"]")
        return h.hexdigest()


async def fold_ledger(conn: Conn, run_id: int, through: int | None = None) -> LedgerFold:
    """The committed `boundary-<k>` rows with k ≤ `through` (all without it) folded in
    boundary order, read through a server-side cursor `FOLD_BATCH` rows at a time."""
    fold = LedgerFold()
    async with conn.transaction(), conn.cursor(name="flyd_ledger_fold") as cur:
        cur.itersize = FOLD_BATCH
        await cur.execute(
            "SELECT session_epoch, payload FROM flyd.effects WHERE run_id = %(run)s "
            "AND boundary IS NOT NULL AND (%(through)s::bigint IS NULL "
            "OR boundary <= %(through)s::bigint) ORDER BY boundary",
            {"run": run_id, "through": through})
        async for epoch, payload in cur:
            fold.add(int(epoch), payload)
    return fold


async def results(conn: Conn, run_id: int) -> AsyncIterator[tuple[int, dict[str, Any] | None]]:
    """`(boundary, result)` of the committed `boundary-<k>` rows in boundary order (`result`
    None on rows written before the ledger kept results), read through a server-side cursor
    `RESULT_BATCH` rows at a time."""
    async with conn.transaction(), conn.cursor(name="flyd_results") as cur:
        cur.itersize = RESULT_BATCH
        await cur.execute(
            "SELECT boundary, result FROM flyd.effects WHERE run_id = %(run)s "
            "AND boundary IS NOT NULL ORDER BY boundary", {"run": run_id})
        async for boundary, result in cur:
            yield int(boundary), result


async def last_result(conn: Conn, run_id: int) -> tuple[int, dict[str, Any] | None] | None:
    """The highest committed boundary and its result (None before results were kept); None
    when no boundary is committed."""
    cur = await conn.execute(
        "SELECT boundary, result FROM flyd.effects WHERE run_id = %(run)s "
        "AND boundary IS NOT NULL ORDER BY boundary DESC LIMIT 1", {"run": run_id})
    row = await cur.fetchone()
    return None if row is None else (int(row[0]), row[1])
