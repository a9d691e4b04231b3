"""Unix-socket helpers shared by the router and the processes that start one.

Why: whether something already accepts on a socket path decides both whether a router may take
the path over (a stale socket is removed, a live router is refused) and which path a node picks
for its own router; one probe says it one way for both.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["probe_socket"]

PROBE_TIMEOUT_S = 1.0


def probe_socket(path: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """True when something accepts a connection on the Unix socket `path`; False when the
    connection is refused or the path is gone (nothing listens: a stale socket or none).
    Any other failure (a permission, a timeout) is raised as the `OSError` it is."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout_s)
        probe.connect(path)
    except OSError as exc:
        if isinstance(exc, ConnectionRefusedError | FileNotFoundError) \
                or exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    finally:
        probe.close()
    return True
