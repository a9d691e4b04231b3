"""`FlyBrain`: a fly's controller, a tiny multilayer perceptron with seeded numpy weights.

Input: the fly's own row of the world's `eyes` view. `encode` reduces every row of that view to
three senses, the mean odour (the green channel, 0..1) seen by the left, middle and right thirds
of the retina; `install_input` keeps this fly's own row, found by its index among the flies of
the structured input. Output (`fly.decision.v1`): `{turn, speed}`.

The network: `hidden = relu(W1 · [L, C, R] + b1)` (6 units), `out = W2 · hidden + b2`,
`turn = softsign(out[0])`, `speed = (1 + softsign(out[1])) / 2`, softsign(x) = x / (1 + |x|).
Its weights are a designed chemotaxis prior plus seeded noise: unit 0 fires when the left side
smells more (`gain · (L − R)`), unit 1 when the right does, unit 2 when the middle smells less
than the sides (the source is behind: turn and slow down), unit 3 near the source (slow down);
units 4 and 5 start at zero. Every weight and bias then gets `noise · U(−1, 1)` from
`numpy.random.Generator(PCG64(seed))`, drawn once when the brain is built, so two flies with
different seeds walk differently. Learning: every reinforcement moves the speed
bias `b2[1]` by `learningRate · signal` (clamped to ±3): approaching speeds a fly up.

Determinism: the matrix products are explicit sums of `+` and `*` in a fixed order (no BLAS), in
float64, correctly rounded everywhere; `decide` and `encode` are pure reads. `capture` holds the
weights, the current senses and the counters; canonical JSON round-trips every float exactly.

Config (`modelConfig`): `gain` (default 12), `noise` (default 0.3), `learningRate`
(default 0.02).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from examples.fly_arena.schemas import CONTEXT, DECISION, INSPECTION, expect, settings, typed
from workers.protocols import DecodedView
from workers.types.canonical import canonical, digest_bytes, parse_strict
from workers.types.datatypes import (
    AssetRef,
    Graph,
    Learning,
    RateRole,
    Stimulus,
    Telemetry,
    TypedValue,
)
from workers.types.domain import (
    DomainError,
    parse_bool,
    parse_finite,
    parse_i32,
    parse_int,
    parse_u64,
)
from workers.types.ticks import RationalNs

Floats = npt.NDArray[np.float64]

CAPTURE_FORMAT: Final = "fly-brain-v1"
EYES_VIEW: Final = "eyes"
SOURCE_STIMULUS: Final = "fly.source"
HIDDEN: Final = 6
SENSES: Final = 3
BIAS_LIMIT: Final = 3.0
DEFAULTS: Final = {"gain": (12.0, 0.0, 1000.0), "noise": (0.3, 0.0, 10.0),
                   "learningRate": (0.02, 0.0, 1.0)}
_SHAPES: Final = {"w1": (HIDDEN, SENSES), "b1": (HIDDEN,), "w2": (2, HIDDEN), "b2": (2,)}
_FIELDS: Final = ("params", "senses", "ticks", "mutations", "learning", "updates", "changed",
                  "signal", "visits")


def softsign(x: float) -> float:
    return x / (1.0 + abs(x))


def affine(weights: Floats, bias: Floats, x: Floats) -> Floats:
    """`weights · x + bias` as a fixed-order sum of products (no BLAS: the same bits on every
    machine and in every process)."""
    out = bias.copy()
    for i in range(weights.shape[1]):
        out = out + weights[:, i] * x[i]
    return out


def senses_of(green: npt.NDArray[np.uint8]) -> list[list[float]]:
    """Per retina row: the mean of the left, middle and right thirds of the green channel, 0..1.
    Integer sums, then one division: exact."""
    width = green.shape[1]
    third = width // 3
    sums = green.astype(np.int64)
    parts = (sums[:, :third], sums[:, third:width - third], sums[:, width - third:])
    return [[int(part[row].sum()) / (255.0 * part.shape[1]) for part in parts]
            for row in range(green.shape[0])]


def prior(gain: float) -> dict[str, Floats]:
    """The designed chemotaxis weights (see the module docstring)."""
    w1 = np.zeros((HIDDEN, SENSES), dtype=np.float64)
    w1[0] = (gain, 0.0, -gain)
    w1[1] = (-gain, 0.0, gain)
    w1[2] = (gain / 2.0, -gain, gain / 2.0)
    w1[3] = (0.0, 4.0, 0.0)
    b1 = np.array([0.0, 0.0, 0.0, -2.0, 0.0, 0.0])
    w2 = np.zeros((2, HIDDEN), dtype=np.float64)
    w2[0, :3] = (1.5, -1.5, 1.0)
    w2[1, 2:4] = (-1.0, -1.0)
    b2 = np.array([0.0, 1.5])
    return {"w1": w1, "b1": b1, "w2": w2, "b2": b2}


class FlyBrain:
    """Steers by the odour its eyes see on the left, ahead and on the right."""

    capabilities: ClassVar[tuple[str, ...]] = ()
    inline_calls: ClassVar[bool] = True
    #: checkpoints record both; a restore refuses a checkpoint of another version
    model_version: ClassVar[str] = "fly-brain-v1"
    plasticity_version: ClassVar[str] = "fly-brain-speed-bias-v1"

    # ------------------------------------------------------------------ class level

    @classmethod
    def profile(cls, agent_id: str, tick: RationalNs, warmup_ticks: int,
                config: Mapping[str, Any]) -> AssetRef:
        """What this agent runs: the model, its config, its clock."""
        settings(dict(config), "fly brain", DEFAULTS)
        text = canonical({"model": cls.model_version, "agentId": agent_id,
                          "config": dict(config), "tick": tick.to_json(),
                          "warmupTicks": warmup_ticks})
        return AssetRef(f"fly-brain-{agent_id}", digest_bytes(text), len(text),
                        "fly-profile-v1")

    @classmethod
    def graph(cls, agent_id: str, config: Mapping[str, Any]) -> Graph:
        return Graph(dataset_digest=digest_bytes(b"fly-brain-dataset-v1"),
                     index_digest=digest_bytes(f"fly-brain-index-v1\n{agent_id}\n".encode()),
                     neuron_count=SENSES + HIDDEN + 2, rate_roles=("motor",),
                     supported_stimuli=(SOURCE_STIMULUS,))

    @classmethod
    def check_context(cls, context: TypedValue) -> None:
        value = expect(context, CONTEXT, "the decision context")
        if not isinstance(value, dict) or set(value) != {"step"}:
            raise DomainError.invalid("a fly context is {step}")

    @classmethod
    def encode(cls, views: Sequence[DecodedView], structured: TypedValue | None) -> Any:
        """`{agents: [agentId per row], senses: [[L, C, R] per row]}` from the `eyes` view."""
        if structured is None:
            raise DomainError.invalid("the fly brain needs structured input (a world with "
                                      "structured-observation-v1)")
        value = expect(structured, INSPECTION, "the structured input")
        flies = value.get("flies") if isinstance(value, dict) else None
        if not isinstance(flies, list) or not flies \
                or not all(isinstance(f, dict) for f in flies):
            raise DomainError.invalid("the structured input has no flies")
        eyes = next((v for v in views if v.view_id == EYES_VIEW), None)
        if eyes is None:
            raise DomainError.invalid(f"the fly brain needs the world's {EYES_VIEW} view")
        rows = len(flies)
        width = len(eyes.pixels) // (4 * rows)
        if width < SENSES or len(eyes.pixels) != 4 * rows * width:
            raise DomainError.invalid(f"the {EYES_VIEW} view is not {rows} rows of at least "
                                      f"{SENSES} pixels")
        pixels = np.frombuffer(eyes.pixels, dtype=np.uint8).reshape(rows, width, 4)
        return {"agents": [f.get("agentId") for f in flies], "senses": senses_of(pixels[..., 1])}

    # ------------------------------------------------------------------ instance

    def __init__(self, *, agent_id: str, seed: int, threads: int, executor: Executor,
                 config: Mapping[str, Any]) -> None:
        values = settings(dict(config), "fly brain", DEFAULTS)
        self.agent_id = agent_id
        self.rate = values["learningRate"]
        rng = np.random.Generator(np.random.PCG64(parse_i32(seed, "seed") & 0xFFFFFFFF))
        noise = values["noise"]
        self.params = {name: base + noise * (2.0 * rng.random(base.shape) - 1.0)
                       for name, base in prior(values["gain"]).items()}
        self.senses = (0.0, 0.0, 0.0)
        self.ticks = 0
        self.learning = False
        self.updates = 0
        self.changed = 0
        self.signal = 0.0
        self.visits = 0
        self._mutations = 0

    def install_input(self, encoded: Any) -> None:
        agents, senses = encoded["agents"], encoded["senses"]
        if self.agent_id not in agents:
            raise DomainError.invalid(f"the world shows no fly of {self.agent_id}")
        left, middle, right = senses[agents.index(self.agent_id)]
        self.senses = (left, middle, right)
        self._mutations += 1

    def advance(self, ticks: int) -> None:
        self.ticks += ticks
        self._mutations += ticks

    def stimulate(self, stimulus: Stimulus) -> None:
        if stimulus.kind_id == SOURCE_STIMULUS:
            self.visits += 1
        self._mutations += 1

    def act(self) -> tuple[float, float]:
        """`(turn, speed)` for the current senses: the network's forward pass."""
        p = self.params
        hidden = np.maximum(affine(p["w1"], p["b1"], np.array(self.senses)), 0.0)
        out = affine(p["w2"], p["b2"], hidden).tolist()
        return softsign(out[0]), (1.0 + softsign(out[1])) / 2.0

    def decide(self, context: TypedValue) -> TypedValue:
        self.check_context(context)
        turn, speed = self.act()
        return typed(DECISION, {"turn": turn, "speed": speed})

    def reinforce(self, signal: float) -> None:
        signal = parse_finite(signal, "reinforcement signal")
        if self.learning:
            self.updates += 1
            if signal != 0:
                self.changed += 1
                bias = self.params["b2"]
                bias[1] = min(BIAS_LIMIT, max(-BIAS_LIMIT, float(bias[1]) + self.rate * signal))
        self.signal = signal
        self._mutations += 1

    def set_learning(self, enabled: bool) -> None:
        self.learning = enabled

    def telemetry(self, brain_ticks: int) -> Telemetry:
        hz = 50.0 * (1.0 + softsign(float(self.params["b2"][1])))
        return Telemetry(brain_ticks, hz, (RateRole("motor", hz),),
                         Learning(self.learning, self.updates, self.changed, self.signal), None)

    def mutations(self) -> int:
        return self._mutations

    # ------------------------------------------------------------------ checkpoint

    def capture(self) -> bytes:
        return canonical({
            "format": CAPTURE_FORMAT,
            "params": {name: value.tolist() for name, value in self.params.items()},
            "senses": list(self.senses), "ticks": str(self.ticks),
            "mutations": str(self._mutations), "learning": self.learning,
            "updates": str(self.updates), "changed": str(self.changed), "signal": self.signal,
            "visits": self.visits})

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`: all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        try:
            doc = parse_strict(payload)
            if not isinstance(doc, dict) or doc.get("format") != CAPTURE_FORMAT \
                    or set(doc) != {"format", *_FIELDS} or not isinstance(doc["params"], dict) \
                    or set(doc["params"]) != set(_SHAPES):
                raise DomainError.invalid(f"not a {CAPTURE_FORMAT} state")
            params = {name: self._array(doc["params"][name], name, shape)
                      for name, shape in _SHAPES.items()}
            senses = self._array(doc["senses"], "senses", (SENSES,)).tolist()
            counts = {k: parse_u64(doc[k], k) for k in
                      ("ticks", "mutations", "updates", "changed")}
            learning = parse_bool(doc["learning"], "learning")
            signal = parse_finite(doc["signal"], "signal")
            visits = parse_int(doc["visits"], "visits", 0, 2**53 - 1)
        except DomainError as exc:
            raise DomainError.before("INCOMPATIBLE_STATE",
                                     f"fly brain state: {exc.message}") from None
        self.params, self.senses = params, (senses[0], senses[1], senses[2])
        self.ticks, self._mutations = counts["ticks"], counts["mutations"]
        self.updates, self.changed = counts["updates"], counts["changed"]
        self.learning, self.signal, self.visits = learning, signal, visits

    @staticmethod
    def _array(value: Any, what: str, shape: tuple[int, ...]) -> Floats:
        """A nested list of finite numbers of exactly `shape`, as float64."""
        def check(item: Any, dims: tuple[int, ...], where: str) -> None:
            if not dims:
                parse_finite(item, where)
                return
            if not isinstance(item, list) or len(item) != dims[0]:
                raise DomainError.invalid(f"{where} must be a list of {dims[0]}")
            for i, sub in enumerate(item):
                check(sub, dims[1:], f"{where}[{i}]")
        check(value, shape, what)
        return np.array(value, dtype=np.float64)
