"""Long runs in flat memory (issue 17): `flyd run` of `LONG_STEPS` (20 000) thread-mode steps
with no checkpoint cadence (forced captures of 4096 effects) on the embedded PostgreSQL (Unix
socket, where the 4096-effect commit used to hang), and with a checkpoint at every step on the
test server (TCP). Those two cover both cadences and both connections within the suite's
budget (a cadence-1 run is the slowest, about 10 minutes of one CPU); `make soak` runs both
cadences at 10^5 steps, and tests/distribution/test_large_commit.py commits 4096 effects over
both connections.

Each run is `scripts/long_run.py` (one `flyd run` subprocess, its RSS and its router's sampled
every 0.5 s against the boundary its progress lines report): it must end `succeeded`, its ledger
must hold `boundary-1..N` and `finish` exactly once, and the median RSS of the node (in thread
mode also the workers' process) and of the router over 75–100 % of the run must not exceed
their median over 20–45 % by more than 20 % (medians over windows, not peaks: a forced
capture lifts the node's RSS by 15–30 MB for under a second, and whether a sample falls on one
is chance; scripts/long_run.py says more). Why 20 % and one-sided: glibc's per-thread arenas
moved the node's level by about a tenth between windows of one run (measured on peaks: +12 %
and −11 % in two 20 000-step runs), and a shrinking RSS is no leak. The defect this guards
against kept 16 KB per step, over +100 % between the windows; `make soak`'s
10^5-step runs bound slower growth. Each combination is its own test, so xdist spreads them
over its workers.
`FLYD_LONG_STEPS` shortens the runs for a quick local check; `make test` uses the default.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serve_nodes import ROOT, process_dir

sys.path.insert(0, str(ROOT / "scripts"))
from long_run import long_run

LONG_STEPS = int(os.environ.get("FLYD_LONG_STEPS", "20000"))
TOLERANCE = 0.20
TIMEOUT_S = 1800

pytestmark = [pytest.mark.timeout(TIMEOUT_S + 120), pytest.mark.long]


@pytest.fixture
def work() -> Iterator[Path]:
    with process_dir("flyd-long-") as path:
        yield path


@pytest.mark.parametrize(("database", "cadence"), [("embedded", 0), ("tcp", 1)],
                         ids=["embedded-cadence-0", "tcp-cadence-1"])
def test_a_long_run_succeeds_once_per_boundary_in_flat_memory(
        work: Path, db_dsn: str, cadence: int, database: str) -> None:
    run = long_run(LONG_STEPS, cadence, dsn=db_dsn if database == "tcp" else None, work=work,
                   timeout_s=TIMEOUT_S)
    report = json.dumps(run.to_json())
    assert run.summary["state"] == "succeeded", report
    assert run.summary["boundary"] == LONG_STEPS, report
    assert run.ledger_ok, report
    growth = run.growth()
    assert {"node", "router"} <= set(growth), f"no samples at 20 % and at the end: {report}"
    assert all(g <= TOLERANCE for g in growth.values()), report
