"""`flyd run`: one session on this host, start to finish (cli.md §4), without a database yet.

Why: `flyd run` is the main job (the README's quick start). It wires, in production code, what
`tests/session/harness.py` wires for tests: a router child process, the node connection, a
launcher, the workers in the chosen execution mode and a coordinator, then reaps everything and
prints the §4.2 summary.

Sequence: build and validate the run spec from the options (exit 2, `USAGE`, naming the JSON
path or the fault spec) → pick the socket (§4.1) → write the router's TOML (the `[bus]` section
of `--config`, plus the default policy of session.md §7.2 with `pid` = this process on the
`node.*` entry unless the file sets `[bus.policy]`) → spawn `flyd router` through
`flyd.spawn.ChildProcess` (die-with-parent, own process group, log lines forwarded) → connect as
`node.<node_id>` → `Launcher.open` + `launch_composition` → coordinator bootstrap and
`--steps` transitions under `launcher.supervise` → reap the workers (`reap_all`), close the
launcher and the clients, SIGTERM the router (SIGKILL after 5 s) → summary.

Decisions (where cli.md is silent or this stage has no database):
- No database, no leases, no checkpoints yet: `--checkpoint-every`, `--dsn`, `--state-dir` and
  `--lease-ttl` are not accepted (they would have no truthful meaning). The summary reports
  `run: null` (no queue row exists), `checkpoints: 0`, `recoveries: 0`, `epochs: ["e1"]`; any
  failure ends the run `failed` (exit 1) with the diagnosis in `failures` (no recovery).
- The spec carries `exclusiveToSubmitter: true`, as a submitted one will.
- A bad option that makes the spec invalid (e.g. `--steps 0`, a bad agent id, too many agents)
  is `USAGE` (exit 2) with the message `run spec <path>: <reason>`; a malformed `--fault` is
  `USAGE` naming the spec. The JSON error keeps exactly the `{error: {code, message}}` shape.
- The router's `[bus.limits]` are raised to cli.md §5.1's floors for capacity 1 and
  `max_agents` 4 (`maxClients` 15, `maxServices` 6, `maxActiveCallsPerClient` 8) where the file
  sets less; the defaults are above them already.
- `--config`: only its `[bus]` section is used (socket, limits, policy, group, uids); other
  sections are accepted by name and not interpreted yet. The socket follows flag >
  `FLYD_SOCKET` > `[bus] socket` > §4.1's choice; a given one is used as is.
- The node name is `FLYD_NODE_NAME` or the host name (cli.md §2.2); an invalid one exits 2
  (`CONFIG`).
- Thread budget: `[node] threads` default `max(cpus, 4)`, raised to the spec's thread need,
  since `flyd run` holds exactly this one run.
- `failures` lists the failure that ended the run: `{detail, participant, code, mutation,
  message}`; a failed launch has detail `launch`.
- `workers` lists the launched workers (as launched, before any kill): `workerId`, `role`,
  `incarnationId`, `pid` (the node's own pid in thread and in-process modes), `threads`.
- `wallSeconds` is the whole command (router start to teardown); `stepsPerSecond` is
  `advances` over the stepping time only (from `Ready(0)` to the last committed boundary), so
  it does not depend on how long the workers took to start.
- `worldProgress` is the world's `progressCounter` (`Worker.Status`) read before the reap, null
  when the world cannot answer; `counter` is the task's progress counter.
- `behaviourDigest` = `digest_of` of the committed behaviour records rebased onto `e1` (the
  records of a failed run up to its last committed boundary).
- `--trace PATH` writes the committed behaviour records (canonical JSON, one line each), also
  for a failed run; the file is created (truncated) before anything starts, so an unwritable
  path is `USAGE` (exit 2).
- Human summary and progress go to stderr (cli.md §1); with `--json` the summary is the only
  stdout output.
- Progress: on a TTY a one-line bar on stderr, redrawn at most every 0.1 s; otherwise a
  `run.progress` log line every 5 s (step, steps, steps_per_s, epoch, recoveries).
- SIGINT: the first stops at the next committed boundary, the run ends `cancelled`, everything is
  reaped, the summary is printed, exit 130; a second SIGINT, or `DRAIN_S` (20 s) without
  reaching a boundary, abandons the step at once, exit 130. SIGTERM abandons at once too, exit 143.
  Nothing survives in any case (the router and worker processes are reaped; they also carry
  die-with-parent against a SIGKILL of `flyd run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket as socketlib
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson
import structlog

from bus.client import BusClient, connect
from bus.errors import BusError
from bus.policy import Policy
from flyd.budget import ThreadBudget
from flyd.config import ConfigError, default_socket, load_toml, router_config
from flyd.coordinator import Coordinator, Deadlines, DispatchOrder, Injections
from flyd.fence import SessionFailure
from flyd.health import HealthPolicy
from flyd.identities import SessionNames, SessionTags, new_node_id, node_client_id
from flyd.launcher import ExecutionMode, LaunchedWorker, Launcher, connect_expected
from flyd.runspec import DEFAULT_MAX_AGENTS, FaultSpecError, RunSpec, RunSpecError
from flyd.spawn import ChildProcess
from flyd.trace import EpochRebase
from workers.canonical import canonical, digest_of
from workers.domain import DomainError
from workers.shell import load_plugin
from workers.synthetic.executor import IdentityExecutor

__all__ = ["RunOptions", "RunUsageError", "build_spec", "choose_socket", "default_node_name",
           "required_limits", "router_toml", "run_session"]

log = structlog.get_logger("flyd.run")

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130
EXIT_TERMINATED: Final = 143
EPOCH: Final = "e1"
ROUTER_START_S: Final = 15.0
ROUTER_STOP_S: Final = 5.0
REAP_S: Final = 10.0
DRAIN_S: Final = 20.0
PROGRESS_LOG_S: Final = 5.0
BAR_REDRAW_S: Final = 0.1
_NODE_NAME: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")


class RunUsageError(Exception):
    """A usage or configuration error (exit 2): `code` is `USAGE` or `CONFIG`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class RunOptions:
    steps: int = 600
    agents: tuple[str, ...] | None = None
    mode: str = "process"
    seed: int | None = None
    dispatch: str = "concurrent"
    faults: tuple[str, ...] = ()
    trace: Path | None = None
    pace: bool = False
    socket: str | None = None
    as_json: bool = False
    config_file: Path | None = None
    router_quiet: int = 1


# --------------------------------------------------------------------------------------------
# spec, socket, router configuration (pure or nearly)


def build_spec(opts: RunOptions) -> RunSpec:
    """The validated run spec of the options (cli.md §4 seeds); `RunUsageError` otherwise."""
    doc: dict[str, Any] = {
        "steps": str(opts.steps) if opts.steps >= 0 else opts.steps,
        "mode": "in-process" if opts.mode == "inprocess" else opts.mode,
        "dispatch": opts.dispatch,
        "pacing": "realtime" if opts.pace else "off",
        "exclusiveToSubmitter": True,
    }
    if opts.seed is not None:
        doc["seed"] = str(opts.seed) if opts.seed >= 0 else opts.seed
    if opts.agents is not None or opts.seed is not None:
        ids = opts.agents if opts.agents is not None else ("fly-a", "fly-b")
        doc["agents"] = [{"agentId": a, "portId": f"p{i + 1}", "seed": None}
                         for i, a in enumerate(ids)]
    try:
        spec = RunSpec.validate(doc, max_agents=DEFAULT_MAX_AGENTS, check_imports=True)
    except RunSpecError as exc:
        raise RunUsageError("USAGE", exc.message) from None
    if opts.faults:
        try:
            spec = spec.with_faults(list(opts.faults))
        except FaultSpecError as exc:
            raise RunUsageError("USAGE", exc.message) from None
    return spec


def _router_answers(path: str) -> bool:
    """True when something accepts a connection on `path`."""
    probe = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def choose_socket(forced: str | None) -> tuple[str, bool]:
    """cli.md §4.1: `(path, private)`; the default socket unless a router answers there, then
    `run-<pid>.sock` beside it; a forced path is used as given."""
    if forced:
        return forced, False
    default = default_socket()
    if not _router_answers(default):
        return default, False
    return os.path.join(os.path.dirname(default), f"run-{os.getpid()}.sock"), True


def default_node_name() -> str:
    """`FLYD_NODE_NAME`, else the host name mapped as cli.md §2.2 says."""
    env = os.environ.get("FLYD_NODE_NAME")
    if env is not None:
        if _NODE_NAME.fullmatch(env) is None:
            raise RunUsageError("CONFIG", f"FLYD_NODE_NAME {env!r} is not a node name "
                                          "([a-z0-9][a-z0-9-]{0,31})")
        return env
    name = re.sub(r"[^a-z0-9-]", "-", socketlib.gethostname().lower()).lstrip("-")[:32]
    return name or "node"


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else orjson.dumps(key).decode()


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return orjson.dumps(value).decode()
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to the router's configuration")


def _toml_table(prefix: str, table: Mapping[str, Any], out: list[str]) -> None:
    out.append(f"[{prefix}]")
    subtables: list[tuple[str, Mapping[str, Any]]] = []
    arrays: list[tuple[str, list[Mapping[str, Any]]]] = []
    for key, value in table.items():
        if isinstance(value, Mapping):
            subtables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
            arrays.append((key, value))
        else:
            out.append(f"{_toml_key(key)} = {_toml_value(value)}")
    for key, sub in subtables:
        _toml_table(f"{prefix}.{_toml_key(key)}", sub, out)
    for key, items in arrays:
        for item in items:
            out.append(f"[[{prefix}.{_toml_key(key)}]]")
            for k, v in item.items():
                out.append(f"{_toml_key(k)} = {_toml_value(v)}")


def _policy_table(policy: Policy) -> dict[str, Any]:
    clients: list[dict[str, Any]] = []
    for entry in policy.entries:
        item: dict[str, Any] = {"id": entry.id}
        for kind in ("register", "call", "expect", "delegate"):
            patterns = list(getattr(entry, kind))
            if patterns:
                item[kind] = patterns
        if entry.require_expect:
            item["requireExpect"] = True
        if entry.pid is not None:
            item["pid"] = entry.pid
        clients.append(item)
    return {"mode": policy.mode, "client": clients}


def required_limits(capacity: int = 1, max_agents: int = DEFAULT_MAX_AGENTS) -> dict[str, int]:
    """cli.md §5.1: the `[bus.limits]` floors a node needs (snake_case keys)."""
    return {"max_clients": capacity * (max_agents + 3) + 8,
            "max_services": capacity * (max_agents + 1) + 1,
            "max_active_calls_per_client": 2 * max_agents}


def router_toml(bus: Mapping[str, Any], node_pid: int) -> str:
    """The router child's configuration: `bus` (the `[bus]` table of `--config`, socket
    dropped: the socket is a flag) with `[bus.limits]` raised to `required_limits()` where a
    configured value is lower, plus the default policy with the node's pid (session.md §7.2)
    unless `bus` sets a policy."""
    table = {k: v for k, v in bus.items() if k != "socket"}
    limits = dict(table.get("limits", {}))
    for key, floor in required_limits().items():
        value = limits.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value < floor:
            log.info("run.limit_raised", key=f"[bus.limits] {key}", configured=value,
                     used=floor)
            limits[key] = floor
    if limits:
        table["limits"] = limits
    if "policy" not in table:
        table["policy"] = _policy_table(Policy.default(node_pid))
    lines: list[str] = []
    _toml_table("bus", table, lines)
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# progress


class Progress:
    """A bar on a TTY, else a `run.progress` log line every 5 s (cli.md §4)."""

    def __init__(self, total: int, tty: bool) -> None:
        self.total = total
        self.tty = tty
        self.done = 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self._task: asyncio.Task[None] | None = None

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        if not self.tty:
            self._task = asyncio.get_running_loop().create_task(self._log_every())

    async def _log_every(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_LOG_S)
            log.info("run.progress", step=self.done, steps=self.total,
                     steps_per_s=round(self.rate(), 1), epoch=EPOCH, recoveries=0)

    def update(self, done: int) -> None:
        self.done = done
        if not self.tty:
            return
        now = time.monotonic()
        if done < self.total and now - self._drawn < BAR_REDRAW_S:
            return
        self._drawn = now
        width = 30
        filled = width * done // max(1, self.total)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r[{bar}] {done}/{self.total} steps  {self.rate():.1f} steps/s  "
                         f"epoch {EPOCH}  recoveries 0 ")
        sys.stderr.flush()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.tty and self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


# --------------------------------------------------------------------------------------------
# the run


@dataclass
class _Outcome:
    state: str = "failed"
    failure: dict[str, Any] | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)
    world_progress: str | None = None
    step_seconds: float = 0.0


def _failure_json(failure: SessionFailure) -> dict[str, Any]:
    return {"detail": failure.detail, "participant": failure.participant,
            "code": str(failure.code), "mutation": str(failure.mutation),
            "message": failure.message}


def _worker_json(w: LaunchedWorker) -> dict[str, Any]:
    return {"workerId": w.worker_id, "role": w.identity.role,
            "incarnationId": w.identity.incarnation_id,
            "pid": w.pid if w.pid is not None else os.getpid(),
            "threads": w.identity.worker_threads}


class _Signals:
    """SIGINT: first → stop at the next boundary; second → abandon. SIGTERM → abandon."""

    def __init__(self, main: asyncio.Task[Any]) -> None:
        self.main = main
        self.cancel_requested = asyncio.Event()
        self.exit_code: int | None = None
        self._loop = asyncio.get_running_loop()
        self._drain: asyncio.TimerHandle | None = None

    def install(self) -> None:
        self._loop.add_signal_handler(signal.SIGINT, self._sigint)
        self._loop.add_signal_handler(signal.SIGTERM, self._sigterm)

    def remove(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.remove_signal_handler(sig)
        if self._drain is not None:
            self._drain.cancel()

    def _sigint(self) -> None:
        if self.exit_code is None:
            self.exit_code = EXIT_INTERRUPTED
            self.cancel_requested.set()
            log.warning("run.interrupted", detail="stopping at the next committed boundary; "
                                                  "press Ctrl-C again to abandon at once")
            self._drain = self._loop.call_later(DRAIN_S, self._abandon)
            return
        self._abandon()

    def _sigterm(self) -> None:
        self.exit_code = EXIT_TERMINATED
        self._abandon()

    def _abandon(self) -> None:
        self.cancel_requested.set()
        self.main.cancel()


class _Session:
    """Everything `flyd run` starts, owned for teardown."""

    def __init__(self, opts: RunOptions, spec: RunSpec) -> None:
        self.opts = opts
        self.spec = spec
        self.directory = tempfile.mkdtemp(prefix="flyd-run-")
        self.socket = ""
        self.router: ChildProcess | None = None
        self.node: BusClient | None = None
        self.launcher: Launcher | None = None
        self.coordinator_client: BusClient | None = None
        self.coordinator: Coordinator | None = None

    # -------------------------------------------------------------------- router

    async def start_router(self, socket: str, bus: Mapping[str, Any]) -> None:
        self.socket = socket
        config = Path(self.directory) / "router.toml"
        config.write_text(router_toml(bus, os.getpid()))
        env = {**os.environ, "FLYD_LOG_FORMAT": "json"}
        env.pop("FLYD_SOCKET", None)
        level = self.opts.router_quiet
        flags = ["-q"] * level if level > 0 else ["-v"] * -level
        self.router = await ChildProcess.spawn(
            [sys.executable, "-m", "flyd", "router", "--socket", socket, "--config",
             str(config), *flags], env=env, fields={"component": "router"})
        deadline = time.monotonic() + ROUTER_START_S
        while True:
            if self.router.exited.done():
                raise RunUsageError("CONFIG", f"the router on {socket} exited with code "
                                              f"{self.router.exited.result()}")
            if await asyncio.to_thread(_router_answers, socket):
                return
            if time.monotonic() > deadline:
                raise RunUsageError("CONFIG", f"the router did not accept on {socket} within "
                                              f"{ROUTER_START_S:g}s")
            await asyncio.sleep(0.02)

    async def stop_router(self) -> None:
        router, self.router = self.router, None
        if router is None:
            return
        if not router.exited.done():
            with contextlib.suppress(ProcessLookupError):
                os.kill(router.pid, signal.SIGTERM)
            await router.wait(ROUTER_STOP_S)
        await router.close(ROUTER_STOP_S)

    # -------------------------------------------------------------------- teardown

    async def teardown(self) -> None:
        """Reap the workers, close the clients, stop the router; every step bounded."""
        if self.launcher is not None:
            launcher, self.launcher = self.launcher, None
            with contextlib.suppress(Exception):
                async with asyncio.timeout(REAP_S):
                    await launcher.reap_all("run-ended")
            launcher.kill_process_groups()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(REAP_S):
                    await launcher.close()
        for attr in ("coordinator_client", "node"):
            client: BusClient | None = getattr(self, attr)
            setattr(self, attr, None)
            if client is not None:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2.0):
                        await client.close()
        await self.stop_router()
        shutil.rmtree(self.directory, ignore_errors=True)


async def run_session(opts: RunOptions) -> int:
    """`flyd run`; returns the exit code (prints the summary or the error)."""
    try:
        spec = build_spec(opts)
        bus: Mapping[str, Any] = {}
        if opts.config_file is not None:
            bus = load_toml(opts.config_file).get("bus", {})
            router_config(opts.config_file, opts.socket)  # validates [bus], names the key
        node_id = new_node_id(default_node_name())
        if opts.trace is not None:
            try:
                opts.trace.write_bytes(b"")
            except OSError as exc:
                raise RunUsageError("USAGE", f"--trace {opts.trace}: cannot write: "
                                             f"{exc.strerror}") from None
    except ConfigError as exc:
        return _error(opts, "CONFIG", str(exc))
    except RunUsageError as exc:
        return _error(opts, exc.code, exc.message)
    main = asyncio.current_task()
    assert main is not None
    signals = _Signals(main)
    signals.install()
    session = _Session(opts, spec)
    outcome = _Outcome()
    started = time.monotonic()
    try:
        try:
            file_socket = bus.get("socket")
            socket, private = choose_socket(opts.socket or os.environ.get("FLYD_SOCKET")
                                            or (file_socket if isinstance(file_socket, str)
                                                else None))
            if private:
                print(f"flyd run: a router answers on {default_socket()}; using the private "
                      f"socket {socket}", file=sys.stderr)
            else:
                print(f"flyd run: router socket {socket}", file=sys.stderr)
            log.info("run.socket", socket=socket, private=private, node=node_id)
            await session.start_router(socket, bus)
            await _execute(session, node_id, outcome, signals)
        except RunUsageError as exc:
            return _error(opts, exc.code, exc.message)
        except asyncio.CancelledError:
            if signals.exit_code is None:
                raise
            outcome.state = "cancelled"
            main.uncancel()
        finally:
            coordinator = session.coordinator
            await _read_world(session, outcome)
            with contextlib.suppress(asyncio.CancelledError):
                await session.teardown()
    finally:
        signals.remove()
    wall = time.monotonic() - started
    summary = _summary(spec, coordinator, outcome, wall)
    if opts.trace is not None and coordinator is not None:
        _write_trace(opts.trace, coordinator)
    _print_summary(opts, summary)
    if signals.exit_code is not None:
        return signals.exit_code
    return EXIT_OK if outcome.state == "succeeded" else EXIT_FAILED


async def _start_session(session: _Session, node_id: str, outcome: _Outcome) -> Coordinator:
    """Launcher, workers, coordinator client and coordinator (not bootstrapped)."""
    spec = session.spec
    assert session.node is not None
    names = SessionNames(session_id=spec.session_id, tag=SessionTags().next(), node_id=node_id)
    budget = ThreadBudget.for_this_machine(1)
    need = spec.thread_need(budget.coordinator_reservation)
    if not budget.fits(need):
        budget = ThreadBudget(need, budget.coordinator_reservation)
    session.launcher = launcher = await Launcher.open(
        names=names, socket=session.socket, node=session.node, budget=budget,
        health=HealthPolicy(), max_agents=DEFAULT_MAX_AGENTS)
    launched = await launcher.launch_composition(spec, ExecutionMode.from_label(spec.mode))
    outcome.workers = [_worker_json(launched[w]) for w in spec.worker_ids() if w in launched]
    session.coordinator_client = await connect_expected(
        session.node, session.socket, names.coordinator_client_id,
        grants=names.client_grants())
    task = load_plugin(spec.task.impl, "task")(config=dict(spec.task.config),
                                               terminal=spec.task.terminal,
                                               max_agents=DEFAULT_MAX_AGENTS, epoch=EPOCH)
    injections = Injections(
        lose_advance_result_at=spec.injections.lose_advance_result_at,
        kill_at=tuple((k.worker, k.step) for k in spec.injections.kill),
        kill=launcher.kill)
    return Coordinator(
        spec, session.coordinator_client,
        {wid: w.worker_ref() for wid, w in launcher.workers().items()},
        task=task, executor=IdentityExecutor(), deadlines=Deadlines(),
        order=DispatchOrder.from_label(spec.dispatch), injections=injections, epoch=EPOCH)


async def _execute(session: _Session, node_id: str, outcome: _Outcome,
                   signals: _Signals) -> None:
    spec = session.spec
    try:
        session.node = await connect(session.socket, client_id=node_client_id(node_id))
    except BusError as exc:
        raise RunUsageError(exc.name, f"the router refused the node connection: "
                                      f"{exc.message}") from None
    except OSError as exc:
        raise RunUsageError("CONFIG", f"cannot connect to the router on {session.socket}: "
                                      f"{exc}") from None
    try:
        coordinator = await _start_session(session, node_id, outcome)
    except (DomainError, BusError) as exc:
        code, mutation, message = (
            (str(exc.code), str(exc.mutation), exc.message) if isinstance(exc, DomainError)
            else (exc.name, "none", exc.message))
        outcome.failure = {"detail": "launch", "participant": None, "code": code,
                           "mutation": mutation, "message": message}
        log.error("run.launch_failed", code=code, message=message)
        return
    launcher = session.launcher
    assert launcher is not None
    if spec.pacing == "off" and spec.pace_s is None:
        coordinator.disable_pacing()
    session.coordinator = coordinator
    progress = Progress(spec.steps, sys.stderr.isatty())
    health_failure: list[SessionFailure] = []

    async def steps() -> None:
        await coordinator.bootstrap()
        progress.start()
        for _ in range(spec.steps):
            if signals.cancel_requested.is_set():
                outcome.state = "cancelled"
                return
            report = await coordinator.step()
            outcome.step_seconds = time.monotonic() - progress.started
            progress.update(report.boundary)
            if report.terminal or report.paused:
                break
        outcome.state = "succeeded"

    stepper = asyncio.get_running_loop().create_task(steps())

    def report(worker_id: str, error: DomainError) -> None:
        failure = coordinator.health_failure(worker_id, error)
        if failure is not None and not stepper.done():
            health_failure.append(failure)
            stepper.cancel()

    supervisor = asyncio.get_running_loop().create_task(launcher.supervise(report))
    try:
        await stepper
    except SessionFailure as failure:
        outcome.state = "failed"
        outcome.failure = _failure_json(failure)
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if (current is not None and current.cancelling()) or not health_failure:
            raise
        outcome.state = "failed"
        outcome.failure = _failure_json(health_failure[0])
    finally:
        supervisor.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await supervisor
        await progress.stop()
    if outcome.failure is not None:
        log.error("run.failed", **{k: v for k, v in outcome.failure.items() if v is not None})


async def _read_world(session: _Session, outcome: _Outcome) -> None:
    """The world's `progressCounter` before the reap (null when it cannot answer)."""
    launcher = session.launcher
    if launcher is None:
        return
    world = session.spec.world.world_id
    with contextlib.suppress(DomainError, TimeoutError, asyncio.CancelledError):
        if world in launcher.workers():
            async with asyncio.timeout(2.0):
                status = await launcher.health_check(world)
            counter = status.get("progressCounter")
            outcome.world_progress = None if counter is None else str(counter)


def _behaviour(coordinator: Coordinator) -> list[dict[str, Any]]:
    records = [t.behaviour for t in coordinator.trace.transitions]
    if coordinator.epoch == EPOCH:
        return records
    rebase = EpochRebase(coordinator.epoch, EPOCH, coordinator.task)
    return [rebase.apply(r) for r in records]


def _summary(spec: RunSpec, coordinator: Coordinator | None, outcome: _Outcome,
             wall: float) -> dict[str, Any]:
    boundary = 0
    advances = 0
    counter: int | None = None
    digest = digest_of([])
    if coordinator is not None:
        boundary = len(coordinator.trace.transitions)
        advances = coordinator.stats.advances
        digest = digest_of(_behaviour(coordinator))
        with contextlib.suppress(Exception):
            counter = int(coordinator.progress().value["counter"])
    return {
        "run": None,
        "state": outcome.state,
        "steps": spec.steps,
        "boundary": boundary,
        "epochs": [EPOCH],
        "recoveries": 0,
        "advances": advances,
        "checkpoints": 0,
        "behaviourDigest": digest,
        "worldProgress": outcome.world_progress,
        "counter": counter,
        "wallSeconds": round(wall, 3),
        "stepsPerSecond": (round(advances / outcome.step_seconds, 1)
                           if outcome.step_seconds > 0 else 0.0),
        "mode": spec.mode,
        "workers": outcome.workers,
        "failures": [] if outcome.failure is None else [outcome.failure],
    }


def _write_trace(path: Path, coordinator: Coordinator) -> None:
    with path.open("wb") as fh:
        for record in _behaviour(coordinator):
            fh.write(canonical(record) + b"\n")


def _print_summary(opts: RunOptions, summary: dict[str, Any]) -> None:
    if opts.as_json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
        sys.stdout.flush()
        return
    line = (f"flyd run: {summary['state']} at boundary {summary['boundary']}/{summary['steps']} "
            f"({summary['mode']}), {summary['stepsPerSecond']} steps/s in "
            f"{summary['wallSeconds']}s; counter {summary['counter']}, behaviour digest "
            f"{summary['behaviourDigest']}")
    print(line, file=sys.stderr)
    for failure in summary["failures"]:
        who = f" ({failure['participant']})" if failure["participant"] else ""
        print(f"flyd run: failure: {failure['detail']}{who}: {failure['code']}: "
              f"{failure['message']}", file=sys.stderr)


def _error(opts: RunOptions, code: str, message: str) -> int:
    if opts.as_json:
        sys.stdout.write(orjson.dumps({"error": {"code": code, "message": message}}).decode()
                         + "\n")
    else:
        print(f"flyd run: {message}", file=sys.stderr)
    return EXIT_USAGE


def parse_agents(text: str) -> tuple[str, ...]:
    """`fly-a,fly-b` → ids (empty items are kept so that validation names them)."""
    return tuple(part.strip() for part in text.split(","))

