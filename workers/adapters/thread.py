"""The one thread an environment lives on (docs/adapters.md, "The env's thread").

Why: native simulators bind resources to the thread that made them. A MuJoCo env rendered
first on one thread and later on another draws black frames or fails with `Cannot make context
… current on thread`; OpenGL contexts, some physics engines and GUI toolkits behave alike. The
worker calls its world from more than one thread (the world is built on the event loop's thread
when the worker starts; its later calls run on the worker's model thread, or inline), so the
adapter owns a single-thread executor and makes every call into its env there: build, reset,
step, render, capture, restore and close.

A call made from the env's own thread (a step that the first-capture check makes inside a
world call) runs directly instead of waiting for itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["EnvThread"]

T = TypeVar("T")


class EnvThread:
    """A dedicated thread; `call(fn, …)` runs `fn` there and returns its result (or raises
    its exception, traceback included)."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._ident: int | None = None

    def _enter(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        self._ident = threading.get_ident()
        return fn(*args)

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        if threading.get_ident() == self._ident:
            return fn(*args)
        return self._pool.submit(self._enter, fn, args).result()

    def ident(self) -> int | None:
        """The thread's id, once it ran a call (for the tests of the threading rule)."""
        return self._ident

    def close(self) -> None:
        """Let the thread end once its queue is empty; later calls are refused."""
        self._pool.shutdown(wait=False)
