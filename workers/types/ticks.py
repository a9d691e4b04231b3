"""Exact time: `RationalNs`, `TickAccumulator`, `AudioBudget` (design/session.md §5.1-§5.3). Pure.

The spec's module map calls this module `workers/clock.py`; it is named for the ticks it counts,
so it is not mistaken for the lease clock (`flyd.leases.clock`), which reads the system clock.

A world step of 60 Hz is 50000000/3 ns; a brain tick of 1 ms never divides it. Floats would
drift, so time is an exact fraction of nanoseconds and every clock is integer arithmetic.

`RationalNs` rules:
- Non-negative, frozen, always reduced (gcd 1), denominator >= 1, zero is `0/1`; numerator and
  denominator <= 2^64-1. The constructor *checks* these (a non-reduced `6/4` is refused, as on
  the wire); `RationalNs.of(n, d)` reduces first. Refusals are `INVALID_ARGUMENT`/`none`.
- Wire form `{"numerator": U64, "denominator": U64}` (exact keys).
- `a + b` and `a.times(k)` are checked: a result whose reduced numerator or denominator exceeds
  2^64-1 raises `INTERNAL` (an invariant of a session, not a caller's mistake).
- `divide_floor(a, b) -> (q, r)` with `a = q·b + r`, `0 <= r < b`; `b = 0` is refused.
- Comparisons are exact (cross multiplication). Conversion to float is only for display and
  pacing (`floor_ns`).

`TickAccumulator` (fields `tick > 0`, `remainder` in [0, tick), `executed`, `warmup_offset`):

    advance(interval)   interval > 0 else INVALID_ARGUMENT "a zero interval is refused" (nothing
                        changes); (q, r) = divide_floor(remainder + interval, tick);
                        executed += q; remainder = r; returns q. The sum is exact and
                        unbounded (only the new remainder must fit a RationalNs), so a long
                        interval after a fine-grained remainder cannot overflow needlessly.
    warm_up(n)          executed += n; warmup_offset += n; remainder untouched
    brain_ticks()       executed (warm-up included)
    brain_time_ms()     executed·tick in ms as a float; INVALID_ARGUMENT once executed >= 2^53

`AudioBudget` (integer only): D = step.denominator·10^9; per chunk acc += sampleRate·
step.numerator, frames = acc // D, acc = acc mod D; the chunk starts at the stream position and
the position advances by frames. Changing the step after a chunk was produced is refused.

Resolved ambiguities:
- `divide_floor` by zero and an AudioBudget step change after a chunk are `INVALID_ARGUMENT`.
- A counter (`executed`, an audio position) that would pass 2^64-1 raises `INTERNAL`.
- `TickAccumulator.advance` forms `remainder + interval` exactly without the U64 bound (the
  spec's `+` would raise `INTERNAL` on a large intermediate sum); only the new remainder, which
  is below one tick, must be a RationalNs. Results are identical whenever the bounded sum fits.
- `AudioBudget` takes any sample rate >= 1; the 8000..192000 range is the descriptor's rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Final

from workers.types.domain import (
    U64_MAX,
    DomainError,
    ErrorCode,
    Mutation,
    format_u64,
    parse_u64,
    short,
)

__all__ = [
    "NS_PER_MS",
    "NS_PER_S",
    "AudioBudget",
    "AudioSpan",
    "RationalNs",
    "TickAccumulator",
    "divide_floor",
]

NS_PER_S: Final = 10**9
NS_PER_MS: Final = 10**6
_EXACT_FLOAT_LIMIT: Final = 2**53


def _overflow(what: str) -> DomainError:
    return DomainError(ErrorCode.INTERNAL, f"{what} exceeds 2^64-1", Mutation.NONE)


def _natural(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DomainError.invalid(f"{what} must be a non-negative integer; got {short(value)}")
    return value


@dataclass(frozen=True, slots=True, eq=True)
class RationalNs:
    """An exact non-negative number of nanoseconds, `numerator/denominator`, reduced."""

    numerator: int
    denominator: int = 1

    def __post_init__(self) -> None:
        n = _natural(self.numerator, "numerator")
        d = _natural(self.denominator, "denominator")
        if d == 0:
            raise DomainError.invalid("a RationalNs needs a denominator >= 1")
        if n > U64_MAX or d > U64_MAX:
            raise DomainError.invalid(f"{n}/{d} does not fit U64 numerator and denominator")
        if math.gcd(n, d) != 1:
            raise DomainError.invalid(f"{n}/{d} is not reduced")

    # construction ---------------------------------------------------------------------------

    @classmethod
    def of(cls, numerator: int, denominator: int = 1) -> RationalNs:
        """Reduce, then check (`of(6, 4) == RationalNs(3, 2)`, `of(0, 5)` is `0/1`)."""
        n = _natural(numerator, "numerator")
        d = _natural(denominator, "denominator")
        if d == 0:
            raise DomainError.invalid("a RationalNs needs a denominator >= 1")
        g = math.gcd(n, d)
        return cls(n // g, d // g)

    @classmethod
    def zero(cls) -> RationalNs:
        return cls(0, 1)

    @classmethod
    def hz(cls, frequency: int) -> RationalNs:
        """The period of a frequency: `hz(60) == 50000000/3`."""
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency <= 0:
            raise DomainError.invalid(f"a frequency must be a positive integer; got {frequency}")
        return cls.of(NS_PER_S, frequency)

    @classmethod
    def millis(cls, milliseconds: int) -> RationalNs:
        return cls.of(_natural(milliseconds, "milliseconds") * NS_PER_MS, 1)

    @classmethod
    def from_json(cls, value: Any, what: str = "RationalNs") -> RationalNs:
        if not isinstance(value, dict) or set(value) != {"numerator", "denominator"}:
            raise DomainError.invalid(
                f"{what} must be an object with exactly numerator and denominator"
            )
        try:
            return cls(
                parse_u64(value["numerator"], f"{what}.numerator"),
                parse_u64(value["denominator"], f"{what}.denominator"),
            )
        except DomainError as exc:
            if exc.message.startswith(what):
                raise
            raise exc.with_message(f"{what}: {exc.message}") from None

    def to_json(self) -> dict[str, str]:
        return {
            "numerator": format_u64(self.numerator),
            "denominator": format_u64(self.denominator),
        }

    # arithmetic ----------------------------------------------------------------------------

    @staticmethod
    def _checked(numerator: int, denominator: int, what: str) -> RationalNs:
        g = math.gcd(numerator, denominator)
        n, d = numerator // g, denominator // g
        if n > U64_MAX or d > U64_MAX:
            raise _overflow(what)
        return RationalNs(n, d)

    def __add__(self, other: RationalNs) -> RationalNs:
        if not isinstance(other, RationalNs):
            return NotImplemented
        return self._checked(
            self.numerator * other.denominator + other.numerator * self.denominator,
            self.denominator * other.denominator,
            f"{self} + {other}",
        )

    def times(self, factor: int) -> RationalNs:
        """`factor · self`, checked like `+` (world time = k × stepDuration)."""
        k = _natural(factor, "factor")
        return self._checked(self.numerator * k, self.denominator, f"{k} × {self}")

    def divide_floor(self, divisor: RationalNs) -> tuple[int, RationalNs]:
        return divide_floor(self, divisor)

    def is_zero(self) -> bool:
        return self.numerator == 0

    def floor_ns(self) -> int:
        return self.numerator // self.denominator

    # exact comparisons ---------------------------------------------------------------------

    def _cross(self, other: RationalNs) -> tuple[int, int]:
        return self.numerator * other.denominator, other.numerator * self.denominator

    def __lt__(self, other: RationalNs) -> bool:
        if not isinstance(other, RationalNs):
            return NotImplemented
        left, right = self._cross(other)
        return left < right

    def __le__(self, other: RationalNs) -> bool:
        if not isinstance(other, RationalNs):
            return NotImplemented
        left, right = self._cross(other)
        return left <= right

    def __gt__(self, other: RationalNs) -> bool:
        if not isinstance(other, RationalNs):
            return NotImplemented
        left, right = self._cross(other)
        return left > right

    def __ge__(self, other: RationalNs) -> bool:
        if not isinstance(other, RationalNs):
            return NotImplemented
        left, right = self._cross(other)
        return left >= right

    def __str__(self) -> str:
        return f"{self.numerator}/{self.denominator}"


def divide_floor(a: RationalNs, b: RationalNs) -> tuple[int, RationalNs]:
    """`(q, r)` with `a = q·b + r` and `0 <= r < b`."""
    return _divide_floor(a.numerator, a.denominator, b)


def _divide_floor(numerator: int, denominator: int, b: RationalNs) -> tuple[int, RationalNs]:
    """`divide_floor` of the exact fraction numerator/denominator, which may exceed U64."""
    if b.is_zero():
        raise DomainError.invalid(f"cannot divide {numerator}/{denominator} by zero")
    q = (numerator * b.denominator) // (b.numerator * denominator)
    # r = a − q·b over the common denominator a.d·b.d
    r_numerator = numerator * b.denominator - q * b.numerator * denominator
    return q, RationalNs._checked(
        r_numerator, denominator * b.denominator, f"{numerator}/{denominator} mod {b}"
    )


@dataclass(slots=True)
class TickAccumulator:
    """Turns exact world intervals into whole brain ticks, carrying the remainder."""

    tick: RationalNs
    remainder: RationalNs = RationalNs(0, 1)
    executed: int = 0
    warmup_offset: int = 0

    def __post_init__(self) -> None:
        if self.tick.is_zero():
            raise DomainError.invalid("a zero tick is refused")
        if not self.remainder < self.tick:
            raise DomainError.invalid(
                f"the remainder {self.remainder} must lie in [0, {self.tick})"
            )
        _natural(self.executed, "executed")
        _natural(self.warmup_offset, "warmup_offset")
        if self.executed > U64_MAX:
            raise _overflow("executed")
        if self.warmup_offset > self.executed:
            raise DomainError.invalid(
                f"warmup_offset {self.warmup_offset} exceeds executed {self.executed}"
            )

    def advance(self, interval: RationalNs) -> int:
        """Run the whole ticks that `interval` (plus the carried remainder) covers."""
        if interval.is_zero():
            raise DomainError.invalid("a zero interval is refused")
        # remainder + interval, exactly, without bounding the intermediate sum: only the
        # new remainder (< tick) must fit a RationalNs
        q, r = _divide_floor(
            self.remainder.numerator * interval.denominator
            + interval.numerator * self.remainder.denominator,
            self.remainder.denominator * interval.denominator,
            self.tick,
        )
        if self.executed + q > U64_MAX:
            raise _overflow("executed brain ticks")
        self.executed += q
        self.remainder = r
        return q

    def warm_up(self, ticks: int) -> None:
        """Warm-up ticks count as brain ticks but are not world time: the remainder stays."""
        n = _natural(ticks, "warm-up ticks")
        if self.executed + n > U64_MAX:
            raise _overflow("executed brain ticks")
        self.executed += n
        self.warmup_offset += n

    def brain_ticks(self) -> int:
        return self.executed

    def brain_time_ms(self) -> float:
        """The legacy millisecond clock; exact only while `executed < 2^53`."""
        if self.executed >= _EXACT_FLOAT_LIMIT:
            raise DomainError.invalid(
                f"brain time in milliseconds is exact only below 2^53 executed ticks; "
                f"this clock has executed {self.executed}"
            )
        return (self.executed * self.tick.numerator) / (self.tick.denominator * NS_PER_MS)


@dataclass(frozen=True, slots=True)
class AudioSpan:
    """One chunk's place in its stream: `firstSample` and `sampleFrames`."""

    first_sample: int
    frames: int


@dataclass(slots=True)
class AudioBudget:
    """How many sample frames each world step owns, exactly, with no drift."""

    sample_rate: int
    step: RationalNs
    position: int = 0
    acc: int = 0
    chunks: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, int):
            raise DomainError.invalid(f"sample rate must be an integer; got {self.sample_rate}")
        if self.sample_rate < 1:
            raise DomainError.invalid(f"sample rate must be >= 1; got {self.sample_rate}")
        if self.step.is_zero():
            raise DomainError.invalid("a zero step is refused")
        _natural(self.position, "position")
        _natural(self.chunks, "chunks")
        if self.position > U64_MAX:
            raise _overflow("audio position")
        if not 0 <= self.acc < self.denominator:
            raise DomainError.invalid(f"acc {self.acc} must lie in [0, {self.denominator})")

    @property
    def denominator(self) -> int:
        return self.step.denominator * NS_PER_S

    def next_chunk(self) -> AudioSpan:
        total = self.acc + self.sample_rate * self.step.numerator
        frames, acc = divmod(total, self.denominator)
        if self.position + frames > U64_MAX:
            raise _overflow("audio position")
        span = AudioSpan(self.position, frames)
        self.acc = acc
        self.position += frames
        self.chunks += 1
        return span

    def set_step(self, step: RationalNs) -> None:
        if step == self.step:
            return
        if self.chunks or self.acc:
            raise DomainError.invalid(
                f"the step cannot change from {self.step} to {step} after a chunk was produced"
            )
        if step.is_zero():
            raise DomainError.invalid("a zero step is refused")
        self.step = step
