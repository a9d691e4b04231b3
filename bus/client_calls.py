"""The client's calls (design/wire.md §17): each call's record from its `bus.call` to its one
terminal outcome, the deadline on the caller's monotonic clock, and the result credits calls carry.

At a deadline the SDK cancels and reports the certainty the cancel proved. Against a router of
minor >= 1 (design/wire.md §21) `call()` uses the lean notification form, and credits ride inside
it: a call carries the result deliveries consumed since the last one; result credits no call took
within CREDIT_DELAY_S leave in one `bus.consumed` notification (design/wire.md §21.6).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any, Final

import orjson

from bus import codec
from bus.client_artifacts import Artifacts, Attachment, AttachmentRef, artifact_ids
from bus.client_connection import Connection, Validators, settle
from bus.client_identity import Identities, Identity
from bus.client_serving import REFUSAL_KEY
from bus.errors import (
    AttachmentsNotKept,
    BusError,
    CallDeadlineExceeded,
    CallGone,
    InvalidEnvelope,
    InvalidParams,
    QuotaExceeded,
    RouterLost,
    from_wire,
)
from bus.limits import MAX_CONSUME_BATCH

CANCEL_WAIT_S: Final = 0.5
# result credits wait this long for a call to carry them (design/wire.md §21.6)
CREDIT_DELAY_S: Final = 0.005
# A credit window with less than this left when its timer fires is due now, not re-armed.
CREDIT_SLACK_S: Final = 0.0005

_CERTAINTY: Final = {
    "cancelled-before-dispatch": "not-dispatched",
    "execution-unknown": "dispatched",
}


@dataclass(frozen=True, slots=True)
class CallResult:
    call_id: int
    service_incarnation: str
    responder: Identity
    outcome: dict[str, Any]
    attachments: tuple[Attachment, ...] = ()
    frame: bytes = field(default=b"", repr=False, compare=False)  # the bus.result frame

    @property
    def outcome_bytes(self) -> bytes:
        """The outcome as the responder wrote it (design/wire.md §22.1; against a router of minor
        < 3, as that router re-encoded it), found in the frame on each use."""
        found = codec.body_bytes(self.frame, "outcome")
        return found if found is not None else codec.encode(self.outcome)


class CallState:
    """SDK-side record of one bus.call: admission, then exactly one terminal outcome.

    `admitted` exists only for a request-form call (`start_call` awaits the admission); a
    lean call has no admission response to wait for."""

    __slots__ = ("admitted", "call_id", "done", "keep", "service_incarnation")

    def __init__(self, loop: asyncio.AbstractEventLoop, call_id: int, admission: bool) -> None:
        self.call_id = call_id
        self.admitted: asyncio.Future[str] | None = None
        if admission:
            self.admitted = loop.create_future()
        self.done: asyncio.Future[CallResult] = loop.create_future()
        self.service_incarnation: str | None = None
        self.keep = True  # retain a result's attachments (topics.md §12)


class _DeadlineReached(Exception):
    """Set on a call's `done` future when its deadline passes (the outcome moves on to a
    fresh future that `_deadline` reads)."""


def _deliver(state: CallState, exc: BaseException | None = None, value: Any = None) -> None:
    """Settle a call's outcome. `call()` awaits `done` directly (no shield: one wake-up
    fewer), so a task cancellation may have cancelled it; the outcome then goes to a fresh
    future that `_deadline` reads."""
    if state.done.cancelled():
        state.done = asyncio.get_running_loop().create_future()
    settle(state.done, exc, value)


def _expire(state: CallState) -> None:
    """A `call()` deadline: wake the caller with _DeadlineReached; a later outcome goes to a
    fresh future."""
    done = state.done
    if not done.done():
        state.done = done.get_loop().create_future()
        done.set_exception(_DeadlineReached())


def _payload_bytes(payload: bytes) -> bytes:
    """A payload given as wire bytes (a retry resends what it sent, design/wire.md §22.3). They get
    the router's check, one well-formed JSON object, else InvalidEnvelope and nothing is sent;
    design/wire.md §3's strictness inside them is the receiver's to check, as for any forwarded
    body."""
    problem = codec.body_problem(payload) if payload[:1] == b"{" else "not a JSON object"
    if problem is not None:
        raise InvalidEnvelope(f"payload: {problem}", "not-dispatched")
    return payload


class PendingCall:
    """An admitted call (`start_call`): await `result()`, or `cancel()` it."""

    def __init__(self, calls: Calls, state: CallState) -> None:
        self._calls = calls
        self._state = state
        self.call_id = state.call_id
        self.service_incarnation: str = state.service_incarnation or ""
        self.cancel_state: str | None = None

    async def result(self) -> CallResult:
        """Wait for the outcome (no deadline; abandoning the wait does not cancel)."""
        return await asyncio.shield(self._state.done)

    async def cancel(self) -> str:
        """`bus.cancel`; afterwards `result()` raises CallGone unless the state is completed."""
        if self._state.done.done():
            self.cancel_state = "completed" if not self._state.done.exception() else "call-gone"
            return self.cancel_state
        self.cancel_state = await self._calls.cancel(self._state)
        return self.cancel_state

    async def __aenter__(self) -> PendingCall:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._state.done.done() and not self._calls.closed:
            with contextlib.suppress(BusError):
                await self.cancel()


class Calls:
    """The calls of one connection: `bus.call` out, `bus.result` and `bus.callFailed` in."""

    def __init__(self, connection: Connection, artifacts: Artifacts,
                 identities: Identities) -> None:
        self._conn = connection
        self._artifacts = artifacts
        self._identities = identities
        self._calls: dict[int, CallState] = {}
        self._credits: list[str] = []  # result credits waiting for a call to carry them
        self._credit_timer: asyncio.TimerHandle | None = None
        self._last_credit = 0.0
        connection.on("bus.result", self._on_result)
        connection.on("bus.callFailed", self._on_call_failed)
        connection.on_lost(self._lost)

    @property
    def closed(self) -> bool:
        return self._conn.closed

    async def start_call(self, target: str, method: str, payload: dict[str, Any] | bytes, *,
                         expected_incarnation: str | None = None) -> PendingCall:
        drained = self._conn.drained
        if drained is not None:
            await drained
        state = self._admit(target, method, payload, expected_incarnation)
        assert state.admitted is not None
        await state.admitted
        return PendingCall(self, state)

    async def call(self, target: str, method: str, payload: dict[str, Any] | bytes, *,
                   timeout: float | None,  # noqa: ASYNC109 - the SDK contract (design/wire.md §17)
                   expected_incarnation: str | None = None,
                   attachments: tuple[AttachmentRef, ...] = (), transfer: bool = False,
                   keep_attachments: bool = True) -> CallResult:
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be > 0 seconds, or None")
        loop = self._conn.loop
        deadline = None if timeout is None else loop.time() + timeout
        drained = self._conn.drained
        if drained is not None:
            await self._drain_until(drained, deadline)
        state = self._admit(target, method, payload, expected_incarnation,
                            lean=self._conn.lean, attachments=tuple(artifact_ids(attachments)),
                            transfer=transfer, keep=keep_attachments)
        # One plain loop timer, not asyncio.timeout: that one also cancels and uncancels the
        # task and, on Python 3.11, calls getpid() through get_running_loop() on every call.
        timer = None if deadline is None else loop.call_at(deadline, _expire, state)
        try:
            # `done` also settles on a refused admission: not waking up for the
            # admission response saves a task step per call
            return await state.done
        except _DeadlineReached:
            return await self._deadline(state)
        except asyncio.CancelledError:
            finished = state.done.done() and not state.done.cancelled()
            if not finished and not self._conn.closed:
                fut = self._conn.send_nowait("bus.cancel", {"callId": state.call_id})
                fut.add_done_callback(lambda f: self._task_cancel_answered(state, f))
            raise
        finally:
            if timer is not None:
                timer.cancel()

    async def cancel(self, state: CallState) -> str:
        """`bus.cancel` for an admitted call; a call not completed ends CallGone."""
        res = await self._conn.command("bus.cancel", {"callId": state.call_id},
                                       wait_drain=False)
        cancel_state: str = res["state"]
        if cancel_state != "completed":
            self._finish_cancelled(state, cancel_state)
        return cancel_state

    def _encode_call(self, rid: int, target: str, method: str, payload: dict[str, Any] | bytes,
                     expected_incarnation: str | None, lean: bool,
                     attachments: tuple[str, ...] = (), transfer: bool = False) -> bytes:
        """A `bus.call` frame, the notification form when `lean` (its callId is `rid`);
        a lean router also takes the pending result credits with it (design/wire.md §21.3).

        Only the payload needs the strict encoder's value checks: the envelope around it is
        strings, ints and maybe a null, and the strict encoder would walk the whole value
        again just because that null might be a NaN."""
        params: dict[str, Any] = {"target": target, "expectedIncarnation": expected_incarnation,
                                  "method": method}
        if lean:
            params["callId"] = rid
        if attachments:
            params["attachments"] = artifact_ids(attachments)
            params["transfer"] = transfer
        credits = self._credits[:MAX_CONSUME_BATCH] if self._conn.lean else None
        if credits:
            params["consumed"] = credits
        # last: the router's split (design/wire.md §22.1); given bytes are sent as they are
        params["payload"] = orjson.Fragment(_payload_bytes(payload)) \
            if isinstance(payload, bytes) else payload
        msg: dict[str, Any] = ({"jsonrpc": "2.0", "method": "bus.call", "params": params} if lean
                               else {"jsonrpc": "2.0", "id": rid, "method": "bus.call",
                                     "params": params})
        if type(target) is not str or type(method) is not str or not (
                expected_incarnation is None or type(expected_incarnation) is str):
            body = codec.encode(msg, self._conn.max_envelope)
        else:
            if not isinstance(payload, bytes):
                params["payload"] = orjson.Fragment(codec.encode(payload))
            body = codec.encode_trusted(msg, self._conn.max_envelope)
        if credits:  # they leave with this frame
            del self._credits[:len(credits)]
        return body

    def _admit(self, target: str, method: str, payload: dict[str, Any] | bytes,
               expected_incarnation: str | None, *, lean: bool = False,
               attachments: tuple[str, ...] = (), transfer: bool = False,
               keep: bool = True) -> CallState:
        """Send a `bus.call`: the request form (an admission response follows), or with
        `lean` the notification form, whose only answer is the outcome (design/wire.md §21.2)."""
        conn = self._conn
        conn.check_open()
        rid = conn.next_id
        body = self._encode_call(rid, target, method, payload, expected_incarnation, lean,
                                 attachments, transfer)
        state = CallState(conn.loop, rid, not lean)
        state.keep = keep
        self._calls[rid] = state
        if lean:
            conn.send_numbered(rid, body)
        else:
            fut = conn.send_request(rid, "bus.call", body, lambda r: self._admitted(state, r))
            fut.add_done_callback(lambda f: self._admission_failed(state, f))
        return state

    def _admitted(self, state: CallState, result: dict[str, Any]) -> None:
        if self._calls.get(state.call_id) is state:
            state.service_incarnation = result["serviceIncarnation"]
            settle(state.admitted, value=result["serviceIncarnation"])

    def _admission_failed(self, state: CallState, fut: asyncio.Future[dict[str, Any]]) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:
            self._calls.pop(state.call_id, None)
            settle(state.admitted, exc)
            _deliver(state, exc)

    async def _drain_until(self, drained: asyncio.Future[None], deadline: float | None) -> None:
        """Wait for write credit until the call's deadline. Nothing of the call was sent, so
        a deadline here is certainly `not-dispatched`. `drained` is shared by every waiter and
        is never cancelled by one."""
        if deadline is None:
            await drained
            return
        await asyncio.wait((drained,), timeout=max(0.0, deadline - self._conn.loop.time()))
        if not drained.done():
            raise CallDeadlineExceeded("deadline while waiting for write credit; nothing was "
                                       "sent", "not-dispatched")
        drained.result()  # a lost connection raises its RouterLost

    async def _deadline(self, state: CallState) -> CallResult:
        if state.done.cancelled():
            state.done = self._conn.loop.create_future()
        elif state.done.done():
            return state.done.result()
        self._conn.check_open()
        fut = self._conn.send_nowait("bus.cancel", {"callId": state.call_id})
        try:
            async with asyncio.timeout(CANCEL_WAIT_S):
                cancel_state: str = (await fut)["state"]
        except (TimeoutError, BusError):
            self._calls.pop(state.call_id, None)
            raise CallDeadlineExceeded(f"call {state.call_id}: deadline; no cancel answer",
                                       "unknown") from None
        if cancel_state == "completed":
            return await asyncio.shield(state.done)
        if cancel_state == "call-gone" and state.done.done():
            return state.done.result()
        self._calls.pop(state.call_id, None)
        dispatch = _CERTAINTY.get(cancel_state, "unknown")
        exc = CallDeadlineExceeded(f"call {state.call_id}: deadline ({cancel_state})",
                                   dispatch, cancel_state)  # type: ignore[arg-type]
        settle(state.done, exc)
        raise exc

    def _finish_cancelled(self, state: CallState, cancel_state: str) -> None:
        self._calls.pop(state.call_id, None)
        dispatch = _CERTAINTY.get(cancel_state, "unknown")
        settle(state.done, CallGone(f"call {state.call_id} cancelled ({cancel_state})",
                                    dispatch))  # type: ignore[arg-type]

    def _task_cancel_answered(self, state: CallState,
                              fut: asyncio.Future[dict[str, Any]]) -> None:
        """A cancelled `call()` task's best-effort cancel was answered: forget the call
        unless its result is still due (`completed`; the result is consumed on arrival)."""
        if fut.cancelled() or fut.exception() is not None:
            return
        cancel_state: str = fut.result()["state"]
        if cancel_state != "completed":
            self._finish_cancelled(state, cancel_state)

    # inbound --------------------------------------------------------------------------------
    def _on_result(self, params: dict[str, Any], frame: bytes, bad: str | None) -> None:
        state = self._calls.pop(params["callId"], None)
        if state is not None:
            self._result(state, params, frame, bad)
        # queued after the wake-up: the credit leaves with the caller's next request
        self._queue_result_credit(params["deliveryId"])

    def _result(self, state: CallState, params: dict[str, Any], frame: bytes,
                bad: str | None) -> None:
        """A call's `bus.result`. An outcome that breaks design/wire.md §3 (design/wire.md §22.3)
        fails the call INVALID_PARAMS, `dispatched` (a handler saw the request); a service SDK's
        refusal (`{"bus.error": ...}`) is raised as that error."""
        if bad is not None:
            _deliver(state, InvalidParams(f"call {state.call_id}: the outcome is malformed: "
                                          f"{bad}", "dispatched"))
            return
        outcome = params["outcome"]
        if len(outcome) == 1 and REFUSAL_KEY in outcome:
            error = outcome[REFUSAL_KEY]
            if Validators.get().error(error) is None:
                _deliver(state, from_wire(error))
                return
        result = CallResult(params["callId"], params["serviceIncarnation"],
                            self._identities.get(params["responder"]), outcome,
                            self._artifacts.attachments(params), frame)
        if result.attachments and state.keep:
            self._keep(state, result)  # the retain leaves before the credit
        else:
            _deliver(state, value=result)

    def _keep(self, state: CallState, result: CallResult) -> None:
        """topics.md §12: retain a result's attachments before its credit leaves (the
        router handles our frames in order, so the hold exists before the delivery goes)."""
        fut = self._conn.send_nowait(
            "bus.retain", {"artifactIds": [a.artifact_id for a in result.attachments]})

        def kept(f: asyncio.Future[dict[str, Any]]) -> None:
            exc = None if f.cancelled() else f.exception()
            if exc is None:
                _deliver(state, value=result)
            elif isinstance(exc, QuotaExceeded):
                _deliver(state, AttachmentsNotKept(
                    f"the result's attachments were not kept: {exc.message}", result))
            else:
                _deliver(state, exc)

        fut.add_done_callback(kept)

    def _on_call_failed(self, params: dict[str, Any], _frame: bytes, _bad: str | None) -> None:
        state = self._calls.pop(params["callId"], None)
        if state is not None:
            err = from_wire(params["error"])
            settle(state.admitted, err)
            _deliver(state, err)

    # result credits (design/wire.md §21.6) --------------------------------------------------------
    def _queue_result_credit(self, delivery_id: str) -> None:
        """A consumed `bus.result`. A lean router takes it inside the next `bus.call`; if
        none leaves within CREDIT_DELAY_S of the last result, or MAX_CONSUME_BATCH credits
        are waiting, they go in one `bus.consumed`. One timer serves the whole window, not
        one per result."""
        if not self._conn.lean:
            self._conn.return_credit(delivery_id)
            return
        credits = self._credits
        credits.append(delivery_id)
        if len(credits) >= MAX_CONSUME_BATCH:
            self._release_credits()
            return
        self._last_credit = self._conn.loop.time()
        if self._credit_timer is None:
            self._credit_timer = self._conn.loop.call_later(CREDIT_DELAY_S, self._credits_due)

    def _credits_due(self) -> None:
        self._credit_timer = None
        if not self._credits or self._conn.closed:
            return
        left = self._last_credit + CREDIT_DELAY_S - self._conn.loop.time()
        if left > CREDIT_SLACK_S:
            self._credit_timer = self._conn.loop.call_later(left, self._credits_due)
            return
        self._release_credits()

    def _release_credits(self) -> None:
        self._conn.return_credit(*self._credits)
        self._credits.clear()

    def _lost(self, failure: RouterLost) -> None:
        for state in self._calls.values():
            settle(state.admitted, RouterLost(failure.message))
            settle(state.done, RouterLost(failure.message))
        self._calls.clear()
        if self._credit_timer is not None:
            self._credit_timer.cancel()
            self._credit_timer = None
