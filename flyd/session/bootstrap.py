"""Bootstrap (design/session.md §6.5): the checks of each step that brings a session to `Ready(0)`.

Why a module of its own: bootstrap is the one place where the coordinator learns who its
workers are (their pinned incarnations), what the world declares (descriptor, O[0]) and what
each agent starts from (graph, telemetry, ticks). Each step here sends through the session's
call engine (`flyd.session.calls`), checks the reply exactly as design/session.md §6.5 says and
returns what it learnt; the coordinator runs the steps in order and keeps the results, so what it
installs is visible in one place.

Steps (numbers of design/session.md §6.5):
1. `hello`: `Worker.Hello` (scope null), `workerId` and `role` as expected, the coordinator's
   `contractDigest`, the role's step capability (else `IDENTITY_MISMATCH`/`UNSUPPORTED`,
   blamed on `Worker.Hello`); pins the returned incarnation.
2. `initialize_environment`: `Environment.Initialize`; the descriptor's ports are the
   composition's (else detail `port-assignment`); O[0] at boundary 0, world time 0/1, the
   descriptor's inspection schema, no audio, every view at producedStep 0 and decodable.
3. `bootstrap_task`: every event has sourceStep 0 and every agent a context (else detail
   `task-bootstrap`).
4. `initialize_agent`: `Agent.Initialize`; committed step 0, the configured profile digest,
   the context digest, valid telemetry whose rates follow the graph; fills the slot.
5. `acknowledge_lifecycle`: one `Worker.Acknowledge` per worker with its owed ids; with
   `duplicate_lifecycle_acknowledge`, a second one that must release nothing.
Every failure is a `Blame` (the caller's `guarded` fails the epoch with it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bus.client_artifacts import Attachment
from flyd.session.calls import (
    Blame,
    Call,
    CallEngine,
    backend_failure,
    identity_mismatch,
)
from flyd.session.fence import Detail
from flyd.session.injections import InjectionOutcome
from flyd.session.inputs import sensory_inputs
from flyd.session.media import Media, check_views
from flyd.session.runspec import RunSpec
from flyd.session.slots import AgentSlot
from flyd.session.task_output import task_error
from workers.artifacts import open_attached
from workers.composition import config_asset
from workers.protocols import Bootstrap, Task
from workers.types.contract import contract_digest
from workers.types.datatypes import EnvironmentDescriptor, Graph, Telemetry, WorldObservation
from workers.types.domain import DomainError, ErrorCode, Mutation, Scope, parse_u64
from workers.types.ticks import RationalNs

__all__ = [
    "WorldStart",
    "acknowledge_lifecycle",
    "bootstrap_task",
    "hello",
    "initialize_agent",
    "initialize_environment",
]


@dataclass(frozen=True)
class WorldStart:
    """What `Environment.Initialize` established: the descriptor, O[0] and its decoded views,
    and the request id owed an acknowledgement."""

    descriptor: EnvironmentDescriptor
    observation: WorldObservation
    media: Media
    request_id: str


async def hello(calls: CallEngine, session_id: str, worker_id: str, role: str,
                capability: str) -> list[str]:
    """The worker's capabilities, once its answer passed the checks of step 1."""
    call = calls.new_call(worker_id, "Worker.Hello", None, {
        "sessionId": session_id, "expectedWorkerId": worker_id, "role": role,
        "supportedMajors": [1]})
    result = await calls.blamed(call)
    problem: DomainError | None = None
    if result.get("workerId") != worker_id or result.get("role") != role:
        problem = identity_mismatch(f"Worker.Hello: {worker_id} answers as "
                                    f"{result.get('workerId')}/{result.get('role')}, expected "
                                    f"{worker_id}/{role}")
    elif result.get("contractDigest") != contract_digest():
        problem = identity_mismatch(f"Worker.Hello: {worker_id} has contract "
                                    f"{result.get('contractDigest')}, expected "
                                    f"{contract_digest()}")
    elif capability not in result.get("capabilities", []):
        problem = DomainError(ErrorCode.UNSUPPORTED,
                              f"Worker.Hello: {worker_id} lacks {capability}", Mutation.NONE)
    if problem is not None:
        raise Blame(problem, "Worker.Hello", worker_id)
    calls.pin(worker_id, result["incarnationId"])
    return [str(c) for c in result.get("capabilities", [])]


async def initialize_environment(calls: CallEngine, spec: RunSpec, scope: Scope,
                                 bindings: Sequence[tuple[str, str]]) -> WorldStart:
    world = spec.world
    wid = world.world_id
    call = calls.new_call(wid, "Environment.Initialize", scope, {
        "backendConfig": config_asset(f"{wid}-config", dict(world.config)).to_json(),
        "taskConfig": config_asset(f"{wid}-task", dict(spec.task.config)).to_json(),
        "episodeId": spec.episode_id,
        "portBindings": [[p, a] for p, a in bindings]})
    result = await calls.blamed(call)
    received = calls.take_attachments(call)
    try:
        return _world_start(calls, call, result, received, wid, bindings)
    except BaseException:
        calls.drop([a.artifact_id for a in received])
        raise


def _world_start(calls: CallEngine, call: Call, result: dict[str, Any],
                 received: tuple[Attachment, ...], wid: str,
                 bindings: Sequence[tuple[str, str]]) -> WorldStart:
    """Check `Environment.Initialize`'s result; its media hold `received`."""
    try:
        descriptor = EnvironmentDescriptor.from_json(result["descriptor"])
        observation = WorldObservation.from_json(result["observation"])
    except DomainError as exc:
        raise Blame(backend_failure(f"Environment.Initialize: {exc.message}"),
                    "Environment.Initialize", wid) from None
    ports = sorted(p.port_id for p in descriptor.ports)
    want = sorted(p for p, _ in bindings)
    if ports != want:
        raise Blame(identity_mismatch(f"the world declares ports {ports}; the composition "
                                      f"binds {want}"), Detail.PORT_ASSIGNMENT, wid)
    try:
        if observation.boundary != 0 or not observation.world_time.is_zero():
            raise backend_failure("O[0] is not at boundary 0, world time 0/1")
        if observation.inspection.schema != descriptor.inspection_schema:
            raise backend_failure("O[0] inspection schema differs from the descriptor's")
        if observation.audio:
            raise backend_failure("O[0] carries audio")
        attached = open_attached(calls.client, received) if received else None
        media = check_views(descriptor, observation, 0, Mutation.NONE, attached)
    except DomainError as exc:
        raise Blame(exc, "Environment.Initialize", wid) from None
    media.held = tuple(a.artifact_id for a in received)
    return WorldStart(descriptor, observation, media, call.request_id)


def bootstrap_task(task: Task, observation: WorldObservation,
                   bindings: Sequence[tuple[str, str]], agent_ids: Sequence[str],
                   plugin: str) -> Bootstrap:
    """The task's bootstrap, checked; `plugin` is the task's import path, named when a value
    it built cannot be encoded (`flyd.session.task_output`)."""
    try:
        boot = task.bootstrap(observation.inspection, bindings)
        for event in boot.events:
            if event.source_step != 0:
                raise backend_failure(f"bootstrap event {event.id} has sourceStep "
                                      f"{event.source_step}")
        for agent_id in agent_ids:
            if agent_id not in boot.contexts:
                raise backend_failure(f"the task gives {agent_id} no decision context")
    except Exception as exc:
        raise Blame(task_error(exc, plugin), Detail.TASK_BOOTSTRAP, None) from None
    return boot


async def initialize_agent(calls: CallEngine, scope: Scope, agent_id: str, slot: AgentSlot,
                           observation: WorldObservation, structured: bool = False) -> str:
    """`Agent.Initialize` of one agent, its slot filled; the request id owed an acknowledgement.
    `structured`: O[0]'s inspection is the agent's structured input (the world offers it)."""
    assert slot.context is not None
    try:
        inputs = sensory_inputs(observation, [(slot.spec.port_id, agent_id)], structured, 0,
                                Mutation.UNKNOWN)
    except DomainError as exc:
        raise Blame(exc, "Agent.Initialize", None) from None
    call = calls.new_call(agent_id, "Agent.Initialize", scope, {
        "agentId": agent_id, "profile": slot.profile, "seed": slot.seed,
        "initialInput": inputs.json[agent_id],
        "initialDecisionContext": slot.context.to_json(),
        "workerThreads": slot.spec.threads},
        attachments=inputs.attachments[agent_id])
    result = await calls.blamed(call)
    try:
        if result.get("committedStep") != "0":
            raise backend_failure(f"Agent.Initialize: {agent_id} committed "
                                  f"{result.get('committedStep')}, expected 0")
        if result.get("profileDigest") != slot.profile["digest"]:
            raise identity_mismatch(f"Agent.Initialize: {agent_id} has profile "
                                    f"{result.get('profileDigest')}, expected "
                                    f"{slot.profile['digest']}")
        if result.get("decisionContextDigest") != slot.context_digest:
            raise identity_mismatch(f"Agent.Initialize: {agent_id} holds context "
                                    f"{result.get('decisionContextDigest')}, expected "
                                    f"{slot.context_digest}")
        graph = Graph.from_json(result["graph"])
        telemetry = Telemetry.from_json(result["telemetry"])
        telemetry.check_rates(graph)
        slot.tick_duration = RationalNs.from_json(result["tickDuration"])
        slot.warmup_ticks = parse_u64(result["warmupTicks"])
    except DomainError as exc:
        raise Blame(exc, "Agent.Initialize", agent_id) from None
    slot.graph = graph
    slot.telemetry = telemetry
    slot.committed_step = 0
    return call.request_id


async def acknowledge_lifecycle(calls: CallEngine, owed: Mapping[str, Sequence[str]],
                                workers: Sequence[str], twice: bool,
                                log: list[InjectionOutcome]) -> None:
    """Step 5 for `workers` in order; `twice`: `duplicate_lifecycle_acknowledge`."""
    for worker_id in workers:
        ids = owed.get(worker_id, [])
        if not ids:
            continue
        await calls.acknowledge(worker_id, ids)
        if twice:
            again = await calls.acknowledge(worker_id, ids)
            log.append(InjectionOutcome("duplicate-lifecycle-acknowledge", None, again == []))
