"""`MemStore`: the `Store` contract in memory, at virtual instants (design/distribution.md §7.2).

Why: tier 1 runs the production node runtime against this store on a virtual-time loop; it must
give the results and typed errors `PgStore` gives for the SQL of design/distribution.md §2–§3, at
the instants `now()` returns (sim seconds). `tests/distribution/test_contract.py` holds both to the
same behaviour.

Rules reproduced from the migrations and statements:
- Tables `runs`, `run_attempts`, `nodes`, `checkpoints`, `run_heads`, `effects`, `interventions`
  as rows keyed by their primary keys; every scan is ordered by key (never by set or hash order).
- Expiry: a lease is live iff `lease_expires_at > now()`; claim and reap take expired rows
  (`<= now()`). Instants are sim seconds inside; results and `dump()` report them as
  `epoch_base + t` (UTC); `not_before = '-infinity'` is reported as `datetime.min` (UTC).
- `run_id` and `intervention_id` come from identity counters; like PostgreSQL's
  `INSERT ... ON CONFLICT DO NOTHING`, every submit draws a run id even when the key exists.
- A group commit (design/distribution.md §3.5) runs in two steps. `open_commit` runs the statements
  at the current instant, in the order of design/distribution.md §3.5: `assert_fence` (except for a
  finish-only commit, which is `finish_run` alone: it fences itself and answers `'already'` to a
  retry, design/distribution.md §3.5, §8 test 32), checkpoint insert, effect inserts, head move (a
  lower boundary raises `HeadRegression`), rotation keeping the newest `keep`, `finish_run`.
  `OpenCommit.commit()` repeats the fence at the instant of COMMIT for every written row (the
  deferred triggers), where a terminal run passes only if this very commit finished it at that epoch
  (the `flyd.finished` marker), then applies everything atomically (rotation never selects the new
  head, so the head's deferred foreign key cannot fail here).
- Locks: an open commit that passed the fence holds the run's key-share lock, so claim and reap
  skip that run (SKIP LOCKED) while renew, release, cancel and the fault mark proceed. An open
  commit that ran `finish_run` also holds the row's no-key-update lock: a statement that would
  update that run, or a second open commit on the same run's head, effect keys or checkpoint ids,
  would wait in PostgreSQL; here it raises `Transient` at once (the lock timeout, with no wait).
- An open commit idle for `idle_in_transaction_timeout_s` or longer (`<= 0` disables) is aborted,
  checked lazily whenever the store is used; `end_backend()` aborts an open commit as a
  backend kill does. A later `commit()` of an aborted one raises `Transient`:
  the server reported the session's end (25P03/57P01), nothing committed.
- Raw writes outside the protocol are no part of the store: the tests of the triggers write
  through a test double (tests/admin_store.py) that keeps LF003 and LF004 as the triggers do.
- A submit whose key holds another spec raises `SpecMismatch`. An effect key already stored
  (or repeated in the commit) is classified as design/distribution.md §6.4 reads the stored rows:
  the first key with another digest is a `ConflictingEffect`, else the first a `DuplicateEffect`,
  naming the stored row's epoch and digest.
- The reap (design/distribution.md §3.7 as `PgStore` sends it) also ends a running
  submitter-exclusive run whose lease expired while its owner (the submitter's node) has no registry
  row, is `stopped`, or has not beaten for `node_stale_after_s` (a constructor argument, default
  `LeaseParams`'): `failed`, `{error: "submitter gone"}`, unless a cancel was asked (`cancelled`) or
  its attempts were exhausted (that outcome).
- A statement PostgreSQL would refuse for another reason (a CHECK constraint, a duplicate
  checkpoint id) raises `Transient`: a server error, nothing committed.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from flyd.leases.fit import Fit, fitting
from flyd.leases.params import LeaseParams
from flyd.leases.stores.contract import (
    IMPORT_NODE,
    Backend,
    Cancelled,
    Commit,
    Committed,
    ConflictingEffect,
    DuplicateEffect,
    Effect,
    Fenced,
    Grant,
    HeadRegression,
    Held,
    Import,
    NodeInfo,
    NodeState,
    Reaped,
    Released,
    Renewed,
    RunRead,
    RunState,
    SpecMismatch,
    StoredCheckpoint,
    Submitted,
    TerminalState,
    Transient,
)

DEFAULT_EPOCH_BASE: Final = datetime(2030, 1, 1, tzinfo=UTC)
PRUNE_AFTER_S: Final = 86400.0


def _json(value: Any) -> Any:
    """A detached copy with jsonb's value domain (tuples become lists)."""
    return json.loads(json.dumps(value))


@dataclass(slots=True)
class RunRow:
    run_id: int
    submit_key: str | None
    spec: Any
    state: RunState = "pending"
    lease_epoch: int = 0
    attempt: int = 0
    max_attempts: int = 3
    owner_node: str | None = None
    lease_expires_at: float | None = None
    not_before: float = -math.inf
    cancel_requested: bool = False
    faults_fired: list[str] = field(default_factory=list)
    outcome: Any = None
    submitted_at: float = 0.0
    finished_at: float | None = None


@dataclass(slots=True)
class AttemptRow:
    run_id: int
    lease_epoch: int
    node_id: str
    granted_at: float
    ended_at: float | None = None
    end_reason: str | None = None


@dataclass(slots=True)
class NodeRow:
    node_id: str
    node_name: str
    host: str
    pid: int
    version: str
    capacity: int
    held: int
    state: str
    started_at: float
    heartbeat_at: float
    reason: str | None = None


@dataclass(slots=True)
class CheckpointRow:
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
    envelope: bytes
    committed_at: float


@dataclass(slots=True)
class HeadRow:
    run_id: int
    high_water: str | None = None
    boundary: int = 0
    lease_epoch: int = 0


@dataclass(slots=True)
class EffectRow:
    run_id: int
    effect_key: str
    lease_epoch: int
    node_id: str
    session_epoch: int
    boundary: int | None
    checkpoint_id: str | None
    payload: Any
    payload_digest: bytes
    recorded_at: float
    delivered: bool = False
    result: Any = None


@dataclass(slots=True)
class InterventionRow:
    intervention_id: int
    at: float
    actor: str
    kind: str
    run_id: int | None
    detail: Any


_TIME_COLUMNS: Final = frozenset({
    "lease_expires_at", "not_before", "submitted_at", "finished_at", "granted_at", "ended_at",
    "started_at", "heartbeat_at", "committed_at", "recorded_at", "at",
})


@dataclass(slots=True)
class _Plan:
    """What the statements of one group commit wrote, applied at COMMIT."""

    run_id: int
    lease_epoch: int
    fenced: bool = False
    checkpoint: CheckpointRow | None = None
    effects: list[EffectRow] = field(default_factory=list)
    head: HeadRow | None = None
    rotate: list[str] = field(default_factory=list)
    finish: tuple[TerminalState, Any, float] | None = None
    finished: str | None = None

    @property
    def deferred(self) -> bool:
        """Whether deferred fence triggers are queued (a row tagged with the epoch was written)."""
        return self.checkpoint is not None or bool(self.effects) or self.head is not None


class OpenCommit:
    """A group commit whose statements ran and whose COMMIT has not been sent yet."""

    def __init__(self, store: MemStore, plan: _Plan, backend: Backend, opened_at: float) -> None:
        self._store = store
        self._plan = plan
        self.backend = backend
        self.opened_at = opened_at
        self.ended: str | None = None

    @property
    def run_id(self) -> int:
        return self._plan.run_id

    async def commit(self) -> Committed:
        """COMMIT: the deferred fence at this instant, then every write at once."""
        return self._store._finish_commit(self)

    def abort(self) -> None:
        """ROLLBACK (idempotent): nothing of this commit is ever applied."""
        self._store._end(self, "aborted")


class MemStore:
    """The design/distribution.md §3 statements over in-memory tables at the instants `now()`
    returns."""

    def __init__(self, now: Callable[[], float], *, idle_in_transaction_timeout_s: float = 1.5,
                 epoch_base: datetime = DEFAULT_EPOCH_BASE,
                 node_stale_after_s: float = LeaseParams().node_stale_after_s) -> None:
        self._now = now
        self.idle_in_transaction_timeout_s = idle_in_transaction_timeout_s
        self.node_stale_after_s = node_stale_after_s
        self.epoch_base = epoch_base
        self._runs: dict[int, RunRow] = {}
        self._by_key: dict[str, int] = {}
        self._attempts: dict[tuple[int, int], AttemptRow] = {}
        self._nodes: dict[str, NodeRow] = {}
        self._checkpoints: dict[tuple[int, str], CheckpointRow] = {}
        self._heads: dict[int, HeadRow] = {}
        self._effects: dict[tuple[int, str], EffectRow] = {}
        self._interventions: dict[int, InterventionRow] = {}
        self._run_ids = itertools.count(1)
        self._intervention_ids = itertools.count(1)
        self._pids = itertools.count(10001)
        self._open: dict[int, OpenCommit] = {}

    # ----------------------------------------------------------------------------------------
    # time and locks

    def dt(self, t: float) -> datetime:
        """Report a sim instant as a timestamp (`-infinity` as `datetime.min`)."""
        if t == -math.inf:
            return datetime.min.replace(tzinfo=UTC)
        if t == math.inf:
            return datetime.max.replace(tzinfo=UTC)
        return self.epoch_base + timedelta(seconds=t)

    def _tick(self) -> float:
        """The statement's instant; ends open commits idle past the timeout first."""
        now = self._now()
        limit = self.idle_in_transaction_timeout_s
        if limit > 0:
            for pid in sorted(self._open):
                h = self._open[pid]
                if now - h.opened_at >= limit:
                    self._end(h, "idle_in_transaction_timeout")
        return now

    def _end(self, h: OpenCommit, reason: str) -> None:
        if h.ended is None:
            h.ended = reason
        self._open.pop(h.backend.pid, None)

    def _open_plans(self, run_id: int) -> list[_Plan]:
        return [h._plan for _, h in sorted(self._open.items()) if h._plan.run_id == run_id]

    def _key_share_locked(self, run_id: int) -> bool:
        return any(p.fenced for p in self._open_plans(run_id))

    def _row_locked(self, run_id: int) -> bool:
        return any(p.finish is not None for p in self._open_plans(run_id))

    def _wait_for_row(self, run_id: int) -> None:
        if self._row_locked(run_id):
            raise Transient(f"lock timeout: run {run_id} is being finished by an open commit")

    def _live(self, r: RunRow, now: float) -> bool:
        return r.lease_expires_at is not None and r.lease_expires_at > now

    # ----------------------------------------------------------------------------------------
    # design/distribution.md §3.1 registry

    async def register_node(self, node: NodeInfo) -> None:
        now = self._tick()
        row = self._nodes.get(node.node_id)
        if row is None:
            self._nodes[node.node_id] = NodeRow(
                node_id=node.node_id, node_name=node.node_name, host=node.host, pid=node.pid,
                version=node.version, capacity=node.capacity, held=0, state="active",
                started_at=now, heartbeat_at=now)
        else:
            row.state = "active"
            row.reason = None
            row.heartbeat_at = now

    async def set_node_state(self, node_id: str, state: NodeState,
                             reason: str | None = None) -> None:
        self._tick()
        row = self._nodes.get(node_id)
        if row is not None:
            row.state = state
            row.reason = reason
            if state == "stopped":
                row.held = 0

    async def prune_nodes(self) -> int:
        now = self._tick()
        gone = [k for k in sorted(self._nodes) if self._nodes[k].heartbeat_at < now - PRUNE_AFTER_S]
        for k in gone:
            del self._nodes[k]
        return len(gone)

    # ----------------------------------------------------------------------------------------
    # design/distribution.md §3.2 submit

    async def submit(self, key: str | None, spec: Mapping[str, Any],
                     max_attempts: int) -> Submitted:
        now = self._tick()
        spec_json = _json(dict(spec))
        run_id = next(self._run_ids)
        if max_attempts <= 0:
            raise Transient("check violation: runs.max_attempts > 0")
        if key is not None and key in self._by_key:
            existing = self._runs[self._by_key[key]]
            if existing.spec != spec_json:
                raise SpecMismatch(f"submit key {key!r} is run {existing.run_id} "
                                   f"with another spec")
            return Submitted(run_id=existing.run_id, created=False, same_spec=True)
        self._runs[run_id] = RunRow(run_id=run_id, submit_key=key, spec=spec_json,
                                    max_attempts=max_attempts, submitted_at=now)
        if key is not None:
            self._by_key[key] = run_id
        self._heads[run_id] = HeadRow(run_id=run_id)
        return Submitted(run_id=run_id, created=True, same_spec=True)

    # ----------------------------------------------------------------------------------------
    # design/distribution.md §3.3 claim, §3.4 renew, §3.6 release, §3.7 reap, §3.8 cancel, §3.9
    # sweep, §3.11 faults

    @staticmethod
    def _exclusive(spec: Any) -> bool:
        """`coalesce(spec -> 'exclusiveToSubmitter' = 'true'::jsonb, false)`: only JSON `true`."""
        return isinstance(spec, dict) and spec.get("exclusiveToSubmitter") is True

    async def claim(self, node_id: str, n: int, ttl_s: float,
                    only: int | None = None, fit: Fit | None = None) -> list[Grant]:
        now = self._tick()
        if n < 0:
            raise Transient("LIMIT must not be negative")
        picked: list[tuple[RunRow, RunState, float | None]] = []
        for run_id in sorted(self._runs):
            if len(picked) >= n:
                break
            r = self._runs[run_id]
            claimable = ((r.state == "pending" and r.not_before <= now
                          and r.attempt < r.max_attempts)
                         or (r.state == "running" and r.lease_expires_at is not None
                             and r.lease_expires_at <= now and r.attempt < r.max_attempts
                             and not r.cancel_requested))
            if not claimable:
                continue
            if only is None:
                if self._exclusive(r.spec):
                    continue
            elif run_id != only:
                continue
            if fit is not None and fit.need(r.spec) > fit.room:
                continue
            if self._key_share_locked(run_id) or self._row_locked(run_id):
                continue
            picked.append((r, r.state, r.lease_expires_at))
        if fit is not None:
            picked = picked[:fitting((fit.need(r.spec) for r, _, _ in picked), fit.room)]
        grants: list[Grant] = []
        for r, prev_state, prev_expiry in picked:
            r.state = "running"
            r.lease_epoch += 1
            r.attempt += 1
            r.owner_node = node_id
            r.lease_expires_at = now + ttl_s
            if prev_state == "running":
                old = self._attempts.get((r.run_id, r.lease_epoch - 1))
                if old is not None:
                    old.ended_at = prev_expiry
                    old.end_reason = "expired"
            self._attempts[(r.run_id, r.lease_epoch)] = AttemptRow(
                run_id=r.run_id, lease_epoch=r.lease_epoch, node_id=node_id, granted_at=now)
            head = self._heads[r.run_id]
            grants.append(Grant(
                run_id=r.run_id, lease_epoch=r.lease_epoch,
                lease_expires_at=self.dt(r.lease_expires_at), attempt=r.attempt,
                cancel_requested=r.cancel_requested, spec=_json(r.spec),
                faults_fired=tuple(r.faults_fired), high_water=head.high_water,
                boundary=head.boundary, max_attempts=r.max_attempts))
        return grants

    async def reconnect_heartbeat(self) -> None:
        """No sessions in memory: nothing to re-establish."""

    async def renew(self, node_id: str, holds: Sequence[Held], ttl_s: float) -> list[Renewed]:
        now = self._tick()
        matched: dict[int, RunRow] = {}
        for h in holds:
            r = self._runs.get(h.run_id)
            if (r is not None and r.lease_epoch == h.lease_epoch and r.state == "running"
                    and r.owner_node == node_id and self._live(r, now)):
                self._wait_for_row(r.run_id)
                matched[r.run_id] = r
        node = self._nodes.get(node_id)
        if node is not None:
            node.heartbeat_at = now
            node.held = len(holds)
        out: list[Renewed] = []
        for run_id in sorted(matched):
            r = matched[run_id]
            r.lease_expires_at = now + ttl_s
            out.append(Renewed(run_id=run_id, lease_epoch=r.lease_epoch,
                               lease_expires_at=self.dt(r.lease_expires_at),
                               cancel_requested=r.cancel_requested))
        return out

    async def release(self, run_id: int, lease_epoch: int, node_id: str, *, refund: bool,
                      backoff_s: float) -> Released | None:
        now = self._tick()
        r = self._runs.get(run_id)
        if (r is None or r.lease_epoch != lease_epoch or r.state != "running"
                or r.owner_node != node_id):
            return None
        self._wait_for_row(run_id)
        if refund and r.attempt < 1:
            raise Transient("check violation: runs.attempt >= 0")
        r.state = "pending"
        r.owner_node = None
        r.lease_expires_at = None
        r.attempt -= 1 if refund else 0
        r.not_before = now + backoff_s
        a = self._attempts.get((run_id, lease_epoch))
        if a is None:
            return None
        a.ended_at = now
        a.end_reason = "released"
        return Released(run_id=run_id, lease_epoch=lease_epoch)

    async def reap(self, n: int) -> list[Reaped]:
        now = self._tick()
        if n < 0:
            raise Transient("LIMIT must not be negative")
        picked: list[RunRow] = []
        for run_id in sorted(self._runs):
            if len(picked) >= n:
                break
            r = self._runs[run_id]
            if (r.state == "running" and r.lease_expires_at is not None
                    and r.lease_expires_at <= now
                    and (r.attempt >= r.max_attempts or r.cancel_requested
                         or self._submitter_gone(r, now))
                    and not self._key_share_locked(run_id) and not self._row_locked(run_id)):
                picked.append(r)
        out: list[Reaped] = []
        for r in picked:
            prev_expiry = r.lease_expires_at
            cancelled = r.cancel_requested
            state: TerminalState = "cancelled" if cancelled else "failed"
            r.state = state
            r.lease_epoch += 1
            r.owner_node = None
            r.lease_expires_at = None
            r.finished_at = now
            if cancelled:
                r.outcome = {"reaped": "cancel requested, holder gone"}
            elif r.attempt >= r.max_attempts:
                r.outcome = {"reaped": "attempts exhausted"}
            else:
                r.outcome = {"error": "submitter gone"}
            a = self._attempts.get((r.run_id, r.lease_epoch - 1))
            if a is None:
                continue
            a.ended_at = prev_expiry
            a.end_reason = "cancelled" if cancelled else "exhausted"
            out.append(Reaped(run_id=r.run_id, lease_epoch=r.lease_epoch, state=state))
        return out

    def _submitter_gone(self, r: RunRow, now: float) -> bool:
        """3.7's added case: an exclusive run whose owner has no registry row, is `stopped`
        or has not beaten for `node_stale_after_s`."""
        if not self._exclusive(r.spec):
            return False
        node = self._nodes.get(r.owner_node) if r.owner_node is not None else None
        return (node is None or node.state == "stopped"
                or node.heartbeat_at <= now - self.node_stale_after_s)

    async def cancel(self, run_id: int, actor: str) -> Cancelled | None:
        now = self._tick()
        r = self._runs.get(run_id)
        if r is None or r.state not in ("pending", "running"):
            return None
        self._wait_for_row(run_id)
        r.cancel_requested = True
        if r.state == "pending":
            r.state = "cancelled"
            r.finished_at = now
            r.outcome = {"cancelledBy": actor}
        else:
            r.finished_at = None
            r.outcome = None
        return Cancelled(run_id=run_id, state=r.state)

    async def own_grants(self, node_id: str) -> list[Held]:
        self._tick()
        return [Held(run_id=k, lease_epoch=r.lease_epoch) for k, r in sorted(self._runs.items())
                if r.state == "running" and r.owner_node == node_id]

    async def mark_faults_fired(self, run_id: int, lease_epoch: int, node_id: str,
                                faults: Sequence[str]) -> tuple[str, ...] | None:
        now = self._tick()
        r = self._runs.get(run_id)
        if (r is None or r.lease_epoch != lease_epoch or r.state != "running"
                or r.owner_node != node_id or not self._live(r, now)):
            return None
        self._wait_for_row(run_id)
        r.faults_fired = sorted(set(r.faults_fired) | set(faults))
        return tuple(r.faults_fired)

    # ----------------------------------------------------------------------------------------
    # design/distribution.md §3.5 group commit

    def _fence_ok(self, run_id: int, epoch: int) -> bool:
        """`flyd.assert_fence` without the finish marker (a missing run counts as fenced)."""
        r = self._runs.get(run_id)
        return (r is not None and r.lease_epoch == epoch and r.state == "running"
                and self._live(r, self._now()))

    def _fence(self, run_id: int, epoch: int) -> None:
        if not self._fence_ok(run_id, epoch):
            raise Fenced(self._fenced_message(run_id, epoch))

    def _fenced_message(self, run_id: int, epoch: int) -> str:
        r = self._runs.get(run_id)
        live = r.lease_epoch if r is not None else None
        state = r.state if r is not None else None
        return f"fenced: run {run_id} epoch {epoch} (live epoch {live}, state {state})"

    def open_commit(self, commit: Commit) -> OpenCommit:
        """Run the statements of design/distribution.md §3.5 now; COMMIT is
        `await handle.commit()`."""
        now = self._tick()
        plan = self._statements(commit, now)
        backend = Backend(pid=next(self._pids), backend_start=self.dt(now))
        h = OpenCommit(self, plan, backend, now)
        self._open[backend.pid] = h
        return h

    async def commit(self, commit: Commit) -> Committed:
        return await self.open_commit(commit).commit()

    def _statements(self, c: Commit, now: float) -> _Plan:
        run_id, epoch = c.run_id, c.lease_epoch
        plan = _Plan(run_id=run_id, lease_epoch=epoch)
        others = self._open_plans(run_id)
        if c.checkpoint is not None or c.effects or c.finish is None:
            self._fence(run_id, epoch)
            plan.fenced = True
        ck = c.checkpoint
        if ck is not None:
            if (run_id, ck.checkpoint_id) in self._checkpoints:
                raise Transient(f"duplicate key value violates unique constraint "
                                f"checkpoints_pkey: ({run_id}, {ck.checkpoint_id})")
            if any(p.checkpoint is not None and p.checkpoint.checkpoint_id == ck.checkpoint_id
                   for p in others):
                raise Transient(f"lock timeout: checkpoint {ck.checkpoint_id} being inserted")
            plan.checkpoint = CheckpointRow(
                run_id=run_id, checkpoint_id=ck.checkpoint_id, lease_epoch=epoch,
                node_id=c.node_id, session_id=ck.session_id, session_epoch=ck.session_epoch,
                episode_id=ck.episode_id, boundary=ck.boundary,
                compatibility_digest=ck.compatibility_digest,
                envelope_digest=bytes(ck.envelope_digest), byte_length=ck.byte_length,
                envelope=bytes(ck.envelope), committed_at=now)
        self._check_effect_keys(c)
        for e in c.effects:
            self._insert_effect(plan, others, c, e, now)
        if ck is not None:
            self._move_head(plan, others, ck.checkpoint_id, ck.boundary)
            plan.rotate = self._rotation(run_id, ck.checkpoint_id, c.keep)
        if c.finish is not None:
            self._finish_run(plan, others, c.finish.state, _json(dict(c.finish.outcome)), now)
        return plan

    def _check_effect_keys(self, c: Commit) -> None:
        """23505 on `effects_pkey`, classified as design/distribution.md §6.4 reads the stored rows:
        among the commit's keys already recorded (or repeated inside it), the first with another
        digest is a conflict, else the first is a duplicate; the error names the stored row."""
        seen: dict[str, bytes] = {}
        clashes: list[tuple[str, int, bytes, bool]] = []
        for e in c.effects:
            stored = self._effects.get((c.run_id, e.key))
            if stored is not None:
                clashes.append((e.key, stored.lease_epoch, stored.payload_digest,
                                stored.payload_digest == bytes(e.digest)))
            elif e.key in seen:
                clashes.append((e.key, c.lease_epoch, seen[e.key], seen[e.key] == bytes(e.digest)))
            seen.setdefault(e.key, bytes(e.digest))
        if not clashes:
            return
        key, epoch, digest, same = next((x for x in clashes if not x[3]), clashes[0])
        cls = DuplicateEffect if same else ConflictingEffect
        raise cls(key, epoch, digest, f"run {c.run_id} effect {key!r} already recorded at "
                  f"epoch {epoch} with {'the same' if same else 'another'} digest")

    def _insert_effect(self, plan: _Plan, others: list[_Plan], c: Commit, e: Effect,
                       now: float) -> None:
        if any(x.effect_key == e.key for p in others for x in p.effects):
            raise Transient(f"lock timeout: effect {e.key} being inserted by an open commit")
        plan.effects.append(EffectRow(
            run_id=c.run_id, effect_key=e.key, lease_epoch=c.lease_epoch, node_id=c.node_id,
            session_epoch=e.session_epoch, boundary=e.boundary,
            checkpoint_id=c.checkpoint.checkpoint_id if c.checkpoint is not None else None,
            payload=_json(dict(e.payload)), payload_digest=bytes(e.digest), recorded_at=now,
            result=None if e.result is None else _json(dict(e.result))))

    def _move_head(self, plan: _Plan, others: list[_Plan], checkpoint_id: str,
                   boundary: int) -> None:
        old = self._heads.get(plan.run_id)
        if old is None:
            return
        if any(p.head is not None for p in others):
            raise Transient(f"lock timeout: head of run {plan.run_id} moved by an open commit")
        if boundary < old.boundary:
            raise HeadRegression(f"high-water regression: run {plan.run_id} boundary "
                                 f"{old.boundary} -> {boundary}")
        self._fence(plan.run_id, plan.lease_epoch)
        plan.head = HeadRow(run_id=plan.run_id, high_water=checkpoint_id, boundary=boundary,
                            lease_epoch=plan.lease_epoch)

    def _rotation(self, run_id: int, checkpoint_id: str, keep: int) -> list[str]:
        if keep - 1 < 0:
            raise Transient("LIMIT must not be negative")
        others = [c for (rid, cid), c in sorted(self._checkpoints.items())
                  if rid == run_id and cid != checkpoint_id]
        others.sort(key=lambda c: (c.boundary, c.committed_at, c.checkpoint_id), reverse=True)
        return sorted(c.checkpoint_id for c in others[keep - 1:])

    def _finish_run(self, plan: _Plan, others: list[_Plan], state: TerminalState, outcome: Any,
                    now: float) -> None:
        r = self._runs.get(plan.run_id)
        if r is not None and r.lease_epoch == plan.lease_epoch and r.state == state:
            plan.finished = "already"
            return
        self._fence(plan.run_id, plan.lease_epoch)
        plan.fenced = True
        if any(p.finish is not None for p in others):
            raise Transient(f"lock timeout: run {plan.run_id} is being finished")
        plan.finish = (state, outcome, now)
        plan.finished = "finished"

    def _finish_commit(self, h: OpenCommit) -> Committed:
        self._tick()
        if h.ended is not None:
            raise Transient(f"transaction ended before COMMIT ({h.ended}); nothing committed")
        plan = h._plan
        self._end(h, "committed")
        if plan.deferred and not self._deferred_fence_ok(plan):
            raise Fenced(self._fenced_message(plan.run_id, plan.lease_epoch))
        self._apply(plan)
        return Committed(finished=plan.finished, backend=h.backend)

    def _deferred_fence_ok(self, plan: _Plan) -> bool:
        """The deferred triggers at COMMIT. A run this commit finished shows its own update
        (terminal at the epoch, marker set), which its row lock kept unchanged since."""
        if plan.finish is not None:
            r = self._runs.get(plan.run_id)
            return r is not None and r.lease_epoch == plan.lease_epoch
        return self._fence_ok(plan.run_id, plan.lease_epoch)

    def _apply(self, plan: _Plan) -> None:
        run_id = plan.run_id
        if plan.checkpoint is not None:
            self._checkpoints[(run_id, plan.checkpoint.checkpoint_id)] = plan.checkpoint
        for e in plan.effects:
            self._effects[(run_id, e.effect_key)] = e
        if plan.head is not None:
            self._heads[run_id] = plan.head
        for cid in plan.rotate:
            self._checkpoints.pop((run_id, cid), None)
        if plan.finish is not None:
            state, outcome, at = plan.finish
            r = self._runs[run_id]
            r.state = state
            r.outcome = outcome
            r.owner_node = None
            r.lease_expires_at = None
            r.finished_at = at
            a = self._attempts.get((run_id, plan.lease_epoch))
            if a is not None:
                a.ended_at = at
                a.end_reason = "finished"

    # ----------------------------------------------------------------------------------------
    # design/distribution.md §3.10 unknown outcomes

    async def read_run(self, run_id: int, lease_epoch: int,
                       checkpoint_id: str | None) -> RunRead | None:
        now = self._tick()
        r = self._runs.get(run_id)
        head = self._heads.get(run_id)
        if r is None or head is None:
            return None
        ck = self._checkpoints.get((run_id, checkpoint_id)) if checkpoint_id is not None else None
        return RunRead(state=r.state, lease_epoch=r.lease_epoch, owner_node=r.owner_node,
                       live=self._live(r, now), high_water=head.high_water,
                       boundary=head.boundary,
                       checkpoint_committed=ck is not None and ck.lease_epoch == lease_epoch)

    async def end_backend(self, backend: Backend) -> None:
        self._tick()
        h = self._open.get(backend.pid)
        if h is not None and h.backend == backend:
            self._end(h, "terminated")

    # ----------------------------------------------------------------------------------------
    # checkpoint reads and import (design/state.md §4.2, §4.7)

    async def read_checkpoints(self, run_id: int, checkpoint_id: str | None, *,
                               with_envelope: bool) -> list[StoredCheckpoint]:
        self._tick()
        head = self._heads.get(run_id)
        high_water = head.high_water if head is not None else None
        rows = [StoredCheckpoint(
            run_id=run_id, checkpoint_id=c.checkpoint_id, lease_epoch=c.lease_epoch,
            node_id=c.node_id, session_id=c.session_id, session_epoch=c.session_epoch,
            episode_id=c.episode_id, boundary=c.boundary,
            compatibility_digest=c.compatibility_digest,
            envelope_digest=bytes(c.envelope_digest), byte_length=c.byte_length,
            committed_at=self.dt(c.committed_at), is_head=c.checkpoint_id == high_water,
            envelope=bytes(c.envelope) if with_envelope else None)
            for (rid, cid), c in sorted(self._checkpoints.items())
            if rid == run_id and checkpoint_id in (None, cid)]
        rows.sort(key=lambda r: (r.boundary, r.committed_at, r.checkpoint_id), reverse=True)
        return rows

    async def read_head(self, run_id: int) -> str | None:
        self._tick()
        head = self._heads.get(run_id)
        return None if head is None else head.high_water

    async def import_checkpoint(self, imp: Import) -> int | None:
        """`flyd.fence_row`'s lease-epoch-0 rule: only a pending, never granted run; the
        checks come first, so a refused import changes nothing (one transaction)."""
        ck = imp.checkpoint
        run_id = imp.run_id
        if run_id is None:
            if imp.submit_key is not None and imp.submit_key in self._by_key:
                next(self._run_ids)  # ON CONFLICT DO NOTHING still draws an id
                return None
            if imp.max_attempts <= 0:
                raise Transient("check violation: runs.max_attempts > 0")
        else:
            r = self._runs.get(run_id)
            if r is None or r.lease_epoch != 0 or r.state != "pending":
                raise Fenced(f"fenced: run {run_id} has been granted")
            if (run_id, ck.checkpoint_id) in self._checkpoints:
                raise Transient(f"duplicate key value violates unique constraint "
                                f"checkpoints_pkey: ({run_id}, {ck.checkpoint_id})")
            if imp.keep < 1:
                raise Transient("LIMIT must not be negative")
        if run_id is None:
            run_id = (await self.submit(imp.submit_key, imp.spec, imp.max_attempts)).run_id
        now = self._tick()
        self._checkpoints[(run_id, ck.checkpoint_id)] = CheckpointRow(
            run_id=run_id, checkpoint_id=ck.checkpoint_id, lease_epoch=0, node_id=IMPORT_NODE,
            session_id=ck.session_id, session_epoch=ck.session_epoch,
            episode_id=ck.episode_id, boundary=ck.boundary,
            compatibility_digest=ck.compatibility_digest,
            envelope_digest=bytes(ck.envelope_digest), byte_length=ck.byte_length,
            envelope=bytes(ck.envelope), committed_at=now)
        self._heads[run_id] = HeadRow(run_id=run_id, high_water=ck.checkpoint_id,
                                      boundary=ck.boundary, lease_epoch=0)
        for cid in self._rotation(run_id, ck.checkpoint_id, imp.keep):
            self._checkpoints.pop((run_id, cid), None)
        return run_id

    # ----------------------------------------------------------------------------------------
    # operator requeue

    async def requeue(self, run_id: int, actor: str) -> bool:
        now = self._tick()
        r = self._runs.get(run_id)
        if r is None or r.state != "failed":
            return False
        self._wait_for_row(run_id)
        r.state = "pending"
        r.attempt = 0
        r.outcome = None
        r.finished_at = None
        iid = next(self._intervention_ids)
        self._interventions[iid] = InterventionRow(
            intervention_id=iid, at=now, actor=actor, kind="requeue", run_id=run_id,
            detail={"fromState": "failed", "leaseEpoch": r.lease_epoch})
        return True

    # ----------------------------------------------------------------------------------------
    # the tables, as a dump reads them

    def dump(self) -> dict[str, list[dict[str, Any]]]:
        """Every table as rows ordered by primary key, instants as timestamps."""
        self._tick()
        tables: dict[str, list[Any]] = {
            "runs": [self._runs[k] for k in sorted(self._runs)],
            "run_attempts": [self._attempts[k] for k in sorted(self._attempts)],
            "nodes": [self._nodes[k] for k in sorted(self._nodes)],
            "checkpoints": [self._checkpoints[k] for k in sorted(self._checkpoints)],
            "run_heads": [self._heads[k] for k in sorted(self._heads)],
            "effects": [self._effects[k] for k in sorted(self._effects)],
            "interventions": [self._interventions[k] for k in sorted(self._interventions)],
        }
        return {name: [self._row_dict(row) for row in rows] for name, rows in tables.items()}

    def _row_dict(self, row: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(row):
            value = getattr(row, f.name)
            if f.name in _TIME_COLUMNS and value is not None:
                value = self.dt(value)
            elif isinstance(value, (list, dict)):
                value = _json(value)
            out[f.name] = value
        return out
