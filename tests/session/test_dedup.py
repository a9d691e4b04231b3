"""The pure result cache (session.md §2.4; §8 tests 12-19)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from workers.dedup import (
    MAX_UNACKNOWLEDGED,
    Execute,
    OpClass,
    Refuse,
    Replay,
    ResultCache,
    StepKey,
    Ticket,
    class_of,
)
from workers.types.canonical import body_digest
from workers.types.domain import DomainError, ErrorCode, Mutation, Scope, format_request_id
from workers.types.rpc import Outcome

SESSION = "demo"
WORKER = "fly-a"
INCARNATION = "fly-a-inc-1"
PREPARE = "Agent.Prepare"
COMMIT = "Agent.Commit"


def scope(step: int, epoch: str = "e1") -> Scope:
    return Scope(SESSION, epoch, step)


def digest(step: int, method: str = PREPARE, body: str = "a", epoch: str = "e1") -> str:
    return body_digest(method, scope(step, epoch), {"agentId": WORKER, "body": body})


def result(request_id: str, step: int | None, tag: str = "ok", epoch: str = "e1") -> Outcome:
    return Outcome(
        request_id, WORKER, INCARNATION, None if step is None else scope(step, epoch),
        result={"tag": tag},
    )


def failure(request_id: str, step: int, mutation: str) -> Outcome:
    error = DomainError("BACKEND_FAILURE", "injected commit failure", mutation)
    return Outcome(request_id, WORKER, INCARNATION, scope(step), error=error)


def fresh(epoch: str | None = "e1") -> ResultCache[Outcome]:
    cache: ResultCache[Outcome] = ResultCache(WORKER)
    if epoch is not None:
        cache.adopt_epoch(epoch)
    return cache


def execute(admission: object) -> Ticket:
    assert isinstance(admission, Execute), admission
    return admission.ticket


def refused(admission: object, code: ErrorCode, mutation: Mutation = Mutation.NONE) -> None:
    assert isinstance(admission, Refuse), admission
    assert admission.error.code == code, admission.error
    assert admission.error.mutation == mutation, admission.error


def run_step(
    cache: ResultCache[Outcome], step: int, rid: str, method: str = PREPARE, body: str = "a"
) -> Outcome:
    ticket = execute(cache.admit_step(scope(step), method, rid, digest(step, method, body)))
    outcome = result(rid, step)
    cache.complete(ticket, outcome)
    return outcome


def test_the_same_key_request_and_body_replays() -> None:
    cache = fresh()
    outcome = run_step(cache, 0, "req-1")
    again = cache.admit_step(scope(0), PREPARE, "req-1", digest(0))
    assert isinstance(again, Replay)
    assert again.outcome is outcome
    assert again.outcome.to_json() == outcome.to_json()
    assert again.record.request_id == "req-1" and again.record.step == 0
    # replays change nothing: a third admission replays the same record
    third = cache.admit_step(scope(0), PREPARE, "req-1", digest(0))
    assert isinstance(third, Replay) and third.record == again.record
    assert cache.active is None

    # a lifecycle request replays the same way until acknowledged
    ticket = execute(cache.admit_lifecycle("req-2", digest(0, "Agent.Initialize")))
    init = result("req-2", 0, "initialized")
    cache.complete(ticket, init)
    replay = cache.admit_lifecycle("req-2", digest(0, "Agent.Initialize"))
    assert isinstance(replay, Replay) and replay.outcome is init


def test_a_changed_body_or_request_for_a_recorded_key_is_a_conflict() -> None:
    cache = fresh()
    outcome = run_step(cache, 0, "req-1")
    key = StepKey(SESSION, "e1", 0, PREPARE, WORKER)
    record = cache.step_records()[key]

    refused(cache.admit_step(scope(0), PREPARE, "req-1", digest(0, body="b")), ErrorCode.CONFLICT)
    refused(cache.admit_step(scope(0), PREPARE, "req-2", digest(0)), ErrorCode.CONFLICT)
    refused(cache.admit_step(scope(0), PREPARE, "req-3", digest(0, body="b")),
            ErrorCode.CONFLICT)
    # the earlier result stands
    assert cache.step_records()[key] == record
    assert cache.active is None
    replay = cache.admit_step(scope(0), PREPARE, "req-1", digest(0))
    assert isinstance(replay, Replay) and replay.outcome is outcome

    # lifecycle: the same request id with another body
    ticket = execute(cache.admit_lifecycle("req-4", digest(0, "State.Capture")))
    cache.complete(ticket, result("req-4", 0))
    refused(cache.admit_lifecycle("req-4", digest(0, "State.Capture", "b")), ErrorCode.CONFLICT)
    assert cache.lifecycle_records()["req-4"].digest == digest(0, "State.Capture")


def test_a_duplicate_while_the_original_runs_is_in_progress() -> None:
    cache = fresh()
    ticket = execute(cache.admit_step(scope(0), PREPARE, "req-1", digest(0)))
    assert cache.active == ticket

    refused(cache.admit_step(scope(0), PREPARE, "req-1", digest(0)), ErrorCode.IN_PROGRESS)
    refused(cache.admit_step(scope(0), PREPARE, "req-1", digest(0, body="b")),
            ErrorCode.CONFLICT)
    refused(cache.admit_step(scope(0), PREPARE, "req-2", digest(0)), ErrorCode.CONFLICT)
    refused(cache.admit_step(scope(0), COMMIT, "req-2", digest(0, COMMIT)), ErrorCode.BUSY)
    refused(cache.admit_step(scope(1), PREPARE, "req-2", digest(1)), ErrorCode.BUSY)
    refused(cache.admit_lifecycle("req-2", digest(0, "State.Capture")), ErrorCode.BUSY)
    # a request of a foreign epoch still meets the active rule
    refused(cache.admit_step(scope(0, "e0"), PREPARE, "req-2", digest(0, epoch="e0")),
            ErrorCode.BUSY)
    assert cache.active == ticket  # refusals start nothing
    cache.complete(ticket, result("req-1", 0))

    # a running lifecycle operation
    life = execute(cache.admit_lifecycle("req-5", digest(0, "State.Capture")))
    refused(cache.admit_lifecycle("req-5", digest(0, "State.Capture")), ErrorCode.IN_PROGRESS)
    refused(cache.admit_lifecycle("req-5", digest(0, "State.Capture", "b")), ErrorCode.CONFLICT)
    refused(cache.admit_lifecycle("req-6", digest(0, "State.Capture")), ErrorCode.BUSY)
    refused(cache.admit_step(scope(0), COMMIT, "req-6", digest(0, COMMIT)), ErrorCode.BUSY)
    cache.abandon(life)
    assert cache.active is None


def test_an_evicted_step_gives_result_expired_and_a_fresh_serial_gives_stale_step() -> None:
    cache = fresh()
    outcomes = {step: run_step(cache, step, f"req-{step + 1}") for step in range(4)}
    assert cache.highest_step == 3
    assert cache.highest_serial == 4
    assert sorted(key.step for key in cache.step_records()) == [2, 3]

    refused(cache.admit_step(scope(1), PREPARE, "req-2", digest(1)),
            ErrorCode.RESULT_EXPIRED, Mutation.UNKNOWN)
    refused(cache.admit_step(scope(1), PREPARE, "req-5", digest(1)), ErrorCode.STALE_STEP)
    refused(cache.admit_step(scope(0), COMMIT, "req-6", digest(0, COMMIT)),
            ErrorCode.STALE_STEP)
    for step in (2, 3):
        replay = cache.admit_step(scope(step), PREPARE, f"req-{step + 1}", digest(step))
        assert isinstance(replay, Replay)
        assert replay.outcome is outcomes[step]
    # the watermarks moved nothing on refusals
    assert (cache.highest_step, cache.highest_serial) == (3, 4)

    # an eviction by a test never re-enables execution either
    cache.expire_step(3)
    assert cache.step_records() == {}
    refused(cache.admit_step(scope(3), PREPARE, "req-4", digest(3)),
            ErrorCode.RESULT_EXPIRED, Mutation.UNKNOWN)
    refused(cache.admit_step(scope(2), PREPARE, "req-7", digest(2)), ErrorCode.STALE_STEP)
    execute(cache.admit_step(scope(4), PREPARE, "req-8", digest(4)))


def test_a_none_failure_frees_the_key_and_an_applied_failure_replays() -> None:
    cache = fresh()
    # a `none` failure: abandon, nothing stored, a corrected body executes
    ticket = execute(cache.admit_step(scope(0), PREPARE, "req-1", digest(0, body="bad")))
    cache.abandon(ticket)
    assert cache.step_records() == {} and cache.active is None
    corrected = execute(cache.admit_step(scope(0), PREPARE, "req-2", digest(0, body="good")))
    cache.complete(corrected, result("req-2", 0))

    # an `applied` failure is stored and replayed identically
    commit = execute(cache.admit_step(scope(0), COMMIT, "req-3", digest(0, COMMIT)))
    failed = failure("req-3", 0, "applied")
    cache.complete(commit, failed)
    replay = cache.admit_step(scope(0), COMMIT, "req-3", digest(0, COMMIT))
    assert isinstance(replay, Replay)
    assert replay.outcome is failed
    assert replay.outcome.to_json() == failed.to_json()
    assert replay.outcome.to_json()["error"]["mutation"] == "applied"

    # the same request id and body after an abandon executes again (the key is free)
    again = execute(cache.admit_step(scope(1), PREPARE, "req-4", digest(1)))
    cache.abandon(again)
    execute(cache.admit_step(scope(1), PREPARE, "req-4", digest(1)))

    # a ticket that is not the active one is an invariant violation, and changes nothing
    with pytest.raises(DomainError) as info:
        cache.abandon(ticket)
    assert info.value.code == ErrorCode.INTERNAL
    assert cache.active is not None


def test_lifecycle_replies_are_kept_until_acknowledged() -> None:
    cache = fresh(None)
    method = "Agent.Initialize"
    outcomes: dict[str, Outcome] = {}
    for n in range(1, MAX_UNACKNOWLEDGED + 1):
        rid = format_request_id(n)
        ticket = execute(cache.admit_lifecycle(rid, digest(0, method, rid)))
        outcomes[rid] = result(rid, 0, rid)
        cache.complete(ticket, outcomes[rid])
    assert cache.unacknowledged == MAX_UNACKNOWLEDGED
    # replay before acknowledgement
    replay = cache.admit_lifecycle("req-1", digest(0, method, "req-1"))
    assert isinstance(replay, Replay) and replay.outcome is outcomes["req-1"]
    # the 17th unacknowledged -> BUSY, nothing started
    refused(cache.admit_lifecycle("req-17", digest(0, method, "req-17")), ErrorCode.BUSY)
    assert cache.active is None

    # acknowledge drops the named records, in request order; unknown and repeats ignored
    dropped = cache.acknowledge(["req-3", "req-1", "req-99", "req-3", "req-2"])
    assert dropped == ["req-3", "req-1", "req-2"]
    assert cache.acknowledged_serial == 3
    assert cache.acknowledge(["req-3", "req-1"]) == []
    assert cache.unacknowledged == MAX_UNACKNOWLEDGED - 3
    # an acknowledged serial replayed -> RESULT_EXPIRED/unknown
    refused(cache.admit_lifecycle("req-1", digest(0, method, "req-1")),
            ErrorCode.RESULT_EXPIRED, Mutation.UNKNOWN)
    # the still unacknowledged ones replay; capacity is free again
    assert isinstance(cache.admit_lifecycle("req-4", digest(0, method, "req-4")), Replay)
    cache.abandon(execute(cache.admit_lifecycle("req-17", digest(0, method, "req-17"))))

    # a step request with serial <= A -> RESULT_EXPIRED/unknown
    cache.adopt_epoch("e1")
    refused(cache.admit_step(scope(0), PREPARE, "req-2", digest(0)),
            ErrorCode.RESULT_EXPIRED, Mutation.UNKNOWN)
    execute(cache.admit_step(scope(0), PREPARE, "req-18", digest(0)))


def test_a_new_epoch_starts_a_new_step_table() -> None:
    cache = fresh("e1")
    for step in range(11):
        run_step(cache, step, f"req-{step + 1}")
    assert (cache.epoch, cache.highest_step) == ("e1", 10)
    e1_records = cache.step_records()

    cache.adopt_epoch("e2")
    assert (cache.epoch, cache.highest_step, cache.highest_serial) == ("e2", None, 11)
    assert cache.step_records() == {}
    # step 0 executes in e2 though W was 10 in e1
    ticket = execute(cache.admit_step(scope(0, "e2"), PREPARE, "req-12", digest(0, epoch="e2")))
    assert ticket.recorded
    e2_outcome = result("req-12", 0, epoch="e2")
    cache.complete(ticket, e2_outcome)
    assert cache.highest_step == 0

    # an e1 request is never matched against e2 records and is never recorded
    e1_key = StepKey(SESSION, "e1", 10, PREPARE, WORKER)
    assert e1_key in e1_records
    stale = execute(cache.admit_step(scope(10), PREPARE, "req-11", digest(10)))
    assert not stale.recorded
    cache.complete(stale, result("req-11", 10, "stale-epoch"))
    same_step = execute(cache.admit_step(scope(0), PREPARE, "req-13", digest(0)))
    assert not same_step.recorded
    cache.complete(same_step, result("req-13", 0))
    assert list(cache.step_records()) == [StepKey(SESSION, "e2", 0, PREPARE, WORKER)]
    assert cache.highest_step == 0
    replay = cache.admit_step(scope(0, "e2"), PREPARE, "req-12", digest(0, epoch="e2"))
    assert isinstance(replay, Replay) and replay.outcome is e2_outcome

    # before any adoption every step request is unrecorded
    unadopted = fresh(None)
    first = execute(unadopted.admit_step(scope(0), PREPARE, "req-1", digest(0)))
    assert not first.recorded
    unadopted.complete(first, result("req-1", 0))
    assert unadopted.step_records() == {} and unadopted.highest_step is None

    # an epoch is adopted once
    with pytest.raises(DomainError) as info:
        cache.adopt_epoch("e1")
    assert info.value.code == ErrorCode.INTERNAL


# --------------------------------------------------------------------------------------------
# test 19: a key executes again only after `abandon`


@dataclass(frozen=True)
class Sent:
    """A step request as sent, so that a rule can send it again unchanged."""

    step: int
    method: str
    number: int
    body: str
    epoch: str


class NoKeyRunsTwice(RuleBasedStateMachine):
    """Random admit/complete/abandon/ack/adopt/expire sequences against one cache."""

    sent = Bundle("sent")

    def __init__(self) -> None:
        super().__init__()
        self.cache = fresh("e1")
        self.epochs = 1
        # recorded keys that were executed and not abandoned
        self.live: set[tuple[str, object]] = set()

    def _admitted(self, admission: object) -> None:
        if isinstance(admission, Execute):
            ticket = admission.ticket
            if ticket.recorded:
                key = (ticket.op_class.value, ticket.key)
                assert key not in self.live, f"{key} executed twice"
                self.live.add(key)
            return
        assert isinstance(admission, Replay | Refuse)
        if isinstance(admission, Refuse):
            code = admission.error.code
            expected = Mutation.UNKNOWN if code == ErrorCode.RESULT_EXPIRED else Mutation.NONE
            assert admission.error.mutation == expected

    def _send(self, request: Sent) -> None:
        self._admitted(
            self.cache.admit_step(
                scope(request.step, request.epoch), request.method,
                format_request_id(request.number),
                digest(request.step, request.method, request.body, request.epoch),
            )
        )

    @rule(
        target=sent,
        step=st.integers(min_value=0, max_value=4),
        method=st.sampled_from([PREPARE, COMMIT]),
        number=st.integers(min_value=1, max_value=30),
        body=st.sampled_from(["a", "b"]),
        current=st.booleans(),
    )
    def admit_step(self, step: int, method: str, number: int, body: str, current: bool) -> Sent:
        epoch = self.epochs if current or self.epochs == 1 else self.epochs - 1
        request = Sent(step, method, number, body, f"e{epoch}")
        self._send(request)
        return request

    @rule(request=sent)
    def resend(self, request: Sent) -> None:
        self._send(request)

    @rule(number=st.integers(min_value=1, max_value=30), body=st.sampled_from(["a", "b"]))
    def admit_lifecycle(self, number: int, body: str) -> None:
        self._admitted(
            self.cache.admit_lifecycle(format_request_id(number), digest(0, "State.Capture", body))
        )

    @precondition(lambda self: self.cache.active is not None)
    @rule(applied=st.booleans())
    def complete(self, applied: bool) -> None:
        ticket = self.cache.active
        assert ticket is not None
        step = ticket.step or 0
        outcome = (failure(ticket.request_id, step, "applied") if applied
                   else result(ticket.request_id, step))
        self.cache.complete(ticket, outcome)

    @precondition(lambda self: self.cache.active is not None)
    @rule()
    def abandon(self) -> None:
        ticket = self.cache.active
        assert ticket is not None
        self.cache.abandon(ticket)
        self.live.discard((ticket.op_class.value, ticket.key))

    @rule(numbers=st.lists(st.integers(min_value=1, max_value=30), max_size=4))
    def acknowledge(self, numbers: list[int]) -> None:
        ids = [format_request_id(n) for n in numbers]
        before = set(self.cache.lifecycle_records())
        dropped = self.cache.acknowledge(ids)
        assert dropped == [i for i in dict.fromkeys(ids) if i in before]

    # only a lifecycle handler adopts an epoch, so never while a step mutation runs
    @precondition(
        lambda self: self.cache.active is None
        or self.cache.active.op_class == OpClass.LIFECYCLE
    )
    @rule()
    def adopt(self) -> None:
        self.epochs += 1
        self.cache.adopt_epoch(f"e{self.epochs}")

    @rule(step=st.integers(min_value=0, max_value=4))
    def expire(self, step: int) -> None:
        self.cache.expire_step(step)

    @invariant()
    def retention(self) -> None:
        cache = self.cache
        assert cache.unacknowledged <= MAX_UNACKNOWLEDGED
        recorded = [key.step for key in cache.step_records()]
        for key in cache.step_records():
            assert key.epoch == cache.epoch
            assert key.step >= max(recorded) - 1  # the current and previous step only
            assert cache.highest_step is not None and key.step <= cache.highest_step


@pytest.mark.timeout(240)  # 300 machines of 60 steps: minutes on a loaded 2-CPU host
def test_no_key_executes_twice() -> None:
    run_state_machine_as_test(
        NoKeyRunsTwice,
        settings=settings(max_examples=300, stateful_step_count=60, deadline=None),
    )


def test_operation_classes_follow_the_table() -> None:
    steps = ["Agent.Prepare", "Agent.Commit", "Environment.Advance"]
    lifecycle = ["Agent.Initialize", "Environment.Initialize", "State.Capture",
                 "State.StageRestore", "State.ActivateRestore"]
    read_only = ["Worker.Hello", "Worker.Status", "Worker.Acknowledge", "Worker.Shutdown"]
    assert [class_of(m) for m in steps] == [OpClass.STEP_MUTATION] * 3
    assert [class_of(m) for m in lifecycle] == [OpClass.LIFECYCLE] * 5
    assert [class_of(m) for m in read_only] == [OpClass.READ_ONLY] * 4
    assert class_of("Agent.Dance") is None
