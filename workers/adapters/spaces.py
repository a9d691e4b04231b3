"""Gymnasium spaces as flyd values: observations as binary arrays, actions as port controls.

Why: a PettingZoo or Gymnasium environment speaks numpy values in `gymnasium.spaces`; flyd's
agents receive a structured value (JSON) with binary arrays beside it and act through a port's
buttons and axes. This module is the one place that translates, both ways, so the world (which
turns controls into actions) and the policy model (which turns actions into controls) agree.

Spaces are described as JSON once (`describe`, sent to each agent at bootstrap) and rebuilt
as gymnasium spaces on the agent's side (`to_space`).

Observations (`encode_observation`, `decode_observation`): every `Box`, `MultiBinary` and
`MultiDiscrete` leaf travels as one binary array (numpy's dtype string, shape, C-order bytes;
`workers.types.datatypes.ArrayValue`), named in the structured value as `{"array": "o<i>", "digest":
<SHA-256 of its bytes>}` (leaves numbered in order, `Dict` keys in the space's order); a
`Discrete` leaf is a JSON integer; `Dict` and `Tuple` recursively. No number of an array is
written as JSON, so an observation's size is bounded by the transport, not by the 32 KiB of a
typed value. The agent reads each array back as a read-only numpy array of the space's dtype
and shape.

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

import hashlib
import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
from gymnasium import spaces

from workers.protocols import AgentArray, DecodedArray
from workers.types.canonical import canonical, digest_bytes
from workers.types.datatypes import (
    AxisSpec,
    AxisValue,
    ButtonState,
    ControllerSchema,
    PortControl,
    SchemaRef,
    TypedValue,
)
from workers.types.domain import DomainError, parse_finite

MAX_BUTTONS: Final = 32
MAX_AXES: Final = 16
#: an observation box's bounds listed per element up to this many (beyond, and not uniform,
#: they are sent as unbounded: the bootstrap input stays a small typed value)
MAX_BOUNDS: Final = 256


def adapter_schema(name: str, version: int = 1) -> SchemaRef:
    """A schema reference of the adapters, its digest taken of the name and version."""
    return SchemaRef(name, version, digest_bytes(f"flyd-adapter-schema\n{name}\n{version}\n"
                                                 .encode()))


INSPECTION: Final = adapter_schema("adapter.inspection.v2")
"""The task's view of a boundary: `{boundary, env, steps, episode, episodesDone, done,
agentIds, active, rewards, terminated, truncated, observationDigests}`, each of the last six a
list by port, in port order (columns, so a key is not repeated per agent).
No observations, only their digests (`workers.adapters.replay.observation_digest`, which the
task's reward events carry into a run's export): the observations go to each agent alone
(`INPUT`)."""
INPUT: Final = adapter_schema("adapter.input.v1")
"""One agent's structured input: `{step, episode, active, done, reward, terminated, truncated,
observation}` (`observation` as `encode_observation` writes it) and, at boundary 0 only,
`spaces: {agent, observation, action}` (the env's name of the agent and its spaces)."""
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

def _bound(values: Any) -> Any:
    """A box bound as JSON: one number when uniform, else the flat list; None for ±inf."""
    flat = [None if not math.isfinite(v) else v for v in np.asarray(values).ravel().tolist()]
    if len(set(flat)) == 1:
        return flat[0]
    return flat if len(flat) <= MAX_BOUNDS else None


def describe(space: spaces.Space[Any], *, bounds: bool = False) -> dict[str, Any]:
    """The JSON description of a space. With `bounds` (an action space) a box's bounds must be
    finite and are listed per element; otherwise they are one number when uniform (a pixel
    box's 0..255), the flat list else, null for an infinite one."""
    if isinstance(space, spaces.Discrete):
        return {"kind": "discrete", "n": int(space.n), "start": int(space.start)}
    if isinstance(space, spaces.Box):
        dtype = np.dtype(space.dtype)
        if _DTYPE_KINDS.get(dtype.kind) is None:
            raise unsupported(f"a Box of dtype {dtype} is not supported (bool, int, uint, "
                              "float are)")
        doc: dict[str, Any] = {"kind": "box", "shape": list(space.shape), "dtype": dtype.str}
        if bounds:
            low, high = space.low.ravel().tolist(), space.high.ravel().tolist()
            if not all(math.isfinite(v) for v in low + high):
                raise unsupported(f"a Box action space needs finite bounds; got {space}")
            doc["low"], doc["high"] = low, high
        else:
            doc["low"], doc["high"] = _bound(space.low), _bound(space.high)
        return doc
    if isinstance(space, spaces.MultiBinary):
        return {"kind": "multi-binary", "shape": list(space.shape)}
    if isinstance(space, spaces.MultiDiscrete):
        return {"kind": "multi-discrete", "shape": list(space.shape),
                "dtype": np.dtype(space.dtype).str, "nvec": np.asarray(space.nvec).ravel()
                .tolist()}
    if isinstance(space, spaces.Dict):
        return {"kind": "dict", "spaces": [[str(k), describe(s, bounds=bounds)]
                                           for k, s in space.spaces.items()]}
    if isinstance(space, spaces.Tuple):
        return {"kind": "tuple", "spaces": [describe(s, bounds=bounds) for s in space.spaces]}
    raise unsupported(f"the space {space} is not supported (Discrete, Box, MultiBinary, "
                      "MultiDiscrete, Dict, Tuple are)")


_DTYPE_KINDS: Final = {"b": "bool", "i": "int", "u": "uint", "f": "float"}


def _unbound(value: Any, default: float, shape: list[int]) -> Any:
    if isinstance(value, list):
        return np.asarray([default if v is None else v for v in value]).reshape(shape)
    return default if value is None else value


def to_space(desc: dict[str, Any]) -> spaces.Space[Any]:
    """The gymnasium space `describe` described (a policy's `spaces`)."""
    kind = desc["kind"]
    if kind == "discrete":
        return spaces.Discrete(desc["n"], start=desc["start"])
    if kind == "box":
        shape = list(desc["shape"])
        return spaces.Box(_unbound(desc["low"], -np.inf, shape),
                          _unbound(desc["high"], np.inf, shape), tuple(shape),
                          np.dtype(desc["dtype"]))
    if kind == "multi-binary":
        return spaces.MultiBinary(desc["shape"])
    if kind == "multi-discrete":
        return spaces.MultiDiscrete(np.asarray(desc["nvec"]).reshape(desc["shape"]),
                                    dtype=np.dtype(desc["dtype"]))
    if kind == "dict":
        return spaces.Dict({k: to_space(d) for k, d in desc["spaces"]})
    if kind == "tuple":
        return spaces.Tuple([to_space(d) for d in desc["spaces"]])
    raise DomainError.invalid(f"unknown space kind {kind!r}")


# ---------------------------------------------------------------------------------- observations

def _leaf_dtype(desc: dict[str, Any]) -> np.dtype[Any]:
    return np.dtype(np.int8) if desc["kind"] == "multi-binary" else np.dtype(desc["dtype"])


def encode_observation(desc: dict[str, Any], value: Any) -> tuple[Any, list[AgentArray]]:
    """An observation of the described space: its structured JSON and its binary arrays."""
    arrays: list[AgentArray] = []

    def walk(d: dict[str, Any], v: Any) -> Any:
        kind = d["kind"]
        if kind == "discrete":
            return int(v)
        if kind in ("box", "multi-binary", "multi-discrete"):
            array = np.ascontiguousarray(v, dtype=_leaf_dtype(d))
            if list(array.shape) != list(d["shape"]):
                raise DomainError.invalid(f"an observation of shape {list(array.shape)} does "
                                          f"not fit its space's {d['shape']}")
            data = array.tobytes()
            ident = f"o{len(arrays)}"
            digest = hashlib.sha256(data).hexdigest()
            arrays.append(AgentArray(ident, array.dtype.str, tuple(array.shape), data, digest))
            return {"array": ident, "digest": digest}
        if kind == "dict":
            return {k: walk(sub, v[k]) for k, sub in d["spaces"]}
        if kind == "tuple":
            return [walk(sub, item) for sub, item in zip(d["spaces"], v, strict=True)]
        raise DomainError.invalid(f"unknown space kind {kind!r}")

    return walk(desc, value), arrays


def decode_observation(desc: dict[str, Any], value: Any,
                       arrays: Mapping[str, DecodedArray]) -> Any:
    """The observation `encode_observation` wrote, as the environment gave it (read-only
    numpy arrays of the space's dtype and shape, a `numpy.int64` for `Discrete`)."""
    kind = desc["kind"]
    if kind == "discrete":
        return np.int64(value)
    if kind in ("box", "multi-binary", "multi-discrete"):
        found = arrays.get(str(value.get("array"))) if isinstance(value, dict) else None
        if found is None or np.dtype(found.dtype) != _leaf_dtype(desc) \
                or list(found.shape) != list(desc["shape"]):
            raise DomainError.invalid(f"the input has no array {value!r} of dtype "
                                      f"{_leaf_dtype(desc).str} and shape {desc['shape']}")
        return np.frombuffer(found.data, dtype=found.dtype).reshape(found.shape)
    if kind == "dict":
        return {k: decode_observation(d, value[k], arrays) for k, d in desc["spaces"]}
    if kind == "tuple":
        return tuple(decode_observation(d, v, arrays)
                     for d, v in zip(desc["spaces"], value, strict=True))
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


def space_text(desc: Mapping[str, Any]) -> str:
    """A described space as Gymnasium prints it, near enough to recognise it."""
    kind = str(desc["kind"])
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
