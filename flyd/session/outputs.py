"""Files a run writes as it goes: the `--trace` file across grants, and the error of any
output file (`OutputWriteError`).

Why: a run may be re-granted (a lost lease, a PostgreSQL interruption) and recovered within a
grant; its trace must still end up with every boundary once, and a disk that fills up under
it must end the run naming the file, not burn the run's attempts on a fault no attempt can
repair.

`TraceFile` (one per run and node, outliving the run's grants):
- Every committed transition's behaviour record (canonical JSON, one line) is appended as it
  is recorded (`append`), through one buffered handle, and flushed whenever the run's head
  moves (`durable`) and before the run's final transaction (`flush`), so a write error
  surfaces while the run can still fail because of it.
- Records beyond the durable head may be executed again: a recovery or a new grant resumes
  from the head. `resume(boundary, mark)` cuts the file back to the end of record `boundary`
  (the records of the abandoned transitions are **replaced** by those of their re-execution,
  never kept twice) and writes a resume line `{"resume": {...}}` there. Each grant's first
  line is such a mark (`cause: "grant"`, boundary 0 for the first), and so is each
  recovery's (`cause: "recovery"`). So the file holds every boundary of the run once, in
  order, with a mark wherever execution resumed; a reader skips lines with a `resume` key.
- Only the positions of records beyond the last durable boundary are kept (`durable` forgets
  the others), so memory stays bounded by the checkpoint cadence. A resume before the last
  durable boundary cannot happen (the head never goes back) and is `INTERNAL`; one beyond the
  last record written (a run started from an imported checkpoint) writes its mark at the end.

`OutputWriteError`: an `OSError` writing an output file, with the option, the path and the
errno's name. Retrying the run cannot repair a full disk or a read-only file, and a recovery
would only write the same bytes again, so the grant session ends the run `failed` at once with
`outcome()` = `{error: "output write failed", option, path, errno, message}` (no recovery
attempt, no further grant). After its error a `TraceFile` writes nothing more and `close()`
raises nothing, so `flyd run` still prints its summary.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import os
from pathlib import Path
from typing import IO, Any

from workers.types.canonical import canonical
from workers.types.domain import DomainError, ErrorCode, Mutation

__all__ = ["OutputWriteError", "TraceFile"]


class OutputWriteError(Exception):
    """An output file of the run could not be written (module rules)."""

    def __init__(self, option: str, path: Path, exc: OSError) -> None:
        self.option = option
        self.path = path
        self.errno = errnos.errorcode.get(exc.errno or 0, str(exc.errno))
        self.strerror = exc.strerror or str(exc)
        super().__init__(f"{option} {path}: {self.errno} ({self.strerror})")

    def outcome(self) -> dict[str, Any]:
        """The run's `failed` outcome."""
        return {"error": "output write failed", "option": self.option, "path": str(self.path),
                "errno": self.errno, "message": self.strerror}


class TraceFile:
    """One run's `--trace` file on this node (module rules). The file exists (created empty
    before the run starts) and is written only through this object."""

    def __init__(self, path: Path, option: str = "--trace") -> None:
        self.path = path
        self.option = option
        self.boundary = 0
        """The last boundary whose record is in the file."""
        self.error: OutputWriteError | None = None
        self._fh: IO[bytes] | None = None
        self._durable = 0
        self._ends: dict[int, int] = {0: 0}
        """Boundary k ≥ the durable one → the offset where what follows record k starts."""

    def _handle(self) -> IO[bytes]:
        if self._fh is None:
            self._fh = self.path.open("r+b")
            self._fh.seek(self._ends[self.boundary])
        return self._fh

    def _failed(self, exc: OSError) -> OutputWriteError:
        self.error = OutputWriteError(self.option, self.path, exc)
        fh, self._fh = self._fh, None
        if fh is not None:
            with contextlib.suppress(OSError):  # the unwritten buffer: the error is kept
                fh.close()
        return self.error

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def append(self, boundary: int, data: bytes) -> None:
        """The record of the transition that ends at `boundary` (the next one)."""
        self._check()
        if boundary != self.boundary + 1:
            raise DomainError(ErrorCode.INTERNAL, f"trace file: record of boundary {boundary} "
                              f"after boundary {self.boundary}", Mutation.NONE)
        try:
            fh = self._handle()
            fh.write(data + b"\n")
            self._ends[boundary] = fh.tell()
        except OSError as exc:
            raise self._failed(exc) from None
        self.boundary = boundary

    def resume(self, boundary: int, mark: dict[str, Any]) -> None:
        """Execution resumes after `boundary`: cut what follows it, then write the mark."""
        self._check()
        if boundary > self.boundary:  # a run that started from an imported checkpoint
            self._ends = {boundary: self._ends[self.boundary]}
            self._durable = self.boundary = boundary
        end = self._ends.get(boundary)
        if end is None:
            raise DomainError(ErrorCode.INTERNAL, f"trace file: cannot resume at boundary "
                              f"{boundary} (durable {self._durable}, written {self.boundary})",
                              Mutation.NONE)
        try:
            fh = self._handle()
            fh.flush()
            if fh.seek(0, os.SEEK_END) > end:
                fh.seek(end)
                fh.truncate()
            fh.write(canonical({"resume": mark}) + b"\n")
            self._ends = {k: v for k, v in self._ends.items() if k < boundary}
            self._ends[boundary] = fh.tell()
        except OSError as exc:
            raise self._failed(exc) from None
        self.boundary = boundary

    def flush(self) -> None:
        """Write out what is buffered."""
        self._check()
        try:
            if self._fh is not None:
                self._fh.flush()
        except OSError as exc:
            raise self._failed(exc) from None

    def durable(self, boundary: int) -> None:
        """The run's head now covers `boundary`: when that is further than before, write out
        what is buffered and forget the positions before it."""
        if boundary <= self._durable:
            return
        self.flush()
        self._durable = min(boundary, self.boundary)
        self._ends = {k: v for k, v in self._ends.items() if k >= self._durable}

    def close(self) -> OutputWriteError | None:
        """Flush and close (the run ended); the error, if writing ever failed."""
        if self.error is None and self._fh is not None:
            try:
                self._fh.flush()
                self._fh.close()
            except OSError as exc:
                self._failed(exc)
            self._fh = None
        return self.error
