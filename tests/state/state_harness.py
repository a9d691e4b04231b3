"""`StateHarness` (state.md §10): the session harness plus a checkpoint store, a writer and the
run context of `claimed_run`, wired into the coordinator as its `StateContext`.

    async with StateHarness.start(claimed_run, Fixture(mode=...)) as s:
        await s.bootstrap()
        await s.run_and_checkpoint(2, "ckpt-1")
        await s.fail_the_epoch()
        await s.replace_all_participants()
        report = await s.coordinator.restore("ckpt-1", "e2")

Helpers: `run_and_checkpoint(n, id)` (steps to n, a durable checkpoint: `Committed(id, n)` and
`durable() == (id, n)`), `fail_the_epoch()` (kill fly-a; the next step fails naming it; fenced;
no media held), `replace_all_participants()`, `rewrite_generation(id, edit)` (decode, edit the
manifest and the ordered payloads, rebuild `payloads`, re-encode; delete and re-insert the row in
one fenced transaction) and `nothing_is_installed(epoch)` (no Status reports the epoch; `Failed`,
fenced; a step fails `INVALID_PHASE`).

`UnversionedBrain` is the fake brain without model and plasticity versions: its worker serves no
`State.*` and lacks `checkpoint-v1` (launched as `tests.state.state_harness:UnversionedBrain`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, ClassVar

import psycopg
import pytest

from flyd.launch.launcher import LaunchedWorker
from flyd.leases.stores import pg as pgstore
from flyd.session.coordinator import Coordinator
from flyd.session.fence import SessionFailure
from flyd.session.phase import Failed
from flyd.session.restore import StateContext
from flyd.state.effects import epoch_number
from flyd.state.envelope import decode, encode
from flyd.state.writer import CheckpointSettings, CheckpointWriter, Committed, WriterFaults
from tests.session.harness import WAIT, Fixture, SessionHarness, within
from tests.state.conftest import NODE, RunCtx
from workers.faults import Faults
from workers.launch import AgentSettings
from workers.synthetic.brain import FakeBrain
from workers.types.canonical import digest_bytes, digest_of
from workers.types.domain import ErrorCode

Edit = Callable[[dict[str, Any], dict[str, bytes]], None]


class UnversionedBrain(FakeBrain):
    """A model that declares no versions, so its worker is not checkpoint-capable."""

    model_version: ClassVar[str | None] = None  # type: ignore[misc]
    plasticity_version: ClassVar[str | None] = None  # type: ignore[misc]


class StateHarness:
    """A session with a checkpoint store, a running writer and a claimed run."""

    def __init__(self, h: SessionHarness, ctx: RunCtx, writer: CheckpointWriter) -> None:
        self.h = h
        self.ctx = ctx
        self.writer = writer
        self.faults = writer.faults
        self.attach(h.coordinator)

    @classmethod
    @asynccontextmanager
    async def start(cls, ctx: RunCtx, fixture: Fixture | None = None,
                    config: CheckpointSettings | None = None, faults: WriterFaults | None = None
                    ) -> AsyncIterator[StateHarness]:
        writer = CheckpointWriter(ctx.store, ctx.path, config or CheckpointSettings(),
                                  faults=faults)
        async with SessionHarness.start(fixture) as h, asyncio.TaskGroup() as tg:
            tg.create_task(writer.run())
            try:
                yield cls(h, ctx, writer)
            finally:
                if writer.faults.gate is not None:
                    writer.faults.gate.set()
                await writer.shutdown()

    def attach(self, coordinator: Coordinator) -> None:
        coordinator.state = StateContext(self.ctx.store, self.ctx.run_id, writer=self.writer)

    @property
    def coordinator(self) -> Coordinator:
        return self.h.coordinator

    async def bootstrap(self) -> None:
        await self.h.bootstrap()

    async def run_and_checkpoint(self, n: int, checkpoint_id: str) -> None:
        """Step to boundary n, then a durable checkpoint there."""
        c = self.coordinator
        boundary = c.committed_boundary()
        assert boundary is not None and boundary <= n
        if n > boundary:
            await self.h.run(n - boundary)
        outcome = await within(c.checkpoint(checkpoint_id))
        assert outcome == Committed(checkpoint_id, n), outcome
        assert c.durable() == (checkpoint_id, n)

    async def fail_the_epoch(self) -> SessionFailure:
        """Kill fly-a; the next step fails naming it; the epoch is fenced with no media held."""
        await self.h.kill("fly-a")
        with pytest.raises(SessionFailure) as info:
            await self.h.step()
        c = self.coordinator
        assert info.value.participant == "fly-a", info.value
        assert isinstance(c.phase, Failed) and c.fenced
        assert c.media.count() == 0
        return info.value

    async def replace_all_participants(self, faults: Faults | None = None) -> None:
        """Replace every participant (with `faults`, when given, instead of the launch's)."""
        if faults is None:
            await self.h.replace_all_participants()
            return
        for worker_id in self.h.spec.worker_ids():
            await self.replace_one(worker_id, faults)

    async def fresh_session(self, epoch: str = "e1") -> Coordinator:
        """New workers and a new coordinator over them (not bootstrapped), with this state."""
        for worker_id in self.h.spec.worker_ids():
            self.h.workers[worker_id] = await within(self.h.launched.restart(worker_id))
        coordinator = self.h.new_coordinator(epoch)
        self.h._coordinator = coordinator
        self.attach(coordinator)
        return coordinator

    async def replace_one(self, worker_id: str, faults: Faults | None = None,
                          **settings: Any) -> LaunchedWorker:
        """Restart one worker (optionally with other settings or faults) and hand it over."""
        launcher = self.h.launched
        plan = launcher._plans[worker_id]
        new_settings = replace(plan.settings, **settings) if settings else None
        launched = await within(launcher.restart(worker_id, new_settings, faults=faults))
        self.h.workers[worker_id] = launched
        self.coordinator.replace_participant(worker_id, launched.worker_ref())
        return launched

    async def replace_with_model(self, worker_id: str, model: str) -> LaunchedWorker:
        plan = self.h.launched._plans[worker_id]
        assert isinstance(plan.settings, AgentSettings)
        return await self.replace_one(worker_id, model=model)

    async def rewrite_generation(self, checkpoint_id: str, edit: Edit) -> None:
        """Decode the stored generation, edit it, re-encode it, and swap the row in one fenced
        transaction."""
        ctx = self.ctx
        record = await ctx.store.lookup(ctx.run_id, checkpoint_id)
        assert record is not None
        data, _ = await ctx.store.read_bytes(record)
        env = decode(data)
        manifest = dict(env.manifest)
        payloads = dict(env.payloads)
        edit(manifest, payloads)
        manifest["payloads"] = [{"name": name, "byteLength": str(len(body)),
                                 "digest": digest_bytes(body)}
                                for name, body in payloads.items()]
        envelope = encode(manifest, list(payloads.items()))
        assert ctx.dsn is not None
        async with await psycopg.AsyncConnection.connect(ctx.dsn, autocommit=True) as conn:
            base = {"run": ctx.run_id, "epoch": ctx.lease_epoch, "node": NODE,
                    "ckpt": checkpoint_id}
            await conn.execute("BEGIN")
            await conn.execute(pgstore.ASSERT_FENCE, base)
            await conn.execute("DELETE FROM flyd.checkpoints WHERE run_id = %(run)s AND "
                               "checkpoint_id = %(ckpt)s", base)
            await conn.execute(pgstore.INSERT_CHECKPOINT, {
                **base, "session_id": manifest["sourceScope"]["sessionId"],
                "session_epoch": epoch_number(manifest["sourceScope"]["epoch"]),
                "episode_id": manifest["episodeId"],
                "boundary": int(manifest["sourceScope"]["step"]),
                "compat": digest_of(manifest["compatibility"]),
                "env_digest": hashlib.sha256(envelope).digest(),
                "byte_length": len(envelope), "envelope": envelope})
            await conn.execute("COMMIT")

    async def statuses(self) -> dict[str, dict[str, Any]]:
        return {w: await self.h.status_of(w) for w in self.h.spec.worker_ids()}

    async def nothing_is_installed(self, epoch: str) -> None:
        """No Status reports `epoch`; `Failed` and fenced; a step fails `INVALID_PHASE`."""
        for worker, status in (await self.statuses()).items():
            scope = status.get("currentScope")
            assert scope is None or scope["epoch"] != epoch, (worker, status)
        c = self.coordinator
        assert isinstance(c.phase, Failed) and c.fenced
        with pytest.raises(SessionFailure) as info:
            await within(c.step(), WAIT)
        assert info.value.code == ErrorCode.INVALID_PHASE
