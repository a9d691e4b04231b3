"""The node's metrics endpoint: a minimal HTTP/1.1 server on the node's event loop.

Why on the loop and not prometheus_client's threaded server: what a scrape reads (lease holds,
reports, the executor's totals, the router's `bus.stats`) lives on the loop and is mutated
there; rendering on the loop reads it consistently without locks, can await the router under a
deadline, and leaves no thread behind: the server is started and closed with the node
(`NodeProcess.start` / `close`), and every connection's handler is tracked and cancelled at
close.

Rules:
- `MetricsAddress.parse("HOST:PORT" | "[V6]:PORT" | "PORT")`: a bare port binds 127.0.0.1
  (loopback unless an interface is named); port 0 takes a free port (the bound one is what
  `MetricsEndpoint.start` returns and the node logs as `metrics.listening`).
- `GET /metrics` (and `HEAD`) answers 200 with the rendered exposition; any other path 404,
  any other method 405. Every answer closes the connection.
- A request head must arrive within `READ_S` and fit in `MAX_HEAD_BYTES`, else the connection
  is closed (408 / 431); a render that fails answers 500 and is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import structlog

__all__ = ["MetricsAddress", "MetricsAddressError", "MetricsEndpoint"]

log = structlog.get_logger("flyd.node.metrics")

READ_S: Final = 5.0
WRITE_S: Final = 10.0
CLOSE_S: Final = 5.0
MAX_HEAD_BYTES: Final = 8192
DEFAULT_HOST: Final = "127.0.0.1"

Render = Callable[[], Awaitable[bytes]]


class MetricsAddressError(ValueError):
    """An address that is not `HOST:PORT` or `PORT`."""


@dataclass(frozen=True)
class MetricsAddress:
    """Where the metrics endpoint listens (`[node] metrics`, `flyd serve --metrics`)."""

    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> MetricsAddress:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = DEFAULT_HOST, text
        elif host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                raise MetricsAddressError(f"{text!r}: {host!r} is not an IPv6 address") from None
        elif not host or ":" in host or any(c.isspace() for c in host):
            raise MetricsAddressError(f"{text!r} is not HOST:PORT, [IPV6]:PORT or PORT")
        if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
            raise MetricsAddressError(f"{text!r}: the port must be 0..65535")
        return cls(host, int(port_text))

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class MetricsEndpoint:
    """`GET /metrics` on `address`, answered with `render()` (module rules)."""

    def __init__(self, address: MetricsAddress, render: Render, content_type: str) -> None:
        self.address = address
        self._render = render
        self._content_type = content_type
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> MetricsAddress:
        """Listen; returns the bound address (the real port when 0 was asked for). An
        address that cannot be bound raises `OSError`."""
        self._server = await asyncio.start_server(
            self._handle, self.address.host, self.address.port, limit=MAX_HEAD_BYTES)
        host, port = self._server.sockets[0].getsockname()[:2]
        return MetricsAddress(str(host), int(port))

    async def close(self) -> None:
        """Stop listening and end every open connection (bounded)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=CLOSE_S)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_S):
                await server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._answer(reader, writer)
        except (ConnectionError, TimeoutError):
            pass  # the scraper went away or stalled: nothing to answer
        finally:
            self._handlers.discard(task)
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(CLOSE_S):
                    await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(READ_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            await self._send(writer, 408, b"request timeout\n")
            return
        except asyncio.LimitOverrunError:
            await self._send(writer, 431, b"request head too large\n")
            return
        except asyncio.IncompleteReadError:
            return
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3:
            await self._send(writer, 400, b"bad request\n")
            return
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            await self._send(writer, 405, b"method not allowed\n", allow=True)
            return
        if target != b"/metrics":
            await self._send(writer, 404, b"not found: the metrics are at /metrics\n")
            return
        try:
            body = await self._render()
        except Exception:  # a failed render is a 500 for this scrape, never the node's end
            log.exception("metrics.render_failed")
            await self._send(writer, 500, b"metrics could not be rendered\n")
            return
        await self._send(writer, 200, body, content_type=self._content_type,
                         head_only=method == b"HEAD")

    async def _send(self, writer: asyncio.StreamWriter, status: int, body: bytes, *,
                    content_type: str = "text/plain; charset=utf-8", allow: bool = False,
                    head_only: bool = False) -> None:
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  408: "Request Timeout", 431: "Request Header Fields Too Large",
                  500: "Internal Server Error"}[status]
        headers = [f"HTTP/1.1 {status} {reason}", f"Content-Type: {content_type}",
                   f"Content-Length: {len(body)}", "Connection: close"]
        if allow:
            headers.append("Allow: GET, HEAD")
        writer.write(("\r\n".join(headers) + "\r\n\r\n").encode())
        if not head_only:
            writer.write(body)
        async with asyncio.timeout(WRITE_S):
            await writer.drain()
