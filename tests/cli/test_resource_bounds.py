"""The bus's per-connection and queue bounds as configured for a real `flyd router` process
(README "Resource bounds"; wire.md §14; cli.md §2.3 `[bus.limits]`).

A router child is started with `[bus.limits]` from a TOML file (`max_envelope_bytes = 65536`,
`max_service_queued = 2`, `max_queued_call_bytes = 65536`); each bound is then exceeded by a
real client:
- a frame prefix over `max_envelope_bytes` → `bus.closing` INVALID_ENVELOPE and EOF before the
  router reads (or allocates) the body; the other connections keep working;
- a registration asking `maxQueued` above `max_service_queued` → QUOTA_EXCEEDED;
- a call to a service whose queue is full, and a call whose payload would take the router's queued
  bytes past `max_queued_call_bytes` → BACKPRESSURE `not-dispatched`;
and nothing admitted is lost: once the service answers, every admitted call completes, and the
service keeps its incarnation.

The same bounds on an in-process router, with the control lane (`max_control_frames`,
`max_control_bytes`), the active-call and open-request limits: `tests/bus/test_backpressure.py`,
`tests/bus/test_framing.py`. The checkpoint byte budget (`[checkpoints] max_queued_bytes` →
BUSY, `max_envelope_bytes` → UNSUPPORTED, the queue capacity → BUSY before anyone is asked):
`tests/state/test_writer.py` (tests 36 and 37 of state.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from bus.client import BusClient, connect
from bus.client_serving import Request
from bus.errors import Backpressure, QuotaExceeded
from flyd.node.router_child import router_answers

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
ENVELOPE = 65536
LIMITS = f"""[bus.limits]
max_envelope_bytes = {ENVELOPE}
max_service_queued = 2
max_queued_call_bytes = {ENVELOPE}
"""


@pytest.fixture
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="flyd-rb-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def router(home: Path) -> AsyncIterator[str]:
    """`flyd router --open` with the test's `[bus.limits]`; stopped with SIGTERM (exit 0)."""
    config = home / "flyd.toml"
    config.write_text(LIMITS)
    sock = str(home / "bus.sock")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "flyd", "router", "--socket", sock, "--config", str(config),
        "--open", "-q", cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        async with asyncio.timeout(30):
            while not await asyncio.to_thread(router_answers, sock):
                assert proc.returncode is None, "the router exited"
                await asyncio.sleep(0.05)
        yield sock
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(30):
                code = await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
    assert code == 0


async def _closing_after_prefix(sock: str, length: int) -> dict[str, Any]:
    """Send only a length prefix; return the `bus.closing` the router answers, then EOF."""
    reader, writer = await asyncio.open_unix_connection(sock)
    try:
        writer.write(struct.pack("<I", length))
        await writer.drain()
        async with asyncio.timeout(10):
            size = struct.unpack("<I", await reader.readexactly(4))[0]
            frame: dict[str, Any] = orjson.loads(await reader.readexactly(size))
            assert await reader.read() == b"", "the connection stayed open"
    finally:
        writer.close()
    return frame


async def test_configured_router_bounds_refuse_with_their_codes_and_lose_nothing(
        home: Path) -> None:
    async with router(home) as sock:
        release = asyncio.Event()
        seen: list[int] = []

        async def handler(request: Request) -> dict[str, Any]:
            await release.wait()
            seen.append(int(request.payload["params"]["n"]))
            return {"type": "result", "requestId": request.payload["requestId"], "result": {}}

        async with connect(sock, client_id="svc-owner") as owner, \
                connect(sock, client_id="caller") as caller:
            assert {k: owner.limits[k] for k in ("maxEnvelopeBytes", "maxServiceQueued",
                                                 "maxQueuedCallBytes")} == {
                "maxEnvelopeBytes": ENVELOPE, "maxServiceQueued": 2,
                "maxQueuedCallBytes": ENVELOPE}
            with pytest.raises(QuotaExceeded) as quota:
                await owner.register("worker.w", handler, max_queued=3, max_in_flight=1)
            assert quota.value.dispatch == "not-dispatched"
            async with await owner.register("worker.w", handler, max_queued=2,
                                            max_in_flight=1):
                before = _owners(await caller.services("worker."))
                admitted = [await _start(caller, n, 16) for n in range(3)]  # 1 in flight, 2 queued
                await _settled(caller, queued=2)
                with pytest.raises(Backpressure) as full:
                    await _start(caller, 3, 16)
                assert full.value.dispatch == "not-dispatched"

                # the frame bound: another connection is closed, this one is not
                frame = await _closing_after_prefix(sock, ENVELOPE + 1)
                assert frame["method"] == "bus.closing"
                assert orjson.dumps(frame).count(b"INVALID_ENVELOPE") == 1
                assert _owners(await caller.services("worker.")) == before

                release.set()
                async with asyncio.timeout(30):
                    for pending in admitted:
                        assert (await pending.result()).outcome["type"] == "result"
                assert sorted(seen) == [0, 1, 2]
                assert _owners(await caller.services("worker.")) == before

            # the queued-bytes budget: a blocked service, payloads of 30 KiB each
            gate = asyncio.Event()

            async def blocked(request: Request) -> dict[str, Any]:
                await gate.wait()
                return {"type": "result", "requestId": request.payload["requestId"],
                        "result": {}}

            async with await owner.register("worker.b", blocked, max_queued=2, max_in_flight=1):
                first = await _start(caller, 0, 30_000, target="worker.b")  # dispatched
                await _settled(caller, queued=0)
                second = await _start(caller, 1, 30_000, target="worker.b")  # queued
                await _settled(caller, queued=1)
                with pytest.raises(Backpressure) as budget:
                    await _start(caller, 2, 40_000, target="worker.b")
                assert budget.value.dispatch == "not-dispatched"
                stats = await caller.stats()
                assert 30_000 < stats["queuedCallBytes"] <= ENVELOPE
                gate.set()
                async with asyncio.timeout(30):
                    for pending in (first, second):
                        assert (await pending.result()).outcome["type"] == "result"


async def _start(client: BusClient, n: int, pad: int, target: str = "worker.w") -> Any:
    """Admit one call (raises the router's refusal) and return its pending handle."""
    return await client.start_call(target, "Worker.Status",
                                   {"requestId": f"req-{n + 1}", "scope": None,
                                    "params": {"n": n, "pad": "x" * pad}})


def _owners(listing: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    """Who holds each service under which incarnation (queue gauges left out)."""
    return [(s["name"], s["serviceIncarnation"], s["owner"]) for s in listing]


async def _settled(client: BusClient, queued: int) -> None:
    """Poll `bus.stats` until `queuedCalls` is `queued` (router effects are asynchronous)."""
    async with asyncio.timeout(10):
        while True:
            if (await client.stats())["queuedCalls"] == queued:
                return
            await asyncio.sleep(0.02)


def test_router_limits_out_of_range_stop_the_router(home: Path) -> None:
    """A limit outside wire.md §14.1's range stops the router at start, naming the key."""
    config = home / "flyd.toml"
    config.write_text("[bus.limits]\nmax_envelope_bytes = 1024\n")
    out = subprocess.run([sys.executable, "-m", "flyd", "router", "--socket",
                          str(home / "bus.sock"), "--config", str(config)], cwd=ROOT,
                         capture_output=True, timeout=60, check=False)
    assert out.returncode == 2
    assert b"max_envelope_bytes" in out.stderr and str(config).encode() in out.stderr
    assert not (home / "bus.sock").exists()
