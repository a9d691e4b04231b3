"""Node clocks (design/distribution.md §4.1 R2, §5.1): `now()` in seconds, `sleep_until(t)`.

Rules:
- The lease core never reads a clock; the runtime reads one of these and passes the number.
- `BootClock`: `CLOCK_BOOTTIME` on Linux (counts suspend), else `time.monotonic()`.
  `sleep_until` re-reads the clock after every wake-up: the loop's timer does not count
  suspend, so a wake-up is only a prompt to look again, never evidence that time passed.
- `LoopClock`: the running loop's clock (tests and tools that want loop time).
- `ManualClock`: virtual time for tests; it moves only by `advance`/`set`, and sleepers whose
  deadline has come are woken then. Nothing sleeps in real time.
- `SimFileClock` (design/distribution.md §7.3.4, `flyd serve --sim-clock PATH`): the harness clock's
  file, read with `mmap`, never the database, so a partitioned node still sees time pass. Layout (16
  bytes, little-endian): `u64` seqlock counter (odd while the writer is inside), `i64` sim time in
  ns. A reader retries until it sees the same even counter before and after reading the time.
  `sleep_until` polls every `SIM_POLL_S` of real time (the harness advances in 5 ms ticks).
  `rate` (`--clock-rate`, the clock-skew scenario) scales elapsed sim time since the first
  reading, so a node's clock can run fast or slow against the server's.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import mmap
import os
import struct
import sys
import time
from pathlib import Path
from typing import Final, Protocol

SIM_LAYOUT: Final = struct.Struct("<Qq")
SIM_POLL_S: Final = 0.002


class LeaseClock(Protocol):
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


class SimFileClock:
    """The harness clock as seen by a node (design/distribution.md §7.3.4): seconds of sim time,
    optionally skewed."""

    def __init__(self, path: Path | str, rate: float = 1.0) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._map = mmap.mmap(fd, SIM_LAYOUT.size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        self.rate = rate
        self._origin: float | None = None

    def _raw(self) -> float:
        while True:
            before, ns = SIM_LAYOUT.unpack_from(self._map, 0)
            after = SIM_LAYOUT.unpack_from(self._map, 0)[0]
            if before == after and before % 2 == 0:
                return float(ns) / 1e9

    def now(self) -> float:
        t = self._raw()
        if self.rate == 1.0:
            return t
        if self._origin is None:
            self._origin = t
        return self._origin + (t - self._origin) * self.rate

    async def sleep_until(self, deadline: float) -> None:
        """Poll: the time source is another process's file, there is nothing to wait on."""
        while True:
            if self.now() >= deadline:
                return
            await asyncio.sleep(SIM_POLL_S)

    def close(self) -> None:
        self._map.close()


class SimFileWriter:
    """The writer side of the sim-clock file (harnesses): `write(ns)` under the seqlock."""

    def __init__(self, path: Path | str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size < SIM_LAYOUT.size:
                os.ftruncate(fd, SIM_LAYOUT.size)
            self._map = mmap.mmap(fd, SIM_LAYOUT.size)
        finally:
            os.close(fd)
        self._counter = SIM_LAYOUT.unpack_from(self._map, 0)[0] & ~1

    def write(self, ns: int) -> None:
        self._counter += 1
        SIM_LAYOUT.pack_into(self._map, 0, self._counter, SIM_LAYOUT.unpack_from(self._map, 0)[1])
        SIM_LAYOUT.pack_into(self._map, 0, self._counter, ns)
        self._counter += 1
        SIM_LAYOUT.pack_into(self._map, 0, self._counter, ns)

    def close(self) -> None:
        self._map.close()
