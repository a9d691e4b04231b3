"""The environment endpoint: `Environment.Initialize`, `Environment.Advance`
(design/session.md §3.4, §3.5); `python -m workers.environment …` (design/session.md §7.5, §7.7).

Why: the shared world behind the session's guarantees. The world (a `World`, design/session.md §4.1,
named by `--world`) keeps only its own state; this endpoint owns the boundary, world time, the batch
set, the view pipeline, the audio sample budgets, every check of design/session.md §3 in its order,
and the environment fault knobs (`advance_delay_ms` and the media faults of design/session.md §4.9).

View pipeline: exactly one frame per boundary per view (a world whose `render` returns None drew
nothing new: the frame of the previous boundary, rendered or restored, is that boundary's again,
so the frames are the same whether or not a restore came between); the last `delay+1` frames are
kept; at boundary `b` the frame produced at `max(0, b − delay)` is served (boundaries `0..delay`
repeat O[0]). Audio: one chunk per transition per stream, sized by `AudioBudget`
(design/session.md §5.3), none at boundary 0, `discontinuity` false. A view or chunk above the
launch's `media_inline_max_bytes` travels by reference (topics.md §14.2,
`workers.artifacts.MediaSink`): staged while rendering, sealed before the reply of
`Environment.Initialize` or `Environment.Advance`, and attached to it (the shell keeps the holds
until the next such reply, for a replay); a failed reply drops what it sealed. A view's frame is
sealed with the reply of the boundary that rendered it and kept while the pipeline retains it, so a
delayed view is served as the one artifact sealed at its render. `State.ActivateRestore`'s
observation does the same (topics.md §14.2 rule 7: the restored frames become new artifacts of the
current store).

Media faults at boundary B (applied to whichever observation has that boundary, O[0] included):
`omit_view_at_boundary` serves no sensory view (the frame is still rendered and kept);
`stale_view_at_boundary` serves again the `ViewRef` served at the previous boundary;
`truncated_view_at_boundary` serves the frame one row short, with a blob that describes the
shorter bytes honestly; `omit_audio_at_boundary` drops the chunk (it is produced, so the stream
position and the world's audio state advance: the next chunk shows the gap);
`overlapping_audio_at_boundary` moves the chunk's `firstSample` one back (saturating at 0).

Resolved ambiguities:
- The world class is checked first (`workers.protocols.check_plugin`: a missing method fails the
  start naming the class and attribute).
- The world is built when the endpoint is (at launch), from the launch's world settings; its
  descriptor must be valid (design/session.md §1.8), declare exactly the launch's ports in launch
  order and the launch's step, else the launch is refused (`INVALID_ARGUMENT`).
- `broadcastViews` lists every sensory view served (v1 carries no second copy of the bytes).
- `engineFrame` is `world.engine_frame(boundary)` when the world offers it, else null.
- `Environment.Initialize` also refuses (`INVALID_ARGUMENT`) an agent bound to two ports; the
  `taskConfig` asset is parsed but not compared (the task is coordinator-local).
- A world failure while resetting or applying is `BACKEND_FAILURE`/`unknown`; a render failure
  after the step was applied is `BACKEND_FAILURE`/`applied` (design/session.md §3.5 step 6), also at
  Initialize (the episode was reset). A rendered frame or audio chunk of the wrong size is a render
  failure, and so is an observation whose reply would exceed the router's `maxEnvelopeBytes`
  (checked with the router's own frame rule, `Endpoint.reply_frame`): sent anyway, the router would
  refuse it and the coordinator learn only that the call went without a reply.
- `Environment.Initialize` also refuses (`UNSUPPORTED`, before the reset) a world whose smallest
  capture — one frame of each view, base64 inside a payload that travels base64 — exceeds
  `maxEnvelopeBytes`: every run ends with a durable capture, so that world could never finish.
- `State.*` (design/state.md §6, `workers.state`): a staged restore builds a fresh world from the
  launch's settings, resets it to the checkpoint's episode and bindings and restores the saved
  world into it (the staging copy); activation swaps it in with the recorded frames and audio
  positions. The first chunk of each audio stream after an activation is marked
  `discontinuity`. The activation also reports `observationDigests` (design/session.md §6.12,
  amendment 2026-12-07): each view's frame of k rendered again from the restored world, for the
  coordinator to compare with its record (a delayed view, served from an older frame, is
  compared by the world itself with the checkpoint's frame of k:
  `WorldParticipant.observation_digests`). A world
  whose `restore` (staging) or `render` (activation) raises `RESTORE_DIVERGED` itself is
  answered with that code, not `INCOMPATIBLE_STATE` or `BACKEND_FAILURE`: the checkpoint is
  fine, the world's state did not come back.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import re
import sys
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final, TypeVar

from workers.artifacts import MediaSink
from workers.faults import Role
from workers.launch import WorkerLaunch
from workers.main import main
from workers.plugins import load_plugin
from workers.protocols import PER_AGENT_INPUT, WORLD_ATTRIBUTES, World, check_plugin
from workers.shell import Call, Endpoint, WorkerState
from workers.state import (
    StateService,
    check_provenance,
    common_members,
    compatibility_block,
    decode_plugin_blob,
    incompatible,
    parse_digest_member,
    parse_u64_member,
    plugin_blob,
    wrapper_object,
)
from workers.types.canonical import controls_digest, digest_bytes, digest_of
from workers.types.datatypes import (
    ARRAY_CONTENT_TYPE,
    AUDIO_CONTENT_TYPE,
    VIEW_CONTENT_TYPE,
    AgentInput,
    ArrayValue,
    AssetRef,
    AudioRef,
    EnvironmentDescriptor,
    PortControl,
    ViewDescriptor,
    ViewRef,
    WorldObservation,
    check_controls,
)
from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    PluginFault,
    PluginStage,
    Scope,
    format_u64,
)
from workers.types.ticks import AudioBudget, RationalNs

__all__ = ["EnvironmentEndpoint", "StagedWorld", "ViewPipeline", "WorldParticipant"]

WORLD_WRAPPER_KEYS: Final = frozenset({
    "payloadVersion", "kind", "checkpointId", "committedStep", "sourceScope", "workerId",
    "episodeId", "worldTime", "bindings", "compatibilityDigest", "progress", "frames", "audio",
    "world"})

T = TypeVar("T")
RENDER: Final = "render"



_BATCH_ID: Final = re.compile(r"(batch-e[1-9][0-9]*-)(0|[1-9][0-9]*)")


class BatchSet:
    """The batch ids applied in the current epoch (design/session.md §3.5 step 2) in memory that
    does not grow with the number of steps: ids of the coordinator's form `batch-<epoch>-<k>` are
    kept as ranges of k per prefix (a session applies k = 0, 1, 2, … so one range), any other id as
    itself. Membership is exact either way."""

    def __init__(self) -> None:
        self._ranges: dict[str, list[list[int]]] = {}
        self._other: set[str] = set()

    def __contains__(self, batch_id: object) -> bool:
        if not isinstance(batch_id, str):
            return False
        m = _BATCH_ID.fullmatch(batch_id)
        if m is None:
            return batch_id in self._other
        ranges, k = self._ranges.get(m.group(1), []), int(m.group(2))
        i = bisect.bisect_right(ranges, k, key=lambda r: r[0]) - 1
        return i >= 0 and ranges[i][0] <= k <= ranges[i][1]

    def add(self, batch_id: str) -> None:
        m = _BATCH_ID.fullmatch(batch_id)
        if m is None:
            self._other.add(batch_id)
            return
        if batch_id in self:
            return
        ranges, k = self._ranges.setdefault(m.group(1), []), int(m.group(2))
        i = bisect.bisect_right(ranges, k, key=lambda r: r[0])
        joins_left = i > 0 and ranges[i - 1][1] == k - 1
        joins_right = i < len(ranges) and ranges[i][0] == k + 1
        if joins_left and joins_right:
            ranges[i - 1][1] = ranges[i][1]
            del ranges[i]
        elif joins_left:
            ranges[i - 1][1] = k
        elif joins_right:
            ranges[i][0] = k
        else:
            ranges.insert(i, [k, k])


def _base64_length(n: int) -> int:
    """Characters of `n` bytes in padded base64."""
    return 4 * ((n + 2) // 3)


class ViewPipeline:
    """One view's retained frames: the last `delay + 1` boundaries."""

    def __init__(self, delay: int) -> None:
        self.delay = delay
        self.frames: deque[tuple[int, bytes]] = deque(maxlen=delay + 1)

    def push(self, boundary: int, frame: bytes) -> None:
        if self.frames and boundary != self.frames[-1][0] + 1:
            raise DomainError(ErrorCode.INTERNAL, f"frame {boundary} does not follow "
                              f"{self.frames[-1][0]}", Mutation.UNKNOWN)
        self.frames.append((boundary, frame))

    def again(self, boundary: int, frame: bytes | None) -> bytes | None:
        """`frame`, or for None (the world drew nothing new) the frame of `boundary − 1`, which
        the pipeline always retains (restored with a checkpoint's frames too)."""
        if frame is not None:
            return frame
        if boundary == 0 or not self.frames or self.frames[-1][0] != boundary - 1:
            return None
        return self.frames[-1][1]

    def served(self, boundary: int) -> tuple[int, bytes]:
        """`(producedStep, frame)` served at `boundary`."""
        produced = max(0, boundary - self.delay)
        for step, frame in self.frames:
            if step == produced:
                return step, frame
        raise DomainError(ErrorCode.INTERNAL, f"frame {produced} is no longer retained",
                          Mutation.UNKNOWN)


class EnvironmentEndpoint(Endpoint):
    """The environment's methods on top of a `World`."""

    role: ClassVar[Role] = "environment"
    base_capabilities: ClassVar[tuple[str, ...]] = ("pixel-observation-v1", "world-step-v1")

    def __init__(self, launch: WorkerLaunch) -> None:
        super().__init__(launch)
        settings = launch.environment
        self.settings = settings
        self.world_class: type[World] = load_plugin(settings.world, "world")
        check_plugin(self.world_class, "world", settings.world, WORLD_ATTRIBUTES)
        self.world: World = self.world_class(
            world_id=launch.worker_id, ports=settings.ports, step=settings.step,
            observation_delay_steps=settings.observation_delay_steps, threads=launch.threads,
            config=settings.world_config)
        descriptor = EnvironmentDescriptor.from_json(self.world.descriptor().to_json(),
                                                     "world descriptor")
        if tuple(p.port_id for p in descriptor.ports) != settings.ports:
            raise DomainError.invalid(
                f"the world declares ports {[p.port_id for p in descriptor.ports]}; the launch "
                f"has {list(settings.ports)}")
        if descriptor.step_duration != settings.step:
            raise DomainError.invalid(f"the world's step is {descriptor.step_duration}; the "
                                      f"launch's is {settings.step}")
        self.descriptor = descriptor
        self.config_asset: AssetRef = self.world.config_asset()
        self.epoch: str | None = None
        self.episode_id: str | None = None
        self.bindings: tuple[tuple[str, str], ...] = ()
        self.boundary = 0
        self.world_time = RationalNs.zero()
        self.batches = BatchSet()
        self.progress = 0
        self.pipelines: dict[str, ViewPipeline] = {}
        self.last_served: dict[str, ViewRef] = {}
        self.budgets: dict[str, AudioBudget] = {}
        self.resumed_streams: set[str] = set()
        #: views and audio above the launch's threshold go by reference (topics.md §14.2)
        self.media = MediaSink(launch.media_inline_max_bytes)
        self.handlers = {
            "Environment.Initialize": self.initialize,
            "Environment.Advance": self.advance,
        }
        self.state = StateService(self, WorldParticipant(self))
        self.handlers.update(self.state.handlers())

    def extras(self) -> tuple[str, ...]:
        return tuple(getattr(self.world_class, "capabilities", ()))

    def inline_calls(self) -> bool:
        return getattr(self.world_class, "inline_calls", False) is True

    # helpers ----------------------------------------------------------------------------------

    async def _world(self, what: str, fn: Callable[[], T], mutation: Mutation) -> T:
        """A world call; any failure is `BACKEND_FAILURE` with `mutation` (carrying the world's
        `PluginFault` when it says the failure repeats)."""
        try:
            return await self.run_model(what, fn)
        except DomainError as exc:
            # a world's own fault that repeats (a deterministic refusal) keeps its data, so
            # the run ends at once instead of being retried
            fault = exc.data if exc.data is not None and exc.data.repeats else None
            if exc.code == ErrorCode.BACKEND_FAILURE and exc.mutation != Mutation.NONE:
                raise DomainError(exc.code, exc.message, mutation, fault) from None
            raise DomainError(ErrorCode.BACKEND_FAILURE, f"{what}: {exc.code}: {exc.message}",
                              mutation, fault) from None
        except Exception as exc:
            fault = PluginFault.of(exc, self.settings.world, PluginStage.CALL)
            raise DomainError(ErrorCode.BACKEND_FAILURE, f"{what} failed: {fault.summary()}",
                              mutation, fault) from None

    def _fresh_media(self) -> None:
        self.pipelines = {v.view_id: ViewPipeline(v.observation_delay_steps)
                          for v in self.descriptor.views}
        self.last_served = {}
        self.budgets = {a.stream_id: AudioBudget(a.sample_rate, self.descriptor.step_duration)
                        for a in self.descriptor.audio}
        self.resumed_streams = set()

    def _observe(self, boundary: int, world_time: RationalNs, *, audio: bool) -> WorldObservation:
        """Render the observation of `boundary` (runs in the model thread)."""
        faults = self.launch.faults
        views: list[ViewRef] = []
        for spec in self.descriptor.views:
            pipeline = self.pipelines[spec.view_id]
            frame = pipeline.again(boundary, self.world.render(spec.view_id, boundary))
            if frame is None:
                raise DomainError(ErrorCode.BACKEND_FAILURE,
                                  f"view {spec.view_id} rendered None at boundary {boundary}, "
                                  "which has no previous frame to serve again",
                                  Mutation.APPLIED)
            if not isinstance(frame, bytes | bytearray) or len(frame) != spec.byte_length:
                raise DomainError(ErrorCode.BACKEND_FAILURE,
                                  f"view {spec.view_id} rendered "
                                  f"{len(frame) if isinstance(frame, bytes | bytearray) else 0} "
                                  f"bytes; the descriptor requires {spec.byte_length}",
                                  Mutation.APPLIED)
            pipeline.push(boundary, bytes(frame))
            self.media.render((spec.view_id, boundary), VIEW_CONTENT_TYPE, bytes(frame))
            produced, data = pipeline.served(boundary)
            previous = self.last_served.get(spec.view_id)
            if faults.stale_view_at_boundary == boundary and previous is not None:
                ref = previous
            elif faults.truncated_view_at_boundary == boundary:
                ref = ViewRef(spec.view_id, produced, self.media.stage(
                    VIEW_CONTENT_TYPE, data[: len(data) - spec.row_stride]))
            else:
                ref = ViewRef(spec.view_id, produced,
                              self.media.serve((spec.view_id, produced), VIEW_CONTENT_TYPE, data))
            self.last_served[spec.view_id] = ref
            if faults.omit_view_at_boundary != boundary:
                views.append(ref)
        chunks: list[AudioRef] = []
        if audio:
            for stream in self.descriptor.audio:
                span = self.budgets[stream.stream_id].next_chunk()
                samples = self.world.audio(stream.stream_id, span.frames)
                expected = span.frames * stream.channels * 4
                if not isinstance(samples, bytes | bytearray) or len(samples) != expected:
                    raise DomainError(ErrorCode.BACKEND_FAILURE,
                                      f"audio stream {stream.stream_id} produced a chunk of the "
                                      f"wrong size; {expected} bytes were due", Mutation.APPLIED)
                first = span.first_sample
                if faults.overlapping_audio_at_boundary == boundary:
                    first = max(0, first - 1)
                resumed = stream.stream_id in self.resumed_streams
                self.resumed_streams.discard(stream.stream_id)
                if faults.omit_audio_at_boundary != boundary:
                    chunks.append(AudioRef(stream.stream_id, first, span.frames,
                                           self.media.stage(AUDIO_CONTENT_TYPE, bytes(samples)),
                                           resumed))
        engine_frame = getattr(self.world, "engine_frame", None)
        return WorldObservation(
            boundary=boundary,
            world_time=world_time,
            engine_frame=None if engine_frame is None else str(engine_frame(boundary)),
            sensory_views=tuple(views),
            inspection=self.world.inspection(boundary),
            broadcast_views=tuple(v.view_id for v in views),
            audio=tuple(chunks),
            agent_inputs=self.agent_inputs(boundary),
        )

    def agent_inputs(self, boundary: int) -> tuple[AgentInput, ...] | None:
        """Each bound port's own input, its arrays staged like media (inline when small, by
        reference above the threshold), for a world that offers per-agent inputs."""
        if PER_AGENT_INPUT not in self.extras():
            return None
        inputs: list[AgentInput] = []
        for port, _agent in self.bindings:
            structured, arrays = self.world.agent_input(port, boundary)  # type: ignore[attr-defined]
            inputs.append(AgentInput(port, structured, tuple(
                ArrayValue(a.id, a.dtype, a.shape,
                           self.media.stage(ARRAY_CONTENT_TYPE, a.data, a.digest))
                for a in arrays)))
        return tuple(inputs)

    def _check_capturable(self, method: str) -> None:
        """`UNSUPPORTED` before anything changes when even the smallest capture of this world
        cannot be one bus frame: its payload holds a frame of every view as base64 and travels
        as base64 itself. Every run ends with a durable capture, so such a world could step
        but never finish; refused here, the run fails at once naming the limit."""
        limit = self.envelope_limit()
        if not limit or "State.Capture" not in self.handlers \
                or self.descriptor.recovery != "exact-checkpoint":
            return
        least = _base64_length(sum(_base64_length(v.byte_length)
                                   for v in self.descriptor.views))
        if least > limit:
            raise DomainError.before(
                ErrorCode.UNSUPPORTED,
                f"{method}: a checkpoint of this world carries its views base64 twice, at least "
                f"{least} bytes, over maxEnvelopeBytes {limit} (raise [bus.limits] "
                "max_envelope_bytes or render smaller views)")

    async def _render(self, call: Call, boundary: int, world_time: RationalNs, *,
                      audio: bool) -> WorldObservation:
        """Render the observation of `boundary` and seal its large media; the sealed artifacts
        leave with the reply (`call.outgoing`)."""
        self.media.discard()
        observation = await self._world(
            RENDER, lambda: self._observe(boundary, world_time, audio=audio), Mutation.APPLIED)
        observation, attachments = await self.media.seal(observation)
        call.outgoing.extend(attachments)
        self.media.retain_only(self._retained(), self.shell.replayable_artifacts())
        return observation

    def _retained(self) -> set[tuple[str, int]]:
        """The frames the view pipelines retain: those a later boundary may still serve."""
        return {(view_id, step) for view_id, pipeline in self.pipelines.items()
                for step, _data in pipeline.frames}

    def view_shapes(self) -> list[tuple[int, int]]:
        """`(byte length, observation delay)` of each declared view, for `MediaSink`."""
        return [(v.byte_length, v.observation_delay_steps) for v in self.descriptor.views]

    def kept_artifacts(self) -> frozenset[str]:
        return self.media.kept()

    def _fitting(self, call: Call, boundary: int, result: dict[str, Any]) -> dict[str, Any]:
        """`result`, or `BACKEND_FAILURE`/`applied` naming the limit when its reply cannot be one
        bus frame: the router would refuse the reply and the coordinator hear only that the call
        went without one."""
        size, limit = self.reply_frame(call, result)
        if limit and size > limit:
            raise DomainError(ErrorCode.BACKEND_FAILURE,
                              f"{call.method}: the observation of boundary {boundary} makes a "
                              f"reply of {size} bytes, over maxEnvelopeBytes {limit} (media "
                              "travel inline: raise [bus.limits] max_envelope_bytes or render "
                              "smaller views)", Mutation.APPLIED)
        return result

    def _scope_step(self) -> None:
        status = self.status
        assert status.current_scope is not None
        status.current_scope = status.current_scope.at(self.boundary)

    # Environment.Initialize (design/session.md §3.4) ----------------------------------------------

    async def initialize(self, call: Call) -> dict[str, Any]:
        method = call.method
        # 1: scope, session, phase, step 0
        scope = self.check_scope(call)
        self.check_initialize_phase(call)
        if scope.step != 0:
            raise DomainError.before(ErrorCode.FUTURE_STEP,
                                     f"{method} names step {scope.step}; a world starts at 0")
        # 2: params schema, binding count
        call.check_params()
        p = call.params
        raw_bindings: list[list[str]] = p["portBindings"]
        if len(raw_bindings) > self.launch.max_agents:
            raise DomainError.invalid(f"{method}: {len(raw_bindings)} port bindings; at most "
                                      f"{self.launch.max_agents} agents")
        bindings = tuple((port, agent) for port, agent in raw_bindings)
        # 3: ports, duplicates, backend config
        for port, _agent in bindings:
            if port not in self.settings.ports:
                raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                         f"{method} binds port {port}; {self.launch.worker_id} "
                                         f"has ports {list(self.settings.ports)}")
        seen_ports: set[str] = set()
        seen_agents: set[str] = set()
        for port, agent in bindings:
            if port in seen_ports:
                raise DomainError.invalid(f"{method}: port {port} is bound twice")
            if agent in seen_agents:
                raise DomainError.invalid(f"{method}: agent {agent} is bound to two ports")
            seen_ports.add(port)
            seen_agents.add(agent)
        backend = AssetRef.from_json(p["backendConfig"], "params.backendConfig")
        AssetRef.from_json(p["taskConfig"], "params.taskConfig")
        if backend != self.config_asset:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"{method} names backend config {backend.id} "
                                     f"({backend.digest[:12]}); this world's is "
                                     f"{self.config_asset.id} ({self.config_asset.digest[:12]})")
        episode: str = p["episodeId"]
        self._check_capturable(method)
        # 4: apply
        await self._world(method, lambda: self.world.reset(episode, bindings), Mutation.UNKNOWN)
        self.shell.cache.adopt_epoch(scope.epoch)
        self.epoch = scope.epoch
        self.episode_id = episode
        self.bindings = bindings
        self.boundary = 0
        self.world_time = RationalNs.zero()
        self.batches = BatchSet()
        self._fresh_media()
        self.progress += 1
        status = self.status
        status.state = WorkerState.READY
        status.current_scope = scope.at(0)
        status.last_batch_id = None
        status.raise_progress(self.progress)
        self.media.configure(self.shell.client, self.view_shapes(),
                             self.shell.replayable_artifacts())
        observation = await self._render(call, 0, self.world_time, audio=False)
        return self._fitting(call, 0, {"descriptor": self.descriptor.to_json(),
                                       "observation": observation.to_json()})

    # Environment.Advance (design/session.md §3.5) -------------------------------------------------

    async def advance(self, call: Call) -> dict[str, Any]:
        method = call.method
        # 1: epoch check, step == boundary
        scope = self.check_epoch(call, self.epoch)
        k = self.boundary
        self.check_step(call, scope.step, k)
        # 2: params schema, batch id
        call.check_params()
        p = call.params
        batch_id: str = p["batchId"]
        if batch_id in self.batches:
            raise DomainError.before(ErrorCode.CONFLICT,
                                     f"batch {batch_id} was already applied in epoch "
                                     f"{self.epoch}")
        # 3: controls
        controls: Sequence[PortControl] = [
            PortControl.from_json(item, f"params.controls[{i}]")
            for i, item in enumerate(p["controls"])]
        check_controls(controls, self.descriptor.ports)
        # 4: apply
        status = self.status
        status.state = WorkerState.ADVANCING
        await self._world(method, lambda: self.world.apply(controls), Mutation.UNKNOWN)
        self.boundary = k + 1
        self.world_time = self.world_time + self.descriptor.step_duration
        self.batches.add(batch_id)
        status.last_batch_id = batch_id
        self._scope_step()
        self.progress += 1
        status.raise_progress(self.progress)
        # 5: fault delay
        await self.sleep_fault("advance_delay_ms", k)
        # 6: render
        observation = await self._render(call, k + 1, self.world_time, audio=True)
        result = self._fitting(call, k + 1, {
            "batchId": batch_id,
            "appliedFromStep": format_u64(k),
            "nextStep": format_u64(k + 1),
            "appliedControlsDigest": controls_digest([c.to_json() for c in controls]),
            "observation": observation.to_json(),
        })
        # 7
        status.state = WorkerState.READY
        return result


# --------------------------------------------------------------------------------------------
# State.* (design/state.md §6.3, §6.4)


@dataclass(frozen=True)
class StagedWorld:
    """A restored world beside the live one: installed only by activation."""

    world: World
    episode_id: str
    bindings: tuple[tuple[str, str], ...]
    world_time: RationalNs
    frames: dict[str, list[tuple[int, bytes]]]
    audio: dict[str, tuple[int, int]]
    progress: int


class WorldParticipant:
    """The environment's wrapper (`world`), compatibility digest and install."""

    def __init__(self, endpoint: EnvironmentEndpoint) -> None:
        self.endpoint = endpoint

    @property
    def epoch(self) -> str | None:
        return self.endpoint.epoch

    def committed_step(self) -> int:
        return self.endpoint.boundary

    def identity(self) -> None:
        return None

    def compatibility_digest(self) -> str:
        return digest_of(compatibility_block(self.endpoint.descriptor))

    def capture_wrapper(self, checkpoint_id: str, scope: Scope) -> dict[str, Any]:
        e = self.endpoint
        frames = [{"viewId": spec.view_id, "producedStep": format_u64(step),
                   "digest": digest_bytes(data), "data": base64.b64encode(data).decode("ascii")}
                  for spec in e.descriptor.views for step, data in e.pipelines[spec.view_id].frames]
        audio = [{"streamId": a.stream_id, "position": format_u64(e.budgets[a.stream_id].position),
                  "acc": format_u64(e.budgets[a.stream_id].acc)} for a in e.descriptor.audio]
        return {
            **common_members("world", checkpoint_id, scope),
            "workerId": e.launch.worker_id,
            "episodeId": e.episode_id,
            "worldTime": e.world_time.to_json(),
            "bindings": [[port, agent] for port, agent in e.bindings],
            "compatibilityDigest": self.compatibility_digest(),
            "progress": format_u64(e.progress),
            "frames": frames,
            "audio": audio,
            "world": plugin_blob(e.world.capture()),
        }

    def _frames(self, raw: Any, k: int) -> dict[str, list[tuple[int, bytes]]]:
        """Exactly boundaries `max(0, k − delay)..k` per declared view, oldest first."""
        descriptor = self.endpoint.descriptor
        if not isinstance(raw, list):
            raise incompatible("the world payload's frames are not a list")
        want = [(spec, step) for spec in descriptor.views
                for step in range(max(0, k - spec.observation_delay_steps), k + 1)]
        if len(raw) != len(want):
            raise incompatible(f"the world payload holds {len(raw)} frames; the retained "
                               f"boundaries up to {k} of every declared view are {len(want)}")
        out: dict[str, list[tuple[int, bytes]]] = {spec.view_id: [] for spec in descriptor.views}
        for item, (spec, step) in zip(raw, want, strict=True):
            if not isinstance(item, dict) or set(item) != {"viewId", "producedStep", "digest",
                                                           "data"}:
                raise incompatible("a world payload frame is malformed")
            if item["viewId"] != spec.view_id or \
                    parse_u64_member(item["producedStep"], "frame.producedStep") != step:
                raise incompatible(f"the world payload's frames are not boundaries of view "
                                   f"{spec.view_id} in order (expected {step})")
            try:
                data = base64.b64decode(item["data"], validate=True) \
                    if isinstance(item["data"], str) else None
            except (binascii.Error, ValueError):
                data = None
            if data is None or len(data) != spec.byte_length:
                raise incompatible(f"frame {step} of view {spec.view_id} is not "
                                   f"{spec.byte_length} bytes")
            if digest_bytes(data) != parse_digest_member(item["digest"], "frame.digest"):
                raise incompatible(f"frame {step} of view {spec.view_id} does not match its "
                                   "digest")
            out[spec.view_id].append((step, data))
        return out

    def _audio(self, raw: Any) -> dict[str, tuple[int, int]]:
        e = self.endpoint
        streams = [a.stream_id for a in e.descriptor.audio]
        if not isinstance(raw, list) or [
                item.get("streamId") if isinstance(item, dict) else None
                for item in raw] != streams:
            raise incompatible(f"the world payload's audio does not list exactly the declared "
                               f"streams {streams}")
        out: dict[str, tuple[int, int]] = {}
        for item, spec in zip(raw, e.descriptor.audio, strict=True):
            if set(item) != {"streamId", "position", "acc"}:
                raise incompatible(f"audio stream {spec.stream_id}'s state is malformed")
            position = parse_u64_member(item["position"], "audio.position")
            acc = parse_u64_member(item["acc"], "audio.acc")
            try:
                AudioBudget(spec.sample_rate, e.descriptor.step_duration, position, acc)
            except DomainError as exc:
                raise incompatible(f"audio stream {spec.stream_id}: {exc.message}") from None
            out[spec.stream_id] = (position, acc)
        return out

    def stage_wrapper(self, data: bytes, params: Mapping[str, Any],
                      scope: Scope) -> StagedWorld:
        e = self.endpoint
        doc = wrapper_object(data, "world", WORLD_WRAPPER_KEYS)
        if doc["workerId"] != e.launch.worker_id:
            raise DomainError.before(ErrorCode.IDENTITY_MISMATCH,
                                     f"the payload is world {doc['workerId']!r}'s; this worker "
                                     f"is {e.launch.worker_id}")
        check_provenance(doc, params, scope)
        own = self.compatibility_digest()
        if doc["compatibilityDigest"] != params["compatibilityDigest"] \
                or doc["compatibilityDigest"] != own:
            raise incompatible(f"the payload's compatibility digest "
                               f"{doc['compatibilityDigest']!r} differs from the request's or "
                               f"this world's {own}")
        raw_bindings = doc["bindings"]
        if not isinstance(raw_bindings, list) or not all(
                isinstance(b, list) and len(b) == 2 and all(isinstance(x, str) for x in b)
                for b in raw_bindings):
            raise incompatible("the world payload's bindings are not [[portId, agentId], ...]")
        bindings = tuple((port, agent) for port, agent in raw_bindings)
        if sorted(port for port, _ in bindings) != sorted(e.settings.ports):
            raise incompatible(f"the checkpoint binds ports {[p for p, _ in bindings]}; this "
                               f"world has {list(e.settings.ports)}")
        k = scope.step
        frames = self._frames(doc["frames"], k)
        audio = self._audio(doc["audio"])
        episode = doc["episodeId"]
        if not isinstance(episode, str):
            raise incompatible("the world payload's episodeId is not a string")
        try:
            world_time = RationalNs.from_json(doc["worldTime"], "worldTime")
        except DomainError as exc:
            raise incompatible(exc.message) from None
        progress = parse_u64_member(doc["progress"], "progress")
        blob = decode_plugin_blob(doc["world"], "the world state")
        settings = e.settings
        world = e.world_class(
            world_id=e.launch.worker_id, ports=settings.ports, step=settings.step,
            observation_delay_steps=settings.observation_delay_steps, threads=e.launch.threads,
            config=settings.world_config)
        try:
            world.reset(episode, bindings)
            world.restore(blob)
        except DomainError as exc:
            if exc.code == ErrorCode.RESTORE_DIVERGED:
                # the world found its own state would not come back (e.g. a replay checked
                # against its record): that, not an incompatible checkpoint
                raise DomainError.before(ErrorCode.RESTORE_DIVERGED, exc.message) from None
            raise incompatible(f"the world refuses the state: {exc.message}") from None
        except Exception as exc:
            raise incompatible(f"the world refuses the state: {type(exc).__name__}") from None
        if world_time != e.descriptor.step_duration.times(k):
            raise incompatible(f"the checkpoint's world time {world_time} is not {k} steps of "
                               f"{e.descriptor.step_duration}")
        return StagedWorld(world, episode, bindings, world_time, frames, audio, progress)

    async def seal_media(self, call: Call, observation: dict[str, Any] | None,
                         ) -> dict[str, Any] | None:
        if observation is None:
            return None
        sealed, attachments = await self.endpoint.media.seal(
            WorldObservation.from_json(observation))
        call.outgoing.extend(attachments)
        return sealed.to_json()

    def install(self, staged: StagedWorld, scope: Scope) -> dict[str, Any]:
        e = self.endpoint
        k = scope.step
        # a replaced world restores without an Initialize: decide by reference here too
        e.media.configure(e.shell.client, e.view_shapes(), e.shell.replayable_artifacts())
        e.media.discard()
        e.world = staged.world
        e.episode_id = staged.episode_id
        e.bindings = staged.bindings
        e.boundary = k
        e.world_time = staged.world_time
        e.batches = BatchSet()
        e.pipelines = {}
        e.last_served = {}
        views: list[ViewRef] = []
        for spec in e.descriptor.views:
            pipeline = ViewPipeline(spec.observation_delay_steps)
            for step, data in staged.frames[spec.view_id]:
                pipeline.push(step, data)
            e.pipelines[spec.view_id] = pipeline
            produced, data = pipeline.served(k)
            ref = ViewRef(spec.view_id, produced,
                          e.media.serve((spec.view_id, produced), VIEW_CONTENT_TYPE, data))
            e.last_served[spec.view_id] = ref
            views.append(ref)
        e.budgets = {}
        for spec_a in e.descriptor.audio:
            position, acc = staged.audio[spec_a.stream_id]
            e.budgets[spec_a.stream_id] = AudioBudget(
                spec_a.sample_rate, e.descriptor.step_duration, position, acc, chunks=k)
        e.resumed_streams = {a.stream_id for a in e.descriptor.audio}
        e.progress = max(e.progress, staged.progress)
        e.status.raise_progress(e.progress)
        e.epoch = scope.epoch
        engine_frame = getattr(e.world, "engine_frame", None)
        observation = WorldObservation(
            boundary=k, world_time=staged.world_time,
            engine_frame=None if engine_frame is None else str(engine_frame(k)),
            sensory_views=tuple(views), inspection=e.world.inspection(k),
            broadcast_views=tuple(v.view_id for v in views), audio=(),
            agent_inputs=e.agent_inputs(k))
        return observation.to_json()

    def observation_digests(self, boundary: int) -> list[dict[str, str]]:
        """What the restored world observes now, in the behaviour record's form (design/state.md
        §6.5, `observationDigests`): per declared view, by view id, the step and digest of the
        frame served at `boundary`. Every view's frame of `boundary` is rendered again from the
        restored world, not read from the checkpoint. An undelayed view serves that frame, so
        its digest goes to the coordinator, which compares it with its record. A delayed view
        serves a frame of an earlier boundary that only the checkpoint holds (reported as
        recorded); its frame of `boundary` is in the checkpoint too, but not in the
        coordinator's record, so this world compares the two itself: a difference is
        `RESTORE_DIVERGED`. Model thread; renders once more, changes nothing."""
        e = self.endpoint
        entries: list[dict[str, str]] = []
        for spec in sorted(e.descriptor.views, key=lambda v: v.view_id):
            pipeline = e.pipelines[spec.view_id]
            now = self._render_again(spec, boundary)
            produced, served = pipeline.served(boundary)
            if produced == boundary:
                served = now
            else:
                recorded = next(data for step, data in pipeline.frames if step == boundary)
                if now != recorded:
                    raise DomainError(
                        ErrorCode.RESTORE_DIVERGED,
                        f"view {spec.view_id}: frame {boundary} rendered again by the restored "
                        f"world has digest {digest_bytes(now)}; the checkpoint's frame "
                        f"{boundary} has digest {digest_bytes(recorded)}", Mutation.UNKNOWN)
            entries.append({"viewId": spec.view_id, "producedStep": format_u64(produced),
                            "digest": digest_bytes(served)})
        return entries

    def _render_again(self, spec: ViewDescriptor, boundary: int) -> bytes:
        """`world.render` of the restored world; a failure or a frame of the wrong size is
        `BACKEND_FAILURE`/`unknown` (the state was installed)."""
        e = self.endpoint
        try:
            frame = e.world.render(spec.view_id, boundary)
            if frame is None:  # the frame of k − 1 again: the checkpoint's frame of k is it
                frame = next(data for step, data in e.pipelines[spec.view_id].frames
                             if step == boundary)
        except DomainError:
            raise
        except Exception as exc:
            fault = PluginFault.of(exc, e.settings.world, PluginStage.CALL)
            raise DomainError(ErrorCode.BACKEND_FAILURE,
                              f"rendering view {spec.view_id} of the restored world failed: "
                              f"{fault.summary()}", Mutation.UNKNOWN, fault) from None
        if not isinstance(frame, bytes | bytearray) or len(frame) != spec.byte_length:
            raise DomainError(ErrorCode.BACKEND_FAILURE,
                              f"view {spec.view_id} of the restored world rendered a frame of "
                              f"the wrong size; the descriptor requires {spec.byte_length} "
                              "bytes", Mutation.UNKNOWN)
        return bytes(frame)

if __name__ == "__main__":
    sys.exit(main("environment", sys.argv[1:], endpoint_factory=EnvironmentEndpoint))
