"""The bus demo that `make run` runs until the coordinator lands.

It is real, not a placeholder: a `flyd router` child process with a closed policy written to
a temporary config, an echo service on one connection, a caller on another, and `calls` round
trips through the router with eight callers in flight, then a summary on stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from bus.client import connect
from bus.client_serving import Request
from bus.errors import BusError

POLICY = """\
[bus.policy]
mode = "closed"
[[bus.policy.client]]
id = "demo.server"
register = ["demo.echo"]
[[bus.policy.client]]
id = "demo.caller"
call = ["demo.*"]
"""
CONCURRENCY = 8


async def _wait_for_socket(path: Path, proc: asyncio.subprocess.Process) -> None:
    """Until the router accepts a connection (or exits)."""
    async with asyncio.timeout(15):
        while proc.returncode is None:
            try:
                _, writer = await asyncio.open_unix_connection(str(path))
            except (FileNotFoundError, ConnectionRefusedError):
                await asyncio.sleep(0.02)
                continue
            writer.close()
            return
        raise RuntimeError(f"the router exited with {proc.returncode}")


async def _echo(req: Request) -> dict[str, Any]:
    return {"type": "result", "requestId": req.payload.get("requestId"),
            "result": req.payload.get("params", {})}


async def run_demo(calls: int, as_json: bool) -> int:
    with tempfile.TemporaryDirectory(prefix="flyd-demo-") as tmp:
        sock = Path(tmp) / "bus.sock"
        cfg = Path(tmp) / "router.toml"
        cfg.write_text(POLICY)
        print(f"flyd demo: starting router on {sock}", file=sys.stderr)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flyd", "router", "--socket", str(sock), "--config", str(cfg),
            "-q", env={**os.environ, "FLYD_LOG_FORMAT": "json"},
        )
        try:
            await _wait_for_socket(sock, proc)
            summary = await _exercise(str(sock), calls)
        finally:
            if proc.returncode is None:
                proc.terminate()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        summary["routerExit"] = proc.returncode
    if as_json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
    else:
        print(
            f"bus demo: {summary['calls']} calls, {summary['errors']} errors, "
            f"p50 {summary['p50Us']} us, p99 {summary['p99Us']} us round trip, "
            f"{summary['callsPerS']} calls/s; router {summary['routerId']} exited "
            f"{summary['routerExit']}"
        )
    return 0 if summary["errors"] == 0 and summary["routerExit"] == 0 else 1


async def _exercise(sock: str, calls: int) -> dict[str, Any]:
    rtts: list[float] = []
    errors = 0
    async with connect(sock, client_id="demo.server") as server, \
            await server.register("demo.echo", _echo, max_queued=16, max_in_flight=8), \
            connect(sock, client_id="demo.caller") as caller:
        counter = iter(range(calls))

        async def worker() -> None:
            nonlocal errors
            for i in counter:
                payload = {"requestId": f"req-{i}", "scope": None, "params": {"n": i}}
                t0 = time.perf_counter()
                try:
                    res = await caller.call("demo.echo", "Demo.Echo", payload, timeout=5.0)
                except BusError as exc:
                    errors += 1
                    print(f"call {i} failed: {exc}", file=sys.stderr)
                    continue
                rtts.append(time.perf_counter() - t0)
                if res.outcome.get("result") != {"n": i}:
                    errors += 1

        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for _ in range(CONCURRENCY):
                tg.create_task(worker())
        elapsed = time.perf_counter() - t0
        stats = await caller.stats()
    rtts.sort()
    q = statistics.quantiles(rtts, n=100) if len(rtts) >= 2 else rtts * 99
    return {
        "calls": calls,
        "errors": errors,
        "p50Us": round(q[49] * 1e6) if q else None,
        "p99Us": round(q[98] * 1e6) if q else None,
        "callsPerS": round(calls / elapsed) if elapsed > 0 else None,
        "routerId": stats["routerId"],
        "routerCallsAdmitted": stats["counters"]["callsAdmitted"],
    }
