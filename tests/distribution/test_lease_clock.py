"""Clocks (distribution.md §4.1 R2, §5.1): virtual time wakes sleepers only when advanced."""

from __future__ import annotations

import asyncio

import pytest

from flyd.leases.clock import BootClock, LoopClock, ManualClock
from flyd.leases.clock import LeaseClock as Clock


def test_boot_clock_monotone() -> None:
    c: Clock = BootClock()
    a = c.now()
    assert c.now() >= a


async def test_real_clocks_return_at_past_deadline() -> None:
    for c in (BootClock(), LoopClock()):
        await c.sleep_until(c.now() - 1)


async def test_manual_clock_wakes_in_order_without_sleeping() -> None:
    clock = ManualClock(10.0)
    woke: list[str] = []

    async def sleeper(name: str, deadline: float) -> None:
        await clock.sleep_until(deadline)
        woke.append(f"{name}@{clock.now()}")

    tasks = [asyncio.create_task(sleeper("b", 12.0)), asyncio.create_task(sleeper("a", 11.0))]
    await asyncio.sleep(0)
    assert clock.next_wakeup() == 11.0
    clock.advance(0.5)
    await asyncio.sleep(0)
    assert woke == []
    clock.advance(0.5)
    await asyncio.sleep(0)
    assert woke == ["a@11.0"]
    clock.set(20.0)
    await asyncio.gather(*tasks)
    assert woke == ["a@11.0", "b@20.0"]
    with pytest.raises(ValueError):
        clock.set(19.0)
    await clock.sleep_until(5.0)  # a past deadline returns at once
