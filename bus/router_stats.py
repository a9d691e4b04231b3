"""`bus.stats` (design/wire.md §16): the router's gauges and counters, read from the parts' books.

Pure: a function of the books handed in, computed in O(connections + services) when asked,
so no gauge is kept beside the state it measures. The key order is the one `bus.stats` has
always listed.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from bus.artifacts import ArtifactLedger
from bus.call_phases import CallPhase, Ledger
from bus.connection import Conn
from bus.registry import Registry
from bus.topics import TopicTable


@dataclass(frozen=True)
class Books:
    """What `bus.stats` reads: each part's books, and the store's own member."""

    router_id: str
    conns: Collection[Conn]
    registry: Registry
    calls: Ledger[Conn]
    topics: TopicTable[Conn]
    artifacts: ArtifactLedger[Conn]
    store: dict[str, Any] | None
    counters: dict[str, Any]


def stats(books: Books, uptime_s: float, now: float, detail: bool) -> dict[str, Any]:
    """design/wire.md §16; `now` is the monotonic clock a connection's age is measured against."""
    conns = books.conns
    clients = sum(1 for c in conns if c.client_id is not None and not c.closing)
    open_conns = sum(1 for c in conns if not c.closing)
    services = books.registry.services
    queued = sum(len(s.queue) for s in services.values())
    dispatched = sum(c.capabilities for c in conns)
    active = sum(c.active for c in conns)
    counters = books.counters
    topics = books.topics
    art = books.artifacts
    ledger = books.calls
    result: dict[str, Any] = {
        "routerId": books.router_id,
        "uptimeMs": int(uptime_s * 1000),
        "connections": open_conns,
        "pendingConnections": open_conns - clients,
        "clients": clients,
        "services": len(services),
        "expectations": len(books.registry.expectations),
        "calls": ledger.calls,
        "activeCalls": active,
        "queuedCalls": queued,
        "dispatchedCalls": dispatched,
        "detachedCalls": ledger.detached,
        "repliedCalls": ledger.calls - queued - dispatched,
        "replyCapabilities": dispatched,
        "queuedCallBytes": ledger.queued_bytes,
        "topics": len(topics.topics),
        "subscriptions": topics.subscriptions,
        "queuedMessages": topics.queued_messages,
        "queuedTopicBytes": topics.queued_bytes,
        "messageDeliveries": topics.deliveries,
        "store": books.store,
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
