"""Shared pieces of the State.* tests (state.md §6): raw capture, stage and activate calls
through the coordinator's call engine (`calls.probe`), and wrapper rewriting."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest

from flyd.launch.identities import WorkerRef
from flyd.session.runspec import RunSpec
from tests.session.harness import Fixture, SessionHarness
from workers.state import PAYLOAD_CONTENT_TYPE
from workers.types.canonical import canonical, digest_bytes, digest_of, parse_strict
from workers.types.datatypes import MediaBlob
from workers.types.domain import DomainError, ErrorCode, Mutation, Scope

SESSION = "demo"


@dataclass
class DelayFixture(Fixture):
    """The synthetic composition with the arena's observation delay set."""

    delay: int = 0

    def spec(self) -> RunSpec:
        spec = super().spec()
        return replace(spec, world=replace(spec.world, observation_delay_steps=self.delay))


def scope(epoch: str, step: int) -> Scope:
    return Scope(SESSION, epoch, step)


async def refused(call: Awaitable[Any], code: ErrorCode, *, contains: str = "") -> DomainError:
    """The call's DomainError: `code`, mutation `none`, and `contains` in its message."""
    with pytest.raises(DomainError) as info:
        await call
    error = info.value
    assert (error.code, error.mutation) == (code, Mutation.NONE), error
    assert contains in error.message, error.message
    return error


async def capture_raw(h: SessionHarness, worker: str, k: int, checkpoint_id: str = "ckpt-1",
                      epoch: str = "e1", ref: WorkerRef | None = None) -> dict[str, Any]:
    return await h.coordinator.calls.probe(worker, "State.Capture", scope(epoch, k),
                                         {"checkpointId": checkpoint_id}, ref)


def wrapper_of(result: dict[str, Any]) -> dict[str, Any]:
    doc = parse_strict(base64.b64decode(result["payload"]["data"]))
    assert isinstance(doc, dict)
    return doc


def blob_of(doc: dict[str, Any]) -> dict[str, Any]:
    data = canonical(doc)
    return MediaBlob(PAYLOAD_CONTENT_TYPE, len(data), digest_bytes(data),
                     base64.b64encode(data).decode("ascii")).to_json()


def stage_params(captured: dict[str, Any], source: Scope,
                 edit: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """`StageRestoreParams` from a capture result, the wrapper optionally edited (an agent's
    `compatibilityDigest` follows its edited identity)."""
    params = {"checkpointId": captured["checkpointId"], "sourceScope": source.to_json(),
              "compatibilityDigest": captured["compatibilityDigest"],
              "payload": captured["payload"]}
    if edit is not None:
        doc = wrapper_of(captured)
        edit(doc)
        params["payload"] = blob_of(doc)
        if doc["kind"] == "agent":
            params["compatibilityDigest"] = digest_of(doc["identity"])
    return params


async def stage(h: SessionHarness, worker: str, target: Scope | None, params: dict[str, Any],
                ref: WorkerRef | None = None) -> dict[str, Any]:
    return await h.coordinator.calls.probe(worker, "State.StageRestore", target, params, ref)


async def activate(h: SessionHarness, worker: str, target: Scope | None, token: str,
                   ref: WorkerRef | None = None) -> dict[str, Any]:
    return await h.coordinator.calls.probe(worker, "State.ActivateRestore", target,
                                         {"restoreToken": token}, ref)
