"""The inventory marks (distribution.md §7.3.7, test 60): each test of `test_sim.py` that ran
leaves `tier1-<test>` in the test run's inventory directory, and every test of this package
leaves `done-<digest of its node id>` after its teardown, so test 60 judges orphans only once
no other test of the suite (a scenario, the budget probe) can still own a marked process."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.distribution.harness.runner import done_mark, inventory_dir


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    report = yield
    if call.when == "call" and item.path.name == "test_sim.py":
        (inventory_dir(item.config) / f"tier1-{item.originalname}").write_text(  # type: ignore[attr-defined]
            str(getattr(report, "outcome", "")))
    if call.when == "teardown":
        done_mark(inventory_dir(item.config), item.nodeid).write_text(
            str(getattr(report, "outcome", "")))
    return report


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Test 60 waits for the marks of every selected scenario test, so it must be the last item
    of the session: under xdist's load scheduling nothing is then queued behind it on its
    worker (a scenario queued there could never run while it waits)."""
    last = [i for i in items if i.name == "test_no_orphans_and_inventory"]
    items[:] = [i for i in items if i not in last] + last
