"""Every run that does not succeed says why (issue 17 item 5): `flyd run`'s summary and stderr,
and `flyctl runs show`, name the outcome whatever its shape (`flyd.outcome`).

A durable capture a participant refuses late in a run (after Initialize's size check) is named
too: refused `UNSUPPORTED` (a checkpoint over one bus frame) the run fails at once with
`checkpoint capture refused`; refused otherwise it is retried and ends `attempts exhausted`
with `lastCaptureRefusal` (`flyd.node.grant`)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from flyd.leases.params import LeaseParams
from flyd.leases.stores.contract import NodeInfo
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.outcome import describe, failure_of, traceback_of
from tests.cli.test_flyctl_runs import FLYCTL
from tests.cli.test_run import ROOT, env_for, flyd_run
from tests.cli.test_run import tmp as tmp
from tests.cli.test_wide_runs import events

pytestmark = pytest.mark.timeout(180)

KINDS: list[tuple[str, dict[str, Any], dict[str, Any], list[str]]] = [
    ("checkpoint too large (bytes)", {"error": "checkpoint too large", "byteLength": 70000000,
                                      "limit": 67108864}, {},
     ["checkpoint too large", "70000000 bytes", "max_envelope_bytes 67108864"]),
    ("checkpoint too large (payloads)", {"error": "checkpoint too large", "byteLength": 900,
                                         "limit": 67108864, "payloadCount": 1030,
                                         "payloadLimit": 1024}, {},
     ["checkpoint too large", "1030 payloads", "holds 1024"]),
    ("attempts exhausted", {"reaped": "attempts exhausted"},
     {"last_loss": "unknown_outcome_lost",
      "last_grant": {"leaseEpoch": 3, "nodeId": "n-1", "endReason": "exhausted"}},
     ["attempts exhausted", "last lease loss: unknown_outcome_lost",
      "last grant 3 on n-1 ended exhausted"]),
    ("invalid run spec", {"error": "invalid run spec", "path": "/checkpoints/everySteps",
                          "reason": "must be an integer"}, {},
     ["invalid run spec at /checkpoints/everySteps", "must be an integer"]),
    ("launch failed", {"error": "launch failed", "failure": {
        "detail": "launch", "participant": "fly-b", "code": "TIMEOUT", "mutation": "none",
        "message": "fly-b did not identify within 0.001 s"}}, {},
     ["launch failed", "fly-b", "TIMEOUT", "did not identify"]),
    ("recovery attempts exhausted", {"error": "recovery attempts exhausted", "attempts": 3,
                                     "lastFailure": {"detail": "acknowledge",
                                                     "participant": "arena",
                                                     "code": "INVALID_ARGUMENT",
                                                     "message": "unknown id req-9999"}}, {},
     ["after 3 attempts", "acknowledge of arena", "INVALID_ARGUMENT", "req-9999"]),
    ("recovery attempts exhausted (restore diverged)", {
        "error": "recovery attempts exhausted", "attempts": 3,
        "lastFailure": {"detail": "restore", "participant": "arena", "code": "RESTORE_DIVERGED",
                        "message": "State.ActivateRestore: restored world arena diverged from "
                                   "checkpoint ck-e1-4 at boundary 4: view arena is frame 4"}},
     {}, ["after 3 attempts", "restore of arena", "RESTORE_DIVERGED",
          "restored world arena diverged", "view arena"]),
    ("checkpoint capture refused", {"error": "checkpoint capture refused", "failure": {
        "detail": "capture", "participant": "arena", "code": "UNSUPPORTED", "mutation": "none",
        "message": "checkpoint payload of 69155 bytes does not fit one bus frame (limit 65536)",
        "checkpointId": "ck-e1-1-final"}}, {},
     ["checkpoint capture refused by arena: UNSUPPORTED: checkpoint payload of 69155 bytes",
      "(limit 65536)", "ck-e1-1-final"]),
    ("attempts exhausted (capture refused)", {"error": "attempts exhausted",
                                              "lastCaptureRefusal": {
        "detail": "capture", "participant": "arena", "code": "BACKEND_FAILURE",
        "mutation": "none", "message": "injected capture failure",
        "checkpointId": "ck-e1-1-final"}},
     {"last_grant": {"leaseEpoch": 3, "nodeId": "n-1", "endReason": "finished"}},
     ["attempts exhausted (checkpoint capture refused by arena: BACKEND_FAILURE: injected "
      "capture failure; last grant 3 on n-1 ended finished)"]),
    ("restore refused", {"code": "INCOMPATIBLE_STATE", "message": "S3: digest",
                         "checkpointId": "ck-e1-1"}, {},
     ["restore refused", "INCOMPATIBLE_STATE", "ck-e1-1"]),
    ("plugin failed", {"error": "plugin failed", "failure": {
        "detail": "Agent.Initialize", "participant": "ant-1", "code": "BACKEND_FAILURE",
        "mutation": "none", "message": "Agent.Initialize: building the model failed: "
                                       "ValueError: bad gain 42"},
        "plugin": {"plugin": "ants.brain:Model", "stage": "construct",
                   "exception": "ValueError", "message": "bad gain 42",
                   "frames": ["ants/brain.py:9 in __init__: raise ValueError(...)"],
                   "repeats": True}}, {},
     ["plugin failed", "ants.brain:Model (construct) of ant-1 at Agent.Initialize",
      "ValueError: bad gain 42"]),
]


def test_a_plugin_fault_traceback_is_found_in_every_outcome_shape() -> None:
    plugin = {"plugin": "ants.brain:Model", "stage": "call", "exception": "KeyError",
              "message": "'x'", "frames": ["a.py:1 in f", "b.py:2 in g"], "repeats": False}
    exhausted = {"error": "recovery attempts exhausted", "attempts": 3,
                 "lastFailure": {"detail": "Agent.Prepare", "participant": "ant-1",
                                 "code": "BACKEND_FAILURE", "message": "m", "plugin": plugin}}
    launch = {"error": "launch failed", "failure": {"detail": "launch", "plugin": plugin}}
    refused = {"error": "attempts exhausted",
               "lastCaptureRefusal": {"detail": "capture", "plugin": plugin}}
    assert (traceback_of(exhausted) == traceback_of(launch) == traceback_of(refused)
            == ["a.py:1 in f", "b.py:2 in g"])
    assert traceback_of({"error": "launch failed", "failure": {"detail": "launch"}}) == []


@pytest.mark.parametrize(("kind", "outcome", "extra", "said"), KINDS,
                         ids=[k[0] for k in KINDS])
def test_each_outcome_kind_is_named(kind: str, outcome: dict[str, Any], extra: dict[str, Any],
                                    said: list[str]) -> None:
    failure = failure_of("failed", outcome, **extra)
    assert failure is not None and failure["error"]
    text = describe(failure)
    for part in said:
        assert part in text, (kind, text)


def test_a_succeeded_run_has_no_reason_and_an_unended_one_is_abandoned() -> None:
    assert failure_of("succeeded", {"boundary": 3}) is None
    assert failure_of("cancelled", {"cancelledBy": "flyctl 1"})["error"] == "cancelled"
    assert failure_of("abandoned", None)["error"] == "abandoned"


def test_flyd_run_names_the_reason_in_its_summary_and_on_stderr(tmp: Path) -> None:
    code, summary, stderr = flyd_run(tmp, "--steps", "20", "--mode", "in-process", "--fault",
                                     "arena.acknowledge_extra_id=req-9999", timeout=150)
    assert code == 1 and summary["state"] == "failed"
    outcome = summary["outcome"]
    assert outcome["error"] == "recovery attempts exhausted" and outcome["attempts"] == 3
    lines = [ln for ln in stderr.splitlines() if ln.startswith("flyd run: ")]
    assert f"flyd run: run {summary['run']} failed: {describe(outcome)}" in lines, lines
    assert any(ln.startswith("flyd run: outcome: ") and orjson.loads(
        ln.removeprefix("flyd run: outcome: ")) == outcome for ln in lines), lines
    code, ok, _ = flyd_run(tmp, "--steps", "3", "--mode", "in-process")
    assert code == 0 and ok["state"] == "succeeded" and ok["outcome"] is None


async def _reaped_run(dsn: str) -> int:
    """A run whose only attempt expired: the reaper fails it `{reaped: attempts exhausted}`
    once the database clock (`flyd.sim_clock`) passes the lease."""
    store = PgStore(dsn, "n-gone", DbSettings(), LeaseParams())
    await store.open()
    try:
        await store.register_node(NodeInfo("n-gone", "gone", "h", os.getpid(), "0", 1))
        run = (await store.submit(None, {"steps": "5"}, 1)).run_id
        granted = await store.claim("n-gone", 1, 5.0, only=run)
        assert [g.run_id for g in granted] == [run]
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
            await admin.execute("INSERT INTO flyd.sim_clock (t) VALUES (%s)",
                                (datetime.now(UTC) + timedelta(hours=1),))
        reaped = await store.reap(10)
        assert [(r.run_id, r.state) for r in reaped] == [(run, "failed")]
        return run
    finally:
        await store.close()


def test_runs_show_names_an_exhausted_run_and_its_last_grant(tmp: Path) -> None:
    dsn = env_for(tmp)["FLYD_DSN"]
    run = asyncio.run(_reaped_run(dsn))
    shown = subprocess.run([*FLYCTL, "runs", "show", str(run), "--json", "--dsn", dsn],
                           cwd=ROOT, env=env_for(tmp), capture_output=True, timeout=60,
                           check=False)
    assert shown.returncode == 0, shown.stderr
    doc = orjson.loads(shown.stdout)
    assert doc["outcome"] == {"reaped": "attempts exhausted"}
    assert doc["reason"] == "attempts exhausted (last grant 1 on n-gone ended exhausted)"
    human = subprocess.run([*FLYCTL, "runs", "show", str(run), "--dsn", dsn], cwd=ROOT,
                           env=env_for(tmp), capture_output=True, timeout=60, check=False)
    assert human.returncode == 0, human.stderr
    assert f"reason: {doc['reason']}" in human.stdout.decode().splitlines()  # a result: stdout


def _shown(tmp: Path, run: int) -> tuple[dict[str, Any], list[str]]:
    """`flyctl runs show RUN`: the JSON document and the human lines."""
    dsn = env_for(tmp)["FLYD_DSN"]
    argv = [*FLYCTL, "runs", "show", str(run), "--dsn", dsn]
    shown = subprocess.run([*argv, "--json"], cwd=ROOT, env=env_for(tmp), capture_output=True,
                           timeout=60, check=False)
    human = subprocess.run(argv, cwd=ROOT, env=env_for(tmp), capture_output=True, timeout=60,
                           check=False)
    assert shown.returncode == 0 and human.returncode == 0, (shown.stderr, human.stderr)
    return orjson.loads(shown.stdout), human.stdout.decode().splitlines()


def test_a_late_capture_over_one_bus_frame_fails_the_run_at_once_naming_it(tmp: Path) -> None:
    """An 80x80 view with one step of observation delay passes Initialize's size check (one
    frame) under a 64 KiB envelope, but a capture after a step retains two frames: the final
    capture is refused by the world. Before, the run was retried until `attempts exhausted`
    and only the log named the refusal; now it fails on its one attempt and says why."""
    config = tmp / "limits.toml"
    config.write_text("[bus.limits]\nmax_envelope_bytes = 65536\n")
    spec = tmp / "spec.json"
    spec.write_bytes(orjson.dumps({"world": {"observationDelaySteps": 1,
                                             "config": {"width": 80, "height": 80}}}))
    code, summary, stderr = flyd_run(tmp, "--steps", "6", "--mode", "in-process", "--spec",
                                     str(spec), "--config", str(config))
    assert code == 1 and summary["state"] == "failed", summary
    assert summary["boundary"] == 6, "stepped to the end: the refusal came late"
    [refused] = events(stderr, "checkpoint.capture_refused")  # the capture was refused
    assert refused["participant"] == "arena" and refused["code"] == "UNSUPPORTED"
    outcome = summary["outcome"]
    assert outcome["error"] == "checkpoint capture refused", outcome
    failure = outcome["failure"]
    assert (failure["detail"], failure["participant"], failure["code"], failure["mutation"]) \
        == ("capture", "arena", "UNSUPPORTED", "none")
    assert failure["checkpointId"] == refused["checkpoint_id"] == "ck-e1-1-final"
    assert "does not fit one bus frame (limit 65536)" in failure["message"]
    assert summary["failures"] == [failure]
    reason = describe(outcome)
    assert reason.startswith("checkpoint capture refused by arena: UNSUPPORTED: checkpoint "
                             "payload of "), reason
    assert f"flyd run: run {summary['run']} failed: {reason}" in stderr.splitlines()
    [retry] = [e["retry"] for e in events(stderr, "run.capture_refused")]
    assert retry is False
    doc, lines = _shown(tmp, summary["run"])
    assert [g["endReason"] for g in doc["grants"]] == ["finished"], "one attempt"
    assert doc["outcome"] == outcome and doc["reason"] == reason
    assert f"reason: {reason}" in lines


def test_a_capture_refused_on_every_attempt_ends_attempts_exhausted_naming_it(
        tmp: Path) -> None:
    """A world whose every capture fails (`BACKEND_FAILURE`, which another attempt might not
    meet) is retried; the last attempt ends the run `attempts exhausted` with the refusal as
    `lastCaptureRefusal`, in the summary, on stderr and in `flyctl runs show`."""
    code, summary, stderr = flyd_run(tmp, "--steps", "4", "--mode", "in-process", "--fault",
                                     "arena.fail_capture=true")
    assert code == 1 and summary["state"] == "failed", summary
    assert len(events(stderr, "checkpoint.capture_refused")) == 3  # once per attempt
    assert [e["retry"] for e in events(stderr, "run.capture_refused")] == [True, True, False]
    outcome = summary["outcome"]
    assert outcome["error"] == "attempts exhausted", outcome
    last = outcome["lastCaptureRefusal"]
    assert (last["participant"], last["code"], last["message"], last["checkpointId"]) == (
        "arena", "BACKEND_FAILURE", "injected capture failure", "ck-e1-1-final")
    reason = describe(outcome)
    assert reason == ("attempts exhausted (checkpoint capture refused by arena: "
                      "BACKEND_FAILURE: injected capture failure)")
    assert f"flyd run: run {summary['run']} failed: {reason}" in stderr.splitlines()
    doc, lines = _shown(tmp, summary["run"])
    assert [g["endReason"] for g in doc["grants"]] == ["released", "released", "finished"]
    assert doc["outcome"] == outcome
    assert doc["reason"].startswith(f"{reason[:-1]}; last grant 3 on "), doc["reason"]
    assert f"reason: {doc['reason']}" in lines
