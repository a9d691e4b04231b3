"""`HealthPolicy`: the launcher's supervision budgets (design/session.md §7.4). Pure.

Why: the node probes every live worker with `Worker.Status`, and the same three numbers bound
the launcher's own calls: `probe` (seconds between health checks; also the bound of a
`Worker.Shutdown` and of the wait for an exit at reap), `fail` (how long one health check or one
identify attempt may wait for an answer) and `boot` (how long a launch may take to identify).
They come from `[session] health_probe_s`, `health_fail_s`, `health_boot_s` (design/cli.md §2.3),
typed by the configuration (`flyd.config.SessionSettings.health`).

Resolved ambiguities:
- Durations in messages are written by `format_seconds`: whole milliseconds below one second
  (`200ms`), otherwise seconds in the shortest exact decimal form (`10s`, `2.5s`).
- A policy must have every value finite and > 0 (`INVALID_ARGUMENT` naming the key otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from workers.types.domain import DomainError, ErrorCode, Mutation

__all__ = ["CONFIG_KEYS", "HealthPolicy", "format_seconds", "no_answer"]

#: `[session]` configuration key of each field.
CONFIG_KEYS: Final = {"probe": "health_probe_s", "fail": "health_fail_s", "boot": "health_boot_s"}


def format_seconds(seconds: float) -> str:
    """`0.2` → `200ms`, `10.0` → `10s`, `2.5` → `2.5s`."""
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    return f"{seconds:g}s"


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """Seconds: `probe` 2.0, `fail` 10.0, `boot` 30.0 by default."""

    probe: float = 2.0
    fail: float = 10.0
    boot: float = 30.0

    def __post_init__(self) -> None:
        for name, key in CONFIG_KEYS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value <= 0:
                raise DomainError.invalid(f"[session] {key} must be a number > 0; got {value!r}")



def no_answer(method: str, worker_id: str, budget: float) -> DomainError:
    """`BACKEND_FAILURE`/`unknown`: the worker did not answer within the supervisor's budget."""
    return DomainError(
        ErrorCode.BACKEND_FAILURE,
        f"{method}: {worker_id} did not answer within the supervisor's budget of "
        f"{format_seconds(budget)}",
        Mutation.UNKNOWN,
    )
