"""The `flyd` and `flyctl` command groups (cli.md).

Human text and logs go to stderr; `--json` output goes to stdout. Exit codes follow cli.md §1:
0 success, 1 the work failed, 2 usage or configuration error, 3 timeout, 130 interrupted.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

import click
import uvloop

from bus.router import Router, RouterStartError
from flyd import logs
from flyd.config import ConfigError, router_config

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_FATAL = 70


def _setup_logging(log_format: str | None, verbose: int, quiet: int) -> None:
    base = "info"
    logs.configure(log_format, logs.shift_level(base, verbose, quiet))  # type: ignore[arg-type]


def _global_options(fn: click.decorators.FC) -> click.decorators.FC:
    fn = click.option("--config", "config_file", type=click.Path(path_type=Path),
                      envvar="FLYD_CONFIG", help="TOML configuration file.")(fn)
    fn = click.option("--log-format", type=click.Choice(["json", "console"]),
                      envvar="FLYD_LOG_FORMAT", help="Log renderer (default: by TTY).")(fn)
    fn = click.option("-v", "verbose", count=True, help="More log output (repeatable).")(fn)
    fn = click.option("-q", "quiet", count=True, help="Less log output (repeatable).")(fn)
    return fn


@click.group()
def flyd_main() -> None:
    """flyd: reliable lockstep multi-agent simulation sessions."""


@flyd_main.command("router")
@click.option("--socket", "socket_path", help="Unix socket path to listen on.")
@click.option("--open", "open_policy", is_flag=True,
              help="Open policy: every client may do anything (development and tests only).")
@_global_options
def router_cmd(socket_path: str | None, open_policy: bool, config_file: Path | None,
               log_format: str | None, verbose: int, quiet: int) -> None:
    """Run the bus router in the foreground until SIGTERM/SIGINT."""
    _setup_logging(log_format, verbose, quiet)
    try:
        config = router_config(config_file, socket_path, open_policy)
    except ConfigError as exc:
        click.echo(f"flyd router: {exc}", err=True)
        sys.exit(EXIT_CONFIG)
    sys.exit(uvloop.run(_serve_router(config)))


async def _serve_router(config: object) -> int:
    from bus.router import RouterConfig

    assert isinstance(config, RouterConfig)
    router = Router(config)
    try:
        await router.start()
    except RouterStartError as exc:
        click.echo(f"flyd router: {exc}", err=True)
        return EXIT_CONFIG
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, router.request_stop)
    try:
        await router.serve_forever()
    except Exception:
        return EXIT_FATAL
    return 0


@flyd_main.command("demo")
@click.option("--calls", default=500, show_default=True, help="Number of calls to make.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@_global_options
def demo_cmd(calls: int, as_json: bool, config_file: Path | None, log_format: str | None,
             verbose: int, quiet: int) -> None:
    """Bus demo: a router child process, an echo service, calls through it, a summary."""
    from flyd.demo import run_demo

    _setup_logging(log_format, verbose, quiet + 1)
    sys.exit(uvloop.run(run_demo(calls, as_json)))


@click.group()
def flyctl_main() -> None:
    """flyctl: inspect and steer running flyd nodes."""


def main() -> None:
    flyd_main()
