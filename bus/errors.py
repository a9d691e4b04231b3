"""Bus error values (design/wire.md §15).

Every error the bus reports carries a fixed name, a fixed JSON-RPC code, a human message and a
dispatch certainty, because callers must decide from the certainty alone whether a request may
have run. The code table is part of the wire contract and never changes.
"""

from __future__ import annotations

from typing import Any, Final, Literal

Dispatch = Literal["not-dispatched", "dispatched", "unknown"]
DISPATCH_VALUES: Final = ("not-dispatched", "dispatched", "unknown")

ERROR_CODES: Final[dict[str, int]] = {
    "PARSE_ERROR": -32700,
    "INVALID_REQUEST": -32600,
    "METHOD_NOT_FOUND": -32601,
    "INVALID_PARAMS": -32602,
    "INVALID_ENVELOPE": -32000,
    "VERSION_MISMATCH": -32001,
    "NOT_AUTHORIZED": -32002,
    "NO_SERVICE": -32003,
    "TARGET_CHANGED": -32004,
    "BACKPRESSURE": -32005,
    "CALL_GONE": -32006,
    "QUOTA_EXCEEDED": -32007,
    "ROUTER_LOST": -32008,
    "CONFLICT": -32009,
    "NO_TOPIC": -32010,
    "ARTIFACT_GONE": -32011,
    "ARTIFACT_UNSEALED": -32012,
    "ARTIFACT_MISMATCH": -32013,
    "OWNER_INVALID": -32014,
    "STORE_FAILURE": -32015,
}
ERROR_NAMES: Final[dict[int, str]] = {code: name for name, code in ERROR_CODES.items()}

MAX_MESSAGE_CHARS: Final = 512


def error_object(name: str, message: str, dispatch: Dispatch) -> dict[str, Any]:
    """The wire form `{code, message, data:{name, dispatch}}`; the message is capped at 512."""
    return {
        "code": ERROR_CODES[name],
        "message": message[:MAX_MESSAGE_CHARS],
        "data": {"name": name, "dispatch": dispatch},
    }


class BusError(Exception):
    """A bus failure: name, code, message and dispatch certainty."""

    name: str = "BUS_ERROR"

    def __init__(self, message: str, dispatch: Dispatch = "not-dispatched") -> None:
        super().__init__(message)
        self.message = message
        self.dispatch: Dispatch = dispatch

    @property
    def code(self) -> int:
        return ERROR_CODES[self.name]

    def to_wire(self) -> dict[str, Any]:
        return error_object(self.name, self.message, self.dispatch)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, dispatch={self.dispatch!r})"

    def __str__(self) -> str:
        return f"{self.name}: {self.message} ({self.dispatch})"


class ParseError(BusError):
    name = "PARSE_ERROR"


class InvalidRequest(BusError):
    name = "INVALID_REQUEST"


class MethodNotFound(BusError):
    name = "METHOD_NOT_FOUND"


class InvalidParams(BusError):
    name = "INVALID_PARAMS"


class InvalidEnvelope(BusError):
    name = "INVALID_ENVELOPE"


class VersionMismatch(BusError):
    name = "VERSION_MISMATCH"


class NotAuthorized(BusError):
    name = "NOT_AUTHORIZED"


class NoService(BusError):
    name = "NO_SERVICE"


class TargetChanged(BusError):
    name = "TARGET_CHANGED"


class Backpressure(BusError):
    name = "BACKPRESSURE"


class CallGone(BusError):
    name = "CALL_GONE"


class CallDeadlineExceeded(CallGone):
    """The SDK's deadline ran out; `cancel_state` is what `bus.cancel` answered (or None)."""

    def __init__(
        self, message: str, dispatch: Dispatch = "unknown", cancel_state: str | None = None
    ) -> None:
        super().__init__(message, dispatch)
        self.cancel_state = cancel_state


class QuotaExceeded(BusError):
    name = "QUOTA_EXCEEDED"


class RouterLost(BusError):
    name = "ROUTER_LOST"

    def __init__(
        self, message: str = "connection to the router lost", dispatch: Dispatch = "unknown"
    ) -> None:
        super().__init__(message, dispatch)


class Conflict(BusError):
    name = "CONFLICT"


class NoTopic(BusError):
    """A publish or subscribe names no declared topic (topics.md §9)."""

    name = "NO_TOPIC"


class ArtifactGone(BusError):
    """An artifact id this store never issued or already collected, or an attachment the
    store cannot honour (disabled, failed, not offered); SDK-local: an open found no file."""

    name = "ARTIFACT_GONE"


class ArtifactUnsealed(BusError):
    """Attaching or retaining an Allocated artifact, or a seal while a writer is still open."""

    name = "ARTIFACT_UNSEALED"


class ArtifactMismatch(BusError):
    """A seal's digest differs from the bytes, or a file is not the one allocated."""

    name = "ARTIFACT_MISMATCH"


class OwnerInvalid(BusError):
    """A seal of another connection's allocation, or an artifact the sender cannot see."""

    name = "OWNER_INVALID"


class StoreFailure(BusError):
    """The store is disabled or failed, or creating a file failed (ENOSPC included)."""

    name = "STORE_FAILURE"


class AttachmentsNotKept(QuotaExceeded):
    """`call()` got its result but could not retain its attachments (topics.md §12);
    `.result` is the call's result."""

    def __init__(self, message: str, result: Any, dispatch: Dispatch = "dispatched") -> None:
        super().__init__(message, dispatch)
        self.result = result


ERROR_CLASSES: Final[dict[str, type[BusError]]] = {
    cls.name: cls
    for cls in (
        ParseError,
        InvalidRequest,
        MethodNotFound,
        InvalidParams,
        InvalidEnvelope,
        VersionMismatch,
        NotAuthorized,
        NoService,
        TargetChanged,
        Backpressure,
        CallGone,
        QuotaExceeded,
        RouterLost,
        Conflict,
        NoTopic,
        ArtifactGone,
        ArtifactUnsealed,
        ArtifactMismatch,
        OwnerInvalid,
        StoreFailure,
    )
}


def from_wire(error: dict[str, Any]) -> BusError:
    """Build the matching BusError subclass from a wire error object."""
    data = error.get("data") or {}
    name = data.get("name") or ERROR_NAMES.get(error.get("code", 0), "ROUTER_LOST")
    dispatch = data.get("dispatch", "unknown")
    if dispatch not in DISPATCH_VALUES:
        dispatch = "unknown"
    cls = ERROR_CLASSES.get(name, RouterLost)
    return cls(str(error.get("message", "")), dispatch)
