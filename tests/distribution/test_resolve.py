"""`resolve.decide` (distribution.md §5.6): every combination of the read's fields, judged
against the rules stated independently here, plus the named cases of the spec."""

from __future__ import annotations

import itertools
from typing import get_args

import pytest

from flyd.leases.resolve import decide
from flyd.leases.stores.contract import RunRead, RunState, TerminalState

ME = "node-a-000000000001"
OTHER = "node-b-000000000002"
EPOCH = 4
CKPT = "ck-7"


def read(state: RunState = "running", epoch: int = EPOCH, owner: str | None = ME,
         live: bool = True, committed: bool = False) -> RunRead:
    return RunRead(state=state, lease_epoch=epoch, owner_node=owner, live=live,
                   high_water=CKPT if committed else None, boundary=7 if committed else 0,
                   checkpoint_committed=committed)


def test_unknown_run_is_lost() -> None:
    finals: tuple[TerminalState | None, ...] = (None, "succeeded")
    for ckpt, final in itertools.product((None, CKPT), finals):
        assert decide(None, lease_epoch=EPOCH, node_id=ME, checkpoint_id=ckpt,
                      final=final) == "lost"


def test_checkpoint_present_at_my_epoch_is_committed() -> None:
    assert decide(read(committed=True), lease_epoch=EPOCH, node_id=ME, checkpoint_id=CKPT,
                  final=None) == "committed"
    # Lease gone since, or run reclaimed: the checkpoint still landed under my epoch.
    assert decide(read(committed=True, epoch=EPOCH + 1, owner=OTHER), lease_epoch=EPOCH,
                  node_id=ME, checkpoint_id=CKPT, final=None) == "committed"
    assert decide(read(committed=True, live=False), lease_epoch=EPOCH, node_id=ME,
                  checkpoint_id=CKPT, final=None) == "committed"


def test_final_commit_terminal_at_my_epoch_is_committed() -> None:
    for state in get_args(TerminalState):
        r = read(state=state, owner=None, live=False)
        assert decide(r, lease_epoch=EPOCH, node_id=ME, checkpoint_id=None,
                      final=state) == "committed"
        assert decide(r, lease_epoch=EPOCH, node_id=ME, checkpoint_id=CKPT,
                      final=state) == "committed"


def test_terminal_in_another_state_or_epoch_is_lost() -> None:
    # Released then cancelled at my epoch: not my commit.
    assert decide(read(state="cancelled", owner=None, live=False), lease_epoch=EPOCH,
                  node_id=ME, checkpoint_id=None, final="succeeded") == "lost"
    # Reaped: terminal at the next epoch.
    assert decide(read(state="failed", epoch=EPOCH + 1, owner=None, live=False),
                  lease_epoch=EPOCH, node_id=ME, checkpoint_id=None, final="failed") == "lost"
    # Terminal but not a final commit of mine.
    assert decide(read(state="succeeded", owner=None, live=False), lease_epoch=EPOCH,
                  node_id=ME, checkpoint_id=CKPT, final=None) == "lost"


def test_running_live_mine_absent_is_retry() -> None:
    assert decide(read(), lease_epoch=EPOCH, node_id=ME, checkpoint_id=CKPT,
                  final=None) == "retry"
    assert decide(read(), lease_epoch=EPOCH, node_id=ME, checkpoint_id=None,
                  final="cancelled") == "retry"


@pytest.mark.parametrize("r", [
    read(live=False),                          # expired, not yet reclaimed
    read(epoch=EPOCH + 1, owner=OTHER),        # reclaimed by another node
    read(epoch=EPOCH + 1, owner=ME),           # reclaimed by me under a newer grant
    read(owner=OTHER),                         # (impossible, but not mine)
    read(state="pending", owner=None, live=False),  # released
])
def test_not_mine_or_not_live_is_lost(r: RunRead) -> None:
    assert decide(r, lease_epoch=EPOCH, node_id=ME, checkpoint_id=CKPT, final=None) == "lost"


def _expected(r: RunRead, ckpt: str | None, final: TerminalState | None) -> str:
    """The rules of §5.6, restated independently of the module."""
    landed_checkpoint = ckpt is not None and r.checkpoint_committed
    landed_finish = final is not None and r.state == final and r.lease_epoch == EPOCH
    if landed_checkpoint or landed_finish:
        return "committed"
    still_mine = (r.state, r.lease_epoch, r.owner_node, r.live) == ("running", EPOCH, ME, True)
    return "retry" if still_mine else "lost"


def test_exhaustive_combinations() -> None:
    states: tuple[RunState, ...] = get_args(RunState)
    finals: tuple[TerminalState | None, ...] = (None, *get_args(TerminalState))
    seen: set[str] = set()
    for state, epoch, owner, live, committed, ckpt, final in itertools.product(
            states, (EPOCH - 1, EPOCH, EPOCH + 1), (ME, OTHER, None), (False, True),
            (False, True), (None, CKPT), finals):
        r = read(state=state, epoch=epoch, owner=owner, live=live, committed=committed)
        got = decide(r, lease_epoch=EPOCH, node_id=ME, checkpoint_id=ckpt, final=final)
        assert got == _expected(r, ckpt, final), (r, ckpt, final)
        seen.add(got)
        # Never retry a commit whose trace is visible, nor one whose grant is gone.
        if got == "retry":
            assert state == "running" and epoch == EPOCH and owner == ME and live
    assert seen == {"committed", "retry", "lost"}
