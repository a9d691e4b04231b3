"""The launcher: start, identify, supervise and stop a session's workers (design/session.md §7).

Why: a session's workers must run with exactly the identities the bus admits
(design/session.md §7.2), within the node's thread budget (design/session.md §7.3), under health
supervision (design/session.md §7.4), and nothing of them may outlive the node. One `Launcher` per
session does that on the node's event loop, with its own bus connection (`<tag>.launcher`) for
`Worker.*` calls and the node connection (`node.<node_id>`) for every `bus.expect`.

API (all coroutines run on the node's loop):

    Launcher.open(names=, socket=, node=, budget=, health=, max_agents=, log_format=,
                  spawner=) -> Launcher
    launcher.launch(identity, settings, mode, *, faults=None) -> LaunchedWorker
    launcher.launch_composition(spec, mode) -> dict[workerId, LaunchedWorker]
    launcher.health_check(worker_id) -> dict        the `Worker.Status` result
    (design/session.md §2.6) launcher.reap(worker_id, reason) -> Stopped | Terminated | AlreadyGone
    launcher.reap_all(reason) -> dict[workerId, outcome]
    launcher.kill(worker_id) -> Terminated | AlreadyGone
    launcher.restart(worker_id, settings=None, *, faults=None) -> LaunchedWorker
    launcher.info(worker_id) -> WorkerInfo           psutil facts (pid, RSS, peak RSS, cpu, threads)
    launcher.supervise(report)                       health loop + exit reports, until cancelled
    launcher.kill_process_groups()                   synchronous SIGKILL of every child group
    launcher.abandon()                               the same, and no process exit waited for
    launcher.close()                                 kills every remaining body; idempotent
    connect_expected(node, socket, client_id, grants=, ttl=) -> BusClient

Execution modes (design/session.md §7.1), all over the Unix socket:
- `PROCESS`: the worker's `main` with `<argv>` in its own session and process group, started by
  the node's `Spawner` (`flyd.launch.spawner`): forked from the fork server, or
  `python -m workers.agent|workers.environment <argv>` spawned on the spawner's thread, never on
  the event loop; stdin = start gate. The expectation is made with the child's pid, then `go\\n`
  is written. A process launch holds one of the spawner's slots (`[session]
  launch_concurrency`) from its start until it identified.
- `THREAD`: a dedicated OS thread running its own uvloop loop and the worker shell.
- `IN_PROCESS`: a task on the node's loop, owned by the launcher.

Task and thread ownership: every body (child, thread, task) is owned by the launcher's table from
spawn to reap; `close()` kills the ones left. What a process worker starts carries the
worker's scope (`FLYD_SCOPE=<launcher scope>/<worker id>`); reaping or killing a worker also
kills what it started, detached processes included, which the node adopts as child subreaper
(`flyd.launch.orphans`), and killing the process groups and `close()` kill what any of them
started. Every wait is bounded (`asyncio.timeout`): calls by
the health policy, exits by `probe` (reap) or `KILL_WAIT_S` (after SIGKILL / cancel).

Resolved ambiguities:
- Budget holders are `<tag>.<workerId>` (the node's budget is shared by sessions whose workers
  share ids); the session's coordinator reservation (`coordinator-<tag>`) is taken by
  `Launcher.open` and released by `close()`.
- `launch(..., faults=)`: a launch's settings are its role settings (`AgentSettings` /
  `EnvironmentSettings`) plus its `Faults`; `restart` keeps either unless given.
- `identify` treats an attempt that sees no answer within `fail` as a failed launch
  (`BACKEND_FAILURE`/`unknown`, "did not answer within the supervisor's budget"); running out
  of `boot` is `BACKEND_FAILURE`/`none` naming the last retried refusal; a body that
  ends during identify fails the launch at once (`BACKEND_FAILURE`/`none`, naming the exit
  code) instead of waiting for `boot`. The reply's bus responder must be the worker's client id
  and incarnation, and the outcome must echo the request id and a null scope.
- A `bus.expect` refusal maps `NOT_AUTHORIZED`/`CONFLICT` → `IDENTITY_MISMATCH`,
  `BACKPRESSURE`/`QUOTA_EXCEEDED` → `BUSY`, anything else → `BACKEND_FAILURE`, all `none`.
  The expectation lives `boot` seconds.
- `reap`: `Worker.Shutdown` is bounded by `probe`; an unanswered Shutdown is followed by the
  kill at once (no `probe` wait for a worker that did not agree to stop); a worker that was
  already dead when reaped is `Terminated`.
- After SIGKILL (or a cancel) the launcher waits up to `KILL_WAIT_S` (5 s) for the body to end;
  a child stuck beyond that is logged `process-did-not-exit` (its pidfd watcher still reaps
  it later), a thread `thread-did-not-stop` and left as a daemon thread; both are `Terminated`.
- `abandon()` is the lost lease's kill (design/distribution.md §5.5 step 3): every child group is
  SIGKILLed and from then on no process exit is waited for (kills, `close()`, a cancelled
  launch's cleanup). Why: a process's exit is learnt from the fork server's report (or the
  pidfd), which a loaded host schedules late, and the scope must end within the lease bound
  K; the kernel ends a SIGKILLed group regardless, the lease runtime confirms it gone
  (`groups_running`), and the fork server (or the pidfd watch) still reaps each zombie on its
  own. The output pipes are closed at once, so a killed worker's last lines may be lost.
- `supervise(report)` reports `(worker_id, DomainError)` once per launch: a failed health
  check, or `BACKEND_FAILURE`/`unknown` "<worker> exited with code <n>" for a body that ended
  without the launcher stopping it. A health check that fails while the body ends within
  `EXIT_GRACE_S` (its service vanished a moment before the exit was seen) leaves the report to
  the exit watcher, which names the exit code.
- A body that ends before it answered names its reason: the refusal it reported (a thread or
  task body's raised `DomainError`, a process's `REFUSED_LAUNCH` line), keeping the refusal's
  code and plugin fault (`INVALID_ARGUMENT` for a model or world that cannot be imported, so
  the node does not retry it); else a process's last output lines (`flyd.launch.spawn`); else
  the exit code alone. A process's output is awaited up to `OUTPUT_DRAIN_S` (0.5 s) first.
- Exit codes: a child's own code, or −signal (−9 after SIGKILL); a thread or task body reports
  the shell's code, `CANCELLED_EXIT` (−9) when it was cancelled and `CRASHED_EXIT` (70) when it
  raised (a refused launch, e.g. an unknown model: the message carries the exception).
- `launch_composition` checks the workers' thread need against `remaining` first (`BUSY`,
  nothing started), then launches the world and the agents concurrently; the world serves the
  agents' ports in the spec's (sorted) agent order. Any failure kills the launched ones.
- Every `bus.expect` is bounded by `fail`.
- Start errors (`start_error`): `BUSY` → `QUOTA_EXCEEDED`, `IDENTITY_MISMATCH` →
  `NOT_AUTHORIZED`, anything else → `NO_SERVICE` (design/session.md §7.3), for callers (the harness)
  that report a failed start as a bus error.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, Protocol

import psutil
import structlog

from bus.client import BusClient, connect
from bus.client_calls import CallResult
from bus.client_topics import PublishFailedHook
from bus.errors import (
    BusError,
    CallDeadlineExceeded,
    CallGone,
    NoService,
    NotAuthorized,
    QuotaExceeded,
    TargetChanged,
)
from flyd.launch.budget import ThreadBudget
from flyd.launch.forkserver import ForkServerError
from flyd.launch.health import HealthPolicy, format_seconds, no_answer
from flyd.launch.identities import (
    SessionNames,
    WorkerIdentity,
    WorkerRef,
    new_client_incarnation,
)
from flyd.launch.orphans import SCOPE_VAR, reap, sweep
from flyd.launch.spawn import ChildProcess, ProcessInfo, process_info, settled_within
from flyd.launch.spawner import Spawner
from workers.bodies import EndpointFactory, WorkerThread, run_worker
from workers.faults import Faults
from workers.host import HostLaunch
from workers.launch import (
    CRASHED_EXIT,
    DEFAULT_MEDIA_INLINE_MAX_BYTES,
    AgentSettings,
    EnvironmentSettings,
    LogFormat,
    WorkerLaunch,
    thread_environment,
)
from workers.roles import endpoint_for
from workers.types.domain import DomainError, ErrorCode, Mutation, format_request_id
from workers.types.rpc import Outcome, Refused, answer, from_bus_error
from workers.types.ticks import RationalNs

__all__ = [
    "IDENTIFY_RETRY_S",
    "KILL_WAIT_S",
    "AgentPlan",
    "AlreadyGone",
    "Composition",
    "ExecutionMode",
    "LaunchedWorker",
    "Launcher",
    "Plan",
    "ReapOutcome",
    "Report",
    "Settings",
    "Stopped",
    "Terminated",
    "WorkerInfo",
    "WorldPlan",
    "composition_plans",
    "connect_expected",
    "expect",
    "host_groups",
    "start_error",
    "worker_launch",
]

log = structlog.get_logger("flyd.launch.launcher")

IDENTIFY_RETRY_S: Final = 0.005
KILL_WAIT_S: Final = 5.0
#: how long a process that ended before it answered is given to finish writing its output
OUTPUT_DRAIN_S: Final = 0.5
#: after a failed health check, how long to wait for the body's end before reporting the check
EXIT_GRACE_S: Final = 0.25
#: exit code recorded for a thread or task body that was cancelled (stopped by force)
CANCELLED_EXIT: Final = -9
#: exit code recorded for a thread or task body that raised

Settings = AgentSettings | EnvironmentSettings
Report = Callable[[str, DomainError], None]


class ExecutionMode(Enum):
    PROCESS = "process"
    THREAD = "thread"
    IN_PROCESS = "in-process"

    def label(self) -> str:
        return self.value

    @classmethod
    def from_label(cls, label: str) -> ExecutionMode:
        for mode in cls:
            if mode.value == label:
                return mode
        raise DomainError.invalid(f"{label!r} is not an execution mode (process, thread, "
                                  "in-process)")


# --------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True, slots=True)
class Stopped:
    """The worker answered `Worker.Shutdown` and ended on its own."""

    worker_id: str
    exit_code: int | None = None

    @property
    def label(self) -> str:
        return "Stopped"


@dataclass(frozen=True, slots=True)
class Terminated:
    """The worker was stopped by force (SIGKILL, or abort and cancel)."""

    worker_id: str
    exit_code: int | None = None

    @property
    def label(self) -> str:
        return "Terminated"


@dataclass(frozen=True, slots=True)
class AlreadyGone:
    """No live worker of that id."""

    worker_id: str

    @property
    def label(self) -> str:
        return "AlreadyGone"


ReapOutcome = Stopped | Terminated | AlreadyGone


@dataclass(slots=True)
class LaunchedWorker:
    """One identified, live launch (design/session.md §7.2). `peak_rss_kib` is sampled at health
    checks and reap (process mode)."""

    identity: WorkerIdentity
    mode: ExecutionMode
    service_incarnation: str
    domain_incarnation: str
    pid: int | None
    peak_rss_kib: int | None = None

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    def worker_ref(self) -> WorkerRef:
        """The coordinator's reference, pinning both incarnations."""
        return WorkerRef(self.identity.service, self.service_incarnation,
                         self.identity.worker_id, self.domain_incarnation)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """`info(worker_id)`: the worker's process (the node's own in thread/in-process mode)."""

    worker_id: str
    mode: ExecutionMode
    pid: int
    status: str | None
    rss_kib: int | None
    peak_rss_kib: int | None
    cpu_user_s: float | None
    cpu_system_s: float | None
    num_threads: int | None
    worker_threads: int


def start_error(error: DomainError) -> BusError:
    """The bus error a failed start reports (design/session.md §7.3): BUSY → QUOTA_EXCEEDED,
    IDENTITY_MISMATCH → NOT_AUTHORIZED, anything else → NO_SERVICE."""
    if error.code == ErrorCode.BUSY:
        return QuotaExceeded(error.message)
    if error.code == ErrorCode.IDENTITY_MISMATCH:
        return NotAuthorized(error.message)
    return NoService(error.message)


def _expect_error(client_id: str, exc: BusError) -> DomainError:
    message = f"bus.expect {client_id}: bus {exc.name}: {exc.message}"
    if exc.name in ("NOT_AUTHORIZED", "CONFLICT"):
        return DomainError.before(ErrorCode.IDENTITY_MISMATCH, message)
    if exc.name in ("BACKPRESSURE", "QUOTA_EXCEEDED"):
        return DomainError.before(ErrorCode.BUSY, message)
    return DomainError(ErrorCode.BACKEND_FAILURE, message, Mutation.NONE)


async def connect_expected(node: BusClient, socket: str, client_id: str, *,
                           grants: dict[str, list[str]], ttl: float = 30.0,
                           timeout: float = 5.0,  # noqa: ASYNC109
                           on_publish_failed: PublishFailedHook | None = None) -> BusClient:
    """Have the node connection expect `client_id` from this process with a fresh `inc-<hex>`
    incarnation and `grants`, then connect it (coordinator and launcher clients,
    design/session.md §7.2); `on_publish_failed` hears its refused lean publications (the
    coordinator's run topic)."""
    incarnation = new_client_incarnation()
    await expect(node, client_id, os.getpid(), incarnation, grants, ttl=ttl, timeout=timeout)
    return await connect(socket, client_id=client_id, client_incarnation=incarnation,
                         timeout=timeout, on_publish_failed=on_publish_failed)


async def expect(node: BusClient, client_id: str, pid: int, incarnation: str,
                 grants: dict[str, list[str]], *, ttl: float,
                 timeout: float) -> None:  # noqa: ASYNC109
    """One `bus.expect` by the node connection, bounded by `timeout`; refusals and a missing
    answer are DomainErrors (`_expect_error`)."""
    try:
        async with asyncio.timeout(timeout):
            await node.expect(client_id, pid, client_incarnation=incarnation, ttl=ttl,
                              grants=grants)
    except TimeoutError:
        raise DomainError(ErrorCode.BACKEND_FAILURE,
                          f"bus.expect {client_id}: no answer within {format_seconds(timeout)}",
                          Mutation.UNKNOWN) from None
    except BusError as exc:
        raise _expect_error(client_id, exc) from None


Plan = tuple[WorkerIdentity, Settings, Faults]


class WorldPlan(Protocol):
    """What launching reads of a run's world (the run spec's `WorldSpec` has it): the session
    layer describes runs, this layer only starts what such a description names."""

    @property
    def world_id(self) -> str: ...
    @property
    def impl(self) -> str: ...
    @property
    def config(self) -> Mapping[str, Any]: ...
    @property
    def step(self) -> RationalNs: ...
    @property
    def observation_delay_steps(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def faults(self) -> Faults: ...


class AgentPlan(Protocol):
    """What launching reads of one agent of a run (the run spec's `AgentSpec`)."""

    @property
    def agent_id(self) -> str: ...
    @property
    def port_id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def model_config(self) -> Mapping[str, Any]: ...
    @property
    def tick(self) -> RationalNs: ...
    @property
    def warmup_ticks(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def faults(self) -> Faults: ...


class Composition(Protocol):
    """The workers of a run to launch: its mode, world and agents (the run spec, `RunSpec`)."""

    @property
    def mode(self) -> str: ...
    @property
    def world(self) -> WorldPlan: ...
    @property
    def agents(self) -> Sequence[AgentPlan]: ...


def worker_launch(names: SessionNames, identity: WorkerIdentity, settings: Settings,
                  faults: Faults, mode: ExecutionMode, *, socket: str, supervisor: str,
                  max_agents: int, log_format: LogFormat = "json",
                  parent_pid: int | None = None,
                  media_inline_max_bytes: int = DEFAULT_MEDIA_INLINE_MAX_BYTES) -> WorkerLaunch:
    """The `WorkerLaunch` of one launch: identity, the session's callers (coordinator, launcher,
    node), the supervisor (the launcher), and `--parent-pid` in process mode only: the process
    that starts the worker (`parent_pid`: the fork server), this one by default."""
    return WorkerLaunch(
        socket=socket, session_id=identity.session_id, worker_id=identity.worker_id,
        incarnation_id=identity.incarnation_id, client_id=identity.client_id,
        service=identity.service, supervisor=supervisor, callers=names.callers,
        threads=identity.worker_threads, max_agents=max_agents, settings=settings,
        faults=faults,
        parent_pid=(parent_pid or os.getpid()) if mode is ExecutionMode.PROCESS else None,
        log_format=log_format, media_inline_max_bytes=media_inline_max_bytes)


def composition_plans(names: SessionNames, spec: Composition, *,
                      generation: int = 1) -> list[Plan]:
    """`(identity, settings, faults)` of the world, then every agent, of a run spec. The world
    serves the agents' ports in the spec's (sorted) agent order."""
    world = spec.world
    plans: list[Plan] = [(
        names.environment(world.world_id, world.threads, generation),
        EnvironmentSettings(ports=tuple(a.port_id for a in spec.agents), world=world.impl,
                            world_config=dict(world.config), step=world.step,
                            observation_delay_steps=world.observation_delay_steps),
        world.faults)]
    for agent in spec.agents:
        plans.append((
            names.agent(agent.agent_id, agent.port_id, agent.threads, generation),
            AgentSettings(port_id=agent.port_id, model=agent.model,
                          model_config=dict(agent.model_config), tick=agent.tick,
                          warmup_ticks=agent.warmup_ticks),
            agent.faults))
    return plans


def host_groups(plans: Sequence[Plan], agents_per_process: int) -> list[list[Plan]]:
    """The processes a launch of `plans` takes: every environment alone, the agents in plan
    order in groups of at most `agents_per_process` (the last may be smaller). A group of one
    is an ordinary worker process; a larger one is an agent host."""
    groups: list[list[Plan]] = [[plan] for plan in plans if plan[0].role != "agent"]
    agents = [plan for plan in plans if plan[0].role == "agent"]
    size = max(1, agents_per_process)
    groups += [agents[i:i + size] for i in range(0, len(agents), size)]
    return groups


# --------------------------------------------------------------------------------------------
# bodies


def _settle(fut: asyncio.Future[int], code: int) -> None:
    if not fut.done():
        fut.set_result(code)


class _Body:
    """Where one launch's code runs; `ended` resolves with its exit code on the owner loop."""

    mode: ExecutionMode

    def __init__(self) -> None:
        self.ended: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.ended.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.error: BaseException | None = None

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def exit_code(self) -> int | None:
        return self.ended.result() if self.ended.done() and not self.ended.cancelled() else None

    def describe_end(self) -> str:
        text = f"exited with code {self.exit_code}"
        if self.error is not None:
            text += f" ({self.error})"
        return text

    async def refusal(self) -> DomainError | None:
        """Why the body refused to start, when it said so (a thread or task body raised it)."""
        return self.error if isinstance(self.error, DomainError) else None

    def last_lines(self) -> list[str]:
        """The body's last output lines (a process's; the others share the node's log)."""
        return []

    def abort(self) -> None:
        """Stop by force, synchronously (SIGKILL of the group / abort and cancel)."""
        raise NotImplementedError

    async def wait(self, timeout: float) -> bool:  # noqa: ASYNC109
        """Up to `timeout` seconds for the end; True when it ended."""
        return await settled_within(self.ended, timeout)

    async def dispose(self, wait_s: float) -> None:
        """Release what the body holds once it ended (or was given up on), waiting at most
        `wait_s` for what is still ending."""

    def info(self) -> ProcessInfo:
        return process_info(self.pid)


class _ProcessBody(_Body):
    mode = ExecutionMode.PROCESS

    def __init__(self, child: ChildProcess) -> None:
        super().__init__()
        self.child = child
        child.exited.add_done_callback(
            lambda f: _settle(self.ended, f.result()) if not f.cancelled() else None)

    @property
    def pid(self) -> int:
        return self.child.pid

    async def refusal(self) -> DomainError | None:
        """The child's `REFUSED_LAUNCH` error, read once its output ended (or `OUTPUT_DRAIN_S`
        passed: the exit can be seen before the last lines); an unreadable one is ignored."""
        await self.child.drained(OUTPUT_DRAIN_S)
        raw = self.child.refusal
        if raw is None:
            return None
        try:
            return DomainError.from_json(raw)
        except DomainError:
            return None

    def last_lines(self) -> list[str]:
        return self.child.last_lines()

    def abort(self) -> None:
        self.child.kill()

    async def dispose(self, wait_s: float) -> None:
        await self.child.close(wait_s)


class _ThreadBody(_Body):
    """A `WorkerThread`: a dedicated OS thread with its own uvloop loop running `run_worker`
    (design/session.md §7.1). `abort()` stops and cancels it (thread-safe); its last act resolves
    `ended` on the owner loop."""

    mode = ExecutionMode.THREAD

    def __init__(self, launch: WorkerLaunch, factory: EndpointFactory) -> None:
        super().__init__()
        self._owner = asyncio.get_running_loop()
        self.worker = WorkerThread(launch, endpoint_factory=factory,
                                   name=f"flyd-{launch.client_id}", on_end=self._ended)

    def _ended(self, worker: WorkerThread) -> None:
        self.error = worker.error
        code = (CANCELLED_EXIT if worker.cancelled
                else CRASHED_EXIT if worker.exit_code is None else worker.exit_code)
        with contextlib.suppress(RuntimeError):  # the owner loop is closed: nobody waits
            self._owner.call_soon_threadsafe(_settle, self.ended, code)

    def start(self) -> None:
        self.worker.start()

    def abort(self) -> None:
        self.worker.stop()
        self.worker.cancel()

    async def dispose(self, wait_s: float) -> None:
        # `ended` is resolved by the thread's last statement: the join is immediate then.
        if self.ended.done():
            self.worker.join(timeout=0.1)


class _TaskBody(_Body):
    """`run_worker` as a task on the node's loop, owned by the launcher. `abort()` sets the
    shell's stop event (it aborts the connection) and cancels the task."""

    mode = ExecutionMode.IN_PROCESS

    def __init__(self, launch: WorkerLaunch, factory: EndpointFactory) -> None:
        super().__init__()
        self._stop = asyncio.Event()
        self.task: asyncio.Task[int] = asyncio.get_running_loop().create_task(
            run_worker(launch, stop_event=self._stop, endpoint_factory=factory),
            name=f"flyd-{launch.client_id}")
        self.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[int]) -> None:
        if task.cancelled():
            code = CANCELLED_EXIT
        elif task.exception() is not None:
            self.error = task.exception()
            code = CRASHED_EXIT
        else:
            code = task.result()
        _settle(self.ended, code)

    def abort(self) -> None:
        self._stop.set()
        self.task.cancel()

    async def dispose(self, wait_s: float) -> None:
        if not self.task.done():
            self.task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                await asyncio.wait({self.task})


# --------------------------------------------------------------------------------------------
# the launcher


@dataclass(slots=True)
class _Plan:
    """What the last launch of a worker id was (for `restart`)."""

    identity: WorkerIdentity
    settings: Settings
    faults: Faults
    mode: ExecutionMode


@dataclass(slots=True)
class _Live:
    launched: LaunchedWorker
    body: _Body
    holder: str
    stopping: bool = False
    reported: bool = False
    #: the agents sharing this one's host process, itself included (empty: not hosted)
    host: tuple[str, ...] = ()
    #: the worker whose kill ended this one's host
    ended_with: str | None = None


class Launcher:
    """One session's launcher on the node's loop."""

    def __init__(self, *, names: SessionNames, socket: str, node: BusClient, client: BusClient,
                 budget: ThreadBudget, health: HealthPolicy | None = None, max_agents: int = 4,
                 log_format: LogFormat = "json", python: str = sys.executable,
                 endpoint_factory: EndpointFactory | None = None,
                 spawner: Spawner | None = None,
                 holds_reservation: bool = False, owns_client: bool = False) -> None:
        self.names = names
        self.socket = socket
        self.node = node
        self.client = client
        self.budget = budget
        self.health = health or HealthPolicy()
        self.max_agents = max_agents
        self.log_format: LogFormat = log_format
        self.python = python
        self._endpoint_factory = endpoint_factory or endpoint_for
        self._owns_spawner = spawner is None
        self.spawner = spawner or Spawner(socket=socket, python=python)
        #: agents per process in process mode (`[session] agents_per_process`; a run's spec may
        #: set its own through `launch_composition`)
        self.agents_per_process = self.spawner.settings.agents_per_process
        self._holds_reservation = holds_reservation
        self._owns_client = owns_client
        self._serial = 0
        self._workers: dict[str, _Live] = {}
        self._plans: dict[str, _Plan] = {}
        self._starting: dict[str, _Body] = {}
        self._report: Report | None = None
        self._closed = False
        self._abandoned = False
        #: `FLYD_SCOPE` of this launcher's process workers (`flyd.launch.orphans`)
        self.scope = f"{names.node_id}.{names.tag}"
        self._orphans: list[psutil.Process] = []

    @classmethod
    async def open(cls, *, names: SessionNames, socket: str, node: BusClient,
                   budget: ThreadBudget, health: HealthPolicy | None = None,
                   max_agents: int = 4, log_format: LogFormat = "json",
                   python: str = sys.executable,
                   endpoint_factory: EndpointFactory | None = None,
                   spawner: Spawner | None = None) -> Launcher:
        """Take the session's coordinator reservation, have the node expect the launcher's
        client (`<tag>.launcher`) and connect it. Process workers start through `spawner` (the
        node's); without one the launcher owns a default one and closes it with itself."""
        health = health or HealthPolicy()
        budget.open_session(names.tag)
        try:
            client = await connect_expected(node, socket, names.launcher_client_id,
                                            grants=names.client_grants(), ttl=health.boot)
        except BaseException:
            budget.close_session(names.tag)
            raise
        return cls(names=names, socket=socket, node=node, client=client, budget=budget,
                   health=health, max_agents=max_agents, log_format=log_format, python=python,
                   endpoint_factory=endpoint_factory, spawner=spawner, holds_reservation=True,
                   owns_client=True)

    # ------------------------------------------------------------------------- properties

    @property
    def client_id(self) -> str:
        return self.client.client_id

    def set_health_policy(self, policy: HealthPolicy) -> None:
        """The supervisor's budgets from now on (design/session.md §7.4)."""
        self.health = policy

    def workers(self) -> dict[str, LaunchedWorker]:
        """The live workers by id."""
        return {wid: live.launched for wid, live in self._workers.items()}

    def launched_ids(self) -> list[str]:
        """Every worker id this launcher has launched, live or not (its composition), sorted:
        tells a worker that is gone from one that never existed."""
        return sorted(self._plans)

    def get(self, worker_id: str) -> LaunchedWorker:
        live = self._workers.get(worker_id)
        if live is None:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH, f"no live worker {worker_id}")
        return live.launched

    def worker_ref(self, worker_id: str) -> WorkerRef:
        return self.get(worker_id).worker_ref()

    def holder(self, worker_id: str) -> str:
        """The thread-budget holder name of a worker of this session."""
        return f"{self.names.tag}.{worker_id}"

    def _next_request_id(self) -> str:
        self._serial += 1
        return format_request_id(self._serial)

    # ------------------------------------------------------------------------- launch

    def _check_launch(self, identity: WorkerIdentity, settings: Settings) -> None:
        if self._closed:
            raise DomainError.before(ErrorCode.INVALID_PHASE, "the launcher is closed")
        if identity.tag != self.names.tag or identity.session_id != self.names.session_id:
            raise DomainError.before(
                ErrorCode.IDENTITY_MISMATCH,
                f"{identity.worker_id} belongs to session {identity.session_id} "
                f"({identity.tag}), not {self.names.session_id} ({self.names.tag})")
        wid = identity.worker_id
        if wid in self._workers or wid in self._starting:
            raise DomainError.before(ErrorCode.CONFLICT, f"{wid} is already live")
        if isinstance(settings, AgentSettings):
            if identity.role != "agent" or identity.port_id != settings.port_id:
                raise DomainError.invalid(
                    f"{wid}: agent settings for port {settings.port_id} do not match the "
                    f"identity (role {identity.role}, port {identity.port_id})")
        elif identity.role != "environment":
            raise DomainError.invalid(f"{wid}: environment settings for an {identity.role}")

    def worker_launch(self, identity: WorkerIdentity, settings: Settings, faults: Faults,
                      mode: ExecutionMode, parent_pid: int | None = None) -> WorkerLaunch:
        """The `WorkerLaunch` this launcher writes for a launch (design/session.md §7.7)."""
        return worker_launch(self.names, identity, settings, faults, mode, socket=self.socket,
                             supervisor=self.client_id, max_agents=self.max_agents,
                             log_format=self.log_format, parent_pid=parent_pid,
                             media_inline_max_bytes=self.spawner.settings.media_inline_max_bytes)

    async def _parent_pid(self) -> int:
        try:
            return await self.spawner.parent_pid()
        except (OSError, ForkServerError) as exc:
            raise DomainError(ErrorCode.BACKEND_FAILURE, f"the fork server is unavailable: {exc}",
                              Mutation.NONE) from None

    async def _expect(self, identity: WorkerIdentity, pid: int) -> None:
        await expect(self.node, identity.client_id, pid, identity.incarnation_id,
                     identity.grants(), ttl=self.health.boot, timeout=self.health.fail)

    async def _start_child(self, launch: WorkerLaunch | HostLaunch, threads: int, what: str,
                           fields: Mapping[str, Any], scope: str) -> ChildProcess:
        """A process for one worker or one agent host, blocked on its start gate; `scope` is
        its `FLYD_SCOPE` (`flyd.launch.orphans`)."""
        env = thread_environment(threads)
        env["PYTHONUNBUFFERED"] = "1"
        env[SCOPE_VAR] = scope
        try:
            return await self.spawner.start(launch, env=env, timeout=self.health.boot,
                                            fields=fields)
        except (OSError, ForkServerError, TimeoutError) as exc:
            raise DomainError(ErrorCode.BACKEND_FAILURE,
                              f"{what}: the worker process could not be started "
                              f"({self.spawner.method}): {exc or type(exc).__name__}",
                              Mutation.NONE) from None

    async def _start_body(self, identity: WorkerIdentity, launch: WorkerLaunch,
                          mode: ExecutionMode) -> _Body:
        wid = identity.worker_id
        if mode is ExecutionMode.PROCESS:
            child = await self._start_child(
                launch, identity.worker_threads, wid,
                {"worker": wid, "incarnation": identity.incarnation_id,
                 "session": identity.session_id}, self._worker_scope(wid))
            body: _Body = _ProcessBody(child)
            self._starting[wid] = body
            await self._expect(identity, child.pid)
            child.open_gate()
            return body
        await self._expect(identity, os.getpid())
        if mode is ExecutionMode.THREAD:
            thread_body = _ThreadBody(launch, self._endpoint_factory)
            self._starting[wid] = thread_body
            thread_body.start()
            return thread_body
        body = _TaskBody(launch, self._endpoint_factory)
        self._starting[wid] = body
        return body

    async def launch(self, identity: WorkerIdentity, settings: Settings,
                     mode: ExecutionMode = ExecutionMode.PROCESS, *,
                     faults: Faults | None = None) -> LaunchedWorker:
        """Allocate threads, start the body, identify it with `Worker.Hello`
        (design/session.md §7.5)."""
        self._check_launch(identity, settings)
        faults = faults if faults is not None else Faults()
        wid = identity.worker_id
        holder = self.holder(wid)
        self.budget.allocate(holder, identity.worker_threads)
        self._plans[wid] = _Plan(identity, settings, faults, mode)
        body: _Body | None = None
        started = asyncio.get_running_loop().time()
        process = mode is ExecutionMode.PROCESS
        try:
            async with self.spawner.launch_slot() if process else contextlib.nullcontext():
                parent = await self._parent_pid() if process else None
                launch = self.worker_launch(identity, settings, faults, mode, parent)
                body = await self._start_body(identity, launch, mode)
                service_incarnation = await self._identify(identity, body)
        except BaseException:
            starting = self._starting.pop(wid, None)
            self.budget.release(holder)
            body = body or starting
            if body is not None:
                body.abort()
                wait_s = self._kill_wait(body)
                await body.wait(wait_s)
                await body.dispose(wait_s)
            raise
        self._starting.pop(wid, None)
        launched = LaunchedWorker(
            identity=identity, mode=mode, service_incarnation=service_incarnation,
            domain_incarnation=identity.incarnation_id,
            pid=body.pid if mode is ExecutionMode.PROCESS else None)
        self._register(_Live(launched, body, holder))
        log.info("launcher.launched", worker=wid, incarnation=identity.incarnation_id,
                 mode=mode.label(), pid=body.pid, service_incarnation=service_incarnation,
                 threads=identity.worker_threads,
                 ms=round((asyncio.get_running_loop().time() - started) * 1000, 1))
        return launched

    def _register(self, live: _Live) -> None:
        """A worker that answered `Worker.Hello` joins the table; its body's end is watched."""
        self._workers[live.launched.worker_id] = live
        live.body.ended.add_done_callback(lambda f: self._body_ended(live, f))

    async def launch_composition(self, spec: Composition,
                                 mode: ExecutionMode | None = None) -> dict[str, LaunchedWorker]:
        """Launch the world and every agent of a run spec concurrently; all or none."""
        mode = mode or ExecutionMode.from_label(spec.mode)
        need = spec.world.threads + sum(a.threads for a in spec.agents)
        if not self.budget.fits(need):
            raise DomainError.before(
                ErrorCode.BUSY, f"the composition of {self.names.tag} wants {need} worker "
                f"threads; {self.budget.remaining} of {self.budget.total} remain")
        return await self.launch_all(composition_plans(self.names, spec), mode)

    async def launch_all(self, plans: list[Plan], mode: ExecutionMode) -> dict[str, LaunchedWorker]:
        """Launch several workers concurrently; on any failure the launched ones are killed
        and the first failure is raised. In process mode the agents share processes by
        `agents_per_process` (`host_groups`)."""
        out: dict[str, LaunchedWorker] = {}
        per_process = self.agents_per_process if mode is ExecutionMode.PROCESS else 1

        async def one(group: list[Plan]) -> None:
            if len(group) > 1:
                out.update(await self.launch_host(group))
                return
            ((identity, settings, faults),) = group
            out[identity.worker_id] = await self.launch(identity, settings, mode, faults=faults)

        try:
            async with asyncio.TaskGroup() as tg:
                for group in host_groups(plans, per_process):
                    tg.create_task(one(group))
        except BaseException as exc:
            for wid in list(out):
                await self.kill(wid)
            if isinstance(exc, BaseExceptionGroup):
                raise _first(exc) from None
            raise
        return out

    async def launch_host(self, plans: Sequence[Plan]) -> dict[str, LaunchedWorker]:
        """Several agents in one process (`workers.host`), all or none: each agent keeps its
        own identity, expectation, thread allocation and `Worker.Hello`; the process is one
        failure domain (docs/launcher.md, "Agent hosts")."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        for identity, settings, _ in plans:
            self._check_launch(identity, settings)
        holders: dict[str, str] = {}
        child: ChildProcess | None = None
        try:
            for identity, settings, faults in plans:
                wid = identity.worker_id
                holders[wid] = self.holder(wid)
                self.budget.allocate(holders[wid], identity.worker_threads)
                self._plans[wid] = _Plan(identity, settings, faults, ExecutionMode.PROCESS)
            async with self.spawner.launch_slot():
                parent = await self._parent_pid()
                host = HostLaunch(tuple(
                    self.worker_launch(identity, settings, faults, ExecutionMode.PROCESS, parent)
                    for identity, settings, faults in plans))
                first = plans[0][0]
                child = await self._start_child(
                    host, sum(identity.worker_threads for identity, _, _ in plans),
                    ",".join(host.worker_ids),
                    {"worker": ",".join(host.worker_ids), "incarnation": first.incarnation_id,
                     "session": first.session_id},
                    self._worker_scope(",".join(host.worker_ids)))
                bodies = {identity.worker_id: _ProcessBody(child) for identity, _, _ in plans}
                self._starting.update(bodies)
                async with asyncio.TaskGroup() as tg:
                    for identity, _, _ in plans:
                        tg.create_task(self._expect(identity, child.pid))
                child.open_gate()
                incarnations: dict[str, str] = {}

                async def identify(identity: WorkerIdentity) -> None:
                    wid = identity.worker_id
                    incarnations[wid] = await self._identify(identity, bodies[wid])

                async with asyncio.TaskGroup() as tg:
                    for identity, _, _ in plans:
                        tg.create_task(identify(identity))
        except BaseException as exc:
            for wid, holder in holders.items():
                self._starting.pop(wid, None)
                self.budget.release(holder)
            if child is not None:
                child.kill()
                await child.close(KILL_WAIT_S if not self._abandoned else 0.0)
            if isinstance(exc, BaseExceptionGroup):
                raise _first(exc) from None
            raise
        out: dict[str, LaunchedWorker] = {}
        for identity, _, _ in plans:
            wid = identity.worker_id
            body = self._starting.pop(wid)
            launched = LaunchedWorker(
                identity=identity, mode=ExecutionMode.PROCESS,
                service_incarnation=incarnations[wid], domain_incarnation=identity.incarnation_id,
                pid=child.pid)
            self._register(_Live(launched, body, holders[wid], host=tuple(holders)))
            out[wid] = launched
        log.info("launcher.launched_host", workers=list(out), pid=child.pid,
                 incarnations=[plan[0].incarnation_id for plan in plans],
                 threads=sum(identity.worker_threads for identity, _, _ in plans),
                 ms=round((loop.time() - started) * 1000, 1))
        return out

    # ------------------------------------------------------------------------- identify

    def _mismatch(self, message: str) -> DomainError:
        return DomainError.before(ErrorCode.IDENTITY_MISMATCH, f"Worker.Hello: {message}")

    async def _identify(self, identity: WorkerIdentity, body: _Body) -> str:
        """`Worker.Hello` until it answers (retrying NO_SERVICE, CALL_GONE, TARGET_CHANGED and
        a predecessor's answer every 5 ms until `boot`); returns the service incarnation."""
        loop = asyncio.get_running_loop()
        health = self.health
        deadline = loop.time() + health.boot
        params = {"sessionId": identity.session_id, "expectedWorkerId": identity.worker_id,
                  "role": identity.role, "supportedMajors": [1]}
        wid = identity.worker_id
        last = "nothing"
        while True:
            if body.ended.done():
                raise await self._ended_early(wid, body)
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise self._boot_expired(identity, last)
            budget = min(health.fail, remaining)
            request_id = self._next_request_id()
            payload = {"requestId": request_id, "scope": None, "params": params}
            try:
                async with asyncio.timeout(budget):
                    result = await self.client.call(identity.service, "Worker.Hello", payload,
                                                    timeout=budget, expected_incarnation=None)
            except (TimeoutError, CallDeadlineExceeded):
                if budget < health.fail:  # the boot budget, not the attempt's, ran out
                    raise self._boot_expired(identity, f"{last}; then no answer") from None
                raise no_answer("Worker.Hello", wid, budget) from None
            except (NoService, CallGone, TargetChanged) as exc:
                last = f"bus {exc.name}: {exc.message}"
                await asyncio.sleep(IDENTIFY_RETRY_S)
                continue
            except BusError as exc:
                raise from_bus_error("Worker.Hello", exc) from None
            if self._from_predecessor(identity, result):
                last = f"an answer from {result.responder.client_id}"
                await asyncio.sleep(IDENTIFY_RETRY_S)
                continue
            self._check_hello(identity, request_id, result)
            return result.service_incarnation

    @staticmethod
    async def _ended_early(wid: str, body: _Body) -> DomainError:
        """A body that ended before it answered `Worker.Hello`, with its reason: its refusal
        (code, message and plugin fault kept: a model that cannot be imported or built says
        so), else its last output lines, else its exit code alone."""
        where = f"Worker.Hello: {wid} exited with code {body.exit_code} before it answered"
        refusal = await body.refusal()
        if refusal is not None:
            return DomainError(refusal.code, f"{where}: {refusal.message}", Mutation.NONE,
                               refusal.data)
        lines = body.last_lines()
        if lines:
            return DomainError(ErrorCode.BACKEND_FAILURE,
                               f"{where}; its last output: {' | '.join(lines)}", Mutation.NONE)
        return DomainError(ErrorCode.BACKEND_FAILURE,
                           f"Worker.Hello: {wid} {body.describe_end()} before it answered",
                           Mutation.NONE)

    def _boot_expired(self, identity: WorkerIdentity, last: str) -> DomainError:
        return DomainError(
            ErrorCode.BACKEND_FAILURE,
            f"Worker.Hello: {identity.worker_id} did not answer on {identity.service} within "
            f"the boot budget of {format_seconds(self.health.boot)} (last: {last})",
            Mutation.NONE)

    @staticmethod
    def _from_predecessor(identity: WorkerIdentity, result: CallResult) -> bool:
        responder = result.responder
        if responder.client_id == identity.client_id:
            return False
        outcome = result.outcome
        incarnation = outcome.get("incarnationId") if isinstance(outcome, dict) else None
        return identity.is_predecessor(responder.client_incarnation) or (
            isinstance(incarnation, str) and identity.is_predecessor(incarnation))

    def _check_hello(self, identity: WorkerIdentity, request_id: str,
                     result: CallResult) -> None:
        responder = result.responder
        if (responder.client_id, responder.client_incarnation) != (identity.client_id,
                                                                    identity.incarnation_id):
            raise self._mismatch(
                f"answered by {responder.client_id} ({responder.client_incarnation}), expected "
                f"{identity.client_id} ({identity.incarnation_id})")
        outcome = self._outcome("Worker.Hello", identity.worker_id, identity.incarnation_id,
                                request_id, result)
        hello = outcome.result
        assert hello is not None
        checks = (("workerId", identity.worker_id), ("role", identity.role),
                  ("incarnationId", identity.incarnation_id))
        for key, want in checks:
            if hello.get(key) != want:
                raise self._mismatch(f"{key} is {hello.get(key)!r}, expected {want!r}")
        limits = hello.get("limits")
        threads = limits.get("workerThreads") if isinstance(limits, dict) else None
        if threads != identity.worker_threads:
            raise self._mismatch(f"limits.workerThreads is {threads!r}, the allocation is "
                                 f"{identity.worker_threads}")

    def _outcome(self, method: str, worker_id: str, incarnation_id: str, request_id: str,
                 result: CallResult) -> Outcome:
        """Classify and check a reply: worker id, incarnation, echoed request id and null
        scope; a domain error outcome is raised."""
        classified = answer(method, result.outcome)
        if isinstance(classified, Refused):
            raise classified.error
        outcome = classified.outcome
        if outcome.worker_id != worker_id:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"{method}: the reply names worker {outcome.worker_id}, "
                                     f"expected {worker_id}")
        if outcome.incarnation_id != incarnation_id:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"{method}: the reply comes from incarnation "
                                     f"{outcome.incarnation_id}, expected {incarnation_id}")
        if outcome.request_id != request_id or outcome.scope is not None:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"{method}: the reply echoes request {outcome.request_id} "
                                     f"and scope {outcome.scope}, expected {request_id} and "
                                     "null")
        if outcome.error is not None:
            raise outcome.error
        return outcome

    # ------------------------------------------------------------------------- calls

    async def _worker_call(self, live: _Live, method: str, params: dict[str, Any],
                           budget: float) -> dict[str, Any]:
        """One `Worker.*` call pinned to the service incarnation, bounded by `budget` seconds
        (admission and result); every failure is a DomainError."""
        launched = live.launched
        wid = launched.worker_id
        request_id = self._next_request_id()
        payload = {"requestId": request_id, "scope": None, "params": params}
        try:
            async with asyncio.timeout(budget):
                result = await self.client.call(
                    launched.identity.service, method, payload, timeout=budget,
                    expected_incarnation=launched.service_incarnation)
        except (TimeoutError, CallDeadlineExceeded):
            raise no_answer(method, wid, budget) from None
        except BusError as exc:
            raise from_bus_error(method, exc) from None
        outcome = self._outcome(method, wid, launched.domain_incarnation, request_id, result)
        assert outcome.result is not None
        return outcome.result

    def _sample_rss(self, live: _Live) -> None:
        if live.launched.mode is ExecutionMode.PROCESS and not live.body.ended.done():
            info = live.body.info()
            if info.peak_rss_kib is not None:
                old = live.launched.peak_rss_kib or 0
                live.launched.peak_rss_kib = max(old, info.peak_rss_kib)

    async def health_check(self, worker_id: str) -> dict[str, Any]:
        """`Worker.Status` pinned to the service incarnation, bounded by `fail`
        (design/session.md §7.4)."""
        live = self._workers.get(worker_id)
        if live is None:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"Worker.Status: no live worker {worker_id}")
        self._sample_rss(live)
        return await self._worker_call(live, "Worker.Status", {}, self.health.fail)

    # ------------------------------------------------------------------------- stop

    def _remove(self, worker_id: str) -> _Live | None:
        live = self._workers.pop(worker_id, None)
        if live is not None:
            live.stopping = True
            self.budget.release(live.holder)
        return live

    def _kill_wait(self, body: _Body) -> float:
        """How long to wait for a body stopped by force: `KILL_WAIT_S`, or nothing for a
        process once the launcher was abandoned (see `abandon`)."""
        return 0.0 if self._abandoned and isinstance(body, _ProcessBody) else KILL_WAIT_S

    async def _force(self, live: _Live) -> bool:
        """Abort the body and wait up to `_kill_wait`; True when it ended."""
        live.body.abort()
        wait_s = self._kill_wait(live.body)
        ended = await live.body.wait(wait_s)
        if not ended and wait_s > 0:
            event = ("launcher.thread-did-not-stop" if live.launched.mode is ExecutionMode.THREAD
                     else "launcher.process-did-not-exit"
                     if live.launched.mode is ExecutionMode.PROCESS
                     else "launcher.task-did-not-stop")
            log.error(event, worker=live.launched.worker_id, pid=live.body.pid)
        await live.body.dispose(wait_s)
        return ended

    async def reap(self, worker_id: str, reason: str, *, sweep: bool = True) -> ReapOutcome:
        """`Worker.Shutdown {reason}` bounded by `probe`, then wait ≤ `probe` for the end;
        else stop by force (design/session.md §7.6). Then what the worker started is killed, unless
        `sweep` is False (the caller sweeps the whole session once)."""
        live = self._workers.get(worker_id)
        if live is None:
            return AlreadyGone(worker_id)
        live.stopping = True
        self._sample_rss(live)
        answered = False
        if not live.body.ended.done():
            try:
                result = await self._worker_call(live, "Worker.Shutdown", {"reason": reason},
                                                 self.health.probe)
                answered = result.get("stopping") is True
            except DomainError as exc:
                log.warning("launcher.shutdown_failed", worker=worker_id, error=str(exc))
        self._remove(worker_id)
        if answered and await live.body.wait(self.health.probe):
            await live.body.dispose(KILL_WAIT_S)
            outcome: ReapOutcome = Stopped(worker_id, live.body.exit_code)
        else:
            await self._force(live)
            outcome = Terminated(worker_id, live.body.exit_code)
        if sweep:
            self._sweep(worker_id)
        log.info("launcher.reaped", worker=worker_id, reason=reason, outcome=outcome.label,
                 exit_code=live.body.exit_code, peak_rss_kib=live.launched.peak_rss_kib)
        return outcome

    async def reap_all(self, reason: str) -> dict[str, ReapOutcome]:
        """Reap every live worker concurrently, then kill what any of them started (one pass
        over the node's descendants, not one per worker)."""
        out: dict[str, ReapOutcome] = {}

        async def one(wid: str) -> None:
            out[wid] = await self.reap(wid, reason, sweep=False)

        async with asyncio.TaskGroup() as tg:
            for wid in list(self._workers):
                tg.create_task(one(wid))
        self._sweep()
        return out

    async def kill(self, worker_id: str, *, sweep: bool = True) -> Terminated | AlreadyGone:
        """No request: remove, release, SIGKILL the group (or abort and cancel) and wait; then
        kill what the worker started, unless `sweep` is False."""
        live = self._remove(worker_id)
        if live is None:
            return AlreadyGone(worker_id)
        for sibling in live.host:
            other = self._workers.get(sibling)
            if other is not None:
                other.ended_with = worker_id
        self._sample_rss(live)
        await self._force(live)
        if sweep:
            self._sweep(worker_id)
        log.info("launcher.killed", worker=worker_id, exit_code=live.body.exit_code)
        return Terminated(worker_id, live.body.exit_code)

    async def restart(self, worker_id: str, settings: Settings | None = None, *,
                      faults: Faults | None = None) -> LaunchedWorker:
        """`kill`, then launch generation + 1 with the same or updated settings and faults."""
        plan = self._plans.get(worker_id)
        if plan is None:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"{worker_id} was never launched by {self.client_id}")
        await self.kill(worker_id)
        return await self.launch(plan.identity.next_generation(), settings or plan.settings,
                                 plan.mode, faults=plan.faults if faults is None else faults)

    async def restart_all(self, worker_ids: Sequence[str],
                          faults_of: Callable[[str], Faults]) -> dict[str, LaunchedWorker]:
        """Kill every named worker, then launch their next generations together (as
        `launch_all`: agents share hosts again as they did), each with `faults_of(id)`."""
        plans: list[Plan] = []
        modes: set[ExecutionMode] = set()
        for wid in worker_ids:
            plan = self._plans.get(wid)
            if plan is None:
                raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                         f"{wid} was never launched by {self.client_id}")
            plans.append((plan.identity.next_generation(), plan.settings, faults_of(wid)))
            modes.add(plan.mode)
        async with asyncio.TaskGroup() as tg:
            for wid in worker_ids:
                tg.create_task(self.kill(wid))
        (mode,) = modes or {ExecutionMode.PROCESS}
        return await self.launch_all(plans, mode)

    def kill_process_groups(self) -> list[int]:
        """SIGKILL every child process group now (synchronous; design/distribution.md §5.5 step 3).
        Returns the groups signalled; the bodies stay in the table until reaped or closed."""
        for live in self._workers.values():
            live.stopping = True  # an exit now is ours, not a failure to report
        groups: list[int] = []
        for body in self._process_bodies():
            body.abort()
            if body.child.pgid not in groups:  # the agents of a host share one
                groups.append(body.child.pgid)
        self._sweep()
        return groups

    def _process_bodies(self) -> list[_ProcessBody]:
        return [body for body in [live.body for live in self._workers.values()]
                + list(self._starting.values()) if isinstance(body, _ProcessBody)]

    def _worker_scope(self, worker_id: str) -> str:
        return f"{self.scope}/{worker_id}"

    def _sweep(self, worker_id: str | None = None) -> None:
        """SIGKILL what one worker (else every worker of the session) started and left behind
        (`flyd.launch.orphans`); the workers themselves are their bodies' to reap."""
        scope = self.scope if worker_id is None else self._worker_scope(worker_id)
        self._orphans.extend(sweep(scope, spare={b.pid for b in self._process_bodies()},
                                   deep=worker_id is None))

    def abandon(self) -> list[int]:
        """The run's lease is lost: `kill_process_groups()`, and no process exit is waited for
        from now on (see the module docstring), so whatever is still stopping ends at once."""
        self._abandoned = True
        return self.kill_process_groups()

    async def close(self) -> None:
        """Kill every remaining body, release the session's reservation, close the client."""
        if self._closed:
            return
        self._closed = True
        async with asyncio.TaskGroup() as tg:
            for wid in list(self._workers):
                tg.create_task(self.kill(wid, sweep=False))
            for body in list(self._starting.values()):
                body.abort()
        self._sweep()
        orphans, self._orphans = self._orphans, []
        wait = 0.0 if self._abandoned else KILL_WAIT_S  # a lost lease waits for no exit
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait + 1):
                await asyncio.to_thread(reap, orphans, wait)
        if self._holds_reservation:
            self.budget.close_session(self.names.tag)
            self._holds_reservation = False
        if self._owns_client:
            await self.client.close()
        if self._owns_spawner:
            await self.spawner.close()

    async def __aenter__(self) -> Launcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------------- observe

    def info(self, worker_id: str) -> WorkerInfo:
        """psutil facts: the child (process mode) or the node's process (thread/in-process)."""
        live = self._workers.get(worker_id)
        if live is None:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH, f"no live worker {worker_id}")
        info = live.body.info()
        launched = live.launched
        if launched.mode is ExecutionMode.PROCESS and info.peak_rss_kib is not None:
            launched.peak_rss_kib = max(launched.peak_rss_kib or 0, info.peak_rss_kib)
        return WorkerInfo(
            worker_id=worker_id, mode=launched.mode, pid=info.pid, status=info.status,
            rss_kib=info.rss_kib,
            peak_rss_kib=(launched.peak_rss_kib if launched.mode is ExecutionMode.PROCESS
                          else info.peak_rss_kib),
            cpu_user_s=info.cpu_user_s, cpu_system_s=info.cpu_system_s,
            num_threads=info.num_threads, worker_threads=launched.identity.worker_threads)

    def _body_ended(self, live: _Live, fut: asyncio.Future[int]) -> None:
        if live.stopping or fut.cancelled():
            return
        wid = live.launched.worker_id
        log.warning("launcher.worker_exited", worker=wid, exit_code=fut.result(),
                    mode=live.launched.mode.label(), pid=live.body.pid)
        report = self._report
        if report is not None and self._workers.get(wid) is live and not live.reported:
            live.reported = True
            report(wid, DomainError(ErrorCode.BACKEND_FAILURE,
                                    f"{wid} {live.body.describe_end()}{_host_note(live)}",
                                    Mutation.UNKNOWN))

    async def supervise(self, report: Report) -> None:
        """Health-check every live worker every `probe` seconds and report failures and
        unexpected exits to `report(worker_id, error)`; runs until cancelled."""
        self._report = report
        try:
            while True:
                await asyncio.sleep(self.health.probe)
                async with asyncio.TaskGroup() as tg:
                    for wid, live in list(self._workers.items()):
                        tg.create_task(self._probe(wid, live, report))
        finally:
            self._report = None

    async def _probe(self, worker_id: str, live: _Live, report: Report) -> None:
        try:
            await self.health_check(worker_id)
        except DomainError as exc:
            # A dying worker's service vanishes a moment before its exit is seen: give the
            # exit watcher the word (it names the exit code) when the body ends right away.
            if await live.body.wait(EXIT_GRACE_S):
                return
            if self._workers.get(worker_id) is live and not live.stopping and not live.reported:
                live.reported = True
                report(worker_id, exc)


def _host_note(live: _Live) -> str:
    """What a hosted agent's exit report adds: the host it shared, and whose kill ended it."""
    if not live.host:
        return ""
    note = f" (its host process, pid {live.body.pid}, ran {', '.join(live.host)}"
    if live.ended_with is not None:
        note += f"; {live.ended_with} was killed"
    return note + ")"


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first non-cancellation exception of a (nested) group."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            return _first(exc)
        if not isinstance(exc, asyncio.CancelledError):
            return exc
    return group.exceptions[0]
