"""The harness clock (distribution.md §7.3.4).

A thread owns sim time: every 5 ms of real time it adds the real time elapsed since its
previous tick × `time_scale` (unless frozen), writes the `flyd.sim_clock` row, then the
sim-clock file the nodes read. Nodes never read the
database for time, so a partitioned node still sees time pass; `flyd.app_now()` reads the row,
so the server judges expiry in the same sim time. No test waits out a TTL in real time: at
scale 20 a 15 s TTL passes in 0.75 s.

Decisions where the spec is silent:
- A tick adds the real time elapsed since the previous one (monotonic clock), not a fixed
  5 ms × `time_scale`: under load a tick (its wake-up and the row's UPDATE) takes longer than
  5 ms, and fixed steps then ran sim time at a fraction of the scale (about 4x instead of 10x
  at load 10-26), stretching every real-time bound of the nodes and the server against sim
  time. Sim time now passes at `time_scale` × real time however late a tick runs; a late tick
  is one larger step. Frozen time is not credited: `thaw` restarts the count, and ticks while
  frozen only move the reference. `max_step_s()` reports the largest step so far (the
  "one tick" within which the row and the file agree). `now()` is the last value written to
  the file, read without the lock, so no reader waits for a tick's UPDATE.
- When the row cannot be written (the server restarts, or its session was ended) the tick
  still writes the file and reconnects at the next tick, so time keeps passing for the nodes
  while the server is away (as a real clock would) and the row catches up as soon as the
  server answers. The server then lags the nodes, the direction a node's safety margin does
  not depend on.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import TracebackType

import psycopg

from flyd.leases.clock import SimFileWriter

TICK_S = 0.005
CONNECT_S = 1
EPOCH = datetime(2030, 1, 1, tzinfo=UTC)


class HarnessClock:
    """Sim time shared by the database row and the nodes' clock file."""

    def __init__(self, dsn: str, path: Path, time_scale: float = 20.0,
                 start_s: float = 1000.0) -> None:
        self.dsn = dsn
        self.path = path
        self.time_scale = time_scale
        self._sim_ns = int(start_s * 1e9)
        self._frozen = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._max_step_ns = int(TICK_S * time_scale * 1e9)
        self._writer = SimFileWriter(path)
        self._conn: psycopg.Connection[tuple[object, ...]] | None = psycopg.connect(
            dsn, autocommit=True)
        self._conn.execute("INSERT INTO flyd.sim_clock (t) VALUES (%s) "
                           "ON CONFLICT (only_row) DO UPDATE SET t = excluded.t",
                           (self._at(),))
        self._writer.write(self._sim_ns)
        self._published_ns = self._sim_ns
        self._thread = threading.Thread(target=self._loop, name="harness-clock", daemon=True)

    def _at(self) -> datetime:
        return EPOCH + timedelta(microseconds=self._sim_ns // 1000)

    def now(self) -> float:
        """Sim seconds, as the nodes read them (the file's value; the row is never behind it).
        Lock-free: readers (proxy taps, samples) never wait for a tick's UPDATE."""
        return self._published_ns / 1e9

    def _publish(self) -> None:
        try:
            if self._conn is None:
                self._conn = psycopg.connect(self.dsn, autocommit=True,
                                             connect_timeout=CONNECT_S)
            self._conn.execute("UPDATE flyd.sim_clock SET t = %s", (self._at(),))
        except psycopg.OperationalError:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
        self._writer.write(self._sim_ns)
        self._published_ns = self._sim_ns

    def max_step_s(self) -> float:
        """The largest sim advance of one tick so far (at least 5 ms × `time_scale`)."""
        with self._lock:
            return self._max_step_ns / 1e9

    def _loop(self) -> None:
        while not self._stop.wait(TICK_S):
            with self._lock:
                now = time.monotonic()
                elapsed, self._last = now - self._last, now
                if self._frozen.is_set():
                    continue
                step = int(elapsed * self.time_scale * 1e9)
                self._max_step_ns = max(self._max_step_ns, step)
                self._sim_ns += step
                self._publish()

    def freeze(self) -> None:
        """Stop sim time; on return no tick is in progress, so the row and the file agree."""
        with self._lock:
            self._frozen.set()

    def thaw(self) -> None:
        """Run again from now: the frozen interval is never credited."""
        with self._lock:
            self._last = time.monotonic()
            self._frozen.clear()

    def advance(self, seconds: float) -> None:
        """Jump sim time (the clock frozen or not), row first, then the file."""
        with self._lock:
            self._sim_ns += int(seconds * 1e9)
            self._publish()

    def __enter__(self) -> HarnessClock:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(2.0)
        if self._conn is not None:
            self._conn.close()
        self._writer.close()
