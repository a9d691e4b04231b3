"""The worker shell: bus connection, registration, admission, `Worker.*`, status cell
(design/session.md §2.1–§2.8).

Why: every agent and environment must refuse, replay and report the same way, whatever model or
world it runs; the shell owns all of that and an endpoint (`workers.agent`, `workers.environment`)
only implements its own methods' checks and effects.

API:

    WorkerState                      the 11 states of design/session.md §2.6 (StrEnum, wire values)
    StatusCell                       what `Worker.Status` reports; `raise_progress(n)` only rises
    Call                             one admitted request as an endpoint handler sees it
    Endpoint                         base class of the agent and environment endpoints
    WorkerShell(launch, endpoint)    `await shell.run(stop_event=None) -> exit code`
    EXIT_SHUTDOWN 0, EXIT_GATE 1, EXIT_ARGS 2, EXIT_LOST 3, EXIT_REGISTER 4

The bodies that run a shell are `workers.bodies` (in-process and thread mode) and
`workers.main` (the process); the contract's identities and schemas are `workers.types.contract`.

Start (design/session.md §2.1): (process mode) arm die-with-parent, read the start gate line `go`
from stdin; connect with `clientIncarnation = incarnationId`; register
`maxQueued 16, maxInFlight 8`, retrying a bus `CONFLICT` every 5 ms for up to 30 s (then exit 4);
serve until `Worker.Shutdown` was answered (exit 0) or the connection is lost (exit 3). The shell
never reconnects.

Request pipeline (design/session.md §2.2), for each delivered request in arrival order: the SDK
starts one task per `bus.request` in arrival order, and everything up to admission runs
synchronously at the start of that task, so admission order is arrival order; `Worker.Hello`,
`Worker.Status` and `Worker.Acknowledge` never await and run inline on the SDK's reader
(design/wire.md §22.2). 1 parse (design/session.md §1.3) → `INVALID_ARGUMENT`; 2 method table →
`UNSUPPORTED`; 3 class, StepMutation with scope null → `INVALID_ARGUMENT`; 3b caller ∉ `--callers` ∪
{supervisor} → `IDENTITY_MISMATCH`; 4 ReadOnly → answered at once from the status cell (never waits
for the endpoint lock); 5 admission by the `ResultCache` with `wire_digest(method, payload bytes)`
(design/wire.md §22.3: the bytes the caller sent): Replay (the stored outcome JSON, a fresh bus
reply), Refuse, or Execute (`activeRequestId`, the endpoint handler behind the endpoint lock in the
request's own task); 6 a success or an error with mutation ≠ `none` is stored in the cache before
the reply (`lastCompletedRequestId`; mutation ≠ `none` makes the worker `failed`), an error with
`none` abandons the key; `activeRequestId` is cleared either way. The endpoint lock is released
before the reply is sent (the SDK sends the returned outcome), so it is never held across bus I/O.

Resolved ambiguities:
- The effective caller set is `--callers` plus the supervisor (its `Worker.Shutdown` must get
  through check 3b).
- `State.*` (`workers.state`) is in an endpoint's method table when the endpoint serves it (the
  agent only for a model that declares its versions); `checkpoint-v1` is advertised exactly
  then, and removed from a plugin's extras otherwise. An endpoint without it refuses `State.*`
  at pipeline step 2 with `UNSUPPORTED`/`none`.
- `Worker.Status` and `Worker.Acknowledge` do not check their scope (echoed); `Worker.Status`
  params must be exactly `{}`; `Worker.Acknowledge` accepts repeated ids (the cache ignores a
  repeat). `Worker.Shutdown` checks its params before the caller.
- Model and world calls run in one dedicated thread per worker ("the model thread"), so the
  event loop keeps answering `Worker.Status` and exact duplicates during long CPU work, and a
  plugin may use the offered `ThreadPoolExecutor(max_workers=threads)` from inside a call without
  deadlocking it. A model call has a deadline of `MODEL_CALL_TIMEOUT_S`; passing it is
  `BACKEND_FAILURE`/`unknown`.
  A plugin class that declares `inline_calls = True` (`workers.protocols`; the synthetic
  classes do) has its calls run on the event loop instead: short calls do not pay two thread
  wake-ups each, at the price of no deadline and no `Worker.Status` answer while one runs.
- An exception other than `DomainError` escaping a handler is `BACKEND_FAILURE`/`unknown` (the
  shell cannot know whether it mutated), which makes the worker `failed`.
- A connection that cannot be opened or a registration refused by anything but `CONFLICT` exits
  3 as a lost connection does; a stop requested by the owner (`stop_event`, thread/in-process
  modes) aborts the connection without unregistering and also returns 3. Cancelling the task of
  `run_worker` aborts the connection and re-raises the cancellation.
- Requests that arrive while `stopping` are refused by the endpoints with `INVALID_PHASE`.
- The shell is the base layer of the roles: it imports no endpoint. Every body is given its
  `endpoint_factory`; `workers.roles.endpoint_for` is the one that maps a role to its endpoint.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Final, TypeVar

import structlog

from bus import client as bus_client
from bus import client_artifacts, client_serving
from bus.errors import BusError
from bus.limits import MAX_ID, result_frame
from workers.artifacts import open_attached
from workers.dedup import (
    Execute,
    OpClass,
    Refuse,
    Replay,
    ResultCache,
    Ticket,
    class_of,
    wire_digest,
)
from workers.faults import Role
from workers.launch import WorkerLaunch
from workers.types.contract import build_digest, check_params, contract_digest
from workers.types.datatypes import Attached
from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    Scope,
    format_u64,
    parse_id,
    parse_request_id,
    short,
)
from workers.types.rpc import Outcome, Request, parse_request, unparsable_outcome
from workers.types.structures import parse_typed

__all__ = [
    "EXIT_ARGS",
    "EXIT_GATE",
    "EXIT_LOST",
    "EXIT_REGISTER",
    "EXIT_SHUTDOWN",
    "MAX_IN_FLIGHT",
    "MAX_QUEUED",
    "Call",
    "Endpoint",
    "StatusCell",
    "WorkerShell",
    "WorkerState",
]

log = structlog.get_logger("workers.shell")

EXIT_SHUTDOWN: Final = 0
EXIT_GATE: Final = 1
EXIT_ARGS: Final = 2
EXIT_LOST: Final = 3
EXIT_REGISTER: Final = 4

MAX_QUEUED: Final = 16
MAX_IN_FLIGHT: Final = 8
REGISTER_RETRY_S: Final = 0.005
REGISTER_BUDGET_S: Final = 30.0
CONNECT_TIMEOUT_S: Final = 10.0
BUS_OP_TIMEOUT_S: Final = 5.0
LOCK_WAIT_S: Final = 30.0
MODEL_CALL_TIMEOUT_S: Final = 300.0
READ_ONLY_HISTORY: Final = 16
SUPPORTED_MAJOR: Final = 1
SELECTED_MINOR: Final = 0

WORKER_METHODS: Final = ("Worker.Hello", "Worker.Status", "Worker.Acknowledge", "Worker.Shutdown")
#: methods whose whole pipeline completes without awaiting: the SDK runs them inline on its
#: reader (design/wire.md §22.2). The step mutations await the endpoint lock, the model thread,
#: media seals and delay faults, and Shutdown awaits its own reply: they keep a task each.
INLINE_METHODS: Final = ("Worker.Hello", "Worker.Status", "Worker.Acknowledge")

T = TypeVar("T")


# --------------------------------------------------------------------------------------------
# status (design/session.md §2.6)


class WorkerState(StrEnum):
    UNINITIALIZED = "uninitialized"
    READY = "ready"
    PREPARING = "preparing"
    PREPARED = "prepared"
    ADVANCING = "advancing"
    COMMITTING = "committing"
    CAPTURING = "capturing"
    STAGED_RESTORE = "staged-restore"
    RESTORING = "restoring"
    FAILED = "failed"
    STOPPING = "stopping"


@dataclass
class StatusCell:
    """The shell's status cell: `Worker.Status` reads it and never waits for anything."""

    state: WorkerState = WorkerState.UNINITIALIZED
    current_scope: Scope | None = None
    active_request_id: str | None = None
    last_completed_request_id: str | None = None
    last_batch_id: str | None = None
    progress: int = 0

    def raise_progress(self, value: int) -> None:
        """Progress is monotonic: only a larger value is taken."""
        if value > self.progress:
            self.progress = value

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "currentScope": None if self.current_scope is None else self.current_scope.to_json(),
            "activeRequestId": self.active_request_id,
            "lastCompletedRequestId": self.last_completed_request_id,
            "lastBatchId": self.last_batch_id,
            "progressCounter": format_u64(self.progress),
        }


# --------------------------------------------------------------------------------------------
# endpoints


@dataclass(frozen=True, slots=True)
class Call:
    """One admitted request as its handler sees it. `attached`: the request's attachments,
    opened (by-reference media, topics.md §14.2); a handler appends to `outgoing` the
    sealed artifacts its result names, and they leave with the reply (the shell keeps its holds
    until the next reply with attachments, for a replay)."""

    method: str
    request: Request
    caller: str
    attached: Mapping[str, Attached] = field(default_factory=dict)
    outgoing: list[client_artifacts.Attachment] = field(default_factory=list)
    #: the params were checked against the method's schema by the typed decode (`parse_typed`)
    typed: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def scope(self) -> Scope | None:
        return self.request.scope

    @property
    def params(self) -> dict[str, Any]:
        return self.request.params

    def check_params(self) -> None:
        """The params against the method's schema, unless the typed decode checked them."""
        if not self.typed:
            check_params(self.method, self.params)


Handler = Callable[[Call], Awaitable[dict[str, Any]]]


class Endpoint:
    """Base of the agent and environment endpoints: its methods, capabilities and checks.

    Subclasses set `role`, `base_capabilities`, fill `handlers` (method → coroutine function
    returning the result object or raising `DomainError`) and may override `extras()`.
    The shell calls `attach(shell)` once before serving.
    """

    role: ClassVar[Role]
    base_capabilities: ClassVar[tuple[str, ...]]

    def __init__(self, launch: WorkerLaunch) -> None:
        if launch.role != self.role:
            raise DomainError.invalid(f"{launch.worker_id} is launched as {launch.role}, "
                                      f"not {self.role}")
        self.launch = launch
        self.handlers: dict[str, Handler] = {}
        self._shell: WorkerShell | None = None

    # wiring ---------------------------------------------------------------------------------

    def attach(self, shell: WorkerShell) -> None:
        self._shell = shell

    def kept_artifacts(self) -> frozenset[str]:
        """Artifact ids this endpoint holds for a later reply (a world's delayed frames,
        topics.md §14.2 rule 3): the shell never drops those with its replay holds."""
        return frozenset()

    @property
    def shell(self) -> WorkerShell:
        if self._shell is None:
            raise DomainError(ErrorCode.INTERNAL, "endpoint used before attach", Mutation.NONE)
        return self._shell

    @property
    def status(self) -> StatusCell:
        return self.shell.status

    def extras(self) -> tuple[str, ...]:
        """Capabilities of the model or world beyond the endpoint's own."""
        return ()

    def capabilities(self) -> list[str]:
        caps = set(self.base_capabilities) | set(self.extras())
        if "State.Capture" in self.handlers:
            caps.add("checkpoint-v1")
        else:
            caps.discard("checkpoint-v1")
        return sorted(caps)

    def reply_frame(self, call: Call, result: dict[str, Any]) -> tuple[int, int]:
        """(worst-case `bus.result` frame bytes of this reply, the `maxEnvelopeBytes` the router
        announced at hello, 0 before it): the router's own rule (`bus.limits.result_frame`)
        with the longest call id and this worker's responder and service incarnation."""
        shell = self.shell
        launch = shell.launch
        outcome = Outcome.success(call.request, launch.worker_id, launch.incarnation_id,
                                  result).to_json()
        frame = result_frame(MAX_ID, shell.service_incarnation or "",
                             {"clientId": launch.client_id,
                              "clientIncarnation": launch.incarnation_id}, outcome)
        return len(frame), self.envelope_limit()

    def envelope_limit(self) -> int:
        """The `maxEnvelopeBytes` the router announced at hello; 0 before it."""
        client = self.shell.client
        limit: int = client.limits.get("maxEnvelopeBytes", 0) if client is not None else 0
        return limit

    # the common checks of design/session.md §3 ----------------------------------------------------

    def check_scope(self, call: Call) -> Scope:
        """Checks 1–2: scope present, same session."""
        scope = call.scope
        if scope is None:
            raise DomainError.invalid(f"{call.method} needs a scope")
        if scope.session_id != self.launch.session_id:
            raise DomainError.before(
                ErrorCode.IDENTITY_MISMATCH,
                f"{call.method} names session {scope.session_id}; this worker serves "
                f"{self.launch.session_id}")
        return scope

    def check_initialize_phase(self, call: Call) -> None:
        """Check 3 of an `*.Initialize`: only an uninitialized worker initializes."""
        state = self.status.state
        if state != WorkerState.UNINITIALIZED:
            raise DomainError.before(
                ErrorCode.INVALID_PHASE,
                f"{call.method}: {self.launch.worker_id} is {state.value}, not uninitialized "
                f"(restore uses State.*)")

    def check_epoch(self, call: Call, epoch: str | None) -> Scope:
        """Checks 1–4 of every scoped non-Initialize method ("epoch check")."""
        scope = self.check_scope(call)
        state = self.status.state
        if state in (WorkerState.UNINITIALIZED, WorkerState.FAILED, WorkerState.STOPPING):
            raise DomainError.before(
                ErrorCode.INVALID_PHASE,
                f"{call.method}: {self.launch.worker_id} is {state.value}")
        if scope.epoch != epoch:
            raise DomainError.before(
                ErrorCode.STALE_EPOCH,
                f"{call.method} names epoch {scope.epoch}; this worker is in epoch {epoch}")
        return scope

    def check_step(self, call: Call, step: int, at: int) -> None:
        """`step < at` → `STALE_STEP`, `step > at` → `FUTURE_STEP`."""
        if step < at:
            raise DomainError.before(
                ErrorCode.STALE_STEP,
                f"{call.method} names step {step}; this worker is at {at}")
        if step > at:
            raise DomainError.before(
                ErrorCode.FUTURE_STEP,
                f"{call.method} names step {step}; this worker is at {at}")

    async def sleep_fault(self, knob: str, step: int) -> None:
        """A `*_delay_ms` fault for the call at `step` (asyncio sleep; 0 does nothing)."""
        ms = self.launch.faults.delay_ms(knob, step)
        if ms > 0:
            log.info("worker.fault_delay", worker_id=self.launch.worker_id, knob=knob,
                     step=step, ms=ms)
            await asyncio.sleep(ms / 1000)

    def inline_calls(self) -> bool:
        """Whether the plugin declared its calls short enough to run on the event loop."""
        return False

    async def run_model(self, what: str, fn: Callable[[], T]) -> T:
        """Run model/world code in the model thread, bounded by `MODEL_CALL_TIMEOUT_S`, or
        inline for a plugin that declares `inline_calls`."""
        if self.inline_calls():
            return fn()
        return await self.shell.run_model(what, fn)


# --------------------------------------------------------------------------------------------
# the shell


class WorkerShell:
    """One worker incarnation: connection, registration, admission, `Worker.*`."""

    def __init__(self, launch: WorkerLaunch, endpoint: Endpoint) -> None:
        self.launch = launch
        self.endpoint = endpoint
        self.status = StatusCell()
        self.cache: ResultCache[dict[str, Any]] = ResultCache(launch.worker_id)
        self.read_only_history: deque[tuple[str, dict[str, Any]]] = deque(
            maxlen=READ_ONLY_HISTORY)
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=launch.threads, thread_name_prefix=f"{launch.worker_id}-cpu")
        self._model_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"{launch.worker_id}-model")
        self._callers = launch.allowed_callers()
        self._lock = asyncio.Lock()
        self._shutdown = asyncio.Event()
        #: the request id and sealed attachments of the last reply that carried some: this
        #: worker keeps its holds on them until the next such reply, so a replay of that
        #: reply (a re-sent request after a lost result) attaches them again
        self._kept: tuple[str, tuple[client_artifacts.Attachment, ...]] | None = None
        self.client: bus_client.BusClient | None = None
        self.service: client_serving.Service | None = None
        self.service_incarnation: str | None = None
        self._log = log.bind(worker_id=launch.worker_id, incarnation_id=launch.incarnation_id)
        endpoint.attach(self)

    def replayable_artifacts(self) -> frozenset[str]:
        """The artifact ids of the last reply that carried some: held for its replay until
        the next such reply, which drops them (the endpoint must not drop them before)."""
        return frozenset() if self._kept is None else \
            frozenset(a.artifact_id for a in self._kept[1])

    # identity ---------------------------------------------------------------------------------

    @property
    def worker_id(self) -> str:
        return self.launch.worker_id

    @property
    def incarnation_id(self) -> str:
        return self.launch.incarnation_id

    # running ----------------------------------------------------------------------------------

    async def run(self, *, stop_event: asyncio.Event | None = None) -> int:
        """Connect, register, serve; the exit code of design/session.md §2.1."""
        try:
            return await self._run(stop_event)
        finally:
            self.executor.shutdown(wait=False, cancel_futures=True)
            self._model_thread.shutdown(wait=False, cancel_futures=True)

    async def _run(self, stop_event: asyncio.Event | None) -> int:
        launch = self.launch
        try:
            client = await bus_client.connect(
                launch.socket, client_id=launch.client_id,
                client_incarnation=launch.incarnation_id, supported_majors=(SUPPORTED_MAJOR,),
                timeout=CONNECT_TIMEOUT_S)
        except BusError as exc:
            self._log.error("worker.connect_failed", error=exc.name, message=exc.message)
            return EXIT_LOST
        self.client = client
        try:
            code = await self._register(client)
            if code is not None:
                return code
            self._log.info("worker.serving", service=launch.service,
                           service_incarnation=self.service_incarnation)
            return await self._serve(client, stop_event)
        finally:
            await client.close()

    async def _register(self, client: bus_client.BusClient) -> int | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REGISTER_BUDGET_S
        attempts = 0
        while True:
            attempts += 1
            try:
                async with asyncio.timeout(BUS_OP_TIMEOUT_S):
                    service = await client.register(
                        self.launch.service, self._on_request, max_queued=MAX_QUEUED,
                        max_in_flight=MAX_IN_FLIGHT,
                        inline=dict.fromkeys(INLINE_METHODS, self._on_read_only))
            except BusError as exc:
                if exc.name == "CONFLICT" and loop.time() + REGISTER_RETRY_S <= deadline:
                    await asyncio.sleep(REGISTER_RETRY_S)
                    continue
                if exc.name == "CONFLICT":
                    self._log.error("worker.register_conflict", attempts=attempts)
                    return EXIT_REGISTER
                self._log.error("worker.register_failed", error=exc.name, message=exc.message)
                return EXIT_LOST
            except TimeoutError:
                self._log.error("worker.register_timeout")
                return EXIT_LOST
            self.service = service
            self.service_incarnation = service.incarnation
            return None

    async def _serve(self, client: bus_client.BusClient,
                     stop_event: asyncio.Event | None) -> int:
        waits: dict[asyncio.Task[Any], str] = {
            asyncio.ensure_future(self._shutdown.wait()): "shutdown",
            asyncio.ensure_future(client.wait_closed()): "lost",
        }
        if stop_event is not None:
            waits[asyncio.ensure_future(stop_event.wait())] = "stop"
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        reasons = {waits[task] for task in done}
        if "shutdown" in reasons and not client.closed:
            if self.service is not None:
                with contextlib.suppress(BusError, TimeoutError):
                    async with asyncio.timeout(BUS_OP_TIMEOUT_S):
                        await self.service.unregister()
            self._log.info("worker.stopped")
            return EXIT_SHUTDOWN
        if "shutdown" in reasons:
            return EXIT_SHUTDOWN
        if "stop" in reasons:
            self._log.warning("worker.aborted")
        else:
            self._log.warning("worker.connection_lost")
        return EXIT_LOST

    async def run_model(self, what: str, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._model_thread, fn)
        try:
            async with asyncio.timeout(MODEL_CALL_TIMEOUT_S):
                return await future
        except TimeoutError:
            raise DomainError(
                ErrorCode.BACKEND_FAILURE,
                f"{what} did not finish within {MODEL_CALL_TIMEOUT_S:g} s", Mutation.UNKNOWN,
            ) from None

    # the request pipeline (design/session.md §2.2) ------------------------------------------------

    def _outcome(self, request: Request, *, result: dict[str, Any] | None = None,
                 error: DomainError | None = None) -> dict[str, Any]:
        if error is not None:
            return Outcome.failure(request, self.worker_id, self.incarnation_id, error).to_json()
        assert result is not None
        return Outcome.success(request, self.worker_id, self.incarnation_id, result).to_json()

    def _front(self, req: client_serving.Request) -> dict[str, Any] | tuple[Call, OpClass]:
        """Steps 1–3b of design/session.md §2.2, synchronous: an outcome to answer at once, or the
        call."""
        method = req.method
        request = parse_typed(method, req.payload)
        typed = request is not None
        if request is None:
            try:
                request = parse_request(req.payload)
            except DomainError as exc:
                return unparsable_outcome(req.payload, exc, self.worker_id,
                                          self.incarnation_id).to_json()
        op = class_of(method)
        # the endpoint's method table (design/session.md §3.7): the Worker.* methods and the
        # endpoint's handlers
        if op is None or (method not in self.endpoint.handlers
                          and method not in WORKER_METHODS):
            return self._outcome(request, error=DomainError.before(
                ErrorCode.UNSUPPORTED,
                f"{short(method)} is not served by this {self.endpoint.role} endpoint"))
        if op == OpClass.STEP_MUTATION and request.scope is None:
            return self._outcome(request, error=DomainError.invalid(
                f"{method} is a step mutation and needs a scope"))
        caller = req.caller.client_id
        if caller not in self._callers:
            self._log.warning("worker.foreign_caller", caller=caller, method=method)
            return self._outcome(request, error=DomainError.before(
                ErrorCode.IDENTITY_MISMATCH,
                f"{caller} is not a caller of session {self.launch.session_id}"))
        attached = {} if not req.attachments or self.client is None \
            else open_attached(self.client, req.attachments)
        return Call(method, request, caller, attached, typed=typed), op

    def _on_read_only(self, req: client_serving.Request) -> dict[str, Any]:
        """The inline handler (design/wire.md §22.2) of the read-only methods that never await
        (`INLINE_METHODS`): design/session.md §2.2 steps 1–4 on the SDK's reader, no task per
        request."""
        front = self._front(req)
        if isinstance(front, dict):
            return front
        call, op = front
        assert op == OpClass.READ_ONLY
        return self._read_only_now(call)

    async def _on_request(self, req: client_serving.Request,
                          ) -> dict[str, Any] | client_serving.Reply | None:
        """The SDK handler: everything up to admission runs before the first await."""
        front = self._front(req)
        if isinstance(front, dict):
            return front
        call, op = front
        method = call.method
        request = call.request
        if op == OpClass.READ_ONLY:
            return await self._read_only(call, req)
        digest = wire_digest(method, req.payload_bytes)
        if op == OpClass.STEP_MUTATION:
            assert request.scope is not None
            admission = self.cache.admit_step(request.scope, method, request.request_id, digest)
        else:
            admission = self.cache.admit_lifecycle(request.request_id, digest)
        if isinstance(admission, Replay):
            self._log.info("worker.replay", method=method, request_id=request.request_id)
            kept = self._kept
            if kept is not None and kept[0] == request.request_id:
                return client_serving.Reply(admission.outcome, attachments=kept[1])
            return admission.outcome
        if isinstance(admission, Refuse):
            return self._outcome(request, error=admission.error)
        assert isinstance(admission, Execute)
        self.status.active_request_id = request.request_id
        return await self._execute(admission.ticket, call)

    async def _execute(self, ticket: Ticket, call: Call) -> dict[str, Any] | client_serving.Reply:
        handler = self.endpoint.handlers[call.method]
        error: DomainError | None = None
        result: dict[str, Any] | None = None
        try:
            if self._lock.locked():
                async with asyncio.timeout(LOCK_WAIT_S):
                    await self._lock.acquire()
            else:
                # a free lock is taken without suspending: there is no wait to bound, and the
                # timer (get_running_loop, current_task, call_at, cancel) would be pure cost
                await self._lock.acquire()
            try:
                result = await handler(call)
            finally:
                self._lock.release()
        except DomainError as exc:
            error = exc
        except TimeoutError:
            error = DomainError.before(ErrorCode.BUSY, "the endpoint lock is held too long")
        except Exception as exc:  # a handler bug: nobody knows what it touched
            self._log.exception("worker.handler_crashed", method=call.method)
            error = DomainError(ErrorCode.BACKEND_FAILURE,
                                f"{call.method} failed: {type(exc).__name__}", Mutation.UNKNOWN)
        outgoing = tuple(call.outgoing)
        if error is not None and outgoing and self.client is not None:
            # sealed for a result that is not sent: nothing else will ever name them, unless
            # the endpoint keeps them for a later reply
            own = self.endpoint.kept_artifacts()
            self.client.drop_nowait([a.artifact_id for a in outgoing
                                     if a.artifact_id not in own])
            outgoing = ()
        outcome = self._outcome(call.request, result=result, error=error)
        if error is None or error.mutation != Mutation.NONE:
            self.cache.complete(ticket, outcome)
            self.status.last_completed_request_id = call.request_id
            if error is not None:
                self.status.state = WorkerState.FAILED
                self._log.error("worker.failed", method=call.method, code=error.code.value,
                                mutation=error.mutation.value, message=error.message)
        else:
            self.cache.abandon(ticket)
        self.status.active_request_id = None
        if outgoing:
            # the previous reply's holds end (written before this reply, after that one),
            # except on what this reply names again or the endpoint keeps for a later one
            if self._kept is not None and self.client is not None:
                still = {a.artifact_id for a in outgoing} | self.endpoint.kept_artifacts()
                self.client.drop_nowait([a.artifact_id for a in self._kept[1]
                                         if a.artifact_id not in still])
            self._kept = (call.request_id, outgoing)
            return client_serving.Reply(outcome, attachments=outgoing)
        return outcome

    # Worker.* (design/session.md §2.5–§2.8) -------------------------------------------------------

    def _read_only_now(self, call: Call) -> dict[str, Any]:
        """Hello, Status or Acknowledge (design/session.md §2.5–§2.7): answered from the status cell
        at once."""
        try:
            result = self.READ_ONLY_HANDLERS[call.method](self, call)
        except DomainError as exc:
            outcome = self._outcome(call.request, error=exc)
        except Exception as exc:  # a bug in a read-only handler: it changed nothing
            self._log.exception("worker.read_only_crashed", method=call.method)
            outcome = self._outcome(call.request, error=DomainError(
                ErrorCode.INTERNAL, f"{call.method} failed: {type(exc).__name__}",
                Mutation.NONE))
        else:
            outcome = self._outcome(call.request, result=result)
        self.read_only_history.append((call.method, outcome))
        return outcome

    async def _read_only(self, call: Call, req: client_serving.Request) -> dict[str, Any] | None:
        if call.method != "Worker.Shutdown":
            return self._read_only_now(call)
        try:
            result = self._shutdown_check(call)
        except DomainError as exc:
            outcome = self._outcome(call.request, error=exc)
            self.read_only_history.append((call.method, outcome))
            return outcome
        except Exception as exc:  # a bug in a read-only handler: it changed nothing
            self._log.exception("worker.read_only_crashed", method=call.method)
            outcome = self._outcome(call.request, error=DomainError(
                ErrorCode.INTERNAL, f"{call.method} failed: {type(exc).__name__}",
                Mutation.NONE))
            self.read_only_history.append((call.method, outcome))
            return outcome
        outcome = self._outcome(call.request, result=result)
        self.read_only_history.append((call.method, outcome))
        # Shutdown: reply, wait until the reply was written, then end the serve loop
        self.status.state = WorkerState.STOPPING
        try:
            async with asyncio.timeout(BUS_OP_TIMEOUT_S):
                await req.reply(outcome)
        except (BusError, TimeoutError) as exc:
            self._log.warning("worker.shutdown_reply_failed", error=type(exc).__name__)
        finally:
            self._shutdown.set()
        return None

    def _hello(self, call: Call) -> dict[str, Any]:
        if call.scope is not None:
            raise DomainError.invalid("Worker.Hello takes scope null")
        call.check_params()
        p = call.params
        launch = self.launch
        if p["sessionId"] != launch.session_id:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"Worker.Hello expects session {p['sessionId']}; this is "
                                     f"{launch.worker_id} of session {launch.session_id}")
        if p["expectedWorkerId"] != launch.worker_id:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"Worker.Hello expects worker {p['expectedWorkerId']}; "
                                     f"this is {launch.worker_id}")
        if p["role"] != launch.role:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"Worker.Hello expects role {p['role']}; {launch.worker_id} "
                                     f"is an {launch.role}")
        if SUPPORTED_MAJOR not in p["supportedMajors"]:
            raise DomainError.before(ErrorCode.UNSUPPORTED,
                                     f"no common major: this worker speaks {SUPPORTED_MAJOR}, "
                                     f"the caller {p['supportedMajors']}")
        return {
            "selectedMajor": SUPPORTED_MAJOR,
            "selectedMinor": SELECTED_MINOR,
            "workerId": launch.worker_id,
            "incarnationId": launch.incarnation_id,
            "role": launch.role,
            "buildDigest": build_digest(),
            "contractDigest": contract_digest(),
            "capabilities": self.endpoint.capabilities(),
            "limits": {"maxAgents": launch.max_agents, "maxPorts": launch.max_agents,
                       "workerThreads": launch.threads},
        }

    def _status(self, call: Call) -> dict[str, Any]:
        call.check_params()
        return self.status.to_json()

    def _acknowledge(self, call: Call) -> dict[str, Any]:
        call.check_params()
        ids = [parse_request_id(rid, "requestIds[]") for rid in call.params["requestIds"]]
        acknowledged = self.cache.acknowledge(ids)
        extra = self.launch.faults.acknowledge_extra_id
        if extra is not None:
            acknowledged.append(extra)
        return {"acknowledged": acknowledged}

    def _shutdown_check(self, call: Call) -> dict[str, Any]:
        call.check_params()
        parse_id(call.params["reason"], "reason")
        if call.caller != self.launch.supervisor:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"only the supervisor {self.launch.supervisor} may shut "
                                     f"{self.worker_id} down; {call.caller} may not")
        self._log.info("worker.shutdown", reason=call.params["reason"])
        return {"stopping": True}

    #: the `Worker.*` methods answered at once from the status cell (pipeline step 4), by name
    READ_ONLY_HANDLERS: ClassVar[dict[str, Callable[[WorkerShell, Call], dict[str, Any]]]] = {
        "Worker.Hello": _hello,
        "Worker.Status": _status,
        "Worker.Acknowledge": _acknowledge,
    }
