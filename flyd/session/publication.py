"""Local publication (design/session.md §6.9): the session's feed, and the descriptor and snapshot
bodies it carries.

Why a module of its own: publication is the one view of a session that observers (the control
service, a UI, tests) read while it runs. It must never block or slow the transaction, and it
must describe exactly a committed boundary; keeping the feed and the bodies here, built only
from immutable values the coordinator hands over, keeps both properties visible in one place.

Rules:
- The feed (`Feed`) yields `Publication(kind, body)` items: `kind` is `descriptor` or
  `snapshot`. A subscriber's queue is bounded (`Subscription`); a full queue drops its oldest
  entry and counts it (`dropped`). A replaying subscriber first gets the descriptor, then the
  latest snapshot.
- A snapshot body is built when someone reads it: at once while the feed has subscribers, else
  on the first read of `latest`. Its builder (`snapshot_body` with the boundary's values) holds
  only immutable values, so the body is the same either way and an unwatched session builds
  none per step.
- `check_publication` (design/session.md §6.9): the agents' ports are the descriptor's, the
  observation is of boundary b and every view was produced at `max(0, b - delay)`; else
  `BUFFER_INVALID`/`none`.
- `descriptor_body`: the session, revision, composition digest, scheduler, environment
  descriptor, task schema, agents (port, profile, graph digests, rates, stimuli) and assets.
- `Publisher` numbers the descriptor revisions and the snapshots (`sequence` from 0) and puts
  each on the feed and, for a node's run, on the run topic (topics.md §14.1): a boundary's
  snapshot rides along there only when its large media are by reference.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bus.client import BusClient
from flyd.session.run_topic import RunPublisher
from flyd.session.slots import AgentSlot
from flyd.state.envelope import SCHEDULER_ID
from workers.artifacts import any_by_reference, referenced_artifacts
from workers.composition import composition_digest
from workers.types.contract import contract_digest
from workers.types.datatypes import (
    AudioRef,
    EnvironmentDescriptor,
    PortControl,
    Reward,
    Telemetry,
    TypedValue,
    ViewRef,
    WorldObservation,
)
from workers.types.domain import DomainError, ErrorCode, Scope

__all__ = [
    "AgentValues",
    "Feed",
    "Publication",
    "Publisher",
    "Subscription",
    "check_publication",
    "descriptor_body",
    "snapshot_body",
]


#: One agent at a boundary, as a snapshot shows it: id, telemetry, selected decision, applied
#: controls.
AgentValues = tuple[str, Telemetry | None, TypedValue | None, PortControl | None]


@dataclass(frozen=True)
class Publication:
    kind: str  # "descriptor" | "snapshot"
    body: dict[str, Any]


class Subscription:
    """A bounded queue of publications; a full queue drops its oldest entry (`dropped`)."""

    def __init__(self, depth: int) -> None:
        self._queue: collections.deque[Publication] = collections.deque(maxlen=depth)
        self._event = asyncio.Event()
        self.dropped = 0

    def push(self, item: Publication) -> None:
        if self._queue.maxlen is not None and len(self._queue) == self._queue.maxlen:
            self.dropped += 1
        self._queue.append(item)
        self._event.set()

    def pending(self) -> list[Publication]:
        return list(self._queue)

    def __aiter__(self) -> AsyncIterator[Publication]:
        return self

    async def __anext__(self) -> Publication:
        while not self._queue:
            self._event.clear()
            await self._event.wait()
        return self._queue.popleft()


class Feed:
    """The session's local, never-blocking publication feed."""

    def __init__(self) -> None:
        self.descriptor: dict[str, Any] | None = None
        self._latest: dict[str, Any] | None = None
        self._build: Callable[[], dict[str, Any]] | None = None
        self._subscribers: list[Subscription] = []

    @property
    def latest(self) -> dict[str, Any] | None:
        """The latest snapshot body, built on first read."""
        if self._build is not None:
            self._latest, self._build = self._build(), None
        return self._latest

    def subscribe(self, depth: int = 8, replay: bool = True) -> Subscription:
        sub = Subscription(depth)
        if replay:
            if self.descriptor is not None:
                sub.push(Publication("descriptor", self.descriptor))
            if self.latest is not None:
                sub.push(Publication("snapshot", self.latest))
        self._subscribers.append(sub)
        return sub

    def _publish(self, item: Publication) -> None:
        for sub in self._subscribers:
            sub.push(item)

    def publish_descriptor(self, body: dict[str, Any]) -> None:
        self.descriptor = body
        self._publish(Publication("descriptor", body))

    def publish_snapshot(self, body: dict[str, Any]) -> None:
        self.publish_snapshot_on_read(lambda: body)

    def publish_snapshot_on_read(self, build: Callable[[], dict[str, Any]]) -> None:
        """Publish the snapshot `build` returns: now when someone subscribes, else when read."""
        if self._subscribers:
            self._latest, self._build = build(), None
            self._publish(Publication("snapshot", self._latest))
        else:
            self._latest, self._build = None, build



class Publisher:
    """What one session publishes: on its `feed` and, with `run` (a node's run), on the run
    topic, through the connection `client()` returns at the time."""

    def __init__(self, feed: Feed, run: RunPublisher | None,
                 client: Callable[[], BusClient]) -> None:
        self.feed = feed
        self.run = run
        self.client = client
        self.revision = 0
        self.sequence = 0

    def descriptor(self, session_id: str, epoch: str, descriptor: EnvironmentDescriptor,
                   agents: Sequence[tuple[str, AgentSlot]], progress: TypedValue | None) -> None:
        self.revision += 1
        body = descriptor_body(session_id, epoch, self.revision, descriptor, agents, progress)
        self.feed.publish_descriptor(body)
        if self.run is not None:
            self.run.descriptor(self.client(), body)

    def snapshot(self, scope: Scope, episode_id: str, observation: WorldObservation,
                 agents: list[AgentValues], progress: TypedValue | None, event_ids: list[str],
                 rewards: Callable[[], Mapping[str, Sequence[Reward]]]) -> None:
        """Boundary `scope.step`; `rewards` are its rewards by agent, asked for only by the run
        topic."""
        # the boundary's values, all immutable: the body is built from them only when read
        body = functools.partial(snapshot_body, self.revision, scope, episode_id, self.sequence,
                                 observation, agents, progress, tuple(event_ids))
        self.feed.publish_snapshot_on_read(body)
        self.sequence += 1
        if self.run is not None:
            by_reference = any_by_reference(observation)
            self.run.boundary(
                self.client(), scope.step, observation.world_time, rewards(), event_ids,
                body() if by_reference else None,
                referenced_artifacts(observation.sensory_views, observation.audio)
                if by_reference else ())


def descriptor_body(session_id: str, epoch: str, revision: int,
                    descriptor: EnvironmentDescriptor, slots: Sequence[tuple[str, AgentSlot]],
                    progress: TypedValue | None) -> dict[str, Any]:
    """The descriptor publication of `revision`; `slots` are the agents by id."""
    agents = []
    for agent_id, slot in slots:
        assert slot.graph is not None
        graph = slot.graph.to_json()
        agents.append({"agentId": agent_id, "portId": slot.spec.port_id,
                       "profileDigest": slot.profile["digest"],
                       "datasetDigest": graph["datasetDigest"],
                       "indexDigest": graph["indexDigest"],
                       "neuronCount": graph["neuronCount"],
                       "rateRoles": graph["rateRoles"],
                       "supportedStimuli": graph["supportedStimuli"]})
    return {
        "sessionId": session_id, "revision": str(revision),
        "compositionDigest": composition_digest(
            session_id, epoch, contract_digest(),
            [(a, slot.spec.port_id, slot.profile["digest"]) for a, slot in slots]),
        "schedulerId": SCHEDULER_ID, "environment": descriptor.to_json(),
        "taskSchema": None if progress is None else progress.schema.to_json(),
        "agents": agents, "assets": [slot.profile for _, slot in slots]}


def check_publication(descriptor: EnvironmentDescriptor, observation: WorldObservation,
                      ports: Sequence[str], b: int) -> None:
    """Boundary `b` may be published (module docstring); `ports` are the agents' ports."""
    if sorted(p.port_id for p in descriptor.ports) != sorted(ports):
        raise DomainError.before(ErrorCode.BUFFER_INVALID,
                                 "the agents' ports disagree with the descriptor")
    if observation.boundary != b:
        raise DomainError.before(ErrorCode.BUFFER_INVALID,
                                 f"the media are of boundary {observation.boundary}, not {b}")
    for view in descriptor.views:
        ref = next((v for v in observation.sensory_views if v.view_id == view.view_id), None)
        if ref is None or ref.produced_step != max(0, b - view.observation_delay_steps):
            raise DomainError.before(ErrorCode.BUFFER_INVALID,
                                     f"view {view.view_id} is not the one of boundary {b}")


def snapshot_body(revision: int, scope: Scope, episode_id: str, sequence: int,
                  observation: WorldObservation, agents: Sequence[AgentValues],
                  progress: TypedValue | None, event_ids: Sequence[str]) -> dict[str, Any]:
    """The snapshot publication of one boundary, from its immutable values."""
    views: list[ViewRef] = list(observation.sensory_views)
    audio: list[AudioRef] = list(observation.audio)
    return {
        "descriptorRevision": str(revision), "scope": scope.to_json(),
        "episodeId": episode_id, "sequence": str(sequence),
        "worldTime": observation.world_time.to_json(),
        "agents": [{
            "agentId": agent_id,
            "telemetry": None if telemetry is None else telemetry.to_json(),
            "selectedDecision": None if decision is None else decision.to_json(),
            "appliedControls": None if controls is None else controls.to_json()}
            for agent_id, telemetry, decision, controls in agents],
        "progress": None if progress is None else progress.to_json(),
        "media": {"views": [v.to_json() for v in views],
                  "audio": [a.to_json() for a in audio]},
        "eventIds": list(event_ids)}
