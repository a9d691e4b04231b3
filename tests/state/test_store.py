"""The checkpoint store (state.md §4; §10 tests 22–34). Tests 22–27 and 30 run on PostgreSQL
and on the memory store (`run_ctx`); the others on PostgreSQL (`claimed_run`)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import psycopg
import pytest
from structlog.testing import capture_logs

from flyd.leases.stores import pg as pgstore
from flyd.leases.stores.contract import Commit, Fenced, HeadRegression
from flyd.state.checkpoints import (
    CheckpointRecord,
    CommitFailure,
    CommitFaults,
    DirectCommitPath,
    FinishRun,
    IntegrityError,
    PgCheckpointStore,
    verify_file,
)
from flyd.state.envelope import EnvelopeError, encode
from flyd.state.writer import (
    CaptureSubmission,
    CheckpointSettings,
    CheckpointWriter,
    Failed,
)
from tests.state.conftest import (
    NODE,
    OTHER,
    ExpiringPath,
    RunCtx,
    behaviour,
    effect_rows,
    make_capture,
    make_job,
    run_state,
)
from workers.types.domain import DomainError, ErrorCode, Mutation

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint-envelope.json"


async def stored_ids(ctx: RunCtx) -> list[str]:
    return [r.checkpoint_id for r in await ctx.store.list(ctx.run_id)]


# 22
async def test_rows_are_immutable_and_the_head_never_moves_back(run_ctx: RunCtx) -> None:
    ctx = run_ctx
    await ctx.store.commit(make_job(ctx.run_id, 1, "ck-4", 4), ctx.path)
    before = await ctx.store.list(ctx.run_id)
    assert await ctx.update_checkpoint_row("ck-4") == "LF004"
    lower = make_job(ctx.run_id, 1, "ck-2", 2, after=4)
    with pytest.raises(HeadRegression) as info:
        await ctx.lease.commit(Commit(ctx.run_id, 1, NODE, (), lower.checkpoint()))
    assert info.value.code == "LF002"
    assert await ctx.store.list(ctx.run_id) == before
    head = await ctx.store.head(ctx.run_id)
    assert head is not None and (head.checkpoint_id, head.boundary) == ("ck-4", 4)


# 23
async def test_a_commit_stores_moves_the_head_and_records_covered_effects(run_ctx: RunCtx
                                                                          ) -> None:
    ctx = run_ctx
    first = await ctx.store.commit(make_job(ctx.run_id, 1, "ck-4", 4), ctx.path)
    assert first.is_head and first.boundary == 4 and first.session_epoch == "e1"
    second = await ctx.store.commit(make_job(ctx.run_id, 1, "ck-7", 7, after=4), ctx.path)
    assert second.is_head and ctx.store.commits == 2
    rows = await ctx.store.list(ctx.run_id)
    assert [(r.checkpoint_id, r.boundary, r.is_head) for r in rows] == [
        ("ck-7", 7, True), ("ck-4", 4, False)]
    head = await ctx.store.head(ctx.run_id)
    assert head == second
    expected = sorted((f"boundary-{j}", 1, "ck-4" if j <= 4 else "ck-7") for j in range(1, 8))
    assert await effect_rows(ctx) == expected


# 24
async def test_rotation_keeps_three_generations_and_never_the_head(run_ctx: RunCtx) -> None:
    ctx = run_ctx
    for n in range(1, 6):
        await ctx.store.commit(make_job(ctx.run_id, 1, f"ck-{n}", n, after=n - 1), ctx.path)
        await ctx.advance(1)
    assert await stored_ids(ctx) == ["ck-5", "ck-4", "ck-3"]
    keep_one = DirectCommitPath(ctx.lease, ctx.run_id, 1, NODE, keep=1)
    await ctx.store.commit(make_job(ctx.run_id, 1, "ck-6", 6, after=5, keep=1), keep_one)
    assert await stored_ids(ctx) == ["ck-6"]
    # the clock stands still: four generations at one boundary tie on (boundary, committed_at)
    for n in range(7, 11):
        await ctx.store.commit(make_job(ctx.run_id, 1, f"ck-{n}", 6, after=6, keep=1),
                               keep_one)
        head = await ctx.store.head(ctx.run_id)
        assert head is not None and head.checkpoint_id == f"ck-{n}"
        assert await stored_ids(ctx) == [f"ck-{n}"]


# 25
async def test_a_stale_lease_epoch_cannot_commit(run_ctx: RunCtx) -> None:
    ctx = run_ctx
    assert await ctx.reclaim() == 2
    calls = 0
    original = ctx.path.commit

    async def counting(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        await original(*args, **kwargs)

    ctx.path.commit = counting  # type: ignore[method-assign]
    config = CheckpointSettings(retry="retry", retry_attempts=3, retry_backoff_s=0.01)
    writer = CheckpointWriter(ctx.store, ctx.path, config)
    pending = writer.pending
    for j in range(1, 4):
        pending.append(j, "e1", behaviour(j))
    manifest, payloads = make_capture("ck-3", 3)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(writer.run())
        ticket = writer.submit(writer.reserve(), CaptureSubmission(
            "ck-3", 3, "e1", "ep-1", manifest, payloads, replaceable=False))
        outcome = await writer.wait(ticket, 10)
        await writer.shutdown()
    assert outcome == Failed("ck-3", "fenced")
    assert calls == 1
    assert await stored_ids(ctx) == [] and await effect_rows(ctx) == []
    assert len(pending) == 3


# 26
async def test_a_commit_outliving_its_lease_is_rejected_at_commit(run_ctx: RunCtx) -> None:
    ctx = run_ctx
    with pytest.raises(CommitFailure) as info:
        await ctx.store.commit(make_job(ctx.run_id, 1, "ck-1", 1), ExpiringPath(ctx))
    assert info.value.reason == "fenced"
    cause = info.value.__cause__
    assert isinstance(cause, Fenced) and cause.code == "LF001"        # the deferred fence
    assert await stored_ids(ctx) == []
    assert await ctx.store.head(ctx.run_id) is None
    assert ctx.store.commits == 0


# 27
async def test_a_reused_checkpoint_id_is_refused_not_replaced(run_ctx: RunCtx) -> None:
    ctx = run_ctx
    stored = await ctx.store.commit(make_job(ctx.run_id, 1, "ck-a", 4), ctx.path)
    data_before, _ = await ctx.store.read_bytes(stored)
    again = make_job(ctx.run_id, 1, "ck-a", 5, after=4)
    with pytest.raises(CommitFailure) as info:
        await ctx.store.commit(again, ctx.path)
    assert info.value.reason == "reused id"
    assert info.value.code == ErrorCode.INTERNAL and not info.value.retryable
    assert "ck-a" in info.value.message
    after = await ctx.store.lookup(ctx.run_id, "ck-a")
    assert after == stored
    assert (await ctx.store.read_bytes(stored))[0] == data_before
    assert [k for k, _, _ in await effect_rows(ctx)] == [f"boundary-{j}" for j in range(1, 5)]


# 28
async def test_a_duplicate_effect_aborts_the_commit_and_fails_the_run(claimed_run: RunCtx
                                                                      ) -> None:
    ctx = claimed_run
    assert ctx.admin is not None
    await ctx.admin.execute(
        "INSERT INTO flyd.effects (run_id, effect_key, lease_epoch, node_id, session_epoch, "
        "boundary, payload, payload_digest) VALUES (%s, 'boundary-5', 1, %s, 1, 5, "
        "'{}'::jsonb, %s)", (ctx.run_id, NODE, b"\x00" * 32))
    with capture_logs() as logs, pytest.raises(CommitFailure) as info:
        await ctx.store.commit(make_job(ctx.run_id, 1, "ck-7", 7), ctx.path)
    assert info.value.reason == "effect_conflict" and not info.value.retryable
    assert any(e["event"] == "effect_conflict" and e["key"] == "boundary-5" for e in logs)
    assert await stored_ids(ctx) == []
    keys = [k for k, _, _ in await effect_rows(ctx)]
    assert keys == ["boundary-5", "finish"]
    state, outcome = await run_state(ctx)
    assert state == "failed"
    assert outcome is not None and outcome["error"] == "effect_conflict"
    assert outcome["key"] == "boundary-5"
    assert await ctx.lease.claim(NODE, 1, 60.0) == []       # failed is terminal: no recovery


async def rewrite_row(ctx: RunCtx, record: CheckpointRecord, **columns: Any) -> None:
    """Delete and re-insert one generation with some columns changed, in one fenced
    transaction (its deferred fence and foreign key checked at COMMIT)."""
    assert ctx.admin is not None
    cur = await ctx.admin.execute(
        "SELECT * FROM flyd.checkpoints WHERE run_id = %s AND checkpoint_id = %s",
        (ctx.run_id, record.checkpoint_id), binary=True)
    row = await cur.fetchone()
    assert row is not None and cur.description is not None
    values = dict(zip([d.name for d in cur.description], row, strict=True))
    values.update(columns)
    values.pop("committed_at")
    names = list(values)
    async with ctx.admin.transaction():
        await ctx.admin.execute("DELETE FROM flyd.checkpoints WHERE run_id = %s "
                                "AND checkpoint_id = %s", (ctx.run_id, record.checkpoint_id))
        await ctx.admin.execute(
            f"INSERT INTO flyd.checkpoints ({', '.join(names)}) "
            f"VALUES ({', '.join('%s' for _ in names)})", [values[n] for n in names])


# 29
async def test_read_checks_every_integrity_rule(claimed_run: RunCtx) -> None:
    ctx = claimed_run
    store = ctx.store
    first = await store.commit(make_job(ctx.run_id, 1, "ck-1", 1), ctx.path)
    for n in range(2, 5):
        await ctx.advance(1)
        await store.commit(make_job(ctx.run_id, 1, f"ck-{n}", n, after=n - 1), ctx.path)

    async def check_of(record: CheckpointRecord) -> str:
        with pytest.raises(IntegrityError) as info:
            await store.read(record)
        err = info.value
        assert (err.code, err.mutation) == (ErrorCode.INCOMPATIBLE_STATE, Mutation.NONE)
        assert err.message.startswith(
            f"checkpoint {record.checkpoint_id} of run {ctx.run_id}: {err.check}: ")
        return err.check

    assert await check_of(first) == "S1"                    # rotated away

    head = await store.select(ctx.run_id)
    env = await store.read(head)
    assert env.checkpoint_id == "ck-4"
    good, _ = await store.read_bytes(head)

    await rewrite_row(ctx, head, envelope=good[:-8])        # truncated bytea
    assert await check_of(head) == "S2"

    flipped = bytearray(good)
    flipped[100] ^= 0xFF
    await rewrite_row(ctx, head, envelope=bytes(flipped))    # same length, other bytes
    assert await check_of(head) == "S3"

    await rewrite_row(ctx, head, envelope=bytes(flipped),
                      envelope_digest=hashlib.sha256(bytes(flipped)).digest())
    with pytest.raises(IntegrityError) as info:
        await store.read(head)
    assert info.value.check == "S4" and "envelope R" in info.value.message

    for column, value, named in [
        ("checkpoint_id", None, "checkpointId"),
        ("session_id", "other", "sourceScope.sessionId"),
        ("session_epoch", 2, "sourceScope.epoch"),
        ("boundary", 3, "sourceScope.step"),
        ("episode_id", "ep-2", "episodeId"),
        ("compatibility_digest", "0" * 64, "digest_of(compatibility)"),
    ]:
        await rewrite_row(ctx, head, envelope=good,
                          envelope_digest=hashlib.sha256(good).digest(),
                          session_id="demo", session_epoch=1, boundary=4, episode_id="ep-1",
                          compatibility_digest=head.compatibility_digest)
        if column == "checkpoint_id":
            # another generation's bytes under this id
            other = await store.lookup(ctx.run_id, "ck-3")
            assert other is not None
            data3, _ = await store.read_bytes(other)
            await rewrite_row(ctx, head, envelope=data3,
                              envelope_digest=hashlib.sha256(data3).digest(), boundary=3)
            target = replace(head, boundary=3)
        else:
            await rewrite_row(ctx, head, **{column: value})
            target = head
        with pytest.raises(IntegrityError) as info:
            await store.read(target)
        assert info.value.check == "S5", column
        assert f"row's {column}" in info.value.message and named in info.value.message


# 30
async def test_select_names_the_head_and_refuses_the_unknown(run_ctx: RunCtx) -> None:
    ctx = run_ctx
    with pytest.raises(DomainError) as info:
        await ctx.store.select(ctx.run_id)
    assert (info.value.code, info.value.message) == (
        ErrorCode.INCOMPATIBLE_STATE, f"run {ctx.run_id} has no durable checkpoint")
    await ctx.store.commit(make_job(ctx.run_id, 1, "ck-2", 2), ctx.path)
    await ctx.advance(1)
    await ctx.store.commit(make_job(ctx.run_id, 1, "ck-5", 5, after=2), ctx.path)
    head = await ctx.store.select(ctx.run_id)
    assert (head.checkpoint_id, head.is_head) == ("ck-5", True)
    assert (await ctx.store.select(ctx.run_id, "ck-5", for_restore=True)) == head
    with pytest.raises(DomainError) as info:
        await ctx.store.select(ctx.run_id, "ck-9")
    assert (info.value.code, info.value.message) == (
        ErrorCode.INCOMPATIBLE_STATE, f"run {ctx.run_id} has no checkpoint ck-9")
    older = await ctx.store.select(ctx.run_id, "ck-2")           # export and inspection
    assert older.boundary == 2 and not older.is_head
    with pytest.raises(DomainError) as info:
        await ctx.store.select(ctx.run_id, "ck-2", for_restore=True)
    assert (info.value.code, info.value.mutation) == (ErrorCode.INVALID_ARGUMENT, Mutation.NONE)
    assert info.value.message == ("effects beyond boundary 2 are recorded; only the head can "
                                  "be resumed")


# 31
async def test_the_final_commit_finishes_the_run_in_the_same_transaction(claimed_run: RunCtx
                                                                         ) -> None:
    ctx = claimed_run
    await ctx.store.commit(make_job(ctx.run_id, 1, "ck-3", 3), ctx.path)
    outcome = {"boundary": 5, "advances": 5}
    final = make_job(ctx.run_id, 1, "ck-5-final", 5, after=3,
                     finish=FinishRun("succeeded", outcome, boundaries=5, session_epoch=1))
    faults = CommitFaults(abort_before_commit_for="ck-5-final")
    with pytest.raises(CommitFailure) as info:
        await ctx.store.commit(final, ctx.path, faults)
    assert info.value.reason == "aborted before commit"
    assert faults.fired == ["abort_before_commit:ck-5-final"]
    assert (await run_state(ctx))[0] == "running"
    assert await stored_ids(ctx) == ["ck-3"]
    assert [k for k, _, _ in await effect_rows(ctx)] == [f"boundary-{j}" for j in range(1, 4)]

    record = await ctx.store.commit(final, ctx.path)
    assert record.is_head and record.checkpoint_id == "ck-5-final"
    state, stored_outcome = await run_state(ctx)
    assert state == "succeeded" and stored_outcome == outcome
    rows = await effect_rows(ctx)
    assert [k for k, _, _ in rows] == [*(f"boundary-{j}" for j in range(1, 6)), "finish"]
    assert dict((k, c) for k, _, c in rows)["boundary-5"] == "ck-5-final"


# 32
async def test_an_unknown_outcome_is_resolved_by_id_not_by_a_second_save(claimed_run: RunCtx
                                                                         ) -> None:
    ctx = claimed_run
    sent: list[str] = []
    original = ctx.path.commit

    async def counting(*args: Any, **kwargs: Any) -> None:
        sent.append("commit")
        await original(*args, **kwargs)

    ctx.path.commit = counting  # type: ignore[method-assign]
    faults = CommitFaults(lose_commit_reply_for="ck-2")
    with capture_logs() as logs:
        record = await ctx.store.commit(make_job(ctx.run_id, 1, "ck-2", 2), ctx.path, faults)
    assert faults.fired == ["lose_commit_reply:ck-2"]
    assert [e["decision"] for e in logs if e["event"] == "checkpoint.resolved"] == ["committed"]
    assert record.checkpoint_id == "ck-2" and record.is_head
    assert ctx.store.commits == 1 and sent == ["commit"]
    assert await stored_ids(ctx) == ["ck-2"]
    assert [k for k, _, _ in await effect_rows(ctx)] == ["boundary-1", "boundary-2"]

    # absent and the grant live: the identical commit is sent again and lands once
    faults = CommitFaults(lose_commit_request_for="ck-4")
    with capture_logs() as logs:
        record = await ctx.store.commit(make_job(ctx.run_id, 1, "ck-4", 4, after=2), ctx.path,
                                        faults)
    assert faults.fired == ["lose_commit_request:ck-4"]
    assert [e["decision"] for e in logs if e["event"] == "checkpoint.resolved"] == ["retry"]
    assert record.checkpoint_id == "ck-4"
    assert ctx.store.commits == 2 and sent == ["commit", "commit"]
    assert await stored_ids(ctx) == ["ck-4", "ck-2"]
    assert [k for k, _, _ in await effect_rows(ctx)] == [f"boundary-{j}" for j in range(1, 5)]



async def test_an_unknown_outcome_waits_for_the_database_to_answer(claimed_run: RunCtx
                                                                  ) -> None:
    """The resolution read fails while the server is away (a restart): it is repeated, so a
    commit that landed is reported committed, never failed (its effects would otherwise be
    sent again under the next checkpoint id)."""
    ctx = claimed_run
    original = ctx.store._read_run
    failures = [DomainError(ErrorCode.BACKEND_FAILURE, "read run: server restarting",
                            Mutation.UNKNOWN)] * 2

    async def flaky(*args: Any) -> Any:
        if failures:
            raise failures.pop()
        return await original(*args)

    ctx.store._read_run = flaky  # type: ignore[method-assign]
    faults = CommitFaults(lose_commit_reply_for="ck-2")
    with capture_logs() as logs:
        record = await ctx.store.commit(make_job(ctx.run_id, 1, "ck-2", 2), ctx.path, faults)
    assert faults.fired == ["lose_commit_reply:ck-2"]
    assert [e["event"] for e in logs].count("checkpoint.resolve_retry") == 2
    assert [e["decision"] for e in logs if e["event"] == "checkpoint.resolved"] == ["committed"]
    assert record.checkpoint_id == "ck-2" and ctx.store.commits == 1
    assert await stored_ids(ctx) == ["ck-2"]

# 33 (store level: the library functions `flyctl checkpoints export` / `verify` call)
async def test_export_writes_the_stored_bytes_exactly(claimed_run: RunCtx,
                                                      tmp_path: Path) -> None:
    ctx = claimed_run
    store = ctx.store
    record = await store.commit(make_job(ctx.run_id, 1, "ck-3", 3), ctx.path)
    out = tmp_path / "ck.flysess"
    exported = await store.export(ctx.run_id, out)
    assert exported == record
    stored, _ = await store.read_bytes(record)
    assert out.read_bytes() == stored
    assert not (tmp_path / "ck.flysess.tmp").exists()
    assert verify_file(out).checkpoint_id == "ck-3"
    assert await store.verify_stored(ctx.run_id) == record
    assert await store.verify_stored(ctx.run_id, "ck-3") == record

    flipped = bytearray(stored)
    flipped[-60] ^= 0x01
    await rewrite_row(ctx, record, envelope=bytes(flipped))
    bad = tmp_path / "bad.flysess"
    with pytest.raises(IntegrityError) as info:
        await store.export(ctx.run_id, bad)
    assert info.value.check == "S3"
    assert not bad.exists() and not (tmp_path / "bad.flysess.tmp").exists()
    with pytest.raises(IntegrityError) as info:
        await store.verify_stored(ctx.run_id, "ck-3")
    assert ": S3: " in info.value.message


# 34 (store level)
async def test_import_creates_a_pending_run_and_refuses_a_granted_one(claimed_run: RunCtx,
                                                                      tmp_path: Path) -> None:
    ctx = claimed_run
    store = ctx.store
    assert isinstance(store, PgCheckpointStore)
    manifest, payloads = make_capture("ck-20", 20, session_epoch="e3")
    data = encode(manifest, payloads)
    record = await store.import_envelope(data, spec={"steps": 40})
    assert (record.lease_epoch, record.boundary, record.is_head) == (0, 20, True)
    assert record.session_epoch == "e3" and record.envelope_digest == (
        hashlib.sha256(data).hexdigest())
    assert ctx.admin is not None
    cur = await ctx.admin.execute("SELECT state::text, lease_epoch, spec FROM flyd.runs "
                                  "WHERE run_id = %s", (record.run_id,))
    row = await cur.fetchone()
    assert row is not None
    assert row[:2] == ("pending", 0)
    assert row[2]["startFrom"] == {"checkpointId": "ck-20",
                                   "envelopeDigest": hashlib.sha256(data).hexdigest()}
    head = await store.head(record.run_id)
    assert head == record
    assert (await store.read_bytes(record))[0] == data

    with pytest.raises(CommitFailure) as info:                # into a granted run
        await store.import_envelope(data, run_id=ctx.run_id)
    cause = info.value.__cause__
    assert info.value.reason == "fenced"
    assert isinstance(cause, psycopg.Error) and cause.sqlstate == "LF001"
    assert await stored_ids(ctx) == []

    corrupt = bytearray(data)
    corrupt[0:8] = b"OTHERFMT"
    path = tmp_path / "corrupt.flysess"
    path.write_bytes(bytes(corrupt))
    with pytest.raises(EnvelopeError) as env_info:
        verify_file(path)
    assert env_info.value.check == "R1" and "OTHERFMT" in env_info.value.message
    with pytest.raises(EnvelopeError) as env_info:
        await store.import_envelope(bytes(corrupt), spec={})
    assert env_info.value.check == "R1"


# 35
async def test_flyctl_checkpoints_json_output(claimed_run: RunCtx, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    import orjson

    ctx = claimed_run
    assert ctx.dsn is not None
    await ctx.store.commit(make_job(ctx.run_id, 1, "ck-3", 3), ctx.path)
    await ctx.store.commit(make_job(ctx.run_id, 1, "ck-6", 6, after=3), ctx.path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}

    async def flyctl(*args: str) -> tuple[int, dict[str, Any]]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "from flyd.cli.flyd import flyctl_main; flyctl_main()", *args,
            "--json", "--dsn", str(ctx.dsn), env=env, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        out, err = await proc.communicate()
        assert b"Traceback" not in out + err
        return int(proc.returncode or 0), orjson.loads(out)

    code, listed = await flyctl("checkpoints", "list", str(ctx.run_id))
    assert code == 0 and listed["run"] == ctx.run_id
    assert [(c["checkpointId"], c["boundary"], c["head"]) for c in listed["checkpoints"]] == [
        ("ck-6", 6, True), ("ck-3", 3, False)]
    assert all(c["sessionEpoch"] == "e1" and c["leaseEpoch"] == 1
               for c in listed["checkpoints"])
    out = tmp_path / "head.flysess"
    code, exported = await flyctl("checkpoints", "export", str(ctx.run_id), "-o", str(out))
    assert code == 0 and exported["checkpointId"] == "ck-6" and exported["boundary"] == 6
    assert exported["envelopeDigest"] == hashlib.sha256(out.read_bytes()).hexdigest()
    code, verified = await flyctl("checkpoints", "verify", str(out))
    assert (code, verified) == (0, {"ok": True, "check": None, "reason": None})
    code, stored = await flyctl("checkpoints", "verify", "--run", str(ctx.run_id), "--id",
                                "ck-3")
    assert code == 0 and stored["ok"] is True
    # the synthetic generation names no agents: no composition can install it, and the
    # import says so before it submits anything (an import keeps the file's composition)
    code, refused = await flyctl("checkpoints", "import", str(out), "--steps", "12")
    assert code == 2 and refused["error"]["code"] == "USAGE"
    assert "/agents" in refused["error"]["message"]
    real = tmp_path / "real.flysess"
    real.write_bytes(base64.b64decode(orjson.loads(FIXTURE.read_bytes())["envelope"]))
    code, imported = await flyctl("checkpoints", "import", str(real), "--steps", "12")
    assert code == 0 and imported["boundary"] == 2 and imported["checkpointId"] == "ckpt-1"
    assert imported["run"] != ctx.run_id


async def test_a_large_envelope_commits_and_a_refused_one_leaves_the_pool_usable(
        claimed_run: RunCtx, caplog: pytest.LogCaptureFixture) -> None:
    """A 64 MiB envelope, past `PIPELINE_MAX_BYTES`, commits within the commit bound (as one
    pipeline it never finished sending); the same commit refused as fenced is rolled back
    before its connection returns to the pool, and the pool's next commit goes through."""
    ctx = claimed_run
    manifest, payloads = make_capture("ck-big", 1, world=bytes(range(256)) * (1 << 18))
    envelope = encode(manifest, payloads)
    assert len(envelope) > 64 * (1 << 20) > pgstore.PIPELINE_MAX_BYTES
    job = replace(make_job(ctx.run_id, 1, "ck-big", 1), envelope=envelope,
                  envelope_digest=hashlib.sha256(envelope).digest())
    async with asyncio.timeout(60):
        record = await ctx.store.commit(job, ctx.path)
    assert record.is_head and record.byte_length == len(envelope)
    assert (await ctx.store.read_bytes(record))[0] == envelope
    epoch = await ctx.reclaim()
    stale = replace(job, checkpoint_id="ck-big-2", boundary=2, effects=())
    with caplog.at_level("WARNING", logger="psycopg.pool"), \
            pytest.raises(CommitFailure) as refused:
        await ctx.store.commit(stale, ctx.path)
    assert refused.value.reason == "fenced"
    assert not [r for r in caplog.records if "rolling back returned connection" in r.message], \
        "the refused transaction reached the pool still open"
    path = DirectCommitPath(ctx.lease, ctx.run_id, epoch, OTHER)
    after = await ctx.store.commit(make_job(ctx.run_id, epoch, "ck-3", 3, after=1), path)
    assert after.is_head and after.lease_epoch == epoch
