"""One node's process: the router child, the lease runtime's host for granted runs (`executor`,
`grant`), the control service and systemd notification. Top of the daemon's layers, under the
command line. Import from the submodules; this package re-exports nothing.
"""
