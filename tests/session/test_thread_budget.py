"""`ThreadBudget` (session.md §7.3): tests 27–28 of §8, plus reporting helpers."""

from __future__ import annotations

import pytest

from flyd.launch.budget import ThreadBudget, cpus
from workers.types.domain import DomainError


def test_worker_threads_lie_within_the_budget() -> None:
    budget = ThreadBudget(4, 1)
    budget.open_session("s1")
    assert budget.remaining == 3
    assert budget.allocate("arena", 1) == 1
    assert budget.allocate("fly-a", 2) == 2
    with pytest.raises(DomainError) as err:
        budget.allocate("fly-b", 1)
    assert (err.value.code, err.value.mutation) == ("BUSY", "none")
    assert err.value.message == "fly-b wants 1 threads; 0 of 4 remain"
    assert budget.release("fly-a") is True
    assert budget.allocate("fly-b", 1) == 1
    with pytest.raises(DomainError) as err:
        budget.allocate("fly-b", 1)
    assert (err.value.code, err.value.mutation) == ("CONFLICT", "none")
    with pytest.raises(DomainError) as err:
        budget.allocate("fly-c", 0)
    assert (err.value.code, err.value.mutation) == ("INVALID_ARGUMENT", "none")
    assert budget.release("fly-z") is False
    assert budget.holders() == {"coordinator-s1": 1, "arena": 1, "fly-b": 1}
    assert (budget.used, budget.remaining) == (3, 1)


def test_a_budget_must_cover_its_reservation() -> None:
    for total, reservation in [(0, 0), (2, 0), (2, 3)]:
        with pytest.raises(DomainError) as err:
            ThreadBudget(total, reservation)
        assert (err.value.code, err.value.mutation) == ("INVALID_ARGUMENT", "none")
    one = ThreadBudget.for_this_machine(1)
    three = ThreadBudget.for_this_machine(3)
    assert one.total >= 4 and three.total >= 12
    assert one.coordinator_reservation == three.coordinator_reservation == 1
    assert one.total == max(cpus(), 4)
    budget = ThreadBudget(4, 1)
    budget.open_session("s1")
    budget.open_session("s2")
    assert budget.remaining == 2
    assert budget.fits(3) is False
    assert budget.fits(2) is True


def test_a_session_reservation_is_released_with_the_session() -> None:
    budget = ThreadBudget(4, 1)
    assert budget.default_need() == 4
    assert budget.fits(budget.default_need())
    budget.open_session("s7")
    assert budget.allocation("coordinator-s7") == 1
    with pytest.raises(DomainError) as err:
        budget.open_session("s7")
    assert err.value.code == "CONFLICT"
    assert budget.close_session("s7") is True
    assert budget.close_session("s7") is False
    assert budget.remaining == 4
    configured = ThreadBudget.for_this_machine(2, threads=10, coordinator_reservation=2)
    assert (configured.total, configured.coordinator_reservation) == (10, 2)
    for bad in (True, -1, 1.5):
        with pytest.raises(DomainError):
            ThreadBudget(bad, 1)  # type: ignore[arg-type]
