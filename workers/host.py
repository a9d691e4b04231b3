"""An agent host: up to K agents in one worker process (`[session] agents_per_process`).

Why: in process mode each agent is an OS process, and every request wakes one of them on caches
the others left cold; a host runs several agents in one process and one event loop, so a step's
requests to its agents are served by one wake-up. Nothing on the wire changes: each hosted agent
keeps its own bus connection, client id, incarnation, service and result cache, exactly as if it
ran alone (`workers.shell.WorkerShell` per agent).

A host is one failure domain: the agents share the process, so a crash, a SIGKILL (a `kill:`
fault of any of them) or an exit ends them all, and the launcher treats them as failed together
(docs/launcher.md, "Agent hosts").

API:

    HostLaunch(launches)            the agents of one host, each a `WorkerLaunch` of role agent
        .role == "host"; .module == "workers.host"
        .to_argv() -> list[str]     K, then each agent's argv prefixed by its length
        .command(python) -> list[str]
    parse_host_argv(argv) -> HostLaunch          raises LaunchArgsError
    main(argv) -> int               `python -m workers.host <argv>`: the exit code of the first
                                    agent that ended otherwise than 0, else 0

The command line is length-prefixed, not separated by a marker, so no value an agent's argv can
carry (a model config is one argument) is ever mistaken for a boundary.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import structlog

from workers.agent import AgentEndpoint
from workers.bodies import start_endpoint
from workers.launch import (
    REFUSED_LAUNCH,
    LaunchArgsError,
    WorkerLaunch,
    arm_die_with_parent,
    parse_worker_argv,
)
from workers.main import configure_logging, read_start_gate
from workers.shell import EXIT_ARGS, EXIT_GATE, WorkerShell
from workers.types.domain import DomainError

__all__ = ["HOST_MODULE", "HOST_ROLE", "HostLaunch", "main", "parse_host_argv"]

HOST_ROLE: Final = "host"
HOST_MODULE: Final = "workers.host"

log = structlog.get_logger("workers.host")


@dataclass(frozen=True, slots=True)
class HostLaunch:
    """The agents one host process runs; every launch is an agent's, with one parent pid and
    one log format (the launcher builds them together)."""

    launches: tuple[WorkerLaunch, ...]

    def __post_init__(self) -> None:
        if not self.launches:
            raise LaunchArgsError("a host needs at least one agent")
        for launch in self.launches:
            if launch.role != "agent":
                raise LaunchArgsError(f"{launch.worker_id} is an {launch.role}; a host runs "
                                      "agents only")
        first = self.launches[0]
        for launch in self.launches[1:]:
            if (launch.parent_pid, launch.log_format) != (first.parent_pid, first.log_format):
                raise LaunchArgsError("the agents of one host share the parent pid and the "
                                      "log format")

    @property
    def role(self) -> str:
        return HOST_ROLE

    @property
    def module(self) -> str:
        return HOST_MODULE

    @property
    def worker_ids(self) -> list[str]:
        return [launch.worker_id for launch in self.launches]

    def to_argv(self) -> list[str]:
        argv = [str(len(self.launches))]
        for launch in self.launches:
            own = launch.to_argv()
            argv += [str(len(own)), *own]
        return argv

    def command(self, python: str = sys.executable) -> list[str]:
        return [python, "-m", HOST_MODULE, *self.to_argv()]


def _count(argv: Sequence[str], at: int, what: str) -> int:
    if at >= len(argv) or not argv[at].isdigit():
        raise LaunchArgsError(f"python -m {HOST_MODULE}: expected the {what} at argument {at}")
    return int(argv[at])


def parse_host_argv(argv: Sequence[str]) -> HostLaunch:
    """The inverse of `HostLaunch.to_argv`; each agent's argv is parsed as `workers.agent`'s."""
    count = _count(argv, 0, "number of agents")
    at, launches = 1, []
    for index in range(count):
        length = _count(argv, at, f"length of agent {index}'s arguments")
        part = argv[at + 1:at + 1 + length]
        if len(part) != length:
            raise LaunchArgsError(f"python -m {HOST_MODULE}: agent {index}'s arguments end "
                                  "early")
        launches.append(parse_worker_argv("agent", part))
        at += 1 + length
    if at != len(argv):
        raise LaunchArgsError(f"python -m {HOST_MODULE}: {len(argv) - at} arguments after the "
                              f"{count} agents")
    return HostLaunch(tuple(launches))


async def _serve(shells: list[WorkerShell]) -> int:
    """Every hosted agent's shell until each has ended; the first code other than 0 wins."""
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(shell.run(), name=f"host-{shell.launch.worker_id}")
                 for shell in shells]
    codes = [task.result() for task in tasks]
    return next((code for code in codes if code != 0), 0)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m workers.host …`: parse, arm die-with-parent, wait for the gate, build every
    agent's endpoint (a refusal of any ends the host, naming that agent), run them."""
    try:
        host = parse_host_argv(list(sys.argv[1:] if argv is None else argv))
    except LaunchArgsError as exc:
        print(exc.message, file=sys.stderr)
        return EXIT_ARGS
    first = host.launches[0]
    arm_die_with_parent(first.parent_pid)
    configure_logging(first.log_format)
    if not read_start_gate():
        log.error("worker.start_gate_closed", worker_id=",".join(host.worker_ids))
        return EXIT_GATE
    shells = []
    for launch in host.launches:
        try:
            endpoint = start_endpoint(launch, AgentEndpoint)
        except DomainError as exc:
            log.error(REFUSED_LAUNCH, worker_id=launch.worker_id, message=exc.message,
                      error=exc.to_json())
            return EXIT_ARGS
        shells.append(WorkerShell(launch, endpoint))
    import uvloop

    code: int = uvloop.run(_serve(shells))
    return code


if __name__ == "__main__":
    sys.exit(main())
