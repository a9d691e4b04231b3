"""Broken variants the oracle must flag (distribution.md §7.2 "Canaries").

Each breaks one safety mechanism inside the simulator only (a subclass of the production class
or a flag of the simulated executor); production code has no switch for any of them.
- `watchdog_off`: the runtime never self-fences at safe_until (the watchdog only sleeps).
- `fence_off`: the store's fence (statement-time and commit-time) accepts every epoch.
- `renew_expired`: the store renews a lease that has already expired (M6 broken).
- `behind_head`: the executor resumes from one checkpoint interval behind the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from flyd.leases.runtime import NodeRuntime
from flyd.leases.stores.contract import Held, Renewed
from flyd.leases.stores.mem import _Plan
from tests.admin_store import AdminMemStore

from .world import Variant

SLEEP_S: Final = 3600.0


class NoWatchdogRuntime(NodeRuntime):
    async def _watchdog(self) -> None:
        while True:
            await self._clock.sleep_until(self._clock.now() + SLEEP_S)


class FenceOffStore(AdminMemStore):
    def _fence_ok(self, run_id: int, epoch: int) -> bool:
        return run_id in self._runs

    def _deferred_fence_ok(self, plan: _Plan) -> bool:
        return True


class RenewExpiredStore(AdminMemStore):
    async def renew(self, node_id: str, holds: Sequence[Held], ttl_s: float) -> list[Renewed]:
        now = self._now()
        for h in holds:
            r = self._runs.get(h.run_id)
            if (r is not None and r.lease_epoch == h.lease_epoch and r.state == "running"
                    and r.owner_node == node_id and r.lease_expires_at is not None
                    and r.lease_expires_at <= now):
                r.lease_expires_at = now + 1e-9
        return await super().renew(node_id, holds, ttl_s)


CANARIES: Final = {
    "watchdog_off": Variant("watchdog_off", runtime=NoWatchdogRuntime),
    "fence_off": Variant("fence_off", store=FenceOffStore),
    "renew_expired": Variant("renew_expired", store=RenewExpiredStore),
    "behind_head": Variant("behind_head", behind_head=True),
}


def variant(name: str) -> Variant:
    """The named variant; `real` is the unbroken system."""
    return Variant() if name == "real" else CANARIES[name]
