"""How an adapter world checkpoints and recovers its env: `restore: auto | snapshot | replay`
(docs/adapters.md, "Checkpoints and recovery").

Why: a checkpoint is worth something only if the env restored from it continues exactly as
the env that wrote it would have. Two ways get there, and neither fits every env:

- **snapshot**: the env's whole state, pickled (`workers.adapters.snapshot`). Fast to restore
  at any length of episode, but only exact if everything the env's future depends on is in its
  pickle (not a native simulator that re-seeds itself, not global random state).
- **replay**: the episode's seed and actions (`workers.adapters.replay`); the restore rebuilds
  the env from the world's config, resets it with that seed and applies the actions again,
  checking every replayed step's digest against the record. Exact for any env that is
  deterministic given its seed and actions, pickled or not; its cost grows with the episode.

`auto` (the default) tries the snapshot and checks it: at the first capture it pickles the env
and unpickles the bytes into a second env (the *twin*), then steps the twin with the live env's
actions for the next `CHECK_STEPS` steps and compares their results. Equal every time, the env
is trusted and later captures are snapshots; a difference, a twin that raises, or an env that
cannot be pickled makes the world replay from then on. Until the check has passed a capture
restores by replay, so no checkpoint ever depends on an unchecked snapshot. A trusted snapshot
keeps the episode's record beside it, and for a world that rendered at the capture's boundary,
the digest of that frame: a snapshot restored in another process whose render differs (an env
whose state depends on its process) is dropped and the episode replayed instead. (A capture at
a boundary the world does not render at, `render_every`, holds no frame digest: the check is
skipped rather than rendering the env once more.)
`snapshot` skips the check and never replays: an env that cannot be pickled is refused when
the world starts (a run that could never be checkpointed fails at once, naming the world), and
a restored env that diverges is left to the coordinator's restore verification
(`RESTORE_DIVERGED`). `replay` never pickles the env.

The policy's state (which way it is, the record, the twin) is bookkeeping of the world, not
behaviour: the checks step only the twin, never the live env. Every call into an env made here
runs on the world's env thread (the world calls these methods there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Literal

import structlog

from workers.adapters.replay import EpisodeLog, StepResult, replay, step_digest
from workers.adapters.snapshot import Unpicklable, dumps, loads
from workers.types.domain import DomainError, ErrorCode

__all__ = ["CHECK_STEPS", "RESTORE_MODES", "EnvRecovery"]

logger = structlog.get_logger("workers.adapters.recovery")

RESTORE_MODES: Final = ("auto", "snapshot", "replay")
#: steps the twin of the first capture is compared over
CHECK_STEPS: Final = 3

State = Literal["unchecked", "checking", "snapshot", "replay"]
#: the digest of what an env renders now (None for a world without a view)
Picture = Callable[[Any], str] | None


class EnvRecovery:
    """One world's restore policy; `what` names the world and env in every message."""

    def __init__(self, mode: str, what: str) -> None:
        if mode not in RESTORE_MODES:
            raise DomainError.invalid(f"{what}: world config restore must be one of "
                                      f"{', '.join(RESTORE_MODES)}; got {mode!r}")
        self.mode = mode
        self.what = what
        self.state: State = {"auto": "unchecked", "snapshot": "snapshot",
                             "replay": "replay"}[mode]  # type: ignore[assignment]
        self.log: EpisodeLog | None = None
        self.twin: Any = None
        self.twin_steps = 0
        #: why the world replays (empty while it does not)
        self.reason = ""

    # ------------------------------------------------------------------ the run

    def admit(self, env: Any) -> None:
        """`snapshot` refuses an env that cannot be pickled when the world starts: every run
        ends with a capture, so such a run could never succeed."""
        if self.mode != "snapshot":
            return
        try:
            dumps(env)
        except Unpicklable as exc:
            raise DomainError.invalid(
                f"{self.what} cannot be pickled ({exc}), so restore: snapshot cannot "
                "checkpoint it: set restore to auto or replay in the world config to recover "
                "it by replaying its actions") from None

    def keeps_log(self) -> bool:
        return self.mode != "snapshot"

    def reset(self, seed: int) -> None:
        """A new episode: a new record; a check in progress starts again at the next
        capture (the twin belongs to the old episode)."""
        self.log = EpisodeLog(seed) if self.keeps_log() else None
        if self.state == "checking":
            self.state, self.twin = "unchecked", None

    def stepped(self, actions: Mapping[str, Any], result: StepResult,
                observed: Mapping[Any, str]) -> None:
        """The live env stepped with `actions` and returned `result`, whose observations'
        digests are `observed`."""
        digest = step_digest(result, observed) \
            if self.log is not None or self.twin is not None else ""
        if self.log is not None:
            self.log.record(actions, digest)
        if self.state != "checking":
            return
        try:
            twin = self.twin.step(dict(actions))
        except Exception as exc:
            self._replay_from_now(f"its restored copy raised {type(exc).__name__} in a step")
            return
        if step_digest(twin) != digest:
            self._replay_from_now(f"its restored copy diverged {self.twin_steps + 1} step(s) "
                                  "after the first capture")
            return
        self.twin_steps += 1
        if self.twin_steps >= CHECK_STEPS:
            self.state, self.twin = "snapshot", None
            logger.info("adapter.snapshot_trusted", world=self.what, steps=CHECK_STEPS)

    def _replay_from_now(self, reason: str) -> None:
        self.state, self.twin, self.reason = "replay", None, reason
        logger.warning("adapter.replaying", world=self.what, reason=reason)

    # ------------------------------------------------------------------ checkpoints

    def capture(self, env: Any, drawn: Callable[[], str | None]) -> dict[str, Any]:
        """The env's part of a world capture: `{state, env: snapshot bytes | None, log,
        frame: the digest of the env's render | None}`; `drawn()` is the digest of what the
        env rendered at this boundary, None when it drew nothing here (it is not rendered
        again for the capture: a world renders only at the boundaries its config keeps)."""
        snapshot: bytes | None = None
        if self.state in ("unchecked", "snapshot"):
            try:
                snapshot = dumps(env)
            except Unpicklable as exc:
                if self.mode == "snapshot":
                    raise DomainError.before(
                        ErrorCode.UNSUPPORTED,
                        f"{self.what} cannot be pickled ({exc}), so restore: snapshot cannot "
                        "checkpoint it: set restore to auto or replay") from None
                self._replay_from_now(f"it cannot be pickled ({exc})")
        if self.state == "unchecked" and snapshot is not None:
            try:
                self.twin, self.twin_steps, self.state = loads(snapshot), 0, "checking"
            except Exception as exc:
                self._replay_from_now(f"its pickle does not load ({type(exc).__name__})")
        log = None if self.log is None else self.log.copy()
        if self.state == "snapshot":
            frame = drawn() if log is not None else None
            return {"state": "snapshot", "env": snapshot, "log": log, "frame": frame}
        assert log is not None, "a world that replays keeps its episode's record"
        return {"state": self.state, "env": None, "log": log, "frame": None}

    def restore(self, part: Mapping[str, Any], env: Any, picture: Picture) -> Any:
        """The env of a capture's part: unpickled, or `env` (freshly built) replayed. Raises
        `RESTORE_DIVERGED` naming the first step that replays differently: the checkpoint is
        sound, the env did not come back (design/session.md §6.12, the world's own verification)."""
        state, snapshot, log = part["state"], part["env"], part["log"]
        if state == "snapshot":
            restored = loads(snapshot)
            self.twin = None
            frame = part["frame"]
            if frame is None or picture is None or picture(restored) == frame:
                self.state = "snapshot"
                self.log = None if log is None else log.copy()
                return restored
            close = getattr(restored, "close", None)
            if callable(close):
                close()
            self.reason = "its snapshot rendered another picture once restored"
            logger.warning("adapter.replaying", world=self.what, reason=self.reason)
            state = "replay"
        if not isinstance(log, EpisodeLog):
            raise DomainError.before(ErrorCode.INCOMPATIBLE_STATE,
                                     f"{self.what}: the capture holds no episode record")
        done = replay(env, log)
        if done.diverged is not None:
            raise DomainError.before(
                ErrorCode.RESTORE_DIVERGED,
                f"{self.what} did not replay its episode: {done.reason}; the env is not "
                "deterministic given its seed and actions, so it cannot be recovered")
        self.log, self.twin = log.copy(), None
        self.state = "replay" if state == "replay" else "unchecked"
        return env
