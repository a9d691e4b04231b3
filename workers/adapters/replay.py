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
from typing import Any

import numpy as np

__all__ = ["EpisodeLog", "Replayed", "StepResult", "observation_digest", "replay", "step_digest"]

#: `env.step`'s five dicts: observations, rewards, terminations, truncations, infos
StepResult = Sequence[Mapping[str, Any]]


def _feed(h: Any, value: Any) -> None:
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


def step_digest(result: StepResult) -> str:
    """The digest of a step's observations, rewards, terminations and truncations (not the
    infos, which are free-form)."""
    observations, rewards, terminations, truncations = result[:4]
    h = hashlib.sha256()
    for part in (observations, {k: np.float64(v) for k, v in rewards.items()},
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
