"""What a run spec must be to start from an imported checkpoint (`flyctl checkpoints import`).

Why: a FLYSESS1 file carries the identities of the composition that wrote it (design/state.md §2.4,
§3: agents, ports, seeds, model versions, profile, dataset and index digests, the world's
compatibility block), not its run spec. A run submitted with another composition is accepted
and then fails its restore (`INCOMPATIBLE_STATE`), on a node, after the submitter has gone.
This module rebuilds the composition from what the manifest says, and checks a spec against it
before anything is submitted, naming the first difference and the spec field behind it.

Rules:
- `rebuild(manifest, source)`: the spec document of the composition. Agents, their ports and
  their seeds (explicit, as recorded), the world's id come from the manifest; the model, world
  and task settings (import paths, configs, tick, warm-up, step, observation delay, threads,
  mode, dispatch, pacing, cadence) from `source`, the spec of a run that holds the same file
  in this database, when there is one (an agent the source lacks gets the defaults); without
  one they are the defaults, and the check below says whether that composition fits. Faults,
  injections, `steps`, `startFrom` and `exclusiveToSubmitter` never carry over: they belong to
  a run, not to a composition. Session and episode ids: the source's, else the manifest's.
- `mismatch(spec, manifest)` checks, in order: the agent set, each agent's port, the world's
  id; then each agent's identity (design/state.md §3, `AgentIdentity` order) computed as the agent
  worker computes it (`profile`, `graph`, the class's `model_version` and
  `plasticity_version`, the effective seed); then the world's compatibility block, from the
  descriptor of the world built as the environment worker builds it. The answer is a
  `Mismatch`: the JSON path of the spec field to change and a message naming the field, the
  checkpoint's value and the spec's.
- Plugin code runs here, in the submitting process, as it would in the workers: a plugin whose
  module this host cannot find is not checked (`Unchecked`, the node checks at restore); a
  plugin that is found but fails (a missing class or attribute, an exception in a constructor
  or class method) is a `Mismatch`, since it would fail the same way on the node.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from flyd.session.runspec import MAX_AGENTS_LIMIT, AgentSpec, RunSpec, RunSpecError
from flyd.state.compat import AGENT_IDENTITY_FIELDS, Compatibility
from workers.plugins import load_plugin
from workers.types.datatypes import EnvironmentDescriptor
from workers.types.domain import DomainError

__all__ = ["Mismatch", "Unchecked", "mismatch", "rebuild"]

#: The spec field behind each compared identity (design/state.md §3).
AGENT_FIELD_PATHS: Final = {"profileDigest": "", "datasetDigest": "/modelConfig",
                            "indexDigest": "/modelConfig", "modelVersion": "/model",
                            "plasticityVersion": "/model", "seed": "/seed"}
WORLD_FIELD_PATHS: Final = {"stateFormatId": "/world", "backendDigest": "/world/impl",
                            "contentDigest": "/world/impl", "patchDigest": "/world/config",
                            "controllerDigest": "/agents", "parserDigest": "/world/impl"}
RUN_ONLY_KEYS: Final = ("steps", "exclusiveToSubmitter", "injections", "startFrom", "paceS")


@dataclass(frozen=True)
class Mismatch:
    """The spec cannot install the checkpoint: `path` is the spec field to change."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


@dataclass(frozen=True)
class Unchecked:
    """A plugin this host cannot import: its identities are left to the node's restore."""

    path: str
    module: str


def rebuild(manifest: Mapping[str, Any], source: Mapping[str, Any] | None) -> dict[str, Any]:
    """The spec document of the checkpoint's composition (module rules), without `steps`."""
    base = RunSpec()
    known = False
    if source is not None:
        try:
            base = RunSpec.validate(dict(source), max_agents=MAX_AGENTS_LIMIT)
            known = True
        except RunSpecError:
            base = RunSpec()
    ports = {str(p["agentId"]): str(p["portId"]) for p in manifest["portMap"]}
    by_id = {a.agent_id: a for a in base.agents} if known else {}
    agents = []
    for entry in manifest["agents"]:
        agent_id = str(entry["agentId"])
        agent = by_id.get(agent_id, AgentSpec(agent_id, ports[agent_id]))
        doc = agent.to_json()
        doc.update(portId=ports[agent_id], seed=int(entry["seed"]), faults={})
        agents.append(doc)
    world = base.world.to_json()
    world.update(worldId=str(manifest["environment"]["workerId"]), faults={})
    doc = base.to_json()
    for key in RUN_ONLY_KEYS:
        doc.pop(key, None)
    doc.update(agents=agents, world=world)
    if not known:
        doc.update(sessionId=str(manifest["sourceScope"]["sessionId"]),
                   episodeId=str(manifest["episodeId"]))
        for key in ("mode", "dispatch", "pacing", "checkpoints"):
            doc.pop(key)  # the defaults of the host that submits it
    return doc


def mismatch(spec: RunSpec, manifest: Mapping[str, Any]) -> Mismatch | Unchecked | None:
    """The first reason `spec` cannot install the checkpoint, a plugin left unchecked, or
    None when every identity matches (module rules)."""
    recorded = {str(e["agentId"]): e for e in manifest["agents"]}
    ids = [a.agent_id for a in spec.agents]
    if sorted(recorded) != ids:
        return Mismatch("/agents", f"the checkpoint's agents are {', '.join(sorted(recorded))}; "
                                   f"the spec has {', '.join(ids)}")
    ports = {str(p["agentId"]): str(p["portId"]) for p in manifest["portMap"]}
    for i, agent in enumerate(spec.agents):
        if ports[agent.agent_id] != agent.port_id:
            return Mismatch(f"/agents/{i}/portId",
                            f"the checkpoint binds agent {agent.agent_id} to port "
                            f"{ports[agent.agent_id]}; the spec to {agent.port_id}")
    world_id = str(manifest["environment"]["workerId"])
    if spec.world.world_id != world_id:
        return Mismatch("/world/worldId", f"the checkpoint's world is {world_id}; the spec's "
                                          f"is {spec.world.world_id}")
    unchecked: Unchecked | None = None
    for i, agent in enumerate(spec.agents):
        found = _agent(spec, i, agent, recorded[agent.agent_id])
        if isinstance(found, Mismatch):
            return found
        unchecked = unchecked or found
    found = _world(spec, Compatibility.from_json(manifest["compatibility"]))
    return found if isinstance(found, Mismatch) else unchecked or found


def _absent(path: str) -> bool:
    module = path.partition(":")[0]
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def _failed(exc: Exception) -> str:
    return exc.message if isinstance(exc, DomainError) else f"{type(exc).__name__}: {exc}"


def _agent(spec: RunSpec, i: int, agent: AgentSpec,
           entry: Mapping[str, Any]) -> Mismatch | Unchecked | None:
    path = f"/agents/{i}"
    if _absent(agent.model):
        return Unchecked(f"{path}/model", agent.model)
    try:
        model = load_plugin(agent.model, "model")
        profile = model.profile(agent.agent_id, agent.tick, agent.warmup_ticks,
                                agent.model_config)
        graph = model.graph(agent.agent_id, agent.model_config)
    except Exception as exc:  # a plugin's failure, named as the node would meet it
        return Mismatch(path, f"agent {agent.agent_id}: {_failed(exc)}")
    live = {"agentId": agent.agent_id, "profileDigest": profile.digest,
            "datasetDigest": graph.dataset_digest, "indexDigest": graph.index_digest,
            "modelVersion": getattr(model, "model_version", None),
            "plasticityVersion": getattr(model, "plasticity_version", None),
            "seed": spec.seed_of(agent.agent_id)}
    for name, _ in AGENT_IDENTITY_FIELDS:
        if entry.get(name) != live[name]:
            return Mismatch(path + AGENT_FIELD_PATHS.get(name, ""),
                            f"agent {agent.agent_id}: the checkpoint's {name} identity "
                            f"{entry.get(name)} differs from this spec's {live[name]}")
    return None


def _world(spec: RunSpec, recorded: Compatibility) -> Mismatch | Unchecked | None:
    world = spec.world
    if _absent(world.impl):
        return Unchecked("/world/impl", world.impl)
    try:
        cls = load_plugin(world.impl, "world")
        built = cls(world_id=world.world_id, ports=tuple(a.port_id for a in spec.agents),
                    step=world.step, observation_delay_steps=world.observation_delay_steps,
                    threads=world.threads, config=world.config)
        descriptor = EnvironmentDescriptor.from_json(built.descriptor().to_json(),
                                                     "world descriptor")
        live = Compatibility.of(descriptor)
    except Exception as exc:  # a plugin's failure, named as the node would meet it
        return Mismatch("/world", f"world {world.world_id}: {_failed(exc)}")
    difference = recorded.first_difference(live)
    if difference is None:
        return None
    name, was, now = difference
    return Mismatch(WORLD_FIELD_PATHS[name], f"the checkpoint's {name} identity {was} differs "
                                             f"from this spec's world's {now}")
