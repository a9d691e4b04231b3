"""Node clocks (distribution.md §4.1 R2, §5.1): `now()` in seconds, `sleep_until(t)`.

Rules:
- The lease core never reads a clock; the runtime reads one of these and passes the number.
- `BootClock`: `CLOCK_BOOTTIME` on Linux (counts suspend), else `time.monotonic()`.
  `sleep_until` re-reads the clock after every wake-up: the loop's timer does not count
  suspend, so a wake-up is only a prompt to look again, never evidence that time passed.
- `LoopClock`: the running loop's clock (tests and tools that want loop time).
- `ManualClock`: virtual time for tests; it moves only by `advance`/`set`, and sleepers whose
  deadline has come are woken then. Nothing sleeps in real time.

Left out: `SimFileClock` (§7.3.4) belongs with the tier-2 harness, whose file layout (int64
ns under a seqlock counter) is not yet fixed byte for byte.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import sys
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...

    async def sleep_until(self, deadline: float) -> None: ...


class BootClock:
    """R2's node clock."""

    def __init__(self) -> None:
        boot: int | None = getattr(time, "CLOCK_BOOTTIME", None)
        self._boot = boot if sys.platform.startswith("linux") else None

    def now(self) -> float:
        if self._boot is None:
            return time.monotonic()
        return time.clock_gettime(self._boot)

    async def sleep_until(self, deadline: float) -> None:
        while True:
            left = deadline - self.now()
            if left <= 0:
                return
            await asyncio.sleep(left)


class LoopClock:
    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep_until(self, deadline: float) -> None:
        while True:
            left = deadline - self.now()
            if left <= 0:
                return
            await asyncio.sleep(left)


class ManualClock:
    """Virtual time: `advance(dt)` moves it and wakes every sleeper whose deadline has come."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._seq = itertools.count()
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self._now

    def set(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"ManualClock never goes back ({t} < {self._now})")
        self._now = t
        while self._sleepers and self._sleepers[0][0] <= t:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)

    def advance(self, dt: float) -> None:
        self.set(self._now + dt)

    def next_wakeup(self) -> float | None:
        live = [d for d, _, f in self._sleepers if not f.done()]
        return min(live) if live else None

    async def sleep_until(self, deadline: float) -> None:
        if deadline <= self._now:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (deadline, next(self._seq), fut))
        await fut
