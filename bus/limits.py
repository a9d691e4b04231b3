"""Router limits (design/wire.md §14.1): defaults, ranges, wire names and config names.

Limits are plain data, validated once at router start; an out-of-range value names its key so
the operator can fix the configuration (the router then exits with code 2).

`result_frame(...)` is the one rule for the size a reply counts against `maxEnvelopeBytes`
(design/wire.md §7.4 `bus.reply` check 4): the `bus.result` frame with the longest delivery id. The
router builds that frame to check and route a reply; a worker builds it with the longest call
id too, to check a large reply before sending it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any, Final

import orjson

MAX_CONSUME_BATCH: Final = 64
#: attachments per call, reply or publish (topics.md §8, fixed)
MAX_ATTACHMENTS: Final = 16
MAX_JSON_DEPTH: Final = 128
REMEMBERED_INCARNATIONS: Final = 1024
REMEMBERED_CLIENT_IDS: Final = 4096
FRAMES_PER_TURN: Final = 32
#: the largest request id, call id and delivery serial (2^53-1, exact in every JSON reader)
MAX_ID: Final = 2**53 - 1
#: the longest delivery id: a `bus.result` frame is sized with it, whichever id it gets
LONGEST_DELIVERY_ID: Final = f"dlv-{MAX_ID}"


class LimitError(ValueError):
    """A limit out of its range; `key` is the offending name as configured."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class Limits:
    maxEnvelopeBytes: int = 1048576
    maxClients: int = 64
    maxServices: int = 256
    maxServiceQueued: int = 16
    maxServiceInFlight: int = 16
    maxActiveCallsPerClient: int = 64
    maxOpenRequestsPerClient: int = 256
    maxQueuedCallBytes: int = 67108864
    maxControlFrames: int = 128
    maxControlBytes: int = 4194304
    maxConsumeBatch: int = MAX_CONSUME_BATCH
    maxExpectations: int = 256
    helloTimeoutMs: int = 5000
    writeHighWaterBytes: int = 262144
    # topics (topics.md §8)
    maxTopics: int = 256
    maxSubscribersPerTopic: int = 64
    maxSubscriptionsPerClient: int = 64
    maxBoundedDepth: int = 64
    maxSubscriptionWindow: int = 16
    maxQueuedTopicBytes: int = 67108864
    # the artifact store (topics.md §8)
    maxAttachments: int = MAX_ATTACHMENTS
    maxArtifactBytes: int = 16777216
    maxArtifacts: int = 65536
    maxStoreBytes: int = 1073741824
    maxHeldBytesPerClient: int = 268435456
    maxHoldsPerClient: int = 4096
    maxAllocationsPerClient: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise LimitError(f.name, f"must be an integer, got {value!r}")
        for name, (lo, hi) in _RANGES.items():
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise LimitError(name, f"{value} is outside {lo}..{hi}")
        if self.maxQueuedCallBytes < self.maxEnvelopeBytes:
            raise LimitError("maxQueuedCallBytes", "must be >= maxEnvelopeBytes")
        if self.maxControlBytes < self.maxEnvelopeBytes:
            raise LimitError("maxControlBytes", "must be >= maxEnvelopeBytes")
        if self.maxQueuedTopicBytes < self.maxEnvelopeBytes:
            raise LimitError("maxQueuedTopicBytes", "must be >= maxEnvelopeBytes")
        if self.maxStoreBytes < self.maxArtifactBytes:
            raise LimitError("maxStoreBytes", "must be >= maxArtifactBytes")
        if not self.maxArtifactBytes <= self.maxHeldBytesPerClient <= self.maxStoreBytes:
            raise LimitError("maxHeldBytesPerClient",
                             "must be within maxArtifactBytes..maxStoreBytes")
        if self.maxAttachments != MAX_ATTACHMENTS:
            raise LimitError("maxAttachments", f"is fixed at {MAX_ATTACHMENTS}")
        if self.maxConsumeBatch != MAX_CONSUME_BATCH:
            raise LimitError("maxConsumeBatch", f"is fixed at {MAX_CONSUME_BATCH}")

    def hello(self) -> dict[str, int]:
        """The `limits` object of the hello result: exactly the keys marked "hello"."""
        return {name: getattr(self, name) for name in HELLO_KEYS}

    def replace(self, **overrides: Any) -> Limits:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(overrides)
        return Limits(**values)

    @classmethod
    def from_config(cls, table: dict[str, Any]) -> Limits:
        """Build from a `[bus.limits]` table with snake_case keys; unknown keys are refused."""
        by_snake = {snake_case(f.name): f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in table.items():
            if key not in by_snake:
                raise LimitError(key, "unknown [bus.limits] key")
            values[by_snake[key]] = value
        try:
            return cls(**values)
        except LimitError as exc:
            raise LimitError(snake_case(exc.key), str(exc).split(": ", 1)[1]) from None


_RANGES: Final[dict[str, tuple[int, int]]] = {
    "maxEnvelopeBytes": (65536, 16777216),
    "maxClients": (1, 4096),
    "helloTimeoutMs": (100, 60000),
    "maxServices": (1, 65535),
    "maxServiceQueued": (1, 65535),
    "maxServiceInFlight": (1, 65535),
    "maxActiveCallsPerClient": (1, 65535),
    "maxOpenRequestsPerClient": (1, 65535),
    "maxQueuedCallBytes": (65536, 2**53 - 1),
    "maxControlFrames": (8, 65535),
    "maxControlBytes": (65536, 2**53 - 1),
    "maxExpectations": (0, 65535),
    "writeHighWaterBytes": (65536, 16777216),
    "maxTopics": (1, 65535),
    "maxSubscribersPerTopic": (1, 65535),
    "maxSubscriptionsPerClient": (0, 65535),
    "maxBoundedDepth": (1, 65535),
    "maxSubscriptionWindow": (1, 256),
    "maxQueuedTopicBytes": (65536, 2**53 - 1),
    "maxArtifactBytes": (1, 1073741824),
    "maxArtifacts": (1, 1048576),
    "maxStoreBytes": (1, 2**53 - 1),
    "maxHeldBytesPerClient": (1, 2**53 - 1),
    "maxHoldsPerClient": (1, 65535),
    "maxAllocationsPerClient": (1, 65535),
}

HELLO_KEYS_MINOR_1: Final = (
    "maxEnvelopeBytes",
    "maxClients",
    "maxServices",
    "maxServiceQueued",
    "maxServiceInFlight",
    "maxActiveCallsPerClient",
    "maxOpenRequestsPerClient",
    "maxQueuedCallBytes",
    "maxControlFrames",
    "maxControlBytes",
    "maxConsumeBatch",
    "maxExpectations",
    "helloTimeoutMs",
)
#: the hello keys this router sends (minor 2): minor 1's, the topic and the store limits
HELLO_KEYS: Final = (
    *HELLO_KEYS_MINOR_1,
    "maxTopics",
    "maxSubscribersPerTopic",
    "maxSubscriptionsPerClient",
    "maxBoundedDepth",
    "maxSubscriptionWindow",
    "maxQueuedTopicBytes",
    "maxAttachments",
    "maxArtifactBytes",
    "maxArtifacts",
    "maxStoreBytes",
    "maxHeldBytesPerClient",
    "maxHoldsPerClient",
    "maxAllocationsPerClient",
)


def hello_keys(minor: int) -> frozenset[str]:
    """The limits keys a router of `minor` announces (topics.md §1 rule 3)."""
    return frozenset(HELLO_KEYS if minor >= 2 else HELLO_KEYS_MINOR_1)


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def result_frame(call_id: int, service_incarnation: str, responder: Any, outcome: Any,
                 attachments: Any = None) -> bytes:
    """The `bus.result` frame body of a reply, its delivery id the longest one: its length is
    the size checked against `maxEnvelopeBytes`, whatever delivery id the caller gets.
    `responder` is `{clientId, clientIncarnation}` and `outcome` the reply's outcome, each as a
    JSON value or an `orjson.Fragment` already encoded; `attachments` (topics.md §6.1) is
    present only when given."""
    params = {
        "deliveryId": LONGEST_DELIVERY_ID,
        "callId": call_id,
        "serviceIncarnation": service_incarnation,
        "responder": responder,
    }
    if attachments is not None:
        params["attachments"] = attachments
    params["outcome"] = outcome  # last: the receiver's split (design/wire.md §22.1)
    return orjson.dumps({"jsonrpc": "2.0", "method": "bus.result", "params": params})


def message_frame(delivery_id: str, topic: str, incarnation: str, sequence: int, skipped: int,
                  publisher: Any, payload: Any, attachments: Any = None) -> bytes:
    """The `bus.message` frame body (topics.md §3.8). With the longest delivery id and
    `skipped` = 2^53-1 its length is the size a publish counts against `maxEnvelopeBytes`
    (topics.md §3.4 check 10), whatever delivery it becomes. `attachments` (topics.md §6.1) is
    present only when given: a frame without attachments stays byte-identical to one of a store-less
    router."""
    params = {
        "deliveryId": delivery_id,
        "topic": topic,
        "topicIncarnation": incarnation,
        "sequence": sequence,
        "skipped": skipped,
        "publisher": publisher,
        "payload": payload,
    }
    if attachments is not None:
        params["attachments"] = attachments
    return orjson.dumps({"jsonrpc": "2.0", "method": "bus.message", "params": params})
