"""The run topic (docs/topics.md §14.1, tests 173–176).

173–175 run through the session harness with `run_id` set: the harness's node connection
declares `flyd.run.<run>` as a node does and the coordinator publishes on it with the node's
coordinator grants; the `end` a node's grant publishes is `end_run_topic`, called by the test in
the node's place. 176 runs real `flyd serve` nodes: the grant itself publishes `end` and
removes the topic.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path
from typing import Any

import pytest

from bus.client import connect
from bus.client_topics import Message, Subscription
from bus.errors import NotAuthorized, QuotaExceeded
from flyd.session.run_topic import EndState, RunEnd, end_run_topic
from tests.cli.test_flyctl_runs import Site, serve, submit, wait_state
from tests.cli.test_flyctl_runs import site as site
from tests.session.harness import Fixture, SessionHarness, within

pytestmark = pytest.mark.timeout(120)

RUN = 7
STEPS = 50


def ctl_id() -> str:
    return f"ctl-{os.getpid()}-{os.urandom(4).hex()}"


async def read_all(sub: Subscription) -> list[Message]:
    """Every message until the topic's removal, each consumed as the next is asked for."""
    return [msg async for msg in sub]


def publish_lines(h: SessionHarness) -> list[str]:
    return [e for e in h.coordinator.audit.entries() if e.startswith("publish:")]


async def unwatched_run(steps: int) -> tuple[list[str], list[dict[str, Any]]]:
    """The audit's publication lines and behaviour records of the same run without a topic."""
    async with SessionHarness.start(Fixture()) as h:
        await h.bootstrap()
        await h.run(steps)
        return publish_lines(h), [t.behaviour for t in h.coordinator.trace.transitions]


async def watched_run(steps: int, state: EndState,
                      ) -> tuple[Subscription, list[Message], list[str], str]:
    """A run of `steps` watched from before its descriptor to its `end` (`state`): the
    subscription, the messages read, the audit's publication lines and the coordinator's
    client id."""
    async with SessionHarness.start(Fixture(run_id=RUN)) as h:
        assert h.topic is not None
        async with connect(h.socket, client_id=ctl_id()) as ctl:
            sub = await ctl.subscribe(h.topic.name, mode="latest", window=16)
            async with asyncio.TaskGroup() as tg:
                reader = tg.create_task(within(read_all(sub)))
                await h.bootstrap()
                await h.run(steps)
                await end_run_topic(h.topic, RunEnd(RUN, state, steps), 5.0, h.publisher)
            return sub, reader.result(), publish_lines(h), h.names.coordinator_client_id


async def test_every_committed_boundary_is_published() -> None:
    sub, messages, watched, coordinator = await watched_run(STEPS, "succeeded")
    assert sub.removed_reason == "undeclared"
    end = messages[-1]
    assert end.payload == {"kind": "end", "run": RUN, "state": "succeeded", "boundary": STEPS,
                           "error": None}
    assert end.sequence == 1 + (STEPS + 1) + 1
    # subscribed before the descriptor (sequence 0): every accepted message is read or skipped
    assert sub.sequence == 0 and messages[0].sequence == messages[0].skipped + 1
    for before, after in itertools.pairwise(messages):
        assert after.sequence > before.sequence
        assert after.sequence - before.sequence == after.skipped + 1
    boundaries = [m.payload for m in messages if m.payload["kind"] == "boundary"]
    assert [b["boundary"] for b in boundaries] == sorted({b["boundary"] for b in boundaries})
    assert {"run", "boundary", "worldTime", "stepsPerSecond", "rewards",
            "eventIds"} <= set(boundaries[-1])
    assert boundaries[-1]["boundary"] <= STEPS
    assert any(b["stepsPerSecond"] > 0 for b in boundaries)
    assert all(m.publisher.client_id == coordinator for m in messages[:-1])
    unwatched, _ = await unwatched_run(STEPS)
    assert watched == unwatched


async def test_a_released_end_is_sent_without_waiting_and_still_removes_the_topic() -> None:
    """A lost lease's grant publishes `released` and pipelines the undeclare (it must not wait
    on the router): the observer still reads `end`, then the removal."""
    sub, messages, _, _ = await watched_run(3, "released")
    assert sub.removed_reason == "undeclared"
    assert messages[-1].payload == {"kind": "end", "run": RUN, "state": "released",
                                    "boundary": 3, "error": None}


async def test_run_topic_admits_only_latest_observers() -> None:
    async with SessionHarness.start(Fixture(run_id=RUN)) as h:
        assert h.topic is not None
        await h.bootstrap()
        async with connect(h.socket, client_id=ctl_id()) as ctl:
            with pytest.raises(QuotaExceeded):
                await ctl.subscribe(h.topic.name, mode="bounded", depth=4)
            sub = await ctl.subscribe(h.topic.name, mode="latest", window=1)
            assert sub.retained and sub.sequence == 2  # the descriptor, then boundary 0
            first = await within(anext(sub))
            assert first.payload["kind"] == "boundary" and first.payload["boundary"] == 0
            with pytest.raises(NotAuthorized):
                await ctl.publish(h.topic.name, {"kind": "boundary", "run": RUN})


async def test_refused_publication_never_fails_the_epoch() -> None:
    async with SessionHarness.start(Fixture(run_id=RUN)) as h:
        assert h.topic is not None and h.publisher is not None
        await h.bootstrap()
        await h.run(10)
        assert h.publisher.refused == 0
        h.publisher.flush()  # boundary 10's lingering message leaves before the undeclare
        assert await h.topic.undeclare()  # the node gives the topic up at boundary 10
        reports = await h.run(STEPS - 10)
        assert reports[-1].boundary == STEPS
        # a refusal is a notification on the control lane: one request on the coordinator's
        # connection is answered after every refusal of the publications sent before it
        assert h.coordinator_client is not None
        await within(h.coordinator_client.stats())
        assert h.publisher.refusals == {"NO_TOPIC": STEPS - 10}
        assert h.coordinator.stats.to_json()["publicationsRefused"] == STEPS - 10
        assert h.coordinator.last_failure is None and not h.coordinator.fenced
        watched = [t.behaviour for t in h.coordinator.trace.transitions]
    _, unwatched = await unwatched_run(STEPS)
    assert watched == unwatched


def _config(site: Site) -> Path:
    path = site.path / "flyd.toml"
    path.write_text("[checkpoints]\nrecovery_max_attempts = 1\nrecovery_backoff_s = 0.1\n")
    return path


async def _watch_to_the_end(site: Site, run: int) -> tuple[Subscription, list[Message]]:
    async with connect(site.socket, client_id=ctl_id()) as ctl:
        sub = await ctl.subscribe(f"flyd.run.{run}", mode="latest", window=1)
        return sub, await within(read_all(sub), 90)


async def test_end_message_then_removal(site: Site) -> None:
    await asyncio.to_thread(serve, site, "n1", env=site.env(FLYD_CONFIG=str(_config(site))))
    run = await asyncio.to_thread(submit, site, "--steps", "240", "--pace", "--mode", "thread")
    await asyncio.to_thread(wait_state, site, run, {"running"})
    sub, messages = await _watch_to_the_end(site, run)
    assert sub.removed_reason == "undeclared"
    assert messages[-1].payload == {"kind": "end", "run": run, "state": "succeeded",
                                    "boundary": 240, "error": None}
    assert messages[-2].payload["kind"] == "boundary"

    failing = await asyncio.to_thread(submit, site, "--steps", "600", "--pace", "--mode",
                                      "thread", "--fault", "fly-a.fail_commit_at_step=90",
                                      "--fault", "fly-a.fail_stage_restore=true")
    await asyncio.to_thread(wait_state, site, failing, {"running"})
    sub, messages = await _watch_to_the_end(site, failing)
    assert sub.removed_reason == "undeclared"
    end = messages[-1].payload
    assert (end["kind"], end["run"], end["state"]) == ("end", failing, "failed")
    assert isinstance(end["error"], str) and end["error"]
    row = await asyncio.to_thread(wait_state, site, failing, {"failed"})
    assert row["state"] == "failed"
