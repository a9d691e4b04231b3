"""Fixtures of wire.md §20: `router`, `raw`, `sdk`, `settle`.

Routers run in-process on the test's event loop (uvloop, tests/conftest.py) on a short
temporary socket path; raw connections speak bytes so tests can break every rule on purpose.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from bus.client import BusClient, connect
from bus.limits import Limits
from bus.policy import Policy
from bus.router import Router, RouterConfig
from bus.store import StoreSettings

#: every wire test runs under pytest-timeout (10 s) unless it names its own (wire.md §20)
WIRE_TIMEOUT_S = 10
RECV_TIMEOUT = 5.0
SHM = "/dev/shm"
HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test under tests/bus without a timeout marker of its own (function, class or
    module) the wire tests' 10 s; a `pytestmark` in a conftest would mark nothing."""
    for item in items:
        if item.path.is_relative_to(HERE) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(WIRE_TIMEOUT_S))


def short_socket_dir() -> str:
    """sun_path is 107 bytes; pytest's tmp_path can be longer."""
    return tempfile.mkdtemp(prefix="flyd-t-", dir="/tmp")


class RawConn:
    """A byte-level client: no checks, no SDK, just frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.next_id = 1

    async def send_bytes(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def send_body(self, body: bytes) -> None:
        await self.send_bytes(struct.pack("<I", len(body)) + body)

    async def send_obj(self, obj: Any) -> None:
        await self.send_body(orjson.dumps(obj))

    async def request(self, method: str, params: dict[str, Any] | None = None,
                      rid: int | None = None) -> int:
        """Send a request with the next id (or `rid`); return the id used."""
        if rid is None:
            rid = self.next_id
        self.next_id = rid + 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        await self.send_obj(msg)
        return rid

    async def recv_frame(self, timeout: float = RECV_TIMEOUT) -> bytes:
        async with asyncio.timeout(timeout):
            prefix = await self.reader.readexactly(4)
            (n,) = struct.unpack("<I", prefix)
            return await self.reader.readexactly(n)

    async def recv_obj(self, timeout: float = RECV_TIMEOUT) -> dict[str, Any]:
        obj: dict[str, Any] = orjson.loads(await self.recv_frame(timeout))
        return obj

    async def recv_response(self, rid: int, timeout: float = RECV_TIMEOUT,
                            notes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Read until the response with `rid`; notifications seen meanwhile go to `notes`."""
        while True:
            msg = await self.recv_obj(timeout)
            if msg.get("id") == rid:
                return msg
            if "id" in msg:
                raise AssertionError(f"response {msg['id']} arrived while waiting for {rid}")
            if notes is not None:
                notes.append(msg)

    async def call(self, method: str, params: dict[str, Any] | None = None,
                   notes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        rid = await self.request(method, params)
        return await self.recv_response(rid, notes=notes)

    async def recv_notification(self, method: str, timeout: float = RECV_TIMEOUT,
                                notes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        while True:
            msg = await self.recv_obj(timeout)
            if msg.get("method") == method:
                params: dict[str, Any] = msg["params"]
                return params
            if notes is not None:
                notes.append(msg)

    async def hello(self, client_id: str = "raw-1", client_incarnation: str | None = None,
                    supported_majors: list[int] | None = None) -> dict[str, Any]:
        return await self.call("bus.hello", {
            "clientId": client_id,
            "clientIncarnation": client_incarnation or f"{client_id}-inc-{os.urandom(4).hex()}",
            "supportedMajors": supported_majors or [1],
        })

    async def expect_eof(self, timeout: float = RECV_TIMEOUT) -> None:
        async with asyncio.timeout(timeout):
            rest = await self.reader.read()
            while rest:
                rest = await self.reader.read()

    async def expect_closing(self, name: str, timeout: float = RECV_TIMEOUT) -> dict[str, Any]:
        """Read frames up to `bus.closing`, check its error name, then require EOF."""
        while True:
            msg = await self.recv_obj(timeout)
            if msg.get("method") == "bus.closing":
                break
        error: dict[str, Any] = msg["params"]["error"]
        assert error["data"]["name"] == name, error
        assert error["data"]["dispatch"] == "unknown"
        await self.expect_eof(timeout)
        return error

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except OSError:
            pass


RouterFactory = Callable[..., Awaitable[Router]]
RawFactory = Callable[..., Awaitable[RawConn]]
SdkFactory = Callable[..., Awaitable[BusClient]]
Settle = Callable[[Callable[[dict[str, Any]], bool]], Awaitable[dict[str, Any]]]


@pytest.fixture
async def router() -> AsyncIterator[RouterFactory]:
    """`await router(policy=..., socket_group=..., allowed_uids=..., store_enabled=...,
    store_root=..., **limit_overrides)`. The store's root is, unless given, a fresh directory
    under /dev/shm shared by the test's routers and removed after it (docs/topics.md §17)."""
    started: list[Router] = []
    dirs: list[str] = []
    roots: list[str] = []

    async def make(policy: Policy | None = None, socket_group: str | None = None,
                   allowed_uids: tuple[int, ...] | None = None, socket_path: str | None = None,
                   store_enabled: bool = True, store_root: str | None = None,
                   **limits: int) -> Router:
        if socket_path is None:
            d = short_socket_dir()
            dirs.append(d)
            socket_path = os.path.join(d, "bus.sock")
        if store_root is None:
            if not roots:
                roots.append(tempfile.mkdtemp(prefix="flyd-t-store-", dir=SHM))
            store_root = roots[0]
        cfg = RouterConfig(socket_path=socket_path, limits=Limits().replace(**limits),
                           policy=policy or Policy.open(), socket_group=socket_group,
                           allowed_uids=allowed_uids,
                           store=StoreSettings(enabled=store_enabled, root=store_root))
        r = Router(cfg)
        await r.start()
        started.append(r)
        return r

    yield make
    for r in started:
        await r.stop()
    for d in dirs + roots:
        shutil.rmtree(d, ignore_errors=True)


def store_dir(r: Router) -> str:
    """The store directory of router `r` (docs/topics.md §17)."""
    store = r.artifacts.store
    assert store is not None, "the router has no store"
    return store.path


def store_files(r: Router) -> list[str]:
    """The entries of `r`'s store directory, sorted."""
    return sorted(os.listdir(store_dir(r)))


@pytest.fixture
async def raw(router: RouterFactory) -> AsyncIterator[RawFactory]:
    """`await raw(r)` opens a byte-level connection to router `r` (or a path)."""
    conns: list[RawConn] = []

    async def make(target: Router | str) -> RawConn:
        path = target if isinstance(target, str) else target.socket_path
        reader, writer = await asyncio.open_unix_connection(path, limit=2**25)
        c = RawConn(reader, writer)
        conns.append(c)
        return c

    yield make
    for c in conns:
        await c.close()


@pytest.fixture
async def sdk(router: RouterFactory) -> AsyncIterator[SdkFactory]:
    """`await sdk(r, "client-id", **connect_kwargs)` opens an SDK connection."""
    clients: list[BusClient] = []

    async def make(target: Router | str, client_id: str, **kwargs: Any) -> BusClient:
        path = target if isinstance(target, str) else target.socket_path
        c = await connect(path, client_id=client_id, **kwargs)
        clients.append(c)
        return c

    yield make
    for c in clients:
        await c.close()


@pytest.fixture
def settle() -> Callable[[Router, Callable[[dict[str, Any]], bool]], Awaitable[dict[str, Any]]]:
    """`await settle(r, pred)`: poll the router's stats every 10 ms for up to 2 s."""

    async def wait(r: Router, pred: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        stats = r.stats()
        for _ in range(200):
            stats = r.stats()
            if pred(stats):
                return stats
            await asyncio.sleep(0.01)
        raise AssertionError(f"router state did not settle: {stats}")

    return wait


# Hypothesis profile for `make fuzz` (`pytest tests/bus/test_fuzz.py --hypothesis-profile=fuzz`).
# The hypothesis plugin loads that option when pytest configures, before any test module is
# imported, so the profile must be registered here; test_fuzz.py registers its quick default
# and, under this profile, also raises its state machine's frame target (FRAME_TARGET).
from hypothesis import HealthCheck as _HealthCheck  # noqa: E402
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile(
    "fuzz", max_examples=2000, deadline=None,
    suppress_health_check=[_HealthCheck.too_slow, _HealthCheck.data_too_large],
)
