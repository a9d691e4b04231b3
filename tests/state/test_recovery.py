"""Automatic recovery on the node's production path (state.md §8, §9.3; tests 84–92).

Every scenario runs real `flyd run` or `flyd serve` processes on the test's own database; the
witnesses are the JSON log lines on the node's stderr (`recovery.*`, `faults.fired`,
`checkpoint.*`, `run.resumed`), the ledger (`flyd.effects`, `flyd.checkpoints`, `flyd.runs`)
and the process table.

Decisions where the spec leaves the harness open:
- The reference is one clean `flyd run` (40 steps, cadence 5, thread mode) per test process:
  its `behaviourDigest`, its `boundary-1..40` payloads and the `world`/`model` blobs of its
  final generation. Behaviour is independent of mode, cadence and pacing (cli.md §4.2,
  state.md §9.1), so every scenario compares against it.
- Test 84's seeds are `FLYD_RECOVERY_SEEDS` cases per mode (default 3), each seed derived by
  SHA-256 from the suite seed `FLYD_RECOVERY_SEED` (default 84), the mode and the case index,
  and printed first. A seed picks the worker, a step s in 1..39 and a mid-step
  (`kill:<worker>@<s>`) or a between-steps kill. The between-steps kill runs `flyd run`
  through a small launcher module whose coordinator, once a step leaves the session at
  `Ready(s)`, calls its kill injection: the node's `launcher.kill`, in every mode.
- The head at the failure is read from the database, not from the node's log: the effects the
  failed epoch e1 executed are exactly those its committed generations covered, so the head
  is the generation covering the highest of them (none: a restart from zero). The log's
  `recovery.drained`, `recovery.restored` and `recovery.resumed` must name that head.
- Test 86's "worker dying at every launch" is `fly-b.fail_activate_restore=true`: every launch
  of fly-b fails the install (`BACKEND_FAILURE`, retried), so every attempt fails until the
  bound. A first kill before any head (restart from zero, no install) followed by a commit
  shows the reset.
- Test 88 gates the grant's own writer: the node runs `flyd run` through a small launcher
  module that swaps in a `CheckpointWriter` with the writer's `gate` fault installed; the gate
  opens 1.5 s after the job at 10 stalls, well after the failure at 12.
- Test 87 changes the run's world config (`observationDelaySteps`, part of the environment's
  configuration digest, i.e. the head's `patchDigest`) in `flyd.runs.spec` between a drained
  grant and the next claim.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from flyd.leases.params import LeaseParams
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.session.runspec import RunSpec
from flyd.state.checkpoints import PgCheckpointStore
from flyd.state.envelope import decode
from tests.distribution.harness.clock import EPOCH, HarnessClock
from tests.serve_nodes import node_log, processes_under, query, start_node, stop, wait_for
from workers.types.canonical import digest_of

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 40
EVERY = 5
LAST_HOT = 35
WORKERS = ("fly-a", "fly-b", "arena")
MODES = ("process", "thread", "in-process")
SUITE_SEED = int(os.environ.get("FLYD_RECOVERY_SEED", "84"))
CASES = int(os.environ.get("FLYD_RECOVERY_SEEDS", "3"))
TIME_SCALE = 10.0
PACE_S = 0.05
Log = list[dict[str, Any]]

GATED_RUN = '''\
"""`flyd run` whose grant writer holds its first job at the writer's `gate` fault."""
import asyncio
import sys

import flyd.node.grant
from flyd.cli.flyd import flyd_main
from flyd.state.writer import CheckpointWriter, WriterFaults

HOLD_S = 1.5


class GatedWriter(CheckpointWriter):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, faults=WriterFaults(gate=asyncio.Event()), **kwargs)

    async def run(self):
        async with asyncio.TaskGroup() as tg:
            opener = tg.create_task(self._open_later())
            try:
                await super().run()
            finally:
                opener.cancel()

    async def _open_later(self):
        await self.faults.stalled.wait()
        await asyncio.sleep(HOLD_S)
        self.faults.gate.set()


flyd.node.grant.CheckpointWriter = GatedWriter
flyd_main(args=["run", *sys.argv[1:]], prog_name="flyd")
'''

KILLING_RUN = '''\
"""`flyd run` that kills a worker through the node's `launcher.kill` (the coordinator's kill
injection is that method) once its session is at `Ready(AT)`, between two steps."""
import sys

import orjson

from flyd.cli.flyd import flyd_main
from flyd.session.coordinator import Coordinator

WORKER, AT = sys.argv[1], int(sys.argv[2])
step = Coordinator.step
killed = []


async def step_then_kill(self):
    report = await step(self)
    if not killed and report.boundary == AT and self.phase.label == f"Ready({AT})":
        killed.append(AT)
        outcome = await self.injections.kill(WORKER)
        sys.stderr.write(orjson.dumps({"event": "test.killed", "worker": WORKER,
                                       "phase": f"Ready({AT})",
                                       "outcome": type(outcome).__name__}).decode() + "\\n")
    return report


Coordinator.step = step_then_kill
flyd_main(args=["run", *sys.argv[3:]], prog_name="flyd")
'''


# ------------------------------------------------------------------ fixtures and helpers


@dataclass
class Box:
    """A test's temporary directory and database."""

    path: Path
    dsn: str


@pytest.fixture
def box(db_dsn: str) -> Iterator[Box]:
    path = Path(tempfile.mkdtemp(prefix="flyd-r-", dir="/tmp"))
    try:
        yield Box(path, db_dsn)
    finally:
        survivors = processes_under(str(path))
        for proc in survivors:
            proc.kill()
        shutil.rmtree(path, ignore_errors=True)
        assert not survivors, f"processes outlived the test: {survivors}"


def env_for(box: Box, config: str = "") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLYD_SOCKET", "RUNTIME_DIRECTORY", "FLYD_CONFIG", "FLYD_NODE_NAME",
                        "NOTIFY_SOCKET")}
    env["XDG_RUNTIME_DIR"] = str(box.path / "xdg")
    env["FLYD_LOG_FORMAT"] = "json"
    env["FLYD_STATE_DIR"] = str(box.path / "state")
    env["FLYD_DSN"] = box.dsn
    if config:
        toml = box.path / "flyd.toml"
        toml.write_text(config)
        env["FLYD_CONFIG"] = str(toml)
    return env


def parse_log(text: str) -> Log:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                lines.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return lines


def events(log: Log, name: str) -> Log:
    return [e for e in log if e.get("event") == name]


def recovery_events(log: Log) -> Log:
    return [e for e in log if str(e.get("event", "")).startswith("recovery.")]


@dataclass
class Result:
    code: int
    summary: dict[str, Any]
    log: Log


def finish_run(box: Box, out: bytes, err: str, code: int) -> Result:
    assert not processes_under(str(box.path)), "a router or worker outlived flyd run"
    assert "Traceback" not in err, err[-3000:]
    lines = out.decode().splitlines()
    assert len(lines) == 1, (out, err[-3000:])
    return Result(code, orjson.loads(lines[0]), parse_log(err))


def flyd_run(box: Box, *args: str, config: str = "", gated: bool = False,
             kill_at: tuple[str, int] | None = None) -> Result:
    """`flyd run --json … --socket <private>` (or the gated or the killing launcher) to its
    end."""
    if gated:
        script = box.path / "gated_run.py"
        script.write_text(GATED_RUN)
        argv = [sys.executable, str(script)]
    elif kill_at is not None:
        script = box.path / "killing_run.py"
        script.write_text(KILLING_RUN)
        argv = [sys.executable, str(script), kill_at[0], str(kill_at[1])]
    else:
        argv = [sys.executable, "-m", "flyd", "run"]
    # -v: debug, so the per-write lines (`checkpoint.*`, `write_begin`) are in the log
    argv += ["--json", "-v", "--socket", str(box.path / "bus.sock"), *args]
    out = subprocess.run(argv, cwd=ROOT, env=env_for(box, config), capture_output=True,
                         timeout=120, check=False)
    return finish_run(box, out.stdout, out.stderr.decode(errors="replace"), out.returncode)


def ledger(dsn: str, run: int) -> list[tuple[str, int | None, Any, int]]:
    """(effect_key, boundary, payload, lease_epoch) of a run in key order of boundaries."""
    rows = query(dsn, "SELECT effect_key, boundary, payload, lease_epoch FROM flyd.effects "
                      "WHERE run_id = %s ORDER BY boundary NULLS LAST, effect_key", run)
    return [(str(k), None if b is None else int(b), p, int(e))  # type: ignore[call-overload]
            for k, b, p, e in rows]


def assert_effects_once(dsn: str, run: int, first: int = 1) -> list[Any]:
    """`boundary-first..40` once each, then `finish`; the boundary payloads in order."""
    rows = ledger(dsn, run)
    assert [r[0] for r in rows] == [f"boundary-{k}" for k in range(first, STEPS + 1)] + [
        "finish"], [r[0] for r in rows]
    return [r[2] for r in rows[:-1]]


def final_blobs(dsn: str, run: int, checkpoint_id: str) -> dict[str, Any]:
    """The `world` blob and each agent's `model` blob of a stored generation."""
    [(envelope,)] = query(dsn, "SELECT envelope FROM flyd.checkpoints WHERE run_id = %s AND "
                               "checkpoint_id = %s", run, checkpoint_id)
    assert isinstance(envelope, bytes | memoryview)
    env = decode(bytes(envelope))
    blobs: dict[str, Any] = {}
    for name, body in env.payloads:
        doc = orjson.loads(body)
        if doc.get("kind") == "world":
            blobs[name] = doc["world"]
        elif doc.get("kind") == "agent":
            blobs[name] = doc["model"]
    assert set(blobs) == {"world", "agent-fly-a", "agent-fly-b"}, list(blobs)
    return blobs


def run_row(dsn: str, run: int) -> tuple[str, dict[str, Any] | None, list[str]]:
    [(state, outcome, fired)] = query(dsn, "SELECT state::text, outcome, faults_fired FROM "
                                           "flyd.runs WHERE run_id = %s", run)
    assert outcome is None or isinstance(outcome, dict)
    assert fired is None or isinstance(fired, list)
    return str(state), outcome, [str(f) for f in fired or []]


@dataclass
class Clean:
    digest: str
    payloads: list[Any]
    blobs: dict[str, Any]


_CLEAN: list[Clean] = []


def clean(box: Box) -> Clean:
    """The uninterrupted reference run (once per test process)."""
    if not _CLEAN:
        r = flyd_run(box, "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
                     "--mode", "thread")
        assert r.code == 0 and r.summary["state"] == "succeeded", r.summary
        run = int(r.summary["run"])
        _, outcome, _ = run_row(box.dsn, run)
        assert outcome is not None
        _CLEAN.append(Clean(r.summary["behaviourDigest"], assert_effects_once(box.dsn, run),
                            final_blobs(box.dsn, run, outcome["finalCheckpointId"])))
    return _CLEAN[0]


def assert_matches_clean(box: Box, run: int, reference: Clean) -> None:
    """Effects once each, equal to the clean run's; equal digest and final blobs."""
    state, outcome, _ = run_row(box.dsn, run)
    assert state == "succeeded" and outcome is not None, (state, outcome)
    payloads = assert_effects_once(box.dsn, run)
    assert payloads == reference.payloads
    assert outcome["behaviourDigest"] == reference.digest == digest_of(payloads)
    assert final_blobs(box.dsn, run, outcome["finalCheckpointId"]) == reference.blobs


def case_seed(mode: str, index: int) -> int:
    raw = hashlib.sha256(f"{SUITE_SEED}:{mode}:{index}".encode()).digest()
    return int.from_bytes(raw[:4], "big")


# ------------------------------------------------------------------ 84


def head_at_failure(dsn: str, run: int) -> tuple[int, str | None]:
    """The head the failed epoch e1 left in the database: the effects e1 executed are exactly
    those its committed generations covered (state.md §9.3), so the head is the generation
    covering the highest of them; (0, None) when e1 committed none. The boundaries after it
    were re-executed by e2."""
    rows = query(dsn, "SELECT boundary, session_epoch, checkpoint_id FROM flyd.effects "
                      "WHERE run_id = %s AND boundary IS NOT NULL ORDER BY boundary", run)
    e1 = [(int(b), str(c)) for b, n, c in rows if n == 1]  # type: ignore[call-overload]
    boundary, checkpoint_id = e1[-1] if e1 else (0, None)
    assert [b for b, _ in e1] == list(range(1, boundary + 1)), e1
    assert [n for b, n, _ in rows if b > boundary] == [2] * (STEPS - boundary), rows
    return boundary, checkpoint_id


@pytest.mark.parametrize("index", range(CASES))
@pytest.mark.parametrize("mode", MODES)
def test_killing_any_worker_at_a_random_step_recovers_to_identical_behaviour(
        box: Box, mode: str, index: int) -> None:
    seed = case_seed(mode, index)
    rng = random.Random(seed)
    worker = rng.choice(WORKERS)
    step = rng.randint(1, STEPS - 1)
    between = rng.random() < 0.5
    print(f"[recovery] seed={seed} mode={mode} worker={worker} step={step} "
          f"variant={'between-steps' if between else 'mid-step'}")
    reference = clean(box)
    common = ("--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--mode", mode)
    fault = f"kill:{worker}@{step}"
    if between:
        r = flyd_run(box, *common, kill_at=(worker, step))
        [killed] = events(r.log, "test.killed")
        assert (killed["phase"], killed["outcome"]) == (f"Ready({step})", "Terminated")
    else:
        r = flyd_run(box, *common, "--fault", fault)
    assert r.code == 0, (r.summary, recovery_events(r.log))
    s = r.summary
    run = int(s["run"])
    assert s["state"] == "succeeded" and s["recoveries"] == 1 and s["boundary"] == STEPS

    [started] = events(r.log, "recovery.started")
    [resumed] = events(r.log, "recovery.resumed")
    [drained] = events(r.log, "recovery.drained")
    assert started["failure"]["participant"] == worker, started
    assert started["attempt"] == resumed["attempt"] == 1
    head_boundary, head_id = head_at_failure(box.dsn, run)
    assert resumed["boundary"] == head_boundary
    if head_id is None:
        assert drained["head"] is None and not events(r.log, "recovery.restored")
        [restarted] = events(r.log, "recovery.restarted")
        assert restarted["new_epoch"] == resumed["new_epoch"]
    else:
        assert (drained["head"]["checkpoint_id"], drained["head"]["boundary"]) == (
            head_id, head_boundary)
        [restored] = events(r.log, "recovery.restored")
        assert (restored["checkpoint_id"], restored["boundary"]) == (head_id, head_boundary)
        assert not events(r.log, "recovery.restarted"), "a durable head existed"
    abandoned = events(r.log, "recovery.abandoned")
    if head_boundary < step:
        [a] = abandoned
        assert (a["from_boundary"], a["to_boundary"]) == (head_boundary + 1, step)
        assert a["failed_epoch"] == started["failed_epoch"] == "e1"
    else:
        assert head_boundary == step and not abandoned
    assert resumed["new_epoch"] == "e2" and s["epochs"][-1] == "e2"

    assert_matches_clean(box, run, reference)
    assert s["behaviourDigest"] == reference.digest
    _, _, fired = run_row(box.dsn, run)
    if between:
        assert fired == []
    else:
        assert fired == [fault]
        assert [e["faults"] for e in events(r.log, "faults.fired")] == [[fault]]
    assert [f["participant"] for f in s["failures"]] == [worker], "it did not recur"


# ------------------------------------------------------------------ 85


def test_a_failure_before_the_first_checkpoint_restarts_from_zero(box: Box) -> None:
    reference = clean(box)
    r = flyd_run(box, "--steps", str(STEPS), "--checkpoint-every", "10", "--mode",
                 "in-process", "--fault", "kill:fly-a@3")
    assert r.code == 0, recovery_events(r.log)
    assert r.summary["recoveries"] == 1 and r.summary["epochs"] == ["e2"]
    [drained] = events(r.log, "recovery.drained")
    assert drained["head"] is None
    [restarted] = events(r.log, "recovery.restarted")
    assert restarted["new_epoch"] == "e2"
    assert not events(r.log, "recovery.restored")
    [abandoned] = events(r.log, "recovery.abandoned")
    assert (abandoned["from_boundary"], abandoned["to_boundary"]) == (1, 3)
    [resumed] = events(r.log, "recovery.resumed")
    assert resumed["boundary"] == 0
    assert_matches_clean(box, int(r.summary["run"]), reference)


# ------------------------------------------------------------------ 86


def test_recovery_attempts_are_bounded(box: Box) -> None:
    backoff = 0.25
    r = flyd_run(box, "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--mode",
                 "in-process", "--fault", "kill:fly-a@3", "--fault", "kill:fly-b@13",
                 "--fault", "fly-b.fail_activate_restore=true",
                 config=f"[checkpoints]\nrecovery_backoff_s = {backoff}\n")
    assert r.code == 1, recovery_events(r.log)
    assert r.summary["state"] == "failed"
    # the first failure (no head) restarts from zero; the commits at 5 and 10 reset the count
    assert [e["attempt"] for e in events(r.log, "recovery.started")] == [1, 1, 2, 3]
    assert len(events(r.log, "recovery.resumed")) == 1
    failed = events(r.log, "recovery.attempt_failed")
    assert [e["attempt"] for e in failed] == [1, 2, 3]
    assert [e["backoff_s"] for e in failed] == [backoff, 2 * backoff, 4 * backoff]
    assert {e["participant"] for e in failed} == {"fly-b"}
    assert {e["code"] for e in failed} == {"BACKEND_FAILURE"}
    [exhausted] = events(r.log, "recovery.exhausted")
    assert exhausted["attempts"] == 3
    run = int(r.summary["run"])
    state, outcome, _ = run_row(box.dsn, run)
    assert state == "failed" and outcome is not None
    assert outcome["error"] == "recovery attempts exhausted" and outcome["attempts"] == 3
    assert outcome["lastFailure"]["participant"] == "fly-b"
    assert outcome["lastFailure"]["code"] == "BACKEND_FAILURE"
    keys = [row[0] for row in ledger(box.dsn, run)]
    assert keys[-1] == "finish" and keys[:-1] == [f"boundary-{k}" for k in range(1, 11)], keys


# ------------------------------------------------------------------ 87


def serve_spec(mode: str) -> dict[str, Any]:
    return RunSpec.validate({"steps": str(STEPS), "mode": mode, "paceS": PACE_S,
                             "checkpoints": {"everySteps": EVERY}}).to_json()


async def _submit(dsn: str, spec: dict[str, Any]) -> int:
    store = PgStore(dsn, "harness", DbSettings(), LeaseParams())
    await store.open()
    try:
        return (await store.submit("recovery", spec, 10)).run_id
    finally:
        await store.close()


def submit(dsn: str, spec: dict[str, Any]) -> int:
    return asyncio.run(_submit(dsn, spec))


def head_of(dsn: str, run: int) -> tuple[str, int, int] | None:
    """(checkpoint id, boundary, raw session epoch) of the run's head."""
    rows = query(dsn, "SELECT c.checkpoint_id, c.boundary, c.session_epoch FROM "
                      "flyd.run_heads h JOIN flyd.checkpoints c ON c.run_id = h.run_id AND "
                      "c.checkpoint_id = h.high_water WHERE h.run_id = %s", run)
    if not rows:
        return None
    (cid, boundary, epoch), = rows
    return str(cid), int(boundary), int(epoch)  # type: ignore[call-overload]


def head_at_least(dsn: str, run: int, boundary: int) -> bool:
    head = head_of(dsn, run)
    return head is not None and head[1] >= boundary


def terminal(dsn: str, run: int) -> bool:
    return run_row(dsn, run)[0] in ("succeeded", "failed", "cancelled")


def drain_a(box: Box, run: int) -> tuple[str, int]:
    """Node a executes the run until its head is at ≥ 10, then drains (SIGTERM); the head."""
    a = start_node(box.path, "a", box.dsn)
    try:
        wait_for("node a to commit a checkpoint", lambda: head_at_least(box.dsn, run, 10), 60)
        assert stop(a) == 0
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert run_row(box.dsn, run)[0] == "pending", "a drain releases the run"
    head = head_of(box.dsn, run)
    assert head is not None
    return head[0], head[1]


def test_an_incompatible_head_fails_the_run_without_retrying(box: Box) -> None:
    spec = serve_spec("in-process")
    run = submit(box.dsn, spec)
    head_id, _ = drain_a(box, run)
    changed = {**spec, "world": {**spec["world"], "observationDelaySteps": 1}}
    RunSpec.validate(changed)
    query(box.dsn, "UPDATE flyd.runs SET spec = %s::jsonb WHERE run_id = %s RETURNING run_id",
          orjson.dumps(changed).decode(), run)
    b = start_node(box.path, "b", box.dsn)
    try:
        wait_for("the run to end", lambda: terminal(box.dsn, run), 60)
    finally:
        stop(b)
    state, outcome, _ = run_row(box.dsn, run)
    assert state == "failed" and outcome is not None, (state, outcome,
                                                       node_log(box.path, "b")[-4000:])
    assert outcome.get("code") == "INCOMPATIBLE_STATE" and "patchDigest" in outcome["message"]
    assert outcome["checkpointId"] == head_id
    log = parse_log(node_log(box.path, "b"))
    [refused] = events(log, "recovery.refused")
    assert refused["checkpoint_id"] == head_id and "patchDigest" in refused["message"]
    assert [e["event"] for e in recovery_events(log)] == ["recovery.refused"], "one attempt"
    assert [r[0] for r in ledger(box.dsn, run)][-1] == "finish"


# ------------------------------------------------------------------ 88


def test_recovery_drains_the_writer_before_choosing_the_head(box: Box) -> None:
    reference = clean(box)
    r = flyd_run(box, "--steps", str(STEPS), "--checkpoint-every", "10", "--mode",
                 "in-process", "--fault", "kill:fly-a@12", gated=True)
    assert r.code == 0, recovery_events(r.log)
    order = [(e["event"], e.get("checkpoint_id")) for e in r.log
             if e.get("event") in ("recovery.started", "recovery.drained",
                                   "checkpoint.committed")]
    assert order[:3] == [("recovery.started", None), ("checkpoint.committed", "ck-e1-1"),
                         ("recovery.drained", None)], order
    [drained] = events(r.log, "recovery.drained")
    assert drained["outstanding_before"] == 1
    assert drained["head"]["checkpoint_id"] == "ck-e1-1" and drained["head"]["boundary"] == 10
    [abandoned] = events(r.log, "recovery.abandoned")
    assert (abandoned["from_boundary"], abandoned["to_boundary"]) == (11, 12)
    [restored] = events(r.log, "recovery.restored")
    assert (restored["checkpoint_id"], restored["boundary"]) == ("ck-e1-1", 10)
    assert_matches_clean(box, int(r.summary["run"]), reference)


# ------------------------------------------------------------------ 89


def test_lease_loss_cancels_instead_of_recovering(box: Box) -> None:
    run = submit(box.dsn, serve_spec("process"))
    with HarnessClock(box.dsn, box.path / "clock", time_scale=TIME_SCALE) as clock:
        a = start_node(box.path, "a", box.dsn, "--sim-clock", str(box.path / "clock"),
                       "--time-scale", str(TIME_SCALE))
        try:
            wait_for("node a to commit a checkpoint", lambda: head_at_least(box.dsn, run, 5),
                     60)
            workers = [p for p in processes_under(str(box.path / "a"))
                       if "--worker" in p.cmdline()]
            assert len(workers) == 3
            clock.freeze()
            lost_at = clock.now()
            clock.advance(LeaseParams().ttl_s + 5)
            clock.thaw()

            def lost() -> bool:
                return any(e.get("run") == run and e.get("epoch") == 1
                           for e in events(parse_log(node_log(box.path, "a")), "lease_lost"))

            wait_for("node a to lose the lease", lost, 30)
            wait_for("the grant's workers to die",
                     lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                     for p in workers), 10)
            wait_for("the run to end", lambda: terminal(box.dsn, run), 90)
        finally:
            stop(a)
    log = parse_log(node_log(box.path, "a"))
    assert recovery_events(log) == [], "a lost lease is never recovered"
    names = [(e.get("event"), e.get("epoch")) for e in log
             if e.get("run") == run and e.get("event") in ("lease_lost", "write_begin")]
    lost_index = names.index(("lease_lost", 1))
    assert ("write_begin", 1) not in names[lost_index:], "a write after safe_until"
    ends = {e["event"]: e for e in log if e.get("run") == run and e.get("epoch") == 1
            and e.get("event") in ("lease_lost", "scope_cancelled", "scope_stuck")}
    assert "scope_stuck" not in ends, "the scope ended within the runtime's bound"
    assert ends["scope_cancelled"]["t"] - ends["lease_lost"]["t"] <= 5.0
    written = query(box.dsn, "SELECT max(recorded_at) FROM flyd.effects WHERE run_id = %s "
                             "AND lease_epoch = 1", run)
    assert written[0][0] is not None
    assert written[0][0] <= EPOCH + timedelta(seconds=lost_at)  # type: ignore[operator]
    state, _, _ = run_row(box.dsn, run)
    assert state == "succeeded"
    assert_effects_once(box.dsn, run)


# ------------------------------------------------------------------ 90


def test_a_run_resumes_on_another_node_from_its_head(box: Box) -> None:
    reference = clean(box)
    run = submit(box.dsn, serve_spec("process"))
    sim = ("--sim-clock", str(box.path / "clock"), "--time-scale", str(TIME_SCALE))
    with HarnessClock(box.dsn, box.path / "clock", time_scale=TIME_SCALE):
        a = start_node(box.path, "a", box.dsn, *sim)
        b = None
        try:
            wait_for("node a to commit a checkpoint", lambda: head_at_least(box.dsn, run, 10),
                     60)
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            wait_for("node a's router and workers to die",
                     lambda: not processes_under(str(box.path / "a")), 10)
            head = head_of(box.dsn, run)
            assert head is not None
            b = start_node(box.path, "b", box.dsn, *sim)
            wait_for("the run to end", lambda: terminal(box.dsn, run), 90)
        finally:
            if a.poll() is None:
                a.kill()
                a.wait()
            if b is not None:
                assert stop(b) == 0
    head_id, head_boundary, h = head
    log = parse_log(node_log(box.path, "b"))
    [resumed] = events(log, "run.resumed")
    assert resumed["checkpoint_id"] == head_id and resumed["boundary"] == head_boundary
    assert resumed["new_epoch"] == f"e{h + 2}", "bootstrapped in e<h+1>, installed into e<h+2>"
    assert recovery_events(log) == []
    rows = ledger(box.dsn, run)
    assert {e for _, k, _, e in rows if k is not None and k <= head_boundary} == {1}
    assert {e for _, k, _, e in rows if k is not None and k > head_boundary} == {2}
    epochs = query(box.dsn, "SELECT DISTINCT session_epoch FROM flyd.effects WHERE run_id = %s "
                            "AND boundary > %s", run, head_boundary)
    assert {int(r[0]) for r in epochs} == {h + 2}  # type: ignore[call-overload]
    assert_matches_clean(box, run, reference)


# ------------------------------------------------------------------ 91


def test_a_drained_node_hands_over_without_an_abandoned_range(box: Box) -> None:
    reference = clean(box)
    run = submit(box.dsn, serve_spec("in-process"))
    head_id, head_boundary = drain_a(box, run)
    a_log = parse_log(node_log(box.path, "a"))
    [drain] = events(a_log, "run.drain_checkpoint")
    assert drain["outcome"] == "Committed"
    assert head_id.endswith("-drain"), head_id
    b = start_node(box.path, "b", box.dsn)
    try:
        wait_for("the run to end", lambda: terminal(box.dsn, run), 60)
    finally:
        assert stop(b) == 0
    b_log = parse_log(node_log(box.path, "b"))
    [resumed] = events(b_log, "run.resumed")
    assert (resumed["checkpoint_id"], resumed["boundary"]) == (head_id, head_boundary)
    assert recovery_events(a_log) == recovery_events(b_log) == []
    rows = ledger(box.dsn, run)
    assert {e for _, k, _, e in rows if k is not None and k <= head_boundary} == {1}
    assert {e for _, k, _, e in rows if k is not None and k > head_boundary} == {2}
    assert_matches_clean(box, run, reference)


# ------------------------------------------------------------------ 92


async def _export_import(dsn: str, run: int, checkpoint_id: str, path: Path,
                         spec: dict[str, Any]) -> int:
    store = PgCheckpointStore(dsn)
    try:
        record = await store.export(run, path, checkpoint_id)
        assert record.boundary == 20
        data = await asyncio.to_thread(path.read_bytes)
        imported = await store.import_envelope(data, spec=spec)
        return imported.run_id
    finally:
        await store.close()


def test_an_imported_checkpoint_runs_to_the_same_end(box: Box) -> None:
    original = flyd_run(box, "--steps", str(STEPS), "--checkpoint-every", str(EVERY),
                        "--mode", "in-process",
                        config="[checkpoints]\nkeep_generations = 10\n")
    assert original.code == 0
    run = int(original.summary["run"])
    payloads = assert_effects_once(box.dsn, run)
    # a cadence capture the writer replaced while busy (a loaded host) is never stored, so the
    # import starts from the first mid-run checkpoint that landed, at or after boundary 20
    stored = query(box.dsn, "SELECT c.checkpoint_id, r.spec, c.boundary FROM flyd.checkpoints c "
                            "JOIN flyd.runs r USING (run_id) WHERE run_id = %s AND boundary >= 20 "
                            "AND boundary < %s ORDER BY boundary LIMIT 1", run, STEPS)
    assert stored, "no mid-run checkpoint was stored"
    [(checkpoint_id, spec, at)] = stored
    at = int(at)
    assert isinstance(spec, dict)
    spec = {k: v for k, v in spec.items() if k != "startFrom"}
    spec["exclusiveToSubmitter"] = False
    imported = asyncio.run(_export_import(box.dsn, run, str(checkpoint_id),
                                          box.path / f"at-{at}.flysess", spec))
    node = start_node(box.path, "a", box.dsn)
    try:
        wait_for("the imported run to end", lambda: terminal(box.dsn, imported), 60)
    finally:
        assert stop(node) == 0
    state, outcome, _ = run_row(box.dsn, imported)
    assert state == "succeeded" and outcome is not None, (state, outcome)
    [resumed] = events(parse_log(node_log(box.path, "a")), "run.resumed")
    assert (resumed["checkpoint_id"], resumed["boundary"]) == (checkpoint_id, at)
    again = assert_effects_once(box.dsn, imported, first=at + 1)
    assert again == payloads[at:]
    assert outcome["boundary"] == STEPS
    assert outcome["behaviourDigest"] == digest_of(payloads[at:])
