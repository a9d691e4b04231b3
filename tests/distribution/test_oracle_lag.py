"""S6's kill bound K against the node's own measured loop lag (tests/distribution/oracle.py).

K bounds a physical act (confirming a lost hold's workers dead), so the oracle extends it by the
loop lag the node measured between the loss and the scope's end, and by nothing else: a node that
was on time, or lag outside that window, still fails S6.
"""

from __future__ import annotations

from typing import Any

from tests.distribution import oracle

K, SLACK = 2.0, 0.5
LOST = 5.0


def record(cancelled_after: float, lags: list[tuple[float, float]]) -> dict[str, Any]:
    events: list[dict[str, Any]] = [
        {"event": "claimed", "node": "a", "run": 1, "epoch": 1, "t": 0.0},
        {"event": "lease_lost", "node": "a", "run": 1, "epoch": 1, "t": LOST,
         "reason": "safe_until"},
    ]
    events += [{"event": "loop_lag", "node": "a", "t": t, "lag_s": lag} for t, lag in lags]
    events.append({"event": "scope_cancelled", "node": "a", "run": 1, "epoch": 1,
                   "t": LOST + cancelled_after})
    events.sort(key=lambda e: e["t"])
    return {"params": {"G": 10.0, "kill_bound_s": K, "watchdog_tick_s": 0.25},
            "log": {"slack_s": SLACK, "nodes": [{"node_id": "a", "end": [100.0, 100.0]}]},
            "events": events, "tables": {}}


def s6(rec: dict[str, Any]) -> oracle.Verdict:
    return oracle.s6(oracle.History(rec))


def test_s6_holds_within_k() -> None:
    assert s6(record(K + SLACK - 0.1, [])).ok


def test_s6_fails_past_k_on_a_node_that_ran_on_time() -> None:
    verdict = s6(record(K + SLACK + 0.4, []))
    assert not verdict.ok
    assert "without scope_cancelled within K" in verdict.evidence[0]


def test_s6_extends_k_by_the_loop_lag_measured_after_the_loss() -> None:
    assert s6(record(K + SLACK + 0.4, [(LOST + 2.0, 0.6)])).ok


def test_s6_counts_only_the_lag_inside_the_window() -> None:
    # the loop was late before the loss (ending at LOST) and partly after it: only 0.2 counts
    assert not s6(record(K + SLACK + 0.4, [(LOST - 0.1, 0.6), (LOST + 0.2, 0.4)])).ok
    assert s6(record(K + SLACK + 0.4, [(LOST - 0.1, 0.6), (LOST + 0.5, 0.7)])).ok
