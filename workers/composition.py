"""Composition-wide identities: config assets, seeds, composition digest (design/session.md §4.6,
§4.7).

Why: these are model-agnostic facts about a composition that the coordinator, the run spec and
the worlds must compute identically; they are pure functions of their inputs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Final

from workers.types.canonical import canonical, digest_bytes
from workers.types.datatypes import AssetRef
from workers.types.domain import U64_MAX, DomainError

CONFIG_FORMAT: Final = "fly-config-v1"
SEED_DERIVATION: Final = "flyd/seed-derivation-v1"


def config_asset(asset_id: str, config: Mapping[str, Any]) -> AssetRef:
    """`{id, digest: digest_of(config), byteLength: canonical length, format: "fly-config-v1"}`."""
    data = canonical(dict(config))
    return AssetRef(asset_id, digest_bytes(data), len(data), CONFIG_FORMAT)


def derive_seed(master: int, agent_id: str) -> int:
    """An agent's I32 seed derived from the run's master seed (U64).

    SHA-256 of `"flyd/seed-derivation-v1\\n<master>\\n<agentId>\\n"` split into eight big-endian
    u32 lanes; the first non-zero lane as two's-complement i32. All-zero digests rehash with the
    suffixes `"1\\n"`, `"2\\n"`, `"3\\n"`, then fail `INTERNAL` (never happens in practice).
    """
    if isinstance(master, bool) or not isinstance(master, int) or not 0 <= master <= U64_MAX:
        raise DomainError.before("INVALID_ARGUMENT", f"master seed {master!r} is not a U64")
    material = f"{SEED_DERIVATION}\n{master}\n{agent_id}\n"
    for suffix in ("", "1\n", "2\n", "3\n"):
        digest = hashlib.sha256((material + suffix).encode("utf-8")).digest()
        for i in range(0, 32, 4):
            lane = int.from_bytes(digest[i:i + 4], "big")
            if lane:
                return lane - (1 << 32) if lane >= 1 << 31 else lane
    raise DomainError("INTERNAL", f"no seed could be derived for {agent_id}", "none")


def composition_digest(session_id: str, epoch: str, contract_digest: str,
                       agents: Iterable[tuple[str, str, str]]) -> str:
    """Digest of the session, epoch, contract and every `(agentId, portId, profileDigest)`,
    agents in sorted order."""
    text = (f"fly-session/composition-v1\nsession={session_id}\nepoch={epoch}\n"
            f"contract={contract_digest}\n")
    for agent_id, port_id, profile_digest in sorted(agents):
        text += f"agent={agent_id} port={port_id} profile={profile_digest}\n"
    return digest_bytes(text.encode("utf-8"))
