"""Plugin errors that explain themselves (issue 21, item 3): real `flyd serve` node processes.

A model that raises in its constructor, a class its module does not have and a module that does
not exist each end the run `failed` on its first attempt, no recovery attempt spent, with the
exception's type and message in the run's outcome, the node's log and `flyctl runs show`.
The failing plugins live in `tests/fixtures/plugins/`; the node runs with the repository root
as its working directory, which `python -m` puts on the import path of the node and of every
worker process it starts (the fork server's children inherit it).

`flyd run` prints the same reason (`flyd.outcome.describe`) and traceback
(`flyd.outcome.traceback_of`) on stderr as `flyctl runs show` does, from the same outcome;
tests/cli/test_plugin_errors_run.py runs it with `--model` and `--plugin-path`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from flyd.outcome import describe, traceback_of
from flyd.session.runspec import RunSpec
from tests.cli.test_serve import log_events, run_state, submit
from tests.serve_nodes import ROOT, process_dir, start_node, stop, wait_for
from workers.types.domain import FAULT_FRAMES, FAULT_LINE

pytestmark = pytest.mark.timeout(180)

FAULTY = "tests.fixtures.plugins.faulty"
FLYCTL = [sys.executable, "-c", "from flyd.cli.flyd import flyctl_main; flyctl_main()"]
TERMINAL = ("succeeded", "failed", "cancelled")


@pytest.fixture
def tmp() -> Iterator[Path]:
    with process_dir("flyd-p-") as path:
        yield path


def spec_with(model: str, mode: str) -> Any:
    return RunSpec.validate({
        "steps": "10", "mode": mode,
        "agents": [{"agentId": "ant-1", "portId": "p1", "seed": None, "model": model}]}
    ).to_json()


def run_to_end(dsn: str, tmp: Path, spec: Any) -> tuple[str, int, Any]:
    run = submit(dsn, spec)
    node = start_node(tmp, "n", dsn)
    try:
        wait_for("the node to end the run", lambda: run_state(dsn, run)[0] in TERMINAL, 90)
    finally:
        assert stop(node) == 0
    state, attempt, outcome = run_state(dsn, run)
    return state, attempt, {"run": run, "outcome": outcome}


def runs_show(dsn: str, run: int, *, json: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FLYD_SOCKET", "FLYD_CONFIG")}
    env["FLYD_DSN"] = dsn
    argv = [*FLYCTL, "runs", "show", str(run), *(["--json"] if json else [])]
    shown = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    return shown


def assert_not_retried(tmp: Path) -> None:
    """One attempt: no recovery started, no launch handed back for a retry."""
    assert log_events(tmp, "n", "recovery.started") == []
    assert [e for e in log_events(tmp, "n", "run.launch_failed") if e.get("retry")] == []
    assert len(log_events(tmp, "n", "run.plugin_failed")) == 1


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_model_raising_in_its_constructor_fails_the_run_at_once_with_its_message(
        db_dsn: str, tmp: Path, mode: str) -> None:
    spec = spec_with(f"{FAULTY}:BadGainModel", mode)
    state, attempt, seen = run_to_end(db_dsn, tmp, spec)
    outcome = seen["outcome"]
    assert (state, attempt) == ("failed", 1), outcome
    assert outcome["error"] == "plugin failed"
    assert outcome["failure"]["detail"] == "Agent.Initialize"
    assert outcome["failure"]["participant"] == "ant-1"
    assert "ValueError: bad gain 42" in outcome["failure"]["message"]
    plugin = outcome["plugin"]
    assert plugin["plugin"] == f"{FAULTY}:BadGainModel"
    assert (plugin["stage"], plugin["exception"], plugin["message"], plugin["repeats"]) == \
        ("construct", "ValueError", "bad gain 42", True)
    frames = plugin["frames"]
    assert 2 <= len(frames) <= FAULT_FRAMES and all(len(f) <= FAULT_LINE for f in frames)
    assert "in check_gain" in frames[-1] and "faulty.py" in frames[-1]
    assert "in __init__" in frames[-2]
    assert_not_retried(tmp)
    failed = log_events(tmp, "n", "run.plugin_failed")[0]
    assert (failed["exception"], failed["exception_message"]) == ("ValueError", "bad gain 42")
    reason = describe(outcome)
    assert "ValueError: bad gain 42" in reason and "BadGainModel" in reason
    assert traceback_of(outcome) == frames

    shown = runs_show(db_dsn, seen["run"], json=True)
    doc = orjson.loads(shown.stdout)
    assert doc["state"] == "failed" and doc["reason"] == reason
    assert doc["outcome"]["plugin"] == plugin
    human = runs_show(db_dsn, seen["run"], json=False).stdout
    assert f"reason: {reason}" in human
    assert "traceback (innermost last):" in human
    assert all(f"  {frame}" in human for frame in frames)


def test_a_missing_class_is_named_and_not_retried(db_dsn: str, tmp: Path) -> None:
    state, attempt, seen = run_to_end(db_dsn, tmp, spec_with(f"{FAULTY}:NoSuchClass",
                                                             "process"))
    outcome = seen["outcome"]
    assert (state, attempt) == ("failed", 1), outcome
    assert outcome["error"] == "plugin failed"
    assert outcome["failure"]["detail"] == "launch"
    assert outcome["failure"]["code"] == "INVALID_ARGUMENT"
    message = outcome["failure"]["message"]
    assert "ant-1 exited with code 2 before it answered" in message
    assert f"{FAULTY}:NoSuchClass" in message and "has no NoSuchClass" in message
    plugin = outcome["plugin"]
    assert (plugin["plugin"], plugin["stage"], plugin["exception"], plugin["repeats"]) == \
        (f"{FAULTY}:NoSuchClass", "attribute", "AttributeError", True)
    assert "NoSuchClass" in describe(outcome)
    assert_not_retried(tmp)
    human = runs_show(db_dsn, seen["run"], json=False).stdout
    assert "NoSuchClass" in human and "AttributeError" in human


def test_a_missing_module_is_named_and_not_retried(db_dsn: str, tmp: Path) -> None:
    spec = spec_with(f"{FAULTY}:BadGainModel", "process")
    spec["agents"][0]["model"] = "tests.fixtures.plugins.no_such_module:Model"
    state, attempt, seen = run_to_end(db_dsn, tmp, spec)
    outcome = seen["outcome"]
    assert (state, attempt) == ("failed", 1), outcome
    assert outcome["error"] == "invalid run spec"
    assert outcome["path"] == "/agents/0/model"
    assert "tests.fixtures.plugins.no_such_module" in describe(outcome)
    assert log_events(tmp, "n", "recovery.started") == []
    assert log_events(tmp, "n", "launcher.launched") == []
    human = runs_show(db_dsn, seen["run"], json=False).stdout
    assert "no_such_module" in human


@pytest.mark.parametrize(("key", "impl", "detail", "participant", "summary"), [
    ("world", "OfflineArena", "launch", None,
     "ConnectionError: engine at 127.0.0.1:9 refused the connection"),
    ("task", "BadTask", "bootstrap", None, "KeyError: 'terminal'"),
], ids=["world", "task"])
def test_a_world_or_task_raising_in_its_constructor_fails_the_run_at_once(
        db_dsn: str, tmp: Path, key: str, impl: str, detail: str, participant: str | None,
        summary: str) -> None:
    spec = spec_with("workers.synthetic:FakeBrain", "process")
    spec[key]["impl"] = f"{FAULTY}:{impl}"
    state, attempt, seen = run_to_end(db_dsn, tmp, spec)
    outcome = seen["outcome"]
    assert (state, attempt) == ("failed", 1), outcome
    assert outcome["error"] == "plugin failed"
    assert (outcome["failure"]["detail"], outcome["failure"]["participant"]) == \
        (detail, participant)
    plugin = outcome["plugin"]
    assert (plugin["plugin"], plugin["stage"], plugin["repeats"]) == \
        (f"{FAULTY}:{impl}", "construct", True)
    assert summary in outcome["failure"]["message"] and summary in describe(outcome)
    assert "faulty.py" in plugin["frames"][-1] and "in __init__" in plugin["frames"][-1]
    assert_not_retried(tmp)

