"""Launcher benchmark: what a worker launch costs with the fork server and with plain spawn, how
long the node's event loop stalls while 64 process workers start, and how long a session's
three workers take to launch, restart and reap in each execution mode.

The benchmark acts as a node: a router in this process with the default closed policy
(`Policy.default(os.getpid())`), a node connection that makes every `bus.expect`, and launchers
opened on it.

Prints one JSON line per measurement:
  {"bench":"worker_launch","method":"fork"|"spawn","workers":64,"concurrency":..,
   "cpu_ms_per_worker":..,"wall_ms_per_worker":..,"wall_s":..,"loop_lag_ms":{"max","p99"},
   "target_cpu_ms":30,"target_lag_ms":100,"met":..}
     CPU per worker = (this process's CPU + the fork server's + every worker's own CPU, all
     from before the launch until every worker identified) / workers; the fork server's start
     is paid once per node and reported apart as `server_start_cpu_ms`. Loop lag: the largest
     lateness of a 10 ms timer on this process's event loop during the launch.
  {"bench":"launch","mode":..,"workers":3,"rounds":..,"launch_ms":{"min","median","max"},
   "restart_ms":{..},"reap_ms":{..}}
  {"bench":"worker_rss","mode":"process","rss_kib":{worker: ..},"peak_rss_kib":{..},
   "uss_kib":{..},"node_rss_kib":..}       (forked workers, sampled after a health check)
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import orjson
import psutil
import structlog
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bus.client import BusClient, connect  # noqa: E402
from bus.limits import Limits  # noqa: E402
from bus.policy import Policy  # noqa: E402
from bus.router import Router, RouterConfig  # noqa: E402
from flyd.launch.budget import ThreadBudget  # noqa: E402
from flyd.launch.identities import SessionNames, SessionTags, new_node_id, node_client_id  # noqa: E402
from flyd.launch.launcher import ExecutionMode, Launcher  # noqa: E402
from flyd.launch.spawn import process_info  # noqa: E402
from flyd.launch.spawner import LauncherSettings, Spawner  # noqa: E402
from flyd.session.runspec import AgentSpec, RunSpec  # noqa: E402

TARGET_CPU_MS = 30.0
TARGET_LAG_MS = 100.0
TICK_S = 0.01


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def summary(samples: list[float]) -> dict[str, float]:
    return {"min": round(min(samples), 1), "median": round(statistics.median(samples), 1),
            "max": round(max(samples), 1)}


def cpu_s(proc: psutil.Process) -> float:
    """User + system CPU of one process (not its children), 0 when it is gone."""
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def unique_kib(pid: int | None) -> int | None:
    """Memory only this process holds (USS): what a forked worker does not share."""
    try:
        return int(psutil.Process(pid).memory_full_info().uss) // 1024
    except (psutil.Error, ValueError):
        return None


class LagProbe:
    """A 10 ms timer on the event loop; records how late each tick fires."""

    def __init__(self) -> None:
        self.lags: list[float] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + TICK_S
            await asyncio.sleep(TICK_S)
            self.lags.append(max(0.0, loop.time() - due))

    def report(self) -> dict[str, float]:
        lags = sorted(self.lags) or [0.0]
        return {"max": round(lags[-1] * 1000, 1),
                "p99": round(lags[int(0.99 * (len(lags) - 1))] * 1000, 1)}


@contextlib.asynccontextmanager
async def bench_node(workers: int) -> AsyncIterator[tuple[str, BusClient]]:
    d = tempfile.mkdtemp(prefix="flyd-b-", dir="/tmp")
    path = os.path.join(d, "bus.sock")
    room = 2 * workers + 16
    limits = Limits(maxClients=room, maxServices=room, maxExpectations=room)
    router = Router(RouterConfig(socket_path=path, policy=Policy.default(os.getpid()),
                                 limits=limits))
    await router.start()
    node = await connect(path, client_id=node_client_id(new_node_id("bench")))
    try:
        yield path, node
    finally:
        await node.close()
        await router.stop()
        shutil.rmtree(d, ignore_errors=True)


async def worker_launch(method: Literal["fork", "spawn"], workers: int,
                        concurrency: int) -> dict[str, Any]:
    """Launch `workers` agents plus the world in process mode at once; CPU, wall, loop lag."""
    me = psutil.Process()
    spec = RunSpec(agents=tuple(AgentSpec(f"a{i}", f"p{i}") for i in range(1, workers)))
    async with bench_node(workers) as (path, node):
        spawner = Spawner(LauncherSettings(method=method, concurrency=concurrency), socket=path)
        names = SessionNames(session_id="bench", tag=SessionTags().next(),
                             node_id=node.client_id.removeprefix("node."))
        launcher = await Launcher.open(names=names, socket=path, node=node,
                                       budget=ThreadBudget(workers + 2, 1), spawner=spawner,
                                       max_agents=workers)
        server_start_cpu = 0.0
        try:
            if method == "fork":
                server = psutil.Process(await spawner.parent_pid())
                server_start_cpu = cpu_s(server)
            probe = LagProbe()
            cpu0 = cpu_s(me)
            server0 = cpu_s(server) if method == "fork" else 0.0
            t0 = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                ticker = tg.create_task(probe.run())
                launched = await launcher.launch_composition(spec, ExecutionMode.PROCESS)
                ticker.cancel()
            wall = time.perf_counter() - t0
            split = {"node": cpu_s(me) - cpu0,
                     "server": cpu_s(server) - server0 if method == "fork" else 0.0,
                     "workers": sum(cpu_s(psutil.Process(w.pid)) for w in launched.values()
                                    if w.pid is not None)}
            cpu = sum(split.values())
            assert len(launched) == workers
            await launcher.reap_all("bench")
        finally:
            await launcher.close()
            await spawner.close()
    per_cpu = cpu / workers * 1000
    lag = probe.report()
    return {"bench": "worker_launch", "method": method, "workers": workers,
            "concurrency": concurrency, "cpu_ms_per_worker": round(per_cpu, 1),
            "wall_ms_per_worker": round(wall / workers * 1000, 1), "wall_s": round(wall, 2),
            "cpu_ms_per_worker_by_process": {k: round(v / workers * 1000, 1)
                                             for k, v in split.items()},
            "server_start_cpu_ms": round(server_start_cpu * 1000, 1), "loop_lag_ms": lag,
            "target_cpu_ms": TARGET_CPU_MS, "target_lag_ms": TARGET_LAG_MS,
            "met": per_cpu <= TARGET_CPU_MS and lag["max"] <= TARGET_LAG_MS}


async def session_rounds(rounds: int) -> list[dict[str, Any]]:
    """A session's three workers: launch, restart one, reap, in every mode."""
    tags = SessionTags()
    budget = ThreadBudget(16, 1)
    spec = RunSpec()
    lines: list[dict[str, Any]] = []
    async with bench_node(4) as (path, node):
        spawner = Spawner(socket=path)
        try:
            for mode in ExecutionMode:
                launch_ms: list[float] = []
                restart_ms: list[float] = []
                reap_ms: list[float] = []
                for n in range(rounds):
                    names = SessionNames(session_id="bench", tag=tags.next(),
                                         node_id=node.client_id.removeprefix("node."))
                    launcher = await Launcher.open(names=names, socket=path, node=node,
                                                   budget=budget, spawner=spawner)
                    try:
                        if mode is ExecutionMode.PROCESS:
                            await spawner.parent_pid()  # the node's server is up already
                        t0 = time.perf_counter()
                        launched = await launcher.launch_composition(spec, mode)
                        launch_ms.append((time.perf_counter() - t0) * 1000)
                        for wid in launched:
                            await launcher.health_check(wid)
                        if mode is ExecutionMode.PROCESS and n == rounds - 1:
                            rss = {wid: launcher.info(wid).rss_kib for wid in launched}
                            peak = {wid: launcher.info(wid).peak_rss_kib for wid in launched}
                            uss = {wid: unique_kib(w.pid) for wid, w in launched.items()}
                            lines.append({"bench": "worker_rss", "mode": mode.label(),
                                          "rss_kib": rss, "peak_rss_kib": peak, "uss_kib": uss,
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
            await spawner.close()
    return lines


async def bench(rounds: int, workers: int, concurrency: int) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for method in ("fork", "spawn"):
        line = await worker_launch(method, workers, concurrency)
        progress(f"{workers} workers, {method}: {line['cpu_ms_per_worker']} ms CPU per worker, "
                 f"loop lag max {line['loop_lag_ms']['max']} ms, {line['wall_s']} s")
        lines.append(line)
    lines += await session_rounds(rounds)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=LauncherSettings().concurrency)
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    progress(f"{os.cpu_count()} CPUs, {args.workers} workers, {args.rounds} rounds per mode")
    for line in uvloop.run(bench(args.rounds, args.workers, args.concurrency)):
        print(orjson.dumps(line).decode(), flush=True)


if __name__ == "__main__":
    main()
