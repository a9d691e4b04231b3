"""Encoder, readout and telemetry of the fake brain (design/session.md §4.3).

Why a separate module: these are pure functions of the brain's 64-bit state, so a test or a
coordinator-side check can compute decisions and telemetry without a model instance, and the
model itself stays a small state machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from workers.protocols import DecodedView
from workers.synthetic.schemas import CONTEXT, DECISION, has_schema, typed
from workers.types.datatypes import Learning, RateRole, Telemetry, TypedValue
from workers.types.domain import DomainError, parse_int

MASK64: Final = (1 << 64) - 1
BUTTONS: Final = ("inc", "dec")
RATE_ROLES: Final = ("kc", "mbon")


def rotate_right(x: int, r: int) -> int:
    """64-bit rotation to the right."""
    x &= MASK64
    return ((x >> r) | (x << (64 - r))) & MASK64


def check_context(context: TypedValue) -> None:
    """`arena.context.v1` or `IDENTITY_MISMATCH`; `value.available` a list of strings or
    `INVALID_ARGUMENT` (both before any mutation)."""
    if not has_schema(context, CONTEXT):
        raise DomainError.before("IDENTITY_MISMATCH",
                                 "the decision context is not arena.context.v1")
    value = context.value
    available = value.get("available") if isinstance(value, dict) else None
    if not isinstance(available, list) or not all(isinstance(b, str) for b in available):
        raise DomainError.invalid("context value.available must be a list of strings")


def available_buttons(context: TypedValue) -> frozenset[str]:
    value = context.value
    raw = value.get("available") if isinstance(value, dict) else None
    return frozenset(b for b in raw if isinstance(b, str)) if isinstance(raw, list) \
        else frozenset()


def encode(views: Sequence[DecodedView], structured: TypedValue | None) -> int:
    """Σ of the first pixel byte of every view, plus `structured.value.counter` when present."""
    total = 0
    for view in views:
        if not view.pixels:
            raise DomainError.before("BUFFER_INVALID", f"view {view.view_id} has no pixels")
        total += view.pixels[0]
    if structured is not None:
        value = structured.value
        counter = value.get("counter") if isinstance(value, dict) else None
        total += parse_int(counter, "structured value.counter", -(2**63), 2**63 - 1)
    return total


def decide(state: int, context: TypedValue) -> TypedValue:
    """The `arena.decision.v1` read from the state; a button not available is forced up."""
    d = rotate_right(state, 29)
    inc = d & 1 == 1
    dec = (not inc) and (d >> 7) & 1 == 1
    available = available_buttons(context)
    bias = (((d >> 13) % 5) - 2) / 4
    return typed(DECISION, {
        "buttons": [{"id": "inc", "down": inc and "inc" in available},
                    {"id": "dec", "down": dec and "dec" in available}],
        "axes": [{"id": "bias", "value": bias}],
    })


def telemetry(state: int, brain_ticks: int, learning: Learning) -> Telemetry:
    """Rates derived from `state >> 29`; `brainTicks` is the accumulator's count."""
    t = (state & MASK64) >> 29
    return Telemetry(
        brain_ticks=brain_ticks,
        population_rate_hz=(t % 1000) / 10,
        rates=(RateRole("kc", (t % 700) / 10), RateRole("mbon", (t % 310) / 10)),
        learning=learning,
        stimulus_remaining_ms=None,
    )
