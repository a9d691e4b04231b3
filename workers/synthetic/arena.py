"""`CounterArena`: the synthetic world (design/session.md §4.6).

Why: the smallest world with every feature the session checks — per-port controls, an inspection
the task reads, one view whose bytes depend on counter and boundary, and one audio stream whose
phase persists — so that lost, repeated or reordered steps are visible.

The world keeps only `counter` and the audio phase: the worker shell owns the boundary, the batch
set, the view pipeline and the audio sample budget (design/session.md §3.5) and passes the boundary
in. Its config object takes two optional keys, `width` and `height` of the `arena` view (1..4096
each, default 32×24), so that the media path can be measured and tested with large frames; its
config asset is `"<worldId>-config"` over that object as given.

Decision: the configuration digest is the spec's text (design/session.md §4.6) for the default size
and gains `width=<w>\nheight=<h>\n` for any other, so the golden vectors stand and a checkpoint of
one frame size is refused (`patchDigest`) by a world of another instead of failing on its media.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Final

from workers.composition import config_asset
from workers.synthetic import frame as _frame
from workers.synthetic.audio import CHANNELS, SAMPLE_RATE, TriangleSource
from workers.synthetic.schemas import CONTROLLER, INSPECTION, typed
from workers.types.canonical import canonical, digest_bytes, parse_strict
from workers.types.datatypes import (
    AssetRef,
    AudioDescriptor,
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

VIEW_ID: Final = "arena"
STREAM_ID: Final = "arena"
MAX_OBSERVATION_DELAY: Final = 8
CAPTURE_FORMAT: Final = "counter-arena-v1"
BACKEND_DIGEST: Final = digest_bytes(b"counter-arena-backend-v1")
CONTENT_DIGEST: Final = digest_bytes(b"counter-arena-content-v1")
CONTROLS: Final = ControllerSchema(CONTROLLER, ("inc", "dec"),
                                   (AxisSpec("bias", "bipolar", 0.0),))
_BUTTON_DELTA: Final = {"inc": 1, "dec": -1}
_SAFE_INT: Final = 2**53 - 1
CONFIG_KEYS: Final = ("width", "height")
#: the largest view side an `EnvironmentDescriptor` allows (design/session.md §1.8)
MAX_SIDE: Final = 4096


def configuration_digest(step: RationalNs, ports: int, delay: int,
                         width: int = _frame.WIDTH, height: int = _frame.HEIGHT) -> str:
    text = (f"counter-arena-config-v1\nstep={step.numerator}/{step.denominator}\n"
            f"ports={ports}\ndelay={delay}\n")
    if (width, height) != (_frame.WIDTH, _frame.HEIGHT):
        text += f"width={width}\nheight={height}\n"
    return digest_bytes(text.encode("utf-8"))


def frame_size(config: Mapping[str, Any]) -> tuple[int, int]:
    """`(width, height)` of the `arena` view from the world config; `INVALID_ARGUMENT` naming
    the key for an unknown key or a size outside 1..4096."""
    if not isinstance(config, Mapping):
        raise DomainError.invalid("the counter arena's config must be an object")
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise DomainError.invalid(f"world config: unknown keys {unknown} (the counter arena "
                                  f"takes {list(CONFIG_KEYS)})")
    width = parse_int(config.get("width", _frame.WIDTH), "world config width", 1, MAX_SIDE)
    height = parse_int(config.get("height", _frame.HEIGHT), "world config height", 1, MAX_SIDE)
    return width, height


def control_delta(control: PortControl) -> int:
    """+1 per pressed `inc`, −1 per pressed `dec`."""
    return sum(_BUTTON_DELTA.get(b.id, 0) for b in control.buttons if b.down)


class CounterArena:
    """A signed counter moved by the `inc`/`dec` buttons of every port."""

    capabilities: ClassVar[tuple[str, ...]] = ()
    #: every call is microseconds of pure Python: no model-thread hop (`workers.protocols`)
    inline_calls: ClassVar[bool] = True

    def __init__(self, *, world_id: str, ports: Sequence[str], step: RationalNs,
                 observation_delay_steps: int, threads: int,
                 config: Mapping[str, Any]) -> None:
        parse_id(world_id, "world id")
        if not ports or len(set(ports)) != len(ports):
            raise DomainError.invalid("the arena needs at least one port, each once")
        for port in ports:
            parse_id(port, "port")
        if step.is_zero():
            raise DomainError.invalid("the step duration must be > 0")
        parse_int(observation_delay_steps, "observation_delay_steps", 0, MAX_OBSERVATION_DELAY)
        parse_int(threads, "threads", 1, 2**31 - 1)
        self.width, self.height = frame_size(config)
        self.world_id = world_id
        self.ports = tuple(ports)
        self.step = step
        self.delay = observation_delay_steps
        self.threads = threads
        self.config: dict[str, Any] = dict(config)
        self.counter = 0
        self.bindings: tuple[tuple[str, str], ...] = ()
        self.episode_id: str | None = None
        self.source = TriangleSource()

    def config_asset(self) -> AssetRef:
        return config_asset(f"{self.world_id}-config", self.config)

    def descriptor(self) -> EnvironmentDescriptor:
        return EnvironmentDescriptor(
            backend_digest=BACKEND_DIGEST,
            content_digest=CONTENT_DIGEST,
            configuration_digest=configuration_digest(self.step, len(self.ports), self.delay,
                                                      self.width, self.height),
            step_duration=self.step,
            ports=tuple(PortSpec(p, CONTROLS) for p in self.ports),
            inspection_schema=INSPECTION,
            views=(ViewDescriptor(VIEW_ID, self.width, self.height,
                                  self.width * _frame.BYTES_PER_PIXEL, PixelAspect(1, 1),
                                  self.delay),),
            audio=(AudioDescriptor(STREAM_ID, SAMPLE_RATE, CHANNELS),),
            recovery="exact-checkpoint",
            determinism="fixed-build",
        )

    def reset(self, episode_id: str, bindings: Sequence[tuple[str, str]]) -> None:
        """A fresh episode: counter 0, audio phase 0."""
        self.episode_id = episode_id
        self.bindings = tuple((p, a) for p, a in bindings)
        self.counter = 0
        self.source.reset()

    def apply(self, controls: Sequence[PortControl]) -> None:
        """`counter += Σ delta` over the controls."""
        self.counter += sum(control_delta(c) for c in controls)

    def inspection(self, boundary: int) -> TypedValue:
        return typed(INSPECTION, {"counter": self.counter, "boundary": boundary})

    def engine_frame(self, boundary: int) -> str:
        """The boundary as a decimal string."""
        return str(boundary)

    def render(self, view_id: str, boundary: int) -> bytes:
        if view_id != VIEW_ID:
            raise DomainError.invalid(f"the arena has no view {view_id}")
        return _frame.render_frame(self.counter, boundary, self.width, self.height)

    def audio(self, stream_id: str, frames: int) -> bytes:
        if stream_id != STREAM_ID:
            raise DomainError.invalid(f"the arena has no audio stream {stream_id}")
        return self.source.chunk(self.counter, frames)

    def capture(self) -> bytes:
        return canonical({"format": CAPTURE_FORMAT, "counter": self.counter,
                          "audioPhase": self.source.phase})

    def restore(self, payload: bytes) -> None:
        """Install a `capture()`; all or nothing, `INCOMPATIBLE_STATE` when it does not fit."""
        try:
            doc = parse_strict(payload)
            if not isinstance(doc, dict) or set(doc) != {"format", "counter", "audioPhase"} \
                    or doc["format"] != CAPTURE_FORMAT:
                raise DomainError.invalid("not a counter-arena-v1 state")
            counter = parse_int(doc["counter"], "counter", -_SAFE_INT, _SAFE_INT)
            phase = parse_int(doc["audioPhase"], "audioPhase", 0, SAMPLE_RATE - 1)
        except DomainError as exc:
            raise DomainError.before("INCOMPATIBLE_STATE",
                                     f"counter arena state: {exc.message}") from None
        self.counter = counter
        self.source.phase = phase
