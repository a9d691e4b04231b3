"""`flyd run`: one session on this host through the queue, start to finish (design/cli.md §4).

Why: `flyd run` is the main job (the README's quick start). It is a node of capacity 1 that
submits one run and claims only that run, so its work is leased, fenced and recorded in the
effects ledger exactly as a `flyd serve` node's would be.

Sequence: build and validate the run spec from the options (exit 2, `USAGE`, naming the JSON
path or the fault spec) → resolve the configuration (design/cli.md §2; `CONFIG` on a bad key) → pick
the socket (design/cli.md §4.1) → start the node (`flyd.node.process.NodeProcess`: embedded
PostgreSQL under `<state-dir>/pg` when no DSN is configured, migrations, router child, node
connection, store) → submit the spec with `exclusiveToSubmitter: true` → run the lease runtime with
`only` = that run id until the run is terminal in the database → summary (design/cli.md §4.2) from
the run row, its effects and what this node saw → stop everything.

Decisions:
- `--spec FILE` (also `flyctl runs submit`): the file is normalised first, so its errors name
  its own JSON paths; then the options given on the command line (click's parameter source,
  `RunOptions.given`) replace its values, and a host default (`with_host_defaults`) fills only
  a key the file leaves out. `--agents` keeps the file's fields of an id it repeats; `--seed`
  switches every agent to derived seeds, as without a file; `startFrom` is refused (imports go
  through `flyctl checkpoints import`). `--model`/`--world` and their `--*-config` set every
  agent's and the world's, replacing (not merging) the configs; a refusal of what they set
  names the option (docs/cli.md, "A run spec from a file").
- `wallSeconds` is the whole command; `stepsPerSecond` is `advances` over the stepping time of
  the grant that finished the run (from `Ready(0)` to its last committed boundary).
- `behaviourDigest` and `epochs` come from the ledger (the `effects` payloads, design/cli.md §4.2).
  A failed run has no boundary effects (design/state.md §9.3); its digest is that of the behaviour
  records this node committed up to the failure, so a diagnosis can still compare runs.
- `checkpoints` counts the checkpoint generations the run committed (`0` until checkpoints are
  taken by the node).
- `worldProgress` is the world's `progressCounter` (`Worker.Status`) read before the reap, null
  when the world cannot answer; `counter` is the task's progress counter.
- `--trace PATH` writes the behaviour records (canonical JSON, one line each), also for a
  failed run; the file is created (truncated) before anything starts, so an unwritable path is
  `USAGE` (exit 2). A re-granted or recovered run appends to it: each grant's first line and
  each recovery's is a mark `{"resume": {boundary, cause, leaseEpoch, node[, epoch]}}`, and the
  records of re-executed transitions replace those they repeat, so every boundary is there
  once (`flyd.session.outputs.TraceFile`). A write error during the run (a full disk) fails
  the run at once (`{error: "output write failed", option, path, errno, message}`); the
  summary is printed as always.
- `--record FILE.gif` (`--record-every K`) and `--plot FILE.png` draw pictures of the committed
  boundaries (`flyd.cli.pictures`): the same `USAGE` rule for their paths, and a missing
  `flyd[pictures]` extra is `USAGE` naming it. An adapter world that renders draws only the
  frames the recording keeps: `--record-every K` sets its config's `render_every` to K when the
  spec sets none, and refuses one that does not divide K (docs/adapters.md, "Which boundaries
  render"). What they wrote (or why not) is printed on stderr at the end, in both output modes.
- The end-of-run poll and the summary's reads use a connection of their own that reconnects
  (the lease store's `ReadConnection`): a PostgreSQL blip that ends it is retried, never a
  crash that would leave the run `running`. A poll that still fails after `POLL_READ_S` is logged
  (`run.poll_failed`) and tried again at the next poll; the cancel request of a SIGINT is sent
  again at each poll until it is acknowledged. When the summary's ledger reads still fail after
  `SUMMARY_READ_S`, the summary is built from what this node saw (`run.summary_read_failed`).
- Human summary and progress go to stderr (design/cli.md §1); with `--json` the summary is the only
  stdout output.
- `outcome` (summary key) is why the run did not succeed, `{error, …}` (`flyd.outcome`), null
  for a succeeded run; an `attempts exhausted` run adds the reason this node lost its last
  lease. It is also printed on stderr in both modes: `flyd run: run N failed: <reason>`, the
  plugin's last traceback frames when a plugin failed (`flyd.outcome.traceback_of`), and
  `flyd run: outcome: <JSON>`.
- Progress: on a TTY a one-line bar on stderr, redrawn at most every 0.1 s; otherwise a
  `run.progress` log line every 5 s (step, steps, steps_per_s, epoch, recoveries).
- SIGINT: the first requests cancellation of the run (design/distribution.md §3.8); the node sees
  the flag in its next renewal and finishes the run `cancelled` at the next boundary; `flyd run`
  waits up to `[leases] drain_timeout_s` for that, stops everything and exits 130. A second
  SIGINT, or the wait running out, abandons at once (exit 130; a reaper ends the run). SIGTERM
  abandons at once, exit 143. The router and worker processes are reaped in every case (they
  also carry die-with-parent against a SIGKILL of `flyd run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, Any, Final

import orjson
import psycopg
import structlog

from flyd.cli.pictures import Pictures, frame_delay_ms, missing_extra
from flyd.config import Config, Settings, load_config
from flyd.errors import ConfigError
from flyd.launch.identities import new_node_id
from flyd.launch.spawner import add_import_roots
from flyd.leases import queries
from flyd.leases.migrate import MigrationError
from flyd.leases.stores.contract import TERMINAL, StoreError
from flyd.leases.stores.pg import ClosingConnection, ReadConnection
from flyd.logs import LogFlags
from flyd.node.grant import RunReport
from flyd.node.process import NodeProcess, NodeSetup, NodeStartError
from flyd.node.router_child import RouterChildError, choose_socket
from flyd.outcome import describe, failure_of, traceback_of
from flyd.session.runspec import (
    ADAPTER_WORLDS,
    DEFAULT_MAX_AGENTS,
    MAX_AGENTS_LIMIT,
    MAX_SPEC_BYTES,
    FaultSpecError,
    RunSpec,
    RunSpecError,
    is_import_path,
)

__all__ = ["RunOptions", "RunUsageError", "build_spec", "read_spec_file", "run_session"]

log = structlog.get_logger("flyd.cli.run")

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_INTERRUPTED: Final = 130
EXIT_TERMINATED: Final = 143
EPOCH: Final = "e1"
POLL_S: Final = 0.2
POLL_READ_S: Final = 5.0
SUMMARY_READ_S: Final = 30.0
PROGRESS_LOG_S: Final = 5.0
BAR_REDRAW_S: Final = 0.1
ACTOR: Final = "flyd run"


class RunUsageError(Exception):
    """A usage or configuration error (exit 2): `code` is `USAGE` or `CONFIG`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class RunOptions:
    """The options of a run spec; None leaves a choice to the host (`with_host_defaults`)."""

    steps: int = 600
    agents: tuple[str, ...] | None = None
    mode: str | None = None
    seed: int | None = None
    dispatch: str | None = None
    faults: tuple[str, ...] = ()
    trace: Path | None = None
    record: Path | None = None
    record_every: int = 1
    plot: Path | None = None
    pace: bool | None = None
    checkpoint_every: int | None = None
    checkpoint_seconds: float | None = None
    socket: str | None = None
    dsn: str | None = None
    state_dir: Path | None = None
    lease_ttl: float | None = None
    as_json: bool = False
    config_file: Path | None = None
    log: LogFlags = field(default_factory=LogFlags)
    spec_file: Path | None = None
    model: str | None = None
    model_config: str | None = None
    world: str | None = None
    world_config: str | None = None
    plugin_paths: tuple[Path, ...] = ()
    #: the spec options given on the command line (field names): with `spec_file`, only these
    #: override the file
    given: frozenset[str] = frozenset()

    def with_host_defaults(self, settings: Settings) -> RunOptions:
        """design/cli.md §2.3: `[session] mode`, `dispatch`, `pacing` and the `[checkpoints]`
        cadence are the defaults of the run specs this host builds; an option given on the command
        line wins."""
        session, checkpoints = settings.session, settings.checkpoints
        return dataclasses.replace(
            self, mode=self.mode or session.mode, dispatch=self.dispatch or session.dispatch,
            pace=session.realtime if self.pace is None else self.pace,
            checkpoint_every=(checkpoints.every_steps if self.checkpoint_every is None
                              else self.checkpoint_every),
            checkpoint_seconds=(checkpoints.every_seconds if self.checkpoint_seconds is None
                                else self.checkpoint_seconds))


# --------------------------------------------------------------------------------------------
# spec and configuration


def build_spec(opts: RunOptions, max_agents: int = DEFAULT_MAX_AGENTS, *,
               check_imports: bool = True) -> RunSpec:
    """The validated run spec of the options (design/cli.md §4 seeds), or of `--spec FILE` with the
    options given on the command line laid over it, for a host whose `[session] max_agents` is
    `max_agents`; `RunUsageError` otherwise. `check_imports` is the node's rule (every import
    path's module can be found here); a submitter that is no node leaves it to the node."""
    if opts.spec_file is None:
        doc = _options_doc(opts)
    else:
        doc = _file_doc(opts, check_imports)
    doc = _with_render_every(_with_shortcuts(doc, opts), opts)
    try:
        spec = RunSpec.validate(doc, max_agents=max_agents, check_imports=check_imports)
    except RunSpecError as exc:
        raise RunUsageError("USAGE", _shortcut_error(opts, exc)) from None
    if opts.faults:
        try:
            spec = spec.with_faults(list(opts.faults))
        except FaultSpecError as exc:
            raise RunUsageError("USAGE", exc.message) from None
    return spec


def _u64_field(value: int) -> int | str:
    """A spec's U64 text, a negative number kept as a number so that validation refuses it."""
    return str(value) if value >= 0 else value


def _mode_field(mode: str) -> str:
    return "in-process" if mode == "inprocess" else mode


def _options_doc(opts: RunOptions) -> dict[str, Any]:
    """The spec document of the options alone."""
    doc: dict[str, Any] = {"steps": _u64_field(opts.steps), "exclusiveToSubmitter": True}
    if opts.mode is not None:
        doc["mode"] = _mode_field(opts.mode)
    if opts.dispatch is not None:
        doc["dispatch"] = opts.dispatch
    if opts.pace is not None:
        doc["pacing"] = "realtime" if opts.pace else "off"
    cadence = {"everySteps": opts.checkpoint_every, "everySeconds": opts.checkpoint_seconds}
    if any(v is not None for v in cadence.values()):
        doc["checkpoints"] = {k: v for k, v in cadence.items() if v is not None}
    if opts.seed is not None:
        doc["seed"] = _u64_field(opts.seed)
    if opts.agents is not None or opts.seed is not None:
        ids = opts.agents if opts.agents is not None else ("fly-a", "fly-b")
        doc["agents"] = [{"agentId": a, "portId": f"p{i + 1}", "seed": None}
                         for i, a in enumerate(ids)]
    return doc


def read_spec_file(path: Path) -> dict[str, Any]:
    """The JSON object of a `--spec` file; `RunUsageError` naming the file otherwise."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise RunUsageError("USAGE", f"--spec {path}: cannot read: {exc.strerror}") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise RunUsageError("USAGE", f"--spec {path}: a run spec file is at most "
                                     f"{MAX_SPEC_BYTES} bytes (1 MiB)")
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RunUsageError("USAGE", f"--spec {path}: not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RunUsageError("USAGE", f"--spec {path}: a run spec is a JSON object; got "
                                     f"{type(doc).__name__}")
    return doc


def _file_doc(opts: RunOptions, check_imports: bool) -> dict[str, Any]:
    """The `--spec` file normalised (its own errors name its JSON paths), then the options
    given on the command line laid over it; a key the file leaves out takes the host's
    default (`with_host_defaults`) as a spec built from options alone would (README, "Your
    own run spec")."""
    assert opts.spec_file is not None
    raw = read_spec_file(opts.spec_file)
    if raw.get("startFrom") is not None:
        raise RunUsageError("USAGE", f"--spec {opts.spec_file}: run spec /startFrom: a run "
                                     "starts from a checkpoint only through `flyctl "
                                     "checkpoints import`")
    try:
        doc = RunSpec.validate(raw, max_agents=MAX_AGENTS_LIMIT,
                               check_imports=check_imports).to_json()
    except RunSpecError as exc:
        raise RunUsageError("USAGE", f"--spec {opts.spec_file}: {exc.message}") from None
    given = opts.given
    doc["exclusiveToSubmitter"] = True
    if "steps" in given:
        doc["steps"] = _u64_field(opts.steps)
    if opts.mode is not None and ("mode" in given or "mode" not in raw):
        doc["mode"] = _mode_field(opts.mode)
    if opts.dispatch is not None and ("dispatch" in given or "dispatch" not in raw):
        doc["dispatch"] = opts.dispatch
    if opts.pace is not None and ("pace" in given or "pacing" not in raw):
        doc["pacing"] = "realtime" if opts.pace else "off"
    file_cadence = raw.get("checkpoints") or {}
    for key, value, name in (("everySteps", opts.checkpoint_every, "checkpoint_every"),
                             ("everySeconds", opts.checkpoint_seconds, "")):
        if value is not None and (name in given or file_cadence.get(key) is None):
            doc["checkpoints"][key] = value
    if "agents" in given and opts.agents is not None:
        by_id = {a["agentId"]: a for a in doc["agents"]}
        doc["agents"] = [{**by_id.get(agent_id, {"seed": None}), "agentId": agent_id,
                          "portId": f"p{i + 1}"} for i, agent_id in enumerate(opts.agents)]
    if "seed" in given and opts.seed is not None:
        doc["seed"] = _u64_field(opts.seed)
        for agent in doc["agents"]:
            agent["seed"] = None
    return doc


def _config_option(option: str, text: str | None) -> dict[str, Any] | None:
    """`--model-config` / `--world-config`: a JSON object, or a usage error naming the option."""
    if text is None:
        return None
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise RunUsageError("USAGE", f"{option}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RunUsageError("USAGE", f"{option}: must be a JSON object; got "
                                     f"{type(value).__name__}")
    return value


def _with_shortcuts(doc: dict[str, Any], opts: RunOptions) -> dict[str, Any]:
    """`--model` / `--model-config` set every agent's, `--world` / `--world-config` the
    world's (a config replaces the spec's whole object, it is not merged into it)."""
    model_config = _config_option("--model-config", opts.model_config)
    world_config = _config_option("--world-config", opts.world_config)
    for option, value in (("--model", opts.model), ("--world", opts.world)):
        if value is not None and not is_import_path(value):
            raise RunUsageError("USAGE", f"{option}: must be an import path "
                                         f"package.module:Class; got {value!r}")
    if (opts.model, model_config, opts.world, world_config) == (None, None, None, None):
        return doc
    try:
        doc = RunSpec.validate(doc, max_agents=MAX_AGENTS_LIMIT).to_json()
    except RunSpecError as exc:
        raise RunUsageError("USAGE", exc.message) from None
    for agent in doc["agents"]:
        if opts.model is not None:
            agent["model"] = opts.model
        if model_config is not None:
            agent["modelConfig"] = model_config
    if opts.world is not None:
        doc["world"]["impl"] = opts.world
    if world_config is not None:
        doc["world"]["config"] = world_config
    return doc


def _with_render_every(doc: dict[str, Any], opts: RunOptions) -> dict[str, Any]:
    """`--record FILE --record-every K` renders an adapter world's view only at the boundaries
    the recording keeps: its config gets `render_every: K` when it renders and sets none; a
    `render_every` that does not divide K is refused (the recording would keep frames the env
    did not draw at their boundary). The run's behaviour (its views) follows from the spec it
    records, so the spec says so, not the recorder."""
    world = doc.get("world")
    if opts.record is None or not isinstance(world, dict) \
            or world.get("impl") not in ADAPTER_WORLDS:
        return doc
    config = world.get("config")
    if not isinstance(config, dict) or config.get("render") is not True:
        return doc
    every = config.get("render_every")
    if every is None:
        if opts.record_every == 1:
            return doc
        return {**doc, "world": {**world, "config": {**config, "render_every": opts.record_every}}}
    if not isinstance(every, int) or isinstance(every, bool) or every < 1 \
            or opts.record_every % every:
        raise RunUsageError("USAGE", f"--record-every {opts.record_every}: the world config's "
                                     f"render_every {every!r} does not divide it, so the "
                                     "recording would keep frames the env did not draw; drop "
                                     "render_every from the spec or make it divide "
                                     f"{opts.record_every}")
    return doc


def _shortcut_error(opts: RunOptions, exc: RunSpecError) -> str:
    """A refusal of a field a shortcut set names the option, else the spec's JSON path."""
    parts = exc.path.split("/")
    if opts.model is not None and len(parts) == 4 and parts[1] == "agents" \
            and parts[3] == "model":
        return f"--model {opts.model}: {exc.reason}"
    if opts.world is not None and exc.path == "/world/impl":
        return f"--world {opts.world}: {exc.reason}"
    return exc.message


def node_setup(opts: RunOptions, config: Config, spec: RunSpec) -> NodeSetup:
    """A capacity-1 node on the design/cli.md §4.1 socket whose budget fits the run."""
    settings = config.settings
    bus, node = settings.bus, settings.node
    forced = opts.socket
    if forced is None and bus.socket_given:
        forced = bus.socket
    socket, private = choose_socket(forced)
    origin = bus.socket_origin if forced else "default"
    if private:
        print(f"flyd run: a router answers on the default socket; using the private socket "
              f"{socket}", file=sys.stderr)
    else:
        print(f"flyd run: router socket {socket}", file=sys.stderr)
    threads = max(node.threads, spec.thread_need(node.coordinator_reservation))
    return NodeSetup(settings=settings, node_id=new_node_id(node.name), node_name=node.name,
                     socket=socket, state_dir=node.state_dir, capacity=1,
                     threads=threads, router_quiet=config.log_settings(opts.log).router_quiet,
                     socket_origin=origin)


class Progress:
    """A bar on a TTY, else a `run.progress` log line every 5 s (design/cli.md §4)."""

    def __init__(self, total: int, tty: bool) -> None:
        self.total = total
        self.tty = tty
        self.done = 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self._task: asyncio.Task[None] | None = None

    def rate(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        if not self.tty:
            self._task = asyncio.get_running_loop().create_task(self._log_every())

    async def _log_every(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_LOG_S)
            log.info("run.progress", step=self.done, steps=self.total,
                     steps_per_s=round(self.rate(), 1), epoch=EPOCH, recoveries=0)

    def update(self, done: int) -> None:
        self.done = done
        if not self.tty:
            return
        now = time.monotonic()
        if done < self.total and now - self._drawn < BAR_REDRAW_S:
            return
        self._drawn = now
        width = 30
        filled = width * done // max(1, self.total)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r[{bar}] {done}/{self.total} steps  {self.rate():.1f} steps/s  "
                         f"epoch {EPOCH}  recoveries 0 ")
        sys.stderr.flush()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.tty and self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()


# --------------------------------------------------------------------------------------------
# the run


class _Signals:
    """SIGINT: first → cancel the run and wait for its end; second → abandon. SIGTERM → abandon."""

    def __init__(self) -> None:
        self.cancel = asyncio.Event()
        self.abandon = asyncio.Event()
        self.exit_code: int | None = None
        self._loop = asyncio.get_running_loop()

    def install(self) -> None:
        self._loop.add_signal_handler(signal.SIGINT, self._sigint)
        self._loop.add_signal_handler(signal.SIGTERM, self._sigterm)

    def remove(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._loop.remove_signal_handler(sig)

    def _sigint(self) -> None:
        if self.exit_code is None:
            self.exit_code = EXIT_INTERRUPTED
            self.cancel.set()
            log.warning("run.interrupted", detail="cancelling the run at the next boundary; "
                                                  "press Ctrl-C again to abandon at once")
            return
        self.abandon.set()

    def _sigterm(self) -> None:
        self.exit_code = EXIT_TERMINATED
        self.abandon.set()


async def run_session(opts: RunOptions) -> int:
    """`flyd run`; returns the exit code (prints the summary or the error)."""
    try:
        config = load_config(opts.config_file, flags={
            "database.dsn": opts.dsn, "node.state_dir": opts.state_dir,
            "leases.ttl_s": opts.lease_ttl, "bus.socket": opts.socket,
            "node.log_format": opts.log.format, "plugins.paths": opts.plugin_paths or None})
        config.log_settings(opts.log).apply()
        add_import_roots(config.settings.session.launcher.plugin_paths)
        opts = opts.with_host_defaults(config.settings)
        spec = build_spec(opts, config.settings.session.max_agents)
        if opts.trace is not None:
            try:
                opts.trace.write_bytes(b"")
            except OSError as exc:
                raise RunUsageError("USAGE", f"--trace {opts.trace}: cannot write: "
                                             f"{exc.strerror}") from None
        setup = node_setup(opts, config, spec)
        pictures = _open_pictures(opts, spec)
    except ConfigError as exc:
        return _error(opts, "CONFIG", str(exc))
    except RunUsageError as exc:
        return _error(opts, exc.code, exc.message)
    try:
        return await _run_node(opts, spec, setup, pictures)
    finally:
        if pictures is not None:
            for note in pictures.finish():
                print(f"flyd run: {note}", file=sys.stderr, flush=True)


def _open_pictures(opts: RunOptions, spec: RunSpec) -> Pictures | None:
    """`--record` and `--plot`: their extra is installed and their files can be written, or
    `RunUsageError` before anything starts (`flyd.cli.pictures`)."""
    if opts.record is None and opts.plot is None:
        return None
    if opts.record_every < 1:
        raise RunUsageError("USAGE", f"--record-every: must be at least 1; got "
                                     f"{opts.record_every}")
    for option, path in (("--record", opts.record), ("--plot", opts.plot)):
        if path is None:
            continue
        missing = missing_extra(option)
        if missing is not None:
            raise RunUsageError("USAGE", missing)
    if opts.plot is not None:
        _writable("--plot", opts.plot).close()
    record: tuple[Path, IO[bytes], int, int] | None = None
    if opts.record is not None:
        step_ns = spec.world.step.numerator / spec.world.step.denominator
        record = (opts.record, _writable("--record", opts.record), opts.record_every,
                  frame_delay_ms(step_ns, opts.record_every))
    return Pictures(record, opts.plot)


def _writable(option: str, path: Path) -> IO[bytes]:
    """The file created (truncated) for writing, or `RunUsageError` naming the option."""
    try:
        return path.open("wb")
    except OSError as exc:
        raise RunUsageError("USAGE", f"{option} {path}: cannot write: {exc.strerror}") from None


async def _run_node(opts: RunOptions, spec: RunSpec, setup: NodeSetup,
                    pictures: Pictures | None) -> int:
    signals = _Signals()
    signals.install()
    node = NodeProcess(setup)
    started = time.monotonic()
    try:
        try:
            await node.start()
        except (NodeStartError, RouterChildError, ConfigError, MigrationError,
                StoreError, psycopg.Error) as exc:
            return _error(opts, "CONFIG", getattr(exc, "message", None) or str(exc))
        leases = setup.settings.leases
        run_id, report, row = await _execute(node, spec, leases.max_attempts, signals,
                                             leases.drain_timeout_s, opts.trace, pictures)
        try:
            ledger = await _fold_ledger(node.dsn, run_id)
            checkpoints = await _count_checkpoints(node.dsn, run_id)
        except (psycopg.Error, TimeoutError, OSError) as exc:
            log.error("run.summary_read_failed", run=run_id,
                      error=f"{type(exc).__name__}: {exc}")
            ledger, checkpoints = queries.LedgerFold(), 0
    finally:
        signals.remove()
        await node.close()
    if report is not None and report.trace is not None:
        error = report.trace.close()
        if error is not None:
            print(f"flyd run: {error}", file=sys.stderr, flush=True)
    summary = _summary(spec, run_id, row, report, ledger, checkpoints,
                       time.monotonic() - started)
    _print_summary(opts, summary)
    if signals.exit_code is not None:
        return signals.exit_code
    return EXIT_OK if summary["state"] == "succeeded" else EXIT_FAILED


async def _execute(node: NodeProcess, spec: RunSpec, max_attempts: int, signals: _Signals,
                   drain_s: float, trace: Path | None, pictures: Pictures | None,
                   ) -> tuple[int, RunReport | None, dict[str, Any] | None]:
    """Submit, serve only that run until it is terminal (or abandoned), stop the runtime."""
    assert node.store is not None and node.executor is not None
    submitted = await node.store.submit(None, spec.to_json(), max_attempts)
    run_id = submitted.run_id
    log.info("run.submitted", run=run_id, node=node.setup.node_id)
    progress = Progress(spec.steps, sys.stderr.isatty())
    node.executor.on_progress = lambda r: progress.update(r.boundary)
    node.executor.on_recovery = _print_recovery
    node.executor.keep_reports = True
    node.executor.trace_path = trace
    if pictures is not None:
        node.executor.on_boundary = lambda _report, sample: pictures.observe(sample)
    progress.start()
    runtime = node.make_runtime(only=run_id)
    row: dict[str, Any] | None = None
    try:
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(node.run_runtime(runtime))
            row = await _await_end(node, run_id, signals, serving, drain_s)
            runtime.stop()
    finally:
        await progress.stop()
    return run_id, node.executor.reports.get(run_id), row


async def _await_end(node: NodeProcess, run_id: int, signals: _Signals,
                     serving: asyncio.Task[int], drain_s: float) -> dict[str, Any] | None:
    """Poll the run row until it is terminal; a SIGINT cancels it (waiting at most `drain_s`),
    a second signal or the runtime's own end stops waiting. A poll or cancel request that
    meets a lost database session is tried again at the next poll (module decisions)."""
    assert node.store is not None
    cancel_deadline: float | None = None
    cancel_sent = False
    row: dict[str, Any] | None = None
    reads = ReadConnection(node.dsn, within_s=POLL_READ_S)
    try:
        while True:
            try:
                row = await reads.read(partial(queries.run_row, run_id=run_id), "poll run")
            except (psycopg.Error, TimeoutError, OSError) as exc:
                log.warning("run.poll_failed", run=run_id, error=f"{type(exc).__name__}: {exc}")
            if row is not None and row["state"] in TERMINAL:
                return row
            if signals.abandon.is_set() or serving.done():
                return row
            if signals.cancel.is_set() and cancel_deadline is None:
                cancel_deadline = time.monotonic() + drain_s
            if cancel_deadline is not None and not cancel_sent:
                try:
                    await node.store.cancel(run_id, ACTOR)
                    cancel_sent = True
                except StoreError as exc:
                    log.warning("run.cancel_failed", run=run_id, error=exc.message)
            if cancel_deadline is not None and time.monotonic() > cancel_deadline:
                log.warning("run.cancel_timeout", run=run_id, waited_s=drain_s)
                return row
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await signals.abandon.wait()
    finally:
        await reads.close()


async def _fold_ledger(dsn: str, run_id: int) -> queries.LedgerFold:
    reads = ReadConnection(dsn, within_s=SUMMARY_READ_S)
    try:
        return await reads.read(partial(queries.fold_ledger, run_id=run_id), "fold the ledger")
    finally:
        await reads.close()


async def _count_checkpoints(dsn: str, run_id: int) -> int:
    """Generations the run committed: distinct checkpoint ids its effects and head name."""
    async def op(conn: ClosingConnection) -> int:
        cur = await conn.execute(
            "SELECT count(DISTINCT checkpoint_id) FROM flyd.effects "
            "WHERE run_id = %(run)s AND checkpoint_id IS NOT NULL", {"run": run_id})
        found = await cur.fetchone()
        return int(found[0]) if found is not None else 0

    reads = ReadConnection(dsn, within_s=SUMMARY_READ_S)
    try:
        return await reads.read(op, "count checkpoints")
    finally:
        await reads.close()


def _summary(spec: RunSpec, run_id: int, row: dict[str, Any] | None, report: RunReport | None,
             ledger: queries.LedgerFold, checkpoints: int, wall: float) -> dict[str, Any]:
    outcome: dict[str, Any] = dict(row.get("outcome") or {}) if row is not None else {}
    state = row["state"] if row is not None and row["state"] in TERMINAL else "cancelled"
    digest, epochs = ledger.digest(), ledger.epochs
    if not ledger.count and report is not None:
        digest = report.records.digest()
    advances = report.advances if report is not None else 0
    step_seconds = report.step_seconds if report is not None else 0.0
    failures: list[dict[str, Any]] = []
    if report is not None:
        failures = list(report.failures)
        if report.failure is not None and report.failure not in failures:
            failures.append(report.failure)
    ended = row is not None and row["state"] in TERMINAL
    reason = failure_of(state if ended else "abandoned",
                        row.get("outcome") if row is not None and ended else None,
                        last_loss=report.lost_reason if report is not None else None)
    return {
        "run": run_id,
        "state": state,
        "steps": spec.steps,
        "boundary": int(outcome.get("boundary", report.boundary if report else 0)),
        "epochs": outcome.get("epochs") or epochs or [EPOCH],
        "recoveries": int(outcome.get("recoveries", 0)),
        "advances": int(outcome.get("advances", advances)),
        "checkpoints": checkpoints,
        "behaviourDigest": outcome.get("behaviourDigest", digest),
        "worldProgress": report.world_progress if report is not None else None,
        "counter": report.counter if report is not None else None,
        "wallSeconds": round(wall, 3),
        "stepsPerSecond": round(advances / step_seconds, 1) if step_seconds > 0 else 0.0,
        "mode": spec.mode,
        "workers": report.workers if report is not None else [],
        "failures": failures,
        "outcome": reason,
    }


def _print_recovery(report: RunReport, info: dict[str, Any]) -> None:
    """design/cli.md §4: one line per recovery naming the failed participant, the failure code and
    the checkpoint boundary restored."""
    who = info.get("participant") or "the session"
    print(f"flyd run: recovered run {report.run_id} from {info['code']} of {who}: resumed at "
          f"boundary {info['boundary']} in epoch {info['epoch']}", file=sys.stderr, flush=True)


def _print_summary(opts: RunOptions, summary: dict[str, Any]) -> None:
    """The summary; a run that did not succeed also prints its reason on stderr (one line
    naming it, then the outcome as JSON), in both output modes (`flyd.outcome`)."""
    if opts.as_json:
        sys.stdout.write(orjson.dumps(summary).decode() + "\n")
        sys.stdout.flush()
    else:
        line = (f"flyd run: run {summary['run']} {summary['state']} at boundary "
                f"{summary['boundary']}/{summary['steps']} ({summary['mode']}), "
                f"{summary['stepsPerSecond']} steps/s in {summary['wallSeconds']}s; counter "
                f"{summary['counter']}, behaviour digest {summary['behaviourDigest']}")
        print(line, file=sys.stderr)
        for failure in summary["failures"]:
            who = f" ({failure['participant']})" if failure["participant"] else ""
            print(f"flyd run: failure: {failure['detail']}{who}: {failure['code']}: "
                  f"{failure['message']}", file=sys.stderr)
    reason = summary["outcome"]
    if reason is not None:
        print(f"flyd run: run {summary['run']} {summary['state']}: {describe(reason)}",
              file=sys.stderr)
        frames = traceback_of(reason)
        if frames:
            print("flyd run: traceback (innermost last):", file=sys.stderr)
            for frame in frames:
                print(f"flyd run:   {frame}", file=sys.stderr)
        print(f"flyd run: outcome: {orjson.dumps(reason).decode()}", file=sys.stderr)
    sys.stderr.flush()


def _error(opts: RunOptions, code: str, message: str) -> int:
    """The error line on stderr, and with `--json` the error object on stdout too (as
    `flyctl` reports them)."""
    print(f"flyd run: {message}", file=sys.stderr)
    if opts.as_json:
        sys.stdout.write(orjson.dumps({"error": {"code": code, "message": message}}).decode()
                         + "\n")
    return EXIT_USAGE


def parse_agents(text: str) -> tuple[str, ...]:
    """`fly-a,fly-b` → ids (empty items are kept so that validation names them)."""
    return tuple(part.strip() for part in text.split(","))
