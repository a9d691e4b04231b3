"""`GoalSeeker`: an agent model that steers its point toward its goal.

Input: the point world's inspection, as structured input (`encode` keeps the points;
`install_input` takes this agent's own). Decision (`reaching.decision.v1`): the unit vector
toward the goal plus a jitter, and a throttle equal to the current gain. Learning: every
reinforcement moves the gain by `learningRate · signal`, clamped to `[0.1, 1]`, so steering that
reduced the distance speeds up.

Determinism: the jitter comes from a 64-bit LCG seeded by the agent's seed and drawn once per
brain tick (`advance`); arithmetic is `+ - * /` and `sqrt` on binary64, correctly rounded on
every platform. `decide` is a pure read. `capture` holds every field that any later result
depends on, and `restore` installs all of them or nothing.

Config (`modelConfig`): `gain` (initial throttle, default 0.8), `jitter` (default 0.05),
`learningRate` (default 0.05).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, ClassVar, Final

from examples.reaching.schemas import (
    CONTEXT,
    DECISION,
    INSPECTION,
    expect,
    point,
    settings,
    typed,
)
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

CAPTURE_FORMAT: Final = "goal-seeker-v1"
MASK64: Final = (1 << 64) - 1
LCG_MULTIPLIER: Final = 6364136223846793005
LCG_INCREMENT: Final = 1442695040888963407
GOAL_STIMULUS: Final = "reaching.goal"
DEFAULTS: Final = {"gain": (0.8, 0.1, 1.0), "jitter": (0.05, 0.0, 1.0),
                   "learningRate": (0.05, 0.0, 1.0)}
_FIELDS: Final = ("rng", "ticks", "mutations", "gain", "position", "goal", "learning",
                  "updates", "changed", "signal", "goals")


class GoalSeeker:
    """Steers toward the goal the world names for this agent."""

    capabilities: ClassVar[tuple[str, ...]] = ()
    inline_calls: ClassVar[bool] = True
    #: checkpoints record both; a restore refuses a checkpoint of another version
    model_version: ClassVar[str] = "goal-seeker-v1"
    plasticity_version: ClassVar[str] = "goal-seeker-gain-v1"

    # ------------------------------------------------------------------ class level

    @classmethod
    def profile(cls, agent_id: str, tick: RationalNs, warmup_ticks: int,
                config: Mapping[str, Any]) -> AssetRef:
        """What this agent runs: the model, its config, its clock."""
        settings(dict(config), "goal seeker", DEFAULTS)
        text = canonical({"model": cls.model_version, "agentId": agent_id,
                          "config": dict(config), "tick": tick.to_json(),
                          "warmupTicks": warmup_ticks})
        return AssetRef(f"goal-seeker-{agent_id}", digest_bytes(text), len(text),
                        "fly-profile-v1")

    @classmethod
    def graph(cls, agent_id: str, config: Mapping[str, Any]) -> Graph:
        return Graph(dataset_digest=digest_bytes(b"goal-seeker-dataset-v1"),
                     index_digest=digest_bytes(f"goal-seeker-index-v1\n{agent_id}\n".encode()),
                     neuron_count=2, rate_roles=("steer",), supported_stimuli=(GOAL_STIMULUS,))

    @classmethod
    def check_context(cls, context: TypedValue) -> None:
        value = expect(context, CONTEXT, "the decision context")
        if not isinstance(value, dict) or set(value) != {"step"}:
            raise DomainError.invalid("a reaching context is {step}")

    @classmethod
    def encode(cls, views: Sequence[DecodedView], structured: TypedValue | None) -> Any:
        """The world's points; this model needs the point world's structured input."""
        if structured is None:
            raise DomainError.invalid("the goal seeker needs structured input (a world with "
                                      "structured-observation-v1)")
        value = expect(structured, INSPECTION, "the structured input")
        points = value.get("points") if isinstance(value, dict) else None
        if not isinstance(points, list):
            raise DomainError.invalid("the structured input has no points")
        return points

    # ------------------------------------------------------------------ instance

    def __init__(self, *, agent_id: str, seed: int, threads: int, executor: Executor,
                 config: Mapping[str, Any]) -> None:
        values = settings(dict(config), "goal seeker", DEFAULTS)
        self.agent_id = agent_id
        self.jitter = values["jitter"]
        self.rate = values["learningRate"]
        self.gain = values["gain"]
        self.rng = (parse_i32(seed, "seed") & MASK64) ^ 0x9E3779B97F4A7C15
        self.ticks = 0
        self.position = (0.0, 0.0)
        self.goal = (0.0, 0.0)
        self.goals = 0
        self.learning = False
        self.updates = 0
        self.changed = 0
        self.signal = 0.0
        self._mutations = 0

    def install_input(self, encoded: Any) -> None:
        mine = next((p for p in encoded if isinstance(p, dict)
                     and p.get("agentId") == self.agent_id), None)
        if mine is None:
            raise DomainError.invalid(f"the world shows no point of {self.agent_id}")
        self.position = point(mine.get("position"), "position")
        self.goal = point(mine.get("goal"), "goal")
        self._mutations += 1

    def advance(self, ticks: int) -> None:
        rng = self.rng
        for _ in range(ticks):
            rng = (rng * LCG_MULTIPLIER + LCG_INCREMENT) & MASK64
        self.rng = rng
        self.ticks += ticks
        self._mutations += ticks

    def stimulate(self, stimulus: Stimulus) -> None:
        if stimulus.kind_id == GOAL_STIMULUS:
            self.goals += 1
        self._mutations += 1

    def decide(self, context: TypedValue) -> TypedValue:
        self.check_context(context)
        gx, gy = self.goal[0] - self.position[0], self.goal[1] - self.position[1]
        length = math.sqrt(gx * gx + gy * gy)
        ux, uy = (gx / length, gy / length) if length > 0 else (0.0, 0.0)
        # two jitter fractions in [-1, 1) from the generator's state (read, not drawn)
        jx = ((self.rng >> 11) / 2.0**52) - 1.0
        jy = (((self.rng * LCG_MULTIPLIER) & MASK64) >> 11) / 2.0**52 - 1.0
        return typed(DECISION, {"direction": [ux + self.jitter * jx, uy + self.jitter * jy],
                                "throttle": self.gain})

    def reinforce(self, signal: float) -> None:
        signal = parse_finite(signal, "reinforcement signal")
        if self.learning:
            self.updates += 1
            if signal != 0:
                self.changed += 1
                self.gain = min(1.0, max(0.1, self.gain + self.rate * signal))
        self.signal = signal
        self._mutations += 1

    def set_learning(self, enabled: bool) -> None:
        self.learning = enabled

    def telemetry(self, brain_ticks: int) -> Telemetry:
        hz = self.gain * 100.0
        return Telemetry(brain_ticks, hz, (RateRole("steer", hz),),
                         Learning(self.learning, self.updates, self.changed, self.signal), None)

    def mutations(self) -> int:
        return self._mutations

    # ------------------------------------------------------------------ checkpoint

    def capture(self) -> bytes:
        return canonical({
            "format": CAPTURE_FORMAT, "rng": str(self.rng), "ticks": str(self.ticks),
            "mutations": str(self._mutations), "gain": self.gain,
            "position": list(self.position), "goal": list(self.goal),
            "learning": self.learning, "updates": str(self.updates),
            "changed": str(self.changed), "signal": self.signal, "goals": self.goals})

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`: all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        try:
            doc = parse_strict(payload)
            if not isinstance(doc, dict) or doc.get("format") != CAPTURE_FORMAT \
                    or set(doc) != {"format", *_FIELDS}:
                raise DomainError.invalid(f"not a {CAPTURE_FORMAT} state")
            counts = {k: parse_u64(doc[k], k) for k in
                      ("rng", "ticks", "mutations", "updates", "changed")}
            gain = parse_finite(doc["gain"], "gain")
            position = point(doc["position"], "position")
            goal = point(doc["goal"], "goal")
            learning = parse_bool(doc["learning"], "learning")
            signal = parse_finite(doc["signal"], "signal")
            goals = parse_int(doc["goals"], "goals", 0, 2**53 - 1)
        except DomainError as exc:
            raise DomainError.before("INCOMPATIBLE_STATE",
                                     f"goal seeker state: {exc.message}") from None
        self.rng, self.ticks = counts["rng"], counts["ticks"]
        self._mutations = counts["mutations"]
        self.updates, self.changed = counts["updates"], counts["changed"]
        self.gain, self.position, self.goal = gain, position, goal
        self.learning, self.signal, self.goals = learning, signal, goals
