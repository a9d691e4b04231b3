"""The checkpoint store (design/state.md §4): records, select, read with integrity checks, the
fenced durable commit, unknown-outcome resolution, export, import, list and verify.

Rules:
- Reads (`lookup`, `head`, `select`, `read`, `list`) never write. `list` and records carry no
  bytes; `read(record)` fetches the row again and runs, in order, S1 (the row still exists), S2
  (length = `byte_length`), S3 (SHA-256 = `envelope_digest`), S4 (the envelope's R1–R8) and S5
  (the row agrees with the manifest), each failure an `IntegrityError`
  (`INCOMPATIBLE_STATE`/`none`, "checkpoint <id> of run <r>: S<n>: <reason>").
- The write path never bypasses the fence: `commit(job, path)` sends the group commit of
  design/distribution.md §3.5 through a `CommitPath`, which is either the node's `Scope` (its
  `commit`/`finish`: the guard, the hold's COMMITTING phase and the node's own handling of
  fenced, duplicate and unknown outcomes) or a `DirectCommitPath` over a lease `Store` bound to
  one (run, lease epoch, node) (tools and tests). The store decides what an outcome means for a
  checkpoint: `CommitFailure` values with a `reason` and whether the retry policy may repeat
  the attempt (design/state.md §5.4); success returns the committed record and adds 1 to `commits`.
- Unknown outcomes (design/state.md §4.6) are resolved by checkpoint id: the old backend (when
  named) is ended, then design/distribution.md §3.10 is read and `flyd.leases.resolve.decide` judges
  it: committed → the record; `retry` → the identical commit again (same id, same effects, same
  attempt); `lost` → `CommitFailure("grant lost")`. A real unknown without a named backend is
  `lost`, as the node decides (a read cannot prove the old COMMIT will not land later).
- The reads after a sent commit (the design/distribution.md §3.10 resolution, with ending the old
  backend, and the lookup of a committed record) are repeated with backoff (50 ms doubling to 1 s)
  while the database does not answer (`BACKEND_FAILURE`), for up to `RESOLVE_S` (30 s): a commit
  that may have landed must not be reported failed, or the writer would send its effects again
  under the next checkpoint id (`effect_duplicate`) after, e.g., a server restart. A lost
  lease cancels the writer meanwhile (design/distribution.md §5.5); past the bound the error stands.
- A `Transient` failure while a row with the job's id exists is a reused id: `INTERNAL`,
  never retried (PostgreSQL reports 23505 on the checkpoint key as an ordinary server error).
- Rotation, the head move and the effect rows are the lease layer's statement. `keep` (1..100)
  is the path's: `DirectCommitPath(keep=…)`; a path without a `keep` attribute (the node's
  `Scope`) rotates with the lease layer's default 3. A job whose `keep` differs from its path's
  is `INTERNAL`, so a configured `keep_generations` is never silently ignored.

Decisions where the spec is silent:
- `commit` takes the path as an argument (the protocol's `commit(job)` plus the one thing a
  store cannot own: whose grant writes). A store serves any run; a path is one grant.
- Faults (`CommitFaults`, set by the writer's `WriterFaults`) act at the store:
  `abort_before_commit_for` abandons the transaction before COMMIT, so nothing of it is sent
  (`Failed` "aborted before commit", not retryable); `lose_commit_reply_for` sends the commit
  and then discards its reply; `lose_commit_request_for` drops the request so it never lands.
  Each of the last two fires once per id and leaves an unknown outcome to resolve.
- `effect_duplicate` / `effect_conflict` are logged (structlog, level error) by the store when
  the path reports them; the path has already failed the run (the node's `Scope` does, and so
  does `DirectCommitPath`).
- `PgCheckpointStore` uses one connection of its own (autocommit, opened lazily, closed after
  any failure) for reads, the design/distribution.md §3.10 read and ending a backend, and a
  connection per import; every call is bounded by `timeout_s`. Those statements are idempotent, so
  while the session is lost (a PostgreSQL blip ended it, `flyd.leases.reconnect`) a call reconnects
  and repeats its statement within that bound: a connection left stale by a blip never fails a
  grant's first head read or a recovery's read. Database failures are `BACKEND_FAILURE`/`unknown`.
  Its connections are the lease store's `ClosingConnection`: a call cancelled mid-query (its
  bound, or a lost lease cancelling the grant) closes the socket at once instead of waiting up
  to 10 s for a server-side cancel that an unreachable server never answers.
- `MemoryCheckpointStore` reads the in-memory lease store's tables through `MemStore.dump()`;
  it has no `import_envelope` (the in-memory lease store has no lease-epoch-0 write path).
- An import inserts the row with node id `import`; the run's spec gains
  `startFrom: {checkpointId, envelopeDigest}`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import psycopg
import structlog
from psycopg.types.json import Jsonb

from flyd.cancel import raise_if_cancelled
from flyd.leases.core import LeaseLost
from flyd.leases.reconnect import ReadConnection
from flyd.leases.resolve import decide
from flyd.leases.runtime import finish_effect
from flyd.leases.stores import pg as sql
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
    LedgerImmutable,
    RunRead,
    Store,
    TerminalFinal,
    TerminalState,
    Transient,
    UnknownOutcome,
)
from flyd.leases.stores.mem import MemStore
from flyd.state.effects import epoch_number
from flyd.state.envelope import MAX_ENVELOPE_BYTES, Envelope, EnvelopeError, decode
from workers.types.canonical import digest_of
from workers.types.domain import DomainError, ErrorCode, Mutation

__all__ = [
    "CheckpointRecord",
    "CheckpointStore",
    "CommitFailure",
    "CommitFaults",
    "CommitJob",
    "CommitPath",
    "DirectCommitPath",
    "FinishRun",
    "IntegrityError",
    "MemoryCheckpointStore",
    "PgCheckpointStore",
    "verify_file",
    "write_file",
]

log = structlog.get_logger("flyd.state.checkpoints")

IMPORT_NODE: Final = "import"
DEFAULT_TIMEOUT_S: Final = 5.0
DEFAULT_KEEP: Final = 3
RESOLVE_S: Final = 30.0
RESOLVE_BACKOFF_S: Final = 0.05
RESOLVE_BACKOFF_MAX_S: Final = 1.0

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# Values and errors


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """One generation without its bytes (design/state.md §4.2); `session_epoch` is the Id `e<N>`."""

    run_id: int
    checkpoint_id: str
    lease_epoch: int
    node_id: str
    session_id: str
    session_epoch: str
    episode_id: str
    boundary: int
    compatibility_digest: str
    envelope_digest: str
    byte_length: int
    committed_at: datetime
    is_head: bool

    def to_json(self) -> dict[str, Any]:
        """The camelCase row of `flyctl checkpoints list --json` (design/cli.md §1)."""
        return {"runId": self.run_id, "checkpointId": self.checkpoint_id,
                "leaseEpoch": self.lease_epoch, "nodeId": self.node_id,
                "sessionId": self.session_id, "sessionEpoch": self.session_epoch,
                "episodeId": self.episode_id, "boundary": self.boundary,
                "compatibilityDigest": self.compatibility_digest,
                "envelopeDigest": self.envelope_digest, "byteLength": self.byte_length,
                "committedAt": self.committed_at.isoformat(), "isHead": self.is_head}


@dataclass(frozen=True, slots=True)
class FinishRun:
    """The terminal transition a final commit carries (design/state.md §4.3 step 6)."""

    state: TerminalState
    outcome: Mapping[str, Any]
    boundaries: int
    session_epoch: int


@dataclass(frozen=True, slots=True)
class CommitJob:
    """design/state.md §4.3's job: one checkpoint, the effects (h.boundary, c], rotation, optional
    finish."""

    run_id: int
    lease_epoch: int
    checkpoint_id: str
    session_id: str
    session_epoch: str
    episode_id: str
    boundary: int
    compatibility_digest: str
    envelope: bytes
    envelope_digest: bytes
    effects: tuple[Effect, ...] = ()
    keep: int = 3
    finish: FinishRun | None = None

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(checkpoint_id=self.checkpoint_id, session_id=self.session_id,
                          session_epoch=epoch_number(self.session_epoch),
                          episode_id=self.episode_id, boundary=self.boundary,
                          compatibility_digest=self.compatibility_digest,
                          envelope_digest=self.envelope_digest, envelope=self.envelope)


@dataclass(slots=True)
class CommitFaults:
    """Test hooks at the durable commit point (module decisions)."""

    abort_before_commit_for: str | None = None
    lose_commit_reply_for: str | None = None
    lose_commit_request_for: str | None = None
    fired: list[str] = field(default_factory=list)


class IntegrityError(DomainError):
    """A stored generation failed S1–S5 (design/state.md §4.5); `check` names which."""

    def __init__(self, check: str, run_id: int, checkpoint_id: str, reason: str) -> None:
        self.check = check
        super().__init__(ErrorCode.INCOMPATIBLE_STATE,
                         f"checkpoint {checkpoint_id} of run {run_id}: {check}: {reason}",
                         Mutation.NONE)


class CommitFailure(DomainError):
    """The commit did not land (or landed for nobody): `reason` is the `Failed` reason;
    `retryable` says whether `RetryThenRelease` may send it again (design/state.md §5.4)."""

    def __init__(self, reason: str, message: str, *, retryable: bool = False,
                 code: ErrorCode = ErrorCode.BACKEND_FAILURE,
                 mutation: Mutation = Mutation.NONE) -> None:
        self.reason = reason
        self.retryable = retryable
        super().__init__(code, message, mutation)


def _backend_failure(what: str, exc: BaseException) -> DomainError:
    return DomainError(ErrorCode.BACKEND_FAILURE, f"{what}: {type(exc).__name__}: {exc}",
                       Mutation.UNKNOWN)


# --------------------------------------------------------------------------------------------
# Commit paths


class CommitPath(Protocol):
    """One grant's fenced writer: the node's `Scope` or a `DirectCommitPath`."""

    run_id: int
    lease_epoch: int
    node_id: str

    async def commit(self, effects: Sequence[Effect], checkpoint: Checkpoint | None = None
                     ) -> None: ...

    async def finish(self, state: TerminalState, outcome: Mapping[str, Any],
                     effects: Sequence[Effect] = (), *, boundaries: int, session_epoch: int,
                     checkpoint: Checkpoint | None = None) -> None: ...


class DirectCommitPath:
    """The lease `Store`'s group commit for one (run, lease epoch, node), without a node
    runtime. Errors are the store's, raised as they come, except that a duplicate or
    conflicting effect or a head regression first fails the run (design/distribution.md §6.4, the
    node's rule) with a finish-only commit, then is re-raised."""

    def __init__(self, store: Store, run_id: int, lease_epoch: int, node_id: str, *,
                 head_boundary: int = 0, keep: int = 3) -> None:
        self.store = store
        self.run_id = run_id
        self.lease_epoch = lease_epoch
        self.node_id = node_id
        self.keep = keep
        self._boundary = head_boundary
        self._session_epoch = 0

    async def commit(self, effects: Sequence[Effect], checkpoint: Checkpoint | None = None
                     ) -> None:
        await self._send(tuple(effects), checkpoint, None)

    async def finish(self, state: TerminalState, outcome: Mapping[str, Any],
                     effects: Sequence[Effect] = (), *, boundaries: int, session_epoch: int,
                     checkpoint: Checkpoint | None = None) -> None:
        fin = finish_effect(state, outcome, boundaries=boundaries, session_epoch=session_epoch)
        await self._send((*effects, fin), checkpoint, Finish(state, outcome))

    async def _send(self, effects: tuple[Effect, ...], checkpoint: Checkpoint | None,
                    finish: Finish | None) -> None:
        commit = Commit(self.run_id, self.lease_epoch, self.node_id, effects, checkpoint,
                        finish, self.keep)
        try:
            await self.store.commit(commit)
        except (DuplicateEffect, ConflictingEffect, HeadRegression) as exc:
            if finish is None or finish.state != "failed":
                await self._fail_run(exc, checkpoint)
            raise
        epochs = [e.session_epoch for e in effects if e.key != "finish"]
        if checkpoint is not None:
            self._boundary = max(self._boundary, checkpoint.boundary)
            epochs.append(checkpoint.session_epoch)
        self._session_epoch = max([self._session_epoch, *epochs])

    async def _fail_run(self, exc: DuplicateEffect | ConflictingEffect | HeadRegression,
                        checkpoint: Checkpoint | None) -> None:
        if isinstance(exc, HeadRegression):
            outcome: dict[str, Any] = {
                "error": "head_regression", "message": exc.message,
                "checkpointId": checkpoint.checkpoint_id if checkpoint is not None else None}
        else:
            outcome = exc.outcome()
        fin = finish_effect("failed", outcome, boundaries=self._boundary,
                            session_epoch=self._session_epoch)
        await self.store.commit(Commit(self.run_id, self.lease_epoch, self.node_id, (fin,),
                                       None, Finish("failed", outcome)))


# --------------------------------------------------------------------------------------------
# Shared logic


@dataclass(frozen=True, slots=True)
class _Row:
    record: CheckpointRecord
    envelope: bytes | None


def write_file(path: Path, data: bytes) -> None:
    """`FILE.tmp` beside FILE, fsync, rename, fsync the directory (design/state.md §4.7);
    blocking."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify_file(path: Path) -> Envelope:
    """`flyctl checkpoints verify FILE`: R1–R8 on a file (`EnvelopeError` names the check);
    a file over `MAX_ENVELOPE_BYTES` is `UNSUPPORTED`."""
    size = path.stat().st_size
    if size > MAX_ENVELOPE_BYTES:
        raise DomainError(ErrorCode.UNSUPPORTED, f"{path.name} has {size} bytes; at most "
                          f"{MAX_ENVELOPE_BYTES} are allowed", Mutation.NONE)
    return decode(path.read_bytes())


def _manifest_row(env: Envelope) -> tuple[str, str, int, str, str]:
    """(session_id, epoch Id, boundary, episode_id, compatibility digest) from a manifest."""
    m = env.manifest
    scope = m["sourceScope"]
    return (str(scope["sessionId"]), str(scope["epoch"]), int(scope["step"]),
            str(m["episodeId"]), digest_of(m["compatibility"]))


class _Base(ABC):
    """design/state.md §4.2–§4.7 over the backend primitives each store implements."""

    def __init__(self) -> None:
        self.commits = 0

    # -- primitives ----------------------------------------------------------------------
    @abstractmethod
    async def _rows(self, run_id: int, checkpoint_id: str | None, *,
                    with_envelope: bool) -> list[_Row]:
        """Rows of a run (one id, or all) newest first, with or without the bytes."""

    @abstractmethod
    async def _head_id(self, run_id: int) -> str | None:
        """`run_heads.high_water` of the run."""

    @abstractmethod
    async def _read_run(self, run_id: int, lease_epoch: int,
                        checkpoint_id: str) -> RunRead | None:
        """design/distribution.md §3.10's read of the run after an unknown commit outcome; the
        backend that sent the commit was ended first, so the answer is final."""

    @abstractmethod
    async def _end_backend(self, backend: Backend) -> None:
        """design/distribution.md §3.10: terminate the session that ran a commit."""

    # -- reads ---------------------------------------------------------------------------
    async def lookup(self, run_id: int, checkpoint_id: str) -> CheckpointRecord | None:
        rows = await self._rows(run_id, checkpoint_id, with_envelope=False)
        return rows[0].record if rows else None

    async def head(self, run_id: int) -> CheckpointRecord | None:
        head = await self._head_id(run_id)
        return None if head is None else await self.lookup(run_id, head)

    async def list(self, run_id: int) -> list[CheckpointRecord]:
        """Newest first by (boundary, committed_at, checkpoint_id); no bytes."""
        return [r.record for r in await self._rows(run_id, None, with_envelope=False)]

    async def select(self, run_id: int, checkpoint_id: str | None = None, *,
                     for_restore: bool = False) -> CheckpointRecord:
        """The named generation or the head (design/state.md §4.2); a restore may only take the head
        (design/state.md §4.5)."""
        if checkpoint_id is None:
            record = await self.head(run_id)
            if record is None:
                raise DomainError(ErrorCode.INCOMPATIBLE_STATE,
                                  f"run {run_id} has no durable checkpoint", Mutation.NONE)
            return record
        record = await self.lookup(run_id, checkpoint_id)
        if record is None:
            raise DomainError(ErrorCode.INCOMPATIBLE_STATE,
                              f"run {run_id} has no checkpoint {checkpoint_id}", Mutation.NONE)
        if for_restore and not record.is_head:
            head = await self.head(run_id)
            if head is not None and record.boundary < head.boundary:
                raise DomainError(ErrorCode.INVALID_ARGUMENT,
                                  f"effects beyond boundary {record.boundary} are recorded; "
                                  "only the head can be resumed", Mutation.NONE)
        return record

    async def read(self, record: CheckpointRecord) -> Envelope:
        """S1–S5 (design/state.md §4.5), in order; the decoded envelope."""
        return (await self.read_bytes(record))[1]

    async def read_bytes(self, record: CheckpointRecord) -> tuple[bytes, Envelope]:
        """`read`, also returning the stored bytes (export)."""
        run, cid = record.run_id, record.checkpoint_id
        rows = await self._rows(run, cid, with_envelope=True)
        if not rows or rows[0].envelope is None:
            raise IntegrityError("S1", run, cid, "the generation no longer exists "
                                 "(rotated away or never stored)")
        row, data = rows[0].record, rows[0].envelope
        if len(data) != row.byte_length:
            raise IntegrityError("S2", run, cid, f"the envelope has {len(data)} bytes; "
                                 f"byte_length says {row.byte_length}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != row.envelope_digest:
            raise IntegrityError("S3", run, cid, f"the envelope's SHA-256 {digest} differs "
                                 f"from envelope_digest {row.envelope_digest}")
        try:
            env = await asyncio.to_thread(decode, data)
        except EnvelopeError as exc:
            raise IntegrityError("S4", run, cid, exc.message) from exc
        session_id, epoch, boundary, episode_id, compat = _manifest_row(env)
        pairs = [
            ("checkpoint_id", row.checkpoint_id, "checkpointId", str(env.manifest["checkpointId"])),
            ("session_id", row.session_id, "sourceScope.sessionId", session_id),
            ("session_epoch", row.session_epoch, "sourceScope.epoch", epoch),
            ("boundary", row.boundary, "sourceScope.step", boundary),
            ("episode_id", row.episode_id, "episodeId", episode_id),
            ("compatibility_digest", row.compatibility_digest,
             "digest_of(compatibility)", compat),
        ]
        for column, stored, name, value in pairs:
            if stored != value:
                raise IntegrityError("S5", run, cid, f"the row's {column} {stored} differs "
                                     f"from the manifest's {name} {value}")
        return data, env

    async def export(self, run_id: int, path: Path,
                     checkpoint_id: str | None = None) -> CheckpointRecord:
        """design/state.md §4.7: select (head by default), read (S1–S5), write atomically; nothing
        is written when a check fails."""
        record = await self.select(run_id, checkpoint_id)
        data, _ = await self.read_bytes(record)
        await asyncio.to_thread(write_file, path, data)
        return record

    async def verify_stored(self, run_id: int, checkpoint_id: str | None = None
                            ) -> CheckpointRecord:
        """`verify --run RUN [--id ID]`: `read` on a stored generation."""
        record = await self.select(run_id, checkpoint_id)
        await self.read(record)
        return record

    # -- the durable commit ----------------------------------------------------------------
    async def commit(self, job: CommitJob, path: CommitPath,
                     faults: CommitFaults | None = None) -> CheckpointRecord:
        """design/state.md §4.3 through `path`; the committed record, else `CommitFailure` (module
        rules)."""
        if (job.run_id, job.lease_epoch) != (path.run_id, path.lease_epoch):
            raise DomainError(ErrorCode.INTERNAL, f"job for {job.run_id}@{job.lease_epoch} "
                              f"sent through {path.run_id}@{path.lease_epoch}", Mutation.NONE)
        path_keep = getattr(path, "keep", DEFAULT_KEEP)
        if not 1 <= job.keep <= 100 or job.keep != path_keep:
            raise DomainError(ErrorCode.INTERNAL, f"keep {job.keep} is not in 1..100 or "
                              f"differs from the commit path's {path_keep}", Mutation.NONE)
        f = faults if faults is not None else CommitFaults()
        cid = job.checkpoint_id
        if f.abort_before_commit_for == cid:
            f.fired.append(f"abort_before_commit:{cid}")
            raise CommitFailure("aborted before commit",
                                f"checkpoint {cid}: aborted before commit")
        checkpoint = job.checkpoint()
        while True:
            backend: Backend | None = None
            simulated = False
            try:
                if f.lose_commit_request_for == cid:
                    f.lose_commit_request_for = None
                    f.fired.append(f"lose_commit_request:{cid}")
                    simulated = True
                else:
                    await self._send(job, path, checkpoint)
                    if f.lose_commit_reply_for == cid:
                        f.lose_commit_reply_for = None
                        f.fired.append(f"lose_commit_reply:{cid}")
                        simulated = True
                    else:
                        break
            except UnknownOutcome as exc:
                backend = exc.backend
            decision = await self._until_answered(
                partial(self._resolve, job, path, backend, simulated=simulated))
            if decision == "committed":
                break
            if decision == "lost":
                raise CommitFailure("grant lost", f"checkpoint {cid}: the commit's outcome is "
                                    "unknown and the grant is lost", mutation=Mutation.UNKNOWN)
        self.commits += 1
        record = await self._until_answered(partial(self.lookup, job.run_id, cid))
        if record is None:
            raise DomainError(ErrorCode.INTERNAL, f"checkpoint {cid} committed but not found",
                              Mutation.UNKNOWN)
        return record

    @staticmethod
    async def _until_answered(read: Callable[[], Awaitable[T]]) -> T:
        """A read after a commit, repeated while the database does not answer (module
        rules): giving up would report a commit that may have landed as failed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RESOLVE_S
        delay = RESOLVE_BACKOFF_S
        while True:
            try:
                return await read()  # each read is bounded by the store's own timeout
            except DomainError as exc:
                raise_if_cancelled()
                if exc.code != ErrorCode.BACKEND_FAILURE or loop.time() + delay > deadline:
                    raise
                log.warning("checkpoint.resolve_retry", error=exc.message)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RESOLVE_BACKOFF_MAX_S)

    async def _send(self, job: CommitJob, path: CommitPath, checkpoint: Checkpoint) -> None:
        cid = job.checkpoint_id
        try:
            if job.finish is None:
                await path.commit(job.effects, checkpoint)
            else:
                fin = job.finish
                await path.finish(fin.state, fin.outcome, job.effects,
                                  boundaries=fin.boundaries, session_epoch=fin.session_epoch,
                                  checkpoint=checkpoint)
        except Fenced as exc:
            raise CommitFailure("fenced", f"checkpoint {cid}: {exc.message}") from exc
        except LeaseLost as exc:
            reason = "fenced" if isinstance(exc.__cause__, Fenced) else "grant lost"
            raise CommitFailure(reason, f"checkpoint {cid}: {exc}") from exc
        except (DuplicateEffect, ConflictingEffect) as exc:
            log.error(exc.error, run=job.run_id, lease_epoch=job.lease_epoch,
                      checkpoint_id=cid, key=exc.key, existing_epoch=exc.existing_epoch,
                      digest=exc.digest.hex())
            raise CommitFailure(exc.error, f"checkpoint {cid}: {exc.message}") from exc
        except HeadRegression as exc:
            raise CommitFailure("head regression", f"checkpoint {cid}: {exc.message}") from exc
        except (TerminalFinal, LedgerImmutable) as exc:
            raise CommitFailure(exc.code, f"checkpoint {cid}: {exc.message}",
                                code=ErrorCode.INTERNAL) from exc
        except Transient as exc:
            if await self.lookup(job.run_id, cid) is not None:
                raise CommitFailure("reused id", f"checkpoint id {cid} of run {job.run_id} is "
                                    "already stored; ids are never reused",
                                    code=ErrorCode.INTERNAL) from exc
            raise CommitFailure("transient", f"checkpoint {cid}: {exc.message}",
                                retryable=True) from exc

    async def _resolve(self, job: CommitJob, path: CommitPath, backend: Backend | None, *,
                       simulated: bool) -> str:
        """design/state.md §4.6: end the old backend, read design/distribution.md §3.10, decide."""
        if backend is None and not simulated:
            return "lost"
        if backend is not None:
            await self._end_backend(backend)
        read = await self._read_run(job.run_id, job.lease_epoch, job.checkpoint_id)
        final = job.finish.state if job.finish is not None else None
        decision = decide(read, lease_epoch=job.lease_epoch, node_id=path.node_id,
                          checkpoint_id=job.checkpoint_id, final=final)
        log.info("checkpoint.resolved", run=job.run_id, lease_epoch=job.lease_epoch,
                 checkpoint_id=job.checkpoint_id, decision=decision)
        return decision


class CheckpointStore(Protocol):
    """design/state.md §4.2's async API; `PgCheckpointStore` and `MemoryCheckpointStore` implement
    it."""

    commits: int

    async def commit(self, job: CommitJob, path: CommitPath,
                     faults: CommitFaults | None = None) -> CheckpointRecord: ...

    async def lookup(self, run_id: int, checkpoint_id: str) -> CheckpointRecord | None: ...

    async def head(self, run_id: int) -> CheckpointRecord | None: ...

    async def select(self, run_id: int, checkpoint_id: str | None = None, *,
                     for_restore: bool = False) -> CheckpointRecord: ...

    async def read(self, record: CheckpointRecord) -> Envelope: ...

    async def read_bytes(self, record: CheckpointRecord) -> tuple[bytes, Envelope]: ...

    async def list(self, run_id: int) -> list[CheckpointRecord]: ...

    async def export(self, run_id: int, path: Path,
                     checkpoint_id: str | None = None) -> CheckpointRecord: ...

    async def verify_stored(self, run_id: int, checkpoint_id: str | None = None
                            ) -> CheckpointRecord: ...


# --------------------------------------------------------------------------------------------
# PostgreSQL

ROWS: Final = """
SELECT c.run_id, c.checkpoint_id, c.lease_epoch, c.node_id, c.session_id, c.session_epoch,
       c.episode_id, c.boundary, c.compatibility_digest, c.envelope_digest, c.byte_length,
       c.committed_at, coalesce(h.high_water = c.checkpoint_id, false) AS is_head
  FROM flyd.checkpoints c LEFT JOIN flyd.run_heads h USING (run_id)
 WHERE c.run_id = %(run)s AND (%(ckpt)s::text IS NULL OR c.checkpoint_id = %(ckpt)s::text)
 ORDER BY c.boundary DESC, c.committed_at DESC, c.checkpoint_id DESC
"""

ROWS_WITH_ENVELOPE: Final = ROWS.replace("AS is_head\n", "AS is_head, c.envelope\n")

HEAD_ID: Final = "SELECT high_water FROM flyd.run_heads WHERE run_id = %(run)s"

IMPORT_HEAD: Final = """
UPDATE flyd.run_heads SET high_water = %(ckpt)s, boundary = %(boundary)s, lease_epoch = 0
 WHERE run_id = %(run)s
"""


def _record(r: Sequence[Any]) -> CheckpointRecord:
    return CheckpointRecord(
        run_id=int(r[0]), checkpoint_id=str(r[1]), lease_epoch=int(r[2]), node_id=str(r[3]),
        session_id=str(r[4]), session_epoch=f"e{int(r[5])}", episode_id=str(r[6]),
        boundary=int(r[7]), compatibility_digest=str(r[8]), envelope_digest=bytes(r[9]).hex(),
        byte_length=int(r[10]), committed_at=r[11], is_head=bool(r[12]))


class PgCheckpointStore(_Base):
    """The checkpoint store on the distribution schema (module rules)."""

    def __init__(self, dsn: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 application_name: str | None = None) -> None:
        super().__init__()
        self._dsn = dsn
        self._timeout_s = timeout_s
        self._reads = ReadConnection(dsn, within_s=timeout_s,
                                     application_name=application_name)

    async def close(self) -> None:
        await self._reads.close()

    async def _fetch(self, what: str, query: str, params: Mapping[str, Any], *,
                     binary: bool = False) -> list[Any]:
        """An idempotent statement (every caller's is a read, or ends a backend), repeated on
        a new connection while the session is lost, within `timeout_s` (module rules)."""
        async def op(conn: sql.ClosingConnection) -> list[Any]:
            cur = await conn.execute(query, params, binary=binary)
            return await cur.fetchall() if cur.description is not None else []

        try:
            return await self._reads.read(op, what)
        except (psycopg.Error, TimeoutError, OSError) as exc:
            raise _backend_failure(what, exc) from exc

    async def _rows(self, run_id: int, checkpoint_id: str | None, *,
                    with_envelope: bool) -> list[_Row]:
        query = ROWS_WITH_ENVELOPE if with_envelope else ROWS
        rows = await self._fetch("read checkpoints", query,
                                 {"run": run_id, "ckpt": checkpoint_id}, binary=with_envelope)
        return [_Row(_record(r), bytes(r[13]) if with_envelope else None) for r in rows]

    async def _head_id(self, run_id: int) -> str | None:
        rows = await self._fetch("read head", HEAD_ID, {"run": run_id})
        return None if not rows or rows[0][0] is None else str(rows[0][0])

    async def _read_run(self, run_id: int, lease_epoch: int,
                        checkpoint_id: str) -> RunRead | None:
        rows = await self._fetch("read run", sql.READ_RUN, {
            "run": run_id, "epoch": lease_epoch, "ckpt": checkpoint_id})
        if not rows:
            return None
        r = rows[0]
        return RunRead(state=r[0], lease_epoch=int(r[1]), owner_node=r[2], live=bool(r[3]),
                       high_water=r[4], boundary=int(r[5]), checkpoint_committed=bool(r[6]))

    async def _end_backend(self, backend: Backend) -> None:
        await self._fetch("end backend", sql.END_BACKEND, {
            "pid": backend.pid, "backend_start": backend.backend_start,
            "wait_ms": max(50, round(self._timeout_s * 500))})

    async def import_envelope(self, data: bytes, *, spec: Mapping[str, Any] | None = None,
                              run_id: int | None = None, submit_key: str | None = None,
                              max_attempts: int = 3, keep: int = 3) -> CheckpointRecord:
        """design/state.md §4.7 import: R1–R8, then one transaction: submit the run (unless `run_id`
        names a pending one), insert the row at lease epoch 0, move the head, rotate. The fence
        refuses lease epoch 0 once the run has been granted (LF001 → `CommitFailure`
        "fenced")."""
        if len(data) > MAX_ENVELOPE_BYTES:
            raise DomainError(ErrorCode.UNSUPPORTED, f"an envelope of {len(data)} bytes; at "
                              f"most {MAX_ENVELOPE_BYTES} are allowed", Mutation.NONE)
        env = await asyncio.to_thread(decode, data)
        session_id, epoch, boundary, episode_id, compat = _manifest_row(env)
        cid = str(env.manifest["checkpointId"])
        digest = hashlib.sha256(data).digest()
        run_spec = {**dict(spec or {}),
                    "startFrom": {"checkpointId": cid, "envelopeDigest": digest.hex()}}
        try:
            async with asyncio.timeout(self._timeout_s):
                conn = await sql.ClosingConnection.connect(self._dsn, autocommit=True)
                async with conn:
                    async with conn.transaction():
                        run = run_id
                        if run is None:
                            cur = await conn.execute(sql.SUBMIT, {
                                "key": submit_key, "spec": Jsonb(run_spec),
                                "max_attempts": max_attempts})
                            row = await cur.fetchone()
                            if row is None or not row[1]:
                                raise DomainError(ErrorCode.CONFLICT, f"submit key "
                                                  f"{submit_key!r} is already used",
                                                  Mutation.NONE)
                            run = int(row[0])
                        base = {"run": run, "epoch": 0, "node": IMPORT_NODE, "ckpt": cid}
                        await conn.execute(sql.INSERT_CHECKPOINT, {
                            **base, "session_id": session_id,
                            "session_epoch": epoch_number(epoch), "episode_id": episode_id,
                            "boundary": boundary, "compat": compat, "env_digest": digest,
                            "byte_length": len(data), "envelope": data})
                        await conn.execute(IMPORT_HEAD, {**base, "boundary": boundary})
                        await conn.execute(sql.ROTATE, {**base, "keep": keep})
        except psycopg.Error as exc:
            if exc.sqlstate == "LF001":
                raise CommitFailure("fenced", f"import of {cid}: {exc}") from exc
            raise _backend_failure("import", exc) from exc
        except (TimeoutError, OSError) as exc:
            raise _backend_failure("import", exc) from exc
        record = await self.lookup(run, cid)
        if record is None:
            raise DomainError(ErrorCode.INTERNAL, f"imported {cid} not found", Mutation.UNKNOWN)
        return record


# --------------------------------------------------------------------------------------------
# Memory


class MemoryCheckpointStore(_Base):
    """The same rules over `MemStore`'s tables (design/state.md §4.8); the lease store enforces
    fence, head, rotation and ledger rules, exactly as the triggers do on PostgreSQL."""

    def __init__(self, mem: MemStore) -> None:
        super().__init__()
        self.mem = mem

    async def _rows(self, run_id: int, checkpoint_id: str | None, *,
                    with_envelope: bool) -> list[_Row]:
        tables = self.mem.dump()
        head = await self._head_id(run_id)
        out: list[_Row] = []
        for c in tables["checkpoints"]:
            if c["run_id"] != run_id or checkpoint_id not in (None, c["checkpoint_id"]):
                continue
            rec = CheckpointRecord(
                run_id=run_id, checkpoint_id=c["checkpoint_id"], lease_epoch=c["lease_epoch"],
                node_id=c["node_id"], session_id=c["session_id"],
                session_epoch=f"e{c['session_epoch']}", episode_id=c["episode_id"],
                boundary=c["boundary"], compatibility_digest=c["compatibility_digest"],
                envelope_digest=bytes(c["envelope_digest"]).hex(),
                byte_length=c["byte_length"], committed_at=c["committed_at"],
                is_head=c["checkpoint_id"] == head)
            out.append(_Row(rec, bytes(c["envelope"]) if with_envelope else None))
        out.sort(key=lambda r: (r.record.boundary, r.record.committed_at,
                                r.record.checkpoint_id), reverse=True)
        return out

    async def _head_id(self, run_id: int) -> str | None:
        for h in self.mem.dump()["run_heads"]:
            if h["run_id"] == run_id:
                return None if h["high_water"] is None else str(h["high_water"])
        return None

    async def _read_run(self, run_id: int, lease_epoch: int,
                        checkpoint_id: str) -> RunRead | None:
        return await self.mem.read_run(run_id, lease_epoch, checkpoint_id)

    async def _end_backend(self, backend: Backend) -> None:
        await self.mem.end_backend(backend)
