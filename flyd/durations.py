"""The bound on every configured duration (design/cli.md §2.3, design/session.md §4.10,
design/state.md §5.1).

Why: a duration is handed to PostgreSQL (`statement_timeout`, `make_interval(secs => …)` added to
`now()`), to the event loop's timers and to the node's clock. An absurd value (`--lease-ttl
1e308`) used to pass validation and then fail every claim with "timestamp out of range" while the
command waited silently. Every duration is therefore refused at parse time, naming its key,
unless it is finite and at most `MAX_DURATION_MS`.

Decision: one bound for every duration, the tightest representation among their uses:
2^31 − 1 ms (about 24.8 days), the largest timeout PostgreSQL accepts as a setting; it is far
inside what a `timestamptz` plus an interval and the event loop's clock represent. TCP keepalive
times are bounded by what Linux accepts for them instead (`MAX_KEEPALIVE_S`,
`MAX_KEEPALIVE_COUNT`).
"""

from __future__ import annotations

import math
from typing import Final

__all__ = [
    "DURATION_RULE",
    "MAX_DURATION_MS",
    "MAX_DURATION_S",
    "MAX_KEEPALIVE_COUNT",
    "MAX_KEEPALIVE_S",
    "is_duration_s",
]

MAX_DURATION_MS: Final = 2**31 - 1
MAX_DURATION_S: Final = MAX_DURATION_MS / 1000
#: TCP_KEEPIDLE / TCP_KEEPINTVL (seconds) and TCP_KEEPCNT maxima of Linux (`MAX_TCP_KEEP*`)
MAX_KEEPALIVE_S: Final = 32767
MAX_KEEPALIVE_COUNT: Final = 127
DURATION_RULE: Final = f"at most {MAX_DURATION_S} s (2^31−1 ms)"


def is_duration_s(value: object, *, zero: bool = False) -> bool:
    """A finite number of seconds in (0, MAX_DURATION_S], or [0, …] with `zero`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        seconds = float(value)
    except OverflowError:
        return False
    return math.isfinite(seconds) and (seconds >= 0 if zero else seconds > 0) \
        and seconds <= MAX_DURATION_S
