"""The in-process and thread bodies of a worker: how an owner process runs a
worker shell on its own loop or in a thread of its own.

Why apart from the shell: the launcher runs workers in thread and in-process mode, so it needs
these bodies, while the shell's request pipeline and the process body (`workers.main`) are the
worker's side only; flyd imports this module and never the shell.

API:

    EndpointFactory                  builds a launch's endpoint (`workers.roles.endpoint_for`)
    start_endpoint(launch, endpoint_factory) -> Endpoint
                                     the endpoint, a plugin's start-up exception as a
                                     `DomainError` with its `PluginFault`
    run_worker(launch, *, stop_event=None, endpoint_factory) -> int
                                     thread / in-process body
    WorkerThread(launch, *, endpoint_factory, name=None, on_end=None)
                                     thread mode: own uvloop loop; start/stop/cancel/join
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from workers.launch import WorkerLaunch
from workers.shell import Endpoint, WorkerShell
from workers.types.domain import DomainError, ErrorCode, Mutation, PluginFault, PluginStage

__all__ = ["EndpointFactory", "WorkerThread", "run_worker", "start_endpoint"]

EndpointFactory = Callable[[WorkerLaunch], Endpoint]
"""Builds a launch's endpoint: `workers.roles.endpoint_for`, or a test's or an owner's own."""


async def run_worker(launch: WorkerLaunch, *, stop_event: asyncio.Event | None = None,
                     endpoint_factory: EndpointFactory) -> int:
    """Build the endpoint (its model/world class is imported and checked now; a refusal is
    raised as `DomainError`), then serve on the running loop until Shutdown (0), a lost or
    aborted connection (3) or a registration conflict (4). The thread and in-process body."""
    endpoint = start_endpoint(launch, endpoint_factory)
    return await WorkerShell(launch, endpoint).run(stop_event=stop_event)


def start_endpoint(launch: WorkerLaunch, endpoint_factory: EndpointFactory) -> Endpoint:
    """The launch's endpoint. Building it imports the model or world and runs its start-up
    code (a world's constructor, a model's `profile`/`graph`); an exception from there is
    `BACKEND_FAILURE`/`none` carrying its `PluginFault` (stage `construct`: a worker built from
    the same launch fails the same way again), so the launcher can name it."""
    try:
        return endpoint_factory(launch)
    except DomainError:
        raise
    except Exception as exc:
        fault = PluginFault.of(exc, launch.plugin, PluginStage.CONSTRUCT)
        raise DomainError(ErrorCode.BACKEND_FAILURE,
                          f"{launch.worker_id}: starting {launch.plugin} failed: "
                          f"{fault.summary()}", Mutation.NONE, fault) from None


class WorkerThread:
    """Thread mode (design/session.md §7.1): `run_worker` on its own uvloop event loop in a
    dedicated OS thread.

    `start()` returns at once. `stop()` aborts the connection (no reply, no unregister) and
    `cancel()` cancels the worker's task; both are thread-safe and hold when called before the
    loop runs (a cancelled body then never starts). `join(timeout) -> bool` is True when the
    thread ended. At the end `exit_code` is the body's code, or None when the body raised
    (`error`, e.g. a refused launch) or was cancelled (`cancelled`). `on_end(thread)` is the
    thread's last act, so an owner on another loop learns of the end without polling.
    """

    def __init__(self, launch: WorkerLaunch, *, endpoint_factory: EndpointFactory,
                 name: str | None = None,
                 on_end: Callable[[WorkerThread], None] | None = None) -> None:
        self.launch = launch
        self.exit_code: int | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self._factory = endpoint_factory
        self._on_end = on_end
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False
        self._cancel_requested = False
        self.thread = threading.Thread(target=self._main,
                                       name=name or f"worker-{launch.worker_id}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _main(self) -> None:
        import uvloop

        try:
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                self.exit_code = runner.run(self._amain())
        except asyncio.CancelledError:
            self.cancelled = True
        except BaseException as exc:  # a refused launch (DomainError) or a crash, for the owner
            self.error = exc
        finally:
            if self._on_end is not None:
                self._on_end(self)

    async def _amain(self) -> int:
        with self._lock:
            if self._cancel_requested:
                raise asyncio.CancelledError
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            self._stop = asyncio.Event()
            if self._stop_requested:
                self._stop.set()
        return await run_worker(self.launch, stop_event=self._stop,
                                endpoint_factory=self._factory)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The worker's event loop once it runs (an owner schedules onto it thread-safely)."""
        return self._loop

    def stop(self) -> None:
        """Abort the worker's connection (thread-safe)."""
        with self._lock:
            self._stop_requested = True
            loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            with contextlib.suppress(RuntimeError):  # the thread's loop already closed
                loop.call_soon_threadsafe(stop.set)

    def cancel(self) -> None:
        """Cancel the worker's task (thread-safe)."""
        with self._lock:
            self._cancel_requested = True
            loop, task = self._loop, self._task
        if loop is not None and task is not None:
            with contextlib.suppress(RuntimeError):  # the thread's loop already closed
                loop.call_soon_threadsafe(task.cancel)

    def join(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()
