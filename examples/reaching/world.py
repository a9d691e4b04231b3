"""`PointWorld`: points in a square plane, one per port, moved by their port's axes.

State: per port a position, a goal and the number of goals reached. `apply` moves each point by
`speed · (dx, dy)`, clamps it to the plane `[-size, size]²`, and when it lies within
`goalRadius` of its goal counts the goal and draws the next one. Positions and goals are pure
functions of the config's `layoutSeed`, the port and the goal's index (SHA-256, no global
random state), so every run of a spec is the same run, and a restored world continues exactly.

The world offers its inspection as the agents' structured input (`STRUCTURED_OBSERVATION`): the
agents see positions and goals without pixels. With `view` > 0 it also declares one view,
`top-down`: the plane seen from above, `view` pixels square, each point a filled square and its
goal a hollow one in the port's colour (what `flyd run --record` shows; the goal seekers do not
look at it). It declares no audio.

Config: `size` (default 5), `speed` (distance per step at full throttle, default 0.4),
`goalRadius` (default 0.5), `layoutSeed` (an integer, default 1), `view` (pixels per side of
the top-down view, an integer; default 0, no view).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

from examples.reaching.schemas import CONTROLLER, INSPECTION, distance, point, settings, typed
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

CAPTURE_FORMAT: Final = "point-world-v1"
CONTROLS: Final = ControllerSchema(CONTROLLER, (), (AxisSpec("dx", "bipolar", 0.0),
                                                    AxisSpec("dy", "bipolar", 0.0)))
DEFAULTS: Final = {"size": (5.0, 0.5, 1000.0), "speed": (0.4, 0.0, 100.0),
                   "goalRadius": (0.5, 0.01, 100.0), "layoutSeed": (1.0, 0.0, 2.0**31),
                   "view": (0.0, 0.0, 512.0)}
VIEW_ID: Final = "top-down"
BACKGROUND: Final = (24, 26, 32, 255)
#: the ports' colours, in port order (repeating)
COLOURS: Final = ((230, 159, 0), (86, 180, 233), (0, 158, 115), (240, 228, 66),
                  (0, 114, 178), (213, 94, 0), (204, 121, 167), (255, 255, 255))


class PointWorld:
    """Points in `[-size, size]²` steered toward goals."""

    capabilities: ClassVar[tuple[str, ...]] = (STRUCTURED_OBSERVATION,)
    inline_calls: ClassVar[bool] = True  # every call is microseconds of pure Python

    def __init__(self, *, world_id: str, ports: Sequence[str], step: RationalNs,
                 observation_delay_steps: int, threads: int,
                 config: Mapping[str, Any]) -> None:
        parse_id(world_id, "world id")
        if not ports:
            raise DomainError.invalid("the point world needs at least one port")
        self.world_id = world_id
        self.ports = tuple(ports)
        self.step = step
        self.config = dict(config)
        values = settings(self.config, "point world", DEFAULTS)
        for key in ("layoutSeed", "view"):
            if not values[key].is_integer():
                raise DomainError.invalid(f"point world config {key} must be an integer")
        self.view = int(values["view"])
        self.delay = observation_delay_steps
        self.size = values["size"]
        self.speed = values["speed"]
        self.radius = values["goalRadius"]
        self.layout_seed = int(values["layoutSeed"])
        self.agents: dict[str, str] = {}
        self.positions: dict[str, tuple[float, float]] = {}
        self.reached: dict[str, int] = {}

    # ------------------------------------------------------------------ layout

    def _spot(self, port: str, kind: str, index: int) -> tuple[float, float]:
        """A point of the plane from `(layoutSeed, port, kind, index)`: two 53-bit fractions."""
        text = f"{self.layout_seed}\n{port}\n{kind}\n{index}\n".encode()
        digest = hashlib.sha256(text).digest()
        fx = int.from_bytes(digest[:8], "big") >> 11
        fy = int.from_bytes(digest[8:16], "big") >> 11
        scale = 2.0 * self.size / 2.0**53
        return fx * scale - self.size, fy * scale - self.size

    def goal(self, port: str) -> tuple[float, float]:
        return self._spot(port, "goal", self.reached[port])

    # ------------------------------------------------------------------ World

    def config_asset(self) -> AssetRef:
        return config_asset(f"{self.world_id}-config", self.config)

    def descriptor(self) -> EnvironmentDescriptor:
        config = canonical({"config": self.config, "ports": list(self.ports),
                            "step": self.step.to_json()})
        return EnvironmentDescriptor(
            backend_digest=digest_bytes(b"reaching-point-world-backend-v1"),
            content_digest=digest_bytes(b"reaching-point-world-content-v1"),
            configuration_digest=digest_bytes(config),
            step_duration=self.step,
            ports=tuple(PortSpec(p, CONTROLS) for p in self.ports),
            inspection_schema=INSPECTION,
            views=(ViewDescriptor(VIEW_ID, self.view, self.view, 4 * self.view,
                                  PixelAspect(1, 1), self.delay),) if self.view else (),
            audio=(),
            recovery="exact-checkpoint",
            determinism="fixed-build",
        )

    def reset(self, episode_id: str, bindings: Sequence[tuple[str, str]]) -> None:
        self.agents = {port: agent for port, agent in bindings}
        self.positions = {port: self._spot(port, "start", 0) for port in self.ports}
        self.reached = dict.fromkeys(self.ports, 0)

    def apply(self, controls: Sequence[PortControl]) -> None:
        for control in controls:
            port = control.port_id
            axes = {axis.id: axis.value for axis in control.axes}
            x, y = self.positions[port]
            x = min(self.size, max(-self.size, x + self.speed * axes["dx"]))
            y = min(self.size, max(-self.size, y + self.speed * axes["dy"]))
            self.positions[port] = (x, y)
            if distance((x, y), self.goal(port)) <= self.radius:
                self.reached[port] += 1

    def inspection(self, boundary: int) -> TypedValue:
        return typed(INSPECTION, {"boundary": boundary, "points": [
            {"portId": port, "agentId": self.agents.get(port),
             "position": list(self.positions[port]), "goal": list(self.goal(port)),
             "reached": self.reached[port]} for port in self.ports]})

    def render(self, view_id: str, boundary: int) -> bytes:
        if view_id != VIEW_ID or not self.view:
            raise DomainError.invalid(f"the point world has no view {view_id}")
        side = self.view
        pixels = bytearray(bytes(BACKGROUND) * side * side)
        half = max(1, side // 40)
        for index, port in enumerate(self.ports):
            colour = bytes((*COLOURS[index % len(COLOURS)], 255))
            gx, gy = self._pixel(self.goal(port))
            self._square(pixels, gx, gy, half + 2, colour, hollow=True)
            px, py = self._pixel(self.positions[port])
            self._square(pixels, px, py, half + 1, colour, hollow=False)
        return bytes(pixels)

    def _pixel(self, spot: tuple[float, float]) -> tuple[int, int]:
        """A point of the plane as a pixel of the view (y up, rows top down)."""
        scale = (self.view - 1) / (2.0 * self.size)
        return (round((spot[0] + self.size) * scale), round((self.size - spot[1]) * scale))

    def _square(self, pixels: bytearray, cx: int, cy: int, half: int, colour: bytes,
                hollow: bool) -> None:
        side = self.view
        for y in range(max(0, cy - half), min(side, cy + half + 1)):
            edge_row = y in (cy - half, cy + half)
            for x in range(max(0, cx - half), min(side, cx + half + 1)):
                if hollow and not edge_row and x not in (cx - half, cx + half):
                    continue
                at = 4 * (y * side + x)
                pixels[at:at + 4] = colour

    def audio(self, stream_id: str, frames: int) -> bytes:
        raise DomainError.invalid(f"the point world has no audio stream {stream_id}")

    # ------------------------------------------------------------------ checkpoint

    def capture(self) -> bytes:
        return canonical({"format": CAPTURE_FORMAT, "agents": self.agents, "points": {
            port: {"position": list(self.positions[port]), "reached": self.reached[port]}
            for port in self.ports}})

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`: all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        try:
            doc = parse_strict(payload)
            if not isinstance(doc, dict) or doc.get("format") != CAPTURE_FORMAT:
                raise DomainError.invalid(f"not a {CAPTURE_FORMAT} state")
            agents, points = doc.get("agents"), doc.get("points")
            if not isinstance(agents, dict) or not isinstance(points, dict) \
                    or sorted(points) != sorted(self.ports):
                raise DomainError.invalid("agents and points must cover this world's ports")
            positions = {port: point(points[port].get("position"), f"{port} position")
                         for port in self.ports}
            reached = {port: parse_int(points[port].get("reached"), f"{port} reached", 0,
                                       2**53 - 1) for port in self.ports}
        except (DomainError, AttributeError) as exc:
            reason = exc.message if isinstance(exc, DomainError) else "malformed points"
            raise DomainError.before("INCOMPATIBLE_STATE", f"point world state: {reason}") \
                from None
        self.agents = {str(p): str(a) for p, a in agents.items()}
        self.positions = positions
        self.reached = reached
