"""The call phase table of bus/call_phases.py (wire.md §9.1), exhaustively and without a router."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from bus.call_phases import EDGES, HOLDS_SLOT, Call, CallPhase, CallPhaseError, Ledger, Service


class _Caller:
    def __init__(self) -> None:
        self.active = 0
        self.calls: dict[int, Any] = {}


def _admitted(size: int = 10) -> tuple[Ledger[_Caller], Call[_Caller], _Caller]:
    caller = _Caller()
    svc: Service[_Caller] = Service("svc.a", "svc-1", caller, 16, 4)
    ledger: Ledger[_Caller] = Ledger()
    call = Call(caller, 1, svc, b"{}", size)
    ledger.admit(call)
    return ledger, call, caller


def _reach(ledger: Ledger[_Caller], call: Call[_Caller], phase: CallPhase) -> None:
    path = {
        CallPhase.QUEUED: [],
        CallPhase.DISPATCHED: [CallPhase.DISPATCHED],
        CallPhase.DETACHED: [CallPhase.DISPATCHED, CallPhase.DETACHED],
        CallPhase.REPLIED: [CallPhase.DISPATCHED, CallPhase.REPLIED],
        CallPhase.GONE: [CallPhase.GONE],
    }[phase]
    for step in path:
        if step is CallPhase.DISPATCHED:
            call.service.queue.popleft()
        ledger.move(call, step)


def test_admission_takes_a_slot_and_queues() -> None:
    ledger, call, caller = _admitted()
    assert call.phase is CallPhase.QUEUED
    assert (ledger.calls, ledger.queued_bytes, ledger.detached) == (1, 10, 0)
    assert caller.active == 1 and caller.calls == {1: call}
    assert list(call.service.queue) == [call]


@pytest.mark.parametrize(("source", "target"), list(itertools.product(CallPhase, CallPhase)))
def test_every_pair_is_an_edge_or_refused_unchanged(source: CallPhase,
                                                    target: CallPhase) -> None:
    ledger, call, caller = _admitted()
    _reach(ledger, call, source)
    before = (call.phase, ledger.calls, ledger.detached, ledger.queued_bytes, caller.active,
              dict(caller.calls))
    if target not in EDGES[source]:
        with pytest.raises(CallPhaseError, match=f"{source.value} -> {target.value}"):
            ledger.move(call, target)
        assert (call.phase, ledger.calls, ledger.detached, ledger.queued_bytes, caller.active,
                dict(caller.calls)) == before
        return
    ledger.move(call, target)
    assert call.phase is target
    assert caller.active == (1 if target in HOLDS_SLOT else 0)
    assert ledger.detached == (1 if target is CallPhase.DETACHED else 0)
    assert ledger.queued_bytes == (10 if target is CallPhase.QUEUED else 0)
    assert ledger.calls == (0 if target is CallPhase.GONE else 1)
    assert (1 in caller.calls) == (target is not CallPhase.GONE)


def test_gone_is_final_and_every_phase_reaches_it() -> None:
    assert EDGES[CallPhase.GONE] == frozenset()
    for phase in CallPhase:
        if phase is not CallPhase.GONE:
            assert CallPhase.GONE in EDGES[phase]
