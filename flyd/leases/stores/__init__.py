"""The lease store: its contract (`contract`) and two backends, PostgreSQL (`pg`) and in memory
(`mem`, the tests' and the simulation's). Import from the submodules."""
