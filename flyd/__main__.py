"""`python -m flyd` is the `flyd` command."""

from flyd.cli.flyd import flyd_main

flyd_main()
