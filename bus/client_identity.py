"""Who is on the other end of a frame: a peer's `Identity`, the client's cache of them, and a
fresh client incarnation (design/wire.md §17).

A caller, a responder or a publisher arrives as `{clientId, clientIncarnation}` on every
delivery; the same few peers recur, so each is built once per connection."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

IDENTITY_CACHE: Final = 1024


@dataclass(frozen=True, slots=True)
class Identity:
    client_id: str
    client_incarnation: str


def new_incarnation() -> str:
    return "inc-" + os.urandom(16).hex()


class Identities:
    """The Identities one connection has seen (bounded: the cache starts over when full)."""

    def __init__(self) -> None:
        self._known: dict[tuple[str, str], Identity] = {}

    def get(self, wire: dict[str, str]) -> Identity:
        """The Identity of a caller, responder or publisher as the router names it."""
        key = (wire["clientId"], wire["clientIncarnation"])
        found = self._known.get(key)
        if found is None:
            if len(self._known) >= IDENTITY_CACHE:
                self._known.clear()
            found = self._known[key] = Identity(*key)
        return found
