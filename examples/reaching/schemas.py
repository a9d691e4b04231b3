"""The schemas of the reaching composition: one `SchemaRef` per typed value it exchanges.

Why: every typed value names its schema by id, version and digest, and receivers compare the
whole reference. The digest identifies the schema's text; these schemas are defined by this
package's docstrings, so the digest is taken of the name and version, which is stable across
installs without shipping schema files.
"""

from __future__ import annotations

import math
from typing import Any, Final

from workers.types.canonical import digest_bytes
from workers.types.datatypes import SchemaRef, TypedValue
from workers.types.domain import DomainError, parse_finite


def schema(name: str, version: int = 1) -> SchemaRef:
    return SchemaRef(name, version, digest_bytes(f"reaching-schema\n{name}\n{version}\n".encode()))


INSPECTION: Final = schema("reaching.inspection.v1")
"""`{boundary, points: [{portId, agentId, position: [x, y], goal: [x, y], reached}]}`, points in
port order."""
CONTROLLER: Final = schema("reaching.controller.v1")
"""Two bipolar axes, `dx` and `dy`; no buttons."""
DECISION: Final = schema("reaching.decision.v1")
"""`{direction: [x, y], throttle: 0..1}`."""
CONTEXT: Final = schema("reaching.context.v1")
"""`{step}`: the boundary the decision is made at."""
PROGRESS: Final = schema("reaching.progress.v1")
"""`{counter, transitions, reached: {agentId: n}, totalReward}`; `counter` is the goals reached
by all agents (the `counter` of `flyd run`'s summary)."""
EVENT: Final = schema("reaching.event.v1")
EPISODE: Final = schema("reaching.episode.v1")


def typed(ref: SchemaRef, value: Any) -> TypedValue:
    return TypedValue(ref, value)


def expect(value: TypedValue, ref: SchemaRef, what: str) -> Any:
    """The value of `value` when its schema is `ref`; `IDENTITY_MISMATCH` otherwise."""
    if value.schema != ref:
        raise DomainError.before("IDENTITY_MISMATCH", f"{what} is {value.schema.id}, not {ref.id}")
    return value.value


def point(value: Any, what: str) -> tuple[float, float]:
    """An `[x, y]` pair of finite numbers."""
    if not isinstance(value, list) or len(value) != 2:
        raise DomainError.invalid(f"{what} must be [x, y]")
    return parse_finite(value[0], f"{what}[0]"), parse_finite(value[1], f"{what}[1]")


def distance(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Euclidean distance with `+ - * /` and `sqrt` only: correctly rounded everywhere."""
    dx, dy = a[0] - b[0], a[1] - b[1]
    return math.sqrt(dx * dx + dy * dy)


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
