"""Which endpoint serves a role (design/session.md §3, §7.1): the one map from a launch's role to
its endpoint class.

Why: the shell (`workers.shell`) is the base layer every endpoint builds on, so it must not
import them; whoever starts a worker without an endpoint of its own (the fork server, the
launcher, tests) asks this module, which sits above both endpoints.

API:

    ENDPOINTS                         {"agent": AgentEndpoint, "environment": EnvironmentEndpoint}
    endpoint_for(launch) -> Endpoint  the endpoint of `launch.role`, built for that launch
"""

from __future__ import annotations

from typing import Final

from workers.agent import AgentEndpoint
from workers.bodies import EndpointFactory
from workers.environment import EnvironmentEndpoint
from workers.faults import Role
from workers.launch import WorkerLaunch
from workers.shell import Endpoint

__all__ = ["ENDPOINTS", "endpoint_for"]

ENDPOINTS: Final[dict[Role, EndpointFactory]] = {
    "agent": AgentEndpoint,
    "environment": EnvironmentEndpoint,
}


def endpoint_for(launch: WorkerLaunch) -> Endpoint:
    """The endpoint of a launch's role (its model or world class is imported and checked now;
    a refusal is raised as `DomainError`)."""
    return ENDPOINTS[launch.role](launch)
