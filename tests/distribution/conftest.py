"""The inventory marks (distribution.md §7.3.7, test 60): each test of `test_sim.py` that ran
leaves `tier1-<test>` in the test run's inventory directory, and every test of this package
leaves `done-<digest of its node id>` after its teardown, so test 60 judges orphans only once
no other test of the suite (a scenario, the budget probe) can still own a marked process.

The suite's seed line (§7.3.7) comes first: `faults_suite` writes it once per test run, before
the first tier-2 scenario line or tier-1 `[sim]` line of any xdist worker; `live` is the
reporter of both (`live_reporter`: on the terminal as it happens, also under xdist).
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.distribution.harness.runner import (
    Report,
    announce_once,
    done_mark,
    inventory_dir,
    live_reporter,
    suite_line,
)
from tests.distribution.harness.scenarios import suite_seed


@pytest.fixture(scope="session")
def faults_suite(request: pytest.FixtureRequest, pg_server_dsn: str) -> tuple[int, Report]:
    """The suite seed and the live reporter; the suite's seed line is written once per run."""
    report = live_reporter(request.config)
    seed = suite_seed()
    announce_once(request.config, suite_line(seed, pg_server_dsn), report)
    return seed, report


@pytest.fixture
def live(faults_suite: tuple[int, Report]) -> Report:
    """The live reporter of tier 1's `[sim]` lines, after the suite's seed line."""
    return faults_suite[1]


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
