"""The embedded PostgreSQL default (design/distribution.md §5.9): pgserver's bundled binaries.

Rules:
- `<state_dir>/run` (mode 0700) is created first and `XDG_RUNTIME_DIR` points at it while pgserver
  is imported, so pgserver's inter-process lock (`platformdirs.user_runtime_path`) lives there
  whatever the account's login session; the variable is restored afterwards so that nothing
  else (the default bus socket in particular) ever resolves into that directory.
- The data directory is `<state_dir>/pg`; `get_server(..., cleanup_mode='stop')` refcounts the
  processes using it in `<pg>/.handle_pids.json`, so the postmaster stops when the last flyd
  process using it calls `stop()` (or exits). Database `flyd` is created if missing and migrated.
- Blocking pgserver calls run in `asyncio.to_thread`, each under a deadline.
- PostgreSQL never runs as root. Under uid 0 pgserver runs the server as a system user
  `pgserver` (creating it with `useradd` and widening the permissions of the data directory's
  ancestors). The server's owner is verified after start: the data directory and the postmaster
  must belong to the current user, or to `pgserver` under uid 0; anything else (including a
  failed `useradd` or `chmod`, as under systemd's `ProtectSystem=strict`) is an
  `EmbeddedError` (`CONFIG`, exit 2) that recommends a dedicated user or `[database] dsn`.

Decisions where the spec is silent:
- pgserver fixes its lock path when first imported; when it was already imported with another
  runtime directory (a second state dir in one process), the lock is re-pointed at this state
  dir's, so every process sharing a data directory shares one lock.
- Handles of processes that died without `stop()` (SIGKILL) are pruned from pgserver's refcount
  at `stop()`, so a crashed node never keeps the server alive for ever.
- Several processes may start on one fresh state dir at once (two `flyd run`): creating
  database `flyd` tolerates losing that race to another process (`_create_database`); the
  migrations already serialise on their advisory lock.
- A server that does not start says why: pgserver keeps the failing command's stderr in its own
  log records only, so they are captured while it starts, with the tail of `<pg>/log`, and the
  first line naming a full disk, then a permission, then any PostgreSQL error is the cause
  (`start_failure_cause`).
- `embedded_dsn_if_running` reads `postmaster.pid` only; it never starts or connects to anything
  (`flyctl`, design/cli.md §7.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import subprocess
from pathlib import Path
from typing import Any, Final

import psutil
import psycopg
from psycopg import errors, sql

from flyd.errors import ConfigError
from flyd.leases.migrate import migrate

ROOT_USER: Final = "pgserver"
START_TIMEOUT_S: Final = 60.0
STOP_TIMEOUT_S: Final = 30.0
_FLYD_EXISTS: Final = "SELECT 1 FROM pg_database WHERE datname = 'flyd'"
MAX_CAUSE_CHARS: Final = 300
#: what a start failure's output is searched for, in this order (the first match is the cause)
_CAUSES: Final = (("No space left on device", "ENOSPC", "Disk quota exceeded"),
                  ("Permission denied", "Operation not permitted", "Read-only file system"),
                  ("FATAL:", "PANIC:", "initdb: error:", "pg_ctl: ", "could not "))
_ADVICE: Final = ("run flyd as a dedicated non-root user, or point [database] dsn (FLYD_DSN, "
                  "--dsn) at an external PostgreSQL")


class EmbeddedError(ConfigError):
    """The embedded server cannot be used here (exit 2, `CONFIG`); nothing was changed."""


def _runtime_dir(state_dir: Path) -> Path:
    run = state_dir / "run"
    run.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(run, 0o700)
    return run


def _import_pgserver(run_dir: Path) -> Any:
    """Import pgserver with `XDG_RUNTIME_DIR` = `run_dir`; point its lock there."""
    previous = os.environ.get("XDG_RUNTIME_DIR")
    os.environ["XDG_RUNTIME_DIR"] = str(run_dir)
    try:
        import fasteners  # type: ignore[import-untyped]
        import pgserver
        import platformdirs
        from pgserver.postgres_server import PostgresServer

        runtime_path = platformdirs.user_runtime_path("python_PostgresServer")
    finally:
        if previous is None:
            os.environ.pop("XDG_RUNTIME_DIR", None)
        else:
            os.environ["XDG_RUNTIME_DIR"] = previous
    if PostgresServer.runtime_path != runtime_path:
        PostgresServer.runtime_path = runtime_path
        PostgresServer.lock_path = runtime_path / ".lockfile"
        PostgresServer._lock = fasteners.InterProcessLock(PostgresServer.lock_path)
    return pgserver


def _expected_owner() -> int:
    if os.geteuid() != 0:
        return os.geteuid()
    try:
        return pwd.getpwnam(ROOT_USER).pw_uid
    except KeyError:
        raise EmbeddedError(f"embedded PostgreSQL: no user {ROOT_USER!r} to run the server as "
                            f"root; {_ADVICE}") from None


def _owner_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _check_data_dir(pgdata: Path) -> None:
    """An existing data directory must belong to whoever will run the server."""
    if not pgdata.exists() or os.geteuid() == 0:
        return
    owner = pgdata.stat().st_uid
    if owner != os.geteuid():
        raise EmbeddedError(f"embedded PostgreSQL: {pgdata} belongs to {_owner_name(owner)}, "
                            f"not to {_owner_name(os.geteuid())}; {_ADVICE}")


def _verify_owner(pgdata: Path, postmaster_pid: int) -> None:
    expected = _expected_owner()
    owner = pgdata.stat().st_uid
    if owner != expected:
        raise EmbeddedError(f"embedded PostgreSQL: {pgdata} belongs to {_owner_name(owner)}, "
                            f"expected {_owner_name(expected)}; {_ADVICE}")
    try:
        runs_as = psutil.Process(postmaster_pid).uids().effective
    except psutil.NoSuchProcess:
        raise EmbeddedError(f"embedded PostgreSQL: the postmaster (pid {postmaster_pid}) "
                            f"of {pgdata} is gone") from None
    if runs_as != expected:
        raise EmbeddedError(f"embedded PostgreSQL: the postmaster of {pgdata} runs as "
                            f"{_owner_name(runs_as)}, expected {_owner_name(expected)}; "
                            f"{_ADVICE}")


class _Captured(logging.Handler):
    """pgserver's own log records while it starts: the failing command's stderr is only there
    (its `CalledProcessError` carries none)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):  # a record that cannot be formatted adds nothing
            self.lines.extend(record.getMessage().splitlines())


def start_failure_cause(lines: list[str]) -> str:
    """The line that says why the server did not start, first by the causes an operator can
    act on (disk full, permissions), then any PostgreSQL error line; "" when none does."""
    texts = [line.strip() for line in lines if line.strip()]
    for words in _CAUSES:
        for line in texts:
            if any(word in line for word in words):
                return line[:MAX_CAUSE_CHARS]
    return ""


def _get_server(pgserver: Any, pgdata: Path) -> Any:
    captured = _Captured()
    logger = logging.getLogger("pgserver")
    level = logger.level
    logger.addHandler(captured)
    if logger.getEffectiveLevel() > logging.ERROR:  # `-q`: still see why it failed
        logger.setLevel(logging.ERROR)
    try:
        return pgserver.get_server(pgdata, cleanup_mode="stop")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        lines = list(captured.lines)
        with contextlib.suppress(OSError):
            lines.extend((pgdata / "log").read_text(errors="replace").splitlines()[-50:])
        if isinstance(exc, OSError):
            lines.insert(0, str(exc))
        cause = start_failure_cause(lines) or (
            f"{type(exc).__name__}: exit status {exc.returncode}"
            if isinstance(exc, subprocess.CalledProcessError) else str(exc))
        advice = (f"free space on the file system of {pgdata}, or point [database] dsn at an "
                  "external PostgreSQL" if any(w in cause for w in _CAUSES[0]) else _ADVICE)
        raise EmbeddedError(f"embedded PostgreSQL under {pgdata} did not start: {cause}; "
                            f"{advice}") from exc
    finally:
        logger.removeHandler(captured)
        logger.setLevel(level)


def _create_database(admin_uri: str) -> None:
    """Create database `flyd` unless it exists. Processes starting on one fresh state dir at
    once may all see it missing: the one whose `CREATE DATABASE` loses the race (a
    `duplicate_database`, or a unique violation on the catalog's name index when both
    inserted concurrently) finds the winner's database and goes on."""
    with psycopg.connect(admin_uri, autocommit=True, connect_timeout=10) as conn:
        found = conn.execute(_FLYD_EXISTS).fetchone()
        if found is not None:
            return
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier("flyd")))
        except (errors.DuplicateDatabase, errors.UniqueViolation):
            if conn.execute(_FLYD_EXISTS).fetchone() is None:
                raise


def _prune_dead_handles(server: Any) -> None:
    """Drop refcount entries of processes that are gone (they never ran their cleanup)."""
    with type(server)._lock:
        handles = server.global_process_id_list
        alive = [pid for pid in handles.get() if psutil.pid_exists(pid)]
        handles.put(alive)


def _stop(server: Any) -> None:
    _prune_dead_handles(server)
    server.cleanup()


def _prepare(state_dir: Path) -> tuple[Any, Path]:
    """The run directory first, then pgserver imported against it; the data dir's path."""
    state_dir = state_dir.expanduser().resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    pgserver = _import_pgserver(_runtime_dir(state_dir))
    pgdata = state_dir / "pg"
    _check_data_dir(pgdata)
    return pgserver, pgdata


class EmbeddedPostgres:
    """One process's handle on the embedded server of a state dir (one per state dir)."""

    def __init__(self) -> None:
        self._server: Any = None
        self.dsn: str | None = None
        self.schema_version = 0

    async def start(self, state_dir: Path) -> str:
        """Start (or join) the server under `<state_dir>/pg`; return the migrated `flyd` DSN."""
        pgserver, pgdata = _prepare(state_dir)
        async with asyncio.timeout(START_TIMEOUT_S):
            self._server = await asyncio.to_thread(_get_server, pgserver, pgdata)
            try:
                _verify_owner(pgdata, self._server.get_pid())
                await asyncio.to_thread(_create_database, self._server.get_uri())
                dsn: str = self._server.get_uri("flyd")
                version = await migrate(dsn)
            except BaseException:
                await self.stop()
                raise
        self.dsn, self.schema_version = dsn, version
        return dsn

    async def stop(self) -> None:
        """Release this process's handle; the last one stops the postmaster."""
        server, self._server, self.dsn = self._server, None, None
        if server is not None:
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await asyncio.to_thread(_stop, server)


def embedded_dsn_if_running(state_dir: Path) -> str | None:
    """The `flyd` DSN of a server already running under `<state_dir>/pg`, else None."""
    pid_file = state_dir / "pg" / "postmaster.pid"
    try:
        lines = pid_file.read_text().splitlines()
    except OSError:
        return None
    if len(lines) < 5 or not lines[0].strip().isdigit():
        return None
    pid, port, socket_dir = int(lines[0]), lines[3].strip(), lines[4].strip()
    if not psutil.pid_exists(pid) or not port.isdigit():
        return None
    if socket_dir:
        return f"postgresql://postgres@/flyd?host={socket_dir}&port={port}"
    return f"postgresql://postgres@127.0.0.1:{port}/flyd"
