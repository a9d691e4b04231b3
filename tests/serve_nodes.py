"""Real `flyd serve` node processes for tests (shared by the cli and distribution suites).

Every node gets its own socket, state dir and name under a temporary directory, so the
processes it starts (router and workers carry `--socket <tmp>/...`) are found by command line
and a test can prove none survives.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import psycopg

ROOT = Path(__file__).resolve().parents[1]


def processes_under(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line names `marker`."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if marker in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
                found.append(proc)
        except (psutil.Error, TypeError):
            continue
    return found


def commands_under(marker: str) -> list[tuple[psutil.Process, str]]:
    """`(process, command line)` of `processes_under(marker)`, read once: a process that exits
    meanwhile is simply absent (asking it again later would raise `NoSuchProcess`)."""
    found = []
    for proc in processes_under(marker):
        try:
            found.append((proc, " ".join(proc.cmdline())))
        except psutil.Error:
            continue
    return found


def start_node(tmp: Path, name: str, dsn: str, *args: str,
               config: str = "") -> subprocess.Popen[bytes]:
    """`python -m flyd serve` as node `name`; stderr (JSON logs) goes to `<tmp>/<name>/node.log`."""
    home = tmp / name
    home.mkdir(exist_ok=True)
    toml = home / "flyd.toml"
    toml.write_text(config)
    env = {k: v for k, v in os.environ.items()
           if k not in ("FLYD_SOCKET", "FLYD_DSN", "FLYD_CONFIG", "FLYD_NODE_NAME",
                        "NOTIFY_SOCKET")}
    log = (home / "node.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "flyd", "serve", "--dsn", dsn, "--socket",
         str(home / "bus.sock"), "--state-dir", str(home), "--node-name", name,
         "--config", str(toml), "--log-format", "json", "-v", *args],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)


def node_log(tmp: Path, name: str) -> str:
    path = tmp / name / "node.log"
    return path.read_text(errors="replace") if path.exists() else ""


def query(dsn: str, sql: str, *args: object) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql, args).fetchall()  # type: ignore[arg-type]


def wait_for(what: str, check: Callable[[], bool], timeout: float) -> None:
    """Poll `check` every 0.1 s; fail naming `what` after `timeout` real seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def stop(proc: subprocess.Popen[bytes], timeout: float = 30) -> int:
    """SIGTERM (a drain), then SIGKILL if it does not exit in time; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def process_dir(prefix: str) -> Iterator[Path]:
    """A temporary directory for a test's sockets and state; every process naming it in its
    command line must be gone at the end (given 5 s to exit), else the test fails listing them
    (and they are killed)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        yield path
    finally:
        with contextlib.suppress(AssertionError):
            wait_for("the test's processes to end", lambda: not processes_under(str(path)), 5)
        survivors = processes_under(str(path))
        for proc in survivors:
            proc.kill()
        shutil.rmtree(path, ignore_errors=True)
        assert not survivors, f"processes outlived the test: {survivors}"
