"""`PgStore`: the statements of design/distribution.md §3 on PostgreSQL (psycopg 3 async,
psycopg_pool).

Rules:
- The SQL is design/distribution.md §3's, verbatim, except the `picked` step of the claim (3.3),
  which finds the same rows in the same order with the same locks without walking held runs
  (docs/leases.md, "Claim order"; migration 0004 adds its index), and the reap (3.7), which also
  ends a submitter-exclusive run whose submitter's node is gone (docs/leases.md, "Reap"); every
  method is one round trip (the group commit is one pipeline), READ COMMITTED, autocommit
  unless written as a transaction.
- Connections (design/distribution.md §5.3): a work pool (`:work`), a dedicated heartbeat connection
  (`:heartbeat`, statement timeout R) for renew and node registration, closed after any failure and
  reconnected by `reconnect_heartbeat()` (the node calls it right after an abandoned renewal)
  or, failing that, lazily by the next call, and a dedicated listener connection (`:listen`)
  per `listen()` iterator. Each work connection records its `Backend` (pid, backend_start)
  when it opens, so an unknown commit names the session to end (design/distribution.md §3.10).
- A work call first takes a live session: a pooled one that answers an empty statement. A dead
  one (a PostgreSQL blip ended it) is closed and handed back, the pool opens a replacement at
  once, and the next is tried. Taking a session is bounded by half of C (never more than the
  call's own bound) and, when that runs out, is `Transient` (`PoolTimeout`, nothing was sent):
  the node's own bound on a commit is C in loop time, unscaled, so without the shorter bound a
  commit still waiting for the pool to reconnect would end on the node's bound, an unknown
  outcome with no backend, and count as a lost lease. Likewise a heartbeat statement that
  finds its (reused) session lost is sent once more on a new session within its bound R:
  otherwise a session reconnected during a blip and ended by the blip's next round would
  cost the next renewal too, and renewals one H apart could each meet a dead session until
  the holds pass safe_until.
- Errors are classified by `sqlstate`, never by message text: LF001..LF004 map to their typed
  errors; 23505 on `effects_pkey` is classified by reading the existing rows in a new call
  after the failed transaction was rolled back (design/distribution.md §6.4); any other server error
  with the session still up is `Transient` (not committed, for certain, COMMIT included). A lost
  session (class 08, 57P01..57P03, a broken socket) or a call that overran its client bound
  is `Transient` if the writing statement (the COMMIT of a transaction, the statement itself
  in autocommit) was not yet sent, else `UnknownOutcome` carrying the backend; reads are
  always `Transient`. 25P03 is `Transient`: the server ended the transaction it names.
- The pipeline's own COMMIT is its last statement; psycopg logs a warning ("error ignored
  terminating ... pipeline aborted") when a statement before it failed, which is expected.
- A connection whose call timed out, was cancelled or ended unknown is closed, never pooled.
  psycopg, when cancelled mid-query, would send a server-side cancel and wait up to 10 s for
  it; the connection class here instead closes the socket at once and re-raises, so a
  cancelled call returns within the caller's deadline. `CancelledError` is always re-raised.

Decisions where the spec is silent:
- Client bounds: every work call is bounded by C (`commit_timeout_s`), renew and node
  registration by R including a lazy reconnect, `reconnect_heartbeat()` by R on its own, the
  pool wait included; all divided by
  `time_scale` like the server-side timeouts (design/distribution.md §4.2), floor 50 ms.
- Scaling (design/distribution.md §4.2): the scaled durations are S (or R for the heartbeat
  session), I, the lock timeout, `tcp_user_timeout` (both sides), the keepalive idle/interval times
  (both sides) and `client_connection_check_interval`. Millisecond settings are divided and floored
  at 50 ms; second settings (libpq and `tcp_keepalives_*` are whole seconds) are divided and
  rounded up, at least 1 s. A value of 0 ("off"/"system default") stays 0. With
  `time_scale == 1` every value is sent as configured.
- `DbSettings` is `[database]` less `dsn`, built by the configuration (`flyd.config`, which
  checks every key); `time_scale` is not a TOML key: the tier-2 harness sets it in code.
- 23505 on `effects_pkey`: among the commit's keys already stored, the first whose digest
  differs is reported as `ConflictingEffect`, else the first as `DuplicateEffect`; a key
  repeated inside one commit is classified against its earlier copy in that commit.
- `listen()` probes its connection (bound R) after each quiet period of `claim_poll_s`, so a
  dead listener ends the iterator (`Transient`) rather than waiting forever; losing it only
  slows wake-ups (design/distribution.md §5.3). The probe reads when another node's reclaimable
  lease expires next (database time, divided by `time_scale`); when that is within `claim_poll_s`,
  the listener waits exactly that long (plus 10 ms) and yields that run id, so the claimer tries the
  reclaim at the expiry instead of up to one poll period later. The wake-up only triggers a claim,
  which decides expiry in SQL as always (R1): a lease renewed meanwhile is simply not granted.
- The heartbeat session never prepares its statements (`prepare_threshold=None`): psycopg
  would prepare renew on its sixth run, and preparing is a round trip of its own (Parse, wait,
  then Bind/Execute), so that one renewal would need two round trips inside R. A renew costs
  the server little to plan; one round trip per renewal, always, is what R is sized for.
- A group commit whose envelope exceeds `PIPELINE_MAX_BYTES` (64 KiB) sends its statements one
  round trip each instead of as one pipeline: psycopg's async pipeline stops sending a large
  parameter part-way (the server waits in `ClientRead`, the client waits for results; a 64 MiB
  envelope hangs every time, psycopg issue 685), so the commit would time out and its retries
  with it. Those few extra round trips are small beside the transfer of such an envelope.
- A commit carrying only `finish_run` (no effects, no checkpoint) skips `assert_fence`:
  `finish_run` fences itself and answers `'already'` for a run already terminal in that state
  at that epoch (design/distribution.md §3.5), which a fenced transaction could never report.
- Operator requeue records `{"fromState": "failed", "leaseEpoch": e}` as its detail.

Checkpoint reads (design/state.md §4.2) and reads that outlive their connection:
- `read_checkpoints` and `read_head` run on a session of their own, `:checkpoints`, opened
  lazily (the raw DSN with that application name, as an operator and the blip tests see it),
  through a `ReadConnection` bounded by `CHECKPOINT_READ_S`: a PostgreSQL blip (a server
  restart, a failover, an operator's `pg_terminate_backend`) ends every session at once, and a
  long-lived connection simply reused afterwards would fail a grant's first head read or a
  recovery's read although the database answers again a moment later. Their failures are
  `Transient`. `import_checkpoint` is one work-pool transaction; the lease-epoch-0 fence
  (`flyd.fence_row`) refuses a run that has been granted (LF001, `Fenced`).
- `ReadConnection.read(op, what)` runs `op` on one long-lived autocommit connection (opened
  lazily; closed after any failure, so the next use reconnects). While the session is lost
  (`session_lost`) it reconnects and repeats `op`, `BACKOFF_S` doubling to `BACKOFF_MAX_S`
  apart, logging `db.read_retry` with `what`, until `within_s` has passed since the read
  began; then the last error stands. Each try is bounded by what is left of `within_s`; tries
  are serialised by a lock, the backoff sleeps outside it. Only idempotent reads may be
  passed: a write repeated after a lost reply could apply twice. A cancelled read never
  retries, even when the cancellation came out of a try as another error (`flyd.cancel`).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing, asynccontextmanager, nullcontext
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import Any, Final, Literal, Self, TypeVar, cast

import psycopg
import structlog
from psycopg import waiting
from psycopg.abc import PQGen
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from flyd.cancel import raise_if_cancelled
from flyd.leases.fit import WORKER_THREADS_SQL, Fit
from flyd.leases.params import LeaseParams
from flyd.leases.stores.contract import (
    IMPORT_NODE,
    Backend,
    Cancelled,
    Committed,
    ConflictingEffect,
    DuplicateEffect,
    Fenced,
    Grant,
    HeadRegression,
    Held,
    Import,
    LedgerImmutable,
    NodeInfo,
    NodeState,
    Reaped,
    Released,
    Renewed,
    RunRead,
    RunState,
    SpecMismatch,
    StoredCheckpoint,
    StoreError,
    Submitted,
    TerminalFinal,
    TerminalState,
    Transient,
    UnknownOutcome,
    commit_allowance_s,
    payload_document,
    result_document,
)
from flyd.leases.stores.contract import Commit as CommitRequest

__all__ = ["DbSettings", "PgStore", "ReadConnection", "Role", "classify", "conninfo",
           "session_lost"]

T = TypeVar("T")
Role = Literal["work", "heartbeat", "listen"]
ROLES: Final = ("work", "heartbeat", "listen")
SCALE_FLOOR_MS: Final = 50
#: The largest envelope a group commit sends as one pipeline (module decisions).
PIPELINE_MAX_BYTES: Final = 64 * 1024
LOST_SESSION: Final = frozenset({"57P01", "57P02", "57P03"})
EXPIRY_SLACK_S: Final = 0.01         # the listener's wake-up after a lease's expiry
EFFECTS_PKEY: Final = "effects_pkey"
#: `ReadConnection`'s retry backoff and the bound on a checkpoint read (module rules)
BACKOFF_S: Final = 0.05
BACKOFF_MAX_S: Final = 1.0
CHECKPOINT_READ_S: Final = 5.0

log = structlog.get_logger("flyd.leases.stores.pg")

# --------------------------------------------------------------------------------------------
# Settings and conninfo


@dataclass(frozen=True, slots=True)
class DbSettings:
    """`[database]` of design/cli.md §2.3 (except `dsn`), plus the harness's `time_scale`
    (design/distribution.md §4.2)."""

    statement_timeout_ms: int = 2000
    idle_in_transaction_timeout_ms: int = 1500
    lock_timeout_ms: int = 1000
    connect_timeout_s: int = 2
    keepalives: int = 1
    keepalives_idle_s: int = 5
    keepalives_interval_s: int = 1
    keepalives_count: int = 3
    tcp_user_timeout_ms: int = 4000
    server_keepalives_idle_s: int = 5
    server_keepalives_interval_s: int = 1
    server_keepalives_count: int = 3
    server_tcp_user_timeout_ms: int = 4000
    client_connection_check_interval_ms: int = 1000
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise ValueError(f"time_scale must be a finite number > 0, not {self.time_scale!r}")



def _scaled_ms(ms: float, scale: float) -> int:
    """design/distribution.md §4.2: a millisecond duration enforced outside flyd's clock; 0 (off)
    stays 0."""
    if ms == 0 or scale == 1:
        return round(ms)
    return max(SCALE_FLOOR_MS, round(ms / scale))


def _scaled_s(s: int, scale: float) -> int:
    """A whole-second setting: divided, rounded up, at least 1 s (0 would mean "default")."""
    if s == 0 or scale == 1:
        return s
    return max(1, math.ceil(s / scale))


def conninfo(dsn: str, node_id: str, role: Role, settings: DbSettings,
             statement_timeout_ms: float | None = None) -> str:
    """design/distribution.md §5.3 conninfo for one session: application name, read-write target,
    the client keepalive settings and `options` carrying the server settings of
    design/distribution.md §4.2.

    `statement_timeout_ms` overrides S (the heartbeat session passes R). Options already in
    `dsn` are kept, ahead of ours."""
    if role not in ROLES:
        raise ValueError(f"unknown connection role {role!r}")
    k = settings.time_scale
    stmt = settings.statement_timeout_ms if statement_timeout_ms is None else statement_timeout_ms
    server = {
        "statement_timeout": _scaled_ms(stmt, k),
        "idle_in_transaction_session_timeout": _scaled_ms(
            settings.idle_in_transaction_timeout_ms, k),
        "lock_timeout": _scaled_ms(settings.lock_timeout_ms, k),
        "tcp_keepalives_idle": _scaled_s(settings.server_keepalives_idle_s, k),
        "tcp_keepalives_interval": _scaled_s(settings.server_keepalives_interval_s, k),
        "tcp_keepalives_count": settings.server_keepalives_count,
        "tcp_user_timeout": _scaled_ms(settings.server_tcp_user_timeout_ms, k),
        "client_connection_check_interval": _scaled_ms(
            settings.client_connection_check_interval_ms, k),
    }
    ours = " ".join(f"-c {name}={value}" for name, value in server.items())
    given = conninfo_to_dict(dsn).get("options")
    params: dict[str, Any] = {
        "application_name": f"flyd:{node_id}:{role}",
        "target_session_attrs": "read-write",
        "keepalives": settings.keepalives,
        "keepalives_idle": _scaled_s(settings.keepalives_idle_s, k),
        "keepalives_interval": _scaled_s(settings.keepalives_interval_s, k),
        "keepalives_count": settings.keepalives_count,
        "tcp_user_timeout": _scaled_ms(settings.tcp_user_timeout_ms, k),
        "options": f"{given} {ours}" if given else ours,
    }
    if k == 1 and settings.connect_timeout_s > 0:
        params["connect_timeout"] = settings.connect_timeout_s
    return make_conninfo(dsn, **params)


# --------------------------------------------------------------------------------------------
# Error classification


def session_lost(exc: BaseException) -> bool:
    """The session ended or never answered: class 08 and 57P01..57P03 (the server ended it), a
    client-side error without a SQLSTATE, a broken socket, a bound that ran out. A server
    error on a live session is not: repeating the statement would fail the same way."""
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate
        return state is None or state.startswith("08") or state in LOST_SESSION
    return isinstance(exc, TimeoutError | OSError)


def classify(exc: BaseException, *, sent: bool, backend: Backend | None,
             what: str) -> StoreError:
    """Map a failure of one call to the store's typed error (module rules).

    `sent`: the writing statement may have reached the server (its outcome is unknown if the
    session is lost). 23505 on `effects_pkey` needs a read and is handled by the caller."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, psycopg.Error):
        state = exc.sqlstate
        msg = f"{what}: {exc}"
        typed: dict[str, type[StoreError]] = {
            "LF001": Fenced, "LF002": HeadRegression, "LF003": TerminalFinal,
            "LF004": LedgerImmutable,
        }
        if state in typed:
            return typed[state](msg)
        if state == "25P03":
            return Transient(msg)
        lost = (state is not None and (state.startswith("08") or state in LOST_SESSION)) \
            or state is None
        if lost and sent:
            return UnknownOutcome(msg, backend)
        return Transient(msg)
    if isinstance(exc, TimeoutError | PoolTimeout | OSError):
        what_ = f"{what}: {type(exc).__name__}: {exc}"
        return UnknownOutcome(what_, backend) if sent else Transient(what_)
    raise TypeError(f"not a store failure: {exc!r}") from exc


# --------------------------------------------------------------------------------------------
# Connections


class ClosingConnection(psycopg.AsyncConnection[TupleRow]):
    """A connection that, when its call is cancelled, closes at once instead of asking the
    server to cancel and waiting for it (psycopg's default, up to 10 s)."""

    backend: Backend | None = None

    async def wait(self, gen: PQGen[T], interval: float = 0.1,
                   timeout: float | None = None) -> T:  # noqa: ASYNC109 (psycopg's signature)
        try:
            return await waiting.wait_async(gen, self.pgconn.socket, interval=interval,
                                            timeout=timeout)
        except asyncio.CancelledError:
            await self.close()
            raise


async def _record_backend(conn: ClosingConnection) -> None:
    """Pool `configure`: pid and backend_start of the session (design/distribution.md §3.10 guards
    pid reuse)."""
    cur = await conn.execute(
        "SELECT pid, backend_start FROM pg_stat_activity WHERE pid = pg_backend_pid()")
    row = await cur.fetchone()
    if row is None:
        raise psycopg.OperationalError("own backend missing from pg_stat_activity")
    conn.backend = Backend(pid=int(row[0]), backend_start=cast(datetime, row[1]))


class ReadConnection:
    """One lazily opened autocommit connection for idempotent reads (module rules)."""

    def __init__(self, dsn: str, *, within_s: float, application_name: str | None = None
                 ) -> None:
        self._dsn = dsn
        self.within_s = within_s
        self._names: dict[str, Any] = {} if application_name is None else {
            "application_name": application_name}
        self._conn: ClosingConnection | None = None
        self._lock = asyncio.Lock()

    async def close(self) -> None:
        """Close the connection, if open; a later `read` opens a new one."""
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close()

    async def read(self, op: Callable[[ClosingConnection], Awaitable[T]], what: str) -> T:
        """`op`'s result, `op` repeated on a new connection while the session is lost, for at
        most `within_s` (module rules); `what` names the read in the retry log."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.within_s
        delay = BACKOFF_S
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    return await self._try(op)
            except (psycopg.Error, TimeoutError, OSError) as exc:
                raise_if_cancelled()
                if not session_lost(exc) or loop.time() + delay >= deadline:
                    raise
                log.warning("db.read_retry", what=what, error=f"{type(exc).__name__}: {exc}",
                            retry_in_s=delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, BACKOFF_MAX_S)

    async def _try(self, op: Callable[[ClosingConnection], Awaitable[T]]) -> T:
        async with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = await ClosingConnection.connect(self._dsn, autocommit=True,
                                                                    **self._names)
            try:
                return await op(conn)
            except BaseException:
                self._conn = None
                await conn.close()
                raise


def _bound_s(seconds: float, scale: float) -> float:
    return max(SCALE_FLOOR_MS / 1000, seconds / scale)


# --------------------------------------------------------------------------------------------
# SQL of design/distribution.md §3 (verbatim)

REGISTER_NODE: Final = """
INSERT INTO flyd.nodes (node_id, node_name, host, pid, version, capacity)
VALUES (%(node)s, %(name)s, %(host)s, %(pid)s, %(version)s, %(capacity)s)
ON CONFLICT (node_id) DO UPDATE SET state = 'active', reason = NULL,
                                    heartbeat_at = flyd.app_now()
"""

SET_NODE_STATE: Final = """
UPDATE flyd.nodes
   SET state = %(state)s, held = CASE WHEN %(state)s = 'stopped' THEN 0 ELSE held END,
       reason = %(reason)s
 WHERE node_id = %(node)s
"""

SUBMIT: Final = """
WITH ins AS (
  INSERT INTO flyd.runs (submit_key, spec, max_attempts)
  VALUES (%(key)s, %(spec)s, %(max_attempts)s)
  ON CONFLICT (submit_key) DO NOTHING
  RETURNING run_id, true AS created, true AS same_spec
)
SELECT run_id, created, same_spec FROM ins
UNION ALL
SELECT run_id, false, spec = %(spec)s FROM flyd.runs
 WHERE submit_key = %(key)s AND NOT EXISTS (SELECT 1 FROM ins);
"""

# design/distribution.md §3.3 with its `picked` rewritten (docs/leases.md, "Claim order"): the same
# rows, locked the same way and in the same order, found without visiting held runs. `candidate`
# yields the claimable run ids of the statement's snapshot in ascending order, one index probe each
# (`runs_claim_order` for pending runs, the few expired ones from `runs_leased`), and is read
# lazily; each candidate is re-checked against design/distribution.md §3.3's predicate and locked
# with FOR UPDATE SKIP LOCKED in the lateral subquery, and LIMIT stops the walk after n locked rows.
# No ORDER BY on `picked`: an explicit sort would lock every candidate before limiting. The re-check
# also requires `attempt < max_attempts` of a pending run (docs/leases.md, "Attempts"): a run is
# never granted beyond its own budget, whatever handed it back. The claim returns `max_attempts`
# too, so the node compares with the run's budget, not its own `[leases] max_attempts`.
CLAIM: Final = """
WITH RECURSIVE expired AS MATERIALIZED (
  SELECT coalesce(array_agg(run_id ORDER BY run_id), '{}') AS ids
    FROM flyd.runs
   WHERE state = 'running' AND lease_expires_at <= flyd.app_now()
     AND attempt < max_attempts AND NOT cancel_requested
     AND (%(only)s::bigint IS NULL OR run_id = %(only)s::bigint)
), candidate (run_id) AS (
  SELECT least((SELECT min(run_id) FROM flyd.runs
                 WHERE state = 'pending' AND not_before <= flyd.app_now()
                   AND (%(only)s::bigint IS NULL OR run_id = %(only)s::bigint)),
               (SELECT min(x) FROM expired, unnest(expired.ids) AS x))
  UNION ALL
  SELECT least((SELECT min(r.run_id) FROM flyd.runs r
                 WHERE r.state = 'pending' AND r.not_before <= flyd.app_now()
                   AND (%(only)s::bigint IS NULL OR r.run_id = %(only)s::bigint)
                   AND r.run_id > c.run_id),
               (SELECT min(x) FROM expired, unnest(expired.ids) AS x WHERE x > c.run_id))
    FROM candidate c
   WHERE c.run_id IS NOT NULL
), picked AS MATERIALIZED (
  SELECT l.run_id, l.prev_state, l.prev_expiry, l.need
    FROM candidate c
   CROSS JOIN LATERAL (
     SELECT run_id, state AS prev_state, lease_expires_at AS prev_expiry,
            %(per_run)s::bigint + @NEED@ AS need
       FROM flyd.runs
      WHERE run_id = c.run_id
        AND ((state = 'pending' AND not_before <= flyd.app_now()
              AND attempt < max_attempts)
          OR (state = 'running' AND lease_expires_at <= flyd.app_now()
              AND attempt < max_attempts AND NOT cancel_requested))
        AND CASE WHEN %(only)s::bigint IS NULL
                 THEN NOT coalesce(spec -> 'exclusiveToSubmitter' = 'true'::jsonb, false)
                 ELSE run_id = %(only)s::bigint END
        AND (%(room)s::bigint IS NULL OR %(per_run)s::bigint + @NEED@ <= %(room)s::bigint)
      FOR UPDATE SKIP LOCKED) l
   LIMIT %(n)s
), fitted AS (
  SELECT q.run_id, q.prev_state, q.prev_expiry
    FROM (SELECT p.*, sum(p.need) OVER (ORDER BY p.run_id) AS used FROM picked p) q
   WHERE %(room)s::bigint IS NULL OR q.used <= %(room)s::bigint
), granted AS (
  UPDATE flyd.runs r
     SET state = 'running', lease_epoch = r.lease_epoch + 1, attempt = r.attempt + 1,
         owner_node = %(node)s,
         lease_expires_at = flyd.app_now() + make_interval(secs => %(ttl)s)
    FROM fitted p
   WHERE r.run_id = p.run_id
  RETURNING r.run_id, r.lease_epoch, r.lease_expires_at, r.attempt, r.cancel_requested, r.spec,
            r.faults_fired, r.max_attempts
), closed AS (
  UPDATE flyd.run_attempts a
     SET ended_at = p.prev_expiry, end_reason = 'expired'
    FROM fitted p JOIN granted g USING (run_id)
   WHERE p.prev_state = 'running' AND a.run_id = g.run_id AND a.lease_epoch = g.lease_epoch - 1
), opened AS (
  INSERT INTO flyd.run_attempts (run_id, lease_epoch, node_id, granted_at)
  SELECT run_id, lease_epoch, %(node)s, flyd.app_now() FROM granted
)
SELECT g.run_id, g.lease_epoch, g.lease_expires_at, g.attempt, g.cancel_requested, g.spec,
       g.faults_fired, h.high_water, h.boundary, g.max_attempts
  FROM granted g JOIN flyd.run_heads h USING (run_id);
""".replace("@NEED@", WORKER_THREADS_SQL)

RENEW: Final = """
WITH beat AS (
  UPDATE flyd.nodes
     SET heartbeat_at = flyd.app_now(), held = cardinality(%(ids)s::bigint[])
   WHERE node_id = %(node)s
)
UPDATE flyd.runs r
   SET lease_expires_at = flyd.app_now() + make_interval(secs => %(ttl)s)
  FROM unnest(%(ids)s::bigint[], %(epochs)s::bigint[]) AS h(run_id, lease_epoch)
 WHERE r.run_id = h.run_id AND r.lease_epoch = h.lease_epoch
   AND r.state = 'running' AND r.owner_node = %(node)s
   AND r.lease_expires_at > flyd.app_now()
RETURNING r.run_id, r.lease_epoch, r.lease_expires_at, r.cancel_requested;
"""

ASSERT_FENCE: Final = "SELECT flyd.assert_fence(%(run)s, %(epoch)s);"

INSERT_CHECKPOINT: Final = """
INSERT INTO flyd.checkpoints (run_id, checkpoint_id, lease_epoch, node_id, session_id, session_epoch,
                              episode_id, boundary, compatibility_digest, envelope_digest,
                              byte_length, envelope)
VALUES (%(run)s, %(ckpt)s, %(epoch)s, %(node)s, %(session_id)s, %(session_epoch)s,
        %(episode_id)s, %(boundary)s, %(compat)s, %(env_digest)s, %(byte_length)s, %(envelope)s);
"""  # noqa: E501 (verbatim design/distribution.md §3)

# design/distribution.md §3.5's effect insert with the payloads as one JSON array
# (`payload_document`) instead of a `jsonb[]` (module decisions, "Large group commits"): the same
# rows, in one statement. The four arrays go in binary format (`%(…)b`): the text format quotes
# every element through a regular expression, several times the cost of the binary dump. The results
# ride along as a second JSON array (`result_document`, JSON null → SQL NULL), so the export's lines
# are written by the very statement that writes their ledger rows.
INSERT_EFFECTS: Final = """
INSERT INTO flyd.effects (run_id, effect_key, lease_epoch, node_id, session_epoch, boundary,
                          checkpoint_id, payload, payload_digest, result)
SELECT %(run)s, e.key, %(epoch)s, %(node)s, e.session_epoch, e.boundary, %(ckpt)s, p.payload,
       e.digest, NULLIF(r.result, 'null'::jsonb)
  FROM unnest(%(keys)b::text[], %(session_epochs)b::bigint[], %(boundaries)b::bigint[],
              %(digests)b::bytea[]) WITH ORDINALITY AS e(key, session_epoch, boundary, digest, i)
  JOIN jsonb_array_elements(%(payloads)s::jsonb) WITH ORDINALITY AS p(payload, i) USING (i)
  JOIN jsonb_array_elements(%(results)s::jsonb) WITH ORDINALITY AS r(result, i) USING (i);
"""

MOVE_HEAD: Final = """
UPDATE flyd.run_heads SET high_water = %(ckpt)s, boundary = %(boundary)s, lease_epoch = %(epoch)s
 WHERE run_id = %(run)s;
"""

ROTATE: Final = """
DELETE FROM flyd.checkpoints
 WHERE run_id = %(run)s
   AND checkpoint_id <> %(ckpt)s
   AND checkpoint_id NOT IN (SELECT checkpoint_id FROM flyd.checkpoints
                              WHERE run_id = %(run)s AND checkpoint_id <> %(ckpt)s
                              ORDER BY boundary DESC, committed_at DESC, checkpoint_id DESC
                              LIMIT %(keep)s - 1);
"""

FINISH_RUN: Final = "SELECT flyd.finish_run(%(run)s, %(epoch)s, %(state)s, %(outcome)s);"

EXISTING_EFFECTS: Final = """
SELECT effect_key, lease_epoch, payload_digest FROM flyd.effects
 WHERE run_id = %(run)s AND effect_key = ANY(%(keys)s::text[])
"""

RELEASE: Final = """
WITH rel AS (
  UPDATE flyd.runs
     SET state = 'pending', owner_node = NULL, lease_expires_at = NULL,
         attempt = attempt - CASE WHEN %(refund)s THEN 1 ELSE 0 END,
         not_before = flyd.app_now() + make_interval(secs => %(backoff)s)
   WHERE run_id = %(run)s AND lease_epoch = %(epoch)s
     AND state = 'running' AND owner_node = %(node)s
  RETURNING run_id, lease_epoch
)
UPDATE flyd.run_attempts a
   SET ended_at = flyd.app_now(), end_reason = 'released'
  FROM rel
 WHERE a.run_id = rel.run_id AND a.lease_epoch = rel.lease_epoch
RETURNING a.run_id, a.lease_epoch;
"""

# design/distribution.md §3.7 with one more case (docs/leases.md, "Reap"): a submitter-exclusive run
# whose lease expired while its submitter's node is gone (no registry row, `stopped`, or no
# heartbeat for `stale` seconds) can be taken by no node, so it is failed
# `{error: "submitter gone"}`.
REAP: Final = """
WITH picked AS MATERIALIZED (
  SELECT run_id, lease_expires_at AS prev_expiry, cancel_requested AS cancelled,
         attempt >= max_attempts AS exhausted
    FROM flyd.runs r
   WHERE state = 'running' AND lease_expires_at <= flyd.app_now()
     AND (attempt >= max_attempts OR cancel_requested
          OR (coalesce(spec -> 'exclusiveToSubmitter' = 'true'::jsonb, false)
              AND NOT EXISTS (
                SELECT 1 FROM flyd.nodes n
                 WHERE n.node_id = r.owner_node AND n.state <> 'stopped'
                   AND n.heartbeat_at > flyd.app_now() - make_interval(secs => %(stale)s))))
   ORDER BY run_id LIMIT %(n)s
   FOR UPDATE SKIP LOCKED
), dead AS (
  UPDATE flyd.runs r
     SET state = CASE WHEN p.cancelled THEN 'cancelled' ELSE 'failed' END::flyd.run_state,
         lease_epoch = r.lease_epoch + 1, owner_node = NULL, lease_expires_at = NULL,
         finished_at = flyd.app_now(),
         outcome = CASE WHEN p.cancelled
                        THEN jsonb_build_object('reaped', 'cancel requested, holder gone')
                        WHEN p.exhausted
                        THEN jsonb_build_object('reaped', 'attempts exhausted')
                        ELSE jsonb_build_object('error', 'submitter gone') END
    FROM picked p
   WHERE r.run_id = p.run_id
  RETURNING r.run_id, r.lease_epoch, r.state, p.prev_expiry, p.cancelled
)
UPDATE flyd.run_attempts a
   SET ended_at = d.prev_expiry,
       end_reason = CASE WHEN d.cancelled THEN 'cancelled' ELSE 'exhausted' END
  FROM dead d
 WHERE a.run_id = d.run_id AND a.lease_epoch = d.lease_epoch - 1
RETURNING a.run_id, d.lease_epoch, d.state;
"""

CANCEL: Final = """
UPDATE flyd.runs
   SET cancel_requested = true,
       state       = CASE WHEN state = 'pending' THEN 'cancelled' ELSE state END::flyd.run_state,
       finished_at = CASE WHEN state = 'pending' THEN flyd.app_now() END,
       outcome     = CASE WHEN state = 'pending'
                          THEN jsonb_build_object('cancelledBy', %(actor)s::text) END
 WHERE run_id = %(run)s AND state IN ('pending', 'running')
RETURNING run_id, state;
"""

OWN_GRANTS: Final = """
SELECT run_id, lease_epoch FROM flyd.runs WHERE state = 'running' AND owner_node = %(node)s
"""

END_BACKEND: Final = """
SELECT pg_terminate_backend(pid, %(wait_ms)s)
  FROM pg_stat_activity WHERE pid = %(pid)s AND backend_start = %(backend_start)s;
"""

READ_RUN: Final = """
SELECT r.state, r.lease_epoch, r.owner_node,
       coalesce(r.lease_expires_at > flyd.app_now(), false) AS live,
       h.high_water, h.boundary,
       EXISTS (SELECT 1 FROM flyd.checkpoints c WHERE c.run_id = r.run_id
                  AND c.checkpoint_id = %(ckpt)s AND c.lease_epoch = %(epoch)s) AS checkpoint_committed
  FROM flyd.runs r JOIN flyd.run_heads h USING (run_id)
 WHERE r.run_id = %(run)s;
"""  # noqa: E501 (verbatim design/distribution.md §3)

# the checkpoint reads and the import of design/state.md §4.2 and §4.7 (no statement of
# design/distribution.md §3)
CHECKPOINT_ROWS: Final = """
SELECT c.run_id, c.checkpoint_id, c.lease_epoch, c.node_id, c.session_id, c.session_epoch,
       c.episode_id, c.boundary, c.compatibility_digest, c.envelope_digest, c.byte_length,
       c.committed_at, coalesce(h.high_water = c.checkpoint_id, false) AS is_head
  FROM flyd.checkpoints c LEFT JOIN flyd.run_heads h USING (run_id)
 WHERE c.run_id = %(run)s AND (%(ckpt)s::text IS NULL OR c.checkpoint_id = %(ckpt)s::text)
 ORDER BY c.boundary DESC, c.committed_at DESC, c.checkpoint_id DESC
"""

CHECKPOINT_ROWS_WITH_ENVELOPE: Final = CHECKPOINT_ROWS.replace(
    "AS is_head\n", "AS is_head, c.envelope\n")

HEAD_ID: Final = "SELECT high_water FROM flyd.run_heads WHERE run_id = %(run)s"

IMPORT_HEAD: Final = """
UPDATE flyd.run_heads SET high_water = %(ckpt)s, boundary = %(boundary)s, lease_epoch = 0
 WHERE run_id = %(run)s
"""

MARK_FAULTS: Final = """
UPDATE flyd.runs
   SET faults_fired = ARRAY(SELECT DISTINCT f FROM unnest(faults_fired || %(faults)s::text[]) AS f
                             ORDER BY f)
 WHERE run_id = %(run)s AND lease_epoch = %(epoch)s AND state = 'running'
   AND owner_node = %(node)s AND lease_expires_at > flyd.app_now()
RETURNING faults_fired;
"""

REQUEUE: Final = """
UPDATE flyd.runs
   SET state = 'pending', attempt = 0, outcome = NULL, finished_at = NULL
 WHERE run_id = %(run)s AND state = 'failed'
RETURNING lease_epoch
"""

RECORD_INTERVENTION: Final = """
INSERT INTO flyd.interventions (actor, kind, run_id, detail)
VALUES (%(actor)s, 'requeue', %(run)s, %(detail)s)
"""

# Not design/distribution.md §3: the listener's probe. The reclaimable lease of another node that
# expires next, and how long until then in database time; its holder renews it long before unless it
# is gone.
NEXT_EXPIRY: Final = """
SELECT run_id, extract(epoch FROM lease_expires_at - flyd.app_now())::float8
  FROM flyd.runs
 WHERE state = 'running' AND lease_expires_at > flyd.app_now()
   AND attempt < max_attempts AND NOT cancel_requested AND owner_node <> %(node)s
 ORDER BY lease_expires_at LIMIT 1
"""

PRUNE_NODES: Final = """
DELETE FROM flyd.nodes WHERE heartbeat_at < flyd.app_now() - interval '1 day'
"""


# --------------------------------------------------------------------------------------------


class PgStore:
    """The `Store` protocol on PostgreSQL (design/distribution.md §3, §5.3, §5.6)."""

    def __init__(self, dsn: str, node_id: str, settings: DbSettings, params: LeaseParams,
                 capacity: int = 1) -> None:
        self._dsn = dsn
        self._node_id = node_id
        self._settings = settings
        self._params = params
        scale = settings.time_scale
        self._call_s = _bound_s(params.commit_timeout_s, scale)
        self._conn_s = min(self._call_s, params.commit_timeout_s / 2)
        self._renew_s = _bound_s(params.renew_timeout_s, scale)
        self._pool: AsyncConnectionPool[ClosingConnection] = AsyncConnectionPool(
            conninfo(dsn, node_id, "work", settings),
            connection_class=ClosingConnection,
            min_size=2,
            max_size=capacity + 3,
            open=False,
            configure=_record_backend,
            kwargs={"autocommit": True},
            name=f"flyd:{node_id}:work",
            timeout=self._call_s,
        )
        self._heartbeat: ClosingConnection | None = None
        self._heartbeat_lock = asyncio.Lock()
        self._listeners: set[ClosingConnection] = set()
        self._checkpoint_reads = ReadConnection(
            dsn, within_s=CHECKPOINT_READ_S, application_name=f"flyd:{node_id}:checkpoints")

    # -- lifecycle -----------------------------------------------------------------------
    async def open(self) -> None:
        """Open the work pool, waiting (at least 5 s, else 2·C) for its `min_size` sessions."""
        try:
            await self._pool.open(wait=True, timeout=max(5.0, 2 * self._call_s))
        except (PoolTimeout, psycopg.Error) as exc:
            await self._pool.close()
            raise Transient(f"open work pool: {exc}") from exc

    async def close(self) -> None:
        hb, self._heartbeat = self._heartbeat, None
        if hb is not None:
            await hb.close()
        for conn in list(self._listeners):
            await conn.close()
        await self._checkpoint_reads.close()
        await self._pool.close(timeout=self._call_s)

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()

    # -- plumbing --------------------------------------------------------------------------
    @asynccontextmanager
    async def _work_conn(self) -> AsyncIterator[ClosingConnection]:
        """A pooled work connection; closed instead of returned when the call did not end
        cleanly (timeout, cancellation, lost session)."""
        conn = await self._live_conn()
        clean = False
        try:
            yield conn
            clean = True
        except psycopg.Error as exc:
            clean = exc.sqlstate is not None and not conn.broken and not conn.closed
            raise
        finally:
            if not clean and not conn.closed:
                await conn.close()
            elif clean and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                await self._rollback_or_close(conn)
            await self._pool.putconn(conn)

    async def _live_conn(self) -> ClosingConnection:
        """A pooled work connection that answered an empty statement, within half of C (module
        rules): a dead one is closed and handed back (the pool opens a replacement at once)
        and the next is tried, without psycopg_pool's own check backoff (1 s, then 2 s, ...)."""
        try:
            async with asyncio.timeout(self._conn_s):
                while True:
                    conn = await self._pool.getconn()
                    try:
                        await conn.execute("")
                    except (psycopg.Error, OSError):
                        await conn.close()
                        await self._pool.putconn(conn)
                        continue
                    except BaseException:
                        await conn.close()
                        await self._pool.putconn(conn)
                        raise
                    return conn
        except TimeoutError as exc:
            raise PoolTimeout(f"no live work session within {self._conn_s:.3g} s") from exc

    async def _rollback_or_close(self, conn: ClosingConnection) -> None:
        try:
            async with asyncio.timeout(self._call_s):
                await conn.rollback()
        except (psycopg.Error, TimeoutError):
            await conn.close()

    async def _call(self, what: str, op: Callable[[ClosingConnection], Awaitable[T]], *,
                    writes: bool = True, allowance_s: float = 0.0) -> T:
        """One work-pool call under the client bound C (plus a large write's scaled
        `allowance_s`), classified (module rules)."""
        sent = False
        backend: Backend | None = None

        async def body() -> T:
            nonlocal sent, backend
            async with self._work_conn() as conn:
                backend = conn.backend
                sent = writes
                return await op(conn)

        try:
            async with asyncio.timeout(self._call_s + allowance_s):
                return await body()
        except (psycopg.Error, TimeoutError, PoolTimeout, OSError) as exc:
            raise classify(exc, sent=sent, backend=backend, what=what) from exc

    async def _fetchall(self, what: str, query: str, params: Mapping[str, Any], *,
                        writes: bool = True) -> list[TupleRow]:
        async def op(conn: ClosingConnection) -> list[TupleRow]:
            cur = await conn.execute(query, params)
            return await cur.fetchall() if cur.description is not None else []
        return await self._call(what, op, writes=writes)

    async def _heartbeat_call(self, what: str, query: str,
                              params: Mapping[str, Any]) -> list[TupleRow]:
        """One statement on the heartbeat session, bounded by R including a reconnect; any
        failure closes the session, the next call reconnects. A session that was already
        open and turns out lost (a blip ended it while idle) is replaced and the statement
        sent once more within the same bound: renew and registration are idempotent, and a
        renewal's `t_send` precedes both sends, so the safe_until it yields stays safe."""
        sent = False
        try:
            async with asyncio.timeout(self._renew_s):
                async with self._heartbeat_lock:
                    for reused in (True, False):
                        before = self._heartbeat
                        conn = await self._heartbeat_session()
                        try:
                            sent = True
                            cur = await conn.execute(query, params)
                            return await cur.fetchall() if cur.description is not None else []
                        except psycopg.Error as exc:
                            self._heartbeat = None
                            await conn.close()
                            if not (reused and conn is before and session_lost(exc)):
                                raise
                        except BaseException:
                            self._heartbeat = None
                            await conn.close()
                            raise
                    raise AssertionError("unreachable: the second send returns or raises")
        except (psycopg.Error, TimeoutError, OSError) as exc:
            raise classify(exc, sent=sent, backend=None, what=what) from exc

    async def _heartbeat_session(self) -> ClosingConnection:
        """The heartbeat session (the caller holds its lock), connected when it is down."""
        conn = self._heartbeat
        if conn is None or conn.closed:
            info = conninfo(self._dsn, self._node_id, "heartbeat", self._settings,
                            statement_timeout_ms=self._params.renew_timeout_s * 1000)
            conn = await ClosingConnection.connect(info, autocommit=True,
                                                   prepare_threshold=None)
            self._heartbeat = conn
        return conn

    async def reconnect_heartbeat(self) -> None:
        """Connect the heartbeat session now if it is down, bounded by R on its own
        (design/distribution.md §5.4): under latency near R a reconnect and a statement do not both
        fit in one renewal's R."""
        try:
            async with asyncio.timeout(self._renew_s):
                async with self._heartbeat_lock:
                    await self._heartbeat_session()
        except (psycopg.Error, TimeoutError, OSError) as exc:
            raise classify(exc, sent=False, backend=None, what="heartbeat reconnect") from exc

    # -- design/distribution.md §3.1 ---------------------------------------------------------------
    async def register_node(self, node: NodeInfo) -> None:
        await self._heartbeat_call("register node", REGISTER_NODE, {
            "node": node.node_id, "name": node.node_name, "host": node.host, "pid": node.pid,
            "version": node.version, "capacity": node.capacity})

    async def set_node_state(self, node_id: str, state: NodeState,
                             reason: str | None = None) -> None:
        await self._fetchall("set node state", SET_NODE_STATE,
                             {"node": node_id, "state": state, "reason": reason})

    async def prune_nodes(self) -> int:
        async def op(conn: ClosingConnection) -> int:
            cur = await conn.execute(PRUNE_NODES)
            return cur.rowcount
        return await self._call("prune nodes", op)

    # -- design/distribution.md §3.2 ---------------------------------------------------------------
    async def submit(self, key: str | None, spec: Mapping[str, Any],
                     max_attempts: int) -> Submitted:
        params = {"key": key, "spec": Jsonb(dict(spec)), "max_attempts": max_attempts}
        for _ in range(2):                    # a racing insert of the same key: repeat once
            rows = await self._fetchall("submit", SUBMIT, params)
            if rows:
                run_id, created, same = rows[0]
                if not same:
                    raise SpecMismatch(f"submit key {key!r} is run {run_id} with another spec")
                return Submitted(run_id=int(run_id), created=bool(created), same_spec=True)
        raise Transient(f"submit key {key!r}: no row after one repeat")

    # -- design/distribution.md §3.3 ---------------------------------------------------------------
    async def claim(self, node_id: str, n: int, ttl_s: float,
                    only: int | None = None, fit: Fit | None = None) -> list[Grant]:
        rows = await self._fetchall("claim", CLAIM, {
            "node": node_id, "n": n, "ttl": float(ttl_s), "only": only,
            "room": fit.room if fit is not None else None,
            "per_run": fit.per_run if fit is not None else 0})
        return [Grant(run_id=int(r[0]), lease_epoch=int(r[1]), lease_expires_at=r[2],
                      attempt=int(r[3]), cancel_requested=bool(r[4]), spec=r[5],
                      faults_fired=tuple(r[6]), high_water=r[7], boundary=int(r[8]),
                      max_attempts=int(r[9]))
                for r in rows]

    # -- design/distribution.md §3.4 ---------------------------------------------------------------
    async def renew(self, node_id: str, holds: Sequence[Held], ttl_s: float) -> list[Renewed]:
        rows = await self._heartbeat_call("renew", RENEW, {
            "node": node_id, "ttl": float(ttl_s),
            "ids": [h.run_id for h in holds], "epochs": [h.lease_epoch for h in holds]})
        return [Renewed(run_id=int(r[0]), lease_epoch=int(r[1]), lease_expires_at=r[2],
                        cancel_requested=bool(r[3])) for r in rows]

    # -- design/distribution.md §3.5 ---------------------------------------------------------------
    async def commit(self, commit: CommitRequest) -> Committed:
        """One pipeline (statement by statement past `PIPELINE_MAX_BYTES` of parameters):
        BEGIN, fence, [checkpoint], [effects], [head + rotation], [finish], COMMIT. `sent`
        turns true as COMMIT is queued: from then on a lost session or an
        overrun bound is an unknown outcome. The bound is C plus the commit's size allowance
        (`commit_allowance_s`); a commit with an allowance raises its transaction's statement
        timeout by as much."""
        c = commit
        ckpt = c.checkpoint
        base: dict[str, Any] = {"run": c.run_id, "epoch": c.lease_epoch, "node": c.node_id,
                                "ckpt": ckpt.checkpoint_id if ckpt is not None else None}
        sent = False
        backend: Backend | None = None
        document = payload_document(c.effects).decode() if c.effects else ""
        results = result_document(c.effects).decode() if c.effects else ""
        size = (len(document) + len(results)
                + (len(ckpt.envelope) if ckpt is not None else 0))
        allowance = commit_allowance_s(len(c.effects) + (ckpt is not None), size)
        scale = self._settings.time_scale

        async def body() -> str | None:
            nonlocal sent, backend
            async with self._work_conn() as conn:
                backend = conn.backend
                finish_cur: psycopg.AsyncCursor[TupleRow] | None = None
                pipelined = size <= PIPELINE_MAX_BYTES
                async with conn.pipeline() if pipelined else nullcontext() as pipe:
                    await conn.execute("BEGIN")
                    if allowance > 0:
                        statement_ms = _scaled_ms(self._settings.statement_timeout_ms
                                                  + allowance * 1000, scale)
                        await conn.execute(f"SET LOCAL statement_timeout = {statement_ms}")
                    if c.effects or ckpt is not None or c.finish is None:
                        await conn.execute(ASSERT_FENCE, base)
                    if ckpt is not None:
                        await conn.execute(INSERT_CHECKPOINT, {
                            **base, "session_id": ckpt.session_id,
                            "session_epoch": ckpt.session_epoch, "episode_id": ckpt.episode_id,
                            "boundary": ckpt.boundary, "compat": ckpt.compatibility_digest,
                            "env_digest": ckpt.envelope_digest, "byte_length": ckpt.byte_length,
                            "envelope": ckpt.envelope})
                    if c.effects:
                        await conn.execute(INSERT_EFFECTS, {
                            **base, "keys": [e.key for e in c.effects],
                            "session_epochs": [e.session_epoch for e in c.effects],
                            "boundaries": [e.boundary for e in c.effects],
                            "payloads": document, "results": results,
                            "digests": [e.digest for e in c.effects]})
                    if ckpt is not None:
                        await conn.execute(MOVE_HEAD, {**base, "boundary": ckpt.boundary})
                        await conn.execute(ROTATE, {**base, "keep": c.keep})
                    if c.finish is not None:
                        finish_cur = await conn.execute(FINISH_RUN, {
                            **base, "state": c.finish.state,
                            "outcome": Jsonb(dict(c.finish.outcome))})
                    sent = True
                    await conn.execute("COMMIT")
                    if pipe is not None:
                        await pipe.sync()
                if finish_cur is None:
                    return None
                row = await finish_cur.fetchone()
                return None if row is None else str(row[0])

        try:
            async with asyncio.timeout(self._call_s + _bound_s(allowance, scale)
                                       if allowance > 0 else self._call_s):
                finished = await body()
        except psycopg.Error as exc:
            if exc.sqlstate == "23505" and exc.diag.constraint_name == EFFECTS_PKEY:
                raise await self._effect_clash(c, exc) from exc
            raise classify(exc, sent=sent, backend=backend, what="commit") from exc
        except (TimeoutError, PoolTimeout, OSError) as exc:
            raise classify(exc, sent=sent, backend=backend, what="commit") from exc
        return Committed(finished=finished, backend=backend)

    async def _effect_clash(self, c: CommitRequest, exc: psycopg.Error) -> StoreError:
        """design/distribution.md §6.4: read the stored rows of the commit's keys once the failed
        transaction is gone (rolled back; the read is a new call, on any pooled session)."""
        keys = [e.key for e in c.effects]
        rows = await self._fetchall("read existing effects", EXISTING_EFFECTS,
                                    {"run": c.run_id, "keys": keys}, writes=False)
        stored: dict[str, tuple[int, bytes]] = {str(k): (int(ep), bytes(d)) for k, ep, d in rows}
        seen: dict[str, bytes] = {}
        clashes: list[tuple[str, int, bytes, bool]] = []
        for e in c.effects:
            if e.key in stored:
                epoch, digest = stored[e.key]
                clashes.append((e.key, epoch, digest, digest == e.digest))
            elif e.key in seen:
                clashes.append((e.key, c.lease_epoch, seen[e.key], seen[e.key] == e.digest))
            seen.setdefault(e.key, e.digest)
        if not clashes:
            return Transient(f"commit: 23505 on {EFFECTS_PKEY} but no stored key found: {exc}")
        key, epoch, digest, same = next((x for x in clashes if not x[3]), clashes[0])
        cls = DuplicateEffect if same else ConflictingEffect
        return cls(key, epoch, digest, f"run {c.run_id} effect {key!r} already recorded at "
                   f"epoch {epoch} with {'the same' if same else 'another'} digest")

    # -- design/distribution.md §3.6 ---------------------------------------------------------------
    async def release(self, run_id: int, lease_epoch: int, node_id: str, *, refund: bool,
                      backoff_s: float) -> Released | None:
        rows = await self._fetchall("release", RELEASE, {
            "run": run_id, "epoch": lease_epoch, "node": node_id, "refund": refund,
            "backoff": float(backoff_s)})
        return Released(run_id=int(rows[0][0]), lease_epoch=int(rows[0][1])) if rows else None

    # -- design/distribution.md §3.7 ---------------------------------------------------------------
    async def reap(self, n: int) -> list[Reaped]:
        rows = await self._fetchall("reap", REAP, {
            "n": n, "stale": float(self._params.node_stale_after_s)})
        return [Reaped(run_id=int(r[0]), lease_epoch=int(r[1]),
                       state=cast(TerminalState, str(r[2]))) for r in rows]

    # -- design/distribution.md §3.8 ---------------------------------------------------------------
    async def cancel(self, run_id: int, actor: str) -> Cancelled | None:
        rows = await self._fetchall("cancel", CANCEL, {"run": run_id, "actor": actor})
        if not rows:
            return None
        return Cancelled(run_id=int(rows[0][0]), state=cast(RunState, str(rows[0][1])))

    # -- design/distribution.md §3.9 ---------------------------------------------------------------
    async def own_grants(self, node_id: str) -> list[Held]:
        rows = await self._fetchall("own grants", OWN_GRANTS, {"node": node_id}, writes=False)
        return [Held(run_id=int(r[0]), lease_epoch=int(r[1])) for r in rows]

    # -- design/distribution.md §3.10 --------------------------------------------------------------
    async def end_backend(self, backend: Backend) -> None:
        wait_ms = max(SCALE_FLOOR_MS, round(self._call_s * 1000 / 2))
        await self._fetchall("end backend", END_BACKEND, {
            "pid": backend.pid, "backend_start": backend.backend_start, "wait_ms": wait_ms},
            writes=False)

    async def read_run(self, run_id: int, lease_epoch: int,
                       checkpoint_id: str | None) -> RunRead | None:
        rows = await self._fetchall("read run", READ_RUN, {
            "run": run_id, "epoch": lease_epoch, "ckpt": checkpoint_id}, writes=False)
        if not rows:
            return None
        r = rows[0]
        return RunRead(state=cast(RunState, str(r[0])), lease_epoch=int(r[1]), owner_node=r[2],
                       live=bool(r[3]), high_water=r[4], boundary=int(r[5]),
                       checkpoint_committed=bool(r[6]))

    # -- checkpoints (design/state.md §4.2, §4.7) ------------------------------------------
    async def _checkpoint_read(self, what: str, query: str, params: Mapping[str, Any], *,
                               binary: bool = False) -> list[TupleRow]:
        """A read on the `:checkpoints` session, repeated while the session is lost (module
        rules)."""
        async def op(conn: ClosingConnection) -> list[TupleRow]:
            cur = await conn.execute(query, params, binary=binary)
            return await cur.fetchall()

        try:
            return await self._checkpoint_reads.read(op, what)
        except (psycopg.Error, TimeoutError, OSError) as exc:
            raise classify(exc, sent=False, backend=None, what=what) from exc

    async def read_checkpoints(self, run_id: int, checkpoint_id: str | None, *,
                               with_envelope: bool) -> list[StoredCheckpoint]:
        query = CHECKPOINT_ROWS_WITH_ENVELOPE if with_envelope else CHECKPOINT_ROWS
        rows = await self._checkpoint_read("read checkpoints", query,
                                           {"run": run_id, "ckpt": checkpoint_id},
                                           binary=with_envelope)
        return [StoredCheckpoint(
            run_id=int(r[0]), checkpoint_id=str(r[1]), lease_epoch=int(r[2]),
            node_id=str(r[3]), session_id=str(r[4]), session_epoch=int(r[5]),
            episode_id=str(r[6]), boundary=int(r[7]), compatibility_digest=str(r[8]),
            envelope_digest=bytes(r[9]), byte_length=int(r[10]),
            committed_at=cast(datetime, r[11]), is_head=bool(r[12]),
            envelope=bytes(r[13]) if with_envelope else None) for r in rows]

    async def read_head(self, run_id: int) -> str | None:
        rows = await self._checkpoint_read("read head", HEAD_ID, {"run": run_id})
        return None if not rows or rows[0][0] is None else str(rows[0][0])

    async def import_checkpoint(self, imp: Import) -> int | None:
        ck = imp.checkpoint
        allowance = commit_allowance_s(1, ck.byte_length)
        scale = self._settings.time_scale

        async def op(conn: ClosingConnection) -> int | None:
            async with conn.transaction():
                if allowance > 0:
                    statement_ms = _scaled_ms(self._settings.statement_timeout_ms
                                              + allowance * 1000, scale)
                    await conn.execute(f"SET LOCAL statement_timeout = {statement_ms}")
                run = imp.run_id
                if run is None:
                    cur = await conn.execute(SUBMIT, {
                        "key": imp.submit_key, "spec": Jsonb(dict(imp.spec)),
                        "max_attempts": imp.max_attempts})
                    row = await cur.fetchone()
                    if row is None or not row[1]:
                        return None
                    run = int(row[0])
                base = {"run": run, "epoch": 0, "node": IMPORT_NODE, "ckpt": ck.checkpoint_id}
                await conn.execute(INSERT_CHECKPOINT, {
                    **base, "session_id": ck.session_id, "session_epoch": ck.session_epoch,
                    "episode_id": ck.episode_id, "boundary": ck.boundary,
                    "compat": ck.compatibility_digest, "env_digest": ck.envelope_digest,
                    "byte_length": ck.byte_length, "envelope": ck.envelope})
                await conn.execute(IMPORT_HEAD, {**base, "boundary": ck.boundary})
                await conn.execute(ROTATE, {**base, "keep": imp.keep})
            return run
        return await self._call("import", op, allowance_s=_bound_s(allowance, scale)
                                if allowance > 0 else 0.0)

    # -- design/distribution.md §3.11 --------------------------------------------------------------
    async def mark_faults_fired(self, run_id: int, lease_epoch: int, node_id: str,
                                faults: Sequence[str]) -> tuple[str, ...] | None:
        rows = await self._fetchall("mark faults fired", MARK_FAULTS, {
            "run": run_id, "epoch": lease_epoch, "node": node_id, "faults": list(faults)})
        return tuple(rows[0][0]) if rows else None

    # -- operator requeue --------------------------------------------------------------------
    async def requeue(self, run_id: int, actor: str) -> bool:
        """One transaction: `SET LOCAL flyd.intervention = 'on'`, failed -> pending with
        attempt 0 and outcome/finished_at cleared, and an `interventions` row."""
        async def op(conn: ClosingConnection) -> bool:
            async with conn.transaction():
                await conn.execute("SET LOCAL flyd.intervention = 'on'")
                cur = await conn.execute(REQUEUE, {"run": run_id})
                row = await cur.fetchone()
                if row is None:
                    return False
                await conn.execute(RECORD_INTERVENTION, {
                    "actor": actor, "run": run_id,
                    "detail": Jsonb({"fromState": "failed", "leaseEpoch": int(row[0])})})
            return True
        return await self._call("requeue", op)

    # -- LISTEN ----------------------------------------------------------------------------
    async def listen(self) -> AsyncGenerator[int, None]:
        """Run ids from `flyd_claimable` notifications (design/distribution.md §2.4) on a dedicated
        `:listen` session, and the run id of another node's lease at the instant it expires (expiry
        sends no notification); ends with `Transient` when the session is lost. Close it with
        `aclose()` (or `contextlib.aclosing`) to release the session."""
        info = conninfo(self._dsn, self._node_id, "listen", self._settings)
        scale = self._settings.time_scale
        quiet_s = _bound_s(self._params.claim_poll_s, scale)
        try:
            async with asyncio.timeout(self._renew_s):
                conn = await ClosingConnection.connect(info, autocommit=True)
        except (psycopg.Error, TimeoutError, OSError) as exc:
            raise classify(exc, sent=False, backend=None, what="listen") from exc
        self._listeners.add(conn)
        try:
            await conn.execute("LISTEN flyd_claimable")
            while True:
                async with asyncio.timeout(self._renew_s):
                    cur = await conn.execute(NEXT_EXPIRY, {"node": self._node_id})
                    row = await cur.fetchone()
                wait_s, due = quiet_s, None
                if row is not None and float(row[1]) < self._params.claim_poll_s:
                    wait_s, due = _bound_s(float(row[1]) + EXPIRY_SLACK_S, scale), int(row[0])
                async with aclosing(conn.notifies(timeout=wait_s)) as notes:
                    async for note in notes:
                        yield int(note.payload)
                if due is not None:
                    yield due
        except (psycopg.Error, TimeoutError, OSError) as exc:
            raise classify(exc, sent=False, backend=None, what="listen") from exc
        finally:
            self._listeners.discard(conn)
            await conn.close()
