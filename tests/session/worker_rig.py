"""A rig for driving real workers over a real router, the test acting as the coordinator.

The router runs in the test process on a short /tmp socket with the default closed policy
(`Policy.default(os.getpid())`); a node connection `node.<id>` makes every `bus.expect`, as a
node does; the coordinator `<tag>.coordinator` and launcher `<tag>.launcher` (the supervisor)
are expected session clients. Workers run in-process (`run_worker` as a task on the test loop)
unless a test starts them otherwise.

Every reply that passes through `Rig.call` is checked against `schemas/session/outcome.json`
and, for a result, against the method's `schemas/session/methods/<method>.result.json` with
`jsonschema` (Draft 2020-12): the tests validate real traffic, not hand-written samples.

Fixture: `rig` (import it into a test module: `from tests.session.worker_rig import rig`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from bus.client import BusClient, connect
from bus.client_calls import CallResult
from bus.errors import CallGone, NoService
from bus.policy import Policy
from bus.router import Router, RouterConfig
from workers.bodies import run_worker
from workers.composition import config_asset
from workers.faults import Faults
from workers.launch import AgentSettings, EnvironmentSettings, WorkerLaunch
from workers.roles import endpoint_for
from workers.shell import Endpoint
from workers.synthetic import FakeBrain
from workers.synthetic.frame import render_frame
from workers.synthetic.task import context
from workers.types.canonical import typed_digest
from workers.types.datatypes import VIEW_CONTENT_TYPE, ViewRef, encode_media
from workers.types.ticks import RationalNs

ROOT = Path(__file__).resolve().parents[2] / "schemas" / "session"
SESSION = "demo"
EPOCH = "e1"
TAG = "s7"
STEP = RationalNs(50_000_000, 3)
TICK = RationalNs(1_000_000, 1)
WAIT = 10.0


def _load(path: Path) -> Draft202012Validator:
    schema = json.loads(path.read_text())
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


OUTCOME = _load(ROOT / "outcome.json")
REQUEST = _load(ROOT / "request.json")
_METHOD_SCHEMAS: dict[str, Draft202012Validator] = {}


def method_schema(method: str, kind: str) -> Draft202012Validator:
    key = f"{method}.{kind}"
    if key not in _METHOD_SCHEMAS:
        _METHOD_SCHEMAS[key] = _load(ROOT / "methods" / f"{key}.json")
    return _METHOD_SCHEMAS[key]


def check_traffic(method: str, payload: dict[str, Any], outcome: dict[str, Any]) -> None:
    """Validate a real reply (and its request when it is well-formed) against the schemas."""
    OUTCOME.validate(outcome)
    if outcome["type"] == "result":
        method_schema(method, "result").validate(outcome["result"])
        REQUEST.validate(payload)
        method_schema(method, "params").validate(payload["params"])


def scope(step: int | str, epoch: str = EPOCH, session: str = SESSION) -> dict[str, str]:
    return {"sessionId": session, "epoch": epoch, "step": str(step)}


def service_of(worker_id: str, role: str, tag: str = TAG) -> str:
    return f"{tag}.{'agent' if role == 'agent' else 'env'}.{worker_id}"


def agent_launch(socket: str, agent_id: str = "fly-a", port: str = "p1", *,
                 faults: Faults | None = None, threads: int = 1, generation: int = 1,
                 tag: str = TAG, session: str = SESSION, warmup: int = 10,
                 tick: RationalNs = TICK, model: str = "workers.synthetic:FakeBrain",
                 model_config: dict[str, Any] | None = None, max_agents: int = 4,
                 callers: tuple[str, ...] | None = None) -> WorkerLaunch:
    return WorkerLaunch(
        socket=socket, session_id=session, worker_id=agent_id,
        incarnation_id=f"{agent_id}-inc-{generation}",
        client_id=f"{tag}.{agent_id}.g{generation}", service=service_of(agent_id, "agent", tag),
        supervisor=f"{tag}.launcher",
        callers=callers or (f"{tag}.coordinator", f"{tag}.launcher", "node.rig"),
        threads=threads, max_agents=max_agents,
        settings=AgentSettings(port, model=model, model_config=model_config or {}, tick=tick,
                               warmup_ticks=warmup),
        faults=faults or Faults())


def environment_launch(socket: str, world_id: str = "arena", ports: tuple[str, ...] = ("p1", "p2"),
                       *, faults: Faults | None = None, threads: int = 1, generation: int = 1,
                       tag: str = TAG, session: str = SESSION, delay: int = 0,
                       step: RationalNs = STEP, max_agents: int = 4) -> WorkerLaunch:
    return WorkerLaunch(
        socket=socket, session_id=session, worker_id=world_id,
        incarnation_id=f"{world_id}-inc-{generation}",
        client_id=f"{tag}.{world_id}.g{generation}",
        service=service_of(world_id, "environment", tag), supervisor=f"{tag}.launcher",
        callers=(f"{tag}.coordinator", f"{tag}.launcher", "node.rig"), threads=threads,
        max_agents=max_agents,
        settings=EnvironmentSettings(ports, step=step, observation_delay_steps=delay),
        faults=faults or Faults())


# --------------------------------------------------------------------------------------------
# synthetic params


def view_ref(counter: int, boundary: int, produced: int | None = None) -> dict[str, Any]:
    produced = boundary if produced is None else produced
    return ViewRef("arena", produced, encode_media(VIEW_CONTENT_TYPE,
                                                   render_frame(counter, produced))).to_json()


def sensory(boundary: int, views: list[dict[str, Any]]) -> dict[str, Any]:
    return {"boundary": str(boundary), "views": views, "structured": None}


def profile_of(agent_id: str, warmup: int = 10, tick: RationalNs = TICK) -> dict[str, Any]:
    return FakeBrain.profile(agent_id, tick, warmup, {}).to_json()


def agent_init_params(agent_id: str = "fly-a", seed: int = 7, *, threads: int = 1,
                      views: list[dict[str, Any]] | None = None,
                      ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "agentId": agent_id,
        "profile": profile_of(agent_id),
        "seed": seed,
        "initialInput": sensory(0, [view_ref(0, 0)] if views is None else views),
        "initialDecisionContext": ctx or context(0, boot=True).to_json(),
        "workerThreads": threads,
    }


def prepare_params(agent_id: str, context_digest: str,
                   stimuli: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "agentId": agent_id,
        "profileDigest": profile_of(agent_id)["digest"],
        "interval": STEP.to_json(),
        "decisionContextDigest": context_digest,
        "preStepStimulations": stimuli or [],
    }


def commit_params(agent_id: str, prepared: str, k: int, *, counter: int = 0,
                  rewards: list[dict[str, Any]] | None = None,
                  stimuli: list[dict[str, Any]] | None = None,
                  views: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "agentId": agent_id,
        "preparedRequestId": prepared,
        "nextInput": sensory(k + 1, [view_ref(counter, k + 1)] if views is None else views),
        "nextDecisionContext": context(k + 1, boot=False).to_json(),
        "rewards": rewards or [],
        "taskStimulations": stimuli or [],
    }


def boot_digest() -> str:
    return typed_digest(context(0, boot=True))


def context_digest(step: int) -> str:
    return typed_digest(context(step, boot=step == 0))


def env_init_params(bindings: list[list[str]] | None = None,
                    world_id: str = "arena") -> dict[str, Any]:
    return {
        "backendConfig": config_asset(f"{world_id}-config", {}).to_json(),
        "taskConfig": config_asset(f"{world_id}-task", {}).to_json(),
        "episodeId": "ep1",
        "portBindings": [["p1", "fly-a"], ["p2", "fly-b"]] if bindings is None else bindings,
    }


def control(port: str, inc: bool = False, dec: bool = False, bias: float = 0.0) -> dict[str, Any]:
    return {"portId": port, "buttons": [{"id": "inc", "down": inc}, {"id": "dec", "down": dec}],
            "axes": [{"id": "bias", "value": bias}]}


def advance_params(k: int, controls: list[dict[str, Any]] | None = None,
                   batch: str | None = None) -> dict[str, Any]:
    return {"batchId": batch or f"batch-{EPOCH}-{k}",
            "controls": [control("p1"), control("p2")] if controls is None else controls}


# --------------------------------------------------------------------------------------------
# the rig


@dataclass
class Running:
    launch: WorkerLaunch
    task: asyncio.Task[int]


@dataclass
class Rig:
    router: Router
    socket: str
    node: BusClient
    coordinator: BusClient
    supervisor: BusClient
    tag: str = TAG
    running: dict[str, Running] = field(default_factory=dict)
    serials: dict[str, int] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    others: list[BusClient] = field(default_factory=list)
    traffic: list[tuple[str, dict[str, Any], dict[str, Any]]] = field(default_factory=list)
    """Every `(method, payload, outcome)` that passed through `call`."""

    # starting workers -------------------------------------------------------------------------

    async def expect(self, launch: WorkerLaunch, pid: int | None = None) -> None:
        await self.node.expect(launch.client_id, pid or os.getpid(),
                               client_incarnation=launch.incarnation_id,
                               grants={"register": [launch.service], "call": []})

    async def start(self, launch: WorkerLaunch,
                    factory: Callable[[WorkerLaunch], Endpoint] | None = None,
                    stop_event: asyncio.Event | None = None) -> Running:
        """Expect, start `run_worker` as a task, wait until the service answers."""
        await self.expect(launch)
        task = asyncio.get_running_loop().create_task(
            run_worker(launch, stop_event=stop_event, endpoint_factory=factory or endpoint_for))
        running = Running(launch, task)
        self.running[launch.worker_id] = running
        self.roles[launch.worker_id] = launch.role
        await self.wait_registered(launch.worker_id)
        return running

    async def start_endpoint(self, launch: WorkerLaunch) -> Endpoint:
        """`start` with the role's endpoint, returned so a test can look inside the shell."""
        box: list[Endpoint] = []

        def factory(lw: WorkerLaunch) -> Endpoint:
            box.append(endpoint_for(lw))
            return box[0]

        await self.start(launch, factory)
        return box[0]

    async def wait_registered(self, worker_id: str, timeout: float = WAIT) -> None:
        """Probe with `Worker.Status` until the worker answers, retrying `NO_SERVICE` and
        `CALL_GONE` every 5 ms as the launcher's identify does (§7.5 step 3): the SDK can
        release a request that arrives in the same read as the registration's response."""
        service = service_of(worker_id, self.roles[worker_id], self.tag)
        probe = {"requestId": "req-1", "scope": None, "params": {}}
        async with asyncio.timeout(timeout):
            while True:
                try:
                    await self.node.call(service, "Worker.Status", probe, timeout=timeout)
                    return
                except (NoService, CallGone):
                    await asyncio.sleep(0.005)

    async def open_client(self, client_id: str) -> BusClient:
        """An expected session client (coordinator-like grants) with this id."""
        incarnation = "inc-" + uuid.uuid4().hex
        await self.node.expect(client_id, os.getpid(), client_incarnation=incarnation,
                               grants={"register": [],
                                       "call": [f"{self.tag}.agent.*", f"{self.tag}.env.*"]})
        client = await connect(self.socket, client_id=client_id, client_incarnation=incarnation)
        self.others.append(client)
        return client

    # calls ------------------------------------------------------------------------------------

    def next_id(self, worker_id: str) -> str:
        self.serials[worker_id] = self.serials.get(worker_id, 0) + 1
        return f"req-{self.serials[worker_id]}"

    async def raw(self, worker_id: str, method: str, payload: dict[str, Any], *,
                  client: BusClient | None = None, timeout: float = WAIT,
                  expected_incarnation: str | None = None) -> CallResult:
        service = service_of(worker_id, self.roles.get(worker_id, "agent"), self.tag)
        return await (client or self.coordinator).call(
            service, method, payload, timeout=timeout, expected_incarnation=expected_incarnation)

    async def call(self, worker_id: str, method: str, params: dict[str, Any],
                   scope: dict[str, str] | None = None, *, request_id: str | None = None,
                   client: BusClient | None = None, timeout: float = WAIT) -> dict[str, Any]:
        """One domain call; returns the outcome after checking it against the schemas."""
        payload = {"requestId": request_id or self.next_id(worker_id), "scope": scope,
                   "params": params}
        res = await self.raw(worker_id, method, payload, client=client, timeout=timeout)
        outcome = res.outcome
        self.traffic.append((method, payload, outcome))
        check_traffic(method, payload, outcome)
        assert outcome["requestId"] == payload["requestId"]
        assert outcome["scope"] == scope
        assert outcome["workerId"] == worker_id
        return outcome

    async def ok(self, worker_id: str, method: str, params: dict[str, Any],
                 scope: dict[str, str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """A call that must succeed; returns its result."""
        outcome = await self.call(worker_id, method, params, scope, **kwargs)
        assert outcome["type"] == "result", outcome
        result: dict[str, Any] = outcome["result"]
        return result

    async def error(self, worker_id: str, method: str, params: dict[str, Any],
                    scope: dict[str, str] | None = None, **kwargs: Any) -> dict[str, Any]:
        """A call that must fail; returns its error object."""
        outcome = await self.call(worker_id, method, params, scope, **kwargs)
        assert outcome["type"] == "error", outcome
        error: dict[str, Any] = outcome["error"]
        return error

    async def status(self, worker_id: str) -> dict[str, Any]:
        return await self.ok(worker_id, "Worker.Status", {})

    # synthetic shortcuts ----------------------------------------------------------------------

    async def init_agent(self, agent_id: str = "fly-a", seed: int = 7,
                         **kwargs: Any) -> dict[str, Any]:
        return await self.ok(agent_id, "Agent.Initialize", agent_init_params(agent_id, seed,
                                                                             **kwargs), scope(0))

    async def init_env(self, world_id: str = "arena", **kwargs: Any) -> dict[str, Any]:
        return await self.ok(world_id, "Environment.Initialize",
                             env_init_params(world_id=world_id, **kwargs), scope(0))

    async def stop_all(self) -> None:
        for running in self.running.values():
            if not running.task.done():
                running.task.cancel()
        await asyncio.gather(*(r.task for r in self.running.values()), return_exceptions=True)


def short_socket() -> tuple[str, str]:
    d = tempfile.mkdtemp(prefix="flyd-w-", dir="/tmp")
    return d, os.path.join(d, "bus.sock")


async def open_rig(tag: str = TAG) -> tuple[Rig, str]:
    d, path = short_socket()
    router = Router(RouterConfig(socket_path=path, policy=Policy.default(os.getpid())))
    await router.start()
    node = await connect(path, client_id="node.rig")
    clients: dict[str, BusClient] = {}
    for role in ("coordinator", "launcher"):
        client_id = f"{tag}.{role}"
        incarnation = "inc-" + uuid.uuid4().hex
        await node.expect(client_id, os.getpid(), client_incarnation=incarnation,
                          grants={"register": [], "call": [f"{tag}.agent.*", f"{tag}.env.*"]})
        clients[role] = await connect(path, client_id=client_id, client_incarnation=incarnation)
    rig = Rig(router, path, node, clients["coordinator"], clients["launcher"], tag=tag)
    return rig, d


async def close_rig(rig: Rig, d: str) -> None:
    await rig.stop_all()
    for client in (rig.coordinator, rig.supervisor, rig.node, *rig.others):
        await client.close()
    await rig.router.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    r, d = await open_rig()
    try:
        yield r
    finally:
        await close_rig(r, d)


async def wait_for(predicate: Callable[[], Any], timeout: float = WAIT,
                   interval: float = 0.005) -> None:
    """Poll an async or sync predicate until it is truthy."""
    async with asyncio.timeout(timeout):
        while True:
            value = predicate()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return
            await asyncio.sleep(interval)




# --------------------------------------------------------------------------------------------
# a minimal coordinator: bootstrap and lockstep transitions over the rig (session.md §6.5, §6.6)


@dataclass
class Transition:
    k: int
    prepared: dict[str, dict[str, Any]]
    advanced: dict[str, Any]
    committed: dict[str, dict[str, Any]]


class Driver:
    """The test as coordinator of the synthetic composition: no resolution, no fencing."""

    def __init__(self, rig: Rig, agents: tuple[tuple[str, str, int], ...] = (
            ("fly-a", "p1", 7), ("fly-b", "p2", 11)), world: str = "arena") -> None:
        from workers.synthetic import CounterTask, IdentityExecutor

        self.rig = rig
        self.agents = agents
        self.world = world
        self.task = CounterTask(epoch=EPOCH)
        self.executor = IdentityExecutor()
        self.observation: dict[str, Any] = {}
        self.contexts: dict[str, Any] = {}
        self.k = 0
        self.transitions: list[Transition] = []

    async def bootstrap(self) -> dict[str, Any]:
        from workers.types.datatypes import TypedValue

        env = await self.rig.ok(self.world, "Environment.Initialize", env_init_params(
            [[port, agent] for agent, port, _ in sorted(self.agents)], self.world), scope(0))
        self.observation = env["observation"]
        boot = self.task.bootstrap(TypedValue.from_json(self.observation["inspection"]),
                                   [(port, agent) for agent, port, _ in self.agents])
        owed: dict[str, list[str]] = {self.world: [f"req-{self.rig.serials[self.world]}"]}
        for agent, _port, seed in sorted(self.agents):
            ctx = boot.contexts[agent]
            params = agent_init_params(agent, seed, views=self.observation["sensoryViews"],
                                       ctx=ctx.to_json())
            result = await self.rig.ok(agent, "Agent.Initialize", params, scope(0))
            assert result["decisionContextDigest"] == typed_digest(ctx)
            self.contexts[agent] = ctx
            owed[agent] = [f"req-{self.rig.serials[agent]}"]
        for worker, ids in owed.items():
            await self.rig.ok(worker, "Worker.Acknowledge", {"requestIds": ids})
        return env

    async def step(self) -> Transition:
        from workers.types.datatypes import PortControl, TypedValue
        from workers.types.domain import Scope

        k = self.k
        prepared: dict[str, dict[str, Any]] = {}
        prepare_ids: dict[str, str] = {}

        async def prepare(agent: str) -> None:
            rid = self.rig.next_id(agent)
            prepare_ids[agent] = rid
            prepared[agent] = await self.rig.ok(
                agent, "Agent.Prepare", prepare_params(agent, typed_digest(self.contexts[agent])),
                scope(k), request_id=rid)

        await asyncio.gather(*(prepare(a) for a, _, _ in self.agents))
        ports = dict((a, p) for a, p, _ in self.agents)
        controls = []
        for agent, _, _ in sorted(self.agents):
            decision = TypedValue.from_json(prepared[agent]["decision"])
            intent = self.executor.apply(Scope(SESSION, EPOCH, k), decision,
                                         TypedValue.from_json(self.observation["inspection"]),
                                         self.task.progress(), RationalNs.zero())
            controls.append(intent.for_port(ports[agent]))
        controls.sort(key=lambda c: c.port_id)
        advanced = await self.rig.ok(self.world, "Environment.Advance",
                                     advance_params(k, [c.to_json() for c in controls]),
                                     scope(k))
        old = TypedValue.from_json(self.observation["inspection"])
        self.observation = advanced["observation"]
        evaluation = self.task.evaluate_transition(
            Scope(SESSION, EPOCH, k), old, TypedValue.from_json(self.observation["inspection"]),
            [PortControl.from_json(c.to_json()) for c in controls])
        committed: dict[str, dict[str, Any]] = {}

        async def commit(agent: str) -> None:
            outcome = evaluation.outcomes[agent]
            params = {
                "agentId": agent, "preparedRequestId": prepare_ids[agent],
                "nextInput": sensory(k + 1, self.observation["sensoryViews"]),
                "nextDecisionContext": evaluation.next_contexts[agent].to_json(),
                "rewards": [r.to_json() for r in outcome.rewards],
                "taskStimulations": [s.to_json() for s in outcome.stimulations],
            }
            committed[agent] = await self.rig.ok(agent, "Agent.Commit", params, scope(k))

        await asyncio.gather(*(commit(a) for a, _, _ in self.agents))
        for agent, _, _ in self.agents:
            self.contexts[agent] = evaluation.next_contexts[agent]
        self.k = k + 1
        transition = Transition(k, prepared, advanced, committed)
        self.transitions.append(transition)
        return transition
