"""`RecoveryBudget` (flyd/state/recovery.py): attempts, backoff and the refund of an attempt a
router death interrupted."""

from __future__ import annotations

from flyd.state.recovery import Exhausted, RecoveryBudget


def test_a_refunded_attempt_neither_counts_nor_grows_the_backoff() -> None:
    budget = RecoveryBudget(max_attempts=2, backoff_s=1.0, backoff_max_s=8.0)
    assert budget.start() == 1
    assert budget.failed() == 1.0
    for _ in range(5):                       # router deaths, each interrupting attempt 2
        assert budget.start() == 2
        budget.refund()
    assert budget.start() == 2
    assert budget.failed() == 2.0            # only real failures doubled the backoff
    assert budget.start() == Exhausted(2)


def test_a_refund_never_goes_below_zero() -> None:
    budget = RecoveryBudget()
    budget.refund()
    assert budget.start() == 1
