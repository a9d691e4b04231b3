"""A restored world that does not observe what its checkpoint recorded (session.md §6.12,
amendment 2026-12-07: behaviour record v2 and verified restore), through `flyd run` with real
processes.

The worlds are tests/fixtures/plugins/diverging.py's: the synthetic arena, except that once
restored it flips the last byte of every frame it renders (`ForgetfulArena`), or does so only
from its second step after the restore (`LateForgetfulArena`). No agent reads that byte and the
task reads only the inspection, so every decision, control and reward of the recovered run is
that of an undisturbed one. Under the v1 record (view step numbers, reward event ids) and
without the restore check, every run below succeeded as a clean recovery and printed the
undisturbed run's `behaviourDigest`. Now:
- the restored world renders its views again at the restore: the attempt fails
  `RESTORE_DIVERGED` naming the world and the view, found by the coordinator for an undelayed
  view (against its record) and by the world itself for a delayed one (against the
  checkpoint's frame of the restored boundary), and no attempt continues;
- a world that diverges only later passes the restore, and the v2 record sees it from the first
  boundary that serves a changed frame: the digest differs from the clean run's while the v1
  projection of every record is identical (so the digest test fails without record v2).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from flyd.outcome import describe
from tests.cli.test_flyctl_runs import FLYCTL
from tests.cli.test_run import ROOT, env_for, flyd_run
from tests.cli.test_run import tmp as tmp
from tests.cli.test_wide_runs import events
from workers.types.canonical import digest_of

pytestmark = pytest.mark.timeout(240)

PLUGINS = "tests.fixtures.plugins.diverging"
STEPS = 12
KILL = "kill:fly-b@6"  # the head is then boundary 4 (cadence 4)


def run(tmp: Path, *args: str, world: str = "ForgetfulArena", delay: int = 0,
        trace: Path | None = None) -> tuple[int, dict[str, Any], str]:
    config = tmp / "quick.toml"
    config.write_text("[checkpoints]\nrecovery_max_attempts = 2\nrecovery_backoff_s = 0.05\n")
    spec = tmp / f"spec-{delay}.json"
    spec.write_bytes(orjson.dumps({"world": {"observationDelaySteps": delay}}))
    extra = ["--trace", str(trace)] if trace is not None else []
    return flyd_run(tmp, "--world", f"{PLUGINS}:{world}", "--plugin-path", str(ROOT),
                    "--spec", str(spec), "--steps", str(STEPS), "--checkpoint-every", "4",
                    "--mode", "thread", "--config", str(config), *extra, *args, timeout=200)


def records(path: Path) -> list[dict[str, Any]]:
    """The trace's behaviour records, without its resume marks (docs/cli.md, "The behaviour
    trace": a grant's and a recovery's first line says where it resumes)."""
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert lines and "resume" in lines[0], "the trace starts with the grant's resume mark"
    return [line for line in lines if "resume" not in line]


def v1(record: dict[str, Any]) -> dict[str, Any]:
    """A v2 behaviour record as the v1 builder wrote it."""
    out = {k: v for k, v in record.items() if k not in ("inputDigests", "rewardsDigest")}
    out["observationBoundaries"] = [{"viewId": e["viewId"], "producedStep": e["producedStep"]}
                                    for e in record["observationBoundaries"]]
    return out


@pytest.mark.parametrize(("delay", "said"), [
    (0, "at boundary 4: view arena is frame 4 with digest"),
    (1, "at boundary 4: view arena: frame 4 rendered again by the restored world has digest"),
], ids=["undelayed view, the coordinator's check", "delayed view, the world's own check"])
def test_a_world_that_mutates_an_observation_after_restore_ends_restore_diverged(
        tmp: Path, delay: int, said: str) -> None:
    code, summary, stderr = run(tmp, "--fault", KILL, delay=delay)
    assert code == 1 and summary["state"] == "failed", summary
    # the fault happened: fly-b was killed at step 6 and recovery restored the head
    assert events(stderr, "faults.fired"), "the kill never fired"
    first, *attempts = summary["failures"]
    assert first["participant"] == "fly-b", first
    assert len(events(stderr, "recovery.started")) == 2
    # every attempt failed at the restore, naming the world and the view, and never resumed
    assert not events(stderr, "recovery.resumed")
    assert [(f["code"], f["participant"], f["detail"]) for f in attempts] == [
        ("RESTORE_DIVERGED", "arena", "restore")] * len(attempts) and attempts
    outcome = summary["outcome"]
    assert outcome["error"] == "recovery attempts exhausted", outcome
    last = outcome["lastFailure"]
    assert (last["code"], last["participant"]) == ("RESTORE_DIVERGED", "arena"), last
    assert last["message"].startswith("State.ActivateRestore: restored world arena diverged "
                                      "from checkpoint "), last["message"]
    assert said in last["message"], last["message"]
    reason = describe(outcome)
    assert "RESTORE_DIVERGED" in reason and "view arena" in reason and "arena" in reason
    assert f"flyd run: run {summary['run']} failed: {reason}" in stderr.splitlines()
    # and `flyctl runs show` says the same
    dsn = env_for(tmp)["FLYD_DSN"]
    shown = subprocess.run([*FLYCTL, "runs", "show", str(summary["run"]), "--json", "--dsn",
                            dsn], cwd=ROOT, env=env_for(tmp), capture_output=True, timeout=60,
                           check=False)
    assert shown.returncode == 0, shown.stderr
    doc = orjson.loads(shown.stdout)
    assert doc["reason"] == reason
    assert doc["outcome"]["lastFailure"]["code"] == "RESTORE_DIVERGED"


def test_a_world_that_mutates_an_observation_later_changes_the_behaviour_digest(
        tmp: Path) -> None:
    clean_trace, trace = tmp / "clean.jsonl", tmp / "recovered.jsonl"
    world = "LateForgetfulArena"
    code, clean, _ = run(tmp, world=world, trace=clean_trace)
    assert code == 0 and clean["state"] == "succeeded", clean
    code, summary, stderr = run(tmp, "--fault", KILL, world=world, trace=trace)
    assert code == 0 and summary["state"] == "succeeded", summary
    # the fault happened and the run was recovered from the head at 4, which passed the check
    assert events(stderr, "faults.fired") and summary["recoveries"] == 1, summary
    [restored] = events(stderr, "recovery.restored")
    assert restored["boundary"] == 4
    ours, theirs = records(trace), records(clean_trace)
    assert len(ours) == len(theirs) == STEPS
    assert digest_of(ours) == summary["behaviourDigest"]
    assert digest_of(theirs) == clean["behaviourDigest"]
    # v1 could not tell them apart: every record's v1 projection is the clean run's
    assert [v1(r) for r in ours] == [v1(r) for r in theirs]
    # v2 does: the digest differs, first at boundary 6 (the restored world's second step)
    assert summary["behaviourDigest"] != clean["behaviourDigest"]
    differing = [int(r["publishedBoundary"]) for r, c in zip(ours, theirs, strict=True)
                 if r != c]
    assert differing == list(range(6, STEPS + 1)), differing
    for r, c in zip(ours[5:], theirs[5:], strict=True):
        assert r["observationBoundaries"] != c["observationBoundaries"]
        assert (r["inputDigests"], r["rewardsDigest"]) == (c["inputDigests"], c["rewardsDigest"])
