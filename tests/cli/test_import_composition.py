"""`flyctl checkpoints import` keeps the composition that wrote the file, against a real
database and a real `flyd serve` node.

The run exported here is not the demo composition: three agents on their own ports with a
non-default graph variant (their dataset and index digests differ), a world with its own id,
step and observation delay (its patch digest differs) and another master seed. An import that
built the demo's spec used to be accepted and then fail its restore on the node; now the import
rebuilds the composition and the run resumes, and a `--spec` that cannot install the file is
refused at submit, exit 2, naming the field.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import orjson
import pytest

from flyd.session.runspec import RunSpec
from tests.cli.test_flyctl_runs import Site, flyctl, serve, wait_state
from tests.cli.test_flyctl_runs import site as site
from tests.cli.test_serve import submit as store_submit

pytestmark = pytest.mark.timeout(180)

AGENTS = ("ant-1", "ant-2", "ant-3")


def custom_spec(steps: int) -> dict[str, Any]:
    return RunSpec.validate({
        "steps": str(steps), "mode": "thread", "seed": "11",
        "agents": [{"agentId": a, "portId": f"q{i + 1}", "seed": None,
                    "modelConfig": {"graphVariant": 3}} for i, a in enumerate(AGENTS)],
        "world": {"worldId": "field", "step": {"numerator": "20000000", "denominator": "1"},
                  "observationDelaySteps": 1},
        "checkpoints": {"everySteps": 2}}, max_agents=4).to_json()


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_bytes(orjson.dumps(doc))
    return path


def _refused(site: Site, file: Path, spec: Path, *needles: str) -> None:
    ran = flyctl(site, "checkpoints", "import", str(file), "--steps", "10", "--spec", str(spec),
                 socket=False)
    assert ran.code == 2 and ran.json["error"]["code"] == "USAGE", ran
    message = ran.json["error"]["message"]
    for needle in needles:
        assert needle in message, message


def test_an_imported_custom_run_resumes_and_an_incompatible_spec_is_refused(site: Site) -> None:
    source = store_submit(site.dsn, custom_spec(6))
    config = site.path / "flyd.toml"
    config.write_text("[node]\nthreads = 8\n")  # three agents, the world, the coordinator
    serve(site, "n1", "--config", str(config))
    assert wait_state(site, source, {"succeeded", "failed"})["state"] == "succeeded"
    file = site.path / "run.flysess"
    exported = flyctl(site, "checkpoints", "export", str(source), "-o", str(file), socket=False)
    assert exported.code == 0 and exported.json["boundary"] == 6, exported

    # rebuilt from the file and the run that wrote it: resumes at 6 and reaches 10
    imported = flyctl(site, "checkpoints", "import", str(file), "--steps", "10", socket=False)
    assert imported.code == 0, imported
    run = imported.json["run"]
    assert wait_state(site, run, {"succeeded", "failed"})["state"] == "succeeded"
    shown = flyctl(site, "runs", "show", str(run), socket=False).json
    spec = shown["spec"]
    assert [(a["agentId"], a["portId"], a["modelConfig"]) for a in spec["agents"]] == [
        (a, f"q{i + 1}", {"graphVariant": 3}) for i, a in enumerate(AGENTS)]
    assert spec["world"]["worldId"] == "field" and spec["world"]["observationDelaySteps"] == 1
    assert spec["steps"] == "10" and spec["startFrom"]["checkpointId"]
    assert shown["progress"]["boundary"] == 10 and shown["recoveries"] == 0
    lines = flyctl(site, "runs", "export", str(run), json=False, socket=False)
    assert [orjson.loads(x)["boundary"] for x in lines.out.splitlines()] == [7, 8, 9, 10]

    # --spec: the demo composition, then near misses, each named by its field
    _refused(site, file, _write(site.path / "demo.json", {"mode": "thread"}), "/agents",
             "ant-1, ant-2, ant-3", "fly-a, fly-b")
    right = custom_spec(10)
    variant = copy.deepcopy(right)
    variant["agents"][1]["modelConfig"] = {}
    _refused(site, file, _write(site.path / "variant.json", variant), "/agents/1/modelConfig",
             "agent ant-2", "datasetDigest")
    delay = copy.deepcopy(right)
    delay["world"]["observationDelaySteps"] = 0
    _refused(site, file, _write(site.path / "delay.json", delay), "/world/config",
             "patchDigest")
    seeded = copy.deepcopy(right)
    seeded["agents"][2]["seed"] = 5
    _refused(site, file, _write(site.path / "seed.json", seeded), "/agents/2/seed", "seed")
    ports = copy.deepcopy(right)
    ports["agents"][0]["portId"] = "p1"
    _refused(site, file, _write(site.path / "ports.json", ports), "/agents/0/portId", "q1")
    missing = copy.deepcopy(right)
    missing["world"]["impl"] = "workers.synthetic:NoSuchWorld"
    _refused(site, file, _write(site.path / "missing.json", missing), "/world",
             "NoSuchWorld")
    assert flyctl(site, "runs", "list", socket=False).json["runs"][-1]["run"] == run, \
        "a refused import submitted a run"

    # the right spec is accepted, and its run resumes too
    accepted = flyctl(site, "checkpoints", "import", str(file), "--spec",
                      str(_write(site.path / "right.json", right)), socket=False)
    assert accepted.code == 0, accepted
    again = accepted.json["run"]
    assert wait_state(site, again, {"succeeded", "failed"})["state"] == "succeeded"
    shown = flyctl(site, "runs", "show", str(again), socket=False).json
    assert shown["progress"]["boundary"] == 10 and shown["spec"]["steps"] == "10"
