"""The coordinator's side of the run topic (topics.md §14.1): descriptor and boundary
messages published to `flyd.run.<run>`, the node declares and ends it.

Why a module of its own: the run topic is how observers (`flyctl watch`) follow a run while it
runs, and it must cost the transaction nothing it would notice. Each message is one lean
`bus.publish` notification on the coordinator's connection (no answer, no round trip, never
awaited); a refusal arrives later as `bus.publishFailed` and is only counted and logged, so an
observer is never required and a refused publication never fails the epoch.

Rules:
- `descriptor(client, body)` at every descriptor publication (`publish:descriptor`,
  `descriptor-revision:<n>`): `{kind: "descriptor", run, descriptor}`.
- `boundary(client, ...)` at every `publish:<k>`, after the commit: `{kind: "boundary", run,
  boundary, worldTime, stepsPerSecond, rewards, eventIds}`, plus `snapshot` (the boundary's
  snapshot body) with the boundary's artifacts attached (no transfer: the coordinator keeps its
  holds) when some medium of the boundary travels by reference, the rest being small
  (topics.md §14.2, §16 decision 31: large inline media would cost a base64 snapshot per
  step). `stepsPerSecond` is the rate over the boundaries published in the last second of
  wall time (and the one before them), 0 before the second; every watcher therefore shows the
  same figure whatever its slot skipped.
  A boundary message lingers (the SDK's `linger`): unpaced, the next step's Prepare calls
  follow within the window and carry it in their write, so it costs the step no write and no
  router wake-up of its own; paced, it leaves alone at most `bus.client_connection.LINGER_S` later.
- `on_publish_failed` is the coordinator connection's hook: it counts the refusal here and in
  the bound `Stats.publications_refused`, and logs the first refusal of each error name.
- A publication the SDK refuses locally (a closed connection) counts as refused too.
- The node's part: `declare_run_topic` when the grant's session starts (a refusal leaves the run
  unwatched, `run.topic_unavailable`), `end_run_topic` when it ends: `{kind: "end", run, state,
  boundary, error}`, then the topic is undeclared.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import structlog

from bus.client import BusClient
from bus.client_topics import Topic
from bus.errors import BusError
from flyd.launch.identities import run_topic
from flyd.session.stats import Stats
from workers.types.datatypes import Reward
from workers.types.ticks import RationalNs

__all__ = ["RATE_WINDOW_S", "EndState", "RunEnd", "RunPublisher", "declare_run_topic",
           "end_run_topic"]

log = structlog.get_logger("flyd.session.run_topic")

#: the wall-time window of `stepsPerSecond`
RATE_WINDOW_S: Final = 1.0


EndState = Literal["succeeded", "failed", "cancelled", "released"]


@dataclass(frozen=True)
class RunEnd:
    """The node's last message on the run topic when its grant ends (topics.md §14.1 rule 4);
    `released`: this node gave the run up (a drain, a lost lease), another may continue it."""

    run: int
    state: EndState
    boundary: int
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kind": "end", "run": self.run, "state": self.state, "boundary": self.boundary,
                "error": self.error}


class RunPublisher:
    """Lean publications of one run's descriptors and boundaries (module rules)."""

    def __init__(self, run_id: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_id = run_id
        self.topic = run_topic(run_id)
        self.refused = 0
        #: refusals by error name (NO_TOPIC, NOT_AUTHORIZED, ...)
        self.refusals: collections.Counter[str] = collections.Counter()
        self._clock = clock
        self._stats: Stats | None = None
        self._published: collections.deque[tuple[float, int]] = collections.deque()
        self._lingering: BusClient | None = None  # the client of the last boundary message

    def bind(self, stats: Stats) -> None:
        """Count refusals in `stats` too (the current coordinator's)."""
        self._stats = stats

    def on_publish_failed(self, topic: str, error: BusError) -> None:
        """The connection's `bus.publishFailed` hook: counted and logged, nothing else."""
        self._refused(error.name, error.message)

    def _refused(self, name: str, message: str) -> None:
        self.refused += 1
        self.refusals[name] += 1
        if self._stats is not None:
            self._stats.publications_refused += 1
        if self.refusals[name] == 1:
            log.warning("run.publication_refused", run=self.run_id, topic=self.topic,
                        error=name, message=message)

    def descriptor(self, client: BusClient, body: dict[str, Any]) -> None:
        self._send(client, {"kind": "descriptor", "run": self.run_id, "descriptor": body})

    def boundary(self, client: BusClient, boundary: int, world_time: RationalNs,
                 rewards: Mapping[str, Sequence[Reward]], event_ids: Sequence[str],
                 snapshot: dict[str, Any] | None = None,
                 attachments: Sequence[str] = ()) -> None:
        payload: dict[str, Any] = {
            "kind": "boundary", "run": self.run_id, "boundary": boundary,
            "worldTime": world_time.to_json(), "stepsPerSecond": self._rate(boundary),
            "rewards": {agent: [r.to_json() for r in given] for agent, given in rewards.items()},
            "eventIds": list(event_ids)}
        if snapshot is not None:
            payload["snapshot"] = snapshot
        self._send(client, payload, tuple(attachments), linger=True)
        self._lingering = client

    def flush(self) -> None:
        """Write a lingering boundary message now (before the node's `end`, which another
        connection sends and which must come after it)."""
        client, self._lingering = self._lingering, None
        if client is not None:
            client.flush()

    def _rate(self, boundary: int) -> float:
        """Boundaries per second over the last `RATE_WINDOW_S` (module rules)."""
        now = self._clock()
        published = self._published
        if published and boundary <= published[-1][1]:  # a restore went back: start again
            published.clear()
        published.append((now, boundary))
        while len(published) > 2 and now - published[1][0] > RATE_WINDOW_S:
            published.popleft()
        first_at, first = published[0]
        if now <= first_at or boundary == first:
            return 0.0
        return round((boundary - first) / (now - first_at), 1)

    def _send(self, client: BusClient, payload: dict[str, Any],
              attachments: tuple[str, ...] = (), linger: bool = False) -> None:
        try:
            client.publish_nowait(self.topic, payload, attachments=attachments, linger=linger)
        except BusError as exc:
            self._refused(exc.name, exc.message)


async def declare_run_topic(node: BusClient, run_id: int, timeout_s: float) -> Topic | None:
    """The node declares the run's topic (topics.md §14.1 rules 1–2): retained, no bounded
    subscriber. A refusal or no answer leaves the run unwatched: logged once, never a failure."""
    try:
        async with asyncio.timeout(timeout_s):
            return await node.declare(run_topic(run_id), retain=True, max_bounded=0)
    except (BusError, TimeoutError) as exc:
        log.warning("run.topic_unavailable", run=run_id, topic=run_topic(run_id),
                    error=exc.name if isinstance(exc, BusError) else "TIMEOUT",
                    message=str(exc))
        return None


async def end_run_topic(topic: Topic, end: RunEnd, timeout_s: float,
                        publisher: RunPublisher | None) -> None:
    """Publish the run's `end` on the node connection, then undeclare the topic: the router
    takes one connection's frames in order, so `end` is accepted before the removal and every
    subscriber reads it before `bus.topicRemoved` (topics.md §3.3). The publisher's lingering
    boundary message is written first, so it is not accepted after the end. A lost router already
    removed the topic.
    A `released` end (a lost lease, an abandoned grant) does not wait for the removal's answer:
    its scope must end within the kill bound (design/distribution.md §5.5), never on the router."""
    if publisher is not None:
        publisher.flush()
    if topic.closed:
        return
    with contextlib.suppress(BusError, TimeoutError):
        topic.publish_nowait(end.to_json())
        if end.state == "released":
            topic.undeclare_nowait()
            return
        async with asyncio.timeout(timeout_s):
            await topic.undeclare()
