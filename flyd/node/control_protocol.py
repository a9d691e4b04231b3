"""The control service's wire names and shapes (design/cli.md §8), shared by the service
(`flyd.node.control`) and its client (`flyctl`).

Why here: `flyctl` needs the service name, the method names and the schemas to check what it
sends and receives, not the service's implementation (its node view, its handlers); both sides
read them from this one module.
"""

from __future__ import annotations

import functools
from typing import Final

from bus.schema import Validator, compile_schema
from workers.types.canonical import parse_strict
from workers.types.contract import SCHEMA_ROOT
from workers.types.domain import DomainError, ErrorCode, Mutation

__all__ = ["CONTROL_PREFIX", "CONTROL_SCHEMAS", "METHODS", "control_service", "control_validator"]

CONTROL_PREFIX: Final = "flyd.control."
CONTROL_SCHEMAS: Final = SCHEMA_ROOT / "control"
METHODS: Final = ("Control.Status", "Control.Kill", "Control.Drain", "Control.RunEvents",
                   "Control.Watch")


def control_service(node_id: str) -> str:
    """`flyd.control.<node_id>`."""
    return CONTROL_PREFIX + node_id


@functools.cache
def control_validator(method: str, kind: str) -> Validator:
    """The compiled schema `schemas/control/<method>.<kind>.json` (kind params|result)."""
    schema = parse_strict((CONTROL_SCHEMAS / f"{method}.{kind}.json").read_bytes())
    if not isinstance(schema, dict):
        raise DomainError(ErrorCode.INTERNAL, f"{method}.{kind}.json is not a schema object",
                          Mutation.NONE)
    return compile_schema(schema)
