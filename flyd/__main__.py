"""`python -m flyd` is the `flyd` command."""

from flyd.cli import flyd_main

flyd_main()
