"""Request-path CPU in situ: the thread CPU of each stage of a step's work, measured inside the
node, the router and the workers of a real `flyd run --mode process` session.

Whole-tree CPU per step (`step_cpu.py`) says how much a step costs, not where; cProfile and
py-spy say where, but cProfile inflates call-heavy code several times over and py-spy cannot
tell a waiting thread from a working one. This bench wraps each stage in `time.thread_time_ns()`
(the calling thread's CPU, so time spent waiting or descheduled is not counted) and reports, per
role, the CPU per call and per step of one process of that role:

  {"bench":"request_cpu","role":"node"|"router"|"world"|"agent","agents":N,"steps":S,
   "warmup_s":W,"measured_steps":M,"processes":P,
   "stages":{"<stage>":{"calls_per_step":..,"us_per_call":..,"us_per_step":..},..}}

Stages (some nest: a worker's `handler` contains its protocol stages and its endpoint's
handler, the router's `frames_in` contains `route`, the node's `check_advance` its
`decision_parse` of the inspection):
- workers: `frames_in` (`bus.client_connection` reading and dispatching what arrived: decode,
  envelope checks, the handler task's creation), `writes` (the SDK's flush), `handler`
  (`WorkerShell._on_request`, one whole request, session.md §2.2), its protocol stages `typed`,
  `parse`, `params_schema`, `digest`, `admit`, `complete`, `outcome` (`parse_typed`: the request
  and its params checked in one pass, wire.md §22.3; `parse_request` and `check_params`, which
  run only where the typed pass has no structure or refused; the body digest, the result
  cache's admission and record, the outcome's JSON), and the
  endpoint's `prepare`, `commit` or `advance` (each includes `params_schema`);
- router: `frames_in` (a read: frames decoded, checked, routed and the writes they cause) and
  `route` (one frame, `Router._on_frame`);
- node: `frames_in`, `writes`, `new_call` (a call's request), `call_out` (`Calls._admit`:
  the call's frame), `answer` (a reply's outcome: `answer`, or `answer_typed` with the result
  schema in the same pass), `check_reply` (echo checks, and the result schema when `answer`
  did not check it), `decision_parse` and
  `telemetry_parse` (a decision's and a commit telemetry's `from_json`), `controls`,
  `check_advance` (the world's observation), `step` (the transition's records), `trace`,
  `effect` and `publish` (the boundary's publication).
For the workers' protocol stages it also runs the same function back to back on a payload
recorded from the run (`hot_us_per_call`).

How: the bench writes a `sitecustomize.py` into a scratch directory on `PYTHONPATH`; it wraps
the stage functions of the process's role (the fork server imports the worker modules, so every
forked worker inherits the wrappers) and each process writes its counters to a file of its own
every 20 reads and at exit. Every process counts from the same instant, `--warmup` seconds
after launch (`time.monotonic()` is system-wide), so launch and warm-up stay out. A worker's
steps are its own requests (an agent serves two a step); the node's and the router's are the
node's transitions in the window. Each wrapper costs two clock reads (about 1 µs on this kind of
host), which the figures include.

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
import time
import timeit
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

ROOT = Path(__file__).resolve().parent.parent

SITECUSTOMIZE = r'''
import atexit, collections, os, sys, time
import orjson

OUT = os.environ.get("FLYD_BENCH_STAGES")
CMDLINE = open("/proc/self/cmdline", "rb").read().split(b"\0")
if OUT:
    FROM = float(os.environ["FLYD_BENCH_FROM"])  # time.monotonic() is system-wide
    stats = collections.defaultdict(lambda: [0, 0])
    samples = {}
    frames = [0]
    clock = time.thread_time_ns

    def dump():
        cmdline = open("/proc/self/cmdline", "rb").read().split(b"\0")
        role = ("agent" if b"workers.agent" in cmdline else
                "world" if b"workers.environment" in cmdline else
                "router" if b"router" in cmdline else
                "node" if b"run" in cmdline else None)
        if role is not None:
            with open(os.path.join(OUT, f"{os.getpid()}.json"), "wb") as f:
                f.write(orjson.dumps({"role": role, "stats": stats, "samples": samples}))

    def timed(owner, name, stage, is_async=False):
        # a stage the tree lacks is left out, so one bench compares a tree before a change
        original = getattr(owner, name, None)
        if original is None:
            return
        if is_async:
            async def wrapper(*args, **kwargs):
                if stage == "handler" and len(samples) < 2 and time.monotonic() >= FROM:
                    samples.setdefault(args[1].method, args[1].payload)
                start = clock()
                result = await original(*args, **kwargs)
                if time.monotonic() >= FROM:
                    entry = stats[stage]; entry[0] += 1; entry[1] += clock() - start
                return result
        else:
            def wrapper(*args, **kwargs):
                start = clock()
                result = original(*args, **kwargs)
                if time.monotonic() >= FROM:
                    entry = stats[stage]; entry[0] += 1; entry[1] += clock() - start
                if stage == "frames_in":
                    frames[0] += 1
                    if frames[0] % 20 == 0:
                        dump()
                return result
        if isinstance(owner, type) and isinstance(owner.__dict__.get(name), classmethod):
            wrapper = staticmethod(wrapper)
        setattr(owner, name, wrapper)

    atexit.register(dump)
    if b"workers.forkserver" in CMDLINE or b"workers.agent" in CMDLINE \
            or b"workers.environment" in CMDLINE:
        import bus.client_connection as client_connection
        import workers.agent as agent
        import workers.environment as environment
        import workers.shell as shell

        timed(client_connection.Connection, "data_received", "frames_in")
        timed(client_connection.Connection, "_flush", "writes")
        timed(shell.WorkerShell, "_on_request", "handler", is_async=True)
        timed(shell, "parse_typed", "typed")
        timed(shell, "parse_request", "parse")
        timed(shell, "check_params", "params_schema")
        timed(shell, "wire_digest", "digest")  # over the payload's wire bytes (wire.md §22.3)
        timed(shell.ResultCache, "admit_step", "admit")
        timed(shell.ResultCache, "complete", "complete")
        timed(shell.WorkerShell, "_outcome", "outcome")
        timed(agent.AgentEndpoint, "prepare", "prepare", is_async=True)
        timed(agent.AgentEndpoint, "commit", "commit", is_async=True)
        timed(environment.EnvironmentEndpoint, "advance", "advance", is_async=True)
    elif b"router" in CMDLINE:
        import bus.connection as connection
        import bus.router as router

        timed(connection.Conn, "data_received", "frames_in")
        timed(router.Router, "_on_frame", "route")
    elif b"run" in CMDLINE:
        import bus.client_calls as client_calls
        import bus.client_connection as client_connection
        import flyd.session.calls as calls
        import flyd.session.coordinator as coordinator
        import flyd.session.transition as transition

        timed(client_connection.Connection, "data_received", "frames_in")
        timed(client_connection.Connection, "_flush", "writes")
        timed(client_calls.Calls, "_admit", "call_out")
        timed(calls.CallEngine, "new_call", "new_call")
        timed(calls, "answer", "answer")  # the outcome's shape, before this tree's typed check
        timed(calls, "answer_typed", "answer")
        timed(calls.CallEngine, "check_reply", "check_reply")
        timed(transition.TypedValue, "from_json", "decision_parse")
        timed(transition.Telemetry, "from_json", "telemetry_parse")
        timed(transition, "controls_for", "controls")
        timed(transition, "check_advance", "check_advance")
        timed(coordinator, "transition_records", "step")
        timed(coordinator.TraceLog, "record", "trace")
        timed(coordinator.Coordinator, "_append_effect", "effect")
        timed(coordinator.Coordinator, "_publish_snapshot", "publish")
'''


# bench/step_cpu.py by path (the bench runs with -P: `bench/bus.py` would shadow `bus`); it
# loads its own siblings, so that loader is written once, there.
scaling = SimpleNamespace(**runpy.run_path(str(ROOT / "bench" / "step_cpu.py"),
                                           run_name="bench_step_cpu")).scaling


def run(tmp: Path, dsn: str, agents: int, steps: int, warmup: float) -> dict[str, Any]:
    """One instrumented `flyd run`; its summary."""
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    out = tmp / "stages"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]),
               FLYD_BENCH_STAGES=str(out), FLYD_BENCH_FROM=repr(time.monotonic() + warmup))
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
    from bus import codec
    from workers.dedup import wire_digest
    from workers.types.contract import check_params
    from workers.types.rpc import parse_request
    try:
        from workers.types.structures import parse_typed
    except ImportError:  # a tree before the typed decode
        parse_typed = None

    def best_us(fn: Callable[[], object]) -> float:
        return min(timeit.repeat(fn, number=500, repeat=5)) / 500 * 1e6

    totals: dict[str, float] = collections.defaultdict(float)
    for method, payload in samples.items():
        request = parse_request(payload)
        totals["parse"] += best_us(partial(parse_request, payload)) / len(samples)
        totals["digest"] += best_us(partial(wire_digest, method, codec.encode(payload))) / len(
            samples)
        totals["params_schema"] += best_us(
            partial(check_params, method, request.params)) / len(samples)
        if parse_typed is not None:
            totals["typed"] += best_us(partial(parse_typed, method, payload)) / len(samples)
    return {stage: round(us, 1) for stage, us in totals.items()}


def report(out: Path, agents: int, steps: int, warmup: float) -> list[dict[str, Any]]:
    """One line per role: the stages summed over that role's processes, per call and per step
    of one process (an agent's figures are one agent's). Steps: a worker's own (an agent
    handles two requests a step, the world one), the node's `step` stage (one per transition)
    for the node and the router."""
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
    node_steps = by_role["node"]["step"][0]
    if not node_steps:
        raise RuntimeError("the node recorded no transition inside the measured window")
    lines = []
    for role in ("node", "router", "world", "agent"):
        stages = by_role.get(role)
        if not stages:
            continue
        if role in ("agent", "world"):
            steps_each = stages["handler"][0] / processes[role] / (2 if role == "agent" else 1)
        else:
            steps_each = node_steps
        hot = hot_us(samples[role]) if samples[role] else {}
        lines.append({
            "bench": "request_cpu", "role": role, "agents": agents, "steps": steps,
            "warmup_s": warmup, "measured_steps": round(steps_each), "processes": processes[role],
            "stages": {stage: {
                "calls_per_step": round(calls / processes[role] / steps_each, 2),
                "us_per_call": round(ns / calls / 1000, 1),
                "us_per_step": round(ns / processes[role] / steps_each / 1000, 1),
                **({"hot_us_per_call": hot[stage]} if stage in hot else {})}
                for stage, (calls, ns) in stages.items() if calls},
        })
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--warmup", type=float, default=4.0,
                    help="seconds from launch left out (startup and warm-up)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp"))
    try:
        with scaling.scratch_database() as dsn:
            (tmp / "flyd.toml").write_text(scaling.config_text(args.agents))
            scaling.progress(f"{args.agents} agents, {args.steps} steps, instrumented")
            run(tmp, dsn, args.agents, args.steps, args.warmup)
            for line in report(tmp / "stages", args.agents, args.steps, args.warmup):
                scaling.emit(line)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
