"""`PartsWatch`: the asyncio shell of the node's part liveness (`flyd.node.liveness`).

Why: the router and the fork server are the node's own parts; every run it holds depends on
them. This shell probes each part on the node's health budgets (`[session] health_probe_s`
between probes, `[session] health_fail_s` for an answer: the deadline the node already gives a
worker's `Worker.Status`), kills a part that misses its deadline (SIGKILL, which ends a stopped
process too) and has it replaced, and tells the node when a part is given up or back
(`on_change`). All decisions are the pure core's; each part is one task of a TaskGroup and
every wait is bounded.

Parts:
- `RouterPart`: the probe is `bus.stats` on the node's own connection; the kill is SIGKILL of
  the router child. The router's supervisor (`NodeProcess.supervise_router`) replaces it, as
  it replaces a router that died, and reports its outcome here (`lost`, `replaced`,
  `replace_failed`).
- `ForkServerPart`: the probe is the server's `ping`; only a started, ready server is probed (a
  node that never launched a process worker has none). A miss, or a server found gone, is
  replaced here: `Spawner.replace_server()` kills it and starts another, bounded by the
  spawner's own start bound.

`check(timeout)` probes every present part at once and waits until each answered or was given
up: a grant session asks it when an attempt failed, so a failure caused by a hung part is known
as such (and refunded) before the attempt is judged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Final, Protocol

import structlog

from bus.client import BusClient
from bus.errors import BusError
from flyd.launch.forkserver import ForkServerError
from flyd.launch.spawn import ChildProcess
from flyd.launch.spawner import SERVER_START_S, Spawner
from flyd.node.liveness import GiveUp, PartLiveness, Phase, Probe, Recovered, Replace, Verdict

__all__ = ["ForkServerPart", "Part", "PartGone", "PartsWatch", "RouterPart"]

log = structlog.get_logger("flyd.node.parts")

#: longest wait between two replacement tries of a part the shell replaces itself
RETRY_MAX_S: Final = 5.0


class PartGone(Exception):
    """The part is not there to answer (its connection closed, its process gone)."""


class Part(Protocol):
    """One of the node's parts as the watch sees it."""

    @property
    def name(self) -> str: ...

    @property
    def replaces_itself(self) -> bool:
        """False when another task replaces the part and reports to the watch (the router)."""

    def present(self) -> bool:
        """Whether there is a part to probe now."""

    def gone(self) -> str | None:
        """Why a present part is known dead without a probe; None when it is not."""

    async def probe(self) -> None:
        """One round trip; `PartGone` when the part is gone. The watch bounds it."""

    def kill(self) -> None:
        """SIGKILL the part's process."""

    async def replace(self) -> None:
        """Bring up a new part (only when `replaces_itself`); raises when it cannot."""


class RouterPart:
    """The router child, probed over the node's connection (module docstring)."""

    name = "router"
    replaces_itself = False

    def __init__(self, process: Callable[[], ChildProcess | None],
                 client: Callable[[], BusClient | None]) -> None:
        self._process = process
        self._client = client

    def present(self) -> bool:
        process, client = self._process(), self._client()
        return (process is not None and not process.exited.done() and client is not None
                and not client.closed)

    def gone(self) -> str | None:
        return None  # the supervisor sees the router's exit first and reports it

    async def probe(self) -> None:
        client = self._client()
        if client is None or client.closed:
            raise PartGone("the node's connection to the router is closed")
        try:
            await client.stats()
        except BusError as exc:
            raise PartGone(f"bus.stats: {exc.name}: {exc.message}") from None

    def kill(self) -> None:
        process = self._process()
        if process is not None:
            process.kill()  # a no-op once its exit was seen: never a reused pid

    async def replace(self) -> None:
        raise NotImplementedError("the router's supervisor replaces it")


class ForkServerPart:
    """The node's fork server, probed with `ping` (module docstring)."""

    name = "fork server"
    replaces_itself = True

    def __init__(self, spawner: Spawner) -> None:
        self._spawner = spawner

    def present(self) -> bool:
        server = self._spawner.server
        return server is not None and (server.ready or server.closed)

    def gone(self) -> str | None:
        server = self._spawner.server
        return "the fork server exited" if server is not None and server.closed else None

    async def probe(self) -> None:
        server = self._spawner.server
        if server is None or server.closed:
            raise PartGone("the fork server exited")
        try:
            await server.ping()
        except ForkServerError as exc:
            raise PartGone(str(exc)) from None

    def kill(self) -> None:
        server = self._spawner.server
        if server is not None:
            server.kill()

    async def replace(self) -> None:
        async with asyncio.timeout(SERVER_START_S + 5.0):
            await self._spawner.replace_server()


class PartsWatch:
    """Probes `parts` every `period` seconds with `deadline` for an answer; `on_change(reason)`
    hears a part given up (the reason) or every part back (None)."""

    def __init__(self, parts: Sequence[Part], *, period: float, deadline: float,
                 on_change: Callable[[str | None], None]) -> None:
        self._parts = {p.name: p for p in parts}
        self.cores = {p.name: PartLiveness(p.name, period, deadline) for p in parts}
        self._on_change = on_change
        self._changed = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        #: given-up parts and why
        self.down: dict[str, str] = {}

    @property
    def reason(self) -> str | None:
        """Why the node cannot launch runs now (None: every part is up)."""
        return "; ".join(self.down.values()) or None

    async def run(self) -> None:
        """Watch every part until cancelled (lifetime tasks, one TaskGroup)."""
        async with asyncio.TaskGroup() as tg:
            for part in self._parts.values():
                tg.create_task(self._watch(part))

    # ------------------------------------------------------------------ reports (router)

    def lost(self, name: str, why: str) -> None:
        """The part died (its supervisor saw the exit)."""
        self._apply(self._parts[name], self.cores[name].lost(self._loop.time(), why))

    def replaced(self, name: str) -> None:
        self.cores[name].replaced(self._loop.time())
        log.info("part.replaced", part=name)
        self._notify()

    def replace_failed(self, name: str, why: str) -> None:
        self._apply(self._parts[name], self.cores[name].replace_failed(self._loop.time(), why))

    # ------------------------------------------------------------------ on demand

    async def check(self, timeout: float) -> None:  # noqa: ASYNC109
        """Probe every present part now and wait (≤ `timeout`) until each answered since, or
        was given up (module docstring)."""
        asked = self._loop.time()
        for name, core in self.cores.items():
            if self._parts[name].present():
                core.request(asked)
        self._notify()

        def settled() -> bool:
            return all(core.settled_since(asked) or (core.phase is Phase.IDLE
                                                     and not self._parts[name].present())
                       for name, core in self.cores.items())

        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while not settled():
                    changed = self._changed
                    await changed.wait()

    # ------------------------------------------------------------------ the loop

    async def _watch(self, part: Part) -> None:
        core = self.cores[part.name]
        while True:
            now = self._loop.time()
            if core.phase is not Phase.REPLACING:
                why = part.gone() if part.present() else None
                if why is not None:
                    self._apply(part, core.lost(now, why))
                    continue
            action = core.tick(now) if part.present() or core.phase is Phase.PROBING else None
            if isinstance(action, Probe):
                await self._probe(part, core)
            elif action is not None:
                self._apply(part, action)
            elif core.phase is Phase.REPLACING and part.replaces_itself:
                await self._replace(part, core)
            else:
                due = core.due()
                await self._sleep(core.period if due is None or not part.present()
                                  else max(0.0, due - now))

    async def _probe(self, part: Part, core: PartLiveness) -> None:
        try:
            async with asyncio.timeout(core.deadline):
                await part.probe()
        except TimeoutError:
            return  # the next tick is the miss
        except PartGone as exc:
            self._apply(part, core.lost(self._loop.time(), str(exc)))
            return
        self._apply(part, core.answered(self._loop.time()))

    async def _replace(self, part: Part, core: PartLiveness) -> None:
        """Bring up a new part; a failure waits (doubling, ≤ `RETRY_MAX_S`) before the next."""
        try:
            await part.replace()
        except (ForkServerError, OSError, TimeoutError) as exc:
            self._apply(part, core.replace_failed(self._loop.time(), str(exc) or repr(exc)))
            retry_at = self._loop.time() + min(RETRY_MAX_S,
                                               core.period * 2 ** min(core.failures, 6))
            while (left := retry_at - self._loop.time()) > 0:  # other changes wake the sleep
                await self._sleep(left)
            return
        core.replaced(self._loop.time())
        log.info("part.replaced", part=part.name)
        self._notify()

    def _apply(self, part: Part, verdict: Verdict | None) -> None:
        """Carry out what the core decided (a `GiveUp` from a miss or loss also replaces)."""
        if isinstance(verdict, Replace | GiveUp):
            log.warning("part.replacing", part=part.name, reason=verdict.reason)
            part.kill()
        if isinstance(verdict, GiveUp):
            log.error("part.given_up", part=part.name, reason=verdict.reason)
            self.down[part.name] = verdict.reason
            self._on_change(self.reason)
        elif isinstance(verdict, Recovered):
            log.info("part.recovered", part=part.name)
            self.down.pop(part.name, None)
            self._on_change(self.reason)
        self._notify()

    def _notify(self) -> None:
        """Wake every waiter (the watch loops and `check`); never blocks."""
        woken, self._changed = self._changed, asyncio.Event()
        woken.set()

    async def _sleep(self, seconds: float) -> None:
        """Until `seconds` pass or anything changes."""
        changed = self._changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await changed.wait()
