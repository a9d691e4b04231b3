"""The session test harness (session.md §7.8): a router, a node connection, a launcher, the
participants in any execution mode, and a coordinator, wired as a node wires them.

    async with SessionHarness.start(Fixture(mode=ExecutionMode.THREAD)) as h:
        await h.bootstrap()
        reports = await h.run(3)

`Fixture` = the synthetic run spec (`RunSpec()`, the `SessionSpec.synthetic()` of §4.7) plus
`mode` (default in-process), `order`, `faults` per worker, `thread_budget`, `health`,
`deadlines`, `injections`, `pacing`, `terminal`, `agents` (to change the composition),
`media_inline_max_bytes` (the node's threshold for media by reference, docs/topics.md §14.2),
`router_limits` and `router_store` (the in-process router's `Limits` and `StoreSettings`),
`composition` (a run spec whose agents, world, task and executor replace the synthetic ones: a
plugin composition), `router` (`"test"`: in the test process; `"process"`: a child
`python -m flyd router` with the default closed policy, stopped by SIGTERM) and `run_id` (the
harness then plays the node's part of the run topic, docs/topics.md §14.1: its node connection
declares `flyd.run.<run_id>` as `h.topic`, and the coordinator publishes through `h.publisher`
with the node's coordinator grants).
`harness.router.shutdown()` stops either. Every helper works in every mode: `status_of` and
`progress_of` ask `Worker.Status` over the bus through the launcher; `kill(id)` is
`launcher.kill` and is bound as the coordinator's `kill` injection.
`WAIT` (20 s) bounds every awaited operation of the helpers.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from bus.client import BusClient, connect
from bus.client_topics import Topic
from bus.limits import Limits
from bus.policy import Policy
from bus.router import Router, RouterConfig
from bus.store import StoreSettings
from flyd.launch.budget import ThreadBudget
from flyd.launch.health import HealthPolicy
from flyd.launch.identities import SessionNames, SessionTags, WorkerRef, new_node_id, node_client_id
from flyd.launch.launcher import (
    AlreadyGone,
    ExecutionMode,
    LaunchedWorker,
    Launcher,
    Terminated,
    connect_expected,
    start_error,
)
from flyd.launch.spawner import LauncherSettings, Spawner
from flyd.node.router_child import router_answers
from flyd.session.calls import Deadlines
from flyd.session.coordinator import Coordinator
from flyd.session.injections import Injections
from flyd.session.profiles import model_profiles
from flyd.session.run_topic import RunPublisher
from flyd.session.runspec import AgentSpec, RunSpec, TaskSpec
from flyd.session.stepping import PauseHandle, StepReport
from flyd.session.transition import DispatchOrder
from workers.bodies import EndpointFactory
from workers.faults import Faults
from workers.launch import DEFAULT_MEDIA_INLINE_MAX_BYTES
from workers.plugins import load_plugin
from workers.synthetic.executor import IdentityExecutor
from workers.synthetic.task import CounterTask
from workers.types.domain import DomainError

WAIT = 20.0
T = TypeVar("T")

ALL_MODES = (ExecutionMode.PROCESS, ExecutionMode.THREAD, ExecutionMode.IN_PROCESS)


@dataclass
class Fixture:
    mode: ExecutionMode = ExecutionMode.IN_PROCESS
    order: DispatchOrder = DispatchOrder.CONCURRENT
    faults: dict[str, Faults] = field(default_factory=dict)
    thread_budget: int = 16
    health: HealthPolicy | None = None
    deadlines: Deadlines | None = None
    injections: Injections | None = None
    pacing: str = "off"
    terminal: str = "never"
    agents: tuple[AgentSpec, ...] | None = None
    epoch: str = "e1"
    router: str = "test"
    composition: RunSpec | None = None
    run_id: int | None = None
    #: the node's `[session] media_inline_max_bytes` (docs/topics.md §14.2)
    media_inline_max_bytes: int = DEFAULT_MEDIA_INLINE_MAX_BYTES
    #: the in-process router's limits and store (`RouterConfig.limits`, `.store`; None: its
    #: defaults)
    router_limits: Limits | None = None
    router_store: StoreSettings | None = None

    def spec(self) -> RunSpec:
        if self.composition is not None:
            return replace(self.composition, mode=self.mode.label(), dispatch=self.order.value,
                           pacing=self.pacing)
        base = RunSpec()
        agents = self.agents if self.agents is not None else base.agents
        agents = tuple(replace(a, faults=self.faults.get(a.agent_id, a.faults)) for a in agents)
        world = replace(base.world, faults=self.faults.get(base.world.world_id,
                                                           base.world.faults))
        return replace(base, mode=self.mode.label(), dispatch=self.order.value,
                       pacing=self.pacing, agents=agents, world=world,
                       task=TaskSpec(terminal=self.terminal))


async def within(awaitable: Awaitable[T], seconds: float = WAIT) -> T:
    async with asyncio.timeout(seconds):
        return await awaitable


class RouterHandle:
    """The harness's router: in the test process (`Router`) or a child `flyd router`."""

    def __init__(self, socket: str, in_process: bool, limits: Limits | None = None,
                 store: StoreSettings | None = None) -> None:
        self.socket = socket
        self.in_process = in_process
        self.limits = limits
        self.store = store
        self._router: Router | None = None
        self._child: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        if self.in_process:
            given: dict[str, Any] = {"limits": self.limits, "store": self.store}
            self._router = Router(RouterConfig(
                socket_path=self.socket, policy=Policy.default(os.getpid()),
                **{k: v for k, v in given.items() if v is not None}))
            await self._router.start()
            return
        self._child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "flyd", "router", "--socket", self.socket,
            "--log-format", "json", stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.monotonic() + WAIT
        while not await asyncio.to_thread(router_answers, self.socket):
            if self._child.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError("the router child did not start")
            await asyncio.sleep(0.01)

    @property
    def pid(self) -> int | None:
        return None if self._child is None else self._child.pid

    async def shutdown(self) -> None:
        """Stop the router (SIGTERM for a child, then SIGKILL after WAIT)."""
        if self._router is not None:
            router, self._router = self._router, None
            await router.stop()
        if self._child is not None and self._child.returncode is None:
            self._child.terminate()
            try:
                await within(self._child.wait())
            except TimeoutError:
                self._child.kill()
                await self._child.wait()


class SessionHarness:
    """A running session: router, node connection, launcher, workers and coordinator."""

    def __init__(self, fixture: Fixture, directory: str, socket: str, router: RouterHandle,
                 node: BusClient, names: SessionNames, budget: ThreadBudget) -> None:
        self.fixture = fixture
        self.directory = directory
        self.socket = socket
        self.router = router
        self.node = node
        self.names = names
        self.budget = budget
        self.spec = fixture.spec()
        self.launcher: Launcher | None = None
        self.spawner: Spawner | None = None
        self.coordinator_client: BusClient | None = None
        self._coordinator: Coordinator | None = None
        self.workers: dict[str, LaunchedWorker] = {}
        self.task: CounterTask | None = None
        self.publisher = None if fixture.run_id is None else RunPublisher(fixture.run_id)
        #: the coordinators' pause request (§6.7): `h.pause.request()`
        self.pause = PauseHandle()
        self.topic: Topic | None = None

    @classmethod
    @asynccontextmanager
    async def start(cls, fixture: Fixture | None = None) -> AsyncIterator[SessionHarness]:
        fixture = fixture or Fixture()
        directory = tempfile.mkdtemp(prefix="flyd-h-", dir="/tmp")
        socket = os.path.join(directory, "bus.sock")
        router = RouterHandle(socket, in_process=fixture.router != "process",
                              limits=fixture.router_limits, store=fixture.router_store)
        node: BusClient | None = None
        harness: SessionHarness | None = None
        try:
            await router.start()
            node_id = new_node_id("harness")
            node = await connect(socket, client_id=node_client_id(node_id))
            names = SessionNames(session_id="demo", tag=SessionTags().next(), node_id=node_id)
            budget = ThreadBudget(fixture.thread_budget, 1)
            harness = cls(fixture, directory, socket, router, node, names, budget)
            await within(harness._open())
            yield harness
        finally:
            if harness is not None:
                await harness.close()
            if node is not None:
                await node.close()
            await router.shutdown()
            shutil.rmtree(directory, ignore_errors=True)

    async def _open(self) -> None:
        fixture = self.fixture
        self.spawner = Spawner(LauncherSettings(
            media_inline_max_bytes=fixture.media_inline_max_bytes), socket=self.socket)
        self.launcher = await Launcher.open(names=self.names, socket=self.socket, node=self.node,
                                            budget=self.budget, health=fixture.health,
                                            endpoint_factory=self.endpoint_factory(),
                                            spawner=self.spawner)
        try:
            self.workers = await self.launcher.launch_composition(self.spec, fixture.mode)
        except DomainError as exc:
            raise start_error(exc) from None
        publisher = self.publisher
        if publisher is not None:
            self.topic = await self.node.declare(publisher.topic, retain=True, max_bounded=0)
        self.coordinator_client = await connect_expected(
            self.node, self.socket, self.names.coordinator_client_id,
            grants=self.names.coordinator_grants(fixture.run_id),
            on_publish_failed=None if publisher is None else publisher.on_publish_failed)
        self._coordinator = self.new_coordinator()

    def endpoint_factory(self) -> EndpointFactory | None:
        """How thread and in-process workers are built (None: the role's own endpoint); a
        test harness overrides it to observe or alter an endpoint."""
        return None

    def new_coordinator(self, epoch: str | None = None) -> Coordinator:
        """A coordinator over the current workers (not bootstrapped)."""
        assert self.coordinator_client is not None
        fixture = self.fixture
        epoch = epoch or fixture.epoch
        spec = self.spec
        executor: Any
        if fixture.composition is None:
            self.task = CounterTask(terminal=spec.task.terminal, epoch=epoch)
            executor = IdentityExecutor()
        else:
            self.task = load_plugin(spec.task.impl, "task")(
                config=dict(spec.task.config), terminal=spec.task.terminal, max_agents=4,
                epoch=epoch)
            executor = load_plugin(spec.executor.impl, "executor")(
                config=dict(spec.executor.config))
        injections = fixture.injections or Injections()
        if injections.kill is None:
            injections = replace(injections, kill=self.kill)
        coordinator = Coordinator(
            self.spec, self.coordinator_client, self.refs(), task=self.task,
            profiles=model_profiles(self.spec), executor=executor, deadlines=fixture.deadlines,
            order=fixture.order, injections=injections, epoch=epoch, publisher=self.publisher,
            pause=self.pause)
        if fixture.pacing == "off":
            coordinator.disable_pacing()
        return coordinator

    @property
    def coordinator(self) -> Coordinator:
        assert self._coordinator is not None
        return self._coordinator

    @property
    def launched(self) -> Launcher:
        assert self.launcher is not None
        return self.launcher

    def refs(self) -> dict[str, WorkerRef]:
        return {wid: w.worker_ref() for wid, w in self.launched.workers().items()}

    async def close(self) -> None:
        if self.launcher is not None:
            with _quiet():
                await within(self.launcher.close())
            self.launcher = None
        if self.coordinator_client is not None:
            await self.coordinator_client.close()
            self.coordinator_client = None
        if self.spawner is not None:
            await within(self.spawner.close())
            self.spawner = None

    # ------------------------------------------------------------------ helpers

    async def bootstrap(self) -> None:
        await within(self.coordinator.bootstrap())

    async def run(self, n: int) -> list[StepReport]:
        return await within(self.coordinator.run(n), WAIT + n * 2.0)

    async def step(self) -> StepReport:
        return await within(self.coordinator.step())

    async def restart_agent(self, agent_id: str) -> LaunchedWorker:
        launched = await within(self.launched.restart(agent_id))
        self.workers[agent_id] = launched
        return launched

    async def restart_environment(self) -> LaunchedWorker:
        return await self.restart_agent(self.spec.world.world_id)

    async def replace_all_participants(self) -> None:
        for wid in self.spec.worker_ids():
            launched = await within(self.launched.restart(wid))
            self.workers[wid] = launched
            self.coordinator.replace_participant(wid, launched.worker_ref())

    async def kill(self, worker_id: str) -> Terminated | AlreadyGone:
        return await within(self.launched.kill(worker_id))

    async def status_of(self, worker_id: str) -> dict[str, Any]:
        return await within(self.launched.health_check(worker_id))

    async def progress_of(self, worker_id: str) -> int:
        return int((await self.status_of(worker_id))["progressCounter"])

    async def mutations_of(self, agent_id: str) -> int:
        return await self.progress_of(agent_id)

    async def client(self, client_id: str) -> BusClient:
        """A raw bus connection attempt (raises the refusal's BusError)."""
        return await within(connect(self.socket, client_id=client_id))


class _quiet:
    """Suppress every exception but cancellation (teardown must not mask a test failure)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> bool:
        return kind is not None and issubclass(kind, Exception)


HarnessFactory = Callable[..., Awaitable[SessionHarness]]
