"""A task value that cannot be encoded is the task's failure (issue 34, Build item 4): a reward
of 1e16 (outside ±(2^53−1)) or NaN ends the run `failed` at once, naming the task and the
value's path, with no recovery attempt and no agent blamed. The tasks are
tests/fixtures/plugins/faulty.py's, run through `flyd run --spec`."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from flyd.outcome import describe
from tests.cli.test_run import ROOT, flyd_run
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(180)

FAULTY = "tests.fixtures.plugins.faulty"


@pytest.mark.parametrize(("task", "value"), [("HugeRewardTask", "1e+16"),
                                             ("NanRewardTask", "nan")])
def test_a_task_value_that_cannot_be_encoded_ends_the_run_naming_the_task(
        tmp: Path, task: str, value: str) -> None:
    impl = f"{FAULTY}:{task}"
    spec = tmp / "spec.json"
    spec.write_bytes(orjson.dumps({"steps": "10", "task": {"impl": impl}}))
    code, summary, stderr = flyd_run(tmp, "--spec", str(spec), "--plugin-path", str(ROOT),
                                     "--mode", "process")
    assert code == 1 and summary["state"] == "failed", summary
    assert summary["boundary"] == 3, "the bad reward comes with transition 3"
    assert summary["recoveries"] == 0, summary
    [failure] = summary["failures"]  # one failure, never retried
    assert failure["detail"] == "task-evaluate" and failure["participant"] is None, failure
    assert failure["code"] == "INVALID_ARGUMENT"
    assert f"task {impl}: /outcomes/fly-a/rewards/0/value:" in failure["message"], failure
    assert value in failure["message"], failure
    outcome = summary["outcome"]
    assert outcome["error"] == "plugin failed", outcome
    assert outcome["plugin"]["plugin"] == impl and outcome["plugin"]["repeats"] is True
    assert f"run {summary['run']} failed: {describe(outcome)}" in stderr
    assert impl in describe(outcome)
    assert "recovery.started" not in stderr and "CALL_GONE" not in stderr
