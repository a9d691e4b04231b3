"""Checkpoints, restore and recovery (state.md).

The pure format modules are `envelope` (the FLYSESS1 envelope) and `compat` (the compatibility
block and agent identities); the store, writer, capture, restore, recovery and cadence modules
build on them. Import from the submodules; this package re-exports nothing, so importing one part
never loads the others.
"""
