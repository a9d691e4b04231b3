"""The fly-arena example end to end (docs/examples.md): `flyd run --spec
examples/fly_arena/run.json --plugin-path <repository root>`, the README's command, succeeds and
gives the same behaviour digest in every mode; a fly (or the world) killed mid-run is replaced
and the run restored from its last checkpoint with the digest of an undisturbed run; and the
32-fly swarm (`examples/fly_arena/swarm.json` on a node configured by `swarm.toml`) runs in
process mode, which needs the router's per-client call limit sized for 32 agents and the world.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from flyd.node.router_child import required_limits
from tests.cli.test_run import ROOT, flyd_run
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(180)

EXAMPLE = Path("examples") / "fly_arena"
SPEC = str(EXAMPLE / "run.json")
PLUGINS = ("--plugin-path", str(ROOT))
STEPS = "60"
FLIES = ["fly-1", "fly-2", "fly-3", "fly-4"]
_CLEAN: dict[str, str] = {}


def clean_digest(tmp: Path) -> str:
    if "digest" not in _CLEAN:
        code, summary, _ = flyd_run(tmp, "--spec", SPEC, *PLUGINS, "--steps", STEPS,
                                    "--mode", "thread")
        assert code == 0 and summary["state"] == "succeeded", summary
        assert summary["recoveries"] == 0 and summary["epochs"] == ["e1"]
        _CLEAN["digest"] = summary["behaviourDigest"]
    return _CLEAN["digest"]


def test_the_example_runs_from_its_spec_with_the_same_digest_in_every_mode(tmp: Path) -> None:
    clean = clean_digest(tmp)
    code, summary, _ = flyd_run(tmp, "--spec", SPEC, *PLUGINS, "--steps", STEPS)
    assert code == 0, summary
    assert summary["state"] == "succeeded" and summary["mode"] == "process"
    assert summary["boundary"] == summary["steps"] == int(STEPS)
    assert sorted(w["workerId"] for w in summary["workers"]) == ["arena", *FLIES]
    assert len({w["pid"] for w in summary["workers"]}) == 5
    assert summary["counter"] > 0, "no fly reached the odour source"
    assert summary["checkpoints"] >= 3  # every 25 steps, and the final one
    assert summary["behaviourDigest"] == clean


@pytest.mark.parametrize("mode, kill", [("process", "kill:fly-2@35"),
                                        ("thread", "kill:arena@40")])
def test_a_killed_fly_is_recovered_with_the_clean_digest(tmp: Path, mode: str,
                                                         kill: str) -> None:
    clean = clean_digest(tmp)
    code, summary, _ = flyd_run(tmp, "--spec", SPEC, *PLUGINS, "--steps", STEPS,
                                "--mode", mode, "--fault", kill)
    assert code == 0, summary
    assert summary["state"] == "succeeded" and summary["mode"] == mode
    assert summary["recoveries"] == 1 and summary["epochs"] == ["e1", "e2"], summary
    assert [f["participant"] for f in summary["failures"]] == [kill[5:].partition("@")[0]]
    assert summary["checkpoints"] >= 2  # restored from the one at 25, and the final one
    assert summary["behaviourDigest"] == clean


def test_thirty_two_flies_run_in_process_mode(tmp: Path) -> None:
    code, summary, _ = flyd_run(tmp, "--spec", str(EXAMPLE / "swarm.json"), *PLUGINS,
                                "--config", str(ROOT / EXAMPLE / "swarm.toml"),
                                "--steps", "20", timeout=150)
    assert code == 0, summary
    assert summary["state"] == "succeeded" and summary["mode"] == "process"
    assert summary["recoveries"] == 0 and summary["boundary"] == 20
    agents = [w for w in summary["workers"] if w["role"] == "agent"]
    assert len(agents) == 32 and len({w["pid"] for w in summary["workers"]}) == 33
    assert summary["checkpoints"] == 1  # the final capture: 33 answers, 33 acknowledgements


def test_the_router_call_limit_covers_two_calls_per_participant() -> None:
    for max_agents in (1, 4, 32, 256):
        limits = required_limits(1, max_agents)
        assert limits["max_active_calls_per_client"] >= 2 * (max_agents + 1)
