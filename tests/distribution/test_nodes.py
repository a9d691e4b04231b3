"""Two real `flyd serve` nodes on one database; one is SIGKILLed mid-run (distribution.md §5).

Each node is `python -m flyd serve` with its own socket, state dir and name, reading time from
the harness clock file (`--sim-clock`, §7.3.4) at `time_scale` sim seconds per real second, so
the default 15 s TTL passes in three real seconds: nothing here waits out a TTL in real time. The
scale is the fault suite's (docs/faults.md): at 10, a node off the CPU for 100 ms on a loaded
host loses a second of sim time, and renewals and claims time out for no fault at all.
Runs checkpoint every 10 steps, so a reclaimed run resumes from the head its first holder
committed. The ledger is the witness: every run must end `succeeded` with exactly its
`boundary-1..N` effects and one `finish`, at least one run must show a second grant (the kill
bit) and boundaries committed by both grants (the resume), and no process of the killed node
may survive it.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from flyd.leases.params import LeaseParams
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.session.runspec import RunSpec
from tests.distribution.harness.clock import HarnessClock
from tests.serve_nodes import (
    commands_under,
    process_dir,
    processes_under,
    query,
    start_node,
    wait_for,
)

pytestmark = pytest.mark.timeout(240)

TIME_SCALE = 5.0
RUNS = 6
STEPS = 60
PACE_S = 0.05
EVERY = 10


@pytest.fixture
def tmp() -> Iterator[Path]:
    with process_dir("flyd-n-") as path:
        yield path


async def submit_runs(dsn: str) -> list[int]:
    spec = RunSpec.validate({"steps": str(STEPS), "mode": "process", "paceS": PACE_S,
                             "checkpoints": {"everySteps": EVERY}}).to_json()
    store = PgStore(dsn, "harness", DbSettings(), LeaseParams())
    await store.open()
    try:
        return [(await store.submit(f"run-{i}", spec, 10)).run_id for i in range(RUNS)]
    finally:
        await store.close()


def test_two_nodes_lose_one_and_every_run_completes_once(db_dsn: str, tmp: Path) -> None:
    with HarnessClock(db_dsn, tmp / "clock", time_scale=TIME_SCALE):
        clock = ("--sim-clock", str(tmp / "clock"), "--time-scale", str(TIME_SCALE),
                 "--capacity", "3")
        a = start_node(tmp, "a", db_dsn, *clock, config="[node]\nthreads = 12\n")
        b = start_node(tmp, "b", db_dsn, *clock, config="[node]\nthreads = 12\n")
        try:
            runs = asyncio.run(submit_runs(db_dsn))

            def a_is_working() -> bool:
                """Node a holds a run whose head it moved (a checkpoint is durable)."""
                held = query(db_dsn, "SELECT count(*) FROM flyd.runs r JOIN flyd.nodes n "
                             "ON n.node_id = r.owner_node JOIN flyd.run_heads h USING (run_id) "
                             "WHERE n.node_name = 'a' AND r.state = 'running' "
                             "AND h.boundary >= %s", EVERY)
                workers = [p for p, cmd in commands_under(str(tmp / "a")) if "workers." in cmd]
                return int(held[0][0]) > 0 and len(workers) >= 3  # type: ignore[call-overload]

            wait_for("node a to run workers", a_is_working, 90)
            a_runs = {int(r[0]) for r in query(  # type: ignore[call-overload]
                db_dsn, "SELECT r.run_id FROM flyd.runs r JOIN flyd.nodes n ON "
                "n.node_id = r.owner_node WHERE n.node_name = 'a' AND r.state = 'running'")}
            a.send_signal(signal.SIGKILL)
            a.wait(10)
            wait_for("node a's router and workers to die",
                     lambda: not processes_under(str(tmp / "a")), 10)

            def all_terminal() -> bool:
                rows = query(db_dsn, "SELECT count(*) FROM flyd.runs WHERE state IN "
                             "('succeeded', 'failed', 'cancelled')")
                return rows[0][0] == RUNS

            wait_for("every run to end", all_terminal, 180)
            b.send_signal(signal.SIGTERM)
            assert b.wait(30) == 0
        finally:
            for proc in (a, b):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    states = query(db_dsn, "SELECT run_id, state::text, lease_epoch FROM flyd.runs "
                           "ORDER BY run_id")
    assert [(r[0], r[1]) for r in states] == [(run, "succeeded") for run in runs]
    digests = set()
    for run in runs:
        rows = query(db_dsn, "SELECT effect_key, payload_digest FROM flyd.effects "
                             "WHERE run_id = %s ORDER BY boundary NULLS LAST", run)
        keys = [str(r[0]) for r in rows]
        assert keys == [f"boundary-{k}" for k in range(1, STEPS + 1)] + ["finish"], run
        digests.add(tuple(bytes(r[1]) for r in rows[:-1]))  # type: ignore[arg-type]
    assert len(digests) == 1, "identical specs must record identical boundaries"
    regranted = query(db_dsn, "SELECT DISTINCT run_id FROM flyd.run_attempts "
                              "WHERE lease_epoch = 2")
    assert a_runs and {int(r[0]) for r in regranted} >= a_runs  # type: ignore[call-overload]
    resumed = query(db_dsn, "SELECT DISTINCT run_id FROM flyd.effects WHERE lease_epoch = 1 "
                            "AND boundary IS NOT NULL AND run_id IN (SELECT run_id FROM "
                            "flyd.run_attempts WHERE lease_epoch = 2)")
    assert resumed, "a reclaimed run resumed from the head its first holder committed"
    expired = query(db_dsn, "SELECT count(*) FROM flyd.run_attempts a JOIN flyd.nodes n "
                            "ON n.node_id = a.node_id WHERE n.node_name = 'a' "
                            "AND a.end_reason = 'expired'")
    assert expired[0][0] == len(a_runs)
