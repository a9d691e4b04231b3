"""Grants and policy (design/wire.md §12, the flyd default of design/session.md §7.2).

Policy is fixed router configuration: an entry per clientId (exact, or a `prefix*` pattern),
each with register/call/expect/delegate grant patterns, and publish/subscribe/manage for topics
(topics.md §7). Routing never uses patterns; they only gate what a client may register,
call, pre-bind, publish, subscribe to and declare.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

PolicyMode = Literal["closed", "open"]
GRANT_KINDS: Final = ("register", "call", "expect", "delegate", "publish", "subscribe", "manage")
CLIENT_ID_TOKEN: Final = "{clientId}"

_PATTERN_RE: Final = re.compile(r"^(?:[a-z0-9._-]|\{clientId\})*\*?$")


class PolicyError(ValueError):
    """A policy table that cannot be used; the message names the entry and key."""


def substitute(pattern: str, client_id: str) -> str:
    return pattern.replace(CLIENT_ID_TOKEN, client_id)


def pattern_matches(pattern: str, name: str) -> bool:
    """An exact name, or `<prefix>*` matching every name that starts with prefix."""
    if pattern.endswith("*"):
        return name.startswith(pattern[:-1])
    return pattern == name


def any_matches(patterns: Iterable[str], name: str) -> bool:
    return any(pattern_matches(p, name) for p in patterns)


def covered_by_delegate(grant: str, delegates: Iterable[str], expected_id: str) -> bool:
    """design/wire.md §7.10: equal to a delegate pattern, or starting with a delegate prefix
    pattern's prefix; `{clientId}` is the expected client's id on both sides."""
    grant = substitute(grant, expected_id)
    for raw in delegates:
        pattern = substitute(raw, expected_id)
        if grant == pattern:
            return True
        if pattern.endswith("*") and grant.startswith(pattern[:-1]):
            return True
    return False


@dataclass(frozen=True, slots=True)
class Grants:
    """Effective grants of one client, `{clientId}` already substituted."""

    register: tuple[str, ...] = ()
    call: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()
    delegate: tuple[str, ...] = ()
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    manage: tuple[str, ...] = ()

    def to_wire(self) -> dict[str, list[str]]:
        return {
            "register": list(self.register),
            "call": list(self.call),
            "expect": list(self.expect),
            "delegate": list(self.delegate),
            "publish": list(self.publish),
            "subscribe": list(self.subscribe),
            "manage": list(self.manage),
        }


@dataclass(frozen=True, slots=True)
class PolicyEntry:
    id: str
    register: tuple[str, ...] = ()
    call: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()
    delegate: tuple[str, ...] = ()
    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    manage: tuple[str, ...] = ()
    require_expect: bool = False
    pid: int | None = None

    def grants_for(self, client_id: str) -> Grants:
        return Grants(
            register=tuple(substitute(p, client_id) for p in self.register),
            call=tuple(substitute(p, client_id) for p in self.call),
            expect=tuple(substitute(p, client_id) for p in self.expect),
            # design/wire.md §7.10: {clientId} in a delegate pattern is the *expected* client's id,
            # substituted at bus.expect (covered_by_delegate), never the launcher's own.
            delegate=self.delegate,
            publish=tuple(substitute(p, client_id) for p in self.publish),
            subscribe=tuple(substitute(p, client_id) for p in self.subscribe),
            manage=tuple(substitute(p, client_id) for p in self.manage),
        )


OPEN_ENTRY: Final = PolicyEntry(
    id="*", register=("*",), call=("*",), expect=("*",), delegate=("*",), publish=("*",),
    subscribe=("*",), manage=("*",)
)


@dataclass(frozen=True)
class Policy:
    mode: PolicyMode = "closed"
    entries: tuple[PolicyEntry, ...] = field(default_factory=tuple)

    def entry_for(self, client_id: str) -> PolicyEntry | None:
        """Exact id wins; otherwise the longest matching prefix entry; else None."""
        if self.mode == "open":
            return OPEN_ENTRY
        best: PolicyEntry | None = None
        for entry in self.entries:
            if entry.id == client_id:
                return entry
            if entry.id.endswith("*") and client_id.startswith(entry.id[:-1]):
                if best is None or len(entry.id) > len(best.id):
                    best = entry
        return best

    @classmethod
    def open(cls) -> Policy:
        return cls(mode="open")

    @classmethod
    def default(cls, node_pid: int | None = None) -> Policy:
        """The flyd node's policy (design/session.md §7.2)."""
        return cls(
            mode="closed",
            entries=(
                PolicyEntry(
                    id="node.*",
                    register=("flyd.control.*",),
                    call=("*",),
                    expect=("s*",),
                    delegate=("s*", "flyd.run.*"),
                    manage=("flyd.run.*",),
                    publish=("flyd.run.*",),
                    pid=node_pid,
                ),
                PolicyEntry(id="s*", require_expect=True),
                PolicyEntry(id="ctl-*", call=("flyd.control.*",), subscribe=("flyd.run.*",)),
            ),
        )

    @classmethod
    def from_config(cls, table: Mapping[str, Any]) -> Policy:
        """Build from a `[bus.policy]` TOML table; unknown keys and bad patterns are refused."""
        unknown = set(table) - {"mode", "client"}
        if unknown:
            raise PolicyError(f"[bus.policy]: unknown key {sorted(unknown)[0]!r}")
        mode = table.get("mode", "closed")
        if mode not in ("closed", "open"):
            raise PolicyError(f"[bus.policy] mode: {mode!r} is not 'closed' or 'open'")
        clients = table.get("client", [])
        if not isinstance(clients, list):
            raise PolicyError("[bus.policy] client: must be an array of tables")
        return cls(mode=mode, entries=tuple(_entry(i, c) for i, c in enumerate(clients)))


def _patterns(where: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise PolicyError(f"{where}: must be a list of patterns")
    for p in value:
        if not isinstance(p, str) or not _PATTERN_RE.match(p):
            raise PolicyError(f"{where}: {p!r} is not a grant pattern")
    return tuple(value)


def _entry(index: int, raw: Any) -> PolicyEntry:
    where = f"[[bus.policy.client]] #{index + 1}"
    if not isinstance(raw, Mapping):
        raise PolicyError(f"{where}: must be a table")
    allowed = {"id", *GRANT_KINDS, "requireExpect", "pid"}
    unknown = set(raw) - allowed
    if unknown:
        raise PolicyError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    ident = raw.get("id")
    if not isinstance(ident, str) or not re.match(r"^[a-z0-9][a-z0-9._-]{0,63}\*?$|^\*$", ident):
        raise PolicyError(f"{where} id: {ident!r} is not a clientId or prefix pattern")
    require = raw.get("requireExpect", False)
    if not isinstance(require, bool):
        raise PolicyError(f"{where} requireExpect: must be a boolean")
    pid = raw.get("pid")
    if pid is not None and (not isinstance(pid, int) or isinstance(pid, bool) or pid < 1):
        raise PolicyError(f"{where} pid: must be a positive integer")
    grants = {k: _patterns(f"{where} {k}", raw.get(k, [])) for k in GRANT_KINDS}
    return PolicyEntry(id=ident, require_expect=require, pid=pid, **grants)
