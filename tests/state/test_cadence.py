"""Cadence and the effects group commit (state.md §9; §10 tests 77–83).

A real session (the session harness, in-process workers) is stepped through the durability
layer (`flyd.session.durability`): each committed transition's behaviour record joins the pending
effects, captures follow the cadence, and the writer commits through the fenced group commit of
a claimed run (`DirectCommitPath`, on the in-memory lease store or PostgreSQL).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest

from flyd.node.grant import writer_config
from flyd.session.durability import (
    CaptureRefused,
    CheckpointTooLarge,
    Durability,
    Refusal,
    TooLarge,
)
from flyd.session.runspec import RunSpec
from flyd.session.trace import EpochRebase
from flyd.state.cadence import Cadence, CadenceError
from flyd.state.checkpoints import FinishRun
from flyd.state.recovery import capture_repeats
from flyd.state.writer import CheckpointSettings, CheckpointWriter, Committed, WriterFaults
from tests.session.harness import Fixture, SessionHarness
from tests.state.conftest import RunCtx, effect_rows, run_state
from workers.faults import Faults
from workers.types.domain import ErrorCode, Mutation

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Driven:
    h: SessionHarness
    durability: Durability
    writer: CheckpointWriter
    ctx: RunCtx
    records: list[dict[str, Any]] = field(default_factory=list)
    blocked: list[int] = field(default_factory=list)

    async def step(self) -> int:
        """One transition, its effect, then whatever the cadence asks (§9.1, §9.2)."""
        coordinator = self.h.coordinator
        report = await coordinator.step()
        record = coordinator.trace.transitions[-1].behaviour
        if coordinator.epoch != "e1":
            record = EpochRebase(coordinator.epoch, "e1", coordinator.task).apply(record)
        self.records.append(record)
        self.durability.record(report.boundary, coordinator.epoch, record)
        if self.writer.pending.full():
            self.blocked.append(report.boundary)
        await self.durability.after_boundary(coordinator, report.boundary)
        return report.boundary

    async def run(self, n: int) -> None:
        for _ in range(n):
            await self.step()

    async def final(self) -> None:
        async with asyncio.timeout(10):
            await self.writer.idle()
        k = self.h.coordinator.committed_boundary() or 0
        result = await self.durability.durable(
            self.h.coordinator, "final",
            finish=FinishRun("succeeded", {"boundary": k}, k, 1))
        assert isinstance(result, Committed), result

    async def settle(self) -> None:
        async with asyncio.timeout(10):
            await self.writer.idle()


@asynccontextmanager
async def driven(ctx: RunCtx, config: CheckpointSettings, faults: WriterFaults | None = None,
                 fixture: Fixture | None = None) -> AsyncIterator[Driven]:
    writer = CheckpointWriter(ctx.store, ctx.path, config, faults=faults)
    durability = Durability(writer, Cadence(config.every_steps, config.every_seconds))
    async with SessionHarness.start(fixture or Fixture()) as h, asyncio.TaskGroup() as tg:
        tg.create_task(writer.run())
        try:
            await h.bootstrap()
            durability.audit = h.coordinator.audit.add
            durability.restart(0, h.coordinator.epoch)
            yield Driven(h, durability, writer, ctx)
        finally:
            await writer.shutdown()


def keys(rows: list[tuple[str, int, str | None]]) -> list[str]:
    return sorted((k for k, _, _ in rows), key=lambda k: (k == "finish", len(k), k))


def boundary_keys(a: int, b: int) -> list[str]:
    return [f"boundary-{j}" for j in range(a, b + 1)]


# ---------------------------------------------------------------------------------------------


async def test_every_n_steps_captures_at_multiples(mem_run: RunCtx) -> None:
    async with driven(mem_run, CheckpointSettings(every_steps=5)) as d:
        await d.run(17)
        await d.settle()
        committed = [line for line in d.h.coordinator.audit.entries()
                     if line.startswith("captured:")]
    assert committed == ["captured:ck-e1-1@5", "captured:ck-e1-2@10", "captured:ck-e1-3@15"]
    assert d.durability.committed == 3


def test_every_t_seconds_and_whichever_first() -> None:
    now = [0.0]
    seconds = Cadence(every_steps=0, every_seconds=2.0)
    seconds.reset(0, now[0])
    now[0] = 1.9
    assert not seconds.due(40, now[0])
    now[0] = 2.0
    assert seconds.due(41, now[0])
    both = Cadence(every_steps=10, every_seconds=2.0)
    both.reset(0, 0.0)
    assert both.due(3, 2.5), "the seconds cadence came first"
    both.submitted(3, 2.5)
    assert not both.due(12, 3.0) and both.due(13, 3.0), "steps count from the reset"
    both.submitted(13, 3.0)
    assert not both.due(14, 4.9) and both.due(14, 5.0), "seconds count from the reset"
    assert both.next_id() == "ck-e1-1" and both.next_id("final") == "ck-e1-2-final"
    both.reset(0, 0.0, "e2")
    assert both.next_id("drain") == "ck-e2-1-drain", "a new epoch restarts the ids"
    off = Cadence(every_steps=0, every_seconds=0)
    assert not off.due(10**6, 10.0**6)


@pytest.mark.parametrize("backend", ["pg", "mem"])
async def test_effects_become_durable_only_with_a_covering_checkpoint(
        backend: str, claimed_run: RunCtx, mem_run: RunCtx) -> None:
    ctx = claimed_run if backend == "pg" else mem_run
    async with driven(ctx, CheckpointSettings(every_steps=5)) as d:
        await d.run(12)
        await d.settle()
        assert keys(await effect_rows(ctx)) == boundary_keys(1, 10)
        assert {cid for k, _, cid in await effect_rows(ctx)} == {"ck-e1-1", "ck-e1-2"}
        await d.final()
    rows = await effect_rows(ctx)
    assert keys(rows) == [*boundary_keys(1, 12), "finish"]
    assert {cid for k, _, cid in rows if k in ("boundary-11", "boundary-12", "finish")} == {
        "ck-e1-3-final"}
    state, _ = await run_state(ctx)
    assert state == "succeeded"


async def test_a_busy_writer_defers_the_capture_and_stepping_continues(mem_run: RunCtx) -> None:
    gate = asyncio.Event()
    faults = WriterFaults(gate=gate)
    async with driven(mem_run, CheckpointSettings(every_steps=5, queue_capacity=1), faults) as d:
        await d.run(5)  # ck-e1-1 reserved, captured and queued; the writer waits at the gate
        async with asyncio.timeout(5):
            await faults.stalled.wait()
        await d.run(3)  # boundaries 6..8: not due
        refused_before = d.writer.stats.rejected
        await d.run(4)  # 9..12: still nothing due (5 steps since 5 only at 10)
        assert d.h.coordinator.committed_boundary() == 12, "no step waited for the writer"
        assert d.writer.stats.rejected == refused_before + 3, "10, 11 and 12 each asked"
        audit = d.h.coordinator.audit.entries()
        assert [a for a in audit if a.startswith("capture-refused:")] == [
            "capture-refused:ck-e1-2", "capture-refused:ck-e1-3", "capture-refused:ck-e1-4"]
        gate.set()
        await d.settle()
        await d.run(1)  # 13: still due (the refusals did not reset the cadence): captured
        await d.settle()
    rows = await effect_rows(mem_run)
    assert keys(rows) == boundary_keys(1, 13)
    assert d.writer.stats.committed == 2


async def test_the_pending_effects_bound_forces_a_durable_capture(mem_run: RunCtx) -> None:
    config = CheckpointSettings(every_steps=0, max_pending_effects=8)
    async with driven(mem_run, config) as d:
        await d.run(7)
        assert await effect_rows(mem_run) == [], "cadence 0: nothing durable yet"
        await d.run(1)  # boundary 8 fills the buffer: a forced durable capture, awaited
        assert d.blocked == [8]
        assert keys(await effect_rows(mem_run)) == boundary_keys(1, 8)
        assert any(line.startswith("captured:ck-e1-1-forced@8")
                   for line in d.h.coordinator.audit.entries())
        assert len(d.writer.pending) == 0
        await d.run(3)
        assert keys(await effect_rows(mem_run)) == boundary_keys(1, 8)


@pytest.mark.parametrize("every", [1, 7, 0])
async def test_cadence_never_changes_behaviour(every: int, mem_run: RunCtx) -> None:
    async with SessionHarness.start(Fixture()) as reference:
        await reference.bootstrap()
        await reference.run(20)
        clean = reference.coordinator.trace.behaviour()
    async with driven(mem_run, CheckpointSettings(every_steps=every)) as d:
        await d.run(20)
        await d.final()
        assert d.h.coordinator.trace.behaviour() == clean
    rows = [e for e in mem_run.mem.dump()["effects"]  # type: ignore[union-attr]
            if e["run_id"] == mem_run.run_id and e["boundary"] is not None]
    rows.sort(key=lambda e: e["boundary"])
    assert [e["payload"] for e in rows] == d.records
    assert [e["boundary"] for e in rows] == list(range(1, 21))


@pytest.mark.parametrize(("line", "key"), [
    ("every_steps = -1", "every_steps"),
    ("every_seconds = nan", "every_seconds"),
    ("keep_generations = 0", "keep_generations"),
    ("queue_capacity = 17", "queue_capacity"),
    ("bogus_key = 1", "bogus_key"),
])
def test_cadence_configuration_is_validated(tmp_path: Path, line: str, key: str) -> None:
    config = tmp_path / "flyd.toml"
    config.write_text(f"[checkpoints]\n{line}\n")
    out = subprocess.run([sys.executable, "-m", "flyd", "config", "show", "--json",
                          "--config", str(config)], cwd=ROOT, capture_output=True,
                         timeout=60, check=False)
    assert out.returncode == 2, out.stdout
    error = orjson.loads(out.stdout)["error"]
    assert error["code"] == "CONFIG" and key in error["message"]
    assert str(config) in error["message"]
    with pytest.raises(CadenceError):
        Cadence(every_steps=-1, every_seconds=0)


def test_a_run_spec_overrides_the_node_cadence() -> None:
    node = CheckpointSettings(every_steps=60, keep_generations=3)
    spec = RunSpec.validate({"steps": "10", "checkpoints": {"everySteps": 5,
                                                            "keepGenerations": 2}})
    merged = writer_config(node, spec)
    assert (merged.every_steps, merged.keep_generations) == (5, 2)
    plain = writer_config(node, RunSpec.validate({"steps": "10"}))
    assert (plain.every_steps, plain.keep_generations) == (60, 3)


async def test_a_capture_over_the_envelope_limit_names_both_sizes(mem_run: RunCtx) -> None:
    """A hot capture over `max_envelope_bytes` is abandoned and stepping goes on; a forced one
    can never commit and raises `CheckpointTooLarge`; a final one returns `TooLarge`; both carry
    the outcome the run ends `failed` with, `{error, byteLength, limit}` (state.md §5.2)."""
    limit = 64
    config = CheckpointSettings(every_steps=2, max_pending_effects=6)
    # The configured floor is 1 MiB (§6); a synthetic capture is a few KiB, so the limit is set
    # below the floor here to make every capture too large.
    object.__setattr__(config, "max_envelope_bytes", limit)
    async with driven(mem_run, config) as d:
        await d.run(5)                     # hot captures at 2 and 4, each refused at submit
        assert d.writer.stats.rejected >= 2
        with pytest.raises(CheckpointTooLarge) as forced:
            await d.run(1)                 # boundary 6 fills the buffer: a forced capture
        refused = forced.value.refused
        assert refused.byte_length > limit and refused.limit == limit
        assert refused.outcome() == {"error": "checkpoint too large",
                                     "byteLength": refused.byte_length, "limit": limit}
        final = await d.durability.durable(d.h.coordinator, "final",
                                           finish=FinishRun("succeeded", {}, 6, 1))
        assert isinstance(final, TooLarge) and final.limit == limit
        assert final.outcome()["byteLength"] == final.byte_length > limit
        assert await effect_rows(mem_run) == [], "nothing of a refused capture is durable"


async def test_a_capture_a_participant_refuses_is_returned_naming_it(mem_run: RunCtx) -> None:
    """A capture the world refuses with the epoch intact (mutation `none`): hot ones are
    skipped and stepping goes on; a forced one raises `CaptureRefused`, a final one returns the
    `Refusal`; both carry the world's `SessionFailure`, which the grant puts in the run's
    outcome. `BACKEND_FAILURE` may pass on another attempt; `UNSUPPORTED` would not."""
    config = CheckpointSettings(every_steps=2, max_pending_effects=6)
    fixture = Fixture(faults={"arena": Faults(fail_capture=True)})
    async with driven(mem_run, config, fixture=fixture) as d:
        await d.run(5)                     # hot captures at 2 and 4, each refused
        with pytest.raises(CaptureRefused) as forced:
            await d.run(1)                 # boundary 6 fills the buffer: a forced capture
        final = await d.durability.durable(d.h.coordinator, "final",
                                           finish=FinishRun("succeeded", {}, 6, 1))
        assert isinstance(final, Refusal) and not d.h.coordinator.fenced
        for refusal in (forced.value.refusal, final):
            failure = refusal.failure
            assert (failure.participant, failure.code, failure.mutation, failure.message) == (
                "arena", ErrorCode.BACKEND_FAILURE, Mutation.NONE, "injected capture failure")
            assert not capture_repeats(failure.error)
        assert forced.value.refusal.checkpoint_id.endswith("-forced")
        assert final.checkpoint_id.endswith("-final")
        assert await effect_rows(mem_run) == [], "nothing of a refused capture is durable"
