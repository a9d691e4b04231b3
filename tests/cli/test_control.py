"""The node's control service (cli.md §8, §11 #18–#20; `Control.Watch`: docs/topics.md §14.3,
test 187).

`test_checkpoint_commands_print_json` stores its generation through the checkpoint store's own
commit path (the node does not take checkpoints yet).

`test_flyctl_drain_and_runs_show`: the drained node releases the run with refund and a second
node finishes it; `runs show` of the finished run lists both grants, its recoveries and epochs.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import socket as socketlib
import time
from typing import Any

import orjson
import psycopg
import pytest

from bus.client import connect
from bus.errors import NotAuthorized
from bus.policy import Policy
from bus.router import Router, RouterConfig
from flyd.launch.identities import session_client_grants
from flyd.leases.params import LeaseParams
from flyd.leases.stores import pg as pgstore
from flyd.leases.stores.contract import Commit, Effect
from flyd.node.control_protocol import METHODS, control_validator
from flyd.state.checkpoints import CheckpointStore, DirectCommitPath
from tests.cli.test_flyctl_runs import ROOT, Site, flyctl, serve, submit, wait_state
from tests.cli.test_flyctl_runs import site as site
from tests.state.conftest import NODE, make_job

pytestmark = pytest.mark.timeout(120)

FIXTURE = ROOT / "tests" / "fixtures" / "checkpoint-envelope.json"


def _call_payload(serial: int, params: dict[str, Any]) -> dict[str, Any]:
    return {"requestId": f"req-{serial}", "scope": None, "params": params}


async def test_the_control_service_is_closed_to_other_clients(site: Site) -> None:
    router = Router(RouterConfig(socket_path=site.socket, policy=Policy.default(None)))
    await router.start()
    try:
        await asyncio.to_thread(serve, site, "n1", "--no-router")
        for client_id in ("rogue", "s9.fly-a.g1"):
            with pytest.raises(NotAuthorized):
                await connect(site.socket, client_id=client_id)
        async with connect(site.socket, client_id="ctl-1-0a1b2c3d") as ctl:
            (svc,) = await ctl.services("flyd.control.")
            node_id = svc["name"].removeprefix("flyd.control.")
            assert node_id.startswith("n1-")
            assert (svc["maxQueued"], svc["maxInFlight"]) == (16, 4)
            assert svc["owner"]["clientId"] == f"node.{node_id}"
            target = svc["name"]

            # a session's coordinator client: admitted through the node's expectation, refused
            async with connect(site.socket, client_id="node.test-000000000000") as node:
                await node.expect("s1.coordinator", os.getpid(), client_incarnation="inc-1",
                                  grants=session_client_grants("s1"))
                async with connect(site.socket, client_id="s1.coordinator",
                                   client_incarnation="inc-1") as coordinator:
                    with pytest.raises(NotAuthorized):
                        await coordinator.call(target, "Control.Status", _call_payload(1, {}),
                                               timeout=10)

            async def call(serial: int, method: str, params: dict[str, Any]) -> dict[str, Any]:
                answer = await ctl.call(target, method, _call_payload(serial, params),
                                        timeout=30)
                outcome = answer.outcome
                assert outcome["workerId"] == node_id and outcome["scope"] is None
                assert outcome["requestId"] == f"req-{serial}"
                assert outcome["incarnationId"].startswith("inc-")
                assert outcome["incarnationId"] == answer.responder.client_incarnation
                return outcome

            seen: set[str] = set()
            for serial, (method, params) in enumerate([
                    ("Control.Status", {}),
                    ("Control.Kill", {"run": None, "workerId": "fly-a", "signal": "TERM"}),
                    ("Control.Kill", {"run": None, "workerId": "fly-a", "signal": "KILL"})],
                    start=1):
                outcome = await call(serial, method, params)
                assert outcome["type"] == "result", outcome
                assert control_validator(method, "result")(outcome["result"]) is None
                seen.add(method)
            assert outcome["result"] == {"workerId": "fly-a", "run": None,
                                         "outcome": "AlreadyGone"}

            # a run the node holds: its event ring, once a checkpoint was taken
            run = await asyncio.to_thread(submit, site, "--steps", "600", "--pace",
                                          "--mode", "in-process", "--checkpoint-every", "10")
            await asyncio.to_thread(wait_state, site, run, {"running"})
            deadline = time.monotonic() + 30
            for serial in range(40, 400):
                outcome = await call(serial, "Control.RunEvents", {"run": run})
                assert outcome["type"] == "result", outcome
                if outcome["result"]["events"] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            events = outcome["result"]["events"]
            assert outcome["result"]["run"] == run and events, outcome
            assert control_validator("Control.RunEvents", "result")(outcome["result"]) is None
            assert {e["run"] for e in events} == {run}
            seen.add("Control.RunEvents")
            outcome = await call(41, "Control.Watch", {"run": run})
            assert outcome["type"] == "result", outcome
            assert outcome["result"]["topic"] == f"flyd.run.{run}"
            seen.add("Control.Watch")
            refusals = [
                ("Control.Kill", {"run": 7, "workerId": "fly-a", "signal": "KILL"},
                 "IDENTITY_MISMATCH", f"run 7 is not held by node {node_id}"),
                ("Control.RunEvents", {"run": 7}, "IDENTITY_MISMATCH",
                 f"run 7 is not held by node {node_id}"),
                ("Control.Kill", {"workerId": "fly-a", "signal": "HUP"}, "INVALID_ARGUMENT", ""),
                ("Control.Status", {"extra": 1}, "INVALID_ARGUMENT", ""),
                ("Control.Reboot", {}, "UNSUPPORTED", ""),
            ]
            for serial, (method, params, code, message) in enumerate(refusals, start=10):
                outcome = await call(serial, method, params)
                assert outcome["type"] == "error", outcome
                assert outcome["error"]["code"] == code
                assert outcome["error"]["mutation"] == "none"
                assert message in outcome["error"]["message"]
            bad = await ctl.call(target, "Control.Status", {"requestId": "req-20", "scope":
                                 {"sessionId": "x", "epoch": "e1", "step": "0"}, "params": {}},
                                 timeout=10)
            assert bad.outcome["error"]["code"] == "INVALID_ARGUMENT"
            for serial in (30, 31):  # a repeated Drain answers the same; the node exits 0
                outcome = await call(serial, "Control.Drain", {})
                assert outcome["result"] == {"draining": True}
                assert control_validator("Control.Drain", "result")(outcome["result"]) is None
            seen.add("Control.Drain")
            assert seen == set(METHODS)
        assert await asyncio.to_thread(site.procs[0].wait, 60) == 0
    finally:
        await router.stop()


async def test_control_watch(site: Site) -> None:
    router = Router(RouterConfig(socket_path=site.socket, policy=Policy.default(None)))
    await router.start()
    try:
        await asyncio.to_thread(serve, site, "n1", "--no-router", "--capacity", "3")
        async with connect(site.socket, client_id="ctl-1-0a1b2c3d") as ctl:
            (svc,) = await ctl.services("flyd.control.")
            node_id = svc["name"].removeprefix("flyd.control.")
            serials = iter(range(1, 100))

            async def watch(run: int | None) -> dict[str, Any]:
                answer = await ctl.call(svc["name"], "Control.Watch",
                                        _call_payload(next(serials), {"run": run}), timeout=30)
                outcome: dict[str, Any] = answer.outcome
                return outcome

            none = await watch(None)
            assert none["error"]["code"] == "IDENTITY_MISMATCH", none
            first = await asyncio.to_thread(submit, site, "--steps", "6000", "--pace",
                                            "--mode", "in-process")
            await asyncio.to_thread(wait_state, site, first, {"running"})
            deadline = time.monotonic() + 30
            outcome = await watch(first)
            while outcome["result"]["descriptor"] is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
                outcome = await watch(first)
            result = outcome["result"]
            assert control_validator("Control.Watch", "result")(result) is None
            assert result["run"] == first and result["topic"] == f"flyd.run.{first}"
            (listed,) = await ctl.topics(f"flyd.run.{first}")
            assert result["topicIncarnation"] == listed["topicIncarnation"]
            assert listed["owner"]["clientId"] == f"node.{node_id}"
            assert result["descriptor"]["sessionId"] and result["descriptor"]["agents"]
            only = (await watch(None))["result"]
            assert (only["run"], only["topicIncarnation"]) == (first, result["topicIncarnation"])
            missing = await watch(first + 100)
            assert missing["error"]["code"] == "IDENTITY_MISMATCH"
            assert missing["error"]["message"] == (f"run {first + 100} is not held by node "
                                                   f"{node_id}")
            # another node connection holds the next run's topic name: that run is unwatched
            async with connect(site.socket, client_id="node.test-000000000000") as rival:
                await rival.declare(f"flyd.run.{first + 1}")
                second = await asyncio.to_thread(submit, site, "--steps", "6000", "--pace",
                                                 "--mode", "in-process")
                assert second == first + 1
                await asyncio.to_thread(wait_state, site, second, {"running"})
                unwatched = await watch(second)
                assert unwatched["error"]["code"] == "UNSUPPORTED", unwatched
                both = await watch(None)
            assert both["error"]["code"] == "INVALID_ARGUMENT"
            assert f"{first}, {second}" in both["error"]["message"]
            for run in (first, second):
                ran = await asyncio.to_thread(flyctl, site, "runs", "cancel", str(run),
                                              socket=False)
                assert ran.code == 0
            for run in (first, second):
                await asyncio.to_thread(wait_state, site, run, {"cancelled"})
    finally:
        await router.stop()


def test_flyctl_status_falls_back_to_the_database(site: Site) -> None:
    node = serve(site, "n1")
    drained = flyctl(site, "drain")
    assert drained.code == 0 and drained.json["draining"] is True
    assert node.wait(timeout=60) == 0
    run = submit(site, "--steps", "30")
    ran = flyctl(site, "status")
    assert ran.code == 0
    doc = ran.json
    assert doc["source"] == "database" and doc["router"] is None
    assert "database" in ran.err and "no router" in ran.err
    (row,) = doc["nodes"]
    assert row["nodeId"] == drained.json["node"] and row["state"] == "stopped"
    assert row["lastHeartbeat"] and row["dsn"]
    assert [(r["run"], r["state"]) for r in doc["runs"]] == [(run, "pending")]
    human = flyctl(site, "status", json=False)
    assert human.code == 0
    assert "RUN" in human.out and "RUN" not in human.err  # the result on stdout
    assert "source: database" in human.err                # the note on stderr


def test_flyctl_drain_and_runs_show(site: Site) -> None:
    notify = site.path / "notify.sock"
    receiver = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    receiver.bind(str(notify))
    receiver.settimeout(0.1)
    try:
        first = serve(site, "n1", env=site.env(NOTIFY_SOCKET=str(notify)))
        run = submit(site, "--steps", "600", "--pace")
        wait_state(site, run, {"running"})
        shown = _live_show(site, run)
        assert shown["phase"]
        assert shown["state"] == "running" and shown["ownerNode"].startswith("n1-")
        _assert_checkpoint_events(shown, run)
        drained = flyctl(site, "drain")
        assert drained.code == 0
        assert drained.json == {"node": shown["ownerNode"], "draining": True}
        assert first.wait(timeout=60) == 0
        messages = _received(receiver)
        assert "STOPPING=1" in messages, messages
    finally:
        receiver.close()
    row = wait_state(site, run, {"pending"})
    assert row["attempt"] == 0 and row["leaseEpoch"] == 1
    serve(site, "n2", socket=str(site.path / "bus2.sock"))
    done = wait_state(site, run, {"succeeded"}, timeout=60)
    assert done["leaseEpoch"] == 2
    final = flyctl(site, "runs", "show", str(run))
    assert final.code == 0
    doc = final.json
    assert [(g["nodeId"][:3], g["endReason"]) for g in doc["grants"]] == [
        ("n1-", "released"), ("n2-", "finished")]
    assert isinstance(doc["recoveries"], int) and doc["epochs"][0] == "e1"
    with psycopg.connect(site.dsn, autocommit=True) as conn:
        effects = conn.execute("SELECT count(*) FROM flyd.effects WHERE run_id = %s",
                               (run,)).fetchone()
    assert effects is not None and doc["effects"] == effects[0] == 601


def _live_show(site: Site, run: int) -> dict[str, Any]:
    """`runs show` of a live run once its holder's ring holds a committed checkpoint."""
    deadline = time.monotonic() + 30
    while True:
        ran = flyctl(site, "runs", "show", str(run))
        assert ran.code == 0, ran
        events = ran.json["events"] or []
        if ran.json["phase"] is not None and any(e["event"] == "committed" for e in events):
            return dict(ran.json)
        assert time.monotonic() < deadline, ran
        time.sleep(0.3)


def _assert_checkpoint_events(shown: dict[str, Any], run: int) -> None:
    """The ring of state.md §5.6: every event carries the run, its lease epoch and the
    generation; a cadence generation (every 60 steps) of e1 is queued, then committed, with its
    size."""
    events = shown["events"]
    fields = {"event", "run", "leaseEpoch", "checkpointId", "sessionId", "epoch", "episodeId",
              "boundary", "byteLength"}
    assert all(fields <= set(e) for e in events), events
    assert {(e["run"], e["leaseEpoch"], e["epoch"]) for e in events} == {(run, 1, "e1")}
    assert {e["event"] for e in events} <= {"captured", "queued", "superseded", "committed",
                                            "failed"}
    committed = next(e for e in events if e["event"] == "committed")
    assert committed["boundary"] > 0 and committed["boundary"] % 60 == 0, committed
    assert committed["byteLength"] > 0
    story = [e["event"] for e in events if e["checkpointId"] == committed["checkpointId"]]
    assert story == ["queued", "committed"], story


def _received(receiver: socketlib.socket) -> list[str]:
    out: list[str] = []
    while True:
        try:
            data = receiver.recv(4096)
        except (TimeoutError, BlockingIOError):
            return out
        out += data.decode().splitlines()


async def _stored_generation(dsn: str) -> int:
    """A run claimed at lease epoch 1 with one committed generation `ck-5` of session epoch
    `e2` at boundary 5 (the store's own commit path)."""
    lease = pgstore.PgStore(dsn, NODE, pgstore.DbSettings(), LeaseParams())
    await lease.open()
    store = CheckpointStore(lease)
    try:
        run_id = (await lease.submit(None, {}, 3)).run_id
        [grant] = await lease.claim(NODE, 1, 3600.0)
        await store.commit(make_job(run_id, grant.lease_epoch, "ck-5", 5, session_epoch="e2"),
                           DirectCommitPath(lease, run_id, grant.lease_epoch, NODE))
    finally:
        await lease.close()
    return run_id


async def _running_with_two_epochs(dsn: str) -> int:
    """A running run whose committed effects span session epochs 1 and 2 (one recovery),
    written through the lease layer's own group commit; it has no outcome yet."""
    lease = pgstore.PgStore(dsn, NODE, pgstore.DbSettings(), LeaseParams())
    await lease.open()
    try:
        run_id = (await lease.submit(None, {}, 3)).run_id
        [grant] = await lease.claim(NODE, 1, 3600.0)
        effects = []
        for k in range(1, 5):
            payload = {"boundary": k}
            effects.append(Effect(f"boundary-{k}", 1 if k <= 2 else 2, k, payload,
                                  hashlib.sha256(orjson.dumps(payload)).digest()))
        await lease.commit(Commit(run_id, grant.lease_epoch, NODE, tuple(effects)))
    finally:
        await lease.close()
    return run_id


def test_runs_show_counts_recoveries_before_the_outcome(site: Site) -> None:
    run = asyncio.run(_running_with_two_epochs(site.dsn))
    shown = flyctl(site, "runs", "show", str(run), socket=False)
    assert shown.code == 0
    doc = shown.json
    assert doc["state"] == "running" and doc["outcome"] is None
    assert doc["epochs"] == ["e1", "e2"] and doc["recoveries"] == 1
    human = flyctl(site, "runs", "show", str(run), socket=False, json=False)
    assert human.code == 0 and human.err == ""
    first = human.out.splitlines()[0]
    assert " recoveries 1 " in first and " checkpoints kept 0 " in first, first


def _rewrite_row(dsn: str, run_id: int, **columns: Any) -> None:
    """Delete and re-insert the generation with some columns changed, in one transaction."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute("SELECT * FROM flyd.checkpoints WHERE run_id = %s", (run_id,),
                           binary=True)
        row = cur.fetchone()
        assert row is not None and cur.description is not None
        values = dict(zip([d.name for d in cur.description], row, strict=True))
        values.update(columns)
        values.pop("committed_at")
        names = list(values)
        with conn.transaction():
            conn.execute("DELETE FROM flyd.checkpoints WHERE run_id = %s", (run_id,))
            conn.execute(f"INSERT INTO flyd.checkpoints ({', '.join(names)}) "
                         f"VALUES ({', '.join('%s' for _ in names)})",
                         [values[n] for n in names])


def test_checkpoint_commands_print_json(site: Site) -> None:
    run = asyncio.run(_stored_generation(site.dsn))
    listed = flyctl(site, "checkpoints", "list", str(run), socket=False)
    assert listed.code == 0
    (ck,) = listed.json["checkpoints"]
    assert listed.json["run"] == run
    assert (ck["checkpointId"], ck["boundary"], ck["sessionEpoch"], ck["leaseEpoch"],
            ck["head"]) == ("ck-5", 5, "e2", 1, True)
    assert set(ck) == {"checkpointId", "boundary", "sessionEpoch", "leaseEpoch", "byteLength",
                       "compatibilityDigest", "committedAt", "head"}
    human = flyctl(site, "checkpoints", "list", str(run), json=False, socket=False)
    assert "SESSION-EPOCH" in human.out and "LEASE-EPOCH" in human.out and human.err == ""

    out = site.path / "ck.flysess"
    exported = flyctl(site, "checkpoints", "export", str(run), "-o", str(out), socket=False)
    assert exported.code == 0
    data = out.read_bytes()
    assert exported.json == {"run": run, "checkpointId": "ck-5", "boundary": 5,
                             "byteLength": len(data),
                             "envelopeDigest": hashlib.sha256(data).hexdigest(),
                             "file": str(out)}
    ok = flyctl(site, "checkpoints", "verify", str(out), socket=False)
    assert ok.code == 0 and ok.json == {"ok": True, "check": None, "reason": None}
    corrupt = site.path / "corrupt.flysess"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    corrupt.write_bytes(bytes(flipped))
    bad = flyctl(site, "checkpoints", "verify", str(corrupt), socket=False)
    assert bad.code == 1 and bad.json["ok"] is False and bad.json["check"] == "R2"
    assert bad.json["reason"]

    stored = flyctl(site, "checkpoints", "verify", "--run", str(run), socket=False)
    assert stored.code == 0 and stored.json["ok"] is True
    _rewrite_row(site.dsn, run, byte_length=len(data) + 1)
    rewritten = flyctl(site, "checkpoints", "verify", "--run", str(run), "--id", "ck-5",
                       socket=False)
    assert rewritten.code == 1 and rewritten.json["check"] == "S2"
    refused = flyctl(site, "checkpoints", "export", str(run), "-o",
                     str(site.path / "none.flysess"), socket=False)
    assert refused.code == 1 and refused.json["error"]["code"] == "INCOMPATIBLE_STATE"
    assert not (site.path / "none.flysess").exists()

    # this generation's manifest names no agents: no composition can install it
    empty = flyctl(site, "checkpoints", "import", str(out), "--steps", "20", socket=False)
    assert empty.code == 2 and empty.json["error"]["code"] == "USAGE"
    assert "/agents" in empty.json["error"]["message"]
    # a real one-agent checkpoint of the synthetic composition imports
    real = site.path / "real.flysess"
    data = base64.b64decode(orjson.loads(FIXTURE.read_bytes())["envelope"])
    real.write_bytes(data)
    low = flyctl(site, "checkpoints", "import", str(real), "--steps", "2", socket=False)
    assert low.code == 2 and low.json["error"]["code"] == "USAGE"
    imported = flyctl(site, "checkpoints", "import", str(real), "--steps", "20", "--mode",
                      "thread", socket=False)
    assert imported.code == 0, imported
    assert imported.json["checkpointId"] == "ckpt-1" and imported.json["boundary"] == 2
    assert imported.json["envelopeDigest"] == hashlib.sha256(data).hexdigest()
    assert imported.json["run"] != run
    row = flyctl(site, "runs", "show", str(imported.json["run"]), socket=False).json
    assert row["state"] == "pending" and row["checkpoints"][0]["leaseEpoch"] == 0
