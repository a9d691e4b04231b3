"""The worker shell (session.md §2.1–§2.8) driven over a real router: start and exit codes,
the request pipeline in its order, `Worker.*`, the status cell, dedup through the shell, and the
three execution modes (in-process task, `WorkerThread`, `python -m workers.<role>`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest

from bus.client import connect
from bus.errors import NotAuthorized
from bus.policy import Policy
from bus.router import Router, RouterConfig
from tests.session.worker_rig import (
    OUTCOME,
    Rig,
    agent_init_params,
    agent_launch,
    boot_digest,
    commit_params,
    environment_launch,
    prepare_params,
    rig,
    scope,
    short_socket,
    wait_for,
)
from workers import shell as shell_module
from workers.bodies import WorkerThread, run_worker
from workers.faults import Faults, Role
from workers.launch import REFUSED_LAUNCH, START_GATE, WorkerLaunch, die_with_parent
from workers.roles import endpoint_for
from workers.shell import (
    EXIT_ARGS,
    EXIT_GATE,
    EXIT_LOST,
    EXIT_REGISTER,
    EXIT_SHUTDOWN,
    Call,
    Endpoint,
    WorkerShell,
)
from workers.types.canonical import digest_bytes, digest_of
from workers.types.contract import build_digest, contract_digest
from workers.types.domain import DomainError

__all__ = ["rig"]

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"
HELLO = {"sessionId": "demo", "expectedWorkerId": "fly-a", "role": "agent",
         "supportedMajors": [1]}


def hello(**changes: Any) -> dict[str, Any]:
    return {**HELLO, **changes}


async def initialized_agent(rig: Rig, faults: Faults | None = None,
                            agent: str = "fly-a") -> Endpoint:
    endpoint = await rig.start_endpoint(agent_launch(rig.socket, agent, faults=faults))
    await rig.init_agent(agent)
    return endpoint


async def prepare(rig: Rig, k: int, agent: str = "fly-a", **kw: Any) -> tuple[str, dict[str, Any]]:
    rid = rig.next_id(agent)
    digest = kw.pop("digest", boot_digest() if k == 0 else None)
    if digest is None:
        from tests.session.worker_rig import context_digest

        digest = context_digest(k)
    outcome = await rig.call(agent, "Agent.Prepare", prepare_params(agent, digest), scope(k),
                             request_id=rid, **kw)
    return rid, outcome


async def transition(rig: Rig, k: int, agent: str = "fly-a") -> None:
    rid, outcome = await prepare(rig, k, agent)
    assert outcome["type"] == "result", outcome
    await rig.ok(agent, "Agent.Commit", commit_params(agent, rid, k), scope(k))


# --------------------------------------------------------------------------------------------
# start, registration, exit codes (§2.1)


async def test_a_worker_registers_its_service_with_16_queued_and_8_in_flight(rig: Rig) -> None:
    await rig.start(agent_launch(rig.socket))
    (svc,) = await rig.node.services("s7.agent.fly-a")
    assert svc["maxQueued"] == 16 and svc["maxInFlight"] == 8
    assert svc["owner"] == {"clientId": "s7.fly-a.g1", "clientIncarnation": "fly-a-inc-1"}


async def test_a_worker_the_router_does_not_expect_exits_3(rig: Rig) -> None:
    launch = agent_launch(rig.socket, "fly-c")  # never expected by the node connection
    async with asyncio.timeout(10):
        assert await run_worker(launch, endpoint_factory=endpoint_for) == EXIT_LOST


async def test_a_lost_connection_ends_the_worker_with_exit_3(rig: Rig) -> None:
    running = await rig.start(agent_launch(rig.socket))
    await rig.router.stop()
    async with asyncio.timeout(10):
        assert await running.task == EXIT_LOST


async def test_a_stop_event_aborts_the_connection_with_exit_3(rig: Rig) -> None:
    stop = asyncio.Event()
    running = await rig.start(agent_launch(rig.socket), stop_event=stop)
    stop.set()
    async with asyncio.timeout(10):
        assert await running.task == EXIT_LOST
    await wait_for(lambda: _no_service(rig, "s7.agent.fly-a"))


async def _no_service(rig: Rig, name: str) -> bool:
    return not await rig.node.services(name)


async def test_cancelling_the_worker_task_closes_its_connection(rig: Rig) -> None:
    running = await rig.start(agent_launch(rig.socket))
    running.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running.task
    await wait_for(lambda: _no_service(rig, "s7.agent.fly-a"))


async def test_a_registration_conflict_is_retried_until_the_name_is_free() -> None:
    d, path = short_socket()
    router = Router(RouterConfig(socket_path=path, policy=Policy.open()))
    await router.start()
    launch = agent_launch(path)
    try:
        async with await connect(path, client_id="blocker") as blocker:
            held = await blocker.register(launch.service, _never)
            task = asyncio.create_task(run_worker(launch, endpoint_factory=endpoint_for))
            await asyncio.sleep(0.1)
            assert not task.done()  # still retrying CONFLICT every 5 ms
            await held.unregister()
            async with await connect(path, client_id="watcher") as watcher:
                async def registered() -> bool:
                    services = await watcher.services(launch.service)
                    return bool(services) and services[0]["owner"]["clientId"] == \
                        launch.client_id
                await wait_for(registered)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        await router.stop()
        shutil.rmtree(d, ignore_errors=True)


async def test_a_registration_conflict_that_outlasts_the_budget_exits_4(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shell_module, "REGISTER_BUDGET_S", 0.2)
    d, path = short_socket()
    router = Router(RouterConfig(socket_path=path, policy=Policy.open()))
    await router.start()
    launch = agent_launch(path)
    try:
        async with await connect(path, client_id="blocker") as blocker:
            await blocker.register(launch.service, _never)
            started = time.monotonic()
            async with asyncio.timeout(10):
                assert await run_worker(launch, endpoint_factory=endpoint_for) == EXIT_REGISTER
            assert time.monotonic() - started >= 0.15  # retried for the whole budget
    finally:
        await router.stop()
        shutil.rmtree(d, ignore_errors=True)


async def _never(req: Any) -> None:
    return None


# --------------------------------------------------------------------------------------------
# Worker.Hello (§2.5)


def independent_contract_digest() -> str:
    files = {p.relative_to(SCHEMAS).as_posix(): digest_bytes(p.read_bytes())
             for p in SCHEMAS.rglob("*.json")}
    return digest_of({"contract": "flyd-session-v1", "schemas": files})


async def test_hello_answers_the_identity_contract_and_capabilities(rig: Rig) -> None:
    await rig.start(agent_launch(rig.socket, threads=2))
    await rig.start(environment_launch(rig.socket))
    result = await rig.ok("fly-a", "Worker.Hello", HELLO)
    assert result == {
        "selectedMajor": 1, "selectedMinor": 0, "workerId": "fly-a",
        "incarnationId": "fly-a-inc-1", "role": "agent",
        "buildDigest": digest_bytes(b"flyd-build-v1\nversion=0.1.0\n"),
        "contractDigest": independent_contract_digest(),
        "capabilities": ["agent-step-v1", "checkpoint-v1", "pixel-observation-v1"],
        "limits": {"maxAgents": 4, "maxPorts": 4, "workerThreads": 2},
    }
    env = await rig.ok("arena", "Worker.Hello", hello(expectedWorkerId="arena",
                                                      role="environment"))
    assert env["capabilities"] == ["checkpoint-v1", "pixel-observation-v1", "world-step-v1"]
    assert env["contractDigest"] == result["contractDigest"] == contract_digest()
    assert result["buildDigest"] == build_digest()


def test_the_contract_digest_covers_every_schema_file_the_package_ships() -> None:
    names = {p.relative_to(SCHEMAS).as_posix() for p in SCHEMAS.rglob("*.json")}
    assert "session/methods/Agent.Prepare.params.json" in names
    assert "bus/request.json" in names and "session/outcome.json" in names
    assert contract_digest() == independent_contract_digest()


@pytest.mark.parametrize(("params", "hello_scope", "code"), [
    (HELLO, scope(0), "INVALID_ARGUMENT"),
    ({**HELLO, "extra": 1}, None, "INVALID_ARGUMENT"),
    ({k: v for k, v in HELLO.items() if k != "role"}, None, "INVALID_ARGUMENT"),
    (hello(supportedMajors=[]), None, "INVALID_ARGUMENT"),
    (hello(supportedMajors=[1] * 9), None, "INVALID_ARGUMENT"),
    (hello(supportedMajors=["1"]), None, "INVALID_ARGUMENT"),
    (hello(sessionId="other"), None, "IDENTITY_MISMATCH"),
    (hello(expectedWorkerId="fly-z"), None, "IDENTITY_MISMATCH"),
    (hello(role="environment"), None, "IDENTITY_MISMATCH"),
    (hello(role="coordinator"), None, "IDENTITY_MISMATCH"),
    (hello(supportedMajors=[2, 3]), None, "UNSUPPORTED"),
    # order: scope before params, params before identity, identity before majors
    (hello(sessionId="other"), scope(0), "INVALID_ARGUMENT"),
    (hello(sessionId="other", supportedMajors=[2]), None, "IDENTITY_MISMATCH"),
    (hello(expectedWorkerId="fly-z", role="bogus"), None, "INVALID_ARGUMENT"),
], ids=["scope", "extra-key", "missing-key", "no-majors", "nine-majors", "string-major",
        "session", "worker", "role", "coordinator-role", "no-common-major",
        "scope-before-params", "identity-before-major", "params-before-identity"])
async def test_hello_checks_its_refusals_in_order(rig: Rig, params: dict[str, Any],
                                                  hello_scope: dict[str, str] | None,
                                                  code: str) -> None:
    await rig.start(agent_launch(rig.socket))
    error = await rig.error("fly-a", "Worker.Hello", params, hello_scope)
    assert (error["code"], error["mutation"]) == (code, "none")


# --------------------------------------------------------------------------------------------
# Worker.Status (§2.6)


async def test_status_reports_the_cell_and_echoes_any_scope(rig: Rig) -> None:
    await rig.start(agent_launch(rig.socket))
    assert await rig.status("fly-a") == {
        "state": "uninitialized", "currentScope": None, "activeRequestId": None,
        "lastCompletedRequestId": None, "lastBatchId": None, "progressCounter": "0"}
    outcome = await rig.call("fly-a", "Worker.Status", {}, scope(9, "e7"))
    assert outcome["scope"] == scope(9, "e7") and outcome["type"] == "result"
    error = await rig.error("fly-a", "Worker.Status", {"verbose": True})
    assert error["code"] == "INVALID_ARGUMENT"


async def test_status_never_changes_progress(rig: Rig) -> None:
    await initialized_agent(rig)
    first = await rig.status("fly-a")
    second = await rig.status("fly-a")
    assert first == second
    assert first["progressCounter"] == "11" and first["lastCompletedRequestId"] == "req-1"


async def test_status_answers_while_a_mutation_runs_and_names_it(rig: Rig) -> None:
    await initialized_agent(rig, Faults(prepare_delay_ms=400))
    rid = rig.next_id("fly-a")
    running = asyncio.create_task(rig.call("fly-a", "Agent.Prepare",
                                           prepare_params("fly-a", boot_digest()), scope(0),
                                           request_id=rid))
    await wait_for(lambda: _state_is(rig, "preparing"))
    status = await rig.status("fly-a")
    assert not running.done()  # answered during the mutation, not after it
    assert status["activeRequestId"] == rid and status["progressCounter"] == "11"
    assert (await running)["type"] == "result"
    status = await rig.status("fly-a")
    assert status["state"] == "prepared" and status["activeRequestId"] is None
    assert status["lastCompletedRequestId"] == rid and status["progressCounter"] == "27"


async def _state_is(rig: Rig, state: str, worker: str = "fly-a") -> bool:
    return (await rig.status(worker))["state"] == state


# --------------------------------------------------------------------------------------------
# Worker.Acknowledge (§2.7)


async def test_lifecycle_replies_replay_until_acknowledged(rig: Rig) -> None:
    await rig.start(agent_launch(rig.socket))
    payload = {"requestId": "req-1", "scope": scope(0), "params": agent_init_params()}
    first = (await rig.raw("fly-a", "Agent.Initialize", payload)).outcome
    again = (await rig.raw("fly-a", "Agent.Initialize", payload)).outcome
    assert first["type"] == "result" and again == first
    assert (await rig.status("fly-a"))["progressCounter"] == "11"
    ack = await rig.ok("fly-a", "Worker.Acknowledge", {"requestIds": ["req-1", "req-77"]},
                       request_id="req-2")
    assert ack == {"acknowledged": ["req-1"]}
    assert await rig.ok("fly-a", "Worker.Acknowledge", {"requestIds": ["req-1"]},
                        request_id="req-3") == {"acknowledged": []}
    expired = (await rig.raw("fly-a", "Agent.Initialize", payload)).outcome
    assert expired["error"]["code"] == "RESULT_EXPIRED"
    assert expired["error"]["mutation"] == "unknown"


@pytest.mark.parametrize("params", [
    {"requestIds": []}, {"requestIds": [f"req-{i}" for i in range(1, 18)]},
    {"requestIds": ["req-0"]}, {"requestIds": ["7"]}, {}, {"requestIds": ["req-1"], "x": 1},
], ids=["empty", "seventeen", "req-0", "not-a-request-id", "missing", "extra-key"])
async def test_acknowledge_refuses_malformed_params(rig: Rig, params: dict[str, Any]) -> None:
    await rig.start(agent_launch(rig.socket))
    error = await rig.error("fly-a", "Worker.Acknowledge", params)
    assert (error["code"], error["mutation"]) == ("INVALID_ARGUMENT", "none")


async def test_the_acknowledge_extra_id_fault_adds_its_id(rig: Rig) -> None:
    await rig.start(environment_launch(rig.socket, faults=Faults(acknowledge_extra_id="req-9999")))
    result = await rig.ok("arena", "Worker.Acknowledge", {"requestIds": ["req-1"]})
    assert result == {"acknowledged": ["req-9999"]}


# --------------------------------------------------------------------------------------------
# Worker.Shutdown (§2.8)


async def test_shutdown_is_answered_then_the_worker_unregisters_and_exits_0(rig: Rig) -> None:
    running = await rig.start(agent_launch(rig.socket))
    outcome = await rig.call("fly-a", "Worker.Shutdown", {"reason": "reap"},
                             client=rig.supervisor)
    assert outcome["result"] == {"stopping": True}
    async with asyncio.timeout(10):
        assert await running.task == EXIT_SHUTDOWN
    assert not await rig.node.services("s7.agent.fly-a")


@pytest.mark.parametrize(("params", "code"), [
    ({}, "INVALID_ARGUMENT"), ({"reason": "Not An Id"}, "INVALID_ARGUMENT"),
    ({"reason": "reap", "x": 1}, "INVALID_ARGUMENT"), ({"reason": "reap"}, "IDENTITY_MISMATCH"),
], ids=["missing-reason", "bad-reason", "extra-key", "not-the-supervisor"])
async def test_shutdown_refusals_leave_the_worker_serving(rig: Rig, params: dict[str, Any],
                                                          code: str) -> None:
    running = await rig.start(agent_launch(rig.socket))
    error = await rig.error("fly-a", "Worker.Shutdown", params)  # from the coordinator
    assert (error["code"], error["mutation"]) == (code, "none")
    assert (await rig.status("fly-a"))["state"] == "uninitialized"
    assert not running.task.done()


# --------------------------------------------------------------------------------------------
# the request pipeline (§2.2)


async def test_an_unparsable_request_is_invalid_argument_with_scope_null(rig: Rig) -> None:
    await rig.start(agent_launch(rig.socket))
    cases = [
        ({"nope": 1}, "req-0"),
        ({"requestId": "req-0", "scope": None, "params": {}}, "req-0"),
        ({"requestId": "req-5", "scope": {"sessionId": "demo"}, "params": {}}, "req-5"),
        ({"requestId": "req-6", "scope": scope(0), "params": {"a": [{"callId": 1}]}}, "req-6"),
        ({"requestId": "req-7", "scope": None, "params": [], }, "req-7"),
    ]
    for payload, rid in cases:
        outcome = (await rig.raw("fly-a", "Agent.Initialize", payload)).outcome
        OUTCOME.validate(outcome)
        assert outcome["type"] == "error" and outcome["requestId"] == rid
        assert outcome["scope"] is None
        assert (outcome["error"]["code"], outcome["error"]["mutation"]) == (
            "INVALID_ARGUMENT", "none")
    assert (await rig.status("fly-a"))["state"] == "uninitialized"


@pytest.mark.parametrize(("role", "method"), [
    ("agent", "Agent.Dance"), ("agent", "Environment.Advance"), ("agent", "State.Dance"),
    ("agent", "Environment.Initialize"), ("environment", "Agent.Prepare"),
    ("environment", "Agent.Commit"), ("environment", "worker.status"),
])
async def test_a_method_outside_the_endpoint_table_is_unsupported(rig: Rig, role: Role,
                                                                  method: str) -> None:
    launch = agent_launch(rig.socket) if role == "agent" else environment_launch(rig.socket)
    await rig.start(launch)
    outcome = (await rig.raw(launch.worker_id, method,
                             {"requestId": "req-1", "scope": scope(0), "params": {}})).outcome
    OUTCOME.validate(outcome)
    assert (outcome["error"]["code"], outcome["error"]["mutation"]) == ("UNSUPPORTED", "none")
    assert outcome["scope"] == scope(0)


async def test_a_step_mutation_without_scope_is_refused_before_admission(rig: Rig) -> None:
    endpoint = await initialized_agent(rig)
    cache = endpoint.shell.cache
    before = cache.highest_serial
    error = await rig.error("fly-a", "Agent.Prepare", prepare_params("fly-a", boot_digest()),
                            None, request_id="req-50")
    assert (error["code"], error["mutation"]) == ("INVALID_ARGUMENT", "none")
    assert cache.highest_serial == before and cache.step_records() == {}


async def test_a_caller_outside_the_session_is_refused_and_nothing_is_cached(rig: Rig) -> None:
    endpoint = await rig.start_endpoint(agent_launch(rig.socket))
    intruder = await rig.open_client("s7.intruder")
    error = await rig.error("fly-a", "Agent.Initialize", agent_init_params(), scope(0),
                            request_id="req-1", client=intruder)
    assert (error["code"], error["mutation"]) == ("IDENTITY_MISMATCH", "none")
    assert "s7.intruder" in error["message"]
    error = await rig.error("fly-a", "Worker.Status", {}, client=intruder)
    assert error["code"] == "IDENTITY_MISMATCH"
    # the pipeline's earlier steps still answer first
    outcome = (await rig.raw("fly-a", "Agent.Dance", {"requestId": "req-2", "scope": None,
                                                      "params": {}}, client=intruder)).outcome
    assert outcome["error"]["code"] == "UNSUPPORTED"
    cache = endpoint.shell.cache
    assert cache.highest_serial is None and cache.lifecycle_records() == {}
    # the same request id from the coordinator executes: nothing was recorded for it
    await rig.ok("fly-a", "Agent.Initialize", agent_init_params(), scope(0), request_id="req-1")
    # the node connection is a caller too
    assert (await rig.ok("fly-a", "Worker.Status", {}, client=rig.node))["state"] == "ready"


# --------------------------------------------------------------------------------------------
# dedup through the shell (§2.2 step 5–6, §2.4)


async def test_an_exact_duplicate_replays_the_stored_outcome_without_running_again(
        rig: Rig) -> None:
    await initialized_agent(rig)
    payload = {"requestId": "req-2", "scope": scope(0),
               "params": prepare_params("fly-a", boot_digest())}
    first = (await rig.raw("fly-a", "Agent.Prepare", payload)).outcome
    progress = (await rig.status("fly-a"))["progressCounter"]
    again = (await rig.raw("fly-a", "Agent.Prepare", payload)).outcome
    assert again == first and first["type"] == "result"
    assert (await rig.status("fly-a"))["progressCounter"] == progress == "27"


async def test_a_changed_body_or_request_for_a_recorded_key_conflicts(rig: Rig) -> None:
    await initialized_agent(rig)
    rid, _first = await prepare(rig, 0)
    other_id = await rig.error("fly-a", "Agent.Prepare", prepare_params("fly-a", boot_digest()),
                               scope(0))
    assert (other_id["code"], other_id["mutation"]) == ("CONFLICT", "none")
    changed = prepare_params("fly-a", boot_digest(),
                             [{"id": "s1", "kindId": "arena.milestone", "durationMs": 4.0}])
    other_body = await rig.error("fly-a", "Agent.Prepare", changed, scope(0), request_id=rid)
    assert other_body["code"] == "CONFLICT"
    assert (await rig.status("fly-a"))["progressCounter"] == "27"


async def test_a_duplicate_while_the_original_runs_is_in_progress_and_others_are_busy(
        rig: Rig) -> None:
    await initialized_agent(rig, Faults(prepare_delay_ms=300))
    payload = {"requestId": "req-2", "scope": scope(0),
               "params": prepare_params("fly-a", boot_digest())}
    original = asyncio.create_task(rig.raw("fly-a", "Agent.Prepare", payload))
    await wait_for(lambda: _state_is(rig, "preparing"))
    duplicate = (await rig.raw("fly-a", "Agent.Prepare", payload)).outcome
    assert (duplicate["error"]["code"], duplicate["error"]["mutation"]) == (
        "IN_PROGRESS", "none")
    changed = {**payload, "params": {**payload["params"], "preStepStimulations": [
        {"id": "s1", "kindId": "arena.milestone", "durationMs": 1.0}]}}
    conflict = (await rig.raw("fly-a", "Agent.Prepare", changed)).outcome
    assert conflict["error"]["code"] == "CONFLICT"
    busy = await rig.error("fly-a", "Agent.Commit", commit_params("fly-a", "req-2", 0), scope(0))
    assert (busy["code"], busy["mutation"]) == ("BUSY", "none")
    lifecycle = await rig.error("fly-a", "Agent.Initialize", agent_init_params(), scope(0))
    assert lifecycle["code"] == "BUSY"
    assert (await original).outcome["type"] == "result"
    # the refused Commit was not recorded: the same id now commits
    await rig.ok("fly-a", "Agent.Commit", commit_params("fly-a", "req-2", 0), scope(0))


async def test_a_none_failure_frees_the_key_for_a_corrected_request(rig: Rig) -> None:
    await initialized_agent(rig)
    wrong = await rig.error("fly-a", "Agent.Prepare", prepare_params("fly-a", "0" * 64),
                            scope(0))
    assert (wrong["code"], wrong["mutation"]) == ("IDENTITY_MISMATCH", "none")
    status = await rig.status("fly-a")
    assert status["state"] == "ready" and status["lastCompletedRequestId"] == "req-1"
    _, corrected = await prepare(rig, 0)
    assert corrected["type"] == "result"


async def test_an_applied_failure_is_stored_before_the_reply_and_fails_the_worker(
        rig: Rig) -> None:
    endpoint = await initialized_agent(rig, Faults(fail_commit_at_step=0))
    rid, _ = await prepare(rig, 0)
    payload = {"requestId": "req-3", "scope": scope(0),
               "params": commit_params("fly-a", rid, 0)}
    first = (await rig.raw("fly-a", "Agent.Commit", payload)).outcome
    assert first["error"] == {"code": "BACKEND_FAILURE", "mutation": "applied",
                              "message": "injected commit failure after the next input was "
                                         "installed"}
    assert "req-3" in {r.request_id for r in endpoint.shell.cache.step_records().values()}
    assert (await rig.raw("fly-a", "Agent.Commit", payload)).outcome == first
    status = await rig.status("fly-a")
    assert status["state"] == "failed" and status["lastCompletedRequestId"] == "req-3"
    assert status["progressCounter"] == "28"  # the next input was installed
    error = await rig.error("fly-a", "Agent.Prepare", prepare_params("fly-a", boot_digest()),
                            scope(1))
    assert (error["code"], error["mutation"]) == ("INVALID_PHASE", "none")


async def test_an_evicted_step_is_result_expired_and_a_fresh_serial_is_stale(rig: Rig) -> None:
    await initialized_agent(rig)
    for k in range(4):
        await transition(rig, k)
    old = await rig.error("fly-a", "Agent.Prepare", prepare_params("fly-a", boot_digest()),
                          scope(1), request_id="req-4")
    assert (old["code"], old["mutation"]) == ("RESULT_EXPIRED", "unknown")
    fresh = await rig.error("fly-a", "Agent.Prepare", prepare_params("fly-a", boot_digest()),
                            scope(1))
    assert (fresh["code"], fresh["mutation"]) == ("STALE_STEP", "none")


async def test_an_old_epoch_request_is_refused_and_recorded_nowhere(rig: Rig) -> None:
    endpoint = await initialized_agent(rig)
    payload = {"requestId": "req-9", "scope": scope(0, "e0"),
               "params": prepare_params("fly-a", boot_digest())}
    for _ in range(2):  # executed unrecorded each time, never replayed
        outcome = (await rig.raw("fly-a", "Agent.Prepare", payload)).outcome
        assert (outcome["error"]["code"], outcome["error"]["mutation"]) == ("STALE_EPOCH",
                                                                            "none")
    assert endpoint.shell.cache.step_records() == {}
    _, ok = await prepare(rig, 0)
    assert ok["type"] == "result"


# --------------------------------------------------------------------------------------------
# handler failures


class CrashingAgent(Endpoint):
    role: ClassVar[Role] = "agent"
    base_capabilities: ClassVar[tuple[str, ...]] = ("agent-step-v1", "checkpoint-v1")

    def __init__(self, launch: WorkerLaunch) -> None:
        super().__init__(launch)
        self.handlers = {"Agent.Initialize": self.crash, "Agent.Prepare": self.wordy}

    async def crash(self, call: Call) -> dict[str, Any]:
        raise RuntimeError("model exploded")

    async def wordy(self, call: Call) -> dict[str, Any]:
        from workers.types.domain import DomainError

        raise DomainError.invalid("é" * 2000)


async def test_a_handler_crash_is_backend_failure_unknown_and_fails_the_worker(
        rig: Rig) -> None:
    await rig.start(agent_launch(rig.socket), CrashingAgent)
    payload = {"requestId": "req-1", "scope": scope(0), "params": {}}
    first = (await rig.raw("fly-a", "Agent.Initialize", payload)).outcome
    assert first["error"] == {"code": "BACKEND_FAILURE", "mutation": "unknown",
                              "message": "Agent.Initialize failed: RuntimeError"}
    assert (await rig.raw("fly-a", "Agent.Initialize", payload)).outcome == first
    assert (await rig.status("fly-a"))["state"] == "failed"
    # an endpoint listing checkpoint-v1 without serving State.* does not advertise it
    assert (await rig.ok("fly-a", "Worker.Hello", HELLO))["capabilities"] == ["agent-step-v1"]


async def test_messages_are_clipped_to_512_code_points(rig: Rig) -> None:
    await rig.start(agent_launch(rig.socket), CrashingAgent)
    error = await rig.error("fly-a", "Agent.Prepare", {}, scope(0))
    assert len(error["message"]) == 512 and error["message"].endswith("…")
    assert error["message"][:511] == "é" * 511


# --------------------------------------------------------------------------------------------
# execution modes (§7.1)


async def test_a_worker_thread_serves_on_its_own_loop_and_stops_on_shutdown(rig: Rig) -> None:
    launch = agent_launch(rig.socket)
    await rig.expect(launch)
    body = WorkerThread(launch, endpoint_factory=endpoint_for)
    body.start()
    rig.roles["fly-a"] = "agent"
    await rig.wait_registered("fly-a")
    assert body.thread.ident != __import__("threading").get_ident()
    await rig.init_agent()
    assert (await rig.status("fly-a"))["progressCounter"] == "11"
    await rig.ok("fly-a", "Worker.Shutdown", {"reason": "reap"}, client=rig.supervisor)
    assert await asyncio.to_thread(body.join, 10)
    assert body.exit_code == EXIT_SHUTDOWN and body.error is None


async def test_a_worker_thread_stopped_by_its_owner_exits_3(rig: Rig) -> None:
    launch = environment_launch(rig.socket)
    await rig.expect(launch)
    body = WorkerThread(launch, endpoint_factory=endpoint_for)
    body.start()
    rig.roles["arena"] = "environment"
    await rig.wait_registered("arena")
    body.stop()
    assert await asyncio.to_thread(body.join, 10)
    assert body.exit_code == EXIT_LOST
    await wait_for(lambda: _no_service(rig, "s7.env.arena"))


def spawn(launch: WorkerLaunch, *extra: str) -> subprocess.Popen[bytes]:
    return die_with_parent([sys.executable, "-m", launch.module, *launch.to_argv(), *extra],
                           stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, start_new_session=True,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def wait_exit(proc: subprocess.Popen[bytes], timeout: float = 20) -> int:
    code = await asyncio.to_thread(proc.wait, timeout)
    return code


@pytest.mark.parametrize("role", ["agent", "environment"])
async def test_the_worker_command_serves_after_the_start_gate_and_exits_0_on_shutdown(
        rig: Rig, role: Role) -> None:
    launch = (agent_launch(rig.socket) if role == "agent" else environment_launch(rig.socket))
    launch = dataclasses.replace(launch, parent_pid=os.getpid())
    proc = spawn(launch)
    try:
        await rig.expect(launch, proc.pid)
        assert proc.stdin is not None
        proc.stdin.write(START_GATE)
        proc.stdin.flush()
        rig.roles[launch.worker_id] = role
        await rig.wait_registered(launch.worker_id, timeout=20)
        (svc,) = await rig.node.services(launch.service)
        assert svc["owner"]["clientIncarnation"] == launch.incarnation_id
        result = await rig.ok(launch.worker_id, "Worker.Hello",
                              hello(expectedWorkerId=launch.worker_id, role=role))
        assert result["incarnationId"] == launch.incarnation_id
        if role == "agent":
            await rig.init_agent()
        else:
            await rig.init_env()
        assert (await rig.status(launch.worker_id))["state"] == "ready"
        await rig.ok(launch.worker_id, "Worker.Shutdown", {"reason": "reap"},
                     client=rig.supervisor)
        assert await wait_exit(proc) == EXIT_SHUTDOWN
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stderr is not None
        print(proc.stderr.read().decode())


@pytest.mark.parametrize("line", [b"", b"no\n"], ids=["eof", "other-line"])
async def test_the_start_gate_refuses_eof_and_any_other_line(rig: Rig, line: bytes) -> None:
    proc = spawn(agent_launch(rig.socket))
    assert proc.stdin is not None
    proc.stdin.write(line)
    proc.stdin.close()
    assert await wait_exit(proc) == EXIT_GATE


async def test_an_unknown_flag_exits_2_before_the_gate(rig: Rig) -> None:
    proc = spawn(agent_launch(rig.socket), "--frobnicate", "1")
    assert await wait_exit(proc) == EXIT_ARGS
    assert proc.stderr is not None and b"--frobnicate" in proc.stderr.read()


async def test_a_launch_the_endpoint_refuses_exits_2_after_the_gate(rig: Rig) -> None:
    proc = spawn(agent_launch(rig.socket, model="workers.synthetic:NoSuchModel"))
    assert proc.stdin is not None
    proc.stdin.write(START_GATE)
    proc.stdin.close()
    assert await wait_exit(proc) == EXIT_ARGS
    # its last word is the refusal as the wire error, plugin fault included, for the launcher
    assert proc.stderr is not None
    records = [json.loads(line) for line in proc.stderr.read().splitlines()
               if line.startswith(b"{")]
    refusal = [r for r in records if r.get("event") == REFUSED_LAUNCH]
    assert len(refusal) == 1
    error = DomainError.from_json(refusal[0]["error"])
    assert error.code == "INVALID_ARGUMENT" and "has no NoSuchModel" in error.message
    assert error.data is not None and error.data.stage == "attribute" and error.data.repeats


async def test_a_worker_whose_parent_is_already_gone_exits_1(rig: Rig) -> None:
    launch = dataclasses.replace(agent_launch(rig.socket), parent_pid=1)
    proc = spawn(launch)  # its parent is this test, not pid 1
    assert await wait_exit(proc) == EXIT_GATE


async def test_the_shell_offers_an_executor_sized_by_threads(rig: Rig) -> None:
    endpoint = await rig.start_endpoint(agent_launch(rig.socket, threads=3))
    shell: WorkerShell = endpoint.shell
    assert shell.executor._max_workers == 3
    await rig.ok("fly-a", "Worker.Shutdown", {"reason": "reap"}, client=rig.supervisor)
    assert await rig.running["fly-a"].task == EXIT_SHUTDOWN
    with pytest.raises(RuntimeError):
        shell.executor.submit(lambda: None)  # shut down with the worker


async def test_a_not_authorized_hello_is_a_bus_refusal_not_a_domain_reply(rig: Rig) -> None:
    with pytest.raises(NotAuthorized):
        await connect(rig.socket, client_id="s7.fly-a.g1", client_incarnation="fly-a-inc-1")


async def test_read_only_replies_keep_the_last_16_for_diagnostics(rig: Rig) -> None:
    endpoint = await rig.start_endpoint(agent_launch(rig.socket))
    for _ in range(20):
        await rig.status("fly-a")
    await rig.error("fly-a", "Worker.Hello", hello(role="environment"))
    history = endpoint.shell.read_only_history
    assert len(history) == 16
    assert history[-1][0] == "Worker.Hello" and history[-1][1]["type"] == "error"
    assert all(method == "Worker.Status" for method, _ in list(history)[:-1])


# --------------------------------------------------------------------------------------------
# method schemas (schemas/session/methods)


METHODS = ("Worker.Hello", "Worker.Status", "Worker.Acknowledge", "Worker.Shutdown",
           "Agent.Initialize", "Agent.Prepare", "Agent.Commit", "Environment.Initialize",
           "Environment.Advance", "State.Capture", "State.StageRestore", "State.ActivateRestore")


def test_every_method_has_a_params_and_a_result_schema() -> None:
    import json

    from jsonschema import Draft202012Validator

    from bus.schema import compile_schema
    from workers.agent import AgentEndpoint
    from workers.environment import EnvironmentEndpoint

    root = SCHEMAS / "session" / "methods"
    files = {p.name for p in root.glob("*.json")}
    assert files == {f"{m}.{k}.json" for m in METHODS for k in ("params", "result")}
    served = set(shell_module.WORKER_METHODS) | {
        "Agent.Initialize", "Agent.Prepare", "Agent.Commit", "Environment.Initialize",
        "Environment.Advance", "State.Capture", "State.StageRestore", "State.ActivateRestore"}
    assert served == set(METHODS)
    assert set(AgentEndpoint(agent_launch("/tmp/x.sock")).handlers) | set(
        EnvironmentEndpoint(environment_launch("/tmp/x.sock")).handlers) | set(
        shell_module.WORKER_METHODS) == served
    request = json.loads((SCHEMAS / "session" / "request.json").read_text())
    defs: dict[str, Any] = {}
    for name in sorted(files):
        schema = json.loads((root / name).read_text())
        Draft202012Validator.check_schema(schema)
        compile_schema(schema)  # within the subset the worker compiles at runtime
        assert schema["type"] == "object" and schema["additionalProperties"] is False
        for key, value in schema.get("$defs", {}).items():
            assert defs.setdefault(key, value) == value, f"{name}: $defs/{key} differs"
    for key in ("Id", "U64"):
        assert defs[key]["pattern"] == request["$defs"][key]["pattern"]
    assert defs["RequestId"]["pattern"] == request["$defs"]["RequestId"]["pattern"]


# --------------------------------------------------------------------------------------------
# launch settings and the command line (workers/launch.py, §7.7)


def every_fault_launches() -> list[WorkerLaunch]:
    from tests.session.worker_rig import TICK

    agent = dataclasses.replace(
        agent_launch("/tmp/flyd-x/bus.sock", threads=3, model_config={
            "graphVariant": 2, "nested": {"a": [1, 2.5, None, "é"]}}, tick=TICK, warmup=0),
        faults=Faults(prepare_delay_ms=15, prepare_delay_at_step=2, commit_delay_ms=0,
                      fail_commit_at_step=18446744073709551615,
                      acknowledge_extra_id="req-9999", fail_capture=True,
                      fail_stage_restore=True, fail_activate_restore=True),
        parent_pid=4242, log_format="console")
    env = dataclasses.replace(
        environment_launch("/tmp/flyd-x/bus.sock", ports=("p2", "p1", "p3"), delay=8,
                           step=shell_module_step()),
        faults=Faults(advance_delay_ms=120, advance_delay_at_step=0, omit_view_at_boundary=0,
                      stale_view_at_boundary=2, truncated_view_at_boundary=3,
                      omit_audio_at_boundary=4, overlapping_audio_at_boundary=5,
                      acknowledge_extra_id="req-1", fail_capture=True))
    return [agent, env, agent_launch("/tmp/s.sock"), environment_launch("/tmp/s.sock")]


def shell_module_step() -> Any:
    from workers.types.ticks import RationalNs

    return RationalNs(1, 3)


@pytest.mark.parametrize("launch", every_fault_launches(),
                         ids=["agent-all", "environment-all", "agent-plain", "env-plain"])
def test_a_launch_survives_its_command_line(launch: WorkerLaunch) -> None:
    from workers.launch import parse_worker_argv

    argv = launch.to_argv()
    assert WorkerLaunch.from_argv(argv) == launch
    assert parse_worker_argv(launch.role, argv) == launch
    assert launch.command("py")[:3] == ["py", "-m", launch.module]
    flags = [a for a in argv if a.startswith("--")]
    assert len(flags) == len(set(flags))  # every flag at most once


@pytest.mark.parametrize(("argv_change", "message"), [
    (["--prepare-delay-ms", "5@x"], "canonical decimal"),
    (["--prepare-delay-ms", "05"], "canonical decimal"),
    (["--tick", "6/4"], "not reduced"),
    (["--tick", "0/1"], "> 0"),
    (["--threads", "0"], "1..256"),
    (["--model-config", "[1]"], "JSON object"),
    (["--callers", "a,,b"], "Id"),
    (["--acknowledge-extra-id", "req-0"], "req-0"),
    (["--advance-delay-ms", "5"], "unrecognized arguments"),
    (["--model", "not an import path"], "import path"),
], ids=["bad-at", "leading-zero", "unreduced-tick", "zero-tick", "zero-threads",
        "config-array", "empty-caller", "req-0", "environment-flag", "bad-model"])
def test_a_refused_command_line_names_its_problem(argv_change: list[str], message: str) -> None:
    from workers.launch import LaunchArgsError, parse_worker_argv

    argv = agent_launch("/tmp/s.sock").to_argv()
    flag = argv_change[0]
    if flag in argv:
        argv[argv.index(flag) + 1] = argv_change[1]
    else:
        argv += argv_change
    with pytest.raises(LaunchArgsError) as info:
        parse_worker_argv("agent", argv)
    assert message in info.value.message and info.value.exit_code == 2


def test_from_argv_needs_a_role_it_can_tell() -> None:
    from workers.launch import LaunchArgsError

    argv = agent_launch("/tmp/s.sock").to_argv()
    with pytest.raises(LaunchArgsError):
        WorkerLaunch.from_argv([*argv, "--world", "a.b:C"])
    without_model = [a for i, a in enumerate(argv)
                     if a != "--model" and (i == 0 or argv[i - 1] != "--model")]
    with pytest.raises(LaunchArgsError):
        WorkerLaunch.from_argv(without_model)


@pytest.mark.parametrize(("change", "message"), [
    ({"faults": Faults(advance_delay_ms=1)}, "advance_delay_ms"),
    ({"faults": Faults(prepare_delay_at_step=1)}, "without prepare_delay_ms"),
    ({"faults": Faults(prepare_delay_ms=-1)}, "prepare_delay_ms"),
    ({"faults": Faults(acknowledge_extra_id="req-0")}, "req-0"),
    ({"threads": 0}, "threads"),
    ({"threads": 257}, "threads"),
    ({"callers": ()}, "callers"),
    ({"service": "S3.Agent"}, "service"),
    ({"session_id": "Demo"}, "session"),
    ({"parent_pid": 0}, "parent pid"),
    ({"log_format": "xml"}, "log format"),
], ids=["foreign-fault", "at-step-alone", "negative-delay", "req-0", "threads-0",
        "threads-257", "no-callers", "service-name", "session-id", "pid-0", "log-format"])
def test_an_invalid_launch_is_refused_at_construction(change: dict[str, Any],
                                                      message: str) -> None:
    from workers.types.domain import DomainError

    with pytest.raises(DomainError) as info:
        dataclasses.replace(agent_launch("/tmp/s.sock"), **change)
    assert info.value.code == "INVALID_ARGUMENT" and message in info.value.message


def test_process_helpers() -> None:
    from workers.launch import thread_environment

    assert thread_environment(3) == {"OMP_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "3",
                                     "MKL_NUM_THREADS": "3", "NUMEXPR_NUM_THREADS": "3"}
    with pytest.raises(ValueError, match="preexec_fn"):
        die_with_parent(["true"], preexec_fn=lambda: None)
    proc = die_with_parent([sys.executable, "-c", "import os; print(os.getppid())"],
                           stdout=subprocess.PIPE)
    out, _ = proc.communicate(timeout=20)
    assert int(out) == os.getpid() and proc.returncode == 0


async def test_a_read_only_handler_bug_is_internal_and_changes_nothing(
        rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(shell: WorkerShell, call: Call) -> dict[str, Any]:
        raise KeyError("oops")

    await rig.start(agent_launch(rig.socket))
    monkeypatch.setitem(WorkerShell.READ_ONLY_HANDLERS, "Worker.Status", broken)
    error = await rig.error("fly-a", "Worker.Status", {})
    assert error == {"code": "INTERNAL", "message": "Worker.Status failed: KeyError",
                     "mutation": "none"}
    monkeypatch.undo()
    assert (await rig.status("fly-a"))["state"] == "uninitialized"
