"""The tier-2 scenario registry (distribution.md §7.3.5): ids and fault schedules as data.

Rules:
- Every row of §7.3.5 is one `Scenario` in `REGISTRY`, in the table's order; `test_scenario`
  is parametrised by these ids and the inventory check compares the ids that ran with them.
  `PROBES` holds harness-only scenarios (the budget probe of test 57); they are not part of
  the fault suite's inventory.
- Times are sim seconds, written as `Span(k, unit)` with `unit` one of `s`, `T` (lease TTL),
  `R` (renew timeout), `G` (give-up): resolved against the run's `LeaseParams`, so a schedule
  stays right when the parameters change (a `Delay` mode holds sim seconds; latency_near_ttl's
  are fractions of the default R). `at` counts from the fault phase's start, which the
  driver places mid-run (every node holds at least one run); `lasts` is how long a link fault
  stays before its heal (None: until the liveness phase heals everything).
- A fault is one of `LinkFault`, `NodeSignal`, `PartSignal` (a signal to one of a node's own
  parts, its router or its fork server: the hangs row), `ServerFault`, `ClockRate`,
  `CancelRun`, `OnMatch` (an action list fired when a node's link carries a protocol message
  containing a text: the kill_finish_* triggers).
- `hangs` is a row beyond §7.3.5 (issue 34: hangs are faults): A's router and fork server are
  SIGSTOPped mid-run and never resumed; A must kill and replace both on its liveness probe
  (`[session] health_probe_s`/`health_fail_s`, short in this row: `HANGS_CONFIG`) and every
  run must succeed on its first charged grant. `swizzle` draws its schedule from the scenario seed.
- latency_near_ttl's "≥ 1 acknowledged renewal with gap ≥ 0.7·G" is `observed` (counted and
  reported in the verdicts, not required): with 0.3–0.7·R each way a round trip averages R, an
  abandoned renewal closes the heartbeat session, and a late renewal then needs a reconnect
  within R and a renewal within R, acknowledged between 0.7·G and G after the last good send,
  before the hold's one chance is gone (nothing can be claimed during the fault: a claim needs
  two round trips within C). Simulating that loop with the scenario's own `Delay` gives about
  15 % of runs, so as a required fact it would fail most runs for a reason that is the spec's
  arithmetic, not a flaw of the node. Every other vacuity fact of the registry is required.
- Seeds: the suite seed is `FLYD_FAULT_SEED` or `DEFAULT_SEED`; a scenario's seed is the first
  four bytes of SHA-256(`<suite seed>:<id>`), so each scenario's draws are independent of which
  others run.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from flyd.leases.params import LeaseParams
from tests.distribution.harness.proxy import (
    DROP,
    HOLD,
    RESET,
    Delay,
    HoldOnMatch,
    Mode,
)

DEFAULT_SEED: Final = 73105
DEFAULT_BUDGET_S: Final = 30.0
#: The process and server scenarios (process_bodies.py) start and stop node processes more
#: often than the link scenarios, which on a loaded 2-CPU host takes most of a minute.
PROCESS_BUDGET_S: Final = 90.0
#: The scenarios running real nodes need more than the spec's default 30 s on a loaded 2-CPU
#: host (node start-up, worker launches and the drain at the end are real time).
LINK_BUDGET_S: Final = 90.0

Unit = Literal["s", "T", "R", "G"]
Side = Literal["up", "down", "both"]


@dataclass(frozen=True, slots=True)
class Span:
    k: float
    unit: Unit = "s"

    def seconds(self, params: LeaseParams) -> float:
        scale = {"s": 1.0, "T": params.T, "R": params.R, "G": params.G}[self.unit]
        return self.k * scale

    def label(self) -> str:
        return f"{self.k:g}{'' if self.unit == 's' else '·' + self.unit}"


@dataclass(frozen=True, slots=True)
class LinkFault:
    at: Span
    node: str
    direction: Side
    mode: Mode
    lasts: Span | None = None
    role: str | None = None


@dataclass(frozen=True, slots=True)
class NodeSignal:
    """`KILL` (node pid only), `STOP`/`CONT` (pause), `TERM` (drain); `restart`: start the
    node again (a new node_id) right after."""

    at: Span
    node: str
    signal: Literal["KILL", "STOP", "CONT", "TERM"]
    restart: bool = False


@dataclass(frozen=True, slots=True)
class PartSignal:
    """`signal` to node `node`'s `part`, its router child or its fork server (found in the
    node's process tree at that instant)."""

    at: Span
    node: str
    part: Literal["router", "fork server"]
    signal: Literal["STOP", "CONT", "KILL"]


@dataclass(frozen=True, slots=True)
class ServerFault:
    """`burst` groups the rounds of one blip (db_blips): its vacuity fact is per burst."""

    at: Span
    kind: Literal["terminate_backends", "restart"]
    burst: int | None = None


@dataclass(frozen=True, slots=True)
class ClockRate:
    """The node's clock runs at 1 + `skew`·ρ from its start (`--clock-rate`)."""

    node: str
    skew: float


@dataclass(frozen=True, slots=True)
class CancelRun:
    """Cancel one run held by `node` (through the production statement)."""

    at: Span
    node: str


@dataclass(frozen=True, slots=True)
class OnMatch:
    """When `node`'s `direction` link carries a message containing `text`, run `then` in
    order (each `at` counts from the match). Down, the message is a CommandComplete whose
    tag contains `text` and which the link held: the server executed the statement, the node
    never heard back (process_bodies.ProcessCluster)."""

    node: str
    direction: Literal["up", "down"]
    text: str
    then: tuple[LinkFault | NodeSignal, ...]


Fault = LinkFault | NodeSignal | PartSignal | ServerFault | ClockRate | CancelRun | OnMatch


@dataclass(frozen=True, slots=True)
class Scenario:
    id: str
    faults: tuple[Fault, ...]
    must_hold: str
    vacuity: tuple[str, ...]
    nodes: int = 2
    runs: int = 6
    budget_s: float = DEFAULT_BUDGET_S
    generate: Callable[[random.Random, LeaseParams], tuple[Fault, ...]] | None = None
    fence_removed: bool = False
    inverted: bool = False
    rerun_k: str | None = None
    #: extra TOML for every node's configuration file
    node_config: str = ""
    # Facts counted and reported with the verdicts but not required (see latency_near_ttl).
    observed: tuple[str, ...] = ()

    def schedule(self, seed: int, params: LeaseParams) -> tuple[Fault, ...]:
        """The scenario's faults for `seed` (static ones ignore it)."""
        if self.generate is None:
            return self.faults
        return self.faults + self.generate(random.Random(seed), params)

    @property
    def pytest_k(self) -> str:
        return self.rerun_k or self.id


#: hangs: a probe every 0.5 s real, 2 s for its answer (the node's call deadline)
HANGS_CONFIG: Final = "[session]\nhealth_probe_s = 0.5\nhealth_fail_s = 2.0\n"


def _partition(mode: Mode) -> tuple[Fault, ...]:
    return (LinkFault(Span(0), "a", "both", mode, lasts=Span(3, "T")),)


BLIP_BURSTS: Final = 3
BLIP_ROUNDS: Final = 8
BLIP_ROUND_S: Final = 0.25


def _blips(_rng: random.Random, params: LeaseParams) -> tuple[Fault, ...]:
    """db_blips: `BLIP_BURSTS` bursts half a lease TTL apart (all within one run's length),
    each `BLIP_ROUNDS` rounds of terminating every flyd session, `BLIP_ROUND_S` apart: about
    2 s, like a restart or a failover, and sessions opened during a burst are ended too.
    Between bursts the database answers for longer than two heartbeat intervals, so a node
    can renew before its give-up time; bursts closer than H apart would end every renewal,
    which no lease can survive and is not a blip."""
    return tuple(ServerFault(Span(burst * params.T / 2 + k * BLIP_ROUND_S),
                             "terminate_backends", burst=burst)
                 for burst in range(BLIP_BURSTS) for k in range(BLIP_ROUNDS))


def _swizzle(rng: random.Random, params: LeaseParams) -> tuple[Fault, ...]:
    """Within 4·T: clog the four links one by one (first half), restore them in a random
    order (second half); one kill (with restart) and one pause of T."""
    window = Span(4, "T").seconds(params)
    links: list[tuple[str, Literal["up", "down"]]] = [
        (node, d) for node in ("a", "b") for d in ("up", "down")]
    rng.shuffle(links)
    n = len(links)
    faults: list[Fault] = []
    for j, i in enumerate(rng.sample(range(n), n)):
        node, d = links[i]
        clog_at = window * 0.5 * i / n
        heal_at = window * 0.5 * (1 + j / n)
        modes: list[Mode] = [HOLD, DROP, Delay(params.R * 0.5, params.R * 0.2)]
        mode = rng.choice(modes)
        faults.append(LinkFault(Span(round(clog_at, 3)), node, d, mode,
                                lasts=Span(round(heal_at - clog_at, 3))))
    victim, paused = rng.sample(["a", "b"], 2)
    pause_at = round(rng.uniform(0, window - params.T), 3)
    faults.append(NodeSignal(Span(round(rng.uniform(0, window), 3)), victim, "KILL",
                             restart=True))
    faults.append(NodeSignal(Span(pause_at), paused, "STOP"))
    faults.append(NodeSignal(Span(round(pause_at + params.T, 3)), paused, "CONT"))
    return tuple(faults)


REGISTRY: Final[tuple[Scenario, ...]] = (
    Scenario("baseline", (), "all succeed, one grant each, full ledger",
             ("≥ 1 rotation per run",), budget_s=LINK_BUDGET_S),
    Scenario("partition_hold", _partition(HOLD),
             "A self-fences before B's grant; B's epoch = A's + 1; A's held statements "
             "rejected; A does not resume",
             ("≥ 1 reclaim", "≥ 1 LF001 tapped for A after heal"),
             runs=4, budget_s=LINK_BUDGET_S),
    Scenario("partition_drop", _partition(DROP),
             "as partition_hold; A's open transactions ended by the server", ("≥ 1 reclaim",),
             runs=4, budget_s=LINK_BUDGET_S),
    Scenario("partition_reset", _partition(RESET), "as partition_hold",
             ("≥ 1 reclaim", "≥ 1 A write cut by reset"),
             runs=4, budget_s=LINK_BUDGET_S),
    Scenario("asymmetric",
             (LinkFault(Span(0), "a", "down", DROP, lasts=Span(3, "T")),),
             "A self-fences although its renewals executed",
             ("≥ 1 renew tapped as executed for A after its last acknowledged one",),
             runs=4, budget_s=LINK_BUDGET_S),
    Scenario("latency_near_ttl",
             tuple(LinkFault(Span(0), node, "both",
                             Delay(0.5 * LeaseParams().R, 0.2 * LeaseParams().R,
                                   spike_p=0.1, spike_mean_s=0.85 * LeaseParams().R,
                                   spike_jitter_s=0.35 * LeaseParams().R),
                             lasts=Span(6, "T"))
                   for node in ("a", "b")),
             "each hold renewed in time or cancelled at safe_until; no write after "
             "safe_until; all complete after",
             ("≥ 1 abandoned renewal",),
             runs=4, budget_s=LINK_BUDGET_S,
             observed=("≥ 1 acknowledged renewal with gap ≥ 0.7·G",)),
    Scenario("pause",
             (NodeSignal(Span(0), "a", "STOP"), NodeSignal(Span(2, "T"), "a", "CONT")),
             "A's first act for overdue holds is cancellation; no A write accepted after "
             "B's grant",
             ("≥ 1 lease_lost(safe_until) after resume", "≥ 1 reclaim"),
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("node_loss", (NodeSignal(Span(0), "a", "KILL"),),
             "B reclaims after expiry, completes once; A's router and workers gone within K",
             ("≥ 1 run finished by B after an epoch of A", "A had live workers"),
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("kill_finish_committed",
             (LinkFault(Span(0), "a", "down", HoldOnMatch("finish_run")),
              OnMatch("a", "down", "COMMIT", (NodeSignal(Span(0), "a", "KILL"),))),
             "terminal once at A's epoch; never granted again", ("trigger fired",),
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("kill_finish_uncommitted",
             (LinkFault(Span(0), "a", "up", HoldOnMatch("finish_run")),
              OnMatch("a", "up", "finish_run",
                      (NodeSignal(Span(0), "a", "KILL"),
                       LinkFault(Span(0), "a", "both", RESET, lasts=Span(0.1))))),
             "nothing of A's final commit lands; B finishes",
             ("trigger fired", "final epoch = A's + 1"),
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("db_backends_terminated",
             (ServerFault(Span(0), "terminate_backends"),
              ServerFault(Span(1, "T"), "terminate_backends")),
             "reconnection; no epoch regression; all terminal",
             ("each round ended ≥ 1 live session",),
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("db_blips", (),
             "reconnection; no epoch regression; all succeed; no grant lost",
             ("each burst ended ≥ 1 live session",), generate=_blips,
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("db_restart", (ServerFault(Span(0), "restart"),),
             "reconnection; no epoch regression; all terminal",
             ("restart while leases held",),
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("clock_skew",
             (ClockRate("a", -0.9), ClockRate("b", 0.9),
              LinkFault(Span(0), "a", "both", HOLD, lasts=Span(3, "T"))),
             "A's self-fence precedes expiry in true time", ("≥ 1 reclaim",),
             runs=4, budget_s=LINK_BUDGET_S),
    Scenario("attempts_exhausted",
             (NodeSignal(Span(0), "holder-of-x", "KILL", restart=True),),
             "X failed after max_attempts grants; others succeed",
             ("X had max_attempts grants",),
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("cancel_while_partitioned",
             (LinkFault(Span(0), "a", "both", HOLD, lasts=Span(3, "T")),
              CancelRun(Span(0.5, "T"), "a")),
             "run cancelled (by reap or holder); no effect after", ("≥ 1 cancel applied",),
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("graceful_drain", (NodeSignal(Span(0), "a", "TERM"),),
             "A commits a checkpoint, releases with refund, exits 0; B resumes from it",
             ("≥ 1 refunded release",),
             runs=3, budget_s=PROCESS_BUDGET_S),
    Scenario("hangs",
             (PartSignal(Span(0), "a", "router", "STOP"),
              PartSignal(Span(0), "a", "fork server", "STOP")),
             "A kills and replaces its stopped router and fork server; every run succeeds "
             "on its first charged grant; A charges no recovery attempt",
             ("A's stopped router and fork server replaced",),
             runs=3, budget_s=PROCESS_BUDGET_S, node_config=HANGS_CONFIG),
    Scenario("swizzle", (), "all invariants", ("≥ 1 reclaim",), generate=_swizzle,
             runs=4, budget_s=LINK_BUDGET_S),
    Scenario("canary_fence_removed", _partition(HOLD),
             "the oracle MUST report a violation", ("inverted: passes only if detected",),
             fence_removed=True, inverted=True,
             runs=4, budget_s=LINK_BUDGET_S),
)

PROBES: Final[tuple[Scenario, ...]] = (
    Scenario("budget_probe", (), "none: outlives any budget (harness self-test)", (),
             nodes=1, runs=0, rerun_k="test_budget_expiry"),
)


def ids() -> list[str]:
    return [s.id for s in REGISTRY]


def lookup(scenario_id: str) -> Scenario:
    for scenario in REGISTRY + PROBES:
        if scenario.id == scenario_id:
            return scenario
    raise KeyError(f"unknown scenario {scenario_id!r} (known: {', '.join(ids())})")


def suite_seed() -> int:
    raw = os.environ.get("FLYD_FAULT_SEED")
    return int(raw) if raw else DEFAULT_SEED


def scenario_seed(suite: int, scenario_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{suite}:{scenario_id}".encode()).digest()[:4],
                          "big")


def describe_fault(fault: Fault, params: LeaseParams) -> dict[str, object]:
    """A fault as JSON for the replay record, its spans resolved to sim seconds."""
    if isinstance(fault, LinkFault):
        return {"kind": "link", "at": fault.at.seconds(params), "node": fault.node,
                "dir": fault.direction, "mode": fault.mode.label(), "role": fault.role,
                "lasts": None if fault.lasts is None else fault.lasts.seconds(params)}
    if isinstance(fault, NodeSignal):
        return {"kind": "signal", "at": fault.at.seconds(params), "node": fault.node,
                "signal": fault.signal, "restart": fault.restart}
    if isinstance(fault, PartSignal):
        return {"kind": "part_signal", "at": fault.at.seconds(params), "node": fault.node,
                "part": fault.part, "signal": fault.signal}
    if isinstance(fault, ServerFault):
        return {"kind": "server", "at": fault.at.seconds(params), "what": fault.kind,
                "burst": fault.burst}
    if isinstance(fault, ClockRate):
        return {"kind": "clock_rate", "node": fault.node,
                "rate": 1 + fault.skew * params.clock_rate_bound}
    if isinstance(fault, CancelRun):
        return {"kind": "cancel", "at": fault.at.seconds(params), "node": fault.node}
    return {"kind": "on_match", "node": fault.node, "dir": fault.direction,
            "text": fault.text, "then": [describe_fault(f, params) for f in fault.then]}
