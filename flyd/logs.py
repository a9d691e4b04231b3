"""structlog configuration, once per process (design/cli.md §9).

JSON lines (orjson renderer) when stderr is not a TTY or the format is forced to json; the
console renderer otherwise. Every line carries `event`, `level` and `ts`. Payload bytes are
never passed to a logger anywhere in flyd, so no renderer needs to scrub them.

The format and level come from the configuration (`[node] log_format` / `log_level`,
`FLYD_LOG_FORMAT` / `FLYD_LOG_LEVEL`, `--log-format`; `flyd.config.Config.log_settings`):
flags beat the environment, which beats the file, which beats the defaults. A level given
explicitly is the base that `-v` / `-q` shift; without one the base is `warning` for the
console renderer (a terminal sees its progress bar and warnings) and `info` for JSON lines.
Until a command has read its configuration, the flags and `FLYD_LOG_FORMAT` alone decide.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
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
    """`-v` / `-q` move the level one step each (design/cli.md §1)."""
    index = LEVELS.index(base) - verbose + quiet
    return LEVELS[max(0, min(len(LEVELS) - 1, index))]


def default_level(fmt: LogFormat) -> str:
    """The level without an explicit one: a terminal's console starts at warning, so a progress
    bar is not buried; JSON lines (a pipe, the journal) keep their info events."""
    return "warning" if fmt == "console" else "info"


@dataclass(frozen=True, slots=True)
class LogFlags:
    """A command line's `--log-format` (None unless given there), `-v` and `-q` counts, and how
    many steps quieter than a node the command's default level is (`flyctl`: one)."""

    format: LogFormat | None = None
    verbose: int = 0
    quiet: int = 0
    quiet_default: int = 0


@dataclass(frozen=True, slots=True)
class LogSettings:
    """A process's renderer and level, and how many steps quieter than `info` its router child
    logs (`flyd router -q`/`-v`; the child writes JSON, which the node forwards)."""

    format: LogFormat
    level: str
    router_quiet: int

    @classmethod
    def resolve(cls, fmt: LogFormat, level: str, explicit: bool, flags: LogFlags) -> LogSettings:
        """An explicit `level` is the base that `-v` / `-q` shift; a default one is first moved
        `flags.quiet_default` steps. The router child logs one step below an explicit level,
        else one step below `info`, then `-v` / `-q` shift it."""
        base = level if explicit else shift_level(level, 0, flags.quiet_default)
        router = shift_level(level if explicit else "info", flags.verbose, flags.quiet + 1)
        return cls(fmt, shift_level(base, flags.verbose, flags.quiet),
                   LEVELS.index(router) - LEVELS.index("info"))

    def apply(self) -> None:
        configure(self.format, self.level)
