"""Tests 44–48: `State.Capture` on the worker and the coordinator's capture (state.md §5.7, §6.2,
§6.3), in-process."""

from __future__ import annotations

import base64
import functools
from typing import Any

import pytest

import tests.session.harness as harness_module
from bus.limits import Limits
from bus.router import RouterConfig
from flyd.session.fence import SessionFailure
from flyd.session.phase import Failed, Ready
from flyd.state.compat import Compatibility
from flyd.state.envelope import decode, encode
from tests.session.harness import Fixture, SessionHarness
from tests.session.worker_rig import prepare_params
from tests.state.capture_rig import DelayFixture, capture_raw, refused, scope
from workers.faults import Faults
from workers.state import StateService
from workers.synthetic.arena import CounterArena
from workers.types.canonical import canonical, digest_bytes, parse_strict
from workers.types.domain import ErrorCode, Mutation, Scope

pytestmark = pytest.mark.timeout(60)


def status_view(status: dict[str, Any]) -> dict[str, Any]:
    """What a read-only call must leave alone (the shell's request bookkeeping aside)."""
    return {k: v for k, v in status.items()
            if k not in ("activeRequestId", "lastCompletedRequestId")}


# 44 -------------------------------------------------------------------------------------------


async def test_capture_checks_run_in_order() -> None:
    fixture = Fixture(faults={"fly-b": Faults(fail_capture=True)})
    async with SessionHarness.start(fixture) as h:
        await h.bootstrap()
        await h.run(2)
        c = h.coordinator
        ok = {"checkpointId": "ckpt-1"}
        bad = {"checkpointId": "ckpt-1", "extra": True}
        # 1: scope null, then another session (before the epoch and params checks)
        await refused(c.calls.probe("fly-a", "State.Capture", None, ok), ErrorCode.INVALID_ARGUMENT)
        await refused(c.calls.probe("fly-a", "State.Capture", Scope("other", "e9", 2), bad),
                      ErrorCode.IDENTITY_MISMATCH)
        # 2: an uninitialized worker, then another epoch (before the step and params checks)
        fresh = await h.restart_agent("fly-a")
        await refused(c.calls.probe("fly-a", "State.Capture", scope("e9", 7), bad,
                                  fresh.worker_ref()), ErrorCode.INVALID_PHASE,
                      contains="uninitialized")
        await refused(c.calls.probe("arena", "State.Capture", scope("e9", 7), bad),
                      ErrorCode.STALE_EPOCH)
        # 3: not quiescent (prepared), then step < k and step > k (before the params check)
        prepared = c.slots["fly-b"].context_digest
        await c.calls.probe("fly-b", "Agent.Prepare", scope("e1", 2),
                          prepare_params("fly-b", prepared))
        await refused(c.calls.probe("fly-b", "State.Capture", scope("e1", 9), bad),
                      ErrorCode.INVALID_PHASE, contains="prepared")
        await refused(c.calls.probe("arena", "State.Capture", scope("e1", 1), bad),
                      ErrorCode.STALE_STEP)
        await refused(c.calls.probe("arena", "State.Capture", scope("e1", 3), bad),
                      ErrorCode.FUTURE_STEP)
        # 4: params schema
        await refused(c.calls.probe("arena", "State.Capture", scope("e1", 2), bad),
                      ErrorCode.INVALID_ARGUMENT)
        await refused(c.calls.probe("arena", "State.Capture", scope("e1", 2),
                                  {"checkpointId": "Not An Id"}), ErrorCode.INVALID_ARGUMENT)
    async with SessionHarness.start(fixture) as h:
        await h.bootstrap()
        await h.run(1)
        # 5: the injected failure comes after the params check, with mutation none
        await refused(capture_raw(h, "fly-b", 1, "NOT-AN-ID"), ErrorCode.INVALID_ARGUMENT)
        await refused(capture_raw(h, "fly-b", 1), ErrorCode.BACKEND_FAILURE,
                      contains="injected capture failure")
        assert (await h.status_of("fly-b"))["state"] == "ready"
        # 6: a healthy worker captures
        result = await capture_raw(h, "fly-a", 1)
        assert (result["checkpointId"], result["boundary"]) == ("ckpt-1", "1")


# 45 -------------------------------------------------------------------------------------------


async def test_a_capture_reads_and_never_mutates() -> None:
    async with SessionHarness.start(Fixture()) as reference:
        await reference.bootstrap()
        await reference.run(4)
        clean = reference.coordinator.trace.behaviour()
        clean_mutations = {a: await reference.mutations_of(a) for a in ("fly-a", "fly-b")}
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        await h.run(2)
        workers = ("arena", "fly-a", "fly-b")
        before = {w: status_view(await h.status_of(w)) for w in workers}
        first = {w: await capture_raw(h, w, 2) for w in workers}
        second = {w: await capture_raw(h, w, 2) for w in workers}
        for w in workers:
            assert second[w] == first[w], w  # repeated captures are byte-identical
            assert status_view(await h.status_of(w)) == before[w], w
        assert before["arena"]["state"] == "ready"
        captured = await h.coordinator.capture("ckpt-2")
        assert h.coordinator.phase == Ready(2)
        assert dict(captured.payloads)["world"] == base64.b64decode(
            (await capture_raw(h, "arena", 2, "ckpt-2"))["payload"]["data"])
        for w in workers:
            assert status_view(await h.status_of(w)) == before[w], w
        await h.run(2)
        # capturing left no trace in behaviour: the run equals one that never captured
        assert h.coordinator.trace.behaviour() == clean
        assert {a: await h.mutations_of(a) for a in ("fly-a", "fly-b")} == clean_mutations


# 46 -------------------------------------------------------------------------------------------

COMMON = {"payloadVersion", "kind", "checkpointId", "committedStep"}
PARTICIPANT = COMMON | {"sourceScope"}


def blob_bytes(blob: dict[str, Any]) -> bytes:
    assert set(blob) == {"digest", "data"}
    data = base64.b64decode(blob["data"])
    assert digest_bytes(data) == blob["digest"]
    return data


async def test_the_payloads_have_the_documented_members() -> None:
    async with SessionHarness.start(DelayFixture(delay=2)) as h:
        await h.bootstrap()
        await h.run(3)
        c = h.coordinator
        captured = await c.capture("ckpt-3")
        assert c.descriptor is not None and c.observation is not None
        payloads = dict(captured.payloads)
        assert [n for n, _ in captured.payloads] == [
            "world", "agent-fly-a", "agent-fly-b", "executor-fly-a", "executor-fly-b",
            "task-ledger", "prior-inspection", "coordinator-admission"]
        docs = {}
        for name, data in captured.payloads:
            doc = parse_strict(data)
            assert canonical(doc) == data, name
            assert doc["payloadVersion"] == 1 and doc["checkpointId"] == "ckpt-3", name
            assert doc["committedStep"] == "3", name
            docs[name] = doc
        source = scope("e1", 3).to_json()
        # world
        world = docs["world"]
        assert set(world) == PARTICIPANT | {
            "workerId", "episodeId", "worldTime", "bindings", "compatibilityDigest", "progress",
            "frames", "audio", "world"}
        assert (world["kind"], world["sourceScope"], world["workerId"]) == ("world", source,
                                                                            "arena")
        assert world["bindings"] == [["p1", "fly-a"], ["p2", "fly-b"]]
        assert world["compatibilityDigest"] == Compatibility.of(c.descriptor).digest()
        assert [(f["viewId"], f["producedStep"]) for f in world["frames"]] == [
            ("arena", "1"), ("arena", "2"), ("arena", "3")]
        for frame in world["frames"]:
            assert set(frame) == {"viewId", "producedStep", "digest", "data"}
            assert digest_bytes(base64.b64decode(frame["data"])) == frame["digest"]
        assert [set(a) for a in world["audio"]] == [{"streamId", "position", "acc"}]
        assert world["audio"][0]["position"] == str(3 * 800)
        arena_state = parse_strict(blob_bytes(world["world"]))
        assert set(arena_state) == {"format", "counter", "audioPhase"}
        assert arena_state["format"] == "counter-arena-v1"
        # agents
        for agent_id in ("fly-a", "fly-b"):
            agent = docs[f"agent-{agent_id}"]
            assert set(agent) == PARTICIPANT | {
                "agentId", "identity", "profile", "accumulator", "context", "contextDigest",
                "model"}
            assert (agent["kind"], agent["agentId"], agent["sourceScope"]) == (
                "agent", agent_id, source)
            assert set(agent["identity"]) == {"agentId", "profileDigest", "datasetDigest",
                                              "indexDigest", "modelVersion",
                                              "plasticityVersion", "seed"}
            assert agent["identity"]["modelVersion"] == "fake-brain-v1"
            assert agent["identity"]["plasticityVersion"] == "fake-reinforce-v1"
            assert set(agent["accumulator"]) == {"tick", "remainder", "executed",
                                                 "warmupOffset"}
            brain = parse_strict(blob_bytes(agent["model"]))
            assert set(brain) == {"format", "state", "ticks", "mutations", "learning",
                                  "reinforcements", "updates", "changed", "signal"}
            assert brain["format"] == "fake-brain-v1"
            executor = docs[f"executor-{agent_id}"]
            assert set(executor) == COMMON | {"agentId", "executor", "slot"}
            assert executor["kind"] == "executor"
            assert set(executor["slot"]) == {"profileDigest", "decisionContextDigest",
                                             "telemetry", "brainTicks", "remainder",
                                             "tickDuration", "warmupTicks", "graph"}
            assert executor["slot"]["brainTicks"] == agent["accumulator"]["executed"]
        # coordinator ledgers
        ledger = docs["task-ledger"]
        assert set(ledger) == COMMON | {"schema", "progress", "contexts", "episodeRequest",
                                        "task"}
        assert [x["agentId"] for x in ledger["contexts"]] == ["fly-a", "fly-b"]
        assert ledger["episodeRequest"] is None
        assert parse_strict(blob_bytes(ledger["task"]))["format"] == "counter-task-v1"
        prior = docs["prior-inspection"]
        assert set(prior) == COMMON | {"worldTime", "inspection", "views", "audioPositions"}
        assert prior["views"] == [{"viewId": "arena", "producedStep": "1",
                                   "digest": c.observation.sensory_views[0].pixels.digest}]
        assert prior["audioPositions"] == [{"streamId": "arena", "position": "2400"}]
        admission = docs["coordinator-admission"]
        assert set(admission) == COMMON | {"admissions", "eventWatermarks",
                                           "descriptorRevision"}
        assert admission["admissions"] == []
        assert admission["eventWatermarks"]["lastSourceStep"] == "3"
        # the manifest lists them, and the whole capture encodes as one envelope
        manifest = captured.manifest
        assert manifest["payloads"] == [
            {"name": n, "byteLength": str(len(d)), "digest": digest_bytes(d)}
            for n, d in captured.payloads]
        assert [a["brainTicks"] for a in manifest["agents"]] == [
            docs["agent-fly-a"]["accumulator"]["executed"],
            docs["agent-fly-b"]["accumulator"]["executed"]]
        envelope = decode(encode(manifest, captured.payloads))
        assert dict(envelope.payloads) == payloads


# 47 -------------------------------------------------------------------------------------------


def tamper(role: str, change: Any) -> Any:
    """`StateService.capture` wrapped so that replies of `role` are changed by `change`."""
    original = StateService.capture

    async def capture(self: StateService[Any], call: Any) -> dict[str, Any]:
        result = await original(self, call)
        if self.endpoint.role == role:
            result = change(result)
        return result

    return capture


@pytest.mark.parametrize("case", ["agent-without-identity", "environment-with-identity",
                                  "wrong-boundary"])
async def test_capture_results_are_validated_for_their_role(
        case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    changes = {
        "agent-without-identity": ("agent", lambda r: {**r, "agentIdentity": None}),
        "environment-with-identity": ("environment", lambda r: {
            **r, "agentIdentity": {"agentId": "fly-a", "profileDigest": "0" * 64,
                                   "datasetDigest": "0" * 64, "indexDigest": "0" * 64,
                                   "modelVersion": "fake-brain-v1",
                                   "plasticityVersion": "fake-reinforce-v1", "seed": 7}}),
        "wrong-boundary": ("agent", lambda r: {**r, "boundary": str(int(r["boundary"]) + 1)}),
    }
    role, change = changes[case]
    monkeypatch.setattr(StateService, "capture", tamper(role, change))
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        await h.run(2)
        with pytest.raises(SessionFailure) as info:
            await h.coordinator.capture("ckpt-1")
        failure = info.value
        assert failure.detail == "capture"
        assert failure.phase == "Capturing(2)"
        assert failure.participant in ("arena", "fly-a", "fly-b")
        assert h.coordinator.fenced and h.coordinator.phase == Failed()
        assert "fail:capture" in " ".join(h.coordinator.audit.entries())
        assert not any(e.startswith("captured:") for e in h.coordinator.audit.entries())


# 48 -------------------------------------------------------------------------------------------

BALLAST = 70_000


def bulky_capture(self: CounterArena) -> bytes:
    return canonical({"format": "counter-arena-v1", "counter": self.counter,
                      "audioPhase": self.source.phase, "ballast": "x" * BALLAST})


async def test_a_payload_too_large_for_one_frame_is_unsupported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(harness_module, "RouterConfig", functools.partial(
        RouterConfig, limits=Limits(maxEnvelopeBytes=65536)))
    monkeypatch.setattr(CounterArena, "capture", bulky_capture)
    async with SessionHarness.start(Fixture()) as h:
        assert h.node.limits["maxEnvelopeBytes"] == 65536
        await h.bootstrap()
        await h.run(2)
        c = h.coordinator
        before = await h.progress_of("arena")
        error = await refused(capture_raw(h, "arena", 2), ErrorCode.UNSUPPORTED,
                              contains="does not fit one bus frame (limit 65536)")
        assert "checkpoint payload of" in error.message
        # the agents' small captures fit; the coordinator's capture is abandoned, not fenced
        assert (await capture_raw(h, "fly-a", 2))["boundary"] == "2"
        with pytest.raises(SessionFailure) as info:
            await c.capture("ckpt-2")
        assert (info.value.code, info.value.mutation) == (ErrorCode.UNSUPPORTED, Mutation.NONE)
        assert info.value.participant == "arena"
        assert not c.fenced and c.phase == Ready(2)
        assert "not-durable:failed:ckpt-2@2" in c.audit.entries()
        assert await h.progress_of("arena") == before
        await h.run(1)
        assert c.phase == Ready(3)
