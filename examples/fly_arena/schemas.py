"""The schemas of the fly-arena composition and the small parsing helpers its pieces share.

Why: every typed value names its schema by id, version and digest, and receivers compare the
whole reference. These schemas are defined by this package's docstrings, so the digest is taken
of the name and version, which is stable across installs without shipping schema files.
"""

from __future__ import annotations

from typing import Any, Final

from workers.types.canonical import digest_bytes
from workers.types.datatypes import SchemaRef, TypedValue
from workers.types.domain import DomainError, parse_finite


def schema(name: str, version: int = 1) -> SchemaRef:
    return SchemaRef(name, version, digest_bytes(f"fly-arena-schema\n{name}\n{version}\n".encode()))


INSPECTION: Final = schema("fly.inspection.v1")
"""`{boundary, source: [x, y], radius, flies: [{portId, agentId, position: [x, y],
heading: [hx, hy], reached}]}`, flies in port order (the rows of the `eyes` view)."""
CONTROLLER: Final = schema("fly.controller.v1")
"""Two axes: `turn` (bipolar, + is counter-clockwise) and `speed` (unipolar); no buttons."""
DECISION: Final = schema("fly.decision.v1")
"""`{turn: -1..1, speed: 0..1}`."""
CONTEXT: Final = schema("fly.context.v1")
"""`{step}`: the boundary the decision is made at."""
PROGRESS: Final = schema("fly.progress.v1")
"""`{counter, transitions, reached: {agentId: n}, totalReward}`; `counter` is the visits to the
source by all flies (the `counter` of `flyd run`'s summary)."""
EVENT: Final = schema("fly.event.v1")
EPISODE: Final = schema("fly.episode.v1")


def typed(ref: SchemaRef, value: Any) -> TypedValue:
    return TypedValue(ref, value)


def expect(value: TypedValue, ref: SchemaRef, what: str) -> Any:
    """The value of `value` when its schema is `ref`; `IDENTITY_MISMATCH` otherwise."""
    if value.schema != ref:
        raise DomainError.before("IDENTITY_MISMATCH", f"{what} is {value.schema.id}, not {ref.id}")
    return value.value


def pair(value: Any, what: str) -> tuple[float, float]:
    """An `[x, y]` pair of finite numbers."""
    if not isinstance(value, list) or len(value) != 2:
        raise DomainError.invalid(f"{what} must be [x, y]")
    return parse_finite(value[0], f"{what}[0]"), parse_finite(value[1], f"{what}[1]")


def settings(config: Any, what: str, defaults: dict[str, tuple[float, float, float]]
             ) -> dict[str, float]:
    """A plugin config: every key one of `defaults` (`key: (default, low, high)`), every value a
    number in `[low, high]`. A misspelt key is refused, never silently ignored."""
    if not isinstance(config, dict):
        raise DomainError.invalid(f"{what} config must be an object")
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise DomainError.invalid(f"{what} config key {unknown[0]!r} is not one of "
                                  f"{', '.join(sorted(defaults))}")
    out: dict[str, float] = {}
    for key, (default, low, high) in defaults.items():
        value = parse_finite(config.get(key, default), f"{what} config {key}")
        if not low <= value <= high:
            raise DomainError.invalid(f"{what} config {key} must be in [{low:g}, {high:g}]; "
                                      f"got {value:g}")
        out[key] = value
    return out


def integral(values: dict[str, float], key: str, what: str) -> int:
    """A setting that must be a whole number."""
    if not values[key].is_integer():
        raise DomainError.invalid(f"{what} config {key} must be an integer")
    return int(values[key])
