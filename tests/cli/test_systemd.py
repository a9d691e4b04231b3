"""systemd integration (cli.md §5.2, §10, §11 test 2): sd_notify, the unit and its companions.

`flyd serve` runs as a real process with `NOTIFY_SOCKET` naming a datagram socket this test
binds (a path, or a name in the abstract namespace) and `WATCHDOG_USEC=2000000`; the test reads
what the node announces and checks each claim against the world (the router socket accepts, the
schema is migrated) at the moment it arrives.
"""

from __future__ import annotations

import asyncio
import configparser
import grp
import itertools
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from flyd.config import load_config
from flyd.leases.migrate import shipped_migrations
from flyd.leases.params import LeaseParams
from flyd.leases.stores.pg import DbSettings, PgStore
from flyd.node.sdnotify import Notifier, NotifyError, encode, notify, watchdog_interval
from flyd.session.runspec import RunSpec
from tests.serve_nodes import process_dir, processes_under, query

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
UNIT_DIR = ROOT / "systemd"
STATUS_RE = re.compile(r"^(serving|draining): \d+/1 runs held, \d+\.\d steps/s$")


@pytest.fixture
def tmp() -> Iterator[Path]:
    with process_dir("flyd-sd-") as path:
        yield path


class FakeManager:
    """The service manager's end of `NOTIFY_SOCKET`: every datagram with its arrival time."""

    def __init__(self, address: str, bind: str | bytes) -> None:
        self.address = address
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(bind)
        self.messages: list[tuple[float, dict[str, str]]] = []

    def close(self) -> None:
        self.sock.close()

    def receive(self, timeout: float) -> dict[str, str] | None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        fields = dict(line.split("=", 1) for line in data.decode().splitlines())
        self.messages.append((time.monotonic(), fields))
        return fields

    def until(self, key: str, timeout: float) -> dict[str, str]:
        """Receive until a datagram carries `key`; fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            fields = self.receive(left)
            if fields is not None and key in fields:
                return fields
        raise AssertionError(f"no {key} within {timeout} s; got {self.messages}")

    def until_status(self, pattern: str, timeout: float) -> str:
        """Receive until a `STATUS=` line matches `pattern`; fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            fields = self.receive(left)
            if fields is not None and re.match(pattern, fields.get("STATUS", "")):
                return fields["STATUS"]
        raise AssertionError(f"no STATUS matching {pattern} within {timeout} s; "
                             f"got {self.messages}")

    def drain_for(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.receive(left)

    def times(self, key: str, since: float = 0.0) -> list[float]:
        return [t for t, fields in self.messages if key in fields and t >= since]


@pytest.fixture(params=["path", "abstract"])
def manager(request: pytest.FixtureRequest, tmp: Path) -> Iterator[FakeManager]:
    if request.param == "path":
        path = str(tmp / "notify.sock")
        fake = FakeManager(path, path)
    else:
        name = f"flyd-test-notify-{uuid.uuid4().hex}"
        fake = FakeManager(f"@{name}", b"\0" + name.encode())
    try:
        yield fake
    finally:
        fake.close()


async def _submit(dsn: str, spec: Mapping[str, Any]) -> int:
    """Insert a run as `flyctl runs submit` does (`PgStore.submit`)."""
    store = PgStore(dsn, "test", DbSettings(), LeaseParams())
    await store.open()
    try:
        return (await store.submit(None, spec, 3)).run_id
    finally:
        await store.close()


def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def _schema_version(dsn: str) -> int:
    rows = query(dsn, "SELECT to_regclass('flyd.schema_migrations') IS NOT NULL")
    if not rows[0][0]:
        return 0
    return int(str(query(dsn, "SELECT coalesce(max(version), 0) FROM flyd.schema_migrations")
                   [0][0]))


def test_sd_notify_ready_status_watchdog_stopping(tmp: Path, manager: FakeManager,
                                                   db_dsn: str) -> None:
    newest = max(m.version for m in shipped_migrations())
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        conn.execute("DROP SCHEMA flyd CASCADE")  # the node must migrate before it is ready
    assert _schema_version(db_dsn) == 0
    toml = tmp / "flyd.toml"
    toml.write_text("")
    drain_s = load_config(toml).settings.leases.drain_timeout_s
    bus = tmp / "bus.sock"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FLYD_", "WATCHDOG_")) and k != "NOTIFY_SOCKET"}
    env.update(NOTIFY_SOCKET=manager.address, WATCHDOG_USEC="2000000")
    log = (tmp / "node.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "flyd", "serve", "--dsn", db_dsn, "--socket", str(bus),
         "--state-dir", str(tmp / "state"), "--node-name", "sdn", "--capacity", "1",
         "--config", str(toml), "--log-format", "json"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        ready = manager.until("READY", 60)
        # checked the moment READY=1 arrives: the router accepts and the schema is migrated
        assert _accepts(bus)
        assert _schema_version(db_dsn) == newest
        assert ready["READY"] == "1"
        assert STATUS_RE.match(ready["STATUS"]), ready
        assert "READY" in manager.messages[0][1], "nothing may precede READY=1 but pings"
        assert all("STOPPING" not in fields for _, fields in manager.messages)
        ready_at = manager.messages[-1][0]

        # the notification variables do not reach the router child
        routers = [p for p in processes_under(str(bus)) if "router" in " ".join(p.cmdline())]
        assert routers, "no router child found"
        for router in routers:
            assert "NOTIFY_SOCKET" not in router.environ()
            assert "WATCHDOG_USEC" not in router.environ()

        manager.drain_for(6.5)
        statuses = [f["STATUS"] for _, f in manager.messages if "STATUS" in f]
        assert len(statuses) >= 2, statuses
        assert all(STATUS_RE.match(s) and s.startswith("serving") for s in statuses), statuses
        pings = manager.times("WATCHDOG", since=ready_at)
        assert len(pings) >= 5, manager.messages
        gaps = [b - a for a, b in itertools.pairwise(pings)]
        assert 0.7 <= statistics.median(gaps) <= 1.3, gaps
        assert all(f["WATCHDOG"] == "1" for _, f in manager.messages if "WATCHDOG" in f)

        # a paced run held by the node shows in the summary with its step rate
        run = asyncio.run(_submit(db_dsn, RunSpec.validate({
            "steps": "600", "mode": "in-process", "pacing": "realtime",
            "agents": [{"agentId": a, "portId": f"p{i + 1}", "seed": None}
                       for i, a in enumerate(["fly-a", "fly-b"])]}).to_json()))
        busy = manager.until_status(r"^serving: 1/1 runs held, (?!0\.0 )", 30)
        assert float(busy.split(", ")[1].split()[0]) > 10, busy  # paced: about 60 steps/s

        term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        stopping = manager.until("STOPPING", drain_s)
        assert stopping["STOPPING"] == "1"
        assert stopping["STATUS"].startswith("draining: ")
        assert proc.wait(timeout=drain_s + 5 - (time.monotonic() - term)) == 0
        assert time.monotonic() - term <= drain_s + 5
        assert len(manager.times("STOPPING")) == 1
        # the drain released the held run for another node (distribution.md §5.8)
        assert query(db_dsn, "SELECT state::text FROM flyd.runs WHERE run_id = %s",
                     run) == [("pending",)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    text = (tmp / "node.log").read_text(errors="replace")
    assert "Traceback" not in text, text
    assert "drain_started" in text


# ---------------------------------------------------------------------------------- the unit

VENV_FLYD = "/opt/flyd/bin/flyd"  # the venv README installs into; systemd needs the full path
REQUIRED = {  # cli.md §10, directive by directive
    "Type": "notify", "NotifyAccess": "main",
    "ExecStart": f"{VENV_FLYD} serve --config /etc/flyd/flyd.toml", "Restart": "on-failure",
    "WatchdogSec": "30", "KillMode": "mixed", "TimeoutStopSec": "60", "User": "flyd",
    "Group": "flyd", "RuntimeDirectory": "flyd", "RuntimeDirectoryMode": "0750",
    "StateDirectory": "flyd", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
    "ProtectHome": "yes", "PrivateTmp": "yes",
}


def _unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string((UNIT_DIR / "flyd.service").read_text())
    return parser


def test_unit_names_every_directive_and_passes_systemd_analyze_verify(tmp: Path) -> None:
    unit = _unit()
    service = dict(unit["Service"])
    assert {k: service.get(k) for k in REQUIRED} == REQUIRED
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    # the stop timeout covers the drain window D + 5 s (distribution.md §5.8)
    assert int(service["TimeoutStopSec"]) >= load_config(None).settings.leases.drain_timeout_s + 5
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze is required (apt-get install systemd)"
    # an alternate root with the host's units, the unit installed and `flyd` where README
    # installs it (the venv under /opt/flyd) and nowhere on the executable search path, so
    # `verify` resolves ExecStart as it would on a host set up as README says
    root = tmp / "root"
    shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    installed = root / "etc/systemd/system/flyd.service"
    shutil.copy(UNIT_DIR / "flyd.service", installed)
    venv_bin = root / VENV_FLYD.lstrip("/")
    venv_bin.parent.mkdir(parents=True)
    shutil.copy(Path(sys.executable).parent / "flyd", venv_bin)

    def verify() -> subprocess.CompletedProcess[str]:
        return subprocess.run([analyze, "verify", f"--root={root}",
                               "/etc/systemd/system/flyd.service"],
                              capture_output=True, text=True, timeout=60, check=False)

    out = verify()
    # any warning at all fails: verify prints them and may still exit 0
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), (
        out.stdout + out.stderr)
    # and it would notice a broken unit: a command by bare name, and an unknown directive
    text = installed.read_text()
    installed.write_text(text.replace(f"ExecStart={VENV_FLYD} ", "ExecStart=flyd "))
    assert "Command flyd is not executable" in verify().stderr
    installed.write_text(text.replace("KillMode=mixed", "KillMode=mixed\nKilMode=x"))
    assert "KilMode" in verify().stderr


def test_example_config_is_valid_and_sets_the_socket_group(tmp: Path) -> None:
    text = (UNIT_DIR / "flyd.toml.example").read_text()
    assert tomllib.loads(text)["bus"] == {"socket_group": "flyd"}
    assert re.search(r"^# dsn = \"postgresql://", text, re.M), "[database] dsn is shown"
    # every commented example key is a real key: uncomment them all; `socket_group` must name an
    # existing group, so the test uses its own
    own = grp.getgrgid(os.getgid()).gr_name
    live = re.sub(r"^# (\w+ = .*)$", r"\1", text, flags=re.M).replace('"flyd"', f'"{own}"')
    cfg = tmp / "flyd.toml"
    cfg.write_text(live)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    out = subprocess.run([sys.executable, "-m", "flyd", "config", "show", "--json",
                          "--config", str(cfg)], env=env, capture_output=True, text=True,
                         timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    settings = orjson.loads(out.stdout)["settings"]
    assert settings["bus.socket_group"] == {"value": own, "source": "file"}
    assert settings["database.dsn"]["source"] == "file"
    assert settings["node.capacity"] == {"value": 2, "source": "file"}
    assert settings["leases.drain_timeout_s"]["source"] == "file"


def test_sysusers_and_tmpfiles_declare_the_flyd_account_and_config_dir(tmp: Path) -> None:
    sysusers = [line.split() for line in (UNIT_DIR / "flyd.sysusers").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert ["g", "flyd", "-"] in sysusers
    assert any(entry[:3] == ["u", "flyd", "-"] for entry in sysusers)
    tmpfiles = [line.split() for line in (UNIT_DIR / "flyd.tmpfiles").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert ["d", "/etc/flyd", "0750", "root", "flyd", "-"] in tmpfiles
    tool = shutil.which("systemd-sysusers")
    if tool is None:
        return  # the parse above is the whole test on a host without systemd
    root = tmp / "root"
    (root / "etc").mkdir(parents=True)
    for name in ("passwd", "group"):
        (root / "etc" / name).write_text("")
    out = subprocess.run([tool, "--dry-run", f"--root={root}", str(UNIT_DIR / "flyd.sysusers")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "Creating group 'flyd'" in out.stderr and "Creating user 'flyd'" in out.stderr


# ---------------------------------------------------------------------------------- sdnotify

def _bound(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + address[1:].encode() if address.startswith("@") else address)
    sock.settimeout(5)
    return sock


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_notifier_sends_key_value_lines(tmp_path: Path, kind: str) -> None:
    address = (str(tmp_path / "n.sock") if kind == "path"
               else f"@flyd-unit-{uuid.uuid4().hex}")
    sock = _bound(address)
    with sock:
        notifier = Notifier.from_environ({"NOTIFY_SOCKET": address})
        assert notifier.enabled
        assert notifier.send(READY=1, STATUS="serving:\n1 run")
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving: 1 run\n"
        assert notifier.send(WATCHDOG=1)
        assert sock.recv(4096) == b"WATCHDOG=1\n"


def test_notify_uses_the_process_environment(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    sock = _bound(str(tmp_path / "n.sock"))
    with sock:
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "n.sock"))
        assert notify(STOPPING=1)
        assert sock.recv(4096) == b"STOPPING=1\n"
        monkeypatch.delenv("NOTIFY_SOCKET")
        assert notify(STOPPING=1) is False  # unset: a no-op


def test_notifier_without_socket_is_a_no_op() -> None:
    notifier = Notifier.from_environ({})
    assert not notifier.enabled
    assert notifier.send(READY=1) is False
    assert Notifier.from_environ({"NOTIFY_SOCKET": ""}).send(READY=1) is False


def test_notifier_reports_a_vanished_socket_without_raising(tmp_path: Path) -> None:
    notifier = Notifier.from_environ({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert notifier.send(WATCHDOG=1) is False


def test_notifier_refuses_a_relative_address() -> None:
    with pytest.raises(NotifyError) as info:
        Notifier.from_environ({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert info.value.code == "CONFIG"
    assert "NOTIFY_SOCKET" in info.value.message


def test_encode_rejects_bad_keys_and_folds_lines() -> None:
    assert encode({"STATUS": "a\nb\r\nc"}) == b"STATUS=a b c\n"
    with pytest.raises(ValueError):
        encode({"ready": 1})


def test_watchdog_interval_is_half_of_usec_for_this_pid(
        monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"WATCHDOG_USEC": "2000000"}
    assert Notifier.from_environ(env, pid=42).watchdog_interval == 1.0
    assert Notifier.from_environ({**env, "WATCHDOG_PID": "42"}, pid=42).watchdog_interval == 1.0
    assert Notifier.from_environ({**env, "WATCHDOG_PID": "43"}, pid=42).watchdog_interval is None
    assert Notifier.from_environ({}, pid=42).watchdog_interval is None
    for bad in ("abc", "0", "-5"):
        with pytest.raises(NotifyError):
            Notifier.from_environ({"WATCHDOG_USEC": bad})
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert watchdog_interval() == 15.0
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval() is None


def test_from_environ_can_unset_the_variables() -> None:
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "7", "HOME": "/"}
    notifier = Notifier.from_environ(env, pid=7, unset=True)
    assert notifier.address == b"\0x" and notifier.watchdog_interval == 2.0
    assert env == {"HOME": "/"}

