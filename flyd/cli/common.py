"""Options and logging set-up shared by the commands of `flyd` and `flyctl` (design/cli.md §1, §7).

Why: every `flyctl` command takes the same connection, output and logging options, and the
run-spec commands the same spec options; declaring them once keeps their names, defaults and
help texts one rule, and hands a command one `CtlCall` instead of eight loose parameters.
This module is light on purpose (click and the logging flags only): `flyd --help` must not
import the node.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from flyd import logs

__all__ = [
    "CtlCall",
    "CtlOptions",
    "ctl_options",
    "given_options",
    "global_options",
    "log_flags",
    "plugin_path_option",
    "run_spec_options",
    "setup_logging",
    "spec_file_options",
]


@dataclass(frozen=True)
class CtlOptions:
    """The options every `flyctl` command takes."""

    config_file: Path | None = None
    socket: str | None = None
    dsn: str | None = None
    node: str | None = None
    log: logs.LogFlags = field(default_factory=logs.LogFlags)


@dataclass(frozen=True)
class CtlCall:
    """What a `flyctl` command gets of the shared options: its `CtlOptions` and `--json`."""

    options: CtlOptions
    as_json: bool


def setup_logging(log_format: str | None, verbose: int, quiet: int) -> None:
    """Logging from the flags and `FLYD_LOG_FORMAT` alone: quiet on a terminal (the console
    renderer starts at warning, `-v` info, `-vv` debug), so a progress bar is not buried; JSON
    lines (a pipe, the journal) start at info. A command that reads the configuration then
    applies its `[node] log_format` / `log_level` (`Config.log_settings`)."""
    fmt = log_format or logs.default_format()
    logs.configure(fmt, logs.shift_level(logs.default_level(fmt),  # type: ignore[arg-type]
                                         verbose, quiet))


def log_flags(log_format: str | None, verbose: int, quiet: int,
              quiet_default: int = 0) -> logs.LogFlags:
    """A command's logging flags (`--log-format` only when given on the command line: from
    `FLYD_LOG_FORMAT` it is the environment's), logging set up from them until the command
    has read its configuration."""
    ctx = click.get_current_context()
    from_cli = ctx.get_parameter_source("log_format") == click.core.ParameterSource.COMMANDLINE
    setup_logging(log_format, verbose, quiet + quiet_default)
    return logs.LogFlags(log_format if from_cli else None,  # type: ignore[arg-type]
                         verbose, quiet, quiet_default)


def global_options(fn: click.decorators.FC) -> click.decorators.FC:
    """`--config`, `--log-format`, `-v` and `-q`, which every command takes."""
    fn = click.option("--config", "config_file", type=click.Path(path_type=Path),
                      envvar="FLYD_CONFIG", help="TOML configuration file.")(fn)
    fn = click.option("--log-format", type=click.Choice(["json", "console"]),
                      envvar="FLYD_LOG_FORMAT", help="Log renderer (default: by TTY).")(fn)
    fn = click.option("-v", "verbose", count=True,
                      help="More log output (repeatable; a terminal starts at warnings: -v info, "
                           "-vv debug).")(fn)
    fn = click.option("-q", "quiet", count=True, help="Less log output (repeatable).")(fn)
    return fn


def ctl_options(*, node: bool = False) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """`--socket`, `--dsn`, `--json` and the global options (design/cli.md §7), plus `--node` for
    the commands that address one node; the command receives them as `call: CtlCall`."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(command)
        def wrapper(*args: Any, socket_path: str | None, dsn: str | None, as_json: bool,
                    config_file: Path | None, log_format: str | None, verbose: int, quiet: int,
                    node: str | None = None, **kwargs: Any) -> None:
            options = CtlOptions(config_file, socket_path, dsn, node,
                                 log=log_flags(log_format, verbose, quiet, quiet_default=1))
            command(*args, call=CtlCall(options, as_json), **kwargs)

        fn: Callable[..., None] = wrapper
        fn = click.option("--socket", "socket_path",
                          help="Router socket (default: FLYD_SOCKET, [bus] socket, else the "
                               "per-user default in docs/configuration.md).")(fn)
        fn = click.option("--dsn", help="PostgreSQL DSN (default: FLYD_DSN, [database] dsn, "
                                        "else a running embedded server under the state "
                                        "dir).")(fn)
        fn = click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")(fn)
        fn = global_options(fn)
        if node:
            fn = click.option("--node", help="Node id or a unique prefix of one.")(fn)
        return fn

    return decorate


def run_spec_options(fn: click.decorators.FC) -> click.decorators.FC:
    """The run-spec options `flyctl runs submit` and `flyctl checkpoints import` share (their
    `--steps` differ in meaning, so each declares its own)."""
    for option in reversed([
        click.option("--agents", help="Agent ids, bound to ports p1, p2, ... in order."),
        click.option("--mode", type=click.Choice(["process", "thread", "in-process",
                                                  "inprocess"]),
                     help="Execution mode of the workers (default [session] mode)."),
        click.option("--seed", type=int, help="Master seed; agents switch to derived seeds."),
        click.option("--checkpoint-every", type=int,
                     help="Durable checkpoint cadence in steps (default [checkpoints] "
                          "every_steps)."),
        click.option("--dispatch", type=click.Choice(["concurrent", "sequential", "reversed"]),
                     help="Dispatch order (default [session] dispatch)."),
        click.option("--pace/--no-pace", default=None,
                     help="Pace transitions at world time (default [session] pacing)."),
        click.option("--fault", "faults", multiple=True, metavar="SPEC",
                     help="Fault injection (repeatable), as for `flyd run`."),
    ]):
        fn = option(fn)
    return fn


def spec_file_options(fn: click.decorators.FC) -> click.decorators.FC:
    """`--spec FILE` and the composition shortcuts of `flyd run` and `flyctl runs submit`
    (README, "Your own run spec")."""
    for option in reversed([
        click.option("--spec", "spec_file", type=click.Path(dir_okay=False, path_type=Path),
                     help="Run spec JSON file (design/session.md §4.10; a partial document is "
                          "completed with the defaults). Options given on the command line "
                          "override it."),
        click.option("--model", metavar="IMPORT:PATH",
                     help="Every agent's model class, e.g. mypkg.brain:Brain."),
        click.option("--model-config", metavar="JSON",
                     help="Every agent's modelConfig (a JSON object; replaces the spec's)."),
        click.option("--world", metavar="IMPORT:PATH",
                     help="The world class, e.g. mypkg.world:PointWorld."),
        click.option("--world-config", metavar="JSON",
                     help="The world's config (a JSON object; replaces the spec's)."),
    ]):
        fn = option(fn)
    return fn


def plugin_path_option(fn: click.decorators.FC) -> click.decorators.FC:
    """`--plugin-path DIR` (repeatable): import roots added to `[plugins] paths`."""
    return click.option("--plugin-path", "plugin_paths", multiple=True,
                        type=click.Path(file_okay=False, path_type=Path),
                        help="Extra import root for model, world and task packages "
                             "(repeatable; added to [plugins] paths).")(fn)


def given_options(*names: str) -> frozenset[str]:
    """Which of the current command's parameters were given on the command line, not left to
    their defaults (a `--spec` file keeps what the user did not override)."""
    ctx = click.get_current_context()
    given = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    return frozenset(name for name in names if ctx.get_parameter_source(name) in given)
