"""The fault-suite oracle (distribution.md §7.3.6), shared by tier 1 and tier 2.

Input: one history record (a JSON-able dict):
- `tables`: `runs`, `run_attempts`, `checkpoints`, `run_heads`, `effects`, `interventions`
  (instants as store seconds or ISO timestamps);
- `events`: node events (`event`, local `t`, `node`, `run`, `epoch`, ...; under test `true`,
  the sim time, else `t` is used), in the order each node emitted them;
- `taps` (optional): what the store or proxy saw, `{t, node, op, ok, code, run, epoch, rows}`;
- `log`: the harness log: `spawned`, `faults`, `nodes` (lifetimes and pauses), `kills`,
  `samples`, `final_heal`, `operator`, `orphans`, `reference` digests, `l1_bound_s`;
- `params`: the lease parameters (T, G, W = `watchdog_tick_s`, K = `kill_bound_s`, ...).
Store instants (tables, taps, samples, `final_heal`) and the events' `true` times must share one
timeline (sim seconds); numbers are taken as they are, timestamps as POSIX seconds.

Rules:
- `judge(record, vacuity)` returns every check S1–S6, L1–L4 as a `Verdict` (ok + evidence,
  at most `MAX_EVIDENCE` lines each), the facts counted on the history, and one verdict per
  requested vacuity fact ("fault did not bite: <fact>" when it is zero).
- The oracle never trusts a node's claim about the store: the store side (tables, taps) decides
  what committed; node events decide what each node did and when.
- Decisions where the spec is silent: a local hold ends at `lease_lost`, `finished`, the first
  `write_begin` of its release (the node sends nothing more for the grant after it), a
  `released` of kind `forget` (a scope that ended on the run's last attempt, its workers dead:
  the node drops the grant without a write and leaves the lease to expire), the node's
  end (crash, stop), or at a pause if its first event of §7.3.6's list (`GRANT_EVENTS`) after
  the pause is the loss. safe_until is
  bounded above by `claimed.t + G` (the claim's send time precedes its event) and extended by
  each `renewed` event processed no later than the current bound. M6 (an expired lease is never
  renewed) is judged under S1 from the taps: a renewal answered with a row whose last known expiry
  had passed at the store.
- S6's K (confirming a lost hold's workers dead) is a physical bound: it is extended by the loop
  lag the node measured itself (`loop_lag` events) between the loss and the scope's end, as a
  pause extends safe_until + W. A node whose loop ran on time gets no extension.
- S5 also checks each run's own grant budget (distribution.md §1.2 T2/T3, `runs.max_attempts`,
  which may be below `[leases] max_attempts`): no claim tap grants an `attempt` (a row's fourth
  field, when the tap records it) beyond it, and neither the final `runs` row nor any sample
  shows `attempt > max_attempts`.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

MAX_EVIDENCE: Final = 12
EPS: Final = 1e-6
FINISH_KINDS: Final = frozenset({"commit", "finish"})
GRANT_EVENTS: Final = frozenset({"claimed", "lease_lost", "scope_cancelled", "write_begin",
                                 "write_result", "resolved", "released", "finished"})
AFTER_LOSS_OK: Final = frozenset({"scope_cancelled", "scope_stuck"})
TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})


@dataclass
class Verdict:
    check: str
    ok: bool = True
    evidence: list[str] = field(default_factory=list)

    def fail(self, line: str) -> None:
        self.ok = False
        if len(self.evidence) < MAX_EVIDENCE:
            self.evidence.append(line)

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "ok": self.ok, "evidence": list(self.evidence)}


@dataclass
class Judgement:
    verdicts: list[Verdict]
    facts: dict[str, int]

    @property
    def ok(self) -> bool:
        return all(v.ok for v in self.verdicts)

    def failures(self) -> list[Verdict]:
        return [v for v in self.verdicts if not v.ok]

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "verdicts": [v.as_dict() for v in self.verdicts],
                "facts": dict(self.facts)}


def _sec(v: Any) -> float | None:
    """Store instants as seconds: numbers as they are, timestamps as POSIX seconds."""
    if v is None:
        return None
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, datetime):
        return v.timestamp()
    return datetime.fromisoformat(str(v)).timestamp()


@dataclass
class Hold:
    node: str
    run: int
    epoch: int
    start_t: float
    start_true: float
    end_true: float | None = None
    lost: Mapping[str, Any] | None = None


class History:
    """The record, indexed for the checks."""

    def __init__(self, record: Mapping[str, Any]) -> None:
        self.record = record
        self.params: Mapping[str, Any] = record.get("params", {})
        self.log: Mapping[str, Any] = record.get("log", {})
        tables = record.get("tables", {})
        self.runs = {r["run_id"]: _times(r) for r in tables.get("runs", [])}
        self.attempts: dict[int, dict[int, dict[str, Any]]] = defaultdict(dict)
        for a in tables.get("run_attempts", []):
            self.attempts[a["run_id"]][a["lease_epoch"]] = _times(a)
        self.effects = [_times(e) for e in tables.get("effects", [])]
        self.checkpoints = [_times(c) for c in tables.get("checkpoints", [])]
        self.heads = {h["run_id"]: h for h in tables.get("run_heads", [])}
        self.interventions = list(tables.get("interventions", []))
        self.events: list[Mapping[str, Any]] = list(record.get("events", []))
        self.taps: list[Mapping[str, Any]] = list(record.get("taps", []) or [])
        self.by_node: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
        for ev in self.events:
            self.by_node[ev["node"]].append(ev)
        self.nodes = {n["node_id"]: n for n in self.log.get("nodes", [])}
        self.T = float(self.params.get("T", self.params.get("ttl_s", 15.0)))
        self.G = float(self.params["G"])
        self.W = float(self.params.get("watchdog_tick_s", 0.25))
        self.K = float(self.params.get("kill_bound_s", 0.5))
        self.B = float(self.params.get("commit_budget_s", 3.0))
        self.P = float(self.params.get("claim_poll_s", 1.0))
        self.reap = float(self.params.get("reap_interval_s", 5.0))
        self.slack = float(self.log.get("slack_s", 0.0))
        self.holds = self._holds()

    def node_end(self, node: str) -> tuple[float, float] | None:
        n = self.nodes.get(node)
        if n is None or n.get("end") is None:
            return None
        return float(n["end"][0]), float(n["end"][1])

    def lag(self, node: str, t0: float, t1: float) -> float:
        """How long the node's event loop measured itself late (`loop_lag`) within [t0, t1],
        local time: while its loop was off the CPU the node could do nothing."""
        total = 0.0
        for ev in self.by_node.get(node, ()):
            if ev["event"] == "loop_lag":
                end = float(ev["t"])
                total += max(0.0, min(end, t1) - max(end - float(ev.get("lag_s", 0.0)), t0))
        return total

    def pauses(self, node: str) -> list[tuple[float, float, float, float]]:
        n = self.nodes.get(node)
        out = []
        for p in (n or {}).get("pauses", []):
            if p[1] is not None:
                out.append((float(p[0]), float(p[1]), float(p[2]), float(p[3])))
        return out

    def _holds(self) -> list[Hold]:
        out: list[Hold] = []
        for node, evs in sorted(self.by_node.items()):
            open_: dict[tuple[int, int], Hold] = {}
            pauses = self.pauses(node)
            for ev in evs:
                key = (ev.get("run"), ev.get("epoch"))
                name = ev["event"]
                if name == "claimed":
                    h = Hold(node, ev["run"], ev["epoch"], float(ev["t"]), _true(ev))
                    open_[(h.run, h.epoch)] = h
                    out.append(h)
                    continue
                h2 = open_.get(key)  # type: ignore[arg-type]
                if h2 is None:
                    continue
                ends = (name in ("lease_lost", "finished")
                        or (name == "released" and ev.get("result") == "released")
                        or (name == "released" and ev.get("kind") == "forget")
                        or (name == "write_begin" and ev.get("kind") == "release"))
                if not ends:
                    continue
                h2.end_true = _true(ev)
                if name == "lease_lost":
                    h2.lost = ev
                    for p0, p1, _, _ in pauses:
                        if h2.start_true < p0 and p1 <= _true(ev) and self._first_after(
                                evs, key, p1) is ev:
                            h2.end_true = p0
                del open_[key]  # type: ignore[arg-type]
            end = self.node_end(node)
            for h in open_.values():
                h.end_true = end[0] if end is not None else float(self.log.get("end", 1e18))
        return out

    @staticmethod
    def _first_after(evs: Sequence[Mapping[str, Any]], key: tuple[Any, Any],
                     t: float) -> Mapping[str, Any] | None:
        for ev in evs:
            if (_true(ev) >= t and ev["event"] in GRANT_EVENTS
                    and (ev.get("run"), ev.get("epoch")) == key):
                return ev
        return None


def _true(ev: Mapping[str, Any]) -> float:
    return float(ev.get("true", ev["t"]))


def _times(row: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(row)
    for k in ("lease_expires_at", "submitted_at", "finished_at", "granted_at", "ended_at",
              "committed_at", "recorded_at"):
        if k in out:
            out[k] = _sec(out[k])
    return out


# ------------------------------------------------------------------------------------------
# safety


def s1(h: History) -> Verdict:
    v = Verdict("S1")
    for run_id, atts in sorted(h.attempts.items()):
        epochs = sorted(atts)
        if epochs != list(range(1, len(epochs) + 1)):
            v.fail(f"run {run_id}: grant epochs {epochs} are not 1..k")
        for e in epochs[1:]:
            prev_end = atts[e - 1].get("ended_at") if e - 1 in atts else None
            if prev_end is None or atts[e]["granted_at"] < prev_end - EPS:
                v.fail(f"run {run_id}: grant {e} at {atts[e]['granted_at']} before grant "
                       f"{e - 1} ended ({prev_end})")
        r = h.runs.get(run_id)
        if r is not None and epochs:
            k = epochs[-1]
            reaped = atts[k].get("end_reason") in ("exhausted", "cancelled")
            if r["lease_epoch"] != k + (1 if reaped else 0):
                v.fail(f"run {run_id}: lease_epoch {r['lease_epoch']} vs last grant {k}")
    by_run: dict[int, list[Hold]] = defaultdict(list)
    for hold in h.holds:
        by_run[hold.run].append(hold)
    for run_id, holds in sorted(by_run.items()):
        holds.sort(key=lambda x: (x.start_true, x.epoch))
        for i, a in enumerate(holds):
            for b in holds[i + 1:]:
                if b.epoch == a.epoch:
                    continue
                a_end = a.end_true if a.end_true is not None else 1e18
                if b.start_true < a_end - EPS:
                    v.fail(f"run {run_id}: hold {a.epoch}@{a.node} [{a.start_true:.3f}, "
                           f"{a_end:.3f}] overlaps hold {b.epoch}@{b.node} from "
                           f"{b.start_true:.3f} (true time)")
    expiry: dict[tuple[int, int], float] = {}
    for tap in h.taps:
        op = tap.get("op")
        if op not in ("claim", "renew") or not tap.get("ok", True):
            continue
        for row in tap.get("rows", []):
            run_id, epoch, exp = int(row[0]), int(row[1]), float(row[2])
            known = expiry.get((run_id, epoch))
            if op == "renew" and known is not None and known <= float(tap["t"]) + EPS:
                v.fail(f"M6: run {run_id} epoch {epoch} renewed at {tap['t']:.3f} by "
                       f"{tap.get('node')} after its lease expired at {known:.3f}")
            expiry[(run_id, epoch)] = exp
    return v


def s2(h: History) -> Verdict:
    v = Verdict("S2")

    def window(run_id: int, epoch: int) -> tuple[float, float] | None:
        a = h.attempts.get(run_id, {}).get(epoch)
        if a is None:
            return None
        end = a.get("ended_at")
        return a["granted_at"], end if end is not None else 1e18

    for kind, rows, col in (("effect", h.effects, "recorded_at"),
                            ("checkpoint", h.checkpoints, "committed_at")):
        for row in rows:
            w = window(row["run_id"], row["lease_epoch"])
            at = row.get(col)
            name = row.get("effect_key") or row.get("checkpoint_id")
            if w is None:
                v.fail(f"{kind} {row['run_id']}/{name} tagged epoch {row['lease_epoch']} "
                       f"without a grant")
            elif at is not None and not (w[0] - EPS <= at <= w[1] + EPS):
                v.fail(f"{kind} {row['run_id']}/{name} of epoch {row['lease_epoch']} recorded "
                       f"at {at:.3f} outside its grant [{w[0]:.3f}, {w[1]:.3f}]")
    for run_id, head in sorted(h.heads.items()):
        e = head.get("lease_epoch", 0)
        if e and window(run_id, e) is None:
            v.fail(f"head of run {run_id} tagged epoch {e} without a grant")
    for tap in h.taps:
        if tap.get("op") != "commit" or not tap.get("ok"):
            continue
        run_id, epoch, t = tap["run"], tap["epoch"], float(tap["t"])
        w = window(run_id, epoch)
        nxt = h.attempts.get(run_id, {}).get(epoch + 1)
        if w is None:
            v.fail(f"COMMIT of run {run_id} epoch {epoch} at {t:.3f} without a grant")
        elif nxt is not None and t > nxt["granted_at"] + EPS:
            v.fail(f"COMMIT of run {run_id} epoch {epoch} at {t:.3f} after grant {epoch + 1} "
                   f"at {nxt['granted_at']:.3f}")
        elif t > w[1] + EPS and not (tap.get("final") and h.attempts[run_id][epoch].get(
                "end_reason") == "finished"):
            v.fail(f"COMMIT of run {run_id} epoch {epoch} at {t:.3f} after the grant ended "
                   f"at {w[1]:.3f}")
    return v


def _finished_by_holder(h: History, run_id: int) -> bool:
    atts = h.attempts.get(run_id, {})
    if not atts:
        return False
    return atts[max(atts)].get("end_reason") == "finished"


def s3(h: History) -> Verdict:
    v = Verdict("S3")
    ref: Mapping[str, Mapping[str, str]] = h.log.get("reference", {})
    imported: Mapping[str, int] = h.log.get("imported", {})
    keys: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in h.effects:
        keys[row["run_id"]].append(row)
    for run_id in sorted(set(keys) | set(h.runs)):
        rows = keys.get(run_id, [])
        r = h.runs.get(run_id)
        if rows and not h.attempts.get(run_id):
            v.fail(f"run {run_id} has effects but was never granted")
        b0 = int(imported.get(str(run_id), 0))
        nums = sorted(int(e["effect_key"].split("-", 1)[1]) for e in rows
                      if e["effect_key"].startswith("boundary-"))
        head_b = int(h.heads.get(run_id, {}).get("boundary", 0))
        terminal = r is not None and r["state"] in TERMINAL
        top = nums[-1] if nums else b0
        if nums != list(range(b0 + 1, top + 1)) or top < head_b or (
                not terminal and top != head_b):
            v.fail(f"run {run_id}: boundary keys {_span(nums)} vs head {head_b} "
                   f"(terminal={terminal})")
        finishes = [e for e in rows if e["effect_key"] == "finish"]
        want = 1 if terminal and _finished_by_holder(h, run_id) else 0
        if len(finishes) != want:
            v.fail(f"run {run_id}: {len(finishes)} finish effects, expected {want}")
        digests = ref.get(str(run_id))
        if digests is not None:
            for e in rows:
                want_d = digests.get(e["effect_key"])
                got = e.get("payload_digest")
                if want_d is not None and got != want_d:
                    v.fail(f"run {run_id}: {e['effect_key']} digest {str(got)[:12]} != "
                           f"reference {want_d[:12]}")
    for ev in h.events:
        if (ev["event"] == "write_result" and ev.get("result") == "23505") or (
                ev["event"] == "run_failed"
                and ev.get("error") in ("effect_duplicate", "effect_conflict")):
            v.fail(f"23505 on effects_pkey: {ev['event']} {ev.get('node')} run "
                   f"{ev.get('run')}@{ev.get('epoch')} ({ev.get('error') or ev.get('result')})")
    for tap in h.taps:
        if tap.get("code") == "23505":
            v.fail(f"23505 seen by the tap: {tap.get('op')} run {tap.get('run')}@"
                   f"{tap.get('epoch')} from {tap.get('node')}")
    return v


def _span(nums: Sequence[int]) -> str:
    if not nums:
        return "[]"
    gaps = [n for a, n in itertools.pairwise(nums) if n != a + 1]
    return f"[{nums[0]}..{nums[-1]}]" + (f" gaps before {gaps[:5]}" if gaps else "")


def s4(h: History) -> Verdict:
    v = Verdict("S4")
    for kind, rows, col in (("effect", h.effects, "recorded_at"),
                            ("checkpoint", h.checkpoints, "committed_at")):
        for row in rows:
            r = h.runs.get(row["run_id"])
            fin = r.get("finished_at") if r is not None else None
            at = row.get(col)
            if fin is not None and at is not None and at > fin + EPS:
                v.fail(f"{kind} of run {row['run_id']} recorded at {at:.3f} after it finished "
                       f"at {fin:.3f}")
    seen: dict[int, str] = {}
    for sample in h.log.get("samples", []):
        for row in sample.get("runs", []):
            run_id, state = row[0], row[1]
            if run_id in seen and state != seen[run_id]:
                v.fail(f"run {run_id} left terminal {seen[run_id]} for {state} at "
                       f"{sample['true']:.3f}")
            if state in TERMINAL:
                seen[run_id] = state
    for ev in h.events:
        if ev.get("result") == "LF003" or ev.get("code") == "LF003":
            v.fail(f"LF003 at node {ev['node']}: {ev['event']} run {ev.get('run')}")
    for tap in h.taps:
        if tap.get("code") == "LF003":
            v.fail(f"LF003 seen by the tap: {tap.get('op')} run {tap.get('run')}")
    return v


def s5(h: History) -> Verdict:
    v = Verdict("S5")
    fin_effects = {e["run_id"]: e for e in h.effects if e["effect_key"] == "finish"}
    for run_id, r in sorted(h.runs.items()):
        if r["state"] not in TERMINAL:
            continue
        atts = h.attempts.get(run_id, {})
        if not atts:
            continue
        last = max(atts)
        reason = atts[last].get("end_reason")
        if reason == "finished":
            fe = fin_effects.get(run_id)
            if r["lease_epoch"] != last or fe is None or fe["lease_epoch"] != last:
                v.fail(f"run {run_id}: finished at epoch {r['lease_epoch']}, last grant "
                       f"{last}, finish effect epoch {fe['lease_epoch'] if fe else None}")
            elif fe.get("payload", {}).get("state") not in (None, r["state"]):
                v.fail(f"run {run_id}: finish effect says {fe['payload'].get('state')}, run "
                       f"is {r['state']}")
        elif reason in ("exhausted", "cancelled"):
            want = "failed" if reason == "exhausted" else "cancelled"
            if r["lease_epoch"] != last + 1 or r["state"] != want:
                v.fail(f"run {run_id}: reaped ({reason}) at epoch {r['lease_epoch']} "
                       f"state {r['state']}; last grant {last}")
        elif r["state"] != "cancelled" or r["lease_epoch"] != last:
            v.fail(f"run {run_id}: terminal {r['state']} at epoch {r['lease_epoch']} but "
                   f"grant {last} ended {reason}")
    _within_budget(h, v)
    return v


def _within_budget(h: History, v: Verdict) -> None:
    """No grant beyond the run's own max_attempts (store side: claim taps, samples, tables)."""
    budget = {run_id: int(r["max_attempts"]) for run_id, r in h.runs.items()
              if r.get("max_attempts") is not None}

    def check(run_id: int, attempt: int, where: str) -> None:
        limit = budget.get(run_id)
        if limit is not None and attempt > limit:
            v.fail(f"run {run_id}: attempt {attempt} beyond its max_attempts {limit} ({where})")

    for tap in h.taps:
        if tap.get("op") == "claim" and tap.get("ok"):
            for row in tap.get("rows") or []:
                if len(row) > 3:
                    check(row[0], int(row[3]), f"granted at {tap.get('t')}")
    for sample in h.log.get("samples", []):
        for row in sample.get("runs", []):
            if len(row) > 3:
                check(row[0], int(row[3]), f"sampled at {sample.get('true')}")
    for run_id, r in h.runs.items():
        check(run_id, int(r.get("attempt", 0)), "final row")


def s6(h: History) -> Verdict:
    v = Verdict("S6")
    renewals: dict[tuple[str, int, int], list[tuple[float, float]]] = defaultdict(list)
    for ev in h.events:
        if ev["event"] == "renewed":
            for run_id, epoch in ev.get("runs", []):
                renewals[(ev["node"], run_id, epoch)].append((float(ev["t"]),
                                                              float(ev["t_send"])))
    kills: dict[tuple[str, int], list[float]] = defaultdict(list)
    for k in h.log.get("kills", []):
        kills[(k["node"], k["run"])].append(float(k["true"]))
    for hold in h.holds:
        node, run_id, epoch = hold.node, hold.run, hold.epoch
        evs = [e for e in h.by_node[node] if e.get("run") == run_id and e.get("epoch") == epoch]
        su = hold.start_t + h.G
        ends = [e for e in evs if e["event"] in ("lease_lost", "finished")
                or (e["event"] == "released" and (e.get("result") == "released"
                                                  or e.get("kind") == "forget"))]
        end_ev = ends[0] if ends else None
        for t, t_send in renewals.get((node, run_id, epoch), []):
            if end_ev is not None and t > float(end_ev["t"]):
                break
            if t <= su + EPS:
                su = max(su, t_send + h.G)
        lost = hold.lost
        for e in evs:
            if e["event"] != "write_begin":
                continue
            if lost is not None and _true(e) > _true(lost):
                v.fail(f"{node} write_begin {e.get('kind')} for {run_id}@{epoch} after "
                       f"lease_lost")
                continue
            need = 0.0 if e.get("kind") == "release" else h.B
            if float(e["t"]) + need >= su + EPS:
                v.fail(f"{node} write_begin {e.get('kind')} for {run_id}@{epoch} at "
                       f"{e['t']:.3f} with safe_until ≤ {su:.3f} (needs {need})")
        deadline = su + h.W + h.slack
        for _, _, p0, p1 in h.pauses(node):
            if p0 < deadline and p1 > su:
                deadline = max(deadline, p1 + h.W + h.slack)
        end = h.node_end(node)
        end_local = end[1] if end is not None else float("inf")
        if end_ev is not None:
            if float(end_ev["t"]) > deadline + EPS and float(end_ev["t"]) <= end_local:
                v.fail(f"{node} hold {run_id}@{epoch}: {end_ev['event']} at "
                       f"{end_ev['t']:.3f}, safe_until {su:.3f} + W passed unfenced")
        elif end_local > deadline + EPS:
            v.fail(f"{node} hold {run_id}@{epoch} still open at its end {end_local:.3f}, "
                   f"safe_until {su:.3f} + W passed")
        if lost is None:
            continue
        t_lost = float(lost["t"])
        after = [e for e in evs if e["seq"] > lost["seq"]] if "seq" in lost else [
            e for e in evs if _true(e) > _true(lost)]
        cancelled = [e for e in after if e["event"] == "scope_cancelled"]
        t_cancelled = float(cancelled[0]["t"]) if cancelled else float("inf")
        lag = h.lag(node, t_lost, min(t_cancelled, end_local))
        within = t_lost + h.K + h.slack + lag + EPS
        if end_local > within and t_cancelled > within:
            v.fail(f"{node} {run_id}@{epoch}: lease_lost at {t_lost:.3f} without "
                   f"scope_cancelled within K (+ {lag:.3f} s measured loop lag)")
        for e in after:
            ok = e["event"] in AFTER_LOSS_OK or (
                e["event"] in ("released", "write_result") and e.get("kind") == "relinquish")
            if not ok:
                v.fail(f"{node} {run_id}@{epoch}: {e['event']} ({e.get('kind')}) after "
                       f"lease_lost")
        for k_true in kills.get((node, run_id), []):
            if _true(lost) + h.K + EPS < k_true <= _true(lost) + h.K + 1.0:
                v.fail(f"{node} run {run_id}: process groups killed at {k_true:.3f}, later "
                       f"than K after lease_lost")
    return v


# ------------------------------------------------------------------------------------------
# liveness


def l1(h: History) -> Verdict:
    v = Verdict("L1")
    spawned = set(h.log.get("spawned", []))
    present = set(h.runs)
    if present - spawned:
        v.fail(f"unexpected runs {sorted(present - spawned)}")
    for run_id in sorted(spawned):
        r = h.runs.get(run_id)
        if r is None or r["state"] not in TERMINAL:
            v.fail(f"run {run_id} is {None if r is None else r['state']} at the end")
    heal = h.log.get("final_heal")
    bound = h.log.get("l1_bound_s")
    if heal is not None and bound is not None:
        for run_id, r in sorted(h.runs.items()):
            fin = r.get("finished_at")
            if fin is not None and fin > float(heal) + float(bound) + EPS:
                v.fail(f"run {run_id} finished at {fin:.3f}, beyond heal {heal:.3f} + "
                       f"{bound:.3f}")
    return v


def l2(h: History) -> Verdict:
    v = Verdict("L2")
    heal = h.log.get("final_heal")
    if heal is None:
        return v
    limit = h.reap + 2 * h.P
    free_since: float | None = None
    for sample in h.log.get("samples", []):
        t = float(sample["true"])
        if t < float(heal) or not any(n[1] > 0 for n in sample.get("free", [])):
            free_since = None
            continue
        if free_since is None:
            free_since = t
        for run_id, state, expires, *_ in sample.get("runs", []):
            exp = _sec(expires)
            # an expired lease is overdue from the latest of its expiry, the final heal and
            # the first sample of the current stretch with free capacity: before the heal no
            # node may have been able to reach it, and with every live node full none may
            # take it
            if state == "running" and exp is not None and \
                    max(exp, float(heal), free_since) < t - limit - EPS:
                v.fail(f"run {run_id} expired at {exp:.3f}, still running at {t:.3f} with "
                       f"free capacity since {free_since:.3f}")
    return v


def l3(h: History) -> Verdict:
    v = Verdict("L3")
    for row in h.interventions:
        v.fail(f"intervention {row}")
    for op in h.log.get("operator", []):
        v.fail(f"operator command {op}")
    for ev in h.events:
        if str(ev["event"]).startswith("operator"):
            v.fail(f"operator event {ev['event']} at {ev['node']}")
    return v


def l4(h: History) -> Verdict:
    v = Verdict("L4")
    for orphan in h.log.get("orphans", []):
        v.fail(f"orphan process group {orphan}")
    return v


CHECKS: Final = (s1, s2, s3, s4, s5, s6, l1, l2, l3, l4)


# ------------------------------------------------------------------------------------------
# facts and vacuity


def facts(h: History) -> dict[str, int]:
    f: dict[str, int] = defaultdict(int)
    for atts in h.attempts.values():
        for a in atts.values():
            if a.get("end_reason") == "expired":
                f["reclaim"] += 1
            if a.get("end_reason") == "exhausted":
                f["exhausted"] += 1
    for ev in h.events:
        name = ev["event"]
        if name == "write_result" and ev.get("result") == "fenced":
            f["db_fenced"] += 1
        elif name == "write_result" and ev.get("result") == "unknown" and ev.get(
                "kind") in FINISH_KINDS:
            f["unknown_commit"] += 1
        elif name == "lease_lost":
            if ev.get("reason") in ("safe_until", "renew_missing"):
                f["self_fence"] += 1
            f[f"lost_{ev.get('reason')}"] += 1
        elif name == "resolved":
            f[f"resolved_{ev.get('decision')}"] += 1
        elif name == "released" and ev.get("refund") and ev.get("kind") == "release" and ev.get(
                "result") == "released":
            f["refunded_release"] += 1
        elif name == "finished":
            f[f"finished_{ev.get('state')}"] += 1
        elif name == "reaped":
            f[f"reaped_{ev.get('state')}"] += 1
        elif name == "released" and ev.get("result") == "skipped" and ev.get("refund") is False:
            own = h.runs.get(ev.get("run"), {}).get("max_attempts")
            if own is not None and own < int(h.params.get("max_attempts", own)):
                f["own_budget_kept"] += 1  # the node's default would have handed it back
    for tap in h.taps:
        if tap.get("op") in ("commit", "commit_statements") and tap.get("code") == "LF001":
            f["db_fenced_tap"] += 1
    f["db_fenced"] += f["db_fenced_tap"]
    for fault in h.log.get("faults", []):
        f[f"fault_{fault['kind']}"] += 1
        if fault["kind"] == "cancel" and fault.get("result") is not None:
            f["cancel_applied"] += 1
        if fault["kind"] == "backend_kill" and fault.get("ended"):
            f["backend_killed"] += 1
    for hold in h.holds:
        lost = hold.lost
        if lost is not None and hold.end_true is not None and hold.end_true < _true(lost):
            f["lost_on_resume"] += 1
    stats = h.log.get("stats", {})
    for k in ("late_refused", "late_through"):
        f[k] = int(stats.get(k, 0))
    return dict(sorted(f.items()))


def judge(record: Mapping[str, Any], vacuity: Iterable[str] = ()) -> Judgement:
    """Every check of §7.3.6 on one history, plus the requested vacuity facts."""
    h = History(record)
    verdicts = [check(h) for check in CHECKS]
    known = facts(h)
    for name in vacuity:
        vac = Verdict(f"vacuity:{name}")
        if known.get(name, 0) <= 0:
            vac.fail(f"fault did not bite: {name}")
        verdicts.append(vac)
    return Judgement(verdicts, known)


def render(j: Judgement) -> str:
    lines = []
    for v in j.verdicts:
        lines.append(f"{v.check}: {'ok' if v.ok else 'VIOLATED'}")
        lines.extend(f"  {e}" for e in v.evidence)
    lines.append("facts: " + ", ".join(f"{k}={n}" for k, n in j.facts.items()))
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """`python -m tests.distribution.oracle <record.json>`: re-judge a record offline, a
    history or a tier-2 replay record (whose `history` is judged)."""
    if len(argv) != 1:
        print("usage: python -m tests.distribution.oracle <record.json>", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        record = json.load(fh)
    if isinstance(record.get("history"), dict):
        record = record["history"]
    j = judge(record, record.get("vacuity", ()))
    print(render(j))
    return 0 if j.ok else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
