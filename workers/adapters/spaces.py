"""Gymnasium spaces as flyd values: observations as JSON, actions as port controls.

Why: a PettingZoo or Gymnasium environment speaks numpy values in `gymnasium.spaces`; flyd's
agents receive JSON (the world's inspection, as structured input) and act through a port's
buttons and axes. This module is the one place that translates, both ways, so the world (which
turns controls into actions) and the policy model (which turns actions into controls) agree.

Observations: a space is described as JSON (`describe`) and every observation is written as
JSON (`to_json`) and read back as the value the environment gave (`from_json`): a `Box`,
`MultiBinary` or `MultiDiscrete` value as a nested list (read back as a numpy array of the
space's dtype and shape), a `Discrete` one as an integer, `Dict` and `Tuple` recursively.
Floats must be finite.

Actions (`controller`, `to_action`, `to_intent`):
- `Discrete(n, start)` ↔ n buttons `a0`..`a<n-1>` (n ≤ 32): the action is `start + i` for
  the lowest pressed button `i`, and `start` when none is pressed; an action presses exactly
  its own button.
- `MultiBinary(shape)` ↔ one button per element, `b0`.. in row-major order (≤ 32).
- `Box` of a floating dtype with finite bounds ↔ one bipolar axis per element, `x0`.. in
  row-major order (≤ 16): axis value v ∈ [-1, 1] is the action `low + (v + 1)/2 · (high − low)`,
  neutral 0 (the middle of the box); an action maps back by the inverse. An action outside
  its space (a `Discrete` value out of range, a `Box` element outside its bounds) is refused.
- Every other action space (integer boxes, unbounded boxes, `MultiDiscrete`, `Dict`, `Tuple`,
  …) is `UNSUPPORTED`, refused when the world starts.
"""

from __future__ import annotations

import math
from typing import Any, Final

import numpy as np
from gymnasium import spaces

from workers.canonical import canonical, digest_bytes
from workers.datatypes import (
    AxisSpec,
    AxisValue,
    ButtonState,
    ControllerSchema,
    PortControl,
    SchemaRef,
    TypedValue,
)
from workers.domain import DomainError, parse_finite

MAX_BUTTONS: Final = 32
MAX_AXES: Final = 16


def adapter_schema(name: str, version: int = 1) -> SchemaRef:
    """A schema reference of the adapters, its digest taken of the name and version."""
    return SchemaRef(name, version, digest_bytes(f"flyd-adapter-schema\n{name}\n{version}\n"
                                                 .encode()))


INSPECTION: Final = adapter_schema("adapter.inspection.v1")
"""`{boundary, env, steps, done, agents: [{portId, agentId, envAgent, active, observation,
reward, terminated, truncated, observationSpace, actionSpace}]}`, agents in port order."""
CONTEXT: Final = adapter_schema("adapter.context.v1")
"""`{step}`: the boundary a decision is made at."""
PROGRESS: Final = adapter_schema("adapter.progress.v1")
EVENT: Final = adapter_schema("adapter.event.v1")
EPISODE: Final = adapter_schema("adapter.episode.v1")


def typed(ref: SchemaRef, value: Any) -> TypedValue:
    return TypedValue(ref, value)


def expect(value: TypedValue, ref: SchemaRef, what: str) -> Any:
    """The value of `value` when its schema is `ref`; `IDENTITY_MISMATCH` otherwise."""
    if value.schema != ref:
        raise DomainError.before("IDENTITY_MISMATCH", f"{what} is {value.schema.id}, not {ref.id}")
    return value.value


def unsupported(message: str) -> DomainError:
    return DomainError.before("UNSUPPORTED", message)


# ---------------------------------------------------------------------------------- describe

def describe(space: spaces.Space[Any], *, bounds: bool = False) -> dict[str, Any]:
    """The JSON description of a space (with a box's finite bounds when `bounds`)."""
    if isinstance(space, spaces.Discrete):
        return {"kind": "discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.Box):
        doc: dict[str, Any] = {"kind": "box", "shape": list(space.shape),
                               "dtype": str(space.dtype)}
        if bounds:
            low, high = space.low.ravel().tolist(), space.high.ravel().tolist()
            if not all(math.isfinite(v) for v in low + high):
                raise unsupported(f"a Box action space needs finite bounds; got {space}")
            doc["low"], doc["high"] = low, high
        return doc
    if isinstance(space, spaces.MultiBinary):
        return {"kind": "multi-binary", "shape": list(space.shape)}
    if isinstance(space, spaces.MultiDiscrete):
        return {"kind": "multi-discrete", "shape": list(space.shape), "dtype": str(space.dtype)}
    if isinstance(space, spaces.Dict):
        return {"kind": "dict", "spaces": {str(k): describe(s, bounds=bounds)
                                           for k, s in space.spaces.items()}}
    if isinstance(space, spaces.Tuple):
        return {"kind": "tuple", "spaces": [describe(s, bounds=bounds) for s in space.spaces]}
    raise unsupported(f"the space {space} is not supported (Discrete, Box, MultiBinary, "
                      "MultiDiscrete, Dict, Tuple are)")


# ---------------------------------------------------------------------------------- observations

def to_json(desc: dict[str, Any], value: Any) -> Any:
    """An observation of the described space as JSON (floats must be finite)."""
    kind = desc["kind"]
    if kind == "discrete":
        return int(value)
    if kind in ("box", "multi-binary", "multi-discrete"):
        array = np.asarray(value)
        if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
            raise DomainError.invalid("an observation holds a non-finite number")
        return array.tolist()
    if kind == "dict":
        return {k: to_json(d, value[k]) for k, d in desc["spaces"].items()}
    if kind == "tuple":
        return [to_json(d, v) for d, v in zip(desc["spaces"], value, strict=True)]
    raise DomainError.invalid(f"unknown space kind {kind!r}")


def from_json(desc: dict[str, Any], value: Any) -> Any:
    """The observation `to_json` wrote, as the environment gave it (numpy arrays of the
    space's dtype and shape, an integer for `Discrete`)."""
    kind = desc["kind"]
    if kind == "discrete":
        return np.int64(value)
    if kind == "box" or kind == "multi-discrete":
        return np.asarray(value, dtype=np.dtype(desc["dtype"])).reshape(desc["shape"])
    if kind == "multi-binary":
        return np.asarray(value, dtype=np.int8).reshape(desc["shape"])
    if kind == "dict":
        return {k: from_json(d, value[k]) for k, d in desc["spaces"].items()}
    if kind == "tuple":
        return tuple(from_json(d, v) for d, v in zip(desc["spaces"], value, strict=True))
    raise DomainError.invalid(f"unknown space kind {kind!r}")


# ---------------------------------------------------------------------------------- actions

def _size(desc: dict[str, Any]) -> int:
    return math.prod(int(n) for n in desc["shape"])


def controller(desc: dict[str, Any]) -> ControllerSchema:
    """The port's controls for an action space of this description (`UNSUPPORTED` else)."""
    ref = adapter_schema("adapter.controller.v1")
    ref = SchemaRef(ref.id, ref.version, digest_bytes(canonical({"ref": ref.digest,
                                                                 "space": desc})))
    kind = desc["kind"]
    if kind == "discrete":
        if not 1 <= desc["n"] <= MAX_BUTTONS:
            raise unsupported(f"a Discrete action space maps to at most {MAX_BUTTONS} buttons; "
                              f"this one has {desc['n']}")
        return ControllerSchema(ref, tuple(f"a{i}" for i in range(desc["n"])), ())
    if kind == "multi-binary":
        if not 1 <= _size(desc) <= MAX_BUTTONS:
            raise unsupported(f"a MultiBinary action space maps to at most {MAX_BUTTONS} "
                              f"buttons; this one has {_size(desc)}")
        return ControllerSchema(ref, tuple(f"b{i}" for i in range(_size(desc))), ())
    if kind == "box":
        if np.dtype(desc["dtype"]).kind != "f":
            raise unsupported(f"a Box action space must be of a floating dtype; got "
                              f"{desc['dtype']}")
        if not 1 <= _size(desc) <= MAX_AXES:
            raise unsupported(f"a Box action space maps to at most {MAX_AXES} axes; this one "
                              f"has {_size(desc)}")
        return ControllerSchema(ref, (), tuple(AxisSpec(f"x{i}", "bipolar", 0.0)
                                               for i in range(_size(desc))))
    raise unsupported(f"a {kind} action space is not supported (Discrete, MultiBinary and "
                      "bounded floating Box are)")


def to_action(desc: dict[str, Any], control: PortControl) -> Any:
    """The environment's action for a port's controls (checked against `controller(desc)`)."""
    kind = desc["kind"]
    if kind == "discrete":
        pressed = [i for i, b in enumerate(control.buttons) if b.down]
        return np.int64(desc["start"] + (pressed[0] if pressed else 0))
    if kind == "multi-binary":
        bits = [1 if b.down else 0 for b in control.buttons]
        return np.asarray(bits, dtype=np.int8).reshape(desc["shape"])
    low, high = desc["low"], desc["high"]
    values = [lo + (a.value + 1.0) / 2.0 * (hi - lo)
              for a, lo, hi in zip(control.axes, low, high, strict=True)]
    return np.asarray(values, dtype=np.dtype(desc["dtype"])).reshape(desc["shape"])


def to_intent(desc: dict[str, Any], action: Any) -> dict[str, Any]:
    """The controls `{buttons, axes}` that make the world take `action`."""
    kind = desc["kind"]
    if kind == "discrete":
        index = int(action) - desc["start"]
        if not 0 <= index < desc["n"]:
            raise DomainError.invalid(f"action {int(action)} lies outside Discrete("
                                      f"{desc['n']}, start={desc['start']})")
        return {"buttons": [{"id": f"a{i}", "down": i == index} for i in range(desc["n"])],
                "axes": []}
    if kind == "multi-binary":
        bits = np.asarray(action).ravel().tolist()
        if len(bits) != _size(desc):
            raise DomainError.invalid(f"a MultiBinary action has {_size(desc)} elements")
        return {"buttons": [{"id": f"b{i}", "down": bool(bit)} for i, bit in enumerate(bits)],
                "axes": []}
    values = np.asarray(action, dtype=np.float64).ravel().tolist()
    if len(values) != _size(desc):
        raise DomainError.invalid(f"a Box action has {_size(desc)} elements; got {len(values)}")
    axes = []
    for i, (value, lo, hi) in enumerate(zip(values, desc["low"], desc["high"], strict=True)):
        v = parse_finite(value, f"action[{i}]")
        if not lo <= v <= hi:
            raise DomainError.invalid(f"action[{i}] = {v} lies outside [{lo}, {hi}]")
        unit = 0.0 if hi == lo else 2.0 * (v - lo) / (hi - lo) - 1.0
        axes.append({"id": f"x{i}", "value": min(1.0, max(-1.0, unit))})
    return {"buttons": [], "axes": axes}


def space_text(desc: dict[str, Any]) -> str:
    """A described space as Gymnasium prints it, near enough to recognise it."""
    kind = desc["kind"]
    if kind == "discrete":
        return f"Discrete({desc['n']}, start={desc['start']})"
    if kind == "box":
        bounds = f"{min(desc['low'])}, {max(desc['high'])}, " if "low" in desc else ""
        return f"Box({bounds}{tuple(desc['shape'])}, {desc['dtype']})"
    if kind in ("multi-binary", "multi-discrete"):
        return f"{'MultiBinary' if kind == 'multi-binary' else 'MultiDiscrete'}" \
               f"({tuple(desc['shape'])})"
    return kind


def neutral(desc: dict[str, Any]) -> dict[str, Any]:
    """The controls of an agent that does not act: every button up, every axis at 0."""
    schema = controller(desc)
    return {"buttons": [ButtonState(b, False).to_json() for b in schema.buttons],
            "axes": [AxisValue(a.id, a.neutral).to_json() for a in schema.axes]}
