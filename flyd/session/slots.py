"""`AgentSlot`: what the coordinator holds of one agent (design/session.md §6.1, §6.6).

Why a value of its own: bootstrap fills it, every transition reads and advances it, capture
records it and restore replaces it; one shape, imported by each of them, keeps those modules
from reaching into the coordinator for it. The coordinator owns the slots (one per agent,
created from the agent's spec and model profile) and changes what they hold at a boundary;
a transition (`flyd.session.transition`) fills only the in-flight fields, which the coordinator
clears at every boundary and on a failure; capture and restore read them.

Fields: the agent's spec, model profile (`digest` is its profile digest), seed and model
config; the decision context in force and its digest; the graph and telemetry from
`Agent.Initialize`/`Agent.Commit`; tick duration and warm-up ticks; the committed step; the
in-flight transition's prepared result, decision and request ids (cleared at every boundary and
by a failure); the last committed decision and applied controls (for the snapshot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flyd.session.runspec import AgentSpec
from workers.types.datatypes import Graph, PortControl, Telemetry, TypedValue
from workers.types.ticks import RationalNs

__all__ = ["AgentSlot"]


@dataclass
class AgentSlot:
    spec: AgentSpec
    profile: dict[str, Any]
    seed: int
    model_config: dict[str, Any]
    context: TypedValue | None = None
    context_digest: str = ""
    graph: Graph | None = None
    telemetry: Telemetry | None = None
    tick_duration: RationalNs | None = None
    warmup_ticks: int = 0
    committed_step: int = 0
    decision: TypedValue | None = None
    prepared: dict[str, Any] | None = None
    prepare_request: str | None = None
    commit_request: str | None = None
    last_decision: TypedValue | None = None
    last_controls: PortControl | None = None

    def clear_in_flight(self) -> None:
        """Forget the in-flight transition's values (at every boundary and on a failure)."""
        self.prepared = None
        self.decision = None
        self.prepare_request = None
        self.commit_request = None
