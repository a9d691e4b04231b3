"""The environment endpoint: `Environment.Initialize`, `Environment.Advance` (session.md §3.4,
§3.5); `python -m workers.environment …` (§7.5, §7.7).

Why: the shared world behind the session's guarantees. The world (a `World`, §4.1, named by
`--world`) keeps only its own state; this endpoint owns the boundary, world time, the batch set,
the view pipeline, the audio sample budgets, every check of §3 in its order, and the environment
fault knobs (`advance_delay_ms` and the media faults of §4.9).

View pipeline: exactly one frame rendered per boundary per view; the last `delay+1` frames are
kept; at boundary `b` the frame produced at `max(0, b − delay)` is served (boundaries `0..delay`
repeat O[0]). Audio: one chunk per transition per stream, sized by `AudioBudget` (§5.3), none at
boundary 0, `discontinuity` false.

Media faults at boundary B (applied to whichever observation has that boundary, O[0] included):
`omit_view_at_boundary` serves no sensory view (the frame is still rendered and kept);
`stale_view_at_boundary` serves again the `ViewRef` served at the previous boundary;
`truncated_view_at_boundary` serves the frame one row short, with a blob that describes the
shorter bytes honestly; `omit_audio_at_boundary` drops the chunk (it is produced, so the stream
position and the world's audio state advance: the next chunk shows the gap);
`overlapping_audio_at_boundary` moves the chunk's `firstSample` one back (saturating at 0).

Resolved ambiguities:
- The world is built when the endpoint is (at launch), from the launch's world settings; its
  descriptor must be valid (§1.8), declare exactly the launch's ports in launch order and the
  launch's step, else the launch is refused (`INVALID_ARGUMENT`).
- `broadcastViews` lists every sensory view served (v1 carries no second copy of the bytes).
- `engineFrame` is `world.engine_frame(boundary)` when the world offers it, else null.
- `Environment.Initialize` also refuses (`INVALID_ARGUMENT`) an agent bound to two ports; the
  `taskConfig` asset is parsed but not compared (the task is coordinator-local).
- A world failure while resetting or applying is `BACKEND_FAILURE`/`unknown`; a render failure
  after the step was applied is `BACKEND_FAILURE`/`applied` (§3.5 step 6), also at Initialize
  (the episode was reset). A rendered frame or audio chunk of the wrong size is a render failure.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Final, TypeVar

from workers.canonical import controls_digest
from workers.clock import AudioBudget, RationalNs
from workers.datatypes import (
    AUDIO_CONTENT_TYPE,
    VIEW_CONTENT_TYPE,
    AssetRef,
    AudioRef,
    EnvironmentDescriptor,
    PortControl,
    ViewRef,
    WorldObservation,
    check_controls,
    encode_media,
)
from workers.domain import DomainError, ErrorCode, Mutation, format_u64
from workers.faults import Role
from workers.launch import WorkerLaunch
from workers.protocols import World
from workers.shell import Call, Endpoint, WorkerState, check_params, load_plugin, main

__all__ = ["EnvironmentEndpoint", "ViewPipeline"]

T = TypeVar("T")
RENDER: Final = "render"


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
        self.batches: set[str] = set()
        self.progress = 0
        self.pipelines: dict[str, ViewPipeline] = {}
        self.last_served: dict[str, ViewRef] = {}
        self.budgets: dict[str, AudioBudget] = {}
        self.handlers = {
            "Environment.Initialize": self.initialize,
            "Environment.Advance": self.advance,
        }

    def extras(self) -> tuple[str, ...]:
        return tuple(getattr(self.world_class, "capabilities", ()))

    # helpers ----------------------------------------------------------------------------------

    async def _world(self, what: str, fn: Callable[[], T], mutation: Mutation) -> T:
        """A world call; any failure is `BACKEND_FAILURE` with `mutation`."""
        try:
            return await self.run_model(what, fn)
        except DomainError as exc:
            if exc.code == ErrorCode.BACKEND_FAILURE and exc.mutation != Mutation.NONE:
                raise DomainError(exc.code, exc.message, mutation) from None
            raise DomainError(ErrorCode.BACKEND_FAILURE, f"{what}: {exc.code}: {exc.message}",
                              mutation) from None
        except Exception as exc:
            raise DomainError(ErrorCode.BACKEND_FAILURE, f"{what} failed: {type(exc).__name__}",
                              mutation) from None

    def _fresh_media(self) -> None:
        self.pipelines = {v.view_id: ViewPipeline(v.observation_delay_steps)
                          for v in self.descriptor.views}
        self.last_served = {}
        self.budgets = {a.stream_id: AudioBudget(a.sample_rate, self.descriptor.step_duration)
                        for a in self.descriptor.audio}

    def _observe(self, boundary: int, world_time: RationalNs, *, audio: bool) -> WorldObservation:
        """Render the observation of `boundary` (runs in the model thread)."""
        faults = self.launch.faults
        views: list[ViewRef] = []
        for spec in self.descriptor.views:
            frame = self.world.render(spec.view_id, boundary)
            if not isinstance(frame, bytes | bytearray) or len(frame) != spec.byte_length:
                raise DomainError(ErrorCode.BACKEND_FAILURE,
                                  f"view {spec.view_id} rendered "
                                  f"{len(frame) if isinstance(frame, bytes | bytearray) else 0} "
                                  f"bytes; the descriptor requires {spec.byte_length}",
                                  Mutation.APPLIED)
            pipeline = self.pipelines[spec.view_id]
            pipeline.push(boundary, bytes(frame))
            produced, data = pipeline.served(boundary)
            previous = self.last_served.get(spec.view_id)
            if faults.stale_view_at_boundary == boundary and previous is not None:
                ref = previous
            else:
                if faults.truncated_view_at_boundary == boundary:
                    data = data[: len(data) - spec.row_stride]
                ref = ViewRef(spec.view_id, produced, encode_media(VIEW_CONTENT_TYPE, data))
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
                if faults.omit_audio_at_boundary != boundary:
                    chunks.append(AudioRef(stream.stream_id, first, span.frames,
                                           encode_media(AUDIO_CONTENT_TYPE, bytes(samples)),
                                           False))
        engine_frame = getattr(self.world, "engine_frame", None)
        return WorldObservation(
            boundary=boundary,
            world_time=world_time,
            engine_frame=None if engine_frame is None else str(engine_frame(boundary)),
            sensory_views=tuple(views),
            inspection=self.world.inspection(boundary),
            broadcast_views=tuple(v.view_id for v in views),
            audio=tuple(chunks),
        )

    def _scope_step(self) -> None:
        status = self.status
        assert status.current_scope is not None
        status.current_scope = status.current_scope.at(self.boundary)

    # Environment.Initialize (§3.4) -------------------------------------------------------------

    async def initialize(self, call: Call) -> dict[str, Any]:
        method = call.method
        # 1: scope, session, phase, step 0
        scope = self.check_scope(call)
        self.check_initialize_phase(call)
        if scope.step != 0:
            raise DomainError.before(ErrorCode.FUTURE_STEP,
                                     f"{method} names step {scope.step}; a world starts at 0")
        # 2: params schema, binding count
        check_params(method, call.params)
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
        # 4: apply
        await self._world(method, lambda: self.world.reset(episode, bindings), Mutation.UNKNOWN)
        self.shell.cache.adopt_epoch(scope.epoch)
        self.epoch = scope.epoch
        self.episode_id = episode
        self.bindings = bindings
        self.boundary = 0
        self.world_time = RationalNs.zero()
        self.batches = set()
        self._fresh_media()
        self.progress += 1
        status = self.status
        status.state = WorkerState.READY
        status.current_scope = scope.at(0)
        status.last_batch_id = None
        status.raise_progress(self.progress)
        observation = await self._world(
            RENDER, lambda: self._observe(0, self.world_time, audio=False), Mutation.APPLIED)
        return {"descriptor": self.descriptor.to_json(), "observation": observation.to_json()}

    # Environment.Advance (§3.5) ----------------------------------------------------------------

    async def advance(self, call: Call) -> dict[str, Any]:
        method = call.method
        # 1: epoch check, step == boundary
        scope = self.check_epoch(call, self.epoch)
        k = self.boundary
        self.check_step(call, scope.step, k)
        # 2: params schema, batch id
        check_params(method, call.params)
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
        world_time = self.world_time
        observation = await self._world(
            RENDER, lambda: self._observe(k + 1, world_time, audio=True), Mutation.APPLIED)
        # 7
        status.state = WorkerState.READY
        return {
            "batchId": batch_id,
            "appliedFromStep": format_u64(k),
            "nextStep": format_u64(k + 1),
            "appliedControlsDigest": controls_digest([c.to_json() for c in controls]),
            "observation": observation.to_json(),
        }


if __name__ == "__main__":
    sys.exit(main("environment", sys.argv[1:], endpoint_factory=EnvironmentEndpoint))
