"""The artifact store's files (topics.md §5): the router's side and the clients' helpers.

The router side (`Store`) owns one directory on a memory file system per router start: it
creates and locks it, sweeps the directories of dead routers, creates files with their pages
reserved, checks and hashes a file at seal, unlinks collected files and removes the directory
on an orderly stop. Every file operation is relative to the store directory's fd with
`O_NOFOLLOW`, so a symlink planted in the directory is never followed. The books (which
artifact lives, who may see it) are `bus/artifacts.py`'s; this module only does the syscalls.

The client side (`open_store_dir`, `map_for_write`, `write_whole`, `read_sealed`) is what the
SDK uses to write an allocation and read an attachment (topics.md §5.4, §5.6), with the same
no-follow rules. A frame-sized artifact is written with one `pwrite` and read with one `pread`
rather than mapped: for 256 KiB on tmpfs that costs about a third of mapping the file, faulting in
its 64 pages, copying and unmapping it (docs/performance.md, "Media"), and the reader gets bytes
that no later change of the file can touch. Larger artifacts are mapped, so nothing copies them
whole.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import mmap
import os
import secrets
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, TypeVar

from bus.errors import ArtifactGone, ArtifactMismatch, ArtifactUnsealed, StoreFailure
from bus.ownership import Trust, dir_problem

__all__ = [
    "DEFAULT_ROOT",
    "RAMFS_MAGIC",
    "READ_COPY_MAX",
    "SEAL_INLINE_BYTES",
    "TMPFS_MAGIC",
    "SealFile",
    "Store",
    "StoreSettings",
    "StoreStartError",
    "map_for_write",
    "memory_fs",
    "open_store_dir",
    "read_sealed",
    "statfs_type",
    "store_offer",
    "write_whole",
]

DEFAULT_ROOT: Final = "/dev/shm"
TMPFS_MAGIC: Final = 0x01021994
RAMFS_MAGIC: Final = 0x858458F6
#: seals of at most this many bytes hash in the handler, larger ones on the hashing thread
SEAL_INLINE_BYTES: Final = 1048576
#: sealed artifacts of at most this many bytes are read into memory with `pread`; larger ones
#: are mapped
READ_COPY_MAX: Final = 1048576
DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
WRITE_FLAGS: Final = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
CREATE_FLAGS: Final = WRITE_FLAGS | os.O_CREAT | os.O_EXCL
PROBE_NAME: Final = "lease-probe"

T = TypeVar("T")


class StoreStartError(RuntimeError):
    """The store cannot be set up; the router does not start (exit 2, naming the key)."""


@dataclass(frozen=True, slots=True)
class StoreSettings:
    """`[bus.store]`: read once by the config layer and handed to the router."""

    enabled: bool = True
    root: str = DEFAULT_ROOT


def memory_fs(f_type: int) -> bool:
    """A `statfs` type on which the store may live (topics.md §5.1 rule 1): tmpfs or ramfs."""
    return f_type in (TMPFS_MAGIC, RAMFS_MAGIC)


class _StatFs(ctypes.Structure):
    # struct statfs on 64-bit Linux; only f_type is read
    _fields_ = [("f_type", ctypes.c_long), ("f_rest", ctypes.c_long * 15)]


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def statfs_type(path: str) -> int:
    """The file-system magic number of `path` (Python's os has no statfs)."""
    buf = _StatFs()
    if _libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), path)
    return int(buf.f_type) & 0xFFFFFFFF


def store_offer(peer_uid: int, router_euid: int, store: T) -> T | None:
    """The hello's store for a peer (topics.md §5.1 rule 6): only the router's uid can use the 0700
    directory, so any other uid is offered none."""
    return store if peer_uid == router_euid else None


@dataclass(slots=True)
class SealFile:
    """A seal's open file between its checks and its hash."""

    fd: int
    length: int


class Store:
    """One router start's store directory. `open()` creates it; `remove()` ends it."""

    def __init__(self, root: str, parent_fd: int, dir_fd: int, store_id: str) -> None:
        self.parent_fd = parent_fd
        self.dir_fd = dir_fd
        self.store_id = store_id
        self.path = os.path.join(os.path.abspath(root), f"flyd-store-{os.geteuid()}", store_id)
        self.failed = False
        self.hashing = 0
        self._executor: ThreadPoolExecutor | None = None

    # start and stop ------------------------------------------------------------------------
    @classmethod
    def open(cls, root: str) -> Store:
        """topics.md §5.1 rules 1–5; StoreStartError says what is wrong."""
        try:
            f_type = statfs_type(root)
        except OSError as exc:
            raise StoreStartError(f"cannot statfs {root}: {exc.strerror}") from exc
        if not memory_fs(f_type):
            raise StoreStartError(f"{root} is not on tmpfs or ramfs (statfs type {f_type:#x})")
        parent = os.path.join(root, f"flyd-store-{os.geteuid()}")
        old = os.umask(0o077)
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(parent, 0o700)
        except OSError as exc:
            raise StoreStartError(f"cannot create {parent}: {exc.strerror}") from exc
        finally:
            os.umask(old)
        problem = dir_problem(os.lstat(parent), Trust.own(private=True))
        if problem is not None:
            raise StoreStartError(f"refusing directory {parent}: {problem}")
        try:
            parent_fd = os.open(parent, DIR_FLAGS)
        except OSError as exc:
            raise StoreStartError(f"cannot open {parent}: {exc.strerror}") from exc
        store_id = "store-" + secrets.token_hex(8)
        try:
            fcntl.flock(parent_fd, fcntl.LOCK_EX)
            try:
                _sweep(parent_fd)
                old = os.umask(0o077)
                try:
                    os.mkdir(store_id, 0o700, dir_fd=parent_fd)
                finally:
                    os.umask(old)
                dir_fd = os.open(store_id, DIR_FLAGS, dir_fd=parent_fd)
                fcntl.flock(dir_fd, fcntl.LOCK_EX)
            finally:
                fcntl.flock(parent_fd, fcntl.LOCK_UN)
        except OSError as exc:
            os.close(parent_fd)
            raise StoreStartError(f"cannot create the store directory in {parent}: "
                                  f"{exc.strerror}") from exc
        store = cls(root, parent_fd, dir_fd, store_id)
        try:
            store._probe_leases()
        except OSError as exc:
            store.remove()
            raise StoreStartError(
                f"file leases are unavailable ({exc.strerror}): seals need them "
                "(fs.leases-enable = 1); [bus.store] enabled = false runs without a store"
            ) from exc
        return store

    def _probe_leases(self) -> None:
        fd = os.open(PROBE_NAME, CREATE_FLAGS, 0o600, dir_fd=self.dir_fd)
        os.close(fd)
        try:
            fd = os.open(PROBE_NAME, READ_FLAGS, dir_fd=self.dir_fd)
            try:
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
                fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            finally:
                os.close(fd)
        finally:
            os.unlink(PROBE_NAME, dir_fd=self.dir_fd)

    def executor(self) -> ThreadPoolExecutor:
        """The one hashing thread (topics.md §5.5 rule 4), started on first use."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bus-hash")
        return self._executor

    def remove(self) -> None:
        """topics.md §5.1 rule 7: unlink every file, remove the directory, let the lock go."""
        if self._executor is not None:
            # never wait on the loop: a hash still running reads its own open fd to the end
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        if self.dir_fd < 0:
            return
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir_fd):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)
        with contextlib.suppress(OSError):
            os.rmdir(self.store_id, dir_fd=self.parent_fd)
        os.close(self.dir_fd)
        os.close(self.parent_fd)
        self.dir_fd = self.parent_fd = -1

    def _check_alive(self) -> None:
        """Rule 8: a store directory removed under the router fails the store."""
        if self.dir_fd < 0 or os.fstat(self.dir_fd).st_nlink == 0:
            self.failed = True
            raise StoreFailure("the store directory was removed")

    # files ---------------------------------------------------------------------------------
    def create(self, artifact_id: str, length: int) -> tuple[int, int]:
        """topics.md §5.3 check 8: the file with `length` bytes reserved; its `(st_dev, st_ino)`.
        Any failure unlinks the partial file and raises StoreFailure."""
        self._check_alive()
        try:
            fd = os.open(artifact_id, CREATE_FLAGS, 0o600, dir_fd=self.dir_fd)
        except OSError as exc:
            raise StoreFailure(f"cannot create {artifact_id}: {exc.strerror}") from exc
        try:
            os.posix_fallocate(fd, 0, length)
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(artifact_id, dir_fd=self.dir_fd)
            raise StoreFailure(f"cannot reserve {length} bytes for {artifact_id}: "
                               f"{exc.strerror}") from exc
        os.close(fd)
        return st.st_dev, st.st_ino

    def open_for_seal(self, artifact_id: str, length: int, file: object) -> SealFile:
        """topics.md §5.5 checks 6 and 7, in order; on success the file is 0444 with no writer and
        the returned fd reads it. A refusal leaves mode 0600."""
        self._check_alive()
        try:
            fd = os.open(artifact_id, READ_FLAGS, dir_fd=self.dir_fd)
        except OSError as exc:
            raise ArtifactMismatch(f"{artifact_id}: the allocated file is gone or replaced "
                                   f"({exc.strerror})") from exc
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != file
                or st.st_nlink != 1 or st.st_size != length):
            os.close(fd)
            raise ArtifactMismatch(f"{artifact_id}: the file is not the one allocated (replaced, "
                                   f"linked or resized)")
        os.fchmod(fd, 0o444)
        try:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as exc:
            os.fchmod(fd, 0o600)
            os.close(fd)
            if exc.errno == errno.EAGAIN:
                raise ArtifactUnsealed(f"{artifact_id} is still open for writing") from exc
            raise
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
        return SealFile(fd, length)

    def hash(self, seal: SealFile) -> str:
        """SHA-256 of a sealed file's bytes through a read-only mapping (any thread)."""
        with mmap.mmap(seal.fd, seal.length, prot=mmap.PROT_READ) as view:
            return hashlib.sha256(view).hexdigest()

    def finish_seal(self, seal: SealFile, accepted: bool) -> None:
        """Close the seal's fd; a refused hash puts the mode back to 0600 (topics.md §5.5 rule
        2)."""
        try:
            if not accepted:
                os.fchmod(seal.fd, 0o600)
        finally:
            os.close(seal.fd)

    def unlink(self, artifact_id: str) -> None:
        """A collected artifact's file goes; readers' mappings stay valid."""
        if self.dir_fd < 0:
            return
        try:
            os.unlink(artifact_id, dir_fd=self.dir_fd)
        except FileNotFoundError:
            return
        except OSError:
            self.failed = True


def _sweep(parent_fd: int) -> None:
    """topics.md §5.1 rule 3: remove every `store-*` directory no live router holds locked; never
    follow a symlink, never touch another entry."""
    for name in os.listdir(parent_fd):
        if not name.startswith("store-"):
            continue
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except OSError:
            continue  # a symlink (ELOOP) or not a directory: left alone
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live router's store
            for entry in os.listdir(fd):
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=fd)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=parent_fd)
        finally:
            os.close(fd)


# client helpers (topics.md §5.4, §5.6, §12) -------------------------------------------------------
def open_store_dir(path: str) -> int:
    """The hello's store directory, opened once: a directory of this euid, mode 0700."""
    try:
        fd = os.open(path, DIR_FLAGS)
    except OSError as exc:
        raise StoreFailure(f"cannot open the store directory {path}: {exc.strerror}") from exc
    problem = dir_problem(os.fstat(fd), Trust.own(private=True))
    if problem is not None:
        os.close(fd)
        raise StoreFailure(f"refusing directory {path}: {problem}")
    return fd


def _open_artifact(dir_fd: int, artifact_id: str, flags: int) -> int:
    try:
        return os.open(artifact_id, flags, dir_fd=dir_fd)
    except FileNotFoundError as exc:
        raise ArtifactGone(f"{artifact_id} is gone from the store") from exc
    except OSError as exc:
        raise ArtifactMismatch(f"{artifact_id} cannot be opened: {exc.strerror}") from exc


def map_for_write(dir_fd: int, artifact_id: str, length: int) -> mmap.mmap:
    """topics.md §5.4: a shared writable mapping of an Allocated artifact's `length` bytes (fd
    closed)."""
    fd = _open_artifact(dir_fd, artifact_id, WRITE_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != length:
            raise ArtifactMismatch(f"{artifact_id} is not a regular file of {length} bytes")
        return mmap.mmap(fd, length, flags=mmap.MAP_SHARED,
                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def write_whole(dir_fd: int, artifact_id: str, length: int, data: bytes | memoryview) -> None:
    """topics.md §5.4 without a mapping: the Allocated artifact's whole contents in `pwrite` calls,
    the fd closed before returning (a writer still open makes the seal refuse)."""
    if len(data) != length:
        raise ValueError(f"{artifact_id} holds {length} bytes; got {len(data)} to write")
    fd = _open_artifact(dir_fd, artifact_id, WRITE_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != length:
            raise ArtifactMismatch(f"{artifact_id} is not a regular file of {length} bytes")
        view = memoryview(data).cast("B")
        done = 0
        while done < length:
            done += os.pwrite(fd, view[done:], done)
    finally:
        os.close(fd)


def read_sealed(dir_fd: int, artifact_id: str, length: int) -> memoryview:
    """topics.md §5.6: a read-only view of a sealed artifact's bytes that stays readable after its
    collection: a private copy (one `pread`) up to READ_COPY_MAX bytes, a mapping above."""
    fd = _open_artifact(dir_fd, artifact_id, READ_FLAGS)
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_size != length
                or stat.S_IMODE(st.st_mode) != 0o444):
            raise ArtifactMismatch(f"{artifact_id} is not a sealed file of {length} bytes")
        if length > READ_COPY_MAX:
            return memoryview(mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
        data = os.pread(fd, length, 0)
        while len(data) < length:  # a regular file reads short only at its end
            more = os.pread(fd, length - len(data), len(data))
            if not more:
                raise ArtifactMismatch(f"{artifact_id} ended after {len(data)} of {length} bytes")
            data += more
        return memoryview(data)
    finally:
        os.close(fd)
