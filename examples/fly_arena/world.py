"""`FlyArena`: flies walking in a square arena toward an odour source, computed with numpy.

State, per port: a fly's position, its heading (a unit vector) and the number of times it
reached the source. The source sits at a point drawn from the config's `layoutSeed`; its odour
concentration at distance d is `1 / (1 + d / odourScale)`, and zero outside the arena's walls.
`apply` turns every fly by its `turn` axis, walks it `speed · maxSpeed` along its new heading
and reflects it off the walls; a fly that comes within `sourceRadius` of the source counts a
visit and is released again from its next start spot (so a long run keeps producing visits).

Views (RGBA8, top-left origin), both rendered from the state after the step:
- `arena` (`viewSize`²): the top-down picture. The odour field as a green glow, the source as a
  yellow disc, every fly a red 3×3 body with a white pixel at its head.
- `eyes` (`eyePixels` wide, one row per fly in port order): every fly's own sensor view, a
  one-dimensional retina of receptors spanning 90° left (column 0) to 90° right of its heading,
  each sampling the odour `eyeReach` away: green is the concentration, blue its complement, red
  marks a receptor that looks past a wall. A fly's controller reads its own row.

The world also offers its inspection as structured input (`STRUCTURED_OBSERVATION`): a fly's
controller finds its row there (its index among the flies).

Determinism: every quantity is computed in float64 with `+ - * /` and `sqrt` only, which IEEE 754
rounds correctly on every platform, one ufunc at a time (no fused multiply-add, no BLAS, no
reductions whose order could vary); a turn by `u` rotates by the rational parametrisation
`((1 − t²), 2t) / (1 + t²)` of the angle `2·atan(t)`, `t = turnRate · u`, so no sine or cosine is
ever evaluated. Start spots and the source come from SHA-256 of `(layoutSeed, port, kind,
index)`. Negative zeros are normalised after each step, so that the canonical JSON of a capture
(which writes -0.0 as 0) restores the identical state.

Config: `size` (half the arena's side, default 10), `maxSpeed` (distance per step at full
speed, default 0.5), `turnRate` (default 0.4), `sourceRadius` (default 1), `odourScale`
(default 8), `eyeReach` (default 1.5), `viewSize` (default 64), `eyePixels` (default 15),
`layoutSeed` (an integer, default 1).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

import numpy as np
import numpy.typing as npt

from examples.fly_arena.schemas import CONTROLLER, INSPECTION, integral, pair, settings, typed
from workers.composition import config_asset
from workers.protocols import STRUCTURED_OBSERVATION
from workers.types.canonical import canonical, digest_bytes, parse_strict
from workers.types.datatypes import (
    AssetRef,
    AxisSpec,
    ControllerSchema,
    EnvironmentDescriptor,
    PixelAspect,
    PortControl,
    PortSpec,
    TypedValue,
    ViewDescriptor,
)
from workers.types.domain import DomainError, parse_id, parse_int
from workers.types.ticks import RationalNs

Floats = npt.NDArray[np.float64]

ARENA_VIEW: Final = "arena"
EYES_VIEW: Final = "eyes"
CAPTURE_FORMAT: Final = "fly-arena-v1"
CONTROLS: Final = ControllerSchema(CONTROLLER, (), (AxisSpec("turn", "bipolar", 0.0),
                                                    AxisSpec("speed", "unipolar", 0.0)))
DEFAULTS: Final = {"size": (10.0, 2.0, 1000.0), "maxSpeed": (0.5, 0.0, 100.0),
                   "turnRate": (0.4, 0.0, 1.0), "sourceRadius": (1.0, 0.1, 100.0),
                   "odourScale": (8.0, 0.1, 1000.0), "eyeReach": (1.5, 0.1, 100.0),
                   "viewSize": (64.0, 16.0, 512.0), "eyePixels": (15.0, 3.0, 256.0),
                   "layoutSeed": (1.0, 0.0, 2.0**31)}
SOURCE_RGB: Final = (255, 220, 40)
FLY_RGB: Final = (230, 50, 50)
HEAD_RGB: Final = (255, 255, 255)


def to_u8(values: Floats) -> npt.NDArray[np.uint8]:
    """`round(v)` clamped to 0..255 (values are finite)."""
    return np.clip(np.floor(values + 0.5), 0.0, 255.0).astype(np.uint8)


def receptor_directions(count: int) -> Floats:
    """`count` unit vectors from 90° left (+, counter-clockwise) to 90° right of the x axis:
    `((1 − t²), 2t) / (1 + t²)` for `t` from 1 down to −1, exact rational arithmetic."""
    t = 1.0 - 2.0 * np.arange(count, dtype=np.float64) / float(count - 1)
    denominator = 1.0 + t * t
    return np.stack(((1.0 - t * t) / denominator, (2.0 * t) / denominator), axis=1)


class FlyArena:
    """Flies in `[-size, size]²` and the odour they smell."""

    capabilities: ClassVar[tuple[str, ...]] = (STRUCTURED_OBSERVATION,)
    inline_calls: ClassVar[bool] = True  # a step and its two views take tens of microseconds

    def __init__(self, *, world_id: str, ports: Sequence[str], step: RationalNs,
                 observation_delay_steps: int, threads: int,
                 config: Mapping[str, Any]) -> None:
        parse_id(world_id, "world id")
        if not ports or len(set(ports)) != len(ports):
            raise DomainError.invalid("the fly arena needs at least one port, each once")
        self.world_id = world_id
        self.ports = tuple(ports)
        self.step = step
        self.delay = parse_int(observation_delay_steps, "observation_delay_steps", 0, 8)
        self.config = dict(config)
        values = settings(self.config, "fly arena", DEFAULTS)
        self.size = values["size"]
        self.max_speed = values["maxSpeed"]
        self.turn_rate = values["turnRate"]
        self.radius = values["sourceRadius"]
        self.scale = values["odourScale"]
        self.reach = values["eyeReach"]
        self.view_size = integral(values, "viewSize", "fly arena")
        self.eye_pixels = integral(values, "eyePixels", "fly arena")
        self.layout_seed = integral(values, "layoutSeed", "fly arena")
        if self.max_speed > self.size:
            raise DomainError.invalid("fly arena config maxSpeed must be at most size")
        sx, sy = self._spot("source", "source", 0)
        self.source = np.array([sx * 0.5, sy * 0.5], dtype=np.float64)  # in the middle half
        self.receptors = receptor_directions(self.eye_pixels)
        self.background = self._background()
        n = len(self.ports)
        self.agents: dict[str, str] = {}
        self.position: Floats = np.zeros((n, 2), dtype=np.float64)
        self.heading: Floats = np.zeros((n, 2), dtype=np.float64)
        self.heading[:, 0] = 1.0
        self.reached = [0] * n

    # ------------------------------------------------------------------ layout and odour

    def _spot(self, port: str, kind: str, index: int) -> tuple[float, float]:
        """A point of the arena from `(layoutSeed, port, kind, index)`: two 53-bit fractions."""
        text = f"{self.layout_seed}\n{port}\n{kind}\n{index}\n".encode()
        digest = hashlib.sha256(text).digest()
        fx = int.from_bytes(digest[:8], "big") >> 11
        fy = int.from_bytes(digest[8:16], "big") >> 11
        scale = 2.0 * self.size / 2.0**53
        return fx * scale - self.size, fy * scale - self.size

    def _release(self, i: int) -> None:
        """Put fly `i` at its start spot for its current visit count, facing a drawn way."""
        port, visit = self.ports[i], self.reached[i]
        self.position[i] = self._spot(port, "start", visit)
        hx, hy = self._spot(port, "heading", visit)
        length = math.sqrt(hx * hx + hy * hy)
        self.heading[i] = (hx / length, hy / length) if length > 0 else (1.0, 0.0)

    def odour(self, points: Floats) -> Floats:
        """The concentration at `points` (`(..., 2)`): `1 / (1 + d / odourScale)`, 0 beyond the
        walls."""
        dx = points[..., 0] - self.source[0]
        dy = points[..., 1] - self.source[1]
        distance = np.sqrt(dx * dx + dy * dy)
        inside = (np.abs(points[..., 0]) <= self.size) & (np.abs(points[..., 1]) <= self.size)
        return np.where(inside, 1.0 / (1.0 + distance / self.scale), 0.0)

    def _background(self) -> npt.NDArray[np.uint8]:
        """The top-down view's odour glow and source disc (`viewSize`², RGB)."""
        s = self.view_size
        centres = (np.arange(s, dtype=np.float64) + 0.5) * (2.0 * self.size / s)
        xs = centres - self.size
        ys = self.size - centres
        grid = np.stack(np.meshgrid(xs, ys), axis=-1)
        c = self.odour(grid)
        rgb = np.stack((to_u8(20.0 + 40.0 * c), to_u8(30.0 + 200.0 * c),
                        to_u8(40.0 + 60.0 * c)), axis=-1)
        dx = grid[..., 0] - self.source[0]
        dy = grid[..., 1] - self.source[1]
        rgb[dx * dx + dy * dy <= self.radius * self.radius] = SOURCE_RGB
        return rgb

    def _pixel(self, x: float, y: float) -> tuple[int, int]:
        """The (row, column) of the top-down view that holds `(x, y)`."""
        s = self.view_size
        column = math.floor((x + self.size) * s / (2.0 * self.size))
        row = math.floor((self.size - y) * s / (2.0 * self.size))
        return min(s - 1, max(0, row)), min(s - 1, max(0, column))

    # ------------------------------------------------------------------ World

    def config_asset(self) -> AssetRef:
        return config_asset(f"{self.world_id}-config", self.config)

    def descriptor(self) -> EnvironmentDescriptor:
        config = canonical({"config": self.config, "ports": list(self.ports),
                            "step": self.step.to_json(), "delay": self.delay})
        s, e = self.view_size, self.eye_pixels
        return EnvironmentDescriptor(
            backend_digest=digest_bytes(b"fly-arena-backend-v1"),
            content_digest=digest_bytes(b"fly-arena-content-v1"),
            configuration_digest=digest_bytes(config),
            step_duration=self.step,
            ports=tuple(PortSpec(p, CONTROLS) for p in self.ports),
            inspection_schema=INSPECTION,
            views=(ViewDescriptor(ARENA_VIEW, s, s, 4 * s, PixelAspect(1, 1), self.delay),
                   ViewDescriptor(EYES_VIEW, e, len(self.ports), 4 * e, PixelAspect(1, 1),
                                  self.delay)),
            audio=(),
            recovery="exact-checkpoint",
            determinism="fixed-build",
        )

    def reset(self, episode_id: str, bindings: Sequence[tuple[str, str]]) -> None:
        self.agents = {port: agent for port, agent in bindings}
        self.reached = [0] * len(self.ports)
        for i in range(len(self.ports)):
            self._release(i)

    def apply(self, controls: Sequence[PortControl]) -> None:
        index = {port: i for i, port in enumerate(self.ports)}
        turn = np.zeros(len(self.ports), dtype=np.float64)
        speed = np.zeros(len(self.ports), dtype=np.float64)
        for control in controls:
            axes = {axis.id: axis.value for axis in control.axes}
            turn[index[control.port_id]] = axes["turn"]
            speed[index[control.port_id]] = axes["speed"]
        t = self.turn_rate * turn
        denominator = 1.0 + t * t
        cos, sin = (1.0 - t * t) / denominator, (2.0 * t) / denominator
        hx, hy = self.heading[:, 0], self.heading[:, 1]
        nx, ny = hx * cos - hy * sin, hx * sin + hy * cos
        length = np.sqrt(nx * nx + ny * ny)
        heading = np.stack((nx / length, ny / length), axis=1)
        position = self.position + (self.max_speed * speed)[:, None] * heading
        for axis in (0, 1):  # reflect off the walls (one reflection: maxSpeed <= size)
            high, low = position[:, axis] > self.size, position[:, axis] < -self.size
            position[:, axis] = np.where(high, 2.0 * self.size - position[:, axis],
                                         np.where(low, -2.0 * self.size - position[:, axis],
                                                  position[:, axis]))
            heading[:, axis] = np.where(high | low, -heading[:, axis], heading[:, axis])
        self.position, self.heading = position + 0.0, heading + 0.0  # no negative zeros
        dx = self.position[:, 0] - self.source[0]
        dy = self.position[:, 1] - self.source[1]
        arrived = dx * dx + dy * dy <= self.radius * self.radius
        for i in np.flatnonzero(arrived).tolist():
            self.reached[i] += 1
            self._release(i)

    def inspection(self, boundary: int) -> TypedValue:
        return typed(INSPECTION, {
            "boundary": boundary, "source": self.source.tolist(), "radius": self.radius,
            "flies": [{"portId": port, "agentId": self.agents.get(port),
                       "position": self.position[i].tolist(),
                       "heading": self.heading[i].tolist(), "reached": self.reached[i]}
                      for i, port in enumerate(self.ports)]})

    def render(self, view_id: str, boundary: int) -> bytes:
        if view_id == ARENA_VIEW:
            return self.render_arena()
        if view_id == EYES_VIEW:
            return self.render_eyes()
        raise DomainError.invalid(f"the fly arena has no view {view_id}")

    def render_arena(self) -> bytes:
        rgb = self.background.copy()
        s = self.view_size
        for i in range(len(self.ports)):
            x, y = self.position[i].tolist()
            row, column = self._pixel(x, y)
            rgb[max(0, row - 1):row + 2, max(0, column - 1):column + 2] = FLY_RGB
            ahead = self.position[i] + self.heading[i] * (2.5 * 2.0 * self.size / s)
            rgb[self._pixel(float(ahead[0]), float(ahead[1]))] = HEAD_RGB
        alpha = np.full((s, s, 1), 255, dtype=np.uint8)
        return np.concatenate((rgb, alpha), axis=-1).tobytes()

    def sensor_points(self) -> Floats:
        """Where every receptor of every fly samples: `(flies, eyePixels, 2)`."""
        hx, hy = self.heading[:, 0:1], self.heading[:, 1:2]
        cos, sin = self.receptors[None, :, 0], self.receptors[None, :, 1]
        dx, dy = hx * cos - hy * sin, hx * sin + hy * cos
        return np.stack((self.position[:, 0:1] + self.reach * dx,
                         self.position[:, 1:2] + self.reach * dy), axis=-1)

    def render_eyes(self) -> bytes:
        points = self.sensor_points()
        concentration = self.odour(points)
        wall = (np.abs(points[..., 0]) > self.size) | (np.abs(points[..., 1]) > self.size)
        green = to_u8(255.0 * concentration)
        blue = np.where(wall, 0, 255 - green).astype(np.uint8)
        red = np.where(wall, 255, 0).astype(np.uint8)
        alpha = np.full(green.shape, 255, dtype=np.uint8)
        return np.stack((red, green, blue, alpha), axis=-1).tobytes()

    def audio(self, stream_id: str, frames: int) -> bytes:
        raise DomainError.invalid(f"the fly arena has no audio stream {stream_id}")

    # ------------------------------------------------------------------ checkpoint

    def capture(self) -> bytes:
        return canonical({"format": CAPTURE_FORMAT, "agents": self.agents, "flies": {
            port: {"position": self.position[i].tolist(), "heading": self.heading[i].tolist(),
                   "reached": self.reached[i]} for i, port in enumerate(self.ports)}})

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`: all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        try:
            doc = parse_strict(payload)
            if not isinstance(doc, dict) or set(doc) != {"format", "agents", "flies"} \
                    or doc["format"] != CAPTURE_FORMAT:
                raise DomainError.invalid(f"not a {CAPTURE_FORMAT} state")
            agents, flies = doc["agents"], doc["flies"]
            if not isinstance(agents, dict) or not isinstance(flies, dict) \
                    or sorted(flies) != sorted(self.ports) \
                    or not all(isinstance(f, dict) for f in flies.values()):
                raise DomainError.invalid("agents and flies must cover this world's ports")
            position = np.array([pair(flies[p].get("position"), f"{p} position")
                                 for p in self.ports], dtype=np.float64)
            heading = np.array([pair(flies[p].get("heading"), f"{p} heading")
                                for p in self.ports], dtype=np.float64)
            reached = [parse_int(flies[p].get("reached"), f"{p} reached", 0, 2**53 - 1)
                       for p in self.ports]
        except DomainError as exc:
            raise DomainError.before("INCOMPATIBLE_STATE",
                                     f"fly arena state: {exc.message}") from None
        self.agents = {str(p): str(a) for p, a in agents.items()}
        self.position, self.heading, self.reached = position, heading, reached
