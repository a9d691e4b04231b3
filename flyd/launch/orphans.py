"""What a worker started outlives neither the worker's session nor the node (docs/launcher.md).

Why: a worker runs in its own process group and is ended with `killpg`, but a plugin may start
processes that leave the group (`setsid`) and its parent (a double fork). Such a process used
to be adopted by init and run on after the run ended. Two things end it now:

- The node is a **child subreaper** (`prctl(PR_SET_CHILD_SUBREAPER)`, `become_subreaper`, set
  once when the node starts): an orphan among its descendants is adopted by the node, not by
  init, so it stays among the node's descendants, where the node can find it and reap it.
- Every process-mode worker gets the variable `FLYD_SCOPE` = `<launcher scope>/<worker id>`
  (the launcher's scope is `<node id>.<session tag>`; an agent host's names its agents,
  `<launcher scope>/<id>,<id>,…`) in its environment, which whatever it starts inherits.
  `sweep(scope, spare)` SIGKILLs every descendant of the node whose `FLYD_SCOPE` falls under
  `scope` (`_within`), except `spare` (the workers' own pids, which their launcher reaps), and
  returns them; `reap(procs, timeout)` then waits for them,
  which reaps the ones the node adopted. The launcher sweeps a worker's scope when it has
  reaped or killed that worker (a recovery's replacement included; `deep=False`: the node's
  own children, where the dead worker's orphans are, a few `/proc` reads), its own scope
  over all the node's descendants whenever it kills its process groups (the end of a
  session, a lost lease), and again when it closes.

Limits: a process that clears its environment, or one of a thread- or in-process-mode worker
(which runs inside the node and so has the node's environment), carries no scope; the node
still adopts such an orphan but cannot tell whose it is, so it is left alone. A process that
moved to another user cannot be read and is left alone too. Without `prctl` (not Linux) the
node is no subreaper, and only the descendants still below the node are swept.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Collection, Sequence
from typing import Final

import psutil
import structlog

__all__ = ["SCOPE_VAR", "become_subreaper", "reap", "sweep"]

log = structlog.get_logger("flyd.launch.orphans")

SCOPE_VAR: Final = "FLYD_SCOPE"
#: `<linux/prctl.h>`
PR_SET_CHILD_SUBREAPER: Final = 36


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants; False where it cannot be."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _scope_of(proc: psutil.Process) -> str | None:
    try:
        scope = proc.environ().get(SCOPE_VAR)
    except (psutil.Error, OSError):
        return None  # gone, a zombie, or another user's
    return None if scope is None else str(scope)


def _within(found: str | None, scope: str) -> bool:
    """Whether a process's `FLYD_SCOPE` falls under `scope`: the same, below it, or, for a
    worker's scope `<launcher>/<id>`, an agent host's `<launcher>/<id>,<id>,…` naming it."""
    if found is None:
        return False
    if found == scope or found.startswith(scope + "/"):
        return True
    base, _, worker = scope.rpartition("/")
    found_base, _, hosted = found.rpartition("/")
    return bool(base) and found_base == base and worker in hosted.split(",")


def _children() -> list[psutil.Process]:
    """This process's own children: one `/proc/self/task/<tid>/children` read per thread of
    ours, rather than psutil's pass over every process of the host."""
    pids: set[int] = set()
    try:
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/children", encoding="ascii") as fh:
                pids.update(int(pid) for pid in fh.read().split())
    except OSError:  # no procfs, or a kernel without CONFIG_PROC_CHILDREN
        return list(psutil.Process().children())
    out: list[psutil.Process] = []
    for pid in sorted(pids):
        with contextlib.suppress(psutil.Error):
            out.append(psutil.Process(pid))
    return out


def sweep(scope: str, spare: Collection[int] = (), *,
          deep: bool = True) -> list[psutil.Process]:
    """SIGKILL every descendant of this process whose `FLYD_SCOPE` is `scope` or below it,
    except the pids in `spare`; the processes signalled. `deep=False` looks only at this
    process's own children (where a dead worker's orphans land, the node being their
    subreaper) and below the ones that match: cheap enough for every worker's end."""
    try:
        if deep:
            descendants = psutil.Process().children(recursive=True)
        else:
            matched = [p for p in _children()
                       if p.pid not in spare and _within(_scope_of(p), scope)]
            descendants = list(matched)
            for proc in matched:
                with contextlib.suppress(psutil.Error):
                    descendants.extend(proc.children(recursive=True))
    except psutil.Error:
        return []
    found = [p for p in descendants if p.pid not in spare and _within(_scope_of(p), scope)]
    killed: list[psutil.Process] = []
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
            killed.append(proc)
    if killed:
        log.info("orphans.killed", scope=scope, pids=[p.pid for p in killed])
    return killed


def reap(procs: Sequence[psutil.Process], timeout: float) -> list[int]:
    """Wait up to `timeout` seconds for `procs` to end (reaping those this process adopted);
    the pids still running then (blocking: run it on a thread)."""
    if not procs:
        return []
    _, alive = psutil.wait_procs(list(procs), timeout=timeout)
    left = [p.pid for p in alive]
    if left:
        log.warning("orphans.still_running", pids=left, node_pid=os.getpid())
    return left
