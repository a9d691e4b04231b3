"""`flyctl`: inspect and steer running nodes (design/cli.md §7).

Why: live facts (workers, phases, leases as the node sees them) come from the nodes' control
services on the bus (design/cli.md §8); queue facts come from PostgreSQL. Every command is one
coroutine here returning a `Result` (JSON object, human lines, exit code) or raising `CtlError`; the
click commands in `flyd.cli.flyd` only parse options.

Rules:
- Bus: one connection to the socket as `ctl-<pid>-<8 hex>`; nodes are found by `bus.services`
  with prefix `flyd.control.`. `--node` is a node id or a unique prefix of one (a node id starts
  with its node name). `kill` and `drain` need exactly one node (several → exit 2 listing them).
- Database: `--dsn`, `FLYD_DSN`, `[database] dsn`, then a running embedded server's
  `postmaster.pid` under the state dir; `flyctl` never starts a server. None → exit 2 "no
  database: pass --dsn" (`CONFIG`).
- Errors: `CtlError(code, message)`; exit 2 for `USAGE`, `CONFIG` and a router refusing the
  connection, 3 for `TIMEOUT`, 1 otherwise (a control service's refusal carries its domain code).
- Output: results on stdout (human text and tables, or one JSON object with `--json`);
  diagnostics on stderr (notes, the one-line error, logs), so a shell can pipe the results.

Decisions where the spec is silent:
- An unknown run (`runs show|cancel|requeue`) is a bad argument: `USAGE`, exit 2. Cancelling a
  terminal run or requeueing a run that is not `failed` is refused `INVALID_PHASE`, exit 1.
- `status`'s database view lists the registered nodes and the runs that are not terminal; the
  fields only a node knows are null (`router`, `uptimeMs`, `threads`, `phase`, workers empty).
  An `active` node whose last heartbeat (by the database clock) is older than `[leases]
  node_stale_after_s` is shown `silent` (design/distribution.md §4.2: status only).
- `runs submit` builds the spec exactly as `flyd run` does, without `exclusiveToSubmitter`, so
  any serve node may claim it; `[session] mode`, `dispatch`, `pacing` and the `[checkpoints]`
  cadence of this host's configuration are its defaults (design/cli.md §2.3), a flag wins.
- Checkpoint commands use the checkpoint store (`flyd.state.checkpoints`, imported by those commands
  only, so the other commands never depend on the state layer); its database failures
  (`BACKEND_FAILURE`) are `CONFIG` (exit 2), its refusals (a missing generation, a failing S-check
  on export) exit 1 with their domain code. A file over the envelope limit, or unreadable, is
  `USAGE` (exit 2); a file failing R1–R8 on import exits 1 naming the check.
- `runs show`: `recoveries` is the outcome's count once the run has one; before that (running,
  or ended without one) it is the number of session epochs after the first that committed
  effects, a lower bound (a recovery that failed before its first commit leaves no trace).
  `checkpoints` lists the generations kept in the database (rotation keeps
  `[checkpoints] keep_generations`), not every checkpoint taken; the human line says "kept".
- `runs show` also shows the stored `spec` and `progress` (`{boundary, steps, task}`: the
  highest committed boundary, else the imported head; the spec's target; the task's progress
  from that boundary's result). `runs export` prints the `flyd.effects.result` of every
  committed boundary, one canonical JSON line each, to `-o FILE` (temporary name, then renamed)
  or stdout (`-o -`, no `-o`: the summary then goes to stderr); rows from before the results
  column are skipped and counted on stderr. Details: docs/cli.md, "Results and imports".
- `checkpoints import` rebuilds the spec of the file's composition (`flyd.session.imported`:
  from the manifest and the spec of a run holding the same file), or reads `--spec FILE`;
  flags given win, then the spec's values, then the host's defaults; a spec that cannot install
  the checkpoint is `USAGE` (exit 2) naming the field, before anything is submitted.
- `runs show` asks the holder (when the run is `running` and its owner's control service answers
  on this socket) for the run's phase (`Control.Status`) and event ring (`Control.RunEvents`);
  otherwise both are null.
- `watch` (topics.md §15) resolves the run through `Control.Watch` (without RUN: the one run
  the nodes' `Control.Status` list), subscribes to its run topic with a latest slot of window 1
  and prints each boundary as it reads it, flushed; the final state is the command's result
  (exit 0 succeeded, 1 failed or cancelled). A `released` end, or the topic's removal without
  one, resolves the run again every second; a switch of node prints `run N: now on node <id>`.
  A run no node holds is answered from the database when terminal. A router lost while
  following is waited for (reconnecting every second, at most `WATCH_ROUTER_S`), then the run
  is resolved anew.
- `runs show` of a run a plugin failed: `reason` names the plugin, the stage and the exception
  with its message (`flyd.outcome.describe`); the human lines add the plugin's last traceback
  frames, which the JSON has in `outcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import orjson
import psycopg
import uvloop

from bus.client import BusClient, connect
from bus.errors import BusError, CallDeadlineExceeded, RouterLost
from bus.ownership import UnsafeDirectory
from flyd.cli.common import CtlOptions
from flyd.cli.run import RunOptions, RunUsageError, build_spec, read_spec_file
from flyd.config import Config, load_config, redact_dsn, redact_dsn_text
from flyd.errors import ConfigError
from flyd.leases import queries
from flyd.leases.embedded import embedded_dsn_if_running
from flyd.leases.stores.contract import TERMINAL, SpecMismatch, StoreError
from flyd.leases.stores.pg import PgStore
from flyd.node.control_protocol import CONTROL_PREFIX, control_service, control_validator
from flyd.outcome import describe, failure_of, traceback_of
from flyd.session.runspec import DEFAULT_MAX_AGENTS, FaultSpecError, RunSpec, RunSpecError
from workers.types.canonical import canonical
from workers.types.domain import DomainError, ErrorCode, format_request_id
from workers.types.rpc import check_outcome

if TYPE_CHECKING:
    from flyd.state.checkpoints import CheckpointStore
    from flyd.state.envelope import Envelope

__all__ = [
    "CtlError",
    "Result",
    "boundary_line",
    "checkpoints_export",
    "checkpoints_import",
    "checkpoints_list",
    "checkpoints_verify",
    "ctl_client_id",
    "drain",
    "execute",
    "kill",
    "resolve_dsn",
    "runs_cancel",
    "runs_export",
    "runs_list",
    "runs_requeue",
    "runs_show",
    "runs_submit",
    "status",
    "table",
    "watch",
]

EXIT_FAILED: Final = 1
EXIT_CONFIG: Final = 2
EXIT_TIMEOUT: Final = 3
EXIT_INTERRUPTED: Final = 130
CONNECT_S: Final = 5.0
DB_CONNECT_S: Final = 5
CALL_S: Final = 30.0
#: how often `flyctl watch` resolves a run that changed hands (topics.md §15 rule 5)
WATCH_RESOLVE_S: Final = 1.0
#: how long `flyctl watch` waits for a lost router to come back before it gives up
WATCH_ROUTER_S: Final = 60.0
ACTOR_PREFIX: Final = "flyctl"


class CtlError(Exception):
    """A refused command: a code of design/cli.md §1 and the exit code that goes with it."""

    def __init__(self, code: str, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.exit_code = exit_code if exit_code is not None else (
            EXIT_CONFIG if code in ("USAGE", "CONFIG") else
            EXIT_TIMEOUT if code == "TIMEOUT" else EXIT_FAILED)


@dataclass
class Result:
    """What a command prints: on stdout `data` with `--json`, else `human`; `notes` go to
    stderr in both modes; and its exit code."""

    data: dict[str, Any]
    human: list[str] = field(default_factory=list)
    exit_code: int = 0
    notes: list[str] = field(default_factory=list)
    stdout_taken: bool = False
    """The command wrote its own output on stdout (`runs export -o -`): the result goes to
    stderr instead, so the stream stays what the command wrote."""


def ctl_client_id() -> str:
    """A fresh `flyctl` client id, `ctl-<pid>-<8 hex>` (design/session.md §7.2): the default
    policy lets `ctl-*` clients call the control service only, and the random part keeps a reused
    pid from colliding with a connection still closing."""
    return f"ctl-{os.getpid()}-{os.urandom(4).hex()}"


def execute(command: str, as_json: bool, work: Callable[[], Awaitable[Result]]) -> int:
    """Run one command on a fresh loop and print what it gives; returns the exit code.

    The result on stdout: its human lines, or with `--json` the object (or `{"error": {code,
    message}}`). Notes and the one-line error always go to stderr."""
    try:
        result = uvloop.run(_awaited(work))
    except CtlError as exc:
        print(f"flyctl {command}: {exc.message}", file=sys.stderr)
        if as_json:
            _stdout({"error": {"code": exc.code, "message": exc.message}})
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    for line in result.notes:
        print(line, file=sys.stderr)
    stream = sys.stderr if result.stdout_taken else sys.stdout
    if as_json:
        stream.write(orjson.dumps(result.data).decode() + "\n")
    else:
        stream.write("".join(f"{line}\n" for line in result.human))
    stream.flush()
    return result.exit_code


async def _awaited(work: Callable[[], Awaitable[Result]]) -> Result:
    return await work()


def _stdout(value: dict[str, Any]) -> None:
    sys.stdout.write(orjson.dumps(value).decode() + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------------------------
# configuration, database


def _config(opts: CtlOptions) -> Config:
    try:
        config = load_config(opts.config_file, {"database.dsn": opts.dsn,
                                                "bus.socket": opts.socket,
                                                "node.log_format": opts.log.format})
    except ConfigError as exc:
        raise CtlError("CONFIG", str(exc)) from None
    config.log_settings(opts.log).apply()
    return config


def resolve_dsn(opts: CtlOptions, config: Config | None = None) -> str:
    """`--dsn` > `FLYD_DSN` > `[database] dsn` > a running embedded server; never starts one."""
    settings = (config or _config(opts)).settings
    if settings.database.dsn is not None:
        return settings.database.dsn
    embedded = embedded_dsn_if_running(settings.node.state_dir)
    if embedded is not None:
        return embedded
    raise CtlError("CONFIG", "no database: pass --dsn")


@contextlib.asynccontextmanager
async def _database(dsn: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A read connection; an unreachable DSN or a failing query is `CONFIG` (password hidden)."""
    try:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True,
                                                     connect_timeout=DB_CONNECT_S)
    except psycopg.Error as exc:
        raise CtlError("CONFIG", f"cannot reach the database {redact_dsn(dsn)}: "
                                 f"{redact_dsn_text(str(exc).strip(), dsn)}") from None
    try:
        async with conn:
            yield conn
    except psycopg.Error as exc:
        raise CtlError("CONFIG", f"database {redact_dsn(dsn)}: "
                                 f"{redact_dsn_text(str(exc).strip(), dsn)}") from None


@contextlib.asynccontextmanager
async def _store(opts: CtlOptions, config: Config) -> AsyncIterator[PgStore]:
    dsn = resolve_dsn(opts, config)
    async with _database(dsn):
        pass  # reachable: the pool below would only retry and log an unreachable server
    settings = config.settings
    store = PgStore(dsn, ctl_client_id(), settings.database.connection, settings.leases)
    try:
        await store.open()
    except StoreError as exc:
        raise CtlError("CONFIG", f"cannot reach the database {redact_dsn(dsn)}: "
                                 f"{redact_dsn_text(str(exc), dsn)}") from None
    try:
        yield store
    finally:
        await store.close()


# --------------------------------------------------------------------------------------------
# bus


class _Bus:
    """The `flyctl` connection: node discovery and control calls."""

    def __init__(self, client: BusClient, socket: str) -> None:
        self.client = client
        self.socket = socket
        self._serial = 0

    async def nodes(self, wanted: str | None) -> list[str]:
        """The node ids with a control service, narrowed by `--node` when given."""
        services = await self.client.services(CONTROL_PREFIX)
        ids = [str(s["name"])[len(CONTROL_PREFIX):] for s in services]
        if wanted is None:
            return ids
        if wanted in ids:
            return [wanted]
        matches = [i for i in ids if i.startswith(wanted)]
        if len(matches) == 1:
            return matches
        if not matches:
            raise CtlError("USAGE", f"no node {wanted!r} on {self.socket}; reachable: "
                                    f"{', '.join(ids) or 'none'}")
        raise CtlError("USAGE", f"--node {wanted} matches several nodes: {', '.join(matches)}")

    async def one_node(self, wanted: str | None) -> str:
        ids = await self.nodes(wanted)
        if not ids:
            raise CtlError("CONFIG", f"no node reachable on {self.socket}")
        if len(ids) > 1:
            raise CtlError("USAGE", f"several nodes on {self.socket}: {', '.join(ids)}; "
                                    "pass --node")
        return ids[0]

    async def call(self, node_id: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """One control call; a refusal is a `CtlError` with the domain or bus code (exit 1)."""
        self._serial += 1
        payload = {"requestId": format_request_id(self._serial), "scope": None, "params": params}
        try:
            answer = await self.client.call(control_service(node_id), method, payload,
                                            timeout=CALL_S)
        except CallDeadlineExceeded:
            raise CtlError("TIMEOUT", f"{method}: node {node_id} did not answer within "
                                      f"{CALL_S:g} s") from None
        except BusError as exc:
            raise CtlError(exc.name, f"{method}: {exc.message}") from None
        try:
            outcome = check_outcome(method, answer.outcome)
        except DomainError as exc:
            raise CtlError(str(exc.code), exc.message) from None
        if outcome.error is not None:
            raise CtlError(str(outcome.error.code), outcome.error.message)
        assert outcome.result is not None
        problem = control_validator(method, "result")(outcome.result)
        if problem is not None:
            raise CtlError("BACKEND_FAILURE", f"{method}: malformed result: {problem}")
        return outcome.result


@contextlib.asynccontextmanager
async def _bus(opts: CtlOptions, config: Config) -> AsyncIterator[_Bus]:
    """Connect as `ctl-<pid>-<8 hex>`; no router → `CONFIG`, a refusal → its bus name (exit 2)."""
    bus = config.settings.bus
    socket = bus.socket
    try:
        client = await connect(socket, client_id=ctl_client_id(), timeout=CONNECT_S,
                               socket_gid=bus.socket_gid)
    except UnsafeDirectory as exc:
        raise CtlError(exc.name, f"socket {socket}: {exc.message}", EXIT_CONFIG) from None
    except RouterLost as exc:
        raise CtlError("CONFIG", f"no router on {socket}: {exc.message}") from None
    except BusError as exc:
        raise CtlError(exc.name, f"the router on {socket} refused the connection: "
                                 f"{exc.message}", EXIT_CONFIG) from None
    try:
        yield _Bus(client, socket)
    finally:
        await client.close()


# --------------------------------------------------------------------------------------------
# rendering


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """Left-aligned columns, two spaces apart, each as wide as its widest cell."""
    cells = [[str(h) for h in headers]] + [["-" if c is None else str(c) for c in r]
                                           for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in cells]


def _seconds(ms: object) -> str | None:
    return None if not isinstance(ms, int) else f"{ms / 1000:.1f}s"


def _status_lines(doc: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    router = doc.get("router")
    if router is not None:
        lines.append(f"router {router['routerId']}  socket {router['socket']}  uptime "
                     f"{_seconds(router['uptimeMs'])}  connections {router['connections']}  "
                     f"active calls {router['activeCalls']}")
    for n in doc["nodes"]:
        threads = n.get("threads") or {}
        leases = ", ".join(f"{x['run']}@{x['leaseEpoch']}" for x in n.get("leases") or [])
        lines.append(f"node {n['nodeId']}  state {n['state']}  pid {n['pid']}  runs "
                     f"{n.get('runs') or []}  leases [{leases}]  threads "
                     f"{threads.get('used', '-')}/{threads.get('total', '-')}  heartbeat "
                     f"{n.get('lastHeartbeat') or '-'}  database {n.get('dsn') or '-'}"
                     + (f"  reason {n['reason']}" if n.get("reason") else ""))
    rows = [[r["run"], w["workerId"], w["role"], w["pid"], w["incarnationId"],
             w["state"] if w["alive"] else "dead", w["step"], w["threads"],
             _seconds(w["uptimeMs"])]
            for r in doc["runs"] for w in r.get("workers") or []]
    lines += table(["RUN", "WORKER", "ROLE", "PID", "INCARNATION", "STATE", "STEP", "THREADS",
                    "UPTIME"], rows)
    return lines


# --------------------------------------------------------------------------------------------
# status


async def status(opts: CtlOptions) -> Result:
    """Every reachable node's `Control.Status`, merged; else the database view."""
    config = _config(opts)
    reached: list[dict[str, Any]] = []
    why = ""
    try:
        async with _bus(opts, config) as bus:
            for node_id in await bus.nodes(opts.node):
                reached.append(await bus.call(node_id, "Control.Status", {}))
            if not reached:
                why = f"no node on {bus.socket}"
    except CtlError as exc:
        if exc.code != "CONFIG":
            raise
        why = exc.message
    if reached:
        doc = {"source": "control", "router": reached[0]["router"],
               "nodes": [n for r in reached for n in r["nodes"]],
               "runs": [run for r in reached for run in r["runs"]]}
        return Result(doc, _status_lines(doc))
    doc = await _database_status(opts, config)
    note = f"flyctl status: {why}; showing the database view (source: database)"
    return Result(doc, _status_lines(doc), notes=[note])


async def _database_status(opts: CtlOptions, config: Config) -> dict[str, Any]:
    dsn = resolve_dsn(opts, config)
    async with _database(dsn) as conn:
        node_rows = await queries.nodes(conn)
        run_rows = [r for r in await queries.list_runs(conn) if r["state"] not in TERMINAL]
    if opts.node is not None:
        node_rows = [n for n in node_rows if str(n["nodeId"]).startswith(opts.node)]
    stale_s = config.settings.leases.node_stale_after_s
    nodes = []
    for n in node_rows:
        mine = [r for r in run_rows if r["ownerNode"] == n["nodeId"] and r["state"] == "running"]
        silent = n["state"] == "active" and n["silentForS"] > stale_s
        nodes.append({
            "nodeId": n["nodeId"], "nodeName": n["nodeName"], "pid": n["pid"],
            "state": "silent" if silent else n["state"], "uptimeMs": None,
            "capacity": n["capacity"], "threads": None,
            "runs": [r["run"] for r in mine],
            "leases": [{"run": r["run"], "leaseEpoch": r["leaseEpoch"],
                        "leaseExpiresAt": r["leaseExpiresAt"]} for r in mine],
            "lastHeartbeat": n["heartbeatAt"], "dsn": redact_dsn(dsn),
            "reason": n["reason"]})
    runs = [{"run": r["run"], "state": r["state"], "leaseEpoch": r["leaseEpoch"],
             "ownerNode": r["ownerNode"], "epoch": None, "phase": None,
             "boundary": r["boundary"] or 0, "recoveries": None, "workers": []}
            for r in run_rows]
    return {"source": "database", "router": None, "nodes": nodes, "runs": runs}


# --------------------------------------------------------------------------------------------
# kill, drain


async def kill(opts: CtlOptions, worker_id: str, run: int | None, signal: str) -> Result:
    """`Control.Kill`; `AlreadyGone` exits 1."""
    async with _bus(opts, _config(opts)) as bus:
        node_id = await bus.one_node(opts.node)
        result = await bus.call(node_id, "Control.Kill",
                                {"run": run, "workerId": worker_id, "signal": signal})
    where = "" if result["run"] is None else f" of run {result['run']}"
    return Result(result, [f"flyctl kill: {worker_id}{where} on {node_id}: {result['outcome']}"],
                  EXIT_FAILED if result["outcome"] == "AlreadyGone" else 0)


async def drain(opts: CtlOptions) -> Result:
    """`Control.Drain` of the one node (or `--node`)."""
    async with _bus(opts, _config(opts)) as bus:
        node_id = await bus.one_node(opts.node)
        result = await bus.call(node_id, "Control.Drain", {})
    return Result({"node": node_id, "draining": result["draining"]},
                  [f"flyctl drain: node {node_id} is draining"])


# --------------------------------------------------------------------------------------------
# watch (topics.md §15)


@dataclass(frozen=True)
class _Watched:
    """A run found on a node: its `Control.Watch` result."""

    node_id: str
    run: int
    topic: str
    topic_incarnation: str


async def watch(opts: CtlOptions, run_id: int | None, as_json: bool) -> Result:
    """Follow a run on its run topic: a line per boundary read, then its final state (exit 0
    succeeded, 1 failed or cancelled). A `released` end, or the topic's removal without an end,
    resolves the run again every `WATCH_RESOLVE_S` and follows whichever node holds it."""
    config = _config(opts)
    loop = asyncio.get_running_loop()
    previous: str | None = None
    lost_at: float | None = None
    while True:
        try:
            async with _bus(opts, config) as bus:
                lost_at = None
                while True:
                    found = await _watch_target(bus, opts, config, run_id,
                                                following=previous is not None)
                    if isinstance(found, Result):
                        return found
                    if found is None:  # between holders: neither held nor terminal
                        await asyncio.sleep(WATCH_RESOLVE_S)
                        continue
                    if previous is not None and found.node_id != previous:
                        _watch_line(as_json, f"run {found.run}: now on node {found.node_id}",
                                    {"run": found.run, "node": found.node_id})
                    previous, run_id = found.node_id, found.run
                    end = await _follow(bus, found, as_json)
                    if end is not None and end["state"] != "released":
                        return _end_result(end)
                    await asyncio.sleep(WATCH_RESOLVE_S)
        except CtlError as exc:
            # the router went away while following: wait for it (bounded), then resolve anew
            if previous is None or exc.code not in ("ROUTER_LOST", "CONFIG"):
                raise
            lost_at = loop.time() if lost_at is None else lost_at
            if loop.time() - lost_at > WATCH_ROUTER_S:
                raise
            await asyncio.sleep(WATCH_RESOLVE_S)


async def _watch_target(bus: _Bus, opts: CtlOptions, config: Config, run_id: int | None, *,
                        following: bool) -> _Watched | Result | None:
    """Rule 1 of topics.md §15: the node holding the run (or the only held run), else the final line
    of a terminal run from the database; None while `following` a run no node holds yet."""
    try:
        nodes = await bus.nodes(opts.node)
    except BusError as exc:
        raise CtlError(exc.name, f"bus.services: {exc.message}") from None
    if run_id is None:
        held: list[tuple[int, str]] = []
        for node_id in nodes:
            status = await bus.call(node_id, "Control.Status", {})
            held += [(int(r), node_id) for r in status["nodes"][0]["runs"]]
        if not held:
            raise CtlError("USAGE", "no run is held by a reachable node")
        if len(held) > 1:
            raise CtlError("USAGE", "several runs are held: " + ", ".join(
                f"{run} (node {node_id})" for run, node_id in sorted(held)) + "; name one")
        run_id = held[0][0]
    for node_id in nodes:
        try:
            result = await bus.call(node_id, "Control.Watch", {"run": run_id})
        except CtlError as exc:
            # a node that does not hold the run, or (following) one going away or coming
            # back meanwhile; a lost router is the caller's
            if exc.code == "ROUTER_LOST":
                raise
            if exc.code == "IDENTITY_MISMATCH" or following:
                continue
            raise
        return _Watched(node_id, run_id, result["topic"], result["topicIncarnation"])
    row = await _run_state(opts, config, run_id)
    if row is not None and row["state"] in TERMINAL:
        outcome = row["outcome"] if isinstance(row["outcome"], dict) else {}
        return _end_result({"run": run_id, "state": row["state"],
                            "boundary": outcome.get("boundary", row["boundary"] or 0),
                            "error": describe(outcome) if row["state"] == "failed" else None})
    if following and row is not None:
        return None
    raise CtlError("USAGE", f"run {run_id} is not held by a reachable node")


async def _run_state(opts: CtlOptions, config: Config, run_id: int) -> dict[str, Any] | None:
    """The run's row, or None without one (or without a database)."""
    try:
        dsn = resolve_dsn(opts, config)
    except CtlError:
        return None
    async with _database(dsn) as conn:
        return await queries.run_row(conn, run_id)


async def _follow(bus: _Bus, found: _Watched, as_json: bool) -> dict[str, Any] | None:
    """Print each boundary the latest slot gives until the run's `end` (returned), or None when
    the topic went away without one."""
    try:
        try:
            async with asyncio.timeout(CALL_S):
                sub = await bus.client.subscribe(found.topic, mode="latest", window=1,
                                                 retained=True)
        except RouterLost:
            raise
        except BusError:
            return None  # removed between the answer and the subscription
        async with sub:
            async for msg in sub:
                payload = msg.payload
                kind = payload.get("kind")
                if kind == "end":
                    return payload
                if kind == "boundary":
                    human, data = boundary_line(payload, msg.skipped)
                    _watch_line(as_json, human, data)
    except RouterLost as exc:
        raise CtlError("ROUTER_LOST", f"the router on {bus.socket} was lost: "
                                      f"{exc.message}") from None
    except TimeoutError:
        raise CtlError("TIMEOUT", f"bus.subscribe {found.topic}: no answer within "
                                  f"{CALL_S:g} s") from None
    return None


def boundary_line(payload: dict[str, Any], skipped: int) -> tuple[str, dict[str, Any]]:
    """One boundary message as `flyctl watch` prints it: the human line and the JSON object."""
    world = payload["worldTime"]
    seconds = int(world["numerator"]) / int(world["denominator"]) / 1e9
    rewards = {agent: sum(r["value"] for r in given)
               for agent, given in sorted(payload["rewards"].items())}
    events = list(payload["eventIds"])
    shown = " ".join(f"{agent} {value:+g}" if value else f"{agent} 0"
                     for agent, value in rewards.items())
    line = (f"run {payload['run']}  boundary {payload['boundary']}  t {seconds:.3f} s  "
            f"{payload['stepsPerSecond']:.1f} steps/s  rewards {shown or '-'}  "
            f"events {len(events)}" + (f"  (+{skipped} skipped)" if skipped else ""))
    return line, {"run": payload["run"], "boundary": payload["boundary"], "worldTime": seconds,
                  "stepsPerSecond": payload["stepsPerSecond"], "rewards": rewards,
                  "events": events, "skipped": skipped}


def _watch_line(as_json: bool, human: str, data: dict[str, Any]) -> None:
    """A live line on stdout, flushed at once (the watcher's reader follows the run)."""
    sys.stdout.write((orjson.dumps(data).decode() if as_json else human) + "\n")
    sys.stdout.flush()


def _end_result(end: dict[str, Any]) -> Result:
    state, run, boundary, error = end["state"], end["run"], end["boundary"], end["error"]
    line = f"run {run}  {state} at boundary {boundary}" + (f": {error}" if error else "")
    return Result({"run": run, "state": state, "boundary": boundary, "error": error}, [line],
                  exit_code=0 if state == "succeeded" else EXIT_FAILED)


# --------------------------------------------------------------------------------------------
# runs


def _submitted_spec(config: Config, run: RunOptions) -> RunSpec:
    """The spec `flyd run` would build from these options, claimable by any node; import
    paths are checked by the node that claims it (its environment and `[plugins] paths`)."""
    try:
        doc = build_spec(run.with_host_defaults(config.settings), check_imports=False).to_json()
        doc.pop("exclusiveToSubmitter", None)
        return RunSpec.validate(doc, max_agents=DEFAULT_MAX_AGENTS)
    except RunUsageError as exc:
        raise CtlError(exc.code, exc.message) from None
    except RunSpecError as exc:
        raise CtlError("USAGE", exc.message) from None


def _max_attempts(config: Config, given: int | None) -> int:
    attempts = given if given is not None else config.settings.leases.max_attempts
    if not 1 <= attempts <= 100:
        raise CtlError("USAGE", f"--max-attempts {attempts}: must be in 1..100")
    return attempts


async def runs_submit(opts: CtlOptions, run: RunOptions, key: str | None,
                      max_attempts: int | None) -> Result:
    """Build, normalise and validate the spec as `flyd run` does (claimable by any node)."""
    config = _config(opts)
    spec = _submitted_spec(config, run)
    attempts = _max_attempts(config, max_attempts)
    async with _store(opts, config) as store:
        try:
            submitted = await store.submit(key, spec.to_json(), attempts)
        except SpecMismatch as exc:
            raise CtlError("CONFLICT", str(exc)) from None
        except StoreError as exc:
            raise CtlError("CONFIG", f"submit: {exc}") from None
    verb = "submitted" if submitted.created else "already submitted"
    return Result({"run": submitted.run_id}, [f"flyctl runs submit: run {submitted.run_id} "
                                              f"{verb}"])


async def runs_list(opts: CtlOptions, state: str | None) -> Result:
    config = _config(opts)
    async with _database(resolve_dsn(opts, config)) as conn:
        rows = await queries.list_runs(conn, state)
    lines = table(["RUN", "STATE", "LEASE-EPOCH", "ATTEMPTS", "OWNER", "EXPIRES", "BOUNDARY"],
                  [[r["run"], r["state"], r["leaseEpoch"], f"{r['attempt']}/{r['maxAttempts']}",
                    r["ownerNode"], r["leaseExpiresAt"], r["boundary"]] for r in rows])
    return Result({"runs": rows}, lines)


async def _checkpoint_rows(conn: psycopg.AsyncConnection[Any], run_id: int) -> list[dict[str, Any]]:
    cur = await conn.execute(
        "SELECT checkpoint_id, boundary, session_epoch, lease_epoch, byte_length, committed_at "
        "FROM flyd.checkpoints WHERE run_id = %(run)s "
        "ORDER BY boundary DESC, committed_at DESC, checkpoint_id DESC", {"run": run_id})
    return [{"checkpointId": r[0], "boundary": int(r[1]), "sessionEpoch": f"e{r[2]}",
             "leaseEpoch": int(r[3]), "byteLength": int(r[4]), "committedAt": r[5].isoformat()}
            for r in await cur.fetchall()]


async def _known_run(conn: psycopg.AsyncConnection[Any], run_id: int) -> dict[str, Any]:
    row = await queries.run_row(conn, run_id)
    if row is None:
        raise CtlError("USAGE", f"no run {run_id}")
    return row


async def runs_show(opts: CtlOptions, run_id: int) -> Result:
    """The run row, its grants, checkpoints, effect count and outcome; live phase and events."""
    config = _config(opts)
    async with _database(resolve_dsn(opts, config)) as conn:
        row = await _known_run(conn, run_id)
        grants = await queries.attempts(conn, run_id)
        checkpoints = await _checkpoint_rows(conn, run_id)
        effect_rows = await queries.effects(conn, run_id)
        last = await queries.last_result(conn, run_id)
    outcome = row["outcome"] if isinstance(row["outcome"], dict) else {}
    failure = (failure_of(row["state"], outcome, last_grant=grants[-1] if grants else None)
               if row["state"] in TERMINAL else None)
    _, epochs = queries.behaviour(effect_rows)
    phase, events = await _live_view(opts, config, row)
    progress = _progress(row, last)
    doc = {"run": run_id, "state": row["state"], "leaseEpoch": row["leaseEpoch"],
           "attempt": row["attempt"], "maxAttempts": row["maxAttempts"],
           "ownerNode": row["ownerNode"], "leaseExpiresAt": row["leaseExpiresAt"],
           "boundary": row["boundary"], "cancelRequested": row["cancelRequested"],
           "submittedAt": row["submittedAt"], "finishedAt": row["finishedAt"],
           "grants": grants, "checkpoints": checkpoints, "effects": len(effect_rows),
           "recoveries": _recoveries(outcome, outcome.get("epochs") or epochs),
           "epochs": outcome.get("epochs") or epochs,
           "outcome": row["outcome"],
           "reason": describe(failure) if failure is not None else None, "phase": phase,
           "events": events, "spec": row["spec"], "progress": progress}
    lines = [f"run {run_id}: {row['state']}  lease epoch {row['leaseEpoch']}  attempt "
             f"{row['attempt']}/{row['maxAttempts']}  owner {row['ownerNode'] or '-'}  boundary "
             f"{row['boundary'] if row['boundary'] is not None else '-'}  effects "
             f"{len(effect_rows)}  checkpoints kept {len(checkpoints)}  recoveries "
             f"{doc['recoveries']}  epochs "
             f"{','.join(doc['epochs']) or '-'}  phase {phase or '-'}"]
    lines += table(["LEASE-EPOCH", "NODE", "GRANTED", "ENDED", "REASON"],
                   [[g["leaseEpoch"], g["nodeId"], g["grantedAt"], g["endedAt"], g["endReason"]]
                    for g in grants])
    if doc["reason"] is not None:
        lines.append(f"reason: {doc['reason']}")
        assert failure is not None
        frames = traceback_of(failure)
        if frames:
            lines.append("traceback (innermost last):")
            lines += [f"  {frame}" for frame in frames]
    if events is not None:
        lines.append(f"events: {len(events)}")
    lines += _spec_lines(row["spec"], progress)
    return Result(doc, lines)


def _progress(row: dict[str, Any], last: tuple[int, dict[str, Any] | None] | None
              ) -> dict[str, Any]:
    """How far the run got: the highest committed boundary (the imported head before the
    first), the spec's boundary target, and the task's progress at that boundary (null before
    the ledger kept results, or before the first boundary)."""
    spec = row["spec"] if isinstance(row["spec"], dict) else {}
    steps = spec.get("steps")
    head = row["boundary"] if isinstance(row["boundary"], int) else 0
    reached = max(head, last[0]) if last is not None else head
    task = last[1].get("progress") if last is not None and isinstance(last[1], dict) else None
    return {"boundary": reached, "steps": int(steps) if isinstance(steps, str) else steps,
            "task": task}


def _spec_lines(spec: Any, progress: dict[str, Any]) -> list[str]:
    """The human view of the spec: its composition in one line each, and the progress."""
    lines = [f"progress: boundary {progress['boundary']}/{progress['steps'] or '-'}"
             + (f"  task {canonical(progress['task']).decode()}" if progress["task"] else "")]
    if not isinstance(spec, dict):
        return lines
    lines.append(f"spec: session {spec.get('sessionId')}  episode {spec.get('episodeId')}  "
                 f"steps {spec.get('steps')}  seed {spec.get('seed')}  mode {spec.get('mode')}"
                 f"  dispatch {spec.get('dispatch')}  pacing {spec.get('pacing')}"
                 + (f"  starts from {spec['startFrom']['checkpointId']}"
                    if isinstance(spec.get("startFrom"), dict) else ""))
    for agent in spec.get("agents") or []:
        lines.append(f"  agent {agent.get('agentId')}  port {agent.get('portId')}  model "
                     f"{agent.get('model')}  config {canonical(agent.get('modelConfig')).decode()}")
    world = spec.get("world")
    if isinstance(world, dict):
        lines.append(f"  world {world.get('worldId')}  impl {world.get('impl')}  config "
                     f"{canonical(world.get('config')).decode()}  step "
                     f"{_rational(world.get('step'))}")
    task = spec.get("task")
    if isinstance(task, dict):
        lines.append(f"  task {task.get('impl')}  terminal {task.get('terminal')}  config "
                     f"{canonical(task.get('config')).decode()}")
    return lines


def _rational(value: Any) -> str:
    if isinstance(value, dict):
        return f"{value.get('numerator')}/{value.get('denominator')} ns"
    return str(value)


async def runs_export(opts: CtlOptions, run_id: int, out: Path | None) -> Result:
    """One canonical JSON line per committed boundary, in boundary order (module decisions);
    to `out` (written to a temporary file, then renamed) or to stdout for None."""
    config = _config(opts)
    written = 0
    missing = 0
    async with _database(resolve_dsn(opts, config)) as conn:
        await _known_run(conn, run_id)
        target: Path | None = None
        try:
            if out is None:
                sink = sys.stdout.buffer
            else:
                target = out.with_name(f".{out.name}.{os.getpid()}.tmp")
                sink = target.open("wb")
            try:
                async for _, result in queries.results(conn, run_id):
                    if result is None:
                        missing += 1
                        continue
                    sink.write(canonical(result) + b"\n")
                    written += 1
                sink.flush()
            finally:
                if target is not None:
                    sink.close()
            if target is not None and out is not None:
                os.replace(target, out)
                target = None
        except OSError as exc:
            raise CtlError("USAGE", f"-o {out}: cannot write: {exc.strerror}") from None
        finally:
            if target is not None:
                target.unlink(missing_ok=True)
    notes = [f"flyctl runs export: {missing} boundaries of run {run_id} were committed before "
             "the ledger kept results; they have no line"] if missing else []
    where = "-" if out is None else str(out)
    return Result({"run": run_id, "lines": written, "file": where},
                  [f"flyctl runs export: {written} boundaries of run {run_id} -> {where}"],
                  notes=notes, stdout_taken=out is None)


def _recoveries(outcome: dict[str, Any], epochs: Sequence[str]) -> int:
    """The outcome's count; without one, the session epochs after the first seen in effects."""
    counted = outcome.get("recoveries")
    if isinstance(counted, int):
        return counted
    return max(len(epochs) - 1, 0)


async def _live_view(opts: CtlOptions, config: Config,
                     row: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None]:
    """The holder's phase and event ring, when it answers on this socket; else (None, None)."""
    owner = row["ownerNode"]
    if row["state"] != "running" or not owner:
        return None, None
    try:
        async with _bus(opts, config) as bus:
            if owner not in await bus.nodes(None):
                return None, None
            state = await bus.call(owner, "Control.Status", {})
            phase = next((r["phase"] for r in state["runs"] if r["run"] == row["run"]), None)
            ring = await bus.call(owner, "Control.RunEvents", {"run": row["run"]})
    except CtlError:
        return None, None
    return phase, list(ring["events"])


async def runs_cancel(opts: CtlOptions, run_id: int) -> Result:
    config = _config(opts)
    async with _store(opts, config) as store:
        try:
            cancelled = await store.cancel(run_id, f"{ACTOR_PREFIX} {os.getpid()}")
        except StoreError as exc:
            raise CtlError("CONFIG", f"cancel: {exc}") from None
    if cancelled is None:
        async with _database(resolve_dsn(opts, config)) as conn:
            row = await _known_run(conn, run_id)
        raise CtlError("INVALID_PHASE", f"run {run_id} is already {row['state']}")
    return Result({"run": run_id, "state": cancelled.state, "cancelRequested": True},
                  [f"flyctl runs cancel: run {run_id} ({cancelled.state}): cancellation "
                   "requested"])


async def runs_requeue(opts: CtlOptions, run_id: int) -> Result:
    config = _config(opts)
    async with _store(opts, config) as store:
        try:
            done = await store.requeue(run_id, f"{ACTOR_PREFIX} {os.getpid()}")
        except StoreError as exc:
            raise CtlError("CONFIG", f"requeue: {exc}") from None
    if not done:
        async with _database(resolve_dsn(opts, config)) as conn:
            row = await _known_run(conn, run_id)
        raise CtlError("INVALID_PHASE", f"run {run_id} is {row['state']}, not failed")
    return Result({"run": run_id, "state": "pending"},
                  [f"flyctl runs requeue: run {run_id} is pending again"])


# --------------------------------------------------------------------------------------------
# checkpoints (design/cli.md §7.3; store semantics: design/state.md §4.7)


@contextlib.asynccontextmanager
async def _checkpoints(opts: CtlOptions, config: Config) -> AsyncIterator[CheckpointStore]:
    from flyd.state.checkpoints import CheckpointStore

    async with _store(opts, config) as store:
        yield CheckpointStore(store)


def _refused(exc: DomainError) -> CtlError:
    """A store refusal: a database failure is `CONFIG` (exit 2), anything else exit 1."""
    if exc.code == ErrorCode.BACKEND_FAILURE:
        return CtlError("CONFIG", exc.message)
    return CtlError(str(exc.code), exc.message)


async def checkpoints_list(opts: CtlOptions, run_id: int) -> Result:
    config = _config(opts)
    async with _database(resolve_dsn(opts, config)) as conn:
        await _known_run(conn, run_id)
    async with _checkpoints(opts, config) as store:
        try:
            records = await store.list(run_id)
        except DomainError as exc:
            raise _refused(exc) from None
    rows = [{"checkpointId": r.checkpoint_id, "boundary": r.boundary,
             "sessionEpoch": r.session_epoch, "leaseEpoch": r.lease_epoch,
             "byteLength": r.byte_length, "compatibilityDigest": r.compatibility_digest,
             "committedAt": r.committed_at.isoformat(), "head": r.is_head} for r in records]
    lines = table(["ID", "BOUNDARY", "SESSION-EPOCH", "LEASE-EPOCH", "SIZE", "COMPATIBILITY",
                   "COMMITTED", "HEAD"],
                  [[r["checkpointId"], r["boundary"], r["sessionEpoch"], r["leaseEpoch"],
                    r["byteLength"], str(r["compatibilityDigest"])[:12], r["committedAt"],
                    "*" if r["head"] else ""] for r in rows])
    return Result({"run": run_id, "checkpoints": rows}, lines)


async def checkpoints_export(opts: CtlOptions, run_id: int, checkpoint_id: str | None,
                             out: Path) -> Result:
    """The head (or `--id`) after S1–S5, written atomically; a failing check writes nothing."""
    config = _config(opts)
    async with _checkpoints(opts, config) as store:
        try:
            record = await store.export(run_id, out, checkpoint_id)
        except DomainError as exc:
            raise _refused(exc) from None
        except OSError as exc:
            raise CtlError("USAGE", f"-o {out}: cannot write: {exc.strerror}") from None
    doc = {"run": run_id, "checkpointId": record.checkpoint_id, "boundary": record.boundary,
           "byteLength": record.byte_length, "envelopeDigest": record.envelope_digest,
           "file": str(out)}
    return Result(doc, [f"flyctl checkpoints export: {record.checkpoint_id} of run {run_id} "
                        f"(boundary {record.boundary}, {record.byte_length} bytes) -> {out}"])


def _read_envelope(path: Path) -> tuple[bytes, Envelope]:
    """R1–R8 on a file: a file too large is `USAGE` (exit 2), a failing check exit 1."""
    from flyd.state.checkpoints import verify_file
    from flyd.state.envelope import EnvelopeError

    try:
        envelope = verify_file(path)
    except EnvelopeError:
        raise
    except DomainError as exc:
        raise CtlError("USAGE", exc.message) from None
    except OSError as exc:
        raise CtlError("USAGE", f"{path}: {exc.strerror}") from None
    return envelope.data, envelope


async def checkpoints_import(opts: CtlOptions, path: Path, run: RunOptions, key: str | None,
                             max_attempts: int | None, *, spec_file: Path | None = None,
                             steps_given: bool = True, trust: bool = False) -> Result:
    """Submit a new run starting from the file's checkpoint, with the composition that wrote
    it (module decisions); `--steps` (counted from 0) must exceed its boundary. A file with
    pickled payloads that this database did not write is refused unless `trust`."""
    from flyd.session.imported import Mismatch, Unchecked, mismatch, rebuild
    from flyd.state.envelope import EnvelopeError
    from flyd.state.pickled import pickled_payloads

    config = _config(opts)
    try:
        data, envelope = _read_envelope(path)
    except EnvelopeError as exc:
        raise CtlError(str(exc.code), exc.message) from None
    boundary = int(envelope.manifest["sourceScope"]["step"])
    pickled = [] if trust else pickled_payloads(envelope.payloads)
    source: dict[str, Any] | None = None
    if pickled or spec_file is None:
        async with _database(resolve_dsn(opts, config)) as conn:
            source = await _source_spec(conn, hashlib.sha256(data).digest())
    if pickled and source is None:
        raise CtlError("USAGE", f"{path}: refusing to import: restoring it would unpickle "
                                f"{', '.join(pickled)}, and unpickling runs whatever code the "
                                "file's author chose; it was not written by this database's "
                                "nodes. Pass --trust if you trust where the file came from")
    if spec_file is not None:
        try:
            base = read_spec_file(spec_file)
        except RunUsageError as exc:
            raise CtlError(exc.code, exc.message) from None
        origin = f"--spec {spec_file}"
    else:
        base = rebuild(envelope.manifest, source)
        origin = "the checkpoint's composition" + (" (from the run that wrote it)"
                                                    if source is not None else "")
    spec = _import_spec(config, base, run, steps_given, origin)
    if spec.steps <= boundary:
        raise CtlError("USAGE", f"--steps {spec.steps} must exceed the imported boundary "
                                f"{boundary}")
    found = mismatch(spec, envelope.manifest)
    if isinstance(found, Mismatch):
        raise CtlError("USAGE", f"{origin} cannot start from {path.name}: {found}")
    notes = [] if not isinstance(found, Unchecked) else [
        f"flyctl checkpoints import: {found.module} ({found.path}) cannot be imported here; "
        "its identity is checked by the node at restore"]
    attempts = _max_attempts(config, max_attempts)
    async with _checkpoints(opts, config) as store:
        try:
            record = await store.import_envelope(data, spec=spec.to_json(), submit_key=key,
                                                 max_attempts=attempts)
        except DomainError as exc:
            raise _refused(exc) from None
    doc = {"run": record.run_id, "checkpointId": record.checkpoint_id,
           "boundary": record.boundary, "envelopeDigest": record.envelope_digest}
    return Result(doc, [f"flyctl checkpoints import: run {record.run_id} starts from "
                        f"{record.checkpoint_id} at boundary {record.boundary}"], notes=notes)


async def _source_spec(conn: psycopg.AsyncConnection[Any],
                       envelope_digest: bytes) -> dict[str, Any] | None:
    """The spec of a run holding this very file (the run that wrote it before an import of
    it), or None."""
    cur = await conn.execute(
        "SELECT r.spec FROM flyd.checkpoints c JOIN flyd.runs r USING (run_id) "
        "WHERE c.envelope_digest = %(digest)s ORDER BY c.lease_epoch = 0, c.run_id LIMIT 1",
        {"digest": envelope_digest})
    row = await cur.fetchone()
    return row[0] if row is not None and isinstance(row[0], dict) else None


def _import_spec(config: Config, base: dict[str, Any], run: RunOptions, steps_given: bool,
                 origin: str) -> RunSpec:
    """`base` under the options: a flag given wins, then the base's own value, then this
    host's default (design/cli.md §2.3); never exclusive to a submitter, `startFrom` is the
    store's."""
    doc = {k: v for k, v in base.items() if k not in ("startFrom", "exclusiveToSubmitter")}
    if steps_given or "steps" not in doc:
        doc["steps"] = str(run.steps) if run.steps >= 0 else run.steps
    host = run.with_host_defaults(config.settings)
    for key, given, default in (("mode", run.mode, host.mode),
                                ("dispatch", run.dispatch, host.dispatch)):
        if given is not None or key not in doc:
            value = given if given is not None else default
            doc[key] = "in-process" if value == "inprocess" else value
    if run.pace is not None or "pacing" not in doc:
        doc["pacing"] = "realtime" if (run.pace if run.pace is not None else host.pace) \
            else "off"
    cadence = dict(doc.get("checkpoints") or {})
    knobs: list[tuple[str, float | None, float | None]] = [
        ("everySteps", run.checkpoint_every, host.checkpoint_every),
        ("everySeconds", run.checkpoint_seconds, host.checkpoint_seconds)]
    for name, wanted, fallback in knobs:
        if wanted is not None or cadence.get(name) is None:
            cadence[name] = wanted if wanted is not None else fallback
    doc["checkpoints"] = cadence
    if run.seed is not None:
        doc["seed"] = str(run.seed) if run.seed >= 0 else run.seed
        doc["agents"] = [{**a, "seed": None} for a in doc.get("agents") or []
                         if isinstance(a, dict)]
    if run.agents is not None:
        doc["agents"] = [{"agentId": a, "portId": f"p{i + 1}", "seed": None}
                         for i, a in enumerate(run.agents)]
    try:
        spec = RunSpec.validate(doc, max_agents=config.settings.session.max_agents)
        return spec.with_faults(list(run.faults)) if run.faults else spec
    except FaultSpecError as exc:
        raise CtlError("USAGE", exc.message) from None
    except RunSpecError as exc:
        raise CtlError("USAGE", f"{origin}: {exc.message}") from None


async def checkpoints_verify(opts: CtlOptions, path: Path | None, run_id: int | None,
                             checkpoint_id: str | None) -> Result:
    """R1–R8 on a file, or S1–S5 on a stored generation; a failing check exits 1."""
    from flyd.state.checkpoints import IntegrityError
    from flyd.state.envelope import EnvelopeError

    if (path is None) == (run_id is None):
        raise CtlError("USAGE", "pass either FILE or --run RUN")
    check: str | None = None
    reason: str | None = None
    if path is not None:
        try:
            _read_envelope(path)
        except EnvelopeError as exc:
            check, reason = exc.check, exc.reason
        what = str(path)
    else:
        assert run_id is not None
        async with _checkpoints(opts, _config(opts)) as store:
            try:
                record = await store.verify_stored(run_id, checkpoint_id)
                what = f"{record.checkpoint_id} of run {run_id}"
            except IntegrityError as exc:
                check, reason = exc.check, exc.message.split(f": {exc.check}: ", 1)[-1]
                what = f"run {run_id}"
            except DomainError as exc:
                raise _refused(exc) from None
    doc = {"ok": check is None, "check": check, "reason": reason}
    line = (f"flyctl checkpoints verify: {what}: ok" if check is None
            else f"flyctl checkpoints verify: {what}: {check}: {reason}")
    return Result(doc, [line], 0 if check is None else EXIT_FAILED)
