"""Exact time: RationalNs, TickAccumulator, AudioBudget, Pacing (session.md §5; §8 tests 5-11)."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flyd.session.pacing import Pacing
from workers.types.domain import DomainError, ErrorCode, Mutation
from workers.types.ticks import AudioBudget, RationalNs, TickAccumulator, divide_floor

STEP_60HZ = RationalNs(50000000, 3)
TICK_1MS = RationalNs.millis(1)


def test_a_60_hz_world_with_a_1_ms_tick_runs_16_17_17() -> None:
    acc = TickAccumulator(TICK_1MS)
    ticks = [acc.advance(STEP_60HZ) for _ in range(3)]
    assert ticks == [16, 17, 17]
    assert sum(ticks) == 50
    assert acc.remainder == RationalNs(0, 1)
    assert acc.brain_ticks() == 50

    long_run = TickAccumulator(TICK_1MS)
    assert sum(long_run.advance(STEP_60HZ) for _ in range(600)) == 10000
    assert long_run.remainder == RationalNs.zero()
    assert long_run.executed == 10000


# denominators from a small set keep every remainder representable (their lcm is bounded)
positive = st.builds(
    RationalNs.of,
    st.integers(min_value=1, max_value=10**12),
    st.sampled_from([1, 2, 3, 7, 60, 1000, 44100, 48000]),
)


@given(positive, st.lists(positive, min_size=1, max_size=40))
def test_the_remainder_stays_below_one_tick_and_never_goes_negative(
    tick: RationalNs, intervals: list[RationalNs]
) -> None:
    acc = TickAccumulator(tick)
    total_ticks = 0
    for interval in intervals:
        total_ticks += acc.advance(interval)
        assert RationalNs.zero() <= acc.remainder < tick
    as_fraction = Fraction(tick.numerator, tick.denominator)
    covered = total_ticks * as_fraction + Fraction(acc.remainder.numerator,
                                                   acc.remainder.denominator)
    assert covered == sum(Fraction(i.numerator, i.denominator) for i in intervals)
    assert acc.executed == total_ticks


def test_warm_up_ticks_do_not_touch_the_remainder() -> None:
    acc = TickAccumulator(TICK_1MS)
    assert acc.advance(STEP_60HZ) == 16  # a partial step: 2/3 ms carried
    remainder = acc.remainder
    assert remainder == RationalNs(2000000, 3)
    before = acc.brain_ticks()
    acc.warm_up(10)
    assert acc.remainder == remainder
    assert acc.brain_ticks() == before + 10
    assert acc.warmup_offset == 10
    # warm-up 10 then 3 steps -> 60 brain ticks (§5.2 vector)
    fresh = TickAccumulator(TICK_1MS)
    fresh.warm_up(10)
    for _ in range(3):
        fresh.advance(STEP_60HZ)
    assert fresh.brain_ticks() == 60


def test_a_zero_interval_is_refused_rather_than_silently_producing_no_ticks() -> None:
    acc = TickAccumulator(TICK_1MS)
    acc.advance(STEP_60HZ)
    before = copy.copy(acc)
    with pytest.raises(DomainError) as info:
        acc.advance(RationalNs.zero())
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert info.value.mutation == Mutation.NONE
    assert info.value.message == "a zero interval is refused"
    assert acc == before
    with pytest.raises(DomainError):
        TickAccumulator(RationalNs.zero())


def test_the_legacy_millisecond_clock_refuses_a_run_beyond_its_exact_range() -> None:
    at_limit = TickAccumulator(TICK_1MS, executed=2**53 - 1)
    assert at_limit.brain_time_ms() == float(2**53 - 1)
    beyond = TickAccumulator(TICK_1MS, executed=2**53)
    with pytest.raises(DomainError) as info:
        beyond.brain_time_ms()
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert TickAccumulator(RationalNs(500000), executed=3).brain_time_ms() == 1.5

    # RationalNs: hz, millis, the wire form, checked arithmetic
    assert RationalNs.hz(60) == RationalNs(50000000, 3)
    assert RationalNs.millis(1) == RationalNs(1000000, 1)
    assert RationalNs.of(6, 4) == RationalNs(3, 2)
    assert RationalNs.of(0, 5) == RationalNs(0, 1)
    assert RationalNs.from_json({"numerator": "50000000", "denominator": "3"}) == STEP_60HZ
    assert STEP_60HZ.to_json() == {"numerator": "50000000", "denominator": "3"}
    for wire in [
        {"numerator": "6", "denominator": "4"},
        {"numerator": "1", "denominator": "0"},
        {"numerator": "0", "denominator": "2"},
        {"numerator": 1, "denominator": "1"},
        {"numerator": "1"},
        {"numerator": "1", "denominator": "1", "x": "1"},
    ]:
        with pytest.raises(DomainError) as info:
            RationalNs.from_json(wire)
        assert info.value.code == ErrorCode.INVALID_ARGUMENT
    with pytest.raises(DomainError) as info:
        RationalNs(6, 4)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    with pytest.raises(DomainError) as info:
        _ = RationalNs(2**64 - 1) + RationalNs(1)
    assert info.value.code == ErrorCode.INTERNAL
    with pytest.raises(DomainError) as info:
        _ = RationalNs(1, 2**64 - 1) + RationalNs(1, 2**64 - 2)
    assert info.value.code == ErrorCode.INTERNAL
    assert RationalNs(1, 3) + RationalNs(1, 6) == RationalNs(1, 2)
    assert RationalNs(1, 3) < RationalNs(1, 2) and RationalNs(3, 2) > RationalNs(1)
    assert divide_floor(RationalNs(7), RationalNs(2)) == (3, RationalNs(1))
    with pytest.raises(DomainError):
        divide_floor(RationalNs(7), RationalNs.zero())


def chunks(rate: int, step: RationalNs, n: int) -> tuple[list[int], list[int], AudioBudget]:
    budget = AudioBudget(rate, step)
    spans = [budget.next_chunk() for _ in range(n)]
    return [s.frames for s in spans], [s.first_sample for s in spans], budget


def test_the_sample_budget_is_exact_when_the_cadence_does_not_divide_the_rate() -> None:
    frames, starts, _ = chunks(48000, STEP_60HZ, 4)
    assert frames == [800, 800, 800, 800]
    assert starts == [0, 800, 1600, 2400]

    frames, _, _ = chunks(8000, STEP_60HZ, 6)
    assert frames == [133, 133, 134, 133, 133, 134]

    frames, starts, budget = chunks(48000, RationalNs(1000000000, 7), 7)
    assert sorted(frames) == [6857] * 6 + [6858]
    assert sum(frames) == 48000
    assert budget.position == 48000
    assert starts[0] == 0 and starts[-1] == 48000 - frames[-1]

    # the step may not change once a chunk was produced
    with pytest.raises(DomainError) as info:
        budget.set_step(STEP_60HZ)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    fresh = AudioBudget(48000, RationalNs(1000000000, 7))
    fresh.set_step(STEP_60HZ)
    assert fresh.next_chunk().frames == 800


class FakeClock:
    def __init__(self, now: int = 1_000_000_000) -> None:
        self.now = now

    def monotonic_ns(self) -> int:
        return self.now


def test_pacing_keeps_absolute_deadlines_and_counts_lag() -> None:
    period = 16666666
    clock = FakeClock()
    pacing = Pacing(STEP_60HZ, clock)
    assert pacing.period_ns == period

    start = clock.now
    assert pacing.before_transition() == 0  # the first transition starts at once
    assert pacing.deadline_ns == start + period

    # on time: the step took 5 ms, sleep to the absolute deadline
    clock.now += 5_000_000
    assert pacing.before_transition() == start + period - clock.now
    clock.now = start + period  # woke exactly at the deadline
    assert pacing.deadline_ns == start + 2 * period
    assert pacing.lag_ns == 0

    # on time again, although the sleep overslept a little: no drift
    clock.now += 16_000_000
    assert pacing.before_transition() == start + 2 * period - clock.now
    clock.now = start + 2 * period + 300  # overslept 300 ns
    assert pacing.deadline_ns == start + 3 * period

    # late by 4 ms: sleep 0, count the lateness, next deadline = now + period (no burst)
    clock.now = start + 3 * period + 4_000_000
    assert pacing.before_transition() == 0
    assert pacing.lag_ns == 4_000_000
    assert pacing.deadline_ns == clock.now + period

    # a restart (resume) starts the next transition at once and counts no lag
    clock.now += 10 * period
    pacing.restart()
    assert pacing.before_transition() == 0
    assert pacing.lag_ns == 4_000_000
    assert pacing.deadline_ns == clock.now + period

    # a bare nanosecond function works as the clock too
    bare = Pacing(STEP_60HZ, clock.monotonic_ns)
    assert bare.before_transition() == 0
    assert bare.deadline_ns == clock.now + period

    fixed = Pacing.fixed(0.25, clock)
    assert fixed.period_ns == 250_000_000
    with pytest.raises(DomainError):
        Pacing(RationalNs.zero(), clock)
