"""Starting and watching worker processes (docs/launcher.md).

The launcher, how a worker is spawned (fork server or fork + exec), worker identities, the
node's thread budget and the health policy. Below the session layer: nothing here knows of
coordinators, runs or leases. Import from the submodules; this package re-exports nothing.
"""
