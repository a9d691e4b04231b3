"""Soak: many consecutive sessions on one long-lived `flyd serve` node, then sessions with a
worker SIGKILLed at a random step; nothing may grow and nothing may be left behind.

Why a long-lived node: the node, its router child and its connections persist across runs, so a
leak per session (a file descriptor, a thread, a child process, memory, a socket or temp file)
accumulates where it can be measured. Runs are queued with the production submit statement
(`PgStore.submit`, as `flyctl runs submit` does) and claimed by the node; one run at a time.

Phases (`--sessions` clean ones, then `--kill-sessions` with a kill):
- clean: the run spec of `--steps` transitions in process mode, a checkpoint every
  `--checkpoint-every` steps, unpaced.
- kill: the same spec paced at `--pace-s` per step (pacing is not behaviour: the digest is the
  same), and once the run's live boundary (`Control.Status` of the node, polled over the bus as a
  `ctl-*` client) reaches a random step K in `1 .. steps - 10`, one random worker (fly-a, fly-b
  or arena) is SIGKILLed by its pid. The kill is proven: the pid is gone, and the run's outcome
  counts a recovery.

Media sessions (every `--media-every`-th session of either phase, 0: none): the arena renders
256×256 views, so every view travels as an artifact of the router's store (docs/topics.md §14.2),
through recoveries too. Their reference digest is the first clean media session's.

Every session must end `succeeded`, with its ledger (`flyd.effects`) holding `boundary-1..N` and
`finish` each exactly once and the `behaviourDigest` of the first clean session of its kind.

Sampling (psutil), after each session once the node is idle again (its only child is the
router: the session's workers were reaped; bounded wait, a worker left behind is a violation):
the node's and the router's open fds, threads and RSS, and the node's descendants. Growth
criteria, over the samples after the warm-up (`--warmup`, default a tenth of all sessions, at
least 10: pools, caches and the allocator's arenas settle there; the node's RSS climbs for
about the first ten sessions, then stays flat):
- fds and threads of node and router: the median of the last tenth of the samples (at least
  three) is not above the median of the first tenth (medians absorb a sample taken while a
  connection was still closing; a leak of one per session still shows as growth);
- RSS of node and router: the last tenth's median is within `--rss-tolerance` (10 %) of the
  first tenth's (allocator noise, no steady growth);
- processes: every idle sample shows no descendant of the node but its router and its fork
  server (once a process session started it), and no zombie; the router and the fork server
  keep their pids (a kill of a worker never takes either down);
- the artifact store: every idle sample shows no artifact, zero store bytes and no file in the
  store directory (`bus.stats` of the router, read as a `ctl-*` client), and the media
  sessions did allocate artifacts (`artifactsAllocated` grew).
Leftovers: the node runs with a private `TMPDIR`; its state dir, socket dir and `TMPDIR` hold
the same entries at the end as after the warm-up, and after the node's drain (exit 0) the
socket dir and `TMPDIR` are empty and no process started under the work directory survives.

Output: progress lines on stderr, one JSON summary object on stdout (`violations` lists every
failed criterion; exit 1 when it is not empty). Without `--dsn` a fresh database is created on
`FLYD_TEST_DSN`'s server (else 127.0.0.1:5432) and dropped at the end.

    python scripts/soak.py                         # 300 + 100 sessions of 50 steps
    python scripts/soak.py --sessions 20 --kill-sessions 5 --dsn postgresql://...
    python scripts/soak.py --long-steps 100000     # then a 10^5-step run at cadence 0 and 1

Long runs (`--long-steps N`, `make soak` passes 10^5): after the sessions, one thread-mode
`flyd run` of N steps per cadence of `--long-cadences` (0 and 1) on the soak's database
(scripts/long_run.py): each must succeed with `boundary-1..N` and `finish` once in its ledger,
and the node's and router's RSS at 95–100 % of the run within `--rss-tolerance` of their RSS
at 20 %.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
import psutil  # noqa: E402
import psycopg  # noqa: E402
from long_run import long_run  # noqa: E402
from psycopg import sql  # noqa: E402
from psycopg.conninfo import make_conninfo  # noqa: E402

from bus.client import connect  # noqa: E402
from bus.errors import BusError  # noqa: E402
from flyd.cli.flyctl import ctl_client_id  # noqa: E402
from flyd.leases.migrate import migrate  # noqa: E402
from flyd.leases.params import LeaseParams  # noqa: E402
from flyd.leases.stores.pg import DbSettings, PgStore  # noqa: E402
from flyd.node.control_protocol import CONTROL_PREFIX, control_service  # noqa: E402
from flyd.session.runspec import RunSpec  # noqa: E402
from workers.types.domain import format_request_id  # noqa: E402
from workers.types.rpc import check_outcome  # noqa: E402

LOCAL_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
WORKERS = ("fly-a", "fly-b", "arena")
TERMINAL = ("succeeded", "failed", "cancelled")
POLL_S = 0.02
RUN_TIMEOUT_S = 180.0
IDLE_TIMEOUT_S = 30.0
START_TIMEOUT_S = 60.0
SETTLE_S = 0.2
MAX_ATTEMPTS = 10


def progress(tool: str, message: str) -> None:
    print(f"{tool}: {message}", file=sys.stderr, flush=True)


class HarnessError(Exception):
    """The harness itself could not do what it set out to (a node that does not start, a run
    that finished before its kill landed): reported, never counted as a pass."""


def wait_until(what: str, check: Callable[[], bool], timeout: float,
               poll: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)


# --------------------------------------------------------------------------------------------
# database


@contextlib.contextmanager
def scratch_database(dsn: str | None) -> Iterator[str]:
    """`dsn` itself when given (it must be migrated); else a fresh migrated database on the
    test server, dropped afterwards."""
    if dsn is not None:
        yield dsn
        return
    admin = os.environ.get("FLYD_TEST_DSN") or LOCAL_DSN
    name = f"flyd_soak_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        fresh = make_conninfo(admin, dbname=name)
        asyncio.run(migrate(fresh))
        yield fresh
    finally:
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def query(dsn: str, statement: str, *args: object) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        return conn.execute(statement, args).fetchall()  # type: ignore[arg-type]


MEDIA_WORLD = {"config": {"width": 256, "height": 256}}  # 256 KiB views: above the threshold


def run_spec(steps: int, every: int, pace_s: float | None,
             media: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"steps": str(steps), "mode": "process",
                            "checkpoints": {"everySteps": every}}
    if media:
        body["world"] = MEDIA_WORLD
    if pace_s is not None:
        body["paceS"] = pace_s
    return RunSpec.validate(body).to_json()


def submit(dsn: str, spec: Mapping[str, Any]) -> int:
    """The production submit statement (`PgStore.submit`)."""
    async def go() -> int:
        async with PgStore(dsn, "soak", DbSettings(), LeaseParams()) as store:
            return (await store.submit(None, spec, MAX_ATTEMPTS)).run_id
    return asyncio.run(go())


def wait_terminal(dsn: str, run: int, timeout: float = RUN_TIMEOUT_S) -> tuple[str, Any]:
    found: list[tuple[Any, ...]] = []

    def ended() -> bool:
        found[:] = query(dsn, "SELECT state::text, outcome FROM flyd.runs WHERE run_id = %s",
                         run)
        return bool(found) and found[0][0] in TERMINAL
    wait_until(f"run {run} to end", ended, timeout, poll=0.1)
    return str(found[0][0]), found[0][1]


def ledger_problems(dsn: str, run: int, steps: int) -> list[str]:
    """The run's effect keys must be exactly `boundary-1..N` and `finish`, each once."""
    keys = [str(k) for (k,) in query(
        dsn, "SELECT effect_key FROM flyd.effects WHERE run_id = %s ORDER BY boundary "
             "NULLS LAST, effect_key", run)]
    want = [f"boundary-{k}" for k in range(1, steps + 1)] + ["finish"]
    if keys == want:
        return []
    missing = sorted(set(want) - set(keys))
    twice = sorted({k for k in keys if keys.count(k) > 1})
    extra = sorted(set(keys) - set(want))
    return [f"run {run}: ledger differs: missing {missing[:5]}, twice {twice[:5]}, "
            f"unexpected {extra[:5]} ({len(keys)} keys)"]


def session_problems(dsn: str, run: int, steps: int, state: str, outcome: Any,
                     digest: str | None) -> list[str]:
    """A run must succeed with its ledger exactly once and the reference digest."""
    problems = []
    if state != "succeeded":
        problems.append(f"run {run} ended {state}: {orjson.dumps(outcome).decode()[:400]}")
    problems += ledger_problems(dsn, run, steps)
    got = outcome.get("behaviourDigest") if isinstance(outcome, dict) else None
    if digest is not None and got != digest:
        problems.append(f"run {run}: behaviourDigest {got} differs from the fault-free {digest}")
    return problems


# --------------------------------------------------------------------------------------------
# nodes


def processes_under(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line names `marker` (a work directory)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error, TypeError):
            if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
                continue
            if marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
    return found


def cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


@dataclass
class Node:
    """One `python -m flyd serve` under `<work>/<name>`: its state dir, socket dir and a private
    `TMPDIR` are its own, so whatever it leaves behind is found there."""

    work: Path
    name: str
    args: tuple[str, ...] = ()
    config: str = ""
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def home(self) -> Path:
        return self.work / self.name

    @property
    def state_dir(self) -> Path:
        return self.home / "state"

    @property
    def socket_dir(self) -> Path:
        return self.home / "run"

    @property
    def socket(self) -> Path:
        return self.socket_dir / "bus.sock"

    @property
    def tmp_dir(self) -> Path:
        return self.home / "tmp"

    @property
    def log_path(self) -> Path:
        return self.home / "node.log"

    def log_tail(self, lines: int = 30) -> list[str]:
        """The last lines of its log, for a harness error's report."""
        try:
            return self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def start(self, dsn: str) -> None:
        """Start (or restart after a kill) and wait until its router accepts and the node is
        registered `active`."""
        for path in (self.state_dir, self.socket_dir, self.tmp_dir):
            path.mkdir(parents=True, exist_ok=True)
        (self.home / "flyd.toml").write_text(self.config)
        env = {k: v for k, v in os.environ.items()
               if k not in ("FLYD_SOCKET", "FLYD_DSN", "FLYD_CONFIG", "FLYD_NODE_NAME",
                            "FLYD_STATE_DIR", "NOTIFY_SOCKET", "STATE_DIRECTORY",
                            "RUNTIME_DIRECTORY")}
        env["TMPDIR"] = str(self.tmp_dir)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flyd", "serve", "--dsn", dsn, "--socket",
                 str(self.socket), "--state-dir", str(self.state_dir), "--node-name",
                 self.name, "--config", str(self.home / "flyd.toml"), "--log-format", "json",
                 *self.args],
                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
        self.starts += 1
        pid = self.proc.pid

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise HarnessError(f"node {self.name} exited {self.proc.returncode} at start; "
                                   f"see {self.log_path}")
            rows = query(dsn, "SELECT count(*) FROM flyd.nodes WHERE node_name = %s AND "
                              "pid = %s AND state = 'active'", self.name, pid)
            return self.socket.exists() and int(rows[0][0]) > 0
        wait_until(f"node {self.name} to serve", up, START_TIMEOUT_S, poll=0.1)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def process(self) -> psutil.Process:
        return psutil.Process(self.pid)

    def children(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            return self.process().children(recursive=True)
        return []

    def router(self) -> psutil.Process | None:
        for child in self.children():
            if " router " in f" {cmdline(child)} ":
                return child
        return None

    def workers(self) -> list[psutil.Process]:
        """The node's worker processes (not its fork server, which lives as long as it)."""
        return [c for c in self.children()
                if "-m workers." in cmdline(c) and "workers.forkserver" not in cmdline(c)]

    def events(self, event: str) -> list[dict[str, Any]]:
        """The node's structlog lines of `event` (its stderr, JSON lines)."""
        out = []
        if self.log_path.exists():
            for line in self.log_path.read_bytes().splitlines():
                if line.startswith(b"{"):
                    with contextlib.suppress(orjson.JSONDecodeError):
                        record = orjson.loads(line)
                        if record.get("event") == event:
                            out.append(record)
        return out

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 60.0) -> int | None:
        """Drain (SIGTERM); SIGKILL if it does not exit in time. The exit code, or None when
        it had to be killed."""
        if self.proc is None:
            return None
        if self.proc.poll() is not None:
            return self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def entries(path: Path) -> list[str]:
    """Every file and directory under `path`, relative, sorted (logs excluded by callers)."""
    if not path.exists():
        return []
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# --------------------------------------------------------------------------------------------
# the live boundary, and a kill at a step


async def _live_run(socket: Path, run: int, at_least: int, deadline: float,
                    held: Callable[[], bool] | None = None) -> dict[str, Any] | None:
    """Poll the node's `Control.Status` until run `run` is at boundary ≥ `at_least` (before
    `deadline`, monotonic); its run entry (workers with pids), or None if the run left the
    node first. `held` (the database still names this node as the holder) catches a run that
    left before the node ever listed it: a node that claims a run that does not fit its
    thread budget hands it back at once (`run_does_not_fit`), and another node takes it."""
    serial = 0
    async with connect(str(socket), client_id=ctl_client_id(), timeout=5.0) as client:
        services = await client.services(CONTROL_PREFIX)
        if len(services) != 1:
            raise HarnessError(f"expected one control service on {socket}: {services}")
        target = control_service(str(services[0]["name"])[len(CONTROL_PREFIX):])
        seen = False
        while time.monotonic() < deadline:
            serial += 1
            answer = await client.call(target, "Control.Status",
                                       {"requestId": format_request_id(serial), "scope": None,
                                        "params": {}}, timeout=10.0)
            result = check_outcome("Control.Status", answer.outcome).result or {}
            mine = [r for r in result.get("runs", []) if r["run"] == run]
            if mine:
                seen = True
                if int(mine[0]["boundary"]) >= at_least:
                    return dict(mine[0])
            elif seen or (held is not None and not await asyncio.to_thread(held)):
                return None
            await asyncio.sleep(POLL_S)
    raise HarnessError(f"run {run} did not reach boundary {at_least} in time")


def live_run(socket: Path, run: int, at_least: int, timeout: float = RUN_TIMEOUT_S,
             held: Callable[[], bool] | None = None) -> dict[str, Any] | None:
    """`_live_run`, reconnecting while the node's router is not up yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return asyncio.run(_live_run(socket, run, at_least, deadline, held))
        except (BusError, OSError) as exc:
            if time.monotonic() > deadline:
                raise HarnessError(f"no control service on {socket}: {exc}") from None
            time.sleep(0.2)


async def _store_view(socket: Path) -> tuple[dict[str, Any], int, int]:
    """The router's store stats, its `artifactsAllocated` counter and the number of files in
    its store directory, as a `ctl-*` client of the router's uid sees them."""
    async with connect(str(socket), client_id=ctl_client_id(), timeout=5.0) as client:
        stats = await client.stats()
        if client.store is None or stats.get("store") is None:
            raise HarnessError(f"the router on {socket} offers no artifact store")
        files = len(os.listdir(client.store["path"]))
        return dict(stats["store"]), int(stats["counters"]["artifactsAllocated"]), files


def store_view(socket: Path) -> tuple[dict[str, Any], int, int]:
    return asyncio.run(_store_view(socket))


def sigkill(proc: psutil.Process) -> None:
    """SIGKILL and confirm the process is gone (reaped by its parent, or a zombie)."""
    proc.send_signal(signal.SIGKILL)

    def gone() -> bool:
        try:
            return proc.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    wait_until(f"pid {proc.pid} to die", gone, 10.0)


# --------------------------------------------------------------------------------------------
# samples and criteria


@dataclass
class Sample:
    session: int
    node_fds: int
    node_threads: int
    node_rss: int
    router_fds: int
    router_threads: int
    router_rss: int
    router_pid: int
    descendants: int
    zombies: int
    server_pids: tuple[int, ...]
    store_artifacts: int
    store_bytes: int
    store_files: int
    artifacts_allocated: int


def sample(node: Node, session: int) -> Sample:
    """The node's and its router's resources once the node is idle (only its router left)."""
    def idle() -> bool:
        return not node.workers()
    wait_until(f"the workers of session {session} to be reaped", idle, IDLE_TIMEOUT_S)
    time.sleep(SETTLE_S)
    proc = node.process()
    router = node.router()
    if router is None:
        raise HarnessError("the node has no router")
    children = proc.children(recursive=True)
    zombies = sum(1 for c in children if c.status() == psutil.STATUS_ZOMBIE)
    servers = tuple(c.pid for c in children if "workers.forkserver" in cmdline(c))
    node_fds, router_fds = proc.num_fds(), router.num_fds()
    # read after the fds: the stats connection is the router's own fd until it sees the close
    store, allocated, files = store_view(node.socket)
    return Sample(session=session, node_fds=node_fds, node_threads=proc.num_threads(),
                  node_rss=proc.memory_info().rss, router_fds=router_fds,
                  router_threads=router.num_threads(), router_rss=router.memory_info().rss,
                  router_pid=router.pid,
                  descendants=len(children) - zombies - len(servers), zombies=zombies,
                  server_pids=servers, store_artifacts=int(store["artifacts"]),
                  store_bytes=int(store["bytes"]), store_files=files,
                  artifacts_allocated=allocated)


def tenths(values: Sequence[int]) -> tuple[float, float]:
    """Medians of the first and the last tenth (at least three samples each)."""
    n = max(3, len(values) // 10)
    return statistics.median(values[:n]), statistics.median(values[-n:])


def growth(samples: Sequence[Sample], rss_tolerance: float) -> tuple[dict[str, Any], list[str]]:
    """The criteria of the module docstring over the post-warm-up samples."""
    report: dict[str, Any] = {}
    problems: list[str] = []
    for metric in ("node_fds", "node_threads", "router_fds", "router_threads", "node_rss",
                   "router_rss"):
        series = [int(getattr(s, metric)) for s in samples]
        first, last = tenths(series)
        report[metric] = {"firstTenthMedian": first, "lastTenthMedian": last,
                          "min": min(series), "max": max(series)}
        if metric.endswith("_rss"):
            if last > first * (1 + rss_tolerance):
                problems.append(f"{metric} grew from {first:.0f} to {last:.0f} "
                                f"(> {rss_tolerance:.0%})")
        elif last > first:
            problems.append(f"{metric} grew from {first:g} to {last:g}")
    odd = [s.session for s in samples if s.descendants != 1 or s.zombies]
    if odd:
        problems.append(f"idle node with other descendants than its router and its fork "
                        f"server (or zombies) after sessions {odd[:10]}")
    servers = sorted({pid for s in samples for pid in s.server_pids})
    if len(servers) > 1 or any(len(s.server_pids) > 1 for s in samples):
        problems.append(f"the fork server was replaced or doubled during the soak: pids "
                        f"{servers}")
    routers = sorted({s.router_pid for s in samples})
    if len(routers) != 1:
        problems.append(f"the router was replaced during the soak: pids {routers}")
    report["descendants"] = sorted({s.descendants for s in samples})
    return report, problems


def store_problems(samples: Sequence[Sample], media_sessions: int) -> list[str]:
    """Every idle sample (warm-up included) shows an empty store; media sessions allocated."""
    problems = []
    kept = [(s.session, s.store_artifacts, s.store_bytes, s.store_files) for s in samples
            if s.store_artifacts or s.store_bytes or s.store_files]
    if kept:
        problems.append(f"the store kept artifacts after sessions (session, artifacts, bytes, "
                        f"files): {kept[:10]}")
    if media_sessions and (not samples or samples[-1].artifacts_allocated == 0):
        problems.append(f"{media_sessions} media sessions allocated no artifact")
    return problems


# --------------------------------------------------------------------------------------------
# the soak


@dataclass
class Soak:
    dsn: str
    work: Path
    sessions: int
    kill_sessions: int
    steps: int
    every: int
    pace_s: float
    warmup: int
    rss_tolerance: float
    rng: random.Random
    media_every: int = 0
    samples: list[Sample] = field(default_factory=list)
    kills: list[dict[str, Any]] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    digests: dict[bool, str] = field(default_factory=dict)  # media or not -> reference digest
    media_sessions: int = 0

    def is_media(self, index: int) -> bool:
        return self.media_every > 0 and index % self.media_every == 0

    def clean_session(self, media: bool) -> None:
        run = submit(self.dsn, run_spec(self.steps, self.every, None, media))
        state, outcome = wait_terminal(self.dsn, run)
        if media not in self.digests and state == "succeeded":
            self.digests[media] = outcome["behaviourDigest"]
        self.violations += session_problems(self.dsn, run, self.steps, state, outcome,
                                            self.digests.get(media))

    def kill_session(self, node: Node, index: int, media: bool) -> None:
        run = submit(self.dsn, run_spec(self.steps, self.every, self.pace_s, media))
        victim = self.rng.choice(WORKERS)
        step = self.rng.randint(1, max(1, self.steps - 10))
        entry = live_run(node.socket, run, step)
        if entry is None:
            raise HarnessError(f"run {run} ended before its kill at boundary {step}")
        [worker] = [w for w in entry["workers"] if w["workerId"] == victim]
        sigkill(psutil.Process(int(worker["pid"])))
        state, outcome = wait_terminal(self.dsn, run)
        recoveries = int(outcome.get("recoveries", 0)) if isinstance(outcome, dict) else 0
        self.kills.append({"session": index, "run": run, "victim": victim, "pid": worker["pid"],
                           "targetBoundary": step, "killedAtBoundary": entry["boundary"],
                           "recoveries": recoveries, "state": state, "media": media})
        if recoveries < 1:
            self.violations.append(f"run {run}: the kill of {victim} left no recovery in "
                                   f"its outcome")
        self.violations += session_problems(self.dsn, run, self.steps, state, outcome,
                                            self.digests.get(media))

    def run(self) -> dict[str, Any]:
        node = Node(self.work, "soak")
        started = time.monotonic()
        total = self.sessions + self.kill_sessions
        baseline: dict[str, list[str]] = {}
        node_code: int | None = None
        try:
            node.start(self.dsn)
            for index in range(1, total + 1):
                media = self.is_media(index)
                self.media_sessions += media
                if index <= self.sessions:
                    self.clean_session(media)
                else:
                    self.kill_session(node, index, media)
                self.samples.append(sample(node, index))
                if index == self.warmup:
                    baseline = self.leftover_view(node)
                if index % 10 == 0 or index == total:
                    last = self.samples[-1]
                    progress("soak", f"{index}/{total} sessions, {time.monotonic() - started:.0f}"
                                     f" s; node fds {last.node_fds} threads {last.node_threads} "
                                     f"rss {last.node_rss >> 20} MiB; router fds "
                                     f"{last.router_fds} rss {last.router_rss >> 20} MiB; "
                                     f"{len(self.violations)} violations")
            final = self.leftover_view(node)
            for where, names in final.items():
                if names != baseline.get(where):
                    self.violations.append(f"{where} changed during the soak: "
                                           f"{baseline.get(where)} -> {names}")
        finally:
            node_code = node.stop()
        if node_code != 0:
            self.violations.append(f"the node's drain exited {node_code}")
        for where, names in (("socket dir", entries(node.socket_dir)),
                             ("TMPDIR", entries(node.tmp_dir))):
            if names:
                self.violations.append(f"{where} not empty after the node stopped: {names}")
        survivors = processes_under(str(self.work))
        if survivors:
            self.violations.append(f"processes outlived the node: "
                                   f"{[(p.pid, cmdline(p)) for p in survivors]}")
            for proc in survivors:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        measured = [s for s in self.samples if s.session > self.warmup]
        report, problems = growth(measured, self.rss_tolerance) if measured else ({}, [
            "no samples after the warm-up"])
        self.violations += problems + store_problems(self.samples, self.media_sessions)
        return {"tool": "soak", "sessions": self.sessions, "killSessions": self.kill_sessions,
                "steps": self.steps, "checkpointEvery": self.every, "paceS": self.pace_s,
                "warmup": self.warmup, "samplesMeasured": len(measured),
                "wallSeconds": round(time.monotonic() - started, 1),
                "behaviourDigest": self.digests.get(False),
                "mediaBehaviourDigest": self.digests.get(True), "mediaEvery": self.media_every,
                "mediaSessions": self.media_sessions,
                "artifactsAllocated": (self.samples[-1].artifacts_allocated if self.samples
                                       else 0),
                "growth": report,
                "rssTolerance": self.rss_tolerance, "kills": self.kills,
                "nodeExit": node_code, "samples": [asdict(s) for s in self.samples],
                "violations": self.violations, "ok": not self.violations}

    @staticmethod
    def leftover_view(node: Node) -> dict[str, list[str]]:
        return {"state dir": entries(node.state_dir), "socket dir": entries(node.socket_dir),
                "TMPDIR": entries(node.tmp_dir)}


def long_runs(summary: dict[str, Any], dsn: str, work: Path, steps: int,
              cadences: Sequence[int], tolerance: float, timeout_s: float) -> None:
    """The long runs (scripts/long_run.py) with the soak's RSS tolerance: each must succeed
    with every boundary once in its ledger and RSS at the end within the tolerance of 20 %."""
    results = []
    for cadence in cadences:
        progress("soak", f"long run: {steps} steps, cadence {cadence}")
        home = work / f"long-{cadence}"
        home.mkdir(parents=True, exist_ok=True)
        run = long_run(steps, cadence, dsn=dsn, work=home, timeout_s=timeout_s)
        doc = run.to_json()
        results.append(doc)
        growth = run.growth()
        if run.summary.get("state") != "succeeded" or not run.ledger_ok:
            summary["violations"].append(f"long run (cadence {cadence}): {doc['state']}, "
                                         f"ledger {doc['ledgerProblem']}")
        if not growth or any(abs(g) > tolerance for g in growth.values()):
            summary["violations"].append(f"long run (cadence {cadence}): RSS growth {growth}")
    summary["longRuns"] = results
    summary["ok"] = not summary["violations"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=300, help="clean sessions (300)")
    parser.add_argument("--kill-sessions", type=int, default=100,
                        help="sessions with a worker SIGKILLed at a random step (100)")
    parser.add_argument("--steps", type=int, default=50, help="transitions per session (50)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--pace-s", type=float, default=0.04,
                        help="seconds per step of the kill sessions (0.04)")
    parser.add_argument("--media-every", type=int, default=5,
                        help="every K-th session renders 256x256 views, which travel as "
                             "artifacts (5; 0: none)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="sessions not measured (default: a tenth, at least 10)")
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=None, help="victims and steps (random)")
    parser.add_argument("--dsn", default=None, help="a migrated database to use")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="directory for the nodes' files (default: a fresh temporary one, "
                             "removed at the end)")
    parser.add_argument("--long-steps", type=int, default=0,
                        help="steps of a long thread-mode `flyd run` per cadence (0 skips it; "
                             "`make soak` runs 10^5)")
    parser.add_argument("--long-cadences", default="0,1",
                        help="checkpoint cadences of the long runs (0,1)")
    parser.add_argument("--long-timeout-s", type=float, default=6 * 3600.0)
    args = parser.parse_args(argv)
    if args.steps < 12:
        parser.error("--steps must be at least 12 (a kill lands in 1 .. steps - 10)")
    total = args.sessions + args.kill_sessions
    warmup = args.warmup if args.warmup is not None else max(10, total // 10)
    if total - warmup < 6:
        parser.error("too few sessions after the warm-up to compare")
    if args.media_every < 0:
        parser.error("--media-every must be 0 or more")
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="flyd-soak-"))
    try:
        with scratch_database(args.dsn) as dsn:
            soak = Soak(dsn=dsn, work=work, sessions=args.sessions,
                        kill_sessions=args.kill_sessions, steps=args.steps,
                        every=args.checkpoint_every, pace_s=args.pace_s, warmup=warmup,
                        rss_tolerance=args.rss_tolerance, rng=random.Random(seed),
                        media_every=args.media_every)
            try:
                summary = soak.run()
            except HarnessError as exc:
                summary = {"tool": "soak", "ok": False, "kills": soak.kills,
                           "violations": [*soak.violations, f"harness: {exc}"]}
            if args.long_steps > 0:
                long_runs(summary, dsn, work, args.long_steps,
                          [int(c) for c in args.long_cadences.split(",") if c],
                          args.rss_tolerance, args.long_timeout_s)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    summary["seed"] = seed
    print(orjson.dumps(summary).decode(), flush=True)
    progress("soak", "ok" if summary["ok"] else f"FAILED: {summary['violations'][:5]}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
