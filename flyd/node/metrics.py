"""What a node exports to Prometheus (`flyd serve --metrics ADDR`, docs/operations.md).

Why read at scrape time: the step path must not get slower for an observer that may not exist.
Nothing here is called per step; a scrape reads what the node already keeps (the lease core's
holds, each live grant's `RunReport`, the executor's `GrantTotals`, the lease runtime's
`LeaseStats`, the router's `bus.stats`, psutil) into a `NodeSnapshot`, and `NodeCollector`
turns that snapshot into metric families of its own registry (never prometheus_client's
global one, so nothing else of the process leaks into the exposition).

Rules:
- `NodeSnapshot.read(parts)` runs on the node's loop (`flyd.node.metrics_http`): it awaits the
  router's `bus.stats` for at most `ROUTER_STATS_S`; without an answer `flyd_router_up` is 0 and
  the router's families are left out of that scrape, everything else is still exported.
- Per-run families (`run` label) cover the grants this node is executing now; a run that ended
  or moved to another node drops out (Prometheus marks its series stale). A run's step counter
  counts this grant's steps (re-executed ones after a recovery included), so it restarts at 0
  when the run is granted again; `increase()` and `rate()` handle that as a counter reset.
- `flyd_run_steps_per_second` is the grant's steps over its stepping time, the figure
  `flyd run` prints as `stepsPerSecond`; a windowed rate is `rate(flyd_run_steps_total[1m])`.
- `flyd_runs{state}` is this node's holds by lease phase, every phase present (0 when none).
- Durations are seconds, sizes bytes, as Prometheus names them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, get_args

import psutil
import structlog
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from bus.client import BusClient
from bus.errors import BusError
from flyd.leases.core import LeasePhase, Reason
from flyd.leases.runtime import NodeRuntime
from flyd.leases.stats import Histogram, LeaseStats
from flyd.node.executor import GrantExecutor
from flyd.node.router_child import RouterChild

__all__ = ["CONTENT_TYPE", "MetricsParts", "NodeCollector", "NodeMetrics", "NodeSnapshot",
           "RunSample"]

log = structlog.get_logger("flyd.node.metrics")

#: the classic text format (Prometheus' default parser), whatever prometheus_client calls latest
CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
ROUTER_STATS_S: Final = 1.0
PHASES: Final = tuple(p for p in LeasePhase if p is not LeasePhase.DONE)
#: how a grant ends (`GrantTotals.ended`), each exported from 0 on
ENDINGS: Final = ("succeeded", "failed", "cancelled", "released", "lost")


class MetricsParts(Protocol):
    """The node's parts a scrape reads (`flyd.node.process.NodeProcess`); each may be absent
    while the node starts or stops."""

    runtime: NodeRuntime | None
    executor: GrantExecutor | None
    client: BusClient | None
    router: RouterChild | None


@dataclass(frozen=True)
class RunSample:
    """One grant this node is executing."""

    run: int
    steps: int
    steps_per_second: float
    boundary: int
    recoveries: int


@dataclass(frozen=True)
class ProcessSample:
    name: str
    resident_bytes: int
    cpu_seconds: float


@dataclass(frozen=True)
class HistogramSample:
    buckets: list[tuple[float, int]]
    sum: float

    @classmethod
    def of(cls, histogram: Histogram) -> HistogramSample:
        return cls(histogram.cumulative(), histogram.sum)


@dataclass(frozen=True)
class NodeSnapshot:
    """Everything one scrape exports, read at once (module rules)."""

    node_id: str
    node_name: str
    version: str
    holds: Mapping[str, int] = field(default_factory=dict)
    runs: list[RunSample] = field(default_factory=list)
    ended: Mapping[str, int] = field(default_factory=dict)
    steps: int = 0
    recoveries: Mapping[str, int] = field(default_factory=dict)
    renew: HistogramSample | None = None
    renew_unknown: int = 0
    losses: Mapping[str, int] = field(default_factory=dict)
    checkpoint_commit: HistogramSample | None = None
    checkpoint_bytes: int = 0
    router: Mapping[str, Any] | None = None
    router_exits: int = 0
    workers: int = 0
    processes: list[ProcessSample] = field(default_factory=list)

    @classmethod
    async def read(cls, parts: MetricsParts, *, node_id: str, node_name: str,
                   version: str) -> NodeSnapshot:
        runtime, executor = parts.runtime, parts.executor
        holds = dict.fromkeys((p.value.lower() for p in PHASES), 0)
        if runtime is not None:
            for _run, _epoch, phase, _left in runtime.held():
                if phase is not LeasePhase.DONE:
                    holds[phase.value.lower()] += 1
        runs: list[RunSample] = []
        steps, ended, recoveries, workers, router_exits = 0, {}, {}, 0, 0
        if executor is not None:
            router_exits = executor.router_exits
            totals = executor.totals
            steps, ended, recoveries = totals.steps, dict(totals.states), dict(totals.recoveries)
            for run, report in sorted(executor.reports.items()):
                if report.ended.is_set():
                    continue
                steps += report.advances
                rate = report.advances / report.step_seconds if report.step_seconds > 0 else 0.0
                runs.append(RunSample(run, report.advances, rate, report.boundary,
                                      len(report.recoveries)))
            workers = executor.worker_count()
        lease = runtime.stats if runtime is not None else LeaseStats()
        return cls(
            node_id=node_id, node_name=node_name, version=version, holds=holds, runs=runs,
            ended=ended, steps=steps, recoveries=recoveries,
            renew=HistogramSample.of(lease.renew), renew_unknown=lease.renew_unknown,
            losses=dict(lease.losses), checkpoint_commit=HistogramSample.of(
                lease.checkpoint_commit), checkpoint_bytes=lease.checkpoint_bytes,
            router=await _router_stats(parts.client), router_exits=router_exits,
            workers=workers,
            processes=_processes(parts.router))


async def _router_stats(client: BusClient | None) -> Mapping[str, Any] | None:
    if client is None or client.closed:
        return None
    try:
        async with asyncio.timeout(ROUTER_STATS_S):
            return await client.stats()
    except (BusError, OSError, TimeoutError) as exc:
        log.debug("metrics.router_stats_unavailable", error=str(exc))
        return None


def _processes(router: RouterChild | None) -> list[ProcessSample]:
    """The node's own process and its router child's (when it has one)."""
    pids = [("node", os.getpid())]
    if router is not None and router.pid is not None:
        pids.append(("router", router.pid))
    out = []
    for name, pid in pids:
        try:
            proc = psutil.Process(pid)
            with proc.oneshot():
                rss = int(proc.memory_info().rss)
                times = proc.cpu_times()
        except psutil.Error:
            continue  # a router between restarts
        out.append(ProcessSample(name, rss, float(times.user + times.system)))
    return out


class NodeCollector(Collector):
    """The metric families of the latest snapshot (`snapshot` is set before each render)."""

    def __init__(self, snapshot: NodeSnapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        info = GaugeMetricFamily("flyd_node_info", "This node: its id, name and version.",
                                 labels=["node_id", "node_name", "version"])
        info.add_metric([s.node_id, s.node_name, s.version], 1)
        yield info
        yield _labelled(GaugeMetricFamily, "flyd_runs",
                        "Runs this node holds, by lease phase.", "state", s.holds)
        yield _labelled(CounterMetricFamily, "flyd_runs_ended",
                        "Grants this node ended, by how: succeeded, failed, cancelled, "
                        "released, lost.", "state", {**dict.fromkeys(ENDINGS, 0), **s.ended})
        yield from self._runs()
        yield CounterMetricFamily("flyd_steps", "Steps this node's sessions took.",
                                  value=s.steps)
        yield _labelled(CounterMetricFamily, "flyd_recoveries",
                        "Automatic recoveries of this node's sessions, by the failure's code.",
                        "cause", s.recoveries)
        yield from self._leases()
        yield from self._router()
        yield GaugeMetricFamily("flyd_workers", "Live workers of the runs this node executes.",
                                value=s.workers)
        rss = GaugeMetricFamily("flyd_process_resident_bytes",
                                "Resident memory of the node and its router child.",
                                labels=["process"])
        cpu = CounterMetricFamily("flyd_process_cpu_seconds",
                                  "CPU time (user + system) of the node and its router child.",
                                  labels=["process"])
        for p in s.processes:
            rss.add_metric([p.name], p.resident_bytes)
            cpu.add_metric([p.name], p.cpu_seconds)
        yield rss
        yield cpu

    def _runs(self) -> Iterator[Metric]:
        runs = self.snapshot.runs
        steps = CounterMetricFamily("flyd_run_steps", "Steps of the run's current grant on "
                                    "this node.", labels=["run"])
        rate = GaugeMetricFamily("flyd_run_steps_per_second",
                                 "The grant's steps over its stepping time.", labels=["run"])
        boundary = GaugeMetricFamily("flyd_run_boundary", "The boundary of the run's last step "
                                     "(its position).", labels=["run"])
        recoveries = CounterMetricFamily("flyd_run_recoveries", "Recoveries of the run's "
                                         "current grant on this node.", labels=["run"])
        for r in runs:
            run = [str(r.run)]
            steps.add_metric(run, r.steps)
            rate.add_metric(run, r.steps_per_second)
            boundary.add_metric(run, r.boundary)
            recoveries.add_metric(run, r.recoveries)
        yield from (steps, rate, boundary, recoveries)

    def _leases(self) -> Iterator[Metric]:
        s = self.snapshot
        if s.renew is not None:
            yield _histogram("flyd_lease_renew_seconds",
                             "Acknowledged lease renewals, send to reply.", s.renew)
        yield CounterMetricFamily("flyd_lease_renewals_unknown",
                                  "Lease renewals abandoned without a reply.",
                                  value=s.renew_unknown)
        yield _labelled(CounterMetricFamily, "flyd_lease_losses",
                        "Holds this node lost, by reason (design/distribution.md §5.5).", "reason",
                        {**dict.fromkeys(get_args(Reason), 0), **s.losses})
        if s.checkpoint_commit is not None:
            yield _histogram("flyd_checkpoint_commit_seconds",
                             "Committed group commits carrying a checkpoint, first send to "
                             "reply.", s.checkpoint_commit)
        yield CounterMetricFamily("flyd_checkpoint_bytes",
                                  "Envelope bytes of the committed checkpoints.",
                                  value=s.checkpoint_bytes)

    def _router(self) -> Iterator[Metric]:
        stats = self.snapshot.router
        yield CounterMetricFamily("flyd_router_exits", "Exits of the node's router the node "
                                  "saw (each one restarted, sessions recovered).",
                                  value=self.snapshot.router_exits)
        yield GaugeMetricFamily("flyd_router_up", "Whether the router answered bus.stats for "
                                "this scrape.", value=0 if stats is None else 1)
        if stats is None:
            return
        counters = stats["counters"]
        yield GaugeMetricFamily("flyd_router_connections", "Open connections to the router.",
                                value=stats["connections"])
        yield _labelled(CounterMetricFamily, "flyd_router_calls",
                        "Calls the router admitted, refused, or failed after admitting.",
                        "result", {"admitted": counters["callsAdmitted"],
                                   "refused": counters["callsRefused"],
                                   "failed": counters["callsFailed"]})
        yield GaugeMetricFamily("flyd_router_active_calls", "Calls in flight in the router.",
                                value=stats["activeCalls"])
        yield _labelled(GaugeMetricFamily, "flyd_router_queued_bytes",
                        "Bytes queued in the router: call payloads, topic messages.", "queue",
                        {"calls": stats["queuedCallBytes"],
                         "topics": stats["queuedTopicBytes"]})


def _labelled(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str,
              documentation: str, label: str, values: Mapping[str, int]) -> Metric:
    family = kind(name, documentation, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


def _histogram(name: str, documentation: str, sample: HistogramSample) -> Metric:
    buckets = [("+Inf" if bound == float("inf") else repr(bound), count)
               for bound, count in sample.buckets]
    return HistogramMetricFamily(name, documentation, buckets=buckets, sum_value=sample.sum)


class NodeMetrics:
    """The node's registry (its own, not prometheus_client's global one) with one collector;
    `render` reads a fresh snapshot and writes the text exposition."""

    def __init__(self, parts: MetricsParts, *, node_id: str, node_name: str,
                 version: str) -> None:
        self._parts = parts
        self._node_id, self._node_name, self._version = node_id, node_name, version
        self.collector = NodeCollector(NodeSnapshot(node_id, node_name, version))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)

    async def render(self) -> bytes:
        snapshot = await NodeSnapshot.read(self._parts, node_id=self._node_id,
                                           node_name=self._node_name, version=self._version)
        self.collector.snapshot = snapshot  # rendered at once: no await in between
        return generate_latest(self.registry)
