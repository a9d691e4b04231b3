"""Checkpoints: their format, store and writer, and the recovery budget (state.md).

The pure format modules are `envelope` (the FLYSESS1 envelope) and `compat` (the compatibility
block and agent identities); the checkpoint store (`checkpoints`), writer, effects, cadence and
recovery modules build on them. Capturing and restoring a session's state are the session
layer's (`flyd.session.capture`, `flyd.session.restore`), which uses these. Import from the
submodules; this package re-exports nothing, so importing one part never loads the others.
"""
