"""Media by reference (docs/topics.md §14.2; conformance tests 177–186).

Views and audio chunks above `[session] media_inline_max_bytes` travel as sealed artifacts of
the router's store attached to the world's reply, and from the coordinator to the agents as
attachments of their `Agent.Commit`/`Agent.Initialize` requests. The tests watch the
coordinator's own SDK calls (the only party that sees both sides), the router's stats and the
store directory, and compare behaviour records with the same run kept inline. The imported
checkpoint's test (184) runs real `flyd serve` nodes and `flyctl`, and watches the run topic.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from bus.client import BusClient, connect
from bus.client_calls import CallResult
from bus.errors import BusError
from bus.limits import Limits
from bus.store import StoreSettings
from flyd.config import load_config
from flyd.launch.launcher import ExecutionMode
from flyd.session.fence import SessionFailure
from flyd.session.injections import Injections
from flyd.session.run_topic import RunEnd, end_run_topic
from flyd.session.runspec import AgentSpec, RunSpec, WorldSpec
from flyd.session.trace import EpochRebase, compare
from flyd.state.envelope import decode
from tests.cli.test_flyctl_runs import Site, flyctl, serve, submit, wait_state
from tests.cli.test_flyctl_runs import site as site
from tests.media.test_media import Recorder
from tests.session.harness import Fixture, SessionHarness, within
from tests.session.worker_rig import environment_launch
from tests.state.conftest import RunCtx
from tests.state.state_harness import StateHarness
from workers.artifacts import MediaSink
from workers.bodies import EndpointFactory
from workers.environment import EnvironmentEndpoint
from workers.launch import MAX_MEDIA_INLINE_MAX_BYTES, WorkerLaunch
from workers.roles import endpoint_for
from workers.shell import Endpoint
from workers.types.canonical import digest_of
from workers.types.datatypes import ArtifactBlob, MediaValue, WorldObservation

LARGE = {"width": 256, "height": 256}
VIEW_BYTES = 256 * 256 * 4


def large_spec(agents: int = 2) -> RunSpec:
    """The synthetic composition with 256×256 views and `agents` agents."""
    base = RunSpec()
    team = tuple(AgentSpec(agent_id=f"fly-{i}", port_id=f"p{i}", seed=i + 1)
                 for i in range(agents))
    return replace(base, agents=team, world=WorldSpec(config=LARGE))


def behaviour_digest(h: SessionHarness) -> str:
    """The digest of every behaviour record of the run (what `behaviourDigest` folds)."""
    return digest_of([t.behaviour for t in h.coordinator.trace.transitions])


@dataclass
class Wire:
    """The coordinator's calls as its SDK made them: method, payload, attachment ids sent, and
    the result (with the attachments it carried)."""

    calls: list[tuple[str, dict[str, Any], tuple[str, ...], CallResult]] = \
        field(default_factory=list)

    def watch(self, client: BusClient) -> None:
        original = client.call

        async def call(target: str, method: str, payload: dict[str, Any], **kw: Any,
                       ) -> CallResult:
            result = await original(target, method, payload, **kw)
            sent = tuple(a if isinstance(a, str) else a.artifact_id
                         for a in kw.get("attachments", ()))
            self.calls.append((method, payload, sent, result))
            return result

        client.call = call  # type: ignore[method-assign]

    def of(self, method: str) -> list[tuple[dict[str, Any], tuple[str, ...], CallResult]]:
        return [(p, s, r) for m, p, s, r in self.calls if m == method]


async def store_of(h: SessionHarness) -> dict[str, Any]:
    """The router's store gauges (empty when it has no store) and counters."""
    stats = await h.node.stats()
    return {**(stats["store"] or {}), "counters": stats["counters"]}


def store_entries(h: SessionHarness) -> list[str]:
    """The store directory's entries (none without a store)."""
    if h.node.store is None:
        return []
    return sorted(os.listdir(h.node.store["path"]))


async def run_large(fixture: Fixture, steps: int, wire: Wire | None = None,
                    ) -> tuple[str, dict[str, Any], dict[str, Any], list[str]]:
    """(behaviour digest, store before, store after the session closed, store entries after)
    of a run of `steps` steps."""
    async with SessionHarness.start(fixture) as h:
        before = await store_of(h)
        if wire is not None:
            assert h.coordinator_client is not None
            wire.watch(h.coordinator_client)
        await h.bootstrap()
        await h.run(steps)
        digest = behaviour_digest(h)
        await within(h.close())
        after = await store_of(h)
        return digest, before, after, store_entries(h)


def view_blobs(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [v["pixels"] for v in result["observation"]["sensoryViews"]]


@pytest.mark.timeout(240)
async def test_large_views_travel_as_artifacts() -> None:
    wire = Wire()
    fixture = Fixture(mode=ExecutionMode.PROCESS, composition=large_spec(4))
    digest, before, after, entries = await run_large(fixture, 20, wire)

    advances = wire.of("Environment.Advance")
    assert len(advances) == 20
    for _payload, _sent, result in advances:
        attached = {a.artifact_id: a for a in result.attachments}
        blobs = view_blobs(result.outcome["result"])
        assert blobs and all("artifactId" in b and "data" not in b for b in blobs)
        for blob in blobs:
            att = attached[blob["artifactId"]]
            assert (att.length, att.digest) == (int(blob["byteLength"]), blob["digest"])
            assert att.length == VIEW_BYTES
    commits = wire.of("Agent.Commit")
    assert len(commits) == 20 * 4
    for payload, sent, _result in commits:
        views = payload["params"]["nextInput"]["views"]
        assert sorted(sent) == sorted(v["pixels"]["artifactId"] for v in views)
    # the inline run of the same composition behaves identically
    inline = replace(fixture, media_inline_max_bytes=MAX_MEDIA_INLINE_MAX_BYTES)
    inline_digest, *_ = await run_large(inline, 20)
    assert digest == inline_digest
    # nothing of the run is left in the store
    assert after["counters"]["artifactsAllocated"] > before["counters"]["artifactsAllocated"]
    assert (after["bytes"], after["artifacts"]) == (before["bytes"], before["artifacts"])
    assert entries == []


@pytest.mark.timeout(120)
async def test_small_media_stays_inline() -> None:
    wire = Wire()
    fixture = Fixture()
    digest, before, after, entries = await run_large(fixture, 10, wire)
    assert after["counters"]["artifactsAllocated"] == before["counters"]["artifactsAllocated"]
    for _payload, _sent, result in wire.of("Environment.Advance"):
        assert result.attachments == ()
        assert all("data" in b and "artifactId" not in b
                   for b in view_blobs(result.outcome["result"]))
    assert all(sent == () for _m, _p, sent, _r in wire.calls)
    inline_digest, *_ = await run_large(
        replace(fixture, media_inline_max_bytes=MAX_MEDIA_INLINE_MAX_BYTES), 10)
    assert digest == inline_digest
    assert entries == []


Tamper = Callable[[ArtifactBlob], MediaValue]


class TamperingHarness(SessionHarness):
    """A harness whose world alters the by-reference blobs of one boundary after sealing."""

    tamper: Tamper
    at_boundary: int

    def endpoint_factory(self) -> EndpointFactory:
        return self.factory

    def factory(self, launch: WorkerLaunch) -> Endpoint:
        endpoint = endpoint_for(launch)
        if isinstance(endpoint, EnvironmentEndpoint):
            endpoint.media = TamperingSink(endpoint.media.threshold, self.tamper,
                                           self.at_boundary)
        return endpoint


class TamperingSink(MediaSink):
    def __init__(self, threshold: int, tamper: Tamper, at_boundary: int) -> None:
        super().__init__(threshold)
        self._tamper = tamper
        self._at = at_boundary

    async def seal(self, observation: WorldObservation) -> tuple[WorldObservation, Any]:
        sealed, attachments = await super().seal(observation)
        if sealed.boundary != self._at:
            return sealed, attachments
        views = tuple(replace(v, pixels=self._tamper(v.pixels))
                      if isinstance(v.pixels, ArtifactBlob) else v
                      for v in sealed.sensory_views)
        return replace(sealed, sensory_views=views), attachments


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["unattached", "digest", "length"])
async def test_a_reference_must_match_its_attachment(case: str) -> None:
    tampers: dict[str, Tamper] = {
        "unattached": lambda b: replace(b, artifact_id="art-9007199254740991"),
        "digest": lambda b: replace(b, digest=hashlib.sha256(b"other").hexdigest()),
        "length": lambda b: replace(b, byte_length=b.byte_length - 4),
    }
    fixture = Fixture(composition=large_spec(2))
    TamperingHarness.tamper = staticmethod(tampers[case])  # type: ignore[assignment]
    TamperingHarness.at_boundary = 2
    async with TamperingHarness.start(fixture) as h:
        before = await store_of(h)
        await h.bootstrap()
        await h.run(1)
        with pytest.raises(SessionFailure) as caught:
            await h.run(1)
        failure = caught.value
        assert (failure.code, failure.mutation) == ("BUFFER_INVALID", "unknown")
        assert "view arena" in failure.error.message
        await within(h.close())
        after = await store_of(h)
        assert (after["bytes"], after["artifacts"]) == (before["bytes"], before["artifacts"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", ["store-disabled", "held-bytes"])
async def test_media_fall_back_to_inline(case: str) -> None:
    spec = large_spec(2)
    if case == "store-disabled":
        fixture = Fixture(mode=ExecutionMode.THREAD, composition=spec,
                          router_store=StoreSettings(enabled=False))
    else:
        fixture = Fixture(mode=ExecutionMode.THREAD, composition=spec,
                          router_limits=Limits(maxArtifactBytes=VIEW_BYTES,
                                               maxHeldBytesPerClient=VIEW_BYTES))
    wire = Wire()
    digest, _before, after, entries = await run_large(fixture, 10, wire)
    for _payload, _sent, result in wire.of("Environment.Advance"):
        assert result.attachments == ()
        assert all("data" in b for b in view_blobs(result.outcome["result"]))
    assert after["counters"]["artifactsAllocated"] == 0
    assert entries == []
    reference = replace(fixture, router_store=None, router_limits=None)
    ref_digest, *_ = await run_large(reference, 10)
    assert digest == ref_digest


@pytest.mark.timeout(240)
async def test_checkpoints_carry_the_bytes(claimed_run: RunCtx) -> None:
    fixture = Fixture(composition=large_spec(2))
    async with SessionHarness.start(fixture) as ref:
        await ref.bootstrap()
        await ref.run(4)
        reference = list(ref.coordinator.trace.transitions)
    wire = Wire()
    async with StateHarness.start(claimed_run, fixture) as s:
        assert s.h.coordinator_client is not None and s.h.node.store is not None
        first_store = s.h.node.store["storeId"]
        wire.watch(s.h.coordinator_client)
        await s.bootstrap()
        await s.run_and_checkpoint(2, "ckpt-1")
        _payload, _sent, last = wire.of("Environment.Advance")[-1]
        blob = view_blobs(last.outcome["result"])[0]
        assert "artifactId" in blob
    # the world's payload holds the frame itself, hashing to the digest the blob declared
    record = await claimed_run.store.lookup(claimed_run.run_id, "ckpt-1")
    assert record is not None
    data, _ = await claimed_run.store.read_bytes(record)
    frames = [frame for name, body in decode(data).payloads if name.startswith("world")
              for frame in orjson.loads(body)["frames"]]
    assert frames
    for frame in frames:
        pixels = base64.b64decode(frame["data"])
        assert hashlib.sha256(pixels).hexdigest() == frame["digest"]
    assert blob["digest"] in {f["digest"] for f in frames if f["producedStep"] == "2"}
    # a restore under a new router (a new store) resumes with the same behaviour; the restored
    # frame is a new artifact of that store with the checkpoint's digest (§14.2 rule 7)
    restored = Wire()
    async with StateHarness.start(claimed_run, fixture) as s:
        assert s.h.node.store is not None and s.h.node.store["storeId"] != first_store
        assert s.h.coordinator_client is not None
        restored.watch(s.h.coordinator_client)
        before = await store_of(s.h)
        c = s.coordinator
        await within(c.bootstrap())
        report = await within(c.restore(None, "e2"))
        assert report.boundary == 2
        c.resume()
        await s.h.run(2)
        resumed = list(c.trace.transitions)
        await within(s.h.close())
        after = await store_of(s.h)
        assert (after["bytes"], after["artifacts"]) == (before["bytes"], before["artifacts"])
        assert store_entries(s.h) == []
    assert compare(resumed, reference[2:], EpochRebase("e2", "e1", c.task)) is None
    (_payload, _sent, activated), = [
        (p, s, r) for p, s, r in restored.of("State.ActivateRestore")
        if r.outcome["result"].get("observation") is not None]
    view = view_blobs(activated.outcome["result"])[0]
    assert view["digest"] == blob["digest"] and "artifactId" in view
    assert [a.artifact_id for a in activated.attachments] == [view["artifactId"]]


def checkpoint_frames(file: Path) -> dict[int, set[str]]:
    """The view digests of the world's frames in a FLYSESS1 file, by produced step; each
    frame's bytes hash to the digest it names."""
    frames: dict[int, set[str]] = {}
    for name, body in decode(file.read_bytes()).payloads:
        if name.startswith("world"):
            for frame in orjson.loads(body)["frames"]:
                data = base64.b64decode(frame["data"])
                assert hashlib.sha256(data).hexdigest() == frame["digest"]
                frames.setdefault(int(frame["producedStep"]), set()).add(frame["digest"])
    return frames


@dataclass
class Seen:
    """One run-topic boundary message as a spectator of the importing node saw it."""

    boundary: int
    views: list[dict[str, Any]]
    attached: list[tuple[str, int, str, str, bool]]  # id, length, digest, sha256, file in store


async def spectate_import(socket: str, importing: Callable[[], int],
                          ) -> tuple[int, dict[str, Any], dict[str, Any], list[Seen]]:
    """Runs `importing` (the import; it returns the new run) while a spectator on the node's
    router waits for the run's topic, subscribes as soon as it is declared (before the workers
    are launched, so before the restored boundary is published) and reads every message to
    the end. (run, the node's store before, its hello's store, the boundary messages)."""
    async with connect(socket, client_id=ctl_id()) as ctl:
        assert ctl.store is not None
        before = await ctl.stats()
        task = asyncio.create_task(asyncio.to_thread(importing))

        async def declared() -> str:
            while True:
                found = [t["topic"] for t in await ctl.topics("flyd.run.")]
                if found:
                    (topic,) = found
                    return topic
                assert not task.done() or task.exception() is None, "the import failed"
                await asyncio.sleep(0.01)

        name = await within(declared(), 60)
        try:
            sub = await ctl.subscribe(name, mode="latest", window=16)
        except BusError as exc:
            raise AssertionError(f"the spectator could not subscribe: {exc!r}") from None
        run = await within(task)
        assert name == f"flyd.run.{run}"
        seen: list[Seen] = []

        async def read() -> None:
            async for msg in sub:
                if msg.payload["kind"] == "end":
                    assert msg.payload["state"] == "succeeded", msg.payload
                    return
                if msg.payload["kind"] != "boundary":
                    continue
                assert "snapshot" in msg.payload, "the views did not travel by reference"
                attached = []
                for att in await msg.retain():
                    data = ctl.open_artifact(att)
                    in_store = (Path(ctl.store["path"]) / att.artifact_id).exists()
                    attached.append((att.artifact_id, att.length, att.digest,
                                     hashlib.sha256(data).hexdigest(), in_store))
                    del data
                    await ctl.drop([att.artifact_id])
                seen.append(Seen(msg.payload["boundary"],
                                 msg.payload["snapshot"]["media"]["views"], attached))

        await asyncio.wait_for(read(), 120)
        return run, before, dict(ctl.store), seen


async def store_settles(socket: str, before: dict[str, Any]) -> dict[str, Any]:
    """The router's stats once its store holds what it held before (the run's ending reaches
    the router after the run's row: its topic's retained value goes with the topic)."""
    async with connect(socket, client_id=ctl_id()) as probe:
        for _ in range(300):
            stats = await probe.stats()
            if (stats["store"]["bytes"], stats["store"]["artifacts"]) == \
                    (before["store"]["bytes"], before["store"]["artifacts"]):
                break
            await asyncio.sleep(0.1)
        return stats


async def hello_store(socket: str) -> str:
    async with connect(socket, client_id=ctl_id()) as probe:
        assert probe.store is not None
        return probe.store["storeId"]


@pytest.mark.timeout(300)
def test_an_imported_asset_is_a_new_collectable_artifact(site: Site) -> None:
    # a 256×256 run on node n1, its last checkpoint exported
    first = serve(site, "n1")
    source = submit(site, "--steps", "4", "--checkpoint-every", "2", "--mode", "process",
                    "--no-pace", "--world-config", orjson.dumps(LARGE).decode())
    assert wait_state(site, source, {"succeeded", "failed"})["state"] == "succeeded"
    file = site.path / "run.flysess"
    exported = flyctl(site, "checkpoints", "export", str(source), "-o", str(file), socket=False)
    assert exported.code == 0 and exported.json["boundary"] == 4, exported
    frames = checkpoint_frames(file)
    assert frames.get(4), frames
    first_store = asyncio.run(hello_store(site.socket))
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=60) == 0

    # imported on node n2: another router, another store
    socket = str(site.path / "n2.sock")
    serve(site, "n2", socket=socket)

    def importing() -> int:
        ran = flyctl(site, "checkpoints", "import", str(file), "--steps", "6", socket=False)
        assert ran.code == 0, ran
        run: int = ran.json["run"]
        return run

    run, before, store, seen = asyncio.run(spectate_import(socket, importing))
    assert store["storeId"] != first_store
    assert wait_state(site, run, {"succeeded", "failed"})["state"] == "succeeded"
    # the node bootstraps the composition (boundary 0), then restores boundary 4 and publishes
    # it: its views are new artifacts of n2's store with the checkpoint's digests, and each
    # boundary after it has its own
    assert [s.boundary for s in seen] == [0, 4, 5, 6]
    restored = seen[1]
    assert restored.views and len(restored.attached) == len(restored.views)
    ids = [a[0] for a in restored.attached]
    assert sorted(ids) == sorted(v["pixels"]["artifactId"] for v in restored.views)
    for view in restored.views:
        assert int(view["producedStep"]) == 4 and "data" not in view["pixels"]
        assert view["pixels"]["digest"] in frames[4]
    for _id, length, digest, sha, in_store in restored.attached:
        assert (length, sha, in_store) == (VIEW_BYTES, digest, True)
    assert not {a[2] for a in seen[0].attached} & {a[2] for a in restored.attached}, \
        "the restored views are the bootstrap's"
    later = {a[0] for s in seen[2:] for a in s.attached}
    assert later and not later & set(ids)
    # and collected: once the run has ended the store holds what it held before
    after = asyncio.run(store_settles(socket, before))
    assert after["counters"]["artifactsAllocated"] > before["counters"]["artifactsAllocated"]
    assert (after["store"]["bytes"], after["store"]["artifacts"]) == \
        (before["store"]["bytes"], before["store"]["artifacts"])
    assert os.listdir(store["path"]) == []


RUN = 7


def ctl_id() -> str:
    return f"ctl-{os.getpid()}-{os.urandom(4).hex()}"


class SensingHarness(SessionHarness):
    """A harness whose agents' models log every view they are given (`recorder.sensed`)."""

    recorder = Recorder()

    def endpoint_factory(self) -> EndpointFactory:
        return self.recorder.factory


def declared_digests(wire: Wire) -> dict[int, str]:
    """The digest the world declared for its view, by produced step."""
    out: dict[int, str] = {}
    for method in ("Environment.Initialize", "Environment.Advance"):
        for _payload, _sent, result in wire.of(method):
            for view in result.outcome["result"]["observation"]["sensoryViews"]:
                out[int(view["producedStep"])] = view["pixels"]["digest"]
    return out


@pytest.mark.timeout(180)
async def test_spectators_cannot_corrupt_sensory_state() -> None:
    SensingHarness.recorder = Recorder()
    fixture = Fixture(mode=ExecutionMode.THREAD, composition=large_spec(2), run_id=RUN)
    wire = Wire()
    seen: list[tuple[str, str]] = []
    refused_writes = 0
    async with SensingHarness.start(fixture) as h:
        assert h.topic is not None and h.coordinator_client is not None
        wire.watch(h.coordinator_client)
        async with connect(h.socket, client_id=ctl_id()) as ctl:
            assert ctl.store is not None
            sub = await ctl.subscribe(h.topic.name, mode="latest", window=1)

            async def spectate() -> None:
                nonlocal refused_writes
                async for msg in sub:
                    if msg.payload["kind"] == "end":
                        return
                    if "snapshot" not in msg.payload:
                        continue
                    for att in await msg.retain():
                        data = ctl.open_artifact(att)
                        with pytest.raises(TypeError):
                            data[0] = 0
                        path = Path(ctl.store["path"]) / att.artifact_id
                        assert path.stat().st_mode & 0o777 == 0o444
                        refused_writes += 1
                        seen.append((att.digest, hashlib.sha256(data).hexdigest()))
                        await ctl.drop([att.artifact_id])

            async with asyncio.TaskGroup() as tg:
                spectator = tg.create_task(within(spectate()))
                await h.bootstrap()
                await h.run(20)
                await end_run_topic(h.topic, RunEnd(RUN, "succeeded", 20), 5.0, h.publisher)
                await spectator
    assert refused_writes > 0 and all(want == got for want, got in seen)
    declared = declared_digests(wire)
    sensed = SensingHarness.recorder.sensed
    assert set(sensed) == {"fly-0", "fly-1"}
    for views in sensed.values():
        assert len(views) == 21
        for produced, pixels in views:
            assert hashlib.sha256(pixels).hexdigest() == declared[produced]


@pytest.mark.timeout(180)
async def test_required_input_is_never_coalesced_while_spectator_snapshots_are() -> None:
    steps = 30
    fixture = Fixture(mode=ExecutionMode.THREAD, composition=large_spec(2), run_id=RUN)
    wire = Wire()
    async with SessionHarness.start(fixture) as h:
        assert h.topic is not None and h.coordinator_client is not None
        wire.watch(h.coordinator_client)
        async with connect(h.socket, client_id=ctl_id()) as ctl:
            sub = await ctl.subscribe(h.topic.name, mode="latest", window=1)
            reader = aiter(sub)
            await h.bootstrap()
            first = await within(anext(reader))
            await h.run(steps)
            # stopped after its first message; resumed, it reads exactly one more
            second = await within(anext(reader))
            assert second.skipped > 0
            assert second.sequence == first.sequence + second.skipped + 1
            assert second.payload["kind"] == "boundary"
            assert second.payload["boundary"] == steps and "snapshot" in second.payload
            await sub.unsubscribe()
    commits = wire.of("Agent.Commit")
    by_boundary: dict[int, list[tuple[dict[str, Any], tuple[str, ...]]]] = {}
    for payload, sent, _result in commits:
        by_boundary.setdefault(int(payload["params"]["nextInput"]["boundary"]), []).append(
            (payload, sent))
    assert sorted(by_boundary) == list(range(1, steps + 1))
    for boundary, calls in by_boundary.items():
        assert sorted(p["params"]["agentId"] for p, _ in calls) == ["fly-0", "fly-1"]
        for payload, sent in calls:
            views = payload["params"]["nextInput"]["views"]
            assert [int(v["producedStep"]) for v in views] == [boundary]
            assert list(sent) == [v["pixels"]["artifactId"] for v in views]


def connection_of(stats: dict[str, Any], client_id: str) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in stats["connectionsDetail"]
                                 if c["clientId"] == client_id)
    return found


async def session_at_rest(h: SessionHarness) -> tuple[int, int, int]:
    """(active calls, holds, held bytes) of the coordinator's connection between steps."""
    coordinator = connection_of(await h.node.stats(detail=True), h.names.coordinator_client_id)
    return coordinator["activeCalls"], coordinator["holds"], coordinator["heldBytes"]


@pytest.mark.timeout(180)
async def test_a_slow_spectator_spends_only_its_own_credits() -> None:
    """Evidence, not wall-clock speed (§16 decision 35): a stopped spectator holds one
    delivery and no other credit, its slot is replaced at every boundary, and the session's
    calls and holds are those of the unwatched run."""
    steps = 30
    fixture = Fixture(mode=ExecutionMode.THREAD, composition=large_spec(2), run_id=RUN)
    async with SessionHarness.start(replace(fixture, run_id=None)) as h:
        await h.bootstrap()
        await h.run(steps)
        unwatched = await session_at_rest(h)
    async with SessionHarness.start(fixture) as h:
        assert h.topic is not None
        spectator_id = ctl_id()
        async with connect(h.socket, client_id=spectator_id) as ctl:
            sub = await ctl.subscribe(h.topic.name, mode="latest", window=1)
            reader = aiter(sub)
            await h.bootstrap()
            await within(anext(reader))  # then it stops reading
            replaced = (await h.node.stats())["counters"]["messagesReplaced"]
            await h.run(steps)
            stats = await h.node.stats(detail=True)
            spectator = connection_of(stats, spectator_id)
            assert (spectator["subscriptions"], spectator["messageDeliveries"]) == (1, 1)
            assert (spectator["activeCalls"], spectator["openRequests"]) == (0, 0)
            assert (spectator["holds"], spectator["heldBytes"]) == (0, 0)
            assert stats["counters"]["messagesReplaced"] - replaced >= steps - 1
            assert await session_at_rest(h) == unwatched
            print("watched run:", h.coordinator.stats.to_json())
            await sub.unsubscribe()


def advance_of(wire: Wire, boundary: int) -> CallResult:
    """The Environment.Advance result that produced `boundary`."""
    return next(r for _p, _s, r in wire.of("Environment.Advance")
                if int(r.outcome["result"]["observation"]["boundary"]) == boundary)


async def collected(h: SessionHarness, artifact_ids: set[str]) -> set[str]:
    """Those of `artifact_ids` still files of the store, once none is or after 300 looks
    (the drops that end their roots are pipelined)."""
    for _ in range(300):
        left = artifact_ids & set(store_entries(h))
        if not left:
            break
        await asyncio.sleep(0.05)
    return left


@pytest.mark.timeout(180)
async def test_delayed_rendering_keeps_its_handle_after_the_message_drops() -> None:
    """With `observationDelaySteps` 2 the frame rendered at step s is sealed then, held by the
    world alone through boundaries s and s + 1 (whose publications a stopped spectator never
    reads), served as that same artifact at s + 2, and collected after s + 3."""
    delay, s = 2, 3
    spec = large_spec(2)
    spec = replace(spec, world=replace(spec.world, observation_delay_steps=delay))
    fixture = Fixture(mode=ExecutionMode.PROCESS, composition=spec, run_id=RUN)
    wire = Wire()
    live: dict[int, set[str]] = {}
    async with SessionHarness.start(fixture) as h:
        assert h.topic is not None and h.coordinator_client is not None
        wire.watch(h.coordinator_client)
        async with connect(h.socket, client_id=ctl_id()) as ctl:
            sub = await ctl.subscribe(h.topic.name, mode="latest", window=1)
            reader = aiter(sub)
            await h.bootstrap()
            await within(anext(reader))  # then it stops reading
            replaced = (await h.node.stats())["counters"]["messagesReplaced"]
            for boundary in range(1, s + 3):
                await h.step()
                live[boundary] = set(store_entries(h))
            # boundaries s and s + 1 were published into its slot and replaced unread
            counters = (await h.node.stats())["counters"]
            assert counters["messagesReplaced"] - replaced >= s + 1
            # the views boundary s + 2 serves: rendered at s, one artifact per view
            served = advance_of(wire, s + 2)
            views = served.outcome["result"]["observation"]["sensoryViews"]
            assert views and all(int(v["producedStep"]) == s for v in views)
            held = {v["pixels"]["artifactId"]: v["pixels"]["digest"] for v in views}
            assert {a.artifact_id: a.digest for a in served.attachments} == held
            # live since its render, while only the world held it: boundaries s and s + 1
            # neither attached nor published it
            for boundary in (s, s + 1):
                assert held.keys() <= live[boundary]
                assert not held.keys() & {a.artifact_id
                                          for a in advance_of(wire, boundary).attachments}
            commits = [(p, sent) for p, sent, _r in wire.of("Agent.Commit")
                       if int(p["params"]["nextInput"]["boundary"]) in (s, s + 1)]
            assert commits and not any(held.keys() & set(sent) for _p, sent in commits)
            # the agents got it at s + 2 with the same id and digest
            given = [(p, sent) for p, sent, _r in wire.of("Agent.Commit")
                     if int(p["params"]["nextInput"]["boundary"]) == s + 2]
            assert sorted(p["params"]["agentId"] for p, _ in given) == ["fly-0", "fly-1"]
            for payload, sent in given:
                for view in payload["params"]["nextInput"]["views"]:
                    assert int(view["producedStep"]) == s
                    assert held[view["pixels"]["artifactId"]] == view["pixels"]["digest"]
                    assert list(sent) == [view["pixels"]["artifactId"]]
            # collected once s + 3 is committed and published
            await h.step()
            assert await collected(h, set(held)) == set()
            resumed = await within(anext(reader))
            assert resumed.payload["kind"] == "boundary"
            assert resumed.payload["boundary"] == s + 3 and resumed.skipped > 0
            assert not held.keys() & {a.artifact_id for a in resumed.attachments}
            await sub.unsubscribe()


@pytest.mark.timeout(120)
async def test_a_replayed_reply_carries_its_artifacts_again() -> None:
    """A lost Advance result is resolved by sending the request again: the world's result
    cache answers with the same outcome, and the artifacts it names, which the world still
    holds, are attached again (docs/topics.md §14.2, rule 3's holds)."""
    spec = large_spec(2)
    lost = Fixture(composition=spec, injections=Injections(lose_advance_result_at=(2,)))
    digest, before, after, entries = await run_large(lost, 5)
    plain, *_ = await run_large(Fixture(composition=spec), 5)
    assert digest == plain
    assert (after["bytes"], after["artifacts"]) == (before["bytes"], before["artifacts"])
    assert entries == []


def test_the_threshold_is_node_configuration() -> None:
    """`[session] media_inline_max_bytes` is read once into the launcher settings and reaches
    every worker's command line; it is not part of the run spec (§16 decision 20)."""
    assert load_config(None, {}, {}).settings.session.launcher.media_inline_max_bytes == 16384
    config = load_config(None, {"session.media_inline_max_bytes": 0}, {})
    assert config.settings.session.launcher.media_inline_max_bytes == 0
    for bad in (-1, MAX_MEDIA_INLINE_MAX_BYTES + 1):
        with pytest.raises(ValueError, match=r"\[session\] media_inline_max_bytes"):
            load_config(None, {"session.media_inline_max_bytes": bad}, {})
    launch = replace(environment_launch("/tmp/x.sock"), media_inline_max_bytes=0)
    argv = launch.to_argv()
    assert argv[argv.index("--media-inline-max-bytes") + 1] == "0"
    assert WorkerLaunch.from_argv(argv) == launch
    default = environment_launch("/tmp/x.sock")
    assert "--media-inline-max-bytes" not in default.to_argv()
    assert "mediaInlineMaxBytes" not in orjson.dumps(RunSpec().to_json()).decode()
