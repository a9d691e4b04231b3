"""Request-path CPU in situ: the thread CPU of each stage of a worker's request handling, measured
inside the worker processes of a real `flyd run --mode process` session.

Whole-tree CPU per step (`step_cpu.py`) says how much a step costs, not where; cProfile and
py-spy say where, but cProfile inflates call-heavy code several times over and py-spy cannot
tell a waiting thread from a working one. This bench wraps each stage of the request path in
`time.thread_time_ns()` (the calling thread's CPU, so time spent waiting or descheduled is not
counted) and reports, per worker role, the CPU per call and per step of each stage:

  {"bench":"request_cpu","role":"agent"|"world","agents":N,"steps":S,"processes":P,
   "stages":{"<stage>":{"calls_per_step":..,"us_per_call":..,"us_per_step":..},..}}

Stages (nested: `handler` contains the ones after it):
- `frames_in`: `bus.client` reading and dispatching what arrived (decode, envelope checks, the
  handler task's creation);
- `writes`: the SDK's flush (the socket write);
- `handler`: `WorkerShell._on_request`, the whole of one request (session.md §2.2);
- `parse`, `params_schema`, `digest`, `admit`, `complete`, `outcome`: its protocol stages
  (`parse_request`, `check_params`, the body digest, the result cache's admission and record,
  the outcome's JSON);
- `prepare`, `commit`, `advance`: the endpoint's handler (it includes `params_schema`).

How: the bench writes a `sitecustomize.py` into a scratch directory on `PYTHONPATH`; it wraps
the stage functions in every process that imports them (the fork server imports the worker
modules, so every forked worker inherits the wrappers) and each worker writes its counters to a
file of its own every 100 requests. Each wrapper costs two clock reads (about 1 µs on this kind
of host), which the figures include. The first `--skip` requests of each worker (its warm-up)
are left out.

Run it as `python -P bench/request_cpu.py [--steps S] [--agents N]`. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import collections
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import timeit
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent

SITECUSTOMIZE = r'''
import collections, os, sys, time
import orjson

OUT = os.environ.get("FLYD_BENCH_STAGES")
SKIP = int(os.environ.get("FLYD_BENCH_SKIP", "0"))
if OUT:
    import bus.client as client
    import workers.agent as agent
    import workers.environment as environment
    import workers.shell as shell

    stats = collections.defaultdict(lambda: [0, 0])
    samples = {}
    handled = [0]
    clock = time.thread_time_ns

    def dump():
        cmdline = open("/proc/self/cmdline", "rb").read().split(b"\0")
        role = ("agent" if b"workers.agent" in cmdline else
                "world" if b"workers.environment" in cmdline else None)
        if role is not None:
            with open(os.path.join(OUT, f"{os.getpid()}.json"), "wb") as f:
                f.write(orjson.dumps({"role": role, "stats": stats, "samples": samples}))

    def timed(owner, name, stage, is_async=False):
        original = getattr(owner, name)
        if is_async:
            async def wrapper(*args, **kwargs):
                if stage == "handler" and SKIP <= handled[0] < SKIP + 2:
                    samples.setdefault(args[1].method, args[1].payload)
                start = clock()
                result = await original(*args, **kwargs)
                if handled[0] >= SKIP:
                    entry = stats[stage]; entry[0] += 1; entry[1] += clock() - start
                if stage == "handler":
                    handled[0] += 1
                    if handled[0] % 100 == 0:
                        dump()
                return result
        else:
            def wrapper(*args, **kwargs):
                start = clock()
                result = original(*args, **kwargs)
                if handled[0] >= SKIP:
                    entry = stats[stage]; entry[0] += 1; entry[1] += clock() - start
                return result
        setattr(owner, name, wrapper)

    timed(client._Protocol, "data_received", "frames_in")
    timed(client.BusClient, "_flush", "writes")
    timed(shell.WorkerShell, "_on_request", "handler", is_async=True)
    timed(shell, "parse_request", "parse")
    for module in (agent, environment):
        timed(module, "check_params", "params_schema")
    timed(shell.Request, "digest", "digest")
    timed(shell.ResultCache, "admit_step", "admit")
    timed(shell.ResultCache, "complete", "complete")
    timed(shell.WorkerShell, "_outcome", "outcome")
    timed(agent.AgentEndpoint, "prepare", "prepare", is_async=True)
    timed(agent.AgentEndpoint, "commit", "commit", is_async=True)
    timed(environment.EnvironmentEndpoint, "advance", "advance", is_async=True)
'''


# bench/step_cpu.py by path (the bench runs with -P: `bench/bus.py` would shadow `bus`); it
# loads its own siblings, so that loader is written once, there.
scaling = SimpleNamespace(**runpy.run_path(str(ROOT / "bench" / "step_cpu.py"),
                                           run_name="bench_step_cpu")).scaling


def run(tmp: Path, dsn: str, agents: int, steps: int, skip: int) -> dict[str, Any]:
    """One instrumented `flyd run`; its summary."""
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp / "stages"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]),
               FLYD_BENCH_STAGES=str(out), FLYD_BENCH_SKIP=str(skip))
    ids = ",".join(f"a{i}" for i in range(1, agents + 1))
    done = subprocess.run(
        [sys.executable, "-m", "flyd", "run", "--json", "-q", "--log-format", "json",
         "--steps", str(steps), "--checkpoint-every", "0", "--no-pace", "--mode", "process",
         "--agents", ids, "--config", str(tmp / "flyd.toml"), "--dsn", dsn, "--socket",
         str(tmp / "run.sock"), "--state-dir", str(tmp / "state")],
        cwd=ROOT, env=env, capture_output=True, check=False)
    try:
        summary: dict[str, Any] = orjson.loads(done.stdout)
    except orjson.JSONDecodeError:
        raise RuntimeError(f"flyd run printed no summary (exit {done.returncode}): "
                           f"{done.stderr.decode(errors='replace')[-2000:]}") from None
    if summary["state"] != "succeeded":
        raise RuntimeError(f"the run ended {summary['state']}: {summary.get('failures')}")
    return summary


def hot_us(samples: dict[str, Any]) -> dict[str, float]:
    """The protocol stages run back to back in this process on one recorded payload of each
    method the role served (caches warm): microseconds per call, averaged over the methods."""
    from workers.rpc import parse_request
    from workers.shell import check_params

    def best_us(fn: Callable[[], object]) -> float:
        return min(timeit.repeat(fn, number=500, repeat=5)) / 500 * 1e6

    totals: dict[str, float] = collections.defaultdict(float)
    for method, payload in samples.items():
        request = parse_request(payload)
        totals["parse"] += best_us(partial(parse_request, payload)) / len(samples)
        totals["digest"] += best_us(partial(request.digest, method)) / len(samples)
        totals["params_schema"] += best_us(
            partial(check_params, method, request.params)) / len(samples)
    return {stage: round(us, 1) for stage, us in totals.items()}


def report(out: Path, agents: int, steps: int, skip: int) -> list[dict[str, Any]]:
    """One line per role: the stages summed over that role's processes, per call and per step
    (per step of one process: an agent's figures are one agent's)."""
    by_role: dict[str, dict[str, list[int]]] = collections.defaultdict(
        lambda: collections.defaultdict(lambda: [0, 0]))
    processes: collections.Counter[str] = collections.Counter()
    samples: dict[str, dict[str, Any]] = collections.defaultdict(dict)
    for path in sorted(out.glob("*.json")):
        got = orjson.loads(path.read_bytes())
        processes[got["role"]] += 1
        samples[got["role"]].update(got["samples"])
        for stage, (calls, ns) in got["stats"].items():
            entry = by_role[got["role"]][stage]
            entry[0] += calls
            entry[1] += ns
    lines = []
    for role, stages in sorted(by_role.items()):
        handled = stages["handler"][0]
        per_process_steps = handled / processes[role] / (2 if role == "agent" else 1)
        hot = hot_us(samples[role])
        lines.append({
            "bench": "request_cpu", "role": role, "agents": agents, "steps": steps,
            "skipped_requests": skip, "processes": processes[role],
            "stages": {stage: {
                "calls_per_step": round(calls / processes[role] / per_process_steps, 2),
                "us_per_call": round(ns / calls / 1000, 1),
                "us_per_step": round(ns / processes[role] / per_process_steps / 1000, 1),
                **({"hot_us_per_call": hot[stage]} if stage in hot else {})}
                for stage, (calls, ns) in stages.items() if calls},
        })
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--skip", type=int, default=200, help="warm-up requests left out per worker")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp"))
    try:
        with scaling.scratch_database() as dsn:
            (tmp / "flyd.toml").write_text(scaling.config_text(args.agents))
            scaling.progress(f"{args.agents} agents, {args.steps} steps, instrumented")
            run(tmp, dsn, args.agents, args.steps, args.skip)
            for line in report(tmp / "stages", args.agents, args.steps, args.skip):
                scaling.emit(line)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
