"""Tier 1 of the fault suite (distribution.md §7.2): the deterministic simulator.

`run_seed(seed, kind, variant)` simulates one seed on a `VirtualTimeLoop` and returns its
history record; `tests.distribution.oracle.judge(record)` judges it; `sweep` runs many seeds.
"""

from .world import KINDS, Variant, digest, run_seed, scenario

__all__ = ["KINDS", "Variant", "digest", "run_seed", "scenario"]
