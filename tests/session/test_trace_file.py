"""`TraceFile` (flyd.session.outputs): a run's `--trace` file across recoveries and grants holds
every boundary once, with a resume mark wherever execution resumed; a write error is an
`OutputWriteError` naming the option, the path and the errno, after which nothing more is
written and `close()` raises nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from flyd.session.outputs import OutputWriteError, TraceFile
from workers.types.canonical import canonical
from workers.types.domain import DomainError


def record(k: int, epoch: str = "e1") -> bytes:
    """The record of the transition that ends at boundary k."""
    return canonical({"scope": {"epoch": epoch, "step": str(k - 1)}})


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def steps(path: Path) -> list[int]:
    return [int(doc["scope"]["step"]) + 1 for doc in lines(path) if "resume" not in doc]


def mark(boundary: int, cause: str) -> dict[str, Any]:
    return {"boundary": str(boundary), "cause": cause}


def test_a_resume_replaces_the_records_after_its_boundary_and_marks_it(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"")
    trace = TraceFile(path)
    trace.resume(0, mark(0, "grant"))
    for k in range(1, 8):
        trace.append(k, record(k))
    trace.durable(4)
    trace.resume(4, mark(4, "recovery"))  # 5..7 are executed again, in e2
    for k in range(5, 11):
        trace.append(k, record(k, "e2"))
    trace.resume(9, mark(9, "grant"))  # a new grant from head 9
    trace.append(10, record(10, "e4"))
    assert trace.close() is None
    docs = lines(path)
    assert steps(path) == list(range(1, 11))  # every boundary once
    assert [d["resume"] for d in docs if "resume" in d] == [
        mark(0, "grant"), mark(4, "recovery"), mark(9, "grant")]
    assert docs[0] == {"resume": mark(0, "grant")}  # the grant's first line
    assert [d["scope"]["epoch"] for d in docs if "scope" in d] == (
        ["e1"] * 4 + ["e2"] * 5 + ["e4"])
    assert docs.index({"resume": mark(4, "recovery")}) == 5  # right after record 4


def test_a_resume_at_the_same_boundary_keeps_the_earlier_mark(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"")
    trace = TraceFile(path)
    trace.resume(0, mark(0, "grant"))
    trace.append(1, record(1))
    trace.resume(0, mark(0, "recovery"))
    trace.append(1, record(1, "e2"))
    trace.close()
    assert lines(path) == [{"resume": mark(0, "grant")}, {"resume": mark(0, "recovery")},
                           orjson.loads(record(1, "e2"))]


def test_a_resume_before_the_durable_boundary_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"")
    trace = TraceFile(path)
    trace.resume(0, mark(0, "grant"))
    for k in range(1, 6):
        trace.append(k, record(k))
    trace.durable(5)
    with pytest.raises(DomainError, match="cannot resume at boundary 3"):
        trace.resume(3, mark(3, "recovery"))
    with pytest.raises(DomainError, match="record of boundary 7 after boundary 5"):
        trace.append(7, record(7))


def test_a_write_error_names_the_path_and_errno_and_stops_writing() -> None:
    trace = TraceFile(Path("/dev/full"))
    trace.resume(0, mark(0, "grant"))
    trace.append(1, record(1))
    with pytest.raises(OutputWriteError) as caught:
        trace.durable(1)
    error = caught.value
    assert error.outcome() == {"error": "output write failed", "option": "--trace",
                               "path": "/dev/full", "errno": "ENOSPC",
                               "message": "No space left on device"}
    with pytest.raises(OutputWriteError):
        trace.append(2, record(2))
    assert trace.close() is error  # nothing raised: flyd run still prints its summary
