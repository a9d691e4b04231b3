"""Tier-2 fault harness (distribution.md §7.3): `clock` (the harness clock), `proxy` (per-node
fault proxies), `taps` (PostgreSQL wire decoding), `scenarios` (the §7.3.5 registry) and
`runner` (wall budgets, progress, replay records; `python -m tests.distribution.harness`)."""
