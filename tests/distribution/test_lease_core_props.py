"""Property tests: the §4.3 invariant and the lease core's decisions under virtual time.

Nothing sleeps: the node clock is a number the test advances.
"""

from __future__ import annotations

import dataclasses
import itertools
from fractions import Fraction

from hypothesis import example, given, settings
from hypothesis import strategies as st

from flyd.leases.core import (
    FINAL,
    CancelScope,
    Forget,
    GrantRow,
    LeaseCore,
    LeaseCoreError,
    LeaseLost,
    Relinquish,
    RenewRow,
    StartScope,
    StopForCancel,
)
from flyd.leases.core import LeasePhase as Phase
from flyd.leases.params import LeaseParams


def _dec(lo: int, hi: int, scale: int = 100) -> st.SearchStrategy[float]:
    return st.integers(lo, hi).map(lambda n: n / scale)


def _expected(p: LeaseParams) -> list[str]:
    """§4.3 restated independently, on exact decimals."""
    q = lambda x: Fraction(str(x))  # noqa: E731
    t, r, rho, eps = q(p.ttl_s), q(p.renew_timeout_s), q(p.clock_rate_bound), q(p.safety_margin_s)
    h = t / 5 if p.heartbeat_interval_s is None else q(p.heartbeat_interval_s)
    g = t * (1 - rho) - eps
    w, k = q(p.watchdog_tick_s), q(p.kill_bound_s)
    c, b = q(p.commit_timeout_s), q(p.commit_budget_s)
    s, i = q(p.statement_timeout_ms) / 1000, q(p.idle_in_transaction_timeout_ms) / 1000
    out = []
    if not (0 <= rho < Fraction(1, 2) and g > 0):
        out.append("§4.3.1")
    if not (r < h and 3 * h <= g):
        out.append("§4.3.2")
    if not eps >= w + k + 1:
        out.append("§4.3.3")
    if not (c >= s and b >= c + w):
        out.append("§4.3.4")
    if not s + i <= eps:
        out.append("§4.3.5")
    if not ((p.connect_timeout_s == 0 or p.connect_timeout_s <= r) and q(p.claim_poll_s) <= t / 5):
        out.append("§4.3.6")
    return out


params_st = st.builds(
    LeaseParams,
    ttl_s=_dec(100, 4000),
    heartbeat_interval_s=st.none() | _dec(10, 600),
    renew_timeout_s=_dec(10, 400),
    clock_rate_bound=_dec(-5, 60),
    safety_margin_s=_dec(50, 600),
    commit_timeout_s=_dec(10, 400),
    commit_budget_s=_dec(10, 600),
    watchdog_tick_s=_dec(5, 100),
    kill_bound_s=_dec(5, 200),
    claim_poll_s=_dec(10, 500),
    statement_timeout_ms=st.integers(100, 4000).map(float),
    idle_in_transaction_timeout_ms=st.integers(100, 4000).map(float),
    connect_timeout_s=st.sampled_from([0, 2, 3, 5]),
)


@settings(max_examples=2000, deadline=None)
@given(params_st)
def test_invariant_matches_spec_and_implies_safety(p: LeaseParams) -> None:
    got = [e.clause for e in p.violations()]
    assert got == _expected(p)
    if got:
        return
    p.validate()
    tol = 1e-9
    # three separately bounded renewals, each starting H apart, end before give-up
    assert 2 * p.H + p.R < p.G + tol and 3 * p.H <= p.G + tol
    # a transaction started at the last permitted instant ends (client side) before safe_until
    assert p.commit_timeout_s + p.watchdog_tick_s <= p.commit_budget_s + tol
    # the node's safe_until lies at least ε before the server's earliest expiry, even when the
    # node clock runs fast by ρ: G·(1+ρ)… is bounded by T·(1−ρ)(1+ρ) − ε < T − ε
    assert p.G * (1 + max(p.clock_rate_bound, 0)) <= p.T - p.safety_margin_s + tol
    assert p.watchdog_tick_s + p.kill_bound_s + 1 <= p.safety_margin_s + tol


def test_invariant_exhaustive_grid() -> None:
    base = LeaseParams()
    grid = {
        "renew_timeout_s": [1.0, 2.0, 3.0],
        "heartbeat_interval_s": [None, 2.5, 3.4],
        "safety_margin_s": [1.5, 3.5, 4.0],
        "commit_timeout_s": [1.5, 2.0],
        "commit_budget_s": [2.2, 3.0],
        "kill_bound_s": [0.5, 2.5],
        "claim_poll_s": [1.0, 3.5],
    }
    keys = list(grid)
    n = 0
    for values in itertools.product(*(grid[k] for k in keys)):
        p = dataclasses.replace(base, **dict(zip(keys, values, strict=True)))  # type: ignore[arg-type]
        assert [e.clause for e in p.violations()] == _expected(p)
        n += 1
    assert n == 3 * 3 * 3 * 2 * 2 * 2 * 2


# --------------------------------------------------------------------------------------------
# Core under virtual time

RUNS = ("a", "b", "c")
STATS: dict[str, int] = {}
op_st = st.one_of(
    st.tuples(st.just("advance"), _dec(0, 600)),
    st.tuples(st.just("grant"), st.sampled_from(RUNS), st.booleans()),
    st.tuples(st.just("renew"), st.lists(st.sampled_from(RUNS), unique=True),
              _dec(0, 300), st.booleans()),
    st.tuples(st.just("renew_unknown"), _dec(0, 300)),
    st.tuples(st.just("watchdog")),
    st.tuples(st.just("begin"), st.sampled_from(RUNS),
              st.sampled_from(["commit", "finish", "release"])),
    st.tuples(st.just("end"), st.sampled_from(RUNS),
              st.sampled_from(["start", "commit", "finish", "release"]),
              st.sampled_from(["committed", "failed", "lost"])),
    st.tuples(st.just("gone"), st.sampled_from(RUNS)),
    st.tuples(st.just("check"), st.sampled_from(RUNS), _dec(0, 150)),
)


@settings(max_examples=600, deadline=None)
@given(st.sampled_from([LeaseParams(), LeaseParams.short_ttl()]), st.lists(op_st, max_size=60))
# A self-fence whose scope is gone (cancel, relinquish), a grant flagged for cancellation
# (stop) and a passing guard: every kind of decision is made in every run, not only when the
# draws reach it.
@example(LeaseParams.short_ttl(), [("grant", RUNS[0], False), ("advance", 5.0), ("watchdog",),
                                   ("gone", RUNS[0]), ("grant", RUNS[1], True),
                                   ("grant", RUNS[2], False), ("check", RUNS[2], 0.5)])
def test_core_decisions_under_virtual_time(p: LeaseParams, ops: list[tuple[object, ...]]) -> None:
    core = LeaseCore(p, "n-000000000000", capacity=3)
    now = 0.0
    epoch = dict.fromkeys(RUNS, 0)
    # the server's view: expiry (server = node clock here; latency only delays it)
    server_expiry: dict[tuple[str, int], float] = {}
    acked: dict[tuple[str, int], float] = {}       # latest acknowledged t_send per grant
    cancels: dict[tuple[str, int], int] = {}
    relinquished: dict[tuple[str, int], int] = {}
    stops: dict[tuple[str, int], int] = {}
    passed = 0

    def record(acts: list[object]) -> None:
        for a in acts:
            if isinstance(a, CancelScope):
                cancels[(a.run_id, a.epoch)] = cancels.get((a.run_id, a.epoch), 0) + 1
            elif isinstance(a, Relinquish):
                key = (a.run_id, a.epoch)
                relinquished[key] = relinquished.get(key, 0) + 1
            elif isinstance(a, StopForCancel):
                stops[(a.run_id, a.epoch)] = stops.get((a.run_id, a.epoch), 0) + 1
            else:
                assert isinstance(a, StartScope | Forget)

    for op in ops:
        before = {(h.run_id, h.epoch): h for h in core.holds}
        kind = op[0]
        try:
            if kind == "advance":
                now += float(op[1])  # type: ignore[arg-type]
            elif kind == "grant":
                run, flag = str(op[1]), bool(op[2])
                if server_expiry.get((run, epoch[run]), 0) > now:
                    continue  # the server would not grant a live lease
                epoch[run] += 1
                key = (run, epoch[run])
                t_send = now
                server_expiry[key] = t_send + p.T
                acked[key] = t_send
                record(core.on_granted([GrantRow(run, epoch[run], epoch[run], flag)], t_send))
            elif kind in ("renew", "renew_unknown"):
                batch = core.renew_batch(now)
                t_send = now
                latency = float(op[2] if kind == "renew" else op[1])  # type: ignore[arg-type]
                if kind == "renew_unknown":
                    record(core.on_renew_unknown(batch))
                else:
                    live_only = bool(op[3])
                    rows = []
                    for e in batch.entries:
                        key = (e.run_id, e.epoch)
                        exec_at = t_send + latency / 2
                        live = server_expiry.get(key, 0) > exec_at and epoch[e.run_id] == e.epoch
                        if live and (e.run_id in op[1] or live_only):  # type: ignore[operator]
                            server_expiry[key] = exec_at + p.T
                            rows.append(RenewRow(e.run_id, e.epoch))
                    now += latency
                    for r in rows:
                        if before[(r.run_id, r.epoch)].phase in FINAL:
                            continue
                        acked[(r.run_id, r.epoch)] = max(acked[(r.run_id, r.epoch)], t_send)
                    record(core.on_renewed(batch, rows, t_send))
                    returned = {(r.run_id, r.epoch) for r in rows}
                    for e in batch.entries:
                        h_now = core.hold(e.run_id, e.epoch)
                        if (e.run_id, e.epoch) not in returned and h_now is not None:
                            assert h_now.phase is Phase.LOST  # a missing row is a loss
            elif kind == "watchdog":
                record(core.expire_due(now))
                assert all(h.safe_until > now for h in core.holds if h.phase not in FINAL)
            elif kind == "begin":
                core.begin(str(op[1]), op[2])  # type: ignore[arg-type]
            elif kind == "end":
                record(core.end(str(op[1]), op[2], op[3]))  # type: ignore[arg-type]
            elif kind == "gone":
                for h in [h for h in core.holds if h.run_id == op[1]]:
                    record(core.scope_gone(h.run_id, h.epoch))
                    record(core.scope_gone(h.run_id, h.epoch))
            elif kind == "check":
                m = float(op[2])  # type: ignore[arg-type]
                for h in [h for h in core.holds if h.run_id == op[1]]:
                    try:
                        core.check(h.run_id, h.epoch, now, m)
                    except LeaseLost:
                        assert h.phase in FINAL or now + m >= h.safe_until
                    else:
                        passed += 1
                        # SAFETY: a permitted write lands ε before the server can expire it
                        assert h.phase not in FINAL
                        assert now + m + p.safety_margin_s <= server_expiry[(h.run_id, h.epoch)]
        except (LeaseCoreError, LeaseLost):
            pass
        # after every step
        for key, h in ((( h.run_id, h.epoch), h) for h in core.holds):
            old = before.get(key)
            if old is not None:
                assert h.safe_until >= old.safe_until            # never shortened
                if old.phase is Phase.LOST:
                    assert h == old                          # a lost hold never changes
            assert h.safe_until == acked[key] + p.G          # extended only by acknowledgements
            assert (h.phase is Phase.LOST) == (h.lost_reason is not None)
        live = [h.safe_until for h in core.holds if h.phase not in FINAL]
        assert core.next_deadline() == (min(live) if live else None)
        assert all(n == 1 for n in cancels.values())
        assert all(n == 1 for n in relinquished.values())
        assert all(n == 1 for n in stops.values())
        assert all(k in cancels for k in relinquished)
        assert core.free_capacity(now) in (0, 3 - len(core.holds))
        for k, v in (("cancel", len(cancels)), ("relinquish", len(relinquished)),
                     ("stop", len(stops)), ("holds", len(core.holds))):
            STATS[k] = STATS.get(k, 0) + v
    STATS["passed_checks"] = STATS.get("passed_checks", 0) + passed



def test_core_property_was_not_vacuous() -> None:
    """Runs after the property above (file order): every kind of decision was exercised."""
    if not STATS:  # run alone
        test_core_decisions_under_virtual_time()
    assert all(STATS.get(k, 0) > 0 for k in ("cancel", "relinquish", "stop", "holds",
                                              "passed_checks")), STATS
