"""`flyctl runs export` and `runs show`'s spec, progress and recoveries, against a real
database and a real `flyd serve` node.

The export's lines are recorded with the effects, in the same insert, so a run recovered from
a killed worker exports exactly what an undisturbed run of the same spec does.
"""

from __future__ import annotations

import orjson
import pytest

from tests.cli.test_flyctl_runs import Site, flyctl, serve, submit, wait_state
from tests.cli.test_flyctl_runs import site as site

pytestmark = pytest.mark.timeout(180)

STEPS = 12
KEYS = {"boundary", "worldTime", "rewards", "events", "progress"}


def _export(site: Site, run: int, *args: str) -> list[bytes]:
    ran = flyctl(site, "runs", "export", str(run), *args, json=False, socket=False)
    assert ran.code == 0, ran
    return ran.out.encode().splitlines()


def test_a_recovered_run_exports_the_lines_of_an_undisturbed_one(site: Site) -> None:
    common = ("--steps", str(STEPS), "--mode", "thread", "--checkpoint-every", "4")
    clean = submit(site, *common)
    killed = submit(site, *common, "--fault", "kill:fly-b@6")
    serve(site)
    assert wait_state(site, clean, {"succeeded", "failed"})["state"] == "succeeded"
    assert wait_state(site, killed, {"succeeded", "failed"})["state"] == "succeeded"

    out = site.path / "clean.jsonl"
    written = flyctl(site, "runs", "export", str(clean), "-o", str(out), socket=False)
    assert written.code == 0, written
    assert written.json == {"run": clean, "lines": STEPS, "file": str(out)}
    lines = out.read_bytes().splitlines()
    assert _export(site, clean) == lines, "stdout (no -o) and the file differ"
    assert _export(site, clean, "-o", "-") == lines
    recovered = _export(site, killed)
    assert recovered == lines, "the recovered run's export differs from the undisturbed one"

    docs = [orjson.loads(line) for line in lines]
    assert [d["boundary"] for d in docs] == list(range(1, STEPS + 1))
    for doc in docs:
        assert set(doc) >= KEYS
        assert set(doc["rewards"]) == {"fly-a", "fly-b"}
        assert doc["progress"]["schema"]["id"] == "arena.progress.v1", doc["progress"]
    last = docs[-1]
    assert last["progress"]["value"]["transitions"] == STEPS
    rewards = sum(r["value"] for d in docs for agent in d["rewards"].values() for r in agent)
    assert rewards == last["progress"]["value"]["totalReward"]
    assert all(e["id"].startswith("ev-") for d in docs for e in d["events"])
    assert last["worldTime"] == {"numerator": str(50_000_000 * STEPS // 3), "denominator": "1"}

    shown = flyctl(site, "runs", "show", str(killed), socket=False)
    assert shown.code == 0
    doc = shown.json
    assert doc["recoveries"] == 1 and doc["epochs"] == ["e1", "e2"]
    assert doc["spec"]["steps"] == str(STEPS) and doc["spec"]["mode"] == "thread"
    assert doc["spec"]["injections"]["kill"] == [{"worker": "fly-b", "step": "6"}]
    assert doc["progress"]["boundary"] == STEPS and doc["progress"]["steps"] == STEPS
    assert doc["progress"]["task"] == last["progress"]
    human = flyctl(site, "runs", "show", str(killed), json=False, socket=False)
    assert human.code == 0 and human.err == ""
    assert f"progress: boundary {STEPS}/{STEPS}" in human.out
    assert " recoveries 1 " in human.out.splitlines()[0]
    assert "  agent fly-b  port p2  model workers.synthetic:FakeBrain" in human.out


def test_export_of_an_unknown_run_exits_2(site: Site) -> None:
    ran = flyctl(site, "runs", "export", "99", socket=False)
    assert ran.code == 2 and ran.json["error"]["code"] == "USAGE"
    assert "no run 99" in ran.json["error"]["message"]
    out = site.path / "none.jsonl"
    refused = flyctl(site, "runs", "export", "99", "-o", str(out), json=False, socket=False)
    assert refused.code == 2 and "no run 99" in refused.err and not out.exists()


def test_a_run_without_boundaries_exports_nothing(site: Site) -> None:
    run = submit(site, "--steps", "5", "--mode", "thread")
    ran = flyctl(site, "runs", "export", str(run), json=False, socket=False)
    assert ran.code == 0 and ran.out == ""
    assert f"0 boundaries of run {run} -> -" in ran.err
    shown = flyctl(site, "runs", "show", str(run), socket=False).json
    assert shown["progress"] == {"boundary": 0, "steps": 5, "task": None}
    assert shown["spec"]["steps"] == "5"
