"""The pure core of the node's part liveness (`flyd.node.liveness`): probe sent, answered,
missed, replaced, given up, recovered."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flyd.node.liveness import (
    GiveUp,
    PartLiveness,
    Phase,
    Probe,
    Recovered,
    Replace,
)


def core() -> PartLiveness:
    return PartLiveness("router", period=0.5, deadline=2.0)


def test_probe_answer_cycle_on_the_period() -> None:
    c = core()
    assert c.tick(0.0) == Probe("router")
    assert c.phase is Phase.PROBING and c.due() == 2.0
    assert c.tick(1.9) is None
    assert c.answered(1.0) is None
    assert c.phase is Phase.IDLE and c.due() == 1.5
    assert c.tick(1.4) is None
    assert c.tick(1.5) == Probe("router")


def test_a_miss_is_replaced_and_the_replacement_probed_at_once() -> None:
    c = core()
    c.tick(0.0)
    action = c.tick(2.0)
    assert isinstance(action, Replace)
    assert action.reason == "the router did not answer its liveness probe within 2s"
    assert c.phase is Phase.REPLACING and c.due() is None and c.misses == 1
    assert c.tick(100.0) is None, "nothing to do while the replacement is under way"
    c.replaced(3.0)
    assert c.replacements == 1
    assert c.tick(3.0) == Probe("router"), "only an answer confirms a replacement"
    assert c.answered(3.1) is None
    assert c.failures == 0 and c.reason is None


def test_given_up_after_consecutive_failures_then_recovered_once() -> None:
    c = core()
    c.tick(0.0)
    assert isinstance(c.tick(2.0), Replace)
    assert c.replace_failed(2.5, "exited with code 1") is None
    give_up = c.replace_failed(3.0, "exited with code 1")
    assert give_up == GiveUp("router", "the router could not be brought back: exited with code 1")
    assert c.given_up
    assert c.replace_failed(4.0, "exited with code 1") is None, "given up once"
    c.replaced(5.0)
    assert c.tick(5.0) == Probe("router")
    assert c.answered(5.2) == Recovered("router")
    assert not c.given_up and c.failures == 0


def test_a_replaced_part_that_hangs_again_is_given_up() -> None:
    c = core()
    t = 0.0
    verdicts = []
    for _ in range(3):
        assert c.tick(t) == Probe("router")
        verdicts.append(c.tick(t + 2.0))
        c.replaced(t + 2.5)
        t += 2.5
    assert [type(v) for v in verdicts] == [Replace, Replace, GiveUp]


def test_losses_after_successful_replacements_never_give_up() -> None:
    """A router killed again and again right after it came back (an operator's burst) was
    brought back each time: only misses and failed replacements count."""
    c = core()
    for k in range(10):
        assert isinstance(c.lost(float(k), "the router exited with code -9"), Replace)
        c.replaced(k + 0.5)
    assert not c.given_up and c.replacements == 10


def test_a_loss_replaces_and_late_answers_are_ignored() -> None:
    c = core()
    c.tick(0.0)
    assert c.lost(0.1, "the router exited with code -9") == Replace(
        "router", "the router exited with code -9")
    assert c.lost(0.2, "again") is None, "one replacement per loss"
    assert c.answered(0.3) is None and c.phase is Phase.REPLACING


def test_request_probes_an_idle_part_now_and_settled_since() -> None:
    c = core()
    c.tick(0.0)
    c.answered(0.1)
    assert not c.settled_since(0.2)
    c.request(0.2)
    assert c.tick(0.2) == Probe("router")
    c.answered(0.3)
    assert c.settled_since(0.2)


def test_bad_budgets_are_refused() -> None:
    with pytest.raises(ValueError, match="router"):
        PartLiveness("router", period=0.0, deadline=2.0)


EVENTS = st.lists(st.sampled_from(["tick", "answer", "lost", "replaced", "failed"]),
                  max_size=60)


@given(EVENTS)
def test_give_up_and_recovered_alternate(events: list[str]) -> None:
    """Whatever happens: `GiveUp` and `Recovered` alternate, starting with `GiveUp`; an answer
    resets the failures; a part is given up exactly when failures reached the bound since its
    last answer."""
    c = core()
    t = 0.0
    edges: list[type] = []
    for name in events:
        t += 1.0
        if name == "tick":
            out = c.tick(t)
        elif name == "answer":
            out = c.answered(t)
        elif name == "lost":
            out = c.lost(t, "gone")
        elif name == "replaced":
            c.replaced(t)
            out = None
        else:
            out = c.replace_failed(t, "no")
        if isinstance(out, GiveUp | Recovered):
            edges.append(type(out))
        if name == "answer" and c.phase is Phase.IDLE and c.answered_at == t:
            assert c.failures == 0 and not c.given_up
        assert c.given_up or c.failures < c.give_up_after
    assert all(e is (GiveUp if i % 2 == 0 else Recovered) for i, e in enumerate(edges))
