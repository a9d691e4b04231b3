"""Bus load: many concurrent clients through one router, with random cancels and service
restarts; every call must end in exactly one terminal outcome (wire.md §9.1).

Processes: one `flyd router`, `--services` echo services (SDK, one per process) and
`--processes` caller processes that share `--clients` SDK connections between them; each
connection makes `--calls` calls one after another to a random service. A fraction
(`--cancel`) of the calls is cancelled after a random short delay. The orchestrator restarts a
random service (SIGKILL, then a new process with the same clientId and a new incarnation) at
random moments: when the router's `callsAdmitted` passes thresholds drawn uniformly over the
run (`--restarts` of them).

Tracked per call on both sides, and cross-checked at the end:
- callers: one outcome per call (a result that echoes the call's own payload, a refusal, a
  `bus.callFailed`, or a cancel state; a call without an outcome after CALL_TIMEOUT_S is
  `lost`), and the number of `bus.result`/`bus.callFailed` frames per callId (at most one; one
  for a result or a failure, none for a call cancelled before dispatch or detached);
- services: a log line per request handled, written before the reply, so a request is never
  handled twice, every result was handled by a service, and no call cancelled before dispatch
  or failed `not-dispatched` was ever handled;
- router: once settled, no call record is left, and its counters match the callers' totals
  (admitted, results, failures, and the two cancel states that end a call).

`python -P bench/load.py` runs the full size (64 x 10000) and prints one JSON line with
calls/s, latency percentiles (from `start_call` to the outcome) and a forwarding floor measured
in the same run (`bench/bus.py`: the same codec and loop forwarding frames between a client
with 8 concurrent calls and an echo); `ratio` is calls/s over the floor's. It exits 1 when any
check fails. tests/bus/test_load.py runs a reduced size with the same checks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bus.client import BusClient, connect  # noqa: E402
from bus.client_serving import Request  # noqa: E402
from bus.errors import BusError, Conflict  # noqa: E402

CALL_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 30.0
SETTLE_TIMEOUT_S = 30.0
SERVICE_LIFETIME_S = 24 * 3600.0
COMMAND_TIMEOUT_S = 30.0
METHOD = "Load.Echo"
CALL_ENDING_CANCELS = ("cancel:cancelled-before-dispatch", "cancel:execution-unknown")
REFUSED_BACKOFF_S = 0.05  # a refused caller (service restarting) waits a moment, as users do


def progress(msg: str) -> None:
    print(f"load: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# service process
async def service_main(path: str, name: str, client_id: str, log_path: str) -> None:
    """Echo the payload; log `callerId callId` before replying. Runs until killed or
    SIGTERM. A restarted service may find its clientId still live while the router tears the
    killed connection down (CONFLICT): it retries with a new incarnation."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    rnd = random.Random()

    async def handler(req: Request) -> dict[str, Any]:
        os.write(fd, f"{req.caller.client_id} {req.call_id}\n".encode())
        if rnd.random() < 0.2:  # some calls stay dispatched a while, so cancels land there
            await asyncio.sleep(rnd.choice((0.0005, 0.002)))
        return {"echo": req.payload}

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    bus: BusClient | None = None
    async with asyncio.timeout(READY_TIMEOUT_S):
        while bus is None:
            try:
                bus = await connect(path, client_id=client_id)
            except Conflict:
                await asyncio.sleep(0.01)
    try:
        await bus.register(name, handler, max_queued=64, max_in_flight=16)
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        async with asyncio.TaskGroup() as tg:
            closed = tg.create_task(bus.wait_closed())
            stopped = tg.create_task(stop.wait())
            await asyncio.wait({closed, stopped}, timeout=SERVICE_LIFETIME_S,
                               return_when=asyncio.FIRST_COMPLETED)
            closed.cancel()
            stopped.cancel()
    finally:
        await bus.close()
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# caller process
@dataclass
class CallerResult:
    lines: list[str] = field(default_factory=list)  # "clientId callId outcome latency_us"
    problems: list[str] = field(default_factory=list)


async def _outcome(pc: Any, payload: dict[str, Any]) -> str:
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            res = await pc.result()
    except TimeoutError:
        return "lost"
    except BusError as exc:
        return f"failed:{exc.name}:{exc.dispatch}"
    if res.call_id != pc.call_id or res.outcome != {"echo": payload}:
        return "bad-result"
    return "result"


async def one_client(path: str, client_id: str, calls: int, services: list[str],
                     cancel: float, seed: int, out: CallerResult,
                     start: asyncio.Event) -> None:
    rnd = random.Random(seed)
    frames: Counter[int] = Counter()  # bus.result + bus.callFailed frames per callId
    async with connect(path, client_id=client_id) as bus:
        connection = bus._conn
        on_notification = connection._on_notification

        def counting(msg: dict[str, Any]) -> None:
            if msg.get("method") in ("bus.result", "bus.callFailed"):
                frames[msg["params"]["callId"]] += 1
            on_notification(msg)

        connection._on_notification = counting  # type: ignore[method-assign]
        async with asyncio.timeout(READY_TIMEOUT_S):
            await start.wait()
        outcomes: dict[int, str] = {}
        for i in range(calls):
            payload = {"c": client_id, "i": i}
            t0 = time.perf_counter()
            call_id: int | None = None
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    pc = await bus.start_call(rnd.choice(services), METHOD, payload)
            except TimeoutError:
                outcome = "lost"
            except BusError as exc:
                outcome = f"refused:{exc.name}"
                await asyncio.sleep(REFUSED_BACKOFF_S)
            else:
                call_id = pc.call_id
                if rnd.random() < cancel:
                    delay = rnd.choice((0.0, 0.0, 0.0002, 0.001))
                    if delay:
                        await asyncio.sleep(delay)
                    try:
                        state = await pc.cancel()
                    except BusError as exc:
                        state = f"error-{exc.name}"
                    if state in ("completed", "call-gone"):
                        outcome = await _outcome(pc, payload)  # the outcome it already had
                    else:
                        outcome = f"cancel:{state}"
                else:
                    outcome = await _outcome(pc, payload)
                outcomes[call_id] = outcome
            latency = round((time.perf_counter() - t0) * 1e6)
            out.lines.append(f"{client_id} {call_id or '-'} {outcome} {latency}")
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await bus.stats()  # responses follow notifications: every late frame is read
    for cid, n in frames.items():
        if cid not in outcomes:
            out.problems.append(f"{client_id}: {n} outcome frames for unknown call {cid}")
    for cid, outcome in outcomes.items():
        want = 1 if outcome == "result" or outcome.startswith("failed:") else 0
        if frames[cid] != want:
            out.problems.append(f"{client_id}: call {cid} ({outcome}) had {frames[cid]} "
                                f"outcome frames, expected {want}")


async def caller_main(path: str, prefix: str, clients: int, calls: int, services: list[str],
                      cancel: float, seed: int, out: CallerResult) -> dict[str, Any]:
    start = asyncio.Event()
    t0 = t1 = 0.0

    async def go() -> None:
        nonlocal t0
        await asyncio.sleep(0.2)  # let every connection say hello first
        t0 = time.time()
        start.set()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(go())
        for k in range(clients):
            tg.create_task(one_client(path, f"{prefix}-{k}", calls, services, cancel,
                                      seed * 1000 + k, out, start))
    t1 = time.time()
    return {"start": t0, "end": t1, "problems": out.problems}


# ---------------------------------------------------------------------------------------------
# orchestrator
@dataclass
class Setup:
    clients: int = 64
    calls: int = 10000
    processes: int = 4
    services: int = 4
    cancel: float = 0.05
    restarts: int = 20
    seed: int = 0


def _router_config(setup: Setup) -> str:
    return ("[bus.limits]\n"
            f"max_clients = {setup.clients + setup.services + 16}\n"
            "max_service_queued = 64\n")


async def _spawn(*args: str, stdout: Any = asyncio.subprocess.DEVNULL
                 ) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, *args, cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=stdout,
        stderr=asyncio.subprocess.DEVNULL, env={**os.environ, "FLYD_LOG_FORMAT": "json"})


class Services:
    """The service processes; `restart(j)` kills one and starts its successor."""

    def __init__(self, path: str, tmp: str, count: int) -> None:
        self.path = path
        self.tmp = tmp
        self.names = [f"load.s{j}" for j in range(count)]
        self.procs: list[asyncio.subprocess.Process | None] = [None] * count
        self.generation = 0
        self.logs: list[str] = []
        self.killed = 0

    async def start(self, j: int) -> asyncio.subprocess.Process:
        self.generation += 1
        log = os.path.join(self.tmp, f"svc-{j}-{self.generation}.log")
        self.logs.append(log)
        proc = await _spawn(__file__, "--role", "service", "--socket", self.path, "--name",
                            self.names[j], "--client-id", f"load-svc{j}", "--log", log,
                            stdout=asyncio.subprocess.PIPE)
        self.procs[j] = proc
        return proc

    async def start_all(self) -> None:
        procs = [await self.start(j) for j in range(len(self.names))]
        async with asyncio.timeout(READY_TIMEOUT_S):
            for proc in procs:
                assert proc.stdout is not None
                line = await proc.stdout.readline()
                if line.strip() != b"ready":
                    raise RuntimeError("a service did not start")

    async def restart(self, j: int) -> None:
        proc = self.procs[j]
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
            self.killed += 1
        await self.start(j)

    async def stop(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.returncode is None:
                proc.terminate()
        for proc in self.procs:
            if proc is None:
                continue
            try:
                async with asyncio.timeout(10):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def _restarter(monitor: BusClient, services: Services, setup: Setup, total: int,
                     done: asyncio.Event) -> None:
    """Restart a random service each time the calls made so far (admitted or refused: a
    refused call is one a caller made too) pass a random threshold."""
    rnd = random.Random(setup.seed)
    thresholds = sorted(rnd.randrange(total // 20, total * 9 // 10)
                        for _ in range(setup.restarts))
    while thresholds and not done.is_set():
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            counters = (await monitor.stats())["counters"]
            admitted: int = counters["callsAdmitted"] + counters["callsRefused"]
        while thresholds and admitted >= thresholds[0]:
            thresholds.pop(0)
            await services.restart(rnd.randrange(len(services.names)))
        await asyncio.sleep(0.02)


async def _settle(monitor: BusClient) -> dict[str, Any]:
    """Detached calls still held by a live service end with its reply: wait for that."""
    async with asyncio.timeout(SETTLE_TIMEOUT_S):
        while True:
            stats = await monitor.stats()
            if stats["calls"] == 0:
                return stats
            await asyncio.sleep(0.05)


async def _router_ready(path: str, router: asyncio.subprocess.Process) -> None:
    async with asyncio.timeout(READY_TIMEOUT_S):
        while True:
            if router.returncode is not None:
                raise RuntimeError("the router did not start")
            try:
                _, writer = await asyncio.open_unix_connection(path)
            except OSError:
                await asyncio.sleep(0.02)
                continue
            writer.close()
            return


async def orchestrate(setup: Setup, tmp: str, config: str) -> dict[str, Any]:
    path = os.path.join(tmp, "bus.sock")
    router = await _spawn("-m", "flyd", "router", "--socket", path, "--config", config,
                          "--open", "-q")
    services = Services(path, tmp, setup.services)
    try:
        await _router_ready(path, router)
        await services.start_all()
        async with connect(path, client_id="load-monitor") as monitor:
            result = await _drive(setup, tmp, path, monitor, services)
            result["router"] = await _settle(monitor)
        return result
    finally:
        await services.stop()
        if router.returncode is None:
            router.terminate()
        try:
            async with asyncio.timeout(10):
                await router.wait()
        except TimeoutError:
            router.kill()
            await router.wait()


async def _drive(setup: Setup, tmp: str, path: str, monitor: BusClient,
                 services: Services) -> dict[str, Any]:
    per_proc = [setup.clients // setup.processes + (1 if p < setup.clients % setup.processes
                                                    else 0) for p in range(setup.processes)]
    callers = []
    for p, count in enumerate(per_proc):
        callers.append(await _spawn(
            __file__, "--role", "caller", "--socket", path, "--prefix", f"c{p}",
            "--clients", str(count), "--calls", str(setup.calls), "--services",
            ",".join(services.names), "--cancel", str(setup.cancel), "--seed",
            str(setup.seed * 100 + p), "--out", os.path.join(tmp, f"caller-{p}.txt"),
            stdout=asyncio.subprocess.PIPE))
    done = asyncio.Event()
    reports: list[dict[str, Any]] = []
    # generous: assumes at least 50 calls/s on a loaded machine
    deadline = 600 + setup.clients * setup.calls / 50
    try:
        async with asyncio.timeout(deadline), asyncio.TaskGroup() as tg:
            restarter = tg.create_task(_restarter(monitor, services, setup,
                                                  setup.clients * setup.calls, done))
            for proc in callers:
                out, _ = await proc.communicate()
                if proc.returncode != 0:
                    raise RuntimeError(f"a caller process exited {proc.returncode}")
                reports.append(orjson.loads(out))
            done.set()
            restarter.cancel()
    finally:
        await _reap(callers)
    return {"reports": reports, "restarts": services.killed, "service_logs": services.logs,
            "caller_files": [os.path.join(tmp, f"caller-{p}.txt") for p in range(len(callers))]}


async def _reap(procs: list[asyncio.subprocess.Process]) -> None:
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _percentile(values: list[int], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) >= 2 else float(
        values[0] if values else 0)


def analyse(setup: Setup, raw: dict[str, Any]) -> dict[str, Any]:
    """Cross-check callers, services and the router; `problems` lists every violation."""
    problems: list[str] = [p for r in raw["reports"] for p in r["problems"]]
    handled: Counter[tuple[str, int]] = Counter()
    for log in raw["service_logs"]:
        with contextlib.suppress(FileNotFoundError):
            for line in Path(log).read_text().splitlines():
                caller, call_id = line.split()
                handled[(caller, int(call_id))] += 1
    twice = [k for k, n in handled.items() if n > 1]
    if twice:
        problems.append(f"{len(twice)} requests handled twice, e.g. {twice[:3]}")
    outcomes: Counter[str] = Counter()
    latencies: list[int] = []
    result_latencies: list[int] = []
    admitted = 0
    lines = 0
    for name in raw["caller_files"]:
        for line in Path(name).read_text().splitlines():
            client, call_id, outcome, latency = line.split()
            lines += 1
            outcomes[outcome] += 1
            latencies.append(int(latency))
            if call_id == "-":
                continue
            admitted += 1
            key = (client, int(call_id))
            if outcome == "result":
                result_latencies.append(int(latency))
                if key not in handled:
                    problems.append(f"{key}: a result no service handled")
            elif outcome in CALL_ENDING_CANCELS or outcome.startswith("failed:"):
                never_ran = outcome == "cancel:cancelled-before-dispatch" or outcome.endswith(
                    ":not-dispatched")
                if never_ran and key in handled:
                    problems.append(f"{key}: {outcome}, yet a service handled it")
            else:
                problems.append(f"{key}: {outcome}")
    expected = setup.clients * setup.calls
    if lines != expected:
        problems.append(f"{lines} call outcomes for {expected} calls")
    if outcomes["lost"]:
        problems.append(f"{outcomes['lost']} calls without an outcome after {CALL_TIMEOUT_S} s")
    counters = raw["router"]["counters"]
    failed = sum(n for o, n in outcomes.items() if o.startswith("failed:"))
    pairs = {
        "callsAdmitted": (counters["callsAdmitted"], admitted),
        "repliesRouted": (counters["repliesRouted"], outcomes["result"]),
        "callsFailed": (counters["callsFailed"], failed),
        "cancelled-before-dispatch": (counters["cancels"]["cancelled-before-dispatch"],
                                      outcomes["cancel:cancelled-before-dispatch"]),
        "execution-unknown": (counters["cancels"]["execution-unknown"],
                              outcomes["cancel:execution-unknown"]),
    }
    for key, (router_n, caller_n) in pairs.items():
        if router_n != caller_n:
            problems.append(f"router {key} {router_n} != callers' {caller_n}")
    ends = sum(counters[k] for k in ("repliesRouted", "callsFailed")) + sum(
        counters["cancels"][k] for k in ("cancelled-before-dispatch", "execution-unknown"))
    if ends != counters["callsAdmitted"]:
        problems.append(f"router: {counters['callsAdmitted']} admitted, {ends} ended")
    if raw["router"]["activeCalls"] or raw["router"]["calls"]:
        problems.append(f"router left calls: {raw['router']}")
    start = min(r["start"] for r in raw["reports"])
    end = max(r["end"] for r in raw["reports"])
    return {
        "clients": setup.clients, "calls_per_client": setup.calls, "calls": lines,
        "seconds": round(end - start, 2), "calls_per_s": round(lines / (end - start)),
        "results_per_s": round(outcomes["result"] / (end - start)),
        "p50_us": round(_percentile(result_latencies, 50)),
        "p99_us": round(_percentile(result_latencies, 99)),
        "p99_all_us": round(_percentile(latencies, 99)),
        "restarts": raw["restarts"], "handled": sum(handled.values()),
        "outcomes": dict(sorted(outcomes.items())), "problems": problems[:50],
    }


def run_load(setup: Setup) -> dict[str, Any]:
    """Run one load scenario in a temporary directory; returns the analysis."""
    tmp = tempfile.mkdtemp(prefix="flyd-load-", dir="/tmp")
    try:
        config = os.path.join(tmp, "router.toml")
        Path(config).write_text(_router_config(setup))
        raw = uvloop.run(orchestrate(setup, tmp, config))
        return analyse(setup, raw)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--role", choices=["service", "caller"])
    ap.add_argument("--socket")
    ap.add_argument("--name")
    ap.add_argument("--client-id")
    ap.add_argument("--log")
    ap.add_argument("--prefix")
    ap.add_argument("--out")
    ap.add_argument("--services", default="4",
                    help="service count (orchestrator) or comma-separated names (caller)")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--calls", type=int, default=10000, help="calls per client")
    ap.add_argument("--processes", type=int, default=4, help="caller processes")
    ap.add_argument("--cancel", type=float, default=0.05, help="fraction of calls cancelled")
    ap.add_argument("--restarts", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--floor-calls", type=int, default=4000)
    args = ap.parse_args()
    if args.role == "service":
        uvloop.run(service_main(args.socket, args.name, args.client_id, args.log))
        return
    if args.role == "caller":
        out = CallerResult()
        report = uvloop.run(caller_main(args.socket, args.prefix, args.clients, args.calls,
                                        args.services.split(","), args.cancel, args.seed, out))
        Path(args.out).write_text("\n".join(out.lines) + "\n")
        sys.stdout.write(orjson.dumps(report).decode())
        return
    from bench.bus import measure_floor

    setup = Setup(clients=args.clients, calls=args.calls, processes=args.processes,
                  services=int(args.services), cancel=args.cancel, restarts=args.restarts,
                  seed=args.seed)
    progress(f"{setup.clients} clients x {setup.calls} calls, {setup.services} services, "
             f"{setup.restarts} restarts, {setup.cancel:.0%} cancelled")
    result = run_load(setup)
    progress(f"floor: forwarder + echo + client, {args.floor_calls} calls")
    tmp = tempfile.mkdtemp(prefix="flyd-load-", dir="/tmp")
    try:
        floor = measure_floor(tmp, args.floor_calls)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    floor_p99 = statistics.quantiles(floor["rtts"], n=100)[98] * 1e6
    line = {"bench": "bus_load", **{k: v for k, v in result.items() if k != "problems"},
            "floor_calls_per_s": round(floor["per_s"]),
            "ratio": round(result["calls_per_s"] / floor["per_s"], 3),
            "floor_p99_us": round(floor_p99, 1), "problems": result["problems"]}
    print(orjson.dumps(line).decode())
    sys.exit(1 if result["problems"] else 0)


if __name__ == "__main__":
    main()
