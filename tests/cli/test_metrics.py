"""Metrics operators can scrape (issue 34, Build 8; docs/operations.md).

- The exposition's names, label sets and types, parsed back with prometheus_client's own parser
  from a snapshot with known figures (fast, no node).
- The HTTP endpoint on a real loopback socket: `/metrics` answered, other paths and methods
  refused, nothing left running after close.
- A real node's scrape after a process-mode run with checkpoints and a killed agent: the
  recovery's cause, every step (re-executed ones included), checkpoint commits, renewals, the
  grant's end, the router and the processes.
- The acceptance test: a real `flyd serve` node with `[node] metrics` executes a paced run
  while a real Prometheus server (Debian's `prometheus` package, which `.ci/run` installs)
  scrapes it every second; a PromQL query through Prometheus' HTTP API shows the run's step
  counter rising. A missing `prometheus` binary fails the test (it is never skipped).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from bus.client import BusClient
from flyd.config import load_config
from flyd.errors import ConfigError
from flyd.leases.runtime import NodeRuntime
from flyd.leases.stats import Histogram
from flyd.node.executor import GrantExecutor
from flyd.node.metrics import (
    CONTENT_TYPE,
    HistogramSample,
    NodeCollector,
    NodeMetrics,
    NodeSnapshot,
    ProcessSample,
    RunSample,
)
from flyd.node.metrics_http import MetricsAddress, MetricsAddressError, MetricsEndpoint
from flyd.node.router_child import RouterChild
from flyd.session.runspec import RunSpec
from tests.cli.test_run import _DSN, flyd_run
from tests.cli.test_serve import log_events, run_state, submit
from tests.serve_nodes import ROOT, node_log, process_dir, start_node, stop, wait_for

pytestmark = pytest.mark.timeout(180)

# -- the exposition ----------------------------------------------------------------------------


def _snapshot() -> NodeSnapshot:
    renew = Histogram()
    for seconds in (0.002, 0.004, 0.3):
        renew.observe(seconds)
    commit = Histogram()
    commit.observe(0.02)
    return NodeSnapshot(
        node_id="n1-0123456789ab", node_name="n1", version="0.1.0",
        holds={"starting": 0, "active": 2, "committing": 0, "finishing": 0, "releasing": 0,
               "lost": 0},
        runs=[RunSample(run=7, steps=120, steps_per_second=59.5, boundary=118, recoveries=1),
              RunSample(run=9, steps=3, steps_per_second=0.0, boundary=3, recoveries=0)],
        ended={"succeeded": 4, "failed": 1}, steps=900, recoveries={"CALL_GONE": 1},
        renew=HistogramSample.of(renew), renew_unknown=2, losses={"safe_until": 1},
        checkpoint_commit=HistogramSample.of(commit), checkpoint_bytes=4096,
        router={"connections": 6, "activeCalls": 1, "queuedCallBytes": 512,
                "queuedTopicBytes": 64,
                "counters": {"callsAdmitted": 1000, "callsRefused": 2, "callsFailed": 3}},
        router_exits=1, workers=5, processes=[ProcessSample("node", 50_000_000, 1.5),
                              ProcessSample("router", 20_000_000, 0.25)])


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _values(family: Any, sample_name: str | None = None) -> dict[tuple[tuple[str, str], ...],
                                                                  float]:
    name = sample_name or family.name
    return {tuple(sorted(s.labels.items())): s.value for s in family.samples if s.name == name}


def test_the_exposition_names_labels_and_types() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(_snapshot()))
    text = prometheus_client.generate_latest(registry).decode()
    families = _families(text)
    types = {name: f.type for name, f in families.items()}
    assert types == {
        "flyd_node_info": "gauge", "flyd_runs": "gauge", "flyd_runs_ended": "counter",
        "flyd_run_steps": "counter", "flyd_run_steps_per_second": "gauge",
        "flyd_run_boundary": "gauge", "flyd_run_recoveries": "counter",
        "flyd_steps": "counter", "flyd_recoveries": "counter",
        "flyd_lease_renew_seconds": "histogram", "flyd_lease_renewals_unknown": "counter",
        "flyd_lease_losses": "counter", "flyd_checkpoint_commit_seconds": "histogram",
        "flyd_checkpoint_bytes": "counter", "flyd_router_exits": "counter",
        "flyd_router_up": "gauge",
        "flyd_router_connections": "gauge", "flyd_router_calls": "counter",
        "flyd_router_active_calls": "gauge", "flyd_router_queued_bytes": "gauge",
        "flyd_workers": "gauge", "flyd_process_resident_bytes": "gauge",
        "flyd_process_cpu_seconds": "counter"}
    # counters are exposed as `<name>_total`, as Prometheus queries them
    assert "flyd_run_steps_total{run=\"7\"} 120.0" in text
    assert _values(families["flyd_run_steps"], "flyd_run_steps_total") == {
        (("run", "7"),): 120, (("run", "9"),): 3}
    assert _values(families["flyd_run_steps_per_second"])[(("run", "7"),)] == 59.5
    assert _values(families["flyd_runs"])[(("state", "active"),)] == 2
    assert {k[0][1] for k in _values(families["flyd_runs"])} == {
        "starting", "active", "committing", "finishing", "releasing", "lost"}
    assert _values(families["flyd_runs_ended"], "flyd_runs_ended_total") == {
        (("state", "failed"),): 1, (("state", "succeeded"),): 4, (("state", "cancelled"),): 0,
        (("state", "released"),): 0, (("state", "lost"),): 0}
    assert _values(families["flyd_steps"], "flyd_steps_total") == {(): 900}
    assert _values(families["flyd_recoveries"], "flyd_recoveries_total") == {
        (("cause", "CALL_GONE"),): 1}
    losses = _values(families["flyd_lease_losses"], "flyd_lease_losses_total")
    assert losses[(("reason", "safe_until"),)] == 1 and losses[(("reason", "fenced"),)] == 0
    renew = families["flyd_lease_renew_seconds"]
    buckets = _values(renew, "flyd_lease_renew_seconds_bucket")
    assert buckets[(("le", "0.0025"),)] == 1 and buckets[(("le", "0.005"),)] == 2
    assert buckets[(("le", "0.25"),)] == 2 and buckets[(("le", "+Inf"),)] == 3
    assert _values(renew, "flyd_lease_renew_seconds_count") == {(): 3}
    assert _values(renew, "flyd_lease_renew_seconds_sum")[()] == pytest.approx(0.306)
    assert _values(families["flyd_checkpoint_bytes"], "flyd_checkpoint_bytes_total") == {
        (): 4096}
    assert _values(families["flyd_router_calls"], "flyd_router_calls_total") == {
        (("result", "admitted"),): 1000, (("result", "failed"),): 3,
        (("result", "refused"),): 2}
    assert _values(families["flyd_router_queued_bytes"]) == {
        (("queue", "calls"),): 512, (("queue", "topics"),): 64}
    assert _values(families["flyd_router_up"]) == {(): 1}
    assert _values(families["flyd_router_exits"], "flyd_router_exits_total") == {(): 1}
    assert _values(families["flyd_workers"]) == {(): 5}
    assert _values(families["flyd_process_resident_bytes"]) == {
        (("process", "node"),): 50_000_000, (("process", "router"),): 20_000_000}
    assert _values(families["flyd_process_cpu_seconds"], "flyd_process_cpu_seconds_total") == {
        (("process", "node"),): 1.5, (("process", "router"),): 0.25}
    assert _values(families["flyd_node_info"]) == {
        (("node_id", "n1-0123456789ab"), ("node_name", "n1"), ("version", "0.1.0")): 1}


def test_a_router_that_does_not_answer_leaves_only_its_families_out() -> None:
    snapshot = NodeSnapshot(node_id="n1-0123456789ab", node_name="n1", version="0.1.0")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(NodeCollector(snapshot))
    families = _families(prometheus_client.generate_latest(registry).decode())
    assert _values(families["flyd_router_up"]) == {(): 0}
    assert [name for name in families if name.startswith("flyd_router_")] == [
        "flyd_router_exits", "flyd_router_up"]
    assert "flyd_steps" in families and "flyd_runs" in families


class _NoParts:
    """A node before its parts exist (`MetricsParts` with every part absent)."""

    runtime: NodeRuntime | None = None
    executor: GrantExecutor | None = None
    client: BusClient | None = None
    router: RouterChild | None = None


def test_the_node_registry_is_its_own() -> None:
    metrics = NodeMetrics(_NoParts(), node_id="n1-0123456789ab", node_name="n1",
                          version="0.1.0")
    text = asyncio.run(metrics.render()).decode()
    assert "flyd_node_info" in text
    # nothing of the process-wide default registry (python_gc_*, process_*) leaks in, and
    # the node's families are not registered there
    assert "python_gc" not in text and "\nprocess_" not in text
    default = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "flyd_" not in default


# -- the endpoint ------------------------------------------------------------------------------


def test_metrics_addresses_parse_or_are_refused_naming_the_form() -> None:
    assert MetricsAddress.parse("9464") == MetricsAddress("127.0.0.1", 9464)
    assert MetricsAddress.parse("0.0.0.0:9464") == MetricsAddress("0.0.0.0", 9464)
    assert MetricsAddress.parse("[::1]:0") == MetricsAddress("::1", 0)
    assert str(MetricsAddress("::1", 9)) == "[::1]:9"
    for bad in ("", "host:", ":9464", "h:70000", "::1:9464", "[nope]:1", "a b:1", "x"):
        with pytest.raises(MetricsAddressError):
            MetricsAddress.parse(bad)


def test_node_metrics_is_checked_where_it_is_set(tmp_path: Path) -> None:
    config = tmp_path / "flyd.toml"
    config.write_text('[node]\nmetrics = "localhost:99999"\n')
    with pytest.raises(ConfigError, match=r"flyd.toml: \[node\] metrics = 'localhost:99999' "
                                          r"is out of range \(HOST:PORT"):
        load_config(config, env={})
    with pytest.raises(ConfigError, match=r"flag --metrics: \[node\] metrics"):
        load_config(None, flags={"node.metrics": "::1:80"}, env={})
    config.write_text('[node]\nmetrics = "0.0.0.0:9464"\n')
    assert load_config(config, env={}).settings.node.metrics == MetricsAddress("0.0.0.0", 9464)
    assert load_config(None, env={}).settings.node.metrics is None


async def _http(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    async with asyncio.timeout(10):
        answer = await reader.read()
    writer.close()
    await writer.wait_closed()
    return answer


async def test_the_endpoint_answers_scrapes_and_closes_with_nothing_left() -> None:
    threads = threading.active_count()
    renders = 0

    async def render() -> bytes:
        nonlocal renders
        renders += 1
        return b"flyd_steps_total 1.0\n"

    endpoint = MetricsEndpoint(MetricsAddress("127.0.0.1", 0), render, CONTENT_TYPE)
    bound = await endpoint.start()
    assert bound.host == "127.0.0.1" and bound.port > 0
    ok = await _http(bound.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = ok.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert f"Content-Type: {CONTENT_TYPE}".encode() in head
    assert body == b"flyd_steps_total 1.0\n"
    assert (await _http(bound.port, b"GET / HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 404")
    refused = await _http(bound.port, b"POST /metrics HTTP/1.1\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 405") and b"Allow: GET, HEAD" in refused
    head_only = await _http(bound.port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert head_only.startswith(b"HTTP/1.1 200") and head_only.endswith(b"\r\n\r\n")
    assert renders == 2
    huge = await _http(bound.port, b"GET /metrics HTTP/1.1\r\nX: " + b"x" * 9000)
    assert huge.startswith(b"HTTP/1.1 431")
    assert (await _http(bound.port, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400")
    assert renders == 2
    # a connection that never finishes its request is ended by close
    _, idle = await asyncio.open_connection("127.0.0.1", bound.port)
    idle.write(b"GET /metr")
    await asyncio.sleep(0.05)
    await endpoint.close()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", bound.port)
    idle.close()
    assert threading.active_count() == threads


# -- a real Prometheus server scrapes a real node ----------------------------------------------


@pytest.fixture
def tmp() -> Iterator[Path]:
    with process_dir("flyd-m-") as path:
        yield path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return orjson.loads(answer.read())


def _query(port: int, promql: str) -> list[dict[str, Any]]:
    """An instant query through Prometheus' HTTP API (`/api/v1/query`)."""
    reply = _get(f"http://127.0.0.1:{port}/api/v1/query?"
                 + urllib.parse.urlencode({"query": promql}))
    assert reply["status"] == "success", reply
    result: list[dict[str, Any]] = reply["data"]["result"]
    return result


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _start_prometheus(tmp: Path, target: str) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("prometheus")
    assert binary is not None, ("the prometheus server is not installed: apt-get install "
                                "prometheus (.ci/run installs it)")
    port = _free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: flyd\n    static_configs:\n"
        f"      - targets: ['{target}']\n")
    log = (tmp / "prometheus.log").open("ab")
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'prometheus-data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=log)
    return proc, port


def _paced_spec(steps: int) -> dict[str, Any]:
    return RunSpec.validate({
        "steps": str(steps), "mode": "in-process", "pacing": "realtime",
        "agents": [{"agentId": a, "portId": f"p{i + 1}", "seed": None}
                   for i, a in enumerate(("fly-a", "fly-b"))]}).to_json()


def test_prometheus_scrapes_the_run_step_counter_rising(db_dsn: str, tmp: Path) -> None:
    node = start_node(tmp, "m", db_dsn, config='[node]\nmetrics = "127.0.0.1:0"\n')
    prometheus: subprocess.Popen[bytes] | None = None
    try:
        wait_for("the metrics endpoint", lambda: bool(log_events(tmp, "m", "metrics.listening"))
                 or node.poll() is not None, 60)
        assert node.poll() is None, node_log(tmp, "m")
        listening = log_events(tmp, "m", "metrics.listening")[0]
        assert listening["host"] == "127.0.0.1"
        target = f"127.0.0.1:{listening['port']}"
        prometheus, prom_port = _start_prometheus(tmp, target)
        started = prometheus
        wait_for("Prometheus to be ready", lambda: _ready(prom_port)
                 or started.poll() is not None, 60)
        assert prometheus.poll() is None, (tmp / "prometheus.log").read_text()
        wait_for("Prometheus to scrape the node", lambda: any(
            r["value"][1] == "1" for r in _query(prom_port, 'up{job="flyd"}')), 30)
        # vacuity: before a run is submitted, Prometheus holds no run's step counter
        assert _query(prom_port, 'flyd_run_steps_total{job="flyd"}') == []
        run = submit(db_dsn, _paced_spec(1800))  # 30 s at 60 Hz
        steps = f'flyd_run_steps_total{{job="flyd",run="{run}"}}'
        rising: list[dict[str, Any]] = []

        def risen() -> bool:
            rising[:] = [r for r in _query(prom_port, f"increase({steps}[1m])")
                         if float(r["value"][1]) > 0]
            return bool(rising)

        wait_for("increase() of the run's step counter through Prometheus", risen, 60)
        assert rising[0]["metric"]["run"] == str(run)
        # two samples of the counter, each read through Prometheus, the second higher
        first = _query(prom_port, steps)
        assert first, "the step counter is not in Prometheus"
        later: list[dict[str, Any]] = []

        def moved() -> bool:
            later[:] = _query(prom_port, steps)
            return bool(later) and float(later[0]["value"][1]) > float(first[0]["value"][1])

        wait_for("a later sample of the step counter to be higher", moved, 30)
        # the hold is active, or committing a checkpoint at the instant of the scrape
        held = _query(prom_port, 'sum(flyd_runs{job="flyd",state!="lost"})')
        assert held and held[0]["value"][1] == "1", held
        assert run_state(db_dsn, run)[0] == "running"
    finally:
        code = stop(node)
        if prometheus is not None:
            stop(prometheus)
    assert code == 0, node_log(tmp, "m")
    assert not [line for line in node_log(tmp, "m").splitlines()
                if '"metrics.render_failed"' in line]
    # the node drained: the metrics port is closed with it
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", listening["port"]), 2):
        pass


def test_a_metrics_port_that_cannot_be_bound_stops_the_start(db_dsn: str, tmp: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        node = start_node(tmp, "m", db_dsn, "--metrics", f"127.0.0.1:{port}", "--json")
        try:
            node.wait(60)
        finally:
            code = stop(node)
    assert code == 2
    assert f"flyd serve: cannot serve metrics on 127.0.0.1:{port}: " in node_log(tmp, "m")


def _scrape(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        assert answer.headers["Content-Type"] == CONTENT_TYPE
        return _families(answer.read().decode())


def _submit_cli(dsn: str, *args: str) -> int:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLYD_SOCKET", "FLYD_DSN", "FLYD_CONFIG", "FLYD_NODE_NAME")}
    out = subprocess.run([sys.executable, "-c", "from flyd.cli.flyd import flyctl_main; "
                          "flyctl_main()", "runs", "submit", "--dsn", dsn, "--json", *args],
                         cwd=ROOT, env=env, capture_output=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    run = orjson.loads(out.stdout)["run"]
    assert isinstance(run, int)
    return run


def test_a_scrape_reports_what_the_node_did(db_dsn: str, tmp: Path) -> None:
    """A process-mode run with checkpoints and a killed agent: the scrape after it shows the
    recovery's cause, the checkpoint commits, the renewals, the run's end and every step."""
    node = start_node(tmp, "m", db_dsn, "--metrics", "127.0.0.1:0")
    try:
        wait_for("the metrics endpoint", lambda: bool(log_events(tmp, "m", "metrics.listening"))
                 or node.poll() is not None, 60)
        assert node.poll() is None, node_log(tmp, "m")
        port = int(log_events(tmp, "m", "metrics.listening")[0]["port"])
        before = _scrape(port)
        # vacuity: nothing of the run is counted before it exists
        assert _values(before["flyd_recoveries"], "flyd_recoveries_total") == {}
        assert _values(before["flyd_checkpoint_commit_seconds"],
                       "flyd_checkpoint_commit_seconds_count") == {(): 0}
        assert _values(before["flyd_steps"], "flyd_steps_total") == {(): 0}
        run = _submit_cli(db_dsn, "--steps", "150", "--mode", "process", "--checkpoint-every",
                          "30", "--fault", "kill:fly-b@50")

        def stepping() -> bool:
            during = _scrape(port)
            return (_values(during["flyd_run_steps"], "flyd_run_steps_total").get(
                (("run", str(run)),), 0) > 0 and _values(during["flyd_workers"])[()] >= 1)

        wait_for("a scrape of the run stepping with its workers", stepping, 60)
        wait_for("the run to succeed", lambda: run_state(db_dsn, run)[0] == "succeeded", 120)
        after: dict[str, Any] = {}

        def ended() -> bool:  # the grant ends once its workers are reaped, after the commit
            after.update(_scrape(port))
            return _values(after["flyd_runs_ended"], "flyd_runs_ended_total")[
                (("state", "succeeded"),)] == 1

        wait_for("the scrape to count the grant's end", ended, 30)
    finally:
        code = stop(node)
    assert code == 0, node_log(tmp, "m")
    recoveries = _values(after["flyd_recoveries"], "flyd_recoveries_total")
    assert sum(recoveries.values()) == 1, recoveries  # the killed agent, once
    resumed = [e for e in log_events(tmp, "m", "recovery.resumed") if e.get("run") == run]
    assert len(resumed) == 1
    # every step taken: the 150 of the run and those re-executed after the restore
    restored = int(resumed[0]["boundary"])
    abandoned = [e for e in log_events(tmp, "m", "recovery.abandoned") if e.get("run") == run]
    assert len(abandoned) == 1, "the kill at 50 comes after the checkpoint at 30"
    reached = int(abandoned[0]["to_boundary"])
    assert reached > restored
    assert _values(after["flyd_steps"], "flyd_steps_total") == {(): 150 + reached - restored}
    assert sum(_values(after["flyd_runs_ended"], "flyd_runs_ended_total").values()) == 1
    assert _values(after["flyd_run_steps"], "flyd_run_steps_total") == {}  # the grant ended
    commits = _values(after["flyd_checkpoint_commit_seconds"],
                      "flyd_checkpoint_commit_seconds_count")[()]
    assert commits >= 5  # 30, 60 (and after the restore again), ..., the final one at 150
    assert _values(after["flyd_checkpoint_bytes"], "flyd_checkpoint_bytes_total")[()] > 0
    assert _values(after["flyd_lease_renew_seconds"], "flyd_lease_renew_seconds_count")[()] > 0
    assert sum(_values(after["flyd_lease_losses"], "flyd_lease_losses_total").values()) == 0
    assert _values(after["flyd_router_up"]) == {(): 1}
    assert _values(after["flyd_router_calls"], "flyd_router_calls_total")[
        (("result", "admitted"),)] > 150
    assert _values(after["flyd_workers"]) == {(): 0}
    assert {k[0][1] for k in _values(after["flyd_process_resident_bytes"])} == {"node",
                                                                               "router"}


def test_flyd_run_does_not_serve_the_configured_metrics(db_dsn: str, tmp: Path) -> None:
    """`[node] metrics` in a host's shared file is the host node's port: `flyd run` on that
    host must neither take it nor fail because the node holds it."""
    config = tmp / "flyd.toml"
    _DSN[tmp] = db_dsn
    try:
        with socket.socket() as held:
            held.bind(("127.0.0.1", 0))
            held.listen()
            config.write_text(f'[node]\nmetrics = "127.0.0.1:{held.getsockname()[1]}"\n')
            code, summary, err = flyd_run(tmp, "--config", str(config), "--steps", "20",
                                          "--mode", "inprocess")
    finally:
        _DSN.pop(tmp, None)
    assert code == 0 and summary["state"] == "succeeded", err
    assert "metrics.listening" not in err
