"""`--spec FILE`, the composition shortcuts and plugin import roots, with real processes.

`flyd run` and `flyctl runs submit` run as subprocesses on the test's own database and private
socket (`tests.cli.test_flyctl_runs.Site`). The plugin package is written into the test's
temporary directory, outside every import root the node has by default: its model and world
are the synthetic ones plus a marker file, named after the worker and its pid and holding the
config it was given, written by each constructor, so a test sees which process really built
which plugin with which config. (The model's config is checked by class methods before the
constructor runs, so the marker directory is written into the package rather than passed in.)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from flyd.session.runspec import RunSpec
from tests.cli.test_flyctl_runs import ROOT, Site, flyctl, leftovers, serve, wait_state
from tests.cli.test_flyctl_runs import site as site

pytestmark = pytest.mark.timeout(120)

PLUGIN = '''
"""A plugin package for the tests: the synthetic model and world, marking their builds."""

import json
import os

from workers.synthetic import CounterArena, FakeBrain

MARKS = @MARKS@


def _mark(name, config):
    with open(os.path.join(MARKS, f"{name}.{os.getpid()}"), "w") as fh:
        fh.write(json.dumps(config, sort_keys=True))


class MarkedBrain(FakeBrain):
    def __init__(self, *, config, **kwargs):
        super().__init__(config=config, **kwargs)
        _mark(self.agent_id, dict(config))


class MarkedArena(CounterArena):
    """Takes one config key of its own, `label`, which the counter arena would refuse."""

    def __init__(self, *, config, **kwargs):
        rest = {k: v for k, v in config.items() if k != "label"}
        super().__init__(config=rest, **kwargs)
        self.config = dict(config)  # the config asset is over the whole config
        _mark(self.world_id, self.config)
'''

THREE_AGENTS = [{"agentId": f"ant-{i}", "portId": f"p{i}"} for i in (1, 2, 3)]
TWO_AGENTS = THREE_AGENTS[:2]


def flyd_run(site: Site, *args: str, timeout: float = 90) -> tuple[int, dict[str, Any], str]:
    """`flyd run --json …`: exit code, the one JSON line on stdout, stderr."""
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--socket", site.socket, *args]
    out = subprocess.run(argv, cwd=ROOT, env=site.env(), capture_output=True, timeout=timeout,
                         check=False)
    assert not leftovers(site.path), "a router or worker outlived flyd run"
    err = out.stderr.decode()
    assert "Traceback" not in err
    lines = out.stdout.decode().splitlines()
    assert len(lines) == 1, (out.stdout, err)
    return out.returncode, orjson.loads(lines[0]), err


def write_spec(site: Site, doc: Any, name: str = "spec.json") -> Path:
    path = site.path / name
    path.write_bytes(orjson.dumps(doc))
    return path


def stored_spec(site: Site, run_id: int) -> dict[str, Any]:
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT spec FROM flyd.runs WHERE run_id = %s", (run_id,)).fetchone()
    assert row is not None
    spec = row[0]
    assert isinstance(spec, dict)
    return spec


def plugin_root(site: Site) -> Path:
    """`<tmp>/plug/flyplug/__init__.py` and an empty marker directory `<tmp>/marks`."""
    root = site.path / "plug"
    (root / "flyplug").mkdir(parents=True)
    (site.path / "marks").mkdir()
    (root / "flyplug" / "__init__.py").write_text(
        PLUGIN.replace("@MARKS@", repr(str(site.path / "marks"))))
    return root


def marks(site: Site) -> dict[str, set[tuple[int, str]]]:
    """Worker id → (pid, config) of each build of its plugin."""
    out: dict[str, set[tuple[int, str]]] = {}
    for path in (site.path / "marks").iterdir():
        name, _, pid = path.name.rpartition(".")
        out.setdefault(name, set()).add((int(pid), path.read_text()))
    return out


# --------------------------------------------------------------------------------------------


def test_a_partial_spec_file_is_completed_and_runs(site: Site) -> None:
    spec = write_spec(site, {"steps": "12", "mode": "thread", "agents": THREE_AGENTS})
    code, summary, _ = flyd_run(site, "--spec", str(spec))
    assert code == 0 and summary["state"] == "succeeded"
    assert summary["steps"] == summary["boundary"] == 12 and summary["mode"] == "thread"
    assert sorted(w["workerId"] for w in summary["workers"]) == ["ant-1", "ant-2", "ant-3",
                                                                 "arena"]
    stored = stored_spec(site, summary["run"])
    assert stored == RunSpec.normalise({"steps": "12", "mode": "thread",
                                        "agents": THREE_AGENTS, "exclusiveToSubmitter": True,
                                        "checkpoints": {"everySteps": 60,
                                                        "everySeconds": 0.0}})
    assert [a["model"] for a in stored["agents"]] == ["workers.synthetic:FakeBrain"] * 3


def test_options_given_override_the_file_and_the_rest_of_the_file_stands(site: Site) -> None:
    # the configuration's [session] defaults are no option given: the file's mode and
    # dispatch stand; --steps, given, overrides the file's 30
    config = site.path / "flyd.toml"
    config.write_text('[session]\nmode = "in-process"\ndispatch = "reversed"\n')
    spec = write_spec(site, {"steps": "30", "mode": "thread", "dispatch": "sequential",
                             "seed": "99", "checkpoints": {"everySteps": 4}})
    code, summary, _ = flyd_run(site, "--spec", str(spec), "--steps", "6", "--config",
                                str(config))
    assert code == 0 and summary["state"] == "succeeded"
    assert summary["steps"] == summary["boundary"] == 6 and summary["mode"] == "thread"
    stored = stored_spec(site, summary["run"])
    assert (stored["steps"], stored["mode"], stored["dispatch"], stored["seed"]) == \
        ("6", "thread", "sequential", "99")
    assert stored["checkpoints"]["everySteps"] == 4
    code, summary, _ = flyd_run(site, "--spec", str(spec), "--steps", "3", "--mode",
                                "inprocess", "--checkpoint-every", "0", "--config", str(config))
    assert code == 0 and summary["mode"] == "in-process"
    stored = stored_spec(site, summary["run"])
    assert (stored["mode"], stored["dispatch"], stored["checkpoints"]["everySteps"]) == \
        ("in-process", "sequential", 0)


@pytest.mark.parametrize(("mode", "how"), [("process", "flag"), ("process", "config-spawn"),
                                           ("thread", "config")])
def test_a_plugin_is_found_through_its_import_root(site: Site, mode: str, how: str) -> None:
    root = plugin_root(site)
    if how == "flag":
        roots = ["--plugin-path", str(root)]
    else:  # relative to the config file's directory
        launcher = 'launcher = "spawn"\n' if how == "config-spawn" else ""
        config = site.path / "flyd.toml"
        config.write_text(f'[plugins]\npaths = ["plug"]\n[session]\n{launcher}')
        roots = ["--config", str(config)]
    spec = write_spec(site, {"steps": "8", "mode": mode, "agents": THREE_AGENTS})
    code, summary, err = flyd_run(
        site, "--spec", str(spec), *roots, "--model", "flyplug:MarkedBrain",
        "--model-config", '{"graphVariant": 1}', "--world", "flyplug:MarkedArena",
        "--world-config", '{"label": "L7"}')
    assert code == 0 and summary["state"] == "succeeded", err
    pids = {w["workerId"]: w["pid"] for w in summary["workers"]}
    assert marks(site) == {
        **{f"ant-{i}": {(pids[f"ant-{i}"], '{"graphVariant": 1}')} for i in (1, 2, 3)},
        "arena": {(pids["arena"], '{"label": "L7"}')}}
    assert len(set(pids.values())) == (4 if mode == "process" else 1)
    stored = stored_spec(site, summary["run"])
    assert {a["model"] for a in stored["agents"]} == {"flyplug:MarkedBrain"}
    assert all(a["modelConfig"] == {"graphVariant": 1} for a in stored["agents"])
    assert stored["world"]["impl"] == "flyplug:MarkedArena"
    assert stored["world"]["config"] == {"label": "L7"}


def test_without_its_import_root_a_plugin_is_refused_naming_where(site: Site) -> None:
    plugin_root(site)
    code, doc, err = flyd_run(site, "--model", "flyplug:MarkedBrain")
    assert code == 2 and doc["error"]["code"] == "USAGE"
    assert "--model flyplug:MarkedBrain: module of flyplug:MarkedBrain cannot be found" in err
    spec = write_spec(site, {"agents": [{"agentId": "a", "portId": "p1"},
                                        {"agentId": "b", "portId": "p2",
                                         "model": "flyplug:MarkedBrain"}]})
    code, doc, err = flyd_run(site, "--spec", str(spec))
    assert code == 2
    assert f"--spec {spec}: run spec /agents/1/model: module of flyplug:MarkedBrain cannot " \
           "be found" in err
    code, doc, err = flyd_run(site, "--plugin-path", str(site.path / "nowhere"))
    assert code == 2 and "[plugins] paths" in err and "is not a directory" in err


def test_a_bad_spec_or_shortcut_exits_2_naming_the_json_path_or_option(site: Site) -> None:
    bad_model = write_spec(site, {"agents": [{"agentId": "a", "portId": "p1"},
                                             {"agentId": "b", "portId": "p2",
                                              "model": "no path"}]})
    code, doc, err = flyd_run(site, "--spec", str(bad_model))
    assert code == 2 and doc["error"]["code"] == "USAGE"
    assert "run spec /agents/1/model: must be an import path" in doc["error"]["message"]
    assert "/agents/1/model" in err
    unknown = write_spec(site, {"world": {"colour": "blue"}}, "unknown.json")
    code, doc, err = flyd_run(site, "--spec", str(unknown))
    assert code == 2 and "run spec /world/colour: unknown key 'colour'" in err
    (site.path / "broken.json").write_text('{"steps": ')
    code, doc, err = flyd_run(site, "--spec", str(site.path / "broken.json"))
    assert code == 2 and f"--spec {site.path / 'broken.json'}: not valid JSON" in err
    code, doc, err = flyd_run(site, "--spec", str(site.path / "absent.json"))
    assert code == 2 and "cannot read: No such file or directory" in err
    code, doc, err = flyd_run(site, "--model-config", '{"graphVariant": ')
    assert code == 2 and "--model-config: not valid JSON" in err
    code, doc, err = flyd_run(site, "--world-config", "[1]")
    assert code == 2 and "--world-config: must be a JSON object; got list" in err
    code, doc, err = flyd_run(site, "--world", "arena")
    assert code == 2 and "--world: must be an import path package.module:Class" in err
    ran = flyctl(site, "runs", "submit", "--spec", str(bad_model), socket=False)
    assert ran.code == 2 and "run spec /agents/1/model" in ran.json["error"]["message"]


def test_runs_submit_stores_the_normalised_spec_and_a_node_runs_it(site: Site) -> None:
    root = plugin_root(site)
    # two agents: a default node on a two-core host has four threads, the coordinator's, the
    # world's and two agents'
    spec = write_spec(site, {"steps": "9", "mode": "thread", "agents": TWO_AGENTS,
                             "exclusiveToSubmitter": True})
    ran = flyctl(site, "runs", "submit", "--spec", str(spec), "--model", "flyplug:MarkedBrain",
                 "--model-config", '{"graphVariant": 2}', socket=False)
    assert ran.code == 0, ran
    run_id = ran.json["run"]
    stored = stored_spec(site, run_id)
    agents = [{**a, "model": "flyplug:MarkedBrain", "modelConfig": {"graphVariant": 2}}
              for a in TWO_AGENTS]
    assert stored == RunSpec.normalise({"steps": "9", "mode": "thread", "agents": agents,
                                        "checkpoints": {"everySteps": 60,
                                                        "everySeconds": 0.0}})
    assert stored["exclusiveToSubmitter"] is False  # any node may claim a submitted run
    serve(site, "n1", "--plugin-path", str(root))
    row = wait_state(site, run_id, {"succeeded", "failed"})
    assert row["state"] == "succeeded", row
    assert set(marks(site)) == {"ant-1", "ant-2"}
