"""The PettingZoo and Gymnasium adapters end to end (docs/adapters.md): a PettingZoo
`ParallelEnv` of this tree (`tests.cli.adapter_envs:LineEnv`) runs as the world
(`ParallelEnvWorld`) with `PolicyModel` agents through `flyd run --spec` in process and thread
mode, and a killed agent or world is recovered with the behaviour digest of an undisturbed run;
a Gymnasium single-agent `Env` runs as a world of one agent, and its end ends the episode.

The repository root is named by `--plugin-path`, so the node and every worker it starts import
the tests' environments and policies from there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.cli.test_run import ROOT, flyd_run
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(180)

PLUGINS = ("--plugin-path", str(ROOT))
ENVS = "tests.cli.adapter_envs"
_CLEAN: dict[str, str] = {}


def line_spec(tmp: Path, **world: Any) -> str:
    """Two walkers on a line, one policy a function and one a callable object with state."""
    doc = {
        "sessionId": "line", "steps": "40", "seed": "7",
        "agents": [
            {"agentId": "walker-a", "portId": "p1",
             "model": "workers.adapters.pettingzoo:PolicyModel",
             "modelConfig": {"policy": f"{ENVS}:walk"}},
            {"agentId": "walker-b", "portId": "p2",
             "model": "workers.adapters.pettingzoo:PolicyModel",
             "modelConfig": {"policy": f"{ENVS}:stubborn"}}],
        "world": {"worldId": "line", "impl": "workers.adapters.pettingzoo:ParallelEnvWorld",
                  "config": {"env": f"{ENVS}:LineEnv", "kwargs": {"size": 16},
                             "render": True, "seed": 3, "episodes": 1, **world}},
        "task": {"impl": "workers.adapters.pettingzoo:EnvTask", "config": {},
                 "terminal": "never"},
        "checkpoints": {"everySteps": 5},
    }
    path = tmp / "line.json"
    path.write_text(json.dumps(doc))
    return str(path)


def slide_spec(tmp: Path) -> str:
    """One agent on a Gymnasium env with a Box action; the episode ends with the env."""
    doc = {
        "sessionId": "slide", "steps": "30", "seed": "5",
        "agents": [{"agentId": "slider", "portId": "p1",
                    "model": "workers.adapters.pettingzoo:PolicyModel",
                    "modelConfig": {"policy": f"{ENVS}:slide"}}],
        "world": {"worldId": "track", "impl": "workers.adapters.gymnasium:EnvWorld",
                  "config": {"env": f"{ENVS}:SlideEnv", "render": True, "seed": 11,
                             "episodes": 1}},
        "task": {"impl": "workers.adapters.pettingzoo:EnvTask", "config": {},
                 "terminal": "done"},
        "checkpoints": {"everySteps": 3},
    }
    path = tmp / "slide.json"
    path.write_text(json.dumps(doc))
    return str(path)


def clean(tmp: Path, name: str) -> dict[str, Any]:
    spec = line_spec(tmp) if name == "line" else slide_spec(tmp)
    code, summary, _ = flyd_run(tmp, "--spec", spec, *PLUGINS, "--mode", "thread")
    assert code == 0 and summary["state"] == "succeeded", summary
    assert summary["recoveries"] == 0 and summary["epochs"] == ["e1"]
    return summary


def clean_digest(tmp: Path, name: str) -> str:
    if name not in _CLEAN:
        _CLEAN[name] = clean(tmp, name)["behaviourDigest"]
    return _CLEAN[name]


def test_a_parallel_env_runs_to_its_end_and_on(tmp: Path) -> None:
    summary = clean(tmp, "line")
    _CLEAN.setdefault("line", summary["behaviourDigest"])
    # terminal never: the run goes on for its 40 steps after both walkers arrived (the env's
    # steps are the counter), with every step's frame rendered and checkpoints taken
    assert summary["boundary"] == summary["steps"] == 40
    assert 0 < summary["counter"] < 40
    assert summary["checkpoints"] >= 2  # hot ones (a busy writer defers some) and the final
    assert sorted(w["workerId"] for w in summary["workers"]) == ["line", "walker-a", "walker-b"]


@pytest.mark.parametrize("mode, kill", [("process", "kill:walker-b@12"),
                                        ("thread", "kill:line@17")])
def test_a_parallel_env_recovers_a_killed_worker_with_the_clean_digest(
        tmp: Path, mode: str, kill: str) -> None:
    digest = clean_digest(tmp, "line")
    code, summary, _ = flyd_run(tmp, "--spec", line_spec(tmp), *PLUGINS, "--mode", mode,
                                "--fault", kill)
    assert code == 0, summary
    assert summary["state"] == "succeeded" and summary["mode"] == mode
    assert summary["recoveries"] == 1 and summary["epochs"] == ["e1", "e2"], summary
    assert [f["participant"] for f in summary["failures"]] == [kill[5:].partition("@")[0]]
    assert summary["behaviourDigest"] == digest


def test_a_gymnasium_env_is_a_world_of_one_agent_and_its_end_ends_the_episode(
        tmp: Path) -> None:
    summary = clean(tmp, "slide")
    _CLEAN.setdefault("slide", summary["behaviourDigest"])
    assert 0 < summary["boundary"] < 30, "the slider never reached its target"
    assert summary["counter"] == summary["boundary"]
    code, killed, _ = flyd_run(tmp, "--spec", slide_spec(tmp), *PLUGINS, "--mode", "process",
                               "--fault", f"kill:track@{summary['boundary'] - 2}")
    assert code == 0 and killed["state"] == "succeeded", killed
    assert killed["recoveries"] == 1 and killed["boundary"] == summary["boundary"]
    assert killed["behaviourDigest"] == summary["behaviourDigest"]
