"""The fence's pure part and `SessionFailure` (design/session.md §6.3). Pure, synchronous, no I/O.

Why: once an epoch failed, nothing may step, bootstrap, capture or publish until a coherent group
restore installs a new epoch; a half-committed transition must never be continued. The
coordinator's call engine (`flyd/session/calls.py`) runs `CallEngine.fail` (clearing its caches,
auditing, raising); what can be decided without I/O lives here, so the coordinator and its tests say
it one way:

- `SessionFailure(error, phase, detail, participant)`: the exception every failed epoch raises
  and `last_failure` keeps; `str()` = `"<detail> at <phase> (<participant>): <CODE>:
  <message>"`, the parenthesis omitted without a participant; `audit_entry` = `fail:<detail>` or
  `fail:<detail>:<participant>`.
- `fenced_refusal(phase)`: what `step()`, `bootstrap()` and `capture()` raise while fenced:
  `INVALID_PHASE`/`none`, `FENCED_MESSAGE`, detail `fenced`, no participant (and the caller
  touches neither the phase nor the audit). `refuse_if_fenced(machine)` raises it.
- `check_replacement(machine, worker_id)`: `replace_participant` is allowed only while fenced or at
  a `Ready(0)` that never started a transition, else `INVALID_PHASE`/`none`.

Whether the fence is closed is `PhaseMachine.fenced` (`flyd.session.phase`): `fail()` closes it
and only the `Restoring(k) -> Paused(k)` edge lifts it, so it cannot disagree with the phase.

Resolved ambiguities:
- `phase` is the remembered *label* (`"Committing(1)"`), as design/session.md §6.3 step 1 says; it
  must be a well-formed label.
- `detail` is one of the fixed values of design/session.md §6.3 (`Detail`) or a domain method name
  (the failed worker call); anything else is a flyd bug (`DomainError` `INTERNAL`/`none`), as is a
  participant that is not an `Id` (`coordinator` is one, design/state.md §7.3).
- A `SessionFailure` is a value like `DomainError`: equal when its four fields are equal.
- The refusal of `check_replacement` is not worded by the spec; it names the worker and the
  phase: `"replace_participant(<id>) needs a fenced epoch or an unstepped Ready(0); the session is
  <label>"`.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Final

from flyd.session.phase import Phase, PhaseMachine, PhaseName
from workers.dedup import METHOD_CLASSES
from workers.types.domain import DomainError, ErrorCode, Mutation, is_id

__all__ = [
    "FENCED_MESSAGE",
    "Detail",
    "SessionFailure",
    "check_replacement",
    "fenced_refusal",
    "refuse_if_fenced",
]

FENCED_MESSAGE: Final = "the epoch is fenced; only a coherent restore resumes play"


class Detail(StrEnum):
    """The fixed failure details of design/session.md §6.3; a failed worker call uses its method
    name instead."""

    COMMIT = "commit"
    ACKNOWLEDGE = "acknowledge"
    PORT_ASSIGNMENT = "port-assignment"
    TASK_BOOTSTRAP = "task-bootstrap"
    APPLY = "apply"
    OBSERVATION = "observation"
    TASK_EVALUATE = "task-evaluate"
    PUBLISH = "publish"
    STEP = "step"
    EPISODE = "episode"
    RESUME = "resume"
    HEALTH = "health"
    FENCED = "fenced"
    ROUTER = "router"
    CAPTURE = "capture"
    RESTORE = "restore"


_DETAILS: Final[frozenset[str]] = frozenset(Detail) | frozenset(METHOD_CLASSES)

_NO_STEP = "|".join(re.escape(n.value) for n in (PhaseName.STARTING, PhaseName.FAILED))
_STEPPED = "|".join(
    re.escape(n.value) for n in PhaseName if n not in (PhaseName.STARTING, PhaseName.FAILED)
)
_LABEL: Final = re.compile(rf"(?:{_NO_STEP})|(?:{_STEPPED})\((?:0|[1-9][0-9]*)\)")


def _bug(message: str) -> DomainError:
    return DomainError(ErrorCode.INTERNAL, message, Mutation.NONE)


class SessionFailure(Exception):
    """A failed epoch: the error, the phase it failed at, what failed, and whom it blames."""

    __slots__ = ("detail", "error", "participant", "phase")

    def __init__(
        self, error: DomainError, phase: str, detail: str, participant: str | None = None
    ) -> None:
        if not isinstance(error, DomainError):
            raise _bug(f"a session failure needs a DomainError; got {error!r}")
        if not isinstance(phase, str) or _LABEL.fullmatch(phase) is None:
            raise _bug(f"a session failure names a phase label; got {phase!r}")
        if detail not in _DETAILS:
            raise _bug(f"{detail!r} is not a failure detail (design/session.md §6.3) or a domain "
                       f"method")
        if participant is not None and not is_id(participant):
            raise _bug(f"a failure's participant is a worker id; got {participant!r}")
        self.error = error
        self.phase = phase
        self.detail = str(detail)
        self.participant = participant
        super().__init__(error, phase, self.detail, participant)

    @property
    def code(self) -> ErrorCode:
        return self.error.code

    @property
    def mutation(self) -> Mutation:
        return self.error.mutation

    @property
    def message(self) -> str:
        return self.error.message

    @property
    def audit_entry(self) -> str:
        """The audit string `CallEngine.fail` appends: `fail:<detail>[:<participant>]`."""
        if self.participant is None:
            return f"fail:{self.detail}"
        return f"fail:{self.detail}:{self.participant}"

    def __str__(self) -> str:
        blamed = "" if self.participant is None else f" ({self.participant})"
        return f"{self.detail} at {self.phase}{blamed}: {self.error.code}: {self.error.message}"

    def __repr__(self) -> str:
        return (
            f"SessionFailure({self.error!r}, {self.phase!r}, {self.detail!r}, "
            f"{self.participant!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SessionFailure):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def _fields(self) -> tuple[DomainError, str, str, str | None]:
        return (self.error, self.phase, self.detail, self.participant)


def fenced_refusal(phase: Phase) -> SessionFailure:
    """What a fenced session answers to `step()`, `bootstrap()` and `capture()`."""
    error = DomainError(ErrorCode.INVALID_PHASE, FENCED_MESSAGE, Mutation.NONE)
    return SessionFailure(error, phase.label, Detail.FENCED)


def refuse_if_fenced(machine: PhaseMachine) -> None:
    """Raise `fenced_refusal` while the fence is closed; touch nothing."""
    if machine.fenced:
        raise fenced_refusal(machine.phase)


def check_replacement(machine: PhaseMachine, worker_id: str) -> None:
    """`replace_participant` needs a closed fence or an unstepped `Ready(0)`
    (design/session.md §6.3)."""
    if machine.fenced or machine.is_unstepped_zero():
        return
    raise DomainError(
        ErrorCode.INVALID_PHASE,
        f"replace_participant({worker_id}) needs a fenced epoch or an unstepped Ready(0); "
        f"the session is {machine.phase.label}",
        Mutation.NONE,
    )
