"""The coordinator's call engine (design/session.md §6.3, §6.4, §6.8): every worker call of a
session and every failure of its epoch go through one `CallEngine`.

Why an engine of its own: bootstrap, the transaction, capture and restore all send requests,
check replies, resolve uncertain calls and fail the epoch, and they must do so one way. Kept
apart from the coordinator's state, those rules are one public, typed interface that the
coordinator owns and hands to the modules that need it (`flyd.session.capture`,
`flyd.session.restore`, `flyd.session.bootstrap`), instead of each of them reaching into the
coordinator.

Rules:

1. A request is a `Call`: a worker, its pinned `WorkerRef`, a method, a request id of the
   worker's next serial (`new_call`; serials restart at 1 when a worker is replaced), a scope
   and params. Resolution and injections re-send the same `Call`, never a new one.
2. Every call has a deadline (`deadline_of`): `Worker.Hello` and `*.Initialize` the `boot`
   deadline, `State.*` the `capture` deadline, everything else `probe`. `send` never raises for
   bus or deadline failures: it returns `Expired` (the caller's deadline passed; uncertain) or
   `Refused` (a definite bus failure or a malformed outcome), else `Answered`; every send's
   latency is observed under its method (`Metrics`).
3. `check_reply` (design/session.md §6.4): the reply's worker, incarnation (when pinned), scope and
   request id must echo the call (`IDENTITY_MISMATCH`/`none`); a domain error outcome is raised; the
   result must match the method's result schema (`BACKEND_FAILURE`/`unknown`).
4. `settle` turns a sent call's outcome into a result: check an answer, raise a refusal,
   resolve an expiry. `call` is `send` then `settle`.
5. `resolve` (design/session.md §6.8) re-sends the same request (deadline `probe`, pause
   `RESOLVE_PAUSE` after an expiry or an `IN_PROGRESS` reply) until it answers, its budget
   (`resolve` seconds) runs out (`BudgetExpired`) or its attempts do (`AttemptsExhausted`): then
   `BACKEND_FAILURE`/`unknown`. A refusal during resolution keeps its code with mutation `unknown`.
   It audits `resolve:<worker>:<method>` and counts in `Stats`.
6. `blamed` is `call` whose `DomainError` becomes a `Blame` naming the method (or a given
   detail) and the worker; `acknowledge` is `Worker.Acknowledge`, blamed, whose answer may only
   name ids it was asked about (else `Blame` detail `acknowledge`). `probe` is one request
   whose outcome is returned or raised as it is (design/session.md §6.13 `probe_raw`).
7. `fail` (design/session.md §6.3) is the one way an epoch fails: the phase label as it was,
   `Failed` (the fence closes), the owner's uncommitted state dropped (`on_fail`),
   `fail:<detail>[:<participant>]` audited, `last_failure` set, `SessionFailure` raised. `move`
   takes a phase edge or fails with the machine's refusal.
8. `guarded` runs a body so that nothing escapes unfenced: a `Blame` fails with its detail
   (`router` instead when the engine's own connection is closed and the error is
   `BACKEND_FAILURE`), a `SessionFailure` passes, any other exception fails with `step`
   (`INTERNAL`/`unknown` unless it is a `DomainError`), and a cancellation away from a committed
   boundary fails (`BACKEND_FAILURE`/`unknown`) before it propagates.
9. Attachments (topics.md §14.2): a `Call` may carry artifact ids, sent without transfer.
   The SDK holds a result's attachments; those of a world's media results
   (`Environment.Initialize`, `Environment.Advance`, `State.ActivateRestore`) wait for
   `take_attachments`, any other's
   are dropped at once, and a re-sent call's earlier ones too. `drop` is pipelined, never
   awaited; `drop_received` drops what nobody took (an epoch failure).

API: `Call`, `Blame`, `Deadlines`, `RESOLVE_PAUSE`, `format_duration`,
`identity_mismatch`, `backend_failure`, `as_domain_error`; `CallEngine(client, refs,
deadlines, machine, audit=, stats=, metrics=, on_fail=)` with `client`, `replace_client`,
`refs`, `ref`, `pin`, `replace`, `deadlines`, `phase`, `machine`, `last_failure`, `new_call`,
`deadline_of`, `send`, `check_reply`, `settle`, `call`, `blamed`, `acknowledge`, `probe`,
`resolve`, `move`, `fail`, `refuse_if_fenced`, `guarded`, `take_attachments`, `drop`,
`drop_received`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, NoReturn

from bus.client import BusClient
from bus.client_artifacts import Attachment
from bus.errors import BusError, CallDeadlineExceeded
from flyd.launch.identities import WorkerRef
from flyd.session.audit import AuditLog
from flyd.session.fence import Detail, SessionFailure, refuse_if_fenced
from flyd.session.phase import Failed, Phase, PhaseMachine
from flyd.session.stats import Metrics, ResolutionEnd, Stats
from workers.types.canonical import canonical
from workers.types.contract import method_validator
from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    PluginFault,
    PluginStage,
    Scope,
    format_request_id,
)
from workers.types.rpc import CallOutcome, Expired, Outcome, Refused, from_bus_error
from workers.types.structures import answer_typed

__all__ = [
    "RESOLVE_PAUSE",
    "Blame",
    "Call",
    "CallEngine",
    "Deadlines",
    "as_domain_error",
    "backend_failure",
    "format_duration",
    "identity_mismatch",
]

RESOLVE_PAUSE: Final = 0.002
#: methods whose results carry a world's media, possibly by reference (topics.md §14.2)
MEDIA_METHODS: Final = frozenset({"Environment.Initialize", "Environment.Advance",
                                  "State.ActivateRestore"})


@dataclass(frozen=True)
class Deadlines:
    """The coordinator's call deadlines in seconds (design/session.md §6.1): each call's initial
    deadline by kind, the resolution budget and attempt guard, and the wait for a durable
    capture."""

    probe: float = 2.0
    resolve: float = 8.0
    resolve_attempts: int = 8192
    boot: float = 30.0
    capture: float = 30.0
    durable: float = 60.0


def format_duration(seconds: float) -> str:
    """`8s`, `200ms`, `250us`, else `<n>ns` (design/session.md §6.8)."""
    ns = round(seconds * 1_000_000_000)
    if ns % 1_000_000_000 == 0:
        return f"{ns // 1_000_000_000}s"
    if ns % 1_000_000 == 0:
        return f"{ns // 1_000_000}ms"
    if ns % 1_000 == 0:
        return f"{ns // 1_000}us"
    return f"{ns}ns"


def identity_mismatch(message: str) -> DomainError:
    return DomainError(ErrorCode.IDENTITY_MISMATCH, message, Mutation.NONE)


def backend_failure(message: str) -> DomainError:
    return DomainError(ErrorCode.BACKEND_FAILURE, message, Mutation.UNKNOWN)


def as_domain_error(exc: Exception) -> DomainError:
    """A plugin's or flyd's exception as the `DomainError` it fails the epoch with; its type,
    message and last frames travel as a `PluginFault` (stage `call`, retried; the plugin is
    not named: the caller may be flyd's own code)."""
    if isinstance(exc, DomainError):
        return exc
    fault = PluginFault.of(exc, "", PluginStage.CALL)
    return DomainError(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", Mutation.UNKNOWN,
                       fault)


class Blame(Exception):
    """A failure inside a phase, with what failed and whom it blames (`guarded` fails the epoch
    with it)."""

    def __init__(self, error: DomainError, detail: str, participant: str | None) -> None:
        super().__init__(error, detail, participant)
        self.error = error
        self.detail = detail
        self.participant = participant


@dataclass
class Call:
    """One request as sent: the same id and body are re-sent by resolution and injections."""

    worker_id: str
    ref: WorkerRef
    method: str
    request_id: str
    scope: Scope | None
    params: dict[str, Any]
    #: artifacts the request carries (by-reference views, topics.md §14.2); the engine's
    #: client holds them, and never transfers them
    attachments: tuple[str, ...] = ()

    def payload(self) -> dict[str, Any]:
        return {"requestId": self.request_id,
                "scope": None if self.scope is None else self.scope.to_json(),
                "params": self.params}


class CallEngine:
    """A session's calls and its epoch's failures (the rules of the module docstring)."""

    def __init__(self, client: BusClient, refs: Mapping[str, WorkerRef], deadlines: Deadlines,
                 machine: PhaseMachine, *, audit: AuditLog, stats: Stats, metrics: Metrics,
                 on_fail: Callable[[], None]) -> None:
        self._client = client
        self._refs: dict[str, WorkerRef] = dict(refs)
        self._serials: dict[str, int] = dict.fromkeys(self._refs, 0)
        self.deadlines = deadlines
        self._machine = machine
        self._audit = audit
        self._stats = stats
        self._metrics = metrics
        self._on_fail = on_fail
        self.last_failure: SessionFailure | None = None
        #: held attachments of media results not yet taken, by (worker, request id)
        self._received: dict[tuple[str, str], tuple[Attachment, ...]] = {}

    # ------------------------------------------------------------------ participants

    @property
    def client(self) -> BusClient:
        return self._client

    def replace_client(self, client: BusClient) -> BusClient:
        """Send through `client` from now on; the client it replaces."""
        old, self._client = self._client, client
        return old

    @property
    def refs(self) -> Mapping[str, WorkerRef]:
        return self._refs

    def ref(self, worker_id: str) -> WorkerRef:
        return self._refs[worker_id]

    def pin(self, worker_id: str, incarnation_id: str) -> None:
        """Pin the domain incarnation a `Worker.Hello` returned."""
        self._refs[worker_id] = replace(self._refs[worker_id], domain_incarnation=incarnation_id)

    def replace(self, worker_id: str, ref: WorkerRef) -> None:
        """A replacement worker: its reference, and serials from 1 again."""
        self._refs[worker_id] = ref
        self._serials[worker_id] = 0

    # --------------------------------------------------------------- calls (design/session.md §6.4)

    def new_call(self, worker_id: str, method: str, scope: Scope | None,
                 params: dict[str, Any], ref: WorkerRef | None = None,
                 attachments: Sequence[str] = ()) -> Call:
        serials = self._serials
        serials[worker_id] = serials.get(worker_id, 0) + 1
        return Call(worker_id, ref or self._refs[worker_id], method,
                    format_request_id(serials[worker_id]), scope, params, tuple(attachments))

    def deadline_of(self, method: str) -> float:
        if method == "Worker.Hello" or method.endswith(".Initialize"):
            return self.deadlines.boot
        if method.startswith("State."):
            return self.deadlines.capture
        return self.deadlines.probe

    async def send(self, call: Call, timeout: float,  # noqa: ASYNC109
                   params: dict[str, Any] | None = None) -> CallOutcome:
        """One bus call of `call` (optionally with other params, same id); never raises for
        bus or deadline failures."""
        payload = call.payload()
        if params is not None:
            payload["params"] = params
        started = time.perf_counter()
        try:
            # the SDK's deadline bounds the whole call (its wait for write credit too), so no
            # guard of our own: that was a timer and a task cancel scope per call
            result = await self._client.call(
                call.ref.service, call.method, payload, timeout=timeout,
                expected_incarnation=call.ref.service_incarnation,
                attachments=call.attachments)
        except CallDeadlineExceeded:
            return Expired()
        except BusError as exc:
            return Refused(from_bus_error(call.method, exc))
        finally:
            self._metrics.observe(call.method, time.perf_counter() - started)
        if result.attachments:
            self._keep_received(call, result.attachments)
        return answer_typed(call.method, result.outcome)

    # ---------------------------------------------------------------- attachments (topics.md §14.2)

    def _keep_received(self, call: Call, attachments: tuple[Attachment, ...]) -> None:
        """The SDK holds a result's attachments; only a world's media results are kept for
        `take_attachments`, anything else is dropped at once (nobody would ever drop it)."""
        key = (call.worker_id, call.request_id)
        if call.method not in MEDIA_METHODS:
            self.drop([a.artifact_id for a in attachments])
            return
        previous = self._received.pop(key, ())
        self.drop([a.artifact_id for a in previous])
        self._received[key] = attachments

    def take_attachments(self, call: Call) -> tuple[Attachment, ...]:
        """The held attachments of `call`'s result; the caller drops them from now on."""
        return self._received.pop((call.worker_id, call.request_id), ())

    def drop(self, artifact_ids: Sequence[str]) -> None:
        """End the engine client's holds on `artifact_ids`, pipelined (never awaited)."""
        if artifact_ids:
            self._client.drop_nowait(list(artifact_ids))

    def drop_received(self) -> None:
        """Drop every attachment not taken (an epoch failure, a restore)."""
        received, self._received = self._received, {}
        self.drop([a.artifact_id for atts in received.values() for a in atts])

    def check_reply(self, call: Call, outcome: Outcome) -> dict[str, Any]:
        """Identity and echo checks (design/session.md §6.4); a domain error outcome is raised; the
        result is validated against the method's result schema."""
        method = call.method
        if outcome.worker_id != call.ref.worker_id:
            raise identity_mismatch(f"{method}: the reply names worker {outcome.worker_id}, "
                                    f"expected {call.ref.worker_id}")
        want_inc = call.ref.domain_incarnation
        if want_inc is not None and outcome.incarnation_id != want_inc:
            raise identity_mismatch(f"{method}: the reply comes from incarnation "
                                    f"{outcome.incarnation_id}, expected {want_inc}")
        if outcome.scope != call.scope:  # equal values, equal JSON: the text only to word it
            got_scope = None if outcome.scope is None else outcome.scope.to_json()
            want_scope = None if call.scope is None else call.scope.to_json()
            raise identity_mismatch(f"{method}: the reply echoes scope "
                                    f"{canonical(got_scope).decode()}, expected "
                                    f"{canonical(want_scope).decode()}")
        if outcome.request_id != call.request_id:
            raise identity_mismatch(f"{method}: the reply echoes request {outcome.request_id}, "
                                    f"expected {call.request_id}")
        if outcome.error is not None:
            raise outcome.error
        assert outcome.result is not None
        problem = None if outcome.checked else method_validator(method, "result")(outcome.result)
        if problem is not None:
            raise backend_failure(f"{method}: the result does not match its schema: {problem}")
        return outcome.result

    async def settle(self, call: Call, outcome: CallOutcome) -> dict[str, Any]:
        """The result of a sent call: check an answer, resolve an expiry, raise a refusal."""
        if isinstance(outcome, Refused):
            raise outcome.error
        if isinstance(outcome, Expired):
            return await self.resolve(call)
        return self.check_reply(call, outcome.outcome)

    async def call(self, call: Call) -> dict[str, Any]:
        return await self.settle(call, await self.send(call, self.deadline_of(call.method)))

    async def blamed(self, call: Call, detail: str | None = None) -> dict[str, Any]:
        """`call`, its `DomainError` blamed on the worker (detail: the method unless given)."""
        try:
            return await self.call(call)
        except DomainError as exc:
            raise Blame(exc, detail or call.method, call.worker_id) from None

    async def acknowledge(self, worker_id: str, ids: Sequence[str]) -> list[str]:
        """`Worker.Acknowledge` of `ids`: the ids the worker dropped (a subset of `ids`)."""
        call = self.new_call(worker_id, "Worker.Acknowledge", None, {"requestIds": list(ids)})
        result = await self.blamed(call)
        acknowledged = list(result.get("acknowledged", []))
        for rid in acknowledged:
            if rid not in ids:
                raise Blame(identity_mismatch(f"Worker.Acknowledge: {worker_id} acknowledged "
                                              f"{rid}, which it was never asked about"),
                            Detail.ACKNOWLEDGE, worker_id)
        return acknowledged

    async def status(self, worker_id: str, scope: Scope | None,
                     ref: WorkerRef | None = None) -> dict[str, Any]:
        """`Worker.Status` at `scope` through the full `check_reply`; any failure fails the
        epoch (`guarded`)."""
        call = self.new_call(worker_id, "Worker.Status", scope, {}, ref)
        result: dict[str, Any] = await self.guarded(lambda: self.blamed(call))
        return result

    async def probe(self, worker_id: str, method: str, scope: Scope | None,
                    params: dict[str, Any], ref: WorkerRef | None = None) -> dict[str, Any]:
        """One request with a fresh serial, its outcome's shape checked only (no identity
        checks): the result, or its `DomainError` raised (an expiry after `probe` is
        `BACKEND_FAILURE`/`unknown`)."""
        call = self.new_call(worker_id, method, scope, params, ref)
        outcome = await self.send(call, self.deadlines.probe)
        if isinstance(outcome, Expired):
            raise backend_failure(f"{method}: {worker_id} did not answer within "
                                  f"{format_duration(self.deadlines.probe)}")
        if isinstance(outcome, Refused):
            raise outcome.error
        if outcome.outcome.error is not None:
            raise outcome.outcome.error
        assert outcome.outcome.result is not None
        return outcome.outcome.result

    # ---------------------------------------------------------- resolution (design/session.md §6.8)

    async def resolve(self, call: Call) -> dict[str, Any]:
        """Re-send the same request until it answers, or fail with the bound that ran out.
        Raises a DomainError (the caller blames the worker)."""
        d = self.deadlines
        stats = self._stats
        stats.resolutions += 1
        stats.last_resolution = None
        stats.last_resolution_attempts = 0
        self._audit.add(f"resolve:{call.worker_id}:{call.method}")
        started = time.monotonic()
        end = ResolutionEnd.ATTEMPTS_EXHAUSTED
        for _ in range(d.resolve_attempts):
            if time.monotonic() - started >= d.resolve:
                end = ResolutionEnd.BUDGET_EXPIRED
                break
            stats.last_resolution_attempts += 1
            outcome = await self.send(call, d.probe)
            if isinstance(outcome, Expired):
                await asyncio.sleep(RESOLVE_PAUSE)
                continue
            if isinstance(outcome, Refused):
                raise DomainError(outcome.error.code, outcome.error.message, Mutation.UNKNOWN)
            try:
                result = self.check_reply(call, outcome.outcome)
            except DomainError as exc:
                if exc.code == ErrorCode.IN_PROGRESS:
                    stats.in_progress_replies += 1
                    await asyncio.sleep(RESOLVE_PAUSE)
                    continue
                raise
            stats.last_resolution = ResolutionEnd.ANSWERED
            return result
        stats.last_resolution = end
        if end is ResolutionEnd.BUDGET_EXPIRED:
            why, bound = "its resolution budget", format_duration(d.resolve)
        else:
            why, bound = "its resolution attempt guard", f"{d.resolve_attempts} attempts"
        raise backend_failure(f"{call.method}: {call.worker_id} never resolved; {why} of "
                              f"{bound} ran out and the operation's outcome is unknown")

    # ----------------------------------------------------------- the fence (design/session.md §6.3)

    @property
    def machine(self) -> PhaseMachine:
        return self._machine

    @property
    def phase(self) -> Phase:
        return self._machine.phase

    def fail(self, error: DomainError, detail: str, participant: str | None = None) -> NoReturn:
        machine = self._machine
        phase_label = machine.phase.label
        if not isinstance(machine.phase, Failed):
            machine.fail()
        self._on_fail()
        failure = SessionFailure(error, phase_label, detail, participant)
        self._audit.add(failure.audit_entry)
        self.last_failure = failure
        raise failure

    def move(self, target: Phase, detail: str) -> None:
        try:
            self._machine.move(target)
        except DomainError as exc:
            self.fail(exc, detail)

    def refuse_if_fenced(self) -> None:
        refuse_if_fenced(self._machine)

    async def guarded(self, body: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await body()
        except Blame as blame:
            detail = blame.detail
            if self._client.closed and blame.error.code == ErrorCode.BACKEND_FAILURE:
                detail = Detail.ROUTER  # the coordinator's own connection was lost
            self.fail(blame.error, detail, blame.participant)
        except SessionFailure:
            raise
        except Exception as exc:  # a flyd or plugin bug must still fence the epoch
            self.fail(as_domain_error(exc), Detail.STEP)
        except asyncio.CancelledError:
            # a step abandoned half-way leaves the workers' state unknown: fence, then go on
            # being cancelled
            machine = self._machine
            if not machine.fenced and not machine.is_committed_boundary():
                with contextlib.suppress(SessionFailure):
                    self.fail(backend_failure("the operation was cancelled half-way"),
                              Detail.STEP)
            raise
