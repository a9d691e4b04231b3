"""The examples package end to end: `flyd run --spec examples/reaching/run.json` (docs/plugins.md)
in process and in thread mode, each with a worker killed and recovered from a checkpoint, gives
the behaviour digest of an undisturbed run.

The repository root, which holds the `examples` package, is named by `--plugin-path`, so the
node and every worker it starts import the package from there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_run import ROOT, flyd_run
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(180)

SPEC = str(Path("examples") / "reaching" / "run.json")
PLUGINS = ("--plugin-path", str(ROOT))
STEPS = "40"
_CLEAN: dict[str, str] = {}


def clean_digest(tmp: Path) -> str:
    if "digest" not in _CLEAN:
        code, summary, _ = flyd_run(tmp, "--spec", SPEC, *PLUGINS, "--steps", STEPS,
                                    "--mode", "thread")
        assert code == 0 and summary["state"] == "succeeded", summary
        assert summary["recoveries"] == 0 and summary["epochs"] == ["e1"]
        assert summary["counter"] > 0, "the goal seekers reached no goal"
        _CLEAN["digest"] = summary["behaviourDigest"]
    return _CLEAN["digest"]


def test_the_spec_file_is_in_the_repository() -> None:
    assert (ROOT / SPEC).is_file()


@pytest.mark.parametrize("mode, kill", [("process", "kill:ant-b@25"),
                                        ("thread", "kill:plane@15")])
def test_the_example_recovers_a_killed_worker_with_the_clean_digest(tmp: Path, mode: str,
                                                                     kill: str) -> None:
    clean = clean_digest(tmp)
    code, summary, _ = flyd_run(tmp, "--spec", SPEC, *PLUGINS, "--steps", STEPS, "--mode",
                                mode, "--fault", kill)
    assert code == 0, summary
    assert summary["state"] == "succeeded" and summary["mode"] == mode
    assert summary["recoveries"] == 1 and summary["epochs"] == ["e1", "e2"], summary
    assert [f["participant"] for f in summary["failures"]] == [kill[5:].partition("@")[0]]
    assert sorted(w["workerId"] for w in summary["workers"]) == ["ant-a", "ant-b", "plane"]
    assert summary["checkpoints"] >= 2  # restored from a checkpoint, and the final one
    assert summary["behaviourDigest"] == clean
