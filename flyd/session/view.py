"""`SessionView`: the part of the coordinator's public side that capture and restore both read.

Why a module of its own: capture (`CaptureSource`) and restore (`RestoreTarget`) each name what
they read of the session as a protocol, so neither imports the coordinator; the members they
share are stated once here and each protocol adds its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from flyd.session.audit import AuditLog
from flyd.session.runspec import RunSpec
from flyd.session.slots import AgentSlot
from flyd.session.trace import TraceLog
from workers.protocols import Task
from workers.types.datatypes import EnvironmentDescriptor

__all__ = ["SessionView"]


class SessionView(Protocol):
    """The session's composition, its task, audit and trace, and its agents' slots."""

    @property
    def spec(self) -> RunSpec: ...
    @property
    def world_id(self) -> str: ...
    @property
    def agent_ids(self) -> list[str]: ...
    @property
    def descriptor(self) -> EnvironmentDescriptor | None: ...
    @property
    def task(self) -> Task: ...
    @property
    def audit(self) -> AuditLog: ...
    @property
    def trace(self) -> TraceLog: ...
    @property
    def slots(self) -> Mapping[str, AgentSlot]: ...
