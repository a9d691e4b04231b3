"""Directories a process may trust: owned by it, writable by nobody else (design/wire.md §13).

Why: a Unix socket or a store file is only as private as the directory that holds it. Whoever
can write that directory can rename the socket and bind their own in its place, so the node's
clients and its workers would talk to an impostor. The router, every bus client and the artifact
store check their directory with the one rule here (`dir_problem`) and refuse it otherwise;
nothing is ever chmod-ed or chown-ed into shape.

The rule, for the directory itself (`Trust`):
- it is a directory (a symlink is refused: `lstat`), owned by one of `Trust.owners` (the
  router and the store: the effective uid; a client: its euid, root, or, with a configured
  socket group, any owner whose directory has that group);
- nobody else may write it: no write bit for others, and the group write bit only when the
  directory's group is the configured socket group;
- `private` (the store): group and others get no bit at all (its files hold artifacts).

Every ancestor, up to `/`, of the path as given and of the path it resolves to is checked too,
more leniently: owned by root or a trusted owner, and writable by others or by a group that is not
the configured one only with the sticky bit (`/tmp`), where nobody may rename an entry they do
not own. Otherwise a directory owned by us inside one another user owns could still be swapped.

`make_dirs` creates the missing directories of a path one by one with the given mode (under a
restrictive umask, group set when configured), so the default per-user directory
(`/tmp/flyd-<uid>`) is created 0700, not with `os.makedirs`' umask-derived mode for parents.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from bus.errors import NotAuthorized

__all__ = ["Trust", "UnsafeDirectory", "check_dir", "check_socket_dir", "dir_problem", "make_dirs"]


class UnsafeDirectory(NotAuthorized):
    """A directory another user could control; `path` is the directory, `reason` why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"refusing directory {path}: {reason}", "not-dispatched")
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Trust:
    """Who may own a directory and which group may write it."""

    owners: frozenset[int]
    group_gid: int | None = None
    private: bool = False
    #: with a group: a directory of that group is trusted whoever owns it (a group member)
    group_owns: bool = False

    @classmethod
    def own(cls, group_gid: int | None = None, *, private: bool = False) -> Trust:
        """The router and the store: only this effective uid."""
        return cls(frozenset({os.geteuid()}), group_gid, private)

    @classmethod
    def client(cls, group_gid: int | None = None) -> Trust:
        """A bus client: its euid, root, or (with a socket group) a directory of that group."""
        return cls(frozenset({os.geteuid(), 0}), group_gid, False, group_gid is not None)


def dir_problem(st: os.stat_result, trust: Trust) -> str | None:
    """Why the directory `st` (from `lstat`/`fstat`) cannot be trusted, or None. Pure."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    mode = stat.S_IMODE(st.st_mode)
    by_group = trust.group_owns and st.st_gid == trust.group_gid
    if st.st_uid not in trust.owners and not by_group:
        wanted = " or ".join(f"uid {u}" for u in sorted(trust.owners))
        return f"it is owned by uid {st.st_uid}, not {wanted}"
    if trust.private and mode & 0o077:
        return f"its mode is {mode:04o}; it must grant group and others nothing (0700)"
    if mode & 0o002:
        return f"its mode is {mode:04o}: others may write it"
    if mode & 0o020 and (trust.group_gid is None or st.st_gid != trust.group_gid):
        return f"its mode is {mode:04o}: group {st.st_gid} may write it"
    return None


def _ancestor_problem(st: os.stat_result, owners: frozenset[int],
                      group_gid: int | None) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return None if st.st_uid in owners else f"it is a symlink owned by uid {st.st_uid}"
    if st.st_uid not in owners:
        return f"it is owned by uid {st.st_uid}"
    mode = stat.S_IMODE(st.st_mode)
    sticky = bool(mode & stat.S_ISVTX)
    if mode & 0o002 and not sticky:
        return f"its mode is {mode:04o}: others may write it"
    if mode & 0o020 and not sticky and st.st_gid not in (0, group_gid):
        return f"its mode is {mode:04o}: group {st.st_gid} may write it"
    return None


def _ancestors(path: str) -> Iterator[str]:
    """`path`'s parents, nearest first, up to `/`."""
    while True:
        parent = os.path.dirname(path)
        if parent == path:
            return
        yield parent
        path = parent


def check_dir(path: str, trust: Trust) -> None:
    """`UnsafeDirectory` unless `path` (a directory that exists) and every ancestor of it, as
    given and as resolved, pass the rule of the module docstring."""
    given = os.path.abspath(path)
    try:
        st = os.lstat(given)
    except OSError as exc:
        raise UnsafeDirectory(given, f"cannot stat it: {exc.strerror}") from exc
    problem = dir_problem(st, trust)
    if problem is not None:
        raise UnsafeDirectory(given, problem)
    owners = frozenset({0, st.st_uid, *trust.owners})
    resolved = os.path.realpath(given)
    seen: set[str] = set()
    for start in (given, resolved):
        for parent in _ancestors(start):
            if parent in seen:
                continue
            seen.add(parent)
            try:
                pst = os.lstat(parent)
            except OSError as exc:
                raise UnsafeDirectory(parent, f"cannot stat it: {exc.strerror}") from exc
            problem = _ancestor_problem(pst, owners, trust.group_gid)
            if problem is not None:
                raise UnsafeDirectory(parent, f"{problem} (an ancestor of {given})")


def check_socket_dir(socket_path: str, trust: Trust) -> None:
    """`check_dir` of the directory that holds the socket `socket_path`."""
    check_dir(os.path.dirname(os.path.abspath(socket_path)), trust)


def make_dirs(path: str, mode: int, group_gid: int | None = None) -> None:
    """Create `path` and its missing parents, each with `mode` exactly (and `group_gid`); an
    existing directory is left as it is (`check_dir` judges it)."""
    missing: list[str] = []
    here = os.path.abspath(path)
    while not os.path.lexists(here):
        missing.append(here)
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    old = os.umask(0o077)
    try:
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):  # a racing creator; judged later
                os.mkdir(directory, mode)
                if group_gid is not None:
                    os.chown(directory, -1, group_gid)
                os.chmod(directory, mode)
    finally:
        os.umask(old)
