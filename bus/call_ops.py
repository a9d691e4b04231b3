"""The calls' side of the router (design/wire.md §7.3–§7.7, §9, §10, §21): the call ops and the RPC
lane.

A call's phases and the books they keep (slots, counts, queued bytes) are `bus/call_phases.py`'s
pure edge table; this module decides when a call moves and does the notices that follow, and a
move off the table is a broken invariant (design/wire.md §11).

Frames are built once: a `bus.request` or `bus.result` is encoded at admission (or reply) with
the longest possible delivery id, which both proves the worst-case size fits and gives the
bytes to send; at dispatch only that first id is rewritten (`take_result`, `dispatch`).

Since minor 1 (design/wire.md §21) `bus.call`, `bus.reply` and `bus.consumed` may also arrive as
notifications: they run the same checks and state changes as the requests, answer nothing on
success and report a refusal as one `bus.callFailed` or `bus.replyFailed` (or close, when the
frame names nothing that could be answered), so a routed call costs four frames.

Attachments are checked at admission like any other member and root their artifacts under the
call (keyed with REQUEST or RESULT), so the hot path of a frame without attachments is the
minor-1 one.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Final

import orjson

from bus import limits
from bus.artifact_ops import ArtifactOps
from bus.call_phases import Call, CallPhase, Delivery, Ledger, Service
from bus.connection import Conn
from bus.errors import (
    Backpressure,
    BusError,
    CallGone,
    Dispatch,
    InvalidEnvelope,
    InvalidParams,
    NoService,
    NotAuthorized,
    TargetChanged,
    error_object,
)
from bus.framing import PREFIX
from bus.inbound import Inbound, serial_of
from bus.limits import LONGEST_DELIVERY_ID, Limits
from bus.outbound import Outbound
from bus.policy import any_matches
from bus.registry import Registry
from bus.schema import Validator
from bus.topic_ops import TopicOps

MAX_DLV: Final = orjson.dumps(LONGEST_DELIVERY_ID)
GRANT_CACHE: Final = 1024  # call-grant answers remembered per connection
#: frame-root keys of a call's request and of its result (topics.md §5.2 rule 2)
REQUEST: Final = 0
RESULT: Final = 1


class CallOps:
    """Admission, replies, releases, cancels and credits, and the RPC lane's writer side."""

    def __init__(self, lim: Limits, out: Outbound, inbound: Inbound, registry: Registry,
                 arts: ArtifactOps, topics: TopicOps, params: dict[str, Validator]) -> None:
        self.limits = lim
        self.ledger: Ledger[Conn] = Ledger()
        self._out = out
        self._in = inbound
        self._registry = registry
        self._arts = arts
        self._topics = topics
        self._call_params = params["bus.call"]
        self._reply_params = params["bus.reply"]
        self._consumed_params = params["bus.consumed"]

    # admission (design/wire.md §7.3) --------------------------------------------------------------
    def op_call(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        if "callId" in p:
            raise InvalidParams("bus.call: callId belongs to the notification form "
                                "(design/wire.md §21.2)")
        return self._admit(conn, p, rid)

    def lean_call(self, conn: Conn, p: dict[str, Any]) -> None:
        """design/wire.md §21.2: the callId takes the place of the id (check 4); a refusal is one
        `bus.callFailed`, success sends nothing."""
        call_id = self._in.next_id(conn, p.get("callId"), "callId",
                                   "a bus.call notification needs a callId, an integer in "
                                   "1..2^53-1")
        if call_id is None:
            return
        if self._in.before_hello(conn):
            return
        out = self._out
        counters = out.counters
        counters["leanCalls"] += 1
        problem = self._call_params(p) or self._in.body_refused()
        try:
            if problem is not None:
                raise InvalidParams(f"bus.call: {problem}")
            self._admit(conn, p, call_id)
        except BusError as exc:
            if problem is None:  # as in the request form, bad params are not a refused call
                counters["callsRefused"] += 1
            out.count_error(exc.name)
            target = p.get("target")
            svc = self._registry.services.get(target) if type(target) is str else None
            out.notice(conn, "bus.callFailed", {
                "callId": call_id,
                "serviceIncarnation": None if svc is None else svc.incarnation,
                "error": error_object(exc.name, exc.message, "not-dispatched"),
            })

    def _admit(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        """design/wire.md §7.3 checks and admission, after the credits the call carries
        (design/wire.md §21.3)."""
        counters = self._out.counters
        consumed = p.get("consumed")
        if consumed:
            counters["creditsCarried"] += self._release(conn, consumed)
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
        svc = self._registry.services.get(target)
        if svc is None:
            raise NoService(f"no service registered under {target}")
        expected = p["expectedIncarnation"]
        if expected is not None and expected != svc.incarnation:
            raise TargetChanged(f"{target} is now {svc.incarnation}, not {expected}")
        ids = p.get("attachments")
        arts = self._arts.attachable(conn, ids) if ids else ()
        if len(svc.queue) >= svc.max_queued:
            raise Backpressure(f"service {target} queue full ({svc.max_queued})")
        payload, raw = self._in.body_bytes(p, "payload")
        size = len(payload)
        if self.ledger.queued_bytes + size > lim.maxQueuedCallBytes:
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
        # last: the receiver's split (design/wire.md §22.1)
        params["payload"] = orjson.Fragment(payload)
        frame = orjson.dumps({"jsonrpc": "2.0", "method": "bus.request", "params": params})
        if len(frame) > lim.maxEnvelopeBytes:
            raise InvalidEnvelope(
                f"the bus.request frame would be {len(frame)} bytes (maxEnvelopeBytes "
                f"{lim.maxEnvelopeBytes})"
            )
        call = Call(conn, rid, svc, frame, size)
        self.ledger.admit(call)
        if arts:
            self._arts.ledger.root((call, REQUEST), arts)
            if p.get("transfer"):
                self._arts.collect(self._arts.ledger.transfer(conn, arts))
        counters["callsAdmitted"] += 1
        if raw:
            counters["bodiesForwardedRaw"] += 1
        self._out.mark(svc.owner)
        return {"callId": rid, "serviceIncarnation": svc.incarnation}

    # replies and releases (design/wire.md §7.4, §7.5) ---------------------------------------------
    def lean_reply(self, conn: Conn, p: dict[str, Any]) -> None:
        """design/wire.md §21.4: a deliveryId that cannot be answered closes; a refusal of one that
        can is one `bus.replyFailed`; success sends nothing."""
        if self._in.before_hello(conn):
            return
        out = self._out
        delivery_id = p.get("deliveryId")
        serial = serial_of(delivery_id)
        if serial is None or serial > conn.dlv:
            out.close(conn, "INVALID_REQUEST", "a bus.reply notification needs a deliveryId "
                      "issued on this connection")
            return
        out.counters["leanReplies"] += 1
        problem = self._reply_params(p) or self._in.body_refused()
        try:
            if problem is not None:
                raise InvalidParams(f"bus.reply: {problem}")
            self.op_reply(conn, p, 0)
        except BusError as exc:
            out.count_error(exc.name)
            out.notice(conn, "bus.replyFailed", {
                "deliveryId": delivery_id,
                "error": error_object(exc.name, exc.message, "not-dispatched"),
            })

    def _request_delivery(self, conn: Conn, delivery_id: str) -> Delivery[Conn] | None:
        serial = int(delivery_id[4:])
        if serial > conn.dlv:
            raise InvalidParams(f"{delivery_id} was never issued on this connection")
        d = conn.deliveries.get(serial)
        if d is None or not d.is_request or not d.capability:
            return None
        return d

    def op_reply(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        d = self._request_delivery(conn, p["deliveryId"])
        if d is None:
            raise CallGone(f"{p['deliveryId']} holds no reply capability")
        call = d.call
        ids = p.get("attachments")
        arts_ops = self._arts
        arts = arts_ops.attachable(conn, ids) if ids else ()
        outcome, raw = self._in.body_bytes(p, "outcome")
        frame = limits.result_frame(call.call_id, call.service.incarnation, conn.identity,
                                    orjson.Fragment(outcome),
                                    [a.wire() for a in arts] if arts else None)
        if len(frame) > self.limits.maxEnvelopeBytes:
            raise InvalidEnvelope(
                f"the bus.result frame would be {len(frame)} bytes (maxEnvelopeBytes "
                f"{self.limits.maxEnvelopeBytes}); the reply capability is kept"
            )
        counters = self._out.counters
        d.capability = False
        conn.capabilities -= 1
        if p.get("consumed") is True and not d.consumed:
            d.consumed = True
            counters["creditsCarried"] += 1
            arts_ops.unsee(conn, (call, REQUEST))
        if d.consumed:
            self._free_request(conn, d)
        if call.phase is CallPhase.DETACHED:
            counters["repliesUnrouted"] += 1
            self.ledger.move(call, CallPhase.GONE)
            if arts and p.get("transfer"):  # the reply roots nothing (topics.md §6.3)
                arts_ops.collect(arts_ops.ledger.transfer(conn, arts))
            return {"routed": False}
        if arts:
            arts_ops.ledger.root((call, RESULT), arts)
            if p.get("transfer"):
                arts_ops.collect(arts_ops.ledger.transfer(conn, arts))
        self.ledger.move(call, CallPhase.REPLIED)
        call.frame = frame
        call.caller.results.append(call)
        self._out.mark(call.caller)
        counters["repliesRouted"] += 1
        if raw:
            counters["bodiesForwardedRaw"] += 1
        if p.get("inline") is True:
            counters["inlineReplies"] += 1
        return {"routed": True}

    def op_release(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
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
        self.ledger.move(call, CallPhase.GONE)
        return {"released": True}

    def op_cancel(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        call_id: int = p["callId"]
        if call_id >= rid:
            raise InvalidParams(f"callId {call_id} is not an earlier request of this connection")
        call = conn.calls.get(call_id)
        if call is None or call.phase is CallPhase.DETACHED:
            state = "call-gone"
        elif call.phase is CallPhase.QUEUED:
            call.service.queue.remove(call)
            self.ledger.move(call, CallPhase.GONE)
            self._arts.unroot((call, REQUEST))
            state = "cancelled-before-dispatch"
        elif call.phase is CallPhase.DISPATCHED:
            self.ledger.move(call, CallPhase.DETACHED)
            state = "execution-unknown"
        else:
            state = "completed"
        self._out.counters["cancels"][state] += 1
        return {"state": state}

    # credits (design/wire.md §7.7) ----------------------------------------------------------------
    def op_consumed(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        return {"released": self._release(conn, p["deliveryIds"])}

    def lean_consumed(self, conn: Conn, p: dict[str, Any]) -> None:
        """design/wire.md §21.5: nothing to answer, so anything wrong closes and releases
        nothing."""
        if self._in.before_hello(conn):
            return
        problem = self._consumed_params(p)
        if problem is not None:
            self._out.close(conn, "INVALID_REQUEST", f"bus.consumed notification: {problem}")
            return
        try:
            self._release(conn, p["deliveryIds"])
        except InvalidParams as exc:
            self._out.close(conn, "INVALID_REQUEST", exc.message)
            return
        self._out.counters["leanConsumed"] += 1

    def _release(self, conn: Conn, ids: list[str]) -> int:
        """design/wire.md §7.7: all ids issued or nothing released (InvalidParams); returns how many
        live deliveries were newly released."""
        serials = [int(d[4:]) for d in ids]
        for d_id, serial in zip(ids, serials, strict=True):
            if serial > conn.dlv:
                raise InvalidParams(f"{d_id} was never issued on this connection")
        released = 0
        arts = self._arts
        for serial in serials:
            d = conn.deliveries.get(serial)
            if d is None:
                if conn.messages:
                    released += self._topics.release_message(conn, serial)
                continue
            if d.consumed:
                continue
            released += 1
            if d.is_request:
                d.consumed = True
                arts.unsee(conn, (d.call, REQUEST))
                if not d.capability:
                    self._free_request(conn, d)
            else:
                del conn.deliveries[serial]
                self.ledger.move(d.call, CallPhase.GONE)
                arts.unsee(conn, (d.call, RESULT))
        return released

    def _free_request(self, conn: Conn, delivery: Delivery[Conn]) -> None:
        """Consumed and answered: the in-flight slot returns and dispatch may continue."""
        del conn.deliveries[delivery.serial]
        conn.open_requests -= 1
        delivery.call.service.in_flight -= 1
        self._out.mark(conn)

    def _call_failed(self, call: Call[Conn], name: str, message: str, dispatch: Dispatch) -> None:
        out = self._out
        out.counters["callsFailed"] += 1
        out.count_error(name)
        out.notice(call.caller, "bus.callFailed", {
            "callId": call.call_id,
            "serviceIncarnation": call.service.incarnation,
            "error": error_object(name, message, dispatch),
        })

    # routes (design/wire.md §7.2, §10.1) ----------------------------------------------------------
    def op_unregister(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        svc = self._registry.services.get(p["name"])
        if svc is None or svc.owner is not conn or svc.incarnation != p["serviceIncarnation"]:
            return {"removed": False}
        self.remove_route(svc, "unregistered")
        return {"removed": True}

    def remove_route(self, svc: Service[Conn], reason: str) -> None:
        """design/wire.md §10.1: free the name, tell attached callers, fail the Queued calls."""
        if not self._registry.remove(svc):
            return
        affected: dict[int, Conn] = {}
        for call in svc.queue:
            affected[call.caller.number] = call.caller
        for delivery in svc.owner.deliveries.values():
            call = delivery.call
            if (delivery.is_request and delivery.capability
                    and call.phase is CallPhase.DISPATCHED and call.service is svc):
                affected[call.caller.number] = call.caller
        notice = {"name": svc.name, "serviceIncarnation": svc.incarnation, "reason": reason}
        for caller in affected.values():
            self._out.notice(caller, "bus.routeRemoved", notice)
        queue, svc.queue = svc.queue, deque()
        for call in queue:
            self._call_failed(call, "NO_SERVICE", f"service {svc.name} was {reason} "
                              "before the call was dispatched", "not-dispatched")
            self.ledger.move(call, CallPhase.GONE)
            self._arts.unroot((call, REQUEST))

    # the RPC lane (design/wire.md §9.2, §14.2) ----------------------------------------------------
    def take_result(self, conn: Conn) -> bytes:
        """The next `bus.result` of the connection's results lane, now a delivery of it."""
        call = conn.results.popleft()
        conn.dlv += 1
        serial = conn.dlv
        conn.deliveries[serial] = Delivery(serial, call, False)
        ledger = self._arts.ledger
        if ledger.frames:
            ledger.see(conn, ledger.rooted((call, RESULT)))
        return call.frame.replace(MAX_DLV, b'"dlv-%d"' % serial, 1)

    def dispatch(self, conn: Conn, out: list[bytes], budget: int) -> int:
        """Pull requests round robin across this connection's services (design/wire.md §9.2, §14.2)
        into `out`, prefixed; returns the budget left."""
        limit = self.limits.maxOpenRequestsPerClient
        services = conn.service_list
        count = len(services)
        idle = 0
        i = conn.rr
        ledger = self._arts.ledger
        while budget > 0 and idle < count and conn.open_requests < limit:
            svc = services[i % count]
            i += 1
            if not svc.queue or svc.in_flight >= svc.max_in_flight:
                idle += 1
                continue
            idle = 0
            call = svc.queue.popleft()
            self.ledger.move(call, CallPhase.DISPATCHED)
            conn.dlv += 1
            serial = conn.dlv
            delivery = Delivery(serial, call, True)
            conn.deliveries[serial] = delivery
            call.delivery = delivery
            if ledger.frames:
                ledger.see(conn, ledger.rooted((call, REQUEST)))
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

    def dispatchable(self, conn: Conn) -> bool:
        """The RPC lane could dispatch a request now (what `dispatch` would find)."""
        if conn.open_requests >= self.limits.maxOpenRequestsPerClient:
            return False
        return any(svc.queue and svc.in_flight < svc.max_in_flight
                   for svc in conn.service_list)

    # teardown (design/wire.md §10.2 steps 2–5) ----------------------------------------------------
    def forget_connection(self, conn: Conn) -> None:
        """Its services are removed; its deliveries dropped (their roots end) and its
        dispatched, unreplied calls fail; the calls it made move on."""
        for svc in list(conn.services.values()):
            self.remove_route(svc, "disconnected")
        ledger = self.ledger
        arts = self._arts
        for delivery in conn.deliveries.values():
            if delivery.is_request and not delivery.consumed:
                arts.unroot((delivery.call, REQUEST))
            if delivery.is_request and delivery.capability:
                call = delivery.call
                if call.phase is CallPhase.DISPATCHED:
                    self._call_failed(call, "NO_SERVICE",
                                      "the service disconnected before replying", "dispatched")
                ledger.move(call, CallPhase.GONE)
        conn.deliveries.clear()
        conn.open_requests = conn.capabilities = 0
        for call in list(conn.calls.values()):
            phase = call.phase
            if phase is CallPhase.QUEUED:
                call.service.queue.remove(call)
                ledger.move(call, CallPhase.GONE)
                arts.unroot((call, REQUEST))
            elif phase is CallPhase.DISPATCHED:
                ledger.move(call, CallPhase.DETACHED)
            elif phase is CallPhase.REPLIED:
                ledger.move(call, CallPhase.GONE)
                arts.unroot((call, RESULT))
