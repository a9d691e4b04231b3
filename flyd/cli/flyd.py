"""The `flyd` and `flyctl` command groups (cli.md).

Results go to stdout (human text, or one JSON object with `--json`); logs, notes and error lines
go to stderr, so `flyctl runs list | grep running` works. Exit codes follow design/cli.md §1:
0 success, 1 the work failed, 2 usage or configuration error, 3 timeout, 130 interrupted.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import NoReturn

import click
import orjson
import psycopg
import uvloop

from bus.router import Router, RouterStartError
from flyd import logs
from flyd.cli.common import (
    CtlCall,
    ctl_options,
    given_options,
    global_options,
    log_flags,
    plugin_path_option,
    run_spec_options,
    setup_logging,
    spec_file_options,
)
from flyd.config import Config, load_config, router_config
from flyd.errors import ConfigError
from flyd.pgtext import text_problem

EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_FATAL = 70
#: the options of `flyd run` and `flyctl runs submit` that override a `--spec` file when given
SPEC_OPTIONS = ("steps", "agents", "mode", "seed", "dispatch", "pace", "checkpoint_every")


@click.group()
def flyd_main() -> None:
    """flyd: reliable lockstep multi-agent simulation sessions."""


@flyd_main.command("router")
@click.option("--socket", "socket_path", help="Unix socket path to listen on.")
@click.option("--open", "open_policy", is_flag=True,
              help="Open policy: every client may do anything (development and tests only).")
@global_options
def router_cmd(socket_path: str | None, open_policy: bool, config_file: Path | None,
               log_format: str | None, verbose: int, quiet: int) -> None:
    """Run the bus router in the foreground until SIGTERM/SIGINT."""
    setup_logging(log_format, verbose, quiet)
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
@global_options
def demo_cmd(calls: int, as_json: bool, config_file: Path | None, log_format: str | None,
             verbose: int, quiet: int) -> None:
    """Bus demo: a router child process, an echo service, calls through it, a summary."""
    from flyd.cli.demo import run_demo

    setup_logging(log_format, verbose, quiet + 1)
    sys.exit(uvloop.run(run_demo(calls, as_json)))


class _JsonErrors(click.Command):
    """A command whose usage errors are JSON (`USAGE`, exit 2) when `--json` is given. A string
    argument or option that PostgreSQL text cannot hold (a NUL, or undecodable bytes, which
    arrive as lone surrogates: `flyd.pgtext`) is such an error, named, before anything runs."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        as_json = "--json" in args
        try:
            rest = super().parse_args(ctx, args)
            _check_text(self, ctx)
            return rest
        except click.UsageError as exc:
            if not as_json:
                raise
            click.echo(orjson.dumps({"error": {"code": "USAGE",
                                               "message": exc.format_message()}}).decode())
            ctx.exit(EXIT_CONFIG)


def _check_text(command: click.Command, ctx: click.Context) -> None:
    for param in command.params:
        value = ctx.params.get(param.name or "")
        for text in value if isinstance(value, tuple | list) else (value,):
            problem = text_problem(text) if isinstance(text, str) else None
            if problem is not None:
                raise click.BadParameter(problem, ctx=ctx, param=param)


@flyd_main.command("run", cls=_JsonErrors)
@click.option("--steps", type=int, default=600, show_default=True,
              help="Transitions to run (600 = 10 s of world time at 60 Hz).")
@click.option("--agents", help="Agent ids, bound to ports p1, p2, ... in order "
                               "(default fly-a,fly-b).")
@click.option("--mode", type=click.Choice(["process", "thread", "in-process", "inprocess"]),
              help="Execution mode of the workers (default [session] mode).")
@click.option("--seed", type=int, help="Master seed; agents switch to derived seeds.")
@click.option("--dispatch", type=click.Choice(["concurrent", "sequential", "reversed"]),
              help="Dispatch order (default [session] dispatch).")
@click.option("--fault", "faults", multiple=True, metavar="SPEC",
              help="Fault injection (repeatable): WORKER.KNOB=VALUE[@STEP], kill:WORKER@STEP, "
                   "lose-advance-result@STEP.")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the behaviour trace as JSON lines.")
@click.option("--record", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE.gif",
              help="Write the world's view as an animated GIF (extra flyd[pictures]).")
@click.option("--record-every", type=click.IntRange(min=1), default=1, show_default=True,
              metavar="K", help="With --record: one frame every K boundaries.")
@click.option("--plot", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE.png",
              help="Draw each agent's cumulative reward and the task's progress over "
                   "boundaries as a PNG (extra flyd[pictures]).")
@click.option("--pace/--no-pace", default=None,
              help="Pace transitions at world time, 60 Hz (default [session] pacing).")
@click.option("--checkpoint-every", type=int,
              help="Durable checkpoint cadence in steps (default [checkpoints] every_steps).")
@click.option("--socket", "socket_path",
              help="Router socket (default: the default socket when free, else a private "
                   "run-<pid>.sock next to it; docs/cli.md).")
@click.option("--dsn", help="PostgreSQL DSN (default: FLYD_DSN, [database] dsn, else an "
                            "embedded server under the state dir).")
@click.option("--state-dir", type=click.Path(path_type=Path), help="Node state directory.")
@click.option("--lease-ttl", type=float, help="Lease TTL in seconds (default 15).")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
@spec_file_options
@plugin_path_option
@global_options
def run_cmd(steps: int, agents: str | None, mode: str | None, seed: int | None,
            dispatch: str | None, faults: tuple[str, ...], trace: Path | None,
            record: Path | None, record_every: int, plot: Path | None, pace: bool | None,
            checkpoint_every: int | None, socket_path: str | None, dsn: str | None,
            state_dir: Path | None, lease_ttl: float | None, as_json: bool,
            spec_file: Path | None, model: str | None, model_config: str | None,
            world: str | None, world_config: str | None, plugin_paths: tuple[Path, ...],
            config_file: Path | None, log_format: str | None, verbose: int, quiet: int) -> None:
    """Run one session to completion on this host (through the queue) and print a summary."""
    from flyd.cli.run import RunOptions, parse_agents, run_session

    log = log_flags(log_format, verbose, quiet)
    opts = RunOptions(steps=steps, agents=None if agents is None else parse_agents(agents),
                      mode=mode, seed=seed, dispatch=dispatch, faults=faults, trace=trace,
                      record=record, record_every=record_every, plot=plot,
                      pace=pace, checkpoint_every=checkpoint_every, socket=socket_path,
                      dsn=dsn, state_dir=state_dir, lease_ttl=lease_ttl, as_json=as_json,
                      config_file=config_file, log=log, spec_file=spec_file, model=model,
                      model_config=model_config, world=world, world_config=world_config,
                      plugin_paths=plugin_paths, given=given_options(*SPEC_OPTIONS))
    sys.exit(uvloop.run(run_session(opts)))


@flyd_main.command("serve", cls=_JsonErrors)
@click.option("--dsn", help="PostgreSQL DSN (default: FLYD_DSN, [database] dsn, else an "
                            "embedded server under the state dir).")
@click.option("--socket", "socket_path",
              help="Router socket (default: FLYD_SOCKET, [bus] socket, else the per-user "
                   "default in docs/configuration.md).")
@click.option("--state-dir", type=click.Path(path_type=Path), help="Node state directory.")
@click.option("--node-name", help="Node name ([a-z0-9][a-z0-9-]{0,31}; default: host name).")
@click.option("--capacity", type=int, help="Runs held at once (default max(1, cpus // 4)).")
@click.option("--router/--no-router", default=None,
              help="Spawn the router as a child (default) or use one managed separately.")
@click.option("--lease-ttl", type=float, help="Lease TTL in seconds (default 15).")
@click.option("--metrics", metavar="ADDR",
              help="Serve Prometheus metrics at http://ADDR/metrics (HOST:PORT, or PORT on "
                   "127.0.0.1; default [node] metrics, else none; docs/operations.md).")
@click.option("--json", "as_json", is_flag=True, help="Errors as JSON on stdout.")
@click.option("--sim-clock", type=click.Path(path_type=Path), hidden=True)
@click.option("--time-scale", type=float, default=1.0, hidden=True)
@click.option("--clock-rate", type=float, default=1.0, hidden=True)
@plugin_path_option
@global_options
def serve_cmd(dsn: str | None, socket_path: str | None, state_dir: Path | None,
              node_name: str | None, capacity: int | None, router: bool | None,
              lease_ttl: float | None, metrics: str | None, as_json: bool,
              sim_clock: Path | None, time_scale: float, clock_rate: float,
              plugin_paths: tuple[Path, ...],
              config_file: Path | None,
              log_format: str | None, verbose: int, quiet: int) -> None:
    """Run the node service: claim, execute and finish runs from the queue until drained."""
    from flyd.cli.serve import ServeOptions, serve

    log = log_flags(log_format, verbose, quiet)
    opts = ServeOptions(config_file=config_file, dsn=dsn, socket=socket_path,
                        state_dir=state_dir, node_name=node_name, capacity=capacity,
                        router=router, lease_ttl=lease_ttl, as_json=as_json,
                        log=log, sim_clock=sim_clock,
                        time_scale=time_scale, clock_rate=clock_rate,
                        plugin_paths=plugin_paths, metrics=metrics)
    sys.exit(uvloop.run(serve(opts)))


def _json_error(as_json: bool, prefix: str, code: str, message: str,
                exit_code: int) -> NoReturn:
    """Report an error (JSON on stdout with `--json`, always a line on stderr) and exit."""
    click.echo(f"{prefix}: {message}", err=True)
    if as_json:
        click.echo(orjson.dumps({"error": {"code": code, "message": message}}).decode())
    sys.exit(exit_code)


def _load_cli_config(config_file: Path | None, log: logs.LogFlags,
                     flags: dict[str, object]) -> Config:
    """The effective configuration of a command, its logging applied; `-v`/`-q` shift the
    level, which `flyd config show` then shows as a flag."""
    flags = {**flags, "node.log_format": log.format}
    config = load_config(config_file, flags)
    settings = config.log_settings(log)
    settings.apply()
    if log.verbose or log.quiet:
        config = load_config(config_file, {**flags, "node.log_level": settings.level})
    return config


@flyd_main.group("db")
def db_group() -> None:
    """Database administration."""


@db_group.command("migrate", cls=_JsonErrors)
@click.option("--dsn", help="PostgreSQL DSN (default: FLYD_DSN, [database] dsn, else the "
                            "embedded server under the state dir).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
@global_options
def db_migrate_cmd(dsn: str | None, as_json: bool, config_file: Path | None,
                   log_format: str | None, verbose: int, quiet: int) -> None:
    """Apply the schema migrations and print the schema version."""
    from flyd.leases.migrate import MigrationError

    log = log_flags(log_format, verbose, quiet)
    try:
        config = _load_cli_config(config_file, log, {"database.dsn": dsn})
        version = uvloop.run(_migrate(config))
    except ConfigError as exc:
        _json_error(as_json, "flyd db migrate", exc.code, str(exc), EXIT_CONFIG)
    except MigrationError as exc:
        _json_error(as_json, "flyd db migrate", "CONFIG", str(exc), exc.exit_code)
    except psycopg.Error as exc:
        _json_error(as_json, "flyd db migrate", "CONFIG",
                    f"cannot migrate the database: {str(exc).strip()}", EXIT_CONFIG)
    if as_json:
        click.echo(orjson.dumps({"schemaVersion": version}).decode())
    else:
        click.echo(f"schema version {version}")


async def _migrate(config: Config) -> int:
    """Migrate the configured DSN, or the embedded server under the state dir."""
    from flyd.leases.embedded import EmbeddedPostgres
    from flyd.leases.migrate import migrate

    settings = config.settings
    if settings.database.dsn is not None:
        return await migrate(settings.database.dsn)
    embedded = EmbeddedPostgres()
    try:
        await embedded.start(settings.node.state_dir)
        return embedded.schema_version
    finally:
        await embedded.stop()


@flyd_main.group("config")
def config_group() -> None:
    """Configuration."""


@config_group.command("show", cls=_JsonErrors)
@click.option("--dsn", help="As `flyd serve --dsn`.")
@click.option("--socket", "socket_path", help="As `flyd serve --socket`.")
@click.option("--state-dir", help="As `flyd serve --state-dir`.")
@click.option("--node-name", help="As `flyd serve --node-name`.")
@click.option("--capacity", type=int, help="As `flyd serve --capacity`.")
@click.option("--router/--no-router", default=None, help="As `flyd serve --router`.")
@click.option("--lease-ttl", type=float, help="As `flyd serve --lease-ttl`.")
@click.option("--metrics", metavar="ADDR", help="As `flyd serve --metrics`.")
@click.option("--json", "as_json", is_flag=True, help="Print the configuration as JSON.")
@global_options
def config_show_cmd(dsn: str | None, socket_path: str | None, state_dir: str | None,
                    node_name: str | None, capacity: int | None, router: bool | None,
                    lease_ttl: float | None, metrics: str | None, as_json: bool,
                    config_file: Path | None, log_format: str | None, verbose: int,
                    quiet: int) -> None:
    """Print the effective configuration: every key with its value and source (`serve`'s
    flags are accepted, so the output is what `flyd serve` with them would use)."""
    log = log_flags(log_format, verbose, quiet)
    flags: dict[str, object] = {
        "database.dsn": dsn, "bus.socket": socket_path, "node.state_dir": state_dir,
        "node.name": node_name, "node.capacity": capacity, "node.router": router,
        "leases.ttl_s": lease_ttl, "node.metrics": metrics,
    }
    try:
        config = _load_cli_config(config_file, log, flags)
    except ConfigError as exc:
        _json_error(as_json, "flyd config show", exc.code, str(exc), EXIT_CONFIG)
    shown = config.show()
    if as_json:
        file = str(config.config_file) if config.config_file else None
        click.echo(orjson.dumps({"configFile": file, "settings": shown}).decode())
        return
    width = max(len(k) for k in shown)
    click.echo(f"# config file: {config.config_file or 'none'}")
    for key, entry in shown.items():
        value = orjson.dumps(entry["value"]).decode()
        click.echo(f"{key.ljust(width)} = {value} ({entry['source']})")


@click.group()
def flyctl_main() -> None:
    """flyctl: inspect and steer running flyd nodes."""


@flyctl_main.command("status", cls=_JsonErrors)
@ctl_options(node=True)
def ctl_status_cmd(call: CtlCall) -> None:
    """Router, nodes and per run its workers (the database view when no node answers)."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute("status", call.as_json, lambda: flyctl.status(call.options)))


@flyctl_main.command("kill", cls=_JsonErrors)
@click.argument("worker")
@click.option("--run", "run_id", type=click.IntRange(min=1), help="The run of the worker.")
@click.option("--signal", "signal_name", type=click.Choice(["KILL", "TERM"]), default="KILL",
              show_default=True, help="KILL: by force; TERM: Worker.Shutdown, then by force.")
@ctl_options(node=True)
def ctl_kill_cmd(worker: str, run_id: int | None, signal_name: str, call: CtlCall) -> None:
    """Stop one worker of a held run (`Control.Kill`); `AlreadyGone` exits 1."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute("kill", call.as_json,
                            lambda: flyctl.kill(call.options, worker, run_id, signal_name)))


@flyctl_main.command("drain", cls=_JsonErrors)
@ctl_options(node=True)
def ctl_drain_cmd(call: CtlCall) -> None:
    """Gracefully shut a node down (`Control.Drain`)."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute("drain", call.as_json, lambda: flyctl.drain(call.options)))


@flyctl_main.command("watch", cls=_JsonErrors)
@click.argument("run_id", metavar="[RUN]", required=False, type=click.IntRange(min=1))
@ctl_options(node=True)
def ctl_watch_cmd(run_id: int | None, call: CtlCall) -> None:
    """Follow a run live: a line per published boundary, then its final state (exit 0
    succeeded, 1 failed or cancelled)."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute("watch", call.as_json,
                            lambda: flyctl.watch(call.options, run_id, call.as_json)))


@flyctl_main.group("runs")
def ctl_runs_group() -> None:
    """The run queue."""


@ctl_runs_group.command("submit", cls=_JsonErrors)
@click.option("--steps", type=int, default=600, show_default=True, help="Transitions to run.")
@run_spec_options
@click.option("--key", help="Idempotency key: a second submit with it returns the same run.")
@click.option("--max-attempts", type=int, help="Grant attempts (default [leases] max_attempts).")
@spec_file_options
@ctl_options()
def ctl_runs_submit_cmd(steps: int, agents: str | None, mode: str | None, seed: int | None,
                        checkpoint_every: int | None, dispatch: str | None,
                        pace: bool | None, faults: tuple[str, ...], key: str | None,
                        max_attempts: int | None, spec_file: Path | None, model: str | None,
                        model_config: str | None, world: str | None,
                        world_config: str | None, call: CtlCall) -> None:
    """Build, validate and insert a run spec; prints its id."""
    from flyd.cli import flyctl
    from flyd.cli.run import RunOptions, parse_agents

    run = RunOptions(steps=steps, agents=None if agents is None else parse_agents(agents),
                     mode=mode, seed=seed, dispatch=dispatch, faults=faults, pace=pace,
                     checkpoint_every=checkpoint_every, spec_file=spec_file, model=model,
                     model_config=model_config, world=world, world_config=world_config,
                     given=given_options(*SPEC_OPTIONS))
    sys.exit(flyctl.execute("runs submit", call.as_json,
                            lambda: flyctl.runs_submit(call.options, run, key, max_attempts)))


@ctl_runs_group.command("list", cls=_JsonErrors)
@click.option("--state", type=click.Choice(["pending", "running", "succeeded", "failed",
                                            "cancelled"]), help="Only runs in this state.")
@ctl_options()
def ctl_runs_list_cmd(state: str | None, call: CtlCall) -> None:
    """Runs with state, lease epoch, attempts, owner, lease expiry and boundary."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute("runs list", call.as_json,
                            lambda: flyctl.runs_list(call.options, state)))


@ctl_runs_group.command("show", cls=_JsonErrors)
@click.argument("run_id", metavar="RUN", type=click.IntRange(min=1))
@ctl_options()
def ctl_runs_show_cmd(run_id: int, call: CtlCall) -> None:
    """One run: grants, checkpoints, effects, outcome; live phase and events from its holder."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute("runs show", call.as_json,
                            lambda: flyctl.runs_show(call.options, run_id)))


@ctl_runs_group.command("export", cls=_JsonErrors)
@click.argument("run_id", metavar="RUN", type=click.IntRange(min=1))
@click.option("-o", "out", default="-", show_default=True,
              type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              help="The .jsonl file to write; - for stdout.")
@ctl_options()
def ctl_runs_export_cmd(run_id: int, out: Path, call: CtlCall) -> None:
    """One JSON line per committed boundary: world time, rewards, events, progress."""
    from flyd.cli import flyctl

    target = None if str(out) == "-" else out
    sys.exit(flyctl.execute("runs export", call.as_json,
                            lambda: flyctl.runs_export(call.options, run_id, target)))


@ctl_runs_group.command("cancel", cls=_JsonErrors)
@click.argument("run_id", metavar="RUN", type=click.IntRange(min=1))
@ctl_options()
def ctl_runs_cancel_cmd(run_id: int, call: CtlCall) -> None:
    """Request cancellation of a run."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute("runs cancel", call.as_json,
                            lambda: flyctl.runs_cancel(call.options, run_id)))


@ctl_runs_group.command("requeue", cls=_JsonErrors)
@click.argument("run_id", metavar="RUN", type=click.IntRange(min=1))
@ctl_options()
def ctl_runs_requeue_cmd(run_id: int, call: CtlCall) -> None:
    """Put a failed run back to pending (logged in flyd.interventions)."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute("runs requeue", call.as_json,
                            lambda: flyctl.runs_requeue(call.options, run_id)))



@flyctl_main.group("checkpoints")
def ctl_checkpoints_group() -> None:
    """Durable checkpoints: list, export, import, verify."""


@ctl_checkpoints_group.command("list", cls=_JsonErrors)
@click.argument("run_id", metavar="RUN", type=click.IntRange(min=1))
@ctl_options()
def ctl_checkpoints_list_cmd(run_id: int, call: CtlCall) -> None:
    """A run's generations, newest first."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute("checkpoints list", call.as_json,
                            lambda: flyctl.checkpoints_list(call.options, run_id)))


@ctl_checkpoints_group.command("export", cls=_JsonErrors)
@click.argument("run_id", metavar="RUN", type=click.IntRange(min=1))
@click.option("--id", "checkpoint_id", help="The generation (default: the head).")
@click.option("-o", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The .flysess file to write.")
@ctl_options()
def ctl_checkpoints_export_cmd(run_id: int, checkpoint_id: str | None, out: Path,
                               call: CtlCall) -> None:
    """Write a generation (after its integrity checks) to a file."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute(
        "checkpoints export", call.as_json,
        lambda: flyctl.checkpoints_export(call.options, run_id, checkpoint_id, out)))


@ctl_checkpoints_group.command("import", cls=_JsonErrors)
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--steps", type=int, help="Total boundary target counted from 0 (above the "
              "imported boundary; default: the --spec file's, else 600).")
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False, path_type=Path),
              help="The run spec to start with (default: the checkpoint's composition); "
                   "refused when it cannot install the checkpoint.")
@run_spec_options
@click.option("--key", help="Idempotency key of the submitted run.")
@click.option("--max-attempts", type=int, help="Grant attempts (default [leases] max_attempts).")
@click.option("--trust", is_flag=True, help="Import a file with pickled payloads that this "
              "database did not write: restoring unpickles them, which runs any code in them.")
@ctl_options()
def ctl_checkpoints_import_cmd(file: Path, steps: int | None, spec_file: Path | None,
                               agents: str | None, mode: str | None,
                               seed: int | None, checkpoint_every: int | None,
                               dispatch: str | None, pace: bool | None,
                               faults: tuple[str, ...], key: str | None,
                               max_attempts: int | None, trust: bool, call: CtlCall) -> None:
    """Submit a new run that starts from the file's checkpoint, with the composition that
    wrote it (or --spec FILE, checked against the checkpoint)."""
    from flyd.cli import flyctl
    from flyd.cli.run import RunOptions, parse_agents

    run = RunOptions(steps=600 if steps is None else steps,
                     agents=None if agents is None else parse_agents(agents),
                     mode=mode, seed=seed, dispatch=dispatch, faults=faults, pace=pace,
                     checkpoint_every=checkpoint_every)
    sys.exit(flyctl.execute(
        "checkpoints import", call.as_json,
        lambda: flyctl.checkpoints_import(call.options, file, run, key, max_attempts,
                                          spec_file=spec_file,
                                          steps_given=steps is not None, trust=trust)))


@ctl_checkpoints_group.command("verify", cls=_JsonErrors)
@click.argument("file", required=False, type=click.Path(exists=True, dir_okay=False,
                                                        path_type=Path))
@click.option("--run", "run_id", type=click.IntRange(min=1), help="Verify a stored generation.")
@click.option("--id", "checkpoint_id", help="The stored generation (default: the head).")
@ctl_options()
def ctl_checkpoints_verify_cmd(file: Path | None, run_id: int | None,
                               checkpoint_id: str | None, call: CtlCall) -> None:
    """Check a .flysess file, or a stored generation (--run), without restoring it.

    A file gets the reader's checks (format, digests, sizes, compatibility); a stored
    generation also its integrity against the database. docs/state.md lists every check."""
    from flyd.cli import flyctl

    sys.exit(flyctl.execute(
        "checkpoints verify", call.as_json,
        lambda: flyctl.checkpoints_verify(call.options, file, run_id, checkpoint_id)))


def main() -> None:
    flyd_main()
