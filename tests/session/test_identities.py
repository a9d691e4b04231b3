"""Session identities, bus names and the default policy's expectations (session.md §7.2).

The pure part checks every derived name; the router part checks that the node connection's
expectations admit exactly the session's clients with exactly their grants under the default
closed policy, and nothing else.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from bus.client import connect
from bus.errors import Conflict, NotAuthorized, RouterLost
from flyd.launch.identities import (
    SessionNames,
    SessionTags,
    WorkerIdentity,
    agent_service,
    coordinator_client_id,
    domain_incarnation,
    environment_service,
    launcher_client_id,
    new_client_incarnation,
    new_node_id,
    parse_tag,
    session_client_grants,
    worker_client_id,
    worker_grants,
)
from flyd.launch.launcher import connect_expected
from flyd.node.grant import launch_refusal_repeats
from flyd.session.runspec import RunSpec, RunSpecError
from workers.launch import AgentSettings, WorkerLaunch
from workers.types.domain import DomainError, ErrorCode, Mutation, is_id, parse_worker_id

if TYPE_CHECKING:
    from tests.session.conftest import Node

NAMES = SessionNames(session_id="demo", tag="s3", node_id="host-a-3f9c0e1b2a4d")


def test_session_tags_start_at_random_and_wrap_after_s999999() -> None:
    tags = SessionTags(999_998)
    assert [tags.next() for _ in range(4)] == ["s999998", "s999999", "s1", "s2"]
    firsts = {int(SessionTags().peek()[1:]) for _ in range(200)}
    assert all(1 <= n <= 900_000 for n in firsts)
    assert len(firsts) > 150  # random, not a counter from 1
    for bad in (0, 1_000_000, -1):
        with pytest.raises(DomainError) as err:
            SessionTags(bad)
        assert err.value.code == "INVALID_ARGUMENT"


def test_tags_parse_strictly() -> None:
    assert parse_tag("s1") == 1
    assert parse_tag("s999999") == 999_999
    for bad in ("s0", "s01", "s1000000", "3", "S3", "s", "s-1"):
        with pytest.raises(DomainError):
            parse_tag(bad)


def test_names_follow_the_table() -> None:
    assert NAMES.node_client_id == "node.host-a-3f9c0e1b2a4d"
    assert NAMES.coordinator_client_id == coordinator_client_id("s3") == "s3.coordinator"
    assert NAMES.launcher_client_id == launcher_client_id("s3") == "s3.launcher"
    assert NAMES.callers == ("s3.coordinator", "s3.launcher", "node.host-a-3f9c0e1b2a4d")
    assert worker_client_id("s3", "fly-a", 2) == "s3.fly-a.g2"
    assert agent_service("s3", "fly-a") == "s3.agent.fly-a"
    assert environment_service("s3", "arena") == "s3.env.arena"
    assert domain_incarnation("fly-a", 2) == "fly-a-inc-2"
    assert session_client_grants("s3") == {"register": [], "call": ["s3.agent.*", "s3.env.*"]}
    assert worker_grants("s3.agent.fly-a") == {"register": ["s3.agent.fly-a"], "call": []}
    assert re.fullmatch(r"inc-[0-9a-f]{32}", new_client_incarnation())
    assert new_client_incarnation() != new_client_incarnation()
    node_id = new_node_id("host-a")
    assert re.fullmatch(r"host-a-[0-9a-f]{12}", node_id)
    with pytest.raises(DomainError):
        new_node_id("Host_A")


def test_worker_identities_and_generations() -> None:
    fly = NAMES.agent("fly-a", "p1", threads=2)
    assert fly == WorkerIdentity(
        session_id="demo", tag="s3", client_id="s3.fly-a.g1", service="s3.agent.fly-a",
        worker_id="fly-a", incarnation_id="fly-a-inc-1", role="agent", port_id="p1",
        worker_threads=2, generation=1)
    second = fly.next_generation()
    assert (second.generation, second.client_id, second.incarnation_id, second.service) == (
        2, "s3.fly-a.g2", "fly-a-inc-2", "s3.agent.fly-a")
    assert second.is_predecessor("fly-a-inc-1")
    assert not second.is_predecessor("fly-a-inc-2")
    assert not second.is_predecessor("fly-b-inc-1")
    assert not second.is_predecessor("fly-a-inc-01")
    arena = NAMES.environment("arena", threads=1)
    assert (arena.service, arena.port_id, arena.role) == ("s3.env.arena", None, "environment")
    assert arena.grants() == {"register": ["s3.env.arena"], "call": []}
    with pytest.raises(DomainError):
        WorkerIdentity.create(NAMES, "fly-a", "agent", 1)  # an agent needs a port
    with pytest.raises(DomainError):
        NAMES.agent("fly-a", "p1", threads=0)
    with pytest.raises(DomainError):
        NAMES.agent("x" * 49, "p1", threads=1)


def test_every_derived_name_is_a_bus_id_at_the_largest_tag_and_generation() -> None:
    names = SessionNames(session_id="demo", tag="s999999", node_id="n-000000000000")
    longest = "a" * 48
    agent = WorkerIdentity.create(names, longest, "agent", 256, 9999, port_id="p1")
    world = WorkerIdentity.create(names, longest, "environment", 1, 9999)
    for name in (agent.client_id, agent.service, agent.incarnation_id, world.service,
                 names.coordinator_client_id, names.launcher_client_id):
        assert is_id(name), name
    with pytest.raises(DomainError):
        agent.next_generation()  # generation 10000


def _spec_accepts(agent_id: str) -> bool:
    try:
        RunSpec.validate({"agents": [{"agentId": agent_id, "portId": "p1", "seed": None}]})
    except RunSpecError as exc:
        assert exc.path == "/agents/0/agentId", exc
        return False
    return True


def _launch_accepts(service: str) -> bool:
    """The launch values' own service-name check (what a worker is started with)."""
    try:
        WorkerLaunch(socket="/tmp/x.sock", session_id="demo", worker_id="w",
                     incarnation_id="w-inc-1", client_id="s1.w.g1", service=service,
                     supervisor="s1.launcher", callers=("s1.coordinator",), threads=1,
                     max_agents=4, settings=AgentSettings(port_id="p1"))
    except DomainError:
        return False
    return True


@given(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,63}", fullmatch=True))
@example("a..b")
@example("c.")
@example("a.b")
@example("a" * 48)
@example("a" * 49)
def test_a_worker_id_validates_exactly_when_its_bus_names_launch(agent_id: str) -> None:
    """One rule for the run spec and the launcher (issue: `--agents a..b,c.` validated, then
    every launch was refused): an Id the spec accepts always makes a valid service name, and
    one it refuses for its dots never would."""
    launches = _launch_accepts(f"s1.agent.{agent_id}") and _launch_accepts(f"s1.env.{agent_id}")
    assert _spec_accepts(agent_id) == (launches and len(agent_id) <= 48)
    if _spec_accepts(agent_id):
        assert NAMES.agent(agent_id, "p1", threads=1).service == f"s3.agent.{agent_id}"
        assert parse_worker_id(agent_id) == agent_id
    else:
        with pytest.raises(DomainError):
            NAMES.agent(agent_id, "p1", threads=1)


def test_only_a_refusal_of_the_launch_values_is_not_retried() -> None:
    """A launch refused for its arguments recurs on every node and attempt (the run ends at
    once); a worker that died, a budget or a bus failure may not, so those are retried."""
    assert launch_refusal_repeats(DomainError.invalid("service 's1.agent.c.' is not a name"))
    for transient in (DomainError(ErrorCode.BACKEND_FAILURE, "fly-a exited with code 70",
                                  Mutation.NONE),
                      DomainError.before(ErrorCode.BUSY, "2 of 8 threads remain"),
                      DomainError.before(ErrorCode.IDENTITY_MISMATCH, "no live worker"),
                      RouterLost("router stopping")):
        assert not launch_refusal_repeats(transient), transient


async def test_the_node_connection_admits_exactly_the_session_clients(node: Node) -> None:
    names = node.names()
    tag = names.tag
    # the session's launcher, through the node's expectation: grants to call the workers only
    launcher = await connect_expected(node.client, node.socket, names.launcher_client_id,
                                      grants=names.client_grants())
    assert launcher.grants == {"register": [], "call": [f"{tag}.agent.*", f"{tag}.env.*"],
                               "expect": [], "delegate": [], "publish": [], "subscribe": [],
                               "manage": []}
    # a worker: register its own service, nothing else
    fly = names.agent("fly-a", "p1", threads=1)
    await node.client.expect(fly.client_id, os.getpid(), client_incarnation=fly.incarnation_id,
                             grants=fly.grants())
    worker = await connect(node.socket, client_id=fly.client_id,
                           client_incarnation=fly.incarnation_id)
    assert worker.grants["register"] == [fly.service]
    assert worker.grants["call"] == []

    async def handler(req: object) -> dict[str, object]:
        return {"ok": True}

    await worker.register(fly.service, handler)
    with pytest.raises(NotAuthorized):
        await worker.register(f"{tag}.agent.fly-b", handler)
    result = await launcher.call(fly.service, "Worker.Status", {"x": 1}, timeout=5)
    assert result.outcome == {"ok": True}
    assert result.responder.client_id == fly.client_id
    with pytest.raises(NotAuthorized):
        await launcher.call("s1.agent.fly-a" if tag != "s1" else "s2.agent.fly-a",
                            "Worker.Status", {}, timeout=5)
    # an s* id without a pending expectation, another incarnation, a reused incarnation
    with pytest.raises(NotAuthorized):
        await connect(node.socket, client_id=f"{tag}.coordinator2")
    await node.client.expect(names.coordinator_client_id, os.getpid(),
                             client_incarnation=new_client_incarnation(),
                             grants=names.client_grants())
    with pytest.raises(NotAuthorized):
        await connect(node.socket, client_id=names.coordinator_client_id,
                      client_incarnation=new_client_incarnation())
    with pytest.raises(Conflict):
        await node.client.expect(fly.client_id, os.getpid(),
                                 client_incarnation=fly.incarnation_id, grants=fly.grants())
    # an id that matches no policy entry
    with pytest.raises(NotAuthorized):
        await connect(node.socket, client_id="someone")
    # another process's expectation is not ours
    fly_b = names.agent("fly-b", "p2", threads=1)
    await node.client.expect(fly_b.client_id, 1, client_incarnation=fly_b.incarnation_id,
                             grants=fly_b.grants())
    with pytest.raises(NotAuthorized):
        await connect(node.socket, client_id=fly_b.client_id,
                      client_incarnation=fly_b.incarnation_id)
    await worker.close()
    await launcher.close()
