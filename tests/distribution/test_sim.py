"""Tier 1 acceptance tests (distribution.md §8, 36–39): parameters and the sans-IO lease core.

Virtual time only: every clock reading is a number passed in; nothing sleeps.
"""

from __future__ import annotations

import dataclasses

import pytest

from flyd.leases.core import (
    CancelScope,
    Forget,
    GrantRow,
    LeaseCore,
    LeaseLost,
    Phase,
    RenewRow,
    StartScope,
)
from flyd.leases.params import LeaseParams, LeaseParamsError

# Each clause of §4.3 violated alone (every other clause holds).
ALONE: dict[str, list[dict[str, float | int | None]]] = {
    "§4.3.1": [
        {"clock_rate_bound": -0.01},
        {"clock_rate_bound": 0.5, "heartbeat_interval_s": 1.3, "renew_timeout_s": 1.0,
         "connect_timeout_s": 0},
    ],
    "§4.3.2": [{"renew_timeout_s": 3.0}, {"heartbeat_interval_s": 3.5}],
    "§4.3.3": [{"kill_bound_s": 2.5}],
    "§4.3.4": [{"commit_timeout_s": 1.9}, {"commit_budget_s": 2.2}],
    "§4.3.5": [{"idle_in_transaction_timeout_ms": 2000.0}],
    "§4.3.6": [{"connect_timeout_s": 3}, {"claim_poll_s": 3.1}],
}


def test_params_invariant() -> None:
    assert LeaseParams().validate().G == 10.0
    assert LeaseParams().H == 3.0
    short = LeaseParams.short_ttl().validate()
    assert (short.T, short.H, short.G) == (4.0, 0.6, 1.85)
    assert short.watchdog_tick_s == 0.25 and short.kill_bound_s == 0.5
    assert short.clock_rate_bound == 0.1
    for clause, variants in ALONE.items():
        for changes in variants:
            p = dataclasses.replace(LeaseParams(), **changes)  # type: ignore[arg-type]
            assert [e.clause for e in p.violations()] == [clause], (clause, changes)
            with pytest.raises(LeaseParamsError) as info:
                p.validate()
            assert info.value.clause == clause and clause in str(info.value)
    # --lease-ttl sets T only; H follows T/5, the rest keeps its value; named clause refuses.
    four = LeaseParams().with_ttl(4)
    assert four.H == 0.8 and four.renew_timeout_s == 2.0
    with pytest.raises(LeaseParamsError, match=r"§4\.3\.2"):
        four.validate()
    fixed_h = dataclasses.replace(LeaseParams(), heartbeat_interval_s=2.5).with_ttl(30)
    assert fixed_h.H == 2.5
    with pytest.raises(LeaseParamsError, match=r"§4\.2"):
        LeaseParams(ttl_s=float("nan")).validate()


P = LeaseParams()
G = P.G


def _core(capacity: int = 4) -> LeaseCore:
    return LeaseCore(P, "n1-000000000000", capacity)


def test_core_safe_until() -> None:
    core = _core()
    acts = core.on_granted([GrantRow("r", 1, 1)], t_send=100.0)
    assert acts == [StartScope("r", 1, 1)]
    assert core.hold("r", 1) is not None and core.hold("r", 1).safe_until == 100.0 + G  # type: ignore[union-attr]
    core.end("r", "start")
    # acknowledged renewal extends to t_send + G
    b = core.renew_batch(103.0)
    assert core.on_renewed(b, [RenewRow("r", 1)], t_send=103.0) == []
    assert core.hold("r", 1).safe_until == 103.0 + G  # type: ignore[union-attr]
    # never shortened: an older t_send acknowledged late keeps the later safe_until
    b2 = core.renew_batch(103.5)
    core.on_renewed(b2, [RenewRow("r", 1)], t_send=101.0)
    assert core.hold("r", 1).safe_until == 103.0 + G  # type: ignore[union-attr]
    # unknown renewals extend nothing
    b3 = core.renew_batch(106.0)
    assert core.on_renew_unknown(b3) == []
    assert core.hold("r", 1).safe_until == 103.0 + G  # type: ignore[union-attr]
    assert core.next_deadline() == 103.0 + G
    assert core.expire_due(103.0 + G - 0.001) == []
    assert core.expire_due(103.0 + G) == [CancelScope("r", 1, "safe_until")]
    assert core.hold("r", 1).phase is Phase.LOST  # type: ignore[union-attr]
    # a lost hold is never extended again
    core.on_renewed(b3, [RenewRow("r", 1)], t_send=110.0)
    assert core.hold("r", 1).safe_until == 103.0 + G  # type: ignore[union-attr]
    assert core.next_deadline() is None


def test_core_missing_row() -> None:
    core = _core(capacity=8)
    core.on_granted([GrantRow(r, 1, 1) for r in "abcdef"], t_send=0.0)
    for r in "abcdef":
        core.end(r, "start")
    core.begin("b", "commit")
    batch = core.renew_batch(1.0)
    assert {e.run_id for e in batch.entries} == set("abcdef")
    core.begin("c", "finish")           # FINISHING after the batch was built
    core.begin("d", "release")          # RELEASING after the batch was built
    core.on_granted([GrantRow("e", 2, 2)], t_send=0.5)   # changed epoch: e@1 fenced
    core.begin("f", "commit")           # ACTIVE -> COMMITTING: still renewable
    acts = core.on_renewed(batch, [], t_send=1.0)
    assert CancelScope("a", 1, "renew_missing") in acts
    assert CancelScope("f", 1, "renew_missing") in acts
    assert CancelScope("b", 1, "renew_missing") in acts
    assert not any(isinstance(a, CancelScope) and a.run_id in "cd" for a in acts)
    assert not any(isinstance(a, CancelScope) and a.run_id == "e" and a.epoch == 2 for a in acts)
    assert core.hold("e", 2).phase is Phase.STARTING  # type: ignore[union-attr]
    assert core.hold("c", 1).phase is Phase.FINISHING  # type: ignore[union-attr]
    assert core.hold("d", 1).phase is Phase.RELEASING  # type: ignore[union-attr]
    # FINISHING / RELEASING are left out of the next batch
    assert {e.run_id for e in core.renew_batch(1.0).entries} == {"e"}
    assert core.end("c", "finish") == [Forget("c", 1)]


def test_guard_min_remaining() -> None:
    core = _core()
    core.on_granted([GrantRow("r", 1, 1)], t_send=0.0)
    core.end("r", "start")
    b = P.commit_budget_s
    assert core.check("r", 1, G - b - 0.01, b).run_id == "r"
    with pytest.raises(LeaseLost):
        core.check("r", 1, G - b, b)          # now + min_remaining == safe_until
    with pytest.raises(LeaseLost):
        core.check("r", 1, G + 1, 0.0)
    with pytest.raises(LeaseLost):
        core.check("r", 2, 0.0, 0.0)          # not my epoch
    assert core.check("r", 1, 0.0, 0.0).phase is Phase.ACTIVE  # check mutates nothing
    core.fence("r", 1, "fenced")
    with pytest.raises(LeaseLost) as info:
        core.check("r", 1, 0.0, 0.0)
    assert info.value.code == "LEASE_LOST" and info.value.mutation == "none"
    with pytest.raises(LeaseLost):
        core.begin("r", "commit")
