"""Agent-scaling benchmark: steps/s of `flyd run` for 1, 2, 4, 8, 16, 32 and 64 agents.

Each point is one `flyd run --agents a1,...,aN --checkpoint-every 0 --no-pace` with synthetic
models (the arena declares one port per agent: `flyd run` binds agent i to port p<i> and the
counter arena declares exactly the spec's ports). A config file raises `[session] max_agents` to
the largest count (session.md §7.2, range 1..256; the node sizes its router from it, cli.md §5.1)
and `[node] threads` to that composition's thread need (§7.3: reservation + world + one per
agent). Prints one JSON line per count and one verdict line:

  {"bench":"agent_scaling","agents":N,"mode":..,"steps":..,"seconds":..,"steps_per_s":..,
   "ms_per_step":..,"linear_ms_per_step":..,"ratio":..}
  {"bench":"agent_scaling_fit","fit_agents":[2,4,8],"ms_per_step_at_0":..,"ms_per_agent":..,
   "ratio_at_64":..,"target":1.2}

`linear_ms_per_step` is the least-squares line through the 2, 4 and 8 agent points (time per step
= a + b·agents), evaluated at N, measured in the same run; `ratio` = measured / linear (the
target: ≤ 1.2 at 64 agents, i.e. time per step grows at most linearly).

Decisions:
- The rate comes from the run's own `run.progress` log lines (every 5 s, cli.md §4) over a fixed
  window, not from the summary, so the launch and the final capture stay out of it. The run is
  abandoned with SIGTERM once the window is measured.
- The default mode is `thread` (every agent still has its own connection and event loop);
  `--mode process` runs the same sweep with a process per agent, forked from the node's fork
  server (docs/launcher.md).

Runs against `FLYD_TEST_DSN`'s server (or 127.0.0.1:5432) in a database created and dropped here.
Run it as `python -P bench/agent_scaling.py`. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"
COUNTS = (1, 2, 4, 8, 16, 32, 64)
FIT = (2, 4, 8)
TARGET = 1.2
COORDINATOR_RESERVATION = 1
MANY_STEPS = 10_000_000
RUN_DEADLINE_S = 120.0
STOP_S = 60.0


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def emit(line: dict[str, Any]) -> None:
    print(orjson.dumps(line).decode(), flush=True)


def config_text(max_agents: int, agents_per_process: int = 1) -> str:
    """The node configuration of the sweep: room for `max_agents` agents of one thread each,
    `agents_per_process` agents per worker process (docs/launcher.md, "Agent hosts")."""
    threads = COORDINATOR_RESERVATION + 1 + max_agents
    return (f"[session]\nmax_agents = {max_agents}\nagents_per_process = {agents_per_process}\n"
            f"[node]\nthreads = {threads}\n")


@contextlib.contextmanager
def scratch_database() -> Iterator[str]:
    """A database of its own on `FLYD_TEST_DSN`'s server (or 127.0.0.1:5432), dropped after:
    its DSN."""
    admin = os.environ.get("FLYD_TEST_DSN") or LOCAL
    name = f"flyd_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_conninfo(admin, dbname=name)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def measure(tmp: Path, dsn: str, agents: int, mode: str, intervals: int) -> dict[str, Any]:
    """Steps/s of a `flyd run` with `agents` agents from its `run.progress` log lines.

    The rate is taken between the first progress line past step 0 and the one `intervals`
    lines later (5 s apart, cli.md §4), so launch and shutdown are excluded; then the run is
    abandoned with SIGTERM (its database is dropped with the bench's)."""
    ids = ",".join(f"a{i}" for i in range(1, agents + 1))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flyd", "run", "--json", "--log-format", "json", "--steps",
         str(MANY_STEPS), "--checkpoint-every", "0", "--no-pace", "--mode", mode, "--agents",
         ids, "--config", str(tmp / "flyd.toml"), "--dsn", dsn, "--socket",
         str(tmp / "run.sock"), "--state-dir", str(tmp / "state")],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watchdog = threading.Timer(RUN_DEADLINE_S, proc.kill)
    watchdog.start()
    points: list[tuple[float, int]] = []
    tail: list[bytes] = []
    try:
        assert proc.stderr is not None
        for raw in proc.stderr:
            tail = [*tail[-20:], raw]
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(line, dict) or line.get("event") != "run.progress":
                continue
            step = int(line["step"])
            if step > 0 or points:
                points.append((datetime.fromisoformat(line["ts"]).timestamp(), step))
            if len(points) > intervals:
                break
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if len(points) <= intervals:
        raise RuntimeError(f"flyd run with {agents} agents stopped before {intervals} progress "
                           f"intervals: {b''.join(tail).decode(errors='replace')[-2000:]}")
    (t0, s0), (t1, s1) = points[0], points[intervals]
    return {"mode": mode, "steps": s1 - s0, "seconds": t1 - t0, "steps_per_s": (s1 - s0) / (
        t1 - t0)}


def linear_fit(points: dict[int, float]) -> tuple[float, float]:
    """Least squares `ms = a + b·agents` through the FIT points: returns (a, b)."""
    xs = [float(n) for n in FIT]
    ys = [points[n] for n in FIT]
    mx = sum(xs) / len(xs)
    my = sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="thread", choices=("process", "thread", "in-process"))
    ap.add_argument("--intervals", type=int, default=2,
                    help="progress intervals (5 s each) measured per count")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp"))
    results: dict[int, dict[str, Any]] = {}
    try:
        with scratch_database() as dsn:
            (tmp / "flyd.toml").write_text(config_text(max(COUNTS)))
            for agents in COUNTS:
                progress(f"{agents} agents, mode {args.mode}, {args.intervals} x 5 s")
                results[agents] = measure(tmp, dsn, agents, args.mode, args.intervals)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ms = {n: 1000.0 / r["steps_per_s"] for n, r in results.items()}
    a, b = linear_fit(ms)
    for n, r in results.items():
        linear = a + b * n
        emit({"bench": "agent_scaling", "agents": n, "mode": r["mode"], "steps": r["steps"],
              "seconds": round(r["seconds"], 3), "steps_per_s": round(r["steps_per_s"], 2),
              "ms_per_step": round(ms[n], 3), "linear_ms_per_step": round(linear, 3),
              "ratio": round(ms[n] / linear, 3)})
    top = max(COUNTS)
    emit({"bench": "agent_scaling_fit", "fit_agents": list(FIT),
          "ms_per_step_at_0": round(a, 3), "ms_per_agent": round(b, 3),
          "ratio_at_64": round(ms[top] / (a + b * top), 3), "target": TARGET})


if __name__ == "__main__":
    main()
