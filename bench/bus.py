"""Bus benchmark: the router against a bare forwarding floor, measured in the same run.

Floor: three processes (client, forwarder, echo) where the forwarder does the least any
router must do per frame with the same loop (uvloop) and codec: strict-decode the frame and
re-encode it for the other side. Router: three processes (client SDK, `flyd router`, echo
service SDK). Both carry the same domain-shaped payload.

The host is shared and noisy, so floor and router run alternately, `--repeat` pairs (default
3), each pair with fresh processes and a warm-up of 200 calls per client; the lines give the
medians over the pairs (an RTT per pair is the median of its round trips) and every pair's
numbers. Prints three JSON lines:
  {"bench":"bus_rtt","floor_us":..,"router_us":..,"ratio":..,"p99_us":..,"pairs":[[f,r],..]}
  {"bench":"bus_throughput","calls_per_s":..,"floor_calls_per_s":..,"ratio":..,"pairs":..}
  {"bench":"bus_cpu","floor_us_per_call":..,"router_us_per_call":..,"ratio":..,"pairs":..}
`ratio` is router/floor in every line: RTT targets ratio <= 1.5, throughput ratio >= 0.5 (none
is asserted anywhere). Round trips are sequential (one outstanding call); throughput uses 8
concurrent callers on one connection. CPU per call is user + system CPU of all three processes
over both parts (steadier than wall time on a shared host), counted once every server is up
(each echo says so when connected or registered). The SDK speaks bus minor 1 to the
router, so the router path moves the same four frames per call as the floor (wire.md §21).
`--inline`: the echo service answers from an inline handler (wire.md §22.2), with no task per
request.
Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson
import psutil
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bus import codec  # noqa: E402
from bus.client import connect  # noqa: E402
from bus.client_serving import Request  # noqa: E402

PREFIX = struct.Struct("<I")
PAYLOAD: dict[str, Any] = {
    "requestId": "req-000000",
    "scope": {"epoch": "e1", "step": 0},
    "params": {"agent": "fly-a", "observation": {"t": 0, "values": list(range(16))}},
}
CONCURRENCY = 8
CLIENT_TIMEOUT_S = 600  # a wedged run fails instead of hanging the whole bench


def progress(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# floor processes
class _Framed(asyncio.Protocol):
    """Minimal framed connection: hands each body to `on_body`."""

    def __init__(self, on_body: Any, lost: asyncio.Future[None] | None = None) -> None:
        self.buf = bytearray()
        self.on_body = on_body
        self.lost = lost
        self.transport: asyncio.Transport | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(None)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while len(buf) >= 4:
            (n,) = PREFIX.unpack_from(buf, 0)
            if len(buf) < 4 + n:
                return
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            self.on_body(self, body)

    def send(self, body: bytes) -> None:
        assert self.transport is not None
        self.transport.write(PREFIX.pack(len(body)) + body)


async def forwarder(path: str) -> None:
    """Forwards frames both ways through the codec between the echo, which connects to its own
    socket (`path` + ".echo") so a slow-starting echo is never taken for a client, and the
    clients on `path`."""
    echo: list[_Framed] = []
    clients: list[_Framed] = []

    def on_body(conn: _Framed, body: bytes) -> None:
        msg = codec.decode(body)
        out = codec.encode_trusted(msg)
        if conn is echo[0]:
            clients[0].send(out)
        else:
            echo[0].send(out)

    def echo_factory() -> _Framed:
        conn = _Framed(on_body)
        echo.append(conn)
        return conn

    def client_factory() -> _Framed:
        conn = _Framed(on_body)
        clients.append(conn)
        return conn

    loop = asyncio.get_running_loop()
    echo_server = await loop.create_unix_server(echo_factory, path + ".echo")
    server = await loop.create_unix_server(client_factory, path)
    async with echo_server, server:
        await server.serve_forever()


async def echo_floor(path: str) -> None:
    def on_body(conn: _Framed, body: bytes) -> None:
        msg = codec.decode(body)
        conn.send(codec.encode_trusted({"id": msg["id"], "outcome": msg["payload"]}))

    loop = asyncio.get_running_loop()
    lost: asyncio.Future[None] = loop.create_future()
    await loop.create_unix_connection(lambda: _Framed(on_body, lost), path + ".echo")
    print("ready", flush=True)  # the client may start
    await lost


async def client_floor(path: str, n: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    waiters: dict[int, asyncio.Future[None]] = {}

    def on_body(conn: _Framed, body: bytes) -> None:
        msg = codec.decode(body)
        waiters.pop(msg["id"]).set_result(None)

    transport, proto = await loop.create_unix_connection(lambda: _Framed(on_body), path)
    counter = 0

    async def one() -> float:
        nonlocal counter
        counter += 1
        fut = loop.create_future()
        waiters[counter] = fut
        t0 = time.perf_counter()
        proto.send(codec.encode({"id": counter, "method": "Bench.Echo", "payload": PAYLOAD}))
        await fut
        return time.perf_counter() - t0

    for _ in range(200):
        await one()
    cpu0 = time.process_time()
    rtts = [await one() for _ in range(n)]

    async def worker(k: int) -> None:
        for _ in range(k):
            await one()

    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tg:
        for _ in range(CONCURRENCY):
            tg.create_task(worker(n // CONCURRENCY))
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    transport.close()
    return {"rtts": rtts, "per_s": (n // CONCURRENCY) * CONCURRENCY / elapsed,
            "cpu_s": cpu, "calls": n + (n // CONCURRENCY) * CONCURRENCY}


# ---------------------------------------------------------------------------------------------
# router processes
async def echo_router(path: str, inline: bool) -> None:
    def echo(req: Request) -> dict[str, Any]:
        return {"type": "result", "result": req.payload}

    async def handler(req: Request) -> dict[str, Any]:
        return echo(req)

    async with connect(path, client_id="bench.echo") as bus:
        await bus.register("bench.echo", handler, max_queued=16, max_in_flight=16,
                           **({"inline": {"Bench.Echo": echo}} if inline else {}))
        print("ready", flush=True)  # registered: the client may start
        await bus.wait_closed()


async def client_router(path: str, n: int) -> dict[str, Any]:
    async with connect(path, client_id="bench.client") as bus:
        async def one() -> float:
            t0 = time.perf_counter()
            await bus.call("bench.echo", "Bench.Echo", PAYLOAD, timeout=10.0)
            return time.perf_counter() - t0

        for _ in range(200):
            await one()
        cpu0 = time.process_time()
        rtts = [await one() for _ in range(n)]

        async def worker(k: int) -> None:
            for _ in range(k):
                await one()

        t0 = time.perf_counter()
        async with asyncio.TaskGroup() as tg:
            for _ in range(CONCURRENCY):
                tg.create_task(worker(n // CONCURRENCY))
        elapsed = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
    return {"rtts": rtts, "per_s": (n // CONCURRENCY) * CONCURRENCY / elapsed,
            "cpu_s": cpu, "calls": n + (n // CONCURRENCY) * CONCURRENCY}


# ---------------------------------------------------------------------------------------------
def _spawn(*args: str, stdout: int | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, stderr=subprocess.DEVNULL,
                            stdout=stdout, env={**os.environ, "FLYD_LOG_FORMAT": "json"})


def _wait_socket(path: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.args} did not create {path}")
        time.sleep(0.01)


def _cpu(procs: list[subprocess.Popen[bytes]]) -> float:
    """User + system CPU seconds the processes have used so far."""
    total = 0.0
    for p in procs:
        times = psutil.Process(p.pid).cpu_times()
        total += times.user + times.system
    return total


def _run_client(role: str, path: str, n: int,
                servers: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    """Run a client role; its result gains `servers_cpu_s`, the CPU the middle and echo
    processes used meanwhile (their share of the client's connect and warm-up included)."""
    cpu0 = _cpu(servers)
    out = path + ".result.json"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(out)
    subprocess.run([sys.executable, __file__, "--role", role, "--socket", path, "-n", str(n),
                    "--out", out], cwd=ROOT, capture_output=True, check=True,
                   timeout=CLIENT_TIMEOUT_S)
    result: dict[str, Any] = orjson.loads(Path(out).read_bytes())
    result["servers_cpu_s"] = _cpu(servers) - cpu0
    return result


def _stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def measure_floor(tmp: str, n: int) -> dict[str, Any]:
    path = os.path.join(tmp, "floor.sock")
    with contextlib.suppress(FileNotFoundError):  # a previous pair's socket: never wait on it
        os.unlink(path)
    fwd = _spawn(__file__, "--role", "forwarder", "--socket", path)
    echo: subprocess.Popen[bytes] | None = None
    try:
        _wait_socket(path, fwd)
        echo = _spawn(__file__, "--role", "echo-floor", "--socket", path,
                      stdout=subprocess.PIPE)
        assert echo.stdout is not None
        if echo.stdout.readline() != b"ready\n":  # "" if it died: the forwarder has no echo
            raise RuntimeError("the floor's echo did not connect")
        return _run_client("client-floor", path, n, [fwd, echo])
    finally:
        _stop(*(p for p in (echo, fwd) if p is not None))


def measure_router(tmp: str, n: int, inline: bool) -> dict[str, Any]:
    path = os.path.join(tmp, "bus.sock")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    router = _spawn("-m", "flyd", "router", "--socket", path, "--open", "-q")
    echo: subprocess.Popen[bytes] | None = None
    try:
        _wait_socket(path, router)
        echo = _spawn(__file__, "--role", "echo-router", "--socket", path,
                      *(["--inline"] if inline else []), stdout=subprocess.PIPE)
        assert echo.stdout is not None
        # as the floor's: the client starts once the echo is up, so the servers' CPU counted
        # for the calls holds none of the echo's start (imports, connect, register: about
        # 0.4 s of CPU, 50 µs per call of a 4 000-call run, more or less with the timing)
        if echo.stdout.readline() != b"ready\n":
            raise RuntimeError("the router's echo did not register")
        return _run_client("client-router", path, n, [router, echo])
    finally:
        _stop(*(p for p in (echo, router) if p is not None))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role")
    ap.add_argument("--socket")
    ap.add_argument("--out", help="a client role writes its JSON result here")
    ap.add_argument("-n", type=int, default=4000)
    ap.add_argument("--inline", action="store_true",
                    help="the echo service answers with an inline handler (wire.md §22.2)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="floor/router pairs, run alternately; the medians over pairs are printed")
    args = ap.parse_args()
    roles = {
        "forwarder": lambda: forwarder(args.socket),
        "echo-floor": lambda: echo_floor(args.socket),
        "client-floor": lambda: client_floor(args.socket, args.n),
        "echo-router": lambda: echo_router(args.socket, args.inline),
        "client-router": lambda: client_router(args.socket, args.n),
    }
    if args.role:
        result = uvloop.run(roles[args.role]())
        if result is not None:
            # a file, not stdout: a pipe has been seen to deliver only its first 64 KiB
            Path(args.out).write_bytes(orjson.dumps(result))
        return
    floors: list[dict[str, Any]] = []
    routers: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="flyd-bench-", dir="/tmp")
    try:
        for rep in range(1, args.repeat + 1):
            progress(f"pair {rep}/{args.repeat}: floor (forwarder + echo + client), {args.n} calls")
            floors.append(measure_floor(tmp, args.n))
            progress(f"pair {rep}/{args.repeat}: router (flyd router + SDK echo + SDK client)")
            routers.append(measure_router(tmp, args.n, args.inline))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    floor_rtts = [statistics.median(f["rtts"]) * 1e6 for f in floors]
    router_rtts = [statistics.median(r["rtts"]) * 1e6 for r in routers]
    p99s = [statistics.quantiles(r["rtts"], n=100)[98] * 1e6 for r in routers]
    floor_us = statistics.median(floor_rtts)
    router_us = statistics.median(router_rtts)
    print(orjson.dumps({"bench": "bus_rtt", "floor_us": round(floor_us, 1),
                        "router_us": round(router_us, 1),
                        "ratio": round(router_us / floor_us, 3),
                        "p99_us": round(statistics.median(p99s), 1),
                        "pairs": [[round(f, 1), round(r, 1)]
                                  for f, r in zip(floor_rtts, router_rtts, strict=True)]}
                       ).decode())
    floor_rate = statistics.median(f["per_s"] for f in floors)
    router_rate = statistics.median(r["per_s"] for r in routers)
    print(orjson.dumps({"bench": "bus_throughput", "calls_per_s": round(router_rate),
                        "floor_calls_per_s": round(floor_rate),
                        "ratio": round(router_rate / floor_rate, 3),
                        "pairs": [[round(f["per_s"]), round(r["per_s"])]
                                  for f, r in zip(floors, routers, strict=True)]}).decode())

    def cpu_us(r: dict[str, Any]) -> float:
        return (r["cpu_s"] + r["servers_cpu_s"]) / r["calls"] * 1e6

    floor_cpu = [cpu_us(f) for f in floors]
    router_cpu = [cpu_us(r) for r in routers]
    print(orjson.dumps({"bench": "bus_cpu", "floor_us_per_call": round(
        statistics.median(floor_cpu), 1), "router_us_per_call": round(
        statistics.median(router_cpu), 1), "ratio": round(
        statistics.median(router_cpu) / statistics.median(floor_cpu), 3),
        "pairs": [[round(f, 1), round(r, 1)] for f, r in zip(floor_cpu, router_cpu,
                                                             strict=True)]}).decode())


if __name__ == "__main__":
    main()
