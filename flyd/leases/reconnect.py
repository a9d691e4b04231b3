"""Reads that outlive their connection.

Why: a PostgreSQL blip (a server restart, a failover, an operator's `pg_terminate_backend`) ends
every session at once. A long-lived connection that is simply reused afterwards fails its next
read at once, and that one failed read would throw away a grant's head read, a recovery attempt
or `flyd run`'s end-of-run poll, although the database answers again a moment later.

Rules:
- `session_lost(exc)` (the lease store's) says whether a failure means the session is gone or
  never answered; a server error on a live session is not, and is never repeated.
- `ReadConnection.read(op, what)` runs `op` on one long-lived autocommit connection (opened
  lazily; closed after any failure, so the next use reconnects). While the session is lost it
  reconnects and repeats `op`, `BACKOFF_S` doubling to `BACKOFF_MAX_S` apart, until `within_s`
  has passed since the read began; then the last error stands. Each try is bounded by what is
  left of `within_s`. An `application_name` names the session in `pg_stat_activity`, so an
  operator (and the blip tests) can tell whose it is. Only idempotent reads may be passed: a
  write repeated after a lost reply could apply twice.
- Tries are serialised by a lock (one connection, one statement at a time); the backoff sleeps
  outside it. The connection is the lease store's `ClosingConnection`: a try cut by its bound
  closes the socket at once instead of waiting for a server-side cancel.
- A cancelled read never retries, even when the cancellation came out of a try as another
  error (`flyd.cancel`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import psycopg
import structlog

from flyd.cancel import raise_if_cancelled
from flyd.leases.stores.pg import ClosingConnection, session_lost

__all__ = ["BACKOFF_MAX_S", "BACKOFF_S", "ReadConnection"]

T = TypeVar("T")

BACKOFF_S: Final = 0.05
BACKOFF_MAX_S: Final = 1.0

log = structlog.get_logger("flyd.leases.reconnect")


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
