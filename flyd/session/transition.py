"""One transition k → k+1 up to its commit (design/session.md §6.6, phases A to D).

Why a module of its own: the transaction is the part of the coordinator a reader comes for, and
it reads best as its steps in order — Prepare every agent, turn the decisions into controls,
Advance the world, check what it observed, let the task evaluate, Commit every agent — apart from
the session state that lives across boundaries. Like capture and restore, a `Transition` reads
the coordinator's public side (`TransitionSource`) and returns what it produced (`NextBoundary`);
the coordinator adopts that at `Ready(k+1)` (phase E) and decides on a pause (phase F). The only
session state it writes is the in-flight part that a failure drops: each agent slot's prepared
result, decision and request ids, and the in-flight media (through `stage_media`).

Rules:
- Phase A: `Agent.Prepare` to every agent in the dispatch order (`DispatchOrder`); the results
  are checked in agent-id order: the decision names its agent and has the executor's
  `decision_schema` (else `IDENTITY_MISMATCH`, blamed on the agent).
- Phase B: the controls (`flyd.session.advance.controls_for`), then `Environment.Advance` with
  batch `batch-<epoch>-<k>`.
- Phase C: the Advance's result checked (`check_advance`), its attachments held as the in-flight
  media; then the task's evaluation of the transition, which must cover every agent (any
  failure of the task is detail `task-evaluate`, `flyd.session.task_output`).
- Phase D: `Agent.Commit` to every agent with its next input (`flyd.session.inputs`), checked:
  the committed step is k+1 and the decision context digest is the evaluation's. Every
  failure, an unresolved Commit included, uses detail `commit` (more specific than
  design/session.md §6.8 step 3).
- The executor's `clock` argument is the world time of boundary k.
- Structured input: when the world's `Worker.Hello` listed `structured-observation-v1`
  (`workers.protocols.STRUCTURED_OBSERVATION`), the inspection of boundary b is every agent's
  `structured` input of b (Initialize and Commit); otherwise it is null.
- Injections (design/session.md §6.13) act through the session's `Injections` hook at the points the
  table names; the hook does nothing unless a test or a run spec's faults asked for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from flyd.session.advance import check_advance, controls_for
from flyd.session.audio import AudioTimelines
from flyd.session.calls import Blame, Call, CallEngine, backend_failure, identity_mismatch
from flyd.session.fence import Detail
from flyd.session.injections import Injections
from flyd.session.inputs import sensory_inputs
from flyd.session.media import Media
from flyd.session.phase import Applying, Committing, Observing, Preparing
from flyd.session.stats import Stats
from flyd.session.task_output import check_evaluation, task_error
from flyd.session.view import SessionView
from workers.artifacts import open_attached
from workers.protocols import ActionExecutor, Evaluation
from workers.types.canonical import controls_digest, typed_digest
from workers.types.datatypes import Graph, PortControl, Telemetry, TypedValue, WorldObservation
from workers.types.domain import DomainError, Mutation, Scope
from workers.types.rpc import CallOutcome

__all__ = ["DispatchOrder", "NextBoundary", "Transition", "TransitionSource"]


class DispatchOrder(Enum):
    """How per-agent calls leave (design/session.md §6.1); results are always read in agent-id
    order."""

    CONCURRENT = "concurrent"
    SEQUENTIAL = "sequential"
    REVERSED = "reversed"

    @classmethod
    def from_label(cls, label: str) -> DispatchOrder:
        return cls(label)


class TransitionSource(SessionView, Protocol):
    """What a transition reads of the session besides its composition and slots."""

    @property
    def executor(self) -> ActionExecutor: ...
    @property
    def order(self) -> DispatchOrder: ...
    @property
    def injections(self) -> Injections: ...
    @property
    def stats(self) -> Stats: ...
    @property
    def epoch(self) -> str: ...
    @property
    def observation(self) -> WorldObservation | None: ...
    @property
    def structured_input(self) -> bool: ...
    def bindings(self) -> list[tuple[str, str]]: ...


@dataclass(frozen=True)
class NextBoundary:
    """What transition k → k+1 produced, for the coordinator to adopt at `Ready(k+1)`."""

    scope: Scope
    batch_id: str
    controls: list[PortControl]
    controls_digest: str
    advance_request_id: str
    observation: WorldObservation
    evaluation: Evaluation
    commits: dict[str, dict[str, Any]]
    telemetry: dict[str, Telemetry]
    #: each agent's structured-input digest as its Commit sent it (the behaviour record's)
    input_digests: dict[str, str | None]


class Transition:
    """Phases A to D of one transition from the committed boundary `k`; `progress` is the
    task's progress at k, `audio` the committed audio timelines (read, not advanced), and
    `stage_media` hands the decoded media of k+1 to the session as its in-flight media."""

    def __init__(self, session: TransitionSource, calls: CallEngine, k: int, *,
                 progress: TypedValue, audio: AudioTimelines,
                 stage_media: Callable[[Media], None]) -> None:
        assert session.descriptor is not None and session.observation is not None
        self.session = session
        self.calls = calls
        self.k = k
        self.scope = Scope(session.spec.session_id, session.epoch, k)
        self.batch_id = f"batch-{session.epoch}-{k}"
        self.descriptor = session.descriptor
        self.old = session.observation
        self.progress = progress
        self.audio = audio
        self.stage_media = stage_media
        self.injections = session.injections
        self.agent_ids = session.agent_ids
        self.slots = session.slots

    async def run(self) -> NextBoundary:
        """The phases in order; every failure raises (`Blame` or a `DomainError`) for the
        caller's `guarded` to fail the epoch with."""
        calls, k = self.calls, self.k
        calls.move(Preparing(k), Detail.STEP)
        await self.prepare()
        calls.move(Applying(k), Detail.STEP)
        controls = controls_for(self.scope, self.descriptor, self.agent_ids, self.slots,
                                self.session.executor, self.progress, self.old)
        wire_controls = [c.to_json() for c in controls]
        digest = controls_digest(wire_controls)
        advance, result = await self.advance(wire_controls)
        calls.move(Observing(k + 1), Detail.STEP)
        new = await self.observe(advance, result, digest)
        evaluation = self.evaluate(new, controls)
        calls.move(Committing(k), Detail.STEP)
        commits, telemetry, digests = await self.commit(new, evaluation)
        return NextBoundary(self.scope, self.batch_id, controls, digest, advance.request_id,
                            new, evaluation, commits, telemetry, digests)

    def agents_in_order(self) -> list[str]:
        if self.session.order is DispatchOrder.REVERSED:
            return list(reversed(self.agent_ids))
        return list(self.agent_ids)

    async def dispatch(self, calls: list[Call], *, kills: bool = False
                       ) -> dict[str, CallOutcome]:
        """Send one call per agent in the dispatch order; with `kills`, the kill injections of
        this step run once every call was dispatched."""
        outcomes: dict[str, CallOutcome] = {}
        engine = self.calls
        concurrent = self.session.order is DispatchOrder.CONCURRENT

        async def one(call: Call) -> None:
            outcomes[call.worker_id] = await engine.send(call, engine.deadline_of(call.method))

        async def kill() -> None:
            # one loop pass, so that every call has left (a step without kills saves it)
            await asyncio.sleep(0)
            await self.injections.kill_dispatched(self.k)

        async with asyncio.TaskGroup() as tg:
            if concurrent:
                for call in calls:
                    tg.create_task(one(call))
                if kills:
                    await kill()
            else:
                for index, call in enumerate(calls):
                    task = tg.create_task(one(call))
                    if index == len(calls) - 1 and kills:
                        await kill()
                    await task
        return outcomes

    # ------------------------------------------------------------------ A. Prepare

    async def prepare(self) -> None:
        """Every agent's decision, into its slot's in-flight fields."""
        engine, k = self.calls, self.k
        interval = self.descriptor.step_duration.to_json()  # one JSON value shared by every call
        calls = [engine.new_call(a, "Agent.Prepare", self.scope, {
            "agentId": a, "profileDigest": self.slots[a].profile["digest"],
            "interval": interval,
            "decisionContextDigest": self.slots[a].context_digest,
            "preStepStimulations": []}) for a in self.agents_in_order()]
        by_agent = {c.worker_id: c for c in calls}
        outcomes = await self.dispatch(calls, kills=self.injections.kills_at(k))
        for agent_id in self.agent_ids:
            call = by_agent[agent_id]
            try:
                result = await engine.settle(call, outcomes[agent_id])
                decision = self.decision_of(agent_id, result)
            except DomainError as exc:
                raise Blame(exc, "Agent.Prepare", agent_id) from None
            slot = self.slots[agent_id]
            slot.prepared = result
            slot.decision = decision
            slot.prepare_request = call.request_id
            self.session.audit.add(f"prepared:{agent_id}@{k}")
            self.session.stats.prepares += 1
        await self.injections.after_prepare(engine, k, by_agent, self.slots)

    def decision_of(self, agent_id: str, result: dict[str, Any]) -> TypedValue:
        if result.get("agentId") != agent_id:
            raise identity_mismatch(f"Agent.Prepare: the decision names "
                                    f"{result.get('agentId')}, expected {agent_id}")
        decision = TypedValue.from_json(result["decision"])
        want = self.session.executor.decision_schema
        if decision.schema != want:
            raise identity_mismatch(f"Agent.Prepare: {agent_id} decided in schema "
                                    f"{decision.schema.id} v{decision.schema.version}, "
                                    f"not the executor's {want.id} v{want.version}")
        return decision

    # ------------------------------------------------------------------ B. Apply

    async def advance(self, wire_controls: list[dict[str, Any]]
                      ) -> tuple[Call, dict[str, Any]]:
        """`Environment.Advance` with the controls; the call and its result."""
        world_id = self.session.world_id
        self.session.audit.add(f"advance:{self.k}")
        advance = self.calls.new_call(world_id, "Environment.Advance", self.scope, {
            "batchId": self.batch_id, "controls": wire_controls})
        try:
            result = await self.injections.advance(self.calls, self.k, advance, self.batch_id,
                                                   world_id)
        except DomainError as exc:
            raise Blame(exc, "Environment.Advance", world_id) from None
        return advance, result

    # ------------------------------------------------------------------ C. Observe

    async def observe(self, advance: Call, result: dict[str, Any], digest: str
                      ) -> WorldObservation:
        """O[k+1], checked, its decoded media staged as the in-flight media."""
        engine = self.calls
        received = engine.take_attachments(advance)
        try:
            attached = open_attached(engine.client, received) if received else None
            new, media = check_advance(self.k, result, self.batch_id, digest, self.descriptor,
                                       self.old, self.audio, self.session.world_id, attached)
        except BaseException:
            engine.drop([a.artifact_id for a in received])
            raise
        media.held = tuple(a.artifact_id for a in received)
        self.stage_media(media)
        await self.injections.after_advance(engine, self.k, advance, result, self.descriptor,
                                            media.views)
        return new

    def evaluate(self, new: WorldObservation, controls: list[PortControl]) -> Evaluation:
        """The task's verdict on the transition, covering every agent."""
        impl = self.session.spec.task.impl
        try:
            evaluation = self.session.task.evaluate_transition(
                self.scope, self.old.inspection, new.inspection, controls)
            for agent_id in self.agent_ids:
                if agent_id not in evaluation.outcomes or agent_id not in \
                        evaluation.next_contexts:
                    raise backend_failure(f"the task's evaluation misses {agent_id}")
            check_evaluation(evaluation, impl, self.agent_ids)
        except Exception as exc:
            raise Blame(task_error(exc, impl), Detail.TASK_EVALUATE, None) from None
        self.session.audit.add(f"evaluate:{self.k}")
        return evaluation

    # ------------------------------------------------------------------ D. Commit

    async def commit(self, new: WorldObservation, evaluation: Evaluation,
                     ) -> tuple[dict[str, dict[str, Any]], dict[str, Telemetry],
                                dict[str, str | None]]:
        """Commit every agent: the results, their parsed telemetry and the digest of the
        structured input each was sent (the behaviour record's `inputDigests`), by agent."""
        engine, k = self.calls, self.k
        calls: list[Call] = []
        # every agent receives the same views (one JSON value shared by every call) and its
        # own structured input (flyd.session.inputs)
        try:
            inputs = sensory_inputs(new, self.session.bindings(), self.session.structured_input,
                                    k + 1, Mutation.APPLIED)
        except DomainError as exc:
            raise Blame(exc, Detail.COMMIT, self.session.world_id) from None
        # the behaviour record's inputDigests: each agent's structured input as sent (its
        # canonical bytes are kept on the value; a shared inspection is hashed once)
        digests: dict[str, str | None] = {}
        hashed: dict[int, str] = {}
        for agent_id in self.agent_ids:
            value = inputs.structured[agent_id]
            if value is not None and id(value) not in hashed:
                hashed[id(value)] = typed_digest(value)
            digests[agent_id] = None if value is None else hashed[id(value)]
        for agent_id in self.agents_in_order():
            slot = self.slots[agent_id]
            outcome = evaluation.outcomes[agent_id]
            assert slot.prepare_request is not None
            calls.append(engine.new_call(agent_id, "Agent.Commit", self.scope, {
                "agentId": agent_id, "preparedRequestId": slot.prepare_request,
                "nextInput": inputs.json[agent_id],
                "nextDecisionContext": evaluation.next_contexts[agent_id].to_json(),
                "rewards": [r.to_json() for r in outcome.rewards],
                "taskStimulations": [s.to_json() for s in outcome.stimulations]},
                attachments=inputs.attachments[agent_id]))
        results: dict[str, dict[str, Any] | DomainError] = {}
        telemetry: dict[str, Telemetry] = {}

        async def one(call: Call) -> None:
            try:
                result = await engine.call(call)
                telemetry[call.worker_id] = self.check_commit(call.worker_id, result,
                                                              evaluation)
                results[call.worker_id] = result
            except DomainError as exc:
                results[call.worker_id] = exc

        async with asyncio.TaskGroup() as tg:
            for call in calls:
                task = tg.create_task(one(call))
                if self.session.order is not DispatchOrder.CONCURRENT:
                    await task
        out = self.committed(calls, results)
        await self.injections.after_commit(engine, k, calls, out)
        return out, telemetry, digests

    def check_commit(self, agent_id: str, result: dict[str, Any], evaluation: Evaluation
                     ) -> Telemetry:
        """One Commit's result checked; its telemetry."""
        k = self.k
        if result.get("committedStep") != str(k + 1):
            raise backend_failure(f"Agent.Commit: {agent_id} committed "
                                  f"{result.get('committedStep')}, expected {k + 1}")
        want = typed_digest(evaluation.next_contexts[agent_id])
        if result.get("decisionContextDigest") != want:
            raise identity_mismatch(f"Agent.Commit: {agent_id} holds context "
                                    f"{result.get('decisionContextDigest')}, "
                                    f"expected {want}")
        parsed = Telemetry.from_json(result["telemetry"])
        parsed.check_rates(self.slots[agent_id].graph or Graph.from_json(None))
        return parsed

    def committed(self, calls: list[Call],
                  results: Mapping[str, dict[str, Any] | DomainError]
                  ) -> dict[str, dict[str, Any]]:
        """Every agent's Commit result, in agent-id order; the first failure, by agent id,
        fails the transition."""
        for agent_id in self.agent_ids:
            got = results[agent_id]
            if isinstance(got, DomainError):
                raise Blame(got, Detail.COMMIT, agent_id)
        out: dict[str, dict[str, Any]] = {}
        request_ids = {c.worker_id: c.request_id for c in calls}
        for agent_id in self.agent_ids:
            got = results[agent_id]
            assert not isinstance(got, DomainError)
            out[agent_id] = got
            self.slots[agent_id].commit_request = request_ids[agent_id]
            self.session.audit.add(f"committed:{agent_id}@{self.k}")
            self.session.stats.commits += 1
        return out
