"""Raw-connection helpers shared by the bus conformance tests."""

from __future__ import annotations

from typing import Any


async def serve(raw: Any, r: Any, client_id: str, name: str, *, max_queued: int = 8,
                max_in_flight: int = 1) -> tuple[Any, str]:
    """A raw service connection holding `name`; returns (conn, serviceIncarnation)."""
    s = await raw(r)
    assert "result" in await s.hello(client_id)
    resp = await s.call("bus.register", {"name": name, "maxQueued": max_queued,
                                         "maxInFlight": max_in_flight})
    return s, resp["result"]["serviceIncarnation"]


async def caller(raw: Any, r: Any, client_id: str) -> Any:
    """A raw connection that completed its hello."""
    c = await raw(r)
    assert "result" in await c.hello(client_id)
    return c


def call_params(target: str, payload: dict[str, Any] | None = None) -> dict[str, Any]:
    """`bus.call` params for an unpinned call of method Test.Op."""
    return {"target": target, "expectedIncarnation": None, "method": "Test.Op",
            "payload": payload if payload is not None else {}}


async def answer(s: Any, req: dict[str, Any], outcome: dict[str, Any] | None = None) -> bool:
    """Reply to a delivered request and consume it; returns `routed`."""
    resp = await s.call("bus.reply", {"deliveryId": req["deliveryId"], "outcome": outcome or {}})
    routed: bool = resp["result"]["routed"]
    resp = await s.call("bus.consumed", {"deliveryIds": [req["deliveryId"]]})
    assert resp["result"] == {"released": 1}
    return routed


async def consume(c: Any, delivery_id: str) -> int:
    """`bus.consumed` of one delivery; returns `released`."""
    resp = await c.call("bus.consumed", {"deliveryIds": [delivery_id]})
    released: int = resp["result"]["released"]
    return released


# wire.md §15, written out from the spec on purpose (not imported from bus.errors)
SPEC_ERROR_CODES = {
    "PARSE_ERROR": -32700,
    "INVALID_REQUEST": -32600,
    "METHOD_NOT_FOUND": -32601,
    "INVALID_PARAMS": -32602,
    "INVALID_ENVELOPE": -32000,
    "VERSION_MISMATCH": -32001,
    "NOT_AUTHORIZED": -32002,
    "NO_SERVICE": -32003,
    "TARGET_CHANGED": -32004,
    "BACKPRESSURE": -32005,
    "CALL_GONE": -32006,
    "QUOTA_EXCEEDED": -32007,
    "ROUTER_LOST": -32008,
    "CONFLICT": -32009,
    "NO_TOPIC": -32010,  # docs/topics.md §9
    "ARTIFACT_GONE": -32011,
    "ARTIFACT_UNSEALED": -32012,
    "ARTIFACT_MISMATCH": -32013,
    "OWNER_INVALID": -32014,
    "STORE_FAILURE": -32015,
}
