"""Virtual time for tier 1 (distribution.md §7.2): the loop, node clocks, the pause gate.

Rules:
- `VirtualTimeLoop` is an asyncio selector loop that does no I/O: when nothing is ready, its
  iteration jumps virtual time to the next timer instead of polling, so `asyncio.sleep`,
  `asyncio.timeout` and every clock below run in virtual seconds and a seed's schedule is a
  pure function of the seed. A loop with nothing ready and no timer is a deadlock
  of the simulated system and raises `SimDeadlock`.
- The loop's time is true time (the store's clock). A node's clock reads
  `offset + rate · true`; `rate` stays within 1 ± ρ.
- `Gate` models SIGSTOP: while a node is paused every sleep of its clock and every store call it
  makes waits at the gate; `resume()` releases the waiting sleepers in order of their deadlines
  (overdue timers fire in order), and replies that arrived during the pause one microsecond
  later, so the timers of the resumed node act before any reply it missed.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import math
import selectors
from collections.abc import Callable, Mapping
from typing import Any, Final

RESUME_REPLY_DELAY_S: Final = 1e-6
CLOCK_RESOLUTION: Final = 1e-9
PURGE_MIN: Final = 100
PURGE_FRACTION: Final = 0.5


class SimDeadlock(RuntimeError):
    """Nothing is ready and no timer is scheduled: every simulated task waits forever."""


class _NoIOSelector(selectors.BaseSelector):
    """The selector the base loop requires (it registers its self-pipe); never polled."""

    def __init__(self) -> None:
        self._keys: dict[Any, selectors.SelectorKey] = {}

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        key = selectors.SelectorKey(fileobj, fileobj if isinstance(fileobj, int)
                                    else fileobj.fileno(), events, data)
        self._keys[fileobj] = key
        return key

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._keys.pop(fileobj)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        return []

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return dict(self._keys)

    def close(self) -> None:
        self._keys.clear()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop in virtual seconds (starts at 0.0).

    `_run_once` is the base loop's iteration (CPython 3.11 `BaseEventLoop._run_once`: purge
    cancelled timers, move due timers to the ready queue in heap order, run the ready queue
    once) without the I/O poll: when nothing is ready, virtual time jumps to the next timer.
    """

    def __init__(self) -> None:
        self._vt = 0.0
        super().__init__(_NoIOSelector())

    def time(self) -> float:
        return self._vt

    def _run_once(self) -> None:
        base: Any = self  # the base loop's private state, untyped in typeshed
        scheduled: list[asyncio.TimerHandle] = base._scheduled
        n = len(scheduled)
        if n > PURGE_MIN and base._timer_cancelled_count / n > PURGE_FRACTION:
            live = []
            for h in scheduled:
                if h.cancelled():
                    _unschedule(h)
                else:
                    live.append(h)
            heapq.heapify(live)
            base._scheduled = scheduled = live
            base._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0].cancelled():
                base._timer_cancelled_count -= 1
                _unschedule(heapq.heappop(scheduled))
        ready: collections.deque[Any] = base._ready
        if not ready and not base._stopping:
            if not scheduled:
                raise SimDeadlock("no ready callback and no timer: the simulation is stuck")
            self._vt = max(self._vt, scheduled[0].when())
        end = self._vt + CLOCK_RESOLUTION
        while scheduled and scheduled[0].when() < end:
            h = heapq.heappop(scheduled)
            _unschedule(h)
            ready.append(h)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle.cancelled():
                handle._run()


def _unschedule(handle: Any) -> None:
    handle._scheduled = False


class Gate:
    """The pause gate of one node (see the module rules)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._seq = itertools.count()
        self.paused = False
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._replies: list[Callable[[], None]] = []

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        if not self.paused:
            return
        self.paused = False
        sleepers, self._sleepers = sorted(self._sleepers, key=lambda s: (s[0], s[1])), []
        for _, _, fut in sleepers:
            if not fut.done():
                fut.set_result(None)
        replies, self._replies = self._replies, []
        if replies:
            self._loop.call_at(self._loop.time() + RESUME_REPLY_DELAY_S, _run_all, replies)

    async def wait(self, deadline: float) -> None:
        """Wait at the gate; `deadline` (local time) orders the release on resume."""
        fut: asyncio.Future[None] = self._loop.create_future()
        self._sleepers.append((deadline, next(self._seq), fut))
        await fut

    def deliver(self, reply: Callable[[], None]) -> None:
        """Hand a reply to the node now, or at resume when it is paused."""
        if self.paused:
            self._replies.append(reply)
        else:
            reply()


def _run_all(callbacks: list[Callable[[], None]]) -> None:
    for cb in callbacks:
        cb()


def _released(gate: Gate) -> bool:
    return not gate.paused


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class SimClock:
    """A node's clock: `offset + rate · loop.time()`, gated while the node is paused."""

    def __init__(self, loop: asyncio.AbstractEventLoop, gate: Gate, *, offset: float,
                 rate: float) -> None:
        self._loop = loop
        self._gate = gate
        self.offset = offset
        self.rate = rate

    def now(self) -> float:
        return self.offset + self.rate * self._loop.time()

    def true_of(self, local: float) -> float:
        return (local - self.offset) / self.rate

    async def sleep_until(self, deadline: float) -> None:
        while True:
            if self._gate.paused:
                await self._gate.wait(deadline)
                continue
            if self.now() >= deadline:
                await asyncio.sleep(0)
                if _released(self._gate):
                    return
                continue
            at = max(self.true_of(deadline), math.nextafter(self._loop.time(), math.inf))
            fut: asyncio.Future[None] = self._loop.create_future()
            handle = self._loop.call_at(at, _wake, fut)
            try:
                await fut
            finally:
                handle.cancel()
