"""Deciding an unknown commit outcome from the read of design/distribution.md §3.10
(design/distribution.md §5.6).

Pure: the caller ended the old backend and read the run; this module only judges the read.

Rules, in order:
1. No row (unknown run) → `lost`.
2. `checkpoint_id` given and that checkpoint is committed at my epoch → `committed`.
3. A final commit (`final` given) and the run is terminal in exactly that state at my epoch →
   `committed`. Any other terminal state at my epoch was not written by my commit (release then
   cancel keeps the epoch), so it falls through to `lost`.
4. The run is `running` at my epoch, owned by me, with a live lease (and rules 2–3 did not
   match) → `retry`: the commit did not land, and sending the identical commit (same checkpoint
   id, same effects) is safe under the fence.
5. Otherwise → `lost` (another epoch, another owner, an expired lease, released, or terminal by
   someone else): the caller cancels the local scope; the next holder resumes from the head.

Decision where the spec is silent: a commit with neither checkpoint nor finish leaves no trace
to look up; rule 4 still answers `retry`, and the ledger key refuses a second insert of an
effect that did land (`DuplicateEffect`), so nothing is recorded twice.
"""

from __future__ import annotations

from typing import Literal

from flyd.leases.stores.contract import RunRead, TerminalState

Decision = Literal["committed", "retry", "lost"]


def decide(read: RunRead | None, *, lease_epoch: int, node_id: str, checkpoint_id: str | None,
           final: TerminalState | None) -> Decision:
    """Judge one design/distribution.md §3.10 read for the commit of (`lease_epoch`, `node_id`); see
    the module rules."""
    if read is None:
        return "lost"
    if checkpoint_id is not None and read.checkpoint_committed:
        return "committed"
    if final is not None and read.state == final and read.lease_epoch == lease_epoch:
        return "committed"
    if (read.state == "running" and read.lease_epoch == lease_epoch
            and read.owner_node == node_id and read.live):
        return "retry"
    return "lost"
