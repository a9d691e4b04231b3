"""The synthetic composition (session.md §4.2–§4.8): every vector, byte for byte.

Tests 29–31 of session.md §8, plus the pure pieces' behaviour (task rules, executor, checkpoint
round trips) and a pure replay of the golden run (§4.8) from the synthetic classes alone; and
test 192 of docs/topics.md §17 (the arena's frame size is world configuration).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import replace
from typing import Any

import orjson
import pytest

from flyd.session.runspec import RunSpec, WorldSpec
from flyd.state.compat import Compatibility
from tests.cli.test_flyctl_runs import Site, flyctl
from tests.cli.test_flyctl_runs import site as site
from tests.cli.test_spec_option import flyd_run
from tests.session.harness import Fixture, SessionHarness
from workers.composition import composition_digest, config_asset, derive_seed
from workers.protocols import ActionExecutor, AgentModel, DecodedView, Task, World
from workers.synthetic import (
    CounterArena,
    CounterTask,
    FakeBrain,
    IdentityExecutor,
)
from workers.synthetic import schemas as S
from workers.synthetic.arena import (
    BACKEND_DIGEST,
    CONTENT_DIGEST,
    configuration_digest,
    frame_size,
)
from workers.synthetic.audio import TriangleSource, frame_bytes
from workers.synthetic.brain import initial_state
from workers.synthetic.frame import FRAME_BYTES, ROW_STRIDE, render_frame
from workers.synthetic.readout import decide, rotate_right
from workers.synthetic.schemas import synthetic_schema
from workers.synthetic.task import Terminal, context, event_id
from workers.types.canonical import typed_digest
from workers.types.datatypes import (
    EnvironmentDescriptor,
    PortControl,
    Stimulus,
    TypedValue,
    check_controls,
)
from workers.types.domain import DomainError, Scope
from workers.types.ticks import AudioBudget, RationalNs, TickAccumulator

STEP_60HZ = RationalNs(50_000_000, 3)
TICK_1MS = RationalNs(1_000_000, 1)


def brain(seed: int, agent_id: str = "fly-a") -> FakeBrain:
    return FakeBrain(agent_id=agent_id, seed=seed, threads=1, executor=None, config={})


def arena(ports: tuple[str, ...] = ("p1", "p2"), delay: int = 0) -> CounterArena:
    world = CounterArena(world_id="arena", ports=ports, step=STEP_60HZ,
                         observation_delay_steps=delay, threads=1, config={})
    world.reset("ep1", [(p, f"fly-{chr(ord('a') + i)}") for i, p in enumerate(ports)])
    return world


def control(port: str, inc: bool, dec: bool, bias: float = 0.0) -> PortControl:
    return PortControl.from_json({"portId": port,
                                  "buttons": [{"id": "inc", "down": inc},
                                              {"id": "dec", "down": dec}],
                                  "axes": [{"id": "bias", "value": bias}]})


def buttons(decision: TypedValue) -> tuple[bool, bool, float]:
    value: dict[str, Any] = decision.value
    return (value["buttons"][0]["down"], value["buttons"][1]["down"],
            value["axes"][0]["value"])


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------
# 29


def test_synthetic_vectors() -> None:
    # §4.2 brain states
    assert initial_state(7) == 0x9E3779B97F4A7C12
    assert initial_state(11) == 0x9E3779B97F4A7C1E
    assert initial_state(-1) == 0x61C8864680B583EA
    b = brain(7)
    assert b.state == 0x9E3779B97F4A7C12 and b.mutations() == 0
    b.draw()
    assert b.state == 0x23F51199D9863E79
    assert brain(11).state == 0x9E3779B97F4A7C1E
    assert brain(-1).state == 0x61C8864680B583EA

    # mutations per operation
    b = brain(7)
    b.advance(5)
    assert (b.mutations(), b.ticks) == (5, 5)
    b.install_input(-3)
    assert b.mutations() == 6
    b.stimulate(Stimulus("ev-1", "arena.milestone", 4.0))
    assert b.mutations() == 7
    b.reinforce(1.0)  # learning off: counted, nothing learnt
    assert (b.mutations(), b.reinforcements, b.updates, b.changed) == (8, 1, 0, 0)
    b.set_learning(True)
    assert b.mutations() == 8
    b.reinforce(0.0)
    assert (b.mutations(), b.updates, b.changed) == (9, 1, 0)
    before = b.state
    b.reinforce(-1.0)
    assert (b.mutations(), b.updates, b.changed, b.signal) == (10, 2, 1, -1.0)
    assert b.state == before ^ struct.unpack("<Q", struct.pack("<d", -1.0))[0]
    ctx = context(0, boot=True)
    b.decide(ctx)
    b.telemetry(3)
    assert b.mutations() == 10  # reads never mutate

    # install_input xors the signed value mod 2^64; stimulate uses the kind's hex digest prefix
    b = brain(7)
    b.install_input(-1)
    assert b.state == 0x9E3779B97F4A7C12 ^ (2**64 - 1)
    b = brain(7)
    b.stimulate(Stimulus("ev-1", "arena.milestone", 4.0))
    prefix = int.from_bytes(sha(b"arena.milestone")[:8].encode("ascii"), "little")
    assert b.state == 0x9E3779B97F4A7C12 ^ prefix ^ struct.unpack("<Q", struct.pack("<d", 4.0))[0]

    # §4.4 schemas
    expected = {
        "arena.inspection.v1": "736ef73314e2bc18490efba0b481049715db003fa36707a688ae82dcbaad9fcb",
        "arena.decision.v1": "95cad684e5ab8699c5ce63610ce7fe94fa10ca5c89b907f67e10ff6c739d7651",
        "arena.context.v1": "b0666123912a99ed5351e924b25e32290816cb654f84bbc50e705030100b177b",
        "arena.progress.v1": "ff63807a63a7c939da958045f8a3a10a46273649612e19e8b9965006ce212280",
        "arena.event.v1": "a1441dc9579743e7dbf3f905dbb37b8d45aa12b98c5c997cbd6bea2f2248f2ce",
        "arena.episode.v1": "36ec70a5a4ebee5bfc2f51da0a95aa9d947521a534e58e28240601ada194ab18",
        "arena.controller.v1":
            "40e131065967be870b7833224c937ef003e635cc09a13a1367dedfbff276db62",
    }
    for name, digest in expected.items():
        ref = synthetic_schema(name, 1)
        assert (ref.id, ref.version, ref.digest) == (name, 1, digest)
    assert [s.digest for s in (S.INSPECTION, S.DECISION, S.CONTEXT, S.PROGRESS, S.EVENT,
                               S.EPISODE, S.CONTROLLER)] == list(expected.values())

    # §4.5 event ids and contexts
    assert event_id("e1", 0, "bootstrap", 0) == "ev-3acdcc6ad920b7cd"
    assert event_id("e1", 1, "counter-delta", 0) == "ev-174c85c5394d5381"
    assert event_id("e1", 1, "counter-delta", 1) == "ev-25786b172a07e212"
    assert typed_digest(context(0, boot=True)) == \
        "72d1f120a194519532f36c38708909532c62c3c9d3f8d5126c3c196b6a155679"
    assert typed_digest(context(1, boot=False)) == \
        "2039eee89893e555855f28368e078bd836789c361e72abdb46322bab334d3d8d"
    task = CounterTask(epoch="e1")
    boot = task.bootstrap(arena().inspection(0), [("p1", "fly-a"), ("p2", "fly-b")])
    assert [typed_digest(c) for c in boot.contexts.values()] == [
        "72d1f120a194519532f36c38708909532c62c3c9d3f8d5126c3c196b6a155679"] * 2
    assert [e.id for e in boot.events] == ["ev-3acdcc6ad920b7cd"]

    # §4.6 descriptor digests
    assert BACKEND_DIGEST == "2fb50676f712f3f1ea2b2b085027711beafb4ec6ede69bb27ebd052b22380849"
    assert CONTENT_DIGEST == "f2b01bea1ea5348acec4345444fcb4617029e06a4edc0625b664f90e4360e801"
    assert configuration_digest(STEP_60HZ, 2, 0) == \
        "19d4b0beffd13556d2f0da539a373c52f22a55708ef6da188a7d1eb8d8040027"
    descriptor = arena().descriptor()
    assert descriptor.backend_digest == BACKEND_DIGEST
    assert descriptor.content_digest == CONTENT_DIGEST
    assert descriptor.configuration_digest == \
        "19d4b0beffd13556d2f0da539a373c52f22a55708ef6da188a7d1eb8d8040027"

    # §4.7 profile, graph, seeds
    fly_a = FakeBrain.profile("fly-a", TICK_1MS, 10, {})
    fly_b = FakeBrain.profile("fly-b", TICK_1MS, 10, {})
    assert fly_a.to_json() == {
        "id": "arena-direct-v1-fly-a", "byteLength": "53", "format": "fly-profile-v1",
        "digest": "e50a471c6327ca4d9295c7efaebba8b4e2f8d08bcefc0b10b2a513e7f8d0a08c"}
    assert (fly_b.id, fly_b.byte_length, fly_b.digest) == (
        "arena-direct-v1-fly-b", 53,
        "60f7d6ed1093a0b36f80b305be6e60bea8cb833751a6d5aff6363b8d4ca6ac62")
    graph_a = FakeBrain.graph("fly-a", {})
    graph_b = FakeBrain.graph("fly-b", {"graphVariant": 0})
    dataset = "3abe76e912cb936270c4d84c7407a663663d965e0b0c5df526d51302ddebd29c"
    assert graph_a.to_json() == {
        "datasetDigest": dataset,
        "indexDigest": "479093e456fee800e2a827d35fc37b94d0b9e053d261964c0e598d290b0dc423",
        "neuronCount": "1024", "rateRoles": ["kc", "mbon"],
        "supportedStimuli": ["arena.milestone"]}
    assert graph_b.dataset_digest == dataset
    assert graph_b.index_digest == \
        "82af4594d4794017581c93d39144aab7ac0dca41ca0a2476297c68fae1768f8f"
    assert FakeBrain.graph("fly-a", {"graphVariant": 1}).dataset_digest != dataset
    seeds = {
        (0, "fly-a"): -1350275275, (0, "fly-b"): 1020775678, (0, "fly-c"): -633508028,
        (0, "fly-d"): 897470079, (1, "fly-b"): 1766338179, (42, "fly-a"): 1329356413,
        (42, "fly-b"): 1459314961, (42, "fly-c"): 1569564501, (42, "fly-d"): 343394545,
        (2**63, "fly-a"): -492516313, (2**64 - 1, "fly-a"): -1126863783,
    }
    for (master, agent), seed in seeds.items():
        assert derive_seed(master, agent) == seed, (master, agent)

    # §4.3 readout: an unavailable button is forced up; bias takes five exact values
    state = 1 << 29  # rotate_right(state, 29) == 1: inc
    assert rotate_right(state, 29) == 1
    assert buttons(decide(state, context(0, boot=True)))[0] is True
    only_dec = TypedValue(S.CONTEXT, {"available": ["dec"], "boot": True, "step": 0})
    assert buttons(decide(state, only_dec))[0] is False
    state = 1 << 36  # rotate_right(state, 29) == 1 << 7: dec
    assert buttons(decide(state, context(0, boot=True)))[1] is True
    only_inc = TypedValue(S.CONTEXT, {"available": ["inc"], "boot": True, "step": 0})
    assert buttons(decide(state, only_inc))[1] is False
    b = brain(7)
    biases = set()
    for _ in range(500):
        b.draw()
        inc, dec, bias = buttons(b.decide(context(0, boot=True)))
        assert not (inc and dec)
        biases.add(bias)
    assert biases == {-0.5, -0.25, 0.0, 0.25, 0.5}


# --------------------------------------------------------------------------------------------
# 30


def test_the_native_frame_is_top_left_rgba8_with_no_padding() -> None:
    world = arena()
    descriptor = world.descriptor()
    view = descriptor.views[0]
    assert (view.view_id, view.width, view.height, view.row_stride, view.format) == \
        ("arena", 32, 24, 128, "rgba8")
    assert view.byte_length == FRAME_BYTES == 3072 == ROW_STRIDE * 24

    o0 = world.render("arena", 0)
    assert len(o0) == 3072
    assert sha(o0) == "4fb13d9f44c918a13f61ee818bd6b46fe2170a2c712d871d88eab2e883f40bcd"

    world.counter = 5
    frame = world.render("arena", 7)
    assert len(frame) == 3072

    def pixel(data: bytes, x: int, y: int) -> tuple[int, ...]:
        offset = y * ROW_STRIDE + 4 * x
        return tuple(data[offset:offset + 4])

    for y in range(24):
        for x in range(32):
            r, g, b, a = pixel(frame, x, y)
            assert (r, a) == (5, 255)
            assert g == x * 255 // 31
            assert (b == 255) == (x == 7) or y == 23  # row 23's ramp is 255 everywhere
            if x != 7:
                assert b == y * 255 // 23
    # top-left origin: row 0 is the top (blue ramp 0), column 0 the left (green 0)
    assert pixel(frame, 0, 0) == (5, 0, 0, 255)
    assert pixel(frame, 31, 23) == (5, 255, 255, 255)
    assert [pixel(frame, x, 3)[2] for x in range(32)].count(255) == 1

    # the marker column wraps at the width; the frame changes with boundary and counter
    assert render_frame(5, 39) == render_frame(5, 7)
    assert render_frame(5, 8) != frame
    assert render_frame(6, 7) != frame
    assert render_frame(-1, 0)[0] == 0xFF  # two's complement low byte
    assert render_frame(256, 0) == o0

    # a decoded view feeds the encoder its first byte
    assert FakeBrain.encode([DecodedView("arena", 1, frame)], None) == 5
    assert FakeBrain.encode([DecodedView("arena", 1, frame)],
                            TypedValue(S.INSPECTION, {"counter": -7, "boundary": 1})) == -2
    assert world.engine_frame(7) == "7"


# --------------------------------------------------------------------------------------------
# 31


def test_the_arena_audio_is_an_exact_triangle() -> None:
    world = arena()
    budget = AudioBudget(48000, STEP_60HZ)
    counters = [1, 3, 3]  # the golden run's counter after each transition
    chunks = []
    positions = []
    for counter in counters:
        world.counter = counter
        span = budget.next_chunk()
        positions.append(span.first_sample)
        chunk = world.audio("arena", span.frames)
        assert len(chunk) == span.frames * 2 * 4 == 6400
        chunks.append(chunk)
    assert positions == [0, 800, 1600] and budget.position == 2400
    assert chunks[0][:16].hex() == "22227abe2222fabd444474be4444f4bd"
    first = struct.unpack("<4f", chunks[0][:16])
    assert first == pytest.approx((-0.24427083, -0.12213542, -0.23854166, -0.11927083), abs=1e-7)
    assert [sha(c) for c in chunks] == [
        "28b7a3fab25556429c78716089033bbaaf1baba3d88701ad44a461fc7ac5e536",
        "1d194c015a4ad833c2cfc26b771b1d6dfd0a3dd3f33c08a2a776c8fdc565aef8",
        "2fd1f6120441542d5697ace118f3eaa83d43055a3a31df558a989105fdf3667d",
    ]

    # a triangle: every sample lies in [-0.25, 0.25] / (c+1); channel 1 is half of channel 0
    samples = struct.unpack("<1600f", chunks[1])
    for left, right in zip(samples[0::2], samples[1::2], strict=True):
        assert -0.25 <= left <= 0.25
        assert right == pytest.approx(left / 2, abs=1e-7)

    # the phase persists across chunks: one chunk of 1600 equals two of 800 at one counter
    one, two = TriangleSource(), TriangleSource()
    assert one.chunk(3, 1600) == two.chunk(3, 800) + two.chunk(3, 800)
    # a reset restarts the phase
    world.reset("ep2", [("p1", "fly-a"), ("p2", "fly-b")])
    world.counter = 1
    assert world.audio("arena", 800) == chunks[0]


def test_audio_chunks_picked_by_slices_equal_the_frame_by_frame_reference() -> None:
    """`chunk` takes strided slices of the frame table, one per wrap of the phase: the bytes and
    the phase it leaves are those of computing every frame at phase start + increment·i."""
    source = TriangleSource()
    for i, (counter, frames) in enumerate([(3, 800), (0, 1), (7, 0), (5, 2000), (2, 799),
                                           (6, 801), (1, 60000)] * 3):
        start, increment = source.phase, 220 + (counter % 8) * 55
        phases = [(start + increment * (n + 1)) % 48000 for n in range(frames)]
        got = source.chunk(counter, frames, channels=1 + i % 3)
        assert got == b"".join(frame_bytes(p, 1 + i % 3) for p in phases)
        assert source.phase == (start + increment * frames) % 48000


# --------------------------------------------------------------------------------------------
# beyond §8: the golden run from the pure pieces, the task, the executor, checkpoints


def test_the_synthetic_pieces_reproduce_the_golden_run() -> None:
    """§4.8 without a session: bootstrap, then 3 transitions, as the coordinator drives them."""
    agents = {"fly-a": ("p1", 7), "fly-b": ("p2", 11)}
    bindings = [(port, agent) for agent, (port, _) in agents.items()]
    world = arena()
    task = CounterTask(epoch="e1")
    executor = IdentityExecutor()
    boot = task.bootstrap(world.inspection(0), bindings)
    frame = DecodedView("arena", 0, world.render("arena", 0))
    brains: dict[str, FakeBrain] = {}
    clocks: dict[str, TickAccumulator] = {}
    contexts = dict(boot.contexts)
    for agent, (_, seed) in agents.items():
        model = brain(seed, agent)
        model.install_input(FakeBrain.encode([frame], None))
        model.advance(10)
        clocks[agent] = TickAccumulator(TICK_1MS)
        clocks[agent].warm_up(10)
        model.decide(contexts[agent])
        model.set_learning(True)
        brains[agent] = model
        assert model.mutations() == 11
    tele = {a: m.telemetry(clocks[a].brain_ticks()) for a, m in brains.items()}
    assert tele["fly-a"].brain_ticks == 10
    assert (tele["fly-a"].population_rate_hz, tele["fly-a"].rates[0].hz,
            tele["fly-a"].rates[1].hz) == (36.3, 16.3, 7.3)
    assert (tele["fly-b"].population_rate_hz, tele["fly-b"].rates[0].hz,
            tele["fly-b"].rates[1].hz) == (6.5, 16.5, 26.5)

    golden = [
        ({"fly-a": (False, False, -0.25), "fly-b": (True, False, 0.0)}, 1, 16,
         RationalNs(2_000_000, 3)),
        ({"fly-a": (True, False, -0.5), "fly-b": (True, False, 0.25)}, 3, 17,
         RationalNs(1_000_000, 3)),
        ({"fly-a": (False, True, 0.5), "fly-b": (True, False, -0.25)}, 3, 17, RationalNs(0, 1)),
    ]
    budget = AudioBudget(48000, STEP_60HZ)
    positions = []
    for k, (decisions, counter, ticks, remainder) in enumerate(golden):
        scope = Scope("demo", "e1", k)
        decided = {}
        for agent, model in brains.items():
            advanced = clocks[agent].advance(STEP_60HZ)
            model.advance(advanced)
            assert (advanced, clocks[agent].remainder) == (ticks, remainder)
            decided[agent] = model.decide(contexts[agent])
            assert buttons(decided[agent]) == decisions[agent]
        old = world.inspection(k)
        controls = [executor.apply(scope, decided[agent], old, task.progress(), STEP_60HZ)
                    .for_port(port) for agent, (port, _) in agents.items()]
        check_controls(controls, world.descriptor().ports)
        world.apply(controls)
        new = world.inspection(k + 1)
        assert new.value == {"counter": counter, "boundary": k + 1}
        positions.append(budget.next_chunk().first_sample)
        evaluation = task.evaluate_transition(scope, old, new, controls)
        frame = DecodedView("arena", k + 1, world.render("arena", k + 1))
        for agent, model in brains.items():
            outcome = evaluation.outcomes[agent]
            model.install_input(FakeBrain.encode([frame], None))
            for stimulus in outcome.stimulations:
                model.stimulate(stimulus)
            model.reinforce(sum((r.value for r in outcome.rewards), 0.0))
            contexts[agent] = evaluation.next_contexts[agent]
    for agent, model in brains.items():
        assert model.mutations() == 67
        assert clocks[agent].brain_ticks() == 60
        assert model.telemetry(60).learning.updates == 3
    assert (brains["fly-a"].changed, brains["fly-a"].signal) == (2, -1.0)
    assert (brains["fly-b"].changed, brains["fly-b"].signal) == (3, 1.0)
    assert task.progress().value == {"counter": 3, "transitions": 3, "totalReward": 3.0}
    assert task.evaluations() == 3
    assert positions == [0, 800, 1600] and budget.position == 2400


def test_the_counter_task_rewards_presses_and_marks_milestones() -> None:
    task = CounterTask(epoch="e2", max_agents=4)
    world = arena()
    task.bootstrap(world.inspection(0), [("p1", "fly-a"), ("p2", "fly-b")])
    world.counter = 4
    old = world.inspection(3)
    controls = [control("p1", True, False), control("p2", True, False)]
    world.apply(controls)
    new = world.inspection(4)
    evaluation = task.evaluate_transition(Scope("demo", "e2", 3), old, new, controls)
    ids = [event_id("e2", 4, "counter-delta", 0), event_id("e2", 4, "counter-delta", 1)]
    assert [e.id for e in evaluation.events] == ids
    assert [e.to_json()["sourceStep"] for e in evaluation.events] == ["4", "4"]
    assert [e.agent_id for e in evaluation.events] == ["fly-a", "fly-b"]
    assert evaluation.events[1].payload.value == {"delta": 1, "counter": 6}
    assert [r.to_json() for r in evaluation.outcomes["fly-a"].rewards] == [
        {"eventId": ids[0], "ruleId": "counter-delta", "value": 1.0}]
    # counter 6 is no multiple of 5: no milestone
    assert evaluation.outcomes["fly-a"].stimulations == ()
    assert evaluation.episode is None
    assert sorted(evaluation.next_contexts) == ["fly-a", "fly-b"]
    assert evaluation.next_contexts["fly-a"].value == {"available": ["inc", "dec"],
                                                       "boot": False, "step": 4}

    # 6 → 5: fly-a presses dec (milestone with the already advanced ordinal), fly-b nothing
    old, controls = new, [control("p1", False, True), control("p2", False, False)]
    world.apply(controls)
    evaluation = task.evaluate_transition(Scope("demo", "e2", 4), old, world.inspection(5),
                                          controls)
    assert [s.to_json() for s in evaluation.outcomes["fly-a"].stimulations] == [
        {"id": event_id("e2", 5, "milestone", 1), "kindId": "arena.milestone",
         "durationMs": 4.0}]
    assert evaluation.outcomes["fly-b"].stimulations == ()  # delta 0 never marks a milestone
    assert [r.value for r in evaluation.outcomes["fly-b"].rewards] == [0.0]
    assert task.progress().value == {"counter": 5, "transitions": 2, "totalReward": 1.0}
    # a negative multiple of 5 counts (Euclidean)
    assert -5 % 5 == 0
    ids_at_5 = task.minted_ids("e2", 5)
    assert all(e.id in ids_at_5 for e in evaluation.events)
    assert event_id("e2", 5, "milestone", 1) in ids_at_5
    assert len(ids_at_5) == 3 * (2 * 4 + 1)


def test_the_counter_task_refuses_what_it_cannot_evaluate() -> None:
    task = CounterTask()
    world = arena()
    with pytest.raises(DomainError) as err:
        task.bootstrap(TypedValue(S.PROGRESS, {"counter": 0}), [("p1", "fly-a")])
    assert err.value.code == "IDENTITY_MISMATCH"
    task.bootstrap(world.inspection(0), [("p1", "fly-a")])
    old = world.inspection(0)
    # a port bound to no agent
    with pytest.raises(DomainError) as err:
        task.evaluate_transition(Scope("demo", "e1", 0), old, old,
                                 [control("p2", False, False)])
    assert (err.value.code, err.value.mutation) == ("IDENTITY_MISMATCH", "none")
    # the world moved differently from the controls
    moved = TypedValue(S.INSPECTION, {"counter": 2, "boundary": 1})
    with pytest.raises(DomainError) as err:
        task.evaluate_transition(Scope("demo", "e1", 0), old, moved,
                                 [control("p1", True, False)])
    assert (err.value.code, err.value.mutation) == ("BACKEND_FAILURE", "unknown")
    assert task.progress().value == {"counter": 0, "transitions": 0, "totalReward": 0.0}
    with pytest.raises(DomainError) as err:
        CounterTask(config={"x": 1})
    assert err.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize(("terminal", "ends_at"), [
    ("never", None), ("after:2", 2), ("counter:2", 2), ("counter:-1", 1), ("counter:9", None)])
def test_the_counter_task_ends_the_episode_at_its_terminal(terminal: str,
                                                            ends_at: int | None) -> None:
    task = CounterTask(terminal=terminal)
    world = arena(("p1",))
    task.bootstrap(world.inspection(0), [("p1", "fly-a")])
    ended = None
    for k in range(4):
        old = world.inspection(k)
        controls = [control("p1", True, False)]
        world.apply(controls)
        evaluation = task.evaluate_transition(Scope("demo", "e1", k), old,
                                              world.inspection(k + 1), controls)
        if evaluation.episode is not None and ended is None:
            ended = k + 1
            assert evaluation.episode.reason == "counter-target"
            assert evaluation.episode.outcome.schema == S.EPISODE
            assert evaluation.episode.outcome.value == {"counter": k + 1,
                                                        "transitions": k + 1}
    assert ended == ends_at


@pytest.mark.parametrize("text", ["", "always", "after:", "after:-1", "after:01", "counter:",
                                  "counter:-0", "counter:1.5", "after:x", 5, None])
def test_a_malformed_terminal_is_refused(text: Any) -> None:
    with pytest.raises(DomainError) as err:
        Terminal.parse(text)
    assert err.value.code == "INVALID_ARGUMENT"


def test_the_identity_executor_passes_an_arena_decision_on() -> None:
    executor = IdentityExecutor()
    decision = brain(7).decide(context(0, boot=True))
    progress = CounterTask().progress()
    scope = Scope("demo", "e1", 0)
    intent = executor.apply(scope, decision, arena().inspection(0), progress, STEP_60HZ)
    assert intent.to_json() == decision.value
    assert intent.for_port("p1").to_json() == {"portId": "p1", **decision.value}
    with pytest.raises(DomainError) as err:
        executor.apply(scope, TypedValue(S.CONTEXT, decision.value), progress, progress,
                       STEP_60HZ)
    assert err.value.code == "IDENTITY_MISMATCH"


def test_a_context_the_model_cannot_use_is_refused_before_anything_changes() -> None:
    with pytest.raises(DomainError) as err:
        FakeBrain.check_context(TypedValue(S.DECISION, {"available": []}))
    assert (err.value.code, err.value.mutation) == ("IDENTITY_MISMATCH", "none")
    with pytest.raises(DomainError) as err:
        FakeBrain.check_context(TypedValue(S.CONTEXT, {"available": "inc"}))
    assert (err.value.code, err.value.mutation) == ("INVALID_ARGUMENT", "none")
    FakeBrain.check_context(context(3, boot=False))
    with pytest.raises(DomainError) as err:
        FakeBrain.graph("fly-a", {"graphVarient": 1})
    assert err.value.code == "INVALID_ARGUMENT" and "graphVarient" in err.value.message
    with pytest.raises(DomainError) as err:
        brain(2**31)
    assert err.value.code == "INVALID_ARGUMENT"


def test_the_arena_descriptor_is_a_valid_environment_descriptor() -> None:
    world = arena(("p2", "p1"), delay=3)
    descriptor = world.descriptor()
    assert EnvironmentDescriptor.from_json(descriptor.to_json()) == descriptor
    wire = descriptor.to_json()
    assert [p["portId"] for p in wire["ports"]] == ["p2", "p1"]  # launch port order
    assert wire["ports"][0]["controls"] == {
        "schema": S.CONTROLLER.to_json(), "buttons": ["inc", "dec"],
        "axes": [{"id": "bias", "range": "bipolar", "neutral": 0.0}]}
    assert wire["views"] == [{"viewId": "arena", "width": 32, "height": 24, "format": "rgba8",
                              "rowStride": 128,
                              "pixelAspect": {"numerator": 1, "denominator": 1},
                              "observationDelaySteps": 3}]
    assert wire["audio"] == [{"streamId": "arena", "sampleRate": 48000, "channels": 2,
                              "format": "f32le-interleaved"}]
    assert (wire["recovery"], wire["determinism"]) == ("exact-checkpoint", "fixed-build")
    assert wire["stepDuration"] == {"numerator": "50000000", "denominator": "3"}
    assert wire["inspectionSchema"] == S.INSPECTION.to_json()
    assert world.config_asset().to_json() == {
        "id": "arena-config", "digest": hashlib.sha256(b"{}").hexdigest(), "byteLength": "2",
        "format": "fly-config-v1"}
    assert config_asset("arena-task", {}).id == "arena-task"
    with pytest.raises(DomainError):
        CounterArena(world_id="arena", ports=["p1", "p1"], step=STEP_60HZ,
                     observation_delay_steps=0, threads=1, config={})
    with pytest.raises(DomainError):
        CounterArena(world_id="arena", ports=["p1"], step=STEP_60HZ,
                     observation_delay_steps=9, threads=1, config={})


def test_checkpoints_round_trip_and_refuse_foreign_state() -> None:
    model = brain(7)
    model.advance(3)
    model.set_learning(True)
    model.reinforce(-1.0)
    copy = brain(11)
    copy.restore(model.capture())
    assert copy.capture() == model.capture()
    assert (copy.state, copy.mutations(), copy.signal, copy.learning) == \
        (model.state, model.mutations(), -1.0, True)

    world = arena()
    world.apply([control("p1", True, False), control("p2", True, False)])
    world.audio("arena", 123)
    other = arena()
    other.restore(world.capture())
    assert other.capture() == world.capture()
    assert other.audio("arena", 800) == world.audio("arena", 800)

    task = CounterTask()
    task.bootstrap(arena().inspection(0), [("p1", "fly-a")])
    again = CounterTask()
    again.restore(task.capture())
    assert again.capture() == task.capture()

    for target, payload in [(brain(7), world.capture()), (arena(), model.capture()),
                            (CounterTask(), b"{not json"), (brain(7), b'{"format":1}')]:
        before = target.capture()
        with pytest.raises(DomainError) as err:
            target.restore(payload)
        assert (err.value.code, err.value.mutation) == ("INCOMPATIBLE_STATE", "none")
        assert target.capture() == before


def test_the_composition_digest_covers_every_agent_in_sorted_order() -> None:
    contract = "0" * 64
    rows = [("fly-b", "p2", "b" * 64), ("fly-a", "p1", "a" * 64)]
    digest = composition_digest("demo", "e1", contract, rows)
    text = (f"fly-session/composition-v1\nsession=demo\nepoch=e1\ncontract={contract}\n"
            f"agent=fly-a port=p1 profile={'a' * 64}\nagent=fly-b port=p2 profile={'b' * 64}\n")
    assert digest == sha(text.encode())
    assert composition_digest("demo", "e1", contract, reversed(rows)) == digest
    assert composition_digest("demo", "e2", contract, rows) != digest


def test_the_synthetic_classes_implement_the_protocols() -> None:
    assert isinstance(brain(7), AgentModel)
    assert isinstance(arena(), World)
    assert isinstance(CounterTask(), Task)
    assert isinstance(IdentityExecutor(), ActionExecutor)


def test_audio_frames_computed_in_bulk_equal_frame_bytes_at_every_phase() -> None:
    """The chunk tables round a whole column of phases per operation (`array("f")`); every
    frame is the bytes `frame_bytes` computes one value at a time. Increment 275 (counter 1)
    visits the 9600 phases of one residue modulo 5 in 9600 frames; five starts cover all."""
    for channels in (1, 2):
        for start in range(5):
            got = TriangleSource(start).chunk(1, 48000 // 5, channels)
            assert got == b"".join(frame_bytes((start + 275 * (i + 1)) % 48000, channels)
                                   for i in range(48000 // 5))


# --------------------------------------------------------------------------------------------
# 192


def sized_arena(config: dict[str, Any]) -> CounterArena:
    return CounterArena(world_id="arena", ports=("p1", "p2"), step=STEP_60HZ,
                        observation_delay_steps=0, threads=1, config=config)


@pytest.mark.timeout(150)
async def test_world_config_sets_the_frame_size(site: Site) -> None:
    # the default is the spec's 32×24 with its vectors (the golden run: tests/session/
    # test_golden.py); an explicit default size is the same frame and configuration digest
    default = sized_arena({}).descriptor()
    assert (default.views[0].width, default.views[0].height, default.views[0].row_stride) == \
        (32, 24, 128)
    assert default.configuration_digest == \
        "19d4b0beffd13556d2f0da539a373c52f22a55708ef6da188a7d1eb8d8040027"
    assert sized_arena({"width": 32, "height": 24}).descriptor() == default

    big = sized_arena({"width": 256, "height": 256})
    big.reset("ep1", [("p1", "fly-a"), ("p2", "fly-b")])
    view = EnvironmentDescriptor.from_json(big.descriptor().to_json()).views[0]
    assert (view.width, view.height, view.row_stride, view.byte_length) == \
        (256, 256, 1024, 256 * 256 * 4)
    big.counter = 5
    assert big.render("arena", 7) == render_frame(5, 7, 256, 256)
    # a size is configuration: a checkpoint of one size is not installed into another
    assert big.descriptor().configuration_digest == \
        configuration_digest(STEP_60HZ, 2, 0, 256, 256) != default.configuration_digest
    assert frame_size({"height": 1}) == (32, 1)

    for bad, field in [({"width": 0}, "width"), ({"height": 4097}, "height"),
                       ({"width": "64"}, "width"), ({"height": True}, "height"),
                       ({"width": 2.0}, "width"), ({"depth": 3}, "depth")]:
        with pytest.raises(DomainError) as err:
            sized_arena(bad)
        assert err.value.code == "INVALID_ARGUMENT" and field in err.value.message, bad

    # a session of 256×256 views: the world serves them and the coordinator decodes them
    spec = replace(RunSpec(), world=WorldSpec(config={"width": 256, "height": 256}))
    async with SessionHarness.start(Fixture(composition=spec)) as h:
        await h.bootstrap()
        await h.run(2)
        committed = h.coordinator.committed_view()
        assert committed is not None
        descriptor, pixels = committed
        assert (descriptor.width, descriptor.height, descriptor.row_stride) == (256, 256, 1024)
        assert len(pixels) == 256 * 256 * 4

    # `flyd run --world-config` reaches the world: the run's checkpoint carries the
    # compatibility of a 64×48 arena, and a size out of range fails naming the key
    code, summary, err = flyd_run(site, "--world-config", '{"width":64,"height":48}',
                                  "--steps", "4", "--mode", "thread")
    assert code == 0 and summary["state"] == "succeeded", err
    listed = flyctl(site, "checkpoints", "list", str(summary["run"]), socket=False)
    assert listed.code == 0, listed
    want = Compatibility.of(sized_arena({"width": 64, "height": 48}).descriptor()).digest()
    assert {c["compatibilityDigest"] for c in listed.json["checkpoints"]} == {want}
    assert want != Compatibility.of(default).digest()
    code, summary, err = flyd_run(site, "--world-config", '{"width":0}', "--steps", "4",
                                  "--mode", "thread")
    assert code != 0 and summary["state"] == "failed"
    assert "world config width must lie in 1..4096; got 0" in orjson.dumps(summary).decode()
