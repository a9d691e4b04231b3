"""The launcher (session.md §7): command lines, identities, the three execution modes, health,
reap, kill and restart — with real processes and a real router in the test process.

Test 33 (`test_every_flag_a_launch_writes_is_one_its_command_accepts`) is the §8 acceptance
test; the rest pin the launcher's own contract.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Literal

import psutil
import pytest

from bus.client_calls import CallResult
from bus.client_identity import Identity
from bus.errors import NoService, NotAuthorized, QuotaExceeded, TargetChanged
from flyd.config import load_config
from flyd.launch.budget import ThreadBudget
from flyd.launch.health import HealthPolicy, format_seconds, no_answer
from flyd.launch.identities import SessionNames
from flyd.launch.launcher import (
    AlreadyGone,
    ExecutionMode,
    Launcher,
    Stopped,
    Terminated,
    composition_plans,
    start_error,
    worker_launch,
)
from flyd.launch.spawner import LauncherSettings, Spawner
from flyd.session.runspec import AgentSpec, FaultSpecError, KillAt, RunSpec
from tests.session.conftest import children
from workers.faults import Faults, role_fields
from workers.launch import WorkerLaunch, parse_worker_argv
from workers.shell import Endpoint
from workers.types.domain import DomainError

if TYPE_CHECKING:
    from tests.session.conftest import LauncherFactory, Node

MODES = list(ExecutionMode)
MODE_IDS = [m.label() for m in MODES]
#: every mode, process mode with both launch methods ([session] launcher)
METHODS = [(ExecutionMode.PROCESS, "fork"), (ExecutionMode.PROCESS, "spawn"),
           (ExecutionMode.THREAD, "fork"), (ExecutionMode.IN_PROCESS, "fork")]
METHOD_IDS = ["process-fork", "process-spawn", "thread", "in-process"]
NAMES = SessionNames(session_id="demo", tag="s3", node_id="host-a-3f9c0e1b2a4d")
SOCKET = "/tmp/flyd-test/bus.sock"

AGENT_FAULTS = ["fly-a.prepare_delay_ms=15@2", "fly-a.commit_delay_ms=9@1",
                "fly-a.fail_commit_at_step=1", "fly-a.acknowledge_extra_id=req-9999",
                "fly-a.fail_capture=true", "fly-a.fail_stage_restore=true",
                "fly-a.fail_activate_restore=true",
                "fly-b.prepare_delay_ms=2600", "fly-b.commit_delay_ms=0@0"]
WORLD_FAULTS = ["arena.advance_delay_ms=120@0", "arena.omit_view_at_boundary=1",
                "arena.stale_view_at_boundary=2", "arena.truncated_view_at_boundary=3",
                "arena.omit_audio_at_boundary=2", "arena.overlapping_audio_at_boundary=3",
                "arena.acknowledge_extra_id=req-1", "arena.fail_capture=true",
                "arena.fail_stage_restore=true", "arena.fail_activate_restore=true"]


def every_fault_spec() -> RunSpec:
    return RunSpec(steps=10).with_faults(AGENT_FAULTS + WORLD_FAULTS)


def launches(spec: RunSpec, mode: ExecutionMode) -> list[WorkerLaunch]:
    return [worker_launch(NAMES, identity, settings, faults, mode, socket=SOCKET,
                          supervisor=NAMES.launcher_client_id, max_agents=4)
            for identity, settings, faults in composition_plans(NAMES, spec)]


def entry_point(launch: WorkerLaunch, *extra: str) -> subprocess.CompletedProcess[bytes]:
    """Run the real entry point with stdin closed (the start gate sees EOF)."""
    return subprocess.run([sys.executable, "-m", launch.module, *launch.to_argv(), *extra],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                          check=False)


# --------------------------------------------------------------------------------------------
# test 33


@pytest.mark.parametrize("mode", [ExecutionMode.PROCESS, ExecutionMode.THREAD], ids=["process",
                                                                                      "thread"])
def test_every_flag_a_launch_writes_is_one_its_command_accepts(mode: ExecutionMode) -> None:
    spec = every_fault_spec()
    written = launches(spec, mode)
    assert [w.worker_id for w in written] == ["arena", "fly-a", "fly-b"]
    for launch in written:
        # every knob of fly-a's and arena's role is set, @K delays included
        if launch.worker_id in ("fly-a", "arena"):
            for name in role_fields(launch.role):
                value = getattr(launch.faults, name)
                assert value is not None and value is not False, (launch.worker_id, name)
        assert launch.faults == spec.faults_of(launch.worker_id)
        argv = launch.to_argv()
        assert WorkerLaunch.from_argv(argv) == launch
        assert WorkerLaunch.from_argv(argv, launch.role) == launch
        assert parse_worker_argv(launch.role, argv) == launch
        assert ("--parent-pid" in argv) == (mode is ExecutionMode.PROCESS)
    fly_a = next(w for w in written if w.worker_id == "fly-a")
    argv = fly_a.to_argv()
    assert argv[argv.index("--prepare-delay-ms") + 1] == "15@2"
    assert argv[argv.index("--commit-delay-ms") + 1] == "9@1"
    assert argv[argv.index("--callers") + 1] == ",".join(NAMES.callers)
    assert argv[argv.index("--supervisor") + 1] == "s3.launcher"
    if mode is not ExecutionMode.PROCESS:
        return
    for launch in written[:2]:  # the environment and one agent entry point
        # the real entry point accepts every flag: it gets past its parser to the start gate,
        # which sees EOF and exits 1 (exit 2 would be a refused command line)
        accepted = entry_point(launch)
        assert accepted.returncode == 1, accepted.stderr.decode()
        refused = entry_point(launch, "--no-such-flag")
        assert refused.returncode == 2, refused.stderr.decode()
        assert b"--no-such-flag" in refused.stderr


@pytest.mark.parametrize(("form", "worker", "expected"), [
    ("fly-a.prepare_delay_ms=15", "fly-a", {"prepare_delay_ms": 15}),
    ("fly-a.prepare_delay_ms=15@4", "fly-a", {"prepare_delay_ms": 15,
                                              "prepare_delay_at_step": 4}),
    ("fly-b.commit_delay_ms=0@0", "fly-b", {"commit_delay_ms": 0, "commit_delay_at_step": 0}),
    ("fly-b.fail_commit_at_step=1", "fly-b", {"fail_commit_at_step": 1}),
    ("fly-a.acknowledge_extra_id=req-9999", "fly-a", {"acknowledge_extra_id": "req-9999"}),
    ("arena.acknowledge_extra_id=req-1", "arena", {"acknowledge_extra_id": "req-1"}),
    ("arena.advance_delay_ms=120@0", "arena", {"advance_delay_ms": 120,
                                               "advance_delay_at_step": 0}),
    ("arena.advance_delay_ms=5", "arena", {"advance_delay_ms": 5}),
    ("arena.omit_view_at_boundary=1", "arena", {"omit_view_at_boundary": 1}),
    ("arena.stale_view_at_boundary=2", "arena", {"stale_view_at_boundary": 2}),
    ("arena.truncated_view_at_boundary=3", "arena", {"truncated_view_at_boundary": 3}),
    ("arena.omit_audio_at_boundary=2", "arena", {"omit_audio_at_boundary": 2}),
    ("arena.overlapping_audio_at_boundary=3", "arena", {"overlapping_audio_at_boundary": 3}),
    ("fly-a.fail_capture=true", "fly-a", {"fail_capture": True}),
    ("arena.fail_stage_restore=true", "arena", {"fail_stage_restore": True}),
    ("fly-b.fail_activate_restore=true", "fly-b", {"fail_activate_restore": True}),
    ("fly-a.fail_capture=false", "fly-a", {}),
])
def test_every_grammar_form_reaches_the_right_launch(form: str, worker: str,
                                                     expected: dict[str, Any]) -> None:
    spec = RunSpec(steps=10).with_faults([form])
    assert spec.faults_of(worker) == Faults(**expected)
    for other in spec.worker_ids():
        if other != worker:
            assert spec.faults_of(other) == Faults()
    launch = next(w for w in launches(spec, ExecutionMode.PROCESS) if w.worker_id == worker)
    assert launch.faults == Faults(**expected)
    assert WorkerLaunch.from_argv(launch.to_argv()) == launch


def test_injection_forms_reach_the_run_spec_not_a_launch() -> None:
    spec = RunSpec(steps=10).with_faults(["kill:fly-a@2", "lose-advance-result@3"])
    assert spec.injections.kill == (KillAt(2, "fly-a"),)
    assert spec.injections.lose_advance_result_at == (3,)
    for launch in launches(spec, ExecutionMode.PROCESS):
        assert launch.faults == Faults()


@pytest.mark.parametrize("forms", [
    ["fly-a.prepare_delay_ms=x"],
    ["fly-a.fail_commit_at_step=3@4"],
    ["fly-z.commit_delay_ms=1"],
    ["arena.commit_delay_ms=1"],
    ["fly-a.prepare_delay_ms=1", "fly-a.prepare_delay_ms=2"],
    ["kill:fly-a"],
], ids=lambda forms: forms[-1])
def test_malformed_forms_are_refused_naming_them(forms: list[str]) -> None:
    with pytest.raises(FaultSpecError) as err:
        RunSpec(steps=10).with_faults(forms)
    assert err.value.code == "INVALID_ARGUMENT"
    assert err.value.mutation == "none"
    assert forms[-1] in err.value.message


# --------------------------------------------------------------------------------------------
# pure parts


def test_execution_modes_have_their_labels() -> None:
    assert [m.label() for m in ExecutionMode] == ["process", "thread", "in-process"]
    assert ExecutionMode.from_label("in-process") is ExecutionMode.IN_PROCESS
    with pytest.raises(DomainError):
        ExecutionMode.from_label("fork")


def test_health_policy_defaults_config_and_messages() -> None:
    assert HealthPolicy() == HealthPolicy(probe=2.0, fail=10.0, boot=30.0)
    configured = load_config(None, {"session.health_fail_s": 0.5, "session.probe_s": 9}, {})
    assert configured.settings.session.health == HealthPolicy(fail=0.5)
    bad: list[tuple[dict[str, Any], str]] = [
        ({"probe": 0}, "health_probe_s"), ({"fail": -1.0}, "health_fail_s"),
        ({"boot": True}, "health_boot_s"), ({"boot": float("inf")}, "health_boot_s")]
    for values, key in bad:
        with pytest.raises(DomainError) as err:
            HealthPolicy(**values)
        assert key in err.value.message
    assert [format_seconds(s) for s in (0.2, 0.05, 10.0, 2.5, 1)] == [
        "200ms", "50ms", "10s", "2.5s", "1s"]
    error = no_answer("Worker.Status", "fly-a", 10.0)
    assert (error.code, error.mutation) == ("BACKEND_FAILURE", "unknown")
    assert error.message == ("Worker.Status: fly-a did not answer within the supervisor's "
                             "budget of 10s")


def test_start_errors_map_to_bus_errors() -> None:
    assert isinstance(start_error(DomainError.before("BUSY", "full")), QuotaExceeded)
    assert isinstance(start_error(DomainError.before("IDENTITY_MISMATCH", "x")), NotAuthorized)
    assert isinstance(start_error(DomainError.invalid("x")), NoService)
    assert start_error(DomainError.before("BUSY", "full")).message == "full"


def hello_result(identity_fields: dict[str, Any], *, responder: tuple[str, str] | None = None,
                 request_id: str = "req-1") -> CallResult:
    fly = NAMES.agent("fly-a", "p1", threads=2)
    hello = {"selectedMajor": 1, "selectedMinor": 0, "workerId": "fly-a",
             "incarnationId": "fly-a-inc-1", "role": "agent", "buildDigest": "0" * 64,
             "contractDigest": "0" * 64, "capabilities": [],
             "limits": {"maxAgents": 4, "maxPorts": 4, "workerThreads": fly.worker_threads}}
    hello.update(identity_fields)
    outcome = {"type": "result", "requestId": request_id, "workerId": hello["workerId"],
               "incarnationId": hello["incarnationId"], "scope": None, "result": hello}
    who = responder or (fly.client_id, fly.incarnation_id)
    return CallResult(1, "svc-1", Identity(*who), outcome)


@pytest.mark.parametrize(("change", "needle"), [
    ({"limits": {"maxAgents": 4, "maxPorts": 4, "workerThreads": 1}}, "workerThreads"),
    ({"role": "environment"}, "role"),
    ({"workerId": "fly-b"}, "worker"),
    ({"incarnationId": "fly-a-inc-7"}, "incarnation"),
])
def test_a_hello_that_does_not_match_the_identity_fails_identity_mismatch(
        change: dict[str, Any], needle: str) -> None:
    fly = NAMES.agent("fly-a", "p1", threads=2)
    check = Launcher._check_hello
    launcher = Launcher.__new__(Launcher)
    check(launcher, fly, "req-1", hello_result({}))  # the unchanged hello passes
    with pytest.raises(DomainError) as err:
        check(launcher, fly, "req-1", hello_result(change))
    assert (err.value.code, err.value.mutation) == ("IDENTITY_MISMATCH", "none")
    assert needle in err.value.message
    with pytest.raises(DomainError) as err:
        check(launcher, fly, "req-2", hello_result({}))
    assert "echoes request" in err.value.message
    with pytest.raises(DomainError) as err:
        check(launcher, fly, "req-1", hello_result({}, responder=("s3.fly-a.g9", "x")))
    assert "answered by s3.fly-a.g9" in err.value.message
    second = fly.next_generation()
    old = hello_result({}, responder=(fly.client_id, fly.incarnation_id))
    assert Launcher._from_predecessor(second, old)
    assert not Launcher._from_predecessor(fly, old)


# --------------------------------------------------------------------------------------------
# real workers


def spec_with_threads() -> RunSpec:
    return RunSpec(agents=(AgentSpec("fly-a", "p1", threads=2), AgentSpec("fly-b", "p2")))


async def raw_hello(launcher: Launcher, worker_id: str,
                    expected_worker: str | None = None) -> dict[str, Any]:
    lw = launcher.get(worker_id)
    params = {"sessionId": lw.identity.session_id,
              "expectedWorkerId": expected_worker or worker_id,
              "role": lw.identity.role, "supportedMajors": [1]}
    res = await launcher.client.call(
        lw.identity.service, "Worker.Hello", {"requestId": "req-900", "scope": None,
                                              "params": params},
        timeout=10, expected_incarnation=lw.service_incarnation)
    outcome: dict[str, Any] = res.outcome
    return outcome


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("flyd-s")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "method"), METHODS, ids=METHOD_IDS)
async def test_a_session_launches_identifies_restarts_and_reaps_in_every_mode(
        mode: ExecutionMode, method: Literal["fork", "spawn"],
        launchers: LauncherFactory) -> None:
    budget = ThreadBudget(8, 1)
    launcher = await launchers(budget=budget,
                               spawner=Spawner(LauncherSettings(method=method, concurrency=2)))
    tag = launcher.names.tag
    assert budget.holders() == {f"coordinator-{tag}": 1}
    started = time.perf_counter()
    launched = await launcher.launch_composition(spec_with_threads(), mode)
    elapsed = time.perf_counter() - started
    print(f"\nlaunch of 3 workers in {mode.label()} mode: {elapsed * 1000:.0f} ms")
    assert sorted(launched) == ["arena", "fly-a", "fly-b"]
    assert budget.holders() == {f"coordinator-{tag}": 1, f"{tag}.arena": 1, f"{tag}.fly-a": 2,
                                f"{tag}.fly-b": 1}
    for wid, lw in launched.items():
        identity = lw.identity
        assert identity.worker_id == wid
        assert lw.mode is mode
        assert lw.domain_incarnation == identity.incarnation_id == f"{wid}-inc-1"
        assert identity.client_id == f"{tag}.{wid}.g1"
        assert lw.service_incarnation.startswith("svc-")
        ref = lw.worker_ref()
        assert (ref.service, ref.service_incarnation, ref.worker_id, ref.domain_incarnation) \
            == (identity.service, lw.service_incarnation, wid, identity.incarnation_id)
        status = await launcher.health_check(wid)
        assert status["state"] == "uninitialized"
        assert status["currentScope"] is None
        hello = await raw_hello(launcher, wid)
        assert hello["type"] == "result", hello
        assert hello["result"]["workerId"] == wid
        assert hello["result"]["incarnationId"] == identity.incarnation_id
        assert hello["result"]["role"] == identity.role
        assert hello["result"]["limits"]["workerThreads"] == identity.worker_threads \
            == budget.allocation(launcher.holder(wid))
        info = launcher.info(wid)
        assert info.worker_threads == identity.worker_threads
        assert info.rss_kib is not None and info.rss_kib > 0
        if mode is ExecutionMode.PROCESS:
            assert lw.pid is not None and lw.pid != os.getpid()
            assert info.pid == lw.pid
            assert os.getpgid(lw.pid) == lw.pid  # its own process group
            assert os.getsid(lw.pid) == lw.pid  # and session
            parent = psutil.Process(psutil.Process(lw.pid).ppid())
            if method == "fork":  # forked by the launcher's fork server, a child of ours
                assert parent.pid == await launcher.spawner.parent_pid()
                assert "workers.forkserver" in parent.cmdline()
                assert parent.ppid() == os.getpid()
            else:
                assert parent.pid == os.getpid()
            # either way the command line is the worker's own (`python -m workers.<role>`)
            shown = [arg for arg in psutil.Process(lw.pid).cmdline() if arg]
            module = "workers.agent" if identity.role == "agent" else "workers.environment"
            assert shown[:3] == [sys.executable, "-m", module]
            written = parse_worker_argv(identity.role, shown[3:])
            assert (written.worker_id, written.incarnation_id, written.parent_pid) == (
                wid, identity.incarnation_id, parent.pid)
            assert lw.peak_rss_kib is not None and lw.peak_rss_kib > 0
            if method == "spawn":  # a forked worker sets them in its own memory, not /proc
                env = psutil.Process(lw.pid).environ()
                assert env["OMP_NUM_THREADS"] == str(identity.worker_threads)
                assert env["PYTHONUNBUFFERED"] == "1"
        else:
            assert lw.pid is None
            assert info.pid == os.getpid()
    assert launched["fly-a"].identity.port_id == "p1"
    assert launched["arena"].identity.port_id is None
    wrong = await raw_hello(launcher, "fly-a", expected_worker="fly-z")
    assert wrong["type"] == "error"
    assert wrong["error"]["code"] == "IDENTITY_MISMATCH"
    if mode is ExecutionMode.THREAD:
        assert len(worker_threads()) == 3

    # restart: new generation, client id, incarnations (and pid)
    old = launched["fly-b"]
    new = await launcher.restart("fly-b")
    assert new.identity.generation == 2
    assert new.identity.client_id == f"{tag}.fly-b.g2"
    assert new.domain_incarnation == "fly-b-inc-2"
    assert new.service_incarnation != old.service_incarnation
    assert (await launcher.health_check("fly-b"))["state"] == "uninitialized"
    if mode is ExecutionMode.PROCESS:
        assert old.pid is not None and new.pid is not None and new.pid != old.pid
        assert not psutil.pid_exists(old.pid) or \
            psutil.Process(old.pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises((TargetChanged, NoService)):
        await launcher.client.call(old.identity.service, "Worker.Status",
                                   {"requestId": "req-901", "scope": None, "params": {}},
                                   timeout=5, expected_incarnation=old.service_incarnation)
    assert budget.allocation(launcher.holder("fly-b")) == 1

    outcomes = await launcher.reap_all("test-done")
    assert outcomes == {"arena": Stopped("arena", 0), "fly-a": Stopped("fly-a", 0),
                        "fly-b": Stopped("fly-b", 0)}
    assert await launcher.reap("fly-a", "again") == AlreadyGone("fly-a")
    assert launcher.workers() == {}
    assert budget.holders() == {f"coordinator-{tag}": 1}
    await launcher.close()
    await launcher.spawner.close()
    assert budget.holders() == {}
    assert children(servers=True) == []
    assert worker_threads() == []
    services = await launcher.node.services(f"{tag}.")
    assert services == []


class NullAgent(Endpoint):
    """A shell with no domain methods: `Worker.*` only."""

    role = "agent"
    base_capabilities = ("agent-step-v1",)


class BrokenAgent(Endpoint):
    role = "agent"
    base_capabilities = ()

    def __init__(self, launch: WorkerLaunch) -> None:
        raise DomainError.invalid("this model cannot be built")


def null_factory(launch: WorkerLaunch) -> Endpoint:
    return NullAgent(launch)


def broken_factory(launch: WorkerLaunch) -> Endpoint:
    return BrokenAgent(launch)


def agent_plan(launcher: Launcher, agent_id: str = "fly-a", threads: int = 1) -> Any:
    spec = RunSpec(agents=(AgentSpec(agent_id, "p1", threads=threads),))
    return composition_plans(launcher.names, spec)[1]


@pytest.mark.parametrize("mode", [ExecutionMode.THREAD, ExecutionMode.IN_PROCESS],
                         ids=["thread", "in-process"])
async def test_a_body_that_ends_before_hello_fails_the_launch_at_once(
        mode: ExecutionMode, launchers: LauncherFactory) -> None:
    budget = ThreadBudget(4, 1)
    launcher = await launchers(budget=budget, endpoint_factory=broken_factory)
    identity, settings, faults = agent_plan(launcher)
    started = time.perf_counter()
    with pytest.raises(DomainError) as err:
        await launcher.launch(identity, settings, mode, faults=faults)
    assert time.perf_counter() - started < 5
    # the body's own refusal, its code kept: a launch refused for its arguments is not retried
    assert (err.value.code, err.value.mutation) == ("INVALID_ARGUMENT", "none")
    assert "before it answered" in err.value.message
    assert "this model cannot be built" in err.value.message
    assert launcher.workers() == {}
    assert budget.remaining == 3
    assert worker_threads() == []


async def test_a_process_that_exits_before_hello_fails_the_launch(
        launchers: LauncherFactory) -> None:
    budget = ThreadBudget(4, 1)
    launcher = await launchers(budget=budget)
    identity, settings, faults = agent_plan(launcher)
    settings = type(settings)(port_id="p1", model="no_such_module:Model")
    with pytest.raises(DomainError) as err:
        await launcher.launch(identity, settings, ExecutionMode.PROCESS, faults=faults)
    # the worker's refusal line names the reason; its code and plugin fault are kept
    assert err.value.code == "INVALID_ARGUMENT"
    assert "exited with code 2" in err.value.message
    assert "cannot import no_such_module" in err.value.message
    assert err.value.data is not None and err.value.data.stage == "import"
    assert budget.remaining == 3
    assert children() == []


async def test_a_process_that_dies_silently_before_hello_is_named_by_its_last_output(
        launchers: LauncherFactory) -> None:
    launcher = await launchers(budget=ThreadBudget(4, 1))
    identity, settings, faults = agent_plan(launcher)
    settings = type(settings)(port_id="p1",
                              model="tests.fixtures.plugins.dies_on_import:Model")
    with pytest.raises(DomainError) as err:
        await launcher.launch(identity, settings, ExecutionMode.PROCESS, faults=faults)
    assert (err.value.code, err.value.mutation) == ("BACKEND_FAILURE", "none")
    assert "exited with code 7 before it answered; its last output:" in err.value.message
    assert "the licence server is unreachable" in err.value.message
    assert err.value.data is None
    assert children() == []


async def test_a_launch_the_budget_refuses_starts_nothing(launchers: LauncherFactory,
                                                          node: Node) -> None:
    budget = ThreadBudget(2, 1)
    launcher = await launchers(budget=budget)
    with pytest.raises(DomainError) as err:
        await launcher.launch_composition(RunSpec(), ExecutionMode.PROCESS)
    assert err.value.code == "BUSY"
    assert "wants 3 worker threads; 1 of 2 remain" in err.value.message
    assert isinstance(start_error(err.value), QuotaExceeded)
    identity, settings, faults = agent_plan(launcher, threads=2)
    with pytest.raises(DomainError) as err:
        await launcher.launch(identity, settings, ExecutionMode.PROCESS, faults=faults)
    assert err.value.message == f"{launcher.names.tag}.fly-a wants 2 threads; 1 of 2 remain"
    assert children() == []
    assert launcher.workers() == {}
    await launchers(budget=budget)  # a second session's reservation takes the last thread
    with pytest.raises(DomainError) as err:
        await launchers(budget=budget)  # a third one's does not fit
    assert err.value.code == "BUSY"
    assert err.value.message.startswith("coordinator-s")


async def test_kill_reap_and_health_of_unknown_and_gone_workers(
        launchers: LauncherFactory) -> None:
    launcher = await launchers(endpoint_factory=null_factory)
    identity, settings, faults = agent_plan(launcher)
    with pytest.raises(DomainError) as err:
        await launcher.health_check("fly-a")
    assert err.value.code == "IDENTITY_MISMATCH"
    assert await launcher.kill("fly-a") == AlreadyGone("fly-a")
    assert await launcher.reap("fly-a", "x") == AlreadyGone("fly-a")
    with pytest.raises(DomainError) as err:
        await launcher.restart("fly-a")
    assert err.value.code == "IDENTITY_MISMATCH"
    await launcher.launch(identity, settings, ExecutionMode.IN_PROCESS, faults=faults)
    with pytest.raises(DomainError) as err:
        await launcher.launch(identity, settings, ExecutionMode.IN_PROCESS, faults=faults)
    assert err.value.code == "CONFLICT"
    result = await launcher.kill("fly-a")
    assert isinstance(result, Terminated)
    assert await launcher.kill("fly-a") == AlreadyGone("fly-a")
    # restart after a kill launches the next generation
    again = await launcher.restart("fly-a")
    assert again.domain_incarnation == "fly-a-inc-2"
    assert (await launcher.health_check("fly-a"))["state"] == "uninitialized"


async def test_a_thread_whose_loop_does_not_answer_fails_its_health_check(
        launchers: LauncherFactory) -> None:
    launcher = await launchers(health=HealthPolicy(probe=0.2, fail=0.3, boot=10),
                               endpoint_factory=null_factory)
    identity, settings, faults = agent_plan(launcher)
    await launcher.launch(identity, settings, ExecutionMode.THREAD, faults=faults)
    body = launcher._workers["fly-a"].body
    loop = body.worker.loop  # type: ignore[attr-defined]
    loop.call_soon_threadsafe(time.sleep, 1.5)  # the worker's loop is stuck in native code
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    with pytest.raises(DomainError) as err:
        await launcher.health_check("fly-a")
    assert time.perf_counter() - started < 1.0
    assert (err.value.code, err.value.mutation) == ("BACKEND_FAILURE", "unknown")
    assert err.value.message == ("Worker.Status: fly-a did not answer within the "
                                 "supervisor's budget of 300ms")
    outcome = await launcher.reap("fly-a", "stuck")
    assert isinstance(outcome, Terminated)
    assert worker_threads() == []


async def test_supervise_reports_a_worker_that_dies_on_its_own(
        launchers: LauncherFactory) -> None:
    launcher = await launchers(health=HealthPolicy(probe=0.1, fail=1.0, boot=30))
    identity, settings, faults = agent_plan(launcher)
    lw = await launcher.launch(identity, settings, ExecutionMode.PROCESS, faults=faults)
    reports: list[tuple[str, DomainError]] = []
    got = asyncio.Event()

    def report(worker_id: str, error: DomainError) -> None:
        reports.append((worker_id, error))
        got.set()

    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(launcher.supervise(report))
        await asyncio.sleep(0.3)
        assert reports == []  # healthy workers are not reported
        assert lw.pid is not None
        os.killpg(lw.pid, signal.SIGKILL)
        async with asyncio.timeout(5):
            await got.wait()
        watcher.cancel()
    worker_id, error = reports[0]
    assert worker_id == "fly-a"
    assert (error.code, error.mutation) == ("BACKEND_FAILURE", "unknown")
    assert f"exited with code {-signal.SIGKILL}" in error.message
    assert isinstance(await launcher.reap("fly-a", "dead"), Terminated)
    assert children() == []


async def test_close_kills_every_remaining_body(launchers: LauncherFactory) -> None:
    budget = ThreadBudget(8, 1)
    launcher = await launchers(budget=budget, endpoint_factory=null_factory)
    await launcher.launch(*agent_plan(launcher, "fly-a")[:2], ExecutionMode.THREAD)
    await launcher.launch(*agent_plan(launcher, "fly-b")[:2], ExecutionMode.IN_PROCESS)
    proc = await launcher.launch(*agent_plan(launcher, "fly-c")[:2], ExecutionMode.PROCESS)
    assert proc.pid is not None
    assert [c.pid for c in children()] == [proc.pid]
    groups = launcher.kill_process_groups()
    assert groups == [proc.pid]
    await launcher.close()
    assert budget.holders() == {}
    assert children() == []
    assert worker_threads() == []
    with pytest.raises(DomainError):
        await launcher.launch(*agent_plan(launcher, "fly-d")[:2], ExecutionMode.IN_PROCESS)


def test_launched_worker_info_fields_are_documented() -> None:
    from flyd.launch.launcher import LaunchedWorker, WorkerInfo

    assert [f.name for f in fields(LaunchedWorker)] == [
        "identity", "mode", "service_incarnation", "domain_incarnation", "pid", "peak_rss_kib"]
    assert "peak_rss_kib" in [f.name for f in fields(WorkerInfo)]


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
async def test_an_expectation_the_router_refuses_fails_the_launch_and_kills_the_body(
        mode: ExecutionMode, launchers: LauncherFactory) -> None:
    budget = ThreadBudget(4, 1)
    launcher = await launchers(budget=budget, endpoint_factory=null_factory)
    identity, settings, faults = agent_plan(launcher)
    await launcher.launch(identity, settings, mode, faults=faults)
    assert isinstance(await launcher.kill("fly-a"), Terminated)
    # generation 1's incarnation was used: the router refuses to expect it again
    with pytest.raises(DomainError) as err:
        await launcher.launch(identity, settings, mode, faults=faults)
    assert (err.value.code, err.value.mutation) == ("IDENTITY_MISMATCH", "none")
    assert "bus.expect" in err.value.message and "CONFLICT" in err.value.message
    assert budget.remaining == 3
    assert launcher.workers() == {}
    assert children() == []
    assert worker_threads() == []


NODE_SCRIPT = """
import asyncio, logging, os, sys, tempfile
import structlog, uvloop
from bus.client import connect
from bus.policy import Policy
from bus.router import Router, RouterConfig
from flyd.launch.budget import ThreadBudget
from flyd.launch.spawner import LauncherSettings
from flyd.launch.identities import SessionNames, new_node_id, node_client_id
from flyd.launch.launcher import ExecutionMode, Launcher
from flyd.session.runspec import RunSpec
from flyd.launch.spawner import Spawner

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))

async def main():
    d = tempfile.mkdtemp(prefix="flyd-o-", dir="/tmp")
    path = os.path.join(d, "bus.sock")
    router = Router(RouterConfig(socket_path=path, policy=Policy.default(os.getpid())))
    await router.start()
    node_id = new_node_id("orphans")
    node = await connect(path, client_id=node_client_id(node_id))
    launcher = await Launcher.open(names=SessionNames("demo", "s1", node_id), socket=path,
                                   node=node, budget=ThreadBudget(8, 1),
                                   spawner=Spawner(LauncherSettings(method=sys.argv[1])))
    launched = await launcher.launch_composition(RunSpec(), ExecutionMode.PROCESS)
    print("PIDS", d, *(w.pid for w in launched.values()), flush=True)
    await asyncio.sleep(300)

uvloop.run(main())
"""


def gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_killed_node_takes_its_process_workers_with_it(method: str) -> None:
    node = subprocess.Popen([sys.executable, "-c", NODE_SCRIPT, method], stdout=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    socket_dir = ""
    try:
        assert node.stdout is not None
        line = node.stdout.readline().decode()
        assert line.startswith("PIDS "), line
        _, socket_dir, *pids = line.split()
        workers = [psutil.Process(int(pid)) for pid in pids]
        assert len(workers) == 3
        parents = {w.ppid() for w in workers}
        if method == "fork":  # the node's fork server, itself a child of the node
            (server,) = (psutil.Process(pid) for pid in parents)
            assert server.ppid() == node.pid and "workers.forkserver" in server.cmdline()
            workers.append(server)
        else:
            assert parents == {node.pid}
        node.send_signal(signal.SIGKILL)
        node.wait(10)
        deadline = time.monotonic() + 5
        alive = workers
        while alive and time.monotonic() < deadline:
            alive = [w for w in alive if not gone(w)]
            time.sleep(0.05)
        assert alive == []
    finally:
        node.kill()
        node.wait(10)
        if socket_dir.startswith("/tmp/flyd-o-"):
            subprocess.run(["rm", "-rf", socket_dir], check=False)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
async def test_a_composition_launches_all_or_nothing(mode: ExecutionMode,
                                                     launchers: LauncherFactory) -> None:
    budget = ThreadBudget(8, 1)
    launcher = await launchers(budget=budget)
    spec = RunSpec(agents=(AgentSpec("fly-a", "p1"),
                           AgentSpec("fly-b", "p2", model="no_such_module:Model")))
    with pytest.raises(DomainError) as err:
        await launcher.launch_composition(spec, mode)
    # every mode names why fly-b ended: the import its worker refused, as a plugin fault
    assert err.value.code == "INVALID_ARGUMENT"
    assert "fly-b" in err.value.message and "before it answered" in err.value.message
    assert "cannot import no_such_module" in err.value.message
    assert err.value.data is not None
    assert (err.value.data.plugin, err.value.data.stage, err.value.data.exception) == \
        ("no_such_module:Model", "import", "ModuleNotFoundError")
    assert err.value.data.repeats
    assert launcher.workers() == {}
    assert budget.holders() == {f"coordinator-{launcher.names.tag}": 1}
    assert children() == []
    assert worker_threads() == []


async def test_a_thread_that_does_not_stop_is_terminated_and_left_as_a_daemon(
        launchers: LauncherFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    import flyd.launch.launcher

    monkeypatch.setattr(flyd.launch.launcher, "KILL_WAIT_S", 0.3)
    budget = ThreadBudget(4, 1)
    launcher = await launchers(budget=budget, endpoint_factory=null_factory)
    identity, settings, faults = agent_plan(launcher)
    await launcher.launch(identity, settings, ExecutionMode.THREAD, faults=faults)
    body = launcher._workers["fly-a"].body
    worker = body.worker  # type: ignore[attr-defined]
    thread = worker.thread
    worker.loop.call_soon_threadsafe(time.sleep, 1.5)
    await asyncio.sleep(0.05)
    started = time.perf_counter()
    assert isinstance(await launcher.kill("fly-a"), Terminated)
    assert time.perf_counter() - started < 1.0
    assert thread.daemon and thread.is_alive()
    assert budget.remaining == 3  # released although the thread still runs
    await asyncio.to_thread(thread.join, 5)  # it ends once native code returns
    assert not thread.is_alive()


async def test_a_worker_that_never_registers_fails_at_the_boot_budget(
        launchers: LauncherFactory, tmp_path: Any) -> None:
    silent = tmp_path / "silent-python"
    silent.write_text("#!/bin/sh\nexec sleep 60\n")
    silent.chmod(0o755)
    budget = ThreadBudget(4, 1)
    spawner = Spawner(LauncherSettings(method="spawn"), python=str(silent))
    launcher = await launchers(budget=budget, python=str(silent), spawner=spawner,
                               health=HealthPolicy(probe=0.2, fail=0.2, boot=0.5))
    identity, settings, faults = agent_plan(launcher)
    started = time.perf_counter()
    try:
        with pytest.raises(DomainError) as err:
            await launcher.launch(identity, settings, ExecutionMode.PROCESS, faults=faults)
    finally:
        await spawner.close()
    assert 0.5 <= time.perf_counter() - started < 3
    assert err.value.code == "BACKEND_FAILURE"
    assert err.value.message.startswith(
        f"Worker.Hello: fly-a did not answer on {identity.service} within the boot budget of "
        "500ms (last: bus NO_SERVICE")
    assert budget.remaining == 3
    assert children() == []


async def test_the_trace_comparator_ignores_operational_fields_and_rebases_epochs() -> None:
    import copy

    from flyd.session.trace import EpochRebase, TraceLog, compare
    from tests.session.harness import Fixture, SessionHarness
    from workers.synthetic.task import CounterTask

    async def trace_of(epoch: str) -> TraceLog:
        async with SessionHarness.start(Fixture(epoch=epoch)) as h:
            await h.bootstrap()
            await h.run(3)
            return h.coordinator.trace

    e1 = await trace_of("e1")
    again = await trace_of("e1")
    assert compare(e1, again) is None
    changed = TraceLog()
    for t in e1.transitions:
        operational = copy.deepcopy(t.operational)
        operational["wallTimeNs"] += 12345
        operational["advanceRequestId"] = "req-999"
        operational["prepareRequestIds"] = [{"agentId": r["agentId"], "requestId": "req-77"}
                                            for r in operational["prepareRequestIds"]]
        changed.record(copy.deepcopy(t.behaviour), operational)
    assert compare(e1, changed) is None
    altered = [copy.deepcopy(t.behaviour) for t in e1.transitions]
    altered[1]["batchId"] = "batch-e1-7"
    assert compare(e1, altered) == (1, "batchId")
    e2 = await trace_of("e2")
    assert compare(e1, e2) is not None
    assert compare(e1, e2, rebase=EpochRebase("e1", "e2", CounterTask())) is None
