"""structlog configuration, once per process (cli.md §9).

JSON lines (orjson renderer) when stderr is not a TTY or the format is forced to json; the
console renderer otherwise. Every line carries `event`, `level` and `ts`. Payload bytes are
never passed to a logger anywhere in flyd, so no renderer needs to scrub them.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Literal

import orjson
import structlog

LogFormat = Literal["json", "console"]
LEVELS = ("debug", "info", "warning", "error")

_configured = False


def default_format() -> LogFormat:
    env = os.environ.get("FLYD_LOG_FORMAT")
    if env in ("json", "console"):
        return env  # type: ignore[return-value]
    return "console" if sys.stderr.isatty() else "json"


def _orjson_dumps(obj: object, default: object = None) -> str:
    return orjson.dumps(obj, default=str).decode()


def configure(fmt: LogFormat | None = None, level: str | None = None) -> None:
    """Configure structlog for this process; later calls only change the level and format."""
    global _configured
    fmt = fmt or default_format()
    level = (level or os.environ.get("FLYD_LOG_LEVEL") or "info").lower()
    if level not in LEVELS:
        level = "info"
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer(serializer=_orjson_dumps)
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper())
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _configured = True


def shift_level(base: str, verbose: int, quiet: int) -> str:
    """`-v` / `-q` move the level one step each (cli.md §1)."""
    index = LEVELS.index(base) - verbose + quiet
    return LEVELS[max(0, min(len(LEVELS) - 1, index))]
