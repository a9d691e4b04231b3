"""Chaos on one host: consecutive runs, each with a SIGKILL of a random process at a random step;
every run must still end `succeeded`, exactly once, with the fault-free behaviour.

Setup: two `flyd serve` nodes (`a`, `b`, capacity 1 each) on one database, each with its own
socket, state dir and `TMPDIR` under a work directory, both reading the harness clock
(`--sim-clock`, `--time-scale`; cli.md §5.3, distribution.md §7.3.4). First a fault-free run of
the spec gives the reference `behaviourDigest`; then every run is submitted with the production
submit statement (`PgStore.submit`), the harness finds its holder (`runs.owner_node`), polls the
holder's `Control.Status` over the bus until the run's live boundary reaches a random step K in
`1 .. steps - 10`, and SIGKILLs one victim:

- `agent`: fly-a or fly-b, by its pid; `environment`: the arena. The holder recovers the run
  through the restore path (state.md §8.2).
- `router`: the holder's router child. The node must restart it (`router.restarted`, a new pid)
  and every session it holds recovers (cli.md §5.1, state.md §8.1 step 0).
- `node`: the holder itself. Its router and workers must die with it (die-with-parent); the
  harness then jumps sim time by the lease TTL plus a second (`HarnessClock.advance`, so no real
  TTL is slept out), the other node reclaims the run after expiry and resumes it from the head
  the victim committed (distribution.md §5.7, state.md §8.5). The victim is restarted (a new node
  id, same name and directories) once the run has ended, so the next run has two nodes again.

Victims are drawn in rounds of the four kinds, shuffled (`--victims` narrows them), so any four
consecutive runs cover every kind.

Per run, the criteria: state `succeeded`; the ledger (`flyd.effects`) holds `boundary-1..N` and
`finish` each exactly once; the `behaviourDigest` equals the fault-free one; the fault is proven
(the victim pid is gone; for agent, environment and router kills the outcome counts a recovery,
for a router kill the holder logged `router.restarted` and runs a router with another pid; for
a node kill the victim's last grant of the run (an earlier one may have been released, e.g. when
the run did not fit yet) ended `expired` and a later grant belongs to the other node); and no
orphan: the holder is idle again (no workers), every live node has exactly one router, nothing
started under a killed node's directory survives it. At the end both nodes drain (exit 0) and
no process started under the work directory survives.

A node killed with SIGKILL cannot remove its private temporary directory (`flyd-node-<pid>-*`
under its `TMPDIR`); its restart removes it (`node.temp_swept`, counted as `sweptNodeTempDirs`),
and at the end every node's `TMPDIR` must be empty.

Output: progress lines on stderr, one JSON summary object on stdout (`violations` lists every
failed criterion; exit 1 when it is not empty). Without `--dsn` a fresh database is created on
`FLYD_TEST_DSN`'s server (else 127.0.0.1:5432) and dropped at the end.

    python scripts/chaos.py                     # 100 runs of 50 steps
    python scripts/chaos.py --runs 8 --dsn postgresql://...
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
import psutil  # noqa: E402

from flyd.leases.params import LeaseParams  # noqa: E402
from scripts.soak import (  # noqa: E402
    HarnessError,
    Node,
    cmdline,
    entries,
    live_run,
    processes_under,
    progress,
    query,
    run_spec,
    scratch_database,
    session_problems,
    sigkill,
    submit,
    wait_terminal,
    wait_until,
)
from tests.distribution.harness.clock import HarnessClock  # noqa: E402

KINDS = ("agent", "environment", "router", "node")
NODES = ("a", "b")
IDLE_TIMEOUT_S = 30.0
ORPHAN_TIMEOUT_S = 10.0
HOLDER_TIMEOUT_S = 120.0


def running_under(dsn: str, run: int) -> tuple[str, int] | None:
    """(node name, node pid) of the node row holding `run` while it is `running`."""
    rows = query(dsn, "SELECT n.node_name, n.pid FROM flyd.runs r JOIN flyd.nodes n "
                      "ON n.node_id = r.owner_node WHERE r.run_id = %s AND r.state = 'running'",
                 run)
    return (str(rows[0][0]), int(rows[0][1])) if rows else None


def holds(dsn: str, run: int, node: Node | None) -> bool:
    """Whether `run` is running under `node`'s live process (any node's, for None)."""
    row = running_under(dsn, run)
    return row is not None and (node is None or row == (node.name, node.pid))


def holder_of(dsn: str, run: int, nodes: dict[str, Node]) -> Node:
    """The node whose live process holds `run` (its `owner_node` row names that node's pid)."""
    found: list[Node] = []

    def held() -> bool:
        row = running_under(dsn, run)
        if row is None or row[0] not in nodes:
            return False
        node = nodes[row[0]]
        if node.alive() and node.pid == row[1]:
            found[:] = [node]
        return bool(found)
    wait_until(f"a node to hold run {run}", held, HOLDER_TIMEOUT_S, poll=0.05)
    return found[0]


@dataclass
class Chaos:
    dsn: str
    work: Path
    runs: int
    steps: int
    every: int
    pace_s: float
    kinds: tuple[str, ...]
    time_scale: float
    rng: random.Random
    nodes: dict[str, Node] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    digest: str | None = None
    swept_temp_dirs: int = 0

    def victims(self) -> list[str]:
        order: list[str] = []
        while len(order) < self.runs:
            kinds = list(self.kinds)
            self.rng.shuffle(kinds)
            order += kinds
        return order[:self.runs]

    def reference(self) -> None:
        """The fault-free run of the same spec: its digest is every chaos run's."""
        run = submit(self.dsn, run_spec(self.steps, self.every, self.pace_s))
        state, outcome = wait_terminal(self.dsn, run)
        problems = session_problems(self.dsn, run, self.steps, state, outcome, None)
        if problems or int(outcome.get("recoveries", 0)):
            raise HarnessError(f"the fault-free run failed: {problems or outcome}")
        self.digest = str(outcome["behaviourDigest"])

    def one(self, index: int, kind: str, clock: HarnessClock) -> None:
        run = submit(self.dsn, run_spec(self.steps, self.every, self.pace_s))
        step = self.rng.randint(1, max(1, self.steps - 10))
        while True:
            holder = holder_of(self.dsn, run, self.nodes)
            restarts = len(holder.events("router.restarted"))
            entry = live_run(holder.socket, run, step,
                             held=lambda h=holder: holds(self.dsn, run, h))  # type: ignore[misc]
            if entry is not None:
                break
            if query(self.dsn, "SELECT state::text FROM flyd.runs WHERE run_id = %s",
                     run)[0][0] != "pending" and not holds(self.dsn, run, None):
                raise HarnessError(f"run {run} ended before its kill at boundary {step}")
        record: dict[str, Any] = {"index": index, "run": run, "victim": kind,
                                  "holder": holder.name, "targetBoundary": step,
                                  "killedAtBoundary": entry["boundary"]}
        problems: list[str] = []
        started = time.monotonic()
        if kind in ("agent", "environment"):
            ids = ["arena"] if kind == "environment" else ["fly-a", "fly-b"]
            worker = self.rng.choice([w for w in entry["workers"] if w["workerId"] in ids])
            record["worker"] = worker["workerId"]
            sigkill(psutil.Process(int(worker["pid"])))
        elif kind == "router":
            router = holder.router()
            if router is None:
                raise HarnessError(f"node {holder.name} has no router")
            record["oldRouterPid"] = router.pid
            sigkill(router)
        else:
            holder.kill()
            try:
                wait_until(f"node {holder.name}'s router and workers to die with it",
                           lambda: not processes_under(str(holder.home)), ORPHAN_TIMEOUT_S)
            except HarnessError as exc:
                problems.append(f"run {run}: {exc}: "
                                f"{[cmdline(p) for p in processes_under(str(holder.home))]}")
            clock.advance(LeaseParams().ttl_s + 1.0)
        state, outcome = wait_terminal(self.dsn, run)
        record.update(state=state, recoveries=int((outcome or {}).get("recoveries", 0)),
                      epochs=(outcome or {}).get("epochs"),
                      secondsToEnd=round(time.monotonic() - started, 2))
        problems += session_problems(self.dsn, run, self.steps, state, outcome, self.digest)
        problems += self.proof(run, kind, holder, record, restarts)
        if kind == "node":
            holder.start(self.dsn)
        problems += self.orphans(run)
        record["problems"] = problems
        self.records.append(record)
        self.violations += problems

    def proof(self, run: int, kind: str, holder: Node, record: dict[str, Any],
              restarts: int) -> list[str]:
        """That the kill happened and was recovered from the way the kind says."""
        problems = []
        if kind != "node" and record["recoveries"] < 1:
            problems.append(f"run {run}: the {kind} kill left no recovery in the outcome")
        if kind == "router":
            def restarted() -> bool:
                router = holder.router()
                return (len(holder.events("router.restarted")) > restarts
                        and router is not None and router.pid != record["oldRouterPid"])
            try:
                wait_until("router.restarted", restarted, IDLE_TIMEOUT_S)
            except HarnessError:
                problems.append(f"run {run}: node {holder.name} did not restart its router")
            router = holder.router()
            record["newRouterPid"] = None if router is None else router.pid
        if kind == "node":
            grants = query(self.dsn, "SELECT a.lease_epoch, n.node_name, n.pid, "
                                     "a.end_reason::text FROM flyd.run_attempts a JOIN "
                                     "flyd.nodes n USING (node_id) WHERE a.run_id = %s "
                                     "ORDER BY a.lease_epoch", run)
            record["grants"] = [[int(g[0]), str(g[1]), g[3]] for g in grants]
            mine = [g for g in grants if g[1] == holder.name and g[2] == holder.pid]
            later = [g for g in grants if mine and g[0] > mine[-1][0]]
            if not mine or mine[-1][3] != "expired":
                problems.append(f"run {run}: the killed node's grant did not end expired: "
                                f"{record['grants']}")
            if not later or later[-1][1] == holder.name:
                problems.append(f"run {run}: no other node reclaimed the run: "
                                f"{record['grants']}")
        return problems

    def orphans(self, run: int) -> list[str]:
        """Every live node idle (no workers) with exactly one router; nothing else alive
        under the work directory."""
        problems = []
        for node in self.nodes.values():
            try:
                wait_until(f"node {node.name} to reap its workers",
                           lambda n=node: not n.workers(), IDLE_TIMEOUT_S)  # type: ignore[misc]
            except HarnessError:
                problems.append(f"after run {run}: node {node.name} keeps workers "
                                f"{[cmdline(p) for p in node.workers()]}")
            routers = [c for c in node.children() if " router " in f" {cmdline(c)} "]
            if node.alive() and len(routers) != 1:
                problems.append(f"after run {run}: node {node.name} has {len(routers)} routers")
        live = {n.pid for n in self.nodes.values() if n.alive()}
        owned = {c.pid for n in self.nodes.values() if n.alive() for c in n.children()}
        strays = [p for p in processes_under(str(self.work))
                  if p.pid not in live and p.pid not in owned]
        if strays:
            problems.append(f"after run {run}: orphans {[(p.pid, cmdline(p)) for p in strays]}")
        return problems

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        codes: dict[str, int | None] = {}
        clock_args = ("--sim-clock", str(self.work / "clock"), "--time-scale",
                      str(self.time_scale), "--capacity", "1")
        with HarnessClock(self.dsn, self.work / "clock", time_scale=self.time_scale) as clock:
            self.nodes = {name: Node(self.work, name, clock_args) for name in NODES}
            try:
                for node in self.nodes.values():
                    node.start(self.dsn)
                self.reference()
                progress("chaos", f"fault-free digest {self.digest}")
                for index, kind in enumerate(self.victims(), start=1):
                    self.one(index, kind, clock)
                    last = self.records[-1]
                    progress("chaos", f"{index}/{self.runs} run {last['run']}: {kind} killed at "
                                      f"boundary {last['killedAtBoundary']} on "
                                      f"{last['holder']}: {last['state']}, recoveries "
                                      f"{last['recoveries']}, {last['secondsToEnd']} s; "
                                      f"{len(self.violations)} violations")
            finally:
                codes = {name: node.stop() for name, node in self.nodes.items()}
        for name, code in codes.items():
            if code != 0:
                self.violations.append(f"node {name}'s drain exited {code}")
            leftovers = [n for n in entries(self.nodes[name].tmp_dir) if "/" not in n]
            self.swept_temp_dirs += sum(int(e.get("count", 0))
                                        for e in self.nodes[name].events("node.temp_swept"))
            if leftovers:
                self.violations.append(f"node {name} left temporary files: {leftovers}")
            if entries(self.nodes[name].socket_dir):
                self.violations.append(f"node {name} left its socket dir non-empty: "
                                       f"{entries(self.nodes[name].socket_dir)}")
        survivors = processes_under(str(self.work))
        if survivors:
            self.violations.append(f"processes outlived the nodes: "
                                   f"{[(p.pid, cmdline(p)) for p in survivors]}")
            for proc in survivors:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        by_kind = Counter(r["victim"] for r in self.records)
        ok_kind = Counter(r["victim"] for r in self.records
                          if r["state"] == "succeeded" and not r["problems"])
        return {"tool": "chaos", "runs": self.runs, "steps": self.steps,
                "checkpointEvery": self.every, "paceS": self.pace_s,
                "timeScale": self.time_scale, "faultFreeDigest": self.digest,
                "victims": dict(by_kind), "passedByVictim": dict(ok_kind),
                "succeeded": sum(1 for r in self.records if r["state"] == "succeeded"),
                "recoveries": sum(r["recoveries"] for r in self.records),
                "sweptNodeTempDirs": self.swept_temp_dirs, "nodeExits": codes,
                "wallSeconds": round(time.monotonic() - started, 1), "records": self.records,
                "violations": self.violations, "ok": not self.violations}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100, help="runs with a kill each (100)")
    parser.add_argument("--steps", type=int, default=50, help="transitions per run (50)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--pace-s", type=float, default=0.04, help="seconds per step (0.04)")
    parser.add_argument("--victims", default=",".join(KINDS),
                        help=f"comma-separated kinds of {','.join(KINDS)} (all)")
    parser.add_argument("--time-scale", type=float, default=2.0,
                        help="sim seconds per real second of the harness clock (2)")
    parser.add_argument("--seed", type=int, default=None, help="victims and steps (random)")
    parser.add_argument("--dsn", default=None, help="a migrated database to use")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="directory for the nodes' files (default: a fresh temporary one, "
                             "removed at the end)")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.victims.split(",") if k)
    if not kinds or any(k not in KINDS for k in kinds):
        parser.error(f"--victims takes kinds of {','.join(KINDS)}")
    if args.steps < 12:
        parser.error("--steps must be at least 12 (a kill lands in 1 .. steps - 10)")
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="flyd-chaos-"))
    try:
        with scratch_database(args.dsn) as dsn:
            chaos = Chaos(dsn=dsn, work=work, runs=args.runs, steps=args.steps,
                          every=args.checkpoint_every, pace_s=args.pace_s, kinds=kinds,
                          time_scale=args.time_scale, rng=random.Random(seed))
            try:
                summary = chaos.run()
            except HarnessError as exc:
                summary = {"tool": "chaos", "ok": False, "records": chaos.records,
                           "violations": [*chaos.violations, f"harness: {exc}"]}
                summary["logTails"] = {n.name: n.log_tail() for n in chaos.nodes.values()}
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    summary["seed"] = seed
    print(orjson.dumps(summary).decode(), flush=True)
    progress("chaos", "ok" if summary["ok"] else f"FAILED: {summary['violations'][:5]}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
