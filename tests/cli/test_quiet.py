"""Quiet by default: a terminal sees the progress bar and warnings (`-v` for info); heartbeats
and per-write lines are debug; JSON lines to a pipe keep their info events.

`flyd run` runs for real (router, workers, the test's database) as in tests/cli/test_run.py; the
terminal case runs it in a pseudo terminal, so the console renderer and the bar are what a user
at a shell gets.

The logging keys of cli.md §2.3 (`[node] log_format` / `FLYD_LOG_FORMAT`, `[node] log_level` /
`FLYD_LOG_LEVEL`) are observed in what a real `flyd run` or `flyd serve` writes: with a key
ignored, the renderer or the levels of the lines differ.
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
from tests.cli.test_serve import run_state, spec_json, submit
from tests.serve_nodes import node_log, start_node, stop, wait_for

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
    env.pop("FLYD_LOG_FORMAT")  # the renderer is chosen by the terminal (or the config file)
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


def run_piped_text(tmp: Path, *args: str, **env: str) -> str:
    """`flyd run --json ARGS` with stderr to a pipe, `env` added to the environment: its
    stderr."""
    out = subprocess.run([sys.executable, "-m", "flyd", "run", "--json", *args, "--socket",
                          str(tmp / "bus.sock")], cwd=ROOT, env={**env_for(tmp), **env},
                         capture_output=True, timeout=120, check=False)
    assert not leftovers(tmp), "a router or worker outlived flyd run"
    assert out.returncode == 0, out.stderr.decode(errors="replace")[-3000:]
    assert orjson.loads(out.stdout)["state"] == "succeeded"
    return out.stderr.decode(errors="replace")


def run_piped(tmp: Path, *args: str, **env: str) -> list[dict[str, Any]]:
    """`flyd run --json ARGS` with stderr to a pipe: its JSON log lines (maybe none)."""
    text = run_piped_text(tmp, *args, **env)
    return [orjson.loads(line) for line in text.splitlines() if line.startswith("{")]


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


# -- the logging keys of cli.md §2.3 take effect (docs/configuration.md) -----------------------

# a short unpaced run that still writes checkpoints (every 60 steps): per-write debug lines
SHORT = ("--steps", "120", "--mode", "thread")
WRITES = ("write_begin", "checkpoint.queued", "checkpoint.committed")


def _config(tmp: Path, text: str) -> str:
    path = tmp / "flyd.toml"
    path.write_text(text)
    return str(path)


def test_flyd_log_level_is_the_base_level_and_beats_the_file(tmp: Path) -> None:
    config = _config(tmp, '[node]\nlog_level = "warning"\n')
    lines = run_piped(tmp, "--config", config, *SHORT, FLYD_LOG_LEVEL="debug")
    levels = {line["event"]: line["level"] for line in lines}
    assert {levels.get(name) for name in WRITES} == {"debug"}, levels
    assert all(levels.get(name) == "info" for name in INFO), levels

    quieter = run_piped(tmp, "-q", *SHORT, FLYD_LOG_LEVEL="debug")  # -q shifts it to info
    events = {line["event"] for line in quieter}
    assert set(INFO) <= events and events.isdisjoint(WRITES), sorted(events)


def test_node_log_level_in_the_file_is_the_base_level(tmp: Path) -> None:
    config = _config(tmp, '[node]\nlog_level = "warning"\n')
    lines = run_piped(tmp, "--config", config, *SHORT)
    assert [line for line in lines if line["level"] in ("debug", "info")] == [], lines

    louder = run_piped(tmp, "--config", config, "-v", *SHORT)  # -v shifts it to info
    levels = {line["event"]: line["level"] for line in louder}
    assert all(levels.get(name) == "info" for name in INFO), levels
    assert {line["level"] for line in louder} <= {"info", "warning", "error"}, levels


def test_flyd_log_format_console_beats_the_file_and_the_pipe(tmp: Path) -> None:
    config = _config(tmp, '[node]\nlog_format = "json"\n')
    text = run_piped_text(tmp, "--config", config, "-v", *SHORT, FLYD_LOG_FORMAT="console")
    assert not [line for line in text.splitlines() if line.startswith("{")], text
    shown = [line for line in text.splitlines() if "[info" in line]
    assert all(any(name in line for line in shown) for name in INFO), text


def test_node_log_format_json_in_the_file_beats_the_terminal(tmp: Path) -> None:
    config = _config(tmp, '[node]\nlog_format = "json"\n')
    code, text = run_in_terminal(tmp, "--config", config, *SHORT)
    assert code == 0, text
    # a JSON line may follow the bar's last redraw on the same terminal line
    lines = [orjson.loads(line[line.index('{"'):]) for line in text.splitlines()
             if '{"' in line]
    events = {line["event"] for line in lines}
    assert set(INFO) <= events, text              # JSON lines start at info, as to a pipe
    assert "[info" not in text, text              # and no console lines


def test_node_log_level_in_the_file_sets_a_serving_nodes_level(db_dsn: str, tmp: Path) -> None:
    # start_node passes -v: the file's "error" shifted one step is warning
    node = start_node(tmp, "quiet", db_dsn, config='[node]\nlog_level = "error"\n')
    try:
        run = submit(db_dsn, spec_json(10))
        wait_for("the node to finish the run", lambda: run_state(db_dsn, run)[0] in (
            "succeeded", "failed", "cancelled"), 120)
        assert run_state(db_dsn, run)[0] == "succeeded"    # the node claimed and ran it
    finally:
        code = stop(node)
    assert code == 0
    lines = [orjson.loads(line) for line in node_log(tmp, "quiet").splitlines()
             if line.startswith("{")]
    assert [line for line in lines if line["level"] in ("debug", "info")] == [], lines
