"""The session stand-in of tier 1 (distribution.md §7.2): `SimExecutor` and `SimGroups`.

Rules:
- A run's spec carries `boundaries` (N), `pace` (sim seconds per boundary on the node's clock)
  and `every` (checkpoint cadence). The executor resumes from the grant's head boundary and
  steps to the next multiple of `every` in one sleep of `pace` per boundary (one timer per
  checkpoint interval keeps a seed cheap; cancels and drains are seen there), then commits the
  pending effects with a checkpoint (a small fake envelope). The last boundary is committed by
  the final commit (`succeeded`, with its checkpoint). A failed commit (`Transient`) keeps the
  effects pending: the next capture covers them.
- Effects are `boundary-<k>` with a payload that depends only on the run's key and k, so every
  epoch that executes a boundary produces the same digest (`payload`, `reference`).
- A flagged cancel ends the run `cancelled` with the effects up to the current boundary; a drain
  commits what is pending with a checkpoint, then releases with refund; a hurried drain releases
  at once.
- Cooperative cancellation: when the scope task is cancelled, the executor may keep going for a
  seeded delay (under K) before it lets the cancellation through; during the delay it tries one
  more write, which the runtime's guard must refuse (`late_refused` / `late_through`).
- `SimGroups` are the run's process groups: spawned at start, gone at a normal end, when the
  session fails on a store error, at `kill` and with a crashed node; every kill is logged at
  true time.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from flyd.leases.core import LeaseLost
from flyd.leases.runtime import GrantScope as Scope
from flyd.leases.stores.contract import Checkpoint, Effect, StoreError, Transient
from workers.types.canonical import canonical

if TYPE_CHECKING:
    from .world import Incarnation


def payload(key: str, k: int) -> dict[str, Any]:
    """The behaviour record stand-in of boundary k of run `key` (epoch-independent)."""
    return {"run": key, "boundary": k,
            "value": hashlib.sha256(f"{key}:{k}".encode()).hexdigest()[:16]}


@functools.lru_cache(maxsize=4096)
def _digest(key: str, k: int) -> bytes:
    return hashlib.sha256(canonical(payload(key, k))).digest()


def effect(key: str, k: int, session_epoch: int) -> Effect:
    return Effect(key=f"boundary-{k}", session_epoch=session_epoch, boundary=k,
                  payload=payload(key, k), digest=_digest(key, k))


def reference(key: str, boundaries: int) -> dict[str, str]:
    """Expected digest (hex) of every boundary effect of a run."""
    return {f"boundary-{k}": _digest(key, k).hex() for k in range(1, boundaries + 1)}


class SimGroups:
    """Process groups of one node incarnation."""

    def __init__(self, node: Incarnation) -> None:
        self._node = node
        self._alive: dict[int, bool] = {}

    def spawn(self, run_id: int) -> None:
        self._alive[run_id] = True

    def exit(self, run_id: int) -> None:
        self._alive.pop(run_id, None)

    def kill(self, run_id: int) -> None:
        if self._alive.pop(run_id, None):
            self._node.sim.log_kill(self._node.node_id, run_id, "kill")

    def alive(self, run_id: int) -> bool:
        return run_id in self._alive

    def die_with_parent(self) -> None:
        for run_id in sorted(self._alive):
            self._node.sim.log_kill(self._node.node_id, run_id, "crash")
        self._alive.clear()

    def orphans(self) -> list[int]:
        return sorted(self._alive)


class SimExecutor:
    """Runs one grant's session on the node's virtual clock (see the module rules)."""

    def __init__(self, node: Incarnation, *, behind_head: bool = False) -> None:
        self._node = node
        self._behind = behind_head

    async def execute(self, scope: Scope) -> None:
        node = self._node
        sim = node.sim
        spec: Mapping[str, Any] = scope.grant.spec
        key: str = spec["key"]
        total: int = spec["boundaries"]
        pace: float = spec["pace"]
        every: int = spec["every"]
        epoch = scope.lease_epoch
        b = scope.grant.boundary
        if self._behind and b > 0:
            b = max(0, b - every)
        node.groups.spawn(scope.run_id)
        pending: list[Effect] = []
        serial = 0

        def ckpt(k: int) -> Checkpoint:
            nonlocal serial
            serial += 1
            env = f"{key}:{k}:{epoch}:{serial}".encode()
            return Checkpoint(checkpoint_id=f"c{epoch}-{k}-{serial}", session_id=f"s{epoch}",
                              session_epoch=epoch, episode_id="e1", boundary=k,
                              compatibility_digest="sim", envelope_digest=hashlib.sha256(
                                  env).digest(), envelope=env)

        try:
            while b < total:
                if scope.cancel_requested.is_set():
                    await self._finish(scope, "cancelled", pending, b, pace)
                    return
                if scope.drain_requested.is_set():
                    if pending and not scope.drain_hurry.is_set():
                        try:
                            await scope.commit(pending, ckpt(b))
                        except Transient:
                            pass
                    await scope.release(refund=True)
                    node.groups.exit(scope.run_id)
                    return
                nxt = min(total, (b // every + 1) * every)
                await node.clock.sleep_until(node.clock.now() + pace * (nxt - b))
                pending.extend(effect(key, k, epoch) for k in range(b + 1, nxt + 1))
                b = nxt
                if b % every == 0 and b < total:
                    try:
                        await scope.commit(pending, ckpt(b))
                        pending = []
                    except Transient:
                        pass
            await self._finish(scope, "succeeded", pending, total, pace, ckpt)
        except StoreError:
            node.groups.exit(scope.run_id)
            raise
        except asyncio.CancelledError:
            delay = node.cancel_delay()
            if delay > 0 and not node.crashed:
                await node.clock.sleep_until(node.clock.now() + delay)
                try:
                    await scope.commit(pending or [effect(key, b + 1, epoch)], ckpt(b + 1))
                except (LeaseLost, Transient):
                    sim.stats["late_refused"] += 1
                else:
                    sim.stats["late_through"] += 1
            raise

    async def _finish(self, scope: Scope, state: str, pending: list[Effect], boundaries: int,
                      pace: float, ckpt: Any = None) -> None:
        node = self._node
        outcome = {"state": state, "boundaries": boundaries}
        while True:
            try:
                if state == "succeeded":
                    await scope.finish("succeeded", outcome, pending, boundaries=boundaries,
                                       session_epoch=scope.lease_epoch,
                                       checkpoint=ckpt(boundaries))
                else:
                    await scope.finish("cancelled", outcome, pending, boundaries=boundaries,
                                       session_epoch=scope.lease_epoch)
            except Transient:
                await node.clock.sleep_until(node.clock.now() + pace)
                continue
            node.groups.exit(scope.run_id)
            return
