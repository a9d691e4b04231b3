"""One worker launch's settings and its command line (design/session.md §2.1, §7.5, §7.7).

Stable API (the launcher, `flyd/launcher.py`, builds on exactly this):

    (`Role`, "agent" | "environment", and `Faults` (design/session.md §4.9) come from
    workers.faults) AgentSettings(port_id, model="workers.synthetic:FakeBrain", model_config={},
                  tick=RationalNs(1000000, 1), warmup_ticks=10)
    EnvironmentSettings(ports, world="workers.synthetic:CounterArena", world_config={},
                        step=RationalNs(50000000, 3), observation_delay_steps=0)
    WorkerLaunch(socket, session_id, worker_id, incarnation_id, client_id, service,
                 supervisor, callers, threads, max_agents, settings,
                 faults=Faults(), parent_pid=None, log_format="json")
        .role                    "agent" when settings is AgentSettings, else "environment"
        .module                  "workers.agent" | "workers.environment" (for `python -m`)
        .to_argv() -> list[str]  the flags of design/session.md §7.7 (no interpreter, no module)
        .from_argv(argv, role=None) -> WorkerLaunch   (classmethod; raises LaunchArgsError)
        .command(python=sys.executable) -> list[str]  [python, "-m", module, *to_argv()]
    LaunchArgsError(ValueError)  a refused command line; `.exit_code == 2`
    build_parser(role) -> argparse.ArgumentParser   the entry points' parser (never exits)
    parse_worker_argv(role, argv) -> WorkerLaunch    what `python -m workers.<role>` runs
    thread_environment(threads) -> dict[str, str]    OMP/OPENBLAS/MKL/NUMEXPR_NUM_THREADS
    (design/session.md §2.1) die_with_parent(argv, **popen_kwargs) -> Popen   spawn armed with
    PR_SET_PDEATHSIG (design/session.md §7.5) arm_die_with_parent(parent_pid) -> None          the
    child's re-arm at the top of main() START_GATE = b"go\\n"                             the line
    the launcher writes to stdin REFUSED_LAUNCH = "worker.refused_launch"          the log event of
    a worker that cannot
                                                      start; its `error` field is the refusal's
                                                      wire `error` object, data included

Construction validates everything (`DomainError` `INVALID_ARGUMENT`/`none`), so a launch that
exists is one the worker accepts, and `from_argv(to_argv(x)) == x` for every launch.

Command line (design/session.md §7.7), in the order `to_argv` writes it:

    common  --socket PATH --session ID --worker ID --incarnation ID --client-id ID
            --service NAME --supervisor ID --callers ID,ID,... --threads N --max-agents N
            [--parent-pid PID] --log-format json|console [--media-inline-max-bytes N]
    agent   --port ID --model IMPORT --model-config JSON --tick NUM/DEN --warmup-ticks N
            [--prepare-delay-ms N[@K]] [--commit-delay-ms N[@K]] [--fail-commit-at-step K]
    env     --world IMPORT --world-config JSON --ports p1,p2 --step NUM/DEN
            --observation-delay-steps D [--advance-delay-ms N[@K]]
            [--omit-view-at-boundary B] [--stale-view-at-boundary B]
            [--truncated-view-at-boundary B] [--omit-audio-at-boundary B]
            [--overlapping-audio-at-boundary B]
    both    [--acknowledge-extra-id REQ] [--fail-capture] [--fail-stage-restore]
            [--fail-activate-restore]

Resolved ambiguities:
- The role is not a flag: the module (`workers.agent` / `workers.environment`) is. The entry
  points pass their role; `from_argv(argv)` without one infers it from `--model` (agent) or
  `--world` (environment). Another role's flags are unknown flags for a role's parser.
- A fault flag is written only when the knob is set (a `*_delay_ms` of None is not 0), so the
  round trip is exact; `--prepare-delay-ms` etc. are optional on the command line. `N@K` sets
  the delay and its `*_at_step`; an `*_at_step` without its delay is refused.
- `--media-inline-max-bytes` (0..2^30, `[session] media_inline_max_bytes`, topics.md
  §14.2) is written only when it is not the default 16384: media above it travel by reference.
- `--parent-pid` is written only when set (process mode); a worker given one re-arms
  die-with-parent and exits 1 when its parent is already someone else.
- JSON configs travel as canonical JSON (`workers.types.canonical.canonical`) and must be objects.
- Integers are canonical decimals (no sign, no leading zero); delays are 0..2^53−1 ms, steps
  and boundaries U64; `threads` and `max-agents` are 1..256 (`[session] max_agents` range).
- The supervisor may always call the worker (`Worker.Shutdown` is its call), whether or not it
  is listed in `--callers`; `--callers` needs at least one id.
- `--service` follows the bus's service-name grammar (`[a-z0-9_-]+(\\.[a-z0-9_-]+)*`).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NoReturn

from workers.faults import KNOBS, Faults, Role
from workers.types.canonical import canonical, parse_strict
from workers.types.domain import (
    U64_MAX,
    DomainError,
    parse_id,
    parse_request_id,
    short,
)
from workers.types.ticks import RationalNs

#: `[session] media_inline_max_bytes` (topics.md §14.2): blobs above it travel by reference
DEFAULT_MEDIA_INLINE_MAX_BYTES: Final = 16384
MAX_MEDIA_INLINE_MAX_BYTES: Final = 2**30

__all__ = [
    "CRASHED_EXIT",
    "DEFAULT_MEDIA_INLINE_MAX_BYTES",
    "DEFAULT_MODEL",
    "DEFAULT_STEP",
    "DEFAULT_TICK",
    "DEFAULT_WORLD",
    "MAX_MEDIA_INLINE_MAX_BYTES",
    "REFUSED_LAUNCH",
    "START_GATE",
    "THREAD_VARIABLES",
    "AgentSettings",
    "EnvironmentSettings",
    "LaunchArgsError",
    "LogFormat",
    "WorkerLaunch",
    "arm_die_with_parent",
    "build_parser",
    "die_with_parent",
    "libc_prctl",
    "parse_worker_argv",
    "thread_environment",
]

LogFormat = Literal["json", "console"]

DEFAULT_MODEL: Final = "workers.synthetic:FakeBrain"
DEFAULT_WORLD: Final = "workers.synthetic:CounterArena"
DEFAULT_TICK: Final = RationalNs(1_000_000, 1)
DEFAULT_STEP: Final = RationalNs(50_000_000, 3)
START_GATE: Final = b"go\n"
#: the structured log line a process worker writes before it exits for a refused start (its
#: model or world failed to import or to build): the launcher reads its `error` field (the wire
#: `error` object) to name the reason instead of only the exit code
REFUSED_LAUNCH: Final = "worker.refused_launch"
#: the exit code of a worker that raised outside its shell's own exit codes (EX_SOFTWARE): the
#: fork server's child and the launcher's thread body report it alike
CRASHED_EXIT: Final = 70
THREAD_VARIABLES: Final = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                           "NUMEXPR_NUM_THREADS")
MAX_THREADS: Final = 256
MAX_AGENTS_LIMIT: Final = 256
MAX_OBSERVATION_DELAY: Final = 8
MAX_DELAY_MS: Final = 2**53 - 1
MODULES: Final[dict[Role, str]] = {"agent": "workers.agent", "environment": "workers.environment"}

_IMPORT_PATH: Final = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*"
    r"(\.[A-Za-z_][A-Za-z0-9_]*)*")
_SERVICE: Final = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_DECIMAL: Final = re.compile(r"0|[1-9][0-9]*")
_RATIONAL: Final = re.compile(r"(0|[1-9][0-9]*)/([1-9][0-9]*)")


# --------------------------------------------------------------------------------------------
# validation helpers (DomainError INVALID_ARGUMENT / none)


def _int(value: Any, what: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise DomainError.invalid(f"{what} must be an integer in {low}..{high}; got "
                                  f"{short(value)}")
    return value


def _import_path(value: Any, what: str) -> str:
    if not isinstance(value, str) or _IMPORT_PATH.fullmatch(value) is None:
        raise DomainError.invalid(f"{what} must be an import path package.module:Class; got "
                                  f"{short(value)}")
    return value


def _config(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise DomainError.invalid(f"{what} must be a JSON object")
    plain = dict(value)
    canonical(plain)  # refuses what canonical JSON cannot carry
    return plain


def _positive(value: Any, what: str) -> RationalNs:
    if not isinstance(value, RationalNs) or value.is_zero():
        raise DomainError.invalid(f"{what} must be a RationalNs > 0; got {short(value)}")
    return value


# --------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class AgentSettings:
    """The agent role's settings (design/session.md §7.7 agent flags)."""

    port_id: str
    model: str = DEFAULT_MODEL
    model_config: Mapping[str, Any] = field(default_factory=dict)
    tick: RationalNs = DEFAULT_TICK
    warmup_ticks: int = 10

    def __post_init__(self) -> None:
        parse_id(self.port_id, "port")
        _import_path(self.model, "model")
        object.__setattr__(self, "model_config", _config(self.model_config, "model config"))
        _positive(self.tick, "tick")
        _int(self.warmup_ticks, "warmup ticks", 0, U64_MAX)


@dataclass(frozen=True)
class EnvironmentSettings:
    """The environment role's settings (design/session.md §7.7 environment flags)."""

    ports: tuple[str, ...]
    world: str = DEFAULT_WORLD
    world_config: Mapping[str, Any] = field(default_factory=dict)
    step: RationalNs = DEFAULT_STEP
    observation_delay_steps: int = 0

    def __post_init__(self) -> None:
        ports = tuple(self.ports)
        if not ports:
            raise DomainError.invalid("an environment needs at least one port")
        for port in ports:
            parse_id(port, "port")
        if len(set(ports)) != len(ports):
            raise DomainError.invalid(f"ports {list(ports)} list a port twice")
        object.__setattr__(self, "ports", ports)
        _import_path(self.world, "world")
        object.__setattr__(self, "world_config", _config(self.world_config, "world config"))
        _positive(self.step, "step")
        _int(self.observation_delay_steps, "observation delay steps", 0, MAX_OBSERVATION_DELAY)


Settings = AgentSettings | EnvironmentSettings


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything one worker incarnation is started with (design/session.md §2.1, §7.7)."""

    socket: str
    session_id: str
    worker_id: str
    incarnation_id: str
    client_id: str
    service: str
    supervisor: str
    callers: tuple[str, ...]
    threads: int
    max_agents: int
    settings: Settings
    faults: Faults = field(default_factory=Faults)
    parent_pid: int | None = None
    log_format: LogFormat = "json"
    #: transport, not behaviour: media above it travel by reference (topics.md §14.2)
    media_inline_max_bytes: int = DEFAULT_MEDIA_INLINE_MAX_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.socket, str) or not self.socket or "\0" in self.socket:
            raise DomainError.invalid("socket must be a non-empty path")
        parse_id(self.session_id, "session")
        parse_id(self.worker_id, "worker")
        parse_id(self.incarnation_id, "incarnation")
        parse_id(self.client_id, "client id")
        if not isinstance(self.service, str) or _SERVICE.fullmatch(self.service) is None:
            raise DomainError.invalid(f"service {short(self.service)} is not a bus service name")
        parse_id(self.supervisor, "supervisor")
        callers = tuple(self.callers)
        if not callers:
            raise DomainError.invalid("callers must name at least one client id")
        for caller in callers:
            parse_id(caller, "caller")
        object.__setattr__(self, "callers", callers)
        _int(self.threads, "threads", 1, MAX_THREADS)
        _int(self.max_agents, "max agents", 1, MAX_AGENTS_LIMIT)
        if not isinstance(self.settings, AgentSettings | EnvironmentSettings):
            raise DomainError.invalid("settings must be AgentSettings or EnvironmentSettings")
        if not isinstance(self.faults, Faults):
            raise DomainError.invalid("faults must be a Faults")
        _check_faults(self.faults, self.role)
        if self.parent_pid is not None:
            _int(self.parent_pid, "parent pid", 1, 2**31 - 1)
        if self.log_format not in ("json", "console"):
            raise DomainError.invalid(f"log format must be json or console; got "
                                      f"{short(self.log_format)}")
        _int(self.media_inline_max_bytes, "media inline max bytes", 0,
             MAX_MEDIA_INLINE_MAX_BYTES)

    @property
    def role(self) -> Role:
        return "agent" if isinstance(self.settings, AgentSettings) else "environment"

    @property
    def module(self) -> str:
        return MODULES[self.role]

    @property
    def plugin(self) -> str:
        """The import path of the launch's model or world."""
        settings = self.settings
        return settings.model if isinstance(settings, AgentSettings) else settings.world

    @property
    def agent(self) -> AgentSettings:
        if not isinstance(self.settings, AgentSettings):
            raise DomainError.invalid(f"{self.worker_id} is not an agent")
        return self.settings

    @property
    def environment(self) -> EnvironmentSettings:
        if not isinstance(self.settings, EnvironmentSettings):
            raise DomainError.invalid(f"{self.worker_id} is not an environment")
        return self.settings

    def allowed_callers(self) -> frozenset[str]:
        """The client ids the shell serves: `callers` plus the supervisor."""
        return frozenset(self.callers) | {self.supervisor}

    def command(self, python: str = sys.executable) -> list[str]:
        """`[python, "-m", module, *to_argv()]` (design/session.md §7.5)."""
        return [python, "-m", self.module, *self.to_argv()]

    def to_argv(self) -> list[str]:
        argv = [
            "--socket", self.socket,
            "--session", self.session_id,
            "--worker", self.worker_id,
            "--incarnation", self.incarnation_id,
            "--client-id", self.client_id,
            "--service", self.service,
            "--supervisor", self.supervisor,
            "--callers", ",".join(self.callers),
            "--threads", str(self.threads),
            "--max-agents", str(self.max_agents),
        ]
        if self.parent_pid is not None:
            argv += ["--parent-pid", str(self.parent_pid)]
        argv += ["--log-format", self.log_format]
        if self.media_inline_max_bytes != DEFAULT_MEDIA_INLINE_MAX_BYTES:
            argv += ["--media-inline-max-bytes", str(self.media_inline_max_bytes)]
        s = self.settings
        if isinstance(s, AgentSettings):
            argv += [
                "--port", s.port_id,
                "--model", s.model,
                "--model-config", canonical(dict(s.model_config)).decode("utf-8"),
                "--tick", f"{s.tick.numerator}/{s.tick.denominator}",
                "--warmup-ticks", str(s.warmup_ticks),
            ]
        else:
            argv += [
                "--world", s.world,
                "--world-config", canonical(dict(s.world_config)).decode("utf-8"),
                "--ports", ",".join(s.ports),
                "--step", f"{s.step.numerator}/{s.step.denominator}",
                "--observation-delay-steps", str(s.observation_delay_steps),
            ]
        argv += _fault_argv(self.faults, self.role)
        return argv

    @classmethod
    def from_argv(cls, argv: Sequence[str], role: Role | None = None) -> WorkerLaunch:
        """Parse a command line written by `to_argv` (or a person); `LaunchArgsError` else."""
        argv = list(argv)
        if role is None:
            has_model = "--model" in argv or any(a.startswith("--model=") for a in argv)
            has_world = "--world" in argv or any(a.startswith("--world=") for a in argv)
            if has_model == has_world:
                raise LaunchArgsError("cannot tell the role: give exactly one of --model "
                                      "(agent) and --world (environment)")
            role = "agent" if has_model else "environment"
        return parse_worker_argv(role, argv)


def _check_faults(faults: Faults, role: Role) -> None:
    foreign = faults.foreign_fields(role)
    if foreign:
        raise DomainError.invalid(f"an {role} has no fault knob {', '.join(foreign)}")
    for knob in KNOBS.values():
        value = getattr(faults, knob.name)
        if knob.kind == "delay":
            assert knob.at_step is not None
            at = getattr(faults, knob.at_step)
            if value is not None:
                _int(value, knob.name, 0, MAX_DELAY_MS)
            if at is not None:
                if value is None:
                    raise DomainError.invalid(f"{knob.at_step} is set without {knob.name}")
                _int(at, knob.at_step, 0, U64_MAX)
        elif knob.kind in ("step", "boundary"):
            if value is not None:
                _int(value, knob.name, 0, U64_MAX)
        elif knob.kind == "request_id":
            if value is not None:
                parse_request_id(value, knob.name)
        elif not isinstance(value, bool):
            raise DomainError.invalid(f"{knob.name} must be true or false")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fault_argv(faults: Faults, role: Role) -> list[str]:
    out: list[str] = []
    for knob in KNOBS.values():
        if role not in knob.roles:
            continue
        value = getattr(faults, knob.name)
        if knob.kind == "flag":
            if value:
                out.append(_flag(knob.name))
            continue
        if value is None:
            continue
        text = str(value)
        if knob.kind == "delay" and knob.at_step is not None:
            at = getattr(faults, knob.at_step)
            if at is not None:
                text += f"@{at}"
        out += [_flag(knob.name), text]
    return out


# --------------------------------------------------------------------------------------------
# the parser


class LaunchArgsError(ValueError):
    """A refused worker command line; the entry points exit with `exit_code` (2)."""

    exit_code: Final = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Parser(argparse.ArgumentParser):
    """An argparse parser that raises `LaunchArgsError` instead of exiting."""

    def error(self, message: str) -> NoReturn:
        raise LaunchArgsError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise LaunchArgsError(message or f"{self.prog}: exit {status}")


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a value parser so a DomainError reads as an argparse type error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except DomainError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None

    convert.__name__ = getattr(parse, "__name__", "value").lstrip("_")
    return convert


def _decimal(text: str, what: str, low: int, high: int) -> int:
    if _DECIMAL.fullmatch(text) is None:
        raise DomainError.invalid(f"{what} must be a canonical decimal; got {short(text)}")
    return _int(int(text), what, low, high)


def _u64(text: str) -> int:
    return _decimal(text, "step", 0, U64_MAX)


def _pid(text: str) -> int:
    return _decimal(text, "pid", 1, 2**31 - 1)


def _count(text: str) -> int:
    return _decimal(text, "count", 1, MAX_THREADS)


def _delay_steps(text: str) -> int:
    return _decimal(text, "observation delay steps", 0, MAX_OBSERVATION_DELAY)


def _media_threshold(text: str) -> int:
    return _decimal(text, "media inline max bytes", 0, MAX_MEDIA_INLINE_MAX_BYTES)


def _warmup(text: str) -> int:
    return _decimal(text, "warmup ticks", 0, U64_MAX)


def _id(text: str) -> str:
    return parse_id(text, "id")


def _ids(text: str) -> tuple[str, ...]:
    return tuple(parse_id(part, "id") for part in text.split(","))


def _request_id(text: str) -> str:
    return parse_request_id(text, "request id")


def _rational(text: str) -> RationalNs:
    match = _RATIONAL.fullmatch(text)
    if match is None:
        raise DomainError.invalid(f"expected NUM/DEN; got {short(text)}")
    return _positive(RationalNs(int(match.group(1)), int(match.group(2))), "duration")


def _json_object(text: str) -> dict[str, Any]:
    value = parse_strict(text.encode("utf-8"))
    if not isinstance(value, dict):
        raise DomainError.invalid("expected a JSON object")
    return value


def _delay(text: str) -> tuple[int, int | None]:
    ms, sep, at = text.partition("@")
    delay = _decimal(ms, "delay ms", 0, MAX_DELAY_MS)
    return delay, (_u64(at) if sep else None)


def _import(text: str) -> str:
    return _import_path(text, "import path")


def build_parser(role: Role) -> argparse.ArgumentParser:
    """The parser of `python -m workers.<role>`: it raises `LaunchArgsError`, never exits."""
    p = _Parser(prog=f"python -m {MODULES[role]}", add_help=False, allow_abbrev=False)
    p.add_argument("--socket", required=True)
    p.add_argument("--session", required=True, type=_arg(_id))
    p.add_argument("--worker", required=True, type=_arg(_id))
    p.add_argument("--incarnation", required=True, type=_arg(_id))
    p.add_argument("--client-id", required=True, type=_arg(_id))
    p.add_argument("--service", required=True)
    p.add_argument("--supervisor", required=True, type=_arg(_id))
    p.add_argument("--callers", required=True, type=_arg(_ids))
    p.add_argument("--threads", required=True, type=_arg(_count))
    p.add_argument("--max-agents", required=True, type=_arg(_count))
    p.add_argument("--parent-pid", type=_arg(_pid))
    p.add_argument("--log-format", choices=("json", "console"), default="json")
    p.add_argument("--media-inline-max-bytes", type=_arg(_media_threshold),
                   default=DEFAULT_MEDIA_INLINE_MAX_BYTES)
    if role == "agent":
        p.add_argument("--port", required=True, type=_arg(_id))
        p.add_argument("--model", required=True, type=_arg(_import))
        p.add_argument("--model-config", required=True, type=_arg(_json_object))
        p.add_argument("--tick", required=True, type=_arg(_rational))
        p.add_argument("--warmup-ticks", required=True, type=_arg(_warmup))
    else:
        p.add_argument("--world", required=True, type=_arg(_import))
        p.add_argument("--world-config", required=True, type=_arg(_json_object))
        p.add_argument("--ports", required=True, type=_arg(_ids))
        p.add_argument("--step", required=True, type=_arg(_rational))
        p.add_argument("--observation-delay-steps", required=True, type=_arg(_delay_steps))
    for knob in KNOBS.values():
        if role not in knob.roles:
            continue
        dest = f"fault_{knob.name}"
        if knob.kind == "flag":
            p.add_argument(_flag(knob.name), dest=dest, action="store_true")
        elif knob.kind == "delay":
            p.add_argument(_flag(knob.name), dest=dest, type=_arg(_delay))
        elif knob.kind == "request_id":
            p.add_argument(_flag(knob.name), dest=dest, type=_arg(_request_id))
        else:
            p.add_argument(_flag(knob.name), dest=dest, type=_arg(_u64))
    return p


def parse_worker_argv(role: Role, argv: Sequence[str]) -> WorkerLaunch:
    """The `WorkerLaunch` of a role's command line; `LaunchArgsError` for anything refused."""
    ns = build_parser(role).parse_args(list(argv))
    faults: dict[str, Any] = {}
    for knob in KNOBS.values():
        if role not in knob.roles:
            continue
        value = getattr(ns, f"fault_{knob.name}")
        if knob.kind == "delay":
            assert knob.at_step is not None
            if value is not None:
                faults[knob.name], faults[knob.at_step] = value
        else:
            faults[knob.name] = value
    settings: Settings
    try:
        if role == "agent":
            settings = AgentSettings(port_id=ns.port, model=ns.model,
                                     model_config=ns.model_config, tick=ns.tick,
                                     warmup_ticks=ns.warmup_ticks)
        else:
            settings = EnvironmentSettings(ports=ns.ports, world=ns.world,
                                           world_config=ns.world_config, step=ns.step,
                                           observation_delay_steps=ns.observation_delay_steps)
        return WorkerLaunch(
            socket=ns.socket, session_id=ns.session, worker_id=ns.worker,
            incarnation_id=ns.incarnation, client_id=ns.client_id, service=ns.service,
            supervisor=ns.supervisor, callers=ns.callers, threads=ns.threads,
            max_agents=ns.max_agents, settings=settings, faults=Faults(**faults),
            parent_pid=ns.parent_pid, log_format=ns.log_format,
            media_inline_max_bytes=ns.media_inline_max_bytes)
    except DomainError as exc:
        raise LaunchArgsError(f"python -m {MODULES[role]}: {exc.message}") from None


# --------------------------------------------------------------------------------------------
# process helpers


def thread_environment(threads: int) -> dict[str, str]:
    """The child environment's thread variables (design/session.md §2.1), each set to `threads`."""
    _int(threads, "threads", 1, MAX_THREADS)
    return dict.fromkeys(THREAD_VARIABLES, str(threads))


PR_SET_PDEATHSIG: Final = 1


@functools.cache
def libc_prctl() -> Callable[..., int]:
    """libc `prctl`, resolved before any fork (Linux only). From the process's own symbols
    (`dlopen(NULL)`), not `ctypes.util.find_library`: that runs `ldconfig -p` in a child
    process, and a worker killed while that child ran left it an orphan zombie in the
    worker's process group until init reaped it."""
    fn: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    return fn


def arm_die_with_parent(parent_pid: int | None) -> None:
    """In the child: `prctl(PR_SET_PDEATHSIG, SIGKILL)`, then exit 1 when the parent is
    already not `parent_pid` (it died before the signal was armed). None does nothing."""
    if parent_pid is None:
        return
    prctl = libc_prctl()
    if prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def die_with_parent(argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """`Popen(argv, **popen_kwargs)` whose child gets SIGKILL when the spawning thread dies.

    libc `prctl` is resolved before the fork; the child calls it before exec and `_exit(1)`s
    when `getppid()` is no longer the pid captured before the fork. The death signal follows
    the forking *thread*: spawn from a thread that lives as long as the parent.
    """
    if "preexec_fn" in popen_kwargs:
        raise ValueError("die_with_parent installs its own preexec_fn")
    prctl = libc_prctl()
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def arm() -> None:  # runs in the child between fork and exec
        if prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(1)

    return subprocess.Popen(list(argv), preexec_fn=arm, **popen_kwargs)
