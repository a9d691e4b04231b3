"""The process body of a worker: `python -m workers.agent|environment …`.

Why apart from the shell: it owns what only a worker process does (arming die-with-parent,
the start gate on stdin, logging on stderr, the exit codes) and nothing imports it but the role
entry points, the agent host and the fork server.

Rules:
- The start gate waits at most `GATE_TIMEOUT_S` for its line `go`.
- A process worker whose endpoint cannot be built (its model or world does not import, lacks
  the class, or raises while it is built) logs `REFUSED_LAUNCH` with the refusal's wire `error`
  object (its `PluginFault` as `data`) and exits 2, so the launcher names the reason rather
  than the exit code alone.
- Logging in process mode is configured here (JSON lines or console on stderr), not through
`flyd.logs`, because `workers` never imports `flyd`.
"""

from __future__ import annotations

import contextlib
import select
import sys
from collections.abc import Sequence
from typing import Any, Final

import structlog

from workers.bodies import EndpointFactory, start_endpoint
from workers.faults import Role
from workers.launch import (
    REFUSED_LAUNCH,
    START_GATE,
    LaunchArgsError,
    arm_die_with_parent,
    build_parser,
    parse_worker_argv,
)
from workers.shell import EXIT_ARGS, EXIT_GATE, WorkerShell
from workers.types.domain import DomainError

__all__ = ["GATE_TIMEOUT_S", "configure_logging", "main", "read_start_gate"]

log = structlog.get_logger("workers.main")

GATE_TIMEOUT_S: Final = 60.0


def configure_logging(fmt: str) -> None:
    """structlog to stderr: JSON lines (`json`) or the console renderer."""
    import orjson

    def dumps(obj: object, default: object = None) -> str:
        return orjson.dumps(obj, default=str).decode()

    renderer: Any = (structlog.processors.JSONRenderer(serializer=dumps) if fmt == "json"
                     else structlog.dev.ConsoleRenderer(colors=False))
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
                    structlog.processors.format_exc_info, renderer],
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def read_start_gate(stream: Any = None, timeout: float = GATE_TIMEOUT_S) -> bool:
    """True when the first stdin line is exactly `go` (within `timeout`)."""
    stream = sys.stdin.buffer if stream is None else stream
    with contextlib.suppress(OSError, ValueError):
        ready, _, _ = select.select([stream], [], [], timeout)
        if not ready:
            return False
    line: bytes = stream.readline()
    return line == START_GATE


def main(role: Role, argv: Sequence[str] | None = None, *,
         endpoint_factory: EndpointFactory) -> int:
    """`python -m workers.agent|environment …` (design/session.md §7.5): exit 0/1/2/3/4 as
    documented."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args in (["--help"], ["-h"]):
        build_parser(role).print_help()
        return 0
    try:
        launch = parse_worker_argv(role, args)
    except LaunchArgsError as exc:
        print(exc.message, file=sys.stderr)
        return EXIT_ARGS
    arm_die_with_parent(launch.parent_pid)
    configure_logging(launch.log_format)
    if not read_start_gate():
        log.error("worker.start_gate_closed", worker_id=launch.worker_id)
        return EXIT_GATE
    try:
        endpoint = start_endpoint(launch, endpoint_factory)
    except DomainError as exc:
        log.error(REFUSED_LAUNCH, worker_id=launch.worker_id, message=exc.message,
                  error=exc.to_json())
        return EXIT_ARGS
    import uvloop

    async def body() -> int:
        return await WorkerShell(launch, endpoint).run()

    code: int = uvloop.run(body())
    return code
