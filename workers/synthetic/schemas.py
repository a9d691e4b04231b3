"""Schema references of the synthetic composition (design/session.md §4.4).

Why: every typed value the synthetic models exchange names its schema by id, version and digest,
and a receiver compares the whole reference; deriving the digest from the name and version keeps
the references stable across installs without shipping schema files for them.
"""

from __future__ import annotations

from typing import Any, Final

from workers.types.canonical import digest_bytes
from workers.types.datatypes import SchemaRef, TypedValue


def synthetic_schema(name: str, version: int = 1) -> SchemaRef:
    """`{id, version, digest}` with `digest_bytes("fly-session-schema-v1\\n<name>\\n<v>\\n")`."""
    text = f"fly-session-schema-v1\n{name}\n{version}\n"
    return SchemaRef(name, version, digest_bytes(text.encode("utf-8")))


INSPECTION: Final = synthetic_schema("arena.inspection.v1")
DECISION: Final = synthetic_schema("arena.decision.v1")
CONTEXT: Final = synthetic_schema("arena.context.v1")
PROGRESS: Final = synthetic_schema("arena.progress.v1")
EVENT: Final = synthetic_schema("arena.event.v1")
EPISODE: Final = synthetic_schema("arena.episode.v1")
CONTROLLER: Final = synthetic_schema("arena.controller.v1")


def typed(schema: SchemaRef, value: Any) -> TypedValue:
    return TypedValue(schema, value)


def has_schema(value: Any, schema: SchemaRef) -> bool:
    """True when `value` is a `TypedValue` whose schema reference equals `schema` exactly."""
    return isinstance(value, TypedValue) and value.schema == schema
