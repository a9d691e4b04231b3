"""An environment's whole state as bytes: a pickle that bypasses `EzPickle` (docs/adapters.md).

Why: most Gymnasium and PettingZoo environments inherit `gymnasium.utils.EzPickle`, whose
pickle holds only the constructor's arguments: unpickled, such an env is a fresh, never-reset
one. A checkpoint needs the env as it is now, so `dumps` reduces every `EzPickle` instance by
its own `__dict__` (the way `object.__reduce_ex__` would without EzPickle's `__getstate__`)
and `loads` installs that dict back without calling EzPickle's `__setstate__` (which would
build a fresh env). Everything the env holds goes with it: its positions, its step counters and
its random generators (`np_random`, numpy `Generator`s), MuJoCo's `MjModel`/`MjData` (which
pickle their full state).

Render caches are not state: a MuJoCo renderer (`MujocoRenderer`) keeps its model and data
and drops its open viewers (OpenGL contexts, which cannot be pickled and belong to the thread
that made them); the restored env opens new ones at its first render.

An object that cannot be pickled (a lock, an open file, a simulator handle, a lambda) makes
`dumps` raise `Unpicklable` with the reason, which the world turns into its `restore` policy's
answer (replay in `auto`, a run that fails at once in `snapshot`).
"""

from __future__ import annotations

import copyreg
import io
import pickle
from typing import Any, Final

from gymnasium.utils.ezpickle import EzPickle

__all__ = ["Unpicklable", "dumps", "install_state", "loads"]

#: attributes of render helpers that hold per-thread resources, and their empty values
_TRANSIENT: Final[dict[str, dict[str, Any]]] = {
    "gymnasium.envs.mujoco.mujoco_rendering.MujocoRenderer": {"_viewers": {}, "viewer": None},
}


class Unpicklable(Exception):
    """The env holds something pickle cannot write; the message says what."""


def install_state(obj: Any, state: dict[str, Any]) -> None:
    """The state setter of a reduced object: its `__dict__` back, no `__setstate__` call."""
    obj.__dict__.update(state)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class _EnvPickler(pickle.Pickler):
    """A pickler that writes `EzPickle` instances and render helpers by their own state."""

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        transient = _TRANSIENT.get(_qualified(cls))
        if transient is None and not isinstance(obj, EzPickle):
            return NotImplemented
        if isinstance(obj, type) or not hasattr(obj, "__dict__"):
            return NotImplemented
        state = dict(obj.__dict__)
        if transient is not None:
            state.update({k: type(v)() if isinstance(v, dict) else v
                          for k, v in transient.items()})
        new = copyreg.__newobj__  # type: ignore[attr-defined]
        return new, (cls,), state, None, None, install_state


def dumps(env: Any) -> bytes:
    """The env's whole state (`Unpicklable` naming the reason when it cannot be written)."""
    buffer = io.BytesIO()
    try:
        _EnvPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(env)
    except Exception as exc:  # an object's own __reduce__/__getstate__ may raise anything
        raise Unpicklable(f"{type(exc).__name__}: {exc}") from None
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """The env `dumps` wrote, as it was (only ever bytes this node wrote: it is a pickle)."""
    return pickle.loads(data)
