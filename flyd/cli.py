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
import orjson
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


class _JsonErrors(click.Command):
    """A command whose usage errors are JSON (`USAGE`, exit 2) when `--json` is given."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        as_json = "--json" in args
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            if not as_json:
                raise
            click.echo(orjson.dumps({"error": {"code": "USAGE",
                                               "message": exc.format_message()}}).decode())
            ctx.exit(EXIT_CONFIG)


@flyd_main.command("run", cls=_JsonErrors)
@click.option("--steps", type=int, default=600, show_default=True,
              help="Transitions to run (600 = 10 s of world time at 60 Hz).")
@click.option("--agents", help="Agent ids, bound to ports p1, p2, ... in order "
                               "(default fly-a,fly-b).")
@click.option("--mode", type=click.Choice(["process", "thread", "in-process", "inprocess"]),
              default="process", show_default=True, help="Execution mode of the workers.")
@click.option("--seed", type=int, help="Master seed; agents switch to derived seeds.")
@click.option("--dispatch", type=click.Choice(["concurrent", "sequential", "reversed"]),
              default="concurrent", show_default=True, help="Dispatch order.")
@click.option("--fault", "faults", multiple=True, metavar="SPEC",
              help="Fault injection (repeatable): WORKER.KNOB=VALUE[@STEP], kill:WORKER@STEP, "
                   "lose-advance-result@STEP.")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the behaviour trace as JSON lines.")
@click.option("--pace/--no-pace", default=False, help="Pace transitions at world time (60 Hz).")
@click.option("--socket", "socket_path", help="Router socket (default: cli.md §4.1).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@_global_options
def run_cmd(steps: int, agents: str | None, mode: str, seed: int | None, dispatch: str,
            faults: tuple[str, ...], trace: Path | None, pace: bool, socket_path: str | None,
            as_json: bool, config_file: Path | None, log_format: str | None, verbose: int,
            quiet: int) -> None:
    """Run one session to completion on this host and print a summary."""
    from flyd.run import RunOptions, parse_agents, run_session

    _setup_logging(log_format, verbose, quiet)
    opts = RunOptions(steps=steps, agents=None if agents is None else parse_agents(agents),
                      mode=mode, seed=seed, dispatch=dispatch, faults=faults, trace=trace,
                      pace=pace, socket=socket_path, as_json=as_json, config_file=config_file,
                      router_quiet=1 + quiet - verbose)
    sys.exit(uvloop.run(run_session(opts)))


@click.group()
def flyctl_main() -> None:
    """flyctl: inspect and steer running flyd nodes."""


def main() -> None:
    flyd_main()
