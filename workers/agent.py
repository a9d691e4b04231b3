"""The agent endpoint: `Agent.Initialize`, `Agent.Prepare`, `Agent.Commit`
(design/session.md §3.1–§3.3); `python -m workers.agent …` (design/session.md §7.5, §7.7).

Why: one simulated brain behind the session's guarantees. The model (an `AgentModel`,
design/session.md §4.1, named by `--model`) only computes; this endpoint owns the phases `Ready(k)`
/ `Prepared(k)`, the tick accumulator, the decision context, every check of design/session.md §3 in
its order, and the agent fault knobs (`prepare_delay_ms`, `commit_delay_ms`, `fail_commit_at_step`).

Phases map onto the status cell: `uninitialized`; `ready` = Ready(k); `preparing`; `prepared` =
Prepared(k); `committing`; `failed` (any error with mutation ≠ `none`, set by the shell). `k` is
`committed_step`; `currentScope.step` is always `k`.

Resolved ambiguities:
- An agent never receives the environment descriptor, so "views decode" (design/session.md §3.1 step
  7, §3.3 step 3) is `decode_media` with content type `image/x-rgba8` (base64, length, digest) plus
  `producedStep ≤ input boundary`; the `rowStride·height` length check is the coordinator's.
- The model is built with the launch's `threads` and the shell's executor; `workerThreads` only
  has to fit (`BUSY` when it exceeds the launch's `threads`).
- `Agent.Initialize` builds a fresh model and touches the endpoint only once everything
  succeeded, so a failure while building or warming it up leaves the worker uninitialized:
  a `DomainError` raised there keeps its own code and mutation, anything else is
  `BACKEND_FAILURE`/`none`. Failures inside Prepare and Commit after the first model call are
  `BACKEND_FAILURE`/`unknown` (partial mutation), except the injected commit failure
  (`applied`, design/session.md §3.3).
- Learning is switched off explicitly before the warm-up (a plugin may start with it on).
- A reward sum is formed left to right in binary64 starting at 0.0 (design/session.md §3.3).
- The model class is checked when the worker starts (`workers.protocols.check_plugin`): a
  missing method or version fails the start with a message naming the class and attribute.
- `State.*` (design/state.md §6, `workers.state`) is served, and `checkpoint-v1` advertised, only
  when the model class declares `model_version` and `plasticity_version` (its identity needs them);
  both explicitly `None` opt out of checkpointing.
  A staged restore builds a fresh model with the checkpoint's seed and restores the saved brain
  into it; the seed is compared only once this incarnation knows its own (after Initialize or an
  activation).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from workers.faults import Role
from workers.launch import WorkerLaunch
from workers.main import main
from workers.plugins import load_plugin
from workers.protocols import (
    ARRAY_INPUT,
    MODEL_ATTRIBUTES,
    AgentModel,
    DecodedArray,
    DecodedView,
    check_plugin,
)
from workers.shell import Call, Endpoint, WorkerState
from workers.state import (
    StateService,
    check_provenance,
    common_members,
    decode_plugin_blob,
    incompatible,
    parse_digest_member,
    parse_u64_member,
    plugin_blob,
    wrapper_object,
)
from workers.types.canonical import digest_of, typed_digest
from workers.types.datatypes import (
    VIEW_CONTENT_TYPE,
    AssetRef,
    Attached,
    Graph,
    Reward,
    SensoryInput,
    Stimulus,
    Telemetry,
    TypedValue,
    decode_array,
    decode_media,
)
from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    PluginFault,
    PluginStage,
    Scope,
    format_u64,
    parse_i32,
)
from workers.types.ticks import RationalNs, TickAccumulator

__all__ = ["AgentEndpoint", "AgentParticipant", "StagedAgent"]

INJECTED_COMMIT_FAILURE: Final = "injected commit failure after the next input was installed"
IDENTITY_FIELDS: Final = ("agentId", "profileDigest", "datasetDigest", "indexDigest",
                          "modelVersion", "plasticityVersion", "seed")
AGENT_WRAPPER_KEYS: Final = frozenset({
    "payloadVersion", "kind", "checkpointId", "committedStep", "sourceScope", "agentId",
    "identity", "profile", "accumulator", "context", "contextDigest", "model"})
ACCUMULATOR_KEYS: Final = frozenset({"tick", "remainder", "executed", "warmupOffset"})


def _before(code: ErrorCode, message: str) -> DomainError:
    return DomainError.before(code, message)


class AgentEndpoint(Endpoint):
    """The agent's methods on top of an `AgentModel`."""

    role: ClassVar[Role] = "agent"
    base_capabilities: ClassVar[tuple[str, ...]] = ("agent-step-v1", "pixel-observation-v1")

    def __init__(self, launch: WorkerLaunch) -> None:
        super().__init__(launch)
        settings = launch.agent
        self.settings = settings
        self.model_class: type[AgentModel] = load_plugin(settings.model, "model")
        check_plugin(self.model_class, "model", settings.model, MODEL_ATTRIBUTES)
        self.profile: AssetRef = self.model_class.profile(
            launch.worker_id, settings.tick, settings.warmup_ticks, settings.model_config)
        self.graph: Graph = self.model_class.graph(launch.worker_id, settings.model_config)
        self.model: AgentModel | None = None
        self.accumulator: TickAccumulator | None = None
        self.epoch: str | None = None
        self.committed_step = 0
        self.context: TypedValue | None = None
        self.context_digest: str | None = None
        self.prepared_request_id: str | None = None
        self.seed: int | None = None
        self.handlers = {
            "Agent.Initialize": self.initialize,
            "Agent.Prepare": self.prepare,
            "Agent.Commit": self.commit,
        }
        self.model_version: str | None = getattr(self.model_class, "model_version", None)
        self.plasticity_version: str | None = getattr(self.model_class, "plasticity_version",
                                                      None)
        if self.model_version is not None and self.plasticity_version is not None:
            self.state = StateService(self, AgentParticipant(self))
            self.handlers.update(self.state.handlers())

    def extras(self) -> tuple[str, ...]:
        return tuple(getattr(self.model_class, "capabilities", ()))

    def inline_calls(self) -> bool:
        return getattr(self.model_class, "inline_calls", False) is True

    # helpers ----------------------------------------------------------------------------------

    def _live(self) -> tuple[AgentModel, TickAccumulator]:
        if self.model is None or self.accumulator is None:
            raise DomainError(ErrorCode.INTERNAL, "no model although initialized", Mutation.NONE)
        return self.model, self.accumulator

    def _check_agent(self, method: str, agent_id: str) -> None:
        if agent_id != self.launch.worker_id:
            raise _before(ErrorCode.IDENTITY_MISMATCH,
                          f"{method} names agent {agent_id}; this worker is "
                          f"{self.launch.worker_id}")

    def _stimuli(self, raw: list[Any], what: str) -> list[Stimulus]:
        return [Stimulus.from_json(item, f"{what}[{i}]") for i, item in enumerate(raw)]

    def _check_kinds(self, method: str, stimuli: Sequence[Stimulus]) -> None:
        for stimulus in stimuli:
            if stimulus.kind_id not in self.graph.supported_stimuli:
                raise _before(ErrorCode.UNSUPPORTED,
                              f"{method}: stimulus kind {stimulus.kind_id} is not declared by "
                              f"the graph of {self.launch.worker_id}")

    def _decode(self, sensory: SensoryInput, what: str,
                attached: Mapping[str, Attached]) -> list[DecodedView]:
        """The input's views, inline or by reference to the request's attachments (read
        during the handler, never kept: topics.md §14.2 rule 5)."""
        views: list[DecodedView] = []
        for view in sensory.views:
            if view.produced_step > sensory.boundary:
                raise _before(ErrorCode.BUFFER_INVALID,
                              f"{what}: view {view.view_id} was produced at step "
                              f"{view.produced_step}, after the input's boundary "
                              f"{sensory.boundary}")
            data = decode_media(view.pixels, VIEW_CONTENT_TYPE, f"view {view.view_id}",
                                attached=attached)
            views.append(DecodedView(view.view_id, view.produced_step, data))
        return views

    def _encode(self, views: Sequence[DecodedView], sensory: SensoryInput, what: str,
                attached: Mapping[str, Attached]) -> Any:
        """`encode(views, structured)`, or with the input's decoded arrays for a model that
        lists `ARRAY_INPUT`; arrays sent to any other model are refused."""
        if ARRAY_INPUT not in self.extras():
            if sensory.arrays:
                raise DomainError.invalid(f"{what}: the input carries arrays; model "
                                          f"{self.settings.model} does not list {ARRAY_INPUT}")
            return self.model_class.encode(views, sensory.structured)
        arrays = tuple(DecodedArray(a.id, a.dtype, a.shape,
                                    decode_array(a, Mutation.NONE, attached))
                       for a in sensory.arrays)
        return self.model_class.encode(views, sensory.structured, arrays)  # type: ignore[call-arg]

    def _telemetry(self, model: AgentModel, accumulator: TickAccumulator) -> Telemetry:
        return model.telemetry(accumulator.brain_ticks())

    async def _apply(self, what: str, fn: Any) -> Any:
        """A model call after the first mutation: any failure is `BACKEND_FAILURE`/`unknown`."""
        try:
            return await self.run_model(what, fn)
        except DomainError as exc:
            if exc.mutation != Mutation.NONE:
                raise
            raise DomainError(ErrorCode.BACKEND_FAILURE, f"{what}: {exc.code}: {exc.message}",
                              Mutation.UNKNOWN) from None
        except Exception as exc:
            fault = PluginFault.of(exc, self.settings.model, PluginStage.CALL)
            raise DomainError(ErrorCode.BACKEND_FAILURE, f"{what} failed: {fault.summary()}",
                              Mutation.UNKNOWN, fault) from None

    # Agent.Initialize (design/session.md §3.1) ----------------------------------------------------

    async def initialize(self, call: Call) -> dict[str, Any]:
        method = call.method
        # 1–2: scope, session, phase, step 0
        scope = self.check_scope(call)
        self.check_initialize_phase(call)
        if scope.step != 0:
            raise _before(ErrorCode.FUTURE_STEP,
                          f"{method} names step {scope.step}; an agent starts at step 0")
        # 3: params schema, agent id
        call.check_params()
        p = call.params
        self._check_agent(method, p["agentId"])
        # 4: threads
        wanted: int = p["workerThreads"]
        if wanted > self.launch.threads:
            raise _before(ErrorCode.BUSY,
                          f"{method} asks for {wanted} worker threads; "
                          f"{self.launch.worker_id} was launched with {self.launch.threads}")
        # 5: profile
        profile = AssetRef.from_json(p["profile"], "params.profile")
        mine = self.profile
        if (profile.id, profile.digest, profile.byte_length) != \
                (mine.id, mine.digest, mine.byte_length):
            raise _before(ErrorCode.IDENTITY_MISMATCH,
                          f"{method} names profile {profile.id} ({profile.digest[:12]}, "
                          f"{profile.byte_length} bytes); this worker runs {mine.id} "
                          f"({mine.digest[:12]}, {mine.byte_length} bytes)")
        seed = parse_i32(p["seed"], "params.seed")
        # 6: context
        context = TypedValue.from_json(p["initialDecisionContext"],
                                       "params.initialDecisionContext")
        self.model_class.check_context(context)
        # 7: input, views, encode (pure)
        initial = SensoryInput.from_json(p["initialInput"], "params.initialInput")
        if initial.boundary != 0:
            raise DomainError.invalid(f"{method}: initialInput.boundary must be 0; got "
                                      f"{initial.boundary}")
        encoded = self._encode(self._decode(initial, method, call.attached), initial, method,
                               call.attached)
        # 8: apply, on a fresh model (the endpoint changes only once it all worked)
        settings = self.settings
        warmup = settings.warmup_ticks

        def build() -> tuple[AgentModel, TickAccumulator, Telemetry, int]:
            try:
                model = self.model_class(agent_id=self.launch.worker_id, seed=seed,
                                         threads=self.launch.threads,
                                         executor=self.shell.executor,
                                         config=settings.model_config)
            except Exception as exc:
                # the same spec builds the same model: this fails on every attempt
                fault = PluginFault.of(exc, settings.model, PluginStage.CONSTRUCT)
                raise DomainError(ErrorCode.BACKEND_FAILURE,
                                  f"{method}: building the model failed: {fault.summary()}",
                                  Mutation.NONE, fault) from None
            model.install_input(encoded)
            model.set_learning(False)
            model.advance(warmup)
            accumulator = TickAccumulator(settings.tick)
            accumulator.warm_up(warmup)
            model.decide(context)  # calibration read (pure)
            model.set_learning(True)
            return model, accumulator, model.telemetry(accumulator.brain_ticks()), \
                model.mutations()

        try:
            model, accumulator, telemetry, mutations = await self.run_model(method, build)
        except DomainError:
            raise
        except Exception as exc:
            fault = PluginFault.of(exc, settings.model, PluginStage.CALL)
            raise DomainError(ErrorCode.BACKEND_FAILURE,
                              f"{method}: building the model failed: {fault.summary()}",
                              Mutation.NONE, fault) from None
        self.shell.cache.adopt_epoch(scope.epoch)
        self.model, self.accumulator = model, accumulator
        self.epoch = scope.epoch
        self.seed = seed
        self.committed_step = 0
        self.context = context
        self.context_digest = typed_digest(context)
        self.prepared_request_id = None
        status = self.status
        status.state = WorkerState.READY
        status.current_scope = scope.at(0)
        status.raise_progress(mutations)
        return {
            "agentId": self.launch.worker_id,
            "profileDigest": self.profile.digest,
            "tickDuration": settings.tick.to_json(),
            "warmupTicks": format_u64(warmup),
            "committedStep": "0",
            "decisionContextDigest": self.context_digest,
            "telemetry": telemetry.to_json(),
            "graph": self.graph.to_json(),
        }

    # Agent.Prepare (design/session.md §3.2) -------------------------------------------------------

    async def prepare(self, call: Call) -> dict[str, Any]:
        method = call.method
        # 1: epoch check, Ready(k), step
        scope = self.check_epoch(call, self.epoch)
        state = self.status.state
        k = self.committed_step
        if state != WorkerState.READY:
            raise _before(ErrorCode.INVALID_PHASE,
                          f"{method}: {self.launch.worker_id} is {state.value} at step {k}, "
                          f"not ready")
        self.check_step(call, scope.step, k)
        # 2: params schema, interval, stimuli
        call.check_params()
        p = call.params
        interval = RationalNs.from_json(p["interval"], "params.interval")
        if interval.is_zero():
            raise DomainError.invalid(f"{method}: interval must be > 0")
        stimuli = self._stimuli(p["preStepStimulations"], "params.preStepStimulations")
        # 3: identities
        self._check_agent(method, p["agentId"])
        if p["profileDigest"] != self.profile.digest:
            raise _before(ErrorCode.IDENTITY_MISMATCH,
                          f"{method} names profile digest {p['profileDigest'][:12]}; this "
                          f"worker runs {self.profile.digest[:12]}")
        if p["decisionContextDigest"] != self.context_digest:
            raise _before(ErrorCode.IDENTITY_MISMATCH,
                          f"{method} names decision context {p['decisionContextDigest'][:12]}; "
                          f"the committed context is {str(self.context_digest)[:12]}")
        # 4: stimulus kinds
        self._check_kinds(method, stimuli)
        # 5: apply
        model, accumulator = self._live()
        context = self.context
        assert context is not None
        self.status.state = WorkerState.PREPARING
        await self.sleep_fault("prepare_delay_ms", k)

        def work() -> tuple[int, TypedValue, int]:
            for stimulus in stimuli:
                model.stimulate(stimulus)
            ticks = accumulator.advance(interval)
            model.advance(ticks)
            return ticks, model.decide(context), model.mutations()

        ticks, decision, mutations = await self._apply(method, work)
        self.prepared_request_id = call.request_id
        self.status.state = WorkerState.PREPARED
        self.status.raise_progress(mutations)
        return {
            "agentId": self.launch.worker_id,
            "ticksAdvanced": format_u64(ticks),
            "brainTicks": format_u64(accumulator.brain_ticks()),
            "remainder": accumulator.remainder.to_json(),
            "decision": decision.to_json(),
        }

    # Agent.Commit (design/session.md §3.3) --------------------------------------------------------

    async def commit(self, call: Call) -> dict[str, Any]:
        method = call.method
        # 1: epoch check, Prepared(k), step == k
        scope = self.check_epoch(call, self.epoch)
        state = self.status.state
        k = self.committed_step
        if state != WorkerState.PREPARED:
            raise _before(ErrorCode.INVALID_PHASE,
                          f"{method}: {self.launch.worker_id} is {state.value} at step {k}, "
                          f"not prepared")
        self.check_step(call, scope.step, k)
        # 2: params schema, identities
        call.check_params()
        p = call.params
        self._check_agent(method, p["agentId"])
        if p["preparedRequestId"] != self.prepared_request_id:
            raise _before(ErrorCode.IDENTITY_MISMATCH,
                          f"{method} commits {p['preparedRequestId']}; step {k} was prepared by "
                          f"{self.prepared_request_id}")
        # 3: input, rewards, stimulations, context, views, encode — all before applying
        next_input = SensoryInput.from_json(p["nextInput"], "params.nextInput")
        if next_input.boundary != k + 1:
            raise DomainError.invalid(f"{method}: nextInput.boundary must be {k + 1}; got "
                                      f"{next_input.boundary}")
        rewards = [Reward.from_json(item, f"params.rewards[{i}]")
                   for i, item in enumerate(p["rewards"])]
        stimulations = self._stimuli(p["taskStimulations"], "params.taskStimulations")
        self._check_kinds(method, stimulations)
        next_context = TypedValue.from_json(p["nextDecisionContext"],
                                            "params.nextDecisionContext")
        self.model_class.check_context(next_context)
        encoded = self._encode(self._decode(next_input, method, call.attached), next_input,
                               method, call.attached)
        # 4: apply
        model, accumulator = self._live()
        self.status.state = WorkerState.COMMITTING
        await self.sleep_fault("commit_delay_ms", k)

        injected = self.launch.faults.fail_commit_at_step == k

        def install() -> tuple[int, tuple[Telemetry, int] | None]:
            # one hand-off to the model thread for the whole commit, not one per part: a
            # threaded model's step then costs two thread switches instead of three
            model.install_input(encoded)
            installed = model.mutations()
            if injected:  # the input is installed, nothing after it is
                return installed, None
            for stimulus in stimulations:
                model.stimulate(stimulus)
            signal = 0.0
            for reward in rewards:
                signal += reward.value
            model.reinforce(signal)
            return installed, (self._telemetry(model, accumulator), model.mutations())

        installed, reinforced = await self._apply(method, install)
        self.status.raise_progress(installed)
        if reinforced is None:
            raise DomainError(ErrorCode.BACKEND_FAILURE, INJECTED_COMMIT_FAILURE,
                              Mutation.APPLIED)
        telemetry, mutations = reinforced
        self.context = next_context
        self.context_digest = typed_digest(next_context)
        self.committed_step = k + 1
        self.prepared_request_id = None
        status = self.status
        status.state = WorkerState.READY
        status.current_scope = scope.at(k + 1)
        status.raise_progress(mutations)
        return {
            "agentId": self.launch.worker_id,
            "committedStep": format_u64(k + 1),
            "decisionContextDigest": self.context_digest,
            "telemetry": telemetry.to_json(),
        }


# --------------------------------------------------------------------------------------------
# State.* (design/state.md §6.3, §6.4)


@dataclass(frozen=True)
class StagedAgent:
    """A restored brain beside the live one: installed only by activation."""

    model: AgentModel
    accumulator: TickAccumulator
    context: TypedValue
    seed: int


class AgentParticipant:
    """The agent's wrapper (`agent-<id>`), identity and install."""

    def __init__(self, endpoint: AgentEndpoint) -> None:
        self.endpoint = endpoint

    @property
    def epoch(self) -> str | None:
        return self.endpoint.epoch

    def committed_step(self) -> int:
        return self.endpoint.committed_step

    def identity(self) -> dict[str, Any]:
        e = self.endpoint
        return {"agentId": e.launch.worker_id, "profileDigest": e.profile.digest,
                "datasetDigest": e.graph.dataset_digest, "indexDigest": e.graph.index_digest,
                "modelVersion": e.model_version, "plasticityVersion": e.plasticity_version,
                "seed": e.seed}

    def compatibility_digest(self) -> str:
        return digest_of(self.identity())

    def capture_wrapper(self, checkpoint_id: str, scope: Scope) -> dict[str, Any]:
        e = self.endpoint
        model, accumulator = e._live()
        assert e.context is not None
        return {
            **common_members("agent", checkpoint_id, scope),
            "agentId": e.launch.worker_id,
            "identity": self.identity(),
            "profile": e.profile.to_json(),
            "accumulator": {"tick": accumulator.tick.to_json(),
                            "remainder": accumulator.remainder.to_json(),
                            "executed": format_u64(accumulator.executed),
                            "warmupOffset": format_u64(accumulator.warmup_offset)},
            "context": e.context.to_json(),
            "contextDigest": typed_digest(e.context),
            "model": plugin_blob(model.capture()),
        }

    def _check_identity(self, recorded: Any) -> int:
        """The checkpoint's identity against this worker's, the first difference named
        (design/state.md §3); the recorded seed."""
        own = self.identity()
        if not isinstance(recorded, dict) or set(recorded) != set(IDENTITY_FIELDS):
            raise incompatible("the agent payload's identity is not an AgentIdentity")
        try:
            seed = parse_i32(recorded["seed"], "identity.seed")
        except DomainError as exc:
            raise incompatible(exc.message) from None
        for field in IDENTITY_FIELDS:
            if field == "seed" and own["seed"] is None:
                continue
            if recorded[field] != own[field]:
                raise incompatible(f"agent {own['agentId']}: the checkpoint's {field} identity "
                                   f"{recorded[field]} differs from this worker's {own[field]}")
        return seed

    def _accumulator(self, raw: Any) -> TickAccumulator:
        e = self.endpoint
        if not isinstance(raw, dict) or set(raw) != ACCUMULATOR_KEYS:
            raise incompatible("the agent payload's accumulator is malformed")
        try:
            tick = RationalNs.from_json(raw["tick"], "accumulator.tick")
            remainder = RationalNs.from_json(raw["remainder"], "accumulator.remainder")
        except DomainError as exc:
            raise incompatible(exc.message) from None
        executed = parse_u64_member(raw["executed"], "accumulator.executed")
        warmup = parse_u64_member(raw["warmupOffset"], "accumulator.warmupOffset")
        if tick != e.settings.tick:
            raise incompatible(f"the checkpoint's tick {tick} differs from this worker's "
                               f"{e.settings.tick}")
        if not remainder < tick:
            raise incompatible(f"the checkpoint's remainder {remainder} lies outside "
                               f"[0, {tick})")
        if executed < warmup:
            raise incompatible(f"the checkpoint executed {executed} brain ticks, fewer than "
                               f"its warm-up offset {warmup}")
        return TickAccumulator(tick, remainder, executed, warmup)

    def stage_wrapper(self, data: bytes, params: Mapping[str, Any],
                      scope: Scope) -> StagedAgent:
        e = self.endpoint
        doc = wrapper_object(data, "agent", AGENT_WRAPPER_KEYS)
        if doc["agentId"] != e.launch.worker_id:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"the payload is agent {doc['agentId']!r}'s; this worker is "
                                     f"{e.launch.worker_id}")
        check_provenance(doc, params, scope)
        if digest_of(doc["identity"]) != params["compatibilityDigest"]:
            raise incompatible("the payload's identity digest differs from the request's "
                               "compatibilityDigest")
        seed = self._check_identity(doc["identity"])
        try:
            profile = AssetRef.from_json(doc["profile"], "profile")
        except DomainError as exc:
            raise incompatible(exc.message) from None
        if profile != e.profile:
            raise incompatible(f"the checkpoint's profile {profile.id} differs from this "
                               f"worker's {e.profile.id}")
        accumulator = self._accumulator(doc["accumulator"])
        blob = decode_plugin_blob(doc["model"], "the model state")
        model = e.model_class(agent_id=e.launch.worker_id, seed=seed, threads=e.launch.threads,
                              executor=e.shell.executor, config=e.settings.model_config)
        try:
            model.restore(blob)
        except DomainError as exc:
            raise incompatible(f"the model refuses the state: {exc.message}") from None
        except Exception as exc:
            raise incompatible(f"the model refuses the state: {type(exc).__name__}") from None
        try:
            context = TypedValue.from_json(doc["context"], "context")
            e.model_class.check_context(context)
        except DomainError as exc:
            raise incompatible(f"the saved decision context is refused: {exc.message}") \
                from None
        if typed_digest(context) != parse_digest_member(doc["contextDigest"], "contextDigest"):
            raise incompatible("the saved decision context does not match its contextDigest")
        return StagedAgent(model, accumulator, context, seed)

    async def seal_media(self, call: Call, observation: dict[str, Any] | None,
                         ) -> dict[str, Any] | None:
        """An agent's activation carries no media."""
        return observation

    def observation_digests(self, boundary: int) -> None:
        """An agent observes nothing of its own (design/state.md §6.5: `observationDigests`
        null)."""
        return None

    def install(self, staged: StagedAgent, scope: Scope) -> None:
        e = self.endpoint
        e.model, e.accumulator = staged.model, staged.accumulator
        e.context = staged.context
        e.context_digest = typed_digest(staged.context)
        e.seed = staged.seed
        e.prepared_request_id = None
        e.epoch = scope.epoch
        e.committed_step = scope.step
        e.status.raise_progress(staged.model.mutations())
        return None


if __name__ == "__main__":
    sys.exit(main("agent", sys.argv[1:], endpoint_factory=AgentEndpoint))
