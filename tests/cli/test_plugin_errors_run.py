"""`flyd run` with a failing plugin (issue 21, item 3): the reason and traceback on stderr, one
attempt. The plugins are tests/fixtures/plugins/faulty.py's, found through `--plugin-path`
naming the repository root."""

from __future__ import annotations

from pathlib import Path

import pytest

from flyd.outcome import describe
from tests.cli.test_run import ROOT, flyd_run
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(180)

FAULTY = "tests.fixtures.plugins.faulty"


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_flyd_run_shows_a_constructor_failure_and_tries_once(tmp: Path, mode: str) -> None:
    """The issue's acceptance run: `flyd run` with a model raising `ValueError("bad gain 42")`
    in its constructor ends `failed` after one attempt and shows the message on stderr."""
    code, summary, stderr = flyd_run(tmp, "--model", f"{FAULTY}:BadGainModel",
                                     "--plugin-path", str(ROOT), "--steps", "10",
                                     "--mode", mode)
    assert code == 1 and summary["state"] == "failed", summary
    assert summary["recoveries"] == 0, summary
    [failure] = summary["failures"]  # the one failure, never retried
    assert (failure["detail"], failure["participant"]) == ("Agent.Initialize", "fly-a")
    assert "ValueError: bad gain 42" in failure["message"]
    outcome = summary["outcome"]
    assert outcome["error"] == "plugin failed" and outcome["plugin"]["repeats"] is True
    assert f"run {summary['run']} failed: {describe(outcome)}" in stderr
    assert "ValueError: bad gain 42" in stderr
    assert "traceback (innermost last):" in stderr and "in check_gain" in stderr
    assert "recovery.started" not in stderr


def test_flyd_run_names_a_missing_required_attribute(tmp: Path) -> None:
    code, summary, stderr = flyd_run(tmp, "--model", f"{FAULTY}:UnversionedModel",
                                     "--plugin-path", str(ROOT), "--steps", "10",
                                     "--mode", "process")
    assert code == 1 and summary["state"] == "failed", summary
    outcome = summary["outcome"]
    assert outcome["error"] == "plugin failed", outcome
    assert (outcome["plugin"]["stage"], outcome["plugin"]["repeats"]) == ("attribute", True)
    assert "lacks model_version" in describe(outcome) and "lacks model_version" in stderr
    assert summary["recoveries"] == 0
