"""The tier-2 fault proxy (distribution.md §7.3.1–§7.3.2).

One listener per node on 127.0.0.1 (port chosen by the OS); all listeners of a harness live in
one `ProxyHost` thread with its own asyncio loop. Every accepted connection gets its own
upstream connection (TCP or Unix socket), so a fault on one node's link never touches another's.

Rules:
- Directions: `up` = node→server, `down` = server→node. A rule is set per direction for the
  whole node (`role=None`) or for one connection role (from `application_name`
  `flyd:<node_id>:<role>` in the startup packet); a role rule overrides the node rule. Without
  a rule a direction passes. `set` applies at once, from any thread; the harness freezes its
  clock around it, so a change happens at an exact sim instant.
- Modes (per chunk, i.e. per read from the source socket):
  `Pass`; `Delay(mean_s, jitter_s[, spike])`: each chunk waits a draw in sim seconds (real wait
  = sim / time_scale), never overtaking an earlier chunk, draws seeded per connection and
  direction (SHA-256 of harness seed, node, ordinal, direction); `Hold`: bytes and EOF are
  buffered; `Drop`: bytes and EOF are discarded; `Reset`: every matching connection is reset
  (RST to the node, RST or close to the server) now, and every new one while the rule is
  active, as soon as its role is known (at once for a node rule); `HoldOnMatch(text)`: passes
  complete protocol messages until one contains `text`, then holds from that message's first
  byte on (bytes of an incomplete message wait for the rest, so the split is exact).
- Transitions (when a direction's effective mode changes): held bytes (and a held EOF) are
  re-delivered under the new mode in order — delivered at a heal, kept under a new `Hold`,
  discarded under `Drop` (a `HoldOnMatch` counts as `Pass` for them). A connection that lived
  under `Drop` is reset when the direction leaves `Drop`, as TCP keepalive and user timeouts
  would end it.
- A connection ends when both EOFs were delivered, when either peer resets it (the other side
  is then reset too), or when a fault resets it.
- Taps (`taps.py`) record every decoded message with its fate at the moment of decision.

Decision where the spec is silent: waits on peer bytes have no deadline (the proxy stands in
for the network, and an idle session is legal); every connection task is owned by the host's
TaskGroup and ends when the host closes, and connecting upstream is bounded by `CONNECT_S`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import random
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.distribution.harness.taps import (
    Decoder,
    Direction,
    Fate,
    Message,
    Tap,
    TapRecord,
    describe,
    role_of,
    startup_parameters,
)

CHUNK: Final = 65536
CONNECT_S: Final = 5.0
CALL_S: Final = 5.0
DIRECTIONS: Final[tuple[Direction, Direction]] = ("up", "down")
_LINGER_RST: Final = struct.pack("ii", 1, 0)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Pass:
    def label(self) -> str:
        return "pass"


@dataclass(frozen=True, slots=True)
class Delay:
    """`mean_s ± jitter_s` sim seconds per chunk; with probability `spike_p`, a spike of
    `spike_mean_s ± spike_jitter_s` instead (latency_near_ttl's slow tail)."""

    mean_s: float
    jitter_s: float = 0.0
    spike_p: float = 0.0
    spike_mean_s: float = 0.0
    spike_jitter_s: float = 0.0

    def draw(self, rng: random.Random) -> float:
        base, spike, pick = rng.uniform(-1, 1), rng.uniform(-1, 1), rng.random()
        if pick < self.spike_p:
            return max(0.0, self.spike_mean_s + spike * self.spike_jitter_s)
        return max(0.0, self.mean_s + base * self.jitter_s)

    def label(self) -> str:
        return f"delay({self.mean_s},{self.jitter_s})"


@dataclass(frozen=True, slots=True)
class Hold:
    def label(self) -> str:
        return "hold"


@dataclass(frozen=True, slots=True)
class Drop:
    def label(self) -> str:
        return "drop"


@dataclass(frozen=True, slots=True)
class Reset:
    def label(self) -> str:
        return "reset"


@dataclass(frozen=True, slots=True)
class HoldOnMatch:
    text: str

    def label(self) -> str:
        return f"hold_on_match({self.text!r})"


Mode = Pass | Delay | Hold | Drop | Reset | HoldOnMatch
PASS: Final = Pass()
HOLD: Final = Hold()
DROP: Final = Drop()
RESET: Final = Reset()


@dataclass(frozen=True, slots=True)
class Upstream:
    """Where a proxied connection goes: a Unix socket `path`, else TCP `host:port`."""

    host: str = "127.0.0.1"
    port: int = 5432
    path: str | None = None

    @classmethod
    def from_dsn(cls, dsn: str) -> Upstream:
        params = conninfo_to_dict(dsn)
        host = str(params.get("host") or "127.0.0.1").split(",")[0]
        port = int(str(params.get("port") or 5432).split(",")[0])
        if host.startswith("/"):
            return cls(port=port, path=f"{host}/.s.PGSQL.{port}")
        return cls(host=host, port=port)

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.path is not None:
            return await asyncio.open_unix_connection(self.path, limit=CHUNK)
        return await asyncio.open_connection(self.host, self.port, limit=CHUNK)


def proxied_dsn(dsn: str, port: int) -> str:
    """`dsn` redirected through a proxy listener, with TLS and GSS encryption off (taps)."""
    return make_conninfo(dsn, host="127.0.0.1", port=str(port), sslmode="disable",
                         gssencmode="disable")


def _seed_rng(seed: int, node: str, ordinal: int, direction: Direction) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{node}:{ordinal}:{direction}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _fate(mode: Mode) -> Fate:
    if isinstance(mode, Pass | Delay | HoldOnMatch):
        return "delivered"
    return "held" if isinstance(mode, Hold) else "dropped"


def _rst(writer: asyncio.StreamWriter) -> None:
    """Abort with RST for TCP (SO_LINGER 0); a Unix socket can only be closed."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # the peer's reset may have closed it already
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    writer.transport.abort()


@dataclass(slots=True)
class _Chunk:
    """Bytes (None = EOF) and the tap descriptions of the messages they complete."""

    data: bytes | None
    messages: list[tuple[str, dict[str, str | int]]] = field(default_factory=list)


class _Side:
    """One direction of one connection."""

    def __init__(self, direction: Direction, rng: random.Random) -> None:
        self.direction = direction
        self.rng = rng
        self.decoder = Decoder(direction)
        self.mode: Mode = PASS
        self.latched = False
        self.held: list[_Chunk] = []
        self.pending = bytearray()
        self.pending_at = 0
        self.eof_seen = False
        self.eof_routed = False
        self.eof_sent = False
        self.last_due = 0.0
        self.queue: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()

    @property
    def holding(self) -> bool:
        return self.latched or isinstance(self.mode, Hold)


@dataclass(frozen=True, slots=True)
class ConnInfo:
    ordinal: int
    role: str | None
    application_name: str | None
    backend_pid: int | None


class _Conn:
    def __init__(self, proxy: FaultProxy, ordinal: int, client: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.ordinal = ordinal
        self.client = client
        self.server: asyncio.StreamWriter | None = None
        self.application_name: str | None = None
        self.role: str | None = None
        self.backend_pid: int | None = None
        self.sides = {d: _Side(d, _seed_rng(proxy.host.seed, proxy.node, ordinal, d))
                      for d in DIRECTIONS}
        self.done = asyncio.Event()
        self.closed = False

    # -- routing ---------------------------------------------------------------------------

    def feed(self, side: _Side, data: bytes | None) -> None:
        """Bytes (or EOF) read from the source of `side`."""
        if self.closed:
            return
        if data is None:
            side.eof_seen = True
            messages: list[Message] = []
        else:
            messages = side.decoder.feed(data)
            side.pending += data
        described: list[tuple[Message, tuple[str, dict[str, str | int]]]] = []
        for msg in messages:
            what = describe(side.direction, msg)
            if what is None:
                continue
            described.append((msg, what))
            if what[0] == "startup" and self.application_name is None:
                params = startup_parameters(msg.body) or {}
                self.application_name = params.get("application_name")
                self.role = role_of(self.application_name)
                self.proxy.refresh(self)
                if self.done.is_set():
                    return
            elif what[0] == "backend_key":
                pid = what[1]["pid"]
                self.backend_pid = pid if isinstance(pid, int) else None
        self.dispatch(side, messages, described)

    def dispatch(self, side: _Side, messages: list[Message],
                 described: list[tuple[Message, tuple[str, dict[str, str | int]]]]) -> None:
        """Route `side.pending` (and a seen EOF) under the side's mode (module rules)."""
        mode = side.mode
        end = side.pending_at + len(side.pending)
        cut = end
        if isinstance(mode, HoldOnMatch) and not side.latched:
            needle = mode.text.encode()
            match = next((m.start for m in messages if needle in m.body), None)
            if match is None and not side.decoder.framed:
                found = bytes(side.pending).find(needle)
                match = None if found < 0 else side.pending_at + found
            if match is not None:
                cut = max(match, side.pending_at)
            elif side.decoder.framed and not side.eof_seen:
                cut = max(side.decoder.complete_upto, side.pending_at)
            first = _Chunk(bytes(side.pending[:cut - side.pending_at]),
                           [w for m, w in described if m.end <= cut])
            if first.data:
                self.route(side, first, PASS)
            del side.pending[:cut - side.pending_at]
            side.pending_at = cut
            if match is None:
                if side.eof_seen and not side.pending and not side.eof_routed:
                    side.eof_routed = True
                    self.route(side, _Chunk(None), PASS)
                return
            side.latched = True
            described = [(m, w) for m, w in described if m.end > cut]
        rest = _Chunk(bytes(side.pending), [w for _, w in described])
        side.pending.clear()
        side.pending_at = end
        if rest.data:
            self.route(side, rest, HOLD if side.latched else mode)
        if side.eof_seen and not side.eof_routed:
            side.eof_routed = True
            self.route(side, _Chunk(None), HOLD if side.latched else mode)

    def route(self, side: _Side, chunk: _Chunk, mode: Mode) -> None:
        if isinstance(mode, Reset):
            self.reset()
            return
        self.record(side, chunk, _fate(mode))
        if isinstance(mode, Hold):
            side.held.append(chunk)
            return
        if isinstance(mode, Drop):
            return
        now = asyncio.get_running_loop().time()
        delay = mode.draw(side.rng) / self.proxy.host.time_scale if isinstance(mode, Delay) \
            else 0.0
        side.last_due = max(now + delay, side.last_due)
        side.queue.put_nowait((side.last_due, chunk.data))

    def record(self, side: _Side, chunk: _Chunk, fate: Fate) -> None:
        host = self.proxy.host
        at = host.now()
        for kind, detail in chunk.messages:
            host.tap.add(TapRecord(at, self.proxy.node, self.role, self.ordinal,
                                   side.direction, kind, fate, detail))

    def transition(self, side: _Side, new: Mode) -> None:
        """The side's effective mode became `new` (module rules: transitions)."""
        was_holding = side.holding
        old, side.mode = side.mode, new
        side.latched = False
        if isinstance(new, Reset):
            self.reset()
            return
        if was_holding and not isinstance(new, Hold):
            held, side.held = side.held, []
            for chunk in held:
                self.route(side, chunk, PASS if isinstance(new, HoldOnMatch) else new)
        if isinstance(old, Drop) and not isinstance(new, Drop):
            self.reset()
            return
        if side.pending and not self.closed:
            self.dispatch(side, [], [])

    # -- lifetime --------------------------------------------------------------------------

    def reset(self) -> None:
        """RST both sides now; held bytes are lost (recorded `dropped`)."""
        if self.closed:
            return
        self.closed = True
        for side in self.sides.values():
            for chunk in side.held:
                self.record(side, chunk, "dropped")
            side.held.clear()
        for writer in (self.client, self.server):
            if writer is not None:
                _rst(writer)
        self.done.set()

    async def pump(self, side: _Side, reader: asyncio.StreamReader) -> None:
        while not self.closed:
            try:
                data = await reader.read(CHUNK)
            except OSError:
                self.reset()
                return
            self.feed(side, data or None)
            if not data:
                return

    async def write(self, side: _Side, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while not self.closed:
            due, data = await side.queue.get()
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if self.done.is_set():
                return
            try:
                if data is None:
                    if writer.can_write_eof() and not writer.is_closing():
                        writer.write_eof()
                    side.eof_sent = True
                    if all(s.eof_sent for s in self.sides.values()):
                        self.done.set()
                    return
                writer.write(data)
                await writer.drain()
            except OSError:
                self.reset()
                return

    def info(self) -> ConnInfo:
        return ConnInfo(self.ordinal, self.role, self.application_name, self.backend_pid)


class FaultProxy:
    """One node's listener and its link rules (module rules). Methods are thread-safe."""

    def __init__(self, host: ProxyHost, node: str, upstream: Upstream) -> None:
        self.host = host
        self.node = node
        self.upstream = upstream
        self.port = 0
        self._rules: dict[tuple[Direction, str | None], Mode] = {}
        self._conns: dict[int, _Conn] = {}
        self._ordinal = 0
        self._server: asyncio.Server | None = None

    # -- harness side (any thread) ---------------------------------------------------------

    def set(self, direction: Direction | Literal["both"], mode: Mode,
            role: str | None = None) -> None:
        """Switch `direction` (or both) of this node's links, or of one role's, to `mode`."""
        dirs = DIRECTIONS if direction == "both" else (direction,)
        self.host.call(lambda: self._set(dirs, mode, role))

    def heal(self) -> None:
        """Remove every rule of this node: all links pass (held bytes delivered, dropped
        connections reset)."""
        self.host.call(self._heal)

    def connections(self) -> list[ConnInfo]:
        return self.host.call(lambda: [c.info() for c in self._conns.values()])

    def dsn(self, dsn: str) -> str:
        return proxied_dsn(dsn, self.port)

    # -- proxy loop ------------------------------------------------------------------------

    def _set(self, dirs: tuple[Direction, ...], mode: Mode, role: str | None) -> None:
        for d in dirs:
            self._rules[(d, role)] = mode
            self.host.log_fault(self.node, d, role, mode)
        for conn in list(self._conns.values()):
            self.refresh(conn)

    def _heal(self) -> None:
        self._rules.clear()
        for d in DIRECTIONS:
            self.host.log_fault(self.node, d, None, PASS)
        for conn in list(self._conns.values()):
            self.refresh(conn)

    def effective(self, role: str | None, direction: Direction) -> Mode:
        if role is not None and (direction, role) in self._rules:
            return self._rules[(direction, role)]
        return self._rules.get((direction, None), PASS)

    def refresh(self, conn: _Conn) -> None:
        """Apply the rules to one connection (after a rule change or once its role is known)."""
        for d, side in conn.sides.items():
            if conn.closed:
                return
            new = self.effective(conn.role, d)
            if new != side.mode:
                conn.transition(side, new)

    async def listen(self) -> None:
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0, limit=CHUNK)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.host.spawn(self._serve(reader, writer))

    async def _serve(self, client_reader: asyncio.StreamReader,
                     client: asyncio.StreamWriter) -> None:
        self._ordinal += 1
        conn = _Conn(self, self._ordinal, client)
        self._conns[conn.ordinal] = conn
        try:
            if any(isinstance(self.effective(None, d), Reset) for d in DIRECTIONS):
                conn.reset()
                return
            for d, side in conn.sides.items():
                side.mode = self.effective(None, d)
            try:
                async with asyncio.timeout(CONNECT_S):
                    server_reader, conn.server = await self.upstream.open()
            except (OSError, TimeoutError):
                conn.reset()
                return
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(conn.pump(conn.sides["up"], client_reader)),
                         tg.create_task(conn.pump(conn.sides["down"], server_reader)),
                         tg.create_task(conn.write(conn.sides["up"], conn.server)),
                         tg.create_task(conn.write(conn.sides["down"], client))]
                await conn.done.wait()
                for task in tasks:
                    task.cancel()
        finally:
            del self._conns[conn.ordinal]
            for writer in (client, conn.server):
                if writer is not None and not writer.is_closing():
                    writer.close()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns.values()):
            conn.reset()


class _Stop(Exception):
    """Raised in the host's TaskGroup body to end every task it owns."""


class ProxyHost:
    """The harness thread running every node's proxy on one asyncio loop.

    `now` gives true sim time for tap records (the harness clock); `time_scale` turns delay
    draws (sim seconds) into real waits; `seed` seeds the delay draws."""

    def __init__(self, now: Callable[[], float], time_scale: float = 1.0, seed: int = 0) -> None:
        self.now = now
        self.time_scale = time_scale
        self.seed = seed
        self.tap = Tap()
        self.fault_log: list[dict[str, object]] = []
        self.proxies: dict[str, FaultProxy] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="fault-proxy", daemon=True)

    def start(self) -> ProxyHost:
        self._thread.start()
        if not self._ready.wait(CALL_S):
            raise RuntimeError("the proxy thread did not start")
        return self

    def close(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(CALL_S)

    def __enter__(self) -> ProxyHost:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def add(self, node: str, upstream: Upstream) -> FaultProxy:
        """A new listener for `node` (its port is `FaultProxy.port`)."""
        proxy = FaultProxy(self, node, upstream)
        self.call_async(proxy.listen())
        self.proxies[node] = proxy
        return proxy

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the proxy loop and return its result (bounded by `CALL_S`)."""
        assert self._loop is not None
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except Exception as exc:  # handed to the calling thread
                done.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return done.result(CALL_S)

    def call_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the proxy loop and return its result (bounded by `CALL_S`)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_S)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A connection task, owned by the host's TaskGroup."""
        assert self._tg is not None
        self._tg.create_task(coro)

    def log_fault(self, node: str, direction: Direction, role: str | None, mode: Mode) -> None:
        self.fault_log.append({"t": self.now(), "node": node, "dir": direction, "role": role,
                               "mode": mode.label()})

    def _main(self) -> None:
        asyncio.run(self._amain())

    async def _amain(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._ready.set()
                await self._stop.wait()
                for proxy in self.proxies.values():
                    await proxy.close()
                raise _Stop
        except* _Stop:
            pass
