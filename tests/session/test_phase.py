"""The pure phase machine (session.md §6.2; §8 tests 20-26), plus an exhaustive walk of every
(phase, event) pair against the spec's edge table and a property test over random event
sequences."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flyd.session.phase import (
    EDGES,
    TRANSITIONS,
    Applying,
    Capturing,
    Committing,
    Edge,
    Failed,
    Guard,
    Observing,
    Paused,
    Phase,
    PhaseMachine,
    PhaseName,
    Preparing,
    Ready,
    Resetting,
    Restoring,
    Starting,
    StepRule,
    Via,
    not_an_edge,
    phase_of,
    step_of,
)
from workers.types.domain import U64_MAX, DomainError, ErrorCode, Mutation


class Fail:
    """The `fail()` event (the only way into `Failed`)."""

    def __repr__(self) -> str:
        return "fail()"


FAIL = Fail()
Event: TypeAlias = Phase | Fail


def run(machine: PhaseMachine, *events: Event) -> PhaseMachine:
    for event in events:
        if isinstance(event, Fail):
            machine.fail()
        else:
            machine.move(event)
    return machine


def transition(k: int) -> list[Event]:
    """The five moves of one transition k -> k+1, from Ready(k)."""
    return [Preparing(k), Applying(k), Observing(k + 1), Committing(k), Ready(k + 1)]


def to_ready(k: int) -> list[Event]:
    """From Starting to Ready(k) by bootstrap and k transitions."""
    events: list[Event] = [Ready(0)]
    for step in range(k):
        events += transition(step)
    return events


def reach(name: PhaseName, k: int = 1) -> PhaseMachine:
    """A fresh machine walked along legal edges to the phase `name` at step k (Observing k+1)."""
    ops: dict[PhaseName, list[Event]] = {
        PhaseName.STARTING: [],
        PhaseName.READY: to_ready(k),
        PhaseName.PREPARING: [*to_ready(k), Preparing(k)],
        PhaseName.APPLYING: [*to_ready(k), Preparing(k), Applying(k)],
        PhaseName.OBSERVING: [*to_ready(k), Preparing(k), Applying(k), Observing(k + 1)],
        PhaseName.COMMITTING: [*to_ready(k), *transition(k)[:4]],
        PhaseName.PAUSED: [*to_ready(k), Paused(k)],
        PhaseName.CAPTURING: [*to_ready(k), Capturing(k)],
        PhaseName.FAILED: [*to_ready(k), FAIL],
        PhaseName.RESTORING: [*to_ready(k), FAIL, Restoring(k)],
        PhaseName.RESETTING: [*to_ready(k), Paused(k), Resetting(k)],
    }
    return run(PhaseMachine(), *ops[name])


def refused(machine: PhaseMachine, target: Phase) -> DomainError:
    """Attempt a refused move; check the error and that nothing changed."""
    before = snapshot(machine)
    with pytest.raises(DomainError) as caught:
        machine.move(target)
    assert snapshot(machine) == before
    error = caught.value
    assert (error.code, error.mutation) == (ErrorCode.INVALID_PHASE, Mutation.NONE)
    assert error.message == f"{before.phase.label} -> {target.label} is not an edge"
    return error


@dataclass(frozen=True)
class Snapshot:
    phase: Phase
    capture_origin: Phase | None
    stepped: bool
    fenced: bool
    log: tuple[tuple[Phase, Phase], ...]
    path: tuple[str, ...]
    committed_boundary: int | None
    is_committed_boundary: bool


def snapshot(machine: PhaseMachine) -> Snapshot:
    return Snapshot(
        machine.phase,
        machine.capture_origin,
        machine.stepped,
        machine.fenced,
        machine.phase_log,
        tuple(machine.phase_path()),
        machine.committed_boundary(),
        machine.is_committed_boundary(),
    )


# --------------------------------------------------------------------------------------------
# §8 tests 20-26


def test_the_happy_path_walks_the_transition_diagram() -> None:
    machine = run(
        PhaseMachine(),
        Ready(0),
        Preparing(0),
        Applying(0),
        Observing(1),
        Committing(0),
        Ready(1),
    )
    assert machine.phase == Ready(1)
    assert machine.phase_path() == [
        "Starting -> Ready(0)",
        "Ready(0) -> Preparing(0)",
        "Preparing(0) -> Applying(0)",
        "Applying(0) -> Observing(1)",
        "Observing(1) -> Committing(0)",
        "Committing(0) -> Ready(1)",
    ]


def test_a_step_cannot_be_skipped_or_rewound() -> None:
    cases = [
        (reach(PhaseName.READY, 1), Ready(1), Preparing(2)),
        (reach(PhaseName.COMMITTING, 0), Committing(0), Ready(0)),
        (reach(PhaseName.PREPARING, 0), Preparing(0), Observing(1)),
    ]
    for machine, at, target in cases:
        assert machine.phase == at
        error = refused(machine, target)
        assert error.code == ErrorCode.INVALID_PHASE
        assert error.message == f"{at.label} -> {target.label} is not an edge"
        assert machine.phase == at
    assert [str(refused(m, t)) for m, _, t in cases] == [
        "INVALID_PHASE: Ready(1) -> Preparing(2) is not an edge",
        "INVALID_PHASE: Committing(0) -> Ready(0) is not an edge",
        "INVALID_PHASE: Preparing(0) -> Observing(1) is not an edge",
    ]


def test_only_a_committed_boundary_pauses_or_captures() -> None:
    for name in (
        PhaseName.PREPARING,
        PhaseName.APPLYING,
        PhaseName.OBSERVING,
        PhaseName.COMMITTING,
    ):
        machine = reach(name, 1)
        for k in (1, 2):
            refused(machine, Paused(k))
            refused(machine, Capturing(k))
    for name in PhaseName:
        machine = reach(name, 1)
        assert machine.phase.name is name
        assert machine.is_committed_boundary() is (name in (PhaseName.READY, PhaseName.PAUSED))


def test_a_capture_returns_to_the_boundary_it_came_from() -> None:
    machine = reach(PhaseName.PAUSED, 2)
    assert machine.committed_boundary() == 2
    machine.move(Capturing(2))
    assert machine.capture_origin == Paused(2)
    assert machine.committed_boundary() == 2
    refused(machine, Ready(2))
    assert machine.committed_boundary() == 2
    machine.move(Paused(2))
    assert machine.phase == Paused(2)
    assert machine.committed_boundary() == 2
    assert machine.capture_origin is None


def test_failure_leads_to_restore_and_then_to_a_paused_boundary() -> None:
    for name in PhaseName:
        if name is PhaseName.FAILED:
            continue
        machine = reach(name, 1)
        at = machine.phase
        assert machine.fail() == at
        assert machine.phase == Failed()
        assert machine.phase_log[-1] == (at, Failed())
    machine = reach(PhaseName.FAILED, 1)
    before = snapshot(machine)
    with pytest.raises(DomainError) as caught:
        machine.fail()
    assert caught.value == DomainError(
        ErrorCode.INVALID_PHASE, "Failed -> Failed is not an edge", Mutation.NONE
    )
    assert snapshot(machine) == before
    refused(machine, Failed())
    machine.move(Restoring(5))
    refused(machine, Ready(5))
    machine.move(Paused(5))
    assert machine.phase == Paused(5)
    assert machine.phase_path()[-3:] == [
        "Ready(1) -> Failed",
        "Failed -> Restoring(5)",
        "Restoring(5) -> Paused(5)",
    ]


def test_an_episode_reset_leaves_a_pause_and_lands_on_step_zero() -> None:
    machine = reach(PhaseName.PAUSED, 7)
    machine.move(Resetting(7))
    machine.move(Ready(0))
    assert machine.phase == Ready(0)
    assert machine.phase_path()[-2:] == ["Paused(7) -> Resetting(7)", "Resetting(7) -> Ready(0)"]
    refused(reach(PhaseName.READY, 7), Resetting(7))


def test_an_import_starts_only_from_an_unstepped_zero() -> None:
    fresh = reach(PhaseName.READY, 0)
    assert fresh.is_unstepped_zero()
    fresh.move(Restoring(4))
    assert fresh.phase == Restoring(4)
    stepped = run(reach(PhaseName.READY, 1), Paused(1), Resetting(1), Ready(0))
    assert stepped.phase == Ready(0)
    assert not stepped.is_unstepped_zero()
    refused(stepped, Restoring(4))


# --------------------------------------------------------------------------------------------
# Phase values


def test_labels_name_the_phase_and_its_step() -> None:
    assert [p.label for p in (Starting(), Ready(3), Observing(4), Committing(3), Failed())] == [
        "Starting",
        "Ready(3)",
        "Observing(4)",
        "Committing(3)",
        "Failed",
    ]
    assert str(Paused(2)) == "Paused(2)"
    same, other_kind, other_step = Ready(2), Paused(2), Ready(3)
    values: list[Phase] = [same, other_kind, other_step]
    assert Ready(2) == same and values[0] != values[1] and values[0] != values[2]
    assert {Ready(2), Ready(2), Capturing(2)} == {Ready(2), Capturing(2)}
    assert step_of(Ready(9)) == 9 and step_of(Failed()) is None
    assert phase_of(PhaseName.OBSERVING, 4) == Observing(4)
    assert phase_of(PhaseName.STARTING) == Starting()


@pytest.mark.parametrize(
    "build",
    [
        lambda: Observing(0),
        lambda: Ready(-1),
        lambda: Ready(U64_MAX + 1),
        lambda: Ready(True),
        lambda: Ready("1"),  # type: ignore[arg-type]
        lambda: phase_of(PhaseName.READY),
        lambda: phase_of(PhaseName.FAILED, 1),
    ],
)
def test_a_phase_that_cannot_exist_is_a_flyd_bug(build: Callable[[], Phase]) -> None:
    with pytest.raises(DomainError) as caught:
        build()
    assert (caught.value.code, caught.value.mutation) == (ErrorCode.INTERNAL, Mutation.NONE)


# --------------------------------------------------------------------------------------------
# The table against the spec, and every (phase, event) pair against the table

#: §6.2's table, transcribed row by row: (from, to, condition, entry point)
SPEC_TABLE: frozenset[tuple[str, str, str, str]] = frozenset(
    {
        ("Starting", "Ready(0)", "", "move"),
        ("Ready(k)", "Preparing(k)", "", "move"),
        ("Ready(k)", "Paused(k)", "", "move"),
        ("Ready(k)", "Capturing(k)", "", "move"),
        ("Ready(k)", "Restoring(j)", "k = 0 and no transition was ever started", "move"),
        ("Preparing(k)", "Applying(k)", "", "move"),
        ("Applying(k)", "Observing(k+1)", "", "move"),
        ("Observing(k+1)", "Committing(k)", "", "move"),
        ("Committing(k)", "Ready(k+1)", "", "move"),
        ("Paused(k)", "Ready(k)", "", "move"),
        ("Paused(k)", "Capturing(k)", "", "move"),
        ("Paused(k)", "Resetting(k)", "", "move"),
        ("Capturing(k)", "Ready(k)", "the phase it came from", "move"),
        ("Capturing(k)", "Paused(k)", "the phase it came from", "move"),
        ("Failed", "Restoring(j)", "", "move"),
        ("Restoring(k)", "Paused(k)", "", "move"),
        ("Resetting(k)", "Ready(0)", "", "move"),
    }
    | {
        (source, "Failed", "", "fail")
        for source in (
            "Starting",
            "Ready(k)",
            "Preparing(k)",
            "Applying(k)",
            "Observing(k+1)",
            "Committing(k)",
            "Paused(k)",
            "Capturing(k)",
            "Restoring(k)",
            "Resetting(k)",
        )
    }
)

_PATTERN = re.compile(r"([A-Za-z]+)(?:\((k|k\+1|j|0)\))?")


def _split(pattern: str) -> tuple[str, str | None]:
    match = _PATTERN.fullmatch(pattern)
    assert match is not None, pattern
    return match.group(1), match.group(2)


def _as_spec_row(edge: Edge) -> tuple[str, str, str, str]:
    """Render one module table row in the spec's notation."""
    source_step, target_step = {
        StepRule.SAME: ("k", "k"),
        StepRule.NEXT: ("k", "k+1"),
        StepRule.PREVIOUS: ("k+1", "k"),
        StepRule.ZERO: ("k", "0"),
        StepRule.ANY: ("k", "j"),
        StepRule.NONE: ("k", None),
    }[edge.step]
    if edge.source is PhaseName.OBSERVING:  # the spec names it by the boundary it observes
        source_step = "k+1"
    no_step = (PhaseName.STARTING, PhaseName.FAILED)
    source = edge.source.value + ("" if edge.source in no_step else f"({source_step})")
    target = edge.target.value + ("" if target_step is None else f"({target_step})")
    condition = {
        Guard.ALWAYS: "",
        Guard.UNSTEPPED_ZERO: "k = 0 and no transition was ever started",
        Guard.CAPTURE_ORIGIN: "the phase it came from",
    }[edge.guard]
    return source, target, condition, edge.via.value


def test_the_edge_table_is_the_spec_table() -> None:
    rows = [_as_spec_row(edge) for edge in EDGES]
    assert len(rows) == len(set(rows))
    assert set(rows) == SPEC_TABLE
    assert {name for name in PhaseName} == set(TRANSITIONS)
    assert sum(len(edges) for edges in TRANSITIONS.values()) == len(EDGES)


@dataclass(frozen=True)
class Situation:
    """A reachable machine state: the events that reach it from a fresh machine."""

    events: tuple[Event, ...]

    @property
    def phase(self) -> Phase:
        return run(PhaseMachine(), *self.events).phase

    @property
    def stepped(self) -> bool:
        return any(isinstance(e, Preparing) for e in self.events)

    @property
    def origin(self) -> Phase | None:
        if len(self.events) >= 2 and isinstance(self.events[-1], Capturing):
            previous = self.events[-2]
            assert isinstance(previous, Phase)
            return previous
        return None


def _situations() -> list[Situation]:
    """Every phase kind at steps 0..3, with each history the guards tell apart."""
    seqs: list[list[Event]] = [[]]
    for k in range(4):
        stepped: list[Event] = (
            to_ready(k) if k else [*to_ready(1), Paused(1), Resetting(1), Ready(0)]
        )
        unstepped: list[Event] = (
            [Ready(0)] if k == 0 else [FAIL, Restoring(k), Paused(k), Ready(k)]
        )
        for ready in (stepped, unstepped):
            seqs += [
                ready,
                [*ready, Preparing(k)],
                [*ready, Preparing(k), Applying(k)],
                [*ready, Preparing(k), Applying(k), Observing(k + 1)],
                [*ready, *transition(k)[:4]],
                [*ready, Paused(k)],
                [*ready, Capturing(k)],
                [*ready, Paused(k), Capturing(k)],
                [*ready, FAIL],
                [*ready, FAIL, Restoring(k)],
                [*ready, Paused(k), Resetting(k)],
            ]
        seqs.append([Ready(0), Restoring(k)])  # a cold install in progress
    return [Situation(tuple(seq)) for seq in seqs]


SITUATIONS = _situations()


def _targets() -> list[Phase]:
    targets: list[Phase] = [Starting(), Failed()]
    for name in PhaseName:
        if name in (PhaseName.STARTING, PhaseName.FAILED):
            continue
        targets += [phase_of(name, j) for j in range(6) if j or name is not PhaseName.OBSERVING]
    return targets


TARGETS = _targets()


def spec_allows(situation: Situation, event: Event) -> bool:
    """The oracle: does some row of SPEC_TABLE admit this event in this situation?"""
    source = situation.phase
    via = "fail" if isinstance(event, Fail) else "move"
    target = Failed() if isinstance(event, Fail) else event
    for from_pattern, to_pattern, condition, row_via in SPEC_TABLE:
        if row_via != via:
            continue
        from_name, from_step = _split(from_pattern)
        to_name, to_step = _split(to_pattern)
        if (from_name, to_name) != (source.label.split("(")[0], target.label.split("(")[0]):
            continue
        s, t = step_of(source), step_of(target)
        k = None if s is None else (s - 1 if from_step == "k+1" else s)
        wanted: int | None = {
            None: None,
            "0": 0,
            "k": k,
            "k+1": None if k is None else k + 1,
            "j": t,
        }[to_step]
        if t != wanted:
            continue
        if condition == "k = 0 and no transition was ever started":
            if not (k == 0 and not situation.stepped):
                continue
        elif condition == "the phase it came from":
            if target != situation.origin:
                continue
        return True
    return False


def test_the_situations_cover_every_phase_and_history() -> None:
    phases = [s.phase for s in SITUATIONS]
    assert {p.name for p in phases} == set(PhaseName)
    assert {(s.phase, s.stepped) for s in SITUATIONS if s.phase == Ready(0)} == {
        (Ready(0), True),
        (Ready(0), False),
    }
    assert {s.origin for s in SITUATIONS if isinstance(s.phase, Capturing)} >= {
        Ready(2),
        Paused(2),
    }


@pytest.mark.parametrize("situation", SITUATIONS, ids=lambda s: " > ".join(map(str, s.events)))
def test_every_phase_and_event_pair_follows_the_table(situation: Situation) -> None:
    events: list[Event] = [*TARGETS, FAIL]
    for event in events:
        machine = run(PhaseMachine(), *situation.events)
        before = snapshot(machine)
        target = Failed() if isinstance(event, Fail) else event
        if spec_allows(situation, event):
            if isinstance(event, Fail):
                assert machine.fail() == before.phase
            else:
                assert machine.can_move(event)
                machine.move(event)
            assert machine.phase == target
            assert machine.phase_log == (*before.log, (before.phase, target))
            assert machine.phase_path()[-1] == f"{before.phase.label} -> {target.label}"
        else:
            if isinstance(event, Phase):
                assert not machine.can_move(event)
                assert machine.edge_to(event) is None
            with pytest.raises(DomainError) as caught:
                if isinstance(event, Fail):
                    machine.fail()
                else:
                    machine.move(event)
            assert caught.value == not_an_edge(before.phase, target)
            assert caught.value == DomainError(
                ErrorCode.INVALID_PHASE,
                f"{before.phase.label} -> {target.label} is not an edge",
                Mutation.NONE,
            )
            assert snapshot(machine) == before


def test_every_table_edge_is_taken_and_lands_where_the_table_says() -> None:
    taken: set[Edge] = set()
    for situation in SITUATIONS:
        for target in [*TARGETS, Failed()]:
            machine = run(PhaseMachine(), *situation.events)
            source = machine.phase
            via = Via.FAIL if isinstance(target, Failed) else Via.MOVE
            rows = [
                edge
                for edge in TRANSITIONS[source.name]
                if edge.via is via
                and edge.target is target.name
                and edge.step.admits(step_of(source), step_of(target))
                and (
                    edge.guard is Guard.ALWAYS
                    or (
                        edge.guard is Guard.UNSTEPPED_ZERO
                        and step_of(source) == 0
                        and not situation.stepped
                    )
                    or (edge.guard is Guard.CAPTURE_ORIGIN and target == situation.origin)
                )
            ]
            assert len(rows) <= 1
            if not rows:
                continue
            if via is Via.FAIL:
                machine.fail()
            else:
                assert machine.edge_to(target) == rows[0]
                machine.move(target)
            assert machine.phase == target
            assert machine.phase_log[-1] == (source, target)
            taken.add(rows[0])
    assert taken == set(EDGES)


# --------------------------------------------------------------------------------------------
# Random event sequences against the invariants the spec states


@dataclass(frozen=True)
class Legal:
    """Take the i-th (mod n) move the machine currently accepts (restores, captures, resets)."""

    index: int


@dataclass(frozen=True)
class Play:
    """Play along the session's main cycle for n moves (then, if `finish`, up to a boundary)."""

    moves: int
    finish: bool


@dataclass(frozen=True)
class Attempt:
    """Try a move to an arbitrary phase (mostly refused)."""

    target: Phase


@dataclass(frozen=True)
class Nearby:
    """Try a move to a phase of this kind at the current step plus delta (mostly refused)."""

    name: PhaseName
    delta: int


@dataclass(frozen=True)
class Detour:
    """Moves at the current step, in order: pauses, captures, returns and resets."""

    names: tuple[PhaseName, ...]


RandomEvent: TypeAlias = Legal | Play | Attempt | Nearby | Detour | Fail


def _arbitrary_phase(name: PhaseName, step: int) -> Phase:
    if name in (PhaseName.STARTING, PhaseName.FAILED):
        return phase_of(name)
    return phase_of(name, max(step, 1) if name is PhaseName.OBSERVING else step)


_legal = st.builds(Legal, st.integers(0, 15))
_play = st.builds(Play, st.integers(1, 12), st.booleans())
_attempt = st.builds(
    Attempt, st.builds(_arbitrary_phase, st.sampled_from(PhaseName), st.integers(0, 8))
)
_nearby = st.builds(Nearby, st.sampled_from(PhaseName), st.integers(-1, 2))
# pauses, captures, resets and returns at the current step: the edges the guards decide
_detour = st.builds(
    Detour,
    st.lists(
        st.sampled_from(
            [PhaseName.PAUSED, PhaseName.CAPTURING, PhaseName.RESETTING, PhaseName.READY]
        ),
        min_size=1,
        max_size=3,
    ).map(tuple),
)
# mostly legal moves so that walks go deep (several transitions, captures, resets, restores),
# with arbitrary attempts and failures mixed in
random_events = st.lists(
    st.one_of(_play, _legal, _legal, _detour, _detour, _nearby, _attempt, st.just(FAIL)),
    min_size=10,
    max_size=60,
)


def _candidates(machine: PhaseMachine) -> list[Phase]:
    s = step_of(machine.phase) or 0
    steps = sorted({0, s, s + 1, max(s - 1, 0), 3})
    found: list[Phase] = []
    for name in PhaseName:
        for j in steps if name not in (PhaseName.STARTING, PhaseName.FAILED) else [None]:
            if name is PhaseName.OBSERVING and j == 0:
                continue
            target = phase_of(name, j)
            if machine.can_move(target):
                found.append(target)
    return found


def _play_next(machine: PhaseMachine) -> Phase | None:
    """The next move of ordinary play: bootstrap, transitions, resume, return from a capture."""
    match machine.phase:
        case Starting():
            return Ready(0)
        case Ready(step=k):
            return Preparing(k)
        case Preparing(step=k):
            return Applying(k)
        case Applying(step=k):
            return Observing(k + 1)
        case Observing(step=k):
            return Committing(k - 1)
        case Committing(step=k):
            return Ready(k + 1)
        case Paused(step=k) | Restoring(step=k):
            return Ready(k) if isinstance(machine.phase, Paused) else Paused(k)
        case Capturing():
            return machine.capture_origin
        case Resetting():
            return Ready(0)
        case _:
            return None


def _actions(machine: PhaseMachine, events: Sequence[RandomEvent]) -> Iterator[Phase | Fail]:
    """Expand the drawn events into single moves, looking at the machine as it is then."""
    for event in events:
        if isinstance(event, Play):
            for move in range(event.moves + 5):
                done = move >= event.moves
                if done and (not event.finish or machine.is_committed_boundary()):
                    break
                target = _play_next(machine)
                if target is None:
                    break
                yield target
        elif isinstance(event, Legal):
            options = _candidates(machine)
            if options:
                yield options[event.index % len(options)]
        elif isinstance(event, Attempt):
            yield event.target
        elif isinstance(event, Nearby):
            yield _arbitrary_phase(event.name, max(0, (step_of(machine.phase) or 0) + event.delta))
        elif isinstance(event, Detour):
            for name in event.names:
                yield phase_of(name, step_of(machine.phase) or 0)
        else:
            yield FAIL


def _check_edge(log: Sequence[tuple[Phase, Phase]], via_fail: bool, ever_stepped: bool) -> None:
    """The invariants of the newest edge, given the log and whether any earlier edge stepped."""
    source, target = log[-1]
    # Failed is entered only through fail(), from anything but Failed
    assert isinstance(target, Failed) is via_fail
    if via_fail:
        assert not isinstance(source, Failed)
        return
    match target:
        case Ready(step=n):
            # a boundary is reached only by a complete transition, by bootstrap, a reset, or a
            # return from a pause or capture at the same boundary: never skipped, never rewound
            if isinstance(source, Committing):
                assert n == source.step + 1
                assert [t for _, t in log[-5:]] == transition(n - 1)
                assert log[-5][0] == Ready(n - 1)
            elif isinstance(source, Starting | Resetting):
                assert n == 0
            else:
                assert source in (Paused(n), Capturing(n))
        case Preparing(step=n):
            assert source == Ready(n)
        case Applying(step=n):
            assert source == Preparing(n)
        case Observing(step=n):
            assert source == Applying(n - 1)
        case Committing(step=n):
            assert source == Observing(n + 1)
        case Paused(step=n):
            # only a committed boundary pauses (a restore lands on a paused boundary)
            assert source in (Ready(n), Capturing(n), Restoring(n))
        case Capturing(step=n):
            # only a committed boundary captures
            assert source in (Ready(n), Paused(n))
        case Restoring():
            # an import starts only from an unstepped zero; a restore only after a failure
            assert isinstance(source, Failed) or (source == Ready(0) and not ever_stepped)
        case Resetting(step=n):
            assert source == Paused(n)
        case _:
            pytest.fail(f"unexpected edge {source} -> {target}")
    if isinstance(source, Capturing):
        # a capture returns to the boundary it came from
        assert len(log) >= 2 and target == log[-2][0]


@settings(max_examples=200, deadline=None)
@given(random_events)
def test_random_event_sequences_keep_the_invariants(events: list[RandomEvent]) -> None:
    machine = PhaseMachine()
    log: list[tuple[Phase, Phase]] = []  # the test's own record of the accepted edges
    ever_stepped = fenced = restoring_from_failed = False
    for action in _actions(machine, events):
        before = _state(machine)
        source = machine.phase
        via_fail = isinstance(action, Fail)
        target = Failed() if isinstance(action, Fail) else action
        allowed = not isinstance(source, Failed) if via_fail else machine.can_move(target)
        try:
            if via_fail:
                assert machine.fail() == source
            else:
                machine.move(target)
        except DomainError as error:
            # a refused event raises the typed error and leaves the machine unchanged
            assert not allowed
            assert error == not_an_edge(source, target)
            assert _state(machine) == before
            continue
        assert allowed
        assert machine.phase == target
        log.append((source, target))
        _check_edge(log, via_fail, ever_stepped)
        ever_stepped = ever_stepped or isinstance(target, Preparing)
        # the fence: closed by fail(), lifted only by the restore that follows it
        if via_fail:
            fenced = True
        elif isinstance(target, Restoring):
            restoring_from_failed = isinstance(source, Failed)
        elif isinstance(source, Restoring) and isinstance(target, Paused):
            fenced = False
        assert machine.fenced is fenced
        assert fenced == (
            isinstance(target, Failed) or (isinstance(target, Restoring) and restoring_from_failed)
        )
        # the boundary queries follow the phase
        committed = isinstance(target, Ready | Paused | Capturing)
        assert machine.committed_boundary() == (step_of(target) if committed else None)
        assert machine.is_committed_boundary() == isinstance(target, Ready | Paused)
        assert (machine.capture_origin is not None) == isinstance(target, Capturing)
        assert machine.stepped is ever_stepped
        assert machine.is_unstepped_zero() == (target == Ready(0) and not ever_stepped)
    # the machine's log is exactly the accepted edges, chained from Starting
    assert list(machine.phase_log) == log
    assert all(log[i][1] == log[i + 1][0] for i in range(len(log) - 1))
    assert (log[0][0] if log else Starting()) == Starting()
    assert (log[-1][1] if log else Starting()) == machine.phase
    assert machine.phase_path() == [f"{a.label} -> {b.label}" for a, b in log]


def _state(machine: PhaseMachine) -> tuple[object, ...]:
    """A fingerprint of everything a move could change (the log only ever grows at its end)."""
    log = machine.phase_log
    return (
        machine.phase,
        machine.capture_origin,
        machine.stepped,
        machine.fenced,
        len(log),
        log[-1] if log else None,
        machine.committed_boundary(),
        machine.is_committed_boundary(),
    )
