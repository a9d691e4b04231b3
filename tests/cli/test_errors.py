"""Errors as JSON, exit codes and the status table on a terminal (cli.md §1; §11 #5, #6)."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import orjson
import pytest

from tests.cli.test_flyctl import live_status, paced_run
from tests.cli.test_flyctl_runs import FLYCTL, ROOT, Site, flyctl, serve
from tests.cli.test_flyctl_runs import site as site

pytestmark = pytest.mark.timeout(300)

UNREACHABLE = "postgresql://nobody@127.0.0.1:1/nothing?connect_timeout=2"


def _flyd(site: Site, *args: str) -> tuple[int, str, str]:
    out = subprocess.run([sys.executable, "-m", "flyd", *args], cwd=ROOT, env=site.env(),
                         capture_output=True, timeout=60, check=False)
    return out.returncode, out.stdout.decode(), out.stderr.decode()


def _error_of(code: int, out: str, err: str) -> tuple[int, str]:
    assert "Traceback" not in out and "Traceback" not in err, (out, err)
    lines = out.splitlines()
    assert len(lines) == 1, (out, err)
    doc = orjson.loads(lines[0])
    assert set(doc) == {"error"} and set(doc["error"]) == {"code", "message"}, doc
    assert doc["error"]["message"]
    return code, str(doc["error"]["code"])


def test_every_command_reports_errors_as_json_with_a_code(site: Site) -> None:
    def ctl(*args: str) -> tuple[int, str]:
        ran = flyctl(site, *args)
        return _error_of(ran.code, ran.out, ran.err)

    def flyd(*args: str) -> tuple[int, str]:
        return _error_of(*_flyd(site, *args, "--json"))

    missing = str(site.path / "missing.toml")
    # without a node: no router, unknown runs, bad arguments, unreachable DSN
    assert ctl("kill", "fly-a") == (2, "CONFIG")
    assert ctl("drain") == (2, "CONFIG")
    assert ctl("kill", "fly-a", "--signal", "HUP") == (2, "USAGE")
    assert ctl("runs", "show", "999") == (2, "USAGE")
    assert ctl("runs", "cancel", "999") == (2, "USAGE")
    assert ctl("runs", "requeue", "999") == (2, "USAGE")
    assert ctl("runs", "show", "abc") == (2, "USAGE")
    assert ctl("runs", "list", "--state", "odd") == (2, "USAGE")
    assert ctl("runs", "submit", "--fault", "fly-q.bogus=1") == (2, "USAGE")
    assert ctl("runs", "submit", "--steps", "-1") == (2, "USAGE")
    assert ctl("runs", "list", "--dsn", UNREACHABLE) == (2, "CONFIG")
    assert ctl("runs", "submit", "--dsn", UNREACHABLE) == (2, "CONFIG")
    assert ctl("status", "--dsn", UNREACHABLE) == (2, "CONFIG")
    assert ctl("status", "--config", missing) == (2, "CONFIG")
    assert flyd("run", "--fault", "fly-a.nope=1") == (2, "USAGE")
    assert flyd("run", "--mode", "warp") == (2, "USAGE")
    assert flyd("serve", "--node-name", "Bad_Name") == (2, "CONFIG")
    assert flyd("serve", "--dsn", UNREACHABLE, "--socket", site.socket) == (2, "CONFIG")
    assert flyd("db", "migrate", "--dsn", UNREACHABLE) == (2, "CONFIG")
    assert flyd("config", "show", "--config", missing) == (2, "CONFIG")
    # with a node: an unknown node, and the control service's refusals (exit 1)
    serve(site, "n1")
    assert ctl("drain", "--node", "nosuch") == (2, "USAGE")
    assert ctl("kill", "fly-a", "--node", "nosuch") == (2, "USAGE")
    assert ctl("kill", "fly-a", "--run", "7") == (1, "IDENTITY_MISMATCH")
    gone = flyctl(site, "kill", "fly-a")
    assert gone.code == 1 and gone.json["outcome"] == "AlreadyGone"


def _read_all(fd: int, proc: subprocess.Popen[bytes]) -> str:
    chunks: list[bytes] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks).decode()


def _aligned(text: str) -> list[str]:
    """The table's lines; every row's cells start where the header's columns start."""
    lines = [line.rstrip("\r") for line in text.splitlines()]
    head = next(i for i, line in enumerate(lines) if line.startswith("RUN  WORKER"))
    table = lines[head:head + 4]
    starts = [m.start() for m in re.finditer(r"\S+", table[0])]
    assert len(starts) == 9, table[0]
    for row in table[1:]:
        assert [m.start() for m in re.finditer(r"\S+", row)] == starts, table
    return table


def test_flyctl_status_renders_in_a_pseudo_terminal(site: Site) -> None:
    run = paced_run(site, "run.log")
    live_status(site)
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen([*FLYCTL, "status", "--socket", site.socket], cwd=ROOT,
                                env=site.env(), stdin=slave, stdout=slave, stderr=slave)
        os.close(slave)
        text = _read_all(master, proc)
        assert proc.wait(timeout=30) == 0
    finally:
        os.close(master)
    assert "Traceback" not in text and "{" not in text
    table = _aligned(text)
    assert {row.split()[1] for row in table[1:]} == {"arena", "fly-a", "fly-b"}
    assert text.lstrip().startswith("router ") and "\nnode " in text
    piped = flyctl(site, "status", json=False)
    assert piped.code == 0 and piped.err == ""
    assert len(_aligned(piped.out)) == 4
    run.terminate()
    run.wait(timeout=60)
