"""Agent hosts (`[session] agents_per_process`, run spec `agentsPerProcess`; docs/launcher.md,
"Agent hosts"): real `flyd run` sessions in process mode whose agents share worker processes.

Hosting changes where agents run, not what they do: a hosted run has the behaviour digest of the
same run with one process per agent, and a kill of one hosted agent ends its whole host (one
failure domain), after which the session recovers every participant and still ends with the
clean digest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from flyd.launch.identities import SessionNames
from flyd.launch.launcher import composition_plans, host_groups
from flyd.session.runspec import RunSpec
from tests.cli.test_run import flyd_run
from tests.cli.test_run import tmp as tmp
from workers.faults import Faults
from workers.host import HostLaunch, parse_host_argv
from workers.launch import AgentSettings, WorkerLaunch

pytestmark = pytest.mark.timeout(240)

AGENTS = "a1,a2,a3,a4,a5,a6,a7,a8"
STEPS = "120"


def config(tmp: Path, per_process: int) -> str:
    path = tmp / f"hosts-{per_process}.toml"
    path.write_text(f"[session]\nagents_per_process = {per_process}\nmax_agents = 64\n")
    return str(path)


def pids(summary: dict[str, Any]) -> dict[str, int]:
    return {w["workerId"]: w["pid"] for w in summary["workers"]}


def run(tmp: Path, per_process: int, *extra: str) -> dict[str, Any]:
    return run_logged(tmp, per_process, *extra)[0]


def run_logged(tmp: Path, per_process: int, *extra: str
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The run's summary and its `launcher.launched_host` log events."""
    code, summary, stderr = flyd_run(tmp, "--steps", STEPS, "--mode", "process", "--agents",
                                     AGENTS, "--no-pace", "--config", config(tmp, per_process),
                                     *extra, timeout=200)
    assert code == 0 and summary["state"] == "succeeded", summary
    hosts = [event for line in stderr.splitlines() if line.startswith("{")
             for event in [orjson.loads(line)] if event.get("event") == "launcher.launched_host"]
    return summary, hosts


def test_hosted_agents_share_processes_and_behave_as_one_per_process(tmp: Path) -> None:
    alone = run(tmp, 1)
    hosted = run(tmp, 4)
    assert hosted["behaviourDigest"] == alone["behaviourDigest"]
    assert len(set(pids(alone).values())) == 9
    by_pid = pids(hosted)
    assert by_pid["a1"] == by_pid["a2"] == by_pid["a3"] == by_pid["a4"]
    assert by_pid["a5"] == by_pid["a6"] == by_pid["a7"] == by_pid["a8"]
    assert len({by_pid["a1"], by_pid["a5"], by_pid["arena"]}) == 3


def test_a_kill_of_one_hosted_agent_recovers_the_host_with_the_clean_digest(tmp: Path) -> None:
    clean = run(tmp, 1)["behaviourDigest"]
    summary, hosts = run_logged(tmp, 4, "--fault", "kill:a2@40", "--checkpoint-every", "20")
    assert summary["behaviourDigest"] == clean
    assert summary["recoveries"] == 1 and summary["epochs"] == ["e1", "e2"]
    (failure,) = summary["failures"]
    # the host is one failure domain: a sibling's exit is reported, naming the host and the kill
    assert failure["participant"] in {"a1", "a3", "a4"}, failure
    assert "a2 was killed" in failure["message"] and "a1, a2, a3, a4" in failure["message"]
    # every participant replaced, the agents hosted again as they were
    assert sorted(sorted(h["incarnations"]) for h in hosts) == [
        [f"a{i}-inc-{g}" for i in range(first, first + 4)]
        for first, g in ((1, 1), (1, 2), (5, 1), (5, 2))]


def test_the_run_spec_sets_agents_per_process(tmp: Path) -> None:
    spec = tmp / "spec.json"
    spec.write_bytes(orjson.dumps({"agentsPerProcess": 3}))
    summary = run(tmp, 1, "--spec", str(spec))
    by_pid = pids(summary)
    assert by_pid["a1"] == by_pid["a2"] == by_pid["a3"] != by_pid["a4"]
    assert by_pid["a7"] == by_pid["a8"] != by_pid["a6"]  # the last host holds the rest


def _launch(agent: str, port: str) -> WorkerLaunch:
    names = SessionNames(session_id="demo", tag="s1", node_id="n1")
    identity = names.agent(agent, port, 1, 1)
    return WorkerLaunch(
        socket="/tmp/x.sock", session_id="demo", worker_id=agent,
        incarnation_id=identity.incarnation_id, client_id=identity.client_id,
        service=identity.service, supervisor="s1.launcher", callers=("s1.coordinator",),
        threads=1, max_agents=8, settings=AgentSettings(port_id=port),
        faults=Faults(), parent_pid=4242)


def test_a_host_command_line_round_trips() -> None:
    host = HostLaunch((_launch("a1", "p1"), _launch("a2", "p2")))
    assert parse_host_argv(host.to_argv()) == host
    assert host.command("python")[:3] == ["python", "-m", "workers.host"]


def test_host_groups_keep_the_world_alone_and_chunk_the_agents() -> None:
    names = SessionNames(session_id="demo", tag="s1", node_id="n1")
    spec = RunSpec.validate({"agents": [{"agentId": f"a{i}", "portId": f"p{i}"}
                                        for i in range(1, 6)]}, max_agents=8)
    plans = composition_plans(names, spec)
    groups = host_groups(plans, 2)
    assert [[p[0].worker_id for p in g] for g in groups] == [
        ["arena"], ["a1", "a2"], ["a3", "a4"], ["a5"]]
    assert [[p[0].worker_id for p in g] for g in host_groups(plans, 1)] == [
        ["arena"], ["a1"], ["a2"], ["a3"], ["a4"], ["a5"]]
