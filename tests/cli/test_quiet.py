"""Quiet by default: a terminal sees the progress bar and warnings (`-v` for info); heartbeats
and per-write lines are debug; JSON lines to a pipe keep their info events.

`flyd run` runs for real (router, workers, the test's database) as in tests/cli/test_run.py; the
terminal case runs it in a pseudo terminal, so the console renderer and the bar are what a user
at a shell gets.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.cli.test_run import ROOT, env_for, leftovers
from tests.cli.test_run import tmp as tmp

pytestmark = pytest.mark.timeout(180)

# one line per heartbeat or per write: debug
PER_BEAT_OR_WRITE = ("renew_sent", "renewed", "write_begin", "checkpoint.queued",
                     "checkpoint.committed")
# info events of every run, as before
INFO = ("run.submitted", "claimed", "launcher.launched", "finished")
# a paced run of 5 s with T = 12 s (the shortest the other defaults allow: a heartbeat every
# 2.4 s), so heartbeats do happen
PACED = ("--pace", "--steps", "300", "--mode", "thread", "--lease-ttl", "12")


def _read_all(fd: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> str:
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: every writer closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=30)
    return b"".join(chunks).decode(errors="replace")


def run_in_terminal(tmp: Path, *args: str) -> tuple[int, str]:
    """`flyd run ARGS` with stdout and stderr on a pseudo terminal; (exit code, text)."""
    env = env_for(tmp)
    env.pop("FLYD_LOG_FORMAT")  # the renderer is chosen by the terminal
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "flyd", "run", *args, "--socket",
                                 str(tmp / "bus.sock")], cwd=ROOT, env=env, stdin=slave,
                                stdout=slave, stderr=slave)
        os.close(slave)
        text = _read_all(master, proc)
    finally:
        os.close(master)
    assert not leftovers(tmp), "a router or worker outlived flyd run"
    assert "Traceback" not in text, text
    return proc.returncode, text


def run_piped(tmp: Path, *args: str) -> list[dict[str, Any]]:
    """`flyd run --json ARGS` with stderr to a pipe: its JSON log lines."""
    out = subprocess.run([sys.executable, "-m", "flyd", "run", "--json", *args, "--socket",
                          str(tmp / "bus.sock")], cwd=ROOT, env=env_for(tmp),
                         capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-3000:]
    assert orjson.loads(out.stdout)["state"] == "succeeded"
    lines = [orjson.loads(line) for line in out.stderr.splitlines() if line.startswith(b"{")]
    assert lines, out.stderr
    return lines


def test_a_terminal_sees_the_bar_and_no_info_lines(tmp: Path) -> None:
    code, text = run_in_terminal(tmp, *PACED)
    assert code == 0, text
    assert "] 300/300 steps" in text, text               # the bar reached its end
    assert "flyd run: run " in text and " succeeded " in text
    shown = [name for name in (*INFO, *PER_BEAT_OR_WRITE) if name in text]
    assert shown == [], text

    code, verbose = run_in_terminal(tmp, "-v", *PACED)
    assert code == 0, verbose
    assert all(name in verbose for name in INFO), verbose  # -v: info
    assert [name for name in PER_BEAT_OR_WRITE if name in verbose] == [], verbose


def test_json_to_a_pipe_keeps_info_and_moves_beats_and_writes_to_debug(tmp: Path) -> None:
    lines = run_piped(tmp, *PACED)
    events = {line["event"] for line in lines}
    assert set(INFO) <= events
    assert events.isdisjoint(PER_BEAT_OR_WRITE), sorted(events)
    assert {"event", "level", "ts"} <= set(lines[0])    # the lines' form is unchanged

    debug = run_piped(tmp, "-v", *PACED)
    levels = {line["event"]: line["level"] for line in debug}
    assert {levels.get(name) for name in PER_BEAT_OR_WRITE} == {"debug"}, levels
    assert all(levels[name] == "info" for name in INFO)
