"""Launcher benchmark: how long a session's three workers take to launch, restart and reap in
each execution mode, and how much memory a worker process holds.

The benchmark acts as a node: a router in this process with the default closed policy
(`Policy.default(os.getpid())`), a node connection that makes every `bus.expect`, and one
launcher per round that launches the default composition (fly-a, fly-b, arena) with
`launch_composition` (concurrently, identified by `Worker.Hello`).

Prints one JSON line per mode:
  {"bench":"launch","mode":..,"workers":3,"rounds":..,"launch_ms":{"min","median","max"},
   "restart_ms":{..},"reap_ms":{..}}
and one for the worker processes (process mode, sampled after a health check):
  {"bench":"worker_rss","mode":"process","rss_kib":{worker: ..},"peak_rss_kib":{worker: ..},
   "node_rss_kib":..}
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import structlog
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bus.client import connect  # noqa: E402
from bus.policy import Policy  # noqa: E402
from bus.router import Router, RouterConfig  # noqa: E402
from flyd.budget import ThreadBudget  # noqa: E402
from flyd.identities import SessionNames, SessionTags, new_node_id, node_client_id  # noqa: E402
from flyd.launcher import ExecutionMode, Launcher  # noqa: E402
from flyd.runspec import RunSpec  # noqa: E402
from flyd.spawn import process_info  # noqa: E402


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def summary(samples: list[float]) -> dict[str, float]:
    return {"min": round(min(samples), 1), "median": round(statistics.median(samples), 1),
            "max": round(max(samples), 1)}


async def bench(rounds: int) -> list[dict[str, Any]]:
    d = tempfile.mkdtemp(prefix="flyd-b-", dir="/tmp")
    path = os.path.join(d, "bus.sock")
    router = Router(RouterConfig(socket_path=path, policy=Policy.default(os.getpid())))
    await router.start()
    node_id = new_node_id("bench")
    node = await connect(path, client_id=node_client_id(node_id))
    tags = SessionTags()
    budget = ThreadBudget(16, 1)
    spec = RunSpec()
    lines: list[dict[str, Any]] = []
    try:
        for mode in ExecutionMode:
            launch_ms: list[float] = []
            restart_ms: list[float] = []
            reap_ms: list[float] = []
            for n in range(rounds):
                names = SessionNames(session_id="bench", tag=tags.next(), node_id=node_id)
                launcher = await Launcher.open(names=names, socket=path, node=node,
                                               budget=budget)
                try:
                    t0 = time.perf_counter()
                    launched = await launcher.launch_composition(spec, mode)
                    launch_ms.append((time.perf_counter() - t0) * 1000)
                    for wid in launched:
                        await launcher.health_check(wid)
                    if mode is ExecutionMode.PROCESS and n == rounds - 1:
                        rss = {wid: launcher.info(wid).rss_kib for wid in launched}
                        peak = {wid: launcher.info(wid).peak_rss_kib for wid in launched}
                        lines.append({"bench": "worker_rss", "mode": mode.label(),
                                      "rss_kib": rss, "peak_rss_kib": peak,
                                      "node_rss_kib": process_info(os.getpid()).rss_kib})
                    t0 = time.perf_counter()
                    await launcher.restart("fly-b")
                    restart_ms.append((time.perf_counter() - t0) * 1000)
                    t0 = time.perf_counter()
                    outcomes = await launcher.reap_all("bench")
                    reap_ms.append((time.perf_counter() - t0) * 1000)
                    assert {o.label for o in outcomes.values()} == {"Stopped"}, outcomes
                finally:
                    await launcher.close()
            progress(f"{mode.label()}: launch median {statistics.median(launch_ms):.0f} ms")
            lines.append({"bench": "launch", "mode": mode.label(), "workers": 3,
                          "rounds": rounds, "launch_ms": summary(launch_ms),
                          "restart_ms": summary(restart_ms), "reap_ms": summary(reap_ms)})
    finally:
        await node.close()
        await router.stop()
        shutil.rmtree(d, ignore_errors=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    progress(f"{os.cpu_count()} CPUs, {args.rounds} rounds per mode")
    for line in uvloop.run(bench(args.rounds)):
        print(orjson.dumps(line).decode(), flush=True)


if __name__ == "__main__":
    main()
