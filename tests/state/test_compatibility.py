"""The compatibility block and agent identities (state.md §3, §10 tests 17–21)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from flyd.state.compat import AGENT_IDENTITY_FIELDS, FIELDS, AgentIdentity, Compatibility
from tests.session.worker_rig import Rig, environment_launch, rig, scope
from workers.synthetic.arena import CounterArena
from workers.types.canonical import digest_bytes, digest_of
from workers.types.datatypes import EnvironmentDescriptor
from workers.types.domain import DomainError, ErrorCode, Mutation
from workers.types.ticks import RationalNs

__all__ = ["rig"]

# session.md §4.6 vectors
BACKEND = "2fb50676f712f3f1ea2b2b085027711beafb4ec6ede69bb27ebd052b22380849"
CONTENT = "f2b01bea1ea5348acec4345444fcb4617029e06a4edc0625b664f90e4360e801"
CONFIGURATION = "19d4b0beffd13556d2f0da539a373c52f22a55708ef6da188a7d1eb8d8040027"
# session.md §4.4: a synthetic schema's digest is over "fly-session-schema-v1\n<name>\n<v>\n"
CONTROLLER_SCHEMA = {"id": "arena.controller.v1", "version": 1, "digest": digest_bytes(
    b"fly-session-schema-v1\narena.controller.v1\n1\n")}
INSPECTION_SCHEMA = {"id": "arena.inspection.v1", "version": 1, "digest": digest_bytes(
    b"fly-session-schema-v1\narena.inspection.v1\n1\n")}


def arena(ports: tuple[str, ...] = ("p1", "p2"), delay: int = 0) -> CounterArena:
    return CounterArena(world_id="arena", ports=ports, step=RationalNs(50_000_000, 3),
                        observation_delay_steps=delay, threads=1, config={})


def block() -> Compatibility:
    return Compatibility.of(arena().descriptor())


def identity(**changes: Any) -> AgentIdentity:
    base = AgentIdentity(
        agent_id="fly-a",
        profile_digest="e50a471c6327ca4d9295c7efaebba8b4e2f8d08bcefc0b10b2a513e7f8d0a08c",
        dataset_digest="3abe76e912cb936270c4d84c7407a663663d965e0b0c5df526d51302ddebd29c",
        index_digest="479093e456fee800e2a827d35fc37b94d0b9e053d261964c0e598d290b0dc423",
        model_version="fake-brain-v1",
        plasticity_version="fake-reinforce-v1",
        seed=7,
    )
    return replace(base, **changes)


def test_the_block_comes_from_the_descriptor() -> None:
    port = {"controls": {"schema": CONTROLLER_SCHEMA, "buttons": ["inc", "dec"],
                         "axes": [{"id": "bias", "range": "bipolar", "neutral": 0}]}}
    compatibility = block()
    assert compatibility.to_json() == {
        "stateFormatId": "flysess-1",
        "backendDigest": BACKEND,
        "contentDigest": CONTENT,
        "patchDigest": CONFIGURATION,
        "controllerDigest": digest_of([{"portId": "p1", **port}, {"portId": "p2", **port}]),
        "parserDigest": digest_of({"inspectionSchema": INSPECTION_SCHEMA}),
    }
    assert [name for name, _ in FIELDS] == list(compatibility.to_json())
    assert compatibility.digest() == digest_of(compatibility.to_json())
    # pinned from the formulas above, so a silent change of the arena's descriptor shows here
    assert compatibility.controller_digest == (
        "d15e0816fcc3a8e7ca0fe676677e4803055e17671c5693c1e15b40e147fc0f66")
    assert compatibility.parser_digest == (
        "206a0a127dfbfac181c683f82cbb138506978f3315ef05b103b4446e0fa7ef6b")
    # the configuration, the ports and their order all reach the block; the task schema does not
    assert Compatibility.of(arena(delay=1).descriptor()).patch_digest != CONFIGURATION
    assert Compatibility.of(arena(("p2", "p1")).descriptor()).controller_digest != (
        compatibility.controller_digest)
    assert Compatibility.from_json(compatibility.to_json()) == compatibility
    with pytest.raises(DomainError) as caught:
        Compatibility.of(replace(arena().descriptor(), recovery="none"))
    assert (caught.value.code, caught.value.mutation) == (ErrorCode.UNSUPPORTED, Mutation.NONE)


@pytest.mark.parametrize(("ports", "delay"), [(("p1", "p2"), 0), (("p1",), 2)])
async def test_the_environment_echoes_the_coordinators_digest(
        rig: Rig, ports: tuple[str, ...], delay: int) -> None:
    await rig.start(environment_launch(rig.socket, ports=ports, delay=delay))
    bindings = [[p, f"fly-{p}"] for p in ports]
    initialized = await rig.init_env(bindings=bindings)
    descriptor = EnvironmentDescriptor.from_json(initialized["descriptor"])
    captured = await rig.ok("arena", "State.Capture", {"checkpointId": "ckpt-1"}, scope(0))
    assert captured["agentIdentity"] is None
    assert captured["compatibilityDigest"] == Compatibility.of(descriptor).digest()
    assert captured["compatibilityDigest"] == Compatibility.of(
        arena(ports, delay).descriptor()).digest()


@pytest.mark.parametrize(("name", "attr"), FIELDS)
def test_the_first_differing_field_is_named(name: str, attr: str) -> None:
    recorded = block()
    other = "flysess-2" if name == "stateFormatId" else digest_bytes(name.encode())
    live = replace(recorded, **{attr: other})
    with pytest.raises(DomainError) as caught:
        recorded.compare(live, checkpoint_id="ckpt-7")
    error = caught.value
    assert (error.code, error.mutation) == (ErrorCode.INCOMPATIBLE_STATE, Mutation.NONE)
    assert error.message == (
        f"checkpoint ckpt-7: the checkpoint's {name} identity {getattr(recorded, attr)} differs "
        f"from this composition's {other}")
    recorded.compare(recorded, checkpoint_id="ckpt-7")
    # with a later field also differing, the earlier one is named
    index = [n for n, _ in FIELDS].index(name)
    if index + 1 < len(FIELDS):
        later = FIELDS[index + 1][1]
        both = replace(live, **{later: digest_bytes(b"later")})
        with pytest.raises(DomainError) as caught:
            recorded.compare(both, checkpoint_id="ckpt-7")
        assert caught.value.message == error.message


@pytest.mark.parametrize(("field", "value", "words"), [
    ("backendDigest", BACKEND[:63], "backendDigest"),
    ("patchDigest", CONFIGURATION.upper(), "patchDigest"),
    ("parserDigest", 7, "parserDigest"),
    ("stateFormatId", "Flysess-1", "stateFormatId"),
    ("stateFormatId", "", "stateFormatId"),
    ("controllerDigest", None, "controllerDigest"),
])
def test_from_json_refuses_malformed_blocks(field: str, value: Any, words: str) -> None:
    good = block().to_json()
    bad = {**good, field: value}
    with pytest.raises(DomainError) as caught:
        Compatibility.from_json(bad)
    error = caught.value
    assert (error.code, error.mutation) == (ErrorCode.INCOMPATIBLE_STATE, Mutation.NONE)
    assert words in error.message
    broken: Any
    for broken in ({k: v for k, v in good.items() if k != field}, {**good, "extra": "x"}, []):
        with pytest.raises(DomainError) as caught:
            Compatibility.from_json(broken)
        assert caught.value.code == ErrorCode.INCOMPATIBLE_STATE


def test_agent_identity_covers_every_field() -> None:
    base = identity()
    assert base.to_json() == {
        "agentId": "fly-a",
        "profileDigest": base.profile_digest,
        "datasetDigest": base.dataset_digest,
        "indexDigest": base.index_digest,
        "modelVersion": "fake-brain-v1",
        "plasticityVersion": "fake-reinforce-v1",
        "seed": 7,
    }
    assert base.digest() == digest_of(base.to_json())
    assert AgentIdentity.from_json(base.to_json()) == base
    changes: dict[str, Any] = {"agent_id": "fly-b", "profile_digest": digest_bytes(b"p"),
               "dataset_digest": digest_bytes(b"d"), "index_digest": digest_bytes(b"i"),
               "model_version": "fake-brain-v2", "plasticity_version": "fake-reinforce-v2",
               "seed": 8}
    assert set(changes) == {attr for _, attr in AGENT_IDENTITY_FIELDS}
    digests = {base.digest()}
    for name, attr in AGENT_IDENTITY_FIELDS:
        changed = replace(base, **{attr: changes[attr]})
        digests.add(changed.digest())
        with pytest.raises(DomainError) as caught:
            base.compare(changed)
        assert caught.value.code == ErrorCode.INCOMPATIBLE_STATE
        assert caught.value.message == (
            f"agent fly-a: the checkpoint's {name} identity {getattr(base, attr)} differs from "
            f"this worker's {changes[attr]}")
    assert len(digests) == 1 + len(AGENT_IDENTITY_FIELDS)
    base.compare(identity())
    for bad in ({**base.to_json(), "seed": 2**31}, {**base.to_json(), "seed": True},
                {**base.to_json(), "incarnationId": "x"}):
        with pytest.raises(DomainError) as caught:
            AgentIdentity.from_json(bad)
        assert caught.value.code == ErrorCode.INVALID_ARGUMENT
