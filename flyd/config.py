"""Configuration: the key table of design/cli.md §2.3, its sources and the router's view
(design/wire.md §12–§14).

Rules:
- Precedence is built-in defaults < config file < environment < flags (design/cli.md §2.1); every
  value remembers its source (`default`, `file`, `env`, `flag`) for `flyd config show`.
- Strict by design: an unknown section or key, a wrong type or an out-of-range value is a
  `ConfigError` naming the key and where it came from (the file, the environment variable or the
  flag), never silently ignored. Related keys are checked together: `[node] threads` against the
  coordinator reservation, `[bus]` by the router's own checks, and the lease invariant of
  design/distribution.md §4.3 through `LeaseParams` (its clause named).
- The config file is `--config PATH`, else `FLYD_CONFIG`, else `/etc/flyd/flyd.toml` if it
  exists, else none.
- Every duration key (`*_s`, `*_ms`), from the file, the environment or a flag, is finite and
  at most 2^31−1 ms (`flyd.durations`); keepalive times and counts stay within what Linux
  accepts. NaN, infinities, negative and absurd values are refused naming the key.
- `--lease-ttl` / `FLYD_LEASE_TTL` / `[leases] ttl_s` set T only: H follows T/5 unless
  `[leases] heartbeat_interval_s` is set (design/distribution.md §4.2).
- Read once, typed: `load_config` builds `Settings` (one typed value per section) beside the
  key table; the node and the commands read those, and no module but this one reads a key by its
  section's name. The key table (`Config.value`, `source`, `origin`) serves `flyd config show`
  and error messages.

Decisions where the spec is silent:
- "Given explicitly" for the `<name>` subdirectory rule of design/cli.md §2.2 means a node name from
  the file, the environment or a flag; systemd's `RUNTIME_DIRECTORY` / `STATE_DIRECTORY` never gain
  it.
- Derived defaults (`[node] threads`, `[leases] heartbeat_interval_s`,
  `[checkpoints] max_pending_effects`) are shown with their computed value and source `default`.
- `flyd config show` lists every `[bus.limits]` key as `bus.limits.<key>`; `bus.policy` is the
  table from the file or the string `"default"` (design/session.md §7.2's policy).
- Values read from the environment or given as strings on flags are parsed by the key's type.
- `[plugins] paths` (import roots of plugin packages): a relative entry is resolved against the
  directory of the config file that names it (not the working directory of whoever starts the
  node, which differs between a shell and systemd); `--plugin-path DIR` is resolved against the
  working directory and adds to the file's list instead of replacing it (source `flag` then).
  Every entry must be an existing directory. The node puts them first on its own `sys.path`
  and on its workers' `PYTHONPATH` (`flyd.launch.spawner`).
- `[node] metrics` (`--metrics`, `flyd serve` only): `HOST:PORT`, `[IPV6]:PORT` or a bare
  `PORT`, which listens on 127.0.0.1; absent, no metrics are served (docs/operations.md).
- `[node] log_level`'s default follows the effective `log_format`: `warning` for the console
  renderer, `info` for JSON lines (`flyd.logs.default_level`), so `flyd config show` prints the
  level a command would use.
"""

from __future__ import annotations

import math
import os
import re
import socket as socketlib
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from bus.limits import LimitError, Limits, snake_case
from bus.policy import Policy, PolicyError
from bus.router import SUN_PATH_MAX, RouterConfig
from bus.store import DEFAULT_ROOT, StoreSettings
from flyd.durations import (
    DURATION_RULE,
    MAX_DURATION_MS,
    MAX_KEEPALIVE_COUNT,
    MAX_KEEPALIVE_S,
    is_duration_s,
)
from flyd.errors import ConfigError
from flyd.launch.health import HealthPolicy
from flyd.launch.spawner import LauncherSettings
from flyd.logs import LogFlags, LogSettings, default_level
from flyd.node.metrics_http import MetricsAddress, MetricsAddressError
from flyd.pgtext import bad_strings, text_problem
from workers.launch import DEFAULT_MEDIA_INLINE_MAX_BYTES, MAX_MEDIA_INLINE_MAX_BYTES

if TYPE_CHECKING:
    from flyd.leases.params import LeaseParams
    from flyd.leases.stores.pg import DbSettings
    from flyd.session.calls import Deadlines
    from flyd.state.writer import CheckpointSettings

KNOWN_SECTIONS: Final = ("node", "bus", "database", "leases", "session", "checkpoints",
                         "plugins")
BUS_KEYS: Final = ("socket", "socket_group", "allowed_uids", "limits", "policy", "store")
STORE_KEYS: Final = ("enabled", "root")
SYSTEM_CONFIG: Final = Path("/etc/flyd/flyd.toml")
NODE_NAME_RE: Final = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")
REDACTED: Final = "***"

Source = Literal["default", "file", "env", "flag"]


def default_socket(node_name: str | None = None) -> str:
    """design/cli.md §2.2: systemd's runtime dir, XDG runtime dir, /run for root, else /tmp."""
    return _default_socket(os.environ, node_name)


def _default_socket(env: Mapping[str, str], node_name: str | None) -> str:
    sub = (node_name,) if node_name else ()
    if env.get("RUNTIME_DIRECTORY"):
        return os.path.join(env["RUNTIME_DIRECTORY"], "bus.sock")
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "flyd", *sub, "bus.sock")
    if os.geteuid() == 0:
        return os.path.join("/run/flyd", *sub, "bus.sock")
    return os.path.join(f"/tmp/flyd-{os.geteuid()}", *sub, "bus.sock")


def _default_state_dir(env: Mapping[str, str], node_name: str | None) -> str:
    """design/cli.md §2.2: systemd's state dir, /var/lib/flyd for root, else the XDG state home."""
    sub = (node_name,) if node_name else ()
    if env.get("STATE_DIRECTORY"):
        return env["STATE_DIRECTORY"]
    if os.geteuid() == 0:
        return os.path.join("/var/lib/flyd", *sub)
    home = env.get("XDG_STATE_HOME") or os.path.join(
        env.get("HOME") or os.path.expanduser("~"), ".local", "state")
    return os.path.join(home, "flyd", *sub)


def host_node_name() -> str:
    """The host name, lower-cased, other characters than `[a-z0-9-]` mapped to `-`, leading
    `-` dropped, truncated to 32; empty gives `node` (design/cli.md §2.2)."""
    name = re.sub(r"[^a-z0-9-]", "-", socketlib.gethostname().lower()).lstrip("-")[:32]
    return name or "node"


def validate_node_name(name: object, where: str = "--node-name") -> str:
    """Refuse a node name outside `[a-z0-9][a-z0-9-]{0,31}` (exit 2)."""
    if not isinstance(name, str) or NODE_NAME_RE.fullmatch(name) is None:
        raise ConfigError(f"{where}: [node] name {name!r} is not a node name "
                          "([a-z0-9][a-z0-9-]{0,31})")
    return name


def load_toml(path: Path) -> dict[str, Any]:
    """The file's tables; a file that cannot be read, is not UTF-8 or not TOML, or holds a
    string PostgreSQL text cannot (`flyd.pgtext`) is a `ConfigError` naming it."""
    try:
        with path.open("rb") as fh:
            raw = fh.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: byte {raw[exc.start]:#04x} at offset "
                          f"{exc.start}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    for pointer, problem in bad_strings(data):
        section, _, rest = pointer.lstrip("/").partition("/")
        raise ConfigError(f"{path}: [{section}] {rest.replace('/', '.')}: {problem}")
    for section in data:
        if section not in KNOWN_SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]")
    return data


def router_config(config_file: Path | None, socket_path: str | None,
                  open_policy: bool = False, node_pid: int | None = None) -> RouterConfig:
    """Build the router's configuration: defaults < file < flags.

    The router reads only `[bus]`, but the file is checked whole, as every other command checks
    it (design/cli.md §2.1): a typo in another section stops the router too instead of being
    ignored. A socket path over sun_path names where it came from (flag, environment or file)."""
    bus: Mapping[str, Any] = {}
    where = str(config_file) if config_file else "defaults"
    if config_file is not None:
        data = load_toml(config_file)
        for section, table in data.items():
            if section == "bus":
                continue
            if not isinstance(table, Mapping):
                raise ConfigError(f"{where}: [{section}] must be a table")
            for key, value in table.items():
                if key not in KEYS[section]:
                    raise ConfigError(f"{where}: unknown key [{section}] {key}")
                _check(section, key, value, where)
        bus = data.get("bus", {})
        if not isinstance(bus, Mapping):
            raise ConfigError(f"{where}: [bus] must be a table")
        for key in bus:
            if key not in BUS_KEYS:
                raise ConfigError(f"{where}: unknown key [bus] {key}")
    socket = socket_path or os.environ.get("FLYD_SOCKET") or bus.get("socket") or default_socket()
    if not isinstance(socket, str) or len(os.fsencode(socket)) > SUN_PATH_MAX:
        source = ("flag --socket" if socket_path else
                  "environment FLYD_SOCKET" if os.environ.get("FLYD_SOCKET") else where)
        raise ConfigError(f"{source}: [bus] socket must be a path of at most {SUN_PATH_MAX} "
                          f"bytes")
    group = bus.get("socket_group")
    if group is not None and not isinstance(group, str):
        raise ConfigError(f"{where}: [bus] socket_group must be a string")
    uids = bus.get("allowed_uids")
    if uids is not None and (not isinstance(uids, list)
                             or not all(isinstance(u, int) and u >= 0 for u in uids)):
        raise ConfigError(f"{where}: [bus] allowed_uids must be a list of uids")
    try:
        limits = Limits.from_config(dict(bus.get("limits", {})))
    except LimitError as exc:
        raise ConfigError(f"{where}: [bus.limits] {exc}") from exc
    try:
        if open_policy:
            policy = Policy.open()
        elif "policy" in bus:
            policy = Policy.from_config(bus["policy"])
        else:
            policy = Policy.default(node_pid)
    except PolicyError as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    if group is not None:
        _check_group(where, group)
    store = store_settings(bus.get("store"), where)
    return RouterConfig(socket_path=socket, limits=limits, policy=policy, socket_group=group,
                        allowed_uids=tuple(uids) if uids is not None else None, store=store)


def store_settings(table: object, where: str) -> StoreSettings:
    """`[bus.store]` as typed settings (topics.md §5.1); a bad key names itself."""
    if table is None:
        return StoreSettings()
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: [bus.store] must be a table")
    for key in table:
        if key not in STORE_KEYS:
            raise ConfigError(f"{where}: unknown key [bus.store] {key}")
    enabled = table.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ConfigError(f"{where}: [bus.store] enabled must be true or false")
    root = table.get("root", DEFAULT_ROOT)
    if not isinstance(root, str) or not os.path.isabs(root):
        raise ConfigError(f"{where}: [bus.store] root must be an absolute path")
    return StoreSettings(enabled=enabled, root=root)


def _check_group(where: str, group: str) -> None:
    import grp

    try:
        grp.getgrnam(group)
    except KeyError:
        raise ConfigError(f"{where}: [bus] socket_group {group!r} is not a group") from None


# -- the key table (design/cli.md §2.3) ------------------------------------------------------------

Kind = Literal["str", "int", "number", "bool", "path", "choice", "uids", "table", "dsn",
               "dirs"]


@dataclass(frozen=True, slots=True)
class Key:
    """One key of design/cli.md §2.3: its type, default (None: absent or derived), range and
    overrides."""

    kind: Kind
    default: Any = None
    check: Callable[[Any], bool] | None = None
    rule: str = ""
    env: str | None = None
    flag: str | None = None
    choices: tuple[str, ...] = ()


def _int(default: int | None, lo: int, hi: int | None = None, *, flag: str | None = None) -> Key:
    rule = f"{lo}..{hi}" if hi is not None else f"≥ {lo}"
    return Key("int", default, lambda v: lo <= v and (hi is None or v <= hi), rule, flag=flag)


def _ms(default: int, lo: int = 1) -> Key:
    """A duration in integer milliseconds (`flyd.durations`)."""
    return _int(default, lo, MAX_DURATION_MS)


def _num(default: float | None, *, env: str | None = None, flag: str | None = None) -> Key:
    """A duration in seconds > 0 (`flyd.durations`)."""
    return Key("number", default, is_duration_s, f"> 0 and {DURATION_RULE}", env=env, flag=flag)


def _nonneg_num(default: float) -> Key:
    """A duration in seconds ≥ 0 (`flyd.durations`)."""
    return Key("number", default, lambda v: is_duration_s(v, zero=True),
               f"≥ 0 and {DURATION_RULE}")


def _choice(default: str | None, *choices: str, env: str | None = None,
            flag: str | None = None) -> Key:
    return Key("choice", default, None, " | ".join(repr(c) for c in choices), env=env, flag=flag,
               choices=choices)


def _is_metrics_address(text: str) -> bool:
    try:
        MetricsAddress.parse(text)
    except MetricsAddressError:
        return False
    return True


KEYS: Final[dict[str, dict[str, Key]]] = {
    "node": {
        "name": Key("str", None, lambda v: NODE_NAME_RE.fullmatch(v) is not None,
                    "[a-z0-9][a-z0-9-]{0,31}", env="FLYD_NODE_NAME", flag="--node-name"),
        "capacity": _int(None, 1, 64, flag="--capacity"),
        "threads": Key("int", None, lambda v: v >= 1, "≥ coordinator_reservation + 3"),
        "coordinator_reservation": _int(1, 1, 16),
        "state_dir": Key("path", None, env="FLYD_STATE_DIR", flag="--state-dir"),
        "router": Key("bool", True, flag="--router/--no-router"),
        "log_format": _choice(None, "json", "console", env="FLYD_LOG_FORMAT",
                              flag="--log-format"),
        "log_level": _choice("info", "debug", "info", "warning", "error", env="FLYD_LOG_LEVEL",
                             flag="-v/-q"),
        "metrics": Key("str", None, _is_metrics_address, "HOST:PORT, [IPV6]:PORT or PORT "
                       "(0..65535; a bare port is on 127.0.0.1)", flag="--metrics"),
    },
    "bus": {
        "socket": Key("path", None, lambda v: len(os.fsencode(v)) <= SUN_PATH_MAX,
                      f"at most {SUN_PATH_MAX} bytes", env="FLYD_SOCKET", flag="--socket"),
        "socket_group": Key("str", None, rule="an existing group"),
        "allowed_uids": Key("uids", None, rule="a list of uids"),
        "limits": Key("table", None, rule="design/wire.md §14.1"),
        "policy": Key("table", None, rule="design/wire.md §12"),
        "store": Key("table", None, rule="topics.md §5.1: enabled (bool), root (path)"),
    },
    "database": {
        "dsn": Key("dsn", None, rule="libpq conninfo or URI", env="FLYD_DSN", flag="--dsn"),
        "statement_timeout_ms": _ms(2000),
        "idle_in_transaction_timeout_ms": _ms(1500),
        "lock_timeout_ms": _ms(1000),
        "connect_timeout_s": Key("int", 2, lambda v: v == 0 or 2 <= v <= MAX_DURATION_MS // 1000,
                                 f"0 (unset) or 2..{MAX_DURATION_MS // 1000}"),
        "keepalives": _int(1, 0, 1),
        "keepalives_idle_s": _int(5, 1, MAX_KEEPALIVE_S),
        "keepalives_interval_s": _int(1, 1, MAX_KEEPALIVE_S),
        "keepalives_count": _int(3, 1, MAX_KEEPALIVE_COUNT),
        "tcp_user_timeout_ms": _ms(4000, 0),
        "server_keepalives_idle_s": _int(5, 1, MAX_KEEPALIVE_S),
        "server_keepalives_interval_s": _int(1, 1, MAX_KEEPALIVE_S),
        "server_keepalives_count": _int(3, 1, MAX_KEEPALIVE_COUNT),
        "server_tcp_user_timeout_ms": _ms(4000, 0),
        "client_connection_check_interval_ms": _ms(1000, 0),
    },
    "leases": {
        "ttl_s": _num(15.0, env="FLYD_LEASE_TTL", flag="--lease-ttl"),
        "heartbeat_interval_s": _num(None),
        "renew_timeout_s": _num(2.0),
        "clock_rate_bound": Key("number", 0.1, lambda v: 0 <= v < 0.5, "[0, 0.5)"),
        "safety_margin_s": _num(3.5),
        "commit_timeout_s": _num(2.0),
        "commit_budget_s": _num(3.0),
        "watchdog_tick_s": _num(0.25),
        "kill_bound_s": _num(0.5),
        "claim_poll_s": _num(1.0),
        "claim_batch": _int(4, 1, 100),
        "reap_interval_s": _num(5.0),
        "drain_timeout_s": _num(20.0),
        "node_stale_after_s": _num(9.0),
        "max_attempts": _int(3, 1, 100, flag="--max-attempts"),
    },
    "session": {
        "mode": _choice("process", "process", "thread", "in-process", flag="--mode"),
        "dispatch": _choice("concurrent", "concurrent", "sequential", "reversed",
                            flag="--dispatch"),
        "pacing": _choice("off", "off", "realtime", flag="--pace/--no-pace"),
        "max_agents": _int(4, 1, 256),
        "launcher": _choice("fork", "fork", "spawn"),
        "launch_concurrency": _int(8, 1, 256),
        "agents_per_process": _int(1, 1, 256),
        "media_inline_max_bytes": _int(DEFAULT_MEDIA_INLINE_MAX_BYTES, 0,
                                       MAX_MEDIA_INLINE_MAX_BYTES),
        "probe_s": _num(2.0),
        "resolve_s": _num(8.0),
        "resolve_attempts": _int(8192, 1, 2**32 - 1),
        "boot_s": _num(30.0),
        "capture_s": _num(30.0),
        "health_probe_s": _num(2.0),
        "health_fail_s": _num(10.0),
        "health_boot_s": _num(30.0),
    },
    "checkpoints": {
        "every_steps": _int(60, 0, flag="--checkpoint-every"),
        "every_seconds": _nonneg_num(0.0),
        "keep_generations": _int(3, 1, 100),
        "queue_capacity": _int(2, 1, 16),
        "max_queued_bytes": _int(67108864, 2**20, 2**30),
        "retry": _choice("release", "release", "retry"),
        "retry_attempts": _int(3, 1, 10),
        "retry_backoff_s": _num(0.2),
        "durable_timeout_s": _num(60.0),
        "recovery_max_attempts": _int(3, 1, 100),
        "recovery_backoff_s": _num(1.0),
        "recovery_backoff_max_s": _num(30.0),
        "max_pending_effects": _int(None, 1),
        "max_pending_effect_bytes": _int(16777216, 2**20),
        "max_envelope_bytes": _int(67108864, 2**20, 2**30 - 1),
    },
    "plugins": {
        "paths": Key("dirs", (), rule="a list of directories", flag="--plugin-path"),
    },
}


@dataclass(frozen=True, slots=True)
class Setting:
    """A configuration value and the level it came from."""

    value: Any
    source: Source


def _typed(kind: Kind, value: Any, key: Key) -> tuple[bool, Any]:
    """(ok, normalised value) for the key's type; numbers become floats."""
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool), value
    if kind == "number":
        try:
            ok = (isinstance(value, int | float) and not isinstance(value, bool)
                  and math.isfinite(value))
        except OverflowError:  # a TOML integer beyond any float
            ok = False
        return ok, float(value) if ok else value
    if kind == "bool":
        return isinstance(value, bool), value
    if kind in ("str", "path", "dsn"):
        return isinstance(value, str) and value != "", value
    if kind == "choice":
        return isinstance(value, str) and value in key.choices, value
    if kind == "uids":
        ok = isinstance(value, list) and all(
            isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in value)
        return ok, value
    if kind == "dirs":
        return isinstance(value, list) and all(isinstance(d, str) and d for d in value), value
    return isinstance(value, Mapping), value


_KIND_TEXT: Final[dict[Kind, str]] = {
    "int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
    "path": "a path", "dsn": "a libpq conninfo or URI", "uids": "a list of uids",
    "table": "a table", "choice": "one of", "dirs": "a list of directories",
}


def _parse_text(kind: Kind, text: str) -> Any:
    """Environment values (and string flags) in the key's type; unparsable text stays text."""
    try:
        if kind == "int":
            return int(text)
        if kind == "number":
            return float(text)
    except ValueError:
        return text
    if kind == "bool" and text.lower() in ("true", "false", "1", "0", "yes", "no"):
        return text.lower() in ("true", "1", "yes")
    return text


def _check(section: str, name: str, value: Any, where: str) -> Any:
    key = KEYS[section][name]
    ok, value = _typed(key.kind, value, key)
    if not ok:
        expected = _KIND_TEXT[key.kind]
        if key.kind == "choice":
            expected += f" {key.rule}"
        raise ConfigError(f"{where}: [{section}] {name} must be {expected}; got {value!r}")
    for text in (value if key.kind == "dirs" else [value]):
        problem = text_problem(text) if isinstance(text, str) else None
        if problem is not None:
            raise ConfigError(f"{where}: [{section}] {name} {problem}")
    if key.kind == "dsn":
        _check_dsn(value, where)
    if key.check is not None and not key.check(value):
        raise ConfigError(f"{where}: [{section}] {name} = {value!r} is out of range "
                          f"({key.rule})")
    return value


def _directories(paths: list[str], base: Path, where: str, section: str, name: str) -> list[str]:
    """Import roots as absolute paths: a relative one is resolved against `base` (the config
    file's directory, or the working directory for a flag); each must be a directory."""
    out: list[str] = []
    for text in paths:
        path = Path(text).expanduser()
        path = (path if path.is_absolute() else base / path).resolve()
        if not path.is_dir():
            raise ConfigError(f"{where}: [{section}] {name}: {text!r} is not a directory"
                              + (f" ({path})" if str(path) != text else ""))
        out.append(str(path))
    return out


def _check_dsn(dsn: str, where: str) -> None:
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict

    try:
        conninfo_to_dict(dsn)
    except ProgrammingError as exc:
        raise ConfigError(f"{where}: [database] dsn is not a libpq conninfo or URI: "
                          f"{redact_dsn_text(str(exc), dsn)}") from None


def redact_dsn(dsn: str) -> str:
    """The DSN with its password (URI user info, `password=` parameter) replaced by `***`."""
    if re.match(r"^postgres(ql)?://", dsn):
        parts = urlsplit(dsn)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            if ":" in userinfo:
                netloc = f"{userinfo.split(':', 1)[0]}:{REDACTED}@{host}"
        query = parts.query
        if query:
            pairs = [(k, REDACTED if k == "password" else v)
                     for k, v in parse_qsl(query, keep_blank_values=True)]
            query = urlencode(pairs, safe="*/")
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    from psycopg import ProgrammingError
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    try:
        params = conninfo_to_dict(dsn)
    except ProgrammingError:
        return REDACTED
    if "password" in params:
        params["password"] = REDACTED
        return make_conninfo("", **params)
    return dsn


def redact_dsn_text(text: str, dsn: str) -> str:
    """`text` without the DSN's password, for error messages that may quote it."""
    m = re.search(r"password\s*=\s*'?([^\s']+)|//[^:/@]*:([^@]+)@", dsn)
    secret = m.group(1) or m.group(2) if m else None
    return text.replace(secret, REDACTED) if secret else text


def resolve_config_file(config_file: Path | None, env: Mapping[str, str]) -> Path | None:
    """`--config`, else `FLYD_CONFIG`, else /etc/flyd/flyd.toml if it exists, else none."""
    if config_file is not None:
        return config_file
    if env.get("FLYD_CONFIG"):
        return Path(env["FLYD_CONFIG"])
    return SYSTEM_CONFIG if SYSTEM_CONFIG.is_file() else None


@dataclass(frozen=True, slots=True)
class NodeSettings:
    """`[node]`, typed; `log_format` and `log_level` are `Config.log_settings`, which `-v` and
    `-q` shift."""

    name: str
    capacity: int
    threads: int
    coordinator_reservation: int
    state_dir: Path
    router: bool
    #: where `flyd serve` serves its metrics (docs/operations.md); None: not served
    metrics: MetricsAddress | None


@dataclass(frozen=True, slots=True)
class BusSettings:
    """`[bus]`, typed: the socket, where its path came from, and what the node's router child
    is configured with (`flyd.node.router_child`)."""

    socket: str
    #: where the socket path came from, as errors name it: `flag --socket`, `environment
    #: FLYD_SOCKET`, the config file's path, or `default`
    socket_origin: str
    socket_group: str | None
    #: the gid of `socket_group` (checked to exist at load): the group that may share the
    #: socket's directory (design/wire.md §13, `bus.ownership`)
    socket_gid: int | None
    allowed_uids: tuple[int, ...]
    limits: Limits
    #: `[bus.policy]`; None: the default policy (`Policy.default`), with the node's pid
    policy: Policy | None
    store: StoreSettings

    @property
    def socket_given(self) -> bool:
        """The path was named (flag, environment or file): design/cli.md §4.1 uses it as given."""
        return self.socket_origin != "default"


@dataclass(frozen=True, slots=True)
class DatabaseSettings:
    """`[database]`, typed: the DSN (None: the node's embedded PostgreSQL)
    and the settings of every connection the node opens."""

    dsn: str | None
    connection: DbSettings


@dataclass(frozen=True, slots=True)
class SessionSettings:
    """`[session]`, typed: the defaults of the run specs this host builds (`mode`, `dispatch`,
    `pacing`), the bound on agents, how workers are launched (`[plugins] paths` included) and
    watched, and the coordinator's deadlines (`[checkpoints] durable_timeout_s` among them)."""

    mode: Literal["process", "thread", "in-process"]
    dispatch: Literal["concurrent", "sequential", "reversed"]
    #: `pacing = "realtime"`
    realtime: bool
    max_agents: int
    launcher: LauncherSettings
    health: HealthPolicy
    deadlines: Deadlines


@dataclass(frozen=True, slots=True)
class Settings:
    """The effective configuration, typed: built once by `load_config`, read where the node is
    assembled (`flyd.cli`, `flyd.node.process`) and handed down as these values."""

    node: NodeSettings
    bus: BusSettings
    database: DatabaseSettings
    #: `[leases]` and the three `[database]` keys the lease invariant reads, validated together
    leases: LeaseParams
    session: SessionSettings
    #: the node's `[checkpoints]`; `max_pending_effects` None unless configured (its derived
    #: default follows a run spec's own `every_steps`)
    checkpoints: CheckpointSettings


class Config:
    """The effective configuration: every key of design/cli.md §2.3 with its value and source (for
    `flyd config show` and error messages), and the same values typed (`settings`)."""

    def __init__(self, table: dict[str, dict[str, Setting]], config_file: Path | None,
                 leases: LeaseParams) -> None:
        self._settings = table
        self.config_file = config_file
        self.settings = _typed_settings(self, leases)

    def setting(self, section: str, key: str) -> Setting:
        try:
            return self._settings[section][key]
        except KeyError:
            raise KeyError(f"no configuration key [{section}] {key}") from None

    def value(self, section: str, key: str) -> Any:
        return self.setting(section, key).value

    def origin(self, section: str, key: str) -> str:
        """Where a value came from, as error messages name it: `flag --socket`, `environment
        FLYD_SOCKET`, the config file's path, or `default`."""
        spec, source = KEYS[section][key], self.source(section, key)
        if source == "flag":
            return f"flag {spec.flag or f'{section}.{key}'}"
        if source == "env":
            return f"environment {spec.env}"
        if source == "file":
            return str(self.config_file)
        return "default"

    def source(self, section: str, key: str) -> Source:
        return self.setting(section, key).source

    def log_settings(self, flags: LogFlags) -> LogSettings:
        """The process's logging: `[node] log_format` and `log_level` as resolved here (flag >
        environment > file > default), `-v` / `-q` shifting the level (`flyd.logs`)."""
        level = self.setting("node", "log_level")
        return LogSettings.resolve(self.value("node", "log_format"), level.value,
                                   level.source != "default", flags)

    def show(self) -> dict[str, dict[str, Any]]:
        """`section.key` → `{"value", "source"}` for every key, the DSN password redacted."""
        out: dict[str, dict[str, Any]] = {}
        bus = self.settings.bus
        for section, keys in self._settings.items():
            for key, s in keys.items():
                if (section, key) == ("bus", "limits"):
                    given = s.value or {}
                    for f in fields(Limits):
                        name = snake_case(f.name)
                        out[f"bus.limits.{name}"] = {
                            "value": getattr(bus.limits, f.name),
                            "source": s.source if name in given else "default"}
                    continue
                if (section, key) == ("bus", "store"):
                    given = s.value or {}
                    for name in STORE_KEYS:
                        out[f"bus.store.{name}"] = {
                            "value": getattr(bus.store, name),
                            "source": s.source if name in given else "default"}
                    continue
                value = s.value
                if (section, key) == ("bus", "policy") and value is None:
                    value = "default"
                elif (section, key) == ("database", "dsn") and value is not None:
                    value = redact_dsn(value)
                out[f"{section}.{key}"] = {"value": value, "source": s.source}
        return out


def _typed_settings(config: Config, leases: LeaseParams) -> Settings:
    """Every section as its typed settings; the values are checked already, so nothing here
    refuses."""
    import grp

    from flyd.leases.stores.pg import DbSettings
    from flyd.session.calls import Deadlines
    from flyd.state.writer import CheckpointSettings

    def section(name: str) -> dict[str, Any]:
        return {key: config.value(name, key) for key in KEYS[name]}

    node, bus, session = section("node"), section("bus"), section("session")
    database, checkpoints = section("database"), section("checkpoints")
    if config.source("checkpoints", "max_pending_effects") == "default":
        checkpoints["max_pending_effects"] = None
    group = bus["socket_group"]
    metrics = node["metrics"]
    return Settings(
        node=NodeSettings(
            name=node["name"], capacity=node["capacity"], threads=node["threads"],
            coordinator_reservation=node["coordinator_reservation"],
            state_dir=Path(node["state_dir"]), router=node["router"],
            metrics=None if metrics is None else MetricsAddress.parse(metrics)),
        bus=BusSettings(
            socket=bus["socket"], socket_origin=config.origin("bus", "socket"),
            socket_group=group, socket_gid=None if group is None else grp.getgrnam(group).gr_gid,
            allowed_uids=tuple(bus["allowed_uids"]),
            limits=Limits.from_config(dict(bus["limits"] or {})),
            policy=None if bus["policy"] is None else Policy.from_config(bus["policy"]),
            store=store_settings(bus["store"], config.origin("bus", "store"))),
        database=DatabaseSettings(
            dsn=database.pop("dsn"), connection=DbSettings(**database)),
        leases=leases,
        session=SessionSettings(
            mode=session["mode"], dispatch=session["dispatch"],
            realtime=session["pacing"] == "realtime", max_agents=session["max_agents"],
            launcher=LauncherSettings(
                method=session["launcher"], concurrency=session["launch_concurrency"],
                plugin_paths=tuple(config.value("plugins", "paths")),
                media_inline_max_bytes=session["media_inline_max_bytes"],
                agents_per_process=session["agents_per_process"]),
            health=HealthPolicy(probe=session["health_probe_s"], fail=session["health_fail_s"],
                                boot=session["health_boot_s"]),
            deadlines=Deadlines(
                probe=session["probe_s"], resolve=session["resolve_s"],
                resolve_attempts=session["resolve_attempts"], boot=session["boot_s"],
                capture=session["capture_s"], durable=checkpoints["durable_timeout_s"])),
        checkpoints=CheckpointSettings(**checkpoints))


def load_config(config_file: Path | None = None, flags: Mapping[str, Any] | None = None,
                env: Mapping[str, str] | None = None) -> Config:
    """Resolve every key: defaults < file < environment < flags (`flags` keys are
    `"section.key"`; a None value means the flag was not given)."""
    env = os.environ if env is None else env
    path = resolve_config_file(config_file, env)
    given: dict[str, dict[str, Setting]] = {s: {} for s in KNOWN_SECTIONS}
    where: dict[tuple[str, str], str] = {}
    if path is not None:
        for section, table in load_toml(path).items():
            if not isinstance(table, Mapping):
                raise ConfigError(f"{path}: [{section}] must be a table")
            for key, value in table.items():
                if key not in KEYS[section]:
                    raise ConfigError(f"{path}: unknown key [{section}] {key}")
                where[section, key] = str(path)
                value = _check(section, key, value, str(path))
                if KEYS[section][key].kind == "dirs":
                    value = _directories(value, path.parent, str(path), section, key)
                given[section][key] = Setting(value, "file")
    for section, keys in KEYS.items():
        for key, spec in keys.items():
            if spec.env is not None and env.get(spec.env) not in (None, ""):
                text = env[spec.env]
                here = f"environment {spec.env}"
                where[section, key] = here
                given[section][key] = Setting(
                    _check(section, key, _parse_text(spec.kind, text), here), "env")
    for dotted, value in (flags or {}).items():
        if value is None:
            continue
        section, _, key = dotted.partition(".")
        if key not in KEYS.get(section, {}):
            raise ConfigError(f"flags: unknown key [{section}] {key}")
        spec = KEYS[section][key]
        here = f"flag {spec.flag or dotted}"
        if isinstance(value, Path):
            value = str(value)
        if isinstance(value, str) and spec.kind in ("int", "number", "bool"):
            value = _parse_text(spec.kind, value)
        if spec.kind == "dirs":  # a flag adds to the file's list
            if not value:
                continue
            value = [*(given[section][key].value if key in given[section] else []),
                     *_directories([str(v) for v in value], Path.cwd(), here, section, key)]
            where[section, key] = here
            given[section][key] = Setting(value, "flag")
            continue
        where[section, key] = here
        given[section][key] = Setting(_check(section, key, value, here), "flag")
    settings = _with_defaults(given, env)
    _check_related(settings, where)
    leases = _lease_params(settings, where)
    return Config(settings, path, leases)


def _with_defaults(given: dict[str, dict[str, Setting]],
                   env: Mapping[str, str]) -> dict[str, dict[str, Setting]]:
    """Every key: the given setting, else its (possibly machine-dependent) default."""
    from flyd.launch.budget import cpus

    def default(section: str, key: str, value: Any) -> Setting:
        return given[section].get(key) or Setting(value, "default")

    node = given["node"]
    explicit_name = node["name"].value if "name" in node else None
    n_cpus = cpus()
    capacity = default("node", "capacity", max(1, n_cpus // 4))
    every_steps = default("checkpoints", "every_steps", 60)
    ttl = default("leases", "ttl_s", 15.0)
    log_format = default("node", "log_format", "console" if sys.stderr.isatty() else "json")
    derived: dict[tuple[str, str], Any] = {
        ("node", "name"): explicit_name or host_node_name(),
        ("node", "capacity"): capacity.value,
        ("node", "threads"): max(n_cpus, 4 * capacity.value),
        ("node", "state_dir"): _default_state_dir(env, explicit_name),
        ("node", "log_format"): log_format.value,
        ("node", "log_level"): default_level(log_format.value),
        ("bus", "socket"): _default_socket(env, explicit_name),
        ("bus", "allowed_uids"): [os.geteuid()],
        ("leases", "heartbeat_interval_s"): ttl.value / 5,
        ("checkpoints", "max_pending_effects"): 4 * every_steps.value or 4096,
    }
    out: dict[str, dict[str, Setting]] = {}
    for section, keys in KEYS.items():
        out[section] = {}
        for key, spec in keys.items():
            value = derived.get((section, key), spec.default)
            out[section][key] = default(section, key, value)
    return out


def _check_related(settings: dict[str, dict[str, Setting]],
                   where: Mapping[tuple[str, str], str]) -> None:
    """Checks across keys: the thread budget and the router's `[bus]` tables."""
    threads = settings["node"]["threads"].value
    reservation = settings["node"]["coordinator_reservation"].value
    if threads < reservation + 3:
        here = where.get(("node", "threads")) or where.get(("node", "coordinator_reservation"))
        raise ConfigError(f"{here or 'defaults'}: [node] threads = {threads} must be ≥ "
                          f"coordinator_reservation + 3 = {reservation + 3}")
    bus = settings["bus"]
    try:
        Limits.from_config(dict(bus["limits"].value or {}))
    except LimitError as exc:
        raise ConfigError(f"{where.get(('bus', 'limits'))}: [bus.limits] {exc}") from exc
    if bus["policy"].value is not None:
        try:
            Policy.from_config(bus["policy"].value)
        except PolicyError as exc:
            raise ConfigError(f"{where.get(('bus', 'policy'))}: {exc}") from exc
    if bus["socket_group"].value is not None:
        _check_group(where[("bus", "socket_group")], bus["socket_group"].value)
    store_settings(bus["store"].value, where.get(("bus", "store")) or "defaults")


def _lease_params(settings: dict[str, dict[str, Setting]],
                  where: Mapping[tuple[str, str], str]) -> LeaseParams:
    """LeaseParams from the effective values; a violated design/distribution.md §4.3 clause names
    what was set."""
    from flyd.leases.params import DATABASE_KEYS, LeaseParams, LeaseParamsError

    values = {k: s.value for k, s in settings["leases"].items()
              if not (k == "heartbeat_interval_s" and s.source == "default")}
    values.update((k, settings["database"][k].value) for k in DATABASE_KEYS)
    try:
        return LeaseParams.of(values)
    except LeaseParamsError as exc:
        chosen = [(f"[{sec}] {k} = {s.value!r}", where[sec, k])
                  for sec in ("leases", "database") for k, s in settings[sec].items()
                  if s.source != "default" and k != "dsn"]
        places = sorted({w for _, w in chosen}) or ["defaults"]
        keys = ", ".join(k for k, _ in chosen) or "defaults"
        raise ConfigError(f"{'; '.join(places)}: {keys}: {exc}") from exc
