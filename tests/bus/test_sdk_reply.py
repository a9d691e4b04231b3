"""SDK replies that the router refuses (wire.md §7.4 step 4, §17 handler contract).

The SDK sends a handler's returned outcome as a lean `bus.reply` notification (wire.md §21.6),
so the refusal of a reply whose worst-case `bus.result` would exceed maxEnvelopeBytes arrives
as a `bus.replyFailed` after the handler task has ended; it must still lead to a release and
the caller's CALL_GONE.
"""

from __future__ import annotations

from typing import Any

import pytest

from bus import codec
from bus.client_serving import Request
from bus.errors import CallGone

LONG_ID = "r" * 64  # the longest Id: the bus.result frame grows with the responder identity
MAX_ENVELOPE = 65536


def _outcome_filling_the_reply(delivery_id: str) -> dict[str, Any]:
    """An outcome whose lean bus.reply frame (wire.md §21.4, `consumed: true`) is exactly
    maxEnvelopeBytes long: it leaves the SDK, but the router's worst-case bus.result frame
    (longer ids around it) would not fit, so a `bus.replyFailed` comes back."""
    def reply_size(n: int) -> int:
        return len(codec.encode({"jsonrpc": "2.0", "method": "bus.reply", "params": {
            "deliveryId": delivery_id, "outcome": {"blob": "x" * n}, "consumed": True}}))

    n = MAX_ENVELOPE - reply_size(0)
    assert reply_size(n) == MAX_ENVELOPE
    return {"blob": "x" * n}


async def test_reply_refused_as_too_large_is_released(router: Any, sdk: Any,
                                                      settle: Any) -> None:
    r = await router(maxEnvelopeBytes=MAX_ENVELOPE, maxControlBytes=MAX_ENVELOPE,
                     maxQueuedCallBytes=MAX_ENVELOPE)
    service = await sdk(r, LONG_ID, client_incarnation="i" * 64)
    caller = await sdk(r, "rr-caller")

    async def handler(req: Request) -> dict[str, Any]:
        if req.method == "Big":
            return _outcome_filling_the_reply(req.delivery_id)
        return {"ok": True}

    # maxInFlight=1: serving again proves the release returned the in-flight slot
    await service.register("rr.svc", handler, max_in_flight=1)
    with pytest.raises(CallGone) as info:
        await caller.call("rr.svc", "Big", {}, timeout=5)
    assert info.value.name == "CALL_GONE"
    assert info.value.dispatch == "dispatched"
    res = await caller.call("rr.svc", "Small", {}, timeout=5)
    assert res.outcome == {"ok": True}
    stats = await settle(r, lambda s: s["calls"] == 0 and s["replyCapabilities"] == 0)
    errors = stats["counters"]["errors"]
    assert errors.get("INVALID_ENVELOPE") == 1  # the refused reply
    assert errors.get("CALL_GONE") == 1  # the caller's callFailed after the release
    assert stats["counters"]["repliesRouted"] == 1
    assert not service.closed and not caller.closed
