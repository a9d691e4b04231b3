"""Fault knobs of a worker launch: `Faults` and the knob table (design/session.md §4.9).

Why here: faults travel with a launch (`WorkerLaunch`, `workers/launch.py`, which re-exports
`Faults`) and are executed by the worker shell, so they must live in `workers/`; the run spec and
the `--fault` grammar (`flyd/runspec.py`) build them from this table, so the knob names, roles,
value kinds and camelCase forms are defined exactly once.

One-shot rule helpers: a step-addressed fault has the id `<workerId>.<knob>` and a step (K for
`*_delay_ms@K`, k for `fail_commit_at_step`, B − 1 for `*_at_boundary` B); `Faults.step_addressed`
lists them and `Faults.without` clears fired ones. A delay without `@K`, `acknowledge_extra_id`
and the `fail_*` booleans are standing faults and never fire "once". A `*_at_boundary` of 0
(only the harness can set it; boundary 0 is rendered at bootstrap) is not step-addressed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any, Final, Literal

Role = Literal["agent", "environment"]
KnobKind = Literal["delay", "step", "boundary", "request_id", "flag"]
ROLES: Final[tuple[Role, ...]] = ("agent", "environment")


@dataclass(frozen=True)
class Knob:
    """One fault knob of design/session.md §4.9: its name, the roles that have it and the type of
    its value, so the CLI, the run spec and the launch parse it the same way."""

    name: str
    roles: frozenset[Role]
    kind: KnobKind
    at_step: str | None = None
    """For a `*_delay_ms` knob: the name of its `*_at_step` field."""

    @property
    def camel(self) -> str:
        return camel_case(self.name)


def camel_case(name: str) -> str:
    """`prepare_delay_ms` → `prepareDelayMs`."""
    head, *rest = name.split("_")
    return head + "".join(part.capitalize() for part in rest)


_AGENT: Final[frozenset[Role]] = frozenset({"agent"})
_ENV: Final[frozenset[Role]] = frozenset({"environment"})
_BOTH: Final[frozenset[Role]] = frozenset({"agent", "environment"})

KNOBS: Final[dict[str, Knob]] = {k.name: k for k in (
    Knob("prepare_delay_ms", _AGENT, "delay", "prepare_delay_at_step"),
    Knob("commit_delay_ms", _AGENT, "delay", "commit_delay_at_step"),
    Knob("fail_commit_at_step", _AGENT, "step"),
    Knob("acknowledge_extra_id", _BOTH, "request_id"),
    Knob("advance_delay_ms", _ENV, "delay", "advance_delay_at_step"),
    Knob("omit_view_at_boundary", _ENV, "boundary"),
    Knob("stale_view_at_boundary", _ENV, "boundary"),
    Knob("truncated_view_at_boundary", _ENV, "boundary"),
    Knob("omit_audio_at_boundary", _ENV, "boundary"),
    Knob("overlapping_audio_at_boundary", _ENV, "boundary"),
    Knob("fail_capture", _BOTH, "flag"),
    Knob("fail_stage_restore", _BOTH, "flag"),
    Knob("fail_activate_restore", _BOTH, "flag"),
)}


def role_knobs(role: Role) -> tuple[Knob, ...]:
    """The knobs a worker of `role` has, in table order."""
    return tuple(k for k in KNOBS.values() if role in k.roles)


def role_fields(role: Role) -> tuple[str, ...]:
    """The `Faults` field names of a role: its knobs plus each delay's `*_at_step`."""
    out: list[str] = []
    for knob in role_knobs(role):
        out.append(knob.name)
        if knob.at_step is not None:
            out.append(knob.at_step)
    return tuple(out)


@dataclass(frozen=True)
class Faults:
    """The faults of one launch; None or False when unset (design/session.md §4.9)."""

    prepare_delay_ms: int | None = None
    prepare_delay_at_step: int | None = None
    commit_delay_ms: int | None = None
    commit_delay_at_step: int | None = None
    fail_commit_at_step: int | None = None
    acknowledge_extra_id: str | None = None
    advance_delay_ms: int | None = None
    advance_delay_at_step: int | None = None
    omit_view_at_boundary: int | None = None
    stale_view_at_boundary: int | None = None
    truncated_view_at_boundary: int | None = None
    omit_audio_at_boundary: int | None = None
    overlapping_audio_at_boundary: int | None = None
    fail_capture: bool = False
    fail_stage_restore: bool = False
    fail_activate_restore: bool = False

    def is_set(self, knob: str) -> bool:
        value = getattr(self, KNOBS[knob].name)
        return value is not None and value is not False

    def delay_ms(self, knob: str, step: int) -> int:
        """Milliseconds a `*_delay_ms` knob sleeps in the call at scope `step` (0: none).

        With its `*_at_step` set it sleeps only in the call whose step equals it; otherwise in
        every call.
        """
        spec = KNOBS[knob]
        if spec.kind != "delay" or spec.at_step is None:
            raise ValueError(f"{knob} is not a delay knob")
        ms: int | None = getattr(self, knob)
        at: int | None = getattr(self, spec.at_step)
        if ms is None or (at is not None and at != step):
            return 0
        return ms

    def step_addressed(self, worker_id: str) -> list[tuple[str, int]]:
        """`(fault id, step)` of every one-shot fault, in knob-table order."""
        out: list[tuple[str, int]] = []
        for knob in KNOBS.values():
            value = getattr(self, knob.name)
            if value is None:
                continue
            fault_id = f"{worker_id}.{knob.name}"
            if knob.kind == "delay" and knob.at_step is not None:
                at = getattr(self, knob.at_step)
                if at is not None:
                    out.append((fault_id, at))
            elif knob.kind == "step":
                out.append((fault_id, value))
            elif knob.kind == "boundary" and value >= 1:
                # boundary 0 is rendered at bootstrap, before any step: not step-addressed
                out.append((fault_id, value - 1))
        return out

    def without(self, knobs: Iterable[str]) -> Faults:
        """A copy with the named knobs cleared (a delay together with its `*_at_step`)."""
        changes: dict[str, Any] = {}
        for name in knobs:
            knob = KNOBS[name]
            changes[name] = False if knob.kind == "flag" else None
            if knob.at_step is not None:
                changes[knob.at_step] = None
        return replace(self, **changes)

    def to_json(self, role: Role) -> dict[str, Any]:
        """The run-spec form (design/session.md §4.10): every camelCase key of the role, steps as
        U64 strings."""
        out: dict[str, Any] = {}
        for name in role_fields(role):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool) \
                    and not name.endswith("_delay_ms"):
                value = str(value)
            out[camel_case(name)] = value
        return out

    def foreign_fields(self, role: Role) -> list[str]:
        """Set fields that a worker of `role` does not have (a launch must carry none)."""
        allowed = set(role_fields(role))
        return [f.name for f in fields(self) if f.name not in allowed
                and getattr(self, f.name) not in (None, False)]
