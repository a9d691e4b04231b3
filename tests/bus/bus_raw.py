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
