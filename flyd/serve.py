"""`flyd serve`: the node service (cli.md §5; distribution.md §5).

Why: a host joins the shared queue by running this. It resolves the configuration (defaults <
file < environment < flags), starts the node (`flyd.node.NodeProcess`), registers it, and works
through the queue until a drain (SIGTERM, SIGINT) ends it with exit 0: it claims runs while its
capacity and thread budget allow, executes them, renews their leases and finishes them. A run
whose spec carries `exclusiveToSubmitter: true` belongs to the `flyd run` that submitted it and
is never claimed here.

Errors before serving (bad configuration, unreachable DSN, a router that does not come up) exit
2 with code `CONFIG`, as JSON on stdout under `--json`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg
import structlog

from flyd.config import ConfigError, load_config
from flyd.identities import new_node_id
from flyd.leases.migrate import MigrationError
from flyd.leases.store import StoreError
from flyd.node import NodeProcess, NodeSetup, NodeStartError
from flyd.router_child import RouterStartError

__all__ = ["ServeOptions", "serve"]

log = structlog.get_logger("flyd.serve")

EXIT_CONFIG = 2


@dataclass(frozen=True)
class ServeOptions:
    config_file: Path | None = None
    dsn: str | None = None
    socket: str | None = None
    state_dir: Path | None = None
    node_name: str | None = None
    capacity: int | None = None
    router: bool | None = None
    lease_ttl: float | None = None
    as_json: bool = False
    router_quiet: int = 1
    sim_clock: Path | None = None
    time_scale: float = 1.0
    clock_rate: float = 1.0

    def flags(self) -> dict[str, Any]:
        return {"database.dsn": self.dsn, "bus.socket": self.socket,
                "node.state_dir": self.state_dir, "node.name": self.node_name,
                "node.capacity": self.capacity, "node.router": self.router,
                "leases.ttl_s": self.lease_ttl}


def _error(opts: ServeOptions, message: str) -> int:
    print(f"flyd serve: {message}", file=sys.stderr)
    if opts.as_json:
        sys.stdout.write(orjson.dumps({"error": {"code": "CONFIG", "message": message}})
                         .decode() + "\n")
    return EXIT_CONFIG


async def serve(opts: ServeOptions) -> int:
    """Run the node until it is drained; returns the exit code."""
    try:
        config = load_config(opts.config_file, flags=opts.flags())
    except ConfigError as exc:
        return _error(opts, str(exc))
    name = str(config.value("node", "name"))
    setup = NodeSetup(
        config=config, node_id=new_node_id(name), node_name=name,
        socket=str(config.value("bus", "socket")),
        state_dir=Path(str(config.value("node", "state_dir"))),
        capacity=int(config.value("node", "capacity")),
        threads=int(config.value("node", "threads")),
        router=bool(config.value("node", "router")), router_quiet=opts.router_quiet,
        sim_clock=opts.sim_clock, time_scale=opts.time_scale, clock_rate=opts.clock_rate)
    node = NodeProcess(setup)
    try:
        try:
            await node.start()
        except (NodeStartError, RouterStartError, ConfigError, MigrationError, StoreError,
                psycopg.Error, OSError) as exc:
            return _error(opts, getattr(exc, "message", None) or str(exc))
        log.info("serve.started", node=setup.node_id, socket=setup.socket,
                 capacity=setup.capacity, threads=setup.threads)
        code = await node.serve()
        log.info("serve.stopped", node=setup.node_id, code=code)
        return code
    finally:
        await node.close()
