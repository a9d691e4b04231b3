"""Profile and graph of the synthetic agent model (design/session.md §4.7).

Why: the profile asset and graph identify what an agent runs; the coordinator publishes and
checks them, so they are pure functions of the agent id, its clock and the model config.
The fake brain's model config is `{"graphVariant": int ≥ 0}` (optional, default 0); any other key
is refused, so a misspelt setting is never silently ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from workers.synthetic.readout import RATE_ROLES
from workers.types.canonical import digest_bytes
from workers.types.datatypes import AssetRef, Graph
from workers.types.domain import DomainError, parse_int
from workers.types.ticks import RationalNs

PROFILE_FORMAT: Final = "fly-profile-v1"
NEURON_COUNT: Final = 1024
SUPPORTED_STIMULI: Final = ("arena.milestone",)
MODEL_CONFIG_KEYS: Final = frozenset({"graphVariant"})


def graph_variant(config: Mapping[str, Any]) -> int:
    """The `graphVariant` of a fake-brain config; `INVALID_ARGUMENT` for anything else."""
    if not isinstance(config, Mapping):
        raise DomainError.invalid("model config must be an object")
    unknown = sorted(set(config) - MODEL_CONFIG_KEYS)
    if unknown:
        raise DomainError.invalid(f"model config key {unknown[0]!r} is not a FakeBrain setting")
    return parse_int(config.get("graphVariant", 0), "model config graphVariant", 0, 2**31 - 1)


def profile_text(agent_id: str, tick: RationalNs, warmup_ticks: int) -> str:
    return (f"arena-direct-v1\nagent={agent_id}\ntick={tick.numerator}/{tick.denominator}\n"
            f"warmup={warmup_ticks}\n")


def profile_asset(agent_id: str, tick: RationalNs, warmup_ticks: int) -> AssetRef:
    """`{id: "arena-direct-v1-<a>", digest, byteLength, format: "fly-profile-v1"}`."""
    text = profile_text(agent_id, tick, warmup_ticks).encode("utf-8")
    return AssetRef(f"arena-direct-v1-{agent_id}", digest_bytes(text), len(text), PROFILE_FORMAT)


def graph(agent_id: str, variant: int = 0) -> Graph:
    """The synthetic graph: digests of the dataset and of the per-agent index."""
    dataset = f"arena-dataset-v1\nvariant={variant}\n"
    index = f"arena-index-v1\nagent={agent_id}\nvariant={variant}\nneurons={NEURON_COUNT}\n"
    return Graph(
        dataset_digest=digest_bytes(dataset.encode("utf-8")),
        index_digest=digest_bytes(index.encode("utf-8")),
        neuron_count=NEURON_COUNT,
        rate_roles=RATE_ROLES,
        supported_stimuli=SUPPORTED_STIMULI,
    )
