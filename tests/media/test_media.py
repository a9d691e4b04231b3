"""Tests 93–104 (state.md §10): the media behaviour v1 has — one shared image per boundary, the
declared render delay, view and audio faults, the exact audio sample budget, audio across a
restore (state.md §7.5) and persistent assets named by id and digest.

Sessions run in-process unless marked. What the agents read and what the world rendered is
recorded by an endpoint factory handed to the launcher: every agent's model class is wrapped so
that `encode` (the plugin call that receives the decoded views) logs the views it was given, and
the world's `render` is wrapped to log each frame. The factory runs wherever the endpoint is
built in this process (in-process and thread modes); a process-mode child builds its own, so
there the published media are compared instead ("where observable").

Across a restore (tests 99, 101) the environment's own `State.Capture`, `State.StageRestore` and
`State.ActivateRestore` are driven over the bus, and the resumed chunks are checked with
`AudioTimelines`, the coordinator's restore-side timeline object (state.md §7.2 step 8).
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pytest

from flyd.launch.identities import WorkerRef
from flyd.launch.launcher import ExecutionMode, Launcher, connect_expected, start_error
from flyd.launch.spawner import LauncherSettings, Spawner
from flyd.session.audio import AudioTimeline, AudioTimelines
from flyd.session.fence import SessionFailure
from flyd.session.runspec import RunSpec
from tests.session.harness import ALL_MODES, Fixture, SessionHarness
from tests.session.worker_rig import agent_init_params, control, env_init_params
from workers.agent import AgentEndpoint
from workers.environment import EnvironmentEndpoint
from workers.faults import Faults
from workers.launch import MAX_MEDIA_INLINE_MAX_BYTES, WorkerLaunch
from workers.protocols import AgentModel, DecodedView
from workers.roles import endpoint_for
from workers.shell import Endpoint
from workers.synthetic.arena import CounterArena
from workers.types.datatypes import (
    AUDIO_CONTENT_TYPE,
    AudioRef,
    EnvironmentDescriptor,
    TypedValue,
    ViewRef,
    decode_audio,
    decode_view,
    encode_media,
)
from workers.types.domain import DomainError, ErrorCode, Scope
from workers.types.ticks import RationalNs

pytestmark = pytest.mark.timeout(60)

STEPS = 3
HZ60 = RationalNs(50_000_000, 3)
HZ7 = RationalNs(1_000_000_000, 7)
AGENTS = ("fly-a", "fly-b")

Sensed = tuple[int, bytes]
"""One boundary as an agent read it: (producedStep, pixels) of its only view."""


# ------------------------------------------------------------------------------ the recorder


@dataclass
class Recorder:
    """What the world rendered and what every agent's model was given, in call order."""

    renders: list[tuple[int, bytes]] = field(default_factory=list)
    sensed: dict[str, list[Sensed]] = field(default_factory=dict)

    def factory(self, launch: WorkerLaunch) -> Endpoint:
        endpoint = endpoint_for(launch)
        if isinstance(endpoint, AgentEndpoint):
            log = self.sensed.setdefault(launch.worker_id, [])
            endpoint.model_class = _sensing(endpoint.model_class, log)
        elif isinstance(endpoint, EnvironmentEndpoint):
            _wrap(endpoint.world, "render", self._rendering(endpoint.world.render))
        return endpoint

    def _rendering(self, render: Callable[[str, int], bytes]) -> Callable[[str, int], bytes]:
        def recorded(view_id: str, boundary: int) -> bytes:
            frame = render(view_id, boundary)
            self.renders.append((boundary, bytes(frame)))
            return frame
        return recorded

    def produced(self, agent_id: str) -> list[int]:
        return [p for p, _ in self.sensed[agent_id]]


def _sensing(base: type[AgentModel], log: list[Sensed]) -> type[AgentModel]:
    """`base` whose `encode` also logs the single view it receives."""
    original = base.encode

    def encode(cls: type[AgentModel], views: Sequence[DecodedView],
               structured: TypedValue | None) -> Any:
        assert len(views) == 1
        log.append((views[0].produced_step, bytes(views[0].pixels)))
        return original(views, structured)

    return cast(type[AgentModel],
                type(f"Sensing{base.__name__}", (base,), {"encode": classmethod(encode)}))


def _wrap(target: object, name: str, replacement: Callable[..., Any]) -> None:
    setattr(target, name, replacement)


# ------------------------------------------------------------------------------ the session


@dataclass
class MediaFixture(Fixture):
    """The harness fixture plus the world's render delay and step."""

    delay: int = 0
    step: RationalNs = HZ60

    def spec(self) -> RunSpec:
        base = super().spec()
        return replace(base, world=replace(base.world, observation_delay_steps=self.delay,
                                           step=self.step))


class MediaHarness(SessionHarness):
    """`SessionHarness` whose launcher builds endpoints through a `Recorder`."""

    recorder: Recorder

    async def _open(self) -> None:
        self.recorder = Recorder()
        fixture = self.fixture
        self.spawner = Spawner(LauncherSettings(
            media_inline_max_bytes=fixture.media_inline_max_bytes), socket=self.socket)
        self.launcher = await Launcher.open(names=self.names, socket=self.socket, node=self.node,
                                            budget=self.budget, health=fixture.health,
                                            endpoint_factory=self.recorder.factory,
                                            spawner=self.spawner)
        try:
            self.workers = await self.launcher.launch_composition(self.spec, fixture.mode)
        except DomainError as exc:
            raise start_error(exc) from None
        self.coordinator_client = await connect_expected(
            self.node, self.socket, self.names.coordinator_client_id,
            grants=self.names.client_grants())
        self._coordinator = self.new_coordinator()


def recorder_of(h: SessionHarness) -> Recorder:
    assert isinstance(h, MediaHarness)
    return h.recorder


def pixels(ref: dict[str, Any]) -> bytes:
    return base64.b64decode(ref["pixels"]["data"])


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshots_of(feed: Any) -> list[dict[str, Any]]:
    return [p.body for p in feed.pending() if p.kind == "snapshot"]


def descriptor_of(h: SessionHarness) -> EnvironmentDescriptor:
    descriptor = h.coordinator.descriptor
    assert descriptor is not None
    return descriptor


def chunks_of(snapshots: Sequence[dict[str, Any]]) -> list[AudioRef]:
    out: list[AudioRef] = []
    for snap in snapshots:
        out.extend(AudioRef.from_json(a) for a in snap["media"]["audio"])
    return out


async def failing_step(h: SessionHarness) -> SessionFailure:
    with pytest.raises(SessionFailure) as caught:
        await h.step()
    return caught.value


# ------------------------------------------------------------------------------ 93, 94


async def test_one_shared_image_reaches_both_agents() -> None:
    async with MediaHarness.start(MediaFixture()) as h:
        await h.bootstrap()
        feed = h.coordinator.snapshots.subscribe(depth=16, replay=True)
        await h.run(STEPS)
        c, rec = h.coordinator, recorder_of(h)
        assert [b for b, _ in rec.renders] == list(range(STEPS + 1))
        assert rec.sensed["fly-a"] == rec.sensed["fly-b"]
        assert rec.produced("fly-a") == [0, 1, 2, 3]
        assert [data for _, data in rec.sensed["fly-a"]] == [f for _, f in rec.renders]
        # one view and one chunk are held: O[3]'s decoded view and its audio chunk
        assert c.media.count() == 2
        assert c.observation is not None
        assert len(c.observation.sensory_views) == 1 and len(c.observation.audio) == 1
        last = snapshots_of(feed)[-1]
        assert last["scope"]["step"] == "3"
        [view] = last["media"]["views"]
        assert view["producedStep"] == "3"
        assert pixels(view) == rec.sensed["fly-a"][-1][1] == rec.sensed["fly-b"][-1][1]
        assert view["pixels"]["digest"] == digest(rec.sensed["fly-a"][-1][1])


async def test_a_declared_render_delay_repeats_o0_until_the_pipeline_fills() -> None:
    async with MediaHarness.start(MediaFixture(delay=2)) as h:
        await h.bootstrap()
        await h.run(4)
        rec = recorder_of(h)
        assert rec.sensed["fly-a"] == rec.sensed["fly-b"]
        assert rec.produced("fly-a") == [0, 0, 0, 1, 2]
        frames = [data for _, data in rec.sensed["fly-a"]]
        assert frames[0] == frames[1] == frames[2]
        rendered = dict(rec.renders)
        assert sorted(rendered) == [0, 1, 2, 3, 4]
        assert len(rec.renders) == 5
        assert frames[3] == rendered[1] and frames[4] == rendered[2]
        assert frames[3] != frames[0]


# ------------------------------------------------------------------------------ 95–97, 100


async def test_an_extra_delayed_sensory_view_fails_the_step() -> None:
    fixture = MediaFixture(faults={"arena": Faults(stale_view_at_boundary=2)})
    async with MediaHarness.start(fixture) as h:
        await h.bootstrap()
        await h.step()
        failure = await failing_step(h)
        assert (failure.code, failure.mutation) == ("BUFFER_INVALID", "unknown")
        assert failure.detail == "observation" and failure.participant == "arena"
        assert "was produced at 1; the descriptor requires 2" in failure.error.message
        assert h.coordinator.stats.advances == 1
        for agent in AGENTS:
            assert recorder_of(h).produced(agent) == [0, 1]


async def test_a_frame_of_the_wrong_length_fails_the_step() -> None:
    fixture = MediaFixture(faults={"arena": Faults(truncated_view_at_boundary=1)})
    async with MediaHarness.start(fixture) as h:
        await h.bootstrap()
        failure = await failing_step(h)
        assert (failure.code, failure.mutation) == ("BUFFER_INVALID", "unknown")
        assert failure.detail == "observation"
        assert "has 2944 bytes; the descriptor requires 3072" in failure.error.message
        assert h.coordinator.stats.advances == 0
        for agent in AGENTS:
            assert recorder_of(h).produced(agent) == [0]


class UncapturedArena(CounterArena):
    """The counter arena declaring `recovery: "none"`: nothing captures it, so only its
    observations bound its frame size."""

    def descriptor(self) -> EnvironmentDescriptor:
        return replace(super().descriptor(), recovery="none")


async def test_a_frame_over_the_envelope_fails_naming_the_limit() -> None:
    """A 512×512 view is 1 MiB of RGBA8, 1.4 MB as inline base64: with media kept inline (the
    threshold at its maximum), the world answers with a failure naming the router's limit and
    the key that raises it, never a reply the router would refuse (the coordinator would hear
    only that the call went without one)."""
    world = replace(RunSpec().world, impl="tests.media.test_media:UncapturedArena",
                    config={"width": 512, "height": 512})
    fixture = Fixture(composition=replace(RunSpec(), world=world),
                      media_inline_max_bytes=MAX_MEDIA_INLINE_MAX_BYTES)
    async with SessionHarness.start(fixture) as h:
        with pytest.raises(SessionFailure) as caught:
            await h.bootstrap()
    failure = caught.value
    assert (failure.code, failure.mutation) == ("BACKEND_FAILURE", "applied")
    assert "over maxEnvelopeBytes 1048576" in failure.error.message
    assert "[bus.limits] max_envelope_bytes" in failure.error.message


async def test_a_world_that_could_never_be_captured_fails_at_initialize() -> None:
    """A 400×400 view steps (its Advance reply is 853 KB) but a capture carries it base64
    twice (1.14 MB): refused before the reset, naming the limit, instead of failing the run's
    final checkpoint after every step."""
    spec = replace(RunSpec(), world=replace(RunSpec().world,
                                            config={"width": 400, "height": 400}))
    async with SessionHarness.start(Fixture(composition=spec)) as h:
        with pytest.raises(SessionFailure) as caught:
            await h.bootstrap()
    failure = caught.value
    assert (failure.code, failure.mutation) == ("UNSUPPORTED", "none")
    assert "at least 1137784 bytes, over maxEnvelopeBytes 1048576" in failure.error.message


async def test_overlapping_audio_fails_the_step() -> None:
    fixture = MediaFixture(faults={"arena": Faults(overlapping_audio_at_boundary=2)})
    async with MediaHarness.start(fixture) as h:
        await h.bootstrap()
        await h.step()
        failure = await failing_step(h)
        assert (failure.code, failure.mutation) == ("BUFFER_INVALID", "unknown")
        assert failure.detail == "observation"
        assert failure.error.message == "audio stream arena starts at 799; the stream is at 800"
        assert h.coordinator.stats.advances == 1


async def test_a_missing_audio_chunk_fails_the_step() -> None:
    fixture = MediaFixture(faults={"arena": Faults(omit_audio_at_boundary=2)})
    async with MediaHarness.start(fixture) as h:
        await h.bootstrap()
        c = h.coordinator
        # boundary 0 carries no audio and that is not a missing chunk
        assert c.observation is not None and c.observation.audio == ()
        assert c.snapshots.latest is not None and c.snapshots.latest["media"]["audio"] == []
        await h.step()
        failure = await failing_step(h)
        assert (failure.code, failure.mutation) == ("BUFFER_INVALID", "unknown")
        assert failure.detail == "observation"
        assert failure.error.message == \
            "audio stream arena produced no chunk for this transition"
        assert c.stats.advances == 1
    # the fault aimed at boundary 0 (harness only) has nothing to drop: the session runs
    fixture = MediaFixture(faults={"arena": Faults(omit_audio_at_boundary=0)})
    async with MediaHarness.start(fixture) as h:
        await h.bootstrap()
        await h.run(2)
        assert h.coordinator.stats.advances == 2


# ------------------------------------------------------------------------------ 98, 102


async def test_one_audio_chunk_per_boundary_with_an_exact_sample_budget() -> None:
    async with MediaHarness.start(MediaFixture()) as h:
        await h.bootstrap()
        feed = h.coordinator.snapshots.subscribe(depth=16, replay=True)
        await h.run(STEPS)
        c = h.coordinator
        descriptor = descriptor_of(h)
        snapshots = snapshots_of(feed)
        assert [s["scope"]["step"] for s in snapshots] == ["0", "1", "2", "3"]
        assert snapshots[0]["media"]["audio"] == []
        assert all(len(s["media"]["audio"]) == 1 for s in snapshots[1:])
        chunks = chunks_of(snapshots)
        assert [(a.first_sample, a.sample_frames) for a in chunks] == \
            [(0, 800), (800, 800), (1600, 800)]
        [stream] = descriptor.audio
        for chunk in chunks:
            assert chunk.stream_id == "arena" and chunk.discontinuity is False
            assert chunk.samples.byte_length == 6400
            assert len(decode_audio(chunk, stream)) == 6400  # decodes, every sample finite
        timelines = AudioTimelines.fresh(descriptor)
        for chunk in chunks:
            timelines.advance([chunk])
        assert timelines.positions() == {"arena": 2400}
        last = chunks[-1]
        assert last.first_sample + last.sample_frames == 2400
        assert c.observation is not None and list(c.observation.audio) == [last]
        # only `arena` is a sensory view; the audio stream is not one
        assert [v.view_id for v in descriptor.views] == ["arena"]
        assert [v.view_id for v in c.observation.sensory_views] == ["arena"]
        assert c.observation.broadcast_views == ("arena",)
        assert all([v["viewId"] for v in s["media"]["views"]] == ["arena"] for s in snapshots)


async def test_a_cadence_that_does_not_divide_the_sample_rate_still_lands_on_whole_samples(
) -> None:
    # the chunks are read from the local feed's snapshots, so they stay inline
    fixture = MediaFixture(step=HZ7, media_inline_max_bytes=MAX_MEDIA_INLINE_MAX_BYTES)
    async with MediaHarness.start(fixture) as h:
        await h.bootstrap()
        feed = h.coordinator.snapshots.subscribe(depth=16, replay=True)
        await h.run(7)
        descriptor = descriptor_of(h)
        assert descriptor.step_duration == HZ7
        chunks = chunks_of(snapshots_of(feed))
        frames = [a.sample_frames for a in chunks]
        assert sorted(frames) == [6857] * 6 + [6858]
        assert sum(frames) == 48000
        position = 0
        for chunk in chunks:
            assert chunk.first_sample == position and not chunk.discontinuity
            assert len(decode_audio(chunk, descriptor.audio[0])) == chunk.sample_frames * 8
            position += chunk.sample_frames
        timelines = AudioTimelines.fresh(descriptor)
        for chunk in chunks:
            timelines.advance([chunk])
        assert position == timelines.positions()["arena"] == 48000


# ------------------------------------------------------------------------------ 99, 101


async def advance_raw(h: SessionHarness, epoch: str, k: int,
                      ref: WorkerRef | None = None) -> AudioRef:
    """One `Environment.Advance` outside the coordinator (neutral controls); its only chunk."""
    result = await h.coordinator.calls.probe(
        "arena", "Environment.Advance", Scope("demo", epoch, k),
        {"batchId": f"batch-{epoch}-{k}", "controls": [control("p1"), control("p2")]}, ref=ref)
    [chunk] = result["observation"]["audio"]
    return AudioRef.from_json(chunk)


async def test_a_restored_audio_source_resumes_and_marks_the_discontinuity() -> None:
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        await h.run(STEPS)
        c = h.coordinator
        descriptor = descriptor_of(h)
        captured = await c.calls.probe("arena", "State.Capture", Scope("demo", "e1", 3),
                                     {"checkpointId": "ckpt-1"})
        # the uninterrupted stream goes on from 2400 without a discontinuity
        straight = [await advance_raw(h, "e1", k) for k in (3, 4)]
        assert [(a.first_sample, a.discontinuity) for a in straight] == \
            [(2400, False), (3200, False)]
        # a replacement environment restored at boundary 3 resumes the stream at 2400
        ref = (await h.restart_environment()).worker_ref()
        scope = Scope("demo", "e2", 3)
        staged = await c.calls.probe("arena", "State.StageRestore", scope, {
            "checkpointId": "ckpt-1", "sourceScope": Scope("demo", "e1", 3).to_json(),
            "compatibilityDigest": captured["compatibilityDigest"],
            "payload": captured["payload"]}, ref=ref)
        activated = await c.calls.probe("arena", "State.ActivateRestore", scope,
                                      {"restoreToken": staged["restoreToken"]}, ref=ref)
        assert activated["observation"]["audio"] == []
        first, second = [await advance_raw(h, "e2", k, ref) for k in (3, 4)]
        assert (first.first_sample, first.sample_frames, first.discontinuity) == \
            (2400, 800, True)
        assert (second.first_sample, second.sample_frames, second.discontinuity) == \
            (3200, 800, False)
        assert [first.samples, second.samples] == [a.samples for a in straight]
    # a timeline restored at the preserved position accepts both
    timeline = AudioTimeline.restored("arena", 2400)
    timeline.accept(first)
    timeline.accept(second)
    assert timeline.position == 4000
    timelines = AudioTimelines.restored(descriptor, [{"streamId": "arena", "position": "2400"}])
    timelines.advance([first])
    timelines.advance([second])
    assert timelines.positions() == {"arena": 4000}
    # a fresh timeline at 0 rejects the resumed chunk: the position tells the epochs apart
    checks: list[Callable[[], None]] = [
        lambda: AudioTimeline.fresh("arena").check(first),
        lambda: AudioTimelines.fresh(descriptor).check([first])]
    for check in checks:
        with pytest.raises(DomainError) as caught:
            check()
        assert (caught.value.code, caught.value.mutation) == ("BUFFER_INVALID", "unknown")
        assert caught.value.message == "audio stream arena starts at 2400; the stream is at 0"
    # an exactly continuing chunk must not set the flag
    continuing = AudioTimeline.restored("arena", 2400)
    continuing.accept(first)
    with pytest.raises(DomainError) as flagged:
        continuing.check(replace(second, discontinuity=True))
    assert flagged.value.code == ErrorCode.BUFFER_INVALID
    assert "marks a discontinuity at 3200, where it continues" in flagged.value.message


def _silence(first_sample: int, discontinuity: bool) -> AudioRef:
    """An 800-frame stereo chunk of `arena` (the bytes do not matter to a timeline)."""
    return AudioRef("arena", first_sample, 800, encode_media(AUDIO_CONTENT_TYPE, bytes(6400)),
                    discontinuity)


def test_restored_timelines_need_every_declared_streams_position() -> None:
    descriptor = CounterArena(world_id="arena", ports=("p1", "p2"), step=HZ60,
                              observation_delay_steps=0, threads=1, config={}).descriptor()
    for positions in ([], [{"streamId": "other", "position": "2400"}]):
        with pytest.raises(DomainError) as caught:
            AudioTimelines.restored(descriptor, positions)
        assert (caught.value.code, caught.value.mutation) == ("INCOMPATIBLE_STATE", "none")
    with pytest.raises(DomainError) as missing:
        AudioTimelines.restored(descriptor, [])
    assert "audio stream arena has no restored position" in missing.value.message
    # a restored epoch's first chunk needs the flag, at the preserved position only
    timelines = AudioTimelines.restored(descriptor, [{"streamId": "arena", "position": "2400"}])
    with pytest.raises(DomainError) as unflagged:
        timelines.check([_silence(2400, False)])
    assert unflagged.value.code == ErrorCode.BUFFER_INVALID
    assert unflagged.value.message == ("audio stream arena resumes at 2400 after a restore "
                                       "without marking the discontinuity")
    with pytest.raises(DomainError) as jumped:
        timelines.check([_silence(3200, True)])
    assert jumped.value.code == ErrorCode.BUFFER_INVALID
    with pytest.raises(DomainError) as none:
        timelines.check([])
    assert none.value.message == "audio stream arena produced no chunk for this transition"
    timelines.advance([_silence(2400, True)])
    assert timelines.positions() == {"arena": 3200}
    # a fresh epoch may open with or without the flag at 0
    for flag in (False, True):
        fresh = AudioTimelines.fresh(descriptor)
        fresh.advance([_silence(0, flag)])
        assert fresh.positions() == {"arena": 800}


# ------------------------------------------------------------------------------ 103


@dataclass
class MediaRun:
    published: list[tuple[str, list[tuple[str, str]], list[tuple[str, str, str]]]]
    """Per snapshot: step, views (producedStep, digest), audio (firstSample, frames, digest)."""
    renders: list[tuple[int, bytes]] | None
    sensed: dict[str, list[Sensed]] | None


async def media_run(mode: ExecutionMode) -> MediaRun:
    async with MediaHarness.start(MediaFixture(mode=mode, delay=1)) as h:
        await h.bootstrap()
        feed = h.coordinator.snapshots.subscribe(depth=16, replay=True)
        await h.run(STEPS)
        descriptor = descriptor_of(h)
        [view_spec], [stream] = descriptor.views, descriptor.audio
        published = []
        for snap in snapshots_of(feed):
            b = int(snap["scope"]["step"])
            views = [ViewRef.from_json(v) for v in snap["media"]["views"]]
            assert [v.produced_step for v in views] == [max(0, b - 1)]
            for v in views:
                assert v.pixels.byte_length == 3072
                assert len(decode_view(v, view_spec)) == 3072
            chunks = [AudioRef.from_json(a) for a in snap["media"]["audio"]]
            assert len(chunks) == (0 if b == 0 else 1)
            for a in chunks:
                assert (a.sample_frames, a.samples.byte_length) == (800, 6400)
                decode_audio(a, stream)  # every sample finite
            published.append((snap["scope"]["step"],
                              [(str(v.produced_step), v.pixels.digest) for v in views],
                              [(str(a.first_sample), str(a.sample_frames), a.samples.digest)
                               for a in chunks]))
        assert published[-1][0] == "3" and published[-1][1][0][0] == "2"
        if mode is ExecutionMode.PROCESS:
            return MediaRun(published, None, None)
        return MediaRun(published, list(recorder_of(h).renders), dict(recorder_of(h).sensed))


_REFERENCE: list[MediaRun] = []


async def reference() -> MediaRun:
    """An in-process run, made once per test process."""
    if not _REFERENCE:
        _REFERENCE.append(await media_run(ExecutionMode.IN_PROCESS))
    return _REFERENCE[0]


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.label())
async def test_the_media_path_works_in_every_execution_mode(mode: ExecutionMode) -> None:
    run = await media_run(mode)
    ref = await reference()
    assert run.published == ref.published
    if mode is ExecutionMode.PROCESS:
        return
    assert run.sensed is not None and run.renders is not None
    assert [b for b, _ in run.renders] == [0, 1, 2, 3]
    assert run.renders == ref.renders
    assert run.sensed == ref.sensed
    for agent in AGENTS:
        assert [p for p, _ in run.sensed[agent]] == [0, 0, 1, 2]
    assert run.sensed["fly-a"] == run.sensed["fly-b"]


# ------------------------------------------------------------------------------ 104


async def test_a_persistent_asset_is_identified_by_id_and_digest() -> None:
    async with SessionHarness.start(Fixture()) as h:
        c = h.coordinator
        scope = Scope("demo", "e1", 0)
        params = agent_init_params("fly-a")
        profile = params["profile"]
        for edited in ({**profile, "digest": "0" * 64},
                       {**profile, "byteLength": str(int(profile["byteLength"]) + 1)}):
            assert edited["id"] == profile["id"]
            with pytest.raises(DomainError) as caught:
                await c.calls.probe("fly-a", "Agent.Initialize", scope,
                                  {**params, "profile": edited})
            assert (caught.value.code, caught.value.mutation) == ("IDENTITY_MISMATCH", "none")
        world = env_init_params()
        backend = world["backendConfig"]
        for edited in ({**backend, "digest": "0" * 64},
                       {**backend, "byteLength": str(int(backend["byteLength"]) + 1)}):
            assert edited["id"] == backend["id"] == "arena-config"
            with pytest.raises(DomainError) as caught:
                await c.calls.probe("arena", "Environment.Initialize", scope,
                                  {**world, "backendConfig": edited})
            assert (caught.value.code, caught.value.mutation) == ("IDENTITY_MISMATCH", "none")
        for worker in ("fly-a", "arena"):
            assert (await h.status_of(worker))["state"] == "uninitialized"
        # the right assets still initialize the session
        await h.bootstrap()
        assert c.committed_boundary() == 0
