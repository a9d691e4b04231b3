"""Fuzzing the router (wire.md §2–§4, §6–§10, §14): bad input never kills it and leaks nothing.

Two tests. `test_router_survives_random_and_mutated_frames` plays scripted rounds against an
in-process router per example (about 60 frames an example). The state machine test
(`RouterMachine`, see its section below) drives raw connections to a `flyd router` process and
carries the volume: the test run asserts that the router read at least 100 000 frames (its own
`framesIn` counter) after a warm-up, and that its fd count and RSS are back within 10 % of the
warm baseline afterwards.

In the first test, each example starts its own router on a fresh uvloop loop and plays rounds
of raw connections against it: the connections of a round run concurrently, rounds run one
after another, and a connection may stay open across rounds. Connections send valid requests
with random params to every op, mutated frames (bit flips, truncation, wrong prefixes,
duplicated keys, bad ids, bad members) and random bytes, then end in one of several ways
(close, half-close, reset, a frame cut short). Throughout, every frame the router sends must be
a strict, schema-valid frame with `bus.closing` (or a refused hello) as the last one.
Afterwards the router must still answer `bus.stats` on a fresh connection and, once everything
is closed, its gauges must settle back to the baseline.

`make fuzz` runs both with `--hypothesis-profile=fuzz` (registered in conftest.py, because the
option is applied before test modules are imported): 2000 scripted examples, and state machine
examples until 2 000 000 frames. `HYPOTHESIS_PROFILE=<name>` also selects a profile. The
default run uses the quick profile registered below, and so does a run under hypothesis's own
"ci" profile (loaded by itself when a CI environment variable is set).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import random
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import psutil
import pytest
import uvloop
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from bus import codec
from bus.client_connection import Validators
from bus.errors import BusError
from bus.limits import REMEMBERED_INCARNATIONS, Limits, snake_case
from bus.policy import Policy
from bus.router import Router, RouterConfig

settings.register_profile(
    "bus-fuzz-quick", max_examples=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _profile_name() -> str:
    """The quick profile unless one was chosen: hypothesis loads its own "ci" profile by itself
    when it sees a CI environment, and that must not turn a CI run into the long fuzz."""
    chosen = os.environ.get("HYPOTHESIS_PROFILE") or settings.get_current_profile_name()
    return "bus-fuzz-quick" if chosen in ("default", "ci") else chosen


PROFILE = _profile_name()
pytestmark = pytest.mark.timeout(240 if PROFILE == "bus-fuzz-quick" else 6 * 3600)

LIMITS = Limits().replace(
    maxEnvelopeBytes=65536, maxClients=16, maxServices=3, maxServiceQueued=4,
    maxServiceInFlight=2, maxActiveCallsPerClient=4, maxOpenRequestsPerClient=3,
    maxQueuedCallBytes=65536, maxControlFrames=8, maxControlBytes=65536, maxExpectations=2,
    helloTimeoutMs=2000, writeHighWaterBytes=65536,
)
MAX_ID = 2**53 - 1
GAUGES = ("connections", "pendingConnections", "clients", "services", "expectations", "calls",
          "activeCalls", "queuedCalls", "dispatchedCalls", "detachedCalls", "repliedCalls",
          "replyCapabilities", "queuedCallBytes",
          # docs/topics.md §10: topics and their messages settle with their connections (#171)
          "topics", "subscriptions", "queuedMessages", "queuedTopicBytes", "messageDeliveries",
          # and so do the store's artifacts, bytes and holds (#171)
          "store")
ART_REF = st.sampled_from(["$art", "$art", "$art", "art-1"])

# --- strategies -------------------------------------------------------------------------------

json_leaf = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
             | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12))
json_key = st.sampled_from(["a", "b", "id", "params", "", "é", "\u0000"]) | st.text(max_size=4)
json_any = st.recursive(
    json_leaf,
    lambda children: (st.lists(children, max_size=3)
                      | st.dictionaries(json_key, children, max_size=3)),
    max_leaves=6,
)
json_object = st.dictionaries(json_key, json_any, max_size=3)
# the large ones hit the outbound size checks and the queued-bytes budget (wire.md §7.3, §7.4)
plain_object = st.sampled_from([{}, {"n": 1}, {"s": "x" * 200}, {"deep": [[[{"a": None}]]]},
                                {"requestId": "req-1", "scope": None, "params": {}},
                                {"big": "x" * 30000}, {"big": "x" * 65300}])

CLIENT_IDS = ["fz-a", "fz-b", "fz-c", "fz-d"]
NAMES = ["fz.a", "fz.b", "fz.a.b", "fz", "", "FZ", ".fz", "fz..a", "fz.", "a" * 193, "fz.*"]
small_int = st.sampled_from([0, 1, 2, 3, 4, 5, 16, 17, 65535, 65536, -1, MAX_ID, MAX_ID + 1])
dlv_ref = st.sampled_from(["$dlv", "$dlv", "$dlv", "dlv-1", "dlv-2"])
grant_list = st.lists(st.sampled_from(["*", "fz.*", "fz.a", "fz.{clientId}", "", "Bad"]),
                      max_size=3)
grants = st.none() | st.fixed_dictionaries({}, optional={"register": grant_list,
                                                        "call": grant_list})

# Mostly valid values: they get past the schema checks into the op checks and routing state.
GOOD: dict[str, st.SearchStrategy[Any]] = {
    "name": st.sampled_from(["fz.a", "fz.b"]),
    "target": st.sampled_from(["fz.a", "fz.b"] * 4 + ["fz.c"]),
    "prefix": st.sampled_from(["", "fz", "fz.a"]),
    "maxQueued": st.integers(1, 5),
    "maxInFlight": st.integers(1, 3),
    "serviceIncarnation": st.sampled_from(["$svc", "$svc", "svc-1"]),
    "expectedIncarnation": st.sampled_from([None] * 8 + ["$svc", "svc-1"]),
    "method": st.sampled_from(["M", "Worker.Status"]),
    "payload": plain_object | json_object,
    "outcome": plain_object | json_object,
    "deliveryId": dlv_ref,
    "deliveryIds": st.lists(dlv_ref, min_size=1, max_size=3),
    "callId": st.sampled_from(["$call", "$call", "$call", 1]),
    "detail": st.booleans(),
    "clientId": st.sampled_from([*CLIENT_IDS, "fz-e"]),
    "pid": st.sampled_from(["$pid", "$pid", 1]),
    "clientIncarnation": st.sampled_from([None, None, "inc-x"]),
    "ttlMs": st.sampled_from([100, 30000]),
    "grants": grants,
    "supportedMajors": st.just([1]),
    # topics (docs/topics.md §3)
    "topic": st.sampled_from(["fz.t", "fz.t", "fz.u"]),
    "retain": st.booleans(),
    "maxBounded": st.integers(0, 2),
    "topicIncarnation": st.sampled_from(["$top", "$top", "top-1"]),
    "mode": st.sampled_from(["latest", "latest", "bounded"]),
    "depth": st.integers(1, 3),
    "window": st.integers(1, 3),
    "retained": st.booleans(),
    # the artifact store (docs/topics.md §5, §6)
    "length": st.sampled_from([1, 16, 4096, 70000]),
    "artifactId": ART_REF,
    "digest": st.sampled_from(["$digest"] * 4 + ["0" * 64]),
    "artifactIds": st.lists(ART_REF, min_size=1, max_size=3),
    "attachments": st.lists(ART_REF, max_size=3),
    "transfer": st.booleans(),
}
# Anything goes: types, ranges, patterns and sizes the schemas must refuse.
WILD: dict[str, st.SearchStrategy[Any]] = {
    "name": st.sampled_from(NAMES) | st.text(max_size=6) | json_any,
    "target": st.sampled_from(NAMES) | st.text(max_size=6) | json_any,
    "prefix": st.sampled_from(["FZ", "a" * 193, "*"]) | json_any,
    "maxQueued": small_int | json_any,
    "maxInFlight": small_int | json_any,
    "serviceIncarnation": st.sampled_from(["svc-0", "svc-01", "svc-9007199254740992", "x"])
    | json_any,
    "expectedIncarnation": st.sampled_from(["svc-0", "svc-01", "", "x"]) | json_any,
    "method": st.sampled_from(["", "\x7f", "é", "x" * 129]) | json_any,
    "payload": json_any,
    "outcome": json_any,
    "deliveryId": st.sampled_from(["dlv-0", "dlv-01", "dlv-9007199254740991",
                                   "dlv-9007199254740992", "dlv-x", "dlv-", "dlv-99"])
    | json_any,
    "deliveryIds": (st.lists(dlv_ref, min_size=2, max_size=4)
                    | st.just([f"dlv-{i}" for i in range(1, 66)])
                    | st.just(["dlv-1", "dlv-99"]) | st.just([]) | json_any),
    "callId": small_int | json_any,
    "detail": json_any,
    "clientId": st.sampled_from(["Bad", "", "x" * 65]) | json_any,
    "pid": st.sampled_from([0, 4194304, 4194305, -1]) | json_any,
    "clientIncarnation": st.sampled_from(["BAD", ""]) | json_any,
    "ttlMs": st.sampled_from([0, 1, 300000, 300001]) | json_any,
    "grants": json_any,
    "supportedMajors": st.sampled_from([[2], [1, 1], [], [0], [1, 2], list(range(1, 18))])
    | json_any,
    "topic": st.sampled_from(NAMES) | json_any,
    "retain": json_any,
    "maxBounded": small_int | json_any,
    "topicIncarnation": st.sampled_from(["top-0", "top-01", "svc-1", ""]) | json_any,
    "mode": st.sampled_from(["", "Latest", "all"]) | json_any,
    "depth": small_int | json_any,
    "window": small_int | json_any,
    "retained": json_any,
    "length": small_int | json_any,
    "artifactId": st.sampled_from(["art-0", "art-01", "x", ""]) | json_any,
    "digest": st.sampled_from(["", "G" * 64, "0" * 63, "0" * 65]) | json_any,
    "artifactIds": st.just([]) | st.just([f"art-{i}" for i in range(1, 18)]) | json_any,
    "attachments": st.just(["art-1", "art-1"]) | json_any,
    "transfer": json_any,
}
OP_KEYS: dict[str, list[str]] = {
    "bus.hello": ["clientId", "clientIncarnation", "supportedMajors"],
    "bus.register": ["name", "maxQueued", "maxInFlight"],
    "bus.unregister": ["name", "serviceIncarnation"],
    "bus.call": ["target", "expectedIncarnation", "method", "payload"],
    "bus.reply": ["deliveryId", "outcome"],
    "bus.release": ["deliveryId"],
    "bus.cancel": ["callId"],
    "bus.consumed": ["deliveryIds"],
    "bus.services": ["prefix"],
    "bus.stats": ["detail"],
    "bus.expect": ["clientId", "pid", "clientIncarnation", "ttlMs", "grants"],
    "bus.declare": ["topic", "retain", "maxBounded"],
    "bus.undeclare": ["topic", "topicIncarnation"],
    "bus.publish": ["topic", "expectedIncarnation", "payload"],
    "bus.subscribe": ["topic", "mode", "depth", "window", "retained"],
    "bus.unsubscribe": ["topic"],
    "bus.topics": ["prefix"],
    "bus.allocate": ["length"],
    "bus.seal": ["artifactId", "digest"],
    "bus.retain": ["artifactIds"],
    "bus.drop": ["artifactIds"],
    "bus.nope": [],
    "": [],
}
RARE_OPS = ["bus.hello", "bus.nope", ""]
ROLE_OPS = {
    "service": ["bus.register"] + ["bus.reply"] * 8 + ["bus.consumed"] * 4
    + ["bus.release", "bus.unregister", "bus.call", "bus.stats", "bus.services"],
    "caller": ["bus.call"] * 10 + ["bus.cancel"] * 3 + ["bus.consumed"] * 3
    + ["bus.expect", "bus.stats", "bus.services", "bus.register"],
    "mixed": ["bus.register", "bus.call", "bus.call", "bus.reply", "bus.reply",
              "bus.consumed", "bus.consumed", "bus.cancel", "bus.release", "bus.unregister",
              "bus.expect", "bus.stats", "bus.services",
              "bus.declare", "bus.publish", "bus.publish", "bus.subscribe", "bus.unsubscribe",
              "bus.undeclare", "bus.topics",
              "bus.allocate", "bus.allocate", "bus.seal", "bus.seal", "bus.retain", "bus.drop"],
}
#: ops whose frames may carry attachments (docs/topics.md §6.1)
ATTACHING = ("bus.call", "bus.reply", "bus.publish")


@st.composite
def params_for(draw: st.DrawFn, op: str) -> Any:
    keys = OP_KEYS[op]
    mode = draw(st.sampled_from(["good"] * 24 + ["one-wild"] * 3 + ["wild", "wild", "subset",
                                                                     "extra", "random"]))
    if mode == "random":
        return draw(json_object)
    if mode == "subset":
        keys = draw(st.lists(st.sampled_from(keys), unique=True)) if keys else []
    table = WILD if mode == "wild" else GOOD
    params = {k: draw(table[k]) for k in keys}
    if mode == "one-wild" and keys:
        key = draw(st.sampled_from(keys))
        params[key] = draw(WILD[key])
    if mode == "extra":
        params[draw(st.text(max_size=6))] = draw(json_any)
    if op == "bus.expect" and "ttlMs" in params and draw(st.booleans()):
        del params["ttlMs"]  # optional members may be omitted
    if op in ATTACHING and mode != "random" and draw(st.sampled_from([True] + [False] * 3)):
        table = WILD if mode == "wild" else GOOD
        params["attachments"] = draw(table["attachments"])
        params["transfer"] = draw(table["transfer"])
    return params


GOOD_ID_MODES = st.sampled_from(["next"] * 15 + ["gap"])
BAD_ID_MODES = st.sampled_from(["same", "back", "zero", "big", "float", "bool", "str", "null",
                                "missing"])
GOOD_FORMS = st.sampled_from(["obj"] * 15 + ["omit"])
BAD_FORMS = st.sampled_from(["array", "null", "string"])


@st.composite
def request_action(draw: st.DrawFn, role: str = "mixed") -> tuple[Any, ...]:
    rare = draw(st.sampled_from([True] + [False] * 19))
    op = draw(st.sampled_from(RARE_OPS if rare else ROLE_OPS[role]))
    return ("req", op, draw(params_for(op)), draw(GOOD_ID_MODES), draw(GOOD_FORMS))


@st.composite
def bad_request_action(draw: st.DrawFn) -> tuple[Any, ...]:
    """A request with a bad id or a bad params member (wire.md §4 checks 3 and 4)."""
    _, op, params, id_mode, form = draw(request_action())
    if draw(st.booleans()):
        id_mode = draw(BAD_ID_MODES)
    else:
        form = draw(BAD_FORMS)
    return ("req", op, params, id_mode, form)


MUTATIONS = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 10_000), st.integers(0, 7)),
    st.tuples(st.just("truncbody"), st.integers(1, 10_000)),
    st.tuples(st.just("dupkey"), st.sampled_from(["id", "jsonrpc", "method", "nested"])),
    st.tuples(st.just("prefix"), st.sampled_from(["be", "zero", "huge", "over", "-1", "+1",
                                                  "+3"])),
    st.tuples(st.just("split"), st.lists(st.integers(1, 40), min_size=1, max_size=6)),
    st.tuples(st.just("shape"), st.sampled_from(["extra-member", "jsonrpc-1.0", "no-jsonrpc",
                                                 "method-int", "notification", "response",
                                                 "batch", "lead-ws", "trail-ws", "trailing",
                                                 "bad-utf8", "deep", "nan", "big-int"])),
)


@st.composite
def mutated_action(draw: st.DrawFn) -> tuple[Any, ...]:
    return ("mut", draw(request_action()), draw(MUTATIONS))


@st.composite
def split_action(draw: st.DrawFn, role: str) -> tuple[Any, ...]:
    """A well-formed request written in pieces (wire.md §2): not a violation."""
    cuts = draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    return ("mut", draw(request_action(role)), ("split", cuts))


@st.composite
def poison_action(draw: st.DrawFn) -> tuple[Any, ...]:
    kind = draw(st.sampled_from(["mut", "mut", "mut", "badreq", "bytes", "json"]))
    if kind == "mut":
        return draw(mutated_action())
    if kind == "badreq":
        return draw(bad_request_action())
    if kind == "bytes":
        return ("bytes", draw(st.binary(min_size=1, max_size=48)))
    return ("json", draw(json_any))


POISON = poison_action()


@st.composite
def action_for(draw: st.DrawFn, role: str) -> tuple[Any, ...]:
    kind = draw(st.sampled_from(["req"] * 30 + ["split", "split"] + ["yield"] * 6
                                + ["poison", "file", "file"]))
    if kind == "req":
        return draw(request_action(role))
    if kind == "split":
        return draw(split_action(role))
    if kind == "yield":
        return ("yield", draw(st.integers(1, 8)))
    if kind == "file":
        return ("file", draw(FILE_ACTIONS))
    return draw(POISON)


HELLOS = st.sampled_from(["fresh"] * 12 + ["reused", "bad", "none", "late"])
ENDINGS = st.sampled_from(["close", "close", "eof", "abort", "truncated", "keep", "keep",
                           "keep"])


@dataclass
class Script:
    client_id: str
    role: str
    hello: str
    actions: list[tuple[Any, ...]]
    tail: list[tuple[Any, ...]]
    delay: int
    ending: str
    auto: str | None = None  # how the reader answers deliveries by itself (see Conn.auto_answer)
    first: bool = False  # a responder: its registration completes before the round starts


@st.composite
def scripts(draw: st.DrawFn) -> Script:
    role = draw(st.sampled_from(["service", "caller", "caller", "caller", "mixed"]))
    actions = draw(st.lists(action_for(role), max_size=12))
    if role == "service" and draw(st.sampled_from([True, True, True, False])):
        actions.insert(0, _register(draw))
    return Script(
        client_id=draw(st.sampled_from(["unique"] * 6 + CLIENT_IDS)),
        role=role,
        hello=draw(HELLOS),
        actions=actions,
        tail=draw(st.lists(POISON, max_size=1 if role == "service" else 2)
                  if draw(st.booleans()) else st.just([])),
        delay=draw(st.integers(0, 3) if role == "service" else st.integers(0, 30)),
        ending=draw(st.sampled_from(["keep", "keep", "close"]) if role == "service"
                    else ENDINGS),
        auto=draw(st.sampled_from([None, "consume", "mixed"])),
    )


def _register(draw: st.DrawFn) -> tuple[Any, ...]:
    return ("req", "bus.register", {
        "name": draw(st.sampled_from(["fz.a", "fz.b"])),
        "maxQueued": draw(st.integers(1, 4)), "maxInFlight": draw(st.integers(1, 2)),
    }, "next", "obj")


@st.composite
def responders(draw: st.DrawFn) -> Script:
    """A well-behaved service that answers its requests by itself (echo, hold or release), so
    the fuzzed callers reach admission, dispatch, replies, results and every cancel state."""
    return Script(
        client_id="unique", role="service", hello="fresh",
        actions=[_register(draw), *draw(st.lists(
            st.tuples(st.just("yield"), st.integers(1, 8)), max_size=2))],
        tail=[], delay=0,
        ending=draw(st.sampled_from(["keep"] * 6 + ["close", "abort"])),
        auto=draw(st.sampled_from(["echo", "hold", "release", "mixed", "mixed"])),
        first=True,
    )


@st.composite
def cases(draw: st.DrawFn) -> list[list[Script]]:
    rounds = draw(st.lists(st.lists(scripts(), min_size=1, max_size=3), min_size=1,
                           max_size=4))
    for round_ in rounds:
        count = draw(st.sampled_from([0, 1, 1, 2, 2]))
        services = [draw(responders()) for _ in range(count)]
        for name, svc in zip(("fz.a", "fz.b"), services, strict=False):
            svc.actions[0][2]["name"] = name
        round_[:0] = services
    return rounds


# --- the player -------------------------------------------------------------------------------


def router_frame(v: Validators, body: bytes,
                 final: str | None) -> tuple[dict[str, Any], None] | tuple[None, str]:
    """One router frame decoded and checked (wire.md §2–§4, §8, §15): strict JSON, a JSON-RPC
    object, a valid response or a known notification with valid params, and nothing after the
    connection's final frame; else what is wrong with it."""
    if final is not None:
        return None, f"a frame after the final {final}: {body[:200]!r}"
    try:
        msg = codec.decode(body)
    except BusError as exc:
        return None, f"router frame is not strict JSON ({exc.message}): {body[:200]!r}"
    if type(msg) is not dict or msg.get("jsonrpc") != "2.0":
        return None, f"router frame is not a JSON-RPC object: {body[:200]!r}"
    if "id" in msg:
        problem = v.response(msg)
        return (None, f"bad response ({problem}): {body[:300]!r}") if problem else (msg, None)
    method = msg.get("method")
    check = v.notifications.get(method) if isinstance(method, str) else None
    if check is None or set(msg) != {"jsonrpc", "method", "params"}:
        return None, f"bad notification: {body[:300]!r}"
    problem = check(msg["params"])
    if problem is not None:
        return None, f"bad {method} ({problem}): {body[:300]!r}"
    return msg, None


@dataclass
class Conn:
    """One raw fuzz connection and what its reader saw."""

    name: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    problems: list[str]
    last_id: int = 0
    tainted: bool = False
    dead: bool = False
    sent: dict[int, str] = field(default_factory=dict)
    dlv: list[str] = field(default_factory=list)
    svc: list[str] = field(default_factory=list)
    top: list[str] = field(default_factory=list)
    art: list[str] = field(default_factory=list)
    lengths: dict[str, int] = field(default_factory=dict)
    store_path: str | None = None
    sent_calls: list[int] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    auto: str | None = None
    answered: int = 0
    last_response: int = 0
    responded: set[int] = field(default_factory=set)
    eof: bool = False
    ended: bool = False  # we closed, half-closed or reset our side
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    def fail(self, message: str) -> None:
        self.problems.append(f"{self.name}: {message}")

    async def read_all(self) -> None:
        try:
            await self._read_all()
        finally:
            self.eof = True
            self.progress.set()

    async def wait_response(self, rid: int) -> None:
        """Until the response to `rid` (or EOF) has been read."""
        while self.last_response < rid and not self.eof:
            self.progress.clear()
            await self.progress.wait()

    async def _read_all(self) -> None:
        """Read until EOF, checking every router frame (wire.md §2–§4, §8, §15)."""
        v = Validators.get()
        final: str | None = None
        while True:
            try:
                prefix = await self.reader.readexactly(4)
            except asyncio.IncompleteReadError as exc:
                # Only our own close may cut a frame short (wire.md §10.2): a close the router
                # starts ends with a whole bus.closing.
                if exc.partial and not self.ended:
                    self.fail(f"router sent a partial prefix {exc.partial!r}")
                return
            except ConnectionError:
                return
            (n,) = struct.unpack("<I", prefix)
            if not 1 <= n <= LIMITS.maxEnvelopeBytes:
                self.fail(f"router frame length {n}")
                return
            try:
                body = await self.reader.readexactly(n)
            except (asyncio.IncompleteReadError, ConnectionError):
                if not self.ended:
                    self.fail("router frame cut short")
                return
            msg, problem = router_frame(v, body, final)
            if msg is None:
                self.fail(problem)
                return
            if "id" in msg:
                rid = msg["id"]
                if rid <= self.last_response:
                    self.fail(f"response {rid} after response {self.last_response}")
                self.last_response = rid
                self.responded.add(rid)
                self.progress.set()
                method = self.sent.get(rid)
                if "result" in msg and method in v.results and not self.tainted:
                    problem = v.results[method](msg["result"])
                    if problem is not None:
                        self.fail(f"bad {method} result ({problem}): {body[:300]!r}")
                    if method == "bus.register":
                        self.svc.append(msg["result"]["serviceIncarnation"])
                    if method == "bus.declare":
                        self.top.append(msg["result"]["topicIncarnation"])
                    learn_store(self, method, msg["result"])
                if "error" in msg:
                    if self.sent.get(rid) == "bus.hello" and not self.tainted:
                        final = "refused hello"
                    data = msg["error"]["data"]
                    if data["dispatch"] != "not-dispatched":
                        self.fail(f"an error response with dispatch {data['dispatch']}")
                continue
            method, params = msg["method"], msg["params"]
            if method in ("bus.request", "bus.result", "bus.message"):
                learn_attachments(self, params)
                self.dlv.append(params["deliveryId"])
                if self.auto is not None:
                    self.auto_answer(method, params)
            elif method == "bus.closing":
                final = "bus.closing"
                if params["error"]["data"]["dispatch"] != "unknown":
                    self.fail(f"bus.closing with dispatch {params['error']['data']}")

    def auto_answer(self, method: str, params: dict[str, Any]) -> None:
        """Answer a delivery at once: reply or release (or hold) a request, then consume it;
        consume a result. Ids come from the same counter as the script's requests."""
        dlv = params["deliveryId"]
        if method == "bus.request":
            mode = self.auto
            if mode == "mixed":
                mode = ("echo", "hold", "release")[self.answered % 3]
            self.answered += 1
            if mode == "consume" or mode == "hold":
                return  # the script's own actions may answer it
            if mode == "echo":
                self.write_request("bus.reply", {"deliveryId": dlv,
                                                 "outcome": {"echo": params["payload"]}})
            else:
                self.write_request("bus.release", {"deliveryId": dlv})
        self.write_request("bus.consumed", {"deliveryIds": [dlv]})

    def write_request(self, method: str, params: dict[str, Any]) -> None:
        if self.dead or self.writer.is_closing():
            return
        self.last_id += 1
        if not self.tainted:
            self.sent[self.last_id] = method
        try:
            self.writer.write(_frame(orjson.dumps({"jsonrpc": "2.0", "id": self.last_id,
                                                   "method": method, "params": params})))
        except (ConnectionError, RuntimeError):
            self.dead = True

    async def send(self, data: bytes, tainted: bool = True) -> None:
        if self.dead:
            return
        self.tainted = self.tainted or tainted
        try:
            self.writer.write(data)
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            self.dead = True

    def next_id(self, mode: str) -> Any:
        if mode == "next":
            self.last_id += 1
            return self.last_id
        if mode == "gap":
            self.last_id += 1000
            return self.last_id
        return {"same": self.last_id, "back": max(self.last_id - 1, 0), "zero": 0,
                "big": MAX_ID + 1, "float": float(self.last_id + 1), "bool": True,
                "str": str(self.last_id + 1), "null": None, "missing": "missing"}[mode]


def _resolve(value: Any, conn: Conn | Sock, counter: list[int]) -> Any:
    """Fill in the `$` placeholders with what the connection learned (or a plausible guess)."""
    if isinstance(value, str) and value.startswith("$"):
        counter[0] += 1
        i = counter[0]
        if value == "$dlv":
            return conn.dlv[-1 - (i - 1) % len(conn.dlv)] if conn.dlv else "dlv-1"
        if value == "$svc":
            return conn.svc[-1] if conn.svc else "svc-1"
        if value == "$top":
            return conn.top[-1] if conn.top else "top-1"
        if value == "$call":
            calls = conn.sent_calls
            return calls[-1 - (i - 1) % len(calls)] if calls else 1
        if value == "$pid":
            return os.getpid()
        if value == "$art":
            return conn.art[-1 - (i - 1) % len(conn.art)] if conn.art else "art-1"
        if value == "$digest":
            last = conn.art[-1] if conn.art else None
            return hashlib.sha256(bytes(conn.lengths.get(last or "", 0))).hexdigest()
    if isinstance(value, list):
        return [_resolve(x, conn, counter) for x in value]
    if isinstance(value, dict):
        return {k: _resolve(x, conn, counter) for k, x in value.items()}
    return value


FILE_ACTIONS = st.sampled_from(["write", "write", "truncate", "symlink", "grow"])


def learn_store(conn: Conn | Sock, method: str | None, result: dict[str, Any]) -> None:
    """The store path of a hello and the ids of allocations, for `$art`, `$digest` and the
    file actions."""
    if method == "bus.hello" and result.get("store"):
        conn.store_path = result["store"]["path"]
    elif method == "bus.allocate":
        conn.art.append(result["artifactId"])
        conn.lengths[result["artifactId"]] = result["length"]
        del conn.art[:-16]


def learn_attachments(conn: Conn | Sock, params: dict[str, Any]) -> None:
    for att in params.get("attachments", ()):
        conn.art.append(att["artifactId"])
    del conn.art[:-16]


def file_action(conn: Conn | Sock, kind: str) -> None:
    """What a client of the router's uid may do to a file of the store (docs/topics.md §5.4):
    write into it (sealed or not), truncate or grow it, or swap it for a symlink. The router
    must never follow, and refuse a seal of a changed file."""
    if conn.store_path is None or not conn.art:
        return
    path = os.path.join(conn.store_path, conn.art[-1])
    try:
        if kind == "symlink":
            os.unlink(path)
            os.symlink(os.devnull, path)
            return
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if kind == "write":
            os.pwrite(fd, os.urandom(16), 0)
        elif kind == "truncate":
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - 1))
        else:
            os.ftruncate(fd, os.fstat(fd).st_size + 1)
    except OSError:
        pass
    finally:
        os.close(fd)


def _build(conn: Conn | Sock, action: tuple[Any, ...]) -> tuple[dict[str, Any], bool]:
    """The request object of a `req` action, and whether it is well formed (untainted)."""
    _, op, params, id_mode, form = action
    rid = conn.next_id(id_mode)
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": op}
    if rid != "missing":
        msg["id"] = rid
    params = _resolve(params, conn, [0])
    if form == "obj":
        msg["params"] = params
    elif form == "array":
        msg["params"] = [params]
    elif form == "null":
        msg["params"] = None
    elif form == "string":
        msg["params"] = "{}"
    ok = id_mode in ("next", "gap") and form in ("obj", "omit")
    return msg, ok


def _dumps(obj: Any) -> bytes | None:
    try:
        return orjson.dumps(obj)
    except (orjson.JSONEncodeError, TypeError):
        return None


def _frame(body: bytes) -> bytes:
    return struct.pack("<I", len(body)) + body


def _mutate(body: bytes, msg: dict[str, Any], mutation: tuple[Any, ...]) -> list[bytes]:
    """Chunks to send for a mutated request frame."""
    kind = mutation[0]
    if kind == "flip":
        pos = mutation[1] % len(body)
        b = bytearray(body)
        b[pos] ^= 1 << mutation[2]
        return [_frame(bytes(b))]
    if kind == "truncbody":
        return [_frame(body[: max(1, mutation[1] % len(body))])]
    if kind == "dupkey":
        which = mutation[1]
        if which == "nested":
            return [_frame(body.replace(b'"params":{', b'"params":{"k":1,"k":2,', 1))]
        dup = {"id": b'"id":1,', "jsonrpc": b'"jsonrpc":"2.0",', "method": b'"method":"x",'}
        return [_frame(b"{" + dup[which] + body[1:])]
    if kind == "prefix":
        n = len(body)
        where = mutation[1]
        prefix = {"be": struct.pack(">I", n), "zero": struct.pack("<I", 0),
                  "huge": struct.pack("<I", 2**32 - 1),
                  "over": struct.pack("<I", LIMITS.maxEnvelopeBytes + 1),
                  "-1": struct.pack("<I", max(n - 1, 1)), "+1": struct.pack("<I", n + 1),
                  "+3": struct.pack("<I", n + 3)}[where]
        return [prefix + body]
    if kind == "split":
        data = _frame(body)
        chunks, at = [], 0
        for size in mutation[1]:
            if at >= len(data):
                break
            chunks.append(data[at:at + size])
            at += size
        if at < len(data):
            chunks.append(data[at:])
        return chunks
    shape = mutation[1]
    other: Any
    if shape == "extra-member":
        other = {**msg, "extra": 1}
    elif shape == "jsonrpc-1.0":
        other = {**msg, "jsonrpc": "1.0"}
    elif shape == "no-jsonrpc":
        other = {k: v for k, v in msg.items() if k != "jsonrpc"}
    elif shape == "method-int":
        other = {**msg, "method": 7}
    elif shape == "notification":
        other = {k: v for k, v in msg.items() if k != "id"}
    elif shape == "response":
        other = {"jsonrpc": "2.0", "id": msg.get("id", 1), "result": {}}
    elif shape == "batch":
        other = [msg]
    elif shape == "lead-ws":
        return [_frame(b" " + body)]
    elif shape == "trail-ws":
        return [_frame(body + b"\n")]
    elif shape == "trailing":
        return [_frame(body + b"{}")]
    elif shape == "bad-utf8":
        return [_frame(body.replace(b'"2.0"', b'"2.\xc0\x80"', 1))]
    elif shape == "deep":
        return [_frame(b'{"jsonrpc":"2.0","id":%d,"method":"bus.stats","params":{"a":%s%s}}'
                       % (msg.get("id") if isinstance(msg.get("id"), int) else 1,
                          b"[" * 130, b"]" * 130))]
    elif shape == "nan":
        return [_frame(body.replace(b'"jsonrpc":"2.0"', b'"jsonrpc":"2.0","x":NaN', 1))]
    else:
        assert shape == "big-int"
        return [_frame(body.replace(b'"jsonrpc":"2.0"', b'"jsonrpc":"2.0","x":1e400', 1))]
    encoded = _dumps(other)
    return [_frame(encoded)] if encoded is not None else []


class Player:
    def __init__(self, path: str) -> None:
        self.path = path
        self.problems: list[str] = []
        self.incarnations = 0
        self.open: list[Conn] = []
        self.count = 0

    async def connect(self) -> Conn | None:
        self.count += 1
        name = f"conn#{self.count}"
        try:
            reader, writer = await asyncio.open_unix_connection(self.path, limit=2**20)
        except OSError as exc:
            self.problems.append(f"connect failed: {exc}")
            return None
        conn = Conn(name, reader, writer, self.problems)
        conn.task = asyncio.get_running_loop().create_task(conn.read_all())
        self.open.append(conn)
        return conn

    async def hello(self, conn: Conn, script: Script) -> None:
        if script.hello == "none":
            return
        if script.hello == "bad":
            action = ("req", "bus.hello", _bad_hello_params(script), "next", "obj")
        else:
            self.incarnations += 1
            inc = "inc-1" if script.hello == "reused" else f"inc-{self.incarnations}"
            client_id = script.client_id
            if client_id == "unique":
                client_id = f"fz-u{conn.name[5:]}"
            action = ("req", "bus.hello", {"clientId": client_id,
                                           "clientIncarnation": inc,
                                           "supportedMajors": [1]}, "next", "obj")
        await self.request(conn, action)

    async def request(self, conn: Conn, action: tuple[Any, ...]) -> None:
        msg, ok = _build(conn, action)
        body = _dumps(msg)
        if body is None:
            return
        if ok and not conn.tainted:
            conn.sent[msg["id"]] = msg["method"]
        if msg["method"] == "bus.call" and isinstance(msg.get("id"), int):
            conn.sent_calls.append(msg["id"])
        await conn.send(_frame(body), tainted=not ok)

    async def play(self, conn: Conn, action: tuple[Any, ...]) -> None:
        kind = action[0]
        if kind == "req":
            await self.request(conn, action)
        elif kind == "mut":
            msg, _ = _build(conn, action[1])
            body = _dumps(msg)
            if body is None:
                return
            chunks = _mutate(body, msg, action[2])
            # a split frame is a valid frame: its response may be checked
            clean = action[2][0] == "split"
            if clean and not conn.tainted and isinstance(msg.get("id"), int) and _ok(action[1]):
                conn.sent[msg["id"]] = msg["method"]
            for chunk in chunks:
                await conn.send(chunk, tainted=not (clean and _ok(action[1])))
                await asyncio.sleep(0)
        elif kind == "bytes":
            await conn.send(action[1])
        elif kind == "json":
            body = _dumps(action[1])
            if body is not None:
                await conn.send(_frame(body))
        elif kind == "file":
            file_action(conn, action[1])
        else:
            assert kind == "yield"
            for _ in range(action[1]):
                await asyncio.sleep(0)

    async def run_round(self, scripts: list[Script]) -> None:
        """Responders register first; then every connection of the round runs at once."""
        ready = [asyncio.Event() for s in scripts if s.first]
        first = [self.run_script(s, e) for s, e in
                 zip([s for s in scripts if s.first], ready, strict=True)]
        tasks = [asyncio.get_running_loop().create_task(c) for c in first]
        for event in ready:
            await event.wait()
        await asyncio.gather(*tasks, *(self.run_script(s) for s in scripts if not s.first))

    async def run_script(self, script: Script, ready: asyncio.Event | None = None) -> None:
        try:
            await self._run_script(script, ready)
        finally:
            if ready is not None:
                ready.set()

    async def _run_script(self, script: Script, ready: asyncio.Event | None) -> None:
        for _ in range(script.delay):  # interleaving with the round's other connections
            await asyncio.sleep(0)
        conn = await self.connect()
        if conn is None:
            return
        conn.auto = script.auto
        if script.hello != "late":
            await self.hello(conn, script)
        for i, action in enumerate(script.actions + script.tail):
            if script.hello == "late" and i == len(script.actions) // 2:
                await self.hello(conn, script)
            await self.play(conn, action)
            if ready is not None:
                await conn.wait_response(conn.last_id)
                ready.set()
                ready = None
            await asyncio.sleep(0)
        await self.end(conn, script.ending)

    async def end(self, conn: Conn, ending: str) -> None:
        if ending == "keep":
            return
        conn.ended = True
        if ending == "truncated":
            await conn.send(struct.pack("<I", 40) + b'{"jsonrpc":"2.0"')
        if ending == "eof":
            if not conn.dead:
                conn.dead = True  # nothing more may be written after the EOF
                try:
                    conn.writer.write_eof()
                except (OSError, RuntimeError):
                    pass
            return  # the router closes its side once it has seen the EOF
        if ending == "abort":
            conn.writer.transport.abort()
        else:
            conn.writer.close()

    async def close_all(self) -> None:
        # wire.md §4: every request after a successful hello gets exactly one response. A
        # well-formed connection the router did not end must have them all.
        for conn in self.open:
            if conn.tainted or conn.dead or conn.writer.is_closing() or not conn.sent:
                continue
            try:
                async with asyncio.timeout(15):
                    # the reader's auto-answers may send more requests meanwhile
                    while conn.last_response < conn.last_id and not conn.eof:
                        await conn.wait_response(conn.last_id)
            except TimeoutError:
                pass
            missing = sorted(set(conn.sent) - conn.responded)
            if missing and not conn.eof:
                self.problems.append(f"{conn.name}: no response to ids {missing[:10]}")
        for conn in self.open:
            conn.ended = True
            conn.writer.close()
        for conn in self.open:
            assert conn.task is not None
            try:
                async with asyncio.timeout(15):
                    await conn.task
            except TimeoutError:
                self.problems.append(f"{conn.name}: the reader never saw EOF")
            try:
                await conn.writer.wait_closed()
            except OSError:
                pass


def _ok(action: tuple[Any, ...]) -> bool:
    return action[3] in ("next", "gap") and action[4] in ("obj", "omit")


def _bad_hello_params(script: Script) -> dict[str, Any]:
    """A hello whose params break its schema in a way that depends on the script."""
    variants: list[dict[str, Any]] = [
        {"clientId": "Bad", "clientIncarnation": "inc-x", "supportedMajors": [1]},
        {"clientId": script.client_id, "clientIncarnation": "inc-x", "supportedMajors": [2]},
        {"clientId": script.client_id, "supportedMajors": [1]},
        {"clientId": script.client_id, "clientIncarnation": "inc-x", "supportedMajors": [1],
         "extra": True},
    ]
    return variants[len(script.actions) % len(variants)]


async def _settle(r: Router, baseline: dict[str, Any]) -> dict[str, Any]:
    stats = r.stats()
    for _ in range(300):
        stats = r.stats()
        if all(stats[k] == baseline[k] for k in GAUGES):
            return stats
        await asyncio.sleep(0.01)
    diff = {k: (baseline[k], stats[k]) for k in GAUGES if stats[k] != baseline[k]}
    raise AssertionError(f"router state did not return to the baseline: {diff}")


async def _check_alive(r: Router) -> dict[str, Any]:
    """A fresh connection still gets a hello and a schema-valid `bus.stats`."""
    reader, writer = await asyncio.open_unix_connection(r.socket_path)
    try:
        v = Validators.get()
        replies = []
        for rid, method, params in (
            (1, "bus.hello", {"clientId": "fz-check", "clientIncarnation":
                              f"inc-check-{os.urandom(4).hex()}", "supportedMajors": [1]}),
            (2, "bus.stats", {"detail": True}),
        ):
            writer.write(_frame(orjson.dumps({"jsonrpc": "2.0", "id": rid, "method": method,
                                              "params": params})))
            await writer.drain()
            async with asyncio.timeout(5):
                (n,) = struct.unpack("<I", await reader.readexactly(4))
                msg = codec.decode(await reader.readexactly(n))
            assert msg.get("id") == rid and "result" in msg, msg
            assert v.results[method](msg["result"]) is None
            replies.append(msg["result"])
        stats: dict[str, Any] = replies[1]
        assert stats["routerId"] == r.router_id
        return stats
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass


async def fuzz_router(case: list[list[Script]]) -> None:
    d = tempfile.mkdtemp(prefix="flyd-fz-", dir="/tmp")
    r = Router(RouterConfig(socket_path=os.path.join(d, "bus.sock"), limits=LIMITS,
                            policy=Policy.open()))
    await r.start()
    try:
        baseline = r.stats()
        player = Player(r.socket_path)
        async with asyncio.timeout(60):
            for round_ in case:
                await player.run_round(round_)
            assert r.fatal is None, f"the router broke an invariant: {r.fatal!r}"
            await player.close_all()
        assert not player.problems, "\n".join(player.problems)
        assert r.fatal is None, f"the router broke an invariant: {r.fatal!r}"
        stats = await _check_alive(r)
        assert stats["connections"] >= 1
        settled = await _settle(r, baseline)
        assert r.fatal is None
        store = r.artifacts.store
        assert store is not None and os.listdir(store.path) == []
        counters = settled["counters"]
        assert counters["helloOk"] >= 1
        # steer generation towards examples that reach deep into the call lifecycle
        target(float(counters["callsAdmitted"]), label="calls admitted")
        target(float(sum(1 for v in counters["cancels"].values() if v)
                     + (counters["repliesRouted"] > 0) + (counters["repliesUnrouted"] > 0)
                     + (counters["callsFailed"] > 0)), label="call outcomes")
        target(float(counters["artifactsSealed"] + counters["sealsRefused"]),
               label="seals")  # docs/topics.md §5.5 (#171)
    finally:
        await r.stop()
        shutil.rmtree(d, ignore_errors=True)


@settings(settings.get_profile(PROFILE))
@given(case=cases())
def test_router_survives_random_and_mutated_frames(case: list[list[Script]]) -> None:
    # The router logs every accept, hello and close: keep only the failing example's tail, not
    # thousands of examples' worth of captured output.
    logs = io.StringIO()
    try:
        with contextlib.redirect_stdout(logs):
            uvloop.run(fuzz_router(case))
    except BaseException:
        sys.stdout.write("".join(logs.getvalue().splitlines(keepends=True)[-200:]))
        raise


# --- the state machine over a router process --------------------------------------------------
#
# A `RuleBasedStateMachine` drives raw, blocking sockets against a real `flyd router` process
# with the limits above. Rules open connections (callers, services, un-helloed, refused hellos),
# send bursts of requests replayed from hypothesis-drawn templates (a drawn seed picks the
# order, placeholders resolve to the live delivery ids, calls and incarnations), split frames,
# maximum-size frames, and end connections with poison of a known outcome, random mutations,
# random bytes, truncated frames, half-closes, closes and resets. Every frame the router sends
# is checked as in the test above. After each example every connection is closed and the
# router's gauges must settle back to the baseline.
#
# The test counts the frames the router read (its own `framesIn` counter, which excludes frames
# refused at the length prefix) and keeps running examples until at least FRAME_TARGET have
# passed after the warm-up. Resource baseline: the router remembers the last 1024 incarnations
# of every clientId it has seen, for as long as it runs (wire.md §6.2), so the machine uses a
# fixed set of clientIds (MACHINE_POOL and SERVICE_CLIENT) and the warm-up first hellos each of
# them that many times, which brings that memory to its full size; then it runs the machine for
# WARMUP_FRAMES frames, half the measured run, so allocator arenas and caches reach their
# working size (under the fuzz profile the router's RSS rose for about the first million frames,
# while its Python heap stayed flat, and then levelled off). With every connection closed and
# the gauges settled, the router's fd count and RSS are the baseline. After the measured run
# they must be back within 10 % of it (fds: exactly, since every connection is closed).

FRAME_TARGET = 100_000 if PROFILE == "bus-fuzz-quick" else 2_000_000
WARMUP_FRAMES = FRAME_TARGET // 2
MACHINE_EXAMPLES = 8 if PROFILE == "bus-fuzz-quick" else 100
IO_TIMEOUT_S = 30.0
CLIENT_POOL = 12  # clientIds fz-a..fz-d, fz-0..fz-7: collisions give CONFLICT
SERVICE_NAMES = ["fz.a", "fz.b", "fz.c"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# ops accepted as notifications (wire.md §21, and bus.publish since minor 2, docs/topics.md
# §3.4): without an id they are lean, not poison
LEAN_OPS: frozenset[str] = frozenset({"bus.call", "bus.reply", "bus.consumed", "bus.publish"})
# expected `bus.closing` names of the poison a clean, helloed connection sends (wire.md §4)
POISON_CLOSES: dict[tuple[str, str], str] = {
    **{("prefix", w): "INVALID_ENVELOPE" for w in ("zero", "huge", "over", "be")},
    **{("dupkey", w): "PARSE_ERROR" for w in ("id", "jsonrpc", "method", "nested")},
    **{("shape", w): "PARSE_ERROR" for w in ("lead-ws", "trail-ws", "trailing", "bad-utf8",
                                             "deep", "nan", "big-int")},
    **{("shape", w): "INVALID_REQUEST" for w in ("extra-member", "jsonrpc-1.0", "no-jsonrpc",
                                                 "method-int", "notification", "response",
                                                 "batch")},
    **{("id", w): "INVALID_REQUEST" for w in ("same", "back", "zero", "big", "float", "bool",
                                              "str", "null", "missing")},
    **{("form", w): "INVALID_REQUEST" for w in ("array", "null", "string")},
}


@dataclass
class Tally:
    """What the whole machine run saw, across examples."""

    path: str
    problems: list[str] = field(default_factory=list)
    frames_sent: int = 0
    connections: int = 0
    closings: dict[str, int] = field(default_factory=dict)
    poison_checked: int = 0
    next_incarnation: int = 0
    lean_calls: int = 0  # bus.call notifications sent (wire.md §21.2)
    request_calls: int = 0  # bus.call requests sent by lifecycle ops
    calls_tracked: int = 0  # calls whose single terminal outcome a teardown checked


class Sock:
    """A raw blocking connection; `pump()` reads whatever arrived and checks every frame."""

    def __init__(self, tally: Tally, role: str, auto: str | None, lean: float = 0.0) -> None:
        tally.connections += 1
        self.lean = lean  # how often this connection uses the lean forms (wire.md §21)
        # callId -> terminal outcomes seen (§9.1: exactly one for an attached caller)
        self.outcomes: dict[int, list[str]] = {}
        self.cancelling: dict[int, int] = {}  # bus.cancel request id -> its callId
        self.credits: list[str] = []  # result deliveries the next lean call carries
        self.lean_turn = 0
        self.tally = tally
        self.name = f"sock#{tally.connections}"
        self.role = role
        self.auto = auto
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(IO_TIMEOUT_S)
        self.buf = bytearray()
        self.last_id = 0
        self.last_response = 0
        self.sent: dict[int, str] = {}
        self.responded: set[int] = set()
        self.dlv: list[str] = []
        self.svc: list[str] = []
        self.top: list[str] = []
        self.art: list[str] = []
        self.lengths: dict[str, int] = {}
        self.store_path: str | None = None
        self.sent_calls: list[int] = []
        self.held: list[str] = []  # request deliveries a "hold" service answers later
        self.out = bytearray()
        self.out_frames = 0
        self.batching = False
        self.helloed = False
        self.tainted = False
        self.dead = False  # nothing more may be written
        self.ended = False  # we closed, half-closed or reset our side
        self.eof = False
        self.final: str | None = None
        self.closing: str | None = None
        self.answered = 0
        self.last_result: Any = None
        try:
            self.sock.connect(tally.path)
        except OSError as exc:
            self.fail(f"connect failed: {exc}")
            self.dead = self.eof = True

    next_id = Conn.next_id  # the same id modes as the scripted connections

    def fail(self, message: str) -> None:
        self.tally.problems.append(f"{self.name}: {message}")

    def send(self, data: bytes, *, tainted: bool = True, frames: int = 1) -> None:
        """Write now, or at the next `flush()` while batching (one write for many frames)."""
        if self.dead:
            return
        self.tainted = self.tainted or tainted
        self.out += data
        self.out_frames += frames
        if not self.batching:
            self.flush()

    def flush(self) -> None:
        if self.dead or not self.out:
            return
        try:
            self.sock.sendall(self.out)
        except OSError:
            self.dead = True  # the router closed first; its closing frame says why
            return
        finally:
            self.out.clear()
        self.tally.frames_sent += self.out_frames
        self.out_frames = 0

    def request(self, method: str, params: dict[str, Any]) -> int:
        """A well-formed request with the next id; returns the id."""
        self.last_id += 1
        if not self.tainted:
            self.sent[self.last_id] = method
            if method == "bus.call":
                self.outcomes[self.last_id] = []
            elif method == "bus.cancel":
                self.cancelling[self.last_id] = params["callId"]
        if method == "bus.call":
            self.sent_calls.append(self.last_id)
        self.send(_frame(orjson.dumps({"jsonrpc": "2.0", "id": self.last_id, "method": method,
                                       "params": params})), tainted=False)
        return self.last_id

    def notify(self, method: str, params: dict[str, Any]) -> None:
        """A lean notification (wire.md §21); a `bus.call` gets the next id as its callId and
        carries the credits this connection holds."""
        if method == "bus.call":
            self.last_id += 1
            params = {**params, "callId": self.last_id}
            if self.credits:
                params["consumed"] = self.credits[:64]
                del self.credits[:64]
            if not self.tainted:
                self.outcomes[self.last_id] = []
            self.sent_calls.append(self.last_id)
            self.tally.lean_calls += 1
        self.send(_frame(orjson.dumps({"jsonrpc": "2.0", "method": method, "params": params})),
                  tainted=False)

    def pick_lean(self) -> bool:
        """Lean or request form for the next op: always at lean 1.0, every other time at 0.5,
        never at 0.0 (a counter, not a random draw, so hypothesis replays stay exact)."""
        self.lean_turn += 1
        return self.lean >= 1.0 or (self.lean > 0.0 and self.lean_turn % 2 == 0)

    def outcome(self, call_id: Any, what: str) -> None:
        """A terminal outcome of a call this connection made; a second one is a bug."""
        seen = self.outcomes.get(call_id)
        if seen is None or self.tainted:
            return
        seen.append(what)
        if len(seen) > 1:
            self.fail(f"call {call_id} has two terminal outcomes: {seen}")

    def play(self, action: tuple[Any, ...]) -> dict[str, Any] | None:
        """Send a `req` action (hypothesis template); returns the message sent."""
        msg, ok = _build(self, action)
        body = _dumps(msg)
        if body is None:
            return None
        if ok and not self.tainted:
            self.sent[msg["id"]] = msg["method"]
            if msg["method"] == "bus.call":
                self.outcomes[msg["id"]] = []
        if msg["method"] == "bus.call" and isinstance(msg.get("id"), int):
            self.sent_calls.append(msg["id"])
        self.send(_frame(body), tainted=not ok)
        return msg

    def pump(self) -> None:
        """Read and check everything that has arrived, without blocking."""
        while not self.eof:
            if not select.select([self.sock], [], [], 0)[0]:
                return
            try:
                data = self.sock.recv(1 << 20)
            except OSError:
                data = b""
            if not data:
                self.eof = True
                if self.buf and not self.ended:
                    self.fail(f"router frame cut short: {bytes(self.buf[:40])!r}")
                return
            self.buf += data
            self._frames()

    def _frames(self) -> None:
        buf = self.buf
        while len(buf) >= 4:
            (n,) = struct.unpack_from("<I", buf, 0)
            if not 1 <= n <= LIMITS.maxEnvelopeBytes:
                self.fail(f"router frame length {n}")
                self.eof = True
                return
            if len(buf) < 4 + n:
                return
            body = bytes(buf[4:4 + n])
            del buf[:4 + n]
            self._check(body)

    def _check(self, body: bytes) -> None:
        """wire.md §2–§4, §8, §15 for one router frame."""
        v = Validators.get()
        msg, problem = router_frame(v, body, self.final)
        if msg is None:
            self.fail(problem)
            return
        if "id" in msg:
            self._check_response(v, msg, body)
            return
        method, params = msg["method"], msg["params"]
        if method == "bus.closing":
            self.final = "bus.closing"
            self.closing = params["error"]["data"]["name"]
            closings = self.tally.closings
            closings[self.closing] = closings.get(self.closing, 0) + 1
            if params["error"]["data"]["dispatch"] != "unknown":
                self.fail(f"bus.closing with dispatch {params['error']['data']}")
        elif method == "bus.message":
            learn_attachments(self, params)
            self.dlv.append(params["deliveryId"])
            del self.dlv[:-16]
        elif method in ("bus.request", "bus.result"):
            learn_attachments(self, params)
            self.dlv.append(params["deliveryId"])
            del self.dlv[:-16]
            if method == "bus.result":
                self.outcome(params["callId"], "result")
            self._auto_answer(method, params)
        elif method == "bus.callFailed":
            self.outcome(params["callId"], f"callFailed {params['error']['data']['name']}")
        elif method == "bus.replyFailed" and not self.tainted:
            name = params["error"]["data"]["name"]
            if name != "CALL_GONE":  # a reply to a delivery another op already answered
                self.fail(f"a lean reply of a clean connection was refused: {params}")

    def _check_response(self, v: Validators, msg: dict[str, Any], body: bytes) -> None:
        rid = msg["id"]
        if rid <= self.last_response:
            self.fail(f"response {rid} after response {self.last_response}")
        self.last_response = rid
        self.responded.add(rid)
        self.last_result = msg.get("result")
        method = self.sent.get(rid)
        if "result" in msg and method in v.results and not self.tainted:
            problem = v.results[method](msg["result"])
            if problem is not None:
                self.fail(f"bad {method} result ({problem}): {body[:300]!r}")
            if method == "bus.register":
                self.svc.append(msg["result"]["serviceIncarnation"])
            if method == "bus.declare":
                self.top.append(msg["result"]["topicIncarnation"])
            if method == "bus.hello":
                self.helloed = True
            learn_store(self, method, msg["result"])
        if method == "bus.call" and "error" in msg:
            self.outcome(rid, "refused")
        elif method == "bus.cancel" and "result" in msg:
            state = msg["result"].get("state")
            if state in ("cancelled-before-dispatch", "execution-unknown"):
                self.outcome(self.cancelling.get(rid), state)
        self.cancelling.pop(rid, None)
        if "error" in msg:
            if method == "bus.hello" and not self.tainted:
                self.final = "refused hello"
            if msg["error"]["data"]["dispatch"] != "not-dispatched":
                self.fail(f"an error response with dispatch {msg['error']['data']}")

    def _auto_answer(self, method: str, params: dict[str, Any]) -> None:
        """Services answer (echo, release or hold) and consume; callers consume results,
        unless they hold them for a later `completed` cancel or an explicit consume."""
        if self.tainted or self.dead or self.auto is None:
            return
        dlv = params["deliveryId"]
        if method == "bus.request":
            mode = self.auto
            if mode == "mixed":
                mode = ("echo", "echo", "release", "hold")[self.answered % 4]
            self.answered += 1
            if mode == "hold":
                self.held.append(dlv)
                return
            if mode == "consume":
                return
            if mode == "echo" and self.pick_lean():  # the reply returns the delivery too (§21.3)
                self.notify("bus.reply", {"deliveryId": dlv, "outcome": {"n": self.answered},
                                          "consumed": True})
                return
            if mode == "echo":
                self.request("bus.reply", {"deliveryId": dlv, "outcome": {"n": self.answered}})
            else:
                self.request("bus.release", {"deliveryId": dlv})
        elif self.auto == "mixed" and self.answered % 5 == 0:
            self.answered += 1
            return
        elif method == "bus.result" and self.pick_lean():
            self.credits.append(dlv)  # the next lean call carries it
            return
        if self.pick_lean():
            self.notify("bus.consumed", {"deliveryIds": [dlv]})
        else:
            self.request("bus.consumed", {"deliveryIds": [dlv]})

    def lifecycle_op(self, rnd: random.Random) -> None:
        """One valid request that moves calls along: answer a held request, call a service,
        cancel a recent call, consume recent deliveries, or look at the router."""
        r = rnd.random()
        if self.held and r < 0.3:
            dlv = self.held.pop(rnd.randrange(len(self.held)))
            if rnd.random() < 0.75:
                self.request("bus.reply", {"deliveryId": dlv, "outcome": {"r": rnd.random()}})
            else:
                self.request("bus.release", {"deliveryId": dlv})
            self.request("bus.consumed", {"deliveryIds": [dlv]})
        elif r < 0.65:
            pin = self.svc[-1] if self.svc and rnd.random() < 0.2 else None
            params = {"target": rnd.choice(SERVICE_NAMES), "expectedIncarnation": pin,
                      "method": "M", "payload": {"n": rnd.randrange(1000)}}
            if self.pick_lean():
                self.notify("bus.call", params)
            else:
                self.tally.request_calls += 1
                self.request("bus.call", params)
        elif r < 0.8 and self.sent_calls:
            self.request("bus.cancel", {"callId": rnd.choice(self.sent_calls[-8:])})
        elif r < 0.9 and self.dlv:
            self.request("bus.consumed", {"deliveryIds": sorted(set(
                rnd.choices(self.dlv[-6:], k=rnd.randint(1, 3))))})
        elif r < 0.95:
            self.store_op(rnd)
        else:
            self.request(rnd.choice(["bus.stats", "bus.services"]), {})

    def store_op(self, rnd: random.Random) -> None:
        """A valid store step (docs/topics.md §5, §6): allocate, seal a recent allocation with
        the digest of its (still zero) bytes, retain or drop what it saw, or attach it."""
        mine = list(self.lengths)[-4:]
        r = rnd.random()
        if not mine or r < 0.3:
            self.request("bus.allocate", {"length": rnd.choice([1, 16, 4096])})
        elif r < 0.6:
            artifact_id = rnd.choice(mine)
            self.request("bus.seal", {"artifactId": artifact_id, "digest": hashlib.sha256(
                bytes(self.lengths[artifact_id])).hexdigest()})
        elif r < 0.75 and self.art:
            self.request(rnd.choice(["bus.retain", "bus.drop"]),
                         {"artifactIds": sorted(set(rnd.choices(self.art[-4:], k=2)))})
        else:
            self.request("bus.call", {
                "target": rnd.choice(SERVICE_NAMES), "expectedIncarnation": None,
                "method": "M", "payload": {}, "attachments": [rnd.choice(mine)],
                "transfer": rnd.random() < 0.5})

    def wait(self, until: Callable[[], bool], timeout: float = IO_TIMEOUT_S) -> bool:
        """Pump until `until()` or EOF; False on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            self.flush()
            self.pump()
            if until() or self.eof:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([self.sock], [], [], min(left, 0.05))

    def wait_response(self, rid: int) -> None:
        if not self.wait(lambda: self.last_response >= rid):
            self.fail(f"no response to id {rid} within {IO_TIMEOUT_S} s")

    def half_close_and_drain(self) -> None:
        """Our EOF, then every frame up to the router's EOF (wire.md §2: a clean close)."""
        if not self.dead:
            self.dead = self.ended = True
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)
        self.ended = True
        if not self.wait(lambda: False):
            self.fail("the router did not close after our EOF")

    def reset(self) -> None:
        self.dead = self.ended = True
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def close(self) -> None:
        self.flush()
        self.dead = self.ended = self.eof = True
        self.sock.close()


class RouterProcess:
    """`flyd router` as a child process with the fuzz limits; psutil watches its resources."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="flyd-fzm-", dir="/tmp")
        self.store_root = tempfile.mkdtemp(prefix="flyd-fzm-store-", dir="/dev/shm")
        self.path = os.path.join(self.dir, "bus.sock")
        config = os.path.join(self.dir, "router.toml")
        with open(config, "w") as f:
            f.write(f'[bus.store]\nroot = "{self.store_root}"\n')
            f.write("[bus.limits]\n")
            for name in Limits.__dataclass_fields__:
                f.write(f"{snake_case(name)} = {getattr(LIMITS, name)}\n")
        self.log = open(os.path.join(self.dir, "router.log"), "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flyd", "router", "--socket", self.path, "--config", config,
             "--open", "-qq"], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self.log,
            stderr=self.log)
        self.ps = psutil.Process(self.proc.pid)
        deadline = time.monotonic() + 15
        while not self._accepts():  # the socket file exists between bind and listen too
            assert self.proc.poll() is None, self.log_tail()
            assert time.monotonic() < deadline, "the router did not accept on its socket"
            time.sleep(0.02)

    def _accepts(self) -> bool:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
        except OSError:
            return False
        finally:
            probe.close()
        return True

    def log_tail(self) -> str:
        self.log.flush()
        with open(os.path.join(self.dir, "router.log"), "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def resources(self) -> tuple[int, int]:
        """(open fds, RSS bytes) of the router process."""
        return self.ps.num_fds(), self.ps.memory_info().rss

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.store_root, ignore_errors=True)
        return code


class Monitor:
    """One long-lived helloed connection that polls `bus.stats` (it is part of the baseline)."""

    def __init__(self, tally: Tally) -> None:
        self.conn = Sock(tally, "monitor", None)
        self.conn.request("bus.hello", {"clientId": "fz-monitor", "clientIncarnation":
                                        f"inc-m-{os.urandom(4).hex()}", "supportedMajors": [1]})
        self.conn.wait_response(1)
        assert self.conn.helloed and not self.conn.eof, self.conn.tally.problems

    def stats(self) -> dict[str, Any]:
        rid = self.conn.request("bus.stats", {"detail": True})
        self.conn.wait_response(rid)
        assert rid in self.conn.responded and not self.conn.eof, "the router stopped answering"
        stats: dict[str, Any] = self.conn.last_result
        return stats

    def settle(self, baseline: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if all(stats[k] == baseline[k] for k in GAUGES):
                return stats
            if time.monotonic() > deadline:
                diff = {k: (baseline[k], stats[k]) for k in GAUGES if stats[k] != baseline[k]}
                raise AssertionError(f"router state did not return to the baseline: {diff}")
            time.sleep(0.02)


@dataclass
class Harness:
    router: RouterProcess
    tally: Tally
    monitor: Monitor
    baseline: dict[str, Any]


MACHINE_HELLOS = st.sampled_from(["fresh"] * 10 + ["reused", "bad", "none"])
MACHINE_POOL = [*CLIENT_IDS, *(f"fz-{k}" for k in range(CLIENT_POOL - len(CLIENT_IDS)))]
SERVICE_CLIENT = "fz-s"  # every example's first service (the previous one has closed by then)
ENDS = st.sampled_from(["close", "reset", "eof"])
# how often a connection uses the lean forms of wire.md §21 (never, half the time, always)
LEAN_MIX = st.sampled_from([0.0, 0.5, 1.0])


@st.composite
def burst_template(draw: st.DrawFn) -> tuple[Any, ...]:
    """A well-formed request to replay in a burst (a second hello would end the burst)."""
    role = draw(st.sampled_from(["service", "caller", "mixed"]))
    return draw(request_action(role).filter(lambda a: a[1] != "bus.hello"))


class RouterMachine(RuleBasedStateMachine):
    """Raw connections against one router process; see the section comment above."""

    conns = Bundle("conns")

    def __init__(self, harness: Harness) -> None:
        super().__init__()
        self.h = harness
        self.tally = harness.tally
        self.tally.problems = []
        self.socks: list[Sock] = []

    def _pump_all(self, skip: Sock | None = None) -> None:
        for s in self.socks:
            if s is not skip:
                s.pump()
                s.flush()

    @initialize(target=conns, name=st.sampled_from(SERVICE_NAMES),
                auto=st.sampled_from(["echo", "mixed", "hold"]), max_queued=st.integers(1, 4),
                max_in_flight=st.integers(1, 2), lean=LEAN_MIX)
    def first_service(self, name: str, auto: str, max_queued: int, max_in_flight: int,
                      lean: float) -> Sock:
        """Every example starts with a service, so calls reach dispatch and replies."""
        return self.open_conn("service", "fresh", SERVICE_CLIENT, auto, name, max_queued,
                              max_in_flight, lean)

    @rule(target=conns, role=st.sampled_from(["caller", "caller", "service", "mixed"]),
          hello=MACHINE_HELLOS, client=st.sampled_from(MACHINE_POOL),
          auto=st.sampled_from(["echo", "release", "mixed", "mixed", "consume", "hold"]),
          name=st.sampled_from(SERVICE_NAMES), max_queued=st.integers(1, 4),
          max_in_flight=st.integers(1, 2), lean=LEAN_MIX)
    def open_conn(self, role: str, hello: str, client: str, auto: str, name: str,
                  max_queued: int, max_in_flight: int, lean: float) -> Sock:
        s = Sock(self.tally, role, auto, lean)
        self.socks.append(s)
        if hello == "none":
            return s
        self.tally.next_incarnation += 1
        inc = "i-reused" if hello == "reused" else f"i-{self.tally.next_incarnation}"
        params: dict[str, Any] = {"clientId": client, "clientIncarnation": inc,
                                  "supportedMajors": [1]}
        if hello == "bad":
            params["supportedMajors"] = [2]
        s.wait_response(s.request("bus.hello", params))
        if hello == "bad" and not s.eof:
            assert s.final == "refused hello", f"{s.name}: VERSION_MISMATCH did not end it"
        if role == "service" and s.helloed:
            s.wait_response(s.request("bus.register", {"name": name, "maxQueued": max_queued,
                                                       "maxInFlight": max_in_flight}))
        return s

    @rule(conn=conns, templates=st.lists(burst_template(), max_size=3),
          lifecycle=st.sampled_from([0.5, 0.8, 1.0]), seed=st.integers(0, 2**32 - 1),
          n=st.integers(50, 600))
    def burst(self, conn: Sock, templates: list[tuple[Any, ...]], lifecycle: float, seed: int,
              n: int) -> None:
        """`n` requests: lifecycle ops, or the templates replayed with placeholders resolved
        afresh each time, in a seeded order. Written 16 at a time; every connection is read
        in between so services keep answering."""
        rnd = random.Random(seed)
        conn.batching = True
        try:
            for i in range(n):
                if conn.dead:
                    break
                if templates and rnd.random() >= lifecycle:
                    conn.play(templates[rnd.randrange(len(templates))])
                else:
                    conn.lifecycle_op(rnd)
                del conn.sent_calls[:-16]
                if i % 16 == 15:
                    self._pump_all()
        finally:
            conn.batching = False
            conn.flush()

    @rule(conn=conns, action=split_action("mixed"))
    def split_frame(self, conn: Sock, action: tuple[Any, ...]) -> None:
        """A valid request written in pieces, the router reading in between (wire.md §2)."""
        if action[1][1] == "bus.hello":
            return
        msg, _ = _build(conn, action[1])
        body = _dumps(msg)
        if body is None:
            return
        conn.sent[msg["id"]] = msg["method"]
        chunks = _mutate(body, msg, action[2])
        for chunk in chunks:
            conn.send(chunk, tainted=False, frames=0)
            # not `conn` itself: what it answers by itself (a request delivered meanwhile)
            # would be written inside its unfinished frame
            self._pump_all(skip=conn)
        conn.tally.frames_sent += 1

    @rule(conn=conns, kind=FILE_ACTIONS)
    def store_file(self, conn: Sock, kind: str) -> None:
        """A client of the router's uid changes a file of the store (docs/topics.md §5.4):
        writes after a seal attempt, a resize or a symlink swap (#171)."""
        file_action(conn, kind)

    @rule(conn=conns, exact=st.booleans())
    def max_size_frame(self, conn: Sock, exact: bool) -> None:
        """A `bus.call` body of exactly (or just under) maxEnvelopeBytes: its worst-case
        `bus.request` cannot fit, so it is refused and the connection stays (wire.md §7.3)."""
        conn.last_id += 1
        head = {"jsonrpc": "2.0", "id": conn.last_id, "method": "bus.call",
                "params": {"target": "fz.a", "expectedIncarnation": None, "method": "M",
                           "payload": {"big": ""}}}
        size = LIMITS.maxEnvelopeBytes - (0 if exact else 1)
        body = orjson.dumps(head)
        head["params"]["payload"]["big"] = "x" * (size - len(body))
        body = orjson.dumps(head)
        assert len(body) == size
        conn.sent[conn.last_id] = "bus.call"
        conn.send(_frame(body), tainted=False)

    @rule(conn=consumes(conns), action=request_action(),
          poison=st.sampled_from(sorted(POISON_CLOSES)), end=ENDS)
    def poison(self, conn: Sock, action: tuple[Any, ...], poison: tuple[str, str],
               end: str) -> None:
        """A violation with a known outcome (wire.md §4 checks 1–4): `bus.closing` with its
        name, then EOF."""
        kind, which = poison
        _, op, params, id_mode, form = action
        if kind == "id":
            id_mode = which
        elif kind == "form":
            form = which
        elif kind == "dupkey":
            form = "obj"
        msg, _ = _build(conn, ("req", op, params, id_mode, form))
        body = _dumps(msg)
        chunks = [] if body is None else (
            _mutate(body, msg, (kind, which)) if kind in ("prefix", "dupkey", "shape")
            else [_frame(body)])
        expected = POISON_CLOSES[poison]
        if op in LEAN_OPS and poison in (("id", "missing"), ("shape", "notification")):
            expected = ""  # a lean notification (wire.md §21): its params decide the outcome
        if kind != "prefix" and len(chunks) == 1 and len(chunks[0]) - 4 > LIMITS.maxEnvelopeBytes:
            expected = "INVALID_ENVELOPE"  # the mutation grew a body near the limit past it (§2)
        if poison == ("prefix", "be") and body is not None:
            (n,) = struct.unpack("<I", struct.pack(">I", len(body)))
            if n <= LIMITS.maxEnvelopeBytes:
                expected = ""  # the swapped length happens to be a valid one
        conn.pump()
        clean = not (conn.eof or conn.final or conn.dead)
        for chunk in chunks:
            conn.send(chunk)
        if not chunks or not expected or not clean:
            self._end(conn, end)
            return
        if not conn.wait(lambda: conn.eof):
            conn.fail(f"no close after poison {poison}")
        allowed = {expected, "QUOTA_EXCEEDED"} | (set() if conn.helloed
                                                  else {"INVALID_ENVELOPE"})
        if conn.closing not in allowed:
            conn.fail(f"poison {poison}: closing {conn.closing}, expected {expected}")
        self.tally.poison_checked += 1
        conn.close()

    @rule(conn=consumes(conns), junk=st.one_of(
        mutated_action(), st.tuples(st.just("bytes"), st.binary(min_size=1, max_size=64))),
        end=ENDS)
    def mutate(self, conn: Sock, junk: tuple[Any, ...], end: str) -> None:
        """A random mutation or random bytes, whatever its outcome, then an ending."""
        if junk[0] == "bytes":
            conn.send(junk[1])
        else:
            msg, _ = _build(conn, junk[1])
            body = _dumps(msg)
            if body is not None:
                for chunk in _mutate(body, msg, junk[2]):
                    conn.send(chunk)
        self._end(conn, end)

    @rule(conn=consumes(conns), action=request_action(), cut=st.integers(1, 10_000), end=ENDS)
    def truncated(self, conn: Sock, action: tuple[Any, ...], cut: int, end: str) -> None:
        """A frame cut short (inside the prefix or the body), then an ending (wire.md §2)."""
        msg, _ = _build(conn, action)
        body = _dumps(msg)
        if body is not None:
            data = _frame(body)
            conn.send(data[:1 + cut % (len(data) - 1)])
        self._end(conn, end)

    @rule(conn=consumes(conns), end=ENDS)
    def end(self, conn: Sock, end: str) -> None:
        """Close, reset or half-close; a service that goes leaves its callers callFailed."""
        self._end(conn, end)

    def _end(self, conn: Sock, end: str) -> None:
        conn.ended = True
        if end == "eof":
            conn.half_close_and_drain()
            conn.close()
        elif end == "reset":
            conn.reset()
        else:
            conn.close()

    @invariant()
    def router_alive_and_frames_valid(self) -> None:
        self._pump_all()
        assert self.h.router.proc.poll() is None, self.h.router.log_tail()
        assert not self.tally.problems, "\n".join(self.tally.problems[:20])

    def teardown(self) -> None:
        """Every request of a clean live connection got its response; once everything is
        closed, the gauges return to the baseline (no connection, call or delivery left)."""
        for s in self.socks:
            if s.tainted or s.dead or s.eof or s.final or not s.sent:
                continue
            s.wait(lambda s=s: s.last_response >= max(s.sent))  # type: ignore[misc]
            missing = sorted(set(s.sent) - s.responded)
            if missing and not s.eof:
                s.fail(f"no response to ids {missing[:10]}")
        for s in self.socks:
            s.close()
        self.h.monitor.settle(self.h.baseline)
        store = self.h.monitor.conn.store_path
        assert store is not None and os.listdir(store) == [], "store files left behind"
        assert self.h.router.proc.poll() is None, self.h.router.log_tail()
        assert not self.tally.problems, "\n".join(self.tally.problems[:20])


class MixedFormsMachine(RouterMachine):
    """The machine with the single-terminal-outcome check of wire.md §9.1 at teardown (§21.8
    test 122): every call a clean caller made, in either form, ends exactly once."""

    def teardown(self) -> None:
        """Close every connection that may own a service, so each call that is still open
        fails (§10.2), then require one terminal outcome per call of each clean caller."""
        for s in self.socks:
            if not (s.tainted or s.dead or s.eof or s.final) and s.sent:
                s.wait(lambda s=s: s.last_response >= max(s.sent))  # type: ignore[misc]
        callers = [s for s in self.socks if s.helloed and not s.svc and s.role == "caller"
                   and not (s.tainted or s.dead or s.eof or s.final)]
        for s in self.socks:
            if s not in callers:
                s.close()
        for s in callers:
            s.flush()
            done = s.wait(lambda s=s: all(s.outcomes.values()))  # type: ignore[misc]
            if s.eof or s.final:
                continue
            if not done:
                open_calls = [c for c, seen in s.outcomes.items() if not seen]
                s.fail(f"calls without a terminal outcome: {open_calls[:10]}")
            self.tally.calls_tracked += len(s.outcomes)
        super().teardown()


def machine_settings() -> settings:
    """Settings for one batch of state-machine examples. The callers run batch after batch
    until enough was checked, so every batch must draw new examples: hypothesis's "ci"
    profile (loaded when a CI variable is set) derandomizes, and would replay the first batch
    forever."""
    return settings(max_examples=MACHINE_EXAMPLES, stateful_step_count=40, deadline=None,
                    derandomize=False, database=None,
                    suppress_health_check=list(HealthCheck))


def run_mixed_forms_machine(frames: int, tracked: int = 0) -> dict[str, Any]:
    """Run MixedFormsMachine examples against a router process until it read `frames`
    frames and their teardowns checked at least `tracked` calls of clean callers (an example
    whose callers were all tainted or closed checks none, so a frame count alone can end with
    nothing checked; the examples stop at 10·`frames` either way); returns what they did and
    every problem seen."""
    router = RouterProcess()
    monitor: Monitor | None = None
    try:
        tally = Tally(router.path)
        monitor = Monitor(tally)
        h = Harness(router, tally, monitor, monitor.stats())
        machine = machine_settings()
        problems: list[str] = []
        while True:
            read = monitor.stats()["counters"]["framesIn"]
            if read >= 10 * frames or (read >= frames and tally.calls_tracked >= tracked):
                break
            try:
                run_state_machine_as_test(lambda: MixedFormsMachine(h), settings=machine)
            except AssertionError as exc:
                problems.append(str(exc)[:2000])
                break
        stats = monitor.settle(h.baseline)
        counters = stats["counters"]
        return {"framesIn": counters["framesIn"], "leanCalls": counters["leanCalls"],
                "leanReplies": counters["leanReplies"],
                "leanConsumed": counters["leanConsumed"],
                "creditsCarried": counters["creditsCarried"],
                "requestCalls": tally.request_calls, "leanCallsSent": tally.lean_calls,
                "callsTracked": tally.calls_tracked,
                "problems": problems + tally.problems}
    finally:
        if monitor is not None:
            monitor.conn.close()
        router.stop()


def _fill_remembered_incarnations(tally: Tally) -> int:
    """Hello every clientId the machine uses REMEMBERED_INCARNATIONS times, each time with a
    fresh incarnation, so the router remembers as many of their incarnations as it ever will
    (the last 1024 per clientId, wire.md §6.2). Each connection is half-closed and drained to
    the router's EOF, so its teardown is done before the next hello of that clientId.
    Returns the number of hellos sent."""
    left = dict.fromkeys([*MACHINE_POOL, SERVICE_CLIENT], REMEMBERED_INCARNATIONS)
    sent = 0
    while left:
        socks = []
        for client in left:
            tally.next_incarnation += 1
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(IO_TIMEOUT_S)
            s.connect(tally.path)
            s.sendall(_frame(orjson.dumps({"jsonrpc": "2.0", "id": 1, "method": "bus.hello",
                                           "params": {
                                               "clientId": client, "supportedMajors": [1],
                                               "clientIncarnation":
                                                   f"i-{tally.next_incarnation}"}})))
            socks.append((client, s))
            sent += 1
        for client, s in socks:
            with s.makefile("rb") as f:
                head = f.read(4)
                reply = f.read(struct.unpack("<I", head)[0]) if len(head) == 4 else b""
            if "result" in orjson.loads(reply or b"{}"):  # else a CONFLICT: one more round
                left[client] -= 1
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_WR)
        for _, s in socks:
            with contextlib.suppress(OSError):
                while s.recv(1 << 16):
                    pass
            s.close()
        left = {k: n for k, n in left.items() if n > 0}
    return sent


def _run_machine(h: Harness, frames_in: int) -> int:
    """Run machine examples until the router has read `frames_in` frames in total."""
    machine = machine_settings()
    while True:
        seen: int = h.monitor.stats()["counters"]["framesIn"]
        if seen >= frames_in:
            return seen
        run_state_machine_as_test(lambda: RouterMachine(h), settings=machine)


@pytest.mark.timeout(900 if PROFILE == "bus-fuzz-quick" else 12 * 3600)
def test_router_state_machine_frames_and_resources() -> None:
    router = RouterProcess()
    monitor: Monitor | None = None
    try:
        tally = Tally(router.path)
        monitor = Monitor(tally)
        h = Harness(router, tally, monitor, monitor.stats())
        t0 = time.monotonic()
        _fill_remembered_incarnations(tally)
        _run_machine(h, WARMUP_FRAMES)
        monitor.settle(h.baseline)
        fds0, rss0 = router.resources()
        start: int = monitor.stats()["counters"]["framesIn"]
        sent0 = tally.frames_sent
        _run_machine(h, start + FRAME_TARGET)
        stats = monitor.settle(h.baseline)
        fds1, rss1 = router.resources()
        frames = stats["counters"]["framesIn"] - start
        summary = {"framesIn": frames, "framesSent": tally.frames_sent - sent0,
                   "connections": tally.connections, "poisonChecked": tally.poison_checked,
                   "closings": tally.closings, "fds": [fds0, fds1], "rss": [rss0, rss1],
                   "calls": {k: stats["counters"][k] for k in (
                       "callsAdmitted", "callsRefused", "callsFailed", "repliesRouted",
                       "repliesUnrouted", "cancels")},
                   "store": {k: stats["counters"][k] for k in (
                       "artifactsAllocated", "artifactsSealed", "artifactsCollected",
                       "sealsRefused")},
                   "seconds": round(time.monotonic() - t0, 1)}
        print(orjson.dumps(summary).decode())
        assert frames >= FRAME_TARGET, summary
        assert tally.frames_sent - sent0 >= frames, summary
        assert fds1 == fds0, summary
        assert abs(rss1 - rss0) <= rss0 // 10, summary
        counters = stats["counters"]
        for name in ("INVALID_ENVELOPE", "PARSE_ERROR", "INVALID_REQUEST"):
            assert tally.closings.get(name, 0) > 0, summary
        assert counters["repliesRouted"] > 0 and counters["callsFailed"] > 0, counters
        assert counters["cancels"]["execution-unknown"] > 0, counters
        # docs/topics.md #171: the store was exercised and everything allocated was collected
        assert counters["artifactsSealed"] > 0, counters
        assert counters["artifactsCollected"] == counters["artifactsAllocated"], counters
        fresh = Sock(tally, "check", None)
        fresh.wait_response(fresh.request("bus.hello", {
            "clientId": "fz-check", "clientIncarnation": f"inc-{os.urandom(4).hex()}",
            "supportedMajors": [1]}))
        fresh.wait_response(fresh.request("bus.stats", {"detail": False}))
        assert fresh.helloed and fresh.last_result["routerId"] == stats["routerId"]
        fresh.close()
        assert not tally.problems, tally.problems
    finally:
        if monitor is not None:
            monitor.conn.close()
        code = router.stop()
    assert code == 0, "the router did not stop cleanly"
