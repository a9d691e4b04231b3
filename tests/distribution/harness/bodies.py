"""The tier-2 scenario driver and the bodies of the link scenarios (distribution.md §7.3).

A body is a function of a `ScenarioContext` (runner.py); most are `Plan`s run by `drive`.
`Cluster` is the driver: a body (here, or in another module registering into `BODIES`) opens
one, walks it through its phases and ends with `conclude`. Rules, in phase order:

- Database: every scenario gets its own database, `CREATE DATABASE flyd_s_<hex> TEMPLATE
  <template>` (the pytest session's migrated template; without one, as in the standalone
  runner, an empty database migrated here), dropped at the end whatever happened. A
  `fence_removed` scenario (the canary) then replaces `flyd.assert_fence` and `flyd.fence_row`
  (0002_fence.sql) by no-ops, so no fenced write is ever refused.
- Clock: one `HarnessClock` (row, then file) at `TIME_SCALE` sim seconds per real second; a
  recorder thread keeps (wall time, sim time) pairs so a node line's wall-clock `ts` maps to
  true sim time. Nodes with rate 1 log true time as `t`; for a skewed node (`ClockRate`,
  `--clock-rate r`, which scales sim time elapsed since the node's first reading) the origin is
  fitted as the median over its lines of (true·r − t)/(r − 1), then true = o + (t − o)/r.
- Proxies: one `FaultProxy` per node, all to the scenario database's server; every node
  connection goes through its node's proxy, the harness (admin, clock, samples) never does.
- Nodes (§7.3.1): `python -m flyd serve --dsn <proxied> --socket <tmp>/<n>/bus.sock
  --state-dir <tmp>/<n> --node-name <n> --sim-clock <file> --time-scale <k> [--clock-rate r]
  --log-format json --capacity <c>`, spawned by `ctx.spawn` (own session, scenario marker),
  stderr to `<tmp>/<n>/node-<generation>.log`. A restart is a new generation (new node_id).
  A node is up once its heartbeat was acknowledged; one that exits while starting is started
  again (at most `START_ATTEMPTS` generations), as a service manager would.
- Workload (§7.3.3): `Workload.runs` copies of one synthetic run spec (two agents and the
  arena, process mode, `paceS`, checkpoint every `every` boundaries), submitted through the
  production statement (`PgStore.submit`, keys `<scenario>-<i>`) once every node has
  registered; the spawned set is kept. Reference digests per boundary come from a fault-free
  `flyd run --mode in-process` of the same composition on a database of its own (cached per
  test process and workload).
- Fault phase: `await_mid_run` waits until every node holds a run; `arm_trigger(node, text)`
  sets the node's up link to `hold_on_match(text)` and `await_trigger` returns the sim instant
  its first message was held (the partition scenarios start there, so the partition catches a
  group commit in flight); `fault_phase(start)` applies the schedule at `start + at`: the
  clock is frozen, every action due is applied and logged with its true time, the clock thaws.
  A `LinkFault` with `lasts` is restored (its direction back to pass) at `at + lasts`; the
  phase ends once every fault has been applied and restored.
- Liveness phase: `liveness_phase` heals every link, resumes paused nodes, restarts dead ones,
  logs `final_heal`, and waits until every spawned run is terminal or the L1 bound
  (`l1_bound_s`) has passed in sim time.
- Conclude: every node gets SIGTERM (a drain, nothing is held any more) and up to
  `STOP_S` to exit, then SIGKILL; processes still carrying the marker after `ORPHAN_S` are
  orphans (logged, killed). The record (oracle.py's format: tables in sim seconds, node events
  with `true`, taps, harness log) is judged by `oracle.judge`; `ctx.verdicts` gets the oracle's
  verdicts plus one `vacuity:<fact>` verdict per fact of the scenario's row (`VACUITY`), and
  `ctx.history` / `ctx.judgement` the record and judgement for the replay record. An
  inverted scenario (the canary) passes only if a safety check (S1–S6) is violated.

Decisions where the spec is silent:
- Time scale: 5, not §7.3.1's 20 (runner.TIME_SCALE, which says why): on a loaded 2-CPU host
  the scaled server timeouts and client bounds then rarely fire spuriously, and a node off the
  CPU for 100 ms stays within the oracle's 0.5 s sim slack.
- Runs are short (`Workload`: 80 boundaries, checkpoint every 20, so 4 checkpoints and one
  rotation each) and `paceS` is 0.05: the node paces boundaries in real seconds (the
  coordinator's pacing clock is the system clock), i.e. 0.25 sim s per boundary at scale 5.
- Taps for the oracle: every ErrorResponse becomes `{t, node, op, ok: false, code, run,
  epoch}` (run and epoch read from the fence's message; `op` is `commit_statements` on a work
  connection); COMMITs are not attributed to a (run, epoch), since the tap decodes no Bind
  parameters: S2 rests on the ledger's `recorded_at` within each grant. The raw proxy records
  are kept as `raw_taps` for the vacuity facts.
- Free capacity in samples: capacity minus the runs the database shows owned by the node, for
  a node that is alive and not paused.
- `restore_s` of the L1 bound is `RESTORE_REAL_S` real seconds at the time scale (launching
  three worker processes and restoring a head on a loaded host).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from flyd.leases.migrate import migrate
from flyd.leases.params import LeaseParams
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.session.runspec import RunSpec
from tests.distribution import oracle
from tests.distribution.harness.clock import EPOCH, HarnessClock
from tests.distribution.harness.proxy import (
    PASS,
    FaultProxy,
    HoldOnMatch,
    ProxyHost,
    Upstream,
)
from tests.distribution.harness.runner import (
    BODIES,
    MARKER,
    ROOT,
    RUN_ENV,
    ScenarioContext,
    processes_with_marker,
    read_tables,
)
from tests.distribution.harness.scenarios import (
    CancelRun,
    ClockRate,
    Fault,
    LinkFault,
    NodeSignal,
    OnMatch,
    ServerFault,
    describe_fault,
)
from tests.distribution.harness.taps import TapRecord, role_of

STOP_S: Final = 15.0
ORPHAN_S: Final = 5.0
SAMPLE_S: Final = 0.2
WALL_TICK_S: Final = 0.01
POLL_S: Final = 0.005
RESTORE_REAL_S: Final = 10.0
SLACK_S: Final = 0.5
REGISTER_S: Final = 60.0
START_ATTEMPTS: Final = 3
REFERENCE_S: Final = 120.0
TERMINAL: Final = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True, slots=True)
class Workload:
    """The runs of one scenario (module rules: workload)."""

    runs: int = 6
    boundaries: int = 80
    pace_s: float = 0.05
    every: int = 20
    capacity: int = 3

    def spec(self) -> dict[str, Any]:
        return RunSpec.validate({"steps": str(self.boundaries), "mode": "process",
                                 "paceS": self.pace_s,
                                 "checkpoints": {"everySteps": self.every}}).to_json()

    def longest_run_s(self, time_scale: float, params: LeaseParams) -> float:
        """Sim seconds of one uninterrupted run: paced boundaries and its group commits."""
        commits = self.boundaries // self.every + 1
        return (self.boundaries * self.pace_s * time_scale * (1 + params.clock_rate_bound)
                + commits * params.commit_timeout_s)


# ------------------------------------------------------------------------------------------
# databases


NOOP_FENCE: Final = """
CREATE OR REPLACE FUNCTION flyd.assert_fence(p_run bigint, p_epoch bigint,
                                             p_at_commit boolean DEFAULT false)
RETURNS void LANGUAGE plpgsql AS $$ BEGIN END $$;
CREATE OR REPLACE FUNCTION flyd.fence_row() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN RETURN NEW; END $$;
"""


def _admin(server_dsn: str) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(server_dsn, autocommit=True, connect_timeout=5)


def create_database(server_dsn: str, template: str | None, prefix: str) -> tuple[str, str]:
    """A fresh migrated database (from `template` when given); returns (name, dsn)."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    with _admin(server_dsn) as conn:
        if template is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        else:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)))
    dsn = make_conninfo(server_dsn, dbname=name)
    if template is None:
        try:
            asyncio.run(migrate(dsn))
        except BaseException:
            drop_database(server_dsn, name)
            raise
    return name, dsn


def drop_database(server_dsn: str, name: str) -> None:
    with _admin(server_dsn) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


def sim_seconds(value: object) -> object:
    """A timestamp of the scenario database as sim seconds (the harness clock's timeline)."""
    if isinstance(value, datetime):
        if value.year <= 1 or value.year >= 9999:
            return -1e308 if value.year <= 1 else 1e308
        return (value - EPOCH) / timedelta(seconds=1)
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    return value


def dump_tables(dsn: str) -> dict[str, list[dict[str, Any]]]:
    """The oracle's tables, instants as sim seconds, bytes as hex (no envelopes)."""
    return read_tables(dsn, sim_seconds)


# ------------------------------------------------------------------------------------------
# reference digests


@functools.cache
def _reference(server_dsn: str, template: str | None, workload: Workload) -> tuple[
        tuple[str, str], ...]:
    cache = _reference_file(workload)
    if cache is not None and cache.exists():
        return tuple((str(k), str(d)) for k, d in json.loads(cache.read_text()))
    name, dsn = create_database(server_dsn, template, "flyd_ref")
    home = Path(tempfile.mkdtemp(prefix="flyd-ref-", dir="/tmp"))
    try:
        env = {k: v for k, v in os.environ.items()
               if k not in ("FLYD_SOCKET", "FLYD_DSN", "FLYD_CONFIG", "FLYD_NODE_NAME",
                            "NOTIFY_SOCKET", MARKER)}
        proc = subprocess.run(
            [sys.executable, "-m", "flyd", "run", "--json", "--steps", str(workload.boundaries),
             "--checkpoint-every", str(workload.every), "--mode", "in-process", "--dsn", dsn,
             "--state-dir", str(home), "--socket", str(home / "bus.sock")],
            cwd=ROOT, env=env, capture_output=True, timeout=REFERENCE_S, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"reference run failed ({proc.returncode}): "
                               f"{proc.stderr.decode(errors='replace')[-2000:]}")
        run = int(json.loads(proc.stdout)["run"])
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute("SELECT effect_key, payload_digest FROM flyd.effects "
                                "WHERE run_id = %s AND boundary IS NOT NULL "
                                "ORDER BY boundary", (run,)).fetchall()
    finally:
        shutil.rmtree(home, ignore_errors=True)
        drop_database(server_dsn, name)
    if len(rows) != workload.boundaries:
        raise RuntimeError(f"reference run recorded {len(rows)} boundaries, "
                           f"expected {workload.boundaries}")
    digests = tuple((str(k), bytes(d).hex()) for k, d in rows)
    if cache is not None:
        part = cache.with_suffix(f".{os.getpid()}")
        part.write_text(json.dumps(digests))
        part.replace(cache)
    return digests


def _reference_file(workload: Workload) -> Path | None:
    """Within one test run (`RUN_ENV`: the run's inventory directory), every process shares
    the reference digests through a file there."""
    run = os.environ.get(RUN_ENV)
    if not run or not Path(run).is_dir():
        return None
    return Path(run) / f"reference-{workload.boundaries}-{workload.every}.json"


def reference_digests(server_dsn: str, template: str | None,
                      workload: Workload) -> dict[str, str]:
    """Digest (hex) of every boundary effect of a fault-free run of the workload's spec."""
    return dict(_reference(server_dsn, template, workload))


# ------------------------------------------------------------------------------------------
# time


class WallMap:
    """(wall time, sim time) pairs sampled every `WALL_TICK_S`: true sim time of a log line."""

    def __init__(self, clock: HarnessClock) -> None:
        self._clock = clock
        self._wall: list[float] = []
        self._sim: list[float] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="wall-map", daemon=True)

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._wall.append(time.time())
                self._sim.append(self._clock.now())
            if self._stop.wait(WALL_TICK_S):
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def sim_at(self, wall: float) -> float:
        with self._lock:
            i = bisect.bisect_left(self._wall, wall)
            if i <= 0:
                return self._sim[0]
            if i >= len(self._wall):
                return self._sim[-1]
            w0, w1, s0, s1 = self._wall[i - 1], self._wall[i], self._sim[i - 1], self._sim[i]
        return s0 if w1 <= w0 else s0 + (s1 - s0) * (wall - w0) / (w1 - w0)


# ------------------------------------------------------------------------------------------
# nodes


@dataclass
class Incarnation:
    """One `flyd serve` process of a node name (a restart is a new one)."""

    name: str
    generation: int
    proc: subprocess.Popen[bytes]
    log: Path
    rate: float
    start_true: float
    node_id: str | None = None
    origin: float | None = None
    end: tuple[float, str] | None = None
    pauses: list[list[float | None]] = field(default_factory=list)
    lines: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0

    @property
    def paused(self) -> bool:
        return bool(self.pauses) and self.pauses[-1][1] is None

    @property
    def alive(self) -> bool:
        return self.end is None and self.proc.poll() is None

    def read(self) -> list[dict[str, Any]]:
        """New JSON lines of the log (a partial last line waits for the next read)."""
        try:
            with self.log.open("rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return []
        cut = data.rfind(b"\n") + 1
        self._offset += cut
        new = []
        for raw in data[:cut].splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict):
                new.append(line)
                if self.node_id is None and isinstance(line.get("node"), str) \
                        and line["node"].startswith(f"{self.name}-"):
                    self.node_id = line["node"]
        self.lines.extend(new)
        return new


def _wall(ts: object) -> float | None:
    if not isinstance(ts, str):
        return None
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def node_events(inc: Incarnation, wall: WallMap) -> list[dict[str, Any]]:
    """The runtime events of one incarnation with their true sim time (module rules)."""
    events = [dict(line) for line in inc.lines
              if isinstance(line.get("t"), int | float) and line.get("node") == inc.node_id
              and isinstance(line.get("event"), str)]
    if inc.rate == 1.0:
        for ev in events:
            ev["true"] = float(ev["t"])
        return events
    origins = []
    for ev in events:
        w = _wall(ev.get("ts"))
        if w is not None:
            origins.append((wall.sim_at(w) * inc.rate - float(ev["t"])) / (inc.rate - 1))
    origin = statistics.median(origins) if origins else inc.start_true
    for ev in events:
        ev["true"] = origin + (float(ev["t"]) - origin) / inc.rate
    inc.origin = origin
    return events


def local_time(inc: Incarnation, true: float) -> float:
    """The node's clock reading at true sim time `true`."""
    if inc.rate == 1.0:
        return true
    origin = inc.origin if inc.origin is not None else inc.start_true
    return origin + (true - origin) * inc.rate


# ------------------------------------------------------------------------------------------
# the cluster


class Cluster:
    """One scenario's database, clock, proxies, nodes and history (module rules)."""

    def __init__(self, ctx: ScenarioContext, workload: Workload) -> None:
        if ctx.dsn is None:
            raise RuntimeError("a tier-2 scenario needs a PostgreSQL server (FLYD_TEST_DSN)")
        self.ctx = ctx
        self.server_dsn = ctx.dsn
        self.workload = workload
        self.params = ctx.params
        self.scale = ctx.time_scale
        self.rates = {f.node: 1 + f.skew * self.params.clock_rate_bound
                      for f in ctx.schedule if isinstance(f, ClockRate)}
        self.tmp = Path(tempfile.mkdtemp(prefix="flyd-s-", dir="/tmp"))
        self.db_name: str | None = None
        self.dsn = ""
        self.clock: HarnessClock | None = None
        self.wall: WallMap | None = None
        self.host: ProxyHost | None = None
        self.incarnations: list[Incarnation] = []
        self.current: dict[str, Incarnation] = {}
        self.spawned: list[int] = []
        self.samples: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.orphans: list[str] = []
        self.final_heal: float | None = None
        self.reference: dict[str, str] = {}
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, name="cluster-monitor",
                                         daemon=True)
        self._stack = contextlib.ExitStack()

    # -- lifetime --------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        try:
            self._open()
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _open(self) -> None:
        ctx = self.ctx
        self._phase("setup")
        self.reference = reference_digests(self.server_dsn, ctx.template, self.workload)
        self.db_name, self.dsn = create_database(self.server_dsn, ctx.template, "flyd_s")
        if ctx.scenario.fence_removed:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                conn.execute(NOOP_FENCE)  # type: ignore[arg-type]
        ctx.dsn = self.dsn
        self.clock = self._stack.enter_context(
            HarnessClock(self.dsn, self.tmp / "clock", time_scale=self.scale))
        ctx.sim_now = self.clock.now
        self.wall = WallMap(self.clock)
        self.wall.start()
        self.host = self._stack.enter_context(
            ProxyHost(now=self.clock.now, time_scale=self.scale, seed=ctx.seed))
        ctx.tap = self.host.tap
        upstream = Upstream.from_dsn(self.dsn)
        for i in range(ctx.scenario.nodes):
            self.host.add(chr(ord("a") + i), upstream)
        self._monitor.start()

    def _close(self) -> None:
        self._phase("teardown")
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(5.0)
        for inc in self.incarnations:
            if inc.proc.poll() is None:
                inc.proc.kill()
                inc.proc.wait(5.0)
        if self.wall is not None:
            self.wall.stop()
        self._stack.close()
        if self.db_name is not None:
            drop_database(self.server_dsn, self.db_name)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- accessors -------------------------------------------------------------------------

    def now(self) -> float:
        assert self.clock is not None
        return self.clock.now()

    def _phase(self, name: str) -> None:
        self.ctx.phase = name
        self.ctx.log_event("phase", phase=name)

    def proxy(self, node: str) -> FaultProxy:
        assert self.host is not None
        return self.host.proxies[node]

    def node_names(self) -> list[str]:
        return sorted(self.current)

    def query(self, text: str, *args: object) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(text, args).fetchall()  # type: ignore[arg-type]

    def wait(self, what: str, done: Callable[[], bool], sim_s: float) -> None:
        """Poll `done` until true; fail naming `what` after `sim_s` sim seconds (the wall
        budget still bounds everything)."""
        deadline = self.now() + sim_s
        while not done():
            if self.now() > deadline:
                raise AssertionError(f"timed out after {sim_s:g} sim s waiting for {what}")
            self.ctx.sleep(0.05)

    def log(self, kind: str, **detail: Any) -> dict[str, Any]:
        entry = {"true": self.now(), "kind": kind, **detail}
        self.faults.append(entry)
        self.ctx.fault_log.append(entry)
        return entry

    @contextlib.contextmanager
    def frozen(self) -> Iterator[float]:
        """The clock stopped: faults applied inside happen at one sim instant."""
        assert self.clock is not None
        self.clock.freeze()
        try:
            yield self.clock.now()
        finally:
            self.clock.thaw()

    # -- nodes -----------------------------------------------------------------------------

    def spawn(self, name: str) -> Incarnation:
        """Start node `name` (a new generation if it ran before) through its proxy."""
        generation = 1 + sum(1 for i in self.incarnations if i.name == name)
        home = self.tmp / name
        home.mkdir(exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (home / "bus.sock").unlink()
        rate = self.rates.get(name, 1.0)
        argv = [sys.executable, "-m", "flyd", "serve", "--dsn", self.proxy(name).dsn(self.dsn),
                "--socket", str(home / "bus.sock"), "--state-dir", str(home),
                "--node-name", name, "--sim-clock", str(self.tmp / "clock"),
                "--time-scale", f"{self.scale:g}"]
        if rate != 1.0:
            argv += ["--clock-rate", f"{rate:g}"]
        # -v: debug, for the heartbeat and write events the oracle reads from the log
        argv += ["--log-format", "json", "-v", "--capacity", str(self.workload.capacity)]
        config = self.tmp / "leases.toml"
        text = self.ctx.scenario.node_config
        if self.params.kill_bound_s != LeaseParams().kill_bound_s:
            text += f"[leases]\nkill_bound_s = {self.params.kill_bound_s!r}\n"
        if text:
            config.write_text(text)
            argv += ["--config", str(config)]
        env = {k: v for k, v in os.environ.items()
               if k not in ("FLYD_SOCKET", "FLYD_DSN", "FLYD_CONFIG", "FLYD_NODE_NAME",
                            "NOTIFY_SOCKET")}
        log = home / f"node-{generation}.log"
        proc = self.ctx.spawn(name, argv, env=env, log=log)
        inc = Incarnation(name, generation, proc, log, rate, self.now())
        self.incarnations.append(inc)
        self.current[name] = inc
        return inc

    def start(self) -> None:
        """Every node up (its heartbeat acknowledged), then the workload submitted."""
        self._phase("start")
        for i in range(self.ctx.scenario.nodes):
            self.spawn(chr(ord("a") + i))
        self.wait("every node to start", self._started, REGISTER_S * self.scale)
        self.submit()

    def _started(self) -> bool:
        """Every current node alive with an acknowledged renewal. A node that exited while
        starting (its first registration, bounded by R, can time out on a loaded host) is
        started again, as a service manager would, at most `START_ATTEMPTS` times."""
        for name, inc in list(self.current.items()):
            if inc.proc.poll() is None:
                continue
            if inc.generation >= START_ATTEMPTS:
                raise AssertionError(f"node {name} exited with {inc.proc.returncode} at "
                                     f"start {inc.generation} times: {self._tail(inc)}")
            inc.end = (self.now(), "start_failed")
            self.log("start_failed", node=name, node_id=inc.node_id,
                     exit_code=inc.proc.returncode)
            self.spawn(name)
        return all(any(ln.get("event") == "renewed" for ln in inc.lines)
                   for inc in self.current.values())

    @staticmethod
    def _tail(inc: Incarnation) -> str:
        try:
            return inc.log.read_text(errors="replace")[-1500:]
        except OSError:
            return ""

    def submit(self) -> None:
        spec = self.workload.spec()
        sid = self.ctx.scenario.id

        async def go() -> list[int]:
            async with PgStore(self.dsn, "harness", DbSettings(), self.params) as store:
                return [(await store.submit(f"{sid}-{i}", spec, self.params.max_attempts)).run_id
                        for i in range(self.workload.runs)]

        self.spawned = asyncio.run(go())
        self.ctx.log_event("submitted", runs=self.spawned)

    def held_by(self) -> dict[str, list[int]]:
        """Runs the database shows `running` per node name (current incarnations)."""
        owners = {inc.node_id: name for name, inc in self.current.items()}
        out: dict[str, list[int]] = {name: [] for name in self.current}
        for run_id, owner in self.query("SELECT run_id, owner_node FROM flyd.runs "
                                        "WHERE state = 'running' ORDER BY run_id"):
            if owner in owners:
                out[owners[owner]].append(int(run_id))
        return out

    def await_mid_run(self) -> None:
        """Until every node holds a run (the fault phase starts mid-run)."""
        self.wait("every node to hold a run",
                  lambda: all(self.held_by().values()), REGISTER_S * self.scale)

    # -- faults ----------------------------------------------------------------------------

    def arm_trigger(self, node: str, text: str) -> None:
        """Hold `node`'s up link from the first message containing `text` on."""
        self.proxy(node).set("up", HoldOnMatch(text))
        self.log("trigger_armed", node=node, text=text)

    def await_trigger(self, node: str, text: str, sim_s: float) -> float:
        """The sim instant a message of `node` containing `text` was first held."""
        assert self.host is not None
        found: list[TapRecord] = []

        def held() -> bool:
            found.extend(r for r in self.host.tap.records()  # type: ignore[union-attr]
                         if r.node == node and r.direction == "up" and r.fate == "held"
                         and r.kind in ("query", "parse") and text in str(r.detail.get("text")))
            return bool(found)

        self.wait(f"node {node} to send {text!r}", held, sim_s)
        self.log("trigger_fired", node=node, text=text, conn=found[0].conn,
                 role=found[0].role, held_at=found[0].sim_time)
        return self.now()

    def fault_phase(self, start: float) -> None:
        """Apply the schedule at `start + at` (module rules); returns when every fault has
        been applied and every timed link fault restored."""
        self._phase("fault")
        self.log("fault_phase", start=start)
        pending: list[tuple[float, int, Callable[[], None]]] = []
        watches: list[tuple[OnMatch, int]] = []
        order = 0
        for fault in self.ctx.schedule:
            if isinstance(fault, ClockRate):
                continue
            if isinstance(fault, OnMatch):
                watches.append((fault, 0))
                continue
            for at, action in self._actions(fault, start):
                order += 1
                pending.append((at, order, action))
        while pending or watches:
            self.ctx.check()
            now = self.now()
            due = sorted(p for p in pending if p[0] <= now)
            if due:
                with self.frozen():
                    for item in due:
                        item[2]()
                        pending.remove(item)
            for i, (watch, seen) in enumerate(list(watches)):
                hit, seen = self._matched(watch, seen)
                watches[i] = (watch, seen)
                if hit is not None:
                    watches.remove((watch, seen))
                    self.log("on_match", node=watch.node, text=watch.text, at_match=hit)
                    for f in watch.then:
                        for at, action in self._actions(f, hit):
                            order += 1
                            pending.append((at, order, action))
            if not due:
                time.sleep(POLL_S)

    def _matched(self, watch: OnMatch, seen: int) -> tuple[float | None, int]:
        assert self.host is not None
        records = self.host.tap.records()
        for r in records[seen:]:
            if r.node == watch.node and r.direction == watch.direction and \
                    watch.text in str(r.detail.get("text", "")):
                return r.sim_time, len(records)
        return None, len(records)

    def _actions(self, fault: Fault, start: float) -> list[tuple[float, Callable[[], None]]]:
        params = self.params
        if isinstance(fault, LinkFault):
            at = start + fault.at.seconds(params)
            out = [(at, functools.partial(self._link, fault, fault.mode))]
            if fault.lasts is not None:
                out.append((at + fault.lasts.seconds(params),
                            functools.partial(self._link, fault, PASS)))
            return out
        if isinstance(fault, NodeSignal):
            return [(start + fault.at.seconds(params), functools.partial(self._signal, fault))]
        if isinstance(fault, ServerFault):
            return [(start + fault.at.seconds(params), functools.partial(self._server, fault))]
        if isinstance(fault, CancelRun):
            return [(start + fault.at.seconds(params), functools.partial(self._cancel, fault))]
        raise TypeError(f"no action for {fault!r}")

    def _link(self, fault: LinkFault, mode: Any) -> None:
        self.proxy(fault.node).set(fault.direction, mode, fault.role)
        kind = "link" if mode is fault.mode else "heal"
        self.log(kind, node=fault.node, dir=fault.direction, mode=mode.label(),
                 role=fault.role)

    def _signal(self, fault: NodeSignal) -> None:
        inc = self.current[fault.node]
        if not inc.alive:
            self.log("signal_skipped", node=fault.node, signal=fault.signal)
            return
        now = self.now()
        os.kill(inc.proc.pid, getattr(signal, f"SIG{fault.signal}"))
        if fault.signal == "KILL":
            inc.end = (now, "kill")
        elif fault.signal == "STOP":
            inc.pauses.append([now, None])
        elif fault.signal == "CONT" and inc.paused:
            inc.pauses[-1][1] = now
        self.log("signal", node=fault.node, node_id=inc.node_id, signal=fault.signal,
                 pid=inc.proc.pid)
        if fault.signal == "KILL" and fault.restart:
            self.spawn(fault.node)

    def _server(self, fault: ServerFault) -> None:
        if fault.kind != "terminate_backends":
            raise NotImplementedError(f"server fault {fault.kind}")
        rows = self.query("SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)), "
                          "count(*) FILTER (WHERE state <> 'idle') "
                          "FROM pg_stat_activity WHERE datname = current_database() "
                          "AND application_name LIKE 'flyd:%%'")
        self.log("backend_kill", ended=int(rows[0][0]), busy=int(rows[0][1]),
                 burst=fault.burst)

    def _cancel(self, fault: CancelRun) -> None:
        held = self.held_by().get(fault.node, [])
        if not held:
            self.log("cancel", node=fault.node, run_id=None, result=None)
            return

        async def go() -> str | None:
            async with PgStore(self.dsn, "harness", DbSettings(), self.params) as store:
                got = await store.cancel(held[0], "harness")
                return None if got is None else got.state

        self.log("cancel", node=fault.node, run_id=held[0], result=asyncio.run(go()))

    # -- liveness --------------------------------------------------------------------------

    def liveness_phase(self) -> None:
        """Heal, resume, restart; then until every run is terminal or the L1 bound passed."""
        with self.frozen() as now:
            self._phase("liveness")
            for name in self.node_names():
                self.proxy(name).heal()
                inc = self.current[name]
                if inc.paused and inc.alive:
                    os.kill(inc.proc.pid, signal.SIGCONT)
                    inc.pauses[-1][1] = now
                if not inc.alive:
                    self.spawn(name)
            self.final_heal = now
            self.log("final_heal")
        bound = self.l1_bound()
        deadline = now + bound
        while not self._all_terminal():
            if self.now() > deadline:
                break
            self.ctx.sleep(0.1)

    def _all_terminal(self) -> bool:
        rows = self.query("SELECT count(*) FROM flyd.runs WHERE state IN "
                          "('succeeded', 'failed', 'cancelled')")
        return int(rows[0][0]) == len(self.spawned)

    def l1_bound(self) -> float:
        p = self.params
        return (p.T + 2 * p.claim_poll_s * 1.2 + p.reap_interval_s * 1.2 + p.max_attempts
                * (self.workload.longest_run_s(self.scale, p) + RESTORE_REAL_S * self.scale))

    # -- monitoring ------------------------------------------------------------------------

    def _watch(self) -> None:
        """Samples for L2/S4 and the progress line's node state, every `SAMPLE_S`."""
        while not self._stop.wait(SAMPLE_S):
            for inc in list(self.incarnations):
                new = inc.read()
                state = self.ctx.nodes.get(inc.name)
                if new and state is not None and self.current.get(inc.name) is inc:
                    events = [ln for ln in new if "t" in ln and "event" in ln]
                    if events:
                        state.last_event = str(events[-1]["event"])
            if self.spawned:
                with contextlib.suppress(psycopg.Error):
                    self._sample()

    def _sample(self) -> None:
        t = self.now()
        rows = self.query("SELECT run_id, state::text, lease_expires_at, attempt, owner_node "
                          "FROM flyd.runs ORDER BY run_id")
        owned = Counter(str(r[4]) for r in rows if r[1] == "running")
        free = [[inc.node_id, self.workload.capacity - owned.get(str(inc.node_id), 0)]
                for inc in list(self.current.values())
                if inc.alive and not inc.paused and inc.node_id is not None]
        self.samples.append({"true": t, "runs": [[int(r[0]), r[1], sim_seconds(r[2]),
                                                  int(r[3])] for r in rows], "free": free})
        for inc in self.current.values():
            state = self.ctx.nodes.get(inc.name)
            if state is not None:
                state.holds = [{"run": int(r[0]), "state": r[1]} for r in rows
                               if r[4] == inc.node_id]

    # -- the end ---------------------------------------------------------------------------

    def stop_nodes(self) -> None:
        """SIGTERM every live node, SIGKILL after `STOP_S`; then the orphan check (L4)."""
        self._phase("stop")
        for inc in self.incarnations:
            if inc.alive:
                if inc.paused:
                    os.kill(inc.proc.pid, signal.SIGCONT)
                    inc.pauses[-1][1] = self.now()
                inc.proc.send_signal(signal.SIGTERM)
        for inc in self.incarnations:
            if inc.end is None:
                try:
                    inc.proc.wait(STOP_S)
                except subprocess.TimeoutExpired:
                    inc.proc.kill()
                    inc.proc.wait(5.0)
                inc.end = (self.now(), "stop")
        deadline = time.monotonic() + ORPHAN_S
        while processes_with_marker(self.ctx.scenario.id) and time.monotonic() < deadline:
            self.ctx.sleep(0.1)
        for proc in processes_with_marker(self.ctx.scenario.id):
            with contextlib.suppress(Exception):
                self.orphans.append(f"{proc.pid} {' '.join(proc.cmdline())[:200]}")
                proc.kill()
        for inc in self.incarnations:
            inc.read()

    def record(self) -> dict[str, Any]:
        """The oracle's history record (oracle.py's module docstring)."""
        assert self.wall is not None and self.host is not None
        p = self.params
        events: list[dict[str, Any]] = []
        nodes = []
        for inc in self.incarnations:
            evs = node_events(inc, self.wall)
            events.extend(evs)
            end = None if inc.end is None else [inc.end[0], local_time(inc, inc.end[0])]
            nodes.append({
                "node_id": inc.node_id or f"{inc.name}-unregistered-{inc.generation}",
                "name": inc.name, "generation": inc.generation, "pid": inc.proc.pid,
                "rate": inc.rate, "start": [inc.start_true, local_time(inc, inc.start_true)],
                "end": end, "how": None if inc.end is None else inc.end[1],
                "exit_code": inc.proc.returncode,
                "pauses": [[p0, p1, local_time(inc, p0 or 0.0),
                            None if p1 is None else local_time(inc, p1)]
                           for p0, p1 in inc.pauses]})
        events.sort(key=lambda e: (e["true"], e["node"]))
        for seq, ev in enumerate(events):
            ev["seq"] = seq
        raw = [r.to_json() for r in self.host.tap.records()]
        params = dataclasses.asdict(p)
        params.update({"T": p.T, "H": p.H, "G": p.G, "R": p.R, "time_scale": self.scale})
        return {
            "tier": 2, "scenario": self.ctx.scenario.id, "seed": self.ctx.seed,
            "params": params, "tables": dump_tables(self.dsn), "events": events,
            "taps": oracle_taps(raw), "raw_taps": raw,
            "log": {
                "spawned": list(self.spawned), "faults": self.faults,
                "schedule": [describe_fault(f, p) for f in self.ctx.schedule],
                "nodes": nodes, "kills": [], "samples": self.samples,
                "final_heal": self.final_heal, "operator": [], "orphans": self.orphans,
                "reference": {str(r): self.reference for r in self.spawned},
                "longest_run_s": self.workload.longest_run_s(self.scale, p),
                "restore_s": RESTORE_REAL_S * self.scale, "l1_bound_s": self.l1_bound(),
                "end": self.now(), "stats": {}, "slack_s": SLACK_S,
            },
            "vacuity": [ORACLE_FACTS[v] for v in self.ctx.scenario.vacuity
                        if v in ORACLE_FACTS],
        }

    def conclude(self, extra: Mapping[str, Callable[[dict[str, Any]], list[str]]]
                 | None = None) -> oracle.Judgement:
        """Stop the nodes, judge the history and fill the context's verdicts (module rules).

        `extra` maps a must-hold name to a check returning violations (empty: it holds)."""
        self.stop_nodes()
        self._phase("judge")
        history = self.record()
        self.ctx.history = history
        judgement = oracle.judge(history)
        verdicts = list(judgement.verdicts)
        for name, check in (extra or {}).items():
            v = oracle.Verdict(f"must:{name}")
            for line in check(history):
                v.fail(line)
            verdicts.append(v)
        facts = dict(judgement.facts)
        if self.ctx.scenario.inverted:
            safety = [v for v in verdicts if v.check in ("S1", "S2", "S3", "S4", "S5", "S6")
                      and not v.ok]
            canary = oracle.Verdict("canary: the oracle reports a violation")
            if not safety:
                canary.fail("no safety check failed: the oracle is blind to a fence removal")
            for v in safety:
                canary.evidence.append(f"{v.check}: {v.evidence[0] if v.evidence else ''}")
            self.ctx.judgement = {**judgement.as_dict(), "inverted": True}
            self.ctx.verdicts = [canary.as_dict()]
            return judgement
        for text in self.ctx.scenario.vacuity:
            count = vacuity_fact(text, history, facts)
            facts[text] = count
            v = oracle.Verdict(f"vacuity:{text}")
            if count <= 0:
                v.fail(f"fault did not bite: {text}")
            verdicts.append(v)
        for text in self.ctx.scenario.observed:
            count = vacuity_fact(text, history, facts)
            facts[text] = count
            verdicts.append(oracle.Verdict(f"observed:{text}", evidence=[
                f"{count} (reported, not required: scenarios.py rules)"]))
        judgement = oracle.Judgement(verdicts, facts)
        self.ctx.judgement = judgement.as_dict()
        self.ctx.verdicts = [v.as_dict() for v in verdicts]
        return judgement


# ------------------------------------------------------------------------------------------
# taps and vacuity facts


def _fence_target(message: str) -> tuple[int | None, int | None]:
    """`fenced: run <r> epoch <e> (...)` → (r, e)."""
    words = message.split()
    try:
        return int(words[words.index("run") + 1]), int(words[words.index("epoch") + 1])
    except (ValueError, IndexError):
        return None, None


def oracle_taps(raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every ErrorResponse as the oracle's tap row (module rules)."""
    node_ids: dict[tuple[str, int], str] = {}
    out = []
    for r in raw:
        if r["kind"] == "startup":
            app = str(r["detail"].get("application_name", ""))
            if role_of(app) is not None:
                node_ids[(r["node"], r["conn"])] = app.split(":")[1]
        if r["kind"] != "error":
            continue
        detail = r["detail"]
        run, epoch = _fence_target(str(detail.get("message", "")))
        out.append({"t": r["t"], "node": node_ids.get((r["node"], r["conn"]), r["node"]),
                    "name": r["node"], "role": r["role"], "conn": r["conn"],
                    "op": "commit_statements" if r["role"] == "work" else "statement",
                    "ok": False, "code": detail.get("sqlstate"),
                    "constraint": detail.get("constraint"), "fate": r["fate"],
                    "run": run, "epoch": epoch})
    return out


ORACLE_FACTS: Final = {"≥ 1 reclaim": "reclaim"}


def _heal_of(history: Mapping[str, Any], node: str) -> float | None:
    for f in history["log"]["faults"]:
        if f["kind"] in ("heal", "final_heal") and f.get("node", node) == node:
            return float(f["true"])
    return None


def _fault_start(history: Mapping[str, Any], node: str) -> float | None:
    for f in history["log"]["faults"]:
        if f["kind"] == "link" and f.get("node") == node:
            return float(f["true"])
    return None


def _name(node_id: str) -> str:
    return node_id.rsplit("-", 1)[0]


def _rotations(history: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    """The fewest rotated checkpoint generations of any run (≥ 1: every run rotated)."""
    tables = history["tables"]
    kept: dict[int, set[str]] = defaultdict(set)
    for c in tables["checkpoints"]:
        kept[c["run_id"]].add(c["checkpoint_id"])
    committed: dict[int, set[str]] = defaultdict(set)
    for e in tables["effects"]:
        if e["checkpoint_id"] is not None:
            committed[e["run_id"]].add(e["checkpoint_id"])
    spawned = history["log"]["spawned"]
    return min((len(committed[r] - kept[r]) for r in spawned), default=0)


def _lf001_after_heal(history: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    heal = _heal_of(history, "a")
    return sum(1 for t in history["taps"] if t["name"] == "a" and t["code"] == "LF001"
               and heal is not None and t["t"] >= heal)


def _write_cut(history: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    start, heal = _fault_start(history, "a"), _heal_of(history, "a")
    if start is None or heal is None:
        return 0
    return sum(1 for e in history["events"] if _name(e["node"]) == "a"
               and e["event"] == "write_result" and e.get("result") in ("failed", "unknown")
               and start <= e["true"] <= heal)


def _renew_unacknowledged(history: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    """Renewals of A the server executed whose reply the link dropped."""
    return sum(1 for r in history["raw_taps"] if r["node"] == "a" and r["role"] == "heartbeat"
               and r["dir"] == "down" and r["kind"] == "complete" and r["fate"] == "dropped"
               and str(r["detail"].get("tag", "")).startswith("UPDATE"))


def _late_renewal(history: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    """Acknowledged renewals that reached a hold ≥ 0.7·G after the send time its safe_until
    rested on (the claim's or the previous acknowledged renewal's): close to self-fencing."""
    gap = 0.7 * float(history["params"]["G"])
    last: dict[tuple[str, int, int], float] = {}
    count = 0
    for e in history["events"]:
        if e["event"] == "claimed":
            last[(e["node"], e["run"], e["epoch"])] = float(e["t"])
        elif e["event"] == "renewed":
            for run, epoch in e.get("runs", []):
                key = (e["node"], run, epoch)
                if key in last and float(e["t"]) - last[key] >= gap:
                    count += 1
                last[key] = float(e["t_send"])
    return count


def _abandoned_renewals(history: Mapping[str, Any], _facts: Mapping[str, int]) -> int:
    return sum(1 for e in history["events"] if e["event"] == "renew_unknown")


VACUITY: Final[dict[str, Callable[[Mapping[str, Any], Mapping[str, int]], int]]] = {
    "≥ 1 rotation per run": _rotations,
    "≥ 1 LF001 tapped for A after heal": _lf001_after_heal,
    "≥ 1 A write cut by reset": _write_cut,
    "≥ 1 renew tapped as executed for A after its last acknowledged one":
        _renew_unacknowledged,
    "≥ 1 acknowledged renewal with gap ≥ 0.7·G": _late_renewal,
    "≥ 1 abandoned renewal": _abandoned_renewals,
}


def vacuity_fact(text: str, history: Mapping[str, Any], facts: Mapping[str, int]) -> int:
    """How often the row's vacuity fact `text` happened (0: the fault did not bite)."""
    if text in ORACLE_FACTS:
        return int(facts.get(ORACLE_FACTS[text], 0))
    if text not in VACUITY:
        raise KeyError(f"no vacuity check for {text!r}")
    return VACUITY[text](history, facts)


# ------------------------------------------------------------------------------------------
# the bodies of the link scenarios


def _one_grant_each(history: Mapping[str, Any]) -> list[str]:
    """Every run succeeded under exactly one executed grant. A grant no node ever saw (an
    unknown claim outcome, released with refund by the claimer's own-grant sweep, §3.9) was
    never executed and does not count: a slow claim reply under load is not a fault."""
    claimed = {(e["run"], e["epoch"]) for e in history["events"] if e["event"] == "claimed"}
    swept = {(e["run"], e["epoch"]) for e in history["events"]
             if e["event"] == "released" and e.get("kind") == "sweep"}
    executed: Counter[int] = Counter()
    out = []
    for a in history["tables"]["run_attempts"]:
        key = (a["run_id"], a["lease_epoch"])
        if key in claimed:
            executed[a["run_id"]] += 1
        elif key not in swept or a["end_reason"] != "released":
            out.append(f"run {key[0]}: grant {key[1]} neither claimed nor swept "
                       f"({a['end_reason']})")
    states = {r["run_id"]: r["state"] for r in history["tables"]["runs"]}
    out += [f"run {run}: {executed.get(run, 0)} executed grants, {states.get(run)}"
            for run in history["log"]["spawned"]
            if executed.get(run, 0) != 1 or states.get(run) != "succeeded"]
    return out


@dataclass(frozen=True)
class Plan:
    """A link scenario: its workload, the trigger that starts its fault phase (node, text;
    None: as soon as every node holds a run) and its must-hold checks beyond the oracle's."""

    workload: Workload = Workload()
    trigger: tuple[str, str] | None = None
    must: Mapping[str, Callable[[dict[str, Any]], list[str]]] = field(default_factory=dict)

    def __call__(self, ctx: ScenarioContext) -> None:
        workload = dataclasses.replace(self.workload, runs=ctx.scenario.runs)
        with Cluster(ctx, workload) as cluster:
            cluster.start()
            cluster.await_mid_run()
            if self.trigger is None:
                start = cluster.now()
            else:
                node, text = self.trigger
                cluster.arm_trigger(node, text)
                start = cluster.await_trigger(node, text, 6 * workload.every * workload.pace_s
                                              * cluster.scale + 3 * ctx.params.T)
            cluster.fault_phase(start)
            cluster.liveness_phase()
            cluster.conclude(self.must)


#: A group commit's pipeline starts with BEGIN: a partition armed on it catches one in flight.
IN_FLIGHT: Final = ("a", "BEGIN")

BODIES.update({
    "baseline": Plan(must={"all succeed, one grant each": _one_grant_each}),
    "partition_hold": Plan(trigger=IN_FLIGHT),
    "partition_drop": Plan(trigger=IN_FLIGHT),
    "partition_reset": Plan(trigger=IN_FLIGHT),
    "asymmetric": Plan(),
    "latency_near_ttl": Plan(),
    "clock_skew": Plan(),
    "swizzle": Plan(),
    "canary_fence_removed": Plan(trigger=IN_FLIGHT),
})

