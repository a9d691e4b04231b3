"""Identity on the bus of a live node: a rogue same-uid process gets nothing (wire.md §12, §13;
session.md §7.2 "Default bus policy and client ids").

A paced `flyd run` holds a session of three worker processes. A rogue process (a separate Python
process under the test's uid, speaking through the SDK) tries, while the session steps:

1. to hello under each worker's client id, with the worker's own incarnation and with a fresh
   one: refused `NOT_AUTHORIZED` (the `s*` entry has `requireExpect`, and the node's expectation
   for that id was consumed by the real worker; the refusal comes before the CONFLICT check);
2. to register each worker's service name and the node's control service name: refused
   `NOT_AUTHORIZED`;
3. to call each worker's service: refused `NOT_AUTHORIZED`;
4. to call `flyd.control.<node>` under an identity without the `flyd.control.*` call grant: the
   node's own client id (bound to the node's pid), a session coordinator id, a worker-shaped id
   and an id no entry matches are each refused `NOT_AUTHORIZED` at hello, so the call is never
   even sent. Under the closed default policy the only identity a same-uid process can take is
   `ctl-*`, whose one call grant is the control service (operators steer the node with it): the
   rogue's hello result shows exactly that grant and nothing else. A session client that *is*
   admitted calling the control service is refused at the call (`test_control.py::
   test_the_control_service_is_closed_to_other_clients`).

Nothing changes: every service keeps its owner and service incarnation, `helloRefused` counts
the refusals, and the run succeeds without a failure or a recovery.

Where the policy is closed by default: the node writes its router child's configuration
(`flyd.node.router_child.router_toml`) with session.md §7.2's policy and its own pid, unless the
configuration sets `[bus.policy]`; the test reads the `--config` file of the live router child and
compares it with `Policy.default(<pid of flyd run>)`. Router-level unit cases of the same rules
(pid binding, requireExpect, expectation grants) are in `tests/bus/test_security.py`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import orjson
import psutil
import pytest

from bus.policy import Policy
from tests.cli.test_flyctl import live_status
from tests.cli.test_flyctl_runs import ROOT, Site, start_process
from tests.cli.test_flyctl_runs import site as site

pytestmark = pytest.mark.timeout(180)

NOT_AUTHORIZED = -32002
STEPS = 900  # 15 s of paced world time: the rogue finishes long before the run does

ROGUE = r"""
import asyncio, json, os, sys
from bus.client import connect
from bus.errors import BusError

PATH = sys.argv[1]


def refusal(exc):
    return {"name": exc.name, "code": exc.code, "dispatch": exc.dispatch}


async def hello(client_id, incarnation=None):
    try:
        client = await connect(PATH, client_id=client_id, client_incarnation=incarnation)
    except BusError as exc:
        return {**refusal(exc), "stage": "hello", "clientId": client_id}
    await client.close()
    return {"name": "OK", "stage": "hello", "clientId": client_id}


async def call_as(client_id, target):
    try:
        client = await connect(PATH, client_id=client_id)
    except BusError as exc:
        return {**refusal(exc), "stage": "hello", "clientId": client_id}
    try:
        await client.call(target, "Control.Status",
                          {"requestId": "req-1", "scope": None, "params": {}}, timeout=10)
    except BusError as exc:
        return {**refusal(exc), "stage": "call", "clientId": client_id}
    finally:
        await client.close()
    return {"name": "OK", "stage": "call", "clientId": client_id}


async def handler(request):
    return {"type": "result", "requestId": request.payload.get("requestId"), "result": {}}


async def main():
    out = {"pid": os.getpid(), "uid": os.getuid()}
    async with connect(PATH, client_id=f"ctl-{os.getpid()}-0badc0de") as ctl:
        out["grants"] = ctl.grants
        before = await ctl.services("")
        out["before"] = before
        out["statsBefore"] = (await ctl.stats())["counters"]
        workers = [s for s in before if not s["name"].startswith("flyd.control.")]
        (control,) = [s for s in before if s["name"].startswith("flyd.control.")]
        out["helloAsWorker"] = [
            await hello(s["owner"]["clientId"], incarnation)
            for s in workers for incarnation in (s["owner"]["clientIncarnation"], None)]
        register = []
        for s in [*workers, control]:
            try:
                await ctl.register(s["name"], handler, max_queued=1, max_in_flight=1)
                register.append({"name": "OK", "service": s["name"]})
            except BusError as exc:
                register.append({**refusal(exc), "service": s["name"]})
        out["register"] = register
        calls = []
        for s in workers:
            try:
                await ctl.call(s["name"], "Worker.Status",
                               {"requestId": "req-1", "scope": None, "params": {}}, timeout=10)
                calls.append({"name": "OK", "service": s["name"]})
            except BusError as exc:
                calls.append({**refusal(exc), "service": s["name"]})
        out["callWorker"] = calls
        session = workers[0]["name"].split(".")[0]
        out["control"] = [await call_as(client_id, control["name"]) for client_id in (
            control["owner"]["clientId"], f"{session}.coordinator",
            f"{session}.fly-z.g1", "rogue")]
        out["after"] = await ctl.services("")
        out["statsAfter"] = (await ctl.stats())["counters"]
    print(json.dumps(out), flush=True)


asyncio.run(main())
"""


def _router_policy(site: Site, run_pid: int) -> dict[str, Any]:
    """The `[bus.policy]` table of the live router child's `--config` file."""
    node = psutil.Process(run_pid)
    for child in node.children():
        argv = child.cmdline()
        if "router" in argv and site.socket in argv:
            config = Path(argv[argv.index("--config") + 1])
            doc = tomllib.loads(config.read_text())
            policy: dict[str, Any] = doc["bus"]["policy"]
            return policy
    raise AssertionError(f"no router child of {run_pid}")


def _rogue(site: Site) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", ROGUE, site.socket], cwd=ROOT, env=site.env(),
                         capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr.decode()
    doc: dict[str, Any] = orjson.loads(out.stdout.splitlines()[-1])
    return doc


def _services(listing: list[dict[str, Any]]) -> dict[str, tuple[str, str, str]]:
    return {s["name"]: (s["serviceIncarnation"], s["owner"]["clientId"],
                        s["owner"]["clientIncarnation"]) for s in listing}


def test_a_rogue_same_uid_process_is_refused_everything(site: Site) -> None:
    run = start_process(site, [sys.executable, "-m", "flyd", "run", "--pace", "--steps",
                               str(STEPS), "--json", "--socket", site.socket], "run.log")
    status = live_status(site, timeout=60)
    pids = {w["workerId"]: w["pid"] for w in status["runs"][0]["workers"]}
    assert len(set(pids.values()) | {run.pid}) == 4, pids  # three worker processes

    policy = _router_policy(site, run.pid)
    assert policy["mode"] == "closed"
    assert Policy.from_config(policy) == Policy.default(run.pid)

    rogue = _rogue(site)
    assert rogue["uid"] == os.getuid() and rogue["pid"] not in (run.pid, *pids.values())
    # a ctl-* client: the control services, and following runs (docs/topics.md §7)
    assert rogue["grants"] == {"register": [], "call": ["flyd.control.*"], "expect": [],
                               "delegate": [], "publish": [], "subscribe": ["flyd.run.*"],
                               "manage": []}
    workers = [s for s in rogue["before"] if not s["name"].startswith("flyd.control.")]
    assert {s["name"].split(".", 1)[1] for s in workers} == {
        "agent.fly-a", "agent.fly-b", "env.arena"}

    attempts = (rogue["helloAsWorker"] + rogue["register"] + rogue["callWorker"]
                + rogue["control"])
    assert len(rogue["helloAsWorker"]) == 6 and len(rogue["register"]) == 4
    assert len(rogue["callWorker"]) == 3 and len(rogue["control"]) == 4
    for attempt in attempts:
        assert (attempt["name"], attempt["code"]) == ("NOT_AUTHORIZED", NOT_AUTHORIZED), attempt
    assert {a["dispatch"] for a in attempts} == {"not-dispatched"}
    assert {a["stage"] for a in rogue["control"]} == {"hello"}

    # nothing changed: same owners and incarnations; every refused hello was counted
    assert _services(rogue["after"]) == _services(rogue["before"])
    refused = rogue["statsAfter"]["helloRefused"] - rogue["statsBefore"]["helloRefused"]
    assert refused >= len(rogue["helloAsWorker"]) + len(rogue["control"])
    assert rogue["statsAfter"]["errors"].get("NOT_AUTHORIZED", 0) - rogue["statsBefore"][
        "errors"].get("NOT_AUTHORIZED", 0) >= len(rogue["register"]) + len(rogue["callWorker"])

    deadline = time.monotonic() + 120
    while run.poll() is None:
        assert time.monotonic() < deadline, "the paced run did not finish"
        time.sleep(0.5)
    assert run.stdout is not None
    summary = orjson.loads(run.stdout.read().splitlines()[-1])
    assert run.returncode == 0, summary
    assert summary["state"] == "succeeded" and summary["boundary"] == STEPS
    assert summary["recoveries"] == 0 and summary["failures"] == []
    assert summary["epochs"] == ["e1"]
