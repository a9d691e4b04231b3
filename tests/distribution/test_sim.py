"""Tier 1 acceptance tests (distribution.md §8, 36–39): parameters and the sans-IO lease core.

Virtual time only: every clock reading is a number passed in; nothing sleeps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from flyd.leases.core import (
    CancelScope,
    Forget,
    GrantRow,
    LeaseCore,
    LeaseLost,
    RenewRow,
    StartScope,
)
from flyd.leases.core import LeasePhase as Phase
from flyd.leases.params import LeaseParams, LeaseParamsError
from tests.distribution.harness.runner import Report

# Each clause of §4.3 violated alone (every other clause holds).
ALONE: dict[str, list[dict[str, float | int | None]]] = {
    "§4.3.1": [
        {"clock_rate_bound": -0.01},
        {"clock_rate_bound": 0.5, "heartbeat_interval_s": 1.3, "renew_timeout_s": 1.0,
         "connect_timeout_s": 0},
    ],
    "§4.3.2": [{"renew_timeout_s": 3.0}, {"heartbeat_interval_s": 3.5}],
    "§4.3.3": [{"kill_bound_s": 2.5}],
    "§4.3.4": [{"commit_timeout_s": 1.9}, {"commit_budget_s": 2.2}],
    "§4.3.5": [{"idle_in_transaction_timeout_ms": 2000.0}],
    "§4.3.6": [{"connect_timeout_s": 3}, {"claim_poll_s": 3.1}],
}


def test_params_invariant() -> None:
    assert LeaseParams().validate().G == 10.0
    assert LeaseParams().H == 3.0
    short = LeaseParams.short_ttl().validate()
    assert (short.T, short.H, short.G) == (4.0, 0.6, 1.85)
    assert short.watchdog_tick_s == 0.25 and short.kill_bound_s == 0.5
    assert short.clock_rate_bound == 0.1
    for clause, variants in ALONE.items():
        for changes in variants:
            p = dataclasses.replace(LeaseParams(), **changes)  # type: ignore[arg-type]
            assert [e.clause for e in p.violations()] == [clause], (clause, changes)
            with pytest.raises(LeaseParamsError) as info:
                p.validate()
            assert info.value.clause == clause and clause in str(info.value)
    # --lease-ttl sets T only; H follows T/5, the rest keeps its value; named clause refuses.
    four = LeaseParams().with_ttl(4)
    assert four.H == 0.8 and four.renew_timeout_s == 2.0
    with pytest.raises(LeaseParamsError, match=r"§4\.3\.2"):
        four.validate()
    fixed_h = dataclasses.replace(LeaseParams(), heartbeat_interval_s=2.5).with_ttl(30)
    assert fixed_h.H == 2.5
    with pytest.raises(LeaseParamsError, match=r"§4\.2"):
        LeaseParams(ttl_s=float("nan")).validate()


P = LeaseParams()
G = P.G


def _core(capacity: int = 4) -> LeaseCore:
    return LeaseCore(P, "n1-000000000000", capacity)


def test_core_safe_until() -> None:
    core = _core()
    acts = core.on_granted([GrantRow("r", 1, 1)], t_send=100.0)
    assert acts == [StartScope("r", 1, 1)]
    assert core.hold("r", 1) is not None and core.hold("r", 1).safe_until == 100.0 + G  # type: ignore[union-attr]
    core.end("r", "start")
    # acknowledged renewal extends to t_send + G
    b = core.renew_batch(103.0)
    assert core.on_renewed(b, [RenewRow("r", 1)], t_send=103.0) == []
    assert core.hold("r", 1).safe_until == 103.0 + G  # type: ignore[union-attr]
    # never shortened: an older t_send acknowledged late keeps the later safe_until
    b2 = core.renew_batch(103.5)
    core.on_renewed(b2, [RenewRow("r", 1)], t_send=101.0)
    assert core.hold("r", 1).safe_until == 103.0 + G  # type: ignore[union-attr]
    # unknown renewals extend nothing
    b3 = core.renew_batch(106.0)
    assert core.on_renew_unknown(b3) == []
    assert core.hold("r", 1).safe_until == 103.0 + G  # type: ignore[union-attr]
    assert core.next_deadline() == 103.0 + G
    assert core.expire_due(103.0 + G - 0.001) == []
    assert core.expire_due(103.0 + G) == [CancelScope("r", 1, "safe_until")]
    assert core.hold("r", 1).phase is Phase.LOST  # type: ignore[union-attr]
    # a lost hold is never extended again
    core.on_renewed(b3, [RenewRow("r", 1)], t_send=110.0)
    assert core.hold("r", 1).safe_until == 103.0 + G  # type: ignore[union-attr]
    assert core.next_deadline() is None


def test_core_missing_row() -> None:
    core = _core(capacity=8)
    core.on_granted([GrantRow(r, 1, 1) for r in "abcdef"], t_send=0.0)
    for r in "abcdef":
        core.end(r, "start")
    core.begin("b", "commit")
    batch = core.renew_batch(1.0)
    assert {e.run_id for e in batch.entries} == set("abcdef")
    core.begin("c", "finish")           # FINISHING after the batch was built
    core.begin("d", "release")          # RELEASING after the batch was built
    core.on_granted([GrantRow("e", 2, 2)], t_send=0.5)   # changed epoch: e@1 fenced
    core.begin("f", "commit")           # ACTIVE -> COMMITTING: still renewable
    acts = core.on_renewed(batch, [], t_send=1.0)
    assert CancelScope("a", 1, "renew_missing") in acts
    assert CancelScope("f", 1, "renew_missing") in acts
    assert CancelScope("b", 1, "renew_missing") in acts
    assert not any(isinstance(a, CancelScope) and a.run_id in "cd" for a in acts)
    assert not any(isinstance(a, CancelScope) and a.run_id == "e" and a.epoch == 2 for a in acts)
    assert core.hold("e", 2).phase is Phase.STARTING  # type: ignore[union-attr]
    assert core.hold("c", 1).phase is Phase.FINISHING  # type: ignore[union-attr]
    assert core.hold("d", 1).phase is Phase.RELEASING  # type: ignore[union-attr]
    # FINISHING / RELEASING are left out of the next batch
    assert {e.run_id for e in core.renew_batch(1.0).entries} == {"e"}
    assert core.end("c", "finish") == [Forget("c", 1)]


def test_guard_min_remaining() -> None:
    core = _core()
    core.on_granted([GrantRow("r", 1, 1)], t_send=0.0)
    core.end("r", "start")
    b = P.commit_budget_s
    assert core.check("r", 1, G - b - 0.01, b).run_id == "r"
    with pytest.raises(LeaseLost):
        core.check("r", 1, G - b, b)          # now + min_remaining == safe_until
    with pytest.raises(LeaseLost):
        core.check("r", 1, G + 1, 0.0)
    with pytest.raises(LeaseLost):
        core.check("r", 2, 0.0, 0.0)          # not my epoch
    assert core.check("r", 1, 0.0, 0.0).phase is Phase.ACTIVE  # check mutates nothing
    core.fence("r", 1, "fenced")
    with pytest.raises(LeaseLost) as info:
        core.check("r", 1, 0.0, 0.0)
    assert info.value.code == "LEASE_LOST" and info.value.mutation == "none"
    with pytest.raises(LeaseLost):
        core.begin("r", "commit")


# --------------------------------------------------------------------------------------------
# 40: cancel_scope runs steps 1–4 of §5.5 before any await (NodeRuntime on MemStore, ManualClock)


async def test_cancel_scope_before_first_await() -> None:
    import asyncio
    from collections.abc import Sequence
    from typing import Any

    from flyd.leases.clock import ManualClock
    from flyd.leases.runtime import GrantScope as Scope
    from flyd.leases.runtime import NodeRuntime
    from flyd.leases.stores.contract import Held, NodeInfo, Released, Renewed, Transient
    from flyd.leases.stores.mem import MemStore

    params = LeaseParams.short_ttl()
    clock = ManualClock(50.0)
    loop = asyncio.get_running_loop()
    ticks = 0                    # loop iterations seen by a self-rescheduling callback
    order: list[tuple[str, int]] = []
    releases: list[tuple[int, int, bool]] = []
    renew_down = False

    class Store(MemStore):
        async def renew(self, node_id: str, holds: Sequence[Held],
                        ttl_s: float) -> list[Renewed]:
            if renew_down:
                raise Transient("unreachable")
            return await super().renew(node_id, holds, ttl_s)

        async def release(self, run_id: int, lease_epoch: int, node_id: str, *, refund: bool,
                          backoff_s: float) -> Released | None:
            releases.append((run_id, lease_epoch, refund))
            return await super().release(run_id, lease_epoch, node_id, refund=refund,
                                         backoff_s=backoff_s)

    store = Store(clock.now)
    scopes: list[Scope] = []
    rt: NodeRuntime

    class Groups:
        def __init__(self) -> None:
            self.alive_runs = {1}

        def kill(self, run_id: int) -> None:
            hold = rt.core.hold(run_id, 1)
            assert hold is not None and hold.phase is Phase.LOST       # step 1 before 3
            assert not scopes[0]._task.cancelling()  # type: ignore[union-attr]  # 4 after 3
            order.append(("kill", ticks))
            self.alive_runs.discard(run_id)

        def alive(self, run_id: int) -> bool:
            return run_id in self.alive_runs

    class Executor:
        async def execute(self, scope: Scope) -> None:
            scopes.append(scope)

            def fenced(reason: str) -> None:
                hold = rt.core.hold(scope.run_id, scope.lease_epoch)
                assert hold is not None and hold.phase is Phase.LOST   # step 1 before 2
                order.append((f"fence:{reason}", ticks))

            scope.on_fence(fenced)
            await asyncio.Event().wait()

    class Events(list[dict[str, Any]]):
        def append(self, item: dict[str, Any]) -> None:
            if item["event"] == "lease_lost":
                order.append(("lease_lost", ticks))
            super().append(item)

    events = Events()
    groups = Groups()
    rt = NodeRuntime(params=params, store=store, clock=clock, executor=Executor(),
                     groups=groups, node=NodeInfo("a-00000000000a", "a", "h", 1, "t", 1),
                     seed=3, events=events)
    cancelled_at: list[int] = []

    def tick() -> None:
        nonlocal ticks
        task = scopes[0]._task if scopes else None
        if task is not None and task.cancelling() and not cancelled_at:
            cancelled_at.append(ticks)
        ticks += 1
        if not done:
            loop.call_soon(tick)

    done = False
    loop.call_soon(tick)
    run = (await store.submit("k40", {"name": "r"}, 3)).run_id

    async def advance_until(cond: Any, limit: float) -> None:
        while not cond():
            for _ in range(40):
                await asyncio.sleep(0)
            if cond():
                return
            nxt = clock.next_wakeup()
            assert nxt is not None and nxt <= limit
            clock.set(max(nxt, clock.now()))

    async with asyncio.TaskGroup() as tg:
        node = tg.create_task(rt.run())
        await advance_until(lambda: bool(scopes), 55.0)
        renew_down = True              # renewals stop: the watchdog self-fences at safe_until
        await advance_until(lambda: bool(releases), 60.0)
        rt.stop()
        await advance_until(node.done, 70.0)
        done = True
    # lease_lost (step 1 logged), fence callback (2), kill (3), task cancel (4): one loop step
    assert [name for name, _ in order] == ["lease_lost", "fence:safe_until", "kill"]
    assert len({t for _, t in order} | set(cancelled_at)) == 1, (order, cancelled_at)
    assert node.result() == 0
    assert releases == [(run, 1, False)]                  # relinquished once
    runs = store.dump()["runs"]
    assert runs[0]["state"] == "pending" and runs[0]["finished_at"] is None  # never terminal
    assert store.dump()["effects"] == []
    assert [e["event"] for e in events if e["event"] in ("lease_lost", "scope_cancelled")] == [
        "lease_lost", "scope_cancelled"]


# --------------------------------------------------------------------------------------------
# 41–51: the deterministic simulator (tests/distribution/sim), judged by tests/distribution/oracle
#
# Each scenario test sweeps a block of seeds of one scenario kind through the process pool;
# every seed must pass S1–S6 and L1–L4, and the block's facts show that the faults bit.


def _sim_sweep(live: Report, kind: str, seeds: range, variant_name: str = "real") -> Any:
    from tests.distribution.sim.sweep import sweep

    result = sweep(seeds, kind=kind, variant_name=variant_name, workers=2, progress=live)
    assert not result.failed, [(r.seed, r.failures, r.record_path) for r in result.failed]
    return result


def _records(kind: str, seeds: range) -> list[dict[str, Any]]:
    from tests.distribution.sim import run_seed

    return [run_seed(s, kind) for s in seeds]


def test_trace_deterministic() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.distribution.sim import digest, run_seed

    seed = 7
    first, second = digest(run_seed(seed)), digest(run_seed(seed))
    assert first == second
    assert digest(run_seed(seed + 1)) != first
    digests = set()
    for hashseed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        out = subprocess.run(
            [sys.executable, "-m", "tests.distribution.sim", "--seed", str(seed),
             "--digest-only"], capture_output=True, text=True, env=env, timeout=60, check=True,
            cwd=Path(__file__).resolve().parents[2])
        digests.add(out.stdout.strip())
    assert digests == {first}


def test_sim_partitions(live: Report) -> None:
    result = _sim_sweep(live, "partitions", range(1000, 1024))
    facts = result.fact_counts()
    assert facts["reclaim"] > 0 and facts["self_fence"] > 0
    modes = set()
    for rec in _records("partitions", range(1000, 1006)):
        for f in rec["log"]["faults"]:
            if f["kind"] == "link":
                modes.add((f["mode"], f["direction"]))
    assert {m for m, _ in modes} == {"hold", "drop"}
    assert {d for _, d in modes} & {"up", "down"}          # asymmetric partitions happened
    mixed = _sim_sweep(live, "mixed", range(0, 60))
    fenced = sum(r.facts.get("db_fenced", 0) for r in mixed.results)
    assert fenced > 0                                        # stale writes reached the fence


def test_sim_runs_keep_their_own_max_attempts(live: Report) -> None:
    """Runs submitted with a budget below the nodes' `[leases] max_attempts` are never granted
    beyond it (oracle S5, from the claim taps, samples and tables), and a node that loses such a
    run on its last attempt keeps it (no relinquish) for the reaper."""
    from tests.distribution.sim import scenario
    from tests.distribution.sim.world import PARAMS

    result = _sim_sweep(live, "partitions", range(1100, 1124))
    assert result.fact_counts()["own_budget_kept"] > 0, "no run lost on its own last attempt"
    budgets = {r.max_attempts for seed in range(1100, 1124)
               for r in scenario(seed, "partitions").runs}
    assert budgets == {1, 2, PARAMS.max_attempts}


def test_sim_latency_near_ttl(live: Report) -> None:
    result = _sim_sweep(live, "latency", range(2000, 2020))
    facts = result.fact_counts()
    assert facts["self_fence"] > 0                           # some holds fenced themselves
    renewed_late = 0
    for rec in _records("latency", range(2000, 2004)):
        delays = [(f["true"], f["true"] + f["dur"]) for f in rec["log"]["faults"]
                  if f["kind"] == "link" and f["mode"] == "delay"]
        for ev in rec["events"]:
            if ev["event"] == "renewed" and ev["runs"] and any(a <= ev["true"] <= b
                                                               for a, b in delays):
                renewed_late += 1
    assert renewed_late > 0                                  # renewals still succeeded, slowly


def test_sim_crash_and_pause(live: Report) -> None:
    result = _sim_sweep(live, "crash_pause", range(3000, 3024))
    facts = result.fact_counts()
    assert facts["reclaim"] > 0 and facts["fault_crash"] > 0 and facts["fault_pause"] > 0
    assert facts["lost_on_resume"] > 0                       # loss was the first act on resume
    late = 0
    for rec in _records("crash_pause", range(3000, 3012)):
        crashed = {n["node_id"]: n["end"][0] for n in rec["log"]["nodes"] if n["how"] == "crash"}
        late += sum(1 for t in rec["taps"] if t["node"] in crashed
                    and t["t"] > crashed[t["node"]])
    assert late > 0                                          # in-flight requests landed late


def test_sim_clock_skew_within_bound(live: Report) -> None:
    from tests.distribution.sim import scenario
    from tests.distribution.sim.world import PARAMS

    sc = scenario(4000, "skew")
    rho = PARAMS.clock_rate_bound
    assert sc.nodes[0].rate == 1 - 0.9 * rho and sc.nodes[1].rate == 1 + 0.9 * rho
    result = _sim_sweep(live, "skew", range(4000, 4020))
    facts = result.fact_counts()
    assert facts["reclaim"] > 0 and facts["self_fence"] > 0


def test_sim_cancel_exhaust_drain(live: Report) -> None:
    result = _sim_sweep(live, "cancel_exhaust_drain", range(5000, 5020))
    facts = result.fact_counts()
    assert facts["cancel_applied"] > 0
    assert facts["finished_cancelled"] > 0                   # cancel via the holder
    assert facts["reaped_cancelled"] > 0                     # cancel via reap
    assert facts["exhausted"] > 0 and facts["reaped_failed"] > 0
    assert facts["refunded_release"] > 0
    resumed_after_drain = 0
    exhausted_grants = []
    for rec in _records("cancel_exhaust_drain", range(5000, 5008)):
        atts = rec["tables"]["run_attempts"]
        runs = {r["run_id"]: r for r in rec["tables"]["runs"]}
        for a in atts:
            if a["end_reason"] == "exhausted":
                grants = sum(1 for b in atts if b["run_id"] == a["run_id"])
                exhausted_grants.append(grants == runs[a["run_id"]]["max_attempts"])
                assert runs[a["run_id"]]["state"] == "failed"
        refunded = {(e["run"], e["epoch"]) for e in rec["events"] if e["event"] == "released"
                    and e.get("refund") and e.get("result") == "released"}
        for run_id, epoch in refunded:
            later = [c for c in rec["taps"] if c["op"] == "claim"
                     and any(row[0] == run_id and row[1] == epoch + 1 for row in c["rows"])]
            heads = [e for e in rec["events"] if e["event"] == "write_result"
                     and e.get("run") == run_id and e.get("epoch") == epoch
                     and e.get("result") == "committed"]
            if later and heads:
                resumed_after_drain += 1
    assert exhausted_grants and all(exhausted_grants)  # each after its own max_attempts
    assert resumed_after_drain > 0


def test_sim_unknown_commit_outcomes(live: Report) -> None:
    result = _sim_sweep(live, "unknown_commit", range(6000, 6040))
    facts = result.fact_counts()
    assert facts["unknown_commit"] > 0
    assert facts["resolved_committed"] > 0
    assert facts["resolved_retry"] > 0
    assert facts["resolved_lost"] > 0


def test_sim_delayed_cancellation_safe(live: Report) -> None:
    result = _sim_sweep(live, "delayed_cancel", range(7000, 7024))
    late_refused = sum(r.facts.get("late_refused", 0) for r in result.results)
    late_through = sum(r.facts.get("late_through", 0) for r in result.results)
    assert late_refused > 0 and late_through == 0


@pytest.mark.serial
@pytest.mark.timeout(300)
def test_sim_sweep_1000_seeds_under_60s(live: Report) -> None:
    import os

    from tests.distribution.sim.sweep import NON_VACUITY, seed_count, summary, sweep

    n = seed_count()
    assert n >= 1000 or "FLYD_SIM_SEEDS" in os.environ
    result = sweep(range(n), workers=min(4, os.cpu_count() or 1), progress=live)
    live(f"[sim] {summary(result)}")
    assert not result.failed, [(r.seed, r.failures, r.record_path) for r in result.failed]
    assert not result.vacuity_problems(), result.vacuity_problems()
    assert set(NON_VACUITY) <= set(result.fact_counts())
    # distribution.md test 49: 1000 seeds in < 60 s (a larger FLYD_SIM_SEEDS scales the bound).
    # The test is `serial`: `make test` and `make faults` run it alone, after the parallel pass.
    bound = 60.0 * max(n, 1000) / 1000
    live(f"[sim] {n} seeds in {result.seconds:.1f} s, {n / result.seconds:.1f} seeds/s; bound "
          f"< {bound:.0f} s")
    assert result.seconds < bound, f"{n} seeds took {result.seconds:.1f} s, bound {bound:.0f} s"


def test_sim_canaries_detected(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                               live: Report) -> None:
    import json
    from pathlib import Path

    from tests.distribution.sim.canaries import CANARIES
    from tests.distribution.sim.sweep import sweep

    monkeypatch.setenv("FLYD_FAULT_ARTIFACTS", str(tmp_path))
    for name in CANARIES:
        result = sweep(range(200), variant_name=name, workers=2, stop_on_failure=True,
                       progress=live)
        assert result.failed, f"canary {name} survived 200 seeds: the oracle is blind"
        first = result.failed[0]
        assert first.record_path is not None
        assert Path(first.record_path).parent == tmp_path
        record = json.loads(Path(first.record_path).read_text())
        assert record["seed"] == first.seed and record["variant"] == name
        assert f"--seed {first.seed}" in record["rerun"] and name in record["rerun"]
        assert not record["verdicts"]["ok"]
        live(f"[sim] canary {name}: flagged at seed {first.seed} ({first.failures[0]})")


def test_sim_replay_from_env(live: Report) -> None:
    import os

    from tests.distribution.sim.sweep import replay, sweep

    seed = int(os.environ.get("FLYD_SIM_SEED", "17"))
    swept = sweep([seed], workers=1, progress=live).results[0]
    lines: list[str] = []

    def trace(line: str) -> None:
        lines.append(line)
        live(line)

    replayed = replay(seed, out=trace)
    out = "\n".join(lines)
    assert replayed.digest == swept.digest
    assert f"[sim] digest {swept.digest}" in out
    assert "\"event\": \"claimed\"" in out and "S1: ok" in out
    assert replayed.ok == swept.ok
