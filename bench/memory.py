"""Memory benchmark: RSS of the router, the node and the workers after 10k steps.

One `flyd run --steps 10000 --mode process` (default composition: fly-a, fly-b, arena; default
checkpoint cadence) against a database created and dropped here (`FLYD_TEST_DSN`'s server or
127.0.0.1:5432). The node is the `flyd run` process itself; the router is its `flyd router` child;
the workers are its `workers.agent` / `workers.environment` children, found with psutil. Their
RSS is sampled at every `run.progress` log line (every 5 s, cli.md §4); the last sample is the
reported one (the run's end tears the processes down, so "after 10k steps" is read just before
the end, at `at_step`; a run shorter than one progress interval reports its first sample). The
floor is the RSS of a bare interpreter (the same `python`, `-c` waiting on stdin: `python -c
pass` lives too briefly to be sampled). Prints:

  {"bench":"memory","steps":..,"at_step":..,"baseline_mib":..,"router_mib":..,
   "router_over_mib":..,"node_mib":..,"node_over_mib":..,"workers_mib":{id: ..},
   "worker_over_mib":..,"targets_over_mib":{"router":40,"worker":30},"met":{..}}

`worker_over_mib` is the largest worker's RSS over the baseline (the target: ≤ 30 MiB); the
router's target is ≤ 40 MiB over the baseline. Run it as `python -P bench/memory.py`. Progress
goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import orjson
import psutil
import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

ROOT = Path(__file__).resolve().parent.parent
LOCAL = "postgresql://postgres@127.0.0.1:5432/postgres"
MIB = 1 << 20
TARGETS = {"router": 40, "worker": 30}
RUN_DEADLINE_S = 400.0
#: extra deadline per step: a loaded 2-CPU host runs 10k steps well below 30 steps/s
DEADLINE_S_PER_STEP = 0.1


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def emit(line: dict[str, Any]) -> None:
    print(orjson.dumps(line).decode(), flush=True)


def baseline_rss() -> int:
    """RSS of an idle bare interpreter."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    try:
        time.sleep(1.0)
        return int(psutil.Process(proc.pid).memory_info().rss)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)


def flag(cmdline: list[str], name: str) -> str | None:
    return cmdline[cmdline.index(name) + 1] if name in cmdline[:-1] else None


def sample(node: psutil.Process) -> dict[str, Any]:
    """RSS of the node, its router and its workers (by worker id)."""
    out: dict[str, Any] = {"node": node.memory_info().rss, "router": None, "workers": {}}
    for child in node.children(recursive=True):
        try:
            cmd = child.cmdline()
            rss = child.memory_info().rss
        except psutil.NoSuchProcess:
            continue
        if "router" in cmd and "flyd" in cmd:
            out["router"] = rss
        elif any(m in cmd for m in ("workers.agent", "workers.environment")):
            worker = flag(cmd, "--worker")
            if worker is not None:
                out["workers"][worker] = rss
    return out


def measure(dsn: str, steps: int) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(at_step, sample, summary) of one run."""
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "flyd", "run", "--json", "--log-format", "json", "--steps",
         str(steps), "--mode", "process", "--dsn", dsn, "--socket", str(tmp / "run.sock"),
         "--state-dir", str(tmp / "state")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    watchdog = threading.Timer(RUN_DEADLINE_S + DEADLINE_S_PER_STEP * steps, proc.send_signal,
                               (signal.SIGTERM,))
    watchdog.start()
    node = psutil.Process(proc.pid)
    taken: tuple[int, dict[str, Any]] | None = None
    try:
        assert proc.stderr is not None and proc.stdout is not None
        for raw in proc.stderr:
            try:
                line = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            if not isinstance(line, dict) or line.get("event") != "run.progress":
                continue
            step = int(line["step"])
            try:
                now = sample(node)
            except psutil.NoSuchProcess:
                break
            taken = (step, now)
            progress(f"step {step}: node {now['node'] / MIB:.1f} MiB")
        out = proc.stdout.read()
        proc.wait(60)
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    summary: dict[str, Any] = orjson.loads(out)
    if summary.get("state") != "succeeded":
        raise RuntimeError(f"flyd run ended {summary.get('state')}: "
                           f"{summary.get('failures') or summary.get('error')}")
    if taken is None:
        raise RuntimeError(f"no progress line during {steps} steps: nothing sampled")
    return taken[0], taken[1], summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    args = ap.parse_args()
    admin = os.environ.get("FLYD_TEST_DSN") or LOCAL
    name = f"flyd_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        base = baseline_rss()
        progress(f"bare interpreter: {base / MIB:.1f} MiB; flyd run --steps {args.steps}")
        at, rss, summary = measure(make_conninfo(admin, dbname=name), args.steps)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
    if rss["router"] is None or not rss["workers"]:
        raise RuntimeError(f"router or workers not found among the node's children: {rss}")
    router_over = (rss["router"] - base) / MIB
    worker_over = (max(rss["workers"].values()) - base) / MIB
    emit({"bench": "memory", "steps": summary["steps"], "at_step": at,
          "steps_per_s": summary["stepsPerSecond"], "baseline_mib": round(base / MIB, 1),
          "router_mib": round(rss["router"] / MIB, 1), "router_over_mib": round(router_over, 1),
          "node_mib": round(rss["node"] / MIB, 1),
          "node_over_mib": round((rss["node"] - base) / MIB, 1),
          "workers_mib": {w: round(v / MIB, 1) for w, v in sorted(rss["workers"].items())},
          "worker_over_mib": round(worker_over, 1), "targets_over_mib": TARGETS,
          "met": {"router": router_over <= TARGETS["router"],
                  "worker": worker_over <= TARGETS["worker"]}})


if __name__ == "__main__":
    main()
