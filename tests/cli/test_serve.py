"""`flyd serve` nodes working through the shared queue (cli.md §5, §11 tests 14–15).

Real node processes on the test's own database; runs are inserted with the production submit
statement (`PgStore.submit`), as `flyctl runs submit` does.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest

from flyd.leases.params import LeaseParams
from flyd.leases.pgstore import DbSettings, PgStore
from flyd.runspec import RunSpec
from tests.serve_nodes import node_log, processes_under, query, start_node, stop, wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="flyd-s-", dir="/tmp"))
    try:
        yield path
    finally:
        survivors = processes_under(str(path))
        for proc in survivors:
            proc.kill()
        shutil.rmtree(path, ignore_errors=True)
        assert not survivors, f"processes outlived the test: {survivors}"


async def _submit(dsn: str, spec: Mapping[str, Any]) -> int:
    store = PgStore(dsn, "test", DbSettings(), LeaseParams())
    await store.open()
    try:
        return (await store.submit(None, spec, 3)).run_id
    finally:
        await store.close()


def submit(dsn: str, spec: Mapping[str, Any]) -> int:
    return asyncio.run(_submit(dsn, spec))


def spec_json(steps: int, agents: int = 2, mode: str = "in-process") -> dict[str, Any]:
    ids = ["fly-a", "fly-b", "fly-c", "fly-d"][:agents]
    return RunSpec.validate({
        "steps": str(steps), "mode": mode,
        "agents": [{"agentId": a, "portId": f"p{i + 1}", "seed": None}
                   for i, a in enumerate(ids)]}).to_json()


def run_state(dsn: str, run: int) -> tuple[str, int, Any]:
    row = query(dsn, "SELECT state::text, attempt, outcome FROM flyd.runs WHERE run_id = %s",
                run)[0]
    return str(row[0]), int(row[1]), row[2]  # type: ignore[call-overload]


def log_events(tmp: Path, name: str, event: str) -> list[dict[str, Any]]:
    out = []
    for line in node_log(tmp, name).splitlines():
        if line.startswith("{"):
            record = orjson.loads(line)
            if record.get("event") == event:
                out.append(record)
    return out


def test_a_run_that_does_not_fit_is_released_not_failed(db_dsn: str, tmp: Path) -> None:
    run = submit(db_dsn, spec_json(20, agents=3))
    small = start_node(tmp, "small", db_dsn, config="[node]\nthreads = 4\n")
    big = None
    try:
        wait_for("the small node to release the run",
                 lambda: bool(query(db_dsn, "SELECT 1 FROM flyd.run_attempts "
                                            "WHERE run_id = %s AND end_reason = 'released'",
                                    run)), 60)
        state, attempt, _ = run_state(db_dsn, run)
        assert (state, attempt) == ("pending", 0)
        refusals = log_events(tmp, "small", "run_does_not_fit")
        assert refusals and refusals[0]["need"] == 5 and refusals[0]["total"] == 4
        assert not log_events(tmp, "small", "finished")
        big = start_node(tmp, "big", db_dsn, config="[node]\nthreads = 8\n")
        wait_for("the big node to finish the run",
                 lambda: run_state(db_dsn, run)[0] != "pending"
                 and run_state(db_dsn, run)[0] != "running", 90)
        final, _, outcome = run_state(db_dsn, run)
        assert final == "succeeded", outcome
        owners = query(db_dsn, "SELECT n.node_name, a.end_reason FROM flyd.run_attempts a "
                               "JOIN flyd.nodes n USING (node_id) WHERE a.run_id = %s "
                               "ORDER BY a.lease_epoch", run)
        assert owners[-1] == ("big", "finished")
        assert {o for o in owners[:-1]} == {("small", "released")}
    finally:
        assert stop(small) == 0
        if big is not None:
            assert stop(big) == 0


def test_an_invalid_run_spec_fails_with_its_path(db_dsn: str, tmp: Path) -> None:
    bad = spec_json(10)
    bad["agents"][0]["threads"] = 0
    run = submit(db_dsn, bad)
    node = start_node(tmp, "n", db_dsn)
    try:
        wait_for("the node to end the invalid run",
                 lambda: run_state(db_dsn, run)[0] not in ("pending", "running"), 60)
        state, _, outcome = run_state(db_dsn, run)
        assert state == "failed"
        assert outcome["error"] == "invalid run spec"
        assert outcome["path"] == "/agents/0/threads" and outcome["reason"]
        assert not log_events(tmp, "n", "launcher.launched")
        keys = query(db_dsn, "SELECT effect_key FROM flyd.effects WHERE run_id = %s", run)
        assert keys == [("finish",)]
        good = submit(db_dsn, spec_json(10))
        wait_for("the node to keep serving",
                 lambda: run_state(db_dsn, good)[0] == "succeeded", 60)
    finally:
        assert stop(node) == 0
