"""Load with faults (wire.md §9.1, §10, §7.6): many concurrent clients through one router
process while services are killed and restarted and calls are cancelled at random moments.

The scenario lives in bench/load.py (`make load` runs it at full size, 64 clients x 10000
calls, and prints calls/s and p99); this is the same scenario and the same checks at a size
that fits the test run: every call ends in exactly one terminal outcome, as seen by the caller
(outcome frames per callId), by the services (each request handled at most once, every result
handled, nothing cancelled before dispatch ever handled) and by the router (no call left, its
counters equal to the callers' totals).
"""

from __future__ import annotations

import os

import pytest

from bench.load import Setup, run_load

CLIENTS = 64
CALLS = 200
RESTARTS = 4


@pytest.mark.timeout(600)
def test_every_call_ends_exactly_once_under_cancels_and_restarts() -> None:
    seed = int.from_bytes(os.urandom(2), "little")
    result = run_load(Setup(clients=CLIENTS, calls=CALLS, processes=4, services=4,
                            cancel=0.05, restarts=RESTARTS, seed=seed))
    note = f"seed {seed}: {result}"
    assert result["problems"] == [], note
    assert result["calls"] == CLIENTS * CALLS, note
    outcomes: dict[str, int] = result["outcomes"]
    assert sum(outcomes.values()) == CLIENTS * CALLS, note
    # the faults happened: services were killed, and calls saw them go
    assert result["restarts"] == RESTARTS, note
    assert sum(n for o, n in outcomes.items() if "NO_SERVICE" in o) > 0, note
    # cancels were answered with the states that end a call
    assert sum(n for o, n in outcomes.items() if o.startswith("cancel:")) > 0, note
    assert outcomes.get("result", 0) > CLIENTS * CALLS // 2, note
    assert result["handled"] >= outcomes["result"], note
