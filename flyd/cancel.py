"""Retry loops stop when their task was cancelled, even if the cancellation was absorbed.

Why: a retry loop catches what one attempt may raise and tries again after a pause. On Python
3.11 a cancellation can be absorbed on its way out of an attempt (a connection closed on cancel
that raises its own error, an `asyncio.timeout` whose deadline passes in the same iteration),
and the loop then goes on retrying for a task its owner cancelled: a lost lease's checkpoint
writer went on retrying its read for seconds, past the kill bound of design/distribution.md §5.5, so
its scope ended late. `Task.cancelling()` still counts the request, so every retry loop asks
`raise_if_cancelled()` before its pause.
"""

from __future__ import annotations

import asyncio

__all__ = ["raise_if_cancelled"]


def raise_if_cancelled() -> None:
    """Raise CancelledError when the current task has a cancellation request outstanding."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
