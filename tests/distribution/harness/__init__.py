"""Tier-2 fault harness pieces (distribution.md §7.3): the harness clock and node processes."""
