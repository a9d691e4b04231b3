"""An episode as its seed and actions, and its replay (docs/adapters.md, "Checkpoints").

Why: an env that cannot be pickled, or whose pickle does not continue exactly, can still be
recovered if it is deterministic given its seed and actions: rebuild it, reset it with the
episode's seed and apply the episode's actions again. `EpisodeLog` keeps what that takes, with
the digest of every step's result (observations, rewards, terminations, truncations), so the
replay checks each replayed step against the record and names the first that differs rather
than continuing from a diverged env.

`step_digest` is taken over the values the env returned (numpy arrays by dtype, shape and
bytes; dicts by sorted key; tuples in order; rewards as float64), not over their JSON, so it
sees every bit of an observation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

__all__ = ["EpisodeLog", "Replayed", "StepResult", "observation_digest", "replay", "step_digest"]

#: `env.step`'s five dicts: observations, rewards, terminations, truncations, infos
StepResult = Sequence[Mapping[str, Any]]


#: what `_feed`'s general rule writes before a float64 or a bool scalar (a 1-element array)
_F8: Final = f"{np.dtype(np.float64).str}(1,)".encode()
_B1: Final = f"{np.dtype(np.bool_).str}(1,)".encode()


def _feed(h: Any, value: Any) -> None:
    """Every bit of `value` into `h`. The leaves a step has most (a numeric array, a float64
    reward, a bool ending) take a short path that writes the bytes of the general rule (the
    value as a C-order array of at least one dimension) without building that array."""
    kind = type(value)
    if kind is np.ndarray and value.ndim and value.dtype.kind != "O":
        h.update(f"{value.dtype.str}{value.shape}".encode())
        h.update(value if value.flags.c_contiguous else np.ascontiguousarray(value))
        return
    if kind is np.float64:
        h.update(_F8 + value.tobytes())
        return
    if kind is bool:
        h.update(_B1 + (b"\x01" if value else b"\x00"))
        return
    if isinstance(value, Mapping):
        h.update(b"{")
        for key in sorted(value, key=str):
            h.update(str(key).encode() + b":")
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, tuple | list):
        h.update(b"(")
        for item in value:
            _feed(h, item)
        h.update(b")")
    else:
        array = np.ascontiguousarray(np.asarray(value))
        h.update(f"{array.dtype.str}{array.shape}".encode())
        h.update(array.tobytes() if array.dtype.kind != "O" else repr(value).encode())


def observation_digest(value: Any) -> str:
    """The digest of one observation as the env gave it (every bit of its arrays)."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def step_digest(result: StepResult, observed: Mapping[Any, str] | None = None) -> str:
    """The digest of a step's observations (each agent's `observation_digest`: `observed`
    when the caller took them already, so a step's observations are hashed once), rewards,
    terminations and truncations (not the infos, which are free-form)."""
    observations, rewards, terminations, truncations = result[:4]
    if observed is None:
        observed = {k: observation_digest(v) for k, v in observations.items()}
    h = hashlib.sha256()
    for key in sorted(observed, key=str):
        h.update(f"{key}:{observed[key]}\n".encode())
    for part in ({k: np.float64(v) for k, v in rewards.items()},
                 {k: bool(v) for k, v in terminations.items()},
                 {k: bool(v) for k, v in truncations.items()}):
        _feed(h, part)
    return h.hexdigest()


@dataclass
class EpisodeLog:
    """The episode so far: the seed of its reset, then each step's actions and digest."""

    seed: int
    actions: list[dict[str, Any]] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)

    def record(self, actions: Mapping[str, Any], digest: str) -> None:
        self.actions.append(dict(actions))
        self.digests.append(digest)

    def copy(self) -> EpisodeLog:
        return EpisodeLog(self.seed, list(self.actions), list(self.digests))


@dataclass(frozen=True)
class Replayed:
    """A replay's end: `diverged` is the first step (1-based) whose result differs from the
    record, `None` when every step matched."""

    steps: int
    diverged: int | None
    reason: str = ""


def replay(env: Any, log: EpisodeLog) -> Replayed:
    """Reset `env` with the log's seed and apply its actions, checking every step."""
    env.reset(seed=log.seed)
    for index, (actions, digest) in enumerate(zip(log.actions, log.digests, strict=True)):
        try:
            result = env.step(dict(actions))
        except Exception as exc:
            return Replayed(index, index + 1, f"step {index + 1} raised "
                                              f"{type(exc).__name__}: {exc}")
        if step_digest(result) != digest:
            return Replayed(index, index + 1, f"step {index + 1}'s result differs from the "
                                              "recorded one")
    return Replayed(len(log.actions), None)
