"""Test injections (design/session.md §6.13): faults the coordinator provokes in its own
transaction.

Why a module of its own: each injection re-sends, loses or kills on purpose and logs what the
workers did about it (`InjectionOutcome`), which is how the spec tests prove replay, conflict
detection, loss recovery and kills. They run inside the transaction at fixed points but are no
part of it, so they live here, through the session's call engine (`flyd.session.calls`).

`Injections` is the one hook the transaction calls at those points (`kills_at` and
`kill_dispatched` in Phase A's dispatch, `after_prepare`, `advance`, `after_advance`,
`after_commit`; bootstrap reads `duplicate_lifecycle_acknowledge`); each decides from its
fields whether to act, so `Injections()` does nothing and `advance` is then a plain
`CallEngine.call`. Outcomes go to the hook's `log` (the session's `injection_log` of
design/session.md §6.13), which starts empty for every hook built, `dataclasses.replace` included.

Procedures (the table of design/session.md §6.13):
- `duplicate`: re-send a call (same id and body, a new bus call); the code of an error or None,
  identical = the result JSON equals the original.
- `advance_injections`, after a successful Advance: `altered_advance_controls` re-sends the
  same id with the first control's first button flipped (code expected `CONFLICT`);
  `consume_advance_artifact_then_retry` drops the decoded copy of the first view, re-sends the
  Advance and decodes the replayed view (identical = same bytes and same result).
- `lose_advance_result`: start the Advance, poll `Worker.Status` (at most `LOSS_POLLS` polls of
  `RESOLVE_PAUSE`, all within the resolve budget) until the world reports the batch or the
  request, `cancel` the bus call, then resolve with the same id.
- `kill_injection`: `kill(W)` for every `(W, k)` of `kill_at`; identical = `Terminated`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from bus.client_calls import PendingCall
from bus.errors import BusError
from flyd.session.calls import RESOLVE_PAUSE, Call, CallEngine
from flyd.session.slots import AgentSlot
from workers.types.canonical import canonical
from workers.types.datatypes import EnvironmentDescriptor, WorldObservation, decode_view
from workers.types.domain import DomainError, ErrorCode, Mutation
from workers.types.rpc import Answered, Expired, Refused, from_bus_error

__all__ = [
    "LOSS_POLLS",
    "InjectionOutcome",
    "Injections",
    "KillCallback",
    "advance_injections",
    "duplicate",
    "kill_injection",
    "lose_advance_result",
]

LOSS_POLLS: Final = 500


@dataclass(frozen=True)
class InjectionOutcome:
    what: str
    code: str | None
    identical: bool


KillCallback = Callable[[str], Awaitable[Any]]


@dataclass
class Injections:
    """Test injections (design/session.md §6.13); the per-step ones act at `at_step`."""

    at_step: int | None = None
    duplicate_prepare: str | None = None
    duplicate_commit: str | None = None
    altered_advance_controls: bool = False
    consume_advance_artifact_then_retry: bool = False
    duplicate_lifecycle_acknowledge: bool = False
    lose_advance_result_at: tuple[int, ...] = ()
    kill_at: tuple[tuple[str, int], ...] = ()
    kill: KillCallback | None = None
    log: list[InjectionOutcome] = field(default_factory=list, init=False, repr=False)

    def kills_at(self, k: int) -> bool:
        """Whether step `k` kills a worker once its Prepares are dispatched."""
        return any(step == k for _, step in self.kill_at)

    async def kill_dispatched(self, k: int) -> None:
        await kill_injection(self, k, self.log)

    async def after_prepare(self, calls: CallEngine, k: int, prepares: Mapping[str, Call],
                            slots: Mapping[str, AgentSlot]) -> None:
        agent_id = self.duplicate_prepare
        if self.at_step == k and agent_id is not None:
            await duplicate(calls, prepares[agent_id], slots[agent_id].prepared,
                            "duplicate-prepare", self.log)

    async def advance(self, calls: CallEngine, k: int, advance: Call, batch_id: str,
                      world_id: str) -> dict[str, Any]:
        """Phase B's Advance: its result, lost on purpose at the steps named."""
        if k in self.lose_advance_result_at:
            return await lose_advance_result(calls, advance, batch_id, world_id, self.log)
        return await calls.call(advance)

    async def after_advance(self, calls: CallEngine, k: int, advance: Call,
                            result: dict[str, Any], descriptor: EnvironmentDescriptor,
                            pending_views: dict[str, bytes]) -> None:
        if self.at_step == k:
            await advance_injections(calls, self, advance, result, descriptor, pending_views,
                                     self.log)

    async def after_commit(self, calls: CallEngine, k: int, commits: list[Call],
                           results: Mapping[str, dict[str, Any]]) -> None:
        agent_id = self.duplicate_commit
        if self.at_step == k and agent_id is not None:
            call = next(c for c in commits if c.worker_id == agent_id)
            await duplicate(calls, call, results[agent_id], "duplicate-commit", self.log)


async def duplicate(calls: CallEngine, call: Call, original: dict[str, Any] | None, what: str,
                    log: list[InjectionOutcome]) -> None:
    outcome = await calls.send(call, calls.deadlines.probe)
    code: str | None = None
    identical = False
    if isinstance(outcome, Expired):
        code = ErrorCode.BACKEND_FAILURE.value
    elif isinstance(outcome, Refused):
        code = outcome.error.code.value
    else:
        try:
            result = calls.check_reply(call, outcome.outcome)
            identical = canonical(result) == canonical(original)
        except DomainError as exc:
            code = exc.code.value
    log.append(InjectionOutcome(what, code, identical))


async def advance_injections(calls: CallEngine, inj: Injections, advance: Call,
                             result: dict[str, Any], descriptor: EnvironmentDescriptor,
                             pending_views: dict[str, bytes],
                             log: list[InjectionOutcome]) -> None:
    """The two after-Advance injections; `pending_views` are the in-flight transition's."""
    probe = calls.deadlines.probe
    if inj.altered_advance_controls:
        params = dict(advance.params)
        controls = [dict(c) for c in params["controls"]]
        first = dict(controls[0])
        buttons = [dict(b) for b in first["buttons"]]
        buttons[0]["down"] = not buttons[0]["down"]
        first["buttons"] = buttons
        controls[0] = first
        params["controls"] = controls
        outcome = await calls.send(advance, probe, params=params)
        code: str | None = None
        if isinstance(outcome, Refused):
            code = outcome.error.code.value
        elif isinstance(outcome, Answered):
            try:
                calls.check_reply(advance, outcome.outcome)
            except DomainError as exc:
                code = exc.code.value
        log.append(InjectionOutcome("altered-advance-controls", code, code is None))
    if inj.consume_advance_artifact_then_retry and descriptor.views:
        view = descriptor.views[0]
        before = pending_views.pop(view.view_id, None)
        identical = False
        code = None
        outcome = await calls.send(advance, probe)
        try:
            replay = await calls.settle(advance, outcome)
            obs = WorldObservation.from_json(replay["observation"])
            ref = next(v for v in obs.sensory_views if v.view_id == view.view_id)
            data = decode_view(ref, view, Mutation.UNKNOWN)
            identical = data == before and canonical(replay) == canonical(result)
            pending_views[view.view_id] = data
        except DomainError as exc:
            code = exc.code.value
            if before is not None:
                pending_views[view.view_id] = before
        log.append(InjectionOutcome("cached-artifact-after-consumption", code, identical))


async def lose_advance_result(calls: CallEngine, advance: Call, batch_id: str, world_id: str,
                              log: list[InjectionOutcome]) -> dict[str, Any]:
    pending: PendingCall | None = None
    try:
        pending = await calls.client.start_call(
            advance.ref.service, advance.method, advance.payload(),
            expected_incarnation=advance.ref.service_incarnation)
    except BusError as exc:
        raise from_bus_error(advance.method, exc) from None
    found = False
    d = calls.deadlines
    # at most LOSS_POLLS polls and, all of them together, the resolve budget
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(d.resolve):
            for _ in range(LOSS_POLLS):
                status_call = calls.new_call(world_id, "Worker.Status", None, {})
                outcome = await calls.send(status_call, d.probe)
                if isinstance(outcome, Answered) and outcome.outcome.result is not None:
                    st = outcome.outcome.result
                    if st.get("lastBatchId") == batch_id or advance.request_id in (
                            st.get("activeRequestId"), st.get("lastCompletedRequestId")):
                        found = True
                        break
                await asyncio.sleep(RESOLVE_PAUSE)
    log.append(InjectionOutcome("status-after-loss", None, found))
    state = "call-gone"
    try:
        async with asyncio.timeout(d.probe):
            state = await pending.cancel()
    except (BusError, TimeoutError):
        pass
    log.append(InjectionOutcome("lost-advance-result", None,
                                state != "cancelled-before-dispatch"))
    return await calls.resolve(advance)


async def kill_injection(inj: Injections, k: int, log: list[InjectionOutcome]) -> None:
    for worker, step in inj.kill_at:
        if step != k:
            continue
        identical = False
        code: str | None = None
        if inj.kill is not None:
            try:
                outcome = await inj.kill(worker)
                identical = getattr(outcome, "label", None) == "Terminated"
            except DomainError as exc:
                code = exc.code.value
        log.append(InjectionOutcome("kill", code, identical))
