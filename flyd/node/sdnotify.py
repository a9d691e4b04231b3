"""A minimal sd_notify client (design/cli.md §5.2, §10): datagrams over `$NOTIFY_SOCKET`, no
libsystemd.

Why: under `Type=notify` systemd learns readiness, status, liveness and shutdown from one-line
`KEY=value` datagrams sent to the socket it names in `$NOTIFY_SOCKET`; a few lines of `socket`
do that without a native dependency.

Rules:
- `$NOTIFY_SOCKET` is an absolute path or, with a leading `@`, a name in the abstract namespace
  (the `@` becomes a NUL byte). Unset or empty: every send is a no-op that reports `False`.
- A message is `KEY=value` lines; keys are upper-case `[A-Z_]` words and values one line (a
  line break in a value, e.g. a `STATUS=` summary, is folded into a space).
- Sends never block the event loop: the socket is non-blocking, and a full receive queue or a
  vanished socket makes that send report `False` rather than raise (notifications are advice to
  the service manager, never a reason for the service to fail).
- `WATCHDOG_USEC` enables the watchdog only when `WATCHDOG_PID` is unset or names this process;
  the interval to ping at is half of it (sd_watchdog_enabled(3)).

Decisions where the spec is silent:
- An address that is neither absolute nor abstract (e.g. systemd's `vsock:` form) is refused by
  `NotifyError` (code `CONFIG`) when read, so a misconfiguration is visible at start.
- `Notifier.from_environ(unset=True)` removes `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID`
  from the environment (sd_notify's `unset_environment`), so the router and the workers the node
  starts never speak for the unit.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Final

__all__ = ["Notifier", "NotifyError", "encode", "notify", "watchdog_interval"]

ENV_KEYS: Final = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
_KEY: Final = re.compile(r"^[A-Z_]+$")


class NotifyError(Exception):
    """`$NOTIFY_SOCKET` or `$WATCHDOG_USEC` is malformed (code `CONFIG`, nothing sent)."""

    code = "CONFIG"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _address(value: str) -> str | bytes:
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    raise NotifyError(f"NOTIFY_SOCKET must be an absolute path or @name, not {value!r}")


def _watchdog_s(environ: Mapping[str, str], pid: int) -> float | None:
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec:
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner and owner != str(pid):
        return None
    try:
        value = int(usec)
    except ValueError:
        raise NotifyError(f"WATCHDOG_USEC must be an integer, not {usec!r}") from None
    if value <= 0:
        raise NotifyError(f"WATCHDOG_USEC must be positive, not {usec!r}")
    return value / 1_000_000


def encode(fields: Mapping[str, object]) -> bytes:
    """The datagram for `fields`: `KEY=value` lines in the given order."""
    lines = []
    for key, value in fields.items():
        if not _KEY.match(key):
            raise ValueError(f"sd_notify key must be upper-case [A-Z_]: {key!r}")
        text = " ".join(str(value).splitlines())
        lines.append(f"{key}={text}")
    return ("\n".join(lines) + "\n").encode()


@dataclass(frozen=True)
class Notifier:
    """Where notifications go (None: not under a service manager) and the watchdog period."""

    address: str | bytes | None = None
    watchdog_s: float | None = None

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None, *,
                     pid: int | None = None, unset: bool = False) -> Notifier:
        env = os.environ if environ is None else environ
        raw = env.get("NOTIFY_SOCKET", "")
        notifier = cls(address=_address(raw) if raw else None,
                       watchdog_s=_watchdog_s(env, os.getpid() if pid is None else pid))
        if unset:
            for key in ENV_KEYS:
                env.pop(key, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self.address is not None

    @property
    def watchdog_interval(self) -> float | None:
        """Seconds between `WATCHDOG=1` pings (half of `WATCHDOG_USEC`), None when disabled."""
        return None if self.watchdog_s is None else self.watchdog_s / 2

    def send(self, **fields: object) -> bool:
        """Send one datagram; True when the socket took it, False when disabled or refused."""
        if self.address is None or not fields:
            return False
        data = encode(fields)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            try:
                sock.sendto(data, self.address)
            except OSError:
                return False
        return True


def notify(**fields: object) -> bool:
    """Send `fields` (e.g. `READY=1`, `STATUS="…"`) to `$NOTIFY_SOCKET`; no-op when unset."""
    return Notifier.from_environ().send(**fields)


def watchdog_interval() -> float | None:
    """Half of `$WATCHDOG_USEC` in seconds when the watchdog is meant for this process."""
    return Notifier.from_environ().watchdog_interval
