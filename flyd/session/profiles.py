"""Each agent's model profile, read from its model plugin (design/session.md §6.1).

Why a module of its own: the grant loads its plugins in one place and hands the coordinator
values (`profiles=`), and a coordinator built with the spec's constructor alone, as harnesses and
embedders build it, reads the same profiles the same way.
"""

from __future__ import annotations

from typing import Any

from flyd.session.runspec import RunSpec
from workers.plugins import load_plugin


def model_profiles(spec: RunSpec) -> dict[str, dict[str, Any]]:
    """Each agent's model profile (its `digest` is the profile digest every Prepare carries), by
    agent id, from the agent's model plugin."""
    profiles: dict[str, dict[str, Any]] = {}
    for agent in spec.agents:
        model = load_plugin(agent.model, "model")
        profiles[agent.agent_id] = model.profile(agent.agent_id, agent.tick, agent.warmup_ticks,
                                                 dict(agent.model_config)).to_json()
    return profiles
