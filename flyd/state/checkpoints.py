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
- `CheckpointStore` reads and imports through the lease `Store` (`read_checkpoints`,
  `read_head`, `read_run`, `end_backend`, `import_checkpoint`), which owns connections and SQL:
  `PgStore` reads checkpoints on its own `:checkpoints` session and repeats a read on a new
  connection while the session is lost (a PostgreSQL blip ended it), within its bound, so a
  connection left stale by a blip never fails a grant's first head read or a recovery's read;
  `MemStore` reads its tables. A lease store failure on a read or an import is
  `BACKEND_FAILURE`/`unknown`; an import refused by the fence is `CommitFailure` "fenced".
- An import inserts the row with node id `import`; the run's spec gains
  `startFrom: {checkpointId, envelopeDigest}`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import structlog

from flyd.cancel import raise_if_cancelled
from flyd.leases.core import LeaseLost
from flyd.leases.resolve import decide
from flyd.leases.runtime import finish_effect
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
    Import,
    LedgerImmutable,
    RunRead,
    Store,
    StoredCheckpoint,
    StoreError,
    TerminalFinal,
    TerminalState,
    Transient,
    UnknownOutcome,
)
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
    "verify_file",
    "write_file",
]

log = structlog.get_logger("flyd.state.checkpoints")

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


class CheckpointStore:
    """design/state.md §4.2–§4.7 over a lease `Store` (`PgStore` in production, `MemStore` in
    tests), which owns the connections, the reconnect and the SQL; this class owns what the rows
    mean."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.commits = 0

    # -- primitives ----------------------------------------------------------------------
    async def _rows(self, run_id: int, checkpoint_id: str | None, *,
                    with_envelope: bool) -> list[StoredCheckpoint]:
        """Rows of a run (one id, or all) newest first, with or without the bytes."""
        return await _answered(self.store.read_checkpoints(
            run_id, checkpoint_id, with_envelope=with_envelope))

    async def _read_run(self, run_id: int, lease_epoch: int,
                        checkpoint_id: str) -> RunRead | None:
        return await _answered(self.store.read_run(run_id, lease_epoch, checkpoint_id))

    async def _end_backend(self, backend: Backend) -> None:
        await _answered(self.store.end_backend(backend))

    # -- reads ---------------------------------------------------------------------------
    async def lookup(self, run_id: int, checkpoint_id: str) -> CheckpointRecord | None:
        rows = await self._rows(run_id, checkpoint_id, with_envelope=False)
        return _record(rows[0]) if rows else None

    async def head(self, run_id: int) -> CheckpointRecord | None:
        head = await _answered(self.store.read_head(run_id))
        return None if head is None else await self.lookup(run_id, head)

    async def list(self, run_id: int) -> list[CheckpointRecord]:
        """Newest first by (boundary, committed_at, checkpoint_id); no bytes."""
        return [_record(r) for r in await self._rows(run_id, None, with_envelope=False)]

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
        row, data = _record(rows[0]), rows[0].envelope
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

    async def import_envelope(self, data: bytes, *, spec: Mapping[str, Any] | None = None,
                              run_id: int | None = None, submit_key: str | None = None,
                              max_attempts: int = 3, keep: int = 3) -> CheckpointRecord:
        """design/state.md §4.7 import: R1–R8, then the lease store's one transaction: submit the
        run (unless `run_id` names a pending one), insert the row at lease epoch 0, move the head,
        rotate. The fence refuses lease epoch 0 once the run has been granted
        (`CommitFailure` "fenced")."""
        if len(data) > MAX_ENVELOPE_BYTES:
            raise DomainError(ErrorCode.UNSUPPORTED, f"an envelope of {len(data)} bytes; at "
                              f"most {MAX_ENVELOPE_BYTES} are allowed", Mutation.NONE)
        env = await asyncio.to_thread(decode, data)
        session_id, epoch, boundary, episode_id, compat = _manifest_row(env)
        cid = str(env.manifest["checkpointId"])
        digest = hashlib.sha256(data).digest()
        run_spec = {**dict(spec or {}),
                    "startFrom": {"checkpointId": cid, "envelopeDigest": digest.hex()}}
        checkpoint = Checkpoint(checkpoint_id=cid, session_id=session_id,
                                session_epoch=epoch_number(epoch), episode_id=episode_id,
                                boundary=boundary, compatibility_digest=compat,
                                envelope_digest=digest, envelope=data)
        try:
            run = await self.store.import_checkpoint(Import(
                checkpoint, run_spec, run_id=run_id, submit_key=submit_key,
                max_attempts=max_attempts, keep=keep))
        except Fenced as exc:
            raise CommitFailure("fenced", f"import of {cid}: {exc.message}") from exc
        except StoreError as exc:
            raise DomainError(ErrorCode.BACKEND_FAILURE, exc.message, Mutation.UNKNOWN) from exc
        if run is None:
            raise DomainError(ErrorCode.CONFLICT, f"submit key {submit_key!r} is already used",
                              Mutation.NONE)
        record = await self.lookup(run, cid)
        if record is None:
            raise DomainError(ErrorCode.INTERNAL, f"imported {cid} not found", Mutation.UNKNOWN)
        return record


async def _answered(call: Awaitable[T]) -> T:
    """A lease store read, its failure a `BACKEND_FAILURE` with unknown mutation (module
    rules; the store's message names the read): the retry of the reads after a commit keys
    on that code."""
    try:
        return await call
    except StoreError as exc:
        raise DomainError(ErrorCode.BACKEND_FAILURE, exc.message, Mutation.UNKNOWN) from exc


def _record(r: StoredCheckpoint) -> CheckpointRecord:
    return CheckpointRecord(
        run_id=r.run_id, checkpoint_id=r.checkpoint_id, lease_epoch=r.lease_epoch,
        node_id=r.node_id, session_id=r.session_id, session_epoch=f"e{r.session_epoch}",
        episode_id=r.episode_id, boundary=r.boundary,
        compatibility_digest=r.compatibility_digest, envelope_digest=r.envelope_digest.hex(),
        byte_length=r.byte_length, committed_at=r.committed_at, is_head=r.is_head)
