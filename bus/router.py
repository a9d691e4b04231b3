"""The router (design/wire.md §1, §4–§16): a thin shell that reads frames and hands each to its
part.

The router only routes. All routing state lives on one event loop and every state change is
synchronous: a handler for one frame never awaits another connection, so a slow or hostile
peer can only hurt itself. This module binds the socket, accepts and reads connections, runs
the checks every frame shares (design/wire.md §4) and dispatches each op to the part that owns its
concern:

    bus/registry.py      the hello, expectations and services (who is on the bus)
    bus/call_ops.py      calls, replies, releases, cancels and credits; the RPC lane
    bus/topic_ops.py     topics and subscriptions; the topic lane
    bus/artifact_ops.py  the artifact store (topics.md §5, §6)
    bus/router_stats.py  `bus.stats`, read from the parts' books
    bus/outbound.py      responses, notices and the closing frame; the counters
    bus/inbound.py       the frame in hand (its body member, design/wire.md §22.1) and checks 4 and
    5

Each connection has its own writer (`writable`), which alone looks at that connection's
transport buffer: control frames (responses and notices) first, then its results, then
requests pulled lazily from the FIFOs of the services it owns; a connection with
subscriptions interleaves its topic lane by `LaneTurn` (topics.md §4.2). A call therefore
waits Queued (bounded, cancellable) instead of piling up in socket buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import secrets
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
import structlog

from bus.artifact_ops import DEFERRED, ArtifactOps
from bus.call_ops import CallOps
from bus.connection import Conn
from bus.errors import BusError, InvalidEnvelope, error_object
from bus.framing import PREFIX
from bus.inbound import Inbound
from bus.lanes import Lane
from bus.limits import FRAMES_PER_TURN, Limits
from bus.outbound import Outbound
from bus.ownership import Trust, UnsafeDirectory, check_dir, make_dirs
from bus.policy import Policy
from bus.registry import Registry
from bus.router_stats import Books, stats
from bus.schema import Validator, contract_digest, validator
from bus.sockets import probe_socket
from bus.store import StoreSettings, StoreStartError
from bus.topic_ops import TopicOps

log = structlog.get_logger("bus.router")

SUN_PATH_MAX: Final = 107
SOMAXCONN_PATH: Final = "/proc/sys/net/core/somaxconn"
WRITE_BATCH_BYTES: Final = 65536
STOP_BUDGET_S: Final = 5.0
PEERCRED: Final = struct.Struct("3i")
#: the ops of bus v1 after the hello, each with its params schema (ops/<op>.params.json)
OPS: Final = (
    "bus.register", "bus.unregister", "bus.call", "bus.reply", "bus.release", "bus.cancel",
    "bus.consumed", "bus.services", "bus.stats", "bus.expect", "bus.declare", "bus.undeclare",
    "bus.publish", "bus.subscribe", "bus.unsubscribe", "bus.topics", "bus.allocate",
    "bus.seal", "bus.retain", "bus.drop",
)

Handler = Callable[[Conn, dict[str, Any], int], Any]


class RouterStartError(RuntimeError):
    """The router cannot start (socket path, live router, bad file); the message says why."""


@dataclass(frozen=True)
class RouterConfig:
    socket_path: str
    limits: Limits = field(default_factory=Limits)
    policy: Policy = field(default_factory=Policy.default)
    socket_group: str | None = None
    allowed_uids: tuple[int, ...] | None = None
    store: StoreSettings = field(default_factory=StoreSettings)


class Router:
    """The bus router. Embedded use: `await Router(config).start()`, then `await stop()`.

    Its parts are public (`registry`, `calls`, `topics`, `artifacts`): each owns the books of
    its concern, and an operator's tool or a harness reads them there."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.limits = lim = config.limits
        self.policy = config.policy
        self.socket_path = config.socket_path
        self.router_id = "router-" + secrets.token_hex(8)
        self._digest = contract_digest()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._started = 0.0
        self._stop_requested: asyncio.Event | None = None
        self._all_lost: asyncio.Event | None = None
        self.fatal: BaseException | None = None
        self._conns: dict[int, Conn] = {}
        self._conn_counter = 0
        self._allowed_uids = (
            config.allowed_uids if config.allowed_uids is not None else (os.geteuid(),)
        )
        self._group_gid = grp.getgrnam(config.socket_group).gr_gid if config.socket_group else None
        self.out = out = Outbound(lim, self.writable, self.ended, self._invariant_broken)
        self._in = inbound = Inbound(out)
        self.registry = Registry(config.policy, lim)
        self.artifacts = ArtifactOps(lim, out, self.readable, secrets.randbelow(2**40) + 1)
        params = {name: validator(f"ops/{name}.params.json") for name in OPS}
        self.topics = TopicOps(lim, out, inbound, self.artifacts, params["bus.publish"],
                               secrets.randbelow(2**40) + 1)
        self.calls = calls = CallOps(lim, out, inbound, self.registry, self.artifacts,
                                     self.topics, params)
        reg, top, art = self.registry, self.topics, self.artifacts
        handlers: dict[str, Handler] = {
            "bus.register": reg.op_register, "bus.unregister": calls.op_unregister,
            "bus.call": calls.op_call, "bus.reply": calls.op_reply,
            "bus.release": calls.op_release, "bus.cancel": calls.op_cancel,
            "bus.consumed": calls.op_consumed, "bus.services": reg.op_services,
            "bus.stats": self._op_stats, "bus.expect": reg.op_expect,
            "bus.declare": top.op_declare, "bus.undeclare": top.op_undeclare,
            "bus.publish": top.op_publish, "bus.subscribe": top.op_subscribe,
            "bus.unsubscribe": top.op_unsubscribe, "bus.topics": top.op_topics,
            "bus.allocate": art.op_allocate, "bus.seal": art.op_seal,
            "bus.retain": art.op_retain, "bus.drop": art.op_drop,
        }
        self._ops: dict[str, tuple[Validator, Handler]] = {
            name: (params[name], handlers[name]) for name in OPS}
        # the lean notification forms (design/wire.md §21): the same params schemas as the requests
        self._lean: dict[str, Callable[[Conn, dict[str, Any]], None]] = {
            "bus.call": calls.lean_call,
            "bus.reply": calls.lean_reply,
            "bus.consumed": calls.lean_consumed,
            "bus.publish": top.lean_publish,
        }

    # lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the socket (0600/0660 under a restrictive umask) and start accepting."""
        self._loop = self.out.loop = self.registry.loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        path = self.socket_path
        if len(os.fsencode(path)) > SUN_PATH_MAX:
            raise RouterStartError(
                f"socket path is {len(os.fsencode(path))} bytes; the limit (sun_path) is "
                f"{SUN_PATH_MAX}: {path}"
            )
        self._prepare_path(path)
        self._open_store()
        staging = staging_path(path)
        bind_at = staging or path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o117 if self._group_gid is not None else 0o177)
        try:
            if staging is not None:
                _remove_stale_socket(staging)
            sock.bind(bind_at)
        except OSError as exc:
            sock.close()
            self.artifacts.remove()
            raise RouterStartError(f"cannot bind {bind_at}: {exc}") from exc
        finally:
            os.umask(old)
        if self._group_gid is not None:
            os.chown(bind_at, -1, self._group_gid)
            os.chmod(bind_at, 0o660)
        else:
            os.chmod(bind_at, 0o600)
        # the loop listens again with its own default backlog (100) unless it is given one
        backlog = listen_backlog(self.limits.maxClients)
        sock.listen(backlog)
        sock.setblocking(False)
        if staging is not None:
            self._publish_path(sock, staging, path)
        max_envelope = self.limits.maxEnvelopeBytes
        self._server = await self._loop.create_unix_server(
            lambda: Conn(self, max_envelope), sock=sock, backlog=backlog
        )
        self.out.serving = True
        self._started = time.monotonic()
        if self.policy.mode == "open":
            log.warning("router.open_policy", socket=path,
                        detail="every client may register, call and expect anything")
        log.info("router.started", router_id=self.router_id, socket=path, pid=os.getpid())

    def _publish_path(self, sock: socket.socket, staging: str, path: str) -> None:
        """Give the listening socket its name: a client that finds the file can connect.

        A hard link, not a rename, so that a router which took the name meanwhile keeps it
        (the link fails, as a bind in place would)."""
        try:
            os.link(staging, path)
        except OSError as exc:
            sock.close()
            self.artifacts.remove()
            detail = ("another router bound it while this one started"
                      if isinstance(exc, FileExistsError) else str(exc))
            raise RouterStartError(f"cannot bind {path}: {detail}") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)

    def _open_store(self) -> None:
        """topics.md §5.1: the store directory of this start, or none when disabled."""
        try:
            self.artifacts.open(self.config.store)
        except StoreStartError as exc:
            raise RouterStartError(f"[bus.store] root: {exc}") from exc

    def _prepare_path(self, path: str) -> None:
        """The socket's directory is created (0700, 0750 with a group) or must be one nobody
        else controls (`bus.ownership`); a stale socket in it is removed, a live one refused."""
        parent = os.path.dirname(os.path.abspath(path))
        try:
            make_dirs(parent, 0o750 if self._group_gid is not None else 0o700, self._group_gid)
        except OSError as exc:
            raise RouterStartError(f"cannot create the socket directory {parent}: "
                                   f"{exc.strerror or exc}") from exc
        try:
            check_dir(parent, Trust.own(self._group_gid))
        except UnsafeDirectory as exc:
            raise RouterStartError(f"socket {path}: {exc.message}") from exc
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise RouterStartError(f"{path} exists and is not a socket; not touching it")
        try:
            live = probe_socket(path)
        except OSError as exc:
            raise RouterStartError(f"cannot probe existing socket {path}: {exc}") from exc
        if live:
            raise RouterStartError(f"a live router already listens on {path}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        log.info("router.stale_socket_removed", socket=path)

    async def stop(self) -> None:
        """Orderly stop (design/wire.md §11): ROUTER_LOST to everyone, unlink the socket."""
        if self._server is None:
            return
        server, self._server = self._server, None
        self.out.serving = False
        server.close()
        for conn in list(self._conns.values()):
            if conn.closing:
                if conn.transport is not None:
                    conn.transport.close()  # end a lingering close (Outbound.finish_close) now
            else:
                self.out.close(conn, "ROUTER_LOST", "router stopping")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        if self._conns:
            self._all_lost = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STOP_BUDGET_S):
                    await self._all_lost.wait()
        for conn in list(self._conns.values()):
            if conn.transport is not None:
                conn.transport.abort()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await server.wait_closed()
        self.artifacts.remove()
        log.info("router.stopped", router_id=self.router_id)

    def request_stop(self) -> None:
        """Ask `serve_forever` to stop the router (signal handlers call this)."""
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def serve_forever(self) -> None:
        """Serve until `request_stop()` or a broken invariant; re-raise the latter so the
        supervisor restarts the router."""
        assert self._stop_requested is not None, "start() first"
        await self._stop_requested.wait()
        await self.stop()
        if self.fatal is not None:
            raise self.fatal

    def _invariant_broken(self, exc: BaseException) -> None:
        """design/wire.md §11: log, close every connection with ROUTER_LOST, stop serving."""
        log.error("router.invariant_broken", error=repr(exc))
        self.fatal = exc
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns.values()):
            self.out.close(conn, "ROUTER_LOST", "router invariant broken")
        self.request_stop()

    # accept / read (the connections' host) ----------------------------------------------
    def accepted(self, conn: Conn) -> None:
        self._conn_counter += 1
        conn.number = self._conn_counter
        conn.connection_id = f"conn-{conn.number}"
        transport = conn.transport
        assert transport is not None
        transport.set_write_buffer_limits(high=self.limits.writeHighWaterBytes)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                conn.pid, conn.uid, conn.gid = PEERCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
                )
            except OSError:
                pass
        if self._server is None:
            transport.abort()
            return
        counters = self.out.counters
        if sum(1 for c in self._conns.values() if not c.closing) >= self.limits.maxClients:
            counters["refusedAtAccept"] += 1
            self._conns[conn.number] = conn
            self.out.close(conn, "QUOTA_EXCEEDED",
                           f"maxClients ({self.limits.maxClients}) reached")
            return
        allowed = conn.uid in self._allowed_uids or (
            self._group_gid is not None and conn.gid == self._group_gid
        )
        self._conns[conn.number] = conn
        if not allowed:
            counters["refusedAtAccept"] += 1
            self.out.close(conn, "NOT_AUTHORIZED", f"peer uid {conn.uid} is not allowed")
            return
        counters["accepted"] += 1
        assert self._loop is not None
        conn.hello_timer = self._loop.call_later(
            self.limits.helloTimeoutMs / 1000.0, self._hello_expired, conn
        )
        log.info("bus.accept", connection_id=conn.connection_id, pid=conn.pid, uid=conn.uid)

    def _hello_expired(self, conn: Conn) -> None:
        conn.hello_timer = None
        if conn.client_id is None and not conn.closing:
            self.out.close(conn, "INVALID_ENVELOPE", "bus.hello deadline expired")

    def readable(self, conn: Conn) -> None:
        """Handle at most FRAMES_PER_TURN frames. What they cause is written by the flush
        that `Outbound.mark` scheduled, after every read of this wake-up: replies from
        several services to one caller (a lockstep phase's fan-in) leave in one write."""
        decoder = conn.decoder
        for _ in range(FRAMES_PER_TURN):
            if conn.closing:
                return
            # topics.md §5.5 rule 4: nothing more from it until its hash is applied
            if conn.sealing:
                if not conn.read_paused and conn.transport is not None:
                    conn.read_paused = True
                    conn.transport.pause_reading()
                return
            try:
                body = decoder.next_frame()
            except InvalidEnvelope as exc:
                self.out.close(conn, "INVALID_ENVELOPE", exc.message)
                return
            if body is None:
                if conn.read_paused and conn.transport is not None:
                    conn.read_paused = False
                    conn.transport.resume_reading()
                return
            try:
                self._on_frame(conn, body)
            except Exception as exc:  # a bug here must not leave half-applied state serving
                self._invariant_broken(exc)
                return
        if not conn.read_paused and conn.transport is not None and not conn.closing:
            conn.read_paused = True
            conn.transport.pause_reading()
        assert self._loop is not None
        self._loop.call_soon(self.readable, conn)

    def _on_frame(self, conn: Conn, body: bytes) -> None:
        conn.frames_in += 1
        out = self.out
        counters = out.counters
        counters["framesIn"] += 1
        counters["bytesIn"] += len(body) + 4
        inbound = self._in
        try:
            msg = inbound.read(body)
        except BusError as exc:
            out.close(conn, "PARSE_ERROR", exc.message)
            return
        if type(msg) is not dict or msg.get("jsonrpc") != "2.0":
            out.close(conn, "INVALID_REQUEST", "not a JSON-RPC 2.0 request object")
            return
        method = msg.get("method")
        if type(method) is not str:
            out.close(conn, "INVALID_REQUEST", "method must be a string")
            return
        has_id = "id" in msg
        n = len(msg) - has_id
        if n == 3 and "params" in msg:
            params = msg["params"]
            if type(params) is not dict:
                out.close(conn, "INVALID_REQUEST", "params must be an object")
                return
        elif n == 2:
            params = {}
        else:
            out.close(conn, "INVALID_REQUEST",
                      "a request has exactly jsonrpc, id, method and optional params")
            return
        if not has_id:
            lean = self._lean.get(method)
            if lean is None:
                out.close(conn, "INVALID_REQUEST", "only bus.call, bus.reply, bus.consumed "
                          "and bus.publish may be sent as notifications")
                return
            lean(conn, params)
            return
        rid = inbound.next_id(conn, msg["id"], "id", "id must be an integer in 1..2^53-1")
        if rid is None:
            return
        if conn.client_id is None:
            if method != "bus.hello":
                out.close(conn, "INVALID_ENVELOPE", "the first request must be bus.hello")
                return
            self._hello(conn, rid, params)
            return
        if method == "bus.hello":
            out.close(conn, "INVALID_ENVELOPE", "bus.hello was already completed")
            return
        op = self._ops.get(method)
        if op is None:
            out.respond_error(conn, rid, "METHOD_NOT_FOUND",
                              f"{method[:128]!r} is not a bus v1 operation", "not-dispatched")
            return
        problem = op[0](params) or inbound.body_refused(strict=method == "bus.publish")
        if problem is not None:
            out.respond_error(conn, rid, "INVALID_PARAMS", f"{method}: {problem}",
                              "not-dispatched")
            return
        try:
            result = op[1](conn, params, rid)
        except BusError as exc:
            if method == "bus.call":
                counters["callsRefused"] += 1
            out.respond_error(conn, rid, exc.name, exc.message, exc.dispatch)
            return
        if result is not DEFERRED:
            out.respond(conn, rid, result)

    def _hello(self, conn: Conn, rid: int, params: dict[str, Any]) -> None:
        """design/wire.md §6: the registry checks and applies; a refusal is the last frame."""
        out = self.out
        try:
            grants = self.registry.hello(conn, params)
        except BusError as exc:
            out.counters["helloRefused"] += 1
            out.count_error(exc.name)
            body = orjson.dumps({"jsonrpc": "2.0", "id": rid,
                                 "error": error_object(exc.name, exc.message, "not-dispatched")})
            log.info("bus.hello_refused", connection_id=conn.connection_id, error=exc.name,
                     client_id=params.get("clientId") if isinstance(
                         params.get("clientId"), str) else None, pid=conn.pid, uid=conn.uid)
            transport = conn.transport
            self.ended(conn, exc.name)
            if transport is not None:
                transport.write(PREFIX.pack(len(body)) + body)
                out.finish_close(conn)
            return
        out.counters["helloOk"] += 1
        out.respond(conn, rid, {
            "routerId": self.router_id,
            "connectionId": conn.connection_id,
            "major": 1,
            "minor": 3,
            "contractDigest": self._digest,
            "grants": grants.to_wire(),
            "limits": self.limits.hello(),
            "store": self.artifacts.offer(conn),
        })

    # the writer -----------------------------------------------------------------------------
    def writable(self, conn: Conn) -> None:
        """The connection's writer: control lane, then results, then dispatch, in batches,
        until the transport signals its high-water mark (pause_writing) or, with budget left
        over, nothing more is ready."""
        transport = conn.transport
        if conn.closing or transport is None:
            return
        if conn in self.topics.table.readers:
            self._write_lanes(conn, transport)
            return
        control = conn.control
        calls = self.calls
        while not conn.write_paused:
            out: list[bytes] = []
            budget = WRITE_BATCH_BYTES
            while control and budget > 0:
                body = control.popleft()
                conn.control_bytes -= len(body)
                out.append(PREFIX.pack(len(body)))
                out.append(body)
                budget -= len(body) + 4
            if not control:
                while conn.results and budget > 0:
                    body = calls.take_result(conn)
                    out.append(PREFIX.pack(len(body)))
                    out.append(body)
                    budget -= len(body) + 4
                if budget > 0 and not conn.results and conn.services:
                    budget = calls.dispatch(conn, out, budget)
            if not out:
                return
            data = b"".join(out)
            self.out.wrote(conn, len(out) // 2, len(data))
            transport.write(data)
            if budget > 0:  # every lane ran dry before the batch filled
                return

    def _write_lanes(self, conn: Conn, transport: asyncio.Transport) -> None:
        """`writable` for a connection with subscriptions: one frame at a time, the topic
        lane taking its turn by `LaneTurn` (topics.md §4.2) between the control and RPC
        lanes."""
        control = conn.control
        topics = self.topics
        table = topics.table
        calls = self.calls
        turn = conn.lane
        while not conn.write_paused:
            out: list[bytes] = []
            budget = WRITE_BATCH_BYTES
            while budget > 0:
                sub = table.next_ready(conn, conn.control_taken)
                other = bool(control or conn.results) or calls.dispatchable(conn)
                lane = turn.pick(sub is not None, other)
                if lane is None:
                    break
                if lane is Lane.TOPIC:
                    assert sub is not None
                    body = topics.frame(conn, sub)
                elif control:
                    body = control.popleft()
                    conn.control_bytes -= len(body)
                    conn.control_taken += 1
                elif conn.results:
                    body = calls.take_result(conn)
                else:
                    before = len(out)
                    calls.dispatch(conn, out, 1)
                    if len(out) == before:
                        break
                    budget -= len(out[-1]) + 4
                    continue
                out.append(PREFIX.pack(len(body)))
                out.append(body)
                budget -= len(body) + 4
            if not out:
                return
            data = b"".join(out)
            self.out.wrote(conn, len(out) // 2, len(data))
            transport.write(data)
            if budget > 0:
                return

    # teardown -------------------------------------------------------------------------------
    def lost(self, conn: Conn) -> None:
        self._conns.pop(conn.number, None)
        if not self._conns and self._all_lost is not None:
            self._all_lost.set()

    def ended(self, conn: Conn, reason: str) -> None:
        """design/wire.md §10.2, in order. Idempotent; the first reason is the one counted."""
        if conn.torn_down:
            return
        conn.torn_down = True
        conn.closing = True
        conn.control.clear()
        conn.control_bytes = 0
        conn.results.clear()
        counters = self.out.counters
        counters["closed"] += 1
        closes = counters["closes"]
        closes[reason] = closes.get(reason, 0) + 1
        if conn.hello_timer is not None:
            conn.hello_timer.cancel()
            conn.hello_timer = None
        log.info("bus.close", connection_id=conn.connection_id, client_id=conn.client_id,
                 reason=reason)
        self.registry.forget_live(conn)  # 1
        self.calls.forget_connection(conn)  # 2–5: services, deliveries, calls it made
        self.registry.forget_expectations(conn)  # 6
        self.topics.forget_connection(conn)  # 7 + 8: subscriptions, messages, topics
        self.artifacts.forget_connection(conn)  # 9 + 10: holds, allocations, files

    # stats ----------------------------------------------------------------------------------
    def _op_stats(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        return self.stats(bool(p.get("detail", False)))

    def stats(self, detail: bool = False) -> dict[str, Any]:
        """The `bus.stats` result of design/wire.md §16 with the topic and artifact counters;
        O(connections + services), so polling it never pauses routing."""
        now = time.monotonic()
        books = Books(self.router_id, self._conns.values(), self.registry, self.calls.ledger,
                      self.topics.table, self.artifacts.ledger, self.artifacts.stats(),
                      self.out.counters)
        return stats(books, now - self._started, now, detail)


def staging_path(path: str, pid: int | None = None) -> str | None:
    """Where the router of `pid` (this process by default) binds before it listens: a hidden
    name beside `path`, or None when that name would not fit sun_path (then it binds `path`
    itself).

    Why: between `bind` and `listen` a socket file exists that refuses connections, and a
    client that waits for the file (the launcher's children, `flyctl`, tests) may hit that
    window. Bound and listening under the staging name, the socket is then linked to `path`.
    """
    parent, base = os.path.split(path)
    staging = os.path.join(parent, f".{base}.{os.getpid() if pid is None else pid}.bind")
    return staging if len(os.fsencode(staging)) <= SUN_PATH_MAX else None


def _remove_stale_socket(path: str) -> None:
    """A staging name left by a router of the same pid that died between bind and link."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def listen_backlog(max_clients: int) -> int:
    """The listen backlog: at least `maxClients`, and the system maximum when that is larger,
    so that a burst of connects waits in the kernel's queue for the accept loop instead of
    being refused with EAGAIN (the kernel caps the value at net.core.somaxconn)."""
    try:
        with open(SOMAXCONN_PATH, encoding="ascii") as f:
            system = int(f.read().strip())
    except (OSError, ValueError):
        system = socket.SOMAXCONN
    return max(max_clients, system)
