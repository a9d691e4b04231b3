"""Session identities and bus names (design/session.md §7.2). Pure.

Why: every name a session puts on the bus (client ids, services, incarnations) and every grant
the node connection hands out through `bus.expect` is derived here, once, so the launcher, the
coordinator, the harness and the node agree byte for byte, and the default closed policy
(`bus.policy.Policy.default`) admits exactly these clients and nothing else.

| item | form |
| --- | --- |
| node connection | `node.<node_id>` (node id `<name>-<12 hex>`, fresh per start,
design/cli.md §2.2) | | session tag | `s<n>`: random first tag in 1..900000, then +1; `s999999` is
followed by `s1` | | coordinator / launcher | `<tag>.coordinator` / `<tag>.launcher` |
| worker client id | `<tag>.<workerId>.g<gen>` |
| service | `<tag>.agent.<agentId>` / `<tag>.env.<worldId>` |
| domain incarnation | `<workerId>-inc-<gen>`, generation 1 first |
| client incarnation | workers: the domain incarnation; node, coordinator, launcher: `inc-<hex>` |

Resolved ambiguities:
- Tags and generations are validated at construction (`s1..s999999`, generations 1..9999, worker
  ids by `workers.types.domain.parse_worker_id`, the run spec's rule too), so every derived name is
  a valid bus Id (≤ 64 characters) and every service a valid service name.
- `WorkerRef` (the coordinator's pinned reference, design/session.md §6.1) lives here rather than in
  the coordinator because the launcher produces it (`LaunchedWorker.worker_ref()`) and imports go
  downward only.
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass, replace
from typing import Final, Literal

from bus.client_identity import new_incarnation
from workers.types.domain import DomainError, parse_id, parse_worker_id

__all__ = [
    "MAX_GENERATION",
    "MAX_TAG",
    "RUN_TOPIC_PREFIX",
    "Role",
    "SessionNames",
    "SessionTags",
    "WorkerIdentity",
    "WorkerRef",
    "agent_service",
    "coordinator_client_id",
    "domain_incarnation",
    "environment_service",
    "launcher_client_id",
    "new_client_incarnation",
    "new_node_id",
    "node_client_id",
    "parse_tag",
    "run_topic",
    "session_client_grants",
    "worker_client_id",
    "worker_grants",
]

Role = Literal["agent", "environment"]

MAX_TAG: Final = 999_999
FIRST_TAG_MAX: Final = 900_000
MAX_GENERATION: Final = 9999
_TAG: Final = re.compile(r"s([1-9][0-9]{0,5})")
RUN_TOPIC_PREFIX: Final = "flyd.run."
_NODE_NAME: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")


def parse_tag(tag: str) -> int:
    """The number of a session tag `s<n>` (1..999999); else `INVALID_ARGUMENT`."""
    match = _TAG.fullmatch(tag) if isinstance(tag, str) else None
    if match is None or not 1 <= int(match.group(1)) <= MAX_TAG:
        raise DomainError.invalid(f"{tag!r} is not a session tag (s1..s{MAX_TAG})")
    return int(match.group(1))


def _check_generation(generation: int) -> int:
    if isinstance(generation, bool) or not isinstance(generation, int) \
            or not 1 <= generation <= MAX_GENERATION:
        raise DomainError.invalid(f"generation {generation!r} is not in 1..{MAX_GENERATION}")
    return generation


class SessionTags:
    """The node's tag sequence: a random first tag in 1..900000, then +1, wrapping to `s1`."""

    def __init__(self, first: int | None = None) -> None:
        if first is None:
            first = secrets.randbelow(FIRST_TAG_MAX) + 1
        if isinstance(first, bool) or not isinstance(first, int) or not 1 <= first <= MAX_TAG:
            raise DomainError.invalid(f"first tag {first!r} is not in 1..{MAX_TAG}")
        self._next = first

    def next(self) -> str:
        """The next session tag (`s417203`, `s417204`, …, `s999999`, `s1`, …)."""
        tag = f"s{self._next}"
        self._next = 1 if self._next >= MAX_TAG else self._next + 1
        return tag

    def peek(self) -> str:
        return f"s{self._next}"


def new_node_id(node_name: str) -> str:
    """`<name>-<12 hex>`, fresh at every start (design/cli.md §2.2)."""
    if not isinstance(node_name, str) or _NODE_NAME.fullmatch(node_name) is None:
        raise DomainError.invalid(f"{node_name!r} is not a node name ([a-z0-9][a-z0-9-]{{0,31}})")
    return f"{node_name}-{os.urandom(6).hex()}"


def new_client_incarnation() -> str:
    """`inc-<32 hex>` from `os.urandom`, new per connection (node, coordinator, launcher)."""
    return new_incarnation()


def node_client_id(node_id: str) -> str:
    return f"node.{node_id}"


def coordinator_client_id(tag: str) -> str:
    parse_tag(tag)
    return f"{tag}.coordinator"


def launcher_client_id(tag: str) -> str:
    parse_tag(tag)
    return f"{tag}.launcher"


def worker_client_id(tag: str, worker_id: str, generation: int) -> str:
    parse_tag(tag)
    return f"{tag}.{parse_worker_id(worker_id)}.g{_check_generation(generation)}"


def agent_service(tag: str, agent_id: str) -> str:
    parse_tag(tag)
    return f"{tag}.agent.{parse_worker_id(agent_id)}"


def environment_service(tag: str, world_id: str) -> str:
    parse_tag(tag)
    return f"{tag}.env.{parse_worker_id(world_id)}"


def domain_incarnation(worker_id: str, generation: int) -> str:
    return f"{parse_worker_id(worker_id)}-inc-{_check_generation(generation)}"


def session_client_grants(tag: str) -> dict[str, list[str]]:
    """Grants of a session's coordinator and launcher: call the session's workers only."""
    parse_tag(tag)
    return {"register": [], "call": [f"{tag}.agent.*", f"{tag}.env.*"]}


def run_topic(run_id: int) -> str:
    """`flyd.run.<run>`: the topic a node declares for a run it holds (topics.md §14.1)."""
    return f"{RUN_TOPIC_PREFIX}{run_id}"


def worker_grants(service: str) -> dict[str, list[str]]:
    """Grants of a worker: register its own service, call nothing."""
    return {"register": [service], "call": []}


@dataclass(frozen=True, slots=True)
class SessionNames:
    """The bus names of one session on one node."""

    session_id: str
    tag: str
    node_id: str

    def __post_init__(self) -> None:
        parse_id(self.session_id, "session id")
        parse_tag(self.tag)

    @property
    def node_client_id(self) -> str:
        return node_client_id(self.node_id)

    @property
    def coordinator_client_id(self) -> str:
        return coordinator_client_id(self.tag)

    @property
    def launcher_client_id(self) -> str:
        return launcher_client_id(self.tag)

    @property
    def callers(self) -> tuple[str, str, str]:
        """Who may call a worker (`--callers`, design/session.md §2.2 step 3b): coordinator,
        launcher, node."""
        return (self.coordinator_client_id, self.launcher_client_id, self.node_client_id)

    def client_grants(self) -> dict[str, list[str]]:
        return session_client_grants(self.tag)

    def coordinator_grants(self, run_id: int | None) -> dict[str, list[str]]:
        """The client grants, and for a node's run the right to publish on its run topic
        (topics.md §14.1 rule 3); declaring it stays with the node."""
        grants = session_client_grants(self.tag)
        if run_id is not None:
            grants["publish"] = [run_topic(run_id)]
        return grants

    def agent(self, agent_id: str, port_id: str, threads: int,
              generation: int = 1) -> WorkerIdentity:
        return WorkerIdentity.create(self, agent_id, "agent", threads, generation,
                                     port_id=port_id)

    def environment(self, world_id: str, threads: int, generation: int = 1) -> WorkerIdentity:
        return WorkerIdentity.create(self, world_id, "environment", threads, generation)


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """Who one launch of a worker is (design/session.md §7.2)."""

    session_id: str
    tag: str
    client_id: str
    service: str
    worker_id: str
    incarnation_id: str
    role: Role
    port_id: str | None
    worker_threads: int
    generation: int

    @classmethod
    def create(cls, names: SessionNames, worker_id: str, role: Role, threads: int,
               generation: int = 1, *, port_id: str | None = None) -> WorkerIdentity:
        if role not in ("agent", "environment"):
            raise DomainError.invalid(f"role {role!r} is not agent or environment")
        if (role == "agent") != (port_id is not None):
            raise DomainError.invalid("an agent has a port and an environment has none")
        if port_id is not None:
            parse_id(port_id, "port id")
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 256:
            raise DomainError.invalid(f"worker threads {threads!r} are not in 1..256")
        service = (agent_service(names.tag, worker_id) if role == "agent"
                   else environment_service(names.tag, worker_id))
        return cls(
            session_id=names.session_id, tag=names.tag,
            client_id=worker_client_id(names.tag, worker_id, generation),
            service=service, worker_id=worker_id,
            incarnation_id=domain_incarnation(worker_id, generation), role=role,
            port_id=port_id, worker_threads=threads, generation=generation,
        )

    def next_generation(self, threads: int | None = None) -> WorkerIdentity:
        """The identity of the next launch: generation + 1, new client id and incarnation."""
        generation = _check_generation(self.generation + 1)
        return replace(
            self, generation=generation,
            client_id=worker_client_id(self.tag, self.worker_id, generation),
            incarnation_id=domain_incarnation(self.worker_id, generation),
            worker_threads=self.worker_threads if threads is None else threads,
        )

    def grants(self) -> dict[str, list[str]]:
        return worker_grants(self.service)

    def is_predecessor(self, incarnation_id: str) -> bool:
        """True for an earlier generation's domain incarnation of this worker."""
        prefix = f"{self.worker_id}-inc-"
        if not incarnation_id.startswith(prefix):
            return False
        tail = incarnation_id[len(prefix):]
        return tail.isdigit() and not tail.startswith("0") and int(tail) < self.generation


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """A pinned reference to one live worker (design/session.md §6.1): calls pin
    `service_incarnation`, replies are checked against `worker_id` and `domain_incarnation` (skipped
    while None)."""

    service: str
    service_incarnation: str
    worker_id: str
    domain_incarnation: str | None
