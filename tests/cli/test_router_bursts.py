"""Router deaths in quick succession under a `flyd serve` node (real processes, real
PostgreSQL): a router death never costs a recovery attempt, so routers SIGKILLed 1–1.5 s apart
never end a run "recovery attempts exhausted" (issue 23, item 6)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from flyd.session.runspec import RunSpec
from tests.cli.test_serve import run_state, submit
from tests.serve_nodes import (
    commands_under,
    node_log,
    process_dir,
    query,
    start_node,
    stop,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)

KILLS = 6
STEPS = 1800


@pytest.fixture
def tmp() -> Iterator[Path]:
    with process_dir("flyd-r-") as path:
        yield path


def router_of(socket: str) -> list[int]:
    return [p.pid for p, cmd in commands_under(socket)
            if "flyd" in cmd and " router " in f" {cmd} "]


def events(tmp: Path, name: str) -> list[dict[str, object]]:
    out = []
    for line in node_log(tmp, "n").splitlines():
        if line.startswith("{"):
            record = orjson.loads(line)
            if record.get("event") == name:
                out.append(record)
    return out


def test_routers_killed_a_second_apart_never_exhaust_recovery(db_dsn: str, tmp: Path) -> None:
    spec = RunSpec.validate({"steps": str(STEPS), "mode": "process", "paceS": 1 / 60,
                             "checkpoints": {"everySteps": 60}}).to_json()
    run = submit(db_dsn, spec)
    node = start_node(tmp, "n", db_dsn)
    socket = str(tmp / "n" / "bus.sock")
    rng = random.Random(23)
    killed: list[int] = []
    try:
        wait_for("a durable checkpoint", lambda: query(
            db_dsn, "SELECT boundary >= 60 FROM flyd.run_heads WHERE run_id = %s",
            run) == [(True,)], 90)
        while len(killed) < KILLS and run_state(db_dsn, run)[0] == "running":
            wait_for("a router to kill", lambda: len(router_of(socket)) == 1, 30)
            [pid] = router_of(socket)
            [router] = [p for p, _ in commands_under(socket) if p.pid == pid]
            router.kill()
            killed.append(pid)
            time.sleep(rng.uniform(1.0, 1.5))
        wait_for("the run to end", lambda: run_state(db_dsn, run)[0] not in (
            "pending", "running"), 150)
        state, attempt, outcome = run_state(db_dsn, run)
        assert len(killed) == KILLS and len(set(killed)) == KILLS, (
            "every kill hit a router of the running run", state, outcome)
        assert len(events(tmp, "router.exited")) == KILLS
        spent = events(tmp, "recovery.attempt_failed")
        assert not spent, f"recovery attempts spent on a router death: {spent}"
        assert state == "succeeded", (outcome, node_log(tmp, "n")[-4000:])
        assert attempt == 1, "no lease attempt was spent either"
        assert outcome["recoveries"] >= 1
        keys = query(db_dsn, "SELECT effect_key FROM flyd.effects WHERE run_id = %s "
                             "ORDER BY boundary NULLS LAST", run)
        assert [k for (k,) in keys] == [f"boundary-{j}" for j in range(1, STEPS + 1)] + [
            "finish"]
        clean = submit(db_dsn, spec)
        wait_for("the clean run", lambda: run_state(db_dsn, clean)[0] == "succeeded", 120)
        assert run_state(db_dsn, clean)[2]["behaviourDigest"] == outcome["behaviourDigest"]
    finally:
        assert stop(node) == 0
