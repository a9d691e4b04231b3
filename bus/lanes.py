"""The topic lane's turn (topics.md §4.2 rule 2), as a pure counter.

Rules:

1. The writer asks `pick(topic_ready, other_ready)` before each frame. The topic lane wins
   when it is ready and either `TOPIC_TURN` control or RPC frames were written since its last
   frame, or nothing else is ready; otherwise the control and RPC lanes (design/wire.md §14.2)
   write.
2. `pick` counts what it chose: a topic frame resets the count, any other frame adds one. So a
   saturated control or RPC lane still lets one topic frame through after every 16 others,
   and with nothing else to write, messages flow back to back.
3. With neither lane ready `pick` returns None and counts nothing.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

__all__ = ["TOPIC_TURN", "Lane", "LaneTurn"]

#: control and RPC frames written before a ready topic lane must get a frame (fixed, topics.md §8)
TOPIC_TURN: Final = 16


class Lane(Enum):
    OTHER = "other"  # control, then RPC, as design/wire.md §14.2 orders them
    TOPIC = "topic"


class LaneTurn:
    """One connection's `sinceTopic` (0 at connection start)."""

    __slots__ = ("since_topic",)

    def __init__(self) -> None:
        self.since_topic = 0

    def pick(self, topic_ready: bool, other_ready: bool) -> Lane | None:
        if topic_ready and (self.since_topic >= TOPIC_TURN or not other_ready):
            self.since_topic = 0
            return Lane.TOPIC
        if other_ready:
            self.since_topic += 1
            return Lane.OTHER
        return None
