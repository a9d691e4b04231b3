"""One session's run: the coordinator and its protocol cores (session.md).

The phase machine (`phase`), fencing (`fence`), pacing, the run spec, the audit and trace logs,
and the capture and restore of a session's state around the coordinator. Import from the
submodules; this package re-exports nothing.
"""
