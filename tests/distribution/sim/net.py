"""Seeded streams, links and the per-node store client of tier 1 (distribution.md §7.2).

Rules:
- `Streams(seed)`: every random choice draws from a named stream, seeded by
  SHA-256(`<seed>:<name>`); adding a stream never shifts another's draws.
- Every store call is a request on the node's up-link and a reply on its down-link. Per
  direction a link is `pass` (delivered in the next loop step, no latency), `delay` (+d),
  `hold` (queued, delivered in order at heal) or `drop` (lost). Each direction is FIFO: a
  message never overtakes an earlier one.
- The store runs a request when it arrives, synchronously (MemStore's coroutines never suspend);
  `Tap` records what the store saw and answered, at true time.
- A group commit is two messages on one connection: the statements (`open_commit`) and, a seeded
  gap later, COMMIT. The client waits at most `CLIENT_COMMIT_BOUND` of C for the reply; then it
  closes the connection (a close message follows on the link and aborts the transaction when it
  arrives) and reports `UnknownOutcome(backend)` if COMMIT was flushed, else `Transient`.
  A commit whose session was terminated before its COMMIT ran is reported as `UnknownOutcome`:
  the client saw its connection die after flushing COMMIT.
- `reconnect_heartbeat()` (the node's eager reconnect after an abandoned renewal) is one
  round trip on the link that runs nothing at the store and is not tapped: it fails or times
  out exactly as a request would under the link's mode. A renewal itself stays one round trip
  (the lazy reconnect inside it is not modelled).
- `end_backend(b)` is a message too: it kills the connection `b` on arrival, so nothing of it
  that arrives later runs. A crash severs both directions (later sends fail at once); each
  message already in flight (a COMMIT due to follow its statements included) lands or not by a
  seeded draw, and replies are discarded.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final, Literal

from flyd.leases.fit import Fit
from flyd.leases.stores.contract import (
    Backend,
    Cancelled,
    Commit,
    Committed,
    Grant,
    Held,
    NodeInfo,
    NodeState,
    Reaped,
    Released,
    Renewed,
    RunRead,
    StoreError,
    Submitted,
    Transient,
    UnknownOutcome,
)
from flyd.leases.stores.mem import MemStore

from .loop import Gate, SimClock

Mode = Literal["pass", "delay", "hold", "drop"]
CLIENT_COMMIT_BOUND: Final = 0.8


class Streams:
    """Named, independent random streams derived from one seed."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._streams: dict[str, random.Random] = {}

    def __call__(self, name: str) -> random.Random:
        rng = self._streams.get(name)
        if rng is None:
            digest = hashlib.sha256(f"{self.seed}:{name}".encode()).digest()
            rng = self._streams[name] = random.Random(int.from_bytes(digest[:8], "big"))
        return rng


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a store coroutine that never suspends to completion, synchronously."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("a store call suspended inside the simulator")


@dataclass
class Direction:
    mode: Mode = "pass"
    delay: float = 0.0
    last_arrival: float = 0.0
    held: list[Callable[[], None]] = field(default_factory=list)


class Link:
    """One node's link to the store: `up` carries requests, `down` replies."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.up = Direction()
        self.down = Direction()
        self.severed = False
        self.land: Callable[[], bool] = _never
        self._inflight: dict[int, tuple[asyncio.TimerHandle, Callable[[], None]]] = {}
        self._ids = itertools.count()
        self.dropped = 0

    def send(self, d: Direction, deliver: Callable[[], None]) -> None:
        if d.mode == "drop":
            self.dropped += 1
            return
        if d.mode == "hold":
            d.held.append(deliver)
            return
        self._schedule(d, deliver, d.delay if d.mode == "delay" else 0.0)

    def _schedule(self, d: Direction, deliver: Callable[[], None], extra: float) -> None:
        now = self._loop.time()
        if extra == 0.0 and d.last_arrival <= now:
            self._loop.call_soon(deliver)
            return
        at = max(now + extra, d.last_arrival)
        d.last_arrival = at
        key = next(self._ids)

        def arrive() -> None:
            self._inflight.pop(key, None)
            deliver()

        self._inflight[key] = (self._loop.call_at(at, arrive), deliver)

    def set_mode(self, d: Direction, mode: Mode, delay: float = 0.0) -> None:
        if d.mode == "hold" and mode != "hold":
            self._release(d)
        d.mode = mode
        d.delay = delay

    def heal(self) -> None:
        for d in (self.up, self.down):
            self.set_mode(d, "pass")

    def _release(self, d: Direction) -> None:
        held, d.held = d.held, []
        for deliver in held:
            self._schedule(d, deliver, 0.0)

    def sever(self, land: Callable[[], bool]) -> None:
        """Crash: nothing more is sent; each in-flight request lands or not (`land()`)."""
        self.severed = True
        self.land = land
        for key in sorted(self._inflight):
            handle, _ = self._inflight[key]
            if not land():
                handle.cancel()
                del self._inflight[key]
        self.up.held = [m for m in self.up.held if land()]
        self.down.held = []


class Tap:
    """The store's view of every request: true time, node, operation, result."""

    def __init__(self, mem: MemStore) -> None:
        self._mem = mem
        self.rows: list[dict[str, Any]] = []

    def sec(self, t: datetime) -> float:
        return (t - self._mem.epoch_base).total_seconds()

    def add(self, t: float, node: str, op: str, **fields: Any) -> None:
        self.rows.append({"t": t, "node": node, "op": op, **fields})


class SimStore:
    """The `Store` one node sees: MemStore behind that node's link (see the module rules)."""

    def __init__(self, mem: MemStore, tap: Tap, link: Link, gate: Gate, clock: SimClock,
                 node_id: str, rng: random.Random, commit_timeout_s: float) -> None:
        self._mem = mem
        self._clock = clock
        self._tap = tap
        self._link = link
        self._gate = gate
        self._node = node_id
        self._rng = rng
        self._bound = CLIENT_COMMIT_BOUND * commit_timeout_s
        self._loop = asyncio.get_running_loop()
        self._dead: set[int] = set()
        self._handles: dict[int, Any] = {}
        self._pids = itertools.count(1)
        self.unknown = 0

    # -- plumbing --------------------------------------------------------------------------
    async def _ready(self) -> None:
        while self._gate.paused:
            await self._gate.wait(self._clock.now())
        if self._link.severed:
            raise Transient("connection refused: node crashed")

    def _reply(self, fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
        def deliver() -> None:
            self._gate.deliver(lambda: _settle(fut, value, error))

        if not self._link.severed:
            self._link.send(self._link.down, deliver)

    async def _await(self, fut: asyncio.Future[Any]) -> Any:
        try:
            return await fut
        except asyncio.CancelledError:
            if self._gate.paused:
                await self._gate.wait(self._clock.now())
            raise

    async def _call(self, op: str, make: Callable[[], Coroutine[Any, Any, Any]],
                    tap: Callable[[Any], Mapping[str, Any]] | None = None,
                    **fields: Any) -> Any:
        await self._ready()
        fut: asyncio.Future[Any] = self._loop.create_future()

        def arrive() -> None:
            now = self._loop.time()
            try:
                value = drive(make())
            except Exception as exc:  # every store refusal travels back as the reply
                code = exc.code if isinstance(exc, StoreError) else type(exc).__name__
                self._tap.add(now, self._node, op, ok=False, code=code, **fields)
                self._reply(fut, None, exc)
                return
            extra = tap(value) if tap is not None else {}
            self._tap.add(now, self._node, op, ok=True, **fields, **extra)
            self._reply(fut, value, None)

        self._link.send(self._link.up, arrive)
        return await self._await(fut)

    # -- Store -----------------------------------------------------------------------------
    async def register_node(self, node: NodeInfo) -> None:
        await self._call("register_node", lambda: self._mem.register_node(node))

    async def set_node_state(self, node_id: str, state: NodeState,
                             reason: str | None = None) -> None:
        await self._call("set_node_state",
                         lambda: self._mem.set_node_state(node_id, state, reason))

    async def submit(self, key: str | None, spec: Mapping[str, Any],
                     max_attempts: int) -> Submitted:
        result: Submitted = await self._call(
            "submit", lambda: self._mem.submit(key, spec, max_attempts))
        return result

    async def claim(self, node_id: str, n: int, ttl_s: float,
                    only: int | None = None, fit: Fit | None = None) -> list[Grant]:
        result: list[Grant] = await self._call(
            "claim", lambda: self._mem.claim(node_id, n, ttl_s, only, fit),
            lambda gs: {"rows": [[g.run_id, g.lease_epoch, self._tap.sec(g.lease_expires_at),
                                  g.attempt] for g in gs]})
        return result

    async def reconnect_heartbeat(self) -> None:
        """A new heartbeat session: one round trip on the link, nothing run at the store."""
        await self._ready()
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._link.send(self._link.up, lambda: self._reply(fut, None, None))
        await self._await(fut)

    async def renew(self, node_id: str, holds: Sequence[Held], ttl_s: float) -> list[Renewed]:
        result: list[Renewed] = await self._call(
            "renew", lambda: self._mem.renew(node_id, holds, ttl_s),
            lambda rs: {"rows": [[r.run_id, r.lease_epoch, self._tap.sec(r.lease_expires_at)]
                                 for r in rs]})
        return result

    async def release(self, run_id: int, lease_epoch: int, node_id: str, *, refund: bool,
                      backoff_s: float) -> Released | None:
        result: Released | None = await self._call(
            "release", lambda: self._mem.release(run_id, lease_epoch, node_id, refund=refund,
                                                 backoff_s=backoff_s),
            lambda r: {"released": r is not None}, run=run_id, epoch=lease_epoch)
        return result

    async def reap(self, n: int) -> list[Reaped]:
        result: list[Reaped] = await self._call(
            "reap", lambda: self._mem.reap(n),
            lambda rs: {"rows": [[r.run_id, r.lease_epoch, r.state] for r in rs]})
        return result

    async def cancel(self, run_id: int, actor: str) -> Cancelled | None:
        result: Cancelled | None = await self._call(
            "cancel", lambda: self._mem.cancel(run_id, actor), run=run_id)
        return result

    async def own_grants(self, node_id: str) -> list[Held]:
        result: list[Held] = await self._call("own_grants", lambda: self._mem.own_grants(node_id))
        return result

    async def mark_faults_fired(self, run_id: int, lease_epoch: int, node_id: str,
                                faults: Sequence[str]) -> tuple[str, ...] | None:
        result: tuple[str, ...] | None = await self._call(
            "mark_faults_fired",
            lambda: self._mem.mark_faults_fired(run_id, lease_epoch, node_id, faults),
            run=run_id, epoch=lease_epoch)
        return result

    async def read_run(self, run_id: int, lease_epoch: int,
                       checkpoint_id: str | None) -> RunRead | None:
        result: RunRead | None = await self._call(
            "read_run", lambda: self._mem.read_run(run_id, lease_epoch, checkpoint_id),
            run=run_id, epoch=lease_epoch)
        return result

    async def end_backend(self, backend: Backend) -> None:
        await self._ready()
        fut: asyncio.Future[Any] = self._loop.create_future()

        def arrive() -> None:
            self._kill_conn(backend.pid)
            self._tap.add(self._loop.time(), self._node, "end_backend", ok=True, pid=backend.pid)
            self._reply(fut, None, None)

        self._link.send(self._link.up, arrive)
        await self._await(fut)

    async def requeue(self, run_id: int, actor: str) -> bool:
        result: bool = await self._call("requeue", lambda: self._mem.requeue(run_id, actor))
        return result

    async def prune_nodes(self) -> int:
        result: int = await self._call("prune_nodes", self._mem.prune_nodes)
        return result

    # -- the two-step group commit ---------------------------------------------------------
    def _kill_conn(self, pid: int) -> None:
        self._dead.add(pid)
        h = self._handles.pop(pid, None)
        if h is not None:
            drive(self._mem.end_backend(h.backend))

    async def commit(self, commit: Commit) -> Committed:
        await self._ready()
        pid = next(self._pids)
        backend = Backend(pid=pid, backend_start=self._mem.epoch_base)
        fut: asyncio.Future[Any] = self._loop.create_future()
        tags = {"run": commit.run_id, "epoch": commit.lease_epoch,
                "final": commit.finish is not None,
                "checkpoint": commit.checkpoint.checkpoint_id if commit.checkpoint else None}
        flushed = False

        def statements() -> None:
            if pid in self._dead:
                return
            now = self._loop.time()
            try:
                self._handles[pid] = self._mem.open_commit(commit)
            except Exception as exc:  # a refused statement: the transaction is over
                code = exc.code if isinstance(exc, StoreError) else type(exc).__name__
                self._dead.add(pid)
                self._tap.add(now, self._node, "commit_statements", ok=False, code=code, **tags)
                self._reply(fut, None, exc)
                return
            self._tap.add(now, self._node, "commit_statements", ok=True, **tags)

        def do_commit() -> None:
            h = self._handles.pop(pid, None)
            if pid in self._dead or h is None:
                return
            self._dead.add(pid)
            now = self._loop.time()
            try:
                done = drive(h.commit())
            except Exception as exc:  # Fenced, or the session already ended
                code = exc.code if isinstance(exc, StoreError) else type(exc).__name__
                self._tap.add(now, self._node, "commit", ok=False, code=code,
                              ended=h.ended, **tags)
                err: BaseException = exc
                if isinstance(exc, Transient) and h.ended == "terminated":
                    err = UnknownOutcome(f"connection terminated: {exc.message}", backend)
                self._reply(fut, None, err)
                return
            self._tap.add(now, self._node, "commit", ok=True, finished=done.finished, **tags)
            self._reply(fut, done, None)

        def flush_commit() -> None:
            nonlocal flushed
            if fut.done() or pid in self._dead:
                return
            if self._gate.paused or (self._link.severed and not self._link.land()):
                return
            flushed = True
            self._link.send(self._link.up, do_commit)

        self._link.send(self._link.up, statements)
        gap = self._commit_gap()
        flush = self._loop.call_at(self._loop.time() + gap, flush_commit)
        try:
            async with asyncio.timeout(self._bound):
                result: Committed = await self._await(fut)
                return result
        except TimeoutError:
            flush.cancel()
            self._close(pid)
            self.unknown += 1
            if flushed:
                raise UnknownOutcome("no reply to COMMIT within the client bound",
                                     backend) from None
            raise Transient("no reply before COMMIT was flushed; connection closed") from None
        except BaseException:
            flush.cancel()
            self._close(pid)
            raise

    def _commit_gap(self) -> float:
        u = self._rng.random()
        if u < 0.85:
            return self._rng.uniform(0.0005, 0.02)
        if u < 0.97:
            return self._rng.uniform(0.02, 0.3)
        return self._rng.uniform(0.3, 0.7)

    def _close(self, pid: int) -> None:
        """The client closes the connection: a close message follows on the link."""
        if not self._link.severed:
            self._link.send(self._link.up, lambda: self._kill_conn(pid))


def _never() -> bool:
    return False


def _settle(fut: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
