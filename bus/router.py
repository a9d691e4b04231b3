"""The router (wire.md §1, §4–§16): registrations, calls, replies, cancels and credits.

The router only routes. All routing state lives on one event loop and every state change is
synchronous: a handler for one frame never awaits another connection, so a slow or hostile
peer can only hurt itself. Each connection has its own writer (`_pump`), which alone looks at
that connection's transport buffer: control frames (responses and notices) first, then its
results, then requests pulled lazily from the FIFOs of the services it owns. A call therefore
waits Queued (bounded, cancellable) instead of piling up in socket buffers.

Since minor 1 (wire.md §21) `bus.call`, `bus.reply` and `bus.consumed` may also arrive as
notifications: they run the same checks and state changes as the requests, answer nothing on
success and report a refusal as one `bus.callFailed` or `bus.replyFailed` (or close, when the
frame names nothing that could be answered), so a routed call costs four frames.

A call's phases and the books they keep (slots, counts, queued bytes) are `bus/call_phases.py`'s
pure edge table; this module decides when a call moves and does the writes and timers that
follow, and a move off the table is a broken invariant (§11).

Frames are built once: a `bus.request` or `bus.result` is encoded at admission (or reply) with
the longest possible delivery id, which both proves the worst-case size fits and gives the
bytes to send; at dispatch only that first id is rewritten.

The artifact store (docs/topics.md §5, §6): `bus/artifacts.py` keeps the books (holds, frame
roots, sight, quotas) and says what each step collected; `bus/store.py` does the file calls.
Attachments are checked at admission like any other member and root their artifacts under the
call (keyed with REQUEST or RESULT) or the message that carries them, so the hot path of a
frame without attachments is the minor-1 one. A seal above SEAL_INLINE_BYTES hashes on the
store's thread while only its own connection stops reading.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import secrets
import signal
import socket
import stat
import struct
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, cast

import orjson
import structlog

from bus import codec, limits
from bus.artifacts import Artifact, ArtifactLedger, StoreLimits
from bus.call_phases import Call, CallPhase, Delivery, Ledger, Service
from bus.errors import (
    ArtifactGone,
    ArtifactMismatch,
    Backpressure,
    BusError,
    CallGone,
    Conflict,
    Dispatch,
    InvalidEnvelope,
    InvalidParams,
    NoService,
    NotAuthorized,
    NoTopic,
    QuotaExceeded,
    StoreFailure,
    TargetChanged,
    VersionMismatch,
    error_object,
)
from bus.framing import PREFIX, FrameDecoder
from bus.lanes import Lane, LaneTurn
from bus.limits import (
    FRAMES_PER_TURN,
    LONGEST_DELIVERY_ID,
    MAX_ID,
    REMEMBERED_INCARNATIONS,
    Limits,
    message_frame,
)
from bus.ownership import Trust, UnsafeDirectory, check_dir, make_dirs
from bus.policy import Grants, Policy, any_matches, covered_by_delegate, substitute
from bus.schema import Validator, contract_digest, validator
from bus.sockets import probe_socket
from bus.store import (
    SEAL_INLINE_BYTES,
    SealFile,
    Store,
    StoreSettings,
    StoreStartError,
    store_offer,
)
from bus.topics import Message, Removal, Subscription, TopicLimits, TopicTable

log = structlog.get_logger("bus.router")

SUN_PATH_MAX: Final = 107
SOMAXCONN_PATH: Final = "/proc/sys/net/core/somaxconn"
MAX_DLV: Final = orjson.dumps(LONGEST_DELIVERY_ID)
CLOSE_GRACE_S: Final = 4.0
WRITE_BATCH_BYTES: Final = 65536
GRANT_CACHE: Final = 1024  # call-grant answers remembered per connection
STOP_BUDGET_S: Final = 5.0
PEERCRED: Final = struct.Struct("3i")
CANCEL_STATES: Final = (
    "cancelled-before-dispatch",
    "execution-unknown",
    "completed",
    "call-gone",
)
#: frame-root keys of a call's request and of its result (docs/topics.md §5.2 rule 2)
REQUEST: Final = 0
RESULT: Final = 1
#: an op whose response comes later (a seal hashing off the loop, §5.5 rule 4)
DEFERRED: Final = object()

def _serial(delivery_id: object) -> int | None:
    """The serial of a well-formed `dlv-<n>` (wire.md §5), else None."""
    if type(delivery_id) is not str or not delivery_id.startswith("dlv-"):
        return None
    digits = delivery_id[4:]
    if not digits.isascii() or not digits.isdigit() or digits[0] == "0" or len(digits) > 16:
        return None
    serial = int(digits)
    return serial if serial <= MAX_ID else None


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


class _Expectation:
    __slots__ = ("client_id", "creator", "grants", "incarnation", "pid", "timer")

    def __init__(self, client_id: str, pid: int, incarnation: str | None,
                 grants: dict[str, list[str]] | None, creator: _Conn,
                 timer: asyncio.TimerHandle) -> None:
        self.client_id = client_id
        self.pid = pid
        self.incarnation = incarnation
        self.grants = grants
        self.creator = creator
        self.timer = timer


class _Conn(asyncio.Protocol):
    """One connection: protocol callbacks forward to the router; state is plain fields."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.transport: asyncio.Transport | None = None
        self.number = 0
        self.connection_id = ""
        self.pid = self.uid = self.gid = -1
        self.created = time.monotonic()
        self.client_id: str | None = None
        self.client_incarnation: str | None = None
        self.identity = orjson.Fragment(b"null")  # {clientId, clientIncarnation}, encoded once
        self.grants = Grants()
        self.may_call: dict[str, bool] = {}  # target -> a call grant matches (grants are fixed)
        self.last_id = 0
        self.decoder = FrameDecoder(router.limits.maxEnvelopeBytes)
        self.hello_timer: asyncio.TimerHandle | None = None
        self.services: dict[str, Service[_Conn]] = {}
        self.service_list: list[Service[_Conn]] = []  # registration order (dispatch)
        self.rr = 0
        self.calls: dict[int, Call[_Conn]] = {}
        self.active = 0
        self.deliveries: dict[int, Delivery[_Conn]] = {}
        self.dlv = 0
        self.open_requests = 0
        self.capabilities = 0
        self.expectations: set[str] = set()
        self.control: deque[bytes] = deque()
        self.control_bytes = 0
        self.results: deque[Call[_Conn]] = deque()
        self.write_paused = False
        self.read_paused = False
        self.dirty = False
        self.closing = False
        self.torn_down = False
        self.frames_in = 0
        self.frames_out = 0
        # topics (docs/topics.md §4): the lane turn, control frames the writer took while the
        # connection had subscriptions, and its written, unconsumed message deliveries
        self.lane = LaneTurn()
        self.control_taken = 0
        self.messages: dict[int, tuple[Subscription[_Conn], Message]] = {}
        # the store (docs/topics.md §5): a seal hashing off the loop pauses this connection
        self.sealing = False

    # asyncio.Protocol -------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.router._accept(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.decoder.feed(data)
        self.router._read_frames(self)

    def eof_received(self) -> bool:
        self.router._teardown(self, "eof")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.router._teardown(self, "eof" if exc is None else "io")
        self.router._on_lost(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self.router._pump(self)


class Router:
    """The bus router. Embedded use: `await Router(config).start()`, then `await stop()`."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.limits = config.limits
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
        self._conns: dict[int, _Conn] = {}
        self._conn_counter = 0
        self._live: dict[str, _Conn] = {}
        # clientId -> its remembered incarnations, least recently seen clientId first
        self._incarnations: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self._services: dict[str, Service[_Conn]] = {}
        self._svc_next = secrets.randbelow(2**40) + 1
        self._expectations: dict[str, _Expectation] = {}
        self._ledger: Ledger[_Conn] = Ledger()
        self._dirty: list[_Conn] = []
        self._flush_scheduled = False
        # the body member of the frame in hand, as the sender wrote it (wire.md §22.1)
        self._body: bytes | None = None
        self._body_key = "payload"
        self._body_problem: str | None = None
        self._allowed_uids = (
            config.allowed_uids if config.allowed_uids is not None else (os.geteuid(),)
        )
        self._group_gid = grp.getgrnam(config.socket_group).gr_gid if config.socket_group else None
        self.counters: dict[str, Any] = {
            "accepted": 0, "refusedAtAccept": 0, "helloOk": 0, "helloRefused": 0, "closed": 0,
            "callsAdmitted": 0, "callsRefused": 0, "callsFailed": 0, "repliesRouted": 0,
            "repliesUnrouted": 0, "cancels": dict.fromkeys(CANCEL_STATES, 0), "errors": {},
            "closes": {}, "framesIn": 0, "framesOut": 0, "bytesIn": 0, "bytesOut": 0,
            "leanCalls": 0, "leanReplies": 0, "leanConsumed": 0, "creditsCarried": 0,
            "published": 0, "publishRefused": 0, "leanPublishes": 0, "messagesDelivered": 0,
            "sealsRefused": 0, "bodiesForwardedRaw": 0, "inlineReplies": 0,
        }
        lim = self.limits
        self._topics: TopicTable[_Conn] = TopicTable(
            TopicLimits(lim.maxTopics, lim.maxSubscribersPerTopic, lim.maxSubscriptionsPerClient,
                        lim.maxBoundedDepth, lim.maxSubscriptionWindow, lim.maxQueuedTopicBytes),
            secrets.randbelow(2**40) + 1, _conn_label)
        self._euid = os.geteuid()
        self._store: Store | None = None
        self._store_wire: dict[str, str] | None = None
        self._art: ArtifactLedger[_Conn] = ArtifactLedger(
            StoreLimits(lim.maxArtifactBytes, lim.maxArtifacts, lim.maxStoreBytes,
                        lim.maxHeldBytesPerClient, lim.maxHoldsPerClient,
                        lim.maxAllocationsPerClient),
            secrets.randbelow(2**40) + 1)
        v = validator
        self._ops: dict[str, tuple[Validator, Callable[[_Conn, dict[str, Any], int], Any]]] = {
            "bus.register": (v("ops/bus.register.params.json"), self._op_register),
            "bus.unregister": (v("ops/bus.unregister.params.json"), self._op_unregister),
            "bus.call": (v("ops/bus.call.params.json"), self._op_call),
            "bus.reply": (v("ops/bus.reply.params.json"), self._op_reply),
            "bus.release": (v("ops/bus.release.params.json"), self._op_release),
            "bus.cancel": (v("ops/bus.cancel.params.json"), self._op_cancel),
            "bus.consumed": (v("ops/bus.consumed.params.json"), self._op_consumed),
            "bus.services": (v("ops/bus.services.params.json"), self._op_services),
            "bus.stats": (v("ops/bus.stats.params.json"), self._op_stats),
            "bus.expect": (v("ops/bus.expect.params.json"), self._op_expect),
            "bus.declare": (v("ops/bus.declare.params.json"), self._op_declare),
            "bus.undeclare": (v("ops/bus.undeclare.params.json"), self._op_undeclare),
            "bus.publish": (v("ops/bus.publish.params.json"), self._op_publish),
            "bus.subscribe": (v("ops/bus.subscribe.params.json"), self._op_subscribe),
            "bus.unsubscribe": (v("ops/bus.unsubscribe.params.json"), self._op_unsubscribe),
            "bus.topics": (v("ops/bus.topics.params.json"), self._op_topics),
            "bus.allocate": (v("ops/bus.allocate.params.json"), self._op_allocate),
            "bus.seal": (v("ops/bus.seal.params.json"), self._op_seal),
            "bus.retain": (v("ops/bus.retain.params.json"), self._op_retain),
            "bus.drop": (v("ops/bus.drop.params.json"), self._op_drop),
        }
        self._hello_params = v("ops/bus.hello.params.json")
        self._call_params = self._ops["bus.call"][0]
        self._reply_params = self._ops["bus.reply"][0]
        self._consumed_params = self._ops["bus.consumed"][0]
        self._publish_params = self._ops["bus.publish"][0]
        # the lean notification forms (wire.md §21): the same params schemas as the requests
        self._lean: dict[str, Callable[[_Conn, dict[str, Any]], None]] = {
            "bus.call": self._lean_call,
            "bus.reply": self._lean_reply,
            "bus.consumed": self._lean_consumed,
            "bus.publish": self._lean_publish,
        }

    # lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the socket (0600/0660 under a restrictive umask) and start accepting."""
        self._loop = asyncio.get_running_loop()
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
            self._remove_store()
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
        self._server = await self._loop.create_unix_server(
            lambda: _Conn(self), sock=sock, backlog=backlog
        )
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
            self._remove_store()
            detail = ("another router bound it while this one started"
                      if isinstance(exc, FileExistsError) else str(exc))
            raise RouterStartError(f"cannot bind {path}: {detail}") from exc
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)

    def _open_store(self) -> None:
        """docs/topics.md §5.1: the store directory of this start, or none when disabled."""
        settings = self.config.store
        if not settings.enabled:
            return
        try:
            store = Store.open(settings.root)
        except StoreStartError as exc:
            raise RouterStartError(f"[bus.store] root: {exc}") from exc
        # a lease break would signal SIGIO, whose default action ends the process
        with contextlib.suppress(ValueError):  # not the main thread: its owner decides
            signal.signal(signal.SIGIO, signal.SIG_IGN)
        self._store = store
        self._store_wire = {"storeId": store.store_id, "path": store.path}
        log.info("router.store", store_id=store.store_id, path=store.path)

    def _remove_store(self) -> None:
        """§5.1 rule 7: every artifact file and the store directory go."""
        store, self._store = self._store, None
        if store is None:
            return
        self._art.clear()
        store.remove()

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
        """Orderly stop (wire.md §11): ROUTER_LOST to everyone, unlink the socket."""
        if self._server is None:
            return
        server, self._server = self._server, None
        server.close()
        for conn in list(self._conns.values()):
            if conn.closing:
                if conn.transport is not None:
                    conn.transport.close()  # end a lingering close (_finish_close) now
            else:
                self._close(conn, "ROUTER_LOST", "router stopping")
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
        self._remove_store()
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
        """wire.md §11: log, close every connection with ROUTER_LOST, stop serving."""
        log.error("router.invariant_broken", error=repr(exc))
        self.fatal = exc
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns.values()):
            self._close(conn, "ROUTER_LOST", "router invariant broken")
        self.request_stop()

    # accept / read ----------------------------------------------------------------------
    def _accept(self, conn: _Conn) -> None:
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
        if sum(1 for c in self._conns.values() if not c.closing) >= self.limits.maxClients:
            self.counters["refusedAtAccept"] += 1
            self._conns[conn.number] = conn
            self._close(conn, "QUOTA_EXCEEDED", f"maxClients ({self.limits.maxClients}) reached")
            return
        allowed = conn.uid in self._allowed_uids or (
            self._group_gid is not None and conn.gid == self._group_gid
        )
        self._conns[conn.number] = conn
        if not allowed:
            self.counters["refusedAtAccept"] += 1
            self._close(conn, "NOT_AUTHORIZED", f"peer uid {conn.uid} is not allowed")
            return
        self.counters["accepted"] += 1
        assert self._loop is not None
        conn.hello_timer = self._loop.call_later(
            self.limits.helloTimeoutMs / 1000.0, self._hello_expired, conn
        )
        log.info("bus.accept", connection_id=conn.connection_id, pid=conn.pid, uid=conn.uid)

    def _hello_expired(self, conn: _Conn) -> None:
        conn.hello_timer = None
        if conn.client_id is None and not conn.closing:
            self._close(conn, "INVALID_ENVELOPE", "bus.hello deadline expired")

    def _read_frames(self, conn: _Conn) -> None:
        """Handle at most FRAMES_PER_TURN frames. What they cause is written by the flush
        that `_mark` scheduled, after every read of this wake-up: replies from several
        services to one caller (a lockstep phase's fan-in) leave in one write."""
        decoder = conn.decoder
        for _ in range(FRAMES_PER_TURN):
            if conn.closing:
                return
            if conn.sealing:  # §5.5 rule 4: nothing more from it until its hash is applied
                if not conn.read_paused and conn.transport is not None:
                    conn.read_paused = True
                    conn.transport.pause_reading()
                return
            try:
                body = decoder.next_frame()
            except InvalidEnvelope as exc:
                self._close(conn, "INVALID_ENVELOPE", exc.message)
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
        self._loop.call_soon(self._read_frames, conn)

    def _on_frame(self, conn: _Conn, body: bytes) -> None:
        conn.frames_in += 1
        counters = self.counters
        counters["framesIn"] += 1
        counters["bytesIn"] += len(body) + 4
        try:
            if b'"payload"' in body or b'"outcome"' in body:
                # §22.1: the body is carried as its wire bytes, the rest checked as always
                read = codec.decode_body_frame(body)
                msg = read.msg
                self._body, self._body_key, self._body_problem = read.body, read.key, read.problem
            else:
                msg = codec.decode(body)
                self._body = self._body_problem = None
        except BusError as exc:
            self._close(conn, "PARSE_ERROR", exc.message)
            return
        if type(msg) is not dict or msg.get("jsonrpc") != "2.0":
            self._close(conn, "INVALID_REQUEST", "not a JSON-RPC 2.0 request object")
            return
        method = msg.get("method")
        if type(method) is not str:
            self._close(conn, "INVALID_REQUEST", "method must be a string")
            return
        has_id = "id" in msg
        n = len(msg) - has_id
        if n == 3 and "params" in msg:
            params = msg["params"]
            if type(params) is not dict:
                self._close(conn, "INVALID_REQUEST", "params must be an object")
                return
        elif n == 2:
            params = {}
        else:
            self._close(conn, "INVALID_REQUEST",
                        "a request has exactly jsonrpc, id, method and optional params")
            return
        if not has_id:
            lean = self._lean.get(method)
            if lean is None:
                self._close(conn, "INVALID_REQUEST", "only bus.call, bus.reply, bus.consumed "
                            "and bus.publish may be sent as notifications")
                return
            lean(conn, params)
            return
        rid = self._next_id(conn, msg["id"], "id", "id must be an integer in 1..2^53-1")
        if rid is None:
            return
        if conn.client_id is None:
            if method != "bus.hello":
                self._close(conn, "INVALID_ENVELOPE", "the first request must be bus.hello")
                return
            self._hello(conn, rid, params)
            return
        if method == "bus.hello":
            self._close(conn, "INVALID_ENVELOPE", "bus.hello was already completed")
            return
        op = self._ops.get(method)
        if op is None:
            self._respond_error(conn, rid, "METHOD_NOT_FOUND",
                                f"{method[:128]!r} is not a bus v1 operation", "not-dispatched")
            return
        problem = op[0](params) or self._body_refused(strict=method == "bus.publish")
        if problem is not None:
            self._respond_error(conn, rid, "INVALID_PARAMS", f"{method}: {problem}",
                                "not-dispatched")
            return
        try:
            result = op[1](conn, params, rid)
        except BusError as exc:
            if method == "bus.call":
                counters["callsRefused"] += 1
            self._respond_error(conn, rid, exc.name, exc.message, exc.dispatch)
            return
        if result is not DEFERRED:
            self._respond(conn, rid, result)

    def _next_id(self, conn: _Conn, value: object, name: str, malformed: str) -> int | None:
        """Check 4 (wire.md §4): a request's id, or a lean call's callId in its place, is an
        integer in 1..2^53-1 above every id before it on this connection. Returns it, now the
        connection's latest; or closes the connection (with `malformed` when it is no such
        integer) and returns None."""
        if type(value) is not int or not 1 <= value <= MAX_ID:
            self._close(conn, "INVALID_REQUEST", malformed)
            return None
        if value <= conn.last_id:
            self._close(conn, "INVALID_REQUEST",
                        f"{name} {value} is not greater than the previous id {conn.last_id}")
            return None
        conn.last_id = value
        return value

    def _before_hello(self, conn: _Conn) -> bool:
        """Check 5 (wire.md §4) for a lean notification, which is never `bus.hello`: before
        the hello it closes the connection and returns True."""
        if conn.client_id is not None:
            return False
        self._close(conn, "INVALID_ENVELOPE", "the first request must be bus.hello")
        return True

    # lean notifications (wire.md §21) ------------------------------------------------------
    def _lean_call(self, conn: _Conn, p: dict[str, Any]) -> None:
        """§21.2: the callId takes the place of the id (check 4); a refusal is one
        `bus.callFailed`, success sends nothing."""
        call_id = self._next_id(conn, p.get("callId"), "callId",
                                "a bus.call notification needs a callId, an integer in 1..2^53-1")
        if call_id is None:
            return
        if self._before_hello(conn):
            return
        counters = self.counters
        counters["leanCalls"] += 1
        problem = self._call_params(p) or self._body_refused()
        try:
            if problem is not None:
                raise InvalidParams(f"bus.call: {problem}")
            self._admit(conn, p, call_id)
        except BusError as exc:
            if problem is None:  # as in the request form, bad params are not a refused call
                counters["callsRefused"] += 1
            self._count_error(exc.name)
            target = p.get("target")
            svc = self._services.get(target) if type(target) is str else None
            self._notify_control(conn, "bus.callFailed", {
                "callId": call_id,
                "serviceIncarnation": None if svc is None else svc.incarnation,
                "error": error_object(exc.name, exc.message, "not-dispatched"),
            })

    def _lean_reply(self, conn: _Conn, p: dict[str, Any]) -> None:
        """§21.4: a deliveryId that cannot be answered closes; a refusal of one that can is
        one `bus.replyFailed`; success sends nothing."""
        if self._before_hello(conn):
            return
        delivery_id = p.get("deliveryId")
        serial = _serial(delivery_id)
        if serial is None or serial > conn.dlv:
            self._close(conn, "INVALID_REQUEST", "a bus.reply notification needs a deliveryId "
                        "issued on this connection")
            return
        self.counters["leanReplies"] += 1
        problem = self._reply_params(p) or self._body_refused()
        try:
            if problem is not None:
                raise InvalidParams(f"bus.reply: {problem}")
            self._op_reply(conn, p, 0)
        except BusError as exc:
            self._count_error(exc.name)
            self._notify_control(conn, "bus.replyFailed", {
                "deliveryId": delivery_id,
                "error": error_object(exc.name, exc.message, "not-dispatched"),
            })

    def _lean_consumed(self, conn: _Conn, p: dict[str, Any]) -> None:
        """§21.5: nothing to answer, so anything wrong closes and releases nothing."""
        if self._before_hello(conn):
            return
        problem = self._consumed_params(p)
        if problem is not None:
            self._close(conn, "INVALID_REQUEST", f"bus.consumed notification: {problem}")
            return
        try:
            self._release(conn, p["deliveryIds"])
        except InvalidParams as exc:
            self._close(conn, "INVALID_REQUEST", exc.message)
            return
        self.counters["leanConsumed"] += 1

    # bodies (wire.md §22.1) -----------------------------------------------------------------
    def _body_refused(self, *, strict: bool = False) -> str | None:
        """Check 7's last part for a frame whose body member is not one well-formed JSON
        value: INVALID_PARAMS naming it (the envelope around it was sound). A published
        payload (`strict`) reaches subscribers that never answer, so the router holds it to
        §3 itself, as before minor 3."""
        if self._body_problem is not None:
            return f"{self._body_key} is {self._body_problem}"
        if strict and self._body is not None:
            try:
                codec.decode(self._body)
            except BusError as exc:
                return f"{self._body_key}: {exc.message}"
        return None

    def _body_bytes(self, p: dict[str, Any], key: str) -> tuple[bytes, bool]:
        """The wire bytes to forward for the body member `key` of the frame in hand, and
        whether they are the sender's own (else re-encoded from a frame read whole)."""
        body = self._body
        if body is not None and self._body_key == key:
            return body, True
        return codec.encode_trusted(p[key]), False

    # outbound ---------------------------------------------------------------------------
    def _respond(self, conn: _Conn, rid: int, result: Any) -> None:
        self._control(conn, orjson.dumps({"jsonrpc": "2.0", "id": rid, "result": result}))

    def _count_error(self, name: str) -> None:
        errors = self.counters["errors"]
        errors[name] = errors.get(name, 0) + 1

    def _respond_error(self, conn: _Conn, rid: int, name: str, message: str,
                       dispatch: Dispatch) -> None:
        self._count_error(name)
        self._control(conn, orjson.dumps(
            {"jsonrpc": "2.0", "id": rid, "error": error_object(name, message, dispatch)}
        ))

    def _notify_control(self, conn: _Conn, method: str, params: dict[str, Any]) -> None:
        self._control(conn, orjson.dumps({"jsonrpc": "2.0", "method": method, "params": params}))

    def _control(self, conn: _Conn, body: bytes) -> None:
        """Enqueue on the control lane; overflow while the writer is blocked closes the client."""
        if conn.closing:
            return
        if conn.write_paused and (
            len(conn.control) + 1 > self.limits.maxControlFrames
            or conn.control_bytes + len(body) > self.limits.maxControlBytes
        ):
            self._close(conn, "QUOTA_EXCEEDED", "control lane exhausted")
            return
        conn.control.append(body)
        conn.control_bytes += len(body)
        self._mark(conn)

    def _mark(self, conn: _Conn) -> None:
        if not conn.dirty and not conn.closing:
            conn.dirty = True
            self._dirty.append(conn)
            if not self._flush_scheduled:
                self._flush_scheduled = True
                assert self._loop is not None
                self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        dirty, self._dirty = self._dirty, []
        for conn in dirty:
            conn.dirty = False
            try:
                self._pump(conn)
            except Exception as exc:
                self._invariant_broken(exc)
                return

    def _pump(self, conn: _Conn) -> None:
        """The connection's writer: control lane, then results, then dispatch, in batches,
        until the transport signals its high-water mark (pause_writing) or, with budget left
        over, nothing more is ready."""
        transport = conn.transport
        if conn.closing or transport is None:
            return
        if conn in self._topics.readers:
            self._pump_lanes(conn, transport)
            return
        control = conn.control
        counters = self.counters
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
                    body = self._take_result(conn)
                    out.append(PREFIX.pack(len(body)))
                    out.append(body)
                    budget -= len(body) + 4
                if budget > 0 and not conn.results and conn.services:
                    budget = self._dispatch(conn, out, budget)
            if not out:
                return
            data = b"".join(out)
            frames = len(out) // 2
            conn.frames_out += frames
            counters["framesOut"] += frames
            counters["bytesOut"] += len(data)
            transport.write(data)
            if budget > 0:  # every lane ran dry before the batch filled
                return

    def _take_result(self, conn: _Conn) -> bytes:
        call = conn.results.popleft()
        conn.dlv += 1
        serial = conn.dlv
        conn.deliveries[serial] = Delivery(serial, call, False)
        if self._art.frames:
            self._art.see(conn, self._art.rooted((call, RESULT)))
        return call.frame.replace(MAX_DLV, b'"dlv-%d"' % serial, 1)

    def _dispatch(self, conn: _Conn, out: list[bytes], budget: int) -> int:
        """Pull requests round robin across this connection's services (wire.md §9.2, §14.2);
        returns the budget left."""
        limit = self.limits.maxOpenRequestsPerClient
        services = conn.service_list
        count = len(services)
        idle = 0
        i = conn.rr
        while budget > 0 and idle < count and conn.open_requests < limit:
            svc = services[i % count]
            i += 1
            if not svc.queue or svc.in_flight >= svc.max_in_flight:
                idle += 1
                continue
            idle = 0
            call = svc.queue.popleft()
            self._ledger.move(call, CallPhase.DISPATCHED)
            conn.dlv += 1
            serial = conn.dlv
            delivery = Delivery(serial, call, True)
            conn.deliveries[serial] = delivery
            call.delivery = delivery
            if self._art.frames:
                self._art.see(conn, self._art.rooted((call, REQUEST)))
            svc.in_flight += 1
            conn.open_requests += 1
            conn.capabilities += 1
            body = call.frame.replace(MAX_DLV, b'"dlv-%d"' % serial, 1)
            call.frame = b""
            out.append(PREFIX.pack(len(body)))
            out.append(body)
            budget -= len(body) + 4
        conn.rr = i % count if count else 0
        return budget

    def _close(self, conn: _Conn, name: str, message: str) -> None:
        """The router ends a connection: `bus.closing` is the last frame (wire.md §4)."""
        if conn.closing:
            return
        self._count_error(name)
        transport = conn.transport
        frame = orjson.dumps({"jsonrpc": "2.0", "method": "bus.closing",
                              "params": {"error": error_object(name, message, "unknown")}})
        self._teardown(conn, name)
        if transport is not None:
            transport.write(PREFIX.pack(len(frame)) + frame)
            conn.frames_out += 1
            self.counters["framesOut"] += 1
            self.counters["bytesOut"] += len(frame) + 4
            self._finish_close(conn)

    def _finish_close(self, conn: _Conn) -> None:
        transport = conn.transport
        assert transport is not None and self._loop is not None
        if self._server is not None and transport.can_write_eof():
            # Lingering close: shut our side down once the last frame is flushed, but keep
            # reading (data_received discards it) until the peer's EOF or the grace abort, so
            # a peer still sending sees its frames, then EOF, instead of a reset (§20 #73).
            transport.write_eof()
            if conn.read_paused:
                conn.read_paused = False
                transport.resume_reading()
        else:
            if conn.read_paused:
                conn.read_paused = False
            transport.close()
        self._loop.call_later(CLOSE_GRACE_S, transport.abort)

    # teardown ---------------------------------------------------------------------------
    def _on_lost(self, conn: _Conn) -> None:
        self._conns.pop(conn.number, None)
        if not self._conns and self._all_lost is not None:
            self._all_lost.set()

    def _teardown(self, conn: _Conn, reason: str) -> None:
        """wire.md §10.2, in order. Idempotent; the first reason is the one counted."""
        if conn.torn_down:
            return
        conn.torn_down = True
        conn.closing = True
        conn.control.clear()
        conn.control_bytes = 0
        conn.results.clear()
        counters = self.counters
        counters["closed"] += 1
        closes = counters["closes"]
        closes[reason] = closes.get(reason, 0) + 1
        if conn.hello_timer is not None:
            conn.hello_timer.cancel()
            conn.hello_timer = None
        log.info("bus.close", connection_id=conn.connection_id, client_id=conn.client_id,
                 reason=reason)
        # 1. no longer live (its incarnations stay remembered, as its most recent sighting)
        if conn.client_id is not None and self._live.get(conn.client_id) is conn:
            del self._live[conn.client_id]
            if conn.client_id in self._incarnations:
                self._incarnations.move_to_end(conn.client_id)
        # 2. its services are removed
        for svc in list(conn.services.values()):
            self._remove_route(svc, "disconnected")
        # 3 + 4. deliveries dropped (their roots end); dispatched, unreplied calls fail
        for delivery in conn.deliveries.values():
            if delivery.is_request and not delivery.consumed:
                self._unroot((delivery.call, REQUEST))
            if delivery.is_request and delivery.capability:
                call = delivery.call
                if call.phase is CallPhase.DISPATCHED:
                    self._call_failed(call, "NO_SERVICE",
                                      "the service disconnected before replying", "dispatched")
                self._ledger.move(call, CallPhase.GONE)
        conn.deliveries.clear()
        conn.open_requests = conn.capabilities = 0
        # 5. calls it made
        ledger = self._ledger
        for call in list(conn.calls.values()):
            phase = call.phase
            if phase is CallPhase.QUEUED:
                call.service.queue.remove(call)
                ledger.move(call, CallPhase.GONE)
                self._unroot((call, REQUEST))
            elif phase is CallPhase.DISPATCHED:
                ledger.move(call, CallPhase.DETACHED)
            elif phase is CallPhase.REPLIED:
                ledger.move(call, CallPhase.GONE)
                self._unroot((call, RESULT))
        # 6. expectations it created
        for client_id in list(conn.expectations):
            exp = self._expectations.get(client_id)
            if exp is not None and exp.creator is conn:
                self._drop_expectation(exp)
        conn.expectations.clear()
        # 7 + 8. its subscriptions and written messages; the topics it owns (docs/topics.md §11)
        deliveries = list(conn.messages.values())
        conn.messages.clear()
        if deliveries or conn in self._topics.readers or conn in self._topics.owned:
            wake, released = self._topics.forget_connection(conn, deliveries)
            for other in wake:
                self._mark(other)
            self._messages_released(released)
        # 9 + 10. its holds end, its Allocated artifacts go; every collected file is unlinked
        if conn in self._art.holds or conn in self._art.sight:
            self._collect(self._art.forget_connection(conn))

    def _remove_route(self, svc: Service[_Conn], reason: str) -> None:
        """wire.md §10.1: free the name, tell attached callers, fail the Queued calls."""
        if not svc.live:
            return
        svc.live = False
        del self._services[svc.name]
        del svc.owner.services[svc.name]
        svc.owner.service_list.remove(svc)
        affected: dict[int, _Conn] = {}
        for call in svc.queue:
            affected[call.caller.number] = call.caller
        for delivery in svc.owner.deliveries.values():
            call = delivery.call
            if (delivery.is_request and delivery.capability
                    and call.phase is CallPhase.DISPATCHED and call.service is svc):
                affected[call.caller.number] = call.caller
        notice = {"name": svc.name, "serviceIncarnation": svc.incarnation, "reason": reason}
        for caller in affected.values():
            self._notify_control(caller, "bus.routeRemoved", notice)
        queue, svc.queue = svc.queue, deque()
        for call in queue:
            self._call_failed(call, "NO_SERVICE", f"service {svc.name} was {reason} "
                              "before the call was dispatched", "not-dispatched")
            self._ledger.move(call, CallPhase.GONE)
            self._unroot((call, REQUEST))

    def _call_failed(self, call: Call[_Conn], name: str, message: str, dispatch: Dispatch) -> None:
        self.counters["callsFailed"] += 1
        self._count_error(name)
        self._notify_control(call.caller, "bus.callFailed", {
            "callId": call.call_id,
            "serviceIncarnation": call.service.incarnation,
            "error": error_object(name, message, dispatch),
        })

    def _free_request(self, conn: _Conn, delivery: Delivery[_Conn]) -> None:
        """Consumed and answered: the in-flight slot returns and dispatch may continue."""
        del conn.deliveries[delivery.serial]
        conn.open_requests -= 1
        delivery.call.service.in_flight -= 1
        self._mark(conn)

    # hello ------------------------------------------------------------------------------
    def _hello(self, conn: _Conn, rid: int, params: dict[str, Any]) -> None:
        try:
            result = self._hello_checks(conn, params)
        except BusError as exc:
            self.counters["helloRefused"] += 1
            self._count_error(exc.name)
            body = orjson.dumps({"jsonrpc": "2.0", "id": rid,
                                 "error": error_object(exc.name, exc.message, "not-dispatched")})
            log.info("bus.hello_refused", connection_id=conn.connection_id, error=exc.name,
                     client_id=params.get("clientId") if isinstance(
                         params.get("clientId"), str) else None, pid=conn.pid, uid=conn.uid)
            transport = conn.transport
            self._teardown(conn, exc.name)
            if transport is not None:
                transport.write(PREFIX.pack(len(body)) + body)
                self._finish_close(conn)
            return
        self.counters["helloOk"] += 1
        self._respond(conn, rid, result)

    def _hello_checks(self, conn: _Conn, params: dict[str, Any]) -> dict[str, Any]:
        problem = self._hello_params(params)
        if problem is not None:
            raise InvalidParams(f"bus.hello: {problem}")
        if 1 not in params["supportedMajors"]:
            raise VersionMismatch("the router speaks bus major 1 only")
        client_id: str = params["clientId"]
        incarnation: str = params["clientIncarnation"]
        entry = self.policy.entry_for(client_id)
        if entry is None:
            raise NotAuthorized(f"no policy entry admits client {client_id}")
        exp = self._expectations.get(client_id)
        if exp is not None:
            if exp.pid != conn.pid:
                raise NotAuthorized(f"client {client_id} is expected from another process")
            if exp.incarnation is not None and exp.incarnation != incarnation:
                raise NotAuthorized(f"client {client_id} is expected with another incarnation")
        elif entry.require_expect:
            raise NotAuthorized(f"client {client_id} needs a pending expectation")
        if entry.pid is not None and entry.pid != conn.pid:
            raise NotAuthorized(f"client {client_id} is bound to another process")
        if client_id in self._live:
            raise Conflict(f"client {client_id} already has a live connection")
        seen = self._incarnations.get(client_id)
        if seen is not None and incarnation in seen:
            raise Conflict(f"incarnation {incarnation} of {client_id} was already used")
        # success: no mutation happened before this point
        grants = entry.grants_for(client_id)
        if exp is not None:
            if exp.grants is not None:
                # a missing list grants nothing; {clientId} is this client's id (§6.2)
                grants = Grants(
                    register=tuple(substitute(g, client_id)
                                   for g in exp.grants.get("register", ())),
                    call=tuple(substitute(g, client_id) for g in exp.grants.get("call", ())),
                    publish=tuple(substitute(g, client_id) for g in exp.grants.get("publish", ())),
                    subscribe=tuple(substitute(g, client_id)
                                    for g in exp.grants.get("subscribe", ())))
            else:
                grants = Grants(register=grants.register, call=grants.call,
                                publish=grants.publish, subscribe=grants.subscribe,
                                manage=grants.manage)
            self._drop_expectation(exp)
        if seen is None:
            seen = self._incarnations[client_id] = OrderedDict()
            self._forget_clients()
        else:
            self._incarnations.move_to_end(client_id)
        seen[incarnation] = None
        if len(seen) > REMEMBERED_INCARNATIONS:
            seen.popitem(last=False)
        conn.client_id = client_id
        conn.client_incarnation = incarnation
        conn.identity = orjson.Fragment(orjson.dumps(
            {"clientId": client_id, "clientIncarnation": incarnation}))
        conn.grants = grants
        self._live[client_id] = conn
        if conn.hello_timer is not None:
            conn.hello_timer.cancel()
            conn.hello_timer = None
        log.info("bus.hello", connection_id=conn.connection_id, client_id=client_id,
                 client_incarnation=incarnation, pid=conn.pid, uid=conn.uid)
        return {
            "routerId": self.router_id,
            "connectionId": conn.connection_id,
            "major": 1,
            "minor": 3,
            "contractDigest": self._digest,
            "grants": grants.to_wire(),
            "limits": self.limits.hello(),
            "store": store_offer(conn.uid, self._euid, self._store_wire),
        }

    # ops --------------------------------------------------------------------------------
    def _op_register(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        name: str = p["name"]
        if not any_matches(conn.grants.register, name):
            raise NotAuthorized(f"no register grant for {name}")
        lim = self.limits
        if p["maxQueued"] > lim.maxServiceQueued or p["maxInFlight"] > lim.maxServiceInFlight:
            raise QuotaExceeded(
                f"maxQueued/maxInFlight above the router's {lim.maxServiceQueued}/"
                f"{lim.maxServiceInFlight}"
            )
        if name in self._services:
            raise Conflict(f"{name} is already registered")
        if len(self._services) >= lim.maxServices:
            raise QuotaExceeded(f"maxServices ({lim.maxServices}) reached")
        incarnation = f"svc-{self._svc_next}"
        self._svc_next += 1
        svc = Service(name, incarnation, conn, p["maxQueued"], p["maxInFlight"])
        self._services[name] = svc
        conn.services[name] = svc
        conn.service_list.append(svc)
        log.info("bus.register", connection_id=conn.connection_id, service=name,
                 service_incarnation=incarnation)
        return {"name": name, "serviceIncarnation": incarnation}

    def _op_unregister(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        svc = self._services.get(p["name"])
        if svc is None or svc.owner is not conn or svc.incarnation != p["serviceIncarnation"]:
            return {"removed": False}
        self._remove_route(svc, "unregistered")
        return {"removed": True}

    def _op_call(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        if "callId" in p:
            raise InvalidParams("bus.call: callId belongs to the notification form (wire.md §21.2)")
        return self._admit(conn, p, rid)

    def _admit(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        """§7.3 checks and admission, after the credits the call carries (§21.3)."""
        consumed = p.get("consumed")
        if consumed:
            self.counters["creditsCarried"] += self._release(conn, consumed)
        target: str = p["target"]
        allowed = conn.may_call.get(target)
        if allowed is None:
            if len(conn.may_call) >= GRANT_CACHE:
                conn.may_call.clear()
            allowed = conn.may_call[target] = any_matches(conn.grants.call, target)
        if not allowed:
            raise NotAuthorized(f"no call grant for {target}")
        lim = self.limits
        if conn.active >= lim.maxActiveCallsPerClient:
            raise Backpressure(f"{conn.active} active calls (maxActiveCallsPerClient)")
        svc = self._services.get(target)
        if svc is None:
            raise NoService(f"no service registered under {target}")
        expected = p["expectedIncarnation"]
        if expected is not None and expected != svc.incarnation:
            raise TargetChanged(f"{target} is now {svc.incarnation}, not {expected}")
        ids = p.get("attachments")
        arts = self._attachable(conn, ids) if ids else ()
        if len(svc.queue) >= svc.max_queued:
            raise Backpressure(f"service {target} queue full ({svc.max_queued})")
        payload, raw = self._body_bytes(p, "payload")
        size = len(payload)
        if self._ledger.queued_bytes + size > lim.maxQueuedCallBytes:
            raise Backpressure("router queued-call bytes budget exhausted")
        params = {
            "deliveryId": LONGEST_DELIVERY_ID,
            "callId": rid,
            "caller": conn.identity,
            "target": target,
            "serviceIncarnation": svc.incarnation,
            "method": p["method"],
        }
        if arts:
            params["attachments"] = [a.wire() for a in arts]
        params["payload"] = orjson.Fragment(payload)  # last: the receiver's split (§22.1)
        frame = orjson.dumps({"jsonrpc": "2.0", "method": "bus.request", "params": params})
        if len(frame) > lim.maxEnvelopeBytes:
            raise InvalidEnvelope(
                f"the bus.request frame would be {len(frame)} bytes (maxEnvelopeBytes "
                f"{lim.maxEnvelopeBytes})"
            )
        call = Call(conn, rid, svc, frame, size)
        self._ledger.admit(call)
        if arts:
            self._art.root((call, REQUEST), arts)
            if p.get("transfer"):
                self._collect(self._art.transfer(conn, arts))
        self.counters["callsAdmitted"] += 1
        if raw:
            self.counters["bodiesForwardedRaw"] += 1
        self._mark(svc.owner)
        return {"callId": rid, "serviceIncarnation": svc.incarnation}

    def _request_delivery(self, conn: _Conn, delivery_id: str) -> Delivery[_Conn] | None:
        serial = int(delivery_id[4:])
        if serial > conn.dlv:
            raise InvalidParams(f"{delivery_id} was never issued on this connection")
        d = conn.deliveries.get(serial)
        if d is None or not d.is_request or not d.capability:
            return None
        return d

    def _op_reply(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        d = self._request_delivery(conn, p["deliveryId"])
        if d is None:
            raise CallGone(f"{p['deliveryId']} holds no reply capability")
        call = d.call
        ids = p.get("attachments")
        arts = self._attachable(conn, ids) if ids else ()
        outcome, raw = self._body_bytes(p, "outcome")
        frame = limits.result_frame(call.call_id, call.service.incarnation, conn.identity,
                                    orjson.Fragment(outcome),
                                    [a.wire() for a in arts] if arts else None)
        if len(frame) > self.limits.maxEnvelopeBytes:
            raise InvalidEnvelope(
                f"the bus.result frame would be {len(frame)} bytes (maxEnvelopeBytes "
                f"{self.limits.maxEnvelopeBytes}); the reply capability is kept"
            )
        d.capability = False
        conn.capabilities -= 1
        if p.get("consumed") is True and not d.consumed:
            d.consumed = True
            self.counters["creditsCarried"] += 1
            self._request_consumed(conn, call)
        if d.consumed:
            self._free_request(conn, d)
        if call.phase is CallPhase.DETACHED:
            self.counters["repliesUnrouted"] += 1
            self._ledger.move(call, CallPhase.GONE)
            if arts and p.get("transfer"):  # the reply roots nothing (§6.3)
                self._collect(self._art.transfer(conn, arts))
            return {"routed": False}
        if arts:
            self._art.root((call, RESULT), arts)
            if p.get("transfer"):
                self._collect(self._art.transfer(conn, arts))
        self._ledger.move(call, CallPhase.REPLIED)
        call.frame = frame
        call.caller.results.append(call)
        self._mark(call.caller)
        counters = self.counters
        counters["repliesRouted"] += 1
        if raw:
            counters["bodiesForwardedRaw"] += 1
        if p.get("inline") is True:
            counters["inlineReplies"] += 1
        return {"routed": True}

    def _op_release(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        d = self._request_delivery(conn, p["deliveryId"])
        if d is None:
            return {"released": False}
        d.capability = False
        conn.capabilities -= 1
        call = d.call
        if d.consumed:
            self._free_request(conn, d)
        if call.phase is CallPhase.DISPATCHED:
            svc = call.service
            if svc.live:
                self._call_failed(call, "CALL_GONE", "released without reply", "dispatched")
            else:
                self._call_failed(call, "NO_SERVICE",
                                  f"released without reply after {svc.name} was removed",
                                  "dispatched")
        self._ledger.move(call, CallPhase.GONE)
        return {"released": True}

    def _op_cancel(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        call_id: int = p["callId"]
        if call_id >= rid:
            raise InvalidParams(f"callId {call_id} is not an earlier request of this connection")
        call = conn.calls.get(call_id)
        if call is None or call.phase is CallPhase.DETACHED:
            state = "call-gone"
        elif call.phase is CallPhase.QUEUED:
            call.service.queue.remove(call)
            self._ledger.move(call, CallPhase.GONE)
            self._unroot((call, REQUEST))
            state = "cancelled-before-dispatch"
        elif call.phase is CallPhase.DISPATCHED:
            self._ledger.move(call, CallPhase.DETACHED)
            state = "execution-unknown"
        else:
            state = "completed"
        self.counters["cancels"][state] += 1
        return {"state": state}

    def _op_consumed(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        return {"released": self._release(conn, p["deliveryIds"])}

    def _release(self, conn: _Conn, ids: list[str]) -> int:
        """§7.7: all ids issued or nothing released (InvalidParams); returns how many live
        deliveries were newly released."""
        serials = [int(d[4:]) for d in ids]
        for d_id, serial in zip(ids, serials, strict=True):
            if serial > conn.dlv:
                raise InvalidParams(f"{d_id} was never issued on this connection")
        released = 0
        for serial in serials:
            d = conn.deliveries.get(serial)
            if d is None:
                if conn.messages:
                    released += self._release_message(conn, serial)
                continue
            if d.consumed:
                continue
            released += 1
            if d.is_request:
                d.consumed = True
                self._request_consumed(conn, d.call)
                if not d.capability:
                    self._free_request(conn, d)
            else:
                del conn.deliveries[serial]
                self._ledger.move(d.call, CallPhase.GONE)
                if self._art.frames:
                    key = (d.call, RESULT)
                    self._art.unsee(conn, self._art.rooted(key))
                    self._unroot(key)
        return released

    def _op_services(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        prefix: str = p.get("prefix", "")
        out = []
        for name in sorted(self._services):
            if not name.startswith(prefix):
                continue
            svc = self._services[name]
            out.append({
                "name": name,
                "serviceIncarnation": svc.incarnation,
                "owner": {"clientId": svc.owner.client_id,
                          "clientIncarnation": svc.owner.client_incarnation},
                "maxQueued": svc.max_queued,
                "maxInFlight": svc.max_in_flight,
                "queued": len(svc.queue),
                "inFlight": svc.in_flight,
            })
        return {"services": out}

    def _op_stats(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        return self.stats(bool(p.get("detail", False)))

    def _op_expect(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        client_id: str = p["clientId"]
        if not any_matches(conn.grants.expect, client_id):
            raise NotAuthorized(f"no expect grant for {client_id}")
        if client_id in self._live:
            raise Conflict(f"client {client_id} already has a live connection")
        incarnation = p.get("clientIncarnation")
        seen = self._incarnations.get(client_id)
        if incarnation is not None and seen is not None and incarnation in seen:
            raise Conflict(f"incarnation {incarnation} of {client_id} was already used")
        grants = p.get("grants")
        if grants is not None:
            for kind in ("register", "call", "publish", "subscribe"):
                for pattern in grants.get(kind, ()):  # a missing list grants nothing
                    if not covered_by_delegate(pattern, conn.grants.delegate, client_id):
                        raise NotAuthorized(
                            f"{kind} grant {pattern!r} is not covered by a delegate grant")
        existing = self._expectations.get(client_id)
        pending = len(self._expectations) - (1 if existing is not None else 0)
        if pending >= self.limits.maxExpectations:
            raise QuotaExceeded(f"maxExpectations ({self.limits.maxExpectations}) reached")
        if existing is not None:
            self._drop_expectation(existing)
        ttl_ms: int = p.get("ttlMs", 30000)
        assert self._loop is not None
        exp = _Expectation(client_id, p["pid"], incarnation, grants, conn,
                           self._loop.call_later(ttl_ms / 1000.0, self._expire, client_id))
        self._expectations[client_id] = exp
        conn.expectations.add(client_id)
        return {"clientId": client_id, "expiresInMs": ttl_ms}

    def _forget_clients(self) -> None:
        """§14.1: over REMEMBERED_CLIENT_IDS clientIds, forget the least recently seen one
        without a live connection, with its incarnations. maxClients <= 4096 = the bound, and
        the clientId just added is live, so one without a live connection always exists."""
        remembered = self._incarnations
        while len(remembered) > limits.REMEMBERED_CLIENT_IDS:
            for client_id in remembered:
                if client_id not in self._live:
                    del remembered[client_id]
                    break
            else:
                return

    def _expire(self, client_id: str) -> None:
        exp = self._expectations.get(client_id)
        if exp is not None:
            self._drop_expectation(exp)

    def _drop_expectation(self, exp: _Expectation) -> None:
        exp.timer.cancel()
        if self._expectations.get(exp.client_id) is exp:
            del self._expectations[exp.client_id]
        exp.creator.expectations.discard(exp.client_id)

    # topics (docs/topics.md §3, §4) ----------------------------------------------------------
    def _lean_publish(self, conn: _Conn, p: dict[str, Any]) -> None:
        """§3.4 notification form: success sends nothing; a refusal is one
        `bus.publishFailed`; a frame naming no topic cannot be answered and closes."""
        if self._before_hello(conn):
            return
        name = p.get("topic")
        if type(name) is not str:
            self._close(conn, "INVALID_REQUEST", "a bus.publish notification needs a string topic")
            return
        self.counters["leanPublishes"] += 1
        problem = self._publish_params(p) or self._body_refused(strict=True)
        try:
            if problem is not None:
                raise InvalidParams(f"bus.publish: {problem}")
            self._op_publish(conn, p, 0)
        except BusError as exc:
            self._count_error(exc.name)
            topic = self._topics.topics.get(name)
            self._notify_control(conn, "bus.publishFailed", {
                "topic": name,
                "topicIncarnation": None if topic is None else topic.incarnation,
                "error": error_object(exc.name, exc.message, "not-dispatched"),
            })

    def _op_declare(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        name: str = p["topic"]
        if not any_matches(conn.grants.manage, name):
            raise NotAuthorized(f"no manage grant for {name}")
        topic = self._topics.declare(conn, name, p.get("retain", False), p.get("maxBounded", 0))
        log.info("bus.declare", connection_id=conn.connection_id, topic=name,
                 topic_incarnation=topic.incarnation)
        return {"topic": name, "topicIncarnation": topic.incarnation}

    def _op_undeclare(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        removed, wake, released = self._topics.undeclare(conn, p["topic"],
                                                         p["topicIncarnation"])
        for other in wake:
            self._mark(other)
        self._messages_released(released)
        return {"removed": removed}

    def _op_publish(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        """§3.4; every refusal after the params counts in `publishRefused`."""
        try:
            return self._publish(conn, p)
        except BusError:
            self.counters["publishRefused"] += 1
            raise

    def _publish(self, conn: _Conn, p: dict[str, Any]) -> dict[str, Any]:
        name: str = p["topic"]
        if not any_matches(conn.grants.publish, name):
            raise NotAuthorized(f"no publish grant for {name}")
        payload, _ = self._body_bytes(p, "payload")
        table = self._topics
        ids = p.get("attachments")
        arts: tuple[Artifact[_Conn], ...] = ()
        if ids:  # checks 5–7 come after 3 and 4, before the transient 8 and 9
            current = table.topics.get(name)
            if current is None:
                raise NoTopic(f"no topic declared under {name}")
            expected = p["expectedIncarnation"]
            if expected is not None and expected != current.incarnation:
                raise TargetChanged(f"{name} is now {current.incarnation}, not {expected}")
            arts = self._attachable(conn, ids)
        topic = table.check_publish(name, p["expectedIncarnation"], len(payload))
        size = len(message_frame(LONGEST_DELIVERY_ID, name, topic.incarnation,
                                 topic.sequence + 1, MAX_ID, conn.identity,
                                 orjson.Fragment(payload),
                                 [a.wire() for a in arts] if arts else None))
        if size > self.limits.maxEnvelopeBytes:
            raise InvalidEnvelope(f"the bus.message frame would be {size} bytes "
                                  f"(maxEnvelopeBytes {self.limits.maxEnvelopeBytes})")
        outcome = table.accept_publish(topic, conn.identity, payload)
        self.counters["published"] += 1
        for other in outcome.wake:
            self._mark(other)
        if arts:
            msg = outcome.message
            if msg not in outcome.released:
                self._art.root(msg, arts)
            if p.get("transfer"):
                self._collect(self._art.transfer(conn, arts))
        self._messages_released(outcome.released)
        return {"topic": name, "topicIncarnation": topic.incarnation,
                "sequence": outcome.message.sequence, "latest": outcome.latest,
                "bounded": outcome.bounded}

    def _op_subscribe(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        name: str = p["topic"]
        mode = p["mode"]
        if (mode == "bounded") != ("depth" in p):
            raise InvalidParams("bus.subscribe: depth is required with bounded and refused "
                                "with latest")
        if not any_matches(conn.grants.subscribe, name):
            raise NotAuthorized(f"no subscribe grant for {name}")
        # its messages wait until the writer took the response enqueued right after (§4.2 r4)
        gate = conn.control_taken + len(conn.control) + 1
        sub, retained = self._topics.subscribe(conn, name, mode, p.get("depth", 1),
                                               p.get("window", 1), p.get("retained", True), gate)
        topic = sub.topic
        self._mark(conn)
        return {"topic": name, "topicIncarnation": topic.incarnation,
                "sequence": topic.sequence, "retained": retained}

    def _op_unsubscribe(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        removed, released = self._topics.unsubscribe(conn, p["topic"])
        self._messages_released(released)
        return {"removed": removed}

    def _op_topics(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        prefix: str = p.get("prefix", "")
        topics = self._topics.topics
        out = []
        for name in sorted(topics):
            if not name.startswith(prefix):
                continue
            topic = topics[name]
            owner = topic.owner
            out.append({
                "topic": name,
                "topicIncarnation": topic.incarnation,
                "owner": {"clientId": owner.client_id,
                          "clientIncarnation": owner.client_incarnation},
                "retain": topic.retain,
                "maxBounded": topic.max_bounded,
                "sequence": topic.sequence,
                "latest": len(topic.subscriptions) - topic.bounded,
                "bounded": topic.bounded,
            })
        return {"topics": out}

    def _release_message(self, conn: _Conn, serial: int) -> int:
        """A message delivery's credit returns (§4.3); 1 if it was live, else 0."""
        entry = conn.messages.pop(serial, None)
        if entry is None:
            return 0
        sub, msg = entry
        ready, released = self._topics.consume(sub, msg)
        if ready:
            self._mark(conn)
        if self._art.frames:
            self._art.unsee(conn, self._art.rooted(msg))
            if released is not None:
                self._collect(self._art.unroot(msg))
        return 1

    def _dispatchable(self, conn: _Conn) -> bool:
        """The RPC lane could dispatch a request now (what `_dispatch` would find)."""
        if conn.open_requests >= self.limits.maxOpenRequestsPerClient:
            return False
        return any(svc.queue and svc.in_flight < svc.max_in_flight
                   for svc in conn.service_list)

    def _pump_lanes(self, conn: _Conn, transport: asyncio.Transport) -> None:
        """`_pump` for a connection with subscriptions: one frame at a time, the topic lane
        taking its turn by `LaneTurn` (§4.2) between the control and RPC lanes."""
        control = conn.control
        counters = self.counters
        table = self._topics
        turn = conn.lane
        while not conn.write_paused:
            out: list[bytes] = []
            budget = WRITE_BATCH_BYTES
            while budget > 0:
                sub = table.next_ready(conn, conn.control_taken)
                other = bool(control or conn.results) or self._dispatchable(conn)
                lane = turn.pick(sub is not None, other)
                if lane is None:
                    break
                if lane is Lane.TOPIC:
                    assert sub is not None
                    body = self._topic_frame(conn, sub)
                elif control:
                    body = control.popleft()
                    conn.control_bytes -= len(body)
                    conn.control_taken += 1
                elif conn.results:
                    body = self._take_result(conn)
                else:
                    before = len(out)
                    self._dispatch(conn, out, 1)
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
            frames = len(out) // 2
            conn.frames_out += frames
            counters["framesOut"] += frames
            counters["bytesOut"] += len(data)
            transport.write(data)
            if budget > 0:
                return

    def _topic_frame(self, conn: _Conn, sub: Subscription[_Conn]) -> bytes:
        item = self._topics.take(sub)
        if isinstance(item, Removal):
            return orjson.dumps({"jsonrpc": "2.0", "method": "bus.topicRemoved", "params": {
                "topic": item.topic, "topicIncarnation": item.incarnation,
                "reason": item.reason}})
        msg, skipped = item
        conn.dlv += 1
        serial = conn.dlv
        conn.messages[serial] = (sub, msg)
        self.counters["messagesDelivered"] += 1
        arts = self._art.rooted(msg) if self._art.frames else ()
        if arts:
            self._art.see(conn, arts)
        return message_frame(f"dlv-{serial}", msg.topic, msg.incarnation, msg.sequence, skipped,
                             msg.publisher, orjson.Fragment(msg.payload),
                             [a.wire() for a in arts] if arts else None)

    # the artifact store (docs/topics.md §5, §6) ---------------------------------------------
    def _usable_store(self, conn: _Conn) -> Store:
        """§5.3 checks 2 and 3 (and §5.7's): the store, for a peer of the router's uid."""
        if conn.uid != self._euid:
            raise NotAuthorized(f"the store is offered to uid {self._euid} only")
        store = self._store
        if store is None or store.failed:
            raise StoreFailure("the store is disabled" if store is None else
                               "the store has failed")
        return store

    def _attachable(self, conn: _Conn, ids: list[str]) -> tuple[Artifact[_Conn], ...]:
        """Checks A1–A3 of §6.2."""
        store = self._store
        if store is None or store.failed or conn.uid != self._euid:
            raise ArtifactGone(f"{ids[0]}: no store is offered to this connection")
        return self._art.attachable(conn, ids)

    def _collect(self, arts: list[Artifact[_Conn]]) -> None:
        """§5.2 rule 4: collected artifacts' files are unlinked in the same step."""
        store = self._store
        if store is None:
            return
        for art in arts:
            store.unlink(art.artifact_id)

    def _unroot(self, key: object) -> None:
        if key in self._art.frames:
            self._collect(self._art.unroot(key))

    def _request_consumed(self, conn: _Conn, call: Call[_Conn]) -> None:
        """A request delivery's credit returned: its sight and its root end (§5.2 rule 2)."""
        if self._art.frames:
            key = (call, REQUEST)
            self._art.unsee(conn, self._art.rooted(key))
            self._unroot(key)

    def _messages_released(self, released: tuple[Message, ...] | list[Message]) -> None:
        """Messages nothing references any more release their attachments (§5.2 rule 3)."""
        if self._art.frames:
            for msg in released:
                self._unroot(msg)

    def _op_allocate(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        store = self._usable_store(conn)
        length: int = p["length"]
        ledger = self._art
        ledger.check_allocate(conn, length)
        artifact_id = ledger.next_id()
        file = store.create(artifact_id, length)
        ledger.allocate(conn, length, file)
        return {"artifactId": artifact_id, "length": length}

    def _op_seal(self, conn: _Conn, p: dict[str, Any], rid: int) -> Any:
        """§5.5: the file checks in the handler; the hash inline up to SEAL_INLINE_BYTES,
        else on the hashing thread with this connection's reading paused."""
        store = self._store
        if store is None or store.failed:
            raise StoreFailure("the store is disabled" if store is None else
                               "the store has failed")
        art = self._art.check_seal(conn, p["artifactId"])
        try:
            seal = store.open_for_seal(art.artifact_id, art.length, art.file)
        except BusError:
            self.counters["sealsRefused"] += 1
            raise
        except OSError as exc:
            store.failed = True
            raise StoreFailure(f"seal of {art.artifact_id} failed: {exc.strerror}") from exc
        if art.length <= SEAL_INLINE_BYTES:
            try:
                actual = store.hash(seal)
            except OSError as exc:
                self._seal_failed(store, seal)
                raise StoreFailure(f"hashing {art.artifact_id} failed: {exc.strerror}") from exc
            return self._apply_seal(conn, art, seal, actual, p["digest"])
        assert self._loop is not None
        conn.sealing = True
        store.hashing += 1
        fut = self._loop.run_in_executor(store.executor(), store.hash_off_loop, seal)
        fut.add_done_callback(
            lambda f: self._hashed(conn, rid, art, seal, p["digest"], f))
        return DEFERRED

    def _hashed(self, conn: _Conn, rid: int, art: Artifact[_Conn], seal: SealFile,
                digest: str, fut: asyncio.Future[str]) -> None:
        """An off-loop hash finished: apply it on the loop, respond, read on."""
        store = self._store
        if store is not None:
            store.hashing -= 1
        conn.sealing = False
        if fut.cancelled() or fut.exception() is not None or store is None or conn.torn_down:
            if store is None or conn.torn_down:  # the allocation went with its connection
                with contextlib.suppress(OSError):
                    os.close(seal.fd)
                return
            self._seal_failed(store, seal)
            self._respond_error(conn, rid, "STORE_FAILURE",
                                f"hashing {art.artifact_id} failed", "not-dispatched")
            assert self._loop is not None
            self._loop.call_soon(self._read_frames, conn)
            return
        try:
            result = self._apply_seal(conn, art, seal, fut.result(), digest)
        except BusError as exc:
            self._respond_error(conn, rid, exc.name, exc.message, exc.dispatch)
        else:
            self._respond(conn, rid, result)
        assert self._loop is not None
        self._loop.call_soon(self._read_frames, conn)

    def _seal_failed(self, store: Store, seal: SealFile) -> None:
        """A store syscall failed unexpectedly: the store is failed (§5.1 rule 8)."""
        store.failed = True
        with contextlib.suppress(OSError):
            store.finish_seal(seal, False)

    def _apply_seal(self, conn: _Conn, art: Artifact[_Conn], seal: SealFile, actual: str,
                    digest: str) -> dict[str, Any]:
        """§5.5 check 8 and the accept."""
        store = self._store
        assert store is not None
        accepted = actual == digest
        try:
            store.finish_seal(seal, accepted)
        except OSError as exc:
            store.failed = True
            raise StoreFailure(f"sealing {art.artifact_id} failed: {exc.strerror}") from exc
        if not accepted:
            self.counters["sealsRefused"] += 1
            raise ArtifactMismatch(f"{art.artifact_id}: the digest differs from the bytes")
        self._art.seal(art, digest)
        return art.wire()

    def _op_retain(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        self._usable_store(conn)
        arts = self._art.retain(conn, p["artifactIds"])
        return {"artifacts": [a.wire() for a in arts]}

    def _op_drop(self, conn: _Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        dropped, collected = self._art.drop(conn, p["artifactIds"])
        self._collect(collected)
        return {"dropped": dropped}

    def store_directory(self) -> str | None:
        """The store directory's path, or None when the store is disabled."""
        return None if self._store is None else self._store.path

    def set_hash_hook(self, hook: Callable[[], None] | None) -> None:
        """Run `hook` on the hashing thread before each off-loop hash: a harness holds a
        large seal there to observe what proceeds meanwhile."""
        if self._store is not None:
            self._store.hash_hook = hook

    # introspection ----------------------------------------------------------------------
    def remembered_incarnations(self) -> dict[str, tuple[str, ...]]:
        """Each remembered clientId's remembered incarnations, least recently seen first
        (wire.md §6.2, §14.1): what the bounds keep, for operators' tools and their tests."""
        return {client: tuple(seen) for client, seen in self._incarnations.items()}

    def transport_of(self, client_id: str) -> asyncio.Transport | None:
        """The transport of `client_id`'s live connection, or None: a harness pauses or drops
        a connection from the router's side with it."""
        for conn in self._conns.values():
            if conn.client_id == client_id and not conn.closing:
                return conn.transport
        return None

    # stats ------------------------------------------------------------------------------
    def stats(self, detail: bool = False) -> dict[str, Any]:
        """wire.md §16; O(connections + services)."""
        conns = self._conns.values()
        clients = sum(1 for c in conns if c.client_id is not None and not c.closing)
        open_conns = sum(1 for c in conns if not c.closing)
        queued = sum(len(s.queue) for s in self._services.values())
        dispatched = sum(c.capabilities for c in conns)
        active = sum(c.active for c in conns)
        counters = self.counters
        topics = self._topics
        art = self._art
        now = time.monotonic()
        result: dict[str, Any] = {
            "routerId": self.router_id,
            "uptimeMs": int((now - self._started) * 1000),
            "connections": open_conns,
            "pendingConnections": open_conns - clients,
            "clients": clients,
            "services": len(self._services),
            "expectations": len(self._expectations),
            "calls": self._ledger.calls,
            "activeCalls": active,
            "queuedCalls": queued,
            "dispatchedCalls": dispatched,
            "detachedCalls": self._ledger.detached,
            "repliedCalls": self._ledger.calls - queued - dispatched,
            "replyCapabilities": dispatched,
            "queuedCallBytes": self._ledger.queued_bytes,
            "topics": len(topics.topics),
            "subscriptions": topics.subscriptions,
            "queuedMessages": topics.queued_messages,
            "queuedTopicBytes": topics.queued_bytes,
            "messageDeliveries": topics.deliveries,
            "store": self._store_stats(),
            "counters": {
                **counters,
                "messagesReplaced": topics.replaced,
                "messagesDropped": topics.dropped,
                "artifactsAllocated": art.allocated_total,
                "artifactsSealed": art.sealed_total,
                "artifactsCollected": art.collected_total,
                "cancels": dict(counters["cancels"]),
                "errors": dict(counters["errors"]),
                "closes": dict(counters["closes"]),
            },
            "connectionsDetail": None,
        }
        if detail:
            result["connectionsDetail"] = [
                {
                    "connectionId": c.connection_id,
                    "clientId": c.client_id,
                    "clientIncarnation": c.client_incarnation,
                    "pid": c.pid,
                    "uid": c.uid,
                    "gid": c.gid,
                    "ageMs": int((now - c.created) * 1000),
                    "services": sorted(c.services),
                    "activeCalls": c.active,
                    "detachedCalls": sum(
                        1 for k in c.calls.values() if k.phase is CallPhase.DETACHED),
                    "openRequests": c.open_requests,
                    "controlFrames": len(c.control),
                    "controlBytes": c.control_bytes,
                    "framesIn": c.frames_in,
                    "framesOut": c.frames_out,
                    "subscriptions": len(r.subs) if (r := topics.readers.get(c)) else 0,
                    "messageDeliveries": len(c.messages),
                    "holds": len(art.holds.get(c, ())),
                    "heldBytes": art.held_bytes.get(c, 0),
                    "allocations": art.allocations.get(c, 0),
                }
                for c in sorted(conns, key=lambda c: c.number)
                if not c.closing
            ]
        return result


    def _store_stats(self) -> dict[str, Any] | None:
        store = self._store
        if store is None:
            return None
        art = self._art
        return {"storeId": store.store_id, "failed": store.failed,
                "artifacts": len(art.artifacts), "allocated": art.allocated, "bytes": art.bytes,
                "holds": art.hold_count, "hashing": store.hashing}


def _conn_label(conn: _Conn) -> str:
    """A subscriber as a BACKPRESSURE message names it (docs/topics.md §3.4 check 8)."""
    return conn.client_id or conn.connection_id


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
