"""`FakeBrain`: the synthetic agent model (design/session.md §4.2), all arithmetic mod 2^64.

Why: a deterministic, cheap stand-in for a neural model that still has every property the session
layer must preserve — state that changes with every tick, input, stimulus and reinforcement, a
monotonic mutation count, and decisions that depend on all of it — so that a repeated or lost
operation is visible in the numbers.

Resolved ambiguity: in `reinforce(x)` the assignment `signal = x` is unconditional (it follows the
`if learning` clause after a semicolon in design/session.md §4.2), so telemetry reports the last
signal even while learning is off; the golden run cannot tell the two readings apart because
learning is on for every reinforcement there.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from hashlib import sha256
from typing import Any, ClassVar, Final

from workers.protocols import DecodedView
from workers.synthetic import profile as _profile
from workers.synthetic import readout as _readout
from workers.types.canonical import canonical, parse_strict
from workers.types.datatypes import AssetRef, Graph, Learning, Stimulus, Telemetry, TypedValue
from workers.types.domain import (
    DomainError,
    parse_bool,
    parse_finite,
    parse_i32,
    parse_int,
    parse_u64,
)
from workers.types.ticks import RationalNs

MASK64: Final = (1 << 64) - 1
SEED_MIX: Final = 0x9E3779B97F4A7C15
LCG_MULTIPLIER: Final = 6364136223846793005
LCG_INCREMENT: Final = 1442695040888963407
CAPTURE_FORMAT: Final = "fake-brain-v1"
_CAPTURE_KEYS: Final = frozenset({"format", "state", "ticks", "mutations", "learning",
                                  "reinforcements", "updates", "changed", "signal"})


def initial_state(seed: int) -> int:
    """`(seed sign-extended to 64 bits, as unsigned) XOR 0x9e3779b97f4a7c15`."""
    return (seed & MASK64) ^ SEED_MIX


def f64_bits(x: float) -> int:
    """The IEEE-754 binary64 bit pattern of `x`."""
    return int.from_bytes(struct.pack("<d", x), "little")


def stimulus_bits(kind_id: str, duration_ms: float) -> int:
    """`le_u64(first 8 ASCII chars of hex SHA-256(kindId)) ^ f64_bits(durationMs)`."""
    prefix = sha256(kind_id.encode("utf-8")).hexdigest()[:8].encode("ascii")
    return int.from_bytes(prefix, "little") ^ f64_bits(duration_ms)


class FakeBrain:
    """A 64-bit LCG brain; `mutations()` counts every operation that changes it."""

    capabilities: ClassVar[tuple[str, ...]] = ()
    #: every call is microseconds of pure Python: no model-thread hop (`workers.protocols`)
    inline_calls: ClassVar[bool] = True
    model_version: ClassVar[str] = "fake-brain-v1"
    plasticity_version: ClassVar[str] = "fake-reinforce-v1"

    # ----------------------------------------------------------------- class level

    @classmethod
    def profile(cls, agent_id: str, tick: RationalNs, warmup_ticks: int,
                config: Mapping[str, Any]) -> AssetRef:
        _profile.graph_variant(config)
        return _profile.profile_asset(agent_id, tick, warmup_ticks)

    @classmethod
    def graph(cls, agent_id: str, config: Mapping[str, Any]) -> Graph:
        return _profile.graph(agent_id, _profile.graph_variant(config))

    @classmethod
    def check_context(cls, context: TypedValue) -> None:
        _readout.check_context(context)

    @classmethod
    def encode(cls, views: Sequence[DecodedView], structured: TypedValue | None) -> int:
        return _readout.encode(views, structured)

    # ----------------------------------------------------------------- instance

    def __init__(self, *, agent_id: str, seed: int, threads: int,
                 executor: Executor | None = None, config: Mapping[str, Any]) -> None:
        parse_i32(seed, "seed")
        self.agent_id = agent_id
        self.threads = threads
        self.executor = executor
        self.variant = _profile.graph_variant(config)
        self.state = initial_state(seed)
        self.ticks = 0
        self.learning = False
        self.reinforcements = 0
        self.updates = 0
        self.changed = 0
        self.signal = 0.0
        self._mutations = 0

    def draw(self) -> None:
        self.state = (self.state * LCG_MULTIPLIER + LCG_INCREMENT) & MASK64
        self._mutations += 1

    def advance(self, ticks: int) -> None:
        parse_int(ticks, "ticks", 0, 2**64 - 1)
        state = self.state  # `ticks` draws (as `draw` does), in a local: no call per tick
        for _ in range(ticks):
            state = (state * LCG_MULTIPLIER + LCG_INCREMENT) & MASK64
        self.state = state
        self._mutations += ticks
        self.ticks += ticks

    def install_input(self, encoded: Any) -> None:
        self.state ^= parse_int(encoded, "FakeBrain input", -(2**63), 2**64 - 1) & MASK64
        self._mutations += 1

    def stimulate(self, stimulus: Stimulus) -> None:
        self.state ^= stimulus_bits(stimulus.kind_id, stimulus.duration_ms)
        self._mutations += 1

    def reinforce(self, signal: float) -> None:
        signal = parse_finite(signal, "reinforcement signal")
        self.reinforcements += 1
        if self.learning:
            self.updates += 1
            if signal != 0:
                self.changed += 1
                self.state ^= f64_bits(signal)
        self.signal = signal
        self._mutations += 1

    def set_learning(self, enabled: bool) -> None:
        self.learning = enabled

    def decide(self, context: TypedValue) -> TypedValue:
        _readout.check_context(context)
        return _readout.decide(self.state, context)

    def telemetry(self, brain_ticks: int) -> Telemetry:
        return _readout.telemetry(self.state, brain_ticks, Learning(
            self.learning, self.updates, self.changed, self.signal))

    def mutations(self) -> int:
        return self._mutations

    # ------------------------------------------------------------ checkpoint (design/state.md §6.3)

    def capture(self) -> bytes:
        return canonical({
            "format": CAPTURE_FORMAT,
            "state": str(self.state),
            "ticks": str(self.ticks),
            "mutations": str(self._mutations),
            "learning": self.learning,
            "reinforcements": str(self.reinforcements),
            "updates": str(self.updates),
            "changed": str(self.changed),
            "signal": self.signal,
        })

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`; all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        try:
            doc = parse_strict(payload)
            if not isinstance(doc, dict) or set(doc) != _CAPTURE_KEYS \
                    or doc["format"] != CAPTURE_FORMAT:
                raise DomainError.invalid("not a fake-brain-v1 state")
            values = {k: parse_u64(doc[k], k) for k in
                      ("state", "ticks", "mutations", "reinforcements", "updates", "changed")}
            learning = parse_bool(doc["learning"], "learning")
            signal = parse_finite(doc["signal"], "signal")
        except DomainError as exc:
            raise DomainError.before("INCOMPATIBLE_STATE",
                                     f"fake brain state: {exc.message}") from None
        self.state = values["state"]
        self.ticks = values["ticks"]
        self._mutations = values["mutations"]
        self.reinforcements = values["reinforcements"]
        self.updates = values["updates"]
        self.changed = values["changed"]
        self.learning = learning
        self.signal = signal
