"""Domain requests, outcomes, bus-failure mapping and call outcomes (design/session.md §1.3, §1.4,
§1.7).

A domain call rides inside one `bus.call` (`payload` = the request) and its `bus.reply`
(`outcome`); the router never reads either. This module is the codec on both ends. Pure.

Request (`payload`), rules:
- Exactly the keys `requestId` (a RequestId >= 1), `scope` (a Scope or null), `params` (an object).
- `params` never holds, at any depth, the bus-only keys of `BUS_ONLY_KEYS`.
- Refusals are `INVALID_ARGUMENT`/`none`. A request that cannot be parsed is answered with scope
  null and `requestId` = the request's id when that was readable, else `req-0`
  (`unparsable_outcome`).

Outcome (`outcome`), rules a receiver checks (`check_outcome`):
- `type` is `result` or `error`; the key set is exact for that type:
      result: type, requestId, workerId, incarnationId, scope, result (an object)
      error:  type, requestId, workerId, incarnationId, scope, error {code, message, mutation}
- `requestId` is a RequestId (`req-0` allowed), `workerId`/`incarnationId` are Ids, `scope` a
  Scope or null; the error's code is a design/session.md §1.6 code, its mutation
  `none`/`applied`/`unknown`, its message at most 512 code points, and a before-mutation code says
  `none`.
- An invalid outcome is a Refused call: `BACKEND_FAILURE`/`unknown`,
  `"<method>: malformed outcome: <why>"`.
- Echo checks (worker id, incarnation, scope, request id against the call) are the caller's
  `check_reply` (design/session.md §6.4), not shape validation.

Bus failures (design/session.md §1.7), as data in `BUS_CODES` and `DISPATCH_MUTATION`:

    TARGET_CHANGED, NO_SERVICE          -> IDENTITY_MISMATCH
    BACKPRESSURE, QUOTA_EXCEEDED        -> BUSY
    anything else (names, JSON-RPC codes, ROUTER_LOST of a closed client) -> BACKEND_FAILURE
    dispatch not-dispatched -> none; dispatched, unknown (or unreadable) -> unknown
    message "<method>: bus <NAME>: <bus message>"

Every call ends in exactly one `CallOutcome`: `Answered(outcome)` (a well-formed terminal
outcome, success or domain error), `Expired()` (the deadline passed: uncertain, never read as
`none`), or `Refused(error)` (a mapped bus failure or a malformed outcome: definite).

Resolved ambiguities:
- A `result` must be a JSON object (every method's result is one).
- `RESULT_EXPIRED` with a mutation other than `unknown` is malformed (design/session.md §1.6 fixes
  it).
- A numeric bus code is named by `bus.errors.ERROR_NAMES` in the message (`-32700` ->
  `PARSE_ERROR`); an unnamed number is printed as is.
- A closed client surfaces from the SDK as `ROUTER_LOST` (dispatch `unknown`), which maps to
  `BACKEND_FAILURE`/`unknown`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final, Literal

from bus.errors import ERROR_NAMES, BusError
from workers.types.canonical import body_digest
from workers.types.domain import (
    DomainError,
    ErrorCode,
    Mutation,
    Scope,
    parse_id,
    parse_request_id,
    parse_scope,
    serial,
    short,
)

__all__ = [
    "BUS_CODES",
    "BUS_ONLY_KEYS",
    "DISPATCH_MUTATION",
    "UNREADABLE_REQUEST_ID",
    "Answered",
    "CallOutcome",
    "Expired",
    "Outcome",
    "Refused",
    "Request",
    "answer",
    "check_outcome",
    "from_bus_error",
    "holds_bus_key",
    "map_bus_error",
    "parse_request",
    "readable_request_id",
    "unparsable_outcome",
]

BUS_ONLY_KEYS: Final[frozenset[str]] = frozenset(
    {
        "callId",
        "deliveryId",
        "expectedIncarnation",
        "serviceIncarnation",
        "clientId",
        "clientIncarnation",
        "routerId",
    }
)
UNREADABLE_REQUEST_ID: Final = "req-0"

_REQUEST_KEYS: Final = frozenset({"requestId", "scope", "params"})
_OUTCOME_KEYS: Final[dict[str, frozenset[str]]] = {
    "result": frozenset({"type", "requestId", "workerId", "incarnationId", "scope", "result"}),
    "error": frozenset({"type", "requestId", "workerId", "incarnationId", "scope", "error"}),
}

BUS_CODES: Final[dict[str, ErrorCode]] = {
    "TARGET_CHANGED": ErrorCode.IDENTITY_MISMATCH,
    "NO_SERVICE": ErrorCode.IDENTITY_MISMATCH,
    "BACKPRESSURE": ErrorCode.BUSY,
    "QUOTA_EXCEEDED": ErrorCode.BUSY,
}
"""Bus error names with a domain meaning; every other name is `BACKEND_FAILURE`."""

DISPATCH_MUTATION: Final[dict[str, Mutation]] = {
    "not-dispatched": Mutation.NONE,
    "dispatched": Mutation.UNKNOWN,
    "unknown": Mutation.UNKNOWN,
}


# --------------------------------------------------------------------------------------------
# requests


@dataclass(frozen=True, slots=True)
class Request:
    """A parsed `bus.call` payload."""

    request_id: str
    scope: Scope | None
    params: dict[str, Any]

    @property
    def serial(self) -> int:
        return serial(self.request_id)

    def digest(self, method: str) -> str:
        """`body_digest(method, scope, params)`: what the result cache compares."""
        return body_digest(method, self.scope, self.params)

    def to_json(self) -> dict[str, Any]:
        return {
            "requestId": self.request_id,
            "scope": None if self.scope is None else self.scope.to_json(),
            "params": self.params,
        }


_SCALARS: Final[frozenset[type]] = frozenset({str, int, float, bool, type(None)})


def holds_bus_key(value: Any) -> bool:
    """Whether a bus-only key occurs anywhere inside `value` (no paths built: the common case
    is a clean request, and `_bus_key_path` words the refusal). Exact scalars, most of a
    request, are passed over by type alone."""
    if isinstance(value, dict):
        if not BUS_ONLY_KEYS.isdisjoint(value):  # one C-level pass over the keys
            return True
        items: Any = value.values()
    elif isinstance(value, list):
        items = value
    else:
        return False
    for item in items:
        if type(item) not in _SCALARS and isinstance(item, (dict, list)) \
                and holds_bus_key(item):
            return True
    return False


def _bus_key_path(value: Any, path: str) -> str | None:
    """The path of the first bus-only key inside `value`, or None."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key in BUS_ONLY_KEYS:
                return f"{path}.{key}"
            found = _bus_key_path(item, f"{path}.{key}")
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _bus_key_path(item, f"{path}[{index}]")
            if found is not None:
                return found
    return None


def parse_request(payload: Any) -> Request:
    """Parse a payload strictly; every refusal is `INVALID_ARGUMENT`/`none`."""
    if not isinstance(payload, dict):
        raise DomainError.invalid(f"a request must be an object; got {short(payload)}")
    keys = set(payload)
    if keys != _REQUEST_KEYS:
        raise DomainError.invalid(
            f"a request has exactly the keys params, requestId, scope; got {sorted(keys)}"
        )
    request_id = parse_request_id(payload["requestId"])
    scope = parse_scope(payload["scope"])
    params = payload["params"]
    if not isinstance(params, dict):
        raise DomainError.invalid(f"params must be an object; got {short(params)}")
    path = _bus_key_path(params, "params") if holds_bus_key(params) else None
    if path is not None:
        raise DomainError.invalid(f"{path} is a bus-only key and may not appear in params")
    return Request(request_id, scope, params)


def readable_request_id(payload: Any) -> str:
    """The payload's request id when it is a valid one, else `req-0` (design/session.md §1.4)."""
    if isinstance(payload, dict):
        try:
            return parse_request_id(payload.get("requestId"))
        except DomainError:
            pass
    return UNREADABLE_REQUEST_ID


# --------------------------------------------------------------------------------------------
# outcomes


@dataclass(frozen=True, slots=True)
class Outcome:
    """A worker's answer: a `result` object or a `DomainError`, never both."""

    request_id: str
    worker_id: str
    incarnation_id: str
    scope: Scope | None
    result: dict[str, Any] | None = None
    error: DomainError | None = None
    #: the result was checked against the method's result schema (`structures.answer_typed`)
    checked: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        if (self.result is None) == (self.error is None):
            raise DomainError(
                ErrorCode.INTERNAL, "an outcome has exactly one of result and error",
                Mutation.NONE,
            )

    @classmethod
    def success(
        cls, request: Request, worker_id: str, incarnation_id: str, result: dict[str, Any]
    ) -> Outcome:
        """The result outcome echoing `request`'s id and scope."""
        return cls(request.request_id, worker_id, incarnation_id, request.scope, result=result)

    @classmethod
    def failure(
        cls, request: Request, worker_id: str, incarnation_id: str, error: DomainError
    ) -> Outcome:
        """The error outcome echoing `request`'s id and scope."""
        return cls(request.request_id, worker_id, incarnation_id, request.scope, error=error)

    @property
    def type(self) -> Literal["result", "error"]:
        return "result" if self.error is None else "error"

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": self.type,
            "requestId": self.request_id,
            "workerId": self.worker_id,
            "incarnationId": self.incarnation_id,
            "scope": None if self.scope is None else self.scope.to_json(),
        }
        if self.error is None:
            body["result"] = self.result
        else:
            body["error"] = self.error.to_json()
        return body


def unparsable_outcome(
    payload: Any, error: DomainError, worker_id: str, incarnation_id: str
) -> Outcome:
    """The answer to a request that could not be parsed: scope null, the readable id or req-0."""
    return Outcome(
        readable_request_id(payload),
        worker_id,
        incarnation_id,
        None,
        error=DomainError(ErrorCode.INVALID_ARGUMENT, error.message, Mutation.NONE),
    )


def _parse_outcome(raw: Any) -> Outcome:
    if not isinstance(raw, dict):
        raise DomainError.invalid(f"an outcome must be an object; got {short(raw)}")
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in _OUTCOME_KEYS:
        raise DomainError.invalid(f"type must be result or error; got {short(kind)}")
    keys = set(raw)
    if keys != _OUTCOME_KEYS[kind]:
        unknown = sorted(keys - _OUTCOME_KEYS[kind])
        missing = sorted(_OUTCOME_KEYS[kind] - keys)
        raise DomainError.invalid(
            f"a {kind} outcome has unknown keys {unknown} and lacks {missing}"
        )
    request_id = parse_request_id(raw["requestId"], allow_zero=True)
    worker_id = parse_id(raw["workerId"], "workerId")
    incarnation_id = parse_id(raw["incarnationId"], "incarnationId")
    scope = parse_scope(raw["scope"])
    if kind == "result":
        result = raw["result"]
        if not isinstance(result, dict):
            raise DomainError.invalid(f"result must be an object; got {short(result)}")
        return Outcome(request_id, worker_id, incarnation_id, scope, result=result)
    return Outcome(
        request_id, worker_id, incarnation_id, scope, error=DomainError.from_json(raw["error"])
    )


def check_outcome(method: str, raw: Any) -> Outcome:
    """Validate a reply's shape; a malformed one is `BACKEND_FAILURE`/`unknown`."""
    try:
        return _parse_outcome(raw)
    except DomainError as exc:
        raise DomainError(
            ErrorCode.BACKEND_FAILURE, f"{method}: malformed outcome: {exc.message}",
            Mutation.UNKNOWN,
        ) from None


# --------------------------------------------------------------------------------------------
# bus failures and call outcomes


def map_bus_error(method: str, name: str | int, message: str, dispatch: str) -> DomainError:
    """The local `DomainError` for a bus failure of a domain call (never sent on the wire)."""
    label = name if isinstance(name, str) else ERROR_NAMES.get(name, str(name))
    code = BUS_CODES.get(label, ErrorCode.BACKEND_FAILURE)
    mutation = DISPATCH_MUTATION.get(dispatch, Mutation.UNKNOWN)
    return DomainError(code, f"{method}: bus {label}: {message}", mutation)


def from_bus_error(method: str, error: BusError) -> DomainError:
    return map_bus_error(method, error.name, error.message, error.dispatch)


@dataclass(frozen=True, slots=True)
class Answered:
    """A terminal, well-formed outcome arrived (a success or a domain error)."""

    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Expired:
    """The caller's deadline passed without an outcome: the call is uncertain."""


@dataclass(frozen=True, slots=True)
class Refused:
    """A bus failure (mapped) or a malformed outcome: definite, never retried as such."""

    error: DomainError


CallOutcome = Answered | Expired | Refused


def answer(method: str, raw: Any) -> Answered | Refused:
    """Classify a received `outcome`: `Answered` when well-formed, else `Refused`."""
    try:
        return Answered(check_outcome(method, raw))
    except DomainError as exc:
        return Refused(exc)
