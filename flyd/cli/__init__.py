"""The command line: `flyd` (`flyd.cli.flyd`: router, run, serve, demo) and `flyctl`
(`flyd.cli.flyctl`, the operator's client of the control service). Import from the submodules.
"""
