"""NodeRuntime (distribution.md §5) against MemStore on a ManualClock: virtual time only.

Every store call answers at once, so no loop-time bound (`asyncio.timeout`) ever fires; the
test moves the ManualClock to the next sleeper's deadline whenever the loop has settled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest

from flyd.leases.clock import ManualClock
from flyd.leases.core import LeaseLost
from flyd.leases.fit import Fit
from flyd.leases.params import LeaseParams
from flyd.leases.runtime import GrantScope as Scope
from flyd.leases.runtime import NodeRuntime
from flyd.leases.stores.contract import (
    Checkpoint,
    Commit,
    Committed,
    DuplicateEffect,
    Effect,
    Fenced,
    Grant,
    Held,
    NodeInfo,
    NodeState,
    Released,
    Renewed,
    Transient,
    UnknownOutcome,
)
from flyd.leases.stores.mem import MemStore
from tests.admin_store import AdminMemStore
from workers.types.canonical import canonical

P = LeaseParams.short_ttl()
NODE = "a-000000000001"


class Groups:
    """Process groups of runs: `live` runs have workers until killed."""

    def __init__(self) -> None:
        self.killed: list[int] = []
        self.live: set[int] = set()

    def kill(self, run_id: int) -> None:
        self.killed.append(run_id)
        self.live.discard(run_id)

    def alive(self, run_id: int) -> bool:
        return run_id in self.live


CommitFault = Callable[["Store", Commit], Awaitable[Committed]]


class Store(AdminMemStore):
    """MemStore recording calls, with switchable faults."""

    def __init__(self, clock: ManualClock) -> None:
        super().__init__(clock.now)
        self.renew_down = False
        self.renew_drop = False
        self.claim_reply_lost = False
        self.commit_faults: list[CommitFault] = []
        self.claims: list[tuple[int, int | None]] = []
        self.releases: list[tuple[int, int, bool]] = []
        self.commits: list[Commit] = []
        self.renews: list[list[Held]] = []
        self.node_states: list[NodeState] = []
        self.register_failures = 0
        self.reconnect_down = False
        self.reconnects = 0

    async def register_node(self, node: NodeInfo) -> None:
        if self.register_failures > 0:
            self.register_failures -= 1
            raise Transient("register timed out")
        await super().register_node(node)

    async def reconnect_heartbeat(self) -> None:
        self.reconnects += 1
        if self.reconnect_down:
            raise Transient("connection refused")

    async def set_node_state(self, node_id: str, state: NodeState,
                             reason: str | None = None) -> None:
        self.node_states.append(state)
        await super().set_node_state(node_id, state, reason)

    async def claim(self, node_id: str, n: int, ttl_s: float,
                    only: int | None = None, fit: Fit | None = None) -> list[Grant]:
        self.claims.append((n, only))
        grants = await super().claim(node_id, n, ttl_s, only, fit)
        if self.claim_reply_lost:
            self.claim_reply_lost = False
            raise UnknownOutcome("claim reply lost", None)
        return grants

    async def renew(self, node_id: str, holds: Sequence[Held], ttl_s: float) -> list[Renewed]:
        self.renews.append(list(holds))
        if self.renew_down:
            raise Transient("connection refused")
        if self.renew_drop:
            return []
        return await super().renew(node_id, holds, ttl_s)

    async def release(self, run_id: int, lease_epoch: int, node_id: str, *, refund: bool,
                      backoff_s: float) -> Released | None:
        self.releases.append((run_id, lease_epoch, refund))
        return await super().release(run_id, lease_epoch, node_id, refund=refund,
                                     backoff_s=backoff_s)

    async def commit(self, commit: Commit) -> Committed:
        self.commits.append(commit)
        if self.commit_faults:
            return await self.commit_faults.pop(0)(self, commit)
        return await super().commit(commit)

    def run_row(self, run_id: int) -> dict[str, Any]:
        return next(r for r in self.dump()["runs"] if r["run_id"] == run_id)

    def effect_keys(self, run_id: int) -> list[str]:
        return [e["effect_key"] for e in self.dump()["effects"] if e["run_id"] == run_id]


Body = Callable[[Scope], Awaitable[None]]


class Executor:
    def __init__(self, body: Body) -> None:
        self.body = body
        self.scopes: list[Scope] = []
        self.errors: list[BaseException] = []

    async def execute(self, scope: Scope) -> None:
        self.scopes.append(scope)
        try:
            await self.body(scope)
        except BaseException as exc:
            self.errors.append(exc)
            raise


def effect(k: int, session_epoch: int = 1) -> Effect:
    payload = {"boundary": k, "v": k * 7}
    return Effect(f"boundary-{k}", session_epoch, k, payload,
                  hashlib.sha256(canonical(payload)).digest())


def checkpoint(k: int, ckpt: str | None = None) -> Checkpoint:
    env = f"envelope-{k}".encode()
    return Checkpoint(ckpt or f"ck-{k}", "session-1", 1, "episode-1", k, "compat",
                      hashlib.sha256(env).digest(), env)


async def step_one(scope: Scope) -> None:
    await scope.commit([effect(1)], checkpoint(1))


async def finish_ok(scope: Scope) -> None:
    await step_one(scope)
    await scope.finish("succeeded", {"result": 42}, [effect(2)], boundaries=2, session_epoch=1)


async def block(scope: Scope) -> None:
    await asyncio.Event().wait()


async def settle() -> None:
    for _ in range(60):
        await asyncio.sleep(0)


async def advance_until(clock: ManualClock, cond: Callable[[], bool], limit: float) -> None:
    """Run the loop, moving virtual time to the next deadline, until `cond()` or `limit`."""
    while True:
        await settle()
        if cond():
            return
        nxt = clock.next_wakeup()
        assert nxt is not None, "nothing left to wake"
        assert nxt <= limit, f"condition still false at t = {clock.now()}"
        clock.set(max(nxt, clock.now()))


class Harness:
    def __init__(self, body: Body, *, capacity: int = 1, only: int | None = None,
                 params: LeaseParams = P) -> None:
        self.clock = ManualClock(100.0)
        self.store = Store(self.clock)
        self.groups = Groups()
        self.executor = Executor(body)
        self.events: list[dict[str, Any]] = []
        node = NodeInfo(NODE, "a", "host", 1, "test", capacity)
        self.rt = NodeRuntime(params=params, store=self.store, clock=self.clock,
                              executor=self.executor, groups=self.groups, node=node,
                              capacity=capacity, only=only, seed=7, events=self.events)
        self.exit: int | None = None

    async def submit(self, n: int = 1, **spec: Any) -> list[int]:
        out: list[int] = []
        for i in range(n):
            s = await self.store.submit(f"k{len(out)}-{i}-{spec}", {"name": f"r{i}", **spec}, 3)
            out.append(s.run_id)
        return out

    def named(self, name: str, **match: Any) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == name
                and all(e.get(k) == v for k, v in match.items())]

    async def run(self, tg: asyncio.TaskGroup) -> asyncio.Task[None]:
        async def main() -> None:
            self.exit = await self.rt.run()
        return tg.create_task(main())

    async def until(self, cond: Callable[[], bool], within: float = 30.0) -> None:
        await advance_until(self.clock, cond, self.clock.now() + within)

    async def idle(self, dt: float) -> None:
        """Let `dt` of virtual time pass."""
        end = self.clock.now() + dt
        await self.until(lambda: self.clock.now() >= end, dt + 1.0)

    async def stop(self, task: asyncio.Task[None]) -> None:
        self.rt.stop()
        await self.until(task.done, 10.0)


async def test_claim_execute_finish_commits_effects_and_finish() -> None:
    h = Harness(finish_ok)
    [run] = await h.submit()
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.named("finished")))
        assert h.store.run_row(run)["state"] == "succeeded"
        assert h.store.effect_keys(run) == ["boundary-1", "boundary-2", "finish"]
        fin = next(e for e in h.store.dump()["effects"] if e["effect_key"] == "finish")
        payload = {"state": "succeeded", "boundaries": 2,
                   "outcomeDigest": hashlib.sha256(canonical({"result": 42})).hexdigest()}
        assert fin["payload"] == payload and fin["boundary"] is None
        assert fin["payload_digest"] == hashlib.sha256(canonical(payload)).digest()
        last = h.store.commits[-1]
        assert last.finish is not None and last.finish.state == "succeeded"
        assert [e.key for e in last.effects] == ["boundary-2", "finish"]
        assert h.rt.core.holds == () and h.rt.held() == []
        assert h.named("claimed", run=run, epoch=1)
        assert [e["kind"] for e in h.named("write_begin", run=run)] == ["commit", "finish"]
        assert all(e["t"] >= 100.0 and e["node"] == NODE for e in h.events)
        assert not h.named("lease_lost") and h.store.releases == []
        await h.stop(task)
    assert h.exit == 0 and h.store.node_states[-1] == "stopped"


async def test_heartbeat_renews_and_extends_safe_until() -> None:
    h = Harness(block)
    [run] = await h.submit()
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.rt.held()))
        await h.until(lambda: h.clock.now() >= 112.0, 15.0)  # 3·T, 6.5·G
        [(r, epoch, phase, left)] = h.rt.held()
        assert (r, epoch, phase.value) == (run, 1, "ACTIVE") and 0 < left <= P.G
        renewed = h.named("renewed")
        assert len(renewed) >= 15 and not h.named("lease_lost")
        gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(renewed)]
        assert all(0.9 * P.H - 1e-9 <= g <= 1.1 * P.H + 1e-9 for g in gaps)  # start to start
        assert any(held == [Held(run, 1)] for held in h.store.renews)
        assert h.store.run_row(run)["state"] == "running"
        await h.stop(task)


async def test_renew_missing_cancels_scope() -> None:
    fences: list[str] = []

    async def body(scope: Scope) -> None:
        scope.on_fence(fences.append)
        await asyncio.Event().wait()

    h = Harness(body)
    [run] = await h.submit()
    h.groups.live.add(run)
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.executor.scopes))
        h.store.renew_drop = True
        await h.until(lambda: bool(h.named("released", run=run, epoch=1)))
        assert fences == ["renew_missing"]
        assert h.groups.killed == [run]
        assert [e["reason"] for e in h.named("lease_lost")] == ["renew_missing"]
        assert h.named("scope_cancelled", run=run, epoch=1)
        assert h.store.releases == [(run, 1, False)]
        assert isinstance(h.executor.errors[0], asyncio.CancelledError)
        assert not h.named("finished") and not any(c.finish for c in h.store.commits)
        [first] = [a for a in h.store.dump()["run_attempts"] if a["lease_epoch"] == 1]
        assert first["end_reason"] == "released"
        assert h.store.run_row(run)["state"] in ("pending", "running")  # never terminal
        regrant = h.named("claimed", run=run, epoch=2)
        assert not regrant or regrant[0]["attempt"] == 2  # the relinquish refunded nothing
        await h.stop(task)


async def test_watchdog_self_fences_at_safe_until_when_store_unreachable() -> None:
    h = Harness(block)
    [run] = await h.submit()
    h.groups.live.add(run)
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.executor.scopes) and len(h.named("renewed")) >= 3)
        h.store.renew_down = True
        last_ack = h.named("renewed")[-1]["t_send"]
        await h.until(lambda: bool(h.named("scope_cancelled")), 10.0)
        [lost] = h.named("lease_lost")
        assert lost["reason"] == "safe_until"
        assert last_ack + P.G <= lost["t"] <= last_ack + P.G + P.watchdog_tick_s
        [gone] = h.named("scope_cancelled")
        assert gone["t"] - lost["t"] <= P.kill_bound_s
        assert h.groups.killed == [run]
        # the server's expiry (renewed at last_ack, + T) comes after the self-fence, ε to spare
        assert last_ack + P.T - lost["t"] >= P.safety_margin_s - P.watchdog_tick_s
        assert h.store.run_row(run)["state"] in ("pending", "running")
        assert h.named("renew_unknown")
        assert not h.named("finished") and not any(c.finish for c in h.store.commits)
        await h.stop(task)


async def test_registration_retried_before_giving_up() -> None:
    h = Harness(block)
    h.store.register_failures = 2
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.named("renewed")))
        failed = h.named("register_failed")
        assert [e["attempt"] for e in failed] == [1, 2]
        assert failed[1]["t"] - failed[0]["t"] == pytest.approx(P.claim_poll_s)
        await h.stop(task)
    assert h.exit == 0
    h = Harness(block)
    h.store.register_failures = 99
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(task.done, 10.0)
    assert h.exit == 1 and [e["attempt"] for e in h.named("register_failed")] == [1, 2, 3, 4, 5]
    assert not h.named("renew_sent")


@pytest.mark.parametrize("reconnect_ok", [True, False])
async def test_abandoned_renewal_reconnects_heartbeat_at_once(reconnect_ok: bool) -> None:
    h = Harness(block)
    [run] = await h.submit()
    h.store.reconnect_down = not reconnect_ok
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.executor.scopes) and len(h.named("renewed")) >= 2)
        assert h.store.reconnects == 0                   # nothing abandoned yet
        h.store.renew_down = True
        await h.until(lambda: bool(h.named("renew_unknown")))
        h.store.renew_down = False
        [unknown] = h.named("renew_unknown")
        await h.until(lambda: len([e for e in h.named("renew_sent")
                                   if e["t"] > unknown["t"]]) >= 1, 5.0)
        after = [e for e in h.events[h.events.index(unknown):] if e["event"] in (
            "renew_unknown", "heartbeat_reconnected", "heartbeat_reconnect_failed",
            "renew_sent", "renewed")]
        done = "heartbeat_reconnected" if reconnect_ok else "heartbeat_reconnect_failed"
        assert [e["event"] for e in after[:3]] == ["renew_unknown", done, "renew_sent"]
        assert after[1]["t"] == unknown["t"] and h.store.reconnects == 1  # before the slot
        sent = [e["t"] for e in h.named("renew_sent")]
        assert after[2]["t"] - sent[sent.index(after[2]["t"]) - 1] >= 0.9 * P.H - 1e-9
        await h.until(lambda: bool(h.named("renewed", runs=[[run, 1]])
                                   and h.named("renewed")[-1]["t"] > unknown["t"]), 5.0)
        assert not h.named("lease_lost")
        await h.stop(task)


async def test_lf001_on_commit_cancels_scope() -> None:
    fences: list[str] = []

    async def fenced(store: Store, c: Commit) -> Committed:
        raise Fenced(f"run {c.run_id} epoch {c.lease_epoch} is not live")

    async def body(scope: Scope) -> None:
        scope.on_fence(fences.append)
        await step_one(scope)
        await asyncio.Event().wait()

    h = Harness(body)
    h.store.commit_faults.append(fenced)
    [run] = await h.submit()
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.named("released", run=run, epoch=1)))
        assert fences == ["fenced"]
        assert isinstance(h.executor.errors[0], LeaseLost)
        assert [e["reason"] for e in h.named("lease_lost")] == ["fenced"]
        assert h.groups.killed == [run]
        assert h.store.releases == [(run, 1, False)]
        assert h.named("write_result", run=run, result="fenced")
        assert not [e for e in h.store.dump()["effects"] if e["lease_epoch"] == 1]
        await h.stop(task)


async def reply_lost_after_commit(store: Store, c: Commit) -> Committed:
    open_ = store.open_commit(c)
    await open_.commit()
    raise UnknownOutcome("connection lost after COMMIT", open_.backend)


async def reply_lost_before_commit(store: Store, c: Commit) -> Committed:
    open_ = store.open_commit(c)
    raise UnknownOutcome("connection lost before COMMIT ran", open_.backend)


async def reply_lost_and_grant_gone(store: Store, c: Commit) -> Committed:
    open_ = store.open_commit(c)
    store.admin_update_run(c.run_id, owner_node="b-000000000002")
    raise UnknownOutcome("connection lost; the grant moved on", open_.backend)


@pytest.mark.parametrize(("fault", "decision"), [
    (reply_lost_after_commit, "committed"),
    (reply_lost_before_commit, "retry"),
    (reply_lost_and_grant_gone, "lost"),
])
async def test_unknown_commit_outcome_resolved(fault: CommitFault, decision: str) -> None:
    h = Harness(finish_ok)
    h.store.commit_faults.append(fault)
    [run] = await h.submit()
    h.groups.live.add(run)
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.named("resolved")))
        if decision == "lost":
            await h.until(lambda: bool(h.named("scope_cancelled")))
        else:
            await h.until(lambda: bool(h.named("finished")))
        assert [e["decision"] for e in h.named("resolved")] == [decision]
        first = h.store.commits[0]
        if decision == "committed":
            assert h.store.effect_keys(run) == ["boundary-1", "boundary-2", "finish"]
            assert len(h.store.commits) == 2
        elif decision == "retry":
            assert h.store.commits[1] == first  # the identical commit, sent again
            assert h.store.effect_keys(run) == ["boundary-1", "boundary-2", "finish"]
            assert len(h.store.commits) == 3
        else:
            assert [e["reason"] for e in h.named("lease_lost")] == ["unknown_outcome_lost"]
            assert isinstance(h.executor.errors[0], LeaseLost)
            assert h.groups.killed == [run]
            assert h.store.effect_keys(run) == [] and len(h.store.commits) == 1
            assert h.store.run_row(run)["state"] == "running"
        assert h.store.open_commits() == []
        await h.stop(task)


async def test_cancel_flag_sets_cancel_requested() -> None:
    async def body(scope: Scope) -> None:
        await step_one(scope)
        await scope.cancel_requested.wait()
        await scope.finish("cancelled", {"cancelledAt": 1}, boundaries=1, session_epoch=1)

    h = Harness(body)
    [run] = await h.submit()
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.named("write_result", kind="commit")))
        assert not h.executor.scopes[0].cancel_requested.is_set()
        await h.store.cancel(run, "tester")
        await h.until(lambda: bool(h.named("finished")), 2 * P.H)
        assert h.store.run_row(run)["state"] == "cancelled"
        assert h.store.effect_keys(run) == ["boundary-1", "finish"]
        assert h.named("finished")[0]["state"] == "cancelled"
        await h.stop(task)


async def test_drain_commits_releases_with_refund_and_stops() -> None:
    async def body(scope: Scope) -> None:
        await scope.drain_requested.wait()
        await step_one(scope)
        await scope.release(refund=True)

    h = Harness(body)
    [run] = await h.submit()
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.executor.scopes))
        claims = len(h.store.claims)
        h.rt.drain()
        await h.until(task.done, P.drain_timeout_s)
    assert h.exit == 0
    assert h.store.node_states == ["draining", "stopped"]
    assert h.store.releases == [(run, 1, True)]
    row = h.store.run_row(run)
    assert (row["state"], row["attempt"]) == ("pending", 0)
    assert h.store.effect_keys(run) == ["boundary-1"]
    assert len(h.store.claims) == claims  # the claimer stopped
    assert h.store.dump()["nodes"][0]["state"] == "stopped"
    assert not h.named("lease_lost")


async def test_drain_timeout_cancels_holds_left() -> None:
    params = dataclasses.replace(P, drain_timeout_s=3.0)
    h = Harness(block, params=params)
    [run] = await h.submit()
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.executor.scopes))
        start = h.clock.now()
        h.rt.drain()
        await h.until(task.done, 10.0)
    [lost] = h.named("lease_lost")
    assert lost["reason"] == "drain_timeout" and lost["t"] - start == pytest.approx(3.0, abs=0.3)
    assert h.exit == 0 and h.store.node_states[-1] == "stopped"
    assert h.store.releases == [(run, 1, False)]


async def test_capacity_respected() -> None:
    gates: dict[int, asyncio.Event] = {}
    running: set[int] = set()
    peak = 0

    async def body(scope: Scope) -> None:
        nonlocal peak
        running.add(scope.run_id)
        peak = max(peak, len(running))
        gates[scope.run_id] = gate = asyncio.Event()
        await gate.wait()
        running.discard(scope.run_id)
        await scope.finish("succeeded", {}, boundaries=0, session_epoch=0)

    h = Harness(body, capacity=2)

    def running_is(n: int) -> Callable[[], bool]:
        return lambda: len(running) == n

    def finished_is(n: int) -> Callable[[], bool]:
        return lambda: len(h.named("finished")) == n
    runs = await h.submit(5)
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        done = 0
        while done < 5:
            await h.until(running_is(min(2, 5 - done)))
            await h.idle(3 * P.claim_poll_s)
            assert len(running) == min(2, 5 - done)
            for r in sorted(running):
                gates[r].set()
            done += len(running)
            await h.until(finished_is(done))
        assert peak == 2
        assert all(n <= 2 for n, _ in h.store.claims)
        assert {h.store.run_row(r)["state"] for r in runs} == {"succeeded"}
        await h.stop(task)


async def test_only_passed_to_claim() -> None:
    h = Harness(finish_ok, capacity=3, only=2)  # run ids count from 1
    runs = await h.submit(3, exclusiveToSubmitter=True)
    assert runs == [1, 2, 3]
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.named("finished")))
        await h.idle(3 * P.claim_poll_s)
        assert [s.run_id for s in h.executor.scopes] == [2]
        assert len(h.store.claims) >= 2 and all(c == (1, 2) for c in h.store.claims)
        assert [h.store.run_row(r)["state"] for r in runs] == ["pending", "succeeded", "pending"]
        await h.stop(task)


async def test_executor_error_relinquishes() -> None:
    async def body(scope: Scope) -> None:
        raise RuntimeError("session crashed")

    h = Harness(body)
    [run] = await h.submit()
    h.groups.live.add(run)
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.named("released")))
        assert h.named("scope_error", run=run, epoch=1)
        assert h.groups.killed[0] == run and not h.groups.alive(run)
        assert h.store.releases[0] == (run, 1, False)
        assert not h.named("lease_lost")
        await h.stop(task)


async def test_duplicate_effect_fails_the_run() -> None:
    async def duplicate(store: Store, c: Commit) -> Committed:
        e = c.effects[0]
        raise DuplicateEffect(e.key, 1, e.digest, f"duplicate key {e.key}")

    h = Harness(finish_ok)
    h.store.commit_faults.append(duplicate)
    [run] = await h.submit()
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.named("finished")))
        row = h.store.run_row(run)
        assert row["state"] == "failed"
        assert row["outcome"] == {"error": "effect_duplicate", "key": "boundary-1",
                                  "existingEpoch": 1, "digest": effect(1).digest.hex()}
        assert h.store.effect_keys(run) == ["finish"]
        last = h.store.commits[-1]
        assert last.checkpoint is None and [e.key for e in last.effects] == ["finish"]
        assert isinstance(h.executor.errors[0], DuplicateEffect)
        assert h.named("run_failed") and not h.named("scope_error")
        await h.stop(task)


async def test_unknown_claim_outcome_sweeps_unseen_grant() -> None:
    h = Harness(block)
    h.store.claim_reply_lost = True
    [run] = await h.submit()
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(h.store.releases))
        assert h.store.releases[0] == (run, 1, True)      # released with refund
        assert h.named("released", run=run, epoch=1, kind="sweep")
        await h.until(lambda: bool(h.executor.scopes))     # claimed again, now seen
        assert (h.executor.scopes[0].run_id, h.executor.scopes[0].lease_epoch) == (run, 2)
        assert h.executor.scopes[0].attempt == 1
        await h.stop(task)


async def test_a_commit_reply_after_the_self_fence_is_neither_logged_nor_acted_on() -> None:
    """S6 (§7.3.6): a group commit lands, the store then stops answering renewals, and the
    commit's reply (committed) comes back only after the watchdog fenced the hold. After
    `lease_lost` the node logs nothing more for the grant but its cleanup (the session's scope
    is cancelled)."""
    clock_box: list[ManualClock] = []

    async def late(store: Store, c: Commit) -> Committed:
        done = await MemStore.commit(store, c)
        store.renew_down = True
        clock = clock_box[0]
        await clock.sleep_until(clock.now() + P.G + 2 * P.watchdog_tick_s)
        return done

    writes: list[asyncio.Task[None]] = []

    async def body(scope: Scope) -> None:
        # the write outlives the scope's cancellation, as a session's checkpoint writer may
        writes.append(asyncio.ensure_future(step_one(scope)))
        await asyncio.shield(writes[0])

    h = Harness(body)
    clock_box.append(h.clock)
    h.store.commit_faults.append(late)
    [run] = await h.submit()
    async with asyncio.TaskGroup() as tg:
        task = await h.run(tg)
        await h.until(lambda: bool(writes) and writes[0].done(), 30.0)
        assert isinstance(writes[0].exception(), LeaseLost)
        [lost] = h.named("lease_lost", run=run, epoch=1)
        assert lost["reason"] == "safe_until"
        [begin] = h.named("write_begin", run=run, epoch=1, kind="commit")
        assert begin["t"] < lost["t"], "the commit was in flight when the hold was fenced"
        assert h.store.effect_keys(run) == ["boundary-1"], "the commit landed"
        after = h.events[h.events.index(lost) + 1:]
        mine = [e["event"] for e in after if e.get("run") == run and e.get("epoch") == 1]
        assert set(mine) <= {"scope_cancelled", "released", "write_begin", "write_result"}
        assert not h.named("write_result", run=run, epoch=1, kind="commit")
        assert not h.named("resolved", run=run, epoch=1)
        assert h.named("scope_cancelled", run=run, epoch=1)
        await h.stop(task)
