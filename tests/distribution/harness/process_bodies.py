"""The bodies of the process and server scenarios of distribution.md §7.3.5.

pause, node_loss, kill_finish_committed, kill_finish_uncommitted, db_backends_terminated,
db_blips, db_restart, attempts_exhausted, cancel_while_partitioned and graceful_drain, registered
into the runner's `BODIES` like the link scenarios of `bodies.py`, whose driver (`Cluster`) they
use through `ProcessCluster`. Each body ends with `Cluster.conclude`: the oracle (S1–S6,
L1–L4), the row's must-hold checks (`must:<name>`) and its vacuity facts (`VACUITY`). Every
check reads the history record only (tables, node events, taps, the fault log and the
`process` evidence the body adds to the log), so a replay record carries its evidence.

Rules:
- `ProcessCluster` adds to the driver: the epoch of every run in each sample (`log.epochs`,
  for "no epoch regression"); the `restart` server fault (`pg_ctl restart -m fast` of the
  scenario's private server, with the count of live leases just before); down-link `OnMatch`
  triggers, which match a CommandComplete tag the link *held* (the server executed the
  statement, the node never heard back).
- Placement: nodes have capacity 2 and rows 3 runs; B is kept stopped (holding nothing)
  while A claims two, so A holds the most and B has room for one of A's at once.
- Dwell: where the row says B takes over (node_loss, graceful_drain: one of A's runs;
  kill_finish_uncommitted: the run of the held final commit), the body waits, before the
  liveness phase restarts A, until the run was granted again (or ended), so the new
  incarnation of A cannot take it first.
- node_loss: only the node pid gets SIGKILL. Its descendants (router, workers; they must die
  by themselves) are snapshotted with pidfds first, once A runs workers; the sim instant at
  which the last pidfd turns readable (exit) is compared with the kill instant (≤ K plus the
  oracle's slack), and no process with the scenario marker outside B's tree may remain.
- kill_finish_committed: A's down link is `hold_on_match('finish_run')` from the fault phase
  on, so from the RowDescription of A's first final commit on nothing reaches A; the trigger
  is the COMMIT tag held on that link (the transaction committed), and A gets SIGKILL at that
  instant. Its victims are the final commits A logged (`write_begin(finish)`) without a
  result: those that landed (grant closed `finished` or `finish` in the ledger) must number
  the connections whose COMMIT tag A never read (held, or let through only by the final heal
  at A's kill: a second final commit on another connection may send its COMMIT after the
  trigger and land) and stay terminal at A's epoch; one still unsent at the kill must land
  nothing. kill_finish_uncommitted's victims are found the same way.
- db_restart runs on a private cluster started from pgserver's binaries in a temporary
  directory (`PrivateServer`), never on the shared server;
  db_backends_terminated ends only sessions named `flyd:%` in the scenario's database.
- db_blips: three bursts T/2 apart, each eight such rounds 0.25 s apart (sessions opened
  during a burst are ended too); every round logs the sessions it ended and how many of them
  were not idle (`busy`). Its vacuity fact is the fewest sessions any burst ended; its
  must-hold adds "all succeed" and "no grant lost" (no `lease_lost`, one grant per run: a
  blip of seconds is far shorter than the lease) to the server rows' checks (S3 already holds
  every boundary once, with the reference digest).
- attempts_exhausted: 3 runs on nodes of capacity 1, so the node holding X holds nothing
  else and only X is charged by each kill. Whenever X is granted at a new epoch, its holder
  gets SIGKILL and restarts; X ends `failed` (reaped) once its charged grants (grants minus
  refunded releases, §1.2) reach `max_attempts`.

Decisions where the spec is silent:
- "A's first act for overdue holds is cancellation" (pause): for every hold A had at SIGSTOP,
  the first of `lease_lost`, `write_begin` and a `renew_sent` naming it after SIGCONT is
  `lease_lost(safe_until)`; results of writes sent before the pause are not acts.
- "no effect after" (cancel_while_partitioned): every effect of the cancelled run recorded
  after the cancel request belongs to the transaction that ended it (recorded at its
  `finished_at`), and the run ends `cancelled`.
- "reconnection" (server faults): every node alive across a round renews a lease again
  after it.
- pause: the clock stays frozen after SIGCONT until the node logs again (≤ `RESUME_REAL_S`
  real): S6 allows W + slack after the resume, and a host loaded far beyond its CPUs may take
  longer than that (in sim time) merely to schedule a resumed process.
- graceful_drain: every hold of A is released within D of SIGTERM on A's clock; the exit is
  only required to come (code 0), its real-time bound is test 59's.
- hangs (issue 34, beyond §7.3.5): once A runs workers (its fork server is up: one stopped
  while it starts is bounded by its start, not by the probe), its router and fork server get SIGSTOP
  at one sim instant and never SIGCONT. The body waits (≤ `dwell_s`) until A logged
  `part.replaced` for both; its evidence (`process.hangs`) holds the stopped pids, whether each
  is gone, the parts A replaced after the stop and A's charged recovery attempts
  (`recovery.attempt_failed`, `recovery.exhausted`). Must hold: every stopped part is gone,
  both were replaced, A charged no recovery attempt, and every run succeeded with
  `attempt = 1` (no grant charged beyond its first). Vacuity: the parts replaced after the
  stop (both, or 0).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import pwd
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import psutil
from psycopg.conninfo import make_conninfo

from tests.distribution.harness.bodies import (
    REGISTER_S,
    SLACK_S,
    TERMINAL,
    VACUITY,
    Cluster,
    Workload,
)
from tests.distribution.harness.runner import (
    BODIES,
    ScenarioContext,
    processes_with_marker,
)
from tests.distribution.harness.scenarios import (
    Fault,
    NodeSignal,
    OnMatch,
    PartSignal,
    ServerFault,
    Span,
)

PG_USER: Final = "pgserver"
PG_TOOL_S: Final = 120.0
GONE_REAL_S: Final = 10.0
RESUME_REAL_S: Final = 2.0
POLL_REAL_S: Final = 0.002
PIDFD_POLL_MS: Final = 20
#: Run lengths a dwell may take beyond the lease TTL: a reclaiming node may first have to
#: finish its own runs (capacity) before it takes the dead node's.
DWELL_RUNS: Final = 3

Check = Callable[[dict[str, Any]], list[str]]


# ------------------------------------------------------------------------------------------
# the private server (db_restart)


def _pg_bin() -> Path:
    """pgserver's bundled binaries, found without importing pgserver (its import resolves
    a runtime directory for a lock this harness does not use)."""
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("pgserver is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


class PrivateServer:
    """A PostgreSQL cluster of this scenario alone, from pgserver's bundled binaries in a
    temporary directory (Unix socket only, `fsync=off`): the only kind of server a test may
    restart. PostgreSQL refuses to run as root, so under uid 0 it runs as pgserver's system
    user, as the embedded default does (flyd.leases.embedded)."""

    def __init__(self) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="flyd-pg-"))
        self.pgdata = self.home / "pg"
        self.user: int | None = None
        if os.geteuid() == 0:
            self.user = pwd.getpwnam(PG_USER).pw_uid
            os.chown(self.home, self.user, pwd.getpwnam(PG_USER).pw_gid)
        self.admin_dsn = make_conninfo(host=str(self.home), dbname="postgres", user="postgres")
        self._started = False

    def _tool(self, name: str, *args: str) -> None:
        subprocess.run([str(_pg_bin() / name), *args], cwd=self.home, user=self.user,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=PG_TOOL_S, check=True)

    def _ctl(self, *args: str) -> None:
        self._tool("pg_ctl", "-D", str(self.pgdata), "-w", "-t", str(int(PG_TOOL_S - 10)),
                   "-l", str(self.home / "log"), *args)

    def __enter__(self) -> PrivateServer:
        try:
            self._tool("initdb", "-D", str(self.pgdata), "--auth=trust", "-U", "postgres",
                       "--encoding=utf8")
            self._ctl("-o", f"-h '' -k {self.home} -c fsync=off", "start")
            self._started = True
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._started:
                self._ctl("-m", "fast", "stop")
        finally:
            shutil.rmtree(self.home, ignore_errors=True)

    def restart(self) -> None:
        """`pg_ctl restart -m fast` (the server keeps the options it was started with)."""
        self._ctl("-m", "fast", "restart")


# ------------------------------------------------------------------------------------------
# the driver's extensions


class ProcessCluster(Cluster):
    """`Cluster` with epoch samples, server restarts, held-reply triggers and the body's
    `process` evidence in the record (module rules)."""

    def __init__(self, ctx: ScenarioContext, workload: Workload,
                 server: PrivateServer | None = None) -> None:
        super().__init__(ctx, workload)
        self.server = server
        self.epochs: list[list[Any]] = []
        self.process: dict[str, Any] = {}

    def submit(self) -> None:
        """The workload, placed: B is held stopped (it holds nothing yet) while A claims up to
        its capacity, so A holds the most runs and B has room to take A's over."""
        b = self.current.get("b")
        if b is None:
            super().submit()
            return
        with self.frozen() as t:
            os.kill(b.proc.pid, signal.SIGSTOP)
            b.pauses.append([t, None])
            self.log("placement", node="b", signal="STOP")
        try:
            super().submit()
            want = min(self.workload.capacity, self.workload.runs)
            self.wait("A to claim its share", lambda: len(self.owned("a")) >= want,
                      REGISTER_S * self.scale)
        finally:
            with self.frozen() as t:
                os.kill(b.proc.pid, signal.SIGCONT)
                b.pauses[-1][1] = t
                self.log("placement", node="b", signal="CONT")

    def _sample(self) -> None:
        super()._sample()
        rows = self.query("SELECT run_id, lease_epoch FROM flyd.runs ORDER BY run_id")
        self.epochs.append([self.now(), [[int(r), int(e)] for r, e in rows]])

    def _server(self, fault: ServerFault) -> None:
        if fault.kind != "restart":
            super()._server(fault)
            return
        if self.server is None:
            raise RuntimeError("a restart needs the scenario's private server")
        held = self.live_leases()
        started = time.monotonic()
        self.server.restart()
        self.log("server_restart", held=held, took_real_s=round(time.monotonic() - started, 3))

    def _signal(self, fault: NodeSignal) -> None:
        """A resume (SIGCONT) keeps the clock frozen until the node writes its first log line
        again (at most `RESUME_REAL_S`): the resume instant is when the node runs again, not
        when a loaded host first schedules it."""
        inc = self.current[fault.node]
        if fault.signal != "CONT" or not inc.alive:
            super()._signal(fault)
            return
        size = _size(inc.log)
        started = time.monotonic()
        super()._signal(fault)
        while inc.alive and _size(inc.log) == size and \
                time.monotonic() - started < RESUME_REAL_S:
            time.sleep(POLL_REAL_S)
        self.log("resumed", node=fault.node, waited_real_s=round(time.monotonic() - started, 3))

    def live_leases(self) -> int:
        rows = self.query("SELECT count(*) FROM flyd.runs WHERE state = 'running' "
                          "AND lease_expires_at > flyd.app_now()")
        return int(rows[0][0])

    def _matched(self, watch: OnMatch, seen: int) -> tuple[float | None, int]:
        if watch.direction == "up":
            return super()._matched(watch, seen)
        assert self.host is not None
        records = self.host.tap.records()
        for r in records[seen:]:
            if r.node == watch.node and r.direction == "down" and r.kind == "complete" \
                    and r.fate == "held" and watch.text in str(r.detail.get("tag", "")):
                return r.sim_time, len(records)
        return None, len(records)

    def record(self) -> dict[str, Any]:
        history = super().record()
        history["log"]["epochs"] = self.epochs
        history["log"]["process"] = self.process
        return history

    # -- helpers for bodies ----------------------------------------------------------------

    def owned(self, name: str) -> dict[int, int]:
        """Runs (run → epoch) the database shows held by node `name`'s incarnation."""
        inc = self.current[name]
        rows = self.query("SELECT run_id, lease_epoch FROM flyd.runs WHERE state = 'running' "
                          "AND owner_node = %s ORDER BY run_id", inc.node_id)
        return {int(r): int(e) for r, e in rows}

    def await_regranted(self, runs: Mapping[int, int], sim_s: float, *,
                        every: bool = True) -> None:
        """Until every run of `runs` (run → epoch; with `every` false: one of them) was
        granted past that epoch or ended."""
        if not runs:
            return

        def done() -> bool:
            rows = self.query("SELECT run_id, lease_epoch, state::text FROM flyd.runs "
                              "WHERE run_id = ANY(%s)", list(runs))
            moved = [int(e) > runs[int(r)] or s in TERMINAL for r, e, s in rows]
            return all(moved) if every else any(moved)

        self.wait(f"runs {sorted(runs)} to be granted again", done, sim_s)
        self.log("regranted", runs=sorted(runs), every=every)

    def kill_and_restart(self, name: str) -> None:
        """SIGKILL node `name` at one sim instant and start it again (a new node_id)."""
        with self.frozen():
            self._signal(NodeSignal(Span(0), name, "KILL", restart=True))

    def logged(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        """The fault log's entries of `kind` whose fields equal `match`."""
        return [f for f in self.faults if f["kind"] == kind
                and all(f.get(k) == v for k, v in match.items())]

    def dwell_s(self) -> float:
        return self.params.T + DWELL_RUNS * self.workload.longest_run_s(self.scale, self.params)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _workload(ctx: ScenarioContext, capacity: int = 2) -> Workload:
    """The row's runs on nodes of `capacity` 2: A claims two, B one (`submit`), so B has room
    for one of A's at once, and no more worker processes start than the rows need."""
    return Workload(runs=ctx.scenario.runs, capacity=capacity)


# ------------------------------------------------------------------------------------------
# reading the history


def _nodes(h: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    return sorted((n for n in h["log"]["nodes"] if n["name"] == name),
                  key=lambda n: n["generation"])


def _ids(h: Mapping[str, Any], name: str) -> set[str]:
    return {str(n["node_id"]) for n in _nodes(h, name)}


def _faults(h: Mapping[str, Any], kind: str, **match: Any) -> list[Mapping[str, Any]]:
    return [f for f in h["log"]["faults"] if f["kind"] == kind
            and all(f.get(k) == v for k, v in match.items())]


def _events(h: Mapping[str, Any], node_id: str) -> list[Mapping[str, Any]]:
    return [e for e in h["events"] if e["node"] == node_id]


def _attempts(h: Mapping[str, Any]) -> dict[int, dict[int, Mapping[str, Any]]]:
    out: dict[int, dict[int, Mapping[str, Any]]] = defaultdict(dict)
    for a in h["tables"]["run_attempts"]:
        out[int(a["run_id"])][int(a["lease_epoch"])] = a
    return out


def _runs(h: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    return {int(r["run_id"]): r for r in h["tables"]["runs"]}


def _ends(ev: Mapping[str, Any]) -> bool:
    return ev["event"] in ("lease_lost", "finished") or (
        ev["event"] == "released" and ev.get("result") == "released")


def _open_at(events: list[Mapping[str, Any]], t: float) -> list[tuple[int, int]]:
    """The (run, epoch) holds a node had open at true time `t`."""
    held: dict[tuple[int, int], bool] = {}
    for ev in events:
        if float(ev["true"]) >= t:
            break
        key = (ev.get("run"), ev.get("epoch"))
        if ev["event"] == "claimed":
            held[(int(ev["run"]), int(ev["epoch"]))] = True
        elif key in held and _ends(ev):
            del held[key]  # type: ignore[arg-type]
    return sorted(held)


def _unanswered_finish(evs: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """`write_begin(finish)` events of one node with no later result for their grant."""
    out = []
    for i, ev in enumerate(evs):
        if ev["event"] != "write_begin" or ev.get("kind") != "finish":
            continue
        key = (ev["run"], ev["epoch"])
        if not any(e["event"] in ("write_result", "finished", "lease_lost")
                   and (e.get("run"), e.get("epoch")) == key for e in evs[i + 1:]):
            out.append(ev)
    return out


def _all_terminal(h: Mapping[str, Any]) -> list[str]:
    runs = _runs(h)
    return [f"run {r} is {runs[r]['state'] if r in runs else None}"
            for r in h["log"]["spawned"] if r not in runs or runs[r]["state"] not in TERMINAL]


def _epochs_monotone(h: Mapping[str, Any]) -> list[str]:
    """No epoch regression: sampled epochs never decrease, and none exceeds the final one."""
    out = []
    last: dict[int, int] = {}
    for t, rows in h["log"].get("epochs", []):
        for run, epoch in rows:
            if epoch < last.get(run, 0):
                out.append(f"run {run}: epoch {last[run]} then {epoch} at {t:.3f}")
            last[run] = epoch
    for run, r in _runs(h).items():
        if int(r["lease_epoch"]) < last.get(run, 0):
            out.append(f"run {run}: final epoch {r['lease_epoch']} below sampled {last[run]}")
    if not h["log"].get("epochs"):
        out.append("no epoch samples")
    return out


def _renewed_after(h: Mapping[str, Any], kinds: tuple[str, ...]) -> list[str]:
    """Every node alive across a server fault renews a lease after it."""
    out = []
    rounds = [f for f in h["log"]["faults"] if f["kind"] in kinds]
    if not rounds:
        return [f"no {'/'.join(kinds)} applied"]
    for f in rounds:
        t = float(f["true"])
        for n in h["log"]["nodes"]:
            end = n["end"][0] if n["end"] is not None else None
            if n["start"][0] > t or n["how"] not in ("stop", None) or (
                    end is not None and end <= t):
                continue
            if not any(e["event"] == "renewed" and float(e["true"]) > t
                       for e in _events(h, n["node_id"])):
                out.append(f"{n['node_id']} never renewed after the {f['kind']} at {t:.3f}")
    return out


# ------------------------------------------------------------------------------------------
# pause


def _pause_window(h: Mapping[str, Any]) -> tuple[str, float, float] | None:
    stops = _faults(h, "signal", node="a", signal="STOP")
    conts = _faults(h, "signal", node="a", signal="CONT")
    if not stops or not conts:
        return None
    return str(stops[0]["node_id"]), float(stops[0]["true"]), float(conts[0]["true"])


def _pause_first_act(h: dict[str, Any]) -> list[str]:
    window = _pause_window(h)
    if window is None:
        return ["A was not paused and resumed"]
    node, stop, cont = window
    evs = _events(h, node)
    out = []
    held = _open_at(evs, stop)
    if not held:
        out.append("A held nothing at SIGSTOP")
    for run, epoch in held:
        acts = [e for e in evs if float(e["true"]) >= cont and (
            ((e.get("run"), e.get("epoch")) == (run, epoch)
             and e["event"] in ("lease_lost", "write_begin"))
            or (e["event"] == "renew_sent" and [run, epoch] in e.get("runs", [])))]
        if not acts:
            out.append(f"{run}@{epoch}: no lease_lost after resume")
        elif acts[0]["event"] != "lease_lost" or acts[0].get("reason") != "safe_until":
            out.append(f"{run}@{epoch}: first act after resume is {acts[0]['event']} "
                       f"({acts[0].get('reason') or acts[0].get('kind')})")
    return out


def _no_write_after_next_grant(h: dict[str, Any]) -> list[str]:
    """No row of A's commits, nor a `committed` result A saw, after the next grant."""
    ids = _ids(h, "a")
    atts = _attempts(h)
    out = []
    for table, col in (("effects", "recorded_at"), ("checkpoints", "committed_at")):
        for row in h["tables"][table]:
            nxt = atts[int(row["run_id"])].get(int(row["lease_epoch"]) + 1)
            if row["node_id"] in ids and nxt is not None and \
                    float(row[col]) > float(nxt["granted_at"]):
                out.append(f"{table} row of run {row['run_id']} epoch {row['lease_epoch']} "
                           f"at {row[col]:.3f} after grant {row['lease_epoch'] + 1}")
    for e in h["events"]:
        if e["node"] in ids and e["event"] == "write_result" and e.get("result") == "committed":
            nxt = atts[int(e["run"])].get(int(e["epoch"]) + 1)
            if nxt is not None and float(e["true"]) > float(nxt["granted_at"]):
                out.append(f"A saw {e['run']}@{e['epoch']} committed at {e['true']:.3f} after "
                           f"grant {int(e['epoch']) + 1}")
    return out


def _lost_after_resume(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    window = _pause_window(h)
    if window is None:
        return 0
    node, _, cont = window
    return sum(1 for e in _events(h, node) if e["event"] == "lease_lost"
               and e.get("reason") == "safe_until" and float(e["true"]) >= cont)


def pause(ctx: ScenarioContext) -> None:
    with ProcessCluster(ctx, _workload(ctx)) as cluster:
        cluster.start()
        cluster.await_mid_run()
        cluster.fault_phase(cluster.now())
        cluster.liveness_phase()
        cluster.conclude({"A's first act for overdue holds is cancellation": _pause_first_act,
                          "no A write accepted after B's grant": _no_write_after_next_grant})


# ------------------------------------------------------------------------------------------
# node_loss


def _role(proc: psutil.Process) -> str:
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return "gone"
    if any(a.startswith("workers.") for a in argv):
        return "worker"
    return "router" if "router" in argv else "other"


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(pid).children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


@contextlib.contextmanager
def _pidfds(procs: list[psutil.Process]) -> Iterator[dict[int, int]]:
    """pidfd → pid for every process still there (closed on exit)."""
    fds: dict[int, int] = {}
    try:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                fds[os.pidfd_open(p.pid)] = p.pid
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def _await_exits(ctx: ScenarioContext, fds: Mapping[int, int]) -> list[int]:
    """Until every pidfd turns readable (its process exited) or `GONE_REAL_S` passes;
    returns the pids still running."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    remaining = set(fds)
    deadline = time.monotonic() + GONE_REAL_S
    while remaining and time.monotonic() < deadline:
        ctx.check()
        for fd, _ in poller.poll(PIDFD_POLL_MS):
            remaining.discard(fd)
            poller.unregister(fd)
    return sorted(fds[fd] for fd in remaining)


def node_loss(ctx: ScenarioContext) -> None:
    with ProcessCluster(ctx, _workload(ctx)) as cluster:
        cluster.start()
        cluster.await_mid_run()
        a = cluster.current["a"]
        cluster.wait("A to run workers",
                     lambda: any(_role(p) == "worker" for p in _tree(a.proc.pid)),
                     cluster.dwell_s())
        tree = _tree(a.proc.pid)
        roles = [{"pid": p.pid, "role": _role(p)} for p in tree]
        held = cluster.owned("a")
        with _pidfds(tree) as fds:
            cluster.fault_phase(cluster.now())
            kill = cluster.logged("signal", signal="KILL")
            running = _await_exits(ctx, fds)
            gone = cluster.now()
        b = cluster.current["b"]
        b_tree = {b.proc.pid, *(p.pid for p in _tree(b.proc.pid))}
        leftover = [f"{p.pid} {_role(p)}" for p in processes_with_marker(ctx.scenario.id)
                    if p.pid not in b_tree]
        cluster.process["node_loss"] = {
            "node_id": a.node_id, "kill": float(kill[0]["true"]) if kill else None,
            "gone": gone if not running else None, "running": running, "leftover": leftover,
            "held": [[r, e] for r, e in held.items()],
            "tree": roles}
        cluster.await_regranted(held, cluster.dwell_s(), every=False)
        cluster.liveness_phase()
        cluster.conclude({"B reclaims after expiry, completes once": _b_reclaims,
                          "A's router and workers gone within K": _a_tree_gone})


def _b_reclaims(h: dict[str, Any]) -> list[str]:
    ev = h["log"]["process"].get("node_loss")
    if ev is None:
        return ["no kill recorded"]
    atts, runs, b_ids = _attempts(h), _runs(h), _ids(h, "b")
    out = []
    if not ev["held"]:
        out.append("A held nothing at the kill")
    for run, epoch in ev["held"]:
        mine, nxt = atts[run].get(epoch), atts[run].get(epoch + 1)
        if mine is None or mine["end_reason"] != "expired":
            out.append(f"run {run}: A's grant {epoch} ended "
                       f"{None if mine is None else mine['end_reason']}, not expired")
        if nxt is None:
            out.append(f"run {run}: never granted again")
        elif mine is not None and mine["ended_at"] is not None and \
                float(nxt["granted_at"]) < float(mine["ended_at"]):
            out.append(f"run {run}: grant {epoch + 1} before A's lease expired")
        finishes = [e for e in h["tables"]["effects"]
                    if e["run_id"] == run and e["effect_key"] == "finish"]
        if runs[run]["state"] != "succeeded" or len(finishes) != 1:
            out.append(f"run {run}: {runs[run]['state']} with {len(finishes)} finish effects")
    if not any(atts[run].get(epoch + 1, {}).get("node_id") in b_ids for run, epoch in ev["held"]):
        out.append("B reclaimed none of A's runs")
    return out


def _a_tree_gone(h: dict[str, Any]) -> list[str]:
    ev = h["log"]["process"].get("node_loss")
    if ev is None or ev["kill"] is None:
        return ["no kill recorded"]
    k = float(h["params"]["kill_bound_s"])
    out = []
    if ev["running"]:
        out.append(f"A's processes {ev['running']} still running {GONE_REAL_S:g} s after the "
                   f"kill")
    elif float(ev["gone"]) - float(ev["kill"]) > k + SLACK_S:
        out.append(f"A's router and workers gone {ev['gone'] - ev['kill']:.3f} sim s after "
                   f"the kill (K = {k:g}, slack {SLACK_S:g})")
    if not any(p["role"] == "router" for p in ev["tree"]):
        out.append("A's router was not among its processes")
    out += [f"left behind with the scenario marker: {p}" for p in ev["leftover"]]
    return out


def _finished_by_b_after_a(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    a_ids, b_ids = _ids(h, "a"), _ids(h, "b")
    count = 0
    for atts in _attempts(h).values():
        last = atts[max(atts)]
        if last["end_reason"] == "finished" and last["node_id"] in b_ids and any(
                a["node_id"] in a_ids for e, a in atts.items() if e < max(atts)):
            count += 1
    return count


def _a_had_workers(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    ev = h["log"]["process"].get("node_loss")
    return 0 if ev is None else sum(1 for p in ev["tree"] if p["role"] == "worker")


# ------------------------------------------------------------------------------------------
# kill_finish_committed / kill_finish_uncommitted


def _victims(h: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A's final commits in flight at its kill (the first incarnation's unanswered ones)."""
    first = _nodes(h, "a")
    return _unanswered_finish(_events(h, str(first[0]["node_id"]))) if first else []


def _held_commit(h: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [r for r in h["raw_taps"] if r["node"] == "a" and r["dir"] == "down"
            and r["kind"] == "complete" and r["fate"] == "held"
            and str(r["detail"].get("tag", "")).startswith("COMMIT")]


def _unread_commits(h: Mapping[str, Any]) -> set[Any]:
    """The connections of A's link whose final commit's COMMIT tag A never read: held by the
    trigger, or let through only by the final heal at A's kill. A final commit on another
    connection may still send its COMMIT after the trigger (the up link passes) and land; its
    reply then reaches the proxy while the down link holds and is delivered to a killed A. Only
    transactions that ran `finish_run` count: the hold also catches a renewal's or checkpoint's
    COMMIT on another connection, which is no final commit."""
    kills = _faults(h, "signal", node="a", signal="KILL")
    kill_t = float(kills[0]["true"]) if kills else float("inf")
    links = [r for r in h["raw_taps"] if r["node"] == "a"]
    before = {r.get("conn") for r in links if float(r["t"]) < kill_t}  # the killed A's
    return {r.get("conn") for i, r in enumerate(links)
            if r["dir"] == "down" and r["kind"] == "complete" and r.get("conn") in before
            and str(r["detail"].get("tag", "")).startswith("COMMIT")
            and (r["fate"] == "held" or float(r["t"]) >= kill_t - 1e-6)
            and _ran_finish(links, i)}


def _ran_finish(links: list[Mapping[str, Any]], at: int) -> bool:
    """Whether the transaction whose COMMIT tag is `links[at]` sent `finish_run`: an up query
    or parse on the tag's connection after that connection's previous transaction ended."""
    conn = links[at].get("conn")
    for r in reversed(links[:at]):
        if r.get("conn") != conn:
            continue
        if r["dir"] == "down" and r["kind"] == "complete" and str(
                r["detail"].get("tag", "")).startswith(("COMMIT", "ROLLBACK")):
            return False
        if r["dir"] == "up" and r["kind"] in ("query", "parse") \
                and "finish_run" in str(r["detail"].get("text", "")):
            return True
    return False


def _landed(h: Mapping[str, Any], v: Mapping[str, Any]) -> bool:
    """Whether a final commit of A committed: its grant closed `finished`, or its `finish`
    effect is in the ledger."""
    run, epoch = int(v["run"]), int(v["epoch"])
    grant = _attempts(h)[run].get(epoch)
    return (grant is not None and grant["end_reason"] == "finished") or any(
        e["run_id"] == run and e["effect_key"] == "finish" and int(e["lease_epoch"]) == epoch
        for e in h["tables"]["effects"])


def _terminal_once_at_a(h: dict[str, Any]) -> list[str]:
    """The final commits of A that committed unanswered (as many as COMMIT tags its link
    held) left their runs terminal at A's epoch for good; the others landed nothing."""
    victims = _victims(h)
    landed = [v for v in victims if _landed(h, v)]
    unread = _unread_commits(h)
    out = []
    if not landed:
        out.append("no final commit of A landed unanswered")
    if len(landed) != len(unread):
        out.append(f"{len(landed)} final commits of A landed, {len(unread)} COMMIT tags "
                   f"held or let through only at A's kill")
    atts, runs = _attempts(h), _runs(h)
    a_ids = _ids(h, "a")
    for v in victims:
        run, epoch = int(v["run"]), int(v["epoch"])
        r = runs[run]
        finishes = [int(e["lease_epoch"]) for e in h["tables"]["effects"]
                    if e["run_id"] == run and e["effect_key"] == "finish"]
        if v not in landed:
            if epoch in finishes or r["state"] not in TERMINAL or max(atts[run]) == epoch:
                out.append(f"run {run}: A's unsent final commit at {epoch}: finish effects at "
                           f"{finishes}, {r['state']}, grants {sorted(atts[run])}")
            continue
        if r["state"] not in TERMINAL or int(r["lease_epoch"]) != epoch:
            out.append(f"run {run}: {r['state']} at epoch {r['lease_epoch']}, A's final "
                       f"commit was at {epoch}")
        if max(atts[run]) != epoch:
            out.append(f"run {run}: granted again after A's final commit (epochs "
                       f"{sorted(atts[run])})")
        mine = atts[run].get(epoch)
        if mine is None or mine["node_id"] not in a_ids or mine["end_reason"] != "finished":
            out.append(f"run {run}: grant {epoch} is {mine}, not finished by A")
        if finishes != [epoch]:
            out.append(f"run {run}: finish effects at epochs {finishes}, expected [{epoch}]")
    return out


def _committed_trigger(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    """Final commits of A that committed while their reply was held, A killed unanswered."""
    kills = _faults(h, "signal", node="a", signal="KILL")
    held = _held_commit(h)
    if not kills or not held or held[0]["t"] > float(kills[0]["true"]) + 1e-6:
        return 0
    landed = [v for v in _victims(h) if _landed(h, v)]
    return len(landed) if len(landed) == len(_unread_commits(h)) else 0


def kill_finish_committed(ctx: ScenarioContext) -> None:
    with ProcessCluster(ctx, _workload(ctx)) as cluster:
        cluster.start()
        cluster.await_mid_run()
        cluster.fault_phase(cluster.now())
        cluster.liveness_phase()
        cluster.conclude({"terminal once at A's epoch; never granted again":
                          _terminal_once_at_a})


def _nothing_of_final_lands(h: dict[str, Any]) -> list[str]:
    victims = _victims(h)
    if not victims:
        return ["A had no final commit in flight at its kill"]
    atts, runs, b_ids = _attempts(h), _runs(h), _ids(h, "b")
    out = []
    for v in victims:
        run, epoch = int(v["run"]), int(v["epoch"])
        keys = set(v.get("effects") or [])
        landed = [e["effect_key"] for e in h["tables"]["effects"] if e["run_id"] == run
                  and int(e["lease_epoch"]) == epoch and e["effect_key"] in keys]
        if landed:
            out.append(f"run {run}: effects of A's final commit landed: {landed[:5]}")
        if any(c["run_id"] == run and c["checkpoint_id"] == v.get("checkpoint")
               and int(c["lease_epoch"]) == epoch for c in h["tables"]["checkpoints"]):
            out.append(f"run {run}: A's final checkpoint {v.get('checkpoint')} landed")
        mine, nxt = atts[run].get(epoch), atts[run].get(epoch + 1)
        if mine is None or mine["end_reason"] != "expired":
            out.append(f"run {run}: A's grant {epoch} ended "
                       f"{None if mine is None else mine['end_reason']}, not expired")
        if nxt is None or nxt["node_id"] not in b_ids or nxt["end_reason"] != "finished" \
                or runs[run]["state"] != "succeeded":
            out.append(f"run {run}: not finished by B at epoch {epoch + 1} "
                       f"({runs[run]['state']}, grant {nxt})")
    return out


def _uncommitted_trigger(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    """A's final commit held before its COMMIT reached the server, then A killed."""
    matched = _faults(h, "on_match", node="a", text="finish_run")
    kills = _faults(h, "signal", node="a", signal="KILL")
    held = [r for r in h["raw_taps"] if r["node"] == "a" and r["dir"] == "up"
            and r["fate"] == "held" and "finish_run" in str(r["detail"].get("text", ""))]
    return len(_victims(h)) if matched and kills and held else 0


def _final_epoch_next(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    runs = _runs(h)
    return sum(1 for v in _victims(h)
               if int(runs[int(v["run"])]["lease_epoch"]) == int(v["epoch"]) + 1)


def kill_finish_uncommitted(ctx: ScenarioContext) -> None:
    with ProcessCluster(ctx, _workload(ctx)) as cluster:
        cluster.start()
        cluster.await_mid_run()
        a = cluster.current["a"]
        cluster.fault_phase(cluster.now())
        victims: list[Mapping[str, Any]] = []

        def logged() -> bool:
            victims[:] = _unanswered_finish(list(a.lines))
            return bool(victims)

        cluster.wait("A's final commit in its log", logged, cluster.params.T)
        cluster.await_regranted({int(v["run"]): int(v["epoch"]) for v in victims},
                                cluster.dwell_s())
        cluster.liveness_phase()
        cluster.conclude({"nothing of A's final commit lands; B finishes":
                          _nothing_of_final_lands})


# ------------------------------------------------------------------------------------------
# db_backends_terminated / db_restart


def _server_must(kinds: tuple[str, ...]) -> dict[str, Check]:
    return {"reconnection": lambda h: _renewed_after(h, kinds),
            "no epoch regression": _epochs_monotone,
            "all terminal": _all_terminal}


def _each_round_ended(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    rounds = _faults(h, "backend_kill")
    want = sum(1 for f in h["log"]["schedule"] if f["kind"] == "server")
    if len(rounds) != want:
        return 0
    return min((int(f["ended"]) for f in rounds), default=0)


def _restart_while_held(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    return sum(int(f["held"]) for f in _faults(h, "server_restart"))


def db_backends_terminated(ctx: ScenarioContext) -> None:
    with ProcessCluster(ctx, _workload(ctx)) as cluster:
        cluster.start()
        cluster.await_mid_run()
        cluster.fault_phase(cluster.now())
        cluster.liveness_phase()
        cluster.conclude(_server_must(("backend_kill",)))


def _each_burst_ended(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    """db_blips: the fewest sessions any burst ended (0 when a scheduled round is missing)."""
    rounds = _faults(h, "backend_kill")
    want = sum(1 for f in h["log"]["schedule"] if f["kind"] == "server")
    if len(rounds) != want or not rounds:
        return 0
    ended: dict[int, int] = defaultdict(int)
    for f in rounds:
        ended[int(f["burst"])] += int(f["ended"])
    return min(ended.values())


def _all_succeeded(h: Mapping[str, Any]) -> list[str]:
    runs = _runs(h)
    return [f"run {r} is {runs[r]['state'] if r in runs else None}: "
            f"{runs[r].get('outcome') if r in runs else None}"
            for r in h["log"]["spawned"] if r not in runs or runs[r]["state"] != "succeeded"]


def _no_grant_lost(h: Mapping[str, Any]) -> list[str]:
    """A blip of a few seconds is far shorter than the lease: no hold is lost and every run
    is granted once (a commit waiting for the pool to reconnect is no lost lease)."""
    lost = [f"{e['node']} lost {e.get('run')}@{e.get('epoch')}: {e.get('reason')}"
            for e in h["events"] if e["event"] == "lease_lost"]
    lost += [f"run {r} was granted {len(grants)} times"
             for r, grants in sorted(_attempts(h).items()) if len(grants) != 1]
    return lost


def db_blips(ctx: ScenarioContext) -> None:
    """Bursts of backend terminations (every flyd session, repeatedly, also the ones opened
    during the burst) while both nodes hold runs: every run succeeds; S3 holds each boundary
    recorded once with the reference digest."""
    with ProcessCluster(ctx, _workload(ctx)) as cluster:
        cluster.start()
        cluster.await_mid_run()
        cluster.fault_phase(cluster.now())
        cluster.liveness_phase()
        cluster.conclude({**_server_must(("backend_kill",)), "all succeed": _all_succeeded,
                          "no grant lost": _no_grant_lost})


def db_restart(ctx: ScenarioContext) -> None:
    with PrivateServer() as server:
        ctx.dsn, ctx.template = server.admin_dsn, None
        with ProcessCluster(ctx, _workload(ctx), server) as cluster:
            cluster.start()
            cluster.await_mid_run()
            cluster.fault_phase(cluster.now())
            cluster.liveness_phase()
            cluster.conclude(_server_must(("server_restart",)))


# ------------------------------------------------------------------------------------------
# attempts_exhausted


def _refunds(h: Mapping[str, Any], run: int) -> int:
    """Refunded releases of `run`: a release the node sent with `refund` whose grant the store
    shows ended `released` (the node may be killed before it logs the reply), and the own-grant
    sweep's refunded releases."""
    asked, swept = set(), set()
    for e in h["events"]:
        if e.get("run") != run or not e.get("refund"):
            continue
        if e["event"] == "write_begin" and e.get("kind") == "release":
            asked.add(e.get("epoch"))
        elif e["event"] == "released" and (e.get("kind") == "sweep"
                                           or e.get("result") == "released"):
            swept.add(e.get("epoch"))
    confirmed = {ep for ep, a in _attempts(h)[run].items()
                 if a["end_reason"] == "released" and ep in asked}
    return len(confirmed | swept)


def _x_exhausted(h: dict[str, Any]) -> list[str]:
    x = h["log"]["process"].get("x")
    if x is None:
        return ["no run X recorded"]
    atts, runs = _attempts(h), _runs(h)
    maximum = int(h["params"]["max_attempts"])
    killed = {f["node_id"] for f in _faults(h, "signal", signal="KILL")}
    grants = atts[x]
    charged = len(grants) - _refunds(h, x)
    out = []
    if runs[x]["state"] != "failed" or charged != maximum:
        out.append(f"X = run {x}: {runs[x]['state']} after {charged} charged grants "
                   f"(max_attempts {maximum})")
    if grants and grants[max(grants)]["end_reason"] != "exhausted":
        out.append(f"X's last grant ended {grants[max(grants)]['end_reason']}, not exhausted")
    out += [f"X's grant {e} to {a['node_id']}: its holder was not killed"
            for e, a in sorted(grants.items()) if a["node_id"] not in killed]
    out += [f"run {r}: {runs[r]['state']}" for r in h["log"]["spawned"]
            if r != x and runs[r]["state"] != "succeeded"]
    return out


def _x_grants(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    x = h["log"]["process"].get("x")
    if x is None:
        return 0
    charged = len(_attempts(h)[x]) - _refunds(h, x)
    return charged if charged == int(h["params"]["max_attempts"]) else 0


def attempts_exhausted(ctx: ScenarioContext) -> None:
    with ProcessCluster(ctx, _workload(ctx, capacity=1)) as cluster:
        cluster.start()
        x = cluster.spawned[0]
        cluster.process["x"] = x
        cluster.ctx.phase = "fault"
        cluster.log("fault_phase", start=cluster.now(), x=x)
        handled = 0
        deadline = cluster.now() + (ctx.params.max_attempts + 1) * cluster.dwell_s()
        while True:
            row = cluster.query("SELECT state::text, lease_epoch, owner_node FROM flyd.runs "
                                "WHERE run_id = %s", x)[0]
            if row[0] in TERMINAL:
                break
            if row[0] == "running" and int(row[1]) > handled:
                holder = next((n for n, inc in cluster.current.items()
                               if inc.node_id == row[2]), None)
                if holder is not None:
                    cluster.kill_and_restart(holder)
                    handled = int(row[1])
            if cluster.now() > deadline:
                raise AssertionError(f"run X = {x} still {row[0]} at epoch {row[1]}")
            ctx.sleep(0.02)
        cluster.liveness_phase()
        cluster.conclude({"X failed after max_attempts grants; others succeed": _x_exhausted})


# ------------------------------------------------------------------------------------------
# cancel_while_partitioned


def _cancelled_no_effect_after(h: dict[str, Any]) -> list[str]:
    cancels = [f for f in _faults(h, "cancel") if f.get("run_id") is not None]
    if not cancels:
        return ["no run was cancelled"]
    runs = _runs(h)
    out = []
    for f in cancels:
        run, t = int(f["run_id"]), float(f["true"])
        r = runs[run]
        if r["state"] != "cancelled":
            out.append(f"run {run} ended {r['state']}, not cancelled")
        fin = r.get("finished_at")
        late = [e["effect_key"] for e in h["tables"]["effects"] if e["run_id"] == run
                and float(e["recorded_at"]) > t
                and (fin is None or abs(float(e["recorded_at"]) - float(fin)) > 1e-6)]
        if late:
            out.append(f"run {run}: effects recorded after the cancel: {late[:5]}")
    return out


def _cancel_applied(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    return sum(1 for f in _faults(h, "cancel") if f.get("result") is not None)


def cancel_while_partitioned(ctx: ScenarioContext) -> None:
    with ProcessCluster(ctx, _workload(ctx)) as cluster:
        cluster.start()
        cluster.await_mid_run()
        cluster.fault_phase(cluster.now())
        cluster.liveness_phase()
        cluster.conclude({"run cancelled (by reap or holder); no effect after":
                          _cancelled_no_effect_after})


# ------------------------------------------------------------------------------------------
# graceful_drain


def _drained(h: dict[str, Any]) -> list[str]:
    ev = h["log"]["process"].get("drain")
    if ev is None:
        return ["no drain recorded"]
    first = _nodes(h, "a")[0]
    atts, b_ids = _attempts(h), _ids(h, "b")
    d = float(h["params"]["drain_timeout_s"])
    out = []
    if first["exit_code"] != 0 or ev["exit"] is None:
        out.append(f"A exited {first['exit_code']}")
    if not ev["held"]:
        out.append("A held nothing at SIGTERM")
    evs = _events(h, str(first["node_id"]))
    for run, epoch in ev["held"]:
        mine = [e for e in evs if (e.get("run"), e.get("epoch")) == (run, epoch)
                and float(e["true"]) >= float(ev["term"])]
        ckpts = [e for e in mine if e["event"] == "write_begin" and e.get("kind") == "commit"
                 and e.get("checkpoint")]
        committed = [e for e in mine if e["event"] == "write_result"
                     and e.get("result") == "committed"]
        released = [e for e in mine if e["event"] == "released" and e.get("refund")
                    and e.get("result") == "released"]
        if not ckpts or not committed or not released:
            out.append(f"{run}@{epoch}: after SIGTERM checkpoint={len(ckpts)} "
                       f"committed={len(committed)} refunded release={len(released)}")
        elif float(released[0]["true"]) - float(ev["term"]) > d:
            out.append(f"{run}@{epoch}: released {released[0]['true'] - ev['term']:.3f} sim s "
                       f"after SIGTERM (D = {d:g})")
        grant, nxt = atts[run].get(epoch), atts[run].get(epoch + 1)
        if grant is None or grant["end_reason"] != "released":
            out.append(f"run {run}: A's grant {epoch} ended "
                       f"{None if grant is None else grant['end_reason']}")
        if nxt is None:
            out.append(f"run {run}: never granted again")
        head = ev["heads"].get(str(run))
        if head is None or not ckpts or head["high_water"] != ckpts[-1]["checkpoint"] \
                or int(head["lease_epoch"]) != epoch:
            out.append(f"run {run}: head after the drain {head} is not A's drain checkpoint")
            continue
        b_first = min((int(e["boundary"]) for e in h["tables"]["effects"]
                       if e["run_id"] == run and int(e["lease_epoch"]) > epoch
                       and e["boundary"] is not None), default=None)
        if b_first != int(head["boundary"]) + 1:
            out.append(f"run {run}: the next holder's first boundary {b_first}, A's drain "
                       f"checkpoint at {head['boundary']}")
    if not any(atts[run].get(epoch + 1, {}).get("node_id") in b_ids for run, epoch in ev["held"]):
        out.append("B resumed none of A's runs")
    if not any(int(head["boundary"]) > 0 for head in ev["heads"].values()):
        out.append("no drain checkpoint carried progress (every head at boundary 0)")
    return out


def _drain_refunds(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    ev = h["log"]["process"].get("drain")
    if ev is None:
        return 0
    first = str(_nodes(h, "a")[0]["node_id"])
    return sum(1 for e in _events(h, first) if e["event"] == "released" and e.get("refund")
               and e.get("kind") == "release" and e.get("result") == "released"
               and float(e["true"]) >= float(ev["term"]))


def graceful_drain(ctx: ScenarioContext) -> None:
    with ProcessCluster(ctx, _workload(ctx)) as cluster:
        cluster.start()
        cluster.await_mid_run()
        a = cluster.current["a"]
        cluster.wait("A to commit a checkpoint", lambda: bool(cluster.query(
            "SELECT 1 FROM flyd.runs r JOIN flyd.run_heads h USING (run_id) "
            "WHERE r.owner_node = %s AND h.boundary > 0", a.node_id)), cluster.dwell_s())
        held = cluster.owned("a")
        cluster.fault_phase(cluster.now())
        term = float(cluster.logged("signal", signal="TERM")[0]["true"])
        bound = ctx.params.drain_timeout_s + 5 + ctx.params.T
        cluster.wait("A to exit after SIGTERM", lambda: a.proc.poll() is not None, bound)
        a.end = (cluster.now(), "drain")
        heads = cluster.query("SELECT run_id, high_water, boundary, lease_epoch "
                              "FROM flyd.run_heads WHERE run_id = ANY(%s)", list(held))
        cluster.process["drain"] = {
            "term": term, "exit": a.end[0], "exit_code": a.proc.returncode,
            "held": [[r, e] for r, e in held.items()],
            "heads": {str(r): {"high_water": hw, "boundary": int(b), "lease_epoch": int(e)}
                      for r, hw, b, e in heads}}
        cluster.await_regranted(held, cluster.dwell_s(), every=False)
        cluster.liveness_phase()
        cluster.conclude({"A commits a checkpoint, releases with refund, exits 0; "
                          "B resumes from it": _drained})


# ------------------------------------------------------------------------------------------
# hangs

HANG_PARTS: Final = ("router", "fork server")
CHARGED: Final = ("recovery.attempt_failed", "recovery.exhausted")


def _part(proc: psutil.Process) -> str | None:
    """Which of a node's own parts `proc` is (None: a worker or anything else)."""
    try:
        argv = proc.cmdline()
    except psutil.Error:
        return None
    if "workers.forkserver" in argv:
        return "fork server"
    if "router" in argv and "flyd" in argv:
        return "router"
    return None


def _children(pid: int) -> list[psutil.Process]:
    """The node's direct children: its router and fork server are; a worker the fork server
    has just forked still shows the server's command line, but is its grandchild."""
    try:
        return psutil.Process(pid).children()
    except psutil.Error:
        return []


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


class HangsCluster(ProcessCluster):
    """`ProcessCluster` that also applies `PartSignal` faults."""

    def _actions(self, fault: Fault, start: float) -> list[tuple[float, Callable[[], None]]]:
        if isinstance(fault, PartSignal):
            return [(start + fault.at.seconds(self.params),
                     functools.partial(self._part_signal, fault))]
        return super()._actions(fault, start)

    def _part_signal(self, fault: PartSignal) -> None:
        inc = self.current[fault.node]
        pids = [p.pid for p in _children(inc.proc.pid) if _part(p) == fault.part]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, getattr(signal, f"SIG{fault.signal}"))
        self.log("part_signal", node=fault.node, node_id=inc.node_id, part=fault.part,
                 signal=fault.signal, pids=pids)

    def replaced_after(self, name: str, line: int) -> set[str]:
        """Parts node `name` logged `part.replaced` for from its log line `line` on."""
        return {str(ln.get("part")) for ln in list(self.current[name].lines)[line:]
                if ln.get("event") == "part.replaced"}


def _hangs_must(h: dict[str, Any]) -> list[str]:
    ev = h["log"]["process"].get("hangs")
    if ev is None:
        return ["no hangs evidence recorded"]
    out = [f"the stopped {part} (pid {pid}) is still there"
           for part, pids in ev["stopped"].items() for pid in pids if pid in ev["alive"]]
    out += [f"A did not replace its {part}" for part in HANG_PARTS
            if part not in ev["replaced"]]
    out += [f"A charged a recovery attempt: {line}" for line in ev["charged"]]
    runs = _runs(h)
    out += [f"run {r}: {runs[r]['state']} at attempt {runs[r]['attempt']}: "
            f"{runs[r].get('outcome')}" for r in h["log"]["spawned"]
            if runs[r]["state"] != "succeeded" or int(runs[r]["attempt"]) != 1]
    return out


def _hangs_replaced(h: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    ev = h["log"]["process"].get("hangs")
    if ev is None or set(ev["stopped"]) != set(HANG_PARTS) or \
            not all(ev["stopped"].values()):
        return 0
    replaced = [p for p in HANG_PARTS if p in ev["replaced"]]
    return len(replaced) if len(replaced) == len(HANG_PARTS) else 0


def hangs(ctx: ScenarioContext) -> None:
    with HangsCluster(ctx, _workload(ctx)) as cluster:
        cluster.start()
        cluster.await_mid_run()
        a = cluster.current["a"]
        cluster.wait("A to run workers from its fork server",
                     lambda: any(_role(p) == "worker" and _part(p) is None
                                 for p in _tree(a.proc.pid))
                     and set(HANG_PARTS) <= {_part(p) for p in _children(a.proc.pid)},
                     cluster.dwell_s())
        start = len(a.lines)  # nothing was replaced before: every later line is after the stop
        cluster.fault_phase(cluster.now())
        stopped = {str(f["part"]): list(f["pids"]) for f in cluster.logged("part_signal")}
        cluster.wait("A to replace its stopped parts",
                     lambda: set(HANG_PARTS) <= cluster.replaced_after("a", start),
                     cluster.dwell_s())
        cluster.liveness_phase()
        cluster.process["hangs"] = {
            "stopped": stopped,
            "alive": [pid for pids in stopped.values() for pid in pids if not _gone(pid)],
            "replaced": sorted(cluster.replaced_after("a", start)),
            "charged": [f"{ln.get('event')} run {ln.get('run')}: {ln.get('message')}"
                        for ln in list(a.lines) if ln.get("event") in CHARGED]}
        cluster.conclude({"A kills and replaces its stopped router and fork server; every run "
                          "succeeds on its first charged grant; A charges no recovery attempt":
                          _hangs_must})


BODIES.update({
    "hangs": hangs,
    "pause": pause,
    "node_loss": node_loss,
    "kill_finish_committed": kill_finish_committed,
    "kill_finish_uncommitted": kill_finish_uncommitted,
    "db_backends_terminated": db_backends_terminated,
    "db_blips": db_blips,
    "db_restart": db_restart,
    "attempts_exhausted": attempts_exhausted,
    "cancel_while_partitioned": cancel_while_partitioned,
    "graceful_drain": graceful_drain,
})

VACUITY.update({
    "≥ 1 lease_lost(safe_until) after resume": _lost_after_resume,
    "≥ 1 run finished by B after an epoch of A": _finished_by_b_after_a,
    "A had live workers": _a_had_workers,
    "trigger fired": lambda h, f: (_committed_trigger(h, f)
                                   if h["scenario"] == "kill_finish_committed"
                                   else _uncommitted_trigger(h, f)),
    "final epoch = A's + 1": _final_epoch_next,
    "each round ended ≥ 1 live session": _each_round_ended,
    "each burst ended ≥ 1 live session": _each_burst_ended,
    "restart while leases held": _restart_while_held,
    "X had max_attempts grants": _x_grants,
    "≥ 1 cancel applied": _cancel_applied,
    "≥ 1 refunded release": _drain_refunds,
    "A's stopped router and fork server replaced": _hangs_replaced,
})
