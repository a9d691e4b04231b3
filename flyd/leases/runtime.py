"""The node's lease runtime (design/distribution.md §5): heartbeat, watchdog, claimer, reaper,
scopes.

Production and the tier-1 simulator run this same class; it is given its store, clock, session
executor and process-group killer, and keeps every lease decision in the sans-IO `LeaseCore`.

Rules:
- Every lease-relevant instant is read from the injected `LeaseClock` and every sleep is
  `clock.sleep_until`; every random draw comes from `random.Random(seed)`. Store calls are
  bounded by `asyncio.timeout` (R for renew and registry writes, C for everything else), which is
  loop time: virtual under the tier-1 loop, and never a lease decision (the core decides those).
- `cancel_scope` (design/distribution.md §5.5) runs steps 1–4 synchronously, before any await: the
  core marks the hold LOST, the scope's fence callbacks run, `groups.kill(run)`, the scope task is
  cancelled. A cleanup task then confirms the workers dead (K) and the task ended (5 s), logs
  `scope_cancelled`, relinquishes once (skipped at `attempt >= max_attempts`, the run's own
  budget from its grant, not `[leases] max_attempts`) and forgets.
- The guard runs synchronously immediately before each write for a grant: `check(B)` before a
  group commit (and before resending one), `check(C)` before the fault mark and while resolving
  an unknown outcome, `check(0)` before a graceful release; a relinquish is exempt.
- Every event of design/distribution.md §7.3.6 (and the runtime's own: `scope_error`, `scope_stuck`,
  `loop_lag`, `node_fatal`, ...) is logged through structlog and appended to the optional `events`
  sink as a dict with `event`, the local clock time `t`, `node` and snake_case fields.

Decisions where the spec is silent:
- Registration at start (design/distribution.md §3.1) is tried up to `REGISTER_ATTEMPTS` (5) times,
  each bounded by R and logged `register_failed` (with `attempt`) when it fails, `claim_poll` apart;
  `run()` returns 1 only when every attempt failed. One slow reply at start (a loaded host, a server
  still starting) is no reason for a node to exit, and a service manager restarting it would
  only take longer; five attempts still end a start against a server that is truly gone.
- The heartbeat reconnects eagerly (design/distribution.md §5.4 "close, reconnect within the next
  slot"): right after an abandoned renewal it calls `store.reconnect_heartbeat()` under its own
  bound R (`heartbeat_reconnected` / `heartbeat_reconnect_failed`), then renews at the next slot, or
  at once when the reconnect overran the slot. Why: with latency near R, a reconnect (one round
  trip) and the renewal's statement (another) do not both fit in one renewal's R, so a lazy
  reconnect inside the renewal would let no renewal succeed after the first abandonment.
  Renewals still never overlap (one task does both in turn), safe_until still comes only from
  an acknowledged renewal's `t_send`, and a renewal whose session is still down (the reconnect
  failed) reconnects inside its own bound R, as before.
- An unknown commit outcome is resolved by reading (design/distribution.md §3.10) only when the
  store named the backend to end first; without one (`UnknownOutcome(backend=None)` or the client
  bound C expiring) a read cannot prove the old COMMIT will not land later, so the outcome is
  `lost`.
- The own-grant sweep (design/distribution.md §3.9) never releases a (run, epoch) this node ever
  held: a lost hold whose relinquish was skipped (attempts exhausted) stays `running` for this node
  until the reaper fails it, and refunding it would undo that. Claims and sweeps are serialised by
  one lock, so a sweep never mistakes a grant whose claim reply is still being processed for an
  unseen one.
- A grant of a run for which an older local scope is still being cleaned up waits (K + 5 s at
  most) for that cleanup, so the old scope's kill never reaches the new scope's workers.
- A scope that returns without finishing or releasing, or raises, is relinquished after its
  process groups are killed; at `attempt >= max_attempts` it is only forgotten, and its lease
  expires into the reaper.
- Log levels: heartbeats (`renew_sent`, `renewed`) and a committed write (`write_begin`,
  `write_result` committed) are debug, one line each per beat or write; losses, unknown
  outcomes, fences and grants stay info or above. The event list (`events=`) gets them all.
- A release answered with no row (the grant is no longer this node's) is evidence of loss:
  `cancel_scope(fenced)`. LF003/LF004 on a commit are bugs: logged, `cancel_scope(fenced)`.
- `finish` accepts an optional final checkpoint (a succeeded run commits it with its last
  effects, design/distribution.md §6.3). A run failed by the runtime (design/distribution.md §6.4)
  records `boundaries` = the head boundary and the last session epoch the scope committed (0 if
  none).
- `stop()` (and the death of heartbeat or watchdog) fences every hold locally (`node_fatal`:
  kill, cancel) without relinquishing; the leases expire in the database. A second `drain()`
  sets `drain_hurry` on every scope (release now, no checkpoint) and cuts the remaining drain
  window to at most B.
- The reaper reaps at most `REAP_BATCH` runs per tick.
- `stats` (`flyd.leases.stats.LeaseStats`) counts what the node's metrics export: each
  acknowledged renewal's latency (send to reply, lease clock), abandoned renewals, each
  `lease_lost` by reason, and each committed group commit that carried a checkpoint (first send
  to committed reply, lease clock) with its envelope's bytes.
- The heartbeat (before applying a renewal's reply) and the resolver of an unknown commit
  outcome (after every await, `_lost_on_wake`) apply the watchdog's `expire_due` first:
  whichever task wakes first after a pause or a stretch off the CPU, a hold whose safe_until
  has passed is fenced (`lease_lost(safe_until)`) before anything else happens for it. A late
  reply never revives a hold the watchdog would already have fenced, and a grant found lost
  is left to its cleanup without a `resolved` line.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

import structlog

from flyd.leases.clock import LeaseClock
from flyd.leases.core import (
    FINAL,
    Action,
    CancelScope,
    Forget,
    GrantRow,
    Kind,
    LeaseCore,
    LeaseCoreError,
    LeaseLost,
    LeasePhase,
    Reason,
    Relinquish,
    RenewRow,
    StartScope,
    StopForCancel,
)
from flyd.leases.fit import ThreadRoom
from flyd.leases.params import LeaseParams
from flyd.leases.resolve import Decision, decide
from flyd.leases.stats import LeaseStats
from flyd.leases.stores.contract import (
    Backend,
    Checkpoint,
    Commit,
    ConflictingEffect,
    DuplicateEffect,
    Effect,
    Fenced,
    Finish,
    Grant,
    HeadRegression,
    Held,
    LedgerImmutable,
    NodeInfo,
    NodeState,
    Store,
    TerminalFinal,
    TerminalState,
    Transient,
    UnknownOutcome,
    commit_allowance_s,
)
from workers.types.canonical import canonical

LAG_PERIOD_S: Final = 0.1
LAG_LOG_S: Final = 0.05
SCOPE_END_S: Final = 5.0
SCOPE_FATAL_S: Final = 60.0
WORKER_POLL_S: Final = 0.05
REAP_BATCH: Final = 32
RELINQUISH_TRIES: Final = 3
REGISTER_ATTEMPTS: Final = 5


class ProcessGroups(Protocol):
    def kill(self, run_id: int) -> None:
        """Synchronous SIGKILL of every process group recorded for the run."""

    def alive(self, run_id: int) -> bool:
        """Any of the run's process groups still alive."""


class GrantHandler(Protocol):
    async def execute(self, scope: GrantScope) -> None:
        """Run the session; end with `scope.finish(...)` or `scope.release(...)`."""


def sha256_hex(value: Any) -> str:
    return hashlib.sha256(canonical(value)).hexdigest()


def finish_effect(state: TerminalState, outcome: Mapping[str, Any], *, boundaries: int,
                  session_epoch: int) -> Effect:
    """design/distribution.md §6.1: key `finish`, payload `{state, boundaries, outcomeDigest}`,
    boundary NULL."""
    payload = {"state": state, "boundaries": boundaries, "outcomeDigest": sha256_hex(outcome)}
    return Effect(key="finish", session_epoch=session_epoch, boundary=None, payload=payload,
                  digest=hashlib.sha256(canonical(payload)).digest())


class GrantScope:
    """One grant's local scope, created by the runtime and handed to the executor."""

    def __init__(self, runtime: NodeRuntime, grant: Grant, node_id: str) -> None:
        self.run_id = grant.run_id
        self.lease_epoch = grant.lease_epoch
        self.attempt = grant.attempt
        #: the run's own budget: at `attempt >= max_attempts` the run is not handed back
        self.max_attempts = grant.max_attempts
        self.node_id = node_id
        self.grant = grant
        self.cancel_requested = asyncio.Event()
        self.drain_requested = asyncio.Event()
        self.drain_hurry = asyncio.Event()
        self._rt = runtime
        self._fence_callbacks: list[Callable[[str], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._task_done = asyncio.Event()
        self._gone = asyncio.Event()
        self._ended = False
        self._boundary = grant.boundary
        self._session_epoch = 0
        #: checkpoint generations a group commit keeps (`[checkpoints] keep_generations`)
        self.keep = 3

    @property
    def key(self) -> tuple[int, int]:
        return (self.run_id, self.lease_epoch)

    def on_fence(self, callback: Callable[[str], None]) -> None:
        """Called synchronously, with the reason, when the hold is lost (design/distribution.md §5.5
        step 2)."""
        self._fence_callbacks.append(callback)

    async def commit(self, effects: Sequence[Effect], checkpoint: Checkpoint | None = None) -> None:
        """A fenced group commit (design/distribution.md §3.5); raises `LeaseLost` or the store's
        error."""
        await self._rt.write(self, tuple(effects), checkpoint, None, "commit")

    async def finish(self, state: TerminalState, outcome: Mapping[str, Any],
                     effects: Sequence[Effect] = (), *, boundaries: int, session_epoch: int,
                     checkpoint: Checkpoint | None = None) -> None:
        """The final commit: effects + `finish` effect + `finish_run`, one transaction
        (design/distribution.md §6.3)."""
        fin = finish_effect(state, outcome, boundaries=boundaries, session_epoch=session_epoch)
        await self._rt.write(self, (*effects, fin), checkpoint, Finish(state, outcome), "finish")

    async def release(self, *, refund: bool, backoff_s: float = 0.0) -> None:
        """Hand the run back (design/distribution.md §3.6); sent again on an unknown outcome while
        the guard allows."""
        await self._rt.release(self, refund=refund, backoff_s=backoff_s)

    async def retry_later(self) -> bool:
        """Hand the run back charged, `claim_poll` from now, when this grant is not its last
        attempt (as a relinquish would be, design/distribution.md §3.6); False, with nothing sent,
        when it is: the caller then ends the run itself."""
        if self.attempt >= self.max_attempts:
            return False
        await self.release(refund=False, backoff_s=self._rt.params.claim_poll_s)
        return True

    async def hand_back(self) -> None:
        """Hand the run back with refund, `claim_poll` from now: the grant failed for the
        node's own reasons (a part it could not keep up), not the run's."""
        await self.release(refund=True, backoff_s=self._rt.params.claim_poll_s)

    async def mark_faults_fired(self, faults: Sequence[str]) -> tuple[str, ...]:
        """design/distribution.md §3.11: the merged set; a grant no longer live is a loss
        (`LeaseLost`)."""
        return await self._rt.mark_faults(self, tuple(faults))


@dataclass
class _Services:
    heartbeat: asyncio.Task[None] | None = None
    watchdog: asyncio.Task[None] | None = None
    claimer: asyncio.Task[None] | None = None
    listener: asyncio.Task[None] | None = None
    others: list[asyncio.Task[None]] = field(default_factory=list)

    def all(self) -> list[asyncio.Task[None]]:
        named = [self.heartbeat, self.watchdog, self.claimer, self.listener]
        return [t for t in named if t is not None] + self.others


class NodeRuntime:
    """design/distribution.md §5: one node's lease runtime. `run()` returns the exit code (0 after
    drain or stop)."""

    def __init__(self, *, params: LeaseParams, store: Store, clock: LeaseClock,
                 executor: GrantHandler,
                 groups: ProcessGroups, node: NodeInfo, capacity: int = 1,
                 only: int | None = None, threads: ThreadRoom | None = None,
                 listen: Callable[[], AsyncIterator[int]] | None = None,
                 seed: int | None = None,
                 log: structlog.typing.FilteringBoundLogger | None = None,
                 events: list[dict[str, Any]] | None = None) -> None:
        self._p = params.validate()
        self._store = store
        self._clock = clock
        self._executor = executor
        self._groups = groups
        self._node = node
        self._node_id = node.node_id
        self._only = only
        self._threads = threads
        self._listen = listen
        self._rng = random.Random(seed)
        base = log if log is not None else structlog.get_logger("flyd.leases.runtime")
        self._log = base.bind(node=node.node_id)
        self._events = events
        self._core = LeaseCore(params, node.node_id, capacity)
        #: renewal latency, losses and checkpoint commits, for the node's metrics
        self.stats = LeaseStats()
        self._scopes: dict[tuple[int, int], GrantScope] = {}
        self._grants: dict[tuple[int, int], Grant] = {}
        self._seen: set[tuple[int, int]] = set()
        self._tg: asyncio.TaskGroup | None = None
        self._services = _Services()
        self._claim_lock = asyncio.Lock()
        self._claim_wake = asyncio.Event()
        self._watch_wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._control = asyncio.Event()
        self._drains = 0
        self._drain_deadline: float | None = None
        self._stop_requested = False
        self._stopping = False
        self._exit_code = 0
        #: why claims are held (`hold_claims`), None while the node claims
        self.claims_held: str | None = None

    # -- views -------------------------------------------------------------------------------
    @property
    def core(self) -> LeaseCore:
        return self._core

    @property
    def node_id(self) -> str:
        return self._node_id

    def held(self) -> list[tuple[int, int, LeasePhase, float]]:
        """(run, epoch, phase, seconds until safe_until) per hold, for status views."""
        now = self._clock.now()
        return [(h.run_id, h.epoch, h.phase, h.safe_until - now) for h in self._core.holds]

    def scope(self, run_id: int, lease_epoch: int) -> GrantScope | None:
        return self._scopes.get((run_id, lease_epoch))

    # -- events ------------------------------------------------------------------------------
    def _event(self, name: str, *, level: str = "info", **fields: Any) -> None:
        t = self._clock.now()
        if self._events is not None:
            self._events.append({"event": name, "t": t, "node": self._node_id, **fields})
        getattr(self._log, level)(name, t=t, **fields)

    # -- control -----------------------------------------------------------------------------
    def drain(self) -> None:
        """design/distribution.md §5.8; idempotent. A second call hurries the scopes and cuts the
        window to ≤ B."""
        self._drains += 1
        if self._drains > 1:
            for sc in self._scopes.values():
                sc.drain_requested.set()
                sc.drain_hurry.set()
            if self._drain_deadline is not None:
                hurry = self._clock.now() + self._p.commit_budget_s
                self._drain_deadline = min(self._drain_deadline, hurry)
            self._changed.set()
        self._control.set()

    def hold_claims(self, reason: str | None) -> None:
        """Stop claiming, for `reason` (the node cannot launch runs: a part of its own could
        not be brought back), or claim again (None). While held, every held run is asked to
        drain (its grant hands it back with refund) and the registry shows the node
        `draining`; unlike `drain()`, the node keeps running and resumes when told."""
        if reason == self.claims_held:
            return
        was, self.claims_held = self.claims_held, reason
        self._event("claims_held" if reason is not None else "claims_resumed",
                    level="warning" if reason is not None else "info", reason=reason)
        if reason is not None:
            for sc in self._scopes.values():
                sc.drain_requested.set()
        else:
            self._claim_wake.set()
        if (was is None) != (reason is None) and self._tg is not None \
                and not (self._drains or self._stopping):
            self._tg.create_task(self._set_state("draining" if reason is not None
                                                 else "active", reason))

    def stop(self) -> None:
        """Immediate stop without drain semantics: holds are fenced locally, not released."""
        self._stop_requested = True
        self._control.set()
        self._changed.set()

    def _fatal(self, why: str) -> None:
        self._event("node_fatal", level="error", reason=why)
        self._exit_code = 1
        self.stop()

    async def _register(self) -> bool:
        """design/distribution.md §3.1 at start: up to `REGISTER_ATTEMPTS` attempts, each bounded by
        R, `claim_poll` apart (module docstring); False when every attempt failed."""
        for attempt in range(1, REGISTER_ATTEMPTS + 1):
            try:
                async with asyncio.timeout(self._p.R):
                    await self._store.register_node(self._node)
            except Exception as exc:  # logged per attempt; only the last one ends the start
                self._event("register_failed", level="error", error=repr(exc), attempt=attempt,
                            attempts=REGISTER_ATTEMPTS)
            else:
                return True
            if attempt < REGISTER_ATTEMPTS:
                await self._clock.sleep_until(self._clock.now() + self._p.claim_poll_s)
        return False

    async def run(self) -> int:
        """Register, run every task of design/distribution.md §5.3 in one TaskGroup until drained or
        stopped."""
        if not await self._register():
            return 1
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                s = self._services
                s.heartbeat = tg.create_task(self._critical("heartbeat", self._heartbeat()))
                s.watchdog = tg.create_task(self._critical("watchdog", self._watchdog()))
                s.claimer = tg.create_task(self._claimer())
                if self._listen is not None:
                    s.listener = tg.create_task(self._listener(self._listen))
                s.others.append(tg.create_task(self._reaper()))
                s.others.append(tg.create_task(self._lag_monitor()))
                await self._supervise()
                for t in s.all():
                    t.cancel()
        except* Exception as group:
            for err in group.exceptions:
                self._event("node_error", level="error", error=repr(err))
            self._exit_code = 1
        finally:
            self._tg = None
            await self._set_state("stopped")
        return self._exit_code

    async def _supervise(self) -> None:
        """Wait for a drain or a stop request and carry it out (lifetime wait, no deadline)."""
        while not (self._stop_requested or self._drains):
            self._control.clear()
            await self._control.wait()
        if self._drains and not self._stop_requested:
            await self._drain()
        self._stopping = True
        for h in self._core.holds:
            if h.phase not in FINAL:
                self.cancel_scope(h.run_id, h.epoch, "node_fatal")
        for sc in list(self._scopes.values()):
            if sc._task is not None:
                sc._task.cancel()

    async def _drain(self) -> None:
        """design/distribution.md §5.8 steps 1–3; step 4 (`stopped`) follows in `run`."""
        self._event("drain_started")
        await self._set_state("draining", self.claims_held)
        try:
            async with asyncio.timeout(self._p.drain_timeout_s):
                await self._claim_lock.acquire()
            held_lock = True
        except TimeoutError:
            held_lock = False
        try:
            for t in (self._services.claimer, self._services.listener):
                if t is not None:
                    t.cancel()
        finally:
            if held_lock:
                self._claim_lock.release()
        for sc in self._scopes.values():
            sc.drain_requested.set()
            if self._drains > 1:
                sc.drain_hurry.set()
        deadline = self._clock.now() + self._p.drain_timeout_s
        if self._drains > 1:
            deadline = min(deadline, self._clock.now() + self._p.commit_budget_s)
        self._drain_deadline = deadline
        while self._core.holds and not self._stop_requested:
            if self._clock.now() >= self._drain_deadline:
                break
            self._changed.clear()
            await self._wait_for(self._changed, min(self._drain_deadline,
                                                    self._clock.now() + self._p.watchdog_tick_s))
        for h in self._core.holds:
            if h.phase not in FINAL:
                self.cancel_scope(h.run_id, h.epoch, "drain_timeout")
        p = self._p
        end = self._clock.now() + (p.kill_bound_s + SCOPE_END_S + p.commit_timeout_s
                                   + p.watchdog_tick_s)
        while self._core.holds and not self._stop_requested and self._clock.now() < end:
            self._changed.clear()
            await self._wait_for(self._changed, min(end, self._clock.now() + p.watchdog_tick_s))

    async def _set_state(self, state: NodeState, reason: str | None = None) -> None:
        try:
            async with asyncio.timeout(self._p.R):
                await self._store.set_node_state(self._node_id, state, reason)
        except Exception as exc:  # the registry is status only
            self._event("node_state_unknown", level="warning", state=state, error=repr(exc))

    async def _critical(self, name: str, body: Awaitable[None]) -> None:
        """Heartbeat and watchdog: their death cancels every scope and exits non-zero."""
        try:
            await body
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any death of a critical task is fatal
            self._fatal(f"{name} died: {exc!r}")
            return
        if not self._stopping:
            self._fatal(f"{name} returned")

    async def _wait_for(self, event: asyncio.Event, deadline: float) -> bool:
        """Wait until `event` is set or the clock reaches `deadline`; True if the event is set."""
        if event.is_set():
            return True
        async with asyncio.TaskGroup() as tg:
            waiter = tg.create_task(event.wait())
            sleeper = tg.create_task(self._clock.sleep_until(deadline))
            await asyncio.wait((waiter, sleeper), return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            sleeper.cancel()
        return event.is_set()

    # -- actions -----------------------------------------------------------------------------
    def _perform(self, actions: Sequence[Action]) -> None:
        for a in actions:
            if isinstance(a, StartScope):
                self._start_scope(a)
            elif isinstance(a, CancelScope):
                self._on_lost(a.run_id, a.epoch, a.reason)
            elif isinstance(a, StopForCancel):
                sc = self._scopes.get((a.run_id, a.epoch))
                if sc is not None:
                    sc.cancel_requested.set()
                self._event("cancel_requested", run=a.run_id, epoch=a.epoch)
            elif isinstance(a, Relinquish):
                raise LeaseCoreError(f"relinquish of {a.run_id}@{a.epoch} outside cleanup")
            elif isinstance(a, Forget):
                self._forget(a.run_id, a.epoch)

    def _forget(self, run_id: int, epoch: int) -> None:
        sc = self._scopes.pop((run_id, epoch), None)
        if sc is not None:
            sc._gone.set()
        self._claim_wake.set()
        self._changed.set()

    def _start_scope(self, a: StartScope) -> None:
        grant = self._grants.pop((a.run_id, a.epoch))
        sc = GrantScope(self, grant, self._node_id)
        self._scopes[sc.key] = sc
        self._seen.add(sc.key)
        self._event("claimed", run=a.run_id, epoch=a.epoch, attempt=a.attempt,
                    max_attempts=sc.max_attempts)
        if self._tg is None:
            raise LeaseCoreError("scope started outside run()")
        sc._task = self._tg.create_task(self._scope_main(sc))
        sc._task.add_done_callback(lambda _t: sc._task_done.set())

    def cancel_scope(self, run_id: int, epoch: int, reason: Reason) -> None:
        """design/distribution.md §5.5: evidence of loss. Steps 1–4 happen here, synchronously;
        idempotent."""
        self._perform(self._core.fence(run_id, epoch, reason))

    def _on_lost(self, run_id: int, epoch: int, reason: Reason) -> None:
        """Steps 2–4 of design/distribution.md §5.5 (the core did step 1), then the cleanup task."""
        self._event("lease_lost", run=run_id, epoch=epoch, reason=reason)
        self.stats.losses[reason] += 1
        sc = self._scopes.get((run_id, epoch))
        if sc is not None:
            for callback in sc._fence_callbacks:
                try:
                    callback(reason)
                except Exception as exc:  # one callback never stops the fence
                    self._event("fence_callback_error", level="error", run=run_id,
                                epoch=epoch, error=repr(exc))
        try:
            self._groups.kill(run_id)
        except Exception as exc:  # logged; the cleanup re-checks liveness
            self._event("kill_error", level="error", run=run_id, epoch=epoch, error=repr(exc))
        if sc is not None and sc._task is not None:
            sc._task.cancel()
        self._watch_wake.set()
        if not self._stopping and self._tg is not None:
            self._tg.create_task(self._cleanup(run_id, epoch, reason, sc))

    async def _cleanup(self, run_id: int, epoch: int, reason: Reason,
                       sc: GrantScope | None) -> None:
        start = self._clock.now()
        stuck = False
        while True:
            now = self._clock.now()
            workers = self._groups.alive(run_id)
            task = sc is not None and sc._task is not None and not sc._task.done()
            if not workers and not task:
                break
            if now - start >= SCOPE_FATAL_S:
                self._fatal(f"scope {run_id}@{epoch} stuck for {SCOPE_FATAL_S} s")
                return
            overdue = (workers and now - start >= self._p.kill_bound_s) or (
                task and now - start >= SCOPE_END_S)
            if overdue and not stuck:
                stuck = True
                self._event("scope_stuck", level="error", run=run_id, epoch=epoch,
                            workers_alive=workers, task_running=task)
            if workers:  # a worker the launch spawned after the first kill dies here
                self._groups.kill(run_id)
            if task and sc is not None:
                await self._wait_for(sc._task_done, now + WORKER_POLL_S)
            else:
                await self._clock.sleep_until(now + WORKER_POLL_S)
        self._event("scope_cancelled", run=run_id, epoch=epoch, reason=reason)
        for a in self._core.scope_gone(run_id, epoch):
            if isinstance(a, Relinquish):
                await self._relinquish(a.run_id, a.epoch, sc)
            else:
                self._perform([a])

    async def _relinquish(self, run_id: int, epoch: int, sc: GrantScope | None) -> None:
        """3.6 with `refund = false`, once; skipped at the run's own `attempt >= max_attempts`
        (so the reaper fails it), and without a scope, whose grant told the budget: the lease
        then expires and the store judges the run by its own budget."""
        if sc is None or sc.attempt >= sc.max_attempts:
            self._event("released", run=run_id, epoch=epoch, refund=False, kind="relinquish",
                        result="skipped")
            return
        for _ in range(RELINQUISH_TRIES):
            try:
                async with asyncio.timeout(self._p.commit_timeout_s):
                    got = await self._store.release(run_id, epoch, self._node_id, refund=False,
                                                    backoff_s=0.0)
            except Exception as exc:  # unknown: send again (design/distribution.md §5.6)
                self._event("write_result", run=run_id, epoch=epoch, kind="relinquish",
                            result="unknown", error=repr(exc))
                await self._clock.sleep_until(self._clock.now() + self._p.watchdog_tick_s)
                continue
            self._event("released", run=run_id, epoch=epoch, refund=False, kind="relinquish",
                        result="released" if got is not None else "none")
            return

    # -- heartbeat and watchdog (design/distribution.md §5.4) --------------------------------------
    async def _heartbeat(self) -> None:
        """Renew every H ± 10 %, bounded by R; after an abandoned renewal, reconnect the
        heartbeat session at once, on its own bound R (module docstring), then renew at the
        next slot, or at once when the reconnect overran it."""
        p = self._p
        start = self._clock.now()
        while True:
            batch = self._core.renew_batch(self._clock.now())
            held = [Held(e.run_id, e.epoch) for e in batch.entries]
            t_send = self._clock.now()
            self._event("renew_sent", level="debug",
                        runs=[[h.run_id, h.lease_epoch] for h in held])
            abandoned = False
            try:
                async with asyncio.timeout(p.R):
                    rows = await self._store.renew(self._node_id, held, p.T)
            except Exception as exc:  # unknown renewal (design/distribution.md §5.6): nothing
                self._event("renew_unknown", error=repr(exc))
                self.stats.renew_unknown += 1
                actions = self._core.on_renew_unknown(batch)
                abandoned = True
            else:
                replied = self._clock.now()
                self.stats.renew.observe(replied - t_send)
                # a hold past safe_until is lost before the reply is applied (module docstring)
                self._perform(self._core.expire_due(replied))
                got = [RenewRow(r.run_id, r.lease_epoch, r.cancel_requested) for r in rows]
                self._event("renewed", level="debug", t_send=t_send,
                            runs=[[r.run_id, r.epoch] for r in got])
                free = self._core.free_capacity(self._clock.now())
                actions = self._core.on_renewed(batch, got, t_send)
                if not free and self._core.free_capacity(self._clock.now()):
                    self._claim_wake.set()
                self._watch_wake.set()
            self._perform(actions)
            start += p.H * self._rng.uniform(0.9, 1.1)
            if abandoned:
                await self._reconnect_heartbeat()
            start = max(start, self._clock.now())
            await self._clock.sleep_until(start)

    async def _reconnect_heartbeat(self) -> None:
        """One reconnect of the heartbeat session, bounded by R; on failure the next renewal
        reconnects within its own bound (and, abandoned again, brings the next attempt)."""
        try:
            async with asyncio.timeout(self._p.R):
                await self._store.reconnect_heartbeat()
        except Exception as exc:  # the next renewal is still sent at its slot
            self._event("heartbeat_reconnect_failed", level="warning", error=repr(exc))
        else:
            self._event("heartbeat_reconnected")

    async def _watchdog(self) -> None:
        w = self._p.watchdog_tick_s
        while True:
            now = self._clock.now()
            self._perform(self._core.expire_due(now))
            due = self._core.next_deadline()
            wake = now + w if due is None else min(due, now + w)
            self._watch_wake.clear()
            await self._wait_for(self._watch_wake, wake)

    async def _lag_monitor(self) -> None:
        while True:
            due = self._clock.now() + LAG_PERIOD_S
            await self._clock.sleep_until(due)
            lag = self._clock.now() - due
            if lag > LAG_LOG_S:
                self._event("loop_lag", level="warning", lag_s=lag)

    # -- claim loop, listener, reaper (design/distribution.md §5.7) --------------------------------
    async def _claimer(self) -> None:
        """Claim, then wait for a notification, freed capacity or `claim_poll` ± 20 %."""
        p = self._p
        while True:
            async with self._claim_lock:
                if self._drains or self._stopping:
                    return
                self._claim_wake.clear()
                again = await self._claim_once()
            if again:
                continue
            wait = p.claim_poll_s * self._rng.uniform(0.8, 1.2)
            await self._wait_for(self._claim_wake, self._clock.now() + wait)

    async def _claim_once(self) -> bool:
        """One claim (3.3) of up to `n` grants; an unknown outcome runs the own-grant sweep.
        True when the batch came back full and capacity is left (claim again at once)."""
        p = self._p
        if self.claims_held is not None:
            return False
        n = min(self._core.free_capacity(self._clock.now()), p.claim_batch)
        if self._only is not None:
            n = min(n, 1)
        if n <= 0:
            return False
        fit = None
        if self._threads is not None:  # claims fit first (flyd.leases.fit)
            held = [sc.grant.spec for sc in self._scopes.values()]
            fit = self._threads.fit([*held, *(g.spec for g in self._grants.values())])
        t_send = self._clock.now()
        try:
            async with asyncio.timeout(p.commit_timeout_s):
                grants = await self._store.claim(self._node_id, n, p.T, self._only, fit)
        except Transient as exc:
            self._event("claim_failed", level="warning", error=repr(exc))
            return False
        except Exception as exc:  # unknown claim outcome (design/distribution.md §5.6)
            self._event("claim_unknown", level="warning", error=repr(exc))
            await self._sweep()
            return False
        rows = []
        for g in grants:
            self._grants[(g.run_id, g.lease_epoch)] = g
            rows.append(GrantRow(g.run_id, g.lease_epoch, g.attempt, g.cancel_requested))
        self._perform(self._core.on_granted(rows, t_send))
        more = self._only is None and self._core.free_capacity(self._clock.now()) > 0
        return bool(grants) and len(grants) == n and more

    async def _sweep(self) -> None:
        """3.9 (caller holds the claim lock): release with refund what this node never saw."""
        try:
            async with asyncio.timeout(self._p.commit_timeout_s):
                shown = await self._store.own_grants(self._node_id)
        except Exception as exc:  # the next reap tick sweeps again
            self._event("sweep_failed", level="warning", error=repr(exc))
            return
        keys = {(h.run_id, h.lease_epoch) for h in shown}
        for run_id, epoch in sorted(keys):
            if (run_id, epoch) in self._seen or self._core.hold(run_id, epoch) is not None:
                continue
            self._seen.add((run_id, epoch))
            try:
                async with asyncio.timeout(self._p.commit_timeout_s):
                    got = await self._store.release(run_id, epoch, self._node_id, refund=True,
                                                    backoff_s=0.0)
            except Exception as exc:  # still shown next sweep; retried then
                self._seen.discard((run_id, epoch))
                self._event("write_result", run=run_id, epoch=epoch, kind="sweep_release",
                            result="unknown", error=repr(exc))
                continue
            self._event("released", run=run_id, epoch=epoch, refund=True, kind="sweep",
                        result="released" if got is not None else "none")
        held = {(h.run_id, h.epoch) for h in self._core.holds}
        self._seen = {k for k in self._seen if k in keys or k in held}

    async def _listener(self, listen: Callable[[], AsyncIterator[int]]) -> None:
        """LISTEN wake-ups; losing it only slows claims to the poll period."""
        while True:
            try:
                async for _run_id in listen():
                    self._claim_wake.set()
            except Exception as exc:  # reconnect after one poll period
                self._event("listen_lost", level="warning", error=repr(exc))
            await self._clock.sleep_until(self._clock.now() + self._p.claim_poll_s)

    async def _reaper(self) -> None:
        p = self._p
        while True:
            wait = p.reap_interval_s * self._rng.uniform(0.8, 1.2)
            await self._clock.sleep_until(self._clock.now() + wait)
            try:
                async with asyncio.timeout(p.commit_timeout_s):
                    reaped = await self._store.reap(REAP_BATCH)
                for r in reaped:
                    self._event("reaped", run=r.run_id, epoch=r.lease_epoch, state=r.state)
            except Exception as exc:  # idempotent; the next tick reaps
                self._event("reap_failed", level="warning", error=repr(exc))
            try:
                async with asyncio.timeout(p.drain_timeout_s):
                    async with self._claim_lock:
                        await self._sweep()
            except TimeoutError:
                self._event("sweep_failed", level="warning", error="claim lock busy")
            try:
                async with asyncio.timeout(p.commit_timeout_s):
                    await self._store.prune_nodes()
            except Exception as exc:  # status only
                self._event("prune_failed", level="warning", error=repr(exc))

    # -- scopes ------------------------------------------------------------------------------
    def _live(self, sc: GrantScope) -> None:
        """Raise `LeaseLost` unless this scope's hold exists and is not final."""
        h = self._core.hold(sc.run_id, sc.lease_epoch)
        if h is None or h.phase in FINAL:
            raise LeaseLost(f"{sc.run_id}@{sc.lease_epoch} is not held")

    async def _scope_main(self, sc: GrantScope) -> None:
        try:
            for old in [o for o in self._scopes.values()
                        if o.run_id == sc.run_id and o.lease_epoch < sc.lease_epoch]:
                bound = self._p.kill_bound_s + SCOPE_END_S + self._p.watchdog_tick_s
                await self._wait_for(old._gone, self._clock.now() + bound)
            self._live(sc)
            self._perform(self._core.end(sc.run_id, "start"))
            await self._executor.execute(sc)
        except asyncio.CancelledError:
            raise
        except LeaseLost as exc:
            # The guard refuses a write when too little of safe_until is left, without marking
            # the hold lost; a hold whose session stopped here is relinquished, not kept
            # renewed forever. A hold already LOST is left to its cleanup.
            await self._scope_error(sc, repr(exc))
        except Exception as exc:  # a failing session is relinquished (design/distribution.md §5.6)
            await self._scope_error(sc, repr(exc))
        else:
            if not sc._ended:
                await self._scope_error(sc, "executor returned without finish or release")

    async def _scope_error(self, sc: GrantScope, why: str) -> None:
        """Relinquish a scope whose executor failed, after killing its process groups."""
        h = self._core.hold(sc.run_id, sc.lease_epoch)
        if h is None or h.phase in FINAL:
            return
        self._event("scope_error", level="error", run=sc.run_id, epoch=sc.lease_epoch,
                    error=why)
        self._groups.kill(sc.run_id)
        end = self._clock.now() + self._p.kill_bound_s
        while self._groups.alive(sc.run_id) and self._clock.now() < end:
            await self._clock.sleep_until(min(end, self._clock.now() + WORKER_POLL_S))
        try:
            await self._relinquish_live(sc)
        except LeaseLost:
            return

    async def _relinquish_live(self, sc: GrantScope) -> None:
        h = self._core.hold(sc.run_id, sc.lease_epoch)
        if h is None or h.phase in FINAL:
            return
        if h.phase is not LeasePhase.RELEASING:
            try:
                self._core.begin(sc.run_id, "release")
            except LeaseCoreError:
                self.cancel_scope(sc.run_id, sc.lease_epoch, "node_fatal")
                return
        if sc.attempt >= sc.max_attempts:
            self._event("released", run=sc.run_id, epoch=sc.lease_epoch, refund=False,
                        kind="forget", result="skipped")
            self._perform(self._core.end(sc.run_id, "release", "committed"))
            return
        await self._send_release(sc, refund=False, backoff_s=0.0)

    @property
    def params(self) -> LeaseParams:
        """The validated lease parameters this runtime keeps (read-only)."""
        return self._p

    # -- writes ------------------------------------------------------------------------------
    async def write(self, sc: GrantScope, effects: tuple[Effect, ...],
                    checkpoint: Checkpoint | None, finish: Finish | None, kind: Kind, *,
                    failing: bool = False) -> None:
        """One group commit (design/distribution.md §3.5) of a scope's, with the
        design/distribution.md §5.6 error handling (`GrantScope.commit` and `GrantScope.finish` are
        how a grant's handler asks for it)."""
        run, epoch = sc.run_id, sc.lease_epoch
        commit = Commit(run, epoch, self._node_id, effects, checkpoint, finish, keep=sc.keep)
        ckpt = checkpoint.checkpoint_id if checkpoint is not None else None
        rows, size = commit.size()
        extra = commit_allowance_s(rows, size)
        budget, bound = self._p.commit_budget_s + extra, self._p.commit_timeout_s + extra
        self._live(sc)
        began = self._clock.now()
        self._core.check(run, epoch, began, budget)
        self._core.begin(run, kind)
        while True:
            self._event("write_begin", level="debug", run=run, epoch=epoch, kind=kind,
                        checkpoint=ckpt,
                        effects=[e.key for e in effects], bytes=size, allowance_s=round(extra, 3),
                        state=finish.state if finish is not None else None)
            try:
                async with asyncio.timeout(bound):
                    done = await self._store.commit(commit)
            except Fenced as exc:
                self._raise_if_lost(run, epoch, kind, exc)
                self._event("write_result", run=run, epoch=epoch, kind=kind, result="fenced",
                            code=exc.code)
                self.cancel_scope(run, epoch, "fenced")
                raise LeaseLost(f"{run}@{epoch} fenced: {exc.message}") from exc
            except (DuplicateEffect, ConflictingEffect, HeadRegression) as exc:
                self._raise_if_lost(run, epoch, kind, exc)
                self._event("write_result", level="error", run=run, epoch=epoch, kind=kind,
                            result=exc.code, error=exc.message)
                self._perform(self._core.end(run, kind, "failed"))
                if failing:
                    raise
                await self._fail_run(sc, exc, checkpoint)
                raise
            except (TerminalFinal, LedgerImmutable) as exc:
                self._raise_if_lost(run, epoch, kind, exc)
                self._event("write_result", level="error", run=run, epoch=epoch, kind=kind,
                            result=exc.code, error=exc.message)
                self.cancel_scope(run, epoch, "fenced")
                raise LeaseLost(f"{run}@{epoch}: {exc.message}") from exc
            except Transient as exc:
                self._raise_if_lost(run, epoch, kind, exc)
                self._event("write_result", run=run, epoch=epoch, kind=kind, result="failed",
                            code=exc.code, error=exc.message)
                self._perform(self._core.end(run, kind, "failed"))
                raise
            except Exception as exc:  # UnknownOutcome, C expired, unclassified
                self._raise_if_lost(run, epoch, kind, exc)
                backend = exc.backend if isinstance(exc, UnknownOutcome) else None
                self._event("write_result", run=run, epoch=epoch, kind=kind, result="unknown",
                            error=repr(exc))
                decision = await self._resolve(sc, commit, backend)
                if decision == "retry":
                    try:
                        self._core.check(run, epoch, self._clock.now(), budget)
                    except LeaseLost:
                        decision = "lost"
                    else:
                        continue
                if decision == "lost":
                    self._perform(self._core.end(run, kind, "lost"))
                    raise LeaseLost(f"{run}@{epoch}: unknown outcome lost") from exc
            else:
                self._raise_if_lost(run, epoch, kind, None)
                self._event("write_result", level="debug", run=run, epoch=epoch, kind=kind,
                            result="committed", finished=done.finished)
            if checkpoint is not None:
                self.stats.checkpoint_commit.observe(self._clock.now() - began)
                self.stats.checkpoint_bytes += len(checkpoint.envelope)
            self._committed(sc, effects, checkpoint)
            self._perform(self._core.end(run, kind, "committed"))
            if finish is not None:
                sc._ended = True
                self._event("finished", run=run, epoch=epoch, state=finish.state)
            return

    def _raise_if_lost(self, run: int, epoch: int, kind: Kind,
                       cause: BaseException | None) -> None:
        """A write's reply that arrives after its grant was fenced (the watchdog passed
        safe_until while it was in flight) is not acted on or logged: after `lease_lost` the
        node logs nothing more for the grant but the cleanup (design/distribution.md §7.3.6, S6).
        What the write did is the database's to tell; the grant's next holder reads it."""
        if self._lost_on_wake(run, epoch):
            raise LeaseLost(f"{run}@{epoch}: lost while its {kind} was in flight") from cause

    def _committed(self, sc: GrantScope, effects: tuple[Effect, ...],
                   checkpoint: Checkpoint | None) -> None:
        epochs = [e.session_epoch for e in effects if e.key != "finish"]
        if checkpoint is not None:
            sc._boundary = max(sc._boundary, checkpoint.boundary)
            epochs.append(checkpoint.session_epoch)
        sc._session_epoch = max([sc._session_epoch, *epochs])

    async def _fail_run(self, sc: GrantScope,
                        exc: DuplicateEffect | ConflictingEffect | HeadRegression,
                        checkpoint: Checkpoint | None) -> None:
        """design/distribution.md §6.4: fail the run through a final commit without checkpoint,
        effects or retry."""
        if isinstance(exc, HeadRegression):
            outcome: dict[str, Any] = {"error": "head_regression", "message": exc.message,
                                       "checkpointId": checkpoint.checkpoint_id
                                       if checkpoint is not None else None}
        else:
            outcome = exc.outcome()
        self._event("run_failed", level="error", run=sc.run_id, epoch=sc.lease_epoch,
                    error=outcome["error"])
        fin = finish_effect("failed", outcome, boundaries=sc._boundary,
                            session_epoch=sc._session_epoch)
        await self.write(sc, (fin,), None, Finish("failed", outcome), "finish", failing=True)

    async def _resolve(self, sc: GrantScope, commit: Commit, backend: Backend | None) -> Decision:
        """design/distribution.md §5.6 / §3.10: end the old backend, read, decide; only while
        `check(C)` passes."""
        run, epoch = sc.run_id, sc.lease_epoch
        if backend is None:
            if not self._lost_on_wake(run, epoch):
                self._event("resolved", run=run, epoch=epoch, decision="lost",
                            why="no backend")
            return "lost"
        ckpt = commit.checkpoint.checkpoint_id if commit.checkpoint is not None else None
        ended = False
        while True:
            if self._lost_on_wake(run, epoch):
                return "lost"
            try:
                self._core.check(run, epoch, self._clock.now(), self._p.commit_timeout_s)
            except LeaseLost:
                self._event("resolved", run=run, epoch=epoch, decision="lost", why="guard")
                return "lost"
            try:
                async with asyncio.timeout(self._p.commit_timeout_s):
                    if not ended:
                        await self._store.end_backend(backend)
                        ended = True
                    read = await self._store.read_run(run, epoch, ckpt)
            except Exception as exc:  # read again while the guard allows
                if self._lost_on_wake(run, epoch):
                    return "lost"
                self._event("resolve_retry", level="warning", run=run, epoch=epoch,
                            error=repr(exc))
                await self._clock.sleep_until(self._clock.now() + self._p.watchdog_tick_s)
                continue
            if self._lost_on_wake(run, epoch):
                return "lost"
            final = commit.finish.state if commit.finish is not None else None
            decision = decide(read, lease_epoch=epoch, node_id=self._node_id,
                              checkpoint_id=ckpt, final=final)
            self._event("resolved", run=run, epoch=epoch, decision=decision)
            return decision

    def _lost_on_wake(self, run: int, epoch: int) -> bool:
        """After an await: first fence every hold past safe_until, as the watchdog would, so a
        task waking late (after a pause, or a reply delivered late) never acts or logs for
        its grant before the loss; True when the grant is no longer live (then nothing more
        is logged for it: the cleanup reports it)."""
        self._perform(self._core.expire_due(self._clock.now()))
        h = self._core.hold(run, epoch)
        return h is None or h.phase in FINAL

    async def release(self, sc: GrantScope, *, refund: bool, backoff_s: float) -> None:
        """Hand a scope's run back (design/distribution.md §3.6; `GrantScope.release`)."""
        self._live(sc)
        self._core.begin(sc.run_id, "release")
        await self._send_release(sc, refund=refund, backoff_s=backoff_s)

    async def _send_release(self, sc: GrantScope, *, refund: bool, backoff_s: float) -> None:
        """3.6 for a RELEASING hold; an unknown outcome is sent again while the guard allows."""
        run, epoch = sc.run_id, sc.lease_epoch
        while True:
            self._core.check(run, epoch, self._clock.now(), 0.0)
            self._event("write_begin", run=run, epoch=epoch, kind="release", refund=refund)
            try:
                async with asyncio.timeout(self._p.commit_timeout_s):
                    got = await self._store.release(run, epoch, self._node_id, refund=refund,
                                                    backoff_s=backoff_s)
            except Exception as exc:  # unknown release: send again (design/distribution.md §5.6)
                self._event("write_result", run=run, epoch=epoch, kind="release",
                            result="unknown", error=repr(exc))
                self._perform(self._core.end(run, "release", "failed"))
                await self._clock.sleep_until(self._clock.now() + self._p.watchdog_tick_s)
                continue
            if got is None:
                self._event("released", run=run, epoch=epoch, refund=refund, kind="release",
                            result="none")
                self.cancel_scope(run, epoch, "fenced")
                raise LeaseLost(f"{run}@{epoch} was no longer this node's at release")
            sc._ended = True
            self._event("released", run=run, epoch=epoch, refund=refund, kind="release",
                        result="released")
            self._perform(self._core.end(run, "release", "committed"))
            return

    async def mark_faults(self, sc: GrantScope, faults: tuple[str, ...]) -> tuple[str, ...]:
        """design/distribution.md §3.11 for a scope's run (`GrantScope.mark_faults_fired`)."""
        run, epoch = sc.run_id, sc.lease_epoch
        self._live(sc)
        self._core.check(run, epoch, self._clock.now(), self._p.commit_timeout_s)
        async with asyncio.timeout(self._p.commit_timeout_s):
            merged = await self._store.mark_faults_fired(run, epoch, self._node_id, faults)
        if merged is None:
            self.cancel_scope(run, epoch, "fenced")
            raise LeaseLost(f"{run}@{epoch} not live at fault mark")
        return merged

