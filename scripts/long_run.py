"""One long `flyd run` with its memory sampled: the check behind tests/cli/test_long_runs.py and
`make soak`'s long run (scripts/soak.py).

Why: a run of 10^4–10^5 steps must end `succeeded` with every boundary in the ledger exactly
once, and neither the `flyd run` process (the node; in thread mode also the workers) nor its
router child may grow with the run's length.

How: `python -m flyd run --json --mode thread --steps N --checkpoint-every C` in a subprocess,
against `dsn` (TCP) or, without one, the embedded PostgreSQL it starts under `state_dir`
(reached over its Unix socket). Its stderr (JSON logs) is read as it comes: `run.progress`
lines give the boundary reached. Every `SAMPLE_S` the RSS of the node, its router and its
worker processes (none in thread mode: the workers are threads of the node) is sampled with
the boundary. Memory "at 20 %" is each process's median RSS over the samples at 0.2·N..0.45·N,
"at 100 %" its median over 0.75·N..N (while it still runs). Medians over windows, not single
samples and not peaks: without a cadence the pending effects grow to `max_pending_effects`
(4096) between forced captures, and each forced capture lifts the node's RSS by 15-30 MB for
well under a second. Over a 40 000-step thread-mode run the node's samples stayed at
119-121 MB except near captures (138-145 MB); whether a 0.5 s sample falls on such a transient,
and how high, is chance, so a window's peak measured the sampling phase (a 20 000-step run's
peaks once grew +21 %, 126 -> 152 MB). A leak lifts every sample, so it lifts the median. Each
window spans more than one saw-tooth at the sizes run here (N >= 20 000); the peaks are
reported too.
After the run the ledger is read: `boundary-1..N` and `finish`, each exactly once.

    python scripts/long_run.py --steps 20000 --checkpoint-every 0 [--dsn DSN]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psutil
import psycopg

ROOT: Final = Path(__file__).resolve().parents[1]
SAMPLE_S: Final = 0.5
EARLY: Final = 0.2
EARLY_END: Final = 0.45
LATE: Final = 0.75


@dataclass
class Sample:
    boundary: int
    rss: dict[str, int]


@dataclass
class LongRun:
    """The outcome of one long run and the checks on it."""

    steps: int
    cadence: int
    database: str
    summary: dict[str, Any] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    ledger_ok: bool = False
    ledger_problem: str | None = None
    wall_s: float = 0.0

    def _window(self, low: float, high: float, roles: set[str] | None = None) -> list[Sample]:
        """The samples at low·N..high·N (with every role of `roles`)."""
        return [s for s in self.samples if low * self.steps <= s.boundary <= high * self.steps
                and (roles is None or roles <= set(s.rss))]

    @staticmethod
    def _reduce(window: list[Sample], how: Callable[[list[int]], float]) -> Sample | None:
        """Each role's RSS over the window reduced by `how` (the boundary is that of the last
        sample); None for an empty window."""
        if not window:
            return None
        roles = {role for sample in window for role in sample.rss}
        return Sample(window[-1].boundary,
                      {role: int(how([s.rss[role] for s in window if role in s.rss]))
                       for role in roles})

    def _late_window(self) -> list[Sample]:
        """0.75·N..N, over the samples with every process of the early window (the router
        stops as the run ends)."""
        early = self._window(EARLY, EARLY_END)
        roles = {role for sample in early for role in sample.rss}
        return self._window(LATE, 1.0, roles)

    def early(self) -> Sample | None:
        return self._reduce(self._window(EARLY, EARLY_END), statistics.median)

    def late(self) -> Sample | None:
        return self._reduce(self._late_window(), statistics.median)

    def growth(self) -> dict[str, float]:
        """Relative change of the median RSS from the 20 % window to the 100 % one, per role."""
        a, b = self.early(), self.late()
        if a is None or b is None:
            return {}
        return {role: (b.rss[role] - a.rss[role]) / a.rss[role]
                for role in a.rss if role in b.rss and a.rss[role] > 0}

    def to_json(self) -> dict[str, Any]:
        a, b = self.early(), self.late()
        peak_a = self._reduce(self._window(EARLY, EARLY_END), max)
        peak_b = self._reduce(self._late_window(), max)
        return {"steps": self.steps, "cadence": self.cadence, "database": self.database,
                "state": self.summary.get("state"), "boundary": self.summary.get("boundary"),
                "outcome": self.summary.get("outcome"), "ledgerOk": self.ledger_ok,
                "ledgerProblem": self.ledger_problem, "wallSeconds": round(self.wall_s, 1),
                "rssEarly": a.rss if a else None, "rssLate": b.rss if b else None,
                "boundaryEarly": a.boundary if a else None,
                "boundaryLate": b.boundary if b else None,
                "rssPeakEarly": peak_a.rss if peak_a else None,
                "rssPeakLate": peak_b.rss if peak_b else None,
                "growth": {k: round(v, 4) for k, v in self.growth().items()}}


def _roles(node: psutil.Process) -> dict[str, int]:
    """RSS of the node, its router child and its worker children (process mode)."""
    rss = {"node": node.memory_info().rss}
    workers = 0
    for child in node.children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            size = child.memory_info().rss
        except psutil.Error:
            continue
        if "router" in cmd:
            rss["router"] = size
        elif "workers." in cmd:
            workers += size
    if workers:
        rss["workers"] = workers
    return rss


def _ledger(dsn: str, run: int, steps: int) -> str | None:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT effect_key, count(*) FROM flyd.effects WHERE run_id = %s "
            "GROUP BY effect_key", (run,)).fetchall()
    counts = {str(k): int(n) for k, n in rows}
    want = {f"boundary-{k}" for k in range(1, steps + 1)} | {"finish"}
    if set(counts) != want:
        missing = sorted(want - set(counts))[:5]
        extra = sorted(set(counts) - want)[:5]
        return f"ledger keys differ: missing {missing}, unexpected {extra}"
    repeated = [k for k, n in counts.items() if n != 1]
    return f"keys recorded more than once: {repeated[:5]}" if repeated else None


def long_run(steps: int, cadence: int, *, dsn: str | None, work: Path,
             timeout_s: float) -> LongRun:
    """Run, sample, check (module docstring)."""
    result = LongRun(steps, cadence, "tcp" if dsn else "embedded")
    argv = [sys.executable, "-m", "flyd", "run", "--json", "--mode", "thread", "--steps",
            str(steps), "--checkpoint-every", str(cadence), "--socket", str(work / "bus.sock"),
            "--state-dir", str(work / "state")]
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLYD_SOCKET", "FLYD_CONFIG", "FLYD_DSN", "FLYD_STATE_DIR")}
    env["FLYD_LOG_FORMAT"] = "json"
    env["XDG_RUNTIME_DIR"] = str(work / "xdg")
    if dsn is not None:
        argv += ["--dsn", dsn]
    boundary = [0]

    def read(stream: Any) -> None:
        for line in stream:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("event") == "run.progress":
                boundary[0] = int(event.get("step", 0))

    started = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    reader = threading.Thread(target=read, args=(proc.stderr,), daemon=True)
    reader.start()
    node = psutil.Process(proc.pid)
    try:
        while proc.poll() is None:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"flyd run of {steps} steps still running after "
                                   f"{timeout_s} s (boundary {boundary[0]})")
            try:
                result.samples.append(Sample(boundary[0], _roles(node)))
            except psutil.Error:
                break
            time.sleep(SAMPLE_S)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    result.wall_s = time.monotonic() - started
    result.summary = json.loads(out.strip().splitlines()[-1])
    if result.summary.get("state") == "succeeded":
        run = int(result.summary["run"])
        result.ledger_problem = (_ledger(dsn, run, steps) if dsn is not None
                                 else _embedded_ledger(work / "state", run, steps))
        result.ledger_ok = result.ledger_problem is None
    return result


def _embedded_ledger(state_dir: Path, run: int, steps: int) -> str | None:
    """The embedded server stopped with `flyd run`: start it again through the module
    `flyd run` uses, read the ledger, stop it."""
    import asyncio

    from flyd.leases.embedded import EmbeddedPostgres

    async def read() -> str | None:
        server = EmbeddedPostgres()
        dsn = await server.start(state_dir)
        try:
            return await asyncio.to_thread(_ledger, dsn, run, steps)
        finally:
            await server.stop()

    return asyncio.run(read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--dsn", default=None, help="a migrated database (else embedded)")
    parser.add_argument("--timeout-s", type=float, default=7200.0)
    parser.add_argument("--rss-tolerance", type=float, default=0.20,
                        help="largest allowed growth of a peak RSS "
                             "(tests/cli/test_long_runs.py says why 20 %%)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flyd-long-", dir="/tmp") as tmp:
        run = long_run(args.steps, args.checkpoint_every, dsn=args.dsn, work=Path(tmp),
                       timeout_s=args.timeout_s)
    doc = run.to_json()
    ok = (run.summary.get("state") == "succeeded" and run.ledger_ok and bool(run.growth())
          and all(g <= args.rss_tolerance for g in run.growth().values()))
    doc["ok"] = ok
    print(json.dumps(doc))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
