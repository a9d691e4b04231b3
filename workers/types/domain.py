"""The domain vocabulary: scalars, error codes, `DomainError` (design/session.md §1.2, §1.6).

Every domain message is built from a handful of scalars, and every refusal is one value, so a
worker, the result cache and the coordinator all say "no" the same way.

Scalars (design/session.md §1.2) — each `parse_*` returns the Python value or raises `DomainError`
`INVALID_ARGUMENT`/`none` naming what was wrong:

    Id          str   ^[a-z0-9][a-z0-9._-]{0,63}$
    WorkerId    str   an Id of at most 48 characters without an empty dot-separated segment
                      (no `..`, no trailing `.`): it ends the worker's bus service name
                      `<tag>.agent.<id>` / `<tag>.env.<id>` (design/wire.md §5), so a run spec that
                      validates always launches
    RequestId   str   req-<U64>, canonical decimal, >= 1 (req-0 only as an outcome's fallback)
    U64         int   JSON *string* "0" or [1-9][0-9]{0,19}, value <= 2^64-1
    I32         int   JSON integer in -2^31..2^31-1 (a bool or a float is refused)
    Digest      str   64 lowercase hex characters
    Scope       Scope {"sessionId": Id, "epoch": Id, "step": U64}, exact key set

Plain JSON integers (dimensions, counts) are never booleans and never floats (`100.0` is
refused where an integer is expected); numbers that must be finite refuse NaN/±Infinity.

Error codes (design/session.md §1.6), as data in `CODES`: number, mutation rule. Rules:

- Codes 1-11 and 13 are *before-mutation* codes (`BEFORE_MUTATION`): a worker reply carrying
  one of them MUST say `none`. Local coordinator errors (mapped bus failures, Phase C media
  checks) may carry them with `unknown`, so `DomainError` itself does not enforce the rule; the
  receiver of a worker reply does (`workers.types.rpc`).
- `RESULT_EXPIRED` is always `unknown` (a replay is gone; whether it ran is not knowable).
- `BACKEND_FAILURE` and `INTERNAL` carry an explicit mutation.

`DomainError(code, message, mutation, data=None)` is an exception *and* a value: equal when
code, message, mutation and data are equal; `to_json()` is the wire `error` object (message
clipped to 512 code points: 511 plus `…`), `from_json()` validates one strictly.

Error data: a failure raised by a plugin (a user's model, world or task) carries a
`PluginFault` as its `data`, the wire `error`'s optional fourth key, so the exception's type,
its message and the last frames of its traceback travel as a value from the worker to the
coordinator, the node and the run's outcome, never parsed back out of a message. Bounds: the
last `FAULT_FRAMES` (5) frames (the import system's own frames left out), each one line of at
most `FAULT_LINE` (240) code points, the exception's message clipped like an error message
(512). `repeats` marks a failure that the same
spec fails the same way on every attempt (an import, a missing attribute, a constructor's
exception); `flyd.state.recovery.is_permanent` reads it, so such a run is not retried.

The spec's module map names this module as the home of the whole design/session.md §1 surface
(request and outcome codec, canonical JSON, digests, shared types). Each of those concepts lives in
its own module (`workers.types.canonical`, `workers.types.rpc`, `workers.types.datatypes`,
`workers.types.ticks`); they raise `DomainError`, so they import this one, and this one
imports none of them: the dependency runs one way, from the design/session.md §1 modules down to
this leaf.

Resolved ambiguities:
- `RequestId` parsing refuses `req-0` unless `allow_zero=True` (outcomes only,
  design/session.md §1.4).
- `RESULT_EXPIRED` with a mutation other than `unknown` is refused by `from_json` (the table
  fixes its mutation), and `DomainError.before(RESULT_EXPIRED, …)` is an `INTERNAL` error.
"""

from __future__ import annotations

import math
import re
import traceback
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Literal

__all__ = [
    "BEFORE_MUTATION",
    "CODES",
    "FAULT_FRAMES",
    "FAULT_LINE",
    "I32_MAX",
    "I32_MIN",
    "MAX_MESSAGE_CODE_POINTS",
    "MAX_WORKER_ID",
    "U64_MAX",
    "CodeRule",
    "DomainError",
    "ErrorCode",
    "Mutation",
    "PluginFault",
    "PluginStage",
    "Scope",
    "clip_message",
    "format_request_id",
    "format_u64",
    "is_id",
    "parse_bool",
    "parse_digest",
    "parse_finite",
    "parse_i32",
    "parse_id",
    "parse_int",
    "parse_request_id",
    "parse_scope",
    "parse_string",
    "parse_u64",
    "parse_worker_id",
    "serial",
    "short",
]

U64_MAX: Final = 2**64 - 1
I32_MIN: Final = -(2**31)
I32_MAX: Final = 2**31 - 1
MAX_MESSAGE_CODE_POINTS: Final = 512
MAX_WORKER_ID: Final = 48
FAULT_FRAMES: Final = 5
FAULT_LINE: Final = 240

_ID: Final = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
_U64: Final = re.compile(r"0|[1-9][0-9]{0,19}")
_REQUEST_ID: Final = re.compile(r"req-(0|[1-9][0-9]{0,19})")
_DIGEST: Final = re.compile(r"[0-9a-f]{64}")


# --------------------------------------------------------------------------------------------
# Error codes and mutation certainty (design/session.md §1.6)


class ErrorCode(StrEnum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    UNSUPPORTED = "UNSUPPORTED"
    IDENTITY_MISMATCH = "IDENTITY_MISMATCH"
    STALE_EPOCH = "STALE_EPOCH"
    STALE_STEP = "STALE_STEP"
    FUTURE_STEP = "FUTURE_STEP"
    INVALID_PHASE = "INVALID_PHASE"
    CONFLICT = "CONFLICT"
    IN_PROGRESS = "IN_PROGRESS"
    BUSY = "BUSY"
    BUFFER_INVALID = "BUFFER_INVALID"
    RESULT_EXPIRED = "RESULT_EXPIRED"
    INCOMPATIBLE_STATE = "INCOMPATIBLE_STATE"
    BACKEND_FAILURE = "BACKEND_FAILURE"
    INTERNAL = "INTERNAL"
    RESTORE_DIVERGED = "RESTORE_DIVERGED"


class Mutation(StrEnum):
    """What a failed operation did to the worker's state, as far as anyone can tell."""

    NONE = "none"
    APPLIED = "applied"
    UNKNOWN = "unknown"


MutationRule = Literal["none", "unknown", "explicit"]


@dataclass(frozen=True, slots=True)
class CodeRule:
    """One row of design/session.md §1.6: the code's number and the mutation a worker reply must
    carry."""

    number: int
    mutation: MutationRule


CODES: Final[dict[ErrorCode, CodeRule]] = {
    ErrorCode.INVALID_ARGUMENT: CodeRule(1, "none"),
    ErrorCode.UNSUPPORTED: CodeRule(2, "none"),
    ErrorCode.IDENTITY_MISMATCH: CodeRule(3, "none"),
    ErrorCode.STALE_EPOCH: CodeRule(4, "none"),
    ErrorCode.STALE_STEP: CodeRule(5, "none"),
    ErrorCode.FUTURE_STEP: CodeRule(6, "none"),
    ErrorCode.INVALID_PHASE: CodeRule(7, "none"),
    ErrorCode.CONFLICT: CodeRule(8, "none"),
    ErrorCode.IN_PROGRESS: CodeRule(9, "none"),
    ErrorCode.BUSY: CodeRule(10, "none"),
    # `none` at a worker; the coordinator's Phase C uses it with `unknown` (a local error).
    ErrorCode.BUFFER_INVALID: CodeRule(11, "none"),
    ErrorCode.RESULT_EXPIRED: CodeRule(12, "unknown"),
    ErrorCode.INCOMPATIBLE_STATE: CodeRule(13, "none"),
    ErrorCode.BACKEND_FAILURE: CodeRule(14, "explicit"),
    ErrorCode.INTERNAL: CodeRule(15, "explicit"),
    # a restored world observes other than its checkpoint recorded (design/session.md §6.12
    # amendment 2026-12-07): found after activation, so the state was installed (`unknown` from the
    # coordinator); a world that checks itself while staging may say `none`
    ErrorCode.RESTORE_DIVERGED: CodeRule(16, "explicit"),
}

BEFORE_MUTATION: Final[frozenset[ErrorCode]] = frozenset(
    code for code, rule in CODES.items() if rule.mutation == "none"
)


def clip_message(message: str) -> str:
    """At most 512 code points: a longer message keeps 511 and ends with `…`
    (design/session.md §1.4)."""
    if len(message) <= MAX_MESSAGE_CODE_POINTS:
        return message
    return message[: MAX_MESSAGE_CODE_POINTS - 1] + "…"


def short(value: Any, limit: int = 40) -> str:
    """A bounded repr for error messages: refusals never echo a large or sensitive value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _line(text: str) -> str:
    """One line of at most `FAULT_LINE` code points."""
    text = " ".join(text.split())
    return text if len(text) <= FAULT_LINE else text[: FAULT_LINE - 1] + "…"


class PluginStage(StrEnum):
    """Where a plugin failed: importing its module, finding its class, constructing it, or in
    a later call. The first three fail the same way on every attempt."""

    IMPORT = "import"
    ATTRIBUTE = "attribute"
    CONSTRUCT = "construct"
    CALL = "call"


#: the import system's own frames, which say nothing about the plugin
_IMPORT_MACHINERY: Final = "<frozen importlib."
_PLUGIN_FAULT_KEYS: Final = frozenset(
    {"plugin", "stage", "exception", "message", "frames", "repeats"})


@dataclass(frozen=True, slots=True)
class PluginFault:
    """A plugin's exception as data: the plugin's import path (empty when the caller cannot
    tell which plugin ran), the stage, the exception's type and message, the last frames of its
    traceback (innermost last), and whether the failure repeats on every attempt."""

    plugin: str
    stage: PluginStage
    exception: str
    message: str
    frames: tuple[str, ...]
    repeats: bool

    @classmethod
    def of(cls, exc: BaseException, plugin: str, stage: PluginStage,
           repeats: bool | None = None) -> PluginFault:
        """The fault of `exc`; `repeats` defaults to "the stage is not a call"."""
        kind = type(exc)
        name = kind.__qualname__ if kind.__module__ == "builtins" else \
            f"{kind.__module__}.{kind.__qualname__}"
        stack = [f for f in traceback.extract_tb(exc.__traceback__)
                 if not f.filename.startswith(_IMPORT_MACHINERY)]
        frames = tuple(
            _line(f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else ""))
            for f in stack[-FAULT_FRAMES:])
        return cls(plugin, stage, _line(name), clip_message(str(exc)), frames,
                   stage != PluginStage.CALL if repeats is None else repeats)

    def summary(self) -> str:
        """`ValueError: bad gain 42` (the type alone for an exception without a message)."""
        return f"{self.exception}: {self.message}" if self.message else self.exception

    def to_json(self) -> dict[str, Any]:
        return {"plugin": self.plugin, "stage": self.stage.value, "exception": self.exception,
                "message": self.message, "frames": list(self.frames), "repeats": self.repeats}

    @classmethod
    def from_json(cls, value: Any, what: str = "error.data") -> PluginFault:
        """Strict parse, within the bounds `of` keeps; refuses with `INVALID_ARGUMENT`."""
        if not isinstance(value, dict) or set(value) != _PLUGIN_FAULT_KEYS:
            raise DomainError.invalid(f"{what} must be an object with exactly "
                                      f"{', '.join(sorted(_PLUGIN_FAULT_KEYS))}")
        stage = value["stage"]
        if stage not in {s.value for s in PluginStage}:
            raise DomainError.invalid(f"{what}.stage {short(stage)} is not a plugin stage")
        frames = value["frames"]
        if not isinstance(frames, list) or len(frames) > FAULT_FRAMES or any(
                not isinstance(f, str) or len(f) > FAULT_LINE for f in frames):
            raise DomainError.invalid(f"{what}.frames must be at most {FAULT_FRAMES} strings "
                                      f"of at most {FAULT_LINE} code points")
        message = parse_string(value["message"], f"{what}.message")
        if len(message) > MAX_MESSAGE_CODE_POINTS:
            raise DomainError.invalid(f"{what}.message is longer than "
                                      f"{MAX_MESSAGE_CODE_POINTS} code points")
        exception = parse_string(value["exception"], f"{what}.exception")
        if len(exception) > FAULT_LINE:
            raise DomainError.invalid(f"{what}.exception is longer than {FAULT_LINE} code points")
        return cls(parse_string(value["plugin"], f"{what}.plugin"), PluginStage(stage),
                   exception, message, tuple(frames),
                   parse_bool(value["repeats"], f"{what}.repeats"))


class DomainError(Exception):
    """A domain refusal or failure: a code, a message and a mutation certainty, and a plugin's
    fault as `data` when a plugin raised it (module docstring)."""

    __slots__ = ("code", "data", "message", "mutation")

    def __init__(self, code: ErrorCode | str, message: str, mutation: Mutation | str,
                 data: PluginFault | None = None) -> None:
        self.code = ErrorCode(code)
        self.message = str(message)
        self.mutation = Mutation(mutation)
        self.data = data
        super().__init__(self.code, self.message, self.mutation)

    @classmethod
    def before(cls, code: ErrorCode | str, message: str) -> DomainError:
        """A refusal raised before anything was touched (mutation `none`)."""
        code = ErrorCode(code)
        if CODES[code].mutation == "unknown":
            raise DomainError(
                ErrorCode.INTERNAL, f"{code} always carries mutation unknown", Mutation.NONE
            )
        return cls(code, message, Mutation.NONE)

    @classmethod
    def invalid(cls, message: str) -> DomainError:
        """Shorthand for the most common refusal, `INVALID_ARGUMENT`/`none`."""
        return cls(ErrorCode.INVALID_ARGUMENT, message, Mutation.NONE)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "code": self.code.value,
            "message": clip_message(self.message),
            "mutation": self.mutation.value,
        }
        if self.data is not None:
            out["data"] = self.data.to_json()
        return out

    @classmethod
    def from_json(cls, value: Any) -> DomainError:
        """Strict parse of a worker's wire `error` object; refuses with `INVALID_ARGUMENT`."""
        if not isinstance(value, dict):
            raise cls.invalid(f"error must be an object; got {short(value)}")
        keys = set(value)
        if keys - {"data"} != {"code", "message", "mutation"}:
            raise cls.invalid(f"error keys must be code, message, mutation (and data); got "
                              f"{sorted(keys)}")
        code, message, mutation = value["code"], value["message"], value["mutation"]
        if not isinstance(code, str) or code not in ErrorCode.__members__:
            raise cls.invalid(f"error code {short(code)} is not a domain code")
        if not isinstance(mutation, str) or mutation not in {m.value for m in Mutation}:
            raise cls.invalid(f"mutation {short(mutation)} is not none, applied or unknown")
        if not isinstance(message, str):
            raise cls.invalid("error message must be a string")
        if len(message) > MAX_MESSAGE_CODE_POINTS:
            raise cls.invalid(
                f"error message has {len(message)} code points; at most "
                f"{MAX_MESSAGE_CODE_POINTS} are allowed"
            )
        rule = CODES[ErrorCode(code)].mutation
        if rule == "none" and mutation != Mutation.NONE:
            raise cls.invalid(f"{code} is a before-mutation code but says mutation {mutation}")
        if rule == "unknown" and mutation != Mutation.UNKNOWN:
            raise cls.invalid(f"{code} always carries mutation unknown, not {mutation}")
        data = PluginFault.from_json(value["data"]) if "data" in value else None
        return cls(code, message, mutation, data)

    def with_message(self, message: str) -> DomainError:
        return DomainError(self.code, message, self.mutation, self.data)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DomainError):
            return NotImplemented
        return (self.code, self.message, self.mutation, self.data) == (
            other.code,
            other.message,
            other.mutation,
            other.data,
        )

    def __hash__(self) -> int:
        return hash((self.code, self.message, self.mutation, self.data))

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def __repr__(self) -> str:
        return (
            f"DomainError({self.code.value!r}, {self.message!r}, {self.mutation.value!r})"
        )


# --------------------------------------------------------------------------------------------
# Scalars (design/session.md §1.2)


# Ids that matched `_ID`: a process checks the same few (worker, schema, view, port ids) in
# every message, and a set lookup is a fraction of a match. Bounded: past it, ids are matched.
_VALID_IDS: set[str] = set()
_VALID_IDS_MAX: Final = 4096


def is_id(value: Any) -> bool:
    if type(value) is str and value in _VALID_IDS:
        return True
    if isinstance(value, str) and _ID.fullmatch(value) is not None:
        if len(_VALID_IDS) < _VALID_IDS_MAX:
            _VALID_IDS.add(value)
        return True
    return False


def parse_id(value: Any, what: str = "id") -> str:
    if not is_id(value):
        raise DomainError.invalid(
            f"{what} must be an Id (^[a-z0-9][a-z0-9._-]{{0,63}}$); got {short(value)}"
        )
    result: str = value
    return result


def parse_worker_id(value: Any, what: str = "worker id") -> str:
    """An agent's or the world's id (the WorkerId rule above): one rule for the run spec and
    for the bus names the launcher derives from it."""
    worker = parse_id(value, what)
    if len(worker) > MAX_WORKER_ID:
        raise DomainError.invalid(f"{what} {worker} is longer than {MAX_WORKER_ID} characters")
    if ".." in worker or worker.endswith("."):
        raise DomainError.invalid(
            f"{what} {worker} has an empty dot-separated segment (no '..', no trailing '.'): "
            "it must end a bus service name")
    return worker


def parse_string(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise DomainError.invalid(f"{what} must be a string; got {short(value)}")
    return value


def parse_u64(value: Any, what: str = "value") -> int:
    """A U64 travels as a canonical decimal *string* so it survives any JSON reader."""
    if not isinstance(value, str) or _U64.fullmatch(value) is None:
        raise DomainError.invalid(
            f"{what} must be a U64 string (canonical decimal); got {short(value)}"
        )
    number = int(value)
    if number > U64_MAX:
        raise DomainError.invalid(f"{what} {value} exceeds 18446744073709551615")
    return number


def format_u64(number: int, what: str = "value") -> str:
    if type(number) is int and 0 <= number <= U64_MAX:
        return str(number)  # the common case, without the isinstance tests below
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= U64_MAX:
        raise DomainError.invalid(f"{what} must be an integer in 0..2^64-1; got {short(number)}")
    return str(number)


def parse_int(value: Any, what: str, low: int, high: int) -> int:
    """A plain JSON integer in [low, high]: never a bool, never a float (not even `3.0`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise DomainError.invalid(f"{what} must be an integer; got {short(value)}")
    if not low <= value <= high:
        raise DomainError.invalid(f"{what} must lie in {low}..{high}; got {value}")
    return value


def parse_i32(value: Any, what: str = "value") -> int:
    return parse_int(value, what, I32_MIN, I32_MAX)


def parse_finite(value: Any, what: str) -> float:
    """A finite JSON number (int or float, never a bool), returned as a float."""
    if type(value) is float and math.isfinite(value):
        return value  # the common case, without the isinstance tests below
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DomainError.invalid(f"{what} must be a number; got {short(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise DomainError.invalid(f"{what} must be finite; got {value}")
    return float(value)


def parse_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise DomainError.invalid(f"{what} must be true or false; got {short(value)}")
    return value


def parse_digest(value: Any, what: str = "digest") -> str:
    if not isinstance(value, str) or _DIGEST.fullmatch(value) is None:
        raise DomainError.invalid(
            f"{what} must be 64 lowercase hex characters; got {short(value)}"
        )
    return value


def parse_request_id(value: Any, what: str = "requestId", *, allow_zero: bool = False) -> str:
    """`req-<U64>` in canonical decimal; `req-0` exists only as an outcome's fallback id."""
    match = _REQUEST_ID.fullmatch(value) if isinstance(value, str) else None
    if match is None or int(match.group(1)) > U64_MAX:
        raise DomainError.invalid(f"{what} must be req-<U64>; got {short(value)}")
    if match.group(1) == "0" and not allow_zero:
        raise DomainError.invalid(f"{what} req-0 is reserved for unreadable requests")
    result: str = value
    return result


def serial(request_id: str) -> int:
    """The serial number of a request id (`serial("req-7") == 7`)."""
    return int(parse_request_id(request_id, allow_zero=True)[4:])


def format_request_id(number: int) -> str:
    return "req-" + format_u64(number, "request serial")


@dataclass(frozen=True, slots=True)
class Scope:
    """Where a domain operation belongs: session, epoch and step (design/session.md §1.2)."""

    session_id: str
    epoch: str
    step: int

    def __post_init__(self) -> None:
        parse_id(self.session_id, "scope.sessionId")
        parse_id(self.epoch, "scope.epoch")
        format_u64(self.step, "scope.step")

    @classmethod
    def _checked(cls, session_id: str, epoch: str, step: int) -> Scope:
        """A scope of fields already checked: every request and reply carries one, so the
        parse does not check its ids a second time in `__post_init__`."""
        scope = object.__new__(cls)
        object.__setattr__(scope, "session_id", session_id)
        object.__setattr__(scope, "epoch", epoch)
        object.__setattr__(scope, "step", step)
        return scope

    @classmethod
    def from_json(cls, value: Any, what: str = "scope") -> Scope:
        if not isinstance(value, dict) or set(value) != {"sessionId", "epoch", "step"}:
            raise DomainError.invalid(
                f"{what} must be an object with exactly sessionId, epoch, step"
            )
        return cls._checked(
            parse_id(value["sessionId"], f"{what}.sessionId"),
            parse_id(value["epoch"], f"{what}.epoch"),
            parse_u64(value["step"], f"{what}.step"),
        )

    def to_json(self) -> dict[str, str]:
        return {"sessionId": self.session_id, "epoch": self.epoch, "step": str(self.step)}

    def at(self, step: int) -> Scope:
        """The same session and epoch (checked on construction) at `step`."""
        format_u64(step, "scope.step")
        return Scope._checked(self.session_id, self.epoch, step)

    def __str__(self) -> str:
        return f"({self.session_id}, {self.epoch}, {self.step})"


def parse_scope(value: Any, what: str = "scope") -> Scope | None:
    """A `Scope` or JSON null."""
    return None if value is None else Scope.from_json(value, what)
