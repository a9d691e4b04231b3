"""The `Store` contract: design/distribution.md §3 as async methods with typed results and errors.

Why: the node runtime (design/distribution.md §5) must run unchanged against PostgreSQL (`PgStore`,
production and tier 2) and against `MemStore` (virtual time, tier 1). Both implement this protocol
and are held to the same behaviour by `tests/distribution/test_contract.py`.

Rules every implementation keeps:
- Expiry is judged only by the store, at its own clock (`app_now()`, R1); callers never pass a
  timestamp for lease arithmetic, only durations (`ttl_s`, `backoff_s`).
- Results are plain values; a missing run or a lost row is an empty result, never an exception.
- Errors are `StoreError` values with a `code`, a `message` and a `mutation` certainty:
  `Fenced` (LF001) and the other server refusals are `none` (nothing committed, for certain);
  `Transient` is `none` too (the server reported an error, or the request never left);
  `UnknownOutcome` is `unknown` (the reply was lost after COMMIT was sent) and carries the
  `Backend` to end before reading the outcome (design/distribution.md §3.10).
- `commit` is the fenced group commit of design/distribution.md §3.5; a plain INSERT of every
  effect, never `ON CONFLICT`: a key already present raises `DuplicateEffect` (same digest) or
  `ConflictingEffect` (another digest), classified by reading the existing row
  (design/distribution.md §6.4).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Literal, Protocol

import orjson

from flyd.leases.fit import Fit

RunState = Literal["pending", "running", "succeeded", "failed", "cancelled"]
TerminalState = Literal["succeeded", "failed", "cancelled"]
TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})
NodeState = Literal["active", "draining", "stopped"]


# --------------------------------------------------------------------------------------------
# Errors


class StoreError(Exception):
    """A store refusal or failure as a value: code, message, mutation certainty."""

    code: str = "STORE_ERROR"
    mutation: str = "none"

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(f"{self.code}: {message}")


class Fenced(StoreError):
    """LF001: not committed; the grant is lost (cancel the local scope)."""

    code = "LF001"


class HeadRegression(StoreError):
    """LF002: the head would move backwards (a bug; the run fails, design/distribution.md §6.4)."""

    code = "LF002"


class TerminalFinal(StoreError):
    """LF003: a terminal run may not change."""

    code = "LF003"


class LedgerImmutable(StoreError):
    """LF004: ledger rows are never updated or deleted."""

    code = "LF004"


class _EffectClash(StoreError):
    code = "23505"
    error: str = ""

    def __init__(self, key: str, existing_epoch: int, digest: bytes, message: str) -> None:
        self.key = key
        self.existing_epoch = existing_epoch
        self.digest = digest
        super().__init__(message)

    def outcome(self) -> dict[str, Any]:
        """The run's failure outcome (design/distribution.md §6.4):
        `{error, key, existingEpoch, digest}`."""
        return {"error": self.error, "key": self.key, "existingEpoch": self.existing_epoch,
                "digest": self.digest.hex()}


class DuplicateEffect(_EffectClash):
    """23505 on `effects_pkey`, the stored payload has the same digest."""

    error = "effect_duplicate"


class ConflictingEffect(_EffectClash):
    """23505 on `effects_pkey`, the stored payload has another digest."""

    error = "effect_conflict"


class Transient(StoreError):
    """Not committed for certain: a server error, a timeout before the commit was sent."""

    code = "TRANSIENT"


class UnknownOutcome(StoreError):
    """The connection failed after COMMIT was sent: resolve by reading
    (design/distribution.md §3.10, §5.6)."""

    code = "UNKNOWN_OUTCOME"
    mutation = "unknown"

    def __init__(self, message: str, backend: Backend | None) -> None:
        self.backend = backend
        super().__init__(message)


class SpecMismatch(StoreError):
    """Submit with a key already used for another spec (design/distribution.md §3.2: a client
    error)."""

    code = "SUBMIT_KEY_CONFLICT"


# --------------------------------------------------------------------------------------------
# Values


@dataclass(frozen=True, slots=True)
class Backend:
    """Identity of the server session that ran a commit (pid + start guards against reuse)."""

    pid: int
    backend_start: datetime


@dataclass(frozen=True, slots=True)
class NodeInfo:
    node_id: str
    node_name: str
    host: str
    pid: int
    version: str
    capacity: int


@dataclass(frozen=True, slots=True)
class Submitted:
    run_id: int
    created: bool
    same_spec: bool


@dataclass(frozen=True, slots=True)
class Grant:
    """One row of claim (design/distribution.md §3.3): the node resumes from `high_water`, fresh
    when None."""

    run_id: int
    lease_epoch: int
    lease_expires_at: datetime
    attempt: int
    cancel_requested: bool
    spec: Mapping[str, Any]
    faults_fired: tuple[str, ...]
    high_water: str | None
    boundary: int
    #: the run's own grant budget (`runs.max_attempts`): the node compares `attempt` with it,
    #: not with its own `[leases] max_attempts`
    max_attempts: int


@dataclass(frozen=True, slots=True)
class Renewed:
    run_id: int
    lease_epoch: int
    lease_expires_at: datetime
    cancel_requested: bool


@dataclass(frozen=True, slots=True)
class Reaped:
    run_id: int
    lease_epoch: int
    state: TerminalState


class CanonicalPayload(Mapping[str, Any]):
    """A payload held as its canonical JSON bytes (the session's pending effects): a group
    commit sends the bytes as they are; it is parsed only when read as a mapping (the
    in-memory store), so committing thousands of effects builds no objects per effect."""

    __slots__ = ("_value", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._value: dict[str, Any] | None = None

    def _parsed(self) -> dict[str, Any]:
        if self._value is None:
            self._value = orjson.loads(self.data)
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self._parsed()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._parsed())

    def __len__(self) -> int:
        return len(self._parsed())


@dataclass(frozen=True, slots=True)
class Effect:
    """A ledger row to insert: `boundary-<k>` or `finish` (design/distribution.md §6.1). `result` is
    what the boundary produced (`flyd.effects.result`, the line `flyctl runs export` prints),
    outside the digest; None for `finish` and for writers that keep none."""

    key: str
    session_epoch: int
    boundary: int | None
    payload: Mapping[str, Any]
    digest: bytes
    result: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A checkpoint row to insert with the group commit (columns of `flyd.checkpoints`)."""

    checkpoint_id: str
    session_id: str
    session_epoch: int
    episode_id: str
    boundary: int
    compatibility_digest: str
    envelope_digest: bytes
    envelope: bytes

    @property
    def byte_length(self) -> int:
        return len(self.envelope)


@dataclass(frozen=True, slots=True)
class Finish:
    state: TerminalState
    outcome: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Commit:
    """One fenced transaction (design/distribution.md §3.5): effects, optionally a checkpoint + head
    move + rotation, optionally `finish_run` last."""

    run_id: int
    lease_epoch: int
    node_id: str
    effects: tuple[Effect, ...] = ()
    checkpoint: Checkpoint | None = None
    finish: Finish | None = None
    keep: int = 3


    def size(self) -> tuple[int, int]:
        """(rows, bytes): the rows it inserts and the bytes it sends (effect payloads and
        results as two JSON documents, and the envelope), which its deadline accounts for."""
        rows = len(self.effects) + (1 if self.checkpoint is not None else 0)
        envelope = len(self.checkpoint.envelope) if self.checkpoint is not None else 0
        if not self.effects:
            return rows, envelope
        return rows, (envelope + len(payload_document(self.effects))
                      + len(result_document(self.effects)))


#: What C (`commit_timeout_s`) and B (`commit_budget_s`) are sized for: a group commit of up to
#: this many rows and bytes (docs/leases.md, "Large group commits").
BASE_COMMIT_ROWS: Final = 256
BASE_COMMIT_BYTES: Final = 1 << 20
#: The extra time a larger commit is allowed, per row and per MiB beyond the base.
EXTRA_S_PER_ROW: Final = 0.0002
EXTRA_S_PER_MIB: Final = 0.25


def payload_document(effects: Sequence[Effect]) -> bytes:
    """The effects' payloads as one JSON array, in order: the group commit sends it as a
    single `jsonb` parameter, parsed by the server in one pass."""
    return b"[" + b",".join(
        e.payload.data if isinstance(e.payload, CanonicalPayload)
        else orjson.dumps(e.payload, default=dict) for e in effects) + b"]"


def result_document(effects: Sequence[Effect]) -> bytes:
    """The effects' results as one JSON array, in order, `null` where there is none: sent
    beside `payload_document` in the same insert."""
    return b"[" + b",".join(
        b"null" if e.result is None
        else e.result.data if isinstance(e.result, CanonicalPayload)
        else orjson.dumps(e.result, default=dict) for e in effects) + b"]"


def commit_allowance_s(rows: int, size: int) -> float:
    """Seconds a group commit of `rows` rows and `size` bytes may take beyond C (and must
    have beyond B on its lease before it starts); 0 up to the base size."""
    extra_rows = max(0, rows - BASE_COMMIT_ROWS)
    extra_bytes = max(0, size - BASE_COMMIT_BYTES)
    return extra_rows * EXTRA_S_PER_ROW + extra_bytes / (1 << 20) * EXTRA_S_PER_MIB


@dataclass(frozen=True, slots=True)
class Committed:
    """`finished` is `finish_run`'s answer (`'finished'`/`'already'`), None without a finish."""

    finished: str | None = None
    backend: Backend | None = None


@dataclass(frozen=True, slots=True)
class RunRead:
    """What design/distribution.md §3.10 reads after an unknown commit outcome: the run's state
    and epoch, whether its lease is live, its head, and whether the checkpoint committed, which
    is all the decision needs."""

    state: RunState
    lease_epoch: int
    owner_node: str | None
    live: bool
    high_water: str | None
    boundary: int
    checkpoint_committed: bool


@dataclass(frozen=True, slots=True)
class StoredCheckpoint:
    """A `flyd.checkpoints` row and whether its run's head names it (design/state.md §4.2);
    `envelope` is None unless the read asked for the bytes."""

    run_id: int
    checkpoint_id: str
    lease_epoch: int
    node_id: str
    session_id: str
    session_epoch: int
    episode_id: str
    boundary: int
    compatibility_digest: str
    envelope_digest: bytes
    byte_length: int
    committed_at: datetime
    is_head: bool
    envelope: bytes | None


@dataclass(frozen=True, slots=True)
class Import:
    """design/state.md §4.7's import, one transaction: `checkpoint` at lease epoch 0 (node id
    `import`) on the pending run `run_id`, or on a new run submitted with `submit_key`, `spec`
    and `max_attempts`; the head moves to it and rotation keeps `keep`."""

    checkpoint: Checkpoint
    spec: Mapping[str, Any]
    run_id: int | None = None
    submit_key: str | None = None
    max_attempts: int = 3
    keep: int = 3


IMPORT_NODE: Final = "import"


@dataclass(frozen=True, slots=True)
class Released:
    run_id: int
    lease_epoch: int


@dataclass(frozen=True, slots=True)
class Cancelled:
    run_id: int
    state: RunState


@dataclass(frozen=True, slots=True)
class Held:
    run_id: int
    lease_epoch: int


# --------------------------------------------------------------------------------------------


class Store(Protocol):
    """design/distribution.md §3 behind one interface; every method is one round trip unless written
    otherwise."""

    async def register_node(self, node: NodeInfo) -> None:
        """design/distribution.md §3.1: insert or re-activate the registry row."""

    async def set_node_state(self, node_id: str, state: NodeState,
                             reason: str | None = None) -> None:
        """design/distribution.md §3.1 / §5.8: `draining`, or `stopped` (which also sets
        `held = 0`); `reason` says why a node holds its claims (status only; None clears it)."""

    async def submit(self, key: str | None, spec: Mapping[str, Any],
                     max_attempts: int) -> Submitted:
        """design/distribution.md §3.2 (idempotent by key; repeats once when racing an insert of the
        same key)."""

    async def claim(self, node_id: str, n: int, ttl_s: float,
                    only: int | None = None, fit: Fit | None = None) -> list[Grant]:
        """design/distribution.md §3.3: up to `n` grants; `only` restricts to one run (exclusive
        runs); with `fit`, only runs whose need fits its room, together (`flyd.leases.fit`)."""

    async def renew(self, node_id: str, holds: Sequence[Held], ttl_s: float) -> list[Renewed]:
        """design/distribution.md §3.4: exactly the pairs still held come back."""

    async def reconnect_heartbeat(self) -> None:
        """design/distribution.md §5.4: re-establish the heartbeat session (closed after an
        abandoned renewal) now, outside any renewal; a no-op when it is up or the store has no
        sessions."""

    async def release(self, run_id: int, lease_epoch: int, node_id: str, *, refund: bool,
                      backoff_s: float) -> Released | None:
        """design/distribution.md §3.6: None when the grant was no longer this node's (nothing
        changed)."""

    async def reap(self, n: int) -> list[Reaped]:
        """design/distribution.md §3.7: end the expired runs that have no attempts left or a
        cancel request, and say which; any node may run it, since it is idempotent."""

    async def cancel(self, run_id: int, actor: str) -> Cancelled | None:
        """design/distribution.md §3.8: None when the run is unknown or already terminal."""

    async def own_grants(self, node_id: str) -> list[Held]:
        """design/distribution.md §3.9: runs the store shows `running` for this node."""

    async def mark_faults_fired(self, run_id: int, lease_epoch: int, node_id: str,
                                faults: Sequence[str]) -> tuple[str, ...] | None:
        """design/distribution.md §3.11: the merged set, or None when the grant is not live."""

    async def commit(self, commit: Commit) -> Committed:
        """design/distribution.md §3.5: one fenced transaction; raises the typed errors of this
        module."""

    async def read_run(self, run_id: int, lease_epoch: int,
                       checkpoint_id: str | None) -> RunRead | None:
        """design/distribution.md §3.10's read (after `end_backend`); None for an unknown run."""

    async def end_backend(self, backend: Backend) -> None:
        """design/distribution.md §3.10: terminate the server session that ran a commit of unknown
        outcome."""

    async def read_checkpoints(self, run_id: int, checkpoint_id: str | None, *,
                               with_envelope: bool) -> list[StoredCheckpoint]:
        """The run's checkpoint rows (one id, or all), newest first by (boundary,
        committed_at, checkpoint_id); the bytes only `with_envelope`."""

    async def read_head(self, run_id: int) -> str | None:
        """`run_heads.high_water` of the run (None without a head or without the run)."""

    async def import_checkpoint(self, imp: Import) -> int | None:
        """design/state.md §4.7: the run the checkpoint now heads; None when `imp.submit_key` is
        already used. A run that has been granted is `Fenced`."""

    async def requeue(self, run_id: int, actor: str) -> bool:
        """Operator requeue of a `failed` run (logged intervention)."""

    async def prune_nodes(self) -> int:
        """Delete registry rows silent for a day (design/distribution.md §3.1)."""
