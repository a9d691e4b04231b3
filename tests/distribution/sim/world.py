"""One tier-1 seed (distribution.md §7.2): scenario, nodes, faults, phases, history.

Rules:
- A seed and a scenario kind fix everything: node count (2–3), capacities, clock offsets and
  rates (within 1 ± 0.9ρ), runs (3–8, 20–120 boundaries), the fault schedule and every delay,
  all drawn from named `Streams`. Production `NodeRuntime` runs unchanged (a canary variant may
  subclass it or the store inside the simulator only).
- Phases: the fault phase (≤ 240 s) applies the schedule (faults start within the first
  seconds, while runs are held) and ends once every fault has been applied and every run is
  terminal, or at its length; the liveness phase heals every link,
  resumes paused nodes, restarts crashed or drained ones (each restart is a new node_id), adds
  no fault, and runs until every run is terminal or the L1 bound has passed; then every node is
  stopped and the history is judged by `tests.distribution.oracle`.
- The history is one JSON-able record: node events (local `t` and `true` time), table dumps
  (instants as store seconds, no envelope bytes), the store tap, and the harness log (spawned
  runs, faults, node lifetimes and pauses, kills, samples, final heal, reference digests).
  `digest()` hashes the JSON of what happened (events, tables, tap, faults, lifetimes, kills):
  the trace digest, equal for a seed in any process and under any `PYTHONHASHSEED`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import itertools
import json
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import structlog

from flyd.leases.params import LeaseParams
from flyd.leases.runtime import NodeRuntime
from flyd.leases.stores.contract import TERMINAL, Cancelled, NodeInfo, Transient
from flyd.leases.stores.mem import MemStore
from tests.admin_store import AdminMemStore

from .executor import SimExecutor, SimGroups, reference
from .loop import Gate, SimClock, VirtualTimeLoop
from .net import Link, SimStore, Streams, Tap

PARAMS: Final = LeaseParams.short_ttl()
KINDS: Final = ("mixed", "partitions", "latency", "crash_pause", "skew", "cancel_exhaust_drain",
                "unknown_commit", "delayed_cancel")
MAX_FAULT_PHASE_S: Final = 240.0
SAMPLE_S: Final = 1.0
POLL_S: Final = 0.25
NULL_LOG: Final = structlog.wrap_logger(
    structlog.PrintLogger(io.StringIO()),
    wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))


@dataclass(frozen=True)
class Variant:
    """How a canary breaks the system (all off: the real thing)."""

    name: str = "real"
    runtime: type[NodeRuntime] = NodeRuntime
    store: type[AdminMemStore] = AdminMemStore
    behind_head: bool = False


@dataclass
class Fault:
    at: float
    kind: str
    node: int = 0
    dur: float = 0.0
    mode: str = ""
    direction: str = ""
    delay: float = 0.0
    run: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v not in ("", 0, 0.0)
                or k in ("at", "kind", "node")}


@dataclass
class RunSpec:
    key: str
    boundaries: int
    pace: float
    every: int
    #: the run's own grant budget, submitted with it (`runs.max_attempts`)
    max_attempts: int = PARAMS.max_attempts

    def spec(self) -> dict[str, Any]:
        return {"key": self.key, "boundaries": self.boundaries, "pace": self.pace,
                "every": self.every}


@dataclass
class NodeSpec:
    name: str
    capacity: int
    offset: float
    rate: float


@dataclass
class Scenario:
    seed: int
    kind: str
    nodes: list[NodeSpec]
    runs: list[RunSpec]
    faults: list[Fault]
    fault_phase_s: float
    cancel_delay_p: float


def scenario(seed: int, kind: str) -> Scenario:
    """Draw the scenario of `seed` for `kind` (see the module rules)."""
    if kind not in KINDS:
        raise ValueError(f"unknown scenario kind {kind!r}")
    s = Streams(seed)
    shape = s("shape")
    rho = PARAMS.clock_rate_bound
    n_nodes = shape.randint(2, 3)
    nodes = []
    for i in range(n_nodes):
        rate = 1.0 + shape.uniform(-0.9, 0.9) * rho
        nodes.append(NodeSpec(f"n{i + 1}", shape.randint(1, 2), shape.uniform(0, 1000), rate))
    if kind == "skew":
        nodes[0].rate = 1 - 0.9 * rho
        nodes[1].rate = 1 + 0.9 * rho
    runs = []
    for i in range(shape.randint(3, 8)):
        total = shape.randint(20, 120)
        runs.append(RunSpec(f"run-{i + 1}", total, round(shape.uniform(0.01, 0.04), 4),
                            shape.randint(4, 12)))
    # Some runs carry a budget below the nodes' `[leases] max_attempts`, drawn from a stream of
    # its own so the other draws of a seed stay as they were.
    budget = s("budget")
    for r in runs:
        r.max_attempts = budget.choice([1, 2, PARAMS.max_attempts, PARAMS.max_attempts])
    f = s("faults")
    T = PARAMS.T
    phase = 60.0
    faults: list[Fault] = []

    def at() -> float:
        return round(f.uniform(0.3, 3.5), 4)

    def link(mode: str | None = None, delay: float | None = None) -> Fault:
        m = mode or f.choice(["hold", "drop", "delay", "hold", "drop"])
        d = delay if delay is not None else (round(f.uniform(0.05, 1.5 * T), 4)
                                             if m == "delay" else 0.0)
        return Fault(at(), "link", f.randrange(n_nodes), round(f.uniform(1.0, 3 * T), 4), m,
                     f.choice(["up", "down", "both", "both"]), d)

    def crash() -> Fault:
        return Fault(at(), "crash", f.randrange(n_nodes), round(f.uniform(0.5, 6.0), 4))

    def pause() -> Fault:
        return Fault(at(), "pause", f.randrange(n_nodes), round(f.uniform(1.0, 3 * T), 4))

    def other(k: str) -> Fault:
        return Fault(at(), k, f.randrange(n_nodes), run=f.randint(1, len(runs)))

    cancel_p = 0.3
    if kind == "mixed":
        pool: list[Callable[[], Fault]] = [
            link, link, link, crash, pause, lambda: other("backend_kill"),
            lambda: other("cancel"), lambda: other("drain")]
        for _ in range(f.randint(1, 4)):
            faults.append(f.choice(pool)())
    elif kind == "partitions":
        for _ in range(f.randint(2, 3)):
            faults.append(link(f.choice(["hold", "drop"])))
    elif kind == "latency":
        for _ in range(f.randint(2, 3)):
            fl = link("delay", round(f.uniform(0.2, 0.7), 4))
            fl.direction = f.choice(["up", "down", "both"])
            fl.dur = round(f.uniform(2 * T, 3 * T), 4)
            faults.append(fl)
    elif kind == "crash_pause":
        c = crash()
        faults.append(c)
        faults.append(Fault(round(max(0.1, c.at - 1.0), 4), "link", c.node, 8.0, "delay", "up",
                            round(f.uniform(0.3, 3.0), 4)))
        p = pause()
        p.dur = round(f.uniform(1.25 * T, 3 * T), 4)
        faults.append(p)
    elif kind == "skew":
        faults.append(Fault(at(), "link", 0, 3 * T, "hold", "both"))
    elif kind == "cancel_exhaust_drain":
        phase = 90.0
        runs[0].boundaries = max(runs[0].boundaries, 60)
        runs[0].pace = max(runs[0].pace, 0.08)
        runs[0].max_attempts = PARAMS.max_attempts  # hunted to exhaustion: the full budget
        faults.append(Fault(0.0, "hunt", run=1))
        faults.append(Fault(round(f.uniform(1.0, 4.0), 4), "cancel", run=f.randint(2, len(runs))))
        faults.append(Fault(round(f.uniform(1.0, 6.0), 4), "drain", f.randrange(n_nodes)))
    elif kind == "unknown_commit":
        for r in runs:
            r.every = f.randint(2, 4)
        for _ in range(f.randint(2, 4)):
            faults.append(other("backend_kill"))
        for _ in range(f.randint(1, 3)):
            fl = link(f.choice(["hold", "drop", "delay"]), round(f.uniform(0.3, 1.0), 4))
            fl.direction = "down"
            fl.dur = round(f.uniform(1.0, 2.5), 4)
            faults.append(fl)
    elif kind == "delayed_cancel":
        cancel_p = 1.0
        for _ in range(f.randint(1, 3)):
            faults.append(link(f.choice(["hold", "drop"])))
        faults.append(crash())
    faults.sort(key=lambda x: (x.at, x.kind, x.node))
    return Scenario(seed, kind, nodes, runs, faults, min(phase, MAX_FAULT_PHASE_S), cancel_p)


class EventSink(list[dict[str, Any]]):
    """The runtime's `events` list: stamps true time and a sequence; silent once crashed."""

    def __init__(self, node: Incarnation) -> None:
        super().__init__()
        self._node = node

    def append(self, item: dict[str, Any]) -> None:
        if self._node.crashed:
            return
        self._node.sim.add_event(item)


class Incarnation:
    """One process of a node: a node_id, its link, clock, gate, store client and runtime."""

    def __init__(self, sim: Sim, spec: NodeSpec, generation: int) -> None:
        self.sim = sim
        self.spec = spec
        loop = sim.loop
        ids = sim.streams(f"node-id:{spec.name}:{generation}")
        self.node_id = f"{spec.name}-{ids.getrandbits(48):012x}"
        self.gate = Gate(loop)
        self.clock = SimClock(loop, self.gate, offset=spec.offset, rate=spec.rate)
        self.link = Link(loop)
        self.store = SimStore(sim.mem, sim.tap, self.link, self.gate, self.clock, self.node_id,
                              sim.streams(f"commit:{self.node_id}"), PARAMS.commit_timeout_s)
        self.groups = SimGroups(self)
        self._cancel_rng = sim.streams(f"cancel-delay:{self.node_id}")
        self.crashed = False
        self.stopped = False
        self.exited = False
        executor = SimExecutor(self, behind_head=sim.variant.behind_head)
        self.runtime = sim.variant.runtime(
            params=PARAMS, store=self.store, clock=self.clock, executor=executor,
            groups=self.groups,
            node=NodeInfo(self.node_id, spec.name, "sim", 1000 + generation, "sim",
                          spec.capacity),
            capacity=spec.capacity, seed=ids.getrandbits(64), log=NULL_LOG,
            events=EventSink(self))
        self.task: asyncio.Task[int] | None = None
        self.entry: dict[str, Any] = {
            "node_id": self.node_id, "name": spec.name, "capacity": spec.capacity,
            "rate": spec.rate, "offset": spec.offset, "start": [loop.time(), self.clock.now()],
            "end": None, "how": None, "pauses": []}
        sim.nodes_log.append(self.entry)

    def cancel_delay(self) -> float:
        if self._cancel_rng.random() >= self.sim.scenario.cancel_delay_p:
            return 0.0
        return round(self._cancel_rng.uniform(0.01, 0.4), 4)

    @property
    def live(self) -> bool:
        return not (self.crashed or self.stopped or self.exited or self.gate.paused)

    def end(self, how: str) -> None:
        if self.entry["end"] is None:
            self.entry["end"] = [self.sim.loop.time(), self.clock.now()]
            self.entry["how"] = how

    def crash(self) -> None:
        if self.crashed or self.stopped:
            return
        self.end("crash")
        land = self.sim.streams(f"land:{self.node_id}")
        self.link.sever(lambda: land.random() < 0.5)
        self.crashed = True
        self.groups.die_with_parent()
        if self.gate.paused:
            self.resume()
        if self.task is not None:
            self.task.cancel()

    def pause(self) -> None:
        if not self.live:
            return
        self.gate.pause()
        self.entry["pauses"].append([self.sim.loop.time(), None, self.clock.now(), None])

    def resume(self) -> None:
        if not self.gate.paused:
            return
        p = self.entry["pauses"][-1]
        p[1], p[3] = self.sim.loop.time(), self.clock.now()
        self.gate.resume()


class Sim:
    """One seed end to end: `await Sim(...).main()` returns the history record."""

    def __init__(self, loop: VirtualTimeLoop, scenario_: Scenario, variant: Variant) -> None:
        self.loop = loop
        self.scenario = scenario_
        self.variant = variant
        self.streams = Streams(scenario_.seed)
        self.mem = variant.store(loop.time,
                                 idle_in_transaction_timeout_s=PARAMS.idle_in_transaction_timeout_ms
                                 / 1000)
        self.tap = Tap(self.mem)
        self.events: list[dict[str, Any]] = []
        self.nodes_log: list[dict[str, Any]] = []
        self.kills: list[dict[str, Any]] = []
        self.faults_log: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.stats: dict[str, int] = {"late_refused": 0, "late_through": 0}
        self._seq = itertools.count()
        self.current: list[Incarnation] = []
        self._generation = itertools.count()
        self._tg: asyncio.TaskGroup | None = None
        self._restarts: dict[int, asyncio.TimerHandle] = {}
        self.run_ids: list[int] = []
        self.final_heal: float | None = None
        self._stopping = False

    # -- history ---------------------------------------------------------------------------
    def add_event(self, item: dict[str, Any]) -> None:
        item["true"] = self.loop.time()
        item["seq"] = next(self._seq)
        self.events.append(item)

    def log_kill(self, node_id: str, run_id: int, how: str) -> None:
        self.kills.append({"true": self.loop.time(), "node": node_id, "run": run_id, "how": how})

    def log_fault(self, fault: Fault, **extra: Any) -> None:
        self.faults_log.append({"true": self.loop.time(), **fault.as_dict(), **extra})

    # -- nodes -----------------------------------------------------------------------------
    def start(self, index: int) -> Incarnation:
        if self._tg is None:
            raise RuntimeError("nodes start inside main()")
        node = Incarnation(self, self.scenario.nodes[index], next(self._generation))
        self.current[index] = node
        node.task = self._tg.create_task(self._run_node(node))
        return node

    async def _run_node(self, node: Incarnation) -> int:
        try:
            code = await node.runtime.run()
        except asyncio.CancelledError:
            return 137
        node.exited = True
        node.end(node.entry["how"] or "exit")
        return code

    def _restart_later(self, index: int, delay: float) -> None:
        if index in self._restarts or self._stopping:
            return

        def go() -> None:
            self._restarts.pop(index, None)
            old = self.current[index]
            if old.crashed or old.exited:
                self.start(index)

        self._restarts[index] = self.loop.call_at(self.loop.time() + delay, go)

    # -- faults ----------------------------------------------------------------------------
    async def _apply(self, fault: Fault) -> None:
        await asyncio.sleep(max(0.0, fault.at - self.loop.time()))
        node = self.current[fault.node]
        if fault.kind == "link":
            directions = [node.link.up, node.link.down] if fault.direction == "both" else [
                node.link.up if fault.direction == "up" else node.link.down]
            for d in directions:
                node.link.set_mode(d, fault.mode, fault.delay)  # type: ignore[arg-type]
            self.log_fault(fault, node_id=node.node_id)
            self.loop.call_at(self.loop.time() + fault.dur, self._heal_link, node, fault)
        elif fault.kind == "crash":
            self.log_fault(fault, node_id=node.node_id)
            node.crash()
            self._restart_later(fault.node, fault.dur)
        elif fault.kind == "pause":
            if node.live:
                self.log_fault(fault, node_id=node.node_id)
                node.pause()
                self.loop.call_at(self.loop.time() + fault.dur, node.resume)
        elif fault.kind == "backend_kill":
            self.log_fault(fault, ended=self.mem.terminate_backends())
        elif fault.kind == "cancel":
            got = await self._client_cancel(self.run_ids[fault.run - 1])
            self.log_fault(fault, run_id=self.run_ids[fault.run - 1],
                           result=None if got is None else got.state)
        elif fault.kind == "drain":
            if node.live:
                self.log_fault(fault, node_id=node.node_id)
                node.entry["how"] = "drain"
                node.runtime.drain()
                self._restart_when_done(fault.node, node)
        elif fault.kind == "hunt":
            await self._hunt(self.run_ids[fault.run - 1], fault)

    async def _client_cancel(self, run_id: int) -> Cancelled | None:
        """A client's cancel (3.8), retried while a finishing commit holds the row lock."""
        while True:
            try:
                return await self.mem.cancel(run_id, "sim-client")
            except Transient:
                await asyncio.sleep(0.05)

    def _heal_link(self, node: Incarnation, fault: Fault) -> None:
        if not node.crashed:
            node.link.heal()
            self.faults_log.append({"true": self.loop.time(), "kind": "heal",
                                    "node_id": node.node_id})

    def _restart_when_done(self, index: int, node: Incarnation) -> None:
        task = node.task
        if task is not None:
            task.add_done_callback(lambda _t: self._restart_later(index, 1.0))

    async def _hunt(self, run_id: int, fault: Fault) -> None:
        """Crash whichever node holds `run_id` shortly after each grant (attempts exhausted)."""
        rng = self.streams("hunt")
        seen = 0
        while self.final_heal is None:
            await asyncio.sleep(0.1)
            row = self.mem._runs[run_id]
            if row.state != "running" or row.lease_epoch <= seen or row.owner_node is None:
                if row.state in TERMINAL:
                    return
                continue
            seen = row.lease_epoch
            owner = row.owner_node
            await asyncio.sleep(rng.uniform(0.3, 1.2))
            for i, node in enumerate(self.current):
                if node.node_id == owner and not node.crashed:
                    self.log_fault(fault, node_id=owner, epoch=seen, run_id=run_id)
                    node.crash()
                    self._restart_later(i, rng.uniform(0.5, 2.0))

    # -- phases ----------------------------------------------------------------------------
    def l1_bound(self) -> float:
        p = PARAMS
        return (p.T + 2 * p.claim_poll_s * 1.2 + p.reap_interval_s * 1.2
                + p.max_attempts * (self.longest_run() + 0.0))

    def longest_run(self) -> float:
        return max(r.boundaries * r.pace * (1 + PARAMS.clock_rate_bound)
                   + (r.boundaries // r.every + 1) * PARAMS.commit_timeout_s
                   for r in self.scenario.runs)

    def _sample(self) -> None:
        now = self.loop.time()
        runs = [[r.run_id, r.state, r.lease_expires_at, r.attempt]
                for r in (self.mem._runs[k] for k in self.run_ids)]
        free = [[n.node_id, n.runtime.core.free_capacity(n.clock.now())]
                for n in self.current if n.live]
        self.samples.append({"true": now, "runs": runs, "free": free})

    async def _sampler(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(SAMPLE_S)

    def _settled(self, faults: list[asyncio.Task[None]]) -> bool:
        """Every fault applied and every run terminal: the fault phase has nothing left to
        bite on (faults still in effect end at the final heal)."""
        return all(t.done() for t in faults) and self._all_terminal()

    async def _poll(self, done: Callable[[], bool], deadline: float) -> None:
        """Look at the store every `POLL_S` until `done()` or `deadline` (true time)."""
        while self.loop.time() < deadline:
            if done():
                return
            await asyncio.sleep(POLL_S)

    def _all_terminal(self) -> bool:
        return all(self.mem._runs[k].state in TERMINAL for k in self.run_ids)

    async def main(self) -> dict[str, Any]:
        sc = self.scenario
        for r in sc.runs:
            self.run_ids.append((await self.mem.submit(r.key, r.spec(), r.max_attempts))
                                .run_id)
        budget = sc.fault_phase_s + self.l1_bound() + 120.0
        async with asyncio.timeout(budget), asyncio.TaskGroup() as tg:
            self._tg = tg
            self.current = [None] * len(sc.nodes)  # type: ignore[list-item]
            for i in range(len(sc.nodes)):
                self.start(i)
            sampler = tg.create_task(self._sampler())
            faults = [tg.create_task(self._apply(f)) for f in sc.faults]
            end = self.loop.time() + sc.fault_phase_s
            await self._poll(lambda: self._settled(faults), end)
            for t in faults:
                t.cancel()
            self.final_heal = self.loop.time()
            self.faults_log.append({"true": self.final_heal, "kind": "final_heal"})
            for handle in self._restarts.values():
                handle.cancel()
            self._restarts.clear()
            for i, node in enumerate(self.current):
                node.link.heal()
                node.resume()
                if node.crashed or node.exited:
                    self.start(i)
                elif node.entry["how"] == "drain":
                    self._restart_when_done(i, node)
            deadline = self.final_heal + self.l1_bound()
            await self._poll(self._all_terminal, deadline)
            self._sample()
            self._stopping = True
            for node in self.current:
                node.stopped = True
                node.runtime.stop()
            for node in self.current:
                if node.task is not None:
                    await asyncio.wait([node.task])
                    node.end("stop")
            sampler.cancel()
        return self.record()

    # -- record ----------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        sc = self.scenario
        tables = dump_tables(self.mem)
        orphans = [[n.node_id, r] for n in self.current for r in n.groups.orphans()]
        ref: dict[str, dict[str, str]] = {}
        for run_id, r in zip(self.run_ids, sc.runs, strict=True):
            ref[str(run_id)] = reference(r.key, r.boundaries)
        p = PARAMS
        params = {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}
        params.update({"T": p.T, "H": p.H, "G": p.G, "R": p.R})
        base = self.mem.epoch_base
        return {
            "tier": 1, "seed": sc.seed, "kind": sc.kind, "variant": self.variant.name,
            "params": params, "tables": tables, "events": self.events,
            "taps": self.tap.rows,
            "log": {
                "spawned": list(self.run_ids), "faults": self.faults_log,
                "schedule": [f.as_dict() for f in sc.faults], "nodes": self.nodes_log,
                "kills": self.kills, "samples": self.samples, "final_heal": self.final_heal,
                "operator": [], "orphans": orphans, "reference": ref,
                "longest_run_s": self.longest_run(), "restore_s": 0.0,
                "l1_bound_s": self.l1_bound(), "end": self.loop.time(),
                "stats": dict(self.stats), "slack_s": 0.0, "epoch_base": base.isoformat(),
            }}


TABLES: Final = (("runs", "_runs"), ("run_attempts", "_attempts"), ("nodes", "_nodes"),
                 ("checkpoints", "_checkpoints"), ("run_heads", "_heads"),
                 ("effects", "_effects"), ("interventions", "_interventions"))
BYTES: Final = frozenset({"payload_digest", "envelope_digest"})
INSTANTS: Final = frozenset({"not_before", "lease_expires_at"})


def dump_tables(mem: MemStore) -> dict[str, list[dict[str, Any]]]:
    """The tables as `MemStore.dump()` orders them, JSON-ready: instants stay store seconds
    (±infinity as ±1e308), bytes become hex, envelopes are left out; rows are read without
    copying payloads."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, attr in TABLES:
        table: dict[Any, Any] = getattr(mem, attr)
        rows: list[dict[str, Any]] = []
        if table:
            fields = [f for f in next(iter(table.values())).__slots__ if f != "envelope"]
            hexed = [f for f in fields if f in BYTES]
            inst = [f for f in fields if f in INSTANTS]
            for key in sorted(table):
                row = table[key]
                d = {f: getattr(row, f) for f in fields}
                for f in hexed:
                    d[f] = d[f].hex()
                for f in inst:
                    v = d[f]
                    if v is not None and not math.isfinite(v):
                        d[f] = 1e308 if v > 0 else -1e308
                rows.append(d)
        out[name] = rows
    return out


def digest(record: dict[str, Any]) -> str:
    """The trace digest: SHA-256 of the canonical JSON of what happened (node events, tables,
    store tap, faults, node lifetimes, kills); parts derived from the scenario are left out."""
    log = record["log"]
    part = [record["seed"], record["kind"], record["variant"], record["events"],
            record["tables"], record["taps"], log["faults"], log["nodes"], log["kills"]]
    text = json.dumps(part, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def quiet_unawaited() -> None:
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited")


def run_seed(seed: int, kind: str = "mixed", variant: Variant | None = None) -> dict[str, Any]:
    """Simulate one seed on a fresh `VirtualTimeLoop`; returns the history record."""
    loop = VirtualTimeLoop()
    with warnings.catch_warnings():
        # A node stopped or crashed right after starting its TaskGroup leaves service
        # coroutines that never ran; their "never awaited" notice is not a finding.
        quiet_unawaited()
        try:
            sim = Sim(loop, scenario(seed, kind), variant or Variant())
            return loop.run_until_complete(sim.main())
        finally:
            loop.close()
