"""The compatibility block and agent identities of a checkpoint (design/state.md §3).

Why: a checkpoint can only be installed into a composition that would have produced it — same
world build, content, configuration, controllers and inspection parser, same agents with the same
data, index, model and seed. Both are plain values compared field by field, and the first
difference is named with both values, so an operator sees *what* changed, not just "no".

Rules:

- `Compatibility.of(descriptor)` builds the live block from the `EnvironmentDescriptor` the
  coordinator received at `Environment.Initialize`:

      stateFormatId     "flysess-1"
      backendDigest     descriptor.backendDigest
      contentDigest     descriptor.contentDigest
      patchDigest       descriptor.configurationDigest
      controllerDigest  digest_of([{portId, controls}, …]) in descriptor port order
      parserDigest      digest_of({"inspectionSchema": descriptor.inspectionSchema})

  A descriptor whose `recovery` is not `"exact-checkpoint"` has no block: `UNSUPPORTED`/`none`.
- `digest()` = `digest_of(to_json())`; the environment computes the same value from its own
  descriptor and echoes it in `CaptureResult.compatibilityDigest`.
- `recorded.compare(live, checkpoint_id=…)` is exact and walks the fields in the order above
  (`FIELDS`); the first difference raises `INCOMPATIBLE_STATE`/`none`:
  `checkpoint <id>: the checkpoint's <field> identity <recorded> differs from this composition's
  <current>`.
- `AgentIdentity` = `{agentId, profileDigest, datasetDigest, indexDigest, modelVersion,
  plasticityVersion, seed}`; its digest is `digest_of(identity)`; `compare` walks those fields in
  that order: `agent <agentId>: the checkpoint's <field> identity <recorded> differs from this
  worker's <current>`.

Decisions where the spec is silent:

- `Compatibility.from_json` refuses a malformed block with `INCOMPATIBLE_STATE`/`none`: blocks
  come only from checkpoints, and a bad checkpoint is `INCOMPATIBLE_STATE` (design/state.md §0). The
  block is closed: a missing or extra key is refused like a malformed value.
- `AgentIdentity.from_json` refuses with `INVALID_ARGUMENT`/`none`: the identity is a wire shape
  (`CaptureResult.agentIdentity`, design/state.md §6.1), and wire shapes are refused that way.
- `compare` takes the checkpoint id as a keyword argument: the block does not carry it, the
  message needs it.
- This module is pure (no I/O, no clock); `workers` cannot import `flyd`, so the environment's
  own computation is a separate implementation, and a test checks that the two agree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from workers.types.canonical import digest_of
from workers.types.datatypes import EnvironmentDescriptor
from workers.types.domain import (
    DomainError,
    ErrorCode,
    parse_digest,
    parse_i32,
    parse_id,
    short,
)

__all__ = [
    "AGENT_IDENTITY_FIELDS",
    "FIELDS",
    "STATE_FORMAT_ID",
    "AgentIdentity",
    "Compatibility",
]

STATE_FORMAT_ID: Final = "flysess-1"

# (wire name, attribute), in comparison order
FIELDS: Final[tuple[tuple[str, str], ...]] = (
    ("stateFormatId", "state_format_id"),
    ("backendDigest", "backend_digest"),
    ("contentDigest", "content_digest"),
    ("patchDigest", "patch_digest"),
    ("controllerDigest", "controller_digest"),
    ("parserDigest", "parser_digest"),
)

AGENT_IDENTITY_FIELDS: Final[tuple[tuple[str, str], ...]] = (
    ("agentId", "agent_id"),
    ("profileDigest", "profile_digest"),
    ("datasetDigest", "dataset_digest"),
    ("indexDigest", "index_digest"),
    ("modelVersion", "model_version"),
    ("plasticityVersion", "plasticity_version"),
    ("seed", "seed"),
)


def _closed(value: Any, fields: tuple[tuple[str, str], ...], what: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise DomainError.invalid(f"{what} must be an object; got {short(value)}")
    names = [name for name, _ in fields]
    missing = [name for name in names if name not in value]
    if missing:
        raise DomainError.invalid(f"{what} lacks {missing[0]}")
    extra = sorted(key for key in value if key not in names)
    if extra:
        raise DomainError.invalid(f"{what} has the unknown field {short(extra[0])}")
    return value


@dataclass(frozen=True, slots=True)
class Compatibility:
    """What a world must match to install a checkpoint (design/state.md §3)."""

    state_format_id: str
    backend_digest: str
    content_digest: str
    patch_digest: str
    controller_digest: str
    parser_digest: str

    @classmethod
    def of(cls, descriptor: EnvironmentDescriptor) -> Compatibility:
        """The live block of a composition, from the world's descriptor."""
        if descriptor.recovery != "exact-checkpoint":
            raise DomainError.before(
                ErrorCode.UNSUPPORTED,
                f"the world declares recovery {descriptor.recovery!r}; a checkpoint needs "
                "'exact-checkpoint'",
            )
        return cls(
            state_format_id=STATE_FORMAT_ID,
            backend_digest=descriptor.backend_digest,
            content_digest=descriptor.content_digest,
            patch_digest=descriptor.configuration_digest,
            controller_digest=digest_of([port.to_json() for port in descriptor.ports]),
            parser_digest=digest_of({"inspectionSchema": descriptor.inspection_schema}),
        )

    @classmethod
    def from_json(cls, value: Any, what: str = "compatibility") -> Compatibility:
        """A recorded block: exactly the six fields, five Digests and an Id."""
        try:
            v = _closed(value, FIELDS, what)
            return cls(
                state_format_id=parse_id(v["stateFormatId"], f"{what}.stateFormatId"),
                **{attr: parse_digest(v[name], f"{what}.{name}") for name, attr in FIELDS[1:]},
            )
        except DomainError as exc:
            raise DomainError.before(ErrorCode.INCOMPATIBLE_STATE, exc.message) from None

    def to_json(self) -> dict[str, str]:
        return {name: getattr(self, attr) for name, attr in FIELDS}

    def digest(self) -> str:
        return digest_of(self.to_json())

    def first_difference(self, live: Compatibility) -> tuple[str, str, str] | None:
        """`(field, recorded, current)` of the first differing field, or None."""
        for name, attr in FIELDS:
            recorded, current = getattr(self, attr), getattr(live, attr)
            if recorded != current:
                return name, recorded, current
        return None

    def compare(self, live: Compatibility, *, checkpoint_id: str) -> None:
        """Refuse a checkpoint recorded under another composition, naming the first field."""
        difference = self.first_difference(live)
        if difference is not None:
            name, recorded, current = difference
            raise DomainError.before(
                ErrorCode.INCOMPATIBLE_STATE,
                f"checkpoint {checkpoint_id}: the checkpoint's {name} identity {recorded} "
                f"differs from this composition's {current}",
            )


@dataclass(frozen=True, slots=True)
class AgentIdentity:
    """What an agent worker must match to install an agent payload (design/state.md §3)."""

    agent_id: str
    profile_digest: str
    dataset_digest: str
    index_digest: str
    model_version: str
    plasticity_version: str
    seed: int

    def __post_init__(self) -> None:
        """Ids, Digests and an I32 seed (`INVALID_ARGUMENT`/`none` otherwise)."""
        for name, attr in AGENT_IDENTITY_FIELDS:
            value, what = getattr(self, attr), f"agentIdentity.{name}"
            if name == "seed":
                parse_i32(value, what)
            elif name.endswith("Digest"):
                parse_digest(value, what)
            else:
                parse_id(value, what)

    @classmethod
    def from_json(cls, value: Any, what: str = "agentIdentity") -> AgentIdentity:
        """Exactly the seven fields; each value checked by the constructor."""
        v = _closed(value, AGENT_IDENTITY_FIELDS, what)
        return cls(**{attr: v[name] for name, attr in AGENT_IDENTITY_FIELDS})

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, attr) for name, attr in AGENT_IDENTITY_FIELDS}

    def digest(self) -> str:
        return digest_of(self.to_json())

    def first_difference(self, live: AgentIdentity) -> tuple[str, Any, Any] | None:
        """`(field, recorded, current)` of the first differing field, or None."""
        for name, attr in AGENT_IDENTITY_FIELDS:
            recorded, current = getattr(self, attr), getattr(live, attr)
            if recorded != current:
                return name, recorded, current
        return None

    def compare(self, live: AgentIdentity) -> None:
        """Refuse an agent payload recorded for another agent, naming the first field."""
        difference = self.first_difference(live)
        if difference is not None:
            name, recorded, current = difference
            raise DomainError.before(
                ErrorCode.INCOMPATIBLE_STATE,
                f"agent {self.agent_id}: the checkpoint's {name} identity {recorded} differs "
                f"from this worker's {current}",
            )
