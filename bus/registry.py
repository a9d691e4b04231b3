"""Who is on the bus (design/wire.md §6, §7.1, §8, §14.1): the hello, expectations and services.

The books of identity and names, changed synchronously by the frame in hand: the live
connection of each clientId, the incarnations remembered per clientId (bounded per client and
in clients, least recently seen forgotten first), the pending expectations, and the registered
services by name. Nothing here writes a frame; a refusal is a `BusError` raised before any
book changed, and the router answers it. The one timer is an expectation's time to live, set
on the loop the router hands in at start.

Removing a service is two steps: `remove` frees its name here, and the call ops fail what was
queued on it (`bus/call_ops.py`), since that is a call's concern.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import OrderedDict
from typing import Any

import orjson
import structlog

from bus import limits
from bus.call_phases import Service
from bus.connection import Conn
from bus.errors import Conflict, InvalidParams, NotAuthorized, QuotaExceeded, VersionMismatch
from bus.limits import REMEMBERED_INCARNATIONS, Limits
from bus.policy import Grants, Policy, any_matches, covered_by_delegate, substitute
from bus.schema import validator

log = structlog.get_logger("bus.router")


class Expectation:
    """A pending `bus.expect` (design/wire.md §8): who may say hello, from which process, with
    what."""

    __slots__ = ("client_id", "creator", "grants", "incarnation", "pid", "timer")

    def __init__(self, client_id: str, pid: int, incarnation: str | None,
                 grants: dict[str, list[str]] | None, creator: Conn,
                 timer: asyncio.TimerHandle) -> None:
        self.client_id = client_id
        self.pid = pid
        self.incarnation = incarnation
        self.grants = grants
        self.creator = creator
        self.timer = timer


class Registry:
    """Live clients, remembered incarnations, expectations and services."""

    def __init__(self, policy: Policy, lim: Limits) -> None:
        self.policy = policy
        self.limits = lim
        self.loop: asyncio.AbstractEventLoop | None = None
        self.live: dict[str, Conn] = {}
        #: clientId -> its remembered incarnations, least recently seen clientId first
        self.incarnations: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self.expectations: dict[str, Expectation] = {}
        self.services: dict[str, Service[Conn]] = {}
        self._svc_next = secrets.randbelow(2**40) + 1
        self._hello_params = validator("ops/bus.hello.params.json")

    # hello (design/wire.md §6) --------------------------------------------------------------------
    def hello(self, conn: Conn, params: dict[str, Any]) -> Grants:
        """The hello's checks, then (nothing changed before) the connection's identity and
        grants; returns the grants."""
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
        exp = self.expectations.get(client_id)
        if exp is not None:
            if exp.pid != conn.pid:
                raise NotAuthorized(f"client {client_id} is expected from another process")
            if exp.incarnation is not None and exp.incarnation != incarnation:
                raise NotAuthorized(f"client {client_id} is expected with another incarnation")
        elif entry.require_expect:
            raise NotAuthorized(f"client {client_id} needs a pending expectation")
        if entry.pid is not None and entry.pid != conn.pid:
            raise NotAuthorized(f"client {client_id} is bound to another process")
        if client_id in self.live:
            raise Conflict(f"client {client_id} already has a live connection")
        seen = self.incarnations.get(client_id)
        if seen is not None and incarnation in seen:
            raise Conflict(f"incarnation {incarnation} of {client_id} was already used")
        # success: no mutation happened before this point
        grants = entry.grants_for(client_id)
        if exp is not None:
            if exp.grants is not None:
                # a missing list grants nothing; {clientId} is this client's id
                # (design/wire.md §6.2)
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
            self.drop_expectation(exp)
        if seen is None:
            seen = self.incarnations[client_id] = OrderedDict()
            self._forget_clients()
        else:
            self.incarnations.move_to_end(client_id)
        seen[incarnation] = None
        if len(seen) > REMEMBERED_INCARNATIONS:
            seen.popitem(last=False)
        conn.client_id = client_id
        conn.client_incarnation = incarnation
        conn.identity = orjson.Fragment(orjson.dumps(
            {"clientId": client_id, "clientIncarnation": incarnation}))
        conn.grants = grants
        self.live[client_id] = conn
        if conn.hello_timer is not None:
            conn.hello_timer.cancel()
            conn.hello_timer = None
        log.info("bus.hello", connection_id=conn.connection_id, client_id=client_id,
                 client_incarnation=incarnation, pid=conn.pid, uid=conn.uid)
        return grants

    def _forget_clients(self) -> None:
        """design/wire.md §14.1: over REMEMBERED_CLIENT_IDS clientIds, forget the least recently
        seen one without a live connection, with its incarnations. maxClients <= 4096 = the bound,
        and the clientId just added is live, so one without a live connection always exists."""
        remembered = self.incarnations
        while len(remembered) > limits.REMEMBERED_CLIENT_IDS:
            for client_id in remembered:
                if client_id not in self.live:
                    del remembered[client_id]
                    break
            else:
                return

    # expectations (design/wire.md §8) -------------------------------------------------------------
    def op_expect(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        client_id: str = p["clientId"]
        if not any_matches(conn.grants.expect, client_id):
            raise NotAuthorized(f"no expect grant for {client_id}")
        if client_id in self.live:
            raise Conflict(f"client {client_id} already has a live connection")
        incarnation = p.get("clientIncarnation")
        seen = self.incarnations.get(client_id)
        if incarnation is not None and seen is not None and incarnation in seen:
            raise Conflict(f"incarnation {incarnation} of {client_id} was already used")
        grants = p.get("grants")
        if grants is not None:
            for kind in ("register", "call", "publish", "subscribe"):
                for pattern in grants.get(kind, ()):  # a missing list grants nothing
                    if not covered_by_delegate(pattern, conn.grants.delegate, client_id):
                        raise NotAuthorized(
                            f"{kind} grant {pattern!r} is not covered by a delegate grant")
        existing = self.expectations.get(client_id)
        pending = len(self.expectations) - (1 if existing is not None else 0)
        if pending >= self.limits.maxExpectations:
            raise QuotaExceeded(f"maxExpectations ({self.limits.maxExpectations}) reached")
        if existing is not None:
            self.drop_expectation(existing)
        ttl_ms: int = p.get("ttlMs", 30000)
        assert self.loop is not None
        exp = Expectation(client_id, p["pid"], incarnation, grants, conn,
                          self.loop.call_later(ttl_ms / 1000.0, self._expire, client_id))
        self.expectations[client_id] = exp
        conn.expectations.add(client_id)
        return {"clientId": client_id, "expiresInMs": ttl_ms}

    def _expire(self, client_id: str) -> None:
        exp = self.expectations.get(client_id)
        if exp is not None:
            self.drop_expectation(exp)

    def drop_expectation(self, exp: Expectation) -> None:
        exp.timer.cancel()
        if self.expectations.get(exp.client_id) is exp:
            del self.expectations[exp.client_id]
        exp.creator.expectations.discard(exp.client_id)

    # services (design/wire.md §7.1, §7.2) ---------------------------------------------------------
    def op_register(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        name: str = p["name"]
        if not any_matches(conn.grants.register, name):
            raise NotAuthorized(f"no register grant for {name}")
        lim = self.limits
        if p["maxQueued"] > lim.maxServiceQueued or p["maxInFlight"] > lim.maxServiceInFlight:
            raise QuotaExceeded(
                f"maxQueued/maxInFlight above the router's {lim.maxServiceQueued}/"
                f"{lim.maxServiceInFlight}"
            )
        if name in self.services:
            raise Conflict(f"{name} is already registered")
        if len(self.services) >= lim.maxServices:
            raise QuotaExceeded(f"maxServices ({lim.maxServices}) reached")
        incarnation = f"svc-{self._svc_next}"
        self._svc_next += 1
        svc = Service(name, incarnation, conn, p["maxQueued"], p["maxInFlight"])
        self.services[name] = svc
        conn.services[name] = svc
        conn.service_list.append(svc)
        log.info("bus.register", connection_id=conn.connection_id, service=name,
                 service_incarnation=incarnation)
        return {"name": name, "serviceIncarnation": incarnation}

    def remove(self, svc: Service[Conn]) -> bool:
        """Free a live service's name; False when it was already removed."""
        if not svc.live:
            return False
        svc.live = False
        del self.services[svc.name]
        del svc.owner.services[svc.name]
        svc.owner.service_list.remove(svc)
        return True

    def op_services(self, conn: Conn, p: dict[str, Any], rid: int) -> dict[str, Any]:
        prefix: str = p.get("prefix", "")
        out = []
        for name in sorted(self.services):
            if not name.startswith(prefix):
                continue
            svc = self.services[name]
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

    # teardown (design/wire.md §10.2 steps 1 and 6) ------------------------------------------------
    def forget_live(self, conn: Conn) -> None:
        """Step 1: no longer live (its incarnations stay remembered, as its most recent
        sighting)."""
        if conn.client_id is not None and self.live.get(conn.client_id) is conn:
            del self.live[conn.client_id]
            if conn.client_id in self.incarnations:
                self.incarnations.move_to_end(conn.client_id)

    def forget_expectations(self, conn: Conn) -> None:
        """Step 6: the expectations it created."""
        for client_id in list(conn.expectations):
            exp = self.expectations.get(client_id)
            if exp is not None and exp.creator is conn:
                self.drop_expectation(exp)
        conn.expectations.clear()
