"""Configuration precedence and strictness (cli.md §2, §11 tests 3 and 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from flyd.config import KEYS, load_config, redact_dsn, validate_node_name
from flyd.durations import MAX_DURATION_MS, MAX_DURATION_S
from flyd.errors import ConfigError
from flyd.session.runspec import RunSpec, RunSpecError
from flyd.state.writer import CheckpointSettings


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """A clean environment: no FLYD_* variable leaks in from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYD_")}
    env.update(extra)
    return env


def _show(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flyd", "config", "show", "--json", *args],
                          env=_env(tmp_path, **env), capture_output=True, text=True,
                          timeout=60, check=False)


def _settings(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = orjson.loads(proc.stdout)["settings"]
    return out


def test_config_precedence_is_default_file_env_flag(tmp_path: Path) -> None:
    cfg = tmp_path / "flyd.toml"
    cfg.write_text("[leases]\nttl_s = 20\n")
    levels = [
        ((), {}, 15.0, "default"),
        (("--config", str(cfg)), {}, 20.0, "file"),
        (("--config", str(cfg)), {"FLYD_LEASE_TTL": "25"}, 25.0, "env"),
        (("--config", str(cfg), "--lease-ttl", "30"), {"FLYD_LEASE_TTL": "25"}, 30.0, "flag"),
    ]
    # every level, then remove them one at a time: the winner falls back in order
    for args, env, ttl, source in reversed(levels):
        settings = _settings(_show(tmp_path, *args, FLYD_STATE_DIR=str(tmp_path / "s"), **env))
        assert settings["leases.ttl_s"] == {"value": ttl, "source": source}
        assert settings["leases.heartbeat_interval_s"] == {"value": ttl / 5, "source": "default"}
        assert settings["node.state_dir"] == {"value": str(tmp_path / "s"), "source": "env"}
    cfg.write_text("[leases]\nttl_s = 20\nheartbeat_interval_s = 3\n")
    settings = _settings(_show(tmp_path, "--config", str(cfg), "--lease-ttl", "30"))
    assert settings["leases.heartbeat_interval_s"] == {"value": 3.0, "source": "file"}


@pytest.mark.parametrize(("toml", "key"), [
    ("[node]\nbogus = 1\n", "[node] bogus"),
    ("[nodes]\nname = 'a'\n", "[nodes]"),
    ("[leases]\nttl_s = 'long'\n", "[leases] ttl_s"),
    ("[node]\ncapacity = 0\n", "[node] capacity"),
    ("[session]\nmax_agents = 257\n", "[session] max_agents"),
    ("[leases]\nttl_s = 5\n", "[leases] ttl_s"),
])
def test_unknown_or_invalid_config_keys_are_refused_by_name(tmp_path: Path, toml: str,
                                                            key: str) -> None:
    cfg = tmp_path / "flyd.toml"
    cfg.write_text(f"{toml}[bus]\nsocket = '{tmp_path}/bus.sock'\n")
    state = tmp_path / "state"
    for command in (("config", "show"), ("db", "migrate")):
        proc = subprocess.run(
            [sys.executable, "-m", "flyd", *command, "--json", "--config", str(cfg)],
            env=_env(tmp_path, FLYD_STATE_DIR=str(state)), capture_output=True, text=True,
            timeout=60, check=False)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        error = orjson.loads(proc.stdout)
        assert list(error) == ["error"] and set(error["error"]) == {"code", "message"}
        assert error["error"]["code"] == "CONFIG"
        for stream in (error["error"]["message"], proc.stderr):
            assert key in stream and str(cfg) in stream
            if "ttl_s = 5" in toml:
                assert "§4.3.2" in stream
        assert "Traceback" not in proc.stderr
    # nothing started: no socket, no state dir (no embedded server)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flyd.toml"]


def test_defaults_depend_on_the_machine(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    config = load_config(None, {}, {"XDG_RUNTIME_DIR": str(tmp_path)})
    capacity = max(1, cpus // 4)
    assert config.value("node", "capacity") == capacity
    assert config.value("node", "threads") == max(cpus, 4 * capacity)
    assert config.value("checkpoints", "max_pending_effects") == 240
    assert config.value("bus", "socket") == f"{tmp_path}/flyd/bus.sock"
    assert config.config_file is None
    assert config.settings.leases.T == 15.0 and config.settings.leases.H == 3.0
    config = load_config(None, {"node.capacity": 8, "checkpoints.every_steps": 0}, {})
    assert config.value("node", "threads") == max(cpus, 32)
    assert config.value("checkpoints", "max_pending_effects") == 4096


def test_an_explicit_node_name_gets_its_own_socket_and_state_dirs(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path / "rt"), "XDG_STATE_HOME": str(tmp_path / "st")}
    if os.geteuid() == 0:
        env = {"XDG_RUNTIME_DIR": str(tmp_path / "rt")}
    config = load_config(None, {"node.name": "alpha"}, env)
    assert config.value("bus", "socket") == f"{tmp_path}/rt/flyd/alpha/bus.sock"
    assert config.value("node", "state_dir").endswith("/alpha")
    assert config.source("node", "name") == "flag"
    systemd = load_config(None, {}, {"FLYD_NODE_NAME": "beta", "RUNTIME_DIRECTORY": "/r",
                                     "STATE_DIRECTORY": "/s"})
    assert systemd.value("bus", "socket") == "/r/bus.sock"
    assert systemd.value("node", "state_dir") == "/s"
    assert systemd.source("node", "name") == "env"


def test_lease_ttl_sets_t_only_and_names_the_clause(tmp_path: Path) -> None:
    cfg = tmp_path / "flyd.toml"
    cfg.write_text("[leases]\nrenew_timeout_s = 1\n[database]\nconnect_timeout_s = 0\n")
    config = load_config(cfg, {"leases.ttl_s": 20}, {})
    assert config.settings.leases.T == 20.0 and config.settings.leases.H == 4.0
    assert config.settings.leases.R == 1.0 and config.settings.leases.safety_margin_s == 3.5
    with pytest.raises(ConfigError, match=r"§4\.3\.2") as info:
        load_config(cfg, {}, {"FLYD_LEASE_TTL": "4"})
    assert "FLYD_LEASE_TTL" in str(info.value)


def test_env_and_flag_values_are_checked_by_name() -> None:
    with pytest.raises(ConfigError, match=r"FLYD_LEASE_TTL.*ttl_s"):
        load_config(None, {}, {"FLYD_LEASE_TTL": "soon"})
    with pytest.raises(ConfigError, match=r"FLYD_LOG_LEVEL.*log_level"):
        load_config(None, {}, {"FLYD_LOG_LEVEL": "loud"})
    with pytest.raises(ConfigError, match=r"--capacity.*capacity"):
        load_config(None, {"node.capacity": 65}, {})
    with pytest.raises(ConfigError, match="--node-name"):
        load_config(None, {"node.name": "Bad_Name"}, {})
    with pytest.raises(ConfigError, match=r"/nonexistent/flyd\.toml: cannot read"):
        load_config(None, {}, {"FLYD_CONFIG": "/nonexistent/flyd.toml"})


def test_threads_must_cover_the_reservation(tmp_path: Path) -> None:
    cfg = tmp_path / "flyd.toml"
    cfg.write_text("[node]\nthreads = 4\ncoordinator_reservation = 2\n")
    with pytest.raises(ConfigError, match=rf"{cfg}: \[node\] threads = 4"):
        load_config(cfg, {}, {})


def test_show_redacts_the_dsn_password() -> None:
    config = load_config(None, {"database.dsn": "postgresql://u:hunter2@db/flyd"}, {})
    shown = config.show()
    assert shown["database.dsn"] == {"value": "postgresql://u:***@db/flyd", "source": "flag"}
    assert config.value("database", "dsn") == "postgresql://u:hunter2@db/flyd"
    assert "hunter2" not in redact_dsn("host=db password=hunter2 dbname=flyd")
    assert shown["bus.limits.max_clients"] == {"value": 64, "source": "default"}
    assert shown["bus.policy"] == {"value": "default", "source": "default"}


def test_validate_node_name() -> None:
    assert validate_node_name("node-1") == "node-1"
    for bad in ("", "-a", "A", "a_b", "a" * 33):
        with pytest.raises(ConfigError):
            validate_node_name(bad)


DURATIONS = [(section, key) for section, keys in KEYS.items() for key, spec in keys.items()
             if key.endswith(("_s", "_ms")) and spec.kind in ("int", "number")]


def test_every_duration_key_is_bounded_at_parse_time_by_name(tmp_path: Path) -> None:
    """Issue: `--lease-ttl 1e308` was accepted, then every claim failed with "timestamp out of
    range" while the command waited silently. Every duration (file, environment, flag) is
    finite and at most 2^31−1 ms, else refused naming the key and where it came from."""
    assert len(DURATIONS) >= 30, DURATIONS
    cfg = tmp_path / "flyd.toml"
    for section, key in DURATIONS:
        number = KEYS[section][key].kind == "number"
        absurd = ["1e308", "1e999", "-1e308", "nan", "inf", "-inf", "-1", str(10**400)] \
            if number else [str(2**63), str(MAX_DURATION_MS + 1), "-1"]
        for text in absurd:
            cfg.write_text(f"[{section}]\n{key} = {text}\n")
            with pytest.raises(ConfigError) as refused:
                load_config(cfg, {}, {})
            assert f"[{section}] {key}" in str(refused.value) and str(cfg) in str(refused.value)
            with pytest.raises(ConfigError) as refused:
                load_config(None, {f"{section}.{key}": text}, {})
            assert f"[{section}] {key}" in str(refused.value), refused.value
    for text in ("1e308", "nan", "inf", "-5", "0", "2147483.648"):
        with pytest.raises(ConfigError) as refused:
            load_config(None, {}, {"FLYD_LEASE_TTL": text})
        assert "environment FLYD_LEASE_TTL: [leases] ttl_s" in str(refused.value)
    # the bound itself is a valid duration
    leases = load_config(None, {"leases.ttl_s": MAX_DURATION_S}, {}).settings.leases
    assert leases.T == MAX_DURATION_S
    cfg.write_text(f"[database]\nclient_connection_check_interval_ms = {MAX_DURATION_MS}\n"
                   "[checkpoints]\ndurable_timeout_s = 2147483.647\nevery_seconds = 0\n")
    config = load_config(cfg, {}, {})
    assert config.value("database", "client_connection_check_interval_ms") == MAX_DURATION_MS
    assert config.value("checkpoints", "durable_timeout_s") == MAX_DURATION_S


@pytest.mark.parametrize(("where", "key"), [
    ("/checkpoints/durableTimeoutS", "durableTimeoutS"),
    ("/checkpoints/everySeconds", "everySeconds"),
    ("/paceS", "paceS"),
])
def test_run_spec_durations_share_the_bound(where: str, key: str) -> None:
    """The run spec's durations (its `checkpoints` are the camelCase `[checkpoints]` keys, same
    ranges) are bounded alike."""
    for value in (1e308, MAX_DURATION_S + 0.001, -1.0):
        doc: dict[str, Any] = ({"paceS": value} if key == "paceS"
                               else {"checkpoints": {key: value}})
        with pytest.raises(RunSpecError) as refused:
            RunSpec.validate(doc)
        assert refused.value.path == where
    ok: dict[str, Any] = ({"paceS": MAX_DURATION_S} if key == "paceS"
                          else {"checkpoints": {key: MAX_DURATION_S}})
    RunSpec.validate(ok)
    with pytest.raises(ConfigError, match="durable_timeout_s"):
        CheckpointSettings(durable_timeout_s=1e308)


def test_the_settings_are_typed_once_from_every_level(tmp_path: Path) -> None:
    """`Config.settings` carries each section typed, after precedence: what the node and the
    commands read instead of the key table."""
    cfg = tmp_path / "flyd.toml"
    cfg.write_text('[session]\nprobe_s = 4\nhealth_fail_s = 7\npacing = "realtime"\n'
                   '[checkpoints]\nevery_steps = 30\ndurable_timeout_s = 9\n'
                   '[database]\nlock_timeout_ms = 700\n[bus.limits]\nmax_clients = 99\n')
    config = load_config(cfg, {"bus.socket": str(tmp_path / "b.sock"), "node.capacity": 2},
                         {"FLYD_STATE_DIR": str(tmp_path / "s")})
    settings = config.settings
    assert settings.session.deadlines.probe == 4.0 and settings.session.deadlines.durable == 9.0
    assert settings.session.health.fail == 7.0 and settings.session.realtime
    assert settings.checkpoints.every_steps == 30
    assert settings.checkpoints.max_pending_effects is None  # derived from the run's cadence
    assert settings.database.dsn is None and settings.database.connection.lock_timeout_ms == 700
    assert settings.bus.limits.maxClients == 99 and settings.bus.policy is None
    assert (settings.bus.socket, settings.bus.socket_origin) == (str(tmp_path / "b.sock"),
                                                                 "flag --socket")
    assert settings.node.capacity == 2 and settings.node.state_dir == tmp_path / "s"
    default = load_config(None, {}, {}).settings
    assert not default.bus.socket_given and default.bus.socket_origin == "default"
    assert default.checkpoints == CheckpointSettings()
